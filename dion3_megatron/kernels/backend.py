"""The "cutedsl" MatmulBackend: symmetric kernels where they pay, torch everywhere else.

Routing is per product, from the measured crossover against cuBLAS on an H200
(docs/benchmarks.md, "Kernels"): a product goes to the kernel only when every condition holds
  * CUDA tensor on a compute-capability 9.0 device (Hopper; the kernels use wgmma and TMA),
  * nvidia-cutlass-dsl importable,
  * fp16/bf16 operands, 16-byte aligned rows (M and K multiples of 8),
  * the product is large enough to pay (:func:`routes_to_kernel`, with the thresholds of the
    kernel configuration, :class:`.config.KernelConfig`).
Otherwise the product runs in torch, exactly as the "torch" backend would. The backend is asked
only while the configuration's kernels is "auto" (or it is forced by name).
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Optional

import torch

from . import config as kernel_config
from .dispatch import TORCH_BACKEND, MatmulBackend, register_backend

BACKEND_NAME = "cutedsl"


@functools.lru_cache(maxsize=None)
def cutlass_available() -> bool:
    """nvidia-cutlass-dsl importable (checked without importing it)."""
    try:
        return importlib.util.find_spec("cutlass") is not None and importlib.util.find_spec("cutlass.cute") is not None
    except (ImportError, ValueError):
        return False


@functools.lru_cache(maxsize=None)
def _device_capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index) == (9, 0)


def kernel_capable_device(t: torch.Tensor) -> bool:
    """t lives on a Hopper GPU and the DSL is installed."""
    if t.device.type != "cuda":
        return False
    if not cutlass_available():
        return False
    return _device_capable(t.device.index if t.device.index is not None else torch.cuda.current_device())


def routes_to_kernel(batch: int, m: int, k: int, dtype: torch.dtype) -> bool:
    """Whether a (batch, m, k) symmetric product goes to the kernel (shape and dtype only): with
    the configuration's routing "measured", only those that fill the GPU (``KernelConfig.min_tiles``),
    or, where stream-K may split them, at least ``KernelConfig.min_width`` wide: smaller ones measured
    slower than cuBLAS."""
    if dtype not in (torch.float16, torch.bfloat16):
        return False
    if m % 8 or k % 8:  # TMA needs 16-byte row strides
        return False
    config = kernel_config.current()
    if config.routing == "always":
        return True
    if config.stream_k is not False and m >= config.min_width and k <= kernel_config.SPLIT_MAX_K:
        return True
    return batch * kernel_config.tile_count(m, *kernel_config.ROUTING_TILE) >= config.min_tiles


def symm_gemm(*args, **kwargs):
    """D = alpha * a @ b^T + beta * c on the kernel (see :func:`.sm90_symm.symm_gemm`)."""
    from .sm90_symm import symm_gemm as _impl  # imports cutlass

    return _impl(*args, **kwargs)


def _as3(t: torch.Tensor) -> torch.Tensor:
    return t if t.dim() == 3 else t.reshape(-1, *t.shape[-2:])


def _kernel_ok(x: torch.Tensor, m: int, k: int) -> bool:
    batch = x.numel() // max(1, x.shape[-1] * x.shape[-2])
    return kernel_capable_device(x) and routes_to_kernel(batch, m, k, x.dtype)


def _gram(x: torch.Tensor, alpha: float, beta: float, c: Optional[torch.Tensor]) -> torch.Tensor:
    m, k = x.shape[-2], x.shape[-1]
    if not _kernel_ok(x, m, k) or (c is not None and c.dtype != x.dtype):
        return TORCH_BACKEND.gram(x, alpha, beta, c)
    x3 = _as3(x)
    out = symm_gemm(x3, x3, alpha, beta, _as3(c) if c is not None else None)
    return out.reshape(*x.shape[:-1], m)


def _symmetric(
    a: torch.Tensor, b: torch.Tensor, alpha: float, beta: float, c: Optional[torch.Tensor]
) -> torch.Tensor:
    m = a.shape[-1]
    if (
        a.shape != b.shape
        or a.dtype != b.dtype
        or a.shape[-2] != m
        or not _kernel_ok(a, m, m)
        or (c is not None and c.dtype != a.dtype)
    ):
        return TORCH_BACKEND.symmetric(a, b, alpha, beta, c)
    # a @ b with b symmetric equals a @ b^T: b's row-major storage is the K-major operand.
    out = symm_gemm(_as3(a), _as3(b), alpha, beta, _as3(c) if c is not None else None)
    return out.reshape(a.shape)


KERNEL_BACKEND = MatmulBackend(BACKEND_NAME, _gram, _symmetric, TORCH_BACKEND.matmul)


def select(x: torch.Tensor) -> Optional[MatmulBackend]:
    """Auto-dispatch selector: claim a (batch, s, L) operand on a kernel-capable device when at
    least its s x s x L Gram product would route to a kernel; otherwise leave it to plain torch
    (no per-product checks on the host for shapes that never pay)."""
    if not kernel_capable_device(x):
        return None
    s, length = x.shape[-2], x.shape[-1]
    batch = x.numel() // max(1, s * length)
    return KERNEL_BACKEND if routes_to_kernel(batch, s, length, torch.float16) else None


def register() -> None:
    """Register the backend and its selector with :mod:`.dispatch` (idempotent)."""
    register_backend(KERNEL_BACKEND, select)
