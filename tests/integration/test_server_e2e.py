"""End to end in a real headless ComfyUI: the pack installed as a custom node, graphs submitted over
HTTP with `levers run`'s own client, outputs downloaded through /view and compared.

The server is a subprocess on 127.0.0.1 started from COMFYUI_PATH with ``--cpu`` and a throw-away
``--base-directory`` (custom_nodes/ComfyUI-Levers -> this checkout). Models are tiny random-weight
Wan 2.1 DiT/VAE files that the stock UNETLoader/VAELoader read; conditioning comes from a test-only
node (no text encoder). Run against each ComfyUI snapshot:

    COMFYUI_PATH=/path/to/ComfyUI-0.8 python -m pytest tests/integration/test_server_e2e.py -q
    COMFYUI_PATH=/path/to/ComfyUI-0.33 python -m pytest tests/integration/test_server_e2e.py -q
"""
from __future__ import annotations

import io
import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from comfy_server import ComfyServer  # noqa: E402

from comfyui_levers.core import client as C  # noqa: E402

ROOT = HERE.parents[1]
API_DIR = ROOT / "example_workflows" / "api"
LEVERS_NODES = ("LeversRecommend", "LeversQuantizeDiT", "LeversPhaseOffload", "LeversGroupPrefetch",
                "LeversTiledVAEDecode", "LeversLoadQuantizedDiT")
UNET = "levers_e2e_wan21.safetensors"
UNET_LOW = "levers_e2e_wan21_low_noise.safetensors"      # a second expert (another tiny Wan 2.1 DiT)
VAE = "levers_e2e_wan21_vae.safetensors"
WIDTH = HEIGHT = 64
FRAMES = 5

# Quality bars for the lossy levers on a random-weight model after 2 sampling steps
# (PSNR of the final latent against the unquantized run, peak = the reference's max |value|).
LATENT_PSNR_MIN = {"fp8_e4m3fn": 20.0, "int8": 25.0, "nf4": 10.0}
TILED_DECODE_PSNR_MIN = 30.0                # 8-bit images, feathered tile seams vs one-shot decode
LEAK_BOUND_BYTES = 128 * 2 ** 20            # steady RSS growth allowed over the five measured runs


# ---------------------------------------------------------------------------------------------
# Fixtures
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(comfy_env, tmp_path_factory):
    """A ComfyUI subprocess with the pack, the test nodes and the tiny models."""
    from tiny_models import save, tiny_wan_dit_state_dict, tiny_wan_vae_state_dict

    srv = ComfyServer(comfy_env.path, base_dir=str(tmp_path_factory.mktemp("comfy_base")))
    # Big enough that one leaked copy per run (~110 MB fp32) stands far above RSS noise.
    dit = tiny_wan_dit_state_dict(dim=512, ffn_dim=1024, num_layers=8, seed=11)
    save(dit, str(srv.models_dir / "diffusion_models" / UNET))
    save(tiny_wan_vae_state_dict(seed=12), str(srv.models_dir / "vae" / VAE))
    save(tiny_wan_dit_state_dict(seed=13), str(srv.models_dir / "diffusion_models" / UNET_LOW))
    srv.model_bytes = sum(t.numel() * t.element_size() for t in dit.values())
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def object_info(server):
    return server.get("/object_info")


@pytest.fixture
def run(server, tmp_path):
    """Run an API prompt through the real client; returns the RunResult (files downloaded)."""
    client = C.ComfyClient(server.url, timeout=120)
    counter = iter(range(10 ** 6))

    def _run(api, expect="success"):
        out = tmp_path / f"run{next(counter)}"
        result = C.run_prompt(client, api, out_dir=str(out), timeout=600)
        if result.status != expect:
            detail = C.format_execution_error(result.error, result.status)
            pytest.fail(f"prompt ended {result.status!r}, expected {expect!r}: {detail}\n{server.log_tail()}")
        return result

    return _run


def _require(object_info, *node_ids):
    missing = [n for n in node_ids if n not in object_info]
    if missing:
        pytest.fail(f"the server does not list {missing}: the pack did not register them (see the server log)")


