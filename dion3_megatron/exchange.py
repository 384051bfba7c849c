"""Exchanges: how one shape group's selected rows reach the ranks that orthogonalize them, and
come back. The engine (:mod:`dion3_megatron.megabatch`) picks one per group (:func:`exchange_for`):

* :class:`WholeExchange`: matrices this rank holds whole. No exchange: scored, selected,
  orthogonalized and updated on the device (:func:`step_whole_matrices`, which the single-process
  optimizer and the ZeRO adapter call too).
* :class:`StaticExchange`: row or column blocks with message sizes known in advance: every rank
  sends its pieces of all k selected rows of each matrix, no host wait (CUDA-graphable).
* :class:`PlannedExchange`: row or column blocks; who holds which selected rows is planned on the
  host, and only those rows travel.
* :class:`GeneralExchange`: any pieces (ZeRO flat slices, ZeRO slices of tensor-parallel blocks),
  planned on the host.

The three with owners (matrix j -> rank j mod W) share :meth:`Exchange.round_trip`, the megabatch
itself: ONE all-to-all assembles each owner's blocks, the owner orthogonalizes and normalizes them
as one batch, ONE all-to-all returns every rank its pieces. All math is in :mod:`dion3_megatron.rule`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist

from . import cuda_graph as cuda_graph_module, rule
from .plan import Rect, ShapeGroup, Sharding, init_state
from .rule import Dion3Hyperparameters


# --------------------------------------------------------------------------------------------
# The whole-matrix step: matrices one process holds whole (the single-process optimizer, the
# engine's one-rank groups, the matrices a ZeRO rank holds whole) need no exchange.


@dataclass
class WholeMatrices:
    """A batch of B same-shape whole matrices one process steps by itself (any views; the state
    is written in place)."""

    weight: torch.Tensor | list[torch.Tensor]  # (B, n, c), or B separate (n, c) tensors
    momentum: torch.Tensor  # (B, n, c) fp32
    variance: torch.Tensor  # (B, n) fp32
    hp: Dion3Hyperparameters  # the batch's settings, fraction already a number
    grads: Optional[list[torch.Tensor]] = None  # B (n, c), added to the momentum by the step
    scores: Optional[torch.Tensor] = None  # else the momentum's (B, n) row scores (accumulate_and_score) or None
    hps: Optional[list[Dion3Hyperparameters]] = None  # each matrix's own lr, weight decay, mu (default: hp)
    mu: Optional[float | torch.Tensor] = None  # the applied rows' decay, or (B,) on the device; default: hp's
    factors: Optional[rule.UpdateFactors] = None  # default: from hps
    age: Optional[torch.Tensor] = None  # (B, n) steps since each row was applied: needed when hp.staleness
    # the caller's accumulation left the momentum decayed (rule.folded_decay): the step, which
    # selects every row, orthogonalizes it as it is and does not decay it again
    momentum_decayed: bool = False

    def __post_init__(self) -> None:
        if self.hps is not None and self.mu is None:  # their mus may differ: the caller keeps the device copy
            raise ValueError("WholeMatrices with per-matrix settings (hps) needs their mu")

    @property
    def count(self) -> int:
        return len(self.weight) if isinstance(self.weight, (list, tuple)) else self.weight.shape[0]

    def settings(self) -> list[Dion3Hyperparameters]:
        return self.hps if self.hps is not None else [self.hp] * self.count

    def graph_key(self) -> tuple:
        """What a captured step of this batch bakes in: buffers, weights, gradients, settings."""
        weights = tuple(w.data_ptr() for w in self.weight) if isinstance(self.weight, (list, tuple)) \
            else self.weight.data_ptr()
        return (self.momentum.data_ptr(), tuple(self.momentum.shape), self.variance.data_ptr(),
                tuple(self.variance.stride()), weights,
                tuple(g.data_ptr() for g in self.grads) if self.grads is not None else None,
                self.scores.data_ptr() if self.scores is not None else None,
                self.age.data_ptr() if self.age is not None else None, self.momentum_decayed,
                cuda_graph_module.baked_settings(self.hp),
                tuple(cuda_graph_module.baked_settings(hp) for hp in self.hps) if self.hps is not None else None)


def step_whole_matrices(entries: list[WholeMatrices], graph: Optional[cuda_graph_module.StepGraph] = None,
                        then: Optional[Callable[[], None]] = None) -> None:
    """The Dion3 step of whole matrices on one process, then ``then()`` (more device work on the
    same tensors). Selected blocks of one shape are orthogonalized as one batch.

    With ``graph``, and every entry on one CUDA device, the step replays from it (captured at its
    third call with these tensors and settings; lr and weight decay reach it as factors). Gradients
    given as ``grads`` are added inside the graph: a caller whose gradients are new tensors every
    step adds them first (:func:`rule.accumulate_and_score`) and passes the ``scores``.
    """
    device = entries[0].momentum.device if entries else None
    if graph is None or not entries or any(e.momentum.device != device for e in entries) \
            or not cuda_graph_module.usable(device):
        _step_whole_eager(entries)
        if then is not None:
            then()
        return
    factors = [e.factors if e.factors is not None else _whole_factors(e) for e in entries]

    def step(graph_factors: list[rule.UpdateFactors]) -> None:
        _step_whole_eager([dataclasses.replace(e, factors=f) for e, f in zip(entries, graph_factors)])
        if then is not None:
            then()

    graph.run_with_factors((then is not None, tuple(e.graph_key() for e in entries)), step, factors, device)


def _whole_factors(e: WholeMatrices) -> rule.UpdateFactors:
    return rule.update_factors(e.settings(), e.hp.fraction, *e.momentum.shape[1:])


def _step_whole_eager(entries: list[WholeMatrices]) -> None:
    batches: dict[tuple, list] = {}
    for e in entries:
        hp = e.hp
        decayed = e.momentum_decayed
        if e.grads is not None:
            decay = rule.folded_decay(hp, e.momentum.shape[1], e.mu)
            scores = rule.accumulate_and_score(e.momentum, e.grads, out=e.scores, decay=decay)
            decayed = decay is not None
        else:
            scores = e.scores if e.scores is not None else rule.row_scores(e.momentum)
        if hp.staleness:
            scores = rule.staleness_boost(scores, e.age, hp.staleness, hp.fraction)
        idx = rule.select_rows(scores, hp.fraction, hp.num_heads)
        if hp.staleness:
            rule.age_rows(e.age, idx)
        mu = e.mu if e.mu is not None else rule.momentum_decay(hp, hp.fraction)
        # every row selected (f = 1): the momentum itself is orthogonalized, its rows not copied out
        # first; it decays after, unless its accumulation already did (rule.folded_decay)
        every_row = idx.shape[1] == e.momentum.shape[1]
        if decayed and not every_row:
            raise RuntimeError("the momentum came decayed for a step that does not select every row")
        selected = e.momentum if every_row else rule.take_selected(e.momentum, idx, mu)
        key = (tuple(selected.shape[1:]), selected.device, hp.ns_method, hp.ns_dtype)
        batches.setdefault(key, []).append((e, idx, selected, mu if every_row and not decayed else None))
    for batch in batches.values():
        stacked = torch.cat([b[2] for b in batch]) if len(batch) > 1 else batch[0][2]
        ortho = rule.orthogonalize_rows(stacked, batch[0][0].hp).split([b[2].shape[0] for b in batch])
        for (e, idx, _, later_mu), block in zip(batch, ortho):
            if later_mu is not None:  # the orthogonalization has read it
                rule.decay_momentum(e.momentum, later_mu)
            weights = list(e.weight.unbind(0)) if torch.is_tensor(e.weight) else list(e.weight)
            factors = e.factors if e.factors is not None else _whole_factors(e)
            rule.normalize_and_apply(weights, e.variance, idx, block, e.hp.beta2, e.hp.eps, factors)


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


@dataclass(eq=False)
class _SubBatch:
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
    state_views: dict = field(default_factory=dict)  # "momentum"/"variance"/"row_age" -> the views the shards hold
    route: Optional["_Route"] = None
    mus: list = field(default_factory=list)  # per-matrix mu when they differ, and its device copy
    mu_on_device: Optional[torch.Tensor] = None


def _sub_batch_mu(sg: ShapeGroup, sub: _SubBatch, device: torch.device) -> float | torch.Tensor:
    """The sub-batch's mu (:func:`rule.momentum_decays`): one number when its matrices share it
    (no host-to-device copy), else (B,) on the device."""
    mus = rule.momentum_decays([sg.shards[j].hp for j in sub.index], sg.fraction)
    if not isinstance(mus, list):
        return mus
    if sub.mus != mus:  # uploaded once, not per step (nor inside a CUDA graph capture)
        sub.mus, sub.mu_on_device = mus, torch.tensor(mus, device=device)
    return sub.mu_on_device


def _group_hp(sg: ShapeGroup) -> Dion3Hyperparameters:
    """The group's settings with its fraction resolved (a number where the option is "auto")."""
    return sg.hp if sg.hp.fraction == sg.fraction else dataclasses.replace(sg.hp, fraction=sg.fraction)


