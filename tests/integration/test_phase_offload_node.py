"""PhaseOffload in a real (headless, CPU) ComfyUI on a tiny random-weight Wan 2.1 DiT + VAE.

On a CPU-only ComfyUI the load and offload devices are both ``cpu``, so nothing would move. Some
tests give the patcher an offload device of ``cpu:0`` (a distinct torch device that is still host
memory): ComfyUI then really runs its load / unpatch / partially_unload paths with ``Module.to``
calls between two devices, and the pointer swap is exercised inside ComfyUI's own code.
"""
from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

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
    """MODEL, CLIP, VAE, report (MODEL_2, the fifth output, blocks its users without model_2)."""
    from comfy_execution.graph_utils import ExecutionBlocker

    out = _node(env).execute(model, clip, vae, **kw)
    args = out.args if hasattr(out, "args") else out.result
    assert len(args) == 5 and isinstance(args[4], ExecutionBlocker) and "model_2" in args[4].message
    return args[:4]


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


def test_fp8_weights_move_by_object_and_offload_is_a_swap(comfy_env, tiny_wan):
    """QuantizeDiT fp8 (ComfyUI's QuantizedTensor, whose device is fixed when it is built): the load copies the
    fp8 codes and scales into a device wrapper that takes the weight's slot; the unload puts the module's own
    wrapper back. Before, these weights were left to ComfyUI's own copy (device->host on every unload). A ComfyUI
    without QuantizedTensor (0.3.64) holds plain fp8 parameters and scales: they move like any other weight."""
    from comfyui_levers.bridge.quant import native_fp8_available
    from comfyui_levers.core.residency.blocks import module_bytes

    quant = next(c for c in comfy_env.levers_nodes.NODE_CLASSES if c.__name__ == "LeversQuantizeDiT")
    model = quant.execute(tiny_wan.load_model(), format="fp8_e4m3fn", quality_check=False).args[0]
    vae = tiny_wan.load_vae()
    ref = tiny_wan.sample(model)["samples"]
    comfy_env.mm.unload_all_models()
    m, _, v, _ = _run_node(comfy_env, _host_offload(model), None, vae)
    group = _group(m)
    own = {n: p for n, p in m.model.diffusion_model.named_parameters()}
    wrapped = {n for n, p in own.items() if type(p) is not torch.nn.Parameter}
    native = native_fp8_available()[0]
    assert bool(wrapped) == native, "QuantizeDiT's fp8 layers hold QuantizedTensor weights where ComfyUI has them"
    assert any(p.dtype == torch.float8_e4m3fn for p in own.values()) or native
    for _ in range(2):
        latent = tiny_wan.sample(m)
        assert torch.equal(latent["samples"], ref)
        tiny_wan.decode(v, latent)                      # releases the DiT through ComfyUI
        now = dict(m.model.diffusion_model.named_parameters())
        assert all(now[n] is own[n] for n in wrapped), "the module's own fp8 wrappers are back"
    assert len(group.components["diffusion_model"].table.wrapped) >= len(wrapped)
    unloads = [r for r in group.ledger()["records"] if r["component"] == "diffusion_model" and r["kind"] == "unload"]
    assert unloads and all(r["d2h"] == 0 for r in unloads)
    # everything the DiT holds, the fp8 codes included, is copied in on load and swapped back on unload
    loads = [r for r in group.ledger()["records"] if r["component"] == "diffusion_model" and r["kind"] == "load"]
    assert [r["h2d"] for r in loads] == [r["swapped"] for r in unloads]
    assert all(r["swapped"] >= module_bytes(m.model.diffusion_model) for r in unloads), unloads


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


def _lora_case(tiny_wan, model):
    """(key, delta, plain output, output with the delta on key) for a LoRA-style patch on one block weight."""
    plain = tiny_wan.sample(model)["samples"]
    sd = model.model.diffusion_model.state_dict()
    key = next(k for k in sd if k.startswith("blocks.1.") and k.endswith("weight") and sd[k].ndim == 2)
    delta = torch.randn(sd[key].shape, generator=torch.Generator().manual_seed(3)) * 0.05
    lora_plain = model.clone()
    lora_plain.add_patches({f"diffusion_model.{key}": (delta,)}, 1.0)
    want = tiny_wan.sample(lora_plain)["samples"]
    assert not torch.equal(want, plain), "the patch must change the output for this test to mean anything"
    return key, delta, plain, want


def test_lora_patched_weights_stay_correct(comfy_env, tiny_wan):
    model = tiny_wan.load_model()
    key, delta, plain, want = _lora_case(tiny_wan, model)
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
    module.manual_cast_dtype = None    # ComfyUI 0.3.64 sets the compute dtype as an object patch of an attribute
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


def test_a_loaded_lora_clip_is_copied_unpatched_so_its_lora_applies_once(comfy_env, tiny_wan):
    """The fp32 private copy was deep-copied from the module as ComfyUI held it: with a LoRA CLIP loaded (an
    earlier CLIPTextEncode), the LoRA was baked into the copy and applied again by its patches after the next
    unload. Now ComfyUI unloads that CLIP first and the copy is of the unpatched weights."""
    comfy_env.mm.unload_all_models()
    base = _stand_in_clip(comfy_env)
    w0 = base.cond_stage_model[0].weight.detach().float().clone()
    delta = torch.full((8, 8), 0.25, dtype=torch.float16)
    lora = base.clone()                                  # LoraLoader on the CLIP
    lora.add_patches({"0.weight": (delta,)}, 1.0)
    lora.load_model()                                    # an earlier encode with it: patched in the module
    assert not torch.equal(base.cond_stage_model[0].weight.float(), w0)
    want = w0 + delta.float()
    # fp32 asked for: a CLIP carrying patches is copied only then (on auto it keeps its precision)
    _, c, _, _ = _run_node(comfy_env, tiny_wan.load_model(), lora, None, text_encoder_device="cpu",
                           text_encoder_precision="fp32")
    assert torch.equal(base.cond_stage_model[0].weight.float(), w0)        # ComfyUI unpatched it first
    for _ in range(2):                                   # each encode, with an unload in between
        c.load_model()
        assert torch.allclose(c.cond_stage_model[0].weight.float(), want, atol=1e-2)
        comfy_env.mm.unload_all_models()
    assert torch.equal(c.cond_stage_model[0].weight.float(), w0)


def test_placing_a_dynamic_vram_component_registers_its_device(comfy_env, tiny_wan, monkeypatch):
    """ComfyUI 0.33's DynamicVRAM patcher keeps pin state per load device (``register_load_device``, which its own
    device selectors call after retargeting). Placing a component elsewhere must register the device, or ComfyUI's
    next use of the patcher raises KeyError. No GPU here: aimdo's host buffer is a stand-in."""
    import comfy.model_patcher as mp
    import comfy.sd
    if not hasattr(mp.ModelPatcher, "register_load_device") and not hasattr(mp, "ModelPatcherDynamic"):
        pytest.skip("this ComfyUI has no DynamicVRAM patcher (0.15+)")
    import comfy_aimdo.host_buffer
    monkeypatch.setattr(comfy_aimdo.host_buffer, "HostBuffer", lambda *a, **k: object())
    module = nn.Sequential(nn.Linear(8, 8))
    dyn = mp.ModelPatcherDynamic(module, load_device=torch.device("cuda", 0), offload_device=torch.device("cpu"))
    assert dyn.is_dynamic()
    clip = comfy.sd.CLIP(no_init=True)
    clip.cond_stage_model, clip.patcher = module, dyn
    clip.tokenizer, clip.layer_idx, clip.tokenizer_options = None, None, {}
    clip.use_clip_schedule, clip.apply_hooks_to_conds = False, None
    _, c, _, _ = _run_node(comfy_env, tiny_wan.load_model(), clip, None, text_encoder_device="cpu")
    assert c.patcher.is_dynamic() and c.patcher.load_device == torch.device("cpu")
    assert torch.device("cpu") in c.patcher.model.dynamic_pins
    c.patcher.set_in_use_by_current_prompt(True)         # what ComfyUI does for every model of a prompt
    c.patcher.set_in_use_by_current_prompt(False)


