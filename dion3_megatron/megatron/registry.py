"""Register Dion3 with an installed Megatron-Core / Megatron-LM 0.19: :func:`register`, the one entry point.

``import dion3_megatron.megatron``, ``python -m dion3_megatron.megatron.launch`` and a Megatron tree
patched with patches/megatron-core-0.19-dion3.patch all call :func:`register`. It applies
:data:`MEGATRON`, the table of every Megatron attribute this package replaces or adds, with why
and the upstream version (applied and restored by :mod:`dion3_megatron.compat`); this module holds
that table and the replacements that concern registration:

1. :func:`dion3_entry`: ``dion3`` in Megatron-Core's emerging-optimizer registry, with its hooks
   :func:`config_to_kwargs` (the ``dion3_*`` values of the ``OptimizerConfig`` or of Megatron-LM's
   args) and :func:`init_state_fn`;
2. :func:`emerging_optimizer_factory`: Megatron's factory builds ``dion3`` without the
   ``emerging-optimizers`` package and with the wrapper classes of :mod:`.wrappers` (fp32 support;
   a bad step skipped whole, every chained optimizer);
3. :func:`megatron_arguments` and :func:`optimizer_config_from_args`: where ``megatron.training``
   is importable, ``--optimizer dion3`` and the ``--dion3-*`` flags in Megatron-LM's parser, their
   values on the ``OptimizerConfig`` it builds;
4. :func:`layer_wise_ddp_wrap`: ``pretrain()`` builds the layer-wise ZeRO-1 layout for
   ``--optimizer dion3 --use-distributed-optimizer`` whichever way the script hands it the model.

The entries of :mod:`.offload` (``--optimizer-cpu-offload``) and :mod:`.precision`
(``--use-precision-aware-optimizer``: ``--exp-avg-dtype`` is the momentum's dtype) are in the table
too. Without apex or Transformer Engine it also applies :mod:`.torch_adam` (torch AdamW's resume)
and :mod:`.multi_tensor` (foreach gradient norm, clipping and copies), both for Dion3 runs only.
:func:`unregister` restores every original.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, TypedDict

from .. import compat, options
from . import multi_tensor, offload, precision, torch_adam, wrappers
from .arguments import (
    DION3_DEFAULTS,
    OPTIMIZER_NAME,
    OPTIONS,
    add_dion3_arguments,
    check_dion3_values,
    config_field,
    fsdp2_tensor_parallel_refusal,
    is_dion3,
    refuse_unknown_fields,
    warn_if_adam_takes_the_dion3_lr,
)
from .optimizer import MegatronDion3

_FACTORY = "megatron.core.optimizer:_get_megatron_emerging_optimizer"
_DDP_WRAP = "megatron.training.models.dist_utils:_ddp_wrap"


def dion3_values(config=None) -> dict[str, Any]:
    """The ``dion3_*`` options: from ``config`` attributes, else Megatron-LM's global args, else defaults."""
    args = None
    try:
        from megatron.training.global_vars import get_args

        args = get_args()
    except Exception:  # noqa: BLE001 - megatron.training absent or args not parsed (core-only use)
        args = None
    for source, where in ((config, "Megatron optimizer config"), (args, "Megatron-LM args")):
        if source is not None:
            refuse_unknown_fields(source, where)
    values = {}
    for key, default in DION3_DEFAULTS.items():
        if config is not None and hasattr(config, key):
            values[key] = getattr(config, key)
        elif args is not None and hasattr(args, key):
            values[key] = getattr(args, key)
        else:
            values[key] = default
    return values


def config_to_kwargs(config, model_chunks, pg_collection) -> dict[str, Any]:
    """Megatron ``OptimizerConfig`` -> :class:`MegatronDion3` constructor kwargs, as Megatron-Core's
    ``_kwargs_from_config`` reads a prefixed config: option ``name`` from ``config.dion3_<name>``
    (``momentum_dtype`` also from the precision-aware optimizer's ``exp_avg_dtype``:
    :func:`.precision.momentum_dtype`), lr, weight decay and offload (:func:`.offload.offloads`) from
    Megatron's own fields."""
    values = dion3_values(config)
    refusal = precision.refusal(config, flags=False) or offload.offload_refusal(config, flags=False)
    if refusal is not None:
        raise ValueError(refusal)
    momentum = config_field("momentum_dtype")
    values[momentum] = precision.momentum_dtype(config, values[momentum])
    check_dion3_values(values, "Megatron optimizer config")
    return dict(
        lr=config.lr if config.lr is not None else options.BY_NAME["lr"].default,
        weight_decay=config.weight_decay,
        offload=offload.offloads(config),
        **{option.name: values[config_field(option.name)] for option in OPTIONS},
        model_chunks=model_chunks,
        pg_collection=pg_collection,
    )


