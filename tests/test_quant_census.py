"""Realistic state-dict key lists (names + shapes) for census tests, per architecture, scaled down."""
from __future__ import annotations


def flux_keys(depth_double=3, depth_single=4, d=256, prefix="") -> dict:
    k = {}
    for n, s in {"img_in": (d, 64), "txt_in": (d, 512), "time_in.in_layer": (d, 256), "time_in.out_layer": (d, d),
                 "vector_in.in_layer": (d, 768), "vector_in.out_layer": (d, d), "guidance_in.in_layer": (d, 256),
                 "guidance_in.out_layer": (d, d), "final_layer.linear": (64, d),
                 "final_layer.adaLN_modulation.1": (2 * d, d)}.items():
        k[f"{n}.weight"], k[f"{n}.bias"] = s, (s[0],)
    for i in range(depth_double):
        for side in ("img", "txt"):
            for n, s in {f"{side}_mod.lin": (6 * d, d), f"{side}_attn.qkv": (3 * d, d), f"{side}_attn.proj": (d, d),
                         f"{side}_mlp.0": (4 * d, d), f"{side}_mlp.2": (d, 4 * d)}.items():
                k[f"double_blocks.{i}.{n}.weight"], k[f"double_blocks.{i}.{n}.bias"] = s, (s[0],)
            k[f"double_blocks.{i}.{side}_attn.norm.query_norm.scale"] = (64,)
            k[f"double_blocks.{i}.{side}_attn.norm.key_norm.scale"] = (64,)
    for i in range(depth_single):
        for n, s in {"linear1": (7 * d, d), "linear2": (d, 5 * d), "modulation.lin": (3 * d, d)}.items():
            k[f"single_blocks.{i}.{n}.weight"], k[f"single_blocks.{i}.{n}.bias"] = s, (s[0],)
        k[f"single_blocks.{i}.norm.query_norm.scale"] = (64,)
    return {prefix + key: v for key, v in k.items()}


def chroma_keys() -> dict:
    k = {key: v for key, v in flux_keys().items() if "_mod." not in key and "modulation.lin" not in key
         and not key.startswith(("time_in", "vector_in", "guidance_in"))}
    for i in range(2):
        k[f"distilled_guidance_layer.layers.{i}.in_layer.weight"] = (256, 256)
        k[f"distilled_guidance_layer.norms.{i}.scale"] = (256,)
    k["distilled_guidance_layer.in_proj.weight"] = (256, 64)
    return k


def hunyuan_video_keys() -> dict:
    k = flux_keys()
    k["img_in.proj.weight"] = (256, 16, 1, 2, 2)
    del k["img_in.weight"]
    for n, s in {"txt_in.input_embedder": (256, 4096), "txt_in.t_embedder.mlp.0": (256, 256),
                 "txt_in.individual_token_refiner.blocks.0.self_attn_qkv": (768, 256),
                 "txt_in.individual_token_refiner.blocks.0.mlp.fc1": (1024, 256)}.items():
        k[f"{n}.weight"] = s
    return k


def wan_keys(depth=4, d=256, ffn=1024, i2v=False, prefix="") -> dict:
    k = {"patch_embedding.weight": (d, 16, 1, 2, 2), "patch_embedding.bias": (d,),
         "text_embedding.0.weight": (d, 4096), "text_embedding.2.weight": (d, d),
         "time_embedding.0.weight": (d, 256), "time_embedding.2.weight": (d, d),
         "time_projection.1.weight": (6 * d, d), "head.head.weight": (64, d), "head.modulation": (1, 2, d)}
    for i in range(depth):
        p = f"blocks.{i}."
        for a in ("self_attn", "cross_attn"):
            for n in ("q", "k", "v", "o"):
                k[f"{p}{a}.{n}.weight"], k[f"{p}{a}.{n}.bias"] = (d, d), (d,)
            k[f"{p}{a}.norm_q.weight"] = (d,)
            k[f"{p}{a}.norm_k.weight"] = (d,)
        if i2v:
            k[f"{p}cross_attn.k_img.weight"] = (d, d)
            k[f"{p}cross_attn.v_img.weight"] = (d, d)
        k[f"{p}norm3.weight"] = (d,)
        k[f"{p}ffn.0.weight"], k[f"{p}ffn.2.weight"] = (ffn, d), (d, ffn)
        k[f"{p}modulation"] = (1, 6, d)
    if i2v:
        k["img_emb.proj.1.weight"] = (d, 1280)
    return {prefix + key: v for key, v in k.items()}


def qwen_image_keys(depth=3, d=256) -> dict:
    k = {"img_in.weight": (d, 64), "txt_in.weight": (d, 3584), "txt_norm.weight": (3584,),
         "time_text_embed.timestep_embedder.linear_1.weight": (d, 256), "norm_out.linear.weight": (2 * d, d),
         "proj_out.weight": (64, d)}
    for i in range(depth):
        p = f"transformer_blocks.{i}."
        for n in ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"):
            k[f"{p}attn.{n}.weight"] = (d, d)
        for s in ("img", "txt"):
            k[f"{p}{s}_mod.1.weight"] = (6 * d, d)
            k[f"{p}{s}_mlp.net.0.proj.weight"] = (4 * d, d)
            k[f"{p}{s}_mlp.net.2.weight"] = (d, 4 * d)
        k[f"{p}attn.norm_q.weight"] = (128,)
    return k


