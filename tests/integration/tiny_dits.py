"""Tiny random-weight diffusion models of ComfyUI's own classes, one per architecture Levers streams.

Each builder returns a ``TinyDiT``: a fresh ModelPatcher (same weights every call), conditioning and an empty
latent, sized so a two-step sample takes well under a second on a CPU. Where ComfyUI's model detection accepts
tiny sizes the model goes through its loader (``comfy.sd.load_diffusion_model_state_dict``); where detection
only matches the released sizes (the SDXL UNet), through ``comfy.supported_models`` with a small config.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from tiny_models import fill_random_


@dataclass
class TinyDiT:
    name: str
    load: Callable[[], object]          # a fresh ModelPatcher
    pos: list
    neg: list
    latent: dict

    def sample(self, model, steps: int = 2, cfg: float = 2.0, seed: int = 0):
        import nodes

        # HiDream-O1 keeps the prompt prefix's K/V across samplings (ComfyUI never clears it): a second run starts
        # from the cache and differs from the first in the last bits. Every sample here starts cold.
        getattr(model.model.diffusion_model, "clear_kv_cache", lambda: None)()
        return nodes.common_ksampler(model, seed, steps, cfg, "euler", "simple", self.pos, self.neg,
                                     self.latent)[0]["samples"]


def _cond(shape, seed: int, **extra):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(*shape, generator=g),
             {k: torch.randn(*v, generator=g) if isinstance(v, tuple) else v for k, v in extra.items()}]]


def _conds(tokens: int, width: int, seed: int, **extra):
    return _cond((1, tokens, width), seed, **extra), _cond((1, tokens, width), seed + 1, **extra)


# Options newer ComfyUI releases added to a model's constructor, with the value that reproduces what an older
# release (0.3.64) does without them. A builder that passes one of these at that value runs on the older release
# with the option left out; any other rejected keyword is a real error.
_NEWER_OPTIONS = {"txt_ids_dims": [], "vec_in_dim": None, "use_cond_type_embedding": False, "vision_in_dim": None,
                  "meanflow_sum": False, "rope_theta": 10000.0, "use_x0": False, "use_sequential_txt_ids": False}


def build_on_this_release(make, config: dict):
    """``make(config)``, leaving out the newer-release options this ComfyUI's constructor rejects."""
    config = dict(config)
    while True:
        try:
            return make(config)
        except TypeError as e:
            key = next((k for k in _NEWER_OPTIONS if f"unexpected keyword argument '{k}'" in str(e)), None)
            if key is None or key not in config or config[key] != _NEWER_OPTIONS[key]:
                raise
            del config[key]


def _loaded(cls, seed: int, **kwargs):
    """A random state dict of ComfyUI class ``cls`` (built on the meta device), through ComfyUI's loader."""
    import comfy.ops
    import comfy.sd

    m = build_on_this_release(
        lambda kw: cls(operations=comfy.ops.disable_weight_init, device="meta", dtype=torch.float32, **kw), kwargs)
    sd = fill_random_({k: torch.empty(v.shape) for k, v in m.state_dict().items()}, seed)
    return comfy.sd.load_diffusion_model_state_dict(sd, model_options={"dtype": torch.float32})


def _patcher_from_config(config_cls, unet_config: dict, seed: int):
    import comfy.model_management as mm
    import comfy.model_patcher

    def make(config):
        mc = config_cls(config)
        mc.set_inference_dtype(torch.float32, None)
        return mc.get_model({})
    model = build_on_this_release(make, unet_config)
    shapes = {k: torch.empty(v.shape) for k, v in model.diffusion_model.state_dict().items()}
    model.diffusion_model.load_state_dict(fill_random_(shapes, seed))
    return comfy.model_patcher.ModelPatcher(model, load_device=mm.get_torch_device(),
                                            offload_device=mm.unet_offload_device())


def tiny_sdxl() -> TinyDiT:
    """SDXL's UNet (``model_base.SDXL``), two levels, one transformer depth: its blocks are
    ``TimestepEmbedSequential``s whose layers the UNet runs itself."""
    import comfy.supported_models as sm

    config = dict(use_checkpoint=False, image_size=32, in_channels=4, out_channels=4, model_channels=32,
                  num_res_blocks=[1, 1], channel_mult=[1, 2], transformer_depth=[0, 1],
                  transformer_depth_output=[0, 0, 1, 1], transformer_depth_middle=1, use_spatial_transformer=True,
                  use_linear_in_transformer=True, legacy=False, num_classes="sequential", adm_in_channels=2816,
                  context_dim=64, num_head_channels=16, use_temporal_resblock=False, use_temporal_attention=False)
    return TinyDiT("sdxl", lambda: _patcher_from_config(sm.SDXL, config, seed=0),
                   _cond((1, 8, 64), 1, pooled_output=(1, 1280)), _cond((1, 8, 64), 2, pooled_output=(1, 1280)),
                   {"samples": torch.zeros(1, 4, 16, 16)})


