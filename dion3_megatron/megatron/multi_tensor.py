"""Foreach forms of Megatron-Core 0.19's multi-tensor fallbacks (no apex, no Transformer Engine).

Without apex's ``amp_C`` or Transformer Engine, Megatron computes the gradient norm, the clipping
and the main-to-model parameter copies with per-tensor Python loops (``megatron.core.utils``):
the norm turns a list of per-tensor norms into a tensor on the host, one device synchronization per
gradient, and scaling or copying allocates a temporary per tensor. With ``--optimizer dion3`` the
step runs these twice (the layer-wise Dion3 optimizer and the embeddings' Adam are chained), so they
weigh on Dion3 most.

:func:`foreach_form` gives ``torch._foreach_*`` forms of the same operations, which
:func:`dion3_megatron.megatron.register` puts in their place (entries of
:data:`.registry.MEGATRON`): the same per-element arithmetic (scaling and copies
bit-identical; the norm the same sum of squares, reduced in another order on the device, so equal
to a few ulps) and no synchronization until Megatron's own ``.item()``, for the steps of Dion3's
Megatron wrappers alone (:func:`dion3_step`): every other call, every other optimizer's step,
runs Megatron's own loop. Nothing is replaced where apex or Transformer Engine provide the fused
kernels (:func:`is_local_fallback`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Callable, Iterator, Optional

import torch

logger = logging.getLogger(__name__)
_announced = False  # the first norm says the foreach forms run (then Megatron's logging is set up)
_dion3_steps = 0  # how many steps of Dion3's wrappers are running (nested: a chain and its member)


@contextlib.contextmanager
def dion3_step() -> Iterator[None]:
    """Within it (a step of Dion3's Megatron wrappers) the foreach forms replace Megatron's loops."""
    global _dion3_steps
    _dion3_steps += 1
    try:
        yield
    finally:
        _dion3_steps -= 1


def foreach_l2_norm(
    chunk_size: int, noop_flag: torch.Tensor, tensor_lists: list[list[torch.Tensor]], per_tensor: bool, *args
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Drop-in for ``amp_C.multi_tensor_l2norm`` / ``local_multi_tensor_l2_norm``: the l2 norm of all
    tensors of ``tensor_lists[0]`` as a 1-element fp32 tensor on their device (and, with
    ``per_tensor``, each tensor's norm)."""
    global _announced
    if not _announced:
        _announced = True
        logger.info(
            "Megatron-Core without apex or Transformer Engine: its gradient norm, clipping and "
            "parameter copies run as torch foreach ops (dion3_megatron.megatron.multi_tensor)"
        )
    tensors = tensor_lists[0]
    if not tensors:
        return torch.zeros(1, device=noop_flag.device), None
    norms = torch.stack([n.float() for n in torch._foreach_norm(tensors)])
    return torch.linalg.vector_norm(norms).reshape(1), (norms if per_tensor else None)


def foreach_scale(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: list[list[torch.Tensor]], scale: float) -> None:
    """Drop-in for ``amp_C.multi_tensor_scale`` / ``local_multi_tensor_scale``: dst = src * scale,
    per element as the loop computes it (in place when dst is src; a plain copy at scale 1)."""
    src, dst = tensor_lists
    if not dst:
        return
    if all(s is d for s, d in zip(src, dst)):
        torch._foreach_mul_(dst, scale)
    elif scale == 1.0:
        torch._foreach_copy_(dst, src)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, scale))


def is_local_fallback(current) -> bool:
    """Whether ``current`` is one of Megatron's local (per-tensor loop) multi-tensor fallbacks."""
    from megatron.core import utils

    return current is utils.local_multi_tensor_l2_norm or current is utils.local_multi_tensor_scale


def foreach_form(local: Callable) -> Callable:
    """One of Megatron's local fallbacks, in its foreach form within :func:`dion3_step`."""
    from megatron.core import utils

    foreach = {utils.local_multi_tensor_l2_norm: foreach_l2_norm, utils.local_multi_tensor_scale: foreach_scale}[local]

    @functools.wraps(local)
    def in_dion3_steps_foreach(*args, **kwargs):
        return (foreach if _dion3_steps else local)(*args, **kwargs)

    return in_dion3_steps_foreach


__all__ = ["dion3_step", "foreach_form", "foreach_l2_norm", "foreach_scale", "is_local_fallback"]
