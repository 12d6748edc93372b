"""`levers run` and the workflow conversion, without ComfyUI.

A fake ComfyUI on 127.0.0.1 (ThreadingHTTPServer) speaks the endpoints the client uses: /object_info,
/prompt, /history, /view, /interrupt and the /ws websocket (hand-rolled RFC 6455 frames), so the
whole CLI path runs for real, including its exit codes.
"""
from __future__ import annotations

import argparse
import base64
import copy
import hashlib
import json
import queue
import socket
import struct
import threading
import time
import urllib.parse
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from comfyui_levers.core import client as C

ROOT = Path(__file__).resolve().parent.parent
FIXTURE_OI = Path(__file__).resolve().parent / "fixtures" / "object_info_workflows.json"

# ---------------------------------------------------------------------------------------------
# A small /object_info in ComfyUI's own shapes (legacy list combos, V3 "COMBO" combos, a seed with
# control_after_generate, an image upload, a V3 dynamic combo and an autogrow input).
# ---------------------------------------------------------------------------------------------

MINI_OI = {
    "UNETLoader": {"input": {"required": {"unet_name": [["tiny.safetensors"]],
                                          "weight_dtype": [["default", "fp8_e4m3fn"]]}},
                   "input_order": {"required": ["unet_name", "weight_dtype"]},
                   "output": ["MODEL"], "output_name": ["MODEL"], "output_node": False},
    "LoadImage": {"input": {"required": {"image": [["a.png", "b.png"], {"image_upload": True}]}},
                  "output": ["IMAGE", "MASK"], "output_node": False},
    "EmptyLatent": {"input": {"required": {"width": ["INT", {"default": 64, "min": 16, "max": 4096}],
                                           "height": ["INT", {"default": 64, "min": 16, "max": 4096}]}},
                    "output": ["LATENT"], "output_node": False},
    "KSampler": {"input": {"required": {
        "model": ["MODEL", {}],
        "seed": ["INT", {"default": 0, "min": 0, "max": 2 ** 64 - 1, "control_after_generate": True}],
        "steps": ["INT", {"default": 20, "min": 1, "max": 10000}],
        "cfg": ["FLOAT", {"default": 8.0, "min": 0.0, "max": 100.0}],
        "sampler_name": ["COMBO", {"options": ["euler", "dpmpp_2m"]}],
        "latent_image": ["LATENT", {}],
        "denoise": ["FLOAT", {"default": 1.0, "min": 0.0, "max": 1.0}]}},
        "input_order": {"required": ["model", "seed", "steps", "cfg", "sampler_name", "latent_image", "denoise"]},
        "output": ["LATENT"], "output_node": False},
    "ModelPatch": {"input": {"required": {"model": ["MODEL", {}], "strength": ["FLOAT", {"default": 1.0}]}},
                   "output": ["MODEL"], "output_node": False},
    "SaveLatent": {"input": {"required": {"samples": ["LATENT", {}],
                                          "filename_prefix": ["STRING", {"default": "latents/x"}]},
                             "hidden": {"prompt": "PROMPT"}},
                   "output": [], "output_node": True},
    "SaveVideo": {"input": {"required": {
        "video": ["IMAGE", {}],
        "format": ["COMFY_DYNAMICCOMBO_V3", {"options": [
            {"key": "auto", "inputs": {"required": {}}},
            {"key": "mp4", "inputs": {"required": {"crf": ["FLOAT", {"default": 23.0, "min": 0, "max": 51}]}}}]}],
        "fps": ["FLOAT", {"default": 24.0}]}},
        "input_order": {"required": ["video", "format", "fps"]}, "output": [], "output_node": True},
    "Batch": {"input": {"required": {"images": ["COMFY_AUTOGROW_V3", {"template": {
        "input": {"required": {"image": ["IMAGE", {}]}}, "prefix": "image", "min": 1, "max": 5}}]}},
        "output": ["IMAGE"], "output_node": False},
    "LeversRecommend": {"input": {"required": {"width": ["INT", {"default": 1024, "min": 64, "max": 8192}]},
                                  "optional": {"model": ["MODEL", {}]}},
                        "output": ["LEVERS_PLAN", "STRING"], "output_node": True},
}


def _node(id_, type_, inputs=(), outputs=(), widgets=None, mode=0, title=None):
    node = {"id": id_, "type": type_, "pos": [0, 0], "size": [300, 100], "flags": {}, "order": 0,
            "mode": mode, "inputs": list(inputs), "outputs": list(outputs), "properties": {}}
    if widgets is not None:
        node["widgets_values"] = widgets
    if title:
        node["title"] = title
    return node


def _ui_graph():
    """Loader -> Reroute -> (bypassed ModelPatch) -> KSampler -> SaveLatent, a PrimitiveNode feeding
    steps, a muted extra SaveLatent, a Note, and a LoadImage with its upload-button value."""
    links = [
        [1, 1, 0, 2, 0, "MODEL"],      # UNETLoader -> Reroute
        [2, 2, 0, 3, 0, "MODEL"],      # Reroute -> ModelPatch (bypassed)
        [3, 3, 0, 4, 0, "MODEL"],      # ModelPatch -> KSampler.model
        [4, 5, 0, 4, 5, "LATENT"],     # EmptyLatent -> KSampler.latent_image
        [5, 6, 0, 4, 2, "INT"],        # PrimitiveNode -> KSampler.steps (converted widget)
        [6, 4, 0, 7, 0, "LATENT"],     # KSampler -> SaveLatent
        [7, 4, 0, 8, 0, "LATENT"],     # KSampler -> muted SaveLatent
    ]
    nodes = [
        _node(1, "UNETLoader", outputs=[{"name": "MODEL", "type": "MODEL", "links": [1], "slot_index": 0}],
              widgets=["tiny.safetensors", "default"]),
        _node(2, "Reroute", inputs=[{"name": "", "type": "*", "link": 1}],
              outputs=[{"name": "", "type": "MODEL", "links": [2]}]),
        _node(3, "ModelPatch", mode=C.MODE_BYPASS, inputs=[{"name": "model", "type": "MODEL", "link": 2}],
              outputs=[{"name": "MODEL", "type": "MODEL", "links": [3]}], widgets=[0.5]),
        _node(4, "KSampler", title="Sampler", inputs=[
            {"name": "model", "type": "MODEL", "link": 3},
            {"name": "latent_image", "type": "LATENT", "link": 4},
            {"name": "steps", "type": "INT", "link": 5, "widget": {"name": "steps"}}],
            outputs=[{"name": "LATENT", "type": "LATENT", "links": [6, 7]}],
            widgets=[42, "randomize", 20, 3.5, "euler", 0.75]),
        _node(5, "EmptyLatent", outputs=[{"name": "LATENT", "type": "LATENT", "links": [4]}], widgets=[128, 96]),
        _node(6, "PrimitiveNode", outputs=[{"name": "INT", "type": "INT", "links": [5],
                                            "widget": {"name": "steps"}}], widgets=[7, "fixed"]),
        _node(7, "SaveLatent", inputs=[{"name": "samples", "type": "LATENT", "link": 6}], widgets=["latents/out"]),
        _node(8, "SaveLatent", mode=C.MODE_NEVER, inputs=[{"name": "samples", "type": "LATENT", "link": 7}],
              widgets=["latents/muted"]),
        _node(9, "Note", widgets=["explains the plan"]),
        _node(10, "LoadImage", outputs=[{"name": "IMAGE", "type": "IMAGE", "links": []}], widgets=["b.png", "image"]),
    ]
    return {"last_node_id": 10, "last_link_id": 7, "nodes": nodes, "links": links, "groups": [],
            "config": {}, "extra": {}, "version": 0.4}


# ---------------------------------------------------------------------------------------------
# UI -> API
# ---------------------------------------------------------------------------------------------

def test_ui_to_api_maps_widgets_links_and_frontend_only_nodes():
    api = C.ui_to_api(_ui_graph(), MINI_OI)
    assert set(api) == {"1", "4", "5", "7", "10"}  # no Reroute/Primitive/Note/bypassed/muted nodes
    assert api["1"]["inputs"] == {"unet_name": "tiny.safetensors", "weight_dtype": "default"}
    sampler = api["4"]
    assert sampler["class_type"] == "KSampler" and sampler["_meta"]["title"] == "Sampler"
    # seed's "randomize" control value is skipped; steps comes from the PrimitiveNode, not the stale 20
    assert sampler["inputs"] == {"model": ["1", 0], "seed": 42, "steps": 7, "cfg": 3.5, "sampler_name": "euler",
                                 "latent_image": ["5", 0], "denoise": 0.75}
    assert api["5"]["inputs"] == {"width": 128, "height": 96}
    assert api["7"]["inputs"] == {"samples": ["4", 0], "filename_prefix": "latents/out"}
    assert api["10"]["inputs"] == {"image": "b.png"}  # the upload button's "image" value is not an input
    assert C.validate_api(api, MINI_OI) == []


def test_ui_to_api_takes_node_ids_saved_as_strings():
    """A hand-edited file with "id": "5" while its links name 5: the same node (it was "not in the workflow")."""
    ui = _ui_graph()
    for n in ui["nodes"]:
        n["id"] = str(n["id"])
    assert C.ui_to_api(ui, MINI_OI) == C.ui_to_api(_ui_graph(), MINI_OI)


def test_ui_to_api_accepts_object_links_and_dict_widget_values():
    ui = _ui_graph()
    ui["links"] = [dict(zip(("id", "origin_id", "origin_slot", "target_id", "target_slot", "type"), link))
                   for link in ui["links"]]
    ui["nodes"][4]["widgets_values"] = {"width": 256, "height": 64}
    api = C.ui_to_api(ui, MINI_OI)
    assert api["5"]["inputs"] == {"width": 256, "height": 64}
    assert api["4"]["inputs"]["model"] == ["1", 0]


