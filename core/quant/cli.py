"""``levers quantize IN OUT --format ...``: quantize a checkpoint once, load it many times."""
from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys

from ..errors import ConfigError, LeversError
from .census import ARCH_NAMES
from .registry import QuantConfig


def register_cli(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "quantize", help="quantize a .safetensors diffusion model to fp8 / int8 / nf4 (streaming)",
        description="Quantize a diffusion-model .safetensors tensor by tensor. fp8 per_tensor writes ComfyUI's "
                    "own layout (stock UNETLoader loads it from ComfyUI 0.3.7x on); other formats write the Levers "
                    "layout (Load Quantized DiT (Levers) reads both).")
    p.add_argument("input", metavar="IN", help="bf16/fp16/fp32 .safetensors (diffusion model or full checkpoint)")
    p.add_argument("output", metavar="OUT", help="output .safetensors (refused if it exists, unless --force)")
    p.add_argument("--format", required=True, choices=["fp8_e4m3fn", "fp8", "int8", "nf4"])
    p.add_argument("--granularity", default="auto", choices=["auto", "per_tensor", "per_row", "per_block"],
                   help="auto: fp8 per_tensor (ComfyUI-loadable), int8 per_row, nf4 per_block")
    p.add_argument("--block-size", type=int, default=64, help="weights per scale for per_block / nf4 (default 64)")
    p.add_argument("--arch", default="auto", choices=("auto",) + ARCH_NAMES,
                   help="architecture census to use (default: detect from key names)")
    p.add_argument("--keep-first-blocks", type=int, default=0)
    p.add_argument("--keep-last-blocks", type=int, default=0)
    p.add_argument("--extra-skip", default="", help="comma-separated name patterns to keep unquantized (globs ok)")
    p.add_argument("--quantize-modulation", action="store_true",
                   help="also quantize the adaLN/modulation linears inside the blocks (kept 16-bit by default; "
                        "27%% of FLUX's weights: what makes nf4 FLUX fit 8-12 GB cards)")
    p.add_argument("--force", action="store_true", help="overwrite OUT")
    p.add_argument("--no-sqnr", action="store_true", help="skip the per-layer SQNR measurement (faster)")
    p.set_defaults(func=run)
    return p


def _config(args) -> QuantConfig:
    gran = args.granularity
    if gran == "auto" and args.format in ("fp8", "fp8_e4m3fn"):
        gran = "per_tensor"  # the layout stock ComfyUI loads
    return QuantConfig(args.format, None if gran == "auto" else gran, block_size=args.block_size,
                       keep_first_blocks=args.keep_first_blocks, keep_last_blocks=args.keep_last_blocks,
                       extra_skip=args.extra_skip, quantize_modulation=args.quantize_modulation)


def _progress_bar():
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    state = {}

    def update(done: int, total: int, key: str) -> None:
        if tqdm is not None:
            bar = state.get("bar") or state.setdefault("bar", tqdm(total=total, unit="tensor", desc="quantize"))
            bar.update(done - bar.n)
            if done == total:
                bar.close()
        elif done == total or done % max(1, total // 20) == 0:
            # a terminal rewrites one line; a log or pipe gets one line per update (\r alone ran them together)
            tty = sys.stderr.isatty()
            print(f"\rquantize {done}/{total}" if tty else f"quantize {done}/{total}",
                  end="\n" if done == total or not tty else "", file=sys.stderr, flush=True)

    return update


# the QuantConfig field each error names, as the option the command line takes
FLAGS = {"format": "--format", "granularity": "--granularity", "block_size": "--block-size", "arch": "--arch",
         "keep_first_blocks": "--keep-first-blocks", "keep_last_blocks": "--keep-last-blocks",
         "extra_skip": "--extra-skip", "quantize_modulation": "--quantize-modulation"}


def _as_flags(exc: Exception) -> str:
    """An error's text with the config fields it names written as the command-line options (``--block-size=0``)."""
    text = str(exc)
    for name, flag in FLAGS.items():
        text = text.replace(f"{name}=", f"{flag}=")
    return text


def _check_paths(args) -> None:
    """IN and OUT problems, before the format's backend is imported (torchao prints library-loading
    warnings on import, which would bury a one-line error about a mistyped path)."""
    from .checkpoint import check_output_path, open_source, same_file

    if not os.path.exists(args.input):
        raise FileNotFoundError(f"IN {args.input} does not exist")
    if os.path.isdir(args.input):
        raise ConfigError("IN", args.input, "a .safetensors file", "It is a folder; name the file to quantize.")
    try:
        with open(args.input, "rb"):
            pass
    except PermissionError:       # safetensors reports it as a missing file
        raise ConfigError("IN", args.input, "a file you can read", "Permission denied: check its owner and mode "
                          "(e.g. chmod a+r).") from None
    with open_source(args.input):       # its header parses (the format's backend would print its noise first)
        pass
    if same_file(args.input, args.output):
        raise ConfigError("OUT", args.output, "a path different from IN", "Write to a new file, then rename it "
                          "yourself.")
    check_output_path(args.output, args.force)
    if not args.output.endswith((".safetensors", ".sft")):
        raise ConfigError("OUT", args.output, "a .safetensors file name", "ComfyUI's loaders list .safetensors files, "
                          f"e.g. {os.path.splitext(args.output)[0]}.safetensors.")


def _os_error_text(exc: OSError, args) -> str:
    """An OSError as one line naming the file (a temp file beside OUT counts as OUT)."""
    reason = exc.strerror or str(exc)
    name = exc.filename
    out_dir = os.path.dirname(os.path.abspath(args.output))
    if name is None or os.path.dirname(os.path.abspath(str(name))) == out_dir and \
            os.path.abspath(str(name)) != os.path.abspath(args.input):
        return (f"cannot write OUT {args.output} ({reason}{': ' + str(name) if name else ''}); choose a folder "
                f"you can write to and that has room for the output")
    return f"cannot read {name}: {reason}"


@contextlib.contextmanager
def _exit_on_sigterm():
    """SIGTERM (``timeout``, ``docker stop``, systemd) as an exception, so the writer's cleanup removes its
    scratch files beside OUT (the default action ends the process on the spot and leaves them, gigabytes for a
    real model) and the exit status is still 128 + 15."""
    def handler(signum, frame):
        raise SystemExit(128 + signum)
    try:
        old = signal.signal(signal.SIGTERM, handler)
    except ValueError:              # not the main thread: nothing to install
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def run(args) -> int:
    try:
        config = _config(args)
        _check_paths(args)
        from .checkpoint import quantize_file

        with _exit_on_sigterm():
            report = quantize_file(args.input, args.output, config, arch=None if args.arch == "auto" else args.arch,
                                   force=args.force, measure=not args.no_sqnr, progress=_progress_bar())
    except FileExistsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 3
    except (LeversError, ValueError, FileNotFoundError) as exc:
        print(f"error: {_as_flags(exc)}", file=sys.stderr)
        return 2
    except OSError as exc:          # a read-only or full disk, a folder without write permission
        print(f"error: {_os_error_text(exc, args)}", file=sys.stderr)
        return 2
    print(report.format_text())
    print(f"wrote {args.output}")
    return 0


def main(argv=None) -> int:  # standalone entry for `python -m comfyui_levers.core.quant.cli`
    parser = argparse.ArgumentParser(prog="levers")
    register_cli(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
