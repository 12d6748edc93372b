"""Group prefetch when forwards skip blocks (skip-layer guidance, Chroma's skip_mmdit): the engine learns each
kind of forward's route, copies only the groups that run and prefetches across the skipped ones."""
from __future__ import annotations

import pytest
import torch

from comfyui_levers.core.residency.prefetch import CALIBRATION_FORWARD, PrefetchConfig, apply_group_prefetch
from comfyui_levers.core.residency.transport import CpuTransport, RecordingTransport
from prefetch_toys import make_wan, wan_inputs

BIG = 10 ** 9


def _bytes(h, groups):
    return sum((hi - lo) * d.itemsize for gi in groups for d, (lo, hi) in h.groups[gi].spans.items())


def _ref(m, x, t, skip):
    m.skip = set(skip)
    with torch.no_grad():
        return m(x, t)


def _install(m, **kw):
    cfg = dict(blocks_per_group=1, prefetch_depth=1, resident_groups=0, budget_bytes=BIG, partial_blocks=False)
    cfg.update(kw)
    return apply_group_prefetch(m, PrefetchConfig(**cfg), RecordingTransport(CpuTransport()), bandwidth=0)


def test_a_block_every_forward_skips_is_never_copied_and_its_neighbours_do_not_miss():
    m = make_wan(n=6)
    x, t = wan_inputs()
    ref = _ref(m, x, t, {3})
    h = _install(m)
    try:
        ran = [gi for gi in h.stream_order if gi != 3]
        with torch.no_grad():
            out = m(x, t)                    # learns the route (block 3 is copied, block 4 misses)
            assert torch.equal(out, ref)
            for _ in range(3):
                out = m(x, t)
                assert torch.equal(out, ref)
                assert h.last.misses == 0
                assert h.last.h2d_bytes == _bytes(h, ran) < _bytes(h, h.stream_order)
                assert h.last.skipped_groups == 1
        copied = {op.tag for op in h.transport.ops[-40:] if op.kind == "h2d"}
        assert "group3" not in copied and "group4" in copied
        assert "skipped blocks: 1 kind(s) of forward" in h.report() and "1 streamed group(s) left out" in h.report()
    finally:
        h.remove()


def test_alternating_full_and_skip_layer_forwards_each_copy_their_own_groups_without_misses():
    """SkipLayerGuidanceDiTSimple's pattern: per step a full forward (cond) then one that skips blocks (uncond),
    labelled apart by route_key, as the ComfyUI node does from the replaced blocks."""
    m = make_wan(n=6)
    x, t = wan_inputs()
    full, slg = _ref(m, x, t, set()), _ref(m, x, t, {2, 3})
    m.skip = set()
    h = _install(m, prefetch_depth=2)
    try:
        with torch.no_grad():
            for step in range(4):
                for key, skip, ref in ((None, set(), full), ("slg", {2, 3}, slg)):
                    h.route_key, m.skip = key, skip
                    out = m(x, t)
                    assert torch.equal(out, ref)
                    if step >= 1:            # both routes and their succession learned in the first step
                        route = [gi for gi in h.stream_order if gi not in skip]
                        assert h.last.misses == 0, (step, key)
                        assert h.last.h2d_bytes == _bytes(h, route), (step, key)
                        assert h.last.d2h_bytes == 0
    finally:
        h.remove()


def test_a_group_that_runs_after_its_key_skipped_it_costs_one_miss_and_prefetching_resumes():
    m = make_wan(n=6)
    x, t = wan_inputs()
    skipped, full = _ref(m, x, t, {1}), _ref(m, x, t, set())
    h = _install(m)
    try:
        with torch.no_grad():
            m.skip = {1}
            m(x, t)
            assert torch.equal(m(x, t), skipped) and h.last.misses == 0
            m.skip = set()                   # same key, block 1 runs again
            assert torch.equal(m(x, t), full)
            assert h.last.misses == 1        # group 1 loads on demand; 2..5 are prefetched again
            assert torch.equal(m(x, t), full)
            assert h.last.misses == 0 and h.last.h2d_bytes == _bytes(h, h.stream_order)
    finally:
        h.remove()


