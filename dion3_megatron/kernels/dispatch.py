"""Which backend runs the matrix products of (Gram) Newton-Schulz.

The orthogonalization (:mod:`dion3_megatron.core.ortho`) asks :func:`get_backend` for the backend of
each operand; GPU kernels register a backend and a selector here (:mod:`.backend`). The choice
follows the kernel configuration (:mod:`.config`) in force at the call: kernels "torch" means
plain torch; a forced ``backend`` runs every product; otherwise the registered selectors decide.
This module imports nothing of the package but the configuration, so ortho depends on kernels
and never the other way round.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from . import config as kernel_config


def transposed_view(t: torch.Tensor) -> bool:
    """t (..., M, K) is the transposed view (``.mT``) of a row-major (..., K, M) tensor, and not
    row-major itself: how Newton-Schulz holds a tall matrix (products read it in place)."""
    return t.mT.is_contiguous() and not t.is_contiguous()


def _torch_matmul(a: torch.Tensor, b: torch.Tensor, alpha: float, beta: float, c: Optional[torch.Tensor]) -> torch.Tensor:
    """alpha * a @ b + beta * c."""
    if c is None:
        out = torch.matmul(a, b)
        return out if alpha == 1.0 else out.mul_(alpha)
    if a.dim() == 3:
        return torch.baddbmm(c, a, b, beta=beta, alpha=alpha)
    return torch.addmm(c, a, b, beta=beta, alpha=alpha)


def _torch_gram(x: torch.Tensor, alpha: float, beta: float, c: Optional[torch.Tensor]) -> torch.Tensor:
    """alpha * x @ x^T + beta * c (symmetric result)."""
    return _torch_matmul(x, x.mT, alpha, beta, c)


@dataclass(frozen=True)
class MatmulBackend:
    """The products of (Gram) Newton-Schulz, on 3-D batched operands.

    gram(x, alpha, beta, c)          = alpha * x @ x^T + beta * c       (result symmetric)
    symmetric(a, b, alpha, beta, c)  = alpha * a @ b + beta * c         (a, b symmetric and commuting,
                                                                         so the result is symmetric)
    matmul(a, b)                     = a @ b                             (general)
    A kernel backend may compute one triangle for ``gram`` and ``symmetric`` and mirror it.
    """

    name: str
    gram: Callable[[torch.Tensor, float, float, Optional[torch.Tensor]], torch.Tensor]
    symmetric: Callable[[torch.Tensor, torch.Tensor, float, float, Optional[torch.Tensor]], torch.Tensor]
    matmul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


TORCH_BACKEND = MatmulBackend("torch", _torch_gram, _torch_matmul, torch.matmul)

_BACKENDS: dict[str, MatmulBackend] = {TORCH_BACKEND.name: TORCH_BACKEND}
# name -> selector(x): claims an operand (s x L batch) for its backend, or returns None.
_SELECTORS: dict[str, Callable[[torch.Tensor], Optional[MatmulBackend]]] = {}


def register_backend(backend: MatmulBackend, selector: Optional[Callable] = None) -> None:
    """Make ``backend`` available by name (to force it: ``kernels.configure(backend=name)``);
    ``selector(x)`` may claim operands unless the configuration runs torch alone (``kernels="torch"``)."""
    _BACKENDS[backend.name] = backend
    if selector is not None:
        _SELECTORS[backend.name] = selector


def check_backend_name(name: str) -> None:
    if name not in _BACKENDS:
        raise ValueError(f"backend must be None or one of {sorted(_BACKENDS)}, got {name!r}")


def get_backend(x: torch.Tensor) -> MatmulBackend:
    """The backend that will run products for operand ``x``."""
    config = kernel_config.current()
    if config.backend is not None:
        return _BACKENDS[config.backend]
    if config.kernels == "torch":
        return TORCH_BACKEND
    for selector in _SELECTORS.values():
        chosen = selector(x)
        if chosen is not None:
            return chosen
    return TORCH_BACKEND
