"""The plan of a megabatched Dion3 step: which matrices step together. :func:`build_plan` groups
the shards (:mod:`.sharding`) into :class:`ShapeGroup` s (same logical shape, batch settings and
process group) in an order every rank computes alike, :func:`check_plan_matches` compares the plans
across ranks, and :func:`resolve_fractions` sets each group's f.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from typing import Mapping, NamedTuple, Optional

import torch
import torch.distributed as dist

from ..core.rule import AUTO, Dion3Hyperparameters
from ..core.rule import resolved as resolved_fraction
from . import fractions
from .sharding import MatrixShard, Rect


# --------------------------------------------------------------------------------------------
# Shape groups.


def group_ranks(group: Optional[dist.ProcessGroup]) -> tuple[int, ...]:
    return () if group is None else tuple(dist.get_process_group_ranks(group))


@dataclass
class ShapeGroup:
    """Matrices stepped together: same logical shape, batch settings and process group."""

    key: BatchKey
    group: Optional[dist.ProcessGroup]
    world: int
    rank: int
    shards: list[MatrixShard]
    resolved_fraction: Optional[float] = None  # set by resolve_fractions (None until then)
    offload: Optional[torch.device] = None  # the device an offloaded step runs on; its state is in host memory

    @property
    def fraction(self) -> float:
        """The group's f: its hp.fraction, or what "auto" resolved to (:func:`resolve_fractions`)."""
        if self.resolved_fraction is None:
            raise AssertionError("the plan's fractions are read before resolve_fractions set them")
        return self.resolved_fraction

    @property
    def hp(self) -> Dion3Hyperparameters:
        return self.shards[0].hp

    def owner(self, j: int) -> int:
        return j % self.world

    @property
    def built_staleness(self) -> float:
        """The staleness the group was planned with (in its key): its state has row ages iff > 0."""
        return self.key.staleness

    @property
    def blockwise(self) -> bool:
        """Every shard is whole or split into non-empty row or column blocks: the batched path."""
        return all(
            s.sharding.kind == "full"
            or s.sharding.kind in ("rows", "cols")
            and all(a < b for a, b in zip(s.sharding.bounds, s.sharding.bounds[1:]))
            for s in self.shards
        )

    @functools.cached_property
    def rects(self) -> list[list[list[Rect]]]:
        """rects[j][q]: the rectangles of rank q's piece of matrix j (fixed for the plan's life)."""
        n, m = self.key.shape
        return [[s.sharding.rects(q, n, m) for q in range(self.world)] for s in self.shards]

    @functools.cached_property
    def spans(self) -> list[list[tuple[int, int]]]:
        """spans[j][q]: the rows rank q's piece of matrix j touches."""
        n, m = self.key.shape
        return [[s.sharding.row_span(q, n, m) for q in range(self.world)] for s in self.shards]

    def describe(self) -> list[str]:
        """One line per matrix: what the ranks holding its pieces must agree on (the settings
        that its rows' update depends on, beside those in the group's key)."""
        return [
            f"{s.name} {s.shape} {s.sharding.kind}{list(s.sharding.bounds or s.sharding.boxes)} "
            + " ".join(f"{k}={getattr(s.hp, k)}" for k in _MATRIX_SETTINGS)
            for s in self.shards
        ]


# Per-matrix settings (not in the batch key) that every rank holding a piece must share.
_MATRIX_SETTINGS = ("lr", "weight_decay", "mu", "adjust_lr", "scale_lr_by_fraction", "scale_mu_by_fraction")


class BatchKey(NamedTuple):
    """What the matrices of one shape group share, read by field name so that reordering the
    fields cannot read a wrong one. Its repr orders the groups and enters the plan's digest."""

    shape: tuple[int, int]
    fraction: float | str
    num_heads: Optional[int]
    beta2: float
    eps: float
    ns_method: str
    ns_dtype: str
    momentum_dtype: str  # what the group's momentum buffers hold
    staleness: float
    ranks: tuple[int, ...]  # the process group's ranks; () when the matrix is whole
    device: str  # where a whole matrix lies ("" for split ones: each rank has its own)


def _batch_key(shard: MatrixShard, world: int) -> BatchKey:
    hp = shard.hp
    return BatchKey(
        shard.shape,
        hp.fraction,
        hp.num_heads,
        hp.beta2,
        hp.eps,
        hp.ns_method,
        str(hp.ns_dtype),
        str(hp.momentum_dtype),
        hp.staleness,
        group_ranks(shard.group) if world > 1 else (),
        str(shard.weight.device) if world == 1 else "",
    )


