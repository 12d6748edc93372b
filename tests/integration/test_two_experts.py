"""Wan 2.2 A14B's two experts in a real (headless, CPU) ComfyUI: a high-noise model samples the first steps and a
low-noise model the rest (two KSamplerAdvanced, as ComfyUI's own Wan 2.2 template). Tiny random-weight Wan 2.1 DiTs
stand in for the experts (Wan 2.2 A14B is the Wan 2.1 architecture, two checkpoints).

As in test_phase_offload_node.py, the patchers get an offload device of ``cpu:0`` (host memory, but another torch
device) so that ComfyUI really moves weights between a load and an offload device."""
from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.comfyui

HOST = torch.device("cpu", 0)
LOW = "levers_tiny_wan21_low_noise.safetensors"
STEPS, SWITCH = 4, 2


def _node(env, name):
    return next(c for c in env.levers_nodes.NODE_CLASSES if c.__name__ == name)


def _args(out):
    return out.args if hasattr(out, "args") else out.result


@pytest.fixture(scope="module")
def experts(comfy_env, tiny_wan):
    """(load_high, load_low): two different tiny Wan 2.1 DiTs, each loaded fresh by ComfyUI's UNETLoader."""
    from tiny_models import save, tiny_wan_dit_state_dict

    path = os.path.join(comfy_env.models_dir, "diffusion_models", LOW)
    if not os.path.exists(path):
        save(tiny_wan_dit_state_dict(seed=7), path)

    def load(name):
        p = comfy_env.nodes.UNETLoader().load_unet(name, "default")[0].clone()
        p.offload_device = HOST
        return p
    return (lambda: load(tiny_wan.unet_name)), (lambda: load(LOW))


def _sample(env, tiny_wan, high, low, seed=0):
    """ComfyUI's Wan 2.2 two-expert recipe: high noise for steps 0..SWITCH (leftover noise kept), low noise after."""
    pos, neg = tiny_wan.cond(seed)
    ks = env.nodes.KSamplerAdvanced()
    latent = tiny_wan.empty_latent()
    mid = ks.sample(high, "enable", seed, STEPS, 3.5, "euler", "simple", pos, neg, latent, 0, SWITCH, "enable")[0]
    return ks.sample(low, "disable", seed, STEPS, 3.5, "euler", "simple", pos, neg, mid, SWITCH, 10000, "disable")[0]


def _storage(t):
    return t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()


def _loaded(env, patcher) -> bool:
    return any(lm.model is not None and lm.model.model is patcher.model for lm in env.mm.current_loaded_models)


def test_phase_offload_gives_each_expert_the_device_alone_bit_identical(comfy_env, tiny_wan, experts):
    from comfyui_levers.bridge.phase import ATTACHMENT

    load_high, load_low = experts
    vae = tiny_wan.load_vae()
    high, low = load_high(), load_low()
    ref = _sample(comfy_env, tiny_wan, high, low)["samples"]
    ref_img = tiny_wan.decode(vae, {"samples": ref})
    high_only = _sample(comfy_env, tiny_wan, high, high)["samples"]
    assert not torch.equal(ref, high_only), "the low-noise expert must change the output for this test to mean much"
    comfy_env.mm.unload_all_models()

    high_in, low_in = load_high(), load_low()
    stock = type(low_in)
    m, _, v, report, m2 = _args(_node(comfy_env, "LeversPhaseOffload").execute(high_in, None, vae, model_2=low_in))
    assert m2 is not None and m2.model is not m.model
    assert "diffusion_model_2" in report
    group = m.attachments[ATTACHMENT].group
    assert m2.attachments[ATTACHMENT].group is group
    for _ in range(2):
        latent = _sample(comfy_env, tiny_wan, m, m2)
        assert torch.equal(latent["samples"], ref)
        # the high-noise expert was released through ComfyUI when the low-noise one started
        assert _loaded(comfy_env, m2) and not _loaded(comfy_env, m)
        assert torch.equal(tiny_wan.decode(v, latent), ref_img)
        assert not _loaded(comfy_env, m2) and not _loaded(comfy_env, m)
        # each expert is back on its own host masters: nothing was copied device->host
        for patcher, name in ((m, "diffusion_model"), (m2, "diffusion_model_2")):
            masters = group.components[name].table.masters
            assert masters
            assert all(p.data_ptr() == masters[n].host.data_ptr() for n, p in patcher.model.named_parameters()
                       if n in masters)
    led = group.ledger()
    run = led["run"]["phases"]
    # headless calls have no prompt id: both generations are one run in the ledger
    assert [p["phase"] for p in run] == ["sample", "sample (model 2)", "decode"] * 2
    assert [p["released"] for p in run] == [[], ["diffusion_model"], ["diffusion_model_2"],
                                            ["vae"], ["diffusion_model"], ["diffusion_model_2"]]
    assert led["totals"]["d2h_bytes"] == 0
    loads = {r["component"]: r["h2d"] for r in led["records"] if r["kind"] == "load"}
    assert loads.get("diffusion_model", 0) > 0 and loads.get("diffusion_model_2", 0) > 0
    # the input models are untouched: stock class, no attachment, the plain workflow gives the same result
    assert type(high_in) is stock and type(low_in) is stock
    assert "levers_phase" not in high_in.attachments and "levers_phase" not in low_in.attachments
    assert torch.equal(_sample(comfy_env, tiny_wan, high_in, low_in)["samples"], ref)


