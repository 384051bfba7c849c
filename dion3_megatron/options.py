"""Every user-facing Dion3 option, declared once (:data:`OPTIONS`: name, kind, default, allowed
values, help), and the checks of what a user gives, wherever it enters: the torch ``Dion3``'s and
the DeepSpeed classes' keyword arguments (spelled out in their signatures) and param groups,
DeepSpeed's ``"params"`` (:mod:`dion3_megatron.deepspeed.config`), Megatron's ``--dion3-<name>``
flags, ``OptimizerConfig.dion3_<name>`` fields and ``MegatronDion3`` keyword arguments
(:mod:`dion3_megatron.megatron.arguments`), torchtitan's kwargs. :func:`hyperparameters` fills the
rule's settings (:class:`dion3_megatron.core.rule.Dion3Hyperparameters`) with these defaults.

tests/unit/test_options.py checks that every front end takes exactly its options, with these defaults,
ranges and types; tools/configuration_md.py renders them as docs/configuration.md. To add an
option: declare it here, add it to the signatures of its front ends, use it in the rule (or the
front end that owns it), and extend that test where the option needs a value of its own.
"""

from __future__ import annotations

import argparse
import difflib
import math
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Union

import torch

from .core.ortho import NS_DTYPES
from .core.rounding import MOMENTUM_DTYPES
from .core.rule import ADJUST_LR_CHOICES, AUTO, Dion3Hyperparameters
from .kernels.config import KERNELS

NS_METHODS = ("gram", "standard")

TORCH, MEGATRON, DEEPSPEED = "torch", "megatron", "deepspeed"
FRONT_ENDS = (TORCH, MEGATRON, DEEPSPEED)
_EVERYWHERE = frozenset(FRONT_ENDS)
_NOT_MEGATRON = frozenset((TORCH, DEEPSPEED))  # Megatron passes its own lr, weight decay and param groups

# The kinds of value an option takes (each has one check and one description).
REAL = "real"  # a finite int or float in [low, high] (either end open, either end unbounded); with
# ``tensor``, a 0-d floating tensor of one too (torch's optimizers take a tensor lr)
FRACTION = "fraction"  # a REAL or "auto"
BOOL = "bool"
CHOICE = "choice"  # one of ``choices``
HEADS = "heads"  # None or a positive int
DTYPE = "dtype"  # None, or one of NS_DTYPES by name or as its torch.dtype
STORAGE_DTYPE = "storage_dtype"  # one of MOMENTUM_DTYPES by name or as its torch.dtype
BETAS = "betas"  # two REALs in [0, 1)
_ANNOTATIONS = {
    REAL: float,
    FRACTION: Union[float, str],
    BOOL: bool,
    CHOICE: str,
    HEADS: Optional[int],
    DTYPE: Optional[Union[torch.dtype, str]],
    STORAGE_DTYPE: Union[torch.dtype, str],
    BETAS: tuple[float, float],
}


def is_real(value: Any) -> bool:
    """A finite int or float, not a bool (True would pass for 1 and reach the math as one)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def is_number_tensor(value: Any) -> bool:
    """A 0-d floating tensor: how torch's optimizers also take an lr."""
    return isinstance(value, torch.Tensor) and value.dim() == 0 and value.is_floating_point()


