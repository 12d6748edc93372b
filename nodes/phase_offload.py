"""LeversPhaseOffload: each component holds the GPU only during its own phase; offload is a pointer swap.

The phases run after this node, so its report says where their ledger appears: on the node as each
phase ends, and as JSON in <output>/levers/ (bridge/phase.py publishes both)."""
from __future__ import annotations

from comfy_api.latest import io, ui

from . import REPORT_TIP
from ..bridge.phase import PhaseSettings, apply, report_text
from ..core.residency.pinned import PinMode
from ..core.types import Residency

PLAN = io.Custom("LEVERS_PLAN")
DEVICE_TIP = "auto = where ComfyUI would put it; cpu; or cuda:N for a specific GPU."


def settings_from(plan, model_device: str, text_encoder_device: str, vae_device: str, pin: str,
                  text_encoder_precision: str) -> PhaseSettings:
    """Node inputs; settings left on auto take the plan's per-component device / pin / precision, and the
    components the plan keeps resident stay on the GPU across phases."""
    resident: tuple[str, ...] = ()
    pageable: tuple[str, ...] = ()
    if plan is not None:
        def planned(name):
            try:
                return plan.component(name)
            except KeyError:
                return None
        dm, te, va = planned("diffusion_model"), planned("text_encoder"), planned("vae")
        model_device = dm.device if model_device == "auto" and dm is not None else model_device
        text_encoder_device = te.device if text_encoder_device == "auto" and te is not None else text_encoder_device
        vae_device = va.device if vae_device == "auto" and va is not None else vae_device
        # the plan pins the host copies of the components that move (all, or the part the RAM rule allows); one it
        # keeps resident stays on the GPU across phases and has no host copy to pin
        moving = [c for c in (dm, te, va) if c is not None and c.residency in (Residency.PHASE, Residency.STREAMED)]
        if pin == "auto" and moving:
            pin = "on" if any(c.pin for c in moving) else "off"
            if pin == "on":
                pageable = tuple(str(c.name) for c in moving if not c.pin)
        experts = getattr(plan, "experts", 1) > 1               # experts always take turns on the GPU
        resident = tuple(str(c.name) for c in (dm, te, va) if c is not None and c.residency is Residency.RESIDENT
                         and not (c is dm and experts))
        if text_encoder_precision == "auto" and te is not None and str(te.precision) in ("fp32", "bf16", "fp16"):
            text_encoder_precision = str(te.precision)
    return PhaseSettings(model_device=model_device, text_encoder_device=text_encoder_device, vae_device=vae_device,
                         pin=pin, text_encoder_precision=text_encoder_precision, resident=resident,
                         pageable=pageable)


