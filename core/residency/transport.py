"""One small interface for every host<->device byte the engine moves.

``CudaTransport`` copies on a side stream with events; ``CpuTransport`` does the same
operations synchronously between CPU tensors (a fresh allocation stands in for the device
copy, so pointer-identity tests mean the same thing); ``RecordingTransport`` wraps either and
keeps the schedule, so CPU tests can assert ordering and byte counts without a GPU.
"""
from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from . import subclass


@dataclass
class Ledger:
    """Bytes and copies moved through a transport. ``seconds`` is wall time spent issuing or
    (on CUDA, when timed) executing copies; it is informational, never asserted in tests."""

    h2d_bytes: int = 0
    d2h_bytes: int = 0
    h2d_copies: int = 0
    d2h_copies: int = 0
    decoded_bytes: int = 0             # device bytes written by work run on the copy stream (unpacking)
    seconds: float = 0.0
    by_tag: dict[str, int] = field(default_factory=dict)

    def add(self, direction: str, nbytes: int, tag: str = "") -> None:
        if direction == "h2d":
            self.h2d_bytes += nbytes
            self.h2d_copies += 1
        else:
            self.d2h_bytes += nbytes
            self.d2h_copies += 1
        if tag:
            self.by_tag[tag] = self.by_tag.get(tag, 0) + nbytes

    def snapshot(self) -> dict[str, Any]:
        return {"h2d_bytes": self.h2d_bytes, "d2h_bytes": self.d2h_bytes, "h2d_copies": self.h2d_copies,
                "d2h_copies": self.d2h_copies, "decoded_bytes": self.decoded_bytes, "seconds": round(self.seconds, 6)}

    def reset(self) -> None:
        self.h2d_bytes = self.d2h_bytes = self.h2d_copies = self.d2h_copies = self.decoded_bytes = 0
        self.seconds = 0.0
        self.by_tag.clear()


@dataclass(frozen=True)
class PinResult:
    pinned: bool
    reason: str
    nbytes: int = 0


def tensor_nbytes(t: torch.Tensor) -> int:
    return subclass.nbytes(t)


class Transport:
    """Interface. All engine code that moves weights calls these and nothing else.

    copy_to_device(src, dst=None, tag) -> device tensor  (async on CUDA, ordered after wait_compute)
    copy_to_host(src, dst=None, tag)   -> host tensor    (counted as device->host bytes)
    record(tag)  -> event marking "copies issued so far are done"
    wait(event)  -> the compute stream waits for that event before using the copied tensor
    wait_compute() -> the copy stream waits for compute issued so far (before reusing a slot)
    release(tag) -> a device copy is no longer needed by compute (bookkeeping, no bytes)
    on_copy_stream(fn, tag, nbytes) -> run device work (unpacking a copied buffer) ordered after the
                   copies issued so far and before the next ``record``; ``nbytes``: device bytes it writes
    pin(tensor)  -> page-lock host memory in place where possible; PinResult says what happened
    """

    name = "abstract"
    device: torch.device

    def __init__(self) -> None:
        self.ledger = Ledger()

    def copy_to_device(self, src: torch.Tensor, dst: torch.Tensor | None = None, tag: str = "") -> torch.Tensor:
        raise NotImplementedError

    def copy_to_host(self, src: torch.Tensor, dst: torch.Tensor | None = None, tag: str = "") -> torch.Tensor:
        raise NotImplementedError

    def record(self, tag: str = "") -> Any:
        raise NotImplementedError

    def wait(self, event: Any, tag: str = "") -> None:
        raise NotImplementedError

    def wait_compute(self, tag: str = "") -> None:
        raise NotImplementedError

    def release(self, tag: str = "") -> None:
        pass

    def on_copy_stream(self, fn, tag: str = "", nbytes: int = 0) -> None:
        fn()
        self.ledger.decoded_bytes += nbytes

    def pin(self, t: torch.Tensor) -> PinResult:
        return PinResult(False, f"{self.name} transport does not pin")

    def unpin(self, t: torch.Tensor) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def empty(self, shape, dtype) -> torch.Tensor:
        """Allocate an uninitialised buffer on the transport's device (static slots)."""
        return torch.empty(shape, dtype=dtype, device=self.device)