def ltxv_keys(depth=3, d=256) -> dict:
    k = {"patchify_proj.weight": (d, 128), "adaln_single.linear.weight": (6 * d, d),
         "adaln_single.emb.timestep_embedder.linear_1.weight": (d, 256), "caption_projection.linear_1.weight": (d, 4096),
         "proj_out.weight": (128, d), "scale_shift_table": (2, d)}
    for i in range(depth):
        p = f"transformer_blocks.{i}."
        for a in ("attn1", "attn2"):
            for n in ("to_q", "to_k", "to_v", "to_out.0"):
                k[f"{p}{a}.{n}.weight"] = (d, d)
            k[f"{p}{a}.q_norm.weight"] = (d,)
        k[f"{p}ff.net.0.proj.weight"] = (4 * d, d)
        k[f"{p}ff.net.2.weight"] = (d, 4 * d)
        k[f"{p}scale_shift_table"] = (6, d)
    return k


def sd3_keys(depth=3, d=256) -> dict:
    k = {"x_embedder.proj.weight": (d, 16, 2, 2), "t_embedder.mlp.0.weight": (d, 256),
         "y_embedder.mlp.0.weight": (d, 2048), "context_embedder.weight": (d, 4096),
         "final_layer.linear.weight": (64, d), "final_layer.adaLN_modulation.1.weight": (2 * d, d), "pos_embed": (1, 64, d)}
    for i in range(depth):
        for blk in ("x_block", "context_block"):
            p = f"joint_blocks.{i}.{blk}."
            k[p + "attn.qkv.weight"] = (3 * d, d)
            k[p + "attn.proj.weight"] = (d, d)
            k[p + "mlp.fc1.weight"] = (4 * d, d)
            k[p + "mlp.fc2.weight"] = (d, 4 * d)
            k[p + "adaLN_modulation.1.weight"] = (6 * d, d)
    return k


def sdxl_keys(prefix="model.diffusion_model.") -> dict:
    k = {"time_embed.0.weight": (1280, 320), "time_embed.2.weight": (1280, 1280), "label_emb.0.0.weight": (1280, 2816),
         "input_blocks.0.0.weight": (320, 4, 3, 3), "out.2.weight": (4, 320, 3, 3)}
    for blk, ch in (("input_blocks.4", 640), ("input_blocks.7", 1280), ("middle_block", 1280), ("output_blocks.2", 1280)):
        k[f"{blk}.0.in_layers.2.weight"] = (ch, ch, 3, 3)
        k[f"{blk}.0.emb_layers.1.weight"] = (ch, 1280)
        k[f"{blk}.1.proj_in.weight"] = (ch, ch)
        k[f"{blk}.1.proj_out.weight"] = (ch, ch)
        t = f"{blk}.1.transformer_blocks.0."
        for a, kv in (("attn1", ch), ("attn2", 2048)):
            k[t + f"{a}.to_q.weight"] = (ch, ch)
            k[t + f"{a}.to_k.weight"] = (ch, kv)
            k[t + f"{a}.to_v.weight"] = (ch, kv)
            k[t + f"{a}.to_out.0.weight"] = (ch, ch)
        k[t + "ff.net.0.proj.weight"] = (8 * ch, ch)
        k[t + "ff.net.2.weight"] = (ch, 4 * ch)
        k[t + "norm1.weight"] = (ch,)
    return {prefix + key: v for key, v in k.items()}


def hidream_keys(double=2, single=2, d=64, experts=2) -> dict:
    k = {"t_embedder.timestep_embedder.linear_1.weight": (d, 256), "x_embedder.proj.weight": (d, 64),
         "p_embedder.pooled_embedder.linear_1.weight": (d, 32), "caption_projection.0.linear.weight": (d, 64),
         "final_layer.linear.weight": (64, d), "final_layer.adaLN_modulation.1.weight": (2 * d, d)}
    for kind, n, mod in (("double", double, 12), ("single", single, 6)):
        for i in range(n):
            b = f"{kind}_stream_blocks.{i}.block."
            k[b + "adaLN_modulation.1.weight"] = (mod * d, d)
            for proj in ("to_q", "to_k", "to_v", "to_out") + (("to_q_t", "to_k_t", "to_v_t", "to_out_t")
                                                             if kind == "double" else ()):
                k[b + f"attn1.{proj}.weight"], k[b + f"attn1.{proj}.bias"] = (d, d), (d,)
            k[b + "attn1.q_rms_norm.weight"] = (d,)
            k[b + "ff_i.gate.weight"] = (experts, d)
            for e in [f"experts.{j}" for j in range(experts)] + ["shared_experts"]:
                k[b + f"ff_i.{e}.w1.weight"], k[b + f"ff_i.{e}.w2.weight"] = (4 * d, d), (d, 4 * d)
                k[b + f"ff_i.{e}.w3.weight"] = (4 * d, d)
            if kind == "double":
                k[b + "ff_t.w1.weight"], k[b + "ff_t.w2.weight"], k[b + "ff_t.w3.weight"] = (4 * d, d), (d, 4 * d), \
                    (4 * d, d)
    return k