def _folded_decay(sg: ShapeGroup, mu: float | torch.Tensor) -> Optional[float]:
    """:func:`rule.folded_decay` for a group's matrices: the decay their accumulation takes when the
    step selects every row, as the single process's does (so both orthogonalize mu * (M + G))."""
    return rule.folded_decay(_group_hp(sg), sg.key.shape[0], mu)


def _take_decay(sg: ShapeGroup, mu: float | torch.Tensor) -> float | torch.Tensor:
    """The decay the selected rows take as they are copied out: mu, or 1 where the accumulation
    has already decayed them (:func:`_folded_decay`)."""
    return 1.0 if _folded_decay(sg, mu) is not None else mu


@dataclass(eq=False)
class _Route:
    """Where a sub-batch's matrices go in the static exchange (fixed for the plan's life):
    ``order`` lists its matrices by owner rank, ``per_dest[d]`` how many rank d owns, and
    ``owned_pos`` the block position (j // world) of each matrix this rank owns, in that order."""

    order: torch.Tensor
    per_dest: list[int]
    owned_pos: torch.Tensor

    @staticmethod
    def build(sg: ShapeGroup, sub: "_SubBatch", device: torch.device) -> "_Route":
        by_dest = [[b for b, j in enumerate(sub.index) if sg.owner(j) == d] for d in range(sg.world)]
        order = [b for bs in by_dest for b in bs]
        owned = [sub.index[b] // sg.world for b in by_dest[sg.rank]]
        return _Route(torch.tensor(order, dtype=torch.long, device=device), [len(bs) for bs in by_dest],
                      torch.tensor(owned, dtype=torch.long, device=device))


def _update_factors(sg: ShapeGroup, index: list[int]) -> rule.UpdateFactors:
    """The weight-update factors of matrices ``index`` of the group (each its own lr, weight decay)."""
    return rule.update_factors([sg.shards[j].hp for j in index], sg.fraction, *sg.key.shape)


STATIC_ROW_BLOCKS_MAX_WORLD = 2  # row blocks send world x the rows they hold on the static exchange


def _static_exchange(sg: ShapeGroup) -> bool:
    """Whether a group of row or column blocks over several ranks takes the static exchange.
    Column blocks always do (they hold every row: nothing is padded). Row blocks send all k rows
    per matrix, zeros for the rows held elsewhere: world times the traffic of the host-planned
    exchange, which sends only the rows each rank holds. They take it on 2 ranks (twice the
    traffic of a few-MB exchange against a host wait) while k * world <= rows (the padded rows
    stay within the group's own momentum)."""
    n = sg.key.shape[0]
    if all(s.sharding.kind == "cols" for s in sg.shards):
        return True
    k = rule.selected_row_count(n, sg.fraction, sg.hp.num_heads)
    return sg.world <= STATIC_ROW_BLOCKS_MAX_WORLD and k * sg.world <= n


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

    def all_reduce(self, flat: torch.Tensor, group: dist.ProcessGroup) -> None:
        self.collectives.append("all_reduce")
        dist.all_reduce(flat, group=group)

    def all_to_all(self, send: torch.Tensor, send_sizes: list[int], recv_sizes: list[int],
                   sg: ShapeGroup) -> torch.Tensor:
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
            raise ValueError(f"Dion3 engine: staleness changed from {built!r} to {now!r} since the engine was built "
                             f"({self.sg.shards[0].name}); build a new engine (the front ends do so)")

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

    def round_trip(self, send_parts: list[list[torch.Tensor]], recv_sizes: list[int],
                   assemble: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]], back_sizes: list[int],
                   pack: Callable[[torch.Tensor, torch.Tensor], list[torch.Tensor]],
                   result_sizes: list[int]) -> torch.Tensor:
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