class CpuTransport(Transport):
    """Synchronous CPU->CPU transport. 'Device' tensors are fresh CPU allocations."""

    name = "cpu"

    def __init__(self) -> None:
        super().__init__()
        self.device = torch.device("cpu")
        self._event_counter = 0

    def copy_to_device(self, src, dst=None, tag=""):
        t0 = time.perf_counter()
        if dst is None:
            dst = torch.empty_like(src, device=self.device, memory_format=torch.preserve_format)
        dst.copy_(src)
        self.ledger.seconds += time.perf_counter() - t0
        self.ledger.add("h2d", tensor_nbytes(src), tag)
        return dst

    def copy_to_host(self, src, dst=None, tag=""):
        if dst is None:
            dst = torch.empty_like(src, device="cpu")
        dst.copy_(src)
        self.ledger.add("d2h", tensor_nbytes(src), tag)
        return dst

    def record(self, tag=""):
        self._event_counter += 1
        return ("event", self._event_counter, tag)

    def wait(self, event, tag=""):
        return None

    def wait_compute(self, tag=""):
        return None


class CudaTransport(Transport):
    """Copies on a dedicated stream; compute waits on per-copy events.

    Why the syncs: ``wait`` makes compute wait for the copy that filled a buffer (else it reads
    garbage); ``wait_compute`` makes the next copy into a reused slot wait for the compute that
    last read it (else the copy overwrites weights still in use). No host synchronisation.
    """

    name = "cuda"

    def __init__(self, device: torch.device | str | int = "cuda", timed: bool = False) -> None:
        super().__init__()
        self.device = torch.device(device)
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.stream = torch.cuda.Stream(device=self.device)
        self.timed = timed

    def copy_to_device(self, src, dst=None, tag=""):
        with torch.cuda.stream(self.stream):
            fresh = dst is None
            if fresh:
                dst = torch.empty_like(src, device=self.device)
            dst.copy_(src, non_blocking=True)
        if fresh:
            # allocated from the copy stream's pool but read by compute: once freed, the caching allocator must
            # not hand the block to a later copy until compute's reads are done
            dst.record_stream(torch.cuda.current_stream(self.device))
        self.ledger.add("h2d", tensor_nbytes(src), tag)
        return dst

    def copy_to_host(self, src, dst=None, tag=""):
        # why: ``src`` may have just been written by compute (a weight patched in place); the copy stream must not
        # read it before those kernels are done
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            if dst is None:
                dst = torch.empty_like(src, device="cpu")
            dst.copy_(src, non_blocking=True)
        self.ledger.add("d2h", tensor_nbytes(src), tag)
        return dst

    def record(self, tag=""):
        ev = torch.cuda.Event()
        ev.record(self.stream)
        return ev

    def wait(self, event, tag=""):
        torch.cuda.current_stream(self.device).wait_event(event)

    def wait_compute(self, tag=""):
        self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def on_copy_stream(self, fn, tag="", nbytes=0):
        # why on the copy stream: the unpacked slot must be complete before the event that compute
        # waits on, and the staging buffer it reads is only overwritten by the next copy there
        with torch.cuda.stream(self.stream):
            fn()
        self.ledger.decoded_bytes += nbytes

    def synchronize(self):
        self.stream.synchronize()

    def pin(self, t):
        return pin_in_place(t)

    def unpin(self, t):
        unpin_in_place(t)


# --- pinning -----------------------------------------------------------------------------------

# The host ranges *we* page-locked: start -> [nbytes, users]. Two Levers stores can hold the same memory (ComfyUI
# re-runs a node on a cached model: the new node's store finds the range the old one pinned, and the old one is
# collected later): each pin of a range inside a registered one takes a use, each unpin gives one back, and the range
# is unregistered when the last use goes.
_REGISTERED: dict[int, list[int]] = {}
_STARTS: list[int] = []           # the keys of _REGISTERED, sorted


def _levers_range(t: torch.Tensor) -> int | None:
    """The start of the range Levers registered that holds all of ``t``'s bytes, or None."""
    if not _STARTS or t.device.type != "cpu":
        return None
    ptr = t.data_ptr()
    i = bisect.bisect_right(_STARTS, ptr) - 1
    if i < 0:
        return None
    start = _STARTS[i]
    return start if ptr + tensor_nbytes(t) <= start + _REGISTERED[start][0] else None