def lumina_keys(layers=3, refiners=2, d=128) -> dict:
    k = {"x_embedder.weight": (d, 64), "t_embedder.mlp.0.weight": (d, 256), "cap_embedder.0.weight": (64,),
         "cap_embedder.1.weight": (d, 64), "final_layer.linear.weight": (64, d),
         "final_layer.adaLN_modulation.1.weight": (d, d)}
    for kind, n in (("context_refiner", refiners), ("noise_refiner", refiners), ("layers", layers)):
        for i in range(n):
            b = f"{kind}.{i}."
            k[b + "attention.qkv.weight"], k[b + "attention.out.weight"] = (3 * d, d), (d, d)
            k[b + "feed_forward.w1.weight"], k[b + "feed_forward.w2.weight"] = (4 * d, d), (d, 4 * d)
            k[b + "feed_forward.w3.weight"] = (4 * d, d)
            k[b + "attention_norm1.weight"] = (d,)
            if kind != "context_refiner":
                k[b + "adaLN_modulation.1.weight"] = (4 * d, d)
    return k


# ---------------------------------------------------------------------------------------------- tests
import pytest  # noqa: E402

from comfyui_levers.core.quant import QuantConfig, census, detect_arch  # noqa: E402
from comfyui_levers.core.errors import ConfigError  # noqa: E402

ARCH_CASES = {
    "flux": flux_keys, "chroma": chroma_keys, "hunyuan_video": hunyuan_video_keys, "wan": wan_keys,
    "qwen_image": qwen_image_keys, "ltxv": ltxv_keys, "sd3": sd3_keys, "sdxl_unet": sdxl_keys,
    "hidream": hidream_keys, "lumina": lumina_keys,
}


@pytest.mark.parametrize("arch", sorted(ARCH_CASES))
def test_detects_architecture(arch):
    assert detect_arch(ARCH_CASES[arch]()) == arch


def test_detects_through_checkpoint_prefix_and_wan_i2v():
    assert detect_arch(flux_keys(prefix="model.diffusion_model.")) == "flux"
    assert detect_arch(wan_keys(i2v=True, prefix="diffusion_model.")) == "wan"
    assert detect_arch(["encoder.layers.0.fc1.weight", "encoder.layers.0.norm.weight"]) == "generic"


def _q(c):
    return {e.key for e in c.quantized}


def test_flux_census_exact():
    c = census(flux_keys())
    expected = {f"double_blocks.{i}.{s}_{n}.weight" for i in range(3) for s in ("img", "txt")
                for n in ("attn.qkv", "attn.proj", "mlp.0", "mlp.2")}
    expected |= {f"single_blocks.{i}.linear{j}.weight" for i in range(4) for j in (1, 2)}
    assert _q(c) == expected
    assert c.n_blocks == 7
    kept = {e.key: e.reason for e in c.kept}
    assert "modulation" in kept["double_blocks.0.img_mod.lin.weight"]
    assert "modulation" in kept["single_blocks.0.modulation.lin.weight"]
    assert "outside" in kept["img_in.weight"] and "outside" in kept["final_layer.linear.weight"]


def test_wan_census_exact_and_prefix_kept_in_keys():
    keys = wan_keys(depth=3, i2v=True, prefix="model.diffusion_model.")
    c = census(keys)
    p = "model.diffusion_model."
    expected = {f"{p}blocks.{i}.{a}.{n}.weight" for i in range(3) for a in ("self_attn", "cross_attn")
                for n in ("q", "k", "v", "o")}
    expected |= {f"{p}blocks.{i}.cross_attn.{n}.weight" for i in range(3) for n in ("k_img", "v_img")}
    expected |= {f"{p}blocks.{i}.ffn.{j}.weight" for i in range(3) for j in (0, 2)}
    assert _q(c) == expected
    assert not c.should_quantize(p + "blocks.0.modulation")
    assert not c.should_quantize(p + "head.head.weight")
    assert not c.should_quantize(p + "text_embedding.0.weight")


