"""CPU tests of the convergence benchmark: corpus, packs, lr-grid extension, merging, a smoke run."""

from __future__ import annotations

import argparse
import json
import math
import sysconfig
from pathlib import Path

import pytest
import torch

from benchmarks import bench_convergence as bench
from benchmarks import convergence_corpus as corpus_lib
from benchmarks.convergence_model import GPT, pack_loss

TINY = [
    "--device",
    "cpu",
    "--layers",
    "2",
    "--hidden",
    "32",
    "--heads",
    "4",
    "--ffn",
    "64",
    "--seq",
    "32",
    "--batch",
    "8",
    "--steps",
    "8",
    "--eval-every",
    "4",
    "--eval-batches",
    "2",
    "--timing-warmup",
    "1",
    "--timing-steps",
    "2",
    "--aux-lr",
    "0.01",
    "--pack",
    "4",
]


@pytest.fixture(scope="module")
def source_tree(tmp_path_factory) -> list[str]:
    """A small, fixed corpus (600 files, a few held out): the smoke runs read it, not the installation."""
    root = tmp_path_factory.mktemp("sources")
    for i in range(600):
        (root / f"mod{i}.py").write_text(f"def function_{i}(value):\n    return value * {i} + {i % 7}\n" * 3)
    return ["--corpus-root", str(root)]


def test_config_parsing():
    cfg = bench.parse_config("dion3:f=0.125:mu=0.6:stale=1:lr=0.03:seed=1")
    assert (cfg["opt"], cfg["f"], cfg["lr"], cfg["seed"]) == ("dion3", 0.125, 0.03, 1)
    assert cfg["family"] == "dion3:f=0.125:mu=0.6:stale=1" and cfg["name"] == cfg["family"] + ":lr=0.03:seed=1"
    assert bench.parse_config("dion3:f=0.25:mu=0.95:lr=0.02")["family"] == "dion3:f=0.25"  # reference values drop
    assert bench.parse_config("normuon")["f"] == 1.0 and bench.parse_config("muon")["lr"] == 0.025
    assert bench.parse_config("dion3:f=auto:lr=best")["name"] == "dion3:f=auto:lr=best"
    bf16 = bench.parse_config("dion3:f=0.25:mom=bf16:lr=0.04")
    assert bf16["family"] == "dion3:f=0.25:mom=bf16" and bench.label(bf16).endswith("bf16 momentum")
    assert bench.parse_config("dion3:f=0.25:mom=fp32")["family"] == "dion3:f=0.25"  # the default drops
    for bad in ("sgd:lr=1", "muon:f=0.5", "dion3:f=2", "adamw:lr", "muon:mu=0.9", "dion3:fwarm=1", "dion3:bogus=1", "dion3:mom=fp16"):
        with pytest.raises(ValueError, match="config"):
            bench.parse_config(bad)


def test_proxy_size_and_the_standard_library_corpus(capsys):
    args = bench.parser().parse_args(["--size", "proxy", "--device", "cpu"])
    bench.resolve_size(args)
    params = sum(p.numel() for p in GPT(**bench.model_config(args)).parameters())
    assert 0.4e6 < params < 0.5e6 and args.steps == math.ceil(10 * params / (32 * 64))
    stdlib = corpus_lib.source_roots(stdlib_only=True)
    assert stdlib == [Path(sysconfig.get_paths()["stdlib"]).resolve()] and stdlib[0] in corpus_lib.source_roots()
    with pytest.raises(SystemExit):
        bench.main(["--size", "proxy", "--device", "cpu", "--stdlib-only", "--corpus-root", "x", "--configs", "muon"])
    assert "--corpus-root: not allowed with argument --stdlib-only" in capsys.readouterr().err


def test_schedule():
    mult = [bench.lr_multiplier(s, 100, 5, 0.1) for s in range(100)]
    assert mult[0] == pytest.approx(0.2) and mult[4] == pytest.approx(1.0)
    assert mult[-1] == pytest.approx(0.1) and all(a >= b for a, b in zip(mult[4:], mult[5:]))
    cfg = bench.parse_config("dion3:f=0.25:fwarm=0.1")
    assert [bench.fraction_at(cfg, s, 100) for s in (0, 9, 10, 99)] == [1.0, 1.0, 0.25, 0.25]


@pytest.mark.parametrize("seed", [0, 3])
def test_lanes_read_every_byte_at_most_once(seed):
    n_train, batch, seq, steps = 10_007, 6, 16, 100
    starts = corpus_lib.lane_starts(n_train, batch, seq, steps, seed)
    assert starts.shape == (steps, batch)
    targets = starts.unsqueeze(-1) + 1 + torch.arange(seq)  # the bytes each window predicts
    assert targets.max() < n_train and targets.unique().numel() == targets.numel()
    with pytest.raises(ValueError, match="without repeats"):
        corpus_lib.lane_starts(n_train, batch, seq, steps + 5, seed)