def tiny_flux() -> TinyDiT:
    """FLUX.1-dev (guidance embedding), 3 double + 2 single blocks of width 64 (the loader's detection fixes
    heads of 128, so through ``supported_models``)."""
    import comfy.supported_models as sm

    config = dict(image_model="flux", in_channels=16, out_channels=16, vec_in_dim=32, context_in_dim=64,
                  hidden_size=64, mlp_ratio=4.0, num_heads=2, depth=3, depth_single_blocks=2, axes_dim=[8, 12, 12],
                  theta=10000, patch_size=2, qkv_bias=True, guidance_embed=True, txt_ids_dims=[])
    pos, neg = _conds(8, 64, 1, pooled_output=(1, 32))
    return TinyDiT("flux", lambda: _patcher_from_config(sm.Flux, config, seed=0), pos, neg,
                   {"samples": torch.zeros(1, 16, 8, 8)})


def tiny_chroma() -> TinyDiT:
    """Chroma (Flux blocks, modulation from a distilled approximator), through ``supported_models``."""
    import comfy.supported_models as sm

    config = dict(image_model="chroma", in_channels=64, out_channels=64, context_in_dim=64, hidden_size=64,
                  mlp_ratio=4.0, num_heads=2, depth=3, depth_single_blocks=2, axes_dim=[8, 12, 12], theta=10000,
                  patch_size=2, qkv_bias=True, in_dim=64, out_dim=64, hidden_dim=64, n_layers=2, txt_ids_dims=[],
                  vec_in_dim=None)
    pos, neg = _conds(8, 64, 1, pooled_output=None)
    return TinyDiT("chroma", lambda: _patcher_from_config(sm.Chroma, config, seed=0), pos, neg,
                   {"samples": torch.zeros(1, 16, 8, 8)})


def tiny_hunyuan_video() -> TinyDiT:
    """HunyuanVideo 1.0 t2v through the loader (width 128 = one head of 128), 3 double + 2 single blocks."""
    import comfy.ldm.hunyuan_video.model as hv

    kwargs = dict(in_channels=16, out_channels=16, vec_in_dim=768, context_in_dim=64, hidden_size=128,
                  mlp_ratio=4.0, num_heads=1, depth=3, depth_single_blocks=2, axes_dim=[16, 56, 56], theta=256,
                  patch_size=[1, 2, 2], qkv_bias=True, guidance_embed=True, byt5=False, meanflow=False,
                  use_cond_type_embedding=False, vision_in_dim=None, meanflow_sum=False)
    pos, neg = _conds(8, 64, 1, pooled_output=(1, 768))
    return TinyDiT("hunyuan_video", lambda: _loaded(hv.HunyuanVideo, 0, **kwargs), pos, neg,
                   {"samples": torch.zeros(1, 16, 1, 8, 8)})


def tiny_sd3() -> TinyDiT:
    """SD3 (MMDiT) through the loader, depth 3 (width 192): its forward never runs ComfyUI's DIFFUSION_MODEL
    wrappers."""
    from comfy.ldm.modules.diffusionmodules.mmdit import OpenAISignatureMMDITWrapper as MMDiT

    kwargs = dict(input_size=None, patch_size=2, in_channels=16, out_channels=16, depth=3, adm_in_channels=64,
                  context_embedder_config={"target": "torch.nn.Linear",
                                           "params": {"in_features": 64, "out_features": 192}},
                  num_patches=256, pos_embed_max_size=16, pos_embed_scaling_factor=None, x_block_self_attn_layers=[])
    pos, neg = _conds(8, 64, 1, pooled_output=(1, 64))
    return TinyDiT("sd3", lambda: _loaded(MMDiT, 0, **kwargs), pos, neg, {"samples": torch.zeros(1, 16, 16, 16)})


def tiny_ltxv() -> TinyDiT:
    """LTX-Video (0.9 layout), 4 blocks of width 128 (32 heads of 4), through the loader; T5 context with its
    attention mask, which LTXV's forward requires."""
    import comfy.sd
    import comfy.supported_models as sm

    mc = sm.LTXV({"image_model": "ltxv", "num_layers": 4, "attention_head_dim": 4, "cross_attention_dim": 128})
    mc.set_inference_dtype(torch.float32, None)
    shapes = mc.get_model({}, device="meta").diffusion_model.state_dict()

    def load():
        sd = fill_random_({k: torch.empty(v.shape) for k, v in shapes.items()}, 0)
        return comfy.sd.load_diffusion_model_state_dict(sd, model_options={"dtype": torch.float32})
    mask = torch.ones(1, 8, dtype=torch.long)
    pos, neg = _conds(8, 4096, 1, attention_mask=mask)
    return TinyDiT("ltxv", load, pos, neg, {"samples": torch.zeros(1, 128, 2, 4, 4)})


