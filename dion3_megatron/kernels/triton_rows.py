"""Triton kernels for the row-wise steps of the Dion3 rule, one pass over memory each, named like
the rule functions they stand in for (whether they run: :mod:`.rows`).

* :func:`apply_rows`: W = shrink * W, plus each selected row's step times its scale: every row
  shrunk and the selected ones updated in one pass (the torch form in
  :func:`dion3_megatron.core.rule.apply_rows` takes a multi-tensor multiply, then ``index_add_``
  on the scaled steps). The step is added in fp32 and rounded to the weight's dtype once.
* :func:`accumulate_and_score`: M += G and the L1 norm of every row of the new M, one pass (the
  torch form in :func:`dion3_megatron.core.rule.accumulate_and_score` adds, then reads M again), M
  left decayed where the rule folds the decay in.
* :func:`take_selected`: copy out the selected rows of the momentum and decay them in place by mu
  (the torch form in :func:`dion3_megatron.core.rule.take_selected` gathers and scatters through an
  index per element).
* :func:`normalized`: Newton-Schulz's input, each matrix divided by its Frobenius norm and written
  in half precision, in two passes and a small kernel between them (the torch form in :func:`dion3_megatron.core.ortho._normalized`
  writes an fp32 copy on the way: 10 bytes per fp32 element here against 22).

A factor (shrink, mu) given as a number is a kernel argument; as a tensor (what a CUDA graph
reads) it is loaded on the device. Floating-point contraction is off: shrink * W and the scaled
step are each rounded to fp32 before they are added, as torch computes them, so a number and a
tensor factor (an eager step and a CUDA graph's) give identical bits. Imports triton at the top:
import it only where triton is present (:mod:`.rows` does that lazily).
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import triton
import triton.language as tl

BLOCK_ROWS, BLOCK_COLS = 16, 128
NORM_BLOCK = 2048  # elements per program of the normalization's two passes over the matrices
COMBINE_BLOCK = 1024  # block results per step of the one program per matrix between them
FP32_TINY = tl.constexpr(1.1754943508222875e-38)  # fp32's smallest normal: the peak of a zero block
SCORE_ROWS, SCORE_COLS = 4, 512  # whole rows per program: more programs, each loops over the columns


@triton.jit
def _accumulate_and_score(
    m_ptr,
    m_stride,
    g_ptr,
    g_stride,
    score_ptr,
    decay,
    n_rows,
    n_cols,
    COL_BLOCKS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    # COL_BLOCKS is a constant: older Triton interpreters cannot loop over a runtime bound
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    in_rows = rows < n_rows
    total = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.float32)
    for block in range(COL_BLOCKS):
        cols = block * BLOCK_C + tl.arange(0, BLOCK_C)
        inside = in_rows[:, None] & (cols < n_cols)[None, :]
        m_ptrs = m_ptr + rows[:, None].to(tl.int64) * m_stride + cols[None, :]
        g = tl.load(g_ptr + rows[:, None].to(tl.int64) * g_stride + cols[None, :], mask=inside, other=0.0)
        m = tl.load(m_ptrs, mask=inside, other=0.0) + g.to(tl.float32)
        tl.store(m_ptrs, m * decay, mask=inside)  # decay 1: m itself
        total += tl.abs(m)
    tl.store(score_ptr + rows, tl.sum(total, axis=1), mask=in_rows)


@triton.jit
def _apply_rows(
    w_ptr,
    w_stride,
    pos_ptr,
    step_ptr,
    scale_ptr,
    shrink_ptr,
    shrink,
    n_rows,
    n_cols,
    SHRINK_ON_DEVICE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    in_rows = rows < n_rows
    inside = in_rows[:, None] & (cols < n_cols)[None, :]
    w_ptrs = w_ptr + rows[:, None].to(tl.int64) * w_stride + cols[None, :]
    w = tl.load(w_ptrs, mask=inside, other=0.0).to(tl.float32)
    pos = tl.load(pos_ptr + rows, mask=in_rows, other=-1)  # the row's place among the steps, or -1
    chosen = in_rows & (pos >= 0)
    step = tl.load(step_ptr + pos[:, None].to(tl.int64) * n_cols + cols[None, :], mask=inside & chosen[:, None], other=0.0).to(tl.float32)
    scale = tl.load(scale_ptr + pos, mask=chosen, other=0.0)
    if SHRINK_ON_DEVICE:
        shrink = tl.load(shrink_ptr)
    w = w * shrink + step * scale[:, None]
    tl.store(w_ptrs, w.to(w_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=inside)


@triton.jit
def _take_selected(
    m_ptr,
    m_batch_stride,
    m_row_stride,
    idx_ptr,
    out_ptr,
    mu_ptr,
    mu,
    k,
    n_cols,
    MU_ON_DEVICE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    b = tl.program_id(0)
    picks = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    in_picks = picks < k
    inside = in_picks[:, None] & (cols < n_cols)[None, :]
    rows = tl.load(idx_ptr + b * k + picks, mask=in_picks, other=0)
    m_ptrs = m_ptr + b.to(tl.int64) * m_batch_stride + rows[:, None].to(tl.int64) * m_row_stride + cols[None, :]
    value = tl.load(m_ptrs, mask=inside, other=0.0)
    tl.store(out_ptr + (b * k + picks)[:, None].to(tl.int64) * n_cols + cols[None, :], value, mask=inside)
    if MU_ON_DEVICE:
        mu = tl.load(mu_ptr + b)
    tl.store(m_ptrs, value * mu, mask=inside)


@triton.jit
def _block_peak_and_squares(x_ptr, batch_stride, numel, peak_ptr, squares_ptr, BLOCK: tl.constexpr):
    # per block of one matrix: its largest |x| and the sum of (x / that)^2 (each term <= 1: no overflow).
    # The blocks on the grid's first axis, the matrices on the second: CUDA allows 2**31 - 1 programs
    # on the first and 65535 on the others, and a 64k x 8k matrix has 2**18 blocks.
    block = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    offsets = block * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + b * batch_stride + offsets, mask=offsets < numel, other=0.0).to(tl.float32)
    peak = tl.max(tl.abs(x), axis=0)
    unit = x / tl.maximum(peak, FP32_TINY)
    at = b * tl.num_programs(0) + block
    tl.store(peak_ptr + at, peak)
    tl.store(squares_ptr + at, tl.sum(unit * unit, axis=0))


@triton.jit
def _matrix_peak_and_inverse(peak_ptr, squares_ptr, blocks, norm_factor, eps, LOOPS: tl.constexpr, BLOCK: tl.constexpr):
    # per matrix, from its blocks' peaks and sums: its largest |x| (fp32's smallest normal for a zero
    # matrix), and 1 / (norm_factor * ||x / peak||_F + eps / peak), written over its first block's pair
    b = tl.program_id(0)
    row = b.to(tl.int64) * blocks
    peak = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in range(LOOPS):
        at = i * BLOCK + tl.arange(0, BLOCK)
        peak = tl.maximum(peak, tl.load(peak_ptr + row + at, mask=at < blocks, other=0.0))
    peak = tl.maximum(tl.max(peak, axis=0), FP32_TINY)
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in range(LOOPS):
        at = i * BLOCK + tl.arange(0, BLOCK)
        inside = at < blocks
        ratio = tl.load(peak_ptr + row + at, mask=inside, other=0.0) / peak
        total += tl.load(squares_ptr + row + at, mask=inside, other=0.0) * (ratio * ratio)
    norm = tl.sqrt(tl.sum(total, axis=0))
    tl.debug_barrier()  # all of its threads have read the row before its first pair is overwritten
    tl.store(peak_ptr + row, peak)
    tl.store(squares_ptr + row, 1.0 / (norm * norm_factor + eps / peak))


@triton.jit
def _scale_into(x_ptr, out_ptr, batch_stride, numel, peak_ptr, inverse_ptr, blocks, BLOCK: tl.constexpr):
    # out = (x / peak) * inverse (matrix b's, at [b * blocks]), rounded once to out's dtype; the grid
    # as _block_peak_and_squares's
    b = tl.program_id(1).to(tl.int64)
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < numel
    at = b * batch_stride + offsets
    x = tl.load(x_ptr + at, mask=inside, other=0.0).to(tl.float32)
    unit = (x / tl.load(peak_ptr + b * blocks)) * tl.load(inverse_ptr + b * blocks)
    tl.store(out_ptr + at, unit.to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=inside)


def _device_of(t: torch.Tensor):
    """Triton launches on the current CUDA device: make it ``t``'s for the launch (matrices of one
    process may live on several GPUs). CPU tensors: Triton's interpreter, no device to set."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def usable(weights: list[torch.Tensor]) -> bool:
    """Every weight a CUDA matrix with unit column stride in a dtype the kernel writes."""
    return all(
        w.is_cuda and w.dim() == 2 and w.stride(1) == 1 and w.dtype in (torch.float32, torch.bfloat16, torch.float16) for w in weights
    )


