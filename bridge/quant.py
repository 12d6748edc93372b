"""QuantizeDiT's ComfyUI side: a NEW ModelPatcher whose diffusion model holds quantized weights.

The input patcher and its module are never mutated: the BaseModel tree is copied module by module
(new Parameter objects sharing the untouched tensors' storage), the chosen Linear layers are
replaced in the copy, and a fresh patcher (own backups, own size) wraps it. Layers:
- fp8 per_tensor on a ComfyUI with ``comfy.quant_ops`` (comfy-kitchen): ComfyUI's own
  ``mixed_precision_ops`` Linear holding a ``QuantizedTensor`` — its LoRA, lowvram, pinning,
  async-offload and fp8-matmul paths apply unchanged.
- everything else: ``ComfyQuantLinear`` (below): plain ``weight`` codes + ``weight_scale`` tensors,
  dequantized per call on the input's device; LoRA works through ComfyUI's ``convert_weight`` /
  ``set_weight`` seam (full load: dequantize, patch, re-quantize with fresh scales, restored exactly
  on unpatch) and through ``weight_function`` (lowvram: patch applied to the dequantized weight).
"""
from __future__ import annotations

import inspect
import json
import logging

import torch
import torch.nn.functional as F

from ..core.errors import ConfigError, IncompatibleInput
from ..core.quant import checkpoint as qckpt
from ..core.quant.linear import CODE_DTYPES, QuantLinear, clone_module_tree, is_quantized_module, quantize_module
from ..core.quant.registry import Granularity, QuantConfig, QuantizedWeight, QuantReport, get_quantizer
from ..core.residency.subclass import is_plain
from ..core.types import Precision
from .comfy_mode import unload_entries_of
from .inputs import require_model

log = logging.getLogger("levers")

# Attributes ComfyUI's patchers leave on modules while a model is loaded; a copy must not inherit them.
_LOAD_STATE_ATTRS = ("comfy_patched_weights", "prev_comfy_cast_weights", "comfy_force_cast_weights", "_v",
                     "_v_weight", "_v_bias", "_v_signature", "_prefetch", "_pin_state", "seed_key")


def _converts_codes(patch) -> bool:
    """Does this lowvram weight patch call the layer's ``convert_weight`` on what it is given (ComfyUI 0.3.x's
    LowVramPatch)? Later releases keep the attribute but patch the weight as given."""
    if getattr(patch, "convert_func", None) is None:
        return False
    call = getattr(type(patch), "__call__", None)
    return "convert_func" in getattr(getattr(call, "__code__", None), "co_names", ())


class ComfyQuantLinear(QuantLinear):
    """QuantLinear that takes part in ComfyUI's cast/patch machinery (a ``CastWeightBiasOp`` look-alike)."""

    comfy_cast_weights = False

    def __init__(self, qweight: QuantizedWeight, bias):
        super().__init__(qweight, bias)
        self.weight_function = []
        self.bias_function = []
        self._lora_base_scale = None  # the scale that belongs to the backed-up (unpatched) codes

    def forward(self, x, *args, **kwargs):
        import comfy.model_management
        comfy.model_management.throw_exception_if_processing_interrupted()
        if not self.weight_function and not self.bias_function:
            return super().forward(x)
        w = None
        for f in self.weight_function:   # lowvram LoRA patches apply to the dequantized weight
            if _converts_codes(f):
                # ComfyUI 0.3.x's LowVramPatch dequantizes what it is given with our convert_weight and
                # re-quantizes the patched result with set_weight itself: it takes the stored codes (as floats,
                # exact), not the dequantized weight, which it would read as codes (found in review)
                w = f(self.weight.to(x.device).float()).to(x.dtype)      # the codes cross the bus once
            else:
                w = f(self.dequantize(x.dtype, x.device) if w is None else w)
        if w is None:
            w = self.dequantize(x.dtype, x.device)                           # (out, in)
        b = None if self.bias is None else self.bias.to(device=x.device, dtype=x.dtype)
        for f in self.bias_function:
            b = f(b)
        return F.linear(x, w, b)

    # --- ComfyUI LoRA seam: ModelPatcher.patch_weight_to_device calls these by name ---------------------
    def convert_weight(self, weight, inplace=False, **kwargs):
        """``weight`` is our codes cast to a float dtype (exact for fp8/int8/uint8): dequantize them."""
        codes = weight.to(self.weight.dtype)
        qw = QuantizedWeight(self.quant_format, self.granularity, self.block_size,
                             (self.out_features, self.in_features),
                             {"weight": codes, "weight_scale": self.weight_scale.data.to(weight.device)},
                             self.orig_dtype)
        return qw.dequantize(weight.dtype if weight.is_floating_point() else torch.float32)

    def set_weight(self, weight, inplace_update=False, seed=None, return_weight=False, **kwargs):
        """Re-quantize a patched weight with fresh scales; ``__setattr__`` restores the scale on unpatch."""
        qw = get_quantizer(self.quant_format).quantize(weight.float(), self.granularity, self.block_size)
        if return_weight:  # ComfyUI (0.3x) asks for the patched weight without installing it
            return qw.dequantize(self.orig_dtype)
        if self.__dict__["_lora_base_scale"] is None:
            # plain __dict__ entry: assigning a Parameter attribute would register it as a parameter
            self.__dict__["_lora_base_scale"] = self._parameters["weight_scale"]
        device = self.weight.device
        self._parameters["weight"] = torch.nn.Parameter(qw.tensors["weight"].to(device), requires_grad=False)
        self._parameters["weight_scale"] = torch.nn.Parameter(qw.tensors["weight_scale"].to(device),
                                                              requires_grad=False)

    def __setattr__(self, name, value):
        # ModelPatcher.unpatch_model restores `weight` from its backup with setattr; the matching
        # scale is the one we kept when the first patch was installed.
        if name == "weight" and self.__dict__.get("_lora_base_scale") is not None:
            self._parameters["weight_scale"] = self.__dict__["_lora_base_scale"]
            self.__dict__["_lora_base_scale"] = None
        super().__setattr__(name, value)


