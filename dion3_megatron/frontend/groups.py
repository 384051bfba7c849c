"""Param groups of the front ends that hold parameters whole (the torch optimizer, DeepSpeed's):
which algorithm a tensor takes, a group's settings checked where they enter and resolved into the
rule's settings once (:class:`GroupSettings`), parameter and matrix names, and a checkpoint's groups
and state checked in full before anything is loaded."""

from __future__ import annotations

import dataclasses
import warnings
from collections import defaultdict
from typing import Any, Callable, Iterable, Optional

import torch

from .. import options
from ..core.rule import Dion3Hyperparameters
from .lifecycle import RECORD, without_records
from .matrices import matrix_count, matrix_shape

ALGORITHMS = ("dion3", "adamw")


def algorithm_of(group: dict, p: torch.Tensor) -> str:
    """The group's algorithm, else Dion3 for a tensor of >= 2 dims and AdamW for the rest."""
    return group["algorithm"] or ("dion3" if p.dim() >= 2 else "adamw")


def split_by_algorithm(params: list) -> Optional[list[dict]]:
    """A plain parameter list (tensors, or ``(name, tensor)`` from ``named_parameters()``) as two
    groups, the matrices and the AdamW tensors (which take ``adamw_lr``); None for a list of
    param groups."""
    if not params or isinstance(params[0], dict):
        return None
    by_algorithm: dict[str, list] = {"dion3": [], "adamw": []}
    for p in params:
        by_algorithm[algorithm_of({"algorithm": None}, p[1] if isinstance(p, tuple) else p)].append(p)
    return [{"params": ps, "algorithm": None if name == "dion3" else name} for name, ps in by_algorithm.items() if ps]


def prepare(owner: str, front_end: str, params: Iterable[Any], given: dict[str, Any]) -> tuple[dict[str, Any], list, dict, bool]:
    """What a whole-parameter front end's constructor needs: its settings (unknown names and bad
    values refused: :func:`~dion3_megatron.options.settings`), the params or param groups for
    ``torch.optim.Optimizer`` (a plain list split by algorithm: :func:`split_by_algorithm`), the
    groups' defaults, and whether the list was split."""
    settings = options.settings(owner, front_end, given)
    keys = options.group_keys(front_end)
    params = list(params)
    split = split_by_algorithm(params)
    return settings, split or params, {**{k: settings[k] for k in keys}, "algorithm": None}, split is not None


def warn_without_matrices(owner: str, groups: list[dict]) -> None:
    """Say so when no parameter takes Dion3 (every one would take AdamW)."""
    if not any(algorithm_of(g, p) == "dion3" for g in groups for p in g["params"]):
        count = sum(len(g["params"]) for g in groups)
        warnings.warn(
            f"{owner}: none of the {count} parameters is a matrix for Dion3 (a tensor of >= 2 dims "
            "outside algorithm='adamw' groups): every parameter will take AdamW",
            stacklevel=3,
        )


GROUP_KEYS = ("params", "param_names", "algorithm", RECORD)  # a param group's keys besides the options


def check_group_keys(where: str, group: dict, front_end: str, set_on: str) -> None:
    """Refuse a param-group key that is an optimizer-wide option (saying where it goes: ``set_on``)
    or looks like a misspelled option (its hint names the option), as the keyword arguments are
    refused (:func:`~dion3_megatron.options.refuse_group_keys`)."""
    options.refuse_group_keys(where, group, front_end, set_on, GROUP_KEYS)


def check_group(where: str, group: dict, front_end: str, params: Optional[list[torch.Tensor]] = None) -> None:
    """Raise ValueError naming the setting and its value when a group's settings are invalid for
    its parameters (``params``, default the group's: at construction, every step, and on a
    checkpoint's groups before loading them)."""
    if group["algorithm"] not in (None, *ALGORITHMS):
        raise ValueError(f"{where}: algorithm must be one of {ALGORITHMS} or absent, got {group['algorithm']!r}")
    options.check(where, **{k: group[k] for k in options.group_keys(front_end)})
    if group["algorithm"] != "dion3" and group["num_heads"] is None:
        return  # nothing per parameter to check (this runs at every step)
    for i, p in enumerate(group["params"] if params is None else params):
        if group["algorithm"] == "dion3" and p.dim() < 2:
            raise ValueError(f"{where}: algorithm 'dion3' needs tensors with >= 2 dims, got shape {tuple(p.shape)}")
        if algorithm_of(group, p) == "dion3":
            options.check_num_heads(where, group["num_heads"], matrix_shape(p)[0], f"param {i} (shape {tuple(p.shape)})")


SCHEDULED = ("lr", "weight_decay")  # what schedulers change between steps


