"""Megabatching: one Dion3 step for sharded matrices, a constant number of collectives per shape.

Every matrix the step touches is grouped by logical shape (and the settings that must agree for
one batched orthogonalization). Over a process group of W ranks:

1. row scores where the rows live (partial L1 norms of column pieces add up): ONE all-reduce for
   all shape groups, then one copy of every group's chosen rows to the host; per shape group:
2. the same top-k rows chosen on every rank; each rank packs its pieces of the selected rows
   (and the row variances it keeps) for the owner of each matrix (matrix j -> rank j mod W):
   ONE all-to-all assembles whole k x n_cols blocks on the owners;
3. the owner orthogonalizes all its blocks as one batch and normalizes them (rule.py);
4. ONE all-to-all sends every rank its pieces of the result, and each applies the update.

Only selected rows travel, so traffic also shrinks with the fraction f. All math is in rule.py;
this module moves tensors. A rank's piece of a matrix is described by a :class:`Sharding`: whole,
a block of rows, a block of columns, a row-major element range (a ZeRO flat slice), or such a
range of one tensor-parallel block (ZeRO slices of TP shards). Pieces are handled as up to three
rectangles of the logical matrix, each a 2-D view of local storage.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import heapq
from dataclasses import dataclass, field
from typing import Callable, Hashable, Optional

import torch
import torch.distributed as dist

from . import cuda_graph as cuda_graph_module, device_speed, rule
from .ortho import default_ns_dtype
from .rule import Dion3Hyperparameters

SELECTION_SCOPES = ("global", "local")


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
    bounds[d+1]) of block t's row-major storage, (t, d) = places[r] (ZeRO slices of TP shards).
    """

    kind: str
    bounds: tuple[int, ...] = ()
    split: str = ""
    places: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in ("full", "rows", "cols", "flat", "block_flat"):
            raise ValueError(f"sharding kind must be full, rows, cols, flat or block_flat, got {self.kind!r}")
        if self.kind != "full" and (len(self.bounds) < 2 or any(a > b for a, b in zip(self.bounds, self.bounds[1:]))):
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
        return 1 if self.kind == "full" else len(self.bounds) - 1

    def local_shape(self, rank: int, n: int, m: int) -> tuple[int, ...]:
        if self.kind == "full":
            return (n, m)
        if self.kind == "block_flat":
            d = self.places[rank][1]
            return (self.bounds[d + 1] - self.bounds[d],)
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
            return [Rect(r.r0 + dr, r.r1 + dr, r.c0 + dc, r.c1 + dc, r.offset)
                    for r in Sharding.flat(self.bounds).rects(d, height, width)]
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


def init_state(shard: MatrixShard, rank: int) -> None:
    """Zero momentum (fp32, the piece's shape) and variance (fp32, rows the piece touches)."""
    if shard.state:
        return
    r0, r1 = shard.sharding.row_span(rank, *shard.shape)
    shard.state["momentum"] = torch.zeros(shard.weight.shape, dtype=torch.float32, device=shard.weight.device)
    shard.state["variance"] = torch.zeros(r1 - r0, dtype=torch.float32, device=shard.weight.device)


def _to_device(host: dict, device: torch.device) -> dict:
    """Move a dict of host index tensors to the device in one copy."""
    if not host:
        return {}
    keys = list(host)
    flat = torch.cat([host[key].to(torch.long) for key in keys])
    if device.type == "cuda":  # from page-locked memory the copy is asynchronous
        flat = flat.pin_memory()
    flat = flat.to(device, non_blocking=True)
    return dict(zip(keys, flat.split([host[key].numel() for key in keys])))


# --------------------------------------------------------------------------------------------
# ZeRO-1 ownership.


def assign_owners(costs: list[float], world: int) -> list[int]:
    """Owner rank per matrix, balancing total cost (e.g. orthogonalization FLOPs) over ``world``.

    Longest-processing-time-first on a min-heap of loads; ties go to the lower rank and the
    earlier matrix, so equal-cost (same-shape) matrices spread round-robin and every rank
    computes the same answer.
    """
    order = sorted(range(len(costs)), key=lambda i: (-costs[i], i))
    heap = [(0.0, rank) for rank in range(world)]
    owners = [0] * len(costs)
    for i in order:
        load, rank = heapq.heappop(heap)
        owners[i] = rank
        heapq.heappush(heap, (load + costs[i], rank))
    return owners


# --------------------------------------------------------------------------------------------
# The plan.


def _group_ranks(group: Optional[dist.ProcessGroup]) -> tuple[int, ...]:
    return () if group is None else tuple(dist.get_process_group_ranks(group))


@dataclass(eq=False)
class _SubBatch:
    """The shards of a shape group that share one sharding, with their state in two buffers.

    rect/span0/provides are per rank q: its block, first row it keeps a variance for, and
    whether it sends those variances to owners. The rest is scratch of the current step.
    """

    index: list[int]
    sharding: Sharding
    momentum: torch.Tensor
    variance: torch.Tensor
    rect: list[Rect]
    span0: list[int]
    provides: list[bool]
    index_on_device: Optional[torch.Tensor] = None
    # Static exchange: row blocks keep one extra zero row (and variance) that rows held by other
    # ranks point at, so every rank sends exactly k rows per matrix (see Dion3Engine._step_static).
    momentum_padded: Optional[torch.Tensor] = None
    variance_padded: Optional[torch.Tensor] = None
    state_views: dict = field(default_factory=dict)  # "momentum"/"variance" -> the views the shards hold
    route: Optional["_Route"] = None
    mus: list = field(default_factory=list)  # per-matrix mu when they differ, and its device copy
    mu_on_device: Optional[torch.Tensor] = None
    # Scratch of the current step (selected rows, who holds them, where they travel).
    chosen: Optional[torch.Tensor] = None
    holds: Optional[torch.Tensor] = None
    counts: list = field(default_factory=list)
    owner_major: list = field(default_factory=list)
    owned: list = field(default_factory=list)
    bi: Optional[torch.Tensor] = None
    local_rows: Optional[torch.Tensor] = None
    variance_rows: Optional[torch.Tensor] = None
    per_dest: list = field(default_factory=list)
    owner_index: dict = field(default_factory=dict)


def _momentum_decay(sg: "ShapeGroup", sub: _SubBatch, device: torch.device) -> float | torch.Tensor:
    """The sub-batch's mu: one number when its matrices share it (no host-to-device copy), else (B,)."""
    mus = [rule.momentum_decay(sg.shards[j].hp, sg.fraction) for j in sub.index]
    if len(set(mus)) == 1:
        return mus[0]
    if sub.mus != mus:  # uploaded once, not per step (nor inside a CUDA graph capture)
        sub.mus, sub.mu_on_device = mus, torch.tensor(mus, device=device)
    return sub.mu_on_device


