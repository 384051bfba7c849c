"""The convergence benchmark's model: a byte-level GPT, trained as a pack of independent copies.

Each copy (a "member": one optimizer config) is an ordinary ``GPT`` module with its own leaf
parameters, so every optimizer sees plain 2-D weights. :func:`pack_loss` runs all members' forward
passes as one batched computation (their weights stacked along a leading dimension, batched
matmuls, one attention call), so a pack of K small models fills the GPU the way one large model
would. The members never mix: each member's loss depends only on its own weights and data, and
the gradient of the summed loss reaches each member's parameters as that member's own gradient.

Architecture: pre-norm RMSNorm, RoPE, SwiGLU MLP, causal ``scaled_dot_product_attention``, untied
embedding and head, bf16 autocast over fp32 weights.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB = 256
EPS = 1e-6
BLOCK_MATRICES = ("q", "k", "v", "o", "gate", "up", "down")


class Block(nn.Module):
    def __init__(self, d: int, ffn: int) -> None:
        super().__init__()
        self.norm1 = nn.Parameter(torch.ones(d))
        self.norm2 = nn.Parameter(torch.ones(d))
        for name in ("q", "k", "v", "o"):
            setattr(self, name, nn.Parameter(torch.empty(d, d)))
        self.gate = nn.Parameter(torch.empty(ffn, d))
        self.up = nn.Parameter(torch.empty(ffn, d))
        self.down = nn.Parameter(torch.empty(d, ffn))


class GPT(nn.Module):
    """One member's parameters (the computation is in :func:`pack_loss`)."""

    def __init__(self, d: int, layers: int, heads: int, ffn: int, seq: int) -> None:
        super().__init__()
        if d % heads or (d // heads) % 2:
            raise ValueError(f"hidden {d} must split into {heads} heads of an even size")
        self.heads = heads
        self.embed = nn.Parameter(torch.empty(VOCAB, d))
        self.blocks = nn.ModuleList(Block(d, ffn) for _ in range(layers))
        self.norm = nn.Parameter(torch.ones(d))
        self.head = nn.Parameter(torch.empty(VOCAB, d))
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith((".o", ".down")) else 0.02
                nn.init.normal_(p, std=std)
        head_dim = d // heads
        inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)


def split_params(model: GPT) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(the block matrices, everything else: embedding, head, norm gains)."""
    matrices = [p for n, p in model.named_parameters() if n.startswith("blocks.") and p.dim() == 2]
    ids = {id(p) for p in matrices}
    return matrices, [p for p in model.parameters() if id(p) not in ids]


def _rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x (K, N, d), weight (K, d): RMSNorm in fp32, returned in x's dtype."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + EPS) * weight.unsqueeze(1)).to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def _linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x (K, N, in) @ weight (K, out, in)^T: one batched matmul for all members."""
    return torch.bmm(x, weight.transpose(1, 2))


def stacked_weights(members: list[GPT]) -> dict[str, torch.Tensor]:
    """The members' weights stacked along a leading member dimension (a view when there is one)."""
    stack = (lambda ts: ts[0].unsqueeze(0)) if len(members) == 1 else torch.stack  # noqa: E731
    first = members[0]
    weights = {
        "embed": stack([m.embed for m in members]),
        "norm": stack([m.norm for m in members]),
        "head": stack([m.head for m in members]),
    }
    for layer in range(len(first.blocks)):
        for name in (*BLOCK_MATRICES, "norm1", "norm2"):
            weights[f"{layer}.{name}"] = stack([getattr(m.blocks[layer], name) for m in members])
    return weights


def _logits(
    idx: torch.Tensor, weights: dict[str, torch.Tensor], cos: torch.Tensor, sin: torch.Tensor, heads: int, layers: int
) -> torch.Tensor:
    """idx (K, B, T) byte ids, member k reading idx[k] -> logits (K, B, T, 256)."""
    k_count, batch, t = idx.shape
    # One lookup in the members' stacked tables through F.embedding, whose backward is a sorted
    # segment sum: advanced indexing's backward (index_put) took 17% of a step's GPU time on an H200.
    offsets = torch.arange(k_count, device=idx.device).view(-1, 1, 1) * VOCAB
    x = F.embedding(idx + offsets, weights["embed"].reshape(k_count * VOCAB, -1)).view(k_count, batch * t, -1)
    d = x.shape[-1]
    cos, sin = cos[:t], sin[:t]
    for layer in range(layers):
        w = lambda name: weights[f"{layer}.{name}"]  # noqa: E731
        h = _rms_norm(x, w("norm1"))
        q, k, v = (_linear(h, w(n)).view(k_count * batch, t, heads, -1).transpose(1, 2) for n in ("q", "k", "v"))
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + _linear(a.transpose(1, 2).reshape(k_count, batch * t, d), w("o"))
        h = _rms_norm(x, w("norm2"))
        x = x + _linear(F.silu(_linear(h, w("gate"))) * _linear(h, w("up")), w("down"))
    x = _rms_norm(x, weights["norm"])
    return _linear(x, weights["head"]).view(k_count, batch, t, -1)


def _losses(
    idx: torch.Tensor,
    targets: torch.Tensor,
    weights: dict[str, torch.Tensor],
    cos: torch.Tensor,
    sin: torch.Tensor,
    heads: int,
    layers: int,
    bf16: bool,
) -> torch.Tensor:
    with torch.autocast(idx.device.type, dtype=torch.bfloat16, enabled=bf16):
        logits = _logits(idx, weights, cos, sin, heads, layers)
    losses = F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1), reduction="none")
    return losses.view(idx.shape[0], -1).mean(-1)


# torch.compile of the whole loss: the norms, RoPE, SwiGLU and the loss fuse into a few kernels
# (compiled once per input shape; ``compiled=True`` in pack_loss).
_compiled_losses = torch.compile(_losses, dynamic=False)


def pack_loss(members: list[GPT], idx: torch.Tensor, targets: torch.Tensor, bf16: bool, compiled: bool = False) -> torch.Tensor:
    """Each member's mean cross-entropy (nats per byte) on its own batch: (K,) fp32. Member k reads
    idx[k]; the members' forward passes run as one batched computation."""
    first = members[0]
    fn = _compiled_losses if compiled else _losses
    return fn(idx, targets, stacked_weights(members), first.cos, first.sin, first.heads, len(first.blocks), bf16)
