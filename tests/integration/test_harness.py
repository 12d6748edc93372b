"""The harness itself: ComfyUI loads the tiny models and the pack's nodes register."""
import torch


def test_tiny_wan_samples_and_decodes_deterministically(tiny_wan):
    model = tiny_wan.load_model()
    a = tiny_wan.sample(model, seed=3)["samples"]
    b = tiny_wan.sample(model, seed=3)["samples"]
    assert a.shape == (1, 16, 2, 8, 8)
    assert torch.isfinite(a).all()
    assert torch.equal(a, b)
    image = tiny_wan.decode(tiny_wan.load_vae(), {"samples": a})
    assert image.shape[-1] == 3 and image.shape[1:3] == (64, 64)
    assert torch.isfinite(image).all()


def test_levers_nodes_register_under_comfyui(comfy_env):
    ids = {cls.GET_SCHEMA().node_id for cls in comfy_env.levers_nodes.NODE_CLASSES}
    assert "LeversRecommend" in ids
    for node_id in ids:
        assert node_id.startswith("Levers")
