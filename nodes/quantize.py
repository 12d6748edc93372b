"""LeversQuantizeDiT: quantize the diffusion model in the graph (fp8 / int8 / nf4); the input stays intact."""
from __future__ import annotations

from comfy_api.latest import io, ui

from . import REPORT_TIP
from ..bridge.quant import quantize_node, save_path_problem

PLAN = io.Custom("LEVERS_PLAN")


class LeversQuantizeDiT(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="LeversQuantizeDiT",
            display_name="QuantizeDiT",
            category="Levers",
            description="Quantize the diffusion transformer's attention and MLP weights to fp8, int8 or nf4. Embedders, "
                        "modulation/adaLN (unless modulation = quantize), norms and the final layer stay in full "
                        "precision (per-architecture census). "
                        "Returns a new model; the input model is untouched. LoRA loaders after this node work.",
            inputs=[
                io.Model.Input("model", tooltip="Diffusion model from a loader (not modified)."),
                io.Combo.Input("format", options=["auto", "fp8_e4m3fn", "int8", "nf4"], default="auto",
                               tooltip="auto: the plan's quantized format; a plan that keeps 16-bit passes the model "
                                       "through unchanged (with a save_path: fp8_e4m3fn); no plan: fp8_e4m3fn. A format "
                                       "set here wins over the plan (the report says so). fp8 ~halves the weights with "
                                       "near-invisible loss; int8 (torchao) similar size; nf4 (bitsandbytes) ~quarter "
                                       "size with visible loss."),
                io.Combo.Input("granularity", options=["auto", "per_tensor", "per_row", "per_block"], default="auto",
                               tooltip="Weights per scale. auto: fp8 per_tensor in ComfyUI's own layout when available "
                                       "(else per_row), int8 per_row, nf4 per_block (64)."),
                io.Int.Input("keep_first_blocks", default=0, min=0, max=200,
                             tooltip="Keep the first N transformer blocks (execution order) in full precision. Counts "
                                     "the blocks that hold layers to quantize (an SDXL UNet's convolution-only "
                                     "blocks are not counted)."),
                io.Int.Input("keep_last_blocks", default=0, min=0, max=200,
                             tooltip="Keep the last N transformer blocks in full precision. Counts the blocks "
                                     "that hold layers to quantize, like keep_first_blocks."),
                io.String.Input("extra_skip", default="", optional=True,
                                tooltip="Comma-separated layer-name patterns to keep: a substring, or a glob "
                                        "(* ? [ ]) matched against the whole layer name; case-sensitive. E.g. "
                                        "'img_mlp, single_blocks.3*'. A pattern that matches no layer gets a note."),
                PLAN.Input("plan", optional=True, tooltip="A Levers plan from Recommend: decides format and modulation on "
                                                          "auto. A plan made for another model family gets a note."),
                io.String.Input("save_path", default="", optional=True,
                                tooltip="Optional: also save a .safetensors (name = into models/diffusion_models; checked before the graph runs). fp8 "
                                        "per_tensor is ComfyUI's own layout (stock UNETLoader loads it from ComfyUI 0.3.7x on; "
                                        "Load Quantized DiT (Levers) reads every layout). Never overwrites."),
                io.Boolean.Input("quality_check", default=True, optional=True,
                                 tooltip="Run the original and the quantized model once on a tiny random latent "
                                         "(same seed, noise and context) and report the PSNR of the quantized "
                                         "output vs the original in dB (fp8/int8 aim for >= 35 dB). Costs two small "
                                         "forward passes (the original is loaded once, as ComfyUI loads it)."),
                io.Combo.Input("modulation", options=["auto", "keep", "quantize"], default="auto", optional=True,
                               tooltip="The adaLN/modulation linears inside the blocks (27% of FLUX's weights, a "
                                       "third of Qwen-Image's). keep: 16-bit (the safe default: they scale every "
                                       "activation). quantize: in the chosen format too, when only that fits the "
                                       "card. auto: the plan's choice, else keep."),
            ],
            outputs=[io.Model.Output(display_name="MODEL", tooltip="A new, quantized model (or the input, passed "
                                                                   "through, when the report says so)."),
                     io.String.Output(display_name="report", tooltip=REPORT_TIP)],
        )

    @classmethod
    def validate_inputs(cls, save_path="") -> bool | str:
        # only save_path: ComfyUI then still checks every other input's range itself
        return save_path_problem(save_path) or True

    @classmethod
    def execute(cls, model, format="auto", granularity="auto", keep_first_blocks=0, keep_last_blocks=0,
                extra_skip="", plan=None, save_path="", quality_check=True, modulation="auto") -> io.NodeOutput:
        new, report = quantize_node(model, format, granularity, keep_first_blocks, keep_last_blocks, extra_skip,
                                    plan, save_path, quality_check, modulation)
        return io.NodeOutput(new, report, ui=ui.PreviewText(report))


NODES = [LeversQuantizeDiT]
