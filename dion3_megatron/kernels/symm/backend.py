"""The "cutedsl" MatmulBackend: symmetric kernels where they pay, torch everywhere else.

A product goes to the kernel only when every condition holds
  * CUDA tensor on a compute-capability 9.0 device (Hopper; the kernels use wgmma and TMA),
  * nvidia-cutlass-dsl and apache-tvm-ffi importable (the ``kernels`` extra),
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


@functools.lru_cache(maxsize=None)
def kernels_installed() -> bool:
    """nvidia-cutlass-dsl (CuTe DSL) and apache-tvm-ffi, its light calling convention, importable
    (checked without importing them). The DSL without apache-tvm-ffi warns once and leaves the
    kernels off: its own launch path costs tens of microseconds of host time per product."""
    if not (_importable("cutlass") and _importable("cutlass.cute")):
        return False
    if not _importable("tvm_ffi"):
        warnings.warn(
            "nvidia-cutlass-dsl is installed but apache-tvm-ffi is not: the symmetric-GEMM kernels "
            "stay off (pip install 'dion3-megatron[kernels]' installs both)",
            stacklevel=2,
        )
        return False
    return True


@functools.lru_cache(maxsize=None)
def _device_capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index) == (9, 0)


def kernel_capable_device(t: torch.Tensor) -> bool:
    """t lives on a Hopper GPU and the kernels are installed."""
    if not t.is_cuda or not kernels_installed():
        return False
    index = t.get_device()
    return _device_capable(index if index >= 0 else torch.cuda.current_device())


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