@dataclass(frozen=True)
class Option:
    """One option. ``name`` is the keyword argument, the param-group key and the DeepSpeed key;
    Megatron spells it ``dion3_<name>`` (config field) and ``--dion3-<name>`` (flag)."""

    name: str
    kind: str
    default: Any
    help: str
    front_ends: frozenset[str] = _EVERYWHERE
    low: Optional[float] = None  # REAL / FRACTION: bounds, None for unbounded
    high: Optional[float] = None
    low_open: bool = False
    high_open: bool = False
    choices: tuple[str, ...] = ()
    tensor: bool = False  # REAL: a 0-d floating tensor holding the number is taken too
    hyperparameter: bool = True  # a field of rule.Dion3Hyperparameters
    group_key: bool = True  # carried by each param group (else one value per optimizer)

    @property
    def annotation(self) -> Any:
        if self.tensor:
            return Union[float, torch.Tensor]
        if self.default is None and self.kind in (REAL, CHOICE):
            return Optional[_ANNOTATIONS[self.kind]]
        return _ANNOTATIONS[self.kind]

    def in_range(self, value: float) -> bool:
        above = self.low is None or (value > self.low if self.low_open else value >= self.low)
        below = self.high is None or (value < self.high if self.high_open else value <= self.high)
        return above and below

    def range_text(self, number=lambda x: f"{x:g}") -> str:
        """ "[0, 1)", "(0, 1]"; one-sided ranges as ">= 0", "> 0"."""
        if self.low is not None and self.high is not None:
            lo, hi = ("(" if self.low_open else "["), (")" if self.high_open else "]")
            return f"in {lo}{number(self.low)}, {number(self.high)}{hi}"
        if self.low is not None:
            return f"{'>' if self.low_open else '>='} {number(self.low)}"
        return f"{'<' if self.high_open else '<='} {number(self.high)}"

    def number_text(self, number=lambda x: f"{x:g}") -> str:
        """The numbers a REAL (or FRACTION) takes: "in [0, 1)", "a finite number >= 0"."""
        two_sided = self.low is not None and self.high is not None
        return self.range_text(number) if two_sided else f"a finite number {self.range_text(number)}"

    def allowed(self) -> str:
        """What the option accepts, in the words of every error message."""
        if self.kind == REAL:
            return self.number_text() + (", or a 0-d floating tensor holding one" if self.tensor else "")
        if self.kind == FRACTION:
            return f"{self.range_text()} or {AUTO!r}"
        if self.kind == BOOL:
            return "a bool"
        if self.kind == CHOICE:
            return f"{'None or ' if self.default is None else ''}one of {self.choices}"
        if self.kind == HEADS:
            return "None or a positive int"
        if self.kind == DTYPE:
            return f"None, or one of {tuple(NS_DTYPES)} by name or as a torch.dtype"
        if self.kind == STORAGE_DTYPE:
            dtypes = " or ".join(dict.fromkeys(str(dtype) for dtype in MOMENTUM_DTYPES.values()))
            return f"one of {tuple(MOMENTUM_DTYPES)}, or {dtypes}"
        if self.kind == BETAS:
            return "two values in [0, 1)"
        raise AssertionError(f"unknown option kind {self.kind!r}")

    def argparse_type(self):
        """The ``type=`` of a command-line flag for a REAL or FRACTION ("auto" taken as it is): the
        number, or argparse's error naming the option and the value."""

        def parse(text: str) -> float | str:
            if self.kind == FRACTION and text == AUTO:
                return text
            # (a flag's value is text: a number, or "auto" where the option takes it, never a tensor)
            what = self.allowed() if self.kind == FRACTION else self.number_text()
            try:
                value = float(text)
            except ValueError:
                raise argparse.ArgumentTypeError(f"{self.name} must be {what}, got {text!r}") from None
            if not self.valid(value):
                raise argparse.ArgumentTypeError(f"{self.name} must be {what}, got {value}")
            return value

        parse.__name__ = self.name
        return parse

    def valid(self, value: Any) -> bool:
        if value is None and self.default is None:
            return True  # not set
        if self.kind == REAL:
            if self.tensor and is_number_tensor(value):
                value = value.item()
            return is_real(value) and self.in_range(value)
        if self.kind == FRACTION:
            return value == AUTO if isinstance(value, str) else is_real(value) and self.in_range(value)
        if self.kind == BOOL:
            return isinstance(value, bool)
        if self.kind == CHOICE:
            return isinstance(value, str) and value in self.choices
        if self.kind == HEADS:
            return value is None or (isinstance(value, int) and not isinstance(value, bool) and value > 0)
        if self.kind == DTYPE:
            return value is None or value in NS_DTYPES.values() or isinstance(value, str) and value in NS_DTYPES
        if self.kind == STORAGE_DTYPE:
            return value in MOMENTUM_DTYPES.values() or isinstance(value, str) and value in MOMENTUM_DTYPES
        if self.kind == BETAS:
            return isinstance(value, (tuple, list)) and len(value) == 2 and all(is_real(b) and 0 <= b < 1 for b in value)
        raise AssertionError(f"unknown option kind {self.kind!r}")


