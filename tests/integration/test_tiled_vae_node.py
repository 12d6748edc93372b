"""LeversTiledVAEDecode in a real ComfyUI (CPU): PSNR vs the untiled VAEDecode, next to ComfyUI's VAEDecodeTiled.

Two VAEs of ComfyUI's own classes with random weights: the tiny Wan 2.1 VAE from the ``tiny_wan``
fixture (loaded by VAELoader) and a small KL VAE (comfy.ldm.models.autoencoder.AutoencoderKL, the
SD/SDXL/Flux decoder with GroupNorm) built here at width 32 through ``comfy.sd.VAE(config=...)``
(VAELoader would build the full-width 128-channel decoder, too slow for a CPU test).
The measured numbers are printed (run with -s) and recorded in README.md (TiledVAEDecode).
"""
from __future__ import annotations

import math
import re

import pytest
import torch

from tiny_models import fill_random_


@pytest.fixture(autouse=True)
def _inference_mode():
    """ComfyUI's executor runs nodes under inference_mode; 0.33's VAEDecodeTiled relies on it (in-place output)."""
    with torch.inference_mode():
        yield


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    mse = float(((a.detach().float() - b.detach().float()) ** 2).mean())
    return math.inf if mse == 0 else 10 * math.log10(1.0 / mse)       # IMAGE is in [0, 1]


def node(comfy_env):
    from comfyui_levers.nodes.tiled_vae import LeversTiledVAEDecode
    return LeversTiledVAEDecode


def run_node(comfy_env, latent, vae, **kw):
    out = node(comfy_env).execute(latent, vae, **kw)
    return out.args[0], out.args[1]


def tiles_vs_comfy(comfy_env, vae, latent, tile, overlap, label):
    """Levers' tiles and ComfyUI's VAEDecodeTiled at the same tile size and overlap, both against VAEDecode.
    Returns (ours, ref, report, Levers PSNR, VAEDecodeTiled PSNR) and prints the two PSNRs (README table)."""
    ref = comfy_env.nodes.VAEDecode().decode(vae, latent)[0]
    comfy_tiled = comfy_env.nodes.VAEDecodeTiled().decode(vae, latent, tile, overlap, 64, 8)[0]
    ours, report = run_node(comfy_env, latent, vae, tile_size=tile, overlap=overlap)
    p_ours, p_comfy = psnr(ours, ref), psnr(comfy_tiled, ref)
    print(f"\n{label} {tuple(ref.shape)} tile {tile} overlap {overlap}: Levers {p_ours:.1f} dB, "
          f"VAEDecodeTiled {p_comfy:.1f} dB\n{report}")
    return ours, ref, report, p_ours, p_comfy


@pytest.fixture(scope="module")
def kl_vae(comfy_env):
    import comfy.sd
    from comfy.ldm.models.autoencoder import AutoencoderKL

    dd = dict(double_z=True, z_channels=16, resolution=256, in_channels=3, out_ch=3, ch=32, ch_mult=[1, 2, 4, 4],
              num_res_blocks=2, attn_resolutions=[], dropout=0.0)
    cfg = {"params": {"ddconfig": dd, "embed_dim": 16}}
    with torch.device("meta"):
        m = AutoencoderKL(**cfg["params"])
    sd = fill_random_({k: torch.empty(v.shape) for k, v in m.state_dict().items()}, seed=4)
    return comfy.sd.VAE(sd=sd, config=cfg)


def smooth_latent(shape, seed):
    """Random latent with some spatial structure (a sampler's output is not white noise)."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(shape, generator=g)
    lo = torch.randn(shape[:-2] + (shape[-2] // 4, shape[-1] // 4), generator=g)
    lo = torch.nn.functional.interpolate(lo.reshape(-1, *lo.shape[-3:]) if lo.ndim == 5 else lo,
                                         size=shape[-2:], mode="bilinear")
    return z * 0.5 + lo.reshape(shape) * 1.5


def test_kl_auto_fits_is_identical_to_vaedecode(comfy_env, kl_vae):
    latent = {"samples": smooth_latent((2, 16, 16, 24), 0)}
    ref = comfy_env.nodes.VAEDecode().decode(kl_vae, latent)[0]
    img, report = run_node(comfy_env, latent, kl_vae)
    assert "mode=whole" in report and "no tiling" in report
    assert torch.equal(img, ref)
    assert "temporal_size / temporal_overlap ignored" not in report
    # time settings on an image latent change nothing, and the report says they were ignored (they were silent)
    img, report = run_node(comfy_env, latent, kl_vae, temporal_size=8, temporal_overlap=4)
    assert torch.equal(img, ref) and "temporal_size / temporal_overlap ignored: an image latent" in report, report


def test_kl_tiles_beat_vaedecodetiled(comfy_env, kl_vae):
    latent = {"samples": smooth_latent((1, 16, 40, 40), 1)}
    ours, ref, report, p_ours, p_comfy = tiles_vs_comfy(comfy_env, kl_vae, latent, 192, 64, "KL")
    assert "mode=spatial" in report and ours.shape == ref.shape
    assert p_ours >= p_comfy + 10, (p_ours, p_comfy)
    assert p_ours >= 35


def test_kl_budget_picks_tiles_that_fit(comfy_env, kl_vae):
    """The planner's tiles for a 0.02 GB budget (whole needs 0.062): 8 tiles of 184x120 px computing 1.73x the
    image's pixels (the largest square that fits, 9 tiles of 152 px, computed 2.03x). ComfyUI's VAEDecodeTiled
    is given the larger side of our tile, so its tiles are at least as big as ours."""
    latent = {"samples": smooth_latent((1, 16, 40, 40), 2)}
    ref = comfy_env.nodes.VAEDecode().decode(kl_vae, latent)[0]
    ours, report = run_node(comfy_env, latent, kl_vae, memory_budget_gb=0.02)
    assert "mode=spatial" in report and "predicted peak" in report and "tail work=" in report, report
    comfy_tiled = comfy_env.nodes.VAEDecodeTiled().decode(kl_vae, latent, 184, 48, 64, 8)[0]
    p, p_comfy = psnr(ours, ref), psnr(comfy_tiled, ref)
    print(f"\nKL budget 0.02 GB: {p:.1f} dB, VAEDecodeTiled (tile 184, overlap 48) {p_comfy:.1f} dB\n{report}")
    assert p >= p_comfy + 5 and p >= 28, report


def test_kl_budget_just_below_the_whole_decode_runs_layered_and_exact(comfy_env, kl_vae):
    """A budget under the whole decode but above the layered decode's measured peak: the high-resolution
    stages run module by module in row bands with exact GroupNorm statistics, so the output is VAEDecode's up
    to float rounding (tiles would estimate the statistics), and the live tensors peak lower than VAEDecode's."""
    from comfyui_levers.core.tiling import measure_peak_bytes

    latent = {"samples": smooth_latent((1, 16, 40, 40), 2)}
    ref, whole = measure_peak_bytes(lambda: comfy_env.nodes.VAEDecode().decode(kl_vae, latent)[0], "cpu")
    (ours, report), layered = measure_peak_bytes(
        lambda: run_node(comfy_env, latent, kl_vae, memory_budget_gb=0.055, unload_other_models=False), "cpu")
    assert "mode=layered" in report and "exact GroupNorm statistics" in report, report
    assert "ResnetBlock 2" in report and "Upsample 1" in report, report      # rows of context, measured
    p = psnr(ours, ref)
    print(f"\nKL layered, budget 0.055 GB: {p:.1f} dB; live-tensor peak {layered.peak_bytes / 2**20:.1f} MiB "
          f"(node run, probes included) vs VAEDecode {whole.peak_bytes / 2**20:.1f} MiB\n{report}")
    assert p >= 90, report
    assert layered.peak_bytes < whole.peak_bytes, (layered.peak_bytes, whole.peak_bytes)


def test_the_default_budget_is_90_percent_of_the_free_memory(comfy_env, kl_vae, monkeypatch):
    """memory_budget_gb = 0 (the default) plans against 90 % of what ComfyUI reports free (found by mutation testing:
    every other test gives a budget, so 100 % passed them all). This decode needs about 0.062 GB whole and runs
    layered within 0.055: with 0.065 GB free it must not run whole, with 0.075 it does."""
    GIB = 1024 ** 3
    latent = {"samples": smooth_latent((1, 16, 40, 40), 2)}
    mm = comfy_env.mm
    monkeypatch.setattr(mm, "get_free_memory", lambda *a, **k: int(0.065 * GIB))
    _, report = run_node(comfy_env, latent, kl_vae, unload_other_models=False)
    assert "budget 90% of free memory" in report and "mode=whole" not in report, report
    monkeypatch.setattr(mm, "get_free_memory", lambda *a, **k: int(0.075 * GIB))
    _, report = run_node(comfy_env, latent, kl_vae, unload_other_models=False)
    assert "mode=whole" in report, report


def test_a_recommend_plan_is_reported_but_the_node_plans_from_its_measurement(comfy_env, kl_vae):
    """Recommend's tiling comes from a formula (overlap = tile / 8, below this VAE's receptive field): forcing it
    would blend seams. The node reports it and keeps its own measured plan, which here is the whole decode."""
    import types
    from comfyui_levers.core.plan_types import Tiling

    latent = {"samples": smooth_latent((1, 16, 24, 24), 11)}
    ref = comfy_env.nodes.VAEDecode().decode(kl_vae, latent)[0]
    plan = types.SimpleNamespace(vae=types.SimpleNamespace(
        tiling=Tiling(tile_px=128, overlap_px=16, temporal_frames=None, temporal_overlap=0, peak_bytes=1 << 20)))
    img, report = run_node(comfy_env, latent, kl_vae, plan=plan)
    assert "plan (Recommend) predicted a tiled decode: 128px tiles, 16px overlap" in report, report
    assert "mode=whole" in report and torch.equal(img, ref), report
    img, report = run_node(comfy_env, latent, kl_vae, plan=plan, tile_size=96)       # the node's own input wins
    assert "mode=spatial" in report and "tile=96x96px" in report, report


