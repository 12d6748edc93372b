"""TiledVAEDecode's ComfyUI side: describe the VAE to the tiling engine, measure it, free memory, decode.

Only this module touches ComfyUI (``comfy.sd.VAE``, ``comfy.model_management``, ``comfy.utils``).
Supported seamless paths, detected from the model's modules rather than ComfyUI's version:
  * KL decoders (SD 1.x/2.x, SDXL, SD3, Flux, Flux 2): ``comfy.ldm.modules.diffusionmodules.model.Decoder``;
    layered (tail modules in row bands, exact statistics) when that fits, else spatial tiles;
  * HunyuanImage 2.1 (``comfy.ldm.hunyuan_video.vae.Decoder``, 32x): as KL, split at 1/4 of the output scale;
  * HunyuanVideo 1.0 (the 3-D KL decoder) and 1.5 (``comfy.ldm.hunyuan_video.vae_refiner.Decoder``): time in the
    decoder's own carried-convolution chunks, streamed; spatial tiles;
  * LTX-Video VAE (``comfy.ldm.lightricks.vae.causal_video_autoencoder.VideoVAE``): spatial tiles, all frames per
    tile (the decoder is not causal; on 0.33 it chunks time itself inside each call); on 0.8 exact temporal
    chunks that stream each time unit's context (``core/tiling/stream.py``);
  * Wan 2.1 VAE (``comfy.ldm.wan.vae.WanVAE``) and Wan 2.2 VAE (``comfy.ldm.wan.vae2_2.WanVAE``): causal,
    temporal chunks with the feature cache carried + spatial tiles. ComfyUI 0.33's Wan 2.1 decoder walks the
    frames in its own chunks (first frame, then pairs); its temporal chunks are those calls (``decode_streamed``).
Any other VAE decodes whole when it fits (ComfyUI's own ``vae.decode``), otherwise the report
says to use ComfyUI's VAEDecodeTiled.
"""
from __future__ import annotations

import dataclasses
import inspect
import logging
import math
import re
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..core.errors import BudgetExceeded, ConfigError, IncompatibleInput
from ..core.quant.metrics import psnr
from ..core.tiling import (DecodeCost, DecodeStats, LayeredStats, PeakMeasurement, StagedDecoder, TilePlan,
                           decode_layered, decode_spatial, decode_streamed, decode_temporal, measure_halo,
                           measure_peak_bytes, plan_decode, run_stem)
from ..core.tiling.decode import STATS_METHODS, _TailRunner, _frames_dummy, collect_tail_stats
from ..core.tiling.memory import peak_method
from ..core.tiling.overrides import StopDecode, override_forwards
from ..core.tiling.stream import (StreamStats, TimeUnit, batch_frames, decode_time_streamed, measure_units,
                                  stream_latency)
from .comfy_mode import stays_on_gpu
from .inputs import require_vae

log = logging.getLogger("levers")
# node choice -> (core method, passes)
STATS_CHOICES = {"tiles": ("tiles", 1), "windows": ("windows", 1), "exact": ("exact", 1)}
GIB = 1024 ** 3
LAYERED_BANDS = 8        # row bands per module in the layered decode: a few rows recomputed per band


@dataclass
class TiledDecodeSettings:
    """Node inputs. Sizes are output pixels / frames like VAEDecodeTiled; 0 = auto."""

    tile_size: int = 0
    overlap: int = 0
    temporal_size: int = 0
    temporal_overlap: int = 0
    memory_budget_gb: float = 0.0
    stats: str = "tiles"
    free_other_models: bool = True

    def validate(self) -> "TiledDecodeSettings":
        for name in ("tile_size", "overlap", "temporal_size", "temporal_overlap"):
            v = getattr(self, name)
            if isinstance(v, bool) or int(v) != v or v < 0:
                raise ConfigError(name, v, "an integer >= 0 (0 = auto)")
        if not (self.memory_budget_gb >= 0) or math.isinf(self.memory_budget_gb):
            raise ConfigError("memory_budget_gb", self.memory_budget_gb, "a number of GB >= 0 (0 = free memory)")
        if self.stats not in STATS_CHOICES:
            raise ConfigError("groupnorm_stats", self.stats, " | ".join(STATS_CHOICES))
        return self


@dataclass
class DecodeReport:
    lines: list[str] = field(default_factory=list)

    def add(self, text: str) -> None:
        self.lines.append(text)

    def text(self) -> str:
        return "\n".join(self.lines)


# ------------------------------------------------------------------------------------- describe
def describe_vae(vae) -> tuple[StagedDecoder | None, str]:
    """A StagedDecoder for the VAE's first_stage_model, or (None, why not). Never raises: a layout Levers
    misreads is a VAE it stands aside for (ComfyUI decodes it), not a failed decode."""
    fsm = getattr(vae, "first_stage_model", None)
    if fsm is None:
        return None, "VAE has no first_stage_model"
    try:
        return _describe(fsm, getattr(fsm, "decoder", None))
    except Exception as e:
        log.warning("levers: could not read the layout of %s", type(fsm).__name__, exc_info=True)
        return None, f"{type(fsm).__name__}: Levers could not read its layout ({type(e).__name__}: {e})"


def _describe(fsm, dec) -> tuple[StagedDecoder | None, str]:
    if _is_wan_decoder(fsm, dec):
        staged = _wan(fsm, dec)
        name = "Wan 2.2 VAE" if staged.first_call_kwarg else "Wan 2.1 VAE"
        return staged, f"{name}: middle block (attention) whole, upsampling stages tiled, causal cache carried"
    if _is_hunyuan15_decoder(dec):
        return _hunyuan15(fsm, dec), ("HunyuanVideo 1.5 VAE: middle block (attention) whole, upsampling stages "
                                      "tiled (per-pixel RMS norms: exact); time in the decoder's own causal chunks")
    if _is_ltx_decoder(dec):
        return _ltx(fsm, dec)
    if _is_hunyuan_image_decoder(dec):
        return _hunyuan_image(fsm, dec)
    if _is_kl_decoder(dec):
        weight = getattr(getattr(dec.conv_in, "conv", dec.conv_in), "weight", None)
        if isinstance(weight, torch.Tensor) and weight.ndim == 5:
            if any(len(up.attn) > 0 for up in dec.up):
                return None, f"{type(dec).__name__} is a 3-D KL decoder with attention in its upsampling stages"
            staged = _kl(fsm, dec, video=True)
            return staged, (
                "3-D KL decoder (HunyuanVideo): stages up to 1/4 of the output scale run whole (attention + their "
                "GroupNorms), the rest tiled with statistics pooled over all tiles; "
                + ("time in the decoder's own causal chunks" if staged.streamed else
                   "every frame in one call (this ComfyUI's decoder carries no causal state between calls; "
                   "0.3.7x and later decode in exact chunks)"))
        if not isinstance(weight, torch.Tensor) or weight.ndim != 4:
            return None, f"{type(dec).__name__} has a conv_in Levers does not recognise"
        if any(len(dec.up[lv].attn) > 0 for lv in range(max(0, dec.num_resolutions - 2))):
            return None, f"{type(dec).__name__} has attention in its high-resolution stages: tiles would not be local"
        return _kl(fsm, dec), ("KL decoder: stages up to 1/4 of the output scale run whole (attention + their "
                               "GroupNorms), the rest tiled with whole-image GroupNorm statistics")
    return None, f"{type(fsm).__name__} has no seamless tiling in Levers yet"


def _is_kl_decoder(dec) -> bool:
    """ComfyUI's KL decoder (``comfy.ldm.modules.diffusionmodules.model.Decoder``, 2-D or 3-D): stages indexed
    from the highest resolution, each with ``block``, ``attn`` and (but the first) ``upsample``. Other decoders
    with the same top-level names (the HunyuanImage 2.1 refiner's) are not this layout."""
    if dec is None or not all(hasattr(dec, a) for a in ("conv_in", "mid", "up", "norm_out", "conv_out",
                                                        "num_resolutions")):
        return False
    return all(hasattr(up, "block") and hasattr(up, "attn") for up in dec.up)