def _cpu_clip(module):
    """A CLIP around ``module`` as ComfyUI's loaders make one, on the CPU."""
    import comfy.model_patcher
    import comfy.sd

    clip = comfy.sd.CLIP(no_init=True)
    clip.cond_stage_model = module
    clip.patcher = comfy.model_patcher.ModelPatcher(module, load_device=torch.device("cpu"),
                                                    offload_device=torch.device("cpu"))
    clip.tokenizer, clip.layer_idx, clip.tokenizer_options = None, None, {}
    clip.use_clip_schedule, clip.apply_hooks_to_conds = False, None
    return clip


def test_a_dynamic_vram_text_encoder_copy_owns_none_of_the_originals_native_buffers(comfy_env, tiny_wan,
                                                                                     monkeypatch):
    """Found in review: the fp32 copy of a 16-bit text encoder placed on the CPU was a deep copy that duplicated
    DynamicVRAM's native host buffers (comfy-aimdo frees each when its Python object goes): every pointer would be
    freed twice once the old copy was dropped. The copy now carries none of that state; its patcher makes its own.
    Found in a later review: the per-layer state DynamicVRAM's load leaves (``_pin_state``, ``_pins``, and
    ``_v_signature = None``) was copied too, and dropping ``None`` by identity turned every ``None`` in the copy,
    a Linear's missing bias included, into a placeholder the dtype conversion then crashed on."""
    import gc
    from collections import Counter

    import comfy.model_patcher as mp
    import comfy.sd
    if not hasattr(mp, "ModelPatcherDynamic"):
        pytest.skip("this ComfyUI has no DynamicVRAM patcher (0.15+)")
    import comfy_aimdo.host_buffer

    freed, count = [], [100]

    class HostBuffer:          # comfy_aimdo's: a native pointer in _ptr, freed in __del__
        def __init__(self, *a, **k):
            count[0] += 1
            self._ptr = count[0]

        def __del__(self):
            freed.append(self._ptr)
    monkeypatch.setattr(comfy_aimdo.host_buffer, "HostBuffer", HostBuffer)
    module = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8, bias=False)).half()
    dyn = mp.ModelPatcherDynamic(module, load_device=torch.device("cuda", 0), offload_device=torch.device("cpu"))
    for layer in module:        # what ModelPatcherDynamic.load leaves on each cast layer (set_dirty, pin_memory)
        layer._v_signature = None
        layer._pin_state = module.dynamic_pins[torch.device("cuda", 0)]
        layer._pins = {"weights": {"pin": None, "hostbuf": HostBuffer()}}
    clip = comfy.sd.CLIP(no_init=True)
    clip.cond_stage_model, clip.patcher = module, dyn
    clip.tokenizer, clip.layer_idx, clip.tokenizer_options = None, None, {}
    clip.use_clip_schedule, clip.apply_hooks_to_conds = False, None
    _, c, _, report = _run_node(comfy_env, tiny_wan.load_model(), clip, None, text_encoder_device="cpu")
    copied = c.cond_stage_model
    assert copied is not module and copied[0].weight.dtype == torch.float32, report
    assert copied[1].bias is None and torch.equal(copied[0].bias, module[0].bias.float())

    def pointers(m):
        found, seen, todo = set(), set(), [v for sub in m.modules() for v in sub.__dict__.values()]
        while todo:
            v = todo.pop()
            if id(v) in seen:
                continue
            seen.add(id(v))
            if isinstance(v, HostBuffer):
                found.add(v._ptr)
            elif isinstance(v, dict):
                todo.extend(v.values())
            elif isinstance(v, (list, tuple, set)):
                todo.extend(v)
        return found
    assert len(pointers(module)) >= 3 and not pointers(module) & pointers(copied)
    assert not any(hasattr(layer, a) for layer in copied for a in ("_pin_state", "_pins", "_v_signature"))
    del c, copied, clip, dyn, module
    gc.collect()
    assert not [p for p, n in Counter(freed).items() if n > 1]


def test_the_node_run_again_shares_its_text_encoder_copy(comfy_env, tiny_wan):
    """Found in review: each run of the node (a widget changed) made a new fp32 copy of the text encoder while
    ComfyUI still cached the last output and its copy: two copies in host RAM (an fp32 T5-XXL is 19 GB). A copy of
    the same module at the same precision is shared while it is alive; it goes with the outputs that hold it."""
    import gc
    import weakref

    module = nn.Sequential(nn.Linear(8, 8)).half()
    clip = _cpu_clip(module)
    _, first, _, _ = _run_node(comfy_env, tiny_wan.load_model(), clip, None, text_encoder_device="cpu")
    _, again, _, report = _run_node(comfy_env, tiny_wan.load_model(), clip, None, text_encoder_device="cpu",
                                    pin="off")
    copy_ = first.cond_stage_model
    assert copy_ is not module and again.cond_stage_model is copy_ and copy_[0].weight.dtype == torch.float32
    assert again.patcher is not first.patcher
    x = torch.randn(2, 8)
    with torch.no_grad():
        assert torch.equal(again.cond_stage_model(x), module.float()(x))
    module.half()
    gone = weakref.ref(copy_)
    del first, again, copy_
    gc.collect()
    assert gone() is None
    _, third, _, _ = _run_node(comfy_env, tiny_wan.load_model(), clip, None, text_encoder_device="cpu",
                               text_encoder_precision="bf16")
    assert third.cond_stage_model[0].weight.dtype == torch.bfloat16


def test_outputs_sharing_the_text_encoder_copy_do_not_leak_a_lora_into_each_other(comfy_env, tiny_wan):
    """Found in review: two outputs alive at once that share the fp32 copy (two PhaseOffload nodes on one CLIP, one
    behind a LoRA; or ComfyUI's cache keeping the older output) each had a patcher with its own backup. When one
    loaded after the other, ComfyUI handed the module over as between clones, leaving the LoRA in the weights, and
    the other's unpatch had nothing to restore: the plain output encoded with the LoRA, even after unloading. The
    patchers of one copy now share their backups, as clones do."""
    import comfy.ops

    mm = comfy_env.mm
    torch.manual_seed(0)
    module = nn.Sequential(comfy.ops.manual_cast.Linear(64, 64, dtype=torch.float16))
    with torch.no_grad():
        module[0].weight.copy_(torch.randn(64, 64) * 0.1)
        module[0].bias.copy_(torch.randn(64) * 0.1)
    module.manual_cast_dtype = None
    clip = _cpu_clip(module)
    clip.patcher.set_model_compute_dtype(torch.float32)
    lora = clip.clone()
    lora.add_patches({"0.weight": (torch.ones(64, 64),)}, 1.0)
    x = torch.randn(2, 64)
    _, plain, _, _ = _run_node(comfy_env, tiny_wan.load_model(), clip, text_encoder_device="cpu",
                               text_encoder_precision="fp32")
    plain.load_model()
    with torch.no_grad():
        ref = plain.cond_stage_model(x).clone()
    mm.unload_all_models()
    _, patched, _, _ = _run_node(comfy_env, tiny_wan.load_model(), lora, text_encoder_device="cpu",
                                 text_encoder_precision="fp32")
    assert patched.cond_stage_model is plain.cond_stage_model         # shared, not a second copy
    patched.load_model()
    with torch.no_grad():
        with_lora = patched.cond_stage_model(x).clone()
    assert (with_lora - ref).abs().max() > 0.1                          # the LoRA applied
    plain.load_model()
    with torch.no_grad():
        assert torch.equal(plain.cond_stage_model(x), ref)
    patched.load_model()
    with torch.no_grad():
        assert torch.equal(patched.cond_stage_model(x), with_lora)
    mm.unload_all_models()
    with torch.no_grad():
        assert torch.equal(plain.cond_stage_model(x), ref)


