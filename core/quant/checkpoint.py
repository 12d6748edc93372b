"""Quantized checkpoints: the on-disk layouts, a streaming file quantizer and a reader.

Layouts (per quantized layer ``L``; every other tensor is copied unchanged):
- fp8 per_tensor, ComfyUI's own layout (stock ``UNETLoader`` loads it, ComfyUI >= 0.3.7x):
    L.weight float8_e4m3fn (out, in), L.weight_scale float32 (), L.comfy_quant uint8 JSON
    {"format": "float8_e4m3fn"}; file metadata ``_quantization_metadata`` lists the layers.
- Levers layout (fp8 per_row / per_block, int8; loaded by the pack):
    L.weight codes, L.weight_scale float32, L.levers_quant uint8 JSON
    {"format", "granularity", "block_size", "shape"}.
- nf4 (Levers layout with bitsandbytes' own serialisation, ``QuantState.as_dict(packed=True)``):
    L.weight uint8 (out*in/2, 1), L.weight.absmax, L.weight.quant_map,
    L.weight.quant_state.bitsandbytes__nf4, L.levers_quant.
File metadata ``levers_quantization`` holds the QuantConfig and the architecture.

The writer streams: each tensor is read, quantized and appended to a scratch data file, so peak
memory is one input tensor plus its outputs, never the whole model. The final file is written to
a temp name beside OUT and renamed, so an error or an interrupt never leaves a partial OUT.
"""
from __future__ import annotations

import json
import os
import struct
import tempfile
from typing import Callable, Iterator

import torch

from ..errors import ConfigError
from ..types import Precision
from .census import census as run_census, not_a_diffusion_model
from .metrics import sqnr
from .registry import Granularity, LayerReport, QuantConfig, QuantizedWeight, QuantReport, get_quantizer

COMFY_FP8_FORMAT = "float8_e4m3fn"
LEVERS_META_KEY = "levers_quantization"

_ST_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
              torch.int8: "I8", torch.uint8: "U8", torch.int16: "I16", torch.int32: "I32", torch.int64: "I64",
              torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}
# the unsigned and scale dtypes newer torch and safetensors name (a source file may hold them beside the weights)
_ST_DTYPES.update({getattr(torch, d): code for d, code in (("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64"),
                                                             ("float8_e8m0fnu", "F8_E8M0")) if hasattr(torch, d)})


def json_tensor(obj) -> torch.Tensor:
    """A JSON object as a uint8 tensor (how ComfyUI stores ``.comfy_quant``)."""
    return torch.tensor(list(json.dumps(obj).encode("utf-8")), dtype=torch.uint8)


def read_json_tensor(t: torch.Tensor) -> dict:
    return json.loads(bytes(t.to(torch.uint8).tolist()).decode("utf-8"))


def uses_comfy_layout(config: QuantConfig) -> bool:
    return config.format == Precision.FP8_E4M3FN and config.granularity == Granularity.PER_TENSOR


def layer_tensors(layer: str, qw: QuantizedWeight, comfy_layout: bool | None = None) -> dict[str, torch.Tensor]:
    """The checkpoint tensors for one quantized layer (see the module docstring)."""
    if comfy_layout is None:
        comfy_layout = qw.format == Precision.FP8_E4M3FN and qw.granularity == Granularity.PER_TENSOR
    t = qw.tensors
    if comfy_layout:
        return {f"{layer}.weight": t["weight"], f"{layer}.weight_scale": t["weight_scale"].reshape(()).float(),
                f"{layer}.comfy_quant": json_tensor({"format": COMFY_FP8_FORMAT})}
    info = {"format": str(qw.format), "granularity": str(qw.granularity), "block_size": qw.block_size,
            "shape": list(qw.shape), "orig_dtype": str(qw.orig_dtype).replace("torch.", "")}
    out = {f"{layer}.weight": t["weight"]}
    if qw.format == Precision.NF4:
        from .nf4 import quant_state_dict
        for k, v in quant_state_dict(t["weight"], t["weight_scale"], qw.shape, qw.block_size, qw.orig_dtype).items():
            out[f"{layer}.weight.{k}"] = v
    else:
        out[f"{layer}.weight_scale"] = t["weight_scale"]
    out[f"{layer}.levers_quant"] = json_tensor(info)
    return out


