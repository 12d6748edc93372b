"""fp8 tensor-core modes of QuantLinear, run through torch._scaled_mm's CPU kernels.

The CUDA kernels differ, but the quantize / scale / un-scale arithmetic these tests check is
the same code: every mode must reproduce the dequantize-then-matmul result to fp8 precision."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from comfyui_levers.core.quant import QuantConfig, QuantLinear, sqnr
from comfyui_levers.core.quant import linear as qlinear
from comfyui_levers.core.quant.fp8 import FP8_COMPUTE_MODES, scaled_mm_linear

needs_cpu_scaled_mm = pytest.mark.skipif(not hasattr(torch, "_scaled_mm"), reason="torch has no _scaled_mm")


def _layer(gran: str, bias: bool = True) -> tuple[nn.Linear, QuantLinear]:
    torch.manual_seed(0)
    lin = nn.Linear(256, 96, bias=bias, dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.distributions.StudentT(4.0).sample(lin.weight.shape) * 0.02)  # heavy tails
    return lin, QuantLinear.from_linear(lin, QuantConfig("fp8", gran))


@needs_cpu_scaled_mm
@pytest.mark.parametrize("gran", ["per_tensor", "per_row"])
@pytest.mark.parametrize("mode", [m for m in FP8_COMPUTE_MODES if m != "off"])
@pytest.mark.parametrize("bias", [True, False])
def test_fp8_modes_match_the_dequantized_matmul(gran, mode, bias):
    lin, q = _layer(gran, bias)
    x = torch.randn(2, 40, 256, dtype=torch.bfloat16)
    slow = q(x)                                                      # CPU: dequantize path
    fast = scaled_mm_linear(x, q.weight, q.weight_scale, q.granularity, q.bias, mode)
    assert fast.shape == slow.shape == (2, 40, 96) and fast.dtype == torch.bfloat16
    assert sqnr(slow.float(), fast.float()) > 25.0                  # only the activation's fp8 rounding differs
    assert sqnr(lin(x).float(), fast.float()) > 24.0


@needs_cpu_scaled_mm
@pytest.mark.parametrize("mode", [m for m in FP8_COMPUTE_MODES if m != "off"])
def test_a_column_major_activation_reaches_the_gemm_row_major(mode, monkeypatch):
    """CUDA's _scaled_mm rejects a column-major first operand (the CPU one accepts it), and a failed call turns fp8
    compute off for the device: an activation that is a transposed view must be made row-major first."""
    _, q = _layer("per_row", True)
    x = torch.randn(256, 40, dtype=torch.bfloat16).t()              # (40, 256), strides (1, 40)
    seen, real = [], torch._scaled_mm
    monkeypatch.setattr(torch, "_scaled_mm", lambda a, *args, **kw: (seen.append(a.is_contiguous()), real(a, *args,
                                                                                                       **kw))[1])
    y = scaled_mm_linear(x, q.weight, q.weight_scale, q.granularity, q.bias, mode)
    assert seen == [True] and sqnr(q(x.contiguous()).float(), y.float()) > 25.0


@needs_cpu_scaled_mm
def test_tensorwise_survives_an_outlier_token():
    _, q = _layer("per_row")
    x = torch.randn(64, 256, dtype=torch.bfloat16)
    x[3, 7] = 3.0e4                                                  # one huge activation sets the scale
    y = scaled_mm_linear(x, q.weight, q.weight_scale, q.granularity, q.bias, "tensorwise")
    assert torch.isfinite(y).all()
    # the outlier token itself stays accurate; rowwise keeps the other tokens accurate too
    ref = q(x).float()
    rowwise = scaled_mm_linear(x, q.weight, q.weight_scale, q.granularity, q.bias, "rowwise").float()
    assert sqnr(ref[3], y[3].float()) > 20.0
    assert sqnr(ref, rowwise) > sqnr(ref, y.float())


def test_unknown_mode_is_an_error():
    _, q = _layer("per_row")
    with pytest.raises(ValueError, match="tensorwise"):
        scaled_mm_linear(torch.randn(4, 256, dtype=torch.bfloat16), q.weight, q.weight_scale, q.granularity,
                         q.bias, "columnwise")


def test_auto_mode_follows_the_default_and_the_environment(monkeypatch):
    _, q = _layer("per_row")
    monkeypatch.delenv("LEVERS_FP8_COMPUTE", raising=False)
    assert q._fp8_mode() == qlinear.DEFAULT_FP8_COMPUTE
    monkeypatch.setenv("LEVERS_FP8_COMPUTE", "rowwise")
    assert q._fp8_mode() == "rowwise"
    monkeypatch.setenv("LEVERS_FP8_COMPUTE", "nonsense")
    assert q._fp8_mode() == "off"                                    # never a crash in the forward
    q.fp8_compute = "tensorwise"                                     # per layer beats the environment
    assert q._fp8_mode() == "tensorwise" and q.use_fp8_compute
    q.use_fp8_compute = False
    assert q.fp8_compute == "off"
    assert not q._fp8_fast_path(torch.randn(4, 256, dtype=torch.bfloat16))   # CPU input: never the fp8 GEMM


def test_a_gemm_mode_the_gpu_lacks_falls_back_once_instead_of_failing_the_forward(monkeypatch):
    """Some torch builds have no rowwise fp8 GEMM for a GPU (sm_89 / sm_120 in some releases): the forward falls
    back to tensorwise, then to the dequantized matmul, remembers the failure per device (the failing kernel is
    not tried again) and says so in fp8_mode_failures(). An out-of-memory error is not a missing kernel."""
    import comfyui_levers.core.quant.fp8 as fp8

    lin, q = _layer("per_row")
    x = torch.randn(4, 256, dtype=torch.bfloat16)
    ref = torch.nn.functional.linear(x, q.dequantize(x.dtype, x.device), q.bias)
    calls: list[str] = []
    broken = {"rowwise"}

    def fake_scaled_mm_linear(x_, codes, scale, gran, bias, mode="tensorwise"):
        calls.append(mode)
        if mode in broken:
            raise RuntimeError(f"{mode} scaling is not currently supported on your device")
        return torch.full((x_.shape[0], codes.shape[0]), 7.0, dtype=x_.dtype)
    monkeypatch.setattr(fp8, "scaled_mm_linear", fake_scaled_mm_linear)
    monkeypatch.setattr(QuantLinear, "_fp8_fast_path", lambda self, x_: True)
    monkeypatch.setattr(qlinear, "_FP8_MODE_FAILED", {})
    q.fp8_compute = "rowwise"
    assert torch.equal(q(x), torch.full((4, 96), 7.0, dtype=torch.bfloat16))     # tensorwise answered
    assert calls == ["rowwise", "tensorwise"]
    q(x)
    assert calls == ["rowwise", "tensorwise", "tensorwise"]                      # rowwise not tried again
    assert "rowwise@cpu" in qlinear.fp8_mode_failures()
    broken.add("tensorwise")
    assert torch.equal(q(x), ref) and calls[-1] == "tensorwise"                  # then the dequantized matmul
    assert torch.equal(q(x), ref) and len(calls) == 4
    monkeypatch.setattr(qlinear, "_FP8_MODE_FAILED", {})

    def oom(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory")
    monkeypatch.setattr(fp8, "scaled_mm_linear", oom)
    with pytest.raises(torch.OutOfMemoryError):
        q(x)
    assert not qlinear.fp8_mode_failures()
