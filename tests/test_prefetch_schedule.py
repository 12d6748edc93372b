"""Group prefetch on CPU through the recording transport: schedule, byte ledger, budget, outputs."""
from __future__ import annotations

import shutil

import pytest
import torch

from comfyui_levers.core.errors import BudgetExceeded, ConfigError
from comfyui_levers.core.residency.blocks import find_blocks
from comfyui_levers.core.residency.prefetch import (AUTO, HostStore, PrefetchConfig, apply_group_prefetch,
                                                    plan_groups, simulate_forward)
from comfyui_levers.core.residency.transport import CpuTransport, RecordingTransport
from prefetch_toys import flux_inputs, make_flux, make_wan, wan_inputs

BIG = 10 ** 9


def _rec():
    return RecordingTransport(CpuTransport())


def _forward_ops(tr, start):
    return tr.ops[start:]


def _streamed_bytes(handle):
    return sum((hi - lo) * d.itemsize for gi in handle.stream_order for d, (lo, hi) in handle.groups[gi].spans.items())


@pytest.fixture
def flux_run():
    m = make_flux(fp8_single=True)
    x = flux_inputs()
    with torch.no_grad():
        ref = m(*x)
    tr = _rec()
    h = apply_group_prefetch(m, PrefetchConfig(blocks_per_group=2, prefetch_depth=1, resident_groups=1,
                                               budget_bytes=BIG), tr, bandwidth=0)
    yield m, x, ref, tr, h
    h.remove()


def test_schedule_prefetch_before_compute_wait_before_release_after(flux_run):
    m, x, ref, tr, h = flux_run
    with torch.no_grad():
        m(*x)                       # warm-up forward: starts the wrap-around
        start = len(tr.ops)
        m(*x)
    ops = tr.ops                    # the steady-state forward's first copy was issued in the warm-up
    order = h.stream_order
    assert len(order) == 3

    def first(kind, tag, after):
        return next(i for i in range(after + 1, len(ops)) if ops[i].kind == kind and ops[i].tag == tag)

    computes = [first("compute", f"group{g}", start - 1) for g in order]
    assert computes == sorted(computes), "groups must compute in execution order"
    for i, g in enumerate(order):
        tag, c = f"group{g}", computes[i]
        # compute waits on this group's copy event right before it starts
        w = max(j for j in range(c) if ops[j].kind == "wait" and ops[j].tag == tag)
        assert all(ops[j].kind != "compute" for j in range(w + 1, c))
        rec = max(j for j in range(w) if ops[j].kind == "record" and ops[j].tag == tag)
        cp = max(j for j in range(rec) if ops[j].kind == "h2d" and ops[j].tag == tag)
        # every copy into a slot follows wait_compute for that same group
        wc = max(j for j in range(cp) if ops[j].kind == "wait_compute")
        assert ops[wc].tag == tag and all(ops[j].kind == "h2d" for j in range(wc + 1, cp + 1))
        # the next streamed group (wrapping to the first one for the next forward) is copied
        # before this group computes
        nxt = f"group{order[(i + 1) % len(order)]}"
        assert any(ops[j].kind == "h2d" and ops[j].tag == nxt for j in range(computes[i - 1] if i else start, c)), \
            (tag, nxt)
        # released after its compute, before the next group computes
        r = first("release", tag, c)
        if i + 1 < len(computes):
            assert r < computes[i + 1]
    assert not any(op.kind == "d2h" for op in ops[start:])


def test_wrap_around_the_next_forward_finds_the_first_group_already_copied(flux_run):
    m, x, ref, tr, h = flux_run
    with torch.no_grad():
        m(*x)
        m(*x)
    last_compute = max(i for i, op in enumerate(tr.ops) if op.kind == "compute")
    first_tag = f"group{h.stream_order[0]}"
    tail = tr.ops[last_compute - 8:]
    # the copy of the first streamed group was issued while the previous forward was still on its last group
    assert any(op.kind == "h2d" and op.tag == first_tag for op in tr.ops[last_compute - 8:last_compute])
    start = len(tr.ops)
    with torch.no_grad():
        m(*x)
    new = tr.ops[start:]
    first_c = next(i for i, op in enumerate(new) if op.kind == "compute")
    assert not any(op.kind == "h2d" and op.tag == first_tag for op in new[:first_c]), "no second copy"
    assert h.last.misses == 0
    assert tail


def test_ledger_bytes_per_forward_equal_streamed_groups_and_no_d2h(flux_run):
    m, x, ref, tr, h = flux_run
    expected = _streamed_bytes(h)
    assert expected == h.stats()["streamed_bytes_per_forward"]
    with torch.no_grad():
        m(*x)
        for _ in range(3):
            m(*x)
            assert h.last.h2d_bytes == expected
            assert h.last.d2h_bytes == 0
            assert h.last.misses == 0
    assert tr.ledger.d2h_bytes == 0
    assert not tr.kinds("d2h")


def test_two_cfg_halves_per_step_each_stream_the_groups_once():
    m = make_wan()
    x, t = wan_inputs(batch=1)
    x_u, _ = wan_inputs(batch=1, seed=1)
    with torch.no_grad():
        ref_c, ref_u = m(x, t), m(x_u, t)
    tr = _rec()
    h = apply_group_prefetch(m, PrefetchConfig(1, 2, 1, BIG), tr, bandwidth=0)
    expected = _streamed_bytes(h)
    try:
        with torch.no_grad():
            for step in range(3):
                out_c = m(x, t)
                if step:
                    assert h.last.h2d_bytes == expected and h.last.misses == 0
                out_u = m(x_u, t)
                assert h.last.h2d_bytes == expected and h.last.misses == 0
                assert torch.equal(out_c, ref_c) and torch.equal(out_u, ref_u)
    finally:
        h.remove()


@pytest.mark.parametrize("cfg", [
    PrefetchConfig(1, 1, 0, BIG),
    PrefetchConfig(2, 1, 1, BIG),
    PrefetchConfig(3, 2, 0, BIG),
    PrefetchConfig(1, 3, 2, BIG),
    PrefetchConfig(8, 1, 0, BIG),          # one group: stays in its slot
])
def test_outputs_bit_identical_flux(cfg):
    m = make_flux(fp8_single=True)
    x = flux_inputs()
    with torch.no_grad():
        ref = m(*x)
    h = apply_group_prefetch(m, cfg, _rec(), bandwidth=0)
    try:
        with torch.no_grad():
            for _ in range(3):
                assert torch.equal(m(*x), ref)
    finally:
        h.remove()


