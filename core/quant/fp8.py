"""fp8 e4m3fn weights with fp32 scales (per tensor, per row or per block), clamped to ±448.

Tensors a quantized layer holds:
  weight        float8_e4m3fn (out, in)        codes = clamp(w / scale, ±448)
  weight_scale  float32 ()                     per_tensor  (ComfyUI's ``weight_scale`` layout)
                float32 (out, 1)               per_row
                float32 (out, in // block)     per_block
Dequantize: codes.to(dtype) * scale (broadcast per block).
"""
from __future__ import annotations

import functools
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


@functools.lru_cache(maxsize=None)
def fp8_compute_available(device: torch.device) -> tuple[bool, str]:
    """Whether ``torch._scaled_mm`` can run fp8 x fp8 matmuls on ``device`` (CUDA sm >= 8.9).

    Cached per device: every fp8 layer asks on every forward."""
    if device.type != "cuda":
        return False, "fp8 matmul is used only on CUDA"
    if not hasattr(torch, "_scaled_mm"):
        return False, "torch has no _scaled_mm"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return False, f"GPU compute capability {major}.{minor} < 8.9 has no fp8 tensor cores"
    return True, f"sm {major}.{minor}"


# How QuantLinear runs an fp8 layer on a GPU with fp8 tensor cores:
#   off         dequantize the weight to the compute dtype, bf16 matmul (also every other GPU)
#   tensorwise  one scale for the whole activation (one reduction kernel, no host sync), cuBLASLt
#               tensorwise fp8 GEMM; per-row weight scales are applied to the output columns
#   rowwise     one scale per token (one fused Triton kernel on CUDA: fp8_triton.py) and per output
#               row (torch's rowwise-scaled fp8 GEMM)
FP8_COMPUTE_MODES = ("off", "tensorwise", "rowwise")


def scaled_mm_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, granularity: Granularity,
                     bias: torch.Tensor | None, mode: str = "tensorwise") -> torch.Tensor:
    """y = x @ (codes * scale).T + bias with fp8 tensor cores; x is quantized on the fly.

    Needs per_tensor or per_row weight scales, in/out features multiples of 16, a bf16/fp16 x.
    The activation scale is rounded to x's dtype first, so dividing by it and undoing it in the
    GEMM use the same number. x: (..., in) -> (..., out).
    """
    shape = x.shape
    x2 = x.reshape(-1, shape[-1]).contiguous()   # (tokens, in) row-major: _scaled_mm rejects a column-major mat1
    out_features = codes.shape[0]
    if mode == "rowwise":
        from .fp8_triton import quantize_rows_fp8
        x8, x_scale = quantize_rows_fp8(x2)                               # one Triton kernel on CUDA
        w_scale = scale.float().reshape(1, -1) if granularity == Granularity.PER_ROW \
            else scale.float().reshape(1, 1).expand(1, out_features)   # (1, out)
        # rowwise scaling wants both scales rowwise: (tokens, 1) and (1, out).
        y = torch._scaled_mm(x8, codes.t(), scale_a=x_scale, scale_b=w_scale.contiguous(),
                             bias=None if bias is None else bias.to(x.dtype), out_dtype=x.dtype)
        return y.reshape(*shape[:-1], out_features)
    if mode != "tensorwise":
        raise ValueError(f"fp8 compute mode {mode!r}: expected one of {FP8_COMPUTE_MODES[1:]}")
    amax = torch.linalg.vector_norm(x2, ord=float("inf"), dtype=torch.float32)   # () one reduction kernel
    x_scale = (amax / FP8_MAX).clamp_min(_TINY).to(x2.dtype)            # ()
    x8 = (x2 / x_scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)          # (tokens, in)
    one = x_scale.new_ones((), dtype=torch.float32)
    if granularity == Granularity.PER_TENSOR:
        y = torch._scaled_mm(x8, codes.t(), scale_a=x_scale.float(), scale_b=scale.float().reshape(()),
                             bias=None if bias is None else bias.to(x.dtype), out_dtype=x.dtype)
    else:
        # per-row weight scales are per output column of y: one fused multiply-add after the GEMM
        y = torch._scaled_mm(x8, codes.t(), scale_a=x_scale.float(), scale_b=one, out_dtype=x.dtype)
        w_scale = scale.reshape(1, -1).to(x.dtype)                      # (1, out)
        y = torch.addcmul(bias.to(x.dtype), y, w_scale) if bias is not None else y.mul_(w_scale)
    return y.reshape(*shape[:-1], out_features)
