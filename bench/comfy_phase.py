#!/usr/bin/env python3
"""PhaseOffload inside a real ComfyUI, in process: time per generation vs ComfyUI's default flow.

Builds random-weight Wan 2.1-shaped models (DiT, UMT5-shaped text encoder, Wan VAE) with ComfyUI's
own classes, saves them where ComfyUI's stock loaders read them, and runs one text-to-video
generation (CLIPTextEncode -> KSampler -> VAEDecode) twice per flow at the same emulated VRAM
budget: (a) ComfyUI's default flow on the loader outputs; (b) the same graph on the outputs of
LeversPhaseOffload's bridge (``bridge.phase.apply``, the function the node calls). The second
run of each flow is the measured one. Per phase: seconds, peak VRAM, bytes moved; overall: the
time ratio and whether the decoded frames are bit-identical.

    python bench/comfy_phase.py --comfyui /path/to/ComfyUI --device cpu --scale cpu
    python bench/comfy_phase.py --comfyui .comfy/pollockjj --device cuda:0 --scale gpu --out OUT

From the GPU suite: ``run_phase_bench(path, "cuda:0", None, scale="gpu", deadline_s=150)``. It never
raises: every failure becomes ``status`` + ``reason`` in the returned (JSON-ready) dict.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import importlib.util
import io
import json
import logging
import math
import os
import random
import shutil
import sys
import tempfile
import time
import traceback
import types
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
GIB = 1024 ** 3
SCHEMA = "levers-comfy-phase/1"
PROMPT = "a red fox runs through fresh snow at dawn, cinematic light, shallow depth of field"
NEGATIVE = "blurry, low quality, watermark"


# --------------------------------------------------------------------------------------------
# workload sizes
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Scale:
    """One workload: model widths/depths, the latent, the sampler, and the default budget."""

    name: str
    dit_dim: int            # Wan: num_heads = dim // 128 (what UNETLoader's detection assumes)
    dit_ffn: int
    dit_layers: int
    te_layers: int          # UMT5 blocks (XXL has 24) at d_model 4096, the DiT's text_dim
    te_heads: int
    te_d_kv: int
    te_d_ff: int
    vae_dim: int
    width: int
    height: int
    frames: int
    steps: int
    cfg: float
    dtype: str              # weights as saved: bf16 on the GPU, fp32 on the CPU (ComfyUI's CPU default)
    budget_extra_gib: float  # default budget = DiT bytes + this
    te_min_length: int | None = None   # prompt padding; None = the UMT5 tokenizer's own (512 tokens)


SCALES = {
    # seconds on 2 CPU cores: every code path, nothing that matters for memory
    "cpu": Scale("cpu", dit_dim=256, dit_ffn=512, dit_layers=6, te_layers=2, te_heads=1, te_d_kv=8, te_d_ff=16, vae_dim=16,
                 width=64, height=64, frames=5, steps=2, cfg=2.0, dtype="fp32", budget_extra_gib=1.5,
                 te_min_length=32),
    # ~4.1 GB DiT (2.0 B params: Wan 2.1 blocks at dim 2048), ~3.1 GB text encoder (8 blocks of
    # UMT5-XXL's own width), tiny VAE: on an emulated DiT + 2.5 GiB card the DiT fits with room for
    # its activations, the encoder does not fit next to it; 480x832x9 frames = 4680 tokens per
    # forward, a step ~0.1-0.2 s on an H200.
    "gpu": Scale("gpu", dit_dim=2048, dit_ffn=8192, dit_layers=30, te_layers=8, te_heads=64, te_d_kv=64, te_d_ff=10240,
                 vae_dim=16, width=832, height=480, frames=9, steps=4, cfg=5.0, dtype="bf16",
                 budget_extra_gib=2.5),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class OutOfTime(Exception):
    """The deadline would be passed; what was measured so far is returned with status partial."""


class Clock:
    def __init__(self, seconds: float) -> None:
        self.t0 = time.monotonic()
        self.deadline = self.t0 + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def need(self, seconds: float, what: str) -> None:
        if self.left() < seconds:
            raise OutOfTime(f"{what}: needs ~{seconds:.0f}s, {max(0.0, self.left()):.0f}s left")


def _log(msg: str) -> None:
    print(f"[comfy_phase] {msg}", flush=True)


def _short(exc: BaseException, limit: int = 600) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= limit else text[:limit] + " ..."


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def _gib(nbytes: float | None) -> float | None:
    return None if nbytes is None else round(nbytes / GIB, 3)


# --------------------------------------------------------------------------------------------
# ComfyUI and Levers, in process
# --------------------------------------------------------------------------------------------

def import_comfy(comfy_path: str, device: torch.device) -> tuple[types.SimpleNamespace, list[str]]:
    """ComfyUI's modules, importing them only if nobody has (the GPU suite may have already).

    Never parses argv (``enable_args_parsing(False)``); a CPU run sets ``args.cpu`` first, as
    ComfyUI's ``--cpu`` would, else model_management asks CUDA for a device.
    """
    notes: list[str] = []
    p = Path(comfy_path).expanduser().resolve()
    if not (p / "comfy" / "model_management.py").is_file():
        raise FileNotFoundError(f"{p} is not a ComfyUI checkout (no comfy/model_management.py)")
    already = "comfy.model_management" in sys.modules
    if already:
        loaded_from = Path(sys.modules["comfy.model_management"].__file__).resolve().parents[1]
        if loaded_from != p:
            notes.append(f"ComfyUI was already imported from {loaded_from}; reused it instead of {p}")
            p = loaded_from
        else:
            notes.append("reused the ComfyUI already imported in this process")
        if str(p) not in sys.path:
            sys.path.insert(0, str(p))     # its top-level modules (nodes, folder_paths) come from the same tree
    else:
        if str(p) not in sys.path:
            sys.path.insert(0, str(p))
        import comfy.options
        comfy.options.enable_args_parsing(False)
        import comfy.cli_args
        if device.type != "cuda":
            comfy.cli_args.args.cpu = True
            if hasattr(comfy.cli_args.args, "disable_pinned_memory"):
                comfy.cli_args.args.disable_pinned_memory = True
    import comfy.model_management as mm
    import comfy.ops
    import comfy.sd
    import folder_paths
    nodes = sys.modules.get("nodes")
    if nodes is None or not hasattr(nodes, "UNETLoader"):
        nodes = importlib.import_module("nodes")
    version = "unknown"
    with contextlib.suppress(ImportError, AttributeError):
        version = importlib.import_module("comfyui_version").__version__
    return types.SimpleNamespace(path=str(p), version=version, mm=mm, sd=comfy.sd, ops=comfy.ops,
                                 folder_paths=folder_paths, nodes=nodes), notes


def import_phase_bridge():
    """``comfyui_levers.bridge.phase`` from this checkout (a package shell when not installed)."""
    if "comfyui_levers" not in sys.modules:
        try:
            importlib.import_module("comfyui_levers")
        except ImportError:
            pkg = types.ModuleType("comfyui_levers")
            pkg.__path__ = [str(ROOT)]
            pkg.__file__ = str(ROOT / "__init__.py")
            sys.modules["comfyui_levers"] = pkg
    return importlib.import_module("comfyui_levers.bridge.phase")


# --------------------------------------------------------------------------------------------
# random-weight models with ComfyUI's own classes
# --------------------------------------------------------------------------------------------

class Filler:
    """Fast deterministic random fill: each tensor is copied from slices of a pre-scaled N(0, 1) pool.

    ``torch.randn`` (or bf16 arithmetic) over billions of elements takes minutes on a CPU; copying
    from a pool runs at memcpy speed. Weights ~ N(0, (0.5 / sqrt(fan_in))^2) keep activations O(1)
    through many blocks, norm scales ~1, biases small. Pool reuse is irrelevant for timing and for
    bit-equality between two flows on the same weights.
    """

    def __init__(self, seed: int, pool: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.base = torch.randn(pool, generator=g)
        self.rng = random.Random(seed)
        self.pools: dict[tuple, torch.Tensor] = {}

    def _pool(self, kind: str, fan_in: int, dtype: torch.dtype) -> torch.Tensor:
        key = (kind, fan_in, dtype)
        if key not in self.pools:
            if kind == "norm":
                self.pools[key] = (self.base * 0.05 + 1.0).to(dtype)
            elif kind == "bias":
                self.pools[key] = (self.base * 0.02).to(dtype)
            else:
                self.pools[key] = (self.base * (0.5 / math.sqrt(max(1, fan_in)))).to(dtype)
        return self.pools[key]

    def tensor(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        leaf = name.rsplit(".", 1)[-1]
        if "norm" in name or leaf == "gamma" or (leaf == "weight" and len(shape) == 1):
            pool = self._pool("norm", 0, dtype)
        elif leaf == "bias" or len(shape) <= 1:
            pool = self._pool("bias", 0, dtype)
        else:
            pool = self._pool("weight", math.prod(shape[1:]), dtype)
        n, size = math.prod(shape), pool.numel()
        out = torch.empty(n, dtype=dtype)
        pos = 0
        while pos < n:
            off = self.rng.randrange(size)
            k = min(n - pos, size - off)
            out[pos:pos + k].copy_(pool[off:off + k])
            pos += k
        return out.view(shape)

    def state_dict(self, module: torch.nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        return {k: self.tensor(k, tuple(v.shape), dtype) for k, v in sorted(module.state_dict().items())}


def wan_dit_state_dict(sc: Scale, fill: Filler) -> dict[str, torch.Tensor]:
    """A Wan 2.1 t2v DiT; UNETLoader reads dim from head.modulation, depth from blocks.N."""
    import comfy.ldm.wan.model as wan
    import comfy.ops

    m = wan.WanModel(model_type="t2v", patch_size=(1, 2, 2), text_len=512, in_dim=16, dim=sc.dit_dim,
                     ffn_dim=sc.dit_ffn, freq_dim=256, text_dim=4096, out_dim=16, num_heads=sc.dit_dim // 128,
                     num_layers=sc.dit_layers, operations=comfy.ops.disable_weight_init, device="meta")
    return fill.state_dict(m, DTYPES[sc.dtype])


def wan_vae_state_dict(sc: Scale, fill: Filler) -> dict[str, torch.Tensor]:
    """A Wan 2.1 VAE at small width; VAELoader reads dim from decoder.head.0.gamma (ComfyUI 0.3.64's loader fixes
    the released width, 96: there, that width)."""
    import inspect

    import comfy.ldm.wan.vae as wanvae
    import comfy.sd

    dim = sc.vae_dim if "decoder.head.0.gamma" in inspect.getsource(comfy.sd.VAE.__init__) else 96
    kwargs = dict(dim=dim, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                  temperal_downsample=[False, True, True], dropout=0.0)
    if "image_channels" in inspect.signature(wanvae.WanVAE.__init__).parameters:
        kwargs["image_channels"] = 3
    with torch.device("meta"):
        m = wanvae.WanVAE(**kwargs)
    return fill.state_dict(m, DTYPES[sc.dtype])


def spiece_model_bytes(seed: int = 0) -> bytes:
    """A tiny SentencePiece model (byte fallback, pad 0 / eos 1 as UMT5 uses), trained in ~0.1 s.

    Real UMT5 checkpoints carry their tokenizer as the ``spiece_model`` tensor; this stands in.
    """
    import sentencepiece as spm

    rng = random.Random(seed)
    syllables = ["ka", "ri", "mo", "ten", "sa", "lu", "vex", "or", "an", "pi", "dro", "qua", "zel", "fu", "ny"]
    lines = [" ".join("".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))) for _ in range(12))
             for _ in range(300)] + [PROMPT, NEGATIVE] * 4
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=buf, vocab_size=320,
                                   model_type="unigram", character_coverage=1.0, byte_fallback=True,
                                   pad_id=0, eos_id=1, unk_id=2, bos_id=-1, minloglevel=2)
    return buf.getvalue()


# ComfyUI recognises UMT5-XXL by this tensor: 0.8.0 checks its width (4096), 0.33 its height (10240).
XXL_PROBE = "encoder.block.23.layer.1.DenseReluDense.wi_1.weight"


def umt5_config(sc: Scale, vocab: int) -> dict[str, Any]:
    """A UMT5 with fewer / narrower blocks than XXL at d_model 4096 (the DiT's text_dim). Passed to
    ComfyUI as ``model_options["umt5xxl_model_config"]``, which its UMT5 class merges into the json."""
    return {"num_layers": sc.te_layers, "num_decoder_layers": sc.te_layers, "d_model": 4096,
            "num_heads": sc.te_heads, "d_kv": sc.te_d_kv, "d_ff": sc.te_d_ff, "vocab_size": vocab}


def umt5_state_dict(sc: Scale, fill: Filler, comfy_path: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    import comfy.ops
    import comfy.text_encoders.t5 as t5

    tok = spiece_model_bytes()
    overrides = umt5_config(sc, vocab=320)
    with open(Path(comfy_path) / "comfy" / "text_encoders" / "umt5_config_xxl.json") as f:
        config = json.load(f)
    config.update(overrides)
    m = t5.T5(config, None, "meta", comfy.ops.disable_weight_init)
    sd = fill.state_dict(m, DTYPES[sc.dtype])
    if XXL_PROBE not in sd:
        # detection only: ComfyUI picks the UMT5-XXL class from this key, then loads the config
        # override; the tensor matches no parameter (ComfyUI logs it as unexpected) and is dropped
        sd[XXL_PROBE] = torch.zeros(10240, 4096, dtype=torch.bfloat16)
    sd["spiece_model"] = torch.frombuffer(bytearray(tok), dtype=torch.uint8).clone()
    return sd, overrides


_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.uint8: "U8"}


def save(sd: dict[str, torch.Tensor], path: Path) -> int:
    """Write ``sd`` as .safetensors; returns the bytes of its real parameters.

    The format is an 8-byte header length, a JSON header, then the raw tensor bytes; writing the
    bytes straight from each tensor avoids ``safetensors.torch.save_file``'s in-memory copy of the
    whole file (half a minute for 7 GB on a busy CPU). Read back by ComfyUI's stock loaders.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    tensors, offset = [], 0
    for name, t in sd.items():
        t = t.detach().contiguous().cpu()
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        tensors.append(t)
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)              # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for t in tensors:
            f.write(memoryview(t.view(-1).view(torch.uint8).numpy()))
    return sum(t.numel() * t.element_size() for k, t in sd.items() if k not in ("spiece_model", XXL_PROBE))


