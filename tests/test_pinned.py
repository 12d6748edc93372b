"""The pinned host store: seed 002's pin rule, storage grouping, fail-soft pinning, pin-once."""
from __future__ import annotations

import pytest
import torch

from comfyui_levers.core.residency import pinned
from comfyui_levers.core.residency.pinned import (GIB, PinMode, PinnedStore, arena_pin_decision, group_by_storage,
                                                  pin_decision)
from comfyui_levers.core.residency.transport import CpuTransport, PinResult


class PinningTransport(CpuTransport):
    """A CPU transport that pretends to page-lock (records what it was asked to pin)."""

    def __init__(self, fail_after: int | None = None):
        super().__init__()
        self.pinned: list[int] = []
        self.unpinned: list[int] = []
        self.fail_after = fail_after

    def pin(self, t):
        if self.fail_after is not None and len(self.pinned) >= self.fail_after:
            return PinResult(False, "simulated cudaHostRegister failure", t.nbytes)
        self.pinned.append(t.data_ptr())
        return PinResult(True, "pinned in place", t.nbytes)

    def unpin(self, t):
        self.unpinned.append(t.data_ptr())


# --- pin_decision ---------------------------------------------------------------------------------

def test_pin_decision_follows_the_ram_rule():
    ok, reason = pin_decision(4 * GIB, 8 * GIB, "linux", True)
    assert ok and "2x" in reason
    ok, reason = pin_decision(4 * GIB, 8 * GIB - 1, "linux", True)
    assert not ok and "cannot be swapped" in reason


def test_pin_decision_without_cuda_or_ram_figures():
    ok, reason = pin_decision(GIB, 64 * GIB, "linux", False)
    assert not ok and "no CUDA" in reason
    ok, reason = pin_decision(GIB, None, "linux", True)
    assert ok and "unknown" in reason
    assert not pin_decision(0, 64 * GIB, "linux", True)[0]


