"""The Dion3 update rule on batches of same-shape matrices: pure tensor math, no communication.

Per matrix W (n_rows x n_cols) with gradient G, momentum M (fp32) and per-row variance V (fp32):

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

import functools
import importlib.util
import math
import os
import warnings
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from . import options
from .options import ADJUST_LR_CHOICES, AUTO  # noqa: F401 - AUTO: the engines compare fractions with rule.AUTO
from .ortho import ns_flops, orthogonalize

# The largest gradient magnitude a step takes: its square is about the largest fp32 value, so
# AdamW's second moment and a global gradient norm stay finite, and Dion3's momentum, a sum of such
# gradients, stays finite for 2**64 steps; with the overflow-safe norms of the orthogonalization
# every update is then finite too. A larger (or a non-finite) gradient skips the whole step.
GRADIENT_LIMIT = 2.0**64

_DEFAULT = {name: options.BY_NAME[name].default for name in options.hyperparameter_names()}


@dataclass(frozen=True)
class Dion3Hyperparameters:
    """Everything the rule needs for one matrix besides its tensors (the options and their
    defaults are declared in :mod:`dion3_megatron.options`)."""

    lr: float = _DEFAULT["lr"]
    fraction: float | str = _DEFAULT["fraction"]  # or "auto": resolved per matrix by auto_fraction()
    mu: float = _DEFAULT["mu"]
    beta2: float = _DEFAULT["beta2"]
    weight_decay: float = _DEFAULT["weight_decay"]
    eps: float = _DEFAULT["eps"]
    adjust_lr: str = _DEFAULT["adjust_lr"]
    scale_lr_by_fraction: bool = _DEFAULT["scale_lr_by_fraction"]
    scale_mu_by_fraction: bool = _DEFAULT["scale_mu_by_fraction"]  # see momentum_decay()
    staleness: float = _DEFAULT["staleness"]  # see staleness_boost()
    num_heads: Optional[int] = _DEFAULT["num_heads"]
    ns_method: str = _DEFAULT["ns_method"]
    ns_dtype: Optional[torch.dtype] = _DEFAULT["ns_dtype"]  # None: fp16 on GPUs, fp32 on CPU (ortho.default_ns_dtype)


# --------------------------------------------------------------------------------------------
# Row selection.


def selected_row_count(n_rows: int, fraction: float, num_heads: Optional[int] = None) -> int:
    """Rows selected per matrix: max(1, ceil(f * rows)), taken per head when num_heads is given."""
    if not isinstance(fraction, (int, float)):
        raise ValueError(f"fraction must be a number here, got {fraction!r} ('auto' is resolved by auto_fraction)")
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


def accumulate_and_score(momentum: torch.Tensor, grads: list[torch.Tensor],
                         out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """M += G for the (B, n, c) fp32 momentum and its B (n, c) gradients; the L1 row scores (B, n)
    of the new momentum (into ``out`` when given).

    With the Triton row kernels (:func:`_fused_rows`) one pass over both
    (:func:`dion3_megatron.kernels.rows.add_and_score`); the scores then sum in another order, equal
    to within fp32 rounding.
    """
    if out is None:
        out = torch.empty(momentum.shape[:2], dtype=torch.float32, device=momentum.device)
    if _fused_momentum(momentum, grads):
        from .kernels import rows as fused

        return fused.add_and_score(momentum, grads, out)
    torch._foreach_add_(list(momentum.unbind(0)), grads)
    return row_scores(momentum, out=out)


def select_rows(scores: torch.Tensor, fraction: float, num_heads: Optional[int] = None) -> torch.Tensor:
    """Indices (B, k), ascending, of the top rows by score; ties go to the lower index.

    A stable descending sort keeps equal scores in index order, so every rank picks the same rows.
    """
    batch, n_rows = scores.shape
    k = selected_row_count(n_rows, fraction, num_heads)
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


def momentum_decay(hp: Dion3Hyperparameters, fraction: float) -> float:
    """The factor the applied rows' momentum decays by: mu, or mu ** (1 / f) with
    ``scale_mu_by_fraction``. A row is applied about once every 1 / f steps, so the scaled form
    keeps the memory of heavy-ball momentum with mu (what f = 1 has) at any f."""
    return hp.mu ** (1 / fraction) if hp.scale_mu_by_fraction else hp.mu


def staleness_boost(scores: torch.Tensor, age: torch.Tensor, staleness: float, fraction: float) -> torch.Tensor:
    """Selection scores of rows with ``age`` steps since they were last applied: the L1 score times
    1 + staleness * f * age, so a row that waited one expected period (1 / f steps) counts
    1 + staleness times its norm."""
    return scores * (1 + (staleness * fraction) * age)


def age_rows(age: torch.Tensor, idx: torch.Tensor) -> None:
    """One step later: every row's age + 1, the applied rows' 0."""
    age.add_(1).scatter_(1, idx, 0.0)


def take_selected(momentum: torch.Tensor, idx: torch.Tensor, mu: float | torch.Tensor) -> torch.Tensor:
    """Copy out the selected rows of the momentum, then decay them there by mu (error feedback).

    mu: a number, or one per matrix of the batch (B,). With the Triton row kernels
    (:func:`_fused_rows`) one pass (:func:`dion3_megatron.kernels.rows.take_rows`).
    """
    if _fused_momentum(momentum):
        from .kernels import rows as fused

        return fused.take_rows(momentum, idx, mu)
    batch, n, c = momentum.shape
    decay = mu if not torch.is_tensor(mu) else mu.view(-1, 1, 1)
    if momentum.is_contiguous():  # whole rows by row number: one index read per row, not per element
        rows = (idx + torch.arange(batch, device=idx.device).unsqueeze(-1) * n).view(-1)
        flat = momentum.view(batch * n, c)
        selected = flat.index_select(0, rows).view(batch, -1, c)
        flat.index_copy_(0, rows, (selected * decay).view(-1, c))  # a repeated (padded, zero) row: zeros
        return selected
    selected = torch.gather(momentum, 1, _row_index(idx, c))
    momentum.scatter_(1, _row_index(idx, c), selected * decay)
    return selected


# --------------------------------------------------------------------------------------------
# fraction="auto": f per matrix from its shape, the world size and the device's measured speed.

AUTO_FRACTIONS = (1.0, 0.5, 0.25, 0.125)
AUTO_MIN_ROWS = 128  # quality floor: fewer selected rows than this lost to f = 1 in our runs
AUTO_SLACK = 0.10  # a larger f is taken while it costs at most this much more than the cheapest
NS_KERNELS = {"gram": 30, "standard": 20}  # kernels per orthogonalization call, shared by its batch
PER_MATRIX_KERNELS = 20  # kernels per matrix whatever f is: scores, top-k, gathers, NorMuon, update
BYTES_PER_ENTRY = 24  # element-wise traffic of the step per matrix entry (momentum, grad, weight, scores)
WIRE_BYTES_PER_ENTRY = 8  # fp32 there and back through the two all-to-alls


@dataclass(frozen=True)
class DeviceSpeed:
    """What the cost model needs to know about the device (see :mod:`dion3_megatron.device_speed`)."""

    matmul_flops: float  # FLOP/s of a large matmul in the orthogonalization dtype
    launch_seconds: float  # time of one small kernel, host overhead included
    memory_bytes_per_s: float
    link_bytes_per_s: float  # per-rank all-to-all bandwidth of the process group's backend


def estimated_step_seconds(
    n_rows: int, n_cols: int, fraction: float, speed: DeviceSpeed,
    world: int = 1, batch: int = 1, ns_method: str = "gram", num_heads: Optional[int] = None,
) -> float:
    """Modelled time of one Dion3 step of one matrix, per rank.

    ``batch`` same-shape matrices share one orthogonalization call (megabatching), so its launch
    cost is split between them; each matrix also launches PER_MATRIX_KERNELS small kernels that
    do not shrink with f (on GPUs this fixed part dominates small matrices: measured, the step of
    a 100M model took the same time at f = 1/2, 1/4 and 1/8). With ``world`` ranks each
    orthogonalizes 1/world of the matrices and the selected rows cross the link both ways. Every
    term is per matrix and divided by ``world`` alike, so only the link term's (world - 1) / world
    depends on the world size.
    """
    k = selected_row_count(n_rows, fraction, num_heads)
    method = ns_method if k != n_cols else "standard"
    per_call = math.ceil(batch / world)
    ortho = ns_flops(k, n_cols, method) / speed.matmul_flops + NS_KERNELS[method] * speed.launch_seconds / per_call
    fixed = PER_MATRIX_KERNELS * speed.launch_seconds
    elementwise = BYTES_PER_ENTRY * (n_rows + k) * n_cols / speed.memory_bytes_per_s
    wire = WIRE_BYTES_PER_ENTRY * k * n_cols * (world - 1) / world / speed.link_bytes_per_s if world > 1 else 0.0
    return (ortho + fixed + elementwise) / world + wire / world


def auto_fraction(
    n_rows: int, n_cols: int, speed: DeviceSpeed,
    world: int = 1, batch: int = 1, ns_method: str = "gram", num_heads: Optional[int] = None,
) -> float:
    """The f that ``fraction="auto"`` uses for an n_rows x n_cols matrix.

    Among AUTO_FRACTIONS that select at least AUTO_MIN_ROWS rows (all of them for smaller
    matrices), the largest f whose modelled step costs at most (1 + AUTO_SLACK) times the cheapest
    one's. Large matrices on a slow device or link land on 1/8; small ones, whose step is launch-
    or memory-bound anyway, get a larger f for free.
    """
    floor = min(AUTO_MIN_ROWS, n_rows)
    feasible = [f for f in AUTO_FRACTIONS if selected_row_count(n_rows, f, num_heads) >= floor] or [1.0]
    cost = {f: estimated_step_seconds(n_rows, n_cols, f, speed, world, batch, ns_method, num_heads) for f in feasible}
    cheapest = min(cost.values())
    return max(f for f in feasible if cost[f] <= (1 + AUTO_SLACK) * cheapest)


# --------------------------------------------------------------------------------------------
# NorMuon normalization and the weight update.


def row_scales(
    ortho: torch.Tensor, variance_selected: torch.Tensor, beta2: float, eps: float,
    scale: Optional[float | torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """NorMuon as one multiplier per row: divide each row by its running RMS, then restore the
    block's Frobenius norm; the normalized block is ``ortho * row_scale[..., None]``.

    ortho (B, k, c) fp32, variance_selected (B, k). Returns (row_scale (B, k), new variance rows).
    Both norms follow from the rows' sums of squares, so the block is read once and no block-size
    temporary is formed. scale: a number or (B,) tensor folded into every row's multiplier.
    """
    squares = torch.linalg.vector_norm(ortho, dim=-1).square()
    variance = variance_selected * beta2 + squares / ortho.shape[-1] * (1 - beta2)
    inverse_rms = 1 / (variance.sqrt() + eps)
    before = squares.sum(dim=-1).sqrt()
    after = (squares * inverse_rms.square()).sum(dim=-1).sqrt().clamp_min(eps)
    factor = before / after
    if scale is not None:
        factor = factor * scale
    return inverse_rms * factor.unsqueeze(-1), variance


def normalize_rows(
    ortho: torch.Tensor, variance_selected: torch.Tensor, beta2: float, eps: float,
    scale: Optional[float | torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """NorMuon (:func:`row_scales`) applied: (normalized block, new variance rows)."""
    row_scale, variance = row_scales(ortho, variance_selected, beta2, eps, scale)
    return ortho * row_scale.unsqueeze(-1), variance


def update_scale(
    n_rows: int,
    n_cols: int,
    adjust_lr: str = "spectral_norm",
    fraction: float = 1.0,
    scale_lr_by_fraction: bool = False,
) -> float:
    """Multiplier of lr for the orthogonalized step of an n_rows x n_cols matrix.

    spectral_norm: sqrt(rows / cols).  rms_norm: 0.2 sqrt(max(rows, cols)), which makes AdamW's
    lr and weight decay transfer. Optionally 1/sqrt(f), keeping the step's norm as f shrinks.
    """
    if adjust_lr == "spectral_norm":
        scale = math.sqrt(n_rows / n_cols)
    elif adjust_lr == "rms_norm":
        scale = 0.2 * math.sqrt(max(n_rows, n_cols))
    else:
        raise ValueError(f"adjust_lr must be one of {ADJUST_LR_CHOICES}, got {adjust_lr!r}")
    return scale / math.sqrt(fraction) if scale_lr_by_fraction else scale


@dataclass
class UpdateFactors:
    """Per matrix of a batch: W *= decay, then W[rows] += coef * step.

    Lists of numbers, or (B,) fp32 tensors on the weights' device: what a captured CUDA graph
    reads, refreshed before every replay (see :mod:`dion3_megatron.cuda_graph`). Both forms give
    bit-identical updates in :func:`normalize_and_apply`; :func:`apply_updates` takes numbers,
    :func:`apply_row_updates` tensors.
    """

    decay: list[float] | torch.Tensor
    coef: list[float] | torch.Tensor

    @staticmethod
    def of(lrs: list[float], weight_decays: list[float], scales: list[float]) -> "UpdateFactors":
        """decay = 1 - lr wd (base lr), coef = -lr * scale."""
        return UpdateFactors([1 - lr * wd for lr, wd in zip(lrs, weight_decays)],
                             [-lr * scale for lr, scale in zip(lrs, scales)])

    def on_device(self, device: torch.device) -> "UpdateFactors":
        """The tensor form on ``device`` (from numbers): one queued copy, not waited for."""
        values = torch.tensor([*self.decay, *self.coef], dtype=torch.float32)
        if device.type == "cuda":
            values = values.pin_memory()
        on_device = torch.empty(values.shape, dtype=torch.float32, device=device).copy_(values, non_blocking=True)
        return UpdateFactors(on_device[: len(self.decay)], on_device[len(self.decay):])

    def part(self, start: int, stop: int) -> "UpdateFactors":
        """The factors of matrices [start, stop) of the batch."""
        return UpdateFactors(self.decay[start:stop], self.coef[start:stop])


def apply_update(
    weight: torch.Tensor | list[torch.Tensor], idx: torch.Tensor, step: torch.Tensor, lr: float, weight_decay: float,
    scale: float,
) -> None:
    """W *= 1 - lr wd (every row, base lr); W[idx] -= lr * scale * step. weight (B, n, c) or B (n, c)."""
    weights = list(weight.unbind(0)) if torch.is_tensor(weight) else list(weight)
    count = len(weights)
    apply_updates(weights, list(idx.unbind(0)), list(step.unbind(0)),
                  UpdateFactors.of([lr] * count, [weight_decay] * count, [scale] * count))


def apply_updates(
    weights: list[torch.Tensor], rows: list[torch.Tensor], steps: list[torch.Tensor], factors: UpdateFactors
) -> None:
    """W *= decay; W[rows] += coef * step, for many 2-D weights (views are fine); factors as numbers.

    weights[i] (n_i, c); rows[i] (k_i,) distinct row indices; steps[i] (k_i, c).
    """
    decay_weights(weights, factors.decay)
    for weight, idx, step, coef in zip(weights, rows, steps, factors.coef):
        if step.dtype == weight.dtype:  # one kernel, no temporary
            weight.index_add_(0, idx, step, alpha=coef)
        else:  # scale in the step's precision, then round once
            weight.index_add_(0, idx, (step * coef).to(weight.dtype))


def apply_row_updates(weights: list[torch.Tensor], rows: torch.Tensor, steps: torch.Tensor,
                      factors: UpdateFactors, padded: bool = False) -> None:
    """W *= decay; W[rows] += coef * step for a batch: rows (B, k), steps (B, k, c), factors as
    (B,) device tensors (what a CUDA graph reads). With ``padded``, a row index equal to the
    weights' row count marks a row that is not here: its step is skipped."""
    coef = factors.coef.view(-1, 1).expand(rows.shape).to(torch.float32)
    apply_scaled_rows(weights, rows, steps, coef, factors.decay, padded)


