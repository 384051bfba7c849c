"""Megatron's precision-aware optimizer for ``--optimizer dion3``: ``--use-precision-aware-optimizer
--exp-avg-dtype bf16`` stores Dion3's momentum in bf16 (the option ``momentum_dtype``, also
``--dion3-momentum-dtype``).

Megatron-Core 0.19 allows ``use_precision_aware_optimizer`` for Adam under the distributed optimizer
only (``OptimizerConfig.__post_init__``), where Transformer Engine's FusedAdam keeps its moments in
the dtypes it is given. For a Dion3 run, through the entries of :data:`~.registry.MEGATRON`:

* ``--exp-avg-dtype`` (the dtype of Adam's first moment) is the dtype of Dion3's momentum, fp32 or
  bf16 (:func:`momentum_dtype`); ``--dion3-momentum-dtype`` says the same, and where both are given
  they must agree. What Dion3 cannot take (:func:`refusal`: ``--exp-avg-sq-dtype``,
  ``--main-params-dtype``, ``--main-grads-dtype`` other than fp32) stops the run in one line, also
  in the launcher before Megatron starts (:func:`precision_validation` for Megatron-LM's args);
* ``OptimizerConfig`` takes the precision-aware optimizer for ``optimizer='dion3'``
  (:func:`config_post_init`), and Megatron's own code builds the run's optimizers from a copy of the
  config without it (:func:`megatron_view`): Megatron's Adam part (embeddings, output layer, norms,
  biases) keeps fp32 moments, as without the flag.
"""

from __future__ import annotations

import copy
import functools
import logging
from typing import Any, Optional

import torch
import torch.distributed as dist

from .. import options
from .arguments import config_field, flag, is_dion3

logger = logging.getLogger(__name__)

# Megatron's state dtypes Dion3 takes at fp32 only: (field, flag, why).
_FP32_ONLY = (
    ("exp_avg_sq_dtype", "--exp-avg-sq-dtype", "Dion3 keeps one variance per row of a matrix, in fp32 (a few bytes per row)"),
    ("main_params_dtype", "--main-params-dtype", "Dion3 steps fp32 main parameters"),
    ("main_grads_dtype", "--main-grads-dtype", "Dion3 steps fp32 main gradients"),
)
_EXP_AVG = ("exp_avg_dtype", "--exp-avg-dtype")
_PRECISION_AWARE = ("use_precision_aware_optimizer", "--use-precision-aware-optimizer")
_MOMENTUM = config_field("momentum_dtype")
# Megatron's names of its dtypes (its args hold the name, or the torch dtype after validate_args).
_DTYPE_NAMES: dict[Any, str] = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.uint8: "fp8"}


def dtype_name(value: Any) -> Any:
    """A Megatron state dtype (a torch dtype or Megatron's name for it) by Megatron's name."""
    return _DTYPE_NAMES.get(value, value)


def _exp_avg(source: Any) -> Any:
    return dtype_name(getattr(source, _EXP_AVG[0], "fp32"))


def refusal(source: Any, flags: bool) -> Optional[str]:
    """One line for what a Dion3 run cannot take of Megatron's precision-aware settings
    (``source``: Megatron-LM's args or an ``OptimizerConfig``), naming the flag (``flags``) or the
    config field; None where it takes them all."""
    name = (lambda field, flag_: flag_) if flags else (lambda field, flag_: field)
    for field, flag_, why in _FP32_ONLY:
        given = dtype_name(getattr(source, field, "fp32"))
        if given != "fp32":
            return f"--optimizer dion3: {name(field, flag_)} must be fp32, got {given}: {why}"
    exp_avg = _exp_avg(source)
    if exp_avg == "fp32":
        return None
    if exp_avg not in options.MOMENTUM_DTYPES:
        return f"--optimizer dion3: {name(*_EXP_AVG)} must be fp32 or bf16 (the dtype of Dion3's momentum), got {exp_avg}"
    if not getattr(source, _PRECISION_AWARE[0], False):
        return (
            f"--optimizer dion3: {name(*_EXP_AVG)} {exp_avg} is the precision-aware optimizer's: add {name(*_PRECISION_AWARE)} "
            f"(or give {name(_MOMENTUM, flag('momentum_dtype'))} {exp_avg})"
        )
    given = getattr(source, _MOMENTUM, None)
    if given is None or not options.BY_NAME["momentum_dtype"].valid(given):  # (a bad value: the option's own error)
        return None
    if options.momentum_dtype(given) != options.MOMENTUM_DTYPES[exp_avg]:
        return (
            f"--optimizer dion3: {name(_MOMENTUM, flag('momentum_dtype'))} {given} and {name(*_EXP_AVG)} {exp_avg} disagree "
            "(both set the dtype of Dion3's momentum): give one of them"
        )
    return None