def test_ui_to_api_expands_dynamic_combo_and_autogrow():
    ui = {"nodes": [
        _node(1, "LoadImage", outputs=[{"name": "IMAGE", "type": "IMAGE", "links": [1, 2]}], widgets=["a.png"]),
        _node(2, "Batch", inputs=[{"name": "images.image0", "type": "IMAGE", "link": 1},
                                  {"name": "images.image1", "type": "IMAGE", "link": 2},
                                  {"name": "images.image2", "type": "IMAGE", "link": None}],
              outputs=[{"name": "IMAGE", "type": "IMAGE", "links": [3]}]),
        _node(3, "SaveVideo", inputs=[{"name": "video", "type": "IMAGE", "link": 3}], widgets=["mp4", 18.0, 12.0]),
    ], "links": [[1, 1, 0, 2, 0, "IMAGE"], [2, 1, 0, 2, 1, "IMAGE"], [3, 2, 0, 3, 0, "IMAGE"]]}
    api = C.ui_to_api(ui, MINI_OI)
    assert api["2"]["inputs"] == {"images.image0": ["1", 0], "images.image1": ["1", 0]}
    assert api["3"]["inputs"] == {"video": ["2", 0], "format": "mp4", "format.crf": 18.0, "fps": 12.0}
    assert C.validate_api(api, MINI_OI) == []
    api["3"]["inputs"]["format.crf"] = 99.0
    assert any("format.crf" in p and "maximum" in p for p in C.validate_api(api, MINI_OI))


def test_ui_to_api_reports_uninstalled_nodes_and_subgraphs():
    ui = _ui_graph()
    ui["nodes"][0]["type"] = "SomeCustomLoader"
    ui["definitions"] = {"subgraphs": [{"id": "abc-123"}]}
    ui["nodes"].append(_node(11, "abc-123", inputs=[{"name": "x", "type": "LATENT", "link": None}]))
    with pytest.raises(C.WorkflowError) as err:
        C.ui_to_api(ui, MINI_OI)
    text = str(err.value)
    assert "SomeCustomLoader" in text and "not installed" in text
    assert "subgraph" in text


def test_ui_to_api_names_a_legacy_group_node_and_how_to_convert_it():
    """Found in review: a legacy group node (type ``workflow>NAME``, defined in ``extra.groupNodes``) was reported as
    a node pack to install."""
    ui = _ui_graph()
    ui["extra"] = {"groupNodes": {"ImageThenInvert": {"nodes": []}}}
    ui["nodes"].append(_node(11, "workflow>ImageThenInvert", inputs=[{"name": "x", "type": "LATENT", "link": None}]))
    with pytest.raises(C.WorkflowError) as err:
        C.ui_to_api(ui, MINI_OI)
    text = str(err.value)
    assert "is a group node" in text and "Convert to nodes" in text and "not installed" not in text, text


def test_uploads_join_the_choices_of_both_combo_forms():
    """Found in review: an uploaded file joined only old-style list combos; ComfyUI 0.33's V3 combos (LoadAudio,
    LoadVideo, LoadImageOutput: ["COMBO", {"options": [...]}]) refused it as a file the server does not have."""
    info = {"LoadImage": MINI_OI["LoadImage"],
            "LoadAudio": {"input": {"required": {"audio": ["COMBO", {"options": ["a.wav"], "audio_upload": True}]}}}}
    out = C.with_uploads(info, [C.parse_set("LoadAudio.audio=/tmp/x/clip.wav"), C.parse_set("LoadImage.image=/y/c.png")])
    assert out["LoadAudio"]["input"]["required"]["audio"][1]["options"] == ["a.wav", "clip.wav"]
    assert out["LoadImage"]["input"]["required"]["image"][0] == ["a.png", "b.png", "c.png"]
    assert info["LoadAudio"]["input"]["required"]["audio"][1]["options"] == ["a.wav"]      # the input is untouched


# ---------------------------------------------------------------------------------------------
# validate_api
# ---------------------------------------------------------------------------------------------

def _valid_api():
    return {"1": {"class_type": "UNETLoader", "inputs": {"unet_name": "tiny.safetensors", "weight_dtype": "default"}},
            "2": {"class_type": "EmptyLatent", "inputs": {"width": 64, "height": 64}},
            "3": {"class_type": "KSampler", "inputs": {"model": ["1", 0], "seed": 1, "steps": 2, "cfg": 1.0,
                                                       "sampler_name": "euler", "latent_image": ["2", 0],
                                                       "denoise": 1.0}, "_meta": {"title": "Sampler"}},
            "4": {"class_type": "SaveLatent", "inputs": {"samples": ["3", 0], "filename_prefix": "x"}}}


@pytest.mark.parametrize("mutate, expected", [
    (lambda a: a["3"].__setitem__("class_type", "Nope"), "not installed"),
    (lambda a: a["3"]["inputs"].pop("steps"), "required input 'steps'"),
    (lambda a: a["3"]["inputs"].__setitem__("steps", "many"), "expects an integer"),
    (lambda a: a["3"]["inputs"].__setitem__("steps", "2.5"), "expects an integer"),
    (lambda a: a["3"]["inputs"].__setitem__("cfg", "x"), "expects a number"),
    (lambda a: a["3"]["inputs"].__setitem__("steps", {"__value__": 0}), "below its minimum 1"),
    (lambda a: a["3"]["inputs"].__setitem__("denoise", 1.5), "above its maximum 1.0"),
    (lambda a: a["3"]["inputs"].__setitem__("sampler_name", "eulr"), "not one of: 'euler'"),
    (lambda a: a["1"]["inputs"].__setitem__("unet_name", "flux1-dev.safetensors"), "file missing"),
    (lambda a: a["3"]["inputs"].__setitem__("model", ["9", 0]), "not in the prompt"),
    (lambda a: a["3"]["inputs"].__setitem__("model", ["1", 3]), "has 1 output"),
    (lambda a: a["3"]["inputs"].__setitem__("model", ["2", 0]), "expects MODEL but node 2 (EmptyLatent) output 0 is LATENT"),
    (lambda a: a["3"]["inputs"].__setitem__("model", "tiny.safetensors"), "takes a link"),
    (lambda a: a.pop("4"), "no output node"),
    (lambda a: a.__setitem__("1", "x"), "node 1: not a node (no class_type)"),      # linked to: no crash
])
def test_validate_api_reports_each_kind_of_problem(mutate, expected):
    api = _valid_api()
    assert C.validate_api(api, MINI_OI) == []
    mutate(api)
    problems = C.validate_api(api, MINI_OI)
    assert any(expected in p for p in problems), problems


def test_validate_api_accepts_what_comfyui_accepts():
    """Found in review: the local check refused prompts the real ComfyUI 0.33 accepted and ran (200): a stray node
    no output needs (a leftover loader), an input the node does not declare (ui_to_api itself keeps those), a value
    ComfyUI converts (int(64.5), a number for a string, a __value__ wrapper)."""
    api = _valid_api()
    api["9"] = {"class_type": "KSampler", "inputs": {"model": ["1", 0]}}          # stray, incomplete, not needed
    api["3"]["inputs"]["stepz"] = 3                                               # undeclared: ignored
    api["2"]["inputs"]["width"] = 64.5
    api["4"]["inputs"]["filename_prefix"] = 7
    api["3"]["inputs"]["cfg"] = {"__value__": 2.0}
    assert C.validate_api(api, MINI_OI) == []
    api["9"]["class_type"] = "Nope"                                              # every node's type is checked
    assert any("not installed" in p for p in C.validate_api(api, MINI_OI))


def test_a_missing_input_image_points_at_comfyuis_input_folder():
    """A LoadImage file the server does not list lives in ComfyUI's input/ folder, not a models folder (headless
    edit workflows name their source image); the hint said "no model file of that kind installed?"."""
    api = {"1": {"class_type": "LoadImage", "inputs": {"image": "cat.png"}},
           "2": {"class_type": "SaveLatent", "inputs": {"samples": ["1", 0], "filename_prefix": "x"}}}
    problems = C.validate_api(api, MINI_OI)
    assert any("'cat.png': the server's input/ folder has no such file" in p and "input/ folder" in p
               for p in problems), problems
    assert not any("model" in p for p in problems if "cat.png" in p), problems


def test_validate_api_can_allow_missing_model_files_only():
    api = _valid_api()
    api["1"]["inputs"]["unet_name"] = "flux1-dev.safetensors"
    assert C.validate_api(api, MINI_OI, allow_missing_files=True) == []
    api["3"]["inputs"]["sampler_name"] = "eulr"
    assert len(C.validate_api(api, MINI_OI, allow_missing_files=True)) == 1


def test_validate_api_accepts_strings_comfyui_would_convert_and_any_type():
    api = _valid_api()
    api["3"]["inputs"]["steps"] = "4"
    oi = copy.deepcopy(MINI_OI)
    oi["ModelPatch"]["input"]["required"]["model"] = ["*", {}]
    api["5"] = {"class_type": "ModelPatch", "inputs": {"model": ["2", 0], "strength": 1}}
    assert C.validate_api(api, oi) == []


# ---------------------------------------------------------------------------------------------
# --set
# ---------------------------------------------------------------------------------------------

def test_parse_set_splits_on_last_dot_before_first_equals():
    a = C.parse_set("My.Sampler.steps=a=b")
    assert (a.node, a.input, a.raw) == ("My.Sampler", "steps", "a=b")
    for bad in ("steps=3", "3.steps", ".steps=3", "3.=4"):
        with pytest.raises(C.WorkflowError, match="NODE.INPUT=VALUE"):
            C.parse_set(bad)


