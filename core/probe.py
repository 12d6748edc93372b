"""Machine capabilities, each with the reason when it is unknown or unusable.

Every probe is a small function, cached unless its answer changes while ComfyUI runs (free VRAM, available
RAM); nothing here runs at import time, and nothing
initialises CUDA unless ``probe()`` is called on a machine that has it.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import io
import logging
import math
import warnings
import os
import platform
import time
from dataclasses import asdict, dataclass, field, replace

GiB = 1024 ** 3

# Effective host->device bandwidth by bus when it cannot be measured (about 80% of the spec, seed 000).
PCIE_TABLE_GBPS = {"pcie3x16": 12.0, "pcie4x16": 25.0, "pcie5x16": 50.0, "sxm-h100": 50.0}
DEFAULT_PINNED_GBPS = 25.0     # PCIe 4.0 x16, the common consumer case
PAGEABLE_FRACTION = 0.45       # pageable copies reach roughly half of pinned (seed 002: 2-16 GB/s)

# Dense bf16 tensor throughput (TFLOP/s) by GPU name fragment; efficiency applied separately.
GPU_TFLOPS = [("h200", 989), ("h100", 989), ("b200", 2250), ("a100", 312), ("l40", 362), ("a6000", 155),
              ("5090", 209), ("4090", 165), ("5080", 113), ("4080", 97), ("5070", 62), ("4070", 58),
              ("3090", 71), ("3080", 60), ("4060", 30), ("3060", 25), ("2080", 40), ("t4", 65)]
CPU_TFLOPS = 0.3
# When only the card's memory is known (--vram-gb on a machine without that GPU), assume a typical card of that size.
TFLOPS_BY_VRAM_GIB = [(8, 30.0), (12, 50.0), (16, 97.0), (24, 165.0), (32, 209.0), (48, 181.0), (80, 989.0)]


def assumed_tflops(vram_gib: float) -> float:
    for size, tf in TFLOPS_BY_VRAM_GIB:
        if vram_gib <= size:
            return tf
    return 989.0


@dataclass(frozen=True)
class Capability:
    ok: bool
    reason: str = ""


@dataclass(frozen=True)
class GPU:
    index: int
    name: str
    total_bytes: int
    free_bytes: int
    capability: tuple[int, int]
    # VRAM held outside this process's torch allocator when probed (other programs, this process's CUDA context);
    # None when not measured (a card given by size)
    others_bytes: int | None = None

    @property
    def bf16(self) -> bool:
        return self.capability >= (8, 0)

    @property
    def fp8_compute(self) -> bool:
        return self.capability >= (8, 9)

    @property
    def device(self) -> str:
        return f"cuda:{self.index}"

    @property
    def tflops(self) -> float:
        low = self.name.lower()
        for frag, tf in GPU_TFLOPS:
            if frag in low:
                return float(tf)
        return assumed_tflops(self.total_bytes / GiB)


@dataclass(frozen=True)
class Bandwidth:
    pinned_gbps: float
    pageable_gbps: float
    source: str          # "measured" | "table" | "override"
    reason: str = ""


@dataclass(frozen=True)
class Machine:
    os: str                          # linux | windows | wsl | darwin
    gpus: tuple[GPU, ...]
    ram_total_bytes: int | None
    ram_available_bytes: int | None
    ram_reason: str
    bandwidth: Bandwidth
    libraries: dict = field(default_factory=dict)   # name -> Capability
    comfyui: dict = field(default_factory=dict)     # filled by the bridge inside ComfyUI
    notes: tuple[str, ...] = ()

    @property
    def gpu(self) -> GPU | None:
        return self.gpus[0] if self.gpus else None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["libraries"] = {k: asdict(v) for k, v in self.libraries.items()}
        return d


def detect_os() -> str:
    system = platform.system().lower()
    if system == "linux":
        try:
            with open("/proc/version", encoding="utf-8") as f:
                if "microsoft" in f.read().lower():
                    return "wsl"
        except OSError:
            pass
        return "linux"
    return system or "unknown"


def host_ram() -> tuple[int | None, int | None, str]:
    """(total, available, source) now: read at every probe, since available RAM changes while ComfyUI runs."""
    try:
        import psutil

        vm = psutil.virtual_memory()
        return int(vm.total), int(vm.available), "psutil"
    except Exception:       # no psutil, or psutil failing in a container: /proc/meminfo, else a note
        pass
    try:
        info = {}
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                k, v = line.split(":", 1)
                info[k] = int(v.split()[0]) * 1024
        return info["MemTotal"], info.get("MemAvailable", info["MemFree"]), "/proc/meminfo"
    except (OSError, KeyError, ValueError) as exc:
        return None, None, f"host RAM unknown: no psutil and /proc/meminfo unreadable ({exc})"


def cuda_usable() -> Capability:
    try:
        import torch
    except ImportError:
        return Capability(False, "torch is not installed")
    except OSError as exc:       # a broken install: a DLL or shared library torch needs does not load
        return Capability(False, f"torch does not load ({exc})")
    if not torch.cuda.is_available():
        return Capability(False, "torch sees no CUDA device (CPU build, no driver, or CUDA_VISIBLE_DEVICES empty)")
    return Capability(True, f"{torch.cuda.device_count()} CUDA device(s)")


def gpus() -> tuple[GPU, ...]:
    """The CUDA devices with their memory now (free memory changes while ComfyUI runs, so it is read at every probe)."""
    if not cuda_usable().ok:
        return ()
    import torch

    out = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        try:
            free, total = torch.cuda.mem_get_info(i)
            others = max(0, int(total) - int(free) - int(torch.cuda.memory_reserved(i)))
        except RuntimeError:
            free, total, others = props.total_memory, props.total_memory, None
        out.append(GPU(i, props.name, int(total), int(free), (props.major, props.minor), others))
    return tuple(out)


@functools.lru_cache(maxsize=4)
def measure_h2d_bandwidth(nbytes: int = 128 * 1024 ** 2, repeats: int = 3, device: int = 0) -> Bandwidth:
    """Time pinned and pageable host->device copies (well under a second in total)."""
    cap = cuda_usable()
    if not cap.ok:
        return Bandwidth(DEFAULT_PINNED_GBPS, DEFAULT_PINNED_GBPS * PAGEABLE_FRACTION, "table",
                         f"not measured ({cap.reason}); assuming PCIe 4.0 x16")
    import torch

    dev = torch.device("cuda", device)
    n = nbytes // 2
    dst = None

    def timed(src) -> float:
        dst.copy_(src, non_blocking=True)  # warm-up
        torch.cuda.synchronize(dev)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize(dev)
            best = min(best, time.perf_counter() - t0)
        return nbytes / best / 1e9

    try:
        # inside the try: a card other programs (or ComfyUI's loaded models) fill is a table figure, not an error
        dst = torch.empty(n, dtype=torch.float16, device=dev)
        pageable = torch.empty(n, dtype=torch.float16)
        page_gbps = timed(pageable)
        try:
            pinned = torch.empty(n, dtype=torch.float16, pin_memory=True)
            pin_gbps = timed(pinned)
            reason = ""
        except RuntimeError as exc:
            pin_gbps = page_gbps
            reason = f"pinning failed ({exc}); pinned = pageable"
        return Bandwidth(round(pin_gbps, 2), round(page_gbps, 2), "measured", reason)
    except RuntimeError as exc:
        return Bandwidth(DEFAULT_PINNED_GBPS, DEFAULT_PINNED_GBPS * PAGEABLE_FRACTION, "table",
                         f"measurement failed ({exc}); assuming PCIe 4.0 x16")


@contextlib.contextmanager
def quiet_import():
    """Optional libraries log about kernels built for other GPUs/Pythons on import; keep reports clean."""
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with contextlib.redirect_stderr(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(previous)


def _module_present(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):         # a broken install: a module without a spec, a half-removed package
        return False


@functools.lru_cache(maxsize=1)
def bitsandbytes_capability() -> Capability:
    if not _module_present("bitsandbytes"):
        return Capability(False, "bitsandbytes is not installed (pip install bitsandbytes)")
    try:
        import torch

        with quiet_import():
            import bitsandbytes.functional as bnbf

        dev = "cuda" if cuda_usable().ok else "cpu"
        w = torch.randn(64, 64, dtype=torch.bfloat16, device=dev)
        q, state = bnbf.quantize_4bit(w, blocksize=64, quant_type="nf4")
        back = bnbf.dequantize_4bit(q, state)
        err = (back.float() - w.float()).norm() / w.float().norm()
        if not torch.isfinite(err) or err > 0.2:
            return Capability(False, f"bitsandbytes nf4 round trip is wrong here (rel. error {float(err):.2f})")
        return Capability(True, f"nf4 kernels work on {dev}")
    except Exception as exc:        # fail soft: a broken CUDA library raises OSError on import, others anything
        return Capability(False, f"bitsandbytes is installed but its kernels fail here: {exc}")


@functools.lru_cache(maxsize=1)
def torchao_capability() -> Capability:
    if not _module_present("torchao"):
        return Capability(False, "torchao is not installed (pip install torchao)")
    try:
        with quiet_import():
            # what QuantizeDiT's int8 quantizer imports (core/quant/int8.py): a torchao whose other parts import
            # but whose primitives do not (an incompatible torch pair) must not plan int8 that QuantizeDiT refuses
            from torchao.quantization.quant_primitives import (MappingType, choose_qparams_affine,  # noqa: F401
                                                               quantize_affine)

        return Capability(True, "torchao int8 weight-only available")
    except Exception as exc:        # fail soft, as above
        return Capability(False, f"torchao is installed but unusable: {exc}")


@functools.lru_cache(maxsize=1)
def fp8_storage_capability() -> Capability:
    try:
        import torch

        t = torch.tensor([1.0, -2.0]).to(torch.float8_e4m3fn).float()
        return Capability(bool(t[1] == -2.0), "float8_e4m3fn casts work")
    except (ImportError, AttributeError, RuntimeError, TypeError) as exc:
        return Capability(False, f"this torch cannot store float8_e4m3fn: {exc}")


def fp8_compute_capability(gpu: GPU | None) -> Capability:
    if gpu is None:
        return Capability(False, "no GPU: fp8 weights are dequantized per layer (memory saving only)")
    if not gpu.fp8_compute:
        return Capability(False, f"{gpu.name} is sm_{gpu.capability[0]}{gpu.capability[1]}; fp8 matmuls need sm_89+")
    return Capability(True, f"{gpu.name} has fp8 tensor cores")


@functools.lru_cache(maxsize=1)
def comfy_kitchen_capability() -> Capability:
    if not _module_present("comfy_kitchen"):
        return Capability(False, "comfy-kitchen is not installed (ComfyUI's quantized-tensor kernels)")
    return Capability(True, "comfy-kitchen present")


@functools.lru_cache(maxsize=1)
def triton_capability() -> Capability:
    if not _module_present("triton"):
        return Capability(False, "Triton is not installed: GroupPrefetch's packed_bf16 (and the fused fp8 activation "
                                 "kernel) need it on CUDA")
    return Capability(True, "Triton present (packed-bf16 unpack and fp8 activation kernels)")


def libraries() -> dict[str, Capability]:
    return {"bitsandbytes": bitsandbytes_capability(), "torchao": torchao_capability(),
            "fp8_storage": fp8_storage_capability(), "comfy_kitchen": comfy_kitchen_capability(),
            "triton": triton_capability()}


@functools.lru_cache(maxsize=1)
def _probe_cached(measure: bool) -> Machine:
    total, avail, ram_reason = host_ram()
    gs = gpus()
    # why measured after the GPUs: the bandwidth test's buffers would count as this process's reserved memory
    bw = measure_h2d_bandwidth() if (measure and gs) else Bandwidth(
        DEFAULT_PINNED_GBPS, DEFAULT_PINNED_GBPS * PAGEABLE_FRACTION, "table",
        "no GPU to measure; assuming PCIe 4.0 x16" if not gs else "measurement skipped; assuming PCIe 4.0 x16")
    notes = []
    if not gs:
        notes.append(cuda_usable().reason)
    return Machine(os=detect_os(), gpus=gs, ram_total_bytes=total, ram_available_bytes=avail,
                   ram_reason=ram_reason, bandwidth=bw, libraries=libraries(), notes=tuple(notes))


def probe(measure_bandwidth: bool = True) -> Machine:
    """This machine's facts: bandwidth and libraries measured once per process, free VRAM and RAM read now."""
    base = _probe_cached(measure_bandwidth)
    total, avail, ram_reason = host_ram()
    return replace(base, gpus=gpus() if base.gpus else (), ram_total_bytes=total, ram_available_bytes=avail,
                   ram_reason=ram_reason)