def init_state_fn(opt, config=None) -> None:
    """Megatron's ``init_state_fn``: create all state (checkpoint loading needs it first)."""
    opt.init_state()


def dion3_entry(current):
    """Dion3's ``EmergingOptimizerEntry`` (``current`` when it is already Dion3's)."""
    from megatron.core.optimizer import emerging_optimizers as eo

    if isinstance(current, eo.EmergingOptimizerEntry) and current.optimizer_cls is MegatronDion3:
        return current
    return eo.EmergingOptimizerEntry(
        optimizer_cls=MegatronDion3,
        init_state_fn=init_state_fn,
        config_to_kwargs=config_to_kwargs,
        default_param_overrides=eo._default_param_overrides_factory(),  # noqa: SLF001 - non-2-D/embedding -> adam
    )


def emerging_optimizer_factory(factory):
    """Megatron's ``_get_megatron_emerging_optimizer``; for Dion3, its own code with four of the
    names it reads bound for Dion3 (:func:`dion3_megatron.compat.rebound`): Megatron checks
    ``HAVE_EMERGING_OPTIMIZERS`` (the emerging-optimizers package) for every emerging optimizer,
    which Dion3 does not use, builds the layer-wise ZeRO-1 wrapper and the outer chain from
    ``LayerWiseDistributedOptimizer`` and ``ChainedOptimizer``, here Dion3's subclasses (fp32
    support, a bad step skipped whole: see :mod:`.wrappers`), and the Adam part with
    ``_get_megatron_optimizer_based_on_param_groups``, here without the CPU offload Dion3 takes for
    its own state (:func:`.offload.adam_part_on_device`); under the precision-aware optimizer it
    builds from :func:`.precision.megatron_view` of the config. Other optimizers: Megatron's factory.

    The registry entry alone cannot do this: the factory checks ``HAVE_EMERGING_OPTIMIZERS`` before
    it reads the entry, and an entry carries the optimizer class, not the wrappers around it."""

    @functools.wraps(factory)
    def build(config, *args, **kwargs):
        if not is_dion3(getattr(config, "optimizer", None)):
            return factory(config, *args, **kwargs)
        config = precision.megatron_view(config)
        dion3_factory = compat.rebound(
            MEGATRON,
            _FACTORY,
            factory,
            {
                "HAVE_EMERGING_OPTIMIZERS": True,
                "LayerWiseDistributedOptimizer": wrappers.layer_wise_class(),
                "ChainedOptimizer": wrappers.chained_class(),
                "_get_megatron_optimizer_based_on_param_groups": offload.adam_part_on_device(
                    factory.__globals__["_get_megatron_optimizer_based_on_param_groups"]
                ),
            },
        )
        return dion3_factory(config, *args, **kwargs)

    return build


def megatron_arguments(add):
    """Megatron-LM's ``add_megatron_arguments``, then :func:`.arguments.add_dion3_arguments`."""

    @functools.wraps(add)
    def add_megatron_arguments(parser):
        return add_dion3_arguments(add(parser))

    return add_megatron_arguments


def optimizer_config_from_args(get_config):
    """Megatron-LM's ``get_megatron_optimizer_config``, then the ``dion3_*`` values of the args
    copied onto the config (it copies only ``OptimizerConfig``'s own fields)."""

    @functools.wraps(get_config)
    def get_megatron_optimizer_config(args):
        config, overrides = get_config(args)
        for key, default in DION3_DEFAULTS.items():
            setattr(config, key, getattr(args, key, getattr(config, key, default)))
        if is_dion3(config.optimizer):
            warn_if_adam_takes_the_dion3_lr(args)
        return config, overrides

    return get_megatron_optimizer_config