def _is_hunyuan_image_decoder(dec) -> bool:
    """ComfyUI's HunyuanImage 2.1 VAE decoder (``comfy.ldm.hunyuan_video.vae.Decoder``: 32x space, 2-D, GroupNorm
    residual stages with pixel-shuffle upsamplers, attention only in the middle block), or a subclass."""
    return dec is not None and any(c.__module__ == "comfy.ldm.hunyuan_video.vae" and c.__name__ == "Decoder"
                                   for c in type(dec).__mro__)


def _zero_stand_in(x, *args, **kwargs):
    """Stand-in for a ``conv_in`` whose caller adds the latent itself (repeated over channels) to its output:
    zeros, so the stand-in latent comes through the sum unchanged."""
    return x * 0


def _hunyuan_image(fsm, dec) -> tuple[StagedDecoder | None, str]:
    """HunyuanImage 2.1: the stem is conv_in, the middle block (attention over the whole image) and the stages up
    to 1/4 of the output scale; the tail is the rest, whose GroupNorms take whole-image statistics like a KL
    decoder's. Its stages run from the lowest resolution up, each upsampling at its end but the last."""
    stages = list(dec.up)
    ups = sum(1 for st in stages if hasattr(st, "upsample"))
    level = ups - 2                      # the stage at 1/4 of the output scale
    if level < 0 or not all(hasattr(st, "block") and len(st.block) > 0 for st in stages):
        return None, f"{type(dec).__name__} (HunyuanImage layout) has fewer than 2 upsamplers"
    stem, boundary, tail = _split_at_stage(
        [(list(st.block), [st.upsample] if hasattr(st, "upsample") else []) for st in stages], level)
    stem = [dec.conv_in, dec.mid.block_1, dec.mid.attn_1, dec.mid.block_2] + stem
    tail += [dec.norm_out, dec.conv_out]
    staged = StagedDecoder(run=fsm.decode, stem=stem, boundary=boundary, tail=tail,
                           stand_ins={dec.conv_in: _zero_stand_in})
    return staged, ("HunyuanImage 2.1 VAE: stages up to 1/4 of the output scale run whole (attention + their "
                    "GroupNorms), the rest tiled with whole-image GroupNorm statistics")


def _split_at_stage(stages: list[tuple[list, list]], at: int) -> tuple[list, torch.nn.Module, list]:
    """(stem, boundary, tail) of decoder stages given from the lowest resolution up as (modules, upsamplers): the
    stages before ``at`` run in the stem, stage ``at`` too up to its last module (the boundary, whose output is
    stored), and the rest, from that stage's upsampler on, in the tail."""
    stem, tail, boundary = [], [], None
    for i, (mods, ups) in enumerate(stages):
        if i < at:
            stem += mods + ups
        elif i == at:
            stem += mods[:-1]
            boundary = mods[-1]
            tail += ups
        else:
            tail += mods + ups
    return stem, boundary, tail


def _kl(fsm, dec, video: bool = False, level: int | None = None) -> StagedDecoder:
    """The 2-D KL decoder (SD/SDXL/SD3/Flux) or its 3-D form (HunyuanVideo, ``conv3d=True``).

    The 3-D form with carried convolutions (``Decoder.carried``) splits the frames after the middle block
    into chunks of 2 latent frames and runs the upsampling stages chunk by chunk, carrying each causal
    convolution's last input frames: its own exact temporal chunks, one ``conv_out`` call each. Its
    ``conv_in`` is called on input its caller has already padded (1 px in space, 2 frames in time), so
    in tile runs its stand-in removes that padding from the stand-in latent.
    """
    n = dec.num_resolutions
    if level is None:
        level = max(0, n - 2)    # the stage one upsampling above the latent (1/4 of the output scale for x8 VAEs)
    stem = []
    pqc = getattr(fsm, "post_quant_conv", None)
    if isinstance(pqc, torch.nn.Module):
        stem.append(pqc)
    stem += [dec.conv_in, dec.mid.block_1, dec.mid.attn_1, dec.mid.block_2]
    stages = []                                  # from the lowest resolution up, as the decoder runs them
    for lv in reversed(range(n)):
        up = dec.up[lv]
        mods = []
        for i, blk in enumerate(up.block):
            mods.append(blk)
            if len(up.attn) > 0:
                mods.append(up.attn[i])
        stages.append((mods, [up.upsample] if hasattr(up, "upsample") else []))
    more, boundary, tail = _split_at_stage(stages, n - 1 - level)
    stem += more
    tail += [dec.norm_out, dec.conv_out]
    if not video:
        return StagedDecoder(run=fsm.decode, stem=stem, boundary=boundary, tail=tail)
    carried = bool(getattr(dec, "carried", False))
    stand_ins = {dec.conv_in: _unpad_carried} if carried else {}
    # without carried convolutions (ComfyUI 0.3.64) the decoder takes every frame in one call: so does each tile,
    # and its cost grows with the frames
    return StagedDecoder(run=fsm.decode, stem=stem, boundary=boundary, tail=tail, stand_ins=stand_ins,
                         stream_module=dec.conv_out if carried else None, own_chunk_frames=2 if carried else 0,
                         whole_frames=not carried)


def deeper_stems(vae, staged: StagedDecoder | None) -> list[tuple[StagedDecoder, str]]:
    """For a 2-D KL decoder (``staged`` as ``describe_vae`` gave it), splits whose stem runs more stages whole
    (deepest first), with their output scale.

    A deeper stem leaves fewer stages to tile: fewer GroupNorms to estimate, a smaller receptive field (so less
    overlap) and a cheaper statistics pass, at the cost of a larger whole-image stem. The node takes the deepest
    one whose stem and tiles fit the budget."""
    fsm = vae.first_stage_model
    dec = getattr(fsm, "decoder", None)
    if staged is None or staged.causal or staged.streamed or not _is_kl_decoder(dec):
        return []
    if getattr(getattr(dec.conv_in, "conv", dec.conv_in), "weight", torch.empty(0)).ndim != 4:
        return []           # the 3-D KL decoder (HunyuanVideo) keeps its own split
    n = dec.num_resolutions
    out = []
    for level in range(1, max(0, n - 2)):
        if any(len(dec.up[lv].attn) > 0 for lv in range(level)):
            continue
        out.append((_kl(fsm, dec, level=level), f"1/{2 ** level}"))
    return out


def _unpad_carried(x, *args, **kwargs):
    """Stand-in for a carried 3-D ``conv_in``: undo the (1, 1, 1, 1, 2, 0) replicate padding its caller added."""
    return x[:, :, 2:, 1:-1, 1:-1]


def _is_hunyuan15_decoder(dec) -> bool:
    """ComfyUI's HunyuanVideo 1.5 decoder (``comfy.ldm.hunyuan_video.vae_refiner.Decoder`` with
    ``refiner_vae=True``): carried causal 3-D convolutions, per-pixel RMS norms, attention only in the middle."""
    if dec is None or not getattr(dec, "refiner_vae", False):
        return False
    if not all(hasattr(dec, a) for a in ("conv_in", "mid", "up", "norm_out", "conv_out", "z_channels")):
        return False
    return not any(isinstance(m, torch.nn.GroupNorm) for m in dec.up.modules())


def _zero_unpad_carried(x, *args, **kwargs):
    """Stand-in for HunyuanVideo 1.5's ``conv_in``, whose caller adds the latent itself (repeated over channels)
    to the convolution's output: unpadded and zeroed, so the stand-in latent (frame indices) comes through."""
    return x[:, :, 2:, 1:-1, 1:-1] * 0


