"""The quantized linear layer and the public entry points that put it into a model.

``QuantLinear`` holds plain tensors (documented per format in fp8.py / int8.py / nf4.py):
``weight`` (codes, Parameter, requires_grad=False), ``weight_scale`` (fp32 Parameter) and ``bias``
(compute dtype, unchanged). Offload code may move them by rebinding ``.data``; the layer
dequantizes on the input's device in the input's dtype at every call.
"""
from __future__ import annotations

import copy
import logging
import os
from typing import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ..types import Precision
from .registry import (Granularity, LayerReport, QuantConfig, QuantizedWeight, QuantReport, get_quantizer)
from .metrics import sqnr
from .fp8 import FP8_COMPUTE_MODES

# fp8 tensor-core mode used when a layer says "auto" (fp8.FP8_COMPUTE_MODES). rowwise was the fastest
# on an H200 (bench/results/2026-11-30-h200-d): whole FLUX-shaped step 1.05x bf16, Wan-shaped 1.16x;
# the dequantize path ("off") ran 0.71x / 0.89x.
DEFAULT_FP8_COMPUTE = "rowwise"


# fp8 GEMM modes that raised on a device (torch builds without the rowwise kernel for a GPU, e.g. sm_89 / sm_120
# in some releases): (mode, device) -> the error. A failed mode is not tried again on that device; the layer falls
# back to the next mode, then to dequantizing, instead of failing the forward.
_FP8_MODE_FAILED: dict[tuple[str, str], str] = {}
_FALLBACK = {"rowwise": ("rowwise", "tensorwise"), "tensorwise": ("tensorwise",), "off": ()}


def _fp8_modes_to_try(mode: str, device: torch.device) -> list[str]:
    return [m for m in _FALLBACK.get(mode, ()) if (m, str(device)) not in _FP8_MODE_FAILED]


def _fp8_mode_failed(mode: str, device: torch.device, error: BaseException) -> None:
    _FP8_MODE_FAILED[(mode, str(device))] = f"{type(error).__name__}: {error}"
    nxt = _fp8_modes_to_try(mode, device)
    logging.getLogger("levers").warning(
        "levers: fp8 %s GEMM failed on %s (%s); using %s from now on", mode, device, str(error)[:200],
        nxt[0] if nxt else "the dequantized bf16 matmul")


def fp8_mode_failures() -> dict[str, str]:
    """Which fp8 GEMM modes failed on which device this process, for reports ("mode@device": error)."""
    return {f"{m}@{d}": e for (m, d), e in _FP8_MODE_FAILED.items()}


