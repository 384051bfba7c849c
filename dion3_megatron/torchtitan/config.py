"""The param-group config that gives the hidden matrices of torchtitan's llama-style models to Dion3
and the rest to AdamW."""

from __future__ import annotations

from typing import Any

from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig

from .. import options
from .registry import NAME

HIDDEN_MATRICES = r"(^|\.)(attention\.(qkv_linear\.)?w(qkv|q|k|v|o)|feed_forward\.w[123])\.weight$"
"""The attention projections (fused ``wqkv`` or ``wq``/``wk``/``wv``, and ``wo``) and the feed-forward
``w1``/``w2``/``w3`` weights of every layer, as torchtitan's llama3 (and qwen3-style dense) models name
them, wherever an activation-checkpoint wrapper puts them (``layers.0._checkpoint_wrapped_module.
attention.wo.weight``). Embeddings, the output head, norms (``q_norm``/``k_norm`` too) and biases
do not match."""


def optimizer_config(matrices: str = HIDDEN_MATRICES, **settings: Any) -> OptimizersContainer.Config:
    """torchtitan's optimizer config: the parameters whose name matches ``matrices`` (first match)
    take Dion3, every other one AdamW.

    ``settings`` are Dion3's options (the torch ``Dion3``'s, with its defaults), checked here: an
    unknown name is a TypeError with the closest option, a bad value a ValueError naming it. The
    per-group ones are the Dion3 group's ``optimizer_kwargs``, written out in full (torchtitan's
    configs carry no implicit defaults); ``kernels`` and ``cuda_graph`` go to
    ``optimizer_factory_kwargs_by_name["Dion3"]``. The AdamW group takes what the torch ``Dion3``
    gives its AdamW tensors: ``adamw_lr``, ``betas``, ``eps`` and ``weight_decay``.
    """
    where = "dion3_megatron.torchtitan.optimizer_config"
    resolved = options.settings(where, options.TORCH, settings)
    options.check(where, **resolved)
    per_group = options.group_keys(options.TORCH)
    adamw = {
        "lr": resolved["adamw_lr"],
        "betas": tuple(resolved["betas"]),
        "eps": resolved["eps"],
        "weight_decay": resolved["weight_decay"],
    }
    return OptimizersContainer.Config(
        param_groups=[
            ParamGroupConfig(pattern=matrices, optimizer_name=NAME, optimizer_kwargs={k: resolved[k] for k in per_group}),
            ParamGroupConfig(pattern=r".*", optimizer_name="AdamW", optimizer_kwargs=adamw),
        ],
        optimizer_factory_kwargs_by_name={NAME: {k: resolved[k] for k in ("kernels", "cuda_graph")}},
    )
