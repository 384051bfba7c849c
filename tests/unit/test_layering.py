"""The layers of dion3_megatron, as a contract: each subpackage and top-level module (a "unit")
imports only the units :data:`ALLOWED` lists for it, and core/ does not communicate.

An edge is any import of a unit, at module level or inside a function, relative or absolute, and
any string that names a module of the package (``"dion3_megatron.x"`` or ``"dion3_megatron.x:name"``,
as ``importlib.import_module`` or a table of ``module:name`` strings would import it), whether a
constant, an f-string or a ``+`` of strings, and a relative name given to ``import_module``.
"""

from __future__ import annotations

import ast
import pathlib
import re
from typing import Optional

import pytest
from support.repository import ROOT

PACKAGE = "dion3_megatron"
SOURCES = ROOT / PACKAGE

# unit -> (the units it may import, why).
ALLOWED: dict[str, tuple[frozenset[str], str]] = {
    "kernels": (frozenset(), "the matrix-product and row kernels and their configuration: the bottom layer"),
    "core": (frozenset({"kernels"}), "the math (orthogonalization, the rule, the cost model), its products run by the kernels"),
    "engine": (frozenset({"core", "kernels"}), "moves matrix shards between ranks and steps them with the rule; knows no option spelling"),
    "options": (frozenset({"core", "kernels"}), "the option spec: its choices are the math's and the kernels' own"),
    "frontend": (
        frozenset({"core", "engine", "kernels", "options"}),
        "what the front ends share: param groups checked by the spec, parameters handed to the engine",
    ),
    "optimizer": (frozenset({"core", "engine", "frontend", "kernels", "options"}), "the torch front end (Dion3)"),
    "megatron": (
        frozenset({"compat", "core", "engine", "frontend", "kernels", "options"}),
        "the Megatron front end; changes Megatron only through compat's table",
    ),
    "deepspeed": (
        frozenset({"compat", "core", "engine", "frontend", "kernels", "optimizer", "options"}),
        "the DeepSpeed front end; changes DeepSpeed only through compat's table, and knows the "
        "torch Dion3 to refuse it where ZeRO hands it flat partitions",
    ),
    "torchtitan": (
        frozenset({"compat", "frontend", "optimizer", "options"}),
        "the torchtitan front end: the torch Dion3 for torchtitan's optimizer config; changes torchtitan only through a compat Patch",
    ),
    "report": (
        frozenset({"__init__", "core", "engine", "kernels", "options", "frontend", "optimizer", "megatron", "deepspeed", "torchtitan"}),
        "python -m dion3_megatron's environment report: imports each front end to say whether it loads",
    ),
    "__main__": (frozenset({"report"}), "python -m dion3_megatron"),
    "compat": (
        frozenset(),
        "applies, restores and checks the tables of patches that the front ends hand it; imports none of them",
    ),
    "__init__": (frozenset({"core", "optimizer"}), "the package's public names: Dion3 and its settings"),
}

# Modules a unit may not import at all, whatever the table says: (unit, module, why).
FORBIDDEN_OUTSIDE = (("core", "torch.distributed", "the engine communicates; the math does not"),)

_MODULE_STRING = re.compile(rf"{PACKAGE}(\.\w+)*(:[\w.]+)?")


def imported_names(source: str, module: str) -> set[str]:
    """Every module (or module attribute) that ``source``, the module ``module``, imports anywhere,
    in absolute form: ``from .. import options`` in dion3_megatron.core.rule gives
    dion3_megatron.options; ``from torch import distributed`` gives torch and torch.distributed.
    (A package's ``__init__`` is the module ``<package>.__init__``.)"""
    package = module.split(".")[:-1]
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1] if node.level else [])
            source_module = ".".join(part for part in (base, node.module) if part)
            if source_module != PACKAGE:  # ``from dion3_megatron import x``: x says which unit
                names.add(source_module)
            names.update(f"{source_module}.{alias.name}" for alias in node.names)
    return names


_UNKNOWN = "\0"  # a part of a string that the source alone does not tell
_KNOWN_PREFIX = re.compile(rf"{PACKAGE}(\.\w+)*[.:]?")