def decay_weights(weights: list[torch.Tensor], decay: list[float] | torch.Tensor) -> None:
    """W *= decay[i] for each weight, as one multi-tensor op when it can be."""
    if torch.is_tensor(decay):
        torch._foreach_mul_(weights, list(decay.unbind(0)))
    elif len(set(decay)) == 1:
        if decay[0] != 1:
            torch._foreach_mul_(weights, decay[0])
    else:
        for weight, d in zip(weights, decay):
            if d != 1:
                weight.mul_(d)


def add_rows(weights: list[torch.Tensor], rows: list[torch.Tensor], steps: list[torch.Tensor]) -> None:
    """W[rows] += step (rounded once to the weight's dtype)."""
    for weight, idx, step in zip(weights, rows, steps):
        weight.index_add_(0, idx, step if step.dtype == weight.dtype else step.to(weight.dtype))


def apply_scaled_rows(weights: list[torch.Tensor], rows: torch.Tensor, steps: torch.Tensor, row_scale: torch.Tensor,
                      decay: list[float] | torch.Tensor, padded: bool = False) -> None:
    """W_b *= decay[b]; W_b[rows[b, i]] += row_scale[b, i] * steps[b, i] for a batch of same-shape
    (n, c) weights; rows (B, k) distinct per matrix, steps (B, k, c) fp32, row_scale (B, k). With
    ``padded``, rows equal to n (any number of them) are skipped.

    With the Triton row kernels (:func:`_fused_rows`) one pass over each weight
    (:mod:`dion3_megatron.kernels.rows`); else a multi-tensor decay, then ``index_add_``.
    """
    if _fused_rows(weights):
        from .kernels import rows as fused

        fused.decay_add_rows(weights, rows, steps, row_scale, decay)
        return
    decay_weights(weights, decay)
    if padded:  # the skipped rows add zeros to the last row
        n = weights[0].shape[0]
        row_scale = row_scale * (rows < n)
        rows = rows.clamp(max=n - 1)
    add_rows(weights, list(rows.unbind(0)), list((steps * row_scale.unsqueeze(-1)).unbind(0)))