@pytest.mark.parametrize("arch,must_quant,must_keep", [
    ("chroma", "single_blocks.1.linear1.weight", "distilled_guidance_layer.layers.0.in_layer.weight"),
    ("hunyuan_video", "double_blocks.0.txt_mlp.0.weight", "txt_in.individual_token_refiner.blocks.0.mlp.fc1.weight"),
    ("qwen_image", "transformer_blocks.1.attn.add_k_proj.weight", "transformer_blocks.1.img_mod.1.weight"),
    ("qwen_image", "transformer_blocks.0.txt_mlp.net.0.proj.weight", "norm_out.linear.weight"),
    ("ltxv", "transformer_blocks.2.attn2.to_out.0.weight", "adaln_single.linear.weight"),
    ("sd3", "joint_blocks.1.context_block.mlp.fc2.weight", "joint_blocks.1.x_block.adaLN_modulation.1.weight"),
    ("sdxl_unet", "model.diffusion_model.middle_block.1.transformer_blocks.0.attn2.to_k.weight",
     "model.diffusion_model.input_blocks.4.0.emb_layers.1.weight"),
    ("sdxl_unet", "model.diffusion_model.output_blocks.2.1.proj_in.weight",
     "model.diffusion_model.label_emb.0.0.weight"),
])
def test_census_per_architecture(arch, must_quant, must_keep):
    c = census(ARCH_CASES[arch]())
    assert c.arch == arch
    assert c.should_quantize(must_quant)
    assert not c.should_quantize(must_keep)
    # nothing 1-D or conv-shaped is ever quantized, and the big block matrices dominate the bytes
    assert all(len(e.shape) == 2 for e in c.quantized)
    assert c.quantized_bytes > c.kept_bytes


def test_sdxl_block_order_and_keep_first_last():
    """keep_first / keep_last count the blocks that hold layers to quantize (found in review: on the real SDXL
    UNet, whose first input blocks are convolutions only, keep_first_blocks 1-4 kept nothing, in silence)."""
    p = "model.diffusion_model."
    c = census(sdxl_keys(), config=QuantConfig("fp8", keep_first_blocks=1, keep_last_blocks=1))
    assert c.n_blocks == 5  # input_blocks.0 (conv_in), .4, .7, middle_block, output_blocks.2
    assert not c.should_quantize(p + "input_blocks.4.1.proj_in.weight")      # the first block with attention
    assert c.should_quantize(p + "input_blocks.7.1.proj_in.weight")
    assert c.should_quantize(p + "middle_block.1.proj_in.weight")
    assert not c.should_quantize(p + "output_blocks.2.1.proj_in.weight")
    c = census(sdxl_keys(), config=QuantConfig("fp8", keep_first_blocks=2, keep_last_blocks=1))
    assert [e.key for e in c.quantized if "proj_in" in e.key] == [p + "middle_block.1.proj_in.weight"]
    assert not c.notes


def test_settings_that_quantize_nothing_or_match_nothing_say_so():
    """Found in review: keep_* covering every block, or an extra_skip that matched no layer, gave no word."""
    c = census(flux_keys(), config=QuantConfig("fp8", keep_first_blocks=4, keep_last_blocks=3))
    assert not c.quantized and any("keep all 7 blocks" in n and "nothing is quantized" in n for n in c.notes)
    for first, last in ((0, 8), (0, 100), (10, 0)):                      # more than there are: all kept, said so
        c = census(flux_keys(), config=QuantConfig("fp8", keep_first_blocks=first, keep_last_blocks=last))
        assert not c.quantized and any("nothing is quantized" in n for n in c.notes), (first, last)
    c = census(flux_keys(), config=QuantConfig("fp8", extra_skip=("img_attn", "IMG_ATTN", "nomatch*")))
    unmatched = [n for n in c.notes if "matched no layer" in n]
    assert len(unmatched) == 2 and "'IMG_ATTN'" in unmatched[0] and "'nomatch*'" in unmatched[1]
    assert "double_blocks.0.img_mlp.0" in unmatched[0]                      # an example of what patterns match


def test_keep_first_last_follow_execution_order_across_groups():
    cfg = QuantConfig("fp8", keep_first_blocks=2, keep_last_blocks=3)
    c = census(flux_keys(), config=cfg)
    blocks_quantized = {e.key.split(".")[0] + "." + e.key.split(".")[1] for e in c.quantized}
    # 3 double + 4 single in execution order: drop double 0,1 and single 1,2,3
    assert blocks_quantized == {"double_blocks.2", "single_blocks.0"}
    reasons = {e.reason for e in c.kept}
    assert "keep_first_blocks=2" in reasons and "keep_last_blocks=3" in reasons


def test_hidream_blocks_are_double_then_single_and_the_router_stays():
    """HiDream's double and single stream blocks are numbered separately: the generic rule gave double.i and
    single.i one block number (3 blocks for 4), so keep_first_blocks=1 kept two."""
    c = census(hidream_keys(), config=QuantConfig("fp8", keep_first_blocks=1))
    assert c.arch == "hidream" and c.n_blocks == 4
    assert not c.should_quantize("double_stream_blocks.0.block.attn1.to_q.weight")
    assert c.should_quantize("double_stream_blocks.1.block.attn1.to_q_t.weight")
    assert c.should_quantize("single_stream_blocks.0.block.ff_i.experts.1.w2.weight")
    assert c.should_quantize("single_stream_blocks.0.block.ff_i.shared_experts.w3.weight")
    kept = {e.key: e.reason for e in c.kept}
    assert "router" in kept["single_stream_blocks.1.block.ff_i.gate.weight"]
    assert "modulation" in kept["double_stream_blocks.1.block.adaLN_modulation.1.weight"]


