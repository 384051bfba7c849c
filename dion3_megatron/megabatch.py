"""Megabatching: one Dion3 step for sharded matrices, a constant number of collectives per shape.

Every matrix the step touches is grouped by logical shape (and the settings that must agree for
one batched orthogonalization). For one shape group over a process group of W ranks:

1. row scores where the rows live (partial L1 norms of column pieces add up): ONE all-reduce;
2. the same top-k rows chosen on every rank; each rank packs its pieces of the selected rows
   (and the row variances it keeps) for the owner of each matrix (matrix j -> rank j mod W):
   ONE all-to-all assembles whole k x n_cols blocks on the owners;
3. the owner orthogonalizes all its blocks as one batch and normalizes them (rule.py);
4. ONE all-to-all sends every rank its pieces of the result, and each applies the update.

Only selected rows travel, so traffic also shrinks with the fraction f. All math is in rule.py;
this module moves tensors. A rank's piece of a matrix is described by a :class:`Sharding`: whole,
a block of rows, a block of columns, or a row-major element range (a ZeRO flat slice). Pieces are
handled as up to three rectangles of the logical matrix, each a 2-D view of local storage.
"""

from __future__ import annotations

import hashlib
import heapq
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from . import rule
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
    [bounds[r], bounds[r+1]) of the row-major flattened matrix (a ZeRO slice, possibly empty).
    """

    kind: str
    bounds: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in ("full", "rows", "cols", "flat"):
            raise ValueError(f"sharding kind must be full, rows, cols or flat, got {self.kind!r}")
        if self.kind != "full" and (len(self.bounds) < 2 or any(a > b for a, b in zip(self.bounds, self.bounds[1:]))):
            raise ValueError(f"{self.kind} sharding needs >= 2 non-decreasing bounds, got {self.bounds}")

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
        return 1 if self.kind == "full" else len(self.bounds) - 1

    def local_shape(self, rank: int, n: int, m: int) -> tuple[int, ...]:
        if self.kind == "full":
            return (n, m)
        lo, hi = self.bounds[rank], self.bounds[rank + 1]
        return {"rows": (hi - lo, m), "cols": (n, hi - lo), "flat": (hi - lo,)}[self.kind]

    def rects(self, rank: int, n: int, m: int) -> list[Rect]:
        """The rectangles of rank's piece, in local storage order."""
        if self.kind == "full":
            return [Rect(0, n, 0, m, 0)]
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

    def variance_provider(self, rows: torch.Tensor, n: int, m: int) -> torch.Tensor:
        """For each row, the lowest rank whose piece touches it (it sends that row's variance)."""
        provider = torch.full_like(rows, -1)
        for rank in reversed(range(self.world)):
            r0, r1 = self.row_span(rank, n, m)
            provider[(rows >= r0) & (rows < r1)] = rank
        return provider


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


@dataclass
class ShapeGroup:
    """Matrices stepped together: same logical shape, batch settings and process group."""

    key: tuple
    group: Optional[dist.ProcessGroup]
    world: int
    rank: int
    shards: list[MatrixShard]

    @property
    def hp(self) -> Dion3Hyperparameters:
        return self.shards[0].hp

    def owner(self, j: int) -> int:
        return j % self.world

    @property
    def uniform(self) -> bool:
        """All shards split alike into non-empty row or column blocks (or whole): the batched path."""
        first = self.shards[0].sharding
        if first.kind not in ("full", "rows", "cols") or any(s.sharding != first for s in self.shards):
            return False
        return first.kind == "full" or all(a < b for a, b in zip(first.bounds, first.bounds[1:]))

    def describe(self) -> list[str]:
        return [f"{s.name} {s.shape} {s.sharding.kind}{list(s.sharding.bounds)}" for s in self.shards]


def _batch_key(shard: MatrixShard, world: int, scope: str) -> tuple:
    hp = shard.hp
    return (
        shard.shape, hp.fraction, hp.num_heads, hp.beta2, hp.eps, hp.ns_method, str(hp.ns_dtype),
        _group_ranks(shard.group) if world > 1 else (), scope,
    )


