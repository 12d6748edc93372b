"""Tile layout, blend weights and the planner (pure functions, CPU)."""
from __future__ import annotations

import pytest
import torch

from comfyui_levers.core.errors import BudgetExceeded, ConfigError
from comfyui_levers.core.tiling import DecodeCost, axis_weights, layout_axis, make_grid, plan_decode

MIB = 1024 ** 2


@pytest.mark.parametrize("length,tile,overlap", [(64, 32, 8), (100, 24, 6), (33, 32, 4), (17, 16, 15), (50, 8, 0)])
def test_layout_covers_the_axis_with_at_least_the_overlap(length, tile, overlap):
    spans = layout_axis(length, tile, overlap)
    assert spans[0].start == 0 and spans[-1].stop == length
    assert all(s.size == min(tile, length) for s in spans)
    for a, b in zip(spans, spans[1:]):
        assert a.start < b.start and a.stop - b.start >= overlap


@pytest.mark.parametrize("tile,overlap,margin", [(16, 6, 4.0), (10, 2, 28.0), (20, 10, 0.0), (12, 11, 3.0)])
def test_blend_weights_sum_to_one_everywhere(tile, overlap, margin):
    grid = make_grid(37, 29, (tile, tile), overlap, scale=8, margin_px=margin)
    total = torch.zeros(37 * 8, 29 * 8, dtype=torch.float64)
    for rs, cs, w in grid:
        assert (w >= 0).all()
        total[rs.start * 8:rs.stop * 8, cs.start * 8:cs.stop * 8] += w
    torch.testing.assert_close(total, torch.ones_like(total), rtol=0, atol=1e-12)


def test_weights_skip_the_margin_when_the_overlap_allows_it():
    spans = layout_axis(40, 28, 16)                        # two tiles, overlapping on [12, 28)
    assert [(s.start, s.stop) for s in spans] == [(0, 28), (12, 40)]
    w0, w1 = axis_weights(spans, 40, 1, margin=5.0, band=6.0)
    assert torch.all(w0[12:17] == 1.0) and torch.all(w1[:5] == 0.0)    # 5 px of margin: tile 0 only
    assert torch.all(w0[-5:] == 0.0) and torch.all(w1[-17:] == 1.0)    # and the other side


def test_bad_layouts_are_refused():
    with pytest.raises(ConfigError, match="overlap"):
        layout_axis(64, 16, 16)
    with pytest.raises(ConfigError, match="tile"):
        layout_axis(64, 0, 0)


COST = DecodeCost(whole_bytes_per_px=4000.0, tile_bytes_per_px=4000.0, stem_bytes_per_px=500.0,
                  stored_bytes_per_px=100.0)


def test_no_tiling_when_the_whole_decode_fits():
    p = plan_decode((2, 16, 64, 64), 8, COST, budget_bytes=2 * 4000 * 512 * 512 + 1)
    assert p.mode == "whole" and p.batch_per_pass == 2 and p.tile is None and p.exact


def test_batch_slicing_before_tiling():
    p = plan_decode((4, 16, 64, 64), 8, COST, budget_bytes=int(1.5 * 4000 * 512 * 512))
    assert p.mode == "whole" and p.batch_per_pass == 1


@pytest.mark.parametrize("shape,budget_mib", [((1, 16, 128, 128), 600), ((1, 16, 128, 128), 540),
                                               ((1, 16, 90, 160), 520), ((1, 16, 64, 200), 450)])
def test_auto_tiles_fit_and_recompute_the_least(shape, budget_mib):
    """Among every tile size that fits the budget (checked by brute force over all sizes, laid out as the
    decode lays them out), the planner's tiles compute the fewest tail pixels, overlaps included."""
    h, w = shape[-2:]
    budget = budget_mib * MIB
    p = plan_decode(shape, 8, COST, budget_bytes=budget, halo_px=20.0)
    assert p.mode == "spatial" and p.exact and p.overlap * 8 >= 2 * 20 + 1
    assert p.predicted_peak_bytes <= budget

    def work(th, tw):
        rows, cols = layout_axis(h, th, p.overlap), layout_axis(w, tw, p.overlap)
        return sum(r.size for r in rows) * sum(c.size for c in cols)

    def fits(th, tw):
        return 100.0 * h * w * 64 + COST.tile_bytes_per_px * th * tw * 64 <= budget

    best = min(work(th, tw) for th in range(p.overlap + 1, h + 1) for tw in range(p.overlap + 1, w + 1)
               if fits(th, tw))
    assert work(*p.tile) == best
    assert p.work_ratio == pytest.approx(best / (h * w)) and f"{p.work_ratio:.2f}x" in p.reason


