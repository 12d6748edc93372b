"""Choices shared by the CLI, the nodes and the JSON plan (``str`` Enums)."""
from __future__ import annotations

from enum import Enum


class _StrEnum(str, Enum):
    def __str__(self) -> str:  # so f-strings and JSON read "bf16", not "Precision.BF16"
        return self.value

    @classmethod
    def parse(cls, value: "str | _StrEnum", field: str = "value"):
        """Normalise user input into the Enum, with an error that lists the choices."""
        if isinstance(value, cls):
            return value
        text = str(value).strip().lower().replace("-", "_") if value is not None else ""
        for member in cls:
            if text in (member.value.lower().replace("-", "_"), member.name.lower()):
                return member
        aliases = getattr(cls, "_aliases", {})
        if text in aliases:
            return cls(aliases[text])
        choices = ", ".join(m.value for m in cls)
        raise ValueError(f"{field}: unknown {cls.__name__.lower()} {value!r}; choose one of: {choices}")


class Precision(_StrEnum):
    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"
    FP8_E4M3FN = "fp8_e4m3fn"
    INT8 = "int8"
    NF4 = "nf4"

    @property
    def is_quantized(self) -> bool:
        return self in (Precision.FP8_E4M3FN, Precision.INT8, Precision.NF4)

    @property
    def is_lossless_cast(self) -> bool:
        return not self.is_quantized


Precision._aliases = {"fp8": "fp8_e4m3fn", "float8": "fp8_e4m3fn", "e4m3": "fp8_e4m3fn",
                      "float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16",
                      "4bit": "nf4"}


class Residency(_StrEnum):
    RESIDENT = "resident"   # on the GPU for the whole generation
    PHASE = "phase"         # on the GPU only during its own phase (encode / sample / decode)
    STREAMED = "streamed"   # lives in host RAM, streamed block-group by group every step
    CPU = "cpu"             # computed on the CPU


class Goal(_StrEnum):
    FIT = "fit"             # smallest footprint that runs
    BALANCED = "balanced"   # lossless first, then fp8, then streaming
    QUALITY = "quality"     # never lossy below fp8 unless nothing else fits
    SPEED = "speed"         # fp8 compute where it helps, no streaming if avoidable


class Component(_StrEnum):
    DIFFUSION_MODEL = "diffusion_model"
    TEXT_ENCODER = "text_encoder"
    VAE = "vae"