def _check_shard(shard: MatrixShard, world: int, rank: int, scope: str) -> None:
    n, m = shard.shape
    s = shard.sharding
    if s.kind != "full" and s.world != world:
        raise ValueError(f"{shard.name}: sharding spans {s.world} ranks but its group has {world}")
    if s.kind == "rows" and s.bounds[-1] != n or s.kind == "cols" and s.bounds[-1] != m:
        raise ValueError(f"{shard.name}: {s.kind} bounds {s.bounds} do not cover the {shard.shape} matrix")
    if s.kind == "flat" and s.bounds[-1] != n * m:
        raise ValueError(f"{shard.name}: flat bounds end at {s.bounds[-1]}, the matrix has {n * m} elements")
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


def check_plan_matches(plan: list[ShapeGroup]) -> None:
    """Compare the plan across ranks with one all-gather of digests; name the first difference.

    Runs at construction, so a mismatch raises on every rank instead of hanging a later step.
    """
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    mine: dict[tuple, list[str]] = {}
    for sg in plan:
        if sg.world > 1:
            mine.setdefault(_group_ranks(sg.group), []).extend([repr(sg.key)] + sg.describe())
    digests = {ranks: hashlib.sha1("\n".join(lines).encode()).hexdigest() for ranks, lines in mine.items()}
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, digests)
    me = dist.get_rank()
    bad = sorted(
        ranks for ranks in {r for d in gathered for r in d}
        if len({gathered[r].get(ranks) for r in ranks}) > 1
    )
    if not bad:
        return
    details: list = [None] * dist.get_world_size()
    dist.all_gather_object(details, mine)  # only on the error path: every rank reaches it
    ranks = bad[0]
    listings = {r: details[r].get(ranks, []) for r in ranks}
    first, second = ranks[0], next(r for r in ranks if listings[r] != listings[ranks[0]])
    a, b = listings[first], listings[second]
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    left = a[i] if i < len(a) else "<nothing>"
    right = b[i] if i < len(b) else "<nothing>"
    where = "this rank's group" if me in ranks else f"the group of ranks {list(ranks)}"
    raise RuntimeError(
        f"Dion3 megabatch plans differ across ranks in {where}: entry {i} is {left!r} on rank {first} "
        f"but {right!r} on rank {second}. Every rank must pass the same matrices in the same order."
    )


# --------------------------------------------------------------------------------------------
# The step.