@dataclass(eq=False)
class _Route:
    """Where a sub-batch's matrices go in the static exchange (fixed for the plan's life):
    ``order`` lists its matrices by owner rank, ``per_dest[d]`` how many rank d owns, and
    ``owned_pos`` the block position (j // world) of each matrix this rank owns, in that order."""

    order: torch.Tensor
    per_dest: list[int]
    owned_pos: torch.Tensor

    @staticmethod
    def build(sg: "ShapeGroup", sub: "_SubBatch", device: torch.device) -> "_Route":
        by_dest = [[b for b, j in enumerate(sub.index) if sg.owner(j) == d] for d in range(sg.world)]
        order = [b for bs in by_dest for b in bs]
        owned = [sub.index[b] // sg.world for b in by_dest[sg.rank]]
        return _Route(torch.tensor(order, dtype=torch.long, device=device), [len(bs) for bs in by_dest],
                      torch.tensor(owned, dtype=torch.long, device=device))


def _update_factors(sg: "ShapeGroup", index: list[int]) -> rule.UpdateFactors:
    """The weight-update factors of matrices ``index`` of the group, each with its own lr and decay."""
    n, m = sg.key[0]
    hps = [sg.shards[j].hp for j in index]
    return rule.UpdateFactors.of([hp.lr for hp in hps], [hp.weight_decay for hp in hps],
                                 [rule.update_scale(n, m, hp.adjust_lr, sg.fraction, hp.scale_lr_by_fraction) for hp in hps])


@dataclass(eq=False)
class _PendingStep:
    """Between Dion3Engine.start_step and finish_step."""

    subs: dict
    chosen: dict  # group index -> (B, k) rows: on the device, on the host once finish_step has them
    local: list[int]  # groups stepped in start_step
    exchanged: list[int]  # groups whose rows travel to the host
    host: Optional[torch.Tensor] = None
    rows: Optional[torch.Tensor] = None
    copied: Optional[torch.cuda.Event] = None


@dataclass
class ShapeGroup:
    """Matrices stepped together: same logical shape, batch settings and process group."""

    key: tuple
    group: Optional[dist.ProcessGroup]
    world: int
    rank: int
    shards: list[MatrixShard]
    fraction: float = 0.0  # hp.fraction, or what "auto" resolved to (Dion3Engine sets it)

    @property
    def hp(self) -> Dion3Hyperparameters:
        return self.shards[0].hp

    def owner(self, j: int) -> int:
        return j % self.world

    @property
    def blockwise(self) -> bool:
        """Every shard is whole or split into non-empty row or column blocks: the batched path."""
        return all(
            s.sharding.kind == "full"
            or s.sharding.kind in ("rows", "cols") and all(a < b for a, b in zip(s.sharding.bounds, s.sharding.bounds[1:]))
            for s in self.shards
        )

    @functools.cached_property
    def rects(self) -> list[list[list[Rect]]]:
        """rects[j][q]: the rectangles of rank q's piece of matrix j (fixed for the plan's life)."""
        n, m = self.key[0]
        return [[s.sharding.rects(q, n, m) for q in range(self.world)] for s in self.shards]

    @functools.cached_property
    def spans(self) -> list[list[tuple[int, int]]]:
        """spans[j][q]: the rows rank q's piece of matrix j touches."""
        n, m = self.key[0]
        return [[s.sharding.row_span(q, n, m) for q in range(self.world)] for s in self.shards]

    def describe(self) -> list[str]:
        """One line per matrix: what the ranks holding its pieces must agree on (the settings
        that its rows' update depends on, beside those in the group's key)."""
        return [f"{s.name} {s.shape} {s.sharding.kind}{list(s.sharding.bounds)} "
                + " ".join(f"{k}={getattr(s.hp, k)}" for k in _MATRIX_SETTINGS) for s in self.shards]


# Per-matrix settings (not in the batch key) that every rank holding a piece must share.
_MATRIX_SETTINGS = ("lr", "weight_decay", "mu", "adjust_lr", "scale_lr_by_fraction", "scale_mu_by_fraction")


def _batch_key(shard: MatrixShard, world: int, scope: str) -> tuple:
    hp = shard.hp
    return (
        shard.shape, hp.fraction, hp.num_heads, hp.beta2, hp.eps, hp.ns_method, str(hp.ns_dtype),
        _group_ranks(shard.group) if world > 1 else (), scope,
    )


def _check_shard(shard: MatrixShard, world: int, rank: int, scope: str) -> None:
    n, m = shard.shape
    if shard.hp.staleness:
        raise ValueError(f"{shard.name}: staleness={shard.hp.staleness!r} is supported by the single-process Dion3 "
                         "only so far; use staleness=0 here")
    s = shard.sharding
    if s.kind != "full" and s.world != world:
        raise ValueError(f"{shard.name}: sharding spans {s.world} ranks but its group has {world}")
    if s.kind == "rows" and s.bounds[-1] != n or s.kind == "cols" and s.bounds[-1] != m:
        raise ValueError(f"{shard.name}: {s.kind} bounds {s.bounds} do not cover the {shard.shape} matrix")
    if s.kind == "flat" and s.bounds[-1] != n * m:
        raise ValueError(f"{shard.name}: flat bounds end at {s.bounds[-1]}, the matrix has {n * m} elements")
    if s.kind == "block_flat":
        blocks = s.blocks
        if (n if s.split == "rows" else m) % blocks or sorted(set(s.places)) != sorted(s.places):
            raise ValueError(f"{shard.name}: {blocks} {s.split} blocks do not split the {shard.shape} matrix evenly, "
                             f"or places {s.places} repeat")
        height, width = s.block_shape(n, m)
        if s.bounds[-1] != height * width:
            raise ValueError(f"{shard.name}: block_flat bounds end at {s.bounds[-1]}, a block has {height * width} elements")
    expected = s.local_shape(rank, n, m)
    if tuple(shard.weight.shape) != expected or not shard.weight.is_contiguous():
        raise ValueError(
            f"{shard.name}: local piece must be a contiguous tensor of shape {expected}, got {tuple(shard.weight.shape)}"
        )
    if scope == "local" and s.kind not in ("full", "rows"):
        raise ValueError(
            f"{shard.name}: selection_scope='local' picks rows within each row shard; this matrix is split as "
            f"{s.kind!r}: use selection_scope='global'"
        )
    if scope == "local" and shard.hp.num_heads is not None and s.kind == "rows":
        raise ValueError(f"{shard.name}: per-head selection needs selection_scope='global' for row-sharded matrices")


STATIC_ROW_BLOCKS_MAX_WORLD = 2  # row blocks send world x the rows they hold on the static exchange


def _static_exchange(sg: ShapeGroup) -> bool:
    """Whether a batched group takes the static exchange. Column blocks always do (they hold
    every row: nothing is padded). Row blocks send all k rows per matrix, zeros for the rows held
    elsewhere: world times the traffic of the host-planned exchange, which sends only the rows
    each rank holds. They take it on 2 ranks (twice the traffic of a few-MB exchange against a
    host wait) while k * world <= rows (the padded rows stay within the group's own momentum)."""
    n = sg.key[0][0]
    if sg.world == 1:
        return False
    if all(s.sharding.kind == "cols" for s in sg.shards):
        return True
    k = rule.selected_row_count(n, sg.fraction, sg.hp.num_heads)
    return sg.world <= STATIC_ROW_BLOCKS_MAX_WORLD and k * sg.world <= n


def build_plan(shards: list[MatrixShard], scope: str) -> list[ShapeGroup]:
    """Group shards by batch key in an order every rank computes alike."""
    groups: dict[tuple, ShapeGroup] = {}
    for shard in shards:
        world = 1 if shard.group is None or shard.sharding.kind == "full" else dist.get_world_size(shard.group)
        rank = 0 if world == 1 else dist.get_rank(shard.group)
        _check_shard(shard, world, rank, scope)
        key = _batch_key(shard, world, scope)
        if key not in groups:
            groups[key] = ShapeGroup(key, shard.group if world > 1 else None, world, rank, [])
        groups[key].shards.append(shard)
    return [groups[k] for k in sorted(groups, key=repr)]


def check_plan_matches(plan: list[ShapeGroup], group: Optional[dist.ProcessGroup] = None) -> None:
    """Compare the plan across the ranks of each process group its matrices span; name the first
    difference, on every rank.

    ONE all-gather over ``group`` (default: the world), which must contain every such process
    group, of each rank's digest per process group: every rank of ``group`` takes part, also one
    that passes no matrix split over some process group its peers use (it reports none for it), so
    a mismatch raises on every rank at construction instead of hanging a later collective. A
    digest covers each matrix's name, shape, sharding and the settings its ranks must share.
    """
    if not dist.is_available() or not dist.is_initialized():
        return
    mine: dict[tuple, list[str]] = {}
    for sg in plan:
        if sg.world > 1:
            mine.setdefault(_group_ranks(sg.group), []).extend([repr(sg.key)] + sg.describe())
    members = list(dist.get_process_group_ranks(group)) if group is not None else list(range(dist.get_world_size()))
    digests: list = [None] * len(members)
    dist.all_gather_object(digests, {ranks: hashlib.sha1("\n".join(lines).encode()).hexdigest()
                                     for ranks, lines in mine.items()}, group=group)
    reported = dict(zip(members, digests))
    bad = []
    for ranks in sorted({ranks for d in digests for ranks in d}):
        outside = [r for r in ranks if r not in reported]
        if outside:
            raise RuntimeError(f"Dion3 megabatch: matrices are split over the ranks {list(ranks)}, but the ranks "
                               f"{outside} are outside the group the plan is checked on ({members})")
        if len({reported[r].get(ranks) for r in ranks}) > 1:
            bad.append(ranks)
    if not bad:
        return
    listings: list = [None] * len(members)
    dist.all_gather_object(listings, mine, group=group)  # only on the error path, by every rank alike
    ranks = bad[0]
    lists = [dict(zip(members, listings))[r].get(ranks, []) for r in ranks]
    first = next(q for q, listing in enumerate(lists) if listing != lists[0])
    a, b = lists[0], lists[first]
    if not a or not b:  # lines: the group key, then one per matrix
        (empty, holder), listing = ((ranks[0], ranks[first]), b) if b else ((ranks[first], ranks[0]), a)
        detail = f"rank {empty} passes no matrix split over them, rank {holder} does (the first: {listing[1]!r})"
    else:
        i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        left = a[i] if i < len(a) else "<nothing>"
        right = b[i] if i < len(b) else "<nothing>"
        detail = f"entry {i} is {left!r} on rank {ranks[0]} but {right!r} on rank {ranks[first]}"
    raise RuntimeError(
        f"Dion3 megabatch plans differ across the ranks {list(ranks)}: {detail}. Every rank of a group "
        f"must pass the same matrices in the same order, with the same settings."
    )


def resolve_fractions(plan: list[ShapeGroup]) -> None:
    """Set every group's f: its hp.fraction, or for "auto" rule.auto_fraction on the device's
    measured speed, agreed over the group's process group (one collective per such group, in an
    order every member shares) so that all members select the same number of rows."""
    speeds: dict[tuple, rule.DeviceSpeed] = {}
    auto = [sg for sg in plan if sg.hp.fraction == rule.AUTO]
    for sg in sorted(auto, key=lambda sg: _group_ranks(sg.group) if sg.world > 1 else ()):
        ranks = _group_ranks(sg.group) if sg.world > 1 else ()
        if ranks not in speeds:
            device = sg.shards[0].weight.device
            dtype = sg.hp.ns_dtype or default_ns_dtype(device)
            speeds[ranks] = device_speed.for_group(device, dtype, sg.group if sg.world > 1 else None)
    for sg in plan:
        if sg.hp.fraction != rule.AUTO:
            sg.fraction = sg.hp.fraction
            continue
        (n, m), ranks = sg.key[0], _group_ranks(sg.group) if sg.world > 1 else ()
        sg.fraction = rule.auto_fraction(n, m, speeds[ranks], sg.world, len(sg.shards), sg.hp.ns_method, sg.hp.num_heads)


# --------------------------------------------------------------------------------------------
# The step.


class Dion3Engine:
    """Steps a list of :class:`MatrixShard` with Dion3, a constant number of collectives per shape.

    selection: "global" (top-k over the whole logical matrix: identical to the single-process
    optimizer at any world size) or "local" (top-k within each row shard; no score exchange).
    check_group: ranks that construct their engines together (default: the world), containing
    every process group the shards span; construction is collective over it, as the plan is
    checked on it (:func:`check_plan_matches`).
    """

    def __init__(self, shards: list[MatrixShard], selection: str = "global", cuda_graph: bool = True,
                 check_group: Optional[dist.ProcessGroup] = None) -> None:
        if selection not in SELECTION_SCOPES:
            raise ValueError(f"selection_scope must be one of {SELECTION_SCOPES}, got {selection!r}")
        if not isinstance(cuda_graph, bool):
            raise ValueError(f"cuda_graph must be a bool, got {cuda_graph!r}")
        self.selection = selection
        self.cuda_graph = cuda_graph
        self._graph = cuda_graph_module.StepGraph()
        self.plan = build_plan(shards, selection)
        check_plan_matches(self.plan, check_group)
        resolve_fractions(self.plan)
        self._group_state: dict[int, list[_SubBatch]] = {}
        self._static = {i for i, sg in enumerate(self.plan) if self._batched(sg) and _static_exchange(sg)}
        for i, sg in enumerate(self.plan):
            if self._batched(sg):
                self._group_state[i] = self._allocate_group_state(sg, padded=i in self._static)
            else:
                for shard in sg.shards:
                    init_state(shard, sg.rank)
        self.collectives: list[str] = []  # per step, for tests and benchmarks
        self.buffer_numels: list[int] = []

    def auto_fractions(self) -> dict[tuple[int, int], float]:
        """What fraction="auto" chose, per logical shape (empty when no matrix asked for it)."""
        return {sg.key[0]: sg.fraction for sg in self.plan if sg.hp.fraction == rule.AUTO}

    @torch.no_grad()
    def step(self, prologue: Optional[Callable[[], None]] = None, epilogue: Optional[Callable[[], None]] = None,
             around_key: Hashable = ()) -> None:
        """One Dion3 step for every shard. When every shape group steps on the device alone (held
        whole, or on the static exchange), the whole step, collectives included, replays from one
        CUDA graph; otherwise :meth:`start_step`, then :meth:`finish_step`.

        ``prologue`` and ``epilogue``: device work right before and after the step (a caller's
        copies into and out of the shards' tensors), inside the graph when the step is graphed;
        ``around_key`` names the tensors they touch, so a graph never replays into stale memory.
        """
        if self._whole_step_graphable():
            self._step_graphed(prologue, epilogue, around_key)
            return
        if prologue is not None:
            prologue()
        self.finish_step(self.start_step())
        if epilogue is not None:
            epilogue()

    def _whole_step_graphable(self) -> bool:
        if not self.cuda_graph or not self.plan or len(self._group_state) != len(self.plan):
            return False  # (an empty plan: a data-parallel rank that owns no matrix)
        return (cuda_graph_module.usable(self.plan[0].shards[0].weight.device)
                and all(sg.world == 1 or i in self._static for i, sg in enumerate(self.plan)))

    def _step_graphed(self, prologue: Optional[Callable[[], None]], epilogue: Optional[Callable[[], None]],
                      around_key: Hashable) -> None:
        """The whole step from one CUDA graph: the tensors it touches and all sizes are fixed, and
        nothing waits for the host. ``collectives`` and ``buffer_numels`` fill on eager calls only."""
        self.collectives, self.buffer_numels = [], []
        subs = {i: self._bind_group_state(self.plan[i], state) for i, state in self._group_state.items()}
        local = [(self.plan[i], sub) for i in subs if self.plan[i].world == 1 for sub in subs[i]]
        exchanged = [i for i in subs if self.plan[i].world > 1]
        factors = [_update_factors(sg, sub.index) for sg, sub in local]
        factors += [_update_factors(self.plan[i], [j for sub in subs[i] for j in sub.index]) for i in exchanged]

        def step(graph_factors: list[rule.UpdateFactors]) -> None:
            if prologue is not None:
                prologue()
            self._step_on_device(subs, graph_factors[: len(local)], dict(zip(exchanged, graph_factors[len(local):])))
            if epilogue is not None:
                epilogue()

        key = (prologue is not None, epilogue is not None, around_key,
               self._graph_key([(self.plan[i], sub) for i in subs for sub in subs[i]]))
        self._graph.run_with_factors(key, step, factors, self.plan[0].shards[0].weight.device)

    def _step_on_device(self, subs: dict[int, list["_SubBatch"]], local_factors: list[rule.UpdateFactors],
                        exchanged_factors: dict[int, rule.UpdateFactors]) -> None:
        """The step of an engine whose groups are all held whole or on the static exchange."""
        local = [i for i in subs if self.plan[i].world == 1]
        chosen = self._select({i: self._accumulate_and_score(self.plan[i], subs[i]) for i in exchanged_factors})
        if local:
            self._step_whole([(self.plan[i], sub) for i in local for sub in subs[i]], local_factors)
        for i, factors in exchanged_factors.items():
            self._step_static(self.plan[i], subs[i], chosen[i], factors)

    @staticmethod
    def _graph_key(parts: list[tuple["ShapeGroup", "_SubBatch"]]) -> tuple:
        """What a captured step of these sub-batches bakes in: buffers, weights, gradients, settings."""
        return tuple(
            (sub.momentum_padded.data_ptr(), sub.variance_padded.data_ptr(), tuple(sub.momentum_padded.shape),
             sg.key, sg.fraction,
             tuple((sg.shards[j].weight.data_ptr(), sg.shards[j].grad.data_ptr(),
                    cuda_graph_module.baked_settings(sg.shards[j].hp)) for j in sub.index))
            for sg, sub in parts
        )

    def _select(self, scores: dict[int, Optional[torch.Tensor]]) -> dict[int, torch.Tensor]:
        """Sum the partial row scores of all groups on one process group in ONE all-reduce; the
        chosen rows (B, k) of each group that has scores."""
        by_group: dict[tuple, list[int]] = {}
        for i, t in scores.items():
            if t is not None and self.plan[i].world > 1:
                by_group.setdefault(_group_ranks(self.plan[i].group), []).append(i)
        for ranks in sorted(by_group):
            members = by_group[ranks]
            flat = torch.cat([scores[i].view(-1) for i in members])
            self.collectives.append("all_reduce")
            dist.all_reduce(flat, group=self.plan[members[0]].group)
            for i, part in zip(members, flat.split([scores[i].numel() for i in members])):
                scores[i] = part.view(scores[i].shape)
        return {i: rule.select_rows(t, self.plan[i].fraction, self.plan[i].hp.num_heads)
                for i, t in scores.items() if t is not None}

    @torch.no_grad()
    def start_step(self) -> "_PendingStep":
        """Accumulate momentum and score rows in every shape group; the scores of all groups on
        one process group are summed in ONE all-reduce and the rows chosen. The chosen rows of the
        groups that exchange them start their ONE copy to the host, not waited for here; groups
        this rank holds whole step right away on the device. Device work a caller queues before
        :meth:`finish_step` also runs while the host waits for that copy.
        """
        self.collectives = []
        self.buffer_numels = []
        subs = {i: self._bind_group_state(self.plan[i], state) for i, state in self._group_state.items()}
        # Groups on one rank need no exchange: they step right away, on the device, unsynced.
        local = [i for i in subs if self.plan[i].world == 1]
        chosen = self._select({i: self._accumulate_and_score(sg, subs.get(i))
                               for i, sg in enumerate(self.plan) if i not in local})
        # Groups on the static exchange keep their rows on the device; the rest need them on the host.
        pending = _PendingStep(subs, chosen, local, [i for i in chosen if i not in self._static])
        if pending.exchanged:
            rows = torch.cat([chosen[i].view(-1) for i in pending.exchanged])
            pending.host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=rows.is_cuda)
            pending.host.copy_(rows, non_blocking=rows.is_cuda)
            if rows.is_cuda:
                pending.copied = torch.cuda.Event()
                pending.copied.record()
            pending.rows = rows  # alive until the copy is done
        if local:
            self._step_local_groups(local, subs)
        return pending

    @torch.no_grad()
    def finish_step(self, pending: "_PendingStep") -> None:
        """Wait for the chosen rows on the host (the step's only wait on the device), then each
        remaining group makes its two all-to-alls and applies its update."""
        chosen = pending.chosen
        if pending.exchanged:
            if pending.copied is not None:
                pending.copied.synchronize()
            sizes = [chosen[i].numel() for i in pending.exchanged]
            for i, part in zip(pending.exchanged, pending.host.split(sizes)):
                chosen[i] = part.view(chosen[i].shape)
        for i, sg in enumerate(self.plan):
            if i in pending.local:
                continue
            if i in self._static:
                self._step_static(sg, pending.subs[i], chosen[i])
            elif i in pending.subs:
                self._step_batched(sg, pending.subs[i], chosen[i])
            else:
                self._step_group(sg, chosen.get(i))

    def _accumulate_and_score(self, sg: ShapeGroup, subs: Optional[list["_SubBatch"]]) -> Optional[torch.Tensor]:
        """Add the gradients to the momentum; this rank's partial row scores (B, n), or None
        under local selection (each rank then scores its own rows in the general path)."""
        n, m = sg.key[0]
        me, shards = sg.rank, sg.shards
        device = shards[0].weight.device
        if subs is not None:  # a batched group: global selection, or one rank (see _batched)
            scores = torch.zeros(len(shards), n, dtype=torch.float32, device=device)
            for sub in subs:
                block = rule.accumulate_and_score(sub.momentum, [shards[j].grad.view(sub.momentum.shape[1:]) for j in sub.index])
                mine = sub.rect[me]
                if sub.index_on_device is None:
                    sub.index_on_device = torch.tensor(sub.index, device=device)
                scores[sub.index_on_device, mine.r0 : mine.r1] = block
            return scores
        for shard in shards:
            shard.state["momentum"].add_(shard.grad)
        if self.selection == "local" and sg.world > 1:
            return None
        scores = torch.zeros(len(shards), n, dtype=torch.float32, device=device)
        for j, shard in enumerate(shards):
            for rect in sg.rects[j][me]:
                scores[j, rect.r0 : rect.r1] += rule.row_scores(rect.view(shard.state["momentum"])[None])[0]
        return scores

    # -- batched path: shards in whole row or column blocks (Megatron tensor parallel) ----

    def _batched(self, sg: ShapeGroup) -> bool:
        return sg.blockwise and not (self.selection == "local" and sg.world > 1)

    @staticmethod
    def _allocate_group_state(sg: ShapeGroup, padded: bool = False) -> list["_SubBatch"]:
        """Split the group by sharding; each part keeps its momentum and variance in one buffer
        (row blocks with one extra zero row when ``padded``, for the static exchange)."""
        n, m = sg.key[0]
        parts: dict[Sharding, list[int]] = {}
        for j, shard in enumerate(sg.shards):
            parts.setdefault(shard.sharding, []).append(j)
        subs = []
        for sharding, index in parts.items():
            first = sg.shards[index[0]]
            r0, r1 = sharding.row_span(sg.rank, n, m)
            device = first.weight.device
            extra = int(padded and sharding.kind == "rows")
            rows, width = first.weight.shape
            momentum = torch.zeros((len(index), rows + extra, width), dtype=torch.float32, device=device)
            variance = torch.zeros(len(index), r1 - r0 + extra, dtype=torch.float32, device=device)
            sub = _SubBatch(
                index,
                sharding,
                momentum[:, :rows],
                variance[:, : r1 - r0],
                [sharding.rects(q, n, m)[0] for q in range(sg.world)],
                [sharding.row_span(q, n, m)[0] for q in range(sg.world)],
                # Column blocks all touch every row: rank 0 sends their variances. Row blocks their own.
                [sharding.kind != "cols" or q == 0 for q in range(sg.world)],
                momentum_padded=momentum,
                variance_padded=variance,
            )
            sub.state_views = {"momentum": list(sub.momentum), "variance": list(sub.variance)}
            for b, j in enumerate(index):
                for key, views in sub.state_views.items():
                    if key in sg.shards[j].state:  # state given by the caller (a resumed checkpoint)
                        views[b].copy_(sg.shards[j].state[key])
                    sg.shards[j].state[key] = views[b]
            subs.append(sub)
        return subs

    @staticmethod
    def _bind_group_state(sg: ShapeGroup, subs: list["_SubBatch"]) -> list["_SubBatch"]:
        """Take back state tensors that a caller replaced (e.g. a checkpoint load) into the buffers.
        Every step, so by identity: the views handed out are the shards' state until replaced."""
        for sub in subs:
            for key, views in sub.state_views.items():
                for view, j in zip(views, sub.index):
                    state = sg.shards[j].state
                    if state[key] is not view:
                        view.copy_(state[key])
                        state[key] = view
        return subs

    def _step_local_groups(self, local: list[int], subs: dict[int, list["_SubBatch"]]) -> None:
        """The groups this rank holds whole: accumulate, score, select, orthogonalize and update,
        all on the device with no host round trip (through one CUDA graph when possible)."""
        parts = [(self.plan[i], sub) for i in local for sub in subs[i]]
        factors = [_update_factors(sg, sub.index) for sg, sub in parts]
        device = parts[0][1].momentum.device
        if not (self.cuda_graph and cuda_graph_module.usable(device)):
            self._step_whole(parts, factors)
            return
        self._graph.run_with_factors(self._graph_key(parts), lambda graph_factors: self._step_whole(parts, graph_factors),
                                     factors, device)

    @staticmethod
    def _step_whole(parts: list[tuple[ShapeGroup, "_SubBatch"]], factors: list[rule.UpdateFactors]) -> None:
        """The Dion3 step of whole matrices (the sub-batches ``parts``), each with its factors and mu."""
        entries = []
        for (sg, sub), part_factors in zip(parts, factors):
            n, m = sg.key[0]
            scores = rule.accumulate_and_score(sub.momentum, [sg.shards[j].grad.view(n, m) for j in sub.index])
            hp = sg.hp if sg.hp.fraction == sg.fraction else dataclasses.replace(sg.hp, fraction=sg.fraction)
            entries.append(rule.WholeMatrices([sg.shards[j].weight.view(n, m) for j in sub.index], scores, sub.momentum,
                                              sub.variance, hp, part_factors,
                                              _momentum_decay(sg, sub, sub.momentum.device)))
        rule.step_whole_matrices(entries)

    def _step_static(self, sg: ShapeGroup, subs: list["_SubBatch"], chosen: torch.Tensor,
                     factors: Optional[rule.UpdateFactors] = None) -> None:
        """Exchange and update of row/column blocks with sizes known in advance: no host wait.

        Every rank sends, for each matrix, its pieces of all k selected rows to the owner: a
        column block holds every row; a row block sends zeros (its padded row) for rows another
        rank holds. Owners add the pieces up (each element comes from exactly one rank, the rest
        are zeros, so the sum is exact), orthogonalize, and return to every rank its columns of
        all k rows; a row block applies only the rows it holds. ``chosen`` (B, k) on the device;
        ``factors`` of the sub-batches' matrices in order, as device tensors (from the group's
        settings when not given).
        """
        n, m = sg.key[0]
        world, me, hp = sg.world, sg.rank, sg.hp
        device = subs[0].momentum.device
        k = chosen.shape[1]
        held: dict[int, tuple] = {}
        send_parts: list[list[torch.Tensor]] = [[] for _ in range(world)]
        for sub in subs:
            if sub.route is None:
                sub.route = _Route.build(sg, sub, device)
            rect, rows = sub.rect[me], sub.momentum.shape[1]
            local = chosen[sub.index_on_device] - rect.r0
            mask = None
            if sub.sharding.kind == "rows":  # rows another rank holds point at the zero row
                mask = (local >= 0) & (local < rows)
                local = torch.where(mask, local, rows)
            pieces = rule.take_selected(sub.momentum_padded, local, _momentum_decay(sg, sub, device))
            variances = torch.gather(sub.variance_padded, 1, local)
            if mask is not None:
                variances = variances * mask
            held[id(sub)] = (local, mask)
            pieces, variances = pieces[sub.route.order], variances[sub.route.order]
            for d, (piece, v) in enumerate(zip(pieces.split(sub.route.per_dest), variances.split(sub.route.per_dest))):
                send_parts[d] += [piece.reshape(-1)] + ([v.reshape(-1)] if sub.provides[me] else [])
        width = {id(sub): [r.c1 - r.c0 for r in sub.rect] for sub in subs}
        send_sizes = [sum(t.numel() for t in parts) for parts in send_parts]
        recv_sizes = [sum(sub.route.per_dest[me] * k * (width[id(sub)][q] + sub.provides[q]) for sub in subs)
                      for q in range(world)]
        send = self._buffer(sum(send_sizes), subs[0].momentum)
        torch.cat([t for parts in send_parts for t in parts], out=send)
        recv = self._all_to_all(send, send_sizes, recv_sizes, sg)

        # Owner: add up the pieces of each owned matrix's k rows, orthogonalize them as one batch.
        owned = len(range(me, len(sg.shards), world))
        blocks = torch.zeros(owned, k, m, dtype=torch.float32, device=device)
        block_variances = torch.zeros(owned, k, dtype=torch.float32, device=device)
        offset = 0
        for q in range(world):
            for sub in subs:
                count, r, pos = sub.route.per_dest[me], sub.rect[q], sub.route.owned_pos
                size = count * k * (r.c1 - r.c0)
                blocks[:, :, r.c0 : r.c1].index_add_(0, pos, recv[offset : offset + size].view(count, k, r.c1 - r.c0))
                offset += size
                if sub.provides[q]:
                    block_variances.index_add_(0, pos, recv[offset : offset + count * k].view(count, k))
                    offset += count * k
        back_sizes = [sum(sub.route.per_dest[me] * k * (width[id(sub)][q] + 1) for sub in subs) for q in range(world)]
        back = self._buffer(sum(back_sizes), subs[0].momentum)
        if owned:
            self._orthogonalize_and_pack(blocks, block_variances, hp, subs, world, back,
                                         lambda sub, q: (sub.route.owned_pos, slice(None)))
        result_sizes = [sum(sub.route.per_dest[d] * k * (width[id(sub)][me] + 1) for sub in subs) for d in range(world)]
        result = self._all_to_all(back, back_sizes, result_sizes, sg)

        # Apply: each owner's results, per part, in route order; row blocks keep the rows they hold.
        steps, new_variances = self._split_returned(result, subs, me, world, lambda sub, d: sub.route.per_dest[d] * k)
        if factors is None:
            factors = _update_factors(sg, [j for sub in subs for j in sub.index]).on_device(device)
        start = 0
        for sub in subs:
            local, mask = held[id(sub)]
            in_order = torch.empty(len(sub.index), k, width[id(sub)][me], dtype=torch.float32, device=device)
            in_order.index_copy_(0, sub.route.order, steps[id(sub)].view(-1, k, width[id(sub)][me]))
            variance_in_order = torch.empty(len(sub.index), k, dtype=torch.float32, device=device)
            variance_in_order.index_copy_(0, sub.route.order, new_variances[id(sub)].view(-1, k))
            sub.variance_padded.scatter_(1, local, variance_in_order)  # rows held elsewhere land in the pad
            weights = [sg.shards[j].weight.view(sub.momentum.shape[1:]) for j in sub.index]
            rule.apply_row_updates(weights, local, in_order, factors.part(start, start + len(sub.index)),
                                   padded=mask is not None)  # rows held elsewhere are skipped
            start += len(sub.index)

    def _step_batched(self, sg: ShapeGroup, subs: list["_SubBatch"], chosen: torch.Tensor) -> None:
        """Exchange and update for a group of row/column blocks; ``chosen`` (B, k) on the host."""
        n, m = sg.key[0]
        world, me, hp, shards = sg.world, sg.rank, sg.hp, sg.shards
        device = subs[0].momentum.device
        k = chosen.shape[1]

        # Host bookkeeping: holds[q][b, i] says rank q holds selected row i of the part's matrix b.
        host: dict[tuple, torch.Tensor] = {}
        for p, sub in enumerate(subs):
            sub.chosen = chosen[sub.index]
            sub.holds = torch.stack([(sub.chosen >= r.r0) & (sub.chosen < r.r1) for r in sub.rect])  # (W, b, k)
            sub.counts = sub.holds.sum(-1).tolist()  # [q][b]
            sub.owner_major = [b for d in range(world) for b, j in enumerate(sub.index) if j % world == d]
            sub.owned = [b for b, j in enumerate(sub.index) if j % world == me]
            order = torch.tensor(sub.owner_major, dtype=torch.long)
            bi, si = sub.holds[me][order].nonzero(as_tuple=True)
            rows = sub.chosen[order[bi], si]
            host[p, "bi"], host[p, "local"], host[p, "var"] = order[bi], rows - sub.rect[me].r0, rows - sub.span0[me]
            position = torch.tensor([sub.index[b] // world for b in sub.owned], dtype=torch.long)
            for q in range(world):
                obi, osi = sub.holds[q][sub.owned].nonzero(as_tuple=True)
                host[p, "pos", q], host[p, "si", q] = position[obi], osi
        on_device = _to_device(host, device)

        # Forward: to each owner, per part, my pieces of its matrices' selected rows, then variances.
        send_parts: list[list[torch.Tensor]] = [[] for _ in range(world)]
        send_sizes = [0] * world
        for p, sub in enumerate(subs):
            sub.bi, sub.local_rows, sub.variance_rows = on_device[p, "bi"], on_device[p, "local"], on_device[p, "var"]
            sub.owner_index = {q: (on_device[p, "pos", q], on_device[p, "si", q]) for q in range(world)}
            pieces = sub.momentum[sub.bi, sub.local_rows]
            mu = _momentum_decay(sg, sub, device)
            sub.momentum[sub.bi, sub.local_rows] = pieces * (mu if not torch.is_tensor(mu) else mu[sub.bi][:, None])
            sub.per_dest = [sum(sub.counts[me][b] for b, j in enumerate(sub.index) if j % world == d) for d in range(world)]
            variances = sub.variance[sub.bi, sub.variance_rows]
            width = sub.rect[me].c1 - sub.rect[me].c0
            for d, (piece, v) in enumerate(zip(pieces.split(sub.per_dest), variances.split(sub.per_dest))):
                send_parts[d] += [piece.reshape(-1)] + ([v] if sub.provides[me] else [])
                send_sizes[d] += sub.per_dest[d] * (width + sub.provides[me])
        recv_sizes = [
            sum(sum(sub.counts[q][b] for b in sub.owned) * (sub.rect[q].c1 - sub.rect[q].c0 + sub.provides[q]) for sub in subs)
            for q in range(world)
        ]
        send = self._buffer(sum(send_sizes), subs[0].momentum)
        torch.cat([p for parts in send_parts for p in parts], out=send)
        recv = self._all_to_all(send, send_sizes, recv_sizes, sg)

        # Owner: whole blocks of all owned matrices, one batched orthogonalization, normalization.
        owned = list(range(me, len(shards), world))  # block b holds matrix owned[b] = me + b * world
        blocks = self._buffer(len(owned) * k * m, subs[0].momentum).view(len(owned), k, m)
        block_variances = torch.empty(len(owned), k, dtype=torch.float32, device=device)
        offset = 0
        for q in range(world):
            for sub in subs:
                pos, si = sub.owner_index[q]
                r = sub.rect[q]
                count = pos.numel()
                blocks[pos, si, r.c0 : r.c1] = recv[offset : offset + count * (r.c1 - r.c0)].view(count, r.c1 - r.c0)
                offset += count * (r.c1 - r.c0)
                if sub.provides[q]:
                    block_variances[pos, si] = recv[offset : offset + count]
                    offset += count
        back_sizes = [sum(sum(sub.counts[q][b] for b in sub.owned) * (sub.rect[q].c1 - sub.rect[q].c0 + 1) for sub in subs)
                      for q in range(world)]
        back = self._buffer(sum(back_sizes), subs[0].momentum)
        if owned:
            self._orthogonalize_and_pack(blocks, block_variances, hp, subs, world, back,
                                         lambda sub, q: sub.owner_index[q])
        result_sizes = [sum(sub.per_dest[d] * (sub.rect[me].c1 - sub.rect[me].c0 + 1) for sub in subs) for d in range(world)]
        result = self._all_to_all(back, back_sizes, result_sizes, sg)

        # Apply: results arrive per owner, per part, in the order this rank sent its pieces.
        steps, new_variances = self._split_returned(result, subs, me, world, lambda sub, d: sub.per_dest[d])
        weights, rows, updates, order = [], [], [], []
        for sub in subs:
            sub.variance[sub.bi, sub.variance_rows] = new_variances[id(sub)]
            sub_steps = steps[id(sub)]
            start = 0
            for b in sub.owner_major:
                shard = shards[sub.index[b]]
                count = sub.counts[me][b]
                weights.append(shard.weight.view(sub.momentum.shape[1:]))
                rows.append(sub.local_rows[start : start + count])
                updates.append(sub_steps[start : start + count])
                order.append(sub.index[b])
                start += count
        rule.apply_updates(weights, rows, updates, _update_factors(sg, order))

    # -- helpers --------------------------------------------------------------------------

    @staticmethod
    def _orthogonalize_and_pack(blocks: torch.Tensor, block_variances: torch.Tensor, hp: Dion3Hyperparameters,
                                subs: list["_SubBatch"], world: int, back: torch.Tensor, rows_of) -> None:
        """Owner side of a batched exchange: orthogonalize and normalize the (B, k, m) blocks and
        pack, per rank q and part, its columns of the rows ``rows_of(sub, q)`` indexes (block
        positions, rows within the blocks) and their new variances into ``back``."""
        ortho = rule.orthogonalize_rows(blocks, hp)
        normalized, new_variance = rule.normalize_rows(ortho, block_variances, hp.beta2, hp.eps)
        parts = []
        for q in range(world):
            for sub in subs:
                rows = rows_of(sub, q)
                parts += [normalized[(*rows, slice(sub.rect[q].c0, sub.rect[q].c1))].reshape(-1),
                          new_variance[rows].reshape(-1)]
        torch.cat(parts, out=back)

    @staticmethod
    def _split_returned(result: torch.Tensor, subs: list["_SubBatch"], me: int, world: int, rows_from):
        """Cut the buffer the owners returned into each part's steps ((rows, width), rows from
        ``rows_from(sub, d)`` for owner d, in owner order) and new variances (rows,)."""
        steps: dict[int, list] = {id(sub): [] for sub in subs}
        variances: dict[int, list] = {id(sub): [] for sub in subs}
        offset = 0
        for d in range(world):
            for sub in subs:
                count, width = rows_from(sub, d), sub.rect[me].c1 - sub.rect[me].c0
                steps[id(sub)].append(result[offset : offset + count * width].view(count, width))
                offset += count * width
                variances[id(sub)].append(result[offset : offset + count])
                offset += count
        return ({key: torch.cat(parts) for key, parts in steps.items()},
                {key: torch.cat(parts) for key, parts in variances.items()})

    def _buffer(self, numel: int, like: torch.Tensor) -> torch.Tensor:
        self.buffer_numels.append(numel)
        return torch.empty(numel, dtype=torch.float32, device=like.device)

    def _all_to_all(self, send: torch.Tensor, send_sizes: list[int], recv_sizes: list[int], sg: ShapeGroup):
        if sg.world == 1:
            return send
        recv = self._buffer(sum(recv_sizes), send)
        self.collectives.append("all_to_all_single")
        dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=sg.group)
        return recv

    # -- general path: any piece (flat ZeRO slices), and local selection -----------------
    #
    # Who holds which selected rows is worked out on the host from one copy of the chosen rows,
    # and every index tensor of the step travels to the device in one copy: no per-matrix syncs.

    def _step_group(self, sg: ShapeGroup, chosen: Optional[torch.Tensor]) -> None:
        """Exchange and update for any pieces; ``chosen`` (B, k) on the host, None for local scope."""
        n, m = sg.key[0]
        world, me, hp, shards = sg.world, sg.rank, sg.hp, sg.shards
        device = shards[0].weight.device
        rects, spans = sg.rects, sg.spans
        layout = _GeneralLayout(sg, rects, spans, chosen, device)
        if chosen is None:  # local scope: each rank picks within its own row block (local indices)
            layout.local_picks = [
                rule.select_rows(rule.row_scores(r[me][0].view(s.state["momentum"])[None]), sg.fraction)[0]
                if r[me] else torch.empty(0, dtype=torch.long, device=device)
                for s, r in zip(shards, rects)
            ]
        layout.finalize()

        # Forward: for each matrix, to its owner: the variances I provide, then my row pieces.
        send_parts: list[list[torch.Tensor]] = [[] for _ in range(world)]
        for j, shard in enumerate(shards):
            owner = sg.owner(j)
            momentum = shard.state["momentum"]
            send_parts[owner].append(shard.state["variance"][layout.provided_rows(j)])
            for t, rect in enumerate(rects[j][me]):
                view, local = rect.view(momentum), layout.rect_rows(j, t)
                piece = view[local]
                view[local] = piece * rule.momentum_decay(shard.hp, sg.fraction)
                send_parts[owner].append(piece.reshape(-1))
        send_sizes = [sum(p.numel() for p in parts) for parts in send_parts]
        send = self._buffer(sum(send_sizes), momentum)
        if send.numel():
            torch.cat([p for parts in send_parts for p in parts], out=send)
        recv_sizes = [layout.forward_size(q) for q in range(world)]
        recv = self._all_to_all(send, send_sizes, recv_sizes, sg)

        # Owner: assemble whole blocks, orthogonalize them as one batch, normalize.
        owned = list(range(me, len(shards), world))
        k = layout.k
        blocks = self._buffer(len(owned) * k * m, momentum).view(len(owned), k, m)
        variances = torch.empty(len(owned), k, dtype=torch.float32, device=device)
        offset = 0
        for q in range(world):
            for b, j in enumerate(owned):
                positions = layout.provider_positions(j, q)
                variances[b, positions] = recv[offset : offset + positions.numel()]
                offset += positions.numel()
                for t, rect in enumerate(rects[j][q]):
                    positions = layout.block_positions(j, q, t)
                    count, width = positions.numel(), rect.c1 - rect.c0
                    blocks[b, positions, rect.c0 : rect.c1] = recv[offset : offset + count * width].view(count, width)
                    offset += count * width
        back_sizes = [layout.backward_size(q, sender=me) for q in range(world)]
        back = self._buffer(sum(back_sizes), momentum)
        if owned:
            ortho = rule.orthogonalize_rows(blocks, hp)
            normalized, new_variance = rule.normalize_rows(ortho, variances, hp.beta2, hp.eps)
            parts = []
            for q in range(world):
                for b, j in enumerate(owned):
                    parts.append(new_variance[b, layout.span_positions(j, q)])
                    for t, rect in enumerate(rects[j][q]):
                        parts.append(normalized[b, layout.block_positions(j, q, t), rect.c0 : rect.c1].reshape(-1))
            if back.numel():
                torch.cat(parts, out=back)
        result = self._all_to_all(back, back_sizes, [layout.backward_size(me, sender=q) for q in range(world)], sg)

        # Apply: results come owner by owner, matrix by matrix, in the order sent.
        offsets = [sum(layout.backward_size(me, sender=p) for p in range(q)) for q in range(world)]
        for j, shard in enumerate(shards):
            q = sg.owner(j)
            rows = layout.span_rows(j)
            shard.state["variance"][rows] = result[offsets[q] : offsets[q] + rows.numel()]
            offsets[q] += rows.numel()
            scale = rule.update_scale(n, m, shard.hp.adjust_lr, sg.fraction, shard.hp.scale_lr_by_fraction)
            for t, rect in enumerate(rects[j][me]):
                local = layout.rect_rows(j, t)
                count, width = local.numel(), rect.c1 - rect.c0
                step = result[offsets[q] : offsets[q] + count * width].view(1, count, width)
                offsets[q] += count * width
                rule.apply_update(rect.view(shard.weight)[None], local[None], step, shard.hp.lr,
                                  shard.hp.weight_decay, scale)


class _GeneralLayout:
    """Host-side bookkeeping of one general-path step: which selected rows each rank holds.

    Global scope: from the chosen rows (on the host). Local scope (row blocks only): rank q holds
    a contiguous run of its own picks, so block positions are ranges and no row index travels.
    Index tensors are built on the host and moved to the device together in :meth:`finalize`.
    """

    def __init__(self, sg: ShapeGroup, rects, spans, chosen: Optional[torch.Tensor], device) -> None:
        self.sg, self.rects, self.spans, self.chosen, self.device = sg, rects, spans, chosen, device
        self.local_picks: Optional[list[torch.Tensor]] = None
        n, _ = sg.key[0]
        if chosen is not None:
            self.k = chosen.shape[1]
        else:
            self.counts = [self._local_count(q) for q in range(sg.world)]
            self.starts = [sum(self.counts[:q]) for q in range(sg.world)]
            self.k = sum(self.counts)
        self._device: dict[tuple, torch.Tensor] = {}
        self._cache: dict[tuple, torch.Tensor] = {}

    def _local_count(self, q: int) -> int:
        r0, r1 = self.spans[0][q]
        return rule.selected_row_count(r1 - r0, self.sg.fraction) if r1 > r0 else 0

    # Host-side index sets ------------------------------------------------------------------

    def _in(self, j: int, lo: int, hi: int) -> torch.Tensor:
        """Positions (into the k selected rows of matrix j) of rows in [lo, hi); rows are sorted."""
        key = ("in", j, lo, hi)
        if key not in self._cache:
            rows = self.chosen[j]
            start, end = torch.searchsorted(rows, torch.tensor([lo, hi])).tolist()
            self._cache[key] = torch.arange(start, end)
        return self._cache[key]

    def _provider_positions_host(self, j: int, q: int) -> torch.Tensor:
        if self.chosen is None:
            return torch.arange(self.starts[q], self.starts[q] + self.counts[q])
        # The provider of a row is the lowest rank touching it: rows of q's span in no lower rank's
        # span (spans need not follow rank order: ZeRO slices of tensor-parallel blocks).
        key = ("provider", j, q)
        if key not in self._cache:
            rows = self.chosen[j]
            lo, hi = self.spans[j][q]
            mine = (rows >= lo) & (rows < hi)
            for p in range(q):
                p_lo, p_hi = self.spans[j][p]
                mine &= (rows < p_lo) | (rows >= p_hi)
            self._cache[key] = mine.nonzero().view(-1)
        return self._cache[key]

    def _block_positions_host(self, j: int, q: int, t: int) -> torch.Tensor:
        if self.chosen is None:
            return torch.arange(self.starts[q], self.starts[q] + self.counts[q])
        rect = self.rects[j][q][t]
        return self._in(j, rect.r0, rect.r1)

    def _span_positions_host(self, j: int, q: int) -> torch.Tensor:
        if self.chosen is None:
            return torch.arange(self.starts[q], self.starts[q] + self.counts[q])
        return self._in(j, *self.spans[j][q])

    def finalize(self) -> None:
        """Build every index set of the step and move them to the device in one copy."""
        sg, me = self.sg, self.sg.rank
        wanted: dict[tuple, torch.Tensor] = {}
        for j in range(len(sg.shards)):
            r0 = self.spans[j][me][0]
            if self.chosen is None:
                picks = self.local_picks[j]  # already indices into this rank's row block
                self._device[("provided", j)] = picks
                self._device[("span_rows", j)] = picks
                for t, _ in enumerate(self.rects[j][me]):
                    self._device[("rect", j, t)] = picks
            else:
                rows = self.chosen[j]
                wanted[("provided", j)] = rows[self._provider_positions_host(j, me)] - r0
                wanted[("span_rows", j)] = rows[self._span_positions_host(j, me)] - r0
                for t, rect in enumerate(self.rects[j][me]):
                    wanted[("rect", j, t)] = rows[self._block_positions_host(j, me, t)] - rect.r0
            if sg.owner(j) == me:
                for q in range(sg.world):
                    wanted[("provider_pos", j, q)] = self._provider_positions_host(j, q)
                    wanted[("span_pos", j, q)] = self._span_positions_host(j, q)
                    for t, _ in enumerate(self.rects[j][q]):
                        wanted[("block_pos", j, q, t)] = self._block_positions_host(j, q, t)
        self._device.update(_to_device(wanted, self.device))

    # Device-side lookups and message sizes -------------------------------------------------

    def provided_rows(self, j: int) -> torch.Tensor:
        return self._device[("provided", j)]

    def span_rows(self, j: int) -> torch.Tensor:
        return self._device[("span_rows", j)]

    def rect_rows(self, j: int, t: int) -> torch.Tensor:
        return self._device[("rect", j, t)]

    def provider_positions(self, j: int, q: int) -> torch.Tensor:
        return self._device[("provider_pos", j, q)]

    def span_positions(self, j: int, q: int) -> torch.Tensor:
        return self._device[("span_pos", j, q)]

    def block_positions(self, j: int, q: int, t: int) -> torch.Tensor:
        return self._device[("block_pos", j, q, t)]

    def _count(self, j: int, q: int, kind: str, t: int = 0) -> int:
        if self.chosen is None:
            return self.counts[q]
        host = {"provider": self._provider_positions_host, "span": self._span_positions_host}
        return (self._block_positions_host(j, q, t) if kind == "block" else host[kind](j, q)).numel()

    def forward_size(self, q: int) -> int:
        """Values rank q sends to this rank (as owner)."""
        total = 0
        for j in range(self.sg.rank, len(self.sg.shards), self.sg.world):
            total += self._count(j, q, "provider")
            total += sum(self._count(j, q, "block", t) * (r.c1 - r.c0) for t, r in enumerate(self.rects[j][q]))
        return total

    def backward_size(self, q: int, sender: int) -> int:
        """Values owner ``sender`` sends back to rank q."""
        total = 0
        for j in range(sender, len(self.sg.shards), self.sg.world):
            total += self._count(j, q, "span")
            total += sum(self._count(j, q, "block", t) * (r.c1 - r.c0) for t, r in enumerate(self.rects[j][q]))
        return total
