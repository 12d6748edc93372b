"""Group prefetch: stream transformer blocks host->device, group i+1 copying while group i computes.

Layout (what lives where):
- Host: one arena per dtype holding every streamed tensor, blocks in execution order, each
  tensor at an aligned offset with its strides preserved. A group of consecutive blocks is then a
  contiguous slice of each arena: one copy per dtype per group, and regrouping needs no repack.
  The arena is page-locked in place when the transport can pin. Streamed parameters point at
  their arena view whenever their group is not computing (zero bytes moved to "offload").
- Device: ``prefetch_depth + 1`` static slots of bytes sized for the largest group (allocated
  once, never freed in the hot path), a resident prefix of groups, and the remainder.
- Quantized weights held as wrapper subclasses (ComfyUI's ``QuantizedTensor``, ``subclass.py``)
  stream as the plain tensors inside them (fp8 codes and scales): their host copies stay in the
  wrapper, and a device wrapper around the slot's copies, built once per slot, takes the
  parameter's place while its group computes.
- Split blocks (``partial_blocks``): a streamed block may keep the tail of its tensors resident and
  stream only a head of at most ``cap`` bytes. Slots then hold ``cap`` instead of a whole block, so
  under a tight budget the room whole-block slots would take keeps weights resident instead: with
  N blocks and S slots, about (model - budget) * N / (N - S) bytes stream instead of
  (model - budget) + S * largest block.

Schedule per streamed group g (hooks on the blocks, opaque to torch.compile):
  pre-hook of g's first block: [load g if it was not prefetched] -> prefetch the next
  ``prefetch_depth`` streamed groups (wrapping to the first streamed group for the next forward:
  the next step or the other CFG half) -> compute waits on g's event -> bind g's parameters to
  its slot -> compute. post-hook of g's last block: rebind g's parameters to the host arena and
  release the slot. A copy into a slot always follows ``wait_compute`` so it cannot overwrite
  weights that compute issued earlier still reads. No host synchronisation in the hot path.

Routes: a forward may skip blocks (skip-layer guidance replaces them with a function that does not run
them; Chroma's ``skip_mmdit``). The caller labels each forward with ``route_key`` (forwards that may skip
different blocks get different keys); the engine remembers which blocks the last forward under each key
ran, and the prefetch order of the next forward under that key leaves out the groups none of whose blocks
ran. A group that runs although its key's last forward skipped it loads on demand (a miss), and the rest of
that forward prefetches in the full order.
"""
from __future__ import annotations

import bisect
import math
import statistics
import time
import weakref
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Hashable, Sequence

import torch
from torch import nn

from ..errors import BudgetExceeded, ConfigError
from . import subclass
from .blocks import BlockLayout, entry_exit, find_blocks, held_outside
from .packed import (PACKABLE, PackedArena, pack, packed_nbytes, packing_supported, repack_ranges, staging_caps,
                     staging_nbytes, unpack)
from .transport import PinResult, Transport, note_compute, tensor_nbytes

AUTO = "auto"
ALIGN_BYTES = 64          # slice alignment inside arenas and slots (DMA- and vector-friendly)
MAX_AUTO_DEPTH = 4
CALIBRATION_FORWARD = 1   # index of the forward whose per-block compute is measured
CALIBRATION_RETRIES = 4   # later forwards that may measure instead when it skipped blocks (always skipped: 0 s)
SLOT_ALIGN = 512          # bytes: where each dtype's region starts in a device slot (the CUDA allocator's alignment)
_GIB = 1024 ** 3
# A host copy is held in segments of about this many bytes, cut at block boundaries: building a copy frees the
# weights' old storage segment by segment, and giving a copy back (a rebuild for another layout, the node removed)
# frees each segment once its weights have their own storage again, so either holds the streamed bytes once plus
# one segment in RAM, not twice. A group copy that crosses a cut is two copies; a packed dtype is one segment.
SEGMENT_BYTES = _GIB


# --- config ------------------------------------------------------------------------------------

def _auto_or_int(name: str, value: Any, minimum: int) -> int | str:
    if value is None or (isinstance(value, str) and value.strip().lower() == AUTO):
        return AUTO
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) or value < minimum:
        raise ConfigError(name, value, f"'auto' or an integer >= {minimum}")
    return int(value)


@dataclass(frozen=True)
class PrefetchConfig:
    """How to stream. Each size is ``"auto"`` or a number.

    blocks_per_group: blocks per streamed group (bigger groups hide copies behind more compute).
    prefetch_depth: groups copied ahead of the one computing (device slots = depth + 1).
    resident_groups: groups at the start of the model kept on the device for good.
    budget_bytes: device bytes for weights (remainder + resident groups + slots). ``auto``: free
        device memory plus what this module already holds there, minus 1 GiB headroom.
    manage_resident: move the remainder and the resident groups to the device (False when the
        caller, e.g. ComfyUI's loader, places them).
    pin: page-lock the host arenas when the transport can.
    partial_blocks: with one block per group and no fixed resident prefix, also consider plans
        where streamed blocks keep part of their tensors resident (smaller slots, fewer bytes
        streamed under a tight budget).
    packed: stream bf16 weights losslessly packed (``packed.py``: about 0.76 x the bytes over the
        bus, unpacked on the device, bit-identical). Costs a packed host copy of the streamed bf16
        bytes (pinned instead of the bf16 arena), a one-time packing pass and a staging buffer.
    """

    blocks_per_group: int | str = AUTO
    prefetch_depth: int | str = AUTO
    resident_groups: int | str = AUTO
    budget_bytes: int | str = AUTO
    manage_resident: bool = True
    pin: bool = True
    partial_blocks: bool = True
    packed: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "blocks_per_group", _auto_or_int("blocks_per_group", self.blocks_per_group, 1))
        object.__setattr__(self, "prefetch_depth", _auto_or_int("prefetch_depth", self.prefetch_depth, 1))
        object.__setattr__(self, "resident_groups", _auto_or_int("resident_groups", self.resident_groups, 0))
        object.__setattr__(self, "budget_bytes", _auto_or_int("budget_bytes", self.budget_bytes, 0))

    @property
    def is_auto(self) -> bool:
        return AUTO in (self.blocks_per_group, self.prefetch_depth, self.resident_groups)


# --- host store --------------------------------------------------------------------------------

def _dense_span(t: torch.Tensor) -> int | None:
    """Elements covered by ``t``'s strides when it is non-overlapping and dense, else None."""
    if t.numel() == 0:
        return 0
    span = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()) if s > 1)
    return span if span == t.numel() and all(st >= 0 for st in t.stride()) else None


_is_plain = subclass.is_plain


@dataclass
class _Ref:
    owner: nn.Module
    name: str
    is_param: bool
    inner: subclass.Path = ()     # the plain tensor at this path inside a wrapper subclass

    def outer(self) -> torch.Tensor | None:
        table = self.owner._parameters if self.is_param else self.owner._buffers
        return table.get(self.name)

    def get(self) -> torch.Tensor | None:
        t = self.outer()
        return subclass.leaf(t, self.inner) if self.inner else t


@dataclass
class _Entry:
    """One streamed tensor: where it sits in the arena and who holds it."""

    refs: list[_Ref]
    block: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int                         # element offset in the dtype arena
    span: int                           # elements covered
    orig_device: torch.device
    host_view: torch.Tensor | None = None
    tensor: torch.Tensor | None = None  # the object whose .data is swapped (refreshed on attach)
    wrapped: "_Wrapped | None" = None   # the wrapper subclass this is an inner tensor of


@dataclass
class _Wrapped:
    """A parameter held as a wrapper subclass: its inner tensors are entries (``leaves``); on the
    device a wrapper around their device copies takes the parameter's place (``subclass.rebuild``)."""

    refs: list[_Ref]
    leaves: list[tuple[subclass.Path, _Entry]] = field(default_factory=list)
    host: torch.Tensor | None = None      # the module's own wrapper (host copies inside), set by the engine

    def outer(self) -> torch.Tensor | None:
        return self.refs[0].outer()

    def set(self, value: torch.Tensor) -> None:
        for r in self.refs:
            _set(r, value)


class _Arena:
    """One dtype's host copy: elements [0, n) held in segments (``SEGMENT_BYTES``), each a tensor of its own.
    No entry crosses a segment (the cuts are block boundaries). ``bounds``: the segments' first elements, then n."""

    def __init__(self, dtype: torch.dtype, bounds: list[int]):
        self.dtype = dtype
        self.bounds = bounds
        self.segments: list[torch.Tensor | None] = [None] * (len(bounds) - 1)   # allocated as the build reaches them

    def numel(self) -> int:
        return self.bounds[-1]

    def element_size(self) -> int:
        return self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.numel() * self.dtype.itemsize

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in self.segments if t is not None]

    @property
    def tensor(self) -> torch.Tensor:
        """The whole copy as one tensor (a packed dtype's arena is one segment)."""
        assert len(self.segments) == 1 and self.segments[0] is not None, "a segmented arena has no single tensor"
        return self.segments[0]

    def index(self, offset: int) -> int:
        """The segment holding element ``offset``."""
        return bisect.bisect_right(self.bounds, offset, hi=len(self.segments)) - 1

    def view(self, offset: int, shape: tuple[int, ...], stride: tuple[int, ...]) -> torch.Tensor:
        i = self.index(offset)
        return self.segments[i].as_strided(shape, stride, offset - self.bounds[i])

    def pieces(self, lo: int, hi: int):
        """(slice of one segment, its first element's offset from ``lo``) covering elements [lo, hi)."""
        for i in range(self.index(lo), len(self.segments)):
            s0, s1 = self.bounds[i], self.bounds[i + 1]
            if s0 >= hi:
                break
            a, b = max(lo, s0), min(hi, s1)
            if a < b:
                yield self.segments[i][a - s0:b - s0], a - lo

    def ranges(self) -> list[tuple[int, int]]:
        """The host address ranges the segments span."""
        return [(t.data_ptr(), t.data_ptr() + tensor_nbytes(t)) for t in self.tensors()]


# (bytes about to be page-locked, whether the RAM now read already holds them) -> (pin, why)
PinDecider = Callable[[int, bool], tuple[bool, str]]


def _pin_each(transport: Transport, tensors: Sequence[torch.Tensor], into: list[torch.Tensor]) -> PinResult | None:
    """Pin each tensor (fail-soft), adding those pinned to ``into`` (a store's list); the first failure, or None."""
    bad = None
    for t in tensors:
        r = transport.pin(t)
        if r.pinned:
            into.append(t)
        else:
            bad = bad or r
    return bad


def _unpin_one(transport: Transport, t: torch.Tensor, pinned: list[torch.Tensor]) -> None:
    """Unpin ``t`` if it is in ``pinned`` (a store's list, changed in place) and drop it from there."""
    if any(p is t for p in pinned):
        transport.unpin(t)
        pinned[:] = [p for p in pinned if p is not t]


def _unpin_all(transport: Transport, *pinned: list[torch.Tensor]) -> None:
    """Unpin and forget every tensor in ``pinned`` (lists a store owns; emptied in place)."""
    for group in pinned:
        for t in group:
            transport.unpin(t)
        group.clear()


class StoreOutdated(RuntimeError):
    """The blocks no longer match the host copy (a weight removed, changed kind, or a tie broken): build a new one.
    Its own class, so a caller rebuilding on it does not also rebuild on an out-of-memory error while re-staging."""


