"""What every exchange shares: how one shape group's selected rows reach the ranks that
orthogonalize them and come back (:meth:`Exchange.round_trip`, the megabatch itself: ONE all-to-all
assembles each owner's blocks, the owner orthogonalizes and normalizes them as one batch, ONE
all-to-all returns every rank its pieces), the group's state buffers (:class:`SubBatch`), and the
base of the exchanges whose state lives in them (:class:`BlockExchange`). The strategies:
:mod:`.local` (matrices a rank holds whole), :mod:`.static`, :mod:`.planned`, :mod:`.general`;
:func:`.engine.exchange_for` picks one per group. All math is in :mod:`dion3_megatron.core.rule`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional

import torch
import torch.distributed as dist

from ..core import rounding as bf16_rounding
from ..core import rule
from ..core.rounding import Rounding
from ..core.rule import Dion3Hyperparameters
from . import cuda_graph as cuda_graph_module
from .plan import ShapeGroup
from .sharding import Rect, Sharding, state_placement

if TYPE_CHECKING:
    from .static import Route


def to_device(host: dict, device: torch.device) -> dict:
    """Move a dict of host index tensors to the device in one copy."""
    if not host:
        return {}
    keys = list(host)
    flat = torch.cat([host[key].to(torch.long) for key in keys])
    if device.type == "cuda":  # from page-locked memory the copy is asynchronous
        flat = flat.pin_memory()
    flat = flat.to(device, non_blocking=True)
    return dict(zip(keys, flat.split([host[key].numel() for key in keys])))


@dataclass(eq=False)
class SubBatch:
    """The shards of a shape group that share one sharding, with their state in two buffers.

    rect/span0/provides are per rank q: its block, first row it keeps a variance for, and
    whether it sends those variances to owners.
    """

    index: list[int]
    sharding: Sharding
    momentum: torch.Tensor
    variance: torch.Tensor
    age: Optional[torch.Tensor]  # with staleness: (B, rows touched) steps since each row was applied
    rect: list[Rect]
    span0: list[int]
    provides: list[bool]
    index_on_device: Optional[torch.Tensor] = None
    # Static exchange: row blocks keep one extra zero row (and variance) that rows held by other
    # ranks point at, so every rank sends exactly k rows per matrix (see StaticExchange).
    momentum_padded: Optional[torch.Tensor] = None
    variance_padded: Optional[torch.Tensor] = None
    state_views: dict = field(default_factory=dict)  # "momentum"/"variance"/"row_age"/"rounding_step" -> the shards' views
    route: Optional["Route"] = None
    mus: list = field(default_factory=list)  # per-matrix mu when they differ, and its device copy
    mu_on_device: Optional[torch.Tensor] = None
    rounding: Optional[Rounding] = None  # a momentum stored below fp32: what its rounding hashes


def sub_batch_mu(sg: ShapeGroup, sub: SubBatch, device: torch.device) -> float | torch.Tensor:
    """The sub-batch's mu (:func:`rule.momentum_decays`): one number when its matrices share it
    (no host-to-device copy), else (B,) on the device."""
    mus = rule.momentum_decays([sg.shards[j].hp for j in sub.index], sg.fraction)
    if not isinstance(mus, list):
        return mus
    if sub.mus != mus or sub.mu_on_device is None:  # uploaded once, not per step (nor inside a CUDA graph capture)
        sub.mus, sub.mu_on_device = mus, torch.tensor(mus, device=device)
    return sub.mu_on_device


def group_hp(sg: ShapeGroup) -> Dion3Hyperparameters:
    """The group's settings with its fraction resolved (a number where the plan chose it)."""
    return sg.hp if sg.hp.fraction == sg.fraction else dataclasses.replace(sg.hp, fraction=sg.fraction)


def folded_decay_of(sg: ShapeGroup, mu: float | torch.Tensor) -> Optional[float]:
    """:func:`rule.folded_decay` for a group's matrices: the decay their accumulation takes when the
    step selects every row, as the single process's does (so both orthogonalize mu * (M + G))."""
    return rule.folded_decay(group_hp(sg), sg.key.shape[0], mu)


