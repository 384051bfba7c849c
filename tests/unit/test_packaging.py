"""pyproject.toml: the metadata, the extras (those the docs and CI name exist; [test] brings what the
tests import; the front-end extras bring only what the library imports, [all] is their union), the
long description an index renders, CITATION.cff, and ruff passes."""

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
import torch
import yaml
from packaging.requirements import Requirement
from support.repository import ROOT

import dion3_megatron
from dion3_megatron.kernels.symm import backend

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
    "torchtitan": "torchtitan",
    "tvm_ffi": "apache-tvm-ffi",
    "triton": "triton",
    "packaging": "packaging",
    "ruff": "ruff",
    "yaml": "pyyaml",
}
# Distributions the tests import that [test] leaves to something else, and what brings them.
BROUGHT_OTHERWISE = {
    "nvidia-cutlass-dsl": "kernels",
    "apache-tvm-ffi": "kernels",  # the [kernels] extra (Hopper GPUs); the tests of its kernels skip without it
    "torchtitan": "torchtitan",  # the [torchtitan] extra; .ci/run installs it without its requirements
    "ruff": "lint",  # the [lint] extra; the lint test skips without it
    "triton": "torch",  # a requirement of torch's Linux CUDA wheels (its tests skip without it)
    "packaging": "pytest",  # a requirement of pytest
    "pyyaml": "transformers",  # a requirement of transformers
}
# Brought by a requirement only in some of its builds: torch's CPU wheels come without triton.
OPTIONAL_IN_SOME_BUILDS = {"triton": "torch"}
# The extras a user installs (a front end or the kernels) and the tools'.
USER_EXTRAS = {"megatron", "deepspeed", "hf", "kernels"}
# A front end's extra that [all] leaves out: a training stack of its own.
STACK_EXTRAS = {"torchtitan"}
TOOL_EXTRAS = {"examples", "test", "docs", "lint"}


def names(requirements: list[str]) -> set[str]:
    return {Requirement(r).name for r in requirements}


def test_metadata():
    assert PROJECT["name"] == "dion3-megatron"
    assert PROJECT["version"] == dion3_megatron.__version__ == "0.2.0"
    assert PROJECT["requires-python"] == ">=3.12"
    assert PROJECT["dependencies"] == ["torch>=2.11,<2.15"]  # tested 2.11-2.14; frontend/dtensor.py's private DTensor helpers
    classifiers = set(PROJECT["classifiers"])
    assert {
        "Programming Language :: Python :: 3.12",
        "Programming Language :: Python :: 3.13",
        "Operating System :: POSIX :: Linux",
        "Typing :: Typed",
    } <= classifiers
    assert any(c.startswith("Topic :: Scientific/Engineering :: Artificial Intelligence") for c in classifiers)
    assert PROJECT["keywords"] and set(PROJECT["urls"]) == {"Homepage", "Documentation", "Source", "Issues", "Changelog"}
    assert all(url.startswith("https://github.com/dion3-megatron/dion3-megatron") for url in PROJECT["urls"].values())
    assert PROJECT["license"] == "Apache-2.0" and PROJECT["license-files"] == ["LICENSE"]
    license_text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    assert "END OF TERMS AND CONDITIONS" in license_text and "Copyright 2026 dion3-megatron contributors" in license_text
    assert PROJECT["readme"] == {"file": "README.md", "content-type": "text/markdown"}
    assert (ROOT / "dion3_megatron" / "py.typed").is_file()
    assert PYPROJECT["tool"]["setuptools"]["package-data"]["dion3_megatron"] == ["py.typed"]
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
    assert set(EXTRAS) == USER_EXTRAS | STACK_EXTRAS | TOOL_EXTRAS | {"all"}
    readme = mentioned_extras((ROOT / "README.md").read_text(encoding="utf-8"))
    ci = mentioned_extras((ROOT / ".ci" / "run").read_text(encoding="utf-8"))
    assert "megatron" in readme and "test" in readme, readme  # the install and the test commands
    assert ci == {"test", "lint", "docs"}, ci
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


def test_the_extras_are_the_unions_they_are_declared_as():
    """[all] is what a user runs (the front ends and the kernels), not the tools; [examples] adds to
    the front ends what the examples use; [test] is [examples] with pytest and numpy."""
    for extra, requirements in EXTRAS.items():
        assert len(names(requirements)) == len(requirements), f"[{extra}] names a distribution twice"
    assert EXTRAS["all"] == sorted({r for extra in USER_EXTRAS for r in EXTRAS[extra]})
    frameworks = {r for extra in ("megatron", "deepspeed", "hf") for r in EXTRAS[extra]}
    assert frameworks <= set(EXTRAS["examples"])
    # Megatron's --optimizer muon (the main job's --compare) imports both; Dion3 needs neither
    assert {"emerging-optimizers", "absl-py"} <= names(EXTRAS["examples"]) - names(EXTRAS["megatron"])
    assert set(EXTRAS["examples"]) <= set(EXTRAS["test"])
    assert names(set(EXTRAS["test"]) - set(EXTRAS["examples"])) == {"pytest", "numpy"}
    assert names(EXTRAS["lint"]) == {"ruff", "mypy"} and names(EXTRAS["docs"]) == {"mkdocs", "mkdocs-material", "mkdocstrings"}


