"""Recommend inside ComfyUI: measure the connected MODEL / CLIP / VAE and plan with ComfyUI's facts."""
from __future__ import annotations

import dataclasses
import math

import torch

from ..core.presets import ModelSpec, PRESETS, get_preset
from ..core.probe import GiB, Machine, probe
from ..core.residency import subclass
from ..core.residency.blocks import find_blocks
from .comfy_mode import comfy_device_facts, comfy_mode
from .inputs import require_clip, require_model, require_vae

# ComfyUI model classes (comfy.model_base / diffusion module names) -> preset family and the preset that supplies the
# token and VAE geometry. First match wins: the more specific names come first (Flux2 before flux, HunyuanVideo15 and
# HunyuanImage21 before hunyuan_video, LTXAV before ltx). ComfyUI 0.33's classes: model_base.Flux2, Chroma, HiDream,
# Lumina2 (Lumina 2 and Z-Image), HunyuanVideo15, HunyuanImage21, LTXAV, WAN22 (Wan 2.2 5B; its A14B experts are WAN21).
_FAMILIES = [("flux2", "flux2", "flux2-dev"), ("chroma", "flux", "chroma"), ("flux", "flux", "flux1-dev"),
             # HiDream-O1: pixel space (no VAE), 32x32 RGB patches, text and image in one sequence. No preset is
             # pixel-space; HunyuanImage 2.1's (32x VAE, patch 1) makes the same 32 px a token, where HiDream-I1's
             # (8x, patch 2) made 4x the tokens. Its family stays hidream (text counted in the sequence)
             ("hidream_o1", "hidream", "hunyuanimage-2.1"),
             ("hidream", "hidream", "hidream-i1"), ("lumina", "lumina", "z-image"),
             ("hunyuanvideo15", "hunyuan", "hunyuanvideo-1.5"), ("hunyuanimage21", "hunyuan", "hunyuanimage-2.1"),
             ("wan", "wan", "wan2.1-14b"), ("hunyuanvideo", "hunyuan", "hunyuanvideo"),
             ("hunyuan_video", "hunyuan", "hunyuanvideo"), ("qwen", "qwen", "qwen-image"), ("ltxav", "ltxv", "ltx-2"),
             ("ltx", "ltxv", "ltxv"), ("lightricks", "ltxv", "ltxv"), ("mmdit", "sd3", "sd3.5-large"),
             ("sd3", "sd3", "sd3.5-large"), ("sdxl", "sdxl", "sdxl"), ("unet", "sdxl", "sdxl")]


_FP8 = {getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
        if hasattr(torch, n)}
_PRECISION_LABEL = {"fp8_e4m3fn": "fp8", "int8": "int8", "nf4": "nf4"}


def _format(name: str, t: torch.Tensor) -> tuple[str, str] | None:
    """(what a quantized weight holds, the Precision it is planned as); None for a plain floating-point tensor.
    GGUF's GGMLTensor names its type; a wrapper subclass (ComfyUI's QuantizedTensor, torchao) is told by its bytes
    per weight (under 0.8: a 4-bit layout, whatever dtype its scales have), then by its codes' dtype."""
    qtype = getattr(t, "tensor_type", None)
    if qtype is not None:
        kind = getattr(qtype, "name", str(qtype))
        if kind in ("F32", "F16", "BF16"):
            return None
        return f"gguf {kind}", ("int8" if kind.startswith("Q8") else "nf4")
    if subclass.is_plain(t) or subclass.is_storage(t):
        if t.dtype in _FP8:
            return "fp8", "fp8_e4m3fn"
        return None
    inner = subclass.leaves(t)
    if not inner:
        return None
    where = f" ({type(t).__name__})"
    per_weight = subclass.nbytes(t) / max(1, math.prod(t.shape))
    if per_weight < 0.8:
        return f"4-bit{where}", "nf4"
    dtypes = {x.dtype for _, x in inner}
    if dtypes & _FP8:
        return f"fp8{where}", "fp8_e4m3fn"
    if torch.int8 in dtypes:
        return f"int8{where}", "int8"
    return None


