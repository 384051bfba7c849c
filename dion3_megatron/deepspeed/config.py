"""Validation of the ``"optimizer": {"type": "Dion3", "params": {...}}`` block of a DeepSpeed config.

DeepSpeed hands ``params`` to the optimizer's constructor verbatim, which checks them with the
option spec (:mod:`dion3_megatron.options`), naming the key and what is allowed (DeepSpeed's
built-in Muon silently ignores unknown keys). The keys are the options whose front ends include
"deepspeed", in their JSON spellings too: ``betas`` as a list, ``ns_dtype`` as a string
("float16", "bfloat16", "float32", "float64"). :func:`normalize_params` checks a config's
``params`` alone.
"""

from __future__ import annotations

from typing import Any

from .. import options

WHERE = 'DeepSpeed config "optimizer": {"type": "Dion3", "params": ...}'

ALLOWED = {option.name: option.help for option in options.options_for(options.DEEPSPEED)}
"""The keys of a config's Dion3 ``params``, each with what it means (also the error message's list of
allowed keys)."""

# Keys of DeepSpeed's own optimizer configs, with what to use instead (and the hints every front
# end gives, options.HINTS).
HINTS = {
    **options.HINTS,
    "max_grad_norm": "use DeepSpeed's top-level 'gradient_clipping'",
    "torch_adam": "the AdamW half of Dion3 is built in; remove 'torch_adam'",
    "adam_w_mode": "the AdamW half of Dion3 is always decoupled (AdamW); remove 'adam_w_mode'",
    "selection": "row selection is global (top-k over the whole matrix) under ZeRO, so every stage gives the same result",
}


def normalize_params(params: dict[str, Any]) -> dict[str, Any]:
    """Check a config's Dion3 ``params`` and return constructor keyword arguments (``betas`` a
    tuple, ``ns_dtype`` a torch.dtype).

    Raises ``UnknownOptionError`` (``dion3_megatron.options``) naming an unknown key (with the
    closest option, or what to use instead of a key of DeepSpeed's own optimizers), ValueError
    naming the key, the value and what is allowed.
    """
    resolved = options.settings(WHERE, options.DEEPSPEED, params, HINTS)
    return {k: resolved[k] for k in params}
