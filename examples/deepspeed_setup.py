"""DeepSpeed's process setup for the examples: no shared-memory op build on CPU, and no deprecation
notice at each collective."""

from __future__ import annotations

import importlib
import warnings


def skip_shared_memory_op() -> None:
    """Where DeepSpeed runs on the CPU, its init_distributed builds a C++ shared-memory
    communication op (about 47 s on 2 cores, and a compiler needed) that gloo does without: skip it."""
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() == "cpu":
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None


def quiet_deprecated_collectives() -> None:
    """ZeRO-3 gathers and reduce-scatters parameters through DeepSpeed's comm, which calls torch's
    all_gather_into_tensor and reduce_scatter_tensor: torch deprecates both and would warn about 4
    times a step."""
    warnings.filterwarnings(
        "ignore", category=FutureWarning, message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated"
    )