def tiny_ltxav(**layout) -> TinyDiT | None:
    """LTX-2 (audio-video, ``LTXAV``): 4 blocks, video width 128 and audio width 64, each block with video, audio
    and cross-modal attention; context is the video and the audio caption side by side (64 + 64). Sampled
    video-only, as the model allows. Through ``supported_models`` (the loader's detection fixes the audio width)."""
    import comfy.supported_models as sm

    if not hasattr(sm, "LTXAV"):
        return None
    config = {"image_model": "ltxav", "num_layers": 4, "attention_head_dim": 4, "num_attention_heads": 32,
              "cross_attention_dim": 128, "audio_attention_head_dim": 4, "audio_num_attention_heads": 16,
              "audio_cross_attention_dim": 64, "caption_channels": 64,
              # ComfyUI 0.33's text-embedding connectors (unused on a processed context), at the same tiny width
              "connector_attention_head_dim": 4, "connector_num_attention_heads": 16, "connector_num_layers": 1,
              **layout}
    mask = torch.ones(1, 8, dtype=torch.long)
    pos, neg = _conds(8, 128, 1, attention_mask=mask)
    return TinyDiT("ltxav", lambda: _patcher_from_config(sm.LTXAV, config, seed=0), pos, neg,
                   {"samples": torch.zeros(1, 128, 2, 4, 4)})


def tiny_qwen_image() -> TinyDiT:
    """Qwen-Image, 4 blocks of width 64 (the loader's detection fixes width 3072)."""
    import comfy.supported_models as sm

    config = {"image_model": "qwen_image", "in_channels": 64, "out_channels": 16, "num_layers": 4,
              "attention_head_dim": 32, "num_attention_heads": 2, "joint_attention_dim": 64,
              "axes_dims_rope": (8, 12, 12)}
    pos, neg = _conds(8, 64, 1)
    tiny = TinyDiT("qwen_image", lambda: _patcher_from_config(sm.QwenImage, config, seed=0), pos, neg, {})
    dims = getattr(tiny.load().model.latent_format, "latent_dimensions", 2)
    tiny.latent = {"samples": torch.zeros((1, 16, 1, 8, 8) if dims == 3 else (1, 16, 8, 8))}
    return tiny


def _lumina_config(z_image: bool) -> dict:
    config = {"image_model": "lumina2", "patch_size": 2, "in_channels": 16, "dim": 128, "cap_feat_dim": 64,
              "n_layers": 3, "n_refiner_layers": 2, "n_heads": 2, "n_kv_heads": 2, "multiple_of": 32,
              "ffn_dim_multiplier": 4.0, "qk_norm": True, "axes_dims": [16, 24, 24], "axes_lens": [300, 512, 512],
              "rope_theta": 10000.0}
    if z_image:   # Z-Image's modulation reads a 256-wide time embedding: width at least 256
        config.update({"dim": 256, "axes_dims": [32, 48, 48], "ffn_dim_multiplier": 0.5, "z_image_modulation": True,
                       "time_scale": 1000.0, "pad_tokens_multiple": 32, "rope_theta": 256.0, "n_refiner_layers": 1})
    return config


def tiny_lumina2() -> TinyDiT:
    """Lumina 2 (NextDiT): 2 context refiners, 2 noise refiners, then 3 layers, width 128."""
    import comfy.supported_models as sm

    # Lumina 2's text encoder hands its attention mask on; ComfyUI 0.3.64 reads the token count from it
    pos, neg = _conds(8, 64, 1, attention_mask=torch.ones(1, 8, dtype=torch.long))
    return TinyDiT("lumina2", lambda: _patcher_from_config(sm.Lumina2, _lumina_config(False), seed=0), pos, neg,
                   {"samples": torch.zeros(1, 16, 8, 8)})


def tiny_zimage() -> TinyDiT:
    """Z-Image (NextDiT with its own modulation and token padding), width 256."""
    import comfy.supported_models as sm

    if not hasattr(sm, "ZImage"):
        return None
    pos, neg = _conds(8, 64, 1)
    return TinyDiT("zimage", lambda: _patcher_from_config(sm.ZImage, _lumina_config(True), seed=0), pos, neg,
                   {"samples": torch.zeros(1, 16, 8, 8)})


