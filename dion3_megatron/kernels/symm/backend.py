"""The "cutedsl" MatmulBackend: symmetric kernels where they pay, torch everywhere else.

A product goes to the kernel only when every condition holds
  * CUDA tensor on a compute-capability 9.0 device (Hopper; the kernels use wgmma and TMA),
  * nvidia-cutlass-dsl and apache-tvm-ffi importable (the ``kernels`` extra; with one of them
    alone the first step on a Hopper GPU warns, once),
  * fp16/bf16 operands, 16-byte aligned rows (M and K multiples of 8),
  * the product is large enough to pay (:func:`.heuristics.routes_to_kernel`, with the thresholds
    of the kernel configuration, :class:`..config.KernelConfig`).
Otherwise the product runs in torch, exactly as the "torch" backend would. The backend is asked
only while the configuration lets the package choose kernels (or it is forced by name).
"""

from __future__ import annotations

import functools
import importlib.util
import warnings
from typing import Optional

import torch

from .. import config as kernel_config
from ..dispatch import TORCH_BACKEND, MatmulBackend, register_backend, transposed_view
from .heuristics import routes_to_kernel

BACKEND_NAME = "cutedsl"


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


# What the kernels import, as (distribution, module): CuTe DSL compiles them; apache-tvm-ffi is the
# light calling convention of their launch (a few microseconds of host time per product where the
# DSL's own argument marshalling takes tens).
REQUIRED = (("nvidia-cutlass-dsl", "cutlass.cute"), ("apache-tvm-ffi", "tvm_ffi"))
INSTALL = "pip install 'dion3-megatron[kernels]'"
# What running without them costs: Gram Newton-Schulz on cuBLAS against the kernels, summed over the
# 14B model's shapes on an H200 (benchmarks/results/gram-ns-h200.json, total_ratios).
COST = "Gram Newton-Schulz runs on cuBLAS, 1.45x the time it takes on the kernels (14B shapes, one H200)"


@functools.lru_cache(maxsize=None)
def missing() -> tuple[str, ...]:
    """The distributions of :data:`REQUIRED` whose module does not import here (checked without
    importing it)."""
    return tuple(distribution for distribution, module in REQUIRED if not _importable(module))


def kernels_installed() -> bool:
    """nvidia-cutlass-dsl (CuTe DSL) and apache-tvm-ffi, its light calling convention, importable."""
    return not missing()


def half_installed() -> Optional[str]:
    """Where some of the kernels' distributions are installed and others not, which: 'X is installed
    but Y is not'; None otherwise."""
    absent = missing()
    if not absent or len(absent) == len(REQUIRED):
        return None
    present = [distribution for distribution, _ in REQUIRED if distribution not in absent]
    return f"{' and '.join(present)} is installed but {' and '.join(absent)} is not"


@functools.lru_cache(maxsize=None)
def _warn_half_installed() -> None:
    """Once per process, on a Hopper GPU (where the kernels would run): what is missing, what it
    costs, how to install it."""
    which = half_installed()
    if which is not None:
        warnings.warn(
            f"dion3_megatron: the symmetric-GEMM kernels are off: {which}. {COST}. {INSTALL} installs "
            "what they need (DION3_KERNELS=0 runs torch without this warning)",
            RuntimeWarning,
            stacklevel=2,
        )


@functools.lru_cache(maxsize=None)
def _device_capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index) == (9, 0)


def kernel_capable_device(t: torch.Tensor) -> bool:
    """``t`` lives on a Hopper GPU and the kernels are installed. On a Hopper GPU with the kernels
    half installed the first step warns, once (``half_installed``)."""
    if not t.is_cuda:
        return False
    index = t.get_device()
    if not _device_capable(index if index >= 0 else torch.cuda.current_device()):
        return False
    if kernels_installed():
        return True
    _warn_half_installed()
    return False


def symm_gemm(*args, **kwargs):
    """D = alpha * a @ b^T + beta * c on the kernel (see :func:`.launch.symm_gemm`)."""
    from .launch import symm_gemm as _impl  # imports cutlass

    return _impl(*args, **kwargs)


# How a kind of product (operands' shape, strides, dtypes, device; the kernel configuration) runs:
# a launch of the kernel on the operands as they lie, GENERAL (the kernel, through symm_gemm, which
# copies operands into the layout it reads), or absent from the values: torch. Decided once per kind,
# so that an eager product costs the host one lookup and the launch itself.
_CHOICES: dict = {}
GENERAL = "general"


