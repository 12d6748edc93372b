"""Phase offload engine on CPU: zero-byte offload, pointer identity, bit-exact outputs, staleness."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from torch import nn

from comfyui_levers.core.errors import ConfigError, IncompatibleInput
from comfyui_levers.core.residency.phase import PhaseConfig, apply_phase_offload
from comfyui_levers.core.residency.pinned import PinnedStore
from comfyui_levers.core.residency.transport import CpuTransport, PinResult, RecordingTransport


class Tiny(nn.Module):
    """Embedding tied to the output head, a conv, a norm with running stats, a plain buffer."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.conv = nn.Conv1d(16, 16, 3, padding=1)
        self.norm = nn.BatchNorm1d(16)
        self.head = nn.Linear(16, 32, bias=False)
        self.head.weight = self.embed.weight                 # tied
        self.register_buffer("gain", torch.linspace(0.5, 1.5, 16))

    def forward(self, ids):                                  # ids: [B, T] int64
        h = self.embed(ids).transpose(1, 2)                  # [B, 16, T]
        h = self.norm(self.conv(h)) * self.gain[:, None]     # [B, 16, T]
        return self.head(h.transpose(1, 2))                  # [B, T, 32]


def _model(seed=0):
    torch.manual_seed(seed)
    m = Tiny().eval()
    with torch.no_grad():
        m.norm.running_mean.normal_()
        m.norm.running_var.uniform_(0.5, 2.0)
    return m


@pytest.fixture
def ids():
    return torch.randint(0, 32, (2, 7), generator=torch.Generator().manual_seed(1))


def _recording():
    return RecordingTransport(CpuTransport())


def test_offload_moves_zero_bytes_and_points_back_at_masters(ids):
    m, tr = _model(), _recording()
    h = apply_phase_offload(m, PhaseConfig(name="dit"), tr)
    masters = h.master_ptrs()
    assert m.conv.weight.data_ptr() == masters["conv.weight"]           # starts offloaded, no copy
    for _ in range(3):
        rec_on = h.onload("sample")
        assert rec_on["h2d_bytes"] == h.host_bytes > 0
        assert m.conv.weight.data_ptr() != masters["conv.weight"]       # running on the "device" copy
        before = len(tr.ops)
        rec_off = h.offload()
        assert rec_off["d2h_bytes"] == 0 and rec_off["h2d_bytes"] == 0
        assert not [op for op in tr.ops[before:] if op.kind in ("h2d", "d2h")]
        for name, p in [*m.named_parameters(), *m.named_buffers()]:
            assert p.data_ptr() == masters[name], name
    assert tr.ledger.d2h_bytes == 0
    assert h.ledger.totals()["offload_d2h_bytes"] == 0


def test_onload_schedule_waits_before_compute(ids):
    tr = _recording()
    h = apply_phase_offload(_model(), PhaseConfig(name="dit"), tr)
    h.onload()
    kinds = [op.kind for op in tr.ops]
    # copy stream waits for earlier compute, copies, records an event the compute stream waits on
    assert kinds[0] == "wait_compute"
    assert kinds.index("record") > max(i for i, k in enumerate(kinds) if k == "h2d")
    assert kinds.index("wait") > kinds.index("record")
    assert kinds[-1] == "compute"


def test_outputs_bit_identical_across_cycles(ids):
    plain, managed = _model(), _model()
    want = plain(ids)
    h = apply_phase_offload(managed, PhaseConfig(name="dit"), _recording())
    assert torch.equal(managed(ids), want)               # offloaded state computes on the masters
    for _ in range(3):
        with h.phase("sample"):
            assert torch.equal(managed(ids), want)
        assert torch.equal(managed(ids), want)


def test_tied_weights_stay_tied_and_move_once(ids):
    m, tr = _model(), _recording()
    h = apply_phase_offload(m, PhaseConfig(name="dit"), tr)
    h.onload()
    assert m.head.weight is m.embed.weight
    assert m.head.weight.data_ptr() == m.embed.weight.data_ptr()
    copies = len(tr.kinds("h2d"))
    assert copies == h.report()["storages"] == len(list(m.parameters())) + len(list(m.buffers()))
    h.offload()
    assert m.head.weight.data_ptr() == h.master_ptrs()["embed.weight"]


