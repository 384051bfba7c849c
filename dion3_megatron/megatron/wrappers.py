"""The Megatron optimizer wrappers Dion3 is built with: Megatron 0.19's own, with two changes.

1. **fp32.** Megatron 0.19 wraps the layer-wise ZeRO-1 base optimizers in
   ``Float16OptimizerWithFloat16Params`` for bf16 only; in fp32 it chains the raw torch optimizer
   and ``ChainedOptimizer``'s config assertion fails. Here they are wrapped in ``FP32Optimizer``
   (Megatron's own fp32 wrapper), with the state dict nested the way the layer-wise checkpoint code
   reads it.
2. **A bad step changes nothing, anywhere.** Without loss scaling Megatron steps on non-finite
   gradients. The outermost wrapper (the chain [layer-wise Dion3, Adam, ...], or the layer-wise
   wrapper alone) takes the step's one decision, after the gradients are prepared, for every
   optimizer below it (:func:`dion3_megatron.frontend.lifecycle.decide_step`: one tiny all-reduce):
   the Dion3 optimizers' checks (:meth:`MegatronDion3.step_check`: settings, gradient shapes), and
   whether every gradient of every optimizer below is usable on every rank (finite and below
   2**64). Megatron's global gradient norm (a host float reduced over every rank, computed here and
   handed to the step) stands for the gradients it counts: it is usable exactly when they are.
   The gradients it leaves out (tensor-parallel duplicates, shared weights, separately clipped
   groups; all of them when the norm is not reduced over every rank) are gated themselves. A
   refused check raises on every rank. A non-finite step is reported the way loss scaling reports
   an overflow: Megatron's ``step()`` returns ``(False, None, None)`` and steps no optimizer, the
   training loop does not step the lr scheduler, and the step is counted once
   (:attr:`StepGate.skipped_steps`) and warned about once. A usable step vouches for the Dion3
   optimizers below, which take no decision of their own (:meth:`MegatronDion3.vouch_finite`).
"""

from __future__ import annotations

from typing import Any, Optional, Protocol, cast

import torch
import torch.distributed as dist

from ..frontend.dtensor import local
from ..frontend.lifecycle import decide_step
from .multi_tensor import dion3_step
from .optimizer import MegatronDion3, decision_device

_CLASSES: dict[str, type] = {}


def _below(optimizer) -> list:
    """Every optimizer under ``optimizer`` (itself included): chains' members, wrappers' insides."""
    found, stack = [], [optimizer]
    while stack:
        o = stack.pop()
        found.append(o)
        if hasattr(o, "chained_optimizers"):
            stack += list(o.chained_optimizers)
        elif getattr(o, "optimizer", None) is not None:  # (a chain's "optimizer" property asserts)
            stack.append(o.optimizer)
    return found


def dion3_optimizers(optimizer) -> list[MegatronDion3]:
    """The MegatronDion3 optimizers anywhere under a Megatron optimizer (chains, wrappers)."""
    return [o for o in _below(optimizer) if isinstance(o, MegatronDion3)]


def _world_size(group) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


class _MegatronOptimizer(Protocol):
    """The methods of Megatron's optimizer classes (which carry no type information) that
    :class:`StepGate` calls, on the class it is mixed into or on the optimizers below it."""

    def prepare_grads(self) -> bool: ...
    def get_grad_norm(self) -> float: ...
    def step(self) -> Any: ...
    def get_grad_stats_parallel_group(self) -> dist.ProcessGroup: ...
    def grads_states_parallel_group_is_shared(self) -> bool: ...


