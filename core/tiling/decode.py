"""Decode a latent whole, in temporal chunks, or in seamless spatial tiles.

The spatial method splits the decoder at a *boundary* module into a stem and a tail:

* the **stem** (everything up to the boundary: the low-resolution stages with the attention
  block and the GroupNorms whose statistics span the whole image) runs once on the whole latent,
  exactly as in the untiled decode;
* the **tail** (the high-resolution stages, convolutions and per-pixel ops) runs per tile on a
  crop of the stem output with a margin of context. Its GroupNorms normalise with statistics
  gathered for the whole image by a layer-synchronous pass over windows spread across it
  (``GroupNormPatch.pooled``), not with the tile's own.

With that, the tail is a local function of the stem output, so a tile whose context covers the
tail's receptive field computes exactly the untiled pixels; overlaps are blended with weights
that sum to 1 over the band where both tiles are exact. Decoders without GroupNorm in the tail
(Wan 2.1) are exact; with GroupNorm (SD/SDXL/Flux KL) the only difference is the sampled
statistics, which are exact when ``stats_fraction`` is 1.

Causal video decoders (Wan) keep a feature cache from one frame to the next. Temporal chunks
carry that cache (``persistent_cache``), so chunking in time is the same computation; spatial
tiles run tile-major: each tile decodes all its frames with its own cache.

Nothing here imports ComfyUI: the bridge names the modules and supplies ``run`` (the model's own
``decode``), so the same code serves any decoder with this shape, including the toy ones in tests.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from ..errors import ConfigError
from .layout import make_grid
from .overrides import GroupNormPatch, GroupNormStats, StopDecode, find_group_norms, override_forwards, \
    pass_through, persistent_cache
from .plan import TilePlan

Progress = Callable[[int, int], None]
Interrupt = Callable[[], None]


@dataclass
class StagedDecoder:
    """A decoder described well enough to tile it.

    run: the model's own decode, latent -> pixels ([B, C, H, W] -> [B, 3, H*s, W*s], or 5-D).
    stem: modules that run before ``boundary`` (skipped in tile runs). boundary: the module whose
    output is the stem output. tail: modules after it (skipped in the stem run).
    cache_module / cache_kwarg / new_cache: for a causal video decoder, the module that receives
    the feature cache as a keyword argument and a factory for an empty cache.
    first_call_kwarg: a flag ``run`` passes to ``cache_module`` on its first call only (Wan 2.2's
    ``first_chunk``); chunked runs set it on the first call of the video, not of each chunk.
    stand_ins: for stem modules whose tile-run stand-in is not a plain pass-through (a module that
    receives its input already padded by the caller must undo that padding on the stand-in latent).
    stream_module / own_chunk_frames: for a video decoder whose ``run`` already walks the frames in
    chunks of its own, carrying its causal state between them (ComfyUI's HunyuanVideo and 0.33 Wan
    decoders): a module called once per chunk with that chunk's output frames, and the latent frames
    one steady-state chunk covers. Its exact temporal chunks are those calls (``decode_streamed``).
    stem_run_stand_ins: for tail modules, what they do in the stem run instead of passing their input
    through (a decoder whose head cannot take the stem output: end the run early with ``StopDecode``, or
    return no frames so a chunked decoder skips the rest of each chunk).
    whole_frames: a video decoder that is not causal (LTX): every tile run decodes all frames at once, so the
    boundary's stand-in returns all stem frames (the stand-in latent cannot carry frame indices through it).
    time_decoder / time_units: for such a decoder, the module ``run`` calls with the whole latent and the time
    units it chains (``stream.py``): its exact temporal chunks stream each unit's context instead.
    """

    run: Callable[[torch.Tensor], torch.Tensor]
    stem: list[nn.Module]
    boundary: nn.Module
    tail: list[nn.Module]
    cache_module: nn.Module | None = None
    cache_kwarg: str = "feat_cache"
    new_cache: Callable[[], list] | None = None
    first_call_kwarg: str | None = None
    tail_norms: list[nn.GroupNorm] = field(default_factory=list)
    stand_ins: dict = field(default_factory=dict)
    stream_module: nn.Module | None = None
    own_chunk_frames: int = 0
    stem_run_stand_ins: dict = field(default_factory=dict)
    whole_frames: bool = False
    time_decoder: nn.Module | None = None
    time_units: list[nn.Module] = field(default_factory=list)

    def __post_init__(self):
        if not self.tail_norms:
            self.tail_norms = find_group_norms(self.tail)

    @property
    def causal(self) -> bool:
        return self.cache_module is not None

    @property
    def streamed(self) -> bool:
        """True when the decoder chunks time itself (see ``stream_module``)."""
        return self.stream_module is not None


@dataclass
class DecodeStats:
    """What a decode did, for the report."""

    tiles: int = 0
    chunks: int = 0
    stem_shape: tuple[int, ...] = ()
    stats_fraction: float = 0.0
    halo_px: float = 0.0
    notes: list[str] = field(default_factory=list)
    phase_s: dict[str, float] = field(default_factory=dict)   # wall seconds per phase: stem, stats, tiles

    def clock(self, phase: str, since: float, device: torch.device) -> float:
        """Add the seconds since ``since`` to ``phase`` (after the device finished its queued work)."""
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        now = time.perf_counter()
        self.phase_s[phase] = self.phase_s.get(phase, 0.0) + now - since
        return now


def _frames_dummy(latent: torch.Tensor, frames: slice | None = None) -> torch.Tensor:
    """A stand-in latent for tile runs: [B, 1, (T,) 1, 1]; for video its values are frame indices."""
    b = latent.shape[0]
    if latent.ndim == 5:
        t = latent.shape[2]
        idx = torch.arange(t, dtype=torch.float32, device=latent.device)
        d = idx.reshape(1, 1, t, 1, 1).expand(b, latent.shape[1], t, 1, 1).contiguous()
        return d if frames is None else d[:, :, frames]
    return torch.zeros(b, latent.shape[1], 1, 1, dtype=latent.dtype, device=latent.device)


class _StemProvider:
    """The boundary module's stand-in: returns the crop of the stored stem output for the current tile."""

    def __init__(self, stem_out: torch.Tensor, whole_frames: bool = False):
        self.stem_out = stem_out           # [B, C, (T,) Hs, Ws]
        self.whole_frames = whole_frames
        self.batch = slice(None)
        self.rows = slice(None)
        self.cols = slice(None)
        self.windows: torch.Tensor | None = None   # a prepared batch of windows (stats pass, probes)

    def __call__(self, x, *args, **kwargs):
        if self.windows is not None:
            src = self.windows
        else:
            src = self.stem_out[self.batch][..., self.rows, self.cols]
        if src.ndim == 5 and not self.whole_frames:
            # the stand-in latent carries frame indices through the skipped stem modules
            frames = x[0, 0, :, 0, 0].round().long()
            src = src[:, :, int(frames[0]):int(frames[-1]) + 1]
        return src