def torch_fsdp2_validation(validate_args):
    """Megatron-LM's ``validate_args``; for ``--optimizer dion3 --use-torch-fsdp2``, its own checks of
    the torch FSDP2 path with the refusal of every emerging optimizer there lifted: that refusal
    guards the layer-wise ZeRO-1 layout, which FSDP2 replaces, and Dion3 steps FSDP2's row-sharded
    DTensors itself. Tensor parallelism is refused there (one line, naming the way out)."""

    @functools.wraps(validate_args)
    def validate(args, *rest, **kwargs):
        if not (is_dion3(getattr(args, "optimizer", None)) and getattr(args, "use_torch_fsdp2", False)):
            return validate_args(args, *rest, **kwargs)
        if args.tensor_model_parallel_size > 1:
            raise SystemExit(fsdp2_tensor_parallel_refusal(args.tensor_model_parallel_size))
        # Validated as Adam (the optimizer name reaches no other check of this path), named dion3 after.
        args.optimizer = "adam"
        try:
            validated = validate_args(args, *rest, **kwargs)
        finally:
            args.optimizer = OPTIMIZER_NAME
        args.use_layer_wise_distributed_optimizer = False
        return validated

    return validate


def validation(validate_args):
    """Megatron-LM's ``validate_args`` with Dion3's changes: the precision-aware settings
    (:func:`.precision.precision_validation`) and optimizer offload (:func:`.offload.offload_validation`)
    around the torch FSDP2 path (:func:`torch_fsdp2_validation`)."""
    return precision.precision_validation(offload.offload_validation(torch_fsdp2_validation(validate_args)))


def layer_wise_dion3_run() -> bool:
    """Whether Megatron-LM's args (when parsed) ask for Dion3 with the layer-wise ZeRO-1 layout:
    ``--optimizer dion3 --use-distributed-optimizer`` (which Megatron's argument validation turns
    into ``use_layer_wise_distributed_optimizer``), and not ``--no-use-layer-wise-param-layout``."""
    from megatron.training import global_vars

    args = getattr(global_vars, "_GLOBAL_ARGS", None)
    return (
        args is not None
        and is_dion3(getattr(args, "optimizer", None))
        and bool(getattr(args, "use_layer_wise_distributed_optimizer", False))
        and bool(getattr(args, "use_layer_wise_param_layout", True))
    )


def layer_wise_ddp_wrap(ddp_wrap):
    """Give ``pretrain()``'s model-config path the layer-wise layout its ``get_model`` path builds.

    megatron-core 0.19.2's ``pretrain()`` wraps the model in DDP in one of two ways. A script that
    passes ``model_provider`` goes through ``training.get_model``, whose
    ``wrap_model_chunks_with_ddp`` builds the layer-wise ZeRO-1 layout for an emerging optimizer:
    the matrices bin-packed whole into data-parallel shards, gradients reduce-scattered, the other
    parameters in a byte-sharded DistributedOptimizer. A script that passes a model config, as
    Megatron-LM's own pretrain_gpt.py does (``gpt_config_from_args``), goes through
    ``training.models.dist_utils._ddp_wrap``, which ignores ``use_layer_wise_distributed_optimizer``:
    DDP all-reduces (``use_distributed_optimizer`` is False after validate_args) and the optimizer
    factory falls back to the legacy layer-wise path (Adam in FP32 optimizers nested in the
    layer-wise wrapper, the matrices all-gathered after the step). For a Dion3 run this does what
    ``wrap_model_chunks_with_ddp`` does: reduce-scatter (``use_distributed_optimizer`` on DDP's
    config), the parameters tagged for the two buffers, and the layer-wise layout in place of the
    DistributedOptimizer's (``_ddp_wrap``'s own code with ``DistributedOptimizer``, of which it
    reads only the layout, bound to the layer-wise one). Other optimizers (muon too) and FSDP are
    left as Megatron builds them.
    """
    from megatron.core.optimizer.layer_wise_optimizer import (
        LayerWiseDistributedOptimizer,
        tag_params_for_buffer_routing,
    )

    class LayerWiseLayout:
        """Stands in for ``DistributedOptimizer`` inside ``_ddp_wrap``, which reads only its layout."""

        compute_full_param_layout = staticmethod(LayerWiseDistributedOptimizer.compute_full_param_layout)

    @functools.wraps(ddp_wrap)
    def _ddp_wrap(
        model,
        data_parallel_random_init,
        ddp_config,
        overlap_param_gather_with_optimizer_step,
        use_megatron_fsdp=False,
        use_torch_fsdp2=False,
        **kwargs,
    ):
        if use_megatron_fsdp or use_torch_fsdp2 or not layer_wise_dion3_run():
            return ddp_wrap(
                model,
                data_parallel_random_init,
                ddp_config,
                overlap_param_gather_with_optimizer_step,
                use_megatron_fsdp=use_megatron_fsdp,
                use_torch_fsdp2=use_torch_fsdp2,
                **kwargs,
            )
        ddp_config.use_distributed_optimizer = True
        tag_params_for_buffer_routing(model)
        layer_wise_wrap = compat.rebound(MEGATRON, _DDP_WRAP, ddp_wrap, {"DistributedOptimizer": LayerWiseLayout})
        return layer_wise_wrap(
            model,
            data_parallel_random_init,
            ddp_config,
            overlap_param_gather_with_optimizer_step,
            use_megatron_fsdp=False,
            use_torch_fsdp2=False,
            **kwargs,
        )

    return _ddp_wrap