class HostStore:
    """Streamed tensors of ``blocks`` packed into one (pinned) arena per dtype.

    Built once; cheap to re-validate (``refresh``) when the owner replaced or moved a tensor
    (ComfyUI patching a LoRA in, or loading the module elsewhere), re-staging only what changed.
    """

    def __init__(self, blocks: Sequence[tuple[str, nn.Module]], transport: Transport, pin: bool = True,
                 exclude: frozenset[int] = frozenset(), packed: bool = False, unpinned_reason: str = "",
                 decide_pin: PinDecider | None = None, adopt: "HostStore | None" = None,
                 root: nn.Module | None = None):
        """``exclude``: ids of block tensors the caller keeps on the device itself (ComfyUI loads
        them); they are neither streamed nor counted in this engine's budget. ``packed``: also keep
        the bf16 arena losslessly packed (``packed.py``); that form is pinned and streams instead.
        ``unpinned_reason``: why ``pin`` is False (the report's line).

        ``decide_pin(nbytes, allocated)``, when given, replaces ``pin``: asked with the exact bytes about to
        be page-locked, it returns (pin, why). A plain store asks before its arenas exist (they take the place of
        the weights they copy, so the RAM it reads is what is left after). A packed store asks once its planes
        exist (``allocated=True``): they are new memory, smaller than the bf16 bytes, and the RAM read then is
        what they left. Streaming a packed store as stored asks again for its bf16 arena (``pin_arenas``).

        ``adopt``: the store these blocks' copy was built in before (a rebuild for another layout, after its
        ``restore(keep=...)``). Each of its segments whose weights are all streamed here again, laid out the same, is
        taken over as it is (no copy, no pin when it was pinned; ``adopted_bytes``); its other segments are copied
        from as usual. The old store then holds only what was not taken over; restore it next.

        ``root``: the model the blocks belong to. A block tensor that a module of it outside ``blocks`` also holds
        (``held_outside``) is in use while its block is not running: it stays on the device, like a tensor shared
        between two blocks."""
        self._decide_pin = decide_pin
        self._unpinned_reason = unpinned_reason or "pinning disabled"
        self._pin = pin
        self.exclude = frozenset(exclude)
        self.excluded_bytes = 0
        self.block_names = [n for n, _ in blocks]
        self.modules = [m for _, m in blocks]
        self.entries: list[_Entry] = []
        self.by_block: list[list[_Entry]] = [[] for _ in blocks]
        self.kept: list[tuple[str, str]] = []          # (tensor name, why it is not streamed)
        self.kept_refs: list[_Ref] = []
        self.wrapped: list[_Wrapped] = []               # wrapper-subclass parameters streamed by their leaves
        self.arenas: dict[torch.dtype, _Arena] = {}
        self.block_range: dict[torch.dtype, list[tuple[int, int]]] = {}
        self.pin_results: dict[torch.dtype, PinResult] = {}
        self.restaged = 0
        self._planes: dict[torch.dtype, PackedArena] = {}   # packed forms, kept in sync even when unused
        self.use_packed = True                              # stream the packed forms (when there are any)
        self.pack_seconds = 0.0
        self._pack_wanted = packed
        # the pinned tensors, mutated in place only: the finalizer below holds these two lists, so that host
        # memory a dropped store page-locked is unregistered (ComfyUI drops a model, and its store, without
        # telling anyone; unregistered pages would stay locked for the life of the process)
        self._pinned_planes: list[torch.Tensor] = []
        self._pinned_arenas: list[torch.Tensor] = []
        weakref.finalize(self, _unpin_all, transport, self._pinned_arenas, self._pinned_planes).atexit = False
        self._needs_pinning = getattr(getattr(transport, "device", None), "type", None) == "cuda"
        self._esc_cache: dict[tuple[torch.dtype, int, int], int] = {}
        self._fingerprints: dict[int, torch.Tensor] = {}
        # Models built under inference mode (ComfyUI loads inside it) hold inference tensors:
        # their arenas, slots and views must be inference tensors too (a normal tensor assigned
        # to an inference parameter's .data breaks its ops), and copies into them must run in
        # inference mode. Models built normally get normal tensors for the same reason.
        self.inference = any(x.is_inference() for _, b in blocks for t in list(b.parameters()) + list(b.buffers())
                             for x in ([t] if _is_plain(t) or subclass.is_storage(t)
                                       else [x for _, x in subclass.leaves(t) or []]))
        self._collect(blocks, held_outside(root, blocks) if root is not None else frozenset())
        # a rebuild: the old store's segments this copy takes over, and those taken so far (ids; during the build)
        self._adopt = self._adoptable(adopt)
        if adopt is not None:
            # the old copy's pinned segments this one cannot take over (a weight replaced since, a block now split)
            # are only copied from: unpinned before the pin decision, which would count them as held
            taken = {id(seg) for runs in self._adopt.values() for _, seg in runs.values()}
            for seg in [t for t in adopt._pinned_arenas if id(t) not in taken]:
                _unpin_one(transport, seg, adopt._pinned_arenas)
        self._adopted: set[int] = set()
        self.adopted_bytes = 0
        self._old = adopt
        deferred = decide_pin is not None and packed and any(d in PACKABLE and n for d, n in self._sizes.items())
        self._deferred = deferred        # the pin decision comes once the packed planes exist
        if decide_pin is not None and not deferred:
            self._decide(sum(n * d.itemsize for d, n in self._sizes.items()), allocated=False)
        try:
            self._allocate_and_stage(transport, self._pin and not deferred)
        finally:
            self._old, self._adopt = None, {}
        if packed:
            self.pack_arenas(transport, self._pin and not deferred)
        if deferred:
            # segments taken over still pinned are pinned already (and counted among what Levers holds)
            self._decide(sum(pk.nbytes for pk in self._planes.values())
                         + sum(a.nbytes for d, a in self.arenas.items() if d not in PACKABLE)
                         - sum(tensor_nbytes(t) for t in self._pinned_arenas), allocated=True)
            self._pin_after_packing(transport)
        self._adopted = set()

    # layout ------------------------------------------------------------------------------
    def _collect(self, blocks: Sequence[tuple[str, nn.Module]], outside: frozenset[int]) -> None:
        owners: dict[int, set[int]] = {}
        for b, (_, block) in enumerate(blocks):
            for t in list(block.parameters()) + list(block.buffers()):
                owners.setdefault(id(t), set()).add(b)
        by_id: dict[int, _Entry | _Wrapped | None] = {}
        kept_ids: set[int] = set()
        cursor: dict[torch.dtype, int] = {}

        def add(b: int, t: torch.Tensor, refs: list[_Ref], wrapped: _Wrapped | None = None) -> _Entry:
            t = subclass.plain(t)          # a storage subclass's real layout (GGUF: packed blocks)
            span = _dense_span(t)
            stride = tuple(t.stride()) if span is not None else _contiguous_stride(t.shape)
            span = span if span is not None else t.numel()
            align = max(1, ALIGN_BYTES // t.element_size())
            start = cursor.get(t.dtype, 0)
            start = -(-start // align) * align
            e = _Entry(refs, b, t.dtype, tuple(t.shape), stride, start, span, t.device, wrapped=wrapped)
            cursor[t.dtype] = start + span
            self.entries.append(e)
            self.by_block[b].append(e)
            return e

        for b, (bname, block) in enumerate(blocks):
            for mname, mod in block.named_modules():
                for is_param, table in ((True, mod._parameters), (False, mod._buffers)):
                    for name, t in table.items():
                        if t is None:
                            continue
                        if id(t) in self.exclude:
                            if id(t) not in by_id:
                                self.excluded_bytes += tensor_nbytes(t)
                                by_id[id(t)] = None
                            continue
                        ref = _Ref(mod, name, is_param)
                        full = f"{bname}.{mname + '.' if mname else ''}{name}"
                        if id(t) in by_id:
                            tied = by_id[id(t)]       # tied (inside one block, or to an earlier block if kept)
                            tied.refs.append(ref)
                            if id(t) in kept_ids:
                                self.kept_refs.append(ref)    # every name of a kept tensor goes to the device
                            for path, e in getattr(tied, "leaves", ()):
                                e.refs.append(_Ref(mod, name, is_param, path))
                            continue
                        why, inner = None, None
                        if len(owners[id(t)]) > 1:
                            why = "shared between blocks"
                        elif id(t) in outside:
                            why = "also held outside the streamed blocks"
                        elif not _is_plain(t) and not subclass.is_storage(t):
                            inner = subclass.leaves(t)
                            if inner is None:
                                why = f"tensor subclass {type(t.data).__name__} (no plain inner tensors to stream)"
                            elif t.device.type != "cpu":
                                why = f"tensor subclass {type(t.data).__name__} on {t.device} (streamed from the host)"
                            elif any(x.numel() == 0 or x.device != t.device for _, x in inner):
                                why = f"tensor subclass {type(t.data).__name__} with empty or scattered inner tensors"
                        elif t.numel() == 0:
                            why = "empty"
                        if why is not None:
                            self.kept.append((full, why))
                            self.kept_refs.append(ref)
                            kept_ids.add(id(t))
                            by_id[id(t)] = _Entry([ref], b, t.dtype, (), (), 0, 0, t.device)  # placeholder
                            continue
                        if inner is not None:
                            w = _Wrapped([ref])
                            w.leaves = [(path, add(b, x, [_Ref(mod, name, is_param, path)], w)) for path, x in inner]
                            self.wrapped.append(w)
                            by_id[id(t)] = w
                            continue
                        by_id[id(t)] = add(b, t, [ref])
        # per-block element range in each arena (empty ranges sit at the previous block's end)
        for dtype, end in cursor.items():
            align = max(1, ALIGN_BYTES // torch.empty((), dtype=dtype).element_size())
            ranges, last = [], 0
            for b in range(len(blocks)):
                es = [e for e in self.by_block[b] if e.dtype == dtype]
                if es:
                    lo = min(e.offset for e in es)
                    hi = -(-max(e.offset + e.span for e in es) // align) * align
                    ranges.append((lo, hi))
                    last = hi
                else:
                    ranges.append((last, last))
            self.block_range[dtype] = ranges
            cursor[dtype] = -(-end // align) * align
        self._sizes = cursor

    def _bounds(self, dtype: torch.dtype, n: int) -> list[int]:
        """Where ``dtype``'s segments start (block boundaries, about ``SEGMENT_BYTES`` apart), then ``n``."""
        bounds = [0]
        runs = self._adopt.get(dtype, {})        # segments taken over: cut where each starts and ends, not inside
        if not (self._pack_wanted and dtype in PACKABLE):     # packing works on the whole arena
            for lo, _ in self.block_range[dtype][1:]:
                if not bounds[-1] < lo < n:
                    continue
                if bounds[-1] in runs:
                    if lo == runs[bounds[-1]][0]:
                        bounds.append(lo)
                elif lo in runs or (lo - bounds[-1]) * dtype.itemsize >= SEGMENT_BYTES:
                    bounds.append(lo)
        return bounds + [n]

    def _adoptable(self, old: "HostStore | None") -> dict[torch.dtype, dict[int, tuple[int, torch.Tensor]]]:
        """Per dtype, ``{start: (end, segment)}``: the segments of ``old`` this copy can hold as they are. A segment
        qualifies when the weights in it are exactly the weights of consecutive blocks here (every one of them
        still bound to it), at the offsets this layout gives them, and it is as long as their range here."""
        found: dict[torch.dtype, dict[int, tuple[int, torch.Tensor]]] = {}
        if old is None or old.inference != self.inference:
            return found
        for dtype, arena in old.arenas.items():
            if dtype not in self._sizes or (self._pack_wanted and dtype in PACKABLE) or dtype in old._planes:
                continue
            segs = [(s.data_ptr(), s.data_ptr() + tensor_nbytes(s), s) for s in arena.tensors() if s.numel()]
            segs.sort(key=lambda x: x[0])
            starts = [p0 for p0, _, _ in segs]
            held = {}                                         # segment -> how many of old's weights it holds
            for e in old.entries:
                if e.dtype == dtype and e.host_view is not None:
                    seg = arena.segments[arena.index(e.offset)]
                    if seg is not None:
                        held[id(seg)] = held.get(id(seg), 0) + 1

            def where(e: _Entry) -> tuple[int, int] | None:
                t = e.refs[0].get()
                v = subclass.plain(t.data) if t is not None else None
                if (v is None or v.device.type != "cpu" or v.dtype != dtype or tuple(v.shape) != e.shape
                        or tuple(v.stride()) != e.stride):
                    return None
                k = bisect.bisect_right(starts, v.data_ptr()) - 1
                return (k, v.data_ptr() - segs[k][0]) if k >= 0 and v.data_ptr() < segs[k][1] else None

            size = dtype.itemsize
            ranges = self.block_range[dtype]
            blocks: dict[int, list[tuple[int, int]]] = {}     # old segment -> (block here, its byte offset there)
            broken: set[int] = set()
            for b, es in enumerate(self.by_block):
                es = [e for e in es if e.dtype == dtype]
                if not es:
                    continue
                at = [where(e) for e in es]
                ks = {a[0] for a in at if a is not None}
                bases = {rel - (e.offset - ranges[b][0]) * size for e, a in zip(es, at) if a is not None
                         for rel in (a[1],)}
                if None in at or len(ks) != 1 or len(bases) != 1:
                    broken |= ks
                    continue
                blocks.setdefault(ks.pop(), []).append((b, bases.pop()))
            for k, bs in blocks.items():
                seg = segs[k][2]
                first, last = bs[0][0], bs[-1][0]
                start = ranges[first][0]
                end = ranges[last + 1][0] if last + 1 < len(ranges) else self._sizes[dtype]
                mine = {b for b, _ in bs}
                if (k in broken or end - start != seg.numel()
                        or any(base != (ranges[b][0] - start) * size for b, base in bs)
                        or any(ranges[b][0] != ranges[b][1] for b in range(first, last + 1) if b not in mine)
                        or held.get(id(seg)) != sum(1 for b in mine for e in self.by_block[b] if e.dtype == dtype)):
                    continue
                found.setdefault(dtype, {})[start] = (end, seg)
        return found

    def _allocate_and_stage(self, transport: Transport, pin: bool) -> None:
        """Allocate the segments in block order, each just before its first block is staged, and bind each block's
        weights to their copies once staged: their old storage goes as the copy grows."""
        for dtype, n in self._sizes.items():
            self.arenas[dtype] = _Arena(dtype, self._bounds(dtype, n))
        failed: dict[torch.dtype, PinResult] = {}
        with torch.no_grad(), torch.inference_mode(self.inference):
            for b, block in enumerate(self.by_block):
                for e in block:
                    arena = self.arenas[e.dtype]
                    for i in range(arena.index(e.offset) + 1):
                        if arena.segments[i] is None:
                            self._new_segment(transport, arena, i, pin, failed)
                    e.host_view = arena.view(e.offset, e.shape, e.stride)
                d2h = False
                for e in block:
                    t = e.refs[0].get()
                    arena = self.arenas[e.dtype]
                    if id(arena.segments[arena.index(e.offset)]) not in self._adopted:
                        d2h |= self._stage(e, subclass.plain(t.data), transport)     # taken over: already there
                    e.tensor = t
                if d2h:
                    transport.synchronize()   # one-time: staged device weights must land before we drop them
                for e in block:
                    self._bind_host(e)
                if self._old is not None:     # a rebuild: the old copy of this block goes now, segment by segment
                    self._old._release_module(transport, self.modules[b])
            for arena in self.arenas.values():      # segments no entry reached (alignment padding only)
                for i, seg in enumerate(arena.segments):
                    if seg is None:
                        self._new_segment(transport, arena, i, pin, failed)
        for dtype in self.arenas:
            if not (self._pack_wanted and dtype in PACKABLE):   # its packed form is what streams and is pinned
                self.pin_results[dtype] = failed.get(dtype) or (
                    PinResult(True, "pinned", self.arenas[dtype].nbytes) if pin
                    else PinResult(False, self._unpinned_reason))

    def _new_segment(self, transport: Transport, arena: _Arena, i: int, pin: bool,
                     failed: dict[torch.dtype, PinResult]) -> None:
        end, seg = self._adopt.get(arena.dtype, {}).get(arena.bounds[i], (None, None))
        if seg is not None and end == arena.bounds[i + 1]:
            self._take_over(transport, arena, i, seg, pin, failed)
            return
        seg = torch.empty(arena.bounds[i + 1] - arena.bounds[i], dtype=arena.dtype, device="cpu")
        arena.segments[i] = seg
        if pin and not (self._pack_wanted and arena.dtype in PACKABLE) and seg.numel():
            bad = _pin_each(transport, [seg], self._pinned_arenas)
            if bad is not None:
                failed.setdefault(arena.dtype, bad)

    def _take_over(self, transport: Transport, arena: _Arena, i: int, seg: torch.Tensor, pin: bool,
                   failed: dict[torch.dtype, PinResult]) -> None:
        """Hold the old store's ``seg`` as segment ``i``, its weights where they are: pinned as decided (kept pinned
        when it was, without registering it again)."""
        arena.segments[i] = seg
        self._adopted.add(id(seg))
        self.adopted_bytes += tensor_nbytes(seg)
        self._old._give_up([seg])
        was = self._old._pinned_arenas
        pinned = any(p is seg for p in was)
        if pinned:
            was[:] = [p for p in was if p is not seg]        # its unpinning is this store's now
            if pin or self._deferred:                        # deferred: unpinned later if the decision says so
                self._pinned_arenas.append(seg)
            else:
                transport.unpin(seg)
        elif pin and seg.numel():
            bad = _pin_each(transport, [seg], self._pinned_arenas)
            if bad is not None:
                failed.setdefault(arena.dtype, bad)

    def _drop_entries(self, gone: Sequence[_Entry]) -> None:
        """Forget ``gone`` (entries this store no longer holds)."""
        ids = {id(e) for e in gone}
        if ids:
            self.entries = [e for e in self.entries if id(e) not in ids]
            self.by_block = [[e for e in es if id(e) not in ids] for es in self.by_block]

    def _give_up(self, segments: Sequence[torch.Tensor]) -> None:
        """Forget ``segments`` and the weights in them: a store built next holds them now (``adopt``)."""
        ids = {id(t) for t in segments}
        if not ids:
            return
        for arena in self.arenas.values():
            arena.segments = [None if s is not None and id(s) in ids else s for s in arena.segments]
        gone = [e for e in self.entries
                if e.dtype in self.arenas and self.arenas[e.dtype].segments[self.arenas[e.dtype].index(e.offset)] is None]
        for e in gone:
            e.host_view = e.tensor = None
        self._drop_entries(gone)

    def _release_module(self, transport: Transport, module: nn.Module) -> None:
        """A store built next bound ``module``'s weights to its own copy: what this store still holds of it goes. A
        tensor of it still bound here (one the new copy leaves out: a tail ComfyUI loads) gets its own storage
        first, and each segment left holding nothing is unpinned and let go, so a rebuild holds the streamed bytes
        once plus about a segment, whatever it takes over."""
        b = next((i for i, m in enumerate(self.modules) if m is module), None)
        mine = list(self.by_block[b]) if b is not None else []
        if not mine:
            return
        touched = {(e.dtype, self.arenas[e.dtype].index(e.offset)) for e in mine}
        with torch.no_grad(), torch.inference_mode(self.inference):
            for e in mine:
                self._restore_entry(e, transport)     # nothing to do for a weight the new copy bound
        self._drop_entries(mine)
        left = {(e.dtype, self.arenas[e.dtype].index(e.offset)) for e in self.entries}
        for dtype, i in touched - left:
            seg = self.arenas[dtype].segments[i]
            if seg is not None:
                _unpin_one(transport, seg, self._pinned_arenas)
                self.arenas[dtype].segments[i] = None
            del seg

    def _decide(self, nbytes: int, allocated: bool) -> None:
        self._pin, why = self._decide_pin(nbytes, allocated)
        self._unpinned_reason = why or self._unpinned_reason

    def _pin_after_packing(self, transport: Transport) -> None:
        """Pin what a packed store streams (its planes, and the arenas of dtypes it does not pack) as decided."""
        for dtype, arena in self.arenas.items():
            if dtype in self._planes:
                self.pin_results[dtype] = self._pin_planes(self._planes[dtype], transport, self._pin)
            elif dtype not in PACKABLE:
                if not self._pin:              # segments taken over pinned from the last copy
                    for seg in arena.tensors():
                        _unpin_one(transport, seg, self._pinned_arenas)
                self.pin_results[dtype] = self._pin_segments(transport, arena) if self._pin \
                    else PinResult(False, self._unpinned_reason)

    def _pin_segments(self, transport: Transport, arena: _Arena) -> PinResult:
        """Pin the arena's segments that are not pinned yet (fail-soft): the first failure, else pinned."""
        pinned = {id(t) for t in self._pinned_arenas}
        todo = [seg for seg in arena.tensors() if id(seg) not in pinned and seg.numel()]
        return _pin_each(transport, todo, self._pinned_arenas) or PinResult(True, "pinned", arena.nbytes)

    def _stage(self, e: _Entry, src: torch.Tensor, transport: Transport) -> bool:
        """Copy ``src`` into the entry's arena view. Returns True when it was a device->host copy."""
        if src.device.type == "cpu":
            e.host_view.copy_(src)
            return False
        transport.copy_to_host(src, dst=e.host_view, tag=f"stage:{self.block_names[e.block]}")
        return True

    @property
    def packed(self) -> dict[torch.dtype, PackedArena]:
        """The packed forms that stream (empty when packing is off or ``use_packed`` is False)."""
        return self._planes if self.use_packed else {}

    @staticmethod
    def _on_pack_device(transport: Transport, fn: Callable[[torch.device], Any]) -> Any:
        """``fn(device)`` with the arithmetic on the transport's GPU when there is one; when that GPU is full
        (ComfyUI loaded the rest), on the host: slower, same bytes."""
        if transport.device.type == "cuda":
            try:
                return fn(transport.device)
            except torch.cuda.OutOfMemoryError:
                pass
        return fn(torch.device("cpu"))

    def pack_arenas(self, transport: Transport, pin: bool = True) -> None:
        """Pack each bf16 arena (one-time; the arithmetic runs on the transport's GPU when there is
        one) and pin the packed planes. A store built with ``packed=True`` never pinned its bf16
        arena (nothing copies from it in the hot path); one packed later keeps both pinned."""
        if self._planes:
            return
        for dtype, arena in self.arenas.items():
            if dtype in PACKABLE and len(arena.segments) > 1:
                self._merge_segments(transport, arena)
        t0 = time.perf_counter()
        with torch.inference_mode(False):
            for dtype, arena in self.arenas.items():
                if dtype in PACKABLE and arena.numel():
                    self._planes[dtype] = self._on_pack_device(transport, lambda dev: pack(arena.tensor, device=dev))
        self.pack_seconds = time.perf_counter() - t0
        for dtype, pk in self._planes.items():
            self.pin_results[dtype] = self._pin_planes(pk, transport, pin)
        self._fingerprints = {id(e): self._sample(e) for e in self.entries if e.dtype in self._planes}

    def _merge_segments(self, transport: Transport, arena: _Arena) -> None:
        """Hold ``arena`` as one tensor (packing encodes a whole arena): a store built unpacked and packed later.
        Its weights are rebound to the merged copy, which is pinned where every segment was."""
        pinned = self.arena_pinned(arena.dtype) and self._needs_pinning
        with torch.no_grad(), torch.inference_mode(self.inference):
            whole = torch.empty(arena.numel(), dtype=arena.dtype, device="cpu")
            for s0, seg in zip(arena.bounds, arena.segments):
                whole[s0:s0 + seg.numel()].copy_(seg)
            old = arena.tensors()
            arena.bounds, arena.segments = [0, arena.numel()], [whole]
            for e in self.entries:
                if e.dtype != arena.dtype:
                    continue
                view = e.host_view
                e.host_view = arena.view(e.offset, e.shape, e.stride)
                t = e.refs[0].get()
                if t is not None and t.data_ptr() == view.data_ptr():
                    self._bind_host(e)
        for seg in old:
            _unpin_one(transport, seg, self._pinned_arenas)
        if pinned:
            self.pin_results[arena.dtype] = self._pin_segments(transport, arena)

    def _sample(self, e: _Entry) -> torch.Tensor:
        """Up to 256 evenly spaced values of ``e``'s arena range, as bits (a cheap fingerprint)."""
        return self.arenas[e.dtype].tensor.view(torch.int16)[sample_index(e.offset, e.span)].clone()

    def _fingerprint_holds(self, e: _Entry) -> bool:
        return torch.equal(self._fingerprints[id(e)], self._sample(e))

    def _pin_planes(self, pk: PackedArena, transport: Transport, pin: bool) -> PinResult:
        if not pin:
            return PinResult(False, self._unpinned_reason)
        bad = _pin_each(transport, [t for t in pk.planes() if t.numel()], self._pinned_planes)
        return bad or PinResult(True, "packed planes pinned", pk.nbytes)

    def _repack(self, changed: Sequence[_Entry], transport: Transport) -> None:
        """Re-encode what was re-staged; the escape planes are new tensors, so they are re-pinned."""
        for e in changed:
            if e.dtype in self._planes:
                self._fingerprints[id(e)] = self._sample(e)
        for dtype, pk in self._planes.items():
            ranges = [(e.offset, e.offset + e.span) for e in changed if e.dtype == dtype]
            if not ranges:
                continue
            old = [pk.esc_pos, pk.esc_val]
            arena = self.arenas[dtype].tensor
            self._on_pack_device(transport, lambda dev: repack_ranges(pk, arena, ranges, device=dev))
            for t in old:
                _unpin_one(transport, t, self._pinned_planes)
            if any(pk.sm is p for p in self._pinned_planes):      # the planes are pinned: so are their escapes
                for t in (pk.esc_pos, pk.esc_val):
                    if t.numel() and transport.pin(t).pinned:
                        self._pinned_planes.append(t)
            self._esc_cache = {k: v for k, v in self._esc_cache.items() if k[0] != dtype}

    @staticmethod
    def _bind_host(e: _Entry) -> None:
        for r in e.refs:
            r.get().data = e.host_view

    def refresh(self, transport: Transport, force: Sequence[_Entry] = ()) -> int:
        """Re-stage entries whose tensor was replaced, moved or reshaped since staging. In a packed
        store, also re-pack entries written in place in their arena view (ComfyUI patching or
        restoring a weight with ``copy_``), which no pointer shows: the ``force`` entries, and
        any whose sampled values no longer match the packed form's fingerprint."""
        changed, d2h = [], False
        forced = {id(e) for e in force}
        for e in self.entries:
            t = e.refs[0].get()
            if t is None:
                raise StoreOutdated(f"{self.block_names[e.block]}: a streamed tensor was removed from its module")
            if any(r.get() is not t for r in e.refs[1:]):
                # a weight tied under two names, replaced under one (ComfyUI patches a LoRA key by key and keeps the
                # old object as its backup): the names are two weights now, which this copy does not describe;
                # checked before anything is re-staged (rebinding every name would bind the backup to the patch)
                raise StoreOutdated(f"{self.block_names[e.block]}: a weight tied under two names was replaced under "
                                   "one of them; rebuild the prefetch store")
        with torch.no_grad(), torch.inference_mode(self.inference):
            for e in self.entries:
                t = e.refs[0].get()
                v = subclass.plain(t.data)     # a storage subclass's real layout, not its logical shape
                same = (v.data_ptr() == e.host_view.data_ptr() and v.dtype == e.dtype
                        and tuple(v.shape) == e.shape and tuple(v.stride()) == e.stride and v.device.type == "cpu")
                if same and e.dtype in self._planes and (id(e) in forced or not self._fingerprint_holds(e)):
                    e.tensor = t
                    changed.append(e)      # its values are already in the arena view; only re-pack
                    continue
                if same:
                    e.tensor = t
                    continue
                if v.dtype != e.dtype or tuple(v.shape) != e.shape:
                    raise StoreOutdated(f"{self.block_names[e.block]}: a streamed tensor changed dtype or shape; "
                                       f"rebuild the prefetch store")
                old = e.tensor
                if old is not None and old is not t and old.data_ptr() == e.host_view.data_ptr():
                    # why: the replaced tensor may still be held (ComfyUI's LoRA backup keeps the original
                    # Parameter) and it points at the arena view the new values are about to overwrite
                    old.data = subclass.plain(old.data).clone()
                d2h |= self._stage(e, v, transport)
                e.tensor = t
                changed.append(e)
        if d2h:
            transport.synchronize()   # one-time, outside the hot path: see _stage_all
        for e in changed:
            self._bind_host(e)
        if changed and self._planes:
            self._repack(changed, transport)
        self.restaged += len(changed)
        return len(changed)

    def restore(self, transport: Transport, keep: Sequence[nn.Module] = ()) -> None:
        """Give every streamed tensor its own storage again (on its original device, same values; same strides where
        the tensor is dense, an expanded or overlapping one contiguous) and unpin the arenas. The store is unusable
        afterwards. Each segment is unpinned and let go as soon as its tensors are restored: RAM holds the streamed
        bytes once plus a segment or two, not twice.

        ``keep``: blocks a store built next streams too (a rebuild for another layout). Their tensors stay where
        they are, with every segment holding one of them, for that store to take over or copy from (``adopt``);
        the rest goes now, before that store decides on pinning, and so do the packed planes. A segment that also
        held a block not kept can only be copied from: it is unpinned. That store lets each segment go once it has
        bound the blocks in it (``_release_module``); restore again (without ``keep``) for what it did not."""
        for w in self.wrapped:
            w.host = None      # the engine's handle on a wrapper around host copies would keep their segments
        kept_ids = {id(m) for m in keep}
        kept = [e for e in self.entries if id(self.modules[e.block]) in kept_ids]
        with torch.no_grad(), torch.inference_mode(self.inference):
            for dtype, arena in self.arenas.items():
                by_segment: dict[int, list[_Entry]] = {}
                for e in self.entries:
                    if e.dtype == dtype:
                        by_segment.setdefault(arena.index(e.offset), []).append(e)
                staying = {arena.index(e.offset) for e in kept if e.dtype == dtype}
                for i, seg in enumerate(arena.segments):
                    mixed = False
                    for e in by_segment.get(i, ()):
                        if id(self.modules[e.block]) not in kept_ids:
                            self._restore_entry(e, transport)
                            mixed = True
                    if seg is not None and (i not in staying or mixed):
                        # gone, or only a source to copy from now: a segment that held a block no longer streamed
                        # is never taken over whole, so it is not counted among what Levers holds page-locked
                        _unpin_one(transport, seg, self._pinned_arenas)
                        if i not in staying:
                            arena.segments[i] = None
                    del seg
        transport.synchronize()  # one-time: restored copies must land before the packed planes go
        if kept_ids:
            ids = {id(e) for e in kept}
            self._drop_entries([e for e in self.entries if id(e) not in ids])
            # the packed planes only streamed: the next copy is built from the arenas
            _unpin_all(transport, self._pinned_planes)
            self._planes.clear()
            self._fingerprints.clear()
            return
        self.unpin(transport)
        self.arenas.clear()
        self._planes.clear()
        self.entries.clear()
        self.by_block = [[] for _ in self.by_block]
        self._fingerprints.clear()

    def _restore_entry(self, e: _Entry, transport: Transport) -> None:
        t = e.refs[0].get()
        # the entry's view, and the tensor it bound (ComfyUI may have wrapped the same memory in a new object
        # since), are among the last references to its segment
        view, e.host_view, e.tensor = e.host_view, None, None
        if t is None or t.data_ptr() != view.data_ptr():
            return  # the owner already rebound it elsewhere
        fresh = torch.empty_strided(e.shape, e.stride, dtype=e.dtype, device="cpu")
        fresh.copy_(view)
        if e.orig_device.type != "cpu":
            fresh = transport.copy_to_device(fresh, tag="restore") if e.orig_device == transport.device \
                else fresh.to(e.orig_device)
        for r in e.refs:
            r.get().data = fresh

    def pin_arenas(self, transport: Transport) -> None:
        """Pin the arenas a packed store left unpinned (fail-soft), for plans that stream them as stored; with
        ``decide_pin``, when it allows those bytes on top of what is pinned already."""
        todo = [(d, a) for d, a in self.arenas.items()
                if self._pin and self._needs_pinning and not self.arena_pinned(d) and a.numel()]
        if not todo:
            return
        if self._decide_pin is not None:
            pinned = {id(t) for t in self._pinned_arenas}
            ok, why = self._decide_pin(sum(tensor_nbytes(t) for _, a in todo for t in a.tensors()
                                           if id(t) not in pinned), True)
            if not ok:
                for d, _ in todo:
                    self.pin_results[d] = PinResult(False, why)
                return
        for dtype, arena in todo:
            self.pin_results[dtype] = self._pin_segments(transport, arena)

    def unpin(self, transport: Transport) -> None:
        """Unpin every arena and packed plane this store pinned (their values stay)."""
        _unpin_all(transport, self._pinned_arenas, self._pinned_planes)

    # queries -------------------------------------------------------------------------------
    @property
    def n_blocks(self) -> int:
        return len(self.modules)

    def span(self, dtype: torch.dtype, b0: int, b1: int) -> tuple[int, int]:
        """Element range of blocks [b0, b1) in the ``dtype`` arena."""
        r = self.block_range[dtype]
        return r[b0][0], r[b1 - 1][1]

    def cut_span(self, dtype: torch.dtype, b: int, k: int) -> tuple[int, int]:
        """Element range in the ``dtype`` arena of block ``b``'s first ``k`` tensors (its streamed
        head when the block is split); entries of one dtype sit in increasing offset order."""
        lo = self.block_range[dtype][b][0]
        return lo, lo + self.head_table()[dtype][b][k]

    def head_table(self) -> dict[torch.dtype, list[list[int]]]:
        """Per dtype, per block, the elements (aligned) of its first k tensors, k = 0..len(entries)."""
        if getattr(self, "_heads", None) is None:
            table: dict[torch.dtype, list[list[int]]] = {}
            for dtype, arena in self.arenas.items():
                align = max(1, ALIGN_BYTES // arena.element_size())
                rows = []
                for b in range(self.n_blocks):
                    lo, hi = self.block_range[dtype][b]
                    row, end = [0], lo
                    for e in self.by_block[b]:
                        if e.dtype == dtype:
                            end = max(end, e.offset + e.span)
                        row.append(min(hi, -(-end // align) * align) - lo)
                    rows.append(row)
                table[dtype] = rows
            self._heads = table
        return self._heads

    def head_bytes(self, b: int) -> list[int]:
        """Bytes streamed when block ``b`` streams its first k tensors, for k = 0..len(entries)."""
        table = self.head_table()
        return [sum(table[d][b][k] * a.element_size() for d, a in self.arenas.items())
                for k in range(len(self.by_block[b]) + 1)]

    def arena_pinned(self, dtype: torch.dtype) -> bool:
        """Whether copies from this arena run at full speed: it is pinned, or the device needs no pinning."""
        if not self._needs_pinning:
            return True
        pinned = {id(t) for t in self._pinned_arenas}
        return dtype in self.arenas and all(id(t) in pinned for t in self.arenas[dtype].tensors() if t.numel())

    def wire_bytes(self, dtype: torch.dtype, lo: int, hi: int) -> int:
        """Bytes that cross the bus to fill arena elements [lo, hi): packed or as stored."""
        if hi <= lo:
            return 0
        if dtype not in self.packed:
            return (hi - lo) * self.arenas[dtype].element_size()
        return packed_nbytes(hi - lo, self.escapes(dtype, lo, hi))

    def escapes(self, dtype: torch.dtype, lo: int, hi: int) -> int:
        key = (dtype, lo, hi)
        if key not in self._esc_cache:
            i0, i1 = self.packed[dtype].escapes(lo, hi)
            self._esc_cache[key] = i1 - i0
        return self._esc_cache[key]

    def stream_cost(self, spans: dict[torch.dtype, list[tuple[int, int]]]) -> tuple[int, int]:
        """(wire bytes, staging bytes) to stream these arena spans, one per streamed group: a packed
        dtype needs one device staging buffer (``packed.staging_caps``: its widest group, capped)."""
        wire = staging = 0
        for dtype, ranges in spans.items():
            wire += sum(self.wire_bytes(dtype, lo, hi) for lo, hi in ranges)
            if dtype in self.packed:
                staging += staging_nbytes(max((hi - lo for lo, hi in ranges), default=0))
        return wire, staging

    def group_bytes(self, b0: int, b1: int) -> int:
        total = 0
        for dtype, arena in self.arenas.items():
            lo, hi = self.span(dtype, b0, b1)
            total += (hi - lo) * arena.element_size()
        return total

    def block_bytes(self) -> list[int]:
        return [self.group_bytes(b, b + 1) for b in range(self.n_blocks)]

    def group_wire_bytes(self, b0: int, b1: int) -> int:
        return sum(self.wire_bytes(d, *self.span(d, b0, b1)) for d in self.arenas)

    def head_wire_bytes(self, b: int, k: int) -> int:
        return sum(self.wire_bytes(d, *self.cut_span(d, b, k)) for d in self.arenas)

    @property
    def host_bytes(self) -> int:
        return sum(a.nbytes for a in self.arenas.values()) + sum(p.nbytes for p in self._planes.values())

    @property
    def pinned_bytes(self) -> int:
        return sum(tensor_nbytes(t) for t in self._pinned_arenas + self._pinned_planes)

    @property
    def streams_pinned(self) -> bool:
        """Whether what streams is page-locked (a packed store's planes, else the arenas; the bf16 arena a packed
        store holds beside its planes does not stream): the memory its bandwidth is measured from."""
        return bool(self.pin_results) and all(r.pinned for r in self.pin_results.values())


def sample_index(offset: int, span: int, k: int = 256) -> torch.Tensor:
    """``min(span, k)`` evenly spaced element indices in [offset, offset + span), first and last included.
    Integer arithmetic: float32 ``linspace`` rounds ``span - 1`` up past the end once span > 2^24."""
    k = min(span, k)
    return offset + torch.arange(k, dtype=torch.int64) * (span - 1) // max(1, k - 1)


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(int(s), 1)
    return tuple(reversed(stride))


# --- planning ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class GroupPlan:
    """A concrete grouping with its predicted cost (seconds per forward; None when unmeasured)."""

    blocks_per_group: int
    prefetch_depth: int
    resident_groups: int
    n_groups: int
    device_bytes: int              # remainder + resident groups + slots
    slot_bytes: int
    streamed_bytes: int            # bytes copied host->device per forward
    predicted_s: float | None = None
    floor_s: float | None = None
    compute_s: float | None = None
    transfer_s: float | None = None
    reason: str = ""
    cuts: tuple[int, ...] | None = None   # split plan: per block, how many leading tensors stream
    packed: bool = False                  # bf16 streams losslessly packed (streamed_bytes are packed bytes)

    @property
    def split(self) -> bool:
        return self.cuts is not None

    @property
    def streamed_groups(self) -> int:
        return self.n_groups - self.resident_groups

    @property
    def predicted_hidden(self) -> float | None:
        return _hidden(self.compute_s, self.transfer_s, self.predicted_s)


def _hidden(compute: float | None, transfer: float | None, total: float | None) -> float | None:
    """Share of the transfer time hidden behind compute: 1 = fully overlapped, 0 = serial."""
    if compute is None or transfer is None or total is None:
        return None
    if transfer <= 0:
        return 1.0
    return min(1.0, max(0.0, (compute + transfer - total) / transfer))


def simulate_forward(pre_compute: float, compute: Sequence[float], copy: Sequence[float], depth: int,
                     forwards: int = 3) -> float:
    """Steady-state seconds per forward of the prefetch schedule (last of ``forwards``).

    Model: one copy engine, in issue order; the copy for streamed group p+depth is issued at the
    start of group p and waits for compute issued before it (``wait_compute``: group p-1 done);
    compute of group p waits for its copy. ``pre_compute`` is the non-streamed compute per forward
    (remainder and resident groups), which the wrapped prefetch of the first groups overlaps.
    """
    n = len(compute)
    t_comp = t_copy = 0.0
    ready = [0.0] * n
    for k in range(min(depth, n)):
        t_copy = max(t_copy, t_comp) + copy[k]
        ready[k] = t_copy
    last = 0.0
    for _ in range(forwards):
        start = t_comp
        t_comp += pre_compute
        for p in range(n):
            if n > depth:
                q = (p + depth) % n
                t_copy = max(t_copy, t_comp) + copy[q]
                ready_q = t_copy
            t_comp = max(t_comp, ready[p]) + compute[p]
            if n > depth:
                ready[q] = ready_q
        last = t_comp - start
    return last


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to a slot region's alignment (0 stays 0)."""
    return -(-nbytes // SLOT_ALIGN) * SLOT_ALIGN


def slot_bound(widest_bytes: int, n_dtypes: int, n_tensors: int = 0) -> int:
    """At most the bytes of a device slot for a group of ``widest_bytes`` in ``n_dtypes`` dtypes and ``n_tensors``
    tensors (each dtype's region starts aligned, each tensor in it too): what callers that plan around the engine
    budget for one slot."""
    return widest_bytes + SLOT_ALIGN * n_dtypes + ALIGN_BYTES * n_tensors


def _layout_bytes(store: HostStore, g: int, d: int, r: int) -> tuple[int, int, int, int]:
    """(resident block bytes, slot bytes, streamed bytes per forward, n_groups) for a grouping.
    Streamed bytes are what crosses the bus (packed where the store packs); slot bytes include the
    staging buffer packed groups are copied into before they are unpacked into their slot."""
    n = store.n_blocks
    n_groups = -(-n // g)
    res_blocks = min(n, r * g)
    resident = store.group_bytes(0, res_blocks) if res_blocks else 0
    per_group = [0] * max(0, n_groups - r)
    spans: dict[torch.dtype, list[tuple[int, int]]] = {}
    for dtype, arena in store.arenas.items():
        spans[dtype] = [store.span(dtype, gi * g, min(n, (gi + 1) * g)) for gi in range(r, n_groups)]
        for i, (lo, hi) in enumerate(spans[dtype]):
            per_group[i] += aligned((hi - lo) * arena.element_size())
    slot = max(per_group, default=0)
    streamed, staging = store.stream_cost(spans)
    slots = (d + 1) * slot + staging if n_groups > r else 0
    return resident, slots, streamed, n_groups


def plan_groups(store: HostStore, config: PrefetchConfig, budget_bytes: float, remainder_bytes: int,
                bandwidth: float | None = None, block_compute_s: Sequence[float] | None = None,
                other_compute_s: float = 0.0) -> GroupPlan:
    """Choose group size, depth and resident prefix: fit ``budget_bytes``, then minimise the
    simulated time per forward. Without measured compute, transfers are assumed not to hide, so
    the plan keeps as much resident as fits with the smallest groups.

    With a packed store, plans that stream packed bytes (fewer bytes, plus a staging buffer) and plans
    that stream as stored compete; as stored only when its arena is pinned (else its copies would run at
    pageable speed), or as the fallback when no packed plan fits."""
    args = (config, budget_bytes, remainder_bytes, bandwidth, block_compute_s, other_compute_s)
    if not store.packed:
        return _plan_groups(store, *args)
    packed, failure = None, None
    try:
        packed = replace(_plan_groups(store, *args), packed=True)
    except BudgetExceeded as exc:
        failure = exc
    pinned = all(store.arena_pinned(d) for d in store.packed)
    if packed is not None and not pinned:
        return packed
    store.use_packed = False
    try:
        plain = _plan_groups(store, *args)
    except BudgetExceeded:
        if packed is None:
            raise failure from None
        return packed
    finally:
        store.use_packed = True
    if packed is not None and not _better(plain, packed):
        return packed
    why = ("no packed plan fits the budget (its staging buffer)" if packed is None else
           "streaming as stored is predicted faster at this budget" if plain.predicted_s is not None else
           "streaming as stored moves fewer bytes at this budget (the staging buffer costs resident room)")
    if not pinned:
        why += "; the bf16 arena is not pinned, so those copies run at pageable speed"
    return replace(plain, reason=(plain.reason + "; " if plain.reason else "") + f"as stored: {why}")


def _plan_groups(store: HostStore, config: PrefetchConfig, budget_bytes: float, remainder_bytes: int,
                 bandwidth: float | None, block_compute_s: Sequence[float] | None,
                 other_compute_s: float) -> GroupPlan:
    n = store.n_blocks
    fixed_g, fixed_d, fixed_r = config.blocks_per_group, config.prefetch_depth, config.resident_groups
    gs = [min(fixed_g, n)] if fixed_g != AUTO else list(range(1, n + 1))
    best: GroupPlan | None = None
    held: GroupPlan | None = None     # best plan whose slots hold every streamed group (nothing cycles)
    smallest_need: int | None = None
    for g in gs:
        n_groups = -(-n // g)
        ds = [fixed_d] if fixed_d != AUTO else list(range(1, MAX_AUTO_DEPTH + 1))
        for d in ds:
            rs = [min(fixed_r, n_groups)] if fixed_r != AUTO else list(range(n_groups, -1, -1))
            for r in rs:
                streamed_groups = n_groups - r
                if fixed_d == AUTO and streamed_groups and d >= streamed_groups and d > 1:
                    continue   # deeper than the stream: the slots would just hold everything
                holds_all = 0 < streamed_groups <= d + 1
                if holds_all and config.manage_resident:
                    # each streamed group would keep a slot of its own: nothing would move, and the d + 1 slots
                    # hold at least those groups' bytes. Keep them resident instead
                    r, streamed_groups, holds_all = n_groups, 0, False
                resident, slots, streamed, _ = _layout_bytes(store, g, d, r)
                need = remainder_bytes + resident + slots
                smallest_need = need if smallest_need is None else min(smallest_need, need)
                if need > budget_bytes:
                    continue
                plan = _score(store, g, d, r, n_groups, need, slots, streamed, bandwidth,
                              block_compute_s, other_compute_s)
                if holds_all:       # the caller placed the rest: only when no grouping cycles through the slots
                    held = plan if held is None or _better(plan, held) else held
                elif best is None or _better(plan, best):
                    best = plan
                break   # r descends: the first that fits is the most resident for (g, d)
    if config.partial_blocks and fixed_g in (AUTO, 1) and fixed_r in (AUTO, 0) and n:
        ds = [fixed_d] if fixed_d != AUTO else list(range(1, MAX_AUTO_DEPTH + 1))
        for d in ds:
            found = _split_plan(store, d, budget_bytes, remainder_bytes)
            if found is None:
                continue
            cuts, need, slots, streamed = found
            smallest_need = need if smallest_need is None else min(smallest_need, need)
            plan = _score_split(store, d, cuts, need, slots, streamed, bandwidth, block_compute_s, other_compute_s)
            if best is None or _better(plan, best):
                best = plan
    best = best if best is not None else held
    if best is None:
        raise BudgetExceeded(int(smallest_need or 0), int(budget_bytes), "diffusion_model (group prefetch)",
                             hint="Raise the VRAM budget, use smaller groups (blocks_per_group=1, prefetch_depth=1, "
                                  "resident_groups=0) or quantize the model first so fewer bytes stream.")
    return best


def _split_layout(store: HostStore, cuts: Sequence[int], d: int) -> tuple[int, int, int]:
    """(device bytes of the blocks: resident tails + slots, slot bytes, streamed bytes over the bus)
    of a split plan (slot bytes include a packed store's staging buffer, as in ``_layout_bytes``)."""
    table = store.head_table()
    heads = 0
    per_block = [0] * len(cuts)
    spans: dict[torch.dtype, list[tuple[int, int]]] = {}
    for dtype, arena in store.arenas.items():
        widths = [table[dtype][b][k] for b, k in enumerate(cuts)]
        heads += sum(widths) * arena.element_size()
        for b, w in enumerate(widths):
            per_block[b] += aligned(w * arena.element_size())
        spans[dtype] = [store.cut_span(dtype, b, k) for b, k in enumerate(cuts) if k]
    slot = max(per_block, default=0)
    streamed, staging = store.stream_cost(spans)
    slots = (d + 1) * slot + staging if any(cuts) else 0
    return sum(store.block_bytes()) - heads + slots, slots, streamed


def _split_plan(store: HostStore, d: int, budget_bytes: float,
                remainder_bytes: int) -> tuple[tuple[int, ...], int, int, int] | None:
    """The split plan with ``d + 1`` slots that streams the fewest bytes and fits the budget.

    Every block streams the longest head of its tensors that fits a common cap; the rest of it
    stays resident. Streamed bytes only grow with the cap, so the smallest cap that fits is the
    plan (raising the cap grows the slots by (d + 1) x the step but frees up to n x the step of
    resident tails). Caps are tried in increasing order of head size; the budget the cap leaves over is then
    spent block by block (``spend_leftover``)."""
    heads = [store.head_bytes(b) for b in range(store.n_blocks)]
    total = sum(store.block_bytes())
    for cap in sorted({h for hs in heads for h in hs if h > 0}):
        cuts = tuple(bisect.bisect_right(hs, cap) - 1 for hs in heads)   # heads grow with k
        if sum(1 for k in cuts if k) <= d + 1:
            continue   # the d + 1 slots would hold every streamed head: nothing would cycle
        streamed = sum(hs[k] for hs, k in zip(heads, cuts))
        if remainder_bytes + total - streamed > budget_bytes:
            continue   # even with free slots the resident tails do not fit
        dev, slots, streamed = _split_layout(store, cuts, d)
        if remainder_bytes + dev <= budget_bytes:
            cuts = spend_leftover(heads, cuts, budget_bytes - remainder_bytes - dev, d)
            dev, slots, streamed = _split_layout(store, cuts, d)
            return cuts, remainder_bytes + dev, slots, streamed
    return None


def spend_leftover(heads: Sequence[Sequence[int]], cuts: Sequence[int], spare: float, depth: int) -> tuple[int, ...]:
    """Spend the budget a common cap leaves over on keeping more of each block resident.

    heads[b][k]: bytes block ``b`` streams when its first ``k`` tensors (or modules) stream; cuts[b]: its k.
    One cap for every block moves in steps of one tensor per block (a FLUX block's MLP weight is 75 MB, so one
    step is 57 x 75 MB), which can leave a GiB of the budget unused while those bytes stream every step. Here
    blocks give up the last piece of their streamed head, largest first, while the spare room allows: each piece
    moves from the stream to the resident tail byte for byte, and the slots never grow (they hold the widest
    head, which only shrinks). At least ``depth + 2`` blocks keep streaming: with ``depth + 1`` the slots would
    hold them all and nothing would cycle. Used by the engine and by the ComfyUI bridge's per-module split."""
    cuts = list(cuts)
    streaming = sum(1 for hs, k in zip(heads, cuts) if hs[k])
    while True:
        fits = [(hs[k] - hs[k - 1], -b) for b, (hs, k) in enumerate(zip(heads, cuts))
                if k and 0 < hs[k] - hs[k - 1] <= spare and (hs[k - 1] > 0 or streaming - 1 > depth + 1)]
        if not fits:
            return tuple(cuts)
        step, nb = max(fits)
        cuts[-nb] -= 1
        spare -= step
        streaming -= heads[-nb][cuts[-nb]] == 0


def _score_split(store, d, cuts, need, slots, streamed, bandwidth, block_compute_s, other_compute_s) -> GroupPlan:
    n = store.n_blocks
    plan = GroupPlan(1, d, 0, n, need, slots, streamed, cuts=tuple(cuts),
                     reason="split blocks: streamed heads, resident tails")
    if bandwidth is None or block_compute_s is None:
        return plan
    heads = [store.head_wire_bytes(b, k) for b, k in enumerate(cuts)]
    # a streamed group's compute runs until the next streamed block (resident blocks in between)
    pre, comp, copy = other_compute_s, [], []
    for b in range(n):
        if cuts[b]:
            comp.append(block_compute_s[b])
            copy.append(heads[b] / bandwidth)
        elif comp:
            comp[-1] += block_compute_s[b]
        else:
            pre += block_compute_s[b]
    total_compute = pre + sum(comp)
    transfer = sum(copy)
    predicted = simulate_forward(pre, comp, copy, d) if comp else total_compute
    return replace(plan, predicted_s=predicted, floor_s=max(total_compute, transfer), compute_s=total_compute,
                   transfer_s=transfer)


def _score(store, g, d, r, n_groups, need, slots, streamed, bandwidth, block_compute_s, other_compute_s) -> GroupPlan:
    plan = GroupPlan(g, d, r, n_groups, need, slots, streamed)
    if bandwidth is None or block_compute_s is None:
        return plan
    n = store.n_blocks
    res_blocks = min(n, r * g)
    comp, copy = [], []
    for gi in range(r, n_groups):
        b0, b1 = gi * g, min(n, (gi + 1) * g)
        comp.append(sum(block_compute_s[b0:b1]))
        copy.append(store.group_wire_bytes(b0, b1) / bandwidth)
    pre = other_compute_s + sum(block_compute_s[:res_blocks])
    total_compute = pre + sum(comp)
    transfer = sum(copy)
    predicted = simulate_forward(pre, comp, copy, d) if comp else total_compute
    return replace(plan, predicted_s=predicted, floor_s=max(total_compute, transfer), compute_s=total_compute,
                   transfer_s=transfer)


def _better(a: GroupPlan, b: GroupPlan) -> bool:
    if a.predicted_s is not None and b.predicted_s is not None:
        if a.predicted_s < b.predicted_s * 0.995:
            return True
        if b.predicted_s < a.predicted_s * 0.995:
            return False
    # equal time (or unmeasured): fewer streamed bytes, then less device memory, then shallower
    return (a.streamed_bytes, a.device_bytes, a.prefetch_depth) < (b.streamed_bytes, b.device_bytes, b.prefetch_depth)


# --- timing ------------------------------------------------------------------------------------

class _Clock:
    """Compute-stream timestamps: CUDA events on CUDA (read later, when they have completed),
    ``perf_counter`` on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def ready(self, mark: Any) -> bool:
        return (not self.cuda) or mark.query()

    def elapsed(self, a: Any, b: Any) -> float:
        if self.cuda:
            return a.elapsed_time(b) / 1000.0
        return b - a


def measure_bandwidth(transport: Transport, nbytes: int = 256 * 1024 ** 2, repeats: int = 3,
                      pinned: bool = True) -> float:
    """Host->device bytes/s through ``transport`` from a pinned (when possible and ``pinned``) or pageable buffer:
    the kind of memory the weights will stream from.

    One-time calibration: it synchronises the host, so never call it in the hot path."""
    with torch.inference_mode(False):
        src = torch.empty(nbytes, dtype=torch.uint8)
        pin = transport.pin(src) if pinned else None
        dst = transport.empty((nbytes,), torch.uint8)
    try:
        transport.wait_compute("bandwidth")   # dst comes from compute's pool: work queued there may still use it
        transport.copy_to_device(src, dst, tag="bandwidth")
        transport.synchronize()
        t0 = time.perf_counter()
        for _ in range(repeats):
            transport.copy_to_device(src, dst, tag="bandwidth")
        transport.synchronize()
        seconds = time.perf_counter() - t0
    finally:
        if pin is not None and pin.pinned:
            transport.unpin(src)
    transport.ledger.h2d_bytes -= nbytes * (repeats + 1)   # calibration is not model traffic
    transport.ledger.h2d_copies -= repeats + 1
    transport.ledger.by_tag.pop("bandwidth", None)
    return nbytes * repeats / max(seconds, 1e-9)


# --- the engine --------------------------------------------------------------------------------

@dataclass
class _Slot:
    index: int
    buffer: torch.Tensor     # bytes; each group's dtypes are views of consecutive aligned regions
    group: int | None = None
    event: Any = None
    last_use: int = 0


@dataclass
class ForwardStats:
    h2d_bytes: int = 0
    d2h_bytes: int = 0
    h2d_copies: int = 0
    misses: int = 0
    skipped_groups: int = 0     # streamed groups none of whose blocks ran
    seconds: float | None = None


@dataclass
class _Group:
    index: int
    b0: int
    b1: int
    resident: bool
    tag: str
    nbytes: int = 0
    spans: dict[torch.dtype, tuple[int, int]] = field(default_factory=dict)   # element ranges in the arenas
    entries: list[_Entry] = field(default_factory=list)
    plain: list[_Entry] = field(default_factory=list)        # entries bound by pointer swap
    wrapped: list[_Wrapped] = field(default_factory=list)    # wrapper subclasses with an inner tensor here

    def set_entries(self, entries: list[_Entry]) -> None:
        self.entries = entries
        self.plain = [e for e in entries if e.wrapped is None]
        self.wrapped = list({id(e.wrapped): e.wrapped for e in entries if e.wrapped is not None}.values())


@dataclass
class _Staging:
    """Device buffer a packed dtype's bytes land in before they are unpacked into a slot."""

    values: int
    escapes: int
    sm: torch.Tensor             # uint8 [values]
    nib: torch.Tensor            # uint8 [values / 2]
    esc_pos: torch.Tensor        # int64 [escapes]
    esc_val: torch.Tensor        # int16 [escapes]
    table: torch.Tensor          # int32 [16]

    @property
    def nbytes(self) -> int:
        return sum(tensor_nbytes(t) for t in (self.sm, self.nib, self.esc_pos, self.esc_val, self.table))


class PrefetchHandle:
    """The installed engine. ``stats()`` / ``report()`` describe it; ``remove()`` undoes it."""

    def __init__(self, layout: BlockLayout, config: PrefetchConfig, transport: Transport,
                 store: HostStore, owns_store: bool, bandwidth: float | None, budget_bytes: float,
                 reserve: Callable[[int], None] | None = None,
                 timed_between: Sequence[tuple[int, nn.Module]] = ()):
        self.layout = layout
        self.reserve = reserve
        self.config = config
        self.transport = transport
        self.store = store
        self.owns_store = owns_store
        self.bandwidth = bandwidth
        self.budget_bytes = budget_bytes
        self.device = transport.device
        self.clock = _Clock(self.device)
        self._hooks: list[Any] = []
        self.timed_between = tuple(timed_between)
        self._between_marks: dict[int, Any] = {}
        self._moved: list[tuple[_Ref, torch.Tensor]] = []     # (ref, original object) moved to the device
        self._resident_bufs: dict[torch.dtype, torch.Tensor] = {}
        self._resident_leaves: dict[int, torch.Tensor] = {}    # device views of resident inner tensors
        self._wrappers: dict[tuple[int, int], list[tuple[_Wrapped, torch.Tensor]]] = {}
        self._staging: dict[torch.dtype, _Staging] = {}
        self.slots: list[_Slot] = []
        self.groups: list[_Group] = []
        self.group_of: list[int] = []
        self.stream_order: list[int] = []
        self.bound: int | None = None
        self._use_counter = 0
        self.forwards = 0
        self.last = ForwardStats()
        self._fwd_ledger: dict[str, int] | None = None
        self._fwd_marks: list[tuple[Any, Any]] = []
        self._forward_seconds: list[float] = []
        self._misses = 0
        # routes (see the module docstring): the caller sets route_key before each forward
        self.route_key: Hashable = None
        self._skipped: dict[Hashable, frozenset[int]] = {}   # blocks the last forward under each key did not run
        self._routes: dict[Hashable, list[int]] = {}        # streamed groups each key runs, in order (per layout)
        self._after: dict[Hashable, Hashable] = {}          # the key that came next after each key, last time
        self._key: Hashable = None
        self._route: list[int] = []
        self._ran: set[int] = set()
        self._calibrating = False
        self._replan_pending = False      # a calibrated layout deferred by stats(): built at the next forward
        self._block_marks: dict[int, Any] = {}
        self._block_pairs: list[tuple[int, Any, Any]] = []
        self._fwd_start_mark: Any = None
        self.block_compute_s: list[float] | None = None
        self.other_compute_s: float = 0.0
        self.initial_plan: GroupPlan | None = None
        self.plan: GroupPlan | None = None
        self.notes: list[str] = []
        self.remainder_bytes = 0
        self._removed = False

    # setup ---------------------------------------------------------------------------------
    def _install(self) -> None:
        for w in self.store.wrapped:
            w.host = w.outer()     # what remove() puts back, even when planning fails before _build
        self._onload_remainder()
        self.remainder_bytes = self._device_remainder_bytes()
        plan = plan_groups(self.store, self.config, self.budget_bytes, self.remainder_bytes, self.bandwidth)
        self.initial_plan = plan
        self._build(plan)
        root = self.layout.root
        self._hooks.append(root.register_forward_pre_hook(self._on_forward_start))
        self._hooks.append(root.register_forward_hook(self._on_forward_end))
        for b, (_, block) in enumerate(self.layout.blocks):
            entry, exit_ = entry_exit(block)
            self._hooks.append(entry.register_forward_pre_hook(self._make_pre(b)))
            self._hooks.append(exit_.register_forward_hook(self._make_post(b)))
        for i, (b, block) in enumerate(self.timed_between):
            entry, exit_ = entry_exit(block)
            self._hooks.append(entry.register_forward_pre_hook(self._make_between(i, b, True)))
            self._hooks.append(exit_.register_forward_hook(self._make_between(i, b, False)))

    def _device_remainder_bytes(self) -> int:
        """Device bytes outside the streamed/resident groups that the budget must cover: the
        remainder (when this engine places it) and block tensors that cannot stream."""
        seen, total = set(), 0
        refs = [r.get() for r in self.store.kept_refs]
        if self.config.manage_resident:
            refs += [t for _, t in self.layout.remainder]
        for t in refs:
            if t is None or id(t) in seen:
                continue
            seen.add(id(t))
            total += tensor_nbytes(t)
        return total

    def _onload_remainder(self) -> None:
        """Move block tensors that cannot stream, and (manage_resident) the non-block tensors,
        to the device once."""
        refs: list[_Ref] = list(self.store.kept_refs)
        if self.config.manage_resident:
            in_blocks = {id(sub) for _, b in self.layout.blocks for sub in b.modules()}
            for mod in self.layout.root.modules():
                if id(mod) in in_blocks:
                    continue
                for is_param, table in ((True, mod._parameters), (False, mod._buffers)):
                    refs.extend(_Ref(mod, name, is_param) for name, t in table.items() if t is not None)
        done: dict[int, torch.Tensor] = {}
        with torch.no_grad(), torch.inference_mode(self.store.inference):
            for ref in refs:
                t = ref.get()
                if t is None or t.device == self.device:
                    continue
                if id(t) in done:
                    self._moved.append((ref, t))      # each name is put back on removal
                    _set(ref, done[id(t)])
                    continue
                moved = self._to_device(t, "remainder")
                self._moved.append((ref, t))
                done[id(t)] = moved
                _set(ref, moved)
        if done:                          # compute reads them next: it waits for their copies first
            self.transport.wait(self.transport.record("remainder"), "remainder")

    def _to_device(self, t: torch.Tensor, tag: str) -> torch.Tensor:
        if subclass.is_storage(t):     # the same object kind and attributes around a device copy of its data
            return subclass.like(t, self.transport.copy_to_device(subclass.plain(t.data), tag=tag))
        if _is_plain(t):
            data = self.transport.copy_to_device(t.data, tag=tag)
        else:
            data = t.data.to(self.device)   # tensor subclass: its own .to moves its inner tensors
        if isinstance(t, nn.Parameter):
            return nn.Parameter(data, requires_grad=t.requires_grad)
        return data

    def _build(self, plan: GroupPlan) -> None:
        """Materialise ``plan``: groups, resident buffers, device slots, bound views."""
        store, n = self.store, self.store.n_blocks
        g = plan.blocks_per_group
        self.plan = plan
        for w in store.wrapped:
            w.host = w.outer()      # the wrapper around the host copies, which the module holds between uses
        self.groups, self.group_of = [], [0] * n
        kept: list[tuple[int, int]] = []   # (block, first resident entry) per block with a resident part
        for gi in range(plan.n_groups):
            b0, b1 = gi * g, min(n, (gi + 1) * g)
            if plan.split:
                k = plan.cuts[gi]
                grp = _Group(gi, b0, b1, k == 0, f"group{gi}")
                grp.set_entries(store.by_block[b0][:k])
                spans = {d: store.cut_span(d, b0, k) for d in store.arenas}
                if k < len(store.by_block[b0]):
                    kept.append((b0, k))
            else:
                grp = _Group(gi, b0, b1, gi < plan.resident_groups, f"group{gi}")
                grp.set_entries([e for b in range(b0, b1) for e in store.by_block[b]])
                spans = {d: store.span(d, b0, b1) for d in store.arenas}
                if grp.resident and self.config.manage_resident:
                    kept.extend((b, 0) for b in range(b0, b1))
            for dtype, (lo, hi) in spans.items():
                if hi > lo:
                    grp.spans[dtype] = (lo, hi)
                    grp.nbytes += (hi - lo) * store.arenas[dtype].element_size()
            self.groups.append(grp)
            for b in range(b0, b1):
                self.group_of[b] = gi
        self.stream_order = [grp.index for grp in self.groups if not grp.resident]
        self._routes = {}
        self._route = self.stream_order
        if self.reserve is not None:
            # the device bytes this build allocates (resident buffers, slots, staging), asked for now: the
            # calibrated re-plan asks again for its own layout, after the old slots went back
            self.reserve(max(0, plan.device_bytes - self.remainder_bytes))
        with torch.no_grad(), torch.inference_mode(self.store.inference):
            # why: the buffers below are fresh allocations from the compute stream's pool, whose memory
            # work queued there may still use; the copy stream must not write into them before it ends
            self.transport.wait_compute(tag="build")
            if self.store.packed and not plan.packed:
                self.store.pin_arenas(self.transport)    # streaming as stored from a packed store: pin its arena
            self._allocate_staging()
            self._place_resident(kept)
            if not plan.split and not self.config.manage_resident and plan.resident_groups:
                self.notes.append("resident groups are placed by the caller (manage_resident=False)")
            # static slots of bytes, sized for the widest streamed group (all its dtypes together: per-dtype
            # slots sized for each dtype's widest group would hold more when different groups are widest)
            if self.stream_order:
                width = max(sum(aligned((hi - lo) * d.itemsize) for d, (lo, hi) in self.groups[gi].spans.items())
                            for gi in self.stream_order)
                n_slots = min(plan.prefetch_depth + 1, len(self.stream_order) + 1)
                self.slots = [_Slot(i, self.transport.empty((width,), torch.uint8)) for i in range(n_slots)]
                # copy destinations, device views and device wrappers per (group, slot), created once (none in
                # the hot path)
                self._views: dict[tuple[int, int], list[tuple[_Entry, torch.Tensor]]] = {}
                self._wrappers: dict[tuple[int, int], list[tuple[_Wrapped, torch.Tensor]]] = {}
                self._dst: dict[tuple[int, int], dict[torch.dtype, torch.Tensor]] = {}
                for gi in self.stream_order:
                    grp = self.groups[gi]
                    for s in self.slots:
                        dst, at = {}, 0
                        for dtype, (lo, hi) in grp.spans.items():
                            nbytes = (hi - lo) * dtype.itemsize
                            dst[dtype] = s.buffer[at:at + nbytes].view(dtype)
                            at += aligned(nbytes)
                        self._dst[(gi, s.index)] = dst
                        views = {id(e): dst[e.dtype].as_strided(e.shape, e.stride, dst[e.dtype].storage_offset()
                                                                + e.offset - grp.spans[e.dtype][0])
                                 for e in grp.entries}
                        self._views[(gi, s.index)] = [(e, views[id(e)]) for e in grp.plain]
                        self._wrappers[(gi, s.index)] = [(w, self._device_wrapper(w, views)) for w in grp.wrapped]
        self._slot_of: dict[int, _Slot] = {}
        if self.stream_order and len(self.stream_order) <= len(self.slots):
            self.notes.append(f"only {len(self.stream_order)} streamed group(s) for {len(self.slots)} device slots "
                              f"(prefetch_depth={plan.prefetch_depth}): each keeps its slot after the first forward, "
                              "so nothing moves per step")
        fixed_r = self.config.resident_groups
        if self.config.manage_resident and fixed_r != AUTO and plan.resident_groups > fixed_r and not plan.split:
            self.notes.append(f"resident_groups={fixed_r} would leave {plan.n_groups - fixed_r} streamed group(s) for "
                              f"{plan.prefetch_depth + 1} device slots: each would keep its slot and nothing would "
                              "move, on more memory than those blocks take resident; all groups are resident")

    def _allocate_staging(self) -> None:
        """One staging buffer per packed dtype, sized for its widest streamed group (values and escapes)."""
        if not self.plan.packed:
            return
        for dtype in self.store.packed:
            ranges = [self.groups[gi].spans[dtype] for gi in self.stream_order if dtype in self.groups[gi].spans]
            if not ranges:
                continue
            values, escapes = staging_caps(max(hi - lo for lo, hi in ranges))
            e = self.transport.empty
            table = self.transport.copy_to_device(self.store.packed[dtype].table, e((16,), torch.int32),
                                                  tag="packed-table")
            self._staging[dtype] = _Staging(values, escapes, e((values,), torch.uint8), e((values // 2,), torch.uint8),
                                            e((escapes,), torch.int64), e((escapes,), torch.int16), table)

    def _copy_range(self, dtype: torch.dtype, lo: int, hi: int, dst: torch.Tensor, tag: str) -> None:
        """Fill ``dst`` with arena elements [lo, hi): one copy as stored, or for a packed dtype its
        packed bytes into the staging buffer, then unpacked into ``dst`` on the copy stream (in
        pieces when the range is wider than the staging buffer, e.g. the resident part)."""
        st = self._staging.get(dtype)
        if st is None:
            for piece, at in self.store.arenas[dtype].pieces(lo, hi):
                self.transport.copy_to_device(piece, dst[at:at + piece.numel()], tag=tag)
            return
        pk = self.store.packed[dtype]
        for a, b, i0, i1 in pk.pieces(lo, hi, st.values, st.escapes):
            n, m, h = b - a, i1 - i0, (b - a + 1) // 2
            self.transport.copy_to_device(pk.sm[a:b], st.sm[:n], tag=tag)
            self.transport.copy_to_device(pk.nib[a // 2:a // 2 + h], st.nib[:h], tag=tag)
            if m:
                self.transport.copy_to_device(pk.esc_pos[i0:i1], st.esc_pos[:m], tag=tag)
                self.transport.copy_to_device(pk.esc_val[i0:i1], st.esc_val[:m], tag=tag)
            out = dst[a - lo:b - lo]
            self.transport.on_copy_stream(
                lambda n=n, m=m, h=h, a=a, out=out: unpack(st.sm[:n], st.nib[:h], st.table, st.esc_pos[:m],
                                                           st.esc_val[:m], a, out),
                tag=tag, nbytes=tensor_nbytes(out))

    def _place_resident(self, kept: Sequence[tuple[int, int]]) -> None:
        """Copy the resident parts (whole resident blocks, tails of split blocks) to one device
        buffer per dtype, one copy per contiguous arena range, and bind their tensors for good."""
        store = self.store
        for dtype, arena in store.arenas.items():
            ranges: list[list[int]] = []            # merged [lo, hi) element ranges in the arena
            for b, k in kept:
                lo = store.block_range[dtype][b][0] + store.head_table()[dtype][b][k]
                hi = store.block_range[dtype][b][1]
                if hi <= lo:
                    continue
                if ranges and ranges[-1][1] == lo:
                    ranges[-1][1] = hi
                else:
                    ranges.append([lo, hi])
            if not ranges:
                continue
            buf = self.transport.empty((sum(hi - lo for lo, hi in ranges),), dtype)
            base, where = 0, []
            for lo, hi in ranges:
                self._copy_range(dtype, lo, hi, buf[base:base + hi - lo], tag="resident")
                where.append((lo, hi, base))
                base += hi - lo
            self._resident_bufs[dtype] = buf
            for b, k in kept:
                for e in store.by_block[b][k:]:
                    if e.dtype != dtype:
                        continue
                    lo, _, at = next(w for w in where if w[0] <= e.offset < w[1])
                    view = buf.as_strided(e.shape, e.stride, at + e.offset - lo)
                    if e.wrapped is None:
                        _bind(e, view)
                    else:
                        self._resident_leaves[id(e)] = view
        # wrapper subclasses all of whose inner tensors are resident: a device wrapper, for good
        for w in store.wrapped:
            if all(id(e) in self._resident_leaves for _, e in w.leaves):
                w.set(self._device_wrapper(w, {}))
        if self._resident_bufs:
            ev = self.transport.record("resident")
            self.transport.wait(ev, "resident")

    def _teardown(self) -> None:
        """Undo ``_build``: every streamed and resident tensor back on its host view."""
        if self.bound is not None:
            self._release(self.bound)
        self.transport.synchronize()   # one-time (re-plan / remove): in-flight copies must finish first
        for w in self.store.wrapped:
            if w.host is not None:
                w.set(w.host)
        for e in self.store.entries:
            HostStore._bind_host(e)
        self.slots, self._slot_of, self._resident_bufs, self._staging = [], {}, {}, {}
        self._views, self._dst, self._wrappers, self._resident_leaves = {}, {}, {}, {}

    def _device_wrapper(self, w: _Wrapped, views: dict[int, torch.Tensor]) -> torch.Tensor:
        """``w``'s wrapper around device copies of its inner tensors: those in ``views`` (a slot), else
        resident ones."""
        return subclass.rebuild(w.host, {path: views.get(id(e), self._resident_leaves.get(id(e)))
                                         for path, e in w.leaves})

    # hooks ---------------------------------------------------------------------------------
    def _make_pre(self, b: int):
        @torch.compiler.disable
        def pre_hook(module, args):
            self._enter_block(b)
        return pre_hook

    def _make_post(self, b: int):
        @torch.compiler.disable
        def post_hook(module, args, output):
            self._exit_block(b)
        return post_hook

    def _make_between(self, i: int, b: int, enter: bool):
        """Timing only, on the calibration forward: block ``i`` of ``timed_between``, whose compute counts with
        streamed block ``b``'s."""
        @torch.compiler.disable
        def hook(module, args, *output):
            if not self._calibrating:
                return
            if enter:
                self._between_marks[i] = self.clock.mark()
            elif i in self._between_marks:
                self._block_pairs.append((b, self._between_marks.pop(i), self.clock.mark()))
        return hook

    @torch.compiler.disable
    def _on_forward_start(self, module, args):
        self._collect_timings()
        # Calibrate on the second forward: the first pays one-time costs (kernel autotuning,
        # allocator growth, cold caches) that inflated per-block compute ~2x on an H200.
        # (a forward that skips blocks leaves them unmeasured: the next forward measures instead)
        self._calibrating = (self.forwards >= CALIBRATION_FORWARD and self.block_compute_s is None
                             and getattr(self, "_calibration_pairs", None) is None)
        self._fwd_ledger = self.transport.ledger.snapshot()
        self._misses = 0
        self._fwd_start_mark = self.clock.mark()
        self._block_pairs = []
        self._key, self._ran = self.route_key, set()
        self._route = self._route_for(self._key)
        # copy the first streamed groups now, overlapping the embedders / resident prefix
        # (no-op when the previous forward's wrap-around already brought them in)
        if self._route:
            self._prefetch(self._route[: self.plan.prefetch_depth], protect=set())

    @torch.compiler.disable
    def _on_forward_end(self, module, args, output):
        if self.bound is not None:
            self._release(self.bound)
        start, self._fwd_start_mark = self._fwd_start_mark, None
        if start is None:
            # installed while this forward ran (its pre-hooks were already collected): not a forward to count
            return
        end = self.clock.mark()
        self._fwd_marks.append((start, end))
        before, after = self._fwd_ledger or {}, self.transport.ledger.snapshot()
        skipped = frozenset(b for b in range(self.store.n_blocks) if b not in self._ran)
        if self._skipped.get(self._key, frozenset()) != skipped:
            self._skipped[self._key] = skipped
            self._routes.pop(self._key, None)
        self._after[getattr(self, "_prev_key", self._key)] = self._key
        self._prev_key = self._key
        self.last = ForwardStats(
            h2d_bytes=after["h2d_bytes"] - before.get("h2d_bytes", 0),
            d2h_bytes=after["d2h_bytes"] - before.get("d2h_bytes", 0),
            h2d_copies=after["h2d_copies"] - before.get("h2d_copies", 0),
            misses=self._misses,
            skipped_groups=len(self.stream_order) - len(self._route_for(self._key)))
        if self._calibrating and skipped and self.forwards < CALIBRATION_FORWARD + CALIBRATION_RETRIES:
            self._calibrating = False       # blocks went unmeasured: a later forward calibrates
        self.forwards += 1
        if self._calibrating:
            self._calibration_pairs = (self._block_pairs, start, end)
            self._calibrating = False
            if not self.clock.cuda:
                self._collect_timings()   # CPU marks are ready now; CUDA ones are read next forward

    def _enter_block(self, b: int) -> None:
        self._ran.add(b)
        g = self.group_of[b]
        grp = self.groups[g]
        if not grp.resident and self.bound != g:
            if self.bound is not None:
                self._release(self.bound)
            self._acquire(g)
        if self._calibrating:
            self._block_marks[b] = self.clock.mark()

    def _exit_block(self, b: int) -> None:
        if self._calibrating and b in self._block_marks:
            self._block_pairs.append((b, self._block_marks.pop(b), self.clock.mark()))
        g = self.group_of[b]
        if self.bound == g and b == self.groups[g].b1 - 1:
            self._release(g)

    # schedule ------------------------------------------------------------------------------
    def _acquire(self, g: int) -> None:
        if g not in self._route:               # its key's last forward skipped it: prefetch in the full order
            self._route = self.stream_order
        order = self._route
        # the groups after g, then (wrapping around) those the next forward starts with: the next step or
        # the other CFG half, under the key that followed this one last time
        following = order[order.index(g) + 1:] + self._route_for(self._after.get(self._key, self._key))
        ahead: list[int] = []
        for h in following:
            if h != g and h not in ahead:
                ahead.append(h)
                if len(ahead) == self.plan.prefetch_depth:
                    break
        slot = self._slot_of.get(g)
        if slot is None:                       # not prefetched (first forward, a route that changed, out of order)
            self._misses += 1
            # the groups already prefetched for what comes next keep their slots (at most depth of depth + 1)
            slot = self._load(g, protect=set(ahead))
        self._prefetch(ahead, protect={g})
        # why: compute must not read the slot before the copy that fills it has finished
        self.transport.wait(slot.event, tag=self.groups[g].tag)
        for e, view in self._views[(g, slot.index)]:
            _bind(e, view)
        for w, device_param in self._wrappers[(g, slot.index)]:
            w.set(device_param)
        self._use_counter += 1
        slot.last_use = self._use_counter
        self.bound = g
        note_compute(self.transport, self.groups[g].tag)

    def _route_for(self, key: Hashable) -> list[int]:
        """The streamed groups a forward under ``key`` is expected to run, in order: all but those none of
        whose blocks ran in the last forward under that key."""
        route = self._routes.get(key)
        if route is None:
            skipped = self._skipped.get(key, frozenset())
            route = [gi for gi in self.stream_order
                     if any(b not in skipped for b in range(self.groups[gi].b0, self.groups[gi].b1))]
            self._routes[key] = route
        return route

    def _prefetch(self, groups: Sequence[int], protect: set[int]) -> None:
        keep = set(protect) | set(groups)
        for h in groups:
            if h not in self._slot_of:
                self._load(h, protect=keep)

    def _load(self, h: int, protect: set[int]) -> _Slot:
        slot = self._victim(protect)
        if slot.group is not None:
            self._slot_of.pop(slot.group, None)
        grp = self.groups[h]
        # why: the slot's previous group may still be read by compute issued so far; the copy
        # stream waits for it instead of the host (no record_stream, no host sync)
        self.transport.wait_compute(tag=grp.tag)
        dst = self._dst[(h, slot.index)]
        with torch.inference_mode(self.store.inference):   # slots match the parameters' kind
            for dtype, (lo, hi) in grp.spans.items():
                self._copy_range(dtype, lo, hi, dst[dtype], tag=grp.tag)
        slot.event = self.transport.record(tag=grp.tag)
        slot.group = h
        self._slot_of[h] = slot
        return slot

    def _victim(self, protect: set[int]) -> _Slot:
        free = [s for s in self.slots if s.group is None]
        if free:
            return free[0]
        usable = [s for s in self.slots if s.group not in protect and s.group != self.bound]
        if not usable:
            raise RuntimeError("group prefetch: no free device slot (prefetch window larger than the slots)")
        return min(usable, key=lambda s: s.last_use)

    def _release(self, g: int) -> None:
        for e in self.groups[g].plain:
            HostStore._bind_host(e)
        for w in self.groups[g].wrapped:
            w.set(w.host)
        self.transport.release(tag=self.groups[g].tag)
        self.bound = None

    # calibration, re-planning and stats -----------------------------------------------------
    def _collect_timings(self, rebuild: bool = True) -> None:
        """Read finished timing marks. The calibration forward's per-block compute is read once
        (on CUDA at the start of the next forward; a one-time host sync there, then re-plan)."""
        pending = getattr(self, "_calibration_pairs", None)
        if pending is not None:
            pairs, start, end = pending
            if self.clock.cuda:
                end.synchronize()   # one-time calibration read, never in steady state
            per_block = [0.0] * self.store.n_blocks
            for b, a, z in pairs:
                per_block[b] += self.clock.elapsed(a, z)
            self.block_compute_s = per_block
            # non-block compute: before the first block and after the last one. Gaps between
            # blocks are waits for copies, not compute, so the forward's wall time would overstate it.
            self.other_compute_s = (self.clock.elapsed(start, pairs[0][1]) + self.clock.elapsed(pairs[-1][2], end)
                                    if pairs else self.clock.elapsed(start, end))
            self._calibration_pairs = None
            # the calibration forward ran cold (every group a miss, first touches) and maybe in another layout:
            # "achieved" is the forwards after it
            self._fwd_marks, self._forward_seconds = [], []
            self._replan(rebuild)
        elif rebuild and self._replan_pending:
            self._replan_pending = False
            self._replan()
        while self._fwd_marks and self.clock.ready(self._fwd_marks[0][1]):
            a, z = self._fwd_marks.pop(0)
            self._forward_seconds.append(self.clock.elapsed(a, z))
            self.last.seconds = self._forward_seconds[-1]

    def _replan(self, rebuild: bool = True) -> None:
        """Plan again with the measured compute; a new layout is built only when ``rebuild`` (else the current
        one stays, without predictions, until a forward re-plans it)."""
        if self.bandwidth is None:
            return
        plan = plan_groups(self.store, self.config, self.budget_bytes, self.remainder_bytes, self.bandwidth,
                           self.block_compute_s, self.other_compute_s)
        cur = self.plan
        if (plan.blocks_per_group, plan.prefetch_depth, plan.resident_groups, plan.cuts) != \
                (cur.blocks_per_group, cur.prefetch_depth, cur.resident_groups, cur.cuts):
            if not rebuild:
                self._replan_pending = True
                return
            self._teardown()
            self._build(plan)
        else:
            self.plan = plan   # same shape, now with predictions

    def stats(self) -> dict[str, Any]:
        """Per-forward numbers (last forward) and the layout. Reads timings but never rebuilds the slots: callers
        ask at the end of a run, where a new layout would only allocate device memory to be freed again."""
        self._collect_timings(rebuild=False)
        p = self.plan
        achieved = statistics.median(self._forward_seconds) if self._forward_seconds else None
        resident_dev = sum(tensor_nbytes(b) for b in self._resident_bufs.values())
        return {
            "architecture": self.layout.architecture,
            "blocks": self.store.n_blocks,
            "blocks_per_group": p.blocks_per_group,
            "prefetch_depth": p.prefetch_depth,
            "groups": p.n_groups,
            "resident_groups": p.resident_groups,
            "streamed_groups": len(self.stream_order),
            "split_blocks": (sum(1 for gi, k in enumerate(p.cuts) if 0 < k < len(self.store.by_block[gi]))
                             if p.split else 0),
            "resident_blocks": (sum(1 for k in p.cuts if k == 0) if p.split
                                else min(self.store.n_blocks, p.resident_groups * p.blocks_per_group)),
            "streamed_bytes_per_forward": p.streamed_bytes,
            "resident_bytes": resident_dev + self.remainder_bytes,
            "slot_bytes": sum(tensor_nbytes(s.buffer) for s in self.slots),
            "device_bytes_planned": p.device_bytes,
            "budget_bytes": None if math.isinf(self.budget_bytes) else int(self.budget_bytes),
            "host_bytes": self.store.host_bytes,
            "pinned_bytes": self.store.pinned_bytes,
            "kept_unstreamed": len(self.store.kept),
            "forwards": self.forwards,
            "last_forward": {"h2d_bytes": self.last.h2d_bytes, "d2h_bytes": self.last.d2h_bytes,
                             "h2d_copies": self.last.h2d_copies, "misses": self.last.misses,
                             "skipped_groups": self.last.skipped_groups, "seconds": self.last.seconds},
            "skipping_routes": sum(1 for k in self._skipped if len(self._route_for(k)) < len(self.stream_order)),
            "packed": bool(self._staging),
            "stream_device_bytes_per_forward": sum(self.groups[gi].nbytes for gi in self.stream_order),
            "staging_bytes": sum(st.nbytes for st in self._staging.values()),
            "pack_seconds": self.store.pack_seconds,
            "bandwidth_bytes_per_s": self.bandwidth,
            "compute_s": p.compute_s,
            "transfer_s": p.transfer_s,
            "floor_s": p.floor_s,
            "predicted_s": p.predicted_s,
            "achieved_s": achieved,
            "predicted_hidden": p.predicted_hidden,
            "achieved_hidden": _hidden(p.compute_s, p.transfer_s, achieved),
            "floor_efficiency": (p.floor_s / achieved) if (p.floor_s and achieved) else None,
        }

    def report(self) -> str:
        s, p = self.stats(), self.plan
        lines = [
            f"GroupPrefetch: {s['architecture']} model, {s['blocks']} blocks in {s['groups']} groups of "
            f"{s['blocks_per_group']}; {s['resident_groups']} resident, {s['streamed_groups']} streamed, "
            f"prefetch depth {s['prefetch_depth']} ({len(self.slots)} device slots).",
            *([f"split blocks: {s['split_blocks']} blocks stream a head of their tensors and keep the tail "
               f"resident, {s['resident_blocks']} stay whole on the device (smaller slots leave room for more "
               f"resident weights)."] if p.split else []),
            f"device: {_gb(s['resident_bytes'])} resident + {_gb(s['slot_bytes'])} slots"
            + (f" (budget {_gb(s['budget_bytes'])})" if s["budget_bytes"] is not None else "")
            + f"; host arena {_gb(s['host_bytes'])}, pinned {_gb(s['pinned_bytes'])}.",
            f"per forward: {_gb(s['streamed_bytes_per_forward'])} host->device planned; last forward moved "
            f"{_gb(s['last_forward']['h2d_bytes'])} host->device, {_gb(s['last_forward']['d2h_bytes'])} device->host.",
        ]
        if s["skipping_routes"]:
            lines.append(f"skipped blocks: {s['skipping_routes']} kind(s) of forward skip blocks (skip-layer guidance, "
                         "a model's own skip list); each copies only the groups that run, as its previous forward "
                         f"did (last forward: {s['last_forward']['skipped_groups']} streamed group(s) left out, "
                         f"{s['last_forward']['misses']} loaded on demand).")
        if self.config.packed and not s["packed"] and "as stored:" in p.reason:
            lines.append("packed streaming not used: " + p.reason.split("as stored: ", 1)[1] + ".")
        if s["packed"]:
            dev_b = s["stream_device_bytes_per_forward"]
            lines.append(
                f"packed bf16 (lossless): {_gb(s['streamed_bytes_per_forward'])} cross the bus for {_gb(dev_b)} of "
                f"weights ({s['streamed_bytes_per_forward'] / max(1, dev_b):.2f}x), unpacked on the device through a "
                f"{_gb(s['staging_bytes'])} staging buffer; packing took {s['pack_seconds']:.1f} s (once per store).")
        if s["floor_s"] is not None:
            line = (f"timing: compute {s['compute_s'] * 1e3:.1f} ms, transfer {s['transfer_s'] * 1e3:.1f} ms at "
                    f"{s['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s, floor max(compute, transfer) "
                    f"{s['floor_s'] * 1e3:.1f} ms, predicted {s['predicted_s'] * 1e3:.1f} ms "
                    f"(hides {100 * s['predicted_hidden']:.0f}% of the transfer)")
            if s["achieved_s"] is not None:
                # a floor of 0 (every block resident, nothing measured) has no efficiency to give
                line += (f", achieved {s['achieved_s'] * 1e3:.1f} ms (hides {100 * s['achieved_hidden']:.0f}%"
                         + (f", {100 * s['floor_efficiency']:.0f}% of the floor" if s["floor_efficiency"] is not None
                            else "") + ")")
            lines.append(line + ".")
        elif self.bandwidth is None:
            lines.append("timing: no bandwidth given, so no overlap prediction (pass bandwidth=...).")
        for name, why in self.store.kept[:5]:
            lines.append(f"not streamed: {name} ({why}); it stays with the remainder.")
        if len(self.store.kept) > 5:
            lines.append(f"... and {len(self.store.kept) - 5} more tensors not streamed.")
        lines.extend(self.notes)
        for dtype, r in self.store.pin_results.items():
            if not r.pinned:
                lines.append(f"host arena {dtype} not pinned: {r.reason}.")
                break
        return "\n".join(lines)

    # teardown ------------------------------------------------------------------------------
    def remove(self) -> None:
        """Remove the hooks, free the device buffers and restore the module: every tensor back
        on its original device with its values and strides (the store's own storage is returned
        only when this handle built the store)."""
        if self._removed:
            return
        self._removed = True
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self._teardown()
        with torch.no_grad():
            for ref, orig in reversed(self._moved):
                _set(ref, orig)
        self._moved.clear()
        if self.owns_store:
            self.store.restore(self.transport)


def _gb(n: float | None) -> str:
    if n is None:
        return "?"
    for unit, size in (("GiB", _GIB), ("MiB", 1024 ** 2), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def _set(ref: _Ref, value: torch.Tensor) -> None:
    table = ref.owner._parameters if ref.is_param else ref.owner._buffers
    table[ref.name] = value


def _bind(e: _Entry, view: torch.Tensor) -> None:
    for r in e.refs:
        r.get().data = view


def _module_device_bytes(module: nn.Module, device: torch.device) -> int:
    seen, total = set(), 0
    for t in list(module.parameters()) + list(module.buffers()):
        if id(t) not in seen and t.device == device:
            seen.add(id(t))
            total += tensor_nbytes(t)
    return total


def _auto_budget(module: nn.Module, device: torch.device) -> float:
    if device.type != "cuda":
        return math.inf
    free, total = torch.cuda.mem_get_info(device)
    return free + _module_device_bytes(module, device) - max(_GIB, 0.05 * total)


def apply_group_prefetch(module: nn.Module, config: PrefetchConfig, transport: Transport,
                         bandwidth: float | None = None, store: HostStore | None = None,
                         layout: BlockLayout | None = None,
                         reserve: Callable[[int], None] | None = None,
                         timed_between: Sequence[tuple[int, nn.Module]] = ()) -> PrefetchHandle:
    """Stream ``module``'s transformer blocks through ``transport``.

    ``bandwidth`` (host->device bytes/s; measured once through ``transport`` when None, or pass
    0 to skip) enables auto sizing from the first forward's measured per-block compute; without
    it the auto plan keeps as much resident as fits. ``store``: a
    HostStore built earlier for the same blocks (reused across installs; not restored on
    ``remove``). ``layout``: blocks found earlier (default: ``find_blocks(module)``). ``reserve``:
    called with the device bytes a layout is about to allocate, before it allocates them (a host
    asks its memory manager for that room; again for each re-planned layout). ``timed_between``: (b, block)
    for blocks the host keeps loaded that run between streamed block ``b`` and the next: their compute counts
    with block ``b``'s (the time between two streamed blocks is otherwise taken for a wait on a copy).
    """
    if not isinstance(config, PrefetchConfig):
        raise ConfigError("config", type(config).__name__, "a PrefetchConfig")
    layout = layout or find_blocks(module)
    owns = store is None
    # probed only when asked for: on a GPU the first probe self-checks the unpack kernel (a sync)
    pack_ok, pack_why = packing_supported(transport.device) if config.packed else (False, "not asked for")
    if store is None:
        store = HostStore(layout.blocks, transport, pin=config.pin, packed=config.packed and pack_ok,
                          root=layout.root)
    else:
        store.refresh(transport)
    budget = _auto_budget(module, transport.device) if config.budget_bytes == AUTO else float(config.budget_bytes)
    if bandwidth is None and store.host_bytes:
        bandwidth = measure_bandwidth(transport, nbytes=min(256 * 1024 ** 2, max(1024 ** 2, store.host_bytes)),
                                      pinned=store.streams_pinned)
    store.use_packed = config.packed     # a store packed for another install streams as stored here
    handle = PrefetchHandle(layout, config, transport, store, owns, bandwidth or None, budget, reserve,
                            timed_between)
    if config.packed and not store.packed:
        why = (pack_why if not pack_ok else
               "the store given was built without packing (HostStore(..., packed=True))"
               if any(d in PACKABLE for d in store.arenas) else "no bf16 weights in the streamed blocks")
        handle.notes.append(f"packed streaming off: {why}.")
    try:
        handle._install()
    except BaseException:
        handle.remove()
        raise
    return handle
