"""Validation of the ``"optimizer": {"type": "Dion3", "params": {...}}`` block of a DeepSpeed config.

DeepSpeed hands ``params`` to the optimizer's constructor verbatim, so this is where a typo or an
out-of-range value must fail, naming the key and what is allowed (DeepSpeed's built-in Muon
silently ignores unknown keys). JSON spellings are converted: ``betas`` as a list,
``ns_dtype`` as a string ("float16", "bfloat16", "float32", "float64").
"""

from __future__ import annotations

import difflib
from typing import Any

from .. import rule

WHERE = 'DeepSpeed config "optimizer": {"type": "Dion3", "params": ...}'

# key -> what it means (also the error message's list of allowed keys).
ALLOWED = {
    "lr": "learning rate (Dion3, and AdamW unless adamw_lr is given)",
    "adamw_lr": "learning rate of the parameters on AdamW (embeddings, output head, norms, biases), > 0",
    "fraction": "share of each matrix's rows updated per step, in (0, 1], or \"auto\" (chosen per matrix)",
    "mu": "momentum decay of the applied rows, in [0, 1)",
    "beta2": "NorMuon per-row second-moment decay, in [0, 1)",
    "weight_decay": "decoupled weight decay, >= 0",
    "eps": "NorMuon / AdamW epsilon, > 0",
    "adjust_lr": f"one of {rule.ADJUST_LR_CHOICES}",
    "scale_lr_by_fraction": "bool: multiply the Dion3 step by 1/sqrt(fraction)",
    "scale_mu_by_fraction": "bool: the applied rows' momentum decays by mu ** (1/fraction)",
    "cuda_graph": "bool: replay the single-GPU part of the step as a CUDA graph (default true)",
    "betas": "AdamW betas, two values in [0, 1)",
    "num_heads": "select rows per head (positive int) or null",
    "ns_method": f"one of {rule.NS_METHODS}",
    "ns_dtype": f"null or one of {list(rule.NS_DTYPES)}",
}

# Keys people carry over from other optimizers' configs, with what to use instead.
HINTS = {
    "momentum": "Dion3 calls its momentum 'mu'",
    "adam_lr": "Dion3 calls it 'adamw_lr'",
    "beta1": "Dion3 calls its momentum 'mu' (AdamW's are 'betas')",
    "nesterov": "Dion3 uses heavy-ball momentum with error feedback; there is no Nesterov option",
    "ns_steps": "Dion3 runs 5 Polar Express steps; choose the method with 'ns_method'",
    "max_grad_norm": "use DeepSpeed's top-level 'gradient_clipping'",
    "torch_adam": "the AdamW half of Dion3 is built in; remove 'torch_adam'",
    "adam_w_mode": "the AdamW half of Dion3 is always decoupled (AdamW); remove 'adam_w_mode'",
    "rank_fraction": "did you mean 'fraction'?",
    "selection": "row selection is global (top-k over the whole matrix) under ZeRO, so every stage gives the same result",
}

_NUMBERS = ("lr", "adamw_lr", "fraction", "mu", "beta2", "weight_decay", "eps")


def normalize_params(params: dict[str, Any]) -> dict[str, Any]:
    """Check a config's Dion3 ``params`` and return constructor keyword arguments.

    Raises ValueError naming the key, the value and what is allowed.
    """
    unknown = [k for k in params if k not in ALLOWED]
    if unknown:
        lines = []
        for k in unknown:
            hint = HINTS.get(k)
            if hint is None:
                close = difflib.get_close_matches(str(k), ALLOWED, n=1)
                hint = f"did you mean {close[0]!r}?" if close else None
            lines.append(f"{k!r}" + (f" ({hint})" if hint else ""))
        raise ValueError(
            f"{WHERE}: unknown key(s) {', '.join(lines)}. Allowed keys: "
            + "; ".join(f"{k}: {v}" for k, v in ALLOWED.items())
        )
    out = dict(params)
    for k in _NUMBERS:
        if k == "fraction" and out.get(k) == rule.AUTO:
            continue
        if k in out and not rule.is_real(out[k]):
            raise ValueError(f"{WHERE}: {k} must be a finite number ({ALLOWED[k]}), got {out[k]!r}")
    if "betas" in out:
        betas = out["betas"]
        if not (
            isinstance(betas, (list, tuple)) and len(betas) == 2 and all(rule.is_real(b) and 0 <= b < 1 for b in betas)
        ):
            raise ValueError(f"{WHERE}: betas must be two numbers in [0, 1), got {betas!r}")
        out["betas"] = tuple(float(b) for b in betas)
    if "num_heads" in out and isinstance(out["num_heads"], bool):
        raise ValueError(f"{WHERE}: num_heads must be null or a positive int, got {out['num_heads']!r}")
    if "ns_dtype" in out:
        dt = out["ns_dtype"]
        if isinstance(dt, str):
            if dt not in rule.NS_DTYPES:
                raise ValueError(f"{WHERE}: ns_dtype must be null or one of {list(rule.NS_DTYPES)}, got {dt!r}")
            out["ns_dtype"] = rule.NS_DTYPES[dt]
        elif dt is not None and dt not in rule.NS_DTYPES.values():
            raise ValueError(f"{WHERE}: ns_dtype must be null or one of {list(rule.NS_DTYPES)}, got {dt!r}")
    if "cuda_graph" in out and not isinstance(out["cuda_graph"], bool):
        raise ValueError(f"{WHERE}: cuda_graph must be true or false, got {out['cuda_graph']!r}")
    if "adamw_lr" in out and not out["adamw_lr"] > 0:
        raise ValueError(f"{WHERE}: adamw_lr must be > 0, got {out['adamw_lr']!r}")
    hp = {k: v for k, v in out.items() if k in rule.Dion3Hyperparameters.__dataclass_fields__}
    rule.check_hyperparameters(WHERE, **hp)
    return out