def dense_matrices(x: torch.Tensor) -> bool:
    """x (B, s, L) holds each matrix in one dense block, row- or column-major, the blocks one after
    another: what :func:`normalized` reads as flat memory."""
    if x.dim() != 3:
        return False
    batch, s, length = x.shape
    row_major = x.stride(2) == 1 and x.stride(1) == length
    column_major = x.stride(1) == 1 and x.stride(2) == s
    return (row_major or column_major) and (batch == 1 or x.stride(0) == s * length)


def normalized(x: torch.Tensor, dtype: torch.dtype, norm_factor: float, eps: float) -> torch.Tensor:
    """x / (norm_factor * ||x||_F + eps) per matrix of x (B, s, L) (see :func:`dense_matrices`),
    written in ``dtype`` in x's layout. As the torch form, without overflow for any finite x: the
    norm is taken of x / max|x| (per block, then combined), and eps is scaled alike."""
    batch, s, length = x.shape
    numel = s * length
    blocks = triton.cdiv(numel, NORM_BLOCK)
    peaks = torch.empty(batch, blocks, dtype=torch.float32, device=x.device)
    squares = torch.empty_like(peaks)
    out = torch.empty_like(x, dtype=dtype)  # x's strides: the same flat offsets
    with _device_of(x):
        _block_peak_and_squares[(blocks, batch)](x, numel, numel, peaks, squares, BLOCK=NORM_BLOCK)
        _matrix_peak_and_inverse[(batch,)](
            peaks, squares, blocks, norm_factor, eps, LOOPS=triton.cdiv(blocks, COMBINE_BLOCK), BLOCK=COMBINE_BLOCK
        )
        # each matrix's peak and inverse now lead its row of peaks and squares
        _scale_into[(blocks, batch)](x, out, numel, numel, peaks, squares, blocks, BLOCK=NORM_BLOCK)
    return out


