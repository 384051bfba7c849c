"""Where the tests find the repository's files, wherever a test file sits under tests/: the
repository root (README, docs, examples, pyproject.toml), tests/ itself (its data, the ``support``
package), and the scripts of tools/, loaded as modules."""

from __future__ import annotations

import importlib.util
import pathlib
import sys
from types import ModuleType

TESTS = pathlib.Path(__file__).resolve().parents[1]
ROOT = TESTS.parent


def load_tool(name: str) -> ModuleType:
    """tools/``name``.py as the module ``name``, registered in sys.modules (a dataclass of the
    module looks its module up there)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