@pytest.mark.parametrize("inference", [False, True])
def test_outputs_bit_identical_wan_mixed_dtypes(inference):
    m = make_wan(mixed=True)
    x, t = wan_inputs()
    with torch.no_grad():
        ref = m(x, t)
    ctx = torch.inference_mode if inference else torch.no_grad
    with ctx():                     # ComfyUI runs nodes and sampling in inference mode
        h = apply_group_prefetch(m, PrefetchConfig(2, 1, 0, BIG), _rec(), bandwidth=0)
        try:
            assert {d for d in h.store.arenas} == {torch.float32, torch.bfloat16}
            for _ in range(3):
                assert torch.equal(m(x, t), ref)
            assert not any(p.is_inference() for p in m.parameters())
        finally:
            h.remove()


@pytest.mark.parametrize("run_mode", ["inference", "no_grad"])
def test_model_built_in_inference_mode(run_mode):
    """ComfyUI builds models inside inference mode: their parameters are inference tensors."""
    with torch.inference_mode():
        m = make_wan(mixed=True)
        x, t = wan_inputs()
        ref = m(x, t)
        h = apply_group_prefetch(m, PrefetchConfig(1, 1, 1, BIG), _rec(), bandwidth=0)
    assert h.store.inference
    ctx = torch.inference_mode if run_mode == "inference" else torch.no_grad
    try:
        with ctx():
            for _ in range(3):
                assert torch.equal(m(x, t), ref)
    finally:
        h.remove()
    with torch.inference_mode():
        assert torch.equal(m(x, t), ref)


def test_quantized_bytes_stream_as_quantized_bytes():
    m = make_flux(fp8_single=True)
    fp8_bytes = sum(b.linear1.weight.numel() for b in m.single_blocks)   # 1 byte each
    tr = _rec()
    # whole blocks, none resident: every byte streams (split blocks would keep most of them resident in this budget)
    h = apply_group_prefetch(m, PrefetchConfig(1, 1, 0, BIG, partial_blocks=False), tr, bandwidth=0)
    try:
        arena = h.store.arenas[torch.float8_e4m3fn]
        assert fp8_bytes <= arena.numel() < fp8_bytes + 64 * len(m.single_blocks)
        with torch.no_grad():
            m(*flux_inputs())
            m(*flux_inputs())
        fp8_copies = sum(hi - lo for g in h.stream_order for d, (lo, hi) in h.groups[g].spans.items()
                         if d == torch.float8_e4m3fn)
        assert fp8_copies == arena.numel()
        assert m.single_blocks[0].linear1.weight.dtype == torch.float8_e4m3fn   # still fp8 on the host
    finally:
        h.remove()


def test_resident_groups_never_exceed_the_budget():
    m = make_wan(n=8)
    layout_bytes = None
    seen = []
    for budget in (60_000, 120_000, 200_000, 400_000):
        tr = _rec()
        try:
            h = apply_group_prefetch(m, PrefetchConfig(1, 1, AUTO, budget), tr, bandwidth=0)
        except BudgetExceeded:
            seen.append(None)
            continue
        try:
            s = h.stats()
            assert s["device_bytes_planned"] <= budget
            assert s["resident_bytes"] + s["slot_bytes"] <= budget
            layout_bytes = h.store.block_bytes()
            seen.append(s["resident_bytes"])
            with torch.no_grad():
                m(*wan_inputs())
        finally:
            h.remove()
    resident = [r for r in seen if r is not None]
    assert resident == sorted(resident) and resident[-1] > resident[0]
    assert layout_bytes is not None


def _tight(m, tr, slots=2):
    """A budget that holds the remainder, half the blocks and ``slots`` whole-block slots."""
    probe = apply_group_prefetch(m, PrefetchConfig(AUTO, AUTO, AUTO, BIG), tr, bandwidth=0)
    try:
        blocks = probe.store.block_bytes()
        return probe.remainder_bytes + sum(blocks) // 2 + slots * max(blocks)
    finally:
        probe.remove()


@pytest.mark.parametrize("make,inputs", [(make_wan, wan_inputs), (lambda: make_flux(fp8_single=True), flux_inputs)])
def test_split_blocks_stream_fewer_bytes_in_the_same_budget_bit_identical(make, inputs):
    m = make()
    x = inputs()
    with torch.no_grad():
        ref = m(*x)
    budget = _tight(m, _rec())
    whole_tr, split_tr = _rec(), _rec()
    whole = apply_group_prefetch(m, PrefetchConfig(1, 1, AUTO, budget, partial_blocks=False), whole_tr, bandwidth=0)
    try:
        with torch.no_grad():
            m(*x)
            assert torch.equal(m(*x), ref)
        whole_bytes = whole.last.h2d_bytes
        assert not whole.plan.split
    finally:
        whole.remove()
    h = apply_group_prefetch(m, PrefetchConfig(1, 1, AUTO, budget), split_tr, bandwidth=0)
    try:
        assert h.plan.split
        s = h.stats()
        assert s["resident_bytes"] + s["slot_bytes"] <= budget
        with torch.no_grad():
            m(*x)
            out = m(*x)
        assert torch.equal(out, ref)
        assert h.last.h2d_bytes == h.plan.streamed_bytes == _streamed_bytes(h)
        assert h.last.d2h_bytes == 0
        assert h.last.h2d_bytes < whole_bytes
        # the slot is smaller than a whole block, and the split blocks keep their tails resident
        assert s["slot_bytes"] < 2 * max(h.store.block_bytes())
        assert s["split_blocks"] > 0 and "split blocks:" in h.report()
        tails = [e for gi, k in enumerate(h.plan.cuts) for e in h.store.by_block[gi][k:]]
        assert tails and all(e.refs[0].get().data_ptr() != e.host_view.data_ptr() for e in tails)
    finally:
        h.remove()
    with torch.no_grad():
        assert torch.equal(m(*x), ref)     # removed: the plain module again


