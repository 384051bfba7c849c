"""The Megatron optimizer wrappers Dion3 is built with: Megatron 0.19's own, with two changes.

1. **fp32.** Megatron 0.19 wraps the layer-wise ZeRO-1 base optimizers in
   ``Float16OptimizerWithFloat16Params`` for bf16 only; in fp32 it chains the raw torch optimizer
   and ``ChainedOptimizer``'s config assertion fails. Here they are wrapped in ``FP32Optimizer``
   (Megatron's own fp32 wrapper), with the state dict nested the way the layer-wise checkpoint code
   reads it.
2. **One finiteness check per step, not two.** Every Megatron step starts with the global gradient
   norm (a host float, one all-reduce over every rank). When it is finite, every gradient it covers
   is finite on every rank, so Dion3's own check (another all-reduce and a host wait) is redundant:
   these wrappers then tell the Dion3 optimizers below them (:meth:`MegatronDion3.vouch_finite`),
   which skip their check for that step. Only when the norm covers every Dion3 gradient on every
   rank (checked once, collectively) and was reduced over the whole world; otherwise, and whenever
   the norm is inf or NaN, Dion3 checks itself, so a non-finite gradient still never reaches the
   weights or the state.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist

from .optimizer import MegatronDion3

_CLASSES: dict[str, type] = {}


def _flag_device() -> torch.device:
    if torch.cuda.is_available() and "nccl" in str(dist.get_backend()).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def layer_wise_class() -> type:
    """Megatron's ``LayerWiseDistributedOptimizer`` with the two changes of this module."""
    if "layer_wise" not in _CLASSES:
        from megatron.core.optimizer.layer_wise_optimizer import LayerWiseDistributedOptimizer
        from megatron.core.optimizer.optimizer import FP32Optimizer

        class NestedFP32Optimizer(FP32Optimizer):
            """FP32Optimizer whose (sharded) state dict nests under 'optimizer', as the layer-wise
            wrapper's checkpoint code expects from its bf16 children."""

            def sharded_state_dict(self, model_sharded_state_dict, is_loading=False, metadata=None):
                return {"optimizer": super().sharded_state_dict(model_sharded_state_dict, is_loading, metadata)}

            def load_state_dict(self, state_dict):
                super().load_state_dict(state_dict.get("optimizer", state_dict))

        class Dion3LayerWiseDistributedOptimizer(LayerWiseDistributedOptimizer):
            def __init__(self, optimizers, config, pg_collection=None, init_state_fn_list=None, model_chunks=None):
                if not config.bf16:
                    fns = list(init_state_fn_list) if init_state_fn_list else [None] * len(optimizers)
                    optimizers = [NestedFP32Optimizer(opt, config, fn) if isinstance(opt, torch.optim.Optimizer)
                                  else opt for opt, fn in zip(optimizers, fns)]
                super().__init__(optimizers, config, pg_collection, init_state_fn_list, model_chunks)
                # (Megatron wrapper, Dion3 optimizer) pairs below this one
                self._dion3 = [(child, child.optimizer) for child in self.chained_optimizers
                               if isinstance(getattr(child, "optimizer", None), MegatronDion3)]
                self._norm_covers_dion3: Optional[bool] = None

            @torch.no_grad()
            def get_grad_norm(self):
                grad_norm = super().get_grad_norm()  # reduced over the whole world (group None)
                self.vouch_from_grad_norm(grad_norm)
                return grad_norm

            def vouch_from_grad_norm(self, grad_norm: float, global_norm: bool = True) -> None:
                """Tell the Dion3 optimizers below whether this step's gradients are known finite on
                every rank (``grad_norm``: Megatron's norm; ``global_norm``: reduced over all ranks)."""
                finite = global_norm and math.isfinite(grad_norm) and self._norm_covers()
                for _, dion3 in self._dion3:
                    dion3.vouch_finite(finite)

            def _norm_covers(self) -> bool:
                """Whether Megatron's gradient norm counts every gradient of every Dion3 optimizer
                below on every rank (it leaves out tensor-parallel duplicates, shared weights and
                separately clipped groups). Decided at the first call, by all ranks together."""
                if self._norm_covers_dion3 is None:
                    local = True
                    for child, dion3 in self._dion3:
                        counted = {id(g) for g in child.get_grads_for_grad_norm()}
                        local = local and all(p.grad is not None and id(p.grad) in counted
                                              for group in dion3.param_groups for p in group["params"])
                    if dist.is_initialized() and dist.get_world_size() > 1:
                        flag = torch.tensor([1.0 if local else 0.0], device=_flag_device())
                        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
                        local = bool(flag.item() > 0)
                    self._norm_covers_dion3 = local
                return self._norm_covers_dion3

        _CLASSES["layer_wise"] = Dion3LayerWiseDistributedOptimizer
    return _CLASSES["layer_wise"]


def chained_class() -> type:
    """Megatron's ``ChainedOptimizer`` for the chain [layer-wise Dion3, Adam, ...] Megatron builds
    around Dion3: with change 2 where the chain computes the norm itself (its optimizers share one
    grad-stats group); otherwise the layer-wise child's own norm has done it."""
    if "chained" not in _CLASSES:
        from megatron.core.optimizer.optimizer import ChainedOptimizer

        class Dion3ChainedOptimizer(ChainedOptimizer):
            @torch.no_grad()
            def get_grad_norm(self):
                grad_norm = super().get_grad_norm()
                if len(self.chained_optimizers) > 1 and self.grads_states_parallel_group_is_shared():
                    group = self.get_grad_stats_parallel_group()
                    whole_world = not dist.is_initialized() or dist.get_world_size(group) == dist.get_world_size()
                    for child in self.chained_optimizers:
                        if isinstance(child, layer_wise_class()):
                            child.vouch_from_grad_norm(grad_norm, whole_world)
                return grad_norm

        _CLASSES["chained"] = Dion3ChainedOptimizer
    return _CLASSES["chained"]
