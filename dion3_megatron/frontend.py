"""What every front end needs besides the engine: the matrix view of a parameter (2-D as is, 3-D a
batch of matrices, 4-D and larger flattened to (out, rest)), and the non-finite gate (a step whose
gradients hold an inf, a NaN or a magnitude >= 2**64 is skipped on every rank together, warned
about and counted).
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.distributed as dist

from .core import rule


def matrix_view(t: torch.Tensor) -> torch.Tensor:
    """View a >= 2-D tensor as a (B, rows, cols) batch: 2-D -> (1, r, c); 3-D as is; 4-D+ flattened
    (a view, so updates land in the tensor itself: 4-D+ needs a contiguous tensor)."""
    if t.dim() == 2:
        return t.unsqueeze(0)
    if t.dim() == 3:
        return t
    return t.view(1, t.shape[0], -1)


def matrix_values(t: torch.Tensor) -> torch.Tensor:
    """:func:`matrix_view` for reading: a copy where no view exists (a channels_last gradient)."""
    return matrix_view(t) if t.dim() <= 3 else t.reshape(1, t.shape[0], -1)


def matrix_shape(t: torch.Tensor) -> tuple[int, int]:
    """(rows, cols) of the matrices of ``matrix_view(t)``, without making the view."""
    return (t.shape[-2], t.shape[-1]) if t.dim() <= 3 else (t.shape[0], math.prod(t.shape[1:]))


def matrix_count(t: torch.Tensor) -> int:
    """How many matrices ``matrix_view(t)`` holds."""
    return t.shape[0] if t.dim() == 3 else 1


def stacked_view(views: list[torch.Tensor]) -> torch.Tensor:
    """One tensor viewing same-shape tensors that lie one after another in one buffer (an engine's
    state of a parameter's matrices), stacked along a new first dimension."""
    first = views[0]
    size = first.numel()
    if any(v.shape != first.shape or v.stride() != first.stride() or v.untyped_storage().data_ptr() !=
           first.untyped_storage().data_ptr() or v.storage_offset() != first.storage_offset() + i * size
           for i, v in enumerate(views)):
        raise RuntimeError("stacked_view: the tensors do not lie one after another in one buffer")
    return first.as_strided((len(views), *first.shape), (size, *first.stride()), first.storage_offset())


def gradients_usable(tensors: list[torch.Tensor]) -> torch.Tensor:
    """A 0-d bool tensor on the tensors' device: every element of every tensor is finite and of
    magnitude below :data:`rule.GRADIENT_LIMIT` (2**64), so the step stays finite throughout.

    One multi-tensor max-abs reduction (NaN propagates through it, +-inf becomes inf) instead of
    several kernels per tensor; the caller decides when to sync on the answer.
    """
    tensors = [t for t in tensors if t.numel()]
    if not tensors:
        return torch.ones((), dtype=torch.bool)
    return torch.stack([n.float() for n in torch._foreach_norm(tensors, float("inf"))]).max() < rule.GRADIENT_LIMIT


def usable_on_every_rank(tensors: list[torch.Tensor], device: torch.device, group=None) -> bool:
    """True when every rank of ``group`` (default: the world) finds its ``tensors`` usable
    (:func:`gradients_usable`): one local reduction, one tiny all-reduce (a rank without tensors
    still joins it), one host sync. Every rank gets the same answer, so all skip or all step."""
    ok = gradients_usable(tensors).to(device=device, dtype=torch.float32)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    return bool(ok)


def announce_skipped_step(skipped_so_far: int, where: str = "") -> None:
    """The warning every Dion3 front end gives when a non-finite gradient skips a step."""
    warnings.warn(
        f"Dion3: non-finite gradient, step skipped (no weight or state changed{where}; a gradient of "
        f"magnitude >= 2**64 counts as non-finite: its square overflows fp32); {skipped_so_far} step(s) "
        f"skipped so far",
        RuntimeWarning,
        stacklevel=4,
    )
