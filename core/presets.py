"""Model presets: parameter counts, block structure and how a workload becomes tokens.

Where a preset lists its blocks (FLUX.1 and 2, Chroma, SD3.5, Wan 2.1 and 2.2, HunyuanVideo 1.0 and 1.5,
HunyuanImage 2.1, Qwen-Image, Z-Image, LTX-2, HiDream-I1), the counts are those of ComfyUI's model classes at the
published shapes (``comfy/ldm``: every linear with its bias, qk-norm scales); the others (SDXL, LTX-Video) are the
published sizes, rounded (seed 000's table). The presets added on 2026-12-01 were counted from ComfyUI 0.33's classes
on the meta device at the released configs (``tests/integration/test_preset_shapes.py`` builds them and checks every
count); their text encoders and VAEs likewise, from ComfyUI's text-encoder and VAE classes. Inside ComfyUI,
Recommend replaces them with numbers measured from the connected models.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from .errors import ConfigError

B = 1e9
# families whose text tokens pass the blocks' linears (ModelSpec.tokens)
JOINT_TEXT_FAMILIES = ("flux", "flux2", "sd3", "hunyuan", "qwen", "wan", "lumina", "hidream")
# families whose sequence takes reference images as tokens in ComfyUI (ReferenceLatent: FLUX Kontext, FLUX.2,
# Qwen-Image-Edit, Z-Image / Lumina 2; Wan's reference frames; LTX's guide frames; HiDream-O1's reference patches) and
# "custom" (an unknown model may: planned with them, the safe side)
REFERENCE_FAMILIES = ("flux", "flux2", "qwen", "lumina", "wan", "ltxv", "hidream", "custom")


def takes_references(spec: "ModelSpec") -> bool:
    """Whether reference images join ``spec``'s sequence. Chroma is FLUX's family, but its model ignores them
    (comfy/ldm/chroma/model.py reads no ref_latents)."""
    return spec.family in REFERENCE_FAMILIES and not spec.name.startswith("chroma")


@dataclass(frozen=True)
class BlockKind:
    """One kind of repeated block, ``count`` of them in a row (execution order): the parameters of one block, and
    how its linears see the tokens. Modulation linears see one token (the conditioning vector). A dual-stream (MMDiT)
    block has separate weights per stream: image tokens pass only ``image_stream``, text tokens only
    ``text_stream``; whatever is left (``params - modulation - image_stream - text_stream``) every token passes.
    ``idle``: weights a token holds but does not run, the routed experts a mixture-of-experts feed-forward leaves out
    (HiDream: 2 of 4): in the image stream when the block has one, else in the weights every token passes."""

    count: int
    params: int
    modulation: int = 0
    image_stream: int = 0
    text_stream: int = 0
    idle: int = 0


@dataclass(frozen=True)
class ModelSpec:
    """What the planner needs to know about one pipeline."""

    name: str
    family: str                      # flux | flux2 | sdxl | sd3 | wan | hunyuan | qwen | lumina | hidream | ltxv | custom
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
    vae_whole_video: bool = False    # the connected decoder takes every frame in one call and cannot be chunked
                                     # exactly (HunyuanVideo on ComfyUI 0.3.64): its tiles decode all frames
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
        # ComfyUI's empty-latent nodes take width // vae_spatial cells; the DiT pads those to whole patches
        cells = (math.ceil(width // self.vae_spatial / self.patch)
                 * math.ceil(height // self.vae_spatial / self.patch))
        t = math.ceil(self.latent_frames(frames) / self.patch_t)
        return cells * t

    def tokens(self, width: int, height: int, frames: int = 1) -> int:
        """Sequence length of one DiT pass: image/video tokens, plus the text tokens where the blocks' linears see them
        too: joint attention (FLUX.1/2 and Chroma, SD3, HunyuanVideo 1.0/1.5 and HunyuanImage, Qwen-Image, Z-Image's
        unified sequence, HiDream's streams) or Wan's cross-attention keys and values. LTX's cross-attention is left
        out (its text is not in the sequence)."""
        n = self.image_tokens(width, height, frames)
        if self.family in JOINT_TEXT_FAMILIES:
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


def _no_modulation(kind: BlockKind) -> BlockKind:
    """``kind`` without its modulation linears: Chroma's blocks are FLUX's, their modulation computed once outside
    them (the distilled guidance approximator)."""
    return replace(kind, params=kind.params - kind.modulation, modulation=0)


def _flux2_blocks(n_double: int, n_single: int, h: int = 6144, head: int = 128, mlp: int = 3) -> tuple[BlockKind, ...]:
    """FLUX.2's blocks (comfy/ldm/flux/layers.py with ``global_modulation``, ``mlp_silu_act``, no biases): the
    modulation is shared, three linears outside the blocks (double img, double txt, single), so the blocks hold none.
    Per stream of a double block: q, k, v h x 3h, qk-norm, out h x h, a SiLU-gated MLP h x 2*mlp*h and mlp*h x h;
    a single block: linear1 h x (3h + 2*mlp*h), linear2 (h + mlp*h) x h, qk-norm. At h = 6144 both are 490.7 M per
    stream / block."""
    stream = 3 * h * h + 2 * head + h * h + h * 2 * mlp * h + mlp * h * h
    single = h * (3 * h + 2 * mlp * h) + (h + mlp * h) * h + 2 * head
    return (BlockKind(n_double, 2 * stream, image_stream=stream, text_stream=stream), BlockKind(n_single, single))


def _nextdit_blocks(n_context: int, n_noise: int, n_layers: int, d: int, ffn: int, head: int = 128,
                    t_dim: int = 256) -> tuple[BlockKind, ...]:
    """Z-Image's NextDiT (comfy/ldm/lumina/model.py, no biases but the modulation's): each block q, k, v d x 3d, out
    d x d, qk-norm, a SwiGLU FFN (3 x d x ffn), four RMS norms. The context refiners (text tokens only) have no
    modulation; the noise refiners (image tokens only) and the main layers (the joint sequence) a linear
    min(d, 256) x 4d. In execution order: context refiners, noise refiners, layers."""
    plain = 3 * d * d + d * d + 2 * head + 3 * d * ffn + 4 * d
    mod = _linear(min(d, t_dim), 4 * d)
    block = plain + mod
    return (BlockKind(n_context, plain, text_stream=plain),
            BlockKind(n_noise, block, mod, image_stream=plain),
            BlockKind(n_layers, block, mod))


def _ltxav_blocks(n: int, v: int = 4096, a: int = 2048, text: int = 4096, audio_text: int = 2048) -> tuple[BlockKind, ...]:
    """LTX-2's audio-video blocks (comfy/ldm/lightricks/av_model.py, biases, q/k RMS norms over the inner width):
    video self-attention and cross-attention to the text, audio self- and cross-attention, audio-to-video and
    video-to-audio attention, a video FFN v x 4v x v and an audio one, four scale-shift tables (added, not linears).
    The planner plans the video sequence: ``text_stream`` holds every weight the video tokens do not pass (the
    text keys and values, the audio stream's own weights)."""
    def attn(q, kv, inner, out):
        return _linear(q, inner) + 2 * _linear(kv, inner) + _linear(inner, out) + 2 * inner
    tables = 6 * v + 6 * a + 5 * a + 5 * v
    video = (attn(v, v, v, v) + _linear(v, v) + _linear(v, v) + 2 * v + _linear(v, 4 * v) + _linear(4 * v, v)
             + _linear(v, a) + _linear(a, v) + 2 * _linear(v, a))      # a2v query/out, v2a keys/values
    text_kv = 2 * _linear(text, v) + 2 * _linear(audio_text, a)
    audio = (attn(a, a, a, a) + 2 * _linear(a, a) + 2 * a + _linear(a, 4 * a) + _linear(4 * a, a)
             + 2 * _linear(a, a) + 2 * a + 2 * a                      # a2v keys/values and norms, v2a norms
             + _linear(a, a) + _linear(a, a))                          # v2a query/out
    return (BlockKind(n, tables + video + text_kv + audio, text_stream=text_kv + audio),)


def _hidream_blocks(n_double: int, n_single: int, d: int = 2560, ffn: int = 6912, shared: int = 3584,
                    experts: int = 4, active: int = 2) -> tuple[BlockKind, ...]:
    """HiDream-I1's blocks (comfy/ldm/hidream/model.py): adaLN d x 12d (double) / d x 6d (single); per stream q, k,
    v, out d x d with biases and q/k RMS norms (d each); the image feed-forward a mixture of experts (a shared SwiGLU
    d x ``shared`` and ``experts`` routed SwiGLUs d x ``ffn``, ``active`` of them per token, a d x experts gate, no
    biases), the text one (double blocks) a SwiGLU d x ``ffn``."""
    attn = 4 * _linear(d, d) + 2 * d
    moe = 3 * d * shared + experts * 3 * d * ffn + experts * d
    idle = (experts - active) * 3 * d * ffn
    text = attn + 3 * d * ffn
    mod_d, mod_s = _linear(d, 12 * d), _linear(d, 6 * d)
    return (BlockKind(n_double, mod_d + attn + moe + text, mod_d, image_stream=attn + moe, text_stream=text, idle=idle),
            BlockKind(n_single, mod_s + attn + moe, mod_s, idle=idle))


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
    # --- counted from ComfyUI 0.33's classes on the meta device at the released configs (2026-12-01); text encoders
    # from ComfyUI's text-encoder classes, VAEs from the VAE classes comfy/sd.py builds for the released files. Text
    # tokens: ComfyUI's padding where its tokenizer pads (min_length), else the reference pipeline's maximum (an upper
    # bound: ComfyUI encodes the prompt's own tokens). VAE bytes per pixel: 16 x the decoder's width at full
    # resolution, as above. Default sizes and steps are the reference pipelines' (published, not derived).
    # FLUX.2 dev (Flux2, comfy/ldm/flux with global_modulation): 8 double + 48 single blocks at 6144, no biases; the
    # shared modulation (566.2 M: double img, double txt, single) sits outside the blocks with the embedders and the
    # final layer (816.3 M in all). Mistral Small 3.1 24B text model (flux2_te: 22.90 B). The VAE (32 channels, FLUX's
    # decoder widths: 2048 B/px) packs 2x2 latent cells into 128 channels, so ComfyUI's latent is 1/16 of the image
    # and the DiT's patch is 1; guidance-distilled (guidance_in)
    "flux2-dev": _spec(
        name="flux2-dev", family="flux2", dit_params=32.223281152, dit_kept_params=0.816316416,
        blocks=_flux2_blocks(8, 48), hidden=6144, te_params=22.901314561, te_names=("mistral3_24b",), te_hidden=5120,
        text_tokens=512, vae_params=0.084040899, latent_channels=128, vae_spatial=16, vae_temporal=1, patch=1,
        default_steps=50, guidance_distilled=True),
    # Chroma (Chroma, comfy/ldm/chroma): FLUX.1's 19 + 38 blocks without their modulation linears, which a distilled
    # approximator (278.3 M, outside the blocks; 291.3 M in all) computes once per step. T5-XXL encoder only
    # (pixart_te: 4.76 B); FLUX.1's VAE. Real CFG (cond + uncond)
    "chroma": _spec(
        name="chroma", family="flux", dit_params=8.899983424, dit_kept_params=0.291267648,
        blocks=tuple(_no_modulation(k) for k in _flux_blocks(19, 38)), hidden=3072, te_params=4.762310657,
        te_names=("t5xxl",), te_hidden=4096, text_tokens=512, vae_params=0.083819683, latent_channels=16,
        vae_spatial=8, vae_temporal=1, patch=2),
    # HiDream-I1 Full (HiDream, comfy/ldm/hidream): 16 double + 32 single blocks at 2560 with mixture-of-experts
    # feed-forwards (2 of 4 routed experts per token); outside them 546.3 M (513.8 M of it the caption projections).
    # Text in the sequence: T5 (128, padded) + Llama's last layer (128, padded) + each block's own Llama layer (128).
    # CLIP-L, CLIP-G, T5-XXL and Llama 3.1 8B (hidream_clip: 13.09 B); FLUX.1's VAE
    "hidream-i1": _spec(
        name="hidream-i1", family="hidream", dit_params=17.105733184, dit_kept_params=0.546260544,
        blocks=_hidream_blocks(16, 32), hidden=2560, te_params=13.085545476,
        te_names=("clip_l", "clip_g", "t5xxl", "llama3.1_8b"), te_hidden=4096, text_tokens=384,
        vae_params=0.083819683, latent_channels=16, vae_spatial=8, vae_temporal=1, patch=2, default_steps=50),
    # Z-Image Turbo (ZImage, comfy/ldm/lumina NextDiT at dim 3840): 2 context refiners, 2 noise refiners, 30 layers;
    # outside them 11.9 M. Qwen3-4B (z_image.te: 4.02 B); FLUX.1's VAE. Turbo: 8 steps without CFG
    "z-image": _spec(
        name="z-image", family="lumina", dit_params=6.154908736, dit_kept_params=0.011852352,
        blocks=_nextdit_blocks(2, 2, 30, 3840, 10240), hidden=3840, te_params=4.022468097, te_names=("qwen3_4b",),
        te_hidden=2560, text_tokens=512, vae_params=0.083819683, latent_channels=16, vae_spatial=8, vae_temporal=1,
        patch=2, default_steps=8, guidance_distilled=True),
    # HunyuanImage 2.1 (HunyuanImage21: comfy/ldm/hunyuan_video at 3584, patch 1): 20 double + 40 single blocks;
    # outside them 466.6 M (412.1 M the text refiner). Qwen2.5-VL 7B + byT5 small (hunyuan_image.te: 7.97 B). Its
    # VAE: 32x, 64 channels (405.6 M), decoder 128 channels wide at full resolution: 2048 B/px
    "hunyuanimage-2.1": _spec(
        name="hunyuanimage-2.1", family="hunyuan", dit_params=17.42579552, dit_kept_params=0.46657376,
        blocks=_flux_blocks(20, 40, 3584), hidden=3584, te_params=7.966484226, te_names=("qwen2.5_vl_7b", "byt5_small"),
        te_hidden=3584, text_tokens=256, vae_params=0.405575491, latent_channels=64, vae_spatial=32, vae_temporal=1,
        patch=1, default_width=2048, default_height=2048, default_steps=50),
    # HunyuanVideo 1.5 (HunyuanVideo15: 54 double blocks at 2048, patch 1x1x1); outside them 169.5 M (141.1 M the
    # text refiner). Qwen2.5-VL 7B + byT5 small (7.97 B). Its VAE (vae_refiner: 16x, 4x in time, 32 channels, 1.26 B)
    # is causal, its decoder 128 channels wide at full resolution: 2048 B/px. Real CFG
    "hunyuanvideo-1.5": _spec(
        name="hunyuanvideo-1.5", family="hunyuan", dit_params=8.32660816, dit_kept_params=0.169535776,
        blocks=(_dual_stream(54, 2048, 128),), hidden=2048, te_params=7.966484226,
        te_names=("qwen2.5_vl_7b", "byt5_small"), te_hidden=3584, text_tokens=256, vae_params=1.262735363,
        latent_channels=32, vae_spatial=16, vae_temporal=4, patch=1, vae_causal=True, is_video=True,
        default_width=1280, default_height=720, default_frames=121, default_steps=50),
    # Wan 2.2 TI2V 5B (WAN22_T2V, out_dim 48): Wan's blocks, 30 at 3072 (FFN 14336); outside them 90.1 M. UMT5-XXL
    # (5.68 B). The Wan 2.2 VAE (16x, 4x in time, 48 channels, 704.7 M) is causal; its decoder runs at half the output
    # size, 256 channels wide, and unpatchifies 2x2 at the end: 64 channels per output pixel, 1024 B/px
    "wan2.2-ti2v-5b": _spec(
        name="wan2.2-ti2v-5b", family="wan", dit_params=4.999787712, dit_kept_params=0.090086592,
        blocks=_wan_blocks(30, 3072, 14336), hidden=3072, te_params=5.680910337, te_names=("umt5_xxl",),
        te_hidden=4096, text_tokens=512, vae_params=0.704688668, latent_channels=48, vae_spatial=16, vae_temporal=4,
        patch=2, vae_bytes_per_px=1024, vae_causal=True, is_video=True, default_width=1280, default_height=704,
        default_frames=121, default_steps=50),
    # LTX-2 19B (LTXAV, comfy/ldm/lightricks/av_model.py at its defaults: 48 blocks, video 4096, audio 2048); outside
    # the blocks 1.05 B (709 M of it the two text-embedding connectors). Gemma 3 12B + its text projection (ltxav_te:
    # 12.91 B), padded by ComfyUI to 1024 tokens (cross-attention: not in the sequence). Planned for its video; the
    # audio latent's tokens are left out. The VAE's config ships in the checkpoint's metadata, so its size is not
    # derivable from ComfyUI's code: LTX-Video's (0.42 B, 1024 B/px), with its compression (32x, 8x in time, 128
    # channels), which ComfyUI 0.33 hardcodes for it
    "ltx-2": _spec(
        name="ltx-2", family="ltxv", dit_params=19.585115392, dit_kept_params=1.05353344, blocks=_ltxav_blocks(48),
        hidden=4096, te_params=12.909859441, te_names=("gemma3_12b",), te_hidden=3840, text_tokens=1024,
        vae_params=0.42, latent_channels=128, vae_spatial=32, vae_temporal=8, patch=1, vae_bytes_per_px=1024,
        vae_streamed=True, is_video=True, default_width=768, default_height=512, default_frames=121,
        default_steps=40),
}