def test_a_text_encoder_with_quantized_weights_is_kept_as_stored(comfy_env, tiny_wan):
    """Found in review: a text encoder holding fp8 QuantizedTensor weights (ComfyUI 0.33 loads every
    *_fp8_e4m3fn_scaled T5 and UMT5 so) placed on the CPU crashed the node in the fp32 copy's deep copy ("invalid
    python storage"), and converting them would have dequantized the encoder. It keeps its weights, with a note."""
    quant = next(c for c in comfy_env.levers_nodes.NODE_CLASSES if c.__name__ == "LeversQuantizeDiT")
    dm = quant.execute(tiny_wan.load_model(), format="fp8_e4m3fn", quality_check=False).args[0].model.diffusion_model
    lin = next((m for m in dm.modules() if isinstance(getattr(m, "weight", None), torch.Tensor)
                and type(m.weight) is not nn.Parameter), None)
    if lin is None:
        pytest.skip("this ComfyUI stores fp8 as plain tensors (no QuantizedTensor layer)")

    class TE(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, lin.weight.shape[1]).half()
            self.lin = lin

        def forward(self, ids):
            return self.lin(self.emb(ids).float())
    module = TE()
    ids = torch.arange(6).unsqueeze(0)
    with torch.no_grad():
        ref = module(ids)
    for kw in ({}, {"text_encoder_precision": "fp32"}):
        _, c, _, report = _run_node(comfy_env, tiny_wan.load_model(), _cpu_clip(module), None,
                                    text_encoder_device="cpu", **kw)
        assert c.cond_stage_model is module and "weights kept as stored" in report and "quantized" in report, report
        with torch.no_grad():
            assert torch.equal(c.cond_stage_model(ids), ref)


def _fp16_clip_and_lora(comfy_env):
    """A 16-bit CPU CLIP as ComfyUI's loaders make one, a LoRA patch for it, and an input."""
    import comfy.ops

    torch.manual_seed(0)
    module = nn.Sequential(comfy.ops.manual_cast.Linear(64, 64, dtype=torch.float16))
    with torch.no_grad():
        module[0].weight.copy_(torch.randn(64, 64) * 0.1)
        module[0].bias.copy_(torch.randn(64) * 0.1)        # comfy's ops leave parameters uninitialised
    module.manual_cast_dtype = None                          # what ComfyUI's text encoders carry (0.3.64 reads it)
    clip = _cpu_clip(module)
    clip.patcher.set_model_compute_dtype(torch.float32)
    patch = {"0.weight": (torch.randn(64, 64, generator=torch.Generator().manual_seed(1)) * 0.01,)}
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(2))
    return module, clip, patch, x


def _encode(comfy_env, clip, x):
    clip.load_model()
    with torch.no_grad():
        out = clip.cond_stage_model(x).clone()
    comfy_env.mm.unload_all_models()
    return out


def test_a_text_encoder_with_lora_patches_on_the_cpu_stays_bit_identical(comfy_env, tiny_wan):
    """Found in review: with a CLIP LoRA, the automatic fp32 copy of a 16-bit text encoder on the CPU kept the
    patched weights unrounded where ComfyUI rounds them to the stored fp16 (max difference 4.6e-4). The copy now
    rounds a patched weight to its stored dtype and back, as ComfyUI does without it: bit-identical, on auto, on an
    explicit fp32 and on a plan's precision alike (before that fix the LoRA'd CLIP kept its 16-bit weights)."""
    from comfyui_levers.bridge.phase import apply
    from comfyui_levers.nodes.phase_offload import settings_from

    module, clip, patch, x = _fp16_clip_and_lora(comfy_env)
    lora = clip.clone()
    lora.add_patches(patch, 0.7)
    ref = _encode(comfy_env, lora, x)
    unrounded = None
    for precision in ("auto", "fp32"):
        _, c, _, report = _run_node(comfy_env, tiny_wan.load_model(), lora, None, text_encoder_device="cpu",
                                    text_encoder_precision=precision)
        assert c.cond_stage_model[0].weight.dtype == torch.float32 and "weights stored as fp32" in report, report
        assert torch.equal(_encode(comfy_env, c, x), ref), precision
        if unrounded is None:     # the same copy without the rounding differs: the test can see it
            c.patcher.attachments["levers_phase"].stored_dtypes = None
            unrounded = _encode(comfy_env, c, x)
            assert not torch.equal(unrounded, ref)

    class Plan:
        experts = 1

        @staticmethod
        def component(name):
            if name != "text_encoder":
                raise KeyError(name)
            return SimpleNamespace(device="cpu", residency=None, pin=False, precision="fp32", name=name)
    settings = settings_from(Plan(), "auto", "auto", "auto", "off", "auto")
    assert settings.text_encoder_precision == "fp32"
    out = apply(tiny_wan.load_model(), lora, None, settings)
    assert out.clip.cond_stage_model is not module and torch.equal(_encode(comfy_env, out.clip, x), ref)


def test_a_clip_lora_after_the_node_is_bit_identical(comfy_env, tiny_wan):
    """Found in review: a LoRA loader placed after the node patched the fp32 copy without the rounding to fp16
    ComfyUI applies to the stored weights (the README says LoRA loaders go before or after the node). Clones made
    downstream keep the copy's rounding."""
    _, clip, patch, x = _fp16_clip_and_lora(comfy_env)
    plain = clip.clone()
    plain.add_patches(patch, 0.7)
    ref = _encode(comfy_env, plain, x)
    _, c, _, report = _run_node(comfy_env, tiny_wan.load_model(), clip, None, text_encoder_device="cpu")
    assert c.cond_stage_model[0].weight.dtype == torch.float32, report
    after = c.clone()
    after.add_patches(patch, 0.7)
    assert torch.equal(_encode(comfy_env, after, x), ref)
    assert torch.equal(_encode(comfy_env, c, x), _encode(comfy_env, clip, x))     # the node's own output unpatched


@pytest.mark.parametrize("mode", ["MaxSpeed", "MinVram"])
def test_clip_weight_hooks_on_the_fp32_copy_are_rounded_as_comfyui_rounds_them(comfy_env, tiny_wan, mode, caplog):
    """Found in review: a weight hook on the CLIP (a hook LoRA, CreateHookModelAsLora, scheduled CLIP hooks) patched
    the fp32 copy unrounded where ComfyUI rounds the hooked weight to the stored fp16. Bit-identical now, also when
    ComfyUI reapplies its cached hooked weights (MaxSpeed) and after the hooks come off."""
    import comfy.hooks

    _, clip, patch, x = _fp16_clip_and_lora(comfy_env)
    target = {"0.weight": clip.cond_stage_model[0].weight.float() + patch["0.weight"][0]}

    def hooked(c):
        hooks = comfy.hooks.create_hook_model_as_lora(None, target, 1.0, 0.7)
        c = c.clone()
        c.patcher.hook_mode = getattr(comfy.hooks.EnumHookMode, mode)
        c.patcher.forced_hooks = hooks.clone()
        c.patcher.register_all_hook_patches(hooks, comfy.hooks.create_target_dict(comfy.hooks.EnumWeightTarget.Clip))
        return c, hooks

    def encode(c, hooks):
        c.load_model()
        outs = []
        with torch.no_grad():
            for h in (hooks, None, hooks):      # the second time from ComfyUI's cache of hooked weights (MaxSpeed)
                c.patcher.patch_hooks(h)
                outs.append(c.cond_stage_model(x).clone())
        c.patcher.patch_hooks(None)
        comfy_env.mm.unload_all_models()
        return outs

    ref = encode(*hooked(clip))
    assert not torch.equal(ref[0], ref[1]) and torch.equal(ref[0], ref[2])        # the hook applies and comes off
    _, c, _, report = _run_node(comfy_env, tiny_wan.load_model(), clip, None, text_encoder_device="cpu")
    assert c.cond_stage_model[0].weight.dtype == torch.float32, report
    got = encode(*hooked(c))
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    # the rounding seeds through comfy.utils where it lives (0.33's comfy.model_patcher shim warns per call)
    assert not any("string_to_seed has moved" in r.getMessage() for r in caplog.records)


