"""The benchmark-only "quack" backend maps our products onto quack's gemm_symmetric correctly:
with a CPU stand-in of that function (alpha * A @ B + beta * C into ``out``), Gram Newton-Schulz on
the backend equals the torch backend's, and both symmetric products reach it."""

from __future__ import annotations

import torch

from benchmarks import quack_backend
from dion3_megatron import kernels
from dion3_megatron.core import ortho


def test_gram_newton_schulz_on_the_quack_backend_equals_torch(generator):
    calls = []

    def gemm_symmetric(A, B, C=None, out=None, alpha=1.0, beta=1.0):
        assert isinstance(alpha, float) and isinstance(beta, float)  # quack reads other types as tensors
        assert A.shape[-1] == B.shape[-2] and out.shape == (*A.shape[:-1], B.shape[-1])
        calls.append("gram" if C is None else "symmetric")  # ortho: X X^T alone; b P + c P @ P with C
        result = alpha * (A @ B)
        out.copy_(result if C is None else result + beta * C)

    assert quack_backend.register(gemm_symmetric)
    g = torch.randn(3, 24, 80, generator=generator, dtype=torch.float64)
    with kernels.using(kernels="torch"):
        expected = ortho.gram_newton_schulz(g, dtype=torch.float64)
    with kernels.using(backend=quack_backend.NAME):
        got = ortho.gram_newton_schulz(g, dtype=torch.float64)
    assert {"gram", "symmetric"} <= set(calls)
    assert torch.allclose(got, expected, rtol=1e-10, atol=1e-12)
    assert not torch.allclose(got, g / g.norm(dim=(-2, -1), keepdim=True))  # it did orthogonalize
