"""Param groups for DeepSpeed: which tensors take Dion3, which AdamW.

:func:`param_groups` builds them from a model, for ``deepspeed.initialize(model_parameters=...)``.
:func:`engine_param_groups` is what the config route (``"optimizer": {"type": "Dion3"}``) applies to
the parameters DeepSpeed was given (a flat list from Hugging Face Trainer, or groups), using the
engine's model for names and module types.

AdamW takes: every tensor with fewer than 2 dims; every parameter of an ``nn.Embedding`` or a
normalization layer; the output head (``model.get_output_embeddings()`` where the model has it, and
names matching ``adamw_patterns``) and anything tied to either (a tied parameter is one tensor, so it
is found whichever module names it); and the weights of Hugging Face's ``Conv1D`` (GPT-2), which
store (in_features, out_features): Dion3 selects, normalizes and scales rows as output features,
and ZeRO cuts a parameter row-major, so a transposed matrix cannot be stepped as its
transpose. :func:`conv1d_as_linear` converts them so that Dion3 takes them. Everything else with 2
or more dims takes Dion3.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Iterable, Optional

import torch

from .layout import logical

logger = logging.getLogger("dion3_megatron.deepspeed")

# Matrices that are not hidden-layer weights: AdamW is the usual choice for them.
DEFAULT_ADAMW_PATTERNS = (
    r"(^|\.)(embed|embedding|embeddings|wte|wpe|tok_embeddings|position)(\.|$)",
    r"(^|\.)(lm_head|head|output_layer)(\.|$)",
)

# Why a >= 2-D parameter takes AdamW (the log line of the config route counts them by reason).
EMBEDDING, HEAD, NORM, CONV1D, UNKNOWN = "embedding", "output head", "norm", "Conv1D (in, out)", "not in the model"


def _norm_types() -> tuple[type, ...]:
    types = (torch.nn.LayerNorm, torch.nn.GroupNorm, torch.nn.modules.batchnorm._BatchNorm)
    return types + ((torch.nn.RMSNorm,) if hasattr(torch.nn, "RMSNorm") else ())


def is_conv1d(module: torch.nn.Module) -> bool:
    """Hugging Face's ``transformers.pytorch_utils.Conv1D`` (GPT-2's linear layers, weight (in, out)),
    recognised without importing transformers."""
    cls = type(module)
    return cls.__name__ == "Conv1D" and cls.__module__.startswith("transformers")


def adamw_reasons(model: torch.nn.Module, adamw_patterns: Iterable[str] = DEFAULT_ADAMW_PATTERNS) -> dict[int, str]:
    """id(parameter) -> why it takes AdamW, for the >= 2-D parameters of ``model`` that do."""
    patterns = [re.compile(p) for p in adamw_patterns]
    reasons: dict[int, str] = {}

    def mark(module: torch.nn.Module, reason: str) -> None:
        for p in module.parameters(recurse=False):
            reasons.setdefault(id(p), reason)

    head = None
    get_head = getattr(model, "get_output_embeddings", None)
    if callable(get_head):
        try:
            head = get_head()
        except (NotImplementedError, AttributeError):
            head = None
    if isinstance(head, torch.nn.Module):
        mark(head, HEAD)
    norms = _norm_types()
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding):
            mark(module, EMBEDDING)
        elif isinstance(module, norms) or type(module).__name__.endswith(("Norm", "RMSNorm")):
            mark(module, NORM)
    # Every name of a parameter (tied ones have several): a pattern on any of them decides.
    for name, p in model.named_parameters(remove_duplicate=False):
        if any(r.search(name) for r in patterns):
            reasons.setdefault(id(p), HEAD if re.search(DEFAULT_ADAMW_PATTERNS[1], name) else EMBEDDING)
    for module in model.modules():
        if is_conv1d(module):
            mark(module, CONV1D)  # after the head: a Conv1D head is a head
    return reasons


def _split(params: Iterable[torch.Tensor], reasons: dict[int, str]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(Dion3's, AdamW's) tensors of ``params``, in order: AdamW takes every tensor with fewer than
    2 dims (a ZeRO-3 parameter's logical ones: under ``deepspeed.zero.Init`` its ``shape`` is
    empty) and every one in ``reasons`` (:func:`adamw_reasons`)."""
    matrices: list[torch.Tensor] = []
    others: list[torch.Tensor] = []
    for p in params:
        (others if logical(p).dim() < 2 or id(p) in reasons else matrices).append(p)
    return matrices, others


