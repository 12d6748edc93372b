"""Recommend's planner: the memory budget and offload-cost model of seeds 000-002 as pure functions.

``plan(spec, workload, machine, goal)`` enumerates per-component choices (precision, device,
residency, tiling), predicts each combination's peak VRAM and extra seconds, and picks one by
the user's goal. Lossless levers come before lossy ones (seed 001's order).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace

from .errors import ConfigError
from .plan_types import ComponentPlan, Plan, Streaming, Tiling
from .presets import BlockKind, ModelSpec, takes_references
from .probe import CPU_TFLOPS, GiB, Machine
from .types import Component, Goal, Precision, Residency

OVERHEAD_BYTES = int(1.5 * GiB)     # CUDA context + allocator fragmentation (seed 000: 1-2 GB)
# this process's CUDA context and loaded kernels: in OVERHEAD_BYTES, outside torch's allocator
CONTEXT_BYTES = int(0.75 * GiB)
COMFY_DEFAULT_RESERVE = {"windows": 600 * 2 ** 20}    # ComfyUI's own reserve without --reserve-vram (in OVERHEAD_BYTES)
COMFY_DEFAULT_RESERVE_ELSEWHERE = 400 * 2 ** 20
WITHHELD_NOISE = 256 * 2 ** 20      # other programs' VRAM below this is noise the overhead covers
EFFICIENCY = 0.45                   # achieved fraction of dense bf16 peak in eager mode (seed 001)
# fp8 on the linear part, from whole-DiT steps on an H200 (bench/results/2026-11-30-h200-*, torch 2.11):
FP8_GEMM_SPEEDUP = 1.15             # rowwise fp8 GEMM + fused activation quant: 1.06x (FLUX) to 1.24x (Wan)
FP8_DEQUANT_SLOWDOWN = 1.3          # dequantized per layer: 1.43x (FLUX) to 1.16x (Wan) slower
NF4_SLOWDOWN = 1.25                 # dequantize-then-bf16 (seed 000: 0.6-0.9x speed)
INT8_SLOWDOWN = 1.1
STREAM_HEADROOM = 0.92              # leave room in the budget when sizing streamed groups
PARTIAL_TE_MIN_BYTES = 1 * GiB      # the least of a too-big text encoder worth loading (ComfyUI streams the rest)
# An untiled VAE decode's seconds per GB of its planned activation peak at 989 dense TFLOP/s (an H200), scaled by the
# card's rate: FLUX's VAE at 1024² took 0.085 s for a planned 2.1 GB, Wan 2.1's 17 frames of 480x832 0.305 s for a
# planned 10.4 GB (bench/results/2026-11-30-h200-f.md, bf16); the larger ratio is kept.
VAE_DECODE_SECONDS_PER_GB = 0.04
REFERENCE_TFLOPS = 989.0
# quantizing the modulation linears too: half an fp8 step, so under 'balanced' it must buy ~17 % speed, more than the
# 0.3 streaming counts (a plan that quantized them only to avoid streaming was slower and lossier)
MODULATION_LOSS = 0.5
MAX_SIDE = 16384                    # ComfyUI's MAX_RESOLUTION, the node's width/height limit
LOSS_RANK = {Precision.FP32: 0, Precision.BF16: 0, Precision.FP16: 0, Precision.FP8_E4M3FN: 1,
             Precision.INT8: 1, Precision.NF4: 3}


@dataclass(frozen=True)
class Workload:
    width: int
    height: int
    frames: int = 1
    steps: int = 28
    batch: int = 1
    cfg: bool = True    # a negative prompt doubles the DiT batch (unless guidance-distilled)
    references: int = 0  # reference images at the output size whose tokens join the sequence (FLUX Kontext,
                         # Qwen-Image-Edit, FLUX 2 multi-reference)

    def validate(self) -> "Workload":
        for name in ("width", "height", "frames", "steps", "batch"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ConfigError(name, v, "a positive integer")
        if not isinstance(self.references, int) or not 0 <= self.references <= 16:
            raise ConfigError("references", self.references, "an integer from 0 to 16",
                              "The number of reference images an edit model reads (0 for text-to-image).")
        if self.width > MAX_SIDE or self.height > MAX_SIDE:
            raise ConfigError("width/height", (self.width, self.height), f"at most {MAX_SIDE} px",
                              "ComfyUI's largest image side (its MAX_RESOLUTION); use an upscaler beyond it.")
        if self.width % 8 or self.height % 8:
            raise ConfigError("width/height", (self.width, self.height), "multiples of 8",
                              "Latents are 1/8 of the image size; round to a multiple of 8 (e.g. 1024).")
        return self


# --- sizing -------------------------------------------------------------------------------------

def bytes_per_param(precision: Precision) -> float:
    return {Precision.FP32: 4, Precision.BF16: 2, Precision.FP16: 2, Precision.FP8_E4M3FN: 1,
            Precision.INT8: 1, Precision.NF4: 0.5 + 4 / 64}[precision]   # nf4: 4 bits + fp32 absmax per 64


def stored_precision(spec: ModelSpec) -> Precision | None:
    """The format a measured, already-quantized diffusion model is planned as (None: it can be cast or quantized)."""
    return Precision.parse(spec.dit_stored_precision, "dit_stored_precision") if spec.dit_stored_bytes else None


def dit_weight_bytes(spec: ModelSpec, precision: Precision, quantize_modulation: bool = False) -> int:
    """Diffusion-model bytes at ``precision``: the census keeps embedders, norms and the final layer in
    16-bit, and the adaLN/modulation linears too unless ``quantize_modulation``; fp8/int8 carry one
    fp32 scale per output row, nf4 one fp32 absmax per 64 weights. A model that is already quantized
    weighs what it holds."""
    if spec.dit_stored_bytes:
        return int(spec.dit_stored_bytes)
    if not precision.is_quantized:
        return int(spec.dit_params * bytes_per_param(precision))
    kept = spec.dit_kept_params + (0 if quantize_modulation else spec.modulation_params)
    quantized = spec.dit_params - kept
    scales = 4 * quantized / spec.hidden if precision is not Precision.NF4 else 0
    return int(quantized * bytes_per_param(precision) + kept * 2 + scales)


def _block_kinds(spec: ModelSpec) -> tuple[tuple[BlockKind, ...], float]:
    """The spec's kinds of blocks and the factor that maps their parameters onto the spec's blocks (1 for a preset;
    a measured model keeps its preset's proportions at its own size); none when they do not describe its
    ``n_blocks`` blocks (then every block is planned the same size)."""
    listed = sum(k.count * k.params for k in spec.blocks)
    if not spec.blocks or listed <= 0 or sum(k.count for k in spec.blocks) != spec.n_blocks:
        return (), 0.0
    return spec.blocks, spec.dit_params * spec.block_fraction / listed


def dit_block_bytes(spec: ModelSpec, precision: Precision, quantize_modulation: bool = False) -> list[int]:
    """Bytes of each repeated block at ``precision``, in execution order (the rest of ``dit_weight_bytes`` lies
    outside the blocks). A quantized block keeps its modulation linears 16-bit like the census does, so a FLUX
    double block (a third modulation) shrinks less than a single block (a fifth)."""
    total = dit_weight_bytes(spec, precision, quantize_modulation)
    kinds, scale = _block_kinds(spec)
    if not kinds:
        return [int(total * spec.block_fraction / spec.n_blocks)] * spec.n_blocks
    sizes = []
    for k in kinds:
        params = k.params * scale
        if spec.dit_stored_bytes or not precision.is_quantized:       # bytes in proportion to parameters
            nbytes = params * total / spec.dit_params
        else:
            kept = 0.0 if quantize_modulation else k.modulation * scale
            quantized = params - kept
            scales = 4 * quantized / spec.hidden if precision is not Precision.NF4 else 0
            nbytes = quantized * bytes_per_param(precision) + kept * 2 + scales
        sizes.extend([int(nbytes)] * k.count)
    return sizes


def sequence_tokens(spec: ModelSpec, wl: Workload) -> int:
    """Image (or video) tokens of one sequence, with the reference images' tokens an edit model appends (each
    reference at the output size: Kontext's and Qwen-Image-Edit's usual setting)."""
    n = spec.tokens(wl.width, wl.height, wl.frames)
    return n + wl.references * spec.image_tokens(wl.width, wl.height, 1)


def activation_bytes(spec: ModelSpec, wl: Workload) -> int:
    """One denoising pass's live activations (seed 000): tokens x (d + 3d + 4d) x 2 B, two copies in flight.

    One pass, not cond + uncond: ComfyUI splits the CFG batch into separate passes when memory is short."""
    n = sequence_tokens(spec, wl)
    per_layer = n * 8 * spec.hidden * 2
    return int(per_layer * 2 * wl.batch)


def dit_passes(spec: ModelSpec, wl: Workload) -> int:
    """Sequences per DiT call: cond + uncond are batched together unless the model is guidance-distilled."""
    return 1 if (spec.guidance_distilled or not wl.cfg) else 2


def te_activation_bytes(spec: ModelSpec) -> int:
    return int(spec.text_tokens * spec.te_hidden * 2 * 16)


def vae_decode_bytes(spec: ModelSpec, wl: Workload, tile_px: int | None = None, overlap_px: int = 0,
                     frames: int | None = None) -> int:
    """Decode activation peak for one sample (ComfyUI decodes a batch in slices)."""
    if tile_px is None:
        px = wl.width * wl.height
    else:
        px = min(wl.width, tile_px + 2 * overlap_px) * min(wl.height, tile_px + 2 * overlap_px)
    f = (frames if frames is not None else wl.frames) if spec.is_video else 1
    return int(px * f * spec.vae_bytes_per_px)


def vae_decode_seconds(spec: ModelSpec, wl: Workload, machine: Machine) -> float:
    """The untiled decode's seconds for one sample, from its planned activation bytes (``VAE_DECODE_SECONDS_PER_GB``)."""
    tflops = machine.gpu.tflops if machine.gpu else CPU_TFLOPS
    return VAE_DECODE_SECONDS_PER_GB * vae_decode_bytes(spec, wl) / 1e9 * REFERENCE_TFLOPS / max(1e-3, tflops)