def native_fp8_available() -> tuple[bool, str]:
    """(ok, reason): can this ComfyUI hold fp8 per-tensor weights as its own QuantizedTensor?"""
    try:
        import comfy.ops
        import comfy.quant_ops
    except ImportError as exc:
        return False, f"this ComfyUI has no comfy.quant_ops ({exc})"
    if not getattr(comfy.quant_ops, "_CK_AVAILABLE", False):
        return False, "comfy-kitchen is not installed (pip install comfy-kitchen)"
    if "float8_e4m3fn" not in getattr(comfy.quant_ops, "QUANT_ALGOS", {}) or not hasattr(comfy.ops, "mixed_precision_ops"):
        return False, "this ComfyUI's mixed_precision_ops has no float8_e4m3fn"
    return True, "ComfyUI QuantizedTensor (TensorCoreFP8E4M3Layout)"


def stock_loader_reads_comfy_fp8() -> tuple[bool, str]:
    """(ok, why not): does this ComfyUI's stock UNETLoader read ComfyUI's fp8 layout (``.comfy_quant`` tags)?
    Releases before ``comfy/quant_ops.py`` (0.3.64) load the fp8 codes without their scales, silently wrong."""
    try:
        import comfy.quant_ops  # noqa: F401
    except ImportError:
        return False, ("this ComfyUI's stock UNETLoader does not read it (no comfy/quant_ops.py: it would load the "
                       "fp8 codes without their scales; 0.3.7x and later read it): load it with Load Quantized DiT "
                       "(Levers), or update ComfyUI")
    return True, "stock UNETLoader loads it"


def _native_fp8_factory(patcher, compute_dtype):
    import comfy.model_management as mm
    import comfy.ops

    disabled = set()
    if not mm.supports_fp8_compute(patcher.load_device):
        disabled |= {"float8_e4m3fn", "float8_e5m2"}
    params = inspect.signature(comfy.ops.mixed_precision_ops).parameters
    kwargs = {"disabled": disabled} if "disabled" in params else {}
    ops = comfy.ops.mixed_precision_ops({}, compute_dtype, **kwargs)

    def make(linear, qw: QuantizedWeight):
        layer = ops.Linear(qw.shape[1], qw.shape[0], bias=linear.bias is not None, device=qw.tensors["weight"].device)
        sd = {f"{k}": v for k, v in qckpt.layer_tensors("x", qw, comfy_layout=True).items()}
        sd = {k[2:]: v for k, v in sd.items()}  # drop the "x." placeholder prefix
        if linear.bias is not None:
            sd["bias"] = linear.bias.detach().to(compute_dtype)
        layer.load_state_dict(sd, strict=False)
        return layer

    return make


def _fresh_copy(patcher):
    """A copy of ``patcher.model`` that shares no module or Parameter object with it."""
    model = patcher.model
    backup = getattr(patcher, "backup", {}) or {}
    if backup:  # weights currently carry merged LoRA: copy the unpatched tensors instead
        log.info("QuantizeDiT: input model is loaded with weight patches; quantizing the unpatched weights")
    new = clone_module_tree(model, copy_params=bool(getattr(patcher, "weight_inplace_update", False)))
    for key, bk in backup.items():
        owner, _, attr = key.rpartition(".")
        try:
            mod = new.get_submodule(owner)
        except AttributeError:
            continue
        mod._parameters[attr] = torch.nn.Parameter(bk.weight.detach(), requires_grad=False)
    for m in new.modules():
        for attr in _LOAD_STATE_ATTRS:
            if attr in m.__dict__:
                if attr == "prev_comfy_cast_weights":
                    m.comfy_cast_weights = m.__dict__[attr]
                del m.__dict__[attr]
        if "weight_function" in m.__dict__:
            m.weight_function = []
            m.bias_function = []
    for attr, value in (("model_loaded_weight_memory", 0), ("lowvram_patch_counter", 0), ("model_lowvram", False),
                        ("current_weight_patches_uuid", None), ("model_offload_buffer_memory", 0)):
        if hasattr(new, attr):
            setattr(new, attr, value)
    new.device = patcher.offload_device
    return new


