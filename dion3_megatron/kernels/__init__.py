"""Symmetric-GEMM GPU kernels (CuTe DSL, Hopper sm_90a) for Gram Newton-Schulz.

Importing this package is always safe: nvidia-cutlass-dsl is imported only when a kernel first
runs. On import it registers the ``"cutedsl"`` backend with :mod:`dion3_megatron.ortho`, whose
selector claims CUDA operands on Hopper GPUs when the DSL is installed; each product then goes
to a kernel only where it measured faster than cuBLAS (see :mod:`.backend`), and to torch
elsewhere. ``ortho.set_backend("torch")`` forces plain torch; ``set_backend("cutedsl")`` forces
this backend (which still falls back to torch for operands its kernels cannot take).
"""

from __future__ import annotations

from .backend import (
    BACKEND_NAME,
    KERNEL_BACKEND,
    cutlass_available,
    kernel_capable_device,
    register,
    routes_to_kernel,
    select,
    set_routing,
    symm_gemm,
)

register()

__all__ = [
    "BACKEND_NAME",
    "KERNEL_BACKEND",
    "cutlass_available",
    "kernel_capable_device",
    "register",
    "routes_to_kernel",
    "select",
    "set_routing",
    "symm_gemm",
]
