"""``DeepSpeedDion3``: the class DeepSpeed builds for ``"optimizer": {"type": "Dion3"}``.

DeepSpeed constructs it with the model's parameters and the config's ``params``; then
* ZeRO stage 0 (fp32, or bf16/fp16 through DeepSpeed's unfused wrapper) steps it on whole
  parameters, as :class:`dion3_megatron.Dion3` does (:mod:`dion3_megatron.frontend.whole`);
* ZeRO stage 1/2 (and BF16_Optimizer) replace each param group's parameters with one flat fp32
  slice; the step then goes through :mod:`.zero`, which gives every Dion3 matrix of a group (whole
  in this rank's slice, or straddling slices) to one megabatch engine and keeps the state
  slice-shaped.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable, Iterable, Mapping, Optional

import torch

from .. import options
from ..engine.plan import fraction_record
from ..frontend import announce_skipped_step, groups as grouping, usable_on_every_rank
from ..frontend.whole import Fractions, WholeParameters
from ..kernels import config as kernel_config
from . import zero
from .config import normalize_params


@options.documented(options.DEEPSPEED)
class DeepSpeedDion3(torch.optim.Optimizer):
    """Dion3 for DeepSpeed: validated config ``params``; ZeRO-1/2 flat slices through the engine.

    Takes the options below, the config's ``params`` (JSON spellings: ``betas`` a list,
    ``ns_dtype`` a string). Unknown keys and out-of-range values raise ValueError at
    construction, i.e. at ``deepspeed.initialize``. Row selection is global (top-k over the whole
    logical matrix) at every stage, so ZeRO-1/2 give the same parameters as ZeRO-0.

    Options:
{options}
    """

    def __init__(self, params: Iterable[Any], **kwargs: Any) -> None:
        settings, params, defaults, _ = grouping.prepare(type(self).__name__, options.DEEPSPEED, params,
                                                         normalize_params(kwargs))
        self.cuda_graph: bool = settings["cuda_graph"]
        self.kernels: Optional[str] = settings["kernels"]
        self.adamw_lr: float = settings["adamw_lr"]
        self.skipped_steps = 0
        self._whole = WholeParameters(self.cuda_graph)  # ZeRO stage 0
        super().__init__(params, defaults)
        grouping.warn_without_matrices(type(self).__name__, self.param_groups)
        # ZeRO swaps each group's params for a flat slice but keeps the group dicts: remember the
        # original parameters of every group (they carry ZeRO's slice mapping after initialize).
        self._originals: dict[int, tuple[dict, list[torch.Tensor]]] = {
            id(g): (g, list(g["params"])) for g in self.param_groups
        }
        self._zero_plans: dict[int, zero.ZeroGroupPlan] = {}
        # Under ZeRO-1/2, per param group index: the automatic f chosen as a checkpoint loaded it,
        # by matrix name, and from checkpoints before that record the f per run of adjacent same-shape
        # whole matrices (else None); the plans built since take it, and their records supersede it.
        self._saved_fractions: dict[int, tuple[dict[str, float], Optional[list[float]]]] = {}

    def add_param_group(self, param_group: dict) -> None:
        index = len(self.param_groups)
        if param_group.get("algorithm") == "adamw" and "lr" not in param_group:
            param_group = {**param_group, "lr": self.adamw_lr}
        super().add_param_group(param_group)
        grouping.check_group(f"param group {index}", self.param_groups[-1], options.DEEPSPEED)
        if hasattr(self, "_originals"):  # (the base class's constructor adds the first groups)
            g = self.param_groups[-1]
            self._originals[id(g)] = (g, list(g["params"]))

    @property
    def fractions(self) -> Fractions:
        """Without ZeRO, the f each matrix of a group with the automatic fraction uses, by parameter
        name (as :attr:`dion3_megatron.Dion3.fractions`); under ZeRO-1/2 the choices are per slice,
        in :meth:`state_dict`'s ``"fractions"``."""
        return self._whole.fractions(grouping.param_names(self.param_groups))

    def skip_step(self) -> None:
        """Count and announce a step skipped for a non-finite gradient (nothing else changes)."""
        self.skipped_steps += 1
        announce_skipped_step(self.skipped_steps)

    # ----------------------------------------------------------------------------------------

    def _zero_group(self, group: dict) -> Optional[list[torch.Tensor]]:
        """The group's original parameters if ZeRO replaced them with a flat slice, else None."""
        entry = self._originals.get(id(group))
        if entry is None or entry[0] is not group:
            return None
        originals = entry[1]
        params = group["params"]
        if (
            len(params) == 1
            and params[0].dim() == 1
            and not any(params[0] is p for p in originals)
            and any(zero.is_zero_linked(p) for p in originals)
        ):
            return originals
        return None

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
        """ZeRO-1/2 (or BF16_Optimizer) replaced the param groups' parameters with flat slices."""
        return any(self._zero_group(g) is not None for g in self.param_groups)

    def state_dict(self) -> dict[str, Any]:
        """Dion3's state dict; under ZeRO-1/2 with the automatic f chosen on this rank's slices
        under ``"fractions"``, ``{param group index: {matrix name: f}}`` (DeepSpeed's default, rigid,
        checkpoints keep it per rank; elastic and universal ones keep only the slice-shaped tensors,
        and a resume from them chooses again)."""
        sd = super().state_dict()
        sd["skipped_steps"] = self.skipped_steps
        if not self._under_zero():
            sd["fractions"] = dict(self._whole.chosen)
            return sd
        index = list(self._originals)
        saved = {**self._saved_fractions, **{index.index(key): (plan.chosen, None) for key, plan in self._zero_plans.items()}}
        sd["fractions"] = {gi: dict(by_name) for gi, (by_name, runs) in saved.items() if runs is None}
        legacy = {gi: {"whole": list(runs), "pieces": dict(by_name)} for gi, (by_name, runs) in saved.items()
                  if runs is not None}
        if legacy:  # loaded from an older checkpoint and not stepped since: kept in its own format
            sd["zero_auto_fractions"] = legacy
        return sd

    def _originals_of(self, group: dict) -> list[torch.Tensor]:
        # Under ZeRO a group's params are one flat slice: a checkpoint's group settings are checked
        # against the group's original parameters (a "dion3" group's slice is 1-D, its matrices not).
        originals = self._zero_group(group)
        return group["params"] if originals is None else originals

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Dion3's load; under ZeRO-1/2 also the automatic f chosen (:meth:`state_dict`), or
        the record of older checkpoints, ``"zero_auto_fractions"``: ``{param group index: {"whole":
        [f per run of adjacent same-shape whole matrices, in slice order] or None, "pieces":
        {matrix name: f}}}``; a plan maps the runs to its whole matrices' names."""
        grouping.check_saved_groups(state_dict["param_groups"], self.param_groups, options.DEEPSPEED, self._originals_of)
        if not self._under_zero():
            chosen = self._whole.saved_record(state_dict, self.param_groups)
            self._load(state_dict)
            self._whole.reset(chosen)
            return
        saved: dict[int, tuple[dict[str, float], Optional[list[float]]]] = {}
        for gi, old in state_dict.get("zero_auto_fractions", {}).items():
            where = f"checkpoint zero_auto_fractions: param group {gi}"
            runs = list(old["whole"]) if old["whole"] is not None else None
            if runs is not None:
                fraction_record({f"whole-matrix run {i}": f for i, f in enumerate(runs)}, where)
            saved[gi] = (fraction_record(old["pieces"], where), runs)
        for gi, by_name in state_dict.get("fractions", {}).items():
            if not isinstance(by_name, Mapping):
                raise ValueError(f"checkpoint fractions: {gi!r}: {by_name!r} is not a record of ZeRO-1/2's, "
                                 "{param group index: {matrix name: f}} (a checkpoint saved without ZeRO?)")
            saved[gi] = (fraction_record(by_name, f"checkpoint fractions: param group {gi}"), None)
        self._load(state_dict)
        self._saved_fractions = saved
        self._zero_plans.clear()  # rebuilt at the next step (by every rank), with these choices

    def _load(self, state_dict: dict[str, Any]) -> None:
        """Every parameter's state and the groups' settings of a checkpoint whose groups, records and
        shapes were checked (all before anything is set)."""
        self.state = defaultdict(dict, grouping.loaded_state(state_dict, self.param_groups, self._state_shapes))
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
            return self._whole.optimizer_step(self.param_groups, self.state, options.DEEPSPEED, closure, self.skip_step)
        if not all(orig is not None for _, orig in zero_groups):
            raise RuntimeError("Dion3: some param groups are ZeRO flat slices and some are not")
        for gi, (group, _) in enumerate(zero_groups):  # a setting changed since construction, before any step
            options.check(f"param group {gi}", **{k: group[k] for k in options.group_keys(options.DEEPSPEED)})
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group, originals in zero_groups:
            flat = group["params"][0]
            if flat.grad is None:
                continue
            plan = self._zero_plans.get(id(group))
            if plan is None or plan.flat is not flat:
                # The index in self.param_groups shifts while ZeRO steps one group at a time;
                # the position among the remembered groups does not.
                index = list(self._originals).index(id(group))
                plan = zero.ZeroGroupPlan(self.cuda_graph, group, originals, index)
                if index in self._saved_fractions:
                    plan.restore_fractions(*self._saved_fractions[index], f"Dion3 param group {index}")
                self._zero_plans[id(group)] = plan
            if not usable_on_every_rank([flat.grad], flat.device, plan.check_group):
                self.skip_step()
                continue
            state = self.state[flat]
            zero.init_slice_state(state, flat, with_age=group["staleness"] > 0)
            state["step"] += 1
            plan.step(group, state)
        return loss
