"""``DeepSpeedZeroDion3``: Dion3 on the flat fp32 partitions ZeRO stages 1-3 (and DeepSpeed's
BF16_Optimizer) hand the optimizer.

ZeRO-1/2 replace each param group's parameters with this rank's flat slice of them and call
``step()`` once per group, with ``param_groups`` holding that group alone; ZeRO-3 cuts every
parameter over the ranks, lays a sub-group's pieces end to end, and calls ``step()`` once per
sub-group, with that sub-group's partition in its group's ``params``; BF16_Optimizer calls it once
with every group's slice. Each call's partitions come with their gradient, already averaged,
unscaled and clipped. The optimizer takes them until it holds every partition of this rank, and
then steps them all at once (:class:`.zero.ZeroStep`): one decision of the non-finite gate, one
engine and so one set of collectives per step, whatever the number of groups and sub-groups.
The partitions handed earlier in the step are written back to ZeRO's low-precision copies (or
swapped out) by the function the ZeRO hook gave (:meth:`DeepSpeedZeroDion3.adopt_partitions`),
as ZeRO does right after each call. The cost: every partition's fp32 gradient lives until the
step (ZeRO-3's ``sub_group_size`` no longer bounds it).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from .. import options
from ..core.rule import Dion3Hyperparameters
from ..engine.session import EngineSession
from ..frontend import groups as grouping
from ..frontend.lifecycle import RECORD, read_records, without_records
from ..kernels import config as kernel_config
from . import slice_state, zero
from .base import DeepSpeedFrontEnd
from .layout import logical, partition_layout, slice_layout


class Partition:
    """One flat fp32 partition this rank steps: its param group, and for ZeRO-3 the parameters its
    pieces belong to (in the partition's order) and the process group they are cut over."""

    def __init__(
        self, group_index: int, flat: torch.Tensor, params: Optional[list[torch.Tensor]] = None, process_group: Any = None
    ) -> None:
        self.group_index, self.flat, self.params, self.process_group = group_index, flat, params, process_group


class DeepSpeedZeroDion3(DeepSpeedFrontEnd):
    """Dion3 under ZeRO stages 1-3: every Dion3 matrix of every partition this rank holds (whole in
    its partition, or a piece of one split over ranks) goes to one megabatch engine; the state is
    partition-shaped (``dion3_megatron.deepspeed.zero``), so DeepSpeed's elastic and universal
    checkpoints handle it.

    ``deepspeed.initialize`` makes the [`DeepSpeedDion3`][dion3_megatron.deepspeed.DeepSpeedDion3] it
    built (or was given) one of these where ZeRO will wrap it; it takes the same options.
    """

    def _start(self) -> None:
        self._groups = list(self.param_groups)  # ZeRO-1/2 show one group at a time while stepping
        # Each group's parameters as given (ZeRO replaces ``params`` with flat partitions), and their
        # shapes (as meta tensors: ZeRO-3 empties a parameter's own shape once it partitions it).
        self._originals = [list(g["params"]) for g in self._groups]
        self._shaped = [[torch.empty(logical(p).shape, dtype=p.dtype, device="meta") for p in given] for given in self._originals]
        self._partitions: list[Partition] = []  # (:meth:`adopt_partitions`)
        self._write_back: Optional[Callable[[int], None]] = None
        self._pending: dict[int, Optional[torch.Tensor]] = {}  # partition index -> its gradient, this step
        self._step_plan: Optional[zero.ZeroStep] = None
        self._session = EngineSession(self.cuda_graph, offload=self.offload)  # (its group: the ZeroStep's check group)
        self._settings = grouping.GroupSettings(self._check_group, options.group_keys(options.DEEPSPEED))
        # Whether a tensor of each group takes the Dion3 rule: its exp_avg then holds the momentum.
        self._dion3_groups = [any(grouping.algorithm_of(g, p) == "dion3" for p in shaped) for g, shaped in zip(self._groups, self._shaped)]
        for gi in range(len(self._groups)):  # at initialize: what only ZeRO refuses (_check_group)
            self._hp(gi)

    def adopt_partitions(self, partitions: list[Partition], write_back: Optional[Callable[[int], None]]) -> None:
        """The partitions ZeRO built (in the order it steps them) and how to write partition ``i``
        back to its low-precision copy once stepped (None: ZeRO hands every partition in one call)."""
        for part in partitions:
            given = {id(p) for p in self._originals[part.group_index]}
            missing = [tuple(logical(p).shape) for p in part.params or () if id(p) not in given]
            if missing:
                raise RuntimeError(
                    f"Dion3 param group {part.group_index}: ZeRO partitions parameters the optimizer was not given (shapes {missing[:3]})"
                )
        self._partitions, self._write_back = partitions, write_back
        self._step_plan = None

    def offload_state(self) -> None:
        """DeepSpeed keeps the partitions in host memory (``offload_optimizer``): so is their
        state, and each step streams them through the GPU (``dion3_megatron.engine.offload``)."""
        self.offload = self._session.offload = True

    def create_partition_state(self) -> None:
        """Create every partition's state now. ZeRO-1/2 link every group's state to the
        parameters' fragments (``safe_get_full_optimizer_state``) once, right after the first call
        of ``step()``; ZeRO-3's universal-checkpoint load reads the first partition's ``step``."""
        for part in self._partitions:
            self._init_state(part)

    def _init_state(self, part: Partition) -> None:
        """A partition's state, where absent: beside it, pinned where a GPU steps it from host memory;
        ``exp_avg`` in its group's momentum dtype (converted where it holds another, DeepSpeed's
        views of it then taken again)."""
        offload = self._session.offload_device(part.flat.device)
        gi = part.group_index
        state = self.state[part.flat]
        pinned = offload is not None and offload.type == "cuda"
        with_age = self._groups[gi]["staleness"] > 0
        if slice_state.init_slice_state(state, part.flat, with_age=with_age, pinned=pinned, momentum_dtype=self._slice_dtype(gi)):
            slice_state.relink_fragments(part.params or self._originals[gi], part.flat, state)

    def _slice_dtype(self, gi: int) -> torch.dtype:
        """What the ``exp_avg`` of group ``gi``'s partitions holds: a Dion3 group's momentum dtype,
        fp32 for AdamW's first moment."""
        return self._hp(gi).momentum_dtype if self._dion3_groups[gi] else torch.float32

    # --- the record

    def _matrix_names(self) -> list[set[str]]:
        """Per param group, the names of its Dion3 matrices (as :class:`.zero.PartitionPlan` names them)."""
        return [
            {
                name
                for j, p in enumerate(shaped)
                if grouping.algorithm_of(group, p) == "dion3"
                for name in grouping.matrix_names(grouping.param_name(gi, j), p)
            }
            for gi, (group, shaped) in enumerate(zip(self._groups, self._shaped))
        ]

    def fraction_records(self) -> list[dict[str, float]]:
        return self._session.records(len(self._groups))

    def restore_fraction_records(self, records: list[dict[str, float]]) -> None:
        self._session.restore(records)

    def _check_records(self, records: list[dict[str, float]], where: str) -> None:
        for gi, (record, names) in enumerate(zip(records, self._matrix_names())):
            unknown = sorted(set(record) - names)
            if unknown:
                raise ValueError(
                    f"{where}: param group {gi} {RECORD} names {unknown[:3]}, which are not Dion3 matrices "
                    "of that group (saved from another model or grouping)"
                )

    def _take_records_in_groups(self) -> None:
        """A universal checkpoint's load sets every saved key of a param group on the group, the
        record too: take those records (checked) for the next build, and leave the groups their settings."""
        if any(RECORD in g for g in self._groups):
            records = read_records({"param_groups": self._groups}, "universal checkpoint")
            self._check_records(records, "universal checkpoint")
            for group in self._groups:
                group.pop(RECORD, None)
            self.restore_fraction_records(records)

    # --- loading

    def load_checked(self, state_dict: dict[str, Any]) -> None:
        """Each partition's state (``exp_avg`` in its group's momentum dtype, the rest fp32) and
        the saved groups' settings."""

        def momentum_key(group: dict) -> Optional[str]:
            return "exp_avg" if self._dion3_groups[self._group_index(group)] else None

        grouping.load_saved(self, state_dict, offloaded=self.offload, momentum_key=momentum_key)

    def check_loadable(self, state_dict: dict[str, Any]) -> None:
        # A checkpoint's group settings are checked against the group's original parameters (a
        # "dion3" group's partition is 1-D, its matrices not), with their logical shapes.
        self._check_records(read_records(state_dict), "checkpoint")
        shaped = {id(g): given for g, given in zip(self._groups, self._shaped)}
        grouping.check_saved_groups(
            without_records(state_dict["param_groups"]), self.param_groups, options.DEEPSPEED, lambda group: shaped[id(group)]
        )
        grouping.check_state_shapes(state_dict, self.param_groups, _partition_state_shapes)

    # --- the step

    def _adopt_groups(self) -> None:
        """Without a ZeRO hook (BF16_Optimizer, which hands every group in one call): each group's
        flat slice."""
        self.adopt_partitions([Partition(gi, g["params"][0]) for gi, g in enumerate(self._groups)], None)

    def _plan(self) -> zero.ZeroStep:
        if self._step_plan is None:
            plans = []
            for i, part in enumerate(self._partitions):
                where = f"Dion3 param group {part.group_index}"
                originals = self._originals[part.group_index]
                device = self._session.compute_device(part.flat.device)
                if part.params is None:
                    layout = slice_layout(part.flat, originals, where, device)
                else:
                    position = {id(p): j for j, p in enumerate(originals)}
                    layout = partition_layout(part.flat, part.params, [position[id(p)] for p in part.params], part.process_group, where)
                plans.append(
                    zero.PartitionPlan(self._groups[part.group_index], self._hp(part.group_index), layout, part.group_index, device)
                )
            self._step_plan = zero.ZeroStep(plans, [self._hp(part.group_index) for part in self._partitions], self._session)
        return self._step_plan

    def _check_group(self, where: str, group: dict) -> None:
        gi = self._group_index(group)
        grouping.check_group(where, group, options.DEEPSPEED, self._shaped[gi])
        adamw = [p for p in self._shaped[gi] if grouping.algorithm_of(group, p) == "adamw"]
        if options.momentum_dtype(group["momentum_dtype"]) != torch.float32 and adamw and self._dion3_groups[gi]:
            raise ValueError(
                f"{where}: momentum_dtype={group['momentum_dtype']!r} stores the exp_avg of the group's ZeRO partitions in "
                f"that dtype, and {len(adamw)} of its tensors take AdamW (shape {tuple(adamw[0].shape)} ...), whose first "
                "moment would be stored so too: give them a param group of their own (algorithm 'adamw'), or set "
                "momentum_dtype='fp32' for this group"
            )

    def _group_index(self, group: dict) -> int:
        return next(i for i, g in enumerate(self._groups) if g is group)

    def _hp(self, gi: int) -> Dion3Hyperparameters:
        return self._settings.of(f"param group {gi}", self._groups[gi])

    @torch.no_grad()
    @kernel_config.scoped_step
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        """Take the partitions ZeRO hands with this call; once every partition of this rank is in,
        step them all (as ``dion3_megatron.deepspeed.zero_optimizer`` describes)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self._partitions:
            self._adopt_groups()
        index = {id(part.flat): i for i, part in enumerate(self._partitions)}
        handed = [p for g in self.param_groups for p in g["params"]]
        for p in handed:
            i = index.get(id(p))
            if i is None:
                raise RuntimeError(
                    f"Dion3: ZeRO stepped a flat tensor of {p.numel()} elements that is none of the "
                    f"{len(self._partitions)} partitions it built"
                )
            if i in self._pending:  # a partition handed again: a new step (the last one was interrupted)
                self._pending.clear()
            self._pending[i] = p.grad
        if len(self._pending) < len(self._partitions):
            return loss
        grads, self._pending = self._pending, {}
        self._step_all(grads, {index[id(p)] for p in handed})
        return loss

    def _step_all(self, grads: dict[int, Optional[torch.Tensor]], handed: set[int]) -> None:
        """The step's one decision over every partition, agreed by every rank before anything
        changes (:meth:`~dion3_megatron.frontend.lifecycle.Dion3FrontEnd.gate_step`), then the step."""
        self._take_records_in_groups()
        plan = self._plan()  # built at the first step (collective): by every rank alike, before the decision
        ordered = [grads[i] for i in range(len(self._partitions))]
        present = [g for g in ordered if g is not None]  # all of them: the check refuses a missing one

        def check() -> list[torch.Tensor]:
            for gi in range(len(self._groups)):  # a setting changed since construction
                self._hp(gi)
            missing = [i for i, g in enumerate(ordered) if g is None]
            if missing:
                raise RuntimeError(f"Dion3: ZeRO handed partitions {missing} of {len(ordered)} without a gradient")
            return present

        if not self.gate_step(check, self._session.compute_device(self._partitions[0].flat.device), plan.check_group):
            return
        states = []
        for part in self._partitions:
            state = self.state[part.flat]
            self._init_state(part)
            # not in place: ZeRO-3's universal-checkpoint load gives every partition one step tensor
            state["step"] = state["step"] + 1
            states.append(state)
        plan.step(self._groups, states, present, [self._hp(part.group_index) for part in self._partitions])
        if self._write_back is not None:
            for i in range(len(self._partitions)):
                if i not in handed:  # ZeRO writes back the ones of this call itself
                    self._write_back(i)


def _partition_state_shapes(group: dict, p: torch.Tensor) -> list[dict[str, tuple]]:
    """The state shapes a checkpoint may hold for a flat partition (:func:`.zero.init_slice_state`),
    whatever the group's algorithm: AdamW's keys, and ``row_age`` after steps with staleness; a
    partition without ages starts them at 0, as Dion3 does when staleness is switched on."""
    plain = {"step": (), "exp_avg": tuple(p.shape), "exp_avg_sq": tuple(p.shape)}
    return [plain, {**plain, "row_age": tuple(p.shape)}]
