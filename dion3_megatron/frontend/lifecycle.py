"""What every Dion3 front end does around the engine, written once.

A front end (the torch ``Dion3``, DeepSpeed's classes, ``MegatronDion3``) adapts how its framework
hands over parameters; :class:`Dion3FrontEnd` owns the rest:

* the step's one decision (:func:`decide_step`): every check and the non-finite gate, agreed by
  every rank in one tiny all-reduce before any tensor changes, at every step;
* the skip counter, ``skipped_steps``: one per skipped step, whatever the number of groups,
  partitions or sub-groups it spans;
* the record of the automatic f (:data:`RECORD`): one key and one schema in every checkpoint
  format;
* ``load_state_dict``'s order: everything checked, then everything set.

Beneath it, :class:`~dion3_megatron.engine.session.EngineSession` owns the engine across steps
(speeds, builds, the record's gather), and the option spec (:mod:`dion3_megatron.options`) checks
every setting where it enters.

To add a front end:

1. Subclass :class:`Dion3FrontEnd`, set ``FRONT_END`` (add its name to ``options.FRONT_ENDS`` and to
   the ``front_ends`` of the options it takes), and spell its options out as keyword-only
   constructor parameters ending in ``**unknown: Never``; check them with
   ``options.refuse_unknown`` and ``options.settings`` (tests/unit/test_options.py checks the signature
   against the spec).
2. Check param groups where they enter (``add_param_group``: ``frontend.groups.check_group_keys``
   and ``check_group``) and read their settings at a step through ``frontend.groups.GroupSettings``.
3. Describe what the framework hands over as :class:`~dion3_megatron.engine.MatrixShard` s (whole,
   row or column blocks, boxes, flat pieces) and step them through one ``EngineSession``
   (``engine_for`` with a key naming what they were built from; ``gather=True`` where ranks hold
   different matrices).
4. In ``step()``, run every check through :meth:`Dion3FrontEnd.gate_step` before anything changes.
5. Implement :meth:`~Dion3FrontEnd.fraction_records` / :meth:`~Dion3FrontEnd.restore_fraction_records`
   (the session's ``records`` / ``restore``), :meth:`~Dion3FrontEnd.check_loadable` and
   :meth:`~Dion3FrontEnd.load_checked`.
6. Compare every layout with the single-process ``Dion3`` on whole matrices in a test.
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from ..core import cost_model
from .gate import announce_skipped_step, gradients_usable

RECORD = "fractions"
"""The key of the automatic-f record: each saved param group holds ``{matrix name: f}`` for its
matrices whose fraction is "auto", so a resume (at any world size, in any checkpoint format that
keeps param groups) steps each matrix at the f chosen when it first stepped."""

_REFUSED, _SKIP, _STEP = -1.0, 0.0, 1.0


def read_records(state_dict: Mapping[str, Any], where: str = "checkpoint") -> list[dict[str, float]]:
    """Each saved param group's record (empty where a group has none), checked: matrix names map to
    one of the f the cost model offers; ValueError naming the group, the name and the value."""
    records = []
    for gi, saved in enumerate(state_dict["param_groups"]):
        record = saved.get(RECORD, {})
        if not isinstance(record, Mapping):
            raise ValueError(f"{where}: param group {gi}: {RECORD!r} must map matrix names to f, got {record!r}")
        for name, f in record.items():
            if not isinstance(name, str) or f not in cost_model.CANDIDATE_FRACTIONS:
                raise ValueError(f"{where}: param group {gi}: {name!r} has fraction {f!r}, not one of {cost_model.CANDIDATE_FRACTIONS}")
        records.append({name: float(f) for name, f in record.items()})
    return records


def write_records(state_dict: dict[str, Any], records: Sequence[Mapping[str, float]]) -> None:
    """Put ``records[i]`` under :data:`RECORD` in the state dict's param group i."""
    groups = state_dict["param_groups"]
    if len(records) != len(groups):
        raise AssertionError(f"{len(records)} records for {len(groups)} param groups")
    for saved, record in zip(groups, records):
        saved[RECORD] = dict(record)


