"""The non-finite gate: a step whose gradients hold an inf, a NaN or a magnitude >= 2**64 is
skipped on every rank together, warned about and counted."""

from __future__ import annotations

import warnings
from collections import defaultdict

import torch
import torch.distributed as dist

from ..core import rule


def gradients_usable(tensors: list[torch.Tensor]) -> torch.Tensor:
    """A 0-d bool tensor (on the first tensor's device): every element of every tensor is finite and
    of magnitude below :data:`rule.GRADIENT_LIMIT` (2**64), so the step stays finite throughout.

    One multi-tensor max-abs reduction per device (NaN propagates through it, +-inf becomes inf)
    instead of several kernels per tensor; the caller decides when to sync on the answer.
    """
    by_device: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
    for t in tensors:
        if t.numel():
            by_device[t.device].append(t)
    if not by_device:
        return torch.ones((), dtype=torch.bool)
    largest = [_largest_magnitude(same) for same in by_device.values()]
    return torch.stack([m.to(largest[0].device) for m in largest]).max() < rule.GRADIENT_LIMIT


# On a CPU, tensors up to this size (elements, on average) are read as one concatenated copy: a
# per-tensor reduction costs more than copying them (3.5 us per 16 x 32 tensor against about 2).
_CONCATENATED_ON_CPU = 16384


def _largest_magnitude(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The largest |value| of tensors on one device (NaN if any is NaN), fp32, 0-d."""
    if tensors[0].device.type == "cpu" and sum(t.numel() for t in tensors) <= _CONCATENATED_ON_CPU * len(tensors):
        low, high = torch.aminmax(torch.cat([t.view(-1) if t.is_contiguous() else t.reshape(-1) for t in tensors]))
        return torch.maximum(-low, high).float()  # (NaN propagates through both)
    # (stack promotes mixed dtypes: one op per device, not one per tensor)
    return torch.stack(torch._foreach_norm(tensors, float("inf"))).max().float()


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
