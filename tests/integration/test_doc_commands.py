"""Every fenced block of README.md and docs/*.md is checked by the mark on the line before it.

    <!-- command: cpu -->      run as written on CPU, from the repository root (slow tier)
    <!-- command: gpu -->      checked on CPU as far as it can be: scripts and modules exist, their
                               --help works, every flag is one they accept (Megatron's parser with
                               Dion3 registered for Megatron commands), launcher flags, environment
                               variables a script reads, patch files; torchtitan's trainer: the
                               trainer config it names is ours (slow tier)
    <!-- command: install -->  pip and venv lines; every extra named exists in the package metadata
    <!-- command: tests -->    pytest lines; .ci/run runs exactly these, in this order, and .ci/run
                               installs the extras of the install block before it
    <!-- command: snippet -->  Python that needs the reader's model: compiled, not run

Shell and Python blocks must carry a mark; ``text`` blocks are not commands and ``json`` blocks must
parse. The docs' relative links must resolve, and the figures of the README's and
docs/performance.md's tables must be in the JSON files of benchmarks/results/ that their sections
cite (tests/unit/test_shipped_words.py checks the docs' words). Each checker is also run on a broken example, so
that it can be seen to fail.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys
import tomllib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
from support import one_process
from support.repository import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKS = ("cpu", "gpu", "install", "tests", "snippet")
MARK_LINE = re.compile(r"^<!-- command: ([a-z]+) -->$")
SHELL, PYTHON, NOT_COMMANDS = {"bash", "sh", "shell"}, {"python"}, {"text", "json"}
ALLOWED = {"cpu": SHELL | PYTHON, "gpu": SHELL, "install": SHELL, "tests": SHELL, "snippet": PYTHON}
# Where the docs link this repository's files outside docs/ (README.md is a package's long
# description, and the docs site holds docs/ alone): such a link must name a file that exists here.
REPOSITORY_URL = "https://github.com/dion3-megatron/dion3-megatron/"
# Paths a command may name that are the reader's, not this repository's.
EXTERNAL = ("Megatron-LM/", "DeepSpeed")


@dataclass(frozen=True)
class Block:
    path: pathlib.Path
    line: int  # of the opening fence, 1-based
    lang: str
    mark: str | None
    text: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path}:{self.line}"


def parse_blocks(path: pathlib.Path, text: str | None = None) -> list[Block]:
    lines = (path.read_text(encoding="utf-8") if text is None else text).split("\n")
    blocks, i = [], 0
    while i < len(lines):
        stripped = lines[i].strip()
        if stripped.startswith("```"):
            lang = stripped[3:].strip()
            mark = MARK_LINE.match(lines[i - 1].strip()) if i else None
            end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
            assert end is not None, f"{path}:{i + 1}: a fence that is never closed"
            blocks.append(Block(path, i + 1, lang, mark.group(1) if mark else None, "\n".join(lines[i + 1 : end])))
            i = end
        i += 1
    return blocks


ALL_BLOCKS = [b for path in DOCS for b in parse_blocks(path)]


def blocks_marked(mark: str) -> list[Block]:
    return [b for b in ALL_BLOCKS if b.mark == mark]


def block_problems(block: Block) -> list[str]:
    """What is wrong with a block's tag and mark."""
    if not block.lang:
        return [f"{block.where}: a fence without a language (```bash, ```python, ```text, ```json)"]
    if block.lang not in SHELL | PYTHON | NOT_COMMANDS:
        return [f"{block.where}: unknown fence language {block.lang!r}"]
    if block.lang in NOT_COMMANDS:
        return [f"{block.where}: a {block.lang} block is not a command: no mark"] if block.mark else []
    if block.mark is None:
        return [f"{block.where}: a {block.lang} block without '<!-- command: MARK -->' on the line before it ({', '.join(MARKS)})"]
    if block.mark not in MARKS:
        return [f"{block.where}: unknown mark {block.mark!r}"]
    if block.lang not in ALLOWED[block.mark]:
        return [f"{block.where}: a {block.lang} block cannot be marked {block.mark}"]
    return []


# ------------------------------------------------------------------------------------------------
# Shell commands: lines, continuations, comments, operators, environment assignments.


def commands(text: str) -> list[tuple[dict[str, str], list[str], str | None]]:
    """(environment assignments, words, input redirection) of every simple command of a shell block."""
    found = []
    for line in text.replace("\\\n", " ").split("\n"):
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split, lexer.commenters = True, "#"
        words, current = list(lexer), []
        for word in words + [";"]:
            if word in (";", "&&", "||", "|", "&"):
                if current:
                    env = {}
                    while current and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", current[0]):
                        name, value = current.pop(0).split("=", 1)
                        env[name] = value
                    stdin = None
                    if "<" in current:
                        at = current.index("<")
                        stdin, current = current[at + 1], current[:at] + current[at + 2 :]
                    found.append((env, current, stdin))
                current = []
            else:
                current.append(word)
    return found