def _tensors(module: torch.nn.Module):
    """Each tensor of ``module`` once: (tensor, weights it encodes, (storage label, Precision) or None).

    Levers' own quantized layers (QuantizeDiT, Load Quantized DiT) hold plain code and scale tensors: their
    ``weight`` encodes out x in weights whatever its packed shape, their scales none. Other tensors encode their
    logical shape (a GGUF or fp8 weight counts the weights, not its bytes)."""
    seen: set[int] = set()
    for m in module.modules():
        levers = getattr(m, "levers_quantized", False)
        for attr, t in [*m._parameters.items(), *m._buffers.items()]:
            if t is None or id(t) in seen:
                continue
            seen.add(id(t))
            if levers and attr in ("weight", "weight_scale"):
                fmt = str(getattr(m, "quant_format", "int8"))
                logical = m.out_features * m.in_features if attr == "weight" else 0
                yield t, logical, (f"{_PRECISION_LABEL.get(fmt, fmt)} (Levers)", fmt)
            else:
                yield t, math.prod(t.shape), _format(attr, t)


def _param_stats(module: torch.nn.Module) -> tuple[int, int, dict]:
    """(weights encoded, bytes held, bytes per storage label)."""
    params, nbytes, by_label = 0, 0, {}
    for t, logical, fmt in _tensors(module):
        n = subclass.nbytes(t)
        params += logical
        nbytes += n
        label = fmt[0] if fmt else str(t.dtype).replace("torch.", "")
        by_label[label] = by_label.get(label, 0) + n
    return params, nbytes, by_label


def _stored(module: torch.nn.Module, blocks: list[torch.nn.Module]) -> dict:
    """``dit_stored*`` fields for a diffusion model that is already quantized, else {}: most of the weights of its
    blocks' matrices are quantized (counted in weights, not bytes: QuantizeDiT keeps the modulation linears 16-bit
    by default, which in bytes can outweigh 4-bit block linears)."""
    in_blocks = {id(t) for b in blocks for t in [*b.parameters(), *b.buffers()]}
    total, matrix, quantized, by_fmt = 0, 0, 0, {}
    for t, logical, fmt in _tensors(module):
        n = subclass.nbytes(t)
        total += n
        if blocks and id(t) not in in_blocks:
            continue
        if fmt is not None:
            by_fmt[fmt] = by_fmt.get(fmt, 0) + n
            quantized += logical
            matrix += logical
        elif len(t.shape) == 2 and t.dtype.is_floating_point:
            matrix += logical
    if not by_fmt or 2 * quantized < matrix:
        return {}
    (label, precision), _ = max(by_fmt.items(), key=lambda kv: kv[1])
    return {"dit_stored_bytes": int(total), "dit_stored": label, "dit_stored_precision": precision}


def _blocks(dm: torch.nn.Module) -> list[torch.nn.Module]:
    """Repeated transformer blocks, found as GroupPrefetch finds them (empty when there are none)."""
    try:
        return [m for _, m in find_blocks(dm).blocks]
    except ValueError:
        return []


def _family(model) -> tuple[str, str]:
    text = " ".join([type(model.model).__name__, type(model.model.diffusion_model).__name__,
                     type(model.model.diffusion_model).__module__]).lower()
    for frag, fam, preset in _FAMILIES:
        if frag in text:
            if fam == "wan" and _latent_channels(model) == 48:
                preset = "wan2.2-ti2v-5b"    # the 5B's class is WanModel like 2.1's: told by its 48-channel latent
            return fam, preset
    return "custom", "flux1-dev"


def _unet_config(model) -> dict:
    """The diffusion model's config as ComfyUI detected it (empty when the model carries none)."""
    return getattr(getattr(model.model, "model_config", None), "unet_config", None) or {}


