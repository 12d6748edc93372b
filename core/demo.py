"""`levers demo`: a tiny random-weight DiT + VAE decoder, planned by Recommend and run with the levers.

No downloads: the models are built in memory. On a CPU-only machine the levers run through the CPU
transport, so what is shown is the real schedule and byte ledger, not GPU speed.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from .plan import Workload, plan
from .presets import ModelSpec
from .probe import probe
from .report import format_plan


class TinyBlock(nn.Module):
    """A DiT block: adaLN modulation, self-attention, MLP (FLUX/Wan-like shapes at toy size)."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.modulation = nn.Linear(dim, 6 * dim)
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False)
        self.mlp_in = nn.Linear(dim, 4 * dim)
        self.mlp_out = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor, vec: torch.Tensor) -> torch.Tensor:
        # x: [B, N, D]; vec: [B, D]
        shift1, scale1, gate1, shift2, scale2, gate2 = self.modulation(F.silu(vec))[:, None].chunk(6, dim=-1)
        h = self.norm1(x) * (1 + scale1) + shift1
        b, n, d = h.shape
        q, k, v = self.qkv(h).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, d)
        x = x + gate1 * self.proj(a)
        h = self.norm2(x) * (1 + scale2) + shift2
        return x + gate2 * self.mlp_out(F.gelu(self.mlp_in(h), approximate="tanh"))