# ---------------------------------------------------------------------------------------------
# Graph construction (API format)
# ---------------------------------------------------------------------------------------------

def levers_node(object_info, node_id, **given):
    """A Levers node with every widget at its schema default, ``given`` applied (links or values)."""
    specs = C.input_specs(object_info[node_id], given)
    inputs = {}
    for spec in specs:
        if spec.name in given:
            inputs[spec.name] = given[spec.name]
        elif spec.is_widget and "default" in spec.options:
            inputs[spec.name] = spec.options["default"]
        elif spec.is_widget and spec.choices:
            inputs[spec.name] = spec.choices[0]
    unknown = set(given) - {s.name for s in specs}
    if unknown:
        raise KeyError(f"{node_id} has no input(s) {sorted(unknown)}")
    return {"class_type": node_id, "inputs": inputs}


def wan_graph(object_info, *, model_chain=(), decode=None, seed=0, nonce=0, prefix="e2e", plan=False, unet=UNET):
    """UNETLoader -> Nonce -> [Levers model nodes] -> KSampler -> SaveLatent, VAELoader -> decode -> SaveImage.

    ``model_chain`` holds (node_id, overrides) applied in order to the MODEL; ``decode`` is
    None (stock VAEDecode) or overrides for LeversTiledVAEDecode; ``plan`` wires a Recommend plan in.
    """
    api = {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": unet, "weight_dtype": "default"}},
        "2": {"class_type": "LeversTestNonce", "inputs": {"model": ["1", 0], "nonce": nonce}},
        "10": {"class_type": "LeversTestConditioning", "inputs": {"seed": 100 + seed, "tokens": 8, "dim": 4096,
                                                                  "scale": 1.0}},
        "11": {"class_type": "LeversTestConditioning", "inputs": {"seed": 200 + seed, "tokens": 8, "dim": 4096,
                                                                  "scale": 0.1}},
        "12": {"class_type": "EmptyHunyuanLatentVideo", "inputs": {"width": WIDTH, "height": HEIGHT,
                                                                   "length": FRAMES, "batch_size": 1}},
        "15": {"class_type": "VAELoader", "inputs": {"vae_name": VAE}},
    }
    plan_link = {}
    if plan:
        api["3"] = levers_node(object_info, "LeversRecommend", model=["1", 0], vae=["15", 0], width=WIDTH,
                               height=HEIGHT, frames=FRAMES, steps=2)
        plan_link = {"plan": ["3", 0]}
    model = ["2", 0]
    for i, (node_id, overrides) in enumerate(model_chain):
        key = str(4 + i)
        extra = plan_link if "plan" in {s.name for s in C.input_specs(object_info[node_id])} else {}
        api[key] = levers_node(object_info, node_id, model=model, **extra, **overrides)
        model = [key, _output_index(object_info, node_id, "MODEL")]
    api["13"] = {"class_type": "KSampler", "inputs": {
        "model": model, "seed": seed, "steps": 2, "cfg": 2.0, "sampler_name": "euler", "scheduler": "simple",
        "positive": ["10", 0], "negative": ["11", 0], "latent_image": ["12", 0], "denoise": 1.0}}
    api["14"] = {"class_type": "SaveLatent", "inputs": {"samples": ["13", 0], "filename_prefix": f"latents/{prefix}"}}
    if decode is None:
        api["16"] = {"class_type": "VAEDecode", "inputs": {"samples": ["13", 0], "vae": ["15", 0]}}
    else:
        extra = plan_link if "plan" in {s.name for s in C.input_specs(object_info["LeversTiledVAEDecode"])} else {}
        api["16"] = levers_node(object_info, "LeversTiledVAEDecode", samples=["13", 0], vae=["15", 0],
                                **extra, **decode)
    api["17"] = {"class_type": "SaveImage", "inputs": {
        "images": ["16", _output_index(object_info, api["16"]["class_type"], "IMAGE")], "filename_prefix": prefix}}
    problems = C.validate_api(api, object_info)
    if unet != UNET:
        problems = [p for p in problems if "unet_name" not in p]  # listed once ComfyUI rescans the folder
    assert problems == []
    return api


def _output_index(object_info, node_id, type_):
    return list(object_info[node_id]["output"]).index(type_)


