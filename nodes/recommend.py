"""LeversRecommend: which precision / placement / residency plan fits this machine."""
from __future__ import annotations

from comfy_api.latest import io, ui

from . import REPORT_TIP
from ..bridge.recommend import connected_modules, machine_for_comfy, measure
from ..core.plan import Workload, plan
from ..core.presets import PRESETS
from ..core.probe import synthetic_machine
from ..core.report import format_plan

PLAN = io.Custom("LEVERS_PLAN")


def latent_size(width: int, height: int) -> tuple[int, int, str]:
    """The size ComfyUI's latent nodes really make (``width // 8`` x ``height // 8`` latent cells) for a size the
    widgets' step of 8 would not give (an API prompt, a converted input): planned as that, with a note, not an
    error."""
    w, h = (v // 8 * 8 if v >= 8 else v for v in (width, height))
    if (w, h) == (width, height):
        return width, height, ""
    return w, h, (f"size: {width}x{height} planned as {w}x{h}, the latent ComfyUI's empty-latent nodes make for it "
                  f"(width // 8 x height // 8 cells)")


class LeversRecommend(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="LeversRecommend",
            display_name="Recommend",
            category="Levers",
            description="Probes VRAM, host RAM, host->GPU bandwidth and libraries, sizes weights, activations and the "
                        "VAE peak, and returns the plan that fits (precision, device, residency, pinning, streaming, "
                        "tiling) with predicted peak memory and extra seconds.",
            inputs=[
                io.Combo.Input("model_preset", options=["auto"] + list(PRESETS), default="auto",
                               tooltip="auto: measure the connected MODEL/CLIP/VAE (family detected from the model); "
                                       "or a preset when nothing is connected."),
                io.Int.Input("width", default=1024, min=64, max=16384, step=8, tooltip="Output width in pixels."),
                io.Int.Input("height", default=1024, min=64, max=16384, step=8, tooltip="Output height in pixels."),
                io.Int.Input("frames", default=1, min=1, max=1025, tooltip="Video frames (1 for images)."),
                io.Int.Input("steps", default=28, min=1, max=1000, tooltip="Sampling steps."),
                io.Int.Input("batch", default=1, min=1, max=64, tooltip="Images/videos per run."),
                io.Combo.Input("goal", options=["balanced", "quality", "speed", "fit"], default="balanced",
                               tooltip="balanced: fp8 only when it buys >~33% speed or is needed to fit; quality: least lossy "
                                       "that fits; speed: fastest; fit: smallest peak, streaming last."),
                io.Float.Input("vram_gb", default=0.0, min=0.0, max=4096.0, step=0.5,
                               tooltip="Plan for a card with this much memory (GiB). 0 = probe this machine."),
                io.Float.Input("ram_gb", default=0.0, min=0.0, max=65536.0, step=1.0,
                               tooltip="Host RAM available (GiB). 0 = probe."),
                io.Model.Input("model", optional=True, tooltip="Measure this diffusion model instead of a preset."),
                io.Clip.Input("clip", optional=True, tooltip="Measure this text encoder."),
                io.Vae.Input("vae", optional=True, tooltip="Measure this VAE."),
                io.Model.Input("model_2", optional=True,
                               tooltip="A second diffusion model sampled after the first (Wan 2.2 A14B: the "
                                       "low-noise expert). Planned as a second expert: one on the GPU at a time, "
                                       "both in host RAM."),
                io.Int.Input("reference_images", default=0, min=0, max=16, optional=True,
                             tooltip="Reference images an edit model reads, each at the output size (FLUX Kontext, "
                                     "Qwen-Image-Edit, FLUX 2 references): their tokens join the sequence, so "
                                     "activations and step time grow. 0 for text-to-image; ignored, with a note, "
                                     "for models that take none (SDXL, SD3, HunyuanVideo, HunyuanImage, Chroma)."),
            ],
            outputs=[PLAN.Output(display_name="plan",
                                 tooltip="The plan: connect it to the other Levers nodes, which follow it on auto."),
                     io.String.Output(display_name="report", tooltip=REPORT_TIP)],
        )

    @classmethod
    def execute(cls, model_preset, width, height, frames, steps, batch, goal, vram_gb, ram_gb,
                model=None, clip=None, vae=None, model_2=None, reference_images=0) -> io.NodeOutput:
        spec, notes = measure(model, clip, vae, preset=model_preset, model_2=model_2)
        width, height, size_note = latent_size(width, height)     # this model's own cell (16, 32 px): a note in plan
        notes = [*notes, *([size_note] if size_note else [])]
        machine = machine_for_comfy(modules=connected_modules(model, clip, vae, model_2))
        if vram_gb or ram_gb:
            machine = synthetic_machine(vram_gb or None, ram_gb or None, None, base=machine)
        result = plan(spec, Workload(width=width, height=height, frames=frames, steps=steps, batch=batch,
                                     references=int(reference_images or 0)), machine, goal)
        if notes:
            import dataclasses

            result = dataclasses.replace(result, notes=tuple(notes) + result.notes)
        report = format_plan(result, machine)
        return io.NodeOutput(result, report, ui=ui.PreviewText(report))


NODES = [LeversRecommend]
