"""The emulated card every ComfyUI baseline in bench/ uses: ComfyUI's free-memory reads describe a
card of ``budget`` bytes (``budget - active`` on CUDA), whatever the real card holds."""
from __future__ import annotations

from typing import Callable

import torch


def budget_free_memory(mm, budget_bytes: int) -> Callable:
    """A drop-in for ``comfy.model_management.get_free_memory`` on a card of ``budget_bytes``."""
    orig = mm.get_free_memory

    def get_free_memory(dev=None, torch_free_too=False):
        dev = mm.get_torch_device() if dev is None else dev
        if getattr(dev, "type", None) != "cuda":
            return orig(dev, torch_free_too)
        stats = torch.cuda.memory_stats(dev)
        active = stats.get("active_bytes.all.current", 0)
        reserved = stats.get("reserved_bytes.all.current", 0)
        free_total = max(0, budget_bytes - active)
        return (free_total, max(0, reserved - active)) if torch_free_too else free_total

    return get_free_memory
