"""LeversRecommend inside a real ComfyUI: measures the connected tiny models and reports."""
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


def test_recommend_rejects_a_non_model(comfy_env, tiny_wan):
    node = _node(comfy_env)
    with pytest.raises(IncompatibleInput, match="Connect the MODEL output"):
        node.execute("auto", 64, 64, 1, 2, 1, "balanced", 0.0, 0.0, model=tiny_wan.load_vae())


def test_recommend_reports_comfyui_mode(comfy_env):
    from comfyui_levers.bridge.comfy_mode import comfy_mode

    facts = comfy_mode()
    assert facts["cpu"] is True
    assert facts["dynamic_vram"] is False  # a CPU load device never uses the dynamic patcher
