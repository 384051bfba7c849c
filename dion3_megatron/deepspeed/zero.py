"""ZeRO adapter: run Dion3 on DeepSpeed's flat fp32 partitions through the megabatch engine.

Under ZeRO (stages 1-3, and DeepSpeed's BF16_Optimizer) the optimizer steps flat fp32 tensors,
one per param group (stages 1/2) or per sub-group (stage 3) and rank, with their gradient already
averaged, unscaled and clipped; :mod:`.layout` says where each parameter's elements lie in them
(stages 1/2: a slice of the group's parameters laid end to end, so a matrix can straddle two or
more ranks' slices; stage 3: every parameter cut over the ranks on its own). From the layouts of
all of this rank's partitions (:class:`PartitionPlan`) the adapter hands every Dion3 matrix this
rank holds any of to ONE megabatch engine (:class:`ZeroStep`; :class:`~dion3_megatron.engine.Dion3Engine`),
whatever the number of partitions: a matrix that lies whole in this rank's partition
as a ``Sharding.full()`` shard (views of the partition, stepped by this rank alone, no
communication), a matrix split over ranks as a ``Sharding.flat(bounds)`` piece (element ranges of
the row-major matrix), stepped with the ranks that hold its other pieces (over the process group
the partitions span: the expert-data-parallel group for MoE parameters); parameters that are not
matrices take AdamW element by element on the partition. With a Megatron-style ``mpu`` (tensor
parallelism), a weight marked ``tensor_model_parallel`` is one row or column block of a logical
matrix; every rank's piece of every block goes to the engine as a ``Sharding.block_flat`` piece
over the TP x data-parallel group, so whole logical matrices are stepped.

Optimizer state is shaped like the flat partition (a "slice"), so DeepSpeed's elastic and universal
checkpoints handle it like Adam's (``ds_to_universal`` reads exactly the keys ``exp_avg`` and
``exp_avg_sq``; padding elements of a ZeRO-3 partition hold 0):

* ``exp_avg``    (slice)  Dion3 momentum on matrix elements; AdamW first moment elsewhere.
* ``exp_avg_sq`` (slice)  Dion3 per-row variance repeated over the row's elements; AdamW second
                          moment elsewhere.
* ``row_age``    (slice)  with staleness: steps since each row was applied, repeated over the
                          row's elements like the variance; 0 elsewhere. ``ds_to_universal``
                          does not know the key: :func:`.checkpoint.convert_to_universal` adds it.
* ``step``       (0-d)    steps taken (AdamW bias correction).

The engine steps the momentum in ``exp_avg`` where it lies (no copy, no second buffer) and keeps
one variance value (and age) per row a shard touches: before each step they are read from the
slice (a row's variance and age from the first element of the row there), after the step written
back (repeated over the row).
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..core import rule
from ..core.adamw import adamw_step
from ..core.ortho import default_ns_dtype
from ..engine import Dion3Engine, MatrixShard, Rect, Sharding
from ..engine.offload import step_on_device
from ..engine.plan import chooses_fraction
from ..engine.session import EngineSession
from ..frontend import groups as grouping
from .layout import FlatLayout, logical, param_bounds


def matrices_of(p: torch.Tensor) -> list[tuple[int, int, int]]:
    """(element offset, rows, cols) of every matrix in a >= 2-D parameter, as frontend.matrix_view sees it."""
    if p.dim() == 2:
        return [(0, p.shape[0], p.shape[1])]
    if p.dim() == 3:
        n, m = p.shape[1], p.shape[2]
        return [(e * n * m, n, m) for e in range(p.shape[0])]
    n = p.shape[0]
    m = p.numel() // n
    return [(0, n, m)]


@dataclass
class _SlicePiece:
    """This rank's part of one Dion3 matrix, the shard the engine steps (the matrix whole, or this
    rank's piece of a matrix split over ranks), and where it lies in the flat slice."""

    shard: MatrixShard
    offset: int  # first element of the piece in the flat partition
    length: int
    # its elements as blocks of rows (a partial first row, whole rows, a partial last row), rows
    # counted from the first one it touches, offsets from its first element
    rects: list[Rect]

    @property
    def rows(self) -> int:
        """The rows it touches: the engine keeps a variance (and an age) for each."""
        return self.rects[-1].r1 if self.rects else 0

    def of(self, t: torch.Tensor) -> torch.Tensor:
        """The piece's elements of a slice-shaped tensor, shaped like the shard's weight."""
        return t.narrow(0, self.offset, self.length).view(self.shard.weight.shape)


