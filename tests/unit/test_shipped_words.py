"""What ships speaks of the product only: the README, the changelog, docs/, the package's docstrings
and comments, the examples and the results' README name no session, issue, commit of this
repository, attempt or measurement still to come; and every results file they name exists."""

from __future__ import annotations

import pathlib
import re
import tomllib

import pytest
from support.repository import ROOT

SHIPPED = [
    ROOT / "README.md",
    ROOT / "CHANGELOG.md",
    ROOT / "benchmarks" / "results" / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    *sorted((ROOT / "dion3_megatron").rglob("*.py")),
    *sorted(p for p in (ROOT / "examples").rglob("*") if p.suffix in (".py", ".sh", ".md", ".json")),
]
# Words about how the project was developed, not what it is ("session" alone is the engine session,
# engine/session.py: a session of work is "this session", "the twelfth session"...). A figure's own revision is stated as
# "code revision" with its hash, in docs/performance.md's older figures and their JSON.
HISTORY = re.compile(
    r"\b(this|that|previous|earlier|last|next|later|\w+th) sessions?\b|\bsessions? \d|"
    r"issue [0-9]|issue #|parked|reverted|(?-i:DESIGN\.md)|\.carry|shared/tools|\btwenty|\bthirty|"
    r"\bcommit [0-9a-f]{7}|`[0-9a-f]{7}`|not re-measured|not yet measured|to be measured|that version|"
    r"earlier version|previously|tried and|we tried|tried for it|was the target|measurement-log|earlier day|"
    r"main job|in this call|repeats of|aborted \d+ times|for now\b",
    re.I,
)
RESULTS_PATH = re.compile(r"benchmarks/results/([\w.-]+\.\w+)")


def history_problems(path: pathlib.Path, text: str | None = None) -> list[str]:
    text = path.read_text(encoding="utf-8") if text is None else text
    return [
        f"{path.relative_to(ROOT)}:{n}: {match.group(0)!r} in {line.strip()[:100]}"
        for n, line in enumerate(text.splitlines(), 1)
        if (match := HISTORY.search(line))
    ]


def test_shipped_text_does_not_describe_how_the_project_was_developed():
    assert len(SHIPPED) > 100
    problems = [p for path in SHIPPED for p in history_problems(path)]
    assert not problems, "\n".join(problems)
    samples = [
        "in the twelfth session",
        "parked as `c334710`",
        "This is the main job",
        "not re-measured since",
        "(GPU command, not yet measured)",
        "0.96x in this call and 1.03x in two repeats of that shape",
        "measured with an earlier version of the step",
        "the lowest of the lrs tried for it",
        "a script aborted 8 times in 60 runs",
    ]
    assert len(history_problems(ROOT / "README.md", "\n".join(samples))) == len(samples)
    fine = "ZeRO hands the partitions with this call\nmeasured at code revision 63b8d26\nThe orthogonalization runs first"
    assert not history_problems(ROOT / "README.md", fine)


def test_every_results_file_named_exists():
    named = {(path.relative_to(ROOT), name) for path in SHIPPED for name in RESULTS_PATH.findall(path.read_text(encoding="utf-8"))}
    assert len(named) >= 10
    missing = sorted(f"{path}: benchmarks/results/{name}" for path, name in named if not (ROOT / "benchmarks" / "results" / name).exists())
    assert not missing, "\n".join(missing)


def git_tags() -> set[str] | None:
    """This checkout's tags, or None outside a git checkout: read from the git directory itself (its
    loose tag refs and its packed refs), as the quick tier starts no process."""
    git = ROOT / ".git"
    if git.is_file():  # a worktree or submodule: "gitdir: <path>", whose common dir holds the refs
        gitdir = pathlib.Path(git.read_text(encoding="utf-8").split(":", 1)[1].strip())
        common = gitdir / "commondir"
        git = (gitdir / common.read_text(encoding="utf-8").strip()).resolve() if common.exists() else gitdir
    if not git.is_dir():
        return None
    tags = {path.relative_to(git / "refs" / "tags").as_posix() for path in (git / "refs" / "tags").rglob("*") if path.is_file()}
    packed = git / "packed-refs"
    if packed.exists():
        for line in packed.read_text(encoding="utf-8").splitlines():
            ref = line.split(" ", 1)[-1]
            if ref.startswith("refs/tags/"):
                tags.add(ref[len("refs/tags/") :])
    return tags


def changelog_problems(text: str, version: str, tags: set[str]) -> list[str]:
    """The newest entry is this version; an entry dated is a tagged release (its date then is the
    tag's, not a day before the work it lists); any other says "unreleased"."""
    entries = re.findall(r"^## (\S+) \(([^)]+)\)$", text, re.M)
    problems = [] if entries and entries[0][0] == version else [f"the newest entry is {entries[:1]}, not {version}"]
    for name, when in entries:
        if re.fullmatch(r"\d{4}-\d\d-\d\d", when):
            if not {name, f"v{name}"} & tags:
                problems.append(f"{name} is dated {when} but no tag v{name} exists: write (unreleased) until it is tagged")
        elif when != "unreleased":
            problems.append(f"{name}: {when!r} is neither a date nor 'unreleased'")
    return problems


def test_the_changelog_dates_only_tagged_releases():
    version = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["version"]
    tags = git_tags()
    if tags is None:
        pytest.skip("not a git checkout: tags unknown")
    problems = changelog_problems((ROOT / "CHANGELOG.md").read_text(encoding="utf-8"), version, tags)
    assert not problems, "\n".join(problems)
    assert changelog_problems("## 0.2.0 (2026-12-05)\n## 0.1.0 (soon)\n", "0.3.0", {"v0.1.0"}) == [
        "the newest entry is [('0.2.0', '2026-12-05')], not 0.3.0",
        "0.2.0 is dated 2026-12-05 but no tag v0.2.0 exists: write (unreleased) until it is tagged",
        "0.1.0: 'soon' is neither a date nor 'unreleased'",
    ]
    assert not changelog_problems("## 0.3.0 (unreleased)\n## 0.2.0 (2026-12-05)\n", "0.3.0", {"v0.2.0"})
