"""The examples' command lines and logs, run as the docs show them: every option's default in
--help, a hint for another front end's spelling of an option, DeepSpeed on a CPU machine without
--cpu, and readable logs (ZeRO-3 without torch's deprecation notices; Megatron-LM's training loop on
CPU with its loss every few iterations and what fraction="auto" chose)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch
from support import one_process, repository
from support.megatron_flags import LOCAL_LAYERS

ROOT = str(repository.ROOT)
WITH_OPTIONS = ["examples/quickstart.py", "examples/fsdp2_train.py", "examples/pretrain_gpt.py", "examples/deepspeed/train_gpt.py"]


def run(argv: list[str], timeout: int = 300, unset: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """python ARGV in the repository, with none of a launcher's variables nor those in ``unset``."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", *unset)}
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def run_in_one_process(argvs: list[list[str]]) -> dict[tuple[str, ...], subprocess.CompletedProcess]:
    """Each argv's run, by argv, as ``run`` would return it: all in one interpreter (support/one_process.py)."""
    return one_process.results(argvs, run(one_process.arguments(argvs)))


def option_entries(help_text: str) -> dict[str, str]:
    """argparse's --help: each option's first flag -> its entry (the flags, the help, its continuation lines)."""
    entries: dict[str, str] = {}
    flag = None
    for line in help_text.splitlines():
        match = re.match(r"  (-[-\w]+)", line)
        if match:
            flag = match.group(1)
            entries[flag] = line
        elif flag and line.startswith("    "):
            entries[flag] += " " + line.strip()
        else:
            flag = None
    return entries


@pytest.mark.parametrize("script", WITH_OPTIONS)
@pytest.mark.slow
def test_every_option_has_help_with_its_default(script, parsed):
    out = parsed[script, "--help"]
    assert out.returncode == 0, out.stderr[-3000:]
    entries = option_entries(out.stdout)
    assert "--steps" in entries, out.stdout
    undocumented = {flag: entry for flag, entry in entries.items() if flag != "-h" and "default" not in entry}
    assert not undocumented, undocumented


HINTS = [
    ("examples/quickstart.py", "--dion3-fraction", "--fraction"),
    ("examples/fsdp2_train.py", "--dion3-fraction=0.5", "--fraction"),
    ("examples/pretrain_gpt.py", "--fraction", "--dion3-fraction"),
]


def hint_argv(script: str, given: str) -> list[str]:
    return [script, given, "0.25"] if "=" not in given else [script, given]


@pytest.fixture(scope="module")
def parsed() -> dict[tuple[str, ...], subprocess.CompletedProcess]:
    """The scripts' runs that end in their parsers (the hints, then --help; DeepSpeed's script,
    whose import brings DeepSpeed, last), in one process."""
    return run_in_one_process([hint_argv(script, given) for script, given, _ in HINTS] + [[script, "--help"] for script in WITH_OPTIONS])


@pytest.mark.parametrize("script, given, ours", HINTS)
@pytest.mark.slow
def test_another_front_ends_spelling_gets_a_hint(script, given, ours, parsed):
    out = parsed[tuple(hint_argv(script, given))]
    assert out.returncode == 2
    assert f"unrecognized arguments: {given.split('=')[0]} (did you mean {ours}?)" in out.stderr, out.stderr


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU route without --cpu")
def test_deepspeed_zero3_on_cpu_without_the_cpu_flag_and_without_deprecation_notices():
    """On a machine without CUDA the DeepSpeed example picks gloo itself (NCCL would fail), and
    ZeRO-3's collectives print no FutureWarning of torch's."""
    out = run(
        [
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "examples/deepspeed/train_gpt.py",
            "--config",
            "examples/deepspeed/ds_config_dion3_zero3.json",
            "--width",
            "64",
            "--layers",
            "2",
            "--seq",
            "64",
            "--steps",
            "3",
        ],
        unset=("DS_ACCELERATOR",),
    )
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-6000:]
    assert '"device": "cpu"' in text and "FutureWarning" not in text and "NCCL" not in text, text[-6000:]


@pytest.mark.slow
def test_megatron_lm_loop_on_cpu_logs_the_loss_and_what_auto_chose():
    """docs/megatron.md's CPU command (shortened, one process): the loss every tenth of the run,
    the f that fraction="auto" chose per shape, and no dump of Megatron's arguments."""
    out = run(
        [
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "1",
            "examples/megatron_cpu.py",
            "examples/megatron_lm_pretrain_gpt.py",
            "--optimizer",
            "dion3",
            "--use-distributed-optimizer",
            "--lr",
            "0.01",
            "--decoupled-lr",
            "0.002",
            "--num-layers",
            "2",
            "--hidden-size",
            "64",
            "--num-attention-heads",
            "4",
            "--seq-length",
            "64",
            "--max-position-embeddings",
            "64",
            "--vocab-size",
            "256",
            "--micro-batch-size",
            "4",
            "--global-batch-size",
            "4",
            "--train-iters",
            "20",
            "--eval-interval",
            "1000",
            "--eval-iters",
            "0",
            *LOCAL_LAYERS,
        ]
    )
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-6000:]
    logged = {int(i) for i in re.findall(r"iteration\s+(\d+)/\s*20 \|.*? lm loss: ", text)}
    assert set(range(2, 21, 2)) <= logged, logged
    assert re.search(r"Dion3 fraction=auto chose \(rows x cols: f\) 64x64: [\d.]+, 64x256: [\d.]+", text), text[-6000:]
    assert "------------------------ arguments" not in text and "UserWarning" not in text
    assert len(text.splitlines()) < 150, len(text.splitlines())
