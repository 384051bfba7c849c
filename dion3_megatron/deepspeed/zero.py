"""ZeRO-1/2 adapter: run Dion3 on DeepSpeed's flat fp32 partitions through the megabatch engine.

Under ZeRO stage 1 or 2 (and DeepSpeed's BF16_Optimizer) every param group of the optimizer holds
ONE flat fp32 tensor per rank: this rank's slice of the group's parameters laid end to end, with
its gradient already averaged, unscaled and clipped. A matrix can straddle two or more ranks'
slices. Every original parameter carries ZeRO's own mapping into the slice (``_hp_mapping``: which
elements of the parameter, at which offset of the slice; ``None`` when this rank holds none) and
the process group its slices span (``_dp_group``: the expert-data-parallel group for MoE
parameters). From these the adapter describes each matrix that straddles ranks to the engine as
a ``Sharding.flat(bounds)`` piece (element ranges of the row-major matrix) and lets the engine do
its Dion3 step; a matrix that lies whole in one rank's slice is stepped by that rank alone
(``engine.local.step_whole_matrices`` on views of the slice, no communication); parameters that are not
matrices take AdamW element by element on the slice. With a Megatron-style ``mpu`` (tensor
parallelism), a weight marked ``tensor_model_parallel`` is one row or column block of a logical
matrix; every rank's slice of every block goes to the engine as a ``Sharding.block_flat`` piece
over the TP x data-parallel group, so whole logical matrices are stepped.

Optimizer state is slice-shaped, so DeepSpeed's elastic and universal checkpoints handle it like
Adam's (``ds_to_universal`` reads exactly the keys ``exp_avg`` and ``exp_avg_sq``):

* ``exp_avg``    (slice)  Dion3 momentum on matrix elements; AdamW first moment elsewhere.
* ``exp_avg_sq`` (slice)  Dion3 per-row variance repeated over the row's elements; AdamW second
                          moment elsewhere.
* ``row_age``    (slice)  with staleness: steps since each row was applied, repeated over the
                          row's elements like the variance; 0 elsewhere. ``ds_to_universal``
                          does not know the key: :func:`.checkpoint.convert_to_universal` adds it.
* ``step``       (0-d)    steps taken (AdamW bias correction).

The engine keeps one variance value (and age) per row a piece touches; before each step it is read
from the first element of each touched row of ``exp_avg_sq`` (``row_age``), after the step
written back over the row.
"""

from __future__ import annotations

import collections
import dataclasses
import warnings
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..core import rule
from ..engine import Dion3Engine, MatrixShard, Sharding, cuda_graph, fractions
from ..engine.plan import chooses_fraction
from ..engine.local import WholeMatrices, step_whole_matrices
from ..optimizer import Dion3

def is_zero_linked(p: torch.Tensor) -> bool:
    """True for a parameter ZeRO-1/2 (or BF16_Optimizer) has linked to a flat fp32 partition."""
    return hasattr(p, "_hp_mapping") and hasattr(p, "_dp_group")


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
    """This rank's piece of one matrix (what the engine steps) and where it lies in the flat slice,
    with how its per-row variance maps onto the slice."""

    shard: Any  # MatrixShard
    offset: int  # first element of the piece in the flat partition
    length: int
    row_counts: torch.Tensor  # elements of each touched row that lie in the piece
    row_firsts: torch.Tensor  # offset inside the piece of each touched row's first element here


