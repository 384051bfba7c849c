"""Dion3 for DeepSpeed: ``"optimizer": {"type": "Dion3", "params": {...}}`` in the JSON config.

``import dion3_megatron.deepspeed`` (or calling [`register`][dion3_megatron.deepspeed.register]) is all
a training script needs. It applies ``DEEPSPEED`` (every DeepSpeed attribute this package adds or
replaces, with why and the upstream version) through ``dion3_megatron.compat``, which

* makes ``"dion3"`` one of DeepSpeed's own optimizer names, which its config lower-cases, and
  exposes [`DeepSpeedDion3`][dion3_megatron.deepspeed.DeepSpeedDion3] as ``torch.optim.dion3``, where
  DeepSpeed 0.19 then looks it up: ``"Dion3"``, ``"dion3"`` (the spelling of Megatron's
  ``--optimizer dion3``), ``"DION3"`` all work, and a near miss (``"Dion"``, ``"dion-3"``) fails at
  ``deepspeed.initialize`` saying ``"Dion3"``;
* lists it among ZeRO's supported optimizers (no ``zero_allow_untested_optimizer`` needed), and
  makes it a [`DeepSpeedZeroDion3`][dion3_megatron.deepspeed.DeepSpeedZeroDion3] where ZeRO stages 1-3
  (or BF16_Optimizer) will hand it flat partitions;
* splits the parameters DeepSpeed was given by module
  ([`engine_param_groups`][dion3_megatron.deepspeed.engine_param_groups], using the engine's model):
  embeddings, the output head and anything tied to it, norms and vectors
  take AdamW, hidden matrices Dion3; groups that set ``"algorithm"`` are kept;
* with ZeRO's ``"offload_optimizer": {"device": "cpu"}``, keeps Dion3's state in host memory
  beside DeepSpeed's partitions and steps them on the GPU (``dion3_megatron.engine.offload``);
* makes ``deepspeed.initialize`` fail clearly for what it does not support (offload to NVMe or of
  a part of the state, a plain [`dion3_megatron.Dion3`][] under ZeRO-1/2/3), instead of failing
  or silently misbehaving later.

What is supported (ZeRO stages, precisions, MoE, checkpoint formats), each with the test that shows
it: [docs/support.md](../support.md), the support matrix. How each stage steps:
[docs/deepspeed.md](../deepspeed.md).
"""

from __future__ import annotations

import difflib
import json
import re

from .. import compat
from . import checkpoint, zero3
from .base import become
from .config import ALLOWED as CONFIG_KEYS
from .config import normalize_params
from .optimizer import DeepSpeedDion3
from .zero_optimizer import DeepSpeedZeroDion3, Partition
from .groups import engine_param_groups, param_groups
from .conv1d import conv1d_as_linear

__all__ = [
    "DeepSpeedDion3",
    "DeepSpeedZeroDion3",
    "register",
    "unregister",
    "normalize_params",
    "param_groups",
    "engine_param_groups",
    "conv1d_as_linear",
    "CONFIG_KEYS",
    "SUPPORTED_DEEPSPEED",
]

CONFIG_NAME = "dion3"  # the config "type" as DeepSpeed keeps it (it lower-cases its own optimizers' names)

SUPPORTED_DEEPSPEED = (">=0.19", "<0.20")
"""The DeepSpeed versions this package is built for (the ``deepspeed`` extra's range); registering
with another version warns."""
_REGISTERED = False


def _check_deepspeed_version() -> None:
    import deepspeed
    from packaging.version import Version

    v = Version(deepspeed.__version__.split("+")[0])
    if not (Version("0.19") <= v < Version("0.20")):
        import warnings

        warnings.warn(
            f"dion3_megatron.deepspeed is tested with DeepSpeed 0.19.x (it relies on ZeRO's private "
            f"_hp_mapping / _dp_group attributes and ZeRO-3's partition layout); found {deepspeed.__version__}",
            RuntimeWarning,
            stacklevel=3,
        )


