"""GroupPrefetch and PhaseOffload on a model loaded by ComfyUI-GGUF (the real custom node, pointed at by
COMFYUI_GGUF_PATH), in a real headless ComfyUI on the CPU.

GGUF weights are ``GGMLTensor``s: packed quantized blocks (uint8) whose ``shape`` reports the dequantized shape,
with the quantization type and LoRA patches as attributes; ComfyUI-GGUF dequantizes them inside each layer. Both
nodes move their packed bytes by pointer swap and keep the objects and attributes.
"""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.comfyui

HOST = torch.device("cpu", 0)   # another device that is host memory: ComfyUI really moves weights (PhaseOffload tests)


def _node(env, name):
    return next(c for c in env.levers_nodes.NODE_CLASSES if c.__name__ == name)


def _result(out):
    return out.args if hasattr(out, "args") else out.result


def _ggml(model):
    dm = model.model.diffusion_model
    return {n: p for n, p in dm.named_parameters() if type(p).__name__ == "GGMLTensor"}


def test_group_prefetch_streams_the_packed_gguf_blocks_bit_identical(comfy_env, tiny_wan, gguf, monkeypatch):
    from comfyui_levers.bridge.prefetch import prefetch_state
    from comfyui_levers.core.residency.blocks import find_blocks, module_bytes

    model = gguf.load_model()
    quantized = {n for n, p in _ggml(model).items() if getattr(p, "tensor_type", None) is not None
                 and p.tensor_type.name in ("Q8_0", "Q4_0")}
    assert quantized, "the tiny GGUF holds Q8_0 / Q4_0 weights"
    ref = tiny_wan.sample(model)["samples"]
    comfy_env.mm.unload_all_models()            # the node's run loads the model fresh (through its load override)
    clone, report = _result(_node(comfy_env, "LeversGroupPrefetch").execute(
        gguf.load_model(), blocks_per_group=1, prefetch_depth=1, resident_groups=0, vram_budget_gb=1.0))
    state = prefetch_state(clone)
    dm = clone.model.diffusion_model
    blocks = find_blocks(dm).blocks
    block_of = {id(m): i for i, (_, b) in enumerate(blocks) for m in b.modules()}
    reads: list[tuple[int, bool]] = []
    cast = gguf.ops.GGMLLayer.cast_bias_weight

    def spy(s, *args, **kwargs):
        # the packed weight a streamed layer dequantizes must be its group's device slot, not the host copy
        handle = state.session.handle if state.session is not None else None
        if handle is not None and id(s) in block_of and getattr(s.weight, "tensor_type", None) is not None:
            ptr = s.weight.data_ptr()
            reads.append((block_of[id(s)], any(sl.buffer.data_ptr() <= ptr < sl.buffer.data_ptr() + sl.buffer.numel()
                                               for sl in handle.slots)))
        return cast(s, *args, **kwargs)
    monkeypatch.setattr(gguf.ops.GGMLLayer, "cast_bias_weight", spy)
    out = tiny_wan.sample(clone)["samples"]
    assert torch.equal(out, ref)
    stats = state.last_stats
    assert stats is not None, state.last_report
    assert "not streamed" not in state.last_report, state.last_report
    # every block byte is the packed GGUF bytes, and every one of them crossed the bus in the last forward
    assert stats["host_bytes"] >= sum(module_bytes(b) for _, b in blocks)
    assert stats["last_forward"]["h2d_bytes"] == stats["streamed_bytes_per_forward"] >= sum(
        module_bytes(b) for _, b in blocks)
    assert reads and all(in_slot for _, in_slot in reads), [b for b, ok in reads if not ok][:5]
    assert {b for b, _ in reads} == set(range(len(blocks)))
    # the module's own GGMLTensor objects are back on their host copies, attributes intact
    after = _ggml(clone)
    assert all(getattr(after[n], "tensor_type", None) is not None for n in quantized)
    assert torch.equal(tiny_wan.sample(clone)["samples"], ref)