@pytest.mark.parametrize("make,inputs", [(make_wan, wan_inputs), (lambda: make_flux(fp8_single=True), flux_inputs)])
def test_split_plan_spends_the_budget_a_common_cap_leaves_over(make, inputs, monkeypatch):
    """One cap for every block moves in steps of one tensor per block; the leftover budget then keeps single
    tensors of some blocks resident, so fewer bytes stream in the same budget, bit-identical."""
    from comfyui_levers.core.residency import prefetch as engine

    m = make()
    x = inputs()
    with torch.no_grad():
        ref = m(*x)
    with monkeypatch.context() as mp:
        mp.setattr(engine, "spend_leftover", lambda heads, cuts, spare, depth: tuple(cuts))
        probe = apply_group_prefetch(m, PrefetchConfig(1, 1, AUTO, _tight(m, _rec())), _rec(), bandwidth=0)
        heads = [probe.store.head_bytes(b) for b in range(probe.store.n_blocks)]
        step = max(heads[b][k] - heads[b][k - 1] for b, k in enumerate(probe.plan.cuts) if k)
        # room for two or three more tensors, far less than one more tensor in every block (the next common cap)
        budget = probe.plan.device_bytes + int(2.5 * step)
        probe.remove()
        capped = apply_group_prefetch(m, PrefetchConfig(1, 1, AUTO, budget), _rec(), bandwidth=0)
        capped_plan = capped.plan
        capped.remove()
    h = apply_group_prefetch(m, PrefetchConfig(1, 1, AUTO, budget), _rec(), bandwidth=0)
    try:
        p = h.plan
        assert p.split and capped_plan.split
        assert p.streamed_bytes < capped_plan.streamed_bytes
        assert capped_plan.device_bytes < p.device_bytes <= budget
        # what is left is smaller than any tensor that could still move (or the stream is at its minimum)
        heads = [h.store.head_bytes(b) for b in range(h.store.n_blocks)]
        steps = [heads[b][k] - heads[b][k - 1] for b, k in enumerate(p.cuts) if k > 1]
        assert not steps or budget - p.device_bytes < min(steps)
        assert sum(p.cuts) < sum(capped_plan.cuts)                    # tensors moved from the stream to the tails
        assert sum(1 for k in p.cuts if k) >= p.prefetch_depth + 2    # and the stream still cycles
        with torch.no_grad():
            m(*x)
            assert torch.equal(m(*x), ref)
        assert h.last.h2d_bytes == p.streamed_bytes == _streamed_bytes(h)
    finally:
        h.remove()


def test_split_plan_remove_restores_every_tensor():
    m = make_flux(fp8_single=True)
    before = {n: (t.clone(), t.stride(), t.device) for n, t in m.state_dict(keep_vars=True).items()}
    h = apply_group_prefetch(m, PrefetchConfig(1, 1, AUTO, _tight(m, _rec())), _rec(), bandwidth=0)
    assert h.plan.split
    with torch.no_grad():
        m(*flux_inputs())
    h.remove()
    for n, t in m.state_dict(keep_vars=True).items():
        v, stride, device = before[n]
        assert t.device == device and t.stride() == stride and torch.equal(t.float(), v.float()), n


def test_split_plans_only_when_allowed():
    m = make_wan(n=8)
    budget = _tight(m, _rec())
    built = 0
    for cfg in (PrefetchConfig(2, 1, AUTO, budget), PrefetchConfig(1, 1, 1, budget),
                PrefetchConfig(1, 1, AUTO, budget, partial_blocks=False)):
        try:
            h = apply_group_prefetch(m, cfg, _rec(), bandwidth=0)
        except BudgetExceeded:
            continue
        built += 1
        try:
            assert not h.plan.split, cfg
        finally:
            h.remove()
    assert built, "no configuration built: the test checked nothing"


def test_budget_too_small_raises_budget_exceeded():
    m = make_wan()
    with pytest.raises(BudgetExceeded, match="Raise the VRAM budget"):
        apply_group_prefetch(m, PrefetchConfig(1, 1, 0, 1000), _rec(), bandwidth=0)
    # nothing left behind
    assert not m._forward_pre_hooks and not m.blocks[0]._forward_pre_hooks


def test_remove_restores_the_module_exactly():
    m = make_flux(fp8_single=True)
    params = {n: p for n, p in m.named_parameters()}
    before = {n: (t.clone(), t.stride(), t.dtype, t.device, t.requires_grad) for n, t in m.state_dict(keep_vars=True).items()}
    h = apply_group_prefetch(m, PrefetchConfig(2, 1, 1, BIG), _rec(), bandwidth=0)
    with torch.no_grad():
        m(*flux_inputs())
    h.remove()
    h.remove()   # idempotent
    assert {n: p for n, p in m.named_parameters()} == params          # same Parameter objects
    for n, t in m.state_dict(keep_vars=True).items():
        v, stride, dtype, device, rg = before[n]
        assert t.dtype == dtype and t.device == device and t.stride() == stride and t.requires_grad == rg
        assert torch.equal(t.float(), v.float()), n
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size() or t.numel() == 0  # own storage
    for mod in m.modules():
        assert not mod._forward_pre_hooks and not mod._forward_hooks


def test_blocks_called_out_of_order_are_still_correct():
    m = make_wan()
    x, t = wan_inputs()
    h = apply_group_prefetch(m, PrefetchConfig(1, 1, 0, BIG), _rec(), bandwidth=0)
    try:
        with torch.no_grad():
            e = m.time_embedding(t.reshape(-1, 1, 1)).reshape(x.shape[0], 6, -1)
            hx = m.patch_embedding(x)
            out = m.blocks[4](hx, e)          # a block outside any forward of the root
        h.remove()
        with torch.no_grad():
            ref = m.blocks[4](hx, e)
        assert torch.equal(out, ref)
    finally:
        h.remove()


class _EmbedSequential(torch.nn.Sequential):
    """ComfyUI's TimestepEmbedSequential: the model runs its layers itself, never this forward."""


class _ToyUNet(torch.nn.Module):
    def __init__(self, d=16):
        super().__init__()
        torch.manual_seed(0)
        self.time_embed = torch.nn.Linear(d, d)
        self.input_blocks = torch.nn.ModuleList(
            _EmbedSequential(torch.nn.Linear(d, d), torch.nn.GELU(), torch.nn.Linear(d, d)) for _ in range(3))
        self.middle_block = _EmbedSequential(torch.nn.Linear(d, d), torch.nn.Linear(d, d))
        self.output_blocks = torch.nn.ModuleList(_EmbedSequential(torch.nn.Linear(2 * d, d)) for _ in range(3))
        self.out = torch.nn.Linear(d, d)

    @staticmethod
    def _run(seq, h):              # like ComfyUI's forward_timestep_embed: the layers, one by one
        for layer in seq:
            h = layer(h)
        return h

    def forward(self, x):
        h, hs = x + self.time_embed(x), []
        for blk in self.input_blocks:
            h = self._run(blk, h)
            hs.append(h)
        h = self._run(self.middle_block, h)
        for blk in self.output_blocks:
            h = self._run(blk, torch.cat([h, hs.pop()], -1))
        return self.out(h)