def tiny_hidream() -> TinyDiT:
    """HiDream I1: 2 double + 2 single stream blocks with mixture-of-experts feed-forwards, width 64; T5 and
    Llama conditioning and a pooled vector."""
    import comfy.supported_models as sm

    config = {"image_model": "hidream", "patch_size": 2, "in_channels": 16, "out_channels": 16, "num_layers": 2,
              "num_single_layers": 2, "attention_head_dim": 32, "num_attention_heads": 2, "caption_channels": [64, 64],
              "text_emb_dim": 32, "num_routed_experts": 4, "num_activated_experts": 2, "axes_dims_rope": (16, 8, 8),
              "max_resolution": (128, 128), "llama_layers": list(range(4))}
    pos, neg = (_cond((1, 8, 64), seed, pooled_output=(1, 32), conditioning_llama3=(1, 4, 8, 64)) for seed in (1, 2))
    return TinyDiT("hidream", lambda: _patcher_from_config(sm.HiDream, config, seed=0), pos, neg,
                   {"samples": torch.zeros(1, 16, 8, 8)})


def _model_class(name: str):
    """``comfy.supported_models.<name>``, or None when the running ComfyUI lacks it."""
    import comfy.supported_models as sm

    return getattr(sm, name, None)


def _tiny_from_config(name: str, cls_name: str, config: dict, latent_shape: tuple, pos, neg) -> TinyDiT | None:
    cls = _model_class(cls_name)
    if cls is None:
        return None
    return TinyDiT(name, lambda: _patcher_from_config(cls, config, seed=0), pos, neg,
                   {"samples": torch.zeros(*latent_shape)})


def tiny_flux2() -> TinyDiT | None:
    """FLUX.2 (dev / klein): shared modulation linears outside the blocks (``double_stream_modulation_*``,
    ``single_stream_modulation``), no biases, SiLU-gated MLPs, 128 latent channels at patch 1; 2 double + 3 single
    blocks of width 64 (2 heads of 32)."""
    config = dict(image_model="flux2", in_channels=128, out_channels=128, vec_in_dim=None, context_in_dim=64,
                  hidden_size=64, mlp_ratio=3.0, num_heads=2, depth=2, depth_single_blocks=3, axes_dim=[8, 8, 8, 8],
                  theta=2000, patch_size=1, qkv_bias=False, guidance_embed=True, txt_ids_dims=[3],
                  global_modulation=True, mlp_silu_act=True, ops_bias=False, default_ref_method="index",
                  ref_index_scale=10.0)
    pos, neg = _conds(8, 64, 1, pooled_output=None)     # ComfyUI 0.8's Flux reads the key
    return _tiny_from_config("flux2", "Flux2", config, (1, 128, 4, 4), pos, neg)


def _hunyuan_config(**over) -> dict:
    config = dict(image_model="hunyuan_video", in_channels=16, out_channels=16, vec_in_dim=None, context_in_dim=64,
                  hidden_size=128, mlp_ratio=4.0, num_heads=1, depth=2, depth_single_blocks=3, axes_dim=[16, 56, 56],
                  theta=256, patch_size=[1, 1, 1], qkv_bias=True, guidance_embed=False, byt5=False, meanflow=False,
                  use_cond_type_embedding=False, vision_in_dim=None, meanflow_sum=False)
    config.update(over)
    return config


def tiny_hunyuan_video15() -> TinyDiT | None:
    """HunyuanVideo 1.5 (t2v/i2v: 32 latent channels + 33 concat channels, cond-type embedding, SigLIP vision
    input), width 128, 2 double + 3 single blocks."""
    config = _hunyuan_config(in_channels=65, out_channels=32, use_cond_type_embedding=True, vision_in_dim=1152,
                             meanflow_sum=True)
    pos, neg = _conds(8, 64, 1, pooled_output=None)
    return _tiny_from_config("hunyuan_video15", "HunyuanVideo15", config, (1, 32, 1, 8, 8), pos, neg)


def tiny_hunyuan_image21() -> TinyDiT | None:
    """HunyuanImage 2.1 (HunyuanVideo blocks on 2-D patches, 64 latent channels), width 128, 2 double + 3 single."""
    config = _hunyuan_config(in_channels=64, out_channels=64, patch_size=[1, 1], axes_dim=[64, 64])
    pos, neg = _conds(8, 64, 1)
    return _tiny_from_config("hunyuan_image21", "HunyuanImage21", config, (1, 64, 8, 8), pos, neg)