def _new_patcher(patcher, new_model):
    """A patcher around ``new_model`` that keeps the input's patches/options but none of its state."""
    import comfy.model_management as mm

    kwargs = {}
    params = inspect.signature(patcher.clone).parameters
    if "model_override" in params and hasattr(patcher, "get_clone_model_override"):
        fresh_state = tuple(type(x)() for x in patcher.get_clone_model_override()[1])
        kwargs["model_override"] = (new_model, fresh_state)
        if "disable_dynamic" in params:
            kwargs["disable_dynamic"] = True  # our layers are not vbar-managed
        n = patcher.clone(**kwargs)
    else:
        n = patcher.clone()
        n.model = new_model
        n.backup = {}
        n.object_patches_backup = {}
        n.pinned = set()
        if hasattr(n, "backup_buffers"):
            n.backup_buffers = {}
    n.size = mm.module_size(new_model)  # clones inherit the parent's cached size: set the true one
    return n


def quantize_patcher(patcher, config: QuantConfig, arch: str | None = None, measure: bool = True):
    """(new patcher, QuantReport, notes). The input patcher is returned as is when already quantized."""
    import comfy.model_management as mm
    import comfy.utils

    require_model(patcher)
    model = patcher.model
    dm = model.diffusion_model
    if is_quantized_module(dm):
        report = QuantReport(config=config, arch="(already quantized)")
        report.notes.append("input model already holds quantized weights (fp8/int8/nf4 checkpoint, GGUF or an "
                            "earlier QuantizeDiT): passed through unchanged")
        return patcher, report
    is_dynamic = getattr(patcher, "is_dynamic", lambda: False)()
    if is_dynamic:
        patcher = patcher.clone(disable_dynamic=True)  # a real (non-virtual) model we can read
    if any(p.device.type == "meta" for p in dm.parameters()):
        raise IncompatibleInput("model", "a model with materialised weights", patcher,
                                "this ComfyUI keeps weights virtual; quantize the file with `levers quantize` instead")

    compute_dtype = getattr(model, "manual_cast_dtype", None) or next(dm.parameters()).dtype
    notes = []
    native_ok, native_why = native_fp8_available()
    if config.format == Precision.FP8_E4M3FN and config.granularity == Granularity.PER_TENSOR and native_ok:
        make = _native_fp8_factory(patcher, compute_dtype if compute_dtype in (torch.bfloat16, torch.float16,
                                                                                torch.float32) else torch.bfloat16)
        notes.append(f"layers: {native_why}")
    else:
        make = lambda lin, qw: ComfyQuantLinear(qw, lin.bias)  # noqa: E731
        notes.append("layers: Levers QuantLinear (dequantized per layer to the compute dtype)")

    new_model = _fresh_copy(patcher)
    bar = {}

    def progress(done, total):
        mm.throw_exception_if_processing_interrupted()
        if "bar" not in bar:
            bar["bar"] = comfy.utils.ProgressBar(total)
        bar["bar"].update_absolute(done, total)

    # quantize in place on the COPY's diffusion model; the census sees the diffusion model's own names
    report = quantize_module(new_model.diffusion_model, config, arch=arch, make_layer=make, measure=measure,
                             progress=progress)
    from .prefetch import unshare_host_copy
    unshare_host_copy(new_model, dm)     # a GroupPrefetch branch on the input rewrites its host copy in place
    offload = patcher.offload_device
    new_model.diffusion_model.to(offload)
    n = _new_patcher(patcher, new_model)
    if is_dynamic:
        notes.append("DynamicVRAM patcher: the quantized model uses the classic ModelPatcher")
    report.notes[:0] = notes
    return n, report


def save_quantized(patcher, path: str, config: QuantConfig, arch: str, force: bool = False) -> None:
    """Write the quantized diffusion model as a checkpoint (fp8 per_tensor: loadable by stock UNETLoader)."""
    dm = patcher.model.diffusion_model

    def tensors():
        for name, m in dm.named_modules():
            if isinstance(m, QuantLinear):
                yield from qckpt.layer_tensors(name, m.quantized_weight()).items()
                if m.bias is not None:
                    yield f"{name}.bias", m.bias
            elif getattr(m, "layout_type", None) is not None and _native_qweight(m) is not None:  # ComfyUI native
                yield from qckpt.layer_tensors(name, _native_qweight(m), comfy_layout=True).items()
                if m.bias is not None:
                    yield f"{name}.bias", m.bias
            else:
                for k, v in m.named_parameters(prefix=name, recurse=False):
                    yield k, v
                for k, v in m.named_buffers(prefix=name, recurse=False):
                    if k.rpartition(".")[2] not in m._non_persistent_buffers_set:
                        yield k, v

    def fix(items):  # named_parameters(prefix="") yields ".weight" for the root; normalise
        for k, v in items:
            yield k.lstrip("."), v

    layers = [n for n, m in dm.named_modules() if isinstance(m, QuantLinear) or getattr(m, "layout_type", None)]
    meta = qckpt.file_metadata(config, arch, layers)
    model_config = model_config_metadata(patcher.model)
    if model_config is not None:
        meta["config"] = model_config
    qckpt.save_tensors(fix(tensors()), path, meta, force=force)


