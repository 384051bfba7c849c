"""``DeepSpeedDion3``: the class DeepSpeed builds for ``"optimizer": {"type": "Dion3"}``, and the
one that steps at ZeRO stage 0 (fp32, or bf16/fp16 through DeepSpeed's unfused wrapper): whole
parameters, as :class:`dion3_megatron.Dion3` steps them (:mod:`dion3_megatron.frontend.whole`).
Where ZeRO stages 1-3 (or BF16_Optimizer) will hand the optimizer flat partitions instead, the
instance becomes a :class:`.zero_optimizer.DeepSpeedZeroDion3` before they do (:func:`.base.become`).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from .. import options
from ..frontend import groups as grouping
from ..frontend.lifecycle import without_records
from ..frontend.whole import Fractions, WholeParameters
from ..kernels import config as kernel_config
from . import zero
from .base import DeepSpeedFrontEnd


class DeepSpeedDion3(DeepSpeedFrontEnd):
    """Dion3 for DeepSpeed: validated config ``params``; whole parameters at ZeRO stage 0.

    Takes the options of ``DeepSpeedFrontEnd``, the config's ``params``. Under ZeRO stages 1-3
    ``deepspeed.initialize`` makes it a
    [`DeepSpeedZeroDion3`][dion3_megatron.deepspeed.DeepSpeedZeroDion3], whose row selection is global
    (top-k over the whole logical matrix): ZeRO-1, 2 and 3 give the same parameters as ZeRO-0.
    """

    def _start(self) -> None:
        self._whole = WholeParameters(self.cuda_graph, options.DEEPSPEED, self.offload)

    @property
    def fractions(self) -> Fractions:
        """The f each matrix of a group with the automatic fraction uses, by parameter name (as
        [`dion3_megatron.Dion3.fractions`][])."""
        return self._whole.fractions(grouping.param_names(self.param_groups))

    def fraction_records(self) -> list[dict[str, float]]:
        return self._whole.group_records(self.param_groups)

    def restore_fraction_records(self, records: list[dict[str, float]]) -> None:
        self._whole.reset(records)

    def check_loadable(self, state_dict: dict[str, Any]) -> None:
        grouping.check_saved_groups(
            without_records(state_dict["param_groups"]), self.param_groups, options.DEEPSPEED, lambda group: group["params"]
        )
        grouping.check_state_shapes(state_dict, self.param_groups, grouping.param_state_shapes)

    @torch.no_grad()
    @kernel_config.scoped_step
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        zero.warn_if_tensor_parallel_without_zero()
        return self._whole.optimizer_step(self.param_groups, self.state, closure, self.gate_step)
