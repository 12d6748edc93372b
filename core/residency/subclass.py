"""Tensor subclasses that wrap plain tensors (quantized weights), seen as the plain tensors inside them.

ComfyUI 0.8+ holds fp8 and other quantized weights as ``QuantizedTensor`` (comfy-kitchen): a wrapper
subclass around a plain ``_qdata`` tensor and its scale; torchao's quantized tensors nest one wrapper in
another. Both follow torch's traceable-subclass protocol (``__tensor_flatten__`` names the inner tensors,
``__tensor_unflatten__`` builds the wrapper around new ones), which is all this module relies on.

A wrapper's own device is fixed when it is built, so moving one means building a new wrapper around the
moved inner tensors; swapping the inner tensors' storage (as offload does with plain parameters) would
leave the wrapper claiming the old device. Offload therefore keeps the host copies in the wrapper's inner
tensors and builds device wrappers around device copies (``rebuild``).

Storage subclasses are the other kind: a plain tensor's storage and layout with Python attributes on top and
no dispatch of their own. ComfyUI-GGUF's ``GGMLTensor`` is one (packed quantized blocks as uint8, with the
quantization type, the logical shape, which its ``shape`` property returns, and LoRA patches as attributes).
Their data is swapped by pointer like a plain tensor's (``.data = ...`` keeps the object and its
attributes); their real layout is read from a plain alias (``plain``), never from ``shape``.
"""
from __future__ import annotations

from typing import Mapping

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

Path = tuple[str, ...]


def is_plain(t: torch.Tensor) -> bool:
    """A tensor or parameter whose data is an ordinary tensor (no subclass anywhere)."""
    return type(t) in (torch.Tensor, nn.Parameter) and type(t.data) is torch.Tensor


def state_outside(t: torch.Tensor) -> bool:
    """bitsandbytes parameters keep their quantization state (absmax, codebook) in objects beside the data, which
    neither a pointer swap nor a rebuilt wrapper would move with it."""
    mod = type(t).__module__ or ""
    return mod.startswith("bitsandbytes") or hasattr(t, "quant_state") or hasattr(t, "SCB")


def is_storage(t: torch.Tensor) -> bool:
    """A storage subclass (module docstring): its own storage, extra attributes, no dispatch or flatten protocol,
    and no tensor among its attributes (a scale kept there would stay behind when the data moves)."""
    cls = type(t)
    return (not is_plain(t) and not is_traceable_wrapper_subclass(t) and not hasattr(t, "__tensor_flatten__")
            and cls.__torch_dispatch__ is torch.Tensor.__torch_dispatch__ and not state_outside(t)
            and not isinstance(t, nn.parameter.UninitializedTensorMixin)
            and not any(isinstance(v, torch.Tensor) for v in getattr(t, "__dict__", {}).values()))


def plain(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when plain, else a plain alias of a storage subclass's data (its real sizes and strides)."""
    return t if is_plain(t) else t.as_subclass(torch.Tensor)


def like(t: torch.Tensor, data: torch.Tensor) -> torch.Tensor:
    """A storage subclass of ``t``'s class and attributes around ``data`` (no copy; a parameter stays one)."""
    out = data.as_subclass(type(t))
    out.__dict__.update(t.__dict__)
    return out


def leaves(t: torch.Tensor, path: Path = ()) -> list[tuple[Path, torch.Tensor]] | None:
    """The plain tensors inside wrapper subclass ``t``, depth first, each with its attribute path.

    None when ``t`` is plain, or is (or holds) a subclass without the flatten protocol."""
    flatten = getattr(t, "__tensor_flatten__", None)
    if flatten is None or not hasattr(type(t), "__tensor_unflatten__"):
        return None
    names, _ = flatten()
    out: list[tuple[Path, torch.Tensor]] = []
    for name in names:
        inner = getattr(t, name, None)
        if not isinstance(inner, torch.Tensor):
            return None
        if type(inner) is torch.Tensor:
            out.append((path + (name,), inner))
            continue
        nested = leaves(inner, path + (name,))
        if nested is None:
            return None
        out.extend(nested)
    return out


def leaf(t: torch.Tensor | None, path: Path) -> torch.Tensor | None:
    """The inner tensor of ``t`` at ``path`` (None when ``t`` no longer has one there)."""
    for name in path:
        if t is None:
            return None
        inner = getattr(t, name, None)
        if inner is None and hasattr(t, "__tensor_flatten__"):
            t.__tensor_flatten__()     # some wrappers expose their inner tensors under these names only then
            inner = getattr(t, name, None)
        t = inner if isinstance(inner, torch.Tensor) else None
    return t


def rebuild(t: torch.Tensor, new: Mapping[Path, torch.Tensor], path: Path = ()) -> torch.Tensor:
    """A wrapper like ``t`` around the tensors in ``new`` (by path; inner tensors not named stay as they are).

    A parameter stays a parameter: the result is marked as one (``_is_param``), without the ``detach`` that
    ``nn.Parameter(...)`` would run, which for some wrappers copies the inner tensors."""
    names, ctx = t.__tensor_flatten__()
    inner = {}
    for name in names:
        sub = path + (name,)
        cur = getattr(t, name)
        if sub in new:
            inner[name] = new[sub]
        elif type(cur) is not torch.Tensor and any(p[:len(sub)] == sub for p in new):
            inner[name] = rebuild(cur, new, sub)
        else:
            inner[name] = cur
    out = type(t).__tensor_unflatten__(inner, ctx, t.size(), t.stride())
    if not path and isinstance(t, nn.Parameter):
        out._is_param = True
    return out


def nbytes(t: torch.Tensor) -> int:
    """Bytes ``t`` holds: a wrapper subclass's inner tensors (an fp8 weight is its codes and scale, not
    its logical dtype's size), a plain tensor's elements."""
    if type(t) in (torch.Tensor, nn.Parameter) or is_storage(t):
        return t.numel() * t.element_size()
    inner = leaves(t)
    if inner is None:
        return t.numel() * t.element_size()
    return sum(x.numel() * x.element_size() for _, x in inner)
