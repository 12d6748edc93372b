"""Tiny random-weight models that ComfyUI's stock loaders accept (no downloads).

Builders take ComfyUI's own classes, so the files match what the running ComfyUI expects.
"""
from __future__ import annotations

import math
import os

import torch


def fill_random_(state_dict: dict, seed: int) -> dict:
    """Fill every tensor deterministically (ComfyUI's ops do not initialise weights).

    Norm scales are ~1, biases small, weights ~N(0, 1/fan_in) so activations stay O(1).
    """
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in sorted(state_dict.items()):
        shape = tuple(t.shape)
        if not t.is_floating_point():
            out[name] = t.clone()
            continue
        leaf = name.rsplit(".", 1)[-1]
        is_norm = "norm" in name or leaf in ("gamma",) or (leaf == "weight" and len(shape) == 1)
        if is_norm:
            v = 1.0 + 0.05 * torch.randn(shape, generator=g)
        elif leaf == "bias" or len(shape) <= 1:
            v = 0.02 * torch.randn(shape, generator=g)
        else:
            fan_in = math.prod(shape[1:]) if len(shape) > 1 else shape[0]
            v = torch.randn(shape, generator=g) / math.sqrt(max(1, fan_in))
        out[name] = v.to(torch.float32).contiguous()
    return out


def tiny_wan_dit_state_dict(dim: int = 256, ffn_dim: int = 512, num_layers: int = 4, seed: int = 0) -> dict:
    """A Wan 2.1 t2v DiT; UNETLoader detects dim from head.modulation (num_heads = dim // 128)."""
    import comfy.ldm.wan.model as wan
    import comfy.ops

    m = wan.WanModel(model_type="t2v", patch_size=(1, 2, 2), text_len=512, in_dim=16, dim=dim, ffn_dim=ffn_dim,
                     freq_dim=256, text_dim=4096, out_dim=16, num_heads=dim // 128, num_layers=num_layers,
                     operations=comfy.ops.disable_weight_init, device="meta")
    shapes = {k: torch.empty(v.shape, dtype=torch.float32) for k, v in m.state_dict().items()}
    return fill_random_(shapes, seed)


def wan_vae_loader_reads_width() -> bool:
    """Whether this ComfyUI's VAE loader reads a Wan 2.1 VAE's width from ``decoder.head.0.gamma`` (0.3.7x on);
    0.3.64 builds every Wan 2.1 VAE at the released width, 96."""
    import inspect

    import comfy.sd

    return "decoder.head.0.gamma" in inspect.getsource(comfy.sd.VAE.__init__)


def tiny_wan_vae_state_dict(dim: int | None = None, seed: int = 1) -> dict:
    """A Wan 2.1 VAE, width 16 where VAELoader reads the width, else the released 96 (four convolutions of 384
    channels at the middle: a few seconds a decode on a CPU, still random weights)."""
    import inspect

    import comfy.ldm.wan.vae as wanvae

    if dim is None:
        dim = 16 if wan_vae_loader_reads_width() else 96
    kwargs = dict(dim=dim, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                  temperal_downsample=[False, True, True], dropout=0.0)
    if "image_channels" in inspect.signature(wanvae.WanVAE.__init__).parameters:
        kwargs["image_channels"] = 3
    with torch.device("meta"):
        m = wanvae.WanVAE(**kwargs)
    shapes = {k: torch.empty(v.shape, dtype=torch.float32) for k, v in m.state_dict().items()}
    return fill_random_(shapes, seed)


def save(state_dict: dict, path: str) -> str:
    from safetensors.torch import save_file

    os.makedirs(os.path.dirname(path), exist_ok=True)
    save_file(state_dict, path)
    return path


def save_gguf(state_dict: dict, path: str, arch: str, seed: int = 0) -> dict:
    """Write ``state_dict`` as a GGUF file ComfyUI-GGUF's loader reads (needs the ``gguf`` package). 2-D weights
    whose rows hold whole 32-value blocks are quantized, alternately Q8_0 and Q4_0 (the commonest GGUF formats);
    others are stored F32 (1-D, or few values) or F16 with their shape in the loader's ``orig_shape`` field.
    Returns {key: quantization type name}."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(path=None, arch=arch)
    kinds, n_quant = {}, 0
    for key, t in state_dict.items():
        a = t.float().numpy()
        if a.ndim == 2 and a.shape[1] % 32 == 0 and a.size >= 1024:
            q = (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0)[n_quant % 2]
            n_quant += 1
            writer.add_tensor(key, gguf.quants.quantize(a, q), raw_dtype=q)
        elif a.ndim <= 1 or a.size < 1024:
            q = gguf.GGMLQuantizationType.F32
            writer.add_tensor(key, a.astype(np.float32))
        else:
            q = gguf.GGMLQuantizationType.F16
            writer.add_array(f"comfy.gguf.orig_shape.{key}", [int(x) for x in a.shape])
            writer.add_tensor(key, a.astype(np.float16))
        kinds[key] = q.name
    writer.write_header_to_file(path=path)
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return kinds


FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def double_slots_transport():
    """A CPU transport whose copies into GroupPrefetch's slots land with every floating-point value doubled. On a
    CPU a block that read its host copy instead of its slot would compute the same output; with this transport the
    output must be that of the model with every block tensor doubled (``double_blocks``). Doubling is exact, and
    unlike zeros it cannot be hidden behind a zeroed gate."""
    from comfyui_levers.core.residency.transport import CpuTransport

    class DoubleSlots(CpuTransport):
        def copy_to_device(self, src, dst=None, tag=""):
            out = super().copy_to_device(src, dst, tag)
            return out.mul_(2) if tag.startswith("group") and out.dtype in FLOATS else out
    return DoubleSlots()


def double_blocks(model) -> None:
    """Double every floating-point tensor in the diffusion model's blocks, in place (the reference for
    ``double_slots_transport``). ``model`` is a ModelPatcher."""
    from comfyui_levers.core.residency.blocks import find_blocks

    with torch.no_grad():
        for _, block in find_blocks(model.model).blocks:
            for t in [*block.parameters(), *block.buffers()]:
                if t.dtype in FLOATS:
                    t.mul_(2)
