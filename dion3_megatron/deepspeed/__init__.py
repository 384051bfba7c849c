"""Dion3 for DeepSpeed: ``"optimizer": {"type": "Dion3", "params": {...}}`` in the JSON config.

``import dion3_megatron.deepspeed`` (or calling :func:`register`) is all a training script needs:

* exposes :class:`DeepSpeedDion3` as ``torch.optim.Dion3``, which is where DeepSpeed 0.19 looks up
  a config ``type`` it does not know (the name is case-sensitive);
* lists it among ZeRO's supported optimizers (no ``zero_allow_untested_optimizer`` needed);
* makes ``deepspeed.initialize`` fail clearly for what it does not support (ZeRO stage 3,
  optimizer offload), instead of failing or silently misbehaving later.

Supported: ZeRO stages 0, 1, 2; fp32, bf16 (and fp16 with DeepSpeed's loss scaling); gradient
accumulation; gradient clipping (on raw gradients); MoE parameter groups (expert-data-parallel);
checkpoints, elastic loading and ``ds_to_universal``. See docs/deepspeed.md.
"""

from __future__ import annotations

from .config import ALLOWED as CONFIG_KEYS
from .config import normalize_params
from .optimizer import DeepSpeedDion3
from .groups import param_groups

__all__ = ["DeepSpeedDion3", "register", "normalize_params", "param_groups", "CONFIG_KEYS", "SUPPORTED_DEEPSPEED"]

SUPPORTED_DEEPSPEED = (">=0.19", "<0.20")
_REGISTERED = False


def _check_deepspeed_version() -> None:
    import deepspeed
    from packaging.version import Version

    v = Version(deepspeed.__version__.split("+")[0])
    if not (Version("0.19") <= v < Version("0.20")):
        import warnings

        warnings.warn(
            f"dion3_megatron.deepspeed is tested with DeepSpeed 0.19.x (it relies on ZeRO's private "
            f"_hp_mapping / _dp_group attributes); found {deepspeed.__version__}",
            RuntimeWarning,
            stacklevel=3,
        )


def register() -> type:
    """Make ``"type": "Dion3"`` work in DeepSpeed configs; idempotent. Returns the class."""
    global _REGISTERED
    import torch

    torch.optim.Dion3 = DeepSpeedDion3
    if _REGISTERED:
        return DeepSpeedDion3
    try:
        import deepspeed  # noqa: F401
    except ImportError:  # plain torch users can still construct DeepSpeedDion3
        _REGISTERED = True
        return DeepSpeedDion3
    _check_deepspeed_version()
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero import utils as zero_utils

    if DeepSpeedDion3 not in zero_utils.ZERO_SUPPORTED_OPTIMIZERS:
        zero_utils.ZERO_SUPPORTED_OPTIMIZERS.append(DeepSpeedDion3)

    original = DeepSpeedEngine._configure_zero_optimizer
    if not getattr(original, "_dion3_guard", False):

        def _configure_zero_optimizer(self, optimizer):
            if isinstance(optimizer, DeepSpeedDion3):
                stage = self.zero_optimization_stage()
                if stage > 2:
                    raise ValueError(
                        f"Dion3 supports DeepSpeed ZeRO stages 0, 1 and 2; the config asks for stage {stage}. "
                        'Set "zero_optimization": {"stage": 1} (or 2).'
                    )
                if self.zero_cpu_offload():
                    raise ValueError(
                        "Dion3 does not support ZeRO optimizer offload (offload_optimizer): its step runs "
                        "collectives on the slices. Remove offload_optimizer from the config."
                    )
            return original(self, optimizer)

        _configure_zero_optimizer._dion3_guard = True
        DeepSpeedEngine._configure_zero_optimizer = _configure_zero_optimizer
    _REGISTERED = True
    return DeepSpeedDion3


register()
