"""Orthogonalization: Newton-Schulz and Gram Newton-Schulz, batched, any dtype.

Both iterate X <- p(X X^T) X with p(A) = a I + b A + c A^2 for a schedule of (a, b, c).
Standard NS works on the s x L matrix itself (s <= L); Gram NS iterates on the s x s Gram matrix
and applies the accumulated polynomial to X once at the end (and once at the restart), which is
cheaper when L >> s and makes every intermediate product symmetric.

Matrix products go through a :class:`~dion3_megatron.kernels.dispatch.MatmulBackend`, chosen per
operand by :func:`~dion3_megatron.kernels.dispatch.get_backend` under the kernel configuration
(:mod:`dion3_megatron.kernels.config`): plain torch, or GPU kernels (symmetric GEMMs) where they pay.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..kernels import config as kernel_config
from ..kernels import rows as row_kernels
from ..kernels.dispatch import get_backend, transposed_view

Coefficients = Sequence[tuple[float, float, float]]

# Polar Express (arXiv 2505.16932), 5 steps, before the safety factor is applied.
POLAR_EXPRESS_RAW: tuple[tuple[float, float, float], ...] = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
)
# Keller Jordan's constant quintic: the Muon baseline.
KELLER_QUINTIC: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)

GRAM_SAFETY = 1.05
STANDARD_SAFETY = 1.01


def polar_express_coefficients(safety: float = GRAM_SAFETY) -> list[tuple[float, float, float]]:
    """Polar Express schedule scaled by a safety factor s as (a/s, b/s^3, c/s^5).

    The factor keeps singular values that rounding pushed slightly above 1 from diverging.
    """
    if safety < 1.0:
        raise ValueError(f"safety must be >= 1, got {safety}")
    s = safety
    return [(a / s, b / s**3, c / s**5) for a, b, c in POLAR_EXPRESS_RAW]


def keller_coefficients(steps: int = 5) -> list[tuple[float, float, float]]:
    """Keller Jordan's quintic repeated ``steps`` times (Muon's schedule)."""
    return [KELLER_QUINTIC] * steps


# --------------------------------------------------------------------------------------------
# Shared pre/post-processing.


def _as_wide_batch(g: torch.Tensor) -> tuple[torch.Tensor, bool, torch.Size]:
    """View g (..., r, c) as a 3-D batch of wide matrices (s <= L); returns (x, transposed, shape)."""
    if g.dim() < 2:
        raise ValueError(f"orthogonalization needs a matrix or a batch of matrices, got shape {tuple(g.shape)}")
    shape = g.shape
    x = g.reshape(-1, shape[-2], shape[-1])
    transposed = shape[-2] > shape[-1]
    if transposed:
        x = x.mT
    return x, transposed, shape


def _normalized(x: torch.Tensor, dtype: torch.dtype, norm_factor: float, eps: float) -> torch.Tensor:
    """x / (norm_factor * ||x||_F + eps) per matrix, computed in fp32 (fp64 for fp64) and written in
    ``dtype`` by the last kernel, in x's layout (a transposed view stays one: both sides of the
    pass coalesced).

    Without overflow for every finite x: ||x||_F overflows fp32 from about 1.8e19 although each
    entry is finite (the step would silently be zero), so the norm is taken of x / max|x|, whose
    entries are at most 1, and eps is scaled alike. On CUDA with a half-precision result, the
    Triton form (:func:`~dion3_megatron.kernels.triton_rows.normalized`) does the same in two passes
    and no fp32 copy."""
    if row_kernels.takes_block(x, dtype):
        from ..kernels import triton_rows

        return triton_rows.normalized(x, dtype, norm_factor, eps)
    work = torch.float64 if x.dtype == torch.float64 or dtype == torch.float64 else torch.float32
    xw = x.to(work)
    peak = torch.linalg.vector_norm(xw, ord=float("inf"), dim=(-2, -1), keepdim=True).clamp_min(torch.finfo(work).tiny)
    unit = xw / peak
    norm = torch.linalg.matrix_norm(unit, ord="fro", keepdim=True)
    return torch.div(unit, norm * norm_factor + eps / peak, out=torch.empty_like(xw, dtype=dtype))


def _restore(out: torch.Tensor, transposed: bool, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    if transposed:
        out = out.mT
    return out.reshape(shape).to(dtype)


def _left_times(mm, q: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """q @ x for a symmetric q, in x's layout: a transposed view (a tall matrix's, from
    :func:`_as_wide_batch`) comes back as one, computed as (x^T q)^T, so the tall result needs no
    transposing copy later (the row kernels read whole rows)."""
    if transposed_view(x):
        return mm.matmul(x.mT, q).mT
    return mm.matmul(q, x)


def _add_identity(m: torch.Tensor, scale: float) -> torch.Tensor:
    m.diagonal(dim1=-2, dim2=-1).add_(scale)
    return m


# --------------------------------------------------------------------------------------------
# The two iterations.


@kernel_config.pinned()  # one read of the kernel configuration for all its products
def newton_schulz(
    g: torch.Tensor,
    coefficients: Optional[Coefficients] = None,
    dtype: torch.dtype = torch.float16,
    norm_factor: float = STANDARD_SAFETY,
    eps: float = 1e-7,
    out_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """Standard Newton-Schulz: X <- a X + (b A + c A^2) X, A = X X^T, on each matrix of ``g``.

    g: (..., rows, cols), tall or wide. Computes in ``dtype``; returns ``out_dtype`` (default g's).
    Default schedule: Polar Express with safety 1.01, input normalised by 1.01 * ||g||_F.
    """
    coefficients = polar_express_coefficients(STANDARD_SAFETY) if coefficients is None else coefficients
    x, transposed, shape = _as_wide_batch(g)
    x = _normalized(x, dtype, norm_factor, eps)
    mm = get_backend(x)
    for a, b, c in coefficients:
        gram = mm.gram(x, 1.0, 0.0, None)
        # a I + b A + c A^2: X's update is then one product; with a X as an addend, torch's
        # baddbmm would first copy X into its result (a pass over the whole batch)
        poly = _add_identity(mm.symmetric(gram, gram, c, b, gram), a)
        x = _left_times(mm, poly, x)
    return _restore(x, transposed, shape, out_dtype or g.dtype)


@kernel_config.pinned()
def gram_newton_schulz(
    g: torch.Tensor,
    coefficients: Optional[Coefficients] = None,
    dtype: torch.dtype = torch.float16,
    norm_factor: float = 1.0,
    eps: float = 1e-7,
    restarts: Sequence[int] = (2,),
    out_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """Gram Newton-Schulz: the same polynomial iterated on R = X X^T, applied to X at the end.

    One restart (at iteration 2 by default) re-forms X and R from the accumulated polynomial Q,
    which stops rounding-born negative eigenvalues of R from growing in half precision.
    Square matrices gain nothing from the Gram form and take :func:`newton_schulz`.
    Default schedule: Polar Express with safety 1.05; input normalised by ||g||_F.
    """
    if g.dim() >= 2 and g.shape[-1] == g.shape[-2]:
        if coefficients is None:  # the standard path's own schedule and normalisation
            return newton_schulz(g, dtype=dtype, eps=eps, out_dtype=out_dtype)
        return newton_schulz(g, coefficients, dtype, norm_factor, eps, out_dtype)
    coefficients = polar_express_coefficients(GRAM_SAFETY) if coefficients is None else coefficients
    x, transposed, shape = _as_wide_batch(g)
    x = _normalized(x, dtype, norm_factor, eps)
    mm = get_backend(x)
    steps = len(coefficients)
    restart_set = set(restarts)
    r = mm.gram(x, 1.0, 0.0, None)
    q: Optional[torch.Tensor] = None
    for i, (a, b, c) in enumerate(coefficients):
        if i in restart_set and q is not None:
            x = _left_times(mm, q, x)
            r = mm.gram(x, 1.0, 0.0, None)
            q = None
        # Z = b R + c R^2; a*I stays out of Z so half precision does not lose b R + c R^2 under it.
        z = mm.symmetric(r, r, c, b, r)
        q = _add_identity(z.clone(), a) if q is None else mm.symmetric(q, z, 1.0, a, q)
        if i < steps - 1 and (i + 1) not in restart_set:
            rz = mm.symmetric(r, z, 1.0, a, r)  # (Z + aI) R
            r = mm.symmetric(z, rz, 1.0, a, rz)  # (Z + aI) R (Z + aI)
    assert q is not None
    x = _left_times(mm, q, x)
    return _restore(x, transposed, shape, out_dtype or g.dtype)


ORTHOGONALIZERS = {"gram": gram_newton_schulz, "standard": newton_schulz}


# The compute dtypes the orthogonalization takes, by name.
NS_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}


def default_ns_dtype(device: torch.device) -> torch.dtype:
    """fp16 on GPUs (keeps the Gram matrix accurate); fp32 elsewhere, since CPUs have no fast
    half-precision matmul (fp16 there is ~100x slower than fp32) and fp32 only rounds less."""
    return torch.float16 if device.type == "cuda" else torch.float32


def orthogonalize(
    g: torch.Tensor,
    ns_method: str = "gram",
    dtype: Optional[torch.dtype] = None,
    out_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """Orthogonalize each matrix of ``g`` with the named ns_method and its default schedule.

    dtype: compute dtype; None picks :func:`default_ns_dtype` for g's device.
    """
    try:
        fn = ORTHOGONALIZERS[ns_method]
    except KeyError:
        raise ValueError(f"ns_method must be one of {sorted(ORTHOGONALIZERS)}, got {ns_method!r}") from None
    return fn(g, dtype=dtype or default_ns_dtype(g.device), out_dtype=out_dtype)


def ns_flops(s: int, length: int, ns_method: str = "gram", steps: int = 5) -> float:
    """Matmul FLOPs of one s x L orthogonalization (s <= L), symmetric products at half cost.

    standard: 5 (3 s^2 L + s^3) for 5 steps; gram with one restart: 6 s^2 L + 14 s^3.
    """
    s, length = min(s, length), max(s, length)
    if ns_method == "standard":
        return steps * (3 * s * s * length + s**3)
    if ns_method == "gram":
        return 6 * s * s * length + 14 * s**3
    raise ValueError(f"ns_method must be 'gram' or 'standard', got {ns_method!r}")


__all__ = [
    "POLAR_EXPRESS_RAW",
    "KELLER_QUINTIC",
    "polar_express_coefficients",
    "keller_coefficients",
    "newton_schulz",
    "gram_newton_schulz",
    "NS_DTYPES",
    "default_ns_dtype",
    "orthogonalize",
    "ns_flops",
]