def _hunyuan15(fsm, dec) -> StagedDecoder:
    """HunyuanVideo 1.5: the stem is conv_in and the middle block up to its last residual block (the attention
    spans the whole frame); the tail is the upsampling stages (pixel-shuffle upsamplers) and the head, whose
    norms are per pixel, so tiles are exact. Like the 3-D KL decoder it splits time into chunks of 2 latent frames
    after the middle block and carries each causal convolution's last frames: one ``conv_out`` call per chunk."""
    stem = [dec.conv_in, dec.mid.block_1, dec.mid.attn_1]
    tail = []
    for stage in dec.up:
        tail += list(stage.block)
        if hasattr(stage, "upsample"):
            tail.append(stage.upsample)
    tail += [dec.norm_out, dec.conv_out]
    return StagedDecoder(run=fsm.decode, stem=stem, boundary=dec.mid.block_2, tail=tail,
                         stand_ins={dec.conv_in: _zero_unpad_carried}, stream_module=dec.conv_out,
                         own_chunk_frames=2)


def _is_ltx_decoder(dec) -> bool:
    """ComfyUI's LTX-Video decoder (``comfy.ldm.lightricks.vae.causal_video_autoencoder.Decoder``): residual
    stages and depth-to-space upsamplers, no attention, per-pixel norms (or GroupNorm), a patchified head."""
    return dec is not None and "lightricks" in type(dec).__module__ and all(
        hasattr(dec, a) for a in ("conv_in", "up_blocks", "conv_norm_out", "conv_out", "patch_size"))


class _FrameCollector:
    """Stands in for the output buffer ComfyUI 0.33's LTX decoder writes its frames into
    (``output_buffer[:, :, a:b].copy_(frames)``): keeps each piece, in order, for the tile that is running."""

    def __init__(self):
        self.pieces: list[torch.Tensor] = []

    def __getitem__(self, index):
        return self

    def copy_(self, frames: torch.Tensor):
        self.pieces.append(frames)
        return self


def _no_frames(x, *args, **kwargs):
    """Stem run: the first tail module returns no frames, so a chunked decoder skips the rest of each chunk."""
    return x[:, :, :0]


def _stop(x, *args, **kwargs):
    """Stem run: the head is not reached with stem-shaped data (its timestep scale/shift has the head's width)."""
    raise StopDecode


def _ltx(fsm, dec) -> tuple[StagedDecoder | None, str]:
    """LTX-Video: the stem is ``conv_in`` and the stages up to the last spatial upsampler; the tail is that
    upsampler, the stages after it and the head, run per tile on all frames at once (the decoder is not causal in
    time; on 0.33 it chunks time itself inside each call). Its norms are per pixel (or GroupNorm, pooled over
    tiles); the timestep conditioning is global. Its ``decode`` adds noise to the whole latent once, which the
    stem run does, so tiles share it. Decoders that inject spatial noise inside their blocks (LTX 0.9.1) are left
    to ComfyUI: each tile would draw its own."""
    if any(getattr(m, "inject_noise", False) for m in dec.modules()):
        return None, ("LTX decoder that injects random spatial noise in its blocks (LTX-Video 0.9.1): each tile "
                      "would draw its own noise")
    ups = [i for i, b in enumerate(dec.up_blocks)
           if type(b).__name__ == "DepthToSpaceUpsample" and tuple(getattr(b, "stride", (1, 1, 1)))[1] > 1]
    if not ups or ups[-1] < 1:
        return None, "LTX decoder without a spatial upsampler after its first stage"
    last = ups[-1]
    stem = [dec.conv_in] + list(dec.up_blocks[:last - 1])
    tail = list(dec.up_blocks[last:]) + [dec.conv_norm_out, dec.conv_out]
    chunked = _decode_takes_output_buffer(fsm)

    def run(z):
        if not chunked:
            return fsm.decode(z)
        frames = _FrameCollector()
        out = fsm.decode(z, output_buffer=frames)
        return torch.cat(frames.pieces, 2) if frames.pieces else out

    units, stream_why = ([], "the decoder chunks time itself") if chunked else _ltx_time_units(dec)
    staged = StagedDecoder(run=run, stem=stem, boundary=dec.up_blocks[last - 1], tail=tail,
                           stem_run_stand_ins={dec.up_blocks[last]: _no_frames, dec.conv_norm_out: _stop},
                           whole_frames=True, time_decoder=dec if units else None, time_units=units)
    return staged, ("LTX-Video VAE: stages up to the last spatial upsampler run whole, the rest tiled, all frames "
                    "per tile; time: " + stream_why)


def _ltx_time_units(dec) -> tuple[list, str]:
    """ComfyUI 0.8's LTX decoder as a chain of time units (``core/tiling/stream.py``): ``conv_in``, every residual
    block and depth-to-space upsampler, ``conv_out``; the glue between them (pixel norms, activations, the
    timestep scale and shift, unpatchify) is per frame. Not with GroupNorm (statistics over all frames) or
    attention, and only when every time convolution sits inside a unit."""
    if any(isinstance(m, torch.nn.GroupNorm) for m in dec.modules()):
        return [], "GroupNorm over all frames: no exact temporal chunks (spatial tiles only)"
    if any("attention" in type(m).__name__.lower() for m in dec.modules()):
        return [], "attention in the decoder: no exact temporal chunks (spatial tiles only)"
    units = [dec.conv_in] + [m for m in dec.up_blocks.modules()
                             if type(m).__name__ in ("ResnetBlock3D", "DepthToSpaceUpsample")] + [dec.conv_out]
    inside = {id(c) for u in units for c in u.modules()}
    stray = [n for n, m in dec.named_modules() if isinstance(m, torch.nn.Conv3d) and id(m) not in inside]
    if stray:
        return [], f"time convolutions outside the known units ({', '.join(stray[:3])}): no exact temporal chunks"
    return units, (f"exact temporal chunks streamed through {len(units)} time units (each keeps the context "
                   "frames it needs)")


def _is_wan_decoder(fsm, dec) -> bool:
    """Wan's causal 3-D decoder (2.1 and 2.2), by its shape: conv1 -> middle (res, attention, res) ->
    upsamples -> head, called with a ``feat_cache`` list, and a 1x1x1 ``conv2`` before it."""
    if dec is None or not all(hasattr(dec, a) for a in ("conv1", "middle", "upsamples", "head")):
        return False
    if not isinstance(getattr(fsm, "conv2", None), torch.nn.Module) or len(dec.middle) != 3:
        return False
    return "feat_cache" in inspect.signature(dec.forward).parameters


def _wan(fsm, dec) -> StagedDecoder:
    """Wan 2.1 / 2.2: the stem is conv2, conv1 and the middle block up to its last residual block (the
    attention runs per frame on the whole image); the tail is the upsampling stages and the head, whose
    norms are per-pixel RMS norms. Wan 2.2's decoder also takes ``first_chunk`` (its shortcut drops the
    padded frame on the video's first call)."""
    n_cache = sum(1 for _ in dec.modules()) + 8     # longer than any index the decoder uses
    first = "first_chunk" if "first_chunk" in inspect.signature(dec.forward).parameters else None
    stem = [fsm.conv2, dec.conv1, dec.middle[0], dec.middle[1]]
    # ComfyUI 0.33+ decodes latent frames in pairs (``Decoder3d.run_up``): its causal cache keeps only the
    # frames of the last call (2 per cached layer), so chunks of 1 latent frame would lose context; exact
    # chunks are its own calls (the first frame, then pairs), which ``decode_streamed`` runs unchanged.
    pairs = hasattr(dec, "run_up")
    return StagedDecoder(run=fsm.decode, stem=stem, boundary=dec.middle[2], tail=list(dec.upsamples) + list(dec.head),
                         cache_module=dec, cache_kwarg="feat_cache", new_cache=lambda: [None] * n_cache,
                         first_call_kwarg=first, stream_module=dec if pairs else None,
                         own_chunk_frames=2 if pairs else 0)


# ------------------------------------------------------------------------------------- measure
def _spatial_scale(vae) -> int:
    r = vae.upscale_ratio
    return int(r[-1]) if isinstance(r, (tuple, list)) else int(r)


def _out_frames(vae, t: int) -> int:
    r = vae.upscale_ratio
    return int(r[0](t)) if isinstance(r, (tuple, list)) and callable(r[0]) else t