def test_sequential_blocks_whose_layers_the_model_runs_itself_still_stream():
    """ComfyUI's UNet never calls a TimestepEmbedSequential block, only its layers: hooks on the block itself
    never fired, so nothing streamed (on a GPU the layers would have read host weights)."""
    m = _ToyUNet()
    x = torch.randn(2, 16)
    with torch.no_grad():
        ref = m(x)
    tr = _rec()
    h = apply_group_prefetch(m, PrefetchConfig(1, 1, 0, BIG, partial_blocks=False), tr, bandwidth=0)
    try:
        assert h.layout.architecture == "sdxl_unet" and len(h.stream_order) == 7
        expected = _streamed_bytes(h)
        with torch.no_grad():
            assert torch.equal(m(x), ref)      # the first forward also copies the next one's first group
            for _ in range(3):
                assert torch.equal(m(x), ref)
                assert h.last.h2d_bytes == expected > 0 and h.last.d2h_bytes == 0
        assert h.last.misses == 0
        computed = [op.tag for op in tr.ops if op.kind == "compute"][-7:]
        assert computed == [f"group{g}" for g in h.stream_order]
    finally:
        h.remove()
    assert all(not mod._forward_pre_hooks and not mod._forward_hooks for mod in m.modules())
    with torch.no_grad():
        assert torch.equal(m(x), ref)


def test_installed_during_a_forward_of_a_hooked_model_counts_from_the_next_forward():
    """Installed from inside a model call (as a ComfyUI wrapper does) on a module that already has a forward hook:
    torch collected that call's pre-hooks before the engine's existed but runs its end hook, which read a start
    mark never taken (TypeError on the next forward's timing)."""
    m = make_wan()
    x = wan_inputs()
    with torch.no_grad():
        ref = m(*x)
    m.register_forward_hook(lambda mod, args, out: None)    # another node's hook, a profiler...
    handle, forward = {}, m.forward

    def installing_forward(*args):
        if "h" not in handle:
            handle["h"] = apply_group_prefetch(m, PrefetchConfig(1, 1, 0, BIG, partial_blocks=False), _rec(),
                                               bandwidth=0)
        return forward(*args)
    m.forward = installing_forward
    try:
        with torch.no_grad():
            for _ in range(3):
                assert torch.equal(m(*x), ref)
        h = handle["h"]
        assert h.forwards == 2 and h.last.h2d_bytes == _streamed_bytes(h)
        h.stats()
    finally:
        handle["h"].remove()


def test_streamed_groups_that_would_each_keep_a_slot_stay_resident():
    """resident_groups=1 of 3 groups leaves 2 streamed groups for 2 slots: each would keep its slot, nothing would
    move, and the slots hold at least those blocks. The engine keeps every group resident and says why."""
    m = make_wan()
    x = wan_inputs()
    with torch.no_grad():
        ref = m(*x)
    tr = _rec()
    h = apply_group_prefetch(m, PrefetchConfig(2, 1, 1, BIG, partial_blocks=False), tr, bandwidth=0)
    try:
        s = h.stats()
        assert h.stream_order == [] and s["slot_bytes"] == 0 and s["resident_groups"] == 3
        assert any("all groups are resident" in n for n in h.notes), h.notes
        with torch.no_grad():
            for _ in range(2):
                assert torch.equal(m(*x), ref)
                assert h.last.h2d_bytes == 0
    finally:
        h.remove()
    # without a resident prefix the three groups cycle through the two slots as before
    h = apply_group_prefetch(m, PrefetchConfig(2, 1, 0, BIG, partial_blocks=False), _rec(), bandwidth=0)
    try:
        assert len(h.stream_order) == 3
    finally:
        h.remove()


def test_config_validation_names_the_field():
    with pytest.raises(ConfigError, match="blocks_per_group"):
        PrefetchConfig(blocks_per_group=0)
    with pytest.raises(ConfigError, match="prefetch_depth"):
        PrefetchConfig(prefetch_depth="two")
    assert PrefetchConfig(resident_groups="Auto").resident_groups == AUTO


def test_simulated_time_respects_the_floor():
    # compute-bound: copies hide behind compute
    t = simulate_forward(0.0, [1.0] * 6, [0.2] * 6, depth=1)
    assert t == pytest.approx(6.0)
    # transfer-bound: time is the copies
    t = simulate_forward(0.0, [0.1] * 6, [1.0] * 6, depth=2)
    assert t == pytest.approx(6.0, rel=0.05)
    # never below the floor
    for depth in (1, 2, 3):
        t = simulate_forward(0.5, [0.3, 0.1, 0.4], [0.2, 0.5, 0.1], depth=min(depth, 2))
        assert t >= max(0.5 + 0.8, 0.8) - 1e-9


def test_auto_plan_uses_measured_compute_to_choose_groups():
    m = make_wan(n=8)
    tr = _rec()
    h = apply_group_prefetch(m, PrefetchConfig(AUTO, AUTO, AUTO, 150_000), tr, bandwidth=1e9)
    try:
        first = h.plan
        assert first.predicted_s is None                      # before any compute is measured
        with torch.no_grad():
            m(*wan_inputs())
            m(*wan_inputs())                                  # calibration forward
            out = m(*wan_inputs())                            # re-planned from it
        s = h.stats()
        assert h.block_compute_s is not None and len(h.block_compute_s) == 8
        assert s["predicted_s"] is not None and s["floor_s"] is not None
        assert s["predicted_s"] >= s["floor_s"] * 0.999
        assert s["device_bytes_planned"] <= 150_000
        assert "floor max(compute, transfer)" in h.report()
        with torch.no_grad():
            assert torch.equal(m(*wan_inputs()), out)
        # the planner, given the same measurements, is deterministic and within budget
        again = plan_groups(h.store, h.config, 150_000, h.remainder_bytes, 1e9, h.block_compute_s, h.other_compute_s)
        assert (again.blocks_per_group, again.prefetch_depth, again.resident_groups) == \
               (h.plan.blocks_per_group, h.plan.prefetch_depth, h.plan.resident_groups)
    finally:
        h.remove()


def test_the_remainder_is_waited_for_before_compute_reads_it():
    """manage_resident with nothing resident: the embedders and head are copied once, asynchronously on CUDA;
    compute must wait for those copies before its first use of them (there are no resident buffers whose
    wait would cover them)."""
    from comfyui_levers.core.residency.transport import note_compute

    class OffDeviceCpu(CpuTransport):
        """The CPU transport with "device" cpu:0, so host tensors count as off the device, as on CUDA."""
        def __init__(self):
            super().__init__()
            self.device = torch.device("cpu", 0)

    m = make_wan(n=6)
    tr = RecordingTransport(OffDeviceCpu())
    h = apply_group_prefetch(m, PrefetchConfig(1, 1, 0, 10**9, partial_blocks=False), tr, bandwidth=0)
    try:
        m.patch_embedding.register_forward_pre_hook(lambda *a: note_compute(tr, "patch_embedding"))
        with torch.no_grad():
            m(*wan_inputs())
        ops = [(o.kind, o.tag) for o in tr.ops]
        first_use = ops.index(("compute", "patch_embedding"))
        last_copy = max(i for i, o in enumerate(ops) if o == ("h2d", "remainder"))
        assert ("wait", "remainder") in ops[last_copy + 1:first_use], ops[last_copy:first_use + 1]
    finally:
        h.remove()