def estimated_file_bytes(sc: Scale) -> int:
    """DiT + text encoder file sizes, from the widths alone (what ``scratch_dir`` must hold)."""
    d, f, L = sc.dit_dim, sc.dit_ffn, sc.dit_layers
    dit = L * (8 * d * d + 2 * d * f + 8 * d) + 4096 * d + d * d + 256 * d + 7 * d * d
    inner = sc.te_heads * sc.te_d_kv
    te = sc.te_layers * (4 * 4096 * inner + 3 * 4096 * sc.te_d_ff) + 10240 * 4096
    return (dit + te) * (2 if sc.dtype != "fp32" else 4)


def scratch_dir(sc: Scale) -> Path:
    """A temporary models folder: RAM-backed /dev/shm when it has room (writing and re-reading
    7 GB through a slow disk would cost more than the whole measurement), else the temp dir."""
    need = int(estimated_file_bytes(sc) * 1.3) + GIB // 4
    shm = Path("/dev/shm")
    with contextlib.suppress(OSError):
        if shm.is_dir() and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free > 2 * need:
            return Path(tempfile.mkdtemp(prefix="levers_comfy_phase_", dir=shm))
    return Path(tempfile.mkdtemp(prefix="levers_comfy_phase_"))


@contextlib.contextmanager
def model_folders(folder_paths, root: Path):
    """Register ``root/<kind>`` with ComfyUI's folder_paths and send outputs (the PhaseOffload
    ledger JSON) to ``root/output``; undo both on exit."""
    added = []
    old_output = folder_paths.get_output_directory()
    (root / "output").mkdir(parents=True, exist_ok=True)
    folder_paths.set_output_directory(str(root / "output"))
    for kind in ("diffusion_models", "vae", "text_encoders"):
        d = root / kind
        d.mkdir(parents=True, exist_ok=True)
        folder_paths.add_model_folder_path(kind, str(d))
        added.append((kind, str(d)))
    try:
        yield
    finally:
        folder_paths.set_output_directory(old_output)
        for kind, d in added:
            paths = folder_paths.folder_names_and_paths.get(kind, ([],))[0]
            with contextlib.suppress(ValueError):
                paths.remove(d)
        cache = getattr(folder_paths, "filename_list_cache", None)
        if isinstance(cache, dict):
            for kind, _ in added:
                cache.pop(kind, None)


