"""Integration tests against a real ComfyUI, in-process on the CPU.

Point COMFYUI_PATH at a ComfyUI checkout (0.3.64, 0.8.0 or a 0.33-era release). Without it
every test here is skipped with that reason. The tiny models are built by the tests.
"""
from __future__ import annotations

import importlib
import os
import sys
from types import SimpleNamespace

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)  # so tests can `import tiny_models`


def pytest_collection_modifyitems(config, items):
    for item in items:
        if str(item.fspath).startswith(HERE):
            item.add_marker(pytest.mark.comfyui)


def _comfyui_path() -> str | None:
    path = os.environ.get("COMFYUI_PATH")
    if not path:
        return None
    return path if os.path.isfile(os.path.join(path, "comfy", "model_management.py")) else None


def _ensure_torchaudio() -> None:
    """ComfyUI 0.33 imports torchaudio at start-up; use the test-only stand-in when it is missing."""
    try:
        importlib.import_module("torchaudio")
    except ImportError:
        sys.path.insert(0, os.path.join(HERE, "stubs"))


@pytest.fixture(scope="session")
def comfy_env(tmp_path_factory):
    path = _comfyui_path()
    if path is None:
        reason = ("COMFYUI_PATH is not set" if not os.environ.get("COMFYUI_PATH")
                  else f"COMFYUI_PATH={os.environ['COMFYUI_PATH']} has no comfy/model_management.py")
        pytest.skip(f"{reason}: point it at a ComfyUI checkout to run the integration tests")
    _ensure_torchaudio()
    if path not in sys.path:
        sys.path.insert(0, path)
    import comfy.options

    comfy.options.enable_args_parsing(False)
    import comfy.cli_args

    comfy.cli_args.args.cpu = True
    comfy.cli_args.args.disable_pinned_memory = True if hasattr(comfy.cli_args.args, "disable_pinned_memory") else None
    import comfy.model_management as mm
    import folder_paths
    import nodes as comfy_nodes

    models_dir = str(tmp_path_factory.mktemp("comfy_models"))
    for kind in ("diffusion_models", "vae", "loras", "checkpoints", "text_encoders"):
        os.makedirs(os.path.join(models_dir, kind), exist_ok=True)
        folder_paths.add_model_folder_path(kind, os.path.join(models_dir, kind))
    version = "unknown"
    try:
        version = importlib.import_module("comfyui_version").__version__
    except ImportError:
        pass
    # Now that ComfyUI is imported, importing the pack registers its nodes as ComfyUI would.
    import comfyui_levers.nodes as levers_nodes

    return SimpleNamespace(path=path, version=version, nodes=comfy_nodes, folder_paths=folder_paths, mm=mm,
                           models_dir=models_dir, levers_nodes=levers_nodes)


class TinyWan:
    """Tiny Wan 2.1 DiT + VAE and ComfyUI's own sampling/decoding path around them."""

    def __init__(self, env):
        from tiny_models import save, tiny_wan_dit_state_dict, tiny_wan_vae_state_dict

        self.env = env
        self.unet_name = "levers_tiny_wan21.safetensors"
        self.vae_name = "levers_tiny_wan21_vae.safetensors"
        save(tiny_wan_dit_state_dict(), os.path.join(env.models_dir, "diffusion_models", self.unet_name))
        save(tiny_wan_vae_state_dict(), os.path.join(env.models_dir, "vae", self.vae_name))

    def load_model(self, weight_dtype: str = "default"):
        return self.env.nodes.UNETLoader().load_unet(self.unet_name, weight_dtype)[0]

    def load_vae(self):
        return self.env.nodes.VAELoader().load_vae(self.vae_name)[0]

    def cond(self, seed: int = 0, tokens: int = 8):
        g = torch.Generator().manual_seed(seed)
        pos = [[torch.randn(1, tokens, 4096, generator=g), {}]]
        neg = [[torch.randn(1, tokens, 4096, generator=g) * 0.1, {}]]
        return pos, neg

    def empty_latent(self, width: int = 64, height: int = 64, length: int = 5, batch: int = 1):
        t = (length - 1) // 4 + 1
        return {"samples": torch.zeros(batch, 16, t, height // 8, width // 8)}

    def sample(self, model, latent=None, seed: int = 0, steps: int = 2, cfg: float = 2.0,
               sampler: str = "euler", scheduler: str = "simple", denoise: float = 1.0):
        latent = latent if latent is not None else self.empty_latent()
        pos, neg = self.cond(seed)
        return self.env.nodes.common_ksampler(model, seed, steps, cfg, sampler, scheduler, pos, neg, latent,
                                              denoise=denoise)[0]

    def decode(self, vae, latent):
        return self.env.nodes.VAEDecode().decode(vae, latent)[0]


@pytest.fixture(scope="session")
def tiny_wan(comfy_env):
    return TinyWan(comfy_env)


@pytest.fixture(scope="session")
def gguf(comfy_env, tiny_wan):
    """ComfyUI-GGUF (city96), imported as ComfyUI imports a custom node, with a tiny Wan 2.1 GGUF file (Q8_0 and
    Q4_0 weights) in the models folder. Point COMFYUI_GGUF_PATH at a ComfyUI-GGUF checkout (and install the ``gguf``
    package) to run these tests; without it they are skipped with that reason."""
    path = os.environ.get("COMFYUI_GGUF_PATH")
    if not path or not os.path.isfile(os.path.join(path, "nodes.py")):
        pytest.skip("COMFYUI_GGUF_PATH is not set to a ComfyUI-GGUF checkout: the GGUF tests need the real custom "
                    "node (it is not on PyPI)")
    pytest.importorskip("gguf", reason="the gguf package is not installed (pip install gguf)")
    import importlib.util

    name = "levers_test_comfyui_gguf"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, os.path.join(path, "__init__.py"),
                                                      submodule_search_locations=[path])
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    from tiny_models import save_gguf, tiny_wan_dit_state_dict

    unet = "levers_tiny_wan21_q8_q4.gguf"
    kinds = save_gguf(tiny_wan_dit_state_dict(), os.path.join(comfy_env.models_dir, "diffusion_models", unet), "wan")
    nodes = importlib.import_module(f"{name}.nodes")
    ops = importlib.import_module(f"{name}.ops")
    return SimpleNamespace(nodes=nodes, ops=ops, kinds=kinds,
                           load_model=lambda: nodes.UnetLoaderGGUF().load_unet(unet)[0])
