"""The presets added on 2026-12-01 against ComfyUI's own classes at the released configs, built on the meta device:
every block's parameters in execution order, the modulation linears in them, what lies outside, the text encoder,
the VAE and the latent geometry. A preset that drifts from the real shapes fails here."""
import re

import pytest
import torch

import tiny_dits

from comfyui_levers.core.presets import get_preset
from comfyui_levers.core.residency.blocks import find_blocks

# preset: (comfy.supported_models class, the config ComfyUI's model detection reads from the released checkpoint)
RELEASED = {
    "flux2-dev": ("Flux2", dict(
        image_model="flux2", axes_dim=[32, 32, 32, 32], num_heads=48, mlp_ratio=3.0, theta=2000, out_channels=128,
        global_modulation=True, mlp_silu_act=True, qkv_bias=False, ops_bias=False, default_ref_method="index",
        ref_index_scale=10.0, txt_ids_dims=[3], in_channels=128, hidden_size=6144, context_in_dim=15360, patch_size=1,
        vec_in_dim=None, depth=8, depth_single_blocks=48, guidance_embed=True)),
    "chroma": ("Chroma", dict(
        image_model="chroma", axes_dim=[16, 56, 56], num_heads=24, mlp_ratio=4.0, theta=10000, out_channels=64,
        qkv_bias=True, txt_ids_dims=[], in_channels=64, hidden_size=3072, context_in_dim=4096, patch_size=2,
        vec_in_dim=None, depth=19, depth_single_blocks=38, in_dim=64, out_dim=3072, hidden_dim=5120, n_layers=5)),
    "hidream-i1": ("HiDream", dict(
        image_model="hidream", attention_head_dim=128, axes_dims_rope=[64, 32, 32], caption_channels=[4096, 4096],
        max_resolution=[128, 128], in_channels=16, llama_layers=list(range(32)) + [31] * 16, num_attention_heads=20,
        num_routed_experts=4, num_activated_experts=2, num_layers=16, num_single_layers=32, out_channels=16,
        patch_size=2, text_emb_dim=2048)),
    "z-image": ("ZImage", dict(
        image_model="lumina2", patch_size=2, in_channels=16, dim=3840, cap_feat_dim=2560, n_layers=30, qk_norm=True,
        n_heads=30, n_kv_heads=30, axes_dims=[32, 48, 48], axes_lens=[1536, 512, 512], rope_theta=256.0,
        ffn_dim_multiplier=8.0 / 3.0, z_image_modulation=True, time_scale=1000.0, pad_tokens_multiple=32)),
    "hunyuanimage-2.1": ("HunyuanImage21", dict(
        image_model="hunyuan_video", in_channels=64, patch_size=[1, 1], out_channels=64, vec_in_dim=None,
        axes_dim=[64, 64], meanflow=False, context_in_dim=3584, hidden_size=3584, mlp_ratio=4.0, num_heads=28,
        depth=20, depth_single_blocks=40, theta=256, qkv_bias=True, byt5=True, guidance_embed=False,
        use_cond_type_embedding=False, vision_in_dim=None, meanflow_sum=False)),
    "hunyuanvideo-1.5": ("HunyuanVideo15", dict(
        image_model="hunyuan_video", in_channels=65, patch_size=[1, 1, 1], out_channels=32, vec_in_dim=None,
        axes_dim=[16, 56, 56], meanflow=False, context_in_dim=3584, hidden_size=2048, mlp_ratio=4.0, num_heads=16,
        depth=54, depth_single_blocks=0, theta=256, qkv_bias=True, byt5=True, guidance_embed=False,
        use_cond_type_embedding=True, vision_in_dim=1152, meanflow_sum=True)),
    "wan2.2-ti2v-5b": ("WAN22_T2V", dict(
        image_model="wan2.1", model_type="t2v", dim=3072, out_dim=48, num_heads=24, ffn_dim=14336, num_layers=30,
        patch_size=(1, 2, 2), freq_dim=256, window_size=(-1, -1), qk_norm=True, cross_attn_norm=True, eps=1e-6,
        in_dim=48)),
    # the detected config plus LTXAVModel's defaults, which are LTX-2 19B's shapes
    "ltx-2": ("LTXAV", dict(image_model="ltxav", num_layers=48, attention_head_dim=128, cross_attention_dim=4096,
                            use_keyframes_abs_pos_embedding=False)),
}

