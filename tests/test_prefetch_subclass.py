"""Group prefetch of weights held as wrapper tensor subclasses (ComfyUI 0.8+ holds fp8 checkpoints and
QuantizeDiT's fp8 layers as comfy-kitchen ``QuantizedTensor``s): their inner tensors (codes, scale) stream,
as quantized bytes, and a device wrapper takes the parameter's place while its group computes.

``Fp8Wrapper`` here follows the same protocol as ``QuantizedTensor`` (``__tensor_flatten__`` /
``__tensor_unflatten__``, device fixed at construction) with the least dispatch that computes."""
from __future__ import annotations

import pytest
import torch
from torch.utils._pytree import tree_map

from comfyui_levers.core.residency import subclass
from comfyui_levers.core.residency.prefetch import AUTO, PrefetchConfig, apply_group_prefetch
from comfyui_levers.core.residency.transport import CpuTransport, RecordingTransport
from prefetch_toys import make_wan, wan_inputs

BIG = 10 ** 9


class Fp8Wrapper(torch.Tensor):
    """fp8 codes and a float32 scale, dequantized by every op (what matters here is what streams)."""

    @staticmethod
    def __new__(cls, qdata, scale):
        return torch.Tensor._make_wrapper_subclass(cls, qdata.shape, dtype=torch.float32, device=qdata.device)

    def __init__(self, qdata, scale):
        self._qdata, self._scale = qdata, scale

    def __tensor_flatten__(self):
        return ["_qdata", "_scale"], None

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        return Fp8Wrapper(inner["_qdata"], inner["_scale"])

    def dequantize(self):
        return self._qdata.float() * self._scale

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda a: a.dequantize() if isinstance(a, cls) else a   # noqa: E731
        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))


def _quantize_blocks(m) -> int:
    """Every block linear's weight becomes an Fp8Wrapper parameter (as ComfyUI's mixed-precision layers hold
    them). Returns the block bytes in the wrappers (codes + scales)."""
    total = 0
    for block in m.blocks:
        for mod in block.modules():
            if isinstance(mod, torch.nn.Linear):
                w = mod.weight.detach().float()
                scale = (w.abs().amax() / 448.0).reshape(())
                q = Fp8Wrapper((w / scale).to(torch.float8_e4m3fn), scale)
                q._is_param = True          # a parameter without the detach nn.Parameter() would run
                mod._parameters["weight"] = q
                total += q._qdata.numel() + 4
    return total


def _model():
    m = make_wan()
    _quantize_blocks(m)
    return m


def _rec():
    return RecordingTransport(CpuTransport())


def test_leaves_and_rebuild_follow_the_flatten_protocol():
    q = Fp8Wrapper(torch.randn(3, 4).to(torch.float8_e4m3fn), torch.tensor(0.5))
    q._is_param = True
    names = [p for p, _ in subclass.leaves(q)]
    assert names == [("_qdata",), ("_scale",)] and subclass.nbytes(q) == 12 + 4
    codes = torch.zeros(3, 4, dtype=torch.float8_e4m3fn)
    r = subclass.rebuild(q, {("_qdata",): codes})
    assert type(r) is Fp8Wrapper and r._qdata is codes and r._scale is q._scale
    assert isinstance(r, torch.nn.Parameter), "a parameter must stay a parameter"
    assert subclass.leaves(torch.randn(2)) is None and subclass.leaf(q, ("_scale",)) is q._scale