def _probe_crop(latent: torch.Tensor) -> torch.Tensor:
    """The corner of the first sample the probe decodes: at most 32x32 latent px (all frames; callers trim)."""
    return latent[:1, ..., :min(latent.shape[-2], 32), :min(latent.shape[-1], 32)]


def measure_cost(vae, staged: StagedDecoder | None, latent: torch.Tensor,
                 whole_bpp: float | None = None) -> tuple[DecodeCost, float, str]:
    """Bytes per output pixel of the whole decode and of a tile, from small probe decodes.

    Returns (cost, halo_px, method). The probe is a crop of the latent (at most 32x32; 2 frames, or for a
    decoder that chunks time itself, two of its chunks, so that one steady-state chunk is measured).
    whole_bpp: the whole decode's cost when already measured (another split of the same decoder).
    """
    dev = torch.device(vae.device)
    s = _spatial_scale(vae)
    probe = _probe_crop(latent)
    ph, pw = probe.shape[-2:]
    if probe.ndim == 5:
        probe = probe[:, :, :2 * staged.own_chunk_frames if staged is not None and staged.streamed else 2]
    probe = probe.to(dev, vae.vae_dtype)
    frame_px = ph * pw * s * s
    if whole_bpp is None:
        with torch.inference_mode():
            _, whole = measure_peak_bytes(lambda: vae.first_stage_model.decode(probe), dev)
        whole_bpp = whole.peak_bytes / frame_px
    else:
        whole = PeakMeasurement(int(whole_bpp * frame_px), peak_method(dev))
    out_bpp = 0.0
    if probe.ndim == 5:
        out_bpp = 2 * 3 * torch.tensor([], dtype=vae.vae_dtype).element_size()
    if staged is None:
        return DecodeCost(whole_bpp, whole_bpp, output_bytes_per_px=out_bpp, method=whole.method), 0.0, whole.method
    stem_out, stem_m = measure_peak_bytes(lambda: run_stem(staged, probe), dev)
    stem_scale = stem_out.shape[-1] // pw
    halo = measure_halo(staged, stem_out, s // stem_scale)
    stats, _ = collect_tail_stats(staged, stem_out, 0, 1.0)
    runner = _TailRunner(staged, stem_out)
    runner.norms.frozen(stats)

    def tail():
        with torch.inference_mode(), override_forwards(runner.replacements()):
            cache = staged.new_cache() if staged.causal else None
            d = _frames_dummy(probe)
            if d.ndim == 5 and not staged.streamed:
                d = d[:, :, :1]           # one latent frame: the chunk tiles of a causal decoder run
            return runner.run(d, cache)

    _, tail_m = measure_peak_bytes(tail, dev)
    tile_px = frame_px
    # a decoder that runs all frames at once (LTX on 0.8, HunyuanVideo on 0.3.64) costs in proportion to the
    # frames it outputs (its full-resolution activations dominate); one that chunks time itself (LTX on 0.33)
    # costs about one chunk, which the probe's frames cover
    per_video = 1.0
    if staged.whole_frames and not chunks_time_itself(vae):
        per_video = _out_frames(vae, latent.shape[2]) / _out_frames(vae, probe.shape[2])
    cost = DecodeCost(whole_bytes_per_px=whole_bpp * per_video,
                      tile_bytes_per_px=tail_m.peak_bytes / tile_px * 1.1 * per_video,   # +10%: blend + weights
                      stem_bytes_per_px=stem_m.peak_bytes / frame_px * per_video,
                      stored_bytes_per_px=stem_out.numel() * stem_out.element_size() / frame_px
                      / ((probe.shape[2] if staged.whole_frames else stem_out.shape[2]) if stem_out.ndim == 5 else 1),
                      output_bytes_per_px=out_bpp, method=whole.method)
    return cost, halo, whole.method


def measure_stream(vae, staged: StagedDecoder, latent: torch.Tensor) -> tuple[list[TimeUnit], float, float, str]:
    """The time units of a decoder streamed through time, what one chunk costs, and whether streaming is exact.

    Returns (units, base, per latent frame of the chunk, problem): costs in bytes per output px of a frame,
    without the output frames (they leave per chunk; the caller adds them where they stay on the device);
    ``problem`` is "" or why streaming was refused (then ``units`` is empty). Units come from a 2x2-latent,
    2-frame probe. Costs come from streaming a crop (at most 8x8 latent px; the units' latency plus the longest
    batch, in latent frames) in chunks of 1 and 2; the chunk of 1 is also compared with a whole decode of the
    crop under the same random state (LTX's decode adds noise), so a unit whose context was under-measured, or
    glue that mixes frames across units, refuses streaming instead of decoding wrong frames.
    """
    dev = torch.device(vae.device)
    tiny = latent[:1, :, :2, :2, :2].to(dev, vae.vae_dtype).clone()
    try:
        units = measure_units(staged.run, staged.time_units, tiny)
    except ConfigError as exc:
        return [], 0.0, 0.0, str(exc)
    frames = min(latent.shape[2], math.ceil(stream_latency(units)) + max(batch_frames(units, 2)) + 2)
    probe = latent[:1, :, :frames, :min(latent.shape[-2], 8), :min(latent.shape[-1], 8)].to(dev, vae.vae_dtype)
    probe = probe.clone()       # its own storage: the live-tensor count would otherwise count all of the latent
    frame_px = probe.shape[-2] * probe.shape[-1] * _spatial_scale(vae) ** 2

    # Where frames go: off the device as each chunk ends, so they are not part of a chunk's cost. On a GPU the
    # CPU is off the device; on the CPU the live-tensor count sees everything, so the frames go to "meta" there
    # and the chunk of 1 runs once more for the comparison.
    sink = "cpu" if dev.type == "cuda" else "meta"

    def decode(chunk: int | None, to: str = sink) -> torch.Tensor:
        with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []), torch.inference_mode():
            torch.manual_seed(0)       # the same noise LTX's decode adds, in every decode compared
            if chunk is None:
                return staged.run(probe).to("cpu", torch.float32)
            return decode_time_streamed(staged.run, staged.time_decoder, units, probe, chunk, output_device=to)

    outs, peaks = [], []
    for chunk in (1, 2):
        out, m = measure_peak_bytes(lambda: decode(chunk), dev)
        outs.append(out)
        peaks.append(m.peak_bytes / frame_px)
    whole = decode(None)
    streamed = outs[0] if sink == "cpu" else decode(1, "cpu")
    db = psnr(whole, streamed, data_range=float(whole.abs().max()) or 1.0) \
        if streamed.shape == whole.shape else -math.inf
    if db < 30:
        return [], 0.0, 0.0, (f"the streamed probe differs from the whole decode ({db:.1f} dB): a time unit's context "
                              "was under-measured or glue mixes frames across units")
    per_frame = max(0.0, peaks[1] - peaks[0])
    return units, max(peaks[0] - per_frame, 0.0) * 1.1, per_frame * 1.1, ""      # +10%: shorter probe windows


def _decode_takes_output_buffer(fsm) -> bool:
    """LTX on ComfyUI 0.33 walks the frames in chunks sized from the card and writes them to an output buffer."""
    return "output_buffer" in inspect.signature(fsm.decode).parameters


def chunks_time_itself(vae) -> bool:
    return _decode_takes_output_buffer(vae.first_stage_model)


def layered_supported(staged: StagedDecoder | None, latent: torch.Tensor) -> bool:
    """The layered decode runs image decoders whose tail is local (KL: no attention above the stem)."""
    return staged is not None and latent.ndim == 4 and not staged.causal and not staged.streamed


def measure_layered(vae, staged: StagedDecoder, latent: torch.Tensor) -> float:
    """Bytes per output pixel of the layered decode, from a probe decode of a crop (at most 32x32 latent px)."""
    dev = torch.device(vae.device)
    s = _spatial_scale(vae)
    probe = _probe_crop(latent).to(dev, vae.vae_dtype)
    ph, pw = probe.shape[-2:]
    _, m = measure_peak_bytes(lambda: decode_layered(staged.run, staged.tail, probe, bands=LAYERED_BANDS,
                                                     output_device=dev), dev)
    return m.peak_bytes / (ph * pw * s * s) * 1.05         # +5%: the probe's bands are shorter than the image's


