"""Where the parameters of one flat fp32 ZeRO partition lie: which elements of each parameter each
rank holds, and where this rank's lie in its flat tensor.

* ZeRO stage 1/2 (and BF16_Optimizer) lay a param group's parameters end to end and cut the whole
  run into one slice per rank: :func:`slice_layout` reads ZeRO's own mapping of each parameter
  (``_hp_mapping``) and gathers every rank's ranges.
* ZeRO stage 3 cuts every parameter on its own: rank ``r`` of the partition group holds elements
  ``[r * P, (r + 1) * P)`` of the flattened parameter, ``P = ceil(numel / world)``, the end of the
  last ranks' pieces padding; a sub-group's flat partition is its parameters' pieces end to end
  (``P`` elements each, padding included). :func:`partition_layout` computes that, with no
  communication.

Either way a :class:`FlatLayout` is what :class:`.zero.PartitionPlan` turns into engine shards.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

# A parameter as DeepSpeed hands it over: a torch.Tensor with ZeRO's attributes (``_hp_mapping``,
# ``_dp_group``; ZeRO-3's ``ds_numel``, ``partition_numel()``), which carry no type information.
ZeroParam = Any


@dataclass
class FlatLayout:
    """The parameters one flat partition holds elements of, and where they lie."""

    flat: torch.Tensor  # this rank's flat fp32 partition
    params: list[torch.Tensor]  # the parameters (ZeRO-3: partitioned, see :func:`logical`)
    indices: list[int]  # each one's position among its param group's parameters (matrix names)
    starts: list[int]  # where this rank's first element of each lies in ``flat`` (unused where it holds none)
    ranges: torch.Tensor  # (world, params, 2): every rank's [start, end) elements of each (-1: none)
    group: Any  # the process group whose ranks hold the partitions


def logical(p: torch.Tensor) -> torch.Tensor:
    """``p`` with its logical shape: a ZeRO-3 parameter (partitioned, its ``shape`` empty between
    uses, ``ds_shape`` the model's) as a meta tensor of that shape, other tensors as they are."""
    shape = getattr(p, "ds_shape", None)
    return p if shape is None else torch.empty(shape, dtype=p.dtype, device="meta")


def is_zero_linked(p: torch.Tensor) -> bool:
    """True for a parameter ZeRO-1/2 (or BF16_Optimizer) has linked to a flat fp32 partition."""
    return hasattr(p, "_hp_mapping") and hasattr(p, "_dp_group")


def slice_layout(flat: torch.Tensor, originals: list[torch.Tensor], where: str, device: torch.device) -> FlatLayout:
    """A ZeRO-1/2 param group's flat slice (one all_gather of int ranges over its data-parallel
    group, on ``device``: where the step computes, the GPU when the slice is offloaded to the host,
    since an NCCL group takes no CPU tensors)."""
    linked: list[ZeroParam] = [p for p in originals if is_zero_linked(p)]
    if not linked:
        raise RuntimeError(
            f"{where}: its parameters were replaced by a flat tensor but none carries ZeRO's slice "
            "mapping (_hp_mapping), and no ZeRO-3 partition was registered for it"
        )
    group = linked[0]._dp_group
    if any(p._dp_group is not group for p in linked):
        raise RuntimeError(f"{where}: parameters span different data-parallel groups")
    starts = [p._hp_mapping.hp_fragment_address.start if p._hp_mapping is not None else 0 for p in linked]
    return FlatLayout(flat, linked, list(range(len(linked))), starts, _gather_ranges(linked, group, device), group)


def partition_layout(flat: torch.Tensor, params: list[ZeroParam], indices: list[int], group: Any, where: str) -> FlatLayout:
    """A ZeRO-3 sub-group's flat partition: ``params`` in the sub-group's order, each cut into
    ``world`` pieces of ``partition_numel()`` elements over ``group``."""
    world = dist.get_world_size(group)
    ranges = torch.full((world, len(params), 2), -1, dtype=torch.long)
    starts = []
    offset = 0
    for j, p in enumerate(params):
        numel, size = p.ds_numel, p.partition_numel()
        if size * world < numel:
            raise RuntimeError(f"{where}: a parameter of {numel} elements in {world} ZeRO-3 pieces of {size}")
        for r in range(world):
            if r * size < numel:
                ranges[r, j, 0], ranges[r, j, 1] = r * size, min((r + 1) * size, numel)
        starts.append(offset)
        offset += size
    if offset != flat.numel():
        raise RuntimeError(
            f"{where}: the ZeRO-3 partition holds {flat.numel()} elements, its parameters' pieces "
            f"{offset}: DeepSpeed laid it out otherwise than this version of Dion3 expects"
        )
    return FlatLayout(flat, list(params), list(indices), starts, ranges, group)


def _gather_ranges(linked: list[ZeroParam], group, device) -> torch.Tensor:
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


def param_bounds(ranges: torch.Tensor, numel: int, where: str) -> list[int]:
    """Monotone bounds (world + 1) of one parameter's element ranges over the ranks, in rank order."""
    bounds = [0]
    for start, end in ranges.tolist():
        if start < 0:
            bounds.append(bounds[-1])
            continue
        if start != bounds[-1]:
            raise RuntimeError(
                f"{where}: ZeRO slices of a parameter are not contiguous in rank order "
                f"(a rank starts at element {start}, expected {bounds[-1]})"
            )
        bounds.append(end)
    if bounds[-1] != numel:
        raise RuntimeError(f"{where}: ZeRO slices cover {bounds[-1]} of the parameter's {numel} elements")
    return bounds
