"""Phase offload on a real CUDA device (skipped on CPU).

Run the checks:      pytest tests/test_phase_cuda.py -q
Print a benchmark:   python tests/test_phase_cuda.py [--gib 4]   (JSON: onload GB/s pinned vs pageable,
                     raw pinned H2D GB/s, offload bytes, peak memory). No timed assertions here.
"""
from __future__ import annotations

import json
import sys
import time

import pytest
import torch
from torch import nn

from comfyui_levers.core.residency.phase import MasterTable, PhaseConfig, apply_phase_offload, swap_module_to
from comfyui_levers.core.residency.pinned import PinnedStore
from comfyui_levers.core.residency.transport import CudaTransport, RecordingTransport

pytestmark = pytest.mark.cuda
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _model(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.LayerNorm(512), nn.Linear(512, 256)).to(dtype).eval()
    m.register_buffer("gain", torch.linspace(0.5, 1.5, 256, dtype=dtype))
    return m


def _run(m, x):
    return m(x) * m.gain


@needs_cuda
@pytest.mark.parametrize("pin", ["on", "off"])
def test_cuda_cycles_are_bit_exact_and_offload_is_free(pin):
    plain = _model().cuda()
    x = torch.randn(8, 256, device="cuda")
    want = _run(plain, x)
    managed = _model()
    tr = RecordingTransport(CudaTransport("cuda"))
    h = apply_phase_offload(managed, PhaseConfig(name="dit", pin=pin), tr)
    masters = h.master_ptrs()
    assert h.report()["pin"]["pinned"] is (pin == "on")
    if pin == "on":
        assert managed[0].weight.is_pinned()
    base = torch.cuda.memory_allocated()
    for _ in range(3):
        with torch.inference_mode():
            rec = h.onload("sample")
            assert managed[0].weight.is_cuda and rec["h2d_bytes"] == h.host_bytes
            assert torch.equal(_run(managed, x), want)
            off = h.offload()
        assert off["d2h_bytes"] == 0 and not tr.kinds("d2h")
        assert all(p.data_ptr() == masters[n] for n, p in managed.named_parameters())
        assert not managed[0].weight.is_cuda and not managed[0].weight.is_inference()
        assert torch.cuda.memory_allocated() == base      # device copies are gone after offload
    h.remove()
    assert not managed[0].weight.is_pinned()


@needs_cuda
def test_cuda_in_place_patch_is_copied_home_once():
    managed = _model()
    h = apply_phase_offload(managed, PhaseConfig(name="dit", pin="on"), CudaTransport("cuda"))
    master = h.master_ptrs()["0.weight"]
    h.onload()
    with torch.no_grad():
        managed[0].weight.add_(1.0)
    rec = h.offload()
    assert rec["restaged"] == 1 and rec["d2h_bytes"] == managed[0].weight.nbytes
    assert managed[0].weight.data_ptr() == master
    plain = _model()
    with torch.no_grad():
        plain[0].weight.add_(1.0)
    assert torch.equal(managed[0].weight, plain[0].weight)
    h.remove()


