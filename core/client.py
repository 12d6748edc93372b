"""`levers run`: drive a running ComfyUI headless, with the same workflows users drag into the UI.

Submits an API-format workflow to ``POST /prompt``, follows it live over ComfyUI's websocket
(node, step, percent), downloads the outputs through ``/view``, prints the Levers reports and
exits non-zero with ComfyUI's own error when validation or execution fails. UI-format files (what
"Save" writes and what ``example_workflows/`` ships) are converted with the server's
``/object_info``, so the widget values land on the right named inputs.

Standard library only: urllib for HTTP and a minimal RFC 6455 client over a raw socket for the
websocket. When the websocket cannot be opened the client polls ``/history`` instead.
"""
from __future__ import annotations

import argparse
import base64
import http.client
import json
import math
import os
import re
import reprlib
import socket
import ssl
import struct
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

from .errors import LeversError

DEFAULT_SERVER = "http://127.0.0.1:8188"

# Exit codes of `levers run` (documented in README.md, "Headless: levers run").
EXIT_OK = 0
EXIT_FAILED = 1          # ComfyUI rejected the prompt or skipped an output of it, or execution failed / was interrupted
EXIT_INVALID = 2         # the workflow, a --set, --server or --out is invalid (nothing was submitted)
EXIT_UNREACHABLE = 3     # no ComfyUI answered at --server
EXIT_TIMEOUT = 124       # --timeout elapsed; the prompt may still be running on the server
EXIT_INTERRUPTED = 130   # Ctrl-C (the prompt is interrupted on the server)

WIDGET_TYPES = frozenset({"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"})
ANY_TYPES = frozenset({"*", "COMFY_MATCHTYPE_V3"})
# Frontend-only nodes: never sent to the server.
VIRTUAL_NODES = frozenset({"Note", "MarkdownNote", "Reroute", "PrimitiveNode"})
# The extra widget value the frontend stores after a seed-like widget.
CONTROL_VALUES = frozenset({"fixed", "increment", "decrement", "randomize"})
MODEL_FILE_SUFFIXES = (".safetensors", ".sft", ".ckpt", ".pt", ".pt2", ".pth", ".bin", ".gguf", ".pkl")
# files LoadImage, LoadVideo, LoadAudio and the like list from ComfyUI's input/ folder
INPUT_FILE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".gif", ".bmp", ".tif", ".tiff", ".exr", ".mp4", ".webm",
                       ".mov", ".mkv", ".avi", ".wav", ".mp3", ".flac", ".ogg", ".m4a")
INPUT_FILE_FIX = ("upload it with --input NODE.INPUT=FILE (levers run), or copy it into ComfyUI's input/ folder, then "
                  "run again")
MODE_NEVER, MODE_BYPASS = 2, 4
NOT_INSTALLED_FIX = "install the node pack that provides it, e.g. with ComfyUI-Manager, and restart ComfyUI"


class WorkflowError(LeversError, ValueError):
    """The workflow file or a --set cannot be turned into a valid prompt (nothing was submitted)."""

    def __init__(self, message: str, problems: Iterable[str] = ()):
        self.problems = list(problems)
        text = message if not self.problems else message + "\n" + "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(text)


class ServerUnreachable(LeversError, ConnectionError):
    """Nothing answered at the server URL."""

    def __init__(self, url: str, reason: str):
        self.url, self.reason = url, reason
        super().__init__(
            f"cannot reach ComfyUI at {url} ({reason}). Start it (e.g. `python main.py --listen 127.0.0.1 "
            f"--port 8188`) or point --server / COMFYUI_URL at the running server.")


class PlainHTTPAnswer(ServerUnreachable):
    """--server names https://, but the server there answered in plain HTTP (the TLS handshake read its reply)."""

    def __init__(self, url: str, reason: str):
        self.url, self.reason = url, reason
        plain = "http://" + url.split("://", 1)[1]
        LeversError.__init__(self, f"the server at {url} answered plain HTTP, not HTTPS ({reason}). Use {plain} in "
                                   f"--server / COMFYUI_URL (ComfyUI serves plain HTTP unless started with "
                                   f"--tls-keyfile and --tls-certfile).")


# What OpenSSL reports when the first bytes it reads are a plain HTTP reply ("HTTP/1.1 400 ..."): 3.0 and 3.2+.
PLAIN_HTTP_TLS_ERRORS = frozenset({"WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE"})


class NotComfyUI(ServerUnreachable):
    """Something answered at the server URL, but not as ComfyUI does."""

    def __init__(self, url: str, reason: str):
        self.url, self.reason = url, reason
        LeversError.__init__(self, f"the server at {url} answered, but it is not ComfyUI ({reason}). Check the "
                                   f"port in --server / COMFYUI_URL, or the path if ComfyUI runs behind a proxy.")


def payload_text(payload: bytes, limit: int = 200) -> str:
    """An error response's body on one short line: an HTML page's title, else its text with whitespace folded."""
    text = payload.decode(errors="replace")
    title = re.search(r"<title[^>]*>(.*?)</title>", text, re.I | re.S)
    if title:
        text = title.group(1)
    elif text.lstrip().startswith("<"):
        text = re.sub(r"<[^>]+>", " ", text)
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


class HTTPStatusError(LeversError, RuntimeError):
    """The server answered a request with an error status."""

    def __init__(self, request: str, status: int, payload: bytes):
        self.request, self.status = request, status
        body = payload_text(payload)
        super().__init__(f"{request} answered HTTP {status}" + (f": {body}" if body else ""))


class BadServerURL(LeversError, ValueError):
    """--server / COMFYUI_URL is not an http(s) URL a client can connect to (nothing was contacted)."""

    def __init__(self, url: str, reason: str):
        self.url, self.reason = url, reason
        super().__init__(f"--server {url!r} is not a usable ComfyUI URL: {reason}. Expected e.g. "
                         f"http://127.0.0.1:8188 (from --server or COMFYUI_URL)")


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during a run: after the prompt was taken out of ComfyUI's queue or stopped, or, once it had finished,
    while its outputs were downloading; ``done`` says which, ``files`` what was saved by then."""

    def __init__(self, done: str, prompt_id: str | None = None, files: Iterable[str] = ()):
        self.done, self.prompt_id, self.files = done, prompt_id, list(files)
        super().__init__(done)


class PromptRejected(LeversError, RuntimeError):
    """ComfyUI answered /prompt with a validation error."""

    def __init__(self, error: dict, node_errors: dict, api: dict):
        self.error, self.node_errors = error, node_errors
        super().__init__(format_prompt_error(error, node_errors, api))


# --------------------------------------------------------------------------------------------
# /object_info helpers
# --------------------------------------------------------------------------------------------

DYNAMIC_COMBO = "COMFY_DYNAMICCOMBO_V3"    # a combo whose choice adds inputs named "<combo>.<sub>"
AUTOGROW = "COMFY_AUTOGROW_V3"            # a growing list of inputs named "<name>.<slot>"
SOCKETLESS_WIDGET_TYPES = frozenset({"COLOR", "IMAGECOMPARE"})


@dataclass(frozen=True)
class InputSpec:
    """One input of a node as /object_info describes it (``name`` is dotted inside dynamic inputs)."""

    name: str
    type: Any                 # "INT", "MODEL", "COMBO", "A,B" or a list of options (legacy combo)
    options: dict
    required: bool

    @property
    def type_name(self) -> str:
        if isinstance(self.type, list) or self.type == DYNAMIC_COMBO:
            return "COMBO"
        return str(self.type)

    @property
    def choices(self) -> list | None:
        if isinstance(self.type, list):
            return self.type
        if self.type == "COMBO":
            return list(self.options.get("options", []))
        if self.type == DYNAMIC_COMBO:
            return [o.get("key") for o in self.options.get("options", [])]
        return None

    @property
    def is_widget(self) -> bool:
        """True when the frontend draws a widget (and stores a value in widgets_values)."""
        if self.options.get("forceInput") or self.options.get("rawLink"):
            return False
        return (self.type_name in WIDGET_TYPES or bool(self.options.get("widgetType"))
                or bool(self.options.get("socketless")) or self.type in SOCKETLESS_WIDGET_TYPES)

    @property
    def has_control_widget(self) -> bool:
        """The frontend adds a "control after generate" value after this widget."""
        flag = self.options.get("control_after_generate")
        if flag is not None:
            return bool(flag)
        return self.type_name == "INT" and self.name.rsplit(".", 1)[-1] in ("seed", "noise_seed")


def _section_entries(inputs: dict, order: dict | None, section: str) -> list[tuple[str, list]]:
    entries = inputs.get(section, {}) or {}
    names = list((order or {}).get(section) or entries.keys())
    names += [n for n in entries if n not in names]
    out = []
    for name in names:
        if name in entries:
            raw = entries[name]
            out.append((name, [raw] if isinstance(raw, str) else list(raw)))
    return out


def iter_specs(node_info: dict, value_of=None, present=None):
    """Yield a node's inputs in widget order, expanding V3 dynamic inputs (ComfyUI 0.33 era).

    ``value_of(name)`` gives the chosen key of a dynamic combo (asked right after it is yielded,
    so a caller walking widget values can consume the value first); ``present(name)`` tells which
    autogrow slots are in use. Without them only the plain inputs are known.
    """
    yield from _iter_section_specs(node_info.get("input", {}) or {}, node_info.get("input_order"), "",
                                   value_of, present)


def _iter_section_specs(inputs: dict, order, prefix: str, value_of, present):
    for section in ("required", "optional"):
        for name, raw in _section_entries(inputs, order, section):
            type_, opts = raw[0], (raw[1] if len(raw) > 1 and isinstance(raw[1], dict) else {})
            full = prefix + name
            if type_ == AUTOGROW:
                yield from _autogrow_specs(full, opts, section == "required", present)
                continue
            spec = InputSpec(full, type_, opts, section == "required")
            yield spec
            if type_ == DYNAMIC_COMBO and value_of is not None:
                chosen = value_of(full)
                for option in opts.get("options", []):
                    if option.get("key") == chosen:
                        yield from _iter_section_specs(option.get("inputs") or {}, None, full + ".", value_of,
                                                       present)
                        break


def _autogrow_specs(full: str, opts: dict, required: bool, present):
    template = opts.get("template") or {}
    body = template.get("input") or {}
    first = next(((sec, v) for sec in ("required", "optional") for v in (body.get(sec) or {}).values()), None)
    if first is None:
        return
    section, raw = first
    raw = [raw] if isinstance(raw, str) else list(raw)
    type_, sub_opts = raw[0], (raw[1] if len(raw) > 1 and isinstance(raw[1], dict) else {})
    if "names" in template:
        names = list(template["names"])
    else:
        names = [f"{template.get('prefix', '')}{i}" for i in range(int(template.get("max", 10)))]
    minimum = int(template.get("min", 0))
    for i, slot in enumerate(names):
        name = f"{full}.{slot}"
        must = required and section == "required" and i < minimum
        if must or (present is not None and present(name)):
            yield InputSpec(name, type_, sub_opts, must)


def input_specs(node_info: dict, live_inputs: dict | None = None) -> list[InputSpec]:
    """A node's inputs in the order the frontend lays out widgets; dynamic ones per ``live_inputs``."""
    if live_inputs is None:
        return list(iter_specs(node_info))
    return list(iter_specs(node_info, live_inputs.get, live_inputs.__contains__))


