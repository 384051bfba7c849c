"""frontend.lifecycle: the step's one decision (alone, and agreed by 2 gloo ranks without a hang
when one refuses), the automatic-f record in state dicts, and load_state_dict's order (everything
checked, then everything set)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from dion3_megatron import Dion3, options
from dion3_megatron.frontend.lifecycle import RECORD, Dion3FrontEnd, StepRefused, decide_step, read_records, without_records, write_records
from support.dist_utils import run_distributed

CPU = torch.device("cpu")


def _refuse() -> list[torch.Tensor]:
    raise ValueError("w: refused here")


def _gradients(generator: torch.Generator, bad: float = 0.0) -> list[torch.Tensor]:
    grads = [torch.randn(5, 3, generator=generator), torch.randn(4, generator=generator)]
    if bad:
        grads[1][2] = bad
    return grads


@pytest.mark.parametrize("collective", [True, False])
def test_decide_step_alone_steps_skips_and_raises_the_checks_error(generator, collective):
    assert decide_step(lambda: _gradients(generator), CPU, collective=collective) is True
    assert decide_step(lambda: [], CPU, collective=collective) is True  # no gradient: nothing to gate
    for bad in (float("nan"), float("inf"), -(2.0**64)):
        assert decide_step(lambda b=bad: _gradients(generator, b), CPU, collective=collective) is False, bad
    with pytest.raises(ValueError, match="^w: refused here$"):
        decide_step(_refuse, CPU, collective=collective)


def _decisions(rank: int, world: int) -> dict[str, Any]:
    """Each case's outcome on this rank: True/False, or the error's type and message."""
    generator = torch.Generator().manual_seed(10 + rank)
    cases = {
        "fine": lambda: _gradients(generator),
        "non-finite on rank 1": lambda: _gradients(generator, float("nan") if rank == 1 else 0.0),
        "refused on rank 1": _refuse if rank == 1 else lambda: _gradients(generator),
        "refused on rank 1, non-finite on rank 0": _refuse if rank == 1 else lambda: _gradients(generator, 2.0**64),
        "refused on every rank": _refuse,
    }
    outcomes: dict[str, Any] = {}
    for name, check in cases.items():
        try:
            outcomes[name] = decide_step(check, CPU)
        except (ValueError, StepRefused) as e:
            outcomes[name] = (type(e).__name__, str(e))
    return outcomes


@pytest.mark.slow
def test_decide_step_is_agreed_by_every_rank():
    rank0, rank1 = run_distributed(_decisions, 2, timeout=120)  # a rank left waiting fails by the timeout
    assert rank0["fine"] is rank1["fine"] is True
    assert rank0["non-finite on rank 1"] is rank1["non-finite on rank 1"] is False
    for case in ("refused on rank 1", "refused on rank 1, non-finite on rank 0"):
        kind, message = rank0[case]
        assert kind == "StepRefused" and "rank(s) [1]" in message and "nothing changed" in message, rank0[case]
        assert message.endswith("Rank 1: ValueError: w: refused here"), message  # every rank's log says why
        assert rank1[case] == ("ValueError", "w: refused here"), rank1[case]
    assert rank0["refused on every rank"] == rank1["refused on every rank"] == ("ValueError", "w: refused here")


def _state_dict(records: list) -> dict[str, Any]:
    return {"state": {}, "param_groups": [{"params": [0], "lr": 0.1, **({RECORD: r} if r is not None else {})} for r in records]}


def test_records_written_are_read_back_per_group():
    sd = _state_dict([None, None, None])
    write_records(sd, [{"a": 0.25, "b.matrix0": 1.0}, {}, {"c": 0.125}])
    assert read_records(sd) == [{"a": 0.25, "b.matrix0": 1.0}, {}, {"c": 0.125}]
    assert without_records(sd["param_groups"]) == [{"params": [0], "lr": 0.1}] * 3
    assert read_records(_state_dict([None, {"a": 0.5}])) == [{}, {"a": 0.5}]  # a group without a record
    with pytest.raises(AssertionError, match="2 records for 3 param groups"):
        write_records(sd, [{}, {}])


@pytest.mark.parametrize(
    "record, message",
    [
        ({"a": 0.3}, r"^resume: param group 1: 'a' has fraction 0.3, not one of \(1.0, 0.5, 0.25, 0.125\)$"),
        ({"a": "auto"}, r"^resume: param group 1: 'a' has fraction 'auto'"),
        ({3: 0.5}, r"^resume: param group 1: 3 has fraction 0.5"),
        ([("a", 0.5)], r"^resume: param group 1: 'fractions' must map matrix names to f, got \[\('a', 0.5\)\]$"),
    ],
)
def test_a_record_that_is_not_names_to_offered_fractions_is_refused_naming_group_name_and_value(record, message):
    with pytest.raises(ValueError, match=message):
        read_records(_state_dict([{"b": 1.0}, record]), where="resume")


class _Recording(Dion3FrontEnd):
    """A front end that records what load_state_dict asks of it and refuses where told."""

    FRONT_END = options.TORCH

    def __init__(self, refuse: bool = False) -> None:
        self.calls: list = []
        self.refuse = refuse
        super().__init__([torch.nn.Parameter(torch.ones(2, 2))], {"lr": 0.1})

    def fraction_records(self) -> list[dict[str, float]]:
        return [{"w": 0.5}]

    def restore_fraction_records(self, records: list[dict[str, float]]) -> None:
        self.calls.append(("restore", records))

    def check_loadable(self, state_dict: dict[str, Any]) -> None:
        self.calls.append("check")
        if self.refuse:
            raise ValueError("param group 0: does not fit")

    def load_checked(self, state_dict: dict[str, Any]) -> None:
        self.calls.append("load")


def test_load_state_dict_checks_everything_then_sets_everything():
    saved = _Recording().state_dict()
    assert saved["param_groups"][0][RECORD] == {"w": 0.5} and saved["skipped_steps"] == 0
    saved["skipped_steps"] = 3
    opt = _Recording()
    opt.load_state_dict(saved)
    assert opt.calls == ["check", "load", ("restore", [{"w": 0.5}])] and opt.skipped_steps == 3

    refusing = _Recording(refuse=True)
    with pytest.raises(ValueError, match="does not fit"):
        refusing.load_state_dict(saved)
    assert refusing.calls == ["check"] and refusing.skipped_steps == 0

    saved["param_groups"][0][RECORD] = {"w": 0.3}
    opt = _Recording()
    with pytest.raises(ValueError, match="'w' has fraction 0.3"):
        opt.load_state_dict(saved)
    assert opt.calls == [] and opt.skipped_steps == 0


def test_gate_step_counts_a_skipped_step_and_nothing_else(generator):
    opt = _Recording()
    assert opt.gate_step(lambda: _gradients(generator), CPU) is True and opt.skipped_steps == 0
    with pytest.warns(RuntimeWarning, match="non-finite gradient, step skipped.*1 step"):
        assert opt.gate_step(lambda: _gradients(generator, float("nan")), CPU) is False
    with pytest.raises(ValueError, match="refused here"):
        opt.gate_step(_refuse, CPU)
    assert opt.skipped_steps == 1


def _trained(generator: torch.Generator) -> tuple[torch.nn.Module, Dion3]:
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Linear(8, 3))
    opt = Dion3(model.named_parameters(), ns_dtype=torch.float32)  # fraction "auto": a record
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(4, 6, generator=generator)).square().mean().backward()
        opt.step()
    return model, opt


def _tensors_equal(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_tensors_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_tensors_equal(x, y) for x, y in zip(a, b))
    return torch.equal(a, b) if torch.is_tensor(a) else a == b


@pytest.mark.parametrize("damage", ["record", "state shape", "setting"])
def test_the_torch_dion3_loads_nothing_from_a_state_dict_one_check_refuses(generator, damage):
    _, other = _trained(generator)
    saved = other.state_dict()
    saved["skipped_steps"] = 5
    for group in saved["param_groups"]:  # what a load would set, were nothing refused
        group["lr"] = 0.5
    if damage == "record":
        saved["param_groups"][-1][RECORD] = {"0.weight": 0.3}
    elif damage == "state shape":
        saved["state"][3]["exp_avg"] = torch.zeros(4)
    else:
        saved["param_groups"][0]["fraction"] = 2.0
    _, opt = _trained(generator)
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError):
        opt.load_state_dict(saved)
    assert _tensors_equal(opt.state_dict(), before)
