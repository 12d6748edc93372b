"""The Levers nodes: the five levers and the Load Quantized DiT loader. Each file is a schema plus one call into
``core`` (through ``bridge``)."""
from __future__ import annotations

import importlib
import logging

# every node's report output (defined before the node modules import it)
REPORT_TIP = ("What this node did, as text (also shown on the node): connect it to a text preview node, or read it "
              "in the run's outputs.")
_NODE_MODULES = ("recommend", "quantize", "load_quantized", "phase_offload", "group_prefetch", "tiled_vae")

log = logging.getLogger("levers")


def _load_node_classes() -> list:
    classes = []
    for name in _NODE_MODULES:
        try:
            module = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name and exc.name.endswith(f"nodes.{name}"):
                continue  # node not shipped in this build
            raise
        classes.extend(getattr(module, "NODES", []))
    return classes


NODE_CLASSES = _load_node_classes()


async def comfy_entrypoint():
    from comfy_api.latest import ComfyExtension

    class LeversExtension(ComfyExtension):
        async def get_node_list(self):
            return list(NODE_CLASSES)

    return LeversExtension()