def _latent_channels(model) -> int | None:
    """Channels of the latent the diffusion model denoises: its config's ``out_dim`` (Wan), else the latent
    format's."""
    config = _unet_config(model)
    if isinstance(config.get("out_dim"), int):
        return config["out_dim"]
    channels = getattr(getattr(model.model, "latent_format", None), "latent_channels", None)
    return channels if isinstance(channels, int) else None


def _hidden(dm: torch.nn.Module) -> int:
    """Most common Linear in_features inside blocks: the residual width (a quantized layer's packed weight has
    another shape, so its ``in_features`` is read where it has one)."""
    counts: dict[int, int] = {}
    for m in dm.modules():
        w = getattr(m, "weight", None)
        width = getattr(m, "in_features", None)
        if not isinstance(width, int):
            width = w.shape[1] if isinstance(w, torch.Tensor) and len(w.shape) == 2 else None
        if width is not None:
            counts[width] = counts.get(width, 0) + 1
    return max(counts, key=counts.get) if counts else 1024


def measure(model=None, clip=None, vae=None, preset: str | None = None,
            model_2=None) -> tuple[ModelSpec, list[str]]:
    """A ModelSpec from the connected models (measured numbers win over the preset's).

    ``model_2``: a second diffusion model sampled after the first (Wan 2.2 A14B's low-noise expert). Of the same
    family, the two are planned as experts, one on the GPU at a time: the larger sets the GPU's share, both the host
    RAM. A model of another family is left out, with a note."""
    notes = []
    if model_2 is not None:
        require_model(model_2, "model_2")
        if model is None:
            model, model_2 = model_2, None
            notes.append("model_2 is connected without model: planned as the diffusion model")
    if model is not None:
        require_model(model)
    if clip is not None:
        require_clip(clip)
    if vae is not None:
        require_vae(vae)
    family = None
    if preset and preset != "auto":
        spec = get_preset(preset)
    elif model is not None:
        family, base = _family(model)
        spec = PRESETS[base]
        notes.append(f"model family detected: {family} (preset {base} supplies token and VAE geometry)")
    else:
        spec = get_preset("flux1-dev")
        notes.append("no preset and no MODEL connected: planning for flux1-dev")
    upd: dict = {}
    if model is not None:
        upd, more, dit_bytes = _measure_dit(model, spec, family)
        notes.extend(more)
    if model_2 is not None:
        upd, more = _second_expert(model, model_2, spec, family, upd, dit_bytes)
        notes.extend(more)
    if model is not None:
        upd.update(_token_geometry(model))
    if clip is not None:
        params, nbytes, _ = _param_stats(clip.cond_stage_model)
        upd.update(te_params=float(params), te_dtype_bytes=max(1, round(nbytes / max(1, params))))
        notes.append(f"text encoder measured: {params / 1e9:.3f} B params ({nbytes / 2**30:.2f} GiB)")
    if vae is not None:
        params, nbytes, _ = _param_stats(vae.first_stage_model)
        upd.update(vae_params=float(params), latent_channels=int(getattr(vae, "latent_channels", spec.latent_channels)))
        ratio = getattr(vae, "upscale_ratio", None)
        if isinstance(ratio, int):
            upd["vae_spatial"] = ratio
        elif isinstance(ratio, tuple) and len(ratio) == 3 and isinstance(ratio[1], int):
            upd["vae_spatial"] = ratio[1]
        notes.append(f"VAE measured: {params / 1e6:.1f} M params")
        if spec.is_video:
            upd.update(_video_vae_time(vae, notes))
    return dataclasses.replace(spec, **upd), notes


