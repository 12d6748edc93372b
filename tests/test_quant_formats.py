"""Formats, the layer and the model-level entry points, on CPU against float references."""
from __future__ import annotations

import math
import subprocess
import sys
import zlib

import pytest
import torch
from torch import nn

from comfyui_levers.core.errors import BackendUnavailable, ConfigError
from comfyui_levers.core.quant import (Granularity, QuantConfig, QuantLinear, get_quantizer, is_quantized_module,
                                       iter_quant_layers, quantize_model, quantize_module, quantized_nbytes, sqnr,
                                       weight_bytes_for)
from comfyui_levers.core.types import Precision


def heavy_tailed(out=256, inp=1024, df=5.0, seed=0, dtype=torch.bfloat16):
    """Student-t weights: outliers like real DiT matrices, unlike a Gaussian."""
    g = torch.Generator().manual_seed(seed)
    t = torch.distributions.StudentT(df)
    torch.manual_seed(seed)
    return (t.sample((out, inp)) * 0.02).to(dtype)


def roundtrip(fmt, gran=None, w=None, block=64):
    cfg = QuantConfig(fmt, gran, block_size=block)
    w = heavy_tailed() if w is None else w
    qw = get_quantizer(cfg.format).quantize(w, cfg.granularity, cfg.block_size)
    return w, qw, qw.dequantize(torch.float32)


@pytest.mark.parametrize("gran", ["per_tensor", "per_row", "per_block"])
def test_fp8_sqnr_and_clamp(gran):
    w, qw, d = roundtrip("fp8", gran)
    assert qw.tensors["weight"].dtype == torch.float8_e4m3fn
    assert sqnr(w, d) >= 30.0
    assert torch.isfinite(d).all()
    # the largest magnitude of every scale group maps to exactly ±448 (clamped, never NaN)
    assert qw.tensors["weight"].float().abs().max().item() == 448.0


def test_fp8_finer_scales_beat_per_tensor_on_outlier_rows():
    w = heavy_tailed()
    w[3] *= 3000  # one loud output channel: per-tensor pushes the other rows into fp8 subnormals
    per_tensor = sqnr(w[:3], roundtrip("fp8", "per_tensor", w)[2][:3])
    per_row = sqnr(w[:3], roundtrip("fp8", "per_row", w)[2][:3])
    assert per_row > per_tensor + 3.0


def test_fp8_zero_rows_do_not_produce_nan():
    w = heavy_tailed()
    w[0] = 0
    _, qw, d = roundtrip("fp8", "per_row", w)
    assert torch.isfinite(d).all() and (d[0] == 0).all()


@pytest.mark.parametrize("gran,threshold", [("per_row", 35.0), ("per_block", 38.0)])
def test_int8_sqnr(gran, threshold):
    w, qw, d = roundtrip("int8", gran)
    assert qw.tensors["weight"].dtype == torch.int8
    assert sqnr(w, d) >= threshold


def test_int8_matches_torchao_int8_weight_only():
    torchao = pytest.importorskip("torchao.quantization")
    w = heavy_tailed(64, 256).float()
    lin = nn.Linear(256, 64, bias=False)
    lin.weight.data.copy_(w)
    torchao.quantize_(lin, torchao.Int8WeightOnlyConfig())
    x = torch.randn(4, 256)
    ref = lin(x)
    _, qw, d = roundtrip("int8", "per_row", w)
    assert torch.allclose(x @ d.T, ref, rtol=1e-3, atol=1e-4)


