"""Phase offload: a component holds its device only during its phase; offload is a pointer swap.

``apply_phase_offload(module, PhaseConfig(...), transport)`` stages one host master per physical
storage (tied weights stay tied), pins the masters once (budgeted, fail-soft), and returns a
``PhaseHandle``:

- ``onload()``  copies every master to the device through the transport and rebinds each
  parameter/buffer to its device view;
- ``offload()`` rebinds each parameter/buffer back to its still-valid host master: zero bytes
  move and ``param.data_ptr()`` equals the master's afterwards;
- ``remove()``  restores the module exactly as it was handed over.

Masters go stale when weights change. The handle notices (a parameter object or its ``.data`` was
replaced, or ``param._version`` moved because of an in-place update through the parameter) and
re-stages: a host replacement is adopted as the new master without a copy; a device-side change
is copied back once (counted as device->host bytes and as ``restaged``). Writes through
``param.data`` are invisible to torch's version counter and so to this check; call ``restage()``
after such patches.

Every onload/offload appends a record to ``handle.ledger`` (bytes each way, seconds, GB/s, peak
device memory) that reports and benchmarks read as plain dicts.
"""
from __future__ import annotations

import contextlib
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Iterator, Sequence

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ..errors import ConfigError, IncompatibleInput
from . import subclass
from .pinned import PinMode, PinnedStore, PinOutcome, StorageGroup, TensorRef, group_by_storage, storage_key
from .transport import Transport, note_compute, tensor_nbytes


@dataclass(frozen=True)
class PhaseConfig:
    """How one component is phase-offloaded.

    name:            label in ledgers and reports ("diffusion_model", "text_encoder", "vae").
    pin:             auto (seed 002's RAM rule) / on / off.
    pin_budget_bytes: explicit cap on bytes this handle may page-lock (replaces the RAM rule).
    sync_onload:     host-synchronise at the end of onload so the ledger's seconds and GB/s
                     measure finished copies (one sync per phase boundary; phases are seconds long).
    """

    name: str = "component"
    pin: PinMode | str = PinMode.AUTO
    pin_budget_bytes: int | None = None
    sync_onload: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "pin", PinMode.parse(self.pin, "pin"))
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError("name", self.name, "a non-empty string", "Name the component, e.g. 'vae'.")
        if self.pin_budget_bytes is not None and (not isinstance(self.pin_budget_bytes, int)
                                                  or self.pin_budget_bytes < 0):
            raise ConfigError("pin_budget_bytes", self.pin_budget_bytes, "None or an int >= 0",
                              "Leave it None to use the host-RAM rule.")


@dataclass
class PhaseRecord:
    """One onload or offload, as reports and benchmarks read it."""

    component: str
    phase: str
    kind: str                   # "onload" | "offload"
    h2d_bytes: int = 0
    d2h_bytes: int = 0
    seconds: float = 0.0
    peak_bytes: int | None = None   # torch.cuda.max_memory_allocated over the phase (CUDA only)
    restaged: int = 0           # tensors whose master had to be re-staged

    @property
    def gbps(self) -> float | None:
        moved = self.h2d_bytes + self.d2h_bytes
        return moved / self.seconds / 1e9 if moved and self.seconds > 0 else None

    def as_dict(self) -> dict[str, Any]:
        gbps = self.gbps
        return {"component": self.component, "phase": self.phase, "kind": self.kind,
                "h2d_bytes": self.h2d_bytes, "d2h_bytes": self.d2h_bytes, "seconds": round(self.seconds, 6),
                "gbps": None if gbps is None else round(gbps, 3), "peak_bytes": self.peak_bytes,
                "restaged": self.restaged}


@dataclass
class PhaseLedger:
    """All records of one handle, plus totals."""

    records: list[PhaseRecord] = field(default_factory=list)

    def totals(self) -> dict[str, Any]:
        on = [r for r in self.records if r.kind == "onload"]
        off = [r for r in self.records if r.kind == "offload"]
        on_bytes, on_s = sum(r.h2d_bytes for r in on), sum(r.seconds for r in on)
        peaks = [r.peak_bytes for r in self.records if r.peak_bytes is not None]
        return {"onloads": len(on), "offloads": len(off), "h2d_bytes": sum(r.h2d_bytes for r in self.records),
                "offload_d2h_bytes": sum(r.d2h_bytes for r in off),
                "onload_seconds": round(on_s, 6),
                "onload_gbps": round(on_bytes / on_s / 1e9, 3) if on_bytes and on_s > 0 else None,
                "peak_bytes": max(peaks) if peaks else None,
                "restaged": sum(r.restaged for r in self.records)}

    def as_dict(self) -> dict[str, Any]:
        return {"records": [r.as_dict() for r in self.records], "totals": self.totals()}


# --- rebinding -------------------------------------------------------------------------------------

def rebind(obj: torch.Tensor, new: torch.Tensor) -> torch.Tensor | None:
    """Point the tensor object ``obj`` (a Parameter or buffer) at ``new`` without copying.

    Plain tensors: ``obj.data = new`` (object identity and autograd flags kept), through an alias
    of ``new``'s storage of ``obj``'s own kind (inference or normal, see ``_same_kind``). Tensor
    subclasses (torchao): ``.data`` assignment silently does nothing there, so the contents are
    swapped with ``torch.utils.swap_tensors``; the returned object then holds ``obj``'s previous
    contents.
    """
    if is_traceable_wrapper_subclass(obj) or is_traceable_wrapper_subclass(new):
        holder = new
        if isinstance(obj, torch.nn.Parameter) and not isinstance(new, torch.nn.Parameter):
            holder = torch.nn.Parameter(new, requires_grad=obj.requires_grad)
        torch.utils.swap_tensors(obj, holder)
        return holder
    obj.data = _same_kind(obj, new)
    return None