def pinned_by_levers(t: torch.Tensor) -> bool:
    """Is ``t`` inside memory Levers page-locked (so pinning it takes a use of that range, not a new one)?"""
    return _levers_range(t) is not None


def pin_in_place(t: torch.Tensor) -> PinResult:
    """Page-lock a contiguous CPU tensor's memory in place with cudaHostRegister (no copy).

    Fails soft: returns PinResult(False, reason) instead of raising. Never registers memory
    that is already pinned (by ComfyUI or by us): a second registration fails and, on some
    drivers, poisons later pins. Inside a range Levers registered it takes a use of that range
    (``unpin_in_place`` gives it back), so one owner's unpin cannot unpin another's memory.
    """
    nbytes = tensor_nbytes(t)
    if t.device.type != "cpu":
        return PinResult(False, "tensor is not on the CPU", nbytes)
    if not torch.cuda.is_available():
        return PinResult(False, "no CUDA device: nothing to DMA to", nbytes)
    if not t.is_contiguous():
        return PinResult(False, "tensor is not contiguous", nbytes)
    start = _levers_range(t)
    if start is not None:
        _REGISTERED[start][1] += 1
        return PinResult(True, "already pinned by Levers", nbytes)
    if t.is_pinned():
        return PinResult(True, "already pinned (by ComfyUI or torch)", nbytes)
    ptr = t.data_ptr()
    if nbytes == 0:
        return PinResult(False, "empty tensor", 0)
    writable = HostMaps.recent().writable(ptr, nbytes)
    if writable is not True:    # only "writable" is trusted from an older reading: the range may be mapped anew
        writable = HostMaps.recent(max_age_s=0.0).writable(ptr, nbytes)
    if writable is False:
        # registering a read-only mapping needs cudaHostRegisterReadOnly, which not every device supports; the
        # store copies such memory into a writable buffer first (``PinnedStore``)
        return PinResult(False, READ_ONLY_REASON, nbytes)
    try:
        # torch's cudart binding takes plain ints (ctypes objects are rejected on torch 2.11)
        err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 1)  # 1 = portable: pinned for every device, as ComfyUI does
    except (RuntimeError, AttributeError, TypeError) as exc:  # cudart missing or refused
        return PinResult(False, f"cudaHostRegister unavailable: {exc}", nbytes)
    code = cuda_code(err)
    if code != 0:
        discard_pending_cuda_error()
        return PinResult(False, f"cudaHostRegister failed with CUDA error {code} (page-locked limit reached?)", nbytes)
    _REGISTERED[ptr] = [nbytes, 1]
    bisect.insort(_STARTS, ptr)
    return PinResult(True, "pinned in place", nbytes)


def unpin_in_place(t: torch.Tensor) -> None:
    """Give back the use ``pin_in_place`` took; the range is unregistered with its last use."""
    start = _levers_range(t)
    if start is None or not torch.cuda.is_available():
        return
    entry = _REGISTERED[start]
    entry[1] -= 1
    if entry[1] > 0:
        return
    err = torch.cuda.cudart().cudaHostUnregister(start)
    if cuda_code(err) != 0:
        discard_pending_cuda_error()
    del _REGISTERED[start]
    _STARTS.pop(bisect.bisect_left(_STARTS, start))


def cuda_code(err) -> int:
    """The number in a cudart binding's return (an enum with ``.value``, or a plain int)."""
    return int(err.value) if hasattr(err, "value") else int(err)


def discard_pending_cuda_error() -> None:
    """Consume the error a failed cudaHostRegister / Unregister leaves behind.

    The runtime keeps a failed call's error as the thread's "last error", and torch's cudart binding offers no
    cudaGetLastError: the next kernel torch launches checks it and raises it, far from its cause (ComfyUI's
    ``discard_cuda_async_error`` exists for the same reason). A tiny kernel, synchronised, takes it here; the
    failure itself has already been reported by the call's return code."""
    if not torch.cuda.is_available():
        return
    try:
        one = torch.ones(1, dtype=torch.uint8, device="cuda")
        _ = one + one
        torch.cuda.synchronize()
    except RuntimeError:     # the stale error itself, raised by the launch check: consumed
        pass


_MAPS: tuple[float, "HostMaps"] | None = None
READ_ONLY_REASON = "read-only memory (a file mapped read-only: GGUF, or ComfyUI's memory-mapped loader)"


