"""Where a rank's piece of a logical matrix lies: a :class:`Sharding` (whole, a block of rows, a
block of columns, a box of rows and columns, a row-major element range such as a ZeRO slice, or
such a range of one tensor-parallel block), as up to three :class:`Rect` s of the logical matrix, each a 2-D view of
local storage; and :class:`MatrixShard`, one logical matrix as a rank sees it. Whole matrices are
``Sharding.full()`` shards of the same engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from ..core.rule import Dion3Hyperparameters


# --------------------------------------------------------------------------------------------
# Where a rank's piece of a logical matrix lies.


@dataclass(frozen=True)
class Rect:
    """Rows [r0, r1) x cols [c0, c1) of the logical matrix, stored row-major at ``offset`` locally."""

    r0: int
    r1: int
    c0: int
    c1: int
    offset: int

    def view(self, local: torch.Tensor) -> torch.Tensor:
        height, width = self.r1 - self.r0, self.c1 - self.c0
        return local.view(-1)[self.offset : self.offset + height * width].view(height, width)


@dataclass(frozen=True)
class Sharding:
    """How a logical (n, m) matrix is split over a process group.

    kind "full": every rank holds it whole (no communication); "rows": rank r holds rows
    [bounds[r], bounds[r+1]); "cols": columns [bounds[r], bounds[r+1]); "flat": elements
    [bounds[r], bounds[r+1]) of the row-major flattened matrix (a ZeRO slice, possibly empty);
    "block_flat": the matrix is cut into ``blocks`` equal row (``split`` "rows") or column
    ("cols") blocks, one per tensor-parallel rank, and rank r holds elements [bounds[d],
    bounds[d+1]) of block t's row-major storage, (t, d) = places[r] (ZeRO slices of TP shards);
    "boxes": rank r holds rows [r0, r1) x columns [c0, c1), (r0, r1, c0, c1) = boxes[r] (a DTensor
    split over both rows and columns: FSDP2 with tensor parallelism).
    """

    kind: str
    bounds: tuple[int, ...] = ()
    split: str = ""
    places: tuple[tuple[int, int], ...] = ()
    boxes: tuple[tuple[int, int, int, int], ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in ("full", "rows", "cols", "flat", "block_flat", "boxes"):
            raise ValueError(f"sharding kind must be full, rows, cols, flat, block_flat or boxes, got {self.kind!r}")
        if self.kind == "boxes":
            if not self.boxes or any(not (r0 <= r1 and c0 <= c1) for r0, r1, c0, c1 in self.boxes):
                raise ValueError(f"boxes sharding needs one (r0, r1, c0, c1) box per rank, got {self.boxes}")
        elif self.kind != "full" and (len(self.bounds) < 2 or any(a > b for a, b in zip(self.bounds, self.bounds[1:]))):
            raise ValueError(f"{self.kind} sharding needs >= 2 non-decreasing bounds, got {self.bounds}")
        if self.kind == "block_flat" and (self.split not in ("rows", "cols") or not self.places):
            raise ValueError(f"block_flat sharding needs split 'rows' or 'cols' and places, got {self.split!r}")

    @staticmethod
    def full() -> "Sharding":
        return Sharding("full")

    @staticmethod
    def rows(bounds) -> "Sharding":
        return Sharding("rows", tuple(int(b) for b in bounds))

    @staticmethod
    def cols(bounds) -> "Sharding":
        return Sharding("cols", tuple(int(b) for b in bounds))

    @staticmethod
    def flat(bounds) -> "Sharding":
        return Sharding("flat", tuple(int(b) for b in bounds))

    @staticmethod
    def block_flat(split: str, bounds, places) -> "Sharding":
        return Sharding("block_flat", tuple(int(b) for b in bounds), split, tuple((int(t), int(d)) for t, d in places))

    @staticmethod
    def boxes_of(boxes) -> "Sharding":
        return Sharding("boxes", boxes=tuple((int(r0), int(r1), int(c0), int(c1)) for r0, r1, c0, c1 in boxes))

    @property
    def blocks(self) -> int:
        """block_flat: how many tensor-parallel blocks the matrix is cut into."""
        return 1 + max(t for t, _ in self.places)

    def block_shape(self, n: int, m: int) -> tuple[int, int]:
        """block_flat: the shape of one block."""
        return (n // self.blocks, m) if self.split == "rows" else (n, m // self.blocks)

    @staticmethod
    def even_rows(n: int, world: int) -> "Sharding":
        if n % world:
            raise ValueError(f"{n} rows do not split evenly over {world} ranks")
        return Sharding.rows(range(0, n + 1, n // world))

    @staticmethod
    def even_cols(m: int, world: int) -> "Sharding":
        if m % world:
            raise ValueError(f"{m} columns do not split evenly over {world} ranks")
        return Sharding.cols(range(0, m + 1, m // world))

    @property
    def world(self) -> int:
        if self.kind == "block_flat":
            return len(self.places)
        if self.kind == "boxes":
            return len(self.boxes)
        return 1 if self.kind == "full" else len(self.bounds) - 1

    def local_shape(self, rank: int, n: int, m: int) -> tuple[int, ...]:
        if self.kind == "full":
            return (n, m)
        if self.kind == "block_flat":
            d = self.places[rank][1]
            return (self.bounds[d + 1] - self.bounds[d],)
        if self.kind == "boxes":
            r0, r1, c0, c1 = self.boxes[rank]
            return (r1 - r0, c1 - c0)
        lo, hi = self.bounds[rank], self.bounds[rank + 1]
        return {"rows": (hi - lo, m), "cols": (n, hi - lo), "flat": (hi - lo,)}[self.kind]

    def rects(self, rank: int, n: int, m: int) -> list[Rect]:
        """The rectangles of rank's piece, in local storage order."""
        if self.kind == "full":
            return [Rect(0, n, 0, m, 0)]
        if self.kind == "block_flat":  # the flat piece of its block, moved to the block's place
            t, d = self.places[rank]
            height, width = self.block_shape(n, m)
            dr, dc = (t * height, 0) if self.split == "rows" else (0, t * width)
            return [Rect(r.r0 + dr, r.r1 + dr, r.c0 + dc, r.c1 + dc, r.offset) for r in Sharding.flat(self.bounds).rects(d, height, width)]
        if self.kind == "boxes":
            r0, r1, c0, c1 = self.boxes[rank]
            return [Rect(r0, r1, c0, c1, 0)] if r0 < r1 and c0 < c1 else []
        lo, hi = self.bounds[rank], self.bounds[rank + 1]
        if lo == hi:
            return []
        if self.kind == "rows":
            return [Rect(lo, hi, 0, m, 0)]
        if self.kind == "cols":
            return [Rect(0, n, lo, hi, 0)]
        rects, pos = [], lo
        while pos < hi:  # a partial first row, then whole rows, then a partial last row
            row, col = divmod(pos, m)
            if col or hi - pos < m:
                end = min(hi, (row + 1) * m)
                rects.append(Rect(row, row + 1, col, col + end - pos, pos - lo))
            else:
                end = hi - (hi - pos) % m
                rects.append(Rect(row, end // m, 0, m, pos - lo))
            pos = end
        return rects

    def row_span(self, rank: int, n: int, m: int) -> tuple[int, int]:
        """Rows [R0, R1) that rank's piece touches: it keeps the variance of these rows."""
        rects = self.rects(rank, n, m)
        return (rects[0].r0, rects[-1].r1) if rects else (0, 0)


@dataclass(eq=False)
class MatrixShard:
    """One logical matrix as this rank sees it. ``state`` is created and owned by the engine."""

    name: str
    weight: torch.Tensor
    grad: Optional[torch.Tensor]
    shape: tuple[int, int]
    sharding: Sharding
    group: Optional[dist.ProcessGroup]
    hp: Dion3Hyperparameters
    state: dict = field(default_factory=dict)

    def stepped_grad(self) -> torch.Tensor:
        """The gradient the step reads: the front ends hand the engine only matrices that have one."""
        if self.grad is None:
            raise ValueError(f"Dion3 engine: {self.name} has no gradient to step")
        return self.grad


def state_placement(offload: Optional[torch.device], device: torch.device) -> tuple[torch.device, bool]:
    """(device, pinned) of the state of matrices held on ``device``: ``device``, or where the step
    is offloaded (``offload``: the device it runs on, :mod:`.offload`) host memory, pinned where a
    GPU reads it."""
    if offload is None:
        return device, False
    return torch.device("cpu"), offload.type == "cuda"


def init_state(shard: MatrixShard, rank: int, offload: Optional[torch.device] = None) -> None:
    """Zero momentum (``momentum_dtype``, the piece's shape) and variance (fp32, rows the piece
    touches); with staleness also the ages of those rows (``row_age``); with a bf16 momentum its
    count of steps (``rounding_step``); on the weight's device, or in host memory where the step is
    offloaded (:func:`state_placement`). State a caller gave is kept (a momentum of another dtype
    converted)."""
    r0, r1 = shard.sharding.row_span(rank, *shard.shape)
    device, pinned = state_placement(offload, shard.weight.device)
    dtype = shard.hp.momentum_dtype
    if "momentum" not in shard.state:
        shard.state["momentum"] = torch.zeros(shard.weight.shape, dtype=dtype, device=device, pin_memory=pinned)
    elif shard.state["momentum"].dtype != dtype:
        shard.state["momentum"] = shard.state["momentum"].to(dtype)
    if dtype == torch.float32:
        shard.state.pop("rounding_step", None)
    elif "rounding_step" not in shard.state:
        shard.state["rounding_step"] = torch.zeros((), dtype=torch.int64, device=device, pin_memory=pinned)
    if "variance" not in shard.state:
        shard.state["variance"] = torch.zeros(r1 - r0, dtype=torch.float32, device=device, pin_memory=pinned)
    if shard.hp.staleness and "row_age" not in shard.state:
        shard.state["row_age"] = torch.zeros(r1 - r0, dtype=torch.float32, device=device, pin_memory=pinned)
