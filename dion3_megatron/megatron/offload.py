"""Megatron's optimizer offload for ``--optimizer dion3``: ``--optimizer-cpu-offload`` keeps
Dion3's state in pinned host memory and steps it on the GPU (:mod:`dion3_megatron.engine.offload`).

Megatron-Core 0.19 builds its ``HybridDeviceOptimizer`` for ``--optimizer-cpu-offload`` (Adam or
SGD stepped on the CPU), which Megatron-LM allows only with ``--use-precision-aware-optimizer``,
which ``OptimizerConfig`` allows only for Adam under the distributed optimizer (Transformer
Engine's FusedAdam with lower-precision states). For a Dion3 run this module, through the entries
of :data:`~.registry.MEGATRON`:

* lifts Megatron-LM's check that offload comes with the precision-aware optimizer
  (:func:`offload_validation`): for Dion3 either works alone (the precision-aware optimizer's dtypes:
  :mod:`.precision`); what Dion3 cannot take of the offload is refused in one line
  (:func:`offload_refusal`), also by the launcher before Megatron starts, and by ``config_to_kwargs``
  for a Megatron-Core ``OptimizerConfig`` (which takes ``optimizer_cpu_offload`` without the
  precision-aware optimizer);
* hands ``--optimizer-cpu-offload`` to ``MegatronDion3`` (:func:`offloads`) and builds Megatron's
  Adam part (embeddings, output layer, norms) as without it, on the GPU (:func:`adam_part_on_device`).
"""

from __future__ import annotations

import copy
import functools
from typing import Any, Optional

from .arguments import is_dion3


def offload_refusal(source: Any, flags: bool) -> Optional[str]:
    """One line for what a Dion3 run cannot take of Megatron's optimizer offload (``source``:
    Megatron-LM's args or an ``OptimizerConfig``), naming the flag (``flags``) or the config field;
    None where it takes all."""
    if getattr(source, "use_torch_optimizer_for_cpu_offload", False):
        name = "--use-torch-optimizer-for-cpu-offload" if flags else "use_torch_optimizer_for_cpu_offload"
        return f"--optimizer dion3: {name} must be False, got True: Dion3 steps its offloaded state on the GPU, with no CPU optimizer"
    if getattr(source, "optimizer_cpu_offload", False):
        fraction = getattr(source, "optimizer_offload_fraction", 1.0)
        if 0 < fraction < 1:
            name = "--optimizer-offload-fraction" if flags else "optimizer_offload_fraction"
            return (
                f"--optimizer dion3 offloads all of its state or none: {name} must be 1.0 (or 0: none), got {fraction} "
                "(a GPU holds about two shape groups' state during an offloaded step, and none between steps)"
            )
        if getattr(source, "use_torch_fsdp2", False):
            return (
                "--optimizer dion3 --use-torch-fsdp2 keeps Dion3's state beside its DTensor parameters: drop "
                "--optimizer-cpu-offload, or use --use-distributed-optimizer (the layer-wise ZeRO-1 layout) with it"
            )
    return None


def offloads(config: Any) -> bool:
    """Whether Dion3 keeps its state in host memory: ``optimizer_cpu_offload`` with all of the
    state offloaded (an ``optimizer_offload_fraction`` of 0 offloads none, as Megatron's own)."""
    return bool(getattr(config, "optimizer_cpu_offload", False)) and getattr(config, "optimizer_offload_fraction", 1.0) > 0


def offload_validation(validate_args):
    """Megatron-LM's ``validate_args``; for ``--optimizer dion3``, what Dion3 cannot take of
    optimizer offload stops the run in one line, and Megatron's checks run as if
    ``--use-precision-aware-optimizer`` came with ``--optimizer-cpu-offload`` (they assert it does:
    Megatron's CPU Adam needs it; Dion3 needs neither for the other). After them the args hold the
    flags as they were given."""

    @functools.wraps(validate_args)
    def validate(args, *rest, **kwargs):
        if not is_dion3(getattr(args, "optimizer", None)):
            return validate_args(args, *rest, **kwargs)
        refusal = offload_refusal(args, flags=True)
        if refusal is not None:
            raise SystemExit(refusal)
        given = args.use_precision_aware_optimizer
        args.use_precision_aware_optimizer = given or args.optimizer_cpu_offload
        try:
            return validate_args(args, *rest, **kwargs)
        finally:
            args.use_precision_aware_optimizer = given

    return validate


def adam_part_on_device(build):
    """Megatron's ``_get_megatron_optimizer_based_on_param_groups``, as the factory of a Dion3 run
    calls it for its Adam part: given the config without ``optimizer_cpu_offload``, which Dion3
    takes for its own state (with it Megatron would build its ``HybridDeviceOptimizer``, whose Adam
    steps on the CPU and which needs the precision-aware optimizer)."""

    @functools.wraps(build)
    def without_offload(*args, **kwargs):
        config = kwargs.get("config")
        if config is not None and getattr(config, "optimizer_cpu_offload", False):
            config = copy.copy(config)
            config.optimizer_cpu_offload = False
            kwargs["config"] = config
        return build(*args, **kwargs)

    return without_offload
