"""Importing the engine pulls in no ComfyUI module and does not initialise CUDA."""
import subprocess
import sys
import textwrap


def test_core_imports_no_comfy_and_no_cuda():
    code = textwrap.dedent("""
        import sys, torch
        import comfyui_levers
        import comfyui_levers.core
        import comfyui_levers.core.plan, comfyui_levers.core.probe, comfyui_levers.core.presets
        import comfyui_levers.core.report, comfyui_levers.core.residency.transport
        import pkgutil, importlib
        import comfyui_levers.core as core
        for m in pkgutil.walk_packages(core.__path__, core.__name__ + "."):
            importlib.import_module(m.name)
        import comfyui_levers.cli
        bad = [m for m in sys.modules if m == "comfy" or m.startswith(("comfy.", "comfy_api", "comfy_extras"))
               or m in ("folder_paths", "nodes", "execution")]
        print("BAD", bad)
        print("CUDA_INIT", torch.cuda.is_initialized())
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "BAD []" in out.stdout, out.stdout
    assert "CUDA_INIT False" in out.stdout


def test_pack_registers_nothing_outside_comfyui():
    import comfyui_levers

    assert not hasattr(comfyui_levers, "comfy_entrypoint")
