"""GroupPrefetch inside ComfyUI: stream the DiT's blocks while keeping ComfyUI's memory manager right.

How it cooperates (legacy ModelPatcher path, ComfyUI 0.3.x-0.8 and later without DynamicVRAM):
- Everything is installed on a clone through keyed wrappers: ``OUTER_SAMPLE`` scopes one
  sampling run, ``APPLY_MODEL`` attaches the engine on the first model call (after ComfyUI
  has loaded and patched the model, before the diffusion model runs: every architecture goes
  through ``BaseModel.apply_model``, while some, SD3's MMDiT among them, never run the
  ``DIFFUSION_MODEL`` wrappers). Both undo what they did in ``finally``.
- During the run, three instance attributes on the executing patcher (never on the class or the
  shared module) make ComfyUI load only the non-streamed part: ``_load_list`` omits the streamed
  blocks' modules, ``load`` never takes the full-load ``model.to(device)`` shortcut, and
  ``model_size`` reports the non-streamed bytes so ``free_memory`` frees what will really be
  loaded. ComfyUI's ``loaded_size`` is therefore the true resident size; after the run
  ``model_size - loaded_size`` is exactly the streamed bytes, which do live on the host.
- The engine's device slots are allocated after asking ComfyUI to ``free_memory`` for them, so
  ComfyUI's free-memory readings include them; they are freed when the run ends.
- Streamed weights are bound to device views before their block runs, so ComfyUI's per-op cast
  (``cast_bias_weight`` -> ``cast_to``) finds them on the right device and returns them unchanged.
- LoRA patches on streamed weights are applied by ComfyUI's own ``patch_weight_to_device`` on the
  offload device (backed up and undone by ComfyUI as usual); the patched bytes are what streams.
- Under DynamicVRAM, ComfyUI streams dynamic patchers itself: for those this node stands aside and says so; a
  non-dynamic patcher (ComfyUI-GGUF, TorchCompileModel) is loaded the legacy way even then, and streams.
"""
from __future__ import annotations

import bisect
import logging
import math
import weakref
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from ..core.errors import BudgetExceeded
from ..core.residency import subclass
from ..core.residency.blocks import BlockLayout, find_blocks, held_outside, module_bytes, modules_outside
from ..core.residency.packed import packing_supported, staging_nbytes
from ..core.residency.pinned import PinMode, arena_pin_decision
from ..core.residency.prefetch import AUTO, HostStore, PinDecider, PrefetchConfig, PrefetchHandle, \
    apply_group_prefetch, measure_bandwidth, slot_bound, spend_leftover
from ..core.residency.transport import HostMaps, Transport, make_transport, pinned_by_levers, tensor_nbytes
from .comfy_mode import dynamic_vram_active, lowvram_mode_line, patcher_is_dynamic, stays_on_gpu, unload_entries_of
from .inputs import require_model

log = logging.getLogger("levers")

WRAPPER_KEY = "levers.group_prefetch"
_GIB = 1024 ** 3

# Host arenas survive between runs (pinning costs about 0.45 s/GiB on an H200, packing more): one per diffusion model.
_STORES: "weakref.WeakKeyDictionary[nn.Module, tuple[tuple[int, ...], HostStore]]" = weakref.WeakKeyDictionary()
# Per diffusion model, the layout its cached host copy was built for: a later run keeps it while it fits
# (``_Session._keep_built``), so a run at another resolution or batch does not rebuild and re-pin the copy.
_BUILT: "weakref.WeakKeyDictionary[nn.Module, _Built]" = weakref.WeakKeyDictionary()
# A kept layout may stream this much more per forward than the least the run's budget allows; beyond it the
# host copy is rebuilt for the new layout (the bytes saved then repeat every forward, the rebuild is paid once).
KEEP_SLACK = 0.25
_BANDWIDTH: dict[tuple[str, bool], float] = {}     # (device, from pinned memory) -> bytes/s
# Per diffusion model, the weight keys the last run streamed patched (LoRA): ComfyUI may restore them in place
# into our arena views at its next load, which the store cannot see by pointer, so they are re-staged then.
_PATCHED: "weakref.WeakKeyDictionary[nn.Module, set[str]]" = weakref.WeakKeyDictionary()


def _gb(n: float) -> str:
    return f"{n / _GIB:.2f} GiB" if n >= 0.01 * _GIB else f"{n / 1024 ** 2:.1f} MiB"


@dataclass(frozen=True)
class PlanBudget:
    """Where the weights' VRAM budget comes from: the node's ``vram_budget_gb`` (``source`` "node"), a connected
    plan's diffusion-model share ("plan"), or ComfyUI's free memory (``budget_bytes`` None). ``line`` is what the
    report says about a connected plan; ``planned`` the plan's (precision, weight bytes), to name a mismatch."""

    budget_bytes: int | None = None
    source: str = "node"
    line: str = ""
    planned: tuple[str, int] | None = None


def plan_budget(plan) -> PlanBudget:
    """The budget a connected plan gives while ``vram_budget_gb`` is auto: its diffusion-model VRAM share when it
    streams the diffusion model. A plan that keeps it whole on the GPU (resident, or a phase of its own) gives
    none: its byte count is the whole model at the planned precision, which is no share to stream within, and the
    connected model may hold another precision (a bf16 model under an fp8 plan: 2x). ComfyUI's free memory then
    decides, as without a plan."""
    if plan is None:
        return PlanBudget(None, "auto")
    dit = plan.diffusion_model
    precision = str(getattr(dit, "precision", "") or "")
    planned = (precision, int(getattr(dit, "weight_bytes", 0) or 0))
    if getattr(dit, "streaming", None) is not None and dit.resident_bytes:
        return PlanBudget(int(dit.resident_bytes), "plan", f"the plan streams the diffusion model: its VRAM share "
                          f"{_gb(int(dit.resident_bytes))} is the budget", planned)
    residency = str(getattr(dit, "residency", "") or "whole")
    return PlanBudget(None, "auto", f"the plan keeps the diffusion model whole on the GPU ({precision} {residency}): "
                      "the budget stays auto (ComfyUI's free memory), so it streams only what does not fit", planned)


def plan_pin(plan, pin: str) -> tuple[PinMode, str]:
    """The host arena's pin mode: the node's, or on ``auto`` the pinning of a connected plan that streams the
    diffusion model (decided with the rest of its host copies). Returns (mode, source)."""
    mode = PinMode.parse(pin, "pin")
    dit = getattr(plan, "diffusion_model", None) if plan is not None else None
    if mode is PinMode.AUTO and dit is not None and getattr(dit, "streaming", None) is not None:
        return (PinMode.ON if getattr(dit, "pin", False) else PinMode.OFF), "the plan's"
    return mode, ""


@dataclass(frozen=True)
class BridgeRequest:
    """What the node asked for. ``budget_bytes`` None: derive it from ComfyUI's free memory."""

    config: PrefetchConfig
    budget_bytes: int | None = None
    budget: PlanBudget = PlanBudget()
    pin: PinMode = PinMode.AUTO         # the host arena: auto (the RAM rule), on, off
    pin_source: str = ""                # "the plan's" when a connected plan decided it


def _diffusion_model(patcher) -> nn.Module:
    return patcher.model.diffusion_model


