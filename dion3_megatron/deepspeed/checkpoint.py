"""Checkpoint helpers: universal-checkpoint metadata and ``ds_to_universal`` conversion.

Dion3's ZeRO-1/2 state is slice-shaped under the keys DeepSpeed's converter reads (``exp_avg``:
momentum, ``exp_avg_sq``: per-row variance repeated over the row; see :mod:`.zero`), so the stock
converter works unchanged::

    python -m deepspeed.checkpoint.ds_to_universal --input_folder ckpt/step100 \\
        --output_folder ckpt/step100_universal --inject_missing_state

and ``"checkpoint": {"load_universal": true}`` loads the result at any data-parallel size.
"""

from __future__ import annotations

import argparse
from typing import Any


def universal_checkpoint_info() -> dict[str, Any]:
    """``client_state`` entry that ``ds_to_universal`` requires (pass to ``engine.save_checkpoint``)."""
    from deepspeed.checkpoint.constants import (UNIVERSAL_CHECKPOINT_INFO, UNIVERSAL_CHECKPOINT_VERSION_KEY,
                                                UNIVERSAL_CHECKPOINT_VERSION_VALUE)

    return {UNIVERSAL_CHECKPOINT_INFO: {UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE}}


def convert_to_universal(input_folder: str, output_folder: str, workers: int = 1) -> None:
    """Run DeepSpeed's ``ds_to_universal`` in this process (``workers`` > 1 uses a process pool).

    ``input_folder`` is one tag's folder (e.g. ``ckpt/global_step3``); the output folder should be
    a sibling of it: its parent's ``latest_universal`` file is updated to name it.
    """
    from deepspeed.checkpoint import ds_to_universal

    args = argparse.Namespace(
        input_folder=input_folder,
        output_folder=output_folder,
        num_extract_workers=workers,
        num_merge_workers=workers,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,
    )
    ds_to_universal.main(args)