def test_wrapped_weights_stream_as_their_quantized_bytes_bit_identical():
    m = _model()
    x = wan_inputs()
    originals = {n: p for n, p in m.named_parameters()}
    with torch.no_grad():
        ref = m(*x)
    tr = _rec()
    h = apply_group_prefetch(m, PrefetchConfig(1, 1, 0, BIG, partial_blocks=False), tr, bandwidth=0)
    try:
        assert not h.store.kept, h.store.kept
        assert len(h.store.wrapped) == 6 * 6
        streamed = h.stats()["streamed_bytes_per_forward"]
        plain_bytes = sum(t.numel() * t.element_size() for n, t in originals.items()
                          if n.startswith("blocks.") and type(t) is not Fp8Wrapper)
        assert streamed < plain_bytes + sum(t.numel() * 4 for t in originals.values() if type(t) is Fp8Wrapper), \
            "fp8 codes stream, not their float32 meaning"
        seen = []

        def spy(mod, args):
            w = mod.weight
            seen.append((type(w), w is originals[f"blocks.0.ffn.0.weight"], w._qdata.data_ptr()))
        hook = m.blocks[0].ffn[0].register_forward_pre_hook(spy)
        with torch.no_grad():
            assert torch.equal(m(*x), ref)
            for _ in range(2):
                assert torch.equal(m(*x), ref)
                assert h.last.h2d_bytes == streamed and h.last.d2h_bytes == 0 and h.last.misses == 0
        hook.remove()
        slots = [(s.buffer.data_ptr(), s.buffer.data_ptr() + s.buffer.numel()) for s in h.slots]
        for kind, is_original, ptr in seen:
            # while its group computes, the layer holds a wrapper around the slot's copy, not the host one
            assert kind is Fp8Wrapper and not is_original and any(lo <= ptr < hi for lo, hi in slots)
        # between uses the module holds its own wrapper, whose codes live in the host arena
        w = m.blocks[0].ffn[0].weight
        assert w is originals["blocks.0.ffn.0.weight"]
        arena = h.store.arenas[torch.float8_e4m3fn]
        assert any(lo <= w._qdata.data_ptr() < hi for lo, hi in arena.ranges())
    finally:
        h.remove()
    assert all(p is originals[n] for n, p in m.named_parameters())
    with torch.no_grad():
        assert torch.equal(m(*x), ref)


@pytest.mark.parametrize("resident_groups, partial", [(2, False), (AUTO, True)])
def test_wrapped_weights_resident_or_split_bit_identical(resident_groups, partial):
    """Resident groups hold device wrappers for good; a split block may keep some of a wrapper's inner
    tensors resident and stream the rest."""
    m = _model()
    x = wan_inputs()
    originals = {n: p for n, p in m.named_parameters()}
    with torch.no_grad():
        ref = m(*x)
    probe = apply_group_prefetch(m, PrefetchConfig(AUTO, AUTO, AUTO, BIG), _rec(), bandwidth=0)
    blocks = probe.store.block_bytes()
    budget = probe.remainder_bytes + sum(blocks) // 2 + 2 * max(blocks)
    probe.remove()
    h = apply_group_prefetch(m, PrefetchConfig(1, 1, resident_groups, budget, partial_blocks=partial), _rec(),
                             bandwidth=0)
    try:
        s = h.stats()
        assert s["resident_bytes"] > 0 and s["streamed_bytes_per_forward"] > 0
        if partial:
            assert s["split_blocks"] > 0, s
        with torch.no_grad():
            for _ in range(3):
                assert torch.equal(m(*x), ref)
        assert h.last.h2d_bytes == s["streamed_bytes_per_forward"]
        if not partial:
            # a resident group's layer holds a device wrapper around the resident buffer's copy, for good
            resident, buf = m.blocks[0].q.weight, h._resident_bufs[torch.float8_e4m3fn]
            assert type(resident) is Fp8Wrapper and resident is not originals["blocks.0.q.weight"]
            assert buf.data_ptr() <= resident._qdata.data_ptr() < buf.data_ptr() + buf.numel()
    finally:
        h.remove()
    assert all(p is originals[n] for n, p in m.named_parameters())
    with torch.no_grad():
        assert torch.equal(m(*x), ref)


def test_a_failed_install_on_a_reused_store_leaves_the_module_its_current_weight():
    """The ComfyUI bridge reuses a store across runs. When the owner replaced a wrapped weight between runs and the
    next install failed (over budget), removing it put the first install's wrapper back into the module."""
    from comfyui_levers.core.errors import BudgetExceeded
    from comfyui_levers.core.residency.blocks import find_blocks
    from comfyui_levers.core.residency.prefetch import HostStore

    m = _model()
    tr = CpuTransport()
    store = HostStore(find_blocks(m).blocks, tr)
    h = apply_group_prefetch(m, PrefetchConfig(1, 1, 0, BIG, partial_blocks=False), tr, bandwidth=0, store=store)
    with torch.no_grad():
        m(*wan_inputs())
    h.remove()
    old = m.blocks[0].q.weight
    new = Fp8Wrapper(old._qdata.clone(), old._scale.clone())
    new._is_param = True
    m.blocks[0].q._parameters["weight"] = new          # a LoRA, a dtype change...
    with pytest.raises(BudgetExceeded):
        apply_group_prefetch(m, PrefetchConfig(1, 1, 0, 1000, partial_blocks=False), tr, bandwidth=0, store=store)
    assert m.blocks[0].q.weight is new


