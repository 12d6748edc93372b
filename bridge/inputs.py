"""Checks every node runs on its ComfyUI inputs: a wrong wire is an error that says what to connect."""
from __future__ import annotations

from ..core.errors import IncompatibleInput


def require_model(model, name: str = "model"):
    """A MODEL input must be a ComfyUI ModelPatcher around a diffusion model."""
    if (model is None or not hasattr(model, "clone")
            or getattr(getattr(model, "model", None), "diffusion_model", None) is None):
        raise IncompatibleInput(name, "a MODEL (from Load Diffusion Model / Load Checkpoint)", model,
                                "Connect the MODEL output of a loader, not a CLIP, VAE or other value.")
    return model


def require_clip(clip, name: str = "clip"):
    if clip is None or not hasattr(clip, "cond_stage_model") or not hasattr(clip, "patcher"):
        raise IncompatibleInput(name, "a CLIP (from a CLIP/text-encoder loader)", clip,
                                "Connect the CLIP output of Load CLIP / DualCLIPLoader / Load Checkpoint.")
    return clip


def require_vae(vae, name: str = "vae"):
    if vae is None or not hasattr(vae, "first_stage_model") or not hasattr(vae, "decode"):
        raise IncompatibleInput(name, "a VAE (from Load VAE / Load Checkpoint)", vae, "Connect the VAE output of a loader.")
    return vae