MCORE_019 = "megatron-core 0.19.x (read in 0.19.2)"
MLM_019 = "megatron-core 0.19.x's megatron.training (read in 0.19.2)"
WITHOUT_APEX_OR_TE = "without apex or Transformer Engine"


class _Condition(TypedDict):
    """The ``when`` and ``only_if`` fields that several entries share."""

    when: str
    only_if: Callable[[Any], bool]


# Megatron fell back to torch's AdamW (no apex, no Transformer Engine); to its per-tensor loops.
_TORCH_ADAM_FALLBACK = _Condition(when=WITHOUT_APEX_OR_TE, only_if=torch_adam.megatron_adam_is_torch)
_LOOP_FALLBACK = _Condition(when=WITHOUT_APEX_OR_TE, only_if=multi_tensor.is_local_fallback)

# Every attribute of Megatron-Core and Megatron-LM that register() replaces or adds (the launcher's
# one more: LAUNCHER of launch.py); the fields: dion3_megatron.compat.
MEGATRON: tuple[compat.Patch, ...] = (
    compat.Patch(
        "megatron.core.optimizer.emerging_optimizers:_EMERGING_OPTIMIZERS['dion3']",
        dion3_entry,
        "the registry entry Megatron's optimizer factory reads for optimizer='dion3': MegatronDion3, its "
        "init_state_fn and config_to_kwargs, and AdamW for embeddings, the output layer and non-2-D "
        "parameters (the default_param_overrides Muon has)",
        MCORE_019,
    ),
    compat.Patch(
        "megatron.core.optimizer:_get_megatron_emerging_optimizer",
        emerging_optimizer_factory,
        "for dion3 only, Megatron's own factory runs without its check for the emerging-optimizers package "
        "(Dion3 needs nothing from it) and wraps Dion3 in dion3_megatron.megatron.wrappers' subclasses of "
        "its layer-wise and chained optimizers: fp32 without --bf16 (stock 0.19 fails ChainedOptimizer's "
        "config assertion), a step with a non-finite gradient anywhere skipped whole on every rank; "
        "--optimizer-cpu-offload offloads Dion3's state, and Megatron's Adam part is built without it; "
        "the precision-aware optimizer's --exp-avg-dtype is Dion3's momentum dtype, the rest is built without it",
        MCORE_019,
        rebinds=(
            "HAVE_EMERGING_OPTIMIZERS",
            "LayerWiseDistributedOptimizer",
            "ChainedOptimizer",
            "_get_megatron_optimizer_based_on_param_groups",
        ),
    ),
    compat.Patch(
        "megatron.core.optimizer.optimizer_config:OptimizerConfig.__post_init__",
        precision.config_post_init,
        "OptimizerConfig allows use_precision_aware_optimizer for adam only (with Transformer Engine's FusedAdam): "
        "for dion3 its exp_avg_dtype is the dtype of Dion3's momentum (fp32 or bf16), the dtypes Dion3 cannot "
        "take are refused in one line, and the other checks run as without it",
        MCORE_019,
    ),
    compat.Patch(
        "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer._set_main_param_and_optimizer_states",
        torch_adam.set_main_param_and_optimizer_states,
        "torch AdamW's resume under the distributed optimizer: the loaders copied back the 'step' of before "
        "the load (bias corrections restart) or looked for a 'step' the checkpoint never holds (KeyError)",
        MCORE_019,
        **_TORCH_ADAM_FALLBACK,
    ),
    compat.Patch(
        "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.state_dict",
        torch_adam.state_dict,
        "torch AdamW before its first step has no 'step', which state_dict() asserts it finds (load_checkpoint "
        "builds the state dict to load into from a fresh optimizer)",
        MCORE_019,
        **_TORCH_ADAM_FALLBACK,
    ),
    compat.Patch(
        "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.load_state_dict",
        torch_adam.load_state_dict,
        "load_state_dict() hands every parameter the same 'step' tensor, which torch AdamW increments once per "
        "parameter and step: the bias corrections ran ahead",
        MCORE_019,
        **_TORCH_ADAM_FALLBACK,
    ),
    compat.Patch(
        "megatron.core.optimizer.clip_grads:l2_norm_impl",
        multi_tensor.foreach_form,
        "the gradient norm as torch foreach ops: Megatron's loop synchronizes the device once per gradient",
        MCORE_019,
        **_LOOP_FALLBACK,
    ),
    compat.Patch(
        "megatron.core.optimizer.clip_grads:multi_tensor_scale_impl",
        multi_tensor.foreach_form,
        "gradient clipping as torch foreach ops (bit-identical): Megatron's loop allocates a temporary per tensor",
        MCORE_019,
        **_LOOP_FALLBACK,
    ),
    compat.Patch(
        "megatron.core.optimizer.optimizer:multi_tensor_scale_impl",
        multi_tensor.foreach_form,
        "the main-to-model parameter copies as torch foreach ops (bit-identical)",
        MCORE_019,
        **_LOOP_FALLBACK,
    ),
    compat.Patch(
        "megatron.training.arguments:add_megatron_arguments",
        megatron_arguments,
        "Megatron-LM's parser gets 'dion3' among --optimizer's choices and the --dion3-* group, and its --help "
        "works (0.19.2 has a help string with a bare '%' that argparse cannot format)",
        MLM_019,
        optional=True,
    ),
    compat.Patch(
        "megatron.training.training:get_megatron_optimizer_config",
        optimizer_config_from_args,
        "copies the --dion3-* values from Megatron-LM's args onto the OptimizerConfig (upstream copies only "
        "OptimizerConfig's own fields), and warns when Adam would take a Dion3-sized --lr",
        MLM_019,
        optional=True,
    ),
    compat.Patch(
        "megatron.training.arguments:validate_args",
        validation,
        "Megatron-LM refuses every emerging optimizer under --use-torch-fsdp2 (a guard of the layer-wise "
        "ZeRO-1 layout, which FSDP2 replaces); for dion3 its other checks of that path run, and tensor "
        "parallelism there is refused in one line. It asserts --optimizer-cpu-offload only with "
        "--use-precision-aware-optimizer (Megatron's CPU Adam needs it): for dion3 neither needs the other; "
        "--exp-avg-dtype sets Dion3's momentum dtype (--dion3-momentum-dtype must agree), and what Dion3 cannot "
        "take (a partial offload, the other state dtypes other than fp32) is refused in one line",
        MLM_019,
        optional=True,
    ),
    compat.Patch(
        "megatron.training.models.dist_utils:_ddp_wrap",
        layer_wise_ddp_wrap,
        "pretrain()'s model-config path (Megatron-LM's pretrain_gpt.py) ignores the layer-wise distributed "
        "optimizer and all-reduces; for --optimizer dion3 --use-distributed-optimizer it builds the layer-wise "
        "ZeRO-1 layout, as the model-provider path (get_model) does for every emerging optimizer",
        MLM_019,
        optional=True,
        rebinds=("DistributedOptimizer",),
    ),
)