def run_stem(staged: StagedDecoder, latent: torch.Tensor) -> torch.Tensor:
    """Run the decoder whole with the tail skipped; return the boundary's output ([B, C, (T,) Hs, Ws]).

    A causal decoder calls the boundary once per frame chunk; the captured pieces are joined in time.
    """
    captured: list[torch.Tensor] = []
    original = staged.boundary.forward

    def capture(*args, **kwargs):
        out = original(*args, **kwargs)
        captured.append(out)
        return out

    repl = {m: pass_through for m in staged.tail}
    repl.update(staged.stem_run_stand_ins)
    repl[staged.boundary] = capture
    with torch.inference_mode(), override_forwards(repl):
        try:
            staged.run(latent)
        except StopDecode:
            pass
    if not captured:
        raise RuntimeError("the boundary module never ran: the decoder does not match the staged description")
    return captured[0] if len(captured) == 1 else torch.cat(captured, dim=2)


class _TailRunner:
    """Runs the tail on stem windows with the stem skipped and the tail GroupNorms patched."""

    def __init__(self, staged: StagedDecoder, stem_out: torch.Tensor):
        self.staged = staged
        self.provider = _StemProvider(stem_out, staged.whole_frames)
        self.norms = GroupNormPatch(staged.tail_norms)

    def replacements(self) -> dict:
        repl = {m: self.staged.stand_ins.get(m, pass_through) for m in self.staged.stem}
        repl[self.staged.boundary] = self.provider
        repl.update(self.norms.replacements())
        return repl

    def run(self, dummy: torch.Tensor, cache: list | None = None) -> torch.Tensor:
        self.norms.reset()
        if cache is not None and self.staged.cache_module is not None:
            with persistent_cache(self.staged.cache_module, self.staged.cache_kwarg, cache,
                                  self.staged.first_call_kwarg):
                return self.staged.run(dummy)
        return self.staged.run(dummy)


