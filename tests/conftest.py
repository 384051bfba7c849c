import sys

import pytest
import torch

from support import quick_tier
from support.repository import ROOT

# The repository root, once: the tests import the examples and benchmarks as packages
# (``from examples import small_gpt``, ``from benchmarks import bench_convergence``), and spawned
# workers inherit the path. The shared helpers are tests/support (tests/ is on the path already).
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def pytest_configure(config):
    config.pluginmanager.register(quick_tier, "quick_tier")  # no process, at most a second, outside `slow`


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def generator():
    """A fresh, randomly seeded generator: every test draws new inputs (the seed is printed on failure)."""
    seed = torch.seed() % (2**31)
    print(f"seed={seed}")
    return torch.Generator().manual_seed(seed)
