"""MasterTable + swap_module_to: the seam ComfyUI's own ``Module.to`` calls go through.

The "device" here is a label: the CPU transport makes the copies, so ``.to("cuda:0")`` is
intercepted and never reaches torch. Pointer identity means the same thing as on a GPU.
"""
from __future__ import annotations

import torch
from torch import nn

from comfyui_levers.core.residency.phase import MasterTable, swap_module_to
from comfyui_levers.core.residency.transport import CpuTransport, RecordingTransport

DEV = torch.device("cuda", 0)   # never touched: every tensor has a master, so the table handles all
CPU = torch.device("cpu")


def _model():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 16, bias=False))
    m[3].weight = m[0].weight                                # tied, as text encoders do
    m.register_buffer("scale", torch.full((16,), 0.5))
    return m.eval()


def _table(m):
    tr = RecordingTransport(CpuTransport())
    t = MasterTable(m, "dit", tr)
    t.capture()
    return t, tr


def _ptrs(m):
    return {n: t.data_ptr() for n, t in [*m.named_parameters(remove_duplicate=False), *m.named_buffers()]}


def test_whole_module_round_trip_is_a_copy_in_and_a_pointer_swap_out():
    m = _model()
    ids = torch.tensor([[1, 2, 3]])
    want = m(ids) * m.scale
    home = _ptrs(m)
    table, tr = _table(m)
    moves = []
    with swap_module_to(table, DEV, CPU, on_move=lambda *a: moves.append(a)):
        for _ in range(3):
            m.to(DEV)
            assert all(_ptrs(m)[n] != p for n, p in home.items())
            assert m[3].weight is m[0].weight                 # tied stays tied
            assert torch.equal(m(ids) * m.scale, want)
            m.to(CPU)
            assert _ptrs(m) == home                           # pointer swap back to the masters
    assert tr.ledger.d2h_bytes == 0
    total = sum(t.nbytes for t in {t.data_ptr(): t for t in [*m.parameters(), *m.buffers()]}.values())
    assert tr.ledger.h2d_bytes == 3 * total
    assert [mv[0] for mv in moves] == ["onload", "offload"] * 3
    assert all(mv[2] == total for mv in moves if mv[0] == "offload")
    assert not any("to" in mod.__dict__ for mod in m.modules())     # the seam is gone


def test_per_module_moves_touch_only_that_module():
    m = _model()
    table, tr = _table(m)
    with swap_module_to(table, DEV, CPU):
        m[1].to(DEV)
        assert tr.ledger.h2d_bytes == m[1].weight.nbytes + m[1].bias.nbytes
        assert m[2].weight.data_ptr() == table.masters["2.weight"].host.data_ptr()
        m[1].to(CPU)
    assert m[1].weight.data_ptr() == table.masters["1.weight"].host.data_ptr()
    assert tr.ledger.d2h_bytes == 0


def test_weights_the_manager_patched_are_left_to_its_own_copy():
    m = _model()
    table, _ = _table(m)
    backup = m[1].weight                                     # ComfyUI keeps the original as its backup
    # ComfyUI's LoRA path, in its order: patch first (a new Parameter), then move the module
    m[1].weight = nn.Parameter(backup.detach() + 1.0, requires_grad=False)
    moved, left = table.onload(m, DEV)
    assert left == 1                                         # the patched weight is ComfyUI's to move
    assert backup.data_ptr() == table.masters["1.weight"].host.data_ptr()
    with torch.no_grad():
        m[2].weight.add_(1.0)                                # an in-place patch on our device copy
    patched_1, patched_2 = m[1].weight.data_ptr(), m[2].weight.data_ptr()
    swapped, _ = table.offload(m)
    assert m[1].weight.data_ptr() == patched_1               # never swapped to a stale master
    assert m[2].weight.data_ptr() == patched_2
    assert m[0].weight.data_ptr() == table.masters["0.weight"].host.data_ptr()
    assert swapped == moved - m[2].weight.nbytes
    # ComfyUI restores its backup; the next load keeps that master and adopts the patched one
    m[1].weight = nn.Parameter(backup, requires_grad=False)
    assert table.capture() == 1
    assert table.masters["2.weight"].host.data_ptr() == patched_2
    assert table.masters["1.weight"].host.data_ptr() == backup.data_ptr()


def test_non_device_to_calls_pass_through():
    m = _model()
    table, tr = _table(m)
    with swap_module_to(table, DEV, CPU):
        m.to(torch.float64)
    assert m[1].weight.dtype == torch.float64 and tr.ledger.h2d_bytes == 0