def exchange_for(sg: ShapeGroup, traffic: Traffic) -> Exchange:
    """The exchange a group takes: whole on one rank, else by how its matrices are split."""
    if not sg.blockwise:
        return GeneralExchange(sg, traffic)
    if sg.world == 1:
        return WholeExchange(sg, traffic)
    return (StaticExchange if _static_exchange(sg) else PlannedExchange)(sg, traffic)


class _BlockExchange(Exchange):
    """Whole matrices or row or column blocks: the group's state lives in one buffer per sharding
    (a :class:`_SubBatch`), so its steps run as batched ops."""

    padded = False  # row blocks keep one extra zero row (the static exchange)

    def __init__(self, sg: ShapeGroup, traffic: Traffic) -> None:
        super().__init__(sg, traffic)
        self.subs = _allocate_group_state(sg, self.padded)

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
            decay = _folded_decay(sg, _sub_batch_mu(sg, sub, device))
            block = rule.accumulate_and_score(sub.momentum, [sg.shards[j].grad.view(sub.momentum.shape[1:])
                                                             for j in sub.index], decay=decay)
            if sub.age is not None:
                block = rule.staleness_boost(block, sub.age, sg.hp.staleness, sg.fraction)
            mine = sub.rect[sg.rank]
            if sub.index_on_device is None:
                sub.index_on_device = torch.tensor(sub.index, device=device)
            scores[sub.index_on_device, mine.r0 : mine.r1] = block
        return scores

    def age(self, chosen: torch.Tensor) -> None:
        for sub in self.subs:
            rule.age_piece_rows(sub.age, chosen[sub.index_on_device], sub.span0[self.sg.rank])

    def factors(self) -> list[rule.UpdateFactors]:
        """The weight-update factors the step takes, as numbers (a graph refreshes them each replay)."""
        return [_update_factors(self.sg, [j for sub in self.subs for j in sub.index])]

    def graph_key(self) -> tuple:
        """What a captured step of the group bakes in: buffers, weights, gradients, settings."""
        sg = self.sg
        return tuple(
            (sub.momentum_padded.data_ptr(), sub.variance_padded.data_ptr(), tuple(sub.momentum_padded.shape),
             sub.age.data_ptr() if sub.age is not None else None,
             sg.key, sg.fraction,
             tuple((sg.shards[j].weight.data_ptr(), sg.shards[j].grad.data_ptr(),
                    cuda_graph_module.baked_settings(sg.shards[j].hp)) for j in sub.index))
            for sub in self.subs
        )

    def _split_returned(self, result: torch.Tensor, rows_from: Callable[["_SubBatch", int], int]):
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
        return ({key: torch.cat(parts) for key, parts in steps.items()},
                {key: torch.cat(parts) for key, parts in variances.items()})

    def _pack(self, rows_of: Callable[["_SubBatch", int], tuple]):
        """Owner side: per rank q and part, q's columns of the rows ``rows_of(sub, q)`` indexes
        (block positions, rows within the blocks) and their new variances."""
        def pack(normalized: torch.Tensor, new_variance: torch.Tensor) -> list[torch.Tensor]:
            parts = []
            for q in range(self.sg.world):
                for sub in self.subs:
                    rows = rows_of(sub, q)
                    parts += [normalized[(*rows, slice(sub.rect[q].c0, sub.rect[q].c1))].reshape(-1),
                              new_variance[rows].reshape(-1)]
            return parts
        return pack


