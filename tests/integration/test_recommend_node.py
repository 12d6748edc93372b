"""LeversRecommend inside a real ComfyUI: measures the connected tiny models and reports."""
import dataclasses
import json

import pytest

from comfyui_levers.core.errors import IncompatibleInput
from comfyui_levers.core.plan_types import Plan


def _node(comfy_env):
    from comfyui_levers.nodes.recommend import LeversRecommend

    return LeversRecommend


def test_recommend_measures_connected_models(comfy_env, tiny_wan):
    node = _node(comfy_env)
    model, vae = tiny_wan.load_model(), tiny_wan.load_vae()
    out = node.execute("auto", 64, 64, 5, 2, 1, "balanced", 0.0, 0.0, model=model, vae=vae)
    plan, report = out.result
    assert isinstance(plan, Plan)
    params = sum(p.numel() for p in model.model.diffusion_model.parameters())
    assert "measured" in plan.model and f"{params / 1e9:.2f} B" in plan.model
    assert plan.diffusion_model.device == "cpu"  # ComfyUI runs with --cpu in tests
    assert "model family detected: wan" in report
    assert Plan.from_json(plan.to_json()) == plan
    json.loads(plan.to_json())
    assert out.ui.as_dict()["text"][0] == report


def test_recommend_plans_for_a_given_card(comfy_env, tiny_wan):
    node = _node(comfy_env)
    plan, report = node.execute("flux1-dev", 1024, 1024, 1, 28, 1, "balanced", 16.0, 64.0).result
    dm = plan.diffusion_model
    # balanced on 16 GB: bf16 blocks streamed behind compute (fp8 measured only 1.05x on FLUX, tests/test_plan.py)
    assert plan.fits and (dm.precision.value, dm.residency.value) == ("bf16", "streamed")
    assert plan.predicted_peak_bytes <= 16 * 1024 ** 3
    assert "predicted peak" in report


def test_recommend_plans_reference_images(comfy_env):
    node = _node(comfy_env)
    plain, _ = node.execute("flux1-dev", 1024, 1024, 1, 28, 1, "balanced", 16.0, 64.0).result
    edit, report = node.execute("flux1-dev", 1024, 1024, 1, 28, 1, "balanced", 16.0, 64.0,
                                reference_images=1).result
    assert edit.workload["references"] == 1 and edit.activation_bytes > 1.8 * plain.activation_bytes
    assert "+ 1 reference image" in report


def test_a_size_off_the_widgets_step_is_planned_as_comfyuis_latent_with_a_note(comfy_env):
    """An API prompt can send 1020 px (the widget steps by 8): ComfyUI's empty-latent nodes make 1016 // 8 cells for
    it, so the plan is the 1016 plan with a note; it was a ConfigError (Recommend fails soft)."""
    node = _node(comfy_env)
    odd, report = node.execute("flux1-dev", 1020, 1004, 1, 28, 1, "balanced", 16.0, 64.0).result
    even, _ = node.execute("flux1-dev", 1016, 1000, 1, 28, 1, "balanced", 16.0, 64.0).result
    assert (odd.workload["width"], odd.workload["height"]) == (1016, 1000)
    assert odd.predicted_peak_bytes == even.predicted_peak_bytes
    assert "size: 1020x1004 planned as 1016x1000" in report


def test_recommend_rejects_a_non_model(comfy_env, tiny_wan):
    node = _node(comfy_env)
    with pytest.raises(IncompatibleInput, match="Connect the MODEL output"):
        node.execute("auto", 64, 64, 1, 2, 1, "balanced", 0.0, 0.0, model=tiny_wan.load_vae())


def test_recommend_reports_comfyui_mode(comfy_env):
    from comfyui_levers.bridge.comfy_mode import comfy_mode

    facts = comfy_mode()
    assert facts["cpu"] is True
    assert facts["dynamic_vram"] is False  # a CPU load device never uses the dynamic patcher


