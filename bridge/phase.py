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
import logging
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from ..core.errors import ConfigError
from ..core.residency.phase import MasterTable, swap_module_to
from ..core.residency.pinned import PinMode, PinnedStore
from ..core.residency.transport import make_transport
from .inputs import require_clip, require_model, require_vae

log = logging.getLogger("levers")

ATTACHMENT = "levers_phase"
COMPONENTS = ("diffusion_model", "text_encoder", "vae")
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

    def __post_init__(self) -> None:
        object.__setattr__(self, "pin", PinMode.parse(self.pin, "pin"))
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

    def on_model_patcher_clone(self) -> "Component":
        return self  # clones of a managed patcher belong to the same component

    def swaps(self, patcher) -> tuple[bool, str]:
        if self.dynamic:
            return False, "DynamicVRAM patcher: ComfyUI streams this model itself"
        if getattr(patcher, "weight_inplace_update", False):
            return False, "patcher updates weights in place: masters could go stale unseen, ComfyUI's copy kept"
        if torch.device(patcher.load_device) == torch.device(patcher.offload_device):
            return False, f"loads on {patcher.load_device}, its offload device: nothing moves"
        return True, "pointer-swap offload"

    def _table(self, patcher) -> MasterTable:
        if self.table is None:
            transport = make_transport(patcher.load_device)
            self.table = MasterTable(self.module, self.name, transport, self.group.store_for(transport))
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
        comp.group.start_phase(comp)
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

    cls = type(f"LeversPhase{base.__name__}", (base,), {
        "_levers_phase_base": base, "partially_load": partially_load, "load": load,
        "unpatch_model": unpatch_model, "partially_unload": partially_unload,
        "__module__": __name__,
    })
    _CLASSES[base] = cls
    return cls


def install(patcher, comp: Component) -> None:
    """Make ``patcher`` (a clone we own) phase-managed."""
    patcher.__class__ = _phase_class(type(patcher))
    patcher.attachments[ATTACHMENT] = comp


def remove_phase_offload(patcher) -> None:
    """Give ``patcher`` its stock class and behaviour back (weights stay where ComfyUI put them)."""
    base = getattr(type(patcher), "_levers_phase_base", None)
    comp = patcher.attachments.pop(ATTACHMENT, None) if isinstance(getattr(patcher, "attachments", None), dict) else None
    if base is not None:
        patcher.__class__ = base
    if isinstance(comp, Component) and comp.table is not None:
        comp.table.release()


# --- the group -----------------------------------------------------------------------------------------

