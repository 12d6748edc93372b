"""Load Quantized DiT in a real ComfyUI: files saved by QuantizeDiT load back bit-identically, small."""
from __future__ import annotations

import os

import pytest
import torch


@pytest.fixture(scope="module")
def nodes(comfy_env):
    from comfyui_levers.nodes.load_quantized import LeversLoadQuantizedDiT
    from comfyui_levers.nodes.quantize import LeversQuantizeDiT
    return LeversQuantizeDiT, LeversLoadQuantizedDiT


@pytest.fixture(scope="module")
def base(tiny_wan):
    return tiny_wan.load_model()


def _save(quantize, model, comfy_env, name, **kw):
    path = os.path.join(comfy_env.models_dir, "diffusion_models", name)
    if os.path.exists(path):
        os.unlink(path)
    out = quantize.execute(model, save_path=path, **kw)
    return out.result[0], path


@pytest.mark.parametrize("fmt,granularity", [("int8", "auto"), ("nf4", "auto"), ("fp8_e4m3fn", "per_row"),
                                             ("fp8_e4m3fn", "per_block")])
def test_saved_file_loads_bit_identical(nodes, tiny_wan, base, comfy_env, fmt, granularity):
    quantize, load = nodes
    name = f"levers_loader_{fmt}_{granularity}.safetensors"
    qmodel, path = _save(quantize, base, comfy_env, name, format=fmt, granularity=granularity)
    out = load.execute(name)
    loaded, report = out.result
    print("\n" + report)
    assert "Levers loader" in report and fmt in report
    assert loaded is not qmodel
    # exactly the codes and scales QuantizeDiT produced, and every kept tensor as ComfyUI would load it
    want = qmodel.model.diffusion_model.state_dict()
    got = loaded.model.diffusion_model.state_dict()
    assert set(want) == set(got)
    for k in want:
        assert want[k].dtype == got[k].dtype and torch.equal(want[k], got[k]), k
    assert loaded.model_size() == qmodel.model_size()
    assert loaded.model_size() < 0.7 * base.model_size()
    ref = tiny_wan.sample(qmodel, seed=1)["samples"]
    assert torch.equal(tiny_wan.sample(loaded, seed=1)["samples"], ref)


@pytest.mark.parametrize("fmt,granularity", [("int8", "auto"), ("fp8_e4m3fn", "per_row"), ("nf4", "auto")])
def test_what_the_save_line_says_of_the_stock_loader_holds(nodes, tiny_wan, base, comfy_env, fmt, granularity):
    """The save line's claim about the stock Load Diffusion Model, checked against it: a Levers-layout file loads
    without its scales (wrong output, no error), an nf4 file fails to load."""
    from comfyui_levers.core.quant import psnr

    quantize, _ = nodes
    name = f"levers_stock_{fmt}_{granularity}.safetensors"
    path = os.path.join(comfy_env.models_dir, "diffusion_models", name)
    if os.path.exists(path):
        os.unlink(path)
    qmodel, report = quantize.execute(base, save_path=path, format=fmt, granularity=granularity,
                                      quality_check=False).result
    stock = comfy_env.nodes.UNETLoader()
    if fmt == "nf4":
        assert "the stock Load Diffusion Model fails on it" in report, report
        with pytest.raises(Exception):
            stock.load_unet(name, "default")
        return
    assert "reads it without its scales, with wrong output and no error" in report, report
    wrong = stock.load_unet(name, "default")[0]
    ref = tiny_wan.sample(qmodel, seed=1)["samples"]
    assert psnr(ref, tiny_wan.sample(wrong, seed=1)["samples"]) < 25.0


def test_plain_file_uses_comfyui_loader(nodes, tiny_wan, base):
    _, load = nodes
    loaded, report = load.execute(tiny_wan.unet_name).result
    assert "ComfyUI's own loader" in report and "no quantized layers" in report
    assert torch.equal(tiny_wan.sample(loaded, seed=1)["samples"], tiny_wan.sample(base, seed=1)["samples"])


def test_comfy_fp8_file_uses_comfyui_loader(nodes, tiny_wan, base, comfy_env):
    from comfyui_levers.bridge.quant import native_fp8_available

    quantize, load = nodes
    name = "levers_loader_fp8_tensor.safetensors"
    qmodel, _ = _save(quantize, base, comfy_env, name, format="fp8_e4m3fn", granularity="per_tensor")
    loaded, report = load.execute(name).result
    stock = comfy_env.nodes.UNETLoader().load_unet(name, "default")[0] if native_fp8_available()[0] else None
    if stock is not None:
        assert "ComfyUI's own loader" in report
        assert torch.equal(tiny_wan.sample(loaded, seed=1)["samples"], tiny_wan.sample(stock, seed=1)["samples"])
    else:
        assert "Levers loader" in report