class Dion3Engine:
    """Steps a list of :class:`MatrixShard` with Dion3, a constant number of collectives per shape.

    selection: "global" (top-k over the whole logical matrix: identical to the single-process
    optimizer at any world size) or "local" (top-k within each row shard; no score exchange).
    """

    def __init__(self, shards: list[MatrixShard], selection: str = "global") -> None:
        if selection not in SELECTION_SCOPES:
            raise ValueError(f"selection_scope must be one of {SELECTION_SCOPES}, got {selection!r}")
        self.selection = selection
        self.plan = build_plan(shards, selection)
        check_plan_matches(self.plan)
        self._group_state: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for i, sg in enumerate(self.plan):
            if self._batched(sg):
                self._group_state[i] = self._allocate_group_state(sg)
            else:
                for shard in sg.shards:
                    init_state(shard, sg.rank)
        self.collectives: list[str] = []  # per step, for tests and benchmarks
        self.buffer_numels: list[int] = []

    @torch.no_grad()
    def step(self) -> None:
        self.collectives = []
        self.buffer_numels = []
        for i, sg in enumerate(self.plan):
            if i in self._group_state:
                self._step_batched(sg, *self._bind_group_state(sg, *self._group_state[i]))
            else:
                self._step_group(sg)

    # -- batched path: a shape group whose shards are split alike -------------------------

    def _batched(self, sg: ShapeGroup) -> bool:
        return sg.uniform and not (self.selection == "local" and sg.world > 1)

    @staticmethod
    def _allocate_group_state(sg: ShapeGroup) -> tuple[torch.Tensor, torch.Tensor]:
        """One (B, h, w) momentum and one (B, rows) variance buffer; each shard's state views a slice."""
        n, m = sg.key[0]
        first = sg.shards[0]
        r0, r1 = first.sharding.row_span(sg.rank, n, m)
        device = first.weight.device
        momentum = torch.zeros((len(sg.shards), *first.weight.shape), dtype=torch.float32, device=device)
        variance = torch.zeros(len(sg.shards), r1 - r0, dtype=torch.float32, device=device)
        for j, shard in enumerate(sg.shards):
            for key, buffer in (("momentum", momentum), ("variance", variance)):
                if key in shard.state:  # state given by the caller (a resumed checkpoint)
                    buffer[j].copy_(shard.state[key])
                shard.state[key] = buffer[j]
        return momentum, variance

    @staticmethod
    def _bind_group_state(sg: ShapeGroup, momentum: torch.Tensor, variance: torch.Tensor):
        """Take back state tensors that a caller replaced (e.g. a checkpoint load) into the buffers."""
        for j, shard in enumerate(sg.shards):
            for key, buffer in (("momentum", momentum), ("variance", variance)):
                if shard.state[key].data_ptr() != buffer[j].data_ptr():
                    buffer[j].copy_(shard.state[key])
                    shard.state[key] = buffer[j]
        return momentum, variance

    def _step_batched(self, sg: ShapeGroup, momentum: torch.Tensor, variance: torch.Tensor) -> None:
        """The shape group's step with batched tensor ops; one host sync for the message sizes."""
        n, m = sg.key[0]
        world, me, hp = sg.world, sg.rank, sg.hp
        shards = sg.shards
        device = momentum.device
        sharding = shards[0].sharding
        rect = [sharding.rects(q, n, m)[0] for q in range(world)]
        span0 = [sharding.row_span(q, n, m)[0] for q in range(world)]
        # Column blocks all touch every row; rank 0 sends their variances. Row blocks send their own.
        provides = [sharding.kind != "cols" or q == 0 for q in range(world)]
        for shard, buffer in zip(shards, momentum):
            buffer.add_(shard.grad)

        scores = torch.zeros(len(shards), n, dtype=torch.float32, device=device)
        scores[:, rect[me].r0 : rect[me].r1] = rule.row_scores(momentum)
        if world > 1:
            self.collectives.append("all_reduce")
            dist.all_reduce(scores, group=sg.group)
        chosen = rule.select_rows(scores, hp.fraction, hp.num_heads)  # (B, k)

        owner_major = [j for d in range(world) for j in range(d, len(shards), world)]
        owned = list(range(me, len(shards), world))
        holds = torch.stack([(chosen >= r.r0) & (chosen < r.r1) for r in rect])  # (W, B, k)
        counts = holds.sum(-1).tolist()  # [q][j]: the one host sync

        # Forward: my pieces of the selected rows, owner-major, then the variances I provide.
        order = torch.tensor(owner_major, device=device)
        b_i, s_i = holds[me][order].nonzero(as_tuple=True)
        jb = order[b_i]
        rows = chosen[jb, s_i]
        local_rows = rows - rect[me].r0
        pieces = momentum[jb, local_rows]  # (count, w)
        mus = torch.tensor([s.hp.mu for s in shards], device=device)[jb]
        momentum[jb, local_rows] = pieces * mus[:, None]
        variance_rows = rows - span0[me]
        width = [r.c1 - r.c0 for r in rect]
        per_dest = [sum(counts[me][j] for j in range(d, len(shards), world)) for d in range(world)]
        send_parts = []
        for d, (p, v) in enumerate(zip(pieces.split(per_dest), variance[jb, variance_rows].split(per_dest))):
            send_parts += [p.reshape(-1)] + ([v] if provides[me] else [])
        send_sizes = [c * (width[me] + provides[me]) for c in per_dest]
        send = self._buffer(sum(send_sizes), momentum)
        torch.cat(send_parts, out=send)
        from_rank = [sum(counts[q][j] for j in owned) for q in range(world)]
        recv = self._all_to_all(send, send_sizes, [c * (width[q] + provides[q]) for q, c in enumerate(from_rank)], sg)

        # Owner: whole blocks, one batched orthogonalization, NorMuon normalization.
        k = chosen.shape[1]
        blocks = self._buffer(len(owned) * k * m, momentum).view(len(owned), k, m)
        variances = torch.empty(len(owned), k, dtype=torch.float32, device=device)
        owned_holds = holds[:, owned]  # (W, B_own, k)
        for q, chunk in enumerate(recv.split([c * (width[q] + provides[q]) for q, c in enumerate(from_rank)])):
            values = chunk[: from_rank[q] * width[q]].view(-1, width[q])
            blocks[:, :, rect[q].c0 : rect[q].c1][owned_holds[q]] = values
            if provides[q]:
                variances[owned_holds[q]] = chunk[from_rank[q] * width[q] :]
        back_sizes = [c * (width[q] + 1) for q, c in enumerate(from_rank)]
        back = self._buffer(sum(back_sizes), momentum)
        if owned:
            ortho = rule.orthogonalize_rows(blocks, hp)
            normalized, new_variance = rule.normalize_rows(ortho, variances, hp.beta2, hp.eps)
            back_parts = []
            for q in range(world):
                back_parts += [normalized[:, :, rect[q].c0 : rect[q].c1][owned_holds[q]].reshape(-1), new_variance[owned_holds[q]]]
            torch.cat(back_parts, out=back)
        result = self._all_to_all(back, back_sizes, [c * (width[me] + 1) for c in per_dest], sg)

        # Apply: the returned pieces come owner-major, in the order this rank sent them.
        steps, new_variances = [], []
        for chunk, c in zip(result.split([c * (width[me] + 1) for c in per_dest]), per_dest):
            steps.append(chunk[: c * width[me]].view(c, width[me]))
            new_variances.append(chunk[c * width[me] :])
        steps = torch.cat(steps)
        variance[jb, variance_rows] = torch.cat(new_variances)
        offset = 0
        for j in owner_major:
            shard = shards[j]
            count = counts[me][j]
            scale = rule.update_scale(n, m, shard.hp.adjust_lr, shard.hp.fraction, shard.hp.scale_lr_by_fraction)
            rule.apply_update(
                shard.weight.view(1, *momentum.shape[1:]),
                local_rows[offset : offset + count][None],
                steps[offset : offset + count][None],
                shard.hp.lr, shard.hp.weight_decay, scale,
            )
            offset += count

    # -- helpers --------------------------------------------------------------------------

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

    def _select(self, sg: ShapeGroup, rects_of: list[list[Rect]]) -> torch.Tensor:
        """Selected rows (B, k), identical on every rank of the group."""
        n, m = sg.key[0]
        hp = sg.hp
        device = sg.shards[0].weight.device
        if self.selection == "local" and sg.world > 1:
            # Each rank picks within its own rows; everyone derives all choices' sizes, not values,
            # so the chosen rows travel with the data (see _pack). Here: this rank's rows only.
            picks = []
            for shard, rects in zip(sg.shards, rects_of):
                if not rects:
                    picks.append(torch.empty(0, dtype=torch.long, device=device))
                    continue
                rect = rects[0]
                local = rule.select_rows(rule.row_scores(rect.view(shard.state["momentum"])[None]), hp.fraction)
                picks.append(local[0] + rect.r0)
            return picks  # type: ignore[return-value]
        scores = torch.zeros(len(sg.shards), n, dtype=torch.float32, device=device)
        for j, (shard, rects) in enumerate(zip(sg.shards, rects_of)):
            for rect in rects:
                scores[j, rect.r0 : rect.r1] += rule.row_scores(rect.view(shard.state["momentum"])[None])[0]
        if sg.world > 1 and not all(s.sharding.kind == "full" for s in sg.shards):
            self.collectives.append("all_reduce")
            dist.all_reduce(scores, group=sg.group)
        return rule.select_rows(scores, hp.fraction, hp.num_heads)

    def _local_counts(self, sg: ShapeGroup, rank: int) -> int:
        """Rows that ``rank`` picks per matrix under local selection."""
        n, m = sg.key[0]
        r0, r1 = sg.shards[0].sharding.row_span(rank, n, m)
        return rule.selected_row_count(r1 - r0, sg.hp.fraction) if r1 > r0 else 0

    # -- one shape group ------------------------------------------------------------------

    def _step_group(self, sg: ShapeGroup) -> None:
        n, m = sg.key[0]
        world, me = sg.world, sg.rank
        shards = sg.shards
        local_scope = self.selection == "local" and world > 1
        rects = [[s.sharding.rects(q, n, m) for q in range(world)] for s in shards]  # [j][q]
        spans = [[s.sharding.row_span(q, n, m) for q in range(world)] for s in shards]
        for shard in shards:
            shard.state["momentum"].add_(shard.grad.to(torch.float32))
        chosen = self._select(sg, [r[me] for r in rects])

        # ---- forward: pieces of the selected rows to each matrix's owner -------------------
        send_parts: list[list[torch.Tensor]] = [[] for _ in range(world)]
        for j, shard in enumerate(shards):
            hp = shard.hp
            owner = sg.owner(j)
            momentum = shard.state["momentum"]
            rows = chosen[j]
            if local_scope:
                send_parts[owner].append(rows.to(torch.float32))
            provider = shard.sharding.variance_provider(rows, n, m) if not local_scope else None
            mine = rows if local_scope else rows[provider == me]
            r0 = spans[j][me][0]
            send_parts[owner].append(shard.state["variance"][mine - r0])
            for rect in rects[j][me]:
                inside = rows[(rows >= rect.r0) & (rows < rect.r1)] - rect.r0
                piece = rule.take_selected(rect.view(momentum)[None], inside[None], hp.mu)[0]
                send_parts[owner].append(piece.reshape(-1))
        send_sizes = [sum(p.numel() for p in parts) for parts in send_parts]
        send = self._buffer(sum(send_sizes), shards[0].weight)
        if sum(send_sizes):
            torch.cat([p for parts in send_parts for p in parts], out=send)

        owned = [j for j in range(len(shards)) if sg.owner(j) == me]
        recv_sizes = [self._forward_size(sg, q, owned, rects, spans, chosen) for q in range(world)]
        recv = self._all_to_all(send, send_sizes, recv_sizes, sg)

        # ---- owner: assemble blocks, orthogonalize as one batch, normalize ------------------
        k_total = (sum(self._local_counts(sg, q) for q in range(world)) if local_scope
                   else rule.selected_row_count(n, sg.hp.fraction, sg.hp.num_heads))
        blocks = self._buffer(len(owned) * k_total * m, shards[0].weight).view(len(owned), k_total, m)
        variances = torch.zeros(len(owned), k_total, dtype=torch.float32, device=blocks.device)
        owned_rows: list[torch.Tensor] = []
        offset = 0
        for q in range(world):
            for b, j in enumerate(owned):
                if local_scope:
                    count = self._local_counts(sg, q)
                    rows = recv[offset : offset + count].long()
                    offset += count
                    if q == 0:
                        owned_rows.append(rows)
                    else:
                        owned_rows[b] = torch.cat([owned_rows[b], rows])
                    start = sum(self._local_counts(sg, p) for p in range(q))
                    variances[b, start : start + count] = recv[offset : offset + count]
                    offset += count
                    for rect in rects[j][q]:
                        width = rect.c1 - rect.c0
                        blocks[b, start : start + count, rect.c0 : rect.c1] = recv[offset : offset + count * width].view(count, width)
                        offset += count * width
                    continue
                rows = chosen[j]
                provided = shards[j].sharding.variance_provider(rows, n, m) == q
                count = int(provided.sum())
                variances[b, provided] = recv[offset : offset + count]
                offset += count
                for rect in rects[j][q]:
                    inside = (rows >= rect.r0) & (rows < rect.r1)
                    height, width = int(inside.sum()), rect.c1 - rect.c0
                    blocks[b, inside, rect.c0 : rect.c1] = recv[offset : offset + height * width].view(height, width)
                    offset += height * width
        if owned:
            ortho = rule.orthogonalize_rows(blocks, sg.hp)
            normalized, new_variance = rule.normalize_rows(ortho, variances, sg.hp.beta2, sg.hp.eps)
        # ---- back: every rank's pieces of the result, and the new variances of its rows ----
        back_parts: list[list[torch.Tensor]] = [[] for _ in range(world)]
        for q in range(world):
            for b, j in enumerate(owned):
                rows = owned_rows[b] if local_scope else chosen[j]
                lo, hi = spans[j][q]
                if local_scope:
                    start = sum(self._local_counts(sg, p) for p in range(q))
                    count = self._local_counts(sg, q)
                    sl = slice(start, start + count)
                    back_parts[q].append(new_variance[b, sl])
                    for rect in rects[j][q]:
                        back_parts[q].append(normalized[b, sl, rect.c0 : rect.c1].reshape(-1))
                    continue
                back_parts[q].append(new_variance[b, (rows >= lo) & (rows < hi)])
                for rect in rects[j][q]:
                    inside = (rows >= rect.r0) & (rows < rect.r1)
                    back_parts[q].append(normalized[b, inside, rect.c0 : rect.c1].reshape(-1))
        back_sizes = [sum(p.numel() for p in parts) for parts in back_parts]
        back = self._buffer(sum(back_sizes), shards[0].weight)
        if sum(back_sizes):
            torch.cat([p for parts in back_parts for p in parts], out=back)
        result_sizes = [self._backward_size(sg, q, me, rects, spans, chosen) for q in range(world)]
        result = self._all_to_all(back, back_sizes, result_sizes, sg)

        # ---- apply on every rank -----------------------------------------------------------
        offsets = [sum(result_sizes[:q]) for q in range(world)]
        for j, shard in enumerate(shards):
            hp = shard.hp
            q = sg.owner(j)
            rows = chosen[j]
            lo, hi = spans[j][me]
            mine = rows[(rows >= lo) & (rows < hi)]
            shard.state["variance"][mine - lo] = result[offsets[q] : offsets[q] + mine.numel()]
            offsets[q] += mine.numel()
            scale = rule.update_scale(n, m, hp.adjust_lr, hp.fraction, hp.scale_lr_by_fraction)
            for rect in rects[j][me]:
                inside = rows[(rows >= rect.r0) & (rows < rect.r1)] - rect.r0
                height, width = inside.numel(), rect.c1 - rect.c0
                step = result[offsets[q] : offsets[q] + height * width].view(1, height, width)
                offsets[q] += height * width
                rule.apply_update(rect.view(shard.weight)[None], inside[None], step, hp.lr, hp.weight_decay, scale)

    def _forward_size(self, sg, q, owned, rects, spans, chosen) -> int:
        """Values rank q sends this rank (the owner of ``owned``)."""
        n, m = sg.key[0]
        total = 0
        for j in owned:
            if self.selection == "local" and sg.world > 1:
                count = self._local_counts(sg, q)
                total += 2 * count + sum(count * (r.c1 - r.c0) for r in rects[j][q])
                continue
            rows = chosen[j]
            total += int((sg.shards[j].sharding.variance_provider(rows, n, m) == q).sum())
            for rect in rects[j][q]:
                total += int(((rows >= rect.r0) & (rows < rect.r1)).sum()) * (rect.c1 - rect.c0)
        return total

    def _backward_size(self, sg, q, me, rects, spans, chosen) -> int:
        """Values owner q sends back to this rank."""
        total = 0
        for j in range(len(sg.shards)):
            if sg.owner(j) != q:
                continue
            rows = chosen[j]
            lo, hi = spans[j][me]
            total += int(((rows >= lo) & (rows < hi)).sum())
            for rect in rects[j][me]:
                total += int(((rows >= rect.r0) & (rows < rect.r1)).sum()) * (rect.c1 - rect.c0)
        return total
