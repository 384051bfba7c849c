"""Write docs/citing.md, the citations page, from CITATION.cff: the software's entry and each work
of its ``references`` (what it is to this package, its authors, title, year and link), then the
same as BibTeX.

    python tools/citing_md.py [PATH]

tests/unit/test_citing_doc.py fails while the page differs from what this writes.
"""

from __future__ import annotations

import pathlib
import re
import sys
from typing import Any

import yaml

REPO = pathlib.Path(__file__).resolve().parents[1]
SOURCE = REPO / "CITATION.cff"
DEFAULT_PATH = REPO / "docs" / "citing.md"
REFERENCE_COMMAND = "python tools/citing_md.py"
ARXIV = re.compile(r"^arXiv:(\d{4}\.\d{4,5})$")


def load(path: pathlib.Path = SOURCE) -> dict[str, Any]:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def arxiv_id(work: dict[str, Any]) -> str | None:
    """The work's arXiv identifier (``2504.05295``), from its ``identifiers``."""
    ids = [m.group(1) for i in work.get("identifiers", []) if (m := ARXIV.match(i["value"]))]
    return ids[0] if ids else None


def short_name(work: dict[str, Any]) -> str:
    """What the method is called: the title before its colon ("Dion3", "Gram Newton-Schulz"), less a
    leading "The"."""
    return re.sub(r"^The ", "", work["title"].split(":")[0])


def full_name(person: dict[str, Any]) -> str:
    return person["name"] if "name" in person else f"{person['given-names']} {person['family-names']}"


def bibtex_name(person: dict[str, Any]) -> str:
    return f"{{{person['name']}}}" if "name" in person else f"{person['family-names']}, {person['given-names']}"


def written_authors(work: dict[str, Any]) -> str:
    names = [full_name(p) for p in work["authors"]]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def bibtex_key(work: dict[str, Any]) -> str:
    """First author's family name, year, short name: ``ahn2025dion``."""
    first = work["authors"][0]
    family = first.get("family-names", first.get("name", ""))
    return re.sub(r"[^a-z0-9]", "", f"{family}{work.get('year', '')}{short_name(work)}".lower())


def bibtex(fields: list[tuple[str, str]], kind: str, key: str) -> list[str]:
    width = max(len(name) for name, _ in fields)
    return [f"@{kind}{{{key},", *(f"  {name.ljust(width)} = {{{value}}}," for name, value in fields), "}"]


def software_bibtex(citation: dict[str, Any]) -> list[str]:
    fields = [
        ("title", citation["title"]),
        ("author", " and ".join(bibtex_name(p) for p in citation["authors"])),
        ("version", str(citation["version"])),
        ("url", citation["url"]),
    ]
    return bibtex(fields, "software", re.sub(r"[^a-z0-9]", "", citation["repository-code"].rsplit("/", 1)[-1].lower()))


def work_bibtex(work: dict[str, Any]) -> list[str]:
    fields = [
        ("title", work["title"]),
        ("author", " and ".join(bibtex_name(p) for p in work["authors"])),
        ("year", str(work["year"])),
    ]
    number = arxiv_id(work)
    if number:
        fields += [("eprint", number), ("archivePrefix", "arXiv")]
    else:
        fields.append(("howpublished", f"\\url{{{work['url']}}}"))
    return bibtex(fields, "misc", bibtex_key(work))


def work_line(work: dict[str, Any]) -> str:
    number = arxiv_id(work)
    shown = f"arXiv:{number}" if number else re.sub(r"^https?://|/$", "", work["url"])
    code = f"; code: [{work['repository-code'].removeprefix('https://')}]({work['repository-code']})" if "repository-code" in work else ""
    return (
        f"- **{short_name(work)}**, {work['notes']}: {written_authors(work)}, *{work['title']}*, "
        f"{work['year']}, [{shown}]({work['url']}){code}."
    )


def markdown_page(citation: dict[str, Any]) -> str:
    lines = [
        f"<!-- Generated from CITATION.cff by `{REFERENCE_COMMAND}`: edit CITATION.cff, not this page. -->",
        "",
        "# Citing",
        "",
        "If you use dion3-megatron, cite the software (the repository's `CITATION.cff` holds its entry;",
        'GitHub\'s "Cite this repository" reads it) and the methods it implements:',
        "",
        *(work_line(work) for work in citation["references"]),
        "",
        "```text",
        *software_bibtex(citation),
    ]
    for work in citation["references"]:
        lines += work_bibtex(work)
    lines.append("```")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> None:
    path = pathlib.Path(argv[0]) if argv else DEFAULT_PATH
    path.write_text(markdown_page(load()), encoding="utf-8")
    print(f"wrote {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
