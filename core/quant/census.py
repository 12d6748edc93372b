"""Which weights a quantizer may touch, per architecture, decided from state-dict key names.

Everything outside the repeated transformer blocks (patch/text/time embedders, the final layer,
the head) stays in the compute dtype, and so do adaLN/modulation linears and norms inside the
blocks: they set the scale of every activation and their error is amplified step after step.
What is quantized is the attention projections and the MLPs of the blocks, which hold >95% of the
bytes. ``keep_first_blocks`` / ``keep_last_blocks`` (execution order) and ``extra_skip`` widen the
kept set. ``quantize_modulation`` narrows it: the modulation linears inside the blocks are quantized
too (about 27% of FLUX's and a third of Qwen-Image's parameters), for cards where only that fits.
"""
from __future__ import annotations

import fnmatch
import math
import re
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Iterable, Mapping

import torch

from .registry import Granularity, QuantConfig, get_quantizer

MIN_QUANT_NUMEL = 4096  # smaller matrices save nothing worth the error

_PREFIXES = ("model.diffusion_model.", "diffusion_model.", "model.model.", "transformer.", "model.", "net.", "unet.")


@dataclass(frozen=True)
class ArchRules:
    """Name rules for one architecture. Regexes match the layer name (key without ``.weight``)."""

    name: str
    detect: tuple[str, ...]                   # every one must match some key
    blocks: tuple[str, ...]                   # block patterns in execution order; group 1 = index
    quantize: tuple[str, ...]                 # layers inside blocks that may be quantized
    skip: tuple[tuple[str, str], ...] = ()    # (regex, reason), checked first
    reject: tuple[str, ...] = ()              # detection fails if any of these match a key


_MOD = ("(^|\\.)(img_mod|txt_mod|modulation|adaLN_modulation|norm1_context|norm1|modC|modX|modCX|"
        "text_modulation|visual_modulation)\\.(lin|linear|0|1|out_layer)$",   # ..., AuraFlow, Kandinsky 5, Z-Image
        "adaLN / modulation linear (scales every activation)")
_EMB = ("(^|\\.)(emb_layers|time_emb|time_embedding|t_embedder)(\\.|$)", "time-embedding projection")

