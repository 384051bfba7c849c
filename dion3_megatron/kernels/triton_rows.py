"""Triton kernels for the row-wise steps of the Dion3 rule, one pass over memory each, named like
the rule functions they stand in for (whether they run: :mod:`.rows`).

* :func:`apply_rows`: W = shrink * W, plus each selected row's step times its scale: every row
  shrunk and the selected ones updated in one pass (the torch form in
  :func:`dion3_megatron.rule.apply_rows` takes a multi-tensor multiply, then ``index_add_``
  on the scaled steps). The step is added in fp32 and rounded to the weight's dtype once.
* :func:`accumulate_and_score`: M += G and the L1 norm of every row of the new M, one pass (the
  torch form in :func:`dion3_megatron.rule.accumulate_and_score` adds, then reads M again).
* :func:`take_selected`: copy out the selected rows of the momentum and decay them in place by mu
  (the torch form in :func:`dion3_megatron.rule.take_selected` gathers and scatters through an
  index per element).

A factor (shrink, mu) given as a number is a kernel argument; as a tensor (what a CUDA graph
reads) it is loaded on the device. Floating-point contraction is off: shrink * W and the scaled
step are each rounded to fp32 before they are added, as torch computes them, so a number and a
tensor factor (an eager step and a CUDA graph's) give identical bits. Imports triton at the top:
import it only where triton is present (:mod:`.rows` does that lazily).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

BLOCK_ROWS, BLOCK_COLS = 16, 128
SCORE_ROWS, SCORE_COLS = 4, 512  # whole rows per program: more programs, each loops over the columns


@triton.jit
def _accumulate_and_score(m_ptr, m_stride, g_ptr, g_stride, score_ptr, n_rows, n_cols,
                   COL_BLOCKS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
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
        tl.store(m_ptrs, m, mask=inside)
        total += tl.abs(m)
    tl.store(score_ptr + rows, tl.sum(total, axis=1), mask=in_rows)


@triton.jit
def _apply_rows(w_ptr, w_stride, pos_ptr, step_ptr, scale_ptr, shrink_ptr, shrink, n_rows, n_cols,
                SHRINK_ON_DEVICE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    in_rows = rows < n_rows
    inside = in_rows[:, None] & (cols < n_cols)[None, :]
    w_ptrs = w_ptr + rows[:, None].to(tl.int64) * w_stride + cols[None, :]
    w = tl.load(w_ptrs, mask=inside, other=0.0).to(tl.float32)
    pos = tl.load(pos_ptr + rows, mask=in_rows, other=-1)  # the row's place among the steps, or -1
    chosen = in_rows & (pos >= 0)
    step = tl.load(step_ptr + pos[:, None].to(tl.int64) * n_cols + cols[None, :],
                   mask=inside & chosen[:, None], other=0.0)
    scale = tl.load(scale_ptr + pos, mask=chosen, other=0.0)
    if SHRINK_ON_DEVICE:
        shrink = tl.load(shrink_ptr)
    w = w * shrink + step * scale[:, None]
    tl.store(w_ptrs, w.to(w_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=inside)


@triton.jit
def _take_selected(m_ptr, m_batch_stride, m_row_stride, idx_ptr, out_ptr, mu_ptr, mu, k, n_cols,
               MU_ON_DEVICE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
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


def _device_of(t: torch.Tensor):
    """Triton launches on the current CUDA device: make it ``t``'s for the launch (matrices of one
    process may live on several GPUs). CPU tensors: Triton's interpreter, no device to set."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def usable(weights: list[torch.Tensor]) -> bool:
    """Every weight a CUDA matrix with unit column stride in a dtype the kernel writes."""
    return all(
        w.is_cuda and w.dim() == 2 and w.stride(1) == 1 and w.dtype in (torch.float32, torch.bfloat16, torch.float16)
        for w in weights
    )


def probe(device: torch.device) -> None:
    """Compile and run a row kernel on ``device`` once (raises where Triton cannot build it)."""
    momentum = torch.ones(1, 2, 3, device=device)
    accumulate_and_score(momentum, [torch.ones(2, 3, device=device)], torch.empty(1, 2, device=device))


def accumulate_and_score(momentum: torch.Tensor, grads: list[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """For each b: momentum[b] += grads[b]; out[b] = the L1 norm of every row of the new momentum[b].

    momentum (B, n, c) fp32 and grads B (n, c) (see :func:`usable`); out (B, n) fp32, contiguous.
    The scores sum in another order than torch's norm: equal to within fp32 rounding.
    """
    n, c = momentum.shape[1:]
    grid = (triton.cdiv(n, SCORE_ROWS),)
    with _device_of(momentum):
        for b, grad in enumerate(grads):
            _accumulate_and_score[grid](momentum[b], momentum.stride(1), grad, grad.stride(0), out[b], n, c,
                                 COL_BLOCKS=triton.cdiv(c, SCORE_COLS), BLOCK_R=SCORE_ROWS, BLOCK_C=SCORE_COLS)
    return out


def apply_rows(weights: list[torch.Tensor], rows: torch.Tensor, steps: torch.Tensor, row_scale: torch.Tensor,
               shrink: list[float] | torch.Tensor) -> None:
    """For each b: weights[b] *= shrink[b]; weights[b][rows[b, i]] += row_scale[b, i] * steps[b, i].

    weights: B (n, c) matrices (see :func:`usable`); rows (B, k) distinct row indices per matrix,
    or n for "no row here" (any number of times); steps (B, k, c) fp32; row_scale (B, k) fp32;
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
            _apply_rows[grid](weight, weight.stride(0), pos[b], steps[b], row_scale[b],
                              shrink[b:b + 1] if on_device else row_scale, 1.0 if on_device else float(shrink[b]),
                              n, c, SHRINK_ON_DEVICE=on_device, BLOCK_R=BLOCK_ROWS, BLOCK_C=BLOCK_COLS,
                              enable_fp_fusion=False)


def take_selected(momentum: torch.Tensor, idx: torch.Tensor, mu: float | torch.Tensor) -> torch.Tensor:
    """momentum[b, idx[b]] copied out as (B, k, c), then multiplied by mu (a number or (B,)) in place.

    momentum (B, n, c) fp32 with unit column stride; idx (B, k). A row index repeated within a
    matrix must point at a row of zeros (the padded row of the static exchange).
    """
    batch, k = idx.shape
    c = momentum.shape[-1]
    idx = idx.contiguous()
    out = torch.empty(batch, k, c, dtype=momentum.dtype, device=momentum.device)
    on_device = torch.is_tensor(mu)
    grid = (batch, triton.cdiv(k, BLOCK_ROWS), triton.cdiv(c, BLOCK_COLS))
    with _device_of(momentum):
        _take_selected[grid](momentum, momentum.stride(0), momentum.stride(1), idx, out,
                         mu.contiguous() if on_device else out, 1.0 if on_device else float(mu), k, c,
                         MU_ON_DEVICE=on_device, BLOCK_R=BLOCK_ROWS, BLOCK_C=BLOCK_COLS)
    return out
