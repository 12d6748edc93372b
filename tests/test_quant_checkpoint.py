"""Streaming checkpoint quantizer: layouts, round trips, memory bound, atomic writes, the CLI."""
from __future__ import annotations

import gc
import json
import os
import tracemalloc

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from comfyui_levers.core.errors import ConfigError
from comfyui_levers.core.quant import QuantConfig, Granularity, census, get_quantizer, sqnr
from comfyui_levers.core.quant import checkpoint as ckpt
from comfyui_levers.core.quant.cli import main as cli_main
from comfyui_levers.core.types import Precision


def wan_state_dict(depth=2, d=256, ffn=512, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    t = torch.distributions.StudentT(5.0)
    torch.manual_seed(seed)
    sd = {"patch_embedding.weight": torch.randn(d, 16, 1, 2, 2, generator=g),
          "text_embedding.0.weight": torch.randn(d, 64, generator=g), "head.head.weight": torch.randn(64, d, generator=g),
          "head.modulation": torch.randn(1, 2, d, generator=g)}
    for i in range(depth):
        for a in ("self_attn", "cross_attn"):
            for n in ("q", "k", "v", "o"):
                sd[f"blocks.{i}.{a}.{n}.weight"] = t.sample((d, d)) * 0.02
                sd[f"blocks.{i}.{a}.{n}.bias"] = torch.randn(d, generator=g) * 0.01
            sd[f"blocks.{i}.{a}.norm_q.weight"] = torch.ones(d)
        sd[f"blocks.{i}.ffn.0.weight"] = t.sample((ffn, d)) * 0.02
        sd[f"blocks.{i}.ffn.2.weight"] = t.sample((d, ffn)) * 0.02
        sd[f"blocks.{i}.modulation"] = torch.randn(1, 6, d, generator=g)
    return {k: v.to(dtype).contiguous() for k, v in sd.items()}


@pytest.fixture
def src(tmp_path):
    sd = wan_state_dict()
    path = tmp_path / "in.safetensors"
    save_file(sd, str(path), metadata={"modelspec.title": "tiny"})
    return str(path), sd


def test_fp8_per_tensor_writes_comfyui_layout(src, tmp_path):
    path, sd = src
    out = str(tmp_path / "out.safetensors")
    report = ckpt.quantize_file(path, out, QuantConfig("fp8", "per_tensor"))
    loaded = load_file(out)  # readable by the reference safetensors reader
    with safe_open(out, "pt") as f:
        meta = f.metadata()
    layer = "blocks.0.self_attn.q"
    assert loaded[f"{layer}.weight"].dtype == torch.float8_e4m3fn
    assert loaded[f"{layer}.weight_scale"].dtype == torch.float32 and loaded[f"{layer}.weight_scale"].shape == ()
    assert json.loads(bytes(loaded[f"{layer}.comfy_quant"].tolist())) == {"format": "float8_e4m3fn"}
    qmeta = json.loads(meta["_quantization_metadata"])
    assert set(qmeta["layers"]) == {l.name for l in report.layers} and len(report.layers) == 20
    assert all(v == {"format": "float8_e4m3fn"} for v in qmeta["layers"].values())
    assert meta["modelspec.title"] == "tiny"  # source metadata is carried over
    # kept tensors are byte-identical, biases stay in their dtype
    for k in ("head.head.weight", "blocks.1.modulation", "blocks.0.self_attn.q.bias", "patch_embedding.weight"):
        assert torch.equal(loaded[k], sd[k]) and loaded[k].dtype == sd[k].dtype
    deq = loaded[f"{layer}.weight"].float() * loaded[f"{layer}.weight_scale"]
    assert sqnr(sd[f"{layer}.weight"], deq) > 30


@pytest.mark.parametrize("fmt,gran", [("fp8", "per_tensor"), ("fp8", "per_row"), ("fp8", "per_block"),
                                      ("int8", "per_row"), ("nf4", None)])
def test_round_trip_through_save_and_load(src, tmp_path, fmt, gran):
    path, sd = src
    out = str(tmp_path / f"{fmt}.safetensors")
    cfg = QuantConfig(fmt, gran)
    report = ckpt.quantize_file(path, out, cfg)
    plain, quantized, meta = ckpt.load_quantized_file(out)
    expected = {e.key[: -len(".weight")] for e in census(sd, config=cfg).quantized}
    assert set(quantized) == expected
    q = get_quantizer(cfg.format)
    for layer, qw in quantized.items():
        direct = q.quantize(sd[f"{layer}.weight"], cfg.granularity, cfg.block_size)
        # what was saved is exactly what quantizing in memory gives, and dequantizes identically
        assert torch.equal(qw.dequantize(torch.float32), direct.dequantize(torch.float32)), layer
        assert qw.shape == tuple(sd[f"{layer}.weight"].shape)
    assert set(plain) == set(sd) - {f"{l}.weight" for l in expected}
    assert json.loads(meta[ckpt.LEVERS_META_KEY])["config"]["format"] == str(cfg.format)
    assert os.path.getsize(out) < os.path.getsize(path)
    assert report.size_after < report.size_before


def test_nf4_file_uses_bitsandbytes_serialisation(src, tmp_path):
    bnbf = pytest.importorskip("bitsandbytes.functional")
    path, sd = src
    out = str(tmp_path / "nf4.safetensors")
    ckpt.quantize_file(path, out, QuantConfig("nf4"))
    loaded = load_file(out)
    layer = "blocks.1.ffn.0"
    qs = {k[len(layer) + len(".weight."):]: v for k, v in loaded.items() if k.startswith(layer + ".weight.")}
    assert set(qs) == {"absmax", "quant_map", "quant_state.bitsandbytes__nf4"}
    state = bnbf.QuantState.from_dict(qs, device=torch.device("cpu"))
    deq = bnbf.dequantize_4bit(loaded[f"{layer}.weight"], state)  # plain bitsandbytes reads it
    assert deq.shape == sd[f"{layer}.weight"].shape
    assert sqnr(sd[f"{layer}.weight"], deq) > 15


def test_refuses_overwrite_without_force(src, tmp_path):
    path, _ = src
    out = tmp_path / "out.safetensors"
    out.write_bytes(b"keep me")
    with pytest.raises(FileExistsError, match="--force"):
        ckpt.quantize_file(path, str(out), QuantConfig("fp8"))
    assert out.read_bytes() == b"keep me"
    ckpt.quantize_file(path, str(out), QuantConfig("fp8"), force=True)
    assert len(load_file(str(out))) > 0


def test_the_saved_file_follows_the_umask_like_any_saved_model(src, tmp_path):
    """Found in review: the file kept mkstemp's owner-only mode 0600, so another user (a shared ComfyUI install, a
    server running as a service account) could not load it."""
    import os
    import stat

    path, _ = src
    old = os.umask(0o022)
    try:
        out = tmp_path / "shared.safetensors"
        ckpt.quantize_file(path, str(out), QuantConfig("fp8"))
    finally:
        os.umask(old)
    assert stat.S_IMODE(out.stat().st_mode) == 0o644


def test_settings_that_keep_every_layer_are_named_instead_of_the_architecture(src, tmp_path):
    path, _ = src
    out = tmp_path / "none.safetensors"
    with pytest.raises(ConfigError, match=r"keep_first_blocks=200 is not valid.*they keep every layer.*nothing is quantized"):
        ckpt.quantize_file(path, str(out), QuantConfig("fp8", keep_first_blocks=200))
    assert not out.exists()


def test_error_midway_leaves_no_partial_file(src, tmp_path):
    path, _ = src
    out = tmp_path / "out.safetensors"

    def explode(done, total, key):
        if done == 10:
            raise KeyboardInterrupt  # an interrupt, not just an Exception

    with pytest.raises(KeyboardInterrupt):
        ckpt.quantize_file(path, str(out), QuantConfig("fp8"), progress=explode)
    assert sorted(os.listdir(tmp_path)) == ["in.safetensors"]  # no OUT, no temp or scratch files


def test_error_midway_keeps_existing_output_intact(src, tmp_path):
    path, _ = src
    out = tmp_path / "out.safetensors"
    out.write_bytes(b"old")

    def explode(done, total, key):
        if done == 5:
            raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        ckpt.quantize_file(path, str(out), QuantConfig("fp8"), force=True, progress=explode)
    assert out.read_bytes() == b"old"
    assert sorted(os.listdir(tmp_path)) == ["in.safetensors", "out.safetensors"]


def test_refuses_already_quantized_input(src, tmp_path):
    path, _ = src
    out1, out2 = str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors")
    ckpt.quantize_file(path, out1, QuantConfig("fp8"))
    with pytest.raises(ValueError, match="already quantized"):
        ckpt.quantize_file(out1, out2, QuantConfig("int8"))


def test_a_full_checkpoint_with_a_scaled_fp8_text_encoder_is_quantized(tmp_path):
    """Found in review: a bf16 diffusion model bundled with a scaled-fp8 text encoder (its ``.scale_weight`` keys)
    was refused as "already quantized", though the README says full checkpoints are supported. Only the diffusion
    model's keys decide; the encoder is copied as it is."""
    full = {f"model.diffusion_model.{k}": v for k, v in wan_state_dict().items()}
    te = "text_encoders.t5xxl.transformer.encoder.block.0.layer.0.SelfAttention.q"
    full[f"{te}.weight"] = torch.randn(16, 16).to(torch.float8_e4m3fn)
    full[f"{te}.scale_weight"] = torch.tensor(0.5)
    path, out = str(tmp_path / "full.safetensors"), str(tmp_path / "full_fp8.safetensors")
    save_file(full, path)
    report = ckpt.quantize_file(path, out, QuantConfig("fp8"), arch="wan", measure=False)
    assert report.arch == "wan"
    got = load_file(out)
    assert torch.equal(got[f"{te}.scale_weight"], full[f"{te}.scale_weight"])
    assert torch.equal(got[f"{te}.weight"].view(torch.uint8), full[f"{te}.weight"].view(torch.uint8))
    assert got["model.diffusion_model.blocks.0.self_attn.q.weight"].dtype == torch.float8_e4m3fn
    dit_scaled = dict(full, **{"model.diffusion_model.blocks.0.self_attn.q.scale_weight": torch.tensor(1.0)})
    save_file(dit_scaled, path)
    with pytest.raises(ValueError, match="already quantized"):
        ckpt.quantize_file(path, str(tmp_path / "again.safetensors"), QuantConfig("fp8"), arch="wan", measure=False)


def test_streaming_peak_memory_is_a_few_tensors_not_the_model(tmp_path):
    """A ~200 MB fp32 file: peak Python-allocated memory stays near the largest tensor, not the model."""
    d, depth = 1024, 6
    g = torch.Generator().manual_seed(0)
    path = str(tmp_path / "big.safetensors")
    sd = {}
    for i in range(depth):
        for n in ("q", "k", "v", "o"):
            sd[f"blocks.{i}.self_attn.{n}.weight"] = torch.randn(d, d, generator=g, dtype=torch.float32)
        sd[f"blocks.{i}.ffn.0.weight"] = torch.randn(2 * d, d, generator=g)
        sd[f"blocks.{i}.ffn.2.weight"] = torch.randn(d, 2 * d, generator=g)
    sd["patch_embedding.weight"] = torch.randn(d, 16, 1, 2, 2, generator=g)
    save_file(sd, path)
    total = sum(t.numel() * t.element_size() for t in sd.values())
    largest = max(t.numel() * t.element_size() for t in sd.values())
    del sd
    gc.collect()
    _mmap_large_allocations()
    tracemalloc.start()  # torch CPU allocations are tracked through numpy/Python buffers only partly,
    tracemalloc.reset_peak()  # so also bound the resident growth below
    rss0 = _private_rss()
    peak = [0]

    def watch(done, total_, key):
        peak[0] = max(peak[0], _private_rss() - rss0)

    out = str(tmp_path / "out.safetensors")
    ckpt.quantize_file(path, out, QuantConfig("fp8", "per_row"), progress=watch)
    _, py_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert total > 190e6  # 6 blocks of 8 M fp32 weights
    assert py_peak < 3 * largest < total / 8  # Python-side buffers: one copy chunk + one tensor
    # private (anonymous) resident growth: a handful of tensors, far below the model. The mmapped
    # input pages are file-backed and shared, so the kernel can drop them: they are not counted.
    assert peak[0] < total / 3, (peak[0], total)


def _mmap_large_allocations() -> None:
    """Make glibc serve allocations >= 1 MiB with mmap, so freed tensors leave the resident set.

    Otherwise glibc's dynamic threshold moves 8 MB tensors onto the heap after the first free and
    keeps freed heap pages resident: RSS would then measure allocator retention, not live memory.
    (Real checkpoints' tensors are far above glibc's 32 MB ceiling and are always mmapped.)"""
    import ctypes
    import ctypes.util
    import sys

    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    M_MMAP_THRESHOLD = -3
    libc.mallopt(M_MMAP_THRESHOLD, 1 << 20)


def _private_rss() -> int:
    from comfyui_levers.core.benchmark import private_bytes   # the bench's own measure, so both agree

    return private_bytes() or 0


def test_cli_quantize_and_exit_codes(src, tmp_path, capsys):
    path, _ = src
    out = str(tmp_path / "cli.safetensors")
    assert cli_main(["quantize", path, out, "--format", "fp8_e4m3fn"]) == 0
    printed = capsys.readouterr().out
    assert "wan" in printed and "quantized: 20 layers" in printed
    loaded = load_file(out)
    assert "blocks.0.ffn.0.comfy_quant" in loaded  # fp8 auto granularity = ComfyUI layout
    assert cli_main(["quantize", path, out, "--format", "int8"]) == 3
    assert "exists" in capsys.readouterr().err
    assert cli_main(["quantize", path, out, "--format", "nf4", "--granularity", "per_row", "--force"]) == 2
    assert "granularity" in capsys.readouterr().err
    assert cli_main(["quantize", path, out, "--format", "int8", "--force", "--keep-first-blocks", "1",
                     "--extra-skip", "ffn"]) == 0
    loaded = load_file(out)
    assert "blocks.1.self_attn.q.levers_quant" in loaded
    assert "blocks.0.self_attn.q.levers_quant" not in loaded and "blocks.1.ffn.0.levers_quant" not in loaded


def test_bad_files_and_settings_are_clear_errors_before_anything_is_written(src, tmp_path):
    """Found by review: each of these wrote a useless file with exit 0, or ended in a traceback."""
    out = tmp_path / "out.safetensors"
    # nf4 block sizes bitsandbytes does not take (it kept every layer and wrote an unquantized "nf4" file)
    if get_quantizer("nf4").available()[0]:
        with pytest.raises(ValueError, match=r"block_size=32 is not valid: expected for nf4: one of 64, 128"):
            QuantConfig("nf4", block_size=32)
    # weights that are already fp8 codes (no scales): quantizing them again only adds rounding
    codes = tmp_path / "codes.safetensors"
    save_file({k: (v.to(torch.float8_e4m3fn) if v.ndim == 2 else v) for k, v in wan_state_dict().items()}, str(codes))
    with pytest.raises(ValueError, match="already F8_E4M3 codes"):
        ckpt.quantize_file(str(codes), str(out), QuantConfig("fp8_e4m3fn"), measure=False)
    # a file that is not safetensors
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(os.urandom(200))
    with pytest.raises(ValueError, match="IN=.* is not valid: expected a .safetensors file"):
        ckpt.quantize_file(str(junk), str(out), QuantConfig("fp8_e4m3fn"), measure=False)
    # OUT is a folder (IsADirectoryError after all the work, even with --force)
    (tmp_path / "folder").mkdir()
    with pytest.raises(ValueError, match="is a folder"):
        ckpt.quantize_file(src[0], str(tmp_path / "folder"), QuantConfig("fp8_e4m3fn"), force=True, measure=False)
    # nothing the census would quantize (exit 0 and a copy of the input before)
    plain = tmp_path / "plain.safetensors"
    save_file({"encoder.conv.weight": torch.randn(8, 8, 3, 3), "encoder.norm.weight": torch.ones(8)}, str(plain))
    with pytest.raises(ValueError, match="nothing in plain.safetensors matched"):
        ckpt.quantize_file(str(plain), str(out), QuantConfig("fp8_e4m3fn"), measure=False)
    assert not out.exists()
    assert cli_main(["quantize", str(junk), str(out), "--format", "fp8_e4m3fn"]) == 2


def test_the_cli_reads_the_header_of_in_before_it_loads_a_backend(tmp_path, monkeypatch, capsys):
    """torchao prints library-loading lines when imported: a file that is not safetensors is reported before the
    format's backend is asked for, so the one-line error is all the user sees (it came after that noise)."""
    from comfyui_levers.core.quant import checkpoint

    def no_backend(fmt):
        raise AssertionError(f"the {fmt} backend was loaded before IN was read")
    monkeypatch.setattr(checkpoint, "get_quantizer", no_backend)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(os.urandom(200))
    assert cli_main(["quantize", str(junk), str(tmp_path / "out.safetensors"), "--format", "int8"]) == 2
    assert "expected a .safetensors file. it could not be read as one" in capsys.readouterr().err


def test_a_full_checkpoint_quantizes_its_diffusion_model_whatever_else_it_holds(tmp_path):
    """Checkpoints that bundle text encoders and a VAE (e.g. SD3.5 with CLIP-L/G and T5) can hold more of their keys
    than the diffusion model: the census still finds model.diffusion_model.* (as ComfyUI does) and keeps the rest."""
    sd = {f"model.diffusion_model.{k}": v for k, v in wan_state_dict().items()}
    for i in range(60):
        sd[f"text_encoders.t5xxl.transformer.encoder.block.{i}.layer.0.SelfAttention.q.weight"] = \
            torch.randn(64, 64).to(torch.bfloat16)
    plan = census({k: tuple(v.shape) for k, v in sd.items()}, config=QuantConfig("fp8_e4m3fn"))
    assert plan.arch == "wan" and plan.quantized
    assert all(e.key.startswith("model.diffusion_model.blocks.") for e in plan.quantized)
    outside = [e for e in plan.kept if e.key.startswith("text_encoders.")]
    assert len(outside) == 60 and all("outside the diffusion model" in e.reason for e in outside)
    src_path, out = tmp_path / "full.safetensors", tmp_path / "full_fp8.safetensors"
    save_file(sd, str(src_path))
    report = ckpt.quantize_file(str(src_path), str(out), QuantConfig("fp8_e4m3fn"), measure=False)
    assert len(report.layers) == len(plan.quantized)
    with safe_open(str(out), framework="pt") as f:
        assert torch.equal(f.get_tensor("text_encoders.t5xxl.transformer.encoder.block.0.layer.0.SelfAttention.q.weight"),
                           sd["text_encoders.t5xxl.transformer.encoder.block.0.layer.0.SelfAttention.q.weight"])


@pytest.mark.parametrize("fmt", ["fp8_e4m3fn", "int8"])
def test_cli_quantize_modulation_writes_the_modulation_linears_too(tmp_path, capsys, fmt):
    """`--quantize-modulation`: FLUX's img_mod / txt_mod / modulation linears are quantized as well, the file
    loads back with them quantized, and nothing outside the blocks is touched."""
    from test_quant_census import flux_keys

    g = torch.Generator().manual_seed(0)
    sd = {k: (torch.randn(*s, generator=g) * 0.02).to(torch.bfloat16) for k, s in flux_keys(2, 2, d=128).items()}
    path = str(tmp_path / "flux.safetensors")
    save_file(sd, path)
    plain_out, qmod_out = str(tmp_path / "plain.safetensors"), str(tmp_path / "qmod.safetensors")
    assert cli_main(["quantize", path, plain_out, "--format", fmt]) == 0
    assert cli_main(["quantize", path, qmod_out, "--format", fmt, "--quantize-modulation"]) == 0
    capsys.readouterr()
    _, plain_q, _ = ckpt.load_quantized_file(plain_out)
    _, qmod_q, meta = ckpt.load_quantized_file(qmod_out)
    mods = {"double_blocks.0.img_mod.lin", "double_blocks.1.txt_mod.lin", "single_blocks.1.modulation.lin"}
    assert not mods & set(plain_q) and mods <= set(qmod_q)
    added = set(qmod_q) - set(plain_q)
    assert all("mod" in layer for layer in added) and len(added) == 2 * 2 + 2
    assert "final_layer.adaLN_modulation.1" not in qmod_q
    assert json.loads(meta[ckpt.LEVERS_META_KEY])["config"]["quantize_modulation"] is True
    for layer in mods:
        assert sqnr(sd[f"{layer}.weight"].float(), qmod_q[layer].dequantize(torch.float32)) > 25
    assert os.path.getsize(qmod_out) < os.path.getsize(plain_out)


def test_out_paths_that_cannot_be_a_file_are_refused_before_any_work(src, tmp_path, capsys, monkeypatch):
    """Found in review: an empty OUT ran the whole pass and then failed; 'nodir/' wrote a file named 'nodir'; OUT under
    a path that is a file said its folder does not exist; IN = OUT with --force advised --force; an unreadable IN was
    reported as missing (safetensors turns EACCES into FileNotFoundError)."""
    path, _ = src
    work = []
    monkeypatch.setattr(ckpt, "quantize_file", lambda *a, **k: work.append(1))
    cases = [("", "expected a file path"), (str(tmp_path / "nodir") + os.sep, "expected a file path"),
             (os.path.join(path, "x.safetensors"), "is a file, not a folder"),
             (path, "a path different from IN")]
    for out, says in cases:
        assert cli_main(["quantize", path, out, "--format", "fp8_e4m3fn", "--force"]) == 2, out
        assert says in capsys.readouterr().err, out
    assert work == [] and not (tmp_path / "nodir").exists()
    real_open = open

    def denied(name, *a, **k):
        if os.path.abspath(str(name)) == os.path.abspath(path):
            raise PermissionError(13, "Permission denied", name)
        return real_open(name, *a, **k)
    monkeypatch.setattr("builtins.open", denied)
    assert cli_main(["quantize", path, str(tmp_path / "o.safetensors"), "--format", "fp8_e4m3fn"]) == 2
    assert "Permission denied" in capsys.readouterr().err and work == []


def test_quantize_progress_without_tqdm_is_one_line_per_update_when_logged(monkeypatch, capsys):
    """Without tqdm the progress was '\\r'-only, so a piped or logged stderr got one long line."""
    import builtins

    from comfyui_levers.core.quant import cli as qcli

    real_import = builtins.__import__

    def no_tqdm(name, *a, **k):
        if name == "tqdm":
            raise ImportError("no tqdm")
        return real_import(name, *a, **k)
    monkeypatch.setattr(builtins, "__import__", no_tqdm)
    update = qcli._progress_bar()
    for done in range(1, 41):
        update(done, 40, f"t{done}")
    err = capsys.readouterr().err          # captured: not a terminal
    assert "\r" not in err and err.splitlines()[0] == "quantize 2/40" and err.splitlines()[-1] == "quantize 40/40"


def test_cli_errors_name_the_options_and_out_must_be_safetensors(src, tmp_path, capsys):
    """Found in review: the command's errors named config fields (block_size=, keep_first_blocks=) and printed the
    keep/skip settings as a Python tuple; 'out.txt' was accepted, and ComfyUI's loaders would not list it."""
    path, _ = src
    assert cli_main(["quantize", path, str(tmp_path / "o.safetensors"), "--format", "nf4", "--block-size", "0"]) == 2
    assert "--block-size=0 is not valid" in capsys.readouterr().err
    assert cli_main(["quantize", path, str(tmp_path / "o.safetensors"), "--format", "fp8",
                     "--keep-first-blocks", "999"]) == 2
    err = capsys.readouterr().err
    assert "--keep-first-blocks=999 is not valid" in err and "(999" not in err, err
    assert cli_main(["quantize", path, str(tmp_path / "out.txt"), "--format", "fp8"]) == 2
    assert "expected a .safetensors file name" in capsys.readouterr().err and not (tmp_path / "out.txt").exists()


def test_source_tensors_of_the_newer_dtypes_are_copied_and_unknown_ones_named(tmp_path):
    """Found in review: a source tensor in a dtype the writer could not name (U16/U32 beside the weights) raised a
    bare KeyError, a traceback from `levers quantize` instead of exit 2. The newer dtypes safetensors names are
    written; any other is a ConfigError naming the tensor."""
    if not hasattr(torch, "uint16"):
        pytest.skip("this torch has no uint16")
    out = tmp_path / "o.safetensors"
    w = ckpt._StreamingSafetensors(str(out))
    w.add("ids", torch.arange(5, dtype=torch.int32).to(torch.uint16))
    w.commit({})
    assert torch.equal(load_file(str(out))["ids"].to(torch.int32), torch.arange(5, dtype=torch.int32))
    bad = ckpt._StreamingSafetensors(str(tmp_path / "bad.safetensors"))
    with pytest.raises(ConfigError, match="complex64"):
        bad.add("z", torch.zeros(2, dtype=torch.complex64))


def _lora_peft(n=2, r=4, d=64):
    return {f"diffusion_model.double_blocks.{i}.img_attn.qkv.lora_{ab}.weight":
            torch.randn((r, d) if ab == "A" else (3 * d, r)).to(torch.bfloat16) for i in range(n) for ab in "AB"}


def _text_encoder(n=2, d=64):
    sd = {"model.embed_tokens.weight": torch.randn(256, d).to(torch.bfloat16)}
    for i in range(n):
        for p in ("q_proj", "k_proj", "v_proj", "o_proj"):
            sd[f"model.layers.{i}.self_attn.{p}.weight"] = torch.randn(d, d).to(torch.bfloat16)
        sd[f"model.layers.{i}.mlp.up_proj.weight"] = torch.randn(2 * d, d).to(torch.bfloat16)
    return sd


@pytest.mark.parametrize("kind", ["lora_peft", "lora_kohya", "lora_diffusers", "lora_linear_layer", "loha_glora",
                                  "text_encoder", "vae"])
def test_a_file_that_is_no_diffusion_model_is_refused_by_name(tmp_path, capsys, kind):
    """A LoRA (ComfyUI / PEFT layout) or a language-model text encoder matched the generic rule and was quantized,
    exit 0: ComfyUI then read the LoRA's fp8 codes as its A/B matrices (about 100x too large, a warning per key)."""
    sd = {"lora_peft": _lora_peft, "text_encoder": _text_encoder,
          "lora_kohya": lambda: {f"lora_unet_double_blocks_{i}_img_attn_qkv.lora_{ud}.weight": torch.randn(8, 8)
                                 for i in range(2) for ud in ("up", "down")},
          "vae": lambda: {f"decoder.up.{i}.block.0.conv1.weight": torch.randn(8, 8, 3, 3) for i in range(2)},
          # the other layouts ComfyUI's LoRA loader reads (comfy/lora.py, comfy/weight_adapter)
          "lora_diffusers": lambda: {f"transformer.single_transformer_blocks.{i}.attn.to_k.lora.{ud}.weight":
                                     torch.randn(8, 8) for i in range(2) for ud in ("up", "down")},
          "lora_linear_layer": lambda: {f"transformer_blocks.{i}.attn.to_q.lora_linear_layer.{ud}.weight":
                                        torch.randn(8, 8) for i in range(2) for ud in ("up", "down")},
          "loha_glora": lambda: {f"diffusion_model.blocks.{i}.self_attn.q.{p}.weight": torch.randn(8, 8)
                                 for i in range(2) for p in ("a1", "a2", "b1", "b2")}}[kind]()
    src, out = tmp_path / "in.safetensors", tmp_path / "out.safetensors"
    save_file(sd, str(src))
    assert cli_main(["quantize", str(src), str(out), "--format", "fp8"]) == 2
    err = capsys.readouterr().err
    what = "a text encoder" if kind == "text_encoder" else "a VAE" if kind == "vae" else "a LoRA"
    assert f"looks like {what}" in err and "in.safetensors" in err, err
    assert not out.exists() and os.listdir(tmp_path) == ["in.safetensors"]


def test_a_layout_no_rule_knows_is_quantized_when_asked_with_arch_generic(tmp_path):
    """The text-encoder check is a guess from key names: --arch generic says the file is a diffusion model."""
    src, out = tmp_path / "in.safetensors", tmp_path / "out.safetensors"
    save_file(_text_encoder(), str(src))
    report = ckpt.quantize_file(str(src), str(out), QuantConfig("fp8"), arch="generic", measure=False)
    assert len(report.layers) == 10
    with pytest.raises(ConfigError, match="looks like a LoRA"):    # never a diffusion model
        save_file(_lora_peft(), str(src))
        ckpt.quantize_file(str(src), str(tmp_path / "o2.safetensors"), QuantConfig("fp8"), arch="generic")


def test_checks_of_in_s_keys_come_before_the_backend_loads(tmp_path, monkeypatch, capsys):
    """torchao prints library-loading lines on import: "already quantized" or "looks like a LoRA" came after them."""
    from comfyui_levers.core.quant import checkpoint

    real = checkpoint.get_quantizer

    class NoBackend:
        def __init__(self, q):
            self.q = q

        def require(self):
            raise AssertionError("the backend was loaded before IN's keys were checked")

        def __getattr__(self, name):
            return getattr(self.q, name)
    monkeypatch.setattr(checkpoint, "get_quantizer", lambda fmt: NoBackend(real(fmt)))
    src = tmp_path / "lora.safetensors"
    save_file(_lora_peft(), str(src))
    assert cli_main(["quantize", str(src), str(tmp_path / "out.safetensors"), "--format", "int8"]) == 2
    assert "looks like a LoRA" in capsys.readouterr().err


def test_sigterm_during_a_quantize_removes_its_scratch_files(src, tmp_path, capsys, monkeypatch):
    """timeout, docker stop and systemd send SIGTERM: its default action ended the process with a hidden
    .levers-data-* file beside OUT (gigabytes for a real model). Now the writer cleans up, exit status 143."""
    import signal

    from comfyui_levers.core.quant import cli as qcli

    path, _ = src
    outdir = tmp_path / "outdir"
    outdir.mkdir()

    def progress():
        def update(done, total, key):
            if done == 3:
                assert any(n.startswith(".levers-data-") for n in os.listdir(outdir)), "the writer has started"
                os.kill(os.getpid(), signal.SIGTERM)
        return update
    monkeypatch.setattr(qcli, "_progress_bar", progress)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as exc:
        cli_main(["quantize", path, str(outdir / "out.safetensors"), "--format", "fp8", "--no-sqnr"])
    assert exc.value.code == 128 + signal.SIGTERM
    assert os.listdir(outdir) == []
    assert signal.getsignal(signal.SIGTERM) == before      # the handler lives only as long as the quantize
