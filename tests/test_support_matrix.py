"""docs/support.md: every "yes" links the test that shows it, that test exists (read with ast, not
imported), and its CPU/GPU label says where it runs (GPU: marked ``gpu``)."""

from __future__ import annotations

import ast
import functools
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
SUPPORT = ROOT / "docs" / "support.md"
TESTS_URL = "https://github.com/dion3-megatron/dion3-megatron/blob/main/tests/"
TEST_LINK = re.compile(r"\[`(\w+)`\]\(" + re.escape(TESTS_URL) + r"(test_\w+\.py)\) \((CPU|GPU)\)")


def _marks(node: ast.AST) -> set[str]:
    """The pytest.mark names a decorator list or a ``pytestmark`` value names."""
    found = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Attribute) and sub.value.attr == "mark":
            found.add(sub.attr)
    return found


@functools.cache
def functions_in(file: str) -> dict[str, bool]:
    """Test function name -> whether it is marked gpu (on itself or its module)."""
    tree = ast.parse((ROOT / "tests" / file).read_text(encoding="utf-8"))
    module_gpu = any(
        isinstance(n, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in n.targets) and "gpu" in _marks(n.value)
        for n in tree.body
    )
    return {
        n.name: module_gpu or any("gpu" in _marks(d) for d in n.decorator_list)
        for n in ast.walk(tree)
        if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")
    }


def link_problems(text: str) -> list[str]:
    problems = []
    for name, file, where in TEST_LINK.findall(text):
        if not (ROOT / "tests" / file).is_file():
            problems.append(f"{file}: no such test file")
        elif name not in functions_in(file):
            problems.append(f"{file}::{name}: no such test")
        elif functions_in(file)[name] != (where == "GPU"):
            problems.append(f"{file}::{name}: labelled {where}, but it is {'GPU' if functions_in(file)[name] else 'CPU'}")
    return problems


def unproven_yes(text: str) -> list[str]:
    """Table cells with a "yes" that no test link follows."""
    problems = []
    for row in re.findall(r"^\|.*\|$", text, re.M):
        for cell in row.strip("|").split(" | ")[1:]:
            for claim in re.split(r"yes: ", cell)[1:]:
                if not TEST_LINK.match(claim):
                    problems.append(f"{row[:60]!r}: 'yes: {claim[:60]}' links no test")
    return problems


def test_every_linked_test_exists_and_runs_where_its_label_says():
    text = SUPPORT.read_text(encoding="utf-8")
    assert len(TEST_LINK.findall(text)) >= 30
    assert not link_problems(text), "\n".join(link_problems(text))
    broken = (
        f"[`test_no_such_test`]({TESTS_URL}test_fsdp2.py) (CPU) [`test_x`]({TESTS_URL}test_nothing.py) (CPU) "
        f"[`test_dion3_graph_replay_equals_eager`]({TESTS_URL}test_cuda_graph.py) (CPU)"
    )
    assert [p.split(": ", 1)[1] for p in link_problems(broken)] == ["no such test", "no such test file", "labelled CPU, but it is GPU"]


def test_every_yes_links_a_test():
    text = SUPPORT.read_text(encoding="utf-8")
    assert text.count("yes: ") >= 30 and not unproven_yes(text), "\n".join(unproven_yes(text))
    assert len(unproven_yes("| FSDP2 | yes: it works | fp32 yes: [`t`](x) (CPU) |")) == 2


def test_the_matrix_has_every_front_end_and_the_not_yet_rows():
    text = SUPPORT.read_text(encoding="utf-8")
    for row in (
        "PyTorch",
        "FSDP2, 1-D",
        "HSDP",
        "FSDP2 with tensor parallelism",
        "Megatron-Core, tensor parallel",
        "Megatron-Core, pipeline parallel",
        "distributed optimizer",
        "expert parallel",
        "ZeRO-0",
        "ZeRO-1",
        "ZeRO-2",
        "ZeRO-3",
        "DeepSpeed MoE",
        "Hugging Face Trainer",
        "torchtitan",
        "Megatron-LM, torch FSDP2",
        "Megatron-FSDP",
    ):
        assert re.search(rf"^\| [^|]*{re.escape(row)}", text, re.M), row
