"""Dion3 in torchtitan: ``"Dion3"`` as an optimizer name of torchtitan's param-group config.

[`register`][dion3_megatron.torchtitan.register] adds ``"Dion3"`` to the optimizer names torchtitan's
``OptimizersContainer`` resolves (``TORCHTITAN``, the table of its patches);
[`unregister`][dion3_megatron.torchtitan.unregister] restores torchtitan's own resolver. With it, a
``ParamGroupConfig(pattern=..., optimizer_name="Dion3", optimizer_kwargs={...})`` builds a
[`dion3_megatron.Dion3`][] for the parameters its regex matches, with Dion3's
options as the kwargs. [`optimizer_config`][dion3_megatron.torchtitan.optimizer_config] is the config
that gives the hidden matrices of torchtitan's decoder models
([`HIDDEN_MATRICES`][dion3_megatron.torchtitan.HIDDEN_MATRICES]: llama3, qwen3 dense and MoE,
deepseek_v3; the MoE experts' 3-D weights and routers included) to the Dion3 rule and everything
else (embeddings, output head, norms) to AdamW, in one Dion3 per model part.
``--module dion3_megatron.torchtitan --config llama3_debugmodel_dion3`` picks torchtitan's llama3
debug model with it ([`dion3_megatron.torchtitan.config_registry`][]).
See [docs/torchtitan.md](../torchtitan.md).
"""

from .config import HIDDEN_MATRICES, optimizer_config
from .registry import NAME, TORCHTITAN, build_dion3, is_registered, register, unregister

__all__ = ["HIDDEN_MATRICES", "NAME", "TORCHTITAN", "build_dion3", "is_registered", "optimizer_config", "register", "unregister"]
