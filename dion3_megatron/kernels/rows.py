"""Whether the rule's row-wise steps run as Triton kernels (:mod:`.triton_rows`) or torch forms.

The kernels run for CUDA weights when triton is installed, the kernel configuration in force
allows them (:func:`.config.row_kernels_enabled`: not ``kernels="torch"``, and fused_rows on, whose defaults
DION3_KERNELS=0 and DION3_FUSED_ROWS=0 turn off), and a kernel builds on the device (tried once per
process and device). :mod:`dion3_megatron.core.rule` asks :func:`takes` before each row-wise step, and
:mod:`dion3_megatron.core.ortho` asks :func:`takes_block` before normalizing Newton-Schulz's input;
triton itself is imported only once the answer can be yes.
"""

from __future__ import annotations

import functools
import importlib.util
import warnings
from typing import Sequence

import torch

from . import config

HALF = (torch.float16, torch.bfloat16)


def takes(weights: Sequence[torch.Tensor]) -> bool:
    """The row kernels take these (n, c) matrices: CUDA, triton usable, a layout they write."""
    if not weights or not weights[0].is_cuda or not available():
        return False
    from . import triton_rows

    return triton_rows.usable(list(weights)) and runs_on(weights[0].device)


def takes_momentum(momentum: torch.Tensor, others: Sequence[torch.Tensor] = ()) -> bool:
    """The row kernels take this (B, n, c) fp32 momentum (and these other (n, c) matrices)."""
    return momentum.shape[0] > 0 and momentum.dtype == torch.float32 and takes([momentum[0], *others])


def takes_block(x: torch.Tensor, dtype: torch.dtype) -> bool:
    """The normalization kernel takes this (B, s, L) Newton-Schulz input, written in ``dtype``:
    CUDA, a half-precision result, an input it reads, each matrix a dense block."""
    if not x.is_cuda or not x.numel() or dtype not in HALF or x.dtype not in (torch.float32, *HALF) or not available():
        return False
    from . import triton_rows

    return triton_rows.dense_matrices(x) and runs_on(x.device)


def available() -> bool:
    """The configuration in force allows the row kernels, and triton is installed."""
    return config.row_kernels_enabled() and _triton_installed()


@functools.lru_cache(maxsize=None)
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


@functools.lru_cache(maxsize=None)
def runs_on(device: torch.device) -> bool:
    """Whether a row kernel compiles and runs on ``device``, tried once per process and device.

    Triton builds each kernel's launcher with the host's C compiler on first use; where that fails
    (a container without one), the step keeps the torch forms, which give the same results to
    within rounding, and says so once.
    """
    from . import triton_rows

    try:
        triton_rows.probe(device)
    except Exception as error:  # a compile or launch failure: nothing has been written yet
        warnings.warn(
            f"dion3_megatron: the Triton row kernels do not run on {device} ({error!r}); using the "
            "torch forms (the same results to within rounding). DION3_FUSED_ROWS=0 skips this try.",
            RuntimeWarning,
            stacklevel=2,
        )
        return False
    return True