ARCHS: tuple[ArchRules, ...] = (
    ArchRules(
        name="chroma",
        detect=(r"^distilled_guidance_layer\.", r"^double_blocks\.\d+\.img_attn\.qkv\.weight$"),
        blocks=(r"^double_blocks\.(\d+)\.", r"^single_blocks\.(\d+)\."),
        quantize=(r"\.(img|txt)_attn\.(qkv|proj)$", r"\.(img|txt)_mlp\.(0|2)$", r"^single_blocks\.\d+\.linear(1|2)$"),
        skip=(_MOD,),
    ),
    ArchRules(
        name="hunyuan_video",
        detect=(r"^txt_in\.individual_token_refiner\.", r"^double_blocks\.\d+\.img_attn\.qkv\.weight$"),
        blocks=(r"^double_blocks\.(\d+)\.", r"^single_blocks\.(\d+)\."),
        quantize=(r"\.(img|txt)_attn\.(qkv|proj)$", r"\.(img|txt)_mlp\.(0|2|fc1|fc2)$",
                  r"^single_blocks\.\d+\.linear(1|2)$"),
        skip=(_MOD,),
    ),
    ArchRules(
        name="flux",
        detect=(r"^double_blocks\.\d+\.img_attn\.qkv\.weight$", r"^single_blocks\.\d+\.linear1\.weight$"),
        blocks=(r"^double_blocks\.(\d+)\.", r"^single_blocks\.(\d+)\."),
        quantize=(r"\.(img|txt)_attn\.(qkv|proj)$", r"\.(img|txt)_mlp\.(0|2)$", r"^single_blocks\.\d+\.linear(1|2)$"),
        skip=(_MOD,),
    ),
    ArchRules(
        name="krea2",        # text-fusion transformer (layer-wise, then refiner blocks) runs first, then the blocks
        detect=(r"^txtfusion\.projector\.weight$", r"^blocks\.\d+\.attn\.wq\.weight$"),
        blocks=(r"^txtfusion\.layerwise_blocks\.(\d+)\.", r"^txtfusion\.refiner_blocks\.(\d+)\.", r"^blocks\.(\d+)\."),
        # attn.gate is the sigmoid output gate's projection of the block input, a projection like wq
        quantize=(r"\.attn\.(wq|wk|wv|wo|gate)$", r"\.mlp\.(gate|up|down)$"),
        skip=(_MOD,),
    ),
    ArchRules(
        name="hidream_o1",   # a Qwen3-VL decoder over text tokens and 32x32 RGB patches; the vision tower stays
        detect=(r"^t_embedder1\.mlp\.0\.weight$", r"^language_model\.layers\.\d+\.self_attn\.q_proj\.weight$"),
        blocks=(r"^language_model\.layers\.(\d+)\.",),
        quantize=(r"\.self_attn\.(q_proj|k_proj|v_proj|o_proj)$", r"\.mlp\.(gate_proj|up_proj|down_proj)$"),
        skip=(_MOD,),
    ),
    ArchRules(
        name="wan",
        detect=(r"^blocks\.\d+\.self_attn\.q\.weight$", r"^(patch_embedding|head\.modulation)"),
        blocks=(r"^blocks\.(\d+)\.", r"^vace_blocks\.(\d+)\."),
        quantize=(r"\.(self_attn|cross_attn)\.(q|k|v|o|k_img|v_img)$", r"\.ffn\.(0|2)$",
                  r"^vace_blocks\.\d+\.(before_proj|after_proj)$"),
        skip=(_MOD,),
    ),
    ArchRules(
        name="qwen_image",
        detect=(r"^transformer_blocks\.\d+\.img_mod\.1\.weight$", r"^txt_norm\."),
        blocks=(r"^transformer_blocks\.(\d+)\.",),
        quantize=(r"\.attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out)$",
                  r"\.(img|txt)_mlp\.net\.(0\.proj|2)$"),
        skip=(_MOD,),
    ),
    ArchRules(
        name="ltxv",
        detect=(r"^adaln_single\.", r"^transformer_blocks\.\d+\.attn1\.to_q\.weight$"),
        blocks=(r"^transformer_blocks\.(\d+)\.",),
        quantize=(r"\.(attn1|attn2|audio_attn1|audio_attn2|audio_to_video_attn|video_to_audio_attn)"
                  r"\.(to_q|to_k|to_v|to_out\.0)$", r"\.(ff|audio_ff)\.net\.(0\.proj|2)$"),
        skip=(_MOD,),
    ),
    ArchRules(
        name="auraflow",     # joint (double) layers, then single layers
        detect=(r"^double_layers\.\d+\.attn\.w1q\.weight$", r"^single_layers\.\d+\."),
        blocks=(r"^double_layers\.(\d+)\.", r"^single_layers\.(\d+)\."),
        quantize=(r"\.attn\.w[12][qkvo]$", r"\.mlp[CX]?\.(c_fc1|c_fc2|c_proj)$"),
        skip=(_MOD,),
    ),
    ArchRules(
        name="sd3",
        detect=(r"^joint_blocks\.\d+\.x_block\.attn\.qkv\.weight$",),
        blocks=(r"^joint_blocks\.(\d+)\.",),
        quantize=(r"\.(x_block|context_block)\.(attn|attn2)\.(qkv|proj)$", r"\.(x_block|context_block)\.mlp\.(fc1|fc2)$"),
        skip=(_MOD,),
    ),
    ArchRules(
        name="hidream",
        detect=(r"^double_stream_blocks\.\d+\.block\.attn1\.to_q\.weight$", r"^single_stream_blocks\.\d+\."),
        blocks=(r"^double_stream_blocks\.(\d+)\.", r"^single_stream_blocks\.(\d+)\."),
        quantize=(r"\.attn1\.(to_q|to_k|to_v|to_out)(_t)?$", r"\.ff_(i|t)\.((shared_experts|experts\.\d+)\.)?w[123]$"),
        skip=(_MOD, (r"\.ff_i\.gate$", "MoE router (its top-k picks the experts: a rounding flips the choice)")),
    ),
    ArchRules(
        name="lumina",       # Lumina 2, Z-Image: refiners, then the main layers
        detect=(r"^layers\.\d+\.attention\.qkv\.weight$", r"^(context_refiner|noise_refiner|cap_embedder)\."),
        blocks=(r"^context_refiner\.(\d+)\.", r"^noise_refiner\.(\d+)\.", r"^layers\.(\d+)\."),
        quantize=(r"\.attention\.(qkv|out)$", r"\.feed_forward\.w[123]$"),
        skip=(_MOD,),
    ),
    ArchRules(
        name="omnigen2",     # context refiners, noise refiners, reference-image refiners (with references), layers
        detect=(r"^ref_image_refiner\.\d+\.", r"^layers\.\d+\.attn\.to_q\.weight$"),
        blocks=(r"^context_refiner\.(\d+)\.", r"^noise_refiner\.(\d+)\.", r"^ref_image_refiner\.(\d+)\.",
                r"^layers\.(\d+)\."),
        quantize=(r"\.attn\.(to_q|to_k|to_v|to_out\.0)$", r"\.feed_forward\.linear_[123]$"),
        skip=(_MOD,),        # norm1.linear: the adaLN projection
    ),
    ArchRules(
        name="sdxl_unet",
        detect=(r"^input_blocks\.\d+\.\d+\.transformer_blocks\.\d+\.attn1\.to_q\.weight$", r"^(label_emb|time_embed)\."),
        blocks=(r"^input_blocks\.(\d+)\.", r"^middle_block\.()", r"^output_blocks\.(\d+)\."),
        quantize=(r"\.transformer_blocks\.\d+\.(attn1|attn2)\.(to_q|to_k|to_v|to_out\.0)$",
                  r"\.transformer_blocks\.\d+\.ff\.net\.(0\.proj|2)$", r"\.\d+\.(proj_in|proj_out)$"),
        skip=(_EMB,),
    ),
)

