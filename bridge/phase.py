"""PhaseOffload inside ComfyUI: phase exclusivity through ComfyUI's own memory manager, and
ComfyUI's own loads/unloads turned into a transport copy in and a pointer swap out.

How it plugs in (every piece is per clone and removable):

- Each output (MODEL, CLIP's patcher, VAE's patcher) is a *clone* whose class is swapped for a
  small subclass of its own patcher class (``LeversPhase<Base>``). ``clone()`` builds
  ``self.__class__``, so clones made downstream (LoRA loaders, CLIPSetLastLayer) keep it. State
  lives in ``patcher.attachments["levers_phase"]`` (copied by ``clone()``). ``remove_phase_offload``
  restores the class and drops the attachment.
- ``partially_load`` (the entry of every ComfyUI load, legacy and DynamicVRAM) first releases the
  *other* components' GPU copies with ``comfy.model_management.free_memory(..., keep_loaded=...)``,
  ComfyUI's own unload path (what upstream ``unload_model_and_clones`` does), so
  ``current_loaded_models`` and every ``loaded_size`` stay true.
- Legacy patchers only: while ComfyUI runs ``load`` / ``unpatch_model`` / ``partially_unload``,
  its ``Module.to(load_device)`` copies host masters through the transport and its
  ``Module.to(offload_device)`` rebinds untouched weights to their host masters (zero bytes). ComfyUI
  still decides what moves and still does all accounting; LoRA-patched weights follow ComfyUI's own
  backup/restore (never swapped to a stale master).
- DynamicVRAM patchers (``patcher.is_dynamic()``): no swapping (ComfyUI streams from its own pinned
  buffers); exclusivity and placement remain.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import logging
import os
import re
import sys
import time
import weakref
from datetime import datetime, timezone
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from ..core.errors import ConfigError
from ..core.residency.phase import MasterTable, swap_module_to
from ..core.residency.pinned import PinMode, PinnedStore
from ..core.residency.transport import make_transport, tensor_nbytes
from .inputs import require_clip, require_model, require_vae
from .comfy_mode import lowvram_mode_line, stays_on_gpu, unload_entries_of

log = logging.getLogger("levers")

ATTACHMENT = "levers_phase"
COMPONENTS = ("diffusion_model", "diffusion_model_2", "text_encoder", "vae")
_GIB = 1024 ** 3


def _mm():
    import comfy.model_management as mm
    return mm


def is_dynamic(patcher) -> bool:
    fn = getattr(patcher, "is_dynamic", None)
    return bool(fn()) if callable(fn) else False


# --- settings --------------------------------------------------------------------------------------

def parse_device(value: str, field: str) -> torch.device | None:
    """'auto' -> None (ComfyUI decides), 'cpu', 'cuda:N' (must exist here)."""
    text = str(value or "auto").strip().lower()
    if text == "auto":
        return None
    if text == "cpu":
        return torch.device("cpu")
    if text == "cuda":
        text = "cuda:0"
    if text.startswith("cuda:") and text[5:].isdigit():
        index = int(text[5:])
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if index >= count:
            raise ConfigError(field, value, f"auto, cpu or cuda:0..cuda:{count - 1}" if count else "auto or cpu",
                              f"This machine has {count} CUDA device(s).")
        return torch.device("cuda", index)
    raise ConfigError(field, value, "auto, cpu or cuda:N", "Example: cuda:1 puts it on the second GPU.")


TE_PRECISIONS = {"auto": None, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class PhaseSettings:
    """What the node asks for, per component."""

    model_device: str = "auto"
    text_encoder_device: str = "auto"
    vae_device: str = "auto"
    pin: PinMode | str = PinMode.AUTO
    text_encoder_precision: str = "auto"
    pin_budget_bytes: int | None = None
    # components a plan keeps on the GPU across phases: no other phase releases them, and they get no host master
    resident: tuple[str, ...] = ()
    # components whose masters stay pageable while the others are pinned (a plan the RAM rule let pin only part of
    # its host copies); the second expert follows the diffusion model
    pageable: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "pin", PinMode.parse(self.pin, "pin"))
        for field_name, hint in (("resident", "The experts of a two-expert model always take turns."),
                                 ("pageable", "")):
            names = tuple(str(n) for n in getattr(self, field_name))
            bad = [n for n in names if n not in ("diffusion_model", "text_encoder", "vae")]
            if bad:
                raise ConfigError(field_name, bad, "diffusion_model, text_encoder or vae", hint)
            object.__setattr__(self, field_name, names)
        p = str(self.text_encoder_precision).strip().lower()
        if p not in TE_PRECISIONS:
            raise ConfigError("text_encoder_precision", self.text_encoder_precision, ", ".join(TE_PRECISIONS),
                              "auto keeps ComfyUI's choice (fp32 on the CPU when the weights are 16-bit).")
        object.__setattr__(self, "text_encoder_precision", p)


# --- per-component state ---------------------------------------------------------------------------

@dataclass
class Component:
    """One phase-managed component: its shared module, masters, transport and records."""

    name: str
    module: torch.nn.Module
    group: "PhaseGroup"
    dynamic: bool
    load_device: torch.device
    offload_device: torch.device
    table: MasterTable | None = None
    depth: int = 0
    notes: list[str] = field(default_factory=list)
    resident: bool = False       # the plan keeps it on the GPU across phases (PhaseSettings.resident)
    # a text encoder copied at a wider precision: the stored dtype of each weight, which ComfyUI rounds a patched
    # weight to (a LoRA'd fp16 weight held in fp32 is rounded to fp16 and back, as it would be without the copy)
    stored_dtypes: dict[str, torch.dtype] | None = None
    # the pinned store's key for its masters (default: the name); a model added for a component's place (QuantizeDiT's
    # copy) has its own, so neither unpins the other's masters
    pin_key: str | None = None

    def on_model_patcher_clone(self) -> "Component":
        return self  # clones of a managed patcher belong to the same component

    def swaps(self, patcher) -> tuple[bool, str]:
        if self.resident:
            return False, ("the plan keeps it on the GPU across phases: no other phase releases it, ComfyUI loads it "
                           "once and keeps no host copy")
        if self.dynamic:
            return False, "DynamicVRAM patcher: ComfyUI streams this model itself"
        if getattr(patcher, "weight_inplace_update", False):
            return False, "patcher updates weights in place: masters could go stale unseen, ComfyUI's copy kept"
        if torch.device(patcher.load_device) == torch.device(patcher.offload_device):
            return False, f"loads on {patcher.load_device}, its offload device: nothing moves"
        if torch.device(patcher.load_device).type not in ("cuda", "cpu"):
            # only CUDA has a transport (pinned copies on a side stream); elsewhere the swap would bind the weights
            # to host copies while ComfyUI counts them on the device
            return False, (f"loads on {patcher.load_device}: Levers' pointer swap needs a CUDA device, so ComfyUI "
                           "moves this model itself")
        return True, "pointer-swap offload"

    def _table(self, patcher) -> MasterTable:
        if self.table is None:
            transport = make_transport(patcher.load_device)
            self.table = MasterTable(self.module, self.pin_key or self.name, transport,
                                     self.group.store_for(transport))
            # GroupPrefetch's host copy of this model's streamed blocks: their masters point into it once adopted;
            # this node never moves those blocks, and whether the copy is page-locked is GroupPrefetch's decision
            from .prefetch import host_copy_ranges
            module = self.module
            self.table.foreign = lambda: host_copy_ranges(module)
        return self.table

    def stage(self, patcher) -> None:
        """Adopt (and pin) the host-resident weights as masters now: zero copy, once."""
        ok, why = self.swaps(patcher)
        if ok:
            self._table(patcher).capture()
        else:
            self.notes.append(f"no pointer swap: {why}")

    @contextlib.contextmanager
    def moves(self, patcher, kind: str):
        """Around a ComfyUI weight operation: intercept its ``Module.to`` calls (outermost call only)."""
        ok, _ = self.swaps(patcher)
        if self.depth or not ok:
            self.depth += 1
            try:
                yield
            finally:
                self.depth -= 1
            return
        self.depth += 1
        table = self._table(patcher)
        stats = {"h2d": 0, "swapped": 0}
        left0 = table.left_bytes
        t0 = time.perf_counter()

        def on_move(direction, moved, swapped):
            stats["h2d"] += moved
            stats["swapped"] += swapped

        try:
            table.capture()
            with swap_module_to(table, patcher.load_device, patcher.offload_device, on_move=on_move):
                yield
            if stats["h2d"]:
                table.transport.synchronize()  # so `seconds` covers finished copies (one sync per phase change)
        finally:
            self.depth -= 1
        seconds = time.perf_counter() - t0
        if stats["h2d"] or stats["swapped"] or table.left_bytes != left0:
            self.group.record(self.name, kind, h2d=stats["h2d"], d2h=table.left_bytes - left0,
                              swapped=stats["swapped"], seconds=seconds,
                              transfer_seconds=seconds if stats["h2d"] else 0.0)


def _component(patcher) -> Component | None:
    att = getattr(patcher, "attachments", None)
    comp = att.get(ATTACHMENT) if isinstance(att, dict) else None
    return comp if isinstance(comp, Component) else None


# --- the patcher subclass ----------------------------------------------------------------------------

_CLASSES: dict[type, type] = {}


def _phase_class(base: type) -> type:
    """``LeversPhase<Base>``: ``base`` plus phase exclusivity and pointer-swap moves. Cached."""
    if getattr(base, "_levers_phase_base", None) is not None:
        return base
    cls = _CLASSES.get(base)
    if cls is not None:
        return cls

    def partially_load(self, *args, **kwargs):
        comp = _component(self)
        if comp is None:
            return super(cls, self).partially_load(*args, **kwargs)
        comp.group.start_phase(comp, self)
        with comp.moves(self, "load"):
            return super(cls, self).partially_load(*args, **kwargs)

    def load(self, *args, **kwargs):
        comp = _component(self)
        if comp is None:
            return super(cls, self).load(*args, **kwargs)
        with comp.moves(self, "load"):
            return super(cls, self).load(*args, **kwargs)

    def unpatch_model(self, *args, **kwargs):
        comp = _component(self)
        if comp is None:
            return super(cls, self).unpatch_model(*args, **kwargs)
        with comp.moves(self, "unload"):
            return super(cls, self).unpatch_model(*args, **kwargs)

    def partially_unload(self, *args, **kwargs):
        comp = _component(self)
        if comp is None:
            return super(cls, self).partially_unload(*args, **kwargs)
        with comp.moves(self, "partial_unload"):
            return super(cls, self).partially_unload(*args, **kwargs)

    def patch_weight_to_device(self, key, *args, **kwargs):
        out = super(cls, self).patch_weight_to_device(key, *args, **kwargs)
        comp = _component(self)
        stored = comp.stored_dtypes.get(key) if comp is not None and comp.stored_dtypes else None
        if stored is not None and key in self.patches:
            return_weight = kwargs.get("return_weight", args[2] if len(args) > 2 else False)
            out = _round_patched(self, key, stored, out if return_weight else None)
        return out

    def patch_hook_weight_to_device(self, hooks, combined_patches, key, *args, **kwargs):
        # a weight hook (hook LoRA, scheduled CLIP hooks): ComfyUI rounds the hooked weight to the weight's dtype,
        # which on the wider copy is no rounding; round it to the stored dtype, also in ComfyUI's cache of hooked
        # weights (MaxSpeed), which it copies back in unchanged the next time these hooks apply
        out = super(cls, self).patch_hook_weight_to_device(hooks, combined_patches, key, *args, **kwargs)
        comp = _component(self)
        stored = comp.stored_dtypes.get(key) if comp is not None and comp.stored_dtypes else None
        if stored is not None and key in combined_patches:
            _round_patched(self, key, stored, None)
            cached = getattr(self, "cached_hook_patches", {}).get(hooks, {})
            if key in cached:
                cached[key] = (_round_patched(self, key, stored, cached[key][0]), *cached[key][1:])
        return out

    def clone(self, *args, **kwargs):
        n = super(cls, self).clone(*args, **kwargs)
        # some patchers' clone() gives the copy their own class (ComfyUI-GGUF's), which would drop this one's
        # behaviour while the copy still carries the component
        if type(n) is not cls and isinstance(n, base) and _component(n) is not None:
            n.__class__ = cls
        return n

    cls = type(f"LeversPhase{base.__name__}", (base,), {
        "_levers_phase_base": base, "partially_load": partially_load, "load": load,
        "unpatch_model": unpatch_model, "partially_unload": partially_unload, "clone": clone,
        "patch_weight_to_device": patch_weight_to_device, "patch_hook_weight_to_device": patch_hook_weight_to_device,
        "__module__": __name__,
    })
    _CLASSES[base] = cls
    return cls


def _round_patched(patcher, key: str, stored: torch.dtype, weight: torch.Tensor | None):
    """The patched weight ``key`` of a wider copy rounded to its ``stored`` dtype and widened back, as ComfyUI rounds
    it without the copy (its stochastic rounding, with its seed for the key): the returned ``weight`` when given,
    else the module's own, in place. A weight with a setter of its own (a quantized layout) is left as it is."""
    import comfy.model_patcher
    import comfy.utils

    if weight is None:
        current, set_func, _ = comfy.model_patcher.get_key_weight(patcher.model, key)
        if set_func is not None or current.dtype == stored or not current.is_floating_point():
            return None
        comfy.utils.copy_to_param(patcher.model, key, _rounded(current, key, stored))
        return None
    if not isinstance(weight, torch.Tensor) or weight.dtype == stored or not weight.is_floating_point():
        return weight
    return _rounded(weight, key, stored)


