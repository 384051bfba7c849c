"""Parameters that ``torch.distributed.fsdp.fully_shard`` (FSDP2) made DTensors: each rank holds a
block of rows (``Shard(0)``, cut as ``torch.chunk`` cuts: ceil(rows / world) rows each, the last
ranks fewer or none), which the engine steps as a ``Sharding.rows`` piece of the whole logical
matrix over the mesh's process group. Their optimizer state is DTensors too, sharded the same way,
so ``torch.distributed.checkpoint`` saves it and loads it at another world size."""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist

from ..engine import Sharding

try:
    from torch.distributed.tensor import DTensor, Shard
except ImportError:  # a torch without DTensor: no parameter is one
    DTensor, Shard = (), None


def is_dtensor(t: Optional[torch.Tensor]) -> bool:
    return isinstance(t, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds (the tensor itself for a plain one): writing it writes the parameter."""
    return t.to_local() if isinstance(t, DTensor) else t


def param_shaped(p: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """This rank's rows of a state the parameter's shape, as a DTensor placed like ``p`` (a view:
    ``torch.distributed.checkpoint`` saves and reshards it like an FSDP2 AdamW's state)."""
    return DTensor.from_local(rows, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


def per_row(p: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """This rank's values of a state with one value per row (a variance, an age) as a (1, rows)
    DTensor sharded like the rows (a view)."""
    n = p.shape[0]
    return DTensor.from_local(values.unsqueeze(0), p.device_mesh, [Shard(1)], run_check=False, shape=(1, n),
                              stride=(n, 1))


def row_sharding(p: torch.Tensor, where: str) -> tuple[Sharding, dist.ProcessGroup]:
    """Where this rank's rows of a 2-D ``Shard(0)`` DTensor lie, and the process group over them;
    ValueError naming the parameter for a placement the engine does not take."""
    if p.dim() != 2 or len(p.placements) != 1 or p.placements[0] != Shard(0):
        raise ValueError(f"{where}: Dion3 takes DTensor matrices sharded by rows on a 1-D mesh (Shard(0), as "
                         f"fully_shard makes), got shape {tuple(p.shape)} with placements {p.placements}")
    group = p.device_mesh.get_group()
    world = dist.get_world_size(group)
    n = p.shape[0]
    chunk = math.ceil(n / world)
    bounds = [min(r * chunk, n) for r in range(world + 1)]
    rank = dist.get_rank(group)
    if tuple(p.to_local().shape) != (bounds[rank + 1] - bounds[rank], p.shape[1]):
        raise ValueError(f"{where}: this rank holds {tuple(p.to_local().shape)} of the {tuple(p.shape)} matrix, "
                         f"not rows [{bounds[rank]}, {bounds[rank + 1]}) as Shard(0) cuts them")
    return Sharding.rows(bounds), group