def param_groups(
    model: torch.nn.Module,
    adamw_patterns: Iterable[str] = DEFAULT_ADAMW_PATTERNS,
    dion3: dict[str, Any] | None = None,
    adamw: dict[str, Any] | None = None,
    params: Optional[Iterable[torch.Tensor]] = None,
) -> list[dict[str, Any]]:
    """Split a model's parameters into a Dion3 group and an AdamW group (which takes which: the
    docstring of ``dion3_megatron.deepspeed.groups``).

    ``params``: the parameters to split, in this order (default: the model's trainable ones); a
    tensor that is not a parameter of ``model`` is split by its dims alone. ``dion3`` / ``adamw``
    add per-group settings (e.g. ``{"weight_decay": 0.0}``). Empty groups are left out (DeepSpeed
    drops them anyway).
    """
    if params is None:
        params = [p for p in model.parameters() if p.requires_grad]
    matrices, others = _split(params, adamw_reasons(model, adamw_patterns))
    groups = []
    if matrices:
        groups.append({"params": matrices, "algorithm": "dion3", **(dion3 or {})})
    if others:
        groups.append({"params": others, "algorithm": "adamw", **(adamw or {})})
    return groups


def engine_param_groups(module: torch.nn.Module, model_parameters: Any) -> list[dict[str, Any]]:
    """The param groups the config route hands Dion3: what DeepSpeed was given, split by module.

    A flat list of tensors (Hugging Face Trainer passes one) becomes a Dion3 group and an AdamW
    group ([`param_groups`][dion3_megatron.deepspeed.param_groups] over exactly these tensors). A
    group that sets ``"algorithm"`` is kept as it is; one that does not (e.g. DeepSpeed's MoE
    groups) is split in two, each keeping the group's other keys. Logs one line with the counts.
    """
    if model_parameters is None:
        model_parameters = module.parameters()
    given = list(model_parameters)
    known = {id(p) for p in module.parameters()}
    reasons = adamw_reasons(module)
    if given and not isinstance(given[0], dict):
        given = [{"params": given}]
    out: list[dict[str, Any]] = []
    counts = {"dion3": 0, "adamw": 0}
    why: dict[str, int] = {}  # AdamW matrices by reason
    unknown = 0  # matrices not in the engine's model: by their dims (Dion3)
    for group in given:
        if not isinstance(group, dict):
            raise TypeError(f"Dion3: model_parameters mixes tensors and param groups (found {type(group).__name__})")
        params = group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        if group.get("algorithm") is not None:
            out.append(group)
            continue
        matrices, others = _split(params, reasons)
        for p in others:
            if logical(p).dim() >= 2:
                why[reasons[id(p)]] = why.get(reasons[id(p)], 0) + 1
        unknown += sum(id(p) not in known for p in matrices)
        rest = {k: v for k, v in group.items() if k != "params"}
        counts["dion3"] += len(matrices)
        counts["adamw"] += len(others)
        if matrices:
            out.append({**rest, "params": matrices, "algorithm": "dion3"})
        if others:
            out.append({**rest, "params": others, "algorithm": "adamw"})
    if (counts["dion3"] or counts["adamw"]) and _rank() == 0:
        detail = ", ".join(f"{n} {reason}" for reason, n in why.items())
        logger.warning(
            "Dion3: split %d parameters by module: %d matrices take Dion3, %d tensors AdamW%s%s%s",
            counts["dion3"] + counts["adamw"],
            counts["dion3"],
            counts["adamw"],
            f" (matrices among them: {detail})" if detail else "",
            f"; {unknown} matrices not in the engine's model take Dion3 by their dims" if unknown else "",
            "; GPT-2's Conv1D weights are stored (in, out): dion3_megatron.deepspeed.conv1d_as_linear(model) lets Dion3 take them"
            if CONV1D in why
            else "",
        )
    return out


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