def test_a_plan_keeping_one_diffusion_model_resident_lets_two_experts_take_turns(comfy_env, tiny_wan, experts):
    """Found in review: a plan made for one diffusion model may keep it on the GPU across phases; with model_2
    connected, the first expert was then never released and both were on the GPU while the second sampled. The
    experts take turns instead, with a note saying why."""
    from comfyui_levers.bridge.phase import PhaseSettings, apply

    load_high, load_low = experts
    ref = _sample(comfy_env, tiny_wan, load_high(), load_low())["samples"]
    comfy_env.mm.unload_all_models()
    out = apply(load_high(), None, tiny_wan.load_vae(), PhaseSettings(resident=("diffusion_model",)),
                model_2=load_low())
    assert any("model_2 is connected: the two take turns" in n for n in out.group.notes), out.group.notes
    pos, neg = tiny_wan.cond(0)
    ks = comfy_env.nodes.KSamplerAdvanced()
    mid = ks.sample(out.model, "enable", 0, STEPS, 3.5, "euler", "simple", pos, neg, tiny_wan.empty_latent(), 0,
                    SWITCH, "enable")[0]
    assert _loaded(comfy_env, out.model)
    latent = ks.sample(out.model_2, "disable", 0, STEPS, 3.5, "euler", "simple", pos, neg, mid, SWITCH, 10000,
                       "disable")[0]
    assert _loaded(comfy_env, out.model_2) and not _loaded(comfy_env, out.model)
    assert torch.equal(latent["samples"], ref)
    comfy_env.mm.unload_all_models()


def test_group_prefetch_on_each_expert_after_phase_offload(comfy_env, tiny_wan, experts):
    """The shipped Wan 2.2 layout: PhaseOffload (model, model_2) then a GroupPrefetch on each expert. Each streams
    its own blocks (its own host arena), the other expert is released, output bit-identical."""
    from comfyui_levers.bridge.phase import ATTACHMENT
    from comfyui_levers.bridge.prefetch import _STORES, prefetch_state
    from comfyui_levers.core.residency.blocks import find_blocks, module_bytes

    load_high, load_low = experts
    ref = _sample(comfy_env, tiny_wan, load_high(), load_low())["samples"]
    comfy_env.mm.unload_all_models()
    m, _, _, _, m2 = _args(_node(comfy_env, "LeversPhaseOffload").execute(load_high(), model_2=load_low()))
    prefetch = _node(comfy_env, "LeversGroupPrefetch")
    settings = dict(blocks_per_group=1, prefetch_depth=1, resident_groups=1, vram_budget_gb=1.0)
    a, _ = _args(prefetch.execute(m, **settings))
    b, _ = _args(prefetch.execute(m2, **settings))
    group = m.attachments[ATTACHMENT].group
    for _ in range(2):
        assert torch.equal(_sample(comfy_env, tiny_wan, a, b)["samples"], ref)
        assert _loaded(comfy_env, b) and not _loaded(comfy_env, a)
        # one host copy per expert from the first run on: PhaseOffload's masters of the streamed blocks are
        # GroupPrefetch's arena (before, the first run held both: about 1.5x an expert)
        for patcher, name in ((m, "diffusion_model"), (m2, "diffusion_model_2")):
            masters = {_storage(x.host) for x in group.components[name].table.masters.values()}
            store = _STORES[patcher.model.diffusion_model][1]
            arenas = {_storage(t) for a in store.arenas.values() for t in a.tensors()}
            assert sum(n for _, n in masters | arenas) <= 1.01 * module_bytes(patcher.model)
        for clone in (a, b):
            stats = prefetch_state(clone).last_stats
            assert stats is not None, prefetch_state(clone).last_report
            blocks = find_blocks(clone.model.diffusion_model).blocks
            assert stats["last_forward"]["h2d_bytes"] >= sum(module_bytes(x) for _, x in blocks[1:])
            assert stats["last_forward"]["d2h_bytes"] == 0


def test_the_same_model_as_model_2_is_one_component(comfy_env, tiny_wan, experts):
    """A LoRA'd clone of the first expert connected as model_2 (same diffusion model): one component, so its phase
    never releases itself."""
    from comfyui_levers.bridge.phase import ATTACHMENT

    load_high, _ = experts
    high = load_high()
    ref = _sample(comfy_env, tiny_wan, high, high)["samples"]
    comfy_env.mm.unload_all_models()
    m, _, _, report, m2 = _args(_node(comfy_env, "LeversPhaseOffload").execute(high, model_2=high.clone()))
    assert "managed as one" in report
    group = m.attachments[ATTACHMENT].group
    assert set(group.components) == {"diffusion_model"}
    assert m2.attachments[ATTACHMENT] is group.components["diffusion_model"]
    assert torch.equal(_sample(comfy_env, tiny_wan, m, m2)["samples"], ref)
    assert not any(r["kind"] == "exclusive" for r in group.records)


def test_recommend_plans_both_experts(comfy_env, tiny_wan, experts):
    load_high, load_low = experts
    node = _node(comfy_env, "LeversRecommend")
    kw = dict(model_preset="auto", width=832, height=480, frames=81, steps=20, batch=1, goal="balanced",
              vram_gb=24.0, ram_gb=64.0)
    one, _ = _args(node.execute(**kw, model=load_high()))
    two, report = _args(node.execute(**kw, model=load_high(), model_2=load_low()))
    assert one.experts == 1 and two.experts == 2
    # one resident model keeps no host copy (ComfyUI loads it once); two experts keep a host master each
    from comfyui_levers.core.types import Residency

    kept_one = 0 if one.diffusion_model.residency is Residency.RESIDENT else one.diffusion_model.weight_bytes
    assert two.host_bytes - one.host_bytes == 2 * two.diffusion_model.weight_bytes - kept_one
    assert "second expert" in report and "one copy per expert" in report
