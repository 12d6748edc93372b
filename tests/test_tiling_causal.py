"""Causal video decoders whose own ``decode`` shapes the chunks (pure torch, CPU).

* Wan 2.2-style: the decoder takes ``first_chunk`` on the video's first call only. Chunked decodes
  must set it on the first chunk's first call, not on every chunk's (``StagedDecoder.first_call_kwarg``).
* ComfyUI 0.33 Wan 2.1-style: ``decode`` calls the decoder on frame 0, then on pairs, and each cached
  layer keeps only the frames its last call saw. Exact chunks are those calls: ``decode_streamed``
  runs the model's decode unchanged and moves each call's frames off the device.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from comfyui_levers.core.tiling import (StagedDecoder, TilePlan, decode_spatial, decode_streamed, decode_temporal,
                                        measure_halo, persistent_cache, plan_decode, run_stem)
from comfyui_levers.core.tiling.plan import DecodeCost


def _init(module: nn.Module, seed: int) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p[0].numel() if p.ndim > 1 else 8))
    return module.eval()


class CausalConv(nn.Conv3d):
    """3x3x3, causal in time: left-pads what the cache does not supply."""

    def forward(self, x, cache=None):
        if cache is not None:
            x = torch.cat([cache.to(x), x], 2)
        pad_t = 2 - (0 if cache is None else cache.shape[2])
        return super().forward(F.pad(x, (1, 1, 1, 1, pad_t, 0)))


class FrameAttn(nn.Module):
    """Attention over all pixels of each frame (global in space, like Wan's middle block)."""

    def __init__(self, c):
        super().__init__()
        self.qkv = nn.Conv2d(c, 3 * c, 1)

    def forward(self, x, *unused, **unused_kw):
        b, c, t, h, w = x.shape
        y = x.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w)
        q, k, v = self.qkv(y).reshape(b * t, 3, c, h * w).unbind(1)
        a = torch.softmax(q.transpose(1, 2) @ k / math.sqrt(c), -1)
        return x + (v @ a.transpose(1, 2)).reshape(b, t, c, h, w).permute(0, 2, 1, 3, 4)


class CachedConv(nn.Module):
    """A cached causal conv layer. ``keep_two`` (0.8.0 / Wan 2.2): a 1-frame call keeps the previous
    call's last frame too, so the cache always holds 2 frames; without it (0.33 Wan 2.1) the cache
    holds only what the last call saw."""

    def __init__(self, cin, cout, keep_two):
        super().__init__()
        self.conv = CausalConv(cin, cout, 3)
        self.keep_two = keep_two

    def forward(self, x, feat_cache, feat_idx, **unused):
        i = feat_idx[0]
        keep = x[:, :, -2:].clone()
        if self.keep_two and keep.shape[2] < 2 and feat_cache[i] is not None:
            keep = torch.cat([feat_cache[i][:, :, -1:], keep], 2)
        x = self.conv(x, feat_cache[i])
        feat_cache[i] = keep
        feat_idx[0] += 1
        return x


class Up(nn.Module):
    def forward(self, x, *unused, **unused_kw):
        b, c, t, h, w = x.shape
        return F.interpolate(x.reshape(b, c * t, h, w), scale_factor=2.0, mode="nearest").reshape(b, c, t, 2 * h, 2 * w)


class Decoder(nn.Module):
    """conv1 -> res -> attention (boundary) -> conv -> up -> conv (head); ``first_chunk`` (Wan 2.2) adds a
    learned offset to the video's first call, as Wan 2.2's shortcut treats its first chunk differently."""

    def __init__(self, keep_two=True, z=4, c=8):
        super().__init__()
        self.conv1 = CachedConv(z, c, keep_two)
        self.res = CachedConv(c, c, keep_two)
        self.attn = FrameAttn(c)
        self.conv2 = CachedConv(c, c, keep_two)
        self.up = Up()
        self.head = CachedConv(c, 3, keep_two)
        self.first_offset = nn.Parameter(torch.zeros(1, c, 1, 1, 1))

    def forward(self, x, feat_cache=None, feat_idx=(0,), first_chunk=False):
        x = self.conv1(x, feat_cache, feat_idx)
        x = self.res(x, feat_cache, feat_idx)
        x = self.attn(x)
        x = self.conv2(x, feat_cache, feat_idx)
        if first_chunk:
            x = x + self.first_offset
        return self.head(self.up(x), feat_cache, feat_idx)


class FirstChunkVAE(nn.Module):
    """Wan 2.2's call pattern: one latent frame per call, ``first_chunk=True`` on the first."""

    def __init__(self):
        super().__init__()
        self.decoder = Decoder(keep_two=True)

    def decode(self, z):
        cache = [None] * 8
        return torch.cat([self.decoder(z[:, :, i:i + 1], feat_cache=cache, feat_idx=[0], first_chunk=(i == 0))
                          for i in range(z.shape[2])], 2)

    def staged(self, first_kwarg: str | None = "first_chunk") -> StagedDecoder:
        d = self.decoder
        return StagedDecoder(run=self.decode, stem=[d.conv1, d.res], boundary=d.attn, tail=[d.conv2, d.up, d.head],
                             cache_module=d, new_cache=lambda: [None] * 8, first_call_kwarg=first_kwarg)