def _video_vae_time(vae, notes: list) -> dict:
    """How TiledVAEDecode can split this video VAE in time, read from the decoder itself: a decoder that takes
    every frame in one call with nothing carried between calls (HunyuanVideo on ComfyUI 0.3.64, an LTX decoder
    whose time units cannot stream) has no exact temporal chunks, so its tiles decode all frames. Nothing when the
    layout is one Levers does not read."""
    from .vae import chunks_time_itself, describe_vae

    staged, _ = describe_vae(vae)
    # LTX on 0.8 streams its time units (time_units); on 0.33 it chunks time itself
    if staged is None or not staged.whole_frames or staged.time_units or chunks_time_itself(vae):
        return {}
    notes.append("VAE: this ComfyUI's decoder takes every frame in one call and carries nothing between calls: "
                 "no exact temporal chunks, so a tiled decode is planned with every frame in each tile")
    return {"vae_causal": False, "vae_streamed": False, "vae_whole_video": True}


def _token_geometry(model) -> dict:
    """The diffusion model's own patch (``patch_size``: 2, [1, 2, 2], 16 for Chroma Radiance's pixels, 32 for
    HiDream-O1's), and for a pixel-space model (a 3-channel latent) a VAE factor of 1, so that pixels per token
    (``vae_spatial * patch``) are the model's, whichever preset lends the rest of the geometry. Nothing when the
    model names no patch (the SDXL UNet)."""
    p = _unet_config(model).get("patch_size", getattr(model.model.diffusion_model, "patch_size", None))
    if isinstance(p, int) and not isinstance(p, bool):
        spatial, temporal = p, 1
    elif isinstance(p, (list, tuple)) and 1 <= len(p) <= 3 and all(isinstance(v, int) for v in p):
        spatial, temporal = p[-1], (p[0] if len(p) == 3 else 1)
    else:
        return {}
    if spatial <= 0 or temporal <= 0:
        return {}
    upd = {"patch": spatial, "patch_t": temporal}
    if getattr(getattr(model.model, "latent_format", None), "latent_channels", None) == 3:
        upd["vae_spatial"] = 1                 # pixel space: the "VAE" passes pixels through
    return upd


def _measure_dit(model, spec: ModelSpec, family: str | None) -> tuple[dict, list[str], int]:
    """(ModelSpec fields measured from ``model``'s diffusion model, notes, the bytes it holds)."""
    dm = model.model.diffusion_model
    params, nbytes, by_dtype = _param_stats(dm)
    blocks = _blocks(dm)
    block_params = sum(_param_stats(b)[0] for b in blocks)
    scale = params / spec.dit_params if spec.dit_params else 1.0
    upd = dict(dit_params=float(params), dit_kept_params=spec.dit_kept_params * scale,
               modulation_params=spec.modulation_params * scale, hidden=_hidden(dm),
               n_blocks=max(1, len(blocks)), block_fraction=(block_params / params) if params and blocks else 0.9,
               dit_dtype_bytes=max(1, round(nbytes / max(1, params))), measured=True)
    notes = []
    stored = _stored(dm, blocks)
    upd.update(stored)
    if stored:
        notes.append(f"diffusion model already quantized: {stored['dit_stored']}, {nbytes / GiB:.2f} GiB as "
                     "stored (planned that way)")
    if family:
        upd["family"] = family
    upd["name"] = f"{spec.name} (measured: {params / 1e9:.2f} B params, " + \
        ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in by_dtype.items()) + ")"
    notes.append(f"diffusion model measured: {params / 1e9:.3f} B params in {len(blocks)} blocks, "
                 + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in by_dtype.items()))
    return upd, notes, nbytes


