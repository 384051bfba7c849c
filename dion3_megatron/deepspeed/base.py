"""What DeepSpeed's two Dion3 classes share: the config's ``params`` checked, the param groups
split and checked, the skip counter, the automatic-f record in state dicts and the order of a load.

DeepSpeed builds the optimizer before it decides how to wrap it: :class:`.optimizer.DeepSpeedDion3`
(ZeRO stage 0: whole parameters) is what it constructs for ``"type": "Dion3"``; the hook where
DeepSpeed decides (:func:`dion3_megatron.deepspeed.stage_class`) makes that same object a
:class:`.zero_optimizer.DeepSpeedZeroDion3` when ZeRO (or BF16_Optimizer) will hand it flat
partitions (:func:`become`). The object stays the one the engine, and a client's LR scheduler, refer to.
"""

from __future__ import annotations

from typing import Any, Iterable, Never, Optional

import torch

from .. import options
from ..frontend import groups as grouping
from ..frontend.lifecycle import Dion3FrontEnd
from .config import HINTS, WHERE
from .layout import logical


class DeepSpeedFrontEnd(Dion3FrontEnd):
    """Dion3 for DeepSpeed, either stage: the config's ``params`` checked, the groups split and
    checked; a subclass steps, keeps the record and loads (`dion3_megatron.frontend.lifecycle.Dion3FrontEnd`),
    and `_start` sets what only it holds.

    Takes the options (keyword only; docs/configuration.md lists them): the config's ``params``, in
    their JSON spellings too (``betas`` a list, ``ns_dtype`` a string). An unknown key is an
    `dion3_megatron.options.UnknownOptionError` naming the closest option, an out-of-range value a
    ValueError naming it, at construction, i.e. at ``deepspeed.initialize``.
    """

    FRONT_END = options.DEEPSPEED

    def __init__(
        self,
        params: Iterable[Any],
        *,
        lr: float | torch.Tensor = 0.01,
        adamw_lr: float | torch.Tensor = 0.002,
        fraction: float | str = "auto",
        mu: Optional[float] = None,
        beta2: float = 0.95,
        weight_decay: float = 0.01,
        eps: float = 1e-8,
        adjust_lr: str = "spectral_norm",
        scale_lr_by_fraction: bool = True,
        scale_mu_by_fraction: bool = False,
        staleness: float = 1.0,
        num_heads: Optional[int] = None,
        ns_method: str = "gram",
        ns_dtype: Optional[torch.dtype | str] = None,
        momentum_dtype: torch.dtype | str = "fp32",
        betas: tuple[float, float] = (0.9, 0.95),
        kernels: Optional[str] = None,
        cuda_graph: bool = True,
        offload: bool = False,
        **unknown: Never,
    ) -> None:
        where = f"{type(self).__name__} ({WHERE})"
        options.refuse_unknown(where, options.DEEPSPEED, unknown, HINTS)
        given = options.from_signature(options.DEEPSPEED, locals())
        settings, params, defaults, _ = grouping.prepare(where, options.DEEPSPEED, _split_partitioned(list(params)), given)
        self.cuda_graph: bool = settings["cuda_graph"]
        self.kernels: str | None = settings["kernels"]
        self.adamw_lr: float | torch.Tensor = settings["adamw_lr"]
        self.offload: bool = settings["offload"]  # (under ZeRO also set by offload_optimizer: use_host_partitions)
        super().__init__(params, defaults)
        grouping.warn_without_matrices(type(self).__name__, [{**g, "params": [logical(p) for p in g["params"]]} for g in self.param_groups])
        self._start()

    def _start(self) -> None:
        """Set this class's own attributes (also when :func:`become` gives an instance this class)."""
        raise NotImplementedError

    def add_param_group(self, param_group: dict) -> None:
        index = len(self.param_groups)
        super().add_param_group(grouping.with_adamw_lr(param_group, self.adamw_lr))
        group = self.param_groups[-1]
        grouping.check_group_keys(f"param group {index}", group, options.DEEPSPEED, 'the config\'s "optimizer" "params"')
        grouping.check_group(f"param group {index}", group, options.DEEPSPEED, [logical(p) for p in group["params"]])

    def load_checked(self, state_dict: dict[str, Any]) -> None:
        """Each parameter's (or partition's) state, in fp32, and the saved groups' settings."""
        grouping.load_saved(self, state_dict, offloaded=self.offload)


def become(optimizer: DeepSpeedFrontEnd, cls: type) -> None:
    """Give ``optimizer`` (built, not stepped) the class ``cls`` of the other stage: the same object,
    so every reference to it (the engine's, an LR scheduler's) sees the change. Its own attributes
    are set again from the groups as they are now (DeepSpeed drops empty ones before wrapping)."""
    if optimizer.state:
        raise RuntimeError(f"{type(optimizer).__name__} has stepped or loaded state: it cannot become a {cls.__name__}")
    optimizer.__class__ = cls
    optimizer._start()


def _split_partitioned(params: list) -> list:
    """A plain parameter list that holds ZeRO-3 parameters (built under ``deepspeed.zero.Init``,
    their ``shape`` empty) as a Dion3 and an AdamW group by their logical shapes, as
    :func:`.frontend.groups.split_by_algorithm` splits whole parameters; anything else as it is."""
    tensors = [p[1] if isinstance(p, tuple) else p for p in params]
    if not params or isinstance(params[0], dict) or not any(hasattr(t, "ds_shape") for t in tensors):
        return params
    takes = [grouping.algorithm_of({"algorithm": None}, logical(t)) for t in tensors]
    groups = [{"params": [p for p, a in zip(params, takes) if a == name], "algorithm": name} for name in grouping.ALGORITHMS]
    return [g for g in groups if g["params"]]