def test_pin_decision_os_caps():
    ok, reason = pin_decision(2 * GIB, 64 * GIB, "wsl", True)
    assert not ok and "WSL" in reason
    assert pin_decision(GIB // 2, 64 * GIB, "wsl", True)[0]
    ok, reason = pin_decision(20 * GIB, 60 * GIB, "windows", True, total_ram_bytes=32 * GIB)
    assert not ok and "Windows" in reason
    assert pin_decision(10 * GIB, 60 * GIB, "windows", True, total_ram_bytes=32 * GIB)[0]


def test_pin_decision_explicit_budget_replaces_the_ram_rule():
    ok, reason = pin_decision(4 * GIB, 5 * GIB, "linux", True, budget_bytes=6 * GIB)
    assert ok and "budget" in reason            # RAM rule alone would say no
    ok, reason = pin_decision(4 * GIB, 64 * GIB, "linux", True, budget_bytes=3 * GIB)
    assert not ok and "budget" in reason        # RAM rule alone would say yes


def test_a_streaming_arena_is_pinned_by_the_ram_rule_over_everything_levers_holds_pinned():
    """GroupPrefetch's host copy: the same rule as the plan and PhaseOffload, over the arena plus what Levers
    holds pinned already, less the pinned masters the arena takes over; read-only mapped weights become RAM."""
    ram = dict(available_ram_bytes=30 * GIB, total_ram_bytes=64 * GIB, os_name="linux")
    assert arena_pin_decision("auto", 10 * GIB, True, levers_pinned_bytes=0, **ram)[0]
    ok, why = arena_pin_decision("auto", 10 * GIB, True, levers_pinned_bytes=6 * GIB, **ram)
    assert not ok and why.startswith("pageable:") and "6.00 GiB Levers holds pinned already" in why, why
    # the 6 GiB are PhaseOffload's pinned masters of these very weights: the arena takes them over
    assert arena_pin_decision("auto", 10 * GIB, True, levers_pinned_bytes=6 * GIB, replaced_bytes=6 * GIB, **ram)[0]
    # weights read from a read-only file mapping were page cache the OS counted as available
    ok, why = arena_pin_decision("auto", 10 * GIB, True, levers_pinned_bytes=0, mapped_bytes=12 * GIB, **ram)
    assert not ok and "available RAM 18.00 GiB" in why, why
    ok, why = arena_pin_decision("auto", 2 * GIB, True, levers_pinned_bytes=0, **dict(ram, os_name="wsl"))
    assert not ok and "WSL" in why
    # on and off are the user's; without CUDA nothing DMAs from pinned memory
    assert arena_pin_decision("on", 10 * GIB, True, levers_pinned_bytes=60 * GIB, **ram) == (True, "pin = on")
    assert arena_pin_decision("off", GIB, True, **ram) == (False, "pageable: pin = off")
    ok, why = arena_pin_decision("auto", GIB, False, **ram)
    assert not ok and "no CUDA" in why
    with pytest.raises(Exception, match="pin"):
        arena_pin_decision("sometimes", GIB, True, **ram)


# --- storage groups ---------------------------------------------------------------------------------

def test_tied_and_viewed_tensors_share_one_master():
    flat = torch.arange(64, dtype=torch.float32)
    a, b = flat[:32].view(4, 8), flat[32:]
    other = torch.ones(3)
    groups = group_by_storage([("a", a), ("b", b), ("a_tied", a), ("other", other)])
    assert len(groups) == 2
    g = next(g for g in groups if len(g.refs) == 3)
    assert not g.per_tensor and g.nbytes == flat.nbytes
    for ref, t in zip(g.refs, (a, b, a)):
        v = g.host_view(ref)
        assert v.data_ptr() == t.data_ptr() and v.shape == t.shape and torch.equal(v, t)


def test_sparse_view_into_a_big_blob_is_copied_per_tensor():
    blob = torch.zeros(10_000)
    one = group_by_storage([("w", blob[100:164])])[0]      # one view: only its own span moves
    assert not one.per_tensor and one.nbytes < blob[100:164].nbytes + pinned.SPAN_ALIGN
    w, v = blob[100:164], blob[9000:9064]
    g = group_by_storage([("w", w), ("v", v)])[0]           # far apart: each view on its own
    assert g.per_tensor and g.nbytes == w.nbytes + v.nbytes


def test_masters_must_be_host_tensors():
    with pytest.raises(ValueError, match="host memory"):
        group_by_storage([("w", torch.empty(2, device="meta"))])


# --- the store -------------------------------------------------------------------------------------

def _groups(n=3, size=256):
    return group_by_storage([(f"w{i}", torch.randn(size)) for i in range(n)])


def _store(transport, mode="auto", budget=None, avail=64 * GIB):
    return PinnedStore(transport, mode, budget, available_ram_bytes=avail, total_ram_bytes=128 * GIB,
                       os_name="linux", has_cuda=True)


def test_store_pins_once_and_releases_exactly_its_own():
    tr = PinningTransport()
    store = _store(tr)
    groups = _groups()
    out = store.pin_component("dit", groups)
    assert out.pinned and len(tr.pinned) == 3 and store.pinned_bytes == sum(g.nbytes for g in groups)
    again = store.pin_component("dit", groups)
    assert again.pinned and len(tr.pinned) == 3       # pin once, never per step
    store.release("dit")
    assert sorted(tr.unpinned) == sorted(tr.pinned) and store.pinned_bytes == 0


def test_a_component_the_plan_leaves_pageable_is_never_pinned_while_the_others_are():
    tr = PinningTransport()
    store = PinnedStore(tr, "on", None, available_ram_bytes=64 * GIB, total_ram_bytes=128 * GIB, os_name="linux",
                        has_cuda=True, pageable={"diffusion_model": "pageable: the plan pins only the others"})
    dit, te = _groups(), _groups()
    out = store.pin_component("diffusion_model", dit)
    assert not out.pinned and out.reason == "pageable: the plan pins only the others" and not tr.pinned
    assert store.pin_component("text_encoder", te).pinned and len(tr.pinned) == 3
    assert store.pinned_bytes == sum(g.nbytes for g in te)


def test_the_ram_rule_counts_what_other_levers_owners_hold_pinned(monkeypatch):
    """A PhaseOffload store on auto counts the pages GroupPrefetch's host copies (or another node's masters) hold
    locked: the rule is about the process, not the store. An explicit pin budget stays the store's own."""
    from comfyui_levers.core.residency import transport as tr
    groups = _groups()
    need = sum(g.nbytes for g in groups)
    assert _store(PinningTransport(), avail=2 * need).pin_component("te", groups).pinned
    monkeypatch.setattr(tr, "_REGISTERED", {1 << 40: [need, 1]})          # an arena someone else pinned
    out = _store(PinningTransport(), avail=2 * need).pin_component("te", _groups())
    assert not out.pinned and "cannot be swapped" in out.reason, out.reason
    assert _store(PinningTransport(), budget=2 * need).pin_component("te", _groups()).pinned


def test_the_ram_rule_reads_the_ram_at_each_decision_not_when_the_store_is_made(monkeypatch):
    """A PhaseOffload store is made when the node runs; its components are pinned at their first load, after other
    models loaded (or left): the rule reads the available RAM then."""
    need = sum(g.nbytes for g in _groups())
    ram = [64 * need]
    monkeypatch.setattr(pinned, "host_memory", lambda: (ram[0], 128 * GIB))
    store = PinnedStore(PinningTransport(), "auto", os_name="linux", has_cuda=True)
    assert store.pin_component("te", _groups()).pinned
    ram[0] = 2 * need                        # a model loaded since: twice the next set no longer covers both
    out = store.pin_component("vae", _groups())
    assert not out.pinned and "cannot be swapped" in out.reason, out.reason


def test_store_fails_soft_and_rolls_back():
    tr = PinningTransport(fail_after=2)
    store = _store(tr)
    out = store.pin_component("vae", _groups())
    assert not out.pinned and "simulated" in out.reason and out.reason.startswith("pageable")
    assert sorted(tr.unpinned) == sorted(tr.pinned) and store.pinned_bytes == 0
    assert store.report()[0]["pinned"] is False
    calls = len(tr.pinned)
    again = store.pin_component("vae", _groups())           # a failed component is never retried
    assert not again.pinned and len(tr.pinned) == calls and "simulated" in again.reason


def test_store_modes_and_budget():
    g = _groups()
    need = sum(x.nbytes for x in g)
    assert not _store(PinningTransport(), "off").pin_component("te", g).pinned
    low_ram = _store(PinningTransport(), "auto", avail=need)          # < 2x the set
    out = low_ram.pin_component("te", g)
    assert not out.pinned and "available RAM" in out.reason
    assert _store(PinningTransport(), "on", avail=need).pin_component("te", g).pinned
    out = _store(PinningTransport(), "on", budget=need - 1).pin_component("te", g)
    assert not out.pinned and "budget" in out.reason
    cpu_only = PinnedStore(PinningTransport(), "on", available_ram_bytes=64 * GIB, os_name="linux")
    assert not cpu_only.pin_component("te", g).pinned                # CpuTransport: nothing DMAs


def test_store_never_registers_memory_someone_else_pinned(monkeypatch):
    g = _groups()
    foreign = {g[0].host.data_ptr()}
    monkeypatch.setattr(pinned, "_is_pinned", lambda t: t.data_ptr() in foreign)
    tr = PinningTransport()
    out = _store(tr).pin_component("dit", g)
    assert out.pinned and out.already_pinned_bytes == g[0].nbytes
    assert g[0].host.data_ptr() not in tr.pinned and len(tr.pinned) == 2


def test_restage_unpins_masters_that_are_gone():
    tr = PinningTransport()
    store = _store(tr)
    first = _groups(2)
    store.pin_component("dit", first)
    second = [first[0]] + _groups(1)
    store.pin_component("dit", second)
    assert tr.unpinned == [first[1].host.data_ptr()] and len(tr.pinned) == 3


def test_pin_mode_parse_names_the_field():
    assert PinMode.parse("ON") is PinMode.ON
    with pytest.raises(ValueError, match="pin"):
        PinMode.parse("sometimes", "pin")


@pytest.mark.parametrize("packed", [False, True], ids=["as_stored", "packed"])
def test_a_dropped_prefetch_store_unpins_what_it_pinned(packed):
    """ComfyUI drops a model (another checkpoint, a cleared cache) without telling anyone, and GroupPrefetch's
    store goes with it: whatever the store page-locked (arenas, packed planes) is unregistered then, not left
    locked for the life of the process. An explicit unpin first is not repeated by the finalizer."""
    import gc

    from comfyui_levers.core.residency.blocks import find_blocks
    from comfyui_levers.core.residency.prefetch import HostStore
    from prefetch_toys import make_wan

    tr = PinningTransport()
    model = make_wan(n=4, mixed=True).to(torch.bfloat16)
    store = HostStore(find_blocks(model).blocks, tr, packed=packed)
    assert tr.pinned and not tr.unpinned and store.pinned_bytes > 0
    pinned = sorted(tr.pinned)
    del store
    gc.collect()
    assert sorted(tr.unpinned) == pinned

    tr2 = PinningTransport()
    store = HostStore(find_blocks(model).blocks, tr2, packed=packed)
    store.unpin(tr2)
    assert sorted(tr2.unpinned) == sorted(tr2.pinned) and store.pinned_bytes == 0
    del store
    gc.collect()
    assert sorted(tr2.unpinned) == sorted(tr2.pinned)        # nothing unpinned twice


# --- read-only memory (GGUF files, ComfyUI 0.33's memory-mapped loader) ----------------------------------------

def test_host_maps_tell_read_only_file_mappings_from_writable_memory(read_only, tmp_path):
    from comfyui_levers.core.residency.transport import HostMaps

    ro, rw = read_only(torch.randn(4096)), torch.randn(4096)
    maps = HostMaps.read()
    assert maps.writable(ro.data_ptr(), ro.nbytes) is False
    assert maps.writable(rw.data_ptr(), rw.nbytes) is True
    # a range that runs into a hole, and mappings that cannot be read, are "unknown", never "writable"
    fake = tmp_path / "maps"
    fake.write_text("1000-2000 rw-p 00000000 00:00 0\n2000-3000 r--s 00000000 08:01 12 /models/x.gguf\n"
                    "4000-5000 rw-p 00000000 00:00 0 [heap]\n")
    m = HostMaps.read(str(fake))
    assert m.writable(0x1000, 0x1000) is True and m.writable(0x1800, 0x1000) is False
    assert m.writable(0x4800, 0x100) is True and m.writable(0x3800, 0x1000) is None
    assert HostMaps.read(str(tmp_path / "absent")).writable(0x1000, 1) is None


def test_host_maps_count_a_files_unwritten_pages_as_page_cache(read_only, tmp_path):
    """Found in review: a private writable file mapping (``torch.load(mmap=True)``, safetensors' tensors kept as
    loaded) was counted as memory the process holds, like anonymous RAM, although its unwritten pages are page cache
    the OS counts as available: Recommend added them back to the available RAM (counted twice) and GroupPrefetch's
    pin rule took them for free RAM. Now a file mapping's pages are page cache unless written (smaps' Anonymous)."""
    from comfyui_levers.core.residency.transport import HostMaps

    n = 1 << 22
    torch.save({"w": torch.randn(n // 4)}, tmp_path / "w.pt")
    mm = torch.load(tmp_path / "w.pt", mmap=True, weights_only=True)["w"]
    ro, anon = read_only(torch.randn(4096)), torch.randn(4096)
    maps = HostMaps.read()
    assert maps.writable(mm.data_ptr(), n) is True                     # writable: it may be pinned in place
    assert maps.page_cache(mm.data_ptr(), n) == n
    assert maps.page_cache(ro.data_ptr(), ro.nbytes) == ro.nbytes
    assert maps.page_cache(anon.data_ptr(), anon.nbytes) == 0
    mm.add_(1.0)                                                       # written: the pages are this process's now
    assert HostMaps.read().page_cache(mm.data_ptr(), n) < n // 50
    # the parsing, on a stand-in: a shared file mapping is all page cache, a private one less its written pages
    # (spread over the mapping), anonymous memory none, and an unreadable smaps counts a private mapping as written
    (tmp_path / "maps").write_text("1000-3000 r--s 00000000 08:01 12 /models/x.gguf\n"
                                   "3000-7000 rw-p 00000000 08:01 13 /models/y.pt\n"
                                   "7000-9000 rw-p 00000000 00:00 0\n")
    (tmp_path / "smaps").write_text("1000-3000 r--s 00000000 08:01 12 /models/x.gguf\nSize: 8 kB\nAnonymous: 0 kB\n"
                                    "3000-7000 rw-p 00000000 08:01 13 /models/y.pt\nSize: 16 kB\nAnonymous: 4 kB\n"
                                    "VmFlags: rd wr mr mw me ac\n7000-9000 rw-p 00000000 00:00 0\nAnonymous: 8 kB\n")
    m = HostMaps.read(str(tmp_path / "maps"))
    assert m.page_cache(0x1000, 0x2000) == 0x2000 and m.page_cache(0x7000, 0x2000) == 0
    assert m.page_cache(0x3000, 0x4000) == 0x3000 and m.page_cache(0x2000, 0x3000) == 0x1000 + 0x1800
    (tmp_path / "smaps").unlink()
    assert HostMaps.read(str(tmp_path / "maps")).page_cache(0x3000, 0x4000) == 0
    assert HostMaps.read(str(tmp_path / "absent")).page_cache(0x1000, 0x100) == 0


def test_read_only_groups_are_copied_into_writable_memory_before_pinning(read_only):
    from comfyui_levers.core.residency.transport import HostMaps

    values = [torch.randn(256), torch.randn(300), torch.randn(128)]
    tensors = [read_only(values[0]), values[1], read_only(values[2])]
    groups = group_by_storage([(f"w{i}", t) for i, t in enumerate(tensors)])
    tr = PinningTransport()
    out = _store(tr).pin_component("dit", groups)
    assert out.pinned and sorted(out.relocated) == [0, 2]
    assert out.copied_bytes == tensors[0].nbytes + tensors[2].nbytes and "copied first" in out.reason
    maps = HostMaps.read()
    for i, g in out.relocated.items():
        assert maps.writable(g.host.data_ptr(), g.host.numel()) is True
        assert torch.equal(g.host_view(g.refs[0]), values[i])
    ro_ptrs = {tensors[0].data_ptr(), tensors[2].data_ptr()}
    assert not ro_ptrs & set(tr.pinned)                   # read-only memory is never handed to cudaHostRegister
    assert set(tr.pinned) == {out.relocated[0].host.data_ptr(), groups[1].host.data_ptr(),
                              out.relocated[2].host.data_ptr()}


@pytest.mark.parametrize("case", ["off", "no_cuda", "pin_fails"])
def test_read_only_memory_stays_the_master_when_nothing_is_pinned(read_only, case):
    """Off or no CUDA: nothing is copied. A failed pin: the copy made for it is dropped, and the component keeps
    its original memory (no relocation reported)."""
    blob = read_only(torch.randn(4096))
    tr = PinningTransport(fail_after=0 if case == "pin_fails" else None)
    store = PinnedStore(tr, "off" if case == "off" else "auto", None, available_ram_bytes=64 * GIB,
                        total_ram_bytes=128 * GIB, os_name="linux", has_cuda=case != "no_cuda")
    out = store.pin_component("dit", group_by_storage([("a", blob)]))
    assert not out.pinned and out.relocated == {} and out.copied_bytes == 0
    assert blob.data_ptr() not in tr.pinned


def test_read_only_views_with_gaps_are_copied_without_the_gaps(read_only):
    """Views into a larger read-only block (a component's tensors in a file that holds other components' tensors
    between them) stayed pageable: copying the whole block would take more RAM than the weights. Only the bytes the
    views touch are copied now, packed, each view at a whole element offset, and that copy is pinned. A slice of a
    weight stays inside the weight's range (tied)."""
    from comfyui_levers.core.residency.transport import HostMaps

    values = torch.randn(4096)
    blob = read_only(values)
    named = [("a", blob[:64]), ("a_half", blob[:32]), ("b", blob[4000:].view(8, 12)), ("c", blob[1001:1003])]
    groups = group_by_storage(named)
    assert len(groups) == 1 and groups[0].per_tensor
    tr = PinningTransport()
    out = _store(tr).pin_component("dit", groups)
    assert out.pinned and sorted(out.relocated) == [0]
    g = out.relocated[0]
    assert not g.per_tensor and g.span_start == 0
    assert (64 + 96 + 2) * 4 <= out.copied_bytes < (64 + 96 + 2) * 4 + 3 * 64     # the views, not 16 KiB
    assert set(tr.pinned) == {g.host.data_ptr()} and HostMaps.read().writable(g.host.data_ptr(), g.host.numel())
    views = {r.name: g.host_view(r) for r in g.refs}
    assert torch.equal(views["a"], values[:64]) and torch.equal(views["b"], values[4000:].view(8, 12))
    assert torch.equal(views["c"], values[1001:1003]) and views["a_half"].data_ptr() == views["a"].data_ptr()
    # any old offset of a kept byte is found in the copy; a byte of a gap is not
    assert g.translate(4000 * 4) == views["b"].data_ptr() - g.host.data_ptr()
    with pytest.raises(KeyError):
        g.translate(2000 * 4)


def test_pin_in_place_refuses_read_only_memory_and_consumes_the_error_a_failed_register_leaves(read_only,
                                                                                           monkeypatch):
    from comfyui_levers.core.residency import transport

    calls, discarded = [], []

    class Cudart:
        def cudaHostRegister(self, ptr, nbytes, flags):
            calls.append(ptr)
            return 1                                        # cudaErrorInvalidValue

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: Cudart())
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: False)
    monkeypatch.setattr(transport, "discard_pending_cuda_error", lambda: discarded.append(1))
    ro = read_only(torch.randn(1024))
    res = transport.pin_in_place(ro)
    assert not res.pinned and "read-only" in res.reason and calls == [] and discarded == []
    rw = torch.randn(1024)
    res = transport.pin_in_place(rw)
    assert not res.pinned and "CUDA error 1" in res.reason
    assert calls == [rw.data_ptr()] and discarded == [1]    # the stale error is taken before torch trips on it


def test_the_ram_rule_counts_the_copies_of_read_only_memory(read_only):
    """Found in review: copies of read-only memory are new, unswappable RAM (the file's pages were reclaimable), but
    the RAM rule was applied before they were made: 2x cover became 1x. With RAM for exactly twice the pinned set,
    ordinary memory pins and read-only memory (which needs its copy first) does not."""
    n = 1 << 16
    for make, pins in ((lambda t: t, True), (read_only, False)):
        tr = PinningTransport()
        store = PinnedStore(tr, "auto", None, available_ram_bytes=2 * 4 * n, total_ram_bytes=128 * GIB,
                            os_name="linux", has_cuda=True)
        out = store.pin_component("dit", group_by_storage([("w", make(torch.randn(n)))]))
        assert out.pinned is pins and (out.copied_bytes == 0 if not pins else True)
        if not pins:
            assert "pageable" in out.reason and tr.pinned == []


def test_a_released_component_no_longer_holds_its_copies(read_only):
    store = _store(PinningTransport())
    store.pin_component("dit", group_by_storage([("w", read_only(torch.randn(256)))]))
    assert store.outcomes["dit"].relocated
    store.release("dit")
    assert store.outcomes["dit"].relocated == {} and store.outcomes["dit"].copied_bytes > 0


def test_a_cached_read_only_answer_is_checked_again_before_refusing(monkeypatch):
    """Found in review: a read-only range unmapped and replaced by fresh memory within the cache's 2 s was refused
    (and a refused component is never retried). Only a cached "writable" is trusted now."""
    from comfyui_levers.core.residency import transport

    rw = torch.randn(1024)
    lo, hi = rw.data_ptr(), rw.data_ptr() + rw.nbytes
    stale = transport.HostMaps([(lo - 4096, hi + 4096, False)])            # an old reading: read-only there
    monkeypatch.setattr(transport, "_MAPS", (transport.time.monotonic(), stale))
    registered = []

    class Cudart:
        def cudaHostRegister(self, ptr, nbytes, flags):
            registered.append(ptr)
            return 0

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: Cudart())
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: False)
    res = transport.pin_in_place(rw)
    assert res.pinned and registered == [rw.data_ptr()]
    monkeypatch.setattr(Cudart, "cudaHostUnregister", lambda self, ptr: 0, raising=False)
    transport.unpin_in_place(rw)
    assert not transport.pinned_by_levers(rw)


