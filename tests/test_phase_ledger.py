"""PhaseOffload's per-run ledger without ComfyUI: formatting, JSON, the node channel, the CUDA peak path.

The bridge imports ComfyUI lazily, so everything here runs on the plain CPU test environment; the
CUDA peak code is driven through monkeypatched ``torch.cuda`` functions (no GPU here).
"""
from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from comfyui_levers.bridge import phase as P

MIB = 1024 ** 2


def _entry(index, component, **kw):
    base = dict(index=index, component=component, phase=P.PHASES[component], device="cpu", source="pageable",
                source_reason="cpu transport does not pin", moved_by="Levers transport", open=False)
    base.update(kw)
    return P.PhaseEntry(**base)


def _run():
    run = P.RunLedger(run_id="p1-node7", prompt_id="p1", node_id="7", started_at="2026-01-01T00:00:00+00:00")
    run.phases.append(_entry(1, "text_encoder", h2d_bytes=3 * MIB, transfer_seconds=0.5, seconds=1.0,
                             nodes=["6"], loads=2))
    run.phases.append(_entry(2, "diffusion_model", h2d_bytes=40 * MIB, transfer_seconds=2.0, seconds=9.0,
                             swapped_bytes=3 * MIB, released=["text_encoder"], nodes=["13"], loads=1))
    run.phases.append(_entry(3, "vae", h2d_bytes=MIB, transfer_seconds=0.25, seconds=0.75,
                             swapped_bytes=40 * MIB, released=["diffusion_model"], nodes=["16"], loads=1))
    return run


def test_entry_rates_and_totals_are_derived_from_the_bytes_and_seconds():
    run = _run()
    d = run.as_dict()
    sample = d["phases"][1]
    assert sample["gbps"] == round(40 * MIB / 2.0 / 1e9, 3)
    assert sample["peak_bytes"] is None and sample["peak_note"].startswith("n/a on CPU")
    t = d["totals"]
    assert t["h2d_bytes"] == 44 * MIB and t["d2h_bytes"] == 0 and t["swapped_bytes"] == 43 * MIB
    assert t["gbps"] == round(44 * MIB / 2.75 / 1e9, 3) and t["seconds"] == pytest.approx(10.75)
    assert [p["phase"] for p in d["phases"]] == ["encode", "sample", "decode"]
    assert d["schema"] == P.LEDGER_SCHEMA and json.loads(json.dumps(d)) == d   # JSON-ready as is
    # nothing moved: no rate rather than a made-up one
    assert _entry(1, "vae").gbps is None and _entry(1, "vae", h2d_bytes=5).gbps is None


def test_comfyui_moved_bytes_is_what_levers_did_not_copy():
    e = _entry(1, "vae", h2d_bytes=10, comfyui_loaded_before=0, comfyui_loaded_after=25)
    assert e.comfyui_moved_bytes == 15
    assert _entry(1, "vae", moves=False, comfyui_loaded_before=0, comfyui_loaded_after=25).comfyui_moved_bytes == 0
    assert _entry(1, "vae", comfyui_loaded_before=None).comfyui_moved_bytes is None


def test_format_ledger_lists_each_phase_in_order_with_its_numbers():
    d = _run().as_dict()
    d["file"] = "/out/levers/phase_ledger-p1-node7.json"
    text = P.format_ledger(d)
    lines = text.splitlines()
    assert lines[0] == "Levers PhaseOffload ledger, prompt p1: 3 phase(s)"
    heads = [line for line in lines if line[:1].isdigit()]
    assert heads == ["1. encode: text_encoder on cpu, 1.000 s", "2. sample: diffusion_model on cpu, 9.000 s",
                     "3. decode: vae on cpu, 0.750 s"]
    assert f"H2D 40.00 MiB in 2.000 s ({d['phases'][1]['gbps']} GB/s) from pageable masters; D2H 0 B; " \
           "pointer-swapped 3.00 MiB" in text
    assert "released first through ComfyUI: diffusion_model" in text
    assert "peak: n/a on CPU" in text and text.endswith("JSON: /out/levers/phase_ledger-p1-node7.json")
    # the same text from the JSON file's contents
    assert P.format_ledger(json.loads(json.dumps(d))) == text