# ------------------------------------------------------------------------------------- memory
def free_other_models(vae, plan=None) -> str:
    """Unload every model but this VAE from the VAE's device through ComfyUI's memory manager, except the ones kept
    on the GPU across phases on purpose (``_kept_resident``): unloading those would cost a copy home and a reload
    every generation."""
    import comfy.model_management as mm

    dev = torch.device(vae.device)
    if dev.type == "cpu":
        return "VAE runs on the CPU: nothing to unload"
    keep, why = _kept_resident(mm, plan)
    # the VAE itself: unloaded with the others, load_models_gpu below would copy it back at once
    keep = keep + [lm for lm in mm.current_loaded_models if lm.model is vae.patcher and lm not in keep]
    before = mm.get_free_memory(dev)
    # ComfyUI books a model under its load device (``cuda:0``); a VAE may name the device without its index
    for d in {lm.device for lm in mm.current_loaded_models if _same_device(lm.device, dev)}:
        mm.free_memory(1e30, d, keep_loaded=keep)
    mm.soft_empty_cache()
    mm.load_models_gpu([vae.patcher], force_full_load=getattr(vae, "disable_offload", False))
    after = mm.get_free_memory(dev)
    line = f"unloaded other models: free {before / GIB:.2f} -> {after / GIB:.2f} GiB (VAE loaded)"
    if why:
        line += "; kept loaded: " + "; ".join(why)
    return line


def _same_device(a, b: torch.device) -> bool:
    a = torch.device(a)
    return a.type == b.type and (a.index or 0) == (b.index or 0)


def _kept_resident(mm, plan) -> tuple[list, list[str]]:
    """The loaded models that stay through the decode, and why: a PhaseOffload component the plan keeps on the GPU
    across phases, or (no PhaseOffload) the diffusion model or text encoder a connected plan keeps resident."""
    from ..core.types import Residency
    from .phase import _component

    def planned_resident(name: str) -> bool:
        try:
            c = plan.component(name) if plan is not None else None
        except (KeyError, AttributeError):
            return False
        return c is not None and getattr(c, "residency", None) is Residency.RESIDENT

    try:
        from comfy.model_base import BaseModel
    except ImportError:        # pragma: no cover - every ComfyUI has it
        BaseModel = ()
    keep, why = [], []
    # the plan describes one diffusion model: with several loaded (a refiner, another expert) it is not known which
    dits = [lm for lm in mm.current_loaded_models
            if isinstance(getattr(getattr(lm, "model", None), "model", None), BaseModel)]
    for lm in list(mm.current_loaded_models):
        patcher = getattr(lm, "model", None)
        if patcher is None:
            continue
        if stays_on_gpu(lm.device, getattr(patcher, "offload_device", "cpu")):
            # its offload device is the GPU it is on (--highvram, --gpu-only): an unload frees nothing there and only
            # unpatches its LoRA, patched again at its next load
            keep.append(lm)
            why.append(f"{type(getattr(patcher, 'model', patcher)).__name__} (ComfyUI's offload device for it is "
                       "this GPU: --highvram or --gpu-only; unloading it would free nothing)")
            continue
        comp = _component(patcher)
        if comp is not None:
            reason = "PhaseOffload keeps it on the GPU across phases (the plan's residency)" if comp.resident else None
            name = comp.name
        elif (isinstance(getattr(patcher, "model", None), BaseModel) and len(dits) == 1
              and planned_resident("diffusion_model")):
            name, reason = "diffusion_model", "the plan keeps it resident"
        elif getattr(patcher, "is_clip", False) and planned_resident("text_encoder"):
            name, reason = "text_encoder", "the plan keeps it resident"
        else:
            continue
        if reason:
            keep.append(lm)
            why.append(f"{name} ({reason})")
    return keep, why


def budget_bytes(vae, settings: TiledDecodeSettings) -> tuple[int, str]:
    import comfy.model_management as mm

    if settings.memory_budget_gb > 0:
        return int(settings.memory_budget_gb * GIB), f"budget {settings.memory_budget_gb:g} GB (given)"
    dev = torch.device(vae.device)
    free = mm.get_free_memory(dev)
    # at least a byte: a budget of nothing is a decode that fits nowhere, which falls back to ComfyUI's tiles
    budget, line = max(1, int(free * 0.9)), f"budget 90% of free memory on {dev} ({free / GIB:.2f} GiB free)"
    args = getattr(sys.modules.get("comfy.cli_args"), "args", None)
    reserve = getattr(mm, "extra_reserved_memory", lambda: 0)() if getattr(args, "reserve_vram", None) else 0
    if dev.type != "cpu" and reserve and free - reserve < budget:
        # --reserve-vram: the room the user keeps for other programs stays free during the decode too
        budget = max(1, int(free - reserve))
        line = (f"budget {budget / GIB:.2f} GiB: free memory on {dev} ({free / GIB:.2f} GiB) less ComfyUI's "
                f"--reserve-vram ({reserve / GIB:.2f} GiB)")
    return budget, line


# ------------------------------------------------------------------------------------- decode
_MISMATCH_HINT = ("The latent and the VAE come from different model families (an SDXL latent into a FLUX VAE, a FLUX "
                  "latent into a Wan VAE): connect the VAE that matches the model that made the latent.")


def tiled_decode(vae, samples: torch.Tensor, settings: TiledDecodeSettings, plan=None) -> tuple[torch.Tensor, str]:
    """Decode ``samples`` like VAEDecode (IMAGE [N, H, W, C], video frames flattened into N) and a report.

    A latent the VAE cannot decode is an error that says so (ComfyUI's VAEDecode fails there with a bare
    convolution or index error): a 4-D image latent into a video VAE before anything runs, a channel count the
    decoder rejects when it does."""
    settings.validate()
    require_vae(vae)
    vae.throw_exception_if_invalid()
    if not isinstance(samples, torch.Tensor):
        raise IncompatibleInput("samples", "a LATENT tensor", samples)
    if samples.is_nested:
        samples = samples.unbind()[0]
    dropped = ""
    if vae.latent_dim == 2 and samples.ndim == 5:
        if samples.shape[2] > 1:
            dropped = (f"a video latent of {samples.shape[2]} frames into an image VAE: only its first frame is "
                       "decoded, as VAEDecode does (connect the video model's VAE to decode every frame)")
        samples = samples[:, :, 0]
    if samples.ndim not in (4, 5):
        raise ConfigError("samples", tuple(samples.shape), "a 4-D image or 5-D video latent",
                          "This is an audio or other 1-D latent, which no image node decodes; use VAEDecodeAudio for "
                          "audio, or ComfyUI's VAEDecode.")
    channels = getattr(vae, "latent_channels", None)
    if vae.latent_dim == 3 and samples.ndim == 4:
        raise ConfigError("samples", tuple(samples.shape),
                          f"a 5-D video latent [batch, {channels}, frames, height, width] for this video VAE",
                          "This is a 4-D image latent. " + _MISMATCH_HINT)
    try:
        images, report = _tiled_decode(vae, samples, settings, plan)
    except RuntimeError as e:
        wrong = channel_mismatch(e, vae, samples)
        if wrong is not None:
            raise wrong from e
        raise
    return images, (f"{dropped}\n{report}" if dropped else report)


def channel_mismatch(error: BaseException, vae, samples: torch.Tensor) -> ConfigError | None:
    """The error to raise when ``error`` is the decoder refusing the latent's channel count, else None. The
    decoder's first convolution names the channels it takes; LTX's per-channel statistics fail first, naming both
    sizes (ComfyUI's own latent_channels is not set for every VAE it loads, so it only confirms that case)."""
    m = re.search(r"to have (\d+) channels, but got (\d+) channels", str(error))
    if m is not None and int(m.group(2)) == samples.shape[1] != int(m.group(1)):
        takes = int(m.group(1))
    else:
        m = re.search(r"size of tensor a \((\d+)\) must match the size of tensor b \((\d+)\) at non-singleton "
                      r"dimension 1\b", str(error))
        if m is None or int(m.group(1)) != samples.shape[1] or int(m.group(2)) != getattr(vae, "latent_channels", None):
            return None
        takes = int(m.group(2))
    return ConfigError("samples", f"{samples.shape[1]} channels", f"{takes}-channel latents (what this VAE decodes)",
                       _MISMATCH_HINT)