_GENERIC_SKIP = (r"(^|[._])(norm\w*|ln\w*|embed\w*|emb|embedder|mod|modulation|adaLN\w*|adaln\w*|time\w*|"
                 r"final\w*|head|pos\w*|proj_out|patchify\w*|patch_embedding)($|[._])")
GENERIC = ArchRules(
    name="generic",
    detect=(),
    # any numbered list of blocks, layers or refiners; lists are told apart and ordered by their names (_list_rank)
    blocks=(r"^([A-Za-z_]*blocks|[A-Za-z_]*layers|[A-Za-z_]*refiner)\.(\d+)\.",),
    quantize=(r".",),
    skip=((_GENERIC_SKIP, "embedder / norm / modulation / final layer (generic rule)"),),
)

ARCH_NAMES = tuple(a.name for a in ARCHS) + ("generic",)


@dataclass(frozen=True)
class CensusEntry:
    key: str                       # the key as given (with any prefix)
    shape: tuple[int, ...] | None
    nbytes: int
    quantize: bool
    reason: str
    block: int | None = None       # ordinal of its block in execution order


@dataclass(frozen=True)
class Census:
    arch: str
    entries: tuple[CensusEntry, ...]
    n_blocks: int
    notes: tuple[str, ...] = ()
    _index: dict = field(default_factory=dict, compare=False, repr=False)

    def should_quantize(self, key: str) -> bool:
        if not self._index:
            self._index.update({e.key: e for e in self.entries})
        e = self._index.get(key)
        return bool(e and e.quantize)

    @property
    def quantized(self) -> tuple[CensusEntry, ...]:
        return tuple(e for e in self.entries if e.quantize)

    @property
    def kept(self) -> tuple[CensusEntry, ...]:
        return tuple(e for e in self.entries if not e.quantize)

    @property
    def quantized_bytes(self) -> int:
        return sum(e.nbytes for e in self.quantized)

    @property
    def kept_bytes(self) -> int:
        return sum(e.nbytes for e in self.kept)

    def kept_reasons(self) -> dict[str, int]:
        return dict(Counter(e.reason for e in self.kept).most_common())

    def format_text(self) -> str:
        mib = 1024 ** 2
        lines = [f"census ({self.arch}, {self.n_blocks} blocks): quantize {len(self.quantized)} tensors "
                 f"({self.quantized_bytes / mib:.1f} MiB), keep {len(self.kept)} ({self.kept_bytes / mib:.1f} MiB)"]
        lines += [f"  kept {n:4d}: {r}" for r, n in self.kept_reasons().items()]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


