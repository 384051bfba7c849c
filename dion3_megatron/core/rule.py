"""The Dion3 update rule on batches of same-shape matrices: pure tensor math, no communication.

Per matrix W (n_rows x n_cols) with gradient G, momentum M (fp32, or stored in bf16 and computed
in fp32: :mod:`.rounding`) and per-row variance V (fp32):

    M += G
    S = top-k rows of M by L1 norm (k = max(1, ceil(f * rows)), per head if num_heads is given)
    U = M[S];  M[S] *= mu                        # error feedback: only applied rows decay
    O = orthogonalize(U)
    v = beta2 V[S] + (1 - beta2) mean(O^2, -1);  V[S] = v
    On = O / (sqrt(v) + eps);  On *= ||O||_F / max(||On||_F, eps)
    W *= 1 - lr wd;  W[S] -= lr * scale * On

The stages are separate functions so the distributed engine can run the row-local ones where the
rows live and the orthogonalization on an owner rank. Every tensor here is a batch: matrices are
(B, n_rows, n_cols), per-row quantities (B, n_rows), row indices (B, k).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ..kernels import rows as row_kernels
from . import rounding as bf16_rounding
from .ortho import default_ns_dtype, orthogonalize
from .rounding import Rounding, needed

# The largest gradient magnitude a step takes: its square is about the largest fp32 value, so
# AdamW's second moment and a global gradient norm stay finite, and Dion3's momentum, a sum of such
# gradients, stays finite for 2**64 steps; with the overflow-safe norms of the orthogonalization
# every update is then finite too. A larger (or a non-finite) gradient skips the whole step.
GRADIENT_LIMIT = 2.0**64

# Up to this many elements per matrix, apply_rows adds each update as a whole matrix (unselected
# rows zero) in one multi-tensor add, and the momentum takes its gradients stacked: the same sums,
# without the per-matrix launches that were most of a small matrix's step (CPU: 5.4 against 1.3 us
# per 16 x 16 matrix; equal at 64 x 64; slower above).
DENSE_UPDATE_LIMIT = 4096

# The adjust_lr modes; update_scale() gives the lr multiplier of each.
ADJUST_LR_CHOICES = ("spectral_norm", "rms_norm")

# The fraction that asks the engine's plan to choose f per matrix (its one spelling everywhere: the
# option's value, the settings' field, the plan's test).
AUTO = "auto"


@dataclass(frozen=True)
class Dion3Hyperparameters:
    """Everything the rule needs for one matrix besides its tensors. Every field is required: the
    options' defaults and checks are the option spec's (``dion3_megatron.options.hyperparameters()``
    fills in the defaults)."""

    lr: float
    fraction: float | str  # a number in (0, 1], or AUTO: chosen per matrix by the engine's plan before the rule runs
    mu: Optional[float]  # None: by the fraction (see momentum_decay())
    beta2: float
    weight_decay: float
    eps: float
    adjust_lr: str  # one of ADJUST_LR_CHOICES (see update_scale())
    scale_lr_by_fraction: bool
    scale_mu_by_fraction: bool  # see momentum_decay()
    staleness: float  # see staleness_boost()
    num_heads: Optional[int]
    ns_method: str
    ns_dtype: Optional[torch.dtype]  # None: fp16 on GPUs, fp32 on CPU (ortho.default_ns_dtype)
    momentum_dtype: torch.dtype  # what the momentum is stored in: fp32, or bf16 (rounding.MOMENTUM_DTYPES)


# --------------------------------------------------------------------------------------------
# Row selection.


def resolved(fraction: float | str) -> float:
    """A matrix's f, which the engine's plan has resolved from :data:`AUTO` before the rule runs."""
    if isinstance(fraction, str):
        raise ValueError(f"fraction is {fraction!r} here: the engine's plan resolves it before the rule runs")
    return fraction


def selected_row_count(n_rows: int, fraction: float, num_heads: Optional[int] = None) -> int:
    """Rows selected per matrix: max(1, ceil(f * rows)), taken per head when num_heads is given."""
    if not isinstance(fraction, (int, float)):
        raise ValueError(f"fraction must be a number here, got {fraction!r} (the plan resolves {AUTO!r} before the rule runs)")
    if num_heads is None:
        return max(1, math.ceil(fraction * n_rows))
    if n_rows % num_heads:
        raise ValueError(f"num_heads={num_heads} does not divide the matrix's {n_rows} rows")
    return num_heads * max(1, math.ceil(fraction * (n_rows // num_heads)))


def row_scores(m: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """L1 norm of every row: (B, n, c) -> (B, n), fp32 (into ``out`` when given). Partial column
    blocks' scores add up.

    A norm reduction, not abs().sum(): no temporary the size of the matrix.
    """
    return torch.linalg.vector_norm(m, ord=1, dim=-1, dtype=torch.float32, out=out)


def accumulate_and_score(
    momentum: torch.Tensor,
    grads: list[torch.Tensor],
    out: Optional[torch.Tensor] = None,
    decay: Optional[float] = None,
    rounding: Optional[Rounding] = None,
) -> torch.Tensor:
    """M += G for the (B, n, c) momentum and its B (n, c) gradients; the L1 row scores (B, n)
    of the new momentum (into ``out`` when given). With ``decay`` (:func:`folded_decay`) the
    momentum is left as decay * (M + G), the scores still those of M + G.

    Where the Triton row kernels run (:mod:`dion3_megatron.kernels.rows`) one pass over both; the
    scores then sum in another order, equal to within fp32 rounding. A bf16 momentum (with its
    ``rounding``) is summed, scored and decayed in fp32 and stored stochastically rounded.
    """
    if out is None:
        out = torch.empty(momentum.shape[:2], dtype=torch.float32, device=momentum.device)
    if momentum.dtype != torch.float32:
        bf16_rounding.accumulate_and_score(momentum, grads, out, decay, needed(momentum, rounding), row_scores)
        return out
    if row_kernels.takes_momentum(momentum, grads):
        from ..kernels import triton_rows

        return triton_rows.accumulate_and_score(momentum, grads, out, decay)
    if momentum[0].numel() <= DENSE_UPDATE_LIMIT:  # small matrices: one add of them stacked (as in apply_rows)
        momentum.add_(torch.stack(grads))
    else:
        torch._foreach_add_(list(momentum.unbind(0)), grads)
    row_scores(momentum, out=out)
    if decay is not None:
        momentum.mul_(decay)
    return out


def folded_decay(hp: Dion3Hyperparameters, n_rows: int, mu: Optional[float | torch.Tensor] = None) -> Optional[float]:
    """The decay to fold into the accumulation (:func:`accumulate_and_score`) of a step that
    selects every row of an n_rows-row matrix (f = 1), else None. The step orthogonalizes the
    whole momentum and then decays it by mu; orthogonalization does not see its input's scale, so
    it may read mu * (M + G) instead, and the decay costs no pass over the momentum of its own
    (4.3 ms of the 14B-shape step at f = 1 on an H200). mu: the step's (default: hp's); None too
    where it is not a positive number (one per matrix on the device, or 0, which would leave
    nothing to orthogonalize)."""
    fraction = resolved(hp.fraction)
    mu = momentum_decay(hp, fraction) if mu is None else mu
    if isinstance(mu, torch.Tensor) or not mu > 0 or selected_row_count(n_rows, fraction, hp.num_heads) < n_rows:
        return None
    return mu


def accumulate(momenta: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    """M += G for momenta of any shapes (pieces of matrices), each with its gradient."""
    for momentum, grad in zip(momenta, grads):
        momentum.add_(grad)


def select_rows(scores: torch.Tensor, fraction: float, num_heads: Optional[int] = None) -> torch.Tensor:
    """Indices (B, k), ascending, of the top rows by score; ties go to the lower index.

    A stable descending sort keeps equal scores in index order, so every rank picks the same rows.
    """
    batch, n_rows = scores.shape
    k = selected_row_count(n_rows, fraction, num_heads)
    if k == n_rows:  # every row (f = 1, the default's choice at most widths): what the sorts give, without them
        return torch.arange(n_rows, device=scores.device).repeat(batch, 1)
    if num_heads is None:
        order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
        chosen = order[:, :k]
    else:
        head_dim = n_rows // num_heads
        per_head = k // num_heads
        order = torch.sort(scores.view(batch, num_heads, head_dim), dim=-1, descending=True, stable=True).indices
        offsets = torch.arange(num_heads, device=scores.device).view(1, -1, 1) * head_dim
        chosen = (order[:, :, :per_head] + offsets).reshape(batch, k)
    return torch.sort(chosen, dim=-1).values


def _row_index(idx: torch.Tensor, n_cols: int) -> torch.Tensor:
    return idx.unsqueeze(-1).expand(-1, -1, n_cols)


def staleness_boost(scores: torch.Tensor, age: torch.Tensor, staleness: float, fraction: float) -> torch.Tensor:
    """Selection scores of rows with ``age`` steps since they were last applied: the L1 score times
    1 + staleness * f * age, so a row that waited one expected period (1 / f steps) counts
    1 + staleness times its norm."""
    return scores * (1 + (staleness * fraction) * age)


def age_rows(age: torch.Tensor, idx: torch.Tensor) -> None:
    """One step later: every row's age + 1, the applied rows' 0."""
    age.add_(1).scatter_(1, idx, 0.0)


def age_piece_rows(age: torch.Tensor, idx: torch.Tensor, first: int) -> None:
    """:func:`age_rows` for a piece of a matrix that keeps the ages (B, h) of rows [first, first + h)
    only: ``idx`` (B, k) are the selected rows of the whole matrices; those outside the piece are
    ignored. Device ops only (no host wait): a CUDA graph captures it."""
    height = age.shape[1]
    local = idx - first
    held = (local >= 0) & (local < height)
    applied = torch.zeros(age.shape[0], height + 1, dtype=torch.bool, device=age.device)
    applied.scatter_(1, torch.where(held, local, height), True)  # rows held elsewhere mark the spare column
    age.add_(1).masked_fill_(applied[:, :height], 0.0)


# --------------------------------------------------------------------------------------------
# Error feedback: the applied rows leave the momentum, decayed by mu; the rest stay whole.


# mu when none is given: this at f = 1/4, the convergence protocol's best there (docs/tuning.md)
MU_AT_QUARTER = 0.6


def momentum_decay(hp: Dion3Hyperparameters, fraction: float) -> float:
    """The factor the applied rows' momentum decays by: mu, or mu ** (1 / f) with
    ``scale_mu_by_fraction``. A row is applied about once every 1 / f steps, so the scaled form
    keeps the memory of heavy-ball momentum with mu (what f = 1 has) at any f.

    With mu None, MU_AT_QUARTER ** (1 / (4 f)): the memory per step that mu 0.6 has at f = 1/4, at
    any f (0.36 at f = 1/8, 0.88 at f = 1; measured against 0.6: docs/tuning.md)."""
    if hp.mu is None:
        return MU_AT_QUARTER ** (1 / (4 * fraction))
    return hp.mu ** (1 / fraction) if hp.scale_mu_by_fraction else hp.mu


def momentum_decays(hps: Sequence[Dion3Hyperparameters], fraction: float) -> float | list[float]:
    """:func:`momentum_decay` of matrices with these settings: one number when they agree, else one each."""
    if all(hp is hps[0] for hp in hps):  # (one param group's matrices: one settings object)
        return momentum_decay(hps[0], fraction)
    mus = [momentum_decay(hp, fraction) for hp in hps]
    return mus[0] if len(set(mus)) == 1 else mus


def take_selected(momentum: torch.Tensor, idx: torch.Tensor, mu: float | torch.Tensor, rounding: Optional[Rounding] = None) -> torch.Tensor:
    """Copy out the selected rows (B, k) of the (B, n, c) momentum, then decay them there by mu.

    mu: a number, or one per matrix of the batch (B,). Where the Triton row kernels run
    (:mod:`dion3_megatron.kernels.rows`) one pass. A bf16 momentum (with its ``rounding``) gives
    its rows as fp32 and stores their decay rounded.
    """
    if momentum.dtype != torch.float32:
        return bf16_rounding.take_selected(momentum, idx, _per_matrix(mu), needed(momentum, rounding))
    if row_kernels.takes_momentum(momentum):
        from ..kernels import triton_rows

        return triton_rows.take_selected(momentum, idx, mu)
    batch, n, c = momentum.shape
    decay = _per_matrix(mu)
    if momentum.is_contiguous():  # whole rows by row number: one index read per row, not per element
        rows = (idx + torch.arange(batch, device=idx.device).unsqueeze(-1) * n).view(-1)
        flat = momentum.view(batch * n, c)
        selected = flat.index_select(0, rows).view(batch, -1, c)
        flat.index_copy_(0, rows, (selected * decay).view(-1, c))  # a repeated (padded, zero) row: zeros
        return selected
    selected = torch.gather(momentum, 1, _row_index(idx, c))
    momentum.scatter_(1, _row_index(idx, c), selected * decay)
    return selected


def decay_momentum(momentum: torch.Tensor, mu: float | torch.Tensor, rounding: Optional[Rounding] = None) -> None:
    """:func:`take_selected`'s decay of every row, for a caller that read the (B, n, c) momentum in
    place: momentum *= mu (a number, or (B,): one per matrix); a bf16 momentum in fp32, stored
    rounded."""
    if momentum.dtype == torch.float32:
        momentum.mul_(_per_matrix(mu))
    else:
        bf16_rounding.decay(momentum, _per_matrix(mu), needed(momentum, rounding))


def _per_matrix(mu: float | torch.Tensor) -> float | torch.Tensor:
    """mu as a factor of a (B, n, c) batch: a number as it is, one per matrix (B,) as (B, 1, 1)."""
    return mu if not torch.is_tensor(mu) else mu.view(-1, 1, 1)


def take_rows(
    momentum: torch.Tensor,
    rows: torch.Tensor,
    mu: float | torch.Tensor,
    batch: Optional[torch.Tensor] = None,
    rounding: Optional[Rounding] = None,
) -> torch.Tensor:
    """:func:`take_selected` for rows scattered over a batch: momentum[batch, rows] copied out as
    (P, c) and decayed there by mu (a number, or (B,): one per matrix). Without ``batch`` the
    momentum is one (n, c) matrix and mu a number. A bf16 momentum (with its ``rounding``) gives
    its rows as fp32 and stores their decay rounded."""
    at = (rows,) if batch is None else (batch, rows)
    factor = mu if not torch.is_tensor(mu) else mu[batch][:, None]
    if momentum.dtype != torch.float32:
        return bf16_rounding.take_rows(momentum, rows, factor, batch, needed(momentum, rounding))
    picked = momentum[at]
    momentum[at] = picked * factor
    return picked


# --------------------------------------------------------------------------------------------
# NorMuon normalization and the weight update.


def row_scales(
    ortho: torch.Tensor,
    variance_selected: torch.Tensor,
    beta2: float,
    eps: float,
    scale: Optional[float | torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """NorMuon as one multiplier per row: divide each row by its running RMS, then restore the
    block's Frobenius norm; the normalized block is ``ortho * row_scale[..., None]``.

    ortho (B, k, c), fp32 or half precision (read as fp32), variance_selected (B, k). Returns
    (row_scale (B, k), new variance rows).
    Both norms follow from the rows' sums of squares, so the block is read once and no block-size
    temporary is formed. scale: a number or (B,) tensor folded into every row's multiplier.
    """
    squares = torch.linalg.vector_norm(ortho, dim=-1, dtype=torch.promote_types(ortho.dtype, torch.float32)).square()
    variance = variance_selected * beta2 + squares / ortho.shape[-1] * (1 - beta2)
    inverse_rms = 1 / (variance.sqrt() + eps)
    before = squares.sum(dim=-1).sqrt()
    after = (squares * inverse_rms.square()).sum(dim=-1).sqrt().clamp_min(eps)
    factor = before / after
    if scale is not None:
        factor = factor * scale
    return inverse_rms * factor.unsqueeze(-1), variance


def normalize_rows(
    ortho: torch.Tensor,
    variance_selected: torch.Tensor,
    beta2: float,
    eps: float,
    scale: Optional[float | torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """NorMuon (:func:`row_scales`) applied: (normalized block, new variance rows)."""
    row_scale, variance = row_scales(ortho, variance_selected, beta2, eps, scale)
    return ortho * row_scale.unsqueeze(-1), variance


def update_scale(n_rows: int, n_cols: int, adjust_lr: str = "spectral_norm") -> float:
    """Multiplier of lr for the orthogonalized step of an n_rows x n_cols matrix.

    spectral_norm: sqrt(rows / cols).  rms_norm: 0.2 sqrt(max(rows, cols)), which makes AdamW's
    lr and weight decay transfer.
    """
    if adjust_lr == "spectral_norm":
        return math.sqrt(n_rows / n_cols)
    if adjust_lr == "rms_norm":
        return 0.2 * math.sqrt(max(n_rows, n_cols))
    raise ValueError(f"adjust_lr must be one of {ADJUST_LR_CHOICES}, got {adjust_lr!r}")


# With scale_lr_by_fraction a matrix at fraction f steps and decays at lr / max(f, 1/4): a row is
# applied about once every 1 / f steps, so it takes 1 / f times f = 1's step, up to 4x. The
# convergence protocol's best lr was 0.01 at f = 1, 0.02 at f = 1/2, 0.02-0.04 at f = 1/4 and 0.04
# (not 0.08) at f = 1/8, at both sizes (docs/tuning.md).
FRACTION_LR_FLOOR = 0.25


def fraction_lr_multiplier(fraction: float, scale_lr_by_fraction: bool) -> float:
    """What lr is multiplied by for a matrix at ``fraction``: 1 / max(f, 1/4), or 1 when off."""
    return 1 / max(fraction, FRACTION_LR_FLOOR) if scale_lr_by_fraction else 1.0


@dataclass
class UpdateFactors:
    """Per matrix of a batch: W *= shrink (1 - lr wd), then W[rows] += coef * step (coef = -lr scale).

    Lists of numbers, or (B,) fp32 tensors on the weights' device: what a captured CUDA graph
    reads, refreshed before every replay (see :mod:`dion3_megatron.engine.cuda_graph`). Both forms give
    bit-identical updates in :func:`normalize_and_apply`.
    """

    shrink: list[float] | torch.Tensor
    coef: list[float] | torch.Tensor

    @staticmethod
    def of(lrs: list[float], weight_decays: list[float], scales: list[float]) -> "UpdateFactors":
        """shrink = 1 - lr wd, coef = -lr * scale."""
        return UpdateFactors([1 - lr * wd for lr, wd in zip(lrs, weight_decays)], [-lr * scale for lr, scale in zip(lrs, scales)])

    def on_device(self, device: torch.device) -> "UpdateFactors":
        """The tensor form on ``device`` (from numbers): one queued copy, not waited for."""
        values = torch.tensor([*self.shrink, *self.coef], dtype=torch.float32)
        if device.type == "cuda":
            values = values.pin_memory()
        on_device = torch.empty(values.shape, dtype=torch.float32, device=device).copy_(values, non_blocking=True)
        return UpdateFactors(on_device[: len(self.shrink)], on_device[len(self.shrink) :])

    def part(self, start: int, stop: int) -> "UpdateFactors":
        """The factors of matrices [start, stop) of the batch."""
        return UpdateFactors(self.shrink[start:stop], self.coef[start:stop])


def update_factors(hps: Sequence[Dion3Hyperparameters], fraction: float, n_rows: int, n_cols: int) -> UpdateFactors:
    """The factors of n_rows x n_cols matrices with these settings (one each: lr, weight decay and
    the lr adjustment may differ between them), at ``fraction``."""
    if len(hps) > 1 and all(hp is hps[0] for hp in hps):  # (one param group's matrices: one settings object)
        one = update_factors(hps[:1], fraction, n_rows, n_cols)
        return UpdateFactors(one.shrink * len(hps), one.coef * len(hps))
    lrs = [hp.lr * fraction_lr_multiplier(fraction, hp.scale_lr_by_fraction) for hp in hps]
    scales = [update_scale(n_rows, n_cols, hp.adjust_lr) for hp in hps]
    return UpdateFactors.of(lrs, [hp.weight_decay for hp in hps], scales)


def apply_rows(
    weights: list[torch.Tensor],
    rows: torch.Tensor | list[torch.Tensor],
    steps: torch.Tensor | list[torch.Tensor],
    row_scale: torch.Tensor | list[float],
    shrink: list[float] | torch.Tensor,
    padded: bool = False,
) -> None:
    """The weight update: W_b *= shrink[b]; W_b[rows_b] += row_scale_b * steps_b, for 2-D weights
    (views are fine), each step rounded once to its weight's dtype.

    Batched (same-shape (n, c) weights): rows (B, k), distinct per matrix; steps (B, k, c) fp32 or
    half precision (read as fp32);
    row_scale (B, k). Where the Triton row kernels run (:mod:`dion3_megatron.kernels.rows`) one
    pass over each weight; else a multi-tensor shrink, then ``index_add_``. With ``padded``, rows
    equal to n (any number of them) are skipped.
    Ragged (weights of any shapes, a row count each): rows[b] (k_b,), steps[b] (k_b, c_b), and
    row_scale one number per matrix.
    """
    if not isinstance(rows, torch.Tensor):
        shrink_weights(weights, shrink)
        for weight, idx, step, coef in zip(weights, rows, steps, row_scale):
            if step.dtype == weight.dtype:  # one kernel, no temporary
                weight.index_add_(0, idx, step, alpha=coef)
            else:  # scale in the step's precision, then round once
                weight.index_add_(0, idx, (step * coef).to(weight.dtype))
        return
    assert isinstance(steps, torch.Tensor) and isinstance(row_scale, torch.Tensor), "batched: tensors throughout"
    if row_kernels.takes(weights):
        from ..kernels import triton_rows

        triton_rows.apply_rows(weights, rows, steps, row_scale, shrink)
        return
    shrink_weights(weights, shrink)
    n = weights[0].shape[0]
    if padded:  # the skipped rows add zeros to the last row
        row_scale = row_scale * (rows < n)
        rows = rows.clamp(max=n - 1)
    scaled = steps * row_scale.unsqueeze(-1)
    dtype = weights[0].dtype
    if weights[0].numel() <= DENSE_UPDATE_LIMIT and all(w.dtype == dtype for w in weights):
        # small matrices: one multi-tensor add of the updates as whole matrices, rounded as the loop below rounds
        update = torch.zeros((len(weights), n, scaled.shape[-1]), dtype=scaled.dtype, device=scaled.device)
        update.scatter_add_(1, rows.unsqueeze(-1).expand(scaled.shape), scaled)  # (padded rows add their zeros)
        torch._foreach_add_(weights, list(update.to(dtype).unbind(0)))
        return
    for weight, idx, step in zip(weights, rows.unbind(0), scaled.unbind(0)):
        weight.index_add_(0, idx, step if step.dtype == weight.dtype else step.to(weight.dtype))


def shrink_weights(weights: list[torch.Tensor], shrink: list[float] | torch.Tensor) -> None:
    """W *= shrink[i] (decoupled weight decay) for each weight, as one multi-tensor op when it can be."""
    if torch.is_tensor(shrink):
        torch._foreach_mul_(weights, list(shrink.unbind(0)))
    elif len(set(shrink)) == 1:
        if shrink[0] != 1:
            torch._foreach_mul_(weights, shrink[0])
    else:
        for weight, s in zip(weights, shrink):
            if s != 1:
                weight.mul_(s)


def normalize_and_apply(
    weights: list[torch.Tensor],
    variance: torch.Tensor,
    idx: torch.Tensor,
    ortho: torch.Tensor,
    beta2: float,
    eps: float,
    factors: UpdateFactors,
) -> None:
    """NorMuon on the (B, k, c) orthogonalized rows ``idx`` (B, k), their (B, n) variance updated in
    place, then :func:`apply_rows` on each of the B matrices with its own factors.

    The coefficients ride in NorMuon's rescaling, so numbers and tensors (a CUDA graph's form)
    take the same kernels and round alike.
    """
    coef = factors.coef
    scale: float | torch.Tensor = (
        coef
        if isinstance(coef, torch.Tensor)
        else (coef[0] if len(set(coef)) == 1 else torch.tensor(coef, dtype=torch.float32).to(ortho.device))
    )
    row_scale, new_variance = row_scales(ortho, torch.gather(variance, 1, idx), beta2, eps, scale)
    variance.scatter_(1, idx, new_variance)
    apply_rows(weights, idx, ortho, row_scale, factors.shrink)


def orthogonalize_rows(selected: torch.Tensor, hp: Dion3Hyperparameters) -> torch.Tensor:
    """Orthogonalize a (B, k, c) batch of selected rows. A half-precision result (fp16 on GPUs by
    default) comes out as it is: NorMuon and the row update read it as fp32, the same values as an
    fp32 copy would hold, without writing that copy; fp32 and fp64 Newton-Schulz give fp32."""
    dtype = hp.ns_dtype or default_ns_dtype(selected.device)
    return orthogonalize(selected, hp.ns_method, dtype, out_dtype=dtype if dtype in row_kernels.HALF else torch.float32)
