"""Dion3 for Megatron-Core, DeepSpeed and plain PyTorch.

Import :class:`Dion3` for plain PyTorch; ``dion3_megatron.megatron`` and
``dion3_megatron.deepspeed`` register it with those frameworks.
"""

from .optimizer import Dion3
from .core.rule import Dion3Hyperparameters

__all__ = ["Dion3", "Dion3Hyperparameters"]
__version__ = "0.2.0"