def read_layer(layer: str, get: Callable[[str], torch.Tensor], keys: set[str]) -> QuantizedWeight:
    """Inverse of ``layer_tensors``: rebuild the QuantizedWeight of ``layer`` from a file's tensors."""
    if f"{layer}.comfy_quant" in keys:
        conf = read_json_tensor(get(f"{layer}.comfy_quant"))
        if conf.get("format") != COMFY_FP8_FORMAT:
            raise ConfigError(f"{layer}.comfy_quant", conf.get("format"), COMFY_FP8_FORMAT,
                              "only fp8 e4m3fn ComfyUI checkpoints are read by Levers")
        w = get(f"{layer}.weight")
        return QuantizedWeight(Precision.FP8_E4M3FN, Granularity.PER_TENSOR, 64, tuple(w.shape),
                               {"weight": w, "weight_scale": get(f"{layer}.weight_scale").float().reshape(())})
    info = read_json_tensor(get(f"{layer}.levers_quant"))
    fmt, gran = Precision.parse(info["format"]), Granularity.parse(info["granularity"])
    orig = getattr(torch, info.get("orig_dtype", "bfloat16"))
    w = get(f"{layer}.weight")
    if fmt == Precision.NF4:
        from .nf4 import absmax_from_state_dict
        prefix = f"{layer}.weight."
        qs = {k[len(prefix):]: get(k) for k in keys if k.startswith(prefix)}
        absmax, _, block = absmax_from_state_dict(qs)
        return QuantizedWeight(fmt, gran, block, tuple(info["shape"]), {"weight": w, "weight_scale": absmax}, orig)
    return QuantizedWeight(fmt, gran, int(info["block_size"]), tuple(info["shape"]),
                           {"weight": w, "weight_scale": get(f"{layer}.weight_scale")}, orig)


def quantized_layers_in(keys) -> list[str]:
    return sorted(k.rsplit(".", 1)[0] for k in keys if k.endswith((".comfy_quant", ".levers_quant")))


# ------------------------------------------------------------------------------------------ writing
class _StreamingSafetensors:
    """Appends tensors to a scratch file, then writes header + data to a temp file and renames it."""

    def __init__(self, out_path: str):
        self.out_path = os.path.abspath(out_path)
        self.dir = os.path.dirname(self.out_path) or "."
        fd, self.data_path = tempfile.mkstemp(prefix=".levers-data-", dir=self.dir)
        self.data = os.fdopen(fd, "wb")
        self.header: dict = {}
        self.offset = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        if name in self.header:
            raise ValueError(f"duplicate tensor name {name!r} in the output")
        if t.dtype not in _ST_DTYPES:
            raise ConfigError("IN", name, "tensors of a dtype safetensors can store",
                              f"{name} is {t.dtype}, which this writer cannot name; convert that tensor first")
        t = t.detach().to("cpu").contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b""
        self.data.write(memoryview(raw) if t.numel() else raw)
        n = t.numel() * t.element_size()
        self.header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape),
                             "data_offsets": [self.offset, self.offset + n]}
        self.offset += n

    def commit(self, metadata: dict[str, str]) -> None:
        self.data.close()
        header = dict(self.header)
        header["__metadata__"] = metadata
        blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
        blob += b" " * (-len(blob) % 8)  # the data section starts 8-byte aligned
        fd, tmp = tempfile.mkstemp(prefix=".levers-out-", suffix=".safetensors", dir=self.dir)
        try:
            with os.fdopen(fd, "wb") as f, open(self.data_path, "rb") as src:
                f.write(struct.pack("<Q", len(blob)))
                f.write(blob)
                while chunk := src.read(8 << 20):  # small chunks: the copy adds ~8 MB, not the file size
                    f.write(chunk)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o666 & ~_umask())   # mkstemp makes it owner-only; a saved model follows the umask
            os.replace(tmp, self.out_path)  # atomic on the same filesystem
        except BaseException:
            _unlink(tmp)
            raise
        finally:
            _unlink(self.data_path)

    def abort(self) -> None:
        if not self.data.closed:
            self.data.close()
        _unlink(self.data_path)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:                 # one of them does not exist (yet)
        return os.path.abspath(a) == os.path.abspath(b)