def test_lumina_refiners_are_blocks_before_the_layers():
    c = census(lumina_keys(), config=QuantConfig("fp8", keep_first_blocks=1, keep_last_blocks=1))
    assert c.arch == "lumina" and c.n_blocks == 2 + 2 + 3
    assert not c.should_quantize("context_refiner.0.attention.qkv.weight")       # first block
    assert c.should_quantize("context_refiner.1.feed_forward.w1.weight")
    assert c.should_quantize("noise_refiner.0.attention.out.weight")
    assert not c.should_quantize("layers.2.feed_forward.w2.weight")              # last block
    assert not c.should_quantize("layers.1.adaLN_modulation.1.weight")


def test_extra_skip_substring_and_glob():
    cfg = QuantConfig("fp8", extra_skip="img_mlp, single_blocks.*.linear2")
    c = census(flux_keys(), config=cfg)
    assert not any("img_mlp" in e.key or "linear2" in e.key for e in c.quantized)
    assert any("txt_mlp" in e.key for e in c.quantized)
    assert any(e.reason.startswith("extra_skip") for e in c.kept)


def test_shape_rules_per_format():
    keys = {"blocks.0.self_attn.q.weight": (256, 200), "blocks.0.self_attn.k.weight": (256, 256),
            "blocks.0.ffn.0.weight": (8, 8), "patch_embedding.weight": (1,), "head.modulation": (1, 2, 4)}
    c = census(keys, arch="wan", config=QuantConfig("fp8", "per_block", block_size=64))
    assert _q(c) == {"blocks.0.self_attn.k.weight"}
    c = census(keys, arch="wan", config=QuantConfig("fp8", "per_row"))
    assert _q(c) == {"blocks.0.self_attn.q.weight", "blocks.0.self_attn.k.weight"}


def test_generic_fallback_skips_embedders_and_norms():
    keys = {"embed_tokens.weight": (1000, 256), "layers.0.attn.q_proj.weight": (256, 256),
            "layers.0.norm1.weight": (256, 256), "layers.0.mlp.fc1.weight": (1024, 256),
            "layers.1.time_mod.weight": (256, 256), "final_proj.weight": (64, 256)}
    c = census(keys)
    assert c.arch == "generic" and c.notes
    assert _q(c) == {"layers.0.attn.q_proj.weight", "layers.0.mlp.fc1.weight"}


def test_unknown_arch_is_a_clear_error():
    with pytest.raises(ValueError, match="arch: unknown architecture 'mamba'.*wan"):
        census(flux_keys(), arch="mamba")


def test_names_only_census_works_without_shapes():
    c = census(list(wan_keys(depth=2)))
    assert c.should_quantize("blocks.1.ffn.2.weight")
    assert c.should_quantize("blocks.1.self_attn.o.weight")
    assert not c.should_quantize("time_projection.1.weight")


@pytest.mark.parametrize("arch,modulation", [
    ("flux", ("double_blocks.0.img_mod.lin.weight", "double_blocks.2.txt_mod.lin.weight",
              "single_blocks.3.modulation.lin.weight")),
    ("hunyuan_video", ("double_blocks.1.img_mod.lin.weight",)),
    ("qwen_image", ("transformer_blocks.1.img_mod.1.weight", "transformer_blocks.0.txt_mod.1.weight")),
    ("sd3", ("joint_blocks.1.x_block.adaLN_modulation.1.weight",)),
])
def test_quantize_modulation_adds_exactly_the_modulation_linears_inside_the_blocks(arch, modulation):
    """The plan quantizes the modulation linears when only that fits (FLUX nf4 on 12 GB): the census then adds
    those and nothing else; the final layer's adaLN, embedders and norms stay 16-bit."""
    keys = ARCH_CASES[arch]()
    plain = census(keys, config=QuantConfig("fp8_e4m3fn"))
    qmod = census(keys, config=QuantConfig("fp8_e4m3fn", quantize_modulation=True))
    added = _q(qmod) - _q(plain)
    assert _q(plain) <= _q(qmod) and set(modulation) <= added
    reasons = {e.key: e.reason for e in plain.kept}
    assert all("modulation" in reasons[k] for k in added), {k: reasons[k] for k in added}
    assert all(qmod.should_quantize(k) == (k in added or plain.should_quantize(k)) for k in keys)
    for k in keys:
        if k.startswith(("final_layer", "norm_out", "img_in", "time_in", "txt_in", "context_embedder")):
            assert not qmod.should_quantize(k), k
    assert {e.reason for e in qmod.quantized if e.key in added} == {"quantize (modulation linear)"}


def test_quantize_modulation_is_a_bool():
    with pytest.raises(ConfigError, match="quantize_modulation"):
        QuantConfig("fp8_e4m3fn", quantize_modulation="yes")


