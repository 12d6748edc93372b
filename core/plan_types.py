"""The frozen, JSON-serialisable Plan that Recommend returns and the other nodes accept."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from .types import Component, Goal, Precision, Residency


@dataclass(frozen=True)
class Streaming:
    """How a streamed DiT is cut into block groups (GroupPrefetch): the first ``resident_groups`` groups in execution
    order stay on the GPU, the others stream through ``prefetch_depth + 1`` slots of ``slot_bytes`` each.

    Blocks may differ in size (FLUX in bf16: 19 double blocks of 680 MB, then 38 single blocks of 283 MB), so
    ``block_bytes`` is the mean of the streamed blocks (streamed bytes per pass / streamed blocks): the copy time per
    block and whether it hides are for that mean, which is the whole step's balance. A slot holds the widest
    streamed group, not the mean."""

    n_blocks: int
    blocks_per_group: int
    prefetch_depth: int
    resident_groups: int
    streamed_bytes_per_step: int
    block_bytes: int                # mean bytes of a streamed block
    transfer_seconds_per_block: float
    compute_seconds_per_block: float
    hides_transfer: bool
    slot_bytes: int = 0             # one slot: the widest streamed group (0 in plans written before 2026-12-01)

    @property
    def n_groups(self) -> int:
        return -(-self.n_blocks // self.blocks_per_group)


@dataclass(frozen=True)
class Tiling:
    """VAE decode tiling (TiledVAEDecode). Sizes are in output pixels / frames, like VAEDecodeTiled."""

    tile_px: int
    overlap_px: int
    temporal_frames: int | None = None
    temporal_overlap: int = 0
    peak_bytes: int = 0


@dataclass(frozen=True)
class ComponentPlan:
    name: Component
    precision: Precision
    device: str                 # "cuda:0", "cuda:1", "cpu"
    residency: Residency
    pin: bool
    weight_bytes: int           # bytes of the weights at `precision`
    resident_bytes: int         # bytes held on `device` while its phase runs (streamed: the resident part)
    streaming: Streaming | None = None
    tiling: Tiling | None = None
    notes: tuple[str, ...] = ()
    quantize_modulation: bool = False   # census option: adaLN/modulation linears quantized too (needed to fit)


@dataclass(frozen=True)
class Plan:
    model: str
    goal: Goal
    budget_bytes: int           # usable VRAM (after the context / fragmentation reserve and what is withheld)
    vram_bytes: int             # card total (0 when planning for the CPU)
    components: tuple[ComponentPlan, ...]
    activation_bytes: int
    vae_decode_peak_bytes: int
    overhead_bytes: int
    predicted_peak_bytes: int
    predicted_extra_seconds: float
    fits: bool
    notes: tuple[str, ...] = ()
    workload: dict = field(default_factory=dict)
    machine: dict = field(default_factory=dict)
    host_bytes: int = 0         # host RAM the plan's host copies take (every expert's DiT, offloaded TE and VAE)
    experts: int = 1            # diffusion models sampled one after the other (Wan 2.2 A14B: 2)
    withheld_bytes: int = 0     # VRAM left alone beyond the overhead: other programs' use, ComfyUI's --reserve-vram

    def component(self, name: str | Component) -> ComponentPlan:
        name = Component.parse(name, "component")
        for c in self.components:
            if c.name == name:
                return c
        raise KeyError(name)

    @property
    def diffusion_model(self) -> ComponentPlan:
        return self.component(Component.DIFFUSION_MODEL)

    @property
    def text_encoder(self) -> ComponentPlan:
        return self.component(Component.TEXT_ENCODER)

    @property
    def vae(self) -> ComponentPlan:
        return self.component(Component.VAE)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["components"] = {str(c.name): _enum_to_str(asdict(c)) for c in self.components}
        return _enum_to_str(d)

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=False)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Plan":
        comps = []
        for name, c in d["components"].items():
            c = dict(c)
            c["name"] = Component.parse(name)
            c["precision"] = Precision.parse(c["precision"])
            c["residency"] = Residency.parse(c["residency"])
            c["streaming"] = Streaming(**c["streaming"]) if c.get("streaming") else None
            c["tiling"] = Tiling(**c["tiling"]) if c.get("tiling") else None
            c["notes"] = tuple(c.get("notes", ()))
            comps.append(ComponentPlan(**c))
        known = {f.name for f in fields(cls)}
        rest = {k: v for k, v in d.items() if k in known and k != "components"}
        rest["goal"] = Goal.parse(rest["goal"])
        rest["notes"] = tuple(rest.get("notes", ()))
        return cls(components=tuple(comps), **rest)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        return cls.from_dict(json.loads(text))


def _enum_to_str(obj):
    if isinstance(obj, dict):
        return {str(k): _enum_to_str(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_enum_to_str(v) for v in obj]
    if isinstance(obj, (Precision, Residency, Goal, Component)):
        return obj.value
    return obj