@pytest.mark.parametrize("flag", ["highvram", "gpu_only", "lowvram", "novram", "disable_smart_memory", "cpu_vae"])
def test_the_plan_names_comfyuis_memory_flags(comfy_env, monkeypatch, flag):
    """Found in review: the plan and report were the same under --highvram, --gpu-only, --lowvram, --novram and
    --disable-smart-memory, though ComfyUI then keeps models on the GPU, places the text encoder on the CPU, or
    unloads everything after each prompt. The report names the flag and what it does to the plan's levers."""
    import comfy.cli_args
    import comfy.model_management as mm

    from comfyui_levers.bridge.comfy_mode import comfy_mode
    from comfyui_levers.core.plan import Workload, plan
    from comfyui_levers.core.presets import get_preset
    from comfyui_levers.core.probe import synthetic_machine

    state = {"highvram": "HIGH_VRAM", "gpu_only": "HIGH_VRAM", "lowvram": "LOW_VRAM", "novram": "NO_VRAM"}.get(flag)
    if state:
        monkeypatch.setattr(mm, "vram_state", mm.VRAMState[state])
    if flag in ("gpu_only", "cpu_vae"):
        monkeypatch.setattr(comfy.cli_args.args, flag, True)
    if flag == "disable_smart_memory":
        monkeypatch.setattr(mm, "DISABLE_SMART_MEMORY", True)
    want = {"highvram": "--highvram: ComfyUI keeps the diffusion model on the GPU", "gpu_only": "--gpu-only:",
            "lowvram": "--lowvram: ComfyUI loads part", "novram": "--novram: ComfyUI loads none",
            "disable_smart_memory": "--disable-smart-memory:", "cpu_vae": "--cpu-vae:"}[flag]
    assert any(n.startswith(want) for n in comfy_mode()["notes"]), comfy_mode()["notes"]
    m = dataclasses.replace(synthetic_machine(vram_gb=16, ram_gb=64, h2d_gbps=25), comfyui=comfy_mode())
    assert want in "\n".join(plan(get_preset("wan2.1-14b"), Workload(832, 480, 33), m).notes)


@pytest.mark.parametrize("kind", ["fp8", "gguf"])
@pytest.mark.parametrize("vram_gb", [0.0, 1.0], ids=["comfyui_device", "1GB_card"])
def test_an_already_quantized_model_is_planned_as_it_is_stored(comfy_env, tiny_wan, request, kind, vram_gb):
    """An fp8 checkpoint (ComfyUI's QuantizedTensor, here from QuantizeDiT) or a GGUF file (ComfyUI-GGUF's packed
    GGMLTensor) weighs what it holds: the plan must not size it as bf16 (QuantizedTensor reports its logical dtype,
    2x the bytes) nor count a GGUF's packed bytes as parameters."""
    from comfyui_levers.bridge.recommend import measure
    from comfyui_levers.core.residency import subclass

    plain = tiny_wan.load_model()
    params = sum(p.numel() for p in plain.model.diffusion_model.parameters())
    if kind == "fp8":
        quant = next(c for c in comfy_env.levers_nodes.NODE_CLASSES if c.__name__ == "LeversQuantizeDiT")
        model = quant.execute(plain, format="fp8_e4m3fn", quality_check=False).args[0]
    else:
        model = request.getfixturevalue("gguf").load_model()
    dm = model.model.diffusion_model
    real = sum(subclass.nbytes(t) for t in {id(t): t for t in [*dm.parameters(), *dm.buffers()]}.values())
    spec, notes = measure(model=model)
    assert spec.dit_params == params                      # the weights it encodes, not its bytes
    assert spec.dit_stored_bytes == real
    assert spec.dit_stored.startswith("fp8" if kind == "fp8" else "gguf Q"), spec.dit_stored
    plan, report = _node(comfy_env).execute("auto", 64, 64, 5, 2, 1, "balanced", vram_gb, 0.0, model=model).result
    dmp = plan.diffusion_model
    assert dmp.weight_bytes == real, (dmp.weight_bytes, real)
    assert dmp.precision.value == ("fp8_e4m3fn" if kind == "fp8" else spec.dit_stored_precision)
    assert "already quantized" in report, report


def test_comfyuis_reserve_vram_is_left_alone(comfy_env, monkeypatch):
    """``--reserve-vram 4``: ComfyUI keeps 4 GiB free for other programs; the plan used to spend it."""
    from comfyui_levers.bridge.comfy_mode import comfy_mode
    from comfyui_levers.core.plan import Workload, plan
    from comfyui_levers.core.presets import get_preset
    from comfyui_levers.core.probe import synthetic_machine

    mm = comfy_env.mm
    assert comfy_mode()["extra_reserved_vram_bytes"] == mm.extra_reserved_memory()
    # ComfyUI's own default is within the overhead: nothing withheld until a --reserve-vram is given
    m = dataclasses.replace(synthetic_machine(vram_gb=16, ram_gb=64, h2d_gbps=25), comfyui=comfy_mode())
    assert plan(get_preset("flux1-dev"), Workload(1024, 1024), m).withheld_bytes == 0
    import comfy.cli_args

    monkeypatch.setattr(comfy.cli_args.args, "reserve_vram", 4.0)
    monkeypatch.setattr(mm, "EXTRA_RESERVED_VRAM", 4 * 1024 ** 3)      # what ComfyUI sets from it at import
    facts = comfy_mode()
    assert facts["extra_reserved_vram_bytes"] == 4 * 1024 ** 3
    m = dataclasses.replace(synthetic_machine(vram_gb=16, ram_gb=64, h2d_gbps=25), comfyui=facts)
    p = plan(get_preset("flux1-dev"), Workload(1024, 1024), m)
    assert p.withheld_bytes == 4 * 1024 ** 3 - 400 * 1024 ** 2 and any("--reserve-vram" in n for n in p.notes)
