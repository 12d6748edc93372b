"""Find the transformer blocks of a diffusion model, in execution order.

Group prefetch streams these blocks; everything else (embedders, final layer, norms) is the
*remainder* and stays resident. Known architectures are matched by attribute names (the names
ComfyUI's and diffusers' model classes use); unknown models fall back to the ModuleList
children whose items share a class and together hold most of the parameters. Pure torch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from . import subclass

# (architecture, block containers in execution order). The first entry whose containers all
# exist wins, so more specific layouts come first. A container may sit in a submodule (a dotted path).
_LAYOUTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("sdxl_unet", ("input_blocks", "middle_block", "output_blocks")),
    ("hidream", ("double_stream_blocks", "single_stream_blocks")),
    ("flux", ("double_blocks", "single_blocks")),          # also Chroma, HunyuanVideo
    ("sd3", ("joint_blocks",)),
    ("auraflow", ("double_layers", "single_layers")),
    ("kandinsky5", ("text_transformer_blocks", "visual_transformer_blocks")),   # text encoder blocks run first
    ("ltxv_qwen", ("transformer_blocks",)),                  # LTXV, Qwen-Image, diffusers DiTs
    # Krea 2: the text-fusion transformer (layer-wise blocks, a projector, refiner blocks) runs before the blocks
    ("krea2", ("txtfusion.layerwise_blocks", "txtfusion.refiner_blocks", "blocks")),
    # HiDream-O1: the Qwen3-VL decoder's layers (its vision tower runs only on reference images, once per prompt)
    ("hidream_o1", ("language_model.layers",)),
    ("wan", ("blocks",)),
    ("lumina", ("context_refiner", "noise_refiner", "layers")),   # Lumina 2, Z-Image (refiners run first)
    ("lumina", ("layers",)),
)

# Wrappers whose real model sits one attribute deeper (ComfyUI BaseModel, compiled modules).
_INNER = ("diffusion_model", "_orig_mod")


@dataclass(frozen=True)
class BlockLayout:
    """Blocks in execution order and what is left over.

    ``blocks``: (qualified name, module) per block. ``remainder``: (qualified name, tensor) for
    every parameter and buffer outside the blocks. ``root``: the module the names are relative
    to (``model.diffusion_model`` for a ComfyUI BaseModel). ``architecture``: which rule matched.
    """

    root: nn.Module
    root_prefix: str
    blocks: tuple[tuple[str, nn.Module], ...]
    remainder: tuple[tuple[str, torch.Tensor], ...]
    architecture: str

    @property
    def block_bytes(self) -> list[int]:
        return [module_bytes(m) for _, m in self.blocks]

    @property
    def remainder_bytes(self) -> int:
        return sum(_nbytes(t) for _, t in self.remainder)


def _nbytes(t: torch.Tensor) -> int:
    return subclass.nbytes(t)


def module_bytes(module: nn.Module) -> int:
    """Bytes of a module's unique parameters and buffers (tied tensors counted once)."""
    seen: set[int] = set()
    total = 0
    for t in list(module.parameters()) + list(module.buffers()):
        if id(t) in seen:
            continue
        seen.add(id(t))
        total += _nbytes(t)
    return total


def entry_exit(block: nn.Module) -> tuple[nn.Module, nn.Module]:
    """The modules whose calls mark where ``block`` starts and ends running.

    A sequential block is entered at its first layer and left at its last: ComfyUI's UNet runs
    each ``TimestepEmbedSequential`` by calling its layers from a helper, never the block's own
    ``forward``, so hooks on the block itself would never fire. When the block's own forward
    does run, it calls the same layers in the same order, so the marks are the same.
    """
    if isinstance(block, nn.Sequential) and len(block) > 0:
        return block[0], block[-1]
    return block, block


def _unwrap(module: nn.Module) -> tuple[nn.Module, str]:
    prefix = ""
    for _ in range(4):
        for attr in _INNER:
            inner = getattr(module, attr, None)
            if isinstance(inner, nn.Module):
                module, prefix = inner, f"{prefix}{attr}."
                break
        else:
            break
    return module, prefix


def _container_items(root: nn.Module, attr: str) -> list[tuple[str, nn.Module]] | None:
    child = root
    for part in attr.split("."):      # a dotted path reaches a container inside a submodule
        child = getattr(child, part, None)
    if isinstance(child, nn.Module) and attr == "middle_block":
        return [(attr, child)]     # the SDXL middle block is one block (its layers run as one unit)
    if isinstance(child, (nn.ModuleList, nn.Sequential)) and len(child) > 0:
        return [(f"{attr}.{i}", m) for i, m in enumerate(child)]
    return None


def _match_known(root: nn.Module) -> tuple[str, list[tuple[str, nn.Module]]] | None:
    for arch, attrs in _LAYOUTS:
        items: list[tuple[str, nn.Module]] = []
        for attr in attrs:
            found = _container_items(root, attr)
            if found is None:
                break
            items.extend(found)
        else:
            return arch, items
    return None


