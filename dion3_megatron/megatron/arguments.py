"""Megatron-LM command-line flags for Dion3 (``--optimizer dion3`` and the ``--dion3-*`` group).

The same flags are added by ``patches/megatron-core-0.19-dion3.patch`` for users who patch their
Megatron-LM tree instead of importing :mod:`dion3_megatron.megatron`. Values are checked by
argparse itself, so a bad value stops the launch with argparse's usual ``error: argument ...``.
"""

from __future__ import annotations

import argparse

from ..rule import ADJUST_LR_CHOICES, AUTO, NS_METHODS, Dion3Hyperparameters, check_hyperparameters

OPTIMIZER_NAME = "dion3"
SELECTION_SCOPES = ("global", "local")

# (flag, OptimizerConfig / args attribute, default) for every Dion3 option; the single source of
# truth for the argparse group, the config fields and the optimizer kwargs.
DION3_DEFAULTS = {
    "dion3_fraction": Dion3Hyperparameters.fraction,
    "dion3_mu": Dion3Hyperparameters.mu,
    "dion3_beta2": Dion3Hyperparameters.beta2,
    "dion3_eps": Dion3Hyperparameters.eps,
    "dion3_adjust_lr": Dion3Hyperparameters.adjust_lr,
    "dion3_selection_scope": "global",
    "dion3_ns": "gram",
    "dion3_scale_lr_by_fraction": Dion3Hyperparameters.scale_lr_by_fraction,
    "dion3_scale_mu_by_fraction": Dion3Hyperparameters.scale_mu_by_fraction,
    "dion3_cuda_graph": True,
    "dion3_split_qkv": True,
    "dion3_split_glu": True,
}


# The options that name a Dion3 hyper-parameter (dion3_<name>), checked by rule.check_hyperparameters.
_HYPERPARAMETERS = ("fraction", "mu", "beta2", "eps", "adjust_lr")
_CHOICES = {"dion3_selection_scope": SELECTION_SCOPES, "dion3_ns": NS_METHODS}


def check_dion3_values(values: dict, where: str) -> None:
    """Raise ValueError naming the option and its value when a ``dion3_*`` value (from an
    ``OptimizerConfig`` attribute or Megatron-LM's args) has the wrong type or range: a bool
    option given as the string "false" must not turn into True."""
    for key, default in DION3_DEFAULTS.items():
        if isinstance(default, bool) and not isinstance(values[key], bool):
            raise ValueError(f"{where}: {key} must be a bool, got {values[key]!r}")
        if key in _CHOICES and values[key] not in _CHOICES[key]:
            raise ValueError(f"{where}: {key} must be one of {_CHOICES[key]}, got {values[key]!r}")
    check_hyperparameters(where, prefix="dion3_", **{name: values[f"dion3_{name}"] for name in _HYPERPARAMETERS})


def _ranged_float(name: str, low: float, high: float, low_open: bool, high_open: bool):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number, got {text!r}") from None
        ok_low = value > low if low_open else value >= low
        ok_high = value < high if high_open else value <= high
        if not (ok_low and ok_high):
            lo, hi = ("(" if low_open else "["), (")" if high_open else "]")
            raise argparse.ArgumentTypeError(f"{name} must be in {lo}{low}, {high}{hi}, got {value}")
        return value

    parse.__name__ = name
    return parse


def _fraction(text: str) -> float | str:
    return AUTO if text == AUTO else _ranged_float("fraction", 0.0, 1.0, True, False)(text)


def add_dion3_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``dion3`` to ``--optimizer``'s choices (when the parser has that flag) and the Dion3 group.

    Idempotent: a parser that already has ``--dion3-fraction`` is returned unchanged.
    """
    for action in parser._actions:  # noqa: SLF001 - argparse has no public way to edit choices
        if "--optimizer" in action.option_strings and action.choices is not None:
            if OPTIMIZER_NAME not in action.choices:
                action.choices = list(action.choices) + [OPTIMIZER_NAME]
        if "--dion3-fraction" in action.option_strings:
            return parser
    group = parser.add_argument_group(title="Dion3 optimizer (--optimizer dion3)")
    group.add_argument("--dion3-fraction", type=_fraction, default=DION3_DEFAULTS["dion3_fraction"],
                       help="Share of each matrix's rows updated per step, in (0, 1] (paper: 1/4 or 1/8), "
                            "or 'auto': chosen per matrix from its shape, the world size and the device's speed.")
    group.add_argument("--dion3-mu", type=_ranged_float("mu", 0.0, 1.0, False, True),
                       default=DION3_DEFAULTS["dion3_mu"],
                       help="Momentum decay of the applied rows (error feedback), in [0, 1).")
    group.add_argument("--dion3-beta2", type=_ranged_float("beta2", 0.0, 1.0, False, True),
                       default=DION3_DEFAULTS["dion3_beta2"],
                       help="NorMuon per-row second-moment decay, in [0, 1).")
    group.add_argument("--dion3-eps", type=_ranged_float("eps", 0.0, float("inf"), True, True),
                       default=DION3_DEFAULTS["dion3_eps"], help="NorMuon epsilon (> 0).")
    group.add_argument("--dion3-adjust-lr", choices=ADJUST_LR_CHOICES, default=DION3_DEFAULTS["dion3_adjust_lr"],
                       help="lr multiplier of the orthogonalized step: spectral_norm = sqrt(rows/cols); "
                            "rms_norm = 0.2 sqrt(max(rows, cols)) (AdamW lr/wd transfer).")
    group.add_argument("--dion3-selection-scope", choices=SELECTION_SCOPES,
                       default=DION3_DEFAULTS["dion3_selection_scope"],
                       help="global: top rows of the whole logical matrix (identical at any parallel "
                            "size); local: top rows per tensor-parallel shard (cheaper).")
    group.add_argument("--dion3-ns", choices=NS_METHODS, default=DION3_DEFAULTS["dion3_ns"],
                       help="Orthogonalization: Gram Newton-Schulz or standard Newton-Schulz.")
    group.add_argument("--dion3-scale-lr-by-fraction", action="store_true",
                       default=DION3_DEFAULTS["dion3_scale_lr_by_fraction"],
                       help="Multiply the Dion3 step by 1/sqrt(fraction) (keeps the step norm as f shrinks).")
    group.add_argument("--dion3-scale-mu-by-fraction", action="store_true",
                       default=DION3_DEFAULTS["dion3_scale_mu_by_fraction"],
                       help="Applied rows' momentum decays by mu**(1/fraction) (the memory of heavy-ball "
                            "momentum with mu at every fraction).")
    group.add_argument("--dion3-no-cuda-graph", action="store_false", dest="dion3_cuda_graph",
                       help="Step matrices a rank holds whole eagerly instead of replaying a CUDA graph.")
    group.add_argument("--dion3-no-split-qkv", action="store_false", dest="dion3_split_qkv",
                       help="Orthogonalize the fused QKV weight as one matrix instead of Q, K, V apart.")
    group.add_argument("--dion3-no-split-glu", action="store_false", dest="dion3_split_glu",
                       help="Orthogonalize a SwiGLU fc1 as one matrix instead of gate and up apart.")
    return parser
