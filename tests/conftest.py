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


@pytest.fixture
def read_only(tmp_path):
    """``read_only(t)``: ``t``'s values in a read-only file mapping (as a GGUF file or ComfyUI 0.33's
    memory-mapped loader hands weights over), same dtype and shape; each call maps its own file."""
    import warnings

    import numpy as np

    count = [0]

    def make(t: torch.Tensor) -> torch.Tensor:
        count[0] += 1
        path = tmp_path / f"weights{count[0]}.bin"
        t = t.detach().contiguous()
        path.write_bytes(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"\0")
        raw = np.memmap(path, mode="r", dtype=np.uint8)[: t.numel() * t.element_size()]
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            return torch.from_numpy(raw).view(t.dtype).view(t.shape)

    return make