def _fused_rows(weights: list[torch.Tensor]) -> bool:
    """The Triton row kernels apply: CUDA weights, triton installed, and neither DION3_FUSED_ROWS=0
    (the torch forms, e.g. to compare) nor DION3_KERNELS=0 (every kernel of the package off)."""
    if not weights or not weights[0].is_cuda or not _triton_available():
        return False
    from .kernels import rows as fused

    return fused.usable(weights) and _row_kernels_run(weights[0].device)


def _fused_momentum(momentum: torch.Tensor, others: Sequence[torch.Tensor] = ()) -> bool:
    """The row kernels take this (B, n, c) fp32 momentum (and these other (n, c) matrices)."""
    return momentum.shape[0] > 0 and momentum.dtype == torch.float32 and _fused_rows([momentum[0], *others])


@functools.lru_cache(maxsize=None)
def _triton_available() -> bool:
    return (os.environ.get("DION3_FUSED_ROWS", "1") != "0" and os.environ.get("DION3_KERNELS", "1") != "0"
            and importlib.util.find_spec("triton") is not None)


@functools.lru_cache(maxsize=None)
def _row_kernels_run(device: torch.device) -> bool:
    """Whether a row kernel compiles and runs on ``device``, tried once per process and device.

    Triton builds each kernel's launcher with the host's C compiler on first use; where that fails
    (a container without one), the step keeps the torch forms, which give the same results to
    within rounding, and says so once.
    """
    from .kernels import rows as fused

    try:
        fused.probe(device)
    except Exception as error:  # a compile or launch failure: nothing has been written yet
        warnings.warn(f"dion3_megatron: the Triton row kernels do not run on {device} ({error!r}); using the "
                      "torch forms (the same results to within rounding). DION3_FUSED_ROWS=0 skips this try.",
                      RuntimeWarning, stacklevel=2)
        return False
    return True