def test_same_load_and_offload_device_is_left_alone():
    m = _model()
    table, tr = _table(m)
    with swap_module_to(table, CPU, CPU):
        m.to(CPU)
    assert tr.ledger.h2d_bytes == 0 and _ptrs(m)["1.weight"] == table.masters["1.weight"].host.data_ptr()


def test_a_parameter_rewrapped_around_our_device_copy_is_still_swapped_back():
    """ComfyUI's mixed-precision layers (QuantizedTensor weights, which have no master, so the real Module.to runs)
    re-wrap every parameter in a new Parameter in ``_apply``, sharing the storage our copy put there. Offload is
    still a pointer swap for those (it was refused, and ComfyUI copied the untouched bias back device->host);
    a new tensor in the slot is not swapped."""
    lin = nn.Linear(4, 4)
    t, tr = _table(lin)
    master_b, master_w = t.masters["bias"].host, t.masters["weight"].host
    t.onload(lin, CPU)
    assert lin.bias.data_ptr() != master_b.data_ptr()
    for k, p in list(lin._parameters.items()):              # what MixedPrecisionOps._apply does
        lin.register_parameter(k, nn.Parameter(p.to(CPU), requires_grad=False))
    lin.weight = nn.Parameter(lin.weight.detach().clone(), requires_grad=False)   # really new memory
    swapped, left = t.offload(lin)
    assert lin.bias.data_ptr() == master_b.data_ptr() and swapped == master_b.nbytes
    assert lin.weight.data_ptr() != master_w.data_ptr()     # not ours: left alone


def test_an_onload_that_fails_part_way_still_orders_compute_after_the_copies_it_issued():
    """An allocation failing part way through an onload (out of memory): the copies already issued are in
    flight, and ComfyUI will move the weights back and free them. Compute must wait for those copies first."""
    import pytest

    m = _model()
    t, tr = _table(m)
    real_empty, count = tr.empty, {"n": 0}

    def empty(shape, dtype):
        count["n"] += 1
        if count["n"] == 3:
            raise torch.OutOfMemoryError("stand-in: out of memory on the third weight")
        return real_empty(shape, dtype)
    tr.empty = empty
    with pytest.raises(torch.OutOfMemoryError):
        t.onload(m, CPU)
    kinds = [(o.kind, o.tag) for o in tr.ops]
    last_copy = max(i for i, (k, _) in enumerate(kinds) if k == "h2d")
    assert ("record", "onload:dit") in kinds[last_copy:] and ("wait", "onload:dit") in kinds[last_copy:], kinds


def test_wrapper_subclass_weights_move_by_object_and_swap_back():
    """fp8 weights held as a wrapper subclass (ComfyUI's QuantizedTensor) fix their device when built: the load
    puts a device wrapper around copies of the codes and scale in the weight's slot, the unload puts the
    module's own wrapper back (no copy), tied twins included."""
    from test_prefetch_subclass import Fp8Wrapper

    m = _model()
    w = m[1].weight.detach()
    scale = (w.abs().amax() / 448.0).reshape(())
    q = Fp8Wrapper((w / scale).to(torch.float8_e4m3fn), scale)
    q._is_param = True
    m[1]._parameters["weight"] = q
    ids = torch.tensor([[1, 2, 3]])
    want = m(ids) * m.scale
    table, tr = _table(m)
    assert set(table.wrapped) == {"1.weight"}
    fp8_bytes = q._qdata.nbytes + q._scale.nbytes
    with swap_module_to(table, DEV, CPU):
        for _ in range(2):
            m.to(DEV)
            on_device = m[1].weight
            assert type(on_device) is Fp8Wrapper and on_device is not q
            assert on_device._qdata.data_ptr() != q._qdata.data_ptr()
            assert torch.equal(m(ids) * m.scale, want)
            m.to(CPU)
            assert m[1].weight is q                              # the module's own wrapper, back
    assert tr.ledger.d2h_bytes == 0
    assert table.wrapped["1.weight"].dev is None                # no device copy kept alive after the unload
    assert table.swapped_bytes >= 2 * fp8_bytes


