"""docs/support.md: every "yes" links the test that shows it, that test exists (read with ast, not
imported), and its CPU/GPU label says where it runs (GPU: marked ``gpu``)."""

from __future__ import annotations

import ast
import functools
import pathlib
import re

from support.repository import ROOT

SUPPORT = ROOT / "docs" / "support.md"
TESTS_URL = "https://github.com/dion3-megatron/dion3-megatron/blob/main/tests/"
TEST_LINK = re.compile(r"\[`(\w+)`\]\(" + re.escape(TESTS_URL) + r"((?:\w+/)*test_\w+\.py)\) \((CPU|GPU)\)")


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
        f"[`test_no_such_test`]({TESTS_URL}integration/test_fsdp2.py) (CPU) [`test_x`]({TESTS_URL}unit/test_nothing.py) (CPU) "
        f"[`test_dion3_graph_replay_equals_eager`]({TESTS_URL}unit/test_cuda_graph.py) (CPU)"
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
        "FSDP2 with `CPUOffloadPolicy`",
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


# ------------------------------------------------------------------------------------------------
# docs/support.md is the one place that says what is supported: the API docstrings point to it,
# no other page restates the stages MoE is tested at, and the DeepSpeed summaries that remain
# (README, deepspeed.md) name the stages and precisions the matrix gives.

DEEPSPEED_HELPERS = ROOT / "tests" / "support" / "deepspeed_helpers.py"
API_PAGES = sorted((ROOT / "docs" / "api").glob("*.md"))
MOE_STAGES_STATED = re.compile(r"MoE\b[^.|]*?\b(?:stages?|ZeRO-)\s?[0-2]\b")
PRECISION = re.compile(r"\b(fp32|bf16|fp16)\b")


def stages_in(text: str) -> set[int]:
    """The ZeRO stages a phrase names: "0-3", "1 to 3", "0, 1, 2 and 3", "ZeRO-0 and ZeRO-2"."""
    text = text.replace("ZeRO-", "")
    ranges = {n for a, b in re.findall(r"\b(\d)(?:-| to )(\d)\b", text) for n in range(int(a), int(b) + 1)}
    return ranges | {int(n) for n in re.findall(r"\b(\d)\b", re.sub(r"\b\d(?:-| to )\d\b", "", text))}


def moe_test_stages() -> set[int]:
    """The stages the DeepSpeed MoE test builds its engines at: the loop that builds ``MoENet``."""
    for node in ast.walk(ast.parse(DEEPSPEED_HELPERS.read_text(encoding="utf-8"))):
        if isinstance(node, ast.For) and any(
            isinstance(k, ast.keyword) and k.arg == "model_class" and getattr(k.value, "id", None) == "MoENet" for k in ast.walk(node)
        ):
            return set(ast.literal_eval(node.iter))
    raise AssertionError(f"{DEEPSPEED_HELPERS.name}: no loop builds an MoENet engine")


def matrix_rows(prefix: str) -> list[list[str]]:
    rows = re.findall(rf"^\| {re.escape(prefix)}.*\|$", SUPPORT.read_text(encoding="utf-8"), re.M)
    return [[cell.strip() for cell in row.strip("|").split(" | ")] for row in rows]


def deepspeed_matrix() -> tuple[set[int], set[str]]:
    """The ZeRO stages whose row says yes, and the precisions a ZeRO row says yes for."""
    stages, precisions = set(), set()
    for name, parallel, precision, *_ in matrix_rows("DeepSpeed ZeRO-"):
        if parallel.startswith("yes"):
            stages.add(int(re.match(r"DeepSpeed ZeRO-(\d)", name).group(1)))
        precisions |= set(re.findall(r"\b(fp32|bf16|fp16)(?: parameters)? yes", precision))
    return stages, precisions


def test_the_moe_row_names_the_stages_its_test_runs():
    ((name, parallel, *_),) = matrix_rows("DeepSpeed MoE (")
    assert "test_moe_experts_step_over_their_expert_data_parallel_group" in parallel
    stated = re.fullmatch(r"DeepSpeed MoE \(tested at (.+)\)", name)
    assert stated and stages_in(stated.group(1)) == moe_test_stages() == {0, 2}, name
    assert stages_in("ZeRO-0 to 2") == {0, 1, 2} and stages_in("0, 1, 2 and 3") == stages_in("1-3") | {0}


def moe_restatements(path: pathlib.Path, text: str | None = None) -> list[str]:
    text = path.read_text(encoding="utf-8") if text is None else text
    return [f"{path.relative_to(ROOT)}: {m.group(0)[:80]!r}" for m in MOE_STAGES_STATED.finditer(text)]


def test_only_the_matrix_says_which_stages_moe_is_tested_at():
    pages = [
        ROOT / "README.md",
        ROOT / "CHANGELOG.md",
        *sorted((ROOT / "docs").glob("*.md")),
        *sorted((ROOT / "dion3_megatron").rglob("*.py")),
    ]
    problems = [p for path in pages if path != SUPPORT for p in moe_restatements(path)]
    assert not problems, "state it in docs/support.md and link there:\n" + "\n".join(problems)
    assert len(moe_restatements(ROOT / "README.md", "MoE (stages 0-2: refused at stage 3)\nan MoE\n  group (stages 1 and 2)")) == 2
    assert not moe_restatements(ROOT / "README.md", "DeepSpeed refuses its MoE layers at stage 3.")


def module_file(module: str) -> pathlib.Path | None:
    """This checkout's source of a module (read, not imported), or None for a class or function."""
    base = ROOT.joinpath(*module.split("."))
    return next((p for p in (base / "__init__.py", base.with_suffix(".py")) if p.is_file()), None)


def api_modules() -> list[str]:
    """The modules whose docstring the API reference renders (``::: module``)."""
    named = {m for page in API_PAGES for m in re.findall(r"^::: ([\w.]+)$", page.read_text(encoding="utf-8"), re.M)}
    return sorted(m for m in named if module_file(m))


def module_docstring(module: str) -> str:
    return ast.get_docstring(ast.parse(module_file(module).read_text(encoding="utf-8"))) or ""


def test_the_api_docstrings_point_to_the_matrix_instead_of_restating_it():
    modules = api_modules()
    assert {"dion3_megatron.deepspeed", "dion3_megatron.megatron", "dion3_megatron.torchtitan"} <= set(modules)
    for module in modules:
        doc = module_docstring(module)
        assert not PRECISION.search(doc), f"{module}'s docstring names a precision: that is docs/support.md's to say"
        assert not re.search(r"^Supported\b", doc, re.M), f"{module}'s docstring lists what is supported"
    assert "docs/support.md" in module_docstring("dion3_megatron.deepspeed")


def test_the_deepspeed_summaries_name_the_stages_and_precisions_of_the_matrix():
    stages, precisions = deepspeed_matrix()
    assert stages == {0, 1, 2, 3} and precisions == {"fp32", "bf16"}
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    summaries = {
        "README.md": re.search(r"^ZeRO stages [^;]*", readme[readme.index("## DeepSpeed") :], re.M).group(0),
        "docs/deepspeed.md": re.search(
            r"at ZeRO stages [^;]*?checkpoints", (ROOT / "docs" / "deepspeed.md").read_text(encoding="utf-8"), re.S
        ).group(0),
    }
    for where, summary in summaries.items():
        named_stages = stages_in(re.search(r"ZeRO stages ([\d, and-]+)", summary).group(1))
        assert named_stages == stages, (where, named_stages)
        assert set(PRECISION.findall(summary)) == precisions, (where, summary)