_DIFFUSION_PREFIXES = ("model.diffusion_model.", "diffusion_model.")


def strip_prefix(keys: Iterable[str]) -> str:
    """The wrapper prefix of the diffusion model's keys: ``model.diffusion_model.`` in a full checkpoint (as
    ComfyUI finds it, however many text-encoder and VAE keys the file also holds), else the prefix most keys
    share, or ''."""
    keys = list(keys)
    for p in _DIFFUSION_PREFIXES:
        if any(k.startswith(p) for k in keys):
            return p
    for p in _PREFIXES:
        if keys and sum(k.startswith(p) for k in keys) * 2 > len(keys):
            return p
    return ""


def detect_arch(keys: Iterable[str]) -> str:
    """Architecture name from state-dict key names ('generic' when nothing matches)."""
    keys = list(keys)
    prefix = strip_prefix(keys)
    names = [k[len(prefix):] for k in keys if k.startswith(prefix)] if prefix in _DIFFUSION_PREFIXES else \
        [k[len(prefix):] if k.startswith(prefix) else k for k in keys]
    for rules in ARCHS:
        if all(any(re.search(p, k) for k in names) for p in rules.detect):
            return rules.name
    return "generic"


# files that are not a diffusion model, by the keys only they hold: (what it is, key pattern)
# (the layouts comfy/lora.py and comfy/weight_adapter read: PEFT, kohya, diffusers' lora.up / lora_linear_layer,
# LyCORIS LoHa / LoKr / OFT / GLoRA and full diffs, ComfyUI's set_weight and w_norm patches)
_LORA_KEYS = re.compile(r"(\.|^)(lora_(A|B|up|down|mid)|lokr_w\d|hada_w\d|lora_te\d?_|lora_unet_|oft_)"
                        r"|(^|[._])lora[._](up|down)(\.|$)|\.lora_linear_layer\.|\.(a1|a2|b1|b2)\.weight$"
                        r"|\.diff_b?$|\.(set_weight|w_norm|b_norm)$")
_FOREIGN = (
    ("a text encoder (a language model's embed_tokens and numbered layers)",
     re.compile(r"(^|\.)(embed_tokens\.weight|layers\.\d+\.self_attn\.q_proj\.weight)$")),
    ("a text encoder (CLIP's text_model)", re.compile(r"(^|\.)text_model\.encoder\.layers\.\d+\.")),
    ("a text encoder (T5's encoder.block)", re.compile(r"(^|\.)encoder\.block\.\d+\.layer\.\d+\.")),
    ("a VAE (encoder.down / decoder.up)", re.compile(r"(^|\.)(encoder\.down|decoder\.up(_blocks)?)\.\d+\.")),
)


def not_a_diffusion_model(keys: Iterable[str], arch: str) -> str | None:
    """What a file that is no diffusion model is, from its keys (None when it may be one): a LoRA whatever the
    census found, a text encoder or VAE when no rule recognised the keys (the generic rule would quantize a
    language model's layers as if they were a DiT's blocks). A full checkpoint holds a text encoder and VAE
    beside its model.diffusion_model: not asked here."""
    keys = list(keys)
    lora = next((k for k in keys if _LORA_KEYS.search(k)), None)
    if lora is not None:
        return f"a LoRA (its key {lora!r})"
    if arch != "generic" or any(k.startswith("model.diffusion_model.") for k in keys):
        return None
    for what, pattern in _FOREIGN:
        hit = next((k for k in keys if pattern.search(k)), None)
        if hit is not None:
            return f"{what}: its key {hit!r}"
    return None


def _rules(arch: str) -> ArchRules:
    if arch == "generic":
        return GENERIC
    for r in ARCHS:
        if r.name == arch:
            return r
    raise ValueError(f"arch: unknown architecture {arch!r}; choose one of: auto, {', '.join(ARCH_NAMES)}")