def test_a_device_wrapper_written_into_is_not_kept_after_the_unload():
    """Something wrote into our device copy: the swap back is refused (the real Module.to brings the weight home),
    and the table must not keep the device wrapper alive (on a GPU: its memory through the next phases)."""
    from test_prefetch_subclass import Fp8Wrapper

    m = _model()
    w = m[1].weight.detach()
    q = Fp8Wrapper(w.to(torch.float8_e4m3fn), torch.tensor(1.0))
    q._is_param = True
    m[1]._parameters["weight"] = q
    table, _ = _table(m)
    with swap_module_to(table, CPU, torch.device("meta")):
        m.to(CPU)
        m[1].weight._scale.mul_(1.0)            # the version moves
        try:
            m.to("meta")                        # ComfyUI's own copy takes it from here
        except Exception:                       # noqa: BLE001 - the toy wrapper cannot go to meta; not the point
            pass
    assert table.wrapped["1.weight"].dev is None
    # the swap back was refused: the module does not hold the host master again (found by mutation testing: with
    # the version check off, the stale master came back and the assert above still held)
    assert m[1].weight is not table.wrapped["1.weight"].host


def test_a_wrapper_put_in_place_since_the_capture_is_adopted_at_load():
    """ComfyUI restores a LoRA backup as a new wrapper object while the model stays loaded; the next load moves it
    by object too instead of leaving it to ComfyUI's copy (and its unload to a device->host copy)."""
    from test_prefetch_subclass import Fp8Wrapper

    m = _model()
    q = Fp8Wrapper(m[1].weight.detach().to(torch.float8_e4m3fn), torch.tensor(1.0))
    q._is_param = True
    m[1]._parameters["weight"] = q
    table, _ = _table(m)
    fresh = Fp8Wrapper(q._qdata.clone(), q._scale.clone())
    fresh._is_param = True
    m[1]._parameters["weight"] = fresh           # no capture in between
    with swap_module_to(table, DEV, CPU):
        m.to(DEV)
        assert m[1].weight is not fresh and table.wrapped["1.weight"].host is fresh
        m.to(CPU)
        assert m[1].weight is fresh


def test_read_only_weights_are_rebound_to_pinned_copies_at_capture(read_only):
    """A GGUF file's or ComfyUI 0.33's memory-mapped weights sit in a read-only mapping that cannot be
    page-locked: at capture the store copies them, and the module's tensors (the same objects, tied ones too, and
    the inner tensors of a wrapper weight) are rebound to the copies, which are then the masters."""
    from test_prefetch_subclass import Fp8Wrapper

    from comfyui_levers.core.residency.pinned import GIB, PinnedStore
    from comfyui_levers.core.residency.transport import HostMaps, PinResult

    class Pinning(CpuTransport):
        pinned: list[int] = []

        def pin(self, t):
            self.pinned.append(t.data_ptr())
            return PinResult(True, "pinned in place", t.nbytes)

    m = _model()
    w = m[1].weight.detach()
    scale = (w.abs().amax() / 448.0).reshape(())
    q = Fp8Wrapper(read_only((w / scale).to(torch.float8_e4m3fn)), scale)
    q._is_param = True
    m[1]._parameters["weight"] = q
    m[0].weight.data = read_only(m[0].weight.data)            # tied to m[3].weight
    emb = m[0].weight
    ids = torch.tensor([[1, 2, 3]])
    want = m(ids) * m.scale
    inner = RecordingTransport(Pinning())
    store = PinnedStore(inner, "auto", has_cuda=True, available_ram_bytes=64 * GIB, total_ram_bytes=128 * GIB,
                        os_name="linux")
    table = MasterTable(m, "dit", inner, store)
    table.capture()
    out = table.pin_outcome
    assert out.pinned and out.copied_bytes == emb.nbytes + q._qdata.nbytes
    maps = HostMaps.read()
    assert m[0].weight is emb and m[3].weight is emb                      # same object, still tied
    assert maps.writable(emb.data_ptr(), emb.nbytes) is True
    moved = m[1].weight
    assert type(moved) is Fp8Wrapper and maps.writable(moved._qdata.data_ptr(), moved._qdata.nbytes) is True
    assert table.wrapped["1.weight"].host is moved
    assert table.masters["0.weight"].host.data_ptr() == emb.data_ptr()
    assert torch.equal(m(ids) * m.scale, want)
    assert table.capture() == 0                                           # the copies are the masters now
    with swap_module_to(table, DEV, CPU):
        m.to(DEV)
        assert torch.equal(m(ids) * m.scale, want)
        m.to(CPU)
    assert m[1].weight is moved and m[0].weight.data_ptr() == emb.data_ptr()
    assert inner.ledger.d2h_bytes == 0