class FakeDriver:
    """cudaHostRegister / Unregister and Tensor.is_pinned over one registry, as the CUDA driver keeps it."""

    def __init__(self):
        self.ranges: dict[int, int] = {}        # start -> nbytes
        self.unregistered: list[int] = []

    def cudaHostRegister(self, ptr, nbytes, flags):
        if any(s < ptr + nbytes and ptr < s + n for s, n in self.ranges.items()):
            return 712                          # cudaErrorHostMemoryAlreadyRegistered
        self.ranges[ptr] = nbytes
        return 0

    def cudaHostUnregister(self, ptr):
        self.unregistered.append(ptr)
        return 0 if self.ranges.pop(ptr, None) is not None else 713

    def is_pinned(self, t) -> bool:
        p = t.data_ptr()
        return any(s <= p < s + n for s, n in self.ranges.items())


@pytest.fixture
def driver(monkeypatch):
    from comfyui_levers.core.residency import transport

    d = FakeDriver()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: d)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: d.is_pinned(self))
    monkeypatch.setattr(transport, "_REGISTERED", {})
    monkeypatch.setattr(transport, "_STARTS", [], raising=False)
    return d


def test_two_stores_on_the_same_memory_each_hold_its_pinning(driver):
    """Found in review: PhaseOffload re-run on a cached model (a widget changed) built a second store that found the
    masters page-locked by the first and counted them as ComfyUI's; when ComfyUI dropped the old node output, the
    first store's unpin unregistered the memory, and the second went on reporting it pinned while every copy ran
    pageable. Now the second store takes a use of the range: the memory stays pinned until both let go."""
    from comfyui_levers.core.residency.transport import CudaTransport, pinned_by_levers

    class Transport(CudaTransport):       # only pinning is real here: the CPU has nothing to copy to
        def __init__(self):
            pass

        def synchronize(self):
            pass

    w = torch.randn(4096)
    first, second = (PinnedStore(Transport(), "on", None, has_cuda=True) for _ in range(2))
    assert first.pin_component("dit", group_by_storage([("w", w)])).reason == "pinned in place"
    out = second.pin_component("dit", group_by_storage([("w", w)]))
    assert out.pinned and out.already_pinned_bytes == 0 and "shared with another Levers node" in out.reason
    first.unpin_all()                                   # the old node output is collected
    assert driver.unregistered == [] and w.is_pinned() and pinned_by_levers(w)
    second.unpin_all()
    assert driver.unregistered == [w.data_ptr()] and not w.is_pinned() and not pinned_by_levers(w)