def _check_shard(shard: MatrixShard, world: int, rank: int) -> None:
    n, m = shard.shape
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
            raise ValueError(
                f"{shard.name}: {blocks} {s.split} blocks do not split the {shard.shape} matrix evenly, or places {s.places} repeat"
            )
        height, width = s.block_shape(n, m)
        if s.bounds[-1] != height * width:
            raise ValueError(f"{shard.name}: block_flat bounds end at {s.bounds[-1]}, a block has {height * width} elements")
    if s.kind == "boxes":
        inside = all(0 <= r0 and r1 <= n and 0 <= c0 and c1 <= m for r0, r1, c0, c1 in s.boxes)
        area = sum((r1 - r0) * (c1 - c0) for r0, r1, c0, c1 in s.boxes)
        if not inside or area != n * m or any(_overlap(a, b) for i, a in enumerate(s.boxes) for b in s.boxes[:i]):
            raise ValueError(f"{shard.name}: boxes {s.boxes} do not tile the {shard.shape} matrix")
    expected = s.local_shape(rank, n, m)
    if tuple(shard.weight.shape) != expected or not shard.weight.is_contiguous():
        raise ValueError(f"{shard.name}: local piece must be a contiguous tensor of shape {expected}, got {tuple(shard.weight.shape)}")


def _overlap(a: tuple[int, int, int, int], b: tuple[int, int, int, int]) -> bool:
    return max(a[0], b[0]) < min(a[1], b[1]) and max(a[2], b[2]) < min(a[3], b[3])


def build_plan(shards: list[MatrixShard]) -> list[ShapeGroup]:
    """Group shards by batch key in an order every rank computes alike."""
    groups: dict[BatchKey, ShapeGroup] = {}
    for shard in shards:
        world = 1 if shard.group is None or shard.sharding.kind == "full" else dist.get_world_size(shard.group)
        rank = 0 if world == 1 else dist.get_rank(shard.group)
        _check_shard(shard, world, rank)
        key = _batch_key(shard, world)
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
            mine.setdefault(group_ranks(sg.group), []).extend([repr(sg.key)] + sg.describe())
    members = list(dist.get_process_group_ranks(group)) if group is not None else list(range(dist.get_world_size()))
    digests: list = [None] * len(members)
    dist.all_gather_object(
        digests, {ranks: hashlib.sha1("\n".join(lines).encode()).hexdigest() for ranks, lines in mine.items()}, group=group
    )
    reported = dict(zip(members, digests))
    bad = []
    for ranks in sorted({ranks for d in digests for ranks in d}):
        outside = [r for r in ranks if r not in reported]
        if outside:
            raise RuntimeError(
                f"Dion3 megabatch: matrices are split over the ranks {list(ranks)}, but the ranks "
                f"{outside} are outside the group the plan is checked on ({members})"
            )
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


def chooses_fraction(hp: Dion3Hyperparameters) -> bool:
    """True where the plan chooses the matrix's f: its fraction is :data:`~dion3_megatron.core.rule.AUTO`."""
    return hp.fraction == AUTO


def resolve_fractions(
    plan: list[ShapeGroup],
    step_share: float = 1.0,
    speeds: Optional[fractions.AgreedSpeeds] = None,
    chosen: Optional[Mapping[str, float]] = None,
    device: Optional[torch.device] = None,
) -> None:
    """Set every group's f: its hp.fraction, or for "auto" the f chosen before (``chosen``, by
    matrix name, the first of the group's matrices found there: a resumed checkpoint, an engine
    rebuilt), else the f chosen on the device's measured speed, agreed over the group's process
    group (:func:`fractions.choose_fractions`) so that all members select the same number of rows.
    ``speeds``: the speeds agreed before (:class:`~.fractions.AgreedSpeeds`), taken for every group
    whose ranks all took part (whole matrices; split ones too where they were agreed over the
    world, so that data-parallel replicas of a split matrix choose alike): no collective then (the
    ranks of a split group have the same step share). step_share: see
    :func:`fractions.modelled_loss_change`. device: the device the step runs on, where not the
    weights' (an offloaded step of weights held on the host)."""
    chosen = chosen or {}
    earlier = {id(sg): next((chosen[s.name] for s in sg.shards if s.name in chosen), None) for sg in plan}
    wanted = [sg for sg in plan if chooses_fraction(sg.hp) and earlier[id(sg)] is None]
    requests = [
        fractions.FractionRequest(
            sg.key.shape,
            len(sg.shards),
            sg.world,
            sg.hp,
            device or sg.shards[0].weight.device,
            group,
            step_share,
            speeds if speeds is not None and speeds.covers(group) else None,
        )
        for sg in wanted
        for group in [sg.group if sg.world > 1 else None]
    ]
    chosen_now = dict(zip(map(id, wanted), fractions.choose_fractions(requests)))
    for sg in plan:
        if not chooses_fraction(sg.hp):
            sg.resolved_fraction = resolved_fraction(sg.hp.fraction)
        else:
            f = chosen_now.get(id(sg), earlier[id(sg)])
            assert f is not None  # chosen now where not chosen before
            sg.resolved_fraction = f


def chosen_fractions(plan: list[ShapeGroup]) -> dict[str, float]:
    """What "auto" chose, by matrix name: the record a checkpoint keeps (:func:`resolve_fractions`
    takes it back)."""
    return {s.name: sg.fraction for sg in plan if chooses_fraction(sg.hp) for s in sg.shards}
