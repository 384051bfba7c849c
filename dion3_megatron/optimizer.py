"""Dion3 as a ``torch.optim.Optimizer`` for one process (or DDP, where every rank steps alike).

Matrices (>= 2-D) take the Dion3 rule, everything else AdamW, unless a param group says
``algorithm="dion3"`` or ``algorithm="adamw"``. A 3-D tensor is a batch of matrices (MoE experts);
4-D and larger (conv weights) flatten to (out, rest). The selected rows of every matrix whose
selected block has the same shape are orthogonalized as one batch: the matrices are whole
(``Sharding.full()``) shards of the megabatch engine (:mod:`dion3_megatron.frontend.whole`), whose
plan also chooses the automatic f. The math itself lives in :mod:`dion3_megatron.core.rule`.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Never, Optional

import torch

from . import options
from .frontend import groups as grouping
from .frontend.dtensor import check_placements, is_dtensor
from .frontend.lifecycle import Dion3FrontEnd, without_records
from .frontend.whole import Fractions, WholeParameters
from .kernels import config as kernel_config


class Dion3(Dion3FrontEnd):
    """Dion3: top-fraction row selection, Gram Newton-Schulz, NorMuon normalization, error feedback.

    ``params`` are parameters (or ``named_parameters()``) or param groups. A group may set
    ``algorithm`` ("dion3" | "adamw") and the options of one value per param group
    (``lr``, ``fraction``, ``mu``, ...; not ``adamw_lr``, ``kernels``, ``cuda_graph``,
    which are one value per optimizer: a group that sets one is refused).

    The other arguments are the options (keyword only); [docs/configuration.md](../configuration.md)
    describes each, with its default and range, as declared in `dion3_megatron.options`.

    The automatic fraction is chosen per matrix at its first step by the engine's plan from its
    shape and this device's measured speed (see [`fractions`][dion3_megatron.Dion3.fractions]). Under
    torch.distributed every rank must step that first step together (as DDP does): all take the
    slowest rank's speed and agree. `cuda_graph`: on one CUDA device the Dion3 part of the step
    (after the momentum accumulation) is captured once the same matrices have stepped twice, and
    replayed: one launch instead of hundreds. Bit-identical to the eager step; it keeps the step's
    temporaries allocated. Any change of members, settings other than lr and weight decay, or
    tensor storage captures anew. `offload`: the Dion3 state lives in pinned host memory and
    streams through the GPU at each step (``dion3_megatron.engine.offload``), with the pieces of
    parameters that lie in host memory too (FSDP2's ``CPUOffloadPolicy``).

    A step with a non-finite gradient anywhere changes nothing, warns, and counts in
    `skipped_steps`. A step that raises (a setting changed to an invalid value since
    construction, a sparse gradient) raises before any weight, state or counter changes.
    """

    FRONT_END = options.TORCH

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
        options.refuse_unknown(type(self).__name__, options.TORCH, unknown)
        given = options.from_signature(options.TORCH, locals())
        settings, params, defaults, _ = grouping.prepare(type(self).__name__, options.TORCH, params, given)
        self.cuda_graph: bool = settings["cuda_graph"]
        self.kernels: Optional[str] = settings["kernels"]
        self.adamw_lr: float | torch.Tensor = settings["adamw_lr"]
        self.offload: bool = settings["offload"]
        self._whole = WholeParameters(self.cuda_graph, options.TORCH, self.offload)
        super().__init__(params, defaults)
        grouping.warn_without_matrices(type(self).__name__, self.param_groups)

    # ----------------------------------------------------------------------------------------
    # Groups and validation.

    def add_param_group(self, param_group: dict) -> None:
        where = grouping.group_where(len(self.param_groups), param_group)
        super().add_param_group(grouping.with_adamw_lr(param_group, self.adamw_lr))
        group = self.param_groups[-1]
        grouping.check_group_keys(where, group, options.TORCH, "Dion3(..., name=value)")
        grouping.check_group(where, group, options.TORCH)
        sharded = [p for p in group["params"] if is_dtensor(p) and grouping.algorithm_of(group, p) == "dion3"]
        if sharded:  # refused here, before any step, naming the parameter
            names = grouping.param_names(self.param_groups)
            for p in sharded:
                check_placements(p, names[p])

    @property
    def fractions(self) -> Fractions:
        """The f each matrix of a group with the automatic fraction uses (filled at its first step), by
        parameter name (given as ``named_parameters()``), else ``"group<i>.param<j>"``; a
        parameter tensor works as a key too."""
        return self._whole.fractions(grouping.param_names(self.param_groups))

    # ----------------------------------------------------------------------------------------
    # State.

    def fraction_records(self) -> list[dict[str, float]]:
        return self._whole.group_records(self.param_groups)

    def restore_fraction_records(self, records: list[dict[str, float]]) -> None:
        self._whole.reset(records)

    def check_loadable(self, state_dict: dict[str, Any]) -> None:
        grouping.check_saved_groups(
            without_records(state_dict["param_groups"]), self.param_groups, options.TORCH, lambda group: group["params"]
        )
        grouping.check_state_shapes(state_dict, self.param_groups, grouping.param_state_shapes)

    def load_checked(self, state_dict: dict[str, Any]) -> None:
        """Unlike torch's optimizers this keeps state in fp32 whatever the parameters' dtype, the
        momentum in this optimizer's ``momentum_dtype`` (the checkpoint's converted, with a warning)."""
        grouping.load_saved(self, state_dict, offloaded=self.offload)

    # ----------------------------------------------------------------------------------------
    # The step.

    @torch._dynamo.disable  # torch.compile runs the step eagerly: its in-place updates of views do not trace
    @torch.no_grad()
    @kernel_config.scoped_step
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        """One step of every parameter with a gradient. Everything that can be refused (sparse
        gradients, settings changed since construction) is checked before anything changes."""
        return self._whole.optimizer_step(self.param_groups, self.state, closure, self.gate_step)