def test_auto_tiles_beat_the_largest_square_that_fits():
    """The old rule (largest square tile that fits) recomputes more: 1024 px, a budget for ~60-latent tiles."""
    p = plan_decode((1, 16, 128, 128), 8, COST, budget_bytes=int((100 * 128 * 128 + 4000 * 60 * 60) * 64),
                    halo_px=20.0)
    square = sum(r.size for r in layout_axis(128, 60, p.overlap)) ** 2 / 128 ** 2
    assert p.work_ratio < square - 0.3, (p.work_ratio, square)


def test_user_tile_below_receptive_field_is_flagged_not_exact():
    p = plan_decode((1, 16, 64, 64), 8, COST, budget_bytes=10 ** 12, halo_px=20.0, tile=32, overlap=2)
    assert p.mode == "spatial" and not p.exact and "receptive field" in p.reason


def test_video_uses_temporal_chunks_first():
    cost = DecodeCost(whole_bytes_per_px=3000.0, tile_bytes_per_px=3000.0, output_bytes_per_px=12.0)
    whole = 3000.0 * 512 * 512 + 12.0 * 512 * 512 * 81
    p = plan_decode((1, 16, 21, 64, 64), 8, cost, budget_bytes=int(whole * 0.9), temporal_supported=True,
                    out_frames=81)
    assert p.mode == "temporal" and p.chunk_frames == 1


def test_video_tiles_that_hold_all_their_frames_count_them():
    """A decoder that runs all frames of a tile in one call keeps the tile's output frames on the device:
    the tile search counts them, so it picks smaller tiles than for a tile that hands frames off per chunk."""
    cost = DecodeCost(whole_bytes_per_px=3000.0, tile_bytes_per_px=3000.0, stem_bytes_per_px=100.0,
                      output_bytes_per_px=1000.0)
    shape, budget = (1, 16, 21, 64, 64), 300 * MIB
    per_chunk = plan_decode(shape, 8, cost, budget_bytes=budget, halo_px=8.0, out_frames=81)
    held = plan_decode(shape, 8, cost, budget_bytes=budget, halo_px=8.0, out_frames=81, tile_out_frames=81)
    assert per_chunk.mode == held.mode == "spatial"
    assert held.tile[0] < per_chunk.tile[0] and held.predicted_peak_bytes <= budget
    tile_px = held.tile[0] * held.tile[1] * 64
    assert held.predicted_peak_bytes >= cost.output_bytes_per_px * tile_px * 81


