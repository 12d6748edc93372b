"""The `levers` CLI: recommend's JSON contract, clear errors, and the demo end to end."""
import json

import pytest

from comfyui_levers.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_recommend_json_has_the_documented_fields(capsys):
    code, out, _ = run(capsys, "recommend", "--model", "flux1-dev", "--vram-gb", "16", "--ram-gb", "64",
                       "--width", "1024", "--height", "1024", "--steps", "28", "--json")
    assert code == 0
    d = json.loads(out)
    for comp in ("diffusion_model", "text_encoder", "vae"):
        for key in ("precision", "device", "residency", "pin", "weight_bytes", "resident_bytes"):
            assert key in d["components"][comp]
    assert "streaming" in d["components"]["diffusion_model"]
    assert "tiling" in d["components"]["vae"]
    for key in ("activation_bytes", "vae_decode_peak_bytes", "predicted_peak_bytes", "predicted_extra_seconds",
                "fits", "notes"):
        assert key in d
    dm = d["components"]["diffusion_model"]
    assert (dm["precision"], dm["residency"]) == ("bf16", "streamed")   # lossless; the copy hides (tests/test_plan.py)
    assert d["predicted_peak_bytes"] < 16 * 2**30 and d["fits"] is True


def test_recommend_plans_the_reference_images_of_an_edit_model(capsys):
    argv = ("recommend", "--model", "flux1-dev", "--vram-gb", "16", "--ram-gb", "64", "--h2d-gbps", "25")
    _, plain, _ = run(capsys, *argv, "--json")
    code, edit, _ = run(capsys, *argv, "--references", "2", "--json")
    assert code == 0
    plain, edit = json.loads(plain), json.loads(edit)
    assert edit["workload"]["references"] == 2 and edit["activation_bytes"] > 2 * plain["activation_bytes"]
    _, text, _ = run(capsys, *argv, "--references", "2")
    assert "+ 2 reference images" in text


def test_recommend_without_overrides_probes_this_machine(capsys):
    code, out, _ = run(capsys, "recommend", "--model", "sdxl", "--json")
    assert code == 0
    d = json.loads(out)
    import torch

    if not torch.cuda.is_available():
        assert all(c["device"] == "cpu" for c in d["components"].values())


def test_recommend_text_report_has_a_table(capsys):
    code, out, _ = run(capsys, "recommend", "--model", "wan2.1-14b", "--vram-gb", "12", "--width", "832",
                       "--height", "480", "--frames", "81")
    assert code == 0
    assert "diffusion_model" in out and "predicted peak" in out and "GroupPrefetch" in out


@pytest.mark.parametrize("argv,needle", [
    (("recommend", "--model", "flux9"), "flux1-dev"),
    (("recommend", "--vram-gb", "-1"), "negative"),
    (("recommend", "--ram-gb", "0", "--vram-gb", "8"), "positive"),
    (("recommend", "--width", "1001", "--vram-gb", "8"), "multiple"),
    (("recommend", "--references", "-1", "--vram-gb", "8"), "references"),
])
def test_bad_input_is_a_clear_error(capsys, argv, needle):
    code, _, err = run(capsys, *argv)
    assert code == 2
    assert needle in err and "error" in err


def test_demo_runs_every_lever_and_keeps_lossless_ones_exact():
    from comfyui_levers.core.demo import run_demo

    report = run_demo(steps=2, size=128)
    levers = report.data["levers"]
    assert levers["PhaseOffload"]["ledger"]["d2h_bytes"] == 0
    assert levers["PhaseOffload"]["bit_identical"] is True
    assert levers["GroupPrefetch"]["bit_identical"] is True and levers["GroupPrefetch"]["d2h_bytes"] == 0
    assert levers["QuantizeDiT fp8"]["original_unchanged"] is True
    assert levers["QuantizeDiT fp8"]["bytes_after"] < 0.6 * levers["QuantizeDiT fp8"]["bytes_before"]
    assert levers["QuantizeDiT fp8"]["psnr_db"] > 30
    assert levers["TiledVAEDecode"]["psnr_db"] > 40
    assert "Levers plan" in report.text
    assert report.data["peak_memory_bytes"] > 0 and "peak memory" in report.text