def _plan_line(plan, size: tuple[int, int, int],
               decoded: Callable[[int, int, int], tuple[int, int, int]]) -> str:
    """What a connected Recommend plan predicted for the decode, and whether it was made for this decode's size
    (width, height, frames; ``decoded`` maps the size a plan was made for to what its latent decodes to: whole
    latent cells, the VAE's frame rule).

    Recommend sizes tiles from a formula before anything runs; this node measures the VAE itself and picks exact
    overlaps, the layered decode or the least-work tiles, so the plan's sizes are only reported. A plan made for
    another size (a 1024x1024 plan on a 2048x2048 decode) predicted another decode: the line says so."""
    vae_plan = getattr(plan, "vae", None)
    tiling = getattr(vae_plan, "tiling", None)
    if tiling is not None:
        line = (f"plan (Recommend) predicted a tiled decode: {tiling.tile_px}px tiles, {tiling.overlap_px}px overlap"
                + (f", {tiling.temporal_frames}-frame chunks" if tiling.temporal_frames else "")
                + f", peak {tiling.peak_bytes / GIB:.2f} GiB")
    else:
        peak = int(getattr(plan, "vae_decode_peak_bytes", 0) or 0)
        line = "plan (Recommend) predicted the whole decode" + (f", peak {peak / GIB:.2f} GiB" if peak else "")
    line += "; this node plans from its own measurement instead (sizes set on the node still apply)"
    work = getattr(plan, "workload", None) or {}
    try:
        planned = (int(work["width"]), int(work["height"]), int(work.get("frames", 1) or 1))
    except (KeyError, TypeError, ValueError):
        return line
    if decoded(*planned) != size:
        def text(w: int, h: int, f: int) -> str:
            return f"{w}x{h}" + (f", {f} frames" if f > 1 else "")
        line += (f". The plan was made for {text(*planned)}; this latent decodes to {text(*size)}, so its "
                 "prediction is for another decode (run Recommend with this size for a matching plan)")
    return line


