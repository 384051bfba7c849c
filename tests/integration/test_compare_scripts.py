"""The three compare_on_gpus.sh scripts (Megatron-LM, DeepSpeed, Hugging Face Trainer), run with a
python3 that only records its arguments: a failed run fails the script; results go under runs/."""

from __future__ import annotations

import os

import pytest
from support.script_helpers import needs_bash, run_recording_python
from support.repository import ROOT

pytestmark = [needs_bash, pytest.mark.slow]  # each test runs bash

EXAMPLES = ROOT / "examples"
# script -> the settings of a short run of two optimizers on one GPU
SETTINGS = {
    "megatron_lm": {"OPTS": "dion3 adam", "ITERS": "40"},
    "deepspeed": {"GPUS": "1"},
    "hf_trainer": {"GPUS": "1", "OPTS": "dion3 adamw"},
}


@pytest.mark.parametrize("example", SETTINGS)
def test_the_script_fails_when_a_run_fails_and_succeeds_when_none_does(tmp_path, example):
    script = EXAMPLES / example / "compare_on_gpus.sh"
    failing, passing = tmp_path / "failing", tmp_path / "passing"
    failing.mkdir()
    passing.mkdir()
    out = run_recording_python(script, failing, SETTINGS[example], runs_exit=3)
    assert out.returncode == 1, (out.returncode, out.stderr)
    assert "run(s) failed: " in out.stderr and "dion3" in out.stderr and "exit 3" in out.stderr, out.stderr
    out = run_recording_python(script, passing, SETTINGS[example])
    assert out.returncode == 0, (out.returncode, out.stderr)


@pytest.mark.parametrize("example", SETTINGS)
def test_results_go_under_runs_by_default(tmp_path, example):
    out = run_recording_python(EXAMPLES / example / "compare_on_gpus.sh", tmp_path, SETTINGS[example], results=False)
    assert out.returncode == 0, (out.returncode, out.stderr)
    assert sorted(os.listdir(tmp_path)) == ["launched", "python3", "runs"]  # nothing else in the working directory
    assert (tmp_path / "runs" / example / "dion3.log").is_file()