def register() -> type:
    """Make ``"type": "Dion3"`` (or ``"dion3"``) work in DeepSpeed configs: apply ``DEEPSPEED``,
    every DeepSpeed (and ``torch.optim``) attribute this package adds or replaces, with why and the
    upstream version. Idempotent. Returns the class."""
    global _REGISTERED
    if not _REGISTERED:
        try:
            _check_deepspeed_version()
        except ImportError:  # no DeepSpeed: plain torch users can still construct DeepSpeedDion3
            pass
    compat.apply(DEEPSPEED)
    _REGISTERED = True
    return DeepSpeedDion3


def unregister() -> None:
    """Undo :func:`register`: every DeepSpeed and ``torch.optim`` attribute of :data:`DEEPSPEED` it
    replaced is the original again, every one it added (``torch.optim.dion3``, ZeRO's
    supported-optimizer entry) is gone."""
    compat.restore(DEEPSPEED)


def deepspeed_class(_current=None) -> type:
    """What DeepSpeed finds for Dion3: :class:`DeepSpeedDion3`."""
    return DeepSpeedDion3


def config_name(_current=None) -> str:
    """The name DeepSpeed's list of its own optimizers gets: :data:`CONFIG_NAME`."""
    return CONFIG_NAME


def _near_dion3(name: str) -> bool:
    key = re.sub(r"[^a-z0-9]", "", name.lower())
    return key.startswith("dion") or bool(difflib.get_close_matches(key, [CONFIG_NAME], cutoff=0.6))


def name_hint(original):
    """``DeepSpeedEngine._is_supported_optimizer``: a config ``"type"`` close to Dion3's fails with
    one line naming ``"Dion3"`` (DeepSpeed's own refusal is a bare assertion)."""

    def _is_supported_optimizer(self, optimizer_name):
        if original(self, optimizer_name):
            return True
        if isinstance(optimizer_name, str) and _near_dion3(optimizer_name):
            raise ValueError(
                f'DeepSpeed config "optimizer": {{"type": {json.dumps(optimizer_name)}}} is no optimizer '
                'DeepSpeed knows; did you mean "Dion3"?'
            )
        return False

    return _is_supported_optimizer


def _offload_device(offload) -> str | None:
    """The device of a ZeRO ``offload_optimizer`` config (DeepSpeed's ``DeepSpeedZeroOffloadOptimizerConfig``,
    which holds it as a string or its enum), or None."""
    device = getattr(offload, "device", None)
    return getattr(device, "value", device)


def offload_refusal(offload) -> str | None:
    """What Dion3 cannot take of a ZeRO ``offload_optimizer`` config (or None), in one line; None
    where it takes it all: the device "cpu" (DeepSpeed keeps the fp32 partitions and their
    gradients in host memory; Dion3 keeps its state beside them and steps them on the GPU,
    streamed group by group)."""
    device = _offload_device(offload)
    if device in (None, "none", "cpu"):
        if device == "cpu" and offload.ratio != 1.0:
            return (
                f'Dion3 offloads all of its state or none: offload_optimizer "ratio" must be 1.0, got {offload.ratio} '
                "(a GPU holds about two shape groups' state during an offloaded step, and none between steps)"
            )
        if device == "cpu" and offload.super_offload:
            return 'offload_optimizer "super_offload" steps DeepSpeed\'s CPU Adam; Dion3 steps on the GPU: remove "super_offload"'
        return None
    return (
        f"Dion3 offloads its state to host memory, not to {device!r} (offload_optimizer device {device!r}): "
        'use "offload_optimizer": {"device": "cpu"}'
    )


def zero_stage_checks(original):
    """``DeepSpeedEngine._configure_zero_optimizer``: refuse what Dion3 cannot take of optimizer
    offload, naming what to set; with ``offload_optimizer`` to the CPU, Dion3 keeps its state in
    host memory too (:meth:`DeepSpeedZeroDion3.offload_state`). Once ZeRO has wrapped it, give it
    ZeRO's partitions and create their state."""

    def _configure_zero_optimizer(self, optimizer):
        if isinstance(optimizer, DeepSpeedZeroDion3):
            offload = self.zero_offload_optimizer()
            refusal = offload_refusal(offload)
            if refusal is not None:
                raise ValueError(refusal)
            if _offload_device(offload) == "cpu":
                optimizer.offload_state()
        wrapped = original(self, optimizer)
        if isinstance(optimizer, DeepSpeedZeroDion3):
            if self.zero_optimization_stage() == 3:
                optimizer.adopt_partitions(zero3.partitions_of(wrapped), wrapped._reassign_or_swap_out_partitioned_parameters)
            else:
                optimizer.adopt_partitions(
                    [Partition(gi, g["params"][0]) for gi, g in enumerate(optimizer._groups)], _zero12_write_back(wrapped)
                )
            optimizer.create_partition_state()
        return wrapped

    return _configure_zero_optimizer