@pytest.mark.parametrize("size", ["24", "40", "100", "16"])
def test_demo_size_that_the_tiny_pipeline_cannot_take_is_named(size, capsys):
    """Found in review: --size 24 or 40 (multiples of 8, not 16) crashed in the DiT's patchify with a traceback."""
    from comfyui_levers.cli import main

    with pytest.raises(SystemExit) as e:
        main(["demo", "--size", size])
    assert e.value.code == 2
    assert "--size" in capsys.readouterr().err


def _tiny_pipeline(size: int, steps: int):
    import torch

    from comfyui_levers.core import demo

    dit = demo.init_random_(demo.TinyDiT(), 0).eval()
    decoder = demo.init_random_(demo.TinyDecoder(), 1).eval()
    latent = torch.randn(1, 4, size // 8, size // 8, generator=torch.Generator().manual_seed(0))
    ref = demo.sample(dit, latent, steps)
    with torch.no_grad():
        image_ref = decoder(ref)
    return dit, decoder, latent, ref, image_ref, steps


@pytest.mark.parametrize("steps", [1, 3])
def test_demo_prefetch_counts_a_steady_step_apart_from_the_resident_groups_one_time_load(steps):
    """Found in review: at --steps 1 "streamed per step" was all 8 blocks: the resident group's first load
    was divided over the steps. 8 blocks in groups of 2 with 1 resident group stream 6 blocks a step."""
    from comfyui_levers.core.demo import _lever_prefetch

    line, info = _lever_prefetch(*_tiny_pipeline(32, steps))
    assert info["h2d_bytes_per_step"] == 6 * info["block_bytes"]
    assert info["h2d_bytes_once"] == 2 * info["block_bytes"]
    assert info["h2d_bytes_total"] == steps * info["h2d_bytes_per_step"] + info["h2d_bytes_once"]
    assert "streamed per step (6 blocks) after a one-time" in line and "(2 blocks)" in line


@pytest.mark.parametrize("size, tiles", [(128, 9), (48, 4), (32, 1)])
def test_demo_reports_the_tiles_the_decode_ran(size, tiles):
    """Found in review: the report said (h // tile) * (w // tile) = 4 tiles where the overlapping grid has 9."""
    from comfyui_levers.core.demo import _lever_tiled_vae
    from comfyui_levers.core.tiling import make_grid

    line, info = _lever_tiled_vae(*_tiny_pipeline(size, 1))
    h = size // 8
    tile = max(4, h // 2)
    assert info["tiles"] == tiles == len(make_grid(h, h, (tile, tile), max(2, tile // 4), 8, margin_px=16.0))
    assert line.startswith(f"{tiles} tile{'s' if tiles > 1 else ''} of {tile * 8}px")


def _tiny_checkpoint(tmp_path):
    import torch
    from safetensors.torch import save_file

    path = tmp_path / "in.safetensors"
    save_file({f"blocks.{i}.self_attn.q.weight": torch.randn(64, 64, dtype=torch.bfloat16) for i in range(2)},
              str(path))
    return str(path)


def test_quantize_into_a_folder_it_cannot_write_is_one_line(tmp_path, monkeypatch, capsys):
    """Found in review: OUT in a folder without write permission (/sys as root) ended in a PermissionError
    traceback. Root ignores chmod, so the refusal is simulated where the writer creates its file."""
    from comfyui_levers.core.quant import checkpoint

    def refuse(*args, dir=None, **kwargs):
        raise PermissionError(13, "Permission denied", f"{dir}/.levers-data-x")

    monkeypatch.setattr(checkpoint.tempfile, "mkstemp", refuse)
    out = tmp_path / "o.safetensors"
    code, _, err = run(capsys, "quantize", _tiny_checkpoint(tmp_path), str(out), "--format", "fp8", "--no-sqnr")
    assert code == 2
    assert err.startswith(f"error: cannot write OUT {out} (Permission denied"), err
    assert "Traceback" not in err and err.count("\n") == 1


def test_quantize_checks_in_and_out_before_loading_the_backend(tmp_path, monkeypatch, capsys):
    """Found in review: `--format int8` with a mistyped IN printed torchao's library-loading warnings first."""
    from comfyui_levers.core.quant import checkpoint

    def backend(*args, **kwargs):
        raise AssertionError("the backend was looked up before the paths were checked")

    monkeypatch.setattr(checkpoint, "get_quantizer", backend)
    code, _, err = run(capsys, "quantize", str(tmp_path / "missing.safetensors"), str(tmp_path / "o.safetensors"),
                       "--format", "int8")
    assert code == 2 and "missing.safetensors does not exist" in err
    (tmp_path / "o.safetensors").write_text("x")
    code, _, err = run(capsys, "quantize", _tiny_checkpoint(tmp_path), str(tmp_path / "o.safetensors"),
                       "--format", "int8")
    assert code == 3 and "exists; pass --force" in err


NO_TORCH = """
import builtins, sys
real = builtins.__import__
def blocked(name, *args, **kwargs):
    if name == "torch" or name.startswith("torch."):
        raise ModuleNotFoundError("No module named 'torch'", name="torch")
    return real(name, *args, **kwargs)
builtins.__import__ = blocked
from comfyui_levers.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("argv", [["--help"], ["quantize", "a.safetensors", "b.safetensors", "--format", "fp8"],
                                  ["bench", "--cpu", "--quick"], ["demo"],
                                  ["recommend", "--vram-gb", "8", "--ram-gb", "32", "--h2d-gbps", "10"],
                                  ["recommend"], ["run", "sdxl_8gb", "--set", "x"]])
def test_without_torch_every_command_says_what_it_needs_instead_of_a_traceback(argv):
    """torch is not a dependency (ComfyUI brings its own): `levers --help`, `levers recommend` (planning needs no
    torch) and `levers run` work without it, and a command that needs it says so (exit 2). Each crashed on the
    quantize module's torch import."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", NO_TORCH, *argv], capture_output=True, text=True, timeout=120)
    assert "Traceback" not in r.stderr, r.stderr
    if argv == ["--help"]:
        assert r.returncode == 0 and "quantize" in r.stdout and "needs PyTorch" in r.stdout
    elif argv[0] == "run":
        assert r.returncode == 2 and "NODE.INPUT=VALUE" in r.stderr, r.stderr    # the client needs no torch
    elif argv[0] == "recommend":
        assert r.returncode == 0 and "Levers plan: flux1-dev" in r.stdout, r.stderr
        if "--vram-gb" in argv:
            # a card given by size is planned with the formats this Python lacks (found in review: no torch here
            # dropped fp8 from the plan for another machine), and the note says so
            assert "formats assumed available on that machine" in r.stdout and "No module named 'torch'" in r.stdout
        else:
            assert "fp8_e4m3fn" not in r.stdout.split("\n\n")[1], r.stdout   # this machine, no torch: no fp8
    else:
        assert r.returncode == 2 and "needs PyTorch" in r.stderr and "pip install torch" in r.stderr, r.stderr


def test_a_torch_that_does_not_load_leaves_the_other_commands_working(monkeypatch):
    """A broken torch raises OSError on import (a DLL it needs missing), which build_parser let through: even
    `levers recommend --vram-gb 12 --ram-gb 32`, which needs no torch, died with a traceback."""
    import importlib

    from comfyui_levers import cli

    real = importlib.import_module

    def broken(name, *a, **k):
        if name in ("comfyui_levers.core.quant.cli", "comfyui_levers.core.benchmark"):
            raise OSError("[WinError 126] The specified module could not be found. Error loading fbgemm.dll")
        return real(name, *a, **k)
    monkeypatch.setattr(cli.importlib, "import_module", broken)
    parser = cli.build_parser()
    assert {"quantize", "bench"} <= parser.needs_torch
    assert cli.main(["quantize", "a.safetensors", "b.safetensors", "--format", "fp8"]) == 2
