"""DTensor parameters (FSDP2's ``fully_shard``, alone or with tensor parallelism, on a 1-D or
n-D device mesh): where a rank's values lie in the logical matrices, and optimizer state placed
like them, so ``torch.distributed.checkpoint`` saves it and loads it at another world size.

A mesh dimension whose placement is ``Replicate()`` holds replicas (HSDP's replicate dimension, a
tensor-parallel dimension a matrix is not split over): they step alike. The mesh dimensions that
split a matrix's rows or columns (``Shard(0)`` / ``Shard(1)``, and ``_StridedShard`` where FSDP2
shards a tensor-parallel block further) span the process group the engine exchanges selected rows
over; each rank's piece is a block of rows, of columns, or a box of both. A 3-D parameter (MoE
experts) is a batch of matrices: the mesh dimensions that split its experts (dim 0) give each rank
its own experts, and those that split dims 1 and 2 split each of its local experts alike, over the
ranks that hold the same experts (FSDP2's ``Shard(1)`` of torchtitan's experts when the expert
FSDP degree times the expert-parallel degree exceeds the number of experts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence, TypeGuard, cast

import torch
import torch.distributed as dist

from ..engine import Sharding

try:
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import _StridedShard
except ImportError:  # a torch without DTensor: no parameter is one
    # (stand-ins that no isinstance matches, in place of the classes)
    DTensor, Replicate, Shard, _StridedShard = (), None, None, ()  # type: ignore[misc, assignment]

if TYPE_CHECKING:
    from torch.distributed.tensor import Placement


def is_dtensor(t: Optional[torch.Tensor]) -> TypeGuard[DTensor]:
    return isinstance(t, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds (the tensor itself for a plain one): writing it writes the parameter."""
    return t.to_local() if isinstance(t, DTensor) else t


@dataclass(frozen=True)
class Layout:
    """Where a DTensor parameter's local values lie: its matrices' sharding over ``group`` (None:
    held whole; for a 3-D parameter, every local expert alike), and for a 3-D parameter the index of
    its first local matrix (expert)."""

    sharding: Sharding
    group: Optional[dist.ProcessGroup]
    first_matrix: int = 0


def _sharded_dim(placement) -> Optional[int]:
    """The tensor dimension a placement splits (None for ``Replicate()``)."""
    if isinstance(placement, (Shard, _StridedShard)):
        return placement.dim
    return None


def _described(p: DTensor, why: str) -> str:
    return f"{why}; got shape {tuple(p.shape)} with placements {tuple(p.placements)} on a mesh of shape {tuple(p.device_mesh.shape)}"


def _placement_refusal(p: DTensor) -> Optional[str]:
    """Why the engine does not step the DTensor parameter ``p`` as placed (None: it does)."""
    placements, mesh = tuple(p.placements), p.device_mesh
    if any(not isinstance(pl, (Shard, _StridedShard, Replicate)) for pl in placements):
        return _described(p, "Dion3 takes DTensor parameters placed by Shard, _StridedShard (FSDP2 with tensor parallelism) or Replicate")
    if p.dim() not in (2, 3):
        return _described(p, "Dion3 takes 2-D DTensor matrices and 3-D ones (a batch of matrices: MoE experts)")
    for dim in range(p.dim()):  # contiguous pieces only: cut left to right, or FSDP2's cut of a TP block
        cuts = [(d, pl) for d, pl in enumerate(placements) if _sharded_dim(pl) == dim]
        strided = [d for d, pl in cuts if isinstance(pl, _StridedShard)]
        if strided and (
            len(cuts) != 2
            or strided != [cuts[0][0]]
            or isinstance(cuts[1][1], _StridedShard)
            or cast(_StridedShard, cuts[0][1]).split_factor != mesh.size(cuts[1][0])
        ):
            return _described(p, f"dimension {dim} is cut into pieces that are not contiguous")
    return None


def check_placements(p: DTensor, where: str) -> None:
    """ValueError naming ``where`` (the parameter) where the DTensor parameter ``p`` is placed in a
    way the engine does not step (checked when the optimizer is given it; the step's check,
    :class:`HeldPieces`, refuses the same)."""
    if (why := _placement_refusal(p)) is not None:
        raise ValueError(f"{where}: {why}")


def _local_shape(t: DTensor) -> torch.Size:
    """The shape of the DTensor's local piece (``to_local()`` of a parameter makes a view at each call)."""
    return t._local_tensor.shape


