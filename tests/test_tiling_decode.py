"""Tiled decode vs untiled on toy decoders shaped like the real ones (pure torch, CPU).

* conv-only decoder: tiles whose context covers the receptive field are exact;
* KL-style decoder (GroupNorm everywhere, attention at the lowest resolution): the stem runs
  whole, the tail uses whole-image GroupNorm statistics; exact with full statistics, close with
  sampled ones, and far better than tiles that normalise with their own statistics;
* causal video decoder with a Wan-style feature cache: temporal chunks and tiles are bit-exact.
"""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn
import torch.nn.functional as F

from comfyui_levers.core.errors import ConfigError
from comfyui_levers.core.tiling.overrides import StopDecode
from comfyui_levers.core.tiling import (DecodeStats, StagedDecoder, TilePlan, decode_spatial, decode_temporal,
                                        decode_whole, measure_halo, measure_peak_bytes, override_forwards, run_stem)


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    peak = float(b.detach().abs().max())
    mse = float(((a - b).detach() ** 2).mean())
    return math.inf if mse == 0 else 10 * math.log10(peak * peak / mse)


def _init(module: nn.Module, seed: int) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.ndim == 1 and ("norm" in name or "gn" in name) and name.endswith("weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif p.ndim == 1:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p[0].numel()))
    return module.eval()


class Res(nn.Module):
    def __init__(self, cin, cout, gn=True):
        super().__init__()
        self.norm1 = nn.GroupNorm(4, cin) if gn else nn.Identity()
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.norm2 = nn.GroupNorm(4, cout) if gn else nn.Identity()
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x, *unused):
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        return self.skip(x) + h


