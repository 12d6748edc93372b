"""Where tiles go and how their overlaps are blended.

Tiles form a grid: the tensor product of one 1-D layout per spatial axis. Blend weights are
built per axis and normalised per position, so along each axis they sum to 1; the product of
per-axis partitions of unity is a partition of unity on the grid, hence every output pixel's
weights sum to 1 (up to one rounding of the division).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import ConfigError


@dataclass(frozen=True)
class Span:
    """One tile along one axis, in latent units: [start, stop)."""

    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start


def layout_axis(length: int, tile: int, overlap: int) -> list[Span]:
    """Cover [0, length) with windows of `tile` that overlap by at least `overlap`.

    The windows are spread evenly (the last one ends exactly at `length`), so overlaps are
    `overlap` or a little more, never less. One window when the tile covers the axis.
    """
    for name, value in (("length", length), ("tile", tile)):
        if int(value) < 1:
            raise ConfigError(name, value, "an integer >= 1")
    if tile >= length:
        return [Span(0, length)]
    if overlap < 0 or overlap >= tile:
        raise ConfigError("overlap", overlap, f"0 <= overlap < tile ({tile})",
                          "Make the overlap smaller than the tile or the tile larger.")
    n = math.ceil((length - overlap) / (tile - overlap))
    n = max(n, 2)
    starts = [round(i * (length - tile) / (n - 1)) for i in range(n)]
    return [Span(s, s + tile) for s in starts]


def axis_weights(spans: list[Span], length: int, scale: int, margin: float, band: float,
                 dtype=torch.float64) -> list[torch.Tensor]:
    """Per-tile 1-D blend weights at output resolution (`scale` output px per latent unit).

    Inside a tile, a pixel at distance d (px) from an interior tile edge gets
    clamp((d - margin) / band, 0, 1); edges on the image border do not count (no seam there).
    `margin` skips the pixels a tile computed without enough context (its receptive field), so
    when the overlap is at least 2 * margin + band every blended pixel is an exact one.
    The raw weights are divided by their sum at each position: a partition of unity.
    Returns one tensor per span, of length span.size * scale.
    """
    if band <= 0:
        raise ConfigError("band", band, "a positive number of pixels")
    n_px = length * scale
    pos = torch.arange(n_px, dtype=dtype) + 0.5                      # pixel centres
    raw = torch.zeros(len(spans), n_px, dtype=dtype)                 # [tiles, px]
    for i, sp in enumerate(spans):
        lo, hi = sp.start * scale, sp.stop * scale
        inside = (pos > lo) & (pos < hi)
        d = torch.full_like(pos, math.inf)
        if sp.start > 0:
            d = torch.minimum(d, pos - lo)
        if sp.stop < length:
            d = torch.minimum(d, hi - pos)
        w = ((d - margin) / band).clamp(0.0, 1.0)
        raw[i] = torch.where(inside, w, torch.zeros_like(w))
    total = raw.sum(0)                                               # [px]
    if bool((total <= 0).any()):
        bad = int(torch.nonzero(total <= 0)[0])
        raise ValueError(f"tile layout leaves output pixel {bad} with no weight: overlap too small for "
                         f"margin={margin} px; use a larger overlap or a smaller margin")
    norm = raw / total
    return [norm[i, sp.start * scale: sp.stop * scale].clone() for i, sp in enumerate(spans)]


@dataclass(frozen=True)
class TileGrid:
    """A grid of tiles over an (h, w) latent with per-tile output-resolution blend weights."""

    rows: tuple[Span, ...]
    cols: tuple[Span, ...]
    row_weights: tuple[torch.Tensor, ...]
    col_weights: tuple[torch.Tensor, ...]
    scale: int

    def __len__(self) -> int:
        return len(self.rows) * len(self.cols)

    def __iter__(self):
        for i, r in enumerate(self.rows):
            for j, c in enumerate(self.cols):
                yield r, c, self.weight(i, j)

    def weight(self, i: int, j: int) -> torch.Tensor:
        """[H_tile_px, W_tile_px] weight of tile (i, j)."""
        return self.row_weights[i][:, None] * self.col_weights[j][None, :]


def make_grid(h: int, w: int, tile: tuple[int, int], overlap: int, scale: int, margin_px: float = 0.0) -> TileGrid:
    """Lay out tiles of `tile` latent units with `overlap` latent units over an (h, w) latent.

    `margin_px` is the context a tile needs (the tail's receptive-field radius in output px).
    Blending happens in the band between the two margins, so an overlap of at least
    2 * margin_px + 1 px blends only exact pixels; a smaller overlap shrinks the margin and the
    seam is blended over what is left (at least 1 px).
    """
    rows = layout_axis(h, tile[0], overlap)
    cols = layout_axis(w, tile[1], overlap)
    ov_px = overlap * scale
    if ov_px > 0:
        margin = min(float(margin_px), max(0.0, (ov_px - 1.0) / 2))
        band = max(1.0, ov_px - 2 * margin)
    else:
        margin, band = 0.0, 1.0
    return TileGrid(tuple(rows), tuple(cols), tuple(axis_weights(rows, h, scale, margin, band)),
                    tuple(axis_weights(cols, w, scale, margin, band)), scale)