def without_records(saved_groups: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The saved param groups without their records: their parameters and settings alone."""
    return [{k: v for k, v in saved.items() if k != RECORD} for saved in saved_groups]


class StepRefused(RuntimeError):
    """Raised on the ranks whose own checks passed when another rank's refused the step."""


def _distributed(group: Optional[dist.ProcessGroup]) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def decide_step(
    check: Callable[[], Sequence[torch.Tensor]], device: torch.device, group: Optional[dist.ProcessGroup] = None, collective: bool = True
) -> bool:
    """The step's one decision, the same on every rank of ``group`` (default: the world).

    ``check()`` runs this rank's checks (it raises, naming the parameter and the value, for what
    the step does not take) and returns the gradients to gate. One all-reduce (MIN) of a code
    (refused, non-finite, step) agrees: if any rank refused, every rank raises (that rank its own
    error, the others :class:`StepRefused` naming the ranks that refused and the first one's error,
    found by one all_gather on that path alone), so none waits in a later collective; else True when every gradient on
    every rank is usable (:func:`~.gate.gradients_usable`), False when the step is skipped.
    ``collective=False``: this rank decides alone (ranks that do not step together).
    """
    error: Optional[BaseException] = None
    try:
        code = gradients_usable(list(check())).to(device=device, dtype=torch.float32)
    except (ValueError, TypeError, RuntimeError) as e:
        error, code = e, torch.full((), _REFUSED, device=device)
    if collective and _distributed(group):
        agreed = code.clone()
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
        if float(agreed) == _REFUSED:
            # (the refusal path alone: every rank learns which ranks refused, and why)
            said: list = [None] * dist.get_world_size(group)
            dist.all_gather_object(said, None if error is None else f"{type(error).__name__}: {error}", group=group)
            refusing = [(dist.get_global_rank(group, i) if group is not None else i, why) for i, why in enumerate(said) if why is not None]
            if error is not None:
                raise error
            first_rank, first_why = refusing[0]
            raise StepRefused(
                f"Dion3: the step was refused on rank(s) {[r for r, _ in refusing]}; nothing changed on any rank. "
                f"Rank {first_rank}: {first_why}"
            )
        code = agreed
    if error is not None:
        raise error
    return float(code) == _STEP


class Dion3FrontEnd(torch.optim.Optimizer):
    """The base of every Dion3 optimizer class: the skip counter and its announcement, the step's
    decision, the automatic-f record in state dicts, and ``load_state_dict``'s order (everything
    checked, then everything set). A front end implements :meth:`fraction_records`,
    :meth:`restore_fraction_records`, :meth:`check_loadable` and :meth:`load_checked`."""

    FRONT_END: ClassVar[str]  # the option spec's name of the front end (options.TORCH, ...)

    def __init__(self, params: Any, defaults: dict[str, Any]) -> None:
        self.skipped_steps = 0
        super().__init__(params, defaults)

    # ----------------------------------------------------------------------------------------
    # The step's decision.

    def skip_step(self, where: str = "") -> None:
        """Count one skipped step and warn (nothing else changes)."""
        self.skipped_steps += 1
        announce_skipped_step(self.skipped_steps, where)

    def gate_step(
        self,
        check: Callable[[], Sequence[torch.Tensor]],
        device: torch.device,
        group: Optional[dist.ProcessGroup] = None,
        collective: bool = True,
    ) -> bool:
        """:func:`decide_step`; a skipped step is counted and announced here."""
        if decide_step(check, device, group, collective):
            return True
        self.skip_step()
        return False

    # ----------------------------------------------------------------------------------------
    # What a front end provides.

    def fraction_records(self) -> list[dict[str, float]]:
        """Per param group, the automatic f its matrices were given, by matrix name."""
        raise NotImplementedError

    def restore_fraction_records(self, records: list[dict[str, float]]) -> None:
        """A checkpoint's records (checked), for the engine built at the next step."""
        raise NotImplementedError

    def check_loadable(self, state_dict: dict[str, Any]) -> None:
        """Raise, naming what does not fit, where the state dict does not fit this optimizer;
        change nothing."""
        raise NotImplementedError

    def load_checked(self, state_dict: dict[str, Any]) -> None:
        """Set the state and the groups' settings of a state dict :meth:`check_loadable` accepted."""
        raise NotImplementedError

    # ----------------------------------------------------------------------------------------
    # State.

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        sd["skipped_steps"] = self.skipped_steps
        write_records(sd, self.fraction_records())
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load everything or nothing: the records, the groups and every state's shapes are checked
        before anything is set."""
        records = read_records(state_dict)
        self.check_loadable(state_dict)
        self.load_checked(state_dict)
        self.restore_fraction_records(records)
        self.skipped_steps = int(state_dict.get("skipped_steps", 0))
