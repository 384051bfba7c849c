"""dion3_megatron.core is the math alone: it reads neither the option spec (which imports it) nor
torch.distributed (the engine communicates)."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
CORE = ROOT / "dion3_megatron" / "core"
FORBIDDEN = ("dion3_megatron.options", "torch.distributed")


def imported_names(source: str, module: str) -> set[str]:
    """Every module (or module attribute) that ``source``, the module ``module``, imports anywhere,
    in absolute form: ``from .. import options`` in dion3_megatron.core.rule gives
    dion3_megatron and dion3_megatron.options."""
    package = module.split(".")[:-1]
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1] if node.level else [])
            source_module = ".".join(part for part in (base, node.module) if part)
            names.add(source_module)
            names.update(f"{source_module}.{alias.name}" for alias in node.names)
    return names


def forbidden_imports(source: str, module: str) -> set[str]:
    return {name for name in imported_names(source, module)
            if any(name == f or name.startswith(f + ".") for f in FORBIDDEN)}


@pytest.mark.parametrize("source", ["from .. import options", "from ..options import AUTO",
                                    "import dion3_megatron.options", "import torch.distributed as dist",
                                    "from torch import distributed", "from torch.distributed import all_reduce",
                                    "def f():\n    import torch.distributed\n"])
def test_the_check_finds_each_spelling(source):
    assert forbidden_imports(source, "dion3_megatron.core.rule")


def test_the_check_lets_other_imports_pass():
    assert not forbidden_imports("import torch\nfrom ..kernels import rows\nfrom .ortho import orthogonalize\n"
                                 "from . import options_of_the_math", "dion3_megatron.core.rule")


@pytest.mark.parametrize("path", sorted(CORE.rglob("*.py")), ids=lambda p: p.relative_to(CORE).as_posix())
def test_core_imports_neither_the_option_spec_nor_torch_distributed(path):
    module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    assert not forbidden_imports(path.read_text(encoding="utf-8"), module)