def test_format_ledger_shows_cuda_peaks_open_phases_and_bytes_outside_phases():
    run = _run()
    run.phases[1].device = "cuda:0"
    run.phases[1].peak_bytes = 3 * 1024 ** 3
    run.phases[2].open = True
    run.outside["d2h_bytes"] = 2048
    text = P.format_ledger(run.as_dict())
    assert "peak: 3.00 GiB" in text and "3. decode: vae on cpu, 0.750 s, still open" in text
    assert "outside any phase: H2D 0 B, D2H 2.00 KiB" in text and "peak 3.00 GiB" in text


def test_write_ledger_json_round_trips_and_fails_soft(tmp_path, caplog):
    d = _run().as_dict()
    path = tmp_path / "levers" / "phase_ledger-x.json"
    assert P.write_ledger_json(d, str(path)) and json.loads(path.read_text()) == d
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    with caplog.at_level("WARNING", logger="levers"):
        assert not P.write_ledger_json(d, str(blocked / "phase_ledger-y.json"))
    assert "could not write the phase ledger" in caplog.text


def test_send_to_node_uses_comfyuis_progress_text_when_a_server_runs(monkeypatch):
    calls = []
    instance = SimpleNamespace(send_progress_text=lambda text, node_id: calls.append((text, node_id)))
    monkeypatch.delitem(sys.modules, "server", raising=False)
    assert P.progress_text_channel() == (False, "no ComfyUI server in this process (headless)")
    assert not P.send_to_node("x", "3")
    monkeypatch.setitem(sys.modules, "server", SimpleNamespace(PromptServer=SimpleNamespace(instance=object())))
    ok, why = P.progress_text_channel()
    assert not ok and "no progress-text channel" in why            # an older ComfyUI
    monkeypatch.setitem(sys.modules, "server", SimpleNamespace(PromptServer=SimpleNamespace(instance=instance)))
    assert not P.send_to_node("x", None) and calls == []         # no node id: log only
    assert P.send_to_node("ledger", 12) and calls == [("ledger", "12")]

    def closed(text, node_id):
        raise RuntimeError("Event loop is closed")

    instance.send_progress_text = closed
    assert not P.send_to_node("ledger", "12")                    # fail-soft


def _cuda_group(monkeypatch):
    """A group with a VAE on cuda:0 and torch.cuda's peak functions replaced by a fake allocator."""
    calls = {"reset": [], "peak": 0}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda dev=None: calls["reset"].append(dev))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda dev=None: calls["peak"])
    group = P.PhaseGroup(P.PhaseSettings(), node_id="5")
    dit = P.Component("diffusion_model", nn.Linear(2, 2), group, False, torch.device("cuda", 0), torch.device("cpu"))
    vae = P.Component("vae", nn.Linear(2, 2), group, False, torch.device("cuda", 0), torch.device("cpu"))
    group.components.update(diffusion_model=dit, vae=vae)
    group._begin_run(None)
    return group, dit, vae, calls


def test_cuda_peak_is_reset_at_phase_start_and_read_at_close(monkeypatch):
    group, dit, vae, calls = _cuda_group(monkeypatch)
    group._open_phase(dit, None)
    assert calls["reset"] == [torch.device("cuda", 0)]
    calls["peak"] = 700
    group.record("diffusion_model", "load", h2d=600, d2h=0, swapped=0, seconds=0.1, transfer_seconds=0.1)
    group.close_phase()
    group._open_phase(vae, None)
    calls["peak"] = 300
    group.close_phase()
    # the same component again with nothing in between continues its phase; its peak is the max
    group._open_phase(vae, None)
    calls["peak"] = 200
    group.close_phase()
    d = P.latest_ledger(close=False)
    assert [(p["phase"], p["peak_bytes"]) for p in d["phases"]] == [("sample", 700), ("decode", 300)]
    assert len(calls["reset"]) == 3 and d["totals"]["peak_bytes"] == 700
    assert d["phases"][0]["h2d_bytes"] == 600 and "max_memory_allocated(cuda:0)" in d["phases"][0]["peak_note"]
    assert d["file"] is None      # no ComfyUI output folder without ComfyUI


