"""The cost model of the automatic fraction: f per matrix by the loss it costs against the time it
saves (:func:`choose_fraction`), the time from a model of its step (:func:`estimated_step_seconds`)
on a device's speed (:class:`DeviceSpeed`). Pure arithmetic: the speeds are measured and agreed
across ranks by :mod:`dion3_megatron.engine.fractions`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from .ortho import ns_flops
from .rule import selected_row_count


# --------------------------------------------------------------------------------------------
# The cost model: f per matrix from its shape, the world size and the device's speed.

CANDIDATE_FRACTIONS = (1.0, 0.5, 0.25, 0.125)


MIN_SELECTED_ROWS = 128  # quality floor: a step that selects fewer rows trains worse than f = 1


# The exchange rate between loss and time, calibrated on byte-level GPTs trained at 10 tokens per
# parameter, each optimizer at its best lr:
# at equal tokens f costs about LOSS_PER_WAITING_ROW_SHARE * (1/f - 1) nats of final validation
# loss against f = 1, each at its default mu (10.8M: f = 1 0.6954, f = 1/4 0.7088, f = 1/8 0.7210, two
# seeds each: 0.0045 and 0.0037 per unit; 48.7M: f = 1 0.5550, f = 1/4 0.5653, f = 1/8 0.5725, two
# seeds each: 0.0034 and 0.0025; the largest is taken);
LOSS_PER_WAITING_ROW_SHARE = 0.0045


# and near the end of training those GPTs' validation loss falls by 0.06-0.11 per unit of ln(steps)
# (Muon's runs at its best lr, over their last evaluation interval), so a step x times shorter buys
# about LOSS_PER_LOG_TIME * ln(x) at equal wall-clock time (the low end, rounded down; docs/tuning.md
# states both constants and tests/unit/test_doc_claims.py derives them from benchmarks/results).
LOSS_PER_LOG_TIME = 0.06


# The optimizer cannot see the model's forward and backward, which dilute what its step saves: they
# are modelled as 6 FLOPs per parameter and token at the measured matmul rate, with this many tokens
# per data-parallel rank and step (e.g. 8 sequences of 4096), for the whole matrix on every rank.
TOKENS_PER_STEP = 32768


NS_KERNELS = {"gram": 30, "standard": 20}  # kernels per orthogonalization call, shared by its batch


PER_MATRIX_KERNELS = 20  # kernels per matrix whatever f is: scores, top-k, gathers, NorMuon, update


# Element-wise traffic of the step per matrix entry, over n_rows + k rows. Counted from the kernels
# the step runs (fp32 momentum, gradient and weight): every entry 20 bytes (M += G
# with the row scores: 12; the weight update pass: 8), every selected entry 26 (the rows taken out and
# decayed: 12; Newton-Schulz's input scaled to half precision: 10; NorMuon's and the update's reads of
# the result: 4), 22 at f = 1 (decayed in place: 8). That is 42-48 n c at f = 1 and 26.5-30 n c at
# 1/4. With the counted figures in place of 24, choose_fraction picks the same f for the 14B and 350M
# shapes, 2048^2, 8192^2 and 4096x16384 both ways, at 1 rank (batches of 1 and 8) and 8 (64), with an
# H200's speeds assumed (650 TFLOP/s, 8 us a launch, 3.8 TB/s): 24 stays, the simpler form.
BYTES_PER_ENTRY = 24


WIRE_BYTES_PER_ENTRY = 8  # fp32 there and back through the two all-to-alls


@dataclass(frozen=True)
class DeviceSpeed:
    """What the cost model needs to know about the device (:func:`measure` times it)."""

    matmul_flops: float  # FLOP/s of a large matmul in the orthogonalization dtype
    launch_seconds: float  # time of one small kernel, host overhead included
    memory_bytes_per_s: float
    link_bytes_per_s: float  # per-rank all-to-all bandwidth of the process group's backend


def estimated_step_seconds(
    n_rows: int,
    n_cols: int,
    fraction: float,
    speed: DeviceSpeed,
    world: int = 1,
    batch: int = 1,
    ns_method: str = "gram",
    num_heads: Optional[int] = None,
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


def modelled_loss_change(
    n_rows: int,
    n_cols: int,
    fraction: float,
    speed: DeviceSpeed,
    world: int = 1,
    batch: int = 1,
    ns_method: str = "gram",
    num_heads: Optional[int] = None,
    step_share: float = 1.0,
) -> float:
    """Modelled change of the final loss (nats) from stepping this matrix at ``fraction`` instead of
    1, at equal wall-clock time: what f costs at equal tokens (LOSS_PER_WAITING_ROW_SHARE) less
    what the shorter iteration buys (LOSS_PER_LOG_TIME), the iteration being the matrix's
    modelled forward and backward (TOKENS_PER_STEP) plus its step. Negative: f pays.

    step_share: the share of the matrices whose forward and backward a rank computes that it steps
    (Megatron's layer-wise ZeRO-1: about 1 / DP), so each stepped matrix stands for 1 / step_share
    matrices' forward and backward."""

    def step(f: float) -> float:
        return estimated_step_seconds(n_rows, n_cols, f, speed, world, batch, ns_method, num_heads)

    forward_backward = 6 * n_rows * n_cols * TOKENS_PER_STEP / speed.matmul_flops / step_share
    saved = math.log((forward_backward + step(1.0)) / (forward_backward + step(fraction)))
    return LOSS_PER_WAITING_ROW_SHARE * (1 / fraction - 1) - LOSS_PER_LOG_TIME * saved


def choose_fraction(
    n_rows: int,
    n_cols: int,
    speed: DeviceSpeed,
    world: int = 1,
    batch: int = 1,
    ns_method: str = "gram",
    num_heads: Optional[int] = None,
    step_share: float = 1.0,
) -> float:
    """The automatic f for an n_rows x n_cols matrix.

    Among CANDIDATE_FRACTIONS that select at least MIN_SELECTED_ROWS rows (all of them for smaller
    matrices), the f with the lowest :func:`modelled_loss_change` (the larger f on a tie). Where
    the orthogonalization is a large share of the iteration (wide matrices, few tokens per rank, a
    slow link) a smaller f pays for its loss; where launches, memory or the model's own work
    dominate, f = 1 (at or below Muon's loss) is the choice.
    """
    floor = min(MIN_SELECTED_ROWS, n_rows)
    feasible = [f for f in CANDIDATE_FRACTIONS if selected_row_count(n_rows, f, num_heads) >= floor] or [1.0]
    change = {f: modelled_loss_change(n_rows, n_cols, f, speed, world, batch, ns_method, num_heads, step_share) for f in feasible}
    return min(feasible, key=lambda f: (change[f], -f))
