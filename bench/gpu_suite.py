#!/usr/bin/env python3
"""Levers GPU benchmark suite: every lever measured against ComfyUI's own memory management.

One script for an H100/H200-class card. It writes ``suite.json`` (every number, the commit and the
machine), ``suite.md`` (tables) and ``suite.png`` (plot) into ``--out`` and finishes in about six
minutes: each section has its own deadline, a failure in one is recorded and the next one runs,
and a watchdog writes what exists if the whole run ever overshoots.

    python3 bench/gpu_suite.py --out OUT --comfyui .comfy/pollockjj          # the full run
    python3 bench/gpu_suite.py --out OUT --sections dit --models wan          # rerun a subset
    python3 bench/gpu_suite.py --out OUT --smoke                              # tiny shapes, CPU ok

Sections: bandwidth (pinned / pageable host->device), dit (FLUX- and Wan-shaped random-weight DiTs
under emulated VRAM budgets: resident, Levers GroupPrefetch, ComfyUI's lowvram/async offload),
phase (PhaseOffload re-onload bandwidth and device->host bytes), quant (fp8 / int8 / nf4 vs bf16
on FLUX-shaped linears), vae (TiledVAEDecode peak vs untiled), recommend (predicted vs measured).
Without CUDA every section says it was skipped and why; ``--smoke`` runs all code paths on tiny
shapes on whatever device there is. See bench/README.md for what each number means.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import gc
import inspect
import importlib
import json
import logging
import math
import os
import platform
import statistics
import subprocess
import tempfile
import sys
import threading
import time
import traceback
import types
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "bench") not in sys.path:
    sys.path.insert(0, str(ROOT / "bench"))     # sibling modules (comfy_card, comfy_phase), also when imported
from comfy_card import budget_free_memory  # noqa: E402
GIB = 1024 ** 3
MIB = 1024 ** 2
SCHEMA = "levers-gpu-suite/1"
T_PROCESS = time.monotonic()


# --------------------------------------------------------------------------------------------
# logging and small helpers
# --------------------------------------------------------------------------------------------

_LOG_FILE: list = []


def log(msg: str) -> None:
    """One progress line with the seconds since start (the lead watches these scroll by)."""
    line = f"[{time.monotonic() - T_PROCESS:7.1f}s] {msg}"
    print(line, flush=True)
    if _LOG_FILE:
        _LOG_FILE[0].write(line + "\n")
        _LOG_FILE[0].flush()


def gb(nbytes: float | None) -> float | None:
    return None if nbytes is None else round(nbytes / GIB, 3)


def rnd(x: float | None, n: int = 4) -> float | None:
    return None if x is None or (isinstance(x, float) and not math.isfinite(x)) else round(x, n)


def short_exc(exc: BaseException, limit: int = 600) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= limit else text[:limit] + " ..."


def is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def cuda_ok() -> bool:
    return torch.cuda.is_available()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_device_memory(device: torch.device) -> None:
    gc.collect()     # cheap: import-time objects were frozen out of the collector at startup
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_allocated(device: torch.device) -> int | None:
    return int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None


def peak_reserved(device: torch.device) -> int | None:
    return int(torch.cuda.max_memory_reserved(device)) if device.type == "cuda" else None


def allocated(device: torch.device) -> int | None:
    return int(torch.cuda.memory_allocated(device)) if device.type == "cuda" else None


@contextlib.contextmanager
def vram_budget(device: torch.device, budget_bytes: int | None):
    """Emulate a smaller card: cap this process's caching allocator at ``budget_bytes``.

    ``set_per_process_memory_fraction`` makes allocations beyond the cap raise OOM, so a case
    that overshoots its budget fails loudly instead of quietly using the H200's 141 GB. It does
    not change ``mem_get_info``; engines that size themselves from free memory are told the
    budget explicitly (Levers) or through ComfyUI's ``get_free_memory`` (see ComfyBaseline).
    """
    if device.type != "cuda" or budget_bytes is None:
        yield
        return
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, budget_bytes / total), device)
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)


def time_steps(fn: Callable[[], Any], device: torch.device, warmup: int, iters: int,
               deadline: float) -> tuple[list[float], Any]:
    """Wall seconds per call, synchronised (host waits in offload engines are part of the cost).

    Stops early (keeping at least one timed call) when the deadline would be passed.
    """
    out = None
    for _ in range(warmup):
        out = fn()
        sync(device)
    times: list[float] = []
    for i in range(iters):
        if i > 0 and times and time.monotonic() + times[-1] > deadline:
            break
        sync(device)
        t0 = time.perf_counter()
        out = fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return times, out


def _short(obj: Any, limit: int = 1500) -> Any:
    """A JSON-friendly, bounded summary of an engine report object."""
    if obj is None or isinstance(obj, (int, float, str, bool)):
        return obj if not isinstance(obj, str) else obj[:limit]
    for attr in ("as_dict", "to_dict"):
        fn = getattr(obj, attr, None)
        if callable(fn):
            with contextlib.suppress(Exception):
                text = json.dumps(fn(), default=_json_default)
                return fn() if len(text) <= limit else text[:limit] + " ..."
    fn = getattr(obj, "format_text", None) or getattr(obj, "summary", None)
    if callable(fn):
        with contextlib.suppress(Exception):
            return str(fn())[:limit]
    return repr(obj)[:limit]


def compare(out: torch.Tensor, ref: torch.Tensor | None) -> dict[str, Any]:
    if ref is None:
        return {"max_abs_diff": None, "bit_exact": None}
    out_c = out.detach().to("cpu")
    if out_c.shape != ref.shape:
        return {"max_abs_diff": None, "bit_exact": False, "shape_mismatch": [list(out_c.shape), list(ref.shape)]}
    diff = (out_c.float() - ref.float()).abs()
    return {"max_abs_diff": rnd(float(diff.max()), 6), "bit_exact": bool(torch.equal(out_c, ref)),
            "finite": bool(torch.isfinite(out_c.float()).all())}


def sqnr_db(ref: torch.Tensor, test: torch.Tensor) -> float:
    ref, test = ref.float(), test.float()
    noise = (ref - test).pow(2).mean()
    return float("inf") if noise == 0 else float(10 * torch.log10(ref.pow(2).mean() / noise))


# --------------------------------------------------------------------------------------------
# importing Levers without its ComfyUI entry point
# --------------------------------------------------------------------------------------------

def import_levers():
    """Import ``comfyui_levers`` from this checkout, whatever the folder is called.

    The root ``__init__`` is ComfyUI's entry point; a synthetic package whose ``__path__`` is the
    checkout gives ``comfyui_levers.core`` without running it (and so without importing nodes).
    """
    pkg = sys.modules.get("comfyui_levers")
    if pkg is not None and Path(list(pkg.__path__)[0]).resolve() == ROOT:
        return pkg
    pkg = types.ModuleType("comfyui_levers")
    pkg.__path__ = [str(ROOT)]
    pkg.__file__ = str(ROOT / "__init__.py")
    sys.modules["comfyui_levers"] = pkg
    return pkg


class Pieces:
    """Engine modules that may not exist yet in this checkout; each lookup records why not."""

    def __init__(self) -> None:
        import_levers()
        self.status: dict[str, str] = {}

    def get(self, name: str):
        full = f"comfyui_levers.core.{name}"
        try:
            mod = importlib.import_module(full)
        except ImportError as exc:
            self.status[name] = f"missing: {short_exc(exc, 200)}"
            return None
        self.status[name] = "ok"
        return mod

    def need(self, name: str, *attrs: str):
        """The module if it has every attribute, else None (status says which is missing)."""
        mod = self.get(name)
        if mod is None:
            return None
        missing = [a for a in attrs if not hasattr(mod, a)]
        if missing:
            self.status[name] = f"incompatible: core/{name.replace('.', '/')}.py lacks {', '.join(missing)}"
            return None
        return mod


class Skip(Exception):
    """A case or section that cannot run here; the message is the reason recorded in the JSON."""


# --------------------------------------------------------------------------------------------
# DiT shapes: FLUX.1 (double + single stream) and Wan 2.1 14B, random weights
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DiTSpec:
    """A DiT-shaped workload. Token counts are per DiT forward (one sampler step without CFG)."""

    name: str
    family: str                  # "flux" | "wan"
    hidden: int
    heads: int
    ffn: int
    depth: int                   # flux: double blocks; wan: blocks
    depth_single: int = 0        # flux only
    in_channels: int = 64        # patchified latent channels (16 ch x 2 x 2)
    context_in: int = 4096       # T5-XXL width
    vec_in: int = 768            # CLIP pooled (flux)
    img_tokens: int = 4096
    txt_tokens: int = 512
    latent_area: int = 16384     # ComfyUI's memory_required() area (batch x prod(latent spatial dims))
    comfy_memory_factor: float = 3.1   # supported_models.Flux / WAN21_T2V memory_usage_factor
    note: str = ""

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


FLUX = DiTSpec("flux", "flux", hidden=3072, heads=24, ffn=12288, depth=19, depth_single=38,
               img_tokens=4096, txt_tokens=512, latent_area=128 * 128, comfy_memory_factor=3.1,
               note="FLUX.1-dev block shapes (19 double + 38 single, hidden 3072, 24 heads, MLP 4x), "
                    "1024x1024 = 4096 image + 512 text tokens; RoPE omitted (<1% of FLOPs)")
WAN = DiTSpec("wan", "wan", hidden=5120, heads=40, ffn=13824, depth=40,
              img_tokens=9 * 30 * 52, txt_tokens=512, latent_area=9 * 60 * 104, comfy_memory_factor=0.9,
              note="Wan 2.1 14B t2v block shapes (40 blocks, dim 5120, 40 heads, ffn 13824) at 480x832x33 "
                   "frames = 9x30x52 = 14040 tokens (720p x 81 frames would be ~75k tokens: too slow "
                   "for a 6-minute suite; the transfer/compute ratio only gets better with more tokens)")

SMOKE_FLUX = replace(FLUX, name="flux", hidden=64, heads=2, ffn=256, depth=2, depth_single=2, in_channels=16,
                     context_in=32, vec_in=16, img_tokens=64, txt_tokens=16, latent_area=256,
                     note="smoke shapes")
SMOKE_WAN = replace(WAN, name="wan", hidden=64, heads=2, ffn=128, depth=3, in_channels=16, context_in=32,
                    img_tokens=96, txt_tokens=16, latent_area=384, note="smoke shapes")


def _ln(ops, dim, affine=False, device=None, dtype=None):
    return ops.LayerNorm(dim, elementwise_affine=affine, eps=1e-6, device=device, dtype=dtype)


def _attention(q, k, v):
    # q, k, v: [B, H, L, D] -> [B, L, H*D]
    x = F.scaled_dot_product_attention(q, k, v)
    return x.transpose(1, 2).flatten(2)


class MLPEmbedder(nn.Module):
    def __init__(self, ops, in_dim, hidden, dd):
        super().__init__()
        self.in_layer = ops.Linear(in_dim, hidden, bias=True, **dd)
        self.out_layer = ops.Linear(hidden, hidden, bias=True, **dd)

    def forward(self, x):
        return self.out_layer(F.silu(self.in_layer(x)))


class QKNorm(nn.Module):
    def __init__(self, ops, head_dim, dd):
        super().__init__()
        self.query_norm = ops.RMSNorm(head_dim, eps=1e-6, **dd)
        self.key_norm = ops.RMSNorm(head_dim, eps=1e-6, **dd)


class Modulation(nn.Module):
    def __init__(self, ops, dim, n, dd):
        super().__init__()
        self.n = n
        self.lin = ops.Linear(dim, n * dim, bias=True, **dd)

    def forward(self, vec):
        # vec: [B, C] -> n x [B, 1, C]
        return self.lin(F.silu(vec))[:, None, :].chunk(self.n, dim=-1)


class FluxSelfAttention(nn.Module):
    def __init__(self, ops, dim, head_dim, dd):
        super().__init__()
        self.qkv = ops.Linear(dim, 3 * dim, bias=True, **dd)
        self.norm = QKNorm(ops, head_dim, dd)
        self.proj = ops.Linear(dim, dim, bias=True, **dd)


class DoubleStreamBlock(nn.Module):
    """FLUX double-stream block: separate image/text weights, joint attention."""

    def __init__(self, ops, s: DiTSpec, dd):
        super().__init__()
        self.heads = s.heads
        for side in ("img", "txt"):
            setattr(self, f"{side}_mod", Modulation(ops, s.hidden, 6, dd))
            setattr(self, f"{side}_norm1", _ln(ops, s.hidden, **dd))
            setattr(self, f"{side}_attn", FluxSelfAttention(ops, s.hidden, s.head_dim, dd))
            setattr(self, f"{side}_norm2", _ln(ops, s.hidden, **dd))
            setattr(self, f"{side}_mlp", nn.Sequential(ops.Linear(s.hidden, s.ffn, bias=True, **dd),
                                                         nn.GELU(approximate="tanh"),
                                                         ops.Linear(s.ffn, s.hidden, bias=True, **dd)))

    def _qkv(self, side, x, mod):
        attn = getattr(self, f"{side}_attn")
        h = (1 + mod[1]) * getattr(self, f"{side}_norm1")(x) + mod[0]
        qkv = attn.qkv(h).unflatten(-1, (3, self.heads, -1)).permute(2, 0, 3, 1, 4)  # [3, B, H, L, D]
        q, k, v = qkv[0], qkv[1], qkv[2]
        return attn.norm.query_norm(q), attn.norm.key_norm(k), v

    def forward(self, img, txt, vec):
        img_mod, txt_mod = self.img_mod(vec), self.txt_mod(vec)
        iq, ik, iv = self._qkv("img", img, img_mod)
        tq, tk, tv = self._qkv("txt", txt, txt_mod)
        a = _attention(torch.cat((tq, iq), 2), torch.cat((tk, ik), 2), torch.cat((tv, iv), 2))
        ta, ia = a[:, : txt.shape[1]], a[:, txt.shape[1]:]
        img = img + img_mod[2] * self.img_attn.proj(ia)
        img = img + img_mod[5] * self.img_mlp((1 + img_mod[4]) * self.img_norm2(img) + img_mod[3])
        txt = txt + txt_mod[2] * self.txt_attn.proj(ta)
        txt = txt + txt_mod[5] * self.txt_mlp((1 + txt_mod[4]) * self.txt_norm2(txt) + txt_mod[3])
        return img, txt


class SingleStreamBlock(nn.Module):
    """FLUX single-stream block: fused qkv+MLP-in linear, fused attn-out+MLP-out linear."""

    def __init__(self, ops, s: DiTSpec, dd):
        super().__init__()
        self.heads, self.hidden, self.ffn = s.heads, s.hidden, s.ffn
        self.linear1 = ops.Linear(s.hidden, 3 * s.hidden + s.ffn, bias=True, **dd)
        self.linear2 = ops.Linear(s.hidden + s.ffn, s.hidden, bias=True, **dd)
        self.norm = QKNorm(ops, s.head_dim, dd)
        self.pre_norm = _ln(ops, s.hidden, **dd)
        self.modulation = Modulation(ops, s.hidden, 3, dd)
        self.mlp_act = nn.GELU(approximate="tanh")

    def forward(self, x, vec):
        shift, scale, gate = self.modulation(vec)
        h = (1 + scale) * self.pre_norm(x) + shift
        qkv, mlp = torch.split(self.linear1(h), [3 * self.hidden, self.ffn], dim=-1)
        qkv = qkv.unflatten(-1, (3, self.heads, -1)).permute(2, 0, 3, 1, 4)
        q, k, v = self.norm.query_norm(qkv[0]), self.norm.key_norm(qkv[1]), qkv[2]
        a = _attention(q, k, v)
        return x + gate * self.linear2(torch.cat((a, self.mlp_act(mlp)), -1))


class LastLayer(nn.Module):
    def __init__(self, ops, s: DiTSpec, dd):
        super().__init__()
        self.norm_final = _ln(ops, s.hidden, **dd)
        self.linear = ops.Linear(s.hidden, s.in_channels, bias=True, **dd)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), ops.Linear(s.hidden, 2 * s.hidden, bias=True, **dd))

    def forward(self, x, vec):
        shift, scale = self.adaLN_modulation(vec)[:, None, :].chunk(2, dim=-1)
        return self.linear((1 + scale) * self.norm_final(x) + shift)


class FluxShaped(nn.Module):
    """FLUX.1-shaped DiT (names follow ComfyUI's ``comfy.ldm.flux.model.Flux``)."""

    def __init__(self, s: DiTSpec, ops=nn, device=None, dtype=torch.bfloat16):
        super().__init__()
        dd = {"device": device, "dtype": dtype}
        self.spec, self.dtype = s, dtype
        self.img_in = ops.Linear(s.in_channels, s.hidden, bias=True, **dd)
        self.time_in = MLPEmbedder(ops, 256, s.hidden, dd)
        self.vector_in = MLPEmbedder(ops, s.vec_in, s.hidden, dd)
        self.guidance_in = MLPEmbedder(ops, 256, s.hidden, dd)
        self.txt_in = ops.Linear(s.context_in, s.hidden, bias=True, **dd)
        self.double_blocks = nn.ModuleList(DoubleStreamBlock(ops, s, dd) for _ in range(s.depth))
        self.single_blocks = nn.ModuleList(SingleStreamBlock(ops, s, dd) for _ in range(s.depth_single))
        self.final_layer = LastLayer(ops, s, dd)

    def get_dtype(self):  # ComfyUI's ModelPatcher.model_dtype() asks for this
        return self.dtype

    def forward(self, img, txt, t_emb, y):
        # img: [B, N_img, C_in], txt: [B, N_txt, C_ctx], t_emb: [B, 256], y: [B, C_vec]
        img, txt = self.img_in(img), self.txt_in(txt)
        vec = self.time_in(t_emb) + self.guidance_in(t_emb) + self.vector_in(y)
        for block in self.double_blocks:
            img, txt = block(img, txt, vec)
        x = torch.cat((txt, img), 1)
        for block in self.single_blocks:
            x = block(x, vec)
        return self.final_layer(x[:, txt.shape[1]:], vec)


class WanAttention(nn.Module):
    def __init__(self, ops, s: DiTSpec, dd):
        super().__init__()
        self.heads = s.heads
        self.q = ops.Linear(s.hidden, s.hidden, bias=True, **dd)
        self.k = ops.Linear(s.hidden, s.hidden, bias=True, **dd)
        self.v = ops.Linear(s.hidden, s.hidden, bias=True, **dd)
        self.o = ops.Linear(s.hidden, s.hidden, bias=True, **dd)
        self.norm_q = ops.RMSNorm(s.hidden, eps=1e-6, **dd)
        self.norm_k = ops.RMSNorm(s.hidden, eps=1e-6, **dd)

    def forward(self, x, context=None):
        ctx = x if context is None else context
        split = lambda t: t.unflatten(-1, (self.heads, -1)).transpose(1, 2)  # [B, L, C] -> [B, H, L, D]
        q, k, v = split(self.norm_q(self.q(x))), split(self.norm_k(self.k(ctx))), split(self.v(ctx))
        return self.o(_attention(q, k, v))


class WanBlock(nn.Module):
    """Wan 2.1 attention block (names follow ``comfy.ldm.wan.model.WanAttentionBlock``)."""

    def __init__(self, ops, s: DiTSpec, dd):
        super().__init__()
        self.norm1 = _ln(ops, s.hidden, **dd)
        self.self_attn = WanAttention(ops, s, dd)
        self.norm3 = _ln(ops, s.hidden, affine=True, **dd)
        self.cross_attn = WanAttention(ops, s, dd)
        self.norm2 = _ln(ops, s.hidden, **dd)
        self.ffn = nn.Sequential(ops.Linear(s.hidden, s.ffn, bias=True, **dd), nn.GELU(approximate="tanh"),
                                 ops.Linear(s.ffn, s.hidden, bias=True, **dd))
        self.modulation = nn.Parameter(torch.empty(1, 6, s.hidden, **dd), requires_grad=False)

    def forward(self, x, e, context):
        # x: [B, L, C], e: [B, 6, C], context: [B, L_txt, C]
        mod = (self.modulation.to(device=x.device, dtype=x.dtype) + e).chunk(6, dim=1)
        x = x + mod[2] * self.self_attn(self.norm1(x) * (1 + mod[1]) + mod[0])
        x = x + self.cross_attn(self.norm3(x), context)
        return x + mod[5] * self.ffn(self.norm2(x) * (1 + mod[4]) + mod[3])


class WanHead(nn.Module):
    def __init__(self, ops, s: DiTSpec, dd):
        super().__init__()
        self.norm = _ln(ops, s.hidden, **dd)
        self.head = ops.Linear(s.hidden, s.in_channels, bias=True, **dd)
        self.modulation = nn.Parameter(torch.empty(1, 2, s.hidden, **dd), requires_grad=False)

    def forward(self, x, e):
        shift, scale = (self.modulation.to(device=x.device, dtype=x.dtype) + e[:, None]).chunk(2, dim=1)
        return self.head(self.norm(x) * (1 + scale) + shift)


class WanShaped(nn.Module):
    """Wan 2.1 t2v-shaped DiT; the patch embedding is a Linear over pre-patchified latents
    (the same parameters and FLOPs as the real Conv3d with kernel = stride = (1, 2, 2))."""

    def __init__(self, s: DiTSpec, ops=nn, device=None, dtype=torch.bfloat16):
        super().__init__()
        dd = {"device": device, "dtype": dtype}
        self.spec, self.dtype = s, dtype
        self.patch_embedding = ops.Linear(s.in_channels, s.hidden, bias=True, **dd)
        self.text_embedding = nn.Sequential(ops.Linear(s.context_in, s.hidden, bias=True, **dd),
                                            nn.GELU(approximate="tanh"),
                                            ops.Linear(s.hidden, s.hidden, bias=True, **dd))
        self.time_embedding = nn.Sequential(ops.Linear(256, s.hidden, bias=True, **dd), nn.SiLU(),
                                            ops.Linear(s.hidden, s.hidden, bias=True, **dd))
        self.time_projection = nn.Sequential(nn.SiLU(), ops.Linear(s.hidden, 6 * s.hidden, bias=True, **dd))
        self.blocks = nn.ModuleList(WanBlock(ops, s, dd) for _ in range(s.depth))
        self.head = WanHead(ops, s, dd)

    def get_dtype(self):
        return self.dtype

    def forward(self, x, context, t_emb):
        # x: [B, N, C_in], context: [B, N_txt, C_ctx], t_emb: [B, 256]
        x = self.patch_embedding(x)
        e = self.time_embedding(t_emb)                       # [B, C]
        e0 = self.time_projection(e).unflatten(1, (6, -1))   # [B, 6, C]
        context = self.text_embedding(context)
        for block in self.blocks:
            x = block(x, e0, context)
        return self.head(x, e)


# bf16 on the GPU (what the suite measures); fp32 for CPU smoke runs, where bf16 matmuls take a
# slow reference path (the code paths are the same, the smoke run just finishes in seconds).
DTYPE = {"value": torch.bfloat16}


def make_meta_model(spec: DiTSpec, ops=nn) -> nn.Module:
    cls = FluxShaped if spec.family == "flux" else WanShaped
    return cls(spec, ops=ops, device="meta", dtype=DTYPE["value"])


def make_inputs(spec: DiTSpec, device: torch.device, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g).to(device=device, dtype=DTYPE["value"])
    if spec.family == "flux":
        return (r(1, spec.img_tokens, spec.in_channels), r(1, spec.txt_tokens, spec.context_in), r(1, 256),
                r(1, spec.vec_in))
    return r(1, spec.img_tokens, spec.in_channels), r(1, spec.txt_tokens, spec.context_in), r(1, 256)


class HostWeights:
    """Random bf16 weights in host RAM, one tensor (own storage) per parameter, optionally pinned.

    Filled from a random pool by memcpy (gigabytes per second) instead of ``normal_`` (far slower
    on the CPU); repeated values across tensors do not matter for timing or for comparing engines
    on the same weights. Each engine's model wraps these tensors in its own ``nn.Parameter`` objects,
    so when one engine moves its parameters to the GPU (rebinding ``.data``) the others still see
    the host tensors. Pinned in place (``cudaHostRegister``) once, so both Levers and ComfyUI read
    pinned memory, as they would after ComfyUI's own load pinned the model.
    """

    POOL = 16 * 1024 * 1024

    def __init__(self, meta: nn.Module, pin: bool, seed: int = 0) -> None:
        t0 = time.perf_counter()
        g = torch.Generator().manual_seed(seed)
        total = sum(p.numel() for p in meta.parameters())
        pool_n = max(1024, min(self.POOL, total))
        pool = (torch.randn(pool_n, generator=g) * 0.02).to(DTYPE["value"])
        self.tensors: dict[str, torch.Tensor] = {}
        offset = 0
        for name, p in meta.named_parameters():
            t = torch.empty(p.shape, dtype=p.dtype)
            if name.endswith(("norm.weight", "query_norm.weight", "key_norm.weight", "norm_q.weight",
                              "norm_k.weight", "norm3.weight")):
                t.fill_(1.0)
            elif name.endswith("norm3.bias"):
                t.zero_()
            else:
                flat, n, pos = t.view(-1), t.numel(), 0
                while pos < n:
                    start = offset % pool_n
                    k = min(n - pos, pool_n - start)
                    flat[pos:pos + k].copy_(pool[start:start + k])
                    pos, offset = pos + k, offset + k + 7919  # a prime stride so tensors do not align
            self.tensors[name] = t
        self.nbytes = sum(t.numel() * t.element_size() for t in self.tensors.values())
        self.fill_s = time.perf_counter() - t0
        self.pinned_bytes, self.pin_s, self.pin_reason = 0, 0.0, "not requested"
        self._pinned: list[torch.Tensor] = []
        if pin:
            self._pin()

    def _pin(self) -> None:
        from comfyui_levers.core.residency.transport import pin_in_place, pinned_by_levers
        t0 = time.perf_counter()
        reasons = set()
        for t in self.tensors.values():
            if pinned_by_levers(t):
                # a GroupPrefetch arena view: the store's pin covers it. pin_in_place would take a use of the store's
                # range that nothing gives back, so the arena would never be unregistered (freed while page-locked)
                continue
            res = pin_in_place(t)
            if res.pinned and res.reason == "pinned in place":
                self._pinned.append(t)
                self.pinned_bytes += res.nbytes
            elif not res.pinned:
                reasons.add(res.reason)
        self.pin_s = time.perf_counter() - t0
        self.pin_reason = "; ".join(sorted(reasons)) or "all pinned in place"

    def bind(self, model: nn.Module) -> nn.Module:
        """Give ``model`` (built on the meta device) fresh Parameters over the host tensors."""
        for name, _ in list(model.named_parameters()):
            mod_name, _, leaf = name.rpartition(".")
            owner = model.get_submodule(mod_name) if mod_name else model
            owner._parameters[leaf] = nn.Parameter(self.tensors[name], requires_grad=False)
        return model

    def release(self) -> None:
        from comfyui_levers.core.residency.transport import unpin_in_place
        for t in self._pinned:
            unpin_in_place(t)     # unregister before the memory goes back to the OS
        self._pinned.clear()
        self.tensors.clear()


def block_bytes(spec: DiTSpec) -> int:
    meta = make_meta_model(spec)
    blocks = list(getattr(meta, "double_blocks", [])) + list(getattr(meta, "single_blocks", [])) + \
        list(getattr(meta, "blocks", []))
    return sum(p.numel() * p.element_size() for b in blocks for p in b.parameters())


def model_bytes(spec: DiTSpec) -> int:
    return sum(p.numel() * p.element_size() for p in make_meta_model(spec).parameters())


# --------------------------------------------------------------------------------------------
# ComfyUI's own memory management, in process, without its model loaders
# --------------------------------------------------------------------------------------------

class ComfyBaseline:
    """ComfyUI's legacy ``ModelPatcher`` path (lowvram + async offload) on our random-weight DiT.

    The model is built from ``comfy.ops.disable_weight_init`` layers (what ``pick_operations``
    returns for bf16 weights computed in bf16) and wrapped in a ``ModelPatcher``; each case calls
    ``comfy.model_management.load_models_gpu`` with the memory estimate ComfyUI's sampler would
    pass (``BaseModel.memory_required`` with the model's ``memory_usage_factor``), while
    ``get_free_memory`` reports the emulated card: ``budget - active bytes``. ComfyUI then decides
    what stays on the GPU and casts the rest per op on its offload streams, exactly as on a card
    with that much memory. Minimal imports: model_management, model_patcher, ops (the device
    image has their third-party needs; comfy_kitchen is optional in 0.8 and only logs an error).
    """

    def __init__(self, path: str | None, device: torch.device) -> None:
        self.path, self.device = path, device
        self.ok, self.reason, self.version, self.log_lines = False, "", None, []
        self.mm = self.ops = self.mp = None
        if not path:
            self.reason = "no --comfyui PATH given"
            return
        p = Path(path).expanduser().resolve()
        if not (p / "comfy" / "model_management.py").is_file():
            self.reason = f"{p} is not a ComfyUI checkout (no comfy/model_management.py)"
            return
        self.path = str(p)
        try:
            self._import(p)
        except Exception as exc:  # noqa: BLE001 - any import failure means "baseline skipped", with why
            self.reason = f"importing ComfyUI from {p} failed: {short_exc(exc)}"
            log(f"ComfyUI baseline unavailable: {self.reason}")
            return
        self.ok = True

    def _import(self, p: Path) -> None:
        if str(p) not in sys.path:
            sys.path.insert(0, str(p))
        handler = _ListHandler(self.log_lines)
        logging.getLogger().addHandler(handler)
        logging.getLogger().setLevel(min(logging.getLogger().level or logging.INFO, logging.INFO))
        import comfy.options
        comfy.options.enable_args_parsing(False)     # never parse the suite's argv as ComfyUI flags
        import comfy.cli_args
        if self.device.type != "cuda":
            comfy.cli_args.args.cpu = True           # else model_management asks CUDA for a device
        import comfy.model_management as mm
        import comfy.model_patcher as mp
        import comfy.ops as ops
        self.mm, self.mp, self.ops = mm, mp, ops
        try:
            ver = (p / "comfyui_version.py").read_text()
            self.version = ver.split("__version__")[1].split('"')[1]
        except (OSError, IndexError):
            self.version = "unknown"
        log(f"ComfyUI {self.version} imported from {p}: NUM_STREAMS={getattr(mm, 'NUM_STREAMS', '?')}, "
            f"vram_state={getattr(mm, 'vram_state', '?')}, pinned memory cap "
            f"{gb(getattr(mm, 'MAX_PINNED_MEMORY', 0))} GiB")

    def info(self) -> dict[str, Any]:
        d = {"ok": self.ok, "reason": self.reason or None, "path": self.path, "version": self.version}
        if self.ok:
            mm = self.mm
            d.update({"num_streams": getattr(mm, "NUM_STREAMS", None), "vram_state": str(getattr(mm, "vram_state", "")),
                      "max_pinned_memory_gib": gb(getattr(mm, "MAX_PINNED_MEMORY", None)),
                      "extra_reserved_vram_gib": gb(getattr(mm, "EXTRA_RESERVED_VRAM", None)),
                      "comfy_kitchen": "comfy_kitchen" in sys.modules})
        d["log_tail"] = self.log_lines[-40:]
        return d

    def memory_estimate(self, spec: DiTSpec, batch: int) -> int:
        """``BaseModel.memory_required`` for flash/xformers attention, bf16: area * 2 * 0.01 * factor MiB."""
        return int(batch * spec.latent_area * 2 * 0.01 * spec.comfy_memory_factor * MIB)

    @contextlib.contextmanager
    def emulated_card(self, budget_bytes: int | None):
        """Make ComfyUI's free-memory reads describe a card with ``budget_bytes`` of memory."""
        mm = self.mm
        orig = mm.get_free_memory
        if budget_bytes is None or self.device.type != "cuda":
            yield
            return
        get_free_memory = budget_free_memory(mm, budget_bytes)
        mm.get_free_memory = get_free_memory
        try:
            yield
        finally:
            mm.get_free_memory = orig

    @contextlib.contextmanager
    def extra_reserve(self, nbytes: int):
        """``--reserve-vram``: ComfyUI keeps EXTRA_RESERVED_VRAM free on top of its estimate."""
        mm = self.mm
        orig = mm.EXTRA_RESERVED_VRAM
        mm.EXTRA_RESERVED_VRAM = orig + int(nbytes)
        try:
            yield
        finally:
            mm.EXTRA_RESERVED_VRAM = orig

    def build(self, spec: DiTSpec, host: HostWeights):
        model = host.bind(make_meta_model(spec, ops=self.ops.disable_weight_init))
        patcher = self.mp.ModelPatcher(model, load_device=self.device, offload_device=torch.device("cpu"))
        return model, patcher

    def load(self, patcher, spec: DiTSpec, budget_bytes: int | None) -> dict[str, Any]:
        """Load as the sampler does (``prepare_sampling``); on CPU use ``partially_load`` so the
        lowvram code (per-op casting) still runs, since ComfyUI fully loads on a CPU device."""
        mm = self.mm
        required = self.memory_estimate(spec, 2)      # sampler: batch x2 (cond + uncond) ...
        minimum = self.memory_estimate(spec, 1)       # ... and the batch-1 minimum
        if self.device.type == "cuda":
            with self.emulated_card(budget_bytes):
                mm.load_models_gpu([patcher], memory_required=required, minimum_memory_required=minimum)
        else:
            lowvram = max(1, int((budget_bytes or 0) - minimum - mm.extra_reserved_memory()))
            patcher.partially_load(self.device, lowvram)
        return {"memory_required": required, "minimum_memory_required": minimum,
                "loaded_bytes": int(patcher.loaded_size()), "model_bytes": int(patcher.model_size()),
                "lowvram": bool(getattr(patcher.model, "model_lowvram", False)),
                "lowvram_patches": int(getattr(patcher.model, "lowvram_patch_counter", 0)),
                "offload_buffer_bytes": int(getattr(patcher.model, "model_offload_buffer_memory", 0) or 0)}

    def release(self, patcher) -> None:
        """Forget the model without ComfyUI's unload (which copies every loaded weight back to
        fresh pageable host memory: seconds of D2H per case for nothing; our host tensors are
        intact). Unpins whatever ComfyUI pinned itself."""
        mm = self.mm
        for lm in list(mm.current_loaded_models):
            if lm.model is patcher or lm.model is None:
                mm.current_loaded_models.remove(lm)
                if lm.model_finalizer is not None:
                    lm.model_finalizer.detach()
        with contextlib.suppress(Exception):
            patcher.unpin_all_weights()
        # Drop the device copies now: a failed case's traceback may still reference this model.
        with torch.no_grad():
            for t in list(patcher.model.parameters()) + list(patcher.model.buffers()):
                if t.device.type != "cpu":
                    t.data = torch.empty(0, dtype=t.dtype)


class _ListHandler(logging.Handler):
    def __init__(self, sink: list) -> None:
        super().__init__(logging.INFO)
        self.sink = sink

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        self.sink.append(msg[:300])
        if "loaded partially" in msg or "loaded completely" in msg:
            log(f"  comfy: {msg[:200]}")


# --------------------------------------------------------------------------------------------
# the suite: results, deadlines, sections
# --------------------------------------------------------------------------------------------

# dynamic last: it drives another allocator (comfy-aimdo) in child processes; whatever it does,
# every other section's numbers are already saved
SECTION_ORDER = ("bandwidth", "dit", "phase", "comfy_phase", "quant", "vae", "recommend", "dynamic")
# Seconds each section may start new cases for (full run). The dit section also leaves time for
# the sections after it. Sum + imports stays under ~6.5 minutes.
# shares of the time budget (a section stops starting cases past its share; later sections get what is left).
# The H200 runs used phase 5 s, quant 6 s, recommend 0.02 s and comfy_phase 28 s for its PhaseOffload flows alone;
# comfy_phase now also runs GroupPrefetch (bf16, fp8, GGUF) and the two experts (which start only with > 30 s left),
# so it gets the seconds the three small sections never used (dit's reserve for the later sections is unchanged).
# recommend also starts a child process that holds VRAM (a CUDA start, a few seconds): 7 s of quant's went to it.
SECTION_SECONDS = {"bandwidth": 20, "dit": 260, "dynamic": 70, "phase": 15, "comfy_phase": 105, "quant": 13, "vae": 60,
                   "recommend": 12}
# What dit leaves for the sections after it: what each took on the H200 (runs c-f: phase 5 s, quant 6 s, recommend
# under 1 s, dynamic 17-43 s, comfy_phase 28 s before its GroupPrefetch and two-expert cases, vae under 10 s before
# its layered and streamed cases) with room for the cases added since. 0.8 x the caps (220 s) left dit ~60 s of a
# 480 s run after the CUDA tests: its build and resident case, not the streaming cases issue #5 waits for.
SECTION_TYPICAL = {"phase": 6, "comfy_phase": 80, "quant": 8, "vae": 30, "recommend": 5, "dynamic": 45}


def dit_reserve(later: Iterable[str]) -> float:
    """Seconds the dit section leaves for ``later`` sections (each still capped by SECTION_SECONDS when it runs)."""
    return float(sum(SECTION_TYPICAL.get(s, SECTION_SECONDS.get(s, 0)) for s in later))


def source_fingerprint() -> str:
    """sha256 over the engine's and the suite's source files (path + bytes), so a run made from a
    copy without .git can still be matched to a commit: rerun this function on that checkout."""
    import hashlib
    h = hashlib.sha256()
    for top in ("core", "bench", "bridge", "nodes"):
        for path in sorted((ROOT / top).rglob("*.py")):
            h.update(str(path.relative_to(ROOT)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:16]


def git_info(commit_override: str | None = None) -> dict[str, Any]:
    def run(*cmd):
        try:
            proc = subprocess.run(["git", "-C", str(ROOT), *cmd], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return ""
        return proc.stdout.strip() if proc.returncode == 0 else ""   # outside a repo git echoes "HEAD"
    commit = run("rev-parse", "--verify", "HEAD")
    if commit and not all(ch in "0123456789abcdef" for ch in commit.lower()):
        commit = ""
    status = run("status", "--porcelain", "--untracked-files=no")
    info = {"commit": commit or None, "dirty": bool(status) if commit else None,
            "subject": run("log", "-1", "--format=%s") or None, "source_fingerprint": source_fingerprint(),
            "reason": None}
    given = commit_override or os.environ.get("LEVERS_COMMIT")
    if given:
        if commit and not commit.startswith(given) and not given.startswith(commit):
            # a copied working tree can carry an older .git (the lent GPU machine does): the caller
            # knows which commit it sent, so that is the one recorded
            info.update({"commit": given, "dirty": None, "git_head_here": commit,
                         "reason": f"--commit {given} differs from this copy's .git HEAD {commit}; recorded "
                                   f"--commit (the copy's .git is older than its files)"})
        elif not commit:
            info.update({"commit": given, "reason": "no .git here: commit given by --commit / LEVERS_COMMIT"})
    elif not commit:
        info["reason"] = ("not a git checkout (or git missing): commit unknown; pass --commit SHA, or match "
                          "source_fingerprint against a checkout")
    return info


def machine_info(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                            "torch_cuda": torch.version.cuda, "platform": platform.platform(),
                            "cpu_count": os.cpu_count(), "device": str(device)}
    try:
        import psutil
        vm = psutil.virtual_memory()
        info.update({"ram_total_gib": gb(vm.total), "ram_available_gib": gb(vm.available)})
    except ImportError:
        info["ram_total_gib"] = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update({"gpu": props.name, "gpu_memory_gib": gb(props.total_memory),
                     "compute_capability": f"{props.major}.{props.minor}",
                     "multiprocessors": props.multi_processor_count})
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,pcie.link.gen.current,"
                                  "pcie.link.width.current", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=15).stdout.strip().splitlines()
            if out:
                parts = [p.strip() for p in out[0].split(",")]
                info.update({"driver": parts[0], "pcie_gen": parts[1] if len(parts) > 1 else None,
                             "pcie_width": parts[2] if len(parts) > 2 else None})
        except (OSError, subprocess.SubprocessError) as exc:
            info["driver"] = f"unknown ({short_exc(exc, 100)})"
    else:
        info["gpu"] = None
    from importlib import metadata
    for dist in ("triton", "bitsandbytes", "torchao", "comfy-kitchen", "matplotlib", "numpy", "safetensors", "psutil"):
        try:   # versions from package metadata: importing torchao / bitsandbytes costs seconds
            info[f"{dist.replace('-', '_')}_version"] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            info[f"{dist.replace('-', '_')}_version"] = None
    return info


class Suite:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.smoke = args.smoke
        self.device = torch.device("cuda", 0) if cuda_ok() and not args.cpu else torch.device("cpu")
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        # files other processes of the suite read (reference outputs), kept out of the results folder
        self.scratch = Path(tempfile.mkdtemp(prefix="levers-suite-"))
        self.t0 = time.monotonic()
        self.deadline = T_PROCESS + args.time_budget
        self.current = "startup"
        self.pieces = Pieces()
        self.comfy: ComfyBaseline | None = None
        self.results: dict[str, Any] = {
            "schema": SCHEMA, "started": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "finished": None, "wall_s": None, "smoke": self.smoke,
            "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
            "git": git_info(args.commit), "machine": machine_info(self.device),
            "config": {k: v for k, v in vars(args).items() if k != "func"},
            "comfyui": None, "levers_pieces": self.pieces.status,
            "sections": {}, "skipped": [], "summary": {},
        }
        self._lock = threading.Lock()

    # deadlines ---------------------------------------------------------------------------
    def left(self, deadline: float | None = None) -> float:
        return min(deadline or self.deadline, self.deadline) - time.monotonic()

    def skip(self, where: str, reason: str) -> dict[str, Any]:
        self.results["skipped"].append(f"{where}: {reason}")
        log(f"SKIP {where}: {reason}")
        return {"status": "skipped", "reason": reason}

    # output --------------------------------------------------------------------------------
    def save(self, final: bool = False) -> None:
        with self._lock:
            self.results["wall_s"] = round(time.monotonic() - T_PROCESS, 1)
            try:   # keep the summary current, so a run cut off by an outside timeout still has one
                self.results["summary"] = build_summary(self.results)
            except Exception as exc:  # noqa: BLE001 - the summary is derived; never lose the record
                self.results["summary_error"] = short_exc(exc)
            if final:
                self.results["finished"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
            for _ in range(3):   # the watchdog may serialise while the main thread mutates
                try:
                    text = json.dumps(self.results, indent=2, default=_json_default)
                    break
                except RuntimeError:
                    time.sleep(0.05)
                except (TypeError, ValueError) as exc:
                    # a key JSON cannot take (a tuple, a dtype) in some case's record: written with its keys as
                    # text rather than stopping the suite from the section's finally; a record that holds itself
                    # (circular) keeps only what can be written of it
                    self.results["save_error"] = short_exc(exc)
                    try:
                        text = json.dumps(_text_keys(self.results), indent=2, default=_json_default)
                    except (TypeError, ValueError, RecursionError):
                        text = json.dumps({k: v for k, v in self.results.items() if k != "sections"}
                                          | {"sections": {n: repr(v)[:2000] for n, v in
                                                          self.results.get("sections", {}).items()}},
                                          indent=2, default=repr)
                    break
            else:
                return
            tmp = self.out / "suite.json.tmp"
            tmp.write_text(text)
            tmp.replace(self.out / "suite.json")
            try:
                (self.out / "suite.md").write_text(render_markdown(self.results))
            except Exception as exc:  # noqa: BLE001 - the JSON is the record; the table is a view
                log(f"markdown rendering failed: {short_exc(exc)}")

    # running ---------------------------------------------------------------------------------
    def run_section(self, name: str, fn: Callable, seconds: float, reserve_after: float = 0.0) -> None:
        sec: dict[str, Any] = {"status": "running"}
        self.results["sections"][name] = sec
        self.current = name
        left = self.left() - reserve_after
        if left < 3:
            sec.update(self.skip(name, "suite time budget exhausted before this section"))
            return
        deadline = time.monotonic() + min(seconds, left)
        t0 = time.monotonic()
        log(f"== section {name} (up to {min(seconds, left):.0f}s)")
        try:
            fn(self, sec, deadline)
            if sec.get("status") == "running":
                sec["status"] = "ok"
        except Skip as exc:
            sec.update(self.skip(name, str(exc)))
        except Exception as exc:  # noqa: BLE001 - one section's failure must not stop the suite
            sec.update({"status": "failed", "reason": short_exc(exc),
                        "traceback": traceback.format_exc(limit=12)[-4000:]})
            log(f"FAILED section {name}: {short_exc(exc)}")
        finally:
            sec["seconds"] = round(time.monotonic() - t0, 2)
            with contextlib.suppress(Exception):
                free_device_memory(self.device)
            self.save()
            log(f"== section {name}: {sec['status']} in {sec['seconds']}s")

    def guarded_case(self, where: str, record: dict[str, Any], fn: Callable[[], None]) -> dict[str, Any]:
        """Run one case; OOM and errors become the case's status, never the section's."""
        self.current = where
        try:
            fn()
            record.setdefault("status", "ok")
        except Skip as exc:
            record.update({"status": "skipped", "reason": str(exc)})
            self.results["skipped"].append(f"{where}: {exc}")
            log(f"  skip {where}: {exc}")
        except Exception as exc:  # noqa: BLE001
            record.update({"status": "oom" if is_oom(exc) else "failed", "reason": short_exc(exc)})
            if not is_oom(exc):
                record["traceback"] = traceback.format_exc(limit=10)[-3000:]
            log(f"  {record['status'].upper()} {where}: {short_exc(exc, 300)}")
        finally:
            with contextlib.suppress(Exception):
                free_device_memory(self.device)
        return record


def _json_default(o):
    if isinstance(o, (torch.dtype, torch.device, Path)):
        return str(o)
    if hasattr(o, "to_dict"):
        return o.to_dict()
    if hasattr(o, "__dataclass_fields__"):
        return asdict(o)
    if isinstance(o, (set, tuple)):
        return list(o)
    return repr(o)


def _text_keys(o: Any) -> Any:
    """``o`` with every dict key made a string (JSON takes no other), recursively."""
    if isinstance(o, dict):
        return {k if isinstance(k, str) else repr(k): _text_keys(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_text_keys(v) for v in o]
    return o


def watchdog(suite: Suite, hard_limit_s: float) -> None:
    """If the suite overshoots its hard limit, write what exists and exit, so results survive a
    hung case and the caller's own timeout."""
    def run():
        while True:
            time.sleep(1.0)
            if time.monotonic() - T_PROCESS > hard_limit_s:
                suite.results["watchdog"] = (f"suite exceeded its hard limit of {hard_limit_s:.0f}s while in "
                                             f"'{suite.current}'; results so far were written and the process exited")
                log(f"WATCHDOG: {suite.results['watchdog']}")
                with contextlib.suppress(Exception):
                    suite.results["summary"] = build_summary(suite.results)
                with contextlib.suppress(Exception):
                    suite.save(final=True)
                os._exit(3)
    threading.Thread(target=run, name="suite-watchdog", daemon=True).start()


# --------------------------------------------------------------------------------------------
# section 1: host -> device bandwidth
# --------------------------------------------------------------------------------------------

def _copy_gbps(dst: torch.Tensor, src: torch.Tensor, device: torch.device, reps: int) -> dict[str, Any]:
    nbytes = src.numel() * src.element_size()
    dst.copy_(src, non_blocking=True)   # warm-up (first touch, driver staging buffers)
    sync(device)
    secs = []
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        sync(device)
        secs.append(time.perf_counter() - t0)
    return {"gbps_best": rnd(nbytes / min(secs) / 1e9, 2), "gbps_median": rnd(nbytes / statistics.median(secs) / 1e9, 2),
            "bytes": nbytes, "reps": reps}


def sec_bandwidth(suite: Suite, sec: dict, deadline: float) -> None:
    dev = suite.device
    if dev.type != "cuda" and not suite.smoke:
        raise Skip("no CUDA device: host->device bandwidth needs a GPU (run --smoke to exercise the code on CPU)")
    nbytes = (8 * MIB) if suite.smoke else int(suite.args.bw_gib * GIB)
    reps = 2 if suite.smoke else 5
    n = nbytes // 2
    res: dict[str, Any] = {"note": "GB/s = 1e9 bytes/s; wall time of one synchronised copy of "
                                   f"{nbytes / GIB:.2f} GiB, best and median of {reps}"}
    sec["results"] = res
    dst = torch.empty(n, dtype=torch.bfloat16, device=dev)
    src = torch.ones(n, dtype=torch.bfloat16)
    res["h2d_pageable"] = _copy_gbps(dst, src, dev, reps)
    log(f"  pageable H2D {res['h2d_pageable']['gbps_best']} GB/s")
    if dev.type != "cuda":
        res["h2d_pinned_in_place"] = res["h2d_pinned_copy"] = res["d2h_pinned"] = {
            "skipped": "no CUDA device: pinning needs a GPU; the pageable number above is a CPU memcpy"}
        res["packed_unpack"] = _unpack_probe(suite, dev, n)     # the eager path, for the wiring
        return
    from comfyui_levers.core.residency.transport import CudaTransport, pin_in_place, unpin_in_place
    t0 = time.perf_counter()
    pin = pin_in_place(src)
    pin_s = time.perf_counter() - t0
    if pin.pinned:
        res["pin_in_place"] = {"seconds": rnd(pin_s, 4), "gbps": rnd(nbytes / pin_s / 1e9, 2), "reason": pin.reason}
        res["h2d_pinned_in_place"] = _copy_gbps(dst, src, dev, reps)
        res["d2h_pinned"] = _copy_gbps(src, dst, dev, reps)
        # the transport's own path (side stream + event), one big tensor and a block's worth of pieces
        tr = CudaTransport(dev)
        t0 = time.perf_counter()
        for _ in range(reps):
            tr.copy_to_device(src, dst)
        tr.synchronize()
        res["transport_h2d_one_tensor"] = {"gbps": rnd(reps * nbytes / (time.perf_counter() - t0) / 1e9, 2)}
        pieces = list(src.split(max(1, n // 16)))
        dsts = list(dst.split(max(1, n // 16)))
        t0 = time.perf_counter()
        for _ in range(reps):
            for s, d in zip(pieces, dsts):
                tr.copy_to_device(s, d)
        tr.synchronize()
        res["transport_h2d_16_pieces"] = {"gbps": rnd(reps * nbytes / (time.perf_counter() - t0) / 1e9, 2)}
        unpin_in_place(src)
    else:
        res["h2d_pinned_in_place"] = {"skipped": f"pin in place failed: {pin.reason}"}
    log(f"  pinned-in-place H2D {res.get('h2d_pinned_in_place', {}).get('gbps_best')} GB/s, "
        f"D2H {res.get('d2h_pinned', {}).get('gbps_best')} GB/s, pinning {res.get('pin_in_place', {}).get('gbps')} GB/s")
    try:
        pinned_copy = src.pin_memory()          # torch's caching host allocator (a copy)
        res["h2d_pinned_copy"] = _copy_gbps(dst, pinned_copy, dev, reps)
        del pinned_copy
    except RuntimeError as exc:
        res["h2d_pinned_copy"] = {"skipped": f"pin_memory() failed: {short_exc(exc, 200)}"}
    try:
        res["packed_unpack"] = _unpack_probe(suite, dev, n)
        log(f"  packed-bf16 unpack: {res['packed_unpack'].get('unpack_gbps_written')} GB/s written, "
            f"{res['packed_unpack'].get('unpack_vs_copy')} x the time its packed bytes take over the bus")
    except Exception as exc:  # noqa: BLE001 - a diagnostic; the copies above are the section's numbers
        res["packed_unpack"] = {"failed": short_exc(exc)}
    probe = suite.pieces.get("probe")
    if probe is not None and hasattr(probe, "measure_h2d_bandwidth"):
        try:
            bw = probe.measure_h2d_bandwidth()
            res["levers_probe"] = _json_default(bw) if not isinstance(bw, dict) else bw
        except Exception as exc:  # noqa: BLE001
            res["levers_probe"] = {"failed": short_exc(exc)}
    del dst, src


def _unpack_probe(suite: Suite, dev: torch.device, n: int) -> dict[str, Any]:
    """Unpack ``n`` packed bf16 values (Gaussian, sigma 0.02) on the device, timed: what the packed stream adds
    to each copy on the copy stream (Triton on CUDA, eager torch elsewhere), and a bit-exactness check."""
    packed = suite.pieces.get("residency.packed")
    if packed is None:
        return {"skipped": f"core/residency/packed.py unavailable ({suite.pieces.status.get('residency.packed')})"}
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(n, generator=g) * 0.02).bfloat16()
    t0 = time.perf_counter()
    pk = packed.pack(x, device=dev if dev.type == "cuda" else "cpu")
    pack_s = time.perf_counter() - t0
    planes = [t.to(dev) for t in (pk.sm, pk.nib, pk.table, pk.esc_pos, pk.esc_val)]
    out = torch.empty(n, dtype=torch.bfloat16, device=dev)
    kernel = dev.type == "cuda" and packed.triton_unpack_available(dev)[0]
    run = (lambda: packed._launch(*planes, 0, out)) if kernel else (lambda: packed.unpack(*planes, 0, out))
    run()
    sync(dev)
    reps = 5
    t0 = time.perf_counter()
    for _ in range(reps):
        run()
    sync(dev)
    s = (time.perf_counter() - t0) / reps
    bw = None
    r = suite.results.get("sections", {}).get("bandwidth", {}).get("results", {})
    for k in ("h2d_pinned_in_place", "h2d_pageable"):
        if r.get(k, {}).get("gbps_best"):
            bw = r[k]["gbps_best"]
            break
    return {"values": n, "path": "triton" if kernel else "eager", "pack_s": rnd(pack_s, 3),
            "wire_ratio": rnd(pk.nbytes / (2 * n), 4), "escapes": int(pk.esc_pos.numel()),
            "unpack_s": rnd(s, 6), "unpack_gbps_written": rnd(2 * n / s / 1e9, 1),
            "unpack_vs_copy": rnd(s / (pk.nbytes / (bw * 1e9)), 4) if bw else None,
            "bit_exact": bool(torch.equal(out.view(torch.int16).cpu(), x.view(torch.int16)))}


def fp8_failures(suite: Suite) -> dict[str, str]:
    """fp8 GEMM modes that failed in this process ("mode@device": error). QuantLinear then uses the next mode for
    good without raising, so a case labelled rowwise may have timed tensorwise: recorded beside every fp8 number."""
    fn = getattr(suite.pieces.get("quant.linear"), "fp8_mode_failures", None)
    return fn() if callable(fn) else {}


def pinned_gbps(results: dict) -> float | None:
    """The suite's reference pinned H2D bandwidth (best of the pinned measurements)."""
    r = results.get("sections", {}).get("bandwidth", {}).get("results", {})
    vals = [r.get(k, {}).get("gbps_best") for k in ("h2d_pinned_in_place", "h2d_pinned_copy")]
    vals = [v for v in vals if v]
    return max(vals) if vals else None


# --------------------------------------------------------------------------------------------
# section 2: DiTs under emulated VRAM budgets
# --------------------------------------------------------------------------------------------

class LeversPrefetch:
    """GroupPrefetch (core/residency/prefetch.py) as the suite drives it.

    The host arena is built once per model (``HostStore``: every block tensor packed per dtype and
    pinned in place, as the node does once per model load) and reused for every budget; the other
    engines then read the same pinned arena views, so host RAM holds one copy of the weights and
    every engine streams from pinned memory. ``apply`` installs the engine for one budget;
    ``remove`` uninstalls it and leaves the arena for the next budget.
    """

    def __init__(self, pieces: Pieces) -> None:
        self.mod = pieces.need("residency.prefetch", "apply_group_prefetch", "PrefetchConfig", "HostStore")
        self.blocks = pieces.need("residency.blocks", "find_blocks")
        self.reason = None
        if self.mod is None or self.blocks is None:
            which = "residency.prefetch" if self.mod is None else "residency.blocks"
            self.reason = f"core/{which.replace('.', '/')}.py unavailable ({pieces.status.get(which)})"
        self.model = self.layout = self.store = self.transport = None
        self.build_s = None
        self.pack_s = None

    def build_store(self, spec: DiTSpec, host: HostWeights, device: torch.device) -> dict[str, Any]:
        """Bind a model to ``host``, pack its blocks into the pinned arena, and re-point
        ``host``'s block tensors at the arena views (dropping the originals)."""
        model = host.bind(make_meta_model(spec))
        info = self.build_store_for(model, device)
        moved = 0
        for n, p in model.named_parameters():
            if p.data.data_ptr() != host.tensors[n].data_ptr():
                host.tensors[n] = p.data        # the arena view (same values)
                moved += 1
        info["tensors_in_arena"] = moved
        return info

    def build_store_for(self, model: nn.Module, device: torch.device) -> dict[str, Any]:
        """Pack an existing host model's blocks (e.g. one QuantizeDiT made fp8) into a pinned arena."""
        if self.reason:
            raise Skip(self.reason)
        from comfyui_levers.core.residency.transport import make_transport
        self.transport = make_transport(device)
        t0 = time.perf_counter()
        self.layout = self.blocks.find_blocks(model)
        self.store = self.mod.HostStore(self.layout.blocks, self.transport, pin=True)
        self.build_s = time.perf_counter() - t0
        self.model = model
        pins = {str(d): (r.pinned, r.reason) for d, r in self.store.pin_results.items()}
        return {"arena_build_s": rnd(self.build_s, 2), "arena_bytes": self.store.host_bytes,
                "arena_pinned_bytes": self.store.pinned_bytes, "arena_pin": pins,
                "arena_dtypes": sorted(str(d) for d in self.store.arenas),
                "architecture": self.layout.architecture, "blocks": len(self.layout.blocks),
                "kept_unstreamed": self.store.kept[:10]}

    def apply(self, weights_budget: int | None, packed: bool = False):
        """Install for one budget. ``packed``: stream the bf16 arena losslessly packed (packed once, on the
        GPU, the first time; the same store streams as stored again for the other cases)."""
        if self.reason:
            raise Skip(self.reason)
        if self.store is None:
            raise Skip("the GroupPrefetch host arena was not built (see the model's levers_store)")
        budget = "auto" if weights_budget is None else int(weights_budget)
        if packed:
            if not hasattr(self.store, "pack_arenas"):
                raise Skip("this checkout has no packed streaming (HostStore.pack_arenas)")
            ok, why = self.mod.packing_supported(self.transport.device)
            if not ok:
                raise Skip(f"packed streaming unavailable: {why}")
            self.store.pack_arenas(self.transport)          # once per store; later calls return at once
            self.pack_s = self.store.pack_seconds
        if hasattr(self.store, "use_packed"):
            self.store.use_packed = packed
        cfg = self.mod.PrefetchConfig(budget_bytes=budget, **({"packed": True} if packed else {}))
        return self.mod.apply_group_prefetch(self.model, cfg, self.transport, store=self.store, layout=self.layout)

    def h2d_bytes(self) -> int:
        return int(self.transport.ledger.h2d_bytes)

    @staticmethod
    def stats(handle) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in ("stats", "report"):
            fn = getattr(handle, name, None)
            try:
                out[name] = fn() if callable(fn) else None
            except Exception as exc:  # noqa: BLE001 - a broken report must not lose the timing
                out[name] = f"failed: {short_exc(exc)}"
        return out

    def close(self) -> None:
        if self.store is not None:
            if hasattr(self.store, "unpin"):
                self.store.unpin(self.transport)
            else:   # a checkout from before HostStore.unpin
                for dtype, res in self.store.pin_results.items():
                    if res.pinned and dtype in self.store.arenas:
                        self.transport.unpin(self.store.arenas[dtype])
            self.store.arenas.clear()
        self.model = self.layout = self.store = None


def dit_budgets(suite: Suite, spec: DiTSpec) -> list[tuple[str, int]]:
    if suite.smoke:
        total = model_bytes(spec)
        return [(f"{f:.0%} of weights", int(total * f)) for f in (0.8, 0.9)]   # small enough that weights stream
    return [(f"{g:g} GiB", int(g * GIB)) for g in suite.args.budgets]


def sec_dit(suite: Suite, sec: dict, deadline: float) -> None:
    dev = suite.device
    if dev.type != "cuda" and not suite.smoke:
        raise Skip("no CUDA device: the DiT cases need a GPU (run --smoke to exercise the code on CPU)")
    specs = {"flux": SMOKE_FLUX if suite.smoke else FLUX, "wan": SMOKE_WAN if suite.smoke else WAN}
    names = [m for m in suite.args.models if m in specs]
    sec["models"] = {}
    share = {"flux": 0.42, "wan": 0.58} if len(names) == 2 else {n: 1.0 for n in names}
    for i, name in enumerate(names):
        # the last model may use whatever the earlier ones left
        model_deadline = deadline if i == len(names) - 1 else \
            time.monotonic() + share[name] * max(0.0, deadline - time.monotonic())
        rec: dict[str, Any] = {"spec": asdict(specs[name]), "cases": []}
        sec["models"][name] = rec
        try:
            run_dit_model(suite, specs[name], rec, model_deadline)
        except Skip as exc:
            rec.update(suite.skip(f"dit/{name}", str(exc)))
        except Exception as exc:  # noqa: BLE001 - the other model still runs
            rec.update({"status": "failed", "reason": short_exc(exc), "traceback": traceback.format_exc(limit=10)[-3000:]})
            log(f"FAILED dit/{name}: {short_exc(exc)}")
        suite.save()


def run_dit_model(suite: Suite, spec: DiTSpec, rec: dict, deadline: float) -> None:
    dev, smoke = suite.device, suite.smoke
    warmup, iters = (1, 1) if smoke else ((1, 3) if spec.family == "flux" else (1, 2))
    if suite.left(deadline) < 10 and not smoke:
        raise Skip("section deadline reached before building this model")
    log(f"-- dit/{spec.name}: building {model_bytes(spec) / GIB:.1f} GiB of random "
        f"{str(DTYPE['value']).removeprefix('torch.')} weights in host RAM")
    host = HostWeights(make_meta_model(spec), pin=False)
    rec.update({"weights_bytes": host.nbytes, "block_bytes": block_bytes(spec), "host_fill_s": rnd(host.fill_s, 2)})
    log(f"   filled in {host.fill_s:.1f}s")
    levers = LeversPrefetch(suite.pieces)
    try:
        if levers.reason is None:
            try:
                rec["levers_store"] = levers.build_store(spec, host, dev)
                log(f"   GroupPrefetch arena: {gb(levers.store.host_bytes)} GiB packed in {levers.build_s:.1f}s, "
                    f"pinned {gb(levers.store.pinned_bytes)} GiB")
            except Exception as exc:  # noqa: BLE001 - the other engines still run
                levers.reason = f"building the GroupPrefetch host arena failed: {short_exc(exc)}"
                rec["levers_store"] = {"failed": levers.reason, "traceback": traceback.format_exc(limit=8)[-2500:]}
                log(f"   {levers.reason}")
                levers.close()
                levers.reason = levers.reason or "arena build failed"
        if dev.type == "cuda" and not suite.args.no_prepin:
            host._pin()      # whatever the arena does not already cover (all of it without GroupPrefetch)
        gc.collect()         # the block tensors the arena replaced go back to the OS here
        rec.update({"host_pin_s": rnd(host.pin_s, 2), "host_pinned_bytes_by_suite": host.pinned_bytes,
                    "host_pin": host.pin_reason})
        _dit_cases(suite, spec, rec, deadline, host, levers, warmup, iters)
    finally:
        levers.close()
        host.release()
        free_device_memory(dev)


def _dit_cases(suite: Suite, spec: DiTSpec, rec: dict, deadline: float, host: HostWeights,
               levers: LeversPrefetch, warmup: int, iters: int) -> None:
    dev, smoke = suite.device, suite.smoke
    inputs = make_inputs(spec, dev)
    ref: dict[str, Any] = {"out": None, "s_per_step": None, "act_peak": None}
    cases = rec["cases"]

    cost: dict[str, float] = {}     # wall seconds of the last finished case per engine

    def case(engine: str, label: str | None, budget: int | None, fn: Callable[[dict], None]) -> dict:
        r = {"model": spec.name, "engine": engine, "budget": label, "budget_bytes": budget}
        cases.append(r)
        t0 = time.monotonic()
        suite.guarded_case(f"dit/{spec.name}/{engine}/{label or 'unbudgeted'}", r, lambda: fn(r))
        r["case_wall_s"] = rnd(time.monotonic() - t0, 2)
        if r.get("status") == "ok":
            cost[engine] = r["case_wall_s"]
        suite.save()
        return r

    def finish(r: dict, times: list[float], out: torch.Tensor, setup_s: float, budget: int | None) -> None:
        pk = peak_allocated(dev)
        r.update({"s_per_step": rnd(statistics.median(times), 4), "steps_s": [rnd(t, 4) for t in times],
                  "setup_s": rnd(setup_s, 3), "peak_allocated_bytes": pk, "peak_reserved_bytes": peak_reserved(dev),
                  "within_budget": None if budget is None or pk is None else bool(pk <= budget)})
        r.update(compare(out, ref["out"]))
        log(f"   {r['engine']:<16} {str(r['budget'] or 'unbudgeted'):>14}: {r['s_per_step']:.4f} s/step, peak "
            f"{gb(pk)} GiB, setup {setup_s:.1f}s, bit-exact {r.get('bit_exact')}, max|diff| {r.get('max_abs_diff')}")

    def enough_time(est: float, engine: str | None = None, once: float = 0.0) -> None:
        """Skip a case that would run past the deadline: its engine's last case cost (+20%) once
        one finished, else a conservative estimate from the resident step time; ``once``: seconds of
        one-time work this case adds (not in the engine's last cost)."""
        if engine in cost:
            est = cost[engine] * 1.2 + 2
        est += once
        if not smoke and suite.left(deadline) < est:
            raise Skip(f"section deadline: {suite.left(deadline):.0f}s left, case needs ~{est:.0f}s")

    def run_resident(r: dict, budget: int | None) -> None:
        model = host.bind(make_meta_model(spec))
        reset_peak(dev)
        with vram_budget(dev, budget), torch.inference_mode():
            t0 = time.perf_counter()
            model.to(dev)
            sync(dev)
            upload = time.perf_counter() - t0
            times, out = time_steps(lambda: model(*inputs), dev, warmup, iters, deadline)
        if ref["out"] is None and budget is None:
            ref["out"] = out.detach().to("cpu")
        finish(r, times, out, upload, budget)
        r["upload_gbps"] = rnd(host.nbytes / upload / 1e9, 2)

    # the floor: fully resident, no budget (the compute floor and the reference output)
    def floor(r: dict) -> None:
        run_resident(r, None)
        ref["s_per_step"] = r["s_per_step"]
        if ref["out"] is not None:      # for engines timed in other processes (the dynamic section)
            torch.save(ref["out"], suite.scratch / f"ref-{spec.name}.pt")
        if r["peak_allocated_bytes"] is not None:
            ref["act_peak"] = r["peak_allocated_bytes"] - host.nbytes
        r.update({"note": "unbudgeted: the compute floor and the reference output",
                  "activation_peak_bytes": ref["act_peak"]})

    case("resident", None, None, floor)
    step_est = ref["s_per_step"] or 1.0

    # the same model quantized to fp8 by QuantizeDiT (census applied), resident, unbudgeted, once
    # per fp8 compute mode (quantized once; the modes only change how each layer multiplies)
    qstate: dict[str, Any] = {}

    def fp8(r: dict, mode: str) -> None:
        q = suite.pieces.need("quant", "QuantConfig", "quantize_model")
        if q is None:
            raise Skip(f"core/quant unavailable ({suite.pieces.status.get('quant')})")
        enough_time(10 + (warmup + iters) * step_est)
        if "model" not in qstate:
            model = host.bind(make_meta_model(spec))
            with torch.inference_mode():
                model.to(dev)
                t0 = time.perf_counter()
                qstate["model"], qstate["report"] = q.quantize_model(model, q.QuantConfig(format="fp8_e4m3fn"))
                sync(dev)
                qstate["quant_s"] = time.perf_counter() - t0
            del model
            free_device_memory(dev)
        qmodel, report = qstate["model"], qstate["report"]
        layers = [m for m in qmodel.modules() if hasattr(m, "fp8_compute")]
        for m in layers:
            m.fp8_compute = mode
        probe_in = torch.zeros(2, layers[0].in_features, device=dev, dtype=DTYPE["value"]) if layers else None
        if mode != "off" and not (layers and layers[0]._fp8_fast_path(probe_in)):
            raise Skip(f"fp8 compute mode {mode}: fast path unavailable on this GPU/torch")
        reset_peak(dev)
        with torch.inference_mode():
            times, out = time_steps(lambda: qmodel(*inputs), dev, warmup, iters, deadline)
        finish(r, times, out, qstate["quant_s"], None)
        qstate["out"], qstate["mode"] = out.detach().to("cpu"), mode     # the streamed fp8 case's reference
        r["fp8_compute_mode"] = mode
        fell_back = fp8_failures(suite)
        if fell_back:
            r["fp8_mode_failures"] = fell_back
            log(f"   fp8 GEMM fell back: {fell_back}")
        r["quantize_s"] = rnd(qstate["quant_s"], 2)
        r["weight_bytes_after"] = sum(p.numel() * p.element_size() for p in qmodel.parameters())
        if ref["out"] is not None:
            r["sqnr_db_vs_bf16"] = rnd(sqnr_db(ref["out"], out.detach().to("cpu")), 2)
        if ref["s_per_step"]:
            r["speedup_vs_bf16"] = rnd(ref["s_per_step"] / r["s_per_step"], 3)
        fp8_mod = suite.pieces.get("quant.fp8")
        if fp8_mod is not None and hasattr(fp8_mod, "fp8_compute_available"):
            ok, why = fp8_mod.fp8_compute_available(dev)
            r["fp8_compute"] = {"ok": ok, "reason": why}
        r["quant_report"] = {k: _short(getattr(report, k, None)) for k in
                             ("arch", "size_before", "size_after", "kept_bytes", "kept_count", "notes")}
        r["quant_report"]["layers"] = len(getattr(report, "layers", []) or [])

    # the fp8 model streamed by GroupPrefetch: QuantizeDiT's fp8 bytes (+ scales) in their own pinned arena,
    # half the bf16 bytes over the bus; its reference is the resident fp8 output of the last compute mode
    levers_fp8 = None
    if not suite.args.no_fp8_dit:
        try:
            for mode in suite.args.fp8_modes.split(","):
                case("resident_fp8" if mode == "off" else f"resident_fp8_{mode}", None, None,
                     lambda r, mode=mode: fp8(r, mode))
            if not suite.args.no_fp8_stream and "model" in qstate and not levers.reason:
                with torch.inference_mode():
                    qstate["model"].to("cpu")
                free_device_memory(dev)
                levers_fp8 = LeversPrefetch(suite.pieces)
                rec["levers_fp8_store"] = levers_fp8.build_store_for(qstate["model"], dev)
        except Exception as exc:  # noqa: BLE001 - the bf16 cases must still run
            rec["levers_fp8_store"] = {"status": "failed", "reason": short_exc(exc)}
            levers_fp8 = None
        finally:
            if levers_fp8 is None:
                qstate.clear()
            free_device_memory(dev)

    extra: list[tuple[str, str, int, Callable[[dict], None]]] = []
    for label, budget in dit_budgets(suite, spec):
        def prefetch(r: dict, budget=budget, levers=levers, packed: bool = False, label=label) -> None:
            if levers.reason:
                raise Skip(levers.reason)
            pf_warmup = int(getattr(levers.mod, "CALIBRATION_FORWARD", 0)) + 2
            # the first packed case also packs the arena on the GPU (chunked copies both ways, then pinning the planes)
            first_pack = packed and levers.pack_s is None and levers.store is not None
            enough_time(8 + (pf_warmup + iters) * step_est * 3, "levers_prefetch",
                        once=levers.store.host_bytes / 2e9 if first_pack else 0.0)
            if packed:
                plain = next((c for c in cases if c.get("engine") == "levers_prefetch"
                              and c.get("budget") == label and c.get("status") == "ok"), None)
                if plain is not None and not plain.get("h2d_bytes_per_step"):
                    raise Skip("nothing streams at this budget (the plain GroupPrefetch case moved 0 bytes)")
            # GroupPrefetch budgets weights only; the card budget also holds activations, so the
            # engine gets budget - (measured activation peak of the resident run + 10% + 256 MiB).
            act = ref["act_peak"] or 0
            weights_budget = None if dev.type != "cuda" else max(0, int(budget - act * 1.1 - 256 * MIB))
            if dev.type != "cuda":
                weights_budget = budget
            r["weights_budget_bytes"] = weights_budget
            reset_peak(dev)
            handle = None
            try:
                with vram_budget(dev, budget), torch.inference_mode():
                    t0 = time.perf_counter()
                    handle = levers.apply(weights_budget, packed)
                    sync(dev)
                    setup = time.perf_counter() - t0
                    # warm-ups until steady state: GroupPrefetch times one forward (CALIBRATION_FORWARD),
                    # re-plans at the start of the next, and runs that one with the new layout
                    b0 = levers.h2d_bytes()
                    times, out = time_steps(lambda: levers.model(*inputs), dev, pf_warmup, iters, deadline)
                    b1 = levers.h2d_bytes()
                finish(r, times, out, setup, budget)
                info = levers.stats(handle)
                st = info.get("stats") if isinstance(info.get("stats"), dict) else {}
                last = (st or {}).get("last_forward", {}) or {}
                r["h2d_bytes_per_step"] = last.get("h2d_bytes", int((b1 - b0) / max(1, pf_warmup + len(times))))
                r["warmup_forwards"] = pf_warmup
                r["d2h_bytes_per_step"] = last.get("d2h_bytes")
                r["levers_stats"] = st
                r["levers_report"] = info.get("report")
                if levers is levers_fp8 and qstate.get("out") is not None:
                    ref_fp8 = qstate["out"]
                    r["fp8_compute_mode"] = qstate.get("mode")
                    r["fp8_mode_failures"] = fp8_failures(suite) or None
                    r["bit_exact_vs_resident_fp8"] = bool(torch.equal(out.detach().to("cpu"), ref_fp8))
                    r["max_abs_diff_vs_resident_fp8"] = rnd(float((out.detach().float().cpu()
                                                                   - ref_fp8.float()).abs().max()), 6)
                if packed:
                    r["packed_active"] = bool((st or {}).get("packed"))    # False: the planner streamed as stored
                    r["pack_s"] = rnd(levers.pack_s, 2)
                    r["stream_device_bytes_per_step"] = (st or {}).get("stream_device_bytes_per_forward")
            finally:
                if handle is not None:
                    handle.remove()
                if packed and hasattr(levers.store, "use_packed"):
                    levers.store.use_packed = False

        def comfy(r: dict, budget=budget) -> None:
            cb = suite.comfy
            if cb is None or not cb.ok:
                raise Skip(f"ComfyUI baseline unavailable: {cb.reason if cb else 'not set up'}")
            enough_time(8 + (warmup + iters) * step_est * 4, "comfyui_lowvram")

            def attempt(extra_reserve: int) -> None:
                model, patcher = cb.build(spec, host)
                reset_peak(dev)
                try:
                    with vram_budget(dev, budget), torch.inference_mode(), cb.extra_reserve(extra_reserve):
                        t0 = time.perf_counter()
                        r["comfy_load"] = cb.load(patcher, spec, budget)
                        sync(dev)
                        setup = time.perf_counter() - t0
                        times, out = time_steps(lambda: patcher.model(*inputs), dev, warmup, iters, deadline)
                    finish(r, times, out, setup, budget)
                    r["h2d_bytes_per_step"] = r["comfy_load"]["model_bytes"] - r["comfy_load"]["loaded_bytes"]
                    r["h2d_note"] = "estimated: ComfyUI casts every weight it did not load, once per forward"
                finally:
                    cb.release(patcher)

            first_oom = None
            try:
                attempt(0)
            except Exception as exc:  # noqa: BLE001 - OOM only; anything else propagates
                if not is_oom(exc) or dev.type != "cuda":
                    raise
                first_oom = {"status": "oom", "reason": short_exc(exc, 300), "peak_allocated_bytes": peak_allocated(dev)}
            if first_oom is None:
                return
            # Outside the except block (its traceback held the failed attempt's frames and so its
            # GPU tensors). ComfyUI sized its load from its own activation estimate and ran out at
            # the cap; a user would add --reserve-vram: retry once with the shortfall reserved so
            # the comparison still has a ComfyUI number, and record both.
            shortfall = max(0, (ref["act_peak"] or 0) - cb.memory_estimate(spec, 1)) + 512 * MIB
            r["first_attempt"] = first_oom
            log(f"   comfyui_lowvram  {label:>14}: OOM with ComfyUI's own estimate; retrying with "
                f"--reserve-vram +{gb(shortfall)} GiB")
            free_device_memory(dev)
            r["allocated_before_retry_bytes"] = allocated(dev)
            enough_time(5 + (warmup + iters) * step_est * 4)
            r["reserve_vram_added_bytes"] = shortfall
            attempt(shortfall)
            r["note"] = ("ComfyUI's default estimate ran out of memory at this budget (first_attempt); "
                         "timed with the shortfall added as --reserve-vram")

        def resident(r: dict, budget=budget) -> None:
            need = host.nbytes + (ref["act_peak"] or 0)
            if dev.type == "cuda" and need > budget:
                r.update({"status": "does_not_fit", "needed_bytes": need,
                          "reason": f"weights {gb(host.nbytes)} GiB + activations {gb(ref['act_peak'])} GiB "
                                    f"> budget {gb(budget)} GiB"})
                log(f"   resident         {label:>14}: does not fit ({gb(need)} GiB needed)")
                return
            enough_time(5 + (warmup + iters) * step_est)
            run_resident(r, budget)

        case("levers_prefetch", label, budget, prefetch)
        case("comfyui_lowvram", label, budget, comfy)
        case("resident", label, budget, resident)
        if not suite.args.no_packed_stream:
            extra.append(("levers_prefetch_packed", label, budget,
                          lambda r, budget=budget, fn=prefetch: fn(r, budget, levers, True)))
        if levers_fp8 is not None:
            extra.append(("levers_prefetch_fp8", label, budget,
                          lambda r, budget=budget, fn=prefetch: fn(r, budget, levers_fp8)))
    # the extra levers after the main comparison at every budget, lowest budget first (packed, then fp8, at each):
    # a tight deadline drops the budgets where the least streams, not every fp8 case
    for engine, label, budget, fn in sorted(extra, key=lambda e: e[2]):
        case(engine, label, budget, fn)
    if levers_fp8 is not None:
        levers_fp8.close()
        qstate.clear()


# --------------------------------------------------------------------------------------------
# section 4: PhaseOffload (re-onload bandwidth, zero-byte offload) vs a plain .to() round trip
# --------------------------------------------------------------------------------------------

class EncoderShaped(nn.Module):
    """A T5-XXL-shaped stack (d_model 4096, FFN 10240): what phase offload moves around."""

    def __init__(self, layers: int, d: int = 4096, ffn: int = 10240, device=None, dtype=torch.bfloat16):
        super().__init__()
        dd = {"device": device, "dtype": dtype}
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(d, 3 * d, bias=False, **dd), nn.Linear(3 * d, d, bias=False, **dd),
                                                  nn.Linear(d, ffn, bias=False, **dd), nn.GELU(),
                                                  nn.Linear(ffn, d, bias=False, **dd)) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x) * 0.1
        return x


def sec_phase(suite: Suite, sec: dict, deadline: float) -> None:
    dev = suite.device
    if dev.type != "cuda" and not suite.smoke:
        raise Skip("no CUDA device: phase re-onload bandwidth needs a GPU (run --smoke to exercise the code on CPU)")
    phase = suite.pieces.need("residency.phase", "apply_phase_offload", "PhaseConfig")
    if phase is None:
        raise Skip(f"core/residency/phase.py unavailable ({suite.pieces.status.get('residency.phase')})")
    from comfyui_levers.core.residency.transport import make_transport
    d, ffn = (64, 160) if suite.smoke else (4096, 10240)
    per_layer = (3 * d * d + 3 * d * d + 2 * d * ffn) * 2
    layers = 2 if suite.smoke else max(1, int(suite.args.phase_gib * GIB // per_layer))
    dt = DTYPE["value"]
    meta = EncoderShaped(layers, d, ffn, device="meta", dtype=dt)
    host = HostWeights(meta, pin=False)       # pageable: PhaseOffload does its own pinning
    res: dict[str, Any] = {"module": f"T5-XXL-shaped stack, {layers} layers", "bytes": host.nbytes,
                           "host_fill_s": rnd(host.fill_s, 2)}
    sec["results"] = res
    log(f"  module {host.nbytes / GIB:.2f} GiB ({layers} layers)")
    x = torch.randn(1, 16, d, dtype=dt).to(dev)
    try:
        # reference output: a plain resident copy
        ref_model = host.bind(EncoderShaped(layers, d, ffn, device="meta", dtype=dt))
        with torch.inference_mode():
            t0 = time.perf_counter()
            ref_model.to(dev)
            sync(dev)
            res["plain_to_device_s"] = rnd(time.perf_counter() - t0, 4)
            ref = ref_model(x).to("cpu")
            t0 = time.perf_counter()
            ref_model.to("cpu")                  # what ComfyUI's unload does: a real D2H copy
            res["plain_to_cpu_s"] = rnd(time.perf_counter() - t0, 4)
        res["plain_to_device_gbps"] = rnd(host.nbytes / res["plain_to_device_s"] / 1e9, 2)
        res["plain_offload_d2h_bytes"] = host.nbytes
        del ref_model
        free_device_memory(dev)

        model = host.bind(EncoderShaped(layers, d, ffn, device="meta", dtype=dt))
        transport = make_transport(dev)
        t0 = time.perf_counter()
        handle = phase.apply_phase_offload(model, phase.PhaseConfig(name="text_encoder", pin="on"), transport)
        res["stage_s"] = rnd(time.perf_counter() - t0, 3)
        cycles = []
        masters = handle.master_ptrs()
        same_ptr = True
        with torch.inference_mode():
            for i in range(2 if suite.smoke else 4):
                on = handle.onload(f"encode{i}")
                out = model(x)
                sync(dev)
                off = handle.offload()
                ptrs_ok = all(p.data_ptr() == masters.get(n, -1) for n, p in model.named_parameters())
                same_ptr = same_ptr and ptrs_ok
                cycles.append({"onload_gbps": on.get("gbps"), "onload_s": on.get("seconds"),
                               "onload_h2d_bytes": on.get("h2d_bytes"), "offload_d2h_bytes": off.get("d2h_bytes"),
                               "offload_s": off.get("seconds")})
        res["cycles"] = cycles
        res.update(compare(out, ref))
        res["params_point_at_masters_after_offload"] = same_ptr
        rep = handle.report()
        res["pin"] = rep.get("pin")
        res["ledger_totals"] = rep.get("ledger", {}).get("totals")
        gbps = [c["onload_gbps"] for c in cycles[1:] or cycles if c["onload_gbps"]]
        res["onload_gbps_median"] = rnd(statistics.median(gbps), 2) if gbps else None
        res["offload_d2h_bytes_total"] = sum(c["offload_d2h_bytes"] or 0 for c in cycles)
        handle.remove()
        log(f"  re-onload {res['onload_gbps_median']} GB/s (plain .to(): {res['plain_to_device_gbps']} GB/s), "
            f"offload D2H {res['offload_d2h_bytes_total']} bytes (plain .to('cpu'): {res['plain_to_cpu_s']}s), "
            f"bit-exact {res.get('bit_exact')}")
    finally:
        host.release()


# --------------------------------------------------------------------------------------------
# section 3: fp8 / int8 / nf4 vs bf16 on FLUX-shaped linears
# --------------------------------------------------------------------------------------------

FLUX_LINEARS = (("double.qkv", 3072, 9216), ("double.proj", 3072, 3072), ("double.mlp_in", 3072, 12288),
                ("double.mlp_out", 12288, 3072), ("single.linear1", 3072, 21504), ("single.linear2", 15360, 3072))
FORMATS = ("fp8_e4m3fn", "int8", "nf4")


def bench_fn(fn: Callable[[], Any], device: torch.device, warmup: int, reps: int) -> float:
    """Median seconds per call; CUDA events on the GPU (kernel time, no host jitter)."""
    for _ in range(warmup):
        fn()
    sync(device)
    if device.type == "cuda":
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        return statistics.median(times)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def sec_quant(suite: Suite, sec: dict, deadline: float) -> None:
    dev = suite.device
    if dev.type != "cuda" and not suite.smoke:
        raise Skip("no CUDA device: quantized matmul speed needs a GPU (run --smoke to exercise the code on CPU)")
    q = suite.pieces.need("quant", "QuantConfig", "QuantLinear", "get_quantizer")
    if q is None:
        raise Skip(f"core/quant unavailable ({suite.pieces.status.get('quant')})")
    tokens = 64 if suite.smoke else 4608
    shapes = tuple((n, max(32, i // 48), max(32, o // 48)) for n, i, o in FLUX_LINEARS[:2]) if suite.smoke \
        else FLUX_LINEARS
    warmup, reps = (1, 1) if suite.smoke else (3, 10)
    avail = {}
    for fmt in FORMATS:
        try:
            ok, why = q.get_quantizer(fmt).available()
        except Exception as exc:  # noqa: BLE001
            ok, why = False, short_exc(exc)
        avail[fmt] = {"ok": bool(ok), "reason": why}
    fp8_mod = suite.pieces.get("quant.fp8")
    fp8_compute = fp8_mod.fp8_compute_available(dev) if fp8_mod and hasattr(fp8_mod, "fp8_compute_available") \
        else (False, "core/quant/fp8.py has no fp8_compute_available")
    try:
        from comfyui_levers.core.quant import fp8_triton
        sec["fp8_activation_kernel"] = {"triton": fp8_triton._kernel() is not None, "broken": list(fp8_triton._BROKEN)}
    except Exception as exc:  # noqa: BLE001 - informational
        sec["fp8_activation_kernel"] = {"error": short_exc(exc)}
    sec.update({"tokens": tokens, "backends": avail, "fp8_compute": {"ok": fp8_compute[0], "reason": fp8_compute[1]},
                "note": "per-linear kernel time (CUDA events, median), FLUX linear shapes, one 1024x1024 step's "
                        "tokens; SQNR of the layer output vs bf16 (dB)", "layers": []})
    for fmt, a in avail.items():
        if not a["ok"]:
            suite.results["skipped"].append(f"quant/{fmt}: {a['reason']}")
    g = torch.Generator(device=dev).manual_seed(0)
    for name, k, n in shapes:
        if suite.left(deadline) < 3 and not suite.smoke:
            sec["layers"].append({"layer": name, "status": "skipped", "reason": "section deadline"})
            continue
        row: dict[str, Any] = {"layer": name, "in": k, "out": n}
        sec["layers"].append(row)
        with torch.inference_mode():
            lin = nn.Linear(k, n, bias=True, device=dev, dtype=DTYPE["value"])
            lin.weight.normal_(0, 0.02, generator=g)
            lin.bias.normal_(0, 0.02, generator=g)
            x = torch.randn(tokens, k, device=dev, generator=g).to(DTYPE["value"])
            ref = lin(x)
            t = bench_fn(lambda: lin(x), dev, warmup, reps)
            row["bf16"] = {"ms": rnd(t * 1e3, 4), "weight_bytes": k * n * lin.weight.element_size(),
                           "dtype": str(DTYPE["value"])}
            for fmt in FORMATS:
                if not avail[fmt]["ok"]:
                    row[fmt] = {"skipped": avail[fmt]["reason"]}
                    continue
                try:
                    ql = q.QuantLinear.from_linear(lin, q.QuantConfig(format=fmt))
                    y = ql(x)
                    t = bench_fn(lambda: ql(x), dev, warmup, reps)
                    wbytes = sum(p.numel() * p.element_size() for nm, p in ql.named_parameters() if nm != "bias")
                    cell = {"ms": rnd(t * 1e3, 4), "sqnr_db": rnd(sqnr_db(ref, y), 2), "weight_bytes": wbytes,
                            "speedup_vs_bf16": rnd(row["bf16"]["ms"] / (t * 1e3), 3)}
                    if fmt == "fp8_e4m3fn" and hasattr(ql, "fp8_compute"):
                        cell["mode"] = ql._fp8_mode() if ql._fp8_fast_path(x) else "off"
                        cell["modes"] = fp8_modes(q, lin, x, ref, dev, warmup, reps, row["bf16"]["ms"])
                    row[fmt] = cell
                except Exception as exc:  # noqa: BLE001 - one format failing must not hide the others
                    row[fmt] = {"failed": short_exc(exc)}
        free_device_memory(dev)
        log(f"  {name:<15} bf16 {row['bf16']['ms']:.3f} ms | " + " | ".join(
            f"{f} {row[f].get('ms', '-')} ms {row[f].get('sqnr_db', '')} dB" for f in FORMATS if isinstance(row.get(f), dict)))
    # speed-ups over the layers where both bf16 and the format ran
    with contextlib.suppress(Exception):
        from comfyui_levers.core.quant import fp8_triton
        sec.setdefault("fp8_activation_kernel", {})["broken_after"] = list(fp8_triton._BROKEN)
    sec["fp8_mode_failures"] = fp8_failures(suite) or None
    sec["fp8_modes_speedup_vs_bf16"] = {}
    for key in ("off/per_row", "tensorwise/per_tensor", "tensorwise/per_row", "rowwise/per_row"):
        rows = [r for r in sec["layers"] if "ms" in ((r.get("fp8_e4m3fn") or {}).get("modes") or {}).get(key, {})]
        if rows:
            sec["fp8_modes_speedup_vs_bf16"][key] = rnd(
                sum(r["bf16"]["ms"] for r in rows) / sum(r["fp8_e4m3fn"]["modes"][key]["ms"] for r in rows), 3)
    sec["speedup_vs_bf16"] = {}
    for fmt in FORMATS:
        rows = [r for r in sec["layers"] if isinstance(r.get(fmt), dict) and "ms" in r[fmt] and "bf16" in r]
        if rows:
            sec["speedup_vs_bf16"][fmt] = rnd(sum(r["bf16"]["ms"] for r in rows) / sum(r[fmt]["ms"] for r in rows), 3)


def fp8_modes(q, lin, x, ref, dev, warmup: int, reps: int, bf16_ms: float) -> dict:
    """Every fp8 compute mode (and weight granularity) of QuantLinear on one layer: ms, SQNR."""
    out: dict[str, dict] = {}
    for mode, gran in (("off", "per_row"), ("tensorwise", "per_tensor"), ("tensorwise", "per_row"),
                       ("rowwise", "per_row")):
        key = f"{mode}/{gran}"
        try:
            ql = q.QuantLinear.from_linear(lin, q.QuantConfig(format="fp8_e4m3fn", granularity=gran))
            ql.fp8_compute = mode
            if mode != "off" and not ql._fp8_fast_path(x):
                out[key] = {"skipped": "fp8 fast path unavailable here"}
                continue
            y = ql(x)
            t = bench_fn(lambda: ql(x), dev, warmup, reps)
            out[key] = {"ms": rnd(t * 1e3, 4), "sqnr_db": rnd(sqnr_db(ref, y), 2),
                        "speedup_vs_bf16": rnd(bf16_ms / (t * 1e3), 3)}
        except Exception as exc:  # noqa: BLE001 - one mode failing must not hide the others
            out[key] = {"failed": short_exc(exc)}
    return out


# --------------------------------------------------------------------------------------------
# PhaseOffload inside a real ComfyUI (text encoder, DiT, VAE through the stock loaders and nodes)
# --------------------------------------------------------------------------------------------

def sec_comfy_phase(suite: Suite, sec: dict, deadline: float) -> None:
    if suite.device.type != "cuda" and not suite.smoke:
        raise Skip("no CUDA device: PhaseOffload-in-ComfyUI needs a GPU (--smoke runs it on the CPU)")
    if not suite.args.comfyui:
        raise Skip("no --comfyui PATH")
    if str(ROOT / "bench") not in sys.path:
        sys.path.insert(0, str(ROOT / "bench"))
    import comfy_phase
    scale = "gpu" if suite.device.type == "cuda" and not suite.smoke else "cpu"
    # filled in place: the watchdog's save keeps the cases done if the suite must exit during this section
    sec["results"] = res = {}
    comfy_phase.run_phase_bench(suite.args.comfyui, str(suite.device), None, scale=scale,
                                deadline_s=max(10.0, deadline - time.monotonic()), out_dir=str(suite.scratch),
                                into=res)
    log(f"  PhaseOffload in ComfyUI: {res.get('status')}, total time phase/default "
        f"{res.get('ratio_total_time')}, bit-identical {res.get('bit_identical')}"
        + (f" ({str(res.get('reason'))[:200]})" if res.get("reason") else ""))
    if res["status"] == "skipped":
        raise Skip(res["reason"])
    if res["status"] != "ok":
        sec.update(status="partial" if res["status"] == "partial" else "failed", reason=res.get("reason"))


# --------------------------------------------------------------------------------------------
# ComfyUI's DynamicVRAM at the same budgets (its own process per case: bench/comfy_dynamic.py)
# --------------------------------------------------------------------------------------------

def sec_dynamic(suite: Suite, sec: dict, deadline: float) -> None:
    dev = suite.device
    if dev.type != "cuda" and not suite.smoke:
        raise Skip("no CUDA device: DynamicVRAM runs only on a GPU")
    path = suite.args.comfyui_dynamic
    if not path:
        raise Skip("no --comfyui-dynamic PATH (a DynamicVRAM-era ComfyUI, 0.15+, with comfy-aimdo installed)")
    free_device_memory(dev)
    if dev.type == "cuda":
        # comfy-aimdo keeps --vram-headroom free counting every process on the card (ComfyUI's help text): this
        # process's context, cuBLAS/Triton state and cached blocks stay on the card while the child runs. Taking the
        # headroom from the card's size would charge them to DynamicVRAM's budget (Levers' cap excludes them), so
        # the child is told what is free now.
        free_now, card = torch.cuda.mem_get_info(dev)
        total = int(free_now)
        sec["parent_device_used_bytes"] = int(card - free_now)
    else:
        total = 64 * GIB
    dit = suite.results["sections"].get("dit", {}).get("models", {})
    cases: list[dict[str, Any]] = []
    sec.update({"comfyui": str(path), "cases": cases,
                "note": "ComfyUI's ModelPatcherDynamic + comfy-aimdo on the suite's DiT (same seeded weights and "
                        "inputs), one process per case; the card is emulated with aimdo's VRAM headroom "
                        "(free memory at the case's start - budget, ComfyUI's --vram-headroom, which counts every process) and ComfyUI's free-memory reads; "
                        "device_used_after_step = device memory in use after each step minus before the load"})
    for item in suite.args.dynamic_cases.split(","):
        model, _, gib = item.partition(":")
        label = f"{float(gib):g} GiB"
        left = suite.left(deadline)
        row: dict[str, Any] = {"model": model, "budget": label}
        cases.append(row)
        if left < 30 and not suite.smoke:
            row.update({"status": "skipped", "reason": f"section deadline: {left:.0f}s left"})
            continue
        cmd = [sys.executable, str(ROOT / "bench" / "comfy_dynamic.py"), "--comfyui", str(path), "--model", model,
               "--budget-gib", gib, "--total-bytes", str(total), "--seconds", f"{max(5.0, min(40.0, left - 25)):.0f}"]
        cmd += ["--dtype", {torch.bfloat16: "bf16", torch.float32: "fp32"}[DTYPE["value"]]]
        ref = suite.scratch / f"ref-{model}.pt"
        if ref.is_file():
            cmd += ["--ref", str(ref)]
        if suite.smoke:
            cmd += ["--smoke"] + (["--dry-cpu"] if dev.type != "cuda" else [])
        t0 = time.monotonic()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=max(20.0, left - 3))
            line = next((ln for ln in reversed(proc.stdout.splitlines()) if ln.startswith("LEVERS_JSON ")), None)
            if line is None:
                row.update({"status": "failed", "reason": f"no result (exit {proc.returncode})",
                            "stderr_tail": proc.stderr[-2500:]})
            else:
                row.update(json.loads(line[len("LEVERS_JSON "):]))
                row["log_tail"] = proc.stderr[-1500:]
        except subprocess.TimeoutExpired as exc:
            row.update({"status": "timeout", "reason": f"killed after {exc.timeout:.0f}s",
                        "stderr_tail": (exc.stderr or b"")[-2500:].decode(errors="replace")
                        if isinstance(exc.stderr, bytes) else str(exc.stderr or "")[-2500:]})
        row["case_wall_s"] = rnd(time.monotonic() - t0, 2)
        ours = next((c for c in (dit.get(model) or {}).get("cases", [])
                     if c.get("engine") == "levers_prefetch" and c.get("budget") == label and c.get("status") == "ok"),
                    None)
        if ours and row.get("status") == "ok" and row.get("s_per_step"):
            row["levers_prefetch_s_per_step"] = ours["s_per_step"]
            row["levers_vs_dynamic"] = rnd(ours["s_per_step"] / row["s_per_step"], 3)
        log(f"  dynamic {model} {label}: {row.get('status')} {row.get('s_per_step')} s/step"
            + (f", Levers/DynamicVRAM {row['levers_vs_dynamic']}" if "levers_vs_dynamic" in row else "")
            + (f" ({str(row.get('reason'))[:160]})" if row.get("reason") else ""))
        suite.save()


# --------------------------------------------------------------------------------------------
# section 6: Recommend's predictions vs what the dit section measured
# --------------------------------------------------------------------------------------------

PRESET_OF = {"flux": ("flux1-dev", 1024, 1024, 1), "wan": ("wan2.1-14b", 832, 480, 33)}


OTHER_PROGRAM_BYTES = 2 * GIB     # what the stand-in for another program holds on the GPU


def withheld_vram_check(probe, plan_mod, presets, deadline: float) -> dict:
    """Recommend leaves out of the budget the VRAM other programs hold (``GPU.others_bytes``). On a real probe:
    a child process (another program) allocates ``OTHER_PROGRAM_BYTES``; the probe must see at least that much
    more held by others, and a plan made then must withhold it."""
    import torch

    if not torch.cuda.is_available():
        return {"status": "skipped", "reason": "no CUDA device"}
    if deadline - time.monotonic() < 8:       # a child's CUDA start takes a few seconds
        return {"status": "skipped", "reason": "not enough time left in the section"}
    before = probe.gpus()[0]
    code = ("import sys, time, torch\n"
            f"x = torch.empty({OTHER_PROGRAM_BYTES}, dtype=torch.uint8, device='cuda')\n"
            "torch.cuda.synchronize(); print('ready', flush=True); sys.stdin.readline()\n")
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        ready = child.stdout.readline().strip() == "ready"
        if not ready:
            return {"status": "failed", "reason": "the child process did not allocate its memory"}
        during = probe.gpus()[0]
        machine = probe.probe(measure_bandwidth=False)
        p = plan_mod.plan(presets.get_preset("flux1-dev"), plan_mod.Workload(1024, 1024), machine)
    finally:
        with contextlib.suppress(Exception):
            child.stdin.write("\n")
            child.stdin.flush()
        with contextlib.suppress(Exception):
            child.wait(timeout=10)
        if child.poll() is None:
            child.kill()
    seen = (during.others_bytes or 0) - (before.others_bytes or 0)
    ok = seen >= OTHER_PROGRAM_BYTES and p.withheld_bytes >= OTHER_PROGRAM_BYTES
    return {"status": "ok" if ok else "failed", "held_by_child_bytes": OTHER_PROGRAM_BYTES,
            "others_before_bytes": before.others_bytes, "others_during_bytes": during.others_bytes,
            "others_increase_bytes": seen, "plan_withheld_bytes": p.withheld_bytes,
            "free_before_bytes": before.free_bytes, "free_during_bytes": during.free_bytes,
            # this process's own CUDA context is in "others" too; the plan assumes this much for it
            "context_bytes_assumed": getattr(plan_mod, "CONTEXT_BYTES", None)}


def sec_recommend(suite: Suite, sec: dict, deadline: float) -> None:
    plan_mod = suite.pieces.need("plan", "plan", "Workload")
    presets = suite.pieces.need("presets", "get_preset", "with_overrides")
    probe = suite.pieces.need("probe", "synthetic_machine")
    if plan_mod is None or presets is None or probe is None:
        raise Skip("core/plan.py, presets.py or probe.py unavailable: "
                   + "; ".join(f"{k}: {v}" for k, v in suite.pieces.status.items() if k in ("plan", "presets", "probe")))
    try:
        sec["withheld_vram"] = withheld_vram_check(probe, plan_mod, presets, deadline)
    except Exception as exc:  # noqa: BLE001
        sec["withheld_vram"] = {"status": "failed", "reason": short_exc(exc)}
    log(f"  withheld VRAM on a real probe: {sec['withheld_vram']}")
    dit = suite.results["sections"].get("dit", {}).get("models", {})
    if not dit:
        raise Skip("the dit section did not run, so there is nothing measured to compare with")
    bw = pinned_gbps(suite.results) or 25.0
    rows = []
    sec.update({"h2d_gbps_used": bw, "rows": rows,
                "note": "predicted DiT sampling peak = plan.diffusion_model.resident_bytes + plan.activation_bytes "
                        "(the plan's own total adds text encoder, VAE and a 1.5 GiB context/fragmentation "
                        "overhead, which a DiT-only measurement does not hold); measured = max_memory_allocated. "
                        "A budgeted case asks the plan about a card of budget + that overhead, since the "
                        "emulated budget caps only the allocator"})
    for name, rec in dit.items():
        preset, w, h, frames = PRESET_OF[name]
        params = (rec.get("weights_bytes") or 0) // 2
        spec = presets.with_overrides(presets.get_preset(preset), dit_params=float(params) if params else None)
        wl = plan_mod.Workload(width=w, height=h, frames=frames, steps=28, batch=1, cfg=False)
        for c in rec.get("cases", []):
            if c.get("status") != "ok" or c["engine"] not in ("resident", "levers_prefetch"):
                continue
            budget = c.get("budget_bytes")
            # The emulated budget caps the caching allocator; the plan's card also loses its CUDA
            # context and fragmentation reserve (plan.OVERHEAD_BYTES), which sit outside that cap.
            # So ask the plan about the card whose memory after that reserve equals the cap.
            overhead_gib = getattr(plan_mod, "OVERHEAD_BYTES", 0) / GIB
            vram_gib = (budget / GIB + overhead_gib) if budget else (suite.results["machine"].get("gpu_memory_gib") or 80)
            t0 = time.perf_counter()
            try:
                machine = probe.synthetic_machine(vram_gb=vram_gib, h2d_gbps=bw)
                p = plan_mod.plan(spec, wl, machine, "quality")   # lossless first: the runs are bf16
            except Exception as exc:  # noqa: BLE001
                rows.append({"model": name, "engine": c["engine"], "budget": c["budget"], "failed": short_exc(exc)})
                continue
            latency = time.perf_counter() - t0
            d = p.diffusion_model
            predicted = int(d.resident_bytes + p.activation_bytes)
            measured = c.get("peak_allocated_bytes")
            row = {"model": name, "engine": c["engine"], "budget": c["budget"], "plan_latency_s": rnd(latency, 4),
                   "plan_vram_gib": rnd(vram_gib, 3),
                   "plan_precision": str(d.precision), "plan_residency": str(d.residency), "plan_fits": p.fits,
                   "predicted_dit_peak_bytes": predicted, "predicted_total_peak_bytes": p.predicted_peak_bytes,
                   "measured_peak_bytes": measured,
                   "peak_error": rnd((predicted - measured) / measured, 4) if measured else None,
                   "predicted_step_s": p.workload.get("predicted_step_seconds"), "measured_step_s": c.get("s_per_step")}
            if d.streaming is not None:
                st = d.streaming
                row["predicted_streamed_bytes_per_step"] = st.streamed_bytes_per_step
                row["measured_streamed_bytes_per_step"] = c.get("h2d_bytes_per_step")
                row["predicted_extra_s_per_step"] = rnd(p.predicted_extra_seconds / max(1, wl.steps), 4)
            if row["predicted_step_s"] and row["measured_step_s"]:
                row["step_error"] = rnd((row["predicted_step_s"] - row["measured_step_s"]) / row["measured_step_s"], 4)
            rows.append(row)
            log(f"  {name} {c['engine']} {c['budget'] or 'unbudgeted'}: plan {d.precision}/{d.residency}, "
                f"predicted peak {gb(predicted)} GiB vs measured {gb(measured)} GiB ({row['peak_error']})")
    errs = [abs(r["peak_error"]) for r in rows if r.get("peak_error") is not None]
    sec["peak_error_abs_max"] = rnd(max(errs), 4) if errs else None


# --------------------------------------------------------------------------------------------
# section 5: TiledVAEDecode peak vs untiled (filled in below once core/tiling is importable)
# --------------------------------------------------------------------------------------------

def sec_vae(suite: Suite, sec: dict, deadline: float) -> None:
    dev = suite.device
    if dev.type != "cuda" and not suite.smoke:
        raise Skip("no CUDA device: VAE decode peak memory needs a GPU (run --smoke to exercise the code on CPU)")
    run_vae_cases(suite, sec, deadline)


def psnr_db(ref: torch.Tensor, test: torch.Tensor) -> float:
    ref, test = ref.float(), test.float()
    mse = float((ref - test).pow(2).mean())
    peak = float(ref.abs().max())
    return float("inf") if mse == 0 else 10 * math.log10(peak * peak / mse)


def _init_random(module: nn.Module, seed: int) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.ndim == 0:
                p.fill_(1.0)
            elif p.ndim == 1:
                p.fill_(1.0) if (name.endswith("weight") and "norm" in name) else p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p[0].numel()))
    return module.eval()


def _vae_builder(suite: Suite, bm):
    """(make(ch_base, blocks) -> decoder, stage(decoder) -> StagedDecoder, description).

    With ComfyUI present: its own ``Decoder`` (the FLUX VAE config) staged exactly as the node
    stages it (``bridge.vae._kl``). Otherwise the Levers bench shape with a latent-resolution stem.
    """
    if suite.comfy is not None and suite.comfy.ok:
        try:
            from comfy.ldm.modules.diffusionmodules.model import Decoder
            from comfyui_levers.bridge import vae as bridge_vae
            if hasattr(bridge_vae, "_kl"):
                def make(ch_base: int, blocks: int):
                    return Decoder(ch=ch_base, out_ch=3, ch_mult=(1, 2, 4, 4), num_res_blocks=blocks - 1,
                                   attn_resolutions=[], in_channels=3, resolution=256, z_channels=16)

                def stage(dec):
                    return bridge_vae._kl(types.SimpleNamespace(decode=dec.forward), dec)
                return make, stage, "ComfyUI's Decoder (FLUX VAE config), staged by bridge/vae.py as the node does"
        except Exception as exc:  # noqa: BLE001 - fall back to the bench shape, saying why
            log(f"  ComfyUI Decoder unavailable for the VAE bench ({short_exc(exc, 200)}); using the bench shape")

    def make_bm(ch_base: int, blocks: int):
        return bm.VaeDecoderShaped(ch=(ch_base, 2 * ch_base, 4 * ch_base, 4 * ch_base), blocks=blocks)
    return make_bm, lambda dec: dec.staged(), "Levers bench FLUX-VAE shape (core/benchmark.py), latent-resolution stem"


def _vae_halo(make, stage, tiling, blocks: int) -> float:
    """The decoder tail's receptive field, measured on a narrow fp32 CPU copy of the same
    architecture: it depends on the layers, not the channel count, and fp32 on the CPU keeps the
    perturbation test exact (bf16 Winograd/FFT convolutions could smear it across a tile)."""
    small = _init_random(make(32, blocks), 1)
    z = torch.randn(1, 16, 64, 64)
    staged = stage(small)
    with torch.inference_mode():
        stem = tiling.run_stem(staged, z)
        return float(tiling.measure_halo(staged, stem, out_per_stem=8 // max(1, stem.shape[-1] // 64)))


def run_vae_cases(suite: Suite, sec: dict, deadline: float) -> None:
    tiling = suite.pieces.need("tiling", "StagedDecoder", "decode_spatial", "decode_whole", "measure_peak_bytes",
                               "TilePlan")
    if tiling is None:
        raise Skip(f"core/tiling unavailable ({suite.pieces.status.get('tiling')})")
    dev, smoke = suite.device, suite.smoke
    dt = DTYPE["value"]
    lat = 32 if smoke else 128                      # 1024x1024 output = 128x128 latent
    ch_base = 32 if smoke else 128                  # channels ch x (1, 2, 4, 4): the FLUX VAE at 128
    tiles, blocks = ((16,), 1) if smoke else ((48, 64), 3)  # 384 px and 512 px tiles
    bm = suite.pieces.need("benchmark", "VaeDecoderShaped")
    if bm is None:
        raise Skip(f"core/benchmark.py unavailable ({suite.pieces.status.get('benchmark')})")
    make, stage, what = _vae_builder(suite, bm)
    torch.manual_seed(0)
    dec = _init_random(make(ch_base, blocks), 0).to(device=dev, dtype=dt)
    z = torch.randn(1, 16, lat, lat, device=dev, dtype=dt)
    base = {"decoder": what,
            "shape_note": f"{what}; channels {ch_base} x (1, 2, 4, 4), {blocks} res blocks/level, latent "
                          f"{lat}x{lat} -> {lat * 8}x{lat * 8} px, {dt}; overlap covers the measured receptive "
                          f"field; the engine's default whole-image GroupNorm statistics"}
    with torch.inference_mode():
        dec(z)                                          # warm-up (cuDNN algorithm choice)
        free_device_memory(dev)     # from an emptied cache, as every tiled / layered timing below: same allocator cost
        t0 = time.perf_counter()
        ref, whole = tiling.measure_peak_bytes(lambda: dec(z), dev)
        sync(dev)
        base.update({"untiled_s": rnd(time.perf_counter() - t0, 4), "untiled_peak_bytes": whole.peak_bytes,
                     "peak_method": whole.method})
        ref = ref.float()
        staged = stage(dec)
        halo = _vae_halo(make, stage, tiling, blocks)
        overlap = max(1, math.ceil((2 * halo + 1) / 8))
    configs = []
    sec["image_configs"] = configs
    for tile in tiles:
        if not smoke and suite.left(deadline) < 5:
            configs.append({"tile_latent": tile, "status": "skipped", "reason": "section deadline"})
            continue
        tile = min(lat, max(tile, 2 * overlap))
        img = dict(base)
        with torch.inference_mode():
            plan = tiling.TilePlan("spatial", 1, (tile, tile), overlap, None, 0, 1, "suite: fixed tile size")
            info = tiling.DecodeStats()
            run = lambda: tiling.decode_spatial(staged, z, plan, out_scale=8, halo_px=halo, output_device=dev,
                                                info=info)
            run()                                       # warm-up (new shapes)
            free_device_memory(dev)
            t0 = time.perf_counter()
            out, tiled = tiling.measure_peak_bytes(run, dev)
            sync(dev)
            img["tiled_s"] = rnd(time.perf_counter() - t0, 4)
        img.update({"tiled_peak_bytes": tiled.peak_bytes, "halo_px": halo, "tiles": info.tiles,
                    "phase_s": {k: rnd(v, 4) for k, v in getattr(info, "phase_s", {}).items()},
                    "stats_fraction": rnd(info.stats_fraction, 3), "overlap_latent": overlap, "tile_latent": tile,
                    "tile_px": tile * 8, "peak_ratio": rnd(tiled.peak_bytes / max(1, whole.peak_bytes), 4),
                    "time_ratio": rnd(img["tiled_s"] / max(1e-9, img["untiled_s"]), 3),
                    "psnr_db": rnd(psnr_db(ref, out), 2),
                    "max_abs_diff": rnd(float((out.float() - ref).abs().max()), 5)})
        configs.append(img)
        sec.setdefault("image", img)                    # the summary uses the first (smallest-tile) config
        log(f"  image, {tile * 8}px tiles: untiled peak {gb(whole.peak_bytes)} GiB in {img['untiled_s']}s, tiled "
            f"{gb(tiled.peak_bytes)} GiB in {img['tiled_s']}s ({info.tiles} tiles, peak ratio {img['peak_ratio']}), "
            f"PSNR {img['psnr_db']} dB")
        del out
    free_device_memory(dev)
    # each new image case records its own failure: one raising must not cost the video and LTX cases below
    for key, case in (("image_auto_third", lambda: _vae_auto_third(suite, tiling, sec, staged, z, ref, halo, whole,
                                                                    base, deadline)),
                      ("image_layered", lambda: _vae_layered(suite, tiling, sec, staged, z, ref, whole, base, deadline)),
                      ("image_deeper_stem", lambda: _vae_deeper_stem(suite, tiling, sec, dec, z, ref, whole, base,
                                                                     deadline, make, blocks))):
        try:
            case()
        except Exception as exc:  # noqa: BLE001
            sec[key] = {"status": "oom" if is_oom(exc) else "failed", "reason": short_exc(exc),
                        "traceback": traceback.format_exc(limit=8)[-2500:]}
            log(f"  {key} {sec[key]['status']}: {short_exc(exc, 200)}")
        free_device_memory(dev)
    for name, case in (("video", _video_case), ("ltx_streamed", _ltx_streamed_case)):
        if not smoke and suite.left(deadline) < 8:
            sec[name] = {"status": "skipped", "reason": "section deadline"}
            continue
        try:
            sec[name] = case(suite, tiling)
        except Skip as exc:
            sec[name] = {"status": "skipped", "reason": str(exc)}
            suite.results["skipped"].append(f"vae/{name}: {exc}")
        except Exception as exc:  # noqa: BLE001 - the image numbers above stand on their own
            sec[name] = {"status": "oom" if is_oom(exc) else "failed", "reason": short_exc(exc),
                         "traceback": traceback.format_exc(limit=8)[-2500:]}
            log(f"  {name} case {sec[name]['status']}: {short_exc(exc, 200)}")
        free_device_memory(suite.device)


def _vae_auto_third(suite: Suite, tiling, sec, staged, z, ref, halo, whole, base, deadline) -> None:
    """The planner's own tiles for a budget of 1/3 of the untiled peak (the issue's memory goal), with the
    per-pixel tile cost taken from the first fixed-tile config: what auto does on a card that small."""
    first = next((c for c in sec["image_configs"] if "tiled_peak_bytes" in c), None)
    if first is None or not hasattr(tiling, "plan_decode") or (not suite.smoke and suite.left(deadline) < 5):
        sec["image_auto_third"] = {"status": "skipped", "reason": "no fixed-tile config or section deadline"}
        return
    dev = suite.device
    lat = z.shape[-1]
    frame_px = (lat * 8) ** 2
    with torch.inference_mode():
        stem = tiling.run_stem(staged, z)
    stored = stem.numel() * stem.element_size()
    del stem
    tile_px = (first["tile_latent"] * 8) ** 2
    cost = tiling.DecodeCost(whole_bytes_per_px=whole.peak_bytes / frame_px,
                             tile_bytes_per_px=max(1.0, (first["tiled_peak_bytes"] - stored) / tile_px),
                             stored_bytes_per_px=stored / frame_px, method="suite: from the first config")
    budget = whole.peak_bytes // 3
    plan = tiling.plan_decode(tuple(z.shape), 8, cost, budget, halo_px=halo)
    img = dict(base)
    with torch.inference_mode():
        info = tiling.DecodeStats()
        run = lambda: tiling.decode_spatial(staged, z, plan, out_scale=8, halo_px=halo, output_device=dev, info=info)
        run()
        free_device_memory(dev)
        t0 = time.perf_counter()
        out, tiled = tiling.measure_peak_bytes(run, dev)
        sync(dev)
        img["tiled_s"] = rnd(time.perf_counter() - t0, 4)
    img.update({"budget_bytes": budget, "psnr_db": rnd(psnr_db(ref, out), 2),
                "phase_s": {k: rnd(v, 4) for k, v in getattr(info, "phase_s", {}).items()}, "plan": plan.describe(8), "tile_latent": list(plan.tile),
                "work_ratio": rnd(getattr(plan, "work_ratio", 0.0), 3), "tiles": info.tiles,
                "tiled_peak_bytes": tiled.peak_bytes, "predicted_peak_bytes": plan.predicted_peak_bytes,
                "peak_ratio": rnd(tiled.peak_bytes / max(1, whole.peak_bytes), 4),
                "time_ratio": rnd(img["tiled_s"] / max(1e-9, img["untiled_s"]), 3)})
    sec["image_auto_third"] = img
    log(f"  image, auto at 1/3 of the untiled peak: {info.tiles} tiles {plan.tile}, work {img['work_ratio']}x, "
        f"peak ratio {img['peak_ratio']}, time ratio {img['time_ratio']}")
    del out
    free_device_memory(dev)


def _vae_layered(suite: Suite, tiling, sec, staged, z, ref, whole, base, deadline) -> None:
    """The layered decode (tail modules one at a time in 8 row bands, exact GroupNorm statistics): what auto runs
    when the image does not fit whole but the layered peak does. Peak, time and PSNR against the untiled decode."""
    if not hasattr(tiling, "decode_layered") or (not suite.smoke and suite.left(deadline) < 5):
        sec["image_layered"] = {"status": "skipped", "reason": "no layered decode in this build or section deadline"}
        return
    dev = suite.device
    img = dict(base)
    with torch.inference_mode():
        info = tiling.LayeredStats()
        run = lambda: tiling.decode_layered(staged.run, staged.tail, z, bands=8, output_device=dev, info=info)
        run()                                       # warm-up (new shapes, halo probes)
        info = tiling.LayeredStats()                # the measured run's own counts (``run`` reads ``info`` late)
        free_device_memory(dev)
        t0 = time.perf_counter()
        out, peak = tiling.measure_peak_bytes(run, dev)
        sync(dev)
        img["layered_s"] = rnd(time.perf_counter() - t0, 4)
    img.update({"bands": info.bands, "units": info.units, "passes_per_decode": info.passes,
                "halo_rows": dict(info.halo_rows), "layered_peak_bytes": peak.peak_bytes,
                "peak_ratio": rnd(peak.peak_bytes / max(1, whole.peak_bytes), 4),
                "time_ratio": rnd(img["layered_s"] / max(1e-9, img["untiled_s"]), 3),
                "psnr_db": rnd(psnr_db(ref, out), 2), "max_abs_diff": rnd(float((out.float() - ref).abs().max()), 5)})
    sec["image_layered"] = img
    log(f"  image, layered: peak ratio {img['peak_ratio']}, time ratio {img['time_ratio']}, PSNR {img['psnr_db']} dB")
    del out
    free_device_memory(dev)


def _vae_deeper_stem(suite: Suite, tiling, sec, dec, z, ref, whole, base, deadline, make, blocks) -> None:
    """Tiles with the deeper split the node takes when the budget allows it: the stages up to 1/2 of the output
    scale whole, only the last stage tiled (2 x 2 tiles). Peak, time by phase and PSNR against the untiled decode."""
    try:
        from comfyui_levers.bridge import vae as bridge_vae
        if not hasattr(bridge_vae, "deeper_stems") or not hasattr(dec, "num_resolutions"):
            raise Skip("needs ComfyUI's Decoder and a Levers build with deeper stems")
        if not suite.smoke and suite.left(deadline) < 5:
            raise Skip("section deadline")
    except Skip as exc:
        sec["image_deeper_stem"] = {"status": "skipped", "reason": str(exc)}
        return
    dev = suite.device
    def stage(d):
        return bridge_vae._kl(types.SimpleNamespace(decode=d.forward), d, level=1)
    staged = stage(dec)
    lat = z.shape[-1]
    img = dict(base)
    halo = _vae_halo(make, stage, tiling, blocks)          # on an fp32 CPU copy, like the 1/4 split's
    with torch.inference_mode():
        stem, stem_m = tiling.measure_peak_bytes(lambda: tiling.run_stem(staged, z), dev)
        del stem
        overlap = max(1, math.ceil((2 * halo + 1) / 8))
        tile = min(lat, (lat + overlap + 1) // 2)
        plan = tiling.TilePlan("spatial", 1, (tile, tile), overlap, None, 0, 1, "suite: deeper stem, 2 x 2 tiles")
        info = tiling.DecodeStats()
        run = lambda: tiling.decode_spatial(staged, z, plan, out_scale=8, halo_px=halo, output_device=dev, info=info)
        run()
        info = tiling.DecodeStats()
        free_device_memory(dev)
        t0 = time.perf_counter()
        out, peak = tiling.measure_peak_bytes(run, dev)
        sync(dev)
        img["tiled_s"] = rnd(time.perf_counter() - t0, 4)
    img.update({"stem_peak_bytes": stem_m.peak_bytes, "halo_px": halo, "tiles": info.tiles, "tile_latent": tile,
                "tiled_groupnorms": len(staged.tail_norms), "tiled_peak_bytes": peak.peak_bytes,
                "phase_s": {k: rnd(v, 4) for k, v in info.phase_s.items()},
                "peak_ratio": rnd(peak.peak_bytes / max(1, whole.peak_bytes), 4),
                "stem_peak_ratio": rnd(stem_m.peak_bytes / max(1, whole.peak_bytes), 4),
                "time_ratio": rnd(img["tiled_s"] / max(1e-9, img["untiled_s"]), 3), "psnr_db": rnd(psnr_db(ref, out), 2)})
    sec["image_deeper_stem"] = img
    log(f"  image, deeper stem (1/2 scale whole): stem peak ratio {img['stem_peak_ratio']}, peak ratio "
        f"{img['peak_ratio']}, time ratio {img['time_ratio']}, PSNR {img['psnr_db']} dB")
    del out
    free_device_memory(dev)


def _whole_video_decode(vae, z, tiling, dev, rec: dict, warm_frames: int):
    """The model's own decode of ``z`` after a warm-up on its first frames: (output on the CPU in float32, its
    peak); the time and peak go into ``rec`` as ``untiled_s`` / ``untiled_peak_bytes``. The time includes the
    frames' copy to the CPU, as ComfyUI's VAE decode hands them over (and as the chunked decodes are timed)."""
    vae.decode(z[:, :, :warm_frames])
    free_device_memory(dev)
    t0 = time.perf_counter()
    ref, whole = tiling.measure_peak_bytes(lambda: vae.decode(z), dev)
    ref = ref.to("cpu")
    sync(dev)
    rec.update({"untiled_s": rnd(time.perf_counter() - t0, 4), "untiled_peak_bytes": whole.peak_bytes})
    ref = ref.float()
    free_device_memory(dev)
    return ref, whole


def _video_case(suite: Suite, tiling) -> dict[str, Any]:
    """ComfyUI's own Wan 2.1 VAE (random weights): its decode (frame by frame, every frame kept on
    the GPU) vs Levers' temporal chunks with the causal cache carried (frames leave per chunk)."""
    if suite.comfy is None or not suite.comfy.ok:
        raise Skip("needs ComfyUI's WanVAE class (--comfyui)")
    from comfy.ldm.wan.vae import WanVAE
    from comfyui_levers.bridge import vae as bridge_vae
    stage_wan = getattr(bridge_vae, "_wan", None) or getattr(bridge_vae, "_wan21", None)
    if stage_wan is None:
        raise Skip("bridge/vae.py has no Wan staging (_wan)")
    dev, dt, smoke = suite.device, DTYPE["value"], suite.smoke
    dim, t, h, w = (16, 2, 8, 8) if smoke else (96, 5, 60, 104)       # 480x832, 17 frames
    vae = _init_random(WanVAE(dim=dim, z_dim=16), 0).to(device=dev, dtype=dt)
    z = torch.randn(1, 16, t, h, w, device=dev, dtype=dt)
    staged = stage_wan(vae, vae.decoder)
    res: dict[str, Any] = {"shape_note": f"ComfyUI WanVAE(dim={dim}, z_dim=16), latent {t}x{h}x{w} -> "
                                         f"{(t - 1) * 4 + 1} frames of {h * 8}x{w * 8} px, {dt}"}
    with torch.inference_mode():
        ref, whole = _whole_video_decode(vae, z, tiling, dev, res, warm_frames=1)
        t0 = time.perf_counter()
        out, chunks = tiling.measure_peak_bytes(lambda: tiling.decode_temporal(staged, z, 1, output_device="cpu"), dev)
        res.update({"chunked_s": rnd(time.perf_counter() - t0, 4), "chunked_peak_bytes": chunks.peak_bytes,
                    "chunk_latent_frames": 1, "peak_ratio": rnd(chunks.peak_bytes / max(1, whole.peak_bytes), 4),
                    "bit_exact": bool(torch.equal(out, ref)), "psnr_db": rnd(psnr_db(ref, out), 2)})
    log(f"  video: WanVAE decode peak {gb(whole.peak_bytes)} GiB in {res['untiled_s']}s, temporal chunks "
        f"{gb(chunks.peak_bytes)} GiB in {res['chunked_s']}s, bit-exact {res['bit_exact']}")
    return res


def _ltx_streamed_case(suite: Suite, tiling, latent_thw: tuple[int, int, int] | None = None) -> dict[str, Any]:
    """ComfyUI 0.8.0's LTX-Video VAE (the 0.9.5 decoder layout, random weights, bf16): its decode (all frames at
    once) vs Levers' streamed temporal chunks (each time unit keeps its context frames), peak, time and PSNR.
    ``latent_thw`` overrides the latent's frames, height and width (``bench/ltx_stream_cpu.py``)."""
    if suite.comfy is None or not suite.comfy.ok:
        raise Skip("needs ComfyUI's LTX VideoVAE class (--comfyui)")
    import functools
    from comfy.ldm.lightricks.vae.causal_video_autoencoder import VideoVAE
    from comfyui_levers.bridge import vae as bridge_vae
    if not hasattr(bridge_vae, "measure_stream"):
        raise Skip("bridge/vae.py has no streamed LTX chunks (measure_stream)")
    dev, dt, smoke = suite.device, DTYPE["value"], suite.smoke
    layers = 1 if smoke else 5
    res = lambda: ["res_x", {"num_layers": layers, "inject_noise": False}]
    up = ["compress_all", {"residual": True, "multiplier": 2}]
    cfg = {"dims": 3, "in_channels": 3, "out_channels": 3, "latent_channels": 128,
           "decoder_blocks": [res(), up, res(), up, res(), up, res()],
           "encoder_blocks": [["res_x", {"num_layers": 1}]], "scaling_factor": 1.0, "norm_layer": "pixel_norm",
           "patch_size": 4, "latent_log_var": "uniform", "use_quant_conv": False, "causal_decoder": False,
           "timestep_conditioning": True}
    if "output_buffer" in inspect.signature(VideoVAE.decode).parameters:
        raise Skip("this ComfyUI's LTX decoder walks the frames in its own chunks (0.33+)")
    vae = VideoVAE(config=cfg)
    with torch.no_grad():
        for name, buf in vae.named_buffers():        # the latent statistics: identity un-normalisation
            buf.fill_(1.0 if name.endswith("std-of-means") else 0.0)
    vae = _init_random(vae, 0).to(device=dev, dtype=dt).eval()
    vae.decode = functools.partial(VideoVAE.decode, vae, noise_scale=0.0)     # comparable decodes
    t, h, w = latent_thw or ((3, 2, 3) if smoke else (13, 16, 24))           # 97 frames of 512x768
    z = torch.randn(1, 128, t, h, w, device=dev, dtype=dt)
    staged, why = bridge_vae._ltx(vae, vae.decoder)
    out: dict[str, Any] = {"shape_note": f"ComfyUI 0.8.0 VideoVAE (LTX-Video 0.9.5 decoder layout, {layers} layers per "
                                         f"stage, widths 1024..128), latent {t}x{h}x{w} -> {(t - 1) * 8 + 1} frames "
                                         f"of {h * 32}x{w * 32} px, {dt}", "staging": why}
    with torch.inference_mode():
        ref, whole = _whole_video_decode(vae, z, tiling, dev, out, warm_frames=2)
        units, base, per_frame, problem = bridge_vae.measure_stream(vae_wrapper(vae), staged, z)
        if problem:
            raise RuntimeError(f"streaming refused: {problem}")
        frame_px = h * w * 32 * 32
        out["units"] = len(units)
        out["chunks"] = []
        for chunk in ((1, 2) if smoke else (1, 2, 4)):
            free_device_memory(dev)
            stats = tiling.StreamStats()
            t0 = time.perf_counter()
            got, m = tiling.measure_peak_bytes(lambda: tiling.decode_time_streamed(
                staged.run, staged.time_decoder, units, z, chunk, output_device="cpu", stats=stats), dev)
            sync(dev)
            s_ = time.perf_counter() - t0
            out["chunks"].append({"chunk_latent_frames": chunk, "s": rnd(s_, 4), "peak_bytes": m.peak_bytes,
                                  "predicted_peak_bytes": int((base + per_frame * chunk) * frame_px),
                                  "peak_ratio": rnd(m.peak_bytes / max(1, whole.peak_bytes), 4),
                                  "time_ratio": rnd(s_ / max(1e-9, out["untiled_s"]), 3),
                                  "work_ratio": rnd(stats.work, 3), "psnr_db": rnd(psnr_db(ref, got), 2)})
            log(f"  ltx streamed, chunk {chunk}: peak {gb(m.peak_bytes)} GiB (whole {gb(whole.peak_bytes)}) in "
                f"{rnd(s_, 3)}s (whole {out['untiled_s']}s), PSNR {out['chunks'][-1]['psnr_db']} dB")
    return out


def vae_wrapper(fsm) -> Any:
    """The fields of ComfyUI's ``comfy.sd.VAE`` that ``bridge.vae.measure_stream`` reads, around a bare model."""
    p = next(fsm.parameters())
    return types.SimpleNamespace(first_stage_model=fsm, device=p.device, vae_dtype=p.dtype, upscale_ratio=(
        lambda a: max(0, a * 8 - 7), 32, 32))


# --------------------------------------------------------------------------------------------
# summary, tables, plot
# --------------------------------------------------------------------------------------------

def _metric(value, reason=None, goal=None, met=None, **extra) -> dict[str, Any]:
    d = {"value": value, "reason": None if value is not None else (reason or "not measured")}
    if goal is not None:
        d["goal"] = goal
        d["goal_met"] = met if value is not None else None
    d.update(extra)
    return d


def _cases(results: dict) -> list[dict]:
    out = []
    for rec in results.get("sections", {}).get("dit", {}).get("models", {}).values():
        out.extend(rec.get("cases", []))
    return out


def _section_reason(results: dict, name: str) -> str:
    sec = results.get("sections", {}).get(name)
    if sec is None:
        return f"section '{name}' was not run"
    if sec.get("status") in ("skipped", "failed"):
        return f"section '{name}' {sec['status']}: {sec.get('reason')}"
    return ""


def build_summary(results: dict) -> dict[str, Any]:
    """The headline ratios (each with the reason when it could not be computed)."""
    cases = _cases(results)
    ok = [c for c in cases if c.get("status") == "ok" and c.get("s_per_step")]
    floor = {c["model"]: c for c in ok if c["engine"] == "resident" and c.get("budget") is None}
    bw = pinned_gbps(results)
    dit_reason = _section_reason(results, "dit") or "no successful case"
    summary: dict[str, Any] = {}

    # prefetch vs floor: s/step / max(compute, streamed bytes / pinned bandwidth). The bandwidth is
    # the suite's own pinned measurement, else the one GroupPrefetch measured through its transport.
    by_case, worst, sources = {}, None, set()
    for c in ok:
        if c["engine"] != "levers_prefetch" or c["model"] not in floor:
            continue
        compute = floor[c["model"]]["s_per_step"]
        streamed = c.get("h2d_bytes_per_step")
        case_bw, src = bw, "bandwidth section (pinned H2D)"
        engine_bw = (c.get("levers_stats") or {}).get("bandwidth_bytes_per_s")
        if case_bw is None and engine_bw:
            case_bw, src = engine_bw / 1e9, "GroupPrefetch's own transport measurement"
        transfer = streamed / (case_bw * 1e9) if (streamed is not None and case_bw) else None
        if streamed and transfer is None:
            src = "no bandwidth measured: compute only"
        fl = max(compute, transfer or 0.0)
        ratio = c["s_per_step"] / fl
        c.update({"floor_s": rnd(fl, 4), "vs_floor": rnd(ratio, 3), "floor_bandwidth_gbps": rnd(case_bw, 2),
                  "floor_bandwidth_source": src})
        sources.add(src)
        by_case[f"{c['model']}@{c['budget']}"] = rnd(ratio, 3)
        worst = ratio if worst is None else max(worst, ratio)
    summary["prefetch_vs_floor"] = _metric(rnd(worst, 3), dit_reason if not by_case else None, "<= 1.10",
                                           None if worst is None else worst <= 1.10, by_case=by_case,
                                           definition="worst case of s/step / max(resident s/step, streamed bytes "
                                                      "per step / pinned H2D bandwidth)",
                                           bandwidth_gbps=bw, bandwidth_source=sorted(sources))

    # prefetch vs ComfyUI at the same budget
    comfy = {(c["model"], c["budget"]): c for c in ok if c["engine"] == "comfyui_lowvram"}
    by_case, worst, best, resident_ties = {}, None, None, {}
    for c in ok:
        if c["engine"] != "levers_prefetch" or (c["model"], c["budget"]) not in comfy:
            continue
        base = comfy[(c["model"], c["budget"])]
        ratio = c["s_per_step"] / base["s_per_step"]
        c["vs_comfy"] = rnd(ratio, 3)
        if not (base.get("h2d_bytes_per_step") or 0) and not (c.get("h2d_bytes_per_step") or 0):
            resident_ties[f"{c['model']}@{c['budget']}"] = rnd(ratio, 3)   # both fully resident: no offload to compare
            continue
        by_case[f"{c['model']}@{c['budget']}"] = rnd(ratio, 3)
        worst = ratio if worst is None else max(worst, ratio)
        best = ratio if best is None else min(best, ratio)
    comfy_reason = None
    if not by_case:
        cinfo = results.get("comfyui") or {}
        comfy_reason = (f"ComfyUI baseline unavailable: {cinfo.get('reason')}" if cinfo and not cinfo.get("ok")
                        else dit_reason)
    summary["prefetch_vs_comfy"] = _metric(rnd(worst, 3), comfy_reason, "<= 0.77 (>= 1.3x faster)",
                                           None if worst is None else worst <= 1 / 1.3, by_case=by_case,
                                           best=rnd(best, 3), both_resident=resident_ties,
                                           definition="worst case of Levers s/step / ComfyUI s/step at the same budget, "
                                                      "over budgets where weights stream (both-resident ties listed apart)")
    def vs_comfy(engine: str, keep=lambda c: True) -> tuple[dict[str, float], list[dict]]:
        """Per (model, budget) where weights stream: this engine's s/step / ComfyUI's (set as ``vs_comfy``)."""
        by_case, used = {}, []
        for c in ok:
            if c["engine"] == engine and keep(c) and (c["model"], c["budget"]) in comfy:
                base = comfy[(c["model"], c["budget"])]
                if (base.get("h2d_bytes_per_step") or 0) or (c.get("h2d_bytes_per_step") or 0):
                    c["vs_comfy"] = rnd(c["s_per_step"] / base["s_per_step"], 3)
                    by_case[f"{c['model']}@{c['budget']}"] = c["vs_comfy"]
                    used.append(c)
        return by_case, used

    # the same, GroupPrefetch streaming QuantizeDiT's fp8 bytes, against ComfyUI streaming the bf16 model
    fp8_by_case, _ = vs_comfy("levers_prefetch_fp8")
    fp8_worst = max(fp8_by_case.values(), default=None)
    summary["prefetch_fp8_vs_comfy"] = _metric(
        fp8_worst, comfy_reason or "no fp8 streamed case with a ComfyUI case at the same budget",
        "<= 0.77 (>= 1.3x faster)", None if fp8_worst is None else fp8_worst <= 1 / 1.3, by_case=fp8_by_case,
        definition="worst case of GroupPrefetch streaming the fp8 model (QuantizeDiT, half the bytes) / ComfyUI "
                   "lowvram streaming the bf16 model, s/step at the same budget; output differs by fp8 rounding "
                   "(bit_exact_vs_resident_fp8 checks the streaming itself)")
    # the same, GroupPrefetch streaming the bf16 model losslessly packed (~0.76x the bytes), output bit-identical
    packed_by_case, used = vs_comfy("levers_prefetch_packed", lambda c: c.get("packed_active"))
    packed_exact = [bool(c.get("bit_exact")) for c in used]
    packed_worst = max(packed_by_case.values(), default=None)
    summary["prefetch_packed_vs_comfy"] = _metric(
        packed_worst, comfy_reason or "no case streamed packed bytes with a ComfyUI case at the same budget (each "
                                      "levers_prefetch_packed case's levers_report says why)",
        "<= 0.77 (>= 1.3x faster), bit-exact", None if packed_worst is None else
        (packed_worst <= 1 / 1.3 and all(packed_exact)), by_case=packed_by_case, all_bit_exact=all(packed_exact),
        definition="worst case of GroupPrefetch streaming the bf16 model losslessly packed (12 bits per weight on "
                   "the bus, unpacked on the GPU) / ComfyUI lowvram, s/step at the same budget, over budgets where "
                   "weights stream; each case must be bit-exact against the resident run")
    cp = (results.get("sections", {}).get("comfy_phase", {}) or {}).get("results") or {}

    def phase_flow_metric(rec: dict, definition: str) -> dict:
        """PhaseOffload's seconds per generation over ComfyUI's default flow's, in ComfyUI."""
        r = rec.get("ratio_total_time")
        return _metric(rnd(r, 3) if r is not None else None,
                       _section_reason(results, "comfy_phase") or rec.get("reason") or "not measured", "<= 1.0",
                       None if r is None else r <= 1.0, bit_identical=rec.get("bit_identical"), definition=definition)
    summary["phase_in_comfy_time_vs_default"] = phase_flow_metric(
        cp, "seconds per generation (encode + sample + decode) through PhaseOffload / ComfyUI's default flow, same "
            "graph, same emulated budget, inside ComfyUI")
    summary["phase_two_experts_in_comfy_vs_default"] = phase_flow_metric(
        cp.get("experts") or {}, "seconds per generation (encode + two experts, half the steps each, as Wan 2.2 A14B "
                                 "+ decode) through PhaseOffload with model_2 / ComfyUI's default flow, same graph, "
                                 "same emulated budget (one expert fits, not two), inside ComfyUI")
    gp = cp.get("group_prefetch") or {}
    gp_ratio = gp.get("ratio_time")
    summary["prefetch_in_comfy_vs_lowvram"] = _metric(
        rnd(gp_ratio, 3) if gp_ratio is not None else None,
        _section_reason(results, "comfy_phase") or gp.get("reason") or "not measured", "<= 0.77 (>= 1.3x faster)",
        None if gp_ratio is None else gp_ratio <= 1 / 1.3,
        bit_identical=gp.get("bit_identical"), bit_identical_longer_video=gp.get("bit_identical_b"),
        longer_video_unloaded_stale=gp.get("levers_b_unloaded_stale"), card_gib=gp.get("card_gib"),
        definition="seconds per sampling run (DiT only) through the GroupPrefetch node (auto budget) / ComfyUI's "
                   "lowvram, same emulated card (a quarter of the DiT + 2.5 GiB), inside ComfyUI; then the same clone "
                   "at a longer video, bit-compared with ComfyUI there")
    comfy_reason = _section_reason(results, "comfy_phase")

    def in_comfy_case(rec: dict, definition: str, **extra) -> dict:
        """A GroupPrefetch-in-ComfyUI case nested under the plain one: its time ratio against ComfyUI's own path."""
        r = rec.get("ratio_time")
        return _metric(rnd(r, 3) if r is not None else None,
                       comfy_reason or rec.get("reason") or gp.get("reason") or "not measured",
                       "<= 0.77 (>= 1.3x faster)", None if r is None else r <= 1 / 1.3,
                       bit_identical=rec.get("bit_identical"),
                       kept_unstreamed=(rec.get("levers_stats") or {}).get("kept_unstreamed"),
                       definition=definition, **extra)
    gp8 = gp.get("fp8") or {}
    summary["prefetch_fp8_in_comfy_vs_lowvram"] = in_comfy_case(
        gp8, "as prefetch_in_comfy_vs_lowvram, after QuantizeDiT fp8 (ComfyUI's QuantizedTensor layer where "
             "comfy-kitchen is installed): the fp8 codes stream; kept_unstreamed must be 0; bit_identical is against "
             "the fp8 model fully loaded (ComfyUI's own offloaded fp8 layers dequantize, so its lowvram run differs)",
        layers=gp8.get("layers"), bit_identical_vs_comfy=gp8.get("bit_identical_vs_comfy"),
        comfy_bit_identical_vs_resident=gp8.get("comfy_bit_identical_vs_resident"))
    gpg = gp.get("gguf") or {}
    summary["prefetch_gguf_in_comfy_vs_lowvram"] = in_comfy_case(
        gpg, "the same DiT as a Q8_0 GGUF model loaded as ComfyUI-GGUF loads one (GGMLTensor weights, GGMLOps, "
             "GGUFModelPatcher; needs $COMFYUI_GGUF_PATH): seconds per sampling run through GroupPrefetch "
             "(auto budget, the packed Q8 bytes stream) / ComfyUI with ComfyUI-GGUF's per-layer casts, on a card "
             "of a quarter of the Q8 weights + 2.5 GiB; kept_unstreamed must be 0",
        card_gib=gpg.get("card_gib"),
        comfy_loaded_gib=None if gpg.get("comfy_loaded_bytes") is None else gb(gpg["comfy_loaded_bytes"]))
    dyn = results.get("sections", {}).get("dynamic", {})
    dyn_rows = [c for c in dyn.get("cases", []) if c.get("levers_vs_dynamic")]
    dyn_worst = max((c["levers_vs_dynamic"] for c in dyn_rows), default=None)
    dyn_reason = _section_reason(results, "dynamic") or "; ".join(
        f"{c.get('model')}@{c.get('budget')}: {c.get('status')} {str(c.get('reason'))[:200]}"
        for c in dyn.get("cases", []) if c.get("status") != "ok") or "no case with both engines"
    summary["prefetch_vs_comfy_dynamic"] = _metric(
        dyn_worst, dyn_reason, "<= 1.0 (else GroupPrefetch stands aside under DynamicVRAM)",
        None if dyn_worst is None else dyn_worst <= 1.0,
        by_case={f"{c['model']}@{c['budget']}": c["levers_vs_dynamic"] for c in dyn_rows},
        definition="worst case of Levers GroupPrefetch s/step / ComfyUI DynamicVRAM s/step at the same budget")

    # video DiT vs resident
    wan_floor = floor.get("wan")
    by_case = {f"wan@{c['budget']}": rnd(c["s_per_step"] / wan_floor["s_per_step"], 3)
               for c in ok if wan_floor and c["model"] == "wan" and c["engine"] == "levers_prefetch"}
    worst = max(by_case.values()) if by_case else None
    summary["video_prefetch_vs_resident"] = _metric(worst, dit_reason, "<= 1.05", None if worst is None else worst <= 1.05,
                                                    by_case=by_case)

    # PhaseOffload
    ph = results.get("sections", {}).get("phase", {}).get("results", {})
    on = ph.get("onload_gbps_median")
    summary["phase_onload_vs_pinned_bw"] = _metric(
        rnd(on / bw, 3) if (on and bw) else None,
        _section_reason(results, "phase") or ("no pinned bandwidth measured" if not bw else "no onload measured"),
        ">= 0.85", None if not (on and bw) else on / bw >= 0.85, onload_gbps=on, pinned_gbps=bw)
    d2h = ph.get("offload_d2h_bytes_total")
    summary["phase_offload_d2h_bytes"] = _metric(d2h, _section_reason(results, "phase") or "not measured", "== 0",
                                                 None if d2h is None else d2h == 0)

    # fp8: the FLUX step first, else the linears
    fp8_step = [c for c in ok if c["engine"].startswith("resident_fp8") and c.get("speedup_vs_bf16")]
    q = results.get("sections", {}).get("quant", {})
    lin = (q.get("speedup_vs_bf16") or {}).get("fp8_e4m3fn")
    if fp8_step:
        by_mode: dict[str, dict[str, float]] = {}
        for c in fp8_step:
            by_mode.setdefault(c.get("fp8_compute_mode", "off"), {})[c["model"]] = c["speedup_vs_bf16"]
        # the mode that is fastest on the FLUX step (else any model) is the one to ship as default
        best = max(by_mode, key=lambda m: by_mode[m].get("flux", max(by_mode[m].values())))
        by_model = by_mode[best]
        val = by_model.get("flux", next(iter(by_model.values())))
        fell_back = {k: v for c in fp8_step for k, v in (c.get("fp8_mode_failures") or {}).items()}
        summary["fp8_speedup_vs_bf16"] = _metric(val, None, ">= 1.2", val >= 1.2, by_model_step=by_model,
                                                 best_mode=best, by_mode=by_mode, linears=lin,
                                                 modes_linears=q.get("fp8_modes_speedup_vs_bf16"),
                                                 mode_failures=fell_back or None,
                                                 source="whole-DiT step, resident, fastest fp8 compute mode")
    else:
        summary["fp8_speedup_vs_bf16"] = _metric(lin, _section_reason(results, "quant") or "fp8 did not run",
                                                 ">= 1.2", None if lin is None else lin >= 1.2,
                                                 source="FLUX-shaped linears (no whole-step fp8 measurement)")

    # tiled VAE
    vae = results.get("sections", {}).get("vae", {})
    ratio = (vae.get("image") or {}).get("peak_ratio")
    summary["tiled_vae_peak_vs_untiled"] = _metric(ratio, _section_reason(results, "vae") or "not measured",
                                                   "<= 0.333", None if ratio is None else ratio <= 1 / 3)
    auto = vae.get("image_auto_third") or {}
    t_ratio = auto.get("time_ratio")
    summary["tiled_vae_time_vs_untiled"] = _metric(
        t_ratio, auto.get("reason") or _section_reason(results, "vae") or "not measured", "<= 1.3",
        None if t_ratio is None else t_ratio <= 1.3, peak_ratio=auto.get("peak_ratio"),
        work_ratio=auto.get("work_ratio"), source="the planner's tiles for a budget of 1/3 of the untiled peak")
    ltx = [c for c in (vae.get("ltx_streamed") or {}).get("chunks", []) if c.get("peak_ratio") is not None]
    best = min(ltx, key=lambda c: c["peak_ratio"]) if ltx else {}      # the memory it saves, at its time cost
    summary["ltx_streamed_vs_whole"] = _metric(
        best.get("peak_ratio"), (vae.get("ltx_streamed") or {}).get("reason") or _section_reason(results, "vae")
        or "not measured", time_ratio=best.get("time_ratio"), psnr_db=best.get("psnr_db"),
        chunk_latent_frames=best.get("chunk_latent_frames"),
        source="LTX-Video VAE on ComfyUI 0.8.0: streamed temporal chunks vs its whole decode (peak ratio)")
    lay = vae.get("image_layered") or {}
    summary["layered_vae_vs_untiled"] = _metric(
        lay.get("time_ratio"), lay.get("reason") or _section_reason(results, "vae") or "not measured", "<= 1.3",
        None if lay.get("time_ratio") is None else lay["time_ratio"] <= 1.3, peak_ratio=lay.get("peak_ratio"),
        psnr_db=lay.get("psnr_db"), source="layered decode (exact statistics, 8 row bands), time vs untiled")

    # Recommend
    rec = results.get("sections", {}).get("recommend", {})
    err = rec.get("peak_error_abs_max")
    summary["recommend_peak_error"] = _metric(err, _section_reason(results, "recommend") or "not measured",
                                              "<= 0.10", None if err is None else err <= 0.10)

    # budget respected: every budgeted Levers (and resident) case stayed under its emulated budget;
    # ComfyUI's own overruns are reported beside it (they are a finding about the baseline)
    def measured(c):
        return c.get("budget_bytes") and (c.get("status") == "oom" or
                                          (c.get("status") == "ok" and c.get("within_budget") is not None))

    def over(cs):
        return [f"{c['model']}/{c['engine']}@{c['budget']}: "
                + ("OOM at the cap" if c["status"] == "oom" else f"peak {gb(c.get('peak_allocated_bytes'))} GiB")
                for c in cs if c["status"] == "oom" or c.get("within_budget") is False]

    ours = [c for c in cases if measured(c) and c["engine"] != "comfyui_lowvram"]
    comfy_cases = [c for c in cases if c["engine"] == "comfyui_lowvram" and
                   (measured(c) or (c.get("first_attempt") or {}).get("status") == "oom")]
    comfy_over = over([c for c in comfy_cases if measured(c)])
    comfy_over += [f"{c['model']}/comfyui_lowvram@{c['budget']}: OOM with its own estimate (first attempt)"
                   for c in comfy_cases if (c.get("first_attempt") or {}).get("status") == "oom"]
    if not ours and any(c.get("budget_bytes") and c.get("status") == "ok" for c in cases):
        dit_reason = "budgets are not enforced without CUDA (no allocator cap, no peak counter)"
    ours_over = over(ours)
    summary["budget_respected"] = _metric(
        (not ours_over) if ours else None, dit_reason, "true", (not ours_over) if ours else None,
        violations=ours_over, cases=len(ours), comfyui_violations=comfy_over,
        definition="every budgeted Levers / resident case ran with max_memory_allocated <= budget (an OOM at "
                   "the cap counts as a violation); comfyui_violations lists the baseline's own overruns")
    return summary


def _fmt(v, nd=3):
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)


def render_markdown(results: dict) -> str:
    m, g = results.get("machine", {}), results.get("git", {})
    lines = [f"# Levers GPU suite — {m.get('gpu') or 'no GPU'}", "",
             f"- commit `{(g.get('commit') or 'unknown')[:12]}`{' (dirty)' if g.get('dirty') else ''}; "
             f"{results.get('started')}; wall {results.get('wall_s')} s{'; SMOKE (tiny shapes)' if results.get('smoke') else ''}",
             f"- torch {m.get('torch')} (CUDA {m.get('torch_cuda')}), driver {m.get('driver', '–')}, "
             f"python {m.get('python')}, {m.get('cpu_count')} CPUs, {m.get('ram_total_gib')} GiB RAM",
             "- ComfyUI baseline: " + (f"{(results.get('comfyui') or {}).get('version')} "
                                        f"({(results.get('comfyui') or {}).get('path')})"
                                        if (results.get("comfyui") or {}).get("ok")
                                        else f"unavailable — {(results.get('comfyui') or {}).get('reason')}"), ""]
    lines += ["## Summary", "", "| metric | value | goal | met | note |", "|---|---|---|---|---|"]
    for k, v in (results.get("summary") or {}).items():
        note = v.get("reason") or ""
        if not note and v.get("best") is not None:
            note = f"best {_fmt(v['best'])}; " + ", ".join(f"{c} {_fmt(r)}" for c, r in (v.get("by_case") or {}).items())
        if not note and v.get("best_mode"):
            note = f"mode {v['best_mode']}; " + ", ".join(f"{m} {_fmt(r)}" for m, r in (v.get("by_model_step") or {}).items())
        lines.append(f"| {k} | {_fmt(v.get('value'))} | {v.get('goal', '')} | {_fmt(v.get('goal_met'))} | "
                     f"{note[:160]} |")
    br = (results.get("summary") or {}).get("budget_respected") or {}
    if br.get("comfyui_violations"):
        lines += ["", "ComfyUI's own overruns at the emulated budgets: " + "; ".join(br["comfyui_violations"])]
    bw = results.get("sections", {}).get("bandwidth", {}).get("results", {})
    if bw:
        lines += ["", "## Host→device bandwidth (GB/s, best)", "", "| path | GB/s |", "|---|---|"]
        for k in ("h2d_pageable", "h2d_pinned_in_place", "h2d_pinned_copy", "d2h_pinned", "transport_h2d_one_tensor",
                  "transport_h2d_16_pieces", "pin_in_place"):
            if k in bw:
                v = bw[k]
                lines.append(f"| {k} | {_fmt(v.get('gbps_best', v.get('gbps')), 2) if isinstance(v, dict) and not v.get('skipped') else v.get('skipped') if isinstance(v, dict) else v} |")
    cases = _cases(results)
    if cases:
        lines += ["", "## DiT step time under emulated VRAM budgets", "",
                  "One DiT forward (a CFG sampler step is two). ×floor = s/step ÷ max(resident s/step, streamed bytes ÷ "
                  "pinned bandwidth); ×comfy = Levers ÷ ComfyUI at the same budget.", "",
                  "| model | budget | engine | status | s/step | ×floor | ×comfy | peak GiB | ≤ budget | H2D GiB/step | bit-exact | max abs diff |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        retried = False
        for c in cases:
            status = c.get("status")
            if c.get("reserve_vram_added_bytes"):
                status, retried = f"{status}*", True
            lines.append(
                f"| {c.get('model')} | {c.get('budget') or 'unbudgeted'} | {c.get('engine')} | {status} | "
                f"{_fmt(c.get('s_per_step'), 4)} | {_fmt(c.get('vs_floor'))} | {_fmt(c.get('vs_comfy'))} | "
                f"{_fmt(gb(c.get('peak_allocated_bytes')), 2)} | {_fmt(c.get('within_budget'))} | "
                f"{_fmt(gb(c.get('h2d_bytes_per_step')), 2)} | {_fmt(c.get('bit_exact'))} | {_fmt(c.get('max_abs_diff'), 5)} |")
        if retried:
            lines.append("\n\\* ComfyUI ran out of memory at this budget with its own activation estimate; timed with "
                         "the shortfall added as `--reserve-vram` (see `first_attempt` in the JSON).")
    ph = results.get("sections", {}).get("phase", {}).get("results", {})
    if ph:
        lines += ["", "## PhaseOffload", "", f"- module: {ph.get('module')} ({_fmt(gb(ph.get('bytes')), 2)} GiB)",
                  f"- re-onload {_fmt(ph.get('onload_gbps_median'), 2)} GB/s (plain `.to(cuda)` from pageable: "
                  f"{_fmt(ph.get('plain_to_device_gbps'), 2)} GB/s)",
                  f"- offload device→host bytes: {ph.get('offload_d2h_bytes_total')} (ComfyUI's unload `.to('cpu')`: "
                  f"{ph.get('plain_offload_d2h_bytes')} bytes in {_fmt(ph.get('plain_to_cpu_s'), 3)} s)",
                  f"- bit-exact after cycles: {_fmt(ph.get('bit_exact'))}; parameters back on their masters: "
                  f"{_fmt(ph.get('params_point_at_masters_after_offload'))}"]
    q = results.get("sections", {}).get("quant", {})
    if q.get("layers"):
        lines += ["", "## Quantized linears (FLUX shapes, ms; SQNR dB vs bf16)", "",
                  "| layer | bf16 | fp8 | fp8 dB | int8 | int8 dB | nf4 | nf4 dB |", "|---|---|---|---|---|---|---|---|"]
        for r in q["layers"]:
            cells = [r.get("layer"), _fmt((r.get("bf16") or {}).get("ms"), 4)]
            for f in FORMATS:
                c = r.get(f) or {}
                cells += [_fmt(c.get("ms"), 4) if "ms" in c else (c.get("skipped") or c.get("failed") or "–")[:40],
                          _fmt(c.get("sqnr_db"), 1)]
            lines.append("| " + " | ".join(str(x) for x in cells) + " |")
        lines.append(f"\nspeed-up vs bf16 over these layers: {q.get('speedup_vs_bf16')}")
    vae = results.get("sections", {}).get("vae", {})
    v = vae.get("video") or {}
    if "chunked_peak_bytes" in v:
        lines += ["", "## TiledVAEDecode (video, temporal chunks)", "", f"- {v.get('shape_note')}",
                  f"- ComfyUI's decode: peak {_fmt(gb(v.get('untiled_peak_bytes')), 3)} GiB, {_fmt(v.get('untiled_s'), 3)} s; "
                  f"Levers 1-latent-frame chunks: peak {_fmt(gb(v.get('chunked_peak_bytes')), 3)} GiB, "
                  f"{_fmt(v.get('chunked_s'), 3)} s; bit-exact {_fmt(v.get('bit_exact'))}"]
    lx = vae.get("ltx_streamed") or {}
    if lx.get("chunks"):
        lines += ["", "## TiledVAEDecode (LTX-Video on ComfyUI 0.8.0, streamed temporal chunks)", "",
                  f"- {lx.get('shape_note')}; whole decode peak {_fmt(gb(lx.get('untiled_peak_bytes')), 3)} GiB, "
                  f"{_fmt(lx.get('untiled_s'), 3)} s", "",
                  "| chunk (latent frames) | peak GiB | predicted GiB | peak ratio | s | time ratio | work | PSNR dB |",
                  "|---|---|---|---|---|---|---|---|"]
        for c in lx["chunks"]:
            lines.append(f"| {c['chunk_latent_frames']} | {_fmt(gb(c['peak_bytes']), 3)} | "
                         f"{_fmt(gb(c['predicted_peak_bytes']), 3)} | {_fmt(c['peak_ratio'])} | {_fmt(c['s'], 3)} | "
                         f"{_fmt(c['time_ratio'])} | {_fmt(c['work_ratio'])} | {_fmt(c['psnr_db'], 1)} |")
    cfgs = [c for c in vae.get("image_configs", []) if "tiled_peak_bytes" in c]
    if cfgs:
        lines += ["", "## TiledVAEDecode (image)", "", f"{cfgs[0].get('shape_note', '')}", "",
                  "| tile px | tiles | untiled peak GiB | tiled peak GiB | peak ratio | untiled s | tiled s | PSNR dB |",
                  "|---|---|---|---|---|---|---|---|"]
        for v in cfgs:
            lines.append(f"| {v.get('tile_px')} | {v.get('tiles')} | {_fmt(gb(v.get('untiled_peak_bytes')), 3)} | "
                         f"{_fmt(gb(v.get('tiled_peak_bytes')), 3)} | {_fmt(v.get('peak_ratio'))} | "
                         f"{_fmt(v.get('untiled_s'), 3)} | {_fmt(v.get('tiled_s'), 3)} | {_fmt(v.get('psnr_db'), 1)} |")
    cps = ((results.get("sections", {}).get("comfy_phase", {}) or {}).get("results") or {}).get("summary") or {}
    if cps.get("phases"):
        lines += ["", "## PhaseOffload inside ComfyUI vs ComfyUI's default flow", "",
                  f"- seconds per generation: default {_fmt(cps.get('default_total_s'), 3)}, PhaseOffload "
                  f"{_fmt(cps.get('phase_offload_total_s'), 3)} (ratio {_fmt(cps.get('ratio_total_time'))}); "
                  f"bit-identical {_fmt(cps.get('bit_identical'))}; budget {_fmt(cps.get('budget_gib'))} GiB",
                  f"- host->device GiB: default {_fmt(cps.get('default_h2d_gib'))} (estimate), PhaseOffload "
                  f"{_fmt(cps.get('phase_offload_h2d_gib'))}; device->host GiB: default {_fmt(cps.get('default_d2h_gib'))} "
                  f"(estimate), PhaseOffload {_fmt(cps.get('phase_offload_d2h_gib'))}", "",
                  "| phase | default s | PhaseOffload s | default peak GiB | PhaseOffload peak GiB | PhaseOffload peak after release GiB |",
                  "|---|---|---|---|---|---|"]
        for name, ph in cps["phases"].items():
            lines.append(f"| {name} | {_fmt(ph.get('default_s'), 3)} | {_fmt(ph.get('phase_offload_s'), 3)} | "
                         f"{_fmt(ph.get('default_peak_gib'))} | {_fmt(ph.get('phase_offload_peak_gib'))} | "
                         f"{_fmt(ph.get('phase_offload_peak_after_release_gib'))} |")
        ex = cps.get("experts") or {}
        if ex:
            lines += ["", f"- two experts (Wan 2.2 A14B recipe, {ex.get('status')}): seconds per generation default "
                          f"{_fmt(ex.get('default_total_s'), 3)}, PhaseOffload with model_2 "
                          f"{_fmt(ex.get('phase_offload_total_s'), 3)} (ratio {_fmt(ex.get('ratio_total_time'))}); "
                          f"bit-identical {_fmt(ex.get('bit_identical'))}; device->host GiB default "
                          f"{_fmt(ex.get('default_d2h_gib'))} (estimate), PhaseOffload "
                          f"{_fmt(ex.get('phase_offload_d2h_gib'))} (pointer-swapped "
                          f"{_fmt(ex.get('phase_offload_swapped_gib'))})"]
    dyn = results.get("sections", {}).get("dynamic", {})
    if dyn.get("cases"):
        lines += ["", "## ComfyUI DynamicVRAM at the same budgets", "", dyn.get("note", ""), "",
                  "| model | budget | status | s/step | Levers GroupPrefetch s/step | Levers ÷ DynamicVRAM | device used GiB | bit-exact | reason |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for c in dyn["cases"]:
            lines.append(f"| {c.get('model')} | {c.get('budget')} | {c.get('status')} | {_fmt(c.get('s_per_step'), 4)} | "
                         f"{_fmt(c.get('levers_prefetch_s_per_step'), 4)} | {_fmt(c.get('levers_vs_dynamic'))} | "
                         f"{_fmt(gb(c.get('device_used_after_step_bytes')))} | {_fmt(c.get('bit_exact'))} | "
                         f"{str(c.get('reason') or '')[:160]} |")
    rec = results.get("sections", {}).get("recommend", {})
    if rec.get("rows"):
        lines += ["", "## Recommend: predicted vs measured", "",
                  "| model | budget | engine | plan | predicted DiT peak GiB | measured GiB | error | predicted s/step | measured s/step |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in rec["rows"]:
            lines.append(f"| {r.get('model')} | {r.get('budget') or 'unbudgeted'} | {r.get('engine')} | "
                         f"{r.get('plan_precision')}/{r.get('plan_residency')} | {_fmt(gb(r.get('predicted_dit_peak_bytes')), 2)} | "
                         f"{_fmt(gb(r.get('measured_peak_bytes')), 2)} | {_fmt(r.get('peak_error'))} | "
                         f"{_fmt(r.get('predicted_step_s'))} | {_fmt(r.get('measured_step_s'))} |")
    lines += ["", "## Sections", "", "| section | status | seconds | reason |", "|---|---|---|---|"]
    for name, sec in results.get("sections", {}).items():
        lines.append(f"| {name} | {sec.get('status')} | {sec.get('seconds')} | {(sec.get('reason') or '')[:160]} |")
    if results.get("skipped"):
        lines += ["", "## Skipped", ""] + [f"- {s}" for s in results["skipped"]]
    if results.get("watchdog"):
        lines += ["", f"**Watchdog:** {results['watchdog']}"]
    return "\n".join(lines) + "\n"


def render_plot(results: dict, path: Path) -> str | None:
    """s/step and peak VRAM per budget, per model and engine. Returns why not, or None when written."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return f"matplotlib unavailable: {exc}"
    models = results.get("sections", {}).get("dit", {}).get("models", {})
    if not models:
        return "no dit results to plot"
    fig, axes = plt.subplots(2, max(1, len(models)), figsize=(6.5 * max(1, len(models)), 8), squeeze=False)
    colors = {"resident": "#4c72b0", "levers_prefetch": "#55a868", "comfyui_lowvram": "#c44e52", "resident_fp8": "#8172b2"}
    for j, (name, rec) in enumerate(models.items()):
        cases = [c for c in rec.get("cases", []) if c.get("status") == "ok" and c.get("budget")]
        labels = list(dict.fromkeys(c["budget"] for c in rec.get("cases", []) if c.get("budget")))
        engines = [e for e in ("levers_prefetch", "comfyui_lowvram", "resident") if any(c["engine"] == e for c in cases)]
        width = 0.8 / max(1, len(engines))
        for k, eng in enumerate(engines):
            xs, ys, ps = [], [], []
            for i, lab in enumerate(labels):
                c = next((c for c in cases if c["engine"] == eng and c["budget"] == lab), None)
                if c:
                    xs.append(i + k * width)
                    ys.append(c["s_per_step"])
                    ps.append((c.get("peak_allocated_bytes") or 0) / GIB)
            axes[0][j].bar(xs, ys, width, label=eng, color=colors.get(eng))
            axes[1][j].bar(xs, ps, width, label=eng, color=colors.get(eng))
        floor = next((c for c in rec.get("cases", []) if c.get("engine") == "resident" and not c.get("budget")
                      and c.get("s_per_step")), None)
        if floor:
            axes[0][j].axhline(floor["s_per_step"], ls="--", color="k", lw=1, label="resident (compute floor)")
        for i, lab in enumerate(labels):
            c = next((c for c in rec.get("cases", []) if c.get("budget") == lab and c.get("budget_bytes")), None)
            if c:
                axes[1][j].plot([i - 0.1, i + 0.9], [c["budget_bytes"] / GIB] * 2, color="k", lw=1)
        for ax, ylab in ((axes[0][j], "s / DiT forward"), (axes[1][j], "peak allocated GiB (line: budget)")):
            ax.set_xticks([i + 0.4 - width / 2 for i in range(len(labels))])
            ax.set_xticklabels(labels)
            ax.set_ylabel(ylab)
            ax.set_title(f"{name}: {rec.get('spec', {}).get('img_tokens', '?')} image tokens")
            ax.legend(fontsize=8)
    fig.suptitle(f"Levers vs ComfyUI offload — {results.get('machine', {}).get('gpu') or 'CPU smoke'}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


# --------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------

SECTIONS = {"bandwidth": sec_bandwidth, "dit": sec_dit, "dynamic": sec_dynamic, "phase": sec_phase,
            "comfy_phase": sec_comfy_phase, "quant": sec_quant, "vae": sec_vae,
            "recommend": sec_recommend}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output folder (suite.json, suite.md, suite.png, suite.log)")
    p.add_argument("--fp8-modes", default="off,tensorwise,rowwise",
                   help="fp8 compute modes timed on the whole DiT (comma list of off, tensorwise, rowwise)")
    p.add_argument("--comfyui-dynamic", default=os.environ.get("COMFYUI_DYNAMIC_PATH"),
                   help="a DynamicVRAM-era ComfyUI (0.15+, comfy-aimdo importable) for the dynamic section")
    p.add_argument("--dynamic-cases", default="flux:12,wan:12,flux:24",
                   help="model:GiB budgets for the DynamicVRAM baseline, in order, while time lasts")
    p.add_argument("--comfyui", default=os.environ.get("COMFYUI_PATH"),
                   help="ComfyUI checkout for the baseline (default: $COMFYUI_PATH; none = baseline skipped)")
    p.add_argument("--sections", default=",".join(SECTION_ORDER),
                   help=f"comma-separated subset of {','.join(SECTION_ORDER)}")
    p.add_argument("--models", default="flux,wan", help="DiT shapes for the dit section: flux,wan")
    p.add_argument("--budgets", default="8,12,16,24", help="emulated VRAM budgets in GiB")
    p.add_argument("--time-budget", type=float, default=450.0,
                   help="seconds for the whole suite (sections stop starting cases past their share)")
    p.add_argument("--bw-gib", type=float, default=1.0, help="bytes per bandwidth copy, GiB")
    p.add_argument("--phase-gib", type=float, default=4.0, help="size of the phase-offload module, GiB")
    p.add_argument("--no-prepin", action="store_true", help="do not pin the DiT host weights before the cases")
    p.add_argument("--no-fp8-dit", action="store_true", help="skip the whole-DiT fp8 step case")
    p.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto",
                   help="weight and activation dtype of every section (auto: bf16 on CUDA, fp32 on the CPU; "
                        "--smoke --dtype bf16 --sections dit checks the packed-bf16 wiring on a CPU, where the "
                        "other sections run too slowly in bf16)")
    p.add_argument("--no-packed-stream", action="store_true",
                   help="skip GroupPrefetch streaming the bf16 weights losslessly packed (levers_prefetch_packed)")
    p.add_argument("--no-fp8-stream", action="store_true",
                   help="skip GroupPrefetch streaming the fp8 model (fp8 bytes over the bus) at each budget")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, every code path, seconds (CPU is fine)")
    p.add_argument("--cpu", action="store_true", help="ignore CUDA even when present")
    p.add_argument("--commit", help="the commit being measured, when the copy has no .git (else: git HEAD)")
    p.add_argument("--render-only", action="store_true",
                   help="re-read OUT/suite.json and rewrite its summary, suite.md and suite.png (no measuring)")
    a = p.parse_args(argv)
    a.sections = [s.strip() for s in a.sections.split(",") if s.strip()]
    unknown = [s for s in a.sections if s not in SECTIONS]
    if unknown:
        p.error(f"--sections: unknown {unknown}; choose from {', '.join(SECTION_ORDER)}")
    a.models = [m.strip() for m in a.models.split(",") if m.strip()]
    if any(m not in ("flux", "wan") for m in a.models):
        p.error(f"--models: choose from flux, wan (got {a.models})")
    try:
        a.budgets = [float(b) for b in a.budgets.split(",") if b.strip()]
    except ValueError:
        p.error(f"--budgets: expected GiB numbers like 8,12,16,24 (got {a.budgets!r})")
    if a.smoke and a.time_budget == 450.0:
        a.time_budget = 120.0
    return a


def render_only(out: Path) -> int:
    """Rebuild summary, table and plot from an existing suite.json (e.g. after a run was cut off)."""
    path = out / "suite.json"
    if not path.is_file():
        print(f"gpu_suite: {path} does not exist; run the suite first", file=sys.stderr)
        return 2
    results = json.loads(path.read_text())
    results["summary"] = build_summary(results)
    why = render_plot(results, out / "suite.png")
    results["plot"] = "suite.png" if why is None else None
    path.write_text(json.dumps(results, indent=2, default=_json_default))
    (out / "suite.md").write_text(render_markdown(results))
    print(f"rewrote {path}, suite.md" + (", suite.png" if why is None else f" (no plot: {why})"))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.render_only:
        return render_only(Path(args.out))
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    suite = Suite(args)
    if args.dtype != "auto":
        DTYPE["value"] = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    elif suite.device.type != "cuda":
        DTYPE["value"] = torch.float32
        if args.smoke:
            torch.set_num_threads(1)   # tiny ops: OpenMP fan-out only adds spin-waits on a busy CPU
    suite.results["dtype"] = str(DTYPE["value"])
    if suite.device.type == "cuda" or args.smoke:
        for piece in ("residency.transport", "residency.blocks", "residency.prefetch", "residency.packed", "residency.phase", "quant",
                      "quant.fp8", "tiling", "plan", "presets", "probe", "benchmark"):
            suite.pieces.get(piece)    # import every engine piece now (and record which are missing)
    _LOG_FILE.append(open(suite.out / "suite.log", "a"))
    log(f"Levers GPU suite: device {suite.device} ({suite.results['machine'].get('gpu') or 'no GPU'}), "
        f"commit {(suite.results['git'].get('commit') or 'unknown')[:12]}, sections {','.join(args.sections)}, "
        f"time budget {args.time_budget:.0f}s{', SMOKE' if args.smoke else ''}")
    if suite.device.type != "cuda" and not args.smoke:
        log("no CUDA device: every GPU section will be recorded as skipped (use --smoke to exercise the code)")
    watchdog(suite, args.time_budget + (30 if args.smoke else 60))
    if "dit" in args.sections or "vae" in args.sections:
        suite.comfy = ComfyBaseline(args.comfyui, suite.device)
        suite.results["comfyui"] = suite.comfy.info()
        if not suite.comfy.ok:
            suite.results["skipped"].append(f"comfyui baseline: {suite.comfy.reason}")
    gc.freeze()    # imports are done: keep their objects out of every later gc.collect()
    order = [s for s in SECTION_ORDER if s in args.sections]
    # a section that will only say "skipped" (no ComfyUI path for it, or the ComfyUI given did not import here)
    # takes none of dit's time
    comfy_ok = suite.comfy is None or suite.comfy.ok
    idle = {s for s, ok in (("comfy_phase", args.comfyui and comfy_ok), ("dynamic", args.comfyui_dynamic)) if not ok}
    for i, name in enumerate(order):
        reserve = dit_reserve(s for s in order[i + 1:] if s not in idle) if name == "dit" else 0.0
        seconds = SECTION_SECONDS[name] if not args.smoke else 60
        suite.run_section(name, SECTIONS[name], seconds, reserve_after=reserve if not args.smoke else 0.0)
    suite.results["summary"] = build_summary(suite.results)
    if suite.comfy is not None:
        suite.results["comfyui"] = suite.comfy.info()
    why = None
    try:
        why = render_plot(suite.results, suite.out / "suite.png")
    except Exception as exc:  # noqa: BLE001 - the plot is a view; never lose the JSON over it
        why = f"plot failed: {short_exc(exc)}"
    suite.results["plot"] = "suite.png" if why is None else None
    if why:
        suite.results["skipped"].append(f"plot: {why}")
    suite.save(final=True)
    s = suite.results["summary"]
    log("summary: " + "; ".join(f"{k}={_fmt(v.get('value'))}" for k, v in s.items()))
    log(f"wrote {suite.out / 'suite.json'}, suite.md{', suite.png' if why is None else ''} in "
        f"{time.monotonic() - T_PROCESS:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
