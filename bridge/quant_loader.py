"""Load Quantized DiT: build a ComfyUI model from a quantized .safetensors without a bf16 detour.

Plain files and ComfyUI-native fp8 per-tensor files go through ComfyUI's own
``comfy.sd.load_diffusion_model`` (what the stock UNETLoader does). Files in the Levers layout
(int8, nf4, fp8 per_row / per_block; see core/quant/checkpoint.py) are loaded here:
1. the header is parsed and the codes, scales and kept tensors are read with plain ``readinto``
   (no mmap: resident memory is what the model holds, the page cache is not counted twice);
2. ComfyUI detects the architecture from the kept tensors plus zero-stride placeholders of each
   quantized weight's logical (out, in) shape (no memory behind them);
3. the model is built on the ``meta`` device, the quantized Linears are replaced with
   ``ComfyQuantLinear`` layers holding exactly the file's codes and scales, and the kept tensors
   are assigned (cast to the dtype ComfyUI chose, as its own loader would);
4. a classic ModelPatcher wraps it; its size is the true quantized size.
Host memory peaks near the quantized size, never at the bf16 size. The helpers above the
``ComfyUI`` line do not import comfy, so they are unit-tested on plain torch modules.
"""
from __future__ import annotations

import inspect
import json
import logging
import math
import os
import struct
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from ..core.errors import BackendUnavailable, ConfigError, IncompatibleInput, LeversError
from ..core.quant import checkpoint as qckpt
from ..core.quant.registry import Granularity, QuantizedWeight, get_quantizer
from ..core.types import Precision

log = logging.getLogger("levers")

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
_MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header
MiB = 1024 ** 2


@dataclass(frozen=True)
class TensorEntry:
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offsets in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass
class QuantFileInfo:
    """What a diffusion-model file holds, read from its header and the small ``*_quant`` tensors."""

    path: str
    tensors: dict[str, TensorEntry]
    metadata: dict[str, str]
    layers: dict[str, dict] = field(default_factory=dict)   # layer -> {"format", "granularity", "block_size", "layout"}

    @property
    def kind(self) -> str:
        """``plain``, ``comfy_fp8`` (ComfyUI's own per-tensor layout only) or ``levers``."""
        layouts = {v["layout"] for v in self.layers.values()}
        if "levers" in layouts:
            return "levers"
        if "comfy" in layouts:
            return "comfy_fp8"
        return "plain"

    @property
    def formats(self) -> list[str]:
        seen = {}
        for v in self.layers.values():
            key = f"{v['format']} {v['granularity']}" + (f" (block {v['block_size']})"
                                                         if v["granularity"] == "per_block" else "")
            seen[key] = seen.get(key, 0) + 1
        return [f"{k}: {n} layers" for k, n in seen.items()]

    def owned_keys(self) -> set[str]:
        """Keys that belong to quantized layers (codes, scales, tags); their biases are not included."""
        owned = set()
        for layer in self.layers:
            owned |= {k for k in self.tensors if k.startswith(layer + ".") and k != f"{layer}.bias"}
        return owned

    @property
    def disk_bytes(self) -> int:
        return sum(e.nbytes for e in self.tensors.values())

    def unquantized_bytes(self) -> int:
        """The same model with the quantized weights back in their original dtype (kept tensors as stored)."""
        owned = self.owned_keys()
        total = sum(e.nbytes for k, e in self.tensors.items() if k not in owned)
        for v in self.layers.values():
            dtype = getattr(torch, v.get("orig_dtype", "bfloat16"), torch.bfloat16)
            total += dtype.itemsize * math.prod(v["shape"])
        return total

    def bf16_bytes(self) -> int:
        """The same model with every floating tensor (and every quantized weight) in bf16."""
        owned = self.owned_keys()
        total = 0
        for k, e in self.tensors.items():
            if k in owned:
                continue
            total += math.prod(e.shape) * (2 if e.dtype.is_floating_point else e.dtype.itemsize)
        for v in self.layers.values():
            total += 2 * math.prod(v["shape"])
        return total