def _module_strings(tree: ast.Module) -> dict[str, str]:
    """The module-level names bound to a string constant (``_DS = "dion3_megatron.deepspeed"``)."""
    return {
        target.id: node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
        for target in node.targets
        if isinstance(target, ast.Name)
    }


def _text(node: ast.AST, strings: dict[str, str]) -> Optional[str]:
    """The string ``node`` evaluates to, :data:`_UNKNOWN` for each part not known; None where it is
    no string (or nothing of it is known)."""
    if isinstance(node, ast.Constant):
        return node.value if isinstance(node.value, str) else None
    if isinstance(node, ast.Name):
        return strings.get(node.id, _UNKNOWN)
    if isinstance(node, ast.JoinedStr):
        parts = [_text(part.value if isinstance(part, ast.FormattedValue) else part, strings) for part in node.values]
        return "".join(_UNKNOWN if part is None else part for part in parts)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _text(node.left, strings), _text(node.right, strings)
        if left is None or right is None or left == right == _UNKNOWN:
            return None
        return left + right
    return None


def _named_module(text: str) -> Optional[str]:
    """The module of the package that ``text`` names, the package where a part after it is not known."""
    if _UNKNOWN not in text:
        return text.partition(":")[0] if _MODULE_STRING.fullmatch(text) else None
    known = text.partition(_UNKNOWN)[0]
    if not _KNOWN_PREFIX.fullmatch(known):
        return None
    return known[:-1] if known.endswith((".", ":")) else known.rpartition(".")[0] or known


def _relative_import(node: ast.AST, strings: dict[str, str], module: str) -> Optional[str]:
    """The absolute name of ``import_module(".name")`` (relative to ``module``'s package, or the
    package given as the second argument)."""
    if not (isinstance(node, ast.Call) and node.args):
        return None
    called = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
    name = _text(node.args[0], strings)
    if called != "import_module" or not name or not name.startswith(".") or _UNKNOWN in name:
        return None
    given = _text(node.args[1], strings) if len(node.args) > 1 else None
    package = given.split(".") if given and _UNKNOWN not in given else module.split(".")[:-1]
    level = len(name) - len(name.lstrip("."))
    return ".".join([*package[: len(package) - level + 1], name.lstrip(".")]).rstrip(".")


def named_modules(source: str, module: str) -> set[str]:
    """The modules of the package that strings of ``source`` (the module ``module``) name: string
    constants, f-strings and ``+`` of strings, read with the module-level string constants they
    use, and relative names given to ``import_module``."""
    tree = ast.parse(source)
    strings = _module_strings(tree)
    named = set()
    for node in ast.walk(tree):
        text = _text(node, strings) if isinstance(node, (ast.Constant, ast.JoinedStr, ast.BinOp)) else None
        found = (_named_module(text) if text is not None else None) or _relative_import(node, strings, module)
        if found is not None:
            named.add(found)
    return named


def units() -> set[str]:
    """Every subpackage and top-level module of the package (``__init__``: the package itself)."""
    return {
        p.stem if p.is_file() else p.name for p in SOURCES.iterdir() if (p.is_dir() and (p / "__init__.py").is_file()) or p.suffix == ".py"
    }


UNITS = units()