def latent_of(result) -> torch.Tensor:
    from safetensors.torch import load_file

    path = next(p for p in result.files if p.endswith(".latent"))
    return load_file(path)["latent_tensor"].float()


def image_of(result) -> torch.Tensor:
    import numpy as np
    from PIL import Image

    path = next(p for p in result.files if p.endswith(".png"))
    return torch.from_numpy(np.array(Image.open(path).convert("RGB"))).float()


def psnr(ref: torch.Tensor, test: torch.Tensor, peak: float | None = None) -> float:
    mse = torch.mean((ref.double() - test.double()) ** 2).item()
    peak = peak if peak is not None else ref.abs().max().item()
    return math.inf if mse == 0 else 10 * math.log10(peak ** 2 / mse)


# ---------------------------------------------------------------------------------------------
# Registration and the shipped workflows
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("node_id", LEVERS_NODES)
def test_object_info_lists_the_levers_node(object_info, node_id):
    _require(object_info, node_id)
    info = object_info[node_id]
    assert info["category"].startswith("Levers")
    for spec in C.input_specs(info):
        assert spec.options.get("tooltip"), f"{node_id}.{spec.name} has no tooltip"


def _missing_file_problem(problem: str) -> bool:
    return "file missing" in problem or "lists no choices" in problem


@pytest.mark.parametrize("path", sorted(API_DIR.glob("*.json")), ids=lambda p: p.stem)
def test_shipped_api_workflow_validates_against_the_server(server, object_info, path):
    """Locally and by the server's own /prompt validation, only missing model files may fail."""
    api = json.loads(path.read_text())
    local = C.validate_api(api, object_info)
    assert [p for p in local if not _missing_file_problem(p)] == []
    status, answer = server.post("/prompt", {"prompt": api, "client_id": "levers-e2e-validate"})
    if status == 200:  # every file present: nothing should run in this test
        server.post("/interrupt", {"prompt_id": answer["prompt_id"]})
        return
    for node_id, info in (answer.get("node_errors") or {}).items():
        for err in info["errors"]:
            names_file = str(err.get("details", "")).split(":")[0].endswith("_name") or \
                err.get("type") == "value_not_in_list"
            assert names_file and api[node_id]["class_type"] in (
                "UNETLoader", "DualCLIPLoader", "CLIPLoader", "VAELoader", "CheckpointLoaderSimple"), (node_id, err)


def test_comfyui_lists_the_examples_as_templates(server):
    """ComfyUI's template browser lists example_workflows/*.json (not api/) and serves each file."""
    listed = server.get("/api/workflow_templates").get("ComfyUI-Levers", [])
    shipped = sorted(p.stem for p in (ROOT / "example_workflows").glob("*.json"))
    assert sorted(listed) == shipped
    for name in shipped:
        served = server.get(f"/api/workflow_templates/ComfyUI-Levers/{name}.json")
        assert served == json.loads((ROOT / "example_workflows" / f"{name}.json").read_text())


@pytest.mark.parametrize("path", sorted((ROOT / "example_workflows").glob("*.json")), ids=lambda p: p.stem)
def test_shipped_ui_workflow_converts_with_the_servers_object_info(object_info, path):
    """Same nodes, inputs and links as the shipped API twin (titles of untitled stock nodes follow
    each version's display names, so ``_meta`` is not compared)."""
    def semantic(api):
        return {k: (v["class_type"], v["inputs"]) for k, v in api.items()}

    api = C.ui_to_api(json.loads(path.read_text()), object_info)
    assert semantic(api) == semantic(json.loads((API_DIR / path.name).read_text()))


# ---------------------------------------------------------------------------------------------
# Each node against the same graph without it
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def baseline(server, object_info):
    return {}


def _baseline(run, object_info, cache, seed=0):
    if seed not in cache:
        result = run(wan_graph(object_info, seed=seed, nonce=1000 + seed, prefix=f"base{seed}"))
        cache[seed] = (latent_of(result), image_of(result))
    return cache[seed]