class Attn(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.norm = nn.GroupNorm(4, c)
        self.qkv = nn.Conv2d(c, 3 * c, 1)

    def forward(self, x):
        b, c, h, w = x.shape
        q, k, v = self.qkv(self.norm(x)).reshape(b, 3, c, h * w).unbind(1)
        a = torch.softmax(q.transpose(1, 2) @ k / math.sqrt(c), -1)          # [B, HW, HW]
        return x + (v @ a.transpose(1, 2)).reshape(b, c, h, w)


class Up(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x):
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


class ToyKL(nn.Module):
    """conv_in -> mid (res, attn, res) -> res, up, res, up, res -> norm_out -> conv_out; x4 upscale."""

    def __init__(self, gn=True, attn=True, z=4, c=16):
        super().__init__()
        self.conv_in = nn.Conv2d(z, c, 3, padding=1)
        self.mid1 = Res(c, c, gn)
        self.attn = Attn(c) if attn else nn.Identity()
        self.mid2 = Res(c, c, gn)
        self.res_a = Res(c, c, gn)
        self.up_a = Up(c)
        self.res_b = Res(c, c // 2, gn)
        self.up_b = Up(c // 2)
        self.res_c = Res(c // 2, c // 2, gn)
        self.norm_out = nn.GroupNorm(4, c // 2) if gn else nn.Identity()
        self.conv_out = nn.Conv2d(c // 2, 3, 3, padding=1)

    def decode(self, z):
        h = self.mid2(self.attn(self.mid1(self.conv_in(z))))
        h = self.res_c(self.up_b(self.res_b(self.up_a(self.res_a(h)))))
        return self.conv_out(F.silu(self.norm_out(h)))

    def staged(self) -> StagedDecoder:
        return StagedDecoder(run=self.decode, stem=[self.conv_in, self.mid1, self.attn], boundary=self.mid2,
                             tail=[self.res_a, self.up_a, self.res_b, self.up_b, self.res_c, self.norm_out,
                                   self.conv_out])


def test_the_receptive_field_of_a_thin_frame_is_measured_along_its_long_side():
    """Found in review: the probe window was square and stopped growing at the frame's short side, so on a thin frame
    (a panorama) the reach along the long side, where tiles cut, was clipped: a lower bound the planner took for
    exact overlaps. The window grows along each axis on its own."""
    torch.manual_seed(0)
    m = _init(ToyKL(gn=False, attn=False), 1)
    thin = torch.randn(1, 4, 2, 48)
    assert measure_halo(m.staged(), run_stem(m.staged(), thin), out_per_stem=4) == 18     # as on a square frame
    ref = m.decode(thin)
    ov = math.ceil((2 * 18 + 1) / 4)
    out = decode_spatial(m.staged(), thin, TilePlan("spatial", 1, (2, 16), ov, None, 0, 1, "test"), out_scale=4,
                         halo_px=18)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)


def spatial_plan(tile: int, overlap: int) -> TilePlan:
    return TilePlan("spatial", 1, (tile, tile), overlap, None, 0, 1, "test")


# --------------------------------------------------------------------------------------- conv-only
def test_conv_only_tiles_are_exact_when_overlap_covers_receptive_field():
    torch.manual_seed(0)
    m = _init(ToyKL(gn=False, attn=False), 1)
    z = torch.randn(2, 4, 16, 24)
    ref = m.decode(z)
    halo = measure_halo(m.staged(), run_stem(m.staged(), z[:1]), out_per_stem=4)
    # tail radius in 4x px: res_a 2 convs at 1x (8) + up_a conv and res_b 2 convs at 2x (6)
    # + up_b conv, res_c 2 convs and conv_out at 4x (4) = 18
    assert halo == 18
    ov = math.ceil((2 * halo + 1) / 4)
    out = decode_spatial(m.staged(), z, spatial_plan(16, ov), out_scale=4, halo_px=halo)
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)


def test_conv_only_small_overlap_is_not_exact_but_blended():
    m = _init(ToyKL(gn=False, attn=False), 1)
    z = torch.randn(1, 4, 16, 24)
    ref = m.decode(z)
    out = decode_spatial(m.staged(), z, spatial_plan(10, 2), out_scale=4, halo_px=28.0)
    assert (out - ref).abs().max() > 1e-4          # the theory says not exact: the test can see it
    assert psnr(out, ref) > 20


# --------------------------------------------------------------------------------------- KL + GroupNorm
def naive_tiles(m: ToyKL, z: torch.Tensor, tile: int, overlap: int) -> torch.Tensor:
    """What a plain tiler does: the whole decoder per tile (tile GroupNorm stats, tile attention)."""
    from comfyui_levers.core.tiling import make_grid

    grid = make_grid(z.shape[-2], z.shape[-1], (tile, tile), overlap, 4)
    out = torch.zeros(z.shape[0], 3, z.shape[-2] * 4, z.shape[-1] * 4)
    for rs, cs, wt in grid:
        piece = m.decode(z[..., rs.start:rs.stop, cs.start:cs.stop])
        out[..., rs.start * 4:rs.stop * 4, cs.start * 4:cs.stop * 4] += piece * wt.float()
    return out


def toy_kl_case(latent_shape=(1, 4, 24, 24)):
    """(the toy KL decoder, a random latent, its untiled decode)."""
    torch.manual_seed(3)
    m = _init(ToyKL(), 7)
    z = torch.randn(latent_shape)
    with torch.no_grad():
        ref = m.decode(z)
    return m, z, ref


@pytest.fixture(scope="module")
def kl():
    return toy_kl_case()


def test_kl_full_statistics_is_exact(kl):
    m, z, ref = kl
    out = decode_spatial(m.staged(), z, spatial_plan(18, 10), out_scale=4, stats="exact")
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_kl_pooled_tile_statistics_beat_per_tile_statistics(kl):
    m, z, ref = kl
    info = DecodeStats()
    one = decode_spatial(m.staged(), z, spatial_plan(18, 10), out_scale=4, info=info)       # stats="tiles"
    two = decode_spatial(m.staged(), z, spatial_plan(18, 10), out_scale=4, stats_passes=2)
    with torch.no_grad():
        naive = naive_tiles(m, z, 18, 10)
    p_one, p_two, p_naive = psnr(one, ref), psnr(two, ref), psnr(naive, ref)
    assert info.tiles == 4 and info.stats_fraction == 1.0
    assert p_one > 45 and p_one > p_naive + 10, (p_one, p_naive)
    assert p_two > p_one, (p_two, p_one)              # another pass shrinks the statistics error


def test_kl_window_statistics_are_a_cheaper_sample(kl):
    m, z, ref = kl
    info = DecodeStats()
    out = decode_spatial(m.staged(), z, spatial_plan(18, 10), out_scale=4, stats="windows", info=info)
    assert 0 < info.stats_fraction < 0.5
    assert psnr(out, ref) > 25


def test_bad_stats_options_are_refused(kl):
    m, z, _ = kl
    with pytest.raises(ConfigError, match="stats"):
        decode_spatial(m.staged(), z, spatial_plan(18, 10), out_scale=4, stats="median")
    with pytest.raises(ConfigError, match="stats_passes"):
        decode_spatial(m.staged(), z, spatial_plan(18, 10), out_scale=4, stats_passes=0)


def test_batch_is_decoded_per_sample_with_its_own_statistics():
    m = _init(ToyKL(), 7)
    z = torch.randn(2, 4, 16, 16)
    z[1] *= 3.0                                     # very different statistics per sample
    with torch.no_grad():
        ref = m.decode(z)
    out = decode_spatial(m.staged(), z, spatial_plan(12, 10), out_scale=4, stats="exact")
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_overrides_are_removed_even_after_an_error(kl):
    m, z, _ = kl
    before = {id(mod): dict(mod.__dict__) for mod in m.modules()}

    def boom():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        decode_spatial(m.staged(), z, spatial_plan(18, 10), out_scale=4, interrupt=boom)
    for mod in m.modules():
        assert "forward" not in mod.__dict__
        assert set(mod.__dict__) == set(before[id(mod)])


def test_progress_reports_every_tile(kl):
    m, z, _ = kl
    seen = []
    decode_spatial(m.staged(), z, spatial_plan(18, 10), out_scale=4, progress=lambda d, t: seen.append((d, t)))
    assert seen[-1][0] == seen[-1][1] == len(seen) == 4


def test_nested_override_is_refused(kl):
    m, _, _ = kl
    with override_forwards({m.conv_in: lambda x: x}):
        with pytest.raises(RuntimeError, match="do not nest"):
            with override_forwards({m.conv_in: lambda x: x}):
                pass
    assert "forward" not in m.conv_in.__dict__


def test_spatial_plan_is_required(kl):
    m, z, _ = kl
    with pytest.raises(ConfigError):
        decode_spatial(m.staged(), z, TilePlan("whole", 1, None, 0, None, 0, 1, ""), out_scale=4)


def test_tiled_peak_is_below_untiled_peak():
    m = _init(ToyKL(attn=False), 7)                 # no attention: its [HW, HW] matrix is in both paths
    z = torch.randn(1, 4, 24, 24)
    _, whole = measure_peak_bytes(lambda: decode_whole(m.decode, z, 1), "cpu")
    _, tiled = measure_peak_bytes(lambda: decode_spatial(m.staged(), z, spatial_plan(12, 6), out_scale=4,
                                                         halo_px=12.0, stats="windows"), "cpu")
    assert whole.method.startswith("live-tensor")
    assert tiled.peak_bytes < 0.6 * whole.peak_bytes, (tiled.peak_bytes, whole.peak_bytes)


# --------------------------------------------------------------------------------------- causal video
class CausalConv(nn.Conv3d):
    """Causal in time (pads 2 frames on the left, or uses the 2 cached frames)."""

    def forward(self, x, cache=None):
        if cache is not None:
            x = torch.cat([cache.to(x), x], 2)
            pad_t = 2 - cache.shape[2]
        else:
            pad_t = 2
        x = F.pad(x, (1, 1, 1, 1, pad_t, 0))
        return super().forward(x)


class CRes(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv1 = CausalConv(c, c, 3)
        self.conv2 = CausalConv(c, c, 3)

    def forward(self, x, feat_cache, feat_idx):
        h = x
        for conv in (self.conv1, self.conv2):
            i = feat_idx[0]
            keep = h[:, :, -2:].clone()
            if keep.shape[2] < 2 and feat_cache[i] is not None:
                keep = torch.cat([feat_cache[i][:, :, -1:], keep], 2)
            h = conv(F.silu(F.normalize(h, dim=1)), feat_cache[i])
            feat_cache[i] = keep
            feat_idx[0] += 1
        return x + h


class FrameAttn(nn.Module):
    """Attention over all pixels of each frame (global in space, like Wan's middle block)."""

    def __init__(self, c):
        super().__init__()
        self.qkv = nn.Conv2d(c, 3 * c, 1)

    def forward(self, x, *unused):
        b, c, t, h, w = x.shape
        y = x.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w)
        q, k, v = self.qkv(y).reshape(b * t, 3, c, h * w).unbind(1)
        a = torch.softmax(q.transpose(1, 2) @ k / math.sqrt(c), -1)
        y = (v @ a.transpose(1, 2)).reshape(b, t, c, h, w).permute(0, 2, 1, 3, 4)
        return x + y


class SpatialUp(nn.Module):
    def forward(self, x, *unused):
        b, c, t, h, w = x.shape
        return F.interpolate(x.reshape(b, c * t, h, w), scale_factor=2.0, mode="nearest").reshape(b, c, t, 2 * h, 2 * w)


class CausalDecoder(nn.Module):
    def __init__(self, z=4, c=8):
        super().__init__()
        self.conv1 = CausalConv(z, c, 3)
        self.mid_res = CRes(c)
        self.mid_attn = FrameAttn(c)
        self.res1 = CRes(c)
        self.up1 = SpatialUp()
        self.res2 = CRes(c)
        self.head = CausalConv(c, 3, 3)

    def forward(self, x, feat_cache=None, feat_idx=(0,)):
        keep = x[:, :, -2:].clone()
        if keep.shape[2] < 2 and feat_cache[0] is not None:
            keep = torch.cat([feat_cache[0][:, :, -1:], keep], 2)
        x = self.conv1(x, feat_cache[0])
        feat_cache[0] = keep
        feat_idx[0] += 1
        x = self.mid_res(x, feat_cache, feat_idx)
        x = self.mid_attn(x, feat_cache, feat_idx)
        x = self.res1(x, feat_cache, feat_idx)
        x = self.up1(x, feat_cache, feat_idx)
        x = self.res2(x, feat_cache, feat_idx)
        i = feat_idx[0]
        keep = x[:, :, -2:].clone()
        if keep.shape[2] < 2 and feat_cache[i] is not None:
            keep = torch.cat([feat_cache[i][:, :, -1:], keep], 2)
        out = self.head(x, feat_cache[i])
        feat_cache[i] = keep
        return out


class ToyCausalVAE(nn.Module):
    def __init__(self):
        super().__init__()
        self.decoder = CausalDecoder()

    def decode(self, z):
        cache = [None] * 16
        outs = [self.decoder(z[:, :, i:i + 1], feat_cache=cache, feat_idx=[0]) for i in range(z.shape[2])]
        return torch.cat(outs, 2)

    def staged(self) -> StagedDecoder:
        d = self.decoder
        return StagedDecoder(run=self.decode, stem=[d.conv1, d.mid_res], boundary=d.mid_attn,
                             tail=[d.res1, d.up1, d.res2, d.head], cache_module=d, cache_kwarg="feat_cache",
                             new_cache=lambda: [None] * 16)


@pytest.fixture(scope="module")
def video():
    torch.manual_seed(5)
    m = _init(ToyCausalVAE(), 11)
    z = torch.randn(2, 4, 7, 12, 16)
    with torch.no_grad():   # per sample, as the chunked decode runs (batch size changes conv kernels' rounding)
        ref = torch.cat([m.decode(z[i:i + 1]) for i in range(z.shape[0])], 0)
    return m, z, ref


@pytest.mark.parametrize("chunk", [1, 2, 3, 7])
def test_temporal_chunks_are_bit_exact(video, chunk):
    m, z, ref = video
    out = decode_temporal(m.staged(), z, chunk)
    assert torch.equal(out, ref)


def test_plain_chunking_without_the_cache_is_wrong(video):
    m, z, ref = video
    with torch.no_grad():
        naive = torch.cat([m.decode(z[:, :, s:s + 2]) for s in range(0, 7, 2)], 2)
    assert not torch.allclose(naive, ref, atol=1e-3)


def test_causal_spatial_tiles_match_untiled(video):
    m, z, ref = video
    st = m.staged()
    halo = measure_halo(st, run_stem(st, z[:1]), out_per_stem=2)
    assert 4 <= halo <= 16
    plan = TilePlan("spatial", 1, (10, 10), math.ceil((2 * halo + 1) / 2), 2, 0, 1, "test")
    out = decode_spatial(st, z, plan, out_scale=2, halo_px=halo)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)


def test_temporal_needs_a_causal_decoder(kl):
    m, z, _ = kl
    with pytest.raises(ConfigError, match="causal"):
        decode_temporal(m.staged(), z, 1)


def test_decode_reports_time_by_phase(kl):
    """The stem, the statistics pass and the tiles are timed apart (the GPU suite reads this to see where a
    tiled decode's time goes); a run over two samples adds both samples' phases."""
    m, z, _ = kl
    info = DecodeStats()
    decode_spatial(m.staged(), torch.cat([z, z]), spatial_plan(18, 10), out_scale=4, halo_px=4.0, info=info)
    assert set(info.phase_s) == {"stem", "stats", "tiles"} and all(v > 0 for v in info.phase_s.values())
    info2 = DecodeStats()
    decode_spatial(m.staged(), z, spatial_plan(18, 10), out_scale=4, info=info2)       # halo measured
    assert set(info2.phase_s) == {"stem", "halo", "stats", "tiles"}


# --------------------------------------------------------------------------------------- non-causal video (LTX)
class PixelNorm(nn.Module):
    def forward(self, x):
        return x / torch.sqrt((x * x).mean(1, keepdim=True) + 1e-6)


class ToyLTX(nn.Module):
    """A non-causal video decoder shaped like LTX's: the stem doubles the frames, the tail upsamples space,
    and the head scales by a vector of the head's width (which stem-shaped data cannot pass through)."""

    def __init__(self, z=4, c=8):
        super().__init__()
        self.conv_in = nn.Conv3d(z, 2 * c, 3, padding=1)
        self.mid = nn.Conv3d(2 * c, 2 * c, 3, padding=1)
        self.up = nn.Conv3d(2 * c, c, 3, padding=1)
        self.norm = PixelNorm()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, c))
        self.conv_out = nn.Conv3d(c, 3, 3, padding=1)

    def decode(self, z):
        h = self.conv_in(z).repeat_interleave(2, dim=2)                      # time x2 in the stem
        h = self.mid(h)
        h = self.up(F.interpolate(h, scale_factor=(1, 2, 2), mode="nearest"))
        h = F.silu(self.norm(h)) * self.scale[None, :, None, None, None]
        return self.conv_out(h)

    def staged(self, whole_frames=True) -> StagedDecoder:
        def stop(*a, **k):
            raise StopDecode
        return StagedDecoder(run=self.decode, stem=[self.conv_in], boundary=self.mid, tail=[self.up, self.norm,
                             self.conv_out], stem_run_stand_ins={self.norm: stop}, whole_frames=whole_frames)


def test_non_causal_video_tiles_decode_all_frames_and_match():
    """The stem changes the number of frames, so the boundary's stand-in returns all stem frames
    (``whole_frames``); the stem run ends before the head (``stem_run_stand_ins``)."""
    torch.manual_seed(0)
    m = _init(ToyLTX(), 2)
    z = torch.randn(1, 4, 3, 12, 16)
    with torch.no_grad():
        ref = m.decode(z)
    staged = m.staged()
    stem = run_stem(staged, z)
    assert stem.shape == (1, 16, 6, 12, 16)                                  # captured before the head stopped it
    halo = measure_halo(staged, stem, out_per_stem=2)
    assert halo == 2                                                          # up (1 px at x2) + conv_out (1 px)
    plan = TilePlan("spatial", 1, (8, 8), math.ceil((2 * halo + 1) / 2), 3, 0, 1, "test")
    out = decode_spatial(staged, z, plan, out_scale=2, halo_px=halo)
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    # without it the stand-in's frame indices select the latent's 3 frames of the stem's 6: half the video
    bad = decode_spatial(m.staged(whole_frames=False), z, plan, out_scale=2, halo_px=halo)
    assert bad.shape[2] == 3 != ref.shape[2]