def _page_cache_path(path: str) -> bool:
    """Whether a mapping of ``path`` (the last field of a maps line) is a file's page cache, which the OS counts as
    available RAM. Not shared memory (``/dev/shm``, memfd, System V: swap-backed, not reclaimable like page cache),
    nor device memory (``/dev/nvidia*``, where drivers map pinned host buffers)."""
    return path.startswith("/") and not path.startswith(("/dev/", "/memfd:", "/SYSV"))


class HostMaps:
    """This process's memory mappings: whether each is writable, and which are backed by a file (Linux
    ``/proc/self/maps``).

    Page-locking a read-only file mapping in place fails on most systems (it needs cudaHostRegisterReadOnly)
    and leaves a stale CUDA error behind, so such memory is found before anything is registered. Read once per
    batch of tensors; ``writable`` answers None where the mappings cannot be read (other OSes).

    A file mapping's pages are page cache, which the OS counts as available RAM, unless a private mapping's page
    was written (then it is an anonymous copy): ``page_cache`` says how many bytes of a range are such pages, so
    RAM rules neither count them as held nor as free twice."""

    def __init__(self, spans: list[tuple[int, int, bool]] | None,
                 files: dict[int, tuple[bool, int]] | None = None, smaps_path: str = "/proc/self/smaps") -> None:
        self.spans = spans               # sorted (start, end, writable)
        self._starts = [s for s, _, _ in spans] if spans else []
        self.files = files or {}         # start -> (private, Anonymous bytes or -1 until smaps is read)
        self._smaps_path = smaps_path

    @classmethod
    def read(cls, path: str = "/proc/self/maps", smaps_path: str | None = None) -> "HostMaps":
        try:
            with open(path, encoding="ascii", errors="replace") as f:
                lines = f.read().splitlines()
        except OSError:
            return cls(None)
        spans, files = [], {}
        for line in lines:
            parts = line.split(maxsplit=5)
            if len(parts) < 2 or "-" not in parts[0]:
                continue
            lo, hi = parts[0].split("-", 1)
            start = int(lo, 16)
            spans.append((start, int(hi, 16), "w" in parts[1]))
            if len(parts) >= 6 and parts[4] != "0" and _page_cache_path(parts[5]):
                files[start] = (parts[1][3:4] == "p", -1)
        smaps = smaps_path or (path[:-len("maps")] + "smaps" if path.endswith("maps") else "")
        return cls(sorted(spans), files, smaps)

    @classmethod
    def recent(cls, max_age_s: float = 2.0) -> "HostMaps":
        """The mappings as read at most ``max_age_s`` ago (one read serves a whole batch of pins). Callers trust
        only a "writable" answer from it and read again otherwise (a range freed and mapped anew since may have
        changed); a failed registration still fails soft."""
        global _MAPS
        now = time.monotonic()
        if _MAPS is None or now - _MAPS[0] > max_age_s:
            _MAPS = (now, cls.read())
        return _MAPS[1]

    def _overlaps(self, ptr: int, nbytes: int):
        """(start, end, writable, overlap bytes) of each mapping [ptr, ptr + nbytes) touches."""
        if not self.spans or nbytes <= 0:
            return
        i = max(0, bisect.bisect_right(self._starts, ptr) - 1)
        end = ptr + nbytes
        while i < len(self.spans) and self.spans[i][0] < end:
            lo, hi, w = self.spans[i]
            if hi > ptr:
                yield lo, hi, w, min(hi, end) - max(lo, ptr)
            i += 1

    def writable(self, ptr: int, nbytes: int) -> bool | None:
        """True when every byte of [ptr, ptr + nbytes) is in a writable mapping, False when any is in a
        read-only one, None when unknown (mappings unreadable, or a byte outside every mapping)."""
        if self.spans is None or nbytes <= 0:
            return None
        covered = 0
        for _, _, w, n in self._overlaps(ptr, nbytes):
            if not w:
                return False
            covered += n
        return True if covered >= nbytes else None

    def page_cache(self, ptr: int, nbytes: int) -> int:
        """Bytes of [ptr, ptr + nbytes) that are a file's page cache, not memory of this process: any file mapping
        but a private mapping's written pages (its ``Anonymous`` pages in smaps, spread evenly over the mapping).
        0 where the mappings cannot be read."""
        total = 0
        for lo, hi, _, n in self._overlaps(ptr, nbytes):
            if lo not in self.files:
                continue
            private, anon = self.files[lo]
            if private and anon < 0:
                self._read_anonymous()
                anon = self.files[lo][1]
            written = min(1.0, max(0, anon) / (hi - lo)) if private else 0.0
            total += int(n * (1.0 - written))
        return total

    def _read_anonymous(self) -> None:
        """Each private file mapping's written (anonymous) bytes, from smaps; unreadable counts as all written
        (nothing is then taken for page cache that may be this process's memory)."""
        found: dict[int, int] = {}
        try:
            with open(self._smaps_path, encoding="ascii", errors="replace") as f:
                start = None
                for line in f:
                    head = line.split(maxsplit=1)[0] if line.strip() else ""
                    if "-" in head and not head.endswith(":"):
                        start = int(head.split("-", 1)[0], 16)
                    elif head == "Anonymous:" and start is not None:
                        found[start] = int(line.split()[1]) * 1024
        except (OSError, ValueError):
            pass
        for lo, (private, anon) in list(self.files.items()):
            if private and anon < 0:
                span_end = self.spans[bisect.bisect_left(self._starts, lo)][1]
                self.files[lo] = (True, found.get(lo, span_end - lo))