def _window_plan(hs: int, ws: int, halo: int, fraction: float, max_px: int | None) -> list[tuple[int, int, int, int]]:
    """Windows (y0, x0, size_h, size_w) in stem px for the statistics pass: a 2x2 (or 1) grid of equal
    windows centred in their cells, whose cores cover about ``fraction`` of the image."""
    g = 2 if min(hs, ws) >= 8 * max(1, halo) else 1
    core = math.sqrt(fraction * hs * ws / (g * g))
    size = int(math.ceil(core)) + 2 * halo
    if max_px is not None:
        size = min(size, max(2 * halo + 2, int(math.sqrt(max_px / (g * g)))))
    sh, sw = min(size, hs), min(size, ws)
    out = []
    for i in range(g):
        for j in range(g):
            cy, cx = (i + 0.5) * hs / g, (j + 0.5) * ws / g
            y0 = int(min(max(0, round(cy - sh / 2)), hs - sh))
            x0 = int(min(max(0, round(cx - sw / 2)), ws - sw))
            out.append((y0, x0, sh, sw))
    return out


def collect_tail_stats(staged: StagedDecoder, stem_out: torch.Tensor, halo_stem_px: int, fraction: float,
                       max_px: int | None = None) -> tuple[GroupNormStats, float]:
    """Whole-image statistics for the tail's GroupNorms, from one layer-synchronous pass.

    ``fraction`` >= 1 runs the tail once on the whole stem output: exact statistics (and the
    memory of an untiled tail). Below 1, windows spread over the image are run as one batch;
    each GroupNorm pools the sums of every window's interior (pixels at least ``halo_stem_px``
    from a window edge that is not the image edge, so only exactly-computed pixels count) and
    normalises all windows with the pooled values. Returns (stats, fraction of pixels counted).
    """
    runner = _TailRunner(staged, stem_out)
    if not staged.tail_norms:
        return GroupNormStats(), 1.0
    if fraction >= 1.0:
        dummy = (_frames_dummy(stem_out[:, :1, ..., :1, :1]) if stem_out.ndim == 5 else
                 torch.zeros(stem_out.shape[0], 1, 1, 1, device=stem_out.device, dtype=stem_out.dtype))
        runner.norms.pooled(1, None)
        with torch.inference_mode(), override_forwards(runner.replacements()):
            runner.provider.windows = stem_out
            runner.run(dummy)
        return runner.norms.recorded, 1.0
    if stem_out.ndim != 4:
        raise ConfigError("groupnorm_stats", "windows", "tiles or exact for a video VAE",
                          "Window statistics sample single images; video tiles pool their statistics over all "
                          "tiles instead (the default).")
    b, c, hs, ws = stem_out.shape
    wins = _window_plan(hs, ws, halo_stem_px, fraction, max_px)
    k = len(wins)
    crops, masks = [], []
    for bi in range(b):
        for (y0, x0, sh, sw) in wins:
            crops.append(stem_out[bi:bi + 1, :, y0:y0 + sh, x0:x0 + sw])
            m = torch.zeros(1, 1, sh, sw, device=stem_out.device)
            top = 0 if y0 == 0 else halo_stem_px
            left = 0 if x0 == 0 else halo_stem_px
            bottom = sh if y0 + sh == hs else sh - halo_stem_px
            right = sw if x0 + sw == ws else sw - halo_stem_px
            m[..., top:max(top + 1, bottom), left:max(left + 1, right)] = 1.0
            masks.append(m)
    windows = torch.cat(crops, 0)                                   # [B*K, C, Sh, Sw]
    mask = torch.cat(masks, 0)                                      # [B*K, 1, Sh, Sw]
    counted = float(mask[:k].sum()) / (hs * ws)
    runner.norms.pooled(k, mask)
    runner.provider.windows = windows
    dummy = torch.zeros(b * k, 1, 1, 1, device=stem_out.device, dtype=stem_out.dtype)
    with torch.inference_mode(), override_forwards(runner.replacements()):
        runner.run(dummy)
    return runner.norms.recorded, min(1.0, counted)


