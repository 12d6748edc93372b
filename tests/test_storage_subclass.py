"""Storage subclasses (ComfyUI-GGUF's GGMLTensor kind): packed bytes in the tensor's own storage, a logical shape
and other attributes on top. GroupPrefetch streams their bytes and PhaseOffload swaps them, both by pointer,
keeping the objects; a stand-in class (``prefetch_toys.PackedTensor``) plays GGMLTensor here, the real one is
checked in tests/integration/test_gguf.py."""
from __future__ import annotations

import torch
from torch import nn

from comfyui_levers.core.residency import subclass
from comfyui_levers.core.residency.phase import MasterTable, swap_module_to
from comfyui_levers.core.residency.prefetch import PrefetchConfig, apply_group_prefetch
from comfyui_levers.core.residency.transport import CpuTransport, RecordingTransport
from prefetch_toys import PackedLinear, PackedTensor, make_wan, pack_linears, wan_inputs

BIG = 10 ** 9


def _packed(m):
    return {n: p for n, p in m.named_parameters() if isinstance(p, PackedTensor)}


def _packed_wan(n):
    """A toy Wan whose block linears hold PackedTensor weights: (model, inputs, output, its packed weights)."""
    m = pack_linears(make_wan(n=n))
    x, t = wan_inputs()
    with torch.no_grad():
        ref = m(x, t)
    return m, (x, t), ref, _packed(m)


def test_storage_subclasses_are_told_from_plain_wrapper_and_bitsandbytes_tensors():
    w = PackedTensor.pack(torch.randn(4, 8))
    assert subclass.is_storage(w) and subclass.is_storage(nn.Parameter(w, requires_grad=False))
    assert w.shape == (4, 8) and subclass.plain(w).shape == (4, 32) and type(subclass.plain(w)) is torch.Tensor
    assert subclass.plain(w).data_ptr() == w.data_ptr()
    assert subclass.nbytes(w) == 4 * 32
    assert not subclass.is_storage(torch.randn(3)) and not subclass.is_storage(nn.Parameter(torch.randn(3)))
    from test_prefetch_subclass import Fp8Wrapper

    wrapper = Fp8Wrapper(torch.randn(4, 8).to(torch.float8_e4m3fn), torch.tensor(1.0))
    assert not subclass.is_storage(wrapper)          # a wrapper subclass: flatten protocol, own dispatch

    class WithState(torch.Tensor):               # bitsandbytes' Params4bit keeps its absmax beside the data
        pass
    q = torch.zeros(8, dtype=torch.uint8).as_subclass(WithState)
    q.quant_state = object()
    assert not subclass.is_storage(q)

    class WithScale(torch.Tensor):               # a scale kept as an attribute would stay behind when the data moves
        pass
    s = torch.zeros(8, dtype=torch.int8).as_subclass(WithScale)
    s.scale = torch.ones(())
    assert not subclass.is_storage(s)
    assert not subclass.is_storage(nn.parameter.UninitializedParameter())
    moved = subclass.like(w, torch.zeros(4, 32, dtype=torch.uint8))
    assert type(moved) is PackedTensor and moved.shape == (4, 8) and moved.patches == w.patches


def test_group_prefetch_streams_packed_bytes_from_the_slots_bit_identical():
    m, (x, t), ref, own = _packed_wan(6)
    tr = RecordingTransport(CpuTransport())
    h = apply_group_prefetch(m, PrefetchConfig(1, 1, 0, BIG, partial_blocks=False), tr, bandwidth=0)
    try:
        assert not h.store.kept, h.store.kept                      # nothing left resident as "a subclass"
        assert torch.uint8 in h.store.arenas
        layers = [mod for mod in m.modules() if isinstance(mod, PackedLinear)]
        with torch.no_grad():
            m(x, t)                       # warm-up: from here each forward finds its first group prefetched
            for _ in range(3):
                for mod in layers:
                    mod.reads.clear()
                assert torch.equal(m(x, t), ref)
                assert h.last.h2d_bytes == sum(g.nbytes for g in h.groups) and h.last.misses == 0
                slots = [(s.buffer.data_ptr(), s.buffer.data_ptr() + s.buffer.numel()) for s in h.slots]
                assert all(any(lo <= p < hi for lo, hi in slots) for mod in layers for p in mod.reads)
                now = _packed(m)
                assert all(now[n] is own[n] and now[n].shape == own[n].logical_shape for n in own)
    finally:
        h.remove()
    with torch.no_grad():
        assert torch.equal(m(x, t), ref)
    assert all(_packed(m)[n] is own[n] for n in own)


def test_phase_offload_swaps_packed_bytes_and_keeps_the_objects():
    m, (x, t), ref, own = _packed_wan(3)
    home = {n: p.data_ptr() for n, p in own.items()}
    tr = RecordingTransport(CpuTransport())
    table = MasterTable(m, "dit", tr)
    table.capture()
    with swap_module_to(table, torch.device("cuda", 0), torch.device("cpu")), torch.no_grad():
        for _ in range(2):
            m.to("cuda:0")               # a label: the seam copies through the CPU transport
            assert all(own[n].data_ptr() != home[n] for n in own), "the packed bytes were copied in"
            assert torch.equal(m(x, t), ref)
            m.to("cpu")
            assert {n: p.data_ptr() for n, p in _packed(m).items()} == home
            assert all(_packed(m)[n] is own[n] and own[n].shape == own[n].logical_shape for n in own)
    assert tr.ledger.d2h_bytes == 0
    total = sum(subclass.nbytes(p) for p in {id(p): p for p in [*m.parameters(), *m.buffers()]}.values())
    assert tr.ledger.h2d_bytes == 2 * total