def pinned_bytes_by_levers() -> int:
    return sum(n for n, _ in _REGISTERED.values())


def pinned_ranges_by_levers() -> list[tuple[int, int]]:
    """(start, nbytes) of each host range Levers page-locked."""
    return [(start, _REGISTERED[start][0]) for start in _STARTS]


# --- recording ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Op:
    kind: str      # "h2d" | "d2h" | "record" | "wait" | "wait_compute" | "release" | "compute" | "decode"
    tag: str
    nbytes: int = 0


class RecordingTransport(Transport):
    """Wraps another transport and records every operation, in order, for tests and reports."""

    def __init__(self, inner: Transport) -> None:
        super().__init__()
        self.inner = inner
        self.device = inner.device
        self.name = f"recording({inner.name})"
        self.ops: list[Op] = []
        self.ledger = inner.ledger

    def copy_to_device(self, src, dst=None, tag=""):
        self.ops.append(Op("h2d", tag, tensor_nbytes(src)))
        return self.inner.copy_to_device(src, dst, tag)

    def copy_to_host(self, src, dst=None, tag=""):
        self.ops.append(Op("d2h", tag, tensor_nbytes(src)))
        return self.inner.copy_to_host(src, dst, tag)

    def record(self, tag=""):
        self.ops.append(Op("record", tag))
        return self.inner.record(tag)

    def wait(self, event, tag=""):
        self.ops.append(Op("wait", tag))
        return self.inner.wait(event, tag)

    def wait_compute(self, tag=""):
        self.ops.append(Op("wait_compute", tag))
        return self.inner.wait_compute(tag)

    def release(self, tag=""):
        self.ops.append(Op("release", tag))
        return self.inner.release(tag)

    def on_copy_stream(self, fn, tag="", nbytes=0):
        self.ops.append(Op("decode", tag, nbytes))
        return self.inner.on_copy_stream(fn, tag, nbytes)

    def note_compute(self, tag: str) -> None:
        """Engines call this when compute of ``tag`` starts, so schedules can be asserted."""
        self.ops.append(Op("compute", tag))

    def pin(self, t):
        return self.inner.pin(t)

    def unpin(self, t):
        return self.inner.unpin(t)

    def synchronize(self):
        return self.inner.synchronize()

    def empty(self, shape, dtype):
        return self.inner.empty(shape, dtype)

    def kinds(self, *kinds: str) -> list[Op]:
        return [op for op in self.ops if op.kind in kinds]


def note_compute(transport: Transport, tag: str) -> None:
    """Record the start of compute on a recording transport; no-op otherwise."""
    if isinstance(transport, RecordingTransport):
        transport.note_compute(tag)


def make_transport(device: torch.device | str | None = None, record: bool = False) -> Transport:
    """The transport for ``device``: CUDA when it is a CUDA device and CUDA works, else CPU."""
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type == "cuda" and torch.cuda.is_available():
        t: Transport = CudaTransport(dev)
    else:
        t = CpuTransport()
    return RecordingTransport(t) if record else t