def test_apply_sets_coerces_by_input_type_and_finds_nodes_by_id_title_or_class():
    api = _valid_api()
    sets = [C.parse_set(s) for s in ("3.seed=18446744073709551615", "Sampler.cfg=2.5", "sampler.sampler_name=dpmpp_2m",
                                     "SaveLatent.filename_prefix=007", "EmptyLatent.width=128.0")]
    out = C.apply_sets(api, sets, MINI_OI)
    assert out["3"]["inputs"]["seed"] == 2 ** 64 - 1 and isinstance(out["3"]["inputs"]["seed"], int)
    assert out["3"]["inputs"]["cfg"] == 2.5
    assert out["3"]["inputs"]["sampler_name"] == "dpmpp_2m"
    assert out["4"]["inputs"]["filename_prefix"] == "007"  # STRING stays text
    assert out["2"]["inputs"]["width"] == 128 and isinstance(out["2"]["inputs"]["width"], int)
    assert api["3"]["inputs"]["seed"] == 1  # the input prompt is not modified


@pytest.mark.parametrize("text, expected", [
    ("9.steps=3", "no node '9'"),
    ("3.stepz=3", "has no input 'stepz'"),
    ("3.model=1", "link input"),
    ("3.steps=lots", "expects an integer"),
    ("3.steps=0", "below its minimum 1"),
    ("3.sampler_name=eulr", "not one of"),
    ("3.denoise=x", "expects a number"),
])
def test_apply_sets_rejects_bad_targets_and_values(text, expected):
    with pytest.raises(C.WorkflowError, match=expected):
        C.apply_sets(_valid_api(), [C.parse_set(text)], MINI_OI)


def test_apply_sets_refuses_ambiguous_titles():
    api = _valid_api()
    api["5"] = copy.deepcopy(api["4"])
    with pytest.raises(C.WorkflowError, match="matches nodes 4, 5"):
        C.apply_sets(api, [C.parse_set("SaveLatent.filename_prefix=y")], MINI_OI)


# ---------------------------------------------------------------------------------------------
# The websocket framing, over a socket pair
# ---------------------------------------------------------------------------------------------

def _frame(opcode, payload: bytes, fin=True) -> bytes:
    n = len(payload)
    head = bytes([(0x80 if fin else 0) | opcode])
    if n < 126:
        head += bytes([n])
    elif n < 65536:
        head += bytes([126]) + struct.pack(">H", n)
    else:
        head += bytes([127]) + struct.pack(">Q", n)
    return head + payload


def _unmask_client_frame(data: bytes) -> tuple[int, bytes]:
    assert data[1] & 0x80, "client frames must be masked"
    n = data[1] & 0x7F
    mask, body = data[2:6], data[6:6 + n]
    return data[0] & 0x0F, bytes(b ^ mask[i % 4] for i, b in enumerate(body))


def test_websocket_reassembles_fragments_answers_pings_and_reads_long_frames():
    a, b = socket.socketpair()
    ws = C.WebSocket(a)
    big = json.dumps({"type": "x", "data": "y" * 70000}).encode()
    b.sendall(_frame(0x1, b'{"type": "par', fin=False) + _frame(0x9, b"hi") + _frame(0x0, b't"}')
              + _frame(0x2, b"\x00\x01binary") + _frame(0x1, big))
    assert ws.recv(timeout=2) == (0x1, b'{"type": "part"}')
    assert _unmask_client_frame(b.recv(100)) == (0xA, b"hi")  # pong echoes the ping
    assert ws.recv(timeout=2) == (0x2, b"\x00\x01binary")
    assert ws.recv(timeout=2) == (0x1, big)
    assert ws.recv(timeout=0.05) is None  # timeout, nothing pending
    b.sendall(_frame(0x8, b""))
    with pytest.raises(C.WebSocketClosed):
        ws.recv(timeout=2)
    a.close()
    b.close()


# ---------------------------------------------------------------------------------------------
# A fake ComfyUI for end-to-end `levers run`
# ---------------------------------------------------------------------------------------------

class FakeComfy:
    """Scripted ComfyUI: behaviour per test via ``mode`` ("ok", "error", "reject", "hang": queued and never started,
    "busy": started and never ending)."""

    def __init__(self, object_info, websocket=True):
        self.object_info = object_info
        self.websocket = websocket
        self.mode = "ok"
        # ComfyUI's answer when only some outputs fail its validation: 200 + these node_errors, and it runs
        # the prompt without the failing nodes and the outputs that depend on them.
        self.node_errors: dict = {}
        self.prompts: list[dict] = []
        self.history: dict[str, dict] = {}
        self.files: dict[tuple, bytes] = {}
        self.interrupts: list[dict] = []
        self.uploads: list[tuple[str, bytes, str]] = []     # (name filed, content, type) per POST /upload/image
        self.taken: set[str] = set()        # input/ files already there with other content
        self.deletes: list[dict] = []       # POST /queue bodies
        self.pending: list[str] = []        # prompts queued and not started ("hang" mode)
        self.running: list[str] = []        # prompts started and not ended ("busy" mode)
        self.start_on_delete = False        # a pending prompt starts just before a POST /queue delete arrives
        self.unavailable: set[str] = set()  # file names /view answers 404 for
        self.clients: dict[str, queue.Queue] = {}
        self.ws_connected = threading.Event()
        self.register_delay = 0.0     # seconds between the handshake and filing the socket (ComfyUI has a gap too)
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        for q in self.clients.values():
            q.put(None)
        self.server.shutdown()
        self.server.server_close()

    def send(self, client_id, kind, data):
        q = self.clients.get(client_id)
        if q is not None:
            q.put(("text", json.dumps({"type": kind, "data": data}).encode()))

    def execute(self, prompt_id, prompt, client_id):
        """Run the prompt the way ComfyUI reports it: messages first, history slightly later."""
        self.send(client_id, "execution_start", {"prompt_id": prompt_id})
        ids = sorted(prompt, key=int)
        self.send(client_id, "execution_cached", {"nodes": ids[:1], "prompt_id": prompt_id})
        q = self.clients.get(client_id)
        if q is not None:
            q.put(("ping", b"keepalive"))
            q.put(("binary", b"\x00\x00\x00\x01preview-bytes"))
        outputs, messages = {}, [["execution_start", {"prompt_id": prompt_id}]]
        for node_id in ids[1:]:
            node = prompt[node_id]
            self.send(client_id, "executing", {"node": node_id, "display_node": node_id, "prompt_id": prompt_id})
            if node["class_type"] == "KSampler":
                for step in range(1, 5):
                    self.send(client_id, "progress", {"value": step, "max": 4, "node": node_id,
                                                      "prompt_id": prompt_id})
                if self.mode == "error":
                    err = {"prompt_id": prompt_id, "node_id": node_id, "node_type": "KSampler",
                           "exception_type": "torch.OutOfMemoryError",
                           "exception_message": "CUDA out of memory. Tried to allocate 2.00 GiB",
                           "traceback": ["Traceback...\n", "  File x\n", "torch.OutOfMemoryError: CUDA out of memory\n"]}
                    messages.append(["execution_error", err])
                    self.send(client_id, "execution_error", err)
                    self.history[prompt_id] = {"prompt": [0, prompt_id, prompt, {}, []], "outputs": outputs,
                                               "status": {"status_str": "error", "completed": False,
                                                          "messages": messages}}
                    return
            if node["class_type"] == "SaveLatent":
                name = f"{node['inputs']['filename_prefix']}_00001_.latent"
                sub, _, base = name.rpartition("/")
                self.files[(base, sub, "output")] = b"LATENT:" + name.encode()
                ui = {"latents": [{"filename": base, "subfolder": sub, "type": "output"}]}
                outputs[node_id] = ui
                self.send(client_id, "executed", {"node": node_id, "output": ui, "prompt_id": prompt_id})
            if node["class_type"] == "LeversRecommend":
                ui = {"text": ["Plan: fp8 weights, phase offload; peak 11.2 GiB of 16 GiB"]}
                outputs[node_id] = ui
                self.send(client_id, "executed", {"node": node_id, "output": ui, "prompt_id": prompt_id})
        messages.append(["execution_success", {"prompt_id": prompt_id}])
        self.send(client_id, "execution_success", {"prompt_id": prompt_id})
        self.send(client_id, "executing", {"node": None, "prompt_id": prompt_id})
        # ComfyUI files the history entry after the messages went out.
        threading.Timer(0.2, lambda: self.history.__setitem__(prompt_id, {
            "prompt": [0, prompt_id, prompt, {}, []], "outputs": outputs,
            "status": {"status_str": "success", "completed": True, "messages": messages}})).start()

    def _handler(self):
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _json(self, obj, status=200):
                body = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                url = urllib.parse.urlsplit(self.path)
                query = urllib.parse.parse_qs(url.query)
                if url.path == "/object_info":
                    return self._json(fake.object_info)
                if url.path == "/queue":
                    return self._json({"queue_running": [[0, pid, {}, {}, []] for pid in fake.running],
                                       "queue_pending": [[i, pid, {}, {}, []] for i, pid in enumerate(fake.pending)]})
                if url.path.startswith("/history/"):
                    pid = url.path.rsplit("/", 1)[1]
                    return self._json({pid: fake.history[pid]} if pid in fake.history else {})
                if url.path == "/view":
                    key = (query["filename"][0], query.get("subfolder", [""])[0], query["type"][0])
                    if key not in fake.files or key[0] in fake.unavailable:
                        return self._json({"error": "no such file"}, 404)
                    body = fake.files[key]
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return None
                if url.path == "/ws" and fake.websocket:
                    return self._websocket(query["clientId"][0])
                return self._json({"error": "not found"}, 404)

            def _websocket(self, client_id):
                key = self.headers["Sec-WebSocket-Key"]
                accept = base64.b64encode(hashlib.sha1((key + "258EAFA5-E914-47DA-95CA-C5AB0DC85B11")
                                                       .encode()).digest()).decode()
                self.send_response(101)
                self.send_header("Upgrade", "websocket")
                self.send_header("Connection", "Upgrade")
                self.send_header("Sec-WebSocket-Accept", accept)
                self.end_headers()
                self.wfile.flush()
                time.sleep(fake.register_delay)
                q = fake.clients.setdefault(client_id, queue.Queue())
                q.put(("text", json.dumps({"type": "status", "data": {"sid": client_id}}).encode()))
                fake.ws_connected.set()
                while True:
                    item = q.get()
                    if item is None:
                        return
                    kind, payload = item
                    opcode = {"text": 0x1, "binary": 0x2, "ping": 0x9}[kind]
                    try:
                        self.wfile.write(_frame(opcode, payload))
                        self.wfile.flush()
                    except OSError:
                        return

            def do_POST(self):
                length = int(self.headers.get("Content-Length", 0))
                if self.path == "/upload/image":      # multipart, as ComfyUI's page sends it
                    import email.parser
                    import email.policy

                    msg = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
                        f"Content-Type: {self.headers['Content-Type']}\r\n\r\n".encode() + self.rfile.read(length))
                    fields = {part.get_param("name", header="content-disposition"): part for part in msg.iter_parts()}
                    image = fields["image"]
                    name = image.get_filename()
                    if name in fake.taken:            # a different file of that name: ComfyUI numbers the new one
                        name = name.replace(".", " (1).", 1)
                    fake.uploads.append((name, image.get_payload(decode=True),
                                         fields["type"].get_payload(decode=True).decode()))
                    return self._json({"name": name, "subfolder": "", "type": "input"})
                body = json.loads(self.rfile.read(length) or b"{}")
                if self.path == "/interrupt":
                    fake.interrupts.append(body)
                    return self._json({})
                if self.path == "/queue":
                    if fake.start_on_delete:
                        fake.running += fake.pending
                        fake.pending = []
                    fake.deletes.append(body)
                    fake.pending = [p for p in fake.pending if p not in body.get("delete", [])]
                    return self._json({})
                if self.path != "/prompt":
                    return self._json({"error": "not found"}, 404)
                fake.prompts.append(body)
                if fake.mode == "reject":
                    return self._json({"error": {"type": "prompt_outputs_failed_validation",
                                                 "message": "Prompt outputs failed validation", "details": ""},
                                       "node_errors": {"1": {"errors": [{
                                           "type": "value_not_in_list", "message": "Value not in list",
                                           "details": "unet_name: 'tiny.safetensors' not in []"}],
                                           "class_type": "UNETLoader"}}}, 400)
                pid = body.get("prompt_id") or str(uuid.uuid4())     # ComfyUI takes a client's id
                skipped = set(fake.node_errors) | {o for e in fake.node_errors.values()
                                                   for o in e.get("dependent_outputs", [])}
                runnable = {k: v for k, v in body["prompt"].items() if k not in skipped}
                if fake.mode == "hang":
                    fake.pending.append(pid)
                elif fake.mode == "busy":
                    fake.running.append(pid)
                else:
                    threading.Thread(target=fake.execute, args=(pid, runnable, body.get("client_id")),
                                     daemon=True).start()
                return self._json({"prompt_id": pid, "number": len(fake.prompts), "node_errors": fake.node_errors})

        return Handler