_UNIT: dict[str, Any] = dict(low=0.0, high=1.0, high_open=True)  # [0, 1)
_OPTIMIZER_WIDE: dict[str, Any] = dict(hyperparameter=False, group_key=False)

OPTIONS: tuple[Option, ...] = (
    # 0.01 is Dion3's best lr at f = 1 on the GPTs the defaults are tuned on; with
    # scale_lr_by_fraction every other f then steps at its own best (0.02-0.04 at f = 1/4). AdamW on
    # embeddings at such an lr makes the loss spike, hence adamw_lr of its own.
    Option(
        "lr",
        REAL,
        0.01,
        "learning rate of the Dion3 matrices at f = 1 (see scale_lr_by_fraction; also the "
        "lr of the AdamW tensors of a group that mixes both)",
        front_ends=_NOT_MEGATRON,
        low=0.0,
        tensor=True,
    ),
    Option(
        "adamw_lr",
        REAL,
        0.002,
        "learning rate of the AdamW groups (algorithm 'adamw'; under DeepSpeed also "
        "the < 2-D tensors of a plain parameter list) that set none of their own, > 0",
        front_ends=_NOT_MEGATRON,
        low=0.0,
        low_open=True,
        tensor=True,
        **_OPTIMIZER_WIDE,
    ),
    Option(
        "fraction",
        FRACTION,
        AUTO,
        "share of each matrix's rows updated per step, in (0, 1] (paper: 1/4 or "
        "1/8), or 'auto': chosen per matrix from its shape, the world size and the device's speed",
        low=0.0,
        high=1.0,
        low_open=True,
    ),
    Option(
        "mu",
        REAL,
        None,
        "share of the applied rows' momentum kept after a step (error feedback), in [0, 1); "
        "None: 0.6 at f = 1/4 and the same memory per step at any f, 0.6 ** (1 / (4 f)) (0.36 at f = 1/8, "
        "0.88 at f = 1); the reference's 0.95 trails Muon at f < 1",
        **_UNIT,
    ),
    Option("beta2", REAL, 0.95, "NorMuon per-row second-moment decay, in [0, 1)", **_UNIT),
    Option("weight_decay", REAL, 0.01, "decoupled weight decay (both algorithms), >= 0", front_ends=_NOT_MEGATRON, low=0.0),
    Option("eps", REAL, 1e-8, "NorMuon / AdamW epsilon, > 0", low=0.0, low_open=True),
    Option(
        "adjust_lr",
        CHOICE,
        "spectral_norm",
        "multiplier of the orthogonalized step's lr: spectral_norm = "
        "sqrt(rows/cols); rms_norm = 0.2 sqrt(max(rows, cols)) (AdamW lr/wd transfer)",
        choices=ADJUST_LR_CHOICES,
    ),
    Option(
        "scale_lr_by_fraction",
        BOOL,
        True,
        "a matrix at fraction f steps and decays at lr / max(f, 1/4): lr is "
        "f = 1's, and each f takes its measured best (2x lr at f = 1/2, 4x at f <= 1/4); False: lr at every f",
    ),
    Option(
        "scale_mu_by_fraction",
        BOOL,
        False,
        "the applied rows keep mu ** (1/fraction) of their momentum "
        "instead of mu: the memory of heavy-ball momentum with mu at every fraction (needs an explicit mu)",
    ),
    Option(
        "staleness",
        REAL,
        1.0,
        "selection favours rows that waited: each row's L1 score times "
        "1 + staleness * f * (steps since the row was last applied); 0: plain L1 norms",
        low=0.0,
    ),
    Option(
        "num_heads",
        HEADS,
        None,
        "select rows per head (rows viewed as heads x head_dim): a positive int, or None",
        front_ends=_NOT_MEGATRON,
    ),
    Option("ns_method", CHOICE, "gram", "orthogonalization: 'gram' (Gram Newton-Schulz) or 'standard' (Newton-Schulz)", choices=NS_METHODS),
    Option(
        "ns_dtype",
        DTYPE,
        None,
        "compute dtype of the orthogonalization: None is fp16 on GPUs and fp32 on CPU, or one of float16, bfloat16, float32, float64",
        front_ends=_NOT_MEGATRON,
    ),
    Option(
        "momentum_dtype",
        STORAGE_DTYPE,
        "fp32",
        "what the momentum is stored in: fp32, or bf16 (half the bytes; computed in fp32, stored with "
        "stochastic rounding, so small gradients still move it)",
    ),
    Option("betas", BETAS, (0.9, 0.95), "AdamW betas, two values in [0, 1)", front_ends=_NOT_MEGATRON, hyperparameter=False),
    Option(
        "kernels",
        CHOICE,
        None,
        "which matrix products the orthogonalization of the optimizer's steps runs: "
        "'auto', the package's symmetric-GEMM kernels where they measured faster; 'torch', plain torch; None, "
        "the process's kernel configuration (dion3_megatron.kernels.configure; DION3_KERNELS=0 makes it "
        "'torch'); the Triton row kernels follow it too (and DION3_FUSED_ROWS=0)",
        choices=KERNELS,
        **_OPTIMIZER_WIDE,
    ),
    Option("cuda_graph", BOOL, True, "replay the part of the step that one GPU runs alone as a CUDA graph", **_OPTIMIZER_WIDE),
    Option(
        "offload",
        BOOL,
        False,
        "keep the Dion3 state in pinned host memory and stream it through the GPU at each step, one shape group at a time "
        "(the next group's copy overlapping this group's step, run eagerly): the GPU holds about two shape groups' state "
        "during a step and none between steps, for the state's round trip over the host link; AdamW's state stays beside "
        "its tensors. Parameters (or FSDP2 pieces) in host memory travel with their group's state. Without a GPU the state "
        "is in host memory already: no change. Under DeepSpeed ZeRO, offload_optimizer sets it",
        front_ends=_NOT_MEGATRON,
        **_OPTIMIZER_WIDE,
    ),
    Option(
        "split_qkv",
        BOOL,
        True,
        "orthogonalize Q, K and V of a fused QKV weight as separate matrices",
        front_ends=frozenset((MEGATRON,)),
        **_OPTIMIZER_WIDE,
    ),
    Option(
        "split_glu",
        BOOL,
        True,
        "orthogonalize the gate and up halves of a SwiGLU fc1 as separate matrices",
        front_ends=frozenset((MEGATRON,)),
        **_OPTIMIZER_WIDE,
    ),
)