def update_factors(hp: Dion3Hyperparameters, count: int, n_rows: int, n_cols: int) -> UpdateFactors:
    """The factors of ``count`` matrices that share ``hp`` (fraction already a number)."""
    scale = update_scale(n_rows, n_cols, hp.adjust_lr, hp.fraction, hp.scale_lr_by_fraction)
    return UpdateFactors.of([hp.lr] * count, [hp.weight_decay] * count, [scale] * count)


def finish_update(
    weight: torch.Tensor | list[torch.Tensor],
    variance: torch.Tensor,
    idx: torch.Tensor,
    ortho: torch.Tensor,
    hp: Dion3Hyperparameters,
    n_rows: int,
    n_cols: int,
    factors: Optional[UpdateFactors] = None,
) -> None:
    """Everything after the orthogonalization, for rows ``idx`` of (B, n, c) ``weight`` (or B (n, c)).

    n_rows, n_cols: the logical matrix's shape (a shard's weight may hold only some columns).
    factors: given, they replace hp's lr and weight decay (default: ``update_factors``).
    """
    weights = list(weight.unbind(0)) if torch.is_tensor(weight) else list(weight)
    if factors is None:
        factors = update_factors(hp, len(weights), n_rows, n_cols)
    normalize_and_apply(weights, variance, idx, ortho, hp.beta2, hp.eps, factors)


