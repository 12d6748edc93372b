"""How Recommend reads a connected diffusion model (bridge/recommend.py, no ComfyUI needed): weights it encodes,
bytes it holds, and whether it is already quantized, for QuantizeDiT's own layers and for quantized wrapper tensors.
The ComfyUI-side cases (an fp8 QuantizedTensor checkpoint, a GGUF file) are in tests/integration/test_recommend_node.py."""
from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

from comfyui_levers.bridge.recommend import _format, _hidden, _param_stats, _stored
from comfyui_levers.core.quant.linear import quantize_module
from comfyui_levers.core.quant.registry import QuantConfig
from comfyui_levers.core.residency.blocks import find_blocks

D = 256


class _Mod(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.lin = nn.Linear(D, n * D)


class _Double(nn.Module):
    """Flux-shaped double block: two modulation linears (6d each), attention and MLPs per stream."""

    def __init__(self):
        super().__init__()
        self.img_mod, self.txt_mod = _Mod(6), _Mod(6)
        self.img_attn = nn.ModuleDict({"qkv": nn.Linear(D, 3 * D), "proj": nn.Linear(D, D)})
        self.txt_attn = nn.ModuleDict({"qkv": nn.Linear(D, 3 * D), "proj": nn.Linear(D, D)})
        self.img_mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))
        self.txt_mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))


class _Single(nn.Module):
    def __init__(self):
        super().__init__()
        self.modulation = _Mod(3)
        self.linear1 = nn.Linear(D, 7 * D)
        self.linear2 = nn.Linear(5 * D, D)


class _Flux(nn.Module):
    def __init__(self):
        super().__init__()
        self.img_in = nn.Linear(64, D)
        self.double_blocks = nn.ModuleList(_Double() for _ in range(2))
        self.single_blocks = nn.ModuleList(_Single() for _ in range(4))
        self.final_layer = nn.Linear(D, 64)


def _flux():
    torch.manual_seed(0)
    return _Flux().to(torch.bfloat16)


def test_a_plain_model_is_not_taken_for_a_quantized_one():
    m = _flux()
    params, nbytes, labels = _param_stats(m)
    assert params == sum(p.numel() for p in m.parameters()) and nbytes == 2 * params
    assert labels == {"bfloat16": nbytes}
    assert _stored(m, [b for _, b in find_blocks(m).blocks]) == {}
    assert _hidden(m) == D


@pytest.mark.parametrize("fmt,lib", [("fp8_e4m3fn", None), ("int8", "torchao"), ("nf4", "bitsandbytes")])
def test_quantizedit_layers_count_the_weights_they_encode_and_are_planned_as_stored(fmt, lib):
    """QuantizeDiT keeps the modulation linears in 16-bit by default: in bytes they outweigh 4-bit block linears,
    in weights they do not. nf4 packs two codes per byte into an (out*in/2, 1) tensor: its shape is not the layer's."""
    if lib is not None and importlib.util.find_spec(lib) is None:
        pytest.skip(f"{fmt} needs {lib}")
    m = _flux()
    logical = sum(p.numel() for p in m.parameters())
    quantize_module(m, QuantConfig(format=fmt), arch="flux", measure=False)
    params, nbytes, labels = _param_stats(m)
    assert params == logical
    assert nbytes == sum(t.numel() * t.element_size() for t in [*m.parameters(), *m.buffers()])
    stored = _stored(m, [b for _, b in find_blocks(m).blocks])
    assert stored["dit_stored_precision"] == fmt and stored["dit_stored_bytes"] == nbytes, stored
    assert stored["dit_stored"].endswith("(Levers)")
    assert _hidden(m) == D


class _Packed4(torch.Tensor):
    """A 4-bit wrapper subclass like ComfyUI's NVFP4 layout: packed uint8 codes plus fp8 block scales."""

    @staticmethod
    def __new__(cls, codes, scales, shape):
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=torch.bfloat16, device=codes.device)

    def __init__(self, codes, scales, shape):
        self._codes, self._scales = codes, scales

    def __tensor_flatten__(self):
        return ["_codes", "_scales"], None

    @staticmethod
    def __tensor_unflatten__(inner, ctx, size, stride):
        return _Packed4(inner["_codes"], inner["_scales"], size)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(f"{func} (only its layout matters here)")


