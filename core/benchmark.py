"""``levers bench --cpu``: what the engine costs on the CPU, measured (no GPU, no downloads).

Four measurements, each with its own record (and the reason when it could not run):

- quantize: throughput and peak *private* memory of the streaming checkpoint quantizer
  (``levers quantize``) on a synthetic FLUX-shaped bf16 .safetensors file (multi-GB; ``--quick``:
  a few hundred MB), per format. Private = anonymous resident memory (RssAnon), so the
  memory-mapped input does not count and a streaming writer should stay near one tensor.
- vae: tiled vs untiled decode time and activation peak of a FLUX-VAE-shaped decoder (live-tensor
  accounting on the CPU), plus PSNR of the tiled result vs the untiled one.
- recommend: latency of ``plan()`` over the presets and a range of card sizes.
- ledger: the transport's byte ledger per step for GroupPrefetch and per phase for PhaseOffload on a
  small DiT-shaped model (host->device bytes, device->host bytes, copies).

The GPU numbers (bandwidth, step times against ComfyUI's own offload) come from bench/gpu_suite.py.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

GIB = 1024 ** 3
MIB = 1024 ** 2
SCHEMA = "levers-cpu-bench/1"


# --------------------------------------------------------------------------------------------
# shapes shared with bench/gpu_suite.py
# --------------------------------------------------------------------------------------------

class VaeRes(nn.Module):
    def __init__(self, cin: int, cout: int, dd: dict):
        super().__init__()
        self.norm1 = nn.GroupNorm(32, cin, eps=1e-6, **dd)
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1, **dd)
        self.norm2 = nn.GroupNorm(32, cout, eps=1e-6, **dd)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, **dd)
        self.nin_shortcut = nn.Conv2d(cin, cout, 1, **dd) if cin != cout else nn.Identity()

    def forward(self, x, *unused):
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        return self.nin_shortcut(x) + h


class VaeAttn(nn.Module):
    def __init__(self, c: int, dd: dict):
        super().__init__()
        self.norm = nn.GroupNorm(32, c, eps=1e-6, **dd)
        self.q, self.k, self.v = (nn.Conv2d(c, c, 1, **dd) for _ in range(3))
        self.proj_out = nn.Conv2d(c, c, 1, **dd)

    def forward(self, x):
        b, c, h, w = x.shape
        n = self.norm(x)
        q, k, v = (t.reshape(b, 1, c, h * w).transpose(2, 3) for t in (self.q(n), self.k(n), self.v(n)))
        a = F.scaled_dot_product_attention(q, k, v)                   # [B, 1, HW, C]
        return x + self.proj_out(a.transpose(2, 3).reshape(b, c, h, w))


class VaeUp(nn.Module):
    def __init__(self, c: int, dd: dict):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1, **dd)

    def forward(self, x):
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


class VaeDecoderShaped(nn.Module):
    """The FLUX VAE decoder's shape (ComfyUI's ``Decoder``: z 16, channels 512/512/256/128, 3 res
    blocks per level, mid attention at latent resolution, x8 upscale). Smaller ``ch`` for CPU runs."""

    def __init__(self, z: int = 16, ch: tuple[int, ...] = (128, 256, 512, 512), blocks: int = 3,
                 device=None, dtype=torch.float32):
        super().__init__()
        dd = {"device": device, "dtype": dtype}
        top = ch[-1]
        self.conv_in = nn.Conv2d(z, top, 3, padding=1, **dd)
        self.mid = nn.Module()
        self.mid.block_1, self.mid.attn_1, self.mid.block_2 = VaeRes(top, top, dd), VaeAttn(top, dd), VaeRes(top, top, dd)
        self.up = nn.ModuleList()
        cin = top
        for i in reversed(range(len(ch))):
            level = nn.Module()
            level.block = nn.ModuleList()
            for _ in range(blocks):
                level.block.append(VaeRes(cin, ch[i], dd))
                cin = ch[i]
            level.upsample = VaeUp(cin, dd) if i > 0 else nn.Identity()
            self.up.append(level)
        self.norm_out = nn.GroupNorm(32, cin, eps=1e-6, **dd)
        self.conv_out = nn.Conv2d(cin, 3, 3, padding=1, **dd)

    def init_random_(self, seed: int = 0) -> "VaeDecoderShaped":
        g = torch.Generator(device=self.conv_in.weight.device).manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if p.ndim == 1:
                    p.fill_(1.0) if (name.endswith("weight") and "norm" in name) else p.zero_()
                else:
                    p.normal_(0, 1.0 / math.sqrt(p[0].numel()), generator=g)
        return self.eval()

    def forward(self, z):
        # z: [B, 16, h, w] -> [B, 3, 8h, 8w]
        h = self.mid.block_2(self.mid.attn_1(self.mid.block_1(self.conv_in(z))))
        for level in self.up:
            for blk in level.block:
                h = blk(h)
            h = level.upsample(h)
        return self.conv_out(F.silu(self.norm_out(h)))

    def staged(self):
        """For TiledVAEDecode: the stem is everything at latent resolution (attention included);
        the tail is the upsampling stages, run per tile with whole-image GroupNorm statistics."""
        from .tiling import StagedDecoder
        # The modules forward() actually calls: the level containers are never called themselves,
        # so overriding them would not skip anything (the stem pass would run the whole tail).
        tail = [blk for level in self.up for blk in level.block]
        tail += [level.upsample for level in self.up if not isinstance(level.upsample, nn.Identity)]
        return StagedDecoder(run=self.forward, stem=[self.conv_in, self.mid.block_1, self.mid.attn_1],
                             boundary=self.mid.block_2, tail=tail + [self.norm_out, self.conv_out])


def flux_checkpoint_shapes(hidden: int, double: int, single: int, mlp_ratio: int = 4,
                           context: int = 4096) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(key, shape) of a FLUX-style diffusion-model checkpoint with ComfyUI's key names."""
    h, m = hidden, hidden * mlp_ratio
    hd = 128 if hidden % 128 == 0 else hidden // 8
    yield from (("img_in.weight", (h, 64)), ("img_in.bias", (h,)), ("txt_in.weight", (h, context)),
                ("txt_in.bias", (h,)), ("time_in.in_layer.weight", (h, 256)), ("time_in.out_layer.weight", (h, h)))
    for i in range(double):
        for side in ("img", "txt"):
            p = f"double_blocks.{i}.{side}"
            yield from ((f"{p}_mod.lin.weight", (6 * h, h)), (f"{p}_mod.lin.bias", (6 * h,)),
                        (f"{p}_attn.qkv.weight", (3 * h, h)), (f"{p}_attn.qkv.bias", (3 * h,)),
                        (f"{p}_attn.norm.query_norm.scale", (hd,)), (f"{p}_attn.norm.key_norm.scale", (hd,)),
                        (f"{p}_attn.proj.weight", (h, h)), (f"{p}_attn.proj.bias", (h,)),
                        (f"{p}_mlp.0.weight", (m, h)), (f"{p}_mlp.0.bias", (m,)),
                        (f"{p}_mlp.2.weight", (h, m)), (f"{p}_mlp.2.bias", (h,)))
    for i in range(single):
        p = f"single_blocks.{i}"
        yield from ((f"{p}.linear1.weight", (3 * h + m, h)), (f"{p}.linear1.bias", (3 * h + m,)),
                    (f"{p}.linear2.weight", (h, h + m)), (f"{p}.linear2.bias", (h,)),
                    (f"{p}.norm.query_norm.scale", (hd,)), (f"{p}.norm.key_norm.scale", (hd,)),
                    (f"{p}.modulation.lin.weight", (3 * h, h)), (f"{p}.modulation.lin.bias", (3 * h,)))
    yield from (("final_layer.linear.weight", (64, h)), ("final_layer.linear.bias", (64,)),
                ("final_layer.adaLN_modulation.1.weight", (2 * h, h)), ("final_layer.adaLN_modulation.1.bias", (2 * h,)))


