"""Validation of the ``"optimizer": {"type": "Dion3", "params": {...}}`` block of a DeepSpeed config.

DeepSpeed hands ``params`` to the optimizer's constructor verbatim, so this is where a typo or an
out-of-range value must fail, naming the key and what is allowed (DeepSpeed's built-in Muon
silently ignores unknown keys). The keys are the options of :mod:`dion3_megatron.options` whose
front ends include "deepspeed". JSON spellings are converted: ``betas`` as a list, ``ns_dtype``
as a string ("float16", "bfloat16", "float32", "float64").
"""

from __future__ import annotations

from typing import Any

from .. import options

WHERE = 'DeepSpeed config "optimizer": {"type": "Dion3", "params": ...}'

# key -> what it means (also the error message's list of allowed keys).
ALLOWED = {option.name: option.help for option in options.options_for(options.DEEPSPEED)}

# Keys of DeepSpeed's own optimizer configs, with what to use instead (and the hints every front
# end gives, options.HINTS).
HINTS = {
    **options.HINTS,
    "max_grad_norm": "use DeepSpeed's top-level 'gradient_clipping'",
    "torch_adam": "the AdamW half of Dion3 is built in; remove 'torch_adam'",
    "adam_w_mode": "the AdamW half of Dion3 is always decoupled (AdamW); remove 'adam_w_mode'",
    "selection": "row selection is global (top-k over the whole matrix) under ZeRO, so every stage gives the same result",
}


def _from_json(key: str, value: Any) -> Any:
    """A value as JSON spells it -> the constructor's value; ValueError for a JSON type that no
    value of the key's kind has (the range is checked after, by the spec)."""
    option = options.BY_NAME[key]
    kind = option.kind
    if value is None and option.default is None:
        return value  # null: the option's default
    if kind == options.REAL and not options.is_real(value) or kind == options.FRACTION and not options.is_fraction_value(value):
        raise ValueError(f"{WHERE}: {key} must be a finite number ({ALLOWED[key]}), got {value!r}")
    if kind == options.BETAS:
        if not (isinstance(value, (list, tuple)) and len(value) == 2 and all(options.is_real(b) and 0 <= b < 1 for b in value)):
            raise ValueError(f"{WHERE}: {key} must be two numbers in [0, 1), got {value!r}")
        return tuple(float(b) for b in value)
    if kind == options.HEADS and isinstance(value, bool):
        raise ValueError(f"{WHERE}: {key} must be null or a positive int, got {value!r}")
    if kind == options.DTYPE and value is not None and value not in options.NS_DTYPES.values():
        if not (isinstance(value, str) and value in options.NS_DTYPES):
            raise ValueError(f"{WHERE}: {key} must be null or one of {list(options.NS_DTYPES)}, got {value!r}")
        return options.NS_DTYPES[value]
    return value


def normalize_params(params: dict[str, Any]) -> dict[str, Any]:
    """Check a config's Dion3 ``params`` and return constructor keyword arguments.

    Raises ValueError naming the key, the value and what is allowed.
    """
    unknown = [k for k in params if k not in ALLOWED]
    if unknown:
        lines = []
        for k in unknown:
            hint = options.unknown_name_hint(k, ALLOWED, HINTS)
            lines.append(f"{k!r}" + (f" ({hint})" if hint else ""))
        raise ValueError(f"{WHERE}: unknown key(s) {', '.join(lines)}. Allowed keys: " + "; ".join(f"{k}: {v}" for k, v in ALLOWED.items()))
    out = {k: _from_json(k, v) for k, v in params.items()}
    options.check(WHERE, **{**options.defaults_for(options.DEEPSPEED), **out})  # with the defaults: pairs too
    return out