@pytest.mark.parametrize("node_id", ["LeversPhaseOffload", "LeversGroupPrefetch"])
def test_residency_levers_are_bit_identical(run, object_info, baseline, node_id):
    _require(object_info, node_id)
    ref_latent, ref_image = _baseline(run, object_info, baseline)
    result = run(wan_graph(object_info, model_chain=[(node_id, {})], nonce=1, prefix=node_id))
    assert torch.equal(latent_of(result), ref_latent)
    assert torch.equal(image_of(result), ref_image)


def test_group_prefetch_streaming_every_block_is_bit_identical_through_the_server(run, object_info, baseline, server):
    """On a CPU server the auto budget is unlimited, so the default GroupPrefetch streams nothing (found in review:
    the test above could not catch a streaming bug). Forced to stream every block through two slots, the run
    through ComfyUI's real executor and cache must still match the plain graph bit for bit, and the server's log
    must show the blocks streamed."""
    _require(object_info, "LeversGroupPrefetch")
    ref_latent, ref_image = _baseline(run, object_info, baseline)
    forced = {"blocks_per_group": 1, "prefetch_depth": 1, "resident_groups": 0, "vram_budget_gb": 1.0}
    before = server.log_path.read_text(errors="replace")
    result = run(wan_graph(object_info, model_chain=[("LeversGroupPrefetch", forced)], nonce=6, prefix="streamed"))
    assert torch.equal(latent_of(result), ref_latent)
    assert torch.equal(image_of(result), ref_image)
    new = server.log_path.read_text(errors="replace")[len(before):]
    lines = [l for l in new.splitlines() if "levers: GroupPrefetch:" in l]
    assert lines and "0 kept loaded by ComfyUI" in lines[-1] and "streamed" in lines[-1], new[-2000:]


def _precisions(object_info):
    spec = next((s for s in C.input_specs(object_info["LeversQuantizeDiT"]) if s.choices and any(
        str(c).startswith(("fp8", "int8", "nf4")) for c in s.choices)), None)
    if spec is None:
        pytest.fail("LeversQuantizeDiT has no precision choice input")
    return spec.name, [c for c in spec.choices if c in LATENT_PSNR_MIN]


@pytest.mark.parametrize("precision", sorted(LATENT_PSNR_MIN))
def test_quantize_is_close_to_the_unquantized_model(run, object_info, baseline, precision):
    _require(object_info, "LeversQuantizeDiT")
    field, available = _precisions(object_info)
    if precision not in available:
        pytest.skip(f"LeversQuantizeDiT offers no {precision} here (choices: {available})")
    ref_latent, _ = _baseline(run, object_info, baseline)
    result = run(wan_graph(object_info, model_chain=[("LeversQuantizeDiT", {field: precision})], nonce=2,
                           prefix=f"q_{precision}"), )
    latent = latent_of(result)
    assert latent.shape == ref_latent.shape and torch.isfinite(latent).all()
    assert not torch.equal(latent, ref_latent), "quantization changed nothing: was the lever applied?"
    assert psnr(ref_latent, latent) >= LATENT_PSNR_MIN[precision]


def test_tiled_decode_matches_one_shot_decode(run, object_info, baseline):
    _require(object_info, "LeversTiledVAEDecode")
    ref_latent, ref_image = _baseline(run, object_info, baseline)
    result = run(wan_graph(object_info, decode={}, nonce=3, prefix="tiled_auto"))
    assert torch.equal(latent_of(result), ref_latent)
    assert psnr(ref_image, image_of(result), peak=255.0) >= TILED_DECODE_PSNR_MIN
    # Force small blended spatial tiles and one-latent-frame temporal chunks (auto decodes whole here).
    specs = {s.name for s in C.input_specs(object_info["LeversTiledVAEDecode"])}
    forced = {k: v for k, v in (("tile_size", 32), ("overlap", 16), ("temporal_size", 4)) if k in specs}
    if "tile_size" not in forced:
        pytest.skip("LeversTiledVAEDecode has no tile_size input to force")
    result = run(wan_graph(object_info, decode=forced, nonce=4, prefix="tiled_small"))
    assert psnr(ref_image, image_of(result), peak=255.0) >= TILED_DECODE_PSNR_MIN


