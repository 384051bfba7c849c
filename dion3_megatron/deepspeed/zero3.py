"""ZeRO stage 3 as Dion3 sees it: the stage-3 optimizer's flat fp32 partitions, and the Dion3
state a universal checkpoint's stage-3 load leaves out.

Stage 3 hands the optimizer one flat fp32 partition per sub-group (a run of whole parameters of
one param group, on one partition process group) at a time, in that param group's ``params``, and
empties ``params`` between steps. :func:`partitions_of` reads, once ZeRO has built them, which
parameters each partition holds and over which process group (:func:`.layout.partition_layout`
says where). The partitions are the same tensors for the life of the engine (checkpoint loads
copy into them).

Stage 3 steps the sub-groups one at a time (``_optimizer_step(sub_group_id)``), but without
optimizer offload (which Dion3 refuses) every sub-group's fp32 partition and state stay in device
memory throughout: Dion3 steps them all when the last one is handed in
(:mod:`.zero_optimizer`), and writes the earlier ones back to their low-precision copies through
ZeRO's own ``_reassign_or_swap_out_partitioned_parameters``.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from .checkpoint import kept_settings
from .zero_optimizer import Partition


def partitions_of(stage3: Any) -> list[Partition]:
    """The sub-groups of a ``DeepSpeedZeroOptimizer_Stage3``, in its order: each one's flat fp32
    partition on this rank, its parameters (in the partition's order) and the process group they
    are cut over."""
    return [
        Partition(stage3.sub_group_to_group_id[i], flat, list(stage3.fp16_groups[i]), stage3.sub_group_process_groups[i])
        for i, flat in enumerate(stage3.fp32_partitioned_groups_flat)
    ]


def load_universal_settings_and_ages(original):
    """``DeepSpeedZeroOptimizer_Stage3.load_hp_checkpoint_state_from_checkpoint_dir_stage3``: after
    DeepSpeed's load, which gives every param group the settings of the checkpoint's first one and
    loads only ``fp32``, ``exp_avg`` and ``exp_avg_sq``, give Dion3's param groups their own
    settings back (its matrices and AdamW tensors sit in different groups; each group's record of
    the automatic f with them; its ``momentum_dtype`` its own, as every load keeps it) and load the
    rows' ages (``row_age``, written by :func:`.checkpoint.convert_to_universal`) where the
    checkpoint has them."""

    def load_hp_checkpoint_state_from_checkpoint_dir_stage3(self, checkpoint_dir):
        from .zero_optimizer import DeepSpeedZeroDion3

        if not isinstance(self.optimizer, DeepSpeedZeroDion3):
            return original(self, checkpoint_dir)
        from deepspeed.checkpoint.constants import OPTIMIZER_STATE_DICT

        saved = torch.load(os.path.join(checkpoint_dir, "zero", "optimizer_state.pt"), weights_only=False)
        saved_groups = saved[OPTIMIZER_STATE_DICT]["param_groups"]
        groups = self.optimizer.param_groups
        if len(saved_groups) != len(groups):
            raise ValueError(
                f"universal checkpoint {checkpoint_dir}: {len(saved_groups)} param groups, the Dion3 optimizer has {len(groups)}"
            )
        kept = kept_settings(groups)
        original(self, checkpoint_dir)
        for group, settings, own in zip(groups, saved_groups, kept):
            group.update({k: v for k, v in settings.items() if k != "params"}, **own)
        for i, params in enumerate(self.fp16_groups):
            folders = [os.path.join(checkpoint_dir, "zero", self.param_names[p]) for p in params]
            if not all(os.path.isfile(os.path.join(folder, "row_age.pt")) for folder in folders):
                continue
            flat = self.fp32_partitioned_groups_flat[i]
            ages = torch.cat(
                [self.load_hp_checkpoint_state(folder, "row_age", param=p).to(flat.device) for folder, p in zip(folders, params)]
            )
            self.optimizer.state[flat]["row_age"] = ages.to(torch.float32)
        return None

    return load_hp_checkpoint_state_from_checkpoint_dir_stage3
