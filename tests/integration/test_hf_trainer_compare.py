"""examples/hf_trainer/compare_on_gpus.sh: its checks of its input, and what each run is given
(the runs themselves are the Trainer path tests/integration/test_hf_trainer.py covers on CPU)."""

from __future__ import annotations


import pytest
from support.script_helpers import needs_bash, run_recording_python
from support.repository import ROOT

SCRIPT = ROOT / "examples" / "hf_trainer" / "compare_on_gpus.sh"
pytestmark = [needs_bash, pytest.mark.slow]  # each test runs bash


@pytest.mark.parametrize(
    "env, message",
    [
        ({"STAGE": "3"}, "STAGE must be 0, 1 or 2 (the ZeRO stages Dion3 supports), got 3"),
        ({"OPTS": "dion3 lion"}, "OPTS: unknown optimizer lion (dion3, muon, adamw)"),
        ({"GPUS": "two"}, "GPUS must be a number of GPUs, got two"),
    ],
    ids=["stage", "opts", "gpus"],
)
def test_script_refuses_bad_settings_before_running_anything(tmp_path, env, message):
    out = run_recording_python(SCRIPT, tmp_path, env)
    assert out.returncode == 2 and message in out.stderr, (out.returncode, out.stderr)
    assert not (tmp_path / "launched").exists() and not (tmp_path / "results").exists()


def test_each_optimizer_runs_at_its_lr_under_the_zero_stage_asked_for(tmp_path):
    out = run_recording_python(SCRIPT, tmp_path, {"GPUS": "2", "STAGE": "2", "OPTS": "dion3 adamw"})
    assert out.returncode == 0, out.stderr
    calls = (tmp_path / "launched").read_text().splitlines()
    runs = [call for call in calls if "torch.distributed.run" in call]  # the others write the configs
    assert len(runs) == 2
    for run, opt, lr in zip(runs, ("dion3", "adamw"), ("0.01", "0.002")):
        config = tmp_path / "results" / f"ds_config_{opt}_zero2.json"
        assert f"--deepspeed {config} " in run and f"--learning_rate {lr} " in run and "--nproc_per_node 2 " in run