class HeldPieces:
    """The check, at every step, that each DTensor parameter and its gradient are the piece its
    placements give this rank. What depends on the parameter's placements alone (their refusals,
    the local shape) is worked out once per placements; a step compares a few attributes, with no
    collective and no process group, so every rank's verdict enters the step's one decision."""

    def __init__(self) -> None:
        # parameter -> ((placements, mesh, shape, stepped by Dion3), the local shape they give)
        self._held: dict[torch.Tensor, tuple[tuple, torch.Size]] = {}

    def refusal(self, p: DTensor, dion3: bool) -> Optional[str]:
        """Why the step does not take the DTensor parameter ``p`` (``dion3``: stepped by the Dion3
        rule) or its gradient; None when it does."""
        key = (p.placements, p.device_mesh, p.shape, dion3)
        held = self._held.get(p)
        if held is None or held[0] != key:
            why, shape = self._placed(p, dion3)
            if why is not None:
                return why
            held = self._held[p] = (key, shape)
        shape = held[1]
        if _local_shape(p) != shape:
            return _described(p, f"this rank holds {tuple(_local_shape(p))}, not the {tuple(shape)} its placements give")
        grad = p.grad
        if grad is None:
            return None
        if not isinstance(grad, DTensor):
            return _described(p, f"its gradient is a {type(grad).__name__}, not a DTensor placed like the parameter")
        if grad.device_mesh is not p.device_mesh and grad.device_mesh != p.device_mesh:
            return _described(p, f"its gradient lies on another device mesh ({grad.device_mesh})")
        if grad.placements != p.placements:
            return _described(p, f"its gradient is placed {tuple(grad.placements)}, not like the parameter")
        if _local_shape(grad) != shape:
            return _described(
                p, f"its gradient's piece on this rank is {tuple(_local_shape(grad))}, not the {tuple(shape)} its placements give"
            )
        return None

    @staticmethod
    def _placed(p: DTensor, dion3: bool) -> tuple[Optional[str], torch.Size]:
        """The refusal of ``p``'s placements (None) and the local shape they give this rank."""
        mesh = p.device_mesh
        coordinate = mesh.get_coordinate()
        if coordinate is None:
            return (
                _described(
                    p,
                    f"it lies on a device mesh of the ranks {mesh.mesh.flatten().tolist()}, which "
                    f"leaves this rank ({dist.get_rank()}) out; give each rank's optimizer the "
                    "parameters of the meshes that include it",
                ),
                torch.Size(),
            )
        if dion3 and (why := _placement_refusal(p)) is not None:
            return why, torch.Size()
        shape, _ = _compute_local_shape_and_global_offset(p.shape, mesh.shape, list(coordinate), p.placements)
        return None, torch.Size(shape)


def layout(p: DTensor) -> Layout:
    """Where this rank's values of the DTensor parameter ``p`` lie, for a parameter the step's check
    accepted (:class:`HeldPieces`). Makes the process group over the mesh dimensions that split its
    matrices where there are several (once, among their members)."""
    placements, mesh = tuple(p.placements), p.device_mesh
    split = [d for d, pl in enumerate(placements) if _sharded_dim(pl) in (p.dim() - 2, p.dim() - 1)]
    coordinate = mesh.get_coordinate()
    assert coordinate is not None  # the step's check refused a mesh that leaves this rank out
    box = _box(p, coordinate)
    first = box[0][0] if p.dim() == 3 else 0
    if not split:
        return Layout(Sharding.full(), None, first)
    group = _group_over(mesh, split)
    boxes = []
    # Each member's coordinate: mine, but on the split dims. The members share this rank's
    # coordinate on every other mesh dimension, so a 3-D parameter's members hold the same experts.
    for rank in dist.get_process_group_ranks(group):
        at = (mesh.mesh == rank).nonzero()[0].tolist()
        boxes.append(_box(p, [at[d] if d in split else coordinate[d] for d in range(mesh.ndim)])[-2:])
    return Layout(_sharding(boxes, *p.shape[-2:]), group, first)


def _box(p: DTensor, coordinate: Sequence[int]) -> list[tuple[int, int]]:
    """[start, end) per tensor dimension of the piece the mesh coordinate holds."""
    shape, offset = _compute_local_shape_and_global_offset(p.shape, p.device_mesh.shape, list(coordinate), p.placements)
    return [(o, o + s) if s else (n, n) for o, s, n in zip(offset, shape, p.shape)]


def _sharding(boxes: list[list[tuple[int, int]]], n: int, m: int) -> Sharding:
    """Row blocks in rank order, column blocks in rank order, else one box per rank."""
    rows, cols = [b[0] for b in boxes], [b[1] for b in boxes]
    if all(c == (0, m) for c in cols) and _in_order(rows, n):
        return Sharding.rows([0] + [r1 for _, r1 in rows])
    if all(r == (0, n) for r in rows) and _in_order(cols, m):
        return Sharding.cols([0] + [c1 for _, c1 in cols])
    return Sharding.boxes_of([(r0, r1, c0, c1) for (r0, r1), (c0, c1) in boxes])


def _in_order(spans: list[tuple[int, int]], size: int) -> bool:
    ends = [0] + [end for _, end in spans]
    return ends[-1] == size and all(start == ends[i] for i, (start, _) in enumerate(spans))