class WholeExchange(_BlockExchange):
    """Matrices this rank holds whole: no exchange, no host round trip. All such groups of an
    engine step together (:meth:`step_all`), so same-shape blocks share one orthogonalization and
    one CUDA graph replays them."""

    host_rows = False
    static = True

    def factors(self) -> list[rule.UpdateFactors]:
        return [_update_factors(self.sg, sub.index) for sub in self.subs]

    def entries(self, factors: Optional[list[rule.UpdateFactors]] = None) -> list[WholeMatrices]:
        """The group's sub-batches as :class:`WholeMatrices`, each matrix with its own settings
        (``factors`` as device tensors inside a graph of the engine's whole step)."""
        sg = self.sg
        n, m = sg.key.shape
        hp = _group_hp(sg)
        return [WholeMatrices([sg.shards[j].weight.view(n, m) for j in sub.index], sub.momentum, sub.variance, hp,
                              grads=[sg.shards[j].grad.view(n, m) for j in sub.index],
                              hps=[sg.shards[j].hp for j in sub.index], mu=_sub_batch_mu(sg, sub, sub.momentum.device),
                              factors=factors[p] if factors is not None else None, age=sub.age)
                for p, sub in enumerate(self.subs)]

    @staticmethod
    def step_all(exchanges: list["WholeExchange"], graph: Optional[cuda_graph_module.StepGraph],
                 factors: Optional[list[rule.UpdateFactors]] = None) -> None:
        """Accumulate, score, select, orthogonalize and update every group of ``exchanges``."""
        entries, start = [], 0
        for ex in exchanges:
            count = len(ex.subs)
            entries += ex.entries(factors[start : start + count] if factors is not None else None)
            start += count
        step_whole_matrices(entries, graph)


