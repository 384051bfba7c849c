"""Megatron-Core's noise out of the examples' logs: the warnings it gives at every import on every
rank without apex or Transformer Engine, torch's deprecation notices of the collectives it calls, and
its chatty loggers. Nothing that trains changes."""

from __future__ import annotations

import logging
import warnings


def quiet_megatron() -> None:
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    warnings.filterwarnings("ignore", message=r".*\.grad attribute of a Tensor that is not a leaf")
    warnings.filterwarnings("ignore", message=r"'pin_memory' argument is set as true but no accelerator is found")
    for name in ("torch.utils.cpp_extension", "megatron.core.models.gpt.gpt_model", "megatron.core.rerun_state_machine"):
        logging.getLogger(name).setLevel(logging.ERROR)