_groups: dict[tuple[int, ...], dist.ProcessGroup] = {}


def _group_over(mesh, dims: list[int]) -> dist.ProcessGroup:
    """The process group over the mesh dimensions ``dims`` through this rank (the mesh's own for one
    dimension; for several, made once by its members alone and kept)."""
    if len(dims) == 1:
        return mesh.get_group(dims[0])
    coordinate = mesh.get_coordinate()
    index = tuple(slice(None) if d in dims else coordinate[d] for d in range(mesh.ndim))
    ranks = tuple(sorted(mesh.mesh[index].flatten().tolist()))
    if ranks not in _groups:
        group = dist.new_group(list(ranks), use_local_synchronization=True)
        assert isinstance(group, dist.ProcessGroup)  # made by its members alone: this rank is one
        _groups[ranks] = group
    return _groups[ranks]


def _held_as(values: torch.Tensor, mesh, placements: Sequence[Placement], shape: torch.Size, stride: tuple[int, ...]) -> DTensor:
    """``values`` themselves as this rank's piece of a DTensor, where they lie. ``DTensor.from_local``
    would copy them to the mesh's device type, and under FSDP2's ``CPUOffloadPolicy`` a CUDA mesh's
    pieces lie in CPU memory: the state would be a copy on the GPU that the step never updates."""
    spec = DTensorSpec(mesh, tuple(placements), tensor_meta=TensorMeta(shape, stride, values.dtype))
    return DTensor(values, spec, requires_grad=False)


def param_shaped(p: DTensor, values: torch.Tensor) -> torch.Tensor:
    """This rank's values of a state the parameter's shape, as a DTensor placed like ``p`` (a view:
    ``torch.distributed.checkpoint`` saves and reshards it like an FSDP2 AdamW's state)."""
    return _held_as(values, p.device_mesh, p.placements, p.shape, p.stride())


def _state_placements(p: DTensor, rows: Optional[Placement]) -> list[Placement]:
    """The placements of a state with one entry per matrix of ``p`` along its dim 0, cut as ``p``'s
    experts are (a 3-D parameter's dim 0), and (``rows``: the placement of the mesh dimensions that
    split ``p``'s rows, None for one value per matrix) along its dim 1 as ``p``'s rows are;
    replicated over the other mesh dimensions."""
    rows_dim = p.dim() - 2
    placements: list[Placement] = []
    for pl in p.placements:
        dim = _sharded_dim(pl)
        if rows is not None and dim == rows_dim:
            placements.append(_StridedShard(1, split_factor=pl.split_factor) if isinstance(pl, _StridedShard) else rows)
        elif dim == 0 and p.dim() == 3:  # the experts: the state's dim 0 too, cut the same way
            placements.append(pl)
        else:
            placements.append(Replicate())
    return placements


def per_row(p: DTensor, values: torch.Tensor) -> torch.Tensor:
    """This rank's values of a state with one value per matrix row (a variance, an age), ``(matrices,
    rows)`` locally, as a DTensor of shape (the parameter's matrix count, rows) placed like the
    parameter's rows (a view): split where the rows are, replicated where the columns are."""
    count, n = (p.shape[0] if p.dim() == 3 else 1), p.shape[-2]
    return _held_as(values, p.device_mesh, _state_placements(p, Shard(1)), torch.Size((count, n)), (n, 1))


def per_matrix(p: DTensor, values: torch.Tensor) -> torch.Tensor:
    """This rank's values of a state with one value per matrix (a bf16 momentum's count of steps),
    ``(matrices,)`` locally, as a DTensor of shape (the parameter's matrix count,) (a view): split
    where a 3-D parameter's experts are, replicated elsewhere (every rank that holds a piece of a
    matrix holds its count, the same on each), so ``torch.distributed.checkpoint`` saves each count
    once and loads it on any mesh."""
    count = p.shape[0] if p.dim() == 3 else 1
    return _held_as(values, p.device_mesh, _state_placements(p, None), torch.Size((count,)), (1,))


def empty_state(p: DTensor, momentum_dtype: torch.dtype, with_age: bool) -> dict[str, torch.Tensor]:
    """The state of a parameter of which this rank holds no matrix (no local expert), placed like it:
    the momentum in ``momentum_dtype`` (with its count of steps below fp32), the variance and
    (``with_age``) the rows' ages."""
    n, device = p.shape[-2], local(p).device
    rows = {part: per_row(p, torch.zeros(0, n, dtype=torch.float32, device=device)) for part in ("variance", "row_age")[: 1 + with_age]}
    if momentum_dtype != torch.float32:
        rows["rounding_step"] = per_matrix(p, torch.zeros(0, dtype=torch.int64, device=device))
    return {"momentum": param_shaped(p, torch.zeros(local(p).shape, dtype=momentum_dtype, device=device)), **rows}
