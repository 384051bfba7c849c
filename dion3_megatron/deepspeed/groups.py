"""Param groups for ``deepspeed.initialize(model_parameters=...)``: which tensors take Dion3."""

from __future__ import annotations

import re
from typing import Any, Iterable

import torch

# Matrices that are not hidden-layer weights: AdamW is the usual choice for them.
DEFAULT_ADAMW_PATTERNS = (r"(^|\.)(embed|embedding|embeddings|wte|wpe|tok_embeddings|position)(\.|$)",
                          r"(^|\.)(lm_head|head|output_layer)(\.|$)")


def param_groups(
    model: torch.nn.Module,
    adamw_patterns: Iterable[str] = DEFAULT_ADAMW_PATTERNS,
    dion3: dict[str, Any] | None = None,
    adamw: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Split a model's trainable parameters into a Dion3 group and an AdamW group.

    AdamW takes every tensor with fewer than 2 dims, every parameter of an ``nn.Embedding`` or a
    normalization layer, and every parameter whose name matches one of ``adamw_patterns``
    (embeddings and the output head by default). ``dion3`` / ``adamw`` add per-group settings
    (e.g. ``{"weight_decay": 0.0}``). Empty groups are left out (DeepSpeed drops them anyway).
    """
    patterns = [re.compile(p) for p in adamw_patterns]
    norm_types = (torch.nn.LayerNorm, torch.nn.GroupNorm, torch.nn.modules.batchnorm._BatchNorm)
    if hasattr(torch.nn, "RMSNorm"):
        norm_types = norm_types + (torch.nn.RMSNorm,)
    special: set[int] = set()
    for module in model.modules():
        if isinstance(module, (torch.nn.Embedding, *norm_types)):
            special.update(id(p) for p in module.parameters(recurse=False))
    matrices, others = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.dim() < 2 or id(p) in special or any(r.search(name) for r in patterns):
            others.append(p)
        else:
            matrices.append(p)
    groups = []
    if matrices:
        groups.append({"params": matrices, "algorithm": "dion3", **(dion3 or {})})
    if others:
        groups.append({"params": others, "algorithm": "adamw", **(adamw or {})})
    return groups