def synthetic_machine(vram_gb: float | None = None, ram_gb: float | None = None, h2d_gbps: float | None = None,
                      base: Machine | None = None, gpu_name: str | None = None,
                      capability: tuple[int, int] = (8, 9)) -> Machine:
    """A machine with user overrides (CLI --vram-gb etc.), keeping probed facts that were not overridden."""
    for name, v in (("vram_gb", vram_gb), ("ram_gb", ram_gb), ("h2d_gbps", h2d_gbps)):
        if v is not None and not math.isfinite(v):
            raise ValueError(f"{name}={v} is not a finite number; give it in {'GB/s' if name == 'h2d_gbps' else 'GiB'}")
        if v is not None and name != "h2d_gbps" and v > 2 ** 40:
            # finite, but its bytes are not (1e300 GiB): no machine has a tebi-GiB of memory
            raise ValueError(f"{name}={v:g} is more memory than any machine has; give it in GiB (e.g. 24)")
    base = base or probe(measure_bandwidth=h2d_gbps is None)
    gs = base.gpus
    if vram_gb is not None:
        if vram_gb < 0:
            raise ValueError(f"vram_gb={vram_gb} is negative; give the card's memory in GiB (0 plans for the CPU)")
        if vram_gb == 0:
            gs = ()
        else:
            name = gpu_name or (gs[0].name if gs else f"{vram_gb:g} GiB GPU (assumed)")
            cap = gs[0].capability if gs else capability
            total = int(vram_gb * GiB)
            gs = (GPU(0, name, total, total, cap),) + tuple(gs[1:])
    total, avail, reason = base.ram_total_bytes, base.ram_available_bytes, base.ram_reason
    if ram_gb is not None:
        if ram_gb <= 0:
            raise ValueError(f"ram_gb={ram_gb} must be positive; give host RAM in GiB")
        total = avail = int(ram_gb * GiB)
        reason = "override"
    notes = [n for n in base.notes if not (vram_gb and "no CUDA" in n) and not (vram_gb and "sees no CUDA" in n)]
    libs = base.libraries
    if vram_gb and not base.gpus:
        notes.append(f"planning for an assumed {vram_gb:g} GiB card (sm_{capability[0]}{capability[1]}, "
                     f"~{assumed_tflops(vram_gb):g} dense bf16 TFLOP/s, typical for that size); no GPU was probed")
        # what this Python lacks (no torch, no bitsandbytes) says nothing of the machine with that card: its
        # formats are planned as available, and the note says what to install there
        missing = {k: c for k, c in libs.items() if not c.ok}
        if missing:
            libs = {k: c for k, c in libs.items() if c.ok}
            notes.append("formats assumed available on that machine (not usable in this Python: "
                         + "; ".join(f"{k}: {c.reason}" for k, c in sorted(missing.items())) + ")")
    bw = base.bandwidth
    if h2d_gbps is not None:
        if h2d_gbps <= 0:
            raise ValueError(f"h2d_gbps={h2d_gbps} must be positive; give host->GPU bandwidth in GB/s (e.g. 25)")
        bw = Bandwidth(float(h2d_gbps), float(h2d_gbps) * PAGEABLE_FRACTION, "override")
    return Machine(os=base.os, gpus=gs, ram_total_bytes=total, ram_available_bytes=avail, ram_reason=reason,
                   bandwidth=bw, libraries=libs, comfyui=base.comfyui, notes=tuple(notes))
