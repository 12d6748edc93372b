"""Weight quantization of diffusion transformers: fp8_e4m3fn, int8 (torchao), nf4 (bitsandbytes).

Public API (no ComfyUI import; importing this does not initialise CUDA):
  QuantConfig, Granularity                    frozen config + granularity enum
  quantize_model(module, config) -> (copy, QuantReport)   the input module is left untouched
  quantize_module(module, config) -> QuantReport          replaces layers IN PLACE
  census(source, arch=None, config=None) -> Census        which tensors get quantized, and why
  detect_arch(keys) -> str
  weight_bytes_for(shapes, fmt, granularity=None, block_size=64) -> int
  quantized_nbytes(module) -> int
  QuantLinear                                  the layer: ``weight`` codes + ``weight_scale`` + ``bias``
  register_quantizer(fmt), get_quantizer(fmt), backend_status()
  sqnr(ref, x), psnr(ref, x, data_range=None)
"""
from .registry import (Granularity, LayerReport, QuantConfig, QuantizedWeight, Quantizer, QuantReport,
                       backend_status, get_quantizer, register_quantizer, registered_formats, weight_bytes_for)
from .census import ARCH_NAMES, Census, CensusEntry, census, detect_arch
from .linear import (QuantLinear, clone_module_tree, is_quantized_module, iter_quant_layers, quantize_model,
                     quantize_module, quantized_nbytes)
from .metrics import psnr, sqnr

__all__ = [
    "ARCH_NAMES", "Census", "CensusEntry", "Granularity", "LayerReport", "QuantConfig", "QuantLinear",
    "QuantReport", "QuantizedWeight", "Quantizer", "backend_status", "census", "clone_module_tree",
    "detect_arch", "get_quantizer", "is_quantized_module", "iter_quant_layers", "psnr", "quantize_model",
    "quantize_module", "quantized_nbytes", "register_quantizer", "registered_formats", "sqnr",
    "weight_bytes_for",
]