def take_decay_of(sg: ShapeGroup, mu: float | torch.Tensor) -> float | torch.Tensor:
    """The decay the selected rows take as they are copied out: mu, or 1 where the accumulation
    has already decayed them (:func:`folded_decay_of`)."""
    return 1.0 if folded_decay_of(sg, mu) is not None else mu


def update_factors_of(sg: ShapeGroup, index: list[int]) -> rule.UpdateFactors:
    """The weight-update factors of matrices ``index`` of the group (each its own lr, weight decay)."""
    return rule.update_factors([sg.shards[j].hp for j in index], sg.fraction, *sg.key.shape)


# --------------------------------------------------------------------------------------------
# The exchanges.


class Traffic:
    """The communication buffers and collectives of one engine's step, counted for tests and
    benchmarks (on eager steps: a replayed CUDA graph runs none of this Python)."""

    def __init__(self) -> None:
        self.collectives: list[str] = []
        self.buffer_numels: list[int] = []

    def reset(self) -> None:
        self.collectives, self.buffer_numels = [], []

    def buffer(self, numel: int, device: torch.device) -> torch.Tensor:
        self.buffer_numels.append(numel)
        return torch.empty(numel, dtype=torch.float32, device=device)

    def all_reduce(self, flat: torch.Tensor, group: Optional[dist.ProcessGroup]) -> None:  # None: the world
        self.collectives.append("all_reduce")
        dist.all_reduce(flat, group=group)

    def all_to_all(self, send: torch.Tensor, send_sizes: list[int], recv_sizes: list[int], sg: ShapeGroup) -> torch.Tensor:
        if sg.world == 1:
            return send
        recv = self.buffer(sum(recv_sizes), send.device)
        self.collectives.append("all_to_all_single")
        dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=sg.group)
        return recv


class Exchange:
    """The step of one shape group on this rank. The engine calls :meth:`bind` and :meth:`score`
    on every group, sums the partial scores of the groups on one process group in one all-reduce,
    selects the rows, and calls :meth:`step` with them (on the host where :attr:`host_rows`)."""

    host_rows = True  # step() takes the chosen rows on the host
    static = False  # fixed sizes and no host wait: the step can be captured in a CUDA graph

    def __init__(self, sg: ShapeGroup, traffic: Traffic) -> None:
        self.sg, self.traffic = sg, traffic

    def bind(self) -> None:
        """Before a step: check that staleness is what the state was built for; take back state
        tensors a caller replaced (a checkpoint load)."""
        built, now = self.sg.built_staleness, self.sg.hp.staleness
        if now != built:  # the rows' ages exist only when the group was built with staleness
            raise ValueError(
                f"Dion3 engine: staleness changed from {built!r} to {now!r} since the engine was built "
                f"({self.sg.shards[0].name}); build a new engine (the front ends do so)"
            )

    def score(self) -> torch.Tensor:
        """Add the gradients to the momentum; this rank's partial row scores (B, n) of the group,
        with staleness boosted by the ages of the rows this rank keeps (:func:`rule.staleness_boost`:
        every piece of a row boosts by the same age, so the partial scores still add up)."""
        raise NotImplementedError

    def age(self, chosen: torch.Tensor) -> None:
        """With staleness: age the rows this rank keeps, the ``chosen`` (B, k) ones (on the device)
        to 0 (:func:`rule.age_piece_rows`)."""
        raise NotImplementedError

    def step(self, chosen: torch.Tensor, factors: Optional[rule.UpdateFactors] = None) -> None:
        """Send the pieces of the ``chosen`` (B, k) rows to their owners, orthogonalize, update."""
        raise NotImplementedError

    def factors(self) -> list[rule.UpdateFactors]:
        """A :attr:`static` exchange: the weight-update factors its step takes, as numbers."""
        raise NotImplementedError

    def graph_key(self) -> tuple:
        """A :attr:`static` exchange: what a captured step of the group bakes in."""
        raise NotImplementedError

    def round_trip(
        self,
        send_parts: list[list[torch.Tensor]],
        recv_sizes: list[int],
        assemble: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
        back_sizes: list[int],
        pack: Callable[[torch.Tensor, torch.Tensor], list[torch.Tensor]],
        result_sizes: list[int],
    ) -> torch.Tensor:
        """The megabatch: ``send_parts[d]`` (this rank's pieces for owner d) travel in ONE
        all-to-all; ``assemble(received)`` builds the owned (B, k, m) blocks and (B, k) variances,
        which are orthogonalized and normalized as one batch; ``pack(normalized, new_variance)``
        lays out every rank's part of them, and ONE all-to-all returns what this rank receives."""
        sg, traffic = self.sg, self.traffic
        device = sg.shards[0].weight.device
        send_sizes = [sum(t.numel() for t in parts) for parts in send_parts]
        send = traffic.buffer(sum(send_sizes), device)
        if send.numel():
            torch.cat([t for parts in send_parts for t in parts], out=send)
        blocks, variances = assemble(traffic.all_to_all(send, send_sizes, recv_sizes, sg))
        back = traffic.buffer(sum(back_sizes), device)
        if blocks.shape[0]:
            ortho = rule.orthogonalize_rows(blocks, sg.hp)
            normalized, new_variance = rule.normalize_rows(ortho, variances, sg.hp.beta2, sg.hp.eps)
            parts = pack(normalized, new_variance)
            if back.numel():
                torch.cat(parts, out=back)
        return traffic.all_to_all(back, back_sizes, result_sizes, sg)

    def owned(self) -> list[int]:
        """The matrices this rank owns (orthogonalizes): block b holds matrix rank + b * world."""
        return list(range(self.sg.rank, len(self.sg.shards), self.sg.world))