def test_a_pin_inside_a_levers_range_takes_a_use_and_memory_comfyui_pinned_is_never_unregistered(driver):
    from comfyui_levers.core.residency import transport

    arena = torch.randn(1024)
    assert transport.pin_in_place(arena).reason == "pinned in place"
    half = arena[512:]
    assert transport.pin_in_place(half).reason == "already pinned by Levers"
    transport.unpin_in_place(arena)
    assert driver.unregistered == [] and half.is_pinned()
    transport.unpin_in_place(half)
    assert driver.unregistered == [arena.data_ptr()]
    comfy = torch.randn(256)
    driver.ranges[comfy.data_ptr()] = comfy.nbytes      # page-locked by ComfyUI, not by Levers
    assert transport.pin_in_place(comfy).reason.startswith("already pinned (by ComfyUI")
    transport.unpin_in_place(comfy)
    assert driver.unregistered == [arena.data_ptr()] and comfy.is_pinned()


def test_views_sharing_a_start_are_one_pinned_range_given_back_once(driver):
    """Found in review: a sparse group with a weight and a slice of it from the same start (tied weights) made two
    pieces at one address; counted uses then took two and gave one back, leaving the range registered for good."""
    from comfyui_levers.core.residency.transport import CudaTransport, pinned_by_levers

    class Transport(CudaTransport):
        def __init__(self):
            pass

        def synchronize(self):
            pass

    blob = torch.randn(1 << 16)                         # a file-like blob: far more bytes than the views use
    views = [("w", blob[:1024]), ("w_head", blob[:256]), ("w_tail", blob[512:1024]), ("b", blob[60000:60512])]
    for order in (views, views[::-1]):
        groups = group_by_storage(order)
        assert any(g.per_tensor for g in groups)
        store = PinnedStore(Transport(), "on", None, has_cuda=True)
        assert store.pin_component("dit", groups).pinned
        assert sorted(driver.ranges.values()) == [512 * 4, 1024 * 4]       # w (with its slices) and b
        store.unpin_all()
        assert driver.ranges == {} and not pinned_by_levers(blob[:1024])


def test_an_explicit_pin_budget_holds_over_all_components():
    """Found by mutation testing: with pin = on the budget was checked against each component alone, so the store
    could page-lock more than the user allowed in total."""
    first, second = _groups(), _groups()
    need = sum(t.nbytes for t in first)
    store = _store(PinningTransport(), "on", budget=need + need // 2)
    assert store.pin_component("te", first).pinned
    out = store.pin_component("vae", second)
    assert not out.pinned and "budget" in out.reason and store.pinned_bytes <= need + need // 2