def tiny_wan22_5b() -> TinyDiT | None:
    """Wan 2.2 TI2V 5B (``WAN22_T2V``: 48-channel latent, per-token timesteps), 4 blocks of width 256."""
    config = dict(image_model="wan2.1", model_type="t2v", dim=256, ffn_dim=512, num_heads=2, num_layers=4,
                  in_dim=48, out_dim=48, patch_size=(1, 2, 2), freq_dim=256, window_size=(-1, -1), qk_norm=True,
                  cross_attn_norm=True, eps=1e-6, text_dim=4096)
    pos, neg = _conds(8, 4096, 1)
    return _tiny_from_config("wan22_5b", "WAN22_T2V", config, (1, 48, 1, 4, 4), pos, neg)


def tiny_chroma_radiance() -> TinyDiT | None:
    """Chroma Radiance (pixel space: Chroma blocks, then a per-patch NeRF head), 2 double + 2 single, width 64."""
    config = dict(image_model="chroma_radiance", in_channels=3, out_channels=3, context_in_dim=64, hidden_size=64,
                  mlp_ratio=4.0, num_heads=2, depth=2, depth_single_blocks=2, axes_dim=[8, 12, 12], theta=10000,
                  patch_size=16, qkv_bias=True, in_dim=64, out_dim=64, hidden_dim=64, n_layers=2, txt_ids_dims=[],
                  vec_in_dim=None, nerf_hidden_size=16, nerf_mlp_ratio=2, nerf_depth=2, nerf_max_freqs=4,
                  nerf_tile_size=0, nerf_final_head_type="conv", nerf_embedder_dtype=torch.float32, use_x0=False,
                  use_sequential_txt_ids=False)
    pos, neg = _conds(8, 64, 1, pooled_output=None)
    return _tiny_from_config("chroma_radiance", "ChromaRadiance", config, (1, 3, 32, 32), pos, neg)


def _kandinsky5_config(image: bool) -> dict:
    return dict(image_model="kandinsky5", in_visual_dim=16, out_visual_dim=16, in_text_dim=64, in_text_dim2=32,
                time_dim=64, model_dim=128, ff_dim=256, visual_embed_dim=64 if image else 132,   # channels x patch
                patch_size=(1, 2, 2), num_text_blocks=2, num_visual_blocks=3, axes_dims=(16, 24, 24),
                rope_scale_factor=(1.0, 1.0, 1.0) if image else (1.0, 2.0, 2.0))


def tiny_kandinsky5() -> TinyDiT | None:
    """Kandinsky 5 video: 2 text encoder blocks, then 3 visual decoder blocks, width 128 (head 64 ... see axes)."""
    pos, neg = (_cond((1, 8, 64), seed, pooled_output=(1, 32)) for seed in (1, 2))
    return _tiny_from_config("kandinsky5", "Kandinsky5", _kandinsky5_config(False), (1, 16, 1, 8, 8), pos, neg)


def tiny_kandinsky5_image() -> TinyDiT | None:
    """Kandinsky 5 image (FLUX latent, no concat channels)."""
    pos, neg = (_cond((1, 8, 64), seed, pooled_output=(1, 32)) for seed in (1, 2))
    return _tiny_from_config("kandinsky5_image", "Kandinsky5Image", _kandinsky5_config(True), (1, 16, 8, 8), pos, neg)


def tiny_longcat_image() -> TinyDiT | None:
    """LongCat-Image (FLUX blocks, no guidance or pooled vector, 2-axis text positions), 2 double + 3 single."""
    config = dict(image_model="flux", in_channels=16, out_channels=16, vec_in_dim=None, context_in_dim=64,
                  hidden_size=64, mlp_ratio=4.0, num_heads=2, depth=2, depth_single_blocks=3, axes_dim=[8, 12, 12],
                  theta=10000, patch_size=2, qkv_bias=True, guidance_embed=False, txt_ids_dims=[1, 2])
    pos, neg = _conds(8, 64, 1)
    return _tiny_from_config("longcat_image", "LongCatImage", config, (1, 16, 8, 8), pos, neg)


def tiny_ernie_image() -> TinyDiT | None:
    """ERNIE-Image: one shared adaLN modulation for all layers (outside them), 3 layers of width 64, FLUX.2 latent."""
    config = dict(image_model="ernie", hidden_size=64, num_attention_heads=2, num_layers=3, ffn_hidden_size=128,
                  in_channels=128, out_channels=128, patch_size=1, text_in_dim=64, rope_axes_dim=(8, 12, 12))
    pos, neg = _conds(8, 64, 1)
    return _tiny_from_config("ernie_image", "ErnieImage", config, (1, 128, 4, 4), pos, neg)