def test_group_prefetch_streams_gguf_loras_as_comfyui_gguf_applies_them(comfy_env, tiny_wan, gguf):
    """ComfyUI-GGUF applies a LoRA on a quantized weight while dequantizing (the patches ride on the tensor); the
    streamed weight carries them to the device too."""
    model = gguf.load_model()
    sd = model.model.diffusion_model.state_dict()
    key = next(k for k in _ggml(model) if k.startswith("blocks.2.") and k.endswith("q.weight"))
    shape = _ggml(model)[key].shape                      # the dequantized shape
    lora = model.clone()
    g = torch.Generator().manual_seed(5)
    lora.add_patches({f"diffusion_model.{key}": (torch.randn(tuple(shape), generator=g) * 0.05,)}, 1.0)
    ref = tiny_wan.sample(lora)["samples"]
    assert not torch.equal(ref, tiny_wan.sample(model)["samples"]), "the LoRA must change the output"
    assert key in sd
    comfy_env.mm.unload_all_models()
    clone, _ = _result(_node(comfy_env, "LeversGroupPrefetch").execute(
        lora, blocks_per_group=1, prefetch_depth=1, resident_groups=0, vram_budget_gb=1.0))
    for _ in range(2):
        assert torch.equal(tiny_wan.sample(clone)["samples"], ref)
    assert torch.equal(tiny_wan.sample(model)["samples"], tiny_wan.sample(gguf.load_model())["samples"])


def test_phase_offload_swaps_gguf_weights_and_survives_its_clones(comfy_env, tiny_wan, gguf):
    """The load copies the packed bytes to the device; the unload points the GGMLTensors back at their host copies
    (zero bytes). Before, the real layout was read from the logical shape and the load raised. ComfyUI-GGUF's
    clone() gives the copy its own class: a clone taken after the node keeps the phase behaviour."""
    from comfyui_levers.bridge.phase import ATTACHMENT

    model = gguf.load_model()
    ref = tiny_wan.sample(model)["samples"]
    comfy_env.mm.unload_all_models()
    host = gguf.load_model().clone()
    host.offload_device = HOST
    m = _result(_node(comfy_env, "LeversPhaseOffload").execute(host))[0]
    group = m.attachments[ATTACHMENT].group
    own = _ggml(m)

    def run(patcher):
        assert torch.equal(tiny_wan.sample(patcher)["samples"], ref)
        comfy_env.mm.unload_all_models()
        now = _ggml(m)
        assert all(now[n] is own[n] and getattr(now[n], "tensor_type", None) is not None for n in own)
    run(m)
    later = m.clone()                                # e.g. a LoRA loader after the node
    assert type(later) is type(m) and type(later).__name__.startswith("LeversPhase")
    run(later)
    # a LoRA on a packed weight, after the node: ComfyUI-GGUF applies it while dequantizing, as without the node
    key = next(k for k in own if k.startswith("blocks.1.") and k.endswith("q.weight"))
    patch = {f"diffusion_model.{key}": (torch.randn(tuple(own[key].shape), generator=torch.Generator().manual_seed(2))
                                        * 0.05,)}
    plain_lora = gguf.load_model().clone()
    plain_lora.add_patches(patch, 1.0)
    want = tiny_wan.sample(plain_lora)["samples"]
    assert not torch.equal(want, ref)
    comfy_env.mm.unload_all_models()
    lora = m.clone()
    lora.add_patches(patch, 1.0)
    assert torch.equal(tiny_wan.sample(lora)["samples"], want)
    comfy_env.mm.unload_all_models()
    assert torch.equal(tiny_wan.sample(m)["samples"], ref), "the LoRA must not stay on the node's model"
    comfy_env.mm.unload_all_models()
    recs = [r for r in group.ledger()["records"] if r["component"] == "diffusion_model"]
    loads = [r["h2d"] for r in recs if r["kind"] == "load"]
    unloads = [r for r in recs if r["kind"] == "unload"]
    assert len(loads) >= 2 and loads == [r["swapped"] for r in unloads] and all(r["d2h"] == 0 for r in unloads)


