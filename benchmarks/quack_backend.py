"""quack-kernels' symmetric GEMM as a MatmulBackend, for side-by-side benchmarks only.

Registered under the name "quack", it runs our Gram Newton-Schulz (``dion3_megatron.core.ortho``)
with quack's ``gemm_symmetric`` for the symmetric products (X X^T, and P @ Q of two commuting
symmetric matrices) and cuBLAS for the rest, exactly as our "cutedsl" backend splits them. The
same algorithm on two kernel libraries: a difference in time is the kernels', not the schedule's.
quack is measured where it is installed, never vendored.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from dion3_megatron.kernels.dispatch import TORCH_BACKEND, MatmulBackend, register_backend

NAME = "quack"


def quack_gemm_symmetric() -> Optional[Callable]:
    """quack's ``gemm_interface.gemm_symmetric(A, B, C=None, out=None, ..., alpha, beta)``, or None."""
    try:
        from quack.gemm_interface import gemm_symmetric  # type: ignore
    except Exception:  # noqa: BLE001 - not installed, or its CuTe DSL import failed: no quack column
        return None
    return gemm_symmetric


def make_backend(gemm_symmetric: Callable) -> MatmulBackend:
    """A backend whose symmetric products go to ``gemm_symmetric`` (A (L, M, K) @ B (L, K, M),
    ``alpha * A @ B + beta * C``, symmetric result); general products stay on torch."""

    def product(a: torch.Tensor, b: torch.Tensor, alpha: float, beta: float, c: Optional[torch.Tensor]) -> torch.Tensor:
        out = torch.empty(*a.shape[:-1], b.shape[-1], device=a.device, dtype=a.dtype)
        # quack treats a non-float alpha or beta as a device tensor: pass Python floats
        gemm_symmetric(a, b, C=c, out=out, alpha=float(alpha), beta=float(beta) if c is not None else 1.0)
        return out

    def gram(x: torch.Tensor, alpha: float, beta: float, c: Optional[torch.Tensor]) -> torch.Tensor:
        return product(x, x.mT, alpha, beta, c)

    def symmetric(a: torch.Tensor, b: torch.Tensor, alpha: float, beta: float, c: Optional[torch.Tensor]) -> torch.Tensor:
        return product(a, b.mT, alpha, beta, c)  # b is symmetric: b.mT is b, laid out as quack's B of a Gram

    return MatmulBackend(NAME, gram, symmetric, TORCH_BACKEND.matmul)


def register(gemm_symmetric: Optional[Callable] = None) -> bool:
    """Register the "quack" backend (force it with ``kernels.using(backend="quack")``); False when
    quack is not importable and no ``gemm_symmetric`` was given."""
    gemm_symmetric = gemm_symmetric or quack_gemm_symmetric()
    if gemm_symmetric is None:
        return False
    register_backend(make_backend(gemm_symmetric))
    return True
