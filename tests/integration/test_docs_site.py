"""The documentation site builds with ``mkdocs build --strict`` (every page in the navigation, every
link and anchor resolved, the API pages read from the source without importing the package), and
its pages read as prose: no markup of another syntax (Sphinx roles and fields, reStructuredText
directives, Google-style docstring sections, Markdown links left unresolved) and no unfilled
template placeholder shows as text."""

from __future__ import annotations

import html.parser
import pathlib
import re
import shutil
import subprocess
import sys

import pytest
from support.repository import ROOT

# Markup that Markdown leaves as text, each with what it is: the prose outside code, line by line.
SHOWN_AS_TEXT = {
    "a Sphinx role": re.compile(r":(?:py:)?[a-z]+:(?=⟦|`)"),
    "a Sphinx field": re.compile(r"^\s*:(?:param|type|returns?|rtype|raises?|ivar|cvar|var)\b[^:]*:"),
    "a reStructuredText directive": re.compile(r"^\s*\.\. [\w:-]+::"),
    "a reStructuredText literal-block marker": re.compile(r"\w::\s*$"),
    "a backtick": re.compile(r"`"),
    "a template placeholder": re.compile(r"\{(?:[A-Za-z_][\w.]*|\d*|\.\.\.)\}"),
    "a Markdown link left unresolved": re.compile(r"\]\[|\]\("),
    "a Google-style docstring section": re.compile(
        r"^\s*(?:Args|Arguments|Parameters|Params|Keyword Args|Other Parameters|Returns|Yields|Raises|Attributes|"
        r"Examples?|Notes?|Warnings?|See Also):\s*$"
    ),
}


class Prose(html.parser.HTMLParser):
    """The text of a page's article outside code, one line per line of its blocks (paragraphs, list
    items, table cells...), split at each heading: ``sections`` is a list of (heading id, its text).
    An inline code span stands as ``⟦its text⟧``, a code block as ``⟦…⟧``."""

    VERBATIM = {"code", "pre", "kbd", "samp", "script", "style"}
    BLOCKS = {"p", "li", "div", "pre", "table", "tr", "td", "th", "dd", "dt", "blockquote", "details", "summary", "br"}

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.sections: list[tuple[str, list[str]]] = []
        self._in_article = False
        self._verbatim: list[str] = []  # the code elements open, outermost first

    def _add(self, text: str) -> None:
        if self._in_article and self.sections:
            self.sections[-1][1].append(text)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "article":
            self._in_article = True
            self.sections.append(("", []))  # what comes before its first heading
        elif re.fullmatch(r"h[1-6]", tag) and self._in_article:
            self.sections.append((dict(attrs).get("id") or "", []))
        if tag in self.BLOCKS:
            self._add("\n")
        if tag in self.VERBATIM:
            if not self._verbatim:
                self._add("⟦" if tag == "code" else "⟦…")
            self._verbatim.append(tag)

    def handle_endtag(self, tag: str) -> None:
        if tag == "article":
            self._in_article = False
        if self._verbatim and tag == self._verbatim[-1]:
            self._verbatim.pop()
            if not self._verbatim:
                self._add("⟧")
        if tag in self.BLOCKS:
            self._add("\n")

    def handle_data(self, data: str) -> None:
        if not self._verbatim:
            self._add(data)
        elif self._verbatim == ["code"]:
            self._add(data.replace("\n", " "))


def shown_as_text(page: str) -> list[str]:
    """Each piece of markup the page's HTML shows as text: 'heading id: what: the line' (code is
    not scanned)."""
    prose = Prose()
    prose.feed(page)
    return [
        f"{heading}: {what}: {line.strip()[:120]}"
        for heading, parts in prose.sections
        for line in "".join(parts).splitlines()
        for what, pattern in SHOWN_AS_TEXT.items()
        if pattern.search(re.sub(r"⟦[^⟧]*⟧", "⟦⟧", line))
    ]


def article(body: str) -> str:
    return f"<html><body><nav>`{{nav}}`</nav><article class='md-content__inner'>{body}</article></body></html>"


def test_the_scan_finds_markup_shown_as_text_and_only_that():
    found = shown_as_text(
        article(
            "<p>Before a heading, :class:<code>Dion3</code>.</p>"
            '<h2 id="pkg.register">register</h2>'
            "<p>:func:<code>register</code> applies :data:<code>.registry.TABLE</code>.</p>"
            "<p>Args:\n    params: the parameters.</p>"
            "<p>:param lr: the step size.</p>"
            "<p>An example::</p><p>.. note:: a note</p>"
            "<p>``double`` and {options} and {...}</p>"
            "<p>[register][pkg.register] and [the guide](guide.md)</p>"
        )
    )
    assert found == [
        ": a Sphinx role: Before a heading, :class:⟦Dion3⟧.",
        "pkg.register: a Sphinx role: :func:⟦register⟧ applies :data:⟦.registry.TABLE⟧.",
        "pkg.register: a Google-style docstring section: Args:",
        "pkg.register: a Sphinx field: :param lr: the step size.",
        "pkg.register: a reStructuredText literal-block marker: An example::",
        "pkg.register: a reStructuredText directive: .. note:: a note",
        "pkg.register: a backtick: ``double`` and {options} and {...}",
        "pkg.register: a template placeholder: ``double`` and {options} and {...}",
        "pkg.register: a Markdown link left unresolved: [register][pkg.register] and [the guide](guide.md)",
    ]
    fine = article(
        '<h2 id="usage">Usage</h2>'
        '<p><a href="#pkg.register"><code>register</code></a> takes <code>{"params": {...}}</code>; '
        "see the note: it returns.</p><pre><code>:func:`x` {options} ``y`` Args:\n</code></pre>"
    )
    assert shown_as_text(fine) == []


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> pathlib.Path:
    # The mkdocs command of the environment running the tests (the docs tools are not test dependencies).
    mkdocs = shutil.which("mkdocs", path=str(pathlib.Path(sys.executable).parent)) or shutil.which("mkdocs")
    if mkdocs is None:
        pytest.skip("mkdocs is not installed")
    site_dir = tmp_path_factory.mktemp("site")
    build = subprocess.run(
        [mkdocs, "build", "--strict", "--site-dir", str(site_dir)], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert build.returncode == 0, build.stderr[-4000:]
    return site_dir


@pytest.mark.slow
def test_the_site_builds_strictly(site):
    api = (site / "api" / "megatron" / "index.html").read_text(encoding="utf-8")
    assert 'id="dion3_megatron.megatron.MegatronDion3"' in api and 'id="dion3_megatron.megatron.register"' in api
    # A docstring's cross-reference is a link to the object, on its page or another.
    deepspeed = (site / "api" / "deepspeed" / "index.html").read_text(encoding="utf-8")
    assert re.search(r'<a class="autorefs[^>]*href="#dion3_megatron\.megatron\.register"', api)
    assert re.search(r'<a class="autorefs[^>]*href="\.\./dion3/#dion3_megatron\.Dion3"', deepspeed)


@pytest.mark.slow
def test_every_page_reads_as_prose(site):
    pages = sorted(p for p in site.rglob("*.html") if p.parent != site or p.name == "index.html")
    assert len(pages) > 20 and any(p.parts[-3:] == ("api", "dion3", "index.html") for p in pages)
    problems = [f"{page.relative_to(site)}: {problem}" for page in pages for problem in shown_as_text(page.read_text(encoding="utf-8"))]
    assert not problems, "\n".join(problems)