def check_output_path(out_path: str, force: bool) -> None:
    if not out_path or out_path.endswith(("/", os.sep)):
        raise ConfigError("OUT", out_path, "a file path", "Name the file to write, e.g. model_fp8.safetensors"
                          + (f" or {os.path.join(out_path, 'model_fp8.safetensors')}" if out_path else "") + ".")
    if os.path.isdir(out_path):
        raise ConfigError("OUT", out_path, "a file path", "it is a folder; give the file to write, e.g. "
                          f"{os.path.join(out_path, 'model_fp8.safetensors')}")
    if os.path.exists(out_path) and not force:
        raise FileExistsError(f"{out_path} exists; pass --force (node: a new save_path) to overwrite it")
    parent = os.path.dirname(os.path.abspath(out_path))
    if os.path.isfile(parent):
        raise ConfigError("OUT", out_path, "a path in a folder", f"{parent} is a file, not a folder.")
    if not os.path.isdir(parent):
        raise FileNotFoundError(f"output folder {parent} does not exist; create it first, or write into a folder "
                                "that exists")


def save_tensors(tensors: Iterator[tuple[str, torch.Tensor]], out_path: str, metadata: dict[str, str],
                 force: bool = False) -> None:
    """Stream (name, tensor) pairs into ``out_path`` atomically."""
    check_output_path(out_path, force)
    w = _StreamingSafetensors(out_path)
    try:
        for name, t in tensors:
            w.add(name, t)
    except BaseException:
        w.abort()
        raise
    w.commit(metadata)


def file_metadata(config: QuantConfig, arch: str, layers: list[str]) -> dict[str, str]:
    meta = {LEVERS_META_KEY: json.dumps({"config": config.to_dict(), "arch": arch, "format_version": 1})}
    if uses_comfy_layout(config):
        meta["_quantization_metadata"] = json.dumps(
            {"format_version": "1.0", "layers": {l: {"format": COMFY_FP8_FORMAT} for l in layers}})
    return meta


_CODE_DTYPES = {"F8_E4M3", "F8_E5M2", "I8", "U8"}     # safetensors dtypes of already-quantized weights


def open_source(src: str):
    """``safe_open`` on the checkpoint to quantize; a file safetensors cannot parse is a ConfigError naming it."""
    from safetensors import safe_open

    try:
        return safe_open(src, framework="pt")
    except FileNotFoundError:
        raise
    except Exception as exc:         # safetensors raises its own error type for a file it cannot parse
        raise ConfigError("IN", src, "a .safetensors file",
                          f"it could not be read as one ({type(exc).__name__}: {exc})") from exc