def normalize_and_apply(
    weights: list[torch.Tensor],
    variance: torch.Tensor,
    idx: torch.Tensor,
    ortho: torch.Tensor,
    beta2: float,
    eps: float,
    factors: UpdateFactors,
) -> None:
    """NorMuon on the (B, k, c) orthogonalized rows, their (B, n) variance updated in place, then
    the weight update of each of the B matrices with its own factors.

    The coefficients ride in NorMuon's rescaling, so numbers and tensors (a CUDA graph's form)
    take the same kernels and round alike.
    """
    coef = factors.coef
    if not torch.is_tensor(coef):
        coef = coef[0] if len(set(coef)) == 1 else torch.tensor(coef, dtype=torch.float32).to(ortho.device)
    row_scale, new_variance = row_scales(ortho, torch.gather(variance, 1, idx), beta2, eps, coef)
    variance.scatter_(1, idx, new_variance)
    apply_scaled_rows(weights, idx, ortho, row_scale, factors.decay)


def orthogonalize_rows(selected: torch.Tensor, hp: Dion3Hyperparameters) -> torch.Tensor:
    """Orthogonalize a (B, k, c) batch of selected rows; fp32 out."""
    return orthogonalize(selected, hp.ns_method, hp.ns_dtype, out_dtype=torch.float32)