BY_NAME: dict[str, Option] = {option.name: option for option in OPTIONS}

# Names carried over from other optimizers, with what Dion3 calls them: the unknown-name error of
# every front end (keyword argument, DeepSpeed config key) gives the hint. A name that is an option
# of the front end never gets here (betas is one everywhere but Megatron).
HINTS = {
    "momentum": "Dion3 calls its momentum 'mu'",
    "beta1": "Dion3 calls its momentum 'mu' (AdamW's are 'betas')",
    "betas": "Dion3 calls its momentum 'mu'; Megatron's Adam takes --adam-beta1 / --adam-beta2",
    "nesterov": "Dion3 uses heavy-ball momentum with error feedback; there is no Nesterov option",
    "dampening": "Dion3 adds every gradient to its momentum in full; 'mu' sets what the applied rows keep",
    "adam_lr": "Dion3 calls it 'adamw_lr'",
    "ns_steps": "Dion3 runs 5 Polar Express steps; choose the method with 'ns_method'",
    "rank_fraction": "did you mean 'fraction'?",
    "offload": "Megatron offloads Dion3's state with its own --optimizer-cpu-offload",
}


def unknown_name_hint(name: str, known: Iterable[str], hints: Optional[dict[str, str]] = None) -> Optional[str]:
    """What to tell the user who gave ``name``, not one of ``known``: its entry in ``hints``
    (default :data:`HINTS`), else the closest known name, else None."""
    hint = (HINTS if hints is None else hints).get(name)
    if hint is None:
        close = close_option(name, known)
        hint = f"did you mean {close!r}?" if close else None
    return hint


