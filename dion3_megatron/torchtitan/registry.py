"""``"Dion3"`` among the optimizer names of torchtitan's ``OptimizersContainer``.

torchtitan 0.3 resolves a param-group config's ``optimizer_name`` in
``OptimizersContainer._resolve_optimizer_factory``, a fixed table (Adam, AdamW, DistMuon):
:func:`register` puts a resolver in its place that answers ``"Dion3"`` with :func:`build_dion3`
and every other name as torchtitan does (:data:`TORCHTITAN`, applied through
:mod:`dion3_megatron.compat`); :func:`unregister` puts torchtitan's back.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from torchtitan.components.optimizer import OptimizersContainer

from .. import compat, options
from ..frontend.lifecycle import RECORD
from ..optimizer import Dion3

NAME = "Dion3"
"""The optimizer name of Dion3 in torchtitan's config (``optimizer_name="Dion3"``)."""

# Keys torchtitan adds to every param group besides the config's optimizer_kwargs: the parameters'
# names (kept: checkpoints key state by them), and its `implementation` choice of torch's Adam
# kernels (dropped: Dion3 chooses its kernels with its own `kernels` option).
_NAMES = "param_names"
_IMPLEMENTATION = ("fused", "foreach")


def resolver_with_dion3(resolve: Callable[[str], Callable]) -> staticmethod:
    """torchtitan's resolver ``resolve``, answering :data:`NAME` with :func:`build_dion3`."""

    @functools.wraps(resolve)
    def resolve_with_dion3(name: str) -> Callable:
        return build_dion3 if name == NAME else resolve(name)

    setattr(resolve_with_dion3, compat.MARK, True)
    return staticmethod(resolve_with_dion3)


# Every attribute of torchtitan that register() replaces; the fields: dion3_megatron.compat.
TORCHTITAN: tuple[compat.Patch, ...] = (
    compat.Patch(
        "torchtitan.components.optimizer.optimizer:OptimizersContainer._resolve_optimizer_factory",
        resolver_with_dion3,
        'the optimizer_name "Dion3" of a ParamGroupConfig builds dion3_megatron.Dion3 (build_dion3); the other names '
        "resolve as in torchtitan",
        "torchtitan 0.3.x (read in 0.3.0)",
    ),
)


def register() -> None:
    """Make ``optimizer_name="Dion3"`` work in torchtitan's optimizer config: apply
    ``TORCHTITAN``. Idempotent; ``UpstreamChanged`` (``dion3_megatron.compat``) where
    torchtitan no longer has the resolver."""
    compat.apply(TORCHTITAN)


def unregister() -> None:
    """Restore torchtitan's own resolver (nothing to do when Dion3 is not registered)."""
    compat.restore(TORCHTITAN)


def is_registered() -> bool:
    """Whether torchtitan resolves ``optimizer_name="Dion3"``: [`register`][dion3_megatron.torchtitan.register]
    has run, and [`unregister`][dion3_megatron.torchtitan.unregister] not since."""
    return compat.is_patched(OptimizersContainer._resolve_optimizer_factory)


def build_dion3(params: list[dict[str, Any]], **settings: Any) -> Dion3:
    """The Dion3 of the param groups torchtitan matched to ``"Dion3"`` (``settings``: the
    config's ``optimizer_factory_kwargs_by_name["Dion3"]``, Dion3's options that are one value per
    optimizer: ``kernels``, ``cuda_graph``, ``adamw_lr``).

    A group's ``optimizer_kwargs`` are Dion3's per-group options (and ``algorithm``), their names
    checked here on every rank alike before anything is built, naming the group by its first
    parameter: an unknown name is an ``UnknownOptionError`` (``dion3_megatron.options``) with the
    closest option, an option that is one value per optimizer a ValueError saying where it goes;
    ``Dion3`` checks the values as it takes the groups.

    Each parameter of a Dion3-rule group becomes a param group of its own, carrying the record of
    the automatic f (``RECORD`` of ``dion3_megatron.frontend.lifecycle``, filled by ``state_dict()``):
    torchtitan's checkpoint copies every group's settings under each of its parameters' names, so a
    record of a whole group would be copied once per matrix, and it loads only the keys a live
    group has. An ``algorithm="adamw"`` group stays whole (its record is empty; its tensors step in
    one multi-tensor AdamW call).
    """
    groups: list[dict[str, Any]] = []
    for index, group in enumerate(params):
        names = group.get(_NAMES)
        if not names or len(names) != len(group["params"]):
            raise ValueError(
                f"{NAME} param group {index}: torchtitan's groups name their parameters ({_NAMES!r}); "
                f"got {names!r} for {len(group['params'])} parameters"
            )
        given = {k: v for k, v in group.items() if k not in ("params", _NAMES, *_IMPLEMENTATION)}
        _check_group_options(f"{NAME} optimizer_kwargs of {names[0]!r}" + (" and others" if len(names) > 1 else ""), given)
        if given.get("algorithm") == "adamw":
            groups.append({"params": list(group["params"]), _NAMES: list(names), **given, RECORD: {}})
        else:
            groups.extend({"params": [p], _NAMES: [name], **given, RECORD: {}} for p, name in zip(group["params"], names))
    return Dion3(groups, **settings)


def _check_group_options(where: str, given: dict[str, Any]) -> None:
    """The keys of a group's ``optimizer_kwargs``: Dion3's per-group options and ``algorithm`` only
    (their values are checked by ``Dion3`` as it takes the group)."""
    options.refuse_group_keys(where, given, options.TORCH, f"the config's optimizer_factory_kwargs_by_name[{NAME!r}]", ("algorithm",))
    for name in given:
        if name != "algorithm" and name not in options.group_keys(options.TORCH):
            raise options.unknown_option(where, name, (*options.group_keys(options.TORCH), "algorithm"))