def probe(device: torch.device) -> None:
    """Compile and run a row kernel on ``device`` once (raises where Triton cannot build it)."""
    momentum = torch.ones(1, 2, 3, device=device)
    accumulate_and_score(momentum, [torch.ones(2, 3, device=device)], torch.empty(1, 2, device=device))


def accumulate_and_score(
    momentum: torch.Tensor, grads: list[torch.Tensor], out: torch.Tensor, decay: Optional[float] = None
) -> torch.Tensor:
    """For each b: momentum[b] += grads[b]; out[b] = the L1 norm of every row of the new momentum[b];
    with ``decay``, momentum[b] is then multiplied by it (in the same pass).

    momentum (B, n, c) fp32 and grads B (n, c) (see :func:`usable`); out (B, n) fp32, contiguous.
    The scores sum in another order than torch's norm: equal to within fp32 rounding.
    """
    n, c = momentum.shape[1:]
    grid = (triton.cdiv(n, SCORE_ROWS),)
    with _device_of(momentum):
        for b, grad in enumerate(grads):
            _accumulate_and_score[grid](
                momentum[b],
                momentum.stride(1),
                grad,
                grad.stride(0),
                out[b],
                1.0 if decay is None else decay,
                n,
                c,
                COL_BLOCKS=triton.cdiv(c, SCORE_COLS),
                BLOCK_R=SCORE_ROWS,
                BLOCK_C=SCORE_COLS,
            )
    return out


def apply_rows(
    weights: list[torch.Tensor], rows: torch.Tensor, steps: torch.Tensor, row_scale: torch.Tensor, shrink: list[float] | torch.Tensor
) -> None:
    """For each b: weights[b] *= shrink[b]; weights[b][rows[b, i]] += row_scale[b, i] * steps[b, i].

    weights: B (n, c) matrices (see :func:`usable`); rows (B, k) distinct row indices per matrix,
    or n for "no row here" (any number of times); steps (B, k, c) fp32 or half precision (read as
    fp32); row_scale (B, k) fp32;
    shrink: B numbers or a (B,) fp32 tensor.
    """
    batch, k = rows.shape
    n, c = weights[0].shape
    steps = steps.contiguous()
    row_scale = row_scale.contiguous()
    # each row's place among the steps, or -1; column n collects the skipped entries
    pos = torch.full((batch, n + 1), -1, dtype=torch.int32, device=rows.device)
    pos.scatter_(1, rows, torch.arange(k, dtype=torch.int32, device=rows.device).expand(batch, k))
    on_device = torch.is_tensor(shrink)
    grid = (triton.cdiv(n, BLOCK_ROWS), triton.cdiv(c, BLOCK_COLS))
    with _device_of(rows):
        for b, weight in enumerate(weights):
            _apply_rows[grid](
                weight,
                weight.stride(0),
                pos[b],
                steps[b],
                row_scale[b],
                shrink[b : b + 1] if on_device else row_scale,
                1.0 if on_device else float(shrink[b]),
                n,
                c,
                SHRINK_ON_DEVICE=on_device,
                BLOCK_R=BLOCK_ROWS,
                BLOCK_C=BLOCK_COLS,
                enable_fp_fusion=False,
            )


def take_selected(momentum: torch.Tensor, idx: torch.Tensor, mu: float | torch.Tensor) -> torch.Tensor:
    """momentum[b, idx[b]] copied out as (B, k, c), then multiplied by mu (a number or (B,)) in place.

    momentum (B, n, c) fp32 with unit column stride; idx (B, k). A row index repeated within a
    matrix must point at a row of zeros (the padded row of the static exchange).
    """
    batch, k = idx.shape
    c = momentum.shape[-1]
    idx = idx.contiguous()
    out = torch.empty(batch, k, c, dtype=momentum.dtype, device=momentum.device)
    on_device = isinstance(mu, torch.Tensor)
    mu_tensor, mu_value = (mu.contiguous(), 1.0) if isinstance(mu, torch.Tensor) else (out, float(mu))
    grid = (batch, triton.cdiv(k, BLOCK_ROWS), triton.cdiv(c, BLOCK_COLS))
    with _device_of(momentum):
        _take_selected[grid](
            momentum,
            momentum.stride(0),
            momentum.stride(1),
            idx,
            out,
            mu_tensor,
            mu_value,
            k,
            c,
            MU_ON_DEVICE=on_device,
            BLOCK_R=BLOCK_ROWS,
            BLOCK_C=BLOCK_COLS,
        )
    return out