def model_config_metadata(model) -> str | None:
    """The model's configuration as ComfyUI's loaders read it from a file's ``config`` metadata (``{"transformer":
    {...}}``; LTX-Video, LTX-2 and, on newer ComfyUI, Wan take settings from it that the weights do not show, e.g.
    LTX's causal temporal positioning). A saved file without it loaded as another model: wrong output, no error.
    Only JSON values are written (what the loaders' ``dict.update`` can take); None when the model has none."""
    unet_config = getattr(getattr(model, "model_config", None), "unet_config", None)
    if not isinstance(unet_config, dict):
        return None

    def plain(v):
        if isinstance(v, (bool, int, float, str)) or v is None:
            return True
        if isinstance(v, (list, tuple)):
            return all(plain(x) for x in v)
        if isinstance(v, dict):
            return all(isinstance(k, str) and plain(x) for k, x in v.items())
        return False
    return json.dumps({"transformer": {k: v for k, v in unet_config.items() if isinstance(k, str) and plain(v)}})


def held_config(dm) -> tuple[QuantConfig | None, str]:
    """The one format and granularity every quantized layer of ``dm`` holds, to label a save of a model passed
    through as already quantized; (None, why) when there is no single layout QuantizeDiT writes (formats mixed,
    or weights of another kind: GGUF, bitsandbytes, ComfyUI's other quantized layouts, plain fp8 parameters)."""
    kinds = set()
    for name, m in dm.named_modules():
        if isinstance(m, QuantLinear):
            qw = m.quantized_weight()
            kinds.add((qw.format, qw.granularity, qw.block_size))
            continue
        if getattr(m, "layout_type", None) is not None and _native_qweight(m) is not None:
            kinds.add((Precision.FP8_E4M3FN, Granularity.PER_TENSOR, 64))
            continue
        for pname, p in m.named_parameters(recurse=False):
            if not is_plain(p):
                return None, f"{name}.{pname} is a {type(p).__name__}, which QuantizeDiT does not write"
            if p.dtype in CODE_DTYPES:
                return None, f"{name}.{pname} holds {p.dtype} codes outside a quantized layer QuantizeDiT writes"
    if len(kinds) != 1:
        found = ", ".join(sorted(f"{f} {g}" for f, g, _ in kinds)) or "none"
        return None, f"its quantized layers do not share one format and granularity (found: {found})"
    fmt, gran, block = kinds.pop()
    return QuantConfig(fmt, gran, block_size=block), ""


def _native_qweight(m) -> QuantizedWeight | None:
    """QuantizedWeight view of a ComfyUI native fp8 e4m3fn per-tensor layer (comfy-kitchen QuantizedTensor); None
    for its other layouts (e5m2, int8 tensorwise, nvfp4, mxfp8: other codes, block scales), which a file labelled
    e4m3fn per tensor would make the stock loader read silently wrong."""
    w = m.weight
    qdata, params = getattr(w, "_qdata", None), getattr(w, "_params", None)
    if qdata is None or params is None:
        return None
    scale = getattr(params, "scale", None)
    if (getattr(m, "quant_format", "float8_e4m3fn") != "float8_e4m3fn" or qdata.dtype != torch.float8_e4m3fn
            or not isinstance(scale, torch.Tensor) or scale.numel() != 1
            or getattr(params, "block_scale", None) is not None):
        return None
    return QuantizedWeight(Precision.FP8_E4M3FN, Granularity.PER_TENSOR, 64, tuple(qdata.shape),
                           {"weight": qdata, "weight_scale": params.scale.float().reshape(())})


