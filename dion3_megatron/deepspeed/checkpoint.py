"""Checkpoint helpers: universal-checkpoint metadata and ``ds_to_universal`` conversion.

Dion3's ZeRO state (stages 1-3) is shaped like ZeRO's flat partitions, under the keys DeepSpeed's
converter reads (``exp_avg``: momentum, ``exp_avg_sq``: per-row variance repeated over the row; see
:mod:`.zero`), so without staleness the stock converter works unchanged::

    python -m deepspeed.checkpoint.ds_to_universal --input_folder ckpt/step100 \\
        --output_folder ckpt/step100_universal --inject_missing_state

and ``"checkpoint": {"load_universal": true}`` loads the result at any data-parallel size and
ZeRO stage. With staleness the partitions also hold ``row_age``, which the stock converter drops
(it reads its three keys only); :func:`convert_to_universal` keeps it (ZeRO-1/2's loader takes
every key's file, ZeRO-3's through :func:`.zero3.load_universal_settings_and_ages`).
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import tempfile
from typing import Any

import torch


def universal_checkpoint_info() -> dict[str, Any]:
    """``client_state`` entry that ``ds_to_universal`` requires (pass to ``engine.save_checkpoint``)."""
    from deepspeed.checkpoint.constants import (
        UNIVERSAL_CHECKPOINT_INFO,
        UNIVERSAL_CHECKPOINT_VERSION_KEY,
        UNIVERSAL_CHECKPOINT_VERSION_VALUE,
    )

    return {UNIVERSAL_CHECKPOINT_INFO: {UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE}}


def kept_settings(groups: list[dict]) -> list[dict[str, Any]]:
    """Per param group, the settings a checkpoint's groups do not set (how this optimizer stores its
    momentum: ``momentum_dtype``), to set again after a load of DeepSpeed's that sets every saved key."""
    from ..frontend.groups import KEPT_ON_LOAD

    return [{k: group[k] for k in KEPT_ON_LOAD if k != "params" and k in group} for group in groups]


def keep_settings_on_universal_load(original):
    """``ZeROOptimizer.load_hp_checkpoint_state_from_checkpoint_dir`` (the universal-checkpoint
    load of ZeRO-1/2 and BF16_Optimizer), which sets every key of each saved param group on the
    optimizer's: Dion3's groups keep their ``momentum_dtype``, as its other loads keep it (the
    momentum is converted to it at the next step)."""

    def load_hp_checkpoint_state_from_checkpoint_dir(self, lp_groups_name: str, checkpoint_dir: str) -> None:
        from .zero_optimizer import DeepSpeedZeroDion3

        if not isinstance(self.optimizer, DeepSpeedZeroDion3):
            return original(self, lp_groups_name, checkpoint_dir)
        kept = kept_settings(self.optimizer.param_groups)
        original(self, lp_groups_name, checkpoint_dir)
        for group, settings in zip(self.optimizer.param_groups, kept):
            group.update(settings)
        return None

    return load_hp_checkpoint_state_from_checkpoint_dir


def convert_to_universal(input_folder: str, output_folder: str, workers: int = 1) -> None:
    """Run DeepSpeed's ``ds_to_universal`` in this process (``workers`` > 1 uses a process pool).

    ``input_folder`` is one tag's folder (e.g. ``ckpt/global_step3``); the output folder should be
    a sibling of it: its parent's ``latest_universal`` file is updated to name it. Row ages
    (staleness) are converted by a second run of the converter on a copy of the optimizer files
    whose ``exp_avg`` holds them, so they are cut and merged exactly as the momentum is, and land
    in each parameter's ``row_age.pt``.
    """
    from deepspeed.checkpoint import ds_to_universal

    ds_to_universal.main(_converter_args(input_folder, output_folder, workers))
    with tempfile.TemporaryDirectory(dir=os.path.dirname(os.path.abspath(output_folder))) as tmp:
        ages_in, ages_out = os.path.join(tmp, "in"), os.path.join(tmp, "out")
        if not _ages_as_momentum(input_folder, ages_in):
            return
        ds_to_universal.main(_converter_args(ages_in, ages_out, workers))
        for path in glob.glob(os.path.join(ages_out, "zero", "*", "exp_avg.pt")):
            name = os.path.basename(os.path.dirname(path))
            shutil.copyfile(path, os.path.join(output_folder, "zero", name, "row_age.pt"))


def _converter_args(input_folder: str, output_folder: str, workers: int) -> argparse.Namespace:
    return argparse.Namespace(
        input_folder=input_folder,
        output_folder=output_folder,
        num_extract_workers=workers,
        num_merge_workers=workers,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,
    )


def _ages_as_momentum(input_folder: str, output_folder: str) -> bool:
    """A copy of a ZeRO checkpoint folder whose optimizer files hold the row ages as ``exp_avg``
    (zeros for a group without ages); the other files are linked. False (nothing written) when no
    group holds ages."""
    from deepspeed.checkpoint.constants import BASE_OPTIMIZER_STATE, OPTIMIZER_STATE_DICT

    rewritten = {}
    for path in glob.glob(os.path.join(input_folder, "*optim_states.pt")):
        sd = torch.load(path, map_location="cpu", weights_only=False)
        zero = sd[OPTIMIZER_STATE_DICT]  # the optimizer's own state dict: ZeRO-1/2's key, else ZeRO-3's
        states = zero.get(BASE_OPTIMIZER_STATE, zero.get(OPTIMIZER_STATE_DICT))["state"].values()
        if not any("row_age" in state for state in states):
            continue
        for state in states:
            state["exp_avg"] = state.get("row_age", torch.zeros_like(state["exp_avg"]))
        rewritten[os.path.basename(path)] = sd
    if not rewritten:
        return False
    os.makedirs(output_folder)
    for name in os.listdir(input_folder):
        if name in rewritten:
            torch.save(rewritten[name], os.path.join(output_folder, name))
        else:
            os.symlink(os.path.abspath(os.path.join(input_folder, name)), os.path.join(output_folder, name))
    return True