def _choice(x: torch.Tensor, c: Optional[torch.Tensor]):
    """The launch of ``alpha * x @ x^T + beta * c`` (x (B, m, k)), or of ``a @ b`` for symmetric
    (B, m, m) operands shaped and laid out like x, or GENERAL, or None (torch)."""
    config = kernel_config.current()
    key = (x.shape, x.stride(), x.dtype, None if c is None else (c.shape, c.stride(), c.dtype), x.get_device(), config)
    try:
        return _CHOICES[key]
    except KeyError:
        choice = _CHOICES[key] = _choose(x, c, config)
        return choice


def _choose(x: torch.Tensor, c: Optional[torch.Tensor], config: kernel_config.KernelConfig):
    batch, m, k = x.shape
    if not kernel_capable_device(x) or not routes_to_kernel(batch, m, k, x.dtype, config):
        return None
    if c is not None and c.dtype != x.dtype:
        return None
    m_major = m % 8 == 0 and transposed_view(x)
    if not (x.is_contiguous() or m_major) or (c is not None and (c.shape != (batch, m, m) or not c.is_contiguous())):
        return GENERAL
    return _launch_for(batch, m, k, x.dtype, x.dtype, None if c is None else c.dtype, m_major)


def _launch_for(*key):
    """:func:`.launch.launch_for` (imported when a product first goes to the kernel: it imports cutlass)."""
    from .launch import launch_for

    return launch_for(*key)


def _run(a: torch.Tensor, b: torch.Tensor, alpha: float, beta: float, c: Optional[torch.Tensor], choice):
    """Run a product the kernel takes: (B, m, m) in a's dtype."""
    if choice == GENERAL:
        return symm_gemm(a, b, alpha, beta, c)
    out = a.new_empty((a.shape[0], a.shape[1], a.shape[1]))
    choice(a, b, c, out, alpha, beta)
    return out


def _as3(t: torch.Tensor) -> torch.Tensor:
    return t if t.dim() == 3 else t.reshape(-1, *t.shape[-2:])


def _gram(x: torch.Tensor, alpha: float, beta: float, c: Optional[torch.Tensor]) -> torch.Tensor:
    x3 = _as3(x)
    c3 = _as3(c) if c is not None and beta != 0.0 else None
    choice = _choice(x3, c3)
    if choice is None:
        return TORCH_BACKEND.gram(x, alpha, beta, c)
    out = _run(x3, x3, alpha, beta, c3, choice)
    return out if x.dim() == 3 else out.reshape(*x.shape[:-1], x.shape[-2])


def _symmetric(a: torch.Tensor, b: torch.Tensor, alpha: float, beta: float, c: Optional[torch.Tensor]) -> torch.Tensor:
    if a.shape != b.shape or a.dtype != b.dtype or a.shape[-2] != a.shape[-1]:
        return TORCH_BACKEND.symmetric(a, b, alpha, beta, c)
    a3, b3 = _as3(a), _as3(b)
    c3 = _as3(c) if c is not None and beta != 0.0 else None
    choice = _choice(a3, c3)
    if choice is None:
        return TORCH_BACKEND.symmetric(a, b, alpha, beta, c)
    if b3.stride() != a3.stride():  # b laid out otherwise than a: made K-major by symm_gemm
        choice = GENERAL
    # a @ b with b symmetric equals a @ b^T: b's row-major storage is the K-major operand.
    out = _run(a3, b3, alpha, beta, c3, choice)
    return out if a.dim() == 3 else out.reshape(a.shape)


KERNEL_BACKEND = MatmulBackend(BACKEND_NAME, _gram, _symmetric, TORCH_BACKEND.matmul)


def select(x: torch.Tensor) -> Optional[MatmulBackend]:
    """Auto-dispatch selector: claim a (batch, s, L) operand on a kernel-capable device when at
    least its s x s x L Gram product would route to a kernel; otherwise leave it to plain torch
    (no per-product checks on the host for shapes that never pay)."""
    if not kernel_capable_device(x):
        return None
    s, length = x.shape[-2], x.shape[-1]
    batch = x.numel() // max(1, s * length)
    return KERNEL_BACKEND if routes_to_kernel(batch, s, length, torch.float16, kernel_config.current()) else None


def register() -> None:
    """Register the backend and its selector with :mod:`..dispatch` (idempotent)."""
    register_backend(KERNEL_BACKEND, select)
