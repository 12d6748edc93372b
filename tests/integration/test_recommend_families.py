"""Recommend's family detection on tiny models of ComfyUI's own classes: each maps to the preset whose token and VAE
geometry is its own, and the planned tokens are the model's real sequence (ComfyUI's empty-latent node, then the
model's own patch embedding)."""
import pytest
import torch

import tiny_dits

CPU = torch.device("cpu")


def _patcher(class_name: str, config: dict):
    import comfy.model_patcher
    import comfy.supported_models as sm

    cls = getattr(sm, class_name, None)
    if cls is None:
        pytest.skip(f"this ComfyUI has no comfy.supported_models.{class_name}")
    def make(config):
        mc = cls(config)
        mc.set_inference_dtype(torch.float32, None)
        return mc.get_model({})
    return comfy.model_patcher.ModelPatcher(tiny_dits.build_on_this_release(make, config), load_device=CPU,
                                            offload_device=CPU)


def tiny_flux2():
    return _patcher("Flux2", dict(
        image_model="flux2", axes_dim=[8, 8, 8, 8], num_heads=2, mlp_ratio=3.0, theta=2000, out_channels=128,
        global_modulation=True, mlp_silu_act=True, qkv_bias=False, ops_bias=False, default_ref_method="index",
        ref_index_scale=10.0, txt_ids_dims=[3], in_channels=128, hidden_size=64, context_in_dim=64, patch_size=1,
        vec_in_dim=None, depth=2, depth_single_blocks=2, guidance_embed=True))


def _hunyuan(class_name: str, **kw):
    config = dict(image_model="hunyuan_video", vec_in_dim=None, meanflow=False, context_in_dim=64, hidden_size=128,
                  mlp_ratio=4.0, num_heads=1, depth=2, depth_single_blocks=1, theta=256, qkv_bias=True, byt5=False,
                  guidance_embed=False, use_cond_type_embedding=False, vision_in_dim=None, meanflow_sum=False)
    return _patcher(class_name, {**config, **kw})


def tiny_hunyuan_video_15():
    return _hunyuan("HunyuanVideo15", in_channels=65, out_channels=32, patch_size=[1, 1, 1], axes_dim=[16, 56, 56],
                    depth_single_blocks=0, use_cond_type_embedding=True, vision_in_dim=32, meanflow_sum=True)


def tiny_hunyuan_image_21():
    return _hunyuan("HunyuanImage21", in_channels=64, out_channels=64, patch_size=[1, 1], axes_dim=[64, 64])


def tiny_wan22_5b():
    return _patcher("WAN22_T2V", dict(
        image_model="wan2.1", model_type="t2v", dim=128, out_dim=48, in_dim=48, num_heads=1, ffn_dim=256, num_layers=2,
        patch_size=(1, 2, 2), freq_dim=256, window_size=(-1, -1), qk_norm=True, cross_attn_norm=True, eps=1e-6))


def _tiny(builder):
    def load():
        tiny = builder()
        if tiny is None:
            pytest.skip(f"this ComfyUI has no class for {builder.__name__}")
        return tiny.load()
    return load


