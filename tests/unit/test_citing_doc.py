"""Citations have one source, CITATION.cff: docs/citing.md is what tools/citing_md.py renders from
it, each work there names its authors, year and link, and every arXiv identifier the shipped text
mentions is one of its works'."""

from __future__ import annotations

import difflib
import re

import pytest
from support.repository import ROOT, load_tool

PAGE = ROOT / "docs" / "citing.md"
TOOL_PATH = ROOT / "tools" / "citing_md.py"
# What ships: the README, the docs, the package (docstrings and comments), the examples and benchmarks.
SHIPPED = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    *sorted((ROOT / "dion3_megatron").rglob("*.py")),
    *sorted((ROOT / "examples").rglob("*.py")),
    *sorted((ROOT / "benchmarks").glob("*.py")),
]
ARXIV_MENTION = re.compile(r"arXiv[: ]\s*(\d{4}\.\d{4,5})|arxiv\.org/(?:abs|pdf)/(\d{4}\.\d{4,5})", re.I)


tool = load_tool("citing_md")
CITATION = tool.load()
WORKS = CITATION["references"]


def test_citing_md_is_what_citation_cff_renders():
    expected = tool.markdown_page(CITATION)
    actual = PAGE.read_text(encoding="utf-8")
    if actual != expected:
        diff = "".join(list(difflib.unified_diff(actual.splitlines(True), expected.splitlines(True), "docs/citing.md", "generated"))[:60])
        pytest.fail(f"docs/citing.md is not what CITATION.cff renders; regenerate it with\n\n    {tool.REFERENCE_COMMAND}\n\n{diff}")


def test_the_page_says_it_is_generated_and_the_command_writes_it(tmp_path):
    first = tool.markdown_page(CITATION).splitlines()[0]
    assert "Generated from CITATION.cff" in first and tool.REFERENCE_COMMAND in first
    assert tool.REFERENCE_COMMAND == f"python {TOOL_PATH.relative_to(ROOT).as_posix()}" and tool.DEFAULT_PATH == PAGE
    tool.main([str(tmp_path / "page.md")])
    assert (tmp_path / "page.md").read_text(encoding="utf-8") == tool.markdown_page(CITATION)


def work_problems(work: dict) -> list[str]:
    """A work the page can cite: people as authors (family and given names), a year, an https link,
    a note on what it is to this package; an arXiv work's link is its own abstract page."""
    title = work.get("title", "?")
    problems = []
    people = work.get("authors", [])
    if not people or any(not (p.get("family-names") and p.get("given-names")) for p in people):
        problems.append(f"{title}: every author needs family-names and given-names, got {people}")
    if not isinstance(work.get("year"), int):
        problems.append(f"{title}: no year")
    if not str(work.get("url", "")).startswith("https://"):
        problems.append(f"{title}: no https url")
    if not work.get("notes"):
        problems.append(f"{title}: no notes (what the work is to this package)")
    number = tool.arxiv_id(work)
    if number and work.get("url") != f"https://arxiv.org/abs/{number}":
        problems.append(f"{title}: arXiv:{number}, but its url is {work.get('url')}")
    return problems


def test_every_work_names_its_authors_year_and_link():
    assert len(WORKS) >= 6
    problems = [p for work in WORKS for p in work_problems(work)]
    assert not problems, "\n".join(problems)
    placeholder = {"type": "article", "title": "Dion3", "authors": [{"name": "The Dion3 authors"}], "url": "https://arxiv.org/abs/1"}
    placeholder["identifiers"] = [{"type": "other", "value": "arXiv:2608.11612"}]
    assert len(work_problems(placeholder)) == 4  # authors, year, notes, url


def arxiv_mentions(text: str) -> set[str]:
    return {a or b for a, b in ARXIV_MENTION.findall(text)}


def test_every_arxiv_identifier_the_shipped_text_mentions_is_a_work_of_citation_cff():
    known = {tool.arxiv_id(work) for work in WORKS} - {None}
    unknown = {
        f"{path.relative_to(ROOT)}: arXiv:{number}"
        for path in SHIPPED
        for number in arxiv_mentions(path.read_text(encoding="utf-8"))
        if number not in known
    }
    assert not unknown, "not in CITATION.cff (add the work there, or correct the identifier):\n" + "\n".join(sorted(unknown))
    assert arxiv_mentions("Dion (arXiv 2504.14809), [x](https://arxiv.org/pdf/2505.16932)") == {"2504.14809", "2505.16932"}
    assert {"2608.11612", "2504.05295"} <= arxiv_mentions(PAGE.read_text(encoding="utf-8"))
