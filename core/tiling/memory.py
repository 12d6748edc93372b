"""Measure the peak memory a callable allocates: the real allocator on CUDA, a live-tensor count elsewhere."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


@dataclass(frozen=True)
class PeakMeasurement:
    peak_bytes: int        # bytes above what was allocated before the call
    method: str            # "cuda.max_memory_allocated" or "live-tensor tracking (dispatch)"


class _LiveTensorBytes(TorchDispatchMode):
    """Counts bytes of tensor storages created by ops and still alive; keeps the maximum.

    Storages are tracked by weak reference, so a tensor freed by Python stops counting at the
    next op. Views share their base's storage and count once.
    """

    def __init__(self):
        super().__init__()
        from torch.multiprocessing.reductions import StorageWeakRef

        self._ref = StorageWeakRef
        self.live: dict[int, tuple[object, int]] = {}
        self.current = 0
        self.peak = 0

    def _sweep(self) -> None:
        dead = [k for k, (ref, _) in self.live.items() if ref.expired()]
        for k in dead:
            self.current -= self.live.pop(k)[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self._sweep()
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                st = t.untyped_storage()
                key = st.data_ptr()
                if key and key not in self.live:
                    n = st.nbytes()
                    self.live[key] = (self._ref(st), n)
                    self.current += n
        self.peak = max(self.peak, self.current)
        return out


def peak_method(device: torch.device | str) -> str:
    """How ``measure_peak_bytes`` measures on ``device`` (the report names it)."""
    return "cuda.max_memory_allocated" if torch.device(device).type == "cuda" else "live-tensor tracking (dispatch)"


def measure_peak_bytes(fn: Callable[[], object], device: torch.device | str) -> tuple[object, PeakMeasurement]:
    """Run ``fn()`` and return (its result, the peak bytes it allocated on ``device``).

    On CUDA this is ``torch.cuda.max_memory_allocated`` above the starting allocation (what the
    allocator really handed out, workspaces included). Elsewhere it counts the bytes of live
    tensors created during the call (an activation count: allocator slack is not included).
    """
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)   # so the peak counter starts from a settled allocator
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        result = fn()
        torch.cuda.synchronize(device)   # the peak is only final once queued kernels ran
        peak = torch.cuda.max_memory_allocated(device) - base
        return result, PeakMeasurement(int(max(0, peak)), peak_method(device))
    mode = _LiveTensorBytes()
    with mode:
        result = fn()
    return result, PeakMeasurement(int(mode.peak), peak_method(device))