def _second_expert(model, model_2, spec: ModelSpec, family: str | None, upd: dict,
                   bytes_1: int) -> tuple[dict, list[str]]:
    """``upd`` (``model``'s measurement over ``spec``; it holds ``bytes_1``) with ``model_2`` counted as a second
    expert: one expert on the GPU at a time, so the one that holds more bytes is measured for both; notes say what
    was done."""
    fam, _ = _family(model)
    fam_2, _ = _family(model_2)
    if fam_2 != fam:
        return upd, [f"model_2 is a {fam_2} model, not a second {fam} expert: planned without it (plan it with its "
                     "own Recommend)"]
    if model_2.model.diffusion_model is model.model.diffusion_model:
        return upd, ["model_2 is the same diffusion model as model: planned once"]
    upd_2, _, bytes_2 = _measure_dit(model_2, spec, family)
    notes = [f"model_2 measured: {upd_2['dit_params'] / 1e9:.3f} B params, {bytes_2 / GiB:.2f} GiB; planned as a "
             "second expert (one diffusion model on the GPU at a time, both in host RAM)"]
    if bool(upd.get("dit_stored")) != bool(upd_2.get("dit_stored")):
        notes.append("only one of the two models is already quantized: a QuantizeDiT plan applies to the other")
    if bytes_2 > bytes_1:
        # the larger expert is the one that must fit: every measured number is its own
        kept = {k: v for k, v in upd.items() if k not in upd_2 and not k.startswith("dit_stored")}
        upd = {**kept, **upd_2}
        notes.append("model_2 is the larger of the two (in bytes): its measurement is planned for both")
    upd["experts"] = max(2, spec.experts)
    return upd, notes


def host_held_bytes(modules) -> int:
    """Host RAM that ``modules`` and Levers' own page-locked host copies hold now, in memory the OS does not count as
    available: each storage once, file mappings' unwritten pages left out (ComfyUI 0.33's memory-mapped weights, GGUF
    files, a loader's ``torch.load(mmap=True)`` or safetensors tensors kept as loaded: page cache, which the OS counts
    as available already)."""
    from ..core.residency.transport import HostMaps, pinned_ranges_by_levers

    maps = HostMaps.read()
    held: dict[int, int] = {}
    for module in modules:
        for t, _, _ in _tensors(module):
            inner = subclass.leaves(t)
            for x in ([v for _, v in inner] if inner else [subclass.plain(t)]):
                if x.device.type != "cpu":
                    continue
                try:
                    storage = x.untyped_storage()
                    ptr, n = storage.data_ptr(), storage.nbytes()
                except (RuntimeError, NotImplementedError):     # a tensor without its own storage: nothing held
                    continue
                if ptr and ptr not in held:
                    held[ptr] = n - maps.page_cache(ptr, n)
    # masters PhaseOffload or GroupPrefetch keep while the model is on the GPU: the plan's host copies too
    held.update({start: n for start, n in pinned_ranges_by_levers() if start not in held})
    return sum(held.values())


def connected_modules(model=None, clip=None, vae=None, model_2=None) -> list[torch.nn.Module]:
    """The torch modules behind Recommend's MODEL / CLIP / VAE inputs (those connected)."""
    found = [getattr(model, "model", None), getattr(model_2, "model", None),
             getattr(clip, "cond_stage_model", None), getattr(vae, "first_stage_model", None)]
    return [m for m in found if isinstance(m, torch.nn.Module)]


def machine_for_comfy(base: Machine | None = None, modules=()) -> Machine:
    """The probed machine, with ComfyUI's device view and mode folded in. A ComfyUI running with
    --cpu plans for the CPU even when a GPU exists. The RAM the connected ``modules`` (and Levers' host copies)
    hold now is added back to the available RAM: the plan counts them among the host copies it needs, and without
    this a plan made after the loaders ran (or after a run left masters pinned) counted them twice."""
    base = base or probe()
    facts = comfy_mode()
    dev = comfy_device_facts()
    gpus = base.gpus
    if dev.get("is_cpu"):
        gpus = ()
    notes = list(base.notes)
    avail = base.ram_available_bytes
    held = host_held_bytes(modules)
    if avail is not None and held:
        avail = min(base.ram_total_bytes or avail + held, avail + held)
        notes.append(f"host RAM: {base.ram_available_bytes / GiB:.1f} GiB available now, planned with "
                     f"{avail / GiB:.1f} GiB: the connected models and Levers' host copies already hold "
                     f"{held / GiB:.1f} GiB of what the plan counts")
    return dataclasses.replace(base, gpus=gpus, ram_available_bytes=avail, notes=tuple(notes),
                               comfyui={**facts, **{f"device_{k}": v for k, v in dev.items()}})