def tiny_krea2() -> TinyDiT | None:
    """Krea 2: a text-fusion transformer (2 layer-wise + 2 refiner blocks over the text encoder's layers) runs
    first, then 3 single-stream blocks of width 64 with a shared time projection; context = 2 text layers of 64."""
    config = dict(image_model="krea2", features=64, tdim=32, txtdim=64, heads=2, kvheads=2, multiplier=2, layers=3,
                  patch=2, channels=16, txtlayers=2, txtheads=2, txtkvheads=2)
    pos, neg = _conds(8, 128, 1)
    return _tiny_from_config("krea2", "Krea2", config, (1, 16, 1, 8, 8), pos, neg)


def tiny_mage_flow() -> TinyDiT | None:
    """Mage-Flow (Qwen-Image-style dual-stream blocks, FLUX.2 latent), 3 blocks of width 64."""
    config = dict(image_model="mage_flow", in_channels=128, out_channels=128, num_layers=3, attention_head_dim=32,
                  num_attention_heads=2, joint_attention_dim=64, axes_dims_rope=(8, 12, 12))
    pos, neg = _conds(8, 64, 1)
    return _tiny_from_config("mage_flow", "MageFlow", config, (1, 128, 4, 4), pos, neg)


def tiny_omnigen2() -> TinyDiT | None:
    """OmniGen2: 2 noise refiners, 2 context refiners, (reference-image refiners, idle without references), then
    3 layers of width 96 (2 heads of 48)."""
    config = dict(image_model="omnigen2", patch_size=2, in_channels=16, out_channels=None, hidden_size=96,
                  num_layers=3, num_refiner_layers=2, num_attention_heads=2, num_kv_heads=1, multiple_of=32,
                  ffn_dim_multiplier=None, norm_eps=1e-5, axes_dim_rope=(16, 16, 16), axes_lens=(300, 512, 512),
                  text_feat_dim=64, timestep_scale=1000.0)
    pos, neg = _conds(8, 64, 1, attention_mask=torch.ones(1, 8, dtype=torch.long))   # its forward takes num_tokens
    return _tiny_from_config("omnigen2", "Omnigen2", config, (1, 16, 8, 8), pos, neg)


def tiny_auraflow() -> TinyDiT | None:
    """AuraFlow (MMDiT): 2 double (joint) layers, then 2 single layers, width 64; SDXL latent."""
    config = dict(in_channels=4, out_channels=4, patch_size=2, dim=64, n_layers=4, n_double_layers=2, n_heads=2,
                  global_conddim=64, cond_seq_dim=64, max_seq=16 * 16)
    pos, neg = _conds(8, 64, 1)
    return _tiny_from_config("auraflow", "AuraFlow", config, (1, 4, 16, 16), pos, neg)


def tiny_pixart_sigma() -> TinyDiT | None:
    """PixArt-Sigma: 4 blocks of width 64 sharing one adaLN projection (``t_block``) outside them; T5 context."""
    config = dict(image_model="pixart_sigma", input_size=16, patch_size=2, in_channels=4, hidden_size=64, depth=4,
                  num_heads=2, caption_channels=64, model_max_length=8, micro_condition=False, pe_interpolation=1.0)
    pos, neg = _conds(8, 64, 1)
    # 40x40: the positional embedding's base size is the resolution rounded to 64 (0 below 33)
    return _tiny_from_config("pixart_sigma", "PixArtSigma", config, (1, 4, 40, 40), pos, neg)


def tiny_cogvideox() -> TinyDiT | None:
    """CogVideoX t2v (rotary positions, as 1.5), 4 blocks of width 64 (2 heads of 32)."""
    config = dict(image_model="cogvideox", num_attention_heads=2, attention_head_dim=32, in_channels=16,
                  out_channels=16, time_embed_dim=32, text_embed_dim=64, num_layers=4, sample_width=16,
                  sample_height=16, sample_frames=9, patch_size=2, max_text_seq_length=8,
                  use_rotary_positional_embeddings=True)
    pos, neg = _conds(8, 64, 1)
    return _tiny_from_config("cogvideox", "CogVideoX_T2V", config, (1, 16, 1, 8, 8), pos, neg)