def resolve_save_path(save_path: str, create: bool = True) -> str:
    """Relative names go to ComfyUI's diffusion_models folder (``models/diffusion_models`` where it exists, else the
    first folder registered for it: ``models/unet`` on older installs), so UNETLoader lists the file; their
    subfolders are created there, as ComfyUI's save nodes create theirs. Checked before any work is done, and with
    ``create=False`` at prompt validation, before anything runs."""
    import os

    path = save_path.strip()
    name = os.path.basename(path)
    if not name or name in (".", "..") or name == ".safetensors":
        raise ConfigError("save_path", save_path, "a file name (a folder may come before it)",
                          "e.g. 'flux1-dev-fp8' or 'levers/flux1-dev-fp8'; '.safetensors' is added when missing.")
    if not path.endswith(".safetensors"):
        path += ".safetensors"
    if os.path.isabs(path):
        full = path
    else:
        import folder_paths
        folders = folder_paths.get_folder_paths("diffusion_models")
        existing = [f for f in folders if os.path.isdir(f)]
        named = [f for f in existing if os.path.basename(os.path.normpath(f)) == "diffusion_models"]
        base = (named or existing or folders)[0]
        full = os.path.abspath(os.path.join(base, path))
        if os.path.commonpath([full, os.path.abspath(base)]) != os.path.abspath(base):
            raise ConfigError("save_path", save_path, f"a name inside {base}",
                              "A relative save_path is placed under ComfyUI's diffusion_models folder and may not "
                              "leave it ('..'); give an absolute path to write elsewhere.")
        parent = os.path.dirname(full)
        above = parent
        while not os.path.exists(above):
            above = os.path.dirname(above)
        if not os.path.isdir(above):
            raise ConfigError("save_path", save_path, "a name whose folders can be made",
                              f"{above} is a file, not a folder.")
        if create:
            os.makedirs(parent, exist_ok=True)   # a fresh --base-directory may not have it yet
        elif not os.path.isdir(parent):
            return full                          # created when the node runs
    try:
        qckpt.check_output_path(full, force=False)
    except FileExistsError:
        raise FileExistsError(f"save_path: {full} exists; QuantizeDiT never overwrites a file: give a new "
                              "save_path") from None
    return full


def save_path_problem(save_path) -> str | None:
    """Why ``save_path`` cannot be written (None when it can, or when it is empty or linked), for ComfyUI's
    validation: a bad path is refused before the loader and the quantization run. A file that exists already is
    left to the run: ComfyUI validates every node of every queued prompt, and once the first run wrote the file a
    re-queue that does not re-run this (cached) node would be refused."""
    if not isinstance(save_path, str) or not save_path.strip():
        return None
    try:
        resolve_save_path(save_path, create=False)
    except FileExistsError:
        return None
    except (ConfigError, OSError) as exc:
        return str(exc)
    return None


def plan_for_another_family(plan, model) -> str:
    """A note when ``plan`` was made for a model of another family than ``model`` (a plan wired from another
    graph: its format and modulation choices were sized for that model), else ""."""
    if plan is None or not isinstance(getattr(plan, "model", None), str):
        return ""
    from ..core.errors import LeversError
    from ..core.presets import get_preset
    from .recommend import _family

    preset = plan.model.split(" (")[0]
    try:
        planned = get_preset(preset).family
        family, detected = _family(model)
    except (LeversError, AttributeError, KeyError):
        return ""
    # the family, or the preset Recommend plans this model from (HiDream-O1: HunyuanImage 2.1's geometry)
    if family == "custom" or planned == family or preset == detected:
        return ""
    return (f"the plan was made for {preset} (a {planned} model) and this is a {family} model: "
            "its format and modulation choices were sized for that one; connect this model to Recommend for its own "
            "plan")


def choose_format(fmt: str, plan, saving: bool = False) -> tuple[str | None, list[str]]:
    """The node's format: ``auto`` takes the plan's diffusion-model precision; a plan that keeps it 16-bit passes the
    model through (None), unless a file is to be saved; without a plan, fp8. Missing backends fall back to fp8. A
    format set on the node wins, with a note when the connected plan says otherwise."""
    notes = []
    planned = plan.diffusion_model.precision if plan is not None else None
    if fmt != "auto":
        if planned is not None and str(planned) != fmt:
            notes.append(f"format {fmt} (set on the node) differs from the plan's {planned}: the node's setting wins; "
                         "format = auto follows the plan")
        return fmt, notes
    chosen = "fp8_e4m3fn"
    if planned is not None:
        if planned.is_quantized:
            chosen = str(planned)
            notes.append(f"format auto: {chosen} from the plan")
        elif not saving:
            return None, [f"format auto: the plan keeps the diffusion model in {planned}, so it passes through "
                          "unquantized; set a format to quantize anyway"]
        else:
            notes.append(f"format auto: the plan keeps {planned}; saving fp8_e4m3fn, the smallest near-lossless")
    ok, why = get_quantizer(chosen).available()
    if not ok:
        notes.append(f"format auto: {chosen} unavailable ({why}); fell back to fp8_e4m3fn")
        chosen = "fp8_e4m3fn"
    return chosen, notes


def choose_modulation(modulation: str, plan, notes: list[str]) -> bool:
    """Whether the modulation linears are quantized: ``quantize`` / ``keep``, or on ``auto`` the plan's choice
    (a plan quantizes them only when that is what makes the model fit), else keep."""
    choice = (modulation or "auto").strip().lower()
    if choice not in ("auto", "keep", "quantize"):
        raise ConfigError("modulation", modulation, "auto, keep or quantize")
    if choice != "auto":
        return choice == "quantize"
    planned = bool(plan is not None and getattr(plan.diffusion_model, "quantize_modulation", False))
    if planned:
        notes.append("modulation auto: quantized, as the plan says (its report says why)")
    return planned


