"""What the running ComfyUI already does with memory (feature detection, never version checks)."""
from __future__ import annotations

import sys


def _mm():
    return sys.modules.get("comfy.model_management")


def dynamic_vram_active() -> bool:
    """DynamicVRAM (comfy-aimdo) streams weights itself: a dynamic patcher class is installed and on."""
    mem = sys.modules.get("comfy.memory_management")
    if mem is not None and getattr(mem, "aimdo_enabled", False):
        return True
    mp = sys.modules.get("comfy.model_patcher")
    dyn = getattr(mp, "ModelPatcherDynamic", None) if mp else None
    return bool(dyn is not None and getattr(mp, "CoreModelPatcher", None) is dyn)


def stays_on_gpu(device, offload_device) -> bool:
    """A model on ``device`` that ComfyUI offloads to that same GPU (--highvram, --gpu-only): no unload moves it off,
    and nothing of it is on the host to stream from."""
    import torch

    device = torch.device(device)
    return device.type != "cpu" and device == torch.device(offload_device)


def patcher_is_dynamic(patcher) -> bool:
    fn = getattr(patcher, "is_dynamic", None)
    return bool(fn()) if callable(fn) else False


def comfy_mode() -> dict:
    """A dict of facts plus ``notes`` lines for the Recommend report."""
    mm = _mm()
    if mm is None:
        return {}
    args = getattr(sys.modules.get("comfy.cli_args"), "args", None)
    facts = {
        "dynamic_vram": dynamic_vram_active(),
        "async_offload_streams": int(getattr(mm, "NUM_STREAMS", 0) or 0),
        "pinned_memory": bool(getattr(mm, "MAX_PINNED_MEMORY", 0) and getattr(mm, "MAX_PINNED_MEMORY", 0) > 0),
        "vram_state": getattr(getattr(mm, "vram_state", None), "name", "unknown"),
        "cpu": bool(getattr(args, "cpu", False)),
        "lowvram_flag": bool(getattr(args, "lowvram", False)),
        "reserve_vram_gb": getattr(args, "reserve_vram", None),
        # what ComfyUI keeps free for other programs (400 MiB on Linux, 600 MiB on Windows, or --reserve-vram)
        "extra_reserved_vram_bytes": _extra_reserved(mm),
    }
    notes = []
    if facts["dynamic_vram"]:
        notes.append("ComfyUI DynamicVRAM is active: it streams weights into VRAM per module itself; "
                     "Levers keeps its accounting true and only adds what DynamicVRAM lacks")
    if facts["async_offload_streams"]:
        notes.append(f"ComfyUI async offload: {facts['async_offload_streams']} stream(s) for its own lowvram casting")
    if facts["pinned_memory"]:
        notes.append("ComfyUI pins offloaded weights itself (Levers never registers them twice)")
    if facts["lowvram_flag"] and facts["dynamic_vram"]:
        notes.append("--lowvram has no effect under DynamicVRAM")
    facts["gpu_only"] = bool(getattr(args, "gpu_only", False))
    facts["cpu_vae"] = bool(getattr(args, "cpu_vae", False))
    facts["smart_memory"] = not bool(getattr(mm, "DISABLE_SMART_MEMORY", False))
    state = facts["vram_state"]
    if facts["gpu_only"]:
        notes.append("--gpu-only: ComfyUI keeps every model on the GPU (its offload device is the GPU), so plans that "
                     "stream or take turns cannot apply; GroupPrefetch, PhaseOffload and TiledVAEDecode leave such "
                     "models loaded and say so. Start ComfyUI without it for those levers")
    elif state == "HIGH_VRAM":
        notes.append("--highvram: ComfyUI keeps the diffusion model on the GPU (its offload device is the GPU), so a "
                     "plan that streams it or releases it between phases cannot apply to it (GroupPrefetch stands "
                     "aside); the text encoder and the VAE still move")
    elif state in ("LOW_VRAM", "NO_VRAM") and not facts["dynamic_vram"]:
        notes.append(f"--{state.split('_')[0].lower()}vram: ComfyUI loads {'none' if state == 'NO_VRAM' else 'part'} "
                     "of each model and casts the rest per op itself, and puts the text encoder on the CPU; a plan's "
                     "devices set on PhaseOffload override that placement")
    if not facts["smart_memory"]:
        notes.append("--disable-smart-memory: ComfyUI unloads every model after each prompt, so a component the plan "
                     "keeps resident is copied home and loaded again every prompt")
    if facts["cpu_vae"]:
        notes.append("--cpu-vae: ComfyUI decodes on the CPU; the plan's VAE placement and tiling are for the GPU")
    facts["notes"] = tuple(notes)
    return facts


def lowvram_mode_line() -> str | None:
    """A line when ComfyUI runs --lowvram / --novram without DynamicVRAM: it then loads part (or none) of each model
    and casts the rest to the GPU per op itself, which a Levers ledger or report does not count."""
    mm = _mm()
    state = getattr(getattr(mm, "vram_state", None), "name", None)
    if state not in ("LOW_VRAM", "NO_VRAM") or dynamic_vram_active():
        return None
    return (f"ComfyUI runs --{state.split('_')[0].lower()}vram: it loads {'none' if state == 'NO_VRAM' else 'part'} "
            "of what it loads itself and casts the rest to the GPU per op, every step; those copies are ComfyUI's, "
            "not in Levers' byte counts")


def _extra_reserved(mm) -> int | None:
    fn = getattr(mm, "extra_reserved_memory", None)
    value = fn() if callable(fn) else getattr(mm, "EXTRA_RESERVED_VRAM", None)
    return int(value) if isinstance(value, (int, float)) else None


def comfy_device_facts() -> dict:
    """ComfyUI's own view of the torch device and its memory."""
    mm = _mm()
    if mm is None:
        return {}
    dev = mm.get_torch_device()
    out = {"device": str(dev), "is_cpu": getattr(dev, "type", str(dev)) == "cpu"}
    try:
        out["total_bytes"] = int(mm.get_total_memory(dev))
        out["free_bytes"] = int(mm.get_free_memory(dev))
    except (RuntimeError, AttributeError, TypeError):
        pass
    return out


def unload_entries_of(module) -> int:
    """Have ComfyUI unload every loaded model whose torch module is ``module`` (any clone of its patcher), so the
    module's weights are unpatched and back on the offload device; returns how many entries it unloaded."""
    mm = _mm()
    if mm is None:
        return 0
    loaded = mm.current_loaded_models
    mine = [i for i, lm in enumerate(loaded)
            if getattr(lm, "model", None) is not None and getattr(lm.model, "model", None) is module]
    done = 0
    for i in reversed(mine):
        if loaded[i].model_unload():
            loaded.pop(i)
            done += 1
    return done