def _cli(argv) -> int:
    parser = argparse.ArgumentParser(prog="levers")
    C.register_cli(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return args.func(args)


@pytest.fixture
def api_file(tmp_path):
    api = _valid_api()
    api["5"] = {"class_type": "LeversRecommend", "inputs": {"width": 1024, "model": ["1", 0]},
                "_meta": {"title": "Recommend"}}
    path = tmp_path / "wf_api.json"
    path.write_text(json.dumps(api))
    return path


def test_progress_is_not_lost_when_the_server_files_the_socket_after_the_handshake(api_file, tmp_path, capsys):
    """ComfyUI answers the websocket handshake, then files the socket under the client id and sends ``status``.
    A prompt submitted in that gap had its progress sent to nobody (seen once on a loaded CI box); the client
    now waits for that first message before it submits."""
    with FakeComfy(MINI_OI) as fake:
        fake.register_delay = 0.5
        rc = _cli(["run", str(api_file), "--server", fake.url, "--out", str(tmp_path / "out")])
    assert rc == C.EXIT_OK
    err = capsys.readouterr().err
    assert "#3 Sampler" in err and "4/4 100%" in err


def test_levers_run_success_streams_progress_downloads_outputs_and_prints_reports(api_file, tmp_path, capsys):
    out = tmp_path / "out"
    with FakeComfy(MINI_OI) as fake:
        rc = _cli(["run", str(api_file), "--server", fake.url, "--out", str(out), "--set", "Sampler.steps=3",
                   "--set", "4.filename_prefix=latents/run"])
    assert rc == C.EXIT_OK
    captured = capsys.readouterr()
    assert fake.prompts[0]["prompt"]["3"]["inputs"]["steps"] == 3
    assert fake.prompts[0]["client_id"]  # progress is routed to this client
    assert (out / "latents" / "run_00001_.latent").read_bytes() == b"LATENT:latents/run_00001_.latent"
    assert "#3 Sampler" in captured.err and "4/4 100%" in captured.err
    assert "cached: 1 node(s)" in captured.err
    assert "Levers report: #5 Recommend" in captured.out and "peak 11.2 GiB" in captured.out


def test_levers_run_converts_ui_workflows_with_the_servers_object_info(tmp_path, capsys):
    path = tmp_path / "wf_ui.json"
    path.write_text(json.dumps(_ui_graph()))
    with FakeComfy(MINI_OI) as fake:
        rc = _cli(["run", str(path), "--server", fake.url, "--out", str(tmp_path / "o"), "--quiet"])
    assert rc == C.EXIT_OK, capsys.readouterr().err
    sent = fake.prompts[0]["prompt"]
    assert sent == C.ui_to_api(_ui_graph(), MINI_OI)
    assert sent["4"]["inputs"]["steps"] == 7


def test_levers_run_falls_back_to_polling_history_without_websocket(api_file, tmp_path, capsys):
    with FakeComfy(MINI_OI, websocket=False) as fake:
        rc = _cli(["run", str(api_file), "--server", fake.url, "--out", str(tmp_path / "o"), "--json"])
    assert rc == C.EXIT_OK
    summary = json.loads(capsys.readouterr().out)
    assert summary["status"] == "success" and len(summary["files"]) == 1
    assert list(summary["reports"]) == ["#5 Recommend"]


def test_levers_run_exits_1_with_comfyuis_execution_error(api_file, tmp_path, capsys):
    with FakeComfy(MINI_OI) as fake:
        fake.mode = "error"
        rc = _cli(["run", str(api_file), "--server", fake.url, "--out", str(tmp_path / "o")])
    assert rc == C.EXIT_FAILED
    err = capsys.readouterr().err
    assert "execution failed at node 3 (KSampler)" in err
    assert "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB" in err


def test_levers_run_exits_1_with_the_servers_validation_errors(api_file, capsys):
    with FakeComfy(MINI_OI) as fake:
        fake.mode = "reject"
        rc = _cli(["run", str(api_file), "--server", fake.url])
    assert rc == C.EXIT_FAILED
    err = capsys.readouterr().err
    assert "Prompt outputs failed validation" in err
    assert "node 1 (UNETLoader): Value not in list: unet_name" in err


def test_levers_run_rejects_invalid_workflows_before_submitting(api_file, tmp_path, capsys):
    bad = json.loads(api_file.read_text())
    bad["3"]["inputs"]["sampler_name"] = "eulr"
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(bad))
    with FakeComfy(MINI_OI) as fake:
        assert _cli(["run", str(path), "--server", fake.url]) == C.EXIT_INVALID
        assert _cli(["run", str(api_file), "--server", fake.url, "--set", "Sampler.stepz=3"]) == C.EXIT_INVALID
        assert _cli(["run", str(tmp_path / "missing.json"), "--server", fake.url]) == C.EXIT_INVALID
        (tmp_path / "broken.json").write_text("{not json")
        assert _cli(["run", str(tmp_path / "broken.json"), "--server", fake.url]) == C.EXIT_INVALID
    assert fake.prompts == []  # nothing reached /prompt
    err = capsys.readouterr().err
    assert "'eulr' is not one of" in err and "has no input 'stepz'" in err and "not valid JSON" in err


def test_levers_run_reports_an_unreachable_server(api_file, capsys):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert _cli(["run", str(api_file), "--server", f"127.0.0.1:{port}"]) == C.EXIT_UNREACHABLE
    assert "cannot reach ComfyUI at http://127.0.0.1:" in capsys.readouterr().err


def test_levers_run_reports_what_needs_no_server_before_asking_it(api_file, tmp_path, capsys):
    """A malformed --set or an empty workflow is invalid input (exit 2) whether or not a server answers; both were
    reported as an unreachable server (exit 3) when none ran."""
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert _cli(["run", str(api_file), "--server", f"127.0.0.1:{port}", "--set", "bogus"]) == C.EXIT_INVALID
    (tmp_path / "empty.json").write_text("{}")
    assert _cli(["run", str(tmp_path / "empty.json"), "--server", f"127.0.0.1:{port}"]) == C.EXIT_INVALID
    err = capsys.readouterr().err
    assert "expected NODE.INPUT=VALUE" in err and "the prompt is empty" in err and "cannot reach" not in err


