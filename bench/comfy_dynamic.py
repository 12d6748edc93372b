"""ComfyUI's DynamicVRAM (0.15+ on NVIDIA, comfy-aimdo) on the GPU suite's random-weight DiTs.

Run by ``gpu_suite.py``'s ``dynamic`` section, one process per (model, budget): comfy-aimdo takes
over CUDA allocations for the whole process at init and cannot be undone, and the emulated card
(``--vram-headroom``, what ComfyUI's own flag sets) is fixed at that moment. The process prints
one line ``LEVERS_JSON {...}``; every failure is reported there with a reason, never raised.

    python3 bench/comfy_dynamic.py --comfyui .comfy/yzkee --model flux --budget-gib 12 \
        --total-bytes N [--ref out/refs/flux.pt]

The model, its weights (seeded) and its inputs are the suite's own (``gpu_suite.py``), built from
``comfy.ops.disable_weight_init`` layers and wrapped in ComfyUI's ``ModelPatcherDynamic``; the load
goes through ``comfy.model_management.load_models_gpu`` with the memory estimate the sampler
would pass, as in the suite's legacy baseline. Import order follows ComfyUI's ``main.py``:
``comfy_aimdo.control.init()`` before CUDA starts, ``init_devices`` after ``model_management``.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
GIB = 1024 ** 3


def _load_suite():
    spec = importlib.util.spec_from_file_location("levers_gpu_suite", HERE / "gpu_suite.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod          # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod


class Skip(Exception):
    """The baseline cannot run here; the message says why."""


def _import_comfy(path: Path, headroom: int, budget: int, dry_cpu: bool = False) -> dict:
    """ComfyUI with DynamicVRAM enabled and the card shrunk by ``headroom`` bytes to ``budget``.
    ``dry_cpu``: the same code on ComfyUI's CPU device without aimdo (tests the plumbing only)."""
    import torch
    if dry_cpu:
        sys.path.insert(0, str(path))
        import comfy.options
        comfy.options.enable_args_parsing(False)
        import comfy.cli_args as cli
        cli.args.cpu = True
        import comfy.model_management as mm
        import comfy.model_patcher as mp
        import comfy.ops as ops
        return {"mm": mm, "mp": mp, "ops": ops, "aimdo": None, "device": torch.device("cpu"), "version": "dry-cpu",
                "patcher": mp.ModelPatcher}
    if not torch.cuda.is_available():
        raise Skip("no CUDA device: DynamicVRAM runs only on NVIDIA/AMD GPUs")
    if not (path / "comfy" / "model_patcher.py").is_file():
        raise Skip(f"{path} is not a ComfyUI checkout")
    sys.path.insert(0, str(path))
    import comfy.options
    comfy.options.enable_args_parsing(False)
    import comfy.cli_args as cli
    if not hasattr(cli.args, "enable_dynamic_vram"):
        raise Skip("this ComfyUI predates DynamicVRAM (no --enable-dynamic-vram)")
    cli.args.enable_dynamic_vram = True
    cli.args.vram_headroom = headroom / GIB
    try:
        import comfy_aimdo.control as aimdo
    except ImportError as exc:
        raise Skip(f"comfy-aimdo is not installed ({exc}); DynamicVRAM needs it") from exc
    if not aimdo.init():
        raise Skip("comfy_aimdo.control.init() failed (see log)")
    import comfy.model_management as mm
    import comfy.memory_management
    import comfy.model_patcher as mp
    import comfy.ops as ops
    dev = mm.get_torch_device()
    if getattr(dev, "type", None) != "cuda":
        raise Skip(f"ComfyUI picked {dev}, not a CUDA device")
    try:
        ok = aimdo.init_devices([(dev.index or 0, int(headroom))])
    except TypeError:   # comfy-aimdo 0.4.9 protocol: no per-device headroom
        ok = aimdo.init_devices([dev.index or 0])
    if not ok:
        raise Skip("comfy_aimdo.control.init_devices() failed: no working comfy-aimdo on this machine")
    _emulate_card(mm, budget)
    mp.CoreModelPatcher = mp.ModelPatcherDynamic
    comfy.memory_management.aimdo_enabled = True
    version = "unknown"
    try:
        version = (path / "comfyui_version.py").read_text().split("__version__")[1].split('"')[1]
    except (OSError, IndexError):
        pass
    return {"mm": mm, "mp": mp, "ops": ops, "aimdo": aimdo, "device": dev, "version": version,
            "patcher": mp.ModelPatcherDynamic}


def _emulate_card(mm, budget: int) -> None:
    """ComfyUI's free-memory reads describe a card of ``budget`` bytes (as the suite's legacy
    baseline does); aimdo's own headroom keeps its weight cache inside the same card."""
    sys.path.insert(0, str(HERE))
    from comfy_card import budget_free_memory
    mm.get_free_memory = budget_free_memory(mm, budget)


def build_comfy_model(gs, spec, ops, tensors: dict):
    """The suite's DiT from ComfyUI's ``disable_weight_init`` layers, its weights given the way ComfyUI's
    loaders give them (``load_state_dict(..., assign=True)``, as ``BaseModel.load_model_weights`` does).

    Under DynamicVRAM (``comfy.memory_management.aimdo_enabled``) those layers are built without weights and
    take them only through ``_load_from_state_dict`` (``_lazy_load_from_state_dict``); binding Parameters
    directly, as the legacy baseline does, leaves every Linear's weight None (the 2026-11-30 H200 runs failed
    there). Any key the model does not take is an error, not a silent half-loaded model.
    """
    model = gs.make_meta_model(spec, ops=ops.disable_weight_init)
    missing, unexpected = model.load_state_dict(tensors, strict=False, assign=True)
    if missing or unexpected:
        raise RuntimeError(f"the state dict does not fit the model: missing {list(missing)[:5]}, "
                           f"unexpected {list(unexpected)[:5]}")
    meta = [n for n, p in model.named_parameters() if p.is_meta]
    if meta:
        raise RuntimeError(f"parameters left on the meta device: {meta[:5]}")
    return model


