"""LeversTiledVAEDecode: decode in tiles sized from free memory, without seams; whole when it fits."""
from __future__ import annotations

from comfy_api.latest import io, ui

from . import REPORT_TIP
from ..bridge.vae import TiledDecodeSettings, tiled_decode

PLAN = io.Custom("LEVERS_PLAN")


class LeversTiledVAEDecode(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="LeversTiledVAEDecode",
            display_name="TiledVAEDecode",
            category="Levers",
            description="VAEDecode that never runs out of memory: measures the VAE's real decode cost, unloads other "
                        "models, decodes whole when it fits; else (SD/SDXL/FLUX images) layered, its high-resolution "
                        "stages module by module in row bands with exact statistics, when that fits; else in the "
                        "largest tiles / temporal chunks that fit, with whole-image statistics so tiles match the "
                        "untiled decode.",
            inputs=[
                io.Latent.Input("samples", tooltip="The latent to decode (image or video)."),
                io.Vae.Input("vae", tooltip="The VAE to decode with. Tiled seamlessly: SD/SDXL/FLUX/SD3 KL, Wan 2.1/2.2, "
                                           "HunyuanVideo 1.0/1.5, HunyuanImage 2.1, LTX-Video; any other VAE runs ComfyUI's own "
                                           "decode."),
                PLAN.Input("plan", optional=True, tooltip="A Levers plan. Its predicted VAE decode is reported (and "
                                                             "whether it was planned for this size); the node sizes the "
                                                             "decode from its own measurement of the VAE."),
                io.Int.Input("tile_size", default=0, min=0, max=4096, step=8,
                             tooltip="Tile size in output pixels, as in VAEDecodeTiled. 0 = auto: no tiling when the "
                                     "whole decode fits, else a layered decode (KL images) when it fits, else tiles "
                                     "that fit the budget with the least recomputed overlap."),
                io.Int.Input("overlap", default=0, min=0, max=4096, step=8,
                             tooltip="Overlap between tiles in output pixels. 0 = auto: twice the decoder's measured "
                                     "receptive field, which makes tiles exact. Smaller values are blended. An overlap "
                                     "not less than the tile is taken as a quarter of the tile, as VAEDecodeTiled "
                                     "takes it, with a line in the report."),
                io.Int.Input("temporal_size", default=0, min=0, max=4096, step=4,
                             tooltip="Video only: output frames per chunk. 0 = auto (whole video if it fits, else "
                                     "one latent frame at a time, or the decoder's own chunks where it has them; LTX "
                                     "on ComfyUI 0.8: the longest streamed chunk that fits). Chunks carry the causal "
                                     "cache (or stream each layer's context), so they are exact."),
                io.Int.Input("temporal_overlap", default=0, min=0, max=4096, step=4,
                             tooltip="Accepted for VAEDecodeTiled parity; not needed (chunks are exact), ignored."),
                io.Float.Input("memory_budget_gb", default=0.0, min=0.0, max=1024.0, step=0.25, round=0.001,
                               tooltip="Memory the decode may use, in GiB. 0 = 90% of the free memory on the VAE's "
                                       "device after unloading other models (less ComfyUI's --reserve-vram where "
                                       "that is more)."),
                io.Combo.Input("groupnorm_stats", options=["tiles", "windows", "exact"], default="tiles",
                               tooltip="KL VAEs (SD/SDXL/Flux, HunyuanVideo 1.0): where tiled stages get GroupNorm statistics. tiles: "
                                       "pooled over all tiles in one extra pass (accurate); windows: a sample "
                                       "(faster, less accurate, on small images below VAEDecodeTiled; images only); exact: whole image at once (untiled memory)."),
                io.Boolean.Input("unload_other_models", default=True,
                                 tooltip="Unload the diffusion model and text encoder through ComfyUI's memory "
                                         "manager before decoding (they reload on the next run). A model the "
                                         "plan keeps resident (on PhaseOffload, or in the connected plan) "
                                         "stays loaded."),
            ],
            outputs=[io.Image.Output(display_name="IMAGE",
                                     tooltip="The decoded images (video frames in order), as VAEDecode gives them."),
                     io.String.Output(display_name="report", tooltip=REPORT_TIP)],
        )

    @classmethod
    def execute(cls, samples, vae, plan=None, tile_size=0, overlap=0, temporal_size=0, temporal_overlap=0,
                memory_budget_gb=0.0, groupnorm_stats="tiles", unload_other_models=True) -> io.NodeOutput:
        settings = TiledDecodeSettings(tile_size=tile_size, overlap=overlap, temporal_size=temporal_size,
                                       temporal_overlap=temporal_overlap, memory_budget_gb=memory_budget_gb,
                                       stats=groupnorm_stats, free_other_models=unload_other_models)
        images, report = tiled_decode(vae, samples["samples"], settings, plan)
        return io.NodeOutput(images, report, ui=ui.PreviewText(report))


NODES = [LeversTiledVAEDecode]