@dataclass
class WholeMatrices:
    """A batch of whole matrices one process steps by itself: the weights ((B, n, c), or B separate
    (n, c) tensors), the (B, n) row scores of the momentum (from :func:`accumulate_and_score`, or
    None: scored here), the (B, n, c) momentum, gradients already added, and the (B, n) per-row
    variance (any views, written in place)."""

    weight: torch.Tensor | list[torch.Tensor]
    scores: Optional[torch.Tensor]
    momentum: torch.Tensor
    variance: torch.Tensor
    hp: Dion3Hyperparameters  # fraction already a number
    factors: Optional[UpdateFactors] = None  # default: from hp (see finish_update)
    mu: Optional[float | torch.Tensor] = None  # the applied rows' decay, or (B,) of them; default: from hp
    age: Optional[torch.Tensor] = None  # (B, n) steps since each row was applied: needed when hp.staleness


def step_whole_matrices(entries: list[WholeMatrices]) -> None:
    """The Dion3 step of whole matrices on one process; selected blocks of one shape are
    orthogonalized as one batch (the single-process form of megabatching)."""
    batches: dict[tuple, list] = {}
    for e in entries:
        scores = e.scores if e.scores is not None else row_scores(e.momentum)
        if e.hp.staleness:
            scores = staleness_boost(scores, e.age, e.hp.staleness, e.hp.fraction)
        idx = select_rows(scores, e.hp.fraction, e.hp.num_heads)
        if e.hp.staleness:
            age_rows(e.age, idx)
        selected = take_selected(e.momentum, idx, momentum_decay(e.hp, e.hp.fraction) if e.mu is None else e.mu)
        key = (tuple(selected.shape[1:]), selected.device, e.hp.ns_method, e.hp.ns_dtype)
        batches.setdefault(key, []).append((e, idx, selected))
    for batch in batches.values():
        stacked = torch.cat([b[2] for b in batch]) if len(batch) > 1 else batch[0][2]
        ortho = orthogonalize_rows(stacked, batch[0][0].hp).split([b[2].shape[0] for b in batch])
        for (e, idx, _), block in zip(batch, ortho):
            finish_update(e.weight, e.variance, idx, block, e.hp, e.momentum.shape[-2], e.momentum.shape[-1], e.factors)


# --------------------------------------------------------------------------------------------
# AdamW for the parameters Dion3 does not take (biases, norms, embeddings, output head).


def adamw_step(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    step: int,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
) -> None:
    """Decoupled-weight-decay Adam with bias correction for tensors that share ``step`` (from 1)
    and the settings: multi-tensor ops, a handful of kernels for any number of tensors."""
    if not params:
        return
    beta1, beta2 = betas
    g = [grad.to(m.dtype) for grad, m in zip(grads, exp_avgs)]
    torch._foreach_lerp_(exp_avgs, g, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, g, g, value=1 - beta2)
    bias1 = 1 - beta1**step
    bias2 = 1 - beta2**step
    denom = torch._foreach_div(exp_avg_sqs, bias2)
    torch._foreach_sqrt_(denom)
    torch._foreach_add_(denom, eps)
    update = torch._foreach_div(exp_avgs, bias1)
    torch._foreach_div_(update, denom)
    if weight_decay:
        torch._foreach_mul_(params, 1 - lr * weight_decay)
    torch._foreach_add_(params, [u.to(p.dtype) for u, p in zip(update, params)], alpha=-lr)