def test_lora_on_loaded_int8(nodes, tiny_wan, base, comfy_env):
    import comfy.sd
    from test_quantize_node import _tiny_lora

    quantize, load = nodes
    name = "levers_loader_lora_int8.safetensors"
    qmodel, _ = _save(quantize, base, comfy_env, name, format="int8")
    loaded = load.execute(name).result[0]
    lora = _tiny_lora(base)
    a = tiny_wan.sample(comfy.sd.load_lora_for_models(qmodel, None, lora, 1.0, 0.0)[0], seed=1)["samples"]
    b = tiny_wan.sample(comfy.sd.load_lora_for_models(loaded, None, lora, 1.0, 0.0)[0], seed=1)["samples"]
    assert torch.equal(a, b)
    assert not torch.equal(b, tiny_wan.sample(loaded, seed=1)["samples"])  # the LoRA did something


def test_errors_name_the_file(nodes, comfy_env, tmp_path):
    from comfyui_levers.core.errors import ConfigError

    _, load = nodes
    bad = os.path.join(comfy_env.models_dir, "diffusion_models", "levers_not_safetensors.safetensors")
    with open(bad, "wb") as f:
        f.write(b"PK\x03\x04 this is a zip, not a safetensors" * 4)
    with pytest.raises(ConfigError, match="levers_not_safetensors"):
        load.execute("levers_not_safetensors.safetensors")
    with pytest.raises(ConfigError, match="diffusion_models"):
        load.execute("no_such_file.safetensors")


@pytest.mark.parametrize("fmt", ["int8", "nf4"])
def test_quantized_codes_without_a_tag_are_refused_with_the_reason(nodes, base, comfy_env, fmt):
    """Found in review: a file of int8 or nf4 codes with their scales but no quant tag (another tool's layout) was
    called plain and handed to ComfyUI: int8 loaded as weights (18.7 dB from the right output, no error), nf4 failed
    with a size mismatch naming nothing. It is refused before loading, naming the file and what to do."""
    from safetensors.torch import load_file, save_file

    from comfyui_levers.core.errors import ConfigError

    quantize, load = nodes
    _, path = _save(quantize, base, comfy_env, f"levers_tagged_{fmt}.safetensors", format=fmt, quality_check=False)
    name = f"levers_untagged_{fmt}.safetensors"
    untagged = os.path.join(comfy_env.models_dir, "diffusion_models", name)
    save_file({k: v for k, v in load_file(path).items() if not k.endswith(".levers_quant")}, untagged)
    with pytest.raises(ConfigError, match=f"{name}.*quantized codes with their scales but no quant tag"):
        load.execute(name)


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="reads the Linux RSS high-water mark")
def test_host_ram_peak_is_the_quantized_size(nodes, comfy_env):
    """A Wan of 25 M block params (50 MiB of bf16 weights) as nf4: the load's RSS peak stays near the
    quantized size (codes + kept tensors), far below the bf16 model. Measured (CPU, ComfyUI 0.8.0): peak rise
    35.1 MiB for a 30.6 MiB model whose all-bf16 size is 56.5 MiB."""
    import ctypes
    import ctypes.util
    import gc

    from tiny_models import save, tiny_wan_dit_state_dict

    from comfyui_levers.bridge.quant_loader import inspect_file
    from comfyui_levers.core.quant import QuantConfig
    from comfyui_levers.core.quant.checkpoint import quantize_file

    # glibc: >= 1 MiB allocations via mmap (freed ones leave the RSS); malloc_trim below returns the
    # rest of the free heap, so memory freed earlier cannot absorb this load's allocations unseen
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    libc.mallopt(-3, 1 << 20)
    _, load = nodes
    folder = os.path.join(comfy_env.models_dir, "diffusion_models")
    src, name = os.path.join(folder, "levers_mem_src.safetensors"), "levers_mem_nf4.safetensors"
    for p in (src, os.path.join(folder, name)):
        if os.path.exists(p):
            os.unlink(p)
    sd = {k: v.to(torch.bfloat16) for k, v in tiny_wan_dit_state_dict(dim=512, ffn_dim=2048, num_layers=6).items()}
    save(sd, src)
    del sd
    quantize_file(src, os.path.join(folder, name), QuantConfig("nf4"), measure=False)
    info = inspect_file(os.path.join(folder, name))
    bf16 = info.bf16_bytes()
    assert bf16 > 50 * 2 ** 20

    gc.collect()
    libc.malloc_trim(0)

    def vm(field):
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) * 1024 for l in f if l.startswith(field + ":"))

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    base = vm("VmRSS")
    loaded, report = load.execute(name).result
    rise = vm("VmHWM") - base
    held = loaded.model_size()
    print(f"\n{report}\nRSS peak rise {rise / 2**20:.1f} MiB, model {held / 2**20:.1f} MiB, bf16 {bf16 / 2**20:.1f} MiB")
    assert "Levers loader" in report
    assert rise < held + 0.15 * bf16, (rise, held, bf16)
    assert rise < 0.7 * bf16


