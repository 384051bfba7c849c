"""``DeepSpeedDion3``: the class DeepSpeed builds for ``"optimizer": {"type": "Dion3"}``.

DeepSpeed constructs it with the model's parameters and the config's ``params``; then
* ZeRO stage 0 (fp32, or bf16/fp16 through DeepSpeed's unfused wrapper) steps it on whole
  parameters, as :class:`dion3_megatron.Dion3` does (:mod:`dion3_megatron.frontend.whole`);
* ZeRO stage 1/2 (and BF16_Optimizer) replace each param group's parameters with one flat fp32
  slice, stage 3 with one flat fp32 partition per sub-group (:mod:`.zero3`); the step then goes
  through :mod:`.zero`, which gives every Dion3 matrix of a partition (whole in this rank's
  partition, or split over ranks) to one megabatch engine and keeps the state partition-shaped.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable, Iterable, Mapping, Optional

import torch

from .. import options
from ..engine.plan import fraction_record
from ..frontend import announce_skipped_step, groups as grouping, usable_on_every_rank
from ..frontend.lifecycle import decide_step, read_records, without_records, write_records
from ..frontend.whole import Fractions, WholeParameters
from ..kernels import config as kernel_config
from . import zero
from .config import normalize_params
from .layout import FlatLayout, is_zero_linked, logical, partition_layout, slice_layout
from .zero3 import SubGroup


@options.documented(options.DEEPSPEED)
class DeepSpeedDion3(torch.optim.Optimizer):
    """Dion3 for DeepSpeed: validated config ``params``; ZeRO's flat partitions through the engine.

    Takes the options below, the config's ``params`` (JSON spellings: ``betas`` a list,
    ``ns_dtype`` a string). Unknown keys and out-of-range values raise ValueError at
    construction, i.e. at ``deepspeed.initialize``. Row selection is global (top-k over the whole
    logical matrix) at every stage, so ZeRO-1, 2 and 3 give the same parameters as ZeRO-0.

    Options:
{options}
    """

    def __init__(self, params: Iterable[Any], **kwargs: Any) -> None:
        settings, params, defaults, _ = grouping.prepare(type(self).__name__, options.DEEPSPEED,
                                                         _split_partitioned(list(params)), normalize_params(kwargs))
        self.cuda_graph: bool = settings["cuda_graph"]
        self.kernels: Optional[str] = settings["kernels"]
        self.adamw_lr: float = settings["adamw_lr"]
        self.skipped_steps = 0
        self._whole = WholeParameters(self.cuda_graph)  # ZeRO stage 0
        super().__init__(params, defaults)
        grouping.warn_without_matrices(type(self).__name__, [{**g, "params": [logical(p) for p in g["params"]]}
                                                             for g in self.param_groups])
        # ZeRO swaps each group's params for a flat slice but keeps the group dicts: remember the
        # original parameters of every group (they carry ZeRO's slice mapping after initialize).
        self._originals: dict[int, tuple[dict, list[torch.Tensor]]] = {
            id(g): (g, list(g["params"])) for g in self.param_groups
        }
        # Under ZeRO-3, its sub-groups by id of their flat partitions (:meth:`adopt_partitions`).
        self._partitions: dict[int, SubGroup] = {}
        self._zero_plans: dict[int, zero.ZeroGroupPlan] = {}  # by id of their flat partitions
        # Under ZeRO, per param group index: the automatic f chosen as a checkpoint loaded it,
        # by matrix name, and from checkpoints before that record the f per run of adjacent same-shape
        # whole matrices (else None); the plans built since take it, and their records supersede it.
        self._saved_fractions: dict[int, tuple[dict[str, float], Optional[list[float]]]] = {}

    def add_param_group(self, param_group: dict) -> None:
        index = len(self.param_groups)
        if param_group.get("algorithm") == "adamw" and "lr" not in param_group:
            param_group = {**param_group, "lr": self.adamw_lr}
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        grouping.check_group(f"param group {index}", group, options.DEEPSPEED, [logical(p) for p in group["params"]])
        if hasattr(self, "_originals"):  # (the base class's constructor adds the first groups)
            g = self.param_groups[-1]
            self._originals[id(g)] = (g, list(g["params"]))

    @property
    def fractions(self) -> Fractions:
        """Without ZeRO, the f each matrix of a group with the automatic fraction uses, by parameter
        name (as :attr:`dion3_megatron.Dion3.fractions`); under ZeRO the choices are per partition,
        in :meth:`state_dict`'s ``"fractions"``."""
        return self._whole.fractions(grouping.param_names(self.param_groups))

    def skip_step(self) -> None:
        """Count and announce a step skipped for a non-finite gradient (nothing else changes)."""
        self.skipped_steps += 1
        announce_skipped_step(self.skipped_steps)

    def _gate_step(self, check, device, collective: bool = True) -> bool:
        if decide_step(check, device, collective=collective):
            return True
        self.skip_step()
        return False

    # ----------------------------------------------------------------------------------------

    def adopt_partitions(self, sub_groups: list[SubGroup]) -> None:
        """Under ZeRO-3: the stage-3 optimizer's sub-groups (:func:`.zero3.sub_groups_of`). Every
        param group then holds its sub-groups' flat partitions (one at a time while ZeRO steps, none
        between steps)."""
        given = [{id(p) for p in originals} for _, originals in self._originals.values()]
        for sub in sub_groups:
            missing = [tuple(logical(p).shape) for p in sub.params if id(p) not in given[sub.group_index]]
            if missing:
                raise RuntimeError(f"Dion3 param group {sub.group_index}: ZeRO-3 partitions parameters the optimizer "
                                   f"was not given (shapes {missing[:3]})")
        self._partitions = {id(sub.flat): sub for sub in sub_groups}

    def zero_partitions(self) -> list[tuple[dict, torch.Tensor]]:
        """(param group, flat partition) of every ZeRO partition this rank steps; empty without ZeRO."""
        if self._partitions:
            return [(self.param_groups[sub.group_index], sub.flat) for sub in self._partitions.values()]
        return [(g, g["params"][0]) for g in self.param_groups if self._zero_group(g) is not None]

    def _zero_group(self, group: dict) -> Optional[list[torch.Tensor]]:
        """The group's original parameters if ZeRO replaced them with flat partitions, else None."""
        entry = self._originals.get(id(group))
        if entry is None or entry[0] is not group:
            return None
        originals = entry[1]
        if self._partitions:  # ZeRO-3: every group
            return originals
        params = group["params"]
        if (
            len(params) == 1
            and params[0].dim() == 1
            and not any(params[0] is p for p in originals)
            and any(is_zero_linked(p) for p in originals)
        ):
            return originals
        return None

    def _layout(self, flat: torch.Tensor, originals: list[torch.Tensor], index: int) -> FlatLayout:
        where = f"Dion3 param group {index}"
        sub = self._partitions.get(id(flat))
        if sub is None or sub.flat is not flat:
            if self._partitions:
                raise RuntimeError(f"{where}: ZeRO-3 stepped a flat tensor of {flat.numel()} elements that is none "
                                   "of its sub-groups' partitions")
            return slice_layout(flat, originals, where)
        position = {id(p): j for j, p in enumerate(originals)}
        return partition_layout(flat, sub.params, [position[id(p)] for p in sub.params], sub.process_group, where)

    def _plan(self, group: dict, originals: list[torch.Tensor], flat: torch.Tensor) -> zero.ZeroGroupPlan:
        """The plan of one flat partition, built at its first step (by every rank of its group alike)."""
        plan = self._zero_plans.get(id(flat))
        if plan is None or plan.flat is not flat:
            # The index in self.param_groups shifts while ZeRO-1/2 step one group at a time;
            # the position among the remembered groups does not.
            index = list(self._originals).index(id(group))
            plan = zero.ZeroGroupPlan(self.cuda_graph, group, self._layout(flat, originals, index), index)
            if index in self._saved_fractions:
                plan.restore_fractions(*self._saved_fractions[index], f"Dion3 param group {index}")
            self._zero_plans[id(flat)] = plan
        return plan

    def _state_shapes(self, group: dict, p: torch.Tensor) -> list[dict[str, tuple]]:
        """The state shapes a checkpoint may hold for ``p``: a whole parameter's, or a ZeRO flat
        slice's (:func:`.zero.init_slice_state`), whatever the group's algorithm: AdamW's keys, and
        ``row_age`` after steps with staleness; a slice without ages starts them at 0, as Dion3
        does when staleness is switched on."""
        if self._zero_group(group) is None:
            return grouping.param_state_shapes(group, p)
        plain = {"step": (), "exp_avg": tuple(p.shape), "exp_avg_sq": tuple(p.shape)}
        return [plain, {**plain, "row_age": tuple(p.shape)}]

    def _under_zero(self) -> bool:
        """ZeRO (or BF16_Optimizer) replaced the param groups' parameters with flat partitions."""
        return any(self._zero_group(g) is not None for g in self.param_groups)

    def state_dict(self) -> dict[str, Any]:
        """Dion3's state dict; under ZeRO with the automatic f chosen on this rank's partitions
        under ``"fractions"``, ``{param group index: {matrix name: f}}`` (DeepSpeed's default, rigid,
        checkpoints keep it per rank; elastic and universal ones keep only the slice-shaped tensors,
        and a resume from them chooses again)."""
        sd = super().state_dict()
        sd["skipped_steps"] = self.skipped_steps
        if not self._under_zero():
            write_records(sd, self._whole.group_records(self.param_groups))
            return sd
        built: dict[int, dict[str, float]] = {}
        for plan in self._zero_plans.values():
            built.setdefault(plan.group_index, {}).update(plan.chosen)
        saved = {**self._saved_fractions, **{gi: (by_name, None) for gi, by_name in built.items()}}
        sd["fractions"] = {gi: dict(by_name) for gi, (by_name, runs) in saved.items() if runs is None}
        legacy = {gi: {"whole": list(runs), "pieces": dict(by_name)} for gi, (by_name, runs) in saved.items()
                  if runs is not None}
        if legacy:  # loaded from an older checkpoint and not stepped since: kept in its own format
            sd["zero_auto_fractions"] = legacy
        return sd

    def _originals_of(self, group: dict) -> list[torch.Tensor]:
        # Under ZeRO a group's params are flat partitions: a checkpoint's group settings are checked
        # against the group's original parameters (a "dion3" group's slice is 1-D, its matrices not),
        # with their logical shapes (ZeRO-3 partitions the parameters themselves).
        originals = self._zero_group(group)
        return [logical(p) for p in (group["params"] if originals is None else originals)]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Dion3's load; under ZeRO also the automatic f chosen (:meth:`state_dict`), or
        the record of older checkpoints, ``"zero_auto_fractions"``: ``{param group index: {"whole":
        [f per run of adjacent same-shape whole matrices, in slice order] or None, "pieces":
        {matrix name: f}}}``; a plan maps the runs to its whole matrices' names."""
        if not self._under_zero():
            records = read_records(state_dict)
            grouping.check_saved_groups(without_records(state_dict["param_groups"]), self.param_groups,
                                        options.DEEPSPEED, self._originals_of)
            grouping.check_state_shapes(state_dict, self.param_groups, self._state_shapes)
            self._load(without_records_in(state_dict))
            self._whole.reset(records)
            return
        grouping.check_saved_groups(state_dict["param_groups"], self.param_groups, options.DEEPSPEED, self._originals_of)
        saved: dict[int, tuple[dict[str, float], Optional[list[float]]]] = {}
        for gi, old in state_dict.get("zero_auto_fractions", {}).items():
            where = f"checkpoint zero_auto_fractions: param group {gi}"
            runs = list(old["whole"]) if old["whole"] is not None else None
            if runs is not None:
                fraction_record({f"whole-matrix run {i}": f for i, f in enumerate(runs)}, where)
            saved[gi] = (fraction_record(old["pieces"], where), runs)
        for gi, by_name in state_dict.get("fractions", {}).items():
            if not isinstance(by_name, Mapping):
                raise ValueError(f"checkpoint fractions: {gi!r}: {by_name!r} is not a record of ZeRO's, "
                                 "{param group index: {matrix name: f}} (a checkpoint saved without ZeRO?)")
            saved[gi] = (fraction_record(by_name, f"checkpoint fractions: param group {gi}"), None)
        self._load(state_dict)
        self._saved_fractions = saved
        self._zero_plans.clear()  # rebuilt at the next step (by every rank), with these choices

    def _load(self, state_dict: dict[str, Any]) -> None:
        """Every parameter's state and the groups' settings of a checkpoint whose groups, records and
        shapes were checked (all before anything is set)."""
        grouping.check_state_shapes(state_dict, self.param_groups, self._state_shapes)
        self.state = defaultdict(dict, grouping.loaded_state(state_dict, self.param_groups))
        for mine, saved in zip(self.param_groups, state_dict["param_groups"]):
            mine.update({k: v for k, v in saved.items() if k != "params"})
        self.skipped_steps = int(state_dict.get("skipped_steps", 0))

    @torch.no_grad()
    @kernel_config.scoped_step
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        zero_groups = [(g, self._zero_group(g)) for g in self.param_groups]
        if not any(orig is not None for _, orig in zero_groups):
            zero.warn_if_tensor_parallel_without_zero()
            # ZeRO stage 0: the parameters whole, as the torch optimizer steps them
            return self._whole.optimizer_step(self.param_groups, self.state, options.DEEPSPEED, closure, self._gate_step)
        if not all(orig is not None for _, orig in zero_groups):
            raise RuntimeError("Dion3: some param groups are ZeRO flat slices and some are not")
        for gi, (group, _) in enumerate(zero_groups):  # a setting changed since construction, before any step
            options.check(f"param group {gi}", **{k: group[k] for k in options.group_keys(options.DEEPSPEED)})
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group, originals in zero_groups:
            for flat in group["params"]:  # ZeRO-1/2: the group's slice; ZeRO-3: the sub-group it steps now
                if flat.grad is None:
                    continue
                plan = self._plan(group, originals, flat)
                if not usable_on_every_rank([flat.grad], flat.device, plan.check_group):
                    self.skip_step()
                    continue
                state = self.state[flat]
                zero.init_slice_state(state, flat, with_age=group["staleness"] > 0)
                # not in place: ZeRO-3's universal-checkpoint load gives every partition one step tensor
                state["step"] = state["step"] + 1
                plan.step(group, state)
        return loss


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


def without_records_in(state_dict: dict[str, Any]) -> dict[str, Any]:
    """The state dict with its param groups' records left out (their settings alone)."""
    return {**state_dict, "param_groups": without_records(state_dict["param_groups"])}
