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


def test_memory_two_components_share_stays_pinned_until_the_last_lets_go():
    """Found in review: QuantizeDiT's copy shares the input's unquantized tensors, and both are masters in one store.
    The second component's pin found the ranges registered and took no record of them: releasing the first
    unregistered memory the second still copied from (pageable from then on, while its outcome said pinned)."""
    tr = PinningTransport()
    store = _store(tr)
    shared, own = torch.randn(256), torch.randn(256)
    store.pin_component("diffusion_model", group_by_storage([("norm", shared)]))
    out = store.pin_component("diffusion_model (joined 1)", group_by_storage([("norm", shared), ("w", own)]))
    assert out.pinned and sorted(tr.pinned) == sorted([shared.data_ptr(), own.data_ptr()])
    store.release("diffusion_model")
    assert tr.unpinned == []                                     # the copy still uses it
    store.release("diffusion_model (joined 1)")
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


def test_a_restage_the_ram_rule_refuses_says_the_component_is_part_pinned(monkeypatch):
    """Found in review: a re-stage (a LoRA patched since) keeps the component's unchanged pinned ranges; when the RAM
    rule then refused the new masters, the outcome said "pageable" while most masters stayed page-locked."""
    first = _groups(2)
    need = sum(g.nbytes for g in first)
    ram = [64 * need]
    monkeypatch.setattr(pinned, "host_memory", lambda: (ram[0], 128 * GIB))
    tr = PinningTransport()
    store = PinnedStore(tr, "auto", os_name="linux", has_cuda=True)
    assert store.pin_component("dit", first).pinned
    ram[0] = need                                # RAM got short since
    out = store.pin_component("dit", [first[0]] + _groups(1))
    assert not out.pinned and out.reason.startswith("part pinned: ") and "new ones are pageable" in out.reason, out
    assert tr.unpinned == [first[1].host.data_ptr()] and store.pinned_bytes == first[0].nbytes


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


def test_host_maps_do_not_count_shared_or_device_memory_as_page_cache(tmp_path):
    """Found in review: any mapping with an inode counted as page cache, shared memory (/dev/shm, memfd: swap-backed,
    which the OS does not count as available) and driver mappings of pinned host buffers (/dev/nvidia*) included,
    so the RAM rule took weights held there out of the available RAM a second time."""
    from comfyui_levers.core.residency.transport import HostMaps

    (tmp_path / "maps").write_text("1000-2000 rw-s 00000000 00:1a 7 /dev/shm/weights\n"
                                   "2000-3000 rw-s 00000000 00:01 9 /memfd:pinned (deleted)\n"
                                   "3000-4000 rw-s 00000000 00:05 11 /dev/nvidia0\n"
                                   "4000-5000 rw-s 00000000 00:05 12 /SYSV00000000 (deleted)\n"
                                   "5000-6000 r--s 00000000 08:01 13 /models/x.safetensors\n")
    (tmp_path / "smaps").write_text("")
    m = HostMaps.read(str(tmp_path / "maps"))
    assert [m.page_cache(lo, 0x1000) for lo in range(0x1000, 0x6000, 0x1000)] == [0, 0, 0, 0, 0x1000]
