"""Register Dion3 with an installed Megatron-Core / Megatron-LM 0.19 (no source patch needed).

:func:`register` (also run on ``import dion3_megatron.megatron``) is idempotent and does:

1. adds ``dion3`` to ``megatron.core.optimizer.emerging_optimizers._EMERGING_OPTIMIZERS`` (the
   registry Megatron's optimizer factory reads), with AdamW for embeddings, the output layer and
   every non-2-D parameter (Megatron's ``default_param_overrides``, as for Muon);
2. lets the factory build ``dion3`` without the ``emerging-optimizers`` package (Megatron refuses
   every emerging optimizer when it is missing; Dion3 needs nothing from it), with the wrapper
   classes of :mod:`.wrappers` (fp32 support; a bad step skipped whole, every chained optimizer);
3. when ``megatron.training`` is importable: adds ``dion3`` to ``--optimizer``'s choices and the
   ``--dion3-*`` flags to Megatron-LM's parser (and makes that parser's ``--help`` work: see
   :func:`.arguments.escape_unformattable_help`), and copies their values onto the ``OptimizerConfig`` that
   ``megatron.training`` builds from the args;
4. makes ``megatron.training.pretrain`` build the layer-wise ZeRO-1 layout for ``--optimizer dion3
   --use-distributed-optimizer`` whichever way the script hands it the model (see
   :func:`_register_model_builder`);
5. without apex or Transformer Engine: mends the checkpoint resume of Megatron's torch-AdamW
   fallback (:mod:`.torch_adam`; a Dion3 run's embeddings and output layer take that Adam), and
   runs Megatron's multi-tensor fallbacks (gradient norm, clipping, parameter copies) as torch
   foreach ops instead of per-tensor loops (:mod:`.multi_tensor`).
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

from . import multi_tensor, torch_adam, wrappers
from .arguments import DION3_DEFAULTS, OPTIMIZER_NAME, add_dion3_arguments, warn_if_adam_takes_the_dion3_lr
from .optimizer import MegatronDion3, config_to_kwargs, init_state_fn

_MARK = "_dion3_wrapped"


def _dion3_entry():
    from megatron.core.optimizer import emerging_optimizers as eo

    return eo.EmergingOptimizerEntry(
        optimizer_cls=MegatronDion3,
        init_state_fn=init_state_fn,
        config_to_kwargs=config_to_kwargs,
        default_param_overrides=eo._default_param_overrides_factory(),  # noqa: SLF001 - non-2-D/embedding -> adam
    )


def _is_dion3(name: Any) -> bool:
    return isinstance(name, str) and name in (OPTIMIZER_NAME, "dist_" + OPTIMIZER_NAME)


def _register_core() -> None:
    from megatron.core import optimizer as core_optimizer
    from megatron.core.optimizer import emerging_optimizers as eo

    if not isinstance(eo._EMERGING_OPTIMIZERS.get(OPTIMIZER_NAME), eo.EmergingOptimizerEntry):  # noqa: SLF001
        eo._EMERGING_OPTIMIZERS[OPTIMIZER_NAME] = _dion3_entry()  # noqa: SLF001
    factory = core_optimizer._get_megatron_emerging_optimizer  # noqa: SLF001
    if getattr(factory, _MARK, False):
        return

    @functools.wraps(factory)
    def build(config, *args, **kwargs):
        if not _is_dion3(getattr(config, "optimizer", None)):
            return factory(config, *args, **kwargs)
        # Megatron checks HAVE_EMERGING_OPTIMIZERS (the emerging-optimizers package) for every
        # emerging optimizer; Dion3 does not use that package, so lift the check for it alone.
        # And build the layer-wise ZeRO-1 wrapper and the outer chain from Dion3's subclasses
        # (fp32 support, a bad step skipped whole: see .wrappers).
        names = ("HAVE_EMERGING_OPTIMIZERS", "LayerWiseDistributedOptimizer", "ChainedOptimizer")
        saved = [getattr(core_optimizer, name) for name in names]
        for name, value in zip(names, (True, wrappers.layer_wise_class(), wrappers.chained_class())):
            setattr(core_optimizer, name, value)
        try:
            return factory(config, *args, **kwargs)
        finally:
            for name, value in zip(names, saved):
                setattr(core_optimizer, name, value)

    setattr(build, _MARK, True)
    core_optimizer._get_megatron_emerging_optimizer = build  # noqa: SLF001


def _register_training() -> bool:
    try:
        arguments = importlib.import_module("megatron.training.arguments")
    except Exception:  # noqa: BLE001 - megatron-core without megatron.training, or it fails to import
        return False
    add = arguments.add_megatron_arguments
    if not getattr(add, _MARK, False):

        @functools.wraps(add)
        def add_megatron_arguments(parser):
            return add_dion3_arguments(add(parser))

        setattr(add_megatron_arguments, _MARK, True)
        arguments.add_megatron_arguments = add_megatron_arguments

    try:
        training = importlib.import_module("megatron.training.training")
    except Exception:  # noqa: BLE001
        return True
    get_config = training.get_megatron_optimizer_config
    if not getattr(get_config, _MARK, False):

        @functools.wraps(get_config)
        def get_megatron_optimizer_config(args):
            config, overrides = get_config(args)
            for key, default in DION3_DEFAULTS.items():
                setattr(config, key, getattr(args, key, getattr(config, key, default)))
            if _is_dion3(config.optimizer):
                warn_if_adam_takes_the_dion3_lr(args)
            return config, overrides

        setattr(get_megatron_optimizer_config, _MARK, True)
        training.get_megatron_optimizer_config = get_megatron_optimizer_config
    _register_model_builder()
    return True


def layer_wise_dion3_run() -> bool:
    """Whether Megatron-LM's args (when parsed) ask for Dion3 with the layer-wise ZeRO-1 layout:
    ``--optimizer dion3 --use-distributed-optimizer`` (which Megatron's argument validation turns
    into ``use_layer_wise_distributed_optimizer``), and not ``--no-use-layer-wise-param-layout``."""
    from megatron.training import global_vars

    args = getattr(global_vars, "_GLOBAL_ARGS", None)
    return (args is not None and _is_dion3(getattr(args, "optimizer", None))
            and bool(getattr(args, "use_layer_wise_distributed_optimizer", False))
            and bool(getattr(args, "use_layer_wise_param_layout", True)))


def _register_model_builder() -> None:
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
    layer-wise wrapper, the matrices all-gathered after the step). For a Dion3 run this wraps
    ``_ddp_wrap`` to do what ``wrap_model_chunks_with_ddp`` does: reduce-scatter
    (``use_distributed_optimizer`` on DDP's config), the parameters tagged for the two buffers, and
    the layer-wise layout in place of the DistributedOptimizer's. Other optimizers (muon too) and
    FSDP are left as Megatron builds them.
    """
    try:
        dist_utils = importlib.import_module("megatron.training.models.dist_utils")
    except Exception:  # noqa: BLE001 - a Megatron without the model-config path
        return
    ddp_wrap = getattr(dist_utils, "_ddp_wrap", None)
    if ddp_wrap is None or getattr(ddp_wrap, _MARK, False):
        return
    from megatron.core.optimizer.layer_wise_optimizer import (
        LayerWiseDistributedOptimizer,
        tag_params_for_buffer_routing,
    )

    class LayerWiseLayout:
        """Stands in for ``DistributedOptimizer`` inside ``_ddp_wrap``, which reads only its layout."""

        compute_full_param_layout = staticmethod(LayerWiseDistributedOptimizer.compute_full_param_layout)

    @functools.wraps(ddp_wrap)
    def _ddp_wrap(model, data_parallel_random_init, ddp_config, overlap_param_gather_with_optimizer_step,
                  use_megatron_fsdp=False, use_torch_fsdp2=False, **kwargs):
        if use_megatron_fsdp or use_torch_fsdp2 or not layer_wise_dion3_run():
            return ddp_wrap(model, data_parallel_random_init, ddp_config, overlap_param_gather_with_optimizer_step,
                            use_megatron_fsdp=use_megatron_fsdp, use_torch_fsdp2=use_torch_fsdp2, **kwargs)
        ddp_config.use_distributed_optimizer = True
        tag_params_for_buffer_routing(model)
        saved = dist_utils.DistributedOptimizer
        dist_utils.DistributedOptimizer = LayerWiseLayout
        try:
            return ddp_wrap(model, data_parallel_random_init, ddp_config, overlap_param_gather_with_optimizer_step,
                            use_megatron_fsdp=False, use_torch_fsdp2=False, **kwargs)
        finally:
            dist_utils.DistributedOptimizer = saved

    setattr(_ddp_wrap, _MARK, True)
    dist_utils._ddp_wrap = _ddp_wrap  # noqa: SLF001


_registered = False


def register() -> bool:
    """Make ``optimizer='dion3'`` / ``--optimizer dion3`` work; safe to call any number of times.

    Returns True when Megatron-LM's argument parser was extended too (``megatron.training``
    importable), False when only Megatron-Core's optimizer registry was.
    """
    global _registered
    _register_core()
    torch_adam.install()
    multi_tensor.install()
    training = _register_training()
    _registered = True
    return training


def is_registered() -> bool:
    from megatron.core.optimizer import emerging_optimizers as eo

    return OPTIMIZER_NAME in eo._EMERGING_OPTIMIZERS  # noqa: SLF001