class PairsVAE(nn.Module):
    """ComfyUI 0.33's Wan 2.1 call pattern: frame 0, then pairs; the decoder returns a list of chunks and
    each cache keeps only what its last call saw."""

    def __init__(self):
        super().__init__()
        self.decoder = Decoder(keep_two=False)
        self.seen: list[torch.device] = []

    def decode(self, z):
        cache = [None] * 8
        out = []
        starts = [(0, 1)] + [(s, s + 2) for s in range(1, z.shape[2], 2)]
        for s, e in starts:
            out += [self.decoder(z[:, :, s:e], feat_cache=cache, feat_idx=[0])]
            self.seen.append(out[-1].device)
        return torch.cat(out, 2)

    def staged(self) -> StagedDecoder:
        d = self.decoder
        return StagedDecoder(run=self.decode, stem=[d.conv1, d.res], boundary=d.attn, tail=[d.conv2, d.up, d.head],
                             cache_module=d, new_cache=lambda: [None] * 8)


def _toy_case(cls, seed: int, init_seed: int, shape: tuple[int, ...]):
    """(model, latent, reference): the toy with seeded weights, a seeded latent, and its own decode per sample."""
    torch.manual_seed(seed)
    m = _init(cls(), init_seed)
    z = torch.randn(shape)
    with torch.no_grad():
        ref = torch.cat([m.decode(z[i:i + 1]) for i in range(shape[0])], 0)
    return m, z, ref


@pytest.fixture(scope="module")
def first_chunk():
    return _toy_case(FirstChunkVAE, 0, 3, (1, 4, 5, 10, 12))


@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_first_chunk_flag_is_set_once_per_video(first_chunk, chunk):
    m, z, ref = first_chunk
    assert torch.equal(decode_temporal(m.staged(), z, chunk), ref)


def test_first_chunk_flag_on_every_chunk_is_wrong(first_chunk):
    """What the model's own decode does when called per chunk: the flag on each chunk's first frame."""
    m, z, ref = first_chunk
    out = decode_temporal(m.staged(first_kwarg=None), z, 2)
    assert not torch.allclose(out[:, :, 2:], ref[:, :, 2:], atol=1e-3)
    assert torch.equal(out[:, :, :2], ref[:, :, :2])


def test_first_chunk_spatial_tiles_match_untiled(first_chunk):
    m, z, ref = first_chunk
    st = m.staged()
    halo = measure_halo(st, run_stem(st, z), out_per_stem=2)
    assert 2 <= halo <= 8
    plan = TilePlan("spatial", 1, (6, 6), math.ceil((2 * halo + 1) / 2), 2, 0, 1, "test")
    out = decode_spatial(st, z, plan, out_scale=2, halo_px=halo)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)


def test_persistent_cache_sets_the_flag_only_while_the_cache_is_empty():
    seen = []

    class Probe(nn.Module):
        def forward(self, x, feat_cache=None, first_chunk=None):
            seen.append(first_chunk)
            feat_cache[0] = x
            return x

    p, cache = Probe(), [None, None]
    with persistent_cache(p, "feat_cache", cache, "first_chunk"):
        p(1, first_chunk=True)
        p(2, first_chunk=True)
    with persistent_cache(p, "feat_cache", cache, "first_chunk"):
        p(3, first_chunk=True)
    assert seen == [True, False, False]


@pytest.fixture(scope="module")
def pairs():
    return _toy_case(PairsVAE, 1, 4, (2, 4, 5, 6, 8))


def test_streamed_calls_are_bit_exact_and_report_each_call(pairs):
    m, z, ref = pairs
    ticks, frames = [], []
    out = decode_streamed(m.decode, m.decoder, z, "cpu", progress=lambda d, t: frames.append((d, t)),
                          interrupt=lambda: ticks.append(1), total_frames=5)
    assert torch.equal(out, ref) and out.dtype == torch.float32
    assert len(ticks) == 2 * 3                              # per sample: frame 0, then 2 pairs
    assert frames[-1] == (10, 10) and frames[0] == (1, 10)
    assert "forward" not in m.decoder.__dict__              # the wrapper is gone


def test_streamed_output_leaves_the_device_per_call(pairs):
    """The model sees each call's frames already on the output device ("meta" here stands in for the host)."""
    m, z, _ = pairs
    m.seen = []
    out = decode_streamed(m.decode, m.decoder, z[:1], "meta", total_frames=5)
    assert out.device.type == "meta" and out.shape == (1, 3, 5, 12, 16)
    assert [d.type for d in m.seen] == ["meta"] * 3


def test_one_frame_chunks_lose_context_on_the_pairs_decoder(pairs):
    """Why the 0.33 decoder needs its own calls: chunking it by 1 latent frame cuts its cache short."""
    m, z, ref = pairs
    out = decode_temporal(m.staged(), z[:1], 1)
    assert not torch.allclose(out, ref[:1], atol=1e-3)


def test_plan_uses_the_decoders_smallest_exact_chunk():
    cost = DecodeCost(whole_bytes_per_px=100.0, tile_bytes_per_px=50.0, output_bytes_per_px=12.0)
    shape = (1, 16, 21, 60, 104)
    frame_px = 60 * 104 * 64
    budget = int(100 * frame_px + 12 * frame_px * 4 * 3)                  # one pair fits, not the video
    p = plan_decode(shape, 8, cost, budget, temporal_supported=True, out_frames=81, auto_chunk_frames=2)
    assert p.mode == "temporal" and p.chunk_frames == 2
    p1 = plan_decode(shape, 8, cost, budget, temporal_supported=True, out_frames=81)
    assert p1.chunk_frames == 1 and p1.predicted_peak_bytes < p.predicted_peak_bytes
