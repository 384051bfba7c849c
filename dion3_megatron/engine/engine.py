"""Megabatching: one Dion3 step for sharded matrices, a constant number of collectives per shape.

Every matrix the step touches is grouped by logical shape (and the settings that must agree for
one batched orthogonalization: :mod:`.plan`). Over a process group of W ranks:

1. row scores where the rows live (partial L1 norms of column pieces add up): ONE all-reduce for
   all shape groups, then one copy of the chosen rows to the host for the groups planned there;
   per shape group, through its exchange (:func:`exchange_for`; :mod:`.exchange`):
2. the same top-k rows chosen on every rank; each rank packs its pieces of the selected rows
   (and the row variances it keeps) for the owner of each matrix (matrix j -> rank j mod W):
   ONE all-to-all assembles whole k x n_cols blocks on the owners;
3. the owner orthogonalizes all its blocks as one batch and normalizes them (:mod:`..core.rule`);
4. ONE all-to-all sends every rank its pieces of the result, and each applies the update.

Only selected rows travel, so traffic also shrinks with the fraction f. All math is in :mod:`..core`;
the engine and its exchanges move tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Hashable, Mapping, Optional

import torch
import torch.distributed as dist

from ..core import rule
from . import cuda_graph as cuda_graph_module
from .exchange import Exchange, Traffic
from .general import GeneralExchange
from .local import WholeExchange
from .fractions import AgreedSpeeds
from .offload import Streamer, travellers
from .plan import ShapeGroup, build_plan, check_plan_matches, chosen_fractions, chooses_fraction, group_ranks, resolve_fractions
from .planned import PlannedExchange
from .sharding import MatrixShard
from .static import StaticExchange, static_exchange


def exchange_for(sg: ShapeGroup, traffic: Traffic, momentum_in_place: bool = False) -> Exchange:
    """The exchange a group takes: whole on one rank, else by how its matrices are split."""
    if not sg.blockwise:
        return GeneralExchange(sg, traffic)
    if sg.world == 1:
        return WholeExchange(sg, traffic, momentum_in_place)
    return (StaticExchange if static_exchange(sg) else PlannedExchange)(sg, traffic)


@dataclass(eq=False)
class _PendingStep:
    """Between Dion3Engine.start_step and finish_step."""

    chosen: dict  # group index -> (B, k) rows: on the device, on the host once finish_step has them
    host_rows: list[int]  # groups whose rows travel to the host
    host: Optional[torch.Tensor] = None
    rows: Optional[torch.Tensor] = None
    copied: Optional[torch.cuda.Event] = None


class Dion3Engine:
    """Steps a list of :class:`MatrixShard` with Dion3, a constant number of collectives per shape.

    Rows are selected over the whole logical matrix, so a step equals the single-process
    optimizer's at any world size. Each shape group steps through one :class:`~.exchange.Exchange`.
    check_group: ranks that construct their engines together (default: the world), containing
    every process group the shards span; construction is collective over it, as the plan is
    checked on it (:func:`~.plan.check_plan_matches`). step_share: the share of the model's
    matrices this rank steps (for the automatic f: :func:`~dion3_megatron.core.cost_model.modelled_loss_change`).

    local: every shard is whole and construction makes no collective (the torch optimizer: its
    replicas agree on ``speeds`` themselves, :class:`~.fractions.AgreedSpeeds`). fresh_grads: the
    gradients are new tensors every step (``p.grad`` after ``zero_grad()``, a ZeRO partition), so
    the whole matrices add them to the momentum before the step's CUDA graph, which then replays
    whatever their addresses. chosen: the automatic f chosen before, by matrix name
    (:func:`~.plan.resolve_fractions`; :meth:`chosen_fractions` is the record to keep).
    momentum_in_place: the momentum the shards held whole come with is their storage (a ZeRO
    slice's ``exp_avg``): stepped where it lies, not copied into the engine's buffers
    (:func:`~.exchange.allocate_group_state`). offload: the device the step runs on while the
    state lives in host memory (:mod:`.offload`; :func:`~.offload.step_device`): each shape group's
    state (and the pieces of its weights and gradients held on the host) travels there for the
    group's step and back, eagerly, group by group: each group's scores take an all-reduce of their
    own. The math is the same: bit-identical to the step without offload where the step's order
    does not change its numbers (groups whose selected blocks share a shape are orthogonalized in
    one batch without offload, each in its own with it; sums over more than 2 ranks may round
    otherwise in one all-reduce than in several, which can move a tie in the row selection).
    """

    def __init__(
        self,
        shards: list[MatrixShard],
        cuda_graph: bool = True,
        check_group: Optional[dist.ProcessGroup] = None,
        step_share: float = 1.0,
        *,
        local: bool = False,
        fresh_grads: bool = False,
        speeds: Optional[AgreedSpeeds] = None,
        chosen: Optional[Mapping[str, float]] = None,
        momentum_in_place: bool = False,
        offload: Optional[torch.device] = None,
    ) -> None:
        if not isinstance(cuda_graph, bool):
            raise ValueError(f"cuda_graph must be a bool, got {cuda_graph!r}")
        if not 0 < step_share <= 1:
            raise ValueError(f"step_share must be in (0, 1], got {step_share!r}")
        self.cuda_graph = cuda_graph
        self.fresh_grads = fresh_grads
        self.offload = offload
        self._graph = cuda_graph_module.StepGraph()
        self.plan = build_plan(shards)
        for sg in self.plan:
            sg.offload = offload
        if local:
            split = [s.name for sg in self.plan if sg.world > 1 for s in sg.shards]
            if split:
                raise ValueError(f"a local Dion3 engine steps whole matrices only, got split ones: {split[:3]}")
        else:
            check_plan_matches(self.plan, check_group)
        resolve_fractions(self.plan, step_share, speeds, chosen, device=offload)
        self.traffic = Traffic()
        self.exchanges: list[Exchange] = [exchange_for(sg, self.traffic, momentum_in_place) for sg in self.plan]
        self._streamer = Streamer(offload) if offload is not None else None

    @property
    def collectives(self) -> list[str]:
        """The collectives of the last eager step (for tests and benchmarks)."""
        return self.traffic.collectives

    @property
    def buffer_numels(self) -> list[int]:
        """The sizes of the last eager step's communication buffers."""
        return self.traffic.buffer_numels

    def auto_fractions(self) -> dict[tuple[int, int], float]:
        """The automatic f chosen per logical shape (empty when no matrix asked for it)."""
        return {sg.key.shape: sg.fraction for sg in self.plan if chooses_fraction(sg.hp)}

    def chosen_fractions(self) -> dict[str, float]:
        """The automatic f chosen per matrix name: the record a checkpoint keeps."""
        return chosen_fractions(self.plan)

    @torch.no_grad()
    def step(
        self, prologue: Optional[Callable[[], None]] = None, epilogue: Optional[Callable[[], None]] = None, around_key: Hashable = ()
    ) -> None:
        """One Dion3 step for every shard. When every shape group steps on the device alone (held
        whole, or on the static exchange), the whole step, collectives included, replays from one
        CUDA graph; otherwise :meth:`start_step`, then :meth:`finish_step`.

        ``prologue`` and ``epilogue``: device work right before and after the step (a caller's
        copies into and out of the shards' tensors), inside the graph when the step is graphed;
        ``around_key`` names the tensors they touch, so a graph never replays into stale memory.
        With offload the step is :meth:`_step_offloaded`.
        """
        if self._streamer is not None:
            self._step_offloaded(self._streamer, prologue, epilogue)
            return
        if self._whole_step_graphable():
            self._step_graphed(prologue, epilogue, around_key)
            return
        if prologue is not None:
            prologue()
        self.finish_step(self.start_step())
        if epilogue is not None:
            epilogue()

    def _step_offloaded(self, streamer: Streamer, prologue: Optional[Callable[[], None]], epilogue: Optional[Callable[[], None]]) -> None:
        """The step of an engine whose state lives in host memory: group by group, each one's
        state on the device for its own step (:class:`~.offload.Streamer`), which is the step
        without offload restricted to the group."""
        assert self.offload is not None  # (the streamer is made with it)
        self.traffic.reset()
        for ex in self.exchanges:
            ex.bind()  # (on the host state: a caller's replaced tensors are copied in)
        if prologue is not None:
            prologue()

        def step(i: int) -> None:
            ex = self.exchanges[i]
            if isinstance(ex, WholeExchange):
                self._accumulate_fresh([ex])
                WholeExchange.step_all([ex], None)
                return
            rows = self._select([i])[i]
            ex.step(rows.cpu() if ex.host_rows else rows)

        streamer.run([travellers(ex) for ex in self.exchanges], step)
        if epilogue is not None:
            epilogue()

    def _whole(self) -> list[WholeExchange]:
        return [ex for ex in self.exchanges if isinstance(ex, WholeExchange)]

    def _whole_step_graphable(self) -> bool:
        if not self.cuda_graph or not self.plan:
            return False  # (an empty plan: a data-parallel rank that owns no matrix)
        device = self.plan[0].shards[0].weight.device
        return (
            cuda_graph_module.usable(device)
            and all(ex.static for ex in self.exchanges)
            and all(s.weight.device == device for sg in self.plan for s in sg.shards)
        )

    def _step_graphed(self, prologue: Optional[Callable[[], None]], epilogue: Optional[Callable[[], None]], around_key: Hashable) -> None:
        """The whole step from one CUDA graph: the tensors it touches and all sizes are fixed, and
        nothing waits for the host. ``collectives`` and ``buffer_numels`` fill on eager calls only."""
        self.traffic.reset()
        for ex in self.exchanges:
            ex.bind()
        whole = self._whole()
        self._accumulate_fresh(whole)
        exchanged = [i for i, ex in enumerate(self.exchanges) if not isinstance(ex, WholeExchange)]
        factors = [f for ex in whole for f in ex.factors()]
        factors += [self.exchanges[i].factors()[0] for i in exchanged]
        split = len(factors) - len(exchanged)

        def step(graph_factors: list[rule.UpdateFactors]) -> None:
            if prologue is not None:
                prologue()
            chosen = self._select(exchanged)
            if whole:
                WholeExchange.step_all(whole, None, graph_factors[:split])
            for i, f in zip(exchanged, graph_factors[split:]):
                self.exchanges[i].step(chosen[i], f)
            if epilogue is not None:
                epilogue()

        key = (prologue is not None, epilogue is not None, around_key, tuple(part for ex in self.exchanges for part in ex.graph_key()))
        self._graph.run_with_factors(key, step, factors, self.plan[0].shards[0].weight.device)

    def _accumulate_fresh(self, whole: list[WholeExchange]) -> None:
        """With fresh_grads: add the whole matrices' gradients to their momentum here, outside any
        graph (their addresses change every step)."""
        if self.fresh_grads:
            for ex in whole:
                ex.accumulate()

    def _select(self, groups: list[int]) -> dict[int, torch.Tensor]:
        """Score ``groups`` (their gradients added to the momentum), sum the partial row scores of
        all groups on one process group in ONE all-reduce; the chosen rows (B, k) of each group."""
        scores = {i: self.exchanges[i].score() for i in groups}
        by_group: dict[tuple, list[int]] = {}
        for i in groups:
            if self.plan[i].world > 1:
                by_group.setdefault(group_ranks(self.plan[i].group), []).append(i)
        for ranks in sorted(by_group):
            members = by_group[ranks]
            flat = torch.cat([scores[i].view(-1) for i in members])
            self.traffic.all_reduce(flat, self.plan[members[0]].group)
            for i, part in zip(members, flat.split([scores[i].numel() for i in members])):
                scores[i] = part.view(scores[i].shape)
        chosen = {i: rule.select_rows(t, self.plan[i].fraction, self.plan[i].hp.num_heads) for i, t in scores.items()}
        for i, rows in chosen.items():
            if self.plan[i].hp.staleness:
                self.exchanges[i].age(rows)
        return chosen

    @torch.no_grad()
    def start_step(self) -> _PendingStep:
        """Accumulate momentum and score rows in every shape group; the scores of all groups on
        one process group are summed in ONE all-reduce and the rows chosen. The chosen rows of the
        groups that plan their exchange on the host start their ONE copy there, not waited for
        here; groups this rank holds whole step right away on the device. Device work a caller
        queues before :meth:`finish_step` also runs while the host waits for that copy.
        """
        self.traffic.reset()
        for ex in self.exchanges:
            ex.bind()
        whole = self._whole()
        self._accumulate_fresh(whole)
        chosen = self._select([i for i, ex in enumerate(self.exchanges) if not isinstance(ex, WholeExchange)])
        pending = _PendingStep(chosen, [i for i in chosen if self.exchanges[i].host_rows])
        if pending.host_rows:
            rows = torch.cat([chosen[i].view(-1) for i in pending.host_rows])
            pending.host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=rows.is_cuda)
            pending.host.copy_(rows, non_blocking=rows.is_cuda)
            if rows.is_cuda:
                pending.copied = torch.cuda.Event()
                pending.copied.record()
            pending.rows = rows  # alive until the copy is done
        if whole:  # no exchange: they step right away, on the device, unsynced
            WholeExchange.step_all(whole, self._graph if self.cuda_graph else None)
        return pending

    @torch.no_grad()
    def finish_step(self, pending: _PendingStep) -> None:
        """Wait for the chosen rows on the host (the step's only wait on the device), then each
        remaining group makes its two all-to-alls and applies its update."""
        chosen = pending.chosen
        if pending.host_rows:
            assert pending.host is not None  # copied to the host with host_rows
            if pending.copied is not None:
                pending.copied.synchronize()
            sizes = [chosen[i].numel() for i in pending.host_rows]
            for i, part in zip(pending.host_rows, pending.host.split(sizes)):
                chosen[i] = part.view(chosen[i].shape)
        for i, rows in chosen.items():
            self.exchanges[i].step(rows)