def tiling_work(spec: ModelSpec, wl: Workload, tiling: Tiling) -> float:
    """The decoder work of a tiled decode relative to the whole decode: each boundary between tiles is decoded twice
    over its overlap on each side, so a side cut in n tiles costs (side + 2·overlap·(n - 1)) / side. Temporal chunks
    that carry their state (a causal cache, streamed units) recompute nothing; overlapping chunks recompute their
    overlap the same way. TiledVAEDecode's own exact plans (GroupNorm statistics, the layered decode) are its to
    time; this is the estimate Recommend plans with."""
    work = 1.0
    for side in (wl.width, wl.height):
        n = math.ceil(side / max(1, tiling.tile_px))
        if n > 1:
            work *= (side + 2 * tiling.overlap_px * (n - 1)) / side
    f = tiling.temporal_frames
    if spec.is_video and f and wl.frames > f and tiling.temporal_overlap:
        n = math.ceil(wl.frames / f)
        work *= (wl.frames + 2 * tiling.temporal_overlap * (n - 1)) / wl.frames
    return work


def step_flops(spec: ModelSpec, wl: Workload) -> tuple[float, float]:
    """(linear, attention) FLOPs of one step, 2 per weight and token in the blocks' linears. Image (and reference)
    tokens pass a dual-stream block's image weights, text tokens its text weights, every token the single-stream
    and shared ones (FLUX 1024²: 59.5 T linear + 14.9 T attention, seed 001's 74 TFLOPs); a token skips the routed
    experts its router leaves out (HiDream: 2 of 4). Modulation linears see
    one token; outside the blocks are embedders and the final layer, one token or a thin layer each: both left out."""
    n = sequence_tokens(spec, wl)
    n_text = spec.tokens(wl.width, wl.height, wl.frames) - spec.image_tokens(wl.width, wl.height, wl.frames)
    n_image = n - n_text
    kinds, scale = _block_kinds(spec)
    if kinds:
        # a mixture of experts' idle experts sit in the image stream (text tokens never pass them) or, in a block
        # without streams, in the weights every token passes
        per_pass = scale * sum(k.count * (n_image * (k.params - k.modulation - k.text_stream - k.idle)
                                          + n_text * (k.params - k.modulation - k.image_stream
                                                      - (0 if k.image_stream else k.idle))) for k in kinds)
    else:
        per_pass = n * max(0.0, spec.dit_params * spec.block_fraction - spec.modulation_params)
    mult = wl.batch * dit_passes(spec, wl)
    return 2 * per_pass * mult, 4 * spec.n_blocks * n * n * spec.hidden * mult


def compute_seconds_per_step(spec: ModelSpec, wl: Workload, machine: Machine, precision: Precision,
                             fp8_compute: bool) -> float:
    lin, attn = step_flops(spec, wl)
    tflops = machine.gpu.tflops if machine.gpu else CPU_TFLOPS
    rate = tflops * 1e12 * EFFICIENCY
    if precision is Precision.FP8_E4M3FN:
        f = spec.linear_fraction  # convolutions (UNets) keep their speed
        lin = lin * (f / FP8_GEMM_SPEEDUP + (1 - f)) if fp8_compute else lin * FP8_DEQUANT_SLOWDOWN
    elif precision is Precision.NF4:
        lin *= NF4_SLOWDOWN
    elif precision is Precision.INT8:
        lin *= INT8_SLOWDOWN
    return (lin + attn) / rate


# --- options ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _DitOption:
    precision: Precision
    residency: Residency
    weight_bytes: int
    resident_bytes: int
    streaming: Streaming | None
    extra_seconds_per_gen: float     # streaming cost (phase moves are added later)
    step_seconds: float
    quantize_modulation: bool = False


@dataclass(frozen=True)
class _TeOption:
    precision: Precision
    device: str
    residency: Residency
    weight_bytes: int
    gpu_bytes: int                   # bytes on the main GPU during encode
    extra_seconds: float
    loss: float
    note: str = ""
    partial: bool = False            # bigger than its room: ComfyUI's partial load (lowvram) runs it
    prompts: int = 1                 # encodes per generation (a negative prompt is a second one)


def stores_fp8(machine: Machine) -> bool:
    """Whether torch here can hold fp8 weights (unknown counts as yes): one that cannot cannot load fp8 files."""
    cap = machine.libraries.get("fp8_storage")
    return cap is None or cap.ok


def available_precisions(machine: Machine, notes: list[str]) -> list[Precision]:
    gpu = machine.gpu
    ladder = [Precision.BF16 if (gpu is None or gpu.bf16) else Precision.FP16]
    libs = machine.libraries
    for p, lib in ((Precision.FP8_E4M3FN, "fp8_storage"), (Precision.INT8, "torchao"), (Precision.NF4, "bitsandbytes")):
        cap = libs.get(lib)
        if cap is None or cap.ok:
            ladder.append(p)
        else:
            notes.append(f"{p} not considered: {cap.reason}")
    return ladder


def plan_streaming(spec: ModelSpec, precision: Precision, dit_budget: int, wl: Workload, machine: Machine,
                   step_seconds: float, pinned: bool = True, quantize_modulation: bool = False) -> Streaming | None:
    """Block groups that fit ``dit_budget``, laid out as GroupPrefetch lays them: the first groups in execution
    order stay resident (FLUX's are its big double blocks), the others stream through (depth + 1) slots that each
    hold the widest streamed group. Every block of a step is timed the same (a FLUX double and a single block pass
    a token through the same FLOPs); their bytes differ."""
    total = dit_weight_bytes(spec, precision, quantize_modulation)
    sizes = dit_block_bytes(spec, precision, quantize_modulation)
    n = len(sizes)
    rest = max(0, total - sum(sizes))
    bw = (machine.bandwidth.pinned_gbps if pinned else machine.bandwidth.pageable_gbps) * 1e9
    passes = dit_passes(spec, wl)
    per_block_compute = step_seconds / n / passes
    # Groups of at least ~64 MiB amortise per-copy overhead; video blocks are big enough alone.
    bpg = max(1, min(n, math.ceil(64 * 1024 ** 2 / max(1, sum(sizes) / n))))
    groups = [sum(sizes[i:i + bpg]) for i in range(0, n, bpg)]
    # depth 1: every byte past two slots buys resident groups (fewer bytes streamed); GroupPrefetch picks its
    # own depth from the measured step, so the plan's is only the layout it sized
    depth = 1
    usable = int(dit_budget * STREAM_HEADROOM) - rest
    if sum(groups) <= usable:
        return None  # everything fits: not a streaming plan
    # the longest resident prefix whose slots (for the groups after it) still fit
    resident = next((r for r in range(len(groups) - 1, -1, -1)
                     if sum(groups[:r]) + (depth + 1) * max(groups[r:]) <= usable), None)
    if resident is None:
        return None
    streamed_blocks = n - resident * bpg
    streamed = sum(sizes[resident * bpg:])
    t_block = streamed / streamed_blocks / bw
    return Streaming(n_blocks=n, blocks_per_group=bpg, prefetch_depth=depth, resident_groups=resident,
                     streamed_bytes_per_step=int(streamed * passes), block_bytes=round(streamed / streamed_blocks),
                     transfer_seconds_per_block=t_block, compute_seconds_per_block=per_block_compute,
                     hides_transfer=t_block <= per_block_compute, slot_bytes=max(groups[resident:]))