def test_a_new_run_starts_when_the_prompt_changes(monkeypatch):
    group, dit, vae, calls = _cuda_group(monkeypatch)
    group._open_phase(dit, None)
    first = group.run
    group._begin_run("prompt-2")                 # the next prompt: the open phase ends with the old run
    assert group.run is not first and group.run.prompt_id == "prompt-2"
    assert group.run.run_id == "prompt-2-node5" and not first.phases[0].open
    group.new_run()
    assert group.run is None and group._begin_run(None).prompt_id is None


def test_a_load_that_raises_leaves_the_component_swapping():
    """Found by mutation testing: if ComfyUI's load raises part way (an OOM), the component's depth must still come
    back to 0, or PhaseOffload silently stops swapping it for the rest of the process."""
    m = nn.Sequential(nn.Linear(8, 8))
    group = P.PhaseGroup(P.PhaseSettings(pin="off"))
    comp = P.Component(name="diffusion_model", module=m, group=group, dynamic=False,
                       load_device=torch.device("cuda", 0), offload_device=torch.device("cpu"))
    patcher = SimpleNamespace(load_device=torch.device("cuda", 0), offload_device=torch.device("cpu"),
                              weight_inplace_update=False)
    with pytest.raises(RuntimeError, match="part way"):
        with comp.moves(patcher, "load"):
            raise RuntimeError("allocation failed part way")
    assert comp.depth == 0


@pytest.mark.parametrize("device", ["mps", "xpu", "privateuseone"])
def test_a_load_device_without_a_transport_is_left_to_comfyui(device):
    """Found in review: on a non-CUDA accelerator (Apple MPS, Intel XPU, DirectML) the transport was the CPU one,
    yet the pointer swap stayed on: the weights were bound to a second host copy while ComfyUI counted them on the
    device. Only CUDA (and the CPU's own moves) swap; elsewhere ComfyUI moves the model, with the reason."""
    m = nn.Sequential(nn.Linear(8, 8))
    comp = P.Component(name="diffusion_model", module=m, group=P.PhaseGroup(P.PhaseSettings(pin="off")),
                       dynamic=False, load_device=torch.device(device), offload_device=torch.device("cpu"))
    ok, why = comp.swaps(SimpleNamespace(load_device=torch.device(device), offload_device=torch.device("cpu"),
                                         weight_inplace_update=False))
    assert not ok and "needs a CUDA device" in why and device in why
    for dev in (torch.device("cuda", 0), torch.device("cpu", 0)):
        assert comp.swaps(SimpleNamespace(load_device=dev, offload_device=torch.device("cpu"),
                                          weight_inplace_update=False))[0]


@pytest.mark.parametrize("dynamic", [False, True])
def test_a_release_by_comfyui_is_booked_as_a_copy_home_only_when_comfyui_copies(monkeypatch, dynamic):
    """The same diffusion model loaded by a patcher the node does not manage (a branch of the graph without it) is
    released by ComfyUI at the next phase. The legacy unload copies it home (booked as device-to-host bytes, with a
    note); DynamicVRAM's unload gives its VRAM back and copies nothing (found in review: it was booked as 12 GiB
    device-to-host with the note that ComfyUI had copied it)."""
    import types

    mm = types.ModuleType("comfy.model_management")
    mm.current_loaded_models = []

    def free_memory(request, device, keep_loaded=()):
        mm.current_loaded_models[:] = [lm for lm in mm.current_loaded_models
                                       if lm.device != device or any(lm is k for k in keep_loaded)]
    mm.free_memory = free_memory
    monkeypatch.setitem(sys.modules, "comfy", types.ModuleType("comfy"))
    monkeypatch.setitem(sys.modules, "comfy.model_management", mm)

    class Patcher:
        def __init__(self, model):
            self.model, self.load_device, self.offload_device = model, torch.device("cuda", 0), torch.device("cpu")
            self.attachments, self.weight_inplace_update = {}, False

        def is_dynamic(self):
            return dynamic

        def clone(self):
            return Patcher(self.model)

    dit, vae = nn.Linear(4, 4), nn.Linear(4, 4)
    group = P.PhaseGroup(P.PhaseSettings(pin="off"))
    dit_patcher = Patcher(dit)          # the node's MODEL output: it holds the component
    group.add("diffusion_model", dit_patcher)
    vae_patcher = Patcher(vae)
    group.add("vae", vae_patcher)
    mm.current_loaded_models.append(SimpleNamespace(model=Patcher(dit), device=torch.device("cuda", 0),
                                                    model_loaded_memory=lambda: 12 * 2 ** 30))
    group.start_phase(group.components["vae"], vae_patcher)
    group.close_phase()
    decode = group.run.phases[-1]
    assert decode.released == ["diffusion_model"] and not mm.current_loaded_models
    noted = any("a patcher this node does not manage" in n for n in group.notes)
    assert (decode.d2h_bytes, noted) == ((0, False) if dynamic else (12 * 2 ** 30, True)), (decode, group.notes)


