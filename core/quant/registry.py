"""The quantizer registry, the frozen QuantConfig and the QuantizedWeight container.

Formats register themselves with ``@register_quantizer(Precision.X)``; callers look them up with
``get_quantizer(fmt)`` instead of an if-chain. A quantizer turns one 2-D weight into plain tensors
(codes + scales) and back; the layer in ``linear.py`` holds those tensors and does the math.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, ClassVar

import torch

from ..errors import BackendUnavailable, ConfigError
from ..types import Precision, _StrEnum


class Granularity(_StrEnum):
    """How many weights share one scale."""

    PER_TENSOR = "per_tensor"   # one scale per matrix (ComfyUI's own fp8 checkpoint layout)
    PER_ROW = "per_row"         # one scale per output channel
    PER_BLOCK = "per_block"     # one scale per `block_size` consecutive weights of a row


Granularity._aliases = {"tensor": "per_tensor", "row": "per_row", "channel": "per_row",
                        "per_channel": "per_row", "block": "per_block", "group": "per_block"}


@dataclass(frozen=True)
class QuantConfig:
    """What to quantize and how. ``granularity=None`` means the format's default."""

    format: Precision
    granularity: Granularity | None = None
    block_size: int = 64
    keep_first_blocks: int = 0
    keep_last_blocks: int = 0
    extra_skip: tuple[str, ...] = ()
    quantize_modulation: bool = False   # also the adaLN/modulation linears inside the blocks (kept 16-bit by default)

    def __post_init__(self):
        fmt = Precision.parse(self.format, "format")
        if not fmt.is_quantized:
            raise ConfigError("format", self.format, "one of fp8_e4m3fn, int8, nf4",
                              "bf16/fp16/fp32 are casts, not quantization; use the loader's weight_dtype.")
        object.__setattr__(self, "format", fmt)
        quantizer = get_quantizer(fmt)
        gran = quantizer.default_granularity if self.granularity in (None, "", "auto") \
            else Granularity.parse(self.granularity, "granularity")
        if gran not in quantizer.granularities:
            allowed = ", ".join(g.value for g in quantizer.granularities)
            raise ConfigError("granularity", str(gran), f"for {fmt}: {allowed}")
        object.__setattr__(self, "granularity", gran)
        if not isinstance(self.block_size, int) or self.block_size < 16 or self.block_size & (self.block_size - 1):
            raise ConfigError("block_size", self.block_size, "a power of two >= 16 (64 is the usual choice)")
        if gran == Granularity.PER_BLOCK and quantizer.block_sizes and self.block_size not in quantizer.block_sizes:
            raise ConfigError("block_size", self.block_size,
                              f"for {fmt}: one of {', '.join(map(str, quantizer.block_sizes))}",
                              "64 is the usual choice (its backend supports no other sizes).")
        for name in ("keep_first_blocks", "keep_last_blocks"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ConfigError(name, value, "an integer >= 0")
        skips = self.extra_skip
        if isinstance(skips, str):
            skips = tuple(s for s in (p.strip() for p in skips.split(",")) if s)
        object.__setattr__(self, "extra_skip", tuple(str(s) for s in skips))
        if not isinstance(self.quantize_modulation, bool):
            raise ConfigError("quantize_modulation", self.quantize_modulation, "true or false")

    def to_dict(self) -> dict:
        return {"format": str(self.format), "granularity": str(self.granularity), "block_size": self.block_size,
                "keep_first_blocks": self.keep_first_blocks, "keep_last_blocks": self.keep_last_blocks,
                "extra_skip": list(self.extra_skip), "quantize_modulation": self.quantize_modulation}


@dataclass
class QuantizedWeight:
    """One quantized matrix as plain tensors.

    ``tensors`` always has ``weight`` (the codes) and ``weight_scale`` (fp32 scales); the shapes per
    format are documented on each quantizer. ``shape`` is the logical (out_features, in_features).
    """

    format: Precision
    granularity: Granularity
    block_size: int
    shape: tuple[int, int]
    tensors: dict[str, torch.Tensor]
    orig_dtype: torch.dtype = torch.bfloat16

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return get_quantizer(self.format).dequantize(self, dtype or self.orig_dtype)

    def to(self, device) -> "QuantizedWeight":
        return QuantizedWeight(self.format, self.granularity, self.block_size, self.shape,
                               {k: v.to(device) for k, v in self.tensors.items()}, self.orig_dtype)


class Quantizer:
    """Base class of a format. Subclasses set the class attributes and implement the classmethods."""

    format: ClassVar[Precision]
    granularities: ClassVar[tuple[Granularity, ...]]
    default_granularity: ClassVar[Granularity]
    storage_dtype: ClassVar[torch.dtype]
    install_hint: ClassVar[str] = ""
    block_sizes: ClassVar[tuple[int, ...] | None] = None   # per_block sizes the backend takes (None: any power of 2)

    @classmethod
    def available(cls) -> tuple[bool, str]:
        """(ok, reason): whether this format can quantize here."""
        return True, "built in (plain torch)"

    @classmethod
    def require(cls) -> None:
        ok, reason = cls.available()
        if not ok:
            raise BackendUnavailable(str(cls.format), reason, cls.install_hint)

    @classmethod
    def quantize(cls, weight: torch.Tensor, granularity: Granularity, block_size: int) -> QuantizedWeight:
        raise NotImplementedError

    @classmethod
    def dequantize(cls, qweight: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    @classmethod
    def nbytes_for(cls, shape: tuple[int, int], granularity: Granularity, block_size: int) -> int:
        """Exact bytes of the quantized tensors for a matrix of ``shape`` (no allocation)."""
        raise NotImplementedError

    @classmethod
    def supports_shape(cls, shape: tuple[int, ...], granularity: Granularity, block_size: int) -> tuple[bool, str]:
        if len(shape) != 2:
            return False, "not a 2-D matrix"
        if granularity == Granularity.PER_BLOCK and shape[1] % block_size:
            return False, f"in_features {shape[1]} not a multiple of block_size {block_size}"
        return True, ""


_REGISTRY: dict[Precision, type[Quantizer]] = {}


def register_quantizer(fmt: Precision) -> Callable[[type[Quantizer]], type[Quantizer]]:
    """Class decorator: make ``cls`` the quantizer for ``fmt``."""
    fmt = Precision.parse(fmt, "format")

    def deco(cls: type[Quantizer]) -> type[Quantizer]:
        if fmt in _REGISTRY and _REGISTRY[fmt] is not cls:
            raise ValueError(f"a quantizer for {fmt} is already registered ({_REGISTRY[fmt].__name__})")
        cls.format = fmt
        _REGISTRY[fmt] = cls
        return cls

    return deco


def get_quantizer(fmt: Precision | str) -> type[Quantizer]:
    fmt = Precision.parse(fmt, "format")
    _load_builtin_formats()
    try:
        return _REGISTRY[fmt]
    except KeyError:
        allowed = ", ".join(str(f) for f in _REGISTRY)
        raise ConfigError("format", str(fmt), allowed) from None


def registered_formats() -> tuple[Precision, ...]:
    _load_builtin_formats()
    return tuple(_REGISTRY)


def backend_status() -> dict[str, tuple[bool, str]]:
    """{format: (ok, reason)} for every registered format, for reports and Recommend."""
    return {str(f): get_quantizer(f).available() for f in registered_formats()}


def _load_builtin_formats() -> None:
    if len(_REGISTRY) >= 3:
        return
    from . import fp8, int8, nf4  # noqa: F401  (import registers them)


def weight_bytes_for(shapes, fmt: Precision | str, granularity: Granularity | str | None = None,
                     block_size: int = 64) -> int:
    """Bytes of quantized weights for ``shapes`` (iterable of (out, in) shapes, or ints = 2-D numel
    treated as one row-less blob). Recommend uses this for real fp8/int8/nf4 sizes.

    nf4 (block 64, fp32 absmax) is 4.5 bits/param; fp8 per-tensor is 1 B/param + 4 B; int8 per-row
    is 1 B/param + 4 B per row.
    """
    fmt = Precision.parse(fmt, "format")
    if not fmt.is_quantized:
        per = {Precision.FP32: 4, Precision.BF16: 2, Precision.FP16: 2}[fmt]
        return sum((s if isinstance(s, int) else math.prod(s)) * per for s in shapes)
    q = get_quantizer(fmt)
    gran = q.default_granularity if granularity in (None, "", "auto") else Granularity.parse(granularity)
    total = 0
    for s in shapes:
        if isinstance(s, int):
            s = (1, s) if gran != Granularity.PER_ROW else (1, s)
        total += q.nbytes_for(tuple(s), gran, block_size)
    return total


@dataclass
class LayerReport:
    name: str
    shape: tuple[int, ...]
    bytes_before: int
    bytes_after: int
    sqnr_db: float | None = None


@dataclass
class QuantReport:
    """What a quantization pass did: per-layer sizes and SQNR, plus the census it followed."""

    config: QuantConfig
    arch: str
    layers: list[LayerReport] = field(default_factory=list)
    kept_bytes: int = 0
    kept_count: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def quantized_bytes_before(self) -> int:
        return sum(l.bytes_before for l in self.layers)

    @property
    def quantized_bytes_after(self) -> int:
        return sum(l.bytes_after for l in self.layers)

    @property
    def size_before(self) -> int:
        return self.kept_bytes + self.quantized_bytes_before

    @property
    def size_after(self) -> int:
        return self.kept_bytes + self.quantized_bytes_after

    def sqnr_summary(self) -> dict[str, float]:
        vals = sorted(l.sqnr_db for l in self.layers if l.sqnr_db is not None)
        if not vals:
            return {}
        return {"min": vals[0], "median": vals[len(vals) // 2], "mean": sum(vals) / len(vals), "max": vals[-1]}

    def worst_layers(self, n: int = 3) -> list[LayerReport]:
        return sorted((l for l in self.layers if l.sqnr_db is not None), key=lambda l: l.sqnr_db)[:n]

    def format_text(self) -> str:
        mib = 1024 ** 2
        lines = [f"QuantizeDiT: {self.config.format} {self.config.granularity}"
                 + (f" (block {self.config.block_size})" if self.config.granularity == Granularity.PER_BLOCK else "")
                 + f", architecture {self.arch}",
                 f"  quantized: {len(self.layers)} layers, {self.quantized_bytes_before / mib:.1f} MiB -> "
                 f"{self.quantized_bytes_after / mib:.1f} MiB",
                 f"  kept:      {self.kept_count} tensors, {self.kept_bytes / mib:.1f} MiB",
                 f"  size:      {self.size_before / mib:.1f} MiB -> {self.size_after / mib:.1f} MiB "
                 f"({(self.size_after / self.size_before if self.size_before else 1.0):.0%})"]
        s = self.sqnr_summary()
        if s:
            lines.append(f"  weight SQNR dB: min {s['min']:.1f}  median {s['median']:.1f}  max {s['max']:.1f}")
            worst = ", ".join(f"{l.name} {l.sqnr_db:.1f}" for l in self.worst_layers())
            lines.append(f"  lowest: {worst}")
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)
