"""PhaseOffload in a real (headless, CPU) ComfyUI on a tiny random-weight Wan 2.1 DiT + VAE.

On a CPU-only ComfyUI the load and offload devices are both ``cpu``, so nothing would move. Some
tests give the patcher an offload device of ``cpu:0`` (a distinct torch device that is still host
memory): ComfyUI then really runs its load / unpatch / partially_unload paths with ``Module.to``
calls between two devices, and the pointer swap is exercised inside ComfyUI's own code.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.comfyui

HOST = torch.device("cpu", 0)   # "another device" that is host memory (see the module docstring)


def _node(env):
    for cls in env.levers_nodes.NODE_CLASSES:
        if cls.__name__ == "LeversPhaseOffload":
            return cls
    raise AssertionError("LeversPhaseOffload is not registered")


def _run_node(env, model, clip=None, vae=None, **kw):
    out = _node(env).execute(model, clip, vae, **kw)
    return out.args if hasattr(out, "args") else out.result


def _group(patcher):
    from comfyui_levers.bridge.phase import ATTACHMENT

    return patcher.attachments[ATTACHMENT].group


def _dit_entries(env, module):
    return [lm for lm in env.mm.current_loaded_models if lm.model is not None and lm.model.model is module]


def _host_offload(patcher):
    """A clone whose offload device is HOST, so ComfyUI moves weights between two devices."""
    c = patcher.clone()
    c.offload_device = HOST
    return c


def _snapshot(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def test_bit_identical_repeatedly_and_plain_workflow_unchanged(comfy_env, tiny_wan):
    model, vae = tiny_wan.load_model(), tiny_wan.load_vae()
    base_cls, vae_patcher, vae_cls = type(model), vae.patcher, type(vae.patcher)
    weights = _snapshot(model.model)
    ref = tiny_wan.sample(model)["samples"]
    ref_img = tiny_wan.decode(vae, {"samples": ref})
    m, c, v, report = _run_node(comfy_env, model, None, vae)
    assert c is None and m is not model and v is not vae
    assert "PhaseOffload" in report and "what ComfyUI already does" in report
    for _ in range(2):
        out = tiny_wan.sample(m)["samples"]
        assert torch.equal(out, ref)
        assert torch.equal(tiny_wan.decode(v, {"samples": out}), ref_img)
    # the inputs are untouched and the plain workflow still gives the same result
    assert type(model) is base_cls and "levers_phase" not in model.attachments
    assert vae.patcher is vae_patcher and type(vae.patcher) is vae_cls
    assert torch.equal(tiny_wan.sample(model)["samples"], ref)
    assert torch.equal(tiny_wan.decode(vae, {"samples": ref}), ref_img)
    after = _snapshot(model.model)
    assert all(torch.equal(weights[k], after[k]) for k in weights)
    assert _group(m).ledger()["totals"]["d2h_bytes"] == 0


def test_each_phase_runs_alone_in_comfyuis_ledger(comfy_env, tiny_wan):
    model, vae = tiny_wan.load_model(), tiny_wan.load_vae()
    m, _, v, _ = _run_node(comfy_env, model, None, vae)
    latent = tiny_wan.sample(m)
    assert _dit_entries(comfy_env, m.model), "ComfyUI lists the sampled model as loaded"
    tiny_wan.decode(v, latent)
    # decoding released the diffusion model through ComfyUI's own free_memory: its ledger agrees
    assert not _dit_entries(comfy_env, m.model)
    assert _dit_entries(comfy_env, v.patcher.model)
    assert m.loaded_size() == 0
    tiny_wan.sample(m)
    assert not _dit_entries(comfy_env, v.patcher.model)
    kinds = [(r["component"], r["kind"]) for r in _group(m).records]
    assert ("vae", "exclusive") in kinds and ("diffusion_model", "exclusive") in kinds


def test_comfyui_unload_is_a_pointer_swap(comfy_env, tiny_wan):
    model, vae = tiny_wan.load_model(), tiny_wan.load_vae()
    ref = tiny_wan.sample(model)["samples"]
    ref_img = tiny_wan.decode(vae, {"samples": ref})
    comfy_env.mm.unload_all_models()      # else the plain run's load is reused and nothing moves
    m, _, v, _ = _run_node(comfy_env, _host_offload(model), None, vae)
    group = _group(m)
    comp = group.components["diffusion_model"]
    masters = {n: e.host.data_ptr() for n, e in comp.table.masters.items()}
    assert masters, "the node stages host masters at load time (zero copy)"
    for _ in range(2):
        latent = tiny_wan.sample(m)
        assert torch.equal(latent["samples"], ref)
        loaded = dict(m.model.named_parameters())
        assert any(loaded[n].data_ptr() != p for n, p in masters.items() if n in loaded), "weights were onloaded"
        assert torch.equal(tiny_wan.decode(v, latent), ref_img)   # releases the DiT through ComfyUI
        for n, p in m.model.named_parameters():
            assert p.data_ptr() == masters[n], f"{n} is not back on its master"
    led = group.ledger()
    unloads = [r for r in led["records"] if r["component"] == "diffusion_model" and r["kind"] == "unload"]
    assert unloads and all(r["d2h"] == 0 and r["swapped"] > 0 for r in unloads)
    assert led["totals"]["d2h_bytes"] == 0 and led["totals"]["h2d_bytes"] > 0


def test_partially_unload_keeps_comfyuis_accounting(comfy_env, tiny_wan):
    model = tiny_wan.load_model()
    ref = tiny_wan.sample(model)["samples"]
    comfy_env.mm.unload_all_models()
    m, _, _, _ = _run_node(comfy_env, _host_offload(model))
    tiny_wan.sample(m)
    loaded = m.loaded_size()
    assert loaded > 0
    freed = m.partially_unload(m.offload_device, loaded // 2)
    assert freed > 0 and m.loaded_size() == loaded - freed
    rec = [r for r in _group(m).records if r["kind"] == "partial_unload"][-1]
    assert rec["d2h"] == 0 and rec["swapped"] >= freed - 4096   # ComfyUI also counts non-weight buffers
    assert torch.equal(tiny_wan.sample(m)["samples"], ref)


def test_lora_patched_weights_stay_correct(comfy_env, tiny_wan):
    model = tiny_wan.load_model()
    plain = tiny_wan.sample(model)["samples"]
    sd = model.model.diffusion_model.state_dict()
    key = next(k for k in sd if k.startswith("blocks.1.") and k.endswith("weight") and sd[k].ndim == 2)
    delta = torch.randn(sd[key].shape, generator=torch.Generator().manual_seed(3)) * 0.05
    lora_plain = model.clone()
    lora_plain.add_patches({f"diffusion_model.{key}": (delta,)}, 1.0)
    want = tiny_wan.sample(lora_plain)["samples"]
    assert not torch.equal(want, plain), "the patch must change the output for this test to mean anything"
    comfy_env.mm.unload_all_models()
    m, _, _, _ = _run_node(comfy_env, _host_offload(model))
    lora = m.clone()                                    # a LoRA loader downstream of the node
    lora.add_patches({f"diffusion_model.{key}": (delta,)}, 1.0)
    assert type(lora) is type(m), "clones keep phase management"
    for _ in range(2):
        assert torch.equal(tiny_wan.sample(lora)["samples"], want)
        assert torch.equal(tiny_wan.sample(m)["samples"], plain)   # masters never took the patch
    assert _group(m).ledger()["totals"]["d2h_bytes"] == 0


def test_remove_restores_stock_behaviour(comfy_env, tiny_wan):
    from comfyui_levers.bridge.phase import remove_phase_offload

    model = tiny_wan.load_model()
    ref = tiny_wan.sample(model)["samples"]
    m, _, _, _ = _run_node(comfy_env, _host_offload(model))
    tiny_wan.sample(m)
    remove_phase_offload(m)
    assert type(m) is type(model) and "levers_phase" not in m.attachments
    assert torch.equal(tiny_wan.sample(m)["samples"], ref)


def _stand_in_clip(comfy_env, dtype=torch.float16):
    """A CLIP object around a tiny module (ComfyUI's CLIP plumbing without a tokenizer)."""
    import comfy.model_patcher
    import comfy.sd

    module = nn.Sequential(nn.Linear(8, 8)).to(dtype)
    clip = comfy.sd.CLIP(no_init=True)
    clip.cond_stage_model = module
    clip.patcher = comfy.model_patcher.ModelPatcher(module, load_device=torch.device("cpu"),
                                                    offload_device=torch.device("cpu"))
    clip.patcher.set_model_compute_dtype(torch.float32)
    clip.tokenizer, clip.layer_idx, clip.tokenizer_options = None, None, {}
    clip.use_clip_schedule, clip.apply_hooks_to_conds = False, None
    return clip


def test_text_encoder_on_cpu_gets_fp32_weights_without_touching_the_input(comfy_env, tiny_wan):
    clip = _stand_in_clip(comfy_env)
    m, c, _, report = _run_node(comfy_env, tiny_wan.load_model(), clip, None, text_encoder_device="cpu")
    assert c is not clip and c.patcher is not clip.patcher
    assert next(c.cond_stage_model.parameters()).dtype == torch.float32
    assert next(clip.cond_stage_model.parameters()).dtype == torch.float16
    w16 = clip.cond_stage_model[0].weight
    assert torch.equal(c.cond_stage_model[0].weight, w16.float())
    assert c.patcher.load_device == torch.device("cpu") and "fp32" in report
    # ComfyUI can load the private copy and its ledger knows its true size
    comfy_env.mm.load_models_gpu([c.patcher])
    assert c.patcher.model_size() == sum(p.nbytes for p in c.cond_stage_model.parameters())
    kept = _run_node(comfy_env, tiny_wan.load_model(), clip, None, text_encoder_precision="fp16")[1]
    assert kept.cond_stage_model is clip.cond_stage_model       # no copy when nothing changes


def test_invalid_settings_name_the_field(comfy_env, tiny_wan):
    from comfyui_levers.core.errors import ConfigError

    with pytest.raises(ConfigError, match="model_device"):
        _run_node(comfy_env, tiny_wan.load_model(), model_device="cuda:7")
    with pytest.raises(ConfigError, match="text_encoder_precision"):
        _run_node(comfy_env, tiny_wan.load_model(), text_encoder_precision="int3")