class QuantLinear(nn.Module):
    """y = x @ dequant(weight, weight_scale).T + bias; optional fp8 tensor cores on CUDA sm >= 8.9."""

    levers_quantized = True  # marker: ``is_quantized_module`` and "already quantized" checks read it

    def __init__(self, qweight: QuantizedWeight, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.quant_format: Precision = qweight.format
        self.granularity: Granularity = qweight.granularity
        self.block_size: int = qweight.block_size
        self.orig_dtype: torch.dtype = qweight.orig_dtype
        self.weight = nn.Parameter(qweight.tensors["weight"], requires_grad=False)
        self.weight_scale = nn.Parameter(qweight.tensors["weight_scale"], requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        # fp8 tensor-core matmul mode on CUDA sm >= 8.9 (fp8.FP8_COMPUTE_MODES); "auto" follows
        # DEFAULT_FP8_COMPUTE or the LEVERS_FP8_COMPUTE environment variable.
        self.fp8_compute = "auto"

    @property
    def use_fp8_compute(self) -> bool:
        return self._fp8_mode() != "off"

    @use_fp8_compute.setter
    def use_fp8_compute(self, on: bool) -> None:
        self.fp8_compute = "tensorwise" if on else "off"

    def _fp8_mode(self) -> str:
        mode = self.fp8_compute
        if mode == "auto":
            mode = os.environ.get("LEVERS_FP8_COMPUTE", DEFAULT_FP8_COMPUTE).strip().lower()
        return mode if mode in FP8_COMPUTE_MODES else "off"

    @classmethod
    def from_linear(cls, linear: nn.Module, config: QuantConfig) -> "QuantLinear":
        q = get_quantizer(config.format)
        qweight = q.quantize(linear.weight.detach(), config.granularity, config.block_size)
        return cls(qweight, linear.bias)

    def quantized_weight(self) -> QuantizedWeight:
        return QuantizedWeight(self.quant_format, self.granularity, self.block_size,
                               (self.out_features, self.in_features),
                               {"weight": self.weight.data, "weight_scale": self.weight_scale.data}, self.orig_dtype)

    def dequantize(self, dtype: torch.dtype | None = None, device=None) -> torch.Tensor:
        """The (out, in) weight in ``dtype`` on ``device`` (moves the small codes, not bf16 bytes)."""
        qw = self.quantized_weight()
        if device is not None and torch.device(device) != qw.tensors["weight"].device:
            qw = qw.to(device)
        return qw.dequantize(dtype or self.orig_dtype)

    def _fp8_fast_path(self, x: torch.Tensor) -> bool:
        if self.quant_format != Precision.FP8_E4M3FN or x.device.type != "cuda" or not self.use_fp8_compute:
            return False
        if self.granularity not in (Granularity.PER_TENSOR, Granularity.PER_ROW) or x.dtype != torch.bfloat16:
            return False
        if self.in_features % 16 or self.out_features % 16 or self.weight.device != x.device:
            return False
        from .fp8 import fp8_compute_available
        return fp8_compute_available(x.device)[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._fp8_fast_path(x):
            from .fp8 import scaled_mm_linear
            for mode in _fp8_modes_to_try(self._fp8_mode(), x.device):
                try:
                    return scaled_mm_linear(x, self.weight, self.weight_scale, self.granularity, self.bias, mode)
                except RuntimeError as e:
                    if isinstance(e, torch.OutOfMemoryError):
                        raise
                    _fp8_mode_failed(mode, x.device, e)
        w = self.dequantize(x.dtype, x.device)                                # (out, in)
        b = None if self.bias is None else self.bias.to(device=x.device, dtype=x.dtype)
        return F.linear(x, w, b)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"format={self.quant_format}, granularity={self.granularity}, bias={self.bias is not None}")


CODE_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.int8, torch.uint8)   # dtypes of quantized codes


def is_quantized_module(module: nn.Module) -> bool:
    """True when any sub-module already holds quantized weights (ours, or a low-bit dtype)."""
    for m in module.modules():
        if getattr(m, "levers_quantized", False):
            return True
        w = getattr(m, "weight", None)
        if isinstance(w, torch.Tensor) and type(w) not in (torch.Tensor, nn.Parameter):
            return True  # a tensor subclass: ComfyUI QuantizedTensor, GGUF, torchao, bitsandbytes
        if isinstance(w, torch.Tensor) and w.dtype in CODE_DTYPES:
            return True
    return False


def clone_module_tree(module: nn.Module, copy_params: bool = False) -> nn.Module:
    """New module objects with new Parameter objects that share the original storage.

    Moving the copy (``.to()`` rebinds ``param.data``) or replacing its children never touches the
    original. ``copy_params=True`` also copies the storage (needed if someone patches in place).
    """
    new = copy.copy(module)  # shallow: the dicts below are still the original's
    new._parameters = {}
    for k, p in module._parameters.items():
        if p is None or type(p) is not nn.Parameter:
            new._parameters[k] = p  # None or a tensor subclass we cannot re-wrap safely
        else:
            data = p.data.clone() if copy_params else p.data
            new._parameters[k] = nn.Parameter(data, requires_grad=p.requires_grad)
    new._buffers = {k: (b.clone() if copy_params and b is not None else b) for k, b in module._buffers.items()}
    new._modules = {k: (None if m is None else clone_module_tree(m, copy_params)) for k, m in module._modules.items()}
    for hooks in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_state_dict_hooks",
                  "_load_state_dict_pre_hooks", "_non_persistent_buffers_set"):
        if hasattr(module, hooks):
            setattr(new, hooks, copy.copy(getattr(module, hooks)))
    return new