def measure_halo(staged: StagedDecoder, stem_out: torch.Tensor, out_per_stem: int, probe: int = 24) -> float:
    """The tail's receptive-field radius in output px, found by perturbing one stem pixel.

    With the tail's GroupNorm statistics frozen the tail is local, so the pixels that change are
    exactly those the perturbed stem pixel can reach. The probe window grows until the change stays
    inside it.
    """
    hs, ws = stem_out.shape[-2:]
    # the window grows along each axis on its own: on a thin frame (a panorama) the short side stops it early,
    # while the long side, where tiles cut, still needs the whole reach (a square window clipped it there)
    sy, sx = min(probe, hs), min(probe, ws)
    while True:
        y0, x0 = (hs - sy) // 2, (ws - sx) // 2
        win = stem_out[:1, ..., y0:y0 + sy, x0:x0 + sx].clone()
        runner = _TailRunner(staged, stem_out)
        cy, cx = sy // 2, sx // 2
        dummy = (_frames_dummy(torch.zeros(1, 1, win.shape[2], 1, 1, device=win.device))
                 if win.ndim == 5 else torch.zeros(1, 1, 1, 1, device=win.device, dtype=win.dtype))
        with torch.inference_mode(), override_forwards(runner.replacements()):
            runner.norms.pooled(1, None)
            runner.provider.windows = win
            cache = staged.new_cache() if staged.causal else None
            base = runner.run(dummy, cache).float()
            stats = runner.norms.recorded
            runner.norms.frozen(stats)
            bumped = win.clone()
            bumped[..., cy, cx] += 1.0
            runner.provider.windows = bumped
            cache = staged.new_cache() if staged.causal else None
            moved = runner.run(dummy, cache).float()
        diff = (moved - base).abs()
        diff = diff.amax(dim=tuple(range(diff.ndim - 2)))          # [H_out, W_out]
        tol = 1e-6 * float(diff.max().clamp_min(1e-30))
        ys, xs = torch.nonzero(diff > tol, as_tuple=True)
        if len(ys) == 0:
            return 0.0
        lo_y, hi_y = cy * out_per_stem, (cy + 1) * out_per_stem
        lo_x, hi_x = cx * out_per_stem, (cx + 1) * out_per_stem
        radius = max(lo_y - int(ys.min()), int(ys.max()) + 1 - hi_y, lo_x - int(xs.min()), int(xs.max()) + 1 - hi_x, 0)
        grow_y = (int(ys.min()) == 0 or int(ys.max()) == diff.shape[0] - 1) and sy < hs
        grow_x = (int(xs.min()) == 0 or int(xs.max()) == diff.shape[1] - 1) and sx < ws
        if not grow_y and not grow_x:
            return float(radius)
        sy, sx = (min(2 * sy, hs) if grow_y else sy), (min(2 * sx, ws) if grow_x else sx)


def _emit(progress: Progress | None, done: int, total: int) -> None:
    if progress is not None:
        progress(done, total)


def decode_whole(run: Callable[[torch.Tensor], torch.Tensor], latent: torch.Tensor, batch_per_pass: int,
                 output_device: torch.device | str = "cpu", progress: Progress | None = None,
                 interrupt: Interrupt | None = None) -> torch.Tensor:
    """The model's own decode, ``batch_per_pass`` samples at a time; output float32 on ``output_device``."""
    outs = []
    n = latent.shape[0]
    steps = math.ceil(n / batch_per_pass)
    for i, s in enumerate(range(0, n, batch_per_pass)):
        if interrupt is not None:
            interrupt()
        with torch.inference_mode():
            outs.append(run(latent[s:s + batch_per_pass]).to(output_device, torch.float32))
        _emit(progress, i + 1, steps)
    return torch.cat(outs, 0)


def decode_temporal(staged: StagedDecoder, latent: torch.Tensor, chunk_frames: int,
                    output_device: torch.device | str = "cpu", progress: Progress | None = None,
                    interrupt: Interrupt | None = None) -> torch.Tensor:
    """Decode a causal video latent [B, C, T, H, W] ``chunk_frames`` latent frames at a time.

    One feature cache per sample is carried from chunk to chunk, so each chunk continues the
    computation where the previous one stopped; each chunk's frames leave the device at once.
    """
    if not staged.causal:
        raise ConfigError("vae", "a decoder without a causal feature cache", "a causal video VAE",
                          "Temporal chunks are exact only for causal video VAEs (Wan 2.1).")
    b, _, t = latent.shape[:3]
    chunks = list(range(0, t, chunk_frames))
    total, done = b * len(chunks), 0
    per_sample = []
    for bi in range(b):
        cache = staged.new_cache()
        pieces = []
        for s in chunks:
            if interrupt is not None:
                interrupt()
            with torch.inference_mode(), persistent_cache(staged.cache_module, staged.cache_kwarg, cache,
                                                          staged.first_call_kwarg):
                pieces.append(staged.run(latent[bi:bi + 1, :, s:s + chunk_frames]).to(output_device, torch.float32))
            done += 1
            _emit(progress, done, total)
        per_sample.append(torch.cat(pieces, 2))
    return torch.cat(per_sample, 0)