PACKED_WIRE_RATIO = 0.765    # packed bf16 bytes / bf16 bytes planned at the H200 budgets (split_plan_dry.py)


def packed_note(s: Streaming, machine: Machine, host_need: int = 0, room: int | None = None) -> str:
    """What GroupPrefetch's packed_bf16 would change for a copy-bound bf16 stream (computed, not timed); ``host_need``
    and ``room``: the plan's host copies and the host RAM they may take, to say when the packed copy would not fit."""
    t = s.transfer_seconds_per_block * PACKED_WIRE_RATIO
    line = (f"packed_bf16 on GroupPrefetch: about {s.streamed_bytes_per_step * PACKED_WIRE_RATIO / GiB:.1f} GiB per "
            f"step instead of {s.streamed_bytes_per_step / GiB:.1f}, {t * 1e3:.1f} ms copy per block vs "
            f"{s.compute_seconds_per_block * 1e3:.1f} ms compute ("
            + ("the copy would hide" if t <= s.compute_seconds_per_block else "still copy-bound, by less")
            + "); bit-identical output, +0.77x the streamed bytes in host RAM; computed, not yet timed on a GPU")
    cap = machine.libraries.get("triton")
    if cap is not None and not cap.ok:
        line += f"; unavailable here: {cap.reason}"
    packed = int(s.block_bytes * (s.n_blocks - s.resident_groups * s.blocks_per_group) * PACKED_WIRE_RATIO)
    if room is not None and host_need + packed > room:
        line += (f"; not with this RAM: the packed copy ({packed / GiB:.1f} GiB) beside the host copies "
                 f"({host_need / GiB:.1f} GiB) needs more than the {room / GiB:.1f} GiB free for them")
    return line


def fp8_matmuls(machine: Machine) -> bool:
    """Whether fp8 weights run as fp8 matmuls: an sm_89+ GPU and, inside ComfyUI, its quantized-tensor
    kernels (comfy-kitchen) — otherwise fp8 weights are dequantized per layer (slower than bf16)."""
    gpu = machine.gpu
    if gpu is None or not gpu.fp8_compute:
        return False
    if machine.comfyui:
        cap = machine.libraries.get("comfy_kitchen")
        return bool(cap is None or cap.ok)
    return True


def _dit_options(spec, wl, machine, budget, act, notes) -> list[_DitOption]:
    fp8c = fp8_matmuls(machine)
    stored = stored_precision(spec)
    if stored is not None:
        notes.append(f"the diffusion model is already quantized ({spec.dit_stored}, {spec.dit_stored_bytes / GiB:.2f} "
                     f"GiB): planned as it is stored (listed as {stored}); QuantizeDiT leaves it unchanged")
        return _dit_options_for(spec, wl, machine, budget, act, stored, False, fp8c)
    opts = []
    for p in available_precisions(machine, notes):
        for qmod in ((False, True) if p.is_quantized and spec.modulation_params else (False,)):
            opts.extend(_dit_options_for(spec, wl, machine, budget, act, p, qmod, fp8c))
    return opts


def _dit_options_for(spec, wl, machine, budget, act, p, qmod, fp8c) -> list[_DitOption]:
    opts = []
    wb = dit_weight_bytes(spec, p, qmod)
    step = compute_seconds_per_step(spec, wl, machine, p, fp8c)
    if wb + act <= budget:
        if spec.experts == 1:           # experts take turns on the GPU: never resident
            opts.append(_DitOption(p, Residency.RESIDENT, wb, wb, None, 0.0, step, qmod))
        opts.append(_DitOption(p, Residency.PHASE, wb, wb, None, 0.0, step, qmod))
    st = plan_streaming(spec, p, budget - act, wl, machine, step, quantize_modulation=qmod)
    if st is not None:
        streamed = st.streamed_bytes_per_step
        bw = machine.bandwidth.pinned_gbps * 1e9
        streamed_compute = step * (st.n_blocks - st.resident_groups * st.blocks_per_group) / st.n_blocks
        extra = wl.steps * max(0.0, streamed / bw - streamed_compute)
        # on the GPU: everything but the streamed blocks, plus the slots they stream through
        resident = wb - streamed // dit_passes(spec, wl) + st.slot_bytes * (st.prefetch_depth + 1)
        opts.append(_DitOption(p, Residency.STREAMED, wb, min(wb, resident), st, extra, step, qmod))
    return opts


def _te_options(spec, wl, machine, budget) -> list[_TeOption]:
    gpu = machine.gpu
    main = gpu.device if gpu else "cpu"
    te_act = te_activation_bytes(spec)
    bw = machine.bandwidth.pinned_gbps * 1e9
    opts = []
    p16 = Precision.BF16 if gpu.bf16 else Precision.FP16
    # a connected encoder already stored in fp8 (Recommend measured 1 byte a parameter) is planned as stored, at no
    # loss: a 16-bit (or fp32 CPU) copy would take twice (four times) the bytes for no better conditioning
    stored_fp8 = spec.te_dtype_bytes == 1
    # fp8 text encoders are what ComfyUI ships for T5/UMT5/Qwen-VL: nearly lossless for conditioning; a torch that
    # cannot store fp8 cannot load them either
    precisions = (((Precision.FP8_E4M3FN, 0.0),) if stored_fp8 else
                  ((p16, 0.0),) + (((Precision.FP8_E4M3FN, 0.2),) if stores_fp8(machine) else ()))
    room = budget - te_act                    # the encode phase has the card to itself (PhaseOffload)
    prompts = dit_passes(spec, wl)            # a CFG run encodes its negative prompt too
    for p, loss in precisions:
        wb = int(spec.te_params * bytes_per_param(p))
        if wb <= room:
            opts.append(_TeOption(p, main, Residency.RESIDENT, wb, wb + te_act, 0.0, loss))
            opts.append(_TeOption(p, main, Residency.PHASE, wb, wb + te_act, wb / bw, loss))
        elif room >= PARTIAL_TE_MIN_BYTES:
            # larger than the card in this precision (FLUX.2's 24 B Mistral on 8-16 GiB, a bf16 Qwen-VL on 8 GiB):
            # ComfyUI's own partial load keeps what fits the free memory during encode and casts the rest layer by
            # layer (its lowvram path), so that rest crosses the bus at every encode (the negative prompt too).
            # Planned with the least it needs on the GPU; its seconds come from the room the plan leaves it
            # (``_evaluate``). An encoder that fits the card whole is not offered this way: before loading it
            # ComfyUI frees room for all of it, unloading whatever else is loaded, so it would load whole.
            opts.append(_TeOption(p, main, Residency.PHASE, wb, te_act + PARTIAL_TE_MIN_BYTES,
                                  (room + prompts * (wb - room)) / bw, loss, partial=True, prompts=prompts))
    for g in machine.gpus[1:]:
        p2 = Precision.FP8_E4M3FN if stored_fp8 else Precision.BF16 if g.bf16 else Precision.FP16
        wb = int(spec.te_params * bytes_per_param(p2))
        if wb + te_act <= g.total_bytes - OVERHEAD_BYTES:
            opts.append(_TeOption(p2, g.device, Residency.RESIDENT, wb, 0,
                                  0.0, 0.0, f"text encoder lives on the second GPU {g.name}"))
            break
    cpu_seconds = 2 * spec.te_params * spec.text_tokens / (CPU_TFLOPS * 1e12)
    pc = Precision.FP8_E4M3FN if stored_fp8 else Precision.FP32        # fp8 as stored: ComfyUI casts it per op
    opts.append(_TeOption(pc, "cpu", Residency.CPU, int(spec.te_params * bytes_per_param(pc)), 0,
                          prompts * cpu_seconds, 0.0,
                          f"text encoder runs on the CPU in {'fp8 as stored, computed in fp32' if stored_fp8 else 'fp32'}"
                          f" (~{cpu_seconds:.0f} s per prompt" + (", the negative prompt too)" if prompts > 1 else ")"),
                          prompts=prompts))
    return opts