def test_split_plans_keep_more_streamed_heads_than_slots():
    """A split plan whose streamed heads all fit in the slots would move nothing per step (each keeps its slot)."""
    m = make_wan(mixed=True)
    x = wan_inputs()
    probe = apply_group_prefetch(m, PrefetchConfig(AUTO, AUTO, AUTO, BIG), _rec(), bandwidth=0)
    blocks, rem = probe.store.block_bytes(), probe.remainder_bytes
    probe.remove()
    budget = rem + int(sum(blocks) * 0.6) + 3 * max(blocks)
    h = apply_group_prefetch(m, PrefetchConfig(1, 2, 0, budget, partial_blocks=True), _rec(), bandwidth=0)
    try:
        with torch.no_grad():
            for _ in range(3):
                m(*x)
        streaming = sum(1 for k in (h.plan.cuts or ()) if k) if h.plan.split else len(h.stream_order)
        assert streaming > len(h.slots), (h.plan, len(h.slots))
        assert h.last.h2d_bytes == h.stats()["streamed_bytes_per_forward"] > 0
    finally:
        h.remove()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_wrapped_weights_stream_bit_identical_with_device_wrappers():
    """On a GPU the device wrapper must claim the GPU (a wrapper's device is fixed when built) and compute there."""
    from comfyui_levers.core.residency.transport import CudaTransport

    m = _model()
    x = [t.cuda() for t in wan_inputs()]
    ref_model = _model()
    for mod in ref_model.modules():
        for name, p in list(mod._parameters.items()):
            if type(p) is Fp8Wrapper:
                q = Fp8Wrapper(p._qdata.cuda(), p._scale.cuda())
                q._is_param = True
                mod._parameters[name] = q
            elif p is not None:
                mod._parameters[name] = torch.nn.Parameter(p.data.cuda(), requires_grad=p.requires_grad)
        for name, b in list(mod._buffers.items()):
            if b is not None:
                mod._buffers[name] = b.cuda()
    with torch.no_grad():
        ref = ref_model(*x)
    tr = RecordingTransport(CudaTransport("cuda"))
    h = apply_group_prefetch(m, PrefetchConfig(1, 1, 1, BIG, partial_blocks=False), tr)
    devices = []
    hook = m.blocks[3].ffn[0].register_forward_pre_hook(lambda mod, a: devices.append(mod.weight.device.type))
    try:
        with torch.no_grad():
            for _ in range(3):
                assert torch.equal(m(*x), ref)
        assert h.last.h2d_bytes == h.stats()["streamed_bytes_per_forward"] > 0 and h.last.d2h_bytes == 0
        assert devices and set(devices) == {"cuda"}
    finally:
        hook.remove()
        h.remove()
    assert all(p.device.type == "cpu" for p in m.parameters())


def _alias(t: torch.Tensor) -> torch.Tensor:
    """A new tensor object on ``t``'s memory (not a view: no ``_base`` keeping ``t`` alive)."""
    return torch.empty(0, dtype=t.dtype).set_(t.untyped_storage(), t.storage_offset(), t.shape, t.stride())


def test_giving_back_a_copy_of_wrapped_weights_frees_each_segment(monkeypatch):
    """A store reused across runs (the ComfyUI bridge's) keeps the engine's handle on each wrapper around host
    copies (``_Wrapped.host``) after a run: restoring must let go of those too, or every segment stays."""
    import gc

    from torch.multiprocessing.reductions import StorageWeakRef

    from comfyui_levers.core.residency import prefetch as P
    from comfyui_levers.core.residency.blocks import find_blocks

    monkeypatch.setattr(P, "SEGMENT_BYTES", 1)
    m = _model()
    x = wan_inputs()
    with torch.no_grad():
        ref = m(*x)
    tr = CpuTransport()
    layout = find_blocks(m)
    store = P.HostStore(layout.blocks, tr)
    h = apply_group_prefetch(m, PrefetchConfig(1, 1, 0, BIG, partial_blocks=False), tr, bandwidth=0,
                             store=store, layout=layout)
    with torch.no_grad():
        m(*x)
    h.remove()
    assert any(w.host is not None for w in store.wrapped)
    for mod in m.modules():      # the owner rebuilds its wrappers around the same host memory (ComfyUI's fp8 layers)
        q = mod._parameters.get("weight")
        if type(q) is Fp8Wrapper:
            new = Fp8Wrapper(*(_alias(t) for t in (q._qdata, q._scale)))
            new._is_param = True
            mod._parameters["weight"] = new
    del q, new
    storages = [StorageWeakRef(s.untyped_storage()) for a in store.arenas.values() for s in a.tensors()]
    store.restore(tr)
    del h
    gc.collect()
    assert all(w.expired() for w in storages)
    with torch.no_grad():
        assert torch.equal(m(*x), ref)
