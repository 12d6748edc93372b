"""fp8 tensor-core path of QuantLinear on CUDA (sm >= 8.9): same result as dequantize-then-matmul."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from comfyui_levers.core.quant import QuantConfig, QuantLinear, sqnr

cuda = pytest.mark.cuda
needs_fp8 = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                               reason="needs a CUDA GPU with fp8 tensor cores (sm >= 8.9)")


@cuda
@needs_fp8
@pytest.mark.parametrize("gran", ["per_tensor", "per_row"])
@pytest.mark.parametrize("mode", ["tensorwise", "rowwise"])
def test_scaled_mm_matches_dequantized_matmul(gran, mode):
    torch.manual_seed(0)
    lin = nn.Linear(3072, 1024, device="cuda", dtype=torch.bfloat16)
    layer = QuantLinear.from_linear(lin, QuantConfig("fp8", gran))
    layer.fp8_compute = mode
    x = torch.randn(2, 256, 3072, device="cuda", dtype=torch.bfloat16)
    assert layer._fp8_fast_path(x)
    fast = layer(x)
    layer.use_fp8_compute = False
    slow = layer(x)
    assert fast.shape == slow.shape == (2, 256, 1024)
    assert sqnr(slow, fast) > 25.0  # only the per-token fp8 activation rounding differs
    assert sqnr(lin(x), fast) > 25.0


def _bench():  # python tests/test_quant_cuda.py: FLUX-shaped matmul timings (printed, never asserted)
    import time
    rows = []
    for out, inp in ((3072, 3072), (12288, 3072), (3072, 12288), (21504, 3072)):
        lin = nn.Linear(inp, out, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(4096, inp, device="cuda", dtype=torch.bfloat16)
        res = {}
        for name, mod in (("bf16", lin), ("fp8_row", QuantLinear.from_linear(lin, QuantConfig("fp8", "per_row"))),
                          ("fp8_dequant", QuantLinear.from_linear(lin, QuantConfig("fp8", "per_row"))),
                          ("nf4", QuantLinear.from_linear(lin, QuantConfig("nf4")) if _has_bnb() else None)):
            if mod is None:
                continue
            if name == "fp8_row":
                mod.use_fp8_compute = True
            for _ in range(3):
                mod(x)
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(20):
                mod(x)
            torch.cuda.synchronize()  # wait for the queued kernels before reading the clock
            res[name] = (time.perf_counter() - t) / 20 * 1e3
        rows.append(((out, inp), res))
        print(f"{out}x{inp} tokens=4096 ms: " + "  ".join(f"{k} {v:.3f}" for k, v in res.items())
              + f"  speedup fp8/bf16 {res['bf16'] / res['fp8_row']:.2f}x")
    return rows


def _has_bnb():
    try:
        import bitsandbytes  # noqa: F401
        return True
    except ImportError:
        return False


if __name__ == "__main__":
    print(torch.__version__, torch.cuda.get_device_name(), torch.cuda.get_device_capability())
    for g in ("per_tensor", "per_row"):
        test_scaled_mm_matches_dequantized_matmul(g)
        print("fast path ok", g)
    _bench()