def _device_used(torch, dev) -> int:
    if dev.type != "cuda":
        return 0
    free, total = torch.cuda.mem_get_info(dev)
    return int(total - free)


def run(args, out: dict) -> None:
    gs = _load_suite()
    import torch
    budget = int(args.budget_gib * GIB)
    headroom = max(0, int(args.total_bytes) - budget)
    out.update({"budget_bytes": budget, "vram_headroom_bytes": headroom, "model": args.model})
    c = _import_comfy(Path(args.comfyui).resolve(), headroom, budget, args.dry_cpu)
    if args.dry_cpu and args.lazy_ops:
        import comfy.memory_management
        if not hasattr(comfy.memory_management, "aimdo_enabled"):
            raise Skip("this ComfyUI has no DynamicVRAM layers (comfy.memory_management.aimdo_enabled)")
        comfy.memory_management.aimdo_enabled = True      # the layers' constructors read it
    mm, mp, ops, dev = c["mm"], c["mp"], c["ops"], c["device"]
    out["comfyui_version"] = c["version"]
    if args.dtype:    # the parent's weight dtype, which its reference output was computed in
        gs.DTYPE["value"] = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    spec = {"flux": gs.FLUX, "wan": gs.WAN}[args.model]
    if args.smoke:
        spec = {"flux": gs.SMOKE_FLUX, "wan": gs.SMOKE_WAN}[args.model]
    t0 = time.perf_counter()
    host = gs.HostWeights(gs.make_meta_model(spec), pin=False)
    model = build_comfy_model(gs, spec, ops, host.tensors)
    if args.dry_cpu and args.lazy_ops:
        import comfy.memory_management
        comfy.memory_management.aimdo_enabled = False     # built and loaded as DynamicVRAM does; run on the CPU
    out["host_fill_s"] = round(time.perf_counter() - t0, 2)
    out["weights_bound_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    patcher = c["patcher"](model, load_device=dev, offload_device=torch.device("cpu"))
    out["patcher"] = type(patcher).__name__
    inputs = gs.make_inputs(spec, dev)
    area = spec.latent_area * 2 * 0.01 * spec.comfy_memory_factor * 1024 ** 2   # BaseModel.memory_required
    base_used = _device_used(torch, dev)
    gs.reset_peak(dev)
    t0 = time.perf_counter()
    mm.load_models_gpu([patcher], memory_required=int(2 * area), minimum_memory_required=int(area))
    gs.sync(dev)
    out["load_s"] = round(time.perf_counter() - t0, 3)
    out["loaded_bytes_reported"] = int(patcher.loaded_size())
    out["model_bytes"] = int(patcher.model_size())
    deadline = time.monotonic() + args.seconds
    peaks: list[int] = []

    def step():
        y = model(*inputs)
        peaks.append(_device_used(torch, dev) - base_used)
        return y

    with torch.inference_mode():
        times, y = gs.time_steps(step, dev, args.warmup, args.iters, deadline)
    out.update({"status": "ok", "s_per_step": round(sorted(times)[len(times) // 2], 4),
                "steps_s": [round(t, 4) for t in times],
                "torch_peak_allocated_bytes": gs.peak_allocated(dev),
                "device_used_after_step_bytes": max(peaks) if peaks else None,
                "loaded_bytes_after": int(patcher.loaded_size())})
    out["within_budget"] = None if not peaks else bool(max(peaks) <= budget)
    if args.ref and Path(args.ref).is_file():
        ref = torch.load(args.ref, map_location="cpu")
        out.update(gs.compare(y, ref))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--comfyui", required=True, help="a DynamicVRAM-era ComfyUI checkout (0.15+)")
    p.add_argument("--model", choices=("flux", "wan"), default="flux")
    p.add_argument("--budget-gib", type=float, required=True, help="emulated card (GiB)")
    p.add_argument("--total-bytes", type=int, required=True,
                   help="the card's free memory before this process starts (from the parent)")
    p.add_argument("--ref", help="reference output (torch.save) of the resident model, for bit-exactness")
    p.add_argument("--dtype", choices=("bf16", "fp32"), help="weight dtype (default: the suite's, bf16)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--seconds", type=float, default=60.0, help="stop timing steps after this long")
    p.add_argument("--smoke", action="store_true", help="tiny shapes (the CPU test)")
    p.add_argument("--dry-cpu", action="store_true", help="no aimdo, ComfyUI's CPU device: plumbing test only")
    p.add_argument("--lazy-ops", action="store_true",
                   help="with --dry-cpu: build the layers as DynamicVRAM does (no weights until load_state_dict)")
    args = p.parse_args(argv)
    out: dict = {"status": "failed", "reason": None}
    try:
        run(args, out)
    except Skip as exc:
        out.update({"status": "skipped", "reason": str(exc)})
    except BaseException as exc:  # noqa: BLE001 - the parent needs a reason, not a traceback on stderr
        out.update({"status": "oom" if "out of memory" in str(exc).lower() else "failed",
                    "reason": f"{type(exc).__name__}: {str(exc)[:400]}",
                    "traceback": traceback.format_exc(limit=10)[-3000:]})
    print("LEVERS_JSON " + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