def _captured_with_pinning(m: nn.Module) -> "MasterTable":
    """``m``'s master table, captured with a store that pins (in place, on the CPU) whatever it is given."""
    from comfyui_levers.core.residency.pinned import GIB, PinnedStore
    from comfyui_levers.core.residency.transport import PinResult

    class Pinning(CpuTransport):
        def pin(self, t):
            return PinResult(True, "pinned in place", t.nbytes)

    store = PinnedStore(Pinning(), "auto", has_cuda=True, available_ram_bytes=64 * GIB, total_ram_bytes=128 * GIB,
                        os_name="linux")
    table = MasterTable(m, "dit", Pinning(), store)
    table.capture()
    return table


def test_read_only_views_of_one_storage_keep_their_own_shapes_when_copied(read_only):
    """Found in review: the copies were matched to tensors by start address, so a weight and a slice of it that
    start at the same byte both became the slice, and a transposed view (no master: not contiguous) was rebound
    to the other's layout. Each tensor now gets its own view of the copy; one without a master stays as it was."""
    torch.manual_seed(0)
    m = nn.Module()
    m.a, m.b, m.head = nn.Linear(8, 8, bias=False), nn.Linear(8, 4, bias=False), nn.Linear(8, 8, bias=False)
    w = read_only(torch.randn(8, 8))
    m.a.weight = nn.Parameter(w, requires_grad=False)               # a fused weight ...
    m.b.weight = nn.Parameter(w[:4], requires_grad=False)           # ... a slice of it, same first byte
    m.head.weight = nn.Parameter(w.t(), requires_grad=False)        # ... and its transpose (not contiguous)
    x = torch.randn(2, 8)
    want = [m.a(x), m.b(x), m.head(x)]
    table = _captured_with_pinning(m)
    assert table.pin_outcome.copied_bytes == w.nbytes
    assert m.a.weight.shape == (8, 8) and m.b.weight.shape == (4, 8) and m.head.weight.stride() == (1, 8)
    assert m.b.weight.data_ptr() == m.a.weight.data_ptr() != w.data_ptr()          # tied in the copy
    assert m.head.weight.data_ptr() == w.data_ptr()                                 # no master: left as it was
    assert all(torch.equal(got, ref) for got, ref in zip([m.a(x), m.b(x), m.head(x)], want))


def test_read_only_views_with_gaps_are_rebound_to_a_packed_pinned_copy(read_only):
    """A module whose weights are views into one larger read-only mapping with gaps between them (a file holding
    other components' tensors too) stayed pageable. Its masters now move to a copy of the views alone, the module's
    tensors are rebound to it (tied slices stay tied), and the outputs do not change."""
    torch.manual_seed(0)
    blob = read_only(torch.randn(20000))
    m = nn.Module()
    m.a, m.b, m.c = nn.Linear(8, 8, bias=False), nn.Linear(8, 4, bias=False), nn.Linear(8, 8, bias=False)
    m.a.weight = nn.Parameter(blob[:64].view(8, 8), requires_grad=False)
    m.b.weight = nn.Parameter(blob[:32].view(4, 8), requires_grad=False)         # a slice of a's weight
    m.c.weight = nn.Parameter(blob[19000:19064].view(8, 8), requires_grad=False)  # far away: a gap between
    x = torch.randn(2, 8)
    want = [m.a(x), m.b(x), m.c(x)]
    table = _captured_with_pinning(m)
    out = table.pin_outcome
    assert out.pinned and out.copied_bytes < 4 * 64 * 4, out          # the views, not the 80 KB span
    ptrs = {m.a.weight.data_ptr(), m.c.weight.data_ptr()}
    assert blob.data_ptr() not in ptrs and m.b.weight.data_ptr() == m.a.weight.data_ptr()
    assert all(torch.equal(got, ref) for got, ref in zip([m.a(x), m.b(x), m.c(x)], want))


def test_an_onload_waits_for_compute_before_its_first_copy():
    """Found by mutation testing: without the wait, on CUDA the copy stream may write memory that earlier compute
    still reads."""
    m = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    tr = RecordingTransport(CpuTransport())
    t = MasterTable(m, "dit", tr)
    t.capture()
    start = len(tr.ops)
    moved, _ = t.onload(m, torch.device("cuda", 0))
    ops = tr.ops[start:]
    first_copy = next(i for i, op in enumerate(ops) if op.kind == "h2d")
    assert moved and any(op.kind == "wait_compute" for op in ops[:first_copy])


class _Params4bit(nn.Parameter):
    """bitsandbytes' shape of a 4-bit weight: the packed data, with its quantization state beside it (moved only
    by the parameter's own ``.to``)."""

    quant_state: torch.Tensor