def test_recommend_reports_and_drives_every_lever(run, object_info, baseline):
    _require(object_info, *LEVERS_NODES)
    ref_latent, ref_image = _baseline(run, object_info, baseline)
    api = wan_graph(object_info, model_chain=[("LeversPhaseOffload", {}), ("LeversGroupPrefetch", {})],
                    decode={}, nonce=5, prefix="planned", plan=True)
    result = run(api)
    report = result.reports.get(f"#3 {api['3'].get('_meta', {}).get('title', 'LeversRecommend')}") or \
        next((t for k, t in result.reports.items() if k.startswith("#3 ")), None)
    assert report and any("GiB" in text for text in report), result.reports
    # On a CPU server the plan has nothing to shrink: the residency levers must stay exact.
    assert torch.equal(latent_of(result), ref_latent)
    assert psnr(ref_image, image_of(result), peak=255.0) >= TILED_DECODE_PSNR_MIN


# ---------------------------------------------------------------------------------------------
# Models untouched, no leak, server healthy
# ---------------------------------------------------------------------------------------------

def _all_levers_graph(object_info, nonce, prefix):
    chain = [(n, {}) for n in ("LeversQuantizeDiT", "LeversPhaseOffload", "LeversGroupPrefetch") if n in object_info]
    decode = {} if "LeversTiledVAEDecode" in object_info else None
    return wan_graph(object_info, model_chain=chain, decode=decode, nonce=nonce, prefix=prefix,
                     plan="LeversRecommend" in object_info)


def test_cached_loader_model_is_untouched_by_the_levers(run, object_info, baseline):
    """ComfyUI caches the loader's MODEL; after a Levers graph used it, the plain graph is unchanged."""
    _require(object_info, "LeversQuantizeDiT")
    ref_latent, ref_image = _baseline(run, object_info, baseline)
    run(_all_levers_graph(object_info, nonce=6, prefix="all"))
    again = run(wan_graph(object_info, nonce=7, prefix="base_again"))
    assert torch.equal(latent_of(again), ref_latent)
    assert torch.equal(image_of(again), ref_image)


def test_five_repeated_runs_do_not_leak_and_the_server_stays_healthy(server, run, object_info, baseline):
    """Two warm-up runs (imports, arenas, ComfyUI's caches settle), then five measured runs.

    Each run gets a new nonce, so every Levers node executes again on the cached loader model.
    Measured on 0.8.0/CPU: plain runs jitter by about +-60 MiB, Levers runs plateau after the
    second; one leaked model copy per run would add ~4 x 113 MiB over the window. A leak grows the
    RSS run after run, so the test judges the median step between measured runs (and, to catch a
    leak that is not steady, twice the bound overall); one late step of the allocator (seen once,
    +158 MiB on the last run with another suite running alongside, flat before) is not a leak.
    """
    _require(object_info, "LeversQuantizeDiT")
    assert 4 * server.model_bytes > 2 * LEAK_BOUND_BYTES  # a per-run copy leak must clear the bound
    rss, latents = [], []
    for i in range(7):
        result = run(_all_levers_graph(object_info, nonce=100 + i, prefix=f"leak{i}"))
        latents.append(latent_of(result))
        rss.append(server.rss())
    measured = rss[2:]
    growth = measured[-1] - measured[0]
    steps = sorted(b - a for a, b in zip(measured, measured[1:]))
    median_step = (steps[1] + steps[2]) / 2
    mib = [round(r / 2 ** 20) for r in rss]
    assert median_step * 4 < LEAK_BOUND_BYTES and growth < 2 * LEAK_BOUND_BYTES, \
        f"server RSS grew {growth / 2 ** 20:.0f} MiB over 5 runs, median step {median_step / 2 ** 20:.0f} MiB " \
        f"(MiB per run: {mib})"
    for latent in latents[1:]:
        assert torch.equal(latent, latents[0])  # repeated runs are deterministic
    stats = server.get("/system_stats")
    assert stats["devices"], stats
    assert server.alive()
    ref_latent, _ = _baseline(run, object_info, baseline)
    assert torch.equal(latent_of(run(wan_graph(object_info, nonce=8, prefix="healthy"))), ref_latent)