def test_levers_run_uploads_an_input_file_and_sets_the_node_to_the_name_comfyui_filed(tmp_path, capsys):
    """--input NODE.INPUT=FILE: the file reaches ComfyUI's input/ folder (POST /upload/image, as the page's upload
    button) once the prompt passed the checks, and the node takes the name ComfyUI filed it under."""
    api = {"1": {"class_type": "LoadImage", "inputs": {"image": "a.png"}},
           "2": {"class_type": "SaveLatent", "inputs": {"samples": ["3", 0], "filename_prefix": "x"}},
           "3": {"class_type": "EmptyLatent", "inputs": {"width": 64, "height": 64}}}
    wf = tmp_path / "edit.json"
    wf.write_text(json.dumps(api))
    photo = tmp_path / "cat.png"
    photo.write_bytes(b"\x89PNG fake bytes")
    with FakeComfy(MINI_OI) as fake:
        assert _cli(["run", str(wf), "--server", fake.url, "--out", str(tmp_path / "out"),
                     "--input", f"LoadImage.image={photo}"]) == C.EXIT_OK
        assert fake.uploads == [("cat.png", b"\x89PNG fake bytes", "input")]
        assert fake.prompts[-1]["prompt"]["1"]["inputs"]["image"] == "cat.png"
        fake.taken.add("cat.png")                    # another cat.png is there: ComfyUI files this one renamed
        assert _cli(["run", str(wf), "--server", fake.url, "--out", str(tmp_path / "out"),
                     "--input", f"1.image={photo}"]) == C.EXIT_OK
        assert fake.prompts[-1]["prompt"]["1"]["inputs"]["image"] == "cat (1).png"
        # a prompt that fails the checks uploads nothing; a dry run uploads nothing
        n = len(fake.uploads)
        assert _cli(["run", str(wf), "--server", fake.url, "--input", f"1.image={photo}",
                     "--set", "3.width=7"]) == C.EXIT_INVALID
        assert _cli(["run", str(wf), "--server", fake.url, "--input", f"1.image={photo}", "--dry-run"]) == C.EXIT_OK
        assert len(fake.uploads) == n
    # a file that is not there is bad input, before any server is asked
    assert _cli(["run", str(wf), "--server", "http://127.0.0.1:9", "--input",
                 f"LoadImage.image={tmp_path / 'dog.png'}"]) == C.EXIT_INVALID
    assert "dog.png is not a file here" in capsys.readouterr().err


def test_levers_run_times_out_with_exit_124(api_file, capsys):
    with FakeComfy(MINI_OI) as fake:
        fake.mode = "hang"
        rc = _cli(["run", str(api_file), "--server", fake.url, "--timeout", "0.5"])
    assert rc == C.EXIT_TIMEOUT
    assert "still running after 0.5 s" in capsys.readouterr().err


def test_levers_run_dry_run_prints_the_prompt_without_submitting(api_file, capsys):
    with FakeComfy(MINI_OI) as fake:
        rc = _cli(["run", str(api_file), "--server", fake.url, "--dry-run", "--set", "3.seed=5"])
    assert rc == C.EXIT_OK and fake.prompts == []
    assert json.loads(capsys.readouterr().out)["3"]["inputs"]["seed"] == 5


def test_a_dry_run_of_an_api_prompt_without_checks_needs_no_server(api_file, capsys):
    """Found in review: the README says --dry-run with --no-validate runs without the checks (before the model files
    are in place), yet it asked the server for its node list first and exited 3 with no ComfyUI running. An API
    prompt printed unchecked and unchanged needs no server; a UI file or a --set still does (they read its list)."""
    dead = "http://127.0.0.1:1"
    assert _cli(["run", str(api_file), "--server", dead, "--dry-run", "--no-validate"]) == C.EXIT_OK
    assert json.loads(capsys.readouterr().out) == C.normalize_links(json.loads(api_file.read_text()))
    assert _cli(["run", str(api_file), "--server", dead, "--dry-run", "--no-validate",
                 "--set", "3.seed=5"]) == C.EXIT_UNREACHABLE


# ---------------------------------------------------------------------------------------------
# The shipped example workflows
# ---------------------------------------------------------------------------------------------

def _shipped():
    return sorted((ROOT / "example_workflows").glob("*.json"))


def test_examples_are_shipped_in_both_formats():
    ui = {p.stem for p in _shipped()}
    api = {p.stem for p in (ROOT / "example_workflows" / "api").glob("*.json")}
    assert len(ui) >= 4 and ui == api
    # the template browser's card image for each (ComfyUI's frontend asks for <name>.jpg beside the workflow)
    assert ui == {p.stem for p in (ROOT / "example_workflows").glob("*.jpg")}


@pytest.mark.parametrize("path", _shipped(), ids=lambda p: p.stem)
def test_shipped_workflow_converts_to_its_shipped_api_form(path):
    """The UI graph and its API twin agree under the recorded /object_info, and validate."""
    object_info = json.loads(FIXTURE_OI.read_text())
    ui = json.loads(path.read_text())
    api = C.ui_to_api(ui, object_info)
    assert api == json.loads((path.parent / "api" / path.name).read_text())
    assert C.validate_api(api, object_info, allow_missing_files=True) == []
    notes = [n for n in ui["nodes"] if n["type"] in ("Note", "MarkdownNote")]
    assert notes and len(notes[0]["widgets_values"][0]) > 200  # the plan is explained on the graph
    assert any(n["type"].startswith("Levers") for n in ui["nodes"])


def test_collect_reports_reads_levers_ui_text_and_previews_wired_to_levers_nodes():
    api = {"5": {"class_type": "LeversRecommend", "inputs": {}, "_meta": {"title": "Plan"}},
           "6": {"class_type": "PreviewAny", "inputs": {"source": ["5", 1]}},
           "7": {"class_type": "PreviewAny", "inputs": {"source": ["1", 0]}},
           "1": {"class_type": "UNETLoader", "inputs": {}}}
    outputs = {"5": {"text": ["plan text"]}, "6": {"text": ["plan text", "more"]}, "7": {"text": ["not levers"]},
               "1": {"text": ["loader"]}}
    assert C.collect_reports(api, outputs) == {"#5 Plan": ["plan text", "more"]}


def test_shipped_examples_resolve_by_name_and_unknown_names_list_them(tmp_path):
    assert C.resolve_workflow_path("sdxl_8gb") == ROOT / "example_workflows" / "api" / "sdxl_8gb.json"
    assert C.resolve_workflow_path("sdxl_8gb.json").name == "sdxl_8gb.json"
    own = tmp_path / "mine.json"
    own.write_text("{}")
    assert C.resolve_workflow_path(str(own)) == own
    with pytest.raises(C.WorkflowError, match="Shipped examples: .*flux1_dev_16gb"):
        C.resolve_workflow_path("nope")
    # found in review: a typo in the folder of the user's own copy ran the shipped example of the same name
    with pytest.raises(C.WorkflowError, match="not found"):
        C.resolve_workflow_path(str(tmp_path / "no_such_dir" / "sdxl_8gb.json"))


def test_set_reaches_inputs_whose_names_hold_dots():
    """V3 dynamic inputs are named ``format.crf``, ``images.image0``: --set splits NODE.INPUT at the dot that
    names a node with that input (it split at the last one: "no node '2.format'"); titles with dots work too."""
    api = {"1": {"class_type": "LoadImage", "inputs": {"image": "a.png"}, "_meta": {"title": "Load v1.2"}},
           "2": {"class_type": "SaveVideo", "inputs": {"video": ["1", 0], "format": "mp4", "format.crf": 23.0,
                                                      "fps": 24.0}, "_meta": {"title": "Save"}}}
    out = C.apply_sets(api, [C.parse_set("2.format.crf=30"), C.parse_set("Save.fps=12"),
                             C.parse_set("Load v1.2.image=a.png")], MINI_OI)
    assert out["2"]["inputs"]["format.crf"] == 30.0 and out["2"]["inputs"]["fps"] == 12.0
    with pytest.raises(C.WorkflowError, match=r"node 2 \(SaveVideo\) has no input 'format.crf2'"):
        C.apply_sets(api, [C.parse_set("2.format.crf2=30")], MINI_OI)


def test_downloads_never_leave_the_out_folder(tmp_path):
    """A subfolder the server names (absolute, or with ..) must not lead outside --out."""
    class Fake:
        def view(self, filename, subfolder, kind):
            return b"x"
    outside = tmp_path / "outside"
    outs = {"9": {"images": [{"filename": "a.png", "subfolder": str(outside), "type": "output"},
                             {"filename": "b.png", "subfolder": "../../etc", "type": "output"},
                             {"filename": "c.png", "subfolder": "runs/1", "type": "output"}]}}
    saved = C.download_outputs(Fake(), outs, str(tmp_path / "out"))
    root = (tmp_path / "out").resolve()
    assert len(saved) == 3 and all(Path(p).resolve().is_relative_to(root) for p in saved), saved
    assert (root / "runs" / "1" / "c.png").is_file() and not outside.exists()


def test_a_negative_timeout_is_refused():
    p = argparse.ArgumentParser()
    C.register_cli(p.add_subparsers())
    with pytest.raises(SystemExit):
        p.parse_args(["run", "wf.json", "--timeout", "-1"])
    assert p.parse_args(["run", "wf.json", "--timeout", "2.5"]).timeout == 2.5


# ---------------------------------------------------------------------------------------------
# Found in review: cycles, partial rejections, malformed input, bad --server / --out
# ---------------------------------------------------------------------------------------------

def _with_model_patches(links):
    """_valid_api() with ModelPatch nodes 5, 6 whose 'model' inputs link as given; KSampler reads node 6."""
    api = _valid_api()
    for node_id, source in links.items():
        api[node_id] = {"class_type": "ModelPatch", "inputs": {"model": [source, 0], "strength": 1.0}}
    api["3"]["inputs"]["model"] = ["6", 0]
    return api


def test_validate_api_names_the_nodes_of_a_dependency_cycle():
    """ComfyUI refuses a node that (indirectly) needs its own output; the local check passed it (exit 0)."""
    loop = C.validate_api(_with_model_patches({"5": "6", "6": "5"}), MINI_OI)
    assert len(loop) == 1 and "dependency cycle" in loop[0], loop
    assert "node 5 (ModelPatch) input 'model'" in loop[0] and "node 6 (ModelPatch) input 'model'" in loop[0]
    itself = C.validate_api(_with_model_patches({"6": "6"}), MINI_OI)
    assert itself == ["node 6 (ModelPatch): input 'model' links to the node's own output, a dependency cycle "
                      "ComfyUI refuses; link it to another node's output"]
    assert C.validate_api(_with_model_patches({"5": "1", "6": "5"}), MINI_OI) == []   # a chain is fine
    # Like ComfyUI, only what an output needs is walked: a loop nothing reads is not an error there.
    dangling = _with_model_patches({"5": "1", "6": "5"})
    dangling.update({"7": {"class_type": "ModelPatch", "inputs": {"model": ["8", 0], "strength": 1.0}},
                     "8": {"class_type": "ModelPatch", "inputs": {"model": ["7", 0], "strength": 1.0}}})
    assert C.validate_api(dangling, MINI_OI) == []


