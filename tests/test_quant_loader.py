"""Load Quantized DiT's ComfyUI-free helpers on plain torch modules: exact codes, meta build, RAM peak, errors."""
from __future__ import annotations

import gc
import json
import sys

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from comfyui_levers.bridge import quant_loader as ql
from comfyui_levers.core.errors import BackendUnavailable, ConfigError
from comfyui_levers.core.quant import QuantConfig
from comfyui_levers.core.quant import checkpoint as ckpt
from comfyui_levers.core.quant.linear import QuantLinear, quantize_model


class Block(nn.Module):
    def __init__(self, d, ffn):
        super().__init__()
        self.self_attn = nn.ModuleDict({n: nn.Linear(d, d) for n in ("q", "k", "v", "o")})
        self.norm = nn.LayerNorm(d)
        self.ffn = nn.Sequential(nn.Linear(d, ffn), nn.GELU(), nn.Linear(ffn, d))

    def forward(self, x):
        a = self.self_attn
        x = x + a["o"](a["q"](x) * torch.sigmoid(a["k"](x)) + a["v"](x))
        return x + self.ffn(self.norm(x))


class ToyDiT(nn.Module):
    """Wan-like names so the census quantizes the blocks' attention and MLP matrices."""

    def __init__(self, d=128, ffn=256, depth=3):
        super().__init__()
        self.patch_embedding = nn.Linear(16, d)
        self.blocks = nn.ModuleList(Block(d, ffn) for _ in range(depth))
        self.head = nn.Linear(d, 16)

    def forward(self, x):
        x = self.patch_embedding(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _toy(dtype=torch.bfloat16, **kw):
    torch.manual_seed(0)
    return ToyDiT(**kw).to(dtype)


def _files(tmp_path, module, config):
    src, dst = str(tmp_path / "src.safetensors"), str(tmp_path / f"q-{config.format}.safetensors")
    save_file({k: v.contiguous() for k, v in module.state_dict().items()}, src)
    ckpt.quantize_file(src, dst, config, measure=False)
    return src, dst


def _load(path, **kw):
    info = ql.inspect_file(path)
    plain, quantized = ql.read_quantized(info)
    with torch.device("meta"):
        module = ToyDiT(**kw).to(torch.bfloat16)
    left = ql.install_quantized(module, quantized, plain, lambda qw, b: QuantLinear(qw, b))
    return module, info, left


@pytest.mark.parametrize("fmt,gran", [("int8", "per_row"), ("nf4", "per_block"), ("fp8_e4m3fn", "per_row"),
                                      ("fp8_e4m3fn", "per_block"), ("fp8_e4m3fn", "per_tensor")])
def test_loaded_module_holds_the_files_codes_and_matches_in_memory_quantization(tmp_path, fmt, gran):
    module = _toy()
    config = QuantConfig(fmt, gran)
    _, dst = _files(tmp_path, module, config)
    loaded, info, left = _load(dst)
    assert left == []
    assert info.kind == ("comfy_fp8" if gran == "per_tensor" else "levers") and len(info.layers) == 18
    ref, _ = quantize_model(module, config)  # what QuantizeDiT holds in memory
    want, got = ref.state_dict(), loaded.state_dict()
    assert set(want) == set(got)
    for k in want:
        assert want[k].dtype == got[k].dtype and torch.equal(want[k], got[k]), k
    x = torch.randn(2, 5, 16, dtype=torch.bfloat16)
    assert torch.equal(loaded(x), ref(x))
    assert sum(isinstance(m, QuantLinear) for m in loaded.modules()) == 18


def test_kept_tensors_cast_to_the_declared_dtype_and_meta_leftovers_reported(tmp_path):
    module = _toy()
    _, dst = _files(tmp_path, module, QuantConfig("int8"))
    info = ql.inspect_file(dst)
    plain, quantized = ql.read_quantized(info)
    with torch.device("meta"):
        target = ToyDiT().float()  # the loader chose fp32 for the kept weights
        target.register_buffer("freqs", torch.ones(4), persistent=False)  # computed at construction
    left = ql.install_quantized(target, quantized, plain, lambda qw, b: QuantLinear(qw, b))
    assert left == ["freqs"]
    assert target.head.weight.dtype == torch.float32
    assert torch.equal(target.head.weight, module.head.weight.float())
    assert target.blocks[0].ffn[0].bias.dtype == torch.float32  # a quantized layer's bias follows the model


def test_shape_mismatch_names_the_layer(tmp_path):
    _, dst = _files(tmp_path, _toy(), QuantConfig("int8"))
    info = ql.inspect_file(dst)
    plain, quantized = ql.read_quantized(info)
    with torch.device("meta"):
        other = ToyDiT(ffn=512)
    with pytest.raises(ql.IncompatibleInput, match="blocks.0.ffn.0"):
        ql.install_quantized(other, quantized, plain, lambda qw, b: QuantLinear(qw, b))


def test_report_sizes(tmp_path):
    module = _toy()
    src, dst = _files(tmp_path, module, QuantConfig("nf4"))
    plain_info, info = ql.inspect_file(src), ql.inspect_file(dst)
    assert plain_info.kind == "plain" and plain_info.bf16_bytes() == plain_info.disk_bytes  # source is bf16
    assert info.bf16_bytes() == plain_info.disk_bytes
    assert info.unquantized_bytes() == plain_info.disk_bytes  # bf16 source: the same number
    assert info.disk_bytes < 0.5 * info.bf16_bytes()
    assert info.formats == ["nf4 per_block (block 64): 18 layers"]


def test_not_a_safetensors_names_the_file(tmp_path):
    bad = tmp_path / "model.safetensors"
    bad.write_bytes(b"\x80\x02}q\x00(X\x05" * 10)  # a pickle, not a safetensors
    with pytest.raises(ConfigError, match="model.safetensors.*no safetensors header"):
        ql.inspect_file(str(bad))
    with pytest.raises(ConfigError, match="no such file"):
        ql.inspect_file(str(tmp_path / "missing.safetensors"))


def test_unknown_format_tag_is_a_clear_error(tmp_path):
    tag = list(json.dumps({"format": "int3", "granularity": "per_row", "block_size": 64, "shape": [4, 4]}).encode())
    path = str(tmp_path / "odd.safetensors")
    save_file({"blocks.0.q.weight": torch.zeros(4, 4, dtype=torch.int8),
               "blocks.0.q.weight_scale": torch.ones(4, 1),
               "blocks.0.q.levers_quant": torch.tensor(tag, dtype=torch.uint8)}, path)
    with pytest.raises(ConfigError, match="odd.safetensors.*int3.*levers quantize"):
        ql.inspect_file(path)


def test_missing_bitsandbytes_for_nf4_names_file_and_fix(tmp_path, monkeypatch):
    _, dst = _files(tmp_path, _toy(), QuantConfig("nf4"))
    info = ql.inspect_file(dst)
    from comfyui_levers.core.quant import nf4
    monkeypatch.setattr(nf4.Nf4Quantizer, "available", classmethod(lambda cls: (False, "bitsandbytes is not installed")))
    with pytest.raises(BackendUnavailable, match="q-nf4.safetensors.*pip install bitsandbytes"):
        ql.require_backends(info)


def test_truncated_file_is_reported(tmp_path):
    _, dst = _files(tmp_path, _toy(), QuantConfig("int8"))
    data = open(dst, "rb").read()
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(data[: len(data) - 1000])
    with pytest.raises(ConfigError, match="truncated"):
        ql.inspect_file(str(cut))


def _rewrite(path, out, edit_header=None, edit_data=None):
    """A copy of the safetensors file ``path`` with its header (dict) or data (bytearray) edited in place."""
    import struct

    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    header, data = json.loads(raw[8:8 + n]), bytearray(raw[8 + n:])
    if edit_header:
        edit_header(header)
    if edit_data:
        edit_data(header, data)
    b = json.dumps(header).encode()
    b += b" " * (-len(b) % 8)
    with open(out, "wb") as f:
        f.write(struct.pack("<Q", len(b)) + b + bytes(data))
    return str(out)


def test_damaged_headers_and_tags_name_the_file_and_the_fix(tmp_path):
    """Found in review: a header whose byte range disagrees with the shape, a layer without its scale, and a tag that
    is not JSON raised a bare RuntimeError, KeyError or UnicodeDecodeError with no file name."""
    _, dst = _files(tmp_path, _toy(), QuantConfig("int8"))
    header = json.loads(open(dst, "rb").read()[8:8 + int.from_bytes(open(dst, "rb").read()[:8], "little")])
    layer = next(k[:-len(".levers_quant")] for k in header if k.endswith(".levers_quant"))
    kept = next(k for k, e in header.items() if k != "__metadata__" and e["dtype"] in ("BF16", "F32")
                and len(e["shape"]) == 1)

    def shape(h):
        h[kept]["shape"] = [h[kept]["shape"][0] - 1]

    def scale(h):
        del h[f"{layer}.weight_scale"]

    def garbage(h, data):
        a = h[f"{layer}.levers_quant"]["data_offsets"][0]
        data[a:a + 2] = b"\xff\xfe"
    cases = {"bad_shape": (dict(edit_header=shape), "holds .* bytes where its shape"),
             "no_scale": (dict(edit_header=scale), "without their weight_scale"),
             "bad_tag": (dict(edit_data=garbage), "is not a JSON tag")}
    for name, (edit, why) in cases.items():
        path = _rewrite(dst, tmp_path / f"{name}.safetensors", **edit)
        with pytest.raises(ConfigError, match=f"{name}.safetensors.*{why}"):
            ql.read_quantized(ql.inspect_file(path))


# ----------------------------------------------------------------------------------- host memory peak
def _vm(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def _peak_rise(fn):
    """(result, rise of the resident-set high-water mark while ``fn`` runs). Linux: clear_refs resets VmHWM."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _vm("VmRSS")
    out = fn()
    return out, _vm("VmHWM") - base


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self (Linux) for the RSS peak")
def test_host_ram_peak_is_the_quantized_size_not_bf16(tmp_path):
    import ctypes
    import ctypes.util

    # glibc: serve >= 1 MiB allocations with mmap, so freed memory leaves the resident set and an
    # earlier test's retained heap cannot absorb this load's allocations (which would hide them)
    ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt(-3, 1 << 20)
    kw = dict(d=1024, ffn=2048, depth=4)  # 32 M params: 64 MiB in bf16
    module = _toy(**kw)
    src, dst = _files(tmp_path, module, QuantConfig("int8"))
    del module
    info = ql.inspect_file(dst)
    bf16 = info.bf16_bytes()
    assert bf16 > 60 * 2 ** 20

    loaded, rise = _peak_rise(lambda: _load(dst, **kw)[0])
    held = sum(t.numel() * t.element_size() for t in loaded.state_dict().values())
    assert held < 0.55 * bf16
    print(f"peak rise {rise / 2**20:.1f} MiB, held {held / 2**20:.1f} MiB, bf16 {bf16 / 2**20:.1f} MiB")
    assert rise < held + 0.1 * bf16, (rise, held, bf16)   # codes + kept tensors, no bf16 copy on the way
    del loaded
    # the probe sees a bf16 load: ComfyUI's usual path (build in bf16, copy weights in) peaks above bf16
    from safetensors.torch import load_file

    def bf16_load():
        m = ToyDiT(**kw).to(torch.bfloat16)
        m.load_state_dict(load_file(src))
        return m

    _, rise_bf16 = _peak_rise(bf16_load)
    print(f"bf16 load peak rise {rise_bf16 / 2**20:.1f} MiB")
    assert rise_bf16 > 0.9 * bf16 > rise
