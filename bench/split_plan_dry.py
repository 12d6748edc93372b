"""GroupPrefetch's split plan for the suite's FLUX- or Wan-shaped DiT, computed without a GPU or the weights.

Builds the suite's model on the meta device, lays its blocks out the way the engine's HostStore does
(same tensor order and alignment, no arena allocated) and prints the split plan at a weights budget, with and
without spending the budget a common cap leaves over. The default budget is the H200 run's FLUX 12 GiB case
(bench/results/2026-11-30-h200-d.json: weights budget 11881656716 bytes, prefetch depth 1).

    python bench/split_plan_dry.py [--model flux|wan] [--budget BYTES] [--depth D] [--escape-rate R]

``--escape-rate R`` also plans the packed-bf16 stream (core/residency/packed.py) as if a share R of the
weights were escapes (0.0021: 10^8 Gaussian weights of sigma 0.02 gave 0.00015; the tests' layer mixtures up
to 0.0033), and prints the plan the engine would pick between packed and as stored (before timing: fewest
bytes over the bus).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_suite  # noqa: E402  (the suite's model shapes)

from comfyui_levers.core.residency import prefetch  # noqa: E402

GIB = 1024 ** 3


class DryStore(prefetch.HostStore):
    """The engine's layout of the blocks' tensors, without allocating or copying anything."""

    def _allocate_and_stage(self, transport, pin):
        self.arenas = {dtype: torch.empty(0, dtype=dtype) for dtype in self.block_range}


class DryPacked:
    """Stands in for a PackedArena: a fixed share of escapes in every range."""

    def __init__(self, rate: float):
        self.rate = rate

    def escapes(self, lo: int, hi: int) -> tuple[int, int]:
        return 0, int(round((hi - lo) * self.rate))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=("flux", "wan"), default="flux")
    p.add_argument("--budget", type=int, default=11881656716, help="weights budget in bytes")
    p.add_argument("--depth", type=int, default=1, help="prefetch depth (slots = depth + 1)")
    p.add_argument("--escape-rate", type=float, default=None,
                   help="also plan the packed-bf16 stream with this share of escaped weights")
    args = p.parse_args()
    with torch.device("meta"):
        if args.model == "flux":
            model = gpu_suite.FluxShaped(gpu_suite.FLUX, dtype=torch.bfloat16)
            blocks = [(f"double_blocks.{i}", b) for i, b in enumerate(model.double_blocks)]
            blocks += [(f"single_blocks.{i}", b) for i, b in enumerate(model.single_blocks)]
        else:
            model = gpu_suite.WanShaped(gpu_suite.WAN, dtype=torch.bfloat16)
            blocks = [(f"blocks.{i}", b) for i, b in enumerate(model.blocks)]
    store = DryStore(blocks, transport=None, pin=False)
    total = sum(t.numel() * t.element_size() for t in model.parameters())
    remainder = total - sum(store.block_bytes())
    print(f"{args.model.upper()}-shaped DiT: {store.n_blocks} blocks, {total / GIB:.2f} GiB ({remainder / GIB:.3f} GiB outside the "
          f"blocks); weights budget {args.budget / GIB:.2f} GiB, depth {args.depth}")
    fill = prefetch.spend_leftover
    for label, spend in (("common cap only", False), ("cap + leftover spent", True)):
        prefetch.spend_leftover = fill if spend else (lambda heads, cuts, spare, depth: tuple(cuts))
        try:
            found = prefetch._split_plan(store, args.depth, args.budget, remainder)
        finally:
            prefetch.spend_leftover = fill
        if found is None:
            print(f"{label:22s}: no split plan fits")
            continue
        cuts, need, slots, streamed = found
        print(f"{label:22s}: device {need / GIB:.2f} GiB (slots {slots / GIB:.3f}), streamed {streamed / GIB:.2f} "
              f"GiB per forward; streamed tensors per block: {sorted(set(cuts))}")
    if args.escape_rate is not None:
        store._planes = {torch.bfloat16: DryPacked(args.escape_rate)}
        cfg = prefetch.PrefetchConfig(1, args.depth, prefetch.AUTO, args.budget, packed=True)
        plan = prefetch.plan_groups(store, cfg, args.budget, remainder)
        store.use_packed = False
        plain = prefetch.plan_groups(store, cfg, args.budget, remainder)
        store.use_packed = True
        print(f"packed bf16 (escapes {args.escape_rate:.4%}): the planner picks "
              f"{'packed' if plan.packed else 'as stored'}: device {plan.device_bytes / GIB:.2f} GiB (slots + staging "
              f"{plan.slot_bytes / GIB:.3f}), {plan.streamed_bytes / GIB:.2f} GiB over the bus per forward against "
              f"{plain.streamed_bytes / GIB:.2f} GiB as stored ({plan.streamed_bytes / plain.streamed_bytes:.3f}x)")


if __name__ == "__main__":
    main()