def _linear_weight(module: nn.Module) -> torch.Tensor | None:
    w = getattr(module, "weight", None)
    if isinstance(module, nn.Linear) and isinstance(w, torch.Tensor) and w.dim() == 2:
        return w
    return None


LayerFactory = Callable[[nn.Module, QuantizedWeight], nn.Module]


def quantize_module(module: nn.Module, config: QuantConfig, filter_fn: Callable[[str, nn.Module], bool] | None = None,
                    arch: str | None = None, make_layer: LayerFactory | None = None, measure: bool = True,
                    progress: Callable[[int, int], None] | None = None) -> QuantReport:
    """Replace, IN PLACE, the Linear layers of ``module`` that the census allows with quantized ones.

    ``filter_fn(name, linear)`` narrows the census further. ``make_layer(linear, qweight)`` builds the
    replacement (default ``QuantLinear``; the ComfyUI bridge passes its own). ``progress(done, total)``
    is called after each layer and may raise to interrupt. Use ``quantize_model`` to keep the input intact.
    """
    from .census import census as run_census

    quantizer = get_quantizer(config.format)
    quantizer.require()
    plan = run_census(module, arch=arch, config=config)
    targets = []
    for name, sub in module.named_modules():
        if _linear_weight(sub) is None or not plan.should_quantize(f"{name}.weight"):
            continue
        if filter_fn is not None and not filter_fn(name, sub):
            continue
        targets.append((name, sub))
    report = QuantReport(config=config, arch=plan.arch)
    make = make_layer or (lambda lin, qw: QuantLinear(qw, lin.bias))
    target_prefixes = {n for n, _ in targets}
    for i, (name, lin) in enumerate(targets):
        w = lin.weight.detach()                                            # (out, in)
        qw = quantizer.quantize(w, config.granularity, config.block_size)
        score = sqnr(w, quantizer.dequantize(qw, torch.float32)) if measure else None
        new = make(lin, qw)
        _set_submodule(module, name, new)
        report.layers.append(LayerReport(name, tuple(w.shape), w.numel() * w.element_size(), qw.nbytes, score))
        if progress is not None:
            progress(i + 1, len(targets))
    for key, t in module.state_dict().items():
        if key.rpartition(".")[0] not in target_prefixes:
            report.kept_bytes += t.numel() * t.element_size()
            report.kept_count += 1
    for name, lin in targets:  # bias stays in the compute dtype: count it as kept
        if getattr(lin, "bias", None) is not None:
            report.kept_bytes += lin.bias.numel() * lin.bias.element_size()
            report.kept_count += 1
    report.notes.extend(plan.notes)
    return report


def quantize_model(module: nn.Module, config: QuantConfig, **kwargs) -> tuple[nn.Module, QuantReport]:
    """Quantize a COPY of ``module``: returns (new_module, report); ``module`` is left untouched.

    Only module objects are copied; untouched parameters share storage with the original.
    """
    new = clone_module_tree(module)
    report = quantize_module(new, config, **kwargs)
    return new, report


def quantized_nbytes(module: nn.Module) -> int:
    """Bytes of every parameter and buffer as stored (codes + scales for quantized layers)."""
    return sum(t.numel() * t.element_size() for t in module.state_dict().values())


def _set_submodule(root: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, child, new)


def iter_quant_layers(module: nn.Module) -> Iterable[tuple[str, QuantLinear]]:
    for name, m in module.named_modules():
        if isinstance(m, QuantLinear):
            yield name, m