def auraflow_keys(d=128, double=2, single=2) -> dict:
    """AuraFlow's MMDiT: joint ``double_layers`` (attn w1*/w2*, mlpC/mlpX, modC/modX), then ``single_layers``."""
    k = {"t_embedder.mlp.0.weight": (d, 256), "t_embedder.mlp.2.weight": (d, d), "cond_seq_linear.weight": (d, 64),
         "init_x_linear.weight": (d, 16), "final_linear.weight": (16, d), "modF.1.weight": (2 * d, d),
         "positional_encoding": (1, 256, d), "register_tokens": (1, 8, d)}
    for i in range(double):
        for n in ("w1q", "w1k", "w1v", "w1o", "w2q", "w2k", "w2v", "w2o"):
            k[f"double_layers.{i}.attn.{n}.weight"] = (d, d)
        for side in ("C", "X"):
            k[f"double_layers.{i}.mlp{side}.c_fc1.weight"] = (4 * d, d)
            k[f"double_layers.{i}.mlp{side}.c_fc2.weight"] = (4 * d, d)
            k[f"double_layers.{i}.mlp{side}.c_proj.weight"] = (d, 4 * d)
            k[f"double_layers.{i}.mod{side}.1.weight"] = (6 * d, d)
    for i in range(single):
        for n in ("w1q", "w1k", "w1v", "w1o"):
            k[f"single_layers.{i}.attn.{n}.weight"] = (d, d)
        k[f"single_layers.{i}.mlp.c_fc1.weight"] = (4 * d, d)
        k[f"single_layers.{i}.mlp.c_fc2.weight"] = (4 * d, d)
        k[f"single_layers.{i}.mlp.c_proj.weight"] = (d, 4 * d)
        k[f"single_layers.{i}.modCX.1.weight"] = (6 * d, d)
    return k


def test_auraflow_double_then_single_layers_modulation_kept():
    """AuraFlow's blocks are ``double_layers`` / ``single_layers``: no rule matched them, so nothing was quantized."""
    keys = auraflow_keys()
    c = census(keys, config=QuantConfig("fp8", keep_first_blocks=1, keep_last_blocks=1))
    assert detect_arch(keys) == "auraflow" and c.arch == "auraflow" and c.n_blocks == 4
    assert not c.should_quantize("double_layers.0.attn.w1q.weight")             # first block
    assert c.should_quantize("double_layers.1.attn.w2o.weight") and c.should_quantize("double_layers.1.mlpC.c_fc2.weight")
    assert c.should_quantize("single_layers.0.mlp.c_proj.weight")
    assert not c.should_quantize("single_layers.1.attn.w1q.weight")             # last block
    kept = {e.key: e.reason for e in c.kept}
    for k in ("double_layers.1.modX.1.weight", "single_layers.0.modCX.1.weight"):
        assert "modulation" in kept[k], kept[k]
    assert not any(c.should_quantize(k) for k in keys if not k.startswith(("double_layers", "single_layers")))
    qmod = census(keys, config=QuantConfig("fp8", quantize_modulation=True))
    assert qmod.should_quantize("double_layers.0.modC.1.weight") and not qmod.should_quantize("modF.1.weight")


def test_generic_rule_orders_several_block_lists_as_the_keys_list_them():
    """Kandinsky 5 (text blocks, then visual blocks) is detected by no rule: the generic rule gave text.i and
    visual.i one block number (3 blocks for 5), so keep_first_blocks=1 kept two blocks."""
    k = {"time_embeddings.in_layer.weight": (64, 128), "visual_embeddings.in_layer.weight": (128, 132),
         "out_layer.out_layer.weight": (64, 128), "out_layer.modulation.out_layer.weight": (256, 64)}
    for lst, n in (("text_transformer_blocks", 2), ("visual_transformer_blocks", 3)):
        mod = "text_modulation" if lst.startswith("text") else "visual_modulation"
        for i in range(n):
            k[f"{lst}.{i}.{mod}.out_layer.weight"] = (768, 64)
            for p in ("to_query", "to_key", "to_value", "out_layer"):
                k[f"{lst}.{i}.self_attention.{p}.weight"] = (128, 128)
            k[f"{lst}.{i}.feed_forward.in_layer.weight"] = (256, 128)
            k[f"{lst}.{i}.self_attention.query_norm.weight"] = (64,)
    c = census(k, config=QuantConfig("fp8", keep_first_blocks=1, keep_last_blocks=1))
    assert c.arch == "generic" and c.n_blocks == 5
    assert not c.should_quantize("text_transformer_blocks.0.self_attention.to_query.weight")
    assert c.should_quantize("text_transformer_blocks.1.self_attention.to_query.weight")
    assert c.should_quantize("visual_transformer_blocks.0.feed_forward.in_layer.weight")
    assert c.should_quantize("visual_transformer_blocks.1.self_attention.out_layer.weight")
    assert not c.should_quantize("visual_transformer_blocks.2.self_attention.to_key.weight")
    assert not c.should_quantize("visual_transformer_blocks.1.visual_modulation.out_layer.weight")
    qmod = census(k, config=QuantConfig("fp8", quantize_modulation=True))
    assert qmod.should_quantize("visual_transformer_blocks.1.visual_modulation.out_layer.weight")
    assert not qmod.should_quantize("out_layer.modulation.out_layer.weight")     # final layer: outside the blocks


