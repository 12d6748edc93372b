"""nf4 through bitsandbytes (blocksize 64 by default, fp32 absmax, no nested statistics).

Tensors a quantized layer holds (the real bitsandbytes layout, as ``quantize_4bit`` returns it):
  weight        uint8 (out * in // 2, 1)       two 4-bit NF4 codes per byte, row-major
  weight_scale  float32 (out * in // block,)   bitsandbytes' ``absmax`` per block
Dequantize: ``bitsandbytes.functional.dequantize_4bit`` with a QuantState rebuilt from these
(4.5 bits per parameter at block 64). Checkpoints store the bitsandbytes keys
``weight.absmax`` / ``weight.quant_map`` / ``weight.quant_state.bitsandbytes__nf4``.
"""
from __future__ import annotations

import functools
import importlib.util
import math

import torch

from ..types import Precision
from .registry import Granularity, QuantizedWeight, Quantizer, register_quantizer

NF4_BLOCK_SIZES = (64, 128, 256, 512, 1024, 2048, 4096)


@functools.lru_cache(maxsize=1)
def _bnb_status() -> tuple[bool, str]:
    if importlib.util.find_spec("bitsandbytes") is None:
        return False, "bitsandbytes is not installed"
    try:
        import bitsandbytes
        import bitsandbytes.functional as bnbf
    except (ImportError, RuntimeError, OSError) as exc:  # bnb raises RuntimeError/OSError on a broken native lib
        return False, f"bitsandbytes does not import ({exc})"
    if not hasattr(bnbf, "quantize_4bit"):
        return False, f"bitsandbytes {getattr(bitsandbytes, '__version__', '?')} is too old (no quantize_4bit)"
    return True, f"bitsandbytes {getattr(bitsandbytes, '__version__', '?')}"


def _quant_state(absmax: torch.Tensor, shape: tuple[int, int], block_size: int, dtype: torch.dtype):
    import bitsandbytes.functional as bnbf

    code = bnbf.get_4bit_type("nf4", device=absmax.device)
    return bnbf.QuantState(absmax=absmax, shape=torch.Size(shape), code=code, blocksize=block_size,
                           quant_type="nf4", dtype=dtype)


def quantize_nf4(w: torch.Tensor, block_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed uint8 (numel // 2, 1), absmax fp32 (numel // block,)) via bitsandbytes."""
    import bitsandbytes.functional as bnbf

    packed, state = bnbf.quantize_4bit(w.contiguous(), blocksize=block_size, quant_type="nf4",
                                       compress_statistics=False)
    return packed, state.absmax.float()


def dequantize_nf4(packed: torch.Tensor, absmax: torch.Tensor, shape: tuple[int, int], block_size: int,
                   dtype: torch.dtype) -> torch.Tensor:
    import bitsandbytes.functional as bnbf

    # bitsandbytes dequantizes into the QuantState dtype; fp16/bf16/fp32 are supported.
    out = bnbf.dequantize_4bit(packed, _quant_state(absmax.float(), shape, block_size, dtype))
    return out.to(dtype)


def quant_state_dict(packed: torch.Tensor, absmax: torch.Tensor, shape: tuple[int, int], block_size: int,
                     dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """bitsandbytes' own serialisation (``QuantState.as_dict(packed=True)``) for checkpoints."""
    return _quant_state(absmax, shape, block_size, dtype).as_dict(packed=True)


def absmax_from_state_dict(qs: dict[str, torch.Tensor], device="cpu") -> tuple[torch.Tensor, tuple[int, int], int]:
    """(absmax, shape, block_size) from the tensors ``quant_state_dict`` wrote."""
    import bitsandbytes.functional as bnbf

    state = bnbf.QuantState.from_dict(qs, device=torch.device(device))
    if state.nested:  # written by another tool with compress_statistics=True: undo the nesting once
        absmax = bnbf.dequantize_blockwise(state.absmax, state.state2) + state.offset
    else:
        absmax = state.absmax
    return absmax.float(), tuple(state.shape), state.blocksize


@register_quantizer(Precision.NF4)
class Nf4Quantizer(Quantizer):
    block_sizes = NF4_BLOCK_SIZES
    granularities = (Granularity.PER_BLOCK,)
    default_granularity = Granularity.PER_BLOCK
    storage_dtype = torch.uint8
    install_hint = "pip install bitsandbytes (or pick format fp8_e4m3fn / int8)"

    @classmethod
    def available(cls):
        return _bnb_status()

    @classmethod
    def supports_shape(cls, shape, granularity, block_size):
        if len(shape) != 2:
            return False, "not a 2-D matrix"
        if block_size not in NF4_BLOCK_SIZES:
            return False, f"bitsandbytes block sizes are {NF4_BLOCK_SIZES}"
        if (shape[0] * shape[1]) % block_size:
            return False, f"{shape[0] * shape[1]} weights not a multiple of block_size {block_size}"
        return True, ""

    @classmethod
    def quantize(cls, weight, granularity, block_size):
        cls.require()
        packed, absmax = quantize_nf4(weight, block_size)
        return QuantizedWeight(Precision.NF4, granularity, block_size, tuple(weight.shape),
                               {"weight": packed, "weight_scale": absmax}, weight.dtype)

    @classmethod
    def dequantize(cls, qweight, dtype):
        t = qweight.tensors
        return dequantize_nf4(t["weight"], t["weight_scale"], qweight.shape, qweight.block_size, dtype)

    @classmethod
    def nbytes_for(cls, shape, granularity, block_size):
        n = shape[0] * shape[1]
        return (n + 1) // 2 + 4 * math.ceil(n / block_size)
