"""int8 weight-only, symmetric, with torchao's ``Int8WeightOnlyConfig`` math (per row, or per block).

Tensors a quantized layer holds:
  weight        int8 (out, in)                 codes in [-128, 127]
  weight_scale  float32 (out, 1)               per_row   (scale = amax / 127.5, as torchao)
                float32 (out, in // block)     per_block
Dequantize: codes.to(dtype) * scale. torchao does the quantization; the codes are stored as plain
tensors (safetensors cannot hold torchao's tensor subclasses, and offload rebinds plain tensors).
"""
from __future__ import annotations

import functools
import importlib.util
import math

import torch

from ..types import Precision
from .registry import Granularity, QuantizedWeight, Quantizer, register_quantizer


@functools.lru_cache(maxsize=1)
def _torchao_status() -> tuple[bool, str]:
    if importlib.util.find_spec("torchao") is None:
        return False, "torchao is not installed"
    try:
        from torchao.quantization.quant_primitives import MappingType, choose_qparams_affine  # noqa: F401
    except ImportError as exc:  # an incompatible torchao / torch pair
        return False, f"torchao is installed but its quant primitives do not import ({exc})"
    import torchao
    return True, f"torchao {getattr(torchao, '__version__', '?')}"


def _block_shape(shape: tuple[int, int], granularity: Granularity, block_size: int) -> tuple[int, int]:
    return (1, shape[1]) if granularity == Granularity.PER_ROW else (1, block_size)


def quantize_int8(w: torch.Tensor, granularity: Granularity = Granularity.PER_ROW,
                  block_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes int8 (out, in), scale fp32 (out, in // group)) using torchao's affine primitives."""
    from torchao.quantization.quant_primitives import MappingType, choose_qparams_affine, quantize_affine

    block = _block_shape(tuple(w.shape), granularity, block_size)
    wf = w.float()
    scale, zero = choose_qparams_affine(wf, MappingType.SYMMETRIC, block, torch.int8,
                                        eps=torch.finfo(torch.float32).eps, scale_dtype=torch.float32,
                                        zero_point_dtype=torch.int64)
    codes = quantize_affine(wf, block, scale, zero, torch.int8)             # (out, in) int8
    return codes, scale.reshape(w.shape[0], -1).float()                     # (out, groups)


def dequantize_int8(codes: torch.Tensor, scale: torch.Tensor, granularity: Granularity, block_size: int,
                    dtype: torch.dtype) -> torch.Tensor:
    s = scale.float()
    if granularity == Granularity.PER_BLOCK:
        s = s.repeat_interleave(block_size, dim=1)                           # (out, in)
    return (codes.float() * s).to(dtype)


@register_quantizer(Precision.INT8)
class Int8Quantizer(Quantizer):
    granularities = (Granularity.PER_ROW, Granularity.PER_BLOCK)
    default_granularity = Granularity.PER_ROW
    storage_dtype = torch.int8
    install_hint = "pip install torchao (or pick format fp8_e4m3fn)"

    @classmethod
    def available(cls):
        return _torchao_status()

    @classmethod
    def quantize(cls, weight, granularity, block_size):
        cls.require()
        codes, scale = quantize_int8(weight, granularity, block_size)
        return QuantizedWeight(Precision.INT8, granularity, block_size, tuple(weight.shape),
                               {"weight": codes, "weight_scale": scale}, weight.dtype)

    @classmethod
    def dequantize(cls, qweight, dtype):
        t = qweight.tensors
        return dequantize_int8(t["weight"], t["weight_scale"], qweight.granularity, qweight.block_size, dtype)

    @classmethod
    def nbytes_for(cls, shape, granularity, block_size):
        out, inp = shape
        groups = 1 if granularity == Granularity.PER_ROW else math.ceil(inp / block_size)
        return out * inp + 4 * out * groups