def options_for(front_end: str) -> tuple[Option, ...]:
    """The options a front end ("torch", "megatron", "deepspeed") takes, in declaration order."""
    if front_end not in FRONT_ENDS:
        raise ValueError(f"front_end must be one of {FRONT_ENDS}, got {front_end!r}")
    return tuple(option for option in OPTIONS if front_end in option.front_ends)


def defaults_for(front_end: str) -> dict[str, Any]:
    """{name: default} of the options a front end takes."""
    return {option.name: option.default for option in options_for(front_end)}


def hyperparameter_names() -> tuple[str, ...]:
    """The options that are fields of rule.Dion3Hyperparameters."""
    return tuple(option.name for option in OPTIONS if option.hyperparameter)


def hyperparameters(**overrides: Any) -> Dion3Hyperparameters:
    """The rule's settings: the defaults of the options that are its fields, updated with
    ``overrides`` (ValueError for a name that is not one). Values are not checked here (see
    :func:`check`). Values become what the rule computes with: an ``ns_dtype`` name its torch.dtype,
    a tensor lr its number, a ``momentum_dtype`` name its torch.dtype; ``fraction="auto"`` stays
    itself, which the engine's plan resolves to a number
    (:func:`dion3_megatron.engine.plan.resolve_fractions`)."""
    names = hyperparameter_names()
    for name in overrides:
        if name not in names:
            hint = unknown_name_hint(name, names)
            raise UnknownOptionError(f"{name!r} is not a field of Dion3Hyperparameters" + (f" ({hint})" if hint else ""))
    values = {**{name: BY_NAME[name].default for name in names}, **overrides}
    if isinstance(values["ns_dtype"], str):
        values["ns_dtype"] = NS_DTYPES[values["ns_dtype"]]
    values["momentum_dtype"] = momentum_dtype(values["momentum_dtype"])
    if is_number_tensor(values["lr"]):
        values["lr"] = values["lr"].item()
    return Dion3Hyperparameters(**values)


def momentum_dtype(value: Union[torch.dtype, str]) -> torch.dtype:
    """A ``momentum_dtype`` value (a name or a torch.dtype) as its torch.dtype."""
    return MOMENTUM_DTYPES[value] if isinstance(value, str) else value


def group_keys(front_end: str) -> tuple[str, ...]:
    """The options a front end carries in each param group."""
    return tuple(option.name for option in options_for(front_end) if option.group_key)


def settings(where: str, front_end: str, given: dict[str, Any], hints: Optional[dict[str, str]] = None) -> dict[str, Any]:
    """A front end's options: the defaults updated with ``given``, which must name only its options
    (:class:`UnknownOptionError` otherwise, with the did-you-mean hint), checked (:func:`check`:
    ValueError naming ``where``, the option and the value), in their torch spellings: ``betas`` a
    tuple, ``ns_dtype`` a torch.dtype."""
    known = defaults_for(front_end)
    unknown = [name for name in given if name not in known]
    if unknown:
        raise unknown_option(where, unknown, known, hints)
    resolved = {**known, **given}
    check(where, **resolved)
    if resolved.get("betas") is not None:  # (a JSON list)
        resolved["betas"] = tuple(resolved["betas"])
    if isinstance(resolved.get("ns_dtype"), str):  # (a name)
        resolved["ns_dtype"] = NS_DTYPES[resolved["ns_dtype"]]
    return resolved


