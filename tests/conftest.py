import pytest
import torch


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