class LeversPhaseOffload(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="LeversPhaseOffload",
            display_name="PhaseOffload",
            category="Levers",
            description="Encode, sample and decode each get the GPU to themselves: before a phase starts, the other "
                        "components are released through ComfyUI's own memory manager. Weights keep a host master "
                        "(pinned when RAM allows), so going back to the host is a pointer swap (0 bytes copied) and "
                        "coming back is one copy at full PCIe speed. Output is bit-identical to the plain workflow.",
            inputs=[
                io.Model.Input("model", tooltip="The diffusion model (not modified; a managed clone is returned)."),
                io.Clip.Input("clip", optional=True, tooltip="Text encoder to manage (optional; cloned)."),
                io.Vae.Input("vae", optional=True, tooltip="VAE to manage (optional; the input VAE is not modified)."),
                PLAN.Input("plan", optional=True,
                           tooltip="A Levers plan from Recommend: fills devices, pinning and text-encoder precision "
                                   "left on auto; a component it keeps resident stays on the GPU across phases."),
                io.Combo.Input("model_device", options=["auto", "cpu", "cuda:0", "cuda:1", "cuda:2", "cuda:3"],
                               default="auto", tooltip="Where the diffusion model runs. " + DEVICE_TIP),
                io.Combo.Input("text_encoder_device", options=["auto", "cpu", "cuda:0", "cuda:1", "cuda:2", "cuda:3"],
                               default="auto", tooltip="Where the text encoder runs: a second GPU, or the CPU to keep "
                                                       "it off the card entirely. " + DEVICE_TIP),
                io.Combo.Input("vae_device", options=["auto", "cpu", "cuda:0", "cuda:1", "cuda:2", "cuda:3"],
                               default="auto", tooltip="Where the VAE decodes. " + DEVICE_TIP),
                io.Combo.Input("pin", options=PinMode, default=PinMode.AUTO,
                               tooltip="Page-lock the host masters (once, in place) for full-speed copies. auto: only "
                                       "when free RAM is at least twice the pinned set (and within Windows/WSL limits); "
                                       "on: always try; off: pageable. Failures fall back to pageable per component."),
                io.Combo.Input("text_encoder_precision", options=["auto", "fp32", "bf16", "fp16"], default="auto",
                               tooltip="Weight dtype of the text encoder. auto keeps ComfyUI's, except 16-bit weights "
                                       "on the CPU become fp32 (a private copy; the input CLIP is untouched). LoRA'd "
                                       "and hooked weights (CLIP weight hooks) in a wider copy are rounded to the stored precision as ComfyUI rounds "
                                       "them, so the result is bit-identical (LoRA before or after the node); "
                                       "quantized (fp8) weights are always kept as stored."),
                io.Model.Input("model_2", optional=True,
                               tooltip="A second diffusion model sampled after the first (Wan 2.2 A14B: the "
                                       "low-noise expert; or a refiner). It gets its own phase, so each model holds "
                                       "the GPU alone and switching is one copy in, a pointer swap out. Placed "
                                       "with model_device. Its managed clone is the MODEL_2 output."),
            ],
            outputs=[io.Model.Output(display_name="MODEL",
                                     tooltip="A managed clone of the diffusion model: on the GPU only while sampling."),
                     io.Clip.Output(display_name="CLIP",
                                    tooltip="A managed clone of the text encoder: on the GPU only while encoding."),
                     io.Vae.Output(display_name="VAE",
                                   tooltip="A managed clone of the VAE: on the GPU only while decoding."),
                     io.String.Output(display_name="report", tooltip=REPORT_TIP),
                     io.Model.Output(display_name="MODEL_2",
                                     tooltip="The managed clone of model_2 (without model_2, a node using it stops "
                                             "with a message saying so).")],
            hidden=[io.Hidden.unique_id],   # the per-phase ledger is shown on this node after its phases
        )

    @classmethod
    def execute(cls, model, clip=None, vae=None, plan=None, model_device="auto", text_encoder_device="auto",
                vae_device="auto", pin="auto", text_encoder_precision="auto", model_2=None) -> io.NodeOutput:
        settings = settings_from(plan, model_device, text_encoder_device, vae_device, pin, text_encoder_precision)
        hidden = getattr(cls, "hidden", None)   # set by ComfyUI's executor; None when called directly
        m, c, v, group, m2 = apply(model, clip, vae, settings, node_id=getattr(hidden, "unique_id", None),
                                   model_2=model_2)
        note = fp8_text_encoder_note(plan, clip)
        if note:
            group.notes.append(note)
        report = report_text(group)
        if m2 is None:
            m2 = _unconnected_model_2()
        return io.NodeOutput(m, c, v, report, m2, ui=ui.PreviewText(report))


def fp8_text_encoder_note(plan, clip) -> str | None:
    """A line when the plan's text encoder is fp8 but the connected one is stored wider: no node converts it (the
    plan's peak and host RAM assumed the fp8 file)."""
    if plan is None or clip is None:
        return None
    try:
        te = plan.component("text_encoder")
    except KeyError:
        return None
    if str(te.precision) != "fp8_e4m3fn":
        return None
    from ..bridge.recommend import _param_stats

    params, nbytes, _ = _param_stats(clip.cond_stage_model)
    if not params or nbytes / params < 1.5:
        return None
    return (f"the plan's text encoder is fp8, but the connected one is stored at {nbytes / params:.0f} bytes a weight "
            "(the plan's peak and host RAM assume the fp8 file): load ComfyUI's *_fp8_e4m3fn encoder file (e.g. "
            "t5xxl_fp8_e4m3fn_scaled, umt5_xxl_fp8_e4m3fn_scaled); no node converts a 16-bit encoder to fp8")


def _unconnected_model_2():
    """What MODEL_2 carries without a model_2 input: ComfyUI stops a node that uses it with this message (instead
    of a sampler failing on None)."""
    try:
        from comfy_execution.graph_utils import ExecutionBlocker
    except ImportError:
        return None
    return ExecutionBlocker("PhaseOffload's MODEL_2 output is used but its model_2 input is not connected: connect "
                            "the second diffusion model (Wan 2.2's low-noise expert) to model_2, or sample with MODEL")


NODES = [LeversPhaseOffload]
