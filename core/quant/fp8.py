"""fp8 e4m3fn weights with fp32 scales (per tensor, per row or per block), clamped to ±448.

Tensors a quantized layer holds:
  weight        float8_e4m3fn (out, in)        codes = clamp(w / scale, ±448)
  weight_scale  float32 ()                     per_tensor  (ComfyUI's ``weight_scale`` layout)
                float32 (out, 1)               per_row
                float32 (out, in // block)     per_block
Dequantize: codes.to(dtype) * scale (broadcast per block).
"""
from __future__ import annotations

import math

import torch

from ..types import Precision
from .registry import Granularity, QuantizedWeight, Quantizer, register_quantizer

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(float8_e4m3fn).max; values above it would become NaN, so clamp first
_TINY = 1e-12    # floor for all-zero rows / blocks so the scale is never 0


def _amax(w: torch.Tensor, granularity: Granularity, block_size: int) -> torch.Tensor:
    a = w.abs().float()
    if granularity == Granularity.PER_TENSOR:
        return a.amax()                                                  # ()
    if granularity == Granularity.PER_ROW:
        return a.amax(dim=1, keepdim=True)                               # (out, 1)
    out, inp = w.shape
    return a.view(out, inp // block_size, block_size).amax(dim=2)        # (out, in // block)


def _expand(scale: torch.Tensor, granularity: Granularity, block_size: int) -> torch.Tensor:
    """Scale broadcastable against the (out, in) matrix."""
    if granularity == Granularity.PER_BLOCK:
        return scale.repeat_interleave(block_size, dim=1)                # (out, in)
    return scale


def quantize_fp8(w: torch.Tensor, granularity: Granularity = Granularity.PER_ROW,
                 block_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes float8_e4m3fn (out, in), fp32 scale) for a 2-D weight."""
    scale = (_amax(w, granularity, block_size) / FP8_MAX).clamp_min(_TINY)
    x = w.float() / _expand(scale, granularity, block_size)
    codes = x.clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return codes, scale


def dequantize_fp8(codes: torch.Tensor, scale: torch.Tensor, granularity: Granularity, block_size: int,
                   dtype: torch.dtype) -> torch.Tensor:
    # fp8 -> fp32 is exact; multiply in fp32 then round once to the compute dtype.
    return (codes.float() * _expand(scale.float(), granularity, block_size)).to(dtype)


@register_quantizer(Precision.FP8_E4M3FN)
class Fp8Quantizer(Quantizer):
    granularities = (Granularity.PER_TENSOR, Granularity.PER_ROW, Granularity.PER_BLOCK)
    default_granularity = Granularity.PER_ROW
    storage_dtype = FP8_DTYPE

    @classmethod
    def available(cls):
        if not hasattr(torch, "float8_e4m3fn"):
            return False, f"torch {torch.__version__} has no float8_e4m3fn (needs torch >= 2.1)"
        return True, "plain torch casts (fp8 matmul on CUDA sm >= 8.9)"

    @classmethod
    def quantize(cls, weight, granularity, block_size):
        cls.require()
        codes, scale = quantize_fp8(weight, granularity, block_size)
        return QuantizedWeight(Precision.FP8_E4M3FN, granularity, block_size, tuple(weight.shape),
                               {"weight": codes, "weight_scale": scale}, weight.dtype)

    @classmethod
    def dequantize(cls, qweight, dtype):
        t = qweight.tensors
        return dequantize_fp8(t["weight"], t["weight_scale"], qweight.granularity, qweight.block_size, dtype)

    @classmethod
    def nbytes_for(cls, shape, granularity, block_size):
        out, inp = shape
        n_scales = {Granularity.PER_TENSOR: 1, Granularity.PER_ROW: out,
                    Granularity.PER_BLOCK: out * math.ceil(inp / block_size)}[granularity]
        return out * inp + 4 * n_scales


def fp8_compute_available(device: torch.device) -> tuple[bool, str]:
    """Whether ``torch._scaled_mm`` can run fp8 x fp8 matmuls on ``device`` (CUDA sm >= 8.9)."""
    if device.type != "cuda":
        return False, "fp8 matmul is used only on CUDA"
    if not hasattr(torch, "_scaled_mm"):
        return False, "torch has no _scaled_mm"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return False, f"GPU compute capability {major}.{minor} < 8.9 has no fp8 tensor cores"
    return True, f"sm {major}.{minor}"


def scaled_mm_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, granularity: Granularity,
                     bias: torch.Tensor | None) -> torch.Tensor:
    """y = x @ (codes * scale).T + bias with fp8 tensor cores: x is quantized per token on the fly.

    Needs per_tensor or per_row scales, in/out features multiples of 16. x: (..., in) -> (..., out).
    """
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])                                        # (tokens, in)
    x_scale = (x2.abs().amax(dim=1, keepdim=True).float() / FP8_MAX).clamp_min(_TINY)  # (tokens, 1)
    x8 = (x2.float() / x_scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    w_scale = scale.float().reshape(1, -1) if granularity == Granularity.PER_ROW \
        else scale.float().reshape(1, 1).expand(1, codes.shape[0])      # (1, out)
    # rowwise scaling wants both scales rowwise: (tokens, 1) and (1, out).
    y = torch._scaled_mm(x8, codes.t(), scale_a=x_scale, scale_b=w_scale.contiguous(),
                         bias=None if bias is None else bias.to(x.dtype), out_dtype=x.dtype)
    return y.reshape(*shape[:-1], codes.shape[0])