# ---------------------------------------------------------------------------------------------
# The example graphs' structure, on the tiny models
# ---------------------------------------------------------------------------------------------

def tiny_version(api: dict, object_info: dict) -> dict:
    """The shipped graph with the tiny Wan models in place of the real files and a small workload.

    Loaders point at the tiny files; text encoding becomes the test conditioning node; image
    latents become a 1-frame video latent (the tiny model is a Wan DiT); sizes and steps shrink.
    """
    api = json.loads(json.dumps(api))
    removed = set()
    for node_id, node in list(api.items()):
        kind, inputs = node["class_type"], node["inputs"]
        if kind == "UNETLoader":
            inputs["unet_name"] = UNET
        elif kind == "VAELoader":
            inputs["vae_name"] = VAE
        elif kind in ("CLIPLoader", "DualCLIPLoader", "TripleCLIPLoader"):
            del api[node_id]
            removed.add(node_id)
        elif kind == "CheckpointLoaderSimple":
            # MODEL and VAE from the tiny files; there is no CLIP (encoders are replaced below).
            vae_id = str(max(int(k) for k in api if k.isdigit()) + 1)
            api[node_id] = {"class_type": "UNETLoader", "inputs": {"unet_name": UNET, "weight_dtype": "default"}}
            api[vae_id] = {"class_type": "VAELoader", "inputs": {"vae_name": VAE}}
            for other in api.values():
                for name, value in other["inputs"].items():
                    if C._is_link(value) and str(value[0]) == node_id:
                        if value[1] == 2:
                            other["inputs"][name] = [vae_id, 0]
                        elif value[1] == 1:
                            other["inputs"][name] = ["__clip__", 0]
        elif kind == "CLIPTextEncode":
            api[node_id] = {"class_type": "LeversTestConditioning",
                            "inputs": {"seed": int(node_id), "tokens": 8, "dim": 4096, "scale": 1.0}}
        elif kind in ("EmptySD3LatentImage", "EmptyLatentImage", "EmptyHunyuanLatentVideo"):
            api[node_id] = {"class_type": "EmptyHunyuanLatentVideo",
                            "inputs": {"width": WIDTH, "height": HEIGHT, "batch_size": 1,
                                       "length": FRAMES if kind == "EmptyHunyuanLatentVideo" else 1}}
        elif kind == "KSampler":
            inputs["steps"] = 2
        elif kind == "LeversRecommend":
            # Plan for this (CPU) machine: a plan for the example's GPU cannot run here.
            for name, value in (("width", WIDTH), ("height", HEIGHT), ("steps", 2), ("vram_gb", 0.0), ("ram_gb", 0.0)):
                if name in inputs:
                    inputs[name] = value
            if "frames" in inputs:
                inputs["frames"] = min(inputs["frames"], FRAMES)
    for node in api.values():
        for name, value in list(node["inputs"].items()):
            if C._is_link(value) and (str(value[0]) in removed or value[0] == "__clip__"):
                spec = next((s for s in C.input_specs(object_info[node["class_type"]]) if s.name == name), None)
                if spec is not None and spec.required:
                    raise AssertionError(f"{node['class_type']}.{name} needs a CLIP the tiny setup cannot give")
                del node["inputs"][name]  # an optional component input (e.g. clip on PhaseOffload)
    return api