def test_output_kept_on_the_decode_device_is_counted_in_chunks_and_tiles():
    """Found in review: with ComfyUI's output device the decode's (--gpu-only, --cpu-vae) the decoded frames and the
    tile canvas grow there while chunks and tiles run, then are joined (two copies); the plans counted one chunk's
    frames and no canvas, so "fits the budget" was optimistic by the whole video (~0.4 GiB per float32 copy at
    81 frames of 832x480)."""
    cost = DecodeCost(whole_bytes_per_px=3000.0, tile_bytes_per_px=3000.0, stem_bytes_per_px=100.0,
                      output_bytes_per_px=24.0)
    shape, frame_px = (1, 16, 21, 64, 64), 512 * 512
    kept = 81 * frame_px * 3 * 4
    whole = 3000.0 * frame_px + 24.0 * frame_px * 81
    free = plan_decode(shape, 8, cost, budget_bytes=int(whole * 0.9), temporal_supported=True, out_frames=81)
    stays = plan_decode(shape, 8, cost, budget_bytes=int(whole * 0.9), temporal_supported=True, out_frames=81,
                        kept_output_bytes=kept)
    assert free.mode == stays.mode == "temporal"
    assert stays.predicted_peak_bytes == max(free.predicted_peak_bytes + kept, 2 * kept)
    tiles = plan_decode(shape, 8, cost, budget_bytes=600 * MIB, halo_px=8.0, out_frames=81)
    tiles_stay = plan_decode(shape, 8, cost, budget_bytes=600 * MIB, halo_px=8.0, out_frames=81,
                             kept_output_bytes=kept)
    assert tiles.mode == tiles_stay.mode == "spatial"
    assert tiles_stay.tile[0] * tiles_stay.tile[1] < tiles.tile[0] * tiles.tile[1]
    assert kept < tiles_stay.predicted_peak_bytes <= 600 * MIB
    # a decoder streamed through time has the frames that stay in its measured base: not added twice
    streamed = DecodeCost(whole_bytes_per_px=3000.0, tile_bytes_per_px=3000.0, output_bytes_per_px=24.0,
                          stream_base_bytes_per_px=500.0, stream_frame_bytes_per_px=200.0)
    base = plan_decode(shape, 8, streamed, budget_bytes=int(whole * 0.9), temporal_supported=True, out_frames=81)
    again = plan_decode(shape, 8, streamed, budget_bytes=int(whole * 0.9), temporal_supported=True, out_frames=81,
                        kept_output_bytes=kept)
    assert base.mode == again.mode == "temporal" and base.predicted_peak_bytes == again.predicted_peak_bytes
    with pytest.raises(BudgetExceeded):          # the join alone does not fit
        plan_decode(shape, 8, cost, budget_bytes=int(1.5 * kept), halo_px=8.0, out_frames=81,
                    temporal_supported=True, kept_output_bytes=kept)


def test_budget_too_small_raises_with_numbers():
    with pytest.raises(BudgetExceeded, match=r"needs [0-9.]+ (GiB|MiB) but only 0\.0 MiB"):
        plan_decode((1, 16, 64, 64), 8, COST, budget_bytes=1000, halo_px=8.0)


@pytest.mark.parametrize("kwargs,field", [(dict(tile=0), "tile_size"), (dict(overlap=-1), "overlap"),
                                          (dict(chunk_frames=0), "temporal_size")])
def test_bad_inputs_name_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        plan_decode((1, 16, 64, 64), 8, COST, budget_bytes=10 ** 9, **kwargs)


def test_bad_latent_rank_is_refused():
    with pytest.raises(ConfigError, match="samples"):
        plan_decode((16, 64, 64), 8, COST, budget_bytes=10 ** 9)


def test_auto_overlap_is_clamped_below_a_small_user_tile():
    from comfyui_levers.core.tiling.plan import DecodeCost, plan_decode

    cost = DecodeCost(whole_bytes_per_px=100.0, tile_bytes_per_px=100.0, stem_bytes_per_px=1.0,
                      stored_bytes_per_px=1.0)
    p = plan_decode((1, 4, 64, 64), 8, cost, 2**40, halo_px=40.0, tile=4)   # auto overlap would be 81px > 32px tile
    assert p.tile == (4, 4) and 0 < p.overlap < 4
    assert "clamped" in p.reason and not p.exact


def test_overlap_only_counts_along_the_axis_that_is_cut():
    """A wide frame whose height fits one tile: the overlap may exceed the height, not the tile width."""
    p = plan_decode((1, 16, 8, 36), 16, COST, budget_bytes=10 ** 12, halo_px=196.0, tile=32, overlap=25)
    assert p.mode == "spatial" and p.tile == (8, 32) and p.overlap == 25 and p.exact
    assert len(make_grid(8, 36, p.tile, p.overlap, 16)) == 2
    # an overlap as wide as the tile is a quarter of it, as VAEDecodeTiled takes it (it was an error: that node's
    # defaults, tile 64 overlap 64, failed here)
    p = plan_decode((1, 16, 8, 36), 16, COST, budget_bytes=10 ** 12, tile=32, overlap=32)
    assert p.tile == (8, 32) and p.overlap == 8 and "a quarter of the tile, as VAEDecodeTiled" in p.reason
    p = plan_decode((1, 16, 64, 64), 8, COST, budget_bytes=10 ** 12, tile=8, overlap=512)
    assert p.overlap == 2 and len(make_grid(64, 64, p.tile, p.overlap, 8)) > 1


