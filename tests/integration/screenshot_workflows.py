"""Render each example workflow in ComfyUI's real frontend and save a PNG into docs/images/, and a small JPEG
beside the workflow (the template browser's card image).

    COMFYUI_PATH=/path/to/ComfyUI COMFY_PYTHON=/path/to/comfy-venv/bin/python \
        python tests/integration/screenshot_workflows.py   # a Python with playwright

Needs Playwright (pip) and a Chromium (Debian's ``chromium`` package; ``CHROMIUM`` overrides the
path). Starts a headless ComfyUI with the pack, loads each graph through the frontend's own
``app.loadGraphData`` and fits it to the window. A documentation tool, not shipped.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

from comfy_server import ComfyServer, comfyui_path  # noqa: E402

OUT = ROOT / "docs" / "images"
FIT_JS = """
async (graph) => {
  await window.app.loadGraphData(graph, true, false, null,
      {showMissingNodesDialog: false, showMissingModelsDialog: false});
  const c = window.app.canvas;
  let x0 = 1e9, y0 = 1e9, x1 = -1e9, y1 = -1e9;
  for (const n of window.app.graph._nodes) {
    x0 = Math.min(x0, n.pos[0]); y0 = Math.min(y0, n.pos[1] - 40);
    x1 = Math.max(x1, n.pos[0] + n.size[0]); y1 = Math.max(y1, n.pos[1] + n.size[1]);
  }
  for (const g of (window.app.graph._groups || [])) {
    const b = g._bounding || g.bounding;
    x0 = Math.min(x0, b[0]); y0 = Math.min(y0, b[1]); x1 = Math.max(x1, b[0] + b[2]); y1 = Math.max(y1, b[1] + b[3]);
  }
  const w = c.canvas.width / (window.devicePixelRatio || 1), h = c.canvas.height / (window.devicePixelRatio || 1);
  // keep clear of the sidebar (left) and the tab bar / run toolbar (top)
  const left = 80, top = 120, right = 30, bottom = 20;
  const s = Math.min((w - left - right) / (x1 - x0), (h - top - bottom) / (y1 - y0));
  c.ds.scale = s;
  c.ds.offset = [left / s - x0, top / s - y0];
  c.setDirty(true, true);
  c.draw(true, true);
  return [x0, y0, x1, y1, s];
}
"""


def main() -> int:
    from playwright.sync_api import sync_playwright

    path, reason = comfyui_path()
    if path is None:
        raise SystemExit(reason)
    chromium = os.environ.get("CHROMIUM", "/usr/bin/chromium")
    OUT.mkdir(parents=True, exist_ok=True)
    server = ComfyServer(path, python=os.environ.get("COMFY_PYTHON", sys.executable), test_nodes=False)
    from make_workflows import MODEL_URLS, SAVED_FP8

    for name, (folder, _) in {**MODEL_URLS, SAVED_FP8: ("diffusion_models", "")}.items():
        # Empty stand-ins so the loaders show their file names instead of "missing model" errors.
        (server.models_dir / folder).mkdir(parents=True, exist_ok=True)
        (server.models_dir / folder / name).touch()
    server.start()
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 2000, "height": 1100})
            page.goto(server.url)
            page.wait_for_function("window.app && window.app.graph && window.app.canvas", timeout=120_000)
            page.wait_for_timeout(3000)
            page.keyboard.press("Escape")  # first-run dialogs
            for wf in sorted((ROOT / "example_workflows").glob("*.json")):
                graph = json.loads(wf.read_text())
                width = max(n["pos"][0] + n["size"][0] for n in graph["nodes"]) - min(n["pos"][0] for n in graph["nodes"])
                height = max(n["pos"][1] + n["size"][1] for n in graph["nodes"]) - min(n["pos"][1] for n in graph["nodes"])
                scale = min(0.75, 3600 / (width + 200))  # the canvas draws text from ~0.6 up
                page.set_viewport_size({"width": int((width + 200) * scale) + 110,
                                        "height": int((height + 260) * scale) + 140})
                page.wait_for_timeout(500)
                box = page.evaluate(FIT_JS, graph)
                page.wait_for_timeout(1500)
                page.keyboard.press("Escape")
                page.mouse.move(2, 2)
                target = OUT / f"{wf.stem}.png"
                page.screenshot(path=str(target))
                print(f"wrote {target.relative_to(ROOT)} (bounds {box})")
                thumbnail(target, wf.with_suffix(".jpg"))
            browser.close()
    finally:
        server.stop()
    return 0


def thumbnail(png: Path, jpg: Path, width: int = 640) -> None:
    """The template browser's card image: ComfyUI's frontend asks for example_workflows/<name>.jpg."""
    try:
        from PIL import Image
    except ImportError:
        print(f"skipped {jpg.name}: Pillow is not installed (pip install pillow)")
        return
    with Image.open(png) as im:
        im = im.convert("RGB")
        im.thumbnail((width, width))
        im.save(jpg, "JPEG", quality=82, optimize=True)
    print(f"wrote {jpg.relative_to(ROOT)} ({jpg.stat().st_size // 1024} KiB)")


if __name__ == "__main__":
    raise SystemExit(main())
