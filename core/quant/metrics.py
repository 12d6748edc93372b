"""Signal-to-quantization-noise and peak signal-to-noise ratios, in dB (higher is better)."""
from __future__ import annotations

import math

import torch


def sqnr(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """10 log10(|ref|^2 / |ref - approx|^2); +inf when identical."""
    ref = reference.detach().float()
    err = (ref - approx.detach().float()).pow(2).sum().item()
    sig = ref.pow(2).sum().item()
    if err == 0.0:
        return math.inf
    if sig == 0.0:
        return -math.inf
    return 10.0 * math.log10(sig / err)


def psnr(reference: torch.Tensor, approx: torch.Tensor, data_range: float | None = None) -> float:
    """10 log10(range^2 / MSE). ``data_range`` defaults to the reference's max - min."""
    ref = reference.detach().float()
    mse = (ref - approx.detach().float()).pow(2).mean().item()
    if mse == 0.0:
        return math.inf
    rng = data_range if data_range is not None else (ref.max() - ref.min()).item()
    return 10.0 * math.log10(rng * rng / mse) if rng > 0 else -math.inf
