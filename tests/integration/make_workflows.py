"""Regenerate example_workflows/ (UI + API format), the recorded /object_info fixture and the node
reference in README.md from a real ComfyUI's /object_info.

    COMFYUI_PATH=/path/to/ComfyUI python tests/integration/make_workflows.py      # starts one
    python tests/integration/make_workflows.py --server http://127.0.0.1:8188     # or uses yours

The graphs are declared below with node types, widget values by input name and links by output
name; the schema decides widget order, slot indices, control-after-generate values and sizes, so
a node schema change shows up as a clear error here instead of a silently broken template. A
development tool, not shipped.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

from comfyui_levers.core.client import ComfyClient, InputSpec, input_specs, ui_to_api, validate_api  # noqa: E402

EXAMPLES = ROOT / "example_workflows"
FIXTURE = ROOT / "tests" / "fixtures" / "object_info_workflows.json"
DOC = ROOT / "README.md"
LEVERS_NODES = ("LeversRecommend", "LeversQuantizeDiT", "LeversLoadQuantizedDiT", "LeversPhaseOffload", "LeversGroupPrefetch",
                "LeversTiledVAEDecode")

# Where users get the files the graphs name (the frontend offers these downloads when missing).
MODEL_URLS = {
    "flux1-dev.safetensors": ("diffusion_models",
                              "https://huggingface.co/Comfy-Org/flux1-dev/resolve/main/flux1-dev.safetensors"),
    "t5xxl_fp16.safetensors": ("text_encoders", "https://huggingface.co/comfyanonymous/flux_text_encoders/"
                                                "resolve/main/t5xxl_fp16.safetensors?download=true"),
    "clip_l.safetensors": ("text_encoders", "https://huggingface.co/comfyanonymous/flux_text_encoders/resolve/"
                                            "main/clip_l.safetensors?download=true"),
    "ae.safetensors": ("vae", "https://huggingface.co/Comfy-Org/HiDream-I1_ComfyUI/resolve/main/split_files/vae/"
                              "ae.safetensors?download=true"),
    "wan2.1_t2v_14B_bf16.safetensors": ("diffusion_models", "https://huggingface.co/Comfy-Org/Wan_2.1_ComfyUI_"
                                        "repackaged/resolve/main/split_files/diffusion_models/"
                                        "wan2.1_t2v_14B_bf16.safetensors?download=true"),
    "umt5_xxl_fp8_e4m3fn_scaled.safetensors": ("text_encoders", "https://huggingface.co/Comfy-Org/Wan_2.1_ComfyUI_"
                                               "repackaged/resolve/main/split_files/text_encoders/"
                                               "umt5_xxl_fp8_e4m3fn_scaled.safetensors?download=true"),
    "wan_2.1_vae.safetensors": ("vae", "https://huggingface.co/Comfy-Org/Wan_2.1_ComfyUI_repackaged/resolve/main/"
                                       "split_files/vae/wan_2.1_vae.safetensors"),
    "wan2.2_t2v_high_noise_14B_fp8_scaled.safetensors": ("diffusion_models", "https://huggingface.co/Comfy-Org/"
                                                         "Wan_2.2_ComfyUI_Repackaged/resolve/main/split_files/"
                                                         "diffusion_models/wan2.2_t2v_high_noise_14B_fp8_scaled."
                                                         "safetensors"),
    "wan2.2_t2v_low_noise_14B_fp8_scaled.safetensors": ("diffusion_models", "https://huggingface.co/Comfy-Org/"
                                                        "Wan_2.2_ComfyUI_Repackaged/resolve/main/split_files/"
                                                        "diffusion_models/wan2.2_t2v_low_noise_14B_fp8_scaled."
                                                        "safetensors"),
    "sd_xl_base_1.0.safetensors": ("checkpoints", "https://huggingface.co/stabilityai/stable-diffusion-xl-base-1.0/"
                                                  "resolve/main/sd_xl_base_1.0.safetensors?download=true"),
}

COLUMN_X = 40
COLUMN_GAP = 40
ROW_GAP = 64           # includes the ~30 px title bar drawn above each node's pos
TOP = 130
LEVERS_COLOR = ("#233", "#355")       # teal: the Levers nodes stand out from stock nodes
NOTE_COLOR = ("#432", "#653")
GROUP_COLORS = ("#3f789e", "#8A8", "#b58b2a", "#a1309b", "#88A")


@dataclass
class Out:
    node: "Node"
    slot: int

    @property
    def type(self):
        return self.node.graph.object_info[self.node.type]["output"][self.slot]


@dataclass
class Node:
    graph: "Graph"
    id: int
    type: str
    col: int
    values: dict
    title: str | None = None
    mode: int = 0
    width: int = 340
    color: tuple | None = None
    height: int = 0
    pos: list = field(default_factory=list)

    def out(self, name_or_index=0) -> Out:
        if self.type in ("Note", "PrimitiveNode"):
            raise ValueError("no outputs")
        info = self.graph.object_info[self.type]
        if isinstance(name_or_index, int):
            return Out(self, name_or_index)
        names = list(info.get("output_name") or info["output"])
        for i, name in enumerate(names):
            if name == name_or_index or info["output"][i] == name_or_index:
                return Out(self, i)
        raise KeyError(f"{self.type} has no output {name_or_index!r}; outputs: {names}")


class Graph:
    """A workflow declared in Python, written out in ComfyUI's UI format."""

    def __init__(self, object_info: dict, name: str):
        self.object_info = object_info
        self.name = name
        self.nodes: list[Node] = []
        self.groups: list[tuple[str, list[int]]] = []

    def add(self, type_: str, col: int, *, _title: str | None = None, _mode: int = 0, _width: int | None = None,
            **values) -> Node:
        """Add a node; ``values`` are its inputs by name (widget values or ``Out`` links), the
        underscored keywords are layout (so they never collide with an input called width/title)."""
        if type_ not in self.object_info:
            raise KeyError(f"{self.name}: node type {type_!r} is not installed on the reference server")
        specs = {s.name: s for s in input_specs(self.object_info[type_], {k: v for k, v in values.items()})}
        unknown = set(values) - set(specs)
        if unknown:
            raise KeyError(f"{self.name}: {type_} has no input(s) {sorted(unknown)}; inputs: {list(specs)}")
        color = LEVERS_COLOR if type_.startswith("Levers") else None
        node = Node(self, len(self.nodes) + 1, type_, col, values, _title, _mode, _width or 340, color)
        self.nodes.append(node)
        return node

    def note(self, col: int, text: str, title: str = "Read me", width: int = 420) -> Node:
        node = Node(self, len(self.nodes) + 1, "Note", col, {"text": text}, title, 0, width, NOTE_COLOR)
        self.nodes.append(node)
        return node

    def group(self, title: str, *nodes: Node) -> None:
        if nodes:
            self.groups.append((title, [n.id for n in nodes]))

    # -- layout -----------------------------------------------------------------------------

    def _specs(self, node: Node) -> list[InputSpec]:
        return input_specs(self.object_info[node.type], node.values)

    def _estimate_height(self, node: Node) -> int:
        if node.type == "Note":
            lines = sum(max(1, len(line) // 52 + 1) for line in node.values["text"].splitlines())
            return 40 + 17 * lines
        specs = self._specs(node)
        sockets = [s for s in specs if not s.is_widget or isinstance(node.values.get(s.name), Out)]
        widgets = [s for s in specs if s.is_widget and not isinstance(node.values.get(s.name), Out)]
        outs = len(self.object_info[node.type]["output"])
        height = 30 + 22 * max(len(sockets), outs) + 26 * len(widgets)
        height += sum(24 for s in widgets if s.has_control_widget)
        height += sum(90 for s in widgets if s.type_name == "STRING" and s.options.get("multiline"))
        if node.type == "PreviewAny":
            height += 70  # its text display
        return height

    def _layout(self) -> None:
        x = COLUMN_X
        for col in sorted({n.col for n in self.nodes}):
            column = [n for n in self.nodes if n.col == col]
            y = TOP
            for n in column:
                n.height = self._estimate_height(n)
                n.pos = [x, y]
                y += n.height + ROW_GAP
            x += max(n.width for n in column) + COLUMN_GAP

    def _order(self) -> dict[int, int]:
        deps = {n.id: {v.node.id for v in n.values.values() if isinstance(v, Out)} for n in self.nodes}
        order, done = {}, set()
        while len(done) < len(self.nodes):
            ready = sorted(i for i in deps if i not in done and deps[i] <= done)
            if not ready:
                raise ValueError(f"{self.name}: the graph has a cycle")
            for i in ready:
                order[i] = len(order)
                done.add(i)
        return order

    # -- serialisation ------------------------------------------------------------------------

    def to_ui(self) -> dict:
        self._layout()
        order = self._order()
        links, nodes_out = [], []
        out_links: dict[tuple[int, int], list[int]] = {}
        inputs_of: dict[int, list[dict]] = {}
        for n in self.nodes:
            if n.type == "Note":
                continue
            inputs = []
            for spec in self._specs(n):
                value = n.values.get(spec.name)
                if isinstance(value, Out):
                    link_id = len(links) + 1
                    links.append([link_id, value.node.id, value.slot, n.id, len(inputs), _ui_type(value.type)])
                    out_links.setdefault((value.node.id, value.slot), []).append(link_id)
                    entry = {"name": spec.name, "type": _ui_type(spec.type), "link": link_id}
                elif not spec.is_widget:
                    entry = {"name": spec.name, "type": _ui_type(spec.type), "link": None}
                else:
                    continue
                if spec.is_widget:
                    entry["widget"] = {"name": spec.name}
                if not spec.required:
                    entry["shape"] = 7  # the frontend draws optional inputs hollow
                inputs.append(entry)
            inputs_of[n.id] = inputs
        for n in self.nodes:
            node = {"id": n.id, "type": n.type, "pos": n.pos, "size": [n.width, n.height], "flags": {},
                    "order": order[n.id], "mode": n.mode}
            if n.type == "Note":
                node.update(inputs=[], outputs=[], properties={"text": ""}, widgets_values=[n.values["text"]])
            else:
                info = self.object_info[n.type]
                names = list(info.get("output_name") or info["output"])
                node["inputs"] = inputs_of[n.id]
                node["outputs"] = [{"name": names[i], "type": _ui_type(t), "links": out_links.get((n.id, i), []),
                                    "slot_index": i} for i, t in enumerate(info["output"])]
                props = {"Node name for S&R": n.type}
                models = [{"name": v, "url": MODEL_URLS[v][1], "directory": MODEL_URLS[v][0]}
                          for v in n.values.values() if isinstance(v, str) and v in MODEL_URLS]
                if models:
                    props["models"] = models
                node["properties"] = props
                node["widgets_values"] = self._widget_values(n)
            if n.title:
                node["title"] = n.title
            if n.color:
                node["color"], node["bgcolor"] = n.color
            nodes_out.append(node)
        groups = []
        for i, (title, ids) in enumerate(self.groups):
            members = [n for n in self.nodes if n.id in ids]
            x0 = min(n.pos[0] for n in members) - 15
            y0 = min(n.pos[1] for n in members) - 30 - 50  # node title bar + group title
            x1 = max(n.pos[0] + n.width for n in members) + 15
            y1 = max(n.pos[1] + n.height for n in members) + 15
            groups.append({"id": i + 1, "title": title, "bounding": [x0, y0, x1 - x0, y1 - y0],
                           "color": GROUP_COLORS[i % len(GROUP_COLORS)], "font_size": 24, "flags": {}})
        return {"last_node_id": len(self.nodes), "last_link_id": len(links), "nodes": nodes_out,
                "links": links, "groups": groups, "config": {},
                "extra": {"ds": {"scale": 0.65, "offset": [0, 0]}, "levers_example": self.name},
                "version": 0.4}

    def _widget_values(self, n: Node) -> list:
        values = []
        for spec in self._specs(n):
            if not spec.is_widget:
                continue
            value = n.values.get(spec.name)
            if value is None or isinstance(value, Out):
                value = _default(spec)  # a linked widget still stores a value in the UI format
            values.append(value)
            if spec.has_control_widget:
                values.append("fixed")  # examples are reproducible; the user can switch to randomize
        return values


def _ui_type(t) -> str:
    return "COMBO" if isinstance(t, list) else str(t)


def _default(spec: InputSpec):
    if "default" in spec.options:
        return spec.options["default"]
    choices = spec.choices
    if choices:
        return choices[0]
    return {"INT": 0, "FLOAT": 0.0, "STRING": "", "BOOLEAN": False}.get(spec.type_name)


# ---------------------------------------------------------------------------------------------
# The example graphs
# ---------------------------------------------------------------------------------------------

FLUX_PROMPT = ("a red fox standing in fresh snow at the edge of a pine forest, golden hour, shallow depth of "
               "field, 85mm photo")
WAN_PROMPT = ("a paper boat drifting down a rain-soaked city gutter, close-up tracking shot, reflections of neon "
              "signs, cinematic")
WAN_NEGATIVE = "blurry, low quality, static, watermark, subtitles, distorted hands"
SDXL_PROMPT = "isometric cutaway of a tiny cozy library inside a tree trunk, warm light, highly detailed"
SDXL_NEGATIVE = "blurry, lowres, watermark, text"


def levers_inputs(oi: dict, node: str, **wanted) -> dict:
    """Keep only the inputs ``node`` really has (optional knobs differ between node versions)."""
    names = {s.name for s in input_specs(oi[node], wanted)}
    return {k: v for k, v in wanted.items() if k in names}


def flux_16gb(oi: dict) -> Graph:
    g = Graph(oi, "flux1_dev_16gb")
    unet = g.add("UNETLoader", 0, unet_name="flux1-dev.safetensors", weight_dtype="default")
    clip = g.add("DualCLIPLoader", 0, clip_name1="t5xxl_fp16.safetensors", clip_name2="clip_l.safetensors",
                 type="flux")
    vae = g.add("VAELoader", 0, vae_name="ae.safetensors")
    rec = g.add("LeversRecommend", 1, _title="Levers: plan for this GPU", **levers_inputs(
        oi, "LeversRecommend", model=unet.out("MODEL"), clip=clip.out("CLIP"), vae=vae.out("VAE"),
        model_preset="auto", width=1024, height=1024, steps=28, goal="speed",
        vram_gb=0.0))
    quant = g.add("LeversQuantizeDiT", 2, _title="Levers: weights in the plan's format", **levers_inputs(
        oi, "LeversQuantizeDiT", model=unet.out("MODEL"), plan=rec.out("plan"), format="auto"))
    phase = g.add("LeversPhaseOffload", 2, _title="Levers: one phase on the GPU at a time", **levers_inputs(
        oi, "LeversPhaseOffload", model=quant.out("MODEL"), clip=clip.out("CLIP"), vae=vae.out("VAE"),
        plan=rec.out("plan")))
    prefetch = g.add("LeversGroupPrefetch", 2, _title="Levers: stream what does not fit", **levers_inputs(
        oi, "LeversGroupPrefetch", model=_first_out(phase, "MODEL", quant), plan=rec.out("plan")))
    clip_out = _first_out(phase, "CLIP", clip)
    model_out = _first_out(prefetch, "MODEL", quant)
    vae_out = _first_out(phase, "VAE", vae)
    pos = g.add("CLIPTextEncode", 3, _title="Prompt", text=FLUX_PROMPT, clip=clip_out)
    guide = g.add("FluxGuidance", 3, conditioning=pos.out(0), guidance=3.5)
    neg = g.add("ConditioningZeroOut", 3, conditioning=pos.out(0)) if "ConditioningZeroOut" in oi else pos
    latent = g.add("EmptySD3LatentImage", 3, width=1024, height=1024, batch_size=1)
    sampler = g.add("KSampler", 4, model=model_out, positive=guide.out(0), negative=neg.out(0),
                    latent_image=latent.out(0), seed=42, steps=28, cfg=1.0, sampler_name="euler",
                    scheduler="simple", denoise=1.0)
    decode = g.add("LeversTiledVAEDecode", 5, _title="Levers: decode in tiles that fit", **levers_inputs(
        oi, "LeversTiledVAEDecode", samples=sampler.out(0), vae=vae_out, plan=rec.out("plan")))
    save = g.add("SaveImage", 6, images=decode.out("IMAGE"), filename_prefix="levers/flux1-dev")
    reports = _report_previews(g, 7, rec, quant, phase, prefetch, decode)
    g.note(1, f"""FLUX.1-dev (12 B parameters, 24 GB of bf16 weights) on a 16 GB card.

The plan node reads the loaded models, your GPU, your RAM and your resolution and picks the levers; every Levers node follows it. With goal = speed on a 16 GB card:
- fp8 weights for the diffusion model (QuantizeDiT, format auto): about 14 GB instead of 24 GB, quality loss invisible at fp8 (embedders, norms and the final layer stay 16-bit; with 32 GB of RAM the plan quantizes the modulation linears too, 11 GB, and its report says why);
- phase offload: the T5 text encoder (9.5 GB) is on the GPU only while the prompt is encoded, the diffusion model only while sampling, the VAE only while decoding;
- group prefetch streams the blocks that do not fit (with 64 GB of RAM the plan keeps about 47 of 57 resident; nothing streams when all fit);
- tiled decode: tile size chosen so the decode fits next to what is still resident.
If the plan's text encoder is fp8, load t5xxl_fp8_e4m3fn_scaled instead of t5xxl_fp16 in the DualCLIPLoader.

Change: width/height/steps on the plan node and on the latent. vram_gb = 0 probes this GPU; set it (e.g. 16) to plan for another card. goal = balanced or quality keeps 16-bit weights (QuantizeDiT then passes the model through) and streams more blocks; fit takes the smallest footprint. The report nodes on the right show the plan and what each lever did.

Files: flux1-dev.safetensors in models/diffusion_models, t5xxl_fp16 + clip_l in models/text_encoders, ae.safetensors in models/vae.""")
    g.group("1. Load (stock loaders, your files)", unet, clip, vae)
    g.group("2. Levers", quant, phase, prefetch)
    g.group("3. Sample", pos, guide, latent, sampler, *([neg] if neg is not pos else []))
    g.group("4. Decode and save", decode, save)
    g.group("Reports", *reports)
    return g


def wan_12gb(oi: dict) -> Graph:
    g = Graph(oi, "wan21_14b_video_12gb")
    unet = g.add("UNETLoader", 0, unet_name="wan2.1_t2v_14B_bf16.safetensors", weight_dtype="default")
    clip = g.add("CLIPLoader", 0, clip_name="umt5_xxl_fp8_e4m3fn_scaled.safetensors", type="wan")
    vae = g.add("VAELoader", 0, vae_name="wan_2.1_vae.safetensors")
    rec = g.add("LeversRecommend", 1, _title="Levers: plan for this GPU", **levers_inputs(
        oi, "LeversRecommend", model=unet.out("MODEL"), clip=clip.out("CLIP"), vae=vae.out("VAE"),
        model_preset="auto", width=832, height=480, frames=33, length=33, steps=30,
        goal="balanced", vram_gb=0.0))
    quant = g.add("LeversQuantizeDiT", 2, _title="Levers: weights in the plan's format", **levers_inputs(
        oi, "LeversQuantizeDiT", model=unet.out("MODEL"), plan=rec.out("plan"), format="auto"))
    prefetch = g.add("LeversGroupPrefetch", 2, _title="Levers: stream blocks from host RAM", **levers_inputs(
        oi, "LeversGroupPrefetch", model=quant.out("MODEL"), plan=rec.out("plan")))
    model_out = _first_out(prefetch, "MODEL", quant)
    shift = g.add("ModelSamplingSD3", 3, model=model_out, shift=8.0)
    pos = g.add("CLIPTextEncode", 3, _title="Prompt", text=WAN_PROMPT, clip=clip.out("CLIP"))
    neg = g.add("CLIPTextEncode", 3, _title="Negative prompt", text=WAN_NEGATIVE, clip=clip.out("CLIP"))
    latent = g.add("EmptyHunyuanLatentVideo", 3, width=832, height=480, length=33, batch_size=1)
    sampler = g.add("KSampler", 4, model=shift.out(0), positive=pos.out(0), negative=neg.out(0),
                    latent_image=latent.out(0), seed=42, steps=30, cfg=6.0, sampler_name="uni_pc",
                    scheduler="simple", denoise=1.0)
    decode = g.add("LeversTiledVAEDecode", 5, _title="Levers: decode in tiles / temporal chunks that fit", **levers_inputs(
        oi, "LeversTiledVAEDecode", samples=sampler.out(0), vae=vae.out("VAE"), plan=rec.out("plan")))
    save = g.add("SaveAnimatedWEBP", 6, images=decode.out("IMAGE"), filename_prefix="levers/wan21-14b",
                 fps=16.0, lossless=False, quality=90, method="default")
    reports = _report_previews(g, 7, rec, quant, prefetch, decode)
    g.note(1, f"""Wan 2.1 14B text-to-video (832x480, 33 frames) on a 12 GB card.

14 B parameters are 28 GB in bf16 and still 14 GB in fp8: more than the card. So:
- group prefetch keeps the transformer blocks in host RAM and streams them to the GPU a group ahead of compute, on a side stream; at video lengths the copy hides behind the math, even from pageable memory, so the weights can stay bf16 (with 64 GB of RAM and this graph's fp8 text encoder the plan pins the blocks' host copies and the encoder's; with 48 GB the RAM rule allows only the encoder's, and the blocks' copies hide either way);
- QuantizeDiT (format auto) follows the plan: with 64 GB of RAM the plan keeps bf16 (about 32 GiB of host copies with this graph's fp8 text encoder) and the node passes the model through; with 32 GB it plans fp8 (half the bytes to hold and move) and the node quantizes;
- the video VAE decodes in temporal tiles (chunks of latent frames, carried causal cache) and spatial tiles sized to what is free.

On Windows/WSL, where pinning is limited, the plan streams from pageable memory (slower) and says so in its report.

Change: width/height/length on the plan node and on the latent (length = 4k+1 frames). vram_gb = 0 probes this GPU; set it to plan for another card. More frames -> more activation memory -> fewer blocks resident.""")
    g.group("1. Load", unet, clip, vae)
    g.group("2. Levers", quant, prefetch)
    g.group("3. Sample", shift, pos, neg, latent, sampler)
    g.group("4. Decode and save", decode, save)
    g.group("Reports", *reports)
    return g


def wan22_16gb(oi: dict) -> Graph:
    g = Graph(oi, "wan22_a14b_video_16gb")
    high = g.add("UNETLoader", 0, _title="High-noise expert",
                 unet_name="wan2.2_t2v_high_noise_14B_fp8_scaled.safetensors", weight_dtype="default")
    low = g.add("UNETLoader", 0, _title="Low-noise expert",
                unet_name="wan2.2_t2v_low_noise_14B_fp8_scaled.safetensors", weight_dtype="default")
    clip = g.add("CLIPLoader", 0, clip_name="umt5_xxl_fp8_e4m3fn_scaled.safetensors", type="wan")
    vae = g.add("VAELoader", 0, vae_name="wan_2.1_vae.safetensors")
    rec = g.add("LeversRecommend", 1, _title="Levers: plan for this GPU (both experts)", **levers_inputs(
        oi, "LeversRecommend", model=high.out("MODEL"), model_2=low.out("MODEL"), clip=clip.out("CLIP"),
        vae=vae.out("VAE"), model_preset="auto", width=832, height=480, frames=81, steps=20, goal="balanced",
        vram_gb=0.0))
    phase = g.add("LeversPhaseOffload", 2, _title="Levers: one expert on the GPU at a time", **levers_inputs(
        oi, "LeversPhaseOffload", model=high.out("MODEL"), model_2=low.out("MODEL"), clip=clip.out("CLIP"),
        vae=vae.out("VAE"), plan=rec.out("plan")))
    stream_high = g.add("LeversGroupPrefetch", 2, _title="Levers: stream the high-noise expert", **levers_inputs(
        oi, "LeversGroupPrefetch", model=phase.out("MODEL"), plan=rec.out("plan")))
    stream_low = g.add("LeversGroupPrefetch", 2, _title="Levers: stream the low-noise expert", **levers_inputs(
        oi, "LeversGroupPrefetch", model=phase.out("MODEL_2"), plan=rec.out("plan")))
    shift_high = g.add("ModelSamplingSD3", 3, model=_first_out(stream_high, "MODEL", phase), shift=8.0)
    shift_low = g.add("ModelSamplingSD3", 3, model=_first_out(stream_low, "MODEL", phase), shift=8.0)
    clip_out = _first_out(phase, "CLIP", clip)
    pos = g.add("CLIPTextEncode", 3, _title="Prompt", text=WAN_PROMPT, clip=clip_out)
    neg = g.add("CLIPTextEncode", 3, _title="Negative prompt", text=WAN_NEGATIVE, clip=clip_out)
    latent = g.add("EmptyHunyuanLatentVideo", 3, width=832, height=480, length=81, batch_size=1)
    first = g.add("KSamplerAdvanced", 4, _title="Steps 0-10: high-noise expert", model=shift_high.out(0),
                  add_noise="enable", noise_seed=42, steps=20, cfg=3.5, sampler_name="euler", scheduler="simple",
                  positive=pos.out(0), negative=neg.out(0), latent_image=latent.out(0), start_at_step=0,
                  end_at_step=10, return_with_leftover_noise="enable")
    second = g.add("KSamplerAdvanced", 4, _title="Steps 10-20: low-noise expert", model=shift_low.out(0),
                   add_noise="disable", noise_seed=42, steps=20, cfg=3.5, sampler_name="euler", scheduler="simple",
                   positive=pos.out(0), negative=neg.out(0), latent_image=first.out(0), start_at_step=10,
                   end_at_step=10000, return_with_leftover_noise="disable")
    decode = g.add("LeversTiledVAEDecode", 5, _title="Levers: decode in tiles / temporal chunks that fit", **levers_inputs(
        oi, "LeversTiledVAEDecode", samples=second.out(0), vae=_first_out(phase, "VAE", vae), plan=rec.out("plan")))
    save = g.add("SaveAnimatedWEBP", 6, images=decode.out("IMAGE"), filename_prefix="levers/wan22-a14b",
                 fps=16.0, lossless=False, quality=90, method="default")
    reports = _report_previews(g, 7, rec, phase, stream_high, stream_low, decode)
    g.note(1, """Wan 2.2 A14B text-to-video (832x480, 81 frames) on a 16 GB card.

Wan 2.2 A14B is two 14 B experts: the high-noise one samples the first half of the steps, the low-noise one the rest. Each is 14 GB in fp8, so one fits next to nothing else and two never fit together. So:
- Recommend gets both experts (model and model_2): it plans for one on the GPU at a time and for both in host RAM;
- PhaseOffload gets both too (model and model_2): when the low-noise expert starts, the high-noise one leaves the GPU by a pointer swap (no copy back), and the text encoder and the VAE each get the GPU to themselves;
- a GroupPrefetch on each expert streams its blocks from host RAM a group ahead of compute, so the activations of 81 frames fit next to the resident blocks (with 64 GB of RAM the plan pins the two experts' 27 GiB of fp8 weights and leaves the text encoder pageable, as the RAM rule cannot pin both twice over; the copies hide behind 81 frames of compute);
- the video VAE decodes in temporal chunks (causal cache carried, exact) and spatial tiles sized to what is free.

Needs about 36 GB of free host RAM (both experts and the text encoder). With less, set goal = fit on the plan node, or use smaller GGUF files (they stream too).

Change: width/height/length on the plan node and on the latent (length = 4k+1 frames); the switch step on both samplers (end_at_step of the first = start_at_step of the second). vram_gb = 0 probes this GPU; set it to plan for another card.""")
    g.group("1. Load", high, low, clip, vae)
    g.group("2. Levers", phase, stream_high, stream_low)
    g.group("3. Sample", shift_high, shift_low, pos, neg, latent, first, second)
    g.group("4. Decode and save", decode, save)
    g.group("Reports", *reports)
    return g


def sdxl_8gb(oi: dict) -> Graph:
    g = Graph(oi, "sdxl_8gb")
    ckpt = g.add("CheckpointLoaderSimple", 0, ckpt_name="sd_xl_base_1.0.safetensors")
    rec = g.add("LeversRecommend", 1, _title="Levers: plan for this GPU", **levers_inputs(
        oi, "LeversRecommend", model=ckpt.out("MODEL"), clip=ckpt.out("CLIP"), vae=ckpt.out("VAE"),
        model_preset="auto", width=1024, height=1024, steps=30, goal="quality", vram_gb=0.0))
    quant = g.add("LeversQuantizeDiT", 2, _title="Levers: weights in the plan's format", **levers_inputs(
        oi, "LeversQuantizeDiT", model=ckpt.out("MODEL"), plan=rec.out("plan"), format="auto"))
    phase = g.add("LeversPhaseOffload", 2, _title="Levers: one phase on the GPU at a time", **levers_inputs(
        oi, "LeversPhaseOffload", model=quant.out("MODEL"), clip=ckpt.out("CLIP"), vae=ckpt.out("VAE"),
        plan=rec.out("plan")))
    model_out = _first_out(phase, "MODEL", quant)
    clip_out = _first_out(phase, "CLIP", ckpt)
    vae_out = _first_out(phase, "VAE", ckpt)
    pos = g.add("CLIPTextEncode", 3, _title="Prompt", text=SDXL_PROMPT, clip=clip_out)
    neg = g.add("CLIPTextEncode", 3, _title="Negative prompt", text=SDXL_NEGATIVE, clip=clip_out)
    latent = g.add("EmptyLatentImage", 3, width=1024, height=1024, batch_size=1)
    sampler = g.add("KSampler", 4, model=model_out, positive=pos.out(0), negative=neg.out(0),
                    latent_image=latent.out(0), seed=42, steps=30, cfg=6.5, sampler_name="dpmpp_2m",
                    scheduler="karras", denoise=1.0)
    decode = g.add("LeversTiledVAEDecode", 5, _title="Levers: decode in tiles that fit", **levers_inputs(
        oi, "LeversTiledVAEDecode", samples=sampler.out(0), vae=vae_out, plan=rec.out("plan")))
    save = g.add("SaveImage", 6, images=decode.out("IMAGE"), filename_prefix="levers/sdxl")
    reports = _report_previews(g, 7, rec, quant, phase, decode)
    g.note(1, """SDXL at 1024x1024 on a card with 8 GB or less (6 GB and 4 GB work too, slower).

SDXL's UNet is 2.6 B parameters (5 GB in fp16), its two text encoders 0.8 B, its VAE is small but its 1024x1024 decode needs several GB of activations: the usual OOM is at the very end, in VAE decode.
- phase offload: the text encoders leave the GPU after encoding, the UNet after sampling;
- tiled decode: the tile size is fitted to the memory that is actually free, so decode never OOMs;
- no quantization: goal = quality keeps fp16 weights because they fit once the phases are split, so QuantizeDiT (format auto) passes the model through. On 4 GB set goal = fit: the plan picks nf4 weights (bitsandbytes), which QuantizeDiT then applies.

Change: width/height on the plan node and on the latent. vram_gb = 0 probes this GPU; set it (e.g. 6) to plan for a smaller card.""")
    g.group("1. Load", ckpt)
    g.group("2. Levers", quant, phase)
    g.group("3. Sample", pos, neg, latent, sampler)
    g.group("4. Decode and save", decode, save)
    g.group("Reports", *reports)
    return g


def quantize_and_save(oi: dict) -> Graph:
    g = Graph(oi, "quantize_once_and_save")
    unet = g.add("UNETLoader", 0, unet_name="flux1-dev.safetensors", weight_dtype="default")
    quant = g.add("LeversQuantizeDiT", 1, _title="Levers: quantize to fp8 and save", **levers_inputs(
        oi, "LeversQuantizeDiT", model=unet.out("MODEL"), format="fp8_e4m3fn", granularity="per_tensor",
        save_path=SAVED_FP8))
    reports = _report_previews(g, 2, quant)
    loader = g.add("UNETLoader", 3, _title="Next time: load the fp8 file (enable me: Ctrl+M)", _mode=2,
                   unet_name=SAVED_FP8, weight_dtype="default")
    g.note(1, f"""Quantize once, save, then load the small file with the stock loader.

Run this graph once: QuantizeDiT turns FLUX.1-dev into fp8 weights (per-tensor scaled E4M3, ComfyUI's own quantized checkpoint layout; embedders, modulation, norms and the final layer stay 16-bit) and writes models/diffusion_models/{SAVED_FP8}: about 15 GB (14 GiB) instead of 24 GB (modulation = quantize on the node makes it about 12 GB, with more loss: those linears scale every activation). It never overwrites an existing file: delete or rename the old one to redo it.

Then use the stock "Load Diffusion Model" with that file in any workflow (the muted loader on the right shows it; select it and press Ctrl+M to enable it), without a QuantizeDiT node: loading reads about 60% of the bytes from disk and needs about 60% of the RAM.

Quantizing needs the 16-bit model in host RAM once. format = int8 (torchao, per-row) or nf4 (bitsandbytes, smallest, visibly lossy) are alternatives; only fp8 per_tensor files load correctly with the stock loader (from ComfyUI 0.3.7x on); the others need Load Quantized DiT (Levers).""")
    g.group("Run once: quantize and save", unet, quant, *reports)
    g.group("After that: the stock loader reads the fp8 file", loader)
    return g


def _first_out(node: Node, type_: str, fallback: Node) -> Out:
    """``node``'s first output of ``type_`` (Levers nodes that pass a component through), else the fallback's."""
    info = node.graph.object_info[node.type]
    for i, t in enumerate(info["output"]):
        if t == type_:
            return Out(node, i)
    return fallback.out(type_)


def _report_previews(g: Graph, col: int, *nodes: Node) -> list[Node]:
    """A "Preview as Text" per Levers report output, so the plan is readable on the canvas."""
    if "PreviewAny" not in g.object_info:
        return []
    previews = []
    for node in nodes:
        info = g.object_info[node.type]
        names = list(info.get("output_name") or info["output"])
        for i, t in enumerate(info["output"]):
            if t == "STRING":
                previews.append(g.add("PreviewAny", col, _title=f"Report: {node.title or node.type}",
                                      source=Out(node, i)))
    return previews


REF_START, REF_END = "<!-- node-reference:start -->", "<!-- node-reference:end -->"


def render_reference(object_info: dict, node_ids) -> str:
    """Markdown for every Levers node: inputs with type, default, range/choices and tooltip; outputs."""
    parts = [REF_START, "<!-- generated by tests/integration/make_workflows.py from /object_info; "
                        "edit the node schemas, not this text -->", ""]
    for node_id in node_ids:
        info = object_info.get(node_id)
        if info is None:
            parts += [f"#### `{node_id}`", "", "_Not registered on the reference server._", ""]
            continue
        parts += [f"#### {info.get('display_name') or node_id} (`{node_id}`)", ""]
        if info.get("description"):
            parts += [info["description"].strip(), ""]
        parts += ["| Input | Type | Default | Range / choices | What it does |", "|---|---|---|---|---|"]
        for spec in input_specs(info):
            parts.append("| " + " | ".join([
                f"`{spec.name}`" + ("" if spec.required else " (optional)"), _cell(spec.type_name),
                _cell(_fmt(spec.options.get("default")) if "default" in spec.options else ""),
                _cell(_range(spec)), _cell(spec.options.get("tooltip", ""))]) + " |")
        outs = info.get("output") or []
        names = info.get("output_name") or outs
        tips = info.get("output_tooltips") or [None] * len(outs)
        parts += ["", "| Output | Type | What it is |", "|---|---|---|"]
        for name, t, tip in zip(names, outs, tips):
            parts.append(f"| `{name}` | {_cell(str(t))} | {_cell(tip or '')} |")
        parts.append("")
    parts.append(REF_END)
    return "\n".join(parts)


def _fmt(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f"`{value}`" if value else '`""`'
    return f"`{value}`"


def _range(spec: InputSpec) -> str:
    choices = spec.choices
    if choices is not None:
        return ", ".join(f"`{c}`" for c in choices)
    low, high = spec.options.get("min"), spec.options.get("max")
    if low is None and high is None:
        return ""
    step, rounding = spec.options.get("step"), spec.options.get("round")
    # the widget's arrows move by ``step``; a typed value keeps ``round``'s precision (0.034 GiB stays 0.034 at 0.001)
    return (f"{low if low is not None else ''} .. {high if high is not None else ''}" + (f" step {step}" if step else "")
            + (f", typed to {rounding}" if rounding and rounding != step else ""))


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def splice(doc: str, block: str) -> str:
    """Replace the generated block between the markers (append it when they are missing)."""
    if REF_START in doc and REF_END in doc:
        head, rest = doc.split(REF_START, 1)
        tail = rest.split(REF_END, 1)[1]
        return head + block + tail
    return doc.rstrip("\n") + "\n\n" + block + "\n"


SAVED_FP8 = "flux1-dev-levers-fp8.safetensors"
GRAPHS = (flux_16gb, wan_12gb, wan22_16gb, sdxl_8gb, quantize_and_save)


def fixture_subset(object_info: dict, graphs: list[dict]) -> dict:
    types = {n["type"] for ui in graphs for n in ui["nodes"]} | set(LEVERS_NODES)
    return {t: object_info[t] for t in sorted(types) if t in object_info}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", help="use this running ComfyUI instead of starting COMFYUI_PATH")
    parser.add_argument("--check", action="store_true", help="only report whether the files are up to date")
    args = parser.parse_args(argv)
    server = None
    if args.server:
        url = args.server
    else:
        from comfy_server import ComfyServer, comfyui_path

        path, reason = comfyui_path()
        if path is None:
            parser.error(reason)
        server = ComfyServer(path, test_nodes=False).start()
        url = server.url
    try:
        object_info = ComfyClient(url).object_info()
    finally:
        if server is not None:
            server.stop()
    missing = [n for n in LEVERS_NODES if n not in object_info]
    if missing:
        print(f"warning: the server has no {missing}; those graphs will fail", file=sys.stderr)
    uis = {}
    for build in GRAPHS:
        graph = build(object_info)
        ui = graph.to_ui()
        api = ui_to_api(ui, object_info)
        problems = validate_api(api, object_info, allow_missing_files=True)
        if problems:
            raise SystemExit(f"{graph.name} does not validate:\n  " + "\n  ".join(problems))
        uis[graph.name] = (ui, api)
    outputs = {EXAMPLES / f"{name}.json": ui for name, (ui, _) in uis.items()}
    outputs.update({EXAMPLES / "api" / f"{name}.json": api for name, (_, api) in uis.items()})
    outputs[FIXTURE] = fixture_subset(object_info, [ui for ui, _ in uis.values()])
    stale = []
    for path, data in outputs.items():
        text = json.dumps(data, indent=2, ensure_ascii=False) + "\n"
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            stale.append(path)
            if not args.check:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text, encoding="utf-8")
    if DOC.exists():
        text = DOC.read_text(encoding="utf-8")
        new = splice(text, render_reference(object_info, LEVERS_NODES))
        if new != text:
            stale.append(DOC)
            if not args.check:
                DOC.write_text(new, encoding="utf-8")
    for path in stale:
        print(("stale: " if args.check else "wrote: ") + os.path.relpath(path, ROOT))
    return 1 if (args.check and stale) else 0


if __name__ == "__main__":
    raise SystemExit(main())
