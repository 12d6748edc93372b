"""The pinned host store: one host master per physical storage, page-locked in place, budgeted.

Phase offload keeps a host copy ("master") of every weight so that offloading is a pointer swap
back to it. Masters are grouped by *physical storage* (``untyped_storage().data_ptr()``), so
tied weights and views share one master and stay tied. Pinning uses ``transport.pin`` (in place,
``cudaHostRegister``; never a ``pin_memory()`` copy), happens once per master, follows seed 002's
rule (pin only when available host RAM covers the pinned set twice over), honours an explicit
budget and OS caps, and fails soft per component: a component that cannot be pinned stays in
pageable memory and the reason is recorded.

Public API (small on purpose; GroupPrefetch reuses it):
    PinMode                      auto / on / off
    pin_decision(pinned_set_bytes, available_ram_bytes, os_name, has_cuda) -> (bool, reason)
    host_memory() -> (available_bytes | None, total_bytes | None);  os_kind() -> str
    group_by_storage(named_tensors) -> list[StorageGroup]
    PinnedStore(transport, mode, budget_bytes).pin_component(name, groups) -> PinOutcome
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Iterable

import torch

from ..pin_rule import (GIB, RAM_COVER_FACTOR, WINDOWS_PIN_FRACTION, WSL_PIN_CAP_BYTES,  # noqa: F401 (re-exported)
                        host_memory, os_kind, pin_decision)
from ..types import _StrEnum
from .transport import READ_ONLY_REASON, HostMaps, Transport, pinned_by_levers, pinned_bytes_by_levers, tensor_nbytes

# A storage whose span is much bigger than the tensors using it (a view into a whole checkpoint
# blob) is staged tensor by tensor instead of as one span, so onload never drags foreign bytes.
MAX_SPAN_SLACK = 1.25
SPAN_ALIGN = 64


class PinMode(_StrEnum):
    AUTO = "auto"   # seed 002's RAM rule, OS caps, explicit budget
    ON = "on"       # pin regardless of the RAM rule (still fails soft; explicit budget still applies)
    OFF = "off"     # pageable masters


def arena_pin_decision(mode: PinMode | str, nbytes: int, has_cuda: bool, *, replaced_bytes: int = 0,
                       mapped_bytes: int = 0, levers_pinned_bytes: int | None = None,
                       available_ram_bytes: int | None = None, total_ram_bytes: int | None = None,
                       os_name: str | None = None) -> tuple[bool, str]:
    """Should a streaming host arena of ``nbytes`` be page-locked? Returns (pin, reason).

    ``auto`` is seed 002's rule (``pin_decision``) over everything Levers would then hold page-locked in this
    process: the ranges it pinned already (PhaseOffload's masters, other arenas), less ``replaced_bytes`` of them
    that the arena takes over (pinned masters of the weights it streams), plus the arena. Available RAM leaves out
    ``mapped_bytes`` of weights that are a file's page cache (file mappings, read-only or private and not written):
    the OS counts those pages as available, and their copy in the arena is unswappable RAM. ``on`` pins regardless (still failing soft); ``off``
    never pins. RAM and the OS are read here unless given."""
    mode = PinMode.parse(mode, "pin")
    gib = lambda n: f"{n / GIB:.2f} GiB"  # noqa: E731
    if mode is PinMode.OFF:
        return False, "pageable: pin = off"
    if not has_cuda:
        return False, "pageable: no CUDA device, nothing DMAs from pinned memory"
    if mode is PinMode.ON:
        return True, "pin = on"
    held = max(0, (pinned_bytes_by_levers() if levers_pinned_bytes is None else levers_pinned_bytes)
               - replaced_bytes)
    if available_ram_bytes is None and total_ram_bytes is None:
        available_ram_bytes, total_ram_bytes = host_memory()
    if available_ram_bytes is not None:
        available_ram_bytes = max(0, available_ram_bytes - mapped_bytes)
    ok, reason = pin_decision(held + nbytes, available_ram_bytes, os_name or os_kind(), True, total_ram_bytes)
    if held:
        reason += f" (the arena's {gib(nbytes)} + {gib(held)} Levers holds pinned already)"
    return ok, reason if ok else f"pageable: {reason}"


# --- storage groups ------------------------------------------------------------------------------

def storage_key(t: torch.Tensor) -> int:
    """Identity of the physical storage behind ``t`` (tied weights and views share it)."""
    return t.untyped_storage().data_ptr()


@dataclass
class TensorRef:
    """Where one named tensor sits inside its storage (byte offset, shape, stride, dtype)."""

    name: str
    byte_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.size:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()

    def view(self, base: torch.Tensor, base_byte_offset: int = 0) -> torch.Tensor:
        """This tensor as a view into the flat uint8 ``base`` that starts at ``base_byte_offset``.

        Span starts are aligned to ``SPAN_ALIGN`` bytes, so the element offset is always whole.
        """
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        start = base.storage_offset() + self.byte_offset - base_byte_offset  # bytes into base's storage
        return torch.empty(0, dtype=self.dtype, device=base.device).set_(
            base.untyped_storage(), start // itemsize, self.size, self.stride)


@dataclass
class StorageGroup:
    """All tensors that live in one physical storage, and the byte span they use.

    ``host`` is a flat ``uint8`` view of ``[span_start, span_end)`` of that storage: the master.
    Copying ``host`` once moves every tensor of the group and keeps aliases aliased.
    ``per_tensor`` is set when the span is much larger than the tensors (a view into a big blob):
    then each distinct view is copied on its own.
    """

    key: int
    host: torch.Tensor                  # [span_bytes] uint8, shares memory with the tensors
    span_start: int
    refs: list[TensorRef] = field(default_factory=list)
    per_tensor: bool = False
    # a compacted copy of a sparse span (``compact``): (old start, old end, new start) per byte range it kept, so a
    # byte offset into the original storage can still be found in ``host``
    remap: tuple[tuple[int, int, int], ...] = ()

    def translate(self, byte_offset: int) -> int:
        """Where the byte at ``byte_offset`` of the original storage sits now (itself, unless compacted)."""
        for old, end, new in self.remap:
            if old <= byte_offset < end:
                return new + byte_offset - old
        if self.remap:
            raise KeyError(f"byte {byte_offset} is in none of the ranges this copy kept")
        return byte_offset

    @property
    def nbytes(self) -> int:
        """Bytes an onload of this group moves."""
        if self.per_tensor:
            seen = {(r.byte_offset, r.size, r.stride, r.dtype): r.nbytes for r in self.refs}
            return sum(seen.values())
        return self.host.numel()

    def host_view(self, ref: TensorRef) -> torch.Tensor:
        return ref.view(self.host, self.span_start)


def _span(start: int, size, stride, itemsize: int) -> tuple[int, int]:
    """[start, end) in bytes of the storage a view at byte ``start`` with ``size`` and ``stride`` can touch."""
    if any(s == 0 for s in size):
        return start, start
    extent = 1 + sum((s - 1) * st for s, st in zip(size, stride))
    return start, start + extent * itemsize


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    """[start, end) in bytes of the storage region ``t`` can touch."""
    return _span(t.storage_offset() * t.element_size(), t.size(), t.stride(), t.element_size())


def compact(g: StorageGroup) -> StorageGroup:
    """A writable copy of a sparse group's views only: the byte ranges its tensors touch (overlapping ones merged, so
    a weight and a slice of it stay one range and stay tied), packed one after another into a fresh buffer, each
    starting at its old offset modulo ``SPAN_ALIGN`` so every view's element offset stays whole. The refs point
    into the copy; ``remap`` finds any old offset in it. The gaps (other components' tensors in the same file
    mapping) are not copied."""
    spans = sorted(_span(r.byte_offset, r.size, r.stride, torch.empty((), dtype=r.dtype).element_size())
                   for r in g.refs)
    merged: list[list[int]] = []
    for s, e in spans:
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    remap, cursor = [], 0
    for s, e in merged:
        cursor += (s % SPAN_ALIGN - cursor % SPAN_ALIGN) % SPAN_ALIGN     # same offset modulo SPAN_ALIGN
        remap.append((s, e, cursor))
        cursor += e - s
    with torch.inference_mode(False):
        copy = torch.empty(max(cursor, 1), dtype=torch.uint8)                # [packed bytes] uint8, writable
        for s, e, new in remap:
            copy[new:new + e - s].copy_(g.host[s - g.span_start:e - g.span_start])
    out = StorageGroup(key=storage_key(copy), host=copy, span_start=0, refs=[], remap=tuple(remap))
    out.refs = [TensorRef(r.name, out.translate(r.byte_offset), r.size, r.stride, r.dtype) for r in g.refs]
    return out


def group_by_storage(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[StorageGroup]:
    """Group plain (non-subclass) host tensors by physical storage; one master per storage."""
    by_key: dict[int, list[tuple[str, torch.Tensor]]] = {}
    for name, t in named_tensors:
        if t.device.type != "cpu":
            raise ValueError(f"{name}: masters must live in host memory, got a tensor on {t.device}")
        by_key.setdefault(storage_key(t), []).append((name, t))
    groups = []
    for key, items in by_key.items():
        spans = [_byte_span(t) for _, t in items]
        start = min(s for s, _ in spans)
        start -= start % SPAN_ALIGN  # aligned spans keep every view's element offset whole on the device
        end = max(e for _, e in spans)
        storage = items[0][1].untyped_storage()
        flat = torch.empty(0, dtype=torch.uint8).set_(storage, start, (end - start,), (1,))  # [span] uint8
        refs = [TensorRef(name, t.storage_offset() * t.element_size(), tuple(t.size()), tuple(t.stride()), t.dtype)
                for name, t in items]
        used = sum({(r.byte_offset, r.size, r.stride, r.dtype): r.nbytes for r in refs}.values())
        per_tensor = (end - start) > MAX_SPAN_SLACK * max(used, 1)
        groups.append(StorageGroup(key=key, host=flat, span_start=start, refs=refs, per_tensor=per_tensor))
    return groups


# --- the store ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PinOutcome:
    """What happened when a component's masters were offered for pinning."""

    component: str
    pinned: bool
    reason: str
    nbytes: int
    already_pinned_bytes: int = 0   # bytes someone else (ComfyUI) had already page-locked
    copied_bytes: int = 0           # bytes copied out of read-only memory into the pinned buffers below
    # group index -> the writable copy that replaced a read-only group (its tensors must be rebound to it)
    relocated: dict[int, "StorageGroup"] = field(default_factory=dict, compare=False, repr=False)

    def as_dict(self) -> dict:
        return {"component": self.component, "pinned": self.pinned, "reason": self.reason,
                "bytes": self.nbytes, "already_pinned_bytes": self.already_pinned_bytes,
                "copied_bytes": self.copied_bytes}