# ------------------------------------------------------------------------------------------------
# Package metadata: the extras, the pytest markers (pyproject.toml, else setup.py and pytest.ini).


def declared_extras() -> set[str]:
    pyproject = ROOT / "pyproject.toml"
    if pyproject.is_file():
        extras = tomllib.loads(pyproject.read_text(encoding="utf-8")).get("project", {}).get("optional-dependencies")
        if extras:
            return set(extras)
    tree = ast.parse((ROOT / "setup.py").read_text(encoding="utf-8"))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "EXTRAS":
            names |= set(ast.literal_eval(node.value))
        elif (
            isinstance(node, ast.Assign)
            and isinstance(node.targets[0], ast.Subscript)
            and getattr(node.targets[0].value, "id", None) == "EXTRAS"
        ):
            names.add(ast.literal_eval(node.targets[0].slice))
    return names


def declared_markers() -> set[str]:
    pyproject = ROOT / "pyproject.toml"
    if pyproject.is_file():
        ini = tomllib.loads(pyproject.read_text(encoding="utf-8")).get("tool", {}).get("pytest", {}).get("ini_options")
        if ini:
            return {m.split(":")[0].strip() for m in ini["markers"]}
    text = (ROOT / "pytest.ini").read_text(encoding="utf-8")
    return set(re.findall(r"^\s+([a-z_]+):", text, re.M))


def pip_extras(words: list[str]) -> set[str] | None:
    """The extras of this repository that a pip install line names (None: not a pip install)."""
    if words[:2] == ["pip", "install"]:
        args = words[2:]
    elif words[:4] in (["python", "-m", "pip", "install"], ["python3", "-m", "pip", "install"]):
        args = words[4:]
    else:
        return None
    extras = set()
    for arg in args:
        match = re.fullmatch(r"\.(?:\[([^\]]*)\])?", arg)
        if match and match.group(1):
            extras |= {e.strip() for e in match.group(1).split(",")}
    return extras


def install_problems(block: Block, extras: set[str]) -> list[str]:
    problems = []
    for env, words, _ in commands(block.text):
        named = pip_extras(words)
        if named is not None:
            problems += [f"{block.where}: extra [{e}] is not declared (declared: {sorted(extras)})" for e in sorted(named - extras)]
        elif not (
            re.fullmatch(r"python3(\.\d+)?", words[0])
            and words[1:3] == ["-m", "venv"]
            or words[0] in (".", "source")
            and words[1:] == [".venv/bin/activate"]
        ):
            problems.append(f"{block.where}: not an install command: {shlex.join(words)}")
        problems += [f"{block.where}: unexpected variable {name}" for name in env if name != "DS_BUILD_OPS"]
    return problems


def ci_install_extras(ci_text: str) -> set[str]:
    found = set()
    for _, words, _ in commands(ci_text):
        named = pip_extras([w for w in words if w != "-q"])
        if named:
            found |= named
    return found


def pinned(text: str) -> set[tuple[str, bool]]:
    """The pinned requirements (``name==version``) of a text's pip install lines, each with whether
    its line installs without requirements (``--no-deps``); torch's left out: CI pins the build it
    tests, a reader has theirs."""
    found = set()
    for _, words, _ in commands(text):
        if pip_extras([w for w in words if w not in ("-q", "--no-cache-dir")]) is not None:
            pins = (w for w in words if re.fullmatch(r"[\w.-]+==[\w.]+", w) and not w.startswith("torch=="))
            found |= {(pin, "--no-deps" in words) for pin in pins}
    return found


def ci_test_commands(ci_text: str) -> list[str]:
    """The pytest commands .ci/run runs, in order."""
    return [shlex.join(shlex.split(line)) for line in ci_text.splitlines() if re.match(r"\s*python -m pytest", line)]


