"""Levers engine: planning, quantization, residency and tiling.

Imports torch and optional libraries only, never ``comfy``; importing it does not
initialise CUDA. The ComfyUI bridge lives in ``bridge/``.
"""
from .types import Component, Goal, Precision, Residency
from .errors import LeversError

__all__ = ["Component", "Goal", "Precision", "Residency", "LeversError"]
