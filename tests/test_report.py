"""``python -m dion3_megatron``: the environment report, run as a user runs it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from dion3_megatron import report


def run_report(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-m", "dion3_megatron", *argv], capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.slow
def test_the_report_names_versions_front_ends_kernels_and_what_auto_chooses():
    out = run_report("--shape", "4096x14336", "--shape", "256x1024")
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    for line in (
        "versions",
        "dion3-megatron",
        "torch CUDA build",
        "megatron-core",
        "deepspeed",
        "transformers",
        "nvidia-cutlass-dsl",
        "triton",
        "front ends (import)",
        "FSDP2 / DTensor",
        "Megatron-Core",
        "DeepSpeed",
        "Hugging Face Trainer",
        "device and kernels",
        "GPU",
        "symmetric GEMMs routed",
        'fraction="auto" on this',
    ):
        assert line in text, (line, text)
    shapes = {line.split()[0] for line in text.splitlines() if " f = " in line}
    assert shapes == {"4096x14336", "256x1024"}, text
    if not torch.cuda.is_available():
        assert "not routed: no CUDA device" in text and "on this CPU" in text


def test_the_report_chooses_as_the_cost_model_does():
    """The f shown is the engine's choice on this machine's measured speed (cost_model.choose_fraction)."""
    from dion3_megatron.core import cost_model
    from dion3_megatron.engine import fractions

    device = report.device()
    speed = fractions.measure(device, torch.float16 if device.type == "cuda" else torch.float32)
    [line] = report.auto_choices([(4096, 14336)], world=2, batch=8)
    assert line.value.startswith(f"f = {cost_model.choose_fraction(4096, 14336, speed, 2, 8):g} ")


def test_help_documents_the_options(capsys):
    from dion3_megatron.__main__ import parse_args

    with pytest.raises(SystemExit) as exit_:
        parse_args(["--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0
    for option in ("--shape", "--world", "--batch", "ROWSxCOLS", "default: 1"):
        assert option in out, out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--shape", "4096by14336"], "--shape: a shape is ROWSxCOLS"),
        (["--shape", "0x5"], "got '0x5'"),
        (["--world", "0"], "--world must be at least 1, got 0"),
    ],
)
def test_bad_options_are_named(argv, message, capsys):
    from dion3_megatron.__main__ import parse_args

    with pytest.raises(SystemExit) as exit_:
        parse_args(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.slow
def test_importing_the_report_imports_no_framework():
    code = (
        "import sys, dion3_megatron.report, dion3_megatron.__main__; "
        "print(sorted(m for m in ('megatron', 'deepspeed', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr
