"""CPU smoke test of benchmarks/bench_convergence.py: a tiny GPT, a few optimizers, a few steps."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--device", "cpu", "--layers", "2", "--hidden", "64", "--heads", "4", "--ffn", "128", "--seq", "32",
        "--batch", "8", "--steps", "6", "--eval-every", "3", "--eval-batches", "2", "--max-bytes", "200000",
        "--timing-warmup", "1", "--aux-lr", "0.01"]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_convergence", ROOT / "benchmarks" / "bench_convergence.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_convergence"] = module
    spec.loader.exec_module(module)
    return module


def test_config_parsing(bench):
    cfg = bench.parse_config("dion3:f=0.125:lr=0.03")
    assert (cfg["opt"], cfg["f"], cfg["lr"], cfg["family"]) == ("dion3", 0.125, 0.03, "dion3:f=0.125")
    assert bench.parse_config("normuon:lr=0.02")["f"] == 1.0
    assert bench.parse_config("dion3:f=auto:lr=best")["name"] == "dion3:f=auto:lr=best"
    mu = bench.parse_config("dion3:f=0.25:mu=0.8:lr=0.01")
    assert (mu["mu"], mu["family"], mu["name"]) == (0.8, "dion3:f=0.25:mu=0.8", "dion3:f=0.25:mu=0.8:lr=0.01")
    for bad in ("sgd:lr=1", "muon:f=0.5", "dion3:f=2", "adamw:lr", "muon:mu=0.9", "dion3:mu=1.5"):
        with pytest.raises(ValueError):
            bench.parse_config(bad)
    assert bench.parse_config("dion3:f=0.25:lr=best:aux=torch")["family"] == "dion3:f=0.25:aux=torch"
    with pytest.raises(ValueError):
        bench.parse_config("muon:aux=torch")
    sweep = [bench.parse_config(t) for t in bench.sweep_configs(with_auto=True)]
    assert len(sweep) == 20 and len({c["name"] for c in sweep}) == 20
    assert sweep[0]["family"] == "dion3:f=0.25" and sweep[3]["lr"] == "best" and sweep[4]["aux"] == "torch"
    assert len(bench.sweep_configs(with_auto=False, with_aux_variant=False)) == 18


def test_schedule(bench):
    mult = [bench.lr_multiplier(s, 100, 5, 0.1) for s in range(100)]
    assert mult[0] == pytest.approx(0.2) and mult[4] == pytest.approx(1.0)
    assert mult[-1] == pytest.approx(0.1) and all(a >= b for a, b in zip(mult[4:], mult[5:]))


def test_smoke_run(bench, tmp_path, capsys):
    out = tmp_path / "conv.json"
    configs = ["dion3:f=0.25:lr=0.04", "dion3:f=0.25:lr=0.02", "muon:lr=0.05", "adamw:lr=0.01",
               "normuon:lr=0.04:aux=torch"]
    result = bench.main(TINY + ["--json", str(out), "--configs", *configs])
    printed = capsys.readouterr().out
    saved = json.loads(out.read_text())
    assert saved["meta"]["params"] == result["meta"]["params"] > 0
    assert saved["meta"]["tokens_per_run"] == 6 * 8 * 32
    runs = {r["name"]: r for r in saved["runs"]}
    assert set(runs) == set(configs)
    for r in runs.values():
        assert "error" not in r and not r["diverged"]
        assert len(r["train_loss"]) == 6 and all(math.isfinite(v) for v in r["train_loss"])
        vals = [v for _, v in r["val_loss"]]
        assert [s for s, _ in r["val_loss"]] == [0, 3, 6]
        assert vals[0] == pytest.approx(math.log(256), abs=0.1)  # uniform over bytes at init
        assert vals[-1] < vals[0] - 0.1, (r["name"], vals)  # it learns
        assert r["final_val_loss"] == vals[-1]
        assert 0 < r["opt_ms"] < r["step_ms"] and r["opt_share"] == pytest.approx(r["opt_ms"] / r["step_ms"])
    # Same init and data: every run starts from the same validation loss and the same first loss.
    assert len({r["val_loss"][0][1] for r in runs.values()}) == 1
    assert len({r["train_loss"][0] for r in runs.values()}) == 1
    # The best lr per optimizer is the lower final validation loss, and the tables print it.
    best = bench.best_per_family(saved["runs"])
    assert set(best) == {"dion3:f=0.25", "muon", "adamw", "normuon:aux=torch"}
    d3 = [runs["dion3:f=0.25:lr=0.04"], runs["dion3:f=0.25:lr=0.02"]]
    assert best["dion3:f=0.25"]["name"] == min(d3, key=lambda r: r["final_val_loss"])["name"]
    for line in ("best lr per optimizer", "Dion3 f=1/4", "Muon (torch.optim.Muon)", "AdamW", "target"):
        assert line in printed
    # --plot-only re-reads the JSON and prints the same tables.
    replay = bench.main(["--plot-only", str(out)])
    assert bench.format_tables(replay) == bench.format_tables(saved)
    # Several result files of the same settings merge into one.
    merged_path = tmp_path / "merged.json"
    merged = bench.main(["--plot-only", str(out), str(out), "--json", str(merged_path)])
    assert len(merged["runs"]) == 2 * len(configs) and len(merged["meta"]["commands"]) == 2
    assert json.loads(merged_path.read_text())["runs"] == merged["runs"]


def test_best_lr_dependency(bench):
    """lr=best waits for the reference family and takes its best lr; missing refs skip the run."""
    args = bench.parser().parse_args(["--best-ref", "dion3:f=0.25"])
    cfgs = [bench.parse_config(t) for t in ("dion3:f=0.25:lr=0.01", "dion3:f=auto:lr=best", "dion3:f=0.25:lr=0.02",
                                            "adamw:lr=0.001")]
    sched = bench.Scheduler(cfgs, args)
    first = sched.next()
    assert first["name"] == "dion3:f=0.25:lr=0.01"
    second = sched.next()  # auto is not ready: the other f=0.25 run comes first
    assert second["name"] == "dion3:f=0.25:lr=0.02"
    third = sched.next()
    assert third["name"] == "adamw:lr=0.001"
    sched.finish(first, dict(first, final_val_loss=3.0, diverged=False))
    sched.finish(second, dict(second, final_val_loss=2.5, diverged=False))
    auto = sched.next()
    assert auto["f"] == "auto" and auto["lr"] == 0.02 and auto["lr_from"] == "dion3:f=0.25:lr=0.02"
    sched.finish(third, dict(third, final_val_loss=4.0, diverged=False))
    assert sched.next() is None