def test_master_bytes_count_wrapped_weights():
    """Found in review: a diffusion model whose weights are fp8 wrappers (ComfyUI's QuantizedTensor) reported
    "masters 0.000 GiB" and 0 masters: only plain masters were counted, not the wrapped ones' codes and scales."""
    from comfyui_levers.core.residency.phase import MasterTable
    from comfyui_levers.core.residency.transport import CpuTransport
    from test_prefetch_subclass import Fp8Wrapper

    m = nn.Sequential(*[nn.Linear(64, 64) for _ in range(3)])
    for lin in m:
        w = lin.weight.detach()
        scale = (w.abs().amax() / 448.0).reshape(())
        q = Fp8Wrapper((w / scale).to(torch.float8_e4m3fn), scale)
        q._is_param = True
        lin._parameters["weight"] = q
    table = MasterTable(m, "diffusion_model", CpuTransport())
    table.capture()
    assert len(table.wrapped) == 3 and len(table.masters) == 3          # the fp8 weights and the plain biases
    assert P._master_bytes(table) == 3 * (64 * 64 + 4) + 3 * 64 * 4


def test_components_on_two_gpus_get_a_pinned_store_each():
    """Found in review: the pinned stores were keyed by the transport's kind, so components on cuda:0 and cuda:1
    shared one store, whose synchronize before unregistering a range waited on cuda:0's streams only."""
    group = P.PhaseGroup(P.PhaseSettings(pin="off"))

    def transport(index):
        return SimpleNamespace(name="cuda", device=torch.device("cuda", index), synchronize=lambda: None,
                               unpin=lambda t: None)
    t0, t1, again = transport(0), transport(1), transport(0)
    s0, s1 = group.store_for(t0), group.store_for(t1)
    assert s0 is not s1 and s0.transport is t0 and s1.transport is t1
    assert group.store_for(again) is s0


def test_the_latest_ledger_is_the_most_recently_active_groups(monkeypatch):
    """Found when the integration tests ran in another order (ComfyUI 0.3.64): an older group still alive with a
    phase open (a headless run: no node finishes it) was closed by latest_ledger after the newer group had already
    published, so its stale run came back as the latest."""
    older, old_dit, _, _ = _cuda_group(monkeypatch)
    newer, new_dit, _, _ = _cuda_group(monkeypatch)
    P._LIVE.add(older)                               # as apply() registers the groups it makes
    P._LIVE.add(newer)
    older._open_phase(old_dit, None)
    older.last_active = 1
    newer._begin_run("prompt-new")
    newer._open_phase(new_dit, None)
    newer.close_phase()                              # published: the node finished
    newer.last_active = 2
    latest = P.latest_ledger()
    assert latest["prompt_id"] == "prompt-new", latest
    assert not older._open                           # the open phase was closed all the same


class _Patcher:
    """The fields of a ComfyUI ModelPatcher PhaseOffload reads (its class is swapped, so not a SimpleNamespace)."""

    def __init__(self, module, load_device=torch.device("cuda", 0)):
        self.model, self.load_device, self.offload_device = module, load_device, torch.device("cpu")
        self.attachments, self.weight_inplace_update = {}, False