def test_views_of_one_storage_stay_aliased_with_one_copy():
    flat = torch.randn(48)
    m = nn.Module()
    m.a = nn.Parameter(flat[:32].view(4, 8), requires_grad=False)
    m.b = nn.Parameter(flat[32:], requires_grad=False)
    tr = _recording()
    h = apply_phase_offload(m, PhaseConfig(name="x"), tr)
    h.onload()
    assert len(tr.kinds("h2d")) == 1
    assert m.b.data_ptr() - m.a.data_ptr() == 32 * 4                    # same layout on the device
    assert torch.equal(torch.cat([m.a.flatten(), m.b]), flat)
    h.offload()
    assert m.a.data_ptr() == flat.data_ptr()


def test_in_place_patch_on_device_is_restaged(ids):
    plain, managed = _model(), _model()
    tr = _recording()
    h = apply_phase_offload(managed, PhaseConfig(name="dit"), tr)
    masters = h.master_ptrs()
    delta = torch.full_like(plain.conv.weight, 0.01)
    with torch.no_grad():
        plain.conv.weight.add_(delta)
    want = plain(ids)
    h.onload()
    with torch.no_grad():
        managed.conv.weight.add_(delta)                  # e.g. a LoRA merged on the device
    rec = h.offload()
    assert rec["restaged"] == 1 and rec["d2h_bytes"] == managed.conv.weight.nbytes
    assert managed.conv.weight.data_ptr() == masters["conv.weight"]     # master updated in place
    with h.phase():
        assert torch.equal(managed(ids), want)
    assert h.ledger.records[-1].d2h_bytes == 0           # the next offload is free again


def test_replaced_parameter_while_offloaded_is_adopted_without_a_copy(ids):
    plain, managed = _model(), _model()
    tr = _recording()
    h = apply_phase_offload(managed, PhaseConfig(name="dit"), tr)
    new_w = torch.randn_like(plain.conv.weight)
    plain.conv.weight = nn.Parameter(new_w.clone())
    managed.conv.weight = nn.Parameter(new_w.clone())    # a patcher swapped the Parameter object
    rec = h.onload()
    assert rec["restaged"] == 1 and tr.ledger.d2h_bytes == 0
    assert torch.equal(managed(ids), plain(ids))
    h.offload()
    assert managed.conv.weight.data_ptr() == h.master_ptrs()["conv.weight"]
    assert torch.equal(managed(ids), plain(ids))


def test_data_replaced_on_device_is_brought_home(ids):
    plain, managed = _model(), _model()
    h = apply_phase_offload(managed, PhaseConfig(name="dit"), _recording())
    h.onload()
    new_b = torch.randn_like(plain.conv.bias)
    with torch.no_grad():
        plain.conv.bias.copy_(new_b)
    swapped_in = new_b.clone()
    managed.conv.bias.data = swapped_in                  # `.data` swap: the version counter misses it
    rec = h.offload()
    # On the CPU transport the new tensor already lives in host memory: it becomes the master as is
    # (on CUDA it would be copied home once).
    assert rec["restaged"] == 1 and h.master_ptrs()["conv.bias"] == swapped_in.data_ptr()
    assert managed.conv.bias.data_ptr() == swapped_in.data_ptr()
    with h.phase():
        assert torch.equal(managed(ids), plain(ids))


def test_explicit_restage_after_data_write(ids):
    plain, managed = _model(), _model()
    h = apply_phase_offload(managed, PhaseConfig(name="dit"), _recording())
    with torch.no_grad():
        plain.gain.mul_(2)
        managed.gain.mul_(2)                             # in place on the master itself
    with h.phase():
        assert torch.equal(managed(ids), plain(ids))
    assert h.restage() > 0
    with pytest.raises(RuntimeError, match="offload"):
        h.onload()
        h.restage()


class FailingPin(CpuTransport):
    def pin(self, t):
        return PinResult(False, "simulated: page-locked limit reached", t.nbytes)


class CountingPin(CpuTransport):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def pin(self, t):
        self.calls += 1
        return PinResult(True, "pinned in place", t.nbytes)


def test_pin_failure_falls_back_to_pageable_with_a_note(ids):
    plain, managed = _model(), _model()
    tr = FailingPin()
    store = PinnedStore(tr, "on", has_cuda=True, available_ram_bytes=1 << 40, os_name="linux")
    h = apply_phase_offload(managed, PhaseConfig(name="vae", pin="on"), tr, store)
    pin = h.report()["pin"]
    assert pin["pinned"] is False and "simulated" in pin["reason"]
    with h.phase():
        assert torch.equal(managed(ids), plain(ids))