class StaticExchange(_BlockExchange):
    """Row or column blocks, with sizes known in advance: no host wait.

    Every rank sends, for each matrix, its pieces of all k selected rows to the owner: a column
    block holds every row; a row block sends zeros (its padded row) for rows another rank holds.
    Owners add the pieces up (each element comes from exactly one rank, the rest are zeros, so the
    sum is exact), orthogonalize, and return to every rank its columns of all k rows; a row block
    applies only the rows it holds.
    """

    host_rows = False
    static = True
    padded = True

    def step(self, chosen: torch.Tensor, factors: Optional[rule.UpdateFactors] = None) -> None:
        """``chosen`` (B, k) on the device; ``factors`` of the sub-batches' matrices in order, as
        device tensors (from the group's settings when not given)."""
        sg, subs = self.sg, self.subs
        m = sg.key.shape[1]
        world, me = sg.world, sg.rank
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
            pieces = rule.take_selected(sub.momentum_padded, local, _take_decay(sg, _sub_batch_mu(sg, sub, device)))
            variances = torch.gather(sub.variance_padded, 1, local)
            if mask is not None:
                variances = variances * mask
            held[id(sub)] = (local, mask)
            pieces, variances = pieces[sub.route.order], variances[sub.route.order]
            for d, (piece, v) in enumerate(zip(pieces.split(sub.route.per_dest), variances.split(sub.route.per_dest))):
                send_parts[d] += [piece.reshape(-1)] + ([v.reshape(-1)] if sub.provides[me] else [])
        width = {id(sub): [r.c1 - r.c0 for r in sub.rect] for sub in subs}
        recv_sizes = [sum(sub.route.per_dest[me] * k * (width[id(sub)][q] + sub.provides[q]) for sub in subs)
                      for q in range(world)]

        def assemble(recv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            """Add up the pieces of each owned matrix's k rows."""
            owned = len(self.owned())
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
            return blocks, block_variances

        back_sizes = [sum(sub.route.per_dest[me] * k * (width[id(sub)][q] + 1) for sub in subs) for q in range(world)]
        result_sizes = [sum(sub.route.per_dest[d] * k * (width[id(sub)][me] + 1) for sub in subs) for d in range(world)]
        result = self.round_trip(send_parts, recv_sizes, assemble, back_sizes,
                                 self._pack(lambda sub, q: (sub.route.owned_pos, slice(None))), result_sizes)

        # Apply: each owner's results, per part, in route order; row blocks keep the rows they hold.
        steps, new_variances = self._split_returned(result, lambda sub, d: sub.route.per_dest[d] * k)
        if factors is None:
            factors = self.factors()[0].on_device(device)
        start = 0
        for sub in subs:
            local, mask = held[id(sub)]
            in_order = torch.empty(len(sub.index), k, width[id(sub)][me], dtype=torch.float32, device=device)
            in_order.index_copy_(0, sub.route.order, steps[id(sub)].view(-1, k, width[id(sub)][me]))
            variance_in_order = torch.empty(len(sub.index), k, dtype=torch.float32, device=device)
            variance_in_order.index_copy_(0, sub.route.order, new_variances[id(sub)].view(-1, k))
            sub.variance_padded.scatter_(1, local, variance_in_order)  # rows held elsewhere land in the pad
            weights = [sg.shards[j].weight.view(sub.momentum.shape[1:]) for j in sub.index]
            part = factors.part(start, start + len(sub.index))
            coef = part.coef.view(-1, 1).expand(local.shape).to(torch.float32)
            rule.apply_rows(weights, local, in_order, coef, part.shrink,
                            padded=mask is not None)  # rows held elsewhere are skipped
            start += len(sub.index)


@dataclass(eq=False)
class _HeldRows:
    """Who holds which selected rows of one sub-batch in one step of the planned exchange."""

    counts: list[list[int]]  # counts[q][b]: selected rows of matrix b that rank q holds
    owner_major: list[int]  # the sub-batch's matrices in owner order (how this rank sends them)
    owned: list[int]  # the matrices this rank owns
    batch: torch.Tensor  # per row this rank sends: its matrix (position in the sub-batch)
    local_rows: torch.Tensor  # ... its row in this rank's block
    variance_rows: torch.Tensor  # ... its row among those this rank keeps a variance for
    owner_index: dict  # q -> (block positions, rows within the blocks) of what rank q sends this owner
    per_dest: list[int] = field(default_factory=list)  # rows this rank sends each owner


class PlannedExchange(_BlockExchange):
    """Row or column blocks; who holds which selected rows is worked out on the host from the
    chosen rows, and only the rows each rank holds travel."""

    def _held_rows(self, chosen: torch.Tensor, device: torch.device) -> dict[int, _HeldRows]:
        """From the chosen rows (B, k) on the host; the index tensors travel in one copy."""
        world, me = self.sg.world, self.sg.rank
        host: dict[tuple, torch.Tensor] = {}
        plans = []
        for p, sub in enumerate(self.subs):
            picked = chosen[sub.index]
            holds = torch.stack([(picked >= r.r0) & (picked < r.r1) for r in sub.rect])  # (W, b, k): q holds b's i-th
            owner_major = [b for d in range(world) for b, j in enumerate(sub.index) if j % world == d]
            owned = [b for b, j in enumerate(sub.index) if j % world == me]
            order = torch.tensor(owner_major, dtype=torch.long)
            bi, si = holds[me][order].nonzero(as_tuple=True)
            rows = picked[order[bi], si]
            host[p, "bi"], host[p, "local"], host[p, "var"] = order[bi], rows - sub.rect[me].r0, rows - sub.span0[me]
            position = torch.tensor([sub.index[b] // world for b in owned], dtype=torch.long)
            for q in range(world):
                obi, osi = holds[q][owned].nonzero(as_tuple=True)
                host[p, "pos", q], host[p, "si", q] = position[obi], osi
            plans.append((holds.sum(-1).tolist(), owner_major, owned))
        on_device = _to_device(host, device)
        held = {}
        for p, (sub, (counts, owner_major, owned)) in enumerate(zip(self.subs, plans)):
            held[id(sub)] = _HeldRows(
                counts, owner_major, owned, on_device[p, "bi"], on_device[p, "local"], on_device[p, "var"],
                {q: (on_device[p, "pos", q], on_device[p, "si", q]) for q in range(world)},
                [sum(counts[me][b] for b, j in enumerate(sub.index) if j % world == d) for d in range(world)])
        return held

    def step(self, chosen: torch.Tensor, factors: Optional[rule.UpdateFactors] = None) -> None:
        """``chosen`` (B, k) on the host; the factors are taken from the group's settings."""
        sg, subs = self.sg, self.subs
        m = sg.key.shape[1]
        world, me, shards = sg.world, sg.rank, sg.shards
        device = subs[0].momentum.device
        k = chosen.shape[1]
        held = self._held_rows(chosen, device)

        # Forward: to each owner, per part, my pieces of its matrices' selected rows, then variances.
        send_parts: list[list[torch.Tensor]] = [[] for _ in range(world)]
        for sub in subs:
            h = held[id(sub)]
            pieces = rule.take_rows(sub.momentum, h.local_rows, _take_decay(sg, _sub_batch_mu(sg, sub, device)), h.batch)
            variances = sub.variance[h.batch, h.variance_rows]
            for d, (piece, v) in enumerate(zip(pieces.split(h.per_dest), variances.split(h.per_dest))):
                send_parts[d] += [piece.reshape(-1)] + ([v] if sub.provides[me] else [])

        def from_rank(sub: _SubBatch, q: int, extra: int) -> int:
            """Values rank q sends this owner for the sub-batch: its row pieces plus ``extra`` per row."""
            h = held[id(sub)]
            return sum(h.counts[q][b] for b in h.owned) * (sub.rect[q].c1 - sub.rect[q].c0 + extra)

        recv_sizes = [sum(from_rank(sub, q, sub.provides[q]) for sub in subs) for q in range(world)]

        def assemble(recv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            """Whole blocks of all owned matrices from the pieces every rank sent."""
            owned = len(self.owned())
            blocks = self.traffic.buffer(owned * k * m, device).view(owned, k, m)
            block_variances = torch.empty(owned, k, dtype=torch.float32, device=device)
            offset = 0
            for q in range(world):
                for sub in subs:
                    pos, si = held[id(sub)].owner_index[q]
                    r = sub.rect[q]
                    count = pos.numel()
                    blocks[pos, si, r.c0 : r.c1] = recv[offset : offset + count * (r.c1 - r.c0)].view(count, r.c1 - r.c0)
                    offset += count * (r.c1 - r.c0)
                    if sub.provides[q]:
                        block_variances[pos, si] = recv[offset : offset + count]
                        offset += count
            return blocks, block_variances

        back_sizes = [sum(from_rank(sub, q, 1) for sub in subs) for q in range(world)]
        result_sizes = [sum(held[id(sub)].per_dest[d] * (sub.rect[me].c1 - sub.rect[me].c0 + 1) for sub in subs)
                        for d in range(world)]
        result = self.round_trip(send_parts, recv_sizes, assemble, back_sizes,
                                 self._pack(lambda sub, q: held[id(sub)].owner_index[q]), result_sizes)

        # Apply: results arrive per owner, per part, in the order this rank sent its pieces.
        steps, new_variances = self._split_returned(result, lambda sub, d: held[id(sub)].per_dest[d])
        weights, rows, updates, order = [], [], [], []
        for sub in subs:
            h = held[id(sub)]
            sub.variance[h.batch, h.variance_rows] = new_variances[id(sub)]
            sub_steps = steps[id(sub)]
            start = 0
            for b in h.owner_major:
                count = h.counts[me][b]
                weights.append(shards[sub.index[b]].weight.view(sub.momentum.shape[1:]))
                rows.append(h.local_rows[start : start + count])
                updates.append(sub_steps[start : start + count])
                order.append(sub.index[b])
                start += count
        factors = _update_factors(sg, order)
        rule.apply_rows(weights, rows, updates, factors.coef, factors.shrink)


class GeneralExchange(Exchange):
    """Any pieces (ZeRO flat slices, and ZeRO slices of tensor-parallel blocks), each shard with its
    own state. Who holds which selected rows is worked out on the host from one copy of the chosen
    rows, and every index tensor of the step travels to the device in one copy: no per-matrix syncs.
    """

    def __init__(self, sg: ShapeGroup, traffic: Traffic) -> None:
        super().__init__(sg, traffic)
        for shard in sg.shards:
            init_state(shard, sg.rank)

    def score(self) -> torch.Tensor:
        sg = self.sg
        rule.accumulate([shard.state["momentum"] for shard in sg.shards], [shard.grad for shard in sg.shards])
        scores = torch.zeros(len(sg.shards), sg.key.shape[0], dtype=torch.float32, device=sg.shards[0].weight.device)
        for j, shard in enumerate(sg.shards):
            for rect in sg.rects[j][sg.rank]:
                scores[j, rect.r0 : rect.r1] += rule.row_scores(rect.view(shard.state["momentum"])[None])[0]
            decay = _folded_decay(sg, rule.momentum_decay(shard.hp, sg.fraction))
            if decay is not None:  # as rule.accumulate_and_score folds it
                shard.state["momentum"].mul_(decay)
            if sg.hp.staleness:
                r0, r1 = sg.spans[j][sg.rank]
                scores[j, r0:r1] = rule.staleness_boost(scores[j, r0:r1], shard.state["row_age"], sg.hp.staleness,
                                                        sg.fraction)
        return scores

    def age(self, chosen: torch.Tensor) -> None:
        for j, shard in enumerate(self.sg.shards):
            rule.age_piece_rows(shard.state["row_age"][None], chosen[j : j + 1], self.sg.spans[j][self.sg.rank][0])

    def step(self, chosen: torch.Tensor, factors: Optional[rule.UpdateFactors] = None) -> None:
        """``chosen`` (B, k) on the host; the factors are taken from the group's settings."""
        sg = self.sg
        m = sg.key.shape[1]
        world, me, shards = sg.world, sg.rank, sg.shards
        device = shards[0].weight.device
        rects = sg.rects
        layout = _GeneralLayout(sg, chosen, device)
        layout.finalize()

        # Forward: for each matrix, to its owner: the variances I provide, then my row pieces.
        send_parts: list[list[torch.Tensor]] = [[] for _ in range(world)]
        for j, shard in enumerate(shards):
            owner = sg.owner(j)
            momentum = shard.state["momentum"]
            send_parts[owner].append(shard.state["variance"][layout.provided_rows(j)])
            for t, rect in enumerate(rects[j][me]):
                piece = rule.take_rows(rect.view(momentum), layout.rect_rows(j, t),
                                       _take_decay(sg, rule.momentum_decay(shard.hp, sg.fraction)))
                send_parts[owner].append(piece.reshape(-1))
        recv_sizes = [layout.forward_size(q) for q in range(world)]
        owned = self.owned()
        k = layout.k

        def assemble(recv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            """Whole blocks of all owned matrices from the pieces every rank sent."""
            blocks = self.traffic.buffer(len(owned) * k * m, device).view(len(owned), k, m)
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
            return blocks, variances

        def pack(normalized: torch.Tensor, new_variance: torch.Tensor) -> list[torch.Tensor]:
            parts = []
            for q in range(world):
                for b, j in enumerate(owned):
                    parts.append(new_variance[b, layout.span_positions(j, q)])
                    for t, rect in enumerate(rects[j][q]):
                        parts.append(normalized[b, layout.block_positions(j, q, t), rect.c0 : rect.c1].reshape(-1))
            return parts

        back_sizes = [layout.backward_size(q, sender=me) for q in range(world)]
        result_sizes = [layout.backward_size(me, sender=q) for q in range(world)]
        result = self.round_trip(send_parts, recv_sizes, assemble, back_sizes, pack, result_sizes)

        # Apply: results come owner by owner, matrix by matrix, in the order sent.
        offsets = [sum(result_sizes[:q]) for q in range(world)]
        factors = _update_factors(sg, list(range(len(shards))))
        weights, rows_of, steps, coefs, shrinks = [], [], [], [], []
        for j, shard in enumerate(shards):
            q = sg.owner(j)
            rows = layout.span_rows(j)
            shard.state["variance"][rows] = result[offsets[q] : offsets[q] + rows.numel()]
            offsets[q] += rows.numel()
            for t, rect in enumerate(rects[j][me]):
                local = layout.rect_rows(j, t)
                count, width = local.numel(), rect.c1 - rect.c0
                weights.append(rect.view(shard.weight))
                rows_of.append(local)
                steps.append(result[offsets[q] : offsets[q] + count * width].view(count, width))
                coefs.append(factors.coef[j])
                shrinks.append(factors.shrink[j])
                offsets[q] += count * width
        rule.apply_rows(weights, rows_of, steps, coefs, shrinks)


def _allocate_group_state(sg: ShapeGroup, padded: bool) -> list[_SubBatch]:
    """Split the group by sharding; each part keeps its momentum, variance (and with staleness the
    rows' ages) in one buffer each (row blocks with one extra zero row when ``padded``, for the
    static exchange). State a caller gave (a resumed checkpoint) is copied in; the shards' state
    becomes views of the buffers."""
    n, m = sg.key.shape
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
        # Ages of the rows the piece touches, like the variance (pieces of a row age alike).
        age = torch.zeros(len(index), r1 - r0, dtype=torch.float32, device=device) if sg.hp.staleness else None
        sub = _SubBatch(
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
        for b, j in enumerate(index):
            for key, views in sub.state_views.items():
                if key in sg.shards[j].state:  # state given by the caller (a resumed checkpoint)
                    views[b].copy_(sg.shards[j].state[key])
                sg.shards[j].state[key] = views[b]
        subs.append(sub)
    return subs


class _GeneralLayout:
    """Host-side bookkeeping of one general-path step: which selected rows each rank holds, from
    the chosen rows (on the host). Index tensors are built on the host and moved to the device
    together in :meth:`finalize`.
    """

    def __init__(self, sg: ShapeGroup, chosen: torch.Tensor, device: torch.device) -> None:
        self.sg, self.rects, self.spans, self.chosen, self.device = sg, sg.rects, sg.spans, chosen, device
        self.k = chosen.shape[1]
        self._device: dict[tuple, torch.Tensor] = {}
        self._cache: dict[tuple, torch.Tensor] = {}

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
        rect = self.rects[j][q][t]
        return self._in(j, rect.r0, rect.r1)

    def _span_positions_host(self, j: int, q: int) -> torch.Tensor:
        return self._in(j, *self.spans[j][q])

    def finalize(self) -> None:
        """Build every index set of the step and move them to the device in one copy."""
        sg, me = self.sg, self.sg.rank
        wanted: dict[tuple, torch.Tensor] = {}
        for j in range(len(sg.shards)):
            r0 = self.spans[j][me][0]
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