class BlockExchange(Exchange):
    """Whole matrices or row or column blocks: the group's state lives in one buffer per sharding
    (a :class:`SubBatch`), so its steps run as batched ops."""

    padded = False  # row blocks keep one extra zero row (the static exchange)

    def __init__(self, sg: ShapeGroup, traffic: Traffic, momentum_in_place: bool = False) -> None:
        super().__init__(sg, traffic)
        self.subs = allocate_group_state(sg, self.padded, momentum_in_place)

    def bind(self) -> None:
        """Every step, so by identity: the views handed out are the shards' state until replaced."""
        super().bind()
        for sub in self.subs:
            for key, views in sub.state_views.items():
                for view, j in zip(views, sub.index):
                    state = self.sg.shards[j].state
                    if state[key] is not view:
                        view.copy_(state[key])
                        state[key] = view

    def score(self) -> torch.Tensor:
        sg = self.sg
        device = sg.shards[0].weight.device
        scores = torch.zeros(len(sg.shards), sg.key.shape[0], dtype=torch.float32, device=device)
        for sub in self.subs:
            decay = folded_decay_of(sg, sub_batch_mu(sg, sub, device))
            if sub.rounding is not None:
                sub.rounding.advance()
            grads = [sg.shards[j].stepped_grad().view(sub.momentum.shape[1:]) for j in sub.index]
            block = rule.accumulate_and_score(sub.momentum, grads, decay=decay, rounding=sub.rounding)
            if sub.age is not None:
                block = rule.staleness_boost(block, sub.age, sg.hp.staleness, sg.fraction)
            mine = sub.rect[sg.rank]
            if sub.index_on_device is None:
                sub.index_on_device = torch.tensor(sub.index, device=device)
            scores[sub.index_on_device, mine.r0 : mine.r1] = block
        return scores

    def age(self, chosen: torch.Tensor) -> None:
        for sub in self.subs:
            assert sub.age is not None and sub.index_on_device is not None  # staleness; made by score()
            rule.age_piece_rows(sub.age, chosen[sub.index_on_device], sub.span0[self.sg.rank])

    def factors(self) -> list[rule.UpdateFactors]:
        """The weight-update factors the step takes, as numbers (a graph refreshes them each replay)."""
        return [update_factors_of(self.sg, [j for sub in self.subs for j in sub.index])]

    def graph_key(self) -> tuple:
        """What a captured step of the group bakes in: buffers, weights, gradients, settings."""
        sg = self.sg
        padded = []
        for sub in self.subs:
            momentum, variance = sub.momentum_padded, sub.variance_padded
            assert momentum is not None and variance is not None  # a static exchange's, made by bind()
            padded.append((momentum, variance))
        return tuple(
            (
                m.data_ptr(),
                v.data_ptr(),
                tuple(m.shape),
                sub.age.data_ptr() if sub.age is not None else None,
                sub.rounding.steps.data_ptr() if sub.rounding is not None else None,
                sg.key,
                sg.fraction,
                tuple(
                    (
                        sg.shards[j].weight.data_ptr(),
                        sg.shards[j].stepped_grad().data_ptr(),
                        cuda_graph_module.baked_settings(sg.shards[j].hp),
                    )
                    for j in sub.index
                ),
            )
            for sub, (m, v) in zip(self.subs, padded)
        )

    def _split_returned(self, result: torch.Tensor, rows_from: Callable[["SubBatch", int], int]):
        """Cut the buffer the owners returned into each part's steps ((rows, width), rows from
        ``rows_from(sub, d)`` for owner d, in owner order) and new variances (rows,)."""
        me = self.sg.rank
        steps: dict[int, list] = {id(sub): [] for sub in self.subs}
        variances: dict[int, list] = {id(sub): [] for sub in self.subs}
        offset = 0
        for d in range(self.sg.world):
            for sub in self.subs:
                count, width = rows_from(sub, d), sub.rect[me].c1 - sub.rect[me].c0
                steps[id(sub)].append(result[offset : offset + count * width].view(count, width))
                offset += count * width
                variances[id(sub)].append(result[offset : offset + count])
                offset += count
        return ({key: torch.cat(parts) for key, parts in steps.items()}, {key: torch.cat(parts) for key, parts in variances.items()})

    def _pack(self, rows_of: Callable[["SubBatch", int], tuple]):
        """Owner side: per rank q and part, q's columns of the rows ``rows_of(sub, q)`` indexes
        (block positions, rows within the blocks) and their new variances."""

        def pack(normalized: torch.Tensor, new_variance: torch.Tensor) -> list[torch.Tensor]:
            parts = []
            for q in range(self.sg.world):
                for sub in self.subs:
                    rows = rows_of(sub, q)
                    parts += [normalized[(*rows, slice(sub.rect[q].c0, sub.rect[q].c1))].reshape(-1), new_variance[rows].reshape(-1)]
            return parts

        return pack


def allocate_group_state(sg: ShapeGroup, padded: bool, momentum_in_place: bool = False) -> list[SubBatch]:
    """Split the group by sharding; each part keeps its momentum, variance (and with staleness the
    rows' ages) in one buffer each (row blocks with one extra zero row when ``padded``, for the
    static exchange). State a caller gave (a resumed checkpoint) is copied in; the shards' state
    becomes views of the buffers. ``momentum_in_place``: the momentum the caller gave is the
    storage itself (a ZeRO slice's ``exp_avg``), stepped where it lies: each run of matrices whose
    momentum lies end to end in one tensor is a part of its own, with no buffer of its own."""
    n, m = sg.key.shape
    parts: dict[Sharding, list[int]] = {}
    for j, shard in enumerate(sg.shards):
        parts.setdefault(shard.sharding, []).append(j)
    subs = []
    for sharding, index in parts.items():
        for run in _end_to_end_runs(sg, index) if momentum_in_place and not padded else [index]:
            subs.append(_sub_batch(sg, sharding, run, padded, momentum_in_place and not padded))
    return subs


def _end_to_end_runs(sg: ShapeGroup, index: list[int]) -> list[list[int]]:
    """``index`` cut where a matrix's given momentum does not start right after the previous one's."""
    runs: list[list[int]] = []
    for j in index:
        momentum = sg.shards[j].state["momentum"]
        if not momentum.is_contiguous():
            raise ValueError(f"{sg.shards[j].name}: momentum stepped in place must be contiguous")
        if runs:
            last = sg.shards[runs[-1][-1]].state["momentum"]
            if (
                last.untyped_storage().data_ptr() == momentum.untyped_storage().data_ptr()
                and momentum.storage_offset() == last.storage_offset() + last.numel()
            ):
                runs[-1].append(j)
                continue
        runs.append([j])
    return runs