def test_a_release_comfyui_copies_itself_is_counted_in_the_ledger(comfy_env, tiny_wan):
    """Found in review: when the same model is also sampled by a branch without the node, ComfyUI tracks it under
    that branch's patcher, and the release at the next phase is ComfyUI's own copy back to the host; the ledger said
    0 bytes device->host. The copy is now counted, with a note saying why."""
    mm = comfy_env.mm
    model = _host_offload(tiny_wan.load_model())
    vae = tiny_wan.load_vae()
    mm.unload_all_models()
    m, _, v, _ = _run_node(comfy_env, model, None, _host_offload_vae(vae))
    latent = tiny_wan.sample(m)                  # through PhaseOffload
    tiny_wan.sample(model)                       # the plain branch, same model
    tiny_wan.decode(v, latent)                   # the decode phase releases the DiT: ComfyUI's own unload
    led = _group(m).ledger()
    decode = [p for p in led["run"]["phases"] if p["phase"] == "decode"][-1]
    dit = sum(t.numel() * t.element_size() for t in m.model.diffusion_model.parameters())
    assert decode["released"] == ["diffusion_model"] and decode["d2h_bytes"] >= dit * 0.9, decode
    assert any("a patcher this node does not manage" in n for n in led["notes"]), led["notes"]
    mm.unload_all_models()


def test_invalid_settings_name_the_field(comfy_env, tiny_wan):
    from comfyui_levers.core.errors import ConfigError

    with pytest.raises(ConfigError, match="model_device"):
        _run_node(comfy_env, tiny_wan.load_model(), model_device="cuda:7")
    with pytest.raises(ConfigError, match="text_encoder_precision"):
        _run_node(comfy_env, tiny_wan.load_model(), text_encoder_precision="int3")


# --- the per-phase ledger: on the node, as JSON, from Python ----------------------------------------

class _ProgressText:
    """Stands in for ComfyUI's running PromptServer: records send_progress_text(text, node_id)."""

    def __init__(self):
        self.calls: list[tuple[str, str]] = []

    def send_progress_text(self, text, node_id, sid=None):
        self.calls.append((text, node_id))


@pytest.fixture
def ledger_out(comfy_env, tmp_path, monkeypatch):
    """ComfyUI's output folder in tmp_path and a capturing server; yields (levers folder, captured calls).

    The server is a stand-in module: ComfyUI's real ``server`` is only importable from its own
    main.py (it needs ComfyUI's ``utils`` package first on sys.path), and a running PromptServer
    needs an event loop. The bridge looks it up the way custom nodes do: ``server.PromptServer.instance``.
    """
    fake = _ProgressText()
    monkeypatch.setitem(sys.modules, "server", SimpleNamespace(PromptServer=SimpleNamespace(instance=fake)))
    monkeypatch.setattr(comfy_env.folder_paths, "output_directory", str(tmp_path))
    return tmp_path / "levers", fake.calls


def _clone_with_unique_id(comfy_env, node_id: str):
    """The node class as ComfyUI's executor hands it its hidden unique_id (0.8 on: {"hidden_inputs": ...};
    0.3.64: keyed by ``io.Hidden``)."""
    from comfy_api.latest import io

    node = _node(comfy_env).PREPARE_CLASS_CLONE({"hidden_inputs": {"UNIQUE_ID": node_id}})
    if node.hidden.unique_id is None:
        node = _node(comfy_env).PREPARE_CLASS_CLONE({io.Hidden.unique_id: node_id})
    assert node.hidden.unique_id == node_id
    return node


def _weight_bytes(module) -> int:
    """Bytes of every parameter and buffer of ``module``, tied tensors once."""
    seen = {(t.data_ptr(), t.nbytes) for t in [*module.parameters(), *module.buffers()]}
    return sum(n for _, n in seen)


def _host_offload_vae(vae):
    import copy

    v = copy.copy(vae)
    v.patcher = vae.patcher.clone()
    v.patcher.offload_device = HOST
    return v


def _in_prompt(prompt_id):
    """Run callables the way ComfyUI's executor runs nodes: a progress registry per prompt, the
    executing-node context while a node runs, finish_progress when it is done."""
    from comfy_execution.graph import DynamicPrompt
    from comfy_execution.progress import get_progress_state, reset_progress_state
    from comfy_execution.utils import CurrentNodeContext

    reset_progress_state(prompt_id, DynamicPrompt({}))

    def run_node(node_id, fn):
        get_progress_state().start_progress(node_id)
        with CurrentNodeContext(prompt_id, node_id):
            out = fn()
        get_progress_state().finish_progress(node_id)
        return out

    return run_node


def test_ledger_per_phase_reaches_the_node_json_and_python(comfy_env, tiny_wan, ledger_out):
    from comfyui_levers.bridge.phase import format_ledger, latest_ledger

    folder, sent = ledger_out
    model, vae = _host_offload(tiny_wan.load_model()), _host_offload_vae(tiny_wan.load_vae())
    comfy_env.mm.unload_all_models()
    dit_bytes, vae_bytes = _weight_bytes(model.model), _weight_bytes(vae.patcher.model)
    node = _clone_with_unique_id(comfy_env, "7")
    m, _, v, report, _ = node.execute(model, None, vae).args
    assert "on this node" in report and str(folder / "phase_ledger-<prompt id>-node7.json") in report
    assert sent == [], "nothing ran yet"

    for prompt in ("prompt-a", "prompt-b"):
        run_node = _in_prompt(prompt)
        latent = run_node("13", lambda: tiny_wan.sample(m))
        # KSampler (node 13) finished: its phase closed and the ledger reached node 7 at once
        assert sent[-1][1] == "7" and "1. sample: diffusion_model" in sent[-1][0]
        run_node("16", lambda: tiny_wan.decode(v, latent))
        path = folder / f"phase_ledger-{prompt}-node7.json"
        led = json.loads(path.read_text())
        assert led["prompt_id"] == prompt and led["node_id"] == "7"
        assert [(p["phase"], p["component"], p["nodes"]) for p in led["phases"]] == [
            ("sample", "diffusion_model", ["13"]), ("decode", "vae", ["16"])]
        sample, decode = led["phases"]
        # every weight is copied in once per phase (CpuTransport: pageable), nothing is copied out
        assert sample["h2d_bytes"] == dit_bytes and decode["h2d_bytes"] == vae_bytes
        assert sample["d2h_bytes"] == decode["d2h_bytes"] == 0
        assert sample["source"] == decode["source"] == "pageable"
        # decode began by releasing the DiT through ComfyUI: a pointer swap of all its weights
        assert decode["released"] == ["diffusion_model"] and decode["swapped_bytes"] == dit_bytes
        assert sample["released"] == ([] if prompt == "prompt-a" else ["vae"])
        assert sample["swapped_bytes"] == (0 if prompt == "prompt-a" else vae_bytes)
        assert all(p["peak_bytes"] is None and p["peak_note"].startswith("n/a on CPU") for p in led["phases"])
        assert all(not p["open"] and p["gbps"] > 0 for p in led["phases"])
        assert led["totals"]["h2d_bytes"] == dit_bytes + vae_bytes and led["totals"]["d2h_bytes"] == 0
        assert sent[-1] == (format_ledger(led), "7"), "the node shows the same ledger as the JSON"
        latest = latest_ledger()
        assert {k: v for k, v in latest.items() if k != "updated_at"} == \
            {k: v for k, v in led.items() if k != "updated_at"}
    assert all(node_id == "7" for _, node_id in sent)


