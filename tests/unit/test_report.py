"""``python -m dion3_megatron``: the environment report, run as a user runs it."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import subprocess
import sys
import tomllib

import pytest
import torch
from packaging.requirements import Requirement
from support.repository import ROOT

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
        "front ends",
        "device and kernels",
        "GPU",
        "symmetric-GEMM kernels (CuTe DSL)",
        "row kernels (Triton)",
        'fraction="auto" on this',
    ):
        assert line in text, (line, text)
    for front_end in report.FRONT_ENDS:  # the test install has every framework at its version
        assert re.search(rf"^  {re.escape(front_end.label)} +yes$", text, re.M), (front_end.label, text)
    shapes = {line.split()[0] for line in text.splitlines() if " f = " in line}
    assert shapes == {"4096x14336", "256x1024"}, text
    if not torch.cuda.is_available():
        assert re.search(r"^  row kernels \(Triton\) +off: no GPU$", text, re.M) and "on this CPU" in text, text


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


def _installed(monkeypatch, versions: dict[str, str | None]) -> None:
    """importlib.metadata as if these distributions were installed at these versions (None: not installed)."""
    real = importlib.metadata.version

    def version(name: str) -> str:
        if name in versions:
            if versions[name] is None:
                raise importlib.metadata.PackageNotFoundError(name)
            return versions[name]
        return real(name)

    monkeypatch.setattr(importlib.metadata, "version", version)


def _imported(monkeypatch) -> list[tuple[str, ...]]:
    """The import checks the report makes, each answered 'yes' without importing anything."""
    asked: list[tuple[str, ...]] = []
    monkeypatch.setattr(report, "_imports", lambda modules: asked.append(tuple(modules)) or "yes")
    return asked


def test_a_front_end_whose_framework_is_not_installed_is_no_and_names_what_to_install(monkeypatch):
    _installed(monkeypatch, {"megatron-core": None, "deepspeed": None, "transformers": None, "accelerate": None, "torchtitan": None})
    asked = _imported(monkeypatch)
    lines = {line.label: line.value for line in report.front_ends()}
    assert lines == {
        "torch (dion3_megatron.Dion3)": "yes",
        "FSDP2 / DTensor": "yes",
        "Megatron-Core (--optimizer dion3)": 'no: megatron-core not installed (pip install "dion3-megatron[megatron]")',
        'DeepSpeed ("type": "Dion3")': 'no: deepspeed not installed (pip install "dion3-megatron[deepspeed]")',
        "Hugging Face Trainer": "no: deepspeed not installed; transformers not installed; accelerate not installed "
        '(pip install "dion3-megatron[hf]")',
        'torchtitan ("Dion3" in its optimizer config)': 'no: torchtitan not installed (pip install "dion3-megatron[torchtitan]")',
    }
    assert asked == [front_end.modules for front_end in report.FRONT_ENDS[:2]]  # nothing imported for the others


def test_a_front_end_whose_framework_is_at_another_version_is_no_and_says_which_it_needs(monkeypatch):
    _installed(monkeypatch, {"megatron-core": "0.18.1", "deepspeed": "0.20.0", "torch": "2.12.0+cu130", "torchtitan": "0.3.0"})
    _imported(monkeypatch)
    declared = report.declared_requirements()
    lines = {line.label: line.value for line in report.front_ends()}
    wanted = report._REQUIREMENT.fullmatch(declared["deepspeed"][0])[2]  # as pyproject.toml or the metadata spells it
    assert (
        lines["Megatron-Core (--optimizer dion3)"]
        == 'no: megatron-core 0.18.1 installed, ==0.19.* needed (pip install "dion3-megatron[megatron]")'
    )
    assert lines['DeepSpeed ("type": "Dion3")'] == (
        f'no: deepspeed 0.20.0 installed, {wanted} needed (pip install "dion3-megatron[deepspeed]")'
    )
    assert lines['torchtitan ("Dion3" in its optimizer config)'] == (
        'no: torch 2.12.0+cu130 installed, >=2.13 needed (pip install "dion3-megatron[torchtitan]")'
    )
    assert lines["torch (dion3_megatron.Dion3)"] == "yes"  # 2.12: within the library's own range


def test_a_front_end_whose_framework_is_installed_at_its_version_is_yes_only_if_it_imports(monkeypatch):
    _installed(monkeypatch, {"deepspeed": "0.19.8"})
    monkeypatch.setattr(report, "FRONT_ENDS", (report.FrontEnd("DeepSpeed", "deepspeed", ("a_module_nowhere",)),))
    assert report.front_ends() == [report.Line("DeepSpeed", "no (ModuleNotFoundError: No module named 'a_module_nowhere')")]


@pytest.mark.parametrize(
    "version, specifier, met",
    [
        ("0.19.2", "==0.19.*", True),
        ("0.190.0", "==0.19.*", False),
        ("0.20.0", "==0.19.*", False),
        ("0.19.8", ">=0.19,<0.20", True),
        ("0.19.8", "<0.20,>=0.19", True),
        ("0.20.0", ">=0.19,<0.20", False),
        ("0.18.9", ">=0.19,<0.20", False),
        ("2.14.1+cu130", ">=2.11,<2.15", True),
        ("2.15.0rc1", ">=2.11,<2.15", False),
        ("0.3.0", "==0.3.0", True),
        ("0.3", "==0.3.0", True),
        ("0.3.1", "==0.3.0", False),
        ("4.8.1", "~=4.8", True),
        ("5.0", "~=4.8", False),
        ("1.0", "!=1.0.*", False),
        ("1.16.0", ">=1.1", True),
        ("1.0.9", ">1.0.9", False),
        ("1.0.9", "<=1.0.9", True),
        ("4.0", "", True),
    ],
)
def test_a_version_meets_a_specifier_as_pip_reads_it(version, specifier, met):
    assert report.satisfies(version, specifier) is met


def test_a_specifier_of_another_form_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"got '===1.0'"):
        report.satisfies("1.0", ">=0.1,===1.0")


def test_the_requirements_are_pyproject_s_whether_read_from_it_or_from_the_installed_metadata():
    """From a source tree the report reads pyproject.toml; from a wheel, the metadata built from it."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    declared = report.declared_requirements()

    def read(requirements: list[str]) -> set[tuple[str, str]]:
        return {(r.name, str(r.specifier)) for r in map(Requirement, requirements)}  # as pip reads them, in any order

    assert read(declared[None]) == read(project["dependencies"])
    for extra, requirements in project["optional-dependencies"].items():
        assert read(declared[extra]) == read(requirements), extra


