"""Unbiased rounding of fp32 values to a bf16 store: stochastic rounding with hashed noise.

A momentum kept in bf16 (``momentum_dtype``) is read as fp32 and computed in fp32; every write back
rounds. Round-to-nearest would lose every addition smaller than half a bf16 step (2^-9 of the
value): a momentum that accumulates many small gradients stops moving. Stochastic rounding rounds
up with probability equal to the distance from the lower neighbour, so the stored value is right
in expectation: each of the 16 bits below bf16's mantissa is replaced by uniform noise added to the
fp32 bit pattern, and the sum is truncated (:func:`stochastic_round`).

The noise is not drawn from a generator but hashed (:func:`noise`) from the entry's place in its
logical matrix, the matrix's seed (:func:`matrix_seed`, from its name), the matrix's count of steps
(``rounding_step``, state like the momentum's) and which write of the step it is. So it is the same
on every rank that holds the entry (data-parallel replicas, any sharding), the same on a resumed
run, and a CUDA graph computes it from device tensors alone (a hash: integer element-wise ops, no
generator state to register or advance).
"""

from __future__ import annotations

import dataclasses
import zlib
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch

# The dtypes a momentum is stored in, by the names the option takes.
MOMENTUM_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}

# Which write of a step a value is rounded for: each draws its own bits.
ACCUMULATE, TAKE, DECAY = 1, 2, 3

_LOW32 = 0xFFFFFFFF
_BELOW_BF16 = 0xFFFF  # the fp32 mantissa bits bf16 drops
_KEEP_BF16 = -0x10000  # as an int32 mask: the bits bf16 keeps
# Odd 32-bit multipliers, written as signed values below 2^31 in magnitude: the product with a
# 32-bit value stays within int64 and its low 32 bits are those of the unsigned product.
_STEP = 0x9E3779B9 - 2**32
_PLACE = 0x7FEB352D
_WRITE = 0x2C1B3C6D
_MIX = (0x7FEB352D, 0x846CA68B - 2**32)  # Wellons' lowbias32

# Elements hashed at once: bounds the int64 temporaries of a rounded write (~100 MB).
CHUNK_ELEMENTS = 1 << 22


def matrix_seed(name: str) -> int:
    """A matrix's seed, from its name: the same in every process (Python's hash() of a str is not)."""
    return zlib.crc32(name.encode())


def _mix32(h: torch.Tensor) -> torch.Tensor:
    """Wellons' lowbias32 of int64 values in [0, 2^32), in place."""
    h.bitwise_xor_(h >> 16)
    h.mul_(_MIX[0]).bitwise_and_(_LOW32)
    h.bitwise_xor_(h >> 15)
    h.mul_(_MIX[1]).bitwise_and_(_LOW32)
    h.bitwise_xor_(h >> 16)
    return h


@dataclass(frozen=True)
class Rounding:
    """What the noise of a batch of stored momentum blocks is hashed from.

    seeds and steps: one per matrix of the batch, int64 on the momentum's device; steps is the
    matrices' ``rounding_step`` state, which :meth:`advance` counts once per step. width: the
    columns of the logical matrices; row0, col0: where the stored block's first entry lies in them.
    """

    seeds: torch.Tensor
    steps: torch.Tensor
    width: int
    row0: int = 0
    col0: int = 0

    def advance(self) -> None:
        """One more step of these matrices (before the step's first write)."""
        self.steps.add_(1)

    def at(self, row0: int, col0: int) -> "Rounding":
        """The same matrices' block starting at (row0, col0) of the logical matrix."""
        return dataclasses.replace(self, row0=row0, col0=col0)

    def keys(self, write: int) -> torch.Tensor:
        """(B,) int64: each matrix's key for this step's ``write`` (ACCUMULATE, TAKE or DECAY)."""
        spread = ((self.steps & _LOW32) * _STEP) & _LOW32
        return _mix32(spread.add_(self.seeds).add_(write * _WRITE).bitwise_and_(_LOW32))

    def noise(self, keys: torch.Tensor, rows: torch.Tensor, n_cols: int) -> torch.Tensor:
        """int32 noise in [0, 2^16) for the stored entries (rows, columns [0, n_cols)) of the block:
        ``rows`` local row indices of any shape, ``keys`` (from :meth:`keys`) broadcast against them;
        the result has shape rows.shape + (n_cols,)."""
        first = ((rows + self.row0) * self.width + self.col0) & _LOW32
        place = (first.unsqueeze(-1) + torch.arange(n_cols, device=rows.device)).bitwise_and_(_LOW32)
        h = (place.mul_(_PLACE).bitwise_and_(_LOW32) + keys.unsqueeze(-1)).bitwise_and_(_LOW32)
        return _mix32(h).bitwise_and_(_BELOW_BF16).to(torch.int32)