def _zero12_write_back(wrapped):
    """ZeRO-1/2: copy group ``i``'s fp32 slice to its low-precision partition, as ZeRO does after
    each group's ``step()``."""
    import deepspeed.comm as ds_dist

    def write_back(i: int) -> None:
        rank = ds_dist.get_rank(group=wrapped.real_dp_process_group[i])
        wrapped.parallel_partitioned_bit16_groups[i][rank].data.copy_(wrapped.single_partition_of_fp32_groups[i].data)

    return write_back


def split_config_params(original):
    """``DeepSpeedEngine._configure_basic_optimizer``: with ``"type": "Dion3"`` in the config, split
    what DeepSpeed was given by the engine's model."""

    def _configure_basic_optimizer(self, model_parameters):
        if self.optimizer_name().lower() == CONFIG_NAME:
            model_parameters = engine_param_groups(self.module, model_parameters)
        return original(self, model_parameters)

    return _configure_basic_optimizer


def _plain_dion3_error(optimizer, wrapper: str) -> str:
    return (
        f"deepspeed.initialize got a plain {type(optimizer).__module__}.{type(optimizer).__qualname__}, "
        f"which steps whole parameters, but {wrapper} hands the optimizer flat slices of them. Pass "
        "dion3_megatron.deepspeed.DeepSpeedDion3 instead (same arguments; param_groups(model) splits a "
        'model), or put "optimizer": {"type": "Dion3", "params": {...}} in the config and import '
        "dion3_megatron.deepspeed"
    )


def stage_class(original):
    """``DeepSpeedEngine._do_optimizer_sanity_check``, where DeepSpeed decides how to wrap the
    optimizer: Dion3 for DeepSpeed becomes the class of that stage (:func:`.base.become`):
    :class:`DeepSpeedZeroDion3` where ZeRO-1/2/3 or BF16_Optimizer will hand it flat partitions,
    else :class:`DeepSpeedDion3`. A plain ``Dion3`` passed as ``optimizer=`` steps whole
    parameters: there it is refused, by name."""
    from deepspeed.runtime.constants import BFLOAT16
    from deepspeed.runtime.zero.config import ZERO_OPTIMIZATION

    from ..optimizer import Dion3

    def _do_optimizer_sanity_check(self, basic_optimizer):
        plain = isinstance(basic_optimizer, Dion3)
        if plain and self.zero_optimization() and self.zero_optimization_stage() >= 1:
            raise TypeError(_plain_dion3_error(basic_optimizer, f"ZeRO stage {self.zero_optimization_stage()}"))
        wrapper = original(self, basic_optimizer)
        if plain and wrapper == BFLOAT16:  # BF16_Optimizer: flat slices too
            raise TypeError(_plain_dion3_error(basic_optimizer, "DeepSpeed's BF16_Optimizer"))
        if isinstance(basic_optimizer, (DeepSpeedDion3, DeepSpeedZeroDion3)):
            partitioned = wrapper in (ZERO_OPTIMIZATION, BFLOAT16)
            if partitioned and basic_optimizer.offload:
                raise ValueError(
                    f'Dion3 "offload": true under ZeRO stage {self.zero_optimization_stage()}: DeepSpeed keeps the fp32 '
                    'partitions, so it decides where they and their state live: put "offload_optimizer": {"device": '
                    '"cpu"} in "zero_optimization" instead (Dion3 then steps them on the GPU)'
                )
            become(basic_optimizer, DeepSpeedZeroDion3 if partitioned else DeepSpeedDion3)
        return wrapper

    return _do_optimizer_sanity_check