def _shapes_of(source) -> dict[str, tuple[tuple[int, ...] | None, int]]:
    """{key: (shape or None, nbytes)} from a Module, a state dict, {key: shape} or a list of keys."""
    if isinstance(source, torch.nn.Module):
        source = source.state_dict(keep_vars=True)
    if isinstance(source, Mapping):
        out = {}
        for k, v in source.items():
            if isinstance(v, torch.Tensor):
                out[k] = (tuple(v.shape), v.numel() * v.element_size())
            elif isinstance(v, (tuple, list, torch.Size)):
                out[k] = (tuple(v), 2 * math.prod(v))  # assume bf16 when only a shape is given
            else:
                out[k] = (None, 0)
        return out
    return {k: (None, 0) for k in source}


def _block_of(name: str, rules: ArchRules) -> tuple[int, str, int] | None:
    """(pattern index, block list, index in it): the list is the text before the index (the generic rule's
    pattern matches several lists, e.g. Kandinsky 5's text then visual blocks)."""
    for gi, pat in enumerate(rules.blocks):
        m = re.search(pat, name)
        if m:
            idx = m.group(m.lastindex) if m.lastindex else ""
            return gi, name[:m.start(m.lastindex)] if m.lastindex else "", int(idx) if idx else 0
    return None


# words in a block list's name that say it runs before (after) the model's other lists: FLUX's double before its
# single blocks, a text or context stream, refiners and an encoder's down path before the rest
_RUNS_FIRST = {"double", "joint", "text", "txt", "context", "refiner", "input", "down", "encoder"}
_RUNS_LAST = {"single", "output", "up", "decoder"}


def _list_rank(name: str) -> int:
    words = set(re.split(r"[._]", name.lower()))
    return 0 if words & _RUNS_FIRST else 2 if words & _RUNS_LAST else 1


def _extra_skip_match(name: str, patterns: tuple[str, ...]) -> str | None:
    for p in patterns:
        if any(c in p for c in "*?[") and fnmatch.fnmatchcase(name, p):
            return p
        if p in name:
            return p
    return None


