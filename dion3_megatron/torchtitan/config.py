"""The param-group config that gives the hidden matrices of torchtitan's decoder models (llama3,
qwen3 and its MoE, deepseek_v3) to the Dion3 rule and the rest to AdamW, in one Dion3."""

from __future__ import annotations

from typing import Any

from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig

from .. import options
from .registry import NAME

HIDDEN_MATRICES = (
    r"(^|\.)("
    r"attention\.((qkv_linear\.)?w(qkv|q|k|v)|wo|w(q_a|q_b|kv_a|kv_b))\.weight"
    r"|(feed_forward|moe\.shared_experts)\.w[123]\.weight"
    r"|moe\.router\.gate\.weight"
    r"|moe\.routed_experts\.inner_experts\.(w1_EFD|w2_EDF|w3_EFD)"
    r"|eh_proj\.weight"
    r")$"
)
"""The hidden matrices of torchtitan's decoder models, wherever an activation-checkpoint wrapper puts
them (``layers.0._checkpoint_wrapped_module.attention.wo.weight``):

- attention: the fused ``wqkv`` or ``wq``/``wk``/``wv``, and ``wo`` (llama3, qwen3); multi-head
  latent attention's ``wq`` or ``wq_a``/``wq_b``, ``wkv_a``, ``wkv_b`` and ``wo`` (deepseek_v3);
- the feed-forward ``w1``/``w2``/``w3`` of dense layers and of MoE layers' shared experts;
- the MoE router's ``gate`` (experts x dim): a hidden matrix, as Megatron's router weight is under
  ``--optimizer dion3`` (Megatron routes only embeddings, the output layer and non-2-D tensors to
  Adam);
- the routed experts' ``w1_EFD``, ``w2_EDF``, ``w3_EFD``: 3-D, each expert's matrix a Dion3 matrix.
  torchtitan stores them as ``nn.Linear`` stores a weight, (experts, out, in), and multiplies
  ``x @ w.transpose(-2, -1)``, so each expert's rows are its output features, as a dense layer's
  rows are: Dion3 selects and normalizes them as it does a dense ``w1``/``w2``/``w3``'s. The layout
  suffix is part of the name: experts stored the other way round (other suffixes) are not matched;
- the multi-token-prediction projection ``eh_proj`` (deepseek_v3's MTP layers).

Embeddings, the output head, norms (``q_norm``, ``k_norm``, ``kv_norm`` too), biases and buffers
(the MoE's ``expert_bias_E``) do not match, nor gpt_oss's experts (``mlp1_weight_EGD``, its gate and
up projections interleaved) or a vision encoder's layers."""


def optimizer_config(matrices: str = HIDDEN_MATRICES, **settings: Any) -> OptimizersContainer.Config:
    """torchtitan's optimizer config: one Dion3 per model part, stepping the parameters whose name
    matches ``matrices`` (first match) by the Dion3 rule and every other one by AdamW
    (``algorithm="adamw"``).

    One optimizer holds them all so that the step's one decision covers every parameter of the
    part: a non-finite gradient anywhere (an embedding's too) skips the whole step on every rank,
    AdamW's tensors included, and no check refuses on some tensors after others changed.

    ``settings`` are Dion3's options (the torch ``Dion3``'s, with its defaults), checked here: an
    unknown name is an ``UnknownOptionError`` (``dion3_megatron.options``) with the closest option,
    a bad value a ValueError naming it. The per-group ones are the matrices' group's
    ``optimizer_kwargs``, written out in full (torchtitan's
    configs carry no implicit defaults); ``kernels`` and ``cuda_graph`` go to
    ``optimizer_factory_kwargs_by_name["Dion3"]``. The AdamW group takes what the torch ``Dion3``
    gives its AdamW tensors: ``adamw_lr`` (as its ``lr``), ``betas``, ``eps`` and ``weight_decay``.
    """
    where = "dion3_megatron.torchtitan.optimizer_config"
    resolved = options.settings(where, options.TORCH, settings)
    per_group = options.group_keys(options.TORCH)
    adamw = {
        "algorithm": "adamw",
        "lr": resolved["adamw_lr"],
        "betas": tuple(resolved["betas"]),
        "eps": resolved["eps"],
        "weight_decay": resolved["weight_decay"],
    }
    return OptimizersContainer.Config(
        param_groups=[
            ParamGroupConfig(pattern=matrices, optimizer_name=NAME, optimizer_kwargs={k: resolved[k] for k in per_group}),
            ParamGroupConfig(pattern=r".*", optimizer_name=NAME, optimizer_kwargs=adamw),
        ],
        optimizer_factory_kwargs_by_name={NAME: {k: resolved[k] for k in ("kernels", "cuda_graph")}},
    )