def check_tests_block(block: Block, ci_text: str, extras_before: set[str] | None, markers: set[str]) -> list[str]:
    problems = []
    lines = [shlex.join(words) for _, words, _ in commands(block.text)]
    if lines != ci_test_commands(ci_text):
        problems.append(f"{block.where}: the test commands {lines} are not the ones .ci/run runs, {ci_test_commands(ci_text)}")
    for _, words, _ in commands(block.text):
        if words[:3] != ["python", "-m", "pytest"]:
            problems.append(f"{block.where}: not a pytest command: {shlex.join(words)}")
            continue
        args = iter(words[3:])
        for arg in args:
            if arg == "-m":
                used = set(re.findall(r"[A-Za-z_]+", next(args, ""))) - {"not", "and", "or"}
                problems += [f"{block.where}: marker {m!r} is not declared" for m in sorted(used - markers)]
            elif arg not in ("-q", "-x"):
                problems.append(f"{block.where}: unexpected pytest argument {arg!r}")
    if extras_before is None:
        problems.append(f"{block.where}: no install block before the test command")
    elif extras_before != ci_install_extras(ci_text):
        problems.append(
            f"{block.where}: the docs install {sorted(extras_before)} before the tests, .ci/run "
            f"installs {sorted(ci_install_extras(ci_text))}"
        )
    return problems


# ------------------------------------------------------------------------------------------------
# Links, anchors, words, figures.


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def outside_fences(text: str) -> str:
    return re.sub(r"^\s*```.*?^\s*```", "", text, flags=re.S | re.M)


def anchors(path: pathlib.Path) -> set[str]:
    found, seen = set(), {}
    for heading in re.findall(r"^#+ (.+)$", outside_fences(path.read_text(encoding="utf-8")), re.M):
        s = slug(heading)
        found.add(s if s not in seen else f"{s}-{seen[s]}")
        seen[s] = seen.get(s, 0) + 1
    return found


