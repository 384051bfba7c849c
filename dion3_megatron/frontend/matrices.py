"""A parameter as matrices: 2-D as is, 3-D a batch of matrices (MoE experts), 4-D and larger
flattened to (out, rest) (conv weights); and one view over same-shape tensors laid end to end."""

from __future__ import annotations

import math

import torch


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
    """One tensor viewing same-shape tensors that lie one after another in one buffer, at equal
    spacing (an engine's state of a parameter's matrices: end to end, or row blocks of a padded
    buffer), stacked along a new first dimension."""
    first = views[0]
    step = views[1].storage_offset() - first.storage_offset() if len(views) > 1 else first.numel()
    if step < first.numel() or any(
        v.shape != first.shape
        or v.stride() != first.stride()
        or v.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
        or v.storage_offset() != first.storage_offset() + i * step
        for i, v in enumerate(views)
    ):
        raise RuntimeError("stacked_view: the tensors do not lie one after another in one buffer at equal spacing")
    return first.as_strided((len(views), *first.shape), (step, *first.stride()), first.storage_offset())