def test_a_skipped_group_inside_the_resident_prefix_changes_nothing():
    m = make_wan(n=6)
    x, t = wan_inputs()
    ref = _ref(m, x, t, {0})
    h = _install(m, resident_groups=2)
    try:
        with torch.no_grad():
            for _ in range(3):
                assert torch.equal(m(x, t), ref)
            assert h.last.misses == 0 and h.last.skipped_groups == 0
            assert h.last.h2d_bytes == _bytes(h, h.stream_order)
    finally:
        h.remove()


def test_calibration_waits_for_a_forward_that_runs_every_block():
    m = make_wan(n=6)
    x, t = wan_inputs()
    h = _install(m)
    try:
        with torch.no_grad():
            for i in range(CALIBRATION_FORWARD):
                m(x, t)
            m.skip = {3}
            m(x, t)                          # the calibration forward skips block 3: not measured
            assert h.block_compute_s is None
            m.skip = set()
            m(x, t)
        assert h.block_compute_s is not None and all(s > 0 for s in h.block_compute_s)
    finally:
        h.remove()


def test_a_block_skipped_in_every_forward_is_calibrated_as_free_after_the_retries():
    m = make_wan(n=6)
    x, t = wan_inputs()
    m.skip = {3}
    h = _install(m)
    try:
        with torch.no_grad():
            for _ in range(12):
                m(x, t)
        assert h.block_compute_s is not None and h.block_compute_s[3] == 0.0
        assert all(s > 0 for i, s in enumerate(h.block_compute_s) if i != 3)
    finally:
        h.remove()


def test_the_route_key_of_a_comfyui_call_names_the_blocks_it_replaces():
    from comfyui_levers.bridge.prefetch import route_key

    skip = lambda args, extra: args          # noqa: E731  (SkipLayerGuidance's replacement)
    slg = {"patches_replace": {"dit": {("double_block", 2): skip, ("double_block", 5): skip}}}
    assert route_key(slg) == frozenset({("dit", ("double_block", 2)), ("dit", ("double_block", 5))})
    assert route_key(slg) != route_key({"patches_replace": {"dit": {("double_block", 2): skip}}})
    assert route_key({}) is None and route_key(None) is None and route_key({"patches_replace": {}}) is None
    assert route_key({"patches_replace": {"dit": [skip]}}) is None    # not a table of replaced blocks


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_a_group_loaded_on_demand_does_not_evict_the_groups_prefetched_for_what_follows(depth):
    """Block 1 and 3 skipped for three forwards, then everything runs: group 1 loads on demand, and the group
    already prefetched right after it keeps its slot (before, the on-demand load evicted it, and it was copied
    twice). A group prefetched further ahead may still have to give way to the groups the full order now puts
    before it (depth >= 2: slots hold only depth groups ahead), and is copied again when its turn comes."""
    m = make_wan(n=8)
    x, t = wan_inputs()
    full = _ref(m, x, t, set())
    h = _install(m, prefetch_depth=depth)
    try:
        with torch.no_grad():
            m.skip = {1, 3}
            for _ in range(3):
                m(x, t)
            m.skip = set()
            start = len(h.transport.ops)
            assert torch.equal(m(x, t), full)
        assert h.last.misses == 1
        copies = [op.tag for op in h.transport.ops[start:] if op.kind == "h2d"]
        assert copies.count("group2") == 1, copies
        if depth == 1:
            assert len(copies) == len(set(copies)), copies        # no group copied twice in one forward
    finally:
        h.remove()


def test_a_group_with_one_skipped_block_stays_in_the_prefetch_order():
    """Found by mutation testing: with groups of 2, a group whose other block runs dropped out of the learned route
    when any of its blocks was skipped, and loaded on demand at every forward."""
    m, (x, t) = make_wan(n=8), wan_inputs()
    m.skip = {3}
    h = apply_group_prefetch(m, PrefetchConfig(2, 1, 0, BIG, partial_blocks=False), RecordingTransport(CpuTransport()),
                             bandwidth=0)
    try:
        with torch.no_grad():
            m(x, t)
            for _ in range(2):
                m(x, t)
                assert h.last.misses == 0
    finally:
        h.remove()