class GroupSettings:
    """Each param group's settings, checked and resolved into the rule's settings where they enter
    and again only where a value in the group changed, so a step reads them without parsing them
    again: a scheduled lr or weight decay (:data:`SCHEDULED`) alone is checked alone; any other
    change (a user's edit of the group) checks the whole group again.

    ``check(where, group)`` raises ValueError naming the setting and its value (the front end's
    check of a group and its parameters); ``keys``: every group key the settings are read from (the
    rule's settings a group does not carry take their defaults)."""

    def __init__(self, check: Callable[[str, dict], None], keys: Iterable[str]) -> None:
        self._check = check
        self._keys = SCHEDULED + tuple(k for k in keys if k not in SCHEDULED)
        self._resolved: dict[int, tuple[dict, tuple, Dion3Hyperparameters]] = {}

    def _snapshot(self, group: dict) -> tuple:
        # A tensor value (torch's optimizers take a tensor lr, which schedulers change in place) by
        # its number; the params list by identity and length.
        values = tuple(v.item() if isinstance(v, torch.Tensor) else v for v in (group.get(k) for k in self._keys))
        return values + (id(group["params"]), len(group["params"]))

    def of(self, where: str, group: dict) -> Dion3Hyperparameters:
        """The group's settings, checked where they changed since the last call."""
        snapshot = self._snapshot(group)
        held = self._resolved.get(id(group))
        if held is not None and held[0] is group and held[1] == snapshot:
            return held[2]
        scheduled = len(SCHEDULED)
        if held is not None and held[0] is group and held[1][scheduled:] == snapshot[scheduled:]:
            options.check(where, **{k: group[k] for k in SCHEDULED})
            hp = dataclasses.replace(held[2], **dict(zip(SCHEDULED, snapshot[:scheduled])))
        else:
            self._check(where, group)
            fields = Dion3Hyperparameters.__dataclass_fields__
            hp = options.hyperparameters(**{k: group[k] for k in self._keys if k in group and k in fields})
        self._resolved[id(group)] = (group, snapshot, hp)
        return hp


def group_where(index: int, group: dict) -> str:
    """How an error names a param group: its index, and its first parameter's name where the group
    names its parameters (``named_parameters()``, torchtitan's groups)."""
    names = group.get("param_names")
    if not names:
        return f"param group {index}"
    return f"param group {index} ({names[0]!r}{' and others' if len(names) > 1 else ''})"


def param_name(group_index: int, index: int) -> str:
    """The name of a parameter given without one: the j-th of param group i."""
    return f"group{group_index}.param{index}"


def param_names(groups: list[dict]) -> dict[torch.Tensor, str]:
    """Each parameter's name: given by ``named_parameters()``, else :func:`param_name`."""
    names = {}
    for gi, group in enumerate(groups):
        given = group.get("param_names")
        for j, p in enumerate(group["params"]):
            names[p] = given[j] if given else param_name(gi, j)
    return names


def matrix_names(name: str, p: torch.Tensor) -> list[str]:
    """The names of a parameter's matrices in the engine and the record of chosen fractions: the
    parameter's own for a matrix, ``name.matrix<e>`` for each of a 3-D parameter's."""
    return [f"{name}.matrix{e}" for e in range(p.shape[0])] if p.dim() == 3 else [name]


def param_state_shapes(group: dict, p: torch.Tensor) -> list[dict[str, tuple]]:
    """The state shapes a checkpoint may hold for a whole parameter (a Dion3 matrix stepped with
    staleness also keeps each row's age, with a bf16 momentum its count of steps)."""
    if algorithm_of(group, p) == "dion3":
        rows = (matrix_count(p), matrix_shape(p)[0])
        plain = {"momentum": tuple(p.shape), "variance": rows}
        counted = {"rounding_step": (matrix_count(p),)}  # a bf16 momentum's (converted on load: any dtype's checkpoint loads)
        return [plain, {**plain, "row_age": rows}, {**plain, **counted}, {**plain, "row_age": rows, **counted}]
    return [{"step": (), "exp_avg": tuple(p.shape), "exp_avg_sq": tuple(p.shape)}]


def check_saved_groups(
    saved: list[dict], groups: list[dict], front_end: str, params_of: Callable[[dict], list[torch.Tensor]], hint: str = ""
) -> None:
    """A checkpoint's param groups against the optimizer's: as many, each with as many parameters,
    and settings valid for them (``params_of(group)``: the tensors to check them against)."""
    if len(saved) != len(groups):
        raise ValueError(f"checkpoint has {len(saved)} param groups, the optimizer has {len(groups)}{hint}")
    for gi, (mine, theirs) in enumerate(zip(groups, saved)):
        if len(mine["params"]) != len(theirs["params"]):
            raise ValueError(f"param group {gi}: checkpoint has {len(theirs['params'])} params, the optimizer has {len(mine['params'])}")
        settings = {k: v for k, v in theirs.items() if k != "params"}
        check_group(f"param group {gi}", {**mine, **settings}, front_end, params_of(mine))