def test_levers_run_refuses_a_cyclic_prompt_before_submitting(tmp_path, capsys):
    path = tmp_path / "cycle.json"
    path.write_text(json.dumps(_with_model_patches({"5": "6", "6": "5"})))
    with FakeComfy(MINI_OI) as fake:
        assert _cli(["run", str(path), "--server", fake.url, "--dry-run"]) == C.EXIT_INVALID
        assert _cli(["run", str(path), "--server", fake.url, "--out", str(tmp_path / "o")]) == C.EXIT_INVALID
    assert fake.prompts == []
    assert "dependency cycle: node" in capsys.readouterr().err


def test_levers_run_exits_1_when_comfyui_skips_an_output_that_failed_its_validation(api_file, tmp_path, capsys):
    """ComfyUI answers 200 + prompt_id when at least one output is valid, lists the others in node_errors
    and runs without them; `levers run` printed "done" and exited 0 with the output missing."""
    out = tmp_path / "o"
    with FakeComfy(MINI_OI) as fake:
        fake.node_errors = {"5": {"errors": [{"type": "value_bigger_than_max", "message": "Value 9000 bigger than "
                                              "max of 8192", "details": "width"}],
                                  "dependent_outputs": ["5"], "class_type": "LeversRecommend"}}
        rc = _cli(["run", str(api_file), "--server", fake.url, "--out", str(out), "--json"])
    assert rc == C.EXIT_FAILED
    captured = capsys.readouterr()
    assert "ComfyUI skipped node 5 (LeversRecommend, 'Recommend')" in captured.err
    assert "  - node 5 (LeversRecommend, 'Recommend'): Value 9000 bigger than max of 8192: width" in captured.err
    summary = json.loads(captured.out)
    assert summary["status"] == "partial" and set(summary["node_errors"]) == {"5"}
    assert len(summary["files"]) == 1 and (out / "x_00001_.latent").is_file()   # the output that ran is saved
    assert "done:" not in captured.err


@pytest.mark.parametrize("ui, needle", [
    ({"nodes": [{"type": "KSampler"}], "links": []}, "nodes[0] (KSampler) has no 'id'"),
    ({"nodes": [1, 2], "links": []}, "nodes[0] is 1, not a node object"),
    ({"nodes": [{"id": 1, "type": "SaveLatent", "inputs": [{"name": "samples", "link": 5}]}], "links": [[5, 2]]},
     "links[0] [5, 2] is too short: expected [id, origin_id, origin_slot, target_id, target_slot, type]"),
    ({"nodes": [{"id": 1, "type": "SaveLatent", "inputs": [{"name": "samples", "link": 5}]}], "links": [{"id": 5}]},
     "links[0] (link 5) has no 'origin_id', 'origin_slot'"),
    ({"nodes": [{"id": 1, "type": "SaveLatent", "inputs": [{"name": "samples", "link": [5]}]}], "links": []},
     "node 1 (SaveLatent): input 'samples' has link [5]: expected a link id"),
    ({"nodes": [{"id": 1, "type": "SaveLatent"}], "links": [[5, 2, "zero", 1, 0, "LATENT"]]},
     "origin_slot an integer"),
])
def test_malformed_ui_workflows_are_named_not_a_traceback(ui, needle, tmp_path, capsys):
    """These raised KeyError / IndexError / TypeError from ui_to_api and _link_table."""
    with pytest.raises(C.WorkflowError) as exc:
        C.ui_to_api(ui, MINI_OI)
    assert needle in str(exc.value)
    path = tmp_path / "ui.json"
    path.write_text(json.dumps(ui))
    with FakeComfy(MINI_OI) as fake:
        assert _cli(["run", str(path), "--server", fake.url, "--dry-run"]) == C.EXIT_INVALID
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize("server, needle", [
    ("127.0.0.1:8l88", "Port could not be cast to integer"),      # http.client.InvalidURL traceback before
    ("http://127.0.0.1:99999", "Port out of range"),
    ("ftp://127.0.0.1:8188", "only http:// and https:// are supported, not ftp://"),   # timed out before
    ("http://", "it names no host"),
])
def test_a_malformed_server_url_is_refused_before_contacting_anything(server, needle, api_file, capsys):
    start = time.monotonic()
    assert _cli(["run", str(api_file), "--server", server]) == C.EXIT_INVALID
    assert time.monotonic() - start < 5
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err and err.count("\n") == 1


def test_a_server_that_does_not_speak_http_is_unreachable_not_a_traceback(api_file, capsys):
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)

        def answer():
            conn, _ = srv.accept()
            conn.recv(4096)
            conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")
            conn.close()

        threading.Thread(target=answer, daemon=True).start()
        rc = _cli(["run", str(api_file), "--server", f"127.0.0.1:{srv.getsockname()[1]}"])
    assert rc == C.EXIT_UNREACHABLE
    assert "answered, but it is not ComfyUI (the answer is not HTTP" in capsys.readouterr().err


def test_out_that_cannot_be_a_folder_is_refused_before_submitting(api_file, tmp_path, capsys):
    """--out naming a file failed with NotADirectoryError after the prompt had run."""
    a_file = tmp_path / "afile"
    a_file.write_text("hi")
    with FakeComfy(MINI_OI) as fake:
        assert _cli(["run", str(api_file), "--server", fake.url, "--out", str(a_file)]) == C.EXIT_INVALID
        assert _cli(["run", str(api_file), "--server", fake.url, "--out", str(a_file / "sub")]) == C.EXIT_INVALID
        assert _cli(["run", str(api_file), "--server", fake.url, "--out", str(a_file), "--dry-run"]) == C.EXIT_OK
    assert fake.prompts == []
    err = capsys.readouterr().err
    assert f"--out {a_file} is a file, not a folder" in err and f"{a_file} is a file, so the folder" in err
    assert C.check_out_dir(str(tmp_path / "new" / "deeper")) is None    # created on download


@pytest.mark.parametrize("payload, needle", [
    ('{"1": {}}'.encode("utf-16"), "starts with a UTF-16 byte-order mark"),
    (b"\x89PNG\r\n\x1a\n\x00\x00", "byte 0 is not valid UTF-8"),
])
def test_a_workflow_that_is_not_utf8_names_the_file_and_the_fix(payload, needle, tmp_path, capsys):
    path = tmp_path / "wf.json"
    path.write_bytes(payload)
    with FakeComfy(MINI_OI) as fake:
        assert _cli(["run", str(path), "--server", fake.url, "--dry-run"]) == C.EXIT_INVALID
    err = capsys.readouterr().err
    assert f"{path}: not a UTF-8 JSON workflow" in err and needle in err and "save it as UTF-8 JSON" in err


def test_a_utf8_byte_order_mark_is_accepted(api_file):
    api_file.write_bytes(b"\xef\xbb\xbf" + api_file.read_bytes())
    assert C.load_workflow(api_file)["3"]["class_type"] == "KSampler"


def test_links_with_a_numeric_node_id_are_sent_as_comfyui_takes_them(tmp_path, capsys):
    """ComfyUI 0.33 looks a link's node up by its string id: [1, 0] passed the local check, then the server
    failed it ("Exception when validating node"). `levers run` now sends ["1", 0]; validate_api alone names it."""
    api = _valid_api()
    api["3"]["inputs"]["model"] = [1, 0]
    problems = C.validate_api(api, MINI_OI)
    assert len(problems) == 1 and "by a number" in problems[0] and '["1", 0]' in problems[0]
    assert C.prepare_prompt(api, MINI_OI)["3"]["inputs"]["model"] == ["1", 0]
    path = tmp_path / "int_link.json"
    path.write_text(json.dumps(api))
    with FakeComfy(MINI_OI) as fake:
        assert _cli(["run", str(path), "--server", fake.url, "--out", str(tmp_path / "o"), "--quiet"]) == C.EXIT_OK
    assert fake.prompts[0]["prompt"]["3"]["inputs"]["model"] == ["1", 0]


def test_ctrl_c_on_a_prompt_still_in_the_queue_takes_it_out(api_file, capsys):
    """Found in review: Ctrl-C sent only POST /interrupt, which ComfyUI applies to the running prompt: a prompt still
    waiting behind another one ran later anyway, and the message said it had been stopped. A second review: once
    the delete took it out, /interrupt is not sent either (builds that ignore its prompt_id stopped another client's
    running prompt), and --json names the prompt (its prompt_id was null)."""
    import _thread

    with FakeComfy(MINI_OI) as fake:
        fake.mode = "hang"

        def interrupt_once_queued():
            deadline = time.monotonic() + 10
            while not fake.pending and time.monotonic() < deadline:
                time.sleep(0.02)
            _thread.interrupt_main()
        threading.Thread(target=interrupt_once_queued, daemon=True).start()
        rc = _cli(["run", str(api_file), "--server", fake.url, "--json"])
        (pid,) = [d["delete"][0] for d in fake.deletes]
    assert rc == C.EXIT_INTERRUPTED and fake.pending == []
    assert fake.interrupts == []
    out = capsys.readouterr()
    assert "took this prompt out of ComfyUI's queue before it started" in out.err
    summary = json.loads(out.out)
    assert summary["status"] == "interrupted" and summary["prompt_id"] == pid


def test_a_web_server_that_is_not_comfyui_is_unreachable_not_a_failed_prompt(api_file, capsys):
    """Found in review: a plain web server answered /object_info with a 404 page: exit 1 (a failed prompt) and raw
    HTML. No ComfyUI answered, so it is exit 3 with one line."""
    with FakeComfy(MINI_OI) as fake:
        rc = _cli(["run", str(api_file), "--server", fake.url + "/some/prefix"])
    assert rc == C.EXIT_UNREACHABLE
    err = capsys.readouterr().err
    assert "answered, but it is not ComfyUI" in err and "Check the port" in err and err.count("\n") == 1


