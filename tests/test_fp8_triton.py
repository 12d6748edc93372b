"""The fused per-token fp8 activation quantizer (core/quant/fp8_triton.py).

On the CPU the Triton kernel runs under TRITON_INTERPRET=1 in a child process. The interpreter
rounds fp32 -> fp8 wrongly where rounding carries into the exponent (124.6 -> 64 instead of 128),
so the CPU test feeds rows whose scaled values sit exactly on the fp8 grid: it checks the
kernel's indexing, masking, strides, abs-max, scale and clamp, not the hardware's rounding. On
CUDA the kernel must match the eager fallback bit for bit."""
from __future__ import annotations


import pytest
import torch

from comfyui_levers.core.quant.fp8_triton import quantize_rows_fp8
from triton_interp import needs_triton, run_interpreted



def test_eager_fallback_scales_rows_and_clamps():
    x = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0], [448.0, 1e-3, -3.0]], dtype=torch.bfloat16)
    q, s = quantize_rows_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (3, 1) and s.dtype == torch.float32
    assert torch.allclose(s[:, 0], torch.tensor([2.0 / 448, 1e-12, 1.0]))
    assert q.float().abs().amax(dim=1).tolist() == [448.0, 0.0, 448.0]     # each row's max maps to 448
    assert torch.allclose(q.float() * s, x.float(), rtol=0.07, atol=1e-3)


@needs_triton
def test_kernel_under_the_interpreter_matches_on_grid_values():
    run_interpreted("""
        import torch
        from comfyui_levers.core.quant import fp8_triton as ft
        g = torch.Generator().manual_seed(0)
        grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
        grid = grid[torch.isfinite(grid)]
        rows, cols = 21, 300                       # cols not a power of two: the mask matters
        codes = grid[torch.randint(len(grid), (rows, cols), generator=g)]
        codes[:, 5] = 448.0                        # every row's abs-max is exactly 448
        scale = torch.pow(2.0, torch.randint(-8, 4, (rows, 1), generator=g).float())
        x = (codes * scale).to(torch.float32)      # exact: powers of two
        wide = torch.zeros(rows, cols + 9)
        wide[:, :cols] = x
        q, s = ft._launch(wide[:, :cols])          # a strided view: row stride != cols
        assert torch.equal(s, scale), (s[:3], scale[:3])
        assert torch.equal(q.float(), codes)
        print("OK")
    """)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_kernel_matches_the_eager_fallback_bit_for_bit():
    from comfyui_levers.core.quant import fp8_triton as ft
    if not ft.triton_rows_available(torch.zeros(1, 8, device="cuda")):
        pytest.skip("Triton unavailable on this CUDA machine")
    torch.manual_seed(0)
    for cols in (3072, 12288, 15360, 300):
        x = (torch.randn(517, cols, device="cuda") * torch.rand(517, 1, device="cuda") * 8).bfloat16()
        x[3, 7] = 900.0
        q, s = ft._launch(x)
        amax = x.float().abs().amax(dim=1, keepdim=True)
        # tensor / tensor: IEEE division (a Python-scalar divisor multiplies by its reciprocal on CUDA)
        s_ref = (amax / torch.full_like(amax, 448.0)).clamp_min(1e-12)
        q_ref = (x.float() / s_ref).clamp(-448, 448).to(torch.float8_e4m3fn)
        assert torch.equal(s, s_ref), cols
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)), cols


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_kernel_addresses_rows_past_2_to_the_31_elements():
    """HunyuanVideo 720p x 129 frames with cond + uncond batched feeds ~3.7e9 elements to one linear: row offsets
    must be 64-bit (they were int32 and would wrap)."""
    from comfyui_levers.core.quant import fp8_triton as ft
    if not ft.triton_rows_available(torch.zeros(1, 8, device="cuda")):
        pytest.skip("Triton unavailable on this CUDA machine")
    cols = 15360
    rows = (2 ** 31) // cols + 64                       # the last rows start past element 2**31
    if torch.cuda.mem_get_info()[0] < rows * cols * 4 + (1 << 30):
        pytest.skip("not enough free GPU memory for 2**31 elements")
    x = torch.zeros(rows, cols, device="cuda", dtype=torch.bfloat16)
    x[-1] = torch.linspace(-3, 5, cols, device="cuda").bfloat16()
    q, s = ft._launch(x)
    assert float(s[-1]) == pytest.approx(5.0 / 448.0, rel=1e-6)
    assert torch.equal(q[-1].float(), (x[-1].float() / s[-1]).clamp(-448, 448).to(torch.float8_e4m3fn).float())
    assert float(s[0]) == pytest.approx(1e-12)           # an all-zero row: the scale's floor