def read_header(path: str) -> tuple[dict[str, TensorEntry], dict[str, str]]:
    """(tensors, metadata) of a .safetensors file; ConfigError naming the file when it is not one."""
    def bad(why: str) -> ConfigError:
        return ConfigError("unet_name", os.path.basename(path), "a .safetensors diffusion model",
                           f"{path}: {why}. Pick a .safetensors file written by a loader-compatible tool "
                           f"(QuantizeDiT save_path, `levers quantize`, or an original checkpoint).")

    if not os.path.isfile(path):
        raise bad("no such file")
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise bad("file too short to be a safetensors")
        (n,) = struct.unpack("<Q", head)
        if n == 0 or n > min(_MAX_HEADER, size - 8):
            raise bad("no safetensors header (a .ckpt/.pt/.gguf file, or a truncated download)")
        try:
            header = json.loads(f.read(n).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise bad(f"unreadable safetensors header ({exc})") from None
    if not isinstance(header, dict):
        raise bad("safetensors header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    base = 8 + n
    tensors = {}
    for name, e in header.items():
        dtype = _DTYPES.get(e.get("dtype")) if isinstance(e, dict) else None
        if dtype is None:
            raise bad(f"tensor {name!r} has dtype {e.get('dtype') if isinstance(e, dict) else e!r}, "
                      f"which torch cannot hold")
        start, end = e["data_offsets"]
        if base + end > size:
            raise bad(f"tensor {name!r} ends past the end of the file (truncated download?)")
        want = math.prod(e["shape"]) * torch.empty((), dtype=dtype).element_size()
        if end - start != want:
            raise bad(f"tensor {name!r} holds {end - start} bytes where its shape {list(e['shape'])} needs {want} "
                      f"(a damaged header)")
        tensors[name] = TensorEntry(dtype, tuple(e["shape"]), base + start, base + end)
    return tensors, metadata


class TensorReader:
    """Reads tensors with ``readinto`` into fresh CPU memory (no mmap, so nothing is resident twice)."""

    def __init__(self, path: str, tensors: dict[str, TensorEntry]):
        self.path, self.tensors = path, tensors
        self._f = open(path, "rb")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()

    def __call__(self, name: str) -> torch.Tensor:
        e = self.tensors[name]
        buf = torch.empty(e.nbytes, dtype=torch.uint8)
        if e.nbytes:
            self._f.seek(e.start)
            got = self._f.readinto(memoryview(buf.numpy()))
            if got != e.nbytes:
                raise ConfigError("unet_name", os.path.basename(self.path), "a complete .safetensors file",
                                  f"{self.path}: tensor {name!r} is truncated ({got} of {e.nbytes} bytes)")
        return buf.view(e.dtype).reshape(e.shape)                           # shape as stored


def inspect_file(path: str) -> QuantFileInfo:
    """Header + the per-layer quant tags; ConfigError for a file or format tag we cannot read."""
    tensors, metadata = read_header(path)
    info = QuantFileInfo(path, tensors, metadata)
    with TensorReader(path, tensors) as read:
        for layer in qckpt.quantized_layers_in(tensors):
            if f"{layer}.weight" not in tensors:
                raise ConfigError("unet_name", os.path.basename(path), "a complete quantized checkpoint",
                                  f"{path}: layer {layer!r} has a quant tag but no weight")
            if f"{layer}.comfy_quant" in tensors:
                conf = _tag(path, layer, "comfy_quant", read)
                if conf.get("format") != qckpt.COMFY_FP8_FORMAT:
                    raise ConfigError(f"{layer}.comfy_quant", conf.get("format"), qckpt.COMFY_FP8_FORMAT,
                                      f"{path} uses a ComfyUI quant format Levers does not read: load it with the "
                                      f"stock Load Diffusion Model node")
                info.layers[layer] = {"format": "fp8_e4m3fn", "granularity": "per_tensor", "block_size": 64,
                                      "shape": list(tensors[f"{layer}.weight"].shape), "layout": "comfy"}
                continue
            tag = _tag(path, layer, "levers_quant", read)
            try:
                fmt = Precision.parse(tag.get("format"), f"{layer}.levers_quant format")
                gran = Granularity.parse(tag.get("granularity"), f"{layer}.levers_quant granularity")
                if not fmt.is_quantized:
                    raise ConfigError(f"{layer}.levers_quant format", str(fmt), "fp8_e4m3fn, int8 or nf4")
            except ValueError as exc:  # Enum.parse raises ValueError, ConfigError is one too
                raise ConfigError("unet_name", os.path.basename(path), "a file with known quant formats",
                                  f"{path}: {exc} The file was written by a newer or different tool; update "
                                  f"ComfyUI-Levers or re-quantize the original with `levers quantize`.") from None
            if fmt != Precision.NF4 and f"{layer}.weight_scale" not in tensors:
                raise ConfigError("unet_name", os.path.basename(path), "a complete quantized checkpoint",
                                  f"{path}: layer {layer!r} holds {fmt} codes without their weight_scale (a damaged "
                                  "or hand-edited file); quantize the original again")
            info.layers[layer] = {"format": str(fmt), "granularity": str(gran),
                                  "block_size": int(tag.get("block_size", 64)), "shape": list(tag["shape"]),
                                  "layout": "levers", "orig_dtype": str(tag.get("orig_dtype", "bfloat16"))}
    untagged = _untagged_quantized(tensors, info.layers)
    if untagged:
        raise ConfigError("unet_name", os.path.basename(path), "a file Load Quantized DiT or ComfyUI can read",
                          f"{path}: {len(untagged)} layer(s) hold quantized codes with their scales but no quant "
                          f"tag (e.g. {untagged[0]!r}: another tool's layout, e.g. Forge's bitsandbytes nf4 or an "
                          "int8 file); read as plain weights they would load with wrong output or fail. Load the "
                          "file with the tool that wrote it, or quantize the original model with QuantizeDiT or "
                          "`levers quantize`.")
    return info


def _tag(path: str, layer: str, kind: str, read) -> dict:
    """A layer's JSON quant tag; ConfigError naming the file when it is not one."""
    try:
        tag = qckpt.read_json_tensor(read(f"{layer}.{kind}"))
    except (UnicodeDecodeError, ValueError) as exc:
        tag = exc
    if not isinstance(tag, dict):
        raise ConfigError("unet_name", os.path.basename(path), "a quantized checkpoint with readable quant tags",
                          f"{path}: {layer}.{kind} is not a JSON tag ({tag}); the file is damaged or was written by "
                          "another tool: quantize the original again")
    return tag


def _untagged_quantized(tensors: dict[str, TensorEntry], tagged: dict) -> list[str]:
    """Layers whose ``weight`` holds integer codes beside a scale or bitsandbytes state, without a tag either reader
    knows: ComfyUI would load the codes as plain weights (its own fp8 layouts, ``scale_weight`` or tagged, are
    not listed)."""
    out = []
    for key, e in tensors.items():
        if not key.endswith(".weight") or e.dtype not in (torch.int8, torch.uint8):
            continue
        layer = key[:-len(".weight")]
        if layer in tagged:
            continue
        if (f"{layer}.weight_scale" in tensors or f"{key}.absmax" in tensors
                or any(k.startswith(f"{key}.quant_state") for k in tensors)):
            out.append(layer)
    return out


def require_backends(info: QuantFileInfo) -> None:
    """BackendUnavailable naming the file when a format in it cannot be read here (nf4 needs bitsandbytes)."""
    for fmt in sorted({v["format"] for v in info.layers.values()}):
        if fmt != str(Precision.NF4):
            continue  # fp8 and int8 codes are dequantized with plain torch
        q = get_quantizer(fmt)
        ok, why = q.available()
        if not ok:
            raise BackendUnavailable(f"{fmt} (needed to load {os.path.basename(info.path)})", why, q.install_hint)


def read_quantized(info: QuantFileInfo, prefix: str = "") -> tuple[dict[str, torch.Tensor],
                                                                    dict[str, QuantizedWeight]]:
    """(kept tensors, {layer: QuantizedWeight}) exactly as stored, of the keys under ``prefix`` only (a full
    checkpoint's diffusion model: its text encoders and VAE are never read)."""
    keys = set(info.tensors)
    owned = info.owned_keys()
    with TensorReader(info.path, info.tensors) as read:
        quantized = {layer: qckpt.read_layer(layer, read, keys) for layer in info.layers if layer.startswith(prefix)}
        plain = {k: read(k) for k in info.tensors if k not in owned and k.startswith(prefix)}
    return plain, quantized


def placeholder(shape, dtype: torch.dtype) -> torch.Tensor:
    """A tensor of ``shape`` with no memory behind it (one element, zero strides): for shape detection."""
    return torch.zeros((), dtype=dtype).expand(*shape)


def install_quantized(module: nn.Module, quantized: dict[str, QuantizedWeight], tensors: dict[str, torch.Tensor],
                      make_layer: Callable[[QuantizedWeight, torch.Tensor | None], nn.Module]) -> list[str]:
    """Put the file's layers and tensors into ``module`` (typically built on ``meta``). Returns the names
    of tensors still on ``meta`` (nothing in the file for them).

    Each quantized Linear is replaced by ``make_layer(qweight, bias)`` (bias cast to the layer's dtype);
    every other tensor is assigned, cast to the dtype the module declared (what ``load_state_dict``'s
    copy would do, without allocating the target first). ``tensors`` is consumed: each entry is removed
    once cast, so the file-dtype copy is freed tensor by tensor (the caller must hold no other reference).
    """
    for name, qw in quantized.items():
        old = module.get_submodule(name)
        out_f, in_f = getattr(old, "out_features", None), getattr(old, "in_features", None)
        if (out_f, in_f) != tuple(qw.shape):
            raise IncompatibleInput(name, f"a Linear of shape {tuple(qw.shape)}", old,
                                    f"the file's layer {name} is {tuple(qw.shape)} but the detected model has "
                                    f"({out_f}, {in_f}) there: the file does not match the architecture")
        bias = tensors.pop(f"{name}.bias", None)
        if bias is not None:
            bias = bias.to(_declared_dtype(old, "bias") or bias.dtype)
        parent, _, child = name.rpartition(".")
        setattr(module.get_submodule(parent) if parent else module, child, make_layer(qw, bias))
    declared = module.state_dict(keep_vars=True)
    cast = {}
    for k in list(tensors):
        t = tensors.pop(k)
        owner, _, attr = k.rpartition(".")
        target = declared.get(k)
        dtype = target.dtype if target is not None else None
        if dtype is None:
            try:  # ComfyUI lazy-init layers keep weight=None and remember the dtype next to it
                dtype = _declared_dtype(module.get_submodule(owner) if owner else module, attr)
            except AttributeError:
                dtype = None
        cast[k] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
        del t
    missing, unexpected = module.load_state_dict(cast, strict=False, assign=True)
    if unexpected:
        log.warning("Load Quantized DiT: %d tensors in the file have no place in the model: %s", len(unexpected),
                    ", ".join(unexpected[:5]))
    return [n for n, t in list(module.named_parameters()) + list(module.named_buffers()) if t.is_meta]


def _declared_dtype(module: nn.Module, attr: str) -> torch.dtype | None:
    t = getattr(module, attr, None)
    if isinstance(t, torch.Tensor):
        return t.dtype
    return getattr(module, f"{attr}_comfy_model_dtype", None)


# ------------------------------------------------------------------------------------------- ComfyUI
COMPUTE_DTYPES = {"auto": None, "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def load_quantized_dit(path: str, compute_dtype: str = "auto"):
    """(ModelPatcher, report text) for ``path``: ComfyUI's own loader when it can, the Levers path otherwise."""
    if compute_dtype not in COMPUTE_DTYPES:
        raise ConfigError("compute_dtype", compute_dtype, ", ".join(COMPUTE_DTYPES))
    dtype = COMPUTE_DTYPES[compute_dtype]
    info = inspect_file(path)
    from .quant import native_fp8_available

    native_ok, native_why = native_fp8_available()
    notes = []
    if info.kind == "plain" or (info.kind == "comfy_fp8" and native_ok):
        import comfy.sd

        patcher = comfy.sd.load_diffusion_model(path, model_options={} if dtype is None else {"dtype": dtype})
        how = ("ComfyUI's own loader (comfy.sd.load_diffusion_model, as the stock Load Diffusion Model node): "
               + ("no quantized layers in the file" if info.kind == "plain" else f"ComfyUI fp8 layout ({native_why})"))
    else:
        if info.kind == "comfy_fp8":
            notes.append(f"this ComfyUI cannot hold fp8 per-tensor weights natively ({native_why}): Levers layers used")
        require_backends(info)
        patcher, build_notes = _load_levers(info, dtype)
        notes.extend(build_notes)
        how = "Levers loader (architecture detected by ComfyUI, ComfyQuantLinear layers holding the file's codes)"
    return patcher, format_report(info, patcher, how, notes)


def _detection_inputs(info: QuantFileInfo):
    """(state dict for ComfyUI's detection, {layer: QuantizedWeight}), the unet prefix stripped from both.

    The state dict holds the kept tensors plus a shape-only stand-in (no memory) for each quantized weight.
    """
    import comfy.model_detection as md
    import comfy.utils

    # the prefix from the key names alone (ComfyUI's detection reads no values), so that a full checkpoint's text
    # encoders and VAE are not read into RAM only to be dropped
    names = dict.fromkeys([*info.tensors, *(f"{layer}.weight" for layer in info.layers)])
    prefix = md.unet_prefix_from_state_dict(names)
    full = any(k.startswith(prefix) for k in names)
    plain, quantized = read_quantized(info, prefix if full else "")
    for layer, qw in quantized.items():
        plain[f"{layer}.weight"] = placeholder(qw.shape, qw.orig_dtype)
    if full:  # a full checkpoint: only the diffusion model's keys, as ComfyUI's own loader does
        stripped = comfy.utils.state_dict_prefix_replace(plain, {prefix: ""}, filter_keys=True)
        return stripped, {l[len(prefix):]: q for l, q in quantized.items()}
    return plain, quantized


def _unet_tensors(model_config, det: dict, quantized: dict, info: QuantFileInfo) -> dict:
    """The kept tensors after the architecture's key conversion; quantized weights must come through unchanged."""
    to_load = model_config.process_unet_state_dict(dict(det))
    for layer in quantized:
        key = f"{layer}.weight"
        if to_load.get(key) is not det[key]:
            raise IncompatibleInput("unet_name", "weights this architecture loads unchanged", info.path,
                                    f"ComfyUI rewrites {key} while loading this architecture, so its quantized "
                                    f"codes cannot be used as stored; quantize in the graph with QuantizeDiT instead")
        del to_load[key]
    return to_load


def _load_levers(info: QuantFileInfo, dtype: torch.dtype | None):
    import comfy.model_detection as md
    import comfy.model_management as mm
    import comfy.model_patcher
    import comfy.utils

    from .quant import ComfyQuantLinear

    notes = []
    det, quantized = _detection_inputs(info)
    meta = {k: v for k, v in info.metadata.items() if k != "_quantization_metadata"}
    kwargs = {"metadata": meta} if "metadata" in inspect.signature(md.model_config_from_unet).parameters else {}
    model_config = md.model_config_from_unet(det, "", **kwargs)
    if model_config is None:
        raise ConfigError("unet_name", os.path.basename(info.path), "a diffusion model this ComfyUI can detect",
                          f"{info.path}: ComfyUI did not recognise the architecture from its keys; update ComfyUI, "
                          f"or check the file is a diffusion model (not a LoRA, VAE or text encoder)")
    load_device, offload_device = mm.get_torch_device(), mm.unet_offload_device()
    supported = list(model_config.supported_inference_dtypes)
    unet_dtype = dtype or mm.unet_dtype(model_params=comfy.utils.calculate_parameters(det),
                                        supported_dtypes=supported, weight_dtype=comfy.utils.weight_dtype(det))
    manual_cast = mm.unet_manual_cast(unet_dtype, load_device, supported)
    if "device" in inspect.signature(model_config.set_inference_dtype).parameters:
        model_config.set_inference_dtype(unet_dtype, manual_cast, device=load_device)
    else:
        model_config.set_inference_dtype(unet_dtype, manual_cast)

    def make(qw, bias):
        return ComfyQuantLinear(qw, bias)

    model = model_config.get_model(det, "", device="meta")
    to_load = _unet_tensors(model_config, det, quantized, info)
    det = None  # to_load now holds the only references: install_quantized frees each after its cast
    left = install_quantized(model.diffusion_model, quantized, to_load, make)
    if left:  # buffers computed at construction (not in the file): build on the CPU and read again
        notes.append(f"{len(left)} tensors are computed at construction ({', '.join(left[:3])}): model built on "
                     f"the CPU first")
        det, quantized = _detection_inputs(info)
        model = model_config.get_model(det, "")
        to_load = _unet_tensors(model_config, det, quantized, info)
        det = None
        install_quantized(model.diffusion_model, quantized, to_load, make)
    model = model.to(offload_device)
    model.device = offload_device
    patcher = comfy.model_patcher.ModelPatcher(model, load_device=load_device, offload_device=offload_device)
    patcher.size = mm.module_size(model)
    notes.append(f"compute: weights {unet_dtype}, manual cast {manual_cast}")
    if any(v["format"] == "int8" for v in info.layers.values()) and not get_quantizer("int8").available()[0]:
        notes.append("LoRA on int8 layers re-quantizes with torchao, which is not installed (pip install torchao)")
    return patcher, notes


def format_report(info: QuantFileInfo, patcher, how: str, notes: list[str]) -> str:
    disk, bf16, unq = info.disk_bytes, info.bf16_bytes(), info.unquantized_bytes()
    kept = len(info.tensors) - len(info.owned_keys())
    lines = [f"Load Quantized DiT: {os.path.basename(info.path)}",
             f"  loader:    {how}"]
    if info.layers:
        lines.append(f"  format:    {'; '.join(info.formats)}")
    lines += [f"  layers:    {len(info.layers)} quantized, {kept} tensors kept as stored",
              f"  on disk:   {disk / MiB:.1f} MiB; unquantized {unq / MiB:.1f} MiB ({(disk / unq if unq else 1.0):.0%}); "
              f"all-bf16 {bf16 / MiB:.1f} MiB ({(disk / bf16 if bf16 else 1.0):.0%})"]
    size = getattr(patcher, "size", 0) or patcher.model_size()
    lines.append(f"  in memory: {size / MiB:.1f} MiB (size reported to ComfyUI's memory manager)")
    lines.extend(f"  note: {n}" for n in notes)
    return "\n".join(lines)


def resolve_unet_path(unet_name: str) -> str:
    """The full path of a diffusion_models entry (the same lookup as the stock UNETLoader)."""
    import folder_paths

    path = folder_paths.get_full_path("diffusion_models", unet_name)
    if path is None:
        raise ConfigError("unet_name", unet_name, "a file listed under models/diffusion_models",
                          "refresh the node list (R) or put the file into models/diffusion_models")
    return path


__all__ = ["QuantFileInfo", "TensorEntry", "read_header", "inspect_file", "read_quantized", "require_backends",
           "install_quantized", "placeholder", "load_quantized_dit", "resolve_unet_path", "LeversError"]