@pytest.mark.parametrize("path", sorted(API_DIR.glob("*.json")), ids=lambda p: p.stem)
def test_example_graph_structure_runs_on_tiny_models(server, run, object_info, baseline, path):
    shipped = json.loads(path.read_text())
    _require(object_info, *{n["class_type"] for n in shipped.values() if n["class_type"].startswith("Levers")})
    api = tiny_version(shipped, object_info)
    assert C.validate_api(api, object_info) == []
    saves = [n["inputs"]["save_path"] for n in api.values()
             if n["class_type"] == "LeversQuantizeDiT" and n["inputs"].get("save_path")]
    folders = (server.models_dir / "unet", server.models_dir / "diffusion_models", server.output_dir / "diffusion_models")
    before = {p for f in folders for p in f.glob("*.safetensors")}
    result = run(api)
    levers = {n for n, node in api.items() if node["class_type"].startswith("Levers")}
    assert result.reports, "no Levers report reached /history"
    assert {k.split(" ", 1)[0][1:] for k in result.reports} <= levers
    if not saves:
        assert result.files, "the example graph saved nothing"
        return
    # Quantize once and save: the file lands where the stock UNETLoader looks, and sampling with
    # it stays within the fp8 bar of the original model.
    new = sorted({p for f in folders for p in f.glob("*.safetensors")} - before)
    assert [p.name for p in new] == [os.path.basename(saves[0])], new
    assert new[0].stat().st_size < server.model_bytes * 0.75  # 1-byte weights, 16/32-bit leftovers
    names = C.input_specs(server.get("/object_info/UNETLoader")["UNETLoader"])[0].choices
    assert new[0].name in names
    ref_latent, _ = _baseline(run, object_info, baseline)
    graph = wan_graph(object_info, unet=new[0].name, nonce=9, prefix="reloaded")
    from comfyui_levers.bridge.quant import stock_loader_reads_comfy_fp8

    if not stock_loader_reads_comfy_fp8()[0]:
        # ComfyUI 0.3.64's stock loader would read the codes without their scales: the node's report says so and
        # sends the user to the pack's loader, which the reload uses
        assert any("stock UNETLoader does not read it" in t for texts in result.reports.values() for t in texts), \
            result.reports
        graph["1"] = {"class_type": "LeversLoadQuantizedDiT", "inputs": {"unet_name": new[0].name}}
    reloaded = run(graph)
    assert psnr(ref_latent, latent_of(reloaded)) >= LATENT_PSNR_MIN["fp8_e4m3fn"]


def test_model_2_used_without_its_input_stops_with_a_message_naming_it(run, object_info):
    """PhaseOffload's MODEL_2 wired to a sampler while model_2 is unconnected: ComfyUI stops that sampler with the
    node's message (not an AttributeError on None from inside the sampler)."""
    _require(object_info, "LeversPhaseOffload")
    api = wan_graph(object_info, model_chain=[("LeversPhaseOffload", {})], nonce=77, prefix="model2")
    api["13"]["inputs"]["model"] = ["4", list(object_info["LeversPhaseOffload"]["output_name"]).index("MODEL_2")]
    result = run(api, expect="error")
    detail = C.format_execution_error(result.error, result.status)
    assert "model_2 input is not connected" in detail, detail


def _two_experts_graph(object_info, *, phase: bool, nonce: int, prefix: str, low_noise: str = UNET_LOW) -> dict:
    """Wan 2.2's recipe on two tiny DiTs (the experts): KSamplerAdvanced steps 0-2 on the first (leftover noise
    kept), 2-4 on the second; with ``phase`` both go through PhaseOffload (model, model_2)."""
    api = {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": UNET, "weight_dtype": "default"}},
        "2": {"class_type": "LeversTestNonce", "inputs": {"model": ["1", 0], "nonce": nonce}},
        "21": {"class_type": "UNETLoader", "inputs": {"unet_name": low_noise, "weight_dtype": "default"}},
        "22": {"class_type": "LeversTestNonce", "inputs": {"model": ["21", 0], "nonce": nonce + 1}},
        "10": {"class_type": "LeversTestConditioning", "inputs": {"seed": 100, "tokens": 8, "dim": 4096, "scale": 1.0}},
        "11": {"class_type": "LeversTestConditioning", "inputs": {"seed": 200, "tokens": 8, "dim": 4096, "scale": 0.1}},
        "12": {"class_type": "EmptyHunyuanLatentVideo", "inputs": {"width": WIDTH, "height": HEIGHT, "length": FRAMES,
                                                                   "batch_size": 1}},
    }
    high, low = ["2", 0], ["22", 0]
    if phase:
        api["4"] = levers_node(object_info, "LeversPhaseOffload", model=["2", 0], model_2=["22", 0])
        names = list(object_info["LeversPhaseOffload"]["output_name"])
        high, low = ["4", names.index("MODEL")], ["4", names.index("MODEL_2")]
    common = {"noise_seed": 0, "steps": 4, "cfg": 2.0, "sampler_name": "euler", "scheduler": "simple",
              "positive": ["10", 0], "negative": ["11", 0]}
    api["13"] = {"class_type": "KSamplerAdvanced", "inputs": {
        **common, "model": high, "add_noise": "enable", "latent_image": ["12", 0], "start_at_step": 0,
        "end_at_step": 2, "return_with_leftover_noise": "enable"}}
    api["14"] = {"class_type": "KSamplerAdvanced", "inputs": {
        **common, "model": low, "add_noise": "disable", "latent_image": ["13", 0], "start_at_step": 2,
        "end_at_step": 10000, "return_with_leftover_noise": "disable"}}
    api["15"] = {"class_type": "SaveLatent", "inputs": {"samples": ["14", 0], "filename_prefix": f"latents/{prefix}"}}
    assert C.validate_api(api, object_info) == []
    return api