class PhaseGroup:
    """The components one PhaseOffload node manages together; one ledger, one pin budget."""

    def __init__(self, settings: PhaseSettings) -> None:
        self.settings = settings
        self.components: dict[str, Component] = {}
        self.records: list[dict[str, Any]] = []
        self.notes: list[str] = []
        self._stores: dict[str, PinnedStore] = {}
        self._open: tuple[str, torch.device] | None = None
        self._finalizers: list[weakref.finalize] = []

    def store_for(self, transport) -> PinnedStore:
        key = transport.name
        if key not in self._stores:
            store = PinnedStore(transport, self.settings.pin, self.settings.pin_budget_bytes)
            self._stores[key] = store
            # unregister page-locked masters when the group goes away (before their memory is freed)
            self._finalizers.append(weakref.finalize(self, store.unpin_all))
        return self._stores[key]

    def add(self, name: str, patcher) -> Component:
        """Register ``patcher`` (a clone we own) as component ``name`` and install the subclass."""
        comp = Component(name=name, module=patcher.model, group=self, dynamic=is_dynamic(patcher),
                         load_device=torch.device(patcher.load_device),
                         offload_device=torch.device(patcher.offload_device))
        self.components[name] = comp
        install(patcher, comp)
        return comp

    def start_phase(self, comp: Component) -> None:
        """Before ``comp`` loads: release the other components' GPU copies through ComfyUI."""
        mm = _mm()
        self._close_phase()
        others = [c.module for c in self.components.values() if c is not comp]
        loaded = list(mm.current_loaded_models)
        # only what shares this phase's device: a text encoder on the CPU does not need the GPU emptied
        evict = [lm for lm in loaded if lm.model is not None and torch.device(lm.device) == comp.load_device
                 and any(lm.model.model is m for m in others)]
        if evict:
            keep = [lm for lm in loaded if all(lm is not e for e in evict)]
            for device in {lm.device for lm in evict}:
                mm.free_memory(1e30, device, keep_loaded=keep)
            names = sorted({c.name for c in self.components.values() if c is not comp
                            and any(lm.model.model is c.module for lm in evict if lm.model is not None)})
            self.record(comp.name, "exclusive", released=names)
        dev = comp.load_device
        if dev.type == "cuda" and torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats(dev)
        self._open = (comp.name, dev)

    def _close_phase(self) -> None:
        if self._open is None:
            return
        name, dev = self._open
        self._open = None
        if dev.type == "cuda" and torch.cuda.is_available():
            self.record(name, "phase_peak", peak_bytes=int(torch.cuda.max_memory_allocated(dev)))

    def record(self, component: str, kind: str, **fields) -> None:
        rec: dict[str, Any] = {"component": component, "kind": kind}
        rec.update(fields)
        if "h2d" in rec:
            secs = rec.pop("transfer_seconds", 0.0)
            rec["gbps"] = round(rec["h2d"] / secs / 1e9, 3) if rec["h2d"] and secs > 0 else None
            rec["seconds"] = round(rec.get("seconds", 0.0), 6)
        self.records.append(rec)
        if "h2d" in rec:
            log.info("Levers PhaseOffload %s %s: H2D %.3f GiB, D2H %.3f GiB, pointer-swapped %.3f GiB in %.3f s",
                     component, kind, rec["h2d"] / _GIB, rec["d2h"] / _GIB, rec["swapped"] / _GIB, rec["seconds"])

    def ledger(self) -> dict[str, Any]:
        """JSON-ready: per-component settings and pin outcomes, every record, totals."""
        self._close_phase()
        comps = {}
        for name, c in self.components.items():
            table = c.table
            comps[name] = {
                "dynamic": c.dynamic, "load_device": str(c.load_device), "offload_device": str(c.offload_device),
                "masters": len(table.masters) if table else 0,
                "master_bytes": sum(m.host.nbytes for m in {id(m.host.untyped_storage()): m
                                                           for m in table.masters.values()}.values()) if table else 0,
                "pin": table.pin_outcome.as_dict() if table and table.pin_outcome else None,
                "notes": list(c.notes)}
        moves = [r for r in self.records if "h2d" in r]
        return {"components": comps, "records": list(self.records),
                "totals": {"h2d_bytes": sum(r["h2d"] for r in moves), "d2h_bytes": sum(r["d2h"] for r in moves),
                           "swapped_bytes": sum(r["swapped"] for r in moves),
                           "exclusive_releases": sum(1 for r in self.records if r["kind"] == "exclusive")},
                "notes": list(self.notes)}


_LIVE: "weakref.WeakSet[PhaseGroup]" = weakref.WeakSet()


def live_ledgers() -> list[dict[str, Any]]:
    """Ledgers of every PhaseOffload group still alive (benchmarks read these after a run)."""
    return [g.ledger() for g in list(_LIVE)]


# --- building the outputs ------------------------------------------------------------------------------

def _set_load_device(patcher, device: torch.device | None) -> None:
    if device is not None:
        patcher.load_device = device


def retype_text_encoder(clip, dtype: torch.dtype):
    """A CLIP whose text encoder weights are stored at ``dtype``: a private copy (the input CLIP and
    its module are untouched). Costs host RAM for the copy; saves ComfyUI's per-op weight casts."""
    new = clip.clone()
    src = clip.cond_stage_model
    module = copy.deepcopy(src).to(device=clip.patcher.offload_device, dtype=dtype)
    for attr, value in (("model_loaded_weight_memory", 0), ("lowvram_patch_counter", 0), ("model_lowvram", False),
                        ("current_weight_patches_uuid", None), ("model_offload_buffer_memory", 0)):
        if hasattr(module, attr):
            setattr(module, attr, value)
    if hasattr(module, "device"):
        module.device = clip.patcher.offload_device
    patcher = type(clip.patcher)(module, load_device=clip.patcher.load_device,
                                 offload_device=clip.patcher.offload_device)
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


