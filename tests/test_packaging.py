"""pyproject.toml: the metadata, the extras (those the docs and CI name exist; [test] brings what the
tests import; [test] and [all] stay the unions they are declared as), and ruff passes."""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import pathlib
import re
import subprocess
import sys
import tomllib

import pytest
from packaging.requirements import Requirement

import dion3_megatron

ROOT = pathlib.Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
PROJECT = PYPROJECT["project"]
EXTRAS = PROJECT["optional-dependencies"]

# Top-level modules the tests import (at module level, in a test, or through importorskip/find_spec)
# -> their distribution. A module missing here fails test_test_extra_brings_what_the_tests_import.
DISTRIBUTIONS = {
    "torch": "torch",
    "pytest": "pytest",
    "numpy": "numpy",
    "megatron": "megatron-core",
    "deepspeed": "deepspeed",
    "transformers": "transformers",
    "cutlass": "nvidia-cutlass-dsl",
    "tvm_ffi": "apache-tvm-ffi",
    "triton": "triton",
    "packaging": "packaging",
    "ruff": "ruff",
}
# Distributions the tests import that [test] leaves to something else, and what brings them.
BROUGHT_OTHERWISE = {
    "nvidia-cutlass-dsl": "kernels",
    "apache-tvm-ffi": "kernels",  # the [kernels] extra (Hopper GPUs); the tests of its kernels skip without it
    "triton": "torch",  # a requirement of torch's Linux wheels
    "packaging": "pytest",  # a requirement of pytest
}


def names(requirements: list[str]) -> set[str]:
    return {Requirement(r).name for r in requirements}


def test_metadata():
    assert PROJECT["name"] == "dion3-megatron"
    assert PROJECT["version"] == dion3_megatron.__version__ == "0.1.0"
    assert PROJECT["requires-python"] == ">=3.12"
    assert PROJECT["dependencies"] == ["torch>=2.4"]
    assert PROJECT["license"] == "Apache-2.0" and PROJECT["license-files"] == ["LICENSE"]
    license_text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    assert "END OF TERMS AND CONDITIONS" in license_text and "Copyright 2026 dion3-megatron contributors" in license_text
    assert (ROOT / PROJECT["readme"]).is_file()
    assert PYPROJECT["build-system"]["build-backend"] == "setuptools.build_meta"
    assert PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"] == ["dion3_megatron*"]


def test_pyproject_is_the_only_packaging_and_pytest_configuration():
    """A pytest.ini (or setup.cfg / tox.ini with a [pytest] section) would take precedence over
    [tool.pytest.ini_options] and silently drop its markers; a setup.py would be a second source
    of the metadata."""
    for name in ("setup.py", "setup.cfg", "pytest.ini", "tox.ini"):
        assert not (ROOT / name).exists(), name
    options = PYPROJECT["tool"]["pytest"]["ini_options"]
    assert options["testpaths"] == ["tests"]
    assert {m.split(":")[0] for m in options["markers"]} == {"gpu", "slow"}


def mentioned_extras(text: str) -> set[str]:
    """Extras a text names: `.[a,b]` and `dion3-megatron[a]` (pip), `` `[a]` `` and "the `a` extra"."""
    found = set()
    for match in re.finditer(r"(?:\.|dion3-megatron)\[([a-z][a-z0-9_,\- ]*)\]", text):
        found |= {name.strip() for name in match.group(1).split(",")}
    found |= set(re.findall(r"`\[([a-z][a-z0-9_-]*)\]`", text))
    found |= set(re.findall(r"\[([a-z][a-z0-9_-]*)\] extra\b", text))
    found |= set(re.findall(r"`+([a-z][a-z0-9_-]*)`+ extra\b", text))
    return found


def test_mentioned_extras_finds_each_spelling():
    text = 'pip install -e ".[megatron, hf]"; pip install "dion3-megatron[deepspeed]"; `[kernels]`; the ``test`` extra'
    assert mentioned_extras(text) == {"megatron", "hf", "deepspeed", "kernels", "test"}
    assert mentioned_extras("x[0], `[]`, a [link](url), params[i]") == set()


