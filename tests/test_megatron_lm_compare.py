"""examples/megatron_lm: the comparison script's checks of its input, and its summary of Megatron-LM
logs (tests/data/megatron_lm: excerpts of the H200 run in docs/benchmarks.md, twelfth session)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "megatron_lm"
LOGS = Path(__file__).resolve().parent / "data" / "megatron_lm"
sys.path.insert(0, str(EXAMPLE))

import summarize  # noqa: E402


def test_summary_reads_megatrons_optimizer_timer_and_loss():
    runs = {r.optimizer: r for r in (summarize.parse(p.stem, p.read_text()) for p in sorted(LOGS.glob("*.log")))}
    assert set(runs) == {"dion3", "muon", "adam"}
    assert [i.iteration for i in runs["dion3"].intervals] == [1, 10, 20, 30, 40, 50, 60]
    # the means leave out iteration 1 and iterations 2-10: those of docs/benchmarks.md
    assert runs["dion3"].mean("optimizer_ms") == pytest.approx((14.32 + 13.00 + 14.49 + 13.84 + 14.42) / 5)
    assert (runs["dion3"].layout, runs["muon"].layout) == ("reduce-scatter", "all-reduce")
    text = summarize.table(list(runs.values()))
    row = next(line for line in text.splitlines() if line.startswith("dion3"))
    assert "14.01" in row and "5.13x less" in row and "+2.07 ms" in row and row.endswith("4.993352E-02")


def test_resumed_run_is_checked_against_the_uninterrupted_one(tmp_path):
    full = (LOGS / "dion3.log").read_text().splitlines()
    start = next(i for i, line in enumerate(full) if "iteration       30/" in line)
    (tmp_path / "dion3.log").write_text("\n".join(full))
    (tmp_path / "dion3_resumed.log").write_text("\n".join(full[start:]))
    runs = [summarize.parse(p.stem, p.read_text()) for p in sorted(tmp_path.glob("*.log"))]
    assert summarize.resume_verdicts(runs) == [
        "dion3_resumed: iteration 30 lm loss 5.436796E-01 vs 5.436796E-01 uninterrupted: identical"]
    (tmp_path / "dion3_resumed.log").write_text("\n".join(full[start:]).replace("5.436796E-01", "5.436797E-01"))
    runs = [summarize.parse(p.stem, p.read_text()) for p in sorted(tmp_path.glob("*.log"))]
    assert summarize.resume_verdicts(runs)[0].endswith("DIFFERENT")


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("env, message", [({"SIZE": "7b"}, "SIZE must be 202m, 350m or 1.3b, got 7b"),
                                          ({"OPTS": "dion3 lion"}, "OPTS: unknown optimizer lion")])
def test_script_refuses_bad_settings_before_running_anything(tmp_path, env, message):
    run_env = dict(os.environ, RESULTS=str(tmp_path / "results"), PATH=f"{tmp_path}:{os.environ['PATH']}", **env)
    # a python3 that records any call: nothing may be launched before the settings are checked
    (tmp_path / "python3").write_text(f"#!/bin/sh\necho called >> {tmp_path}/launched\n")
    (tmp_path / "python3").chmod(0o755)
    out = subprocess.run(["bash", str(EXAMPLE / "compare_on_gpus.sh")], env=run_env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and message in out.stderr, (out.returncode, out.stderr)
    assert not (tmp_path / "launched").exists()
