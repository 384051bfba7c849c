"""Which logical matrices a Megatron-Core parameter holds, and how tensor parallelism splits them.

A fused QKV weight holds Q, K and V (interleaved per query group); a SwiGLU ``linear_fc1`` holds
gate and up; everything else holds one matrix. :func:`describe_param` reads Megatron's marks on one
parameter, :func:`describe_model` describes every 2-D parameter of the model chunks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

import torch
import torch.distributed as dist


@dataclass
class LogicalMatrix:
    """One logical matrix inside a parameter (Q, K or V of a fused QKV weight, gate or up of a SwiGLU
    fc1, else the whole weight): working-layout rows [start, stop) of the local tensor. Under
    data-parallel sharding (torch FSDP2), ``bounds``: data-parallel rank r holds the matrix's rows
    [bounds[r], bounds[r + 1])."""

    suffix: str
    start: int
    stop: int
    full_shape: tuple[int, int]
    bounds: tuple[int, ...] = ()


@dataclass
class ParamLayout:
    name: str
    local_shape: tuple[int, int]
    matrices: list[LogicalMatrix]
    partition: Optional[str] = None  # None (whole on this rank), "rows" or "cols" (tensor parallel), "data" (FSDP2)
    group: Any = None  # the group the partition spans
    group_size: int = 1
    perm: Optional[torch.Tensor] = None  # working row i is local row perm[i]; None = identity
    inv_perm: Optional[torch.Tensor] = field(default=None, repr=False)


def _group_size(group) -> int:
    if group is None or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


# A SwiGLU fc1 weight: linear_fc1.weight, or one expert's linear_fc1.weight<i> in TEGroupedMLP.
_GLU_FC1 = re.compile(r"linear_fc1\.weight\d*$")


def describe_param(
    name: str,
    param: torch.Tensor,
    tp_group=None,
    *,
    split_qkv: bool = True,
    split_glu: bool = True,
    gated_linear_unit: bool = False,
) -> ParamLayout:
    """Describe a 2-D Megatron weight: its logical matrices and its tensor-parallel split.

    Reads Megatron's marks: ``tensor_model_parallel`` / ``partition_dim`` (0 column-parallel,
    1 row-parallel), ``is_qkv`` / ``qkv_split_shapes`` (per query group), and the name
    ``linear_fc1.weight`` (``weight0``, ``weight1``, ... per expert in TE's grouped MLP) with
    ``gated_linear_unit`` (each TP rank holds [gate_local; up_local]).
    """
    if param.dim() != 2:
        raise ValueError(f"{name}: Dion3 takes 2-D weights, got shape {tuple(param.shape)}")
    n_loc, m_loc = (int(s) for s in param.shape)
    tp = _group_size(tp_group) if getattr(param, "tensor_model_parallel", False) else 1
    partition_dim = getattr(param, "partition_dim", -1) if tp > 1 else -1
    partition = {0: "rows", 1: "cols"}.get(partition_dim)
    row_mult = tp if partition == "rows" else 1
    m_full = m_loc * (tp if partition == "cols" else 1)
    layout = ParamLayout(name, (n_loc, m_loc), [], partition, tp_group if partition else None, tp if partition else 1)

    split_shapes = getattr(param, "qkv_split_shapes", None)
    if split_qkv and getattr(param, "is_qkv", False) and split_shapes and n_loc % sum(split_shapes) == 0:
        per_group = sum(split_shapes)
        groups = n_loc // per_group
        rows = torch.arange(n_loc).view(groups, per_group)
        perm, start, offset = [], 0, 0
        suffixes = ["q", "k", "v"] if len(split_shapes) == 3 else [f"part{i}" for i in range(len(split_shapes))]
        for suffix, size in zip(suffixes, split_shapes):
            perm.append(rows[:, offset : offset + size].reshape(-1))
            count = groups * size
            layout.matrices.append(LogicalMatrix(suffix, start, start + count, (count * row_mult, m_full)))
            start += count
            offset += size
        layout.perm = torch.cat(perm)
        layout.inv_perm = torch.argsort(layout.perm)
        return layout
    if split_glu and gated_linear_unit and _GLU_FC1.search(name) and n_loc % 2 == 0:
        half = n_loc // 2
        layout.matrices = [
            LogicalMatrix("gate", 0, half, (half * row_mult, m_full)),
            LogicalMatrix("up", half, n_loc, (half * row_mult, m_full)),
        ]
        return layout
    layout.matrices = [LogicalMatrix("", 0, n_loc, (n_loc * row_mult, m_full))]
    return layout


def data_parallel_piece(whole: ParamLayout, rank: int, size: int, group: Any) -> ParamLayout:
    """The layout of the rows of a parameter that torch FSDP2 gives data-parallel rank ``rank`` of
    ``size`` (``Shard(0)``: chunks of ceil(rows / size) rows, the last ones shorter or empty), from
    the layout of the whole parameter (tensor parallel size 1).

    Each logical matrix's rows in a chunk are a contiguous block of that matrix (the rows of a
    query group's Q, K or V follow those of the group before), so every matrix is row-sharded over
    the data-parallel group; a fused QKV chunk is gathered into its working order by a permutation
    of the chunk's own rows, as the whole parameter's is."""
    if whole.partition is not None:
        raise ValueError(f"{whole.name}: data-parallel sharding of a tensor-parallel piece is not supported")
    n, m = whole.local_shape
    chunk = -(-n // size)
    starts = [min(r * chunk, n) for r in range(size + 1)]
    rows = torch.arange(n) if whole.perm is None else whole.perm
    lo, hi = starts[rank], starts[rank + 1]
    piece = ParamLayout(whole.name, (hi - lo, m), [], "data", group, size)
    local_rows, start = [], 0
    for matrix in whole.matrices:
        held = rows[matrix.start : matrix.stop]  # the matrix's rows of the parameter, in order
        bounds = tuple(int(b) for b in torch.searchsorted(held, torch.tensor(starts)))
        mine = held[bounds[rank] : bounds[rank + 1]]
        local_rows.append(mine - lo)
        piece.matrices.append(LogicalMatrix(matrix.suffix, start, start + len(mine), matrix.full_shape, bounds))
        start += len(mine)
    perm = torch.cat(local_rows) if local_rows else torch.zeros(0, dtype=torch.long)
    if not torch.equal(perm, torch.arange(hi - lo)):
        piece.perm, piece.inv_perm = perm, torch.argsort(perm)
    return piece


def fsdp_piece(p: torch.Tensor, whole: ParamLayout) -> ParamLayout:
    """The layout of this rank's rows of a torch FSDP2 parameter (a DTensor, ``Shard(0)`` over the
    data-parallel group), from the layout of the whole parameter; ValueError naming the
    parameter for any other placement."""
    from torch.distributed.tensor import DTensor, Shard

    assert isinstance(p, DTensor)
    mesh = p.device_mesh
    if mesh.ndim != 1 or tuple(p.placements) != (Shard(0),):
        raise ValueError(
            f"{whole.name}: Dion3 under Megatron steps torch FSDP2 parameters sharded by rows over the data-parallel "
            f"group (Shard(0) on a 1-D mesh), got {tuple(p.placements)} on a {mesh.ndim}-D mesh"
        )
    if whole.partition is not None:
        raise ValueError(
            f"{whole.name}: Dion3 under --use-torch-fsdp2 steps tensor-parallel size 1, got a tensor-parallel piece of "
            f"{whole.group_size} ranks; for tensor parallelism use --use-distributed-optimizer without FSDP"
        )
    piece = data_parallel_piece(whole, mesh.get_local_rank(), mesh.size(), mesh.get_group())
    held = tuple(p.to_local().shape)
    if held != piece.local_shape:
        raise ValueError(f"{whole.name}: this rank holds rows of shape {held}, torch FSDP2's Shard(0) gives {piece.local_shape}")
    return piece


def _strip_wrappers(name: str) -> str:
    while name.startswith("module."):
        name = name[len("module.") :]
    return name


def describe_model(
    model_chunks: Iterable[torch.nn.Module],
    pg_collection=None,
    *,
    split_qkv: bool = True,
    split_glu: bool = True,
) -> dict[torch.Tensor, ParamLayout]:
    """A :class:`ParamLayout` for every 2-D parameter of the (possibly DDP-wrapped) model chunks."""
    tp_group = getattr(pg_collection, "tp", None) if pg_collection is not None else None
    expt_tp_group = getattr(pg_collection, "expt_tp", None) if pg_collection is not None else None
    if pg_collection is None and dist.is_initialized():
        try:
            from megatron.core import parallel_state as ps

            tp_group = ps.get_tensor_model_parallel_group(check_initialized=False)
            expt_tp_group = ps.get_expert_tensor_parallel_group(check_initialized=False)
        except Exception:  # noqa: BLE001 - plain torch use without Megatron's parallel state
            pass
    layouts: dict[torch.Tensor, ParamLayout] = {}
    for chunk_index, chunk in enumerate(model_chunks):
        config = getattr(chunk, "config", None)
        gated = bool(getattr(config, "gated_linear_unit", False))
        for raw_name, param in chunk.named_parameters():
            if param.dim() != 2 or param in layouts:
                continue
            name = _strip_wrappers(raw_name)
            is_expert = getattr(param, "expert_tp", False) or ("experts" in name and "shared" not in name)
            group = expt_tp_group if is_expert else tp_group
            prefix = f"chunk{chunk_index}." if chunk_index else ""
            layouts[param] = describe_param(prefix + name, param, group, split_qkv=split_qkv, split_glu=split_glu, gated_linear_unit=gated)
    return layouts