def _touched_rows(lo: int, hi: int, n_cols: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """For matrix elements [lo, hi): per touched row, its element count and first offset in the piece."""
    if hi <= lo:
        empty = torch.zeros(0, dtype=torch.long, device=device)
        return empty, empty
    rows = torch.arange(lo // n_cols, (hi - 1) // n_cols + 1, device=device)
    starts = (rows * n_cols).clamp(min=lo)
    ends = ((rows + 1) * n_cols).clamp(max=hi)
    return ends - starts, starts - lo


def _gather_ranges(linked: list[torch.Tensor], group, device) -> torch.Tensor:
    """(world, params, 2) tensor of every rank's [start, end) element range of each parameter (-1: none)."""
    mine = torch.full((len(linked), 2), -1, dtype=torch.long)
    for j, p in enumerate(linked):
        mapping = p._hp_mapping
        if mapping is not None:
            start = mapping.lp_fragment_address.start
            mine[j, 0] = start
            mine[j, 1] = start + mapping.lp_fragment_address.numel
    world = dist.get_world_size(group)
    mine = mine.to(device)
    out = torch.empty((world * len(linked), 2), dtype=torch.long, device=device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, mine, group=group)
    return out.view(world, len(linked), 2).cpu()


def _param_bounds(ranges: torch.Tensor, numel: int, where: str) -> list[int]:
    """Monotone bounds (world + 1) of one parameter's element ranges over the ranks, in rank order."""
    bounds = [0]
    for start, end in ranges.tolist():
        if start < 0:
            bounds.append(bounds[-1])
            continue
        if start != bounds[-1]:
            raise RuntimeError(f"{where}: ZeRO slices of a parameter are not contiguous in rank order "
                               f"(a rank starts at element {start}, expected {bounds[-1]})")
        bounds.append(end)
    if bounds[-1] != numel:
        raise RuntimeError(f"{where}: ZeRO slices cover {bounds[-1]} of the parameter's {numel} elements")
    return bounds


class ZeroGroupPlan:
    """Everything one flat ZeRO param group needs per step, built once (one all_gather of int ranges)."""

    def __init__(self, opt: Dion3, group: dict, originals: list[torch.Tensor], index: int) -> None:
        self.flat = group["params"][0]
        self.use_graph = opt.cuda_graph
        self.graph = cuda_graph.StepGraph()  # the whole matrices' step
        linked = [p for p in originals if is_zero_linked(p)]
        if not linked:
            raise RuntimeError(
                f"Dion3 param group {index}: its parameters were replaced by a flat tensor but none carries "
                "ZeRO's slice mapping (_hp_mapping). Dion3 supports DeepSpeed ZeRO stages 0, 1 and 2."
            )
        self.group_pg = linked[0]._dp_group
        if any(p._dp_group is not self.group_pg for p in linked):
            raise RuntimeError(f"Dion3 param group {index}: parameters span different data-parallel groups")
        self.world = dist.get_world_size(self.group_pg)
        self.rank = dist.get_rank(self.group_pg)
        device = self.flat.device
        ranges = _gather_ranges(linked, self.group_pg, device)
        tensor_parallel = TensorParallel.of_mpu(self.group_pg)
        if tensor_parallel is not None:
            tensor_parallel.check_same_slices(ranges, f"Dion3 param group {index}", device)
        # Every rank whose pieces one step's collectives join: the tensor x data-parallel group with
        # tensor parallelism, else the data-parallel group. They check the plan, and skip a step, together.
        self.check_group = tensor_parallel.group if tensor_parallel is not None else self.group_pg
        self.pieces: list[_SlicePiece] = []  # matrices split over ranks: through the engine
        # (offset, count, rows, cols): runs of adjacent same-shape matrices only this rank holds,
        # stepped as one (count, rows, cols) batch (e.g. one layer's Q, K, V and projection).
        self.whole: list[tuple[int, int, int, int]] = []
        adamw_runs: list[tuple[int, int]] = []
        for j, p in enumerate(linked):
            where = f"Dion3 param group {index}, param {j} (shape {tuple(p.shape)})"
            bounds = _param_bounds(ranges[:, j], p.numel(), where)
            mapping = p._hp_mapping
            lp_lo = bounds[self.rank]
            lp_hi = bounds[self.rank + 1]
            hp_start = mapping.hp_fragment_address.start if mapping is not None else 0
            if Dion3.algorithm_of(group, p) == "adamw":
                if lp_hi > lp_lo:
                    adamw_runs.append((hp_start, lp_hi - lp_lo))
                continue
            split = tensor_parallel.split_of(p) if tensor_parallel is not None else None
            if split is not None:  # one block of a tensor-parallel matrix: through the engine over TP x DP
                self._add_tensor_parallel(p, split, bounds, hp_start, lp_lo, tensor_parallel, opt, group,
                                          f"group{index}.param{j}")
                continue
            for e, (a, n, m) in enumerate(matrices_of(p)):
                mbounds = [min(max(b - a, 0), n * m) for b in bounds]
                lo, hi = mbounds[self.rank], mbounds[self.rank + 1]
                offset = hp_start + (a + lo - lp_lo) if hi > lo else 0
                holders = [q for q in range(self.world) if mbounds[q + 1] > mbounds[q]]
                if len(holders) == 1:  # one rank holds it all: it steps it alone, no communication
                    if holders[0] == self.rank:
                        self._add_whole(offset, n, m)
                    continue
                name = f"group{index}.param{j}" + (f".matrix{e}" if p.dim() == 3 else "")
                self._add_piece(name, offset, hi - lo, lo, m, (n, m), Sharding.flat(mbounds),
                                self.group_pg, opt.hyperparameters(group))
        self.adamw_runs = _merge_runs(adamw_runs)
        # What fraction="auto" chose (saved in checkpoints, so a resume does not measure again):
        # per run of self.whole (None: not chosen yet), and per piece of the engine, by name.
        self.auto = chooses_fraction(opt.hyperparameters(group))
        self.whole_fractions: Optional[list[float]] = None
        self.piece_fractions: dict[str, float] = {}
        self.whole_scores: list[torch.Tensor] = []  # their row scores, in buffers a graph can replay
        self.engine = None
        self._state_ids: tuple = ()

    def auto_fractions(self) -> dict[str, Any]:
        """What fraction="auto" chose so far, for a checkpoint (see :meth:`restore_auto_fractions`)."""
        return {"whole": self.whole_fractions, "pieces": dict(self.piece_fractions)}

    def restore_auto_fractions(self, saved: dict[str, Any], where: str) -> None:
        """Take the choices a checkpoint saved instead of measuring the device again."""
        whole, pieces = saved["whole"], saved["pieces"]
        names = {piece.shard.name for piece in self.pieces}
        if whole is not None and len(whole) != len(self.whole) or not set(pieces) <= names:
            raise ValueError(f"{where}: the checkpoint's fraction='auto' choices ({len(whole or ())} whole-matrix "
                             f"runs, pieces {sorted(pieces)}) do not fit this rank's ZeRO slice ({len(self.whole)} "
                             f"runs, pieces {sorted(names)}): it was saved with another layout")
        self.whole_fractions, self.piece_fractions = whole, dict(pieces)

    def _add_tensor_parallel(self, p: torch.Tensor, split: str, bounds: list[int], hp_start: int, lp_lo: int,
                             tensor_parallel: "TensorParallel", opt: Dion3, group: dict, name: str) -> None:
        """A TP block of a logical matrix, sliced by ZeRO: the engine steps the whole logical matrix
        over the tensor x data-parallel group (every rank of it holds one slice of one block)."""
        n, m = p.shape
        lo, hi = bounds[self.rank], bounds[self.rank + 1]
        blocks = tensor_parallel.size
        shape = (n * blocks, m) if split == "rows" else (n, m * blocks)
        offset = hp_start + (lo - lp_lo) if hi > lo else 0
        self._add_piece(name, offset, hi - lo, lo, m, shape,
                        Sharding.block_flat(split, bounds, tensor_parallel.places),
                        tensor_parallel.group, opt.hyperparameters(group))

    def _add_piece(self, name: str, offset: int, length: int, first: int, row_width: int, shape: tuple[int, int],
                   sharding: Sharding, process_group, hp: rule.Dion3Hyperparameters) -> None:
        """A piece for the engine: ``length`` elements of the slice from ``offset``, which are
        elements [first, first + length) of a row-major matrix ``row_width`` wide (the logical
        matrix, or its TP block)."""
        counts, firsts = _touched_rows(first, first + length, row_width, self.flat.device)
        shard = MatrixShard(
            name=name,
            weight=self.flat.narrow(0, offset, length),
            grad=self.flat.narrow(0, offset, length),  # replaced by the real gradient each step
            shape=shape, sharding=sharding, group=process_group, hp=hp, state={},
        )
        self.pieces.append(_SlicePiece(shard, offset, length, counts, firsts))

    # ----------------------------------------------------------------------------------------

    def _bind_state(self, state: dict, hp: rule.Dion3Hyperparameters) -> None:
        """Point the engine's momentum at the slice's exp_avg (rebuilding the engine if it moved,
        or if staleness changed: the engine plans with it)."""
        ids = (id(state["exp_avg"]), id(state["exp_avg_sq"]), id(state.get("row_age")), hp.staleness)
        if not self.pieces or (self.engine is not None and ids == self._state_ids):
            return
        exp_avg = state["exp_avg"]
        for piece in self.pieces:
            piece.shard.hp = hp
            if self.auto and piece.shard.name in self.piece_fractions:  # chosen before: not measured again
                piece.shard.hp = dataclasses.replace(hp, fraction=self.piece_fractions[piece.shard.name])
            piece.shard.state.clear()
            piece.shard.state["momentum"] = exp_avg.narrow(0, piece.offset, piece.length)
            for key in ("variance", "row_age") if hp.staleness else ("variance",):
                piece.shard.state[key] = torch.zeros(piece.row_counts.numel(), dtype=torch.float32,
                                                     device=exp_avg.device)
        self.engine = Dion3Engine([p.shard for p in self.pieces], cuda_graph=self.use_graph,
                                            check_group=self.check_group)
        if self.auto:
            self.piece_fractions = {s.name: sg.fraction for sg in self.engine.plan for s in sg.shards}
        self._state_ids = ids

    def step(self, opt: Dion3, group: dict, state: dict) -> None:
        flat, grad = self.flat, self.flat.grad
        hp = opt.hyperparameters(group)
        self._bind_state(state, hp)
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        # per-row state the engine keeps one value per touched row of, the slice over the whole row
        per_row = [("variance", exp_avg_sq)] + ([("row_age", state["row_age"])] if hp.staleness else [])
        for piece in self.pieces:
            shard = piece.shard
            shard.weight = flat.narrow(0, piece.offset, piece.length)
            shard.grad = grad.narrow(0, piece.offset, piece.length)
            if shard.hp != hp:
                shard.hp = hp
            momentum = shard.state["momentum"]
            view = exp_avg.narrow(0, piece.offset, piece.length)
            if momentum.data_ptr() != view.data_ptr() and piece.length:
                momentum.copy_(view)
            if piece.row_counts.numel():
                for key, values in per_row:
                    shard.state[key].copy_(values.narrow(0, piece.offset, piece.length)[piece.row_firsts])
        # The whole matrices' device work runs while the engine waits for its chosen rows.
        pending = self.engine.start_step() if self.pieces else None
        self._step_whole(hp, flat, grad, exp_avg, [values for _, values in per_row])
        if pending is not None:
            self.engine.finish_step(pending)
        for piece in self.pieces:
            if not piece.length:
                continue
            shard = piece.shard
            view = exp_avg.narrow(0, piece.offset, piece.length)
            if shard.state["momentum"].data_ptr() != view.data_ptr():
                view.copy_(shard.state["momentum"])
            for key, values in per_row:
                values.narrow(0, piece.offset, piece.length).copy_(
                    shard.state[key].repeat_interleave(piece.row_counts, output_size=piece.length))
        if self.adamw_runs:
            step = int(state["step"].item())
            runs = [[t.narrow(0, start, length) for start, length in self.adamw_runs]
                    for t in (flat, grad, exp_avg, exp_avg_sq)]
            rule.adamw_step(*runs, step, group["lr"], group["betas"], group["eps"], group["weight_decay"])

    def _step_whole(self, hp: rule.Dion3Hyperparameters, flat, grad, exp_avg, per_row: list[torch.Tensor]) -> None:
        """The matrices only this rank holds: the single-process step on views of the slice.
        ``per_row``: the slices of the variance (exp_avg_sq) and, with staleness, the ages, each
        row's value repeated over the row."""
        if chooses_fraction(hp) and self.whole_fractions is None:
            self.whole_fractions = self._auto_fractions(hp)  # collective: every rank of the group calls it
        if not self.whole:
            return
        entries = []
        with_fraction: dict[float, rule.Dion3Hyperparameters] = {}
        if not self.whole_scores:
            self.whole_scores = [torch.empty(count, n, dtype=torch.float32, device=flat.device)
                                 for _, count, n, _ in self.whole]
        for i, (offset, count, n, m) in enumerate(self.whole):
            view = [t.narrow(0, offset, count * n * m).view(count, n, m) for t in (flat, grad, exp_avg, *per_row)]
            fraction = self.whole_fractions[i] if chooses_fraction(hp) else hp.fraction
            if fraction not in with_fraction:
                with_fraction[fraction] = hp if fraction == hp.fraction else dataclasses.replace(hp, fraction=fraction)
            # here, not in a graph: ZeRO's gradient partition is a new tensor every step
            decay = rule.folded_decay(with_fraction[fraction], n)
            scores = rule.accumulate_and_score(view[2], list(view[1].unbind(0)), out=self.whole_scores[i], decay=decay)
            entries.append(WholeMatrices(view[0], view[2], view[3][..., 0], with_fraction[fraction], scores=scores,
                                         age=view[4][..., 0] if hp.staleness else None,
                                         momentum_decayed=decay is not None))

        def spread() -> None:  # each row's variance (and age), repeated over the row (the slice's layout)
            for offset, count, n, m in self.whole:
                for values in per_row:
                    rows = values.narrow(0, offset, count * n * m).view(count * n, m)
                    rows[:, 1:] = rows[:, :1]

        step_whole_matrices(entries, self.graph if self.use_graph else None, then=spread)

    def _auto_fractions(self, hp: rule.Dion3Hyperparameters) -> list[float]:
        """f per run of whole matrices; collective over the data-parallel group (joined also by a
        rank that holds no whole matrix)."""
        matrices = collections.Counter()
        for _, count, n, m in self.whole:
            matrices[n, m] += count
        device = self.flat.device
        requests = [fractions.FractionRequest((n, m), matrices[n, m], 1, hp, device, self.group_pg)
                    for _, _, n, m in self.whole]
        return fractions.resolve_fractions(requests, joined=[(device, hp, self.group_pg)])

    def _add_whole(self, offset: int, n: int, m: int) -> None:
        if self.whole:
            last_offset, count, last_n, last_m = self.whole[-1]
            if (last_n, last_m) == (n, m) and last_offset + count * n * m == offset:
                self.whole[-1] = (last_offset, count + 1, n, m)
                return
        self.whole.append((offset, 1, n, m))


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
            "chosen and orthogonalized per TP shard, like Megatron's block-wise Muon). ZeRO stage 1 or 2 steps the "
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
    def split_of(p: torch.Tensor) -> "str | None":
        """"rows" / "cols" for a 2-D TP-split weight (Megatron's ``partition_dim`` 0 / 1), else None."""
        if p.dim() != 2 or not getattr(p, "tensor_model_parallel", False):
            return None
        return {0: "rows", 1: "cols"}.get(getattr(p, "partition_dim", -1))

    def check_same_slices(self, ranges: torch.Tensor, where: str, device: torch.device) -> None:
        """Every TP rank's ZeRO slices must cut its block at the same elements (the same model on each)."""
        mine = ranges.to(device)
        every = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(every, mine, group=self.tp_group)
        if any(not torch.equal(every[0], other) for other in every[1:]):
            raise RuntimeError(f"{where}: ZeRO slices its parameters differently on the tensor-parallel ranks; "
                               "Dion3 needs the same parameter shapes and order on every TP rank")


def _merge_runs(runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for start, length in sorted(runs):
        if merged and merged[-1][0] + merged[-1][1] == start:
            merged[-1] = (merged[-1][0], merged[-1][1] + length)
        else:
            merged.append((start, length))
    return merged


def init_slice_state(state: dict, flat: torch.Tensor, with_age: bool = False) -> None:
    """Create the slice-shaped state of a flat partition if absent (fp32, on the slice's device);
    ``with_age``: the rows' ages too (staleness), 0 where absent, as in a fresh run."""
    for key in ("exp_avg", "exp_avg_sq", "row_age") if with_age else ("exp_avg", "exp_avg_sq"):
        if key not in state:
            state[key] = torch.zeros_like(flat, dtype=torch.float32, memory_format=torch.contiguous_format)
    if "step" not in state:
        state["step"] = torch.zeros((), dtype=torch.float32)
    elif not torch.is_tensor(state["step"]):
        state["step"] = torch.tensor(float(state["step"]), dtype=torch.float32)