def test_stats_never_rebuilds_the_slots_a_new_layout_waits_for_the_next_forward(monkeypatch):
    """On CUDA the calibration forward's timings are read at the next forward or by stats(). stats() is what the
    bridge asks at the end of a run, where rebuilding the slots would only allocate memory to free it again (and
    could fail there): it keeps the current layout, and the next forward builds the calibrated one."""
    from dataclasses import replace

    import comfyui_levers.core.residency.prefetch as pf

    m = make_wan(n=8)
    tr = _rec()
    h = apply_group_prefetch(m, PrefetchConfig(AUTO, AUTO, AUTO, 150_000), tr, bandwidth=1e9)
    try:
        with torch.no_grad():
            ref = m(*wan_inputs())
        first = h.plan
        other = replace(first, prefetch_depth=1 if first.prefetch_depth > 1 else 2)
        monkeypatch.setattr(pf, "plan_groups", lambda *a, **k: other)
        h.block_compute_s = None
        h._calibration_pairs = ([], h.clock.mark(), h.clock.mark())     # timings as CUDA leaves them pending
        slots = list(h.slots)
        h.stats()
        assert h.plan is first and h.slots == slots and h._replan_pending
        with torch.no_grad():
            out = m(*wan_inputs())
        assert h.plan is other and not h._replan_pending and torch.equal(out, ref)
    finally:
        h.remove()


def test_planner_prefers_streaming_less_when_the_bus_is_slow():
    m = make_wan(n=8)
    h = apply_group_prefetch(m, PrefetchConfig(AUTO, AUTO, AUTO, BIG), _rec(), bandwidth=0)
    try:
        store, rem = h.store, h.remainder_bytes
        total = sum(store.block_bytes())
        budget = rem + total // 2
        compute = [1e-3] * 8
        fast = plan_groups(store, PrefetchConfig(), budget, rem, 1e12, compute)
        slow = plan_groups(store, PrefetchConfig(), budget, rem, 1e5, compute)
        for p in (fast, slow):
            assert p.device_bytes <= budget
        assert slow.predicted_s > fast.predicted_s
        assert fast.predicted_hidden == pytest.approx(1.0)
    finally:
        h.remove()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("split", [False, True], ids=["whole_blocks", "split_blocks"])
def test_cuda_bit_identical_and_no_d2h(split):
    from comfyui_levers.core.residency.transport import CudaTransport
    m = make_flux(fp8_single=False)
    x = flux_inputs()
    ref_model = make_flux(fp8_single=False).cuda()
    with torch.no_grad():
        ref = ref_model(*(t.cuda() for t in x))
    tr = RecordingTransport(CudaTransport("cuda"))
    config = PrefetchConfig(1, 1, AUTO, _tight(m, _rec())) if split else PrefetchConfig(1, 2, 1, BIG)
    h = apply_group_prefetch(m, config, tr)
    try:
        assert h.plan.split == split
        with torch.no_grad():
            for _ in range(4):          # calibration forward and the re-plan included
                out = m(*(t.cuda() for t in x))
                assert torch.equal(out, ref)
        assert h.last.d2h_bytes == 0
        assert h.last.h2d_bytes == _streamed_bytes(h)
        if not split:
            assert h.stats()["achieved_s"] is not None
    finally:
        h.remove()
    assert all(p.device.type == "cpu" for p in m.parameters())


def test_blocks_compiled_with_torch_compile_stream_bit_identical():
    """torch.compile per block (the engine's hooks are opaque to dynamo; parameters are graph inputs,
    so rebinding their storage needs no recompile). aot_eager: no C compiler needed on CPU."""
    import torch._dynamo
    m = make_wan(n=6)
    x = wan_inputs()
    with torch.no_grad():
        ref = m(*x)
    torch._dynamo.reset()
    for b in m.blocks:
        b.compile(backend="aot_eager")
    h = apply_group_prefetch(m, PrefetchConfig(1, 1, 0, BIG), _rec(), bandwidth=0)
    try:
        with torch.no_grad():
            for _ in range(3):
                assert torch.equal(m(*x), ref)
        assert h.last.h2d_bytes == _streamed_bytes(h) > 0 and h.last.d2h_bytes == 0
    finally:
        h.remove()
        torch._dynamo.reset()
    with torch.no_grad():
        assert torch.equal(m(*x), ref)


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                    reason="inductor needs a C compiler on the CPU")
def test_blocks_compiled_with_inductor_stream_bit_identical_without_recompiling():
    """torch.compile per block with inductor (the default backend): streamed blocks compute exactly what the
    same compiled blocks compute resident, and streaming (parameters rebound to slot storage every step)
    compiles nothing new after the first streamed forward."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    m = make_wan(n=6)
    x = wan_inputs()
    torch._dynamo.reset()
    try:
        for b in m.blocks:
            b.compile()
        with torch.no_grad():
            ref = m(*x)                                   # compiled, resident
        h = apply_group_prefetch(m, PrefetchConfig(1, 1, 0, BIG), _rec(), bandwidth=0)
        try:
            with torch.no_grad():
                assert torch.equal(m(*x), ref)
                compiled = dict(counters["stats"])
                assert compiled.get("unique_graphs", 0) >= 1, compiled      # it did compile
                for _ in range(3):
                    assert torch.equal(m(*x), ref)
            assert dict(counters["stats"]) == compiled, (compiled, dict(counters["stats"]))
            assert h.last.h2d_bytes == _streamed_bytes(h) > 0 and h.last.d2h_bytes == 0
        finally:
            h.remove()
        with torch.no_grad():
            assert torch.equal(m(*x), ref)
    finally:
        torch._dynamo.reset()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_inductor_blocks_stream_bit_identical_without_recompiling():
    """The same on a GPU: blocks compiled by inductor, streamed on the copy stream into device slots, compute
    exactly what the compiled blocks compute resident, with no recompile while their storage is rebound."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    from comfyui_levers.core.residency.transport import CudaTransport
    m = make_wan(n=6)
    x = tuple(t.cuda() for t in wan_inputs())
    torch._dynamo.reset()
    try:
        resident = make_wan(n=6).cuda()
        for b in list(m.blocks) + list(resident.blocks):
            b.compile()
        with torch.no_grad():
            ref = resident(*x)
        del resident
        h = apply_group_prefetch(m, PrefetchConfig(1, 2, 1, BIG), RecordingTransport(CudaTransport("cuda")),
                                 bandwidth=0)
        try:
            with torch.no_grad():
                assert torch.equal(m(*x), ref)
                compiled = dict(counters["stats"])
                for _ in range(3):
                    assert torch.equal(m(*x), ref)
            assert dict(counters["stats"]) == compiled
            assert h.last.d2h_bytes == 0 and h.last.h2d_bytes > 0
        finally:
            h.remove()
    finally:
        torch._dynamo.reset()