def test_pins_once_not_per_phase(ids):
    tr = CountingPin()
    store = PinnedStore(tr, "auto", has_cuda=True, available_ram_bytes=1 << 40, os_name="linux")
    h = apply_phase_offload(_model(), PhaseConfig(name="dit"), tr, store)
    assert h.report()["pin"]["pinned"] and tr.calls == h.report()["storages"]
    for _ in range(3):
        with h.phase():
            pass
    assert tr.calls == h.report()["storages"]


def test_inference_mode_does_not_leak_into_parameters(ids):
    plain, managed = _model(), _model()
    h = apply_phase_offload(managed, PhaseConfig(name="dit"), _recording())
    with torch.inference_mode():
        h.onload()
        out = managed(ids)
        h.offload()
        h.onload()
    assert torch.equal(out, plain(ids))
    assert not managed.conv.weight.is_inference()
    with torch.no_grad():
        managed.conv.weight.mul_(1.0)                    # would raise on an inference tensor
    h.offload()


def test_remove_restores_the_original_state(ids):
    m = _model()
    before = {n: (p, p.data_ptr(), p.requires_grad) for n, p in m.named_parameters()}
    bufs = {n: b.data_ptr() for n, b in m.named_buffers()}
    want = m(ids)
    tr = CountingPin()
    store = PinnedStore(tr, "on", has_cuda=True, available_ram_bytes=1 << 40, os_name="linux")
    unpinned = []
    tr.unpin = lambda t: unpinned.append(t.data_ptr())
    h = apply_phase_offload(m, PhaseConfig(name="dit"), tr, store)
    h.onload()
    h.remove()
    for n, p in m.named_parameters():
        obj, ptr, rg = before[n]
        assert p is obj and p.data_ptr() == ptr and p.requires_grad == rg
    assert {n: b.data_ptr() for n, b in m.named_buffers()} == bufs
    assert len(unpinned) == tr.calls and store.pinned_bytes == 0
    assert torch.equal(m(ids), want)
    with pytest.raises(RuntimeError, match="removed"):
        h.onload()


def test_ledger_is_json_for_reports():
    h = apply_phase_offload(_model(), PhaseConfig(name="dit"), _recording())
    with h.phase("sample"):
        pass
    report = json.loads(json.dumps(h.report()))
    kinds = [r["kind"] for r in report["ledger"]["records"]]
    assert kinds == ["onload", "offload"]
    assert report["ledger"]["totals"]["h2d_bytes"] == h.host_bytes


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="pin"):
        PhaseConfig(pin="sometimes")
    with pytest.raises(ConfigError, match="pin_budget_bytes"):
        PhaseConfig(pin_budget_bytes=-1)
    with pytest.raises(IncompatibleInput):
        apply_phase_offload("not a module", PhaseConfig())


def test_bitsandbytes_style_params_are_refused_with_advice():
    m = nn.Linear(4, 4)
    m.weight.quant_state = object()                      # what bnb's Params4bit carries
    with pytest.raises(IncompatibleInput, match="bitsandbytes"):
        apply_phase_offload(m, PhaseConfig(), _recording())


def test_torchao_subclass_weights_swap_by_pointer():
    pytest.importorskip("torchao")
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    torch.manual_seed(0)
    plain, managed = nn.Sequential(nn.Linear(64, 64)), nn.Sequential(nn.Linear(64, 64))
    managed.load_state_dict(plain.state_dict())
    quantize_(plain, Int8WeightOnlyConfig())
    quantize_(managed, Int8WeightOnlyConfig())
    x = torch.randn(3, 64)
    want = plain(x)
    w = managed[0].weight
    tr = _recording()
    h = apply_phase_offload(managed, PhaseConfig(name="dit"), tr)
    master_q = h.master_ptrs()["0.weight.qdata"]
    assert w.qdata.data_ptr() == master_q
    for _ in range(2):
        h.onload()
        assert managed[0].weight is w and w.qdata.data_ptr() != master_q
        assert torch.equal(managed(x), want)
        rec = h.offload()
        assert rec["d2h_bytes"] == 0 and w.qdata.data_ptr() == master_q
    h.remove()
    assert torch.equal(managed(x), want)


def test_importing_the_engine_pulls_in_no_comfy_and_no_cuda():
    code = ("import sys, torch; import comfyui_levers.core.residency.phase, comfyui_levers.core.residency.pinned;"
            "assert not [m for m in sys.modules if m == 'comfy' or m.startswith('comfy.')];"
            "assert not torch.cuda.is_initialized()")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("build_mode", [True, False], ids=["built_in_inference_mode", "built_normally"])