def test_the_front_end_extras_bring_what_the_library_imports():
    """A front end's extra brings the distributions its subpackage imports, and no more."""
    imported = {
        folder: set().union(*(imported_modules(p) for p in (ROOT / "dion3_megatron" / folder).rglob("*.py")))
        for folder in ("megatron", "deepspeed")
    }
    assert "megatron" in imported["megatron"] and names(EXTRAS["megatron"]) == {"megatron-core"}
    assert "deepspeed" in imported["deepspeed"] and names(EXTRAS["deepspeed"]) == {"deepspeed"}
    assert names(EXTRAS["hf"]) == {"deepspeed", "transformers", "accelerate"}  # Trainer needs accelerate
    kernels = set().union(*(imported_modules(p) for p in (ROOT / "dion3_megatron" / "kernels").rglob("*.py")))
    assert "cutlass" in kernels and names(EXTRAS["kernels"]) == {"nvidia-cutlass-dsl", "apache-tvm-ffi"}
    assert {distribution for distribution, _ in backend.REQUIRED} == names(EXTRAS["kernels"])  # what the kernels check for
    library = set().union(*(imported_modules(p) for p in (ROOT / "dion3_megatron").rglob("*.py")))
    third_party = {m for m in library if m not in sys.stdlib_module_names and m != "dion3_megatron"}
    # packaging: deepspeed's requirement; triton: torch's (CUDA wheels), imported only where installed
    assert third_party == {"torch", "megatron", "deepspeed", "cutlass", "triton", "packaging", "torchtitan"}, third_party
    titan = set().union(*(imported_modules(p) for p in (ROOT / "dion3_megatron" / "torchtitan").rglob("*.py")))
    # torch again: torchtitan 0.3.0 needs a later torch than the library's floor
    assert "torchtitan" in titan and names(EXTRAS["torchtitan"]) == {"torchtitan", "torch"}


def imported_modules(path: pathlib.Path) -> set[str]:
    """Top-level names of what a file imports anywhere, or asks for by name (importorskip, find_spec)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            found.add(node.module)
        elif (
            isinstance(node, ast.Call)
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) in ("importorskip", "find_spec")
        ):
            found.add(node.args[0].value)
    return {name.split(".")[0] for name in found}


def test_test_extra_brings_what_the_tests_import():
    local = {p.stem for folder in ("tests", "examples", "benchmarks", "tools") for p in (ROOT / folder).rglob("*.py")}
    local |= {"dion3_megatron", "tests", "support", "unit", "integration", "examples", "benchmarks", "tools"}
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
        elif dist in OPTIONAL_IN_SOME_BUILDS and torch.version.cuda is None:
            continue  # torch's CPU wheel: no triton, and the tests that import it skip
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
    longest = max(
        len(line)
        for folder in ("dion3_megatron", "tests", "examples", "benchmarks", "tools")
        for path in (ROOT / folder).rglob("*.py")
        for line in path.read_text(encoding="utf-8").splitlines()
    )
    assert longest <= ruff["line-length"]
    for path in ruff["lint"]["per-file-ignores"]:
        assert (ROOT / path).is_file(), f"per-file-ignores names a file that is gone: {path}"


@pytest.mark.skipif(
    importlib.util.find_spec("ruff") is None, reason="ruff is not installed (it is in the [lint] extra: pip install -e '.[lint]')"
)
@pytest.mark.slow
def test_ruff_passes():
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]


def markdown_links(text: str) -> list[str]:
    """The targets of a Markdown text's links and images: inline `[t](url)` and reference `[t]: url`."""
    return re.findall(r"\]\(\s*<?([^)\s>]+)", text) + re.findall(r"^\s*\[[^\]]+\]:\s*(\S+)", text, flags=re.M)


def test_markdown_links_finds_each_form():
    text = '[a](docs/x.md) ![p](https://e.org/p.png) [b](#tuning "t")\n[c]: ../y.md\n'
    assert markdown_links(text) == ["docs/x.md", "https://e.org/p.png", "#tuning", "../y.md"]


def test_the_long_description_links_are_absolute():
    """A package index renders the README without the repository beside it: a relative link there
    leads nowhere. Every link is absolute (https://...) or an anchor of the page."""
    readme = (ROOT / PROJECT["readme"]["file"]).read_text(encoding="utf-8")
    relative = [link for link in markdown_links(readme) if not link.startswith(("https://", "http://", "#"))]
    assert not relative, f"relative links in {PROJECT['readme']['file']}: {relative}"


def test_citation_cff():
    """CITATION.cff: CFF 1.2.0's required keys, this version, and the works it builds on."""
    citation = yaml.safe_load((ROOT / "CITATION.cff").read_text(encoding="utf-8"))
    assert citation["cff-version"] == "1.2.0" and citation["type"] == "software"
    assert citation["message"] and citation["title"] and citation["authors"]
    assert citation["version"] == PROJECT["version"] and citation["license"] == PROJECT["license"]
    assert citation["repository-code"] == PROJECT["urls"]["Source"]
    for reference in citation["references"]:
        assert reference["type"] in ("article", "blog") and reference["title"] and reference["authors"], reference
        assert reference["url"].startswith("https://")
    arxiv = {i["value"] for r in citation["references"] for i in r.get("identifiers", [])}
    assert arxiv == {"arXiv:2608.11612", "arXiv:2510.05491", "arXiv:2504.05295", "arXiv:2505.16932"}  # Dion3, NorMuon, Dion, Polar Express
    titles = " ".join(r["title"] for r in citation["references"])
    assert all(name in titles for name in ("Dion3", "Muon", "NorMuon", "Gram Newton-Schulz", "Dion:", "Polar Express"))