def quantize_file(src: str, dst: str, config: QuantConfig, arch: str | None = None, force: bool = False,
                  measure: bool = True, progress: Callable[[int, int, str], None] | None = None) -> QuantReport:
    """Quantize a .safetensors diffusion model tensor by tensor into ``dst`` (see module docstring)."""

    quantizer = get_quantizer(config.format)
    if same_file(src, dst):        # before the exists check, whose advice (--force) would not help
        raise ConfigError("OUT", dst, "a path different from IN", "Write to a new file, then rename it yourself.")
    check_output_path(dst, force)
    with open_source(src) as f:
        keys = list(f.keys())
        src_meta = f.metadata() or {}
        # a full checkpoint's diffusion model is what is quantized: a scaled-fp8 text encoder bundled with a bf16
        # diffusion model (its .scale_weight keys) is copied as it is, not taken for a quantized file
        dit = [k for k in keys if k.startswith("model.diffusion_model.")]
        own, prefix = (dit, "model.diffusion_model.") if dit else (keys, "")
        if any(k.endswith((".comfy_quant", ".levers_quant", ".scale_weight")) for k in own) \
                or f"{prefix}scaled_fp8" in keys or "scaled_fp8" in keys and not dit:
            raise ConfigError("IN", src, "an unquantized (bf16/fp16/fp32) checkpoint",
                              "this file is already quantized")
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in keys}
        plan = run_census(shapes, arch=arch, config=config)
        foreign = not_a_diffusion_model(keys, plan.arch if arch in (None, "", "auto") else "explicit")
        if foreign is not None:
            raise ConfigError("IN", src, "a diffusion model (DiT or UNet) checkpoint",
                              f"{os.path.basename(src)} looks like {foreign}. Quantize the diffusion model it "
                              "goes with; ComfyUI applies a 16-bit LoRA to a quantized model at load (LoraLoader "
                              "after the loader), and keeps text encoders and VAEs as they are. A diffusion model "
                              "of a layout no rule knows: pass --arch generic")
        report = QuantReport(config=config, arch=plan.arch, notes=list(plan.notes))
        targets = [e.key for e in plan.quantized]
        set_targets = set(targets)
        coded = sorted({f.get_slice(k).get_dtype() for k in targets} & _CODE_DTYPES)
        if coded:
            raise ConfigError("IN", src, "an unquantized (bf16/fp16/fp32) checkpoint",
                              f"its block weights are already {', '.join(coded)} codes; quantize the bf16 original "
                              "(quantizing codes again only adds rounding)")
        if not targets and (config.keep_first_blocks or config.keep_last_blocks or config.extra_skip):
            given = {"keep_first_blocks": config.keep_first_blocks, "keep_last_blocks": config.keep_last_blocks,
                     "extra_skip": ", ".join(config.extra_skip)}
            field = next(k for k, v in given.items() if v)
            others = ", ".join(f"{k}={v!r}" for k, v in given.items() if k != field)
            raise ConfigError(field, given[field], "settings that leave some layer to quantize",
                              f"With {others} they keep every layer of {os.path.basename(src)}"
                              + ("; " + "; ".join(plan.notes) if plan.notes else "") + ".")
        if not targets:
            raise ConfigError("arch", plan.arch, "an architecture whose census finds weights to quantize",
                              f"nothing in {os.path.basename(src)} matched the {plan.arch} census "
                              f"({len(keys)} tensors, all kept); pass --arch with the model's family, or check the "
                              "file is a diffusion model")
        # after the checks of IN's keys: a backend's import prints library-loading lines (torchao), which would
        # bury their one-line errors
        quantizer.require()

        def stream():
            for i, k in enumerate(keys):
                t = f.get_tensor(k)
                if k in set_targets:
                    qw = quantizer.quantize(t, config.granularity, config.block_size)
                    score = sqnr(t, quantizer.dequantize(qw, torch.float32)) if measure else None
                    layer = k[: -len(".weight")]
                    report.layers.append(LayerReport(layer, tuple(t.shape), t.numel() * t.element_size(), qw.nbytes,
                                                     score))
                    yield from layer_tensors(layer, qw, uses_comfy_layout(config)).items()
                else:
                    report.kept_bytes += t.numel() * t.element_size()
                    report.kept_count += 1
                    yield k, t
                if progress is not None:
                    progress(i + 1, len(keys), k)

        meta = {k: v for k, v in src_meta.items() if k not in ("_quantization_metadata", LEVERS_META_KEY)}
        meta.update(file_metadata(config, plan.arch, [t[: -len(".weight")] for t in targets]))
        save_tensors(stream(), dst, meta, force=force)
    return report


# ------------------------------------------------------------------------------------------ reading
def load_quantized_file(path: str, device="cpu") -> tuple[dict[str, torch.Tensor], dict[str, QuantizedWeight], dict]:
    """(plain tensors, {layer: QuantizedWeight}, file metadata) from a file either layout wrote."""
    from safetensors import safe_open

    with safe_open(path, framework="pt", device=str(device)) as f:
        keys = set(f.keys())
        meta = f.metadata() or {}
        layers = quantized_layers_in(keys)
        quantized = {l: read_layer(l, f.get_tensor, keys) for l in layers}
        owned = set()
        for l in layers:
            owned |= {k for k in keys if k.startswith(l + ".") and k != f"{l}.bias"}
        plain = {k: f.get_tensor(k) for k in keys if k not in owned}
    return plain, quantized, meta