def test_ledger_on_a_cpu_only_comfyui_says_nothing_moved(comfy_env, tiny_wan, ledger_out):
    """Load and offload device both ``cpu``: ComfyUI copies nothing, Levers copies nothing."""
    from comfyui_levers.bridge.phase import latest_ledger

    folder, sent = ledger_out
    m, _, v, report = _run_node(comfy_env, tiny_wan.load_model(), None, tiny_wan.load_vae())
    assert "not on the node: no node id" in report      # called outside ComfyUI's executor
    latent = tiny_wan.sample(m)
    tiny_wan.decode(v, latent)
    led = latest_ledger()                               # headless: closes the open decode phase
    assert [(p["phase"], p["component"]) for p in led["phases"]] == [("sample", "diffusion_model"),
                                                                      ("decode", "vae")]
    for p in led["phases"]:
        assert p["h2d_bytes"] == p["d2h_bytes"] == p["swapped_bytes"] == 0 and p["gbps"] is None
        assert p["moved_by"].startswith("nothing: loads on cpu") and p["source"] == "n/a"
        assert p["comfyui_moved_bytes"] == 0 and p["peak_bytes"] is None
    assert led["prompt_id"] is None and json.loads(open(led["file"]).read())["phases"] == led["phases"]
    assert os.path.dirname(led["file"]) == str(folder) and sent == []


def test_ledger_file_failure_is_a_warning(comfy_env, tiny_wan, ledger_out, caplog):
    from comfyui_levers.bridge.phase import latest_ledger

    folder, _ = ledger_out
    folder.parent.mkdir(parents=True, exist_ok=True)
    folder.write_text("a file where the levers folder should be")
    m, _, _, _ = _run_node(comfy_env, tiny_wan.load_model())
    with caplog.at_level("WARNING", logger="levers"):
        tiny_wan.sample(m)
        led = latest_ledger()
    assert led["file"] is None and [p["phase"] for p in led["phases"]] == ["sample"]
    assert any("could not write the phase ledger" in r.getMessage() for r in caplog.records)


def test_ledger_has_encode_sample_decode_in_order(comfy_env, tiny_wan, ledger_out):
    """With a text encoder: ComfyUI's own CLIP.load_model() (the first step of every text encode;
    the stand-in CLIP has no tokenizer, so the encode itself is not run) opens the encode phase."""
    folder, sent = ledger_out
    clip = _stand_in_clip(comfy_env, dtype=torch.float32)   # fp32: no private retyped copy
    clip.patcher.offload_device = HOST
    model, vae = _host_offload(tiny_wan.load_model()), _host_offload_vae(tiny_wan.load_vae())
    comfy_env.mm.unload_all_models()
    node = _clone_with_unique_id(comfy_env, "4")
    m, c, v, _, _ = node.execute(model, clip, vae).args
    sizes = {"text_encoder": _weight_bytes(c.cond_stage_model), "diffusion_model": _weight_bytes(m.model),
             "vae": _weight_bytes(v.patcher.model)}
    run_node = _in_prompt("prompt-te")
    run_node("6", c.load_model)
    latent = run_node("13", lambda: tiny_wan.sample(m))
    run_node("16", lambda: tiny_wan.decode(v, latent))
    led = json.loads((folder / "phase_ledger-prompt-te-node4.json").read_text())
    assert [(p["phase"], p["component"]) for p in led["phases"]] == [
        ("encode", "text_encoder"), ("sample", "diffusion_model"), ("decode", "vae")]
    assert [p["h2d_bytes"] for p in led["phases"]] == [sizes[p["component"]] for p in led["phases"]]
    assert all(p["d2h_bytes"] == 0 for p in led["phases"])
    assert [p["released"] for p in led["phases"]] == [[], ["text_encoder"], ["diffusion_model"]]
    assert [p["swapped_bytes"] for p in led["phases"]] == [0, sizes["text_encoder"], sizes["diffusion_model"]]
    assert {node for _, node in sent} == {"4"} and "3. decode: vae" in sent[-1][0]


def test_ledger_in_a_real_comfyui_server_reaches_the_node_and_the_output_folder(comfy_env, tmp_path):
    """A headless ComfyUI subprocess runs UNETLoader -> PhaseOffload -> KSampler -> VAEDecode: the
    executor's own hidden unique_id, execution context and progress registry drive the ledger; the
    text reaches the websocket as ComfyUI's binary TEXT event for the PhaseOffload node."""
    import struct
    import uuid

    from comfy_server import ComfyServer
    from tiny_models import save, tiny_wan_dit_state_dict, tiny_wan_vae_state_dict

    from comfyui_levers.core import client as C

    srv = ComfyServer(comfy_env.path, base_dir=str(tmp_path / "base"))
    save(tiny_wan_dit_state_dict(), str(srv.models_dir / "diffusion_models" / "ledger_dit.safetensors"))
    save(tiny_wan_vae_state_dict(), str(srv.models_dir / "vae" / "ledger_vae.safetensors"))
    srv.start()
    try:
        api = {
            "1": {"class_type": "UNETLoader", "inputs": {"unet_name": "ledger_dit.safetensors",
                                                         "weight_dtype": "default"}},
            "2": {"class_type": "VAELoader", "inputs": {"vae_name": "ledger_vae.safetensors"}},
            "4": {"class_type": "LeversPhaseOffload", "inputs": {
                "model": ["1", 0], "vae": ["2", 0], "model_device": "auto", "text_encoder_device": "auto",
                "vae_device": "auto", "pin": "auto", "text_encoder_precision": "auto"}},
            "10": {"class_type": "LeversTestConditioning", "inputs": {"seed": 1, "tokens": 8, "dim": 4096,
                                                                      "scale": 1.0}},
            "11": {"class_type": "LeversTestConditioning", "inputs": {"seed": 2, "tokens": 8, "dim": 4096,
                                                                      "scale": 0.1}},
            "12": {"class_type": "EmptyHunyuanLatentVideo", "inputs": {"width": 64, "height": 64, "length": 5,
                                                                       "batch_size": 1}},
            "13": {"class_type": "KSampler", "inputs": {
                "model": ["4", 0], "seed": 0, "steps": 2, "cfg": 2.0, "sampler_name": "euler",
                "scheduler": "simple", "positive": ["10", 0], "negative": ["11", 0], "latent_image": ["12", 0],
                "denoise": 1.0}},
            "16": {"class_type": "VAEDecode", "inputs": {"samples": ["13", 0], "vae": ["4", 2]}},
            "17": {"class_type": "SaveImage", "inputs": {"images": ["16", 0], "filename_prefix": "ledger"}},
        }
        client = C.ComfyClient(srv.url, timeout=120)
        listener = C.WebSocket.connect(client.ws_url(uuid.uuid4().hex))   # progress text is broadcast
        try:
            result = C.run_prompt(client, api, out_dir=None, timeout=600)
            assert result.status == "success", srv.log_tail()
            texts, quiet = [], 0
            while quiet < 4:
                msg = listener.recv(timeout=0.5)
                quiet = quiet + 1 if msg is None else 0
                if msg is not None and msg[0] == 0x2 and struct.unpack(">I", msg[1][:4])[0] == 3:  # TEXT
                    n = struct.unpack(">I", msg[1][4:8])[0]
                    texts.append((msg[1][8:8 + n].decode(), msg[1][8 + n:].decode()))
        finally:
            listener.close()
        path = srv.output_dir / "levers" / f"phase_ledger-{result.prompt_id}-node4.json"
        assert path.is_file(), srv.log_tail()
        led = json.loads(path.read_text())
        assert [(p["phase"], p["nodes"], p["open"]) for p in led["phases"]] == [
            ("sample", ["13"], False), ("decode", ["16"], False)]
        ours = [text for node, text in texts if node == "4"]
        assert ours and ours[-1].startswith(f"Levers PhaseOffload ledger, prompt {result.prompt_id}: 2 phase(s)")
        assert f"phase_ledger-{result.prompt_id}-node4.json" in ours[-1]
    finally:
        srv.stop()


