"""The general exchange: any pieces (ZeRO flat slices, ZeRO slices of tensor-parallel blocks),
planned on the host from the chosen rows.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..core import rounding as bf16_rounding
from ..core import rule
from ..core.rounding import Rounding
from .exchange import Exchange, Traffic, folded_decay_of, take_decay_of, to_device, update_factors_of
from .plan import ShapeGroup
from .sharding import init_state


class GeneralExchange(Exchange):
    """Any pieces (ZeRO flat slices, and ZeRO slices of tensor-parallel blocks), each shard with its
    own state. Who holds which selected rows is worked out on the host from one copy of the chosen
    rows, and every index tensor of the step travels to the device in one copy: no per-matrix syncs.
    """

    def __init__(self, sg: ShapeGroup, traffic: Traffic) -> None:
        super().__init__(sg, traffic)
        for shard in sg.shards:
            init_state(shard, sg.rank, sg.offload)
        device = sg.offload or sg.shards[0].weight.device  # (constants: where the step runs)
        self._seeds = [torch.tensor([bf16_rounding.matrix_seed(shard.name)], device=device) for shard in sg.shards]

    def _rounding(self, j: int) -> Optional[Rounding]:
        """A bf16 momentum's rounding, over the shard's count of steps (its state, which a caller may replace)."""
        state = self.sg.shards[j].state
        return Rounding(self._seeds[j], state["rounding_step"].view(1), self.sg.key.shape[1]) if "rounding_step" in state else None

    def score(self) -> torch.Tensor:
        sg = self.sg
        rounded = sg.key.momentum_dtype != str(torch.float32)
        if not rounded:
            rule.accumulate([shard.state["momentum"] for shard in sg.shards], [shard.stepped_grad() for shard in sg.shards])
        scores = torch.zeros(len(sg.shards), sg.key.shape[0], dtype=torch.float32, device=sg.shards[0].weight.device)
        for j, shard in enumerate(sg.shards):
            decay = folded_decay_of(sg, rule.momentum_decay(shard.hp, sg.fraction))
            momentum, rounding = shard.state["momentum"], self._rounding(j)
            if rounding is not None:  # added, scored and decayed in fp32 a rectangle at a time, stored rounded
                rounding.advance()
                for rect in sg.rects[j][sg.rank]:
                    block, grad, at = rect.view(momentum)[None], [rect.view(shard.stepped_grad())], rounding.at(rect.r0, rect.c0)
                    scores[j, rect.r0 : rect.r1] += rule.accumulate_and_score(block, grad, decay=decay, rounding=at)[0]
            else:
                for rect in sg.rects[j][sg.rank]:
                    scores[j, rect.r0 : rect.r1] += rule.row_scores(rect.view(momentum)[None])[0]
                if decay is not None:  # as rule.accumulate_and_score folds it
                    momentum.mul_(decay)
            if sg.hp.staleness:
                r0, r1 = sg.spans[j][sg.rank]
                scores[j, r0:r1] = rule.staleness_boost(scores[j, r0:r1], shard.state["row_age"], sg.hp.staleness, sg.fraction)
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
            momentum, rounding = shard.state["momentum"], self._rounding(j)
            send_parts[owner].append(shard.state["variance"][layout.provided_rows(j)])
            for t, rect in enumerate(rects[j][me]):
                decay = take_decay_of(sg, rule.momentum_decay(shard.hp, sg.fraction))
                at = rounding.at(rect.r0, rect.c0) if rounding is not None else None
                piece = rule.take_rows(rect.view(momentum), layout.rect_rows(j, t), decay, rounding=at)
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
        factors = update_factors_of(sg, list(range(len(shards))))
        assert isinstance(factors.coef, list) and isinstance(factors.shrink, list)  # numbers, one per matrix
        weights, rows_of, steps = [], [], []
        coefs: list[float] = []
        shrinks: list[float] = []
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
        self._device.update(to_device(wanted, self.device))

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
