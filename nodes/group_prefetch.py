"""LeversGroupPrefetch: stream the diffusion model's blocks host->GPU with prefetch during sampling."""
from __future__ import annotations

from comfy_api.latest import io, ui

from . import REPORT_TIP
from ..bridge.prefetch import PlanBudget, attach_group_prefetch, plan_budget, plan_pin
from ..core.errors import ConfigError
from ..core.residency.prefetch import AUTO, PrefetchConfig

PLAN = io.Custom("LEVERS_PLAN")
_GIB = 1024 ** 3


def _auto(value: int, field: str, minimum: int):
    """Node ints use -1 for auto (0 is a real value for resident_groups)."""
    if value == -1:
        return AUTO
    if value < minimum:
        raise ConfigError(field, value, f"-1 (auto) or an integer >= {minimum}")
    return value


def settings_from(plan, blocks_per_group: int, prefetch_depth: int, resident_groups: int, vram_budget_gb: float,
                  packed: bool = False) -> tuple[PrefetchConfig, PlanBudget]:
    """Node inputs; a plan that streams the diffusion model gives the weights' VRAM budget when ``vram_budget_gb``
    is auto.

    Only the budget: the plan sizes its layout from the preset's block sizes, the node from the connected model's
    real blocks and the first step's measured compute, so the plan's group size, depth and resident count are
    not imposed (a resident count sized from other block sizes can overrun the very budget it came with). A plan
    that keeps the diffusion model whole on the GPU gives no budget: its byte count is the weights at the planned
    precision, not a share to stream within, and the model as connected may hold another precision."""
    g = _auto(blocks_per_group, "blocks_per_group", 1)
    d = _auto(prefetch_depth, "prefetch_depth", 1)
    r = _auto(resident_groups, "resident_groups", 0)
    if vram_budget_gb < 0:
        raise ConfigError("vram_budget_gb", vram_budget_gb, "0 (auto) or a positive number of GiB")
    config = PrefetchConfig(blocks_per_group=g, prefetch_depth=d, resident_groups=r, packed=bool(packed))
    if vram_budget_gb > 0:
        return config, PlanBudget(int(vram_budget_gb * _GIB))
    return config, plan_budget(plan)


class LeversGroupPrefetch(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="LeversGroupPrefetch",
            display_name="GroupPrefetch",
            category="Levers",
            description="Keeps a prefix of the diffusion model's blocks in VRAM and streams the rest from host memory "
                        "(pinned when the RAM allows) each step, copying group i+1 while group i computes. ComfyUI loads only the resident "
                        "part, so its memory manager sees the true VRAM use. Output is bit-identical to the "
                        "unstreamed model. Stands aside for models ComfyUI DynamicVRAM streams itself.",
            inputs=[
                io.Model.Input("model", tooltip="The diffusion model to stream (the input is not modified; a clone "
                                                "is returned)."),
                io.Int.Input("blocks_per_group", default=-1, min=-1, max=512,
                             tooltip="Blocks copied together. -1 = auto: chosen from the first step's measured compute "
                                     "and the measured host->GPU bandwidth. Bigger groups hide copies behind more "
                                     "compute but need bigger device slots."),
                io.Int.Input("prefetch_depth", default=-1, min=-1, max=16,
                             tooltip="Groups copied ahead of the one computing (device slots = depth + 1). -1 = auto."),
                io.Int.Input("resident_groups", default=-1, min=-1, max=512,
                             tooltip="Groups at the start of the model that stay in VRAM. 0 = stream every block. "
                                     "-1 = auto: as many as fit the budget after the slots."),
                io.Float.Input("vram_budget_gb", default=0.0, min=0.0, max=4096.0, step=0.25, round=0.01,
                               tooltip="VRAM (GiB) for this model's weights: resident part + slots. 0 = auto: what "
                                       "ComfyUI's own load would give this model (free memory plus what other loaded "
                                       "models hold, which ComfyUI unloads for it) minus this run's activations as "
                                       "ComfyUI estimates them (reference latents and ControlNets included) and the "
                                       "models loaded with it; or the diffusion-model share of a connected plan that "
                                       "streams it."),
                io.Boolean.Input("packed_bf16", default=False,
                                 tooltip="Stream bf16 weights losslessly packed: about 12 bits per weight instead of "
                                         "16 (sign+mantissa byte, 4-bit exponent code, rare escapes), unpacked on the "
                                         "GPU by a Triton kernel; output bit-identical. About 0.76x the bytes over "
                                         "the bus, which is the step time when streaming is copy-bound. Costs a "
                                         "packed host copy (~0.76x the streamed bytes, pinned instead of the bf16 "
                                         "copy), a one-time packing pass and a <=100 MiB staging buffer. Needs Triton "
                                         "on CUDA; otherwise the report says it is off."),
                io.Combo.Input("pin", options=["auto", "on", "off"], default="auto", optional=True,
                               tooltip="Page-lock the host copy of the streamed blocks (copies at full PCIe speed; "
                                       "pinned pages cannot be swapped out). auto = pin when the available RAM covers "
                                       "twice what Levers would then hold pinned (Windows and WSL caps apply), or as "
                                       "a connected plan that streams the model decided; on = pin regardless (fails "
                                       "soft); off = pageable."),
                PLAN.Input("plan", optional=True,
                           tooltip="A Levers plan from Recommend. When it streams the diffusion model, its "
                                   "diffusion-model VRAM share becomes the budget while vram_budget_gb is auto (if "
                                   "the connected model cannot stream within it, the auto budget is used and the "
                                   "report says why); when it keeps the model whole on the GPU, the budget stays "
                                   "auto. Group size, depth and resident blocks are sized from this model's real "
                                   "blocks and measured compute, within the budget."),
            ],
            outputs=[io.Model.Output(display_name="model",
                                     tooltip="A clone that streams its blocks; the input model is unchanged."),
                     io.String.Output(display_name="report", tooltip=REPORT_TIP)],
            hidden=[io.Hidden.unique_id],   # each sampling run's achieved numbers are shown on this node
        )

    @classmethod
    def execute(cls, model, blocks_per_group=-1, prefetch_depth=-1, resident_groups=-1, vram_budget_gb=0.0,
                packed_bf16=False, pin="auto", plan=None) -> io.NodeOutput:
        config, budget = settings_from(plan, blocks_per_group, prefetch_depth, resident_groups, vram_budget_gb,
                                       packed_bf16)
        pin_mode, pin_source = plan_pin(plan, pin)
        hidden = getattr(cls, "hidden", None)   # set by ComfyUI's executor; None when called directly
        clone, report = attach_group_prefetch(model, config, budget_bytes=budget.budget_bytes,
                                              node_id=getattr(hidden, "unique_id", None), plan_budget=budget,
                                              pin=pin_mode, pin_source=pin_source)
        return io.NodeOutput(clone, report, ui=ui.PreviewText(report))


NODES = [LeversGroupPrefetch]