def test_a_web_servers_html_error_page_is_one_readable_line(api_file, tmp_path, capsys):
    """python -m http.server answers /object_info with a 404 HTML page: the error quoted ~10 lines of raw HTML cut
    mid-sentence and advised starting ComfyUI. It now says something answered that is not ComfyUI, with the page's
    title."""
    import functools
    import http.server

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    handler = functools.partial(Quiet, directory=str(tmp_path))
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        rc = _cli(["run", str(api_file), "--server", f"http://127.0.0.1:{srv.server_address[1]}"])
    finally:
        srv.shutdown()
        srv.server_close()
    err = capsys.readouterr().err
    assert rc == C.EXIT_UNREACHABLE and err.count("\n") == 1, err
    assert "GET /object_info answered HTTP 404: Error response" in err and "<" not in err, err
    assert "it is not ComfyUI" in err and "Start it" not in err, err


def test_errors_before_a_result_still_print_json_and_name_the_problem(api_file, tmp_path, capsys):
    """Found in review: with --json, a workflow refused locally, a prompt ComfyUI rejected or an unreachable server
    printed nothing on stdout (scripts got a JSON parse error); a folder given as the workflow was 'not found', an
    empty file 'Expecting value'."""
    (tmp_path / "empty.json").write_text("  \n")
    with FakeComfy(MINI_OI) as fake:
        assert _cli(["run", str(tmp_path), "--server", fake.url, "--json"]) == C.EXIT_INVALID
        first = capsys.readouterr()
        assert "is a folder" in first.err and json.loads(first.out)["status"] == "invalid"
        assert _cli(["run", str(tmp_path / "empty.json"), "--server", fake.url]) == C.EXIT_INVALID
        assert "is empty" in capsys.readouterr().err
        fake.mode = "reject"
        assert _cli(["run", str(api_file), "--server", fake.url, "--json"]) == C.EXIT_FAILED
        assert json.loads(capsys.readouterr().out)["status"] == "rejected"
    assert _cli(["run", str(api_file), "--server", fake.url, "--json"]) == C.EXIT_UNREACHABLE
    assert json.loads(capsys.readouterr().out)["status"] == "unreachable"


def test_set_refuses_nan_and_infinity(api_file, capsys):
    """Found in review: --set 13.cfg=nan passed --set (only the local check caught it; with --no-validate the prompt
    carried a NaN, which is not JSON)."""
    with FakeComfy(MINI_OI) as fake:
        for bad in ("nan", "inf", "-Infinity"):
            assert _cli(["run", str(api_file), "--server", fake.url, "--no-validate", "--dry-run",
                         "--set", f"3.cfg={bad}"]) == C.EXIT_INVALID
    assert capsys.readouterr().err.count("expects a finite number") == 3


def test_ctrl_c_while_the_prompt_is_being_submitted_still_cancels_it(api_file, capsys, monkeypatch):
    """Found in review: submit was outside the cancelling block, so a Ctrl-C after ComfyUI queued the prompt but
    before its answer was read said "nothing was submitted" and the prompt ran later. The client names the prompt
    (a UUID ComfyUI takes) before sending it, so it can cancel it."""
    real = C.ComfyClient.submit

    def submit_then_ctrl_c(self, *a, **k):
        real(self, *a, **k)
        raise KeyboardInterrupt
    monkeypatch.setattr(C.ComfyClient, "submit", submit_then_ctrl_c)
    with FakeComfy(MINI_OI) as fake:
        fake.mode = "hang"
        rc = _cli(["run", str(api_file), "--server", fake.url])
        assert rc == C.EXIT_INTERRUPTED and len(fake.prompts) == 1 and fake.pending == []
        assert fake.deletes == [{"delete": [fake.prompts[0]["prompt_id"]]}]
    assert "took this prompt out of ComfyUI's queue" in capsys.readouterr().err


def test_a_comfyui_answering_object_info_with_an_error_is_not_called_another_server(api_file, capsys, monkeypatch):
    """Found in review: a 500 (a broken node pack) or a proxy's 401 from a real ComfyUI was reported as 'is this a
    ComfyUI server?' with exit 3; only a 404 or a non-JSON answer means no ComfyUI answered."""
    real = C.ComfyClient._request

    def broken(self, method, path, body=None):
        if path == "/object_info":
            return 500, b'{"error": "a node pack raised in INPUT_TYPES"}'
        return real(self, method, path, body)
    monkeypatch.setattr(C.ComfyClient, "_request", broken)
    with FakeComfy(MINI_OI) as fake:
        rc = _cli(["run", str(api_file), "--server", fake.url])
    err = capsys.readouterr().err
    assert rc == C.EXIT_FAILED and "answered HTTP 500" in err and "is this a ComfyUI server" not in err


def test_previews_are_downloaded_apart_from_the_saved_outputs(tmp_path):
    """PreviewImage writes into ComfyUI's temp folder: its files land in --out/preview/, not beside what SaveImage
    saved (they were mixed in with the real outputs)."""
    class Viewer:
        def view(self, filename, subfolder, kind):
            return f"{kind}:{subfolder}/{filename}".encode()

    outputs = {"9": {"images": [{"filename": "ComfyUI_00001_.png", "subfolder": "", "type": "output"}]},
               "12": {"images": [{"filename": "ComfyUI_temp_abcd_00001_.png", "subfolder": "", "type": "temp"}]}}
    saved = sorted(C.download_outputs(Viewer(), outputs, str(tmp_path)))
    assert saved == sorted([str(tmp_path / "ComfyUI_00001_.png"),
                            str(tmp_path / "preview" / "ComfyUI_temp_abcd_00001_.png")])
    assert (tmp_path / "preview" / "ComfyUI_temp_abcd_00001_.png").read_bytes() == b"temp:/ComfyUI_temp_abcd_00001_.png"


# ---------------------------------------------------------------------------------------------
# Found in review of `levers run`: malformed nodes under --no-validate, Ctrl-C around the run, unreadable --input
# files, failed downloads, Ctrl-C and /interrupt, and two messages
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("api, needle", [
    ({"1": {"class_type": "SaveLatent", "inputs": ["x"]}}, "node 1 (SaveLatent): 'inputs' is ['x'], not an object"),
    ({"1": 5}, "node 1 is 5, not a node object"),
    ({"1": {"inputs": {}}}, "node 1 has no 'class_type'"),
    ({"1": {"class_type": "SaveLatent", "inputs": {}, "_meta": "x"}}, "node 1 (SaveLatent): '_meta' is 'x'"),
])
def test_no_validate_still_refuses_a_node_that_is_not_a_node_object(api, needle, tmp_path, capsys):
    """--no-validate skipped every check, and the progress display read each node as an object with an inputs
    object: AttributeError tracebacks ('list' object has no attribute 'values', 'int' object has no attribute 'get')
    with the prompt about to be sent. Checked before the server is asked, as the form of a --set is."""
    path = tmp_path / "odd.json"
    path.write_text(json.dumps(api))
    with FakeComfy(MINI_OI) as fake:
        rc = _cli(["run", str(path), "--server", fake.url, "--out", str(tmp_path / "o"), "--no-validate", "--json"])
    assert rc == C.EXIT_INVALID and fake.prompts == []
    out = capsys.readouterr()
    assert needle in out.err and "Export (API)" in out.err, out.err
    assert json.loads(out.out)["status"] == "invalid"
    # it needs no server: invalid input, not "cannot reach ComfyUI"
    assert _cli(["run", str(path), "--server", "http://127.0.0.1:1", "--no-validate"]) == C.EXIT_INVALID
    assert needle in capsys.readouterr().err


def _two_outputs_file(tmp_path):
    """The api_file prompt with a second SaveLatent: two files to download (x_00001_.latent, y_00001_.latent)."""
    api = _valid_api()
    api["5"] = {"class_type": "LeversRecommend", "inputs": {"width": 1024, "model": ["1", 0]},
                "_meta": {"title": "Recommend"}}
    api["6"] = {"class_type": "SaveLatent", "inputs": {"samples": ["3", 0], "filename_prefix": "y"}}
    path = tmp_path / "two.json"
    path.write_text(json.dumps(api))
    return path


def test_ctrl_c_while_downloading_says_the_prompt_finished_and_what_was_saved(tmp_path, capsys, monkeypatch):
    """Only submitting and following the prompt handled Ctrl-C: during the downloads it said "nothing was submitted"
    (the prompt had run), and --json gave no prompt id and no files."""
    real = C.ComfyClient.view
    calls = []

    def second_view_ctrl_c(self, *a):
        calls.append(a)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(self, *a)
    monkeypatch.setattr(C.ComfyClient, "view", second_view_ctrl_c)
    out = tmp_path / "out"
    with FakeComfy(MINI_OI) as fake:
        rc = _cli(["run", str(_two_outputs_file(tmp_path)), "--server", fake.url, "--out", str(out), "--json"])
        pid = fake.prompts[0]["prompt_id"]
    assert rc == C.EXIT_INTERRUPTED
    assert fake.deletes == [] and fake.interrupts == []          # nothing left to stop on the server
    captured = capsys.readouterr()
    assert f"prompt {pid} had finished on the server; stopped its downloads with 1 file(s) saved" in captured.err
    assert "nothing was submitted" not in captured.err
    summary = json.loads(captured.out)
    assert summary["status"] == "interrupted" and summary["prompt_id"] == pid
    assert summary["files"] == [str(out / "x_00001_.latent")] and (out / "x_00001_.latent").is_file()