class _ToyBlock(nn.Module):
    def __init__(self, d: int, ffn: int):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.o = nn.Linear(d, d)
        self.ffn = nn.Sequential(nn.Linear(d, ffn), nn.GELU(approximate="tanh"), nn.Linear(ffn, d))

    def forward(self, x):
        q, k, v = self.qkv(x).unflatten(-1, (3, 1, -1)).permute(2, 0, 3, 1, 4)   # [3, B, 1, L, D]
        x = x + self.o(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2))
        return x + self.ffn(F.layer_norm(x, x.shape[-1:]))


class ToyDiT(nn.Module):
    """A Wan-style stack (``blocks`` ModuleList) small enough for CPU ledgers."""

    def __init__(self, d: int = 256, ffn: int = 1024, depth: int = 8):
        super().__init__()
        self.patch_embedding = nn.Linear(64, d)
        self.blocks = nn.ModuleList(_ToyBlock(d, ffn) for _ in range(depth))
        self.head = nn.Linear(d, 64)

    def forward(self, x):
        x = self.patch_embedding(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


# --------------------------------------------------------------------------------------------
# measuring helpers
# --------------------------------------------------------------------------------------------

def private_bytes() -> int | None:
    """Anonymous resident memory of this process (Linux RssAnon; psutil RSS elsewhere)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import psutil
        return int(psutil.Process().memory_info().rss)
    except ImportError:
        return None


class PeakSampler:
    """Samples ``private_bytes`` on a thread; ``peak_delta`` is the rise above the start."""

    def __init__(self, interval: float = 0.02):
        self.interval, self.base, self.peak = interval, private_bytes(), private_bytes()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            v = private_bytes()
            if v is not None and (self.peak is None or v > self.peak):
                self.peak = v
            time.sleep(self.interval)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        v = private_bytes()
        if v is not None and (self.peak is None or v > self.peak):
            self.peak = v

    @property
    def peak_delta(self) -> int | None:
        return None if self.base is None or self.peak is None else max(0, self.peak - self.base)


def _r(x: float | None, n: int = 4) -> float | None:
    return None if x is None else round(x, n)


def _git_commit() -> str | None:
    root = Path(__file__).resolve().parents[1]
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def machine_info(name: str | None) -> dict[str, Any]:
    info: dict[str, Any] = {"name": name or f"{os.cpu_count()}-core CPU ({platform.node() or 'host'})",
                            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                            "python": platform.python_version(), "torch": torch.__version__,
                            "platform": platform.platform(), "processor": platform.processor() or None}
    try:
        import psutil
        info["ram_total_gib"] = round(psutil.virtual_memory().total / GIB, 2)
    except ImportError:
        info["ram_total_gib"] = None
    return info


@dataclass(frozen=True)
class Sizes:
    """What one run measures; ``quick`` keeps it under a minute on a 2-core box."""

    ckpt_hidden: int
    ckpt_double: int
    ckpt_single: int
    formats: tuple[str, ...]
    vae_ch: tuple[int, ...]
    vae_blocks: int
    vae_latent: int
    vae_tile: int
    toy_d: int
    toy_depth: int
    toy_tokens: int
    plan_vrams: tuple[float, ...]


QUICK = Sizes(ckpt_hidden=1024, ckpt_double=2, ckpt_single=1, formats=("fp8_e4m3fn", "int8", "nf4"),
              vae_ch=(32, 32, 32, 32), vae_blocks=1, vae_latent=32, vae_tile=16, toy_d=256, toy_depth=8,
              toy_tokens=128, plan_vrams=(8, 16, 24))
FULL = Sizes(ckpt_hidden=3072, ckpt_double=3, ckpt_single=3, formats=("fp8_e4m3fn", "int8", "nf4"),
             vae_ch=(32, 32, 32, 32), vae_blocks=3, vae_latent=128, vae_tile=48, toy_d=512, toy_depth=16,
             toy_tokens=512, plan_vrams=(6, 8, 12, 16, 24, 48))
TINY = Sizes(ckpt_hidden=256, ckpt_double=1, ckpt_single=1, formats=("fp8_e4m3fn",), vae_ch=(32, 32, 32, 32),
             vae_blocks=1, vae_latent=16, vae_tile=8, toy_d=64, toy_depth=4, toy_tokens=32, plan_vrams=(8,))


# --------------------------------------------------------------------------------------------
# the four measurements
# --------------------------------------------------------------------------------------------

def bench_quantize(sizes: Sizes, workdir: str) -> dict[str, Any]:
    from .quant import QuantConfig, get_quantizer
    from .quant.checkpoint import quantize_file, save_tensors

    shapes = list(flux_checkpoint_shapes(sizes.ckpt_hidden, sizes.ckpt_double, sizes.ckpt_single))
    src = os.path.join(workdir, "synthetic-flux-bf16.safetensors")
    g = torch.Generator().manual_seed(0)
    pool = (torch.randn(4 * MIB, generator=g) * 0.02).to(torch.bfloat16)

    def tensors():
        off = 0
        for key, shape in shapes:
            n = math.prod(shape)
            t = torch.empty(n, dtype=torch.bfloat16)
            pos = 0
            while pos < n:             # tile a random pool: GB/s instead of normal_'s MB/s
                s = off % pool.numel()
                k = min(n - pos, pool.numel() - s)
                t[pos:pos + k] = pool[s:s + k]
                pos, off = pos + k, off + k + 7919
            yield key, t.view(shape)

    t0 = time.perf_counter()
    save_tensors(tensors(), src, {"levers_bench": "synthetic FLUX-shaped checkpoint"}, force=True)
    src_bytes = os.path.getsize(src)
    out: dict[str, Any] = {"source": {"shape": f"FLUX-style keys, hidden {sizes.ckpt_hidden}, {sizes.ckpt_double} double + "
                                               f"{sizes.ckpt_single} single blocks, bf16", "bytes": src_bytes,
                                      "tensors": len(shapes), "write_s": _r(time.perf_counter() - t0, 3)},
                           "formats": {}}
    for fmt in sizes.formats:
        ok, why = get_quantizer(fmt).available()
        if not ok:
            out["formats"][fmt] = {"skipped": why}
            continue
        dst = os.path.join(workdir, f"q-{fmt}.safetensors")
        try:
            with PeakSampler() as peak:
                t0 = time.perf_counter()
                report = quantize_file(src, dst, QuantConfig(fmt), force=True, measure=False)
                secs = time.perf_counter() - t0
        except Exception as exc:  # noqa: BLE001 - record and carry on with the next format
            out["formats"][fmt] = {"failed": f"{type(exc).__name__}: {exc}"}
            continue
        biggest = max(math.prod(s) for _, s in shapes) * 2
        out["formats"][fmt] = {
            "seconds": _r(secs, 3), "input_gbps": _r(src_bytes / secs / 1e9, 3), "output_bytes": os.path.getsize(dst),
            "size_ratio": _r(os.path.getsize(dst) / src_bytes, 4), "layers_quantized": len(report.layers),
            "peak_private_bytes": peak.peak_delta, "largest_input_tensor_bytes": biggest,
            "peak_private_vs_largest_tensor": _r(peak.peak_delta / biggest, 2) if peak.peak_delta is not None else None}
        os.unlink(dst)
    os.unlink(src)
    return out


def bench_vae(sizes: Sizes) -> dict[str, Any]:
    from . import tiling

    torch.manual_seed(0)
    dec = VaeDecoderShaped(ch=sizes.vae_ch, blocks=sizes.vae_blocks).init_random_(0)
    z = torch.randn(1, 16, sizes.vae_latent, sizes.vae_latent)
    with torch.inference_mode():
        t0 = time.perf_counter()
        ref, whole = tiling.measure_peak_bytes(lambda: dec(z), "cpu")
        untiled_s = time.perf_counter() - t0
        staged = dec.staged()
        halo = tiling.measure_halo(staged, tiling.run_stem(staged, z), out_per_stem=8)
        overlap = max(1, math.ceil((2 * halo + 1) / 8))
        tile = min(sizes.vae_latent, max(sizes.vae_tile, 2 * overlap))
        plan = tiling.TilePlan("spatial", 1, (tile, tile), overlap, None, 0, 1, "bench: fixed tile size")
        info = tiling.DecodeStats()
        t0 = time.perf_counter()
        out, tiled = tiling.measure_peak_bytes(
            lambda: tiling.decode_spatial(staged, z, plan, out_scale=8, halo_px=halo, info=info), "cpu")
        tiled_s = time.perf_counter() - t0
    mse = float((out.float() - ref.float()).pow(2).mean())
    peak = float(ref.abs().max())
    return {"shape": f"FLUX-VAE-shaped decoder, channels {sizes.vae_ch}, {sizes.vae_blocks} res blocks/level, "
                     f"{sizes.vae_latent * 8}x{sizes.vae_latent * 8} px, fp32",
            "peak_method": whole.method, "untiled_peak_bytes": whole.peak_bytes, "tiled_peak_bytes": tiled.peak_bytes,
            "peak_ratio": _r(tiled.peak_bytes / max(1, whole.peak_bytes), 4), "untiled_s": _r(untiled_s, 3),
            "tiled_s": _r(tiled_s, 3), "tiles": info.tiles, "tile_px": tile * 8, "overlap_px": overlap * 8,
            "halo_px": halo, "psnr_db": _r(math.inf if mse == 0 else 10 * math.log10(peak * peak / mse), 2)}


def bench_recommend(sizes: Sizes) -> dict[str, Any]:
    from .plan import Workload, plan
    from .presets import PRESETS
    from .probe import synthetic_machine

    times, rows = [], 0
    for name, spec in PRESETS.items():
        wl = Workload(width=spec.default_width, height=spec.default_height, frames=spec.default_frames,
                      steps=spec.default_steps)
        for vram in sizes.plan_vrams:
            machine = synthetic_machine(vram_gb=vram, ram_gb=64, h2d_gbps=25)
            t0 = time.perf_counter()
            plan(spec, wl, machine, "balanced")
            times.append(time.perf_counter() - t0)
            rows += 1
    return {"plans": rows, "presets": len(PRESETS), "vram_gib": list(sizes.plan_vrams),
            "latency_ms_median": _r(statistics.median(times) * 1e3, 3), "latency_ms_max": _r(max(times) * 1e3, 3)}


def bench_ledger(sizes: Sizes) -> dict[str, Any]:
    from .residency.phase import PhaseConfig, apply_phase_offload
    from .residency.prefetch import PrefetchConfig, apply_group_prefetch
    from .residency.transport import CpuTransport, RecordingTransport

    torch.manual_seed(0)
    x = torch.randn(1, sizes.toy_tokens, 64)
    out: dict[str, Any] = {}

    model = ToyDiT(sizes.toy_d, 4 * sizes.toy_d, sizes.toy_depth).eval()
    with torch.inference_mode():
        ref = model(x)
    block_bytes = sum(p.numel() * p.element_size() for p in model.blocks.parameters())
    rest = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if not n.startswith("blocks."))
    tr = RecordingTransport(CpuTransport())
    budget = rest + int(max(0.4, 2.5 / sizes.toy_depth) * block_bytes)   # 40% of the blocks, >= 2 slots
    handle = apply_group_prefetch(model, PrefetchConfig(budget_bytes=budget), tr, bandwidth=0)
    try:
        per_step = []
        with torch.inference_mode():
            for _ in range(3):
                before = tr.ledger.snapshot()
                y = model(x)
                after = tr.ledger.snapshot()
                per_step.append({k: after[k] - before[k] for k in ("h2d_bytes", "d2h_bytes", "h2d_copies")})
        st = handle.stats()
        out["group_prefetch"] = {
            "model": f"toy DiT, {sizes.toy_depth} blocks of {block_bytes // sizes.toy_depth} bytes",
            "block_bytes_total": block_bytes, "budget_bytes": budget, "groups": st.get("groups"),
            "blocks_per_group": st.get("blocks_per_group"), "resident_groups": st.get("resident_groups"),
            "streamed_bytes_planned": st.get("streamed_bytes_per_forward"), "per_step": per_step,
            "steady_h2d_bytes_per_step": per_step[-1]["h2d_bytes"], "d2h_bytes_per_step": per_step[-1]["d2h_bytes"],
            "bit_exact": bool(torch.equal(y, ref))}
    finally:
        handle.remove()
    out["group_prefetch_packed"] = _ledger_packed(sizes, x)

    enc = ToyDiT(sizes.toy_d, 4 * sizes.toy_d, sizes.toy_depth).eval()
    with torch.inference_mode():
        ref = enc(x)
    tr = RecordingTransport(CpuTransport())
    ph = apply_phase_offload(enc, PhaseConfig(name="text_encoder", pin="off"), tr)
    try:
        masters = ph.master_ptrs()
        with torch.inference_mode():
            for i in range(2):
                ph.onload(f"encode{i}")
                y = enc(x)
                ph.offload()
        tot = ph.report()["ledger"]["totals"]
        out["phase"] = {"module_bytes": ph.host_bytes, "onloads": tot["onloads"], "onload_h2d_bytes": tot["h2d_bytes"],
                        "h2d_bytes_per_onload": tot["h2d_bytes"] // max(1, tot["onloads"]),
                        "offload_d2h_bytes": tot["offload_d2h_bytes"],
                        "params_on_masters_after_offload": all(p.data_ptr() == masters.get(n, -1)
                                                               for n, p in enc.named_parameters()),
                        "bit_exact": bool(torch.equal(y, ref))}
    finally:
        ph.remove()
    return out


def _ledger_packed(sizes: Sizes, x: torch.Tensor) -> dict[str, Any]:
    """The bf16 toy DiT streamed as stored and losslessly packed at the same budget: bytes per step, bit-exactness."""
    from .residency.prefetch import PrefetchConfig, apply_group_prefetch
    from .residency.transport import CpuTransport, RecordingTransport

    torch.manual_seed(0)
    model = ToyDiT(sizes.toy_d, 4 * sizes.toy_d, sizes.toy_depth).eval().to(torch.bfloat16)
    xb = x.to(torch.bfloat16)
    with torch.inference_mode():
        ref = model(xb)
    block_bytes = sum(p.numel() * p.element_size() for p in model.blocks.parameters())
    rest = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if not n.startswith("blocks."))
    budget = rest + int(max(0.4, 2.5 / sizes.toy_depth) * block_bytes)
    row: dict[str, Any] = {"model": f"toy DiT in bf16, {sizes.toy_depth} blocks", "budget_bytes": budget}
    for packed in (False, True):
        tr = RecordingTransport(CpuTransport())
        t0 = time.perf_counter()
        handle = apply_group_prefetch(model, PrefetchConfig(budget_bytes=budget, packed=packed), tr, bandwidth=0)
        setup = time.perf_counter() - t0
        try:
            with torch.inference_mode():
                for _ in range(3):
                    before = tr.ledger.h2d_bytes
                    y = model(xb)
            st = handle.stats()
            key = "packed" if packed else "as_stored"
            row[key] = {"h2d_bytes_per_step": tr.ledger.h2d_bytes - before, "planned": st["streamed_bytes_per_forward"],
                        "weights_streamed_bytes": st["stream_device_bytes_per_forward"], "packed_active": st["packed"],
                        "staging_bytes": st["staging_bytes"], "setup_s": _r(setup, 3),
                        "pack_s": _r(st["pack_seconds"], 3), "bit_exact": bool(torch.equal(y, ref))}
        finally:
            handle.remove()
    row["wire_ratio"] = _r(row["packed"]["h2d_bytes_per_step"] / max(1, row["as_stored"]["h2d_bytes_per_step"]), 4)
    return row


SECTIONS: dict[str, Callable] = {"quantize": bench_quantize, "vae": bench_vae, "recommend": bench_recommend,
                                 "ledger": bench_ledger}


def run_bench(sizes: Sizes, sections: tuple[str, ...] = tuple(SECTIONS), machine_name: str | None = None,
              workdir: str | None = None, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """All CPU measurements as one JSON-ready dict; a failing section records why and the rest run."""
    result: dict[str, Any] = {"schema": SCHEMA, "commit": _git_commit(), "machine": machine_info(machine_name),
                              "sizes": sizes.__dict__, "results": {}, "skipped": [],
                              "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    t_all = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="levers-bench-", dir=workdir) as tmp:
        for name in sections:
            t0 = time.perf_counter()
            try:
                res = SECTIONS[name](sizes, tmp) if name == "quantize" else SECTIONS[name](sizes)
                res["seconds"] = _r(time.perf_counter() - t0, 2)
            except Exception as exc:  # noqa: BLE001 - one section failing must not lose the others
                res = {"failed": f"{type(exc).__name__}: {exc}", "seconds": _r(time.perf_counter() - t0, 2)}
                result["skipped"].append(f"{name}: {res['failed']}")
            result["results"][name] = res
            if log:
                log(f"{name}: done in {res['seconds']} s")
    result["wall_s"] = _r(time.perf_counter() - t_all, 2)
    return result


def format_text(r: dict[str, Any]) -> str:
    m = r["machine"]
    lines = [f"levers bench --cpu on {m['name']} (torch {m['torch']}, {m['torch_threads']} threads), "
             f"commit {(r.get('commit') or 'unknown')[:12]}, {r['wall_s']} s"]
    q = r["results"].get("quantize", {})
    if "source" in q:
        lines.append(f"quantize: {q['source']['bytes'] / GIB:.2f} GiB {q['source']['shape']}")
        for fmt, v in q["formats"].items():
            if "seconds" in v:
                lines.append(f"  {fmt:<11} {v['input_gbps']:.3f} GB/s in, size x{v['size_ratio']}, peak private "
                             f"{(v['peak_private_bytes'] or 0) / MIB:.0f} MiB ({v['peak_private_vs_largest_tensor']} x "
                             f"the largest tensor)")
            else:
                lines.append(f"  {fmt:<11} {v.get('skipped') or v.get('failed')}")
    elif q:
        lines.append(f"quantize: {q.get('failed')}")
    v = r["results"].get("vae", {})
    if "peak_ratio" in v:
        lines.append(f"vae: {v['shape']}: untiled {v['untiled_peak_bytes'] / MIB:.0f} MiB / {v['untiled_s']} s, tiled "
                     f"{v['tiled_peak_bytes'] / MIB:.0f} MiB / {v['tiled_s']} s ({v['tiles']} tiles; peak x{v['peak_ratio']}, "
                     f"PSNR {v['psnr_db']} dB)")
    elif v:
        lines.append(f"vae: {v.get('failed')}")
    p = r["results"].get("recommend", {})
    if "plans" in p:
        lines.append(f"recommend: {p['plans']} plans, median {p['latency_ms_median']} ms, max {p['latency_ms_max']} ms")
    elif p:
        lines.append(f"recommend: {p.get('failed')}")
    led = r["results"].get("ledger", {})
    if "group_prefetch" in led:
        gp, ph = led["group_prefetch"], led.get("phase", {})
        lines.append(f"ledger: GroupPrefetch {gp['steady_h2d_bytes_per_step'] / MIB:.1f} MiB host->device per step "
                     f"(planned {(gp['streamed_bytes_planned'] or 0) / MIB:.1f}), {gp['d2h_bytes_per_step']} B "
                     f"device->host, bit-exact {gp['bit_exact']}")
        pk = led.get("group_prefetch_packed") or {}
        if "wire_ratio" in pk:
            lines.append(f"        GroupPrefetch packed bf16 {pk['packed']['h2d_bytes_per_step'] / MIB:.1f} MiB per step "
                         f"vs {pk['as_stored']['h2d_bytes_per_step'] / MIB:.1f} MiB as stored (x{pk['wire_ratio']}), "
                         f"bit-exact {pk['packed']['bit_exact']}")
        if ph:
            lines.append(f"        PhaseOffload {ph['h2d_bytes_per_onload'] / MIB:.1f} MiB per onload, "
                         f"{ph['offload_d2h_bytes']} B per offload, bit-exact {ph['bit_exact']}")
    elif led:
        lines.append(f"ledger: {led.get('failed')}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------

def register_cli(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("bench", help="measure the engine on this machine (CPU; the GPU suite is bench/gpu_suite.py)",
                              description="CPU benchmark: quantizer throughput/peak memory, tiled VAE decode, "
                                          "Recommend latency, transport ledgers. The GPU suite lives in bench/gpu_suite.py.")
    p.add_argument("--cpu", action="store_true", help="run the CPU benchmark (required: GPU runs use bench/gpu_suite.py)")
    p.add_argument("--quick", action="store_true", help="small sizes, under a minute")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--out", help="also write the JSON result to this file")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"subset of {','.join(SECTIONS)}")
    p.add_argument("--machine-name", help="how to name this machine in the result (default: N-core CPU (hostname))")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    p.set_defaults(func=run)
    return p


def check_out_file(out: str) -> str | None:
    """Why the JSON result cannot be written to ``out`` (None when it can); checked before the benchmark runs."""
    path = Path(out)
    if path.is_dir():
        return f"--out {out} is a folder; name the JSON file to write, e.g. {path / 'bench.json'}"
    parent = path.absolute().parent
    if not parent.is_dir():
        return f"--out {out}: the folder {parent} does not exist; create it first"
    writable = os.access(path, os.W_OK) if path.exists() else os.access(parent, os.W_OK | os.X_OK)
    if not writable:
        return f"--out {out}: no permission to write there"
    return None


def run(args) -> int:
    if not args.cpu:
        print("levers bench: pass --cpu for the CPU benchmark; GPU numbers come from "
              "`python3 bench/gpu_suite.py --out DIR` (see bench/README.md)", file=sys.stderr)
        return 2
    sections = tuple(s.strip() for s in args.sections.split(",") if s.strip())
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        print(f"levers bench: --sections: unknown {unknown}; choose from {', '.join(SECTIONS)}", file=sys.stderr)
        return 2
    if not sections:
        print(f"levers bench: --sections {args.sections!r} names no section; choose from {', '.join(SECTIONS)} "
              f"(comma-separated)", file=sys.stderr)
        return 2
    if args.threads is not None and args.threads < 1:
        print(f"levers bench: --threads {args.threads}: expected a number of threads >= 1 (omit it for torch's "
              f"choice, {torch.get_num_threads()} here)", file=sys.stderr)
        return 2
    out_problem = check_out_file(args.out) if args.out else None
    if out_problem:
        print(f"levers bench: {out_problem}; nothing was run", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    log = (lambda m: print(m, file=sys.stderr, flush=True)) if args.json else (lambda m: print(m, flush=True))
    result = run_bench(QUICK if args.quick else FULL, sections, args.machine_name, log=log)
    text = json.dumps(result, indent=2)
    print(text if args.json else format_text(result))
    if args.out:
        tmp = f"{args.out}.tmp"
        try:
            # whole or not at all: a full disk must not leave a truncated file, nor empty an earlier run's
            Path(tmp).write_text(text + "\n")
            os.replace(tmp, args.out)
        except OSError as exc:        # checked before the run, so the disk filled up or the folder went away
            Path(tmp).unlink(missing_ok=True)
            print(f"levers bench: could not write --out {args.out}: {exc.strerror or exc}; an earlier file there "
                  "is unchanged, and the results are above", file=sys.stderr)
            return 1
    return 0 if not result["skipped"] else 1