def test_comfyui_split_layout_spends_the_leftover_too(monkeypatch):
    """Inside ComfyUI the split is planned per leaf module (ComfyUI loads the tails itself); the same common cap
    leaves budget unused, and the same greedy spends it: fewer bytes stream, the layout still fits."""
    from comfyui_levers.bridge import prefetch as bridge
    from comfyui_levers.core.residency.blocks import find_blocks, module_bytes

    m = make_wan()
    blocks = find_blocks(m).blocks
    other = module_bytes(m) - sum(module_bytes(b) for _, b in blocks)
    sizes = [module_bytes(b) for _, b in blocks]

    def need(layout):
        return other + sum(sizes) - layout.streamed_bytes + 2 * layout.cap      # depth 1: two slots of the cap

    with monkeypatch.context() as mp:
        mp.setattr(bridge, "spend_leftover", lambda heads, cuts, spare, depth: tuple(cuts))
        probe = bridge._split_blocks(blocks, other, other + sum(sizes) // 2 + 2 * max(sizes), 1)
        leaves = [module_bytes(mod) for mod in blocks[0][1].modules() if not any(True for _ in mod.children())]
        budget = need(probe) + int(2.5 * max(leaves))
        capped = bridge._split_blocks(blocks, other, budget, 1)
    filled = bridge._split_blocks(blocks, other, budget, 1)
    assert filled.streamed_bytes < capped.streamed_bytes
    assert other + sum(sizes) - filled.streamed_bytes + 2 * filled.cap <= budget
    assert len(filled.streamed) >= 3                                    # depth + 2 blocks still stream


def test_each_layout_asks_for_its_device_bytes_before_allocating_them(monkeypatch):
    """``reserve`` is how a host (the ComfyUI bridge) frees exactly the room a layout takes, when it takes it: once
    per built layout, before that layout's first device allocation, for at least what it then allocates; and again
    for a calibrated re-plan, after the old slots went back."""
    from dataclasses import replace

    import comfyui_levers.core.residency.prefetch as pf

    m = make_wan(n=8)
    tr = _rec()
    events: list[tuple[str, int]] = []
    empty = tr.empty

    def counting_empty(shape, dtype):
        t = empty(shape, dtype)
        events.append(("alloc", t.numel() * t.element_size()))
        return t
    monkeypatch.setattr(tr, "empty", counting_empty)
    h = apply_group_prefetch(m, PrefetchConfig(1, 1, 1, 10 ** 9, partial_blocks=False), tr, bandwidth=1e9,
                             reserve=lambda n: events.append(("reserve", n)))
    try:
        def builds():
            out, cur = [], None
            for kind, n in events:
                if kind == "reserve":
                    cur = [n, 0]
                    out.append(cur)
                elif cur is not None:
                    cur[1] += n
            return out
        (asked, allocated), = builds()
        assert asked == h.plan.device_bytes - h.remainder_bytes > 0
        assert 0 < allocated <= asked
        assert allocated >= h.stats()["slot_bytes"]
        with torch.no_grad():
            ref = m(*wan_inputs())
        other = replace(h.plan, prefetch_depth=2, device_bytes=h.plan.device_bytes + h.plan.slot_bytes // 2)
        monkeypatch.setattr(pf, "plan_groups", lambda *a, **k: other)
        h._replan()
        assert len(builds()) == 2 and builds()[1][0] == other.device_bytes - h.remainder_bytes
        assert builds()[1][1] > allocated, "the deeper layout allocates one more slot, asked for first"
        with torch.no_grad():
            assert torch.equal(m(*wan_inputs()), ref)
    finally:
        h.remove()


# --- found by mutation testing (2026-12-01): each fails on the mutant it names --------------------------------------

def test_depth_two_copies_two_groups_ahead():
    """With prefetch_depth 2 the copy of group i+2 is issued before group i computes (a depth-1 lookahead passed
    every other test: the extra slot bought nothing)."""
    m, x = make_wan(n=8), wan_inputs()
    tr = _rec()
    h = apply_group_prefetch(m, PrefetchConfig(1, 2, 0, BIG, partial_blocks=False), tr, bandwidth=0)
    try:
        with torch.no_grad():
            m(*x)
            start = len(tr.ops)
            m(*x)
        ops, order = tr.ops, h.stream_order
        for i, g in enumerate(order[:-2]):
            compute = next(j for j in range(start, len(ops)) if ops[j].kind == "compute" and ops[j].tag == f"group{g}")
            two = f"group{order[i + 2]}"
            copies = [j for j in range(start, len(ops)) if ops[j].kind == "h2d" and ops[j].tag == two]
            assert copies and copies[0] < compute, (g, two)
    finally:
        h.remove()


def _bound_to_the_host(h) -> bool:
    return all(r.get().data_ptr() == e.host_view.data_ptr()
               for gi in h.stream_order for e in h.groups[gi].plain for r in e.refs)


def test_streamed_weights_point_at_the_host_copy_between_forwards():
    """Outside its compute a streamed weight is its host copy: anything reading or patching weights between steps
    (ComfyUI's hook patches, state_dict) must not see a device slot the next copy overwrites."""
    m, x = make_flux(fp8_single=True), flux_inputs()
    h = apply_group_prefetch(m, PrefetchConfig(2, 1, 1, BIG), _rec(), bandwidth=0)
    try:
        with torch.no_grad():
            m(*x)
            m(*x)
        assert _bound_to_the_host(h)
    finally:
        h.remove()


def test_a_forward_that_skips_a_groups_last_block_still_releases_it():
    """The group is released at the forward's end when its last block never ran (skip-layer guidance)."""
    m, (x, t) = make_wan(n=8), wan_inputs()
    m.skip = {7}
    h = apply_group_prefetch(m, PrefetchConfig(2, 1, 0, BIG, partial_blocks=False), _rec(), bandwidth=0)
    try:
        with torch.no_grad():
            m(x, t)
        assert h.bound is None and _bound_to_the_host(h)
    finally:
        h.remove()


def test_the_first_streamed_group_is_prefetched_at_the_forward_start():
    """Its copy overlaps the embedders: the first forward loads nothing on demand."""
    m, x = make_flux(fp8_single=True), flux_inputs()
    h = apply_group_prefetch(m, PrefetchConfig(2, 1, 1, BIG), _rec(), bandwidth=0)
    try:
        with torch.no_grad():
            m(*x)
        assert h.last.misses == 0
    finally:
        h.remove()


def test_the_planner_times_the_resident_blocks_too():
    m = make_wan(n=8)
    cfg = PrefetchConfig(1, 1, 2, BIG, partial_blocks=False)
    h = apply_group_prefetch(m, cfg, _rec(), bandwidth=0)
    try:
        comp = [0.01 * (b + 1) for b in range(8)]
        p = plan_groups(h.store, cfg, BIG, h.remainder_bytes, 1e6, comp, 0.5)
        assert p.resident_groups == 2 and p.compute_s == pytest.approx(0.5 + sum(comp))
    finally:
        h.remove()


def test_a_copy_waits_for_its_slots_previous_compute():
    """One slot pair: group 2's 3 s copy starts when group 0's compute frees its slot, so each forward stalls 2 s on
    top of 5 s of compute."""
    assert simulate_forward(0.0, [1, 1, 3], [1, 1, 3], depth=1) == pytest.approx(7.0)


def test_a_tensor_shared_between_blocks_stays_resident_and_counts_in_the_budget():
    """Streamed as its first block's, the second block would compute with it still on the host (on a GPU); kept out
    of the budget, the plan could exceed the VRAM it was given."""
    m, (x, t) = make_wan(n=6), wan_inputs()
    m.blocks[3].o.weight = m.blocks[2].o.weight
    with torch.no_grad():
        ref = m(x, t)
    h = apply_group_prefetch(m, PrefetchConfig(1, 1, 0, BIG, partial_blocks=False), _rec(), bandwidth=0)
    try:
        assert any("shared between blocks" in why for _, why in h.store.kept)
        w = m.blocks[2].o.weight
        outside = sum(p.numel() * p.element_size() for n, p in m.named_parameters() if not n.startswith("blocks."))
        assert h.remainder_bytes == outside + w.numel() * w.element_size()
        with torch.no_grad():
            assert torch.equal(m(x, t), ref)
    finally:
        h.remove()


class _OtherDevice(CpuTransport):
    """A device no host tensor is on (cpu:0): the engine moves to it what it would move to a GPU."""

    def __init__(self):
        super().__init__()
        self.device = torch.device("cpu", 0)


@pytest.mark.parametrize("manage_resident", [True, False])
def test_a_tensor_shared_between_blocks_goes_to_the_device_under_every_name(manage_resident):
    """Found in review: the shared tensor was moved to the device under its first block's name only; the second
    block kept the host tensor (on a GPU: a CPU weight in a CUDA matmul), and removing the engine left the moved copy
    under the first name."""
    m = make_wan(n=6)
    shared = m.blocks[2].o.weight
    m.blocks[3].o.weight = shared
    h = apply_group_prefetch(m, PrefetchConfig(1, 1, 0, BIG, partial_blocks=False, manage_resident=manage_resident),
                             _OtherDevice(), bandwidth=0)
    try:
        assert [why for _, why in h.store.kept] == ["shared between blocks"]
        assert m.blocks[2].o.weight is not shared                    # moved (a copy on the device)
        assert m.blocks[3].o.weight is m.blocks[2].o.weight
    finally:
        h.remove()
    assert m.blocks[2].o.weight is shared and m.blocks[3].o.weight is shared


def test_a_tied_weight_replaced_under_one_name_asks_for_a_new_store():
    """Found in review: ComfyUI patches a LoRA key by key, keeping the old object as its backup; for a weight tied
    under two names in one block, refresh re-bound every name to the host copy, the backup included, which then held
    the patched values (the LoRA stuck after ComfyUI put the backup back). Nothing is re-staged; the caller builds
    a new store, in which the two names are two weights."""
    m = make_wan(n=4)
    m.blocks[1].k.weight = m.blocks[1].q.weight
    transport = CpuTransport()
    store = HostStore([(f"blocks.{i}", b) for i, b in enumerate(m.blocks)], transport)
    backup = m.blocks[1].q.weight
    backup.data = backup.data.clone()                 # the bridge gives a weight it lets ComfyUI patch its own memory
    original = backup.detach().clone()
    m.blocks[1].q.weight = torch.nn.Parameter(backup.data + 1, requires_grad=False)
    with pytest.raises(RuntimeError, match="tied under two names"):
        store.refresh(transport)
    assert torch.equal(backup, original) and m.blocks[1].k.weight is backup


def test_a_block_tensor_the_model_also_uses_outside_the_blocks_stays_resident():
    """The head's layer is also a submodule of the last block: streamed, the head would run after the blocks with
    the block's weights back on the host or in a slot the next group overwrites (on a GPU)."""
    m, (x, t) = make_wan(n=6), wan_inputs()
    m.blocks[5].alias = m.head
    with torch.no_grad():
        ref = m(x, t)
    assert {n for n, _ in find_blocks(m).remainder} >= {"blocks.5.alias.weight", "blocks.5.alias.bias"}
    h = apply_group_prefetch(m, PrefetchConfig(1, 1, 0, BIG, partial_blocks=False), _rec(), bandwidth=0)
    try:
        assert {n for n, why in h.store.kept if "outside the streamed blocks" in why} == {
            "blocks.5.alias.weight", "blocks.5.alias.bias"}
        outside = sum(p.numel() * p.element_size() for n, p in m.named_parameters(remove_duplicate=False)
                      if not n.startswith("blocks."))
        assert h.remainder_bytes == outside
        assert all(e.refs[0].get() is not m.head.weight for e in h.store.entries)
        with torch.no_grad():
            assert torch.equal(m(x, t), ref)
    finally:
        h.remove()


def test_a_block_also_reachable_by_another_name_still_streams():
    """Its own hooks run whichever name calls it."""
    m = make_wan(n=6)
    m.last = m.blocks[5]
    h = apply_group_prefetch(m, PrefetchConfig(1, 1, 0, BIG, partial_blocks=False), _rec(), bandwidth=0)
    try:
        assert h.store.kept == []
    finally:
        h.remove()


def test_a_tensor_shared_with_a_block_outside_the_store_stays_resident():
    """ComfyUI's node streams only the blocks after the resident prefix: a weight they share with a resident block
    is in use while they are not."""
    m = make_wan(n=6)
    m.blocks[4].o.weight = m.blocks[1].o.weight
    blocks = find_blocks(m).blocks
    store = HostStore(blocks[2:], CpuTransport(), root=m)
    assert [n for n, _ in store.kept] == ["blocks.4.o.weight"]
    assert HostStore(blocks[2:], CpuTransport()).kept == []


def test_the_reported_device_bytes_add_up_to_the_plan():
    m = make_flux(fp8_single=True)
    h = apply_group_prefetch(m, PrefetchConfig(2, 1, 1, BIG, partial_blocks=False), _rec(), bandwidth=0)
    try:
        s = h.stats()
        assert h.remainder_bytes > 0
        assert s["resident_bytes"] + s["slot_bytes"] + s["staging_bytes"] == s["device_bytes_planned"]
    finally:
        h.remove()


def test_a_model_comfyui_keeps_on_the_gpu_is_left_to_comfyui_with_the_flag_named():
    """Found in review: under --highvram (the diffusion model) or --gpu-only ComfyUI's offload device is the GPU, so
    the blocks are on the GPU from the start and an unload puts them there again. The node reported an unload "from
    an earlier load" that never happened and that streaming resumed after a cache clear, which it never does; it
    unloaded the model at every run (a LoRA unpatched and patched again). It stands aside and names the flag."""
    from types import SimpleNamespace

    from comfyui_levers.bridge.prefetch import stays_on_device_line

    gpu, host = torch.device("cuda", 0), torch.device("cpu")
    line = stays_on_device_line(SimpleNamespace(load_device=gpu, offload_device=gpu))
    assert line and "--highvram or --gpu-only" in line and "stands aside" in line
    assert stays_on_device_line(SimpleNamespace(load_device=gpu, offload_device=host)) is None
    assert stays_on_device_line(SimpleNamespace(load_device=host, offload_device=host)) is None     # a CPU run


def test_achieved_time_leaves_out_the_cold_calibration_forward():
    """Found in review: "achieved" was the median of every forward's time, the first one included: it runs cold
    (every group a miss, first touches) and under the uncalibrated plan, and a run builds a new handle every time.
    With three forwards, a 0.5 s first one made achieved 311 ms against 12.7 ms for each later forward."""
    import time

    m = make_wan(n=8)
    calls = [0]

    def slow_first(mod, args):
        calls[0] += 1
        if calls[0] == 1:
            time.sleep(1.0)              # stands for the cold first forward (its median with one more: >= 0.5 s)
    m.patch_embedding.register_forward_pre_hook(slow_first)
    h = apply_group_prefetch(m, PrefetchConfig(AUTO, AUTO, AUTO, 150_000), RecordingTransport(CpuTransport()),
                             bandwidth=1e9)
    with torch.no_grad():
        for _ in range(3):
            m(*wan_inputs())
    s = h.stats()
    assert s["forwards"] == 3 and s["achieved_s"] is not None
    assert s["achieved_s"] < 0.25, s["achieved_s"]
    h.remove()


def test_the_report_of_a_run_with_a_floor_of_nothing_does_not_fail():
    """A plan whose floor is 0 (nothing streamed, no compute measured on a coarse clock) has no floor efficiency;
    the report formatted it anyway and raised TypeError."""
    from dataclasses import replace

    m = make_wan(n=4)
    h = apply_group_prefetch(m, PrefetchConfig(budget_bytes=10 ** 9), RecordingTransport(CpuTransport()),
                             bandwidth=1e9)
    with torch.no_grad():
        for _ in range(3):
            m(*wan_inputs())
    h.plan = replace(h.plan, compute_s=0.0, transfer_s=0.0, floor_s=0.0, predicted_s=0.0)
    text = h.report()
    assert "achieved" in text and "of the floor" not in text
    h.remove()


def test_bandwidth_is_measured_from_the_memory_the_weights_stream_from():
    """Found in review: the probe always copied from a pinned buffer, so a host copy left pageable (pin off, or
    the RAM rule declining) was planned, floored and reported at the pinned rate."""
    pins = []

    class Counting(CpuTransport):
        def pin(self, t):
            pins.append(t.numel())
            return super().pin(t)
    tr = RecordingTransport(Counting())
    from comfyui_levers.core.residency.prefetch import measure_bandwidth

    assert measure_bandwidth(tr, nbytes=1 << 20, pinned=False) > 0 and pins == []
    assert measure_bandwidth(tr, nbytes=1 << 20) > 0 and pins == [1 << 20]
    assert tr.ledger.h2d_bytes == 0          # calibration is not model traffic


def test_blocks_the_host_keeps_between_streamed_ones_count_as_compute():
    """Found in review: a split plan hands the engine only the blocks with a streamed head; a block ComfyUI holds
    whole can run between two of them. Its time was in no block's marks nor in the non-block compute (taken
    before the first and after the last engine block only), so compute, the floor and the predictions left it out
    (2.4 ms measured for a forward of 122 ms with two 50 ms blocks between). Timed with the block before it now."""
    import time
    from dataclasses import replace

    m = make_wan(n=8)
    for i in (3, 4):       # 50 ms of work inside each (a hook registered first runs before the engine's exit mark)
        m.blocks[i].register_forward_hook(lambda mod, a, out: time.sleep(0.05))
    layout = find_blocks(m)
    streamed = tuple(b for i, b in enumerate(layout.blocks) if i not in (3, 4))
    cfg = PrefetchConfig(1, 1, 0, 10 ** 9, manage_resident=False, partial_blocks=False)   # as the bridge sets it
    h = apply_group_prefetch(m, cfg, RecordingTransport(CpuTransport()), bandwidth=1e9,
                             layout=replace(layout, blocks=streamed),
                             timed_between=[(2, layout.blocks[3][1]), (2, layout.blocks[4][1])])
    with torch.no_grad():
        for _ in range(4):
            m(*wan_inputs())
    s = h.stats()
    assert h.block_compute_s[2] >= 0.1, h.block_compute_s
    assert s["compute_s"] >= 0.1 and s["floor_s"] >= 0.1, s
    h.remove()
    assert not m.blocks[3]._forward_pre_hooks and len(m.blocks[3]._forward_hooks) == 1     # only the test's left


def test_the_bridge_times_each_block_comfyui_loads_between_streamed_ones_with_the_one_before():
    """The bridge's side of the test above: which blocks a split layout leaves between its streamed ones, each
    with the streamed block (its index among the streamed) whose compute it joins."""
    from types import SimpleNamespace as NS

    from comfyui_levers.bridge.prefetch import _Session

    blocks = [(f"b{i}", f"m{i}") for i in range(9)]
    s = NS(split=NS(streamed=(1, 2, 3, 5, 7)), layout=NS(blocks=blocks))
    assert _Session._between(s) == [(2, "m4"), (3, "m6")]      # m0 runs before, m8 after: the engine times those
    assert _Session._between(NS(split=None, layout=NS(blocks=blocks))) == []