# the text encoder ComfyUI builds for each (module, factory, arguments)
TEXT_ENCODERS = {
    "flux2-dev": ("flux", "flux2_te", {}), "chroma": ("pixart_t5", "pixart_te", {}),
    "hidream-i1": ("hidream", "hidream_clip", {}), "z-image": ("z_image", "te", {}),
    "hunyuanimage-2.1": ("hunyuan_image", "te", {}), "hunyuanvideo-1.5": ("hunyuan_image", "te", {}),
    "wan2.2-ti2v-5b": ("wan", "te", {}), "ltx-2": ("lt", "ltxav_te", {}),
}

_FLUX_VAE = {"double_z": True, "z_channels": 16, "resolution": 256, "in_channels": 3, "out_ch": 3, "ch": 128,
             "ch_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_resolutions": [], "dropout": 0.0}
_HV15_VAE = {"block_out_channels": [128, 256, 512, 1024, 1024], "in_channels": 3, "out_channels": 3,
             "num_res_blocks": 2, "ffactor_spatial": 16, "ffactor_temporal": 4, "downsample_match_channel": True,
             "upsample_match_channel": True, "z_channels": 32}
_HI21_VAE = {"block_out_channels": [128, 256, 512, 512, 1024, 1024], "in_channels": 3, "out_channels": 3,
             "num_res_blocks": 2, "ffactor_spatial": 32, "downsample_match_channel": True,
             "upsample_match_channel": True, "z_channels": 64}
# the VAE comfy/sd.py builds for each released file (ltx-2's config ships in its metadata: not checked)
VAES = {
    "flux2-dev": ("kl", "comfy.ldm.modules.diffusionmodules.model", {**_FLUX_VAE, "z_channels": 32,
                                                                     "batch_norm_latent": True}),
    "chroma": ("kl", "comfy.ldm.modules.diffusionmodules.model", _FLUX_VAE),
    "hidream-i1": ("kl", "comfy.ldm.modules.diffusionmodules.model", _FLUX_VAE),
    "z-image": ("kl", "comfy.ldm.modules.diffusionmodules.model", _FLUX_VAE),
    "hunyuanimage-2.1": ("kl", "comfy.ldm.hunyuan_video.vae", _HI21_VAE),
    "hunyuanvideo-1.5": ("kl", "comfy.ldm.hunyuan_video.vae_refiner", _HV15_VAE),
    "wan2.2-ti2v-5b": ("wan22", None, dict(dim=160, z_dim=48, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                                           temperal_downsample=[False, True, True], dropout=0.0)),
}

# LTX-2's two text-embedding connectors (709 M) sit in the diffusion model on 0.33, in the text encoder before
_LTX_CONNECTORS = ("this ComfyUI holds LTX-2's text-embedding connectors in the text encoder, not in LTXAV (0.33 "
                   "moved them): the preset counts 0.33's split")

_MODULATION = re.compile(r"(^|\.)(img_mod|txt_mod|modulation|adaLN_modulation)(\.|$)")


def _count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _config_class(name: str):
    import comfy.supported_models as sm

    cls_name, config = RELEASED[name]
    cls = getattr(sm, cls_name, None)
    if cls is None:
        pytest.skip(f"this ComfyUI has no comfy.supported_models.{cls_name} ({name})")
    return cls, dict(config)


