"""The planned exchange: row or column blocks; who holds which selected rows is worked out on the
host from the chosen rows, and only the rows each rank holds travel.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from ..core import rule
from .exchange import BlockExchange, SubBatch, sub_batch_mu, take_decay_of, to_device, update_factors_of


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


class PlannedExchange(BlockExchange):
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
        on_device = to_device(host, device)
        held = {}
        for p, (sub, (counts, owner_major, owned)) in enumerate(zip(self.subs, plans)):
            held[id(sub)] = _HeldRows(
                counts,
                owner_major,
                owned,
                on_device[p, "bi"],
                on_device[p, "local"],
                on_device[p, "var"],
                {q: (on_device[p, "pos", q], on_device[p, "si", q]) for q in range(world)},
                [sum(counts[me][b] for b, j in enumerate(sub.index) if j % world == d) for d in range(world)],
            )
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
            pieces = rule.take_rows(sub.momentum, h.local_rows, take_decay_of(sg, sub_batch_mu(sg, sub, device)), h.batch, sub.rounding)
            variances = sub.variance[h.batch, h.variance_rows]
            for d, (piece, v) in enumerate(zip(pieces.split(h.per_dest), variances.split(h.per_dest))):
                send_parts[d] += [piece.reshape(-1)] + ([v] if sub.provides[me] else [])

        def from_rank(sub: SubBatch, q: int, extra: int) -> int:
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
        result_sizes = [sum(held[id(sub)].per_dest[d] * (sub.rect[me].c1 - sub.rect[me].c0 + 1) for sub in subs) for d in range(world)]
        result = self.round_trip(
            send_parts, recv_sizes, assemble, back_sizes, self._pack(lambda sub, q: held[id(sub)].owner_index[q]), result_sizes
        )

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
        factors = update_factors_of(sg, order)
        rule.apply_rows(weights, rows, updates, factors.coef, factors.shrink)
