"""torchtitan trainer configs with Dion3, for ``--module dion3_megatron.torchtitan --config NAME``
(torchtitan's config manager imports this module and calls NAME). Each registers Dion3 first: the
trainer builds its optimizer in the same process."""

from __future__ import annotations

from .config import optimizer_config
from .registry import register


def llama3_debugmodel_dion3():
    """torchtitan's ``llama3_debugmodel`` with Dion3 on the hidden matrices, AdamW on the rest."""
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    register()
    config = llama3_debugmodel()
    config.optimizer = optimizer_config()
    return config


def llama3_8b_dion3():
    """torchtitan's ``llama3_8b`` with Dion3 on the hidden matrices, AdamW on the rest."""
    from torchtitan.models.llama3.config_registry import llama3_8b

    register()
    config = llama3_8b()
    config.optimizer = optimizer_config()
    return config