# context width of the text conditioning, by the unet_config key each architecture family uses
_CONTEXT_KEYS = ("context_dim", "text_dim", "context_in_dim", "joint_attention_dim", "text_states_dim", "cap_feat_dim",
                 "context_embedder_config", "in_text_dim", "text_in_dim", "cond_seq_dim", "text_embed_dim",
                 "crossattn_emb_channels", "text_feat_dim", "llm_features_dim")
# ... the last seven: Kandinsky 5, ERNIE-Image, AuraFlow, CogVideoX, Cosmos-Predict2, OmniGen2, Ideogram 4
QUALITY_BAR_DB = 35.0  # the bar for fp8 and int8 (invisible on real models); nf4 is reported against it


class QualityCheckSkipped(Exception):
    """The architecture cannot be driven with a synthetic input; the report says why."""


def _synthetic_inputs(patcher, seed: int = 0, tokens: int = 8, side: int = 8):
    """(x, sigma, context, extra conds) for one forward: a tiny latent of the model's own format."""
    model = patcher.model
    lf = getattr(model, "latent_format", None)
    channels = getattr(lf, "latent_channels", None)
    dims = getattr(lf, "latent_dimensions", 2)
    if not channels:
        raise QualityCheckSkipped("the model's latent format has no channel count")
    if dims == 3:
        shape = (1, channels, 1, side, side)                                 # (B, C, T=1 frame, H, W)
    elif dims == 2:
        shape = (1, channels, side, side)                                    # (B, C, H, W)
    else:
        raise QualityCheckSkipped(f"{dims}-D latents (audio/1-D models) are not driven by the check")
    unet_config = getattr(model.model_config, "unet_config", {}) or {}
    width = next((unet_config[k] for k in _CONTEXT_KEYS if isinstance(unet_config.get(k), int)), None)
    captions = unet_config.get("caption_channels")
    if width is None and isinstance(captions, (list, tuple)) and captions:
        width = captions[0]                                # HiDream: T5 width first, then Llama's
    if width is None and isinstance(captions, int):
        width = captions                                   # PixArt: the T5 width
    if width is None and isinstance(unet_config.get("txtdim"), int) and isinstance(unet_config.get("txtlayers"), int):
        width = unet_config["txtdim"] * unet_config["txtlayers"]   # Krea 2: the text encoder's layers side by side
    if width is None:
        width = _context_width_from_layers(model.diffusion_model)
    if width is None:
        raise QualityCheckSkipped("the text-context width is neither in the model config "
                                  f"({', '.join(_CONTEXT_KEYS)}) nor readable from a text-input layer")
    dm = model.diffusion_model
    if callable(getattr(dm, "separate_audio_and_video_latents", None)):
        # LTX-2 (audio-video) takes the video and the audio context side by side: each the caption width (LTX-2.0),
        # or, when the caption projection runs before the text connectors (LTX-2.3), each its stream's width
        if getattr(dm, "caption_proj_before_connector", False):
            width = int(dm.cross_attention_dim + dm.audio_cross_attention_dim)
        else:
            width = int(getattr(dm, "caption_channels", width)) * 2
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    context = torch.randn(1, tokens, width, generator=g)
    sigma = torch.tensor([float(model.model_sampling.percent_to_sigma(0.5))])
    extra = {}
    adm = getattr(model, "adm_channels", 0) or 0
    vec = unet_config.get("vec_in_dim")
    if adm:  # SDXL-style pooled vector
        extra["y"] = torch.randn(1, adm, generator=g)
    elif isinstance(vec, int) and vec > 0:  # Flux-style pooled text vector (HunyuanVideo requires it)
        extra["y"] = torch.randn(1, vec, generator=g)
    if _required_argument(model.diffusion_model, "guidance"):   # Chroma takes a guidance value, unused or not
        extra["guidance"] = torch.full((1,), 3.5)
    return x, sigma, context, extra


def _required_argument(module, name: str) -> bool:
    import inspect

    try:
        param = inspect.signature(module.forward).parameters.get(name)
    except (TypeError, ValueError):
        return False
    return param is not None and param.default is inspect.Parameter.empty


# the first layer that reads the text context, per architecture family (its in_features is the width)
_CONTEXT_LAYERS = ("text_embedding.0", "txt_in.input_embedder", "txt_in", "context_embedder", "cap_embedder.1",
                   "caption_projection.linear_1")


def _context_width_from_layers(dm) -> int | None:
    for name in _CONTEXT_LAYERS:
        try:
            layer = dm.get_submodule(name)
        except AttributeError:
            continue
        width = getattr(layer, "in_features", None)
        if isinstance(width, int):
            return width
    for name, m in dm.named_modules():  # UNets: the cross-attention key projection
        if name.endswith(("attn2.to_k", "cross_attn.k")) and isinstance(getattr(m, "in_features", None), int):
            return m.in_features
    return None