def refuse_unknown(where: str, front_end: str, unknown: dict[str, Any], hints: Optional[dict[str, str]] = None) -> None:
    """Refuse the keyword arguments a constructor caught beside its options (its ``**unknown``):
    :class:`UnknownOptionError` naming each, with its did-you-mean hint."""
    if unknown:
        raise unknown_option(where, unknown, defaults_for(front_end), hints)


def from_signature(front_end: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """The options a constructor whose signature spells out a front end's options was called with
    (``arguments``: its ``locals()``)."""
    return {option.name: arguments[option.name] for option in options_for(front_end)}


def refuse_group_keys(where: str, group: dict, front_end: str, set_on: str, other_keys: Iterable[str] = ()) -> None:
    """Refuse a param-group key that is an option of one value per optimizer (ValueError saying
    where it goes: ``set_on``, the front end's place for optimizer-wide options) or looks like a
    misspelt option (:class:`UnknownOptionError` with the hint). ``other_keys`` (the front end's own:
    ``params``, ``algorithm``, ...) and keys far from every option pass: frameworks keep keys of
    their own in param groups."""
    per_group = group_keys(front_end)
    for key in group:
        option = BY_NAME.get(key)
        if key in per_group or key in other_keys:
            continue
        if option is not None and front_end in option.front_ends:
            instead = "set 'lr' in that group (an AdamW group's lr), or " if key == "adamw_lr" else ""
            raise ValueError(
                f"{where}: {key!r} is one value per optimizer, not per param group: {instead}set it in {set_on}. "
                f"Per param group: {', '.join(per_group)}; per optimizer: "
                f"{', '.join(o.name for o in options_for(front_end) if o.name not in per_group)}"
            )
        if option is not None or key in HINTS or close_option(key, per_group):
            raise unknown_option(where, key, per_group)


class UnknownOptionError(TypeError):
    """A name that is no Dion3 option where an option is expected, in every front end: a keyword
    argument, a param-group key, a DeepSpeed config key, a Megatron ``dion3_*`` field, a torchtitan
    kwarg. A TypeError, as Python's own for an unexpected keyword argument; its message names the
    option meant where one is close."""


def close_option(name: str, known: Iterable[str]) -> Optional[str]:
    """The known name closest to ``name``, if one is close."""
    close = difflib.get_close_matches(str(name), list(known), n=1)
    return close[0] if close else None


def unknown_option(
    where: str, names: str | Iterable[str], known: Iterable[str], hints: Optional[dict[str, str]] = None
) -> UnknownOptionError:
    """The error for ``names`` (one or several), not among ``known``, given in ``where``: each with
    its hint (:func:`unknown_name_hint`), then the known names."""
    known = list(known)
    said = []
    for name in [names] if isinstance(names, str) else names:
        hint = unknown_name_hint(name, known, hints)
        said.append(f"{name!r} is not a Dion3 option here" + (f" ({hint})" if hint else ""))
    return UnknownOptionError(f"{where}: {', '.join(said)}; the options here are {', '.join(known)}")


def check(where: str, prefix: str = "", **values: Any) -> None:
    """Raise ValueError naming ``where``, the option (as ``prefix + name``) and its value when a
    value is out of range or of the wrong type; names that are not options are ignored."""
    for name, value in values.items():
        option = BY_NAME.get(name)
        if option is not None and not option.valid(value):
            raise ValueError(f"{where}: {prefix}{name} must be {option.allowed()}, got {value!r}")
    if values.get("scale_mu_by_fraction") is True and "mu" in values and values["mu"] is None:
        raise ValueError(
            f"{where}: {prefix}scale_mu_by_fraction=True scales an explicit {prefix}mu, got "
            f"{prefix}mu=None (whose default already depends on f); set {prefix}mu, or leave "
            f"{prefix}scale_mu_by_fraction off"
        )


def check_num_heads(where: str, num_heads: Optional[int], n_rows: int, what: str) -> None:
    """Per-head selection views a matrix's rows as heads x head_dim: num_heads must divide them."""
    if num_heads is not None and n_rows % num_heads:
        raise ValueError(f"{where}: num_heads={num_heads} does not divide the {n_rows} rows of {what}")