def test_generic_rule_orders_block_lists_by_name_whatever_order_the_keys_come_in():
    """A diffusers-layout FLUX file (no rule detects it): its transformer_blocks run before its
    single_transformer_blocks. `levers quantize` reads a file's keys sorted (single_... first), QuantizeDiT a
    module's as registered: keep_first_blocks kept a single block from the file and a double block in the node."""
    k = {"x_embedder.weight": (128, 64), "proj_out.weight": (64, 128)}
    for lst, n in (("transformer_blocks", 2), ("single_transformer_blocks", 3)):
        for i in range(n):
            for p in ("attn.to_q", "attn.to_k", "ff.net.2"):
                k[f"{lst}.{i}.{p}.weight"] = (128, 128)
    as_registered = census(k, config=QuantConfig("fp8", keep_first_blocks=1, keep_last_blocks=1))
    as_in_a_file = census(dict(sorted(k.items())), config=QuantConfig("fp8", keep_first_blocks=1, keep_last_blocks=1))
    for c in (as_registered, as_in_a_file):
        assert c.arch == "generic" and c.n_blocks == 5
        assert not c.should_quantize("transformer_blocks.0.attn.to_q.weight")
        assert c.should_quantize("transformer_blocks.1.attn.to_q.weight")
        assert c.should_quantize("single_transformer_blocks.0.attn.to_q.weight")
        assert not c.should_quantize("single_transformer_blocks.2.ff.net.2.weight")
        assert any("transformer_blocks (2), single_transformer_blocks (3)" in n for n in c.notes), c.notes
    assert [e.quantize for e in sorted(as_registered.entries, key=lambda e: e.key)] == \
        [e.quantize for e in sorted(as_in_a_file.entries, key=lambda e: e.key)]


def krea2_keys(d=128, txt=64, layers=3) -> dict:
    """Krea 2: ``txtfusion`` (2 layer-wise blocks, a projector over the text encoder's layers, 2 refiner blocks) runs
    before the single-stream ``blocks``; per-block modulation is a 1-D table added to the shared ``tproj``."""
    k = {"first.weight": (d, 64), "tmlp.0.weight": (d, 256), "tmlp.2.weight": (d, d), "tproj.1.weight": (6 * d, d),
         "txtfusion.projector.weight": (1, 12), "txtmlp.0.scale": (txt,), "txtmlp.1.weight": (d, txt),
         "txtmlp.3.weight": (d, d), "last.linear.weight": (16, d), "last.norm.scale": (d,), "last.modulation.lin": (2, d)}
    blocks = [(f"txtfusion.layerwise_blocks.{i}.", txt) for i in range(2)]
    blocks += [(f"txtfusion.refiner_blocks.{i}.", txt) for i in range(2)] + [(f"blocks.{i}.", d) for i in range(layers)]
    for p, w in blocks:
        for n in ("wq", "wk", "wv", "gate", "wo"):
            k[f"{p}attn.{n}.weight"] = (w, w)
        k[f"{p}attn.qknorm.qnorm.scale"] = (32,)
        k[f"{p}mlp.gate.weight"], k[f"{p}mlp.up.weight"], k[f"{p}mlp.down.weight"] = (3 * w, w), (3 * w, w), (w, 3 * w)
        k[f"{p}prenorm.scale"] = (w,)
        if p.startswith("blocks"):
            k[f"{p}mod.lin"] = (6 * w,)
    return k


def test_krea2_text_fusion_blocks_quantize_and_run_first():
    """Krea 2 matched no rule: the generic rule took ``blocks`` only, so its text-fusion transformer (about 0.7 GB of
    bf16 on the released model) stayed unquantized, and keep_first_blocks counted from the main blocks."""
    keys = krea2_keys()
    assert detect_arch(keys) == "krea2"
    c = census(keys, config=QuantConfig("fp8", keep_first_blocks=1, keep_last_blocks=1))
    assert c.arch == "krea2" and c.n_blocks == 2 + 2 + 3
    assert not c.should_quantize("txtfusion.layerwise_blocks.0.attn.wq.weight")          # first block
    assert c.should_quantize("txtfusion.layerwise_blocks.1.attn.gate.weight")
    assert c.should_quantize("txtfusion.refiner_blocks.0.mlp.down.weight")
    assert c.should_quantize("blocks.0.attn.wo.weight") and c.should_quantize("blocks.1.mlp.up.weight")
    assert not c.should_quantize("blocks.2.mlp.gate.weight")                              # last block
    order = {e.key.rsplit(".attn.wq", 1)[0]: e.block for e in c.entries if e.key.endswith(".attn.wq.weight")}
    assert sorted(order, key=order.get) == ["txtfusion.layerwise_blocks.0", "txtfusion.layerwise_blocks.1",
                                            "txtfusion.refiner_blocks.0", "txtfusion.refiner_blocks.1",
                                            "blocks.0", "blocks.1", "blocks.2"]
    plain = census(keys)
    assert {e.key for e in plain.quantized} == {k for k in keys if ".attn.w" in k or ".attn.gate" in k
                                                or ".mlp." in k}
    for k in ("txtfusion.projector.weight", "txtmlp.1.weight", "tproj.1.weight", "last.linear.weight",
              "blocks.0.mod.lin", "blocks.0.prenorm.scale", "txtfusion.refiner_blocks.1.attn.qknorm.qnorm.scale"):
        assert not plain.should_quantize(k), k