def get_preset(name: str) -> ModelSpec:
    key = (name or "").strip().lower()
    aliases = {"flux": "flux1-dev", "flux-dev": "flux1-dev", "flux1": "flux1-dev", "schnell": "flux1-schnell",
               "sd3": "sd3.5-large", "sd35": "sd3.5-large", "wan": "wan2.1-14b", "wan14b": "wan2.1-14b",
               "wan2.1": "wan2.1-14b", "wan2.2": "wan2.2-a14b", "hunyuan": "hunyuanvideo", "qwen": "qwen-image",
               "ltx": "ltxv", "ltx-video": "ltxv", "flux2": "flux2-dev", "flux.2": "flux2-dev",
               "flux.2-dev": "flux2-dev", "z-image-turbo": "z-image", "zimage": "z-image",
               "hunyuanvideo1.5": "hunyuanvideo-1.5", "hunyuan1.5": "hunyuanvideo-1.5", "hunyuanvideo15": "hunyuanvideo-1.5",
               "hunyuanimage": "hunyuanimage-2.1", "hunyuanimage2.1": "hunyuanimage-2.1",
               "wan2.2-5b": "wan2.2-ti2v-5b", "wan5b": "wan2.2-ti2v-5b", "ti2v": "wan2.2-ti2v-5b", "ltx2": "ltx-2",
               "ltxav": "ltx-2", "hidream": "hidream-i1"}
    key = aliases.get(key, key)
    if key not in PRESETS:
        raise ConfigError("model", name, "one of " + ", ".join(PRESETS),
                          "Pick the closest preset, or connect the MODEL/CLIP/VAE in ComfyUI to measure them.")
    return PRESETS[key]


def with_overrides(spec: ModelSpec, **kw) -> ModelSpec:
    return replace(spec, **{k: v for k, v in kw.items() if v is not None})