def _conds_from_model(patcher, inputs, seed: int = 0):
    """The same inputs with the extra conditions built by the model's own ``extra_conds``, as ComfyUI's sampler
    builds them (attention masks, token counts, frame rates, pooled vectors...): for architectures whose forward
    needs more than the text context. The text's attention mask is all ones."""
    x, sigma, context, _ = inputs
    model = patcher.model
    unet_config = getattr(model.model_config, "unet_config", {}) or {}
    g = torch.Generator().manual_seed(seed + 1)
    kwargs = dict(cross_attn=context, attention_mask=torch.ones(1, context.shape[1], dtype=torch.long), noise=x,
                  device=torch.device("cpu"), latent_image=x, latent_shapes=[x.shape])   # as the sampler passes
    pooled = next((unet_config[k] for k in ("vec_in_dim", "adm_in_channels", "text_emb_dim", "pooled_projection_dim",
                                            "in_text_dim2") if isinstance(unet_config.get(k), int)), None)
    # no pooled vector: passed as None, as ComfyUI's text encoders do (HunyuanVideo 1.5 reads the key)
    kwargs["pooled_output"] = torch.randn(1, pooled, generator=g) if pooled else None
    captions, llama = unet_config.get("caption_channels"), unet_config.get("llama_layers")
    if isinstance(captions, (list, tuple)) and len(captions) > 1 and llama:
        kwargs["conditioning_llama3"] = torch.randn(1, max(llama) + 1, context.shape[1], captions[1], generator=g)
    conds = model.extra_conds(**kwargs)
    extra = {k: v.cond for k, v in conds.items() if k != "c_crossattn"}
    return x, sigma, context, extra


def _predict(patcher, inputs) -> torch.Tensor:
    """The network's contribution ``x - denoised`` for one forward on the patcher's load device."""
    import comfy.model_management as mm

    x, sigma, context, extra = inputs
    mm.load_models_gpu([patcher])
    dev = patcher.load_device
    with torch.inference_mode():
        denoised = patcher.model.apply_model(x.to(dev), sigma.to(dev), c_crossattn=context.to(dev),
                                             **{k: v.to(dev) if isinstance(v, torch.Tensor) else v
                                                for k, v in extra.items()})
    # x is the same in both runs; subtracting it leaves what the weights produced (sigma * prediction)
    return (x.to(dev) - denoised.float()).cpu()


def quality_check(original, quantized, fmt: str, seed: int = 0) -> tuple[float | None, str]:
    """(PSNR dB | None, report line): the quantized model's prediction vs the original's, same input."""
    from ..core.quant.metrics import psnr

    try:
        inputs = _synthetic_inputs(original, seed)
        try:
            ref = _predict(original, inputs)
        except (RuntimeError, TypeError, ValueError, KeyError, IndexError, AttributeError, ArithmeticError):
            # the forward needs conditions beyond the text context: the model's own extra_conds build them
            try:
                inputs = _conds_from_model(original, inputs, seed)
                ref = _predict(original, inputs)
            except ArithmeticError:
                # PixArt sizes its positional embedding from the resolution rounded to 64 latent pixels: 0 at 8x8
                inputs = _conds_from_model(original, _synthetic_inputs(original, seed, side=64), seed)
                ref = _predict(original, inputs)
        out = _predict(quantized, inputs)
    except QualityCheckSkipped as exc:
        return None, f"quality check skipped: {exc}"
    except (RuntimeError, TypeError, ValueError, KeyError, IndexError, AttributeError, ArithmeticError) as exc:
        # fail soft: an architecture that needs conditioning we do not synthesise must not fail the node
        return None, f"quality check skipped: one forward with a synthetic input failed ({type(exc).__name__}: {exc})"
    score = psnr(ref, out)
    shape = "x".join(str(d) for d in inputs[0].shape)
    line = (f"quality check: output PSNR {score:.1f} dB vs the original (one forward, {shape} latent, seed {seed}, "
            f"same noise and context)")
    if score < QUALITY_BAR_DB:
        expected = " (expected for 4-bit)" if str(fmt) == "nf4" else \
            "; keep more layers (keep_first_blocks / keep_last_blocks / extra_skip) or use a finer granularity"
        line += f"\n  below the {QUALITY_BAR_DB:.0f} dB bar that fp8 and int8 are held to{expected}"
    else:
        line += f"\n  meets the {QUALITY_BAR_DB:.0f} dB bar that fp8 and int8 are held to"
    return score, line


