"""Dion3 for Megatron-Core / Megatron-LM 0.19: ``--optimizer dion3``.

[`register`][dion3_megatron.megatron.register] is the one entry point: it applies every change this
package makes to Megatron, each listed with its reason and the upstream version in
``dion3_megatron.megatron.registry.MEGATRON``; ``unregister`` undoes them all.
Importing this package calls it, and so do the launcher and a Megatron tree patched with
patches/megatron-core-0.19-dion3.patch. Then either

* Megatron-LM: ``python -m dion3_megatron.megatron.launch pretrain_gpt.py --optimizer dion3 ...``
  (or ``import dion3_megatron.megatron`` at the top of your training script), or
* Megatron-Core: ``OptimizerConfig(optimizer="dion3", ...)`` and ``get_megatron_optimizer``; set
  ``config.dion3_fraction`` etc. as attributes to change the Dion3 hyper-parameters.

See [docs/megatron.md](../megatron.md).
"""

import sys as _sys

from .arguments import DION3_DEFAULTS, OPTIMIZER_NAME, add_dion3_arguments
from .layout import LogicalMatrix, ParamLayout, describe_model, describe_param
from .optimizer import MegatronDion3
from .registry import config_to_kwargs, init_state_fn, is_registered, register, unregister


def _launcher_starting() -> bool:
    """True while ``python -m dion3_megatron.megatron.launch`` (or torchrun ``-m ...``) imports this
    package on its way to the launcher, which registers Dion3 itself when it runs a script; its
    ``--help`` then needs no Megatron import (and none of Megatron's import-time warnings)."""
    argv = getattr(_sys, "orig_argv", [])
    return any(a == "-m" and b == "dion3_megatron.megatron.launch" for a, b in zip(argv, argv[1:]))


if not _launcher_starting():
    register()

__all__ = [
    "DION3_DEFAULTS",
    "OPTIMIZER_NAME",
    "LogicalMatrix",
    "MegatronDion3",
    "ParamLayout",
    "add_dion3_arguments",
    "config_to_kwargs",
    "describe_model",
    "describe_param",
    "init_state_fn",
    "is_registered",
    "register",
    "unregister",
]
