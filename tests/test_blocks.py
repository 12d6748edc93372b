"""Block finder on toy versions of each architecture's structure."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from comfyui_levers.core.residency.blocks import find_blocks, module_bytes


class Blk(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.lin = nn.Linear(d, d)


def _lst(n, d=8):
    return nn.ModuleList(Blk(d) for _ in range(n))


def _model(**children):
    m = nn.Module()
    m.embed = nn.Linear(8, 8)
    for k, v in children.items():
        setattr(m, k, v)
    m.final = nn.Linear(8, 2)
    return m


@pytest.mark.parametrize("attrs, arch", [
    ({"double_blocks": 2, "single_blocks": 3}, "flux"),              # Flux, Chroma, HunyuanVideo
    ({"blocks": 4}, "wan"),
    ({"transformer_blocks": 3}, "ltxv_qwen"),                         # LTXV, Qwen-Image
    ({"joint_blocks": 3}, "sd3"),
    ({"layers": 5}, "lumina"),
    ({"context_refiner": 2, "noise_refiner": 2, "layers": 3}, "lumina"),      # Lumina 2, Z-Image
    ({"double_stream_blocks": 2, "single_stream_blocks": 2}, "hidream"),
    ({"double_layers": 2, "single_layers": 2}, "auraflow"),                   # AuraFlow (the fallback took one list)
    ({"text_transformer_blocks": 2, "visual_transformer_blocks": 3}, "kandinsky5"),   # text blocks run first
])
def test_known_layouts_in_execution_order(attrs, arch):
    m = _model(**{k: _lst(n) for k, n in attrs.items()})
    layout = find_blocks(m)
    assert layout.architecture == arch
    expected = [f"{k}.{i}" for k, n in attrs.items() for i in range(n)]
    assert [name for name, _ in layout.blocks] == expected
    assert all(mod is getattr(m, name.split(".")[0])[int(name.split(".")[1])] for name, mod in layout.blocks)
    assert sorted(n for n, _ in layout.remainder) == ["embed.bias", "embed.weight", "final.bias", "final.weight"]


def test_krea2_text_fusion_blocks_in_a_submodule_run_before_the_blocks():
    """Krea 2's text-fusion transformer (``txtfusion``: layer-wise blocks, a projector, refiner blocks) runs before
    its ``blocks``; the Wan rule took only ``blocks``, so the text-fusion blocks stayed resident."""
    m = _model(blocks=_lst(3))
    m.txtfusion = nn.Module()
    m.txtfusion.layerwise_blocks = _lst(2)
    m.txtfusion.projector = nn.Linear(4, 1)
    m.txtfusion.refiner_blocks = _lst(2)
    layout = find_blocks(m)
    assert layout.architecture == "krea2"
    assert [n for n, _ in layout.blocks] == ["txtfusion.layerwise_blocks.0", "txtfusion.layerwise_blocks.1",
                                             "txtfusion.refiner_blocks.0", "txtfusion.refiner_blocks.1",
                                             "blocks.0", "blocks.1", "blocks.2"]
    assert all(mod is m.get_submodule(name) for name, mod in layout.blocks)
    assert sorted(n for n, _ in layout.remainder) == ["embed.bias", "embed.weight", "final.bias", "final.weight",
                                                      "txtfusion.projector.bias", "txtfusion.projector.weight"]
    del m.txtfusion.refiner_blocks                    # a path that does not resolve: the next layout matches
    assert find_blocks(m).architecture == "wan"


def test_hidream_o1_decoder_layers_in_a_submodule():
    """HiDream-O1's blocks are its Qwen3-VL decoder's ``language_model.layers``; the vision tower's blocks (reference
    images only) and the 152k-token embedding stay in the remainder. At tiny sizes the embedding outweighs the
    layers, so the fallback found nothing."""
    m = _model()
    m.language_model = nn.Module()
    m.language_model.embed_tokens = nn.Embedding(4096, 8)
    m.language_model.layers = _lst(3)
    m.visual = nn.Module()
    m.visual.blocks = _lst(2)
    layout = find_blocks(m)
    assert layout.architecture == "hidream_o1"
    assert [n for n, _ in layout.blocks] == [f"language_model.layers.{i}" for i in range(3)]
    rest = {n for n, _ in layout.remainder}
    assert {"language_model.embed_tokens.weight", "visual.blocks.0.lin.weight", "visual.blocks.1.lin.bias"} <= rest


def test_flux_order_is_double_then_single_even_if_registered_in_reverse():
    m = nn.Module()
    m.single_blocks = _lst(2)
    m.double_blocks = _lst(3)
    names = [n for n, _ in find_blocks(m).blocks]
    assert names[:3] == ["double_blocks.0", "double_blocks.1", "double_blocks.2"]


def test_sdxl_unet_input_middle_output():
    m = _model(input_blocks=_lst(3), middle_block=nn.Sequential(Blk(), Blk()), output_blocks=_lst(3))
    layout = find_blocks(m)
    assert layout.architecture == "sdxl_unet"
    assert [n for n, _ in layout.blocks] == ["input_blocks.0", "input_blocks.1", "input_blocks.2", "middle_block",
                                             "output_blocks.0", "output_blocks.1", "output_blocks.2"]


def test_comfy_basemodel_wrapper_is_unwrapped():
    outer = nn.Module()
    outer.diffusion_model = _model(blocks=_lst(3))
    layout = find_blocks(outer)
    assert layout.root is outer.diffusion_model
    assert layout.root_prefix == "diffusion_model."
    assert [n for n, _ in layout.blocks] == ["blocks.0", "blocks.1", "blocks.2"]


def test_fallback_takes_the_heavy_same_class_lists():
    m = nn.Module()
    m.stem = nn.Linear(8, 8)
    m.small = nn.ModuleList(nn.Linear(2, 2) for _ in range(3))         # light: not blocks
    m.stage = nn.Module()
    m.stage.units = _lst(6, d=32)                                        # heavy, nested one level
    m.mixed = nn.ModuleList([Blk(32), nn.Linear(32, 32)])               # mixed classes: never blocks
    layout = find_blocks(m)
    assert layout.architecture == "fallback"
    assert [n for n, _ in layout.blocks] == [f"stage.units.{i}" for i in range(6)]
    streamed = sum(module_bytes(b) for _, b in layout.blocks)
    assert streamed > 0.5 * module_bytes(m)


def test_fallback_never_takes_lists_of_lists_whose_forward_never_runs():
    """Stable Cascade keeps levels as ModuleLists of ModuleLists and loops over them itself: a level is not a
    block (hooks on it never fire), and its items mix classes, so there is no block structure to stream."""
    m = nn.Module()
    m.down = nn.ModuleList(nn.ModuleList([Blk(32), nn.Linear(32, 32)]) for _ in range(2))
    m.up = nn.ModuleList(nn.ModuleList([Blk(32), nn.Linear(32, 32)]) for _ in range(2))
    with pytest.raises(ValueError, match="no transformer blocks"):
        find_blocks(m)
    m.tail = nn.ModuleList(nn.ModuleList([Blk(64)]) for _ in range(4))   # same class, heaviest: still containers
    with pytest.raises(ValueError, match="no transformer blocks"):
        find_blocks(m)


def test_no_blocks_raises_with_advice():
    m = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    with pytest.raises(ValueError, match="no transformer blocks"):
        find_blocks(m)


def test_remainder_and_blocks_partition_the_parameters():
    m = _model(double_blocks=_lst(2), single_blocks=_lst(2))
    m.register_buffer("pe", torch.zeros(4))
    layout = find_blocks(m)
    in_blocks = {id(p) for _, b in layout.blocks for p in b.parameters()}
    rem = {id(t) for _, t in layout.remainder}
    assert not in_blocks & rem
    assert in_blocks | rem == {id(p) for p in m.parameters()} | {id(m.pe)}
    assert layout.remainder_bytes == sum(t.numel() * t.element_size() for _, t in layout.remainder)