def quantize_node(model, fmt: str = "auto", granularity: str = "auto", keep_first_blocks: int = 0,
                  keep_last_blocks: int = 0, extra_skip: str = "", plan=None, save_path: str = "",
                  quality_check_enabled: bool = True, modulation: str = "auto"):
    """Everything LeversQuantizeDiT does: returns (MODEL, report text)."""
    saving = bool(save_path and save_path.strip())
    chosen, notes = choose_format(fmt, plan, saving)
    qmod = choose_modulation(modulation, plan, notes)
    mismatch = plan_for_another_family(plan, model)
    if mismatch:
        notes.append(mismatch)
    if chosen is None:          # auto on a 16-bit plan: nothing to do, and the report says so
        require_model(model)
        if qmod:
            notes.append("modulation = quantize has nothing to apply: the model is not quantized")
        return model, "QuantizeDiT: passed through unchanged\n" + "\n".join(f"  note: {n}" for n in notes)
    path = resolve_save_path(save_path) if saving else None   # before any work
    gran = granularity
    if gran == "auto" and chosen == "fp8_e4m3fn":
        # ComfyUI's own fp8 layer when it has one (its LoRA / offload / fp8-matmul paths), else per row
        gran = "per_tensor" if native_fp8_available()[0] else "per_row"
    config = QuantConfig(chosen, None if gran == "auto" else gran, keep_first_blocks=int(keep_first_blocks),
                         keep_last_blocks=int(keep_last_blocks), extra_skip=extra_skip or (),
                         quantize_modulation=qmod)
    require_model(model)
    from ..core.quant.census import census as run_census
    dm = model.model.diffusion_model
    kept = None if is_quantized_module(dm) else run_census(dm, config=config)
    if kept is not None and not kept.quantized:
        # the settings keep every layer (keep_* over all blocks, an extra_skip that matches everything): the input
        # is what the user gets, not a full-precision copy labelled quantized (found in review); decided before
        # the model is copied
        why = ("the settings keep every layer (lower keep_first_blocks / keep_last_blocks, or narrow extra_skip)"
               if config.keep_first_blocks or config.keep_last_blocks or config.extra_skip else
               f"the census found no layer {config.format} may take (below)")
        if path is not None:
            # a file was asked for: a success that saved nothing would read as done (headless: exit 0)
            raise ConfigError("save_path", save_path, "settings that quantize at least one layer",
                              f"Nothing to save: {why}; or clear save_path to pass the model through.")
        text = "\n".join([f"QuantizeDiT: nothing quantized, the model passes through unchanged: {why}",
                           *(f"  note: {n}" for n in notes), kept.format_text()])
        return model, text
    new, report = quantize_patcher(model, config)
    report.notes[:0] = notes
    passed = new is model
    # after PhaseOffload: the copy carried its component, which describes the input model; the quantized model runs
    # unmanaged through the quality check and the save, then takes the input's place in the PhaseOffload group
    from .phase import detach_for_new_model, manage_new_model
    phase_comp = None if passed else detach_for_new_model(new)
    text = (report.format_text() if not passed else
            f"QuantizeDiT: passed through unchanged; the requested {config.format} {config.granularity} was not "
            "applied\n" + "\n".join(f"  note: {n}" for n in report.notes))
    if not passed:
        if quality_check_enabled:
            text += "\n  " + quality_check(model, new, config.format)[1]
        text += "\n" + kept.format_text()
    elif quality_check_enabled:
        text += "\n  quality check skipped: the input is already quantized (nothing to compare)"
    if path is not None:
        text = _save(model, new, path, config, report, text, passed)
    if phase_comp is not None:
        text += "\n  note: " + manage_new_model(phase_comp, new)
    return new, text


def _save(model, new, path, config: QuantConfig, report, text: str, passed: bool) -> str:
    """Save ``new`` to ``path`` (QuantizeDiT's save_path); the report text with what was saved, or why not."""
    held = config
    if passed:    # the file says what the model holds, not what this node was asked for
        held, why = held_config(model.model.diffusion_model)
        if held is None:
            line = (f"not saved: the input passed through as already quantized, and {why}. Set save_path on the "
                    "QuantizeDiT that quantized it, or quantize the original file with `levers quantize`")
            log.warning("levers: QuantizeDiT %s", line)
            return f"{text}\n{line}"
        text += f"\n  saved as the model holds it: {held.format} {held.granularity}"
    # the quality check (or an earlier run) loaded it through ComfyUI, which merged the patcher's LoRA into the
    # weights: unloaded first, so the file holds the base weights its report promises
    unload_entries_of(new.model)
    arch = report.arch
    if passed:      # the report's "(already quantized)" is no architecture: the file names the model's
        from ..core.quant import detect_arch
        arch = detect_arch(new.model.diffusion_model.state_dict().keys())
    save_quantized(new, path, held, arch)
    loadable = (stock_loader_reads_comfy_fp8()[1] if qckpt.uses_comfy_layout(held) else
                "nf4 in bitsandbytes' layout: load it with Load Quantized DiT (Levers); the stock Load Diffusion "
                "Model fails on it" if str(held.format) == "nf4" else
                "Levers layout: load it with Load Quantized DiT (Levers); the stock Load Diffusion Model "
                "reads it without its scales, with wrong output and no error; see the README, QuantizeDiT: "
                "File layouts")
    text += f"\nsaved: {path} ({loadable})"
    if model.patches:
        # the file holds the module's tensors: ComfyUI keeps a LoRA as patches on the patcher, applied at load
        text += (f"\n  note: the input's weight patches ({len(model.patches)} weights, a LoRA or other model "
                 "patch) are not in the file: it holds the base weights quantized; apply the same LoRA after "
                 "the loader, or quantize before the LoRA")
    return text
