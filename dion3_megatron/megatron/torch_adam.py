"""Checkpoint fixes for Megatron-Core 0.19's Adam when it is torch's AdamW (no apex, no Transformer Engine).

Megatron falls back to ``torch.optim.AdamW`` when neither fused Adam is installed (a pip-installed
megatron-core, this project's README install). Under ``--use-distributed-optimizer`` that fallback
resumes wrongly: torch keeps a ``step`` tensor per parameter, which Megatron's
DistributedOptimizer saves once, in its param groups, and restores from there. Then

1. its loaders copy the per-parameter tensors in afterwards: the fully reshardable one looks for a
   ``step`` the checkpoint's tensors never hold (KeyError), the dp-reshardable one (what
   ``megatron.training`` uses) copies back the value ``step`` had before the load (0 in a fresh run):
   Adam's bias corrections restart as if at step 1, and the resumed run departs from the
   uninterrupted one;
2. its ``state_dict()`` reads ``step`` from every parameter's state and asserts it finds one value;
   before the first step there is none (``load_checkpoint`` builds the state dict to load into from
   a fresh optimizer), so loading fails;
3. its ``load_state_dict()`` hands every parameter the same ``step`` tensor, which torch's AdamW
   increments in place once per parameter and step: the bias corrections run ahead.

With ``--optimizer dion3`` the embeddings and the output layer take that Adam, so a Dion3 run would
not resume identically either. The three functions below replace the three methods; they are
entries of :data:`.registry.MEGATRON`, applied where Megatron's Adam is torch's AdamW
(:func:`megatron_adam_is_torch`) by :func:`dion3_megatron.megatron.register`; a fused Adam keeps
no per-parameter ``step`` and needs none of them. They change only the DistributedOptimizer of a
Dion3 run (its config's ``optimizer`` is dion3: Megatron's factory gives the Adam part of an
emerging optimizer's chain the chain's config); every other run's Adam runs Megatron's own methods
(:func:`_in_dion3_run`).
"""

from __future__ import annotations

from typing import Any

import functools

import torch

from .arguments import is_dion3


def _in_dion3_run(distributed_optimizer: Any) -> bool:
    """Whether a DistributedOptimizer belongs to a Dion3 run (the Adam part of its chain)."""
    return is_dion3(getattr(getattr(distributed_optimizer, "config", None), "optimizer", None))


def megatron_adam_is_torch(_current: Any = None) -> bool:
    """Whether Megatron-Core's optimizer factory builds Adam as ``torch.optim.AdamW``."""
    from megatron.core import optimizer as core_optimizer

    return getattr(core_optimizer, "Adam", None) is torch.optim.AdamW


def set_main_param_and_optimizer_states(set_states):
    """1: keep the restored 'step' (param groups) out of the per-parameter copy."""

    @functools.wraps(set_states)
    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        if not _in_dion3_run(self):
            return set_states(self, model_param, tensors)
        # no_grad: in fp32 the main parameters are the model parameters' own storage, which requires grad.
        group_index, group_order = self.model_param_group_index_map[model_param]
        state = self.optimizer.state[self.optimizer.param_groups[group_index]["params"][group_order]]
        tensors = {k: v for k, v in tensors.items() if k != "step"}
        kept = {k: state.pop(k) for k in list(state) if k not in tensors}
        try:
            with torch.no_grad():
                set_states(self, model_param, tensors)
        finally:
            state.update(kept)

    return _set_main_param_and_optimizer_states


def state_dict(original):
    """2: a parameter not stepped yet counts as step 0 for this call only."""

    @functools.wraps(original)
    def fresh_state_dict(self):
        if not _in_dion3_run(self):
            return original(self)
        state = self.optimizer.state
        fresh = [p for group in self.optimizer.param_groups for p in group["params"] if "step" not in state.get(p, {})]
        for p in fresh:
            state[p]["step"] = torch.tensor(0.0)
        try:
            return original(self)
        finally:
            for p in fresh:
                del state[p]["step"]
                if not state[p]:
                    del state[p]

    return fresh_state_dict


def load_state_dict(original):
    """3: one 'step' tensor per parameter."""

    @functools.wraps(original)
    def load_state_dict_own_steps(self, state_dict_in):
        original(self, state_dict_in)
        if not _in_dion3_run(self):
            return
        for state in self.optimizer.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()

    return load_state_dict_own_steps


__all__ = ["load_state_dict", "megatron_adam_is_torch", "set_main_param_and_optimizer_states", "state_dict"]