def test_corpus_is_deterministic_deduplicated_and_refuses_too_little(tmp_path):
    root = tmp_path / "site"
    (root / "pkg").mkdir(parents=True)
    texts = {f"pkg/m{i}.py": f"def f{i}():\n    return {i} * {i + 1}\n" * (i + 1) for i in range(60)}
    texts["pkg/copy.py"] = texts["pkg/m3.py"]  # same content twice: kept once
    texts["pkg/data.bin"] = "not source"
    for name, text in texts.items():
        (root / name).write_text(text)
    first, second = corpus_lib.build(roots=[root]), corpus_lib.build(roots=[root])
    assert first.sha256 == second.sha256 and torch.equal(first.train, second.train)
    sources = {k: v for k, v in texts.items() if k.endswith(".py") and k != "pkg/copy.py"}
    assert first.files == len(sources) and first.bytes == sum(len(v) for v in sources.values())
    with pytest.raises(ValueError, match="are needed"):
        corpus_lib.build(min_bytes=first.bytes + 1, roots=[root])


def test_a_pack_member_trains_exactly_as_it_would_alone(generator):
    """Members never mix: each one's losses and gradients are those of its own model alone."""
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=generator)))
    models = [GPT(d=32, layers=2, heads=4, ffn=48, seq=16) for _ in range(3)]
    idx = torch.randint(0, 256, (3, 4, 17), generator=generator)
    together = pack_loss(models, idx[..., :-1], idx[..., 1:], bf16=False)
    together.sum().backward()
    grads = [[p.grad.clone() for p in m.parameters()] for m in models]
    for k, model in enumerate(models):
        model.zero_grad()
        alone = pack_loss([model], idx[k : k + 1, :, :-1], idx[k : k + 1, :, 1:], bf16=False)
        alone.sum().backward()
        torch.testing.assert_close(alone[0], together[k], rtol=1e-5, atol=1e-6)
        for g, p in zip(grads[k], model.parameters()):
            torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-6)


def _finished(name: str, loss: float) -> dict:
    cfg = bench.parse_config(name)
    return dict(cfg, label=bench.label(cfg), final_val_loss=loss, diverged=False, opt_ms=1.0, forward_backward_ms=2.0)


def test_scheduler_extends_the_lr_grid_until_the_best_is_interior_then_adds_seeds():
    args = argparse.Namespace(best_ref="dion3:f=0.25", extend=True, max_lrs=6, seeds=2, pack=8, deadline_s=0)
    configs = [bench.parse_config(t) for t in ("dion3:f=0.25:lr=0.02", "dion3:f=0.25:lr=0.04", "dion3:f=auto:lr=best")]
    sched = bench.Scheduler(configs, args, earlier=[])
    pack = sched.next_pack()
    assert [c["name"] for c in pack] == ["dion3:f=0.25:lr=0.02", "dion3:f=0.25:lr=0.04"]  # auto waits
    sched.finish([_finished("dion3:f=0.25:lr=0.02", 1.0), _finished("dion3:f=0.25:lr=0.04", 0.9)], 1.0)
    pack = sched.next_pack()  # the best is the highest lr: one more above it (auto waits for the outcome)
    assert [c["name"] for c in pack] == ["dion3:f=0.25:lr=0.08"]
    sched.finish([_finished("dion3:f=0.25:lr=0.08", 0.95)], 1.0)
    pack = sched.next_pack()  # interior now: auto at the best lr, and the best lr with the second seed
    assert {c["name"] for c in pack} == {"dion3:f=auto:lr=0.04", "dion3:f=0.25:lr=0.04:seed=1"}
    sched.finish([_finished("dion3:f=auto:lr=0.04", 0.92), _finished("dion3:f=0.25:lr=0.04:seed=1", 0.91)], 1.0)
    assert sched.next_pack() == []
    summary = bench.family_summary(sched.done)["dion3:f=0.25"]
    assert summary["lr"] == 0.04 and not summary["edge"] and summary["final"] == pytest.approx(0.905)


def test_optimizer_times_of_another_gpu_stay_out_of_the_summary():
    runs = [
        dict(_finished(name, 0.9), opt_timing="alone", device=device, opt_ms=ms)
        for name, device, ms in (
            ("dion3:f=0.25:lr=0.02", "H200", 3.0),
            ("dion3:f=0.25:lr=0.04", "H100", 9.0),
            ("dion3:f=0.25:lr=0.08", "H200", 5.0),
        )
    ]
    assert bench.family_summary(runs, "H200")["dion3:f=0.25"]["opt_ms"] == 4.0
    assert bench.family_summary(runs)["dion3:f=0.25"]["opt_ms"] == 5.0