def _output_types(node_info: dict) -> list:
    return list(node_info.get("output", []) or [])


def _types_compatible(received, expected) -> bool:
    """ComfyUI's validate_node_input rules: exact, "*", unions ("A,B") overlap, list-typed combos."""
    if isinstance(received, list):
        return expected == "COMBO" or isinstance(expected, list)
    if isinstance(expected, list):
        expected = "COMBO"
    if received == expected or received in ANY_TYPES or expected in ANY_TYPES:
        return True
    received_set = {t.strip() for t in str(received).split(",")}
    expected_set = {t.strip() for t in str(expected).split(",")}
    return bool(received_set & expected_set) or "*" in received_set or "*" in expected_set


# --------------------------------------------------------------------------------------------
# UI format -> API format
# --------------------------------------------------------------------------------------------

def is_ui_format(workflow: dict) -> bool:
    return isinstance(workflow, dict) and isinstance(workflow.get("nodes"), list) and "links" in workflow


LINK_FIELDS = ("id", "origin_id", "origin_slot", "target_id", "target_slot", "type")


def _is_id(value) -> bool:
    """A node or link id as the frontend writes it: an integer or a string."""
    return isinstance(value, (int, str)) and not isinstance(value, bool)


def _is_slot(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_ui_structure(ui: dict) -> list[str]:
    """What a UI workflow must hold for the conversion to read it: node objects with ids, well-formed links.

    Reports each malformed node or link by its position, so a hand-edited or truncated file gets one
    line per problem instead of a KeyError from deep inside the conversion.
    """
    problems = []
    for i, node in enumerate(ui.get("nodes") or []):
        if not isinstance(node, dict):
            problems.append(f"nodes[{i}] is {node!r}, not a node object ({{\"id\": ..., \"type\": ...}})")
            continue
        kind = node.get("type", "no type")
        where = f"nodes[{i}] ({kind})"
        if "id" not in node:
            problems.append(f"{where} has no 'id'")
        elif not _is_id(node["id"]):
            problems.append(f"{where} has id {node['id']!r}: expected an integer or a string")
        else:
            where = f"node {node['id']} ({kind})"
        if not isinstance(node.get("type"), str):
            problems.append(f"{where} has no 'type' (the node class, e.g. \"KSampler\")")
        for key in ("inputs", "outputs"):
            entries = node.get(key)
            if entries is not None and not (isinstance(entries, list) and all(isinstance(e, dict) for e in entries)):
                problems.append(f"{where}: '{key}' must be a list of objects, got {entries!r}")
        for inp in node.get("inputs") if isinstance(node.get("inputs"), list) else []:
            if isinstance(inp, dict) and inp.get("link") is not None and not _is_id(inp["link"]):
                problems.append(f"{where}: input {inp.get('name')!r} has link {inp['link']!r}: expected a link id")
    links = ui.get("links")
    if links is not None and not isinstance(links, list):
        return problems + [f"'links' must be a list, got {type(links).__name__}"]
    for i, link in enumerate(links or []):
        if isinstance(link, dict):
            missing = [k for k in LINK_FIELDS[:3] if k not in link]
            if missing:
                problems.append(f"links[{i}] (link {link.get('id', '?')}) has no {', '.join(map(repr, missing))}: "
                                f"a link object needs {', '.join(LINK_FIELDS[:5])}")
                continue
            values = [link[k] for k in LINK_FIELDS[:3]]
        elif isinstance(link, list):
            if len(link) < 5:
                problems.append(f"links[{i}] {link!r} is too short: expected [{', '.join(LINK_FIELDS)}]")
                continue
            values = link[:3]
        else:
            problems.append(f"links[{i}] is {link!r}: expected [{', '.join(LINK_FIELDS)}] or an object")
            continue
        link_id, origin_id, origin_slot = values
        if not (_is_id(link_id) and _is_id(origin_id) and _is_slot(origin_slot)):
            problems.append(f"links[{i}] (link {link_id!r}): id and origin_id must be integers or strings and "
                            f"origin_slot an integer, got {link_id!r}, {origin_id!r}, {origin_slot!r}")
    return problems


def _link_table(ui: dict) -> dict[int, tuple]:
    """link id -> (origin_id, origin_slot, target_id, target_slot, type); both link encodings.

    Expects a workflow that passed ``_check_ui_structure``.
    """
    table = {}
    for link in ui.get("links") or []:
        if isinstance(link, dict):
            table[link["id"]] = (link["origin_id"], link["origin_slot"], link.get("target_id"),
                                 link.get("target_slot"), link.get("type"))
        else:
            table[link[0]] = tuple(link[1:6])
    return table


def _node_label(node: dict) -> str:
    title = node.get("title")
    return f"node {node.get('id')} ({node.get('type')}{', ' + repr(title) if title else ''})"


def ui_to_api(ui_workflow: dict, object_info: dict) -> dict:
    """Convert a UI-format workflow (what ComfyUI's Save writes) into the API format /prompt takes.

    Widget values map to named inputs in the order of the node's required+optional inputs
    (link-only inputs hold no widget value; seed widgets carry an extra "control after generate"
    value); links become ``["origin_id", slot]``; Note/MarkdownNote are dropped; Reroutes are
    followed to their source; PrimitiveNodes are replaced by their value; muted nodes are dropped
    and bypassed nodes pass their matching input through, as the frontend does.
    """
    if not is_ui_format(ui_workflow):
        raise WorkflowError("not a UI-format workflow (expected 'nodes' and 'links')")
    malformed = _check_ui_structure(ui_workflow)
    if malformed:
        raise WorkflowError("the UI workflow is malformed (re-save it from ComfyUI, or fix these entries):",
                            malformed)
    nodes = {str(n["id"]): n for n in ui_workflow["nodes"]}     # an id saved as "1" with links naming 1 (edited files)
    links = _link_table(ui_workflow)
    definitions = ui_workflow.get("definitions")
    subgraphs = {sg.get("id") for sg in (definitions.get("subgraphs") or [] if isinstance(definitions, dict) else [])
                 if isinstance(sg, dict)}
    extra = ui_workflow.get("extra")
    group_nodes = set((extra.get("groupNodes") or {}) if isinstance(extra, dict) else ())
    problems: list[str] = []

    def resolve(link_id, depth=0):
        """Follow a link to ("link", [id, slot]) or ("value", v); None when nothing feeds it."""
        if link_id is None or link_id not in links or depth > len(nodes) + 1:
            return None
        origin_id, origin_slot = links[link_id][0], links[link_id][1]
        origin = nodes.get(str(origin_id))
        if origin is None:
            problems.append(f"link {link_id} starts at node {origin_id}, which is not in the workflow")
            return None
        kind = origin.get("type")
        if kind == "Reroute":
            ins = origin.get("inputs") or []
            return resolve(ins[0].get("link") if ins else None, depth + 1)
        if kind == "PrimitiveNode":
            values = origin.get("widgets_values") or []
            if not values:
                problems.append(f"{_node_label(origin)} has no value")
                return None
            return ("value", values[0])
        mode = origin.get("mode", 0)
        if mode == MODE_NEVER:
            return None
        if mode == MODE_BYPASS:
            return resolve(_bypass_input_link(origin, origin_slot), depth + 1)
        return ("link", [str(origin_id), int(origin_slot)])

    api: dict[str, dict] = {}
    for node in sorted(ui_workflow["nodes"], key=lambda n: _id_sort_key(n["id"])):
        kind = node.get("type")
        if kind in VIRTUAL_NODES or node.get("mode", 0) in (MODE_NEVER, MODE_BYPASS):
            continue
        if kind in subgraphs:
            problems.append(f"{_node_label(node)} is a subgraph; unpack it in ComfyUI (right-click > Unpack "
                            "Subgraph) or export with Workflow > Export (API)")
            continue
        if isinstance(kind, str) and (kind.startswith(("workflow>", "workflow/")) or kind[len("workflow>"):] in
                                      group_nodes or kind in group_nodes):
            problems.append(f"{_node_label(node)} is a group node (the legacy frontend's); convert it in ComfyUI "
                            "(right-click > Convert to nodes) or export with Workflow > Export (API)")
            continue
        info = object_info.get(kind)
        if info is None:
            if _has_links(node):
                problems.append(f"{_node_label(node)}: node type {kind!r} is not installed on this ComfyUI "
                                f"({NOT_INSTALLED_FIX})")
            continue  # an unlinked unknown node is frontend-only decoration (labels, groups helpers)
        inputs = _convert_inputs(node, info, resolve, problems)
        api[str(node["id"])] = {"inputs": inputs, "class_type": kind,
                                "_meta": {"title": node.get("title") or info.get("display_name") or kind}}
    if problems:
        raise WorkflowError("cannot convert the UI workflow to API format:", problems)
    return api


def _id_sort_key(node_id):
    text = str(node_id)
    return (0, int(text), "") if text.isdigit() else (1, 0, text)


def _has_links(node: dict) -> bool:
    ins = any(i.get("link") is not None for i in node.get("inputs") or [])
    outs = any(o.get("links") for o in node.get("outputs") or [])
    return ins or outs


def _bypass_input_link(node: dict, slot: int):
    """The input link a bypassed node passes through for output ``slot`` (frontend rule)."""
    outputs = node.get("outputs") or []
    inputs = node.get("inputs") or []
    out_type = outputs[slot].get("type") if slot < len(outputs) else None
    if slot < len(inputs) and inputs[slot].get("type") == out_type and inputs[slot].get("link") is not None:
        return inputs[slot]["link"]
    for inp in inputs:
        if inp.get("type") == out_type and inp.get("link") is not None:
            return inp["link"]
    return None


def _convert_inputs(node: dict, info: dict, resolve, problems: list[str]) -> dict:
    linked = {}
    for inp in node.get("inputs") or []:
        name = (inp.get("widget") or {}).get("name") or inp.get("name")
        if inp.get("link") is not None:
            linked[name] = inp["link"]
    values = node.get("widgets_values")
    by_name = values if isinstance(values, dict) else None
    queue = list(values) if isinstance(values, list) else []
    out: dict[str, Any] = {}
    chosen: dict[str, Any] = {}
    seen = set()
    for spec in iter_specs(info, chosen.get, linked.__contains__):
        seen.add(spec.name)
        value, has_value = None, False
        if spec.is_widget:
            if by_name is not None:
                has_value = spec.name in by_name
                value = by_name.get(spec.name)
            elif queue:
                value, has_value = queue.pop(0), True
                if spec.has_control_widget and queue and queue[0] in CONTROL_VALUES:
                    queue.pop(0)
                upload = next((k for k, v in spec.options.items() if k.endswith("_upload") and v), None)
                if upload and queue and queue[0] == upload[: -len("_upload")]:
                    queue.pop(0)  # the upload button's stored value ("image", "video", ...)
            if has_value:
                chosen[spec.name] = value
        if spec.name in linked:
            source = resolve(linked[spec.name])
            if source is not None:
                out[spec.name] = source[1]
                continue
        if has_value:
            out[spec.name] = value
    # Inputs the schema does not list but the UI wired up (inputs a custom frontend adds).
    for name, link_id in linked.items():
        if name not in seen:
            source = resolve(link_id)
            if source is not None:
                out[name] = source[1]
    return out


# --------------------------------------------------------------------------------------------
# API format validation
# --------------------------------------------------------------------------------------------

def validate_api(api: dict, object_info: dict, *, allow_missing_files: bool = False) -> list[str]:
    """Check an API-format prompt against /object_info; returns the problems (empty when valid).

    Checks what ComfyUI's own validation checks before running, as it checks it: every node's type
    installed; then, for the nodes the output nodes need (a stray node is not run, so not checked), required
    inputs present, widget values that convert to their type (``int()``, ``float()``, a ``__value__``
    wrapper unwrapped) within their range, combo values among the choices, links pointing at an existing
    node's output of a compatible type; and at least one output node. Inputs a node does not declare are
    ignored, as ComfyUI ignores them. With ``allow_missing_files`` a combo value that names a model file
    absent from the server is not reported (example workflows name files users download themselves).
    """
    if not isinstance(api, dict) or not api:
        return ["the prompt is empty: expected {node_id: {'class_type': ..., 'inputs': {...}}}"]
    problems: list[str] = []
    known: dict[str, dict] = {}
    for node_id, node in api.items():
        if not isinstance(node, dict) or "class_type" not in node:
            problems.append(f"node {node_id}: not a node (no class_type); is this an API-format workflow?")
            continue
        kind = node["class_type"]
        info = object_info.get(kind)
        if info is None:
            problems.append(f"node {node_id} ({kind}): node type {kind!r} is not installed on this ComfyUI "
                            f"({NOT_INSTALLED_FIX})")
            continue
        known[node_id] = info
    outputs = [i for i, info in known.items() if info.get("output_node")]
    for node_id in _needed(api, outputs):
        if node_id not in known:
            continue
        node, info = api[node_id], known[node_id]
        label = f"node {node_id} ({node['class_type']})"
        inputs = node.get("inputs", {})
        if not isinstance(inputs, dict):
            problems.append(f"{label}: 'inputs' must be an object")
            continue
        specs = {s.name: s for s in input_specs(info, inputs)}
        for name, value in inputs.items():
            if name in specs:
                problems.extend(_check_value(label, specs[name], value, api, object_info, allow_missing_files))
        for spec in specs.values():
            if spec.required and spec.name not in inputs:
                problems.append(f"{label}: required input {spec.name!r} ({spec.type_name}) is missing")
    has_output = bool(outputs)
    problems.extend(_describe_cycle(api, cycle) for cycle in dependency_cycles(api, outputs))
    if not has_output and not problems:
        problems.append("the prompt has no output node (SaveImage, PreviewImage, SaveLatent, ...): "
                        "ComfyUI would run nothing")
    return problems


def require_api_shape(api: dict) -> None:
    """Raise WorkflowError unless each node of an API prompt is what `levers run` needs to read it at all: an
    object with a string ``class_type``, an ``inputs`` object and, when there, a ``_meta`` object.

    Checked even under --no-validate: the progress display, --set and the reports read every node, and a node
    written as a number or with a list for ``inputs`` ended in a traceback there (ComfyUI refuses both too).
    """
    problems = []
    for node_id, node in api.items():
        if not isinstance(node, dict):
            problems.append(f"node {node_id} is {reprlib.repr(node)}, not a node object")
            continue
        kind = node.get("class_type")
        if "class_type" not in node:
            problems.append(f"node {node_id} has no 'class_type' (the node class, e.g. \"KSampler\")")
        elif not isinstance(kind, str):
            problems.append(f"node {node_id}: 'class_type' is {reprlib.repr(kind)}, not a node class name "
                            f"(e.g. \"KSampler\")")
        label = f"node {node_id} ({kind})" if isinstance(kind, str) else f"node {node_id}"
        if "inputs" not in node:
            problems.append(f"{label} has no 'inputs' (an object of input name: value; {{}} for none)")
        elif not isinstance(node["inputs"], dict):
            problems.append(f"{label}: 'inputs' is {reprlib.repr(node['inputs'])}, not an object of input name: value")
        if "_meta" in node and not isinstance(node["_meta"], dict):
            problems.append(f"{label}: '_meta' is {reprlib.repr(node['_meta'])}, not an object ({{\"title\": ...}})")
    if problems:
        raise WorkflowError("the API workflow is malformed (nothing was submitted): each node must be "
                            "{\"class_type\": ..., \"inputs\": {...}}; export it again with Workflow > Export (API), "
                            "or fix these nodes:", problems)


def _needed(api: dict, outputs: Iterable[str]) -> list[str]:
    """The output nodes and every node they reach up through their links, in the prompt's order."""
    seen: set[str] = set()
    todo = [o for o in outputs if o in api]
    while todo:
        node_id = todo.pop()
        if node_id not in seen:
            seen.add(node_id)
            todo.extend(source for _, source in _link_inputs(api, node_id))
    return [i for i in api if i in seen]


def _link_inputs(api: dict, node_id: str) -> list[tuple[str, str]]:
    """(input name, source node id) for each input of ``node_id`` linked to a node of the prompt."""
    node = api.get(node_id)
    inputs = node.get("inputs") if isinstance(node, dict) else None
    if not isinstance(inputs, dict):
        return []
    return [(name, str(v[0])) for name, v in inputs.items() if _is_link(v) and str(v[0]) in api]


def dependency_cycles(api: dict, roots: Iterable[str]) -> list[list[tuple[str, str]]]:
    """Dependency cycles among the nodes ``roots`` need, as ComfyUI's validation walks them (from the
    output nodes up through the links). Each cycle is a list of (node id, input name): that node's
    input links to the next node of the list, the last one's to the first. Each cycle is listed once."""
    cycles: list[list[tuple[str, str]]] = []
    found: set[frozenset] = set()
    done: set[str] = set()
    for root in roots:
        if root in done or root not in api:
            continue
        path: list[tuple[str, str]] = []             # (node, input followed to the next node on the path)
        on_path = {root: 0}
        stack = [(root, iter(_link_inputs(api, root)))]
        while stack:
            node_id, edges = stack[-1]
            edge = next(edges, None)
            if edge is None:
                stack.pop()
                on_path.pop(node_id, None)
                done.add(node_id)
                if path:
                    path.pop()
                continue
            name, source = edge
            if source in on_path:
                cycle = path[on_path[source]:] + [(node_id, name)]
                key = frozenset(cycle)
                if key not in found:
                    found.add(key)
                    cycles.append(cycle)
            elif source not in done:
                path.append((node_id, name))
                on_path[source] = len(path)
                stack.append((source, iter(_link_inputs(api, source))))
    return cycles


def _describe_cycle(api: dict, cycle: list[tuple[str, str]]) -> str:
    def label(node_id):
        return f"node {node_id} ({api[node_id].get('class_type')})"

    if len(cycle) == 1:
        node_id, name = cycle[0]
        return (f"{label(node_id)}: input {name!r} links to the node's own output, a dependency cycle ComfyUI "
                f"refuses; link it to another node's output")
    chain = " <- ".join(f"{label(node_id)} input {name!r}" for node_id, name in cycle)
    return (f"dependency cycle: {chain} <- {label(cycle[0][0])}: each of these nodes waits for another's output, "
            f"which ComfyUI refuses; remove or rewire one of these links")


def _is_link(value) -> bool:
    return (isinstance(value, list) and len(value) == 2 and isinstance(value[0], (str, int))
            and isinstance(value[1], int) and not isinstance(value[1], bool))


def _check_value(label, spec: InputSpec, value, api, object_info, allow_missing_files) -> list[str]:
    where = f"{label}: input {spec.name!r}"
    if _is_link(value):
        source = api.get(str(value[0]))
        if source is None:
            return [f"{where} links to node {value[0]}, which is not in the prompt"]
        if not isinstance(value[0], str):
            return [f"{where} links to node {value[0]} by a number: ComfyUI looks node ids up as strings and "
                    f"refuses it; write [\"{value[0]}\", {value[1]}] (`levers run` converts it itself)"]
        source_info = object_info.get(source.get("class_type")) if isinstance(source, dict) else None
        if source_info is None:
            return []  # reported on that node
        outputs = _output_types(source_info)
        if not 0 <= value[1] < len(outputs):
            return [f"{where} links to output {value[1]} of node {value[0]} ({source['class_type']}), "
                    f"which has {len(outputs)} output(s)"]
        if not _types_compatible(outputs[value[1]], spec.type):
            got = "COMBO" if isinstance(outputs[value[1]], list) else outputs[value[1]]
            return [f"{where} expects {spec.type_name} but node {value[0]} ({source['class_type']}) "
                    f"output {value[1]} is {got}"]
        return []
    if not spec.is_widget and spec.type_name not in WIDGET_TYPES:
        return [f"{where} is a {spec.type_name} input: it takes a link [node_id, output_index], not {value!r}"]
    if isinstance(value, dict) and "__value__" in value:
        value = value["__value__"]          # ComfyUI's wrapper for a list value (a bare list reads as a link)
    kind = spec.type_name
    # converted as ComfyUI converts them before its checks: int(), float(); any value is a string or a boolean
    if kind == "INT":
        if not _convertible(int, value):
            return [f"{where} expects an integer, got {value!r}"]
        return _check_range(where, int(value), spec.options)
    if kind == "FLOAT":
        if not _convertible(float, value) or math.isnan(float(value)):
            return [f"{where} expects a number, got {value!r}"]
        return _check_range(where, float(value), spec.options)
    if kind in ("BOOLEAN", "STRING"):
        return []
    choices = spec.choices
    if choices is not None and not spec.options.get("multiselect"):
        if value not in choices:
            if allow_missing_files and isinstance(value, str) and value.lower().endswith(MODEL_FILE_SUFFIXES):
                return []
            return [_not_in_list(where, value, choices)]
    return []


def _convertible(kind, value) -> bool:
    try:
        kind(value)
    except (TypeError, ValueError, OverflowError):
        return False
    return True


def _check_range(where: str, value, options: dict) -> list[str]:
    low, high = options.get("min"), options.get("max")
    if low is not None and value < low:
        return [f"{where} = {value} is below its minimum {low}"]
    if high is not None and value > high:
        return [f"{where} = {value} is above its maximum {high}"]
    return []


def _not_in_list(where: str, value, choices: list) -> str:
    name = str(value).lower()
    if name.endswith(INPUT_FILE_SUFFIXES):
        return f"{where} = {value!r}: the server's input/ folder has no such file; {INPUT_FILE_FIX}"
    if not choices:
        return f"{where} = {value!r}: the server lists no choices (no model file of that kind installed?)"
    shown = ", ".join(repr(c) for c in choices[:12]) + (", ..." if len(choices) > 12 else "")
    hint = " (file missing from the server's models folder?)" if name.endswith(MODEL_FILE_SUFFIXES) else ""
    return f"{where} = {value!r} is not one of: {shown}{hint}"


# --------------------------------------------------------------------------------------------
# --set NODE.INPUT=VALUE
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Assignment:
    node: str
    input: str
    raw: str
    option: str = "--set"        # the command-line option it came from, which its errors name


def _split_assignment(text: str, option: str) -> Assignment | None:
    """``NODE.INPUT=VALUE`` split at the first "=" and the last dot before it; None when a part is missing."""
    key, sep, raw = text.partition("=")
    node, dot, name = key.strip().rpartition(".")
    if not sep or not dot or not node or not name:
        return None
    return Assignment(node.strip(), name.strip(), raw, option)


def parse_set(text: str) -> Assignment:
    """Parse ``NODE.INPUT=VALUE``; NODE is a node id, a title or a unique class type."""
    a = _split_assignment(text, "--set")
    if a is None:
        raise WorkflowError(f"--set {text!r}: expected NODE.INPUT=VALUE, e.g. --set 3.seed=42 or "
                            f"--set \"KSampler.steps=20\" (NODE is a node id, a title, or a class type that "
                            f"appears once)")
    return a


def parse_input(text: str) -> Assignment:
    """Parse ``--input NODE.INPUT=FILE``; the file must exist and be readable (it is uploaded once the prompt
    passes the checks)."""
    a = _split_assignment(text, "--input")
    if a is None:
        raise WorkflowError(f"--input {text!r}: expected NODE.INPUT=FILE, e.g. --input LoadImage.image=photos/cat.png "
                            f"(NODE is a node id, a title, or a class type that appears once)")
    path = os.path.expanduser(a.raw.strip())
    if not path or not os.path.isfile(path):
        raise WorkflowError(f"--input {text!r}: {path or 'FILE'} is not a file here; name a file to upload, e.g. "
                            f"--input LoadImage.image=photos/cat.png")
    a = Assignment(a.node, a.input, path, a.option)
    try:
        with open(path, "rb"):
            pass
    except OSError as exc:
        raise WorkflowError(_unreadable_input(a, exc)) from None
    return a


def _unreadable_input(a: Assignment, exc: OSError) -> str:
    """The error for an --input file that cannot be opened: parse_input checks it, the upload reads it again."""
    return (f"--input {a.node}.{a.input}={a.raw}: cannot read {a.raw}: {exc.strerror or exc}; make it readable "
            f"(check its permissions) or name another file")


def with_uploads(object_info: dict, uploads: list[Assignment]) -> dict:
    """``object_info`` with each file about to be uploaded among the choices of the combo inputs it may be set on
    (ComfyUI lists input/ files as those choices; the file is not there yet while the prompt is checked)."""
    if not uploads:
        return object_info
    info = json.loads(json.dumps(object_info))
    names = {a.input: [] for a in uploads}
    for a in uploads:
        names[a.input].append(os.path.basename(a.raw))
    for node in info.values():
        for section in ("required", "optional"):
            table = ((node.get("input") or {}).get(section) or {}) if isinstance(node, dict) else {}
            for name, spec in table.items():
                if name not in names or not isinstance(spec, list) or not spec:
                    continue
                if isinstance(spec[0], list):                 # ["a.png", ...]: the choices themselves
                    spec[0] = [*spec[0], *(n for n in names[name] if n not in spec[0])]
                elif spec[0] == "COMBO" and len(spec) > 1 and isinstance(spec[1], dict):
                    # ComfyUI 0.33's V3 combos (LoadAudio, LoadVideo, LoadImageOutput): the choices are "options"
                    options = spec[1].setdefault("options", [])
                    options.extend(n for n in names[name] if n not in options)
    return info


def find_node(api: dict, ref: str, option: str = "--set") -> str:
    """Node id for ``ref``: an id, else a title (exact, then case-insensitive), else a unique class type."""
    if ref in api:
        return ref
    for match in (lambda n: n.get("_meta", {}).get("title") == ref,
                  lambda n: str(n.get("_meta", {}).get("title", "")).lower() == ref.lower(),
                  lambda n: n.get("class_type") == ref):
        hits = [i for i, n in api.items() if match(n)]
        if len(hits) == 1:
            return hits[0]
        if len(hits) > 1:
            raise WorkflowError(f"{option}: {ref!r} matches nodes {', '.join(hits)}; use the node id instead")
    listing = [f"{i} {n.get('_meta', {}).get('title', n.get('class_type'))!r}" for i, n in api.items()]
    raise WorkflowError(f"{option}: no node {ref!r} in the workflow; nodes are:", listing)


def coerce_value(spec: InputSpec, raw: str, where: str):
    """Turn the text of a --set into the value type the input takes."""
    kind = spec.type_name
    text = raw.strip()
    if kind == "STRING":
        return raw
    if kind == "BOOLEAN":
        lowered = text.lower()
        if lowered in ("true", "1", "yes", "on"):
            return True
        if lowered in ("false", "0", "no", "off"):
            return False
        raise WorkflowError(f"{where}: expects true or false, got {raw!r}")
    if kind == "INT":
        try:
            number = float(text)
            if not number.is_integer():
                raise ValueError(text)
            value = int(text) if text.lstrip("+-").isdigit() else int(number)  # int() keeps 64-bit seeds exact
        except (ValueError, OverflowError):
            raise WorkflowError(f"{where}: expects an integer, got {raw!r}") from None
        problems = _check_range(where, value, spec.options)
        if problems:
            raise WorkflowError(problems[0])
        return value
    if kind == "FLOAT":
        try:
            value = float(text)
        except ValueError:
            raise WorkflowError(f"{where}: expects a number, got {raw!r}") from None
        if not math.isfinite(value):
            raise WorkflowError(f"{where}: expects a finite number, got {raw!r} (JSON has no NaN or infinity)")
        problems = _check_range(where, value, spec.options)
        if problems:
            raise WorkflowError(problems[0])
        return value
    choices = spec.choices
    if choices is not None:
        for choice in choices:
            if str(choice) == raw or str(choice) == text:
                return choice
        if text.lower().endswith(MODEL_FILE_SUFFIXES):
            return text  # the server names the missing file itself
        raise WorkflowError(_not_in_list(where, raw, choices))
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return raw


def _resolve_split(api: dict, a: Assignment, object_info: dict) -> Assignment:
    """``NODE.INPUT`` split at the dot that names a node with that input: input names may hold dots themselves
    (V3 dynamic inputs: ``format.crf``, ``images.image0``), node titles too. Else the first dot that names a node,
    else the last dot (the errors then say which input or node is missing)."""
    key = f"{a.node}.{a.input}"
    first = None                          # the first split that names a node: its error names the missing input
    for i, ch in enumerate(key):
        if ch != ".":
            continue
        node, name = key[:i].strip(), key[i + 1:].strip()
        try:
            node_id = find_node(api, node)
        except WorkflowError:
            continue
        first = first or Assignment(node, name, a.raw, a.option)
        info = object_info.get(api[node_id].get("class_type"))
        if info is not None and name in {s.name for s in input_specs(info, api[node_id].get("inputs") or {})}:
            return Assignment(node, name, a.raw, a.option)
    return first or a


def apply_sets(api: dict, assignments: Iterable[Assignment], object_info: dict) -> dict:
    """Return a copy of ``api`` with each --set applied; every target is checked first."""
    result = json.loads(json.dumps(api))
    for a in assignments:
        a = _resolve_split(result, a, object_info)
        node_id = find_node(result, a.node, a.option)
        node = result[node_id]
        info = object_info.get(node["class_type"])
        where = f"{a.option} {a.node}.{a.input}"
        if info is None:
            raise WorkflowError(f"{where}: node type {node['class_type']!r} is not installed on this ComfyUI "
                                f"({NOT_INSTALLED_FIX})")
        specs = {s.name: s for s in input_specs(info, node.get("inputs") or {})}
        spec = specs.get(a.input)
        if spec is None:
            raise WorkflowError(f"{where}: node {node_id} ({node['class_type']}) has no input {a.input!r}; "
                                f"inputs: {', '.join(specs) or 'none'}")
        if not spec.is_widget and spec.type_name not in WIDGET_TYPES:
            raise WorkflowError(f"{where}: {a.input!r} is a {spec.type_name} link input; {a.option} only sets "
                                f"widget values (numbers, text, choices)")
        node.setdefault("inputs", {})[a.input] = coerce_value(spec, a.raw, where)
    return result


# --------------------------------------------------------------------------------------------
# HTTP + websocket
# --------------------------------------------------------------------------------------------

def _seconds(text: str) -> float:
    """argparse type: a finite number of seconds >= 0."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not math.isfinite(v) or v < 0:
        raise argparse.ArgumentTypeError(f"{text} must be a number of seconds >= 0 (0 = wait forever)")
    return v


def normalize_server(url: str) -> str:
    """``host:port`` or an http(s) URL -> ``http[s]://host:port[/path]``; raises BadServerURL.

    Checked before anything is sent: a typo in the port otherwise surfaces as http.client's
    InvalidURL traceback, and another scheme (ftp://) as a long timeout in urllib's handler for it.
    """
    given = url
    url = url.strip()
    if "://" not in url:
        url = "http://" + url
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port                    # raises ValueError for "8l88" or a port out of range
    except ValueError as exc:
        raise BadServerURL(given, f"{exc}") from None
    if parts.scheme not in ("http", "https"):
        raise BadServerURL(given, f"only http:// and https:// are supported, not {parts.scheme}://")
    if not parts.hostname:
        raise BadServerURL(given, "it names no host")
    if any(ch.isspace() or ord(ch) < 32 for ch in url):
        raise BadServerURL(given, "it contains spaces or control characters")
    if parts.query or parts.fragment:
        raise BadServerURL(given, "it has a query or fragment; give the server's base URL")
    del port
    return url.rstrip("/")


class ComfyClient:
    """The few ComfyUI endpoints `levers run` needs."""

    def __init__(self, server: str, timeout: float = 30.0):
        self.server = normalize_server(server)
        self.timeout = timeout

    def _request(self, method: str, path: str, body: dict | None = None, raw: bytes | None = None,
                 content_type: str = "application/json") -> tuple[int, bytes]:
        data = json.dumps(body).encode() if body is not None else raw
        req = urllib.request.Request(self.server + path, data=data, method=method,
                                     headers={"Content-Type": content_type} if data else {})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()
        except (urllib.error.URLError, ConnectionError, socket.timeout, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            if isinstance(reason, ssl.SSLError) and reason.reason in PLAIN_HTTP_TLS_ERRORS:
                raise PlainHTTPAnswer(self.server, str(reason)) from None
            raise ServerUnreachable(self.server, str(reason)) from None
        except http.client.HTTPException as exc:     # something that does not speak HTTP answered
            raise NotComfyUI(self.server, f"the answer is not HTTP: {type(exc).__name__}: {exc}") from None

    def get_json(self, path: str):
        status, payload = self._request("GET", path)
        if status != 200:
            raise HTTPStatusError(f"GET {path}", status, payload)
        try:
            return json.loads(payload)
        except json.JSONDecodeError:
            raise NotComfyUI(self.server, f"GET {path} did not return JSON") from None

    def object_info(self) -> dict:
        try:
            info = self.get_json("/object_info")
        except ServerUnreachable:
            raise
        except HTTPStatusError as exc:
            if exc.status == 404:       # a web server, but not ComfyUI (or ComfyUI under another path)
                raise NotComfyUI(self.server, str(exc)) from None
            raise                       # ComfyUI answering with an error (a broken node pack, a proxy's 401/403)
        if not isinstance(info, dict):
            raise NotComfyUI(self.server, "GET /object_info is not ComfyUI's node list")
        return info

    def submit(self, api: dict, client_id: str, prompt_id: str | None = None) -> tuple[str, dict]:
        """Queue ``api``; returns (prompt id, node_errors). ``prompt_id`` (a UUID) names the prompt before it is sent,
        so an interrupt while the request is in flight can still take it out of the queue.

        ComfyUI queues a prompt when at least one output passes its validation and answers 200 with
        the failures of the others in ``node_errors`` (those outputs are skipped); all failing is a 400.
        """
        body = {"prompt": api, "client_id": client_id, **({"prompt_id": prompt_id} if prompt_id else {})}
        status, payload = self._request("POST", "/prompt", body)
        try:
            answer = json.loads(payload)
        except json.JSONDecodeError:
            answer = {}
        if status == 200 and isinstance(answer, dict) and "prompt_id" in answer:
            node_errors = answer.get("node_errors")
            return answer["prompt_id"], node_errors if isinstance(node_errors, dict) else {}
        if isinstance(answer, dict) and ("error" in answer or "node_errors" in answer):
            raise PromptRejected(answer.get("error") or {}, answer.get("node_errors") or {}, api)
        raise LeversError(f"POST /prompt answered HTTP {status}: {payload_text(payload, 500)}")

    def upload_input(self, path: str) -> str:
        """Put a file into ComfyUI's input/ folder as its page's upload button does (``POST /upload/image``, which
        takes images, videos and audio alike); returns the name ComfyUI filed it under: the same name, or a
        numbered one where a different file of that name is there already (ComfyUI never overwrites one)."""
        name = os.path.basename(path)
        with open(path, "rb") as f:
            content = f.read()
        boundary = uuid.uuid4().hex
        quoted = name.replace("\\", "\\\\").replace('"', '\\"')
        body = (f'--{boundary}\r\nContent-Disposition: form-data; name="image"; filename="{quoted}"\r\n'
                f"Content-Type: application/octet-stream\r\n\r\n").encode() + content + (
                f'\r\n--{boundary}\r\nContent-Disposition: form-data; name="type"\r\n\r\ninput\r\n'
                f"--{boundary}--\r\n").encode()
        status, payload = self._request("POST", "/upload/image", raw=body,
                                        content_type=f"multipart/form-data; boundary={boundary}")
        if status != 200:
            raise LeversError(f"uploading {path} (POST /upload/image) answered HTTP {status}: {payload_text(payload)}")
        try:
            answer = json.loads(payload)
            filed = answer["name"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise LeversError(f"uploading {path}: ComfyUI's answer names no file ({payload_text(payload)})") from None
        sub = answer.get("subfolder") or ""
        return f"{sub}/{filed}" if sub else filed

    def history(self, prompt_id: str) -> dict | None:
        return self.get_json(f"/history/{urllib.parse.quote(prompt_id)}").get(prompt_id)

    def _queued(self, prompt_id: str, section: str) -> bool | None:
        """Whether GET /queue lists ``prompt_id`` under ``section`` ("queue_pending" or "queue_running"); None when
        the queue cannot be read."""
        try:
            return any(isinstance(item, list) and len(item) > 1 and item[1] == prompt_id
                       for item in self.get_json("/queue").get(section, []))
        except (LeversError, AttributeError, TypeError):
            return None

    def cancel(self, prompt_id: str) -> str:
        """Stop ``prompt_id`` whether it still waits in ComfyUI's queue or runs (``/interrupt`` alone only stops a
        running prompt: a waiting one ran later anyway); returns what was done, for the message."""
        waiting = self._queued(prompt_id, "queue_pending")
        status, _ = self._request("POST", "/queue", {"delete": [prompt_id]})   # a waiting prompt: dropped, never runs
        # No /interrupt for a prompt taken out of the queue: builds before its prompt_id was honoured stop whatever
        # runs, another client's prompt. Unless ours started between the two requests (the delete skips it then).
        # (a queue that cannot be read now is no proof the prompt did not start: interrupt it then)
        if waiting and status == 200 and self._queued(prompt_id, "queue_running") is False:
            return "took this prompt out of ComfyUI's queue before it started"
        self._request("POST", "/interrupt", {"prompt_id": prompt_id})     # a running one: stopped, no other prompt
        return {True: "asked ComfyUI to stop this prompt (it started as it was being taken out of the queue)",
                False: "asked ComfyUI to stop this prompt"}.get(
            waiting, "asked ComfyUI to drop this prompt from its queue, or stop it if it runs")

    def view(self, filename: str, subfolder: str, kind: str) -> bytes:
        query = urllib.parse.urlencode({"filename": filename, "subfolder": subfolder, "type": kind})
        status, payload = self._request("GET", f"/view?{query}")
        if status != 200:
            raise HTTPStatusError("GET /view", status, payload)
        return payload

    def ws_url(self, client_id: str) -> str:
        parsed = urllib.parse.urlsplit(self.server)
        scheme = "wss" if parsed.scheme == "https" else "ws"
        return f"{scheme}://{parsed.netloc}{parsed.path}/ws?clientId={client_id}"


class WebSocketClosed(ConnectionError):
    pass


class WebSocket:
    """A minimal RFC 6455 client: text/binary frames in, pong/close out. Enough for ComfyUI's /ws."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._buffer = b""

    @classmethod
    def connect(cls, url: str, timeout: float = 10.0) -> "WebSocket":
        parsed = urllib.parse.urlsplit(url)
        secure = parsed.scheme == "wss"
        host, port = parsed.hostname, parsed.port or (443 if secure else 80)
        sock = socket.create_connection((host, port), timeout=timeout)
        if secure:
            sock = ssl.create_default_context().wrap_socket(sock, server_hostname=host)
        key = base64.b64encode(os.urandom(16)).decode()
        path = parsed.path + ("?" + parsed.query if parsed.query else "")
        request = (f"GET {path} HTTP/1.1\r\nHost: {parsed.netloc}\r\nUpgrade: websocket\r\n"
                   f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n")
        sock.sendall(request.encode())
        ws = cls(sock)
        head = ws._read_until(b"\r\n\r\n")
        status_line = head.split(b"\r\n", 1)[0].decode(errors="replace")
        if " 101 " not in status_line + " ":
            sock.close()
            raise WebSocketClosed(f"websocket handshake refused: {status_line}")
        return ws

    def _read_until(self, marker: bytes) -> bytes:
        while marker not in self._buffer:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise WebSocketClosed("connection closed during handshake")
            self._buffer += chunk
        head, _, self._buffer = self._buffer.partition(marker)
        return head

    def _read_exact(self, n: int) -> bytes:
        while len(self._buffer) < n:
            chunk = self.sock.recv(max(65536, n - len(self._buffer)))
            if not chunk:
                raise WebSocketClosed("server closed the websocket")
            self._buffer += chunk
        data, self._buffer = self._buffer[:n], self._buffer[n:]
        return data

    def _send(self, opcode: int, payload: bytes = b"") -> None:
        mask = os.urandom(4)  # clients must mask every frame
        header = bytes([0x80 | opcode])
        n = len(payload)
        if n < 126:
            header += bytes([0x80 | n])
        elif n < 1 << 16:
            header += bytes([0x80 | 126]) + struct.pack(">H", n)
        else:
            header += bytes([0x80 | 127]) + struct.pack(">Q", n)
        masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
        self.sock.sendall(header + mask + masked)

    def recv(self, timeout: float | None) -> tuple[int, bytes] | None:
        """Next complete message as (opcode, payload); None on timeout (nothing consumed)."""
        self.sock.settimeout(timeout)
        message, opcode = b"", None
        while True:
            try:
                first = self._read_exact(2)
            except socket.timeout:
                if opcode is None and not message:
                    return None
                raise
            self.sock.settimeout(30.0)  # the rest of a started frame arrives promptly
            fin, op = first[0] & 0x80, first[0] & 0x0F
            n = first[1] & 0x7F
            if n == 126:
                n = struct.unpack(">H", self._read_exact(2))[0]
            elif n == 127:
                n = struct.unpack(">Q", self._read_exact(8))[0]
            mask = self._read_exact(4) if first[1] & 0x80 else None
            payload = self._read_exact(n)
            if mask:
                payload = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
            if op == 0x8:
                raise WebSocketClosed("server closed the websocket")
            if op == 0x9:
                self._send(0xA, payload)
                continue
            if op == 0xA:
                continue
            if op != 0x0:
                opcode = op
            message += payload
            if fin:
                return opcode or 0x1, message

    def close(self) -> None:
        try:
            self._send(0x8, struct.pack(">H", 1000))
        except OSError:
            pass  # already gone; closing is best effort
        self.sock.close()


# --------------------------------------------------------------------------------------------
# Running a prompt
# --------------------------------------------------------------------------------------------

class Progress:
    """Live progress on a terminal (one rewritten line) or plain lines when piped."""

    def __init__(self, api: dict, stream=None, quiet: bool = False):
        self.api = api
        self.stream = stream if stream is not None else sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.quiet = quiet
        self.total = len(_needed_nodes(api))
        self.done: set[str] = set()
        self.node: str | None = None
        self._last_quarter = -1
        self._open_line = False

    def _title(self, node_id: str) -> str:
        node = self.api.get(str(node_id), {})
        title = node.get("_meta", {}).get("title") or node.get("class_type", "?")
        return f"#{node_id} {title}"

    def _emit(self, text: str, transient: bool = False) -> None:
        if self.quiet:
            return
        if self.tty:
            self.stream.write("\r\x1b[2K" + text + ("" if transient else "\n"))
            self._open_line = transient
        elif not transient:
            self.stream.write(text + "\n")
        self.stream.flush()

    def cached(self, nodes: Iterable[str]) -> None:
        nodes = [str(n) for n in nodes]
        self.done.update(nodes)
        if nodes:
            self._emit(f"cached: {len(nodes)} node(s) reused from the last run")

    def executing(self, node_id: str) -> None:
        if self.node is not None:
            self.done.add(self.node)
        self.node = str(node_id)
        self._last_quarter = -1
        step = min(len(self.done) + 1, max(self.total, 1))
        self._emit(f"[{step}/{self.total}] {self._title(node_id)}")

    def step(self, node_id, value: int, maximum: int) -> None:
        maximum = max(int(maximum), 1)
        pct = 100.0 * value / maximum
        bar = "#" * int(pct // 5) + "-" * (20 - int(pct // 5))
        text = f"    {self._title(node_id)} [{bar}] {value}/{maximum} {pct:3.0f}%"
        quarter = int(pct // 25)
        if self.tty:
            self._emit(text, transient=value < maximum)
        elif quarter != self._last_quarter:
            self._emit(text)
        self._last_quarter = quarter

    def finish(self) -> None:
        if self._open_line and not self.quiet:
            self.stream.write("\n")
            self._open_line = False


def _needed_nodes(api: dict) -> set[str]:
    """Nodes an execution would run: ancestors of output-looking nodes (all nodes when unknown)."""
    consumers = set()
    for node in api.values():
        for value in (node.get("inputs") or {}).values():
            if _is_link(value):
                consumers.add(str(value[0]))
    sinks = [i for i in api if i not in consumers]
    seen: set[str] = set()
    stack = list(sinks)
    while stack:
        node_id = stack.pop()
        if node_id in seen or node_id not in api:
            continue
        seen.add(node_id)
        for value in (api[node_id].get("inputs") or {}).values():
            if _is_link(value):
                stack.append(str(value[0]))
    return seen or set(api)


@dataclass
class RunResult:
    prompt_id: str
    # "success" | "partial" (ran, but ComfyUI skipped outputs that failed its validation: node_errors)
    # | "incomplete" (ran, but some of its files could not be downloaded: download_errors)
    # | "error" | "interrupted" | "timeout"
    status: str
    files: list[str] = field(default_factory=list)
    reports: dict[str, list[str]] = field(default_factory=dict)   # "#id title" -> texts
    error: dict | None = None
    outputs: dict = field(default_factory=dict)
    node_errors: dict = field(default_factory=dict)              # ComfyUI's, for the outputs it skipped
    download_errors: list[str] = field(default_factory=list)     # one line per file not saved into out_dir


def run_prompt(client: ComfyClient, api: dict, *, out_dir: str | None, timeout: float | None = None,
               progress: Progress | None = None, use_websocket: bool = True, poll_interval: float = 0.5
               ) -> RunResult:
    """Submit ``api``, follow it to the end, download its files into ``out_dir``."""
    progress = progress or Progress(api, quiet=True)
    client_id = uuid.uuid4().hex
    ws = None
    if use_websocket:
        try:
            ws = WebSocket.connect(client.ws_url(client_id), timeout=client.timeout)
            _await_registration(ws)
        except (OSError, WebSocketClosed):
            ws = None  # fall back to polling /history
    prompt_id = str(uuid.uuid4())     # ours, so a Ctrl-C while /prompt is in flight can still cancel it
    try:
        try:
            prompt_id, node_errors = client.submit(api, client_id, prompt_id)
            deadline = None if not timeout else time.monotonic() + timeout
            status, error = _follow(client, ws, prompt_id, progress, deadline, poll_interval)
        except KeyboardInterrupt:
            try:
                done = client.cancel(prompt_id)
            except (ServerUnreachable, KeyboardInterrupt):
                done = f"could not reach ComfyUI to stop prompt {prompt_id}: it may still run"
            raise Interrupted(done, prompt_id) from None
    finally:
        progress.finish()
        if ws is not None:
            ws.close()
    result = RunResult(prompt_id=prompt_id, status=status, error=error, node_errors=node_errors)
    if status == "timeout":
        return result
    try:
        entry = _final_history(client, prompt_id)
        result.outputs = entry.get("outputs") or {}
        if status == "success" and (entry.get("status") or {}).get("status_str") == "error":
            status = result.status = "error"
        if status == "success" and node_errors:
            status = result.status = "partial"
        if result.error is None and status != "success":
            result.error = _error_from_history(entry)
        result.reports = collect_reports(api, result.outputs)
        if out_dir is not None:
            for path, problem in iter_downloads(client, result.outputs, out_dir):
                if path is not None:
                    result.files.append(path)
                else:
                    result.download_errors.append(problem)
    except KeyboardInterrupt:
        # the prompt is over on the server: there is nothing to cancel, only downloads to stop
        saved = f"{len(result.files)} file(s) saved into {out_dir}" if out_dir is not None else "nothing downloaded"
        raise Interrupted(f"prompt {prompt_id} had finished on the server; stopped its downloads with {saved}",
                          prompt_id, result.files) from None
    if status == "success" and result.download_errors:
        result.status = "incomplete"
    return result


def _await_registration(ws: "WebSocket", wait_s: float = 5.0) -> None:
    """Wait (bounded) for the server's first message. ComfyUI answers the handshake before it files the socket
    under our client id and sends ``status`` right after filing it; a prompt submitted in between runs with
    its progress messages sent to nobody. Nothing is lost by waiting: no prompt of ours exists yet."""
    end = time.monotonic() + wait_s
    while time.monotonic() < end:
        message = ws.recv(timeout=max(0.01, end - time.monotonic()))
        if message is None or message[0] == 0x1:
            return


def _final_history(client: ComfyClient, prompt_id: str, wait_s: float = 30.0) -> dict:
    """The /history entry of a finished prompt.

    The websocket reports success before the server's worker files the history entry, so the entry
    may lag the message by a moment; wait for it (bounded) rather than report no outputs.
    """
    end = time.monotonic() + wait_s
    while True:
        entry = client.history(prompt_id)
        if entry and ((entry.get("status") or {}).get("completed") is not None or entry.get("outputs")):
            return entry
        if time.monotonic() >= end:
            return entry or {}
        time.sleep(0.05)


def _follow(client, ws, prompt_id, progress, deadline, poll_interval) -> tuple[str, dict | None]:
    """Wait for the prompt to end; returns (status, error message data)."""
    last_history_check = time.monotonic()
    while True:
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            return "timeout", None
        wait = poll_interval if deadline is None else max(0.01, min(poll_interval, deadline - now))
        if ws is not None:
            try:
                message = ws.recv(timeout=wait)
            except (OSError, WebSocketClosed):
                ws = None  # lost the websocket mid-run: keep following through /history
                continue
            if message is not None and message[0] == 0x1:
                outcome = _on_message(json.loads(message[1]), prompt_id, progress)
                if outcome is not None:
                    return outcome
            # Safety net: a message missed while connecting must not hang the client.
            if time.monotonic() - last_history_check < 5.0:
                continue
        else:
            time.sleep(wait)
        last_history_check = time.monotonic()
        entry = client.history(prompt_id)
        if entry and (entry.get("status") or {}).get("completed") is not None:
            st = entry.get("status") or {}
            if st.get("status_str") == "error" or st.get("completed") is False:
                err = _error_from_history(entry)
                interrupted = any(m[0] == "execution_interrupted" for m in st.get("messages", []))
                return ("interrupted" if interrupted else "error"), err
            return "success", None
        if entry and entry.get("outputs") and not entry.get("status"):
            return "success", None  # very old servers write no status


def _on_message(msg: dict, prompt_id: str, progress: Progress):
    kind, data = msg.get("type"), msg.get("data") or {}
    if data.get("prompt_id") not in (prompt_id, None):
        return None
    if kind == "execution_cached":
        progress.cached(data.get("nodes") or [])
    elif kind == "executing":
        if data.get("node") is None:
            if data.get("prompt_id") == prompt_id:
                return "success", None
        else:
            progress.executing(str(data.get("display_node") or data["node"]))
    elif kind == "progress" and data.get("max"):
        progress.step(data.get("node") or progress.node or "?", int(data.get("value", 0)), int(data["max"]))
    elif kind == "execution_success" and data.get("prompt_id") == prompt_id:
        return "success", None
    elif kind == "execution_error" and data.get("prompt_id") == prompt_id:
        return "error", data
    elif kind == "execution_interrupted" and data.get("prompt_id") == prompt_id:
        return "interrupted", data
    return None


def _error_from_history(entry: dict) -> dict | None:
    for event, data in (entry.get("status") or {}).get("messages", []) or []:
        if event in ("execution_error", "execution_interrupted"):
            return data
    return None


def collect_reports(api: dict, outputs: dict) -> dict[str, list[str]]:
    """Text the Levers nodes showed (their ui output, or a "Preview as Text" wired to one), by "#id title"."""
    reports: dict[str, list[str]] = {}
    for node_id, ui in outputs.items():
        node = api.get(str(node_id), {})
        owner_id = str(node_id)
        if not str(node.get("class_type", "")).startswith("Levers"):
            source = (node.get("inputs") or {}).get("source")
            if not (_is_link(source) and str(api.get(str(source[0]), {}).get("class_type", "")).startswith("Levers")):
                continue
            owner_id = str(source[0])  # a PreviewAny showing a Levers report
        owner = api[owner_id]
        title = f"#{owner_id} {owner.get('_meta', {}).get('title') or owner.get('class_type')}"
        for value in (ui or {}).values():
            items = value if isinstance(value, list) else [value]
            for text in items:
                if isinstance(text, str) and text.strip() and text not in reports.get(title, []):
                    reports.setdefault(title, []).append(text)
    return dict(sorted(reports.items(), key=lambda kv: _id_sort_key(kv[0][1:].split(" ", 1)[0])))


class DownloadFailed(LeversError, RuntimeError):
    """Some files of a run could not be downloaded; ``saved`` are the ones that were, ``failed`` says why not."""

    def __init__(self, saved: list[str], failed: list[str]):
        self.saved, self.failed = saved, failed
        super().__init__(f"could not download {len(failed)} of {len(failed) + len(saved)} file(s) (the others are "
                         f"saved):\n" + "\n".join(f"  - {problem}" for problem in failed))


def download_outputs(client: ComfyClient, outputs: dict, out_dir: str) -> list[str]:
    """Fetch every file the run produced into ``out_dir`` (see iter_downloads); returns the paths saved. A file that
    fails does not stop the others: DownloadFailed comes after them, with what was saved."""
    saved, failed = [], []
    for path, problem in iter_downloads(client, outputs, out_dir):
        if path is not None:
            saved.append(path)
        else:
            failed.append(problem)
    if failed:
        raise DownloadFailed(saved, failed)
    return saved


def iter_downloads(client: ComfyClient, outputs: dict, out_dir: str) -> Iterator[tuple[str | None, str | None]]:
    """Fetch every file the run produced (images, videos, latents, ...) through /view, yielding (path saved, None)
    or (None, why not) per file. Previews (PreviewImage and the like, which ComfyUI writes to its temp folder) go
    into a ``preview/`` folder of their own, apart from the outputs the workflow saves. Each file is written to a
    temporary name beside it and renamed, so a Ctrl-C or a full disk never leaves a truncated one."""
    root = Path(out_dir)
    for ui in outputs.values():
        for value in (ui or {}).values():
            if not isinstance(value, list):
                continue
            for item in value:
                if not (isinstance(item, dict) and item.get("filename")):
                    continue
                name = os.path.basename(str(item["filename"]))
                subfolder = str(item.get("subfolder") or "")
                kind = str(item.get("type") or "output")
                label = f"{subfolder}/{name}" if subfolder else name
                target = root / "preview" if kind == "temp" else root
                folder = target / subfolder if subfolder else target
                if not folder.resolve().is_relative_to(target.resolve()):
                    folder = target          # a subfolder the server names must not lead out of --out
                try:
                    payload = client.view(str(item["filename"]), subfolder, kind)
                    folder.mkdir(parents=True, exist_ok=True)
                    saved, problem = str(_write_whole(_unique_path(folder / name), payload)), None
                except ServerUnreachable as exc:
                    saved, problem = None, f"could not download {label}: ComfyUI stopped answering ({exc.reason})"
                except LeversError as exc:
                    saved, problem = None, f"could not download {label} ({exc})"
                except OSError as exc:
                    saved, problem = None, f"could not save {label} into {folder}: {exc.strerror or exc}"
                yield saved, problem


def _write_whole(path: Path, payload: bytes) -> Path:
    """Write ``payload`` to ``path`` whole or not at all: into a hidden temporary file beside it, then renamed."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.part")
    try:
        with open(tmp, "xb") as f:
            f.write(payload)
        os.replace(tmp, path)
    except BaseException:            # a Ctrl-C as well as a full disk: no partial file is left behind
        tmp.unlink(missing_ok=True)
        raise
    return path


def _unique_path(path: Path) -> Path:
    if not path.exists():
        return path
    for i in range(1, 100000):
        candidate = path.with_name(f"{path.stem}_{i}{path.suffix}")
        if not candidate.exists():
            return candidate
    raise LeversError(f"too many files named like {path}")


def format_prompt_error(error: dict, node_errors: dict, api: dict) -> str:
    """ComfyUI's /prompt validation error, one line per problem, with node titles."""
    lines = []
    if error:
        head = error.get("message") or error.get("type") or "invalid prompt"
        details = error.get("details")
        lines.append(f"ComfyUI rejected the prompt: {head}" + (f": {details}" if details else ""))
    else:
        lines.append("ComfyUI rejected the prompt")
    lines += format_node_errors(node_errors, api)
    return "\n".join(lines)


def _api_label(api: dict, node_id, class_type=None) -> str:
    node = api.get(str(node_id), {}) if isinstance(api.get(str(node_id)), dict) else {}
    kind = class_type or node.get("class_type") or "?"
    title = (node.get("_meta") or {}).get("title")
    return f"node {node_id} ({kind}{', ' + repr(title) if title and title != kind else ''})"


def format_node_errors(node_errors: dict, api: dict) -> list[str]:
    """One "  - node ID (Class, 'title'): message: details" line per error ComfyUI listed."""
    lines = []
    for node_id, info in (node_errors or {}).items():
        info = info if isinstance(info, dict) else {}
        label = _api_label(api, node_id, info.get("class_type"))
        for err in info.get("errors") or [{}]:
            msg = err.get("message", "") or "failed validation"
            details = err.get("details")
            lines.append(f"  - {label}: {msg}" + (f": {details}" if details else ""))
    return lines


def skipped_outputs(node_errors: dict) -> list[str]:
    """The output nodes ComfyUI did not run because they depend on a node in ``node_errors``."""
    outs = {str(o) for info in (node_errors or {}).values() if isinstance(info, dict)
            for o in info.get("dependent_outputs") or []}
    return sorted(outs, key=_id_sort_key)


def format_execution_error(error: dict | None, status: str) -> str:
    if not error:
        return f"the prompt ended with status {status!r} (no error details in /history)"
    where = f"node {error.get('node_id')} ({error.get('node_type')})"
    if status == "interrupted":
        return f"execution was interrupted at {where}"
    text = f"execution failed at {where}: {error.get('exception_type', 'Error')}: {error.get('exception_message', '')}"
    return text.rstrip()


# --------------------------------------------------------------------------------------------
# Loading workflows and the CLI
# --------------------------------------------------------------------------------------------

EXAMPLES_DIR = Path(__file__).resolve().parent.parent / "example_workflows"


def resolve_workflow_path(name: str) -> Path:
    """A path, or the name of a shipped example (``flux1_dev_16gb`` finds example_workflows/api/...)."""
    path = Path(name)
    if path.is_file():
        return path
    if path.is_dir():
        raise WorkflowError(f"workflow {name!r} is a folder: give a workflow .json file in it, or a shipped example's "
                            "name")
    stem = path.stem if path.suffix == ".json" else path.name
    # only a bare name is a shipped example's: a path with a folder that does not exist is a typo in the path to
    # the user's own file, which must not run the shipped example of the same name
    for candidate in (EXAMPLES_DIR / "api" / f"{stem}.json", EXAMPLES_DIR / f"{stem}.json"):
        if len(path.parts) == 1 and candidate.is_file():
            return candidate
    shipped = sorted(p.stem for p in (EXAMPLES_DIR / "api").glob("*.json")) if (EXAMPLES_DIR / "api").is_dir() else []
    hint = f" Shipped examples: {', '.join(shipped)}." if shipped else ""
    raise WorkflowError(f"workflow file {name!r} not found.{hint}")


_UTF16_BOMS = (b"\xff\xfe", b"\xfe\xff")


def load_workflow(path: Path) -> dict:
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise WorkflowError(f"cannot read workflow file {path}: {exc.strerror or exc}") from None
    try:
        text = raw.decode("utf-8-sig")          # a UTF-8 byte-order mark (some Windows editors) is fine
    except UnicodeDecodeError as exc:
        found = "it starts with a UTF-16 byte-order mark" if raw.startswith(_UTF16_BOMS) else (
            f"byte {exc.start} is not valid UTF-8")
        raise WorkflowError(f"{path}: not a UTF-8 JSON workflow ({found}); save it as UTF-8 JSON (what ComfyUI's "
                            f"Save and Export (API) write)") from None
    if not text.strip():
        raise WorkflowError(f"{path} is empty; expected a workflow saved from ComfyUI (Save, or Export (API))")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise WorkflowError(f"{path}: not valid JSON ({exc}); expected a UTF-8 JSON workflow") from None
    if isinstance(data, dict) and isinstance(data.get("prompt"), dict) and not is_ui_format(data):
        data = data["prompt"]  # a saved /prompt request body
    if not isinstance(data, dict):
        raise WorkflowError(f"{path}: expected a JSON object (UI or API format workflow)")
    return data


def prepare_prompt(workflow: dict, object_info: dict, sets: Iterable[str] = (), validate: bool = True,
                   inputs: Iterable[Assignment] = ()) -> dict:
    """UI or API workflow + --set assignments + --input files (set to the file's name) -> a checked API prompt;
    raises WorkflowError."""
    if is_ui_format(workflow):
        try:
            api = ui_to_api(workflow, object_info)
        except WorkflowError:
            raise
        except (KeyError, IndexError, TypeError, AttributeError, ValueError) as exc:
            # _check_ui_structure catches the malformed files seen so far; this names any other shape it misses.
            raise WorkflowError(f"the UI workflow is malformed ({type(exc).__name__}: {exc}); re-save it from "
                                f"ComfyUI or export it with Workflow > Export (API)") from None
    else:
        api = json.loads(json.dumps(workflow))
        require_api_shape(api)
    api = normalize_links(api)
    files = [Assignment(a.node, a.input, os.path.basename(a.raw), a.option) for a in inputs]
    api = apply_sets(api, [*(parse_set(s) for s in sets), *files], object_info)
    if validate:
        problems = validate_api(api, object_info)
        if problems:
            raise WorkflowError("the workflow is not valid for this ComfyUI (nothing was submitted):", problems)
    return api


def normalize_links(api: dict) -> dict:
    """Links written with a number as node id (``[1, 0]``) as ComfyUI takes them (``["1", 0]``).

    ComfyUI's validation looks the source node up as ``prompt[node_id]`` and the prompt's keys are JSON
    object keys, i.e. strings: a numeric id fails there ("Exception when validating node"). Only
    two-element lists whose first item is an integer naming a node of the prompt are touched.
    """
    for node in api.values():
        inputs = node.get("inputs") if isinstance(node, dict) else None
        if not isinstance(inputs, dict):
            continue
        for name, value in inputs.items():
            if _is_link(value) and not isinstance(value[0], (str, bool)) and str(value[0]) in api:
                inputs[name] = [str(value[0]), value[1]]
    return api


def check_out_dir(out: str) -> str | None:
    """Why ``--out`` cannot hold the downloads (None when it can), checked before anything is submitted."""
    path = Path(out)
    if path.exists():
        if not path.is_dir():
            return f"--out {out} is a file, not a folder: name a folder for the downloads (created if missing)"
        return None if os.access(path, os.W_OK | os.X_OK) else f"--out {out}: cannot write into this folder"
    parent = path.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        return f"--out {out}: {parent} is a file, so the folder cannot be created there"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"--out {out}: cannot create the folder (no write permission in {parent})"
    return None


def register_cli(subparsers) -> argparse.ArgumentParser:
    """Add ``levers run`` to the CLI's subparsers."""
    p = subparsers.add_parser(
        "run", help="run a workflow on a running ComfyUI (headless), with live progress",
        description="Submit a workflow (API or UI format, or the name of a shipped example) to a running "
                    "ComfyUI, follow it live, download its outputs and print the Levers reports.")
    p.add_argument("workflow", help="workflow JSON (API or UI format) or a shipped example name")
    p.add_argument("--server", default=os.environ.get("COMFYUI_URL", DEFAULT_SERVER),
                   help=f"ComfyUI URL (default: $COMFYUI_URL or {DEFAULT_SERVER})")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="NODE.INPUT=VALUE",
                   help="override a widget value; NODE is a node id, a title, or a class type that appears once "
                        "(repeatable)")
    p.add_argument("--input", dest="inputs", action="append", default=[], metavar="NODE.INPUT=FILE",
                   help="upload FILE into ComfyUI's input/ folder and set NODE.INPUT to it, e.g. "
                        "--input LoadImage.image=cat.png (repeatable; uploaded after the checks pass)")
    p.add_argument("--out", default="levers_output", help="folder for downloaded outputs (default: levers_output)")
    p.add_argument("--timeout", type=_seconds, default=0,
                   help="give up waiting after this many seconds (0 = wait forever); exit code 124")
    p.add_argument("--no-validate", action="store_true",
                   help="skip the local check against /object_info (the server still validates)")
    p.add_argument("--dry-run", action="store_true", help="convert, apply --set and validate, then print the "
                   "API prompt instead of running it")
    p.add_argument("--poll", action="store_true", help="poll /history instead of using the websocket")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.add_argument("--json", dest="json_summary", action="store_true",
                   help="print a JSON summary (prompt id, status, files, reports) on stdout")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    """Entry point of ``levers run``; returns the process exit code."""
    err = sys.stderr
    try:
        client = ComfyClient(args.server)
        out_problem = None if args.dry_run else check_out_dir(args.out)
        if out_problem:
            raise WorkflowError(out_problem + "; nothing was submitted")
        workflow = load_workflow(resolve_workflow_path(args.workflow))
        # what needs no server is checked before asking it (a bad --set is not "cannot reach ComfyUI")
        for text in args.sets:
            parse_set(text)
        uploads = [parse_input(text) for text in args.inputs]
        if not workflow:
            raise WorkflowError(validate_api(workflow, {})[0])
        if not is_ui_format(workflow):
            require_api_shape(workflow)
        # an API prompt printed unchecked and unchanged needs nothing from the server (a UI file, a check, --set and
        # --input read its node list)
        offline = args.dry_run and args.no_validate and not is_ui_format(workflow) and not args.sets and not uploads
        object_info = {} if offline else client.object_info()
        api = prepare_prompt(workflow, with_uploads(object_info, uploads), args.sets, validate=not args.no_validate,
                             inputs=uploads)
        if not args.dry_run:
            for a in uploads:         # only now that the prompt passed: a rejected one leaves no file behind
                try:
                    filed = client.upload_input(a.raw)
                except ServerUnreachable:
                    raise
                except OSError as exc:        # the file changed since parse_input opened it
                    raise WorkflowError(_unreadable_input(a, exc) + "; nothing was submitted") from None
                api[find_node(api, a.node, a.option)]["inputs"][a.input] = filed
    except KeyboardInterrupt as exc:
        return _interrupted(args, err, exc)
    except BadServerURL as exc:
        return _fail(args, err, "invalid", exc, EXIT_INVALID)
    except ServerUnreachable as exc:
        return _fail(args, err, "unreachable", exc, EXIT_UNREACHABLE)
    except WorkflowError as exc:
        return _fail(args, err, "invalid", exc, EXIT_INVALID)
    except LeversError as exc:
        return _fail(args, err, "error", exc, EXIT_FAILED)
    if args.dry_run:
        print(json.dumps(api, indent=2))
        return EXIT_OK
    progress = Progress(api, stream=err, quiet=args.quiet)
    try:
        result = run_prompt(client, api, out_dir=args.out, timeout=args.timeout or None, progress=progress,
                            use_websocket=not args.poll)
    except PromptRejected as exc:
        return _fail(args, err, "rejected", exc, EXIT_FAILED)
    except ServerUnreachable as exc:
        return _fail(args, err, "unreachable", f"lost the server during the run: {exc}", EXIT_UNREACHABLE)
    except KeyboardInterrupt as exc:
        return _interrupted(args, err, exc)
    except LeversError as exc:
        return _fail(args, err, "error", exc, EXIT_FAILED)
    _print_result(result, args, err, api)
    return {"success": EXIT_OK, "timeout": EXIT_TIMEOUT}.get(result.status, EXIT_FAILED)


def _interrupted(args, err, exc: KeyboardInterrupt) -> int:
    """Ctrl-C: what became of the prompt (nothing was submitted unless ``exc`` is an Interrupted saying otherwise)
    and the files saved by then."""
    if isinstance(exc, Interrupted):
        done, prompt_id, files = exc.done, exc.prompt_id, exc.files
    else:
        done, prompt_id, files = "nothing was submitted", None, []
    print(f"\ninterrupted: {done}", file=err)
    for path in files:
        print(f"  {path}", file=err)
    _json_error(args, "interrupted", done, prompt_id, files)
    return EXIT_INTERRUPTED


def _json_error(args, status: str, message, prompt_id: str | None = None, files: Iterable[str] = ()) -> None:
    """With --json, a run that ends before a result still prints a JSON object on stdout, for scripts."""
    if getattr(args, "json_summary", False):
        print(json.dumps({"prompt_id": prompt_id, "status": status, "files": list(files), "reports": {},
                          "error": str(message), "node_errors": {}, "download_errors": []}, indent=2))


def _fail(args, err, status: str, message, code: int) -> int:
    print(f"error: {message}", file=err)
    _json_error(args, status, message)
    return code


def _print_result(result: RunResult, args, err, api: dict | None = None) -> None:
    for title, texts in result.reports.items():
        print(f"--- Levers report: {title}", file=err if args.json_summary else sys.stdout)
        for text in texts:
            print(text, file=err if args.json_summary else sys.stdout)
    if result.status == "timeout":
        print(f"error: still running after {args.timeout:g} s (prompt {result.prompt_id} stays queued on the "
              f"server; POST /interrupt to stop it)", file=err)
    elif result.status == "partial":
        skipped = skipped_outputs(result.node_errors)
        which = ", ".join(_api_label(api or {}, o) for o in skipped) or "some outputs"
        print(f"error: ComfyUI skipped {which}: its validation failed on the node(s) below (the other outputs "
              f"ran):", file=err)
        for line in format_node_errors(result.node_errors, api or {}):
            print(line, file=err)
        _print_downloads(result, args, err)
    elif result.status == "incomplete":
        print(f"error: prompt {result.prompt_id} ran, but not all of its files could be downloaded:", file=err)
        _print_downloads(result, args, err)
    elif result.status != "success":
        print(f"error: {format_execution_error(result.error, result.status)}", file=err)
        tb = (result.error or {}).get("traceback")
        if tb and not args.quiet:
            print("".join(tb[-3:]).rstrip(), file=err)
        _print_downloads(result, args, err)
    elif not args.quiet:
        where = f" into {args.out}" if result.files else ""
        print(f"done: prompt {result.prompt_id}, {len(result.files)} file(s) saved{where}", file=err)
        for path in result.files:
            print(f"  {path}", file=err)
    if args.json_summary:
        print(json.dumps({"prompt_id": result.prompt_id, "status": result.status, "files": result.files,
                          "reports": result.reports, "error": result.error, "node_errors": result.node_errors,
                          "download_errors": result.download_errors}, indent=2, default=str))


def _print_downloads(result: RunResult, args, err) -> None:
    """After an error line: the files that could not be downloaded, then those saved from the outputs that ran."""
    for problem in result.download_errors:
        print(f"  - {problem}", file=err)
    if result.files:
        print(f"saved {len(result.files)} file(s) from the outputs that ran into {args.out}", file=err)
        for path in result.files:
            print(f"  {path}", file=err)