def test_without_a_pyproject_beside_the_package_the_metadata_s_requirements_are_read_by_extra(tmp_path, monkeypatch):
    metadata = ["torch<2.15,>=2.11", 'megatron-core==0.19.*; extra == "megatron"', 'nvidia-cutlass-dsl[cu13]<4.9,>=4.8; extra == "kernels"']
    monkeypatch.setattr(importlib.metadata, "requires", lambda name: metadata if name == "dion3-megatron" else None)
    assert report.declared_requirements(tmp_path / "pyproject.toml") == {
        None: ["torch<2.15,>=2.11"],
        "megatron": ["megatron-core==0.19.*"],
        "kernels": ["nvidia-cutlass-dsl[cu13]<4.9,>=4.8"],
    }


def _kernel_state(monkeypatch, importable: set[str], capability=None, env: dict[str, str] | None = None) -> tuple[str, str]:
    """The report's two kernel lines with these modules importable and, given a capability, on a
    CUDA device of that capability whose Triton kernels build."""
    from dion3_megatron.kernels import rows
    from dion3_megatron.kernels.symm import backend

    monkeypatch.setattr(backend, "_importable", lambda name: name in importable)
    backend.missing.cache_clear()
    monkeypatch.setattr(report, "declared_requirements", lambda: {})
    for name in ("DION3_KERNELS", "DION3_FUSED_ROWS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in (env or {}).items():
        monkeypatch.setenv(name, value)
    if capability is not None:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        monkeypatch.setattr(report, "device", lambda: torch.device("cuda", 0))
        monkeypatch.setattr(rows, "runs_on", lambda device: True)
        monkeypatch.setattr(
            importlib.util, "find_spec", lambda name, *a, real=importlib.util.find_spec: object() if name == "triton" else real(name, *a)
        )
    try:
        lines = {line.label: line.value for line in report.kernels()}
    finally:
        backend.missing.cache_clear()
    return lines["symmetric-GEMM kernels (CuTe DSL)"], lines["row kernels (Triton)"]


COST = "Gram Newton-Schulz runs on cuBLAS, 1.45x the time it takes on the kernels (14B shapes, one H200)"


@pytest.mark.parametrize(
    "importable, capability, env, symmetric, rows",
    [
        (
            {"cutlass.cute", "tvm_ffi"},
            (9, 0),
            {},
            "on, where a product fills the GPU (--shape says for a shape)",
            "on",
        ),
        (
            {"cutlass.cute"},
            (9, 0),
            {},
            f"off: nvidia-cutlass-dsl is installed but apache-tvm-ffi is not: {COST} (pip install 'dion3-megatron[kernels]')",
            "on",
        ),
        (
            {"tvm_ffi"},
            (9, 0),
            {},
            f"off: apache-tvm-ffi is installed but nvidia-cutlass-dsl is not: {COST} (pip install 'dion3-megatron[kernels]')",
            "on",
        ),
        (
            set(),
            None,
            {},
            "off: nvidia-cutlass-dsl and apache-tvm-ffi not installed (pip install 'dion3-megatron[kernels]'); no GPU",
            "off: no GPU",
        ),
        (
            {"cutlass.cute", "tvm_ffi"},
            (8, 0),
            {},
            "off: not a Hopper GPU (compute capability 8.0; the kernels need 9.0)",
            "on",
        ),
        ({"cutlass.cute", "tvm_ffi"}, (9, 0), {"DION3_KERNELS": "0"}, "off: DION3_KERNELS=0", "off: DION3_KERNELS=0"),
        (
            {"cutlass.cute", "tvm_ffi"},
            (9, 0),
            {"DION3_FUSED_ROWS": "0"},
            "on, where a product fills the GPU (--shape says for a shape)",
            "off: DION3_FUSED_ROWS=0",
        ),
    ],
    ids=["installed", "without-tvm-ffi", "without-cutlass-dsl", "nothing-no-gpu", "ampere", "DION3_KERNELS=0", "DION3_FUSED_ROWS=0"],
)
def test_the_report_says_whether_each_kind_of_kernel_runs_and_every_reason_it_does_not(
    monkeypatch, importable, capability, env, symmetric, rows
):
    assert _kernel_state(monkeypatch, importable, capability, env) == (symmetric, rows)


def test_the_report_calls_kernels_turned_off_in_code_by_their_setting(monkeypatch):
    from dion3_megatron import kernels

    with kernels.using(kernels="torch"):
        symmetric, rows = _kernel_state(monkeypatch, {"cutlass.cute", "tvm_ffi"}, (9, 0))
    assert symmetric == rows == "off: kernels='torch' set in code (dion3_megatron.kernels.configure)"