def _diffusion_model(comfy_env, name: str):
    cls, config = _config_class(name)

    def make(config):
        mc = cls(config)
        mc.set_inference_dtype(torch.bfloat16, None)
        return mc, mc.get_model({}, device="meta").diffusion_model
    return tiny_dits.build_on_this_release(make, config)


@pytest.mark.parametrize("name", sorted(RELEASED))
def test_preset_holds_the_parameters_of_comfyuis_class(comfy_env, name):
    mc, dm = _diffusion_model(comfy_env, name)
    if name == "ltx-2" and not hasattr(dm, "video_embeddings_connector"):
        pytest.skip(_LTX_CONNECTORS)
    spec = get_preset(name)
    layout = find_blocks(dm)
    blocks = [m for _, m in layout.blocks]
    real = [_count(b) for b in blocks]
    planned = [k.params for k in spec.blocks for _ in range(k.count)]
    assert planned == real, (name, sorted(set(planned)), sorted(set(real)))
    total = _count(dm)
    assert spec.dit_params == pytest.approx(total, rel=1e-9)
    assert spec.dit_kept_params == pytest.approx(total - sum(real), rel=1e-9)
    modulation = sum(_count(m) for b in blocks for n, m in b.named_modules()
                     if n and _MODULATION.search(n) and isinstance(getattr(m, "weight", None), torch.Tensor)
                     and m.weight.dim() == 2)
    assert spec.modulation_params == modulation, name
    # the latent the DiT denoises, and the patch it cuts it into
    assert spec.latent_channels == mc.latent_format.latent_channels
    patch = RELEASED[name][1]["patch_size"] if "patch_size" in RELEASED[name][1] else 1
    assert spec.patch == (patch[-1] if isinstance(patch, (list, tuple)) else patch)


@pytest.mark.parametrize("name", sorted(TEXT_ENCODERS))
def test_preset_text_encoder_is_comfyuis(comfy_env, name):
    import importlib

    module, factory, kwargs = TEXT_ENCODERS[name]
    try:
        make = getattr(importlib.import_module(f"comfy.text_encoders.{module}"), factory, None)
    except ModuleNotFoundError:
        make = None
    if make is None:
        pytest.skip(f"this ComfyUI has no comfy.text_encoders.{module}.{factory} ({name})")
    te = make(**kwargs)(device="meta", dtype=torch.bfloat16)
    if name == "ltx-2" and hasattr(te, "video_embeddings_connector"):
        pytest.skip(_LTX_CONNECTORS)
    assert get_preset(name).te_params == pytest.approx(_count(te), rel=1e-9), name


@pytest.mark.parametrize("name", sorted(VAES))
def test_preset_vae_is_comfyuis(comfy_env, name):
    import importlib

    kind, target, config = VAES[name]
    _config_class(name)       # skips where this ComfyUI lacks the model (0.3.64's vae_refiner is HunyuanImage 2.1's)
    with torch.device("meta"):
        if kind == "wan22":
            vae = importlib.import_module("comfy.ldm.wan.vae2_2").WanVAE(**config)
            full_res = vae.decoder.head[-1].weight.shape[1] / 4      # half-size maps, unpatchified 2x2 at the end
        else:
            from comfy.ldm.models.autoencoder import AutoencodingEngine

            vae = AutoencodingEngine(
                regularizer_config={"target": "comfy.ldm.models.autoencoder.DiagonalGaussianRegularizer"},
                encoder_config={"target": f"{target}.Encoder", "params": config},
                decoder_config={"target": f"{target}.Decoder", "params": config})
            conv_out = vae.decoder.conv_out
            full_res = getattr(conv_out, "conv", conv_out).weight.shape[1]      # HunyuanVideo 1.5: a carried conv
    spec = get_preset(name)
    assert spec.vae_params == pytest.approx(_count(vae), rel=1e-9), name
    assert spec.vae_bytes_per_px == 16 * full_res, name     # 16 bytes per channel at full resolution
