"""The layers of dion3_megatron, as a contract: each subpackage and top-level module (a "unit")
imports only the units :data:`ALLOWED` lists for it, and core/ does not communicate.

An edge is any import of a unit, at module level or inside a function, relative or absolute, and
any string that names a module of the package (``"dion3_megatron.x"`` or ``"dion3_megatron.x:name"``,
as ``importlib.import_module`` or a table of ``module:name`` strings would import it).
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
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


def named_modules(source: str) -> set[str]:
    """The modules of the package that string constants of ``source`` name."""
    return {
        node.value.partition(":")[0]
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and _MODULE_STRING.fullmatch(node.value)
    }


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
    reached = {name for name in imported_names(source, module) | named_modules(source) if name == PACKAGE or name.startswith(PACKAGE + ".")}
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
    ],
)
def test_a_forbidden_edge_is_caught(module, source, edge):
    assert violations(source, module) == {edge}


def test_the_table_names_every_unit():
    assert set(ALLOWED) == UNITS
    assert all(targets <= UNITS and reason for targets, reason in ALLOWED.values())


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.relative_to(SOURCES).as_posix())
def test_every_module_imports_only_what_its_layer_allows(path):
    module = module_name(path)
    found = violations(path.read_text(encoding="utf-8"), module)
    assert not found, f"{module} ({unit_of(module)}) reaches {sorted(found)}: {ALLOWED[unit_of(module)][1]}"
