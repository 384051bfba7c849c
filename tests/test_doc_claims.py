"""Claims of the docs that a reader can check against the code, the tests and the results: each
test reads the claim from the doc, so that a doc and what it describes cannot drift apart."""

from __future__ import annotations

import ast
import contextlib
import io
import json
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def per_shape_range(row: str, against: str) -> tuple[float, float]:
    match = re.search(rf"(\d\.\d\d)-(\d\.\d\d)x against {against}", row)
    assert match, (against, row)
    return float(match.group(1)), float(match.group(2))


def test_the_readme_orthogonalization_ranges_are_the_json_ratios_they_name():
    ratios = json.loads((RESULTS / "gram-ns-h200.json").read_text(encoding="utf-8"))["ratios"]
    quack = [r["eager: ours vs quack"] for r in ratios.values()]
    faster = [r["eager: ours vs the faster of gram-torch and quack"] for r in ratios.values()]
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    row = next(line for line in readme.splitlines() if line.startswith("| [one orthogonalization"))
    assert per_shape_range(row, "quack") == (min(quack), max(quack))
    assert per_shape_range(row, "the faster of cuBLAS and quack") == (min(faster), max(faster))
    assert min(quack) != min(faster) or max(quack) != max(faster)  # two different ranges: naming matters


def test_the_troubleshooting_kernel_check_tells_the_truth_on_a_machine_without_kernels():
    from dion3_megatron import kernels

    text = (ROOT / "docs" / "troubleshooting.md").read_text(encoding="utf-8")
    snippet = re.search(r"```python\n(.*?kernels.*?)```", text, re.S).group(1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(snippet, "troubleshooting.md", "exec"), {})
    printed = out.getvalue()
    assert not re.search(r": True$", printed, re.M) or kernels.kernels_installed(), printed
    if not kernels.kernels_installed():
        assert re.search(r"run on: torch$", printed, re.M), printed


def _constant(test_file: str, name: str) -> float:
    tree = ast.parse((ROOT / "tests" / test_file).read_text(encoding="utf-8"))
    return next(ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", None) == name)


def test_the_deepspeed_doc_states_the_tolerance_its_tests_check():
    doc = (ROOT / "docs" / "deepspeed.md").read_text(encoding="utf-8")
    for test_file in ("test_deepspeed_zero.py", "test_deepspeed_zero3.py"):
        stated = re.search(rf"{re.escape(test_file)}[^*]*?within ([0-9.e-]+) of stage 0", doc, re.S)
        assert stated, test_file
        assert float(stated.group(1)) == _constant(test_file, "TOL"), (test_file, stated.group(1))


def test_the_docs_site_shows_the_results_plots_unchanged():
    assets = sorted((ROOT / "docs" / "assets").glob("*.png"))
    assert assets
    for asset in assets:
        assert asset.read_bytes() == (RESULTS / asset.name).read_bytes(), asset.name


def test_the_cost_the_half_installed_kernels_warning_states_is_the_measured_one():
    """Gram Newton-Schulz on cuBLAS against the kernels, over the 14B shapes (eager)."""
    from dion3_megatron.kernels.symm import backend

    measured = json.loads((ROOT / "benchmarks" / "results" / "gram-ns-h200.json").read_text())
    assert f", {measured['total_ratios']['eager: ours vs gram-torch']:.2f}x the time" in backend.COST
    assert measured["gpu"].startswith("1 x NVIDIA H200") and "(14B shapes, one H200)" in backend.COST