def test_a_plan_made_for_another_size_is_named_in_the_report(comfy_env, kl_vae):
    """A plan carries the workload it was made for; wired to a decode of another size, its VAE prediction is for
    another decode, and the report says so (before, it was reported as if it described this decode)."""
    import types

    latent = {"samples": smooth_latent((1, 16, 24, 24), 11)}           # decodes to 192x192
    def plan_for(width, height):
        return types.SimpleNamespace(vae=types.SimpleNamespace(tiling=None), vae_decode_peak_bytes=3 << 29,
                                     workload={"width": width, "height": height, "frames": 1})
    _, report = run_node(comfy_env, latent, kl_vae, plan=plan_for(192, 192))
    assert "plan (Recommend) predicted the whole decode, peak 1.50 GiB" in report, report
    assert "The plan was made for" not in report, report
    # a size that is not whole latent cells is what ComfyUI's latent nodes round down (found in review)
    _, report = run_node(comfy_env, latent, kl_vae, plan=plan_for(199, 197))
    assert "The plan was made for" not in report, report
    _, report = run_node(comfy_env, latent, kl_vae, plan=plan_for(1024, 1024))
    assert ("The plan was made for 1024x1024; this latent decodes to 192x192, so its prediction is for another "
            "decode") in report, report


def test_kl_budget_for_a_deeper_stem_tiles_only_the_last_stage(comfy_env, kl_vae):
    """Between the deeper stem's peak (stages up to 1/2 of the output scale whole) and the layered decode's, the
    node tiles only the last stage: fewer GroupNorms to estimate, a smaller receptive field, less overlap. The
    same budget without the deeper stem (the 1/4 split) is measured beside it."""
    from comfyui_levers.bridge import vae as bridge_vae

    latent = {"samples": smooth_latent((1, 16, 40, 40), 2)}
    ref = comfy_env.nodes.VAEDecode().decode(kl_vae, latent)[0]
    ours, report = run_node(comfy_env, latent, kl_vae, memory_budget_gb=0.042)
    assert "mode=spatial" in report and "deeper stem: the stages up to 1/2 of the output scale" in report, report
    original = bridge_vae.deeper_stems
    bridge_vae.deeper_stems = lambda vae, staged: []
    try:
        shallow, shallow_report = run_node(comfy_env, latent, kl_vae, memory_budget_gb=0.042)
    finally:
        bridge_vae.deeper_stems = original
    assert "deeper stem" not in shallow_report and "mode=spatial" in shallow_report
    p, p_shallow = psnr(ours, ref), psnr(shallow, ref)
    print(f"\nKL budget 0.042 GB: deeper stem {p:.1f} dB, 1/4 split {p_shallow:.1f} dB\n{report}\n--\n{shallow_report}")
    assert p >= 35 and p >= p_shallow, (p, p_shallow)