def test_a_component_bigger_than_the_card_is_partially_loaded_by_comfyui(comfy_env, tiny_wan, monkeypatch):
    """Recommend plans a text encoder bigger than the card (FLUX.2's 24 B Mistral on 8-16 GiB) as a phase that
    ComfyUI's own partial load runs: it loads what fits the free memory and casts the rest layer by layer. Under
    PhaseOffload, on a card emulated at half the model: ComfyUI loads part of it (lowvram), the output is
    bit-identical to the same partial load without the node, the loaded part is swapped back at the unload (0 bytes
    device→host) and ComfyUI's accounting is its own."""
    from test_group_prefetch_node import _emulate_card

    mm = comfy_env.mm
    model = tiny_wan.load_model()
    mm.unload_all_models()
    size = model.model_size()
    _emulate_card(monkeypatch, mm, size // 2, SimpleNamespace(session=None))
    plain = _host_offload(model)
    ref = tiny_wan.sample(plain)["samples"]                               # ComfyUI's own partial load
    assert 0 < plain.loaded_size() < size and plain.model.model_lowvram
    mm.unload_all_models()
    m, _, _, _ = _run_node(comfy_env, _host_offload(model))
    for _ in range(2):
        assert torch.equal(tiny_wan.sample(m)["samples"], ref)
        assert 0 < m.loaded_size() < size and m.model.model_lowvram    # a partial load: ComfyUI streams the rest
        mm.unload_all_models()
        assert m.loaded_size() == 0
    unloads = [r for r in _group(m).records if r["kind"] == "unload"]
    assert len(unloads) >= 2 and all(r["d2h"] == 0 and r["swapped"] > 0 for r in unloads)


def test_the_plans_pinning_reaches_the_components_that_move(comfy_env):
    """Found in review: SDXL at 512² on 8 GiB plans its UNet resident (nothing to pin) and the text encoder and VAE
    as phases, pinned; the node took 'pin' from the diffusion model alone and ran them pageable."""
    from comfyui_levers.core.plan import Workload, plan
    from comfyui_levers.core.presets import get_preset
    from comfyui_levers.core.probe import synthetic_machine
    from comfyui_levers.core.types import Residency
    from comfyui_levers.nodes.phase_offload import settings_from

    p = plan(get_preset("sdxl"), Workload(512, 512), synthetic_machine(vram_gb=8, ram_gb=16, h2d_gbps=25))
    assert p.diffusion_model.residency is Residency.RESIDENT and not p.diffusion_model.pin
    assert p.text_encoder.residency is Residency.PHASE and p.text_encoder.pin
    settings = settings_from(p, "auto", "auto", "auto", "auto", "auto")
    # the resident UNet stays on the GPU and keeps no host master: the pinned set is the plan's (found in review:
    # with pin on, PhaseOffload pinned a UNet master the plan never counted, 13 of 16 GiB of RAM for SD3.5)
    assert settings.pin == "on" and settings.resident == ("diffusion_model",)
    assert settings_from(p, "auto", "auto", "auto", "off", "auto").pin == "off"       # the widget wins
    # a plan that pins nothing that moves (WSL page-locks about 1 GiB: no host copy here fits) turns pinning off
    from dataclasses import replace
    wsl = replace(synthetic_machine(vram_gb=12, ram_gb=24, h2d_gbps=25), os="wsl")
    tight = plan(get_preset("flux1-dev"), Workload(1024, 1024), wsl)
    assert not any(c.pin for c in tight.components)
    assert settings_from(tight, "auto", "auto", "auto", "auto", "auto").pin == "off"
    # a plan the RAM rule lets pin only part of its host copies (FLUX streamed on 16 GiB with 40 GiB of RAM: the text
    # encoder alone): pinning on, the streamed diffusion model's masters pageable
    part = plan(get_preset("flux1-dev"), Workload(1024, 1024), synthetic_machine(vram_gb=16, ram_gb=40, h2d_gbps=25))
    assert part.text_encoder.pin and not part.diffusion_model.pin
    settings = settings_from(part, "auto", "auto", "auto", "auto", "auto")
    assert settings.pin == "on" and settings.pageable == ("diffusion_model",)
    from comfyui_levers.bridge.phase import PhaseGroup, report_text
    from comfyui_levers.core.residency.transport import CpuTransport
    group = PhaseGroup(settings)
    assert set(group.store_for(CpuTransport()).pageable) == {"diffusion_model", "diffusion_model_2"}
    assert "pin: on (pageable: diffusion_model)" in report_text(group)
    assert settings_from(part, "auto", "auto", "auto", "on", "auto").pageable == ()     # the widget wins


def test_a_plans_fp8_text_encoder_beside_a_16_bit_one_gets_a_line(comfy_env, tiny_wan):
    """Found in review: a plan often chooses an fp8 text encoder (the speed goal for FLUX on 16 GiB), which means
    loading ComfyUI's fp8 encoder file; no node converts a 16-bit one, and PhaseOffload ignored the plan's fp8 in
    silence (the plan's peak and host RAM then assumed half the encoder's bytes). The report says what to load."""
    from comfyui_levers.core.plan import Workload, plan
    from comfyui_levers.core.presets import get_preset
    from comfyui_levers.core.probe import synthetic_machine

    p = plan(get_preset("flux1-dev"), Workload(1024, 1024), synthetic_machine(vram_gb=16, ram_gb=64, h2d_gbps=25),
             "speed")
    assert str(p.text_encoder.precision) == "fp8_e4m3fn", p.text_encoder
    model = _host_offload(tiny_wan.load_model())
    cpu = dict(plan=p, model_device="cpu", text_encoder_device="cpu")        # the plan is for a 16 GiB card
    _, _, _, report = _run_node(comfy_env, model, _stand_in_clip(comfy_env), **cpu)
    assert "the plan's text encoder is fp8, but the connected one is stored at 2 bytes a weight" in report, report
    _, _, _, report = _run_node(comfy_env, model, _stand_in_clip(comfy_env, torch.float8_e4m3fn), **cpu)
    assert "the plan's text encoder is fp8" not in report, report


def test_a_component_the_plan_keeps_resident_stays_on_the_gpu_across_phases(comfy_env, tiny_wan):
    """A plan that keeps the diffusion model resident sized the encode and decode phases with it on the GPU, and gave
    it no host copy: PhaseOffload must not release it when the VAE decodes, nor keep a master of it (which it would
    pin). The VAE still gets its own phase."""
    from comfyui_levers.bridge.phase import PhaseSettings, apply

    model, vae = _host_offload(tiny_wan.load_model()), tiny_wan.load_vae()
    ref = tiny_wan.sample(model)["samples"]
    out = apply(model, None, vae, PhaseSettings(resident=("diffusion_model",)))
    m, v = out.model, out.vae
    latent = tiny_wan.sample(m)
    assert torch.equal(latent["samples"], ref)
    tiny_wan.decode(v, latent)
    assert _dit_entries(comfy_env, m.model), "the resident diffusion model was released by the decode phase"
    led = _group(m).ledger()["components"]["diffusion_model"]
    assert led["master_bytes"] == 0
    assert any("the plan keeps it on the GPU" in n for n in _group(m).components["diffusion_model"].notes)
    from comfyui_levers.bridge.phase import report_text
    line = next(x for x in report_text(_group(m)).splitlines() if x.startswith("- diffusion_model:"))
    assert "moved by ComfyUI (no pointer swap, below)" in line, line     # found in review: it said pointer-swap
    # without it, the decode releases the model (PhaseOffload's exclusivity)
    plain = apply(_host_offload(tiny_wan.load_model()), None, tiny_wan.load_vae(), PhaseSettings())
    tiny_wan.decode(plain.vae, tiny_wan.sample(plain.model))
    assert not _dit_entries(comfy_env, plain.model.model)
    with pytest.raises(ValueError, match="resident"):
        PhaseSettings(resident=("diffusion_model_2",))


def _is_loaded(env, patcher) -> bool:
    return any(lm.model is patcher for lm in env.mm.current_loaded_models)


@pytest.mark.parametrize("how", ["phase_offload", "plan_only"])
def test_tiled_vae_decode_keeps_loaded_what_the_plan_keeps_resident(comfy_env, tiny_wan, monkeypatch, how):
    """Found in review: TiledVAEDecode's unload_other_models (on in every shipped example, which connect the plan to
    both nodes) unloaded everything, so a diffusion model the plan keeps on the GPU across phases (PhaseOffload's
    promise: ComfyUI loads it once) was copied home and reloaded every generation. It now stays; a component the
    plan moves is still unloaded. No GPU here: the VAE's device reads as CUDA for the node's CPU check."""
    from comfyui_levers.bridge import vae as bv
    from comfyui_levers.bridge.phase import PhaseSettings, apply
    from comfyui_levers.core.types import Residency

    env = comfy_env
    env.mm.unload_all_models()

    def plan_with(residency):
        comps = {"diffusion_model": SimpleNamespace(name="diffusion_model", residency=residency)}
        return SimpleNamespace(component=lambda name: comps[name])

    for residency in (Residency.RESIDENT, Residency.PHASE):
        if how == "phase_offload":
            resident = ("diffusion_model",) if residency is Residency.RESIDENT else ()
            out = apply(_host_offload(tiny_wan.load_model()), None, tiny_wan.load_vae(),
                        PhaseSettings(resident=resident))
            model, vae, plan = out.model, out.vae, None
        else:
            model, vae, plan = tiny_wan.load_model(), tiny_wan.load_vae(), plan_with(residency)
        tiny_wan.sample(model)
        env.mm.load_models_gpu([model])
        assert _is_loaded(env, model)
        monkeypatch.setattr(vae, "device", torch.device("cuda", 0))      # the models' CPU stands in for its GPU
        monkeypatch.setattr(bv, "_same_device", lambda a, b: True)
        monkeypatch.setattr(env.mm, "get_free_memory",
                            lambda dev=None, torch_free_too=False: (0, 0) if torch_free_too else 0)
        line = bv.free_other_models(vae, plan)
        monkeypatch.undo()
        assert _is_loaded(env, model) is (residency is Residency.RESIDENT), line
        assert ("kept loaded: diffusion_model" in line) is (residency is Residency.RESIDENT), line
        env.mm.unload_all_models()


def test_quantize_dit_after_the_node_puts_the_quantized_model_in_the_phase_group(comfy_env, tiny_wan):
    """Found in review: PhaseOffload -> QuantizeDiT -> KSampler. The quantized copy carried the node's component,
    which described the input model: the quantized model was never released before the decode (the VAE OOM the node
    exists to prevent) nor swapped, and the input's masters stayed pinned for a model nothing sampled. The quantized
    model now joins the group in the diffusion model's role: bit-identical to QuantizeDiT before the node, released
    at the decode phase, adopted as its own masters (pinned under a key of its own); the input stays a member for
    the outputs that sample it, and the input the quality check loaded is released when the quantized one samples
    (a first version replaced the input's component: the input then stayed loaded through the decode)."""
    from comfyui_levers.bridge.phase import ATTACHMENT

    env = comfy_env
    quant = next(c for c in env.levers_nodes.NODE_CLASSES if c.__name__ == "LeversQuantizeDiT")

    def quantize(m):
        out = quant.execute(m, format="fp8_e4m3fn", quality_check=True)
        return (out.args if hasattr(out, "args") else out.result)

    env.mm.unload_all_models()
    want = tiny_wan.sample(quantize(_host_offload(tiny_wan.load_model()))[0])["samples"]
    env.mm.unload_all_models()
    m, _, v, _ = _run_node(env, _host_offload(tiny_wan.load_model()), None, tiny_wan.load_vae())
    old = m.attachments[ATTACHMENT]
    assert old.table is not None and old.table.masters          # staged: the input's masters
    q, text = quantize(m)
    assert "manages the quantized model as a diffusion_model of its group" in text, text
    assert "quality check: output PSNR" in text, text
    comp = q.attachments[ATTACHMENT]
    group = old.group
    assert comp.module is q.model and comp.group is group and comp in group.members()
    assert group.components["diffusion_model"] is old and old.table.masters       # the input stays a member
    assert comp.table.component != old.table.component                  # neither unpins the other's masters
    assert m.attachments[ATTACHMENT] is old and m.model is old.module      # the node's own output unchanged
    latent = tiny_wan.sample(q)
    assert torch.equal(latent["samples"], want)
    assert _dit_entries(env, q.model) and not _dit_entries(env, m.model)   # the quality check's load released
    tiny_wan.decode(v, latent)
    assert not _dit_entries(env, q.model), "the quantized model stayed loaded through the decode phase"
    phases = [p["phase"] for p in comp.group.ledger()["run"]["phases"]]
    assert phases[-2:] == ["sample", "decode"], phases


def test_two_nodes_on_one_model_swap_with_the_same_masters(comfy_env, tiny_wan):
    """Found in review: two PhaseOffload nodes on the same MODEL (two branches of one graph) each kept masters of its
    own. ComfyUI leaves the weights on the device when it switches from one node's clone to the other's, as the first
    node's copies, which the second node's masters did not know: its release was ComfyUI's copy home into new host
    memory, while the first node's masters held the old memory (the model twice in RAM). Each node's masters know
    the other's device copies of the same host memory now, and send them home by pointer swap."""
    from comfyui_levers.bridge.phase import ATTACHMENT, PhaseSettings, apply

    env = comfy_env
    env.mm.unload_all_models()
    model = _host_offload(tiny_wan.load_model())
    a = apply(model, None, tiny_wan.load_vae(), PhaseSettings())
    b = apply(model, None, tiny_wan.load_vae(), PhaseSettings())
    for _ in range(2):
        tiny_wan.sample(a.model)
        latent = tiny_wan.sample(b.model)
        tiny_wan.decode(a.vae, latent)        # a's decode releases the diffusion model, loaded under b's clone
    assert a.group.ledger()["totals"]["d2h_bytes"] == 0 and b.group.ledger()["totals"]["d2h_bytes"] == 0
    now = {n: p.data_ptr() for n, p in a.model.model.named_parameters()}
    for out in (a, b):                        # every master is the model's own host memory: one copy in RAM
        masters = out.model.attachments[ATTACHMENT].table.masters
        stale = [n for n, m in masters.items() if n in now and m.host.data_ptr() != now[n]]
        assert not stale, f"{len(stale)} of {len(masters)} masters hold a second host copy"


def test_a_quantized_copy_of_a_resident_diffusion_model_takes_its_place_on_the_gpu(comfy_env, tiny_wan):
    """Found in review: with a plan that keeps the diffusion model on the GPU, QuantizeDiT after the node (its quality
    check loads the input) left both diffusion models loaded through sampling and decoding: the copy joined as
    resident too, and residents released nobody. Members in the same role release each other; the copy stays
    resident through the decode, as the plan asks, and the input's release is booked as ComfyUI's copy home."""
    from comfyui_levers.bridge.phase import PhaseSettings, apply

    env = comfy_env
    quant = next(c for c in env.levers_nodes.NODE_CLASSES if c.__name__ == "LeversQuantizeDiT")
    env.mm.unload_all_models()
    out = apply(_host_offload(tiny_wan.load_model()), None, tiny_wan.load_vae(),
                PhaseSettings(resident=("diffusion_model",)))
    m, v = out.model, out.vae
    r = quant.execute(m, format="fp8_e4m3fn", quality_check=True)
    q, text = (r.args if hasattr(r, "args") else r.result)[:2]
    assert "quality check" in text and _dit_entries(env, m.model)       # the check loaded the input
    latent = tiny_wan.sample(q)
    assert _dit_entries(env, q.model) and not _dit_entries(env, m.model)
    tiny_wan.decode(v, latent)
    assert _dit_entries(env, q.model) and not _dit_entries(env, m.model)
    run = out.group.ledger()["run"]
    assert any(e.get("kind") == "released by ComfyUI" and e.get("component") == "diffusion_model"
               for p in run["phases"] for e in p.get("events", [])) or any(
        "kept on the GPU by the plan, but another model in its role loaded" in n for n in out.group.notes)


@pytest.mark.parametrize("case", ["model_2_shares_it", "quantize_model_2", "two_quantize_nodes"])
def test_quantized_copies_and_the_models_they_came_from_take_turns(comfy_env, tiny_wan, case):
    """Found in review of the first version, which replaced the group's component by name: a model_2 sharing the
    input, the first model beside a quantized model_2, or a first quantized copy beside a second, stayed loaded
    through the decode phase. Every member takes its turn now; a copy nothing uses any more leaves the group."""
    import gc
    import weakref

    env = comfy_env
    quant = next(c for c in env.levers_nodes.NODE_CLASSES if c.__name__ == "LeversQuantizeDiT")

    def quantize(m, fmt="fp8_e4m3fn"):
        out = quant.execute(m, format=fmt, quality_check=False)
        return (out.args if hasattr(out, "args") else out.result)[0]

    env.mm.unload_all_models()
    model = _host_offload(tiny_wan.load_model())
    out = _node(env).execute(model, None, tiny_wan.load_vae(), model_2=model.clone())
    m, _, v, _, m2 = out.args if hasattr(out, "args") else out.result
    if case == "model_2_shares_it":
        first, second = quantize(m), m2
    elif case == "quantize_model_2":
        first, second = m, quantize(m2)
    else:
        first, second = quantize(m), quantize(m, "int8")
    latent = tiny_wan.sample(first)
    latent = tiny_wan.sample(second, latent, denoise=0.5)
    assert _dit_entries(env, second.model) and not _dit_entries(env, first.model)
    tiny_wan.decode(v, latent)
    assert not _dit_entries(env, first.model) and not _dit_entries(env, second.model)
    group = m.attachments["levers_phase"].group
    joined = [weakref.ref(x.model) for x in (first, second) if x.model is not m.model]
    dits = lambda: [c for c in group.members() if c.name == "diffusion_model"]      # noqa: E731
    assert len(dits()) == 1 + len(joined)
    del first, second, latent
    gc.collect()
    assert all(r() is None for r in joined) and len(dits()) == 1     # the group holds the copies weakly
    # and what they pinned went with them (the pinned pieces would have held their weights)
    assert not [k for st in group._stores.values() for k in st._by_component if "joined" in k]


def test_tiled_vae_decode_keeps_a_plans_diffusion_model_only_when_it_is_the_one_loaded(comfy_env, tiny_wan,
                                                                                       monkeypatch):
    """Found in review: without PhaseOffload, a plan keeping the diffusion model resident kept every loaded diffusion
    model through the decode (a refiner, the other expert), shrinking the decode's memory. The plan describes one:
    with two loaded, neither is kept on its account."""
    from comfyui_levers.bridge import vae as bv
    from comfyui_levers.core.types import Residency

    env = comfy_env
    env.mm.unload_all_models()
    plan = SimpleNamespace(component=lambda name: {"diffusion_model": SimpleNamespace(
        name=name, residency=Residency.RESIDENT)}[name])
    a, b, vae = tiny_wan.load_model(), tiny_wan.load_model(), tiny_wan.load_vae()
    env.mm.load_models_gpu([a])
    env.mm.load_models_gpu([b])
    assert _is_loaded(env, a) and _is_loaded(env, b)
    monkeypatch.setattr(vae, "device", torch.device("cuda", 0))      # the models' CPU stands in for its GPU
    monkeypatch.setattr(bv, "_same_device", lambda x, y: True)
    monkeypatch.setattr(env.mm, "get_free_memory",
                        lambda dev=None, torch_free_too=False: (0, 0) if torch_free_too else 0)
    line = bv.free_other_models(vae, plan)
    assert not _is_loaded(env, a) and not _is_loaded(env, b) and "kept loaded" not in line, line


@pytest.mark.parametrize("fail_at", [1, 3, 6, 10 ** 9])
def test_a_load_that_runs_out_of_memory_part_way_with_a_lora_loses_nothing(comfy_env, tiny_wan, fail_at):
    """An allocation failing part way through the pointer-swap load of a LoRA'd model (out of memory): ComfyUI
    moves the weights back and the run fails. Every weight is back on its master, the masters never took the
    patch, and the next run (and the model without the LoRA) gives the outputs of the plain workflow."""
    model = tiny_wan.load_model()
    key, delta, plain, want = _lora_case(tiny_wan, model)
    comfy_env.mm.unload_all_models()
    m, _, _, _ = _run_node(comfy_env, _host_offload(model))
    lora = m.clone()
    lora.add_patches({f"diffusion_model.{key}": (delta,)}, 1.0)
    comp = _group(m).components["diffusion_model"]
    masters = {n: (e.host.data_ptr(), e.host.detach().clone()) for n, e in comp.table.masters.items()}
    tr = comp.table.transport
    real_empty, count = tr.empty, {"n": 0}

    def empty(shape, dtype):
        count["n"] += 1
        if count["n"] == fail_at:
            raise torch.OutOfMemoryError("stand-in: out of memory part way through the load")
        return real_empty(shape, dtype)
    tr.empty = empty
    try:
        if fail_at > 100:             # the same run without a failure: the reference for what follows
            tiny_wan.sample(lora)
        else:
            with pytest.raises(torch.OutOfMemoryError):
                tiny_wan.sample(lora)
    finally:
        tr.empty = real_empty
    comfy_env.mm.unload_all_models()
    _on_masters(m, masters, f"diffusion_model.{key}")
    assert torch.equal(tiny_wan.sample(lora)["samples"], want)
    assert torch.equal(tiny_wan.sample(m)["samples"], plain)
    comfy_env.mm.unload_all_models()
    _on_masters(m, masters, f"diffusion_model.{key}")


def _on_masters(patcher, masters, patched):
    """Every weight bound to its master again, with the master's values. The patched one's backup is a copy here
    (ComfyUI backs it up with ``.to(offload_device)``, which copies to this test's ``cpu:0``; on a GPU machine the
    offload device is the weight's own and the backup is the master itself): its values are checked."""
    for n, p in patcher.model.named_parameters():
        if n in masters:
            assert n == patched or p.data_ptr() == masters[n][0], f"{n} is not back on its master"
            assert torch.equal(p.detach(), masters[n][1]), f"{n} does not hold its master's values"
