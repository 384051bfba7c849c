"""``MegatronDion3``'s state dict: what a parameter's entry and a param group hold, and the checks of
a checkpoint before any of it loads.

Megatron's torch_dist checkpoint shards every per-parameter state tensor like its parameter, so an
entry is param-shaped: ``momentum`` (in its dtype: a bf16 momentum is saved in bf16), ``variance``
and, with staleness, ``row_age`` broadcast over the columns (one value per row). What is one number
per optimizer goes where Megatron keeps such numbers, in the param groups (which its checkpoint
saves once, from a rank that holds parameters of the group): the count of steps that a bf16
momentum's stochastic rounding hashes (:data:`ROUNDING_STEP`). Every matrix steps at every step of
the optimizer (a skipped step skips all), so one count is every matrix's.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .. import options
from ..frontend.lifecycle import without_records

ROUNDING_STEP = "rounding_step"
"""The key of the count of steps in each saved param group whose momentum is bf16."""

# A parameter and its state dict entry (momentum, variance, and with staleness row_age).
Entry = tuple[torch.Tensor, dict[str, torch.Tensor]]


def entry_of(momentum: torch.Tensor, rows: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
    """A parameter's entry: a copy of its momentum, and each per-row tensor (variance, row ages)
    broadcast over the columns."""
    per_row = {key: t.unsqueeze(1).expand(momentum.shape).contiguous() for key, t in zip(("variance", "row_age"), rows)}
    return {"momentum": momentum.clone(), **per_row}


def loaded_entries(groups: list[dict], state_dict: dict[str, Any], settings: Sequence[str]) -> list[Entry]:
    """(param, its entry) of every parameter of ``groups`` (the optimizer's) the state dict holds
    state for; ValueError naming the group and the parameter where the groups, their ``settings``
    or an entry's shapes do not fit.

    Row ages (staleness): the groups step with the checkpoint's settings after the load, so a
    checkpoint whose groups have staleness > 0 must hold every parameter's ``row_age``, and one with
    staleness 0 none."""
    saved_groups = without_records(state_dict["param_groups"])
    if len(saved_groups) != len(groups):
        raise ValueError(f"checkpoint has {len(saved_groups)} param groups, the optimizer has {len(groups)}")
    entries = []
    for gi, (mine, saved) in enumerate(zip(groups, saved_groups)):
        merged = {**mine, **saved}
        options.check(f"param group {gi}", **{k: merged[k] for k in settings})
        if len(saved["params"]) != len(mine["params"]):
            raise ValueError(f"param group {gi}: checkpoint has {len(saved['params'])} params, the optimizer has {len(mine['params'])}")
        staleness = merged["staleness"]
        keys = ("momentum", "variance", "row_age") if staleness else ("momentum", "variance")
        for p, pid in zip(mine["params"], saved["params"]):
            entry = state_dict["state"].get(pid)
            if entry is None:
                continue
            got = {k: tuple(v.shape) for k, v in entry.items() if torch.is_tensor(v)}
            if got != {key: tuple(p.shape) for key in keys}:
                raise ValueError(
                    f"param group {gi}, param {pid} (shape {tuple(p.shape)}): checkpoint state {got} "
                    f"is not Dion3 state of this parameter at staleness={staleness!r} "
                    f"(expected {list(keys)}, each of the parameter's shape)"
                )
            entries.append((p, entry))
    return entries


def loaded_rounding_step(state_dict: dict[str, Any]) -> int:
    """The count of steps of a checkpoint's bf16 momenta (0 where it holds none: an fp32 momentum
    converted starts counting); ValueError where a group's is not a count or the groups' differ."""
    counts = {gi: saved[ROUNDING_STEP] for gi, saved in enumerate(state_dict["param_groups"]) if ROUNDING_STEP in saved}
    for gi, count in counts.items():
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise ValueError(f"param group {gi}: {ROUNDING_STEP} must be an int >= 0, got {count!r}")
    if len(set(counts.values())) > 1:
        raise ValueError(f"checkpoint: the param groups' {ROUNDING_STEP} differ ({counts}), though one optimizer steps them all")
    return next(iter(counts.values()), 0)


def conversions(groups: list[dict], saved_groups: list[dict], loaded: list[Entry]) -> set[str]:
    """The momentum dtypes a load converts ("torch.float32 to torch.bfloat16"): each loaded
    momentum's, and its saved group's (fp32 where the group names none, as before bf16 momenta), to
    the ``momentum_dtype`` of its group in ``groups``. (A torch_dist load hands over tensors in the
    dtype of the optimizer's own state, so the saved group's says what the checkpoint held.)"""
    group_of = {p: (mine, saved) for mine, saved in zip(groups, saved_groups) for p in mine["params"]}
    found = set()
    for p, entry in loaded:
        mine, saved = group_of[p]
        wanted = options.momentum_dtype(mine["momentum_dtype"])
        for given in (entry["momentum"].dtype, options.momentum_dtype(saved.get("momentum_dtype", "fp32"))):
            if given != wanted:
                found.add(f"{given} to {wanted}")
    return found