# --------------------------------------------------------------------------------------------
# the emulated card
# --------------------------------------------------------------------------------------------

@contextlib.contextmanager
def emulated_card(mm, device: torch.device, budget_bytes: int | None):
    """A card with ``budget_bytes``: ComfyUI's ``get_free_memory`` reports ``budget - active``
    (as the suite's ComfyBaseline does) and the caching allocator is capped at the budget, so an
    overshoot raises OOM instead of quietly using the rest of the H200."""
    if device.type != "cuda" or budget_bytes is None:
        yield
        return
    orig = mm.get_free_memory
    if str(Path(__file__).resolve().parent) not in sys.path:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
    from comfy_card import budget_free_memory
    get_free_memory = budget_free_memory(mm, budget_bytes)

    total = torch.cuda.get_device_properties(device).total_memory
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    old_fraction = getter(device) if callable(getter) else 1.0
    mm.get_free_memory = get_free_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, budget_bytes / total), device)
    try:
        yield
    finally:
        mm.get_free_memory = orig
        torch.cuda.set_per_process_memory_fraction(old_fraction, device)


class _Lines(logging.Handler):
    """Collect ComfyUI's load/unload log lines for one flow (they say lowvram vs full loads)."""

    KEYS = ("loaded partially", "loaded completely", "unload", "Requested to load", "Levers PhaseOffload", "lowvram")

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if any(k in msg for k in self.KEYS):
            self.lines.append(msg[:240])


@contextlib.contextmanager
def captured_log():
    h = _Lines()
    root = logging.getLogger()
    old_level = root.level
    root.addHandler(h)
    if root.level > logging.INFO or root.level == logging.NOTSET:
        root.setLevel(logging.INFO)
    try:
        yield h.lines
    finally:
        root.removeHandler(h)
        root.setLevel(old_level)


# --------------------------------------------------------------------------------------------
# one generation, phase by phase
# --------------------------------------------------------------------------------------------

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _mem(device: torch.device) -> int | None:
    return int(torch.cuda.memory_allocated(device)) if device.type == "cuda" else None


def _loaded(patchers: dict[str, Any]) -> dict[str, int]:
    out = {}
    for name, p in patchers.items():
        with contextlib.suppress(Exception):   # a patcher without loaded_size() just is not listed
            out[name] = int(p.loaded_size())
    return out


def _comfy_loaded(mm) -> list[dict[str, Any]]:
    """ComfyUI's own ledger: which models it holds on the device and how much of each."""
    out = []
    for lm in list(mm.current_loaded_models):
        p = lm.model
        if p is None:
            continue
        with contextlib.suppress(Exception):
            out.append({"model": type(p.model).__name__, "loaded_gib": _gib(p.loaded_size()),
                        "size_gib": _gib(p.model_size())})
    return out


class PeakMarks:
    """Per-phase peak VRAM, split at ComfyUI's last release inside the phase.

    ``comfy.model_management.free_memory`` is wrapped for the flow: after each call (ComfyUI's
    load path, or PhaseOffload releasing the other components) the peak so far is folded into
    ``before`` and the counter restarts. At the end of a phase, ``after`` is the peak since the
    last release (this component + its activations + whatever ComfyUI chose to keep), and
    ``max(before, after)`` the whole phase's peak, residue of the previous phase included.
    """

    def __init__(self, mm, device: torch.device) -> None:
        self.mm, self.device, self.before, self._orig = mm, device, 0, None

    def __enter__(self) -> "PeakMarks":
        if self.device.type == "cuda":
            orig = self._orig = self.mm.free_memory

            def free_memory(*args, **kwargs):
                out = orig(*args, **kwargs)
                self.fold()
                return out

            self.mm.free_memory = free_memory
        return self

    def __exit__(self, *exc) -> None:
        if self._orig is not None:
            self.mm.free_memory = self._orig
            self._orig = None

    def fold(self) -> None:
        self.before = max(self.before, int(torch.cuda.max_memory_allocated(self.device)))
        torch.cuda.reset_peak_memory_stats(self.device)

    def start(self) -> None:
        self.before = 0
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def finish(self) -> tuple[int | None, int | None]:
        if self.device.type != "cuda":
            return None, None
        after = int(torch.cuda.max_memory_allocated(self.device))
        return max(self.before, after), after


