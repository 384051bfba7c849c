"""examples/hf_trainer/train.py in one CPU process without a DeepSpeed config (Trainer's own
AdamW): what the example itself adds to Trainer, its defaults and its summary line."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.repository import ROOT

pytestmark = pytest.mark.slow

if importlib.util.find_spec("deepspeed") is None or importlib.util.find_spec("transformers") is None:
    pytest.skip("needs deepspeed and transformers", allow_module_level=True)

SCRIPT = ROOT / "examples" / "hf_trainer" / "train.py"


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, str]:
    """3 steps of a tiny model, no --output_dir or --logging_steps, a checkpoint at step 3: (the
    working directory, stdout)."""
    cwd = tmp_path_factory.mktemp("hf_example")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--use_cpu",
            "--max_steps",
            "3",
            "--save_strategy",
            "steps",
            "--save_steps",
            "3",
            "--width",
            "32",
            "--layers",
            "1",
            "--heads",
            "2",
            "--seq",
            "32",
            "--corpus_bytes",
            "50000",
            "--report_to",
            "none",
            "--disable_tqdm",
            "true",
        ],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return cwd, proc.stdout


def test_output_goes_under_runs_by_default(run):
    cwd, _ = run
    assert os.listdir(cwd) == ["runs"] and (cwd / "runs" / "hf_trainer" / "checkpoint-3").is_dir()


def test_summary_has_the_final_loss_without_logging_steps(run):
    _, out = run
    summary = json.loads(out.split("SUMMARY ", 1)[1].splitlines()[0])
    assert summary["steps"] == 3 and 0 < summary["final_loss"] < 6  # about ln 256 = 5.5 after 3 steps
    assert summary["final_loss_steps"] == 3  # Trainer logs every 500 steps by default: the mean since the start
