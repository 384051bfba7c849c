"""Whether the rule's row-wise steps run as Triton kernels (:mod:`.triton_rows`) or torch forms.

The kernels run for CUDA weights when triton is installed, neither DION3_FUSED_ROWS=0 (the torch
forms, e.g. to compare) nor DION3_KERNELS=0 (every kernel of the package off) is set, and a kernel
builds on the device (tried once per process and device). :mod:`dion3_megatron.rule` asks
:func:`takes` before each row-wise step; triton itself is imported only once the answer can be yes.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import warnings
from typing import Sequence

import torch


def takes(weights: Sequence[torch.Tensor]) -> bool:
    """The row kernels take these (n, c) matrices: CUDA, triton usable, a layout they write."""
    if not weights or not weights[0].is_cuda or not available():
        return False
    from . import triton_rows

    return triton_rows.usable(list(weights)) and runs_on(weights[0].device)


def takes_momentum(momentum: torch.Tensor, others: Sequence[torch.Tensor] = ()) -> bool:
    """The row kernels take this (B, n, c) fp32 momentum (and these other (n, c) matrices)."""
    return momentum.shape[0] > 0 and momentum.dtype == torch.float32 and takes([momentum[0], *others])


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """triton installed and the kernels not switched off by DION3_FUSED_ROWS=0 or DION3_KERNELS=0."""
    return (os.environ.get("DION3_FUSED_ROWS", "1") != "0" and os.environ.get("DION3_KERNELS", "1") != "0"
            and importlib.util.find_spec("triton") is not None)


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
        warnings.warn(f"dion3_megatron: the Triton row kernels do not run on {device} ({error!r}); using the "
                      "torch forms (the same results to within rounding). DION3_FUSED_ROWS=0 skips this try.",
                      RuntimeWarning, stacklevel=2)
        return False
    return True