@needs_cuda
def test_cuda_manager_driven_moves_are_copy_in_and_pointer_swap_out():
    """What ComfyUI's patcher does (per-module and whole-model .to calls), through the seam."""
    plain = _model().cuda()
    x = torch.randn(8, 256, device="cuda")
    want = _run(plain, x)
    m = _model()
    tr = RecordingTransport(CudaTransport("cuda"))
    table = MasterTable(m, "dit", tr, PinnedStore(tr, "on"))
    table.capture()
    assert table.pin_outcome.pinned and m[0].weight.is_pinned()
    masters = {n: e.host.data_ptr() for n, e in table.masters.items()}
    base = torch.cuda.memory_allocated()
    dev, cpu = torch.device("cuda", torch.cuda.current_device()), torch.device("cpu")
    with swap_module_to(table, dev, cpu):
        for _ in range(2):
            with torch.inference_mode():
                m[0].to(dev)                 # ComfyUI loads module by module ...
                m.to(dev)                    # ... then the rest with the root
                assert all(p.is_cuda for p in m.parameters()) and torch.equal(_run(m, x), want)
                m[3].to(cpu)                 # partially_unload
                assert m[3].weight.data_ptr() == masters["3.weight"]
                m.to(cpu)                    # unpatch_model
            assert all(p.data_ptr() == masters[n] for n, p in m.named_parameters())
            assert torch.cuda.memory_allocated() == base
        assert not tr.kinds("d2h")
        # a weight the manager patched (new Parameter on the device) is left to its own copy
        m.to(dev)
        m[0].weight = nn.Parameter(m[0].weight.detach() * 2, requires_grad=False)
        m.to(cpu)
        assert not m[0].weight.is_cuda and m[0].weight.data_ptr() != masters["0.weight"]
        assert table.left_bytes == m[0].weight.nbytes and not tr.kinds("d2h")   # torch's own copy, not ours
    table.release()
    assert not m[3].weight.is_pinned()


@needs_cuda
def test_cuda_read_only_weights_are_copied_then_pinned_and_a_failed_register_leaves_no_error(tmp_path):
    """Weights in a read-only file mapping (GGUF, ComfyUI 0.33's mmap loader) are copied into writable memory and
    pinned there; the module runs bit-exact through the phase. And what the driver does with a read-only range:
    registering it directly is tried once, outside the engine, and whatever it answers, the next kernel runs (a
    failed register's error is consumed). Prints the driver's answer for the record."""
    import warnings

    import numpy as np

    from comfyui_levers.core.residency.transport import HostMaps, cuda_code, discard_pending_cuda_error

    plain = _model().cuda()
    x = torch.randn(8, 256, device="cuda")
    want = _run(plain, x)
    m = _model()
    path = tmp_path / "w.bin"
    w = m[0].weight.detach().contiguous()
    path.write_bytes(w.numpy().tobytes())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ro = torch.from_numpy(np.memmap(path, mode="r", dtype=np.float32)).view(w.shape)
    m[0].weight.data = ro
    assert HostMaps.read().writable(ro.data_ptr(), ro.nbytes) is False
    # the driver on a read-only range, directly (the engine never does this)
    err = torch.cuda.cudart().cudaHostRegister(ro.data_ptr(), ro.nbytes, 1)
    code = cuda_code(err)
    if code == 0:
        torch.cuda.cudart().cudaHostUnregister(ro.data_ptr())
    else:
        discard_pending_cuda_error()
    print(f"cudaHostRegister on a read-only mapping: CUDA error {code}")
    assert torch.equal((x + 1).sum(), (x + 1).sum())              # no stale error surfaces at the next kernel
    tr = RecordingTransport(CudaTransport("cuda"))
    h = apply_phase_offload(m, PhaseConfig(name="dit", pin="on"), tr, PinnedStore(tr, "on"))
    pin = h.report()["pin"]
    assert pin["pinned"] and pin["copied_bytes"] == ro.nbytes, pin
    assert m[0].weight.is_pinned() and m[0].weight.data_ptr() != ro.data_ptr()
    for _ in range(2):
        with h.phase():
            assert torch.equal(_run(m, x), want)
    assert not tr.kinds("d2h")
    h.remove()