def test_a_new_group_prefetch_clone_of_a_gguf_model_does_not_move_or_restage_the_streamed_blocks(comfy_env, tiny_wan,
                                                                                                gguf):
    """ComfyUI-GGUF's first load of a patcher moves every module left on the offload device to the load device and
    back (to detach it from the file's memory map). Under GroupPrefetch those are the streamed blocks, which the
    engine's own host copy already detaches: each new clone (any node upstream makes one) would otherwise move them
    there and back and make the store re-stage every one. Load and offload devices differ here, as on a GPU."""
    import comfyui_levers.bridge.prefetch as bp
    from comfyui_levers.core.residency.blocks import find_blocks

    base = gguf.load_model()
    base.load_device = HOST
    ref = tiny_wan.sample(gguf.load_model())["samples"]
    comfy_env.mm.unload_all_models()
    root = base.model.diffusion_model
    blocks = {id(m) for _, b in find_blocks(root).blocks for m in b.modules()}
    moved = []
    orig_to = torch.nn.Module.to

    def spy(self, *args, **kwargs):
        if id(self) in blocks:
            moved.append(args)
        return orig_to(self, *args, **kwargs)
    restaged = []
    for _ in range(3):
        clone, _ = _result(_node(comfy_env, "LeversGroupPrefetch").execute(
            base.clone(), blocks_per_group=1, prefetch_depth=1, resident_groups=0, vram_budget_gb=1.0))
        torch.nn.Module.to = spy
        try:
            assert torch.equal(tiny_wan.sample(clone)["samples"], ref)
        finally:
            torch.nn.Module.to = orig_to
        restaged.append(bp._STORES[root][1].restaged)
        comfy_env.mm.unload_all_models()
    assert not moved, moved
    assert restaged[1] == restaged[2] == restaged[0], restaged


def test_quantize_dit_leaves_a_gguf_model_as_it_is_and_says_so(comfy_env, tiny_wan, gguf):
    model = gguf.load_model()
    ref = tiny_wan.sample(model)["samples"]
    quant = _node(comfy_env, "LeversQuantizeDiT")
    out, report = _result(quant.execute(model, format="fp8_e4m3fn"))[:2]
    assert "already holds quantized weights" in report, report
    assert all(type(p).__name__ == "GGMLTensor" for p in _ggml(out).values()) and _ggml(out).keys() == _ggml(model).keys()
    assert torch.equal(tiny_wan.sample(out)["samples"], ref)


def test_read_only_gguf_weights_get_writable_copies_to_pin(comfy_env, tiny_wan, gguf):
    """ComfyUI-GGUF hands over its weights as views of the file's read-only memory map, which cudaHostRegister
    cannot page-lock (it fails, and leaves a CUDA error for the next kernel). When the masters are to be pinned,
    the store copies them first and the GGMLTensors (same objects, type and LoRA attributes kept) point at the
    copies: checked here with a transport that stands in for the GPU's pinning."""
    from comfyui_levers.core.residency.phase import MasterTable
    from comfyui_levers.core.residency.pinned import GIB, PinnedStore
    from comfyui_levers.core.residency.transport import CpuTransport, HostMaps, PinResult

    class Pinning(CpuTransport):
        def pin(self, t):
            return PinResult(True, "pinned in place", t.nbytes)

    model = gguf.load_model()
    ref = tiny_wan.sample(model)["samples"]
    comfy_env.mm.unload_all_models()
    own = _ggml(model)
    packed = {n: p for n, p in own.items() if getattr(p.tensor_type, "name", "") in ("Q8_0", "Q4_0")}
    assert packed
    maps = HostMaps.read()
    assert all(maps.writable(p.data_ptr(), p.untyped_storage().nbytes()) is False for p in packed.values())
    kinds = {n: p.tensor_type for n, p in own.items()}
    transport = Pinning()
    store = PinnedStore(transport, "auto", has_cuda=True, available_ram_bytes=64 * GIB,
                        total_ram_bytes=128 * GIB, os_name="linux")
    table = MasterTable(model.model.diffusion_model, "diffusion_model", transport, store)
    table.capture()
    out = table.pin_outcome
    assert out.pinned and out.copied_bytes >= sum(p.untyped_storage().nbytes() for p in packed.values())
    now = _ggml(model)
    maps = HostMaps.read()
    assert all(now[n] is own[n] and now[n].tensor_type == kinds[n] for n in own)
    assert all(maps.writable(p.data_ptr(), p.untyped_storage().nbytes()) is True for p in now.values())
    assert torch.equal(tiny_wan.sample(model)["samples"], ref)