# builder -> (family, preset)
CASES = {
    "flux2": (tiny_flux2, "flux2", "flux2-dev"),
    "flux": (_tiny(tiny_dits.tiny_flux), "flux", "flux1-dev"),
    "chroma": (_tiny(tiny_dits.tiny_chroma), "flux", "chroma"),
    "hunyuan_video_15": (tiny_hunyuan_video_15, "hunyuan", "hunyuanvideo-1.5"),
    "hunyuan_image_21": (tiny_hunyuan_image_21, "hunyuan", "hunyuanimage-2.1"),
    "hunyuan_video": (_tiny(tiny_dits.tiny_hunyuan_video), "hunyuan", "hunyuanvideo"),
    "wan22_5b": (tiny_wan22_5b, "wan", "wan2.2-ti2v-5b"),
    "zimage": (_tiny(tiny_dits.tiny_zimage), "lumina", "z-image"),
    "lumina2": (_tiny(tiny_dits.tiny_lumina2), "lumina", "z-image"),
    "hidream": (_tiny(tiny_dits.tiny_hidream), "hidream", "hidream-i1"),
    "hidream_o1": (_tiny(tiny_dits.tiny_hidream_o1), "hidream", "hunyuanimage-2.1"),
    "ltxav": (_tiny(tiny_dits.tiny_ltxav), "ltxv", "ltx-2"),
    "ltxv": (_tiny(tiny_dits.tiny_ltxv), "ltxv", "ltxv"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_connected_model_gets_its_own_preset_geometry(comfy_env, case):
    from comfyui_levers.bridge.recommend import measure
    from comfyui_levers.core.presets import get_preset

    build, family, preset = CASES[case]
    spec, notes = measure(model=build())
    assert f"model family detected: {family} (preset {preset} supplies" in "\n".join(notes), notes
    ref = get_preset(preset)
    assert spec.family == family and spec.name.startswith(preset + " (measured")
    geometry = ("latent_channels", "vae_temporal", "patch_t", "vae_bytes_per_px", "is_video")
    assert {k: getattr(spec, k) for k in geometry} == {k: getattr(ref, k) for k in geometry}
    # pixels per token: the model's own patch times the VAE's factor (HiDream-O1: 32 px patches on pixels, where
    # the preset lends a 32x VAE and patch 1)
    assert spec.vae_spatial * spec.patch == ref.vae_spatial * ref.patch


def _latent(node_module: str, node: str, *args):
    import importlib

    cls = getattr(importlib.import_module(node_module), node, None)
    if cls is None:
        pytest.skip(f"this ComfyUI has no {node_module}.{node}")
    out = cls.execute(*args)
    return (out.result if hasattr(out, "result") else out)[0]["samples"]


def _embedded_tokens(embed: torch.nn.Module, latent: torch.Tensor, in_channels: int) -> int:
    """Tokens the model's own patch embedding makes of ``latent`` (zero-padded to its input channels, as the
    image-to-video conditioning is)."""
    x = torch.zeros(latent.shape[0], in_channels, *latent.shape[2:])
    with torch.no_grad():
        out = embed(x)
    return out.shape[1] if out.dim() == 3 else out[0, 0].numel()


@pytest.mark.parametrize("case,node,size", [
    ("hunyuan_video_15", ("comfy_extras.nodes_hunyuan", "EmptyHunyuanVideo15Latent"), (1280, 720, 121)),
    ("wan22_5b", ("comfy_extras.nodes_wan", "Wan22ImageToVideoLatent"), (1280, 704, 121)),
])
def test_planned_video_tokens_are_the_models_real_sequence(comfy_env, case, node, size):
    """HunyuanVideo 1.5 at 720p x 121 frames is 31 x 45 x 80 = 111,600 tokens: its VAE is 16x with 32 channels and
    its patch 1, where HunyuanVideo 1.0's preset (8x, patch 2) with the 1.5 VAE's measured 16x made a quarter of
    that. Wan 2.2 5B: 16x VAE, patch 2, 31 x 22 x 40 = 27,280."""
    from comfyui_levers.bridge.recommend import measure

    model = CASES[case][0]()
    spec, _ = measure(model=model)
    w, h, f = size
    args = (None, w, h, f, 1) if "Wan22" in node[1] else (w, h, f)
    latent = _latent(*node, *args)
    dm = model.model.diffusion_model
    embed, in_ch = ((dm.img_in, dm.img_in.proj.in_channels) if hasattr(dm, "img_in")
                    else (dm.patch_embedding, dm.patch_embedding.in_channels))
    real = _embedded_tokens(embed, latent, in_ch)
    assert spec.image_tokens(w, h, f) == real
    assert w // latent.shape[-1] == spec.vae_spatial == 16      # the VAE factor of ComfyUI's own latent
    assert real == {"hunyuan_video_15": 31 * 45 * 80, "wan22_5b": 31 * 22 * 40}[case]


def test_hidream_o1_plans_its_own_pixel_patch_tokens(comfy_env):
    """HiDream-O1 (``comfy.ldm.hidream_o1``) denoises RGB pixels in 32x32 patches: 1024 x 1024 is 32 x 32 = 1,024
    image tokens. The fragment "hidream" gave it HiDream-I1's geometry (8x VAE, patch 2): 4,096."""
    from comfyui_levers.bridge.recommend import measure

    model = CASES["hidream_o1"][0]()
    dm = model.model.diffusion_model
    spec, _ = measure(model=model)
    assert model.model.latent_format.latent_channels == 3 and dm.patch_size == 32    # pixel space, 32 px patches
    assert spec.image_tokens(1024, 1024) == (1024 // dm.patch_size) ** 2 == 1024
    assert spec.tokens(1024, 1024) > spec.image_tokens(1024, 1024)        # the prompt is in the same sequence


def test_a_pixel_space_model_plans_its_own_patches_with_its_vae_connected(comfy_env):
    """Chroma Radiance denoises pixels in 16 px patches; its "VAE" passes pixels through (upscale_ratio 1). Found in
    review: with that VAE connected, Recommend took its factor 1 with the Chroma preset's patch 2, planning one
    token per 2 x 2 pixels (64x the tokens). The model's own patch is read now: 1024 x 1024 is 64 x 64 tokens."""
    import comfy.sd

    from comfyui_levers.bridge.recommend import measure

    tiny = tiny_dits.tiny_chroma_radiance()
    if tiny is None:
        pytest.skip("this ComfyUI has no Chroma Radiance")
    model = tiny.load()
    vae = comfy.sd.VAE(sd={"pixel_space_vae": torch.tensor(1.0)})
    assert vae.upscale_ratio == 1 and model.model.diffusion_model.patch_size == 16
    for connected in (None, vae):
        spec, _ = measure(model=model, vae=connected)
        assert spec.image_tokens(1024, 1024) == 64 * 64, (spec.vae_spatial, spec.patch)