def test_the_extras_the_docs_and_ci_name_exist():
    assert set(EXTRAS) == {"megatron", "deepspeed", "kernels", "hf", "test", "all"}
    readme = mentioned_extras((ROOT / "README.md").read_text(encoding="utf-8"))
    ci = mentioned_extras((ROOT / ".ci" / "run").read_text(encoding="utf-8"))
    assert "megatron" in readme and "test" in readme, readme  # the install and the test commands
    assert ci == {"test"}, ci
    named = {}
    files = [ROOT / "README.md", ROOT / ".ci" / "run", *sorted((ROOT / "docs").rglob("*.md"))]
    for folder in ("examples", "patches", "dion3_megatron", "tests", "benchmarks", "tools"):
        files += sorted(p for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".sh", ".md", ".patch"))
    for path in files:
        if path.name != "test_packaging.py":
            for extra in mentioned_extras(path.read_text(encoding="utf-8", errors="replace")):
                named.setdefault(extra, path.relative_to(ROOT).as_posix())
    unknown = {extra: where for extra, where in named.items() if extra not in EXTRAS}
    assert not unknown, f"extras named but not declared in pyproject.toml: {unknown}"


def test_test_and_all_are_the_unions_they_are_declared_as():
    for extra, requirements in EXTRAS.items():
        assert len(names(requirements)) == len(requirements), f"[{extra}] names a distribution twice"
    frameworks = set(EXTRAS["megatron"]) | set(EXTRAS["deepspeed"]) | set(EXTRAS["hf"])
    assert frameworks <= set(EXTRAS["test"])
    assert names(set(EXTRAS["test"]) - frameworks) == {"pytest", "numpy", "ruff"}
    others = {r for extra, reqs in EXTRAS.items() if extra != "all" for r in reqs}
    assert EXTRAS["all"] == sorted(others)
    megatron = names(EXTRAS["megatron"])  # Megatron's --optimizer muon (the main job's --compare) imports both
    assert {"megatron-core", "emerging-optimizers", "absl-py"} <= megatron


def imported_modules(path: pathlib.Path) -> set[str]:
    """Top-level names of what a file imports anywhere, or asks for by name (importorskip, find_spec)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            found.add(node.module)
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and getattr(node.func, "attr", getattr(node.func, "id", None)) in ("importorskip", "find_spec")):
            found.add(node.args[0].value)
    return {name.split(".")[0] for name in found}


def test_test_extra_brings_what_the_tests_import():
    local = {p.stem for folder in ("tests", "examples", "benchmarks", "tools") for p in (ROOT / folder).rglob("*.py")}
    local |= {"dion3_megatron", "tests", "support", "examples", "benchmarks", "tools"}
    imported = set().union(*(imported_modules(p) for p in (ROOT / "tests").rglob("*.py")))  # support/ too
    third_party = sorted(m for m in imported if m not in sys.stdlib_module_names and m not in local)
    assert {"torch", "pytest", "numpy", "megatron", "deepspeed", "transformers"} <= set(third_party)
    unmapped = [m for m in third_party if m not in DISTRIBUTIONS]
    assert not unmapped, f"map these to their distributions in DISTRIBUTIONS (and add them to [test]): {unmapped}"
    brought = names(EXTRAS["test"]) | names(PROJECT["dependencies"])
    for module in third_party:
        dist = DISTRIBUTIONS[module]
        if dist in brought:
            continue
        assert dist in BROUGHT_OTHERWISE, f"the tests import {module} ({dist}): add it to [test]"
        by = BROUGHT_OTHERWISE[dist]
        if by in EXTRAS:
            assert dist in names(EXTRAS[by]), (dist, by)
        else:  # a requirement of a distribution [test] brings
            assert by in brought and dist in names(importlib.metadata.requires(by) or []), (dist, by)
    # Hugging Face's Trainer (tests/support/hf_trainer_helpers.py) needs accelerate, which the tests never import.
    assert "accelerate" in names(EXTRAS["test"])


def test_ruff_holds_every_file_to_its_line_length():
    """The line length is one the code meets: E501 (in "E") applies to every file, none exempted."""
    ruff = PYPROJECT["tool"]["ruff"]
    assert ruff["target-version"] == "py312" and "E" in ruff["lint"]["select"]
    assert "pycodestyle" not in ruff["lint"]  # no second, longer limit for E501
    assert not any("E501" in rules or "E" in rules for rules in ruff["lint"]["per-file-ignores"].values())
    longest = max(len(line) for folder in ("dion3_megatron", "tests", "examples", "benchmarks", "tools")
                  for path in (ROOT / folder).rglob("*.py") for line in path.read_text(encoding="utf-8").splitlines())
    assert longest <= ruff["line-length"]
    for path in ruff["lint"]["per-file-ignores"]:
        assert (ROOT / path).is_file(), f"per-file-ignores names a file that is gone: {path}"


@pytest.mark.skipif(importlib.util.find_spec("ruff") is None,
                    reason="ruff is not installed (it is in the [test] extra: pip install -e '.[test]')")
def test_ruff_passes():
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
