"""One-kernel per-token fp8 quantization of activations (Triton), for the rowwise fp8 GEMM.

Eager torch needs five passes over the activation (abs-max, scale, divide, clamp, cast); on an
H200 that cost more than the fp8 GEMM saved on FLUX-shaped layers (bench/results). This kernel
reads each row once into registers, takes its abs-max, writes the fp32 scale and the clamped
fp8 codes: 2 bytes read and 1 written per element. Used only on CUDA when Triton imports;
``quantize_rows_fp8`` falls back to the same arithmetic in eager torch everywhere else.
"""
from __future__ import annotations

import functools
import logging

import torch

log = logging.getLogger("levers")
_BROKEN: list[str] = []   # why the kernel failed once (then the eager path is used for good)

FP8_MAX = 448.0
_TINY = 1e-12
_MAX_ROW = 32768   # widest row the one-pass kernel holds in registers (FLUX's widest input: 15360)


@functools.lru_cache(maxsize=1)
def _kernel():
    """The compiled kernel, or None when Triton is missing (imported lazily: CPU installs lack it)."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def rows_fp8(x_ptr, q_ptr, s_ptr, n_cols, stride_x, stride_q, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)      # row * stride passes 2**31 on long video batches
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), axis=0)
        # fp32 scale: the GEMM multiplies by this very value, so quantize and un-scale agree
        scale = tl.maximum(tl.math.div_rn(amax, 448.0), 1e-12)   # IEEE division, as torch does
        q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -448.0), 448.0)
        tl.store(q_ptr + row * stride_q + cols, q.to(tl.float8e4nv), mask=mask)
        tl.store(s_ptr + row, scale)

    return triton, rows_fp8


def triton_rows_available(x: torch.Tensor) -> bool:
    return x.is_cuda and x.dim() == 2 and x.shape[1] <= _MAX_ROW and not _BROKEN and _kernel() is not None


def quantize_rows_fp8(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes float8_e4m3fn (rows, cols), fp32 scale (rows, 1)) with codes = clamp(x / scale, ±448)
    and scale = max|x_row| / 448. x2: (rows, cols), bf16/fp16/fp32."""
    if triton_rows_available(x2):
        try:
            return _launch(x2)
        except Exception as exc:  # noqa: BLE001 - a kernel that fails to build must not break the forward
            _BROKEN.append(f"{type(exc).__name__}: {exc}")
            log.warning("levers: fp8 activation kernel unavailable (%s); using eager torch", _BROKEN[0][:300])
    amax = torch.linalg.vector_norm(x2, ord=float("inf"), dim=1, keepdim=True, dtype=torch.float32)
    s = (amax / FP8_MAX).clamp_min(_TINY)                                     # (rows, 1)
    q = (x2.float() / s).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, s


def _launch(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the kernel (any device Triton targets; the CPU under TRITON_INTERPRET=1 in tests)."""
    triton, rows_fp8 = _kernel()
    x2 = x2 if x2.stride(1) == 1 else x2.contiguous()
    rows, cols = x2.shape
    q = torch.empty((rows, cols), dtype=torch.float8_e4m3fn, device=x2.device)
    s = torch.empty((rows, 1), dtype=torch.float32, device=x2.device)
    block = triton.next_power_of_2(cols)
    warps = 4 if block <= 4096 else (8 if block <= 16384 else 16)
    rows_fp8[(rows,)](x2, q, s, cols, x2.stride(0), q.stride(0), BLOCK=block, num_warps=warps)
    return q, s