def census(source, arch: str | None = None, config: QuantConfig | None = None) -> Census:
    """Decide, for every tensor of ``source``, quantize or keep, with the reason.

    ``source``: an nn.Module, a state dict, {key: shape}, or key names (then shapes are unknown and
    only names decide). ``arch``: None/'auto' detects from the keys.
    """
    shapes = _shapes_of(source)
    prefix = strip_prefix(shapes)
    names = {k: (k[len(prefix):] if k.startswith(prefix) else k) for k in shapes}
    # a full checkpoint: what is not under the diffusion model's prefix is its text encoders and VAE
    outside = {k for k in shapes if not k.startswith(prefix)} if prefix in _DIFFUSION_PREFIXES else set()
    arch = detect_arch(shapes) if arch in (None, "", "auto") else arch
    rules = _rules(arch)
    notes = []
    if arch == "generic":
        notes.append("architecture not recognised: generic rule (2-D weights inside numbered blocks, "
                     "minus embedders / norms / modulation / final layers)")

    found = [b for k, n in names.items() if k not in outside and (b := _block_of(n, rules)) is not None]
    # execution order: the rule's patterns in order; within one pattern, the lists by their names (never by the
    # order the keys come in: a file lists them sorted, a module as registered, and keep_first_blocks must mean
    # the same blocks for `levers quantize` and QuantizeDiT), then the index
    block_ids = sorted(set(found), key=lambda b: (b[0], _list_rank(b[1]), b[1], b[2]))
    lists = list(dict.fromkeys(lst for _, lst, _ in block_ids))
    if arch == "generic" and len(lists) > 1:
        counts = {lst: sum(1 for b in block_ids if b[1] == lst) for lst in lists}
        notes.append("generic rule: block lists taken in this order (keep_first_blocks / keep_last_blocks count "
                     "along it): " + ", ".join(f"{lst.rstrip('.')} ({counts[lst]})" for lst in lists))
    ordinal = {b: i for i, b in enumerate(block_ids)}
    n_blocks = len(block_ids)
    keep_first = config.keep_first_blocks if config else 0
    keep_last = config.keep_last_blocks if config else 0
    extra = config.extra_skip if config else ()
    qmod = bool(config and config.quantize_modulation)
    quantizer = get_quantizer(config.format) if config else None
    gran = config.granularity if config else Granularity.PER_ROW
    bsize = config.block_size if config else 64

    entries = []
    for key, (shape, nbytes) in shapes.items():
        if key in outside:
            entries.append(CensusEntry(key, shape, nbytes, False,
                                       f"outside the diffusion model ({prefix}*): text encoder or VAE", None))
            continue
        name = names[key]
        layer = name[: -len(".weight")] if name.endswith(".weight") else None
        b = _block_of(name, rules)
        blk = ordinal[b] if b is not None else None

        def keep(reason):
            entries.append(CensusEntry(key, shape, nbytes, False, reason, blk))

        if layer is None:
            keep("not a weight (bias, scale, buffer)")
            continue
        if shape is not None and len(shape) != 2:
            keep("not a matrix (norm, conv or modulation table)")
            continue
        hit = _extra_skip_match(layer, extra)
        if hit is not None:
            keep(f"extra_skip '{hit}'")
            continue
        modulation = qmod and blk is not None and re.search(_MOD[0], layer) is not None
        skipped = None if modulation else next((reason for pat, reason in rules.skip if re.search(pat, layer)), None)
        if skipped:
            keep(skipped)
            continue
        if blk is None:
            keep("outside the blocks (embedder, final layer, head)")
            continue
        if not modulation and not any(re.search(p, layer) for p in rules.quantize):
            keep(f"not a quantizable projection in the {arch} census")
            continue
        if shape is not None and math.prod(shape) < MIN_QUANT_NUMEL:
            keep(f"smaller than {MIN_QUANT_NUMEL} weights")
            continue
        if shape is not None and quantizer is not None:
            ok, why = quantizer.supports_shape(shape, gran, bsize)
            if not ok:
                keep(f"shape not supported by {config.format}: {why}")
                continue
        entries.append(CensusEntry(key, shape, nbytes, True, "quantize (modulation linear)" if modulation
                                   else "quantize", blk))
    # keep_first / keep_last count the blocks that hold a layer to quantize, in execution order (an SDXL UNet's
    # first input blocks are convolutions only: keep_first_blocks=1 keeps its first block with attention)
    held = sorted({e.block for e in entries if e.quantize})
    kept_blocks = {b: f"keep_first_blocks={keep_first}" for b in held[:keep_first]}
    kept_blocks.update({b: f"keep_last_blocks={keep_last}" for b in held[max(0, len(held) - keep_last):] if keep_last})
    if kept_blocks:
        entries = [replace(e, quantize=False, reason=kept_blocks[e.block]) if e.quantize and e.block in kept_blocks
                   else e for e in entries]
    if held and len(kept_blocks) == len(held):
        notes.append(f"keep_first_blocks={keep_first} and keep_last_blocks={keep_last} keep all {len(held)} blocks "
                     "that hold layers to quantize: nothing is quantized")
    layers = [names[k][: -len(".weight")] for k in shapes if k not in outside and names[k].endswith(".weight")]
    for p in extra:
        if _extra_skip_match_any(layers, p) is None:
            notes.append(f"extra_skip '{p}' matched no layer (a part of a layer name, case-sensitive, e.g. "
                         f"'{_example_layer(entries, names)}', or a pattern with * ? [ ])")
    return Census(arch=arch, entries=tuple(entries), n_blocks=n_blocks, notes=tuple(notes))


def _extra_skip_match_any(layers: list[str], pattern: str) -> str | None:
    return next((n for n in layers if _extra_skip_match(n, (pattern,)) is not None), None)


def _example_layer(entries, names: dict[str, str]) -> str:
    """A quantized layer's name (what extra_skip patterns match), for the note."""
    e = next((e for e in entries if e.quantize), None) or next((e for e in entries if e.key in names), None)
    if e is None:
        return "blocks.0.attn"
    n = names[e.key]
    return n[: -len(".weight")] if n.endswith(".weight") else n
