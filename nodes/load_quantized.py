"""LeversLoadQuantizedDiT: load the pack's quantized files (int8, nf4, fp8 per_row/per_block) as a MODEL."""
from __future__ import annotations

from comfy_api.latest import io, ui

from . import REPORT_TIP
from ..bridge.quant_loader import COMPUTE_DTYPES, load_quantized_dit, resolve_unet_path


class LeversLoadQuantizedDiT(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        import folder_paths

        return io.Schema(
            node_id="LeversLoadQuantizedDiT",
            display_name="Load Quantized DiT (Levers)",
            category="Levers",
            description="Load a diffusion model saved by QuantizeDiT or `levers quantize` (int8, nf4, fp8 per_row / "
                        "per_block) without expanding it to bf16 in RAM. Plain and ComfyUI fp8 files load through "
                        "ComfyUI's own loader, exactly as Load Diffusion Model would.",
            inputs=[
                io.Combo.Input("unet_name", options=folder_paths.get_filename_list("diffusion_models"),
                               tooltip="A .safetensors in models/diffusion_models (QuantizeDiT's save_path puts "
                                       "files there)."),
                io.Combo.Input("compute_dtype", options=list(COMPUTE_DTYPES), default="auto", optional=True,
                               tooltip="dtype of the kept (unquantized) weights and of the dequantized layers' "
                                       "compute. auto: what ComfyUI picks for this model and device."),
            ],
            outputs=[io.Model.Output(display_name="MODEL",
                                     tooltip="The diffusion model, weights kept as stored (quantized codes + scales)."),
                     io.String.Output(display_name="report", tooltip=REPORT_TIP)],
        )

    @classmethod
    def execute(cls, unet_name, compute_dtype="auto") -> io.NodeOutput:
        model, report = load_quantized_dit(resolve_unet_path(unet_name), compute_dtype)
        return io.NodeOutput(model, report, ui=ui.PreviewText(report))


NODES = [LeversLoadQuantizedDiT]