def _rounded(weight: torch.Tensor, key: str, stored: torch.dtype) -> torch.Tensor:
    import comfy.float
    import comfy.model_patcher

    # comfy.utils on 0.33 (its comfy.model_patcher shim logs a deprecation warning per call); comfy.model_patcher
    # before
    import comfy.utils
    seed = getattr(comfy.utils, "string_to_seed", None) or comfy.model_patcher.string_to_seed
    seed = seed(key)
    return comfy.float.stochastic_rounding(weight, stored, seed=seed).to(weight.dtype)


def adopt_moved_masters(patcher) -> None:
    """Another Levers node just rebound some of ``patcher``'s weights to new host memory (GroupPrefetch's arena):
    make those the masters now, so the old host copies (and their page-locking) go now rather than at the
    component's next load (until then both were held: about 1.5x the model in host RAM for its first run)."""
    comp = _component(patcher)
    if comp is not None and comp.table is not None and comp.swaps(patcher)[0]:
        comp.table.capture()


def install(patcher, comp: Component) -> None:
    """Make ``patcher`` (a clone we own) phase-managed."""
    patcher.__class__ = _phase_class(type(patcher))
    patcher.attachments[ATTACHMENT] = comp


def let_go_for_host_copy(patcher, modules, skip: frozenset[int] = frozenset(), ranges=()) -> int:
    """GroupPrefetch is about to build its host copy of ``modules``' tensors (all but ``skip``: the tails ComfyUI
    loads itself): PhaseOffload's masters of them would hold their old memory, and its page-locking, through the
    build, so RAM held the streamed bytes twice. They are let go (``MasterTable.let_go``); masters pointing into
    ``ranges`` (GroupPrefetch's last copy, about to go) get memory of their own. ``adopt_moved_masters`` takes the
    new copy as the masters once it is built. Returns the masters let go."""
    comp = _component(patcher)
    if comp is None or comp.table is None or not comp.swaps(patcher)[0]:
        return 0
    table = comp.table
    names = set()
    for module in modules:
        prefix = table._prefix(module)
        if prefix is None:
            continue
        for n, mod in module.named_modules(prefix=prefix, remove_duplicate=False):
            for attr, t in list(mod._parameters.items()) + list(mod._buffers.items()):
                # only what is on the host now: what ComfyUI loaded (a split block's tails, a tensor also held
                # outside the streamed blocks) stays on the device, and its master is what unloads it for free
                if t is not None and id(t) not in skip and t.device.type == "cpu":
                    names.add(f"{n}.{attr}" if n else attr)
    return table.let_go(names, ranges)