@pytest.mark.slow
def test_smoke_run_merge_and_plot(tmp_path, capsys, source_tree):
    out = tmp_path / "conv.json"
    configs = ["dion3:f=0.25:mu=0.6:stale=1:fwarm=0.25:lr=0.04", "dion3:f=0.25:lr=0.02", "muon:lr=0.05", "adamw:lr=0.01", "normuon:lr=0.04"]
    result = bench.main(TINY + source_tree + ["--json", str(out), "--png", str(tmp_path / "conv.png"), "--configs", *configs])
    printed = capsys.readouterr().out
    saved = json.loads(out.read_text())
    assert saved["meta"]["tokens_per_run"] == 8 * 8 * 32 and saved["meta"]["forward_backward_ms"] > 0
    runs = {r["name"]: r for r in saved["runs"]}
    assert set(runs) == {bench.parse_config(c)["name"] for c in configs} == {r["name"] for r in result["runs"]}
    for r in runs.values():
        assert "error" not in r and not r["diverged"] and not r.get("partial")
        assert r["train_loss_every"] == bench.TRAIN_LOSS_EVERY
        assert len(r["train_loss"]) == math.ceil(8 / bench.TRAIN_LOSS_EVERY) and all(math.isfinite(v) for v in r["train_loss"])
        assert [s for s, _ in r["val_loss"]] == [0, 4, 8]
        assert r["val_loss"][0][1] == pytest.approx(math.log(256), abs=0.1)  # uniform over bytes at init
        assert r["val_loss"][-1][1] < r["val_loss"][0][1] - 0.1, r["name"]  # it learns
        assert r["opt_timing"] == "alone" and 0 < r["opt_ms"] <= r["opt_ms_p90"]
    assert all(0 < s["opt_ms"] < s["step_ms"] for s in bench.family_summary(saved["runs"]).values())
    # Same seed: the same initial weights and data in every run.
    assert len({r["val_loss"][0][1] for r in runs.values()}) == 1
    assert len({r["first_train_loss"] for r in runs.values()}) == 1
    assert (tmp_path / "conv.png").stat().st_size > 10_000
    for text in ("best lr per family", "Dion3 f=1/4, f=1 for 25% of steps, mu 0.6, staleness 1", "Muon", "f=1/4 within"):
        assert text in printed
    # A second invocation with --merge runs only what is new and keeps everything.
    again = bench.main(
        TINY + source_tree + ["--json", str(tmp_path / "more.json"), "--merge", str(out), "--configs", "muon:lr=0.05", "adamw:lr=0.02"]
    )
    assert len(again["runs"]) == len(configs) + 1
    merged = bench.main(["--plot-only", str(out), str(tmp_path / "more.json")])
    assert len(merged["runs"]) == len(configs) + 1
    assert bench.format_tables(merged) == bench.format_tables(again)


def test_partial_records_of_a_killed_pack_are_not_merged(tmp_path):
    meta = {"command": "x", "training": {}, "corpus_sha256": "s", "params": 1}
    done, partial = _finished("muon:lr=0.05", 1.0), dict(_finished("adamw:lr=0.01", 2.0), partial=True)
    (tmp_path / "a.json").write_text(json.dumps({"meta": meta, "runs": [done, partial]}))
    assert [r["name"] for r in bench.load_results([str(tmp_path / "a.json")])["runs"]] == ["muon:lr=0.05"]
    other = dict(meta, corpus_sha256="other")
    (tmp_path / "b.json").write_text(json.dumps({"meta": other, "runs": []}))
    with pytest.raises(SystemExit, match="corpus_sha256"):
        bench.load_results([str(tmp_path / "a.json"), str(tmp_path / "b.json")])


@pytest.mark.gpu
def test_compiled_pack_loss_matches_eager_on_gpu():
    torch.manual_seed(0)
    members = [GPT(64, 2, 4, 128, 32).cuda() for _ in range(3)]
    idx = torch.randint(0, 256, (3, 4, 32), device="cuda")
    targets = torch.randint(0, 256, (3, 4, 32), device="cuda")
    eager = pack_loss(members, idx, targets, True)
    eager.sum().backward()
    grads = [p.grad.clone() for m in members for p in m.parameters()]
    for m in members:
        m.zero_grad(set_to_none=True)
    compiled = pack_loss(members, idx, targets, True, compiled=True)
    compiled.sum().backward()
    torch.testing.assert_close(compiled, eager, rtol=0, atol=2e-2)  # bf16 autocast, fused differently
    for g, m_p in zip(grads, (p for m in members for p in m.parameters())):
        torch.testing.assert_close(m_p.grad, g, rtol=0.1, atol=1e-3)