def _sub_batch(sg: ShapeGroup, sharding: Sharding, index: list[int], padded: bool, in_place: bool) -> SubBatch:
    n, m = sg.key.shape
    first = sg.shards[index[0]]
    r0, r1 = sharding.row_span(sg.rank, n, m)
    device, pinned = state_placement(sg.offload, first.weight.device)
    extra = int(padded and sharding.kind == "rows")
    rows, width = first.weight.shape
    dtype = sg.hp.momentum_dtype
    if in_place:  # the caller's momentum, as one (matrices, rows, width) view
        given = first.state["momentum"]
        if given.dtype != dtype:
            raise ValueError(
                f"{first.name}: momentum_dtype={dtype} is not taken where the momentum is stepped in place "
                f"(a ZeRO slice's {given.dtype} exp_avg); set momentum_dtype to {given.dtype}"
            )
        momentum = given.as_strided((len(index), rows, width), (rows * width, width, 1), given.storage_offset())
    else:
        momentum = torch.zeros((len(index), rows + extra, width), dtype=dtype, device=device, pin_memory=pinned)
    variance = torch.zeros(len(index), r1 - r0 + extra, dtype=torch.float32, device=device, pin_memory=pinned)
    # Ages of the rows the piece touches, like the variance (pieces of a row age alike).
    age = torch.zeros(len(index), r1 - r0, dtype=torch.float32, device=device, pin_memory=pinned) if sg.hp.staleness else None
    sub = SubBatch(
        index,
        sharding,
        momentum[:, :rows],
        variance[:, : r1 - r0],
        age,
        [sharding.rects(q, n, m)[0] for q in range(sg.world)],
        [sharding.row_span(q, n, m)[0] for q in range(sg.world)],
        # Column blocks all touch every row: rank 0 sends their variances. Row blocks their own.
        [sharding.kind != "cols" or q == 0 for q in range(sg.world)],
        momentum_padded=momentum,
        variance_padded=variance,
    )
    sub.state_views = {"momentum": list(sub.momentum), "variance": list(sub.variance)}
    if age is not None:
        sub.state_views["row_age"] = list(age)
    if dtype != torch.float32:  # each matrix's count of steps, which the rounding's noise is hashed from
        steps = torch.zeros(len(index), dtype=torch.int64, device=device, pin_memory=pinned)
        names = [sg.shards[j].name for j in index]  # (the seeds are constants: where the step runs)
        seeds = torch.tensor(
            [bf16_rounding.matrix_seed(name) for name in names], dtype=torch.int64, device=sg.offload or first.weight.device
        )
        sub.rounding = Rounding(seeds, steps, m, sub.rect[sg.rank].r0, sub.rect[sg.rank].c0)
        sub.state_views["rounding_step"] = list(steps)
    for b, j in enumerate(index):
        for key, views in sub.state_views.items():
            given = sg.shards[j].state.get(key)
            if given is not None and given.data_ptr() != views[b].data_ptr():  # state given by the caller
                views[b].copy_(given)
            sg.shards[j].state[key] = views[b]
        if sub.rounding is None:  # a count carried from a bf16 momentum, now fp32: nothing reads it
            sg.shards[j].state.pop("rounding_step", None)
    return sub