def tiny_cosmos_predict2() -> TinyDiT | None:
    """Cosmos-Predict2 text-to-image (MiniTrainDIT with adaLN-LoRA), 3 blocks of width 64."""
    config = dict(image_model="cosmos_predict2", max_img_h=240, max_img_w=240, max_frames=128, in_channels=16,
                  out_channels=16, patch_spatial=2, patch_temporal=1, model_channels=64, concat_padding_mask=True,
                  crossattn_emb_channels=64, pos_emb_cls="rope3d", pos_emb_learnable=True, pos_emb_interpolation="crop",
                  min_fps=1, max_fps=30, use_adaln_lora=True, adaln_lora_dim=16, num_blocks=3, num_heads=2,
                  extra_per_block_abs_pos_emb=False, rope_h_extrapolation_ratio=4.0, rope_w_extrapolation_ratio=4.0,
                  rope_t_extrapolation_ratio=1.0, extra_h_extrapolation_ratio=1.0, extra_w_extrapolation_ratio=1.0,
                  extra_t_extrapolation_ratio=1.0, rope_enable_fps_modulation=False)
    pos, neg = _conds(8, 64, 1)
    return _tiny_from_config("cosmos_predict2", "CosmosT2IPredict2", config, (1, 16, 1, 8, 8), pos, neg)


def tiny_anima() -> TinyDiT | None:
    """Anima: Cosmos-Predict2 blocks (3 of width 64) behind ComfyUI's ``LLMAdapter``, which maps Qwen3 0.6B states
    and T5 token ids to the cross-attention context (in the model's ``extra_conds`` under inference mode, in its
    forward otherwise, as here). ``Anima()`` builds the adapter at its released size (6 blocks of width 1024 and a
    32128-token embedding, ~134 M weights: 5 s a load here), so it is rebuilt at width 64 with 2 blocks through the
    same class's own arguments before the weights are filled. Context: 8 states of 64 plus T5 ids and weights."""
    cls = _model_class("Anima")
    if cls is None:
        return None
    import comfy.model_management as mm
    import comfy.model_patcher
    import comfy.ops
    from comfy.ldm.anima.model import LLMAdapter

    config = dict(image_model="anima", max_img_h=240, max_img_w=240, max_frames=128, in_channels=16,
                  out_channels=16, patch_spatial=2, patch_temporal=1, model_channels=64, concat_padding_mask=True,
                  crossattn_emb_channels=64, pos_emb_cls="rope3d", pos_emb_learnable=True,
                  pos_emb_interpolation="crop", min_fps=1, max_fps=30, use_adaln_lora=True, adaln_lora_dim=16,
                  num_blocks=3, num_heads=2, extra_per_block_abs_pos_emb=False, rope_h_extrapolation_ratio=4.0,
                  rope_w_extrapolation_ratio=4.0, rope_t_extrapolation_ratio=1.0, extra_h_extrapolation_ratio=1.0,
                  extra_w_extrapolation_ratio=1.0, extra_t_extrapolation_ratio=1.0, rope_enable_fps_modulation=False)

    def load():
        mc = cls(config)
        mc.set_inference_dtype(torch.float32, None)
        model = mc.get_model({})
        dm = model.diffusion_model
        ops = comfy.ops.pick_operations(None, model.manual_cast_dtype)
        dm.llm_adapter = LLMAdapter(source_dim=64, target_dim=64, model_dim=64, num_layers=2, num_heads=2,
                                    dtype=torch.float32, operations=ops)
        dm.load_state_dict(fill_random_({k: torch.empty(v.shape) for k, v in dm.state_dict().items()}, 0))
        return comfy.model_patcher.ModelPatcher(model, load_device=mm.get_torch_device(),
                                                offload_device=mm.unet_offload_device())
    ids = torch.tensor([5, 17, 301, 4000, 12, 9, 1, 0], dtype=torch.int)
    pos, neg = (_cond((1, 8, 64), seed, t5xxl_ids=ids, t5xxl_weights=torch.ones(8)) for seed in (1, 2))
    return TinyDiT("anima", load, pos, neg, {"samples": torch.zeros(1, 16, 1, 8, 8)})


def tiny_ideogram4() -> TinyDiT | None:
    """Ideogram 4: single-stream layers over a packed [text, image] sequence, FLUX.2 latent (128 channels, patch 2
    inside the model's token packing). ComfyUI's config class fixes the released widths in ``unet_extra_config``
    (18 heads of 256, MLP 12288, 53248-wide LLM features), which override any config, so a test subclass carries
    tiny ones: 3 layers of width 128 (2 heads of 64), LLM features 64."""
    cls = _model_class("Ideogram4")
    if cls is None:
        return None
    extra = dict(cls.unet_extra_config, num_attention_heads=2, attention_head_dim=64, intermediate_size=256,
                 adaln_dim=32, llm_features_dim=64, mrope_section=[6, 5, 5])
    tiny = type("TinyIdeogram4", (cls,), {"unet_extra_config": extra})
    pos, neg = _conds(8, 64, 1)
    return TinyDiT("ideogram4", lambda: _patcher_from_config(tiny, {"image_model": "ideogram4", "in_channels": 128,
                                                                    "num_layers": 3}, seed=0),
                   pos, neg, {"samples": torch.zeros(1, 128, 4, 4)})