def _row_blocks(first: int, length: int, width: int) -> list[Rect]:
    """Elements [first, first + length) of a row-major matrix ``width`` wide, as blocks of rows."""
    if not length:
        return []
    top = first // width
    return [
        dataclasses.replace(r, r0=r.r0 - top, r1=r.r1 - top)
        for r in Sharding.flat((first, first + length)).rects(0, (first + length - 1) // width + 1, width)
    ]


class _SliceMoves:
    """What travels between the slice-shaped state and the engine's around each step, in a few
    batched ops whatever the number of matrices: before it, each touched row's variance (and
    age), read from the row's first element in the slice; after it, the rows' values repeated over
    their elements in the slice. The momentum does not travel: the engine steps ``exp_avg`` where
    it lies (``momentum_in_place``). The tensors stay the same while the engine lives (it is
    rebuilt when the state tensors change)."""

    def __init__(self, pieces: list[_SlicePiece], exp_avg: torch.Tensor, per_row: dict[str, torch.Tensor]) -> None:
        live = [p for p in pieces if p.length]
        # where in the slice each touched row's first element here lies, row by row
        self.firsts = torch.cat(
            [p.offset + r.offset + (r.c1 - r.c0) * torch.arange(r.r1 - r.r0) for p in live for r in p.rects]
            or [torch.zeros(0, dtype=torch.long)]
        ).to(exp_avg.device)
        self.sizes = [p.rows for p in live]
        self.per_row = per_row
        self.rows = {key: [p.shard.state[key] for p in live] for key in per_row}
        self.spread = {
            key: (
                [r.view(values.narrow(0, p.offset, p.length)) for p in live for r in p.rects],
                [p.shard.state[key][r.r0 : r.r1, None].expand(r.r1 - r.r0, r.c1 - r.c0) for p in live for r in p.rects],
            )
            for key, values in per_row.items()
        }

    def read(self) -> None:
        if self.sizes:
            for key, values in self.per_row.items():
                torch._foreach_copy_(self.rows[key], list(values[self.firsts].split(self.sizes)))

    def write(self) -> None:
        for blocks, values in self.spread.values():
            if blocks:
                torch._foreach_copy_(blocks, values)


class PartitionPlan:
    """What one flat ZeRO partition holds, read once from its layout: its pieces of Dion3 matrices
    (the shards :class:`ZeroStep`'s engine steps) and its AdamW element runs."""

    def __init__(self, group: dict, hp: rule.Dion3Hyperparameters, layout: FlatLayout, index: int, device: torch.device) -> None:
        self.flat = layout.flat
        self.device = device  # where the step computes and its collectives run: the flat's device, or the GPU it is offloaded to
        self.group_index = index  # the param group's position among the optimizer's
        self.group_pg = layout.group
        self.world = dist.get_world_size(self.group_pg)
        self.rank = dist.get_rank(self.group_pg)
        tensor_parallel = TensorParallel.of_mpu(self.group_pg)
        if tensor_parallel is not None:
            tensor_parallel.check_same_slices(layout.ranges, f"Dion3 param group {index}", device)
        # Every rank whose pieces one step's collectives join: the tensor x data-parallel group with
        # tensor parallelism, else the data-parallel group. They check the plan, and skip a step, together.
        self.check_group = tensor_parallel.group if tensor_parallel is not None else self.group_pg
        self.pieces: list[_SlicePiece] = []  # every Dion3 matrix this rank holds any of: the engine's shards
        # Some rank of the group holds a Dion3 matrix (the same on every rank): then every rank
        # builds the engine, whose construction is collective, also one that holds none.
        self.steps_matrices = False
        self.names: set[str] = set()  # every Dion3 matrix of the layout, whether this rank holds any of it or not
        adamw_runs: list[tuple[int, int]] = []
        for k, (j, p, hp_start) in enumerate(zip(layout.indices, layout.params, layout.starts)):
            shaped = logical(p)
            where = f"Dion3 param group {index}, param {j} (shape {tuple(shaped.shape)})"
            bounds = param_bounds(layout.ranges[:, k], shaped.numel(), where)
            lp_lo = bounds[self.rank]
            lp_hi = bounds[self.rank + 1]
            if grouping.algorithm_of(group, shaped) == "adamw":
                if lp_hi > lp_lo:
                    adamw_runs.append((hp_start, lp_hi - lp_lo))
                continue
            self.steps_matrices = True
            # one block of a tensor-parallel matrix: through the engine over TP x DP
            names = grouping.matrix_names(grouping.param_name(index, j), shaped)
            if tensor_parallel is not None and (split := tensor_parallel.split_of(p, shaped)) is not None:
                self.names.add(names[0])
                self._add_tensor_parallel(shaped, split, bounds, hp_start, lp_lo, tensor_parallel, hp, names[0])
                continue
            for e, (a, n, m) in enumerate(matrices_of(shaped)):
                mbounds = [min(max(b - a, 0), n * m) for b in bounds]
                lo, hi = mbounds[self.rank], mbounds[self.rank + 1]
                offset = hp_start + (a + lo - lp_lo) if hi > lo else 0
                holders = [q for q in range(self.world) if mbounds[q + 1] > mbounds[q]]
                name = names[e]
                self.names.add(name)
                if len(holders) > 1:
                    self._add_piece(name, offset, hi - lo, lo, m, (n, m), Sharding.flat(mbounds), self.group_pg, hp)
                elif holders == [self.rank]:  # whole in this rank's slice: stepped here alone, no communication
                    self._add_piece(name, offset, n * m, 0, m, (n, m), Sharding.full(), None, hp)
        self.adamw_runs = _merge_runs(adamw_runs)

    def chooses_fraction(self, hp: rule.Dion3Hyperparameters) -> bool:
        """Whether the plan chooses f for matrices of this partition (on every rank alike)."""
        return self.steps_matrices and chooses_fraction(hp)

    def _add_tensor_parallel(
        self,
        p: torch.Tensor,
        split: str,
        bounds: list[int],
        hp_start: int,
        lp_lo: int,
        tensor_parallel: "TensorParallel",
        hp: rule.Dion3Hyperparameters,
        name: str,
    ) -> None:
        """A TP block of a logical matrix, sliced by ZeRO: the engine steps the whole logical matrix
        over the tensor x data-parallel group (every rank of it holds one slice of one block)."""
        n, m = p.shape
        lo, hi = bounds[self.rank], bounds[self.rank + 1]
        blocks = tensor_parallel.size
        shape = (n * blocks, m) if split == "rows" else (n, m * blocks)
        offset = hp_start + (lo - lp_lo) if hi > lo else 0
        self._add_piece(
            name, offset, hi - lo, lo, m, shape, Sharding.block_flat(split, bounds, tensor_parallel.places), tensor_parallel.group, hp
        )

    def _add_piece(
        self,
        name: str,
        offset: int,
        length: int,
        first: int,
        row_width: int,
        shape: tuple[int, int],
        sharding: Sharding,
        process_group,
        hp: rule.Dion3Hyperparameters,
    ) -> None:
        """A shard for the engine: ``length`` elements of the slice from ``offset``, which are
        elements [first, first + length) of a row-major matrix ``row_width`` wide (the logical
        matrix, or its TP block); a whole matrix's views of the slice are (rows, cols)."""
        local = shape if sharding.kind == "full" else (length,)
        view = self.flat.narrow(0, offset, length).view(local)
        shard = MatrixShard(
            name=name,
            weight=view,
            grad=view,  # the grad: replaced by the real gradient each step
            shape=shape,
            sharding=sharding,
            group=process_group,
            hp=hp,
            state={},
        )
        self.pieces.append(_SlicePiece(shard, offset, length, _row_blocks(first, length, row_width)))

    def bind(self, state: dict, hp: rule.Dion3Hyperparameters) -> None:
        """Give the shards their state from the partition's, before the engine is built on them (in
        a step, after its count): the momentum, views of ``exp_avg`` (stepped where it lies); a
        variance and an age per touched row; with a bf16 momentum each matrix's count of steps
        before this one, the partition's (every matrix of a partition steps at each of its steps)."""
        exp_avg = state["exp_avg"]
        for piece in self.pieces:
            piece.shard.hp = hp
            piece.shard.state.clear()
            piece.shard.state["momentum"] = piece.of(exp_avg)
            for key in _per_row(state, hp):
                piece.shard.state[key] = torch.zeros(piece.rows, dtype=torch.float32, device=exp_avg.device)
            if hp.momentum_dtype != torch.float32:
                before = int(state["step"]) - 1
                piece.shard.state["rounding_step"] = torch.full(
                    (), before, dtype=torch.int64, device=exp_avg.device, pin_memory=exp_avg.is_pinned()
                )

    def moves(self, state: dict, hp: rule.Dion3Hyperparameters) -> _SliceMoves:
        """What travels between the partition's state and the engine's (built on the shards' state)."""
        return _SliceMoves(self.pieces, state["exp_avg"], _per_row(state, hp))

    def take_gradient(self, grad: torch.Tensor, hp: rule.Dion3Hyperparameters) -> None:
        """This step's gradient and settings for the shards (ZeRO's gradient partition is a new tensor every step)."""
        for piece in self.pieces:
            piece.shard.grad = piece.of(grad)
            if piece.shard.hp != hp:
                piece.shard.hp = hp

    def drop_gradient(self) -> None:
        for piece in self.pieces:
            piece.shard.grad = None

    def adamw_step(self, group: dict, state: dict, grad: torch.Tensor, offload: Optional[torch.device] = None) -> None:
        """AdamW on the runs of the partition that are no Dion3 matrix's; ``offload``: the device
        it runs on, the runs' tensors held on the host (``dion3_megatron.engine.offload.step_on_device``)."""
        if not self.adamw_runs:
            return
        params, grads, exp_avgs, exp_avg_sqs = (
            [t.narrow(0, start, length) for start, length in self.adamw_runs]
            for t in (self.flat, grad, state["exp_avg"], state["exp_avg_sq"])
        )
        count = int(state["step"].item())

        def adamw(read: list[list[torch.Tensor]], written: list[list[torch.Tensor]]) -> None:
            (grads,), (params, exp_avgs, exp_avg_sqs) = read, written
            adamw_step(params, grads, exp_avgs, exp_avg_sqs, count, group["lr"], group["betas"], group["eps"], group["weight_decay"])

        if offload is None:
            adamw([grads], [params, exp_avgs, exp_avg_sqs])
        else:
            step_on_device(offload, [grads], [params, exp_avgs, exp_avg_sqs], adamw)


class ZeroStep:
    """One step of every ZeRO partition this rank holds (every param group's slice, every ZeRO-3
    sub-group): all their pieces of Dion3 matrices are the shards of ONE engine, so a step makes one
    set of collectives whatever the number of partitions; the AdamW runs step element by element.

    The engine is the front end's session's (:class:`~dion3_megatron.engine.session.EngineSession`),
    whose ranks are :attr:`check_group`: built at the first step by every rank alike (the engine's
    construction and the agreement on the device's speed are collective over it), again where the
    partitions' state tensors, or a group's staleness, changed (a checkpoint load)."""

    def __init__(self, partitions: list[PartitionPlan], hps: list[rule.Dion3Hyperparameters], session: EngineSession) -> None:
        self.partitions = partitions
        self.check_group = _widest([p.check_group for p in partitions])
        self.session = session
        session.group = self.check_group
        device = partitions[0].device
        wanted = [(device, hp.ns_dtype or default_ns_dtype(device)) for p, hp in zip(partitions, hps) if p.chooses_fraction(hp)]
        # Some group has the automatic f (the same on every rank): the ranks agree on the device's
        # speed now, and share their choices at each build.
        self.choose = bool(wanted)
        if wanted:
            session.agree_speeds(wanted)
        self._moves: list[_SliceMoves] = []

    def names(self) -> dict[str, int]:
        """Every Dion3 matrix of the partitions (held here or not) -> its param group's index."""
        return {name: p.group_index for p in self.partitions for name in p.names}

    def _engine(self, states: list[dict], hps: list[rule.Dion3Hyperparameters]) -> Dion3Engine:
        """The engine over the partitions' pieces of Dion3 matrices (built again where their state tensors changed)."""
        stepped = [(p, state, hp) for p, state, hp in zip(self.partitions, states, hps) if p.steps_matrices]
        key = tuple((id(s["exp_avg"]), id(s.get("exp_avg_sq")), id(s.get("row_age")), hp.staleness) for _, s, hp in stepped)
        if (engine := self.session.current(key)) is not None:
            return engine
        for p, _, hp in stepped:
            if chooses_fraction(hp):  # refused here on every rank alike where the ranks agreed no speed for it
                self.session.agree_speeds([(p.device, hp.ns_dtype or default_ns_dtype(p.device))])

        def shards() -> list[MatrixShard]:
            for p, state, hp in stepped:
                p.bind(state, hp)
            return [piece.shard for p, _, _ in stepped for piece in p.pieces]

        engine = self.session.engine_for(key, shards, groups_of=self.names(), fresh_grads=True, momentum_in_place=True, gather=self.choose)
        self._moves = [p.moves(state, hp) for p, state, hp in stepped]
        return engine

    def step(self, groups: list[dict], states: list[dict], grads: list[torch.Tensor], hps: list[rule.Dion3Hyperparameters]) -> None:
        """One step of every partition (``states``, ``grads``, ``hps``: their state, gradient and
        settings, in :attr:`partitions`' order)."""
        if any(p.steps_matrices for p in self.partitions):
            engine = self._engine(states, hps)
            for p, grad, hp in zip(self.partitions, grads, hps):
                if p.steps_matrices:
                    p.take_gradient(grad, hp)
            for moves in self._moves:
                moves.read()
            engine.step()
            for moves in self._moves:
                moves.write()
            for p in self.partitions:  # ZeRO frees its gradient partition after the step: let it
                p.drop_gradient()
        for p, state, grad in zip(self.partitions, states, grads):
            p.adamw_step(groups[p.group_index], state, grad, self.session.offload_device(p.flat.device))


def _per_row(state: dict, hp: rule.Dion3Hyperparameters) -> dict[str, torch.Tensor]:
    """The partition's slice-shaped tensors that hold one value per matrix row, by engine state key."""
    return {"variance": state["exp_avg_sq"], **({"row_age": state["row_age"]} if hp.staleness else {})}


def _widest(process_groups: list) -> Any:
    """The process group among ``process_groups`` whose ranks include every other's; None (the
    world) where none does."""
    members = [set(dist.get_process_group_ranks(g)) if g is not None else set(range(dist.get_world_size())) for g in process_groups]
    for g, ranks in zip(process_groups, members):
        if all(other <= ranks for other in members):
            return g
    return None


_WARNED_TP = False
_TENSOR_DATA_GROUPS: dict[tuple[int, ...], Any] = {}  # global ranks -> process group, made once per process


def _mpu_tensor_parallel() -> tuple[int, Any]:
    """(size, group) of the tensor-parallel group of the mpu given to DeepSpeed; (1, None) without one."""
    from deepspeed.utils import groups
    from deepspeed.utils.bwc import bwc_tensor_model_parallel_group, bwc_tensor_model_parallel_world_size

    mpu = getattr(groups, "mpu", None)
    if mpu is None:
        return 1, None
    size = bwc_tensor_model_parallel_world_size(mpu)
    return size, (bwc_tensor_model_parallel_group(mpu) if size > 1 else None)


def warn_if_tensor_parallel_without_zero() -> None:
    """Without ZeRO (stage 0) tensor-parallel shards are stepped as matrices of their own: say so
    once. Keyed on the mpu alone: under bf16/fp16 the optimizer holds fp32 copies that do not
    carry the TP marks, so the parameters cannot tell."""
    global _WARNED_TP
    if _WARNED_TP:
        return
    if _mpu_tensor_parallel()[0] > 1:
        _WARNED_TP = True
        warnings.warn(
            "Dion3 under DeepSpeed without ZeRO treats each tensor-parallel shard as a matrix of its own (rows are "
            "chosen and orthogonalized per TP shard, like Megatron's block-wise Muon). ZeRO stages 1-3 step the "
            "whole logical matrices, as does the Megatron-Core integration (dion3_megatron.megatron).",
            RuntimeWarning,
            stacklevel=3,
        )


@dataclass
class TensorParallel:
    """The mpu's tensor parallelism as the engine sees it: the group of every rank that holds a
    slice of a TP-split matrix (its TP group x its data-parallel group) and, per rank of that
    group, (TP rank, data-parallel rank): which block, which ZeRO slice of it."""

    size: int
    tp_group: Any
    group: Any
    places: tuple[tuple[int, int], ...]

    @staticmethod
    def of_mpu(dp_group) -> "TensorParallel | None":
        """From DeepSpeed's mpu (collective over the whole world the first time: every rank builds
        its param groups' plans at the same step); None without tensor parallelism."""
        size, tp_group = _mpu_tensor_parallel()
        if size == 1:
            return None
        # Each TP rank's data-parallel group, in data-parallel order: rank (t, d) is lists[t][d].
        lists: list = [None] * size
        dist.all_gather_object(lists, dist.get_process_group_ranks(dp_group), group=tp_group)
        ranks = tuple(sorted(r for ranks in lists for r in ranks))
        # Every rank makes the same calls (one per param group plan, in order), so every rank
        # learns every group and creates the missing ones in one order: new_group is collective.
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, ranks)
        for key in sorted(set(everyone)):
            if key not in _TENSOR_DATA_GROUPS:
                _TENSOR_DATA_GROUPS[key] = dist.new_group(list(key))
        group = _TENSOR_DATA_GROUPS[ranks]
        place_of = {r: (t, d) for t, ranks_t in enumerate(lists) for d, r in enumerate(ranks_t)}
        return TensorParallel(size, tp_group, group, tuple(place_of[r] for r in dist.get_process_group_ranks(group)))

    @staticmethod
    def split_of(p: torch.Tensor, shaped: torch.Tensor) -> "str | None":
        """ "rows" / "cols" for a 2-D TP-split weight (Megatron's ``partition_dim`` 0 / 1), else None;
        ``shaped``: ``p`` with its logical shape (:func:`.layout.logical`)."""
        if shaped.dim() != 2 or not getattr(p, "tensor_model_parallel", False):
            return None
        return {0: "rows", 1: "cols"}.get(getattr(p, "partition_dim", -1))

    def check_same_slices(self, ranges: torch.Tensor, where: str, device: torch.device) -> None:
        """Every TP rank's ZeRO slices must cut its block at the same elements (the same model on each)."""
        mine = ranges.to(device)
        every = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(every, mine, group=self.tp_group)
        if any(not torch.equal(every[0], other) for other in every[1:]):
            raise RuntimeError(
                f"{where}: ZeRO slices its parameters differently on the tensor-parallel ranks; "
                "Dion3 needs the same parameter shapes and order on every TP rank"
            )


def _merge_runs(runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for start, length in sorted(runs):
        if merged and merged[-1][0] + merged[-1][1] == start:
            merged[-1] = (merged[-1][0], merged[-1][1] + length)
        else:
            merged.append((start, length))
    return merged