class PinnedStore:
    """Page-locks masters in place, once, within a budget, failing soft per component.

    Keeps the list of host ranges it registered so ``unpin_all`` undoes exactly its own work and
    never unregisters memory ComfyUI pinned.
    """

    def __init__(self, transport: Transport, mode: PinMode | str = PinMode.AUTO,
                 budget_bytes: int | None = None, *, available_ram_bytes: int | None = None,
                 total_ram_bytes: int | None = None, os_name: str | None = None,
                 has_cuda: bool | None = None, pageable: dict[str, str] | None = None) -> None:
        """``pageable``: components never pinned here, each with the reason (a plan that pins the others)."""
        self.transport = transport
        self.pageable = dict(pageable or {})
        self.mode = PinMode.parse(mode, "pin")
        if budget_bytes is not None and budget_bytes < 0:
            raise ValueError(f"pin budget_bytes={budget_bytes} must be >= 0 (or None for the RAM rule)")
        self.budget_bytes = budget_bytes
        avail, total = host_memory() if available_ram_bytes is None or total_ram_bytes is None else (None, None)
        self.available_ram_bytes = available_ram_bytes if available_ram_bytes is not None else avail
        # available RAM read here is read again at each decision (models load, other copies come and go between a
        # node's run and the component's first load); a figure given by the caller stands
        self._reads_ram = available_ram_bytes is None
        self.total_ram_bytes = total_ram_bytes if total_ram_bytes is not None else total
        self.os_name = os_name or os_kind()
        self.has_cuda = (transport.device.type == "cuda") if has_cuda is None else has_cuda
        self.pinned_bytes = 0
        self._mine: dict[int, torch.Tensor] = {}    # host ptr -> flat tensor we registered
        # host ptr -> the components whose masters use that range (QuantizeDiT's copy shares the input's unquantized
        # tensors): it stays registered until the last of them lets go
        self._users: dict[int, set[str]] = {}
        self._by_component: dict[str, dict[int, torch.Tensor]] = {}
        self._failed: dict[str, str] = {}           # component -> reason its pinning failed
        self.outcomes: dict[str, PinOutcome] = {}

    def pin_component(self, component: str, groups: list[StorageGroup]) -> PinOutcome:
        """Pin every group of ``component`` or none of them; record and return the outcome.

        Calling it again for the same component (after a re-stage) pins only new ranges and
        unpins the component's ranges that are no longer masters. Already-pinned ranges are
        never registered twice.
        """
        if component in self._failed:
            # a failed cudaHostRegister can poison later ones: never retry a component that failed
            outcome = PinOutcome(component, False, self._failed[component], sum(g.nbytes for g in groups))
            self.outcomes[component] = outcome
            return outcome
        pieces = [p for g in groups for p in _pin_pieces(g)]
        mine = self._by_component.setdefault(component, {})
        self._drop(component, keep={p.data_ptr() for p in pieces})
        ours = [p for p in pieces if p.data_ptr() in self._mine]
        for p in ours:                # page-locked already, by this component or another one sharing the memory
            mine[p.data_ptr()] = self._mine[p.data_ptr()]
            self._users.setdefault(p.data_ptr(), set()).add(component)
        # memory another Levers store page-locked (this node run before on the same cached model): this store takes
        # a use of it, so the other's unpin (when ComfyUI drops the old node output) leaves it pinned
        shared = [p for p in pieces if p.data_ptr() not in self._mine and pinned_by_levers(p)]
        already = sum(tensor_nbytes(p) for p in pieces
                      if p.data_ptr() not in self._mine and not pinned_by_levers(p) and _is_pinned(p))
        todo = [p for p in pieces if p.data_ptr() not in self._mine and not _is_pinned(p)]
        need = sum(tensor_nbytes(p) for p in todo)
        total = need + already + sum(tensor_nbytes(p) for p in ours + shared)
        maps = HostMaps.recent(max_age_s=0.0) if self.mode is not PinMode.OFF and self.has_cuda else None
        read_only = {i for i, g in enumerate(groups) if maps is not None and g.host.numel()
                     and maps.writable(g.host.data_ptr(), g.host.numel()) is False}
        # copies of read-only memory are new, unswappable RAM, where the file's pages were reclaimable page cache:
        # the RAM rule sees the available RAM without them
        copies = sum(groups[i].nbytes for i in read_only)     # a sparse group copies its views only
        outcome = self._decide(component, need, total, already, bool(ours or shared), copies)
        if outcome is not None and not outcome.pinned and ours:
            # a re-stage whose new masters the rule refuses: the ranges pinned before stay pinned (the rule let them
            # be), and the outcome says the component is part pinned instead of calling it all pageable
            kept = sum(tensor_nbytes(p) for p in ours)
            outcome = replace(outcome, reason=f"part pinned: {kept / GIB:.2f} GiB of its masters stay page-locked "
                                              f"from before, the {need / GIB:.2f} GiB of new ones are "
                                              f"{outcome.reason}")
        if outcome is not None and not (outcome.pinned and shared):
            self.outcomes[component] = outcome
            return outcome
        relocated = self._relocate_read_only(component, groups, read_only)
        if isinstance(relocated, PinOutcome):
            self.outcomes[component] = relocated
            return relocated
        if relocated:
            pieces = [p for i, g in enumerate(groups) for p in _pin_pieces(relocated.get(i, g))]
            todo = [p for p in pieces if p.data_ptr() not in self._mine and not _is_pinned(p)]
        copied = sum(g.host.numel() for g in relocated.values())
        done: list[torch.Tensor] = []
        for piece in shared + todo:
            res = self.transport.pin(piece)
            if not res.pinned:
                for p in done:  # roll back: a half-pinned component reports as pageable
                    self._unpin(component, p)
                self._drop(component, keep=set())
                outcome = PinOutcome(component, False, f"pageable: pin failed ({res.reason})", total, already)
                self._failed[component] = outcome.reason
                self.outcomes[component] = outcome
                return outcome
            done.append(piece)
            self._mine[piece.data_ptr()] = piece
            self._users.setdefault(piece.data_ptr(), set()).add(component)
            mine[piece.data_ptr()] = piece
            self.pinned_bytes += tensor_nbytes(piece)
        how = "pinned in place" if need or ours or shared else "already page-locked"
        if already and (need or ours or shared):
            how += f" ({already / GIB:.2f} GiB was already page-locked by ComfyUI)"
        if shared:
            how += (f" ({sum(tensor_nbytes(p) for p in shared) / GIB:.2f} GiB shared with another Levers node's "
                    "pinned copies)")
        if copied:
            how += f"; {copied / GIB:.2f} GiB copied first out of {READ_ONLY_REASON}"
        outcome = PinOutcome(component, True, how, total, already, copied, relocated)
        self.outcomes[component] = outcome
        return outcome

    def _relocate_read_only(self, component: str, groups: list[StorageGroup],
                            read_only: set[int]) -> "dict[int, StorageGroup] | PinOutcome":
        """Writable copies of the ``read_only`` groups, by index (a GGUF file's or ComfyUI's memory map):
        cudaHostRegister fails on such memory, so the masters move into a fresh host buffer that can be
        page-locked (the file's pages stay clean page cache the OS may reclaim). Only called once the component is
        going to be pinned, and counted in the same budget."""
        out: dict[int, StorageGroup] = {}
        for i in sorted(read_only):
            g = groups[i]
            if g.per_tensor:       # views with gaps (other tensors of the same file between them): only the views
                out[i] = compact(g)
                continue
            with torch.inference_mode(False):
                copy = torch.empty(g.host.numel(), dtype=torch.uint8)    # [span] uint8, writable
                copy.copy_(g.host)
            out[i] = StorageGroup(key=storage_key(copy), host=copy, span_start=g.span_start, refs=list(g.refs))
        return out

    def _unpin(self, component: str, piece: torch.Tensor) -> None:
        ptr = piece.data_ptr()
        users = self._users.get(ptr, set())
        users.discard(component)
        if not users:
            self._users.pop(ptr, None)
            if self._mine.pop(ptr, None) is not None:
                self.transport.unpin(piece)
                self.pinned_bytes -= tensor_nbytes(piece)
        self._by_component.get(component, {}).pop(ptr, None)

    def _drop(self, component: str, keep: set[int]) -> None:
        """Unpin this component's ranges whose pointer is not in ``keep``."""
        stale = [p for ptr, p in self._by_component.get(component, {}).items() if ptr not in keep]
        if stale:
            self.transport.synchronize()  # a DMA may still read a range we are about to unregister
        for p in stale:
            self._unpin(component, p)

    def _decide(self, component: str, need: int, total: int, already: int, ours: bool,
                copies: int = 0) -> PinOutcome | None:
        """An outcome when pinning is skipped, None when it should go ahead. ``copies``: bytes that must first be
        copied out of read-only memory (they take RAM the rule would otherwise count as available)."""
        if self.mode is PinMode.OFF:
            return PinOutcome(component, False, "pageable: pinning is off", total, already)
        if need == 0:
            if ours:
                return PinOutcome(component, True, "pinned in place", total, already)
            return PinOutcome(component, bool(total), "already page-locked" if total else "nothing to pin",
                              total, already)
        if component in self.pageable:
            return PinOutcome(component, False, self.pageable[component], total, already)
        if not self.has_cuda:
            return PinOutcome(component, False, "pageable: no CUDA device, nothing DMAs from pinned memory",
                              total, already)
        if self.mode is PinMode.ON:
            if self.budget_bytes is not None and self.pinned_bytes + need > self.budget_bytes:
                return PinOutcome(component, False, f"pageable: pin budget {self.budget_bytes / GIB:.2f} GiB "
                                  f"is spent ({self.pinned_bytes / GIB:.2f} GiB pinned)", total, already)
            return None
        if self._reads_ram:
            self.available_ram_bytes = host_memory()[0]
        avail = self.available_ram_bytes
        if avail is not None and copies:
            avail = max(0, avail - copies)
        # the rule is about every page Levers locks in this process: other stores' masters and GroupPrefetch's host
        # copies count too (an explicit pin budget stays this store's own)
        held = self.pinned_bytes if self.budget_bytes is not None else max(self.pinned_bytes, pinned_bytes_by_levers())
        ok, reason = pin_decision(held + need, avail, self.os_name,
                                  self.has_cuda, self.total_ram_bytes, self.budget_bytes)
        return None if ok else PinOutcome(component, False, f"pageable: {reason}", total, already)

    def release(self, component: str) -> None:
        """Unpin every range this store pinned for ``component`` (e.g. when its handle is removed)."""
        self._drop(component, keep=set())
        self._by_component.pop(component, None)
        if component in self.outcomes:          # the outcome stays for the report, without the copies it held
            self.outcomes[component] = replace(self.outcomes[component], relocated={})

    def unpin_all(self) -> None:
        """Unregister exactly the ranges this store registered. Waits for in-flight copies first."""
        self.transport.synchronize()  # a DMA may still read a range we are about to unregister
        for piece in self._mine.values():
            self.transport.unpin(piece)
        self._mine.clear()
        self._users.clear()
        self._by_component.clear()
        self.pinned_bytes = 0

    def report(self) -> list[dict]:
        return [o.as_dict() for o in self.outcomes.values()]


def _pin_pieces(group: StorageGroup) -> list[torch.Tensor]:
    """The contiguous host ranges to register for a group (the span, or each distinct view)."""
    if not group.per_tensor:
        return [group.host] if group.host.numel() else []
    views = sorted(((r.byte_offset, r.nbytes, group.host_view(r)) for r in group.refs), key=lambda v: (v[0], -v[1]))
    pieces, end = [], -1
    for offset, nbytes, t in views:
        # one piece per range: a view inside one already kept (a tied slice, the same start with fewer bytes) is
        # pinned with it; two pieces with one start would take two uses of one registration and give back one
        if t.is_contiguous() and t.numel() and offset + nbytes > end:
            pieces.append(t)
            end = offset + nbytes
    return pieces


def _is_pinned(t: torch.Tensor) -> bool:
    """Page-locked already (by ComfyUI, torch or us)? Only asks CUDA when it is available."""
    if not torch.cuda.is_available():
        return False
    try:
        return bool(t.is_pinned())
    except RuntimeError:
        return False