@needs_cuda
def test_cuda_read_only_views_with_gaps_are_packed_pinned_and_bit_exact(tmp_path):
    """Weights that are views into one read-only mapping with gaps between them (a file holding other tensors too):
    only the views are copied, into one packed buffer that is pinned; the phase runs bit-exact from it."""
    import warnings

    import numpy as np

    plain = _model().cuda()
    x = torch.randn(8, 256, device="cuda")
    want = _run(plain, x)
    m = _model()
    ws = [m[i].weight.detach().contiguous() for i in (0, 2)]
    gap = np.zeros(1 << 18, dtype=np.float32)                     # 1 MiB of other tensors between them
    path = tmp_path / "w.bin"
    path.write_bytes(b"".join(np.concatenate([w.numpy().reshape(-1), gap]).tobytes() for w in ws))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        blob = torch.from_numpy(np.memmap(path, mode="r", dtype=np.float32))
    off = 0
    for i, w in zip((0, 2), ws):
        m[i].weight.data = blob[off:off + w.numel()].view(w.shape)
        off += w.numel() + gap.size
    tr = RecordingTransport(CudaTransport("cuda"))
    h = apply_phase_offload(m, PhaseConfig(name="dit", pin="on"), tr, PinnedStore(tr, "on"))
    pin = h.report()["pin"]
    assert pin["pinned"] and sum(w.nbytes for w in ws) <= pin["copied_bytes"] < blob.nbytes, pin
    assert all(m[i].weight.is_pinned() for i in (0, 2))
    for _ in range(2):
        with h.phase():
            assert torch.equal(_run(m, x), want)
    h.remove()


def bench(gib: float = 4.0, layers: int = 16) -> dict:
    """Onload/offload a bf16 stack of ``gib`` GiB; compare with a raw pinned copy of the same size."""
    per = int(gib * 1024 ** 3 / layers / 2)              # bf16 elements per layer
    side = int(per ** 0.5)
    out: dict = {"gib": gib, "layers": layers, "device": torch.cuda.get_device_name()}
    raw = torch.empty(layers * side * side, dtype=torch.bfloat16, pin_memory=True)
    dst = torch.empty_like(raw, device="cuda")
    for _ in range(2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(raw, non_blocking=True)
        torch.cuda.synchronize()
        raw_s = time.perf_counter() - t0
    out["raw_pinned_h2d_gbps"] = round(raw.nbytes / raw_s / 1e9, 2)
    del raw, dst
    for pin in ("on", "off"):
        m = nn.Sequential(*[nn.Linear(side, side, bias=False, dtype=torch.bfloat16, device="meta")
                            for _ in range(layers)]).to_empty(device="cpu")   # values do not matter here
        t0 = time.perf_counter()
        h = apply_phase_offload(m, PhaseConfig(name=f"stack_{pin}", pin=pin), CudaTransport("cuda"))
        out[f"apply_seconds_pin_{pin}"] = round(time.perf_counter() - t0, 3)
        x = torch.randn(64, side, device="cuda", dtype=torch.bfloat16)
        for i in range(3):
            h.onload(f"run{i}")
            with torch.inference_mode():
                m(x)
            h.offload()
        out[f"pin_{pin}"] = h.report()
        h.remove()
        del m, h
        torch.cuda.empty_cache()
    on = [r for r in out["pin_on"]["ledger"]["records"] if r["kind"] == "onload"][1:]
    best = max(r["gbps"] for r in on)
    out["pinned_onload_gbps_best"] = best
    out["pinned_onload_vs_raw"] = round(best / out["raw_pinned_h2d_gbps"], 3)
    return out


if __name__ == "__main__":
    gib = float(sys.argv[sys.argv.index("--gib") + 1]) if "--gib" in sys.argv else 4.0
    print(json.dumps(bench(gib), indent=1))


@needs_cuda
def test_two_stores_share_a_pinned_range_until_the_last_lets_go():
    """The real driver's registry (tests/test_pinned.py emulates it): a second store on memory the first page-locked
    takes a use of it; the first's unpin leaves it page-locked, the second's unregisters it."""
    from comfyui_levers.core.residency.pinned import group_by_storage
    from comfyui_levers.core.residency.transport import pinned_by_levers

    w = torch.randn(1 << 20)
    first, second = (PinnedStore(CudaTransport("cuda"), "on", None) for _ in range(2))
    assert first.pin_component("dit", group_by_storage([("w", w)])).reason == "pinned in place"
    assert "shared with another Levers node" in second.pin_component("dit", group_by_storage([("w", w)])).reason
    first.unpin_all()
    assert w.is_pinned() and pinned_by_levers(w)
    second.unpin_all()
    assert not w.is_pinned() and not pinned_by_levers(w)
