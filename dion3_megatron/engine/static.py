"""The static exchange: row or column blocks with message sizes known in advance, no host wait
(CUDA-graphable): every rank sends its pieces of all k selected rows of each matrix to the owner.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..core import rule
from .exchange import BlockExchange, SubBatch, sub_batch_mu, take_decay_of
from .plan import ShapeGroup


@dataclass(eq=False)
class Route:
    """Where a sub-batch's matrices go in the static exchange (fixed for the plan's life):
    ``order`` lists its matrices by owner rank, ``per_dest[d]`` how many rank d owns, and
    ``owned_pos`` the block position (j // world) of each matrix this rank owns, in that order."""

    order: torch.Tensor
    per_dest: list[int]
    owned_pos: torch.Tensor

    @staticmethod
    def build(sg: ShapeGroup, sub: "SubBatch", device: torch.device) -> "Route":
        by_dest = [[b for b, j in enumerate(sub.index) if sg.owner(j) == d] for d in range(sg.world)]
        order = [b for bs in by_dest for b in bs]
        owned = [sub.index[b] // sg.world for b in by_dest[sg.rank]]
        return Route(
            torch.tensor(order, dtype=torch.long, device=device),
            [len(bs) for bs in by_dest],
            torch.tensor(owned, dtype=torch.long, device=device),
        )


STATIC_ROW_BLOCKS_MAX_WORLD = 2  # row blocks send world x the rows they hold on the static exchange


def static_exchange(sg: ShapeGroup) -> bool:
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


class StaticExchange(BlockExchange):
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
        routes: dict[int, Route] = {}
        for sub in subs:
            route = routes[id(sub)] = sub.route = sub.route or Route.build(sg, sub, device)
            momentum, variance, index = sub.momentum_padded, sub.variance_padded, sub.index_on_device
            assert momentum is not None and variance is not None and index is not None  # made by bind()
            rect, rows = sub.rect[me], sub.momentum.shape[1]
            local = chosen[index] - rect.r0
            mask = None
            if sub.sharding.kind == "rows":  # rows another rank holds point at the zero row
                mask = (local >= 0) & (local < rows)
                local = torch.where(mask, local, rows)
            pieces = rule.take_selected(momentum, local, take_decay_of(sg, sub_batch_mu(sg, sub, device)), sub.rounding)
            variances = torch.gather(variance, 1, local)
            if mask is not None:
                variances = variances * mask
            held[id(sub)] = (local, mask, variance)
            pieces, variances = pieces[route.order], variances[route.order]
            for d, (piece, v) in enumerate(zip(pieces.split(route.per_dest), variances.split(route.per_dest))):
                send_parts[d] += [piece.reshape(-1)] + ([v.reshape(-1)] if sub.provides[me] else [])
        width = {id(sub): [r.c1 - r.c0 for r in sub.rect] for sub in subs}
        recv_sizes = [sum(routes[id(sub)].per_dest[me] * k * (width[id(sub)][q] + sub.provides[q]) for sub in subs) for q in range(world)]

        def assemble(recv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            """Add up the pieces of each owned matrix's k rows."""
            owned = len(self.owned())
            blocks = torch.zeros(owned, k, m, dtype=torch.float32, device=device)
            block_variances = torch.zeros(owned, k, dtype=torch.float32, device=device)
            offset = 0
            for q in range(world):
                for sub in subs:
                    count, r, pos = routes[id(sub)].per_dest[me], sub.rect[q], routes[id(sub)].owned_pos
                    size = count * k * (r.c1 - r.c0)
                    blocks[:, :, r.c0 : r.c1].index_add_(0, pos, recv[offset : offset + size].view(count, k, r.c1 - r.c0))
                    offset += size
                    if sub.provides[q]:
                        block_variances.index_add_(0, pos, recv[offset : offset + count * k].view(count, k))
                        offset += count * k
            return blocks, block_variances

        back_sizes = [sum(routes[id(sub)].per_dest[me] * k * (width[id(sub)][q] + 1) for sub in subs) for q in range(world)]
        result_sizes = [sum(routes[id(sub)].per_dest[d] * k * (width[id(sub)][me] + 1) for sub in subs) for d in range(world)]
        result = self.round_trip(
            send_parts, recv_sizes, assemble, back_sizes, self._pack(lambda sub, q: (routes[id(sub)].owned_pos, slice(None))), result_sizes
        )

        # Apply: each owner's results, per part, in route order; row blocks keep the rows they hold.
        steps, new_variances = self._split_returned(result, lambda sub, d: routes[id(sub)].per_dest[d] * k)
        if factors is None:
            factors = self.factors()[0].on_device(device)
        start = 0
        for sub in subs:
            local, mask, variance = held[id(sub)]
            in_order = torch.empty(len(sub.index), k, width[id(sub)][me], dtype=torch.float32, device=device)
            in_order.index_copy_(0, routes[id(sub)].order, steps[id(sub)].view(-1, k, width[id(sub)][me]))
            variance_in_order = torch.empty(len(sub.index), k, dtype=torch.float32, device=device)
            variance_in_order.index_copy_(0, routes[id(sub)].order, new_variances[id(sub)].view(-1, k))
            variance.scatter_(1, local, variance_in_order)  # rows held elsewhere land in the pad
            weights = [sg.shards[j].weight.view(sub.momentum.shape[1:]) for j in sub.index]
            part = factors.part(start, start + len(sub.index))
            assert isinstance(part.coef, torch.Tensor)  # device factors: on_device() above, or a graph's
            coef = part.coef.view(-1, 1).expand(local.shape).to(torch.float32)
            rule.apply_rows(weights, local, in_order, coef, part.shrink, padded=mask is not None)  # rows held elsewhere are skipped
            start += len(sub.index)