def test_a_copy_joining_a_pageable_role_stays_pageable(monkeypatch):
    """Found in review: a plan pins with ``pin=on`` but keeps the diffusion model's masters pageable (the RAM rule
    refuses the whole set). QuantizeDiT's copy joining in that role was pinned anyway, under its own pin key, which
    the store's pageable list did not name."""
    from comfyui_levers.core.residency import pinned
    from comfyui_levers.core.residency.transport import CpuTransport, PinResult

    class FakeCuda(CpuTransport):
        name = "fakecuda"

        def __init__(self):
            super().__init__()
            self.device = torch.device("cuda", 0)

        def pin(self, t):
            return PinResult(True, "pinned in place", t.nbytes)

        def unpin(self, t):
            pass

    transport = FakeCuda()
    monkeypatch.setattr(P, "make_transport", lambda dev: transport)
    monkeypatch.setattr(pinned, "_is_pinned", lambda p: False)
    group = P.PhaseGroup(P.PhaseSettings(pin="on", pageable=("diffusion_model",)))
    dm, te = _Patcher(nn.Linear(16, 16)), _Patcher(nn.Linear(16, 16))
    comp = group.add("diffusion_model", dm)
    comp.stage(dm)
    group.add("text_encoder", te).stage(te)
    joined = group.add_member("diffusion_model", q := _Patcher(nn.Linear(16, 16)))
    joined.stage(q)
    assert not comp.table.pin_outcome.pinned and "pageable: the plan" in comp.table.pin_outcome.reason
    assert not joined.table.pin_outcome.pinned and "pageable: the plan" in joined.table.pin_outcome.reason
    assert te.attachments[P.ATTACHMENT].table.pin_outcome.pinned          # the other roles are pinned


def test_a_model_no_output_uses_is_freed_without_waiting_for_the_garbage_collector():
    """Found in review: the group held its components and each component its group, a reference cycle: a model
    ComfyUI dropped (a new checkpoint loaded) stayed alive with its host copy and page-locking until the next cyclic
    collection, and ComfyUI logged a potential memory leak. The group holds its components weakly; what a member
    pinned goes with it."""
    import gc
    import weakref
    import comfyui_levers.bridge.prefetch  # noqa: F401  (imported lazily by the first stage; not under test)

    gc.collect()
    gc.disable()
    try:
        group = P.PhaseGroup(P.PhaseSettings(pin="off"))
        dm = _Patcher(nn.Linear(8, 8), load_device=torch.device("cpu", 0))
        te = _Patcher(nn.Linear(8, 8), load_device=torch.device("cpu", 0))
        group.add("diffusion_model", dm).stage(dm)
        group.add("text_encoder", te).stage(te)
        module, group_ref = weakref.ref(dm.model), weakref.ref(group)
        store = next(iter(group._stores.values()))
        assert "diffusion_model" in store._by_component
        del dm
        assert module() is None                                   # freed at once, no collection needed
        assert set(group.components) == {"text_encoder"} and "diffusion_model" not in store._by_component
        del group, te
        assert group_ref() is None
    finally:
        gc.enable()


def test_a_model_whose_offload_device_is_its_gpu_is_not_released(monkeypatch):
    """Found in review: under --highvram (the diffusion model) or --gpu-only ComfyUI's offload device is the GPU.
    The decode phase had ComfyUI "release" the diffusion model anyway: no memory freed (the unload moves it to the
    same GPU), its LoRA unpatched and patched again at the next sample, and the ledger said it was released. It stays
    loaded now, with a line naming the flag."""
    import types

    mm = types.ModuleType("comfy.model_management")
    mm.current_loaded_models = []
    freed = []

    def free_memory(request, device, keep_loaded=()):
        freed.append(device)
        mm.current_loaded_models[:] = [lm for lm in mm.current_loaded_models
                                       if lm.device != device or any(lm is k for k in keep_loaded)]
    mm.free_memory = free_memory
    monkeypatch.setitem(sys.modules, "comfy", types.ModuleType("comfy"))
    monkeypatch.setitem(sys.modules, "comfy.model_management", mm)
    gpu = torch.device("cuda", 0)
    dit_patcher, vae_patcher = _Patcher(nn.Linear(4, 4)), _Patcher(nn.Linear(4, 4))
    dit_patcher.offload_device = gpu                    # --highvram: the diffusion model offloads to the GPU
    group = P.PhaseGroup(P.PhaseSettings(pin="off"))
    group.add("diffusion_model", dit_patcher)
    group.add("vae", vae_patcher)
    entry = SimpleNamespace(model=dit_patcher, device=gpu, model_loaded_memory=lambda: 2 ** 30)
    mm.current_loaded_models.append(entry)
    group.start_phase(group.components["vae"], vae_patcher)
    group.close_phase()
    assert mm.current_loaded_models == [entry] and not freed
    assert group.run.phases[-1].released == []
    assert any("--highvram or --gpu-only" in n and n.startswith("diffusion_model stays on the GPU") for n in group.notes)
