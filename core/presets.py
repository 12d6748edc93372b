"""Model presets: parameter counts, block structure and how a workload becomes tokens.

Where a preset lists its blocks (FLUX, SD3.5, Wan, HunyuanVideo, Qwen-Image), the counts are those of ComfyUI's
model classes at the published shapes (``comfy/ldm``: every linear with its bias, qk-norm scales); the others are
the published sizes, rounded (seed 000's table). Inside ComfyUI, Recommend replaces them with numbers measured from
the connected models.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from .errors import ConfigError

B = 1e9


@dataclass(frozen=True)
class BlockKind:
    """One kind of repeated block, ``count`` of them in a row (execution order): the parameters of one block, and
    how its linears see the tokens. Modulation linears see one token (the conditioning vector). A dual-stream (MMDiT)
    block has separate weights per stream: image tokens pass only ``image_stream``, text tokens only
    ``text_stream``; whatever is left (``params - modulation - image_stream - text_stream``) every token passes."""

    count: int
    params: int
    modulation: int = 0
    image_stream: int = 0
    text_stream: int = 0


@dataclass(frozen=True)
class ModelSpec:
    """What the planner needs to know about one pipeline."""

    name: str
    family: str                      # flux | sdxl | sd3 | wan | hunyuan | qwen | ltxv | custom
    dit_params: float                # all diffusion-model parameters
    dit_kept_params: float           # parameters the census always keeps in 16-bit (embedders, final layer, norms)
    modulation_params: float         # adaLN / modulation linears: kept 16-bit by default, quantized when that is what fits
    hidden: int
    n_blocks: int
    block_fraction: float            # share of dit_params that sits in the repeated blocks
    te_params: float                 # all text-encoder parameters
    te_names: tuple[str, ...]
    te_hidden: int
    text_tokens: int
    vae_params: float
    latent_channels: int
    vae_spatial: int                 # pixels per latent cell
    vae_temporal: int                # frames per latent frame (1 for images)
    patch: int                       # latent cells per token edge
    patch_t: int = 1
    vae_bytes_per_px: int = 2048     # untiled decode activation peak per output pixel (fp32 feature maps)
    vae_causal: bool = False         # temporal chunks are exact with a carried feature cache (Wan, HunyuanVideo;
                                     # not LTX: ComfyUI's LTX decoder is non-causal and chunks time itself)
    vae_streamed: bool = False       # non-causal, but its temporal chunks are exact streamed (LTX: on ComfyUI
                                     # 0.8 TiledVAEDecode keeps each layer's context frames; 0.33 does it itself)
    is_video: bool = False
    experts: int = 1                 # Wan 2.2 A14B: two experts, one active at a time
    default_width: int = 1024
    default_height: int = 1024
    default_frames: int = 1
    default_steps: int = 28
    guidance_distilled: bool = False  # one DiT pass per step (no CFG batch)
    linear_fraction: float = 1.0     # share of token-wise FLOPs in linear layers (fp8 matmuls speed these up)
    dit_dtype_bytes: int = 2         # how the weights are stored (measured models may be fp8 / fp32 already)
    # a measured diffusion model that is already quantized (an fp8 checkpoint, a GGUF file, an earlier QuantizeDiT):
    # its real bytes, what it holds ("gguf Q4_K", "fp8 (QuantizedTensor)") and the Precision it is planned as
    dit_stored_bytes: int = 0
    dit_stored: str = ""
    dit_stored_precision: str = ""
    # the repeated blocks by kind, in execution order (FLUX: 19 double-stream, then 38 single-stream blocks); empty:
    # n_blocks blocks of equal size. Measured models keep their preset's kinds as proportions (Recommend measures
    # the block count and the blocks' share, not each kind)
    blocks: tuple[BlockKind, ...] = ()
    te_dtype_bytes: int = 2
    vae_dtype_bytes: int = 2
    measured: bool = False

    def latent_frames(self, frames: int) -> int:
        if not self.is_video:
            return 1
        return max(1, (max(1, frames) - 1) // self.vae_temporal + 1)

    def image_tokens(self, width: int, height: int, frames: int = 1) -> int:
        cells = math.ceil(width / self.vae_spatial / self.patch) * math.ceil(height / self.vae_spatial / self.patch)
        t = math.ceil(self.latent_frames(frames) / self.patch_t)
        return cells * t

    def tokens(self, width: int, height: int, frames: int = 1) -> int:
        """Sequence length of one DiT pass (image/video tokens + text tokens where they are joint)."""
        n = self.image_tokens(width, height, frames)
        if self.family in ("flux", "sd3", "hunyuan", "qwen", "wan"):
            n += self.text_tokens
        return n

    def output_pixels(self, width: int, height: int, frames: int = 1) -> int:
        return width * height * (max(1, frames) if self.is_video else 1)


# Helper to keep preset rows readable: (numbers in billions of parameters). A row that lists its blocks takes
# n_blocks, block_fraction and modulation_params from them.
def _spec(**kw) -> ModelSpec:
    for k in ("dit_params", "dit_kept_params", "modulation_params", "te_params", "vae_params"):
        if k in kw:
            kw[k] = kw[k] * B
    if kw.get("blocks"):
        kinds = kw["blocks"]
        kw.update(n_blocks=sum(k.count for k in kinds),
                  modulation_params=float(sum(k.count * k.modulation for k in kinds)),
                  block_fraction=sum(k.count * k.params for k in kinds) / kw["dit_params"])
    return ModelSpec(**kw)


def _linear(fan_in: int, fan_out: int) -> int:
    """Parameters of a linear layer with its bias."""
    return fan_in * fan_out + fan_out


def _dual_stream(count: int, h: int, head: int, mlp: int = 4, pre_only_text: bool = False) -> BlockKind:
    """``count`` MMDiT blocks (FLUX / HunyuanVideo double block, Qwen-Image, SD3): per stream a modulation h x 6h,
    q, k, v h x 3h, qk-norm scales, out h x h and an MLP h x mlp*h x h. SD3's last block keeps only the text stream's
    modulation h x 2h and q, k, v (``pre_only_text``)."""
    qkv = _linear(h, 3 * h) + 2 * head
    stream = qkv + _linear(h, h) + _linear(h, mlp * h) + _linear(mlp * h, h)
    mod = _linear(h, 6 * h)
    text, text_mod = (qkv, _linear(h, 2 * h)) if pre_only_text else (stream, mod)
    return BlockKind(count, mod + stream + text_mod + text, mod + text_mod, image_stream=stream, text_stream=text)


def _flux_blocks(n_double: int, n_single: int, h: int = 3072, head: int = 128) -> tuple[BlockKind, ...]:
    """FLUX.1's and HunyuanVideo's blocks (comfy/ldm/flux/layers.py, MLP 4x, biases): ``n_double`` MMDiT blocks of
    339.8 M parameters, then ``n_single`` single-stream blocks of 141.6 M (modulation h x 3h, linear1
    h x (3h + 4h), linear2 (h + 4h) x h, qk-norm): 680 MB and 283 MB in bf16, one FLOP per parameter and token each."""
    mod = _linear(h, 3 * h)
    single = BlockKind(n_single, mod + _linear(h, 7 * h) + _linear(5 * h, h) + 2 * head, mod)
    return _dual_stream(n_double, h, head), single


def _wan_blocks(n: int, d: int, ffn: int) -> tuple[BlockKind, ...]:
    """Wan 2.1's blocks (comfy/ldm/wan/model.py): self-attention q, k, v, o and cross-attention q, o d x d on the
    video tokens, cross-attention k, v d x d on the text tokens, four RMS norms (d each), an affine LayerNorm (2d),
    an FFN d x ffn x d, and a 6 x d modulation table (added, not a linear: nothing to quantize or multiply)."""
    text = 2 * _linear(d, d)
    return (BlockKind(n, 8 * _linear(d, d) + 6 * d + _linear(d, ffn) + _linear(ffn, d) + 6 * d,
                      image_stream=6 * _linear(d, d) + 6 * d + _linear(d, ffn) + _linear(ffn, d) + 6 * d,
                      text_stream=text),)


PRESETS: dict[str, ModelSpec] = {
    # FLUX.1: 19 double + 38 single blocks (3.23 B of modulation); outside them 64.1 M (embedders, final layer)
    "flux1-dev": _spec(
        name="flux1-dev", family="flux", dit_params=11.9014, dit_kept_params=0.0641, blocks=_flux_blocks(19, 38),
        hidden=3072, te_params=4.9, te_names=("t5xxl", "clip_l"), te_hidden=4096,
        text_tokens=512, vae_params=0.084, latent_channels=16, vae_spatial=8, vae_temporal=1, patch=2,
        guidance_distilled=True),
    "flux1-schnell": _spec(
        name="flux1-schnell", family="flux", dit_params=11.9014, dit_kept_params=0.0641, blocks=_flux_blocks(19, 38),
        hidden=3072, te_params=4.9, te_names=("t5xxl", "clip_l"), te_hidden=4096,
        text_tokens=256, vae_params=0.084, latent_channels=16, vae_spatial=8, vae_temporal=1, patch=2,
        default_steps=4, guidance_distilled=True),
    "sdxl": _spec(
        name="sdxl", family="sdxl", dit_params=2.6, dit_kept_params=0.15, modulation_params=0.15,
        hidden=1280, n_blocks=19, block_fraction=0.97, te_params=0.82, te_names=("clip_l", "clip_g"), te_hidden=1280,
        text_tokens=77, vae_params=0.084, latent_channels=4, vae_spatial=8, vae_temporal=1, patch=2,
        default_steps=30, linear_fraction=0.6),
    # SD3.5 Large: 38 MMDiT blocks at 2432 (64 x depth), the last one's text stream pre-only (2.67 B of modulation);
    # outside them 129.2 M (89.7 M of it the 192 x 192 position table)
    "sd3.5-large": _spec(
        name="sd3.5-large", family="sd3", dit_params=8.1463, dit_kept_params=0.1292,
        blocks=(_dual_stream(37, 2432, 64), _dual_stream(1, 2432, 64, pre_only_text=True)),
        hidden=2432, te_params=5.6, te_names=("t5xxl", "clip_l", "clip_g"),
        te_hidden=4096, text_tokens=333, vae_params=0.084, latent_channels=16, vae_spatial=8, vae_temporal=1,
        patch=2),
    # Wan 2.1: no modulation linears in the blocks; outside them the text, time and patch embedders, the time
    # projection d x 6d and the head (1.3B: 25.8 M, 14B: 232.7 M), all kept 16-bit
    "wan2.1-1.3b": _spec(
        name="wan2.1-1.3b", family="wan", dit_params=1.4190, dit_kept_params=0.0258, blocks=_wan_blocks(30, 1536, 8960),
        hidden=1536, te_params=5.7, te_names=("umt5_xxl",), te_hidden=4096,
        text_tokens=512, vae_params=0.127, latent_channels=16, vae_spatial=8, vae_temporal=4, patch=2,
        vae_bytes_per_px=1536, vae_causal=True, is_video=True, default_width=832, default_height=480,
        default_frames=81, default_steps=30),
    "wan2.1-14b": _spec(
        name="wan2.1-14b", family="wan", dit_params=14.2885, dit_kept_params=0.2327,
        blocks=_wan_blocks(40, 5120, 13824), hidden=5120, te_params=5.7, te_names=("umt5_xxl",), te_hidden=4096,
        text_tokens=512, vae_params=0.127, latent_channels=16, vae_spatial=8, vae_temporal=4, patch=2,
        vae_bytes_per_px=1536, vae_causal=True, is_video=True, default_width=1280, default_height=720,
        default_frames=81, default_steps=40),
    "wan2.2-a14b": _spec(       # each expert has Wan 2.1 14B's shape
        name="wan2.2-a14b", family="wan", dit_params=14.2885, dit_kept_params=0.2327,
        blocks=_wan_blocks(40, 5120, 13824), hidden=5120, te_params=5.7, te_names=("umt5_xxl",), te_hidden=4096,
        text_tokens=512, vae_params=0.127, latent_channels=16, vae_spatial=8, vae_temporal=4, patch=2,
        vae_bytes_per_px=1536, vae_causal=True, is_video=True, experts=2, default_width=1280, default_height=720,
        default_frames=81, default_steps=40),
    # HunyuanVideo: FLUX's blocks, 20 double + 40 single (3.40 B of modulation); outside them 360.7 M (309.2 M of it
    # the text refiner). Its VAE has FLUX's decoder widths (128..512 channels): FLUX's 2048 bytes per pixel
    "hunyuanvideo": _spec(
        name="hunyuanvideo", family="hunyuan", dit_params=12.8210, dit_kept_params=0.3607, blocks=_flux_blocks(20, 40),
        hidden=3072, te_params=8.6, te_names=("llava_llama3", "clip_l"),
        te_hidden=4096, text_tokens=256, vae_params=0.25, latent_channels=16, vae_spatial=8, vae_temporal=4,
        patch=2, vae_causal=True, is_video=True, default_width=1280, default_height=720,
        default_frames=129, default_steps=30, guidance_distilled=True),
    # Qwen-Image: 60 MMDiT blocks at 3072 (img_mod and txt_mod: 6.80 B of modulation); outside them 40.5 M
    "qwen-image": _spec(
        name="qwen-image", family="qwen", dit_params=20.4304, dit_kept_params=0.0405,
        blocks=(_dual_stream(60, 3072, 128),), hidden=3072, te_params=8.3, te_names=("qwen2.5_vl_7b",), te_hidden=3584,
        text_tokens=256, vae_params=0.127, latent_channels=16, vae_spatial=8, vae_temporal=1, patch=2,
        vae_bytes_per_px=1536, default_steps=30),
    "ltxv": _spec(
        name="ltxv", family="ltxv", dit_params=1.9, dit_kept_params=0.05, modulation_params=0.25,
        hidden=2048, n_blocks=28, block_fraction=0.97, te_params=4.76, te_names=("t5xxl",), te_hidden=4096,
        text_tokens=128, vae_params=0.42, latent_channels=128, vae_spatial=32, vae_temporal=8, patch=1,
        vae_bytes_per_px=1024, vae_causal=False, vae_streamed=True, is_video=True, default_width=768,
        default_height=512,
        default_frames=97, default_steps=30),
}


def get_preset(name: str) -> ModelSpec:
    key = (name or "").strip().lower()
    aliases = {"flux": "flux1-dev", "flux-dev": "flux1-dev", "flux1": "flux1-dev", "schnell": "flux1-schnell",
               "sd3": "sd3.5-large", "sd35": "sd3.5-large", "wan": "wan2.1-14b", "wan14b": "wan2.1-14b",
               "wan2.1": "wan2.1-14b", "wan2.2": "wan2.2-a14b", "hunyuan": "hunyuanvideo", "qwen": "qwen-image",
               "ltx": "ltxv", "ltx-video": "ltxv"}
    key = aliases.get(key, key)
    if key not in PRESETS:
        raise ConfigError("model", name, "one of " + ", ".join(PRESETS),
                          "Pick the closest preset, or connect the MODEL/CLIP/VAE in ComfyUI to measure them.")
    return PRESETS[key]


def with_overrides(spec: ModelSpec, **kw) -> ModelSpec:
    return replace(spec, **{k: v for k, v in kw.items() if v is not None})