def detach_for_new_model(patcher) -> Component | None:
    """The component a clone carried over onto ``patcher`` although it holds another model now (QuantizeDiT's
    quantized copy of a PhaseOffload output): taken off, with the patcher's stock class back, so ComfyUI loads the
    new model unmanaged until ``manage_new_model`` hands it the component's place. None when there is none."""
    comp = _component(patcher)
    if comp is None or patcher.model is comp.module:
        return None
    patcher.attachments.pop(ATTACHMENT, None)
    base = getattr(type(patcher), "_levers_phase_base", None)
    if base is not None:
        patcher.__class__ = base
    return comp


def manage_new_model(old: Component, patcher) -> str:
    """``patcher``'s model (QuantizeDiT's copy of ``old``'s) joins ``old``'s PhaseOffload group in ``old``'s role: it
    gets the GPU only during that phase, every other member is released before it loads and it is released before
    theirs, and its host copy is adopted (and pinned, under a key of its own) as its masters. ``old`` stays a member
    for the outputs that still sample it (the node's own MODEL, a ``model_2`` sharing it, the quality check).
    Returns the report line."""
    comp = old.group.add_member(old.name, patcher)
    comp.stage(patcher)
    return (f"PhaseOffload (before this node) manages the quantized model as a {old.name} of its group: it holds "
            "the GPU only during its phase and is released before the others")


def remove_phase_offload(patcher) -> None:
    """Give ``patcher`` its stock class and behaviour back (weights stay where ComfyUI put them)."""
    base = getattr(type(patcher), "_levers_phase_base", None)
    comp = patcher.attachments.pop(ATTACHMENT, None) if isinstance(getattr(patcher, "attachments", None), dict) else None
    if base is not None:
        patcher.__class__ = base
    if isinstance(comp, Component) and comp.table is not None:
        comp.table.release()


# --- the per-run ledger ------------------------------------------------------------------------------
#
# Phases run after the node has executed (inside KSampler, VAEDecode, ...), so the node's STRING
# report cannot hold their numbers. Each group keeps a ledger per run (one ComfyUI prompt) and
# publishes it whenever a phase closes: on the node (ComfyUI's progress-text channel), as JSON in
# <output>/levers/, in the log, and in ``latest_ledger()``.

PHASES = {"text_encoder": "encode", "diffusion_model": "sample", "diffusion_model_2": "sample (model 2)",
          "vae": "decode"}
LEDGER_SCHEMA = "levers.phase_ledger/1"


@dataclass
class PhaseEntry:
    """One phase of a run: ``component`` held ``device``, and every byte moved while it did.

    Bytes are counted in the phase during which they moved, so the other components' release at
    the start of a phase (d2h 0 when it is a pointer swap) is part of that phase.
    """

    index: int
    component: str
    phase: str
    device: str
    source: str                          # host masters: "pinned" | "pageable" | "n/a" (Levers copies nothing)
    source_reason: str
    moved_by: str                        # who moves this component's weights, in words
    moves: bool = True                   # load device differs from the offload device
    h2d_bytes: int = 0
    d2h_bytes: int = 0
    swapped_bytes: int = 0               # rebound to host masters, 0 bytes copied
    transfer_seconds: float = 0.0        # inside ComfyUI loads that copied (ends with a stream sync)
    seconds: float = 0.0                 # wall time the phase was open
    peak_bytes: int | None = None        # torch.cuda.max_memory_allocated since the phase began; None off CUDA
    released: list[str] = field(default_factory=list)
    nodes: list[str] = field(default_factory=list)   # ComfyUI node ids that loaded it in this phase
    loads: int = 0                       # ComfyUI load requests for the component in this phase
    comfyui_loaded_before: int | None = None         # ComfyUI's loaded_size() when the phase opened
    comfyui_loaded_after: int | None = None          # ... and when it closed
    open: bool = True
    t0: float = 0.0

    @property
    def gbps(self) -> float | None:
        if not self.h2d_bytes or self.transfer_seconds <= 0:
            return None
        return round(self.h2d_bytes / self.transfer_seconds / 1e9, 3)

    @property
    def comfyui_moved_bytes(self) -> int | None:
        """Growth of ComfyUI's loaded_size() that Levers' transport did not copy (ComfyUI moved it)."""
        if not self.moves:
            return 0
        if self.comfyui_loaded_before is None or self.comfyui_loaded_after is None:
            return None
        return max(0, self.comfyui_loaded_after - self.comfyui_loaded_before - self.h2d_bytes)

    def peak_note(self) -> str:
        if self.peak_bytes is not None:
            return f"torch.cuda.max_memory_allocated({self.device}) since the phase began (all allocations on it)"
        if torch.device(self.device).type == "cuda":
            return "not measured (phase still open)" if self.open else "not measured (CUDA unavailable)"
        return f"n/a on {torch.device(self.device).type.upper()} (only CUDA's allocator keeps a peak)"

    def as_dict(self) -> dict[str, Any]:
        return {"index": self.index, "phase": self.phase, "component": self.component, "device": self.device,
                "h2d_bytes": self.h2d_bytes, "d2h_bytes": self.d2h_bytes, "swapped_bytes": self.swapped_bytes,
                "seconds": round(self.seconds, 6), "transfer_seconds": round(self.transfer_seconds, 6),
                "gbps": self.gbps, "peak_bytes": self.peak_bytes, "peak_note": self.peak_note(),
                "source": self.source, "source_reason": self.source_reason, "moved_by": self.moved_by,
                "comfyui_loaded_bytes": {"before": self.comfyui_loaded_before, "after": self.comfyui_loaded_after},
                "comfyui_moved_bytes": self.comfyui_moved_bytes, "released": list(self.released),
                "nodes": list(self.nodes), "loads": self.loads, "open": self.open}


@dataclass
class RunLedger:
    """The phases of one run (one ComfyUI prompt, or one headless run until ``new_run``)."""

    run_id: str
    prompt_id: str | None
    node_id: str | None
    started_at: str
    phases: list[PhaseEntry] = field(default_factory=list)
    outside: dict[str, int] = field(default_factory=lambda: {"h2d_bytes": 0, "d2h_bytes": 0, "swapped_bytes": 0})

    def totals(self) -> dict[str, Any]:
        h2d = sum(p.h2d_bytes for p in self.phases) + self.outside["h2d_bytes"]
        secs = sum(p.transfer_seconds for p in self.phases)
        peaks = [p.peak_bytes for p in self.phases if p.peak_bytes is not None]
        return {"phases": len(self.phases), "h2d_bytes": h2d,
                "d2h_bytes": sum(p.d2h_bytes for p in self.phases) + self.outside["d2h_bytes"],
                "swapped_bytes": sum(p.swapped_bytes for p in self.phases) + self.outside["swapped_bytes"],
                "seconds": round(sum(p.seconds for p in self.phases), 6), "transfer_seconds": round(secs, 6),
                "gbps": round(h2d / secs / 1e9, 3) if h2d and secs > 0 else None,
                "peak_bytes": max(peaks) if peaks else None}

    def as_dict(self) -> dict[str, Any]:
        return {"schema": LEDGER_SCHEMA, "run_id": self.run_id, "prompt_id": self.prompt_id,
                "node_id": self.node_id, "started_at": self.started_at,
                "updated_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "phases": [p.as_dict() for p in self.phases], "outside_phases": dict(self.outside),
                "totals": self.totals()}