def test_ctrl_c_before_anything_is_submitted_still_prints_json(api_file, capsys, monkeypatch):
    """The README promises a JSON summary when the run ends before a result; a Ctrl-C while the server's node list
    was read printed a traceback and nothing on stdout."""
    def ctrl_c(self):
        raise KeyboardInterrupt
    monkeypatch.setattr(C.ComfyClient, "object_info", ctrl_c)
    with FakeComfy(MINI_OI) as fake:
        rc = _cli(["run", str(api_file), "--server", fake.url, "--json"])
    assert rc == C.EXIT_INTERRUPTED and fake.prompts == []
    out = capsys.readouterr()
    assert "interrupted: nothing was submitted" in out.err
    summary = json.loads(out.out)
    assert summary["status"] == "interrupted" and summary["error"] == "nothing was submitted"
    assert summary["prompt_id"] is None


def _edit_workflow(tmp_path):
    """A LoadImage feeding nothing beside an EmptyLatent -> SaveLatent: a prompt an --input can go into."""
    api = {"1": {"class_type": "LoadImage", "inputs": {"image": "a.png"}},
           "2": {"class_type": "SaveLatent", "inputs": {"samples": ["3", 0], "filename_prefix": "x"}},
           "3": {"class_type": "EmptyLatent", "inputs": {"width": 64, "height": 64}}}
    path = tmp_path / "edit.json"
    path.write_text(json.dumps(api))
    return path


@pytest.mark.parametrize("when", ["from the start", "after the checks"])
def test_an_unreadable_input_file_is_named_with_the_fix(when, tmp_path, capsys, monkeypatch):
    """--input checked only that the file exists: one that cannot be opened (permissions) ended in a PermissionError
    traceback from the upload. parse_input opens it; a file that turns unreadable before the upload is named too.
    (Tests may run as root, where chmod 000 still reads: open() itself is made to refuse.)"""
    import builtins

    photo = tmp_path / "cat.png"
    photo.write_bytes(b"\x89PNG fake bytes")
    locked = when == "from the start"
    real_open, real_info = builtins.open, C.ComfyClient.object_info

    def guarded_open(file, *a, **k):
        if locked and str(file) == str(photo):
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, *a, **k)

    def info_then_lock(self):
        nonlocal locked
        answer = real_info(self)
        locked = True
        return answer
    monkeypatch.setattr(builtins, "open", guarded_open)
    monkeypatch.setattr(C.ComfyClient, "object_info", info_then_lock)
    wf = _edit_workflow(tmp_path)
    with FakeComfy(MINI_OI) as fake:
        rc = _cli(["run", str(wf), "--server", fake.url, "--out", str(tmp_path / "out"),
                   "--input", f"LoadImage.image={photo}", "--json"])
    assert rc == C.EXIT_INVALID and fake.uploads == [] and fake.prompts == []
    out = capsys.readouterr()
    assert f"--input LoadImage.image={photo}: cannot read {photo}: Permission denied" in out.err, out.err
    assert "check its permissions" in out.err and json.loads(out.out)["status"] == "invalid"


def test_a_failed_download_keeps_the_other_files_and_the_reports(tmp_path, capsys):
    """The first /view that failed ended the run: the files saved before it were not listed, the ones after it not
    fetched, the Levers reports not printed, and --json said files []. The other files are saved and listed now,
    with each failure named, and the run exits 1 as before."""
    out = tmp_path / "out"
    with FakeComfy(MINI_OI) as fake:
        fake.unavailable = {"x_00001_.latent"}            # the first of the two outputs
        rc = _cli(["run", str(_two_outputs_file(tmp_path)), "--server", fake.url, "--out", str(out), "--json"])
    assert rc == C.EXIT_FAILED
    captured = capsys.readouterr()
    summary = json.loads(captured.out)
    assert summary["status"] == "incomplete" and summary["files"] == [str(out / "y_00001_.latent")]
    assert (out / "y_00001_.latent").read_bytes() == b"LATENT:y_00001_.latent"
    (problem,) = summary["download_errors"]
    assert problem.startswith("could not download x_00001_.latent (GET /view answered HTTP 404"), problem
    assert list(summary["reports"]) == ["#5 Recommend"] and "Levers report: #5 Recommend" in captured.err
    assert "not all of its files could be downloaded" in captured.err and f"  - {problem}" in captured.err
    assert str(out / "y_00001_.latent") in captured.err


def test_a_download_stopped_mid_write_leaves_no_partial_file(tmp_path, monkeypatch):
    """A download was written straight to its final name: a Ctrl-C (or a full disk) mid-write left a truncated image
    there. Each file is written to a temporary name and renamed once whole."""
    import builtins
    import io

    class HalfThenCtrlC:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, data):
            self.f.write(bytes(data[:len(data) // 2]))
            self.f.flush()
            raise KeyboardInterrupt

    real_open = io.open
    out = tmp_path / "out"

    def interrupting_open(file, mode="r", *a, **k):
        f = real_open(file, mode, *a, **k)
        writing = isinstance(file, (str, Path)) and Path(file).parent == out and set(mode) & set("wx")
        return HalfThenCtrlC(f) if writing else f
    monkeypatch.setattr(io, "open", interrupting_open)        # pathlib's open
    monkeypatch.setattr(builtins, "open", interrupting_open)

    class Viewer:
        def view(self, filename, subfolder, kind):
            return b"x" * 1000

    with pytest.raises(KeyboardInterrupt):
        C.download_outputs(Viewer(), {"9": {"images": [{"filename": "a.png", "subfolder": "", "type": "output"}]}},
                           str(out))
    assert list(out.iterdir()) == []


def test_download_outputs_tries_every_file_and_names_those_saved_and_those_not(tmp_path):
    class Viewer:
        def view(self, filename, subfolder, kind):
            if filename == "a.png":
                raise C.HTTPStatusError("GET /view", 404, b'{"error": "no such file"}')
            return b"b"

    outputs = {"9": {"images": [{"filename": "a.png", "subfolder": "", "type": "output"},
                                {"filename": "b.png", "subfolder": "", "type": "output"}]}}
    with pytest.raises(C.DownloadFailed) as exc:
        C.download_outputs(Viewer(), outputs, str(tmp_path))
    assert exc.value.saved == [str(tmp_path / "b.png")] and (tmp_path / "b.png").read_bytes() == b"b"
    assert exc.value.failed == ['could not download a.png (GET /view answered HTTP 404: {"error": "no such file"})']


@pytest.mark.parametrize("race", [False, True], ids=["running", "started while taken out of the queue"])
def test_ctrl_c_still_interrupts_a_prompt_that_runs(race, api_file, capsys):
    """/interrupt is skipped only for a prompt the delete took out of the queue: a running one is stopped, and so is
    one that started between reading the queue and the delete (the delete leaves a running prompt alone)."""
    import _thread

    with FakeComfy(MINI_OI) as fake:
        fake.mode = "hang" if race else "busy"
        fake.start_on_delete = race

        def interrupt_once_there():
            deadline = time.monotonic() + 10
            while not (fake.pending or fake.running) and time.monotonic() < deadline:
                time.sleep(0.02)
            _thread.interrupt_main()
        threading.Thread(target=interrupt_once_there, daemon=True).start()
        rc = _cli(["run", str(api_file), "--server", fake.url])
        pid = fake.prompts[0]["prompt_id"]
    assert rc == C.EXIT_INTERRUPTED and fake.interrupts == [{"prompt_id": pid}]
    assert "asked ComfyUI to stop this prompt" in capsys.readouterr().err


def test_https_to_a_plain_http_comfyui_says_to_use_http(api_file, capsys):
    """https:// to ComfyUI's plain HTTP port said "cannot reach ComfyUI ... Start it" (TLS failed with
    WRONG_VERSION_NUMBER on the server's plain answer): it is running, at http://."""
    with FakeComfy(MINI_OI) as fake:
        https = fake.url.replace("http://", "https://")
        rc = _cli(["run", str(api_file), "--server", https, "--dry-run"])
    assert rc == C.EXIT_UNREACHABLE
    err = capsys.readouterr().err
    assert f"the server at {https} answered plain HTTP, not HTTPS" in err and f"Use {fake.url} in --server" in err
    assert "Start it" not in err


@pytest.mark.parametrize("given, needle", [
    ("LoadImage.imagex={photo}", "--input LoadImage.imagex: node 1 (LoadImage) has no input 'imagex'"),
    ("Nope.image={photo}", "--input: no node 'Nope' in the workflow"),
    ("{photo}", "expected NODE.INPUT=FILE, e.g. --input LoadImage.image="),
])
def test_input_mistakes_name_the_input_option(given, needle, tmp_path, capsys):
    """An --input aimed at a missing input or node was reported as a --set (`--set LoadImage.imagex: ...`), and a
    malformed one asked for NODE.INPUT=VALUE."""
    photo = tmp_path / "cat.png"
    photo.write_bytes(b"\x89PNG fake bytes")
    wf = _edit_workflow(tmp_path)
    with FakeComfy(MINI_OI) as fake:
        rc = _cli(["run", str(wf), "--server", fake.url, "--input", given.format(photo=photo)])
    assert rc == C.EXIT_INVALID and fake.uploads == []
    err = capsys.readouterr().err
    assert needle in err and "--set" not in err, err


def test_a_queue_that_cannot_be_read_after_the_delete_still_interrupts():
    """Found in review: cancel() skipped /interrupt when the second read of /queue failed (None read as "not
    running"), so a prompt that started between the two requests ran on while the message said it was taken out."""
    from comfyui_levers.core import client as C
    from comfyui_levers.core.errors import LeversError

    c = C.ComfyClient.__new__(C.ComfyClient)
    calls = []
    reads = iter([{"queue_pending": [[0, "p1", {}, {}, []]], "queue_running": []}])

    def get_json(path):
        try:
            return next(reads)
        except StopIteration:
            raise LeversError("GET /queue answered HTTP 500") from None
    c.get_json = get_json
    c._request = lambda method, path, body=None, **k: (calls.append((method, path)) or (200, b"{}"))
    done = c.cancel("p1")
    assert ("POST", "/interrupt") in calls and "took this prompt out" not in done, (done, calls)