def test_omnigen2_context_refiners_count_first():
    """OmniGen2 runs its context refiners, then the noise refiners (then the reference-image refiners, with
    references), then the layers; the generic rule counted the lists in key order (noise refiners first), so
    keep_first_blocks kept a noise refiner and quantized the first block the model runs."""
    k = {"x_embedder.weight": (96, 64), "norm_out.linear_1.weight": (96, 96)}
    for lst in ("noise_refiner", "ref_image_refiner", "context_refiner", "layers"):
        for i in range(2):
            p = f"{lst}.{i}."
            for n in ("to_q", "to_k", "to_v", "to_out.0"):
                k[f"{p}attn.{n}.weight"] = (96, 96)
            k[f"{p}feed_forward.linear_1.weight"], k[f"{p}feed_forward.linear_2.weight"] = (384, 96), (96, 384)
            if lst != "context_refiner":
                k[f"{p}norm1.linear.weight"] = (384, 96)
    c = census(k, config=QuantConfig("fp8", keep_first_blocks=1, keep_last_blocks=1))
    assert c.arch == "omnigen2" and c.n_blocks == 8
    assert not c.should_quantize("context_refiner.0.attn.to_q.weight")
    assert c.should_quantize("noise_refiner.0.attn.to_q.weight") and c.should_quantize("context_refiner.1.attn.to_q.weight")
    assert c.should_quantize("ref_image_refiner.1.feed_forward.linear_2.weight")
    assert not c.should_quantize("layers.1.attn.to_out.0.weight") and c.should_quantize("layers.0.attn.to_out.0.weight")
    kept = {e.key: e.reason for e in c.kept}
    assert "modulation" in kept["layers.0.norm1.linear.weight"] and "outside" in kept["norm_out.linear_1.weight"]


def test_hidream_o1_decoder_layers_quantize_vision_tower_stays():
    """HiDream-O1's blocks are ``language_model.layers`` (a dotted list the generic rule never matches: it quantized
    nothing); the vision tower (reference images only), the token embedding and the patch shims stay."""
    k = {"t_embedder1.mlp.0.weight": (256, 256), "x_embedder.proj1.weight": (64, 3072), "x_embedder.proj2.weight": (256, 64),
         "final_layer2.linear.weight": (3072, 256), "language_model.embed_tokens.weight": (151936, 256),
         "language_model.norm.weight": (256,), "visual.blocks.0.attn.qkv.weight": (384, 128),
         "visual.merger.linear_fc1.weight": (512, 512)}
    for i in range(3):
        p = f"language_model.layers.{i}."
        for n, s in (("q_proj", (256, 256)), ("k_proj", (128, 256)), ("v_proj", (128, 256)), ("o_proj", (256, 256))):
            k[f"{p}self_attn.{n}.weight"] = s
        k[f"{p}mlp.gate_proj.weight"], k[f"{p}mlp.up_proj.weight"] = (768, 256), (768, 256)
        k[f"{p}mlp.down_proj.weight"] = (256, 768)
        k[f"{p}self_attn.q_norm.weight"], k[f"{p}input_layernorm.weight"] = (64,), (256,)
    c = census(k, config=QuantConfig("fp8", keep_last_blocks=1))
    assert c.arch == "hidream_o1" and c.n_blocks == 3
    assert {e.key for e in c.quantized} == {key for key in k if key.startswith(("language_model.layers.0.",
                                                                                "language_model.layers.1."))
                                            and "_proj" in key}


def test_z_image_modulation_is_a_modulation_linear():
    """Z-Image's blocks hold ``adaLN_modulation.0`` (a Sequential of one Linear; Lumina 2's is ``.1``, after a SiLU).
    Found in review: it was not matched as modulation, so it was quantized as a block linear by default, and kept
    under ``quantize_modulation`` accounting where the planner counts it as modulation."""
    keys = {k.replace("adaLN_modulation.1.", "adaLN_modulation.0.") if not k.startswith("final_layer") else k: v
            for k, v in lumina_keys().items()}
    mod = "layers.1.adaLN_modulation.0.weight"
    plain = census(keys, config=QuantConfig("fp8_e4m3fn"))
    assert plain.arch == "lumina" and not plain.should_quantize(mod)
    assert "modulation" in {e.key: e.reason for e in plain.kept}[mod]
    qmod = census(keys, config=QuantConfig("fp8_e4m3fn", quantize_modulation=True))
    assert qmod.should_quantize(mod) and _q(qmod) - _q(plain) == {k for k in keys if "adaLN_modulation.0" in k}