def _size(n: int | None) -> str:
    if n is None:
        return "n/a"
    for unit, scale in (("GiB", _GIB), ("MiB", 1024 ** 2), ("KiB", 1024)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def format_ledger(ledger: dict[str, Any]) -> str:
    """Plain text of a run ledger (the dict ``RunLedger.as_dict`` / the JSON file holds)."""
    run = ledger.get("prompt_id") and f"prompt {ledger['prompt_id']}" or f"run {ledger.get('run_id')}"
    phases = ledger.get("phases", [])
    lines = [f"Levers PhaseOffload ledger, {run}: {len(phases)} phase(s)"]
    for p in phases:
        rate = f" ({p['gbps']} GB/s)" if p.get("gbps") else ""
        peak = _size(p["peak_bytes"]) if p.get("peak_bytes") is not None else p.get("peak_note", "n/a")
        state = ", still open" if p.get("open") else ""
        lines.append(f"{p['index']}. {p['phase']}: {p['component']} on {p['device']}, {p['seconds']:.3f} s{state}")
        lines.append(f"   H2D {_size(p['h2d_bytes'])} in {p['transfer_seconds']:.3f} s{rate} from {p['source']} "
                     f"masters; D2H {_size(p['d2h_bytes'])}; pointer-swapped {_size(p['swapped_bytes'])}")
        lines.append(f"   peak: {peak}")
        if p.get("released"):
            lines.append(f"   released first through ComfyUI: {', '.join(p['released'])}")
        moved = p.get("comfyui_moved_bytes")
        lines.append(f"   moved by: {p['moved_by']}" + (f"; ComfyUI itself loaded {_size(moved)}" if moved else ""))
    out = ledger.get("outside_phases") or {}
    if any(out.values()):
        lines.append(f"outside any phase: H2D {_size(out['h2d_bytes'])}, D2H {_size(out['d2h_bytes'])}, "
                     f"pointer-swapped {_size(out['swapped_bytes'])}")
    t = ledger.get("totals") or {}
    if t:
        rate = f" ({t['gbps']} GB/s)" if t.get("gbps") else ""
        lines.append(f"totals: H2D {_size(t['h2d_bytes'])}{rate}, D2H {_size(t['d2h_bytes'])}, pointer-swapped "
                     f"{_size(t['swapped_bytes'])}, peak {_size(t['peak_bytes'])}, {t['seconds']:.3f} s in phases")
    if ledger.get("file"):
        lines.append(f"JSON: {ledger['file']}")
    return "\n".join(lines)


def _safe_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", str(text)).strip("._") or "run"


def ledger_dir() -> str | None:
    """``<ComfyUI output directory>/levers``, or None outside ComfyUI."""
    try:
        import folder_paths
    except ImportError:
        return None
    return os.path.join(folder_paths.get_output_directory(), "levers")


def write_ledger_json(ledger: dict[str, Any], path: str) -> bool:
    """Write ``ledger`` to ``path`` atomically. Fail-soft: a warning, never an error."""
    tmp = f"{path}.tmp"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(ledger, f, indent=2)
        os.replace(tmp, path)
    except (OSError, TypeError, ValueError) as exc:
        log.warning("Levers PhaseOffload: could not write the phase ledger to %s (%s); it is still in the log "
                    "and in comfyui_levers.bridge.phase.latest_ledger()", path, exc)
        with contextlib.suppress(OSError):
            os.remove(tmp)
        return False
    return True


def _prompt_server():
    """ComfyUI's running PromptServer, or None (headless). Never imports the server module itself."""
    server = sys.modules.get("server")
    return getattr(getattr(server, "PromptServer", None), "instance", None)


def progress_text_channel() -> tuple[bool, str]:
    """(ok, reason): can text be shown on a node in the ComfyUI frontend from here?"""
    instance = _prompt_server()
    if instance is None:
        return False, "no ComfyUI server in this process (headless)"
    if not callable(getattr(instance, "send_progress_text", None)):
        return False, "this ComfyUI has no progress-text channel (PromptServer.send_progress_text)"
    return True, "ComfyUI progress text"


def send_to_node(text: str, node_id: str | None) -> bool:
    """Show ``text`` on node ``node_id`` in the frontend; False (and a debug line) when it cannot."""
    ok, why = progress_text_channel()
    if node_id is None or not ok:
        log.debug("Levers: report not sent to the node (%s)", why if not ok else "no node id")
        return False
    try:
        _prompt_server().send_progress_text(text, str(node_id))
    except (RuntimeError, OSError, ValueError) as exc:   # e.g. the server's event loop is closed
        log.debug("Levers: report not sent to node %s (%s)", node_id, exc)
        return False
    return True


def _executing() -> tuple[str | None, str | None]:
    """(prompt_id, node_id) of the ComfyUI node executing now, or (None, None) outside a prompt."""
    try:
        from comfy_execution.utils import get_executing_context
    except ImportError:
        get_executing_context = None
    ctx = get_executing_context() if get_executing_context is not None else None
    if ctx is not None:
        return (str(ctx.prompt_id) if ctx.prompt_id else None), (str(ctx.node_id) if ctx.node_id else None)
    prompt_id = getattr(_prompt_server(), "last_prompt_id", None)   # ComfyUI without execution contexts
    return (str(prompt_id) if isinstance(prompt_id, str) else None), None


_HANDLER_CLASS: type | None = None


def _watch_node_finish(group: "PhaseGroup", prompt_id: str) -> None:
    """Close the open phase when the node that loaded it finishes: a handler on this prompt's
    progress registry (ComfyUI's own seam; the registry, and the handler, go with the prompt)."""
    global _HANDLER_CLASS
    try:
        from comfy_execution.progress import ProgressHandler, get_progress_state
    except ImportError:
        return                   # no registry: the phase closes when the next one opens
    registry = get_progress_state()
    handlers = getattr(registry, "handlers", None)
    if getattr(registry, "prompt_id", None) != prompt_id or not isinstance(handlers, dict):
        return
    name = f"levers_phase_ledger_{group.serial}"
    if name in handlers:
        return
    if _HANDLER_CLASS is None:
        class PhaseLedgerHandler(ProgressHandler):
            def __init__(self, name: str, group_ref) -> None:
                super().__init__(name)
                self.group_ref = group_ref

            def finish_handler(self, node_id, state, prompt_id):
                group = self.group_ref()
                if group is not None:
                    group.node_finished(str(node_id))

        _HANDLER_CLASS = PhaseLedgerHandler
    registry.register_handler(_HANDLER_CLASS(name, weakref.ref(group)))


def _loaded_size(patcher) -> int | None:
    fn = getattr(patcher, "loaded_size", None)
    return int(fn()) if callable(fn) else None


_LATEST: dict[str, Any] | None = None


def latest_ledger(close: bool = True) -> dict[str, Any] | None:
    """The most recent run ledger any PhaseOffload group published (a JSON-ready copy), or None.

    ``close`` first ends the phase still open in every live group (headless runs have no node
    that finishes), so its seconds and peak are final; a later load of the same component
    continues that phase."""
    if close:
        groups = sorted(_LIVE, key=lambda g: g.last_active)
        for g in groups:
            g.close_phase()
        # the most recently active group's run, even where an older group still had a phase open (closing it just
        # now published that older run last)
        latest = next((g.published for g in reversed(groups) if g.published is not None), None)
        if latest is not None:
            return copy.deepcopy(latest)
    return copy.deepcopy(_LATEST)


# --- the group -----------------------------------------------------------------------------------------

_SERIAL = iter(range(1, 1 << 62))


def _release_member(group_ref, key: str) -> None:
    """A member no output uses any more: what it pinned goes too (its pinned pieces would hold its weights)."""
    group = group_ref()
    for store in (group._stores.values() if group is not None else ()):
        store.release(key)


class PhaseGroup:
    """The components one PhaseOffload node manages together; one ledger, one pin budget."""

    def __init__(self, settings: PhaseSettings, node_id: str | None = None) -> None:
        self.settings = settings
        self.node_id = node_id
        self.serial = next(_SERIAL)
        self.last_active = 0                  # _SERIAL value of this group's latest phase start
        # held weakly, like the models that joined since in a component's role (QuantizeDiT's copy of the diffusion
        # model): the patchers hold their component, and each component holds the group, so a model no output uses
        # any more leaves the group and is freed when ComfyUI drops it (a strong map made a cycle that kept it, its
        # host copy and its page-locking until the next garbage collection)
        self.components: "weakref.WeakValueDictionary[str, Component]" = weakref.WeakValueDictionary()
        self._joined: list[weakref.ref[Component]] = []
        # pin keys whose masters stay pageable (the plan's ``pageable`` roles, and the members that joined in them)
        self._pageable: dict[str, str] = {}
        why = "pageable: the plan pins only the other components' host copies (the RAM rule refuses the whole set)"
        for n in settings.pageable + (("diffusion_model_2",) if "diffusion_model" in settings.pageable else ()):
            self._pageable[n] = why
        self.records: list[dict[str, Any]] = []
        self.notes: list[str] = []
        self.run: RunLedger | None = None
        self._stores: dict[str, PinnedStore] = {}
        self._open: PhaseEntry | None = None
        self._open_patcher = None
        self.published: dict[str, Any] | None = None     # this group's last published run (``latest_ledger``)
        self._finalizers: list[weakref.finalize] = []

    def store_for(self, transport) -> PinnedStore:
        """The pinned store of ``transport``'s device: one per device, so each store's synchronize (before it
        unregisters a range a copy may still read) waits on the streams that copy from it (components on two GPUs
        shared one store, which waited on the first GPU's streams only). Ranges two stores pin are shared by count."""
        key = f"{transport.name}:{transport.device}"
        if key not in self._stores:
            store = PinnedStore(transport, self.settings.pin, self.settings.pin_budget_bytes, pageable=self._pageable)
            self._stores[key] = store
            # unregister page-locked masters when the group goes away (before their memory is freed)
            self._finalizers.append(weakref.finalize(self, store.unpin_all))
        return self._stores[key]

    def add(self, name: str, patcher) -> Component:
        """Register ``patcher`` (a clone we own) as component ``name`` and install the subclass."""
        comp = Component(name=name, module=patcher.model, group=self, dynamic=is_dynamic(patcher),
                         load_device=torch.device(patcher.load_device),
                         offload_device=torch.device(patcher.offload_device),
                         resident=name in self.settings.resident)
        self.components[name] = comp
        weakref.finalize(comp, _release_member, weakref.ref(self), name).atexit = False
        install(patcher, comp)
        return comp

    def add_member(self, name: str, patcher) -> Component:
        """Add ``patcher``'s model in component ``name``'s role beside the one registered under it (``add`` would
        replace that one for the outputs that still use it)."""
        comp = Component(name=name, module=patcher.model, group=self, dynamic=is_dynamic(patcher),
                         load_device=torch.device(patcher.load_device),
                         offload_device=torch.device(patcher.offload_device),
                         resident=name in self.settings.resident, pin_key=f"{name} (joined {next(_SERIAL)})")
        self._joined.append(weakref.ref(comp))
        weakref.finalize(comp, _release_member, weakref.ref(self), comp.pin_key).atexit = False
        if name in self._pageable:            # the plan keeps this role's masters pageable: the copy's too
            self._pageable[comp.pin_key] = self._pageable[name]
            for store in self._stores.values():
                store.pageable[comp.pin_key] = self._pageable[name]
        install(patcher, comp)
        return comp

    def members(self) -> list[Component]:
        """Every component of the group: those registered by name, then the live ones that joined since."""
        self._joined = [r for r in self._joined if r() is not None]
        return list(self.components.values()) + [c for c in (r() for r in self._joined) if c is not None]

    # --- runs and phases ---------------------------------------------------------------------------

    def _begin_run(self, prompt_id: str | None) -> RunLedger:
        """The current run; a new one when the ComfyUI prompt changed (or headless after a prompt)."""
        if self.run is not None and self.run.prompt_id == prompt_id:
            return self.run
        self.close_phase()
        now = datetime.now()
        base = prompt_id or now.strftime("%Y%m%d-%H%M%S-%f")
        run_id = _safe_name(f"{base}-node{self.node_id}" if self.node_id is not None else base)
        self.run = RunLedger(run_id=run_id, prompt_id=prompt_id, node_id=self.node_id,
                             started_at=now.astimezone().isoformat(timespec="seconds"))
        return self.run

    def new_run(self) -> None:
        """End the current run (closing its open phase); the next phase starts a fresh ledger."""
        self.close_phase()
        self.run = None

    def _open_phase(self, comp: Component, patcher) -> PhaseEntry:
        run = self.run
        last = run.phases[-1] if run.phases else None
        if last is not None and last.component == comp.name:
            entry = last                 # the same component again, nothing in between: one phase
            entry.open = True
        else:
            device = torch.device(patcher.load_device) if patcher is not None else comp.load_device
            entry = PhaseEntry(index=len(run.phases) + 1, component=comp.name,
                               phase=PHASES.get(comp.name, comp.name), device=str(device),
                               **_who_moves(comp, patcher))
            entry.comfyui_loaded_before = _loaded_size(patcher)
            run.phases.append(entry)
        dev = torch.device(entry.device)
        if dev.type == "cuda" and torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats(dev)    # the peak read at close is this phase's own
        entry.t0 = time.perf_counter()
        self._open = entry
        self._open_patcher = weakref.ref(patcher) if patcher is not None else None
        return entry

    def start_phase(self, comp: Component, patcher=None) -> None:
        """Before ``comp`` loads: open (or continue) its phase, then release the other components'
        GPU copies through ComfyUI."""
        mm = _mm()
        prompt_id, node_id = _executing()
        self.last_active = next(_SERIAL)
        self._begin_run(prompt_id)
        entry = self._open
        if entry is None or entry.component != comp.name:
            self.close_phase()
            entry = self._open_phase(comp, patcher)
        entry.loads += 1
        if node_id is not None and node_id not in entry.nodes:
            entry.nodes.append(node_id)
        if prompt_id is not None:
            _watch_node_finish(self, prompt_id)
        members = self.members()
        # a member the plan keeps resident stays loaded, except beside another model in its own role (QuantizeDiT's
        # copy and the input it came from): two diffusion models on the GPU at once is what the node prevents
        others = [c.module for c in members if c is not comp and c.module is not comp.module
                  and (not c.resident or c.name == comp.name)]
        loaded = list(mm.current_loaded_models)
        # only what shares this phase's device: a text encoder on the CPU does not need the GPU emptied
        evict = [lm for lm in loaded if lm.model is not None and torch.device(lm.device) == comp.load_device
                 and any(lm.model.model is m for m in others)]
        stays = [lm for lm in evict if stays_on_gpu(lm.device, getattr(lm.model, "offload_device", "cpu"))]
        if stays:
            # its offload device is the GPU it is on (--highvram for the diffusion model, --gpu-only for all): an
            # unload frees nothing there and only unpatches its LoRA, patched again at its next load
            evict = [lm for lm in evict if all(lm is not x for x in stays)]
            names = sorted({c.name for c in members for lm in stays if lm.model.model is c.module})
            note = (f"{', '.join(names)} stay{'s' if len(names) == 1 else ''} on the GPU through the other phases: "
                    "ComfyUI's offload device for it is the GPU (--highvram or --gpu-only), so releasing it would "
                    "free nothing; start ComfyUI without that flag for the phases to take turns")
            if note not in self.notes:
                self.notes.append(note)
        if evict:
            keep = [lm for lm in loaded if all(lm is not e for e in evict)]
            names = sorted({c.name for c in members if c is not comp
                            and any(lm.model.model is c.module for lm in evict if lm.model is not None)})
            for lm in evict:
                member = next(c for c in members if lm.model.model is c.module)
                managed = ATTACHMENT in (getattr(lm.model, "attachments", None) or {})
                if ((managed and not member.resident) or is_dynamic(lm.model)
                        or torch.device(lm.device) == torch.device(getattr(lm.model, "offload_device", lm.device))):
                    # released by the swap; or by DynamicVRAM, which gives back its VRAM and copies nothing home; or
                    # nothing to copy (it loads where it lives)
                    continue
                # kept resident by the plan, so it has no masters; or loaded through a patcher PhaseOffload does not
                # manage (another branch of the graph uses the same model without the node): ComfyUI's own unload
                # copies it back (and the next load re-adopts it)
                n = int(lm.model_loaded_memory()) if callable(getattr(lm, "model_loaded_memory", None)) else 0
                self.record(member.name, "released by ComfyUI", h2d=0, d2h=n, swapped=0, seconds=0.0)
                note = (f"{member.name} is kept on the GPU by the plan, but another model in its role loaded (a "
                        "QuantizeDiT copy and the model it came from): ComfyUI copied it back to the host itself"
                        if managed else
                        f"{member.name} was loaded by a patcher this node does not manage (the same model used without "
                        "it elsewhere in the graph): ComfyUI copied it back to the host itself, and the next phase "
                        "re-adopts it")
                if note not in self.notes:
                    self.notes.append(note)
            for device in {lm.device for lm in evict}:
                mm.free_memory(1e30, device, keep_loaded=keep)
            self.record(comp.name, "exclusive", released=names)
            entry.released.extend(n for n in names if n not in entry.released)

    def node_finished(self, node_id: str) -> None:
        """A ComfyUI node finished: if it is one that loaded the open phase's component, close it."""
        if self._open is not None and node_id in self._open.nodes:
            self.close_phase()

    def close_phase(self) -> None:
        """End the open phase (its seconds, peak, ComfyUI's view) and publish the run."""
        entry = self._open
        if entry is None:
            return
        self._open = None
        entry.open = False
        entry.seconds += time.perf_counter() - entry.t0
        dev = torch.device(entry.device)
        if dev.type == "cuda" and torch.cuda.is_available():
            peak = int(torch.cuda.max_memory_allocated(dev))
            entry.peak_bytes = peak if entry.peak_bytes is None else max(entry.peak_bytes, peak)
        patcher = self._open_patcher() if self._open_patcher is not None else None
        if patcher is not None:
            entry.comfyui_loaded_after = _loaded_size(patcher)
        self.publish()

    def publish(self) -> dict[str, Any] | None:
        """The run as JSON in <output>/levers/, as text on the node and in the log; kept for ``latest_ledger``."""
        global _LATEST
        if self.run is None:
            return None
        data = self.run.as_dict()
        data["settings"] = {"pin": str(self.settings.pin), "text_encoder_precision":
                            self.settings.text_encoder_precision, "model_device": self.settings.model_device,
                            "text_encoder_device": self.settings.text_encoder_device,
                            "vae_device": self.settings.vae_device}
        folder = ledger_dir()
        data["file"] = None
        if folder is not None:
            path = os.path.join(folder, f"phase_ledger-{self.run.run_id}.json")
            data["file"] = path
            if not write_ledger_json(data, path):
                data["file"] = None
        text = format_ledger(data)
        log.info("%s", text)
        send_to_node(text, self.node_id)
        _LATEST = self.published = data
        return data

    def record(self, component: str, kind: str, **fields) -> None:
        rec: dict[str, Any] = {"component": component, "kind": kind}
        rec.update(fields)
        if "h2d" in rec:
            secs = rec.pop("transfer_seconds", 0.0)
            rec["gbps"] = round(rec["h2d"] / secs / 1e9, 3) if rec["h2d"] and secs > 0 else None
            rec["seconds"] = round(rec.get("seconds", 0.0), 6)
            entry = self._open
            if entry is not None:
                entry.h2d_bytes += rec["h2d"]
                entry.d2h_bytes += rec["d2h"]
                entry.swapped_bytes += rec["swapped"]
                entry.transfer_seconds += secs if rec["h2d"] else 0.0
            else:            # e.g. ComfyUI unloading a component for an unmanaged model
                run = self._begin_run(_executing()[0])
                run.outside["h2d_bytes"] += rec["h2d"]
                run.outside["d2h_bytes"] += rec["d2h"]
                run.outside["swapped_bytes"] += rec["swapped"]
        self.records.append(rec)
        if "h2d" in rec:
            log.info("Levers PhaseOffload %s %s: H2D %.3f GiB, D2H %.3f GiB, pointer-swapped %.3f GiB in %.3f s",
                     component, kind, rec["h2d"] / _GIB, rec["d2h"] / _GIB, rec["swapped"] / _GIB, rec["seconds"])

    def ledger(self) -> dict[str, Any]:
        """JSON-ready: per-component settings and pin outcomes, every record, totals, the current run."""
        self.close_phase()
        comps = {}
        for c in self.members():
            table = c.table
            comps[c.pin_key or c.name] = {
                "dynamic": c.dynamic, "load_device": str(c.load_device), "offload_device": str(c.offload_device),
                "masters": len(table.masters) + len(table.wrapped) if table else 0,
                "master_bytes": _master_bytes(table),
                "pin": table.pin_outcome.as_dict() if table and table.pin_outcome else None,
                "notes": list(c.notes)}
        moves = [r for r in self.records if "h2d" in r]
        return {"components": comps, "records": list(self.records),
                "totals": {"h2d_bytes": sum(r["h2d"] for r in moves), "d2h_bytes": sum(r["d2h"] for r in moves),
                           "swapped_bytes": sum(r["swapped"] for r in moves),
                           "exclusive_releases": sum(1 for r in self.records if r["kind"] == "exclusive")},
                "run": self.run.as_dict() if self.run is not None else None,
                "notes": list(self.notes)}


def _master_bytes(table: MasterTable | None) -> int:
    """Host bytes of the masters: plain tensors and the inner tensors of wrapped ones (fp8 ``QuantizedTensor``
    codes and scales), tied twins once."""
    if table is None:
        return 0
    unique = {(m.host.data_ptr(), tensor_nbytes(m.host)) for m in table.masters.values()}
    unique |= {(x.data_ptr(), tensor_nbytes(x)) for w in table.wrapped.values() for _, x in w.leaves}
    return sum(nbytes for _, nbytes in unique)


def _who_moves(comp: Component, patcher) -> dict[str, Any]:
    """Ledger fields saying where this component's bytes come from and who copies them."""
    if patcher is None:
        return {"source": "n/a", "source_reason": "unknown patcher", "moved_by": "unknown", "moves": True}
    moves = torch.device(patcher.load_device) != torch.device(patcher.offload_device)
    ok, why = comp.swaps(patcher)
    if ok:
        pin = comp.table.pin_outcome if comp.table is not None else None
        source = "pinned" if pin is not None and pin.pinned else "pageable"
        reason = pin.reason if pin is not None else "masters not pinned"
        moved_by = "Levers transport (copy in, pointer swap out; ComfyUI decides what moves)"
    elif comp.dynamic:
        source, reason = "n/a", "ComfyUI DynamicVRAM streams from its own pinned buffers"
        moved_by = "ComfyUI DynamicVRAM (Levers does not swap it)"
    elif not moves:
        source, reason, moved_by = "n/a", why, f"nothing: {why}"
    else:
        source, reason, moved_by = "n/a", why, f"ComfyUI ({why})"
    return {"source": source, "source_reason": reason, "moved_by": moved_by, "moves": moves}


_LIVE: "weakref.WeakSet[PhaseGroup]" = weakref.WeakSet()


def live_ledgers() -> list[dict[str, Any]]:
    """Ledgers of every PhaseOffload group still alive (benchmarks read these after a run)."""
    return [g.ledger() for g in list(_LIVE)]


# --- building the outputs ------------------------------------------------------------------------------

def _set_load_device(patcher, device: torch.device | None) -> None:
    if device is not None:
        patcher.load_device = device
        # a DynamicVRAM patcher keeps pin state per load device; ComfyUI's own device selectors register the
        # new one after retargeting, and its next load raises KeyError without it
        register = getattr(patcher, "register_load_device", None)
        if callable(register):
            register(device)


# ComfyUI 0.33's DynamicVRAM (comfy-aimdo) keeps native buffers on the model (``dynamic_*``) and on each layer it
# loaded (its pin state and pins, its VRAM slice and signature, its LoRA functions): each buffer is freed when its
# Python object goes, so a copy must not duplicate them (two objects would free one pointer twice)
NATIVE_STATE = ("dynamic_vbars", "dynamic_pins", "dynamic_patchers", "_v", "_v_signature", "_v_block", "_pin_state",
                "_pins", "weight_lowvram_function", "bias_lowvram_function")


# what every patcher of one module shares, as ComfyUI's clones do (the weights each patch replaced, to restore them
# when another patcher of the module loads): kept on a text-encoder copy for the patchers of later outputs
_PATCHER_STATE = "_levers_patcher_state"
_SHARED_BY_CLONES = ("backup", "backup_buffers", "object_patches_backup", "pinned")


def _copy_without_native_state(module: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of ``module`` whose modules carry none of DynamicVRAM's native state (``NATIVE_STATE``): those
    attributes are taken off the original for the copy and put back after, so they are neither copied nor in the
    copy (a patcher made for the copy creates its own; ComfyUI reads each with a default). Nor is the patcher state
    a copy made here carries."""
    held = []
    for m in module.modules():
        state = {attr: m.__dict__.pop(attr) for attr in NATIVE_STATE + (_PATCHER_STATE,) if attr in m.__dict__}
        if state:
            held.append((m, state))
    try:
        return copy.deepcopy(module)
    finally:
        for m, state in held:
            m.__dict__.update(state)


def _te_kept_reason(clip) -> str | None:
    """Why the text encoder keeps its stored weights instead of a private copy at another precision, or None."""
    from ..core.residency import subclass

    if any(not subclass.is_plain(p) for p in clip.cond_stage_model.parameters()):
        return ("it holds quantized weights (fp8 scaled or another format): converting them would dequantize a "
                "copy of the whole encoder; ComfyUI casts them per op")
    return None


def _stored_dtypes(module: torch.nn.Module, dtype: torch.dtype) -> dict[str, torch.dtype]:
    """The weights of ``module`` a copy at ``dtype`` widens, by state-dict key (LoRA patch keys): their stored
    dtype, which a patched weight is rounded to."""
    width = torch.empty((), dtype=dtype).element_size()
    return {k: t.dtype for k, t in module.state_dict().items() if t.is_floating_point() and t.element_size() < width}


# text encoder module -> {dtype: its private copy at that dtype}, while something holds the copy
_COPIES: "weakref.WeakKeyDictionary[torch.nn.Module, dict[torch.dtype, weakref.ref]]" = weakref.WeakKeyDictionary()


def _cached_copy(src: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module | None:
    ref = _COPIES.get(src, {}).get(dtype)
    return ref() if ref is not None else None


def retype_text_encoder(clip, dtype: torch.dtype):
    """A CLIP whose text encoder weights are stored at ``dtype``: a private copy (the input CLIP and
    its module are untouched). Costs host RAM for the copy; saves ComfyUI's per-op weight casts."""
    new = clip.clone()
    src = clip.cond_stage_model
    # a CLIP ComfyUI holds loaded carries its LoRA in the module's weights (and on the GPU): copy it unpatched
    # from the offload device, or the copy would bake the LoRA in and its patches would apply it again
    unload_entries_of(src)
    module = _cached_copy(src, dtype)
    if module is not None:
        # the node ran again (a widget changed) while its last output, and so this copy, is still cached: share it
        # instead of holding a second copy (an fp32 T5-XXL is 19 GB); unloaded first, so it is unpatched
        unload_entries_of(module)
    else:
        module = _copy_without_native_state(src).to(device=clip.patcher.offload_device, dtype=dtype)
        _COPIES.setdefault(src, {})[dtype] = weakref.ref(module)
    for attr, value in (("model_loaded_weight_memory", 0), ("lowvram_patch_counter", 0), ("model_lowvram", False),
                        ("current_weight_patches_uuid", None), ("model_offload_buffer_memory", 0)):
        if hasattr(module, attr):
            setattr(module, attr, value)
    if hasattr(module, "device"):
        module.device = clip.patcher.offload_device
    patcher = type(clip.patcher)(module, load_device=clip.patcher.load_device,
                                 offload_device=clip.patcher.offload_device)
    # every output sharing the copy gets a patcher that shares its backups, as a clone would: one output's LoRA
    # patches the shared weights, and the next load by another output restores them from the common backup (each
    # patcher with its own backup left the last LoRA baked into the copy for every output)
    shared = module.__dict__.get(_PATCHER_STATE)
    if shared is None:
        module.__dict__[_PATCHER_STATE] = {a: getattr(patcher, a) for a in _SHARED_BY_CLONES if hasattr(patcher, a)}
    else:
        for attr, value in shared.items():
            setattr(patcher, attr, value)
    # keep what the input patcher carried (LoRA patches, compute dtype, hooks, options)
    for attr in ("patches", "object_patches", "weight_wrapper_patches", "model_options", "patches_uuid",
                 "force_cast_weights", "hook_mode", "is_clip", "forced_hooks", "hook_patches", "callbacks",
                 "wrappers", "attachments", "injections", "additional_models"):
        if hasattr(new.patcher, attr):
            value = getattr(new.patcher, attr)
            setattr(patcher, attr, copy.copy(value) if isinstance(value, (dict, list, set)) else value)
    new.patcher = patcher
    new.cond_stage_model = module
    return new


def _short(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype))


def _te_dtype(clip) -> torch.dtype | None:
    for p in clip.cond_stage_model.parameters():
        if p.is_floating_point():
            return p.dtype
    return None


def wrap_vae(vae):
    """A VAE sharing the input's model but with its own patcher (the input VAE is not modified)."""
    require_vae(vae)
    new = copy.copy(vae)           # shallow: shares first_stage_model, its own attribute dict
    new.patcher = vae.patcher.clone()
    return new


class PhaseOutputs(NamedTuple):
    model: Any
    clip: Any
    vae: Any
    group: PhaseGroup
    model_2: Any = None


def apply(model, clip=None, vae=None, settings: PhaseSettings | None = None, node_id: str | None = None,
          model_2=None):
    """Build the phase-managed MODEL / CLIP / VAE (and MODEL_2) outputs and the group that ties them together.

    ``model_2``: a second diffusion model sampled after the first (Wan 2.2 A14B's low-noise expert, an SDXL
    refiner): its own phase, so each holds the GPU alone. ``node_id``: the PhaseOffload node's ComfyUI id; the
    per-phase ledger is shown on that node."""
    settings = settings or PhaseSettings()
    require_model(model)
    two_experts = False
    if model_2 is not None:
        require_model(model_2, "model_2")
        two_experts = model_2.model is not model.model
    resident_dit_dropped = two_experts and "diffusion_model" in settings.resident
    if resident_dit_dropped:
        # a plan made for one diffusion model kept it on the GPU across phases; with a second one the experts take
        # turns, or both would be on the GPU while the second samples
        settings = dataclasses.replace(settings, resident=tuple(n for n in settings.resident
                                                                if n != "diffusion_model"))
    group = PhaseGroup(settings, node_id=None if node_id is None else str(node_id))
    if resident_dit_dropped:
        group.notes.append("the plan keeps the diffusion model on the GPU across phases, but it was made for one "
                           "diffusion model and model_2 is connected: the two take turns on the GPU instead (run "
                           "Recommend for the two-expert model for a plan that counts both)")
    _LIVE.add(group)
    mm = _mm()

    model_device = parse_device(settings.model_device, "model_device")
    m = model.clone()
    _set_load_device(m, model_device)
    group.add("diffusion_model", m)
    m2 = None
    if model_2 is not None:
        m2 = model_2.clone()
        _set_load_device(m2, model_device)
        if model_2.model is model.model:
            # the same diffusion model twice (a LoRA'd clone of the first): one component, or its phase would
            # release itself
            install(m2, group.components["diffusion_model"])
            group.notes.append("model_2 is the same diffusion model as model (a clone of it): managed as one "
                               "component, one phase")
        else:
            group.add("diffusion_model_2", m2)

    c = None
    if clip is not None:
        require_clip(clip)
        te_device = parse_device(settings.text_encoder_device, "text_encoder_device")
        want = TE_PRECISIONS[settings.text_encoder_precision]
        have = _te_dtype(clip)
        target = te_device or torch.device(clip.patcher.load_device)
        if want is None and target.type == "cpu" and have in (torch.float16, torch.bfloat16):
            want = torch.float32   # seed 002: 16-bit weights on the CPU are slow; fp32 there
        retyped = want is not None and have is not None and want != have
        kept = _te_kept_reason(clip) if retyped else None
        retyped = retyped and kept is None
        c = retype_text_encoder(clip, want) if retyped else clip.clone()
        _set_load_device(c.patcher, te_device)
        comp = group.add("text_encoder", c.patcher)
        if retyped:
            comp.stored_dtypes = _stored_dtypes(clip.cond_stage_model, want) or None
        if kept is not None:
            comp.notes.append(f"weights kept as stored, not copied to {_short(want)}: {kept}")
        elif retyped:
            comp.notes.append(f"weights stored as {_short(want)} (a private copy; the input CLIP keeps {_short(have)})")
        elif have is not None:
            comp.notes.append(f"weights stay {_short(have)}; ComfyUI computes text encoders in fp32 "
                              "(it casts each weight per op)")
        if te_device is not None:
            comp.notes.append(f"placed on {te_device}; ComfyUI moves its conditioning to the sampler's device")

    v = None
    if vae is not None:
        v = wrap_vae(vae)
        vae_device = parse_device(settings.vae_device, "vae_device")
        if vae_device is not None:
            v.device = vae_device
            _set_load_device(v.patcher, vae_device)
        group.add("vae", v.patcher)

    for name, patcher in (("diffusion_model", m), ("diffusion_model_2", m2),
                          ("text_encoder", c.patcher if c is not None else None),
                          ("vae", v.patcher if v is not None else None)):
        if patcher is not None and name in group.components:
            group.components[name].stage(patcher)   # pin once, at load, not per step
    group.notes.extend(what_comfyui_does(group, mm))
    return PhaseOutputs(m, c, v, group, m2)


def what_comfyui_does(group: PhaseGroup, mm) -> list[str]:
    """Plain lines for the report: what ComfyUI already handles, so nobody double-manages it."""
    notes = []
    dyn = [n for n, c in group.components.items() if c.dynamic]
    if dyn:
        notes.append("ComfyUI DynamicVRAM manages " + ", ".join(dyn) + ": it faults weights into VRAM per module "
                     "from its own pinned buffers, so Levers does not swap them; it still releases the other "
                     "components before each phase (DynamicVRAM keeps them mapped) and applies placement")
    if getattr(mm, "MAX_PINNED_MEMORY", -1) and getattr(mm, "MAX_PINNED_MEMORY", -1) > 0:
        notes.append("ComfyUI pins the weights it leaves offloaded itself; Levers never registers those twice")
    notes.append("ComfyUI moves conditioning and latents to the device of the phase that uses them; "
                 "Levers only decides where each component runs and that it runs alone")
    lowvram = lowvram_mode_line()
    if lowvram:
        notes.append(f"{lowvram} (the per-phase ledger's bytes are what Levers copied)")
    return notes


def ledger_destinations(group: PhaseGroup) -> list[str]:
    """Where this group's per-phase ledger will appear, as plain lines for the report."""
    ok, why = progress_text_channel()
    if ok and group.node_id is not None:
        node = "on this node (below this report), updated as each phase ends"
    else:
        node = f"not on the node: {why if not ok else 'no node id (the node was called outside ComfyUI)'}"
    folder = ledger_dir()
    where = (f"JSON: {os.path.join(folder, 'phase_ledger-<prompt id>' + (f'-node{group.node_id}' if group.node_id else '') + '.json')}"
             if folder is not None else "JSON: not written (no ComfyUI output folder in this process)")
    return [node, where, "log: INFO 'Levers PhaseOffload ledger' lines; Python: "
            "comfyui_levers.bridge.phase.latest_ledger()"]


def report_text(group: PhaseGroup) -> str:
    """The STRING output: settings, pin outcomes, per-phase ledger, and what ComfyUI already does."""
    led = group.ledger()
    pageable = f" (pageable: {', '.join(group.settings.pageable)})" if group.settings.pageable else ""
    lines = ["Levers PhaseOffload", f"pin: {group.settings.pin}{pageable}  text encoder precision: "
             f"{group.settings.text_encoder_precision}"]
    for name, c in led["components"].items():
        pin = c["pin"]
        pin_txt = "not staged yet" if pin is None else ("pinned" if pin["pinned"] else "pageable") + f" ({pin['reason']})"
        swap = ("ComfyUI DynamicVRAM" if c["dynamic"] else
                "moved by ComfyUI (no pointer swap, below)" if any(n.startswith("no pointer swap") for n in c["notes"])
                else "pointer-swap offload")
        lines.append(f"- {name}: {c['load_device']} <-> {c['offload_device']}, {swap}; masters "
                     f"{c['master_bytes'] / _GIB:.3f} GiB; {pin_txt}")
        lines.extend(f"    {n}" for n in c["notes"])
    lines.append("per-phase ledger (the phases run after this node, so it is published as each one ends):")
    lines.extend(f"  - {w}" for w in ledger_destinations(group))
    if led["run"] is not None and led["run"]["phases"]:
        lines.extend("  " + line for line in format_ledger(led["run"]).splitlines())
    lines.append("what ComfyUI already does:")
    lines.extend(f"  - {n}" for n in led["notes"])
    return "\n".join(lines)


__all__ = ["ATTACHMENT", "Component", "PhaseEntry", "PhaseGroup", "PhaseOutputs", "PhaseSettings", "RunLedger",
           "adopt_moved_masters", "apply",
           "format_ledger", "is_dynamic", "latest_ledger", "ledger_destinations", "ledger_dir", "live_ledgers",
           "parse_device", "progress_text_channel", "remove_phase_offload", "report_text", "retype_text_encoder",
           "send_to_node", "wrap_vae", "write_ledger_json"]