def generation(env, sc: Scale, device: torch.device, model, clip, vae, latent_shape: tuple[int, ...],
               group=None, seed: int = 0, model_2=None) -> tuple[dict[str, Any], torch.Tensor]:
    """CLIPTextEncode (x2) -> KSampler -> VAEDecode with ComfyUI's node code; per-phase numbers. With ``model_2``
    (Wan 2.2 A14B's two experts): two KSamplerAdvanced, ``model`` for the first half of the steps (leftover noise
    kept), ``model_2`` for the rest, as ComfyUI's Wan 2.2 template."""
    nodes, mm = env.nodes, env.mm
    patchers = {"diffusion_model": model, "text_encoder": clip.patcher, "vae": vae.patcher}
    if model_2 is not None:
        patchers["diffusion_model_2"] = model_2
    state: dict[str, Any] = {}
    half = max(1, sc.steps // 2)

    def encode():
        enc = nodes.CLIPTextEncode()
        state["pos"] = enc.encode(clip, PROMPT)[0]
        state["neg"] = enc.encode(clip, NEGATIVE)[0]

    def sample():
        latent = {"samples": torch.zeros(latent_shape)}
        if model_2 is None:
            state["latent"] = nodes.common_ksampler(model, seed, sc.steps, sc.cfg, "euler", "simple",
                                                    state["pos"], state["neg"], latent)[0]
            return
        state["latent"] = nodes.KSamplerAdvanced().sample(model, "enable", seed, sc.steps, sc.cfg, "euler", "simple",
                                                          state["pos"], state["neg"], latent, 0, half, "enable")[0]

    def sample_2():
        state["latent"] = nodes.KSamplerAdvanced().sample(model_2, "disable", seed, sc.steps, sc.cfg, "euler",
                                                          "simple", state["pos"], state["neg"], state["latent"],
                                                          half, 10000, "disable")[0]

    def decode():
        state["images"] = nodes.VAEDecode().decode(vae, state["latent"])[0]

    steps = [("encode", encode), ("sample", sample)] + ([("sample_2", sample_2)] if model_2 is not None else []) \
        + [("decode", decode)]

    if group is not None and hasattr(group, "new_run"):
        group.new_run()          # one bridge run ledger per generation
    phases: dict[str, Any] = {}
    t_total = time.perf_counter()
    for name, fn in steps:
        _sync(device)
        before = _loaded(patchers)
        n_rec = len(group.records) if group is not None else 0
        rec: dict[str, Any] = {"allocated_at_start_bytes": _mem(device)}
        with PeakMarks(mm, device) as marks:
            marks.start()
            t0 = time.perf_counter()
            fn()
            _sync(device)
            rec["seconds"] = round(time.perf_counter() - t0, 4)
            rec["peak_allocated_bytes"], rec["peak_after_release_bytes"] = marks.finish()
        rec["allocated_at_end_bytes"] = _mem(device)
        after = _loaded(patchers)
        rec["loaded_bytes_after"] = after
        # What ComfyUI's ledger says moved: growth = weights it loaded (H2D), shrinkage = weights it
        # unloaded (a D2H copy in the default flow, a pointer swap under PhaseOffload).
        rec["comfy_loaded_delta"] = {
            "up_bytes": sum(max(0, after.get(k, 0) - before.get(k, 0)) for k in patchers),
            "down_bytes": sum(max(0, before.get(k, 0) - after.get(k, 0)) for k in patchers)}
        if group is not None:
            moves = [r for r in group.records[n_rec:] if "h2d" in r]
            rec["levers_ledger"] = {"h2d_bytes": sum(r["h2d"] for r in moves), "d2h_bytes": sum(r["d2h"] for r in moves),
                                    "swapped_bytes": sum(r["swapped"] for r in moves),
                                    "released": sorted({x for r in group.records[n_rec:] if r["kind"] == "exclusive"
                                                        for x in r["released"]})}
        rec["comfy_loaded_after"] = _comfy_loaded(mm)
        phases[name] = rec
    total = time.perf_counter() - t_total
    return {"total_s": round(total, 4), "phases": phases, "steps": sc.steps,
            "dit_size_bytes": int(model.model_size())}, state["images"]


def _flow_bytes(run: dict[str, Any], phase_flow: bool) -> dict[str, Any]:
    ph = run["phases"].values()
    out = {"comfy_loaded_up_bytes": sum(p["comfy_loaded_delta"]["up_bytes"] for p in ph),
           "comfy_loaded_down_bytes": sum(p["comfy_loaded_delta"]["down_bytes"] for p in ph)}
    # Weights ComfyUI left off the device (lowvram) are copied again at every model call: one
    # euler step is one call (cond and uncond batched when they fit).
    dit = run["phases"]["sample"]
    out["lowvram_streamed_estimate_bytes"] = max(0, run.get("dit_size_bytes", 0)
                                                 - dit["loaded_bytes_after"].get("diffusion_model", 0)) * run["steps"]
    if phase_flow:
        out.update({"h2d_bytes": sum(p["levers_ledger"]["h2d_bytes"] for p in ph),
                    "d2h_bytes": sum(p["levers_ledger"]["d2h_bytes"] for p in ph),
                    "swapped_bytes": sum(p["levers_ledger"]["swapped_bytes"] for p in ph),
                    "source": "Levers PhaseOffload ledger (copies it made / pointer swaps it did)"})
    else:
        out.update({"h2d_bytes": out["comfy_loaded_up_bytes"], "d2h_bytes": out["comfy_loaded_down_bytes"],
                    "source": "estimate: ComfyUI loaded_size growth (H2D) / shrinkage (its unload copies weights "
                              "D2H); lowvram per-op casts during sampling are in lowvram_streamed_estimate_bytes "
                              "(DiT bytes left off the device x steps, one model call per euler step)"})
    return out


def run_flow(env, sc: Scale, device: torch.device, clock: Clock, name: str, make: Callable[[], tuple],
             latent_shape, phase_flow: bool) -> tuple[dict[str, Any], torch.Tensor | None]:
    """Warm-up + measured generation of one flow; failures become the flow's status."""
    res: dict[str, Any] = {"status": "running"}
    images = None
    with captured_log() as lines:
        try:
            t0 = time.perf_counter()
            model, clip, vae, group, *more = make()
            model_2 = more[0] if more else None
            res["setup_s"] = round(time.perf_counter() - t0, 3)
            clock.need(5, f"{name} warm-up")
            warm, _ = generation(env, sc, device, model, clip, vae, latent_shape, group, model_2=model_2)
            res["warmup_total_s"] = warm["total_s"]
            _log(f"{name}: warm-up {warm['total_s']:.2f}s")
            clock.need(warm["total_s"] * 1.5 + 2, f"{name} measured run")
            run, images = generation(env, sc, device, model, clip, vae, latent_shape, group, model_2=model_2)
            res.update(run)
            res["bytes"] = _flow_bytes(run, phase_flow)
            res["images_shape"] = list(images.shape)
            res["images_finite"] = bool(torch.isfinite(images).all())
            res["images_mean_std"] = [round(float(images.float().mean()), 5), round(float(images.float().std()), 5)]
            if group is not None:
                bridge = import_phase_bridge()
                led = group.ledger()
                res["ledger_totals_both_runs"] = led.get("totals")
                res["levers_run_ledger"] = led.get("run")    # the measured generation, per phase (bridge's view)
                res["ledger_components"] = {k: {kk: v.get(kk) for kk in ("dynamic", "master_bytes", "pin", "notes")}
                                            for k, v in led["components"].items()}
                res["report"] = bridge.report_text(group)
            res["status"] = "ok"
            _log(f"{name}: {run['total_s']:.2f}s per generation (" +
                 ", ".join(f"{k} {v['seconds']:.2f}s" for k, v in run["phases"].items()) + ")")
        except OutOfTime as exc:
            res.update({"status": "partial", "reason": str(exc)})
        except Exception as exc:  # noqa: BLE001 - a failed flow is a result, not a crash
            res.update({"status": "oom" if _is_oom(exc) else "error", "reason": _short(exc),
                        "traceback": traceback.format_exc()[-8000:]})
            _log(f"{name}: {res['status']}: {_short(exc, 300)}")
        finally:
            res["comfy_log"] = lines[-40:]
    return res, images


def _unload_all(env, device: torch.device) -> None:
    env.mm.unload_all_models()
    gc.collect()
    env.mm.soft_empty_cache()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------------
# the benchmark
# --------------------------------------------------------------------------------------------

def run_phase_bench(comfy_path: str, device: str, budget_gib: float | None, scale: str = "gpu",
                    deadline_s: float = 150.0, out_dir: str | None = None,
                    into: dict[str, Any] | None = None) -> dict[str, Any]:
    """Default flow vs PhaseOffload in ComfyUI at one VRAM budget. Returns a JSON-ready dict and
    never raises (status ok | partial | skipped | error, with reason). ``into``: the dict to fill (and return)
    as the cases finish, so a caller that must exit early (the suite's watchdog) writes what is done."""
    clock = Clock(deadline_s)
    result: dict[str, Any] = into if into is not None else {}
    result.update({"schema": SCHEMA, "status": "running", "reason": None, "device": device,
                   "scale": scale, "budget_gib": budget_gib, "sizes": {}, "default": None,
                   "phase_offload": None, "ratio_total_time": None, "bit_identical": None,
                   "max_abs_diff": None, "notes": [], "timings": {}})
    tmp: Path | None = None
    try:
        if scale not in SCALES:
            raise ValueError(f"scale={scale!r}: choose one of {', '.join(SCALES)}")
        sc = SCALES[scale]
        result["workload"] = asdict(sc)
        dev = torch.device(device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            result.update(status="skipped", reason=f"device {device} requested but CUDA is not available")
            return result
        t0 = time.perf_counter()
        env, notes = import_comfy(comfy_path, dev)
        result["notes"].extend(notes)
        result["comfyui_version"] = env.version
        comfy_dev = torch.device(env.mm.get_torch_device())
        if comfy_dev.type != dev.type:
            result.update(status="skipped", reason=f"ComfyUI in this process runs on {comfy_dev}, not {device} "
                                                   "(it was imported with other flags)")
            return result
        bridge = import_phase_bridge()
        result["timings"]["import_s"] = round(time.perf_counter() - t0, 2)
        result["torch"] = torch.__version__
        if dev.type == "cuda":
            result["gpu"] = torch.cuda.get_device_name(dev)
            result["gpu_total_gib"] = _gib(torch.cuda.get_device_properties(dev).total_memory)

        tmp = scratch_dir(sc)
        result["scratch_dir"] = str(tmp)
        with model_folders(env.folder_paths, tmp):
            names, te_config = build_models(env, sc, tmp, result, clock)
            clock.need(10, "loading the models")
            with torch.inference_mode():    # ComfyUI runs every prompt (loaders included) in inference mode
                result["status"] = load_and_run(env, bridge, sc, dev, budget_gib, clock, tmp, result, names,
                                                te_config)
    except OutOfTime as exc:
        result.update(status="partial", reason=str(exc))
    except Exception as exc:  # noqa: BLE001 - the suite gets a record, never a traceback
        result.update(status="error", reason=_short(exc), traceback=traceback.format_exc()[-8000:])
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        gc.collect()            # the models (and their pinned host masters) die with this call
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()
        result["wall_s"] = round(time.monotonic() - clock.t0, 2)
        if out_dir:
            with contextlib.suppress(OSError):
                Path(out_dir).mkdir(parents=True, exist_ok=True)
                (Path(out_dir) / "comfy_phase.json").write_text(json.dumps(result, indent=2, default=str))
    return result


def build_models(env, sc: Scale, tmp: Path, result: dict[str, Any],
                 clock: Clock) -> tuple[tuple[str, str, str], dict[str, Any]]:
    """Random-weight DiT, text encoder and VAE files under ``tmp`` (registered with folder_paths)."""
    t0 = time.perf_counter()
    fill = Filler(seed=0, pool=(1 << 24) if sc.name == "gpu" else (1 << 20))
    unet_name, vae_name, te_name = "levers_bench_wan.safetensors", "levers_bench_wan_vae.safetensors", \
        "levers_bench_umt5.safetensors"
    sizes = result["sizes"]
    sizes["dit"] = save(wan_dit_state_dict(sc, fill), tmp / "diffusion_models" / unet_name)
    sizes["vae"] = save(wan_vae_state_dict(sc, fill), tmp / "vae" / vae_name)
    clock.need(15 if sc.name == "gpu" else 3, "building the text encoder")
    te_sd, te_config = umt5_state_dict(sc, fill, env.path)
    result["notes"].append(f"text encoder: UMT5 with {sc.te_layers} blocks ({te_config}) loaded by comfy.sd.load_clip "
                           f"(what CLIPLoader type=wan calls) with model_options['umt5xxl_model_config']; the file "
                           f"also holds {XXL_PROBE} (detection only, unused, logged by ComfyUI as unexpected)")
    sizes["te"] = save(te_sd, tmp / "text_encoders" / te_name)
    del te_sd, fill
    result["timings"]["build_s"] = round(time.perf_counter() - t0, 2)
    _log(f"built DiT {sizes['dit'] / GIB:.2f} GiB, text encoder {sizes['te'] / GIB:.2f} GiB, "
         f"VAE {sizes['vae'] / GIB:.3f} GiB in {result['timings']['build_s']}s")
    return (unet_name, vae_name, te_name), te_config


def load_and_run(env, bridge, sc: Scale, dev: torch.device, budget_gib: float | None, clock: Clock, tmp: Path,
                  result: dict[str, Any], names: tuple[str, str, str], te_config: dict[str, Any]) -> str:
    nodes, sizes = env.nodes, result["sizes"]
    unet_name, vae_name, te_name = names

    t0 = time.perf_counter()
    model = nodes.UNETLoader().load_unet(unet_name, "default")[0]
    # CLIPLoader(type="wan") is exactly comfy.sd.load_clip(...); the one addition is the config
    # override ComfyUI reads from model_options, for a narrower UMT5 than the stock XXL json.
    clip = env.sd.load_clip(ckpt_paths=[str(tmp / "text_encoders" / te_name)],
                            embedding_directory=env.folder_paths.get_folder_paths("embeddings"),
                            clip_type=env.sd.CLIPType.WAN, model_options={"umt5xxl_model_config": te_config})
    if sc.te_min_length is not None and hasattr(clip, "set_tokenizer_option"):
        clip.set_tokenizer_option("umt5xxl_min_length", sc.te_min_length)   # clones copy it
    vae = nodes.VAELoader().load_vae(vae_name)[0]
    result["timings"]["load_s"] = round(time.perf_counter() - t0, 2)
    result["model_sizes_comfy"] = {"dit": int(model.model_size()), "te": int(clip.patcher.model_size()),
                                   "vae": int(vae.patcher.model_size())}

    if dev.type == "cuda":
        budget = int((budget_gib if budget_gib is not None else sizes["dit"] / GIB + sc.budget_extra_gib) * GIB)
        result["budget_gib"] = round(budget / GIB, 3)
        if sizes["dit"] + sizes["te"] <= budget:
            result["notes"].append("DiT + text encoder fit together in this budget: phases need not evict")
    else:
        budget = None
        result["budget_gib"] = None
        result["notes"].append("CPU device: no VRAM budget (ComfyUI loads everything on a CPU device); the CPU "
                               "run checks the code path and bit-equality, not memory")
    t = sc.frames
    latent_shape = (1, 16, (t - 1) // 4 + 1, sc.height // 8, sc.width // 8)
    result["latent_shape"] = list(latent_shape)

    def default_flow():
        return model, clip, vae, None

    def phase_flow():
        m, c, v, group, _ = bridge.apply(model, clip, vae, bridge.PhaseSettings())
        state["phase_outputs"] = (m, c, v)
        return m, c, v, group

    state: dict[str, Any] = {}
    images = default_then_phase(env, bridge, sc, dev, clock, budget, default_flow, phase_flow, latent_shape, "",
                                result, lambda: state.get("phase_outputs", ()))

    if clock.left() > 20:         # its own emulated card: a quarter of the DiT fits
        result["group_prefetch"] = prefetch_in_comfy(env, sc, dev, clock, model, result)
    else:
        result["group_prefetch"] = {"status": "skipped", "reason": f"{clock.left():.0f} s left of the deadline"}

    # last: the GroupPrefetch cases above are what issue #5 still needs measured
    if clock.left() > 30:
        result["experts"] = two_experts(env, bridge, sc, dev, clock, budget, model, clip, vae, latent_shape, unet_name)
    else:
        result["experts"] = {"status": "skipped", "reason": f"{clock.left():.0f} s left of the deadline"}

    d, p = result["default"] or {}, result["phase_offload"] or {}
    if d.get("total_s") and p.get("total_s"):
        result["ratio_total_time"] = round(p["total_s"] / d["total_s"], 4)
    if images.get("default") is not None and images.get("phase") is not None:
        result["bit_identical"], result["max_abs_diff"] = _same_bits(images["default"], images["phase"])
    result["summary"] = summarize(result)
    if d.get("status") == "ok" and p.get("status") == "ok":
        result["reason"] = None
        return "ok"
    result["reason"] = "; ".join(f"{n}: {r.get('status')} ({r.get('reason')})" for n, r in
                                 (("default", d), ("phase_offload", p)) if r.get("status") != "ok") or "flow missing"
    return "partial"


def default_then_phase(env, bridge, sc: Scale, dev: torch.device, clock: Clock, budget: int | None, default_flow,
                       phase_flow, latent_shape, label: str, into: dict[str, Any],
                       phase_outputs: Callable[[], Any]) -> dict[str, torch.Tensor | None]:
    """ComfyUI's default flow, then the PhaseOffload flow, on one emulated card, each from an empty card; their
    records go into ``into["default"]`` / ``into["phase_offload"]``, the phase outputs lose PhaseOffload after.
    Returns the images of each ("default", "phase")."""
    images: dict[str, torch.Tensor | None] = {}
    with emulated_card(env.mm, dev, budget):
        try:
            _unload_all(env, dev)
            into["default"], images["default"] = run_flow(env, sc, dev, clock, f"{label}default", default_flow,
                                                          latent_shape, phase_flow=False)
            _unload_all(env, dev)
            if into["default"]["status"] in ("ok", "oom", "error"):
                clock.need(max(5.0, 1.5 * (into["default"].get("warmup_total_s") or 0)
                               + 1.5 * (into["default"].get("total_s") or 0)), f"{label}PhaseOffload flow")
                into["phase_offload"], images["phase"] = run_flow(env, sc, dev, clock, f"{label}phase_offload",
                                                                  phase_flow, latent_shape, phase_flow=True)
        finally:
            _unload_all(env, dev)
            for p in phase_outputs():
                if p is not None:
                    with contextlib.suppress(Exception):
                        bridge.remove_phase_offload(p if not hasattr(p, "patcher") else p.patcher)
    return images


def _same_bits(a: torch.Tensor | None, b: torch.Tensor | None) -> tuple[bool | None, float | None]:
    """(bitwise equal, max abs difference) of two outputs; NaNs (random weights) compare equal bit for bit."""
    if a is None or b is None:
        return None, None
    same = a.shape == b.shape and a.dtype == b.dtype
    equal = bool(same and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))
    return equal, (float((a.float() - b.float()).nan_to_num(0.0).abs().max()) if same else None)


def two_experts(env, bridge, sc: Scale, dev: torch.device, clock: Clock, budget: int | None, model, clip, vae,
                latent_shape, unet_name: str) -> dict[str, Any]:
    """Wan 2.2 A14B's recipe on the same emulated card: a second expert (the same file loaded again: another model
    of the same size) samples the second half of the steps. ComfyUI's default flow against PhaseOffload with
    ``model_2``; ComfyUI unloads the expert it needs room from (a device->host copy), PhaseOffload swaps it back
    to its host master (0 bytes). Never raises: a failure is the record's status."""
    out: dict[str, Any] = {"status": "running"}
    phase_outputs: list = []
    try:
        model_2 = env.nodes.UNETLoader().load_unet(unet_name, "default")[0]

        def default_flow():
            return model, clip, vae, None, model_2

        def phase_flow():
            m, c, v, group, m2 = bridge.apply(model, clip, vae, bridge.PhaseSettings(), model_2=model_2)
            phase_outputs.extend((m, c, v, m2))
            return m, c, v, group, m2

        images = default_then_phase(env, bridge, sc, dev, clock, budget, default_flow, phase_flow, latent_shape,
                                    "experts ", out, lambda: phase_outputs)
        d, p = out.get("default") or {}, out.get("phase_offload") or {}
        if d.get("total_s") and p.get("total_s"):
            out["ratio_total_time"] = round(p["total_s"] / d["total_s"], 4)
        out["bit_identical"], out["max_abs_diff"] = _same_bits(images.get("default"), images.get("phase"))
        out["status"] = "ok" if d.get("status") == "ok" and p.get("status") == "ok" else "partial"
        _log(f"two experts: phase/default {out.get('ratio_total_time')}, bit-identical {out['bit_identical']}")
    except OutOfTime as exc:
        out.update(status="partial", reason=str(exc))
    except Exception as exc:  # noqa: BLE001 - the suite gets a record
        out.update(status="error", reason=_short(exc), traceback=traceback.format_exc()[-8000:])
    return out


def _levers_node(name: str):
    import_phase_bridge()                      # makes comfyui_levers importable from this checkout
    nodes_mod = importlib.import_module("comfyui_levers.nodes")
    return next(c for c in nodes_mod.NODE_CLASSES if c.__name__ == name)


def prefetch_in_comfy(env, sc: Scale, dev: torch.device, clock: Clock, model, result: dict[str, Any]) -> dict[str, Any]:
    """GroupPrefetch through its node inside ComfyUI against ComfyUI's own lowvram, DiT only (random conditioning,
    no text encoder or VAE): on a card that holds about a quarter of the DiT plus room for activations. Warm-up
    and measured sampling per flow at the workload's latent, bit-equality of the latents; then the same clone at
    a longer video (more activations, so the auto budget streams more: the placement the first run left must be
    undone) against ComfyUI at that size. On the CPU no card is emulated: the node gets an explicit budget of 75 % of
    the DiT, ComfyUI loads everything, and only the code path and bit-equality mean anything."""
    nodes, mm = env.nodes, env.mm
    out: dict[str, Any] = {"status": "running", "reason": None}
    dit = result["sizes"]["dit"]
    dtype = DTYPES[sc.dtype]
    g = torch.Generator().manual_seed(11)
    tokens = 512 if sc.name == "gpu" else 16
    pos = [[torch.randn(1, tokens, 4096, generator=g).to(dtype), {}]]
    neg = [[torch.randn(1, tokens, 4096, generator=g).to(dtype) * 0.1, {}]]
    t_a, t_b = (sc.frames - 1) // 4 + 1, (2 * sc.frames - 2) // 4 + 1
    shape_a = (1, 16, t_a, sc.height // 8, sc.width // 8)
    shape_b = (1, 16, t_b, sc.height // 8, sc.width // 8)
    card = int(0.25 * dit + 2.5 * GIB) if dev.type == "cuda" else None
    node_budget_gb = 0.0 if dev.type == "cuda" else round(0.75 * dit / GIB, 6)   # one resident block + slots
    out.update(card_gib=_gib(card), node_vram_budget_gb=node_budget_gb or "auto", latent_a=list(shape_a),
               latent_b=list(shape_b), text_tokens=tokens)

    def sample(m, shape):
        _sync(dev)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        t0 = time.perf_counter()
        lat = nodes.common_ksampler(m, 0, sc.steps, sc.cfg, "euler", "simple", pos, neg,
                                    {"samples": torch.zeros(shape)})[0]["samples"]
        _sync(dev)
        peak = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None
        return lat, round(time.perf_counter() - t0, 4), peak

    def same(a, b):
        return bool(_same_bits(a, b)[0])

    with emulated_card(mm, dev, card):
        try:
            clock.need(5, "GroupPrefetch in ComfyUI: ComfyUI lowvram warm-up")
            clone, state = _versus_comfy(env, dev, clock, model, node_budget_gb, shape_a, sample, same, out,
                                         "GroupPrefetch in ComfyUI")
            clock.need(3 * out["levers_s"] + 5, "GroupPrefetch in ComfyUI: the longer video")
            got_b, out["levers_b_s"], out["levers_b_peak_bytes"] = sample(clone, shape_b)   # same clone, no unload
            out["levers_b_report"] = state.last_report
            out["levers_b_unloaded_stale"] = "unloaded this model first" in (state.last_report or "")
            _unload_all(env, dev)
            ref_b, out["comfy_b_s"], out["comfy_b_peak_bytes"] = sample(model, shape_b)
            out["bit_identical_b"] = same(got_b, ref_b)
            out["status"] = "ok"
        except Exception as exc:  # noqa: BLE001 - a failed flow is a result, not a crash
            _record_failure(out, exc, "GroupPrefetch in ComfyUI")
        finally:
            _unload_all(env, dev)
    if out["status"] == "ok":
        out["fp8"] = _prefetch_fp8_in_comfy(env, dev, clock, model, node_budget_gb, card, shape_a, sample, same)
    out["gguf"] = _prefetch_gguf_in_comfy(env, dev, clock, model, shape_a, sample, same)
    return out


def _comfyui_gguf():
    """ComfyUI-GGUF (city96's custom node, not on PyPI) from $COMFYUI_GGUF_PATH, imported as ComfyUI imports a
    custom node; None with the reason when it or the ``gguf`` package is missing."""
    path = os.environ.get("COMFYUI_GGUF_PATH")
    if not path or not (Path(path) / "nodes.py").is_file():
        return None, "COMFYUI_GGUF_PATH does not point at a ComfyUI-GGUF checkout"
    if importlib.util.find_spec("gguf") is None:
        return None, "the gguf package is not installed"
    name = "levers_bench_comfyui_gguf"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, str(Path(path) / "__init__.py"),
                                                      submodule_search_locations=[str(path)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return types.SimpleNamespace(nodes=importlib.import_module(f"{name}.nodes"),
                                 ops=importlib.import_module(f"{name}.ops"), gguf=importlib.import_module("gguf")), None


def _q8_0(w: torch.Tensor) -> torch.Tensor:
    """GGML's Q8_0 blocks of a 2-D weight (rows of 32-value blocks, each an fp16 scale then 32 int8 codes), as the
    uint8 rows a GGUF file holds; computed on whatever device ``w`` is on."""
    rows, cols = w.shape
    x = w.float().reshape(rows, cols // 32, 32)
    d = x.abs().amax(-1, keepdim=True) / 127
    q = torch.where(d == 0, torch.zeros_like(x), x / d).round().clamp(-127, 127).to(torch.int8)
    blocks = torch.cat([d.to(torch.float16).view(torch.uint8), q.view(torch.uint8)], dim=-1)
    return blocks.reshape(rows, cols // 32 * 34)


def gguf_q8_model(env, gg, model, dev: torch.device):
    """``model``'s diffusion model as ComfyUI-GGUF loads a Q8_0 GGUF file of it: 2-D weights in Q8_0 (rows of whole
    32-value blocks), the rest F32, every tensor a GGMLTensor, through GGMLOps and GGUFModelPatcher (what Unet
    Loader (GGUF) does after reading the file)."""
    qt = gg.gguf.GGMLQuantizationType
    sd = {}
    with torch.no_grad():
        for key, t in model.model.diffusion_model.state_dict().items():
            if t.ndim == 2 and t.shape[1] % 32 == 0 and t.numel() >= 1024:
                data = _q8_0(t.to(dev) if dev.type == "cuda" else t).cpu()
                sd[key] = gg.ops.GGMLTensor(data, tensor_type=qt.Q8_0, tensor_shape=t.shape)
            else:
                sd[key] = gg.ops.GGMLTensor(t.float().cpu().contiguous(), tensor_type=qt.F32, tensor_shape=t.shape)
    base = env.sd.load_diffusion_model_state_dict(sd, model_options={"custom_operations": gg.ops.GGMLOps()})
    if base is None:
        raise RuntimeError("ComfyUI did not detect the GGUF state dict's architecture")
    return gg.nodes.GGUFModelPatcher.clone(base)


def _prefetch_gguf_in_comfy(env, dev, clock, model, shape, sample, same) -> dict[str, Any]:
    """The same DiT as a Q8_0 GGUF model loaded the way ComfyUI-GGUF loads one: ComfyUI (with ComfyUI-GGUF's
    per-layer dequantization) on a card that holds about a quarter of the Q8 weights plus the same room for
    activations, against GroupPrefetch streaming the packed Q8 bytes (about half of bf16) on that card."""
    out: dict[str, Any] = {"status": "running", "reason": None}
    try:
        gg, why = _comfyui_gguf()
        if gg is None:
            out.update(status="skipped", reason=why)
            return out
        from comfyui_levers.core.residency.blocks import module_bytes
        clock.need(20, "GroupPrefetch on a GGUF model: building the Q8_0 model")
        gmodel = gguf_q8_model(env, gg, model, dev)
        q8 = module_bytes(gmodel.model.diffusion_model)
        card = int(0.25 * q8 + 2.5 * GIB) if dev.type == "cuda" else None
        node_budget_gb = 0.0 if dev.type == "cuda" else round(0.75 * q8 / GIB, 6)
        out.update(q8_dit_gib=_gib(q8), card_gib=_gib(card), node_vram_budget_gb=node_budget_gb or "auto")
        with emulated_card(env.mm, dev, card):
            try:
                _versus_comfy(env, dev, clock, gmodel, node_budget_gb, shape, sample, same, out,
                              "GroupPrefetch on a GGUF Q8_0 model")
                out["status"] = "ok"
            finally:
                _unload_all(env, dev)
    except Exception as exc:  # noqa: BLE001 - a failed flow is a result, not a crash
        _record_failure(out, exc, "GroupPrefetch on a GGUF model")
    return out


def _versus_comfy(env, dev, clock, model, node_budget_gb, shape, sample, same, out: dict[str, Any], label: str,
                  resident=None):
    """ComfyUI samples ``model`` (warm-up, then timed), then the GroupPrefetch node's clone of it does the same;
    times, peaks, bit-equality and the engine's numbers go into ``out``. Returns (clone, its prefetch state).
    ``resident``: the output of ``model`` sampled fully loaded, when that, not ComfyUI's offloaded run, is the
    reference (fp8: an offloaded layer dequantizes, a resident or streamed one runs the fp8 GEMM)."""
    from comfyui_levers.bridge.prefetch import prefetch_state

    _unload_all(env, dev)
    sample(model, shape)
    ref, out["comfy_s"], out["comfy_peak_bytes"] = sample(model, shape)
    out["comfy_loaded_bytes"] = int(model.loaded_size())
    _unload_all(env, dev)
    clock.need(2 * out["comfy_s"] + 5, f"{label}: GroupPrefetch")
    clone, _ = _levers_node("LeversGroupPrefetch").execute(model, vram_budget_gb=node_budget_gb).args
    state = prefetch_state(clone)
    sample(clone, shape)
    got, out["levers_s"], out["levers_peak_bytes"] = sample(clone, shape)
    out["bit_identical"] = same(got, ref)
    if resident is not None:
        out["bit_identical_vs_comfy"] = out["bit_identical"]
        out["bit_identical"] = same(got, resident)
        out["comfy_bit_identical_vs_resident"] = same(ref, resident)
    out["ratio_time"] = round(out["levers_s"] / out["comfy_s"], 4) if out["comfy_s"] else None
    out["levers_stats"] = {k: v for k, v in (state.last_stats or {}).items() if not isinstance(v, (dict, list))}
    out["levers_last_forward"] = (state.last_stats or {}).get("last_forward")
    out["levers_report"] = state.last_report
    _log(f"{label}: {out['levers_s']:.2f}s vs ComfyUI {out['comfy_s']:.2f}s per sampling (ratio "
         f"{out['ratio_time']}), bit-identical {out['bit_identical']}")
    return clone, state


def _record_failure(out: dict[str, Any], exc: Exception, label: str) -> None:
    """A flow that ran out of the suite's time is partial; any other failure is its result (oom or error)."""
    if isinstance(exc, OutOfTime):
        out.update(status="partial", reason=str(exc))
        return
    out.update(status="oom" if _is_oom(exc) else "error", reason=_short(exc), traceback=traceback.format_exc()[-8000:])
    _log(f"{label}: {out['status']}: {_short(exc, 300)}")


def _prefetch_fp8_in_comfy(env, dev, clock, model, node_budget_gb, card, shape, sample,
                           same) -> dict[str, Any]:
    """The same DiT after QuantizeDiT fp8 (ComfyUI's QuantizedTensor layer where comfy-kitchen is installed, as
    fp8 checkpoints load in ComfyUI 0.8+): ComfyUI's lowvram against GroupPrefetch streaming the fp8 bytes, on
    the emulated ``card``. Bit-equality is checked against the fp8 model sampled fully loaded (no card): on a GPU
    ComfyUI's numerics depend on where it keeps each fp8 layer, so its offloaded run is not the reference."""
    out: dict[str, Any] = {"status": "running"}
    try:
        clock.need(15, "GroupPrefetch in ComfyUI, fp8: quantize")
        qmodel, qreport = _levers_node("LeversQuantizeDiT").execute(model, format="fp8_e4m3fn",
                                                                    quality_check=False).args[:2]
        out["layers"] = next((ln.split("layers:", 1)[1].strip() for ln in qreport.splitlines() if "layers:" in ln),
                             "Levers QuantLinear")
        if node_budget_gb:          # the CPU's explicit budget: 75 % of the fp8 DiT, so that it streams
            from comfyui_levers.core.residency.blocks import module_bytes
            node_budget_gb = round(0.75 * module_bytes(qmodel.model.diffusion_model) / GIB, 6)
        clock.need(10, "GroupPrefetch in ComfyUI, fp8: the resident reference")
        resident = sample(qmodel, shape)[0]
        _unload_all(env, dev)
        with emulated_card(env.mm, dev, card):
            _versus_comfy(env, dev, clock, qmodel, node_budget_gb, shape, sample, same, out,
                          f"GroupPrefetch in ComfyUI, fp8 ({out['layers']})", resident=resident)
        out["status"] = "ok"
    except Exception as exc:  # noqa: BLE001 - a failed flow is a result, not a crash
        _record_failure(out, exc, "GroupPrefetch in ComfyUI, fp8")
    finally:
        _unload_all(env, dev)
    return out


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """The few numbers a table needs, GiB and seconds, from both flows' records."""
    d, p = result.get("default") or {}, result.get("phase_offload") or {}
    out: dict[str, Any] = {"default_total_s": d.get("total_s"), "phase_offload_total_s": p.get("total_s"),
                           "ratio_total_time": result.get("ratio_total_time"),
                           "bit_identical": result.get("bit_identical"), "budget_gib": result.get("budget_gib"),
                           "phases": {}}
    for flow, key in ((d, "default"), (p, "phase_offload")):
        b = flow.get("bytes") or {}
        for k in ("h2d_bytes", "d2h_bytes", "swapped_bytes", "lowvram_streamed_estimate_bytes"):
            if k in b:
                out[f"{key}_{k.replace('_bytes', '_gib')}"] = _gib(b[k])
        for ph, rec in (flow.get("phases") or {}).items():
            row = out["phases"].setdefault(ph, {})
            row[f"{key}_s"] = rec.get("seconds")
            row[f"{key}_peak_gib"] = _gib(rec.get("peak_allocated_bytes"))
            row[f"{key}_peak_after_release_gib"] = _gib(rec.get("peak_after_release_bytes"))
    for ph, row in out["phases"].items():
        _log(f"  {ph:7s} " + ", ".join(f"{k}={v}" for k, v in row.items()))
    ex = result.get("experts") or {}
    if ex:
        ed, ep = ex.get("default") or {}, ex.get("phase_offload") or {}
        out["experts"] = {"status": ex.get("status"), "default_total_s": ed.get("total_s"),
                          "phase_offload_total_s": ep.get("total_s"), "ratio_total_time": ex.get("ratio_total_time"),
                          "bit_identical": ex.get("bit_identical"),
                          "default_d2h_gib": _gib((ed.get("bytes") or {}).get("d2h_bytes")),
                          "phase_offload_d2h_gib": _gib((ep.get("bytes") or {}).get("d2h_bytes")),
                          "phase_offload_swapped_gib": _gib((ep.get("bytes") or {}).get("swapped_bytes"))}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--comfyui", default=os.environ.get("COMFYUI_PATH"), help="ComfyUI checkout (default $COMFYUI_PATH)")
    ap.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--scale", default="gpu" if torch.cuda.is_available() else "cpu", choices=sorted(SCALES))
    ap.add_argument("--budget-gib", type=float, default=None, help="emulated VRAM budget (default: DiT + the scale's margin)")
    ap.add_argument("--deadline", type=float, default=150.0, help="seconds for the whole benchmark")
    ap.add_argument("--out", default=None, help="folder for comfy_phase.json")
    a = ap.parse_args(argv)
    if not a.comfyui:
        print(json.dumps({"status": "skipped", "reason": "no --comfyui PATH and no $COMFYUI_PATH"}))
        return 2
    res = run_phase_bench(a.comfyui, a.device, a.budget_gib, a.scale, a.deadline, a.out)
    print(json.dumps(res, indent=2, default=str))
    return 0 if res["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