def test_two_experts_through_phase_offload_in_a_real_server(run, object_info):
    """PhaseOffload's MODEL_2 through ComfyUI's executor (output slot, caching, two KSamplerAdvanced): the latent is
    bit-identical to the same graph without the node, twice."""
    _require(object_info, "LeversPhaseOffload")
    ref = latent_of(run(_two_experts_graph(object_info, phase=False, nonce=300, prefix="experts-ref")))
    one = latent_of(run(_two_experts_graph(object_info, phase=False, nonce=302, prefix="experts-one", low_noise=UNET)))
    assert not torch.equal(one, ref), "the second expert must change the output for this test to mean much"
    for i in range(2):
        got = latent_of(run(_two_experts_graph(object_info, phase=True, nonce=310 + 2 * i, prefix=f"experts-{i}")))
        assert torch.equal(got, ref)


def test_a_bad_save_path_is_refused_before_anything_runs(server, object_info):
    """Found in review: a save_path leaving the models folder or in a missing folder failed only when QuantizeDiT
    ran, after the loader (24 GB for FLUX). ComfyUI's own validation now refuses it: /prompt answers 400 naming the
    node and the fix, and nothing is queued. (A file that exists is left to the run, see test_quantize_node.)"""
    _require(object_info, "LeversQuantizeDiT")
    for bad, says in (("../../escape", "may not leave"), ("/nonexistent/dir/x", "does not exist")):
        api = wan_graph(object_info, model_chain=[("LeversQuantizeDiT", {"save_path": bad})], prefix="bad_save")
        status, answer = server.post("/prompt", {"prompt": api, "client_id": "levers-e2e-save-path"})
        assert status == 400, answer
        (node_id,) = [k for k, v in api.items() if v["class_type"] == "LeversQuantizeDiT"]
        (err,) = answer["node_errors"][node_id]["errors"]
        assert err["type"] == "custom_validation_failed" and says in err["details"], err


def test_levers_run_uploads_an_input_image_that_loadimage_reads(server, object_info, tmp_path):
    """`levers run --input LoadImage.image=FILE` against the real server: ComfyUI's /upload/image takes the client's
    multipart body, files the image in input/, and LoadImage -> SaveImage gives back the same pixels."""
    import numpy as np
    from PIL import Image

    from comfyui_levers.cli import main

    pixels = (np.arange(8 * 8 * 3) * 7 % 256).astype("uint8").reshape(8, 8, 3)
    src = tmp_path / "levers_e2e_input.png"
    Image.fromarray(pixels).save(src)
    api = {"1": {"class_type": "LoadImage", "inputs": {"image": "not_uploaded_yet.png"}},
           "2": {"class_type": "SaveImage", "inputs": {"images": ["1", 0], "filename_prefix": "levers_e2e_upload"}}}
    wf = tmp_path / "upload.json"
    wf.write_text(json.dumps(api))
    out = tmp_path / "out"
    assert main(["run", str(wf), "--server", server.url, "--out", str(out), "--quiet",
                 "--input", f"LoadImage.image={src}"]) == 0, server.log_tail()
    (saved,) = list(out.rglob("levers_e2e_upload*.png"))
    assert np.array_equal(np.asarray(Image.open(saved).convert("RGB")), pixels)