def _staging(widest_bytes: int, cfg: PrefetchConfig) -> int:
    """Device bytes of the packed-streaming staging buffer for slots of ``widest_bytes`` (an upper
    bound: at most ``widest_bytes / 2`` bf16 values pack), 0 without packing."""
    return staging_nbytes(widest_bytes // 2) if cfg.packed else 0


def _layout_need(block_bytes: list[int], other_bytes: int, k: int, cfg: PrefetchConfig, n_dtypes: int = 1,
                 block_tensors: list[int] | None = None) -> int:
    """Device bytes of ComfyUI keeping the first ``k`` blocks loaded and the engine streaming the rest through
    its slots (as ``_resident_blocks`` sizes them)."""
    g = cfg.blocks_per_group if cfg.blocks_per_group != AUTO else 1
    d = cfg.prefetch_depth if cfg.prefetch_depth != AUTO else 1
    rest, counts = block_bytes[k:], (block_tensors or [0] * len(block_bytes))[k:]
    widest = max((sum(rest[i:i + g]) for i in range(0, len(rest), g)), default=0)
    tensors = max((sum(counts[i:i + g]) for i in range(0, len(rest), g)), default=0)
    return int(other_bytes + sum(block_bytes[:k]) + (d + 1) * slot_bound(widest, n_dtypes, tensors)
               + _staging(widest, cfg))


def streamable_bytes(root: nn.Module, blocks) -> list[int]:
    """Per block, the bytes that can stream: its tensors no other block and no module outside the blocks holds.
    The engine keeps those on the device whether their block streams or not (a tied or shared weight is in use
    while its block is not running), so they count with the resident part, once; per-block sizes counted them in
    every block that holds them and left them out of the resident part, and the engine then ran out of its
    budget after ComfyUI had loaded the model."""
    owners: dict[int, int] = {}
    for _, m in blocks:
        for i in _tensors([m]):
            owners[i] = owners.get(i, 0) + 1
    kept = held_outside(root, blocks) | {i for i, n in owners.items() if n > 1}
    return [sum(tensor_nbytes(t) for i, t in _tensors([m]).items() if i not in kept) for _, m in blocks]


def _tensors(modules) -> dict[int, torch.Tensor]:
    """The parameters and buffers of ``modules``, each once, by id."""
    return {id(t): t for m in modules for t in [*m.parameters(), *m.buffers()]}


def _unique_bytes(blocks) -> int:
    """Bytes of the tensors of ``blocks`` ((name, module) pairs), each once."""
    return sum(tensor_nbytes(t) for t in _tensors(m for _, m in blocks).values())


def _resident_blocks(block_bytes: list[int], other_bytes: int, budget: float, cfg: PrefetchConfig,
                     n_dtypes: int = 1, block_tensors: list[int] | None = None) -> int:
    """How many leading blocks ComfyUI keeps loaded: the most that leave room for the slots (blocks in
    ``n_dtypes`` dtypes, of ``block_tensors`` tensors each, as the engine lays them out)."""
    n = len(block_bytes)
    g = cfg.blocks_per_group if cfg.blocks_per_group != AUTO else 1
    d = cfg.prefetch_depth if cfg.prefetch_depth != AUTO else 1
    if cfg.resident_groups != AUTO:
        k = min(n, cfg.resident_groups * g)
        # streamed groups that would each keep one of the d + 1 slots move nothing, on more memory than the
        # blocks take loaded: ComfyUI loads them instead, where the whole model fits the budget
        return n if slots_hold_all(n - k, g, d) and other_bytes + sum(block_bytes) <= budget else k
    for k in range(n, -1, -1):
        if _layout_need(block_bytes, other_bytes, k, cfg, n_dtypes, block_tensors) <= budget:
            return k
    return 0


def _own_storage(t: torch.Tensor, arenas: list[tuple[int, int]]) -> None:
    """Give ``t`` (or the tensors inside a wrapper subclass) its own copy where it points into one of ``arenas``
    (address ranges)."""
    own = [t] if subclass.is_plain(t) or subclass.is_storage(t) else [x for _, x in subclass.leaves(t) or []]
    for x in own:
        if any(lo <= x.data_ptr() < hi for lo, hi in arenas):
            with torch.no_grad(), torch.inference_mode(x.is_inference()):
                x.data = subclass.plain(x.data).clone()


def _copy_ranges(root: nn.Module) -> list[tuple[int, int]]:
    """The host address ranges of GroupPrefetch's host copy of the diffusion model ``root`` (none without one)."""
    cached = _STORES.get(root)
    return [r for a in cached[1].arenas.values() for r in a.ranges()] if cached is not None else []


def host_copy_ranges(model) -> list[tuple[int, int]]:
    """``_copy_ranges`` of ``model``'s (a ComfyUI BaseModel's) diffusion model."""
    dm = getattr(model, "diffusion_model", None)
    return _copy_ranges(dm) if isinstance(dm, nn.Module) else []


def unshare_host_copy(module: nn.Module, source_root: nn.Module) -> int:
    """Give the tensors of ``module`` storage of their own where they point into GroupPrefetch's host copy of
    ``source_root`` (QuantizeDiT's copy of a model shares the tensors it keeps in full precision: norms, biases,
    modulation). The copy is rewritten in place whenever a LoRA on the source's streamed weights changes, which
    would change the copy's output. Parameters of ``module`` are its own objects (their data is rebound); a
    buffer may be the source's own object, so the module gets a new one. Returns the bytes copied."""
    ranges = _copy_ranges(source_root)
    if not ranges:
        return 0

    def inside(t) -> bool:
        return isinstance(t, torch.Tensor) and subclass.is_plain(t) and any(lo <= t.data_ptr() < hi
                                                                           for lo, hi in ranges)
    copied = 0
    with torch.no_grad():
        for mod in module.modules():
            for k, t in list(mod._parameters.items()):
                if inside(t) and type(t) is nn.Parameter:
                    with torch.inference_mode(t.is_inference()):
                        t.data = t.data.clone()
                    copied += tensor_nbytes(t)
            for k, t in list(mod._buffers.items()):
                if inside(t):
                    with torch.inference_mode(t.is_inference()):
                        mod._buffers[k] = t.clone()
                    copied += tensor_nbytes(t)
    return copied


def _stream_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The tensors a weight streams as: itself, or a wrapper subclass's inner tensors (fp8 codes and scale)."""
    inner = None if subclass.is_plain(t) or subclass.is_storage(t) else subclass.leaves(t)
    return [x for _, x in inner] if inner else [subclass.plain(t)]


def slots_hold_all(streamed_blocks: int, blocks_per_group: int, depth: int) -> bool:
    """Whether ``streamed_blocks`` in groups of ``blocks_per_group`` would each keep one of the ``depth + 1``
    device slots (nothing would cycle through them)."""
    return 0 < -(-streamed_blocks // blocks_per_group) <= depth + 1


@dataclass(frozen=True)
class SplitLayout:
    """Blocks split between ComfyUI and the engine: ComfyUI loads each block's tail modules
    through its own load list (so its ledger counts them); the engine streams the heads."""

    streamed: tuple[int, ...]          # indices of blocks with a non-empty head
    head_modules: frozenset[int]       # ids of the modules whose tensors stream
    streamed_bytes: int
    cap: int
    widest: int                        # the largest head: what each device slot holds
    cuts: tuple[int, ...]              # per block: how many of its leaf modules stream (the layout, by structure)
    tail_modules: frozenset[int]       # ids of the modules ComfyUI loads (modules outlive their parameters)


@dataclass(frozen=True)
class _Built:
    """A layout a host copy was built for, by structure (ComfyUI replaces parameter objects when it patches or
    moves a model, so their ids name nothing a run later): ``k`` leading blocks loaded by ComfyUI, or per-block
    ``cuts`` of a split (with its ``cap``)."""

    k: int
    cuts: tuple[int, ...] | None
    cap: int = 0


def _split_need(other_bytes: int, block_bytes: int, streamed: int, widest: int, depth: int, cfg: PrefetchConfig,
                n_dtypes: int, max_tensors: int) -> int:
    """Device bytes of a split layout: the non-block part, the resident tails, ``depth + 1`` slots of the widest
    head (and the packed staging buffer)."""
    return int(other_bytes + block_bytes - streamed + (depth + 1) * slot_bound(widest, n_dtypes, max_tensors)
               + _staging(widest, cfg))


def _store_ids(streamed, tail_modules: frozenset[int], packed: bool, pin: PinMode) -> tuple:
    """What a cached host copy was built for: the streamed blocks, the tail modules ComfyUI loads, packed or not,
    the pin mode asked for."""
    return tuple(id(b) for _, b in streamed), tail_modules, packed, pin


def _own_bytes(m: nn.Module) -> int:
    return sum(tensor_nbytes(p) for p in m.parameters(recurse=False))


def _split_blocks(blocks, other_bytes: int, budget: float, depth: int,
                  cfg: PrefetchConfig = PrefetchConfig(), n_dtypes: int = 1,
                  max_tensors: int = 0) -> SplitLayout | None:
    """The smallest head cap whose layout fits: other + tails + (depth + 1) x slot (+ staging) <= budget.

    A block's head is its non-leaf own tensors (ComfyUI never loads those per module) plus its
    leading leaf modules (registration order) up to the cap; the tail is the rest. Streamed bytes
    only grow with the cap, so the first cap that fits streams the fewest bytes."""
    parts = _block_parts(blocks)
    total_blocks = sum(hs[-1] for _, _, hs in parts)
    for cap in sorted({h for _, _, hs in parts for h in hs if h > 0}):
        cuts = [bisect.bisect_right(hs, cap) - 1 if hs[0] <= cap else 0 for _, _, hs in parts]   # hs grows with k
        heads = [hs[k] for (_, _, hs), k in zip(parts, cuts)]
        streamed = sum(heads)
        need = _split_need(other_bytes, total_blocks, streamed, max(heads), depth, cfg, n_dtypes, max_tensors)
        if need > budget:
            continue
        cuts = spend_leftover([hs for _, _, hs in parts], cuts, budget - need, depth)   # as the engine does
        return _split_at(parts, cuts, cap)
    return None


def _block_parts(blocks) -> list:
    """Per block: (modules with own tensors that always stream, leaf modules in order, head sizes), where head
    size ``k`` is the bytes the block streams when its first ``k`` leaf modules do."""
    parts = []
    for _, block in blocks:
        fixed, leaves = [], []
        for m in block.modules():
            own = _own_bytes(m)
            if not own:
                continue
            has_children_params = any(True for c in m.children() for _ in c.parameters())
            (fixed if has_children_params else leaves).append((m, own))
        heads = [sum(n for _, n in fixed)]
        for _, nbytes in leaves:
            heads.append(heads[-1] + nbytes)
        parts.append((fixed, leaves, heads))
    return parts


def _split_at(parts, cuts, cap: int) -> SplitLayout:
    """The split streaming each block's first ``cuts[b]`` leaf modules (with its fixed part), from the modules and
    parameters the blocks hold now."""
    heads = [hs[k] for (_, _, hs), k in zip(parts, cuts)]
    head_mods, tail_mods = set(), set()
    for (fixed, leaves, _), k in zip(parts, cuts):
        head_mods.update(id(m) for m, _ in fixed + leaves[:k])
        tail_mods.update(id(m) for m, _ in leaves[k:])
    idx = tuple(b for b, h in enumerate(heads) if h)
    return SplitLayout(idx, frozenset(head_mods), sum(heads), cap, max(heads), tuple(cuts), frozenset(tail_mods))


class _Session:
    """One sampling run of one patcher: scoped overrides, the attached engine, the report."""

    def __init__(self, state: "PrefetchState", patcher, noise: torch.Tensor | None, guider=None,
                 plan_share_failed: str = ""):
        self.state = state
        # a plan's share that cannot hold this model's least layout: the auto budget instead, and this says why
        self.plan_share_failed = plan_share_failed
        self.patcher = patcher
        self.handle: PrefetchHandle | None = None
        self.skip_reason: str | None = None
        self.root = _diffusion_model(patcher)
        self.layout: BlockLayout = find_blocks(self.root)
        sizes = streamable_bytes(self.root, self.layout.blocks)
        total = module_bytes(self.root)
        other = total - sum(sizes)
        # the models ComfyUI loads with this one for this run (ControlNets, GLIGEN, model patches): never asked to
        # make room, and their memory is not the streamed model's
        self.alongside: list = []
        self.budget_note = ""
        self.run_room = 0        # what ComfyUI keeps free for this run beside the weights (activations, reserve)
        self.reserved: list[int] = []   # device bytes the engine asked ComfyUI for, per layout it built
        self.budget = self._budget(noise, guider)
        cfg = state.request.config
        if cfg.packed and not packing_supported(patcher.load_device)[0]:
            cfg = replace(cfg, packed=False)     # no staging buffer to budget: weights will stream as stored
        # the engine's slots hold the tensors that stream (a quantized weight's codes and scale, not its
        # logical dtype), each aligned: size them the same way
        streams = [[x for t in [*b.parameters(), *b.buffers()] for x in _stream_tensors(t)]
                   for _, b in self.layout.blocks]
        n_dtypes = len({x.dtype for xs in streams for x in xs})
        block_tensors = [len(xs) for xs in streams]
        self.sizes, self.other, self.n_dtypes, self.block_tensors = sizes, other, n_dtypes, block_tensors
        self.split: SplitLayout | None = None
        self._use(_resident_blocks(sizes, other, self.budget, cfg, n_dtypes, block_tensors), None)
        split_ok = cfg.partial_blocks and cfg.resident_groups == AUTO and cfg.blocks_per_group in (AUTO, 1)
        depth = cfg.prefetch_depth if cfg.prefetch_depth != AUTO else 1
        if split_ok and not math.isinf(self.budget) and self.streamed:
            split = _split_blocks(self.layout.blocks, other, self.budget, depth, cfg, n_dtypes,
                                  max(block_tensors, default=0))
            if split is not None and split.streamed_bytes < self.streamed_bytes:
                self._use(0, split)
        # the least this run can stream with still does not fit (a budget below the non-block part plus d + 1
        # slots of the widest group): (needed, budget), decided before ComfyUI loads anything
        self.too_small: tuple[int, float] | None = None
        if self.split is None and self.streamed and not math.isinf(self.budget):
            need = _layout_need(sizes, other, self.k, cfg, n_dtypes, block_tensors)
            if need > self.budget:
                self.too_small = (need, self.budget)
        # bytes per forward the kept host copy's layout streams beyond this run's least (None: not kept)
        self.kept_extra: int | None = None
        # a host copy rebuilt for another layout: (bytes taken over from the old copy as they were, its arenas' bytes)
        self.rebuilt: tuple[int, int] | None = None
        if self.too_small is None:
            self._keep_built(other, cfg, n_dtypes, block_tensors, split_ok, depth)
        self._saved: dict[str, Any] = {}
        self.unloaded_stale: str | None = None

    def resident_groups_line(self) -> str:
        """When ``resident_groups`` set on the node is why the least layout does not fit: which value does ('' when
        it is on auto, or no value fits)."""
        cfg = self.state.request.config
        if cfg.resident_groups == AUTO or not self.too_small:
            return ""
        g = cfg.blocks_per_group if cfg.blocks_per_group != AUTO else 1
        fits = [r for r in range(cfg.resident_groups - 1, -1, -1)
                if _layout_need(self.sizes, self.other, min(len(self.sizes), r * g), cfg, self.n_dtypes,
                                self.block_tensors) <= self.too_small[1]]
        if not fits:
            return ""
        k = min(len(self.sizes), cfg.resident_groups * g)
        return (f"with resident_groups={cfg.resident_groups}, {k} block{'s stay' if k != 1 else ' stays'} loaded beside "
                f"the slots: set it to {fits[0]} or less (or -1, auto)")

    def _use(self, k: int, split: SplitLayout | None) -> None:
        """Take a layout: ``k`` leading blocks loaded by ComfyUI and the rest streamed whole, or ``split``."""
        self.k, self.split = k, split
        if split is None:
            self.streamed = self.layout.blocks[k:]
            self.streamed_bytes = sum(self.sizes[k:])
            self.streamed_ids = {id(sub) for _, b in self.streamed for sub in b.modules()}
        else:
            self.streamed = [self.layout.blocks[b] for b in split.streamed]
            self.streamed_bytes = split.streamed_bytes
            self.streamed_ids = set(split.head_modules)
        # a streamed block's layer the model also holds outside the streamed blocks (by another name) is loaded by
        # ComfyUI with the resident part: the host copy keeps its tensors out (``held_outside``)
        self.streamed_ids -= modules_outside(self.root, self.streamed)

    def _keep_built(self, other: int, cfg: PrefetchConfig, n_dtypes: int, block_tensors: list[int],
                    split_ok: bool, depth: int) -> None:
        """Keep the layout this model's cached host copy was built for, instead of this run's least-streaming
        one, while it fits this run's budget and streams at most ``KEEP_SLACK`` more per forward. A run at another
        resolution or batch (auto budget), or another budget, would otherwise rebuild the copy: one more copy of
        the streamed bytes in host RAM while it is built, and seconds to copy and pin it, every time the size
        alternates. Only the auto layout moves: a resident_groups set on the node is the layout."""
        built, cached = _BUILT.get(self.root), _STORES.get(self.root)
        now = (self.k, self.split.cuts if self.split is not None else None)
        if (built is None or cached is None or cfg.resident_groups != AUTO or math.isinf(self.budget)
                or not self.streamed or (built.k, built.cuts) == now):
            return
        split = None
        if built.cuts is None:
            streamed = sum(self.sizes[built.k:])
            need = _layout_need(self.sizes, other, built.k, cfg, n_dtypes, block_tensors)
            ids = _store_ids(self.layout.blocks[built.k:], frozenset(), cfg.packed, self._pin_mode())
        elif split_ok:
            parts = _block_parts(self.layout.blocks)
            if len(parts) != len(built.cuts) or any(k >= len(hs) for (_, _, hs), k in zip(parts, built.cuts)):
                return          # the blocks changed (another module patched in): not the layout built
            split = _split_at(parts, built.cuts, built.cap)
            streamed = split.streamed_bytes
            need = _split_need(other, sum(hs[-1] for _, _, hs in parts), streamed, split.widest, depth, cfg,
                               n_dtypes, max(block_tensors, default=0))
            ids = _store_ids([self.layout.blocks[b] for b in split.streamed], split.tail_modules, cfg.packed,
                             self._pin_mode())
        else:
            return
        if need > self.budget or streamed > (1 + KEEP_SLACK) * self.streamed_bytes or cached[0] != ids:
            return
        self.kept_extra = max(0, streamed - self.streamed_bytes)
        self._use(built.k, split)

    @property
    def tails(self) -> frozenset[int]:
        """Ids of the block tensors ComfyUI loads itself (the tails of split blocks; none without a split), read
        from the tail modules when asked: ComfyUI's load replaces parameter objects (fp8 layers at every move, a
        LoRA'd weight when it patches), so ids taken before it loaded name nothing after."""
        if self.split is None:
            return frozenset()
        mods = self.split.tail_modules
        return frozenset(id(p) for _, b in self.streamed for m in b.modules() if id(m) in mods
                         for p in m.parameters(recurse=False))

    # budget ----------------------------------------------------------------------------------
    def _budget(self, noise, guider=None) -> float:
        """The VRAM this run's weights may take. An explicit budget as given; on auto, what ComfyUI's own load
        makes room for: the free memory, plus what this model already holds and what the other loaded models hold
        (ComfyUI unloads those for a model that needs the room), minus the models it loads alongside that are not
        loaded yet and the room ComfyUI keeps free for the run (``max(minimum inference memory, this run's
        activations as ComfyUI estimates them + its extra reserve)``, reference latents and ControlNet inference
        memory included). ``run_room`` is kept free again when the engine takes its slots."""
        req = self.state.request
        self.alongside = sampling_models(self.patcher, guider)
        import comfy.model_management as mm
        dev = self.patcher.load_device
        if mm.is_device_cpu(dev):   # nothing to save on a CPU load device unless a budget was given
            if req.budget_bytes is not None and not self.plan_share_failed:
                self.budget_note = ("the load device is the CPU (ComfyUI runs with --cpu or found no GPU): the "
                                    "streamed groups are copied host to host, which saves no memory and costs "
                                    "time; clear vram_budget_gb to run the model resident")
                return float(req.budget_bytes)
            if self.plan_share_failed:
                self.budget_note = f"{self.plan_share_failed}; using the auto budget: none (the load device is the CPU)"
            return math.inf
        activations = sampling_activations(self.patcher, noise, guider)
        extra_reserved = getattr(mm, "extra_reserved_memory", lambda: 0)()
        self.run_room = int(max(mm.minimum_inference_memory(), activations + extra_reserved))
        if req.budget_bytes is not None and not self.plan_share_failed:
            return float(req.budget_bytes)
        own = self.patcher.loaded_size()
        in_use = {id(m) for m in self.alongside}
        # a clone of this model, or of a model loaded with it, is ComfyUI's same weights: it detaches the clone and
        # keeps them loaded
        same_weights = {id(self.patcher.model), *(id(getattr(m, "model", None)) for m in self.alongside)}
        evictable = 0
        for lm in list(mm.current_loaded_models):
            m = getattr(lm, "model", None)
            if (m is None or m is self.patcher or id(m) in in_use or torch.device(lm.device) != torch.device(dev)
                    or id(getattr(m, "model", None)) in same_weights):
                continue
            evictable += int(lm.model_loaded_memory())
        alongside = 0
        for m in self.alongside:
            try:
                if torch.device(m.load_device) == torch.device(dev):
                    alongside += max(0, int(m.model_size()) - int(m.loaded_size()))
            except (AttributeError, TypeError, RuntimeError):
                continue
        free = mm.get_free_memory(dev)
        budget = max(0.0, free + own + evictable - alongside - self.run_room)
        self.budget_note = ((f"{self.plan_share_failed}; using the " if self.plan_share_failed else "")
                            + f"auto budget = free {_gb(free)} + this model's loaded {_gb(own)} + other models "
                            f"ComfyUI may unload {_gb(evictable)} - models loaded with it {_gb(alongside)} - room "
                            f"ComfyUI keeps for the run {_gb(self.run_room)} (activations {_gb(activations)})")
        return budget

    # scoped ComfyUI overrides ------------------------------------------------------------------
    def install_load_overrides(self) -> None:
        """Make ComfyUI load only the non-streamed part (instance attributes, removed in close)."""
        if not self.streamed or self.too_small:
            return
        self.unload_stale_placement()
        p = self.patcher
        cls = type(p)
        streamed_ids, streamed_bytes = self.streamed_ids, self.streamed_bytes
        orig_load_list, orig_load, orig_size = cls._load_list, cls.load, cls.model_size

        def _load_list(*args, **kwargs):
            items = orig_load_list(p, *args, **kwargs)
            return [x for x in items if not (isinstance(x[-2], nn.Module) and id(x[-2]) in streamed_ids)]

        def load(device_to=None, lowvram_model_memory=0, force_patch_weights=False, full_load=False, **kw):
            # full load would end in model.to(device): streamed blocks too. Load "everything that
            # fits" instead, which with the filtered list is exactly the non-streamed part.
            if full_load or not lowvram_model_memory:
                lowvram_model_memory = 1e32
            self._reset_streamed_modules()
            if hasattr(p, "mmap_released"):
                # ComfyUI-GGUF's first load moves every module left on the offload device (here: every streamed
                # block) to the GPU and back, to detach it from the file's memory map. The streamed blocks are
                # detached by the engine's own copy into its host arena, so that round trip (and the re-staging
                # it forces on every new clone) is skipped; the modules ComfyUI loads are copied as usual.
                p.mmap_released = True
            # by keyword: patchers that override load with (*args, force_patch_weights=..., **kwargs), such as
            # ComfyUI-GGUF's, pass force_patch_weights on by keyword themselves
            out = orig_load(p, device_to, lowvram_model_memory=lowvram_model_memory,
                            force_patch_weights=force_patch_weights, full_load=False, **kw)
            # part of the model is off the device: other clones must take the lowvram path
            p.model.model_lowvram = True
            return out

        def model_size():
            return max(0, orig_size(p) - streamed_bytes)

        for name, fn in (("_load_list", _load_list), ("load", load), ("model_size", model_size)):
            self._saved[name] = p.__dict__.get(name, _MISSING)
            setattr(p, name, fn)

    def unload_stale_placement(self) -> None:
        """Before ComfyUI loads: if weights this run streams are still on the device from an earlier load of the
        same model (a previous run that kept more resident: another resolution or batch, an explicit budget
        changed, another split; or a clone loaded without this node), ComfyUI unloads that model first. ComfyUI
        never moves a loaded module back because the load list shrank, and streamed blocks left half on the
        device would have to be skipped. What it did goes into the report (``unloaded_stale``)."""
        stale = self._streamed_on_device()
        if not stale or not unload_entries_of(self.patcher.model):
            return
        self.unloaded_stale = (f"ComfyUI unloaded this model first: {len(stale)} blocks streamed this run "
                               "were still on the device from an earlier load with more resident")
        log.info("levers: %s", self.unloaded_stale)

    def _streamed_on_device(self) -> set[str]:
        """Names of streamed blocks with a tensor (one ComfyUI does not load itself: not a split block's tail, not
        one a module outside the streamed blocks holds too) off the host."""
        own = self.tails | held_outside(self.root, self.streamed)
        return {n for n, b in self.streamed for t in b.parameters() if t.device.type != "cpu" and id(t) not in own}

    def _reset_streamed_modules(self) -> None:
        """Drop lowvram cast state another clone may have left on streamed modules (its LoRA
        patches would otherwise apply to ours)."""
        import comfy.model_patcher as mp
        wipe = getattr(mp, "wipe_lowvram_weight", None)
        if wipe is None:
            return
        for _, block in self.streamed:
            for m in block.modules():
                if id(m) in self.streamed_ids:
                    wipe(m)

    def remove_load_overrides(self) -> None:
        for name, old in self._saved.items():
            if old is _MISSING:
                self.patcher.__dict__.pop(name, None)
            else:
                self.patcher.__dict__[name] = old
        self._saved.clear()

    # engine ------------------------------------------------------------------------------------
    def attach(self) -> None:
        """First model call of the run: ComfyUI has loaded and patched; stream the rest."""
        if self.too_small:
            need, budget = self.too_small
            resident = self.resident_groups_line()
            self.skip_reason = ((f"the free VRAM for this model's weights ({_gb(budget)}) cannot hold the blocks "
                                 f"resident_groups keeps loaded plus the streaming slots ({_gb(need)}), so ComfyUI "
                                 f"loads it itself this run (its own lowvram path); {resident}") if resident else
                                (f"the free VRAM for this model's weights ({_gb(budget)}) cannot hold its non-block "
                                 f"part plus the streaming slots of its widest blocks ({_gb(need)}), so ComfyUI "
                                 "loads it itself this run (its own lowvram path); a smaller resolution or batch, "
                                 "blocks_per_group=1 and prefetch_depth=1, or QuantizeDiT first make room"))
            return
        if not self.streamed:
            cfg = self.state.request.config
            g = cfg.blocks_per_group if cfg.blocks_per_group != AUTO else 1
            if cfg.resident_groups != AUTO and cfg.resident_groups * g < len(self.layout.blocks):
                d = cfg.prefetch_depth if cfg.prefetch_depth != AUTO else 1
                self.skip_reason = (f"resident_groups={cfg.resident_groups} leaves too few groups to stream: each "
                                    f"would keep one of the {d + 1} device slots and nothing would move, on more "
                                    "memory than those blocks take loaded, so ComfyUI loads every block")
            else:
                self.skip_reason = "everything fits the budget: nothing to stream"
            return
        dev = self.patcher.load_device
        if torch.device(dev).type != "cpu" and self._streamed_on_device():
            self.skip_reason = (f"ComfyUI already holds the streamed blocks on {dev} (loaded by another clone "
                                f"of this model); streaming resumes after it is unloaded (Free model and node cache)")
            return
        patched = self._patch_streamed_keys()
        transport = make_transport(dev)
        store = self._store(transport, patched)
        from .phase import adopt_moved_masters
        adopt_moved_masters(self.patcher)       # PhaseOffload before this node: its masters are the arena now
        bandwidth = self._bandwidth(transport, store)
        # the engine's share: the budget less what ComfyUI loads. A tensor the streamed blocks share among
        # themselves is the engine's to place (ComfyUI loads none of their modules), so it counts in that share
        # (a tensor also held outside them too: the engine keeps it with its remainder and counts it there)
        engine_moves = self.streamed_bytes if self.split is not None else _unique_bytes(self.streamed)
        budget = self.budget - (module_bytes(self.root) - engine_moves) if not math.isinf(self.budget) else AUTO
        reserve = None
        if budget != AUTO:
            budget = max(0, int(budget))
            import comfy.model_management as mm
            if not mm.is_device_cpu(dev):
                reserve = self._reserve(mm, dev)
        # ComfyUI holds the resident part (whole blocks, or the tails of split blocks) through its
        # own load list; the engine streams exactly the rest, in whole-block (head) groups.
        cfg = replace(self.state.request.config, resident_groups=0, budget_bytes=budget, manage_resident=False,
                      partial_blocks=False)
        layout = replace(self.layout, blocks=tuple(self.streamed))
        self.handle = apply_group_prefetch(self.root, cfg, transport, bandwidth=bandwidth, store=store,
                                           layout=layout, reserve=reserve, timed_between=self._between())

    def _between(self) -> list[tuple[int, nn.Module]]:
        """The blocks ComfyUI loads whole that run between two streamed ones (a split plan streams heads of some
        blocks only), each with the streamed block before it (its index among the streamed): the engine counts
        their compute with that block's, so its floor, predictions and auto choice see them."""
        if self.split is None:
            return []           # ComfyUI's blocks are a prefix: the engine counts them before its first block
        streamed = list(self.split.streamed)
        out = []
        for j, (_, block) in enumerate(self.layout.blocks):
            if j in streamed or j < streamed[0] or j > streamed[-1]:
                continue
            out.append((bisect.bisect_left(streamed, j) - 1, block))
        return out

    def _reserve(self, mm, dev):
        """Before the engine allocates a layout's slots: ask ComfyUI for exactly those bytes plus the room the
        run needs beside the weights (ComfyUI's own load freed room for the resident part and the run, not for
        the slots). Other models are unloaded only as far as that takes: a text encoder or VAE that still fits
        stays loaded. This model and the models it runs with (a ControlNet) are in use and never unloaded."""
        used = {id(self.patcher), *(id(m) for m in self.alongside)}

        def reserve(nbytes: int) -> None:
            keep = [lm for lm in mm.current_loaded_models if id(getattr(lm, "model", None)) in used]
            self.reserved.append(nbytes)
            mm.free_memory(nbytes + self.run_room, dev, keep_loaded=keep)
        return reserve

    def _patch_streamed_keys(self) -> set[str]:
        """LoRA and other weight patches on streamed weights, applied by ComfyUI itself on the
        offload device (so they are backed up and undone by ComfyUI, and what streams is patched).
        Returns the keys of the streamed weights that carry a patch this run."""
        p = self.patcher
        prefix = "diffusion_model."
        tails = self.tails
        patched = set()
        owners: dict[int, torch.nn.Module] = {}
        arenas = _copy_ranges(self.root)
        for name, block in self.streamed:
            for pname, param in block.named_parameters():
                if id(param) in tails:
                    continue   # ComfyUI loads (and patches) the tails itself
                key = f"{prefix}{name}.{pname}"
                if key not in p.patches:
                    continue
                patched.add(key)
                owner = block.get_submodule(pname.rpartition(".")[0])
                owners[id(owner)] = owner
                if key not in p.backup:
                    # ComfyUI backs up the weight it patches and puts it back afterwards. Between runs a streamed
                    # weight still points at the store's arena, where the patched values are about to be staged:
                    # the backup gets its own storage first. (ComfyUI's fp8 layers even rebuild their
                    # QuantizedTensor around the same arena memory whenever the model moves, so the store cannot
                    # know which object ComfyUI will back up.)
                    _own_storage(param, arenas)
                    p.patch_weight_to_device(key, device_to=p.offload_device)
        for owner in owners.values():
            # ComfyUI's own mark of a module whose weights carry this patch set: a stock load of a clone with the same
            # patches (the node bypassed, LoraLoader's output sampled) skips it instead of patching the patched
            # weights again (the LoRA twice); ComfyUI's unpatch clears the mark with the backups
            owner.comfy_patched_weights = True
        return patched

    def _store(self, transport: Transport, patched: set[str]) -> HostStore:
        tails = self.tails
        cfg = self.state.request.config
        packed = cfg.packed and packing_supported(transport.device)[0]
        split = self.split
        ids = _store_ids(self.streamed, split.tail_modules if split is not None else frozenset(), packed,
                         self._pin_mode())
        _BUILT[self.root] = _Built(self.k, split.cuts if split is not None else None,
                                   split.cap if split is not None else 0)
        cached = _STORES.get(self.root)
        before = _PATCHED.get(self.root, set())
        if cached is not None and cached[0] == ids:
            # weights patched now but not last run, or last run but not now (ComfyUI may have patched or restored
            # them in place, which no pointer shows) are re-packed; a patch kept across runs is left alone (a new
            # strength rewrites the weight, which the store's pointer check or sampled fingerprint catches)
            try:
                cached[1].refresh(transport, force=self._entries(cached[1], before ^ patched))
                _PATCHED[self.root] = set(patched)   # only once re-staged: a failed refresh forces them again
                return cached[1]
            except torch.cuda.OutOfMemoryError:
                raise          # not a sign the copy is stale: a second copy built under memory pressure would be worse
            except RuntimeError as exc:
                # a streamed weight changed kind (dtype, shape, or a quantized weight replaced by a plain one):
                # this store no longer describes the blocks; build a new one
                log.info("levers: GroupPrefetch rebuilds its host copies: %s", exc)
        # PhaseOffload before this node: its masters of the blocks about to be copied would hold their old memory
        # through the build (and those of blocks loaded now, the last copy): let go, taken again once it is built
        from .phase import let_go_for_host_copy
        old_ranges = _copy_ranges(self.root) if cached is not None else []
        let_go_for_host_copy(self.patcher, [m for _, m in self.streamed], tails, old_ranges)
        if cached is not None:
            # a weight the old copy streamed that ComfyUI loads and patches now: its backup (the weight ComfyUI puts
            # back when it unpatches) still points into the old arenas and would keep all of them alive
            for bk in list(getattr(self.patcher, "backup", {}).values()):
                w = getattr(bk, "weight", None)
                if isinstance(w, torch.Tensor) and w.device.type == "cpu":
                    _own_storage(w, old_ranges)
            # the copy of blocks this layout streams no more goes before the pin decision reads the available RAM;
            # the rest stays for the new copy to take over where it is laid out the same (no copy, no pin again)
            old = cached[1]
            old.restore(transport, keep=[m for _, m in self.streamed])
            _STORES.pop(self.root, None)
            cached = None
        else:
            old = None
        store = HostStore(self.streamed, transport, exclude=tails, packed=packed,
                          decide_pin=self._pin_decider(transport, tails), adopt=old, root=self.root)
        if old is not None:
            old.restore(transport)
            self.rebuilt = (store.adopted_bytes, sum(a.nbytes for a in store.arenas.values()),
                            sum(store.arenas[d].nbytes for d in store._planes))
        _STORES[self.root] = (ids, store)
        _PATCHED[self.root] = set(patched)
        return store

    def _pin_mode(self) -> PinMode:
        """The host copy's pin mode: the node's (or the plan's), off when the engine config says not to pin."""
        req = self.state.request
        return req.pin if req.config.pin else PinMode.OFF

    def _pin_decider(self, transport: Transport, tails: frozenset[int]) -> PinDecider:
        """Whether the host copy about to be built is page-locked, and why (``arena_pin_decision``), asked by the
        store with the exact bytes it is about to pin (``HostStore``'s ``decide_pin``): the RAM rule counts what
        Levers holds pinned already, less the pinned masters of the weights the copy takes over (PhaseOffload's),
        and leaves out of the available RAM the weights that are a file's page cache (file mappings not written
        since; until the copy exists: the RAM read after it was built already went to it). Both are read from the
        blocks when the store asks, before the copy takes their place (and after a rebuild has unpinned the old
        copy's segments it cannot take over)."""
        req = self.state.request
        has_cuda = torch.device(transport.device).type == "cuda"
        mode = self._pin_mode()
        if mode is not PinMode.AUTO or not has_cuda:
            pin, why = arena_pin_decision(mode, self.streamed_bytes, has_cuda)
            why = f"{why} ({req.pin_source} pinning)" if req.pin_source else why
            return lambda nbytes, allocated: (pin, why)
        streamed = list(self.streamed)

        def held_now() -> tuple[int, int]:
            """(pinned bytes of the weights the copy replaces, their bytes that are a file's page cache)."""
            seen: set[int] = set()
            replaced = mapped = 0
            maps = HostMaps.recent(max_age_s=0.0)
            for _, block in streamed:
                for t in [*block.parameters(), *block.buffers()]:
                    if id(t) in tails:
                        continue
                    for x in _stream_tensors(t):
                        if x.device.type != "cpu" or not x.numel() or x.data_ptr() in seen:
                            continue
                        seen.add(x.data_ptr())
                        n = tensor_nbytes(x)
                        replaced += n if pinned_by_levers(x) else 0
                        mapped += maps.page_cache(x.data_ptr(), n)
            return replaced, mapped

        def decide(nbytes: int, allocated: bool) -> tuple[bool, str]:
            # once the copy exists (a packed copy's planes, a later run's fallback), what Levers holds pinned is
            # read as it is: masters it replaced and still pinned then are still held
            replaced, mapped = (0, 0) if allocated else held_now()
            pin, why = arena_pin_decision(PinMode.AUTO, nbytes, True, replaced_bytes=replaced, mapped_bytes=mapped)
            return pin, why if pin else f"{why}; pin = on pins it anyway (each step's copies run at pageable speed now)"
        return decide

    def _entries(self, store: HostStore, keys: set[str]) -> list:
        """The store entries holding these ``diffusion_model.``-prefixed weight keys."""
        by_ref: dict[tuple[int, str], list] = {}     # a wrapper subclass weight is several entries
        for e in store.entries:
            for r in e.refs:
                by_ref.setdefault((id(r.owner), r.name), []).append(e)
        out = []
        for key in keys:
            path, _, name = key[len("diffusion_model."):].rpartition(".")
            try:
                owner = self.root.get_submodule(path)
            except AttributeError:
                continue
            out.extend(by_ref.get((id(owner), name), []))
        return out

    @staticmethod
    def _bandwidth(transport: Transport, store: HostStore) -> float:
        # from the kind of memory the weights stream from: a host copy left pageable (pin off, or the RAM rule
        # declining) copies at a fraction of the pinned rate, which the plan, the floor and the report would claim
        pinned = store.streams_pinned
        key = (str(transport.device), pinned)
        if key not in _BANDWIDTH:
            _BANDWIDTH[key] = measure_bandwidth(transport, nbytes=min(256 * 1024 ** 2, max(1024 ** 2, store.host_bytes)),
                                                pinned=pinned)
        return _BANDWIDTH[key]

    def close(self) -> str:
        """Take the engine off the model and the patcher (always), and return the run's report."""
        try:
            report = self.report()
        except Exception as e:            # the numbers are a report; the model is restored regardless
            log.warning("levers: GroupPrefetch report failed (%s: %s)", type(e).__name__, e)
            report = f"GroupPrefetch: the run's numbers could not be read ({type(e).__name__}: {e})."
        finally:
            if self.handle is not None:
                self.handle.remove()      # hooks off, slots freed; weights stay on their host views
                self.handle = None
            self.remove_load_overrides()
        return report

    def report(self) -> str:
        kept = (f"{self.k} kept loaded by ComfyUI, {len(self.streamed)} streamed ({_gb(self.streamed_bytes)})"
                if self.split is None else
                f"split: ComfyUI loads each block's tail modules, {len(self.streamed)} blocks stream a head of at "
                f"most {_gb(self.split.cap)} ({_gb(self.streamed_bytes)} in all)")
        head = (f"GroupPrefetch: {len(self.layout.blocks)} {self.layout.architecture} blocks; {kept}; "
                f"budget {'none' if math.isinf(self.budget) else _gb(self.budget)}.")
        if self.budget_note:
            head += f"\n{self.budget_note}."
        if self.reserved:
            head += (f"\nroom asked of ComfyUI for the streaming slots: {_gb(self.reserved[-1])} + the run's "
                     f"{_gb(self.run_room)} (other models unloaded only as far as that takes)")
            if len(self.reserved) > 1:
                head += f"; {len(self.reserved)} layouts built (calibrated re-plan)"
            head += "."
        if dynamic_vram_active():
            head += "\n" + legacy_under_dynamic_line(self.patcher)
        lowvram = lowvram_mode_line()
        if lowvram:
            head += f"\n{lowvram} (here: the resident part and the split blocks' tails)."
        if self.kept_extra is not None:
            head += (f"\nhost copy kept: the layout it was built for still fits this budget and streams "
                     f"{_gb(self.kept_extra)} more per forward than the least this budget allows (at most "
                     f"{KEEP_SLACK:.0%} more), so it is not rebuilt and re-pinned for this run's size.")
        if self.rebuilt is not None:
            taken, total, packed = self.rebuilt
            head += (f"\nhost copy rebuilt for this layout: {_gb(taken)} of its {_gb(total)} taken over where the "
                     f"last copy held it (not copied again, nor page-locked again where it was), "
                     f"{_gb(total - taken)} copied."
                     if taken else
                     f"\nhost copy rebuilt for this layout: {_gb(total)} copied"
                     + (" (no segment of the last copy held the same blocks laid out the same)." if not packed
                        else "."))
            if packed:
                head += (f" Its {_gb(packed)} of packed bf16 is one piece, copied again on every rebuild: the old "
                         "and the new copy of it are both held until the new one is complete.")
        if self.unloaded_stale:
            head += f"\n{self.unloaded_stale}."
        if self.skip_reason:
            return f"{head}\nnot streaming this run: {self.skip_reason}."
        if self.handle is None:
            return head
        return f"{head}\n{self.handle.report()}"


_MISSING = object()


class PrefetchState:
    """Shared by a clone and its clones (``clone`` copies the wrapper lists, not this object; a
    deep copy of the model options returns it unchanged too)."""

    def __init__(self, request: BridgeRequest, node_id: str | None = None):
        self.request = request
        self.node_id = node_id
        self.session: _Session | None = None
        self.last_report = ""
        self.last_stats: dict | None = None

    def __deepcopy__(self, memo):
        return self

    def outer_sample(self, executor, *args, **kwargs):
        guider = executor.class_obj
        patcher = guider.model_patcher
        if patcher_is_dynamic(patcher):
            self.last_report = stand_aside_line()
            return executor(*args, **kwargs)
        aside = stays_on_device_line(patcher) or (HOOKS_LINE if getattr(patcher, "hook_patches", None) else None)
        if aside:
            self.last_report = aside
            log.info("levers: %s", aside)
            from .phase import send_to_node
            send_to_node(aside, self.node_id)
            return executor(*args, **kwargs)
        noise = args[0] if args and isinstance(args[0], torch.Tensor) else kwargs.get("noise")
        session = _Session(self, patcher, noise, guider)
        if session.too_small and self.request.budget.source == "plan":
            # the plan's share was sized for the planned precision and blocks; this model cannot stream within it
            session = _Session(self, patcher, noise, guider, plan_share_failed=self._plan_share_line(session))
        elif session.too_small and self.request.budget_bytes is not None:
            need, budget = session.too_small
            resident = session.resident_groups_line()
            raise BudgetExceeded(need, int(budget), "GroupPrefetch (vram_budget_gb)",
                                 hint=(f"{resident[0].upper()}{resident[1:]}, or raise vram_budget_gb." if resident
                                       else "The budget must hold the model's non-block part plus prefetch_depth + 1 "
                                       "slots of its widest block group: raise vram_budget_gb, set "
                                       "blocks_per_group=1 and prefetch_depth=1, quantize the model first, or leave "
                                       "the budget on auto (ComfyUI then loads the model itself when even that does "
                                       "not fit)."))
        self.session = session
        try:
            session.install_load_overrides()
            return executor(*args, **kwargs)
        finally:
            try:
                self.last_stats = session.handle.stats() if session.handle is not None else None
                if self.last_stats is not None:
                    # bytes per forward the kept host copy's layout streams beyond the run's least (None: not kept)
                    self.last_stats["host_copy_kept_extra_bytes"] = session.kept_extra
                    # a rebuilt host copy: the bytes taken over from the last copy in place (None: not rebuilt)
                    self.last_stats["host_copy_adopted_bytes"] = (session.rebuilt[0] if session.rebuilt is not None
                                                                  else None)
            except Exception as e:        # the numbers are a report; close() restores the model regardless
                log.warning("levers: GroupPrefetch stats failed (%s: %s)", type(e).__name__, e)
                self.last_stats = None
            self.last_report = session.close()
            self.session = None
            log.info("levers: %s", self.last_report.replace("\n", " | "))
            from .phase import send_to_node
            send_to_node(self.last_report, self.node_id)   # the achieved numbers, on the node; fail-soft

    def _plan_share_line(self, session: "_Session") -> str:
        need, share = session.too_small
        line = (f"the plan's diffusion-model share ({_gb(int(share))}) cannot hold this model's non-block part plus "
                f"the streaming slots of its widest blocks ({_gb(need)})")
        planned = self.request.budget.planned
        held = module_bytes(session.root)
        if planned and planned[1] and held > 1.05 * planned[1]:
            line += (f": the plan sized {planned[0]} weights ({_gb(planned[1])}), this model holds {_gb(held)} "
                     "(connect the same plan to QuantizeDiT before GroupPrefetch)")
        return line

    def apply_model(self, executor, *args, **kwargs):
        s = self.session
        if s is not None and s.handle is None and s.skip_reason is None:
            s.attach()
        if s is not None and s.handle is not None:
            # BaseModel.apply_model's executor arguments: x, t, c_concat, c_crossattn, control, transformer_options
            s.handle.route_key = route_key(args[5] if len(args) > 5 else kwargs.get("transformer_options"))
        return executor(*args, **kwargs)


def sampling_models(patcher, guider) -> list:
    """The models ComfyUI loads with ``patcher`` for this sampling run, once each (``comfy.sampler_helpers``' own
    lists: ControlNets and GLIGEN in the conditioning, models registered by hooks, nested additional models; and,
    as ``load_models_gpu`` adds them, every model's model patches)."""
    try:
        import comfy.sampler_helpers as sh
        conds = getattr(guider, "conds", None) or {}
        models = list(sh.get_additional_models(conds, patcher.model_dtype())[0])
        models += sh.get_additional_models_from_model_options(getattr(guider, "model_options", None))
        nested = getattr(patcher, "get_nested_additional_models", None)
        models += list(nested()) if callable(nested) else []
        for m in [patcher, *models]:      # load_models_gpu also loads each model's model patches (ControlNet patches)
            patches = getattr(m, "model_patches_models", None)
            models += list(patches()) if callable(patches) else []
        return list({id(m): m for m in models if m is not patcher}.values())     # once each, as ComfyUI loads them
    except Exception as e:          # a planning aid: a conditioning this ComfyUI cannot read is not an error here
        log.info("levers: GroupPrefetch could not list the models loaded with this one (%s: %s)", type(e).__name__, e)
        return []


def sampling_activations(patcher, noise, guider) -> int:
    """The activation bytes ComfyUI reserves for this run: its own ``estimate_memory`` (cond and uncond batched,
    reference latents of edit models counted) plus the ControlNets' inference memory; the noise-only estimate
    on a ComfyUI without it."""
    if noise is None:
        return 0
    shape = list(noise.shape)
    try:
        import comfy.sampler_helpers as sh
        conds = getattr(guider, "conds", None) or {}
        estimate = getattr(sh, "estimate_memory", None)
        if callable(estimate) and conds:
            inference = sh.get_additional_models(conds, patcher.model_dtype())[1]
            return int(estimate(patcher, shape, conds)[0] + inference)
    except Exception as e:          # fall back to the noise-only estimate below
        log.info("levers: GroupPrefetch used the noise-only activation estimate (%s: %s)", type(e).__name__, e)
    return int(patcher.model.memory_required([shape[0] * 2] + shape[1:]))     # cond + uncond in one batch


def route_key(transformer_options: Any) -> Any:
    """Which blocks this model call replaces: skip-layer guidance replaces the blocks it skips with a function that
    does not run them, so its calls learn their own route apart from the full ones (``PrefetchHandle.route_key``)."""
    opts = transformer_options if isinstance(transformer_options, dict) else {}
    replaced = opts.get("patches_replace") or {}
    key = frozenset((kind, name) for kind, table in replaced.items() if isinstance(table, dict) for name in table)
    return key or None


HOOKS_LINE = ("GroupPrefetch stands aside for this run: its conditioning carries weight hooks (hook LoRA, "
              "scheduled LoRA), which ComfyUI writes into the weights between model calls; streamed copies would "
              "miss those writes. ComfyUI loads the model itself this run. Apply the LoRA with a LoraLoader to "
              "stream it.")


def stays_on_device_line(patcher) -> str | None:
    """Why ComfyUI keeps this model on its GPU whatever loads (its offload device is the load device: --highvram,
    --gpu-only), or None. Nothing can stream from the host then: the blocks are on the GPU from the start, and an
    unload moves them to the GPU again."""
    if not stays_on_gpu(patcher.load_device, patcher.offload_device):
        return None
    return (f"GroupPrefetch stands aside: ComfyUI keeps this model on {patcher.load_device} (its offload device is the GPU: "
            "ComfyUI started with --highvram or --gpu-only), so there is no host copy to stream from. Start "
            "ComfyUI without that flag to stream the blocks.")


def stand_aside_line() -> str:
    return ("GroupPrefetch stands aside: ComfyUI DynamicVRAM is active and already streams weights per module "
            "with its own prefetch; two streamers would fight over VRAM. Start ComfyUI with "
            "--disable-dynamic-vram to use GroupPrefetch instead.")


DYNAMIC_AT_ATTACH_LINE = ("This model's patcher is dynamic (ComfyUI DynamicVRAM streams it itself): GroupPrefetch "
                          "stands aside when it samples. A later node that gives ComfyUI a non-dynamic copy "
                          "(TorchCompileModel) makes it stream that copy.")


def legacy_under_dynamic_line(patcher) -> str:
    return (f"ComfyUI DynamicVRAM is active, but this model's patcher ({type(patcher).__name__}) is not dynamic "
            "(ComfyUI-GGUF's loader and TorchCompileModel give such patchers), so ComfyUI loads it through its "
            "legacy lowvram path: GroupPrefetch streams it.")


def attach_group_prefetch(model, config: PrefetchConfig, budget_bytes: int | None = None,
                          node_id: str | None = None, plan_budget: PlanBudget | None = None,
                          pin: PinMode | str = PinMode.AUTO, pin_source: str = ""):
    """Return (clone, report): a MODEL clone that streams its DiT blocks during sampling. ``node_id``:
    the node that shows each run's achieved numbers (ComfyUI's progress text), when there is one."""
    import comfy.patcher_extension as pe

    require_model(model)
    try:
        layout = find_blocks(model.model.diffusion_model)     # a clone shares the diffusion model
    except ValueError as e:
        # an architecture whose layers run in no streamable block structure (Stable Cascade's levels of mixed
        # blocks): the graph still runs, ComfyUI loads the model as usual
        return model, (f"GroupPrefetch stands aside: {e}. The model passes through unchanged and ComfyUI loads it "
                       "as usual (its own lowvram path when it does not fit); PhaseOffload and QuantizeDiT still "
                       "apply to it.")
    clone = model.clone()
    diffusion = clone.model.diffusion_model
    budget = plan_budget if plan_budget is not None else PlanBudget(budget_bytes, "node" if budget_bytes else "auto")
    pin = PinMode.parse(pin, "pin")
    state = PrefetchState(BridgeRequest(config, budget_bytes, budget, pin, pin_source), node_id)
    for kind in (pe.WrappersMP.OUTER_SAMPLE, pe.WrappersMP.APPLY_MODEL, pe.WrappersMP.DIFFUSION_MODEL):
        clone.remove_wrappers_with_key(kind, WRAPPER_KEY)   # DIFFUSION_MODEL: where clones of older builds attached
    clone.add_wrapper_with_key(pe.WrappersMP.OUTER_SAMPLE, WRAPPER_KEY, state.outer_sample)
    clone.add_wrapper_with_key(pe.WrappersMP.APPLY_MODEL, WRAPPER_KEY, state.apply_model)
    sizes = [module_bytes(m) for _, m in layout.blocks]
    lines = [f"GroupPrefetch installed: {len(sizes)} blocks of {type(diffusion).__name__} ({layout.architecture} "
             f"layout), {_gb(sum(sizes))} in blocks, "
             f"{_gb(module_bytes(diffusion) - sum(sizes))} outside them.",
             f"settings: blocks_per_group={config.blocks_per_group}, prefetch_depth={config.prefetch_depth}, "
             f"resident_groups={config.resident_groups}, VRAM budget="
             f"{'auto (ComfyUI free memory minus activations)' if budget_bytes is None else _gb(budget_bytes)}"
             + (", packed bf16 streaming" if config.packed else "")
             + f", pin {pin}" + (f" ({pin_source} pinning)" if pin_source else "") + ".",
             *([f"plan: {budget.line}."] if budget.line else []),
             *([f"packed bf16 unavailable on {clone.load_device}: {packing_supported(clone.load_device)[1]}; "
                "weights stream as stored."] if config.packed and not packing_supported(clone.load_device)[0] else []),
             "The resident prefix, groups and overlap are decided when sampling starts (they depend on free VRAM and "
             "the first step's measured compute); each run's achieved numbers appear on this node after it "
             "(and in the log line 'levers: GroupPrefetch ...').",
             *([DYNAMIC_AT_ATTACH_LINE] if patcher_is_dynamic(clone) else
               [legacy_under_dynamic_line(clone)] if dynamic_vram_active() else [])]
    return clone, "\n".join(lines)


def prefetch_state(model) -> PrefetchState | None:
    """The state a GroupPrefetch clone carries (for tests and reports)."""
    import comfy.patcher_extension as pe
    for w in model.get_wrappers(pe.WrappersMP.OUTER_SAMPLE, WRAPPER_KEY):
        owner = getattr(w, "__self__", None)
        if isinstance(owner, PrefetchState):
            return owner
    return None