DS_019 = "deepspeed 0.19.x (read in 0.19.8)"

# Every DeepSpeed (and torch.optim) attribute that register() replaces or adds; the fields:
# dion3_megatron.compat.
DEEPSPEED: tuple[compat.Patch, ...] = (
    compat.Patch(
        "deepspeed.runtime.config:DEEPSPEED_OPTIMIZERS[+]",
        config_name,
        'DeepSpeed lower-cases a config "type" that names one of its own optimizers: "Dion3", "DION3" and "dion3" all become "dion3"',
        DS_019,
        optional=True,
    ),
    compat.Patch(
        "torch.optim:dion3",
        deepspeed_class,
        'DeepSpeed 0.19 looks the optimizer of a config "type" up in torch.optim: "dion3" builds DeepSpeedDion3',
        DS_019,
        adds=True,
    ),
    compat.Patch(
        "deepspeed.runtime.engine:DeepSpeedEngine._is_supported_optimizer",
        name_hint,
        'a config "type" close to Dion3\'s ("Dion", "dion-3", "Dion3Optimizer") fails with one line naming "Dion3" '
        "instead of DeepSpeed's bare assertion",
        DS_019,
        optional=True,
    ),
    compat.Patch(
        "deepspeed.runtime.zero.utils:ZERO_SUPPORTED_OPTIMIZERS[+]",
        deepspeed_class,
        'ZeRO takes DeepSpeedDion3 without "zero_allow_untested_optimizer"',
        DS_019,
        optional=True,
    ),
    compat.Patch(
        "deepspeed.runtime.engine:DeepSpeedEngine._configure_basic_optimizer",
        split_config_params,
        'with "type": "Dion3" the parameters DeepSpeed was given are split by the engine\'s model: embeddings, '
        "the output head, norms and vectors take AdamW, hidden matrices Dion3",
        DS_019,
        optional=True,
    ),
    compat.Patch(
        "deepspeed.runtime.engine:DeepSpeedEngine._do_optimizer_sanity_check",
        stage_class,
        "where DeepSpeed decides how to wrap the optimizer, DeepSpeedDion3 becomes DeepSpeedZeroDion3 if ZeRO-1/2/3 "
        "or BF16_Optimizer will hand it flat partitions; a plain dion3_megatron.Dion3 there is refused at "
        'initialize, by name, and so is Dion3\'s own "offload" there (offload_optimizer is the switch)',
        DS_019,
        optional=True,
    ),
    compat.Patch(
        "deepspeed.runtime.engine:DeepSpeedEngine._configure_zero_optimizer",
        zero_stage_checks,
        "with offload_optimizer to the CPU Dion3 keeps its state in host memory too; what Dion3 cannot take of "
        "optimizer offload (NVMe, a ratio, super_offload) is refused with a message saying what to set; Dion3 learns ZeRO's "
        "partitions (ZeRO-3: which parameters each sub-group's holds) and how to write one back to its "
        "low-precision copy, and the partition-shaped state of every ZeRO partition is created before ZeRO "
        "links state to parameters",
        DS_019,
        optional=True,
    ),
    compat.Patch(
        "deepspeed.runtime.base_optimizer:ZeROOptimizer.load_hp_checkpoint_state_from_checkpoint_dir",
        checkpoint.keep_settings_on_universal_load,
        "the universal-checkpoint load of ZeRO-1/2 and BF16_Optimizer sets every saved key of a param group on the "
        "optimizer's: Dion3's groups keep their own momentum_dtype, as its other loads do",
        DS_019,
        optional=True,
    ),
    compat.Patch(
        "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3.load_hp_checkpoint_state_from_checkpoint_dir_stage3",
        zero3.load_universal_settings_and_ages,
        "ZeRO-3's universal-checkpoint load gives every param group the first one's settings and drops every "
        "state key but exp_avg and exp_avg_sq: for Dion3, each group gets its own settings back (Dion3 and "
        "AdamW groups differ) and the rows' ages (row_age) are loaded too",
        DS_019,
        optional=True,
    ),
)


register()