def check_state_shapes(
    state_dict: dict[str, Any], groups: list[dict], shapes_of: Callable[[dict, torch.Tensor], list[dict[str, tuple]]]
) -> None:
    """Every parameter's state in a checkpoint against ``shapes_of(group, p)``; ValueError naming the
    group, the parameter and both shapes."""
    for gi, (mine, saved) in enumerate(zip(groups, state_dict["param_groups"])):
        for p, pid in zip(mine["params"], saved["params"]):
            entry = state_dict["state"].get(pid)
            if entry is None:
                continue
            expected = shapes_of(mine, p)
            got = {k: tuple(v.shape) for k, v in entry.items() if torch.is_tensor(v)}
            if got not in expected:
                raise ValueError(
                    f"param group {gi}, param {pid} (shape {tuple(p.shape)}): checkpoint state {got} "
                    f"does not match the expected {' or '.join(map(str, expected))}"
                )


# A Dion3 matrix's state keys (the rest are AdamW's).
DION3_STATE = ("momentum", "variance", "row_age", "rounding_step")


def loaded_state(
    state_dict: dict[str, Any],
    groups: list[dict],
    offloaded: bool = False,
    momentum_key: Callable[[dict], Optional[str]] = lambda group: "momentum",
) -> dict[torch.Tensor, dict]:
    """Every parameter's state from a checkpoint whose shapes :func:`check_state_shapes` accepted:
    copies on the parameter's device (the Dion3 state in host memory where it is ``offloaded``; the
    step count stays where it was), fp32 but for a Dion3 momentum (the key ``momentum_key(group)``
    names, None for a group without one), which takes its group's ``momentum_dtype`` (a conversion
    is announced once), and the count of steps of a bf16 one (``rounding_step``, int64; dropped for
    an fp32 momentum)."""
    loaded: dict[torch.Tensor, dict] = {}
    conversions = set()
    for mine, saved in zip(groups, state_dict["param_groups"]):
        momentum_dtype = options.momentum_dtype(mine.get("momentum_dtype", torch.float32))
        key = momentum_key(mine)
        dtypes = {key: momentum_dtype, "rounding_step": torch.int64} if key is not None else {}
        for p, pid in zip(mine["params"], saved["params"]):
            entry = state_dict["state"].get(pid)
            if entry is None:
                continue
            host = torch.device("cpu")
            loaded[p] = {
                k: v.detach()
                .to(
                    device=v.device if k == "step" else host if offloaded and k in DION3_STATE else p.device,
                    dtype=dtypes.get(k, torch.float32),
                )
                .clone(memory_format=torch.contiguous_format)
                for k, v in entry.items()
                if k != "rounding_step" or momentum_dtype != torch.float32
            }
            if key in entry and entry[key].dtype != momentum_dtype:
                conversions.add(f"{entry[key].dtype} to {momentum_dtype}")
    announce_conversions(conversions, stacklevel=5)
    return loaded


def announce_conversions(conversions: set[str], stacklevel: int) -> None:
    """Say once which momentum dtypes a load converted (``"torch.float32 to torch.bfloat16"``):
    a checkpoint's momentum takes the ``momentum_dtype`` of the optimizer that loads it."""
    if conversions:
        warnings.warn(
            f"Dion3: the checkpoint's momentum was converted ({', '.join(sorted(conversions))}) to the "
            "momentum_dtype of this optimizer's param groups",
            stacklevel=stacklevel,
        )


def with_adamw_lr(param_group: dict, adamw_lr: float | torch.Tensor) -> dict:
    """An ``algorithm="adamw"`` group without an lr of its own takes the optimizer's ``adamw_lr``."""
    if param_group.get("algorithm") == "adamw" and "lr" not in param_group:
        return {**param_group, "lr": adamw_lr}
    return param_group


# Group keys a checkpoint does not set: its parameters, and how this optimizer stores the momentum
# (the checkpoint's momentum is converted to it).
KEPT_ON_LOAD = ("params", "momentum_dtype")


def load_saved(
    optimizer: torch.optim.Optimizer,
    state_dict: dict[str, Any],
    offloaded: bool = False,
    momentum_key: Callable[[dict], Optional[str]] = lambda group: "momentum",
) -> None:
    """Set an optimizer's state (:func:`loaded_state`; ``offloaded``: its Dion3 state in host
    memory; ``momentum_key``: the key of a group's Dion3 momentum) and its groups' settings but
    :data:`KEPT_ON_LOAD` from a checkpoint whose groups and shapes were checked."""
    optimizer.state = defaultdict(dict, loaded_state(state_dict, optimizer.param_groups, offloaded, momentum_key))
    for mine, saved in zip(optimizer.param_groups, without_records(state_dict["param_groups"])):
        mine.update({k: v for k, v in saved.items() if k not in KEPT_ON_LOAD})