def test_full_checkpoint_from_levers_quantize(nodes, tiny_wan, comfy_env):
    """`levers quantize` on a full checkpoint keeps the model.diffusion_model. prefix and other components."""
    from safetensors.torch import load_file, save_file

    from comfyui_levers.core.quant import QuantConfig
    from comfyui_levers.core.quant.checkpoint import quantize_file

    _, load = nodes
    folder = os.path.join(comfy_env.models_dir, "diffusion_models")
    sd = load_file(os.path.join(folder, tiny_wan.unet_name))
    full = {f"model.diffusion_model.{k}": v for k, v in sd.items()}
    full["first_stage_model.decoder.conv_in.weight"] = torch.zeros(4, 4, 3, 3)  # a VAE tensor: ignored
    paths = {}
    for kind, data in (("bare", sd), ("full", full)):
        src = os.path.join(folder, f"levers_ckpt_{kind}_src.safetensors")
        paths[kind] = f"levers_ckpt_{kind}_int8.safetensors"
        for p in (src, os.path.join(folder, paths[kind])):
            if os.path.exists(p):
                os.unlink(p)
        save_file(data, src)
        quantize_file(src, os.path.join(folder, paths[kind]), QuantConfig("int8"), arch="wan", measure=False)
    bare = load.execute(paths["bare"]).result[0]
    # found in review: every tensor of a full checkpoint was read into RAM (a FLUX file's T5, CLIP and VAE: about
    # 10 GB) only to be dropped after detection; only the diffusion model's are read now
    from comfyui_levers.bridge import quant_loader as ql

    read = []
    original = ql.TensorReader.__call__

    def spy(self, name):
        read.append(name)
        return original(self, name)
    ql.TensorReader.__call__ = spy
    try:
        loaded, report = load.execute(paths["full"]).result
    finally:
        ql.TensorReader.__call__ = original
    assert read and not [k for k in read if not k.startswith("model.diffusion_model.")], read
    assert "Levers loader" in report
    a, b = bare.model.diffusion_model.state_dict(), loaded.model.diffusion_model.state_dict()
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("fmt,granularity", [("int8", "auto"), ("fp8_e4m3fn", "per_tensor")])
def test_a_saved_file_keeps_the_models_configuration(nodes, comfy_env, fmt, granularity):
    """Found in review: ComfyUI builds LTX-Video (and LTX-2, and Wan on newer releases) with settings read from the
    file's ``config`` metadata that the weights do not show (LTX's causal temporal positioning, its timestep scale).
    QuantizeDiT's save wrote none: Load Quantized DiT and the stock loader built the model with the defaults, and the
    saved file sampled otherwise than the quantized model it came from, with no error. The save carries the model's
    configuration now."""
    import json

    import comfy.supported_models as sm
    from safetensors.torch import save_file
    from tiny_dits import tiny_ltxv
    from tiny_models import fill_random_

    quantize, load = nodes
    tiny = tiny_ltxv()
    mc = sm.LTXV({"image_model": "ltxv", "num_layers": 4, "attention_head_dim": 4, "cross_attention_dim": 128})
    mc.set_inference_dtype(torch.float32, None)
    shapes = mc.get_model({}, device="meta").diffusion_model.state_dict()
    sd = fill_random_({k: torch.empty(v.shape) for k, v in shapes.items()}, 0)
    src = os.path.join(comfy_env.models_dir, "diffusion_models", "levers_ltxv_with_config.safetensors")
    settings = {"causal_temporal_positioning": True, "timestep_scale_multiplier": 250.0}
    save_file(sd, src, metadata={"config": json.dumps({"transformer": settings})})
    base = comfy_env.nodes.UNETLoader().load_unet(os.path.basename(src), "default")[0]
    if {k: base.model.model_config.unet_config.get(k) for k in settings} != settings:
        pytest.skip("this ComfyUI (0.3.64 is one) does not read LTX-Video's settings from a file's config metadata")
    qmodel, path = _save(quantize, base, comfy_env, f"levers_ltxv_{fmt}.safetensors", format=fmt,
                         granularity=granularity, quality_check=False)
    loaded = load.execute(os.path.basename(path)).result[0]
    assert {k: loaded.model.model_config.unet_config.get(k) for k in settings} == settings
    assert torch.equal(tiny.sample(loaded), tiny.sample(qmodel))