def test_nf4_real_bitsandbytes_layout_and_reported_sqnr():
    bnbf = pytest.importorskip("bitsandbytes.functional")
    w, qw, d = roundtrip("nf4")
    packed, absmax = qw.tensors["weight"], qw.tensors["weight_scale"]
    assert packed.dtype == torch.uint8 and packed.shape == (w.numel() // 2, 1)
    assert absmax.shape == (w.numel() // 64,)
    ref_packed, ref_state = bnbf.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=False)
    assert torch.equal(packed, ref_packed)
    s = sqnr(w, d)
    assert 15.0 < s < 30.0  # nf4 is ~20 dB on Student-t weights: reported, not hidden


@pytest.mark.parametrize("fmt,gran", [("fp8", "per_tensor"), ("fp8", "per_row"), ("fp8", "per_block"),
                                      ("int8", "per_row"), ("int8", "per_block"), ("nf4", None)])
def test_weight_bytes_for_is_exact(fmt, gran):
    w, qw, _ = roundtrip(fmt, gran)
    cfg = QuantConfig(fmt, gran)
    assert weight_bytes_for([tuple(w.shape)], cfg.format, cfg.granularity) == qw.nbytes


def test_weight_bytes_for_documented_rates():
    n = 3072 * 3072
    assert weight_bytes_for([(3072, 3072)], "nf4") * 8 / n == pytest.approx(4.5)
    assert weight_bytes_for([(3072, 3072)], "fp8", "per_tensor") == n + 4
    assert weight_bytes_for([(3072, 3072)], "int8") == n + 4 * 3072
    assert weight_bytes_for([(3072, 3072)], "bf16") == 2 * n


@pytest.mark.parametrize("fmt,gran,min_db", [("fp8", "per_row", 28.0), ("int8", "per_row", 33.0), ("nf4", None, 14.0)])
def test_quant_linear_matches_dequantized_reference(fmt, gran, min_db):
    torch.manual_seed(0)
    lin = nn.Linear(1024, 256).to(torch.bfloat16)
    lin.weight.data.copy_(heavy_tailed())
    layer = QuantLinear.from_linear(lin, QuantConfig(fmt, gran))
    x = torch.randn(3, 7, 1024, dtype=torch.bfloat16)
    y = layer(x)
    assert y.shape == (3, 7, 256) and y.dtype == torch.bfloat16
    ref = torch.nn.functional.linear(x.float(), layer.dequantize(torch.float32), lin.bias.float())
    assert sqnr(ref, y) > 40.0  # the layer computes exactly dequant(W) x + b (up to bf16 rounding)
    assert sqnr(lin(x).float(), y) > min_db  # and is close to the unquantized layer


class TinyWanLike(nn.Module):
    """Names follow Wan so the census applies: embedder, 3 blocks, head."""

    def __init__(self, d=128, ffn=256):
        super().__init__()
        self.text_embedding = nn.Sequential(nn.Linear(64, d), nn.GELU(), nn.Linear(d, d))
        self.patch_embedding = nn.Conv3d(4, d, (1, 2, 2), stride=(1, 2, 2))
        self.blocks = nn.ModuleList()
        for _ in range(3):
            b = nn.Module()
            b.self_attn = nn.Module()
            for n in ("q", "k", "v", "o"):
                setattr(b.self_attn, n, nn.Linear(d, d))
            b.norm3 = nn.LayerNorm(d)
            b.ffn = nn.Sequential(nn.Linear(d, ffn), nn.GELU(approximate="tanh"), nn.Linear(ffn, d))
            b.modulation = nn.Parameter(torch.randn(1, 6, d) / d ** 0.5)
            self.blocks.append(b)
        self.head = nn.Module()
        self.head.head = nn.Linear(d, 16)

    def forward(self, x):
        h = self.text_embedding(x)
        for b in self.blocks:
            a = b.self_attn
            q, k, v = a.q(h), a.k(h), a.v(h)
            att = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1)
            h = h + a.o(att @ v)
            h = h + b.ffn(b.norm3(h)) * (1 + b.modulation[0, 0])
        return self.head.head(h)


def make_model(seed=0, dtype=torch.bfloat16):
    torch.manual_seed(seed)
    m = TinyWanLike()
    for name, p in m.named_parameters():
        if p.dim() == 2:
            p.data.copy_(heavy_tailed(*p.shape, seed=zlib.crc32(name.encode()) % 1000).float() * 2.5)
    return m.to(dtype).eval()


