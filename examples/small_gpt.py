"""The small GPT that the examples, the benchmarks and the tests train, written once.

- :class:`GPT`, in plain PyTorch: byte-level (vocab 256), learned positions, pre-norm LayerNorm,
  causal ``scaled_dot_product_attention``, a GELU MLP of 4x the width, no biases in the linear
  layers, an untied output head. Q, K and V are separate linear layers, so that each is a matrix
  of its own for the optimizer. ``examples/quickstart.py`` and ``examples/deepspeed/train_gpt.py``
  train it.
- :func:`megatron_config` and :func:`megatron_gpt`: Megatron-Core's ``GPTModel`` (local layer
  spec, RMSNorm, RoPE, SwiGLU, grouped-query attention, no biases, untied embedding and output
  layer). ``examples/pretrain_gpt.py``, ``benchmarks/bench_megatron.py`` and the Megatron tests
  build it. Megatron is imported only when they are called.

The convergence benchmark's model (``benchmarks/convergence_model.py``) is not here: it trains K
copies as one batched computation, and its architecture is that of its recorded results.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

VOCAB = 256  # byte-level


class Block(torch.nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = torch.nn.LayerNorm(width)
        self.q = torch.nn.Linear(width, width, bias=False)  # Q, K, V separate: each is its own matrix
        self.k = torch.nn.Linear(width, width, bias=False)
        self.v = torch.nn.Linear(width, width, bias=False)
        self.proj = torch.nn.Linear(width, width, bias=False)
        self.norm2 = torch.nn.LayerNorm(width)
        self.fc1 = torch.nn.Linear(width, 4 * width, bias=False)
        self.fc2 = torch.nn.Linear(4 * width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.norm1(x)
        q, k, v = (f(h).view(b, t, self.heads, d // self.heads).transpose(1, 2) for f in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class GPT(torch.nn.Module):
    """A byte-level GPT of ``layers`` blocks, for inputs of up to ``context`` tokens."""

    def __init__(self, width: int, layers: int, heads: int, context: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, width)
        self.embed_position = torch.nn.Embedding(context, width)
        self.blocks = torch.nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(width)
        self.lm_head = torch.nn.Linear(width, VOCAB, bias=False)

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (B, T) -> fp32 logits (B, T, 256) of each next byte."""
        x = self.embed(tokens) + self.embed_position.weight[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm(x)).float()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (B, T + 1) -> the mean cross-entropy of predicting tokens[:, 1:] from what precedes them."""
        logits = self.logits(tokens[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


# ------------------------------------------------------------------------------------------------
# Megatron-Core


def megatron_config(
    *,
    layers: int,
    hidden: int,
    heads: int,
    query_groups: int,
    ffn: int,
    tp: int = 1,
    dtype: torch.dtype = torch.float32,
    init_std: float = 0.02,
    **more,
):
    """The small GPT's ``TransformerConfig``: bf16 when ``dtype`` is; ``more`` sets other fields
    (pipeline or expert parallelism, MoE) or replaces these."""
    from megatron.core.transformer import TransformerConfig

    fields = dict(
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=query_groups,
        ffn_hidden_size=ffn,
        kv_channels=hidden // heads,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        gradient_accumulation_fusion=False,
        tensor_model_parallel_size=tp,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        bf16=dtype == torch.bfloat16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        normalization="RMSNorm",
        init_method_std=init_std,
    )
    fields.update(more)
    return TransformerConfig(**fields)


def megatron_gpt(config, vocab: int, seq: int):
    """Megatron-Core's ``GPTModel`` of ``config`` (the local layer spec, with MoE layers when it
    has experts) for this rank's pipeline stage; call after ``initialize_model_parallel``."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False)
    return GPTModel(
        config,
        spec,
        vocab_size=vocab,
        max_sequence_length=seq,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
    )
