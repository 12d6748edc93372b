"""ComfyUI-Levers: fit big diffusion transformers on the GPU you have.

As a ComfyUI custom node folder this registers the Levers nodes (V3 API when available).
Imported as the ``comfyui_levers`` package outside ComfyUI it does nothing but expose
``core``: no ``comfy`` import, no CUDA initialisation.
"""
import sys

__version__ = "0.1.0"


def _inside_comfyui() -> bool:
    # ComfyUI has imported its model manager before it loads custom nodes.
    return "comfy.model_management" in sys.modules


if _inside_comfyui():
    from .nodes import comfy_entrypoint, NODE_CLASSES  # noqa: F401  (ComfyUI looks these up)

    WEB_DIRECTORY = None