def decode_streamed(run: Callable[[torch.Tensor], torch.Tensor], call_module: nn.Module, latent: torch.Tensor,
                    output_device: torch.device | str = "cpu", progress: Progress | None = None,
                    interrupt: Interrupt | None = None, total_frames: int | None = None) -> torch.Tensor:
    """The model's own decode, one sample at a time, with each call of ``call_module`` leaving the device.

    For a causal video decoder whose ``decode`` already walks the frames in chunks of its own
    choosing and carries the feature cache between them (ComfyUI 0.33's Wan 2.1: the first latent
    frame, then pairs), the exact temporal chunks are those calls. Running ``decode`` unchanged keeps
    the chunk boundaries and the cache exactly the model's; what changes is that each call's frames
    (a tensor or a list of tensors, [B, C, T_call, H, W]) move to ``output_device`` as soon as the
    call returns, so the device holds one call's activations and frames, not the whole video.
    ``interrupt`` runs before each call; ``progress`` counts output frames of ``total_frames``.
    Returns float32 [B, C, T_out, H, W] on ``output_device``.
    """
    state = {"frames": 0}
    total = (total_frames or 0) * latent.shape[0]
    original = call_module.forward

    def move(t):
        return t.to(output_device) if isinstance(t, torch.Tensor) else t

    def forward(*args, **kwargs):
        if interrupt is not None:
            interrupt()
        out = original(*args, **kwargs)
        pieces = out if isinstance(out, (list, tuple)) else [out]
        state["frames"] += sum(p.shape[2] for p in pieces if isinstance(p, torch.Tensor) and p.ndim == 5)
        if total:
            _emit(progress, min(state["frames"], total), total)
        return type(out)(move(p) for p in out) if isinstance(out, (list, tuple)) else move(out)

    outs = []
    with torch.inference_mode(), override_forwards({call_module: forward}):
        for bi in range(latent.shape[0]):
            outs.append(run(latent[bi:bi + 1]).to(output_device, torch.float32))
    return torch.cat(outs, 0)


STATS_METHODS = ("tiles", "windows", "exact")


