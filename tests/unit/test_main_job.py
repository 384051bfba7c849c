"""The main job, examples/pretrain_gpt.py, on CPU: 2 gloo processes that the script starts itself,
a tiny GPT for a few steps (Dion3 loss goes down; --compare writes its JSON and PNG), and the
other data sources (Megatron indexed dataset with TP=2, a text file)."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys

import pytest
from support import repository

pytest.importorskip("megatron.core")

ROOT = str(repository.ROOT)
SCRIPT = os.path.join(ROOT, "examples", "pretrain_gpt.py")
TINY = [
    "--device",
    "cpu",
    "--nproc",
    "2",
    "--layers",
    "2",
    "--hidden",
    "64",
    "--heads",
    "4",
    "--ffn",
    "128",
    "--seq-length",
    "32",
    "--global-batch",
    "8",
    "--steps",
    "12",
    "--eval-batches",
    "2",
    "--max-tokens",
    "200000",
    "--no-progress",
]


def run_job(args, cwd, timeout=120):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, SCRIPT, *TINY, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.stdout


def load_job():
    """examples/pretrain_gpt.py as a module."""
    from examples import pretrain_gpt

    return pretrain_gpt


def numbers(line: str) -> list[float]:
    return [float(x) for x in re.findall(r"[-+]?\d+\.\d+", line)]


@pytest.mark.slow
def test_compare_dp2_stdlib_corpus(tmp_path):
    out = run_job(["--compare", "--out-dir", str(tmp_path / "out")], cwd=tmp_path)
    assert "standard-library sources" in out and "TP=1 DP=2" in out
    result = json.loads((tmp_path / "out" / "compare.json").read_text())
    png = (tmp_path / "out" / "compare.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    runs = {r["optimizer"]: r for r in result["results"]}
    assert set(runs) | set(result["skipped"]) == {"dion3", "adam", "muon"}
    for name, why in result["skipped"].items():  # never silent: the reason is in the JSON and printed
        assert why and f"was skipped: {why}" in out
    for r in runs.values():
        assert "error" not in r, r
        assert len(r["train_loss"]) == 12
        assert r["final_train_loss"] < r["train_loss"][0] - 0.5, r["train_loss"]
        assert r["final_val_loss"] < math.log(256) - 0.5
        assert r["tokens_per_s"] > 0
        assert r["optimizer_ms"] > 0 and len(r["train_time"]) == 12 and r["optimizer_ms_from_step"] == 6
    dion3 = runs["dion3"]
    assert dion3["mode"] == "layer-wise ZeRO-1" and dion3["skipped_steps"] == 0
    # the default fraction="auto" keeps every row of matrices this small (fewer than 128 rows)
    assert "Dion3: fraction=auto chose f=1 on every matrix (rows x cols: 16x64, 64x64, 64x128, 128x64)" in out
    assert dion3["dion3_fractions"] == {"16x64": 1.0, "64x64": 1.0, "64x128": 1.0, "128x64": 1.0}
    assert "| Dion3" in out and "opt. step ms" in out and "vs Muon" in out
    assert "mean over the last 10% of the steps" in out
    verdict = out.split("verdict: ")[1].splitlines()[0]
    assert verdict == result["verdict"]
    if "muon" in runs:  # the same layout as Dion3, also on CPU; the verdict's numbers are the JSON's
        muon, adam = runs["muon"], runs["adam"]
        assert muon["mode"] == dion3["mode"] and "layer-wise ZeRO-1 both" in verdict
        speedup = muon["optimizer_ms"] / dion3["optimizer_ms"]
        assert dion3["speedup_vs_muon"] == pytest.approx(speedup, abs=1e-3) and muon["speedup_vs_muon"] == 1
        assert verdict.startswith("Dion3 f=auto: ")
        expected = [
            (dion3["final_val_loss"], 5e-4),
            (muon["final_val_loss"], 5e-4),
            (dion3["final_val_loss"] - muon["final_val_loss"], 1e-3),
            (adam["final_val_loss"], 5e-4),
            (max(speedup, 1 / speedup), 0.05),
            (dion3["optimizer_ms"], 5e-3),
            (muon["optimizer_ms"], 5e-3),
        ]
        assert len(numbers(verdict)) == len(expected)
        for got, (want, tolerance) in zip(numbers(verdict), expected):
            assert got == pytest.approx(want, abs=tolerance + 1e-9), verdict
        assert ("faster" if speedup >= 1 else "slower") in verdict


@pytest.mark.slow
def test_tp2_indexed_dataset(tmp_path):
    import numpy as np
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(tmp_path / "corpus_text_document")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    gen = torch.Generator().manual_seed(0)
    successor = torch.randperm(300, generator=gen)
    for _ in range(200):  # documents of a learnable language over 300 token ids (vocab > 256)
        doc = torch.empty(100, dtype=torch.long)
        doc[0] = torch.randint(0, 300, (1,), generator=gen)
        for i in range(1, 100):
            doc[i] = successor[doc[i - 1]] if torch.rand(1, generator=gen) < 0.8 else torch.randint(0, 300, (1,), generator=gen)
        builder.add_item(doc)
        builder.end_document()
    builder.finalize(prefix + ".idx")
    out = run_job(["--tp", "2", "--query-groups", "4", "--data-path", prefix, "--lr", "0.03", "--dion3-fraction", "auto"], cwd=tmp_path)
    assert "Megatron indexed dataset" in out and "vocab 300" in out and "TP=2 DP=1" in out
    # Said once, by the job (not the library's log line too); 64-row matrices: below the floor, f = 1.
    assert out.count("auto chose") == 1 and "Dion3: fraction=auto chose f=1 on every matrix (rows x cols: 64x64" in out
    assert "final validation loss" in out and "verdict: Dion3 f=auto: validation loss" in out
    saved = json.loads((tmp_path / "runs" / "pretrain_gpt" / "dion3.json").read_text())  # JSON without --compare too
    assert saved["results"][0]["dion3_fractions"]["64x64"] == 1.0  # what auto chose, not "auto"
    assert saved["results"][0]["optimizer_ms"] > 0 and (tmp_path / "runs" / "pretrain_gpt" / "dion3.png").exists()
    first = float(out.split("| loss ")[1].split()[0])
    final = float(out.split("final validation loss ")[1].split()[0])
    assert final < first and final < math.log(300)


def test_text_file_and_default_corpus(tmp_path):
    job = load_job()
    text = tmp_path / "t.txt"
    text.write_bytes("héllo wörld\n".encode() * 100)
    tokens, vocab, desc = job.load_tokens(argparse.Namespace(data_path=None, text_file=str(text), max_tokens=10**6))
    assert vocab == 256 and tokens.tolist()[:6] == list("héllo".encode()) and "text file" in desc
    corpus = job.stdlib_corpus(100_000)
    assert len(corpus) == 100_000 and corpus == job.stdlib_corpus(100_000)
    batches = job.Batches(tokens, seq=16, global_batch=4, seed=1)
    b1, b2 = next(batches.train_batches()), next(batches.train_batches())
    assert b1.shape == (4, 17) and b1.equal(b2)  # the same data for every optimizer
    assert job.parse_args(["--compare"]).optimizers == ["dion3", "adam", "muon"]
    with pytest.raises(SystemExit):
        job.parse_args(["--optimizers", "sgd"])


def test_the_model_is_the_same_at_every_tp():
    """GQA: --heads / 4 query groups unless --query-groups says otherwise, whatever --tp."""
    job = load_job()
    assert job.parse_args(["--device", "cpu"]).query_groups == 1
    assert job.parse_args(["--device", "cpu", "--heads", "8", "--tp", "2"]).query_groups == 2
    assert job.parse_args(["--device", "cpu", "--tp", "2", "--query-groups", "2"]).query_groups == 2
    assert job.parse_args(["--device", "cpu", "--heads", "6"]).query_groups == 6  # 4 does not divide 6: one head each


def fake_run(name: str, label: str, val: float, ms: float, steps: int = 100) -> dict:
    losses = [5.5 - 3 * (1 - math.exp(-i / 10)) for i in range(steps)]  # 5.5 falling to ~2.5
    return dict(
        optimizer=name,
        label=label,
        mode="layer-wise ZeRO-1",
        train_loss=losses,
        train_time=[0.1 * (i + 1) for i in range(steps)],
        val_loss=[(steps // 2, val + 0.2), (steps, val)],
        final_train_loss=losses[-1],
        final_train_steps=steps // 10,
        final_val_loss=val,
        optimizer_ms=ms,
        optimizer_ms_from_step=6,
        train_seconds=1.0,
        tokens_per_s=10.0,
    )


META = dict(model="GPT", data="d", device="cpu", tp=1, dp=2, steps=100, global_batch=8, dion3_fraction=0.25)


def test_compare_reports_skipped_muon(tmp_path, monkeypatch, capsys):
    job = load_job()
    monkeypatch.setitem(sys.modules, "emerging_optimizers", None)  # as if the package were not installed
    why = job.muon_unavailable()
    assert why and "emerging-optimizers" in why
    args = argparse.Namespace(compare=True, out_dir=str(tmp_path), optimizers=["dion3", "adam", "muon"])
    job.report(args, [fake_run("dion3", "Dion3", 3.1, 2.0), fake_run("adam", "AdamW", 3.3, 1.0)], {"muon": why}, META)
    out = capsys.readouterr().out
    assert "| Muon" in out and "skipped" in out and f"Muon was skipped: {why}" in out
    assert (
        "verdict: Dion3 f=0.25: validation loss 3.100, AdamW 3.300; Muon skipped, so no step-time comparison; "
        "Dion3 optimizer step 2.00 ms (layer-wise ZeRO-1)"
    ) in out
    saved = json.loads((tmp_path / "compare.json").read_text())
    assert saved["skipped"] == {"muon": why} and (tmp_path / "compare.png").exists()
    assert f"wrote {tmp_path / 'compare.json'} and {tmp_path / 'compare.png'}" in out


def test_verdict_and_plot(tmp_path):
    from examples import compare_report as cr

    dion3, muon = fake_run("dion3", "Dion3", 3.25, 8.0), fake_run("muon", "Muon", 3.2, 2.0)
    muon["mode"] = "DDP"
    line = cr.verdict([dion3, muon], {}, 0.25)  # slower and behind: said so, both layouts named
    assert line == (
        "Dion3 f=0.25: validation loss 3.250 vs Muon 3.200 (+0.050); optimizer step 4.0x slower "
        "than Muon (8.00 vs 2.00 ms, Dion3 layer-wise ZeRO-1, Muon DDP)"
    )
    assert "4.00x slower" in cr.table([dion3, muon], {}) and cr.output_stem(False, ["dion3", "adam"]) == "dion3+adam"
    fig = cr.plot_figure([dion3, muon], META)
    by_step, by_time = fig.axes[:2]
    assert by_step.get_xlabel() == "step" and "seconds" in by_time.get_xlabel()
    low, high = by_step.get_ylim()  # the interesting band, not from the initial 5.5
    assert 2.3 < low < 2.6 and high < 4.5
    assert [ln.get_linestyle() for ln in by_step.lines[::2]] == ["-", "--"]  # Dion3 solid, Muon dashed
    assert "moving mean over 2 steps" in by_step.get_legend().get_title().get_text()


def test_help_gives_every_flag_a_text_and_its_default_once(capsys):
    job = load_job()
    with pytest.raises(SystemExit) as exit_info:
        job.parse_args(["--help"])
    assert exit_info.value.code == 0
    helps: dict[str, str] = {}  # flag -> its help text
    for line in capsys.readouterr().out.splitlines():
        if line.startswith("  -"):  # a flag, and maybe the start of its help
            flag, _, text = line.strip().partition("  ")
            current = flag.split()[0].rstrip(",")
            helps[current] = text.strip()
        elif line.startswith("    ") and helps:  # the help, continued
            helps[current] = f"{helps[current]} {line.strip()}".strip()
    assert {
        "--layers",
        "--hidden",
        "--heads",
        "--ffn",
        "--seq-length",
        "--global-batch",
        "--steps",
        "--seed",
        "--weight-decay",
        "--clip-grad",
        "--lr",
        "--dion3-fraction",
    } <= set(helps)
    for flag, text in helps.items():
        assert text, f"{flag} has no help"
        assert text.count("(default") <= 1, f"{flag}: {text}"
    assert helps["--layers"] == "transformer layers (default: 4 on CPU, 8 on GPUs)"
    assert helps["--lr"].endswith("(default: the library's, 0.01)")


def test_the_dion3_run_takes_the_librarys_defaults():
    """The README says the example trains with the library's defaults: its Dion3 run's lr, the AdamW
    lr of its embeddings and output layer (Megatron's decoupled lr), weight decay and f are the
    option spec's, and the other runs keep their own lrs."""
    from dion3_megatron import options

    job = load_job()
    args = job.parse_args([])
    dion3 = job.optimizer_config(args, "dion3", cuda=False)
    defaults = [options.BY_NAME[name].default for name in ("lr", "adamw_lr", "weight_decay", "fraction")]
    assert [dion3.lr, dion3.decoupled_lr, dion3.weight_decay, dion3.dion3_fraction] == defaults
    assert (dion3.min_lr, dion3.decoupled_min_lr) == (dion3.lr / 10, dion3.decoupled_lr / 10)
    muon, adam = job.optimizer_config(args, "muon", cuda=False), job.optimizer_config(args, "adam", cuda=False)
    assert (muon.lr, muon.decoupled_lr, adam.lr, adam.decoupled_lr) == (args.muon_lr, args.adam_lr, args.adam_lr, None)
    set_by_flags = job.optimizer_config(job.parse_args(["--decoupled-lr", "0.001", "--lr", "0.02"]), "dion3", cuda=False)
    assert (set_by_flags.lr, set_by_flags.decoupled_lr) == (0.02, 0.001)


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--steps", "0"], "--steps must be at least 1, got 0"),
        (["--tp", "3"], "--tp 3 must divide the number of processes, 2"),
        (["--heads", "3", "--tp", "2"], "--tp 2 must divide --heads 3"),
        (
            ["--tp", "2"],
            "--tp 2 must divide the query groups, 1 (--heads 4 / 4): give --query-groups 2 (a multiple of "
            "--tp 2 that divides --heads 4), also at TP=1 for the same model",
        ),
        (["--heads", "8", "--query-groups", "3"], "--query-groups 3 must divide --heads 8"),
        (["--global-batch", "3"], "--global-batch 3 must divide by the data-parallel size 2"),
        (["--lr", "-1"], "argument --lr: lr must be a finite number >= 0, got -1.0"),
        (["--weight-decay", "nan"], "argument --weight-decay: weight_decay must be a finite number >= 0, got nan"),
        (["--adam-lr", "-0.1"], "--adam-lr must be a finite number >= 0, got -0.1"),
        (["--decoupled-lr", "0"], "argument --decoupled-lr: adamw_lr must be a finite number > 0, got 0.0"),
        (["--dion3-fraction", "0"], "argument --dion3-fraction: fraction must be in (0, 1] or 'auto', got 0.0"),
        (["--dion3-fraction", "half"], "argument --dion3-fraction: fraction must be in (0, 1] or 'auto', got 'half'"),
        (["--text-file", "/no/such/file"], "--text-file /no/such/file: no such file"),
        (["--data-path", "/no/such/prefix"], "--data-path /no/such/prefix: no /no/such/prefix.bin or /no/such/prefix.idx"),
    ],
)
def test_bad_arguments_get_one_line_before_any_worker_starts(argv, words, monkeypatch, capsys):
    job = load_job()
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(job, "launch", lambda *a: pytest.fail("a worker was started"))
    with pytest.raises(SystemExit) as exit_info:
        job.main(["--device", "cpu", *argv])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and words in err, err