def _comfy_tiled(vae, samples: torch.Tensor, side: int) -> torch.Tensor:
    """ComfyUI's VAEDecodeTiled exactly as it runs there, ``side`` px tiles overlapping by a quarter. A video decodes
    in its smallest temporal tiles (8 frames, 4 overlapping): this runs when even Levers' smallest plan did not fit,
    and its default 64-frame tiles would need far more than the per-frame cost the side was sized from."""
    import nodes as comfy_nodes      # ComfyUI's own node module

    frames, frame_overlap = (8, 4) if samples.ndim == 5 else (64, 8)
    return comfy_nodes.VAEDecodeTiled().decode(vae, {"samples": samples}, side, side // 4, frames, frame_overlap)[0]


def _fallback_side(s: int, budget: float, cost: DecodeCost) -> int:
    """ComfyUI's VAEDecodeTiled tile side (output px) for a fallback, from the measured cost per pixel. At least 4
    latent px: its tiles overlap by a quarter, and a 32x VAE (LTX) cannot pad the 1-px edge tile that 2-px tiles
    leave on an odd latent."""
    return max(64, 4 * s, min(1024, int(math.sqrt(budget / max(1.0, cost.whole_bytes_per_px))) // 32 * 32))


def _user_tile_over_budget(plan: TilePlan, budget: int, settings: TiledDecodeSettings, rep: DecodeReport, s: int,
                           plan_for: Callable[[int | None], TilePlan], longest: int) -> None:
    """A ``tile_size`` set on the node whose tiles are predicted over the budget: with a ``memory_budget_gb`` set
    too, an error naming both fixes (the budget it needs, the largest tile that fits); on the free memory, a
    warning in the report (the user's tiles run: the prediction may be pessimistic). ``longest``: the frame's long
    side in latent px (a tile between the short and the long side cuts the long axis only)."""
    fits = None
    for k in range(min(settings.tile_size // s, longest) - 1, 0, -1):
        try:
            if plan_for(k).predicted_peak_bytes <= budget:
                fits = k
                break
        except ConfigError:            # the overlap no longer fits inside a tile this small
            break
    if fits:
        advice = f"set tile_size to {fits * s} px or less"
    else:
        try:
            plan_for(None)
            advice = "set tile_size to 0 (the node then plans the decode: layered, exact tiles or chunks)"
        except BudgetExceeded:
            advice = "free memory (no tile size fits this budget, nor does the node's own plan)"
    need = plan.predicted_peak_bytes
    if settings.memory_budget_gb > 0:
        raise BudgetExceeded(need, budget, "VAE decode (tile_size given)",
                             f"Raise memory_budget_gb to at least {math.ceil(need / GIB * 1000) / 1000:.3f}, or "
                             f"{advice}.")
    rep.add(f"warning: tile_size {settings.tile_size} px is predicted to need {need / GIB:.3f} GiB, over the "
            f"{budget / GIB:.3f} GiB budget (the auto budget above); decoding with it as asked. To stay within the "
            f"budget, {advice}.")


def _tiled_decode(vae, samples: torch.Tensor, settings: TiledDecodeSettings, plan) -> tuple[torch.Tensor, str]:
    import comfy.model_management as mm
    import comfy.utils

    rep = DecodeReport()
    staged, why = describe_vae(vae)
    if settings.stats == "windows" and samples.ndim == 5 and staged is not None and staged.tail_norms:
        raise ConfigError("groupnorm_stats", "windows", "tiles or exact for this video VAE",
                          "Window statistics sample single images; video tiles pool their statistics over all "
                          "tiles instead (the default, tiles).")
    s = _spatial_scale(vae)
    if 0 < settings.tile_size < s:
        raise ConfigError("tile_size", settings.tile_size, f"0 (auto) or at least {s} px",
                          f"This VAE decodes {s} output px per latent px, so a tile is at least that wide. Use 0 to "
                          "let the node size the tiles.")
    rep.add(f"VAE: {type(vae.first_stage_model).__name__} ({why}); latent {tuple(samples.shape)}")
    if settings.free_other_models:
        rep.add(free_other_models(vae, plan))
    mm.load_models_gpu([vae.patcher], force_full_load=getattr(vae, "disable_offload", False))
    budget, budget_why = budget_bytes(vae, settings)
    rep.add(budget_why)

    video = samples.ndim == 5
    tile, overlap, tsize = settings.tile_size, settings.overlap, settings.temporal_size
    # user sizes in latent px: tiles round down (at most the size asked for), a non-zero overlap rounds up (a
    # smaller one would become 0, hard seams)
    tile_lat = tile // s if tile else None
    overlap_lat = -(-overlap // s) if overlap else None
    # a tile covering the frame asks for no tiles: the node plans as on auto (layered, deeper stem, streaming)
    tiles_asked = tile_lat is not None and not (tile_lat >= samples.shape[-2] and tile_lat >= samples.shape[-1])
    t_compress = max(1, round(_out_frames(vae, 64) / 64)) if video else 1
    if plan is not None:
        def decoded(w: int, h: int, f: int) -> tuple[int, int, int]:
            """What a latent made for w x h x f (as ComfyUI's latent nodes make it) decodes to."""
            return w // s * s, h // s * s, _out_frames(vae, (f - 1) // t_compress + 1) if video else 1
        rep.add(_plan_line(plan, (samples.shape[-1] * s, samples.shape[-2] * s,
                                  _out_frames(vae, samples.shape[2]) if video else 1), decoded))
    own = video and staged is not None and staged.streamed
    streams = video and staged is not None and bool(staged.time_units)
    all_frames = video and staged is not None and (staged.streamed or staged.whole_frames)
    chunk_frames = max(1, tsize // t_compress) if (tsize and video) else None
    if own and chunk_frames is not None:
        chunk_frames = staged.own_chunk_frames      # the decoder's own calls; other sizes would cut its state
    try:
        cost, halo_px, method = measure_cost(vae, staged, samples)
    except Exception as e:
        if staged is None or isinstance(e, mm.InterruptProcessingException) or channel_mismatch(e, vae, samples):
            raise
        # the layout was recognised but a probe through its split failed: a variant Levers misreads. Stand aside
        # (ComfyUI decodes it) rather than fail a decode ComfyUI can do
        log.warning("levers: probing the split of %s failed", type(vae.first_stage_model).__name__, exc_info=True)
        rep.add(f"standing aside: probing this decoder's split failed ({type(e).__name__}: {e}); ComfyUI's own "
                "decode instead")
        staged, own, streams, all_frames = None, False, False, False
        cost, halo_px, method = measure_cost(vae, None, samples)
    frame_px = samples.shape[-2] * samples.shape[-1] * s * s
    if not tiles_asked and layered_supported(staged, samples) and cost.whole_bytes_per_px * frame_px > budget:
        cost = dataclasses.replace(cost, layered_bytes_per_px=measure_layered(vae, staged, samples))
    units: list[TimeUnit] = []
    n_out = _out_frames(vae, samples.shape[2]) if video else 1
    whole_need = samples.shape[0] * (cost.whole_bytes_per_px + cost.output_bytes_per_px * n_out) * frame_px
    if streams and not tiles_asked and (chunk_frames is not None or whole_need > budget):
        units, base, per_frame, problem = measure_stream(vae, staged, samples)
        if problem:
            rep.add(f"no streamed temporal chunks: {problem}")
        else:
            if torch.device(vae.output_device).type == torch.device(vae.device).type:
                # the frames stay on the decode's device and accumulate while chunks run (output_bytes_per_px
                # counts two copies of a frame; the second, their concatenation, comes after the last chunk)
                base += cost.output_bytes_per_px / 2 * n_out
            cost = dataclasses.replace(cost, stream_base_bytes_per_px=base, stream_frame_bytes_per_px=per_frame)
    rep.add(f"measured ({method}): whole decode {cost.whole_bytes_per_px:.0f} B/px, tile {cost.tile_bytes_per_px:.0f} "
            f"B/px, stem {cost.stem_bytes_per_px:.0f} B/px"
            + (f", layered {cost.layered_bytes_per_px:.0f} B/px" if cost.layered_bytes_per_px else "")
            + (f", streamed chunk {cost.stream_base_bytes_per_px:.0f} + {cost.stream_frame_bytes_per_px:.0f} B/px per "
               "latent frame" if units else "")
            + f"; tail receptive field {halo_px:.0f} px")

    # chunks and tiles put their pieces on ComfyUI's output device (float32): when that is the decode's device
    # (--gpu-only, --cpu-vae) the finished output stays beside the work (streamed chunks count it in their measured
    # base, so the planner adds it to tiles and unstreamed chunks only)
    kept_output = (samples.shape[0] * n_out * frame_px * 3 * 4
                   if torch.device(vae.output_device).type == torch.device(vae.device).type else 0)

    def plan_at(tile_latent: int | None) -> TilePlan:
        """The plan with tiles of ``tile_latent`` latent px (None: the planner's own)."""
        return plan_decode(tuple(samples.shape), s, cost, budget, halo_px=halo_px,
                           tile=tile_latent, overlap=overlap_lat,
                           # a decoder that runs every frame of a tile in one call (no carried state): its tile
                           # cost is the whole video's already, and temporal_size does not apply (reported below)
                           chunk_frames=None if all_frames and not own and not units else chunk_frames,
                           spatial_supported=staged is not None,
                           temporal_supported=staged is not None and (staged.causal or staged.streamed or
                                                                      bool(units)),
                           out_frames=_out_frames(vae, samples.shape[2]) if video else None,
                           auto_chunk_frames=staged.own_chunk_frames if own else 1,
                           tile_out_frames=_out_frames(vae, samples.shape[2]) if all_frames else 0,
                           kept_output_bytes=kept_output)

    try:
        plan = plan_at(tile_lat)
    except BudgetExceeded as exc:
        if staged is not None and settings.memory_budget_gb > 0:
            # a budget the user set: say what it would take rather than exceed it
            raise BudgetExceeded(exc.needed_bytes, exc.available_bytes, exc.component,
                                 f"Raise memory_budget_gb to at least {math.ceil(exc.needed_bytes / GIB * 1000) / 1000:.3f} (or 0 = 90% of "
                                 "the free memory).") from exc
        if staged is not None:
            # Even Levers' smallest plan (its whole-image stem, or the smallest exact tile) needs more than the
            # free memory. Fail soft, as ComfyUI's VAEDecode does on OOM: ComfyUI's own tiled decode, whose tiles
            # run the whole decoder (no stem), sized from the measured cost per pixel; its seams are blended.
            side = _fallback_side(s, budget, cost)
            # its peak: one tile of the whole decoder at the measured cost (Levers' smallest plan's need is in the
            # reason; it is not this decode's)
            plan = TilePlan("comfy_tiled", 1, (side // s, side // s), max(1, side // 4 // s), None,
                            int(cost.whole_bytes_per_px * side * side), budget,
                            f"Levers' smallest exact plan does not fit the free memory ({exc}); ComfyUI's own tiled "
                            f"decode instead, {side}px tiles sized from the measured cost (blended seams, not exact)",
                            exact=False)
            rep.add("fallback: ComfyUI's VAEDecodeTiled (even Levers' smallest plan does not fit the free memory)")
        else:
            # Nothing Levers can do better for this VAE: stand aside. ComfyUI's own decode retries with its own
            # tiled decode when it runs out of memory, which beats failing here on a prediction.
            plan = TilePlan("whole", 1 if video else samples.shape[0], None, 0, None, exc.needed_bytes, budget,
                            f"predicted over the budget ({exc}); Levers has no seamless tiling for this VAE, so it "
                            "stands aside: ComfyUI's own decode, which falls back to its tiled decode on "
                            "out-of-memory", exact=True)
            rep.add("standing aside: ComfyUI's own VAE decode (it retries with VAEDecodeTiled's method on OOM)")
    if tiles_asked and plan.mode == "spatial" and plan.predicted_peak_bytes > budget:
        _user_tile_over_budget(plan, budget, settings, rep, s, plan_at, max(samples.shape[-2:]))
    if plan.mode == "spatial" and not tiles_asked and not video:
        default_norms, default_halo = len(staged.tail_norms), halo_px
        for alt, scale_label in deeper_stems(vae, staged):
            try:
                alt_cost, alt_halo, _ = measure_cost(vae, alt, samples, whole_bpp=cost.whole_bytes_per_px)
                alt_plan = plan_decode(tuple(samples.shape), s, alt_cost, budget, halo_px=alt_halo,
                                       overlap=overlap_lat)
            except BudgetExceeded:
                continue
            except Exception as e:
                if isinstance(e, mm.InterruptProcessingException):
                    raise
                # a variant whose deeper split Levers misreads: the default split, already planned, decodes it
                log.warning("levers: probing a deeper split of %s failed", type(vae.first_stage_model).__name__,
                            exc_info=True)
                rep.add(f"deeper stem at {scale_label} skipped: its probe failed ({type(e).__name__}: {e})")
                continue
            if alt_plan.mode != "spatial":
                continue
            staged, cost, halo_px, plan = alt, alt_cost, alt_halo, alt_plan
            rep.add(f"deeper stem: the stages up to {scale_label} of the output scale run whole (the deepest split "
                    f"that fits): {len(alt.tail_norms)} tiled GroupNorms instead of {default_norms}, receptive "
                    f"field {alt_halo:.0f} px instead of {default_halo:.0f} px (stem {alt_cost.stem_bytes_per_px:.0f} "
                    f"B/px, tile {alt_cost.tile_bytes_per_px:.0f} B/px)")
            break
    if plan.mode == "temporal" and own:
        rep.add(f"the decoder walks the frames in its own chunks ({staged.own_chunk_frames} latent frames, carrying "
                "its causal state): chunks are its own calls, run unchanged; each call's frames leave the device")
    if plan.mode == "spatial" and all_frames:
        # the decoder's own chunks carry state a different chunking would cut, or it is not causal (LTX): one
        # native decode call per tile
        plan = dataclasses.replace(plan, chunk_frames=samples.shape[2])
        rep.add("each tile decodes all frames in one call of the decoder" +
                (" (which walks them in its own chunks)" if own or chunks_time_itself(vae) else ""))
    rep.add("plan: " + plan.describe(s))
    rep.add("why: " + plan.reason)
    if plan.mode == "temporal" and units:
        rep.add(f"streamed through time: {len(units)} time units keep their context frames (radius "
                + "/".join(str(u.radius) for u in units[:1] + units[-1:]) + " frames at the first/last unit; the last "
                f"output frame of a chunk waits for {stream_latency(units):.1f} latent frames after it)")
    if video and tsize and own and plan.mode in ("spatial", "temporal") \
            and max(1, tsize // t_compress) != staged.own_chunk_frames:
        rep.add(f"temporal_size {tsize} not used: this decoder walks the frames in its own chunks "
                f"({staged.own_chunk_frames} latent frames, carrying its causal state), which a different chunking "
                "would cut")
    if video and tsize and staged is not None and staged.whole_frames and not (plan.mode == "temporal" and units):
        rep.add("temporal_size ignored: this decoder carries no causal state between calls, so each tile decodes "
                "all frames in one call" + (" (the decoder chunks time itself)" if chunks_time_itself(vae) else ""))
    if not video and (tsize or settings.temporal_overlap):
        rep.add("temporal_size / temporal_overlap ignored: an image latent has no frames to chunk")
    if video and settings.temporal_overlap:
        rep.add("temporal_overlap ignored: chunks " + ("stream each unit's context frames" if units else
                                                       "carry the causal cache") + ", so they need no overlap")
    if plan.mode in ("whole", "layered", "temporal") and (overlap or settings.stats != "tiles"):
        unused = " and ".join(x for x, on in ((f"overlap {overlap} px", bool(overlap)),
                                              (f"groupnorm_stats={settings.stats}", settings.stats != "tiles")) if on)
        rep.add(f"{unused} not used: they apply to spatial tiles, and this decode ({plan.mode}) has none")

    latent = samples.to(torch.device(vae.device), vae.vae_dtype)
    dev = torch.device(vae.device)
    pbar = {"bar": None}

    def progress(done: int, total: int) -> None:
        if pbar["bar"] is None:
            pbar["bar"] = comfy.utils.ProgressBar(total)
        pbar["bar"].update_absolute(done, total)

    interrupt = mm.throw_exception_if_processing_interrupted
    info = DecodeStats()
    layered = LayeredStats()
    streamed = StreamStats()
    t0 = time.perf_counter()

    def run():
        if plan.mode == "comfy_tiled":
            return _comfy_tiled(vae, samples, plan.tile[0] * s)
        if plan.mode == "whole":
            outs = []
            for i in range(0, samples.shape[0], plan.batch_per_pass):
                interrupt()
                outs.append(vae.decode(samples[i:i + plan.batch_per_pass]))      # ComfyUI's own path
                progress(min(i + plan.batch_per_pass, samples.shape[0]), samples.shape[0])
            return torch.cat(outs, 0)
        if plan.mode == "layered":
            out = decode_layered(staged.run, staged.tail, latent, bands=LAYERED_BANDS, output_device=vae.output_device,
                                 progress=progress, interrupt=interrupt, info=layered)
        elif plan.mode == "temporal" and units:
            out = decode_time_streamed(staged.run, staged.time_decoder, units, latent, plan.chunk_frames,
                                       vae.output_device, progress, interrupt,
                                       total_frames=_out_frames(vae, samples.shape[2]), stats=streamed)
        elif plan.mode == "temporal" and own:
            out = decode_streamed(staged.run, staged.stream_module, latent, vae.output_device, progress, interrupt,
                                  total_frames=_out_frames(vae, samples.shape[2]))
        elif plan.mode == "temporal":
            out = decode_temporal(staged, latent, plan.chunk_frames, vae.output_device, progress, interrupt)
        else:
            method, passes = STATS_CHOICES[settings.stats]
            out = decode_spatial(staged, latent, plan, out_scale=s, stats=method, stats_passes=passes, halo_px=halo_px,
                                 output_device=vae.output_device, progress=progress, interrupt=interrupt, info=info)
        with torch.inference_mode():   # newer process_output works in place on our inference-mode output
            return vae.process_output(out).movedim(1, -1)

    fell_back: list[str] = []

    def attempt():
        """``run``; out of memory in Levers' own modes (a prediction too low for this GPU), ComfyUI's VAEDecodeTiled
        instead, as VAEDecode falls back on OOM. ComfyUI's own decode (whole) handles its OOM itself."""
        try:
            return run()
        except torch.cuda.OutOfMemoryError as exc:
            if plan.mode in ("whole", "comfy_tiled"):
                raise
            oom = f"{type(exc).__name__}"
        fell_back.append(oom)
        # outside the except block: the exception's frames (and the tensors they hold) are gone
        mm.soft_empty_cache()
        side = _fallback_side(s, budget, cost)
        rep.add(f"fallback: out of memory in the {plan.mode} decode ({oom}; predicted "
                f"{plan.predicted_peak_bytes / GIB:.3f} GiB): ComfyUI's VAEDecodeTiled instead, {side}px tiles "
                "(blended seams, not exact)")
        return _comfy_tiled(vae, samples, side)

    images, peak = measure_peak_bytes(attempt, dev) if dev.type == "cuda" else (attempt(), None)
    elapsed = time.perf_counter() - t0
    if plan.mode == "spatial" and not fell_back:
        stats_note = ("no GroupNorm in the tiled stages" if not staged.tail_norms else
                      f"GroupNorm statistics: {settings.stats} ({len(staged.tail_norms)} layers"
                      + ("; one extra pass over the tiles)" if settings.stats == "tiles" else ")"))
        if not plan.exact:
            exactness = "seams blended (overlap below the receptive field)"
        elif staged.tail_norms and settings.stats != "exact":
            exactness = "seams exact, GroupNorm statistics estimated"
        else:
            exactness = "exact by construction"
        rep.add(f"{info.tiles} tiles; {stats_note}; {exactness}")
        rep.add("time by phase: " + ", ".join(f"{k} {v:.2f} s" for k, v in info.phase_s.items()))
    if plan.mode == "layered" and not fell_back:
        halos = ", ".join(f"{k} {v}" for k, v in sorted(layered.halo_rows.items()))
        rep.add(f"layered: {layered.units} modules in up to {layered.bands} row bands, {layered.passes} module passes "
                f"(statistics passes included); rows of context per band: {halos}; exact GroupNorm statistics")
    if plan.mode == "temporal" and units and not fell_back:
        rep.add(f"streamed: {streamed.calls} decoder calls; units computed {streamed.work:.2f}x the frames of the "
                "whole decode (context recomputed per chunk)")
    if peak is not None:
        rep.add(f"peak: predicted {plan.predicted_peak_bytes / GIB:.3f} GiB, measured {peak.peak_bytes / GIB:.3f} GiB "
                f"({peak.method})")
    else:
        rep.add(f"peak: predicted {plan.predicted_peak_bytes / GIB:.3f} GiB (not measured on {dev.type})")
    rep.add(f"decode time {elapsed:.2f} s")
    if images.ndim == 5:
        images = images.reshape(-1, *images.shape[-3:])
    # VAEDecode's dtype (ComfyUI 0.33's --fp16-intermediates makes it float16); the tiled paths build float32
    dtype = vae.vae_output_dtype() if callable(getattr(vae, "vae_output_dtype", None)) else images.dtype
    return images.to(vae.output_device, dtype), rep.text()