def decode_spatial(staged: StagedDecoder, latent: torch.Tensor, plan: TilePlan, *, out_scale: int,
                   stats: str = "tiles", stats_passes: int = 1, stats_fraction: float = 0.25,
                   halo_px: float | None = None,
                   output_device: torch.device | str = "cpu", progress: Progress | None = None,
                   interrupt: Interrupt | None = None, info: DecodeStats | None = None) -> torch.Tensor:
    """Decode in the plan's spatial tiles (and temporal chunks for causal video); one sample at a time.

    out_scale: output px per latent px. halo_px: the tail's receptive-field radius (measured when None).
    stats: where the tail's GroupNorm statistics come from (decoders without GroupNorm in the tail
    ignore it):
      * "tiles" (default): ``stats_passes`` extra passes over the tiles. The first normalises each
        tile with its own statistics, later ones with the previous pass's; every pass pools the
        statistics of all tiles weighted by their blend weights (each pixel counts once). Same
        memory as the decode, +1 tail per pass; the error shrinks with each pass.
      * "windows": one layer-synchronous pass over windows covering ``stats_fraction`` of the
        image (cheap; a sample, so less accurate).
      * "exact": the tail once on the whole image (exact, but the memory of an untiled tail).
    Returns float32 [B, C_out, (T_out,) H*s, W*s] on ``output_device``.
    """
    if plan.tile is None:
        raise ConfigError("plan", plan.mode, "a spatial plan with a tile size")
    if stats not in STATS_METHODS:
        raise ConfigError("stats", stats, " | ".join(STATS_METHODS))
    if isinstance(stats_passes, bool) or int(stats_passes) != stats_passes or stats_passes < 1:
        raise ConfigError("stats_passes", stats_passes, "an integer >= 1")
    info = info if info is not None else DecodeStats()
    b = latent.shape[0]
    h, w = latent.shape[-2:]
    grid = None
    outputs = []
    for bi in range(b):
        sample = latent[bi:bi + 1]
        t0 = time.perf_counter()
        stem_out = run_stem(staged, sample)                          # [1, C, (T,) Hs, Ws]
        t0 = info.clock("stem", t0, latent.device)
        stem_scale = stem_out.shape[-1] // w
        if stem_scale * w != stem_out.shape[-1] or stem_scale * h != stem_out.shape[-2]:
            raise RuntimeError(f"stem output {tuple(stem_out.shape)} is not an integer multiple of the latent "
                               f"{tuple(latent.shape)}")
        out_per_stem = out_scale // stem_scale
        if halo_px is None:
            halo_px = measure_halo(staged, stem_out, out_per_stem)
            t0 = info.clock("halo", t0, latent.device)
        halo_stem = int(math.ceil(halo_px / out_per_stem))
        info.stem_shape, info.halo_px = tuple(stem_out.shape), halo_px
        if grid is None:
            grid = make_grid(h, w, plan.tile, plan.overlap, out_scale, margin_px=halo_px)
            info.tiles = len(grid)
        runner = _TailRunner(staged, stem_out)
        if staged.tail_norms and stats == "tiles":
            norm_stats = _tiles_stats(runner, grid, sample, stem_scale, stats_passes, interrupt)
            info.stats_fraction = 1.0
        elif staged.tail_norms:
            tile_px = plan.tile[0] * plan.tile[1] * stem_scale * stem_scale
            frac = 1.0 if stats == "exact" else stats_fraction
            norm_stats, info.stats_fraction = collect_tail_stats(staged, stem_out, halo_stem, frac, max_px=tile_px)
        else:
            norm_stats = GroupNormStats()
        t0 = info.clock("stats", t0, latent.device)
        runner.norms.frozen(norm_stats)
        canvas = None
        total = b * len(grid)
        with torch.inference_mode(), override_forwards(runner.replacements()):
            for k, (rs, cs, wt) in enumerate(grid):
                if interrupt is not None:
                    interrupt()
                runner.provider.rows = slice(rs.start * stem_scale, rs.stop * stem_scale)
                runner.provider.cols = slice(cs.start * stem_scale, cs.stop * stem_scale)
                if staged.causal:
                    piece = _run_tile_causal(runner, staged, sample, plan.chunk_frames or 1, output_device)
                else:
                    piece = runner.run(_frames_dummy(sample)).to(output_device, torch.float32)
                if canvas is None:
                    shape = piece.shape[:-2] + (h * out_scale, w * out_scale)
                    canvas = torch.zeros(shape, dtype=torch.float32, device=output_device)
                ys, xs = slice(rs.start * out_scale, rs.stop * out_scale), slice(cs.start * out_scale, cs.stop * out_scale)
                canvas[..., ys, xs] += piece * wt.to(device=output_device, dtype=torch.float32)
                _emit(progress, bi * len(grid) + k + 1, total)
        info.clock("tiles", t0, latent.device)
        del stem_out, runner
        outputs.append(canvas)
    return torch.cat(outputs, 0)


def _tiles_stats(runner: _TailRunner, grid, sample: torch.Tensor, stem_scale: int, passes: int,
                 interrupt: Interrupt | None) -> GroupNormStats:
    """Pool the tail's GroupNorm statistics over all tiles, ``passes`` times (see decode_spatial)."""
    base = None
    with torch.inference_mode(), override_forwards(runner.replacements()):
        for _ in range(passes):
            runner.norms.accumulate(base)
            for rs, cs, wt in grid:
                if interrupt is not None:
                    interrupt()
                runner.provider.rows = slice(rs.start * stem_scale, rs.stop * stem_scale)
                runner.provider.cols = slice(cs.start * stem_scale, cs.stop * stem_scale)
                runner.norms.weights(wt.to(device=sample.device, dtype=torch.float32)[None, None])
                runner.run(_frames_dummy(sample))
            base = runner.norms.totals()
    return base


def _run_tile_causal(runner: _TailRunner, staged: StagedDecoder, sample: torch.Tensor, chunk: int,
                     output_device) -> torch.Tensor:
    """All frames of one tile, chunk by chunk, with the tile's own feature cache."""
    t = sample.shape[2]
    cache = staged.new_cache()
    dummy = _frames_dummy(sample)
    pieces = []
    for s in range(0, t, chunk):
        pieces.append(runner.run(dummy[:, :, s:s + chunk], cache).to(output_device, torch.float32))
    return torch.cat(pieces, 2)
