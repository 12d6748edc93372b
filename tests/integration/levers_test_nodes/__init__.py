"""Test-only ComfyUI nodes for the server end-to-end tests (installed into a temporary custom_nodes
folder by tests/integration/comfy_server.py; never shipped).

- LeversTestConditioning: Wan-shaped CONDITIONING from a seed, so graphs run without a text encoder.
- LeversTestNonce: passes a MODEL through unchanged; a new nonce makes everything downstream run
  again while the loader's cached model is reused (how the tests see whether a node mutated it).
"""
import torch


class LeversTestConditioning:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"seed": ("INT", {"default": 0, "min": 0, "max": 2 ** 31 - 1}),
                             "tokens": ("INT", {"default": 8, "min": 1, "max": 512}),
                             "dim": ("INT", {"default": 4096, "min": 8, "max": 8192}),
                             "scale": ("FLOAT", {"default": 1.0, "min": 0.0, "max": 10.0})}}

    RETURN_TYPES = ("CONDITIONING",)
    FUNCTION = "make"
    CATEGORY = "_levers_test"

    def make(self, seed, tokens, dim, scale):
        g = torch.Generator().manual_seed(seed)
        return ([[torch.randn(1, tokens, dim, generator=g) * scale, {}]],)


class LeversTestNonce:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",), "nonce": ("INT", {"default": 0, "min": 0, "max": 2 ** 31 - 1})}}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "passthrough"
    CATEGORY = "_levers_test"

    def passthrough(self, model, nonce):
        return (model,)


NODE_CLASS_MAPPINGS = {"LeversTestConditioning": LeversTestConditioning, "LeversTestNonce": LeversTestNonce}