def test_layered_between_whole_and_tiles():
    """An image that does not fit whole decodes layered when that fits (exact, no recomputed tiles); below the
    layered peak the planner tiles; a user tile size or a video latent never picks it."""
    import dataclasses
    cost = dataclasses.replace(COST, layered_bytes_per_px=2000.0)
    px = 512 * 512
    p = plan_decode((2, 16, 64, 64), 8, cost, budget_bytes=3000 * px)
    assert p.mode == "layered" and p.exact and p.tile is None and p.predicted_peak_bytes == 2000 * px
    assert "row bands" in p.reason and "mode=layered" in p.describe(8)
    assert plan_decode((1, 16, 64, 64), 8, cost, budget_bytes=1900 * px).mode == "spatial"
    assert plan_decode((1, 16, 64, 64), 8, COST, budget_bytes=3000 * px).mode == "spatial"      # not measured
    assert plan_decode((1, 16, 64, 64), 8, cost, budget_bytes=3000 * px, tile=32).mode == "spatial"
    assert plan_decode((2, 16, 64, 64), 8, cost, budget_bytes=4001 * px).mode == "whole"        # batch slicing
    assert plan_decode((1, 16, 3, 64, 64), 8, cost, budget_bytes=3000 * px,
                       temporal_supported=False).mode == "spatial"


def test_streamed_video_takes_the_longest_chunk_that_fits():
    """A decoder streamed through time costs base + per frame of the chunk; auto picks the longest that fits
    (each chunk recomputes its units' context), a user's temporal_size is kept."""
    cost = DecodeCost(whole_bytes_per_px=4000, tile_bytes_per_px=100, stream_base_bytes_per_px=200,
                      stream_frame_bytes_per_px=100)
    frame_px = 32 * 32 * 64
    budget = int((200 + 100 * 5.5) * frame_px)
    plan = plan_decode((1, 8, 13, 32, 32), 8, cost, budget, temporal_supported=True, out_frames=97)
    assert plan.mode == "temporal" and plan.chunk_frames == 5
    assert plan.predicted_peak_bytes == (200 + 100 * 5) * frame_px <= budget
    assert "context frames" in plan.reason
    user = plan_decode((1, 8, 13, 32, 32), 8, cost, budget, temporal_supported=True, chunk_frames=2)
    assert user.chunk_frames == 2
    roomy = plan_decode((1, 8, 13, 32, 32), 8, cost, 10 ** 12, temporal_supported=True, chunk_frames=None)
    assert roomy.mode == "whole"


def test_a_tile_covering_the_frame_keeps_temporal_chunks_and_the_budget():
    """VAEDecodeTiled-style settings (tile 1024 px, temporal 16 frames) on an 832x480 video: no spatial tiles,
    but the chunks asked for and the budget still hold (they were dropped for a whole decode)."""
    cost = DecodeCost(whole_bytes_per_px=1000, tile_bytes_per_px=800, stem_bytes_per_px=20, stored_bytes_per_px=4,
                      output_bytes_per_px=24)
    shape, budget = (1, 16, 21, 60, 104), int(0.8 * 2 ** 30)
    p = plan_decode(shape, 8, cost, budget, tile=128, chunk_frames=4, temporal_supported=True, out_frames=81,
                    halo_px=20)
    assert p.mode == "temporal" and p.chunk_frames == 4 and p.predicted_peak_bytes <= budget, p
    assert p.reason.startswith("tile_size covers the whole 480x832px frame")
    # an image that fits whole with a covering tile decodes whole, as before
    img = plan_decode((1, 16, 60, 104), 8, cost, 10 ** 12, tile=128, halo_px=20)
    assert img.mode == "whole" and "covers the whole" in img.reason
    # one that does not fit runs the node's own plan instead of a whole decode over the budget
    small = plan_decode((1, 16, 60, 104), 8, cost, 2 * 10 ** 8, tile=128, halo_px=20)
    assert small.mode == "spatial" and small.predicted_peak_bytes <= 2 * 10 ** 8