class TinyDiT(nn.Module):
    def __init__(self, channels: int = 4, dim: int = 256, depth: int = 8, heads: int = 4, patch: int = 2):
        super().__init__()
        self.patch, self.channels = patch, channels
        self.img_in = nn.Linear(channels * patch * patch, dim)
        self.time_in = nn.Sequential(nn.Linear(64, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.blocks = nn.ModuleList(TinyBlock(dim, heads) for _ in range(depth))
        self.final_norm = nn.LayerNorm(dim, elementwise_affine=False)
        self.final_layer = nn.Linear(dim, channels * patch * patch)

    def forward(self, latent: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        b, c, h, w = latent.shape
        p = self.patch
        x = latent.view(b, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // p) * (w // p), c * p * p)
        freqs = torch.exp(-math.log(10000) * torch.arange(32, dtype=torch.float32) / 32)
        temb = torch.cat([torch.sin(t[:, None] * freqs), torch.cos(t[:, None] * freqs)], dim=-1).to(x.dtype)
        vec = self.time_in(temb)
        x = self.img_in(x)
        for block in self.blocks:
            x = block(x, vec)
        x = self.final_layer(self.final_norm(x))
        return x.view(b, h // p, w // p, c, p, p).permute(0, 3, 1, 4, 2, 5).reshape(b, c, h, w)


class TinyDecoder(nn.Module):
    """A KL-VAE-style decoder: conv stem at latent size, then x2 upsampling stages with GroupNorm."""

    def __init__(self, latent_channels: int = 4, ch: int = 64):
        super().__init__()
        self.conv_in = nn.Conv2d(latent_channels, ch, 3, padding=1)
        stages = []
        for _ in range(3):
            stages += [nn.GroupNorm(8, ch), nn.SiLU(), nn.Upsample(scale_factor=2, mode="nearest"),
                       nn.Conv2d(ch, ch, 3, padding=1)]
        self.up = nn.Sequential(*stages)
        self.norm_out = nn.GroupNorm(8, ch)
        self.conv_out = nn.Conv2d(ch, 3, 3, padding=1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.conv_out(F.silu(self.norm_out(self.up(self.conv_in(z)))))


def init_random_(module: nn.Module, seed: int = 0) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() >= 2:
                fan_in = p[0].numel()
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(fan_in))
            else:
                p.copy_(0.02 * torch.randn(p.shape, generator=g))
    return module


def sample(dit: nn.Module, latent: torch.Tensor, steps: int, after_step=None) -> torch.Tensor:
    """Euler steps of a rectified-flow sampler (the model predicts velocity); ``after_step(i)`` after each."""
    x = latent
    ts = torch.linspace(1.0, 0.0, steps + 1)
    with torch.no_grad():
        for i in range(steps):
            v = dit(x, ts[i].expand(x.shape[0]) * 1000)
            x = x + (ts[i + 1] - ts[i]) * v
            if after_step is not None:
                after_step(i)
    return x


@dataclass
class DemoReport:
    text: str
    data: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return self.data


def _psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    mse = torch.mean((a.float() - b.float()) ** 2).item()
    rng = (a.max() - a.min()).item() or 1.0
    return float("inf") if mse == 0 else 10 * math.log10(rng * rng / mse)


def run_demo(steps: int = 4, size: int = 256, seed: int = 0) -> DemoReport:
    torch.manual_seed(seed)
    dit = init_random_(TinyDiT(), seed).eval()
    decoder = init_random_(TinyDecoder(), seed + 1).eval()
    n_params = sum(p.numel() for p in dit.parameters())
    spec = ModelSpec(name="demo-tiny-dit", family="custom", dit_params=float(n_params),
                     dit_kept_params=float(sum(p.numel() for n, p in dit.named_parameters()
                                               if not n.startswith("blocks."))),
                     modulation_params=float(sum(p.numel() for n, p in dit.named_parameters() if "modulation" in n)),
                     hidden=256, n_blocks=len(dit.blocks), block_fraction=0.95, te_params=0.0, te_names=(),
                     te_hidden=256, text_tokens=0, vae_params=float(sum(p.numel() for p in decoder.parameters())),
                     latent_channels=4, vae_spatial=8, vae_temporal=1, patch=2, vae_bytes_per_px=64 * 4 * 3)
    machine = probe()
    wl = Workload(width=size, height=size, frames=1, steps=steps)
    the_plan = plan(spec, wl, machine)
    latent = torch.randn(1, 4, size // 8, size // 8, generator=torch.Generator().manual_seed(seed))
    lines = [format_plan(the_plan, machine), "", "Run (tiny random-weight pipeline, this machine):"]
    data: dict = {"plan": the_plan.to_dict(), "levers": {}}

    t0 = time.perf_counter()
    ref = sample(dit, latent, steps)
    t_ref = (time.perf_counter() - t0) / steps
    with torch.no_grad():
        image_ref = decoder(ref)
    lines.append(f"- resident baseline: {t_ref * 1e3:.1f} ms/step, {n_params / 1e6:.2f} M params")
    data["levers"]["baseline"] = {"ms_per_step": round(t_ref * 1e3, 2)}

    for name, fn in (("QuantizeDiT fp8", _lever_quant), ("PhaseOffload", _lever_phase),
                     ("GroupPrefetch", _lever_prefetch), ("TiledVAEDecode", _lever_tiled_vae)):
        try:
            line, info = fn(dit, decoder, latent, ref, image_ref, steps)
        except ModuleNotFoundError as exc:
            line, info = f"not in this build ({exc.name})", {"skipped": str(exc)}
        lines.append(f"- {name}: {line}")
        data["levers"][name] = info
    peak = _peak_memory_bytes()
    lines.append(f"- peak memory: {peak[0] / 2**20:.0f} MiB ({peak[1]})")
    data["peak_memory_bytes"], data["peak_memory_source"] = peak
    return DemoReport("\n".join(lines), data)


def _peak_memory_bytes() -> tuple[int, str]:
    """Peak device memory on CUDA, else the process's peak resident set (Linux/macOS)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.max_memory_allocated()), "cuda.max_memory_allocated"
    try:
        import resource
        import sys

        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(rss if sys.platform == "darwin" else rss * 1024), "process peak RSS"
    except ImportError:  # Windows
        return 0, "unavailable on this OS"


def _lever_quant(dit, decoder, latent, ref, image_ref, steps):
    from .quant import QuantConfig, quantize_model

    qdit, report = quantize_model(dit, QuantConfig(format="fp8_e4m3fn"))
    t0 = time.perf_counter()
    out = sample(qdit, latent, steps)
    ms = (time.perf_counter() - t0) / steps * 1e3
    p = _psnr(ref, out)
    before, after = report.size_before, report.size_after
    unchanged = torch.equal(sample(dit, latent, steps), ref)
    return (f"{before / 2**20:.1f} -> {after / 2**20:.1f} MiB, latent PSNR {p:.1f} dB vs bf16/fp32, "
            f"{ms:.1f} ms/step; original model bit-identical afterwards: {unchanged}",
            {"bytes_before": before, "bytes_after": after, "psnr_db": round(p, 2), "original_unchanged": unchanged})


def _lever_phase(dit, decoder, latent, ref, image_ref, steps):
    from .residency.phase import PhaseConfig, apply_phase_offload
    from .residency.transport import make_transport

    transport = make_transport("cpu")
    handle = apply_phase_offload(dit, PhaseConfig(name="diffusion_model", pin="off"), transport)
    try:
        handle.onload()
        out = sample(dit, latent, steps)
        handle.offload()
        ledger = transport.ledger.snapshot()
    finally:
        handle.remove()
    same = torch.equal(out, ref)
    return (f"onload {ledger['h2d_bytes'] / 2**20:.1f} MiB, offload {ledger['d2h_bytes']} bytes (pointer swap), "
            f"output bit-identical: {same}", {"ledger": ledger, "bit_identical": same})


def _lever_prefetch(dit, decoder, latent, ref, image_ref, steps):
    from .residency.prefetch import PrefetchConfig, apply_group_prefetch
    from .residency.transport import make_transport

    transport = make_transport("cpu")
    block_bytes = sum(p.numel() * p.element_size() for p in dit.blocks[0].parameters())
    cfg = PrefetchConfig(blocks_per_group=2, prefetch_depth=1, resident_groups=1, pin=False)
    handle = apply_group_prefetch(dit, cfg, transport, bandwidth=0)
    h2d_after_step: list[int] = []
    try:
        transport.ledger.reset()
        out = sample(dit, latent, steps, after_step=lambda i: h2d_after_step.append(transport.ledger.h2d_bytes))
        ledger = transport.ledger.snapshot()
        # The first step also loads the resident group, once. Per step means a steady-state step: the last
        # one, or (at --steps 1) one more step measured on its own.
        if steps == 1:
            with torch.no_grad():
                dit(latent, torch.zeros(latent.shape[0]))
            steady = transport.ledger.h2d_bytes - ledger["h2d_bytes"]
        else:
            steady = h2d_after_step[-1] - h2d_after_step[-2]
    finally:
        handle.remove()
    same = torch.equal(out, ref)
    once = ledger["h2d_bytes"] - steady * steps
    return (f"{len(dit.blocks)} blocks in groups of 2, 1 resident: {steady / 2**20:.1f} MiB streamed per step "
            f"({steady / block_bytes:.0f} blocks) after a one-time {once / 2**20:.1f} MiB load of the resident "
            f"group ({once / block_bytes:.0f} blocks), {ledger['d2h_bytes']} bytes back; output bit-identical: {same}",
            {"h2d_bytes_per_step": steady, "h2d_bytes_once": once, "h2d_bytes_total": ledger["h2d_bytes"],
             "steps": steps, "block_bytes": block_bytes, "d2h_bytes": ledger["d2h_bytes"], "bit_identical": same})


def _lever_tiled_vae(dit, decoder, latent, ref, image_ref, steps):
    from .tiling import DecodeStats, StagedDecoder, TilePlan, decode_spatial

    staged = StagedDecoder(run=decoder, stem=[], boundary=decoder.conv_in,
                           tail=[decoder.up, decoder.norm_out, decoder.conv_out])
    h, w = ref.shape[-2:]
    tile = max(4, h // 2)                                  # half the latent side, in latent units
    overlap = max(2, tile // 4)
    tile_plan = TilePlan("spatial", 1, (tile, tile), overlap, None, 0, 0, "demo: tiles of half the image side")
    info = DecodeStats()
    t0 = time.perf_counter()
    with torch.no_grad():
        # halo: the tail is three 3x3 convs after x2 upsamplings and one at full size: < 16 output px
        out = decode_spatial(staged, ref, tile_plan, out_scale=8, halo_px=16.0, stats="windows", info=info)
    seconds = time.perf_counter() - t0
    p = _psnr(image_ref, out)
    # The overlap makes the grid one tile wider than side // tile: count what the decode ran, not the division.
    grid = (f"{info.tiles} tiles of {tile * 8}px overlapping by {overlap * 8}px" if info.tiles != 1 else
            f"1 tile of {tile * 8}px (the whole image: --size is no larger than one tile)")
    return (f"{grid}, with GroupNorm statistics from a whole-image sample: PSNR vs untiled {p:.1f} dB "
            f"({seconds:.2f} s)",
            {"psnr_db": round(p, 2), "tiles": info.tiles, "tile_px": tile * 8, "overlap_px": overlap * 8})