def _fallback(root: nn.Module, min_share: float) -> list[tuple[str, nn.Module]]:
    """ModuleLists (anywhere in the tree) of same-class items holding the most bytes, in
    registration order, taken greedily until they hold ``min_share`` of the model. Items must be
    modules that run (a ModuleList of ModuleLists is a container of levels, not of blocks)."""
    total = module_bytes(root) or 1
    candidates: list[tuple[int, int, str, nn.ModuleList]] = []
    for order, (name, child) in enumerate(root.named_modules()):
        if not isinstance(child, nn.ModuleList) or len(child) < 2:
            continue
        if len({type(m) for m in child}) != 1:
            continue
        if isinstance(child[0], (nn.ModuleList, nn.ModuleDict)):
            continue  # lists of lists (Stable Cascade's levels): a container's forward never runs, so no hook fires
        candidates.append((module_bytes(child), order, name, child))
    chosen: list[tuple[int, int, str, nn.ModuleList]] = []
    covered = 0
    for nbytes, order, name, lst in sorted(candidates, key=lambda c: -c[0]):
        if any(name.startswith(f"{c[2]}.") or c[2].startswith(f"{name}.") for c in chosen):
            continue  # nested in (or around) a list already taken
        chosen.append((nbytes, order, name, lst))
        covered += nbytes
        if covered >= min_share * total:
            break
    if covered < min_share * total:
        return []
    items: list[tuple[str, nn.Module]] = []
    for _, _, name, lst in sorted(chosen, key=lambda c: c[1]):
        items.extend((f"{name}.{i}", m) for i, m in enumerate(lst))
    return items


def _walk_outside(root: nn.Module, blocks) -> tuple[set[int], set[int]]:
    """(ids of the modules, ids of the tensors) reachable from ``root`` without entering a block module."""
    block_ids = {id(m) for _, m in blocks}
    held: set[int] = set()
    seen: set[int] = set()
    stack = [root]
    while stack:
        mod = stack.pop()
        if id(mod) in seen or id(mod) in block_ids:
            continue
        seen.add(id(mod))
        held.update(id(t) for t in list(mod._parameters.values()) + list(mod._buffers.values()) if t is not None)
        stack.extend(c for c in mod._modules.values() if c is not None)
    return seen, held


def held_outside(root: nn.Module, blocks) -> frozenset[int]:
    """Ids of the tensors of ``blocks`` ((name, module) pairs) that a module of ``root`` outside them also holds (a
    weight tied to the final layer, a layer of a block that the model also calls by another name). Such a tensor is
    in use while its block is not running, so it cannot stream. A block module held under a second name is not
    outside: its own hooks run whichever name calls it."""
    inside: set[int] = set()
    for _, m in blocks:
        inside.update(id(t) for t in m.parameters())
        inside.update(id(t) for t in m.buffers())
    return frozenset(_walk_outside(root, blocks)[1] & inside)


def modules_outside(root: nn.Module, blocks) -> frozenset[int]:
    """Ids of the modules of ``root`` reachable without entering ``blocks`` (a block's layer the model also holds
    by another name is one: it must be loaded with the model's resident part)."""
    return frozenset(_walk_outside(root, blocks)[0])


def find_blocks(model: nn.Module, min_share: float = 0.5) -> BlockLayout:
    """Blocks of ``model`` in execution order plus the remainder.

    ``model`` may be the diffusion model itself or a wrapper holding it as ``diffusion_model``
    (ComfyUI's BaseModel). Raises ``ValueError`` when no block structure is found.
    """
    root, prefix = _unwrap(model)
    known = _match_known(root)
    if known is not None:
        arch, blocks = known
    else:
        arch, blocks = "fallback", _fallback(root, min_share)
    if not blocks:
        raise ValueError(
            f"no transformer blocks found in {type(root).__name__}: expected one of "
            f"{', '.join('+'.join(a) for _, a in _LAYOUTS)}, or ModuleLists of same-class blocks "
            f"holding at least {min_share:.0%} of the parameters")
    in_blocks: set[int] = set()
    for _, m in blocks:
        in_blocks.update(id(t) for t in m.parameters())
        in_blocks.update(id(t) for t in m.buffers())
    shared = held_outside(root, blocks)     # in a block and outside it: the remainder's too
    remainder = []
    seen: set[int] = set()
    for name, t in list(root.named_parameters()) + list(root.named_buffers()):
        if (id(t) in in_blocks and id(t) not in shared) or id(t) in seen:
            continue
        seen.add(id(t))
        remainder.append((name, t))
    return BlockLayout(root=root, root_prefix=prefix, blocks=tuple(blocks), remainder=tuple(remainder),
                       architecture=arch)