class StepGate:
    """Mixed into the outermost Megatron wrapper: the step's one decision for every chained
    optimizer, on every rank (see the module docstring)."""

    def _init_gate(self) -> None:
        self._gates_step = True  # False for a layer-wise wrapper inside Dion3's chain
        self._step_norm: Optional[float] = None  # the norm prepare_grads took, for this step's get_grad_norm
        self._norm_global: Optional[bool] = None  # whether Megatron's norm is reduced over every rank

    def _megatron(self) -> _MegatronOptimizer:
        """The Megatron class this is mixed into: the next class in the method resolution order."""
        return cast(_MegatronOptimizer, super())

    def _dion3(self) -> list[MegatronDion3]:
        return dion3_optimizers(self)

    @property
    def skipped_steps(self) -> int:
        """The steps skipped: the count of the first Dion3 optimizer below (saved in its state dict);
        the others below hold the same number."""
        return next((o.skipped_steps for o in self._dion3()), 0)

    def _leaves(self) -> list:
        """The Megatron optimizers below that hold parameters themselves (not chains)."""
        return [o for o in _below(self) if hasattr(o, "get_grads_for_grad_norm") and not hasattr(o, "chained_optimizers")]

    def _norm_is_global(self, optimizer: Optional[_MegatronOptimizer] = None) -> bool:
        """Whether this object's ``get_grad_norm`` is reduced over every rank."""
        o = cast(_MegatronOptimizer, self) if optimizer is None else optimizer
        if isinstance(o, layer_wise_class()):
            return True  # LayerWiseDistributedOptimizer reduces over the whole world
        children = getattr(o, "chained_optimizers", None)
        if children is None:
            return _world_size(o.get_grad_stats_parallel_group()) == _world_size(None)
        if len(children) == 1:
            return self._norm_is_global(children[0])
        if o.grads_states_parallel_group_is_shared():
            return _world_size(o.get_grad_stats_parallel_group()) == _world_size(None)
        return all(self._norm_is_global(child) for child in children)

    def _grads_outside_norm(self) -> list[torch.Tensor]:
        """This rank's gradients that Megatron's norm does not count (all of them if it is not global)."""
        grads = []
        for leaf in self._leaves():
            counted = {id(g) for g in leaf.get_grads_for_grad_norm()} if self._norm_global else set()
            grads += [local(p.grad) for p in leaf.get_parameters() if p.grad is not None and id(p.grad) not in counted]
        return grads

    def _step_goes_ahead(self, grad_norm: float, dion3: list[MegatronDion3]) -> bool:
        """The step's one decision, the same on every rank (one all-reduce)."""
        if self._norm_global is None:
            self._norm_global = self._norm_is_global()

        device = decision_device(torch.device("cpu"))

        def check() -> list[torch.Tensor]:
            for opt in dion3:
                opt.step_check()
            norm = [torch.tensor(grad_norm, dtype=torch.float32, device=device)] if self._norm_global else []
            return norm + self._grads_outside_norm()

        return decide_step(check, device)

    def step(self, *args, **kwargs):
        """Megatron's step, with the foreach forms of its multi-tensor loops (:mod:`.multi_tensor`)."""
        with dion3_step():
            return self._megatron().step(*args, **kwargs)

    @torch.no_grad()
    def prepare_grads(self) -> bool:
        found_inf = self._megatron().prepare_grads()
        if found_inf or not self._gates_step:
            return found_inf
        grad_norm = self._megatron().get_grad_norm()
        dion3 = self._dion3()
        if not self._step_goes_ahead(grad_norm, dion3):
            if dion3:  # counted once: by the first, the others agree
                dion3[0].skip_step(", in any chained optimizer")
                for opt in dion3[1:]:
                    opt.skipped_steps = dion3[0].skipped_steps
            return True
        for opt in dion3:
            opt.vouch_finite(True)
        self._step_norm = grad_norm
        return False

    @torch.no_grad()
    def get_grad_norm(self):
        if self._step_norm is not None:  # taken by prepare_grads for this step
            grad_norm, self._step_norm = self._step_norm, None
            return grad_norm
        return self._megatron().get_grad_norm()


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

        class Dion3LayerWiseDistributedOptimizer(StepGate, LayerWiseDistributedOptimizer):
            def __init__(self, optimizers, config, pg_collection=None, init_state_fn_list=None, model_chunks=None):
                if not config.bf16:
                    fns = list(init_state_fn_list) if init_state_fn_list else [None] * len(optimizers)
                    optimizers = [
                        NestedFP32Optimizer(opt, config, fn) if isinstance(opt, torch.optim.Optimizer) else opt
                        for opt, fn in zip(optimizers, fns)
                    ]
                super().__init__(optimizers, config, pg_collection, init_state_fn_list, model_chunks)
                self._init_gate()

        _CLASSES["layer_wise"] = Dion3LayerWiseDistributedOptimizer
    return _CLASSES["layer_wise"]


def chained_class() -> type:
    """Megatron's ``ChainedOptimizer`` for the chain [layer-wise Dion3, Adam, ...] Megatron builds
    around Dion3, with change 2 (the layer-wise member then leaves the decision to the chain)."""
    if "chained" not in _CLASSES:
        from megatron.core.optimizer.optimizer import ChainedOptimizer

        class Dion3ChainedOptimizer(StepGate, ChainedOptimizer):
            def __init__(self, chained_optimizers):
                super().__init__(chained_optimizers)
                self._init_gate()
                for child in chained_optimizers:
                    if isinstance(child, StepGate):
                        child._gates_step = False

            def state_dict(self, is_loading: bool = False):
                """Megatron's torch_dcp load (torch FSDP2) asks with ``is_loading=True`` for the state
                dict to load into, which ChainedOptimizer's does not take: every member's state is
                created first (as Megatron's bf16 optimizer does for itself), torch Adam's ``step``
                included, so that the checkpoint finds a tensor for each of its own."""
                if is_loading:
                    for child in self.chained_optimizers:
                        if getattr(child, "init_state_fn", None) is not None:
                            child.init_state_fn(child.optimizer, child.config)
                        if isinstance(child.optimizer, torch.optim.Adam):
                            for state in child.optimizer.state.values():
                                state.setdefault("step", torch.tensor(0.0))
                return super().state_dict()

        _CLASSES["chained"] = Dion3ChainedOptimizer
    return _CLASSES["chained"]