def test_tensors_keep_their_kind_across_onload_and_offload(ids, build_mode):
    """ComfyUI loads models inside inference mode. An inference buffer given normal data breaks on
    its next view (ComfyUI's sampler reads ``model_sampling.sigmas[-1]``: "Inference tensors do not
    track version counter", seen on an H200); rebinding must keep each tensor's kind."""
    with torch.inference_mode(build_mode):
        m = _model()
    want = _model()(ids)
    kinds = {n: t.is_inference() for n, t in [*m.named_parameters(), *m.named_buffers()]}
    assert all(k == build_mode for k in kinds.values())
    h = apply_phase_offload(m, PhaseConfig(name="dit"), _recording())
    for _ in range(2):
        for state in ("onload", "offload"):
            getattr(h, state)()
            for name, t in [*m.named_parameters(), *m.named_buffers()]:
                assert t.is_inference() == kinds[name], (state, name)
            for mode in (True, False):
                with torch.inference_mode(mode), torch.no_grad():
                    assert float(m.gain[-1]) == 1.5                      # a view of a rebound buffer
                    assert torch.equal(m(ids), want)


def test_weights_that_are_views_with_gaps_into_read_only_memory_get_a_packed_pinned_copy(ids, read_only):
    """Every weight a view into one read-only mapping that also holds other tensors between them (gaps): the
    masters become one packed copy of the views (pinned), the module points at it, outputs as before."""
    plain, managed = _model(), _model()
    named = [(n, p) for n, p in managed.named_parameters()]
    parts, offset, where = [], 0, {}
    for n, p in named:
        where[n] = offset
        parts += [p.detach().reshape(-1).float(), torch.zeros(4096)]          # each weight, then a gap
        offset += p.numel() + 4096
    blob = read_only(torch.cat(parts))
    for n, p in named:
        owner = managed.get_submodule(n.rpartition(".")[0]) if "." in n else managed
        setattr(owner, n.rpartition(".")[2], nn.Parameter(blob[where[n]:where[n] + p.numel()].view(p.shape),
                                                          requires_grad=False))
    tr = CountingPin()
    store = PinnedStore(tr, "auto", has_cuda=True, available_ram_bytes=1 << 40, os_name="linux")
    h = apply_phase_offload(managed, PhaseConfig(name="dit"), tr, store)
    pin = h.report()["pin"]
    weights = sum(p.nbytes for _, p in named)
    assert pin["pinned"] and weights <= pin["copied_bytes"] < weights + 64 * len(named), pin
    assert all(not (blob.data_ptr() <= p.data_ptr() < blob.data_ptr() + blob.nbytes) for p in managed.parameters())
    for _ in range(2):
        with h.phase():
            assert torch.equal(managed(ids), plain(ids))
    assert torch.equal(managed(ids), plain(ids))


def test_weights_in_read_only_memory_get_pinned_copies(ids, read_only):
    """Weights a GGUF file or ComfyUI's memory-mapped loader hands over sit in a read-only file mapping, which
    cannot be page-locked in place: the masters become writable copies (pinned), the module points at them, and
    everything else is as for ordinary weights."""
    from comfyui_levers.core.residency.transport import HostMaps

    plain, managed = _model(), _model()
    for mod in (managed.conv, managed.head):           # head's weight is tied to the embedding
        mod.weight.data = read_only(mod.weight.data)
    managed.gain = read_only(managed.gain)
    assert managed.head.weight is managed.embed.weight
    tr = CountingPin()
    store = PinnedStore(tr, "auto", has_cuda=True, available_ram_bytes=1 << 40, os_name="linux")
    h = apply_phase_offload(managed, PhaseConfig(name="dit"), tr, store)
    pin = h.report()["pin"]
    copied = sum(t.nbytes for t in (managed.conv.weight, managed.head.weight, managed.gain))
    assert pin["pinned"] and pin["copied_bytes"] == copied and "copied first" in pin["reason"]
    maps = HostMaps.read()
    assert all(maps.writable(t.data_ptr(), t.nbytes) for t in [*managed.parameters(), *managed.buffers()])
    assert managed.head.weight is managed.embed.weight           # still tied
    for _ in range(2):
        with h.phase():
            assert torch.equal(managed(ids), plain(ids))
    assert torch.equal(managed(ids), plain(ids))