def apply(model, clip=None, vae=None, settings: PhaseSettings | None = None):
    """Build the phase-managed MODEL / CLIP / VAE outputs and the group that ties them together."""
    settings = settings or PhaseSettings()
    require_model(model)
    group = PhaseGroup(settings)
    _LIVE.add(group)
    mm = _mm()

    m = model.clone()
    _set_load_device(m, parse_device(settings.model_device, "model_device"))
    group.add("diffusion_model", m)

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
        c = retype_text_encoder(clip, want) if retyped else clip.clone()
        _set_load_device(c.patcher, te_device)
        comp = group.add("text_encoder", c.patcher)
        if retyped:
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

    for name, patcher in (("diffusion_model", m), ("text_encoder", c.patcher if c is not None else None),
                          ("vae", v.patcher if v is not None else None)):
        if patcher is not None:
            group.components[name].stage(patcher)   # pin once, at load, not per step
    group.notes.extend(what_comfyui_does(group, mm))
    return m, c, v, group


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
    return notes


def report_text(group: PhaseGroup) -> str:
    """The STRING output: settings, pin outcomes, per-phase ledger, and what ComfyUI already does."""
    led = group.ledger()
    lines = ["Levers PhaseOffload", f"pin: {group.settings.pin}  text encoder precision: "
             f"{group.settings.text_encoder_precision}"]
    for name, c in led["components"].items():
        pin = c["pin"]
        pin_txt = "not staged yet" if pin is None else ("pinned" if pin["pinned"] else "pageable") + f" ({pin['reason']})"
        swap = "ComfyUI DynamicVRAM" if c["dynamic"] else "pointer-swap offload"
        lines.append(f"- {name}: {c['load_device']} <-> {c['offload_device']}, {swap}; masters "
                     f"{c['master_bytes'] / _GIB:.3f} GiB; {pin_txt}")
        lines.extend(f"    {n}" for n in c["notes"])
    lines.append("ledger (per phase):")
    if not led["records"]:
        lines.append("  (nothing ran yet: the ledger fills as the workflow runs; see the JSON report)")
    for r in led["records"]:
        if r["kind"] == "exclusive":
            lines.append(f"  {r['component']}: released {', '.join(r['released'])} through ComfyUI before its phase")
        elif r["kind"] == "phase_peak":
            lines.append(f"  {r['component']}: peak VRAM {r['peak_bytes'] / _GIB:.3f} GiB")
        else:
            gb = f", {r['gbps']} GB/s" if r.get("gbps") else ""
            lines.append(f"  {r['component']} {r['kind']}: H2D {r['h2d'] / _GIB:.3f} GiB{gb}, "
                         f"D2H {r['d2h'] / _GIB:.3f} GiB, swapped {r['swapped'] / _GIB:.3f} GiB, {r['seconds']:.3f} s")
    t = led["totals"]
    lines.append(f"totals: H2D {t['h2d_bytes'] / _GIB:.3f} GiB, D2H {t['d2h_bytes'] / _GIB:.3f} GiB, "
                 f"pointer-swapped {t['swapped_bytes'] / _GIB:.3f} GiB, exclusive releases {t['exclusive_releases']}")
    lines.append("what ComfyUI already does:")
    lines.extend(f"  - {n}" for n in led["notes"])
    return "\n".join(lines)


__all__ = ["ATTACHMENT", "Component", "PhaseGroup", "PhaseSettings", "apply", "is_dynamic", "live_ledgers",
           "parse_device", "remove_phase_offload", "report_text", "retype_text_encoder", "wrap_vae"]