def test_auto_tiles_with_a_user_overlap_below_the_receptive_field_do_not_claim_exact():
    cost = DecodeCost(whole_bytes_per_px=1000, tile_bytes_per_px=800, stem_bytes_per_px=20, stored_bytes_per_px=4)
    p = plan_decode((1, 16, 64, 64), 8, cost, 10 ** 8, halo_px=20, overlap=1)
    assert p.mode == "spatial" and not p.exact
    assert "seams are blended, not exact" in p.reason and "tiles are exact" not in p.reason



WAN_033 = DecodeCost(whole_bytes_per_px=1400.0, tile_bytes_per_px=30000.0, stem_bytes_per_px=300.0,
                     stored_bytes_per_px=40.0, output_bytes_per_px=12.0)   # a tile dearer per pixel than the whole


def _least_budget(shape, cost, kw) -> int:
    """The smallest budget plan_decode plans within, by bisection."""
    lo, hi = 1, 1 << 40
    while lo < hi:
        mid = (lo + hi) // 2
        try:
            plan_decode(shape, 8, cost, budget_bytes=mid, halo_px=8.0, **kw)
            hi = mid
        except BudgetExceeded:
            lo = mid + 1
    return lo


@pytest.mark.parametrize("shape,cost,kw,least", [
    ((1, 16, 64, 64), DecodeCost(4000.0, 4000.0, 10.0), {}, "smallest tile"),
    ((1, 16, 64, 64), COST, {}, "low-resolution stem"),
    ((3, 16, 24, 24), DecodeCost(50.0, 3000.0, 10.0), {}, "whole decode, one image at a time"),
    ((1, 16, 64, 64), DecodeCost(3000.0, 3000.0, 400.0, layered_bytes_per_px=150.0), {}, "layered decode"),
    ((1, 16, 5, 16, 16), WAN_033, dict(temporal_supported=True, out_frames=17), "temporal chunks"),
    ((1, 16, 5, 16, 16), WAN_033, dict(temporal_supported=True, out_frames=17, chunk_frames=5), "temporal chunks"),
    ((1, 16, 3, 16, 16), WAN_033, dict(out_frames=9), "whole decode"),
    ((1, 128, 4, 16, 16), DecodeCost(3000.0, 3000.0, 1000.0, stream_base_bytes_per_px=200.0,
                                     stream_frame_bytes_per_px=300.0),
     dict(temporal_supported=True, out_frames=25), "temporal chunks"),
])
def test_budget_error_names_the_least_any_plan_needs(shape, cost, kw, least):
    """Found in review: the error named the first check that failed (the stem, then the smallest tile), so on
    ComfyUI 0.33's Wan VAE it advised about twice what the whole decode needs. Now it names the cheapest plan:
    the smallest budget that plans (found by bisection) is the one the error gives."""
    with pytest.raises(BudgetExceeded) as info:
        plan_decode(shape, 8, cost, budget_bytes=1000, halo_px=8.0, **kw)
    assert info.value.component == f"VAE decode ({least})", str(info.value)
    assert info.value.needed_bytes == _least_budget(shape, cost, kw)


def test_batch_slices_take_as_many_images_as_fit():
    """Found by mutation testing: the one slicing test had room for one image per pass, so decoding fewer per pass
    than fit (slower) went unnoticed."""
    cost = DecodeCost(whole_bytes_per_px=4000.0, tile_bytes_per_px=4000.0, stem_bytes_per_px=500.0,
                      stored_bytes_per_px=100.0)
    p = plan_decode((4, 16, 64, 64), 8, cost, budget_bytes=int(2.5 * 4000 * 512 * 512))
    assert p.mode == "whole" and p.batch_per_pass == 2