def test_a_bitsandbytes_weight_is_left_to_its_own_move():
    """Found in review: the ComfyUI path's master table took a bitsandbytes Params4bit as a plain master, so the
    swap moved its data and left its quantization state (absmax) on the host. It is left to the manager's move
    (the parameter's own ``.to`` runs there); the rest of the module still moves by the table."""
    m = _model()
    w = _Params4bit(torch.randint(0, 255, (32, 1), dtype=torch.uint8), requires_grad=False)
    w.quant_state = torch.rand(4)
    m[1]._parameters["weight"] = w
    table, tr = _table(m)
    assert "1.weight" not in table.masters and "1.bias" in table.masters
    home = w.data_ptr()
    moved, left = table.onload(m, DEV)
    assert left == 1 and m[1].weight is w and w.data_ptr() == home       # untouched: the manager moves it
    assert m[1].bias.data_ptr() != table.masters["1.bias"].host.data_ptr() and moved > 0


def test_let_go_forgets_masters_and_frees_masters_pointing_into_memory_about_to_go():
    """GroupPrefetch is about to take over some tensors' host memory: their masters are forgotten (so the memory can
    go as the copy takes its place), a master pointing into memory about to be freed gets its own (with the tensor
    still bound to it), and the next capture takes the tensors again from where they then live."""
    m = _model()
    t, _ = _table(m)
    arena = torch.randn(64)                          # stands in for the engine's last host copy
    with torch.no_grad():
        m[2].weight.data = arena[:8]                 # LayerNorm weight bound into it
    t.capture()
    assert t.masters["2.weight"].host.data_ptr() == arena.data_ptr()
    gone = t.let_go({"1.weight", "1.bias"}, [(arena.data_ptr(), arena.data_ptr() + arena.nbytes)])
    assert gone == 2 and "1.weight" not in t.masters and "1.bias" not in t.masters
    w = t.masters["2.weight"].host
    assert w.data_ptr() != arena.data_ptr() and torch.equal(w, arena[:8])
    assert m[2].weight.data_ptr() == w.data_ptr()    # the tensor bound to it moved with it
    with torch.no_grad():
        m[1].weight.data = m[1].weight.data.clone()  # the engine's copy takes its place
    assert t.capture() == 2 and t.masters["1.weight"].host.data_ptr() == m[1].weight.data_ptr()


def test_masters_in_memory_another_engine_owns_are_not_offered_for_pinning():
    """GroupPrefetch's host copy holds the streamed blocks' masters once PhaseOffload adopts it: whether it is
    page-locked is GroupPrefetch's decision (its pin input, its RAM rule; with packed_bf16 only the packed planes).
    The table offers the store every master but those."""
    m = _model()
    t, _ = _table(m)
    offered = []
    real = t.store.pin_component
    t.store.pin_component = lambda name, groups: offered.append(groups) or real(name, groups)
    arena = torch.randn(64)
    with torch.no_grad():
        m[1].weight.data = arena[:64].view(8, 8)
    t.foreign = lambda: [(arena.data_ptr(), arena.data_ptr() + arena.nbytes)]
    t.capture()
    names = {r.name for g in offered[-1] for r in g.refs}
    assert "1.weight" in t.masters and "1.weight" not in names and "1.bias" in names
    t.foreign = None
    t.let_go({"1.bias"})
    assert "1.weight" in {r.name for g in offered[-1] for r in g.refs}


def test_a_second_table_of_the_same_model_sends_the_firsts_device_copies_home_by_pointer():
    """Found in review: two PhaseOffload nodes on one model (two branches of a graph) keep a table each. ComfyUI
    leaves the weights on the device as the first node's copies when it switches to the second node's clone, which
    the second table did not know (on this CPU it even took them for host masters): its release was ComfyUI's copy
    into new host memory, while both tables' masters kept the old, the model twice in RAM."""
    m = _model()
    home = _ptrs(m)
    first, tr = _table(m)
    second = MasterTable(m, "dit", tr)
    second.capture()
    first.onload(m)                                           # the first node's phase
    assert all(_ptrs(m)[n] != p for n, p in home.items())
    second.capture()                                          # the second node's load finds them on the device
    swapped, left = second.offload(m)                         # ... and its release
    assert left == 0 and _ptrs(m) == home
    assert swapped == sum(t.nbytes for t in {t.data_ptr(): t for t in [*m.parameters(), *m.buffers()]}.values())
    assert all(x.dev_ptr == 0 for x in first.masters.values())    # the first table forgets the copies it made
    assert tr.ledger.d2h_bytes == 0