def tiny_hidream_o1() -> TinyDiT | None:
    """HiDream-O1-Image: a Qwen3-VL decoder (``language_model.layers``) over the prompt's token ids and 32x32 RGB
    patches (pixel space, no VAE), plus a vision tower for reference images (idle without them). Sizes through the
    class's own ``text_config_overrides`` / ``vision_config_overrides``: 4 decoder layers of width 64 (2 heads and
    1 KV head of 32), vision width 32 with 2 blocks. The vocabulary keeps its released size: the prompt template's
    special tokens (``<|tms|>`` = 151673) index it. Conditioning: the pass-through text encoder's token ids."""
    text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=2,
                num_key_value_heads=1, head_dim=32, rope_dims=[6, 5, 5])
    vision = dict(hidden_size=32, num_heads=2, intermediate_size=64, depth=2, num_position_embeddings=16,
                  deepstack_visual_indexes=())
    config = {"image_model": "hidream_o1", "text_config_overrides": text, "vision_config_overrides": vision}

    def cond(words):
        ids = torch.tensor([[151644, 872, 198, *words, 151645, 198, 151644, 77091, 198, 151669, 151673]])
        return [[ids.unsqueeze(-1).float(), {"text_input_ids": ids}]]
    return _tiny_from_config("hidream_o1", "HiDreamO1", config, (1, 3, 64, 64), cond([1000, 2000, 3000]),
                             cond([1001, 17]))


def tiny_joyimage() -> TinyDiT | None:
    """JoyImage (HunyuanVideo-style dual-stream blocks on Wan latents), 3 layers of width 128 (1 head of 128)."""
    config = dict(image_model="joyimage", patch_size=[1, 2, 2], in_channels=16, out_channels=16, hidden_size=128,
                  num_attention_heads=1, text_dim=64, mlp_width_ratio=2.0, num_layers=3, rope_dim_list=[16, 56, 56],
                  theta=10000)
    pos, neg = _conds(8, 64, 1)
    return _tiny_from_config("joyimage", "JoyImage", config, (1, 16, 1, 8, 8), pos, neg)


BUILDERS = {"sdxl": tiny_sdxl, "flux": tiny_flux, "chroma": tiny_chroma, "hunyuan_video": tiny_hunyuan_video,
            "sd3": tiny_sd3, "ltxv": tiny_ltxv, "ltxav": tiny_ltxav, "qwen_image": tiny_qwen_image, "lumina2": tiny_lumina2,
            "zimage": tiny_zimage, "hidream": tiny_hidream, "flux2": tiny_flux2, "hunyuan_video15": tiny_hunyuan_video15,
            "hunyuan_image21": tiny_hunyuan_image21, "wan22_5b": tiny_wan22_5b, "chroma_radiance": tiny_chroma_radiance,
            "kandinsky5": tiny_kandinsky5, "kandinsky5_image": tiny_kandinsky5_image, "longcat_image": tiny_longcat_image,
            "ernie_image": tiny_ernie_image, "krea2": tiny_krea2, "mage_flow": tiny_mage_flow, "omnigen2": tiny_omnigen2,
            "auraflow": tiny_auraflow, "pixart_sigma": tiny_pixart_sigma, "cogvideox": tiny_cogvideox,
            "cosmos_predict2": tiny_cosmos_predict2, "joyimage": tiny_joyimage, "anima": tiny_anima,
            "ideogram4": tiny_ideogram4, "hidream_o1": tiny_hidream_o1}


def tiny_stable_cascade_c() -> TinyDiT:
    """Stable Cascade Stage C: levels (ModuleLists) of mixed ResBlock / AttnBlock / TimestepBlock layers that the
    model runs in its own loops, repeated per ``block_repeat``: no block structure GroupPrefetch can stream."""
    import comfy.supported_models as sm

    cfg = dict(stable_cascade_stage="c", c_in=16, c_out=16, c_r=64, patch_size=1, c_cond=64, c_hidden=[64, 64],
               nhead=[2, 2], blocks=[[2, 2], [2, 2]], block_repeat=[[1, 1], [1, 1]], level_config=["CTA", "CTA"],
               c_clip_text=32, c_clip_text_pooled=32, c_clip_img=768, c_clip_seq=4)
    pos = _cond((1, 8, 32), 0, pooled_output=(1, 1, 32))
    neg = _cond((1, 8, 32), 1, pooled_output=(1, 1, 32))
    return TinyDiT("stable_cascade_c", lambda: _patcher_from_config(sm.Stable_Cascade_C, cfg, seed=5), pos, neg,
                   {"samples": torch.zeros(1, 16, 8, 8)})