def stochastic_round(values: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """fp32 ``values`` rounded to bf16: down or up to a neighbouring bf16 value with probability
    proportional to the distance from the other one, given int32 ``noise`` uniform in [0, 2^16).

    The noise is added to the fp32 bit pattern below bf16's mantissa and the sum truncated: a carry
    into the kept bits (rounding away from zero) happens for exactly (dropped bits) of the 2^16
    noise values. Zero stays zero, infinities stay infinite.
    """
    bits = values.contiguous().view(torch.int32) + noise
    return bits.bitwise_and_(_KEEP_BF16).view(torch.float32).to(torch.bfloat16)


def chunks(batch: int, rows: int, cols: int) -> Iterator[tuple[slice, slice]]:
    """(matrices, rows) slices covering a (batch, rows, cols) block, each about CHUNK_ELEMENTS
    at most (one row at least): a rounded write hashes one chunk at a time."""
    per_matrix = rows * cols
    if per_matrix * batch <= CHUNK_ELEMENTS or per_matrix == 0:
        yield slice(0, batch), slice(0, rows)
        return
    if per_matrix <= CHUNK_ELEMENTS:
        step = CHUNK_ELEMENTS // per_matrix
        for b in range(0, batch, step):
            yield slice(b, min(b + step, batch)), slice(0, rows)
        return
    height = max(1, CHUNK_ELEMENTS // max(cols, 1))
    for b in range(batch):
        for r in range(0, rows, height):
            yield slice(b, b + 1), slice(r, min(r + height, rows))


# --------------------------------------------------------------------------------------------
# The momentum's writes, for a momentum stored in bf16 (the rule's functions hand them over):
# read as fp32, computed in fp32, stored rounded, a chunk at a time.


def needed(momentum: torch.Tensor, rounding: Optional[Rounding]) -> Rounding:
    """The rounding a write into a momentum stored below fp32 takes (ValueError without one)."""
    if rounding is None:
        raise ValueError(f"a {momentum.dtype} momentum is written with stochastic rounding: its Rounding is needed")
    return rounding


def _row_range(rows: slice, device: torch.device) -> torch.Tensor:
    return torch.arange(rows.start, rows.stop, device=device)


def _part(factor: float | torch.Tensor, at: slice) -> float | torch.Tensor:
    """A factor of the matrices ``at``: a number as it is, one per matrix ((B, 1, 1)) sliced."""
    return factor[at] if torch.is_tensor(factor) else factor


def accumulate_and_score(
    momentum: torch.Tensor,
    grads: list[torch.Tensor],
    out: torch.Tensor,
    decay: Optional[float],
    rounding: Rounding,
    row_scores: Callable[[torch.Tensor], torch.Tensor],
) -> None:
    """M += G for a (B, n, c) bf16 momentum: M + G in fp32, its ``row_scores`` into ``out`` (B, n),
    then (times ``decay``) stored rounded."""
    batch, n, c = momentum.shape
    keys = rounding.keys(ACCUMULATE)
    for at, rows in chunks(batch, n, c):
        total = momentum[at, rows].float()
        torch._foreach_add_(list(total.unbind(0)), [g[rows] for g in grads[at]])
        out[at, rows] = row_scores(total)
        if decay is not None:
            total.mul_(decay)
        momentum[at, rows] = stochastic_round(total, rounding.noise(keys[at, None], _row_range(rows, momentum.device)[None], c))


def take_selected(momentum: torch.Tensor, idx: torch.Tensor, decay: float | torch.Tensor, rounding: Rounding) -> torch.Tensor:
    """The rows ``idx`` (B, k) of a (B, n, c) bf16 momentum as fp32 (B, k, c), stored back times
    ``decay`` (a number or (B, 1, 1)), rounded."""
    batch, _, c = momentum.shape
    keys = rounding.keys(TAKE)
    selected = torch.empty(*idx.shape, c, dtype=torch.float32, device=momentum.device)
    for at, rows in chunks(batch, idx.shape[1], c):
        where = idx[at, rows].unsqueeze(-1).expand(-1, -1, c)
        part = selected[at, rows]
        part.copy_(torch.gather(momentum[at], 1, where))
        rounded = stochastic_round(part * _part(decay, at), rounding.noise(keys[at, None], idx[at, rows], c))
        momentum[at].scatter_(1, where, rounded)  # a repeated (padded, zero) row: zeros
    return selected


def decay(momentum: torch.Tensor, factor: float | torch.Tensor, rounding: Rounding) -> None:
    """A (B, n, c) bf16 momentum times ``factor`` (a number or (B, 1, 1)), stored rounded."""
    batch, n, c = momentum.shape
    keys = rounding.keys(DECAY)
    for at, rows in chunks(batch, n, c):
        decayed = momentum[at, rows].float() * _part(factor, at)
        momentum[at, rows] = stochastic_round(decayed, rounding.noise(keys[at, None], _row_range(rows, momentum.device)[None], c))


def take_rows(
    momentum: torch.Tensor, rows: torch.Tensor, factor: float | torch.Tensor, batch: Optional[torch.Tensor], rounding: Rounding
) -> torch.Tensor:
    """momentum[batch, rows] of a bf16 momentum ((n, c) without ``batch``) as fp32 (P, c), stored
    back times ``factor`` (a number or (P, 1)), rounded."""
    at = (rows,) if batch is None else (batch, rows)
    picked = momentum[at].float()
    keys = rounding.keys(TAKE)
    momentum[at] = stochastic_round(picked * factor, rounding.noise(keys if batch is None else keys[batch], rows, momentum.shape[-1]))
    return picked