def register(*, launcher: bool = False) -> bool:
    """Make ``optimizer='dion3'`` / ``--optimizer dion3`` work: apply
    ``dion3_megatron.megatron.registry.MEGATRON`` (with ``launcher``, then
    ``dion3_megatron.megatron.launch.LAUNCHER`` too). Safe to call any number of times.

    Returns True when Megatron-LM's argument parser was extended too (``megatron.training``
    importable), False when only Megatron-Core was.
    """
    compat.require_megatron()
    applied = compat.apply(MEGATRON)
    if launcher:
        from .launch import LAUNCHER

        compat.apply(LAUNCHER)
    return applied["megatron.training.arguments:add_megatron_arguments"]


def unregister() -> None:
    """Undo :func:`register`: every attribute of :data:`MEGATRON` (and :data:`.launch.LAUNCHER`) it
    replaced is Megatron's own again, every one it added is gone (``optimizer='dion3'`` no longer
    builds)."""
    from .launch import LAUNCHER

    compat.restore(LAUNCHER)
    compat.restore(MEGATRON)


def is_registered() -> bool:
    """Whether Megatron-Core builds ``optimizer='dion3'``: [`register`][dion3_megatron.megatron.register]
    has run, and ``unregister`` not since."""
    from megatron.core.optimizer import emerging_optimizers as eo

    return OPTIMIZER_NAME in eo._EMERGING_OPTIMIZERS  # noqa: SLF001
