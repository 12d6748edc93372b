"""Readable plan reports (shown on the Recommend node and printed by the CLI)."""
from __future__ import annotations

from .plan_types import Plan
from .probe import GiB, Machine


def gib(n: int | float) -> str:
    return f"{n / GiB:.2f} GiB"


def format_plan(plan: Plan, machine: Machine | None = None) -> str:
    lines = []
    m = plan.machine
    name = str(m.get("gpu"))
    target = ("CPU only" if not plan.vram_bytes else name if name.endswith("(assumed)")     # its size is in its name
              else f"{name} ({gib(plan.vram_bytes)})")
    wl = plan.workload
    shape = f"{wl.get('width')}x{wl.get('height')}" + (f"x{wl['frames']}f" if wl.get("frames", 1) > 1 else "")
    if wl.get("references"):
        shape += f" + {wl['references']} reference image{'s' if wl['references'] > 1 else ''}"
    lines.append(f"Levers plan: {plan.model} at {shape}, {wl.get('steps')} steps, batch {wl.get('batch')} "
                 f"on {target}; goal {plan.goal}")
    lines.append("")
    header = f"{'component':<16}{'precision':<12}{'device':<8}{'residency':<10}{'pin':<5}{'weights':>11}{'on GPU':>11}"
    lines.append(header)
    lines.append("-" * len(header))
    for c in plan.components:
        lines.append(f"{str(c.name):<16}{str(c.precision):<12}{c.device:<8}{str(c.residency):<10}"
                     f"{'yes' if c.pin else 'no':<5}{gib(c.weight_bytes):>11}{gib(c.resident_bytes):>11}")
    lines.append("")
    if plan.vram_bytes:
        verdict = "fits" if plan.fits else "DOES NOT FIT"
        lines.append(f"predicted peak {gib(plan.predicted_peak_bytes)} of {gib(plan.vram_bytes)} -> {verdict} "
                     f"(incl. {gib(plan.overhead_bytes)} CUDA context + fragmentation"
                     + (f"; {gib(plan.withheld_bytes)} more left to other programs, see the notes"
                        if plan.withheld_bytes else "") + ")")
        lines.append(f"activations per pass {gib(plan.activation_bytes)}; VAE decode untiled {gib(plan.vae_decode_peak_bytes)}"
                     + (f", tiled {gib(plan.vae.tiling.peak_bytes)}" if plan.vae.tiling else ""))
        if plan.fits:
            prec = wl.get("predicted_precision_seconds") or 0.0
            lines.append(f"extra seconds per generation from these levers: {plan.predicted_extra_seconds:.2f} s"
                         + (f"; {plan.diffusion_model.precision} compute {prec:+.2f} s against 16-bit" if prec else "")
                         + f" (predicted {wl.get('predicted_step_seconds')} s/step, "
                           f"~{wl.get('predicted_total_seconds')} s total)")
    else:
        tiling = plan.vae.tiling if plan.components else None
        decode = (f"VAE decode untiled {gib(plan.vae_decode_peak_bytes)}, in tiles {gib(tiling.peak_bytes)}"
                  if tiling is not None else f"VAE decode {gib(plan.vae_decode_peak_bytes)}")
        lines.append(f"activations per pass {gib(plan.activation_bytes)}; {decode}; "
                     f"{'fits' if plan.fits else 'DOES NOT FIT'} in host RAM")
    if plan.host_bytes:
        lines.append(f"host RAM for the host copies: {gib(plan.host_bytes)}"
                     + (f" (the diffusion model {plan.experts}x: one copy per expert)" if plan.experts > 1 else ""))
    for c in plan.components:
        for n in c.notes:
            lines.append(f"- {c.name}: {n}")
        if c.streaming:
            s = c.streaming
            lines.append(f"- {c.name}: GroupPrefetch {s.blocks_per_group} block(s)/group, prefetch depth "
                         f"{s.prefetch_depth}, {s.resident_groups} resident group(s) of {s.n_groups}"
                         + (f", slots of {gib(s.slot_bytes)} (the widest streamed group)" if s.slot_bytes else ""))
    for n in plan.notes:
        lines.append(f"- {n}")
    if machine is not None:
        libs = ", ".join(f"{k}: {'ok' if v.ok else 'no'}" for k, v in machine.libraries.items())
        lines.append(f"- machine: {machine.os}, host RAM "
                     + (f"{machine.ram_available_bytes / GiB:.0f} GiB available" if machine.ram_available_bytes else machine.ram_reason)
                     + f", H2D {machine.bandwidth.pinned_gbps:g} GB/s pinned / {machine.bandwidth.pageable_gbps:g} pageable "
                     + f"({machine.bandwidth.source}); {libs}")
        for k, v in machine.libraries.items():
            if not v.ok:
                lines.append(f"  - {k}: {v.reason}")
    return "\n".join(lines)
