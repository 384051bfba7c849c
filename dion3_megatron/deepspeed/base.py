"""What DeepSpeed's two Dion3 classes share: the config's ``params`` checked, the param groups
split and checked, the skip counter, the automatic-f record in state dicts and the order of a load.

DeepSpeed builds the optimizer before it decides how to wrap it: :class:`.optimizer.DeepSpeedDion3`
(ZeRO stage 0: whole parameters) is what it constructs for ``"type": "Dion3"``; the hook where
DeepSpeed decides (:func:`dion3_megatron.deepspeed.stage_class`) makes that same object a
:class:`.zero_optimizer.DeepSpeedZeroDion3` when ZeRO (or BF16_Optimizer) will hand it flat
partitions (:func:`become`). The object stays the one the engine, and a client's LR scheduler, refer to.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Iterable

import torch

from .. import options
from ..engine.plan import fraction_record
from ..frontend import announce_skipped_step, groups as grouping
from ..frontend.whole import RECORD
from .config import normalize_params
from .layout import logical


@options.documented(options.DEEPSPEED)
class DeepSpeedFrontEnd(torch.optim.Optimizer):
    """Dion3 for DeepSpeed, either stage: a subclass implements the step and, for the record and
    loading, :meth:`fraction_records`, :meth:`restore_fraction_records`, :meth:`check_loadable` and
    :meth:`load_checked`; :meth:`_start` sets what only it holds.

    Takes the options below, the config's ``params`` (JSON spellings: ``betas`` a list,
    ``ns_dtype`` a string). Unknown keys and out-of-range values raise ValueError at
    construction, i.e. at ``deepspeed.initialize``.

    Options:
{options}
    """

    def __init__(self, params: Iterable[Any], **kwargs: Any) -> None:
        settings, params, defaults, _ = grouping.prepare(type(self).__name__, options.DEEPSPEED,
                                                         _split_partitioned(list(params)), normalize_params(kwargs))
        self.cuda_graph: bool = settings["cuda_graph"]
        self.kernels: str | None = settings["kernels"]
        self.adamw_lr: float = settings["adamw_lr"]
        self.skipped_steps = 0
        super().__init__(params, defaults)
        grouping.warn_without_matrices(type(self).__name__, [{**g, "params": [logical(p) for p in g["params"]]}
                                                             for g in self.param_groups])
        self._start()

    def _start(self) -> None:
        """Set this class's own attributes (also when :func:`become` gives an instance this class)."""
        raise NotImplementedError

    def add_param_group(self, param_group: dict) -> None:
        index = len(self.param_groups)
        if param_group.get("algorithm") == "adamw" and "lr" not in param_group:
            param_group = {**param_group, "lr": self.adamw_lr}
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        grouping.check_group(f"param group {index}", group, options.DEEPSPEED, [logical(p) for p in group["params"]])

    def skip_step(self) -> None:
        """Count and announce one step skipped for a non-finite gradient (nothing else changes)."""
        self.skipped_steps += 1
        announce_skipped_step(self.skipped_steps)

    # --- the record and loading, per class

    def fraction_records(self) -> list[dict[str, float]]:
        """Per param group, {matrix name: f} chosen by "auto" (the record a checkpoint keeps)."""
        raise NotImplementedError

    def restore_fraction_records(self, records: list[dict[str, float]]) -> None:
        """Take a checkpoint's records (checked) for the next step."""
        raise NotImplementedError

    def check_loadable(self, state_dict: dict[str, Any]) -> None:
        """Raise ValueError naming the group, parameter or shape that does not fit; change nothing."""
        raise NotImplementedError

    def load_checked(self, state_dict: dict[str, Any]) -> None:
        """Set the state and the groups' settings of a state dict :meth:`check_loadable` accepted
        (every state shape is checked before any is set)."""
        raise NotImplementedError

    # ---

    def state_dict(self) -> dict[str, Any]:
        """The torch optimizer's state dict, ``"skipped_steps"``, and in each saved param group the
        automatic f chosen for its matrices, ``{matrix name: f}`` under ``"fractions"``."""
        sd = super().state_dict()
        sd["skipped_steps"] = self.skipped_steps
        for saved, record in zip(sd["param_groups"], self.fraction_records()):
            saved[RECORD] = record
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Everything or nothing: the records, the groups and every state shape are checked before
        anything is set."""
        records = read_records(state_dict)
        state_dict = {**state_dict, "param_groups": [settings_of(saved) for saved in state_dict["param_groups"]]}
        self.check_loadable(state_dict)
        self.load_checked(state_dict)
        self.restore_fraction_records(records)
        self.skipped_steps = int(state_dict.get("skipped_steps", 0))

    def _load_groups_and_state(self, state_dict: dict[str, Any], shapes_of) -> None:
        """The state (every shape checked against ``shapes_of(group, p)`` first) and the groups' settings."""
        self.state = defaultdict(dict, grouping.loaded_state(state_dict, self.param_groups, shapes_of))
        for mine, saved in zip(self.param_groups, state_dict["param_groups"]):
            mine.update({k: v for k, v in saved.items() if k != "params"})


def read_records(state_dict: dict[str, Any]) -> list[dict[str, float]]:
    """Each saved param group's record of the automatic f (empty where it has none), checked."""
    return [fraction_record(saved.get(RECORD, {}), f"checkpoint param group {gi} {RECORD}")
            for gi, saved in enumerate(state_dict["param_groups"])]


def settings_of(saved_group: dict[str, Any]) -> dict[str, Any]:
    """A saved param group without its record."""
    return {k: v for k, v in saved_group.items() if k != RECORD}


def become(optimizer: DeepSpeedFrontEnd, cls: type) -> None:
    """Give ``optimizer`` (built, not stepped) the class ``cls`` of the other stage: the same object,
    so every reference to it (the engine's, an LR scheduler's) sees the change. Its own attributes
    are set again from the groups as they are now (DeepSpeed drops empty ones before wrapping)."""
    if optimizer.state:
        raise RuntimeError(f"{type(optimizer).__name__} has stepped or loaded state: it cannot become a {cls.__name__}")
    optimizer.__class__ = cls
    optimizer._start()


def _split_partitioned(params: list) -> list:
    """A plain parameter list that holds ZeRO-3 parameters (built under ``deepspeed.zero.Init``,
    their ``shape`` empty) as a Dion3 and an AdamW group by their logical shapes, as
    :func:`.frontend.groups.split_by_algorithm` splits whole parameters; anything else as it is."""
    tensors = [p[1] if isinstance(p, tuple) else p for p in params]
    if not params or isinstance(params[0], dict) or not any(hasattr(t, "ds_shape") for t in tensors):
        return params
    takes = [grouping.algorithm_of({"algorithm": None}, logical(t)) for t in tensors]
    groups = [{"params": [p for p, a in zip(params, takes) if a == name], "algorithm": name} for name in grouping.ALGORITHMS]
    return [g for g in groups if g["params"]]