@pytest.mark.parametrize("fmt", ["fp8", "int8", "nf4"])
def test_quantize_model_leaves_input_bit_identical(fmt):
    m = make_model()
    x = torch.randn(2, 8, 64, dtype=torch.bfloat16)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    ref = m(x)
    qm, report = quantize_model(m, QuantConfig(fmt))
    assert qm is not m
    for k, v in m.state_dict().items():
        assert torch.equal(v, before[k]) and v.dtype == before[k].dtype, k
    assert torch.equal(m(x), ref)
    assert not is_quantized_module(m) and is_quantized_module(qm)
    names = {n for n, _ in iter_quant_layers(qm)}
    assert names == {f"blocks.{i}.{p}" for i in range(3) for p in ("self_attn.q", "self_attn.k", "self_attn.v",
                                                                      "self_attn.o", "ffn.0", "ffn.2")}
    # untouched tensors are shared, not copied
    assert qm.head.head.weight.data_ptr() == m.head.head.weight.data_ptr()
    assert qm.head.head.weight is not m.head.head.weight
    assert report.size_after == quantized_nbytes(qm)
    assert report.size_before == quantized_nbytes(m)
    assert report.size_after < report.size_before
    assert all(l.sqnr_db is not None and math.isfinite(l.sqnr_db) for l in report.layers)
    assert "QuantizeDiT" in report.format_text()


def test_model_output_close_to_bf16():
    m = make_model()
    x = torch.randn(2, 8, 64, dtype=torch.bfloat16)
    ref = m(x).float()
    scores = {}
    for fmt in ("fp8", "int8", "nf4"):
        qm, _ = quantize_model(m, QuantConfig(fmt))
        scores[fmt] = sqnr(ref, qm(x))
    assert scores["fp8"] > 25 and scores["int8"] > 25
    assert scores["nf4"] > 10
    assert scores["int8"] > scores["nf4"] and scores["fp8"] > scores["nf4"]


def test_moving_the_copy_does_not_move_the_original():
    m = make_model()
    qm, _ = quantize_model(m, QuantConfig("fp8"))
    qm.to(torch.float32)  # .to() rebinds param.data on the copy's own Parameter objects
    assert m.head.head.weight.dtype == torch.bfloat16
    assert m.blocks[0].norm3.weight.dtype == torch.bfloat16


def test_quantize_module_is_in_place_and_filter_fn_narrows():
    m = make_model()
    report = quantize_module(m, QuantConfig("fp8"), filter_fn=lambda name, mod: "ffn" in name)
    assert {l.name for l in report.layers} == {f"blocks.{i}.ffn.{j}" for i in range(3) for j in (0, 2)}
    assert isinstance(m.blocks[0].ffn[0], QuantLinear) and not isinstance(m.blocks[0].self_attn.q, QuantLinear)


def test_progress_callback_can_interrupt():
    m = make_model()

    class Stop(Exception):
        pass

    seen = []

    def progress(done, total):
        seen.append((done, total))
        if done == 2:
            raise Stop

    with pytest.raises(Stop):
        quantize_model(m, QuantConfig("fp8"), progress=progress)
    assert seen == [(1, 18), (2, 18)]


def test_config_validation_names_field_and_choices():
    with pytest.raises(ConfigError, match="granularity.*per_block"):
        QuantConfig("nf4", "per_row")
    with pytest.raises(ConfigError, match="format"):
        QuantConfig("bf16")
    with pytest.raises(ValueError, match="format: unknown precision 'int3'"):
        QuantConfig("int3")
    with pytest.raises(ConfigError, match="block_size"):
        QuantConfig("fp8", "per_block", block_size=48)
    with pytest.raises(ConfigError, match="keep_first_blocks"):
        QuantConfig("fp8", keep_first_blocks=-1)
    c = QuantConfig("e4m3", "row", extra_skip=" a, b ,")
    assert c.format == Precision.FP8_E4M3FN and c.granularity == Granularity.PER_ROW and c.extra_skip == ("a", "b")
    assert QuantConfig("nf4").granularity == Granularity.PER_BLOCK


def test_missing_backend_names_the_install(monkeypatch):
    from comfyui_levers.core.quant import nf4
    monkeypatch.setattr(nf4.Nf4Quantizer, "available", classmethod(lambda cls: (False, "bitsandbytes is not installed")))
    with pytest.raises(BackendUnavailable, match="pip install bitsandbytes"):
        quantize_model(make_model(), QuantConfig("nf4"))


def test_importing_core_quant_pulls_no_comfy_and_no_cuda():
    code = ("import sys, torch; import comfyui_levers.core.quant as q; q.get_quantizer('fp8'); "
            "q.census(['blocks.0.ffn.0.weight']); "
            "assert not [m for m in sys.modules if m.split('.')[0] in ('comfy', 'comfy_api', 'folder_paths')]; "
            "assert not torch.cuda.is_initialized(); print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
