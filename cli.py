"""`levers` command line: recommend | demo | quantize | run | bench."""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

from . import __version__
from .core.errors import LeversError

# Subcommands provided by other modules, each exposing register_cli(subparsers), with the commands they add.
_PLUGGED = {"comfyui_levers.core.quant.cli": ("quantize",), "comfyui_levers.core.client": ("run",),
            "comfyui_levers.core.benchmark": ("bench",)}
TORCH_FIX = ("install torch first (pip install torch, or pip install 'comfyui-levers[torch]'); ComfyUI's own Python "
             "has it")


def _needs_torch(command: str) -> int:
    print(f"levers {command}: error: this command needs PyTorch, which this Python does not have: {TORCH_FIX}",
          file=sys.stderr)
    return 2


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"{v} must be at least 1")
    return v


def _demo_size(text: str) -> int:
    v = _positive_int(text)
    if v < 32 or v % 16 or v > 2048:
        raise argparse.ArgumentTypeError(f"{v} must be a multiple of 16 from 32 to 2048 (the demo's latent is 1/8 of "
                                         "the image and its DiT takes 2x2 patches; beyond 2048 px its CPU run takes "
                                         "minutes), e.g. 256")
    return v


def _add_recommend(sub) -> None:
    from .core.presets import PRESETS

    p = sub.add_parser("recommend", help="plan precision, placement and residency for a model on this (or a given) machine",
                       description="Without overrides, probes this machine (VRAM, host RAM, host->GPU bandwidth, libraries).")
    p.add_argument("--model", default="flux1-dev", help="preset: " + ", ".join(PRESETS))
    p.add_argument("--width", type=_positive_int)
    p.add_argument("--height", type=_positive_int)
    p.add_argument("--frames", type=_positive_int, help="video frames (video models)")
    p.add_argument("--steps", type=_positive_int)
    p.add_argument("--batch", type=_positive_int, default=1)
    p.add_argument("--no-cfg", action="store_true", help="no negative prompt (one DiT pass per step)")
    p.add_argument("--references", type=int, default=0,
                   help="reference images at the output size an edit model reads (FLUX Kontext, Qwen-Image-Edit): "
                        "their tokens join the sequence")
    p.add_argument("--vram-gb", type=float, help="plan for a card with this much memory (GiB); 0 plans for the CPU")
    p.add_argument("--ram-gb", type=float, help="host RAM available (GiB); plans keep 8%% of it (1.5-4 GiB) free for the OS and ComfyUI")
    p.add_argument("--h2d-gbps", type=float, help="host->GPU bandwidth (GB/s) instead of measuring")
    p.add_argument("--goal", default="balanced", choices=["fit", "balanced", "quality", "speed"])
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=_run_recommend)


def _run_recommend(args) -> int:
    from .core.plan import Workload, plan
    from .core.presets import get_preset
    from .core.probe import probe, synthetic_machine
    from .core.report import format_plan

    spec = get_preset(args.model)
    wl = Workload(width=args.width or spec.default_width, height=args.height or spec.default_height,
                  frames=args.frames or spec.default_frames, steps=args.steps or spec.default_steps,
                  batch=args.batch, cfg=not args.no_cfg, references=args.references)
    if args.vram_gb is None and args.ram_gb is None and args.h2d_gbps is None:
        machine = probe()
    else:
        machine = synthetic_machine(args.vram_gb, args.ram_gb, args.h2d_gbps)
    result = plan(spec, wl, machine, args.goal)
    if args.json:
        print(result.to_json())
    else:
        print(format_plan(result, machine))
    return 0


def _add_demo(sub) -> None:
    p = sub.add_parser("demo", help="run a tiny random-weight DiT + VAE pipeline with the plan's levers (no downloads)")
    p.add_argument("--steps", type=_positive_int, default=4)
    p.add_argument("--size", type=_demo_size, default=256, help="image size in pixels (a multiple of 16, 32-2048)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_run_demo)


def _run_demo(args) -> int:
    from .core.demo import run_demo

    report = run_demo(steps=args.steps, size=args.size)
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="levers", description="Fit big diffusion transformers on the GPU you have.")
    parser.add_argument("--version", action="version", version=f"levers {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    parser.needs_torch = set()
    _add_recommend(sub)
    _add_demo(sub)
    for mod, commands in _PLUGGED.items():
        try:
            module = importlib.import_module(mod)
        except (ModuleNotFoundError, OSError) as exc:
            if isinstance(exc, ModuleNotFoundError) and exc.name == mod:
                continue  # that subcommand is not part of this build
            if isinstance(exc, ModuleNotFoundError) and exc.name != "torch":
                raise
            # no torch, or a torch that does not load (a DLL it needs missing: OSError): the other commands work
            for command in commands:   # listed, and says what it needs when run (`levers run` needs no torch)
                sub.add_parser(command, help="(needs PyTorch, not usable here)")
                parser.needs_torch.add(command)
            continue
        module.register_cli(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in parser.needs_torch:
        return _needs_torch(argv[0])
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except ModuleNotFoundError as exc:
        if exc.name != "torch":
            raise
        return _needs_torch(args.command)
    except (LeversError, ValueError) as exc:
        print(f"levers {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"levers {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # the reader went away (``levers recommend | head -1``): not an error of this command; stdout is closed,
        # so point it at devnull before Python flushes it at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
