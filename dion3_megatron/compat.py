"""Every attribute of Megatron-Core, Megatron-LM and DeepSpeed (and of ``torch.optim``, where DeepSpeed
looks optimizers up) that dion3_megatron replaces or adds.

A behaviour of those frameworks that is not listed here is stock. The lists below are the code
that changes them: :func:`apply_megatron` (run by :func:`dion3_megatron.megatron.register`) and
:func:`apply_deepspeed` (run by :func:`dion3_megatron.deepspeed.register`) apply exactly these
entries, in this order, and nothing else. Both are idempotent, and raise :class:`UpstreamChanged`,
naming the attribute, when the installed framework no longer has one. Every original is kept:
:func:`restore` (run by :func:`dion3_megatron.megatron.unregister` and
:func:`dion3_megatron.deepspeed.unregister`) puts each back, removes what was added (an attribute,
a dict item, a list element), and a later registration applies the entries again.

An entry (:class:`Patch`) says

- ``target``: ``module:name`` (an attribute of a module), ``module:Class.name`` (of a class),
  ``module:NAME['key']`` (an item of a dict) or ``module:NAME[+]`` (an element appended to a list);
- ``replacement``: ``module:function`` of this package, called with the target's current value
  (None where the target is new) and returning what takes its place;
- ``why``: the behaviour it adds or the bug it mends;
- ``upstream``: the release series whose code it was written against (and read in);
- ``when``: :data:`ALWAYS`; :data:`WITHOUT_APEX_OR_TE`, only where Megatron runs its own fallback
  for a fused kernel of apex or Transformer Engine (``only_if`` decides, from the current value);
  :data:`LAUNCHER`, only under ``python -m dion3_megatron.megatron.launch``;
- ``optional``: skipped, instead of failing, where its module does not import (Megatron-LM's
  ``megatron.training`` next to Megatron-Core alone; DeepSpeed for plain torch users);
- ``adds``: the target is new (upstream has no such attribute);
- ``rebinds``: for a function replaced by one whose Dion3 path runs the function's own code with
  some of the globals it reads bound differently (:func:`rebound`), those names. The module keeps
  its own values: nothing is swapped around a call.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import importlib.util
import re
import types
from typing import Any, Callable, Optional, TypedDict

ALWAYS = "always"
WITHOUT_APEX_OR_TE = "without apex or Transformer Engine"
LAUNCHER = "under the launcher"

MCORE_019 = "megatron-core 0.19.x (read in 0.19.2)"
MLM_019 = "megatron-core 0.19.x's megatron.training (read in 0.19.2)"
DS_019 = "deepspeed 0.19.x (read in 0.19.8)"

MARK = "_dion3_patched"  # set on each replacement function this module installs


class UpstreamChanged(RuntimeError):
    """The installed Megatron or DeepSpeed lacks something an entry of this module replaces."""


@dataclasses.dataclass(frozen=True)
class Patch:
    """One change to an attribute of Megatron, DeepSpeed or torch (the fields: the module docstring)."""

    target: str
    replacement: str
    why: str
    upstream: str
    when: str = ALWAYS
    only_if: Optional[str] = None
    optional: bool = False
    adds: bool = False
    rebinds: tuple[str, ...] = ()


_REGISTRY = "dion3_megatron.megatron.registry"
_TORCH_ADAM = "dion3_megatron.megatron.torch_adam"
_MULTI_TENSOR = "dion3_megatron.megatron.multi_tensor"
_DS = "dion3_megatron.deepspeed"


class _Condition(TypedDict):
    """The ``when`` and ``only_if`` fields that several entries share."""

    when: str
    only_if: str


# Megatron fell back to torch's AdamW (no apex, no Transformer Engine); to its per-tensor loops.
_TORCH_ADAM_FALLBACK = _Condition(when=WITHOUT_APEX_OR_TE, only_if=f"{_TORCH_ADAM}:megatron_adam_is_torch")
_LOOP_FALLBACK = _Condition(when=WITHOUT_APEX_OR_TE, only_if=f"{_MULTI_TENSOR}:is_local_fallback")

MEGATRON: tuple[Patch, ...] = (
    Patch(
        "megatron.core.optimizer.emerging_optimizers:_EMERGING_OPTIMIZERS['dion3']",
        f"{_REGISTRY}:dion3_entry",
        "the registry entry Megatron's optimizer factory reads for optimizer='dion3': MegatronDion3, its "
        "init_state_fn and config_to_kwargs, and AdamW for embeddings, the output layer and non-2-D "
        "parameters (the default_param_overrides Muon has)",
        MCORE_019,
    ),
    Patch(
        "megatron.core.optimizer:_get_megatron_emerging_optimizer",
        f"{_REGISTRY}:emerging_optimizer_factory",
        "for dion3 only, Megatron's own factory runs without its check for the emerging-optimizers package "
        "(Dion3 needs nothing from it) and wraps Dion3 in dion3_megatron.megatron.wrappers' subclasses of "
        "its layer-wise and chained optimizers: fp32 without --bf16 (stock 0.19 fails ChainedOptimizer's "
        "config assertion), a step with a non-finite gradient anywhere skipped whole on every rank",
        MCORE_019,
        rebinds=("HAVE_EMERGING_OPTIMIZERS", "LayerWiseDistributedOptimizer", "ChainedOptimizer"),
    ),
    Patch(
        "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer._set_main_param_and_optimizer_states",
        f"{_TORCH_ADAM}:set_main_param_and_optimizer_states",
        "torch AdamW's resume under the distributed optimizer: the loaders copied back the 'step' of before "
        "the load (bias corrections restart) or looked for a 'step' the checkpoint never holds (KeyError)",
        MCORE_019,
        **_TORCH_ADAM_FALLBACK,
    ),
    Patch(
        "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.state_dict",
        f"{_TORCH_ADAM}:state_dict",
        "torch AdamW before its first step has no 'step', which state_dict() asserts it finds (load_checkpoint "
        "builds the state dict to load into from a fresh optimizer)",
        MCORE_019,
        **_TORCH_ADAM_FALLBACK,
    ),
    Patch(
        "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.load_state_dict",
        f"{_TORCH_ADAM}:load_state_dict",
        "load_state_dict() hands every parameter the same 'step' tensor, which torch AdamW increments once per "
        "parameter and step: the bias corrections ran ahead",
        MCORE_019,
        **_TORCH_ADAM_FALLBACK,
    ),
    Patch(
        "megatron.core.optimizer.clip_grads:l2_norm_impl",
        f"{_MULTI_TENSOR}:foreach_form",
        "the gradient norm as torch foreach ops: Megatron's loop synchronizes the device once per gradient",
        MCORE_019,
        **_LOOP_FALLBACK,
    ),
    Patch(
        "megatron.core.optimizer.clip_grads:multi_tensor_scale_impl",
        f"{_MULTI_TENSOR}:foreach_form",
        "gradient clipping as torch foreach ops (bit-identical): Megatron's loop allocates a temporary per tensor",
        MCORE_019,
        **_LOOP_FALLBACK,
    ),
    Patch(
        "megatron.core.optimizer.optimizer:multi_tensor_scale_impl",
        f"{_MULTI_TENSOR}:foreach_form",
        "the main-to-model parameter copies as torch foreach ops (bit-identical)",
        MCORE_019,
        **_LOOP_FALLBACK,
    ),
    Patch(
        "megatron.training.arguments:add_megatron_arguments",
        f"{_REGISTRY}:megatron_arguments",
        "Megatron-LM's parser gets 'dion3' among --optimizer's choices and the --dion3-* group, and its --help "
        "works (0.19.2 has a help string with a bare '%' that argparse cannot format)",
        MLM_019,
        optional=True,
    ),
    Patch(
        "megatron.training.training:get_megatron_optimizer_config",
        f"{_REGISTRY}:optimizer_config_from_args",
        "copies the --dion3-* values from Megatron-LM's args onto the OptimizerConfig (upstream copies only "
        "OptimizerConfig's own fields), and warns when Adam would take a Dion3-sized --lr",
        MLM_019,
        optional=True,
    ),
    Patch(
        "megatron.training.arguments:validate_args",
        f"{_REGISTRY}:torch_fsdp2_validation",
        "Megatron-LM refuses every emerging optimizer under --use-torch-fsdp2 (a guard of the layer-wise "
        "ZeRO-1 layout, which FSDP2 replaces); for dion3 its other checks of that path run, and tensor "
        "parallelism there is refused in one line",
        MLM_019,
        optional=True,
    ),
    Patch(
        "megatron.training.models.dist_utils:_ddp_wrap",
        f"{_REGISTRY}:layer_wise_ddp_wrap",
        "pretrain()'s model-config path (Megatron-LM's pretrain_gpt.py) ignores the layer-wise distributed "
        "optimizer and all-reduces; for --optimizer dion3 --use-distributed-optimizer it builds the layer-wise "
        "ZeRO-1 layout, as the model-provider path (get_model) does for every emerging optimizer",
        MLM_019,
        optional=True,
        rebinds=("DistributedOptimizer",),
    ),
    Patch(
        "megatron.core.datasets.utils:compile_helpers",
        "dion3_megatron.megatron.launch:skip_compile_helpers",
        "Megatron-LM's initialize_megatron runs make for the dataset helpers, which the wheel ships compiled "
        "but without their Makefile: a script run against the wheel would stop there",
        MCORE_019,
        when=LAUNCHER,
        only_if="dion3_megatron.megatron.launch:helpers_prebuilt",
    ),
)

DEEPSPEED: tuple[Patch, ...] = (
    Patch(
        "deepspeed.runtime.config:DEEPSPEED_OPTIMIZERS[+]",
        f"{_DS}:config_name",
        'DeepSpeed lower-cases a config "type" that names one of its own optimizers: "Dion3", "DION3" and "dion3" all become "dion3"',
        DS_019,
        optional=True,
    ),
    Patch(
        "torch.optim:dion3",
        f"{_DS}:deepspeed_class",
        'DeepSpeed 0.19 looks the optimizer of a config "type" up in torch.optim: "dion3" builds DeepSpeedDion3',
        DS_019,
        adds=True,
    ),
    Patch(
        "deepspeed.runtime.engine:DeepSpeedEngine._is_supported_optimizer",
        f"{_DS}:name_hint",
        'a config "type" close to Dion3\'s ("Dion", "dion-3", "Dion3Optimizer") fails with one line naming "Dion3" '
        "instead of DeepSpeed's bare assertion",
        DS_019,
        optional=True,
    ),
    Patch(
        "deepspeed.runtime.zero.utils:ZERO_SUPPORTED_OPTIMIZERS[+]",
        f"{_DS}:deepspeed_class",
        'ZeRO takes DeepSpeedDion3 without "zero_allow_untested_optimizer"',
        DS_019,
        optional=True,
    ),
    Patch(
        "deepspeed.runtime.engine:DeepSpeedEngine._configure_basic_optimizer",
        f"{_DS}:split_config_params",
        'with "type": "Dion3" the parameters DeepSpeed was given are split by the engine\'s model: embeddings, '
        "the output head, norms and vectors take AdamW, hidden matrices Dion3",
        DS_019,
        optional=True,
    ),
    Patch(
        "deepspeed.runtime.engine:DeepSpeedEngine._do_optimizer_sanity_check",
        f"{_DS}:stage_class",
        "where DeepSpeed decides how to wrap the optimizer, DeepSpeedDion3 becomes DeepSpeedZeroDion3 if ZeRO-1/2/3 "
        "or BF16_Optimizer will hand it flat partitions; a plain dion3_megatron.Dion3 there is refused at "
        "initialize, by name",
        DS_019,
        optional=True,
    ),
    Patch(
        "deepspeed.runtime.engine:DeepSpeedEngine._configure_zero_optimizer",
        f"{_DS}:zero_stage_checks",
        "optimizer offload is refused for Dion3 with a message saying what to set; Dion3 learns ZeRO's "
        "partitions (ZeRO-3: which parameters each sub-group's holds) and how to write one back to its "
        "low-precision copy, and the partition-shaped state of every ZeRO partition is created before ZeRO "
        "links state to parameters",
        DS_019,
        optional=True,
    ),
    Patch(
        "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3.load_hp_checkpoint_state_from_checkpoint_dir_stage3",
        f"{_DS}.zero3:load_universal_settings_and_ages",
        "ZeRO-3's universal-checkpoint load gives every param group the first one's settings and drops every "
        "state key but exp_avg and exp_avg_sq: for Dion3, each group gets its own settings back (Dion3 and "
        "AdamW groups differ) and the rows' ages (row_age) are loaded too",
        DS_019,
        optional=True,
    ),
)


MEGATRON_EXTRA = 'pip install "dion3-megatron[megatron]"'


def require_megatron() -> None:
    """Raise ImportError naming the install command when Megatron-Core does not import."""
    try:
        found = importlib.util.find_spec("megatron.core") is not None
    except (ImportError, ValueError):  # no megatron package at all, or one that is blocked
        found = False
    if not found:
        raise ImportError(f"dion3_megatron.megatron needs Megatron-Core 0.19, which is not installed: {MEGATRON_EXTRA}")


def _resolve(path: str) -> Any:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


_TARGET = re.compile(r"(?P<module>[\w.]+):(?P<path>\w+(?:\.\w+)?)(?:\[(?P<key>'\w+'|\+)\])?$")


def _locate(patch: Patch) -> Optional[tuple[Any, str, Optional[str]]]:
    """(owner, name, key) of a target; None when an optional module does not import."""
    match = _TARGET.match(patch.target)
    if match is None:
        raise ValueError(f"dion3_megatron.compat: malformed target {patch.target!r}")
    try:
        owner = importlib.import_module(match["module"])
    except Exception:  # noqa: BLE001 - Megatron-Core without megatron.training, or no DeepSpeed
        if patch.optional:
            return None
        raise
    *outer, name = match["path"].split(".")
    for part in outer:
        owner = _upstream_attribute(patch, owner, part)
    key = match["key"]
    return owner, name, (key.strip("'") if key else None)


def _upstream_attribute(patch: Patch, owner: Any, name: str) -> Any:
    try:
        return getattr(owner, name)
    except AttributeError:
        raise UpstreamChanged(_changed(patch, f"{getattr(owner, '__name__', owner)}.{name} does not exist")) from None


def _changed(patch: Patch, what: str) -> str:
    distribution = patch.upstream.split(" ")[0]
    try:
        installed = f"{distribution} {importlib.metadata.version(distribution)}"
    except importlib.metadata.PackageNotFoundError:
        installed = distribution
    return (
        f"dion3_megatron cannot patch {patch.target}: {what} in the installed {installed}; the entry of "
        f"dion3_megatron/compat.py was written for {patch.upstream}"
    )


def is_patched(value: Any) -> bool:
    """Whether ``value`` is a replacement installed by this module."""
    return getattr(value, MARK, False) is True


_ABSENT = object()


@dataclasses.dataclass(frozen=True)
class _Original:
    """What an applied entry replaced: ``value`` (the raw class or module attribute, or the dict
    item; :data:`_ABSENT` where there was none) or, for a list, the element it appended."""

    owner: Any
    name: str
    key: Optional[str]
    value: Any


# target -> what its applied entry replaced, for restore().
_ORIGINALS: dict[str, _Original] = {}


def _apply(patch: Patch, launcher: bool) -> bool:
    """Apply one entry (or see it applied); whether it is in place."""
    if patch.when == LAUNCHER and not launcher:
        return False
    located = _locate(patch)
    if located is None:
        return False
    owner, name, key = located
    if key is None:
        current = getattr(owner, name, None) if patch.adds else _upstream_attribute(patch, owner, name)
    else:
        container = _upstream_attribute(patch, owner, name)
        current = None if key == "+" else container.get(key)
    if is_patched(current):
        return True
    if patch.only_if is not None and not _resolve(patch.only_if)(current):
        return False
    _check_rebinds(patch, current)
    new = _resolve(patch.replacement)(current)
    if key == "+":
        if new not in container:
            container.append(new)
            _ORIGINALS[patch.target] = _Original(owner, name, key, new)
    elif new is not current:
        if not patch.adds and isinstance(new, types.FunctionType):
            setattr(new, MARK, True)
        if key is None:  # the raw attribute (a staticmethod stays one), absent where it was inherited
            _ORIGINALS[patch.target] = _Original(owner, name, key, vars(owner).get(name, _ABSENT))
            setattr(owner, name, new)
        else:
            _ORIGINALS[patch.target] = _Original(owner, name, key, container.get(key, _ABSENT))
            container[key] = new
    return True


def _restore(original: _Original) -> None:
    if original.key == "+":
        container = getattr(original.owner, original.name)
        if original.value in container:
            container.remove(original.value)
    elif original.key is not None:
        container = getattr(original.owner, original.name)
        if original.value is _ABSENT:
            container.pop(original.key, None)
        else:
            container[original.key] = original.value
    elif original.value is _ABSENT:
        if original.name in vars(original.owner):
            delattr(original.owner, original.name)
    else:
        setattr(original.owner, original.name, original.value)


def restore(patches: tuple[Patch, ...]) -> None:
    """Undo the applied entries of ``patches`` (in reverse order): every replaced attribute and dict
    item is its original again, every added attribute, dict item and list element is gone."""
    for patch in reversed(patches):
        original = _ORIGINALS.pop(patch.target, None)
        if original is not None:
            _restore(original)


def _check_rebinds(patch: Patch, function: Any) -> None:
    read = set(getattr(getattr(function, "__code__", None), "co_names", ()))
    missing = [name for name in patch.rebinds if name not in read]
    if missing:
        raise UpstreamChanged(_changed(patch, f"the function no longer reads {', '.join(missing)}"))


def rebound(target: str, function: Callable, values: dict[str, Any]) -> Callable:
    """``function``'s own code, run with the globals named in ``values`` bound to those values (the
    entry of ``target`` lists the names). Its module keeps its own values, so other callers, other
    threads and the functions it calls see the stock ones."""
    (patch,) = [p for p in MEGATRON + DEEPSPEED if p.target == target]
    assert sorted(values) == sorted(patch.rebinds), (target, sorted(values), patch.rebinds)
    _check_rebinds(patch, function)
    copy = types.FunctionType(
        function.__code__, {**function.__globals__, **values}, function.__name__, function.__defaults__, function.__closure__
    )
    copy.__kwdefaults__ = function.__kwdefaults__
    return copy


def apply(patches: tuple[Patch, ...], *, launcher: bool = False) -> dict[str, bool]:
    """Apply ``patches`` in order; {target: whether it is in place}."""
    return {patch.target: _apply(patch, launcher) for patch in patches}


def apply_megatron(*, launcher: bool = False) -> dict[str, bool]:
    """Apply :data:`MEGATRON` (the :data:`LAUNCHER` entries too when ``launcher``); ImportError naming
    the install command without Megatron-Core."""
    require_megatron()
    return apply(MEGATRON, launcher=launcher)


def apply_deepspeed() -> dict[str, bool]:
    """Apply :data:`DEEPSPEED`."""
    return apply(DEEPSPEED)


def restore_megatron() -> None:
    """Undo :func:`apply_megatron`."""
    restore(MEGATRON)


def restore_deepspeed() -> None:
    """Undo :func:`apply_deepspeed`."""
    restore(DEEPSPEED)


__all__ = [
    "ALWAYS",
    "DEEPSPEED",
    "LAUNCHER",
    "MEGATRON",
    "WITHOUT_APEX_OR_TE",
    "Patch",
    "UpstreamChanged",
    "apply",
    "apply_deepspeed",
    "apply_megatron",
    "is_patched",
    "rebound",
    "require_megatron",
    "restore",
    "restore_deepspeed",
    "restore_megatron",
]
