import pytest
import torch


@pytest.fixture
def seed():
    torch.manual_seed(0)
    return 0


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; this machine has none (GPU facts come from bench/gpu_suite.py)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
