"""GPU kernels and the choice of which run: symmetric GEMMs (CuTe DSL, Hopper sm_90a) for Gram
Newton-Schulz, Triton row kernels (``dion3_megatron.kernels.rows``), and one configuration for both
([`KernelConfig`][dion3_megatron.kernels.KernelConfig], in ``dion3_megatron.kernels.config``).

Importing this package is always safe: nvidia-cutlass-dsl is imported only when a kernel first
runs. On import it registers the ``"cutedsl"`` matmul backend with
``dion3_megatron.kernels.dispatch``, whose selector claims CUDA operands on Hopper GPUs when the
DSL is installed; each product then goes to a kernel only where it measured faster than cuBLAS
(see [`routes_to_kernel`][dion3_megatron.kernels.routes_to_kernel]), and to torch elsewhere.
``configure(kernels="torch")`` (or a Dion3 optimizer's ``kernels="torch"`` for its
steps, or ``DION3_KERNELS=0`` as the default) runs plain torch; ``configure(backend="cutedsl")``
forces this backend (which still falls back to torch for operands its kernels cannot take);
``configure(routing="always")`` sends it every product it can take.
"""

from __future__ import annotations

from .config import (
    KernelConfig,
    configure,
    current,
    from_environment,
    pinned,
    row_kernels_enabled,
    scoped_step,
    using,
)
from .dispatch import TORCH_BACKEND, MatmulBackend, get_backend, register_backend
from .symm.backend import BACKEND_NAME, KERNEL_BACKEND, kernel_capable_device, kernels_installed, register, select
from .symm.heuristics import routes_to_kernel

register()

__all__ = [
    "BACKEND_NAME",
    "KERNEL_BACKEND",
    "KernelConfig",
    "MatmulBackend",
    "TORCH_BACKEND",
    "configure",
    "current",
    "from_environment",
    "get_backend",
    "kernel_capable_device",
    "kernels_installed",
    "pinned",
    "register",
    "register_backend",
    "routes_to_kernel",
    "row_kernels_enabled",
    "scoped_step",
    "select",
    "using",
]