def _same_kind(obj: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """``new``'s storage as a tensor of ``obj``'s kind, no copy.

    ComfyUI loads models inside ``torch.inference_mode()``, so their parameters and buffers are
    inference tensors. Given normal data, such a tensor breaks on its next view ("Inference tensors
    do not track version counter": ``model_sampling.sigmas[-1]`` in ComfyUI's sampler, on a GPU);
    the reverse turns a normal tensor into an inference one. The alias keeps the kind.
    """
    if obj.is_inference() == new.is_inference():
        return new
    with torch.inference_mode(obj.is_inference()):
        alias = torch.empty(0, dtype=new.dtype, device=new.device)
        alias.set_(new.untyped_storage(), new.storage_offset(), new.size(), new.stride())
    return alias


def _version(t: torch.Tensor) -> int | None:
    """torch's in-place version counter, or None where it is not tracked (inference tensors)."""
    try:
        return t._version
    except (RuntimeError, AttributeError):
        return None


def _reject_unsupported(name: str, t: torch.Tensor) -> None:
    if subclass.state_outside(t):
        raise IncompatibleInput(name, "a plain or torchao tensor", t,
                                "bitsandbytes keeps its quantization state outside the parameter, so a pointer "
                                "swap would leave it behind; quantize with Levers' own formats or torchao instead.")


# --- slots -----------------------------------------------------------------------------------------

@dataclass
class _Leaf:
    """One plain tensor the handle moves: a parameter/buffer, or an inner tensor of a subclass."""

    name: str
    group: int
    ref: TensorRef
    host: torch.Tensor              # view of the master
    device: torch.Tensor | None = None


@dataclass
class _Slot:
    """One tensor object registered on the module (tied objects appear once, with every holder)."""

    names: list[str]
    obj: torch.Tensor               # the Parameter/buffer object (identity never changes)
    holders: list[tuple[torch.nn.Module, str, bool]]   # (owner, attr, is_param)
    orig_device: torch.device
    leaves: list[_Leaf] = field(default_factory=list)
    subclass: tuple | None = None   # (type, ctx, inner names, size, stride) for wrapper subclasses
    host_obj: torch.Tensor | None = None   # subclass: the host contents swapped out while onloaded
    version: int | None = None      # obj._version when last rebound
    bound_ptr: int = 0              # data_ptr of what we last bound (plain tensors)

    @property
    def name(self) -> str:
        return self.names[0]


def _collect(module: torch.nn.Module) -> list[_Slot]:
    """Every parameter and buffer object of ``module``, once, with all the places it is held."""
    slots: dict[int, _Slot] = {}
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        for table, is_param in ((mod._parameters, True), (mod._buffers, False)):
            for attr, t in table.items():
                if t is None:
                    continue
                full = f"{mod_name}.{attr}" if mod_name else attr
                slot = slots.get(id(t))
                if slot is None:
                    _reject_unsupported(full, t)
                    slot = _Slot(names=[full], obj=t, holders=[], orig_device=t.device)
                    slots[id(t)] = slot
                elif full not in slot.names:
                    slot.names.append(full)
                if (mod, attr, is_param) not in slot.holders:
                    slot.holders.append((mod, attr, is_param))
    return list(slots.values())


def _flatten(name: str, t: torch.Tensor) -> tuple[list[tuple[str, torch.Tensor]], tuple | None]:
    """Plain tensors behind ``t``: itself, or a wrapper subclass's inner tensors (one level)."""
    if not is_traceable_wrapper_subclass(t):
        return [(name, t.detach())], None
    inner_names, ctx = t.__tensor_flatten__()
    inner = [(f"{name}.{n}", getattr(t, n)) for n in inner_names]
    for n, x in inner:
        if is_traceable_wrapper_subclass(x):
            raise IncompatibleInput(n, "a subclass whose inner tensors are plain", x,
                                    "Nested tensor subclasses are not supported by phase offload.")
    return inner, (type(t), ctx, list(inner_names), tuple(t.size()), tuple(t.stride()))


# --- the handle ------------------------------------------------------------------------------------

class PhaseHandle:
    """A module under phase offload. Create with ``apply_phase_offload``."""

    def __init__(self, module: torch.nn.Module, config: PhaseConfig, transport: Transport,
                 store: PinnedStore | None = None) -> None:
        self.module = module
        self.config = config
        self.transport = transport
        self.device = transport.device
        self.store = store or PinnedStore(transport, config.pin, config.pin_budget_bytes)
        self.ledger = PhaseLedger()
        self.onloaded = False
        self.removed = False
        self.pin_outcome: PinOutcome | None = None
        self._groups: list[StorageGroup] = []
        self._phase_count = 0
        self._phase = ""
        self._slots = _collect(module)
        for slot in self._slots:
            dev = slot.orig_device
            if dev.type != "cpu" and dev != self.device:
                raise IncompatibleInput(slot.name, f"a tensor on the CPU or on {self.device}", slot.obj,
                                        f"It lives on {dev}; move the module to one of those first.")
        stage = self._stage_all()
        self._bind_host()
        if stage.d2h_bytes:
            self.ledger.records.append(stage)

    # --- staging ---------------------------------------------------------------------------------

    def _sources(self, slot: _Slot) -> list[tuple[str, torch.Tensor]]:
        """Host tensors to stage a slot from: its current masters if they are still valid, else
        whatever the module holds now (copied home once if it lives on the device)."""
        if slot.leaves and not self._slot_changed(slot):
            return [(lf.name, lf.host) for lf in slot.leaves]
        current = slot.host_obj if slot.host_obj is not None else slot.obj
        leaves, slot.subclass = _flatten(slot.name, current)
        hosted = []
        for n, x in leaves:
            if x.device.type != "cpu":
                x = self.transport.copy_to_host(x, tag=f"stage:{n}")
            hosted.append((n, x))
        return hosted

    def _stage_all(self) -> PhaseRecord:
        """(Re)build masters from valid masters and changed tensors; pin new ones once; no rebinding."""
        rec = PhaseRecord(self.config.name, "stage", "stage")
        d2h0 = self.transport.ledger.d2h_bytes
        with torch.inference_mode(False), torch.no_grad():
            per_slot = [self._sources(slot) for slot in self._slots]
            if self.transport.ledger.d2h_bytes != d2h0:
                self.transport.synchronize()  # copies home must have landed before they are masters
            groups = group_by_storage([item for hosted in per_slot for item in hosted])
            # pinned before the leaves are cut: a group in read-only memory comes back as a writable copy
            self.pin_outcome = self.store.pin_component(self.config.name, groups)
            groups = [self.pin_outcome.relocated.get(gi, g) for gi, g in enumerate(groups)]
            where: dict[str, tuple[int, TensorRef]] = {}
            for gi, g in enumerate(groups):
                for r in g.refs:
                    where[r.name] = (gi, r)
            for slot, hosted in zip(self._slots, per_slot):
                slot.leaves = []
                for n, _ in hosted:
                    gi, r = where[n]
                    slot.leaves.append(_Leaf(n, gi, r, groups[gi].host_view(r)))
        self._groups = groups
        rec.d2h_bytes = self.transport.ledger.d2h_bytes - d2h0
        return rec

    def _bind_host(self) -> None:
        """Rebind every slot to its master views (zero bytes)."""
        with torch.inference_mode(False), torch.no_grad():
            for slot in self._slots:
                if slot.subclass is None:
                    rebind(slot.obj, slot.leaves[0].host)
                    slot.bound_ptr = slot.leaves[0].host.data_ptr()
                else:
                    host = self._build_subclass(slot, [lf.host for lf in slot.leaves])
                    if slot.host_obj is not None:  # onloaded: swap the host contents back in
                        rebind(slot.obj, slot.host_obj)
                        slot.host_obj = None
                    elif not _same_inner(slot.obj, host):
                        rebind(slot.obj, host)
                slot.version = _version(slot.obj)
                for lf in slot.leaves:
                    lf.device = None

    def restage(self) -> int:
        """Re-stage masters from what the module holds now (after patches). Returns tensors moved."""
        if self.onloaded:
            raise RuntimeError(f"{self.config.name}: restage() while onloaded; offload() first "
                               "(offload re-stages changed weights itself)")
        self._stage_all()
        self._bind_host()
        return len(self._slots)

    # --- moving -----------------------------------------------------------------------------------

    def onload(self, phase: str = "") -> dict[str, Any]:
        """Copy every master to the device and rebind to the device copies. Idempotent."""
        self._check_alive()
        self._phase_count += 1
        self._phase = phase or f"phase{self._phase_count}"
        rec = PhaseRecord(self.config.name, self._phase, "onload")
        if self.onloaded:
            return rec.as_dict()
        rec.restaged = self._adopt_host_changes()
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        h2d0 = self.transport.ledger.h2d_bytes
        t0 = time.perf_counter()
        tag = f"onload:{self.config.name}"
        with torch.inference_mode(False), torch.no_grad():
            # Device buffers are allocated on the compute stream; the copy stream must wait for
            # compute already issued, which may still read memory the allocator hands us.
            self.transport.wait_compute(tag)
            bases = [self._copy_group(g, tag) for g in self._groups]
            event = self.transport.record(tag)
            # Compute must not read a weight before its copy has landed.
            self.transport.wait(event, tag)
            for slot in self._slots:
                for lf in slot.leaves:
                    base = bases[lf.group]
                    lf.device = base[_ref_key(lf.ref)] if isinstance(base, dict) else lf.ref.view(
                        base, self._groups[lf.group].span_start)
                if slot.subclass is None:
                    rebind(slot.obj, slot.leaves[0].device)
                    slot.bound_ptr = slot.leaves[0].device.data_ptr()
                else:
                    slot.host_obj = rebind(slot.obj, self._build_subclass(slot, [lf.device for lf in slot.leaves]))
                slot.version = _version(slot.obj)
            if self.config.sync_onload:
                self.transport.synchronize()  # so `seconds` covers the copies, not just their issue
        rec.seconds = time.perf_counter() - t0
        rec.h2d_bytes = self.transport.ledger.h2d_bytes - h2d0
        if cuda:
            rec.peak_bytes = torch.cuda.max_memory_allocated(self.device)
        self.onloaded = True
        note_compute(self.transport, f"phase:{self.config.name}")
        self.ledger.records.append(rec)
        return rec.as_dict()

    def _copy_group(self, g: StorageGroup, tag: str):
        """One copy per storage span (aliases stay aliased), or per distinct view for sparse spans."""
        if not g.per_tensor:
            dst = self.transport.empty((g.host.numel(),), torch.uint8)  # [span_bytes] uint8
            return self.transport.copy_to_device(g.host, dst, tag=tag)
        out: dict[tuple, torch.Tensor] = {}
        for r in g.refs:
            key = _ref_key(r)
            if key not in out:
                out[key] = self.transport.copy_to_device(g.host_view(r), tag=tag)
        return out

    def offload(self) -> dict[str, Any]:
        """Rebind every parameter/buffer to its host master: zero bytes unless weights changed."""
        self._check_alive()
        rec = PhaseRecord(self.config.name, self._phase or "offload", "offload")
        if not self.onloaded:
            return rec.as_dict()
        cuda = self.device.type == "cuda"
        if cuda:
            rec.peak_bytes = torch.cuda.max_memory_allocated(self.device)
        d2h0, h2d0 = self.transport.ledger.d2h_bytes, self.transport.ledger.h2d_bytes
        t0 = time.perf_counter()
        rec.restaged = self._save_device_changes()
        self._bind_host()
        self.onloaded = False
        rec.seconds = time.perf_counter() - t0
        rec.d2h_bytes = self.transport.ledger.d2h_bytes - d2h0
        rec.h2d_bytes = self.transport.ledger.h2d_bytes - h2d0
        self.transport.release(f"offload:{self.config.name}")
        self.ledger.records.append(rec)
        return rec.as_dict()

    @contextlib.contextmanager
    def phase(self, name: str = "") -> Iterator["PhaseHandle"]:
        """``with handle.phase("decode"): ...`` onloads for the block and offloads after it."""
        self.onload(name)
        try:
            yield self
        finally:
            self.offload()

    # --- staleness ---------------------------------------------------------------------------------

    def _slot_changed(self, slot: _Slot) -> bool:
        """Was the slot's tensor replaced since we bound it (object swapped on the module or .data)?"""
        for owner, attr, is_param in slot.holders:
            table = owner._parameters if is_param else owner._buffers
            if table.get(attr) is not slot.obj:
                return True
        if slot.subclass is None:
            return slot.obj.data_ptr() != slot.bound_ptr
        return False

    def _adopt_host_changes(self) -> int:
        """Before onload: a slot replaced while offloaded becomes its own new master (no copy)."""
        changed = [s for s in self._slots if self._slot_changed(s)]
        if not changed:
            return 0
        self._refresh_slots()
        self._stage_all()
        self._bind_host()
        return len(changed)

    def _save_device_changes(self) -> int:
        """Before offload: bring home weights changed on the device (patched in place or replaced)."""
        n = 0
        with torch.inference_mode(False), torch.no_grad():
            for slot in self._slots:
                if (slot.subclass is None and slot.version is not None and not self._slot_changed(slot)
                        and _version(slot.obj) != slot.version):
                    # patched in place on the device: copy the new values into the master itself,
                    # so its pointer (and pin) stay valid
                    self.transport.copy_to_host(slot.obj.detach(), dst=slot.leaves[0].host,
                                                tag=f"restage:{slot.name}")
                    n += 1
            if n:
                self.transport.synchronize()  # the master is read right after this
        replaced = [s for s in self._slots if self._slot_changed(s)]
        if replaced:
            # The module holds new tensors: they become masters (copied home if on the device).
            self._refresh_slots()
            self._stage_all()
        return n + len(replaced)

    def _refresh_slots(self) -> None:
        """Re-collect tensors from the module (objects may have been replaced); keep what we know
        about objects that are still there, so their masters are reused without a copy."""
        old = {id(s.obj): s for s in self._slots}
        fresh = _collect(self.module)
        for s in fresh:
            prev = old.get(id(s.obj))
            if prev is not None:
                s.orig_device, s.host_obj, s.leaves = prev.orig_device, prev.host_obj, prev.leaves
                s.subclass, s.bound_ptr, s.version = prev.subclass, prev.bound_ptr, prev.version
        self._slots = fresh

    # --- helpers / lifecycle -------------------------------------------------------------------------

    def _build_subclass(self, slot: _Slot, inner: list[torch.Tensor]) -> torch.Tensor:
        cls, ctx, names, size, stride = slot.subclass
        return cls.__tensor_unflatten__(dict(zip(names, inner)), ctx, size, stride)

    def _check_alive(self) -> None:
        if self.removed:
            raise RuntimeError(f"{self.config.name}: this phase-offload handle was removed")

    def master_ptrs(self) -> dict[str, int]:
        """name -> data_ptr of each plain tensor's master (tests and reports compare against it)."""
        return {lf.name: lf.host.data_ptr() for s in self._slots for lf in s.leaves}

    @property
    def host_bytes(self) -> int:
        """Bytes of the masters (what an onload moves)."""
        return sum(g.nbytes for g in self._groups)

    def report(self) -> dict[str, Any]:
        """JSON-ready summary for reports and benchmarks."""
        return {"component": self.config.name, "device": str(self.device), "transport": self.transport.name,
                "host_bytes": self.host_bytes, "storages": len(self._groups),
                "tensors": sum(len(s.leaves) for s in self._slots),
                "pin": None if self.pin_outcome is None else self.pin_outcome.as_dict(),
                "onloaded": self.onloaded, "ledger": self.ledger.as_dict()}

    def remove(self) -> None:
        """Offload (zero bytes), unpin, and give the module back as it was handed over.

        Tensors that started on the CPU point at their original storage again; tensors that
        started on the device are copied back there (the only case where remove() moves bytes).
        """
        if self.removed:
            return
        if self.onloaded:
            self.offload()
        with torch.inference_mode(False), torch.no_grad():
            for slot in self._slots:
                if slot.orig_device.type == "cpu":
                    continue
                if slot.subclass is None:
                    rebind(slot.obj, self.transport.copy_to_device(slot.leaves[0].host, tag=f"remove:{slot.name}"))
                else:
                    inner = [self.transport.copy_to_device(lf.host, tag=f"remove:{lf.name}") for lf in slot.leaves]
                    rebind(slot.obj, self._build_subclass(slot, inner))
            self.transport.synchronize()  # copies must land before the pinned masters are unregistered
        self.store.release(self.config.name)
        self._groups = []
        self.removed = True


def _ref_key(r: TensorRef) -> tuple:
    return (r.byte_offset, r.size, r.stride, r.dtype)


def _same_inner(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Do two subclass tensors wrap the same inner storages?"""
    names, _ = a.__tensor_flatten__()
    return all(getattr(a, n).data_ptr() == getattr(b, n).data_ptr() for n in names)


# --- masters for a module someone else moves (ComfyUI's ModelPatcher) -------------------------------

def _storage_id(t: torch.Tensor) -> int:
    """Identity of ``t``'s storage: the same for every tensor object that shares it, new for memory that was
    freed and handed out again at the same address."""
    return t.untyped_storage()._cdata


@dataclass
class _Master:
    host: torch.Tensor              # the host tensor (shares storage with what the module held)
    dev_ptr: int = 0                # data_ptr of the device copy we made (0: none outstanding)
    dev_storage: int = 0            # the device copy's storage (a tensor object re-wrapped around the same
                                    # storage, as ComfyUI's mixed-precision layers do in ``_apply``, is still it)
    dev_version: int | None = None  # that object's _version right after binding


def _ours(m: _Master, t: torch.Tensor) -> bool:
    """``t`` is the device copy ``m``'s table made, untouched since (same storage, same version)."""
    return bool(m.dev_ptr and t.data_ptr() == m.dev_ptr and _storage_id(t) == m.dev_storage
                and _version(t) == m.dev_version and _real_shape(t) == m.host.shape)


# model -> its live master tables (more than one: a PhaseOffload node per branch of a graph on the same model)
_TABLES: "weakref.WeakKeyDictionary[torch.nn.Module, weakref.WeakSet[MasterTable]]" = weakref.WeakKeyDictionary()


@dataclass
class _WrappedMaster:
    """A weight held as a wrapper subclass (ComfyUI's fp8 ``QuantizedTensor``): its own device is fixed when it
    is built, so it moves by object, not by pointer. ``host`` is the module's own wrapper (inner tensors in host
    memory, pinned in place); a device wrapper around copies of them (``subclass.rebuild``) takes its slot on
    load, and ``host`` takes it back on offload: zero bytes."""

    host: torch.Tensor
    leaves: list                    # [(path, host inner tensor)]
    dev: torch.Tensor | None = None           # the device wrapper we built (None: none outstanding)
    dev_versions: tuple[int, ...] = ()        # its inner tensors' _version right after the copy

    @property
    def nbytes(self) -> int:
        return sum(tensor_nbytes(x) for _, x in self.leaves)


def _wrapped_leaves(t: torch.Tensor) -> list | None:
    """The inner tensors of a host wrapper subclass PhaseOffload can move by object, else None."""
    if t.device.type != "cpu":
        return None
    inner = subclass.leaves(t)
    if not inner or any(x.device.type != "cpu" or not x.is_contiguous() or x.numel() == 0 for _, x in inner):
        return None
    return inner


def _set_slot(owner: torch.nn.Module, attr: str, is_param: bool, value: torch.Tensor) -> None:
    (owner._parameters if is_param else owner._buffers)[attr] = value


def _named_tensor_slots(root: torch.nn.Module, prefix: str = ""):
    """(name, owner, attr, is_param, tensor) for every param/buffer under ``root``, tied ones too."""
    for mod_name, mod in root.named_modules(prefix=prefix, remove_duplicate=False):
        for table, is_param in ((mod._parameters, True), (mod._buffers, False)):
            for attr, t in table.items():
                if t is not None:
                    yield (f"{mod_name}.{attr}" if mod_name else attr), mod, attr, is_param, t


class MasterTable:
    """Host masters for a module whose placement another memory manager drives.

    ComfyUI's ModelPatcher decides when and which modules move; this table only makes the moves
    cheap and keeps them exact:

    - ``capture(root)``: every plain tensor in host memory becomes (or stays) its own master:
      no copy, pinned once through the store;
    - ``onload(module)``: tensors still bound to their master are copied through the transport
      and rebound to the copy;
    - ``offload(module)``: tensors still bound to *our* device copy (same object, same pointer,
      same version: nothing patched them) are rebound to their master: zero bytes. Everything
      else (patched, replaced) is left to the manager's own copy.

    Wrapper subclasses (fp8 ``QuantizedTensor``) move by object instead (``_WrappedMaster``).
    """

    def __init__(self, root: torch.nn.Module, component: str, transport: Transport,
                 store: PinnedStore | None = None) -> None:
        self.root = root
        self.component = component
        self.transport = transport
        self.store = store or PinnedStore(transport)
        self.masters: dict[str, _Master] = {}
        self.wrapped: dict[str, _WrappedMaster] = {}
        self._adopted = False                   # wrapped masters taken at load time, not pinned yet
        self.prefixes: dict[int, str] = {}
        self.swapped_bytes = 0                  # offloaded by pointer swap, cumulative
        self.left_bytes = 0                     # device bytes left to the manager's own copy, cumulative
        self.pin_outcome: PinOutcome | None = None
        # host ranges another Levers engine owns (GroupPrefetch's host copy, read when pinning): masters there are
        # not pinned by this table, whose moves never copy them; whether that memory is page-locked is its owner's
        self.foreign: Callable[[], Sequence[tuple[int, int]]] | None = None
        _TABLES.setdefault(root, weakref.WeakSet()).add(self)

    def _prefix(self, module: torch.nn.Module) -> str | None:
        if id(module) not in self.prefixes:
            self.prefixes = {id(m): n for n, m in self.root.named_modules(remove_duplicate=False)}
        return self.prefixes.get(id(module))

    def capture(self) -> int:
        """Adopt host-resident plain tensors as masters (zero copy); pin new ones. Returns count."""
        fresh = 0
        for name, _, _, _, t in _named_tensor_slots(self.root):
            if is_traceable_wrapper_subclass(t):
                w = self.wrapped.get(name)
                if w is not None and (w.host is t or w.dev is t or self._siblings_wrapper(name, t, w) is not None):
                    continue              # still its master, or our (or another table's) device wrapper of it
                inner = _wrapped_leaves(t)
                if inner is not None:
                    self.wrapped[name] = _WrappedMaster(host=t, leaves=inner)
                    fresh += 1
                continue
            if t.device.type != "cpu" or not t.is_contiguous() or subclass.state_outside(t):
                # a bitsandbytes Params4bit keeps its quantization state beside the data: its own ``.to`` moves
                # both, so it is left to the manager's move (a swapped pointer would leave the state behind)
                continue
            m = self.masters.get(name)
            if m is not None and ((m.host.data_ptr() == t.data_ptr() and m.host.shape == _real_shape(t)
                                   and m.host.dtype == t.dtype)
                                  or (m.dev_ptr == t.data_ptr() and _version(t) == m.dev_version)
                                  or self._siblings_copy(name, t, m, claim=False)):
                continue                  # still its master, or our (or another table's) untouched device copy of it
            with torch.inference_mode(False):
                # a storage subclass (GGUF's GGMLTensor) is mastered as a plain alias of its data: its real
                # layout, not the logical shape its ``shape`` reports (the object keeps its attributes)
                self.masters[name] = _Master(host=subclass.plain(t.detach()))
            fresh += 1
        if fresh or self._adopted:
            self._adopted = False
            groups = self._pin()
            if self.pin_outcome.relocated:
                self._move_masters(groups)
        return fresh

    def _pin(self) -> list[StorageGroup]:
        """Offer every master to the store (which pins new ranges and unpins those no longer masters), but those in
        memory another engine owns (``foreign``); the groups offered."""
        # every master by name (two views of one storage that start at the same byte are both in its span)
        named = [(n, m.host) for n, m in self.masters.items()]
        named += [(f"{n}.{'.'.join(path)}", x) for n, w in self.wrapped.items() for path, x in w.leaves]
        groups = group_by_storage(named)
        ranges = self.foreign() if self.foreign is not None else ()
        if ranges:
            groups = [g for g in groups if not any(lo <= g.host.data_ptr() < hi for lo, hi in ranges)]
        self.pin_outcome = self.store.pin_component(self.component, groups)
        return groups

    def let_go(self, names: Collection[str], ranges: Sequence[tuple[int, int]] = ()) -> int:
        """Another engine is about to take over the host memory of the tensors ``names`` (GroupPrefetch builds its
        host copy of the streamed blocks, freeing each block's old memory as the copy takes its place): forget their
        masters, which would hold that memory, and its page-locking, through the build (the bytes twice). Masters
        that point into ``ranges`` (memory about to be freed: the engine's last copy) get memory of their own, and
        a tensor still bound to one is rebound with it. What is left is pinned again, which unpins what is no
        longer a master; the forgotten tensors are captured again, where they then live, at the next ``capture``.
        Returns the masters forgotten."""
        gone = [n for n in self.masters if n in names] + [n for n in self.wrapped if n in names]
        for n in gone:
            self.masters.pop(n, None)
            self.wrapped.pop(n, None)
        moved = 0
        if ranges:
            def inside(x: torch.Tensor) -> bool:
                return any(lo <= x.data_ptr() < hi for lo, hi in ranges)
            all_slots = list(_named_tensor_slots(self.root))
            rebuilt: dict[int, tuple] = {}        # old host wrapper id -> (leaves, wrapper): tied twins share one
            for name, owner, attr, is_param, t in all_slots:
                w = self.wrapped.get(name)
                if w is None or not any(inside(x) for _, x in w.leaves):
                    continue
                if id(w.host) not in rebuilt:
                    with torch.inference_mode(False):
                        leaves = [(path, x.clone() if inside(x) else x) for path, x in w.leaves]
                    rebuilt[id(w.host)] = (leaves, subclass.rebuild(w.host, dict(leaves)))
                old_host = w.host
                w.leaves, w.host = rebuilt[id(old_host)]
                if t is old_host:                 # the module still holds the host wrapper: it moves with it
                    _set_slot(owner, attr, is_param, w.host)
                moved += 1
            slots = {n: t for n, _, _, _, t in all_slots}
            for name, m in self.masters.items():
                if inside(m.host):
                    t = slots.get(name)
                    with torch.inference_mode(m.host.is_inference()):
                        fresh = m.host.clone()
                    if t is not None and t.device.type == "cpu" and t.data_ptr() == m.host.data_ptr():
                        rebind(t, fresh)
                    m.host = fresh
                    moved += 1
        if gone or moved:
            groups = self._pin()
            if self.pin_outcome.relocated:
                self._move_masters(groups)
        return len(gone)

    def _move_masters(self, groups: list) -> None:
        """Point masters, and the module tensors bound to them, at the writable copies the store made of
        read-only memory: a rebind, like an offload, not a copy. Each tensor gets the view of the copy with its own
        offset, size and stride, so views of one storage (a weight and a slice of it) stay what they were and stay
        tied; a tensor with no master (a transposed view) is left on the original memory."""
        old_to_new = {groups[i].key: g for i, g in self.pin_outcome.relocated.items()}

        def moved(x: torch.Tensor) -> torch.Tensor | None:
            g = old_to_new.get(storage_key(x))
            if g is None:
                return None
            return g.host_view(TensorRef("", g.translate(x.storage_offset() * x.element_size()), tuple(x.size()),
                                         tuple(x.stride()), x.dtype))

        rebuilt: dict[int, tuple | None] = {}          # old host wrapper id -> (leaves, wrapper) around the copies
        for name, owner, attr, is_param, t in _named_tensor_slots(self.root):
            w = self.wrapped.get(name)
            if w is not None and t is w.host:
                if id(t) not in rebuilt:                # tied twins share the one rebuilt wrapper
                    moves = [(path, x, moved(x)) for path, x in w.leaves]
                    leaves = [(path, x if new is None else new) for path, x, new in moves]
                    changed = any(new is not None for *_, new in moves)
                    rebuilt[id(t)] = (leaves, subclass.rebuild(t, dict(leaves))) if changed else None
                if rebuilt[id(t)] is not None:
                    w.leaves, w.host = rebuilt[id(t)]
                    _set_slot(owner, attr, is_param, w.host)
                continue
            m = self.masters.get(name)
            if (m is not None and t.device.type == "cpu" and not is_traceable_wrapper_subclass(t)
                    and t.data_ptr() == m.host.data_ptr() and _real_shape(t) == m.host.shape):
                new = moved(m.host)
                if new is not None:
                    rebind(t, new)                      # the module's tensor, still bound to its master
        for m in self.masters.values():                 # then the masters (one whose slot is on the device too)
            new = moved(m.host)
            if new is not None:
                m.host = new

    def onload(self, module: torch.nn.Module, device: torch.device | None = None) -> tuple[int, int]:
        """Copy the masters of tensors under ``module`` that are bound to them, and rebind.

        Returns (bytes moved, tensors left for the manager: no master, and not on ``device``)."""
        prefix = self._prefix(module)
        if prefix is None:
            return 0, 0
        moved, left = 0, 0
        tag = f"onload:{self.component}"
        with torch.inference_mode(False), torch.no_grad():
            # device buffers come from the compute stream's pool; the copy stream must not write
            # into memory that compute issued earlier may still read
            self.transport.wait_compute(tag)
            done: set[int] = set()
            built: dict[int, torch.Tensor] = {}        # host wrapper id -> its device wrapper (tied twins)
            try:
                for name, owner, attr, is_param, t in _named_tensor_slots(module, prefix):
                    w = self.wrapped.get(name)
                    if is_traceable_wrapper_subclass(t) and (w is None or (w.host is not t and w.dev is not t)):
                        # a wrapper ComfyUI put in place since the last capture (it restores a LoRA backup as a
                        # new object): adopted now, pinned at the next capture
                        inner = _wrapped_leaves(t)
                        if inner is not None:
                            w = self.wrapped[name] = _WrappedMaster(host=t, leaves=inner)
                            self._adopted = True
                    if w is not None and (w.host is t or w.dev is t):
                        if w.dev is t:
                            continue                                  # already ours on the device
                        if id(t) not in built:
                            copies = {path: self.transport.copy_to_device(x, self.transport.empty(tuple(x.shape),
                                                                                                  x.dtype), tag=tag)
                                      for path, x in w.leaves}
                            built[id(t)] = subclass.rebuild(t, copies)
                            w.dev_versions = tuple(_version(c) for c in copies.values())
                            moved += w.nbytes
                        w.dev = built[id(t)]
                        _set_slot(owner, attr, is_param, w.dev)
                        done.add(id(t))
                        continue
                    m = self.masters.get(name)
                    if t.data_ptr() in done:
                        continue                                      # a tied twin, already rebound
                    if m is None or t.data_ptr() != m.host.data_ptr() or _real_shape(t) != m.host.shape:
                        if not (m is not None and m.dev_ptr == t.data_ptr()) and (device is None or t.device != device):
                            left += 1
                        continue
                    dev = self.transport.copy_to_device(m.host, self.transport.empty(tuple(m.host.shape),
                                                                                     m.host.dtype), tag=tag)
                    rebind(t, dev)
                    m.dev_ptr, m.dev_storage, m.dev_version = dev.data_ptr(), _storage_id(t), _version(t)
                    done.add(dev.data_ptr())
                    moved += tensor_nbytes(m.host)
            finally:
                if done:
                    # compute must not read a weight before its copy has landed; nor, when an allocation failed
                    # part way (ComfyUI then moves the weights back and frees the copies), reuse their memory
                    self.transport.wait(self.transport.record(tag), tag)
        return moved, left

    def offload(self, module: torch.nn.Module) -> tuple[int, int]:
        """Rebind tensors under ``module`` still bound to our device copy back to their masters.

        Returns (bytes swapped, tensors left for the manager to copy)."""
        prefix = self._prefix(module)
        if prefix is None:
            return 0, 0
        swapped, left = 0, 0
        home: dict[int, _WrappedMaster] = {}      # device wrappers swapped back (tied twins follow)
        done: list[_WrappedMaster] = []           # wrapped weights under this module: no device wrapper kept after
        with torch.inference_mode(False), torch.no_grad():
            for name, owner, attr, is_param, t in _named_tensor_slots(module, prefix):
                w = self.wrapped.get(name)
                if w is not None:
                    done.append(w)
                sw = self._siblings_wrapper(name, t, w) if w is not None else None
                if sw is not None:                        # another table's device wrapper of the same host one
                    w.dev, w.dev_versions, sw.dev = t, sw.dev_versions, None
                if w is not None and (t is w.host or t is w.dev):
                    if t is w.host:
                        continue                                  # already home
                    if id(t) in home or tuple(_version(x) for _, x in subclass.leaves(t) or []) == w.dev_versions:
                        _set_slot(owner, attr, is_param, w.host)   # nothing wrote into our copy: swap back
                        if id(t) not in home:
                            home[id(t)] = w
                            swapped += w.nbytes
                        continue
                m = self.masters.get(name)
                if t.data_ptr() == (m.host.data_ptr() if m else -1):
                    continue                                      # already home (tied twin)
                if m is not None and (_ours(m, t) or self._siblings_copy(name, t, m)):
                    rebind(t, m.host)
                    m.dev_ptr = 0
                    swapped += tensor_nbytes(m.host)
                elif t.device.type != "cpu":
                    left += 1
                    self.left_bytes += tensor_nbytes(t)
        for w in done:
            # swapped back, or left to ComfyUI's own copy (written into, or re-wrapped by ComfyUI): either way
            # the device copies must not outlive the unload through this reference
            w.dev = None
        self.swapped_bytes += swapped
        return swapped, left

    def _siblings(self) -> list["MasterTable"]:
        """The other live tables of this model: another PhaseOffload node on the same model (two branches of one
        graph) keeps its own masters of the same host memory, each pinned by its own store."""
        return [t for t in _TABLES.get(self.root, ()) if t is not self]

    def _siblings_wrapper(self, name: str, t: torch.Tensor, w: _WrappedMaster) -> _WrappedMaster | None:
        """Another table's wrapped master whose device wrapper ``t`` is, around the same host wrapper as ``w``."""
        if t is w.host or t is w.dev:
            return None
        for sib in self._siblings():
            sw = sib.wrapped.get(name)
            if sw is not None and sw.dev is t and sw.host is w.host:
                return sw
        return None

    def _siblings_copy(self, name: str, t: torch.Tensor, m: _Master, claim: bool = True) -> bool:
        """Whether ``t`` is another table's untouched device copy of the same host memory as ``m`` (ComfyUI leaves
        the weights on the device when it switches from one node's clone to the other's): then it goes home by
        pointer swap too (``claim``), and that table forgets it. Without this, its release was ComfyUI's copy into
        new host memory, while both tables' masters kept the old: the model twice in RAM."""
        for sib in self._siblings():
            sm = sib.masters.get(name)
            if sm is not None and sm.host.data_ptr() == m.host.data_ptr() and _ours(sm, t):
                if claim:
                    sm.dev_ptr = 0
                return True
        return False

    def release(self) -> None:
        """Forget the masters and unpin what was pinned for them."""
        self.store.release(self.component)
        self.masters.clear()
        self.wrapped.clear()


def _real_shape(t: torch.Tensor) -> torch.Size:
    """``t``'s sizes as stored (GGUF's GGMLTensor reports its dequantized shape through ``shape``)."""
    return t.size()


def _parse_to_device(args, kwargs) -> torch.device | None:
    """The device of a ``Module.to(...)`` call that only changes device, else None."""
    try:
        device, dtype, _, fmt = torch._C._nn._parse_to(*args, **kwargs)
    except (TypeError, RuntimeError):
        return None
    if device is None or dtype is not None or fmt is not None:
        return None
    return device


@contextlib.contextmanager
def swap_module_to(table: MasterTable, load_device: torch.device, offload_device: torch.device,
                   on_move=None) -> Iterator[None]:
    """While active, ``m.to(load_device)`` / ``m.to(offload_device)`` on any module under the table's
    root goes through the table (transport copy in, pointer swap out) before the real ``Module.to``
    handles whatever is left. Installed as instance attributes and removed on exit.

    ``on_move(direction, bytes_moved, bytes_swapped)`` is told about each intercepted call.
    """
    load_device, offload_device = torch.device(load_device), torch.device(offload_device)
    real_to = torch.nn.Module.to

    def _norm(d: torch.device) -> torch.device:
        if d.type == "cuda" and d.index is None:
            return torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
        return d

    load_n, off_n = _norm(load_device), _norm(offload_device)

    def make(module: torch.nn.Module):
        def to(*args, **kwargs):
            dev = _parse_to_device(args, kwargs)
            if dev is None or load_n == off_n:
                return real_to(module, *args, **kwargs)
            dev = _norm(dev)
            if dev == load_n:
                moved, left = table.onload(module, dev)
                if on_move:
                    on_move("onload", moved, 0)
                if not left:
                    return module                                 # everything is there already
            elif dev == off_n:
                swapped, left = table.offload(module)
                if on_move:
                    on_move("offload", 0, swapped)
                if not left:
                    return module
            return real_to(module, *args, **kwargs)
        return to

    installed = []
    try:
        for m in table.root.modules():
            if "to" not in m.__dict__:
                object.__setattr__(m, "to", make(m))
                installed.append(m)
        yield
    finally:
        for m in installed:
            if m.__dict__.get("to") is not None:
                del m.__dict__["to"]


def apply_phase_offload(module: torch.nn.Module, config: PhaseConfig | None = None,
                        transport: Transport | None = None, store: PinnedStore | None = None) -> PhaseHandle:
    """Put ``module`` under phase offload and return its handle (module starts offloaded).

    ``transport`` defaults to ``make_transport("cuda")`` (CPU transport where CUDA is missing).
    ``store`` lets several components share one pin budget.
    """
    if not isinstance(module, torch.nn.Module):
        raise IncompatibleInput("module", "a torch.nn.Module", module)
    config = config or PhaseConfig()
    if not isinstance(config, PhaseConfig):
        raise IncompatibleInput("config", "a PhaseConfig", config)
    if transport is None:
        from .transport import make_transport
        transport = make_transport("cuda")
    return PhaseHandle(module, config, transport, store)


__all__ = ["MasterTable", "PhaseConfig", "PhaseHandle", "PhaseLedger", "PhaseRecord", "PinMode",
           "apply_phase_offload", "rebind", "swap_module_to", "tensor_nbytes"]