def test_a_4bit_wrapper_with_fp8_scales_is_4bit_not_fp8():
    out, inp = 64, 128
    w = _Packed4(torch.zeros(out * inp // 2, dtype=torch.uint8), torch.zeros(out * inp // 16, dtype=torch.float8_e4m3fn),
                 (out, inp))
    assert _format("weight", w) == ("4-bit (_Packed4)", "nf4")
    fp8 = torch.zeros(out, inp, dtype=torch.float8_e4m3fn)
    assert _format("weight", fp8) == ("fp8", "fp8_e4m3fn")
    assert _format("weight", torch.zeros(out, inp, dtype=torch.uint8)) is None   # a plain byte buffer is not a weight


def _patcher(dm):
    """What Recommend reads of a ComfyUI MODEL: ``clone`` and ``model.diffusion_model``."""
    from types import SimpleNamespace

    return SimpleNamespace(clone=lambda: None, model=SimpleNamespace(diffusion_model=dm))


def test_a_second_expert_is_planned_one_at_a_time_with_both_in_host_ram():
    from comfyui_levers.bridge.recommend import measure
    from comfyui_levers.core.plan import Workload, plan
    from comfyui_levers.core.probe import synthetic_machine
    from comfyui_levers.core.types import Residency

    high, low = _patcher(_flux()), _patcher(_flux())
    one, _ = measure(high)
    two, notes = measure(high, model_2=low)
    assert one.experts == 1 and two.experts == 2
    assert two.dit_params == one.dit_params and two.family == one.family == "flux"
    assert any("second expert" in n for n in notes)
    m = synthetic_machine(vram_gb=24, ram_gb=256, h2d_gbps=25)
    a, b = plan(one, Workload(1024, 1024), m), plan(two, Workload(1024, 1024), m)
    # one resident model keeps no host copy; two experts keep a host master each
    assert a.diffusion_model.residency is Residency.RESIDENT
    assert b.host_bytes - a.host_bytes == 2 * b.diffusion_model.weight_bytes
    assert not any("larger" in n for n in notes), "experts of the same size: neither is the larger"
    # the larger expert sets the plan (here: the second, in fp32): every measured number is its own
    larger = _patcher(_Flux())
    big, notes = measure(high, model_2=larger)
    alone, _ = measure(larger)
    assert big.experts == 2 and big.dit_dtype_bytes == 4 and any("larger" in n for n in notes)
    for f in ("dit_params", "dit_kept_params", "modulation_params", "block_fraction", "dit_dtype_bytes", "hidden",
              "n_blocks", "dit_stored_bytes", "name"):
        assert getattr(big, f) == getattr(alone, f), f

    # a second model that is not another expert of the same family is left out, with a note
    other, notes = measure(high, model_2=_patcher(nn.Sequential(nn.Linear(D, D))))
    assert other.experts == 1 and any("not a second flux expert" in n for n in notes)
    # the same model twice is one model; model_2 alone is the model
    same, notes = measure(high, model_2=_patcher(high.model.diffusion_model))
    assert same.experts == 1 and any("same diffusion model" in n for n in notes)
    alone, notes = measure(model_2=low)
    assert alone.experts == 1 and alone.dit_params == one.dit_params and any("without model" in n for n in notes)


def test_a_second_input_that_is_not_a_model_names_model_2():
    from comfyui_levers.bridge.recommend import measure
    from comfyui_levers.core.errors import IncompatibleInput

    with pytest.raises(IncompatibleInput, match="model_2"):
        measure(_patcher(_flux()), model_2="a string")


def test_the_ram_the_connected_models_hold_is_added_back_to_the_available_ram(monkeypatch, read_only, tmp_path):
    """Found in review: inside ComfyUI the available RAM is read when Recommend runs, after the loaders read the models
    into RAM (and after a run left PhaseOffload's masters pinned), while the plan counts those very bytes among the
    host copies it needs: they were counted twice, and a re-run could plan another precision. Their bytes are added
    back; weights in a read-only file mapping (0.33's memory-mapped loader, GGUF) are page cache the OS already
    counts as available, so they are not."""
    import dataclasses

    from comfyui_levers.bridge import recommend as R
    from comfyui_levers.core.probe import GiB, synthetic_machine
    from comfyui_levers.core.residency import transport

    base = dataclasses.replace(synthetic_machine(vram_gb=16, ram_gb=64, h2d_gbps=25), ram_available_bytes=10 * GiB)
    dit, te = nn.Linear(256, 256), nn.Linear(128, 128)
    held = sum(t.nbytes for m in (dit, te) for t in m.parameters())
    m = R.machine_for_comfy(base, modules=[dit, te, dit])             # a module connected twice counts once
    assert m.ram_available_bytes == 10 * GiB + held
    assert any("already hold" in n for n in m.notes)
    mapped = nn.Linear(256, 256)
    mapped.weight = nn.Parameter(read_only(mapped.weight.data), requires_grad=False)
    m = R.machine_for_comfy(base, modules=[mapped])
    assert m.ram_available_bytes == 10 * GiB + mapped.bias.nbytes      # the mapped weight is page cache
    # so is a private writable file mapping's unwritten weight (a loader's torch.load(mmap=True), safetensors' own)
    torch.save({"w": torch.randn(256, 256)}, tmp_path / "w.pt")
    private = nn.Linear(256, 256)
    private.weight = nn.Parameter(torch.load(tmp_path / "w.pt", mmap=True, weights_only=True)["w"],
                                  requires_grad=False)
    assert R.machine_for_comfy(base, modules=[private]).ram_available_bytes == 10 * GiB + private.bias.nbytes
    # masters Levers keeps pinned while the model is on the GPU count too
    monkeypatch.setattr(transport, "pinned_ranges_by_levers", lambda: [(12345, 3 * GiB)])
    assert R.machine_for_comfy(base).ram_available_bytes == 13 * GiB
    assert R.machine_for_comfy(base, modules=[]).ram_available_bytes <= base.ram_total_bytes