def momentum_dtype(source: Any, otherwise: Any = None) -> Any:
    """What Dion3 stores its momentum in (``source``: Megatron-LM's args or an ``OptimizerConfig``
    that :func:`refusal` accepted): ``dion3_momentum_dtype`` where it is set, else ``exp_avg_dtype``
    under the precision-aware optimizer, else ``otherwise`` (unset: the option's default)."""
    given = getattr(source, _MOMENTUM, None)
    if given is not None:
        return given
    if getattr(source, _PRECISION_AWARE[0], False):
        return _exp_avg(source)
    return otherwise if otherwise is not None else options.BY_NAME["momentum_dtype"].default


def precision_validation(validate_args):
    """Megatron-LM's ``validate_args``; for ``--optimizer dion3``, first what Dion3 cannot take of
    the precision-aware settings stops the run in one line (:func:`refusal`), and
    ``dion3_momentum_dtype`` becomes what the momentum is stored in (:func:`momentum_dtype`), which
    Megatron's argument dump then shows."""

    @functools.wraps(validate_args)
    def validate(args, *rest, **kwargs):
        if is_dion3(getattr(args, "optimizer", None)):
            refused = refusal(args, flags=True)
            if refused is not None:
                raise SystemExit(refused)
            setattr(args, _MOMENTUM, momentum_dtype(args))
        return validate_args(args, *rest, **kwargs)

    return validate


def config_post_init(post_init):
    """``OptimizerConfig.__post_init__``; for ``optimizer='dion3'`` with the precision-aware
    optimizer, what Dion3 cannot take is refused (ValueError, one line) and Megatron's other checks
    run as without the precision-aware optimizer (which they allow for Adam only, and, without
    CPU offload, with Transformer Engine's FusedAdam only). The config keeps the fields as given;
    Megatron's code sees them through :func:`megatron_view`."""

    @functools.wraps(post_init)
    def __post_init__(self) -> None:
        if not (is_dion3(getattr(self, "optimizer", None)) and self.use_precision_aware_optimizer):
            return post_init(self)
        refused = refusal(self, flags=False)
        if refused is not None:
            raise ValueError(refused)
        given = self.exp_avg_dtype
        self.use_precision_aware_optimizer, self.exp_avg_dtype = False, torch.float32
        try:
            post_init(self)
        finally:
            self.use_precision_aware_optimizer, self.exp_avg_dtype = True, given

    return __post_init__


def megatron_view(config: Any) -> Any:
    """The config a Dion3 run's optimizers are built from: ``config`` itself, or under the
    precision-aware optimizer a copy that carries the momentum's dtype in ``dion3_momentum_dtype``
    and has the precision-aware optimizer off, so Megatron's Adam part and wrappers run as without it
    (Megatron's Adam would otherwise ask for Transformer Engine's FusedAdam)."""
    if not getattr(config, _PRECISION_AWARE[0], False):
        return config
    refused = refusal(config, flags=False)
    if refused is not None:
        raise ValueError(refused)
    view = copy.copy(config)
    setattr(view, _MOMENTUM, momentum_dtype(config))
    view.use_precision_aware_optimizer = view.use_precision_aware_optimizer_no_fp8_or_ds_fp8 = False
    view.exp_avg_dtype = torch.float32
    if not dist.is_initialized() or dist.get_rank() == 0:
        logger.info(
            "--optimizer dion3 --use-precision-aware-optimizer: Dion3's momentum is stored in %s; Megatron's Adam part "
            "(embeddings, output layer, norms, biases) keeps fp32 moments",
            getattr(view, _MOMENTUM),
        )
    return view