def link_problems(path: pathlib.Path, text: str | None = None) -> list[str]:
    text = path.read_text(encoding="utf-8") if text is None else text
    problems = []
    for target in re.findall(r"\]\(([^)\s]+)\)", outside_fences(text)):
        in_repository = re.match(re.escape(REPOSITORY_URL) + r"(?:blob|tree)/main/(.*)", target)
        if re.match(r"[a-z]+:", target) and not in_repository:
            continue
        file, _, anchor = (in_repository.group(1) if in_repository else target).partition("#")
        resolved = (ROOT / file if in_repository else path.parent / file).resolve() if file else path
        if not resolved.exists():
            problems.append(f"{path.name}: link to {target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            problems.append(f"{path.name}: link to {target}: no such heading in {resolved.name}")
    return problems


def numbers(text: str) -> set[float]:
    return {abs(float(x)) for x in re.findall(r"\d+\.\d+", text)}


def section(path: pathlib.Path, anchor: str) -> str:
    """The text under the heading whose anchor this is, to the next heading of its level or above."""
    lines = path.read_text(encoding="utf-8").split("\n")
    for i, line in enumerate(lines):
        heading = re.match(r"^(#+) (.+)$", line)
        if heading and slug(heading.group(2)) == anchor:
            level = len(heading.group(1))
            end = next((j for j in range(i + 1, len(lines)) if re.match(rf"^#{{1,{level}}} ", lines[j])), len(lines))
            return "\n".join(lines[i:end])
    raise AssertionError(f"{path.name}: no heading with the anchor {anchor!r}")


def cited_results(section_text: str) -> list[pathlib.Path]:
    return [
        ROOT / "benchmarks" / "results" / name
        for name in re.findall(
            r"\((?:\.\./|" + re.escape(REPOSITORY_URL) + r"blob/main/)benchmarks/results/([\w.-]+\.json)\)", section_text
        )
    ]


def figure_problems(md: pathlib.Path, text: str | None = None) -> list[str]:
    """Each table row that links a section of docs/performance.md: its figures (the cells after the
    first) must be in the JSON files that section cites. Each table of a section that cites JSON
    files: its figures must be in them."""
    text = md.read_text(encoding="utf-8") if text is None else text
    performance = ROOT / "docs" / "performance.md"
    problems = []
    for row in re.findall(r"^\|.*\|$", text, re.M):
        link = re.search(r"(?:performance\.md)?#([\w-]+)\)", row)
        if not link or (md != performance and "performance.md#" not in row):
            continue
        results = cited_results(section(performance, link.group(1)))
        if not results:
            problems.append(f"{md.name}: row {row[:60]!r}: its section cites no results")
            continue
        have = set().union(*(numbers(r.read_text(encoding="utf-8")) for r in results))
        cells = [c for c in row.strip("|").split("|")[1:] if "](" not in c]
        missing = sorted(numbers(" ".join(cells)) - have)
        if missing:
            problems.append(f"{md.name}: row {row[:60]!r}: {missing} not in {[r.name for r in results]}")
    if md == performance:
        for heading in re.findall(r"^## (.+)$", text, re.M):
            body = section(performance, slug(heading))
            results = cited_results(body)
            if not results:
                continue
            have = set().union(*(numbers(r.read_text(encoding="utf-8")) for r in results))
            for row in re.findall(r"^\|.*\|$", body, re.M):
                missing = sorted(numbers(row) - have)
                if missing:
                    problems.append(f"performance.md, {heading}: row {row[:60]!r}: {missing} not in {[r.name for r in results]}")
    return problems


# ------------------------------------------------------------------------------------------------
# The quick tier: text only.


def test_every_block_has_a_language_and_every_command_a_mark():
    assert len(ALL_BLOCKS) > 20 and {b.path.name for b in ALL_BLOCKS} >= {"README.md", "megatron.md", "deepspeed.md"}
    problems = [p for b in ALL_BLOCKS for p in block_problems(b)]
    assert not problems, "\n".join(problems)


def test_the_block_checker_fails_on_unmarked_and_mismarked_blocks():
    doc = ROOT / "docs" / "example.md"
    text = (
        "```bash\npython x.py\n```\n\n<!-- command: gpu -->\n```python\nx = 1\n```\n\n```\nplain\n```\n\n"
        "<!-- command: cpu -->\n```text\nout\n```\n\n<!-- command: cpu -->\n```bash\ntrue\n```\n"
    )
    found = [p for b in parse_blocks(doc, text) for p in block_problems(b)]
    assert len(found) == 4, found
    assert "without '<!-- command" in found[0] and "cannot be marked gpu" in found[1]
    assert "without a language" in found[2] and "not a command" in found[3]


def test_shell_commands_are_split_as_a_shell_would():
    text = 'A=1 B="x y" python run.py --flag v \\\n  --other # comment\ncd d && patch -p1 < f.patch; echo "a && b" | cat\n'
    assert commands(text) == [
        ({"A": "1", "B": "x y"}, ["python", "run.py", "--flag", "v", "--other"], None),
        ({}, ["cd", "d"], None),
        ({}, ["patch", "-p1"], "f.patch"),
        ({}, ["echo", "a && b"], None),
        ({}, ["cat"], None),
    ]


def test_install_blocks_name_declared_extras():
    extras = declared_extras()
    assert {"megatron", "deepspeed", "kernels", "hf", "test"} <= extras
    blocks = blocks_marked("install")
    assert blocks and any(b.path.name == "README.md" for b in blocks)
    problems = [p for b in blocks for p in install_problems(b, extras)]
    assert not problems, "\n".join(problems)
    misspelled = "kernal"
    bad = Block(ROOT / "README.md", 1, "bash", "install", f'pip install -e ".[megatron,{misspelled}]"\nrm -rf /tmp/x')
    found = [p.split(": ", 1)[1] for p in install_problems(bad, extras)]
    assert len(found) == 2 and found[0].startswith("extra [kernal] is not declared"), found
    assert found[1] == "not an install command: rm -rf /tmp/x", found


def test_the_readme_test_command_is_the_one_ci_runs():
    readme = ROOT / "README.md"
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    blocks = parse_blocks(readme)
    (tests,) = [b for b in blocks if b.mark == "tests"]
    installs = [b for b in blocks if b.mark == "install" and b.line < tests.line]
    extras_before = None
    if installs:
        extras_before = set().union(*(pip_extras(w) or set() for _, w, _ in commands(installs[-1].text)))
    problems = check_tests_block(tests, ci, extras_before, declared_markers())
    assert not problems, "\n".join(problems)
    assert not [b for b in ALL_BLOCKS if b.mark == "tests" and b.path != readme]
    wrong = Block(readme, 1, "bash", "tests", 'python -m pytest -q tests/\npython -m pytest -m "not slowly"')
    found = check_tests_block(wrong, ci, {"megatron"}, declared_markers())
    assert len(found) == 4 and "are not the ones .ci/run runs" in found[0], found
    assert "unexpected pytest argument 'tests/'" in found[1] and "'slowly' is not declared" in found[2]
    assert "installs ['docs', 'lint', 'test']" in found[3]


def test_the_docs_install_the_pinned_packages_ci_installs():
    """The README's tests install and every install block that installs without requirements
    (torchtitan's) pin what .ci/run pins, as it does (with or without --no-deps)."""
    ci = pinned((ROOT / ".ci" / "run").read_text(encoding="utf-8"))
    assert ("torchtitan==0.3.0", True) in ci and ("datasets==5.2.0", False) in ci, ci
    readme = parse_blocks(ROOT / "README.md")
    (tests,) = [b for b in readme if b.mark == "tests"]
    blocks = [[b for b in readme if b.mark == "install" and b.line < tests.line][-1]]
    blocks += [b for b in blocks_marked("install") if "--no-deps" in b.text and b.path.name != "README.md"]
    assert len(blocks) >= 3, [b.where for b in blocks]  # docs/install.md: torchtitan's install and the tests'
    for block in blocks:
        assert pinned(block.text) == ci, (block.where, pinned(block.text) ^ ci)
    for wrong in (blocks[0].text.replace("datasets==5.2.0", "datasets==4.7.0"), blocks[0].text.replace("--no-deps ", "")):
        assert pinned(wrong) != ci


def test_python_blocks_compile():
    for block in ALL_BLOCKS:
        if block.lang in PYTHON:
            compile(block.text, block.where, "exec")
    with pytest.raises(SyntaxError):
        compile("opt = Dion3(params,", "broken", "exec")


def test_json_blocks_parse_and_a_dion3_block_uses_dion3_keys():
    from dion3_megatron import options

    allowed = {o.name for o in options.options_for(options.DEEPSPEED)}
    count = 0
    for block in ALL_BLOCKS:
        if block.lang == "json":
            config = json.loads(block.text)
            optimizer = config.get("optimizer", {}) if isinstance(config, dict) else {}
            if optimizer.get("type") == "Dion3":
                count += 1
                assert set(optimizer.get("params", {})) <= allowed, (block.where, set(optimizer["params"]) - allowed)
    assert count >= 3


def test_links_resolve():
    problems = [p for path in DOCS for p in link_problems(path)]
    assert not problems, "\n".join(problems)
    broken = (
        f"[a](docs/nothing.md) [b](docs/tuning.md#no-such-heading) [c](https://example.com) "
        f"[d]({REPOSITORY_URL}blob/main/docs/nothing.md) [e]({REPOSITORY_URL}blob/main/docs/tuning.md#no-such-heading) "
        f"[f]({REPOSITORY_URL}blob/main/docs/tuning.md#learning-rate)"
    )
    assert len(link_problems(ROOT / "README.md", broken)) == 4


def test_the_tables_figures_are_in_the_results_they_cite():
    performance = ROOT / "docs" / "performance.md"
    assert len(cited_results(performance.read_text(encoding="utf-8"))) >= 10
    for result in cited_results(performance.read_text(encoding="utf-8")):
        data = json.loads(result.read_text(encoding="utf-8"))
        text = json.dumps(data)
        assert '"command' in text and re.search(r"20\d\d-\d\d-\d\d", text), result.name  # what made it, when
        assert re.search(r'"(gpu|machine|device)"', text) and re.search(r'"(versions|torch)"', text), result.name
    problems = figure_problems(ROOT / "README.md") + figure_problems(performance)
    assert not problems, "\n".join(problems)
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    row = next(r for r in readme.splitlines() if "14b-shapes" in r)
    assert figure_problems(ROOT / "README.md", row.replace("8.92x", "8.93x"))


# ------------------------------------------------------------------------------------------------
# The slow tier: CPU commands run, GPU commands checked.


def environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return env


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A directory that looks like the repository root (each top-level entry linked), so that the
    commands run as written while what they write lands outside the checkout."""
    where = tmp_path_factory.mktemp("repo")
    for entry in ROOT.iterdir():
        if entry.name not in (".git", "runs", ".venv", "out", "results"):
            (where / entry.name).symlink_to(entry)
    return where


CPU_RUNS: dict[str, Block] = {}
for _block in blocks_marked("cpu"):
    CPU_RUNS.setdefault(_block.text, _block)  # one run for a command shown twice, named where it is first


# A gloo run can abort on its way out, after its last output, with this message: gloo's worker thread
# frees a finished collective's tensors while the interpreter shuts down, and Python ends that thread
# inside a C++ destructor. The scripts pause before leaving (examples/leave_process_group.py: 0
# aborts in 60 runs of `comm_fsdp2.py --measure`, against 8 in 60 without); a command that
# still aborts so runs once more, and must pass then.
EXIT_ABORT = "terminate called without an active exception"


@pytest.mark.slow
@pytest.mark.parametrize("text", list(CPU_RUNS), ids=[b.where for b in CPU_RUNS.values()])
def test_cpu_command_runs_as_written(text, workdir):
    block = CPU_RUNS[text]
    if block.lang in PYTHON:
        script = workdir / f"block_{block.line}.py"
        script.write_text(text, encoding="utf-8")
        argv = [sys.executable, str(script)]
    else:
        argv = ["bash", "-eo", "pipefail", "-c", text]
    env = environment()
    env["PATH"] = os.pathsep.join([str(pathlib.Path(sys.executable).parent), env.get("PATH", "")])
    proc = subprocess.run(argv, cwd=workdir, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0 and EXIT_ABORT in proc.stderr:  # the command ran; a rank aborted on its way out
        proc = subprocess.run(argv, cwd=workdir, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{block.where}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    assert "Traceback (most recent call last)" not in proc.stderr, f"{block.where}\n{proc.stderr[-5000:]}"


# The GPU checks collect what each command asks of a script, then check it in a few processes.

MEGATRON_PARSE = """
import argparse, json, sys
import dion3_megatron.megatron  # registers --optimizer dion3 and the --dion3-* flags
from megatron.training.arguments import add_megatron_arguments
errors = []
for argv in json.loads(sys.argv[1]):
    parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    def error(message):
        raise ValueError(message)
    parser.error = error
    try:
        parser.parse_args(argv)
        errors.append(None)
    except ValueError as e:
        errors.append(str(e))
print(json.dumps(errors))
"""

DEEPSPEED_PARSE = """
import contextlib, io, json, sys
from deepspeed.launcher.runner import parse_args
parsed = []
for argv in json.loads(sys.argv[1]):
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            args = parse_args(argv)
        parsed.append([args.user_script, args.user_args])
    except SystemExit:
        parsed.append(stderr.getvalue())
print(json.dumps(parsed))
"""

# What a comparison script does with the flags after it.
FORWARDS = {
    "examples/megatron_lm/compare_on_gpus.sh": "megatron",
    "examples/deepspeed/compare_on_gpus.sh": "examples/deepspeed/train_gpt.py",
    "examples/hf_trainer/compare_on_gpus.sh": "examples/hf_trainer/train.py",
}
LAUNCHER = "dion3_megatron.megatron.launch"
# torchtitan's trainer on GPUs: a module of another package, run from a torchtitan checkout (its test
# tokenizer and data). What is checked: our module and a trainer config it registers (the CPU command
# of docs/torchtitan.md runs the trainer).
TORCHTITAN_TRAIN, TORCHTITAN_MODULE = "torchtitan.train", "dion3_megatron.torchtitan"


def torchtitan_configs() -> set[str]:
    """The trainer configs of ``--module dion3_megatron.torchtitan``: the public functions of its
    config_registry (read with ast: importing it imports torchtitan's trainer)."""
    tree = ast.parse((ROOT / "dion3_megatron" / "torchtitan" / "config_registry.py").read_text(encoding="utf-8"))
    return {n.name for n in tree.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")}


class GpuCheck:
    def __init__(self):
        self.problems: list[str] = []
        self.megatron: list[tuple[str, list[str]]] = []  # (where, argv) for Megatron's parser
        self.script_flags: list[tuple[str, str, list[str]]] = []  # (where, script, argv)
        self.deepspeed: list[tuple[str, list[str]]] = []  # (where, argv) for DeepSpeed's launcher's parser

    def flags_of(self, argv: list[str]) -> list[str]:
        return [a.split("=", 1)[0] for a in argv if a.startswith("--")]

    def script(self, where: str, script: str, argv: list[str]) -> None:
        if script.startswith(EXTERNAL):
            return
        if not (ROOT / script).is_file():
            self.problems.append(f"{where}: {script}: no such file")
        elif script.endswith(".sh"):
            if script not in FORWARDS:
                self.problems.append(f"{where}: {script}: what it does with its arguments is not known here")
            elif FORWARDS[script] == "megatron":
                self.megatron.append((where, argv))
            else:
                self.script_flags.append((where, FORWARDS[script], argv))
        elif script == "examples/megatron_cpu.py" or script.endswith("pretrain_gpt.py") and "megatron_lm" in script:
            self.megatron.append((where, argv[1:] if script == "examples/megatron_cpu.py" else argv))
            if script == "examples/megatron_cpu.py":
                self.script(where, argv[0], [])
        else:
            self.script_flags.append((where, script, argv))

    def command(self, where: str, env: dict[str, str], words: list[str], stdin: str | None) -> None:
        program = words[0]
        if program == "patch":
            diff = (ROOT / stdin).read_text(encoding="utf-8") if stdin and (ROOT / stdin).is_file() else ""
            if not (re.search(r"^--- ", diff, re.M) and re.search(r"^\+\+\+ ", diff, re.M)):
                self.problems.append(f"{where}: patch reads {stdin!r}, which is not a patch file here")
            return
        if program == "bash" or program.endswith(".sh"):
            script, argv = (words[1], words[2:]) if program == "bash" else (program, words[1:])
            if (ROOT / script).is_file():
                source = (ROOT / script).read_text(encoding="utf-8")
                for name in env:
                    if not re.search(rf"\${{?{name}\b", source):
                        self.problems.append(f"{where}: {script} does not read ${name}")
                if env.get("DION3_FLAGS") and FORWARDS.get(script) == "megatron":
                    self.megatron.append((where, shlex.split(env["DION3_FLAGS"])))
                syntax = subprocess.run(["bash", "-n", str(ROOT / script)], capture_output=True, text=True)
                if syntax.returncode:
                    self.problems.append(f"{where}: bash -n {script}: {syntax.stderr}")
            self.script(where, script, argv)
            return
        if env:
            self.problems.append(f"{where}: environment {sorted(env)} before {program}: not checked here")
        if program == "torchrun":
            from torch.distributed.run import get_args_parser

            parser = get_args_parser()
            parser.exit_on_error = False
            try:
                args = parser.parse_args(words[1:])
            except (argparse.ArgumentError, SystemExit) as e:
                self.problems.append(f"{where}: torchrun's flags: {e}")
                return
            target = ["-m", args.training_script] if args.module else [args.training_script]
            self.python(where, target + args.training_script_args)
        elif program == "deepspeed":
            self.deepspeed.append((where, words[1:]))
        elif re.fullmatch(r"python3?", program):
            self.python(where, words[1:])
        else:
            self.problems.append(f"{where}: {program}: not a command this test knows how to check")

    def python(self, where: str, argv: list[str]) -> None:
        if argv[:1] == ["-m"]:
            module, rest = argv[1], argv[2:]
            if module == TORCHTITAN_TRAIN:
                self.torchtitan(where, rest)
            elif module != LAUNCHER:
                self.problems.append(f"{where}: python -m {module}: not a module this test knows how to check")
            elif rest and rest[0] != "--help":
                self.script(where, rest[0], rest[1:])
                if not rest[0].startswith(EXTERNAL) and "megatron_lm" not in rest[0]:
                    self.problems.append(f"{where}: the launcher runs Megatron-LM scripts, got {rest[0]}")
                elif rest[0].startswith(EXTERNAL):
                    self.megatron.append((where, rest[1:]))
        elif argv[:1] == ["-c"]:
            compile(argv[1], where, "exec")
        else:
            self.script(where, argv[0], argv[1:])

    def torchtitan(self, where: str, argv: list[str]) -> None:
        """``torchtitan.train --module dion3_megatron.torchtitan --config NAME``: NAME one of our configs."""
        values = dict(zip(argv[::2], argv[1::2]))
        if len(argv) % 2 or set(values) != {"--module", "--config"}:
            self.problems.append(
                f"{where}: torchtitan.train {shlex.join(argv)}: expected --module "
                f"{TORCHTITAN_MODULE} --config NAME (torchtitan's other flags are not checked here)"
            )
        elif values["--module"] != TORCHTITAN_MODULE:
            self.problems.append(f"{where}: torchtitan.train --module {values['--module']}: not {TORCHTITAN_MODULE}")
        elif values["--config"] not in torchtitan_configs():
            self.problems.append(
                f"{where}: torchtitan.train --config {values['--config']}: not a trainer config of "
                f"{TORCHTITAN_MODULE} ({sorted(torchtitan_configs())})"
            )

    def deepspeed_scripts(self) -> None:
        """The scripts the deepspeed commands run, with their flags, by DeepSpeed's launcher's
        parser: every command's in one process (importing DeepSpeed costs seconds)."""
        if not self.deepspeed:
            return
        out = subprocess.run(
            [sys.executable, "-c", DEEPSPEED_PARSE, json.dumps([argv for _, argv in self.deepspeed])],
            capture_output=True,
            text=True,
            env={**environment(), "DS_ACCELERATOR": "cpu"},
            timeout=120,
        )
        if out.returncode:
            self.problems.append(f"DeepSpeed's launcher's parser did not run: {out.stderr[-1500:]}")
            return
        for (where, _), parsed in zip(self.deepspeed, json.loads(out.stdout.strip().splitlines()[-1])):
            if isinstance(parsed, str):
                self.problems.append(f"{where}: deepspeed's flags: {parsed[-500:]}")
            else:
                self.script(where, *parsed)

    def finish(self) -> list[str]:
        """Run what was collected: DeepSpeed's launcher's parser, then the scripts' --help (their
        flags; all in one process) and Megatron's parser, side by side (each process spends its
        time importing torch)."""
        self.deepspeed_scripts()
        scripts = sorted({script for _, script, _ in self.script_flags})
        with ThreadPoolExecutor(max_workers=2) as pool:
            parsed = pool.submit(megatron_parse, [a for _, a in self.megatron]) if self.megatron else None
            helps = pool.submit(scripts_flags, scripts).result()
        for where, script, argv in self.script_flags:
            known = helps[script]
            if isinstance(known, str):
                self.problems.append(f"{where}: {script} {known}")
                continue
            unknown = [f for f in self.flags_of(argv) if f not in known]
            if unknown:
                self.problems.append(f"{where}: {script} does not take {unknown}")
        if parsed is not None:
            errors = parsed.result()
            if isinstance(errors, str):
                self.problems.append(errors)
            else:
                self.problems += [f"{where}: Megatron's parser: {error}" for (where, _), error in zip(self.megatron, errors) if error]
        return self.problems


def scripts_flags(scripts: list[str]) -> dict[str, set[str] | str]:
    """The flags each script's --help lists, or what went wrong, by script: every --help in one
    process (support/one_process.py)."""
    argvs = [[script, "--help"] for script in scripts]
    command = [sys.executable, *one_process.arguments(argvs)]
    runs = one_process.results(argvs, subprocess.run(command, cwd=ROOT, env=environment(), capture_output=True, text=True, timeout=300))
    return {script: script_flags(runs[script, "--help"]) for script in scripts}


def script_flags(out: subprocess.CompletedProcess) -> set[str] | str:
    """The flags a script's --help run lists, or what went wrong."""
    if out.returncode:
        return f"--help failed: {out.stderr[-800:]}"
    return set(re.findall(r"(?<![\w-])(--[A-Za-z0-9][\w-]*)", out.stdout))


def megatron_parse(argvs: list[list[str]]) -> list[str | None] | str:
    """Megatron's parser's error for each argv (None where it parses), or what went wrong."""
    out = subprocess.run(
        [sys.executable, "-c", MEGATRON_PARSE, json.dumps(argvs)], cwd=ROOT, env=environment(), capture_output=True, text=True, timeout=300
    )
    if out.returncode:
        return f"Megatron's parser did not run: {out.stderr[-1500:]}"
    return json.loads(out.stdout.strip().splitlines()[-1])


def check_gpu_blocks(blocks: list[Block]) -> list[str]:
    check = GpuCheck()
    for block in blocks:
        for env, words, stdin in commands(block.text):
            check.command(block.where, env, words, stdin)
    return check.finish()


# A made-up block of GPU commands with one mistake each, checked beside the real ones (one run of
# every script's --help and of Megatron's parser serves both): the check must catch every mistake.
BROKEN_GPU_COMMANDS = (
    "python -m dion3_megatron.megatron.launch Megatron-LM/pretrain_gpt.py --optimizer dion3 --num-layer 4\n"
    "torchrun --nproc-per-node 2 benchmarks/bench_megatron.py --tp 2 --optimiser dion3\n"
    "torchrun --nproc-pre-node 2 benchmarks/bench_megatron.py\n"
    "STEPS=3 bash examples/megatron_lm/compare_on_gpus.sh\n"
    "deepspeed --num_gpus 2 examples/deepspeed/train_gpt.py --config c.json --step 5\n"
    "python benchmarks/bench_nothing.py\n"
    "patch -p1 -d Megatron-LM < patches/nothing.patch\n"
    "torchrun --nproc-per-node 1 -m torchtitan.train --module dion3_megatron.torchtitan --config llama3_nothing\n"
)
BROKEN_MISTAKES = [
    "--num-layer",
    "--optimiser",
    "torchrun's flags",
    "does not read $STEPS",
    "'--step'",
    "bench_nothing.py: no such file",
    "nothing.patch",
    "--config llama3_nothing",
]


@pytest.mark.slow
def test_gpu_commands_name_scripts_and_flags_that_exist():
    blocks = blocks_marked("gpu")
    assert len(blocks) >= 10 and any(LAUNCHER in b.text for b in blocks)
    broken = Block(ROOT / "broken-commands.md", 1, "bash", "gpu", BROKEN_GPU_COMMANDS)
    problems = check_gpu_blocks([*blocks, broken])
    caught = [p for p in problems if p.startswith(broken.where)]
    assert not [p for p in problems if p not in caught], "\n".join(problems)
    for word in BROKEN_MISTAKES:  # the check can fail: each planted mistake is caught, once
        assert any(word in p for p in caught), (word, caught)
    assert len(caught) == len(BROKEN_MISTAKES), caught
    launcher = subprocess.run(
        [sys.executable, "-m", LAUNCHER, "--help"], cwd=ROOT, env=environment(), capture_output=True, text=True, timeout=120
    )
    assert launcher.returncode == 0 and "--dion3-fraction" in launcher.stdout, launcher.stderr[-2000:]
    for block in blocks:  # every --dion3-* flag a doc shows is one the launcher's --help lists
        for flag in re.findall(r"--dion3-[a-z-]+", block.text):
            assert flag in launcher.stdout, (block.where, flag)
