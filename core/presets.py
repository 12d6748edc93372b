"""Model presets: parameter counts, block structure and how a workload becomes tokens.

Figures are the published model sizes (rounded; seed 000's table for FLUX, SDXL, Wan, Hunyuan).
Inside ComfyUI, Recommend replaces them with numbers measured from the connected models.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from .errors import ConfigError

B = 1e9


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


# Helper to keep preset rows readable: (numbers in billions of parameters)
def _spec(**kw) -> ModelSpec:
    for k in ("dit_params", "dit_kept_params", "modulation_params", "te_params", "vae_params"):
        kw[k] = kw[k] * B
    return ModelSpec(**kw)


PRESETS: dict[str, ModelSpec] = {
    "flux1-dev": _spec(
        name="flux1-dev", family="flux", dit_params=11.9, dit_kept_params=0.07, modulation_params=3.23,
        hidden=3072, n_blocks=57, block_fraction=0.99, te_params=4.9, te_names=("t5xxl", "clip_l"), te_hidden=4096,
        text_tokens=512, vae_params=0.084, latent_channels=16, vae_spatial=8, vae_temporal=1, patch=2,
        guidance_distilled=True),
    "flux1-schnell": _spec(
        name="flux1-schnell", family="flux", dit_params=11.9, dit_kept_params=0.07, modulation_params=3.23,
        hidden=3072, n_blocks=57, block_fraction=0.99, te_params=4.9, te_names=("t5xxl", "clip_l"), te_hidden=4096,
        text_tokens=256, vae_params=0.084, latent_channels=16, vae_spatial=8, vae_temporal=1, patch=2,
        default_steps=4, guidance_distilled=True),
    "sdxl": _spec(
        name="sdxl", family="sdxl", dit_params=2.6, dit_kept_params=0.15, modulation_params=0.15,
        hidden=1280, n_blocks=19, block_fraction=0.97, te_params=0.82, te_names=("clip_l", "clip_g"), te_hidden=1280,
        text_tokens=77, vae_params=0.084, latent_channels=4, vae_spatial=8, vae_temporal=1, patch=2,
        default_steps=30, linear_fraction=0.6),
    "sd3.5-large": _spec(
        name="sd3.5-large", family="sd3", dit_params=8.1, dit_kept_params=0.1, modulation_params=1.3,
        hidden=2432, n_blocks=38, block_fraction=0.98, te_params=5.6, te_names=("t5xxl", "clip_l", "clip_g"),
        te_hidden=4096, text_tokens=333, vae_params=0.084, latent_channels=16, vae_spatial=8, vae_temporal=1,
        patch=2),
    "wan2.1-1.3b": _spec(
        name="wan2.1-1.3b", family="wan", dit_params=1.3, dit_kept_params=0.06, modulation_params=0.03,
        hidden=1536, n_blocks=30, block_fraction=0.95, te_params=5.7, te_names=("umt5_xxl",), te_hidden=4096,
        text_tokens=512, vae_params=0.127, latent_channels=16, vae_spatial=8, vae_temporal=4, patch=2,
        vae_bytes_per_px=1536, vae_causal=True, is_video=True, default_width=832, default_height=480,
        default_frames=81, default_steps=30),
    "wan2.1-14b": _spec(
        name="wan2.1-14b", family="wan", dit_params=14.0, dit_kept_params=0.25, modulation_params=0.15,
        hidden=5120, n_blocks=40, block_fraction=0.97, te_params=5.7, te_names=("umt5_xxl",), te_hidden=4096,
        text_tokens=512, vae_params=0.127, latent_channels=16, vae_spatial=8, vae_temporal=4, patch=2,
        vae_bytes_per_px=1536, vae_causal=True, is_video=True, default_width=1280, default_height=720,
        default_frames=81, default_steps=40),
    "wan2.2-a14b": _spec(
        name="wan2.2-a14b", family="wan", dit_params=14.0, dit_kept_params=0.25, modulation_params=0.15,
        hidden=5120, n_blocks=40, block_fraction=0.97, te_params=5.7, te_names=("umt5_xxl",), te_hidden=4096,
        text_tokens=512, vae_params=0.127, latent_channels=16, vae_spatial=8, vae_temporal=4, patch=2,
        vae_bytes_per_px=1536, vae_causal=True, is_video=True, experts=2, default_width=1280, default_height=720,
        default_frames=81, default_steps=40),
    "hunyuanvideo": _spec(
        name="hunyuanvideo", family="hunyuan", dit_params=12.7, dit_kept_params=0.1, modulation_params=2.1,
        hidden=3072, n_blocks=60, block_fraction=0.98, te_params=8.6, te_names=("llava_llama3", "clip_l"),
        te_hidden=4096, text_tokens=256, vae_params=0.25, latent_channels=16, vae_spatial=8, vae_temporal=4,
        patch=2, vae_bytes_per_px=1536, vae_causal=True, is_video=True, default_width=1280, default_height=720,
        default_frames=129, default_steps=30, guidance_distilled=True),
    "qwen-image": _spec(
        name="qwen-image", family="qwen", dit_params=20.4, dit_kept_params=0.1, modulation_params=3.8,
        hidden=3072, n_blocks=60, block_fraction=0.99, te_params=8.3, te_names=("qwen2.5_vl_7b",), te_hidden=3584,
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
