"""Pick how to decode: whole, in temporal chunks, or in spatial tiles, from measured costs and a budget."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ..errors import BudgetExceeded, ConfigError

GIB = 1024 ** 3


@dataclass(frozen=True)
class DecodeCost:
    """Measured memory costs of one VAE's decode, in bytes per output pixel of one frame.

    For an image VAE a "frame" is the image. For a causal video VAE the per-pixel costs are
    those of decoding one temporal chunk (the feature cache included), and the whole-decode
    path also holds every output frame on the device (``output_bytes_per_px`` per frame).
    """

    whole_bytes_per_px: float          # the model's own decode, per output pixel (per frame for video)
    tile_bytes_per_px: float           # the tail on one tile window, per output pixel of the window
    stem_bytes_per_px: float = 0.0     # the whole-image stem pass, per output pixel
    stored_bytes_per_px: float = 0.0   # stem output kept while tiles run, per output pixel (per latent frame)
    output_bytes_per_px: float = 0.0   # decoded frames accumulated on the device by the whole path, per frame
    layered_bytes_per_px: float = 0.0  # the layered decode (tail modules in row bands), per output px; 0 = n/a
    # a decoder streamed through time (not causal: each time unit keeps its own context, stream.py): one chunk
    # costs base + per latent frame of the chunk, per output px of a frame; 0 = chunks cost like the whole decode
    stream_base_bytes_per_px: float = 0.0
    stream_frame_bytes_per_px: float = 0.0
    method: str = ""                   # how the numbers were measured


@dataclass(frozen=True)
class TilePlan:
    """What the decode will do. Tile sizes and overlaps are in latent units."""

    mode: str                          # "whole" | "layered" | "temporal" | "spatial" | "comfy_tiled" (fallback)
    batch_per_pass: int
    tile: tuple[int, int] | None
    overlap: int
    chunk_frames: int | None           # latent frames per temporal chunk (video); None = all at once
    predicted_peak_bytes: int
    budget_bytes: int
    reason: str
    exact: bool = True                 # True when theory says the result equals the untiled decode
    work_ratio: float = 1.0            # tail pixels computed (overlaps included) / pixels of the image

    def describe(self, scale: int) -> str:
        parts = [f"mode={self.mode}", f"batch/pass={self.batch_per_pass}"]
        if self.tile:
            parts.append(f"tile={self.tile[0] * scale}x{self.tile[1] * scale}px overlap={self.overlap * scale}px")
            if self.mode == "spatial":
                parts.append(f"tail work={self.work_ratio:.2f}x of untiled")
        if self.chunk_frames:
            parts.append(f"chunk={self.chunk_frames} latent frame(s)")
        parts.append(f"predicted peak={self.predicted_peak_bytes / GIB:.3f} GiB of budget "
                     f"{self.budget_bytes / GIB:.3f} GiB")
        return ", ".join(parts)


def _check_int(name: str, value, minimum: int) -> int:
    if value is None or isinstance(value, bool) or int(value) != value or int(value) < minimum:
        raise ConfigError(name, value, f"an integer >= {minimum}")
    return int(value)


def plan_decode(latent_shape: tuple[int, ...], scale: int, cost: DecodeCost, budget_bytes: int, *,
                halo_px: float = 0.0, tile: int | None = None, overlap: int | None = None,
                chunk_frames: int | None = None, align: int = 1, spatial_supported: bool = True,
                temporal_supported: bool = False, out_frames: int | None = None,
                auto_chunk_frames: int = 1, tile_out_frames: int = 0, kept_output_bytes: int = 0) -> TilePlan:
    """Choose the cheapest decode that fits ``budget_bytes``.

    latent_shape: [B, C, H, W] or [B, C, T, H, W]. scale: output px per latent px.
    halo_px: the tail's receptive-field radius in output px (context a tile needs to be exact).
    tile / overlap: user sizes in latent units (None = auto). chunk_frames: latent frames per
    temporal chunk (None = auto: ``auto_chunk_frames``, the smallest chunk the decoder can run
    exactly; for a decoder streamed through time, the longest chunk that fits). out_frames: decoded
    frames for a video latent (None = T). tile_out_frames: output frames a video tile keeps on the
    device until it ends (a decoder that runs all frames of a tile in one call). kept_output_bytes: the finished
    output when it stays on the decode's device (ComfyUI's output device is that device: --gpu-only, --cpu-vae):
    it grows there while chunks and tiles run, and is held twice while they are joined.
    Auto never tiles when the whole decode fits. For an image that does not fit whole, the layered decode
    (``cost.layered_bytes_per_px`` > 0) comes before tiles: it is exact and recomputes only a few rows.
    """
    if len(latent_shape) not in (4, 5):
        raise ConfigError("samples", tuple(latent_shape), "a 4-D [B, C, H, W] or 5-D [B, C, T, H, W] latent")
    b, h, w = latent_shape[0], latent_shape[-2], latent_shape[-1]
    t = latent_shape[2] if len(latent_shape) == 5 else 1
    for name, v in (("batch", b), ("height", h), ("width", w), ("frames", t)):
        _check_int(name, v, 1)
    budget = _check_int("budget_bytes", int(budget_bytes), 1)
    if tile is not None:
        tile = _check_int("tile_size", tile, 1)
    if overlap is not None:
        overlap = _check_int("overlap", overlap, 0)
    if chunk_frames is not None:
        chunk_frames = _check_int("temporal_size", chunk_frames, 1)
    auto_chunk_frames = _check_int("auto_chunk_frames", auto_chunk_frames, 1)
    if tile is not None and tile >= h and tile >= w:
        # no spatial tiling asked for; the rest still holds: temporal chunks asked for, and the budget
        p = plan_decode(latent_shape, scale, cost, budget_bytes, halo_px=halo_px, tile=None, overlap=overlap,
                        chunk_frames=chunk_frames, align=align, spatial_supported=spatial_supported,
                        temporal_supported=temporal_supported, out_frames=out_frames,
                        auto_chunk_frames=auto_chunk_frames, tile_out_frames=tile_out_frames,
                        kept_output_bytes=kept_output_bytes)
        return replace(p, reason=f"tile_size covers the whole {h * scale}x{w * scale}px frame, so no tiles were "
                                 f"asked for; {p.reason}")
    frame_px = h * w * scale * scale
    video = len(latent_shape) == 5
    n_out = int(out_frames) if out_frames else t
    per_latent_frame = max(1.0, n_out / t)

    def whole_peak(batch: int) -> int:
        out = cost.output_bytes_per_px * frame_px * n_out if video else 0
        return int(batch * (cost.whole_bytes_per_px * frame_px + out))

    streamed = cost.stream_base_bytes_per_px > 0 or cost.stream_frame_bytes_per_px > 0

    kept = max(0, int(kept_output_bytes))

    def with_output(peak: float) -> int:
        """A chunk's or tile's peak with the finished output beside it, or the join of the pieces (two copies)."""
        return int(max(peak + kept, 2 * kept))

    def chunk_peak(frames: int) -> int:
        if streamed:            # each chunk's frames leave the device as the decoder returns them (the bridge
            # counts frames that stay in the measured base)
            return int((cost.stream_base_bytes_per_px + cost.stream_frame_bytes_per_px * frames) * frame_px)
        return with_output(cost.whole_bytes_per_px * frame_px
                           + cost.output_bytes_per_px * frame_px * per_latent_frame * frames)

    if tile is None:
        chunks_possible = video and temporal_supported and chunk_frames is not None
        if whole_peak(b) <= budget and not chunks_possible:
            return TilePlan("whole", b, None, 0, None, whole_peak(b), budget,
                            "the whole decode fits the budget: no tiling (identical to VAEDecode)")
        if video and temporal_supported:
            cf = chunk_frames or auto_chunk_frames
            if streamed and chunk_frames is None:
                # streaming recomputes each unit's context per chunk: the longest chunk that fits wastes least
                cf = max([f for f in range(1, t + 1) if chunk_peak(f) <= budget], default=cf)
            if chunk_peak(cf) <= budget or not spatial_supported:
                how = ("each time unit keeping the context frames it needs (exact"
                       + ("; the longest chunk that fits)" if chunk_frames is None else ")")
                       if streamed else "the causal cache carried across them (exact)")
                return TilePlan("temporal", 1, None, 0, cf, chunk_peak(cf), budget,
                                "the whole video does not fit or chunks were asked for: decoding in temporal "
                                f"chunks with {how}")
        if not video:
            b_fit = int(budget // max(1, whole_peak(1)))
            if b_fit >= 1:
                return TilePlan("whole", min(b, b_fit), None, 0, None, whole_peak(min(b, b_fit)), budget,
                                f"one image fits, {b} do not: decoding {min(b, b_fit)} at a time (batch slicing)")
            layered = int(cost.layered_bytes_per_px * frame_px)
            if cost.layered_bytes_per_px > 0 and layered <= budget:
                return TilePlan("layered", 1, None, 0, None, layered, budget,
                                f"the whole decode needs {whole_peak(1) / GIB:.3f} GiB: the high-resolution stages "
                                "run module by module in row bands with exact whole-image GroupNorm statistics "
                                "(the untiled result up to float rounding; no recomputed tiles)")

    if not spatial_supported:
        need = whole_peak(1) if not video else chunk_peak(1)
        raise BudgetExceeded(need, budget, "VAE decode",
                             "This VAE has no seamless spatial tiling in Levers; free memory, lower the "
                             "resolution or use ComfyUI's VAEDecodeTiled.")

    min_overlap = math.ceil((2 * halo_px + 1) / scale) if halo_px > 0 else 0
    ov = min_overlap if overlap is None else overlap
    cf = (chunk_frames or auto_chunk_frames) if video else None
    stored = cost.stored_bytes_per_px * frame_px * (t if video else 1)
    stem_peak = cost.stem_bytes_per_px * frame_px

    def tile_peak(tt: tuple[int, int]) -> int:
        # the stem pass ends before tiles start, so its peak is checked on its own
        tile_px = tt[0] * tt[1] * scale * scale
        return with_output(stored + cost.tile_bytes_per_px * tile_px * (cf or 1)
                           + cost.output_bytes_per_px * tile_px * tile_out_frames)

    if tile is not None:
        tt = (min(tile, h), min(tile, w))
        # the overlap only applies along an axis the tile does not cover (a wide frame may be cut in width only)
        cut = min(x for x, n in zip(tt, (h, w)) if x < n)
        clamped = ""
        if overlap is None and ov >= cut:
            # auto overlap (2 x the receptive field) does not fit a tile this small: use half a tile
            ov = max(0, cut // 2)
            clamped = f"; auto overlap clamped to {ov * scale}px (half a tile)"
        if ov >= cut:
            # an overlap as wide as the tile: a quarter of the tile, what VAEDecodeTiled makes of it (its defaults,
            # tile 64 overlap 64, mean the same here)
            asked, ov = ov, cut // 4
            clamped = (f"; overlap {asked * scale}px is not less than the tile ({cut * scale}px): {ov * scale}px, a "
                       "quarter of the tile, as VAEDecodeTiled takes it")
        exact = ov >= min_overlap
        why = "tile_size given" + ("" if exact else
                                   f"; overlap {ov * scale}px is below the decoder's receptive field "
                                   f"({2 * halo_px + 1:.0f}px needed): seams are blended, not exact") + clamped
        ratio = _count(h, tt[0], ov) * tt[0] * _count(w, tt[1], ov) * tt[1] / (h * w)
        return TilePlan("spatial", 1, tt, ov, cf, max(tile_peak(tt), int(stem_peak)), budget, why, exact,
                        work_ratio=ratio)

    a = max(1, align)
    smallest = (min(ov + a, h), min(ov + a, w))

    def too_small() -> BudgetExceeded:
        """The error when nothing fits, naming the least any plan needs (whole, batch-sliced, temporal chunks,
        layered, tiles): the smallest budget that decodes, not the first check that failed."""
        tiles = tile_peak(smallest)
        need = {"smallest tile" if tiles >= stem_peak else "low-resolution stem": max(int(stem_peak), tiles)}
        if not (video and temporal_supported and chunk_frames is not None):
            need["whole decode" + ("" if video or b == 1 else ", one image at a time")] = whole_peak(b if video else 1)
        if video and temporal_supported:
            need["temporal chunks"] = chunk_peak(1 if streamed and chunk_frames is None
                                                 else chunk_frames or auto_chunk_frames)
        if not video and cost.layered_bytes_per_px > 0:
            need["layered decode"] = int(cost.layered_bytes_per_px * frame_px)
        least = min(need, key=need.get)
        return BudgetExceeded(need[least], budget, f"VAE decode ({least})",
                              "Free memory (unload other models), lower the resolution, or decode on the CPU.")

    if stem_peak > budget:
        raise too_small()
    best = None                                     # ((work, tiles), (tile_h, tile_w))
    for nr in range(1, h + 1):
        tr = _tile_for_count(h, nr, ov, a)
        if tr is None:
            break
        # for a fixed number of rows, more columns only add overlap: the fewest that fit is the best
        for nc in range(1, w + 1):
            tc = _tile_for_count(w, nc, ov, a)
            if tc is None:
                break
            if tile_peak((tr, tc)) <= budget:
                n_r, n_c = _count(h, tr, ov), _count(w, tc, ov)
                key = (n_r * tr * n_c * tc, n_r * n_c)
                if best is None or key < best[0]:
                    best = (key, (tr, tc))
                break
        if best is not None and (h + nr * ov) * w >= best[0][0]:
            break                                   # more rows would recompute more than the best found
    if best is not None:
        (work, n), tt = best
        ratio = work / (h * w)
        return TilePlan("spatial", 1, tt, ov, cf, max(tile_peak(tt), int(stem_peak)), budget,
                        f"the whole decode needs {whole_peak(1) / GIB:.3f} GiB: {n} tiles that fit, shaped for the "
                        f"least recomputed overlap (tail work {ratio:.2f}x of untiled); "
                        + ("overlap covers 2 x the receptive field so tiles are exact" if ov >= min_overlap else
                           f"overlap {ov * scale}px is below the decoder's receptive field ({2 * halo_px + 1:.0f}px "
                           "needed): seams are blended, not exact"), ov >= min_overlap, work_ratio=ratio)
    raise too_small()


def _tile_for_count(length: int, n: int, overlap: int, align: int) -> int | None:
    """The smallest tile (a multiple of ``align`` or the whole axis) that covers ``length`` in ``n`` tiles
    overlapping by at least ``overlap``; None when n tiles cannot keep that overlap."""
    if n == 1:
        return length
    t = math.ceil((length + (n - 1) * overlap) / n)
    t = min(length, math.ceil(t / align) * align)
    if t <= overlap or t >= length:
        return None
    return t


def _count(length: int, tile: int, overlap: int) -> int:
    if tile >= length:
        return 1
    return max(2, math.ceil((length - overlap) / (tile - overlap)))
