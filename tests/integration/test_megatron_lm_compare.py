"""examples/megatron_lm: the comparison script's checks of its input, and its summary of Megatron-LM
logs (tests/data/megatron_lm: excerpts of the logs of an H200 run)."""

from __future__ import annotations


import pytest
from support.script_helpers import needs_bash, run_recording_python
from support.repository import ROOT, TESTS

from examples.megatron_lm import summarize

EXAMPLE = ROOT / "examples" / "megatron_lm"
LOGS = TESTS / "data" / "megatron_lm"


def test_summary_reads_megatrons_optimizer_timer_and_loss():
    runs = {r.optimizer: r for r in (summarize.parse(p.stem, p.read_text()) for p in sorted(LOGS.glob("*.log")))}
    assert set(runs) == {"dion3", "muon", "adam"}
    assert [i.iteration for i in runs["dion3"].intervals] == [1, 10, 20, 30, 40, 50, 60]
    # the means leave out iteration 1 and iterations 2-10 (compilation and warm-up)
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
    assert summarize.resume_verdicts(runs) == ["dion3_resumed: iteration 30 lm loss 5.436796E-01 vs 5.436796E-01 uninterrupted: identical"]
    (tmp_path / "dion3_resumed.log").write_text("\n".join(full[start:]).replace("5.436796E-01", "5.436797E-01"))
    runs = [summarize.parse(p.stem, p.read_text()) for p in sorted(tmp_path.glob("*.log"))]
    assert summarize.resume_verdicts(runs)[0].endswith("DIFFERENT")


def test_a_run_resumed_at_another_tensor_parallel_size_is_given_its_relative_difference(tmp_path):
    full = (LOGS / "dion3.log").read_text().splitlines()
    start = next(i for i, line in enumerate(full) if "iteration       30/" in line)
    dump = "  tensor_model_parallel_size ...................... {}"
    (tmp_path / "dion3.log").write_text("\n".join([dump.format(1), *full]))
    resumed = "\n".join([dump.format(2), *full[start:]]).replace("5.436796E-01", "5.437340E-01")
    (tmp_path / "dion3_resumed.log").write_text(resumed)
    runs = [summarize.parse(p.stem, p.read_text()) for p in sorted(tmp_path.glob("*.log"))]
    assert [r.tensor_parallel for r in runs] == [1, 2]
    assert summarize.resume_verdicts(runs) == [
        "dion3_resumed: iteration 30 lm loss 5.437340E-01 vs 5.436796E-01 uninterrupted, resumed at TP=2 from TP=1: "
        "relative difference 1.0e-04 (another layout sums in another order)"
    ]


def run_script(tmp_path, env: dict):
    return run_recording_python(EXAMPLE / "compare_on_gpus.sh", tmp_path, env)


@needs_bash
@pytest.mark.parametrize(
    "env, message",
    [
        ({"SIZE": "7b"}, "SIZE must be 202m, 350m or 1.3b, got 7b"),
        ({"OPTS": "dion3 lion"}, "OPTS: unknown optimizer lion"),
        ({"GPUS": "2", "TP": "3"}, "TP and RESUME_TP must divide GPUS (2), got TP=3 RESUME_TP=3"),
        ({"GPUS": "2", "RESUME_TP": "2"}, "RESUME_TP=2 needs RESUME=1"),
        (
            {"GPUS": "2", "TP": "2", "RESUME": "1", "RESUME_TP": "1"},
            "RESUME_TP=1: its data-parallel size 2 does not divide the saved run's 1",
        ),
    ],
    ids=["size", "opts", "tp", "resume-tp-alone", "resume-dp-too-large"],
)
@pytest.mark.slow
def test_script_refuses_bad_settings_before_running_anything(tmp_path, env, message):
    out = run_script(tmp_path, env)
    assert out.returncode == 2 and message in out.stderr, (out.returncode, out.stderr)
    assert not (tmp_path / "launched").exists()  # nothing launched before the settings are checked


@needs_bash
@pytest.mark.slow
def test_script_resumes_a_dp2_checkpoint_at_tp2_with_the_same_global_batch(tmp_path):
    out = run_script(tmp_path, {"GPUS": "2", "RESUME": "1", "RESUME_TP": "2", "OPTS": "dion3", "ITERS": "40"})
    assert out.returncode == 0, out.stderr
    saved, resumed, summary = (tmp_path / "launched").read_text().splitlines()
    for run, tp in ((saved, "1"), (resumed, "2")):
        assert f"--tensor-model-parallel-size {tp} " in run and "--global-batch-size 16 " in run
        assert "--dist-ckpt-optim-fully-reshardable" in run and "--nproc-per-node 2 " in run
    assert "--save" in saved and "--load" not in saved
    assert "--load" in resumed and "--ckpt-step 20 " in resumed
    assert summary.endswith("dion3.log " + str(tmp_path / "results" / "dion3_resumed.log"))


@needs_bash
@pytest.mark.slow
def test_script_runs_each_optimizer_once_in_one_layout_by_default(tmp_path):
    out = run_script(tmp_path, {"OPTS": "dion3 adam", "ITERS": "40"})
    assert out.returncode == 0, out.stderr
    *runs, summary = (tmp_path / "launched").read_text().splitlines()
    assert "--optimizer dion3" in runs[0] and "--optimizer adam" in runs[1]
    for run in runs:
        assert "--tensor-model-parallel-size 1 " in run and "--global-batch-size 8 " in run
        assert "--dist-ckpt-optim-fully-reshardable" not in run and "--load" not in run
    assert "summarize.py" in summary