def plan_vae_tiling(spec: ModelSpec, wl: Workload, available: int) -> tuple[Tiling | None, int]:
    """Largest tiles (and for causal video VAEs, the longest temporal chunk) whose peak fits ``available``."""
    full = vae_decode_bytes(spec, wl)
    if full <= available:
        return None, full
    exact_chunks = spec.vae_causal or spec.vae_streamed          # chunks that need no temporal overlap
    frames_opts = [None]
    if spec.is_video and not spec.vae_whole_video:        # else tiles of the whole video, as TiledVAEDecode runs it
        t = spec.vae_temporal
        frames_opts = [f for f in (64, 32, 16, 8, t) if f < wl.frames] or [t]
        for f in frames_opts:  # temporal chunks alone, full frame
            peak = vae_decode_bytes(spec, wl, frames=f)
            if peak <= available:
                return Tiling(tile_px=max(wl.width, wl.height), overlap_px=0, temporal_frames=f,
                              temporal_overlap=0 if exact_chunks else max(1, f // 8), peak_bytes=peak), peak
    for tile in (1024, 768, 512, 384, 256, 192, 128):
        if tile >= max(wl.width, wl.height):
            continue
        overlap = max(16, tile // 8)
        f = frames_opts[-1]
        peak = vae_decode_bytes(spec, wl, tile, overlap, frames=f)
        if peak <= available:
            return Tiling(tile_px=tile, overlap_px=overlap, temporal_frames=f,
                          temporal_overlap=(0 if exact_chunks else 1) if f else 0, peak_bytes=peak), peak
    tile, overlap, f = 128, 16, frames_opts[-1]
    peak = vae_decode_bytes(spec, wl, tile, overlap, frames=f)
    return Tiling(tile_px=tile, overlap_px=overlap, temporal_frames=f, temporal_overlap=0, peak_bytes=peak), peak


# --- search -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Candidate:
    dit: _DitOption
    te: _TeOption
    vae_residency: Residency
    tiling: Tiling | None
    vae_peak: int
    peak: int
    extra: float
    total_seconds: float
    loss: float
    # the parts of ``extra`` that copy whole components to the GPU (phase loads, expert swaps, the text encoder's
    # load), timed at the pinned bandwidth, per component: diffusion model, text encoder, VAE (streaming is the DiT's)
    move_parts: tuple[float, float, float] = (0.0, 0.0, 0.0)
    # decided by ``_with_pinning`` before the goal chooses, so every candidate is timed at the bandwidth it will get
    pinned: tuple[bool, bool, bool] = (False, False, False)    # per component, as ``host``
    pin_reason: str = ""
    host: tuple[int, int, int] = (0, 0, 0)     # host-copy bytes: diffusion model, text encoder, VAE
    streaming: Streaming | None = None         # the DiT's streaming, retimed when its copies are pageable


def _evaluate(spec, wl, machine, budget, act, dit, te, vae_res) -> _Candidate | None:
    gpu_bf16 = machine.gpu.bf16
    vae_w = int(spec.vae_params * (2 if gpu_bf16 else 4))
    dit_res = dit.resident_bytes if dit.residency in (Residency.RESIDENT, Residency.STREAMED) else 0
    te_res = te.gpu_bytes if te.residency is Residency.RESIDENT else 0
    vae_res_b = vae_w if vae_res is Residency.RESIDENT else 0
    dit_always = dit.residency is Residency.RESIDENT
    if te.partial:
        # Before a load, ComfyUI frees room for the whole encoder (1.1x its size), unloading the diffusion model
        # first: a DiT planned to stay resident across the encode would be reloaded for every generation. The
        # encoder then loads what fits beside what is left and streams the rest at every encode.
        if dit_always:
            return None
        room = budget - te_activation_bytes(spec) - vae_res_b       # a resident VAE stays beside it
        if room < PARTIAL_TE_MIN_BYTES:
            return None
        streamed = te.weight_bytes - room
        te = replace(te, extra_seconds=(room + te.prompts * streamed) / (machine.bandwidth.pinned_gbps * 1e9),
                     note=f"larger than the room it has while encoding ({te.weight_bytes / GiB:.1f} GiB of weights, "
                          f"{room / GiB:.1f} GiB free after the CUDA context, its activations and what stays "
                          f"loaded): ComfyUI loads the part that fits ({room / GiB:.1f} GiB; the table's 'on GPU' "
                          f"is the least it needs) and streams the rest layer by layer (its lowvram path), about "
                          f"{streamed / GiB:.1f} GiB per encode")
    # A streamed DiT keeps its resident groups across phases only when that is cheaper; PhaseOffload
    # releases them before decode, so treat streamed like phase outside sampling.
    encode = te.gpu_bytes + (dit.resident_bytes if dit_always else 0) + vae_res_b
    sample = dit.resident_bytes + act + te_res + vae_res_b
    avail_decode = budget - vae_w - (dit.resident_bytes if dit_always else 0) - te_res
    if avail_decode <= 0:
        return None
    tiling, vae_peak = plan_vae_tiling(spec, wl, avail_decode)
    decode = vae_w + vae_peak + (dit.resident_bytes if dit_always else 0) + te_res
    peak = max(encode, sample, decode)
    if peak > budget:
        return None
    bw_pin = machine.bandwidth.pinned_gbps * 1e9
    moves = 0.0
    if dit.residency in (Residency.PHASE, Residency.STREAMED):
        moves += dit_res / bw_pin if dit.residency is Residency.STREAMED else dit.weight_bytes / bw_pin
    if spec.experts > 1:
        # experts take turns on the GPU: each loads (its resident part, when streamed) once per generation; the
        # first expert's load of a phase or streamed DiT is counted above
        if dit.residency is Residency.STREAMED:
            moves += (spec.experts - 1) * dit_res / bw_pin
        else:
            loads = spec.experts - 1 if dit.residency is Residency.PHASE else spec.experts
            moves += loads * dit.weight_bytes / bw_pin
    vae_move = vae_w / bw_pin if vae_res is Residency.PHASE else 0.0
    te_move = te.extra_seconds if te.residency is Residency.PHASE else 0.0    # on the CPU its seconds are compute
    extra = dit.extra_seconds_per_gen + te.extra_seconds + (moves + vae_move)
    if tiling is not None:      # the overlap the tiles decode twice (chunks that carry their state: none)
        extra += wl.batch * vae_decode_seconds(spec, wl, machine) * (tiling_work(spec, wl, tiling) - 1.0)
    total = dit.step_seconds * wl.steps + extra
    loss = LOSS_RANK[dit.precision] + te.loss + (MODULATION_LOSS if dit.quantize_modulation else 0.0)
    return _Candidate(dit, te, vae_res, tiling, vae_peak, peak, extra, total, loss, (moves, te_move, vae_move))


def _choose(cands: list[_Candidate], goal: Goal) -> _Candidate:
    def streams(c):
        return c.dit.residency is Residency.STREAMED

    if goal is Goal.QUALITY:
        return min(cands, key=lambda c: (c.loss, c.total_seconds, c.peak))
    if goal is Goal.SPEED:
        # within 0.5 % of the fastest is a tie (below what the time model can tell apart): the least lossy of those
        fastest = min(c.total_seconds for c in cands)
        near = [c for c in cands if c.total_seconds <= fastest * 1.005]
        return min(near, key=lambda c: (c.loss, c.total_seconds, c.peak))
    if goal is Goal.FIT:
        return min(cands, key=lambda c: (streams(c), c.peak, c.total_seconds))
    # balanced: a continuous trade: each lossy rank (fp8 = 1, nf4 = 3, fp8 text encoder = 0.2, modulation linears
    # quantized too = 0.5) is worth +33% time. Streaming every step also costs bus traffic and rests on the compute
    # estimate, so it counts 0.3. fp8 wins where it is markedly faster (image DiTs on fp8 tensor cores, or avoiding
    # slow streaming); lossless wins where the difference is small (attention-bound video DiTs).
    best = max(min(c.total_seconds for c in cands), 1e-9)     # a workload of no time: compare by the rest
    return min(cands, key=lambda c: (c.loss + (0.3 if streams(c) else 0.0) + 3.0 * (c.total_seconds / best - 1.0),
                                     c.total_seconds, c.peak))


def host_reserve(machine: Machine) -> int:
    """Host RAM a plan leaves free for the OS and ComfyUI's own process (Python, torch, decoded frames, the file a
    loader is reading): 8 % of the RAM, at least 1.5 GiB, at most 4 GiB."""
    ram = machine.ram_total_bytes or machine.ram_available_bytes or 0
    return int(min(4 * GiB, max(1.5 * GiB, 0.08 * ram)))


def host_room(machine: Machine) -> int | None:
    """Host RAM the plan's host copies may take (None when RAM is unknown)."""
    ram = machine.ram_available_bytes
    return None if ram is None else max(0, ram - host_reserve(machine))


def vram_withheld(machine: Machine) -> tuple[int, list[str]]:
    """VRAM a plan leaves alone beyond ``OVERHEAD_BYTES``, with a note for each part: what other programs held
    when the card was probed (a display, a browser, another process), and a ``--reserve-vram`` given to ComfyUI,
    above ComfyUI's default."""
    gpu, withheld, notes = machine.gpu, 0, []
    # under DynamicVRAM ComfyUI allocates outside torch's allocator itself: that memory is not another program's
    if gpu.others_bytes is not None and not machine.comfyui.get("dynamic_vram"):
        others = gpu.others_bytes - CONTEXT_BYTES
        if others >= WITHHELD_NOISE:
            withheld += others
            notes.append(f"{others / GiB:.2f} GiB of VRAM was in use by other programs when the card was probed "
                         "(a display, a browser, another process): planned without it")
    # only a --reserve-vram the user gave: ComfyUI's own default (more on Windows with a big card) is in the overhead
    reserve = machine.comfyui.get("extra_reserved_vram_bytes") if machine.comfyui.get("reserve_vram_gb") is not None \
        else None
    default = COMFY_DEFAULT_RESERVE.get(machine.os, COMFY_DEFAULT_RESERVE_ELSEWHERE)
    if reserve and reserve > default:
        withheld += reserve - default
        notes.append(f"ComfyUI keeps {reserve / GiB:.2f} GiB free for other programs (--reserve-vram): planned "
                     f"without the {(reserve - default) / GiB:.2f} GiB above its default")
    return withheld, notes


def pin_rule(pinned_set_bytes: int, machine: Machine) -> tuple[bool, str]:
    """Seed 002's rule, the same one PhaseOffload's pinned store applies (core.residency.pinned)."""
    from .pin_rule import pin_decision

    return pin_decision(pinned_set_bytes, machine.ram_available_bytes, machine.os, bool(machine.gpus),
                        total_ram_bytes=machine.ram_total_bytes)


def plan(spec: ModelSpec, wl: Workload, machine: Machine, goal: Goal | str = Goal.BALANCED) -> Plan:
    """The plan for ``spec`` on ``machine``; never raises for "does not fit" (``fits=False`` + notes)."""
    goal = Goal.parse(goal, "goal")
    wl.validate()
    notes: list[str] = list(machine.notes) + list(machine.comfyui.get("notes", ()))
    if wl.frames > 1 and not spec.is_video:
        notes.append(f"frames={wl.frames} ignored: {spec.name} is an image model (one frame per image; "
                     f"use batch for several images)")
    elif spec.is_video and wl.frames == 1 and spec.default_frames > 1:
        notes.append(f"frames=1: planned for a single frame; a {spec.name} video needs its length "
                     f"(e.g. {spec.default_frames} frames), and its activations and VAE decode grow with it")
    elif spec.is_video and spec.vae_temporal > 1 and (wl.frames - 1) % spec.vae_temporal:
        decoded = (spec.latent_frames(wl.frames) - 1) * spec.vae_temporal + 1
        notes.append(f"frames={wl.frames}: {spec.name}'s VAE decodes {spec.vae_temporal}n+1 frames, so ComfyUI's "
                     f"latent for this length gives {decoded} (use {decoded} or "
                     f"{decoded + spec.vae_temporal}); planned for {wl.frames}")
    v = spec.vae_spatial
    if wl.width < v or wl.height < v:
        # ComfyUI's latent nodes make no cell of a side below one: nothing to plan (and no time to compare plans by)
        least = (max(wl.width, v), max(wl.height, v))
        notes.append(f"size: {wl.width}x{wl.height} is below {spec.name}'s {v}-pixel latent cell, so ComfyUI's latent "
                     f"nodes make no cells for it; planned for {least[0]}x{least[1]}, the least size it samples")
        wl = replace(wl, width=least[0], height=least[1])
    if v > 8 and (wl.width % v or wl.height % v):
        notes.append(f"size: {wl.width}x{wl.height} is not a multiple of {spec.name}'s {v}-pixel latent cell: "
                     f"ComfyUI's latent nodes make {wl.width // v}x{wl.height // v} cells for it "
                     f"({wl.width // v * v}x{wl.height // v * v} px), which the DiT is planned for; use that size")
    if wl.references and not takes_references(spec):
        notes.append(f"reference_images={wl.references} ignored: {spec.name} takes no reference images into its "
                     f"sequence (ComfyUI's ReferenceLatent is for FLUX Kontext, FLUX.2, Qwen-Image-Edit and Z-Image); "
                     f"planned without them")
        wl = replace(wl, references=0)
    act = activation_bytes(spec, wl)
    workload = {"width": wl.width, "height": wl.height, "frames": wl.frames if spec.is_video else 1,
                "steps": wl.steps, "batch": wl.batch, "tokens": sequence_tokens(spec, wl),
                "references": wl.references,
                "dit_passes_per_step": dit_passes(spec, wl)}
    mdict = {"gpu": machine.gpu.name if machine.gpu else None, "vram_bytes": machine.gpu.total_bytes if machine.gpu else 0,
             "ram_available_bytes": machine.ram_available_bytes, "os": machine.os,
             "h2d_gbps": machine.bandwidth.pinned_gbps, "h2d_source": machine.bandwidth.source}
    if machine.gpu is None:
        return _cpu_plan(spec, wl, machine, goal, act, notes, workload, mdict)

    withheld, withheld_notes = vram_withheld(machine)
    notes.extend(withheld_notes)
    budget = machine.gpu.total_bytes - OVERHEAD_BYTES - withheld
    dits, cands = _candidates(spec, wl, machine, budget, act, notes)
    if not cands:
        return _no_fit_plan(spec, wl, machine, goal, act, notes, workload, mdict, dits, withheld,
                            fits_without_withheld=bool(withheld) and _any_fits(spec, wl, machine, budget + withheld,
                                                                                act))
    ram, room = machine.ram_available_bytes, host_room(machine)
    kept = (f"{ram / GiB:.1f} GiB available, {(ram - room) / GiB:.1f} of them kept for the OS and ComfyUI's own "
            "process" if ram is not None else "")
    in_ram = [c for c in cands if room is None or _host_need(spec, machine, c) <= room]
    if in_ram and len(in_ram) < len(cands):
        # a plan whose host copies do not fit the RAM pages them from disk every step: slower than predicted
        # by far. Plans that fit RAM come first.
        notes.append(f"host RAM ({kept}) rules out {len(cands) - len(in_ram)} of "
                     f"{len(cands)} plans that fit the GPU: their host copies would page")
    elif not in_ram:
        # none fits: every plan pages, and the more it keeps the more it pages; the goal picks among the plans
        # that keep the least (within 5 %)
        least = min(_host_need(spec, machine, c) for c in cands)
        in_ram = [c for c in cands if _host_need(spec, machine, c) <= 1.05 * least]
        notes.append(f"host RAM ({kept}) fits no plan's host copies: planned among those "
                     f"that keep the least ({least / GiB:.1f} GiB); the OS will page the rest")
    timed = [_with_pinning(spec, wl, machine, c) for c in in_ram]
    best = _choose(timed, goal)
    # the fastest plan keeping the modulation linears 16-bit in the same format, for the note that says why they are
    # quantized (a plan keeping them in a lossier format is no reason in seconds: it is one in precision)
    keeping = min((c.total_seconds for c in timed if not c.dit.quantize_modulation
                   and c.dit.precision is best.dit.precision), default=None)
    keeps_elsewhere = any(not c.dit.quantize_modulation for c in timed)
    return _assemble(spec, wl, machine, goal, act, best, notes, workload, mdict, withheld,
                     te_reason=_te_reason(best, cands, in_ram, goal), keeping_modulation_seconds=keeping,
                     modulation_needs_lossier=keeping is None and keeps_elsewhere)


def _candidates(spec, wl, machine, budget: int, act: int, notes: list[str]) -> tuple[list, list[_Candidate]]:
    """The DiT options, and every combination with a text encoder and a VAE residency whose peak fits ``budget``."""
    dits = _dit_options(spec, wl, machine, budget, act, notes)
    combos = itertools.product(dits, _te_options(spec, wl, machine, budget), (Residency.RESIDENT, Residency.PHASE))
    return dits, [c for c in (_evaluate(spec, wl, machine, budget, act, d, t, r) for d, t, r in combos)
                  if c is not None]


def _any_fits(spec, wl, machine, budget: int, act: int) -> bool:
    """Whether some plan fits ``budget`` (the card with nothing withheld: for the no-fit advice)."""
    return bool(_candidates(spec, wl, machine, budget, act, [])[1])


def _dit_moves(spec, c: _Candidate) -> bool:
    """Whether the DiT keeps host copies: a single resident DiT loads once and keeps none; experts swap at every
    generation, and PhaseOffload keeps (and pins) a host master of each, the one on the GPU included."""
    return c.dit.residency is not Residency.RESIDENT or spec.experts > 1


def _host_need(spec, machine, c: _Candidate) -> int:
    """Host bytes a plan keeps: the DiT when it moves (every expert), the text encoder when it is not resident,
    the VAE."""
    vae_w = int(spec.vae_params * (2 if machine.gpu.bf16 else 4))
    return (c.dit.weight_bytes * spec.experts * _dit_moves(spec, c)
            + (c.te.weight_bytes if c.te.residency is not Residency.RESIDENT else 0) + vae_w)


def _te_reason(best: _Candidate, cands: list[_Candidate], in_ram: list[_Candidate], goal: Goal) -> str:
    """Why the chosen plan's text encoder is fp8 and not 16-bit (empty when it is not fp8)."""
    if best.te.precision is not Precision.FP8_E4M3FN:
        return ""
    if best.te.partial:
        return "half the bytes over the bus and in host RAM"

    def te16(c):       # the same diffusion model with a 16-bit encoder in the same place
        return (c.dit == best.dit and c.te.device == best.te.device and c.te.residency is best.te.residency
                and c.te.precision in (Precision.BF16, Precision.FP16))
    if not any(te16(c) for c in cands):
        return ("16-bit does not fit beside the resident diffusion model" if best.te.residency is Residency.RESIDENT
                else "16-bit does not fit the encode phase")
    if not any(te16(c) for c in in_ram):
        return "the 16-bit copy does not fit host RAM beside the rest of the plan"
    return {Goal.FIT: "the smaller peak (goal 'fit')",
            Goal.SPEED: "half the bytes to load per encode: faster (goal 'speed')"}.get(
        goal, "half the bytes to load per encode; the 16-bit encoder would take longer than the goal allows")


def _with_pinning(spec, wl, machine, c: _Candidate) -> _Candidate:
    """``c`` with seed 002's pin decision for its host copies, and its seconds at the bandwidth that gives: pageable
    copies are slower, so a component's copies among the extra seconds are rescaled when its copy is pageable (the
    text encoder's load too; not a CPU encode or a tiled decode's recompute), and a streamed DiT's copies are timed
    at the pageable bandwidth (a copy that hides when pinned may not hide any more). Decided per component: when
    the rule refuses the whole set, the subset it allows that saves the most seconds is pinned (the streamed DiT's
    copies repeat every step; a text encoder's once per prompt). Decided before the goal chooses: a plan that is
    fastest only at the pinned bandwidth it will not get must not win."""
    vae_w = int(spec.vae_params * (2 if machine.gpu.bf16 else 4))
    host = (c.dit.weight_bytes * spec.experts if _dit_moves(spec, c) else 0,
            c.te.weight_bytes if c.te.residency is Residency.PHASE else 0,
            vae_w if c.vae_residency is Residency.PHASE else 0)
    # pinned copies are never slower (a pageable figure above the pinned one is a measurement's noise)
    ratio = max(1.0, machine.bandwidth.pinned_gbps / max(0.1, machine.bandwidth.pageable_gbps))
    rules: dict[int, tuple[bool, str]] = {}

    def rule(nbytes: int) -> tuple[bool, str]:
        if nbytes not in rules:
            rules[nbytes] = pin_rule(nbytes, machine)
        return rules[nbytes]

    best = None
    for mask in itertools.product((True, False), repeat=3):
        if any(m and not h for m, h in zip(mask, host)):
            continue                       # only a host copy can be pinned
        pinned_set = sum(h for m, h in zip(mask, host) if m)
        if pinned_set and not rule(pinned_set)[0]:
            continue
        extra, streaming = _pinned_seconds(wl, machine, c, mask, host, ratio)
        key = (extra, -pinned_set)         # the fewest seconds; at a tie, pin more (the rule allows it)
        if best is None or key < best[0]:
            best = (key, mask, extra, streaming)
    (_, neg_pinned), mask, extra, streaming = best
    whole_reason = rule(sum(host))[1]
    if not any(mask) or all(m or not h for m, h in zip(mask, host)):
        reason = whole_reason
    else:
        names = " and ".join(n for n, m in zip(("diffusion model", "text encoder", "VAE"), mask) if m)
        reason = (f"{names} pinned: {rule(-neg_pinned)[1]}; the rest pageable, as the whole set would not be: "
                  f"{whole_reason}")
    return replace(c, extra=extra, total_seconds=c.dit.step_seconds * wl.steps + extra, pinned=mask,
                   pin_reason=reason, host=host, streaming=streaming)


def _pinned_seconds(wl, machine, c: _Candidate, mask, host, ratio) -> tuple[float, Streaming | None]:
    """``c``'s extra seconds (and the DiT's streaming) with the host copies in ``mask`` pinned, the rest pageable.
    Summed in the order the set-wide decision summed them, so all-pinned and all-pageable give its exact numbers."""
    dit, te, vae = (part if h and not m else 0.0 for part, h, m in zip(c.move_parts, host, mask))
    moved = (dit + vae) + te
    if not (host[0] and not mask[0]):
        return c.extra + moved * (ratio - 1), c.dit.streaming
    streaming = c.dit.streaming
    dit_extra = c.dit.extra_seconds_per_gen * ratio
    if streaming is not None:
        # never faster than pinned (as ``ratio``); with ratio >= 1 this is the pageable figure, as it always was
        bw = max(0.1, min(machine.bandwidth.pageable_gbps, machine.bandwidth.pinned_gbps)) * 1e9
        t_block = streaming.block_bytes / bw
        streaming = replace(streaming, transfer_seconds_per_block=t_block,
                            hides_transfer=t_block <= streaming.compute_seconds_per_block)
        n_streamed = streaming.n_blocks - streaming.resident_groups * streaming.blocks_per_group
        dit_extra = wl.steps * max(0.0, streaming.streamed_bytes_per_step / bw
                                   - c.dit.step_seconds * n_streamed / streaming.n_blocks)
    return c.extra - c.dit.extra_seconds_per_gen + moved * (ratio - 1) + dit_extra, streaming


def _assemble(spec, wl, machine, goal, act, c: _Candidate, notes, workload, mdict, withheld=0, te_reason="",
              keeping_modulation_seconds=None, modulation_needs_lossier=False) -> Plan:
    gpu = machine.gpu
    bf16 = gpu.bf16
    vae_w = int(spec.vae_params * (2 if bf16 else 4))
    host = dict(zip((Component.DIFFUSION_MODEL, Component.TEXT_ENCODER, Component.VAE), c.host))
    moving = [m for m, h in zip(c.pinned, c.host) if h]
    notes.append(f"pinning: {'on' if moving and all(moving) else 'off' if not any(moving) else 'partial'} "
                 f"({c.pin_reason})")
    pin = dict(zip((Component.DIFFUSION_MODEL, Component.TEXT_ENCODER, Component.VAE), c.pinned))
    extra, streaming = c.extra, c.streaming
    dit_notes = []
    if c.dit.precision.is_quantized and stored_precision(spec) is None:     # QuantizeDiT's census, not a file's
        kept = spec.dit_kept_params + (0 if c.dit.quantize_modulation else spec.modulation_params)
        what = "embedders, norms and the final layer" + ("" if c.dit.quantize_modulation else ", and the adaLN/modulation linears")
        dit_notes.append(f"census keeps {kept / 1e9:.2f} B params in 16-bit ({what}); the block linears are "
                         f"{c.dit.precision} (~{bytes_per_param(c.dit.precision):g} byte/param)")
        if c.dit.quantize_modulation:
            t = keeping_modulation_seconds
            dit_notes.append("modulation linears quantized too: " + (
                "the smallest footprint (goal 'fit'); QuantizeDiT's modulation = keep keeps them 16-bit in a plan "
                "that takes more memory" if goal is Goal.FIT else
                f"the plans keeping them 16-bit need a lossier format than {c.dit.precision} here; QuantizeDiT's "
                "modulation = keep keeps them" if modulation_needs_lossier else
                "no plan keeping them 16-bit fits this card and its host RAM" if t is None else
                f"the fastest plan keeping them 16-bit takes {t - c.total_seconds:.2f} s more per generation "
                f"(goal '{goal}'); QuantizeDiT's modulation = keep keeps them"))
        if c.dit.precision is Precision.FP8_E4M3FN:
            dit_notes.append("fp8 matmuls on tensor cores (ComfyUI's scaled-fp8 layer)" if fp8_matmuls(machine) else
                             "no fp8 matmuls here (GPU below sm_89, or no comfy-kitchen in ComfyUI): fp8 weights "
                             "are dequantized per layer — a memory lever, ~"
                             f"{FP8_DEQUANT_SLOWDOWN:g}x slower linears as planned (1.16x Wan to 1.43x FLUX measured "
                             "on an H200)")
    if streaming is not None:
        s = streaming
        passes = dit_passes(spec, wl)
        dit_notes.append(f"streams {s.n_blocks - s.resident_groups * s.blocks_per_group} of {s.n_blocks} blocks per step "
                         f"({s.streamed_bytes_per_step / GiB:.1f} GiB"
                         + (f", {passes} passes: the prompt and the negative prompt" if passes > 1 else "")
                         + f") through {s.prefetch_depth + 1} slots of "
                         f"{s.slot_bytes / GiB:.2f} GiB; per block {s.transfer_seconds_per_block * 1e3:.1f} ms copy "
                         f"(mean of the streamed blocks) vs {s.compute_seconds_per_block * 1e3:.1f} ms compute: "
                         + ("the copy hides behind compute" if s.hides_transfer else "the copy cannot fully hide"))
        if not s.hides_transfer:
            dit_notes.append("copy-bound streaming: the step is the bus, for GroupPrefetch and ComfyUI's lowvram "
                             "alike (GroupPrefetch measured 0.93-0.97x ComfyUI's time for a FLUX-shaped DiT at "
                             "8-12 GiB on an H200, bench/results/2026-11-30-h200-c); fewer bytes are the lever: "
                             "fp8 weights (half, lossy) or GroupPrefetch's packed_bf16 (about 0.76x, bit-identical; "
                             "not yet timed on a GPU)")
            if c.dit.precision is Precision.BF16:
                dit_notes.append(packed_note(s, machine, _host_need(spec, machine, c), host_room(machine)))
    if spec.experts > 1:
        dit_notes.append(f"{spec.experts} experts share the GPU one at a time, each swapped in for its own steps: "
                         "connect the second to PhaseOffload's model_2 (one copy in, a pointer swap out), and a "
                         "GroupPrefetch after each when the plan streams")
    if machine.comfyui.get("dynamic_vram"):
        dit_notes.append("ComfyUI's DynamicVRAM streams a dynamic model itself and GroupPrefetch stands aside for it "
                         "(start ComfyUI with --disable-dynamic-vram to use it instead); a model ComfyUI loads the "
                         "legacy way (ComfyUI-GGUF, TorchCompileModel, QuantizeDiT's output) GroupPrefetch streams")
    dit_plan = ComponentPlan(Component.DIFFUSION_MODEL, c.dit.precision, gpu.device, c.dit.residency,
                             pin[Component.DIFFUSION_MODEL], c.dit.weight_bytes, c.dit.resident_bytes,
                             streaming=streaming, notes=tuple(dit_notes),
                             quantize_modulation=c.dit.quantize_modulation)
    te_notes = [c.te.note] if c.te.note else []
    if c.te.residency is Residency.PHASE:
        te_notes.append("on the GPU only while encoding; offload is a pointer swap back to the host copy")
    if c.te.precision is Precision.FP8_E4M3FN:
        te_notes.append(f"fp8 text encoder (as ComfyUI's *_fp8_e4m3fn text-encoder files): {te_reason}")
    te_plan = ComponentPlan(Component.TEXT_ENCODER, c.te.precision, c.te.device, c.te.residency,
                            pin[Component.TEXT_ENCODER], c.te.weight_bytes,
                            c.te.gpu_bytes if c.te.device == gpu.device else (c.te.weight_bytes if c.te.device != "cpu" else 0),
                            notes=tuple(te_notes))
    vae_notes = []
    if c.tiling is not None:
        t = c.tiling
        vae_notes.append(f"tiled decode (estimate; TiledVAEDecode measures the VAE and picks its own exact plan): "
                         + (f"{t.tile_px}px tiles, {t.overlap_px}px overlap" if t.tile_px < max(wl.width, wl.height)
                            else "whole frames")
                         + (f", {t.temporal_frames}-frame chunks" + (" with the causal cache carried (exact)" if spec.vae_causal
                                                                     else " streamed, each layer keeping its context "
                                                                     "frames (exact)" if spec.vae_streamed else "")
                            if t.temporal_frames else "")
                         + (", every frame in each tile (this decoder cannot be chunked in time)"
                            if spec.is_video and spec.vae_whole_video else "")
                         + f" -> peak {t.peak_bytes / GiB:.2f} GiB instead of {vae_decode_bytes(spec, wl) / GiB:.2f} GiB")
    vae_plan = ComponentPlan(Component.VAE, Precision.BF16 if bf16 else Precision.FP32, gpu.device, c.vae_residency,
                             pin[Component.VAE], vae_w, vae_w, tiling=c.tiling, notes=tuple(vae_notes))
    host_need, room = _host_need(spec, machine, c), host_room(machine)
    if room is not None and host_need > room:
        notes.append(f"host RAM: {room / GiB:.1f} GiB free for host copies (of {machine.ram_available_bytes / GiB:.1f} "
                     f"available) but they need {host_need / GiB:.1f} GiB; the OS will page (slow) — close other "
                     "programs or use smaller files")
    loaded_once = ((0 if _dit_moves(spec, c) else c.dit.weight_bytes)
                   + (c.te.weight_bytes if c.te.residency is Residency.RESIDENT else 0))
    if room is not None and loaded_once > room:
        notes.append(f"the models kept on the GPU ({loaded_once / GiB:.1f} GiB) are read through host RAM when they "
                     f"first load ({room / GiB:.1f} GiB free for them): that first load pages from disk")
    if machine.bandwidth.source != "measured":
        notes.append(f"host->GPU bandwidth {machine.bandwidth.pinned_gbps:g} GB/s ({machine.bandwidth.source}"
                     + (f": {machine.bandwidth.reason}" if machine.bandwidth.reason else "") + ")")
    notes.append(f"goal '{goal}': " + {Goal.BALANCED: "a lossy step (fp8) must buy more than ~33% speed",
                                       Goal.QUALITY: "least lossy plan that fits, whatever it costs in seconds",
                                       Goal.SPEED: "fastest predicted plan", Goal.FIT: "smallest peak, streaming last"}[goal])
    peak = c.peak + OVERHEAD_BYTES
    # what the DiT's precision does to compute, against the same model in 16-bit (not in the extra seconds, which
    # are what the levers add: moves, a CPU text encoder, a tiled decode's overlap): nf4 and dequantized fp8 cost
    # seconds, fp8 matmuls save some
    p16 = Precision.BF16 if bf16 else Precision.FP16
    precision_seconds = 0.0 if stored_precision(spec) is not None else \
        wl.steps * (c.dit.step_seconds - compute_seconds_per_step(spec, wl, machine, p16, False))
    return Plan(model=spec.name, goal=goal, budget_bytes=gpu.total_bytes - OVERHEAD_BYTES - withheld,
                vram_bytes=gpu.total_bytes, components=(dit_plan, te_plan, vae_plan), activation_bytes=act,
                vae_decode_peak_bytes=vae_decode_bytes(spec, wl), overhead_bytes=OVERHEAD_BYTES,
                predicted_peak_bytes=int(peak), predicted_extra_seconds=round(extra, 2),
                fits=peak + withheld <= gpu.total_bytes, notes=tuple(notes),
                workload={**workload, "predicted_step_seconds": round(c.dit.step_seconds, 3),
                          "predicted_total_seconds": round(c.dit.step_seconds * wl.steps + extra, 1),
                          "predicted_precision_seconds": round(precision_seconds, 2)},
                machine=mdict, host_bytes=int(host_need), experts=spec.experts, withheld_bytes=withheld)


def _cpu_plan(spec, wl, machine, goal, act, notes, workload, mdict) -> Plan:
    """No GPU: everything computes on the CPU. Weights may be stored smaller than fp32 (ComfyUI casts
    bf16/fp8 weights per op on the CPU), which is the only lever that matters for host RAM."""
    avail = host_room(machine)          # what the OS and ComfyUI's own process leave of the available RAM
    chosen = None
    stored = stored_precision(spec)
    for p in (Precision.FP32, Precision.BF16) + ((Precision.FP8_E4M3FN,) if stores_fp8(machine) else ()):
        dit_b = (int(spec.dit_params * bytes_per_param(p)) if p is not Precision.FP8_E4M3FN and stored is None
                 else dit_weight_bytes(spec, p))
        te_p = Precision.FP8_E4M3FN if spec.te_dtype_bytes == 1 else p    # an fp8 encoder stays as stored
        te_b = int(spec.te_params * bytes_per_param(te_p))
        weights = dit_b * spec.experts + te_b + int(spec.vae_params * 4)   # every expert in RAM
        # the decode runs once sampling is done (its activations gone), in tiles that fit what the weights leave
        # (TiledVAEDecode on the CPU); untiled, a Wan 720p video's decode alone is over 100 GiB
        tiling, vae_peak = (plan_vae_tiling(spec, wl, avail - weights) if avail is not None
                            else (None, vae_decode_bytes(spec, wl)))
        need = weights + max(act, vae_peak)
        chosen = (p, dit_b, te_p, te_b, weights, tiling, need)
        if avail is None or need <= avail:
            break
    p, dit_b, te_p, te_b, weights, tiling, need = chosen
    fits = avail is None or need <= avail
    notes.append("no GPU: every component computes on the CPU (ComfyUI's CPU path); nothing is pinned or moved")
    if stored is not None:
        notes.append(f"the diffusion model is already quantized ({spec.dit_stored}): kept as stored, dequantized per "
                     "layer while computing")
    if p is not Precision.FP32:
        notes.append(f"weights stored as {p} to fit host RAM, cast to fp32 per layer while computing")
    if tiling is not None:
        notes.append(f"the VAE decodes in tiles (TiledVAEDecode): the whole decode needs "
                     f"{vae_decode_bytes(spec, wl) / GiB:.1f} GiB of RAM, tiles {tiling.peak_bytes / GiB:.2f} GiB")
    if avail is not None and not fits:
        notes.append(f"host RAM {avail / GiB:.1f} GiB free for the run (of {machine.ram_available_bytes / GiB:.1f} "
                     f"available) < {need / GiB:.1f} GiB needed even with {p} weights: close "
                     "other programs, lower the resolution/frames or batch, or use a machine with more RAM or a GPU")
    comps = (ComponentPlan(Component.DIFFUSION_MODEL, stored or p, "cpu", Residency.CPU, False, dit_b, 0),
             ComponentPlan(Component.TEXT_ENCODER, te_p, "cpu", Residency.CPU, False, te_b, 0),
             ComponentPlan(Component.VAE, Precision.FP32, "cpu", Residency.CPU, False, int(spec.vae_params * 4), 0,
                           tiling=tiling))
    step = compute_seconds_per_step(spec, wl, machine, Precision.FP32, False)
    workload = {**workload, "predicted_step_seconds": round(step, 1), "predicted_total_seconds": round(step * wl.steps, 1),
                "host_bytes_needed": int(need)}
    return Plan(model=spec.name, goal=goal, budget_bytes=0, vram_bytes=0, components=comps,
                activation_bytes=act, vae_decode_peak_bytes=vae_decode_bytes(spec, wl), overhead_bytes=0,
                predicted_peak_bytes=0, predicted_extra_seconds=0.0, fits=fits, notes=tuple(notes),
                workload=workload, machine=mdict, host_bytes=int(weights), experts=spec.experts)


def _no_fit_plan(spec, wl, machine, goal, act, notes, workload, mdict, dits, withheld=0,
                 fits_without_withheld=False) -> Plan:
    """Nothing fits: return the smallest-footprint plan, marked ``fits=False``, with what to change."""
    gpu = machine.gpu
    smallest = min(dits, key=lambda d: d.resident_bytes) if dits else None
    if smallest is not None:
        p, residency, qmod = smallest.precision, smallest.residency, smallest.quantize_modulation
        wb, resident, streaming = smallest.weight_bytes, smallest.resident_bytes, smallest.streaming
    else:           # not even one streamed group fits: the smallest format this machine can use, loaded for its phase
        p, residency = stored_precision(spec) or available_precisions(machine, [])[-1], Residency.PHASE
        qmod = p.is_quantized and stored_precision(spec) is None and bool(spec.modulation_params)    # the smallest
        wb = resident = dit_weight_bytes(spec, p, qmod)
        streaming = None
    card = (f"{gpu.total_bytes / GiB:.1f}".rstrip("0").rstrip(".") + " GiB" if gpu.total_bytes >= 0.5 * GiB
            else f"{gpu.total_bytes / 2 ** 20:.0f} MiB")
    vae_p, vae_w = (Precision.BF16, int(spec.vae_params * 2)) if gpu.bf16 else (Precision.FP32, int(spec.vae_params * 4))
    budget = gpu.total_bytes - OVERHEAD_BYTES - withheld
    # the phases of the smallest plan (the text encoder on the CPU, the VAE in its smallest tiles), each on its own
    sample = resident + act
    tiling, vae_peak = plan_vae_tiling(spec, wl, 0)        # available 0: the smallest tiles it plans
    decode = vae_w + vae_peak
    short, fixes = [], []
    if budget <= 0:
        short.append(f"the card is below the {OVERHEAD_BYTES / GiB:.1f} GiB kept for the CUDA context and "
                     "fragmentation" + (" and what is withheld (see the notes above)" if withheld else ""))
    else:
        # the least the weights can take (two slots of the widest block, the rest outside the blocks): where no
        # streamed plan was sized (the activations alone leave no room), the sentence names that least, not the
        # whole model on the GPU (found in review: "nf4 weights on the GPU 7.8 GiB" where streaming needs ~1)
        sizes = dit_block_bytes(spec, p, qmod)
        least = dit_weight_bytes(spec, p, qmod) - sum(sizes) + 2 * max(sizes, default=0)
        on_gpu = resident if smallest is not None else min(resident, least)
        if on_gpu + act > budget:
            streams = residency is Residency.STREAMED or on_gpu < resident
            short.append(f"sampling needs {(on_gpu + act) / GiB:.1f} GiB ({p} weights on the GPU "
                         f"{'at least ' if smallest is None and streams else ''}{on_gpu / GiB:.1f} GiB"
                         f"{' with streaming' if streams else ''}, one step's activations {act / GiB:.1f} GiB)")
            # below the card, a smaller workload is what fits
            if least < budget:
                fixes.append("lower the resolution/frames or batch")
        if decode > budget:
            short.append(f"the VAE decode needs {decode / GiB:.1f} GiB (its weights {vae_w / GiB:.2f} GiB and its "
                         f"smallest tiles {vae_peak / GiB:.1f} GiB)")
            # the smallest tiles barely shrink with the image: the VAE on the CPU is what fits
            fixes.append("decode on the CPU (PhaseOffload's vae_device = cpu, TiledVAEDecode after it; slow)")
    if fits_without_withheld:
        fixes = ["close the programs holding VRAM (or lower --reserve-vram), see the notes above"]
    fixes.append("use a bigger card")
    advice = ", or ".join(fixes)
    notes.append(f"does not fit {card} ({max(0, budget) / GiB:.1f} GiB usable) even with {p} weights"
                 f"{' and streaming' if residency is Residency.STREAMED else ''}: " + "; ".join(short or ["no plan fits"])
                 + ". " + advice[0].upper() + advice[1:] + ".")
    te_cpu = Precision.FP8_E4M3FN if spec.te_dtype_bytes == 1 else Precision.FP32   # an fp8 encoder as stored
    comps = (ComponentPlan(Component.DIFFUSION_MODEL, p, gpu.device, residency, False, wb, resident,
                           streaming=streaming, quantize_modulation=qmod),
             ComponentPlan(Component.TEXT_ENCODER, te_cpu, "cpu", Residency.CPU, False,
                           int(spec.te_params * bytes_per_param(te_cpu)), 0),
             ComponentPlan(Component.VAE, vae_p, gpu.device, Residency.PHASE, False, vae_w, vae_w, tiling=tiling))
    peak = max(sample, decode) + OVERHEAD_BYTES
    host = int(wb * spec.experts + comps[1].weight_bytes + vae_w)
    room = host_room(machine)
    if room is not None and host > room:
        notes.append(f"host RAM: {room / GiB:.1f} GiB free for host copies (of {machine.ram_available_bytes / GiB:.1f} "
                     f"available), but this smallest plan needs {host / GiB:.1f} GiB: the RAM is short too")
    return Plan(model=spec.name, goal=goal, budget_bytes=max(0, gpu.total_bytes - OVERHEAD_BYTES - withheld),
                vram_bytes=gpu.total_bytes, components=comps, activation_bytes=act,
                vae_decode_peak_bytes=vae_decode_bytes(spec, wl), overhead_bytes=OVERHEAD_BYTES,
                predicted_peak_bytes=int(peak), predicted_extra_seconds=0.0, fits=False,
                notes=tuple(notes), workload=workload, machine=mdict, host_bytes=host, experts=spec.experts,
                withheld_bytes=withheld)
