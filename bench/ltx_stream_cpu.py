"""LTX-Video's streamed temporal chunks on the CPU, at the real 0.9.5 decoder widths and a small frame size.

The GPU suite's ``ltx_streamed`` case (``bench/gpu_suite.py``) at a size a CPU can decode in minutes: the
peak is the live-tensor count (``core/tiling/memory.py``), the time is this machine's. Needs ComfyUI 0.8.0
(its LTX decoder runs all frames at once; 0.33's chunks time itself).

    python bench/ltx_stream_cpu.py --comfyui /path/to/ComfyUI-0.8 --latent 13 2 3 --out bench/results/x.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import types

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--comfyui", required=True, help="a ComfyUI 0.8.0 checkout")
    ap.add_argument("--latent", nargs=3, type=int, default=(13, 2, 3), metavar=("T", "H", "W"),
                    help="latent frames, height, width (13 2 3: 97 frames of 64x96 px)")
    ap.add_argument("--out", help="write the case's JSON here")
    args = ap.parse_args()
    import gpu_suite as gs
    import torch

    gs.DTYPE["value"] = torch.float32
    comfy = gs.ComfyBaseline(args.comfyui, torch.device("cpu"))
    if not comfy.ok:
        sys.exit(f"ComfyUI at {args.comfyui} did not import: {comfy.reason}")
    suite = types.SimpleNamespace(device=torch.device("cpu"), smoke=False, comfy=comfy)
    tiling = gs.Pieces().get("tiling")
    rec = gs._ltx_streamed_case(suite, tiling, tuple(args.latent))
    rec = {"machine": gs.machine_info(suite.device), "comfyui": comfy.version, "git": gs.git_info(None), **rec}
    text = json.dumps(rec, indent=1, default=str)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