def test_free_memory_below_the_smallest_plan_falls_back_to_comfyuis_tiled_decode(comfy_env, kl_vae, monkeypatch):
    """When even Levers' smallest plan does not fit the free memory (no budget set), the node fails soft the way
    VAEDecode does on OOM: ComfyUI's own VAEDecodeTiled, tiles sized from the measured cost, and a report line.
    With a budget the user set, it says what the decode needs instead."""
    from comfyui_levers.bridge import vae as bridge_vae
    from comfyui_levers.core.errors import BudgetExceeded

    latent = {"samples": smooth_latent((1, 16, 24, 24), 13)}
    monkeypatch.setattr(bridge_vae, "budget_bytes", lambda vae, settings: (200_000, "budget 90% of free memory (test)"))
    img, report = run_node(comfy_env, latent, kl_vae)
    assert "mode=comfy_tiled" in report and "fallback: ComfyUI's VAEDecodeTiled" in report, report
    side = int(report.split("tile=")[1].split("x")[0])
    ref = comfy_env.nodes.VAEDecodeTiled().decode(kl_vae, latent, side, side // 4, 64, 8)[0]
    assert torch.equal(img, ref)
    monkeypatch.undo()
    with pytest.raises(BudgetExceeded, match=r"but only 0\.2 MiB is available.*Raise memory_budget_gb to at least") as e:
        run_node(comfy_env, latent, kl_vae, memory_budget_gb=0.0002)
    # the advised budget fits (it is rounded up: rounded to the nearest, it once advised the budget that failed)
    advised = float(str(e.value).split("at least ")[1].split(" ")[0])
    assert advised * 2 ** 30 >= e.value.needed_bytes, (advised, e.value.needed_bytes)
    img, report = run_node(comfy_env, latent, kl_vae, memory_budget_gb=advised)
    assert img.shape[1:3] == (192, 192), report


def test_an_auto_budget_of_nothing_falls_back_instead_of_failing(comfy_env, kl_vae, monkeypatch):
    """Found in review: with less free memory than ComfyUI's --reserve-vram (or under 2 bytes free) the auto budget
    was 0, which the planner refused as an invalid budget_bytes, an input the user never set, instead of taking
    ComfyUI's tiled decode as any budget too small does. The VAE's device reads as CUDA (no GPU here)."""
    from types import SimpleNamespace

    import comfy.cli_args

    from comfyui_levers.bridge import vae as bv

    GIB = 1024 ** 3
    monkeypatch.setattr(comfy_env.mm, "get_free_memory", lambda *a, **k: 2 * GIB)
    monkeypatch.setattr(comfy_env.mm, "extra_reserved_memory", lambda: 3 * GIB)
    monkeypatch.setattr(comfy.cli_args.args, "reserve_vram", 3.0)
    budget, line = bv.budget_bytes(SimpleNamespace(device="cuda:0"), bv.TiledDecodeSettings())
    assert budget >= 1 and "--reserve-vram" in line, (budget, line)
    monkeypatch.setattr(comfy_env.mm, "get_free_memory", lambda *a, **k: 1)
    assert bv.budget_bytes(SimpleNamespace(device="cpu"), bv.TiledDecodeSettings())[0] >= 1
    monkeypatch.undo()
    monkeypatch.setattr(bv, "budget_bytes", lambda vae, settings: (max(1, budget), line))
    img, report = run_node(comfy_env, {"samples": smooth_latent((1, 16, 24, 24), 13)}, kl_vae)
    assert img.shape[1:3] == (192, 192) and "fallback: ComfyUI's VAEDecodeTiled" in report, report


def test_unloading_the_other_models_leaves_the_vae_loaded(comfy_env, kl_vae, monkeypatch):
    """Found in review: ComfyUI's free_memory unloads every model on the device that is not kept, the VAE's own
    entry too, which load_models_gpu then copied back: a VAE round trip on every decode. The VAE's device reads as
    CUDA for the node's CPU check (no GPU here)."""
    from comfyui_levers.bridge import vae as bv

    mm = comfy_env.mm
    mm.load_models_gpu([kl_vae.patcher])
    entry = next(lm for lm in mm.current_loaded_models if lm.model is kl_vae.patcher)
    monkeypatch.setattr(kl_vae, "device", torch.device("cuda", 0))
    monkeypatch.setattr(bv, "_same_device", lambda a, b: True)
    monkeypatch.setattr(mm, "get_free_memory", lambda dev=None, torch_free_too=False: (0, 0) if torch_free_too else 0)
    line = bv.free_other_models(kl_vae)
    monkeypatch.undo()
    assert "unloaded other models" in line
    assert any(lm is entry for lm in mm.current_loaded_models), "the VAE was unloaded and loaded again"


def test_a_tile_size_over_the_budget_is_an_error_with_a_budget_set_and_a_warning_without(comfy_env, kl_vae,
                                                                                         monkeypatch):
    """Found in review: a tile_size set with a memory_budget_gb its tiles exceed was decoded anyway, silently (the
    report even said "of budget 0.001 GiB"). With a budget set, it is an error naming the budget it needs and the
    largest tile that fits (which then decodes within it); on the free memory, a warning, and the tiles asked for."""
    from comfyui_levers.bridge import vae as bridge_vae
    from comfyui_levers.core.errors import BudgetExceeded

    latent = {"samples": smooth_latent((1, 16, 13, 21), 5)}
    _, report = run_node(comfy_env, latent, kl_vae, tile_size=160)
    peak = float(report.split("predicted peak=")[1].split(" ")[0])
    budget = peak * 0.6
    with pytest.raises(BudgetExceeded, match=r"Raise memory_budget_gb to at least .*or set tile_size to \d+ px or less"
                       ) as e:
        run_node(comfy_env, latent, kl_vae, tile_size=160, memory_budget_gb=budget)
    fits = int(str(e.value).split("set tile_size to ")[1].split(" ")[0])
    assert fits < 160
    ref = comfy_env.nodes.VAEDecode().decode(kl_vae, latent)[0]
    img, report = run_node(comfy_env, latent, kl_vae, tile_size=fits, memory_budget_gb=budget)
    assert "mode=spatial" in report and img.shape == ref.shape, report
    assert float(report.split("predicted peak=")[1].split(" ")[0]) <= budget
    monkeypatch.setattr(bridge_vae, "budget_bytes",
                        lambda vae, settings: (int(budget * 2 ** 30), "budget 90% of free memory (test)"))
    img, report = run_node(comfy_env, latent, kl_vae, tile_size=160)
    assert "warning: tile_size 160 px is predicted to need" in report and f"set tile_size to {fits} px" in report
    assert "tile=104x160px" in report and img.shape == ref.shape, report      # the frame is 104 px high


def test_the_output_has_vaedecodes_dtype_in_every_mode(comfy_env, kl_vae, monkeypatch):
    """Found in review: with ComfyUI 0.33's --fp16-intermediates, VAEDecode returns float16, and so did the node's
    whole decode, while its tiled modes returned float32."""
    import comfy.model_management as mm
    import comfy.sd

    if not hasattr(comfy.sd.VAE, "vae_output_dtype"):
        pytest.skip("this ComfyUI's VAE has no output dtype of its own (float32 everywhere)")
    monkeypatch.setattr(mm, "intermediate_dtype", lambda: torch.float16)
    latent = {"samples": smooth_latent((1, 16, 13, 21), 5)}
    ref = comfy_env.nodes.VAEDecode().decode(kl_vae, latent)[0]
    assert ref.dtype == torch.float16
    for budget in (0.0, 0.006):             # whole, and tiled (or layered)
        img, report = run_node(comfy_env, latent, kl_vae, memory_budget_gb=budget)
        assert img.dtype == ref.dtype and img.shape == ref.shape, report


@pytest.mark.parametrize("mode,target", [("spatial", "decode_spatial"), ("layered", "decode_layered")])
def test_out_of_memory_in_levers_own_decode_falls_back_to_comfyuis_tiled_decode(comfy_env, kl_vae, monkeypatch, mode,
                                                                                  target):
    """Found in review: a prediction too low for the GPU met a raw CUDA out-of-memory error in Levers' own modes,
    where VAEDecode falls back to its tiled decode. Now so does the node, with a report line."""
    from comfyui_levers.bridge import vae as bridge_vae

    latent = {"samples": smooth_latent((1, 16, 24, 24), 13)}

    original = getattr(bridge_vae, target)

    def oom(*a, **k):
        if k.get("progress") is None:          # the planner's probe decode: let it run
            return original(*a, **k)
        raise torch.cuda.OutOfMemoryError("CUDA out of memory (test)")
    _, report = run_node(comfy_env, latent, kl_vae, memory_budget_gb=0.02 if mode == "layered" else 0.006)
    assert f"mode={mode}" in report, report
    monkeypatch.setattr(bridge_vae, target, oom)
    img, report = run_node(comfy_env, latent, kl_vae, memory_budget_gb=0.02 if mode == "layered" else 0.006)
    assert f"fallback: out of memory in the {mode} decode (OutOfMemoryError" in report, report
    side = int(report.split("VAEDecodeTiled instead, ")[1].split("px")[0])
    ref = comfy_env.nodes.VAEDecodeTiled().decode(kl_vae, latent, side, side // 4, 64, 8)[0]
    assert torch.equal(img, ref) and "tiles; GroupNorm" not in report and "layered:" not in report


def test_tile_settings_a_decode_without_tiles_does_not_use_are_named_in_the_report(comfy_env, kl_vae):
    """Found in review: an overlap or groupnorm_stats set on the node was dropped without a word when the whole
    decode fit (or the layered decode ran)."""
    latent = {"samples": smooth_latent((1, 16, 13, 21), 5)}
    _, report = run_node(comfy_env, latent, kl_vae, overlap=64, groupnorm_stats="windows")
    assert "mode=whole" in report
    assert "overlap 64 px and groupnorm_stats=windows not used: they apply to spatial tiles" in report, report
    _, report = run_node(comfy_env, latent, kl_vae)
    assert "not used" not in report


@pytest.fixture(scope="module")
def wan_vae(tiny_wan):
    from tiny_models import tiny_wan_vae_state_dict, wan_vae_loader_reads_width

    if wan_vae_loader_reads_width():
        return tiny_wan.load_vae()
    # ComfyUI 0.3.64's loader fixes the width at 96 (the spatial test alone then takes 11 minutes on a CPU): a
    # narrower subclass while comfy.sd.VAE detects and loads it, as for the other VAEs here
    import comfy.ldm.wan.vae as wanvae

    class NarrowWan(wanvae.WanVAE):
        def __init__(self, **kw):
            super().__init__(**{**kw, "dim": 16})

    vae = vae_with_swapped_classes(wanvae, {"WanVAE": NarrowWan}, tiny_wan_vae_state_dict(dim=16))
    assert vae.first_stage_model.decoder.head[0].gamma.shape[0] == 16
    return vae


def test_wan_temporal_chunks_match_untiled(comfy_env, wan_vae):
    latent = {"samples": smooth_latent((1, 16, 4, 12, 16), 3)}
    ref = comfy_env.nodes.VAEDecode().decode(wan_vae, latent)[0]
    ours, report = run_node(comfy_env, latent, wan_vae, temporal_size=4, memory_budget_gb=64)
    comfy_tiled = comfy_env.nodes.VAEDecodeTiled().decode(wan_vae, latent, 512, 64, 8, 4)[0]
    assert "mode=temporal" in report and ours.shape == ref.shape == (13, 96, 128, 3)
    p_ours, p_comfy = psnr(ours, ref), psnr(comfy_tiled, ref)
    pairs = hasattr(wan_vae.first_stage_model.decoder, "run_up")      # ComfyUI 0.33+: frame 0, then pairs
    print(f"\nWan temporal ({'the decoder' + chr(39) + 's own calls' if pairs else '1 latent frame'} per chunk): "
          f"Levers {p_ours:.1f} dB, VAEDecodeTiled (temporal_size 8, overlap 4) {p_comfy:.1f} dB\n{report}")
    if pairs:
        assert "chunk=2 latent frame(s)" in report and "own calls" in report
    assert torch.equal(ours, ref), p_ours        # same computation as VAEDecode: bit-exact on the CPU
    # VAEDecodeTiled-style settings: a tile covering the frame asks for no spatial tiles, not for no chunks
    covered, report = run_node(comfy_env, latent, wan_vae, tile_size=1024, temporal_size=4, memory_budget_gb=64)
    assert "mode=temporal" in report and "tile_size covers the whole 96x128px frame" in report, report
    assert torch.equal(covered, ref)


def test_wan_spatial_tiles_beat_vaedecodetiled(comfy_env, wan_vae):
    latent = {"samples": smooth_latent((1, 16, 2, 48, 48), 4)}
    ref = comfy_env.nodes.VAEDecode().decode(wan_vae, latent)[0]
    tile, overlap = 256, 224
    comfy_tiled = comfy_env.nodes.VAEDecodeTiled().decode(wan_vae, latent, tile, overlap // 2 * 2, 64, 8)[0]
    ours, report = run_node(comfy_env, latent, wan_vae, tile_size=tile, overlap=overlap)
    assert "mode=spatial" in report and ours.shape == ref.shape
    p_ours, p_comfy = psnr(ours, ref), psnr(comfy_tiled, ref)
    print(f"\nWan {tuple(ref.shape)} tile {tile} overlap {overlap}: Levers {p_ours:.1f} dB, "
          f"VAEDecodeTiled {p_comfy:.1f} dB\n{report}")
    assert p_ours >= p_comfy + 10, (p_ours, p_comfy)


def test_bad_inputs_name_the_field(comfy_env, kl_vae):
    from comfyui_levers.core.errors import ConfigError, IncompatibleInput

    latent = {"samples": torch.zeros(1, 16, 8, 8)}
    with pytest.raises(ConfigError, match="memory_budget_gb"):
        run_node(comfy_env, latent, kl_vae, memory_budget_gb=-1.0)
    with pytest.raises(IncompatibleInput, match="vae"):
        run_node(comfy_env, latent, object())


def test_vaedecodetiled_s_own_defaults_mean_the_same_here(comfy_env, kl_vae):
    """tile_size 64, overlap 64 (VAEDecodeTiled's minimum tile with its default overlap) were an error here:
    VAEDecodeTiled takes an overlap that does not fit as a quarter of the tile, and so does this node."""
    latent = {"samples": smooth_latent((1, 16, 24, 24), 5)}
    img, report = run_node(comfy_env, latent, kl_vae, tile_size=64, overlap=64)
    assert img.shape[1:3] == (192, 192)
    assert "overlap 64px is not less than the tile (64px): 16px" in report, report


def test_a_latent_from_another_model_family_is_named_with_the_fix(comfy_env, kl_vae, wan_vae):
    """An SDXL latent (4 channels) into a FLUX-type VAE (16), or a FLUX image latent into Wan's video VAE: ComfyUI's
    VAEDecode fails with a bare convolution or index error; the node says what does not match and what to connect.
    The VAE still decodes its own latents afterwards."""
    from comfyui_levers.core.errors import ConfigError

    with pytest.raises(ConfigError, match=r"samples.*4 channels.*16-channel latents.*connect the VAE that matches"):
        run_node(comfy_env, {"samples": torch.randn(1, 4, 16, 16)}, kl_vae)
    with pytest.raises(ConfigError, match=r"5-D video latent.*4-D image latent.*connect the VAE that matches"):
        run_node(comfy_env, {"samples": torch.randn(1, 16, 8, 8)}, wan_vae)
    latent = {"samples": torch.randn(1, 16, 8, 8)}
    ours, _ = run_node(comfy_env, latent, kl_vae)
    assert torch.equal(ours, comfy_env.nodes.VAEDecode().decode(kl_vae, latent)[0])


def test_a_video_latent_into_an_image_vae_decodes_its_first_frame_and_says_so(comfy_env, kl_vae):
    """Found in review: a Wan-shaped 5-D latent into a FLUX-type VAE decoded frame 0 in silence. It still decodes
    what VAEDecode decodes there (ComfyUI 0.8+), and the report's first line says the other frames were dropped."""
    latent = {"samples": torch.randn(1, 16, 3, 8, 8)}
    ours, report = run_node(comfy_env, latent, kl_vae)
    first, _ = run_node(comfy_env, {"samples": latent["samples"][:, :, 0]}, kl_vae)
    assert torch.equal(ours, first)
    assert report.splitlines()[0].startswith("a video latent of 3 frames into an image VAE: only its first frame"), report
    _, one = run_node(comfy_env, {"samples": torch.randn(1, 16, 1, 8, 8)}, kl_vae)
    assert "video latent" not in one


# ----------------------------------------------------------------------------------------------- Wan 2.2
def vae_with_swapped_classes(module, swaps: dict, sd: dict):
    """``comfy.sd.VAE(sd=sd)`` while ``module``'s classes named in ``swaps`` are replaced (restored at once):
    sd.py hard-codes the full widths, so the tests swap in narrower subclasses for ComfyUI to detect and load."""
    import comfy.sd

    originals = {name: getattr(module, name) for name in swaps}
    for name, cls in swaps.items():
        setattr(module, name, cls)
    try:
        return comfy.sd.VAE(sd=sd)
    finally:
        for name, cls in originals.items():
            setattr(module, name, cls)


@pytest.fixture(scope="module")
def wan22_vae(comfy_env):
    """A Wan 2.2 VAE (comfy.ldm.wan.vae2_2.WanVAE, 16x spatial, 48 latent channels) built by comfy.sd.VAE
    from a state dict, at width 8 instead of 160/256: sd.py hard-codes the widths, so the class is
    swapped for a narrower subclass while comfy.sd.VAE detects and loads it (restored at once)."""
    import comfy.ldm.wan.vae2_2 as wan22

    original = wan22.WanVAE

    class NarrowWanVAE(original):
        def __init__(self, **kw):
            super().__init__(**{**kw, "dim": 8, "dec_dim": 8})

    kw = dict(z_dim=48, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
              temperal_downsample=[False, True, True])
    with torch.device("meta"):
        shapes = NarrowWanVAE(**kw).state_dict()
    sd = fill_random_({k: torch.empty(v.shape) for k, v in shapes.items()}, seed=6)
    vae = vae_with_swapped_classes(wan22, {"WanVAE": NarrowWanVAE}, sd)
    assert vae.latent_channels == 48 and vae.upscale_ratio[-1] == 16
    return vae


def _kept_output(vae, frame_px: int, frames: int) -> int:
    """The finished frames a chunked decode keeps beside its chunks when ComfyUI's output device is the decode's
    (here, the CPU: both), float32 RGB: what the planner adds to a chunk's peak."""
    return frame_px * frames * 3 * 4 if torch.device(vae.output_device).type == torch.device(vae.device).type else 0


def test_wan22_budget_forces_exact_temporal_chunks(comfy_env, wan22_vae):
    """A budget between one chunk's peak and the whole video's (from the node's own measurement)."""
    from comfyui_levers.bridge.vae import describe_vae, measure_cost

    z = smooth_latent((1, 48, 3, 4, 6), 6)
    staged, _ = describe_vae(wan22_vae)
    cost, _, _ = measure_cost(wan22_vae, staged, z)
    frame_px = 4 * 6 * 16 * 16
    whole = cost.whole_bytes_per_px * frame_px + cost.output_bytes_per_px * frame_px * 9
    chunk = (cost.whole_bytes_per_px * frame_px + cost.output_bytes_per_px * frame_px * 4
             + _kept_output(wan22_vae, frame_px, 9))
    latent = {"samples": z}
    ref = comfy_env.nodes.VAEDecode().decode(wan22_vae, latent)[0]
    ours, report = run_node(comfy_env, latent, wan22_vae, memory_budget_gb=(whole + chunk) / 2 / 2 ** 30)
    comfy_tiled = comfy_env.nodes.VAEDecodeTiled().decode(wan22_vae, latent, 512, 64, 4, 4)[0]
    p_ours, p_comfy = psnr(ours, ref), psnr(comfy_tiled, ref)
    print(f"\nWan 2.2 temporal (budget-forced, 1 latent frame per chunk): Levers {p_ours:.1f} dB, VAEDecodeTiled "
          f"(temporal_size 4, overlap 4) {p_comfy:.1f} dB\n{report}")
    assert "Wan 2.2 VAE" in report and "mode=temporal" in report and "chunk=1 latent frame" in report, report
    assert ours.shape == ref.shape == (9, 64, 96, 3)
    assert torch.equal(ours, ref), p_ours


def test_wan22_spatial_tiles_beat_vaedecodetiled(comfy_env, wan22_vae):
    """One frame, tiled along the width; the overlap covers the tail's receptive field (radius ~196 px at
    16x: 24 convs 3x3 over the 4 upsampling stages and the head), given explicitly because a latent this
    small cannot show the node's probe the whole field."""
    latent = {"samples": smooth_latent((1, 48, 1, 8, 33), 7)}
    ours, ref, report, p_ours, p_comfy = tiles_vs_comfy(comfy_env, wan22_vae, latent, 464, 400, "Wan 2.2")
    assert "mode=spatial" in report and "2 tiles" in report and ours.shape == ref.shape == (1, 128, 528, 3)
    assert p_ours >= 60 and p_ours >= p_comfy + 10, (p_ours, p_comfy)


# ----------------------------------------------------------------------------------------- HunyuanVideo
@pytest.fixture(scope="module")
def hunyuan_vae(comfy_env):
    """A HunyuanVideo (1.0) VAE: the 3-D KL decoder (``conv3d=True``, 4x time, 8x space, carried causal
    convolutions, GroupNorm everywhere) that comfy.sd.VAE builds from a ``decoder.conv_in.conv.weight`` state
    dict, at width 32 instead of 128 (sd.py hard-codes the width: the class is swapped for a narrower
    subclass while comfy.sd.VAE detects and loads it, and restored at once)."""
    import comfy.sd

    original = comfy.sd.AutoencoderKL

    class NarrowKL(original):
        def __init__(self, ddconfig, embed_dim, **kw):
            super().__init__(ddconfig={**ddconfig, "ch": 32}, embed_dim=embed_dim, **kw)

    dd = {"double_z": True, "z_channels": 16, "resolution": 256, "in_channels": 3, "out_ch": 3, "ch": 128,
          "ch_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_resolutions": [], "dropout": 0.0,
          "conv3d": True, "time_compress": 4}
    with torch.device("meta"):
        shapes = NarrowKL(ddconfig=dd, embed_dim=16).state_dict()
    sd = fill_random_({k: torch.empty(v.shape) for k, v in shapes.items()}, seed=8)
    vae = vae_with_swapped_classes(comfy.sd, {"AutoencoderKL": NarrowKL}, sd)
    # carried causal convolutions from ComfyUI 0.3.7x on; 0.3.64's decoder runs every frame in one call
    assert vae.latent_dim == 3 and vae.upscale_ratio[-1] == 8
    return vae


@pytest.mark.parametrize("name,label,latent_shape,out_shape", [
    ("hunyuan_vae", "3-D KL decoder (HunyuanVideo)", (1, 16, 5, 6, 8), (17, 48, 64, 3)),
    ("hunyuan15_vae", "HunyuanVideo 1.5 VAE", (1, 32, 5, 4, 6), (17, 64, 96, 3)),
], ids=["hunyuan_1_0", "hunyuan_1_5"])
def test_hunyuan_temporal_chunks_are_its_own_calls_and_exact(comfy_env, request, name, label, latent_shape,
                                                            out_shape):
    vae = request.getfixturevalue(name)
    if name == "hunyuan_vae" and not getattr(vae.first_stage_model.decoder, "carried", False):
        pytest.skip("this ComfyUI's HunyuanVideo decoder takes every frame in one call (0.3.64): see "
                    "test_hunyuan_decoder_without_carried_convolutions_decodes_all_frames_per_tile")
    latent = {"samples": smooth_latent(latent_shape, 9)}
    ref = comfy_env.nodes.VAEDecode().decode(vae, latent)[0]
    ours, report = run_node(comfy_env, latent, vae, temporal_size=8, memory_budget_gb=64)
    comfy_tiled = comfy_env.nodes.VAEDecodeTiled().decode(vae, latent, 512, 64, 8, 4)[0]
    print(f"\n{label} temporal: Levers bit-exact, VAEDecodeTiled (temporal_size 8, overlap 4) "
          f"{psnr(comfy_tiled, ref):.1f} dB\n{report}")
    assert label in report and "mode=temporal" in report and "own calls" in report, report
    assert ours.shape == ref.shape == out_shape
    assert torch.equal(ours, ref)          # the decoder's own chunks, its outputs moved as they come
    assert "not used" not in report, report  # 8 frames are its own chunk of 2 latent frames
    # another temporal_size cannot be honoured: the report says so (it was dropped silently, found in review)
    other, report = run_node(comfy_env, latent, vae, temporal_size=4, memory_budget_gb=64)
    assert "temporal_size 4 not used: this decoder walks the frames in its own chunks" in report, report
    assert torch.equal(other, ref)


def test_hunyuan_spatial_tiles_beat_vaedecodetiled(comfy_env, hunyuan_vae):
    from comfyui_levers.core.errors import ConfigError

    """GroupNorm statistics pooled over the tiles (one pass) are an estimate: not exact like the Wan VAE's tiles,
    and on random weights the error compounds over 13 norm layers (the KL decoder's real weights gave 54.8 dB)."""
    latent = {"samples": smooth_latent((1, 16, 2, 32, 32), 10)}
    tile, overlap = 128, 64
    ours, ref, report, p_ours, p_comfy = tiles_vs_comfy(comfy_env, hunyuan_vae, latent, tile, overlap, "HunyuanVideo")
    assert "mode=spatial" in report and "9 tiles" in report and ours.shape == ref.shape == (5, 256, 256, 3), report
    assert "statistics estimated" in report
    assert p_ours >= p_comfy + 10 and p_ours >= 30, (p_ours, p_comfy)
    with pytest.raises(ConfigError, match="groupnorm_stats"):
        run_node(comfy_env, latent, hunyuan_vae, tile_size=tile, overlap=overlap, groupnorm_stats="windows")


@pytest.fixture(scope="module")
def hunyuan15_vae(comfy_env):
    """A HunyuanVideo 1.5 VAE (``comfy.ldm.hunyuan_video.vae_refiner``: 16x space, 4x time, 32 latent channels,
    carried causal convolutions, per-pixel RMS norms) that comfy.sd.VAE detects from its state dict, with
    block widths (32, 32, 32, 16, 8) instead of (128 .. 1024): sd.py hard-codes them, so the encoder and decoder
    classes are swapped for narrower subclasses while comfy.sd.VAE builds it (restored at once)."""
    import comfy.ldm.hunyuan_video.vae_refiner as refiner

    widths = [8, 16, 32, 32, 32]
    originals = refiner.Encoder, refiner.Decoder

    class NarrowEncoder(originals[0]):
        def __init__(self, **kw):
            super().__init__(**{**kw, "block_out_channels": widths})

    class NarrowDecoder(originals[1]):
        def __init__(self, **kw):
            super().__init__(**{**kw, "block_out_channels": widths})

    cfg = dict(block_out_channels=widths, in_channels=3, out_channels=3, num_res_blocks=2, ffactor_spatial=16,
               ffactor_temporal=4, downsample_match_channel=True, upsample_match_channel=True, z_channels=32)
    with torch.device("meta"):
        enc, dec = NarrowEncoder(**cfg), NarrowDecoder(**cfg)
    shapes = {**{"encoder." + k: v for k, v in enc.state_dict().items()},
              **{"decoder." + k: v for k, v in dec.state_dict().items()}}
    sd = fill_random_({k: torch.empty(v.shape) for k, v in shapes.items()}, seed=12)
    vae = vae_with_swapped_classes(refiner, {"Encoder": NarrowEncoder, "Decoder": NarrowDecoder}, sd)
    if vae.latent_channels != 32:
        pytest.skip(f"this ComfyUI ({comfy_env.version}) reads this state dict as HunyuanImage 2.1's refiner VAE: "
                    "it has no HunyuanVideo 1.5 VAE")
    assert vae.upscale_ratio[-1] == 16
    assert type(vae.first_stage_model.decoder).__name__ == "NarrowDecoder"
    return vae


def test_hunyuan15_spatial_tiles_are_exact(comfy_env, hunyuan15_vae):
    """Per-pixel norms: with the overlap covering the receptive field the tiles compute the untiled pixels."""
    latent = {"samples": smooth_latent((1, 32, 2, 8, 30), 14)}
    ours, ref, report, p_ours, p_comfy = tiles_vs_comfy(comfy_env, hunyuan15_vae, latent, 288, 224,
                                                        "HunyuanVideo 1.5")
    assert "mode=spatial" in report and ours.shape == ref.shape == (5, 128, 480, 3), report
    assert p_ours >= 60 and p_ours >= p_comfy + 10, (p_ours, p_comfy)


def _narrow(module, widths, **fixed):
    """Subclasses of ``module``'s Encoder and Decoder built at ``widths`` (sd.py hard-codes the full widths)."""
    class NarrowEncoder(module.Encoder):
        def __init__(self, **kw):
            super().__init__(**{**kw, "block_out_channels": widths, **fixed})

    class NarrowDecoder(module.Decoder):
        def __init__(self, **kw):
            super().__init__(**{**kw, "block_out_channels": widths, **fixed})
    return NarrowEncoder, NarrowDecoder


def _vae_from_narrow_classes(module, enc_cls, dec_cls, cfg, seed):
    with torch.device("meta"):
        enc, dec = enc_cls(**cfg), dec_cls(**cfg)
    shapes = {**{"encoder." + k: v for k, v in enc.state_dict().items()},
              **{"decoder." + k: v for k, v in dec.state_dict().items()}}
    sd = fill_random_({k: torch.empty(v.shape) for k, v in shapes.items()}, seed=seed)
    return vae_with_swapped_classes(module, {"Encoder": enc_cls, "Decoder": dec_cls}, sd)


@pytest.fixture(scope="module")
def hunyuan_image_vae(comfy_env):
    """A HunyuanImage 2.1 VAE (``comfy.ldm.hunyuan_video.vae``: 2-D, 32x space, 64 latent channels, GroupNorm
    residual stages, pixel-shuffle upsamplers) that comfy.sd.VAE detects from its state dict, at widths
    (32 .. 64) and one residual block per stage instead of (128 .. 1024) and two."""
    import comfy.ldm.hunyuan_video.vae as hy

    widths = [32, 32, 32, 32, 64, 64]
    enc_cls, dec_cls = _narrow(hy, widths, num_res_blocks=1)
    cfg = dict(block_out_channels=widths, in_channels=3, out_channels=3, num_res_blocks=1, ffactor_spatial=32,
               z_channels=64, downsample_match_channel=True, upsample_match_channel=True)
    vae = _vae_from_narrow_classes(hy, enc_cls, dec_cls, cfg, seed=21)
    assert vae.latent_channels == 64 and vae.upscale_ratio == 32
    assert type(vae.first_stage_model.decoder).__name__ == "NarrowDecoder"
    return vae


def test_hunyuan_image_tiles_beat_vaedecodetiled(comfy_env, hunyuan_image_vae):
    """Stages up to 1/4 of the output scale run whole, the rest in tiles with pooled GroupNorm statistics (this
    decoder crashed the node's recognition before: it has a KL decoder's top-level names, not its stages)."""
    latent = {"samples": smooth_latent((1, 64, 12, 10), 21)}
    ours, ref, report, p_ours, p_comfy = tiles_vs_comfy(comfy_env, hunyuan_image_vae, latent, 192, 64,
                                                        "HunyuanImage 2.1")
    assert "HunyuanImage 2.1 VAE" in report and "mode=spatial" in report and "seams exact" in report, report
    assert ours.shape == ref.shape == (1, 384, 320, 3)
    assert p_ours >= 45 and p_ours >= p_comfy + 10, (p_ours, p_comfy)


def test_hunyuan_image_budget_below_the_whole_decode_runs_layered_and_exact(comfy_env, hunyuan_image_vae):
    from comfyui_levers.bridge.vae import describe_vae, measure_cost, measure_layered

    latent = {"samples": smooth_latent((1, 64, 12, 10), 22)}
    staged, _ = describe_vae(hunyuan_image_vae)
    cost, _, _ = measure_cost(hunyuan_image_vae, staged, latent["samples"])
    px = 384 * 320
    whole, layered = cost.whole_bytes_per_px * px, measure_layered(hunyuan_image_vae, staged, latent["samples"]) * px
    assert layered < whole, (layered, whole)
    ref = comfy_env.nodes.VAEDecode().decode(hunyuan_image_vae, latent)[0]
    ours, report = run_node(comfy_env, latent, hunyuan_image_vae, memory_budget_gb=(layered + whole) / 2 / 2 ** 30)
    assert "mode=layered" in report and "exact GroupNorm statistics" in report, report
    assert psnr(ours, ref) >= 90, report


def test_hunyuan_image_refiner_vae_stands_aside_with_a_reason(comfy_env):
    """The HunyuanImage 2.1 refiner's VAE (``vae_refiner`` with ``refiner_vae=False``: 3-D convolutions, GroupNorm
    over all frames, no stages a KL split knows) has the KL decoder's top-level names too; it used to crash the
    node. Now Levers stands aside and ComfyUI decodes it."""
    import comfy.ldm.hunyuan_video.vae_refiner as refiner

    widths = [32, 32, 32, 32, 32]
    enc_cls, dec_cls = _narrow(refiner, widths, num_res_blocks=1)
    cfg = dict(block_out_channels=widths, in_channels=3, out_channels=3, num_res_blocks=1, ffactor_spatial=16,
               ffactor_temporal=4, downsample_match_channel=True, upsample_match_channel=True, refiner_vae=False,
               z_channels=32)
    vae = _vae_from_narrow_classes(refiner, enc_cls, dec_cls, cfg, seed=23)
    assert vae.first_stage_model.decoder.refiner_vae is False
    latent = {"samples": smooth_latent((1, 32, 2, 4, 4), 23)}
    ref = comfy_env.nodes.VAEDecode().decode(vae, latent)[0]
    ours, report = run_node(comfy_env, latent, vae, memory_budget_gb=1e-6)
    assert "no seamless tiling" in report and "standing aside" in report and "mode=whole" in report, report
    assert torch.equal(ours, ref)


def test_a_decoder_whose_split_cannot_be_probed_is_decoded_by_comfyui(comfy_env, kl_vae, monkeypatch):
    """A VAE Levers recognises but whose split fails to run (a variant it misreads) stands aside with the error
    in the report and ComfyUI's own decode, instead of failing the decode; an interrupt still interrupts; and
    the modules are left as they were."""
    import comfy.model_management as mm
    import comfyui_levers.bridge.vae as bv

    latent = {"samples": smooth_latent((1, 16, 20, 20), 5)}
    ref = comfy_env.nodes.VAEDecode().decode(kl_vae, latent)[0]

    def broken(staged, z):
        raise RuntimeError("stand-in for a decoder variant whose stem does not run alone")
    monkeypatch.setattr(bv, "run_stem", broken)
    ours, report = run_node(comfy_env, latent, kl_vae, memory_budget_gb=1e-6)
    assert "standing aside: probing this decoder's split failed" in report and "mode=whole" in report, report
    assert torch.equal(ours, ref)

    def interrupted(staged, z):
        raise mm.InterruptProcessingException()
    monkeypatch.setattr(bv, "run_stem", interrupted)
    with pytest.raises(mm.InterruptProcessingException):
        run_node(comfy_env, latent, kl_vae, tile_size=128)
    monkeypatch.undo()
    assert not [n for n, m in kl_vae.first_stage_model.named_modules() if "forward" in m.__dict__]
    assert torch.equal(comfy_env.nodes.VAEDecode().decode(kl_vae, latent)[0], ref)


def test_a_vae_whose_layout_cannot_be_read_stands_aside(comfy_env, kl_vae, monkeypatch):
    import comfyui_levers.bridge.vae as bv

    def unreadable(fsm, dec):
        raise AttributeError("'Decoder' object has no attribute 'num_resolutions'")
    monkeypatch.setattr(bv, "_describe", unreadable)
    latent = {"samples": smooth_latent((1, 16, 20, 20), 6)}
    ref = comfy_env.nodes.VAEDecode().decode(kl_vae, latent)[0]
    ours, report = run_node(comfy_env, latent, kl_vae, memory_budget_gb=1e-6)
    assert "could not read its layout (AttributeError" in report and "standing aside" in report, report
    assert torch.equal(ours, ref)


def test_a_vae_levers_cannot_tile_stands_aside_instead_of_failing(comfy_env):
    """TAESD (ComfyUI's tiny preview VAE) has no staged description: with a budget the prediction exceeds, the
    node runs ComfyUI's own decode (which retries with its tiled decode on out-of-memory) and says so."""
    import comfy.sd
    import comfy.taesd.taesd as taesd

    with torch.device("meta"):
        shapes = taesd.TAESD(latent_channels=4).state_dict()
    sd = fill_random_({k: torch.empty(v.shape) for k, v in shapes.items()}, seed=15)
    vae = comfy.sd.VAE(sd=sd)
    latent = {"samples": smooth_latent((1, 4, 16, 16), 15)}
    ref = comfy_env.nodes.VAEDecode().decode(vae, latent)[0]
    ours, report = run_node(comfy_env, latent, vae, memory_budget_gb=1e-6)
    assert "no seamless tiling" in report and "standing aside" in report and "mode=whole" in report, report
    assert torch.equal(ours, ref)


def test_hunyuan15_budget_between_a_chunk_and_the_whole_video_picks_its_own_chunks(comfy_env, hunyuan15_vae):
    """Auto, no sizes given: a budget between one chunk's measured peak and the whole video's makes the node
    decode in the decoder's own chunks (bit-exact); a budget above the whole video's decodes whole."""
    from comfyui_levers.bridge.vae import describe_vae, measure_cost

    z = smooth_latent((1, 32, 9, 4, 6), 16)
    staged, _ = describe_vae(hunyuan15_vae)
    cost, _, _ = measure_cost(hunyuan15_vae, staged, z)
    frame_px, n_out = 4 * 6 * 16 * 16, 33
    whole = cost.whole_bytes_per_px * frame_px + cost.output_bytes_per_px * frame_px * n_out
    chunk = (cost.whole_bytes_per_px * frame_px + cost.output_bytes_per_px * frame_px * (n_out / 9) * 2
             + _kept_output(hunyuan15_vae, frame_px, n_out))
    latent = {"samples": z}
    ref = comfy_env.nodes.VAEDecode().decode(hunyuan15_vae, latent)[0]
    ours, report = run_node(comfy_env, latent, hunyuan15_vae, memory_budget_gb=(whole + chunk) / 2 / 2 ** 30)
    assert "mode=temporal" in report and "own calls" in report, report
    assert ours.shape == ref.shape == (33, 64, 96, 3) and torch.equal(ours, ref)
    whole_out, report = run_node(comfy_env, latent, hunyuan15_vae, memory_budget_gb=2 * whole / 2 ** 30)
    assert "mode=whole" in report and torch.equal(whole_out, ref), report


def test_hunyuan_vae_is_untouched_after_tiled_and_chunked_decodes(comfy_env, hunyuan_vae):
    """The stand-ins, the patched GroupNorms and the streamed conv_out are scoped: afterwards no module keeps an
    instance-level forward and ComfyUI's own decode gives what it gave before."""
    latent = {"samples": smooth_latent((1, 16, 2, 16, 16), 17)}
    ref = comfy_env.nodes.VAEDecode().decode(hunyuan_vae, latent)[0]
    run_node(comfy_env, latent, hunyuan_vae, tile_size=64, overlap=48)
    run_node(comfy_env, latent, hunyuan_vae, temporal_size=8, memory_budget_gb=64)
    leftovers = [n for n, m in hunyuan_vae.first_stage_model.named_modules() if "forward" in m.__dict__]
    assert leftovers == []
    assert torch.equal(comfy_env.nodes.VAEDecode().decode(hunyuan_vae, latent)[0], ref)


def ltx_vae(timestep_conditioning: bool, inject_noise: bool = False):
    """A small LTX-Video VAE of ComfyUI's own class (``VideoVAE`` from a config in the file's metadata, as
    ComfyUI loads LTX checkpoints): the LTX-Video 0.9.5 layout (residual stages, three depth-to-space upsamplers,
    per-pixel norms, patch 4) with one layer per stage. ComfyUI 0.8.0 fixes the decoder width at 128; 0.33 takes
    ``decoder_base_channels``."""
    import json
    import comfy.sd
    from comfy.ldm.lightricks.vae.causal_video_autoencoder import VideoVAE

    res = ["res_x", {"num_layers": 1, "inject_noise": inject_noise}]
    up = ["compress_all", {"residual": True}]
    cfg = {"dims": 3, "in_channels": 3, "out_channels": 3, "latent_channels": 128, "decoder_base_channels": 16,
           "encoder_base_channels": 16, "decoder_blocks": [res, up, res, up, res, up, res],
           "encoder_blocks": [["res_x", {"num_layers": 1}], ["compress_all", {}]] * 3 + [["res_x", {"num_layers": 1}]],
           "scaling_factor": 1.0, "norm_layer": "pixel_norm", "patch_size": 4, "latent_log_var": "uniform",
           "use_quant_conv": False, "causal_decoder": False, "timestep_conditioning": timestep_conditioning}
    with torch.device("meta"):
        m = VideoVAE(config=cfg)
    sd = fill_random_({k: torch.empty(v.shape) for k, v in m.state_dict().items()}, seed=6)
    return comfy.sd.VAE(sd=sd, metadata={"config": json.dumps({"vae": cfg})})


def test_ltx_spatial_tiles_are_exact(comfy_env):
    """LTX-Video: the stages up to the last spatial upsampler run whole, the rest per tile on all frames; its
    norms are per pixel, so tiles whose overlap covers the tail's receptive field are exact."""
    vae = ltx_vae(False)
    latent = {"samples": smooth_latent((1, 128, 2, 4, 16), 8)}
    ref = comfy_env.nodes.VAEDecode().decode(vae, latent)[0]
    ours, report = run_node(comfy_env, latent, vae, tile_size=256)
    comfy_tiled = comfy_env.nodes.VAEDecodeTiled().decode(vae, latent, 256, 64, 64, 8)[0]
    assert "mode=spatial" in report and "LTX" in report and ours.shape == ref.shape == (9, 128, 512, 3), report
    p, p_comfy = psnr(ours, ref), psnr(comfy_tiled, ref)
    print(f"\nLTX tiles (256 px): Levers {p:.1f} dB, VAEDecodeTiled (256 / 64) {p_comfy:.1f} dB\n{report}")
    assert p >= 60 and p >= p_comfy + 10, report


def test_ltx_named_error_for_a_latent_of_another_family(comfy_env, caplog):
    """Found in review: a FLUX or Wan 2.2 latent into the LTX VAE failed with a bare tensor-size error (LTX's
    per-channel statistics fail before any convolution), after a warning with a traceback about probing the split.
    Now it is the named channel error, without the warning."""
    from comfyui_levers.core.errors import ConfigError

    vae = ltx_vae(False)
    for channels in (16, 48):
        caplog.clear()
        with pytest.raises(ConfigError, match=rf"samples.*{channels} channels.*128-channel latents.*connect the VAE"):
            run_node(comfy_env, {"samples": torch.randn(1, channels, 2, 4, 4)}, vae)
        assert not [r for r in caplog.records if "probing the split" in r.getMessage()]


@pytest.mark.parametrize("hw", [(5, 7), (7, 9), (5, 13)])
def test_ltx_fallback_to_comfyuis_tiled_decode_works_at_odd_latent_sizes(comfy_env, monkeypatch, hw):
    """Found in review: when even Levers' smallest plan does not fit the free memory, the fallback ran ComfyUI's
    VAEDecodeTiled with 64 px tiles, 2 latent px of LTX's 32x scale: its quarter overlap left a 1-px edge tile
    the LTX decoder cannot pad (a bare RuntimeError from ComfyUI). Tiles are at least 4 latent px now."""
    from comfyui_levers.bridge import vae as bridge_vae

    vae = _without_decode_noise(ltx_vae(False))
    latent = {"samples": smooth_latent((2, 128, 2) + hw, 7)}
    ref = comfy_env.nodes.VAEDecode().decode(vae, latent)[0]
    monkeypatch.setattr(bridge_vae, "budget_bytes", lambda vae, settings: (100_000, "budget 90% of free memory (test)"))
    img, report = run_node(comfy_env, latent, vae)
    assert "fallback: ComfyUI's VAEDecodeTiled" in report and "tile=128x128px" in report, report
    assert img.shape == ref.shape


def test_ltx_sizes_below_its_32px_scale_round_the_safe_way(comfy_env):
    """LTX decodes 32 px per latent px: a tile below that is a clear error naming the value typed, and a
    non-zero overlap below it rounds up to one latent px instead of down to 0 (hard seams: 28.7 dB)."""
    from comfyui_levers.core.errors import ConfigError

    vae = ltx_vae(False)
    latent = {"samples": smooth_latent((1, 128, 2, 4, 16), 8)}
    with pytest.raises(ConfigError, match=r"tile_size=16 is not valid: expected 0 \(auto\) or at least 32 px"):
        run_node(comfy_env, latent, vae, tile_size=16)
    _, report = run_node(comfy_env, latent, vae, tile_size=256, overlap=24)
    assert "overlap=32px" in report and "overlap=0px" not in report, report


def _without_decode_noise(vae):
    """LTX's decode adds fresh random noise to the latent when the decoder is timestep-conditioned; switched off
    here (0.33: ``decode_noise_scale``; 0.8.0: the ``noise_scale`` argument) so two decodes can be compared."""
    import functools

    fsm = vae.first_stage_model
    if hasattr(fsm, "decode_noise_scale"):
        fsm.decode_noise_scale = 0.0
    else:
        fsm.decode = functools.partial(fsm.decode, noise_scale=0.0)
    return vae


def test_ltx_timestep_conditioned_auto_tiles_are_exact(comfy_env):
    """The LTX-Video 0.9.5+ decoder (timestep-conditioned head and stages): a budget of 60% of VAEDecode's
    measured peak gives auto tiles that fit, exact. The stem run stops before the head (whose scale and shift have
    the head's width, not the stem's)."""
    from comfyui_levers.core.tiling import measure_peak_bytes

    vae = _without_decode_noise(ltx_vae(True))
    latent = {"samples": smooth_latent((1, 128, 2, 4, 16), 9)}
    ref, whole = measure_peak_bytes(lambda: comfy_env.nodes.VAEDecode().decode(vae, latent)[0], "cpu")
    budget = 0.6 * whole.peak_bytes / 1024 ** 3
    ours, report = run_node(comfy_env, latent, vae, memory_budget_gb=budget)
    assert "mode=spatial" in report and "tiles;" in report and "exact by construction" in report, report
    p = psnr(ours, ref)
    print(f"\nLTX (timestep-conditioned), auto at 60% of VAEDecode's peak: {p:.1f} dB\n{report}")
    assert p >= 60, report


def test_ltx_with_injected_noise_stands_aside(comfy_env):
    """LTX-Video 0.9.1 injects random spatial noise inside its blocks: every tile would draw its own, so Levers
    runs ComfyUI's decode and says why."""
    vae = ltx_vae(False, inject_noise=True)
    latent = {"samples": smooth_latent((1, 128, 2, 4, 6), 10)}
    img, report = run_node(comfy_env, latent, vae, memory_budget_gb=0.001)
    assert "injects random spatial noise" in report and "standing aside" in report, report
    assert img.shape == (9, 128, 192, 3)


def test_ltx_costs_scale_with_frames_unless_the_decoder_chunks_time(comfy_env):
    """0.8.0's LTX decoder runs all frames at once, so the predicted whole-decode and tile costs grow with the
    frames it outputs (2 latent frames decode to 9, 6 to 41); 0.33's walks them in chunks sized from the card, so
    they do not. The probe measures 2 latent frames; the prediction for 6 covers VAEDecode's measured peak."""
    from comfyui_levers.bridge import vae as bridge_vae
    from comfyui_levers.core.tiling import measure_peak_bytes

    vae = ltx_vae(False)
    staged, _ = bridge_vae.describe_vae(vae)
    short, _, _ = bridge_vae.measure_cost(vae, staged, smooth_latent((1, 128, 2, 4, 6), 12))
    z = smooth_latent((1, 128, 6, 4, 6), 12)
    long, _, _ = bridge_vae.measure_cost(vae, staged, z)
    chunked = bridge_vae.chunks_time_itself(vae)
    factor = 1.0 if chunked else 41 / 9
    for name in ("whole_bytes_per_px", "tile_bytes_per_px", "stem_bytes_per_px"):
        assert getattr(long, name) == pytest.approx(getattr(short, name) * factor, rel=0.15), (name, chunked)
    if not chunked:
        with torch.inference_mode():
            _, peak = measure_peak_bytes(lambda: vae.first_stage_model.decode(z), "cpu")
        predicted = long.whole_bytes_per_px * 4 * 6 * 32 * 32
        assert peak.peak_bytes <= predicted <= 1.25 * peak.peak_bytes, (peak.peak_bytes, predicted)


def test_hunyuan_decoder_without_carried_convolutions_decodes_all_frames_per_tile(comfy_env, hunyuan_vae):
    """ComfyUI 0.3.64's 3-D KL decoder takes every frame in one call (0.3.7x on carry its causal convolutions
    across calls of 2 latent frames): each tile then decodes all frames, a temporal_size is refused with a line,
    and the predicted costs grow with the output frames, so a tiled decode keeps to the budget it was given."""
    from comfyui_levers.bridge import vae as bridge_vae
    from comfyui_levers.core.tiling import measure_peak_bytes

    if getattr(hunyuan_vae.first_stage_model.decoder, "carried", False):
        pytest.skip("this ComfyUI's HunyuanVideo decoder carries its causal convolutions (0.3.7x and later): see "
                    "test_hunyuan_temporal_chunks_are_its_own_calls_and_exact")
    latent = {"samples": smooth_latent((1, 16, 5, 16, 16), 9)}
    with torch.inference_mode():
        ref, whole = measure_peak_bytes(lambda: hunyuan_vae.first_stage_model.decode(latent["samples"]), "cpu")
    staged, why = bridge_vae.describe_vae(hunyuan_vae)
    assert staged.whole_frames and not staged.streamed and "every frame in one call" in why
    cost, _, _ = bridge_vae.measure_cost(hunyuan_vae, staged, latent["samples"])
    assert cost.whole_bytes_per_px * 128 * 128 >= whole.peak_bytes
    ours, report = run_node(comfy_env, latent, hunyuan_vae, temporal_size=8, memory_budget_gb=64)
    assert "mode=whole" in report and "temporal_size ignored" in report, report
    budget = 0.35 * whole.peak_bytes
    (ours, report), peak = measure_peak_bytes(
        lambda: run_node(comfy_env, latent, hunyuan_vae, memory_budget_gb=budget / 1024 ** 3), "cpu")
    assert "mode=spatial" in report and "chunk=5 latent frame(s)" in report, report
    assert ours.shape == (17, 128, 128, 3) and peak.peak_bytes <= budget, (peak.peak_bytes, budget, report)
    ref_img = comfy_env.nodes.VAEDecode().decode(hunyuan_vae, latent)[0]
    assert psnr(ours, ref_img) >= 20, report      # GroupNorm statistics estimated on random weights


def test_recommend_reads_whether_the_connected_video_vae_can_be_chunked_in_time(comfy_env, hunyuan_vae):
    """Recommend plans a tiled decode from a formula; for a connected video VAE it reads from the decoder whether
    TiledVAEDecode can chunk it in time. HunyuanVideo's decoder with carried convolutions (0.3.7x on) chunks exactly;
    0.3.64's takes every frame in one call, so Recommend plans tiles of the whole video and says why."""
    from comfyui_levers.bridge.recommend import measure

    spec, notes = measure(vae=hunyuan_vae, preset="hunyuanvideo")
    carried = getattr(hunyuan_vae.first_stage_model.decoder, "carried", False)
    assert spec.vae_whole_video is (not carried) and spec.vae_causal is carried, (spec, notes)
    assert any("every frame in each tile" in n for n in notes) is (not carried), notes
    image_spec, _ = measure(vae=hunyuan_vae, preset="flux1-dev")      # an image plan: nothing about time
    assert not image_spec.vae_whole_video


def _streams_time(comfy_env, vae) -> None:
    from comfyui_levers.bridge import vae as bridge_vae

    if bridge_vae.chunks_time_itself(vae):
        pytest.skip("this ComfyUI's LTX decoder walks the frames in its own chunks (0.33+): Levers streams time "
                    "itself only for the decoder that runs all frames at once (0.8.0)")


def test_ltx_temporal_chunks_stream_exactly(comfy_env):
    """ComfyUI 0.8.0's LTX decoder is not causal (every time convolution pads both ends), so plain chunks in time
    differ from the whole decode. Levers streams it: each time unit (conv_in, residual blocks, upsamplers, conv_out)
    keeps the context frames it needs, and chunks equal VAEDecode up to float rounding, with the timestep
    conditioning's per-frame glue in between."""
    vae = _without_decode_noise(ltx_vae(True))
    _streams_time(comfy_env, vae)
    latent = {"samples": smooth_latent((1, 128, 5, 4, 6), 21)}
    ref = comfy_env.nodes.VAEDecode().decode(vae, latent)[0]
    ours, report = run_node(comfy_env, latent, vae, temporal_size=16, memory_budget_gb=64)
    assert "mode=temporal" in report and "chunk=2 latent frame" in report and "streamed through time" in report
    assert "temporal_size ignored" not in report and ours.shape == ref.shape == (33, 128, 192, 3), report
    comfy_chunks = comfy_env.nodes.VAEDecodeTiled().decode(vae, latent, 1024, 64, 16, 8)[0]
    p, p_comfy = psnr(ours, ref), psnr(comfy_chunks, ref)
    print(f"\nLTX temporal chunks of 16 frames: Levers {p:.1f} dB, VAEDecodeTiled (temporal 16 / 8) {p_comfy:.1f} dB"
          f"\n{report}")
    assert p >= 60 and p >= p_comfy + 10, report
    # the streaming stand-ins are scoped: no module keeps an instance-level forward, ComfyUI's decode is unchanged
    assert [n for n, m in vae.first_stage_model.named_modules() if "forward" in m.__dict__] == []
    assert torch.equal(comfy_env.nodes.VAEDecode().decode(vae, latent)[0], ref)


def test_ltx_streamed_chunks_fit_the_budget_they_were_planned_for(comfy_env):
    """Auto: a budget below the whole decode's peak plans the longest streamed chunk that fits; the streamed
    decode's measured peak (live-tensor count) stays within the prediction, and below the whole decode's."""
    from comfyui_levers.bridge import vae as bridge_vae
    from comfyui_levers.core.tiling import measure_peak_bytes
    from comfyui_levers.core.tiling.stream import decode_time_streamed

    vae = _without_decode_noise(ltx_vae(False))
    _streams_time(comfy_env, vae)
    z = smooth_latent((1, 128, 9, 4, 6), 22)
    ref, whole = measure_peak_bytes(lambda: comfy_env.nodes.VAEDecode().decode(vae, {"samples": z})[0], "cpu")
    budget = 0.4 * whole.peak_bytes
    ours, report = run_node(comfy_env, {"samples": z}, vae, memory_budget_gb=budget / 1024 ** 3)
    assert "mode=temporal" in report and "streamed" in report, report
    p = psnr(ours, ref)
    assert p >= 60, report
    chunk = int(re.search(r"chunk=(\d+) latent frame", report).group(1))
    predicted = float(re.search(r"predicted peak=([\d.]+) GiB", report).group(1)) * 1024 ** 3
    staged, _ = bridge_vae.describe_vae(vae)
    units, _, _, problem = bridge_vae.measure_stream(vae, staged, z)
    assert problem == ""
    # the node's own decode, frames kept on the CPU as the node keeps them (the prediction counts them)
    _, peak = measure_peak_bytes(lambda: decode_time_streamed(staged.run, staged.time_decoder, units, z, chunk), "cpu")
    print(f"\nLTX streamed, 9 latent frames: {p:.1f} dB, chunk {chunk}, peak {peak.peak_bytes / 2 ** 20:.1f} MiB, predicted "
          f"{predicted / 2 ** 20:.1f} MiB, whole decode {whole.peak_bytes / 2 ** 20:.1f} MiB")
    assert peak.peak_bytes <= predicted <= budget < whole.peak_bytes


def _plan_line(report: str) -> str:
    return report.split("plan: ")[1].split("\n")[0]


def test_a_tile_size_covering_the_frame_plans_as_auto(comfy_env, kl_vae):
    """Found in review: a tile_size covering the whole frame (4096, the node's maximum) asks for no tiles, and the
    planner plans as on auto; but the layered decode was only measured without a tile_size, so the user got tiles
    with estimated statistics (29 dB) where auto decodes layered (exact)."""
    latent = {"samples": smooth_latent((1, 16, 13, 21), 3)}
    ref = comfy_env.nodes.VAEDecode().decode(kl_vae, latent)[0]
    auto, auto_report = run_node(comfy_env, latent, kl_vae, memory_budget_gb=0.008, unload_other_models=False)
    assert "mode=layered" in _plan_line(auto_report), auto_report
    ours, report = run_node(comfy_env, latent, kl_vae, tile_size=4096, memory_budget_gb=0.008,
                            unload_other_models=False)
    assert "mode=layered" in _plan_line(report) and "tile_size covers the whole" in report, report
    assert torch.equal(ours, auto) and psnr(ours, ref) > 80


def test_the_largest_tile_that_fits_is_searched_along_the_long_side(comfy_env, kl_vae):
    """Found in review: on a wide frame, the search for the largest tile_size within a budget started at the short
    side, so it named a tile far smaller than the one that fits (40 px where about 240 px fits)."""
    from comfyui_levers.core.errors import BudgetExceeded

    latent = {"samples": smooth_latent((1, 16, 6, 60), 5)}        # 48x480 px
    peaks = {}
    for k in (40, 240, 320):
        _, r = run_node(comfy_env, latent, kl_vae, tile_size=k, unload_other_models=False)
        peaks[k] = float(r.split("predicted peak=")[1].split(" ")[0])
    assert peaks[40] < peaks[240] < peaks[320], peaks
    budget = (peaks[240] + peaks[320]) / 2
    with pytest.raises(BudgetExceeded) as err:
        run_node(comfy_env, latent, kl_vae, tile_size=320, memory_budget_gb=budget, unload_other_models=False)
    fits = int(re.search(r"set tile_size to (\d+) px or less", str(err.value)).group(1))
    assert 240 <= fits < 320, str(err.value)
    _, r = run_node(comfy_env, latent, kl_vae, tile_size=fits, memory_budget_gb=budget, unload_other_models=False)
    assert "mode=spatial" in r, r


def test_a_fallback_reports_its_own_predicted_peak(comfy_env, kl_vae, monkeypatch):
    """Found in review: the fallback to VAEDecodeTiled reported Levers' smallest plan's need (known not to fit) as
    the fallback's predicted peak. It reports one tile of the whole decoder at the measured cost, and the plan it
    replaces in its reason."""
    from comfyui_levers.bridge import vae as bv

    latent = {"samples": smooth_latent((1, 16, 24, 24), 13)}
    monkeypatch.setattr(bv, "budget_bytes", lambda vae, settings: (200_000, "budget 90% of free memory (test)"))
    _, report = run_node(comfy_env, latent, kl_vae)
    line = _plan_line(report)
    assert "mode=comfy_tiled" in line, report
    side = int(re.search(r"tile=(\d+)x", line).group(1))
    whole_bpp = float(re.search(r"whole decode (\d+) B/px", report).group(1))
    predicted = float(re.search(r"predicted peak=([\d.]+) GiB", line).group(1))
    assert predicted == pytest.approx(whole_bpp * side * side / 1024 ** 3, abs=6e-4), report
    assert "Levers' smallest exact plan does not fit" in report


def test_temporal_size_an_all_frames_decoder_ignores_does_not_change_its_tiles(comfy_env):
    """Found in review: on a decoder that runs every frame of a tile in one call (its tile cost is the whole video's
    already), a temporal_size the report calls ignored still multiplied the tile cost: smaller tiles, or an error
    that the budget was too small. The plan is now the same with and without it."""
    vae = _without_decode_noise(ltx_vae(False))
    latent = {"samples": smooth_latent((1, 128, 5, 4, 16), 9)}
    _, report = run_node(comfy_env, latent, vae, tile_size=256)
    budget = float(re.search(r"predicted peak=([\d.]+) GiB", _plan_line(report)).group(1)) * 1.1 + 0.001
    plans = {}
    for ts in (0, 32):
        _, report = run_node(comfy_env, latent, vae, tile_size=256, temporal_size=ts, memory_budget_gb=budget)
        plans[ts] = _plan_line(report)
        if "each tile decodes all frames in one call" not in report:
            pytest.skip("this ComfyUI's LTX decoder does not run the frames of a tile in one call")
    assert "mode=spatial" in plans[0] and plans[32] == plans[0], plans


def test_a_deeper_stem_whose_probe_fails_is_skipped(comfy_env, kl_vae, monkeypatch):
    """Found in review: an unexpected error in the deeper stem's probe failed the whole decode, where a failed probe
    of the default split stands aside. The deeper stem is skipped with a line, and the default split decodes."""
    from comfyui_levers.bridge import vae as bridge_vae

    latent = {"samples": smooth_latent((1, 16, 40, 40), 2)}
    original = bridge_vae.measure_cost

    def measure(vae, staged, samples, whole_bpp=None):
        if whole_bpp is not None:                 # only a deeper stem's probe reuses the whole decode's cost
            raise RuntimeError("a variant the split misreads")
        return original(vae, staged, samples)
    monkeypatch.setattr(bridge_vae, "measure_cost", measure)
    ours, report = run_node(comfy_env, latent, kl_vae, memory_budget_gb=0.042)
    assert "mode=spatial" in _plan_line(report) and "deeper stem at" in report, report
    assert "skipped: its probe failed (RuntimeError: a variant the split misreads)" in report, report
    ref = comfy_env.nodes.VAEDecode().decode(kl_vae, latent)[0]
    assert psnr(ours, ref) >= 30


def test_a_video_fallback_runs_comfyuis_smallest_temporal_tiles(comfy_env, wan_vae, monkeypatch):
    """Found in review: the fallback to VAEDecodeTiled, sized from the per-frame cost, ran its default 64-frame
    temporal tiles on a video, which could need many times the budget. It runs the smallest (8 frames, 4
    overlapping); images keep the defaults."""
    from comfyui_levers.bridge import vae as bridge_vae
    import nodes as comfy_nodes

    calls = []
    original = comfy_nodes.VAEDecodeTiled.decode

    def spy(self, vae, samples, tile_size, overlap, temporal_size, temporal_overlap):
        calls.append((temporal_size, temporal_overlap))
        return original(self, vae, samples, tile_size, overlap, temporal_size, temporal_overlap)
    monkeypatch.setattr(comfy_nodes.VAEDecodeTiled, "decode", spy)
    monkeypatch.setattr(bridge_vae, "budget_bytes", lambda vae, settings: (20_000, "budget 90% of free memory (test)"))
    latent = {"samples": smooth_latent((1, 16, 3, 8, 8), 4)}
    img, report = run_node(comfy_env, latent, wan_vae)
    assert "mode=comfy_tiled" in _plan_line(report) and calls == [(8, 4)], (calls, report)
    assert img.shape[0] == 9