def unit_of(name: str) -> str:
    """The unit a module (or module attribute) of the package belongs to."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in UNITS else "__init__"  # else: a name the package exports


def edges(source: str, module: str) -> set[str]:
    """The units other than its own that the module ``module`` reaches: its imports and the modules
    its strings name."""
    mine = unit_of(module)
    reached = {
        name for name in imported_names(source, module) | named_modules(source, module) if name == PACKAGE or name.startswith(PACKAGE + ".")
    }
    return {unit_of(name) for name in reached} - {mine}


def violations(source: str, module: str) -> set[str]:
    """What ``module`` may not reach: units outside its row of ALLOWED, and FORBIDDEN_OUTSIDE modules."""
    unit = unit_of(module)
    found = edges(source, module) - ALLOWED[unit][0]
    names = imported_names(source, module)
    for forbidden_unit, outside, _ in FORBIDDEN_OUTSIDE:
        if unit == forbidden_unit:
            found |= {name for name in names if name == outside or name.startswith(outside + ".")}
    return found


def module_name(path: pathlib.Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


MODULES = sorted(SOURCES.rglob("*.py"))


@pytest.mark.parametrize(
    "source",
    [
        "from .. import options",
        "from ..options import AUTO",
        "import dion3_megatron.options",
        "from dion3_megatron import options",
        "import torch.distributed as dist",
        "from torch import distributed",
        "from torch.distributed import all_reduce",
        "def f():\n    import torch.distributed\n",
        "def f():\n    from ..options import AUTO\n",
    ],
)
def test_the_check_finds_each_spelling(source):
    assert violations(source, "dion3_megatron.core.rule")


def test_the_check_lets_allowed_imports_pass():
    assert not violations(
        "import torch\nfrom ..kernels import rows\nfrom .ortho import orthogonalize\n"
        "from . import options_of_the_math\nimport dion3_megatron.kernels.config",
        "dion3_megatron.core.rule",
    )
    assert not violations("from .. import options\nfrom ..engine import plan", "dion3_megatron.frontend.groups")


@pytest.mark.parametrize(
    "module, source, edge",
    [
        ("dion3_megatron.engine.fractions", "from ..options import NS_DTYPES", "options"),
        ("dion3_megatron.kernels.dispatch", "def f():\n    from ..core import ortho\n", "core"),
        ("dion3_megatron.megatron.optimizer", "from ..deepspeed import config", "deepspeed"),
        ("dion3_megatron.core.rule", "import dion3_megatron", "__init__"),
        ("dion3_megatron.options", "from . import Dion3", "__init__"),
        ("dion3_megatron.engine.plan", 'HOOK = "dion3_megatron.megatron.registry:dion3_entry"', "megatron"),
        ("dion3_megatron.compat", 'import importlib\nimportlib.import_module("dion3_megatron.deepspeed.zero3")', "deepspeed"),
        ("dion3_megatron.compat", '_DS = "dion3_" + "megatron.deepspeed"\n', "deepspeed"),
        ("dion3_megatron.compat", 'UNIT = "megatron"\nHOOK = f"dion3_megatron.{UNIT}.registry:dion3_entry"', "megatron"),
        ("dion3_megatron.compat", 'def f(unit):\n    return f"dion3_megatron.{unit}.registry:dion3_entry"', "__init__"),
        ("dion3_megatron.compat", 'def f(unit):\n    return "dion3_megatron.megatron." + unit', "megatron"),
        ("dion3_megatron.compat", 'def f():\n    return importlib.import_module(".megatron.registry", __package__)', "megatron"),
        ("dion3_megatron.megatron.registry", 'import_module("..deepspeed")', "deepspeed"),
        ("dion3_megatron.compat", 'import_module(".launch", "dion3_megatron.megatron")', "megatron"),
    ],
)
def test_a_forbidden_edge_is_caught(module, source, edge):
    assert violations(source, module) == {edge}


@pytest.mark.parametrize(
    "source",
    [
        '"""Applied by dion3_megatron.megatron.register and dion3_megatron.deepspeed.register."""',
        'raise ImportError(f"dion3_megatron.megatron needs Megatron-Core: {EXTRA}")',
        'NAME = "megatron.core.optimizer:_get_megatron_emerging_optimizer"',
        'x = a + b\ny = f"{a}.{b}"\nz = 1 + 2',
    ],
)
def test_text_about_a_module_is_no_edge(source):
    assert violations(source, "dion3_megatron.compat") == set()


def test_the_table_names_every_unit():
    assert set(ALLOWED) == UNITS
    assert all(targets <= UNITS and reason for targets, reason in ALLOWED.values())


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.relative_to(SOURCES).as_posix())
def test_every_module_imports_only_what_its_layer_allows(path):
    module = module_name(path)
    found = violations(path.read_text(encoding="utf-8"), module)
    assert not found, f"{module} ({unit_of(module)}) reaches {sorted(found)}: {ALLOWED[unit_of(module)][1]}"
