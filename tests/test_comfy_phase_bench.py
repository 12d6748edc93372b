"""bench/comfy_phase.py: PhaseOffload vs ComfyUI's default flow, in a real ComfyUI, on the CPU.

The benchmark imports ComfyUI into its process, so it runs in a subprocess: nothing of ComfyUI
leaks into this test process. Needs COMFYUI_PATH (a ComfyUI checkout); skipped without it.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench" / "comfy_phase.py"
STUBS = ROOT / "tests" / "integration" / "stubs"


def _load_bench():
    spec = importlib.util.spec_from_file_location("levers_bench_comfy_phase", BENCH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod      # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod


def _comfyui() -> str:
    path = os.environ.get("COMFYUI_PATH")
    if not path:
        pytest.skip("COMFYUI_PATH is not set: point it at a ComfyUI checkout to run the in-ComfyUI benchmark")
    if not (Path(path) / "comfy" / "model_management.py").is_file():
        pytest.skip(f"COMFYUI_PATH={path} has no comfy/model_management.py")
    return path


def test_bad_inputs_become_a_status_not_an_exception(tmp_path):
    bench = _load_bench()
    res = bench.run_phase_bench(str(tmp_path), "cpu", None, scale="cpu", deadline_s=10)
    assert res["status"] == "error" and "not a ComfyUI checkout" in res["reason"]
    res = bench.run_phase_bench(str(tmp_path), "cpu", None, scale="huge", deadline_s=10)
    assert res["status"] == "error" and "scale" in res["reason"]
    json.dumps(res)   # JSON-ready even on failure
    # the suite passes its own record to fill as the cases finish (its watchdog writes what is done)
    live = {"from_the_suite": True}
    res = bench.run_phase_bench(str(tmp_path), "cpu", None, scale="cpu", deadline_s=10, into=live)
    assert res is live and live["status"] == "error" and live["from_the_suite"]


def test_default_and_phase_offload_flows_in_comfyui(tmp_path):
    comfy = _comfyui()
    env = dict(os.environ)
    spec = importlib.util.find_spec("torchaudio")       # ComfyUI 0.33 imports it at start-up
    if spec is None or str(STUBS) in str(spec.origin):  # absent, or only the integration suite's stand-in
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(STUBS), env.get("PYTHONPATH")) if p)
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(BENCH), "--comfyui", comfy, "--device", "cpu", "--scale", "cpu",
                           "--deadline", "400", "--out", str(out)],
                          env=env, cwd=str(ROOT), capture_output=True, text=True, timeout=600)
    path = out / "comfy_phase.json"
    assert path.is_file(), f"no result written (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    res = json.loads(path.read_text())
    assert res["status"] == "ok", (res["reason"], res.get("traceback"), res.get("default"), res.get("phase_offload"))
    assert proc.returncode == 0

    d, p = res["default"], res["phase_offload"]
    assert res["sizes"]["dit"] > 0 and res["sizes"]["te"] > 0 and res["sizes"]["vae"] > 0
    for flow in (d, p):
        assert flow["status"] == "ok"
        assert flow["images_shape"][-1] == 3 and flow["images_finite"]
        assert set(flow["phases"]) == {"encode", "sample", "decode"}
        for ph in flow["phases"].values():
            assert ph["seconds"] > 0 and "peak_allocated_bytes" in ph and "peak_after_release_bytes" in ph
        assert flow["total_s"] >= sum(ph["seconds"] for ph in flow["phases"].values()) * 0.99
    assert d["images_shape"] == p["images_shape"]
    assert res["bit_identical"] is True and res["max_abs_diff"] == 0.0
    assert res["ratio_total_time"] == pytest.approx(p["total_s"] / d["total_s"], rel=1e-3)

    # ComfyUI's default flow keeps every component loaded; under PhaseOffload each phase runs alone
    # (ComfyUI's own ledger, read after each phase) and the bridge says whom it released.
    assert len(d["phases"]["decode"]["comfy_loaded_after"]) == 3
    for name, ph in p["phases"].items():
        assert len(ph["comfy_loaded_after"]) == 1, (name, ph["comfy_loaded_after"])
    assert p["phases"]["sample"]["levers_ledger"]["released"] == ["text_encoder"]
    assert p["phases"]["decode"]["levers_ledger"]["released"] == ["diffusion_model"]
    assert p["bytes"]["d2h_bytes"] == 0
    assert "PhaseOffload" in p["report"]

    # GroupPrefetch through its node, DiT only, same sampler: bit-identical to ComfyUI at both video lengths,
    # and it streamed (on the CPU with an explicit budget: ComfyUI itself loads everything there)
    gp = res["group_prefetch"]
    assert gp["status"] == "ok", (gp.get("reason"), gp.get("traceback"))
    assert gp["bit_identical"] is True and gp["bit_identical_b"] is True
    assert gp["levers_stats"]["streamed_groups"] >= 1 and gp["levers_stats"]["streamed_bytes_per_forward"] > 0
    assert "GroupPrefetch" in gp["levers_report"] and gp["ratio_time"] > 0
    # the same DiT as ComfyUI-GGUF loads a Q8_0 file of it, when a ComfyUI-GGUF checkout is given
    gg = gp["gguf"]
    if os.environ.get("COMFYUI_GGUF_PATH"):
        assert gg["status"] == "ok", (gg.get("reason"), gg.get("traceback"))
        assert gg["bit_identical"] is True and gg["levers_stats"]["kept_unstreamed"] == 0
        assert gg["levers_last_forward"]["h2d_bytes"] == gg["levers_stats"]["streamed_bytes_per_forward"] > 0
    else:
        assert gg["status"] == "skipped" and "COMFYUI_GGUF_PATH" in gg["reason"]
    # Wan 2.2's two experts (KSamplerAdvanced, half the steps each): PhaseOffload with model_2 against ComfyUI's
    # default flow, bit-identical, each expert with its own sampling phase in the ledger
    ex = res["experts"]
    assert ex["status"] == "ok", (ex.get("reason"), ex.get("traceback"))
    assert ex["bit_identical"] is True and ex["ratio_total_time"] > 0
    phases = [p["phase"] for p in ex["phase_offload"]["levers_run_ledger"]["phases"]]
    assert phases == ["encode", "sample", "sample (model 2)", "decode"]
    assert set(ex["default"]["phases"]) == {"encode", "sample", "sample_2", "decode"}
    assert res["summary"]["experts"]["bit_identical"] is True


class _FakeCuda:
    """Stands in for the few torch.cuda calls the CUDA-only helpers make (no GPU here)."""

    def __init__(self, monkeypatch, total=100, active=0):
        import torch

        self.allocated, self.peak, self.active, self.fractions = 0, 0, active, []
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda dev=None: self.peak)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", self.reset)
        monkeypatch.setattr(torch.cuda, "memory_stats", lambda dev=None: {"active_bytes.all.current": self.active,
                                                                          "reserved_bytes.all.current": self.active + 3})
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev=None: type("P", (), {"total_memory": total}))
        monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, dev=None: self.fractions.append(f))
        monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda dev=None: 1.0, raising=False)

    def reset(self, dev=None):
        self.peak = self.allocated

    def alloc(self, n):
        self.allocated += n
        self.peak = max(self.peak, self.allocated)


def test_peak_marks_split_a_phase_at_comfyuis_last_release(monkeypatch):
    import torch

    bench = _load_bench()
    cuda = _FakeCuda(monkeypatch)
    released = []

    def free_memory(need, device, keep_loaded=()):
        released.append(need)
        cuda.allocated -= 70          # the previous phase's model leaves the card
        return []

    mm = type("MM", (), {})()
    mm.free_memory = free_memory
    cuda.alloc(70)                    # previous component still resident when the phase starts
    with bench.PeakMarks(mm, torch.device("cuda", 0)) as marks:
        marks.start()
        assert mm.free_memory is not free_memory
        mm.free_memory(1, "cuda")     # ComfyUI / PhaseOffload release before this phase loads
        cuda.alloc(30)                # this component + activations
        cuda.alloc(-10)
        whole, after = marks.finish()
    assert (whole, after) == (70, 30) and released == [1]
    assert mm.free_memory is free_memory, "the wrapper is removed after the phase"


def test_emulated_card_reports_the_budget_and_restores(monkeypatch):
    import torch

    bench = _load_bench()
    cuda = _FakeCuda(monkeypatch, total=1000, active=150)
    orig = lambda dev=None, torch_free_too=False: (999, 0) if torch_free_too else 999  # noqa: E731
    mm = type("MM", (), {})()
    mm.get_free_memory = orig
    mm.get_torch_device = lambda: torch.device("cuda", 0)
    dev = torch.device("cuda", 0)
    with bench.emulated_card(mm, dev, 400):
        assert mm.get_free_memory() == 250                           # budget - active
        assert mm.get_free_memory(dev, torch_free_too=True) == (250, 3)
        assert mm.get_free_memory(torch.device("cpu")) == 999       # other devices: ComfyUI's own answer
        assert cuda.fractions == [0.4]
    assert mm.get_free_memory is orig and cuda.fractions == [0.4, 1.0]
    with bench.emulated_card(mm, torch.device("cpu"), 400):        # no budget on the CPU
        assert mm.get_free_memory is orig
