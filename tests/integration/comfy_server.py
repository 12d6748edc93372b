"""Start a real headless ComfyUI (a subprocess on 127.0.0.1) with the Levers pack installed.

Everything lives in a throw-away base directory (``--base-directory``): custom_nodes/ holds a
symlink to this checkout as ``ComfyUI-Levers``, models/ the tiny test models, output/ what the
graphs save. ComfyUI's own checkout is never written to (the database is in memory).
Used by test_server_e2e.py and by make_workflows.py.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

PACK_ROOT = Path(__file__).resolve().parents[2]
STUBS = Path(__file__).resolve().parent / "stubs"
TEST_NODES = Path(__file__).resolve().parent / "levers_test_nodes"
MODEL_KINDS = ("diffusion_models", "unet", "vae", "text_encoders", "clip", "checkpoints", "loras")  # as a fresh install has


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def comfyui_path() -> tuple[str | None, str]:
    """(path, reason): the ComfyUI named by COMFYUI_PATH, or None and why not."""
    path = os.environ.get("COMFYUI_PATH")
    if not path:
        return None, "COMFYUI_PATH is not set: point it at a ComfyUI checkout to run the server tests"
    if not os.path.isfile(os.path.join(path, "main.py")):
        return None, f"COMFYUI_PATH={path} has no main.py"
    return path, ""


class ComfyServer:
    """A ComfyUI subprocess: ``start()``, ``url``, ``get``/``post``, ``rss()``, ``stop()``."""

    def __init__(self, comfy_path: str, base_dir: str | None = None, python: str | None = None,
                 extra_args: tuple[str, ...] = (), test_nodes: bool = True):
        self.comfy_path = os.path.abspath(comfy_path)
        self._own_base = base_dir is None
        self.base_dir = Path(base_dir or tempfile.mkdtemp(prefix="levers_comfy_"))
        self.python = python or sys.executable
        self.extra_args = tuple(extra_args)
        self.test_nodes = test_nodes
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.log_path = self.base_dir / "server.log"

    @property
    def models_dir(self) -> Path:
        return self.base_dir / "models"

    @property
    def output_dir(self) -> Path:
        return self.base_dir / "output"

    def start(self, timeout: float = 240.0) -> "ComfyServer":
        (self.base_dir / "custom_nodes").mkdir(parents=True, exist_ok=True)
        for kind in MODEL_KINDS:
            (self.models_dir / kind).mkdir(parents=True, exist_ok=True)
        for name, target in (("ComfyUI-Levers", PACK_ROOT), ("levers_test_nodes", TEST_NODES)):
            link = self.base_dir / "custom_nodes" / name
            if self.test_nodes or name == "ComfyUI-Levers":
                if not link.exists():
                    link.symlink_to(target, target_is_directory=True)
        env = dict(os.environ)
        if not _has_module(self.python, "torchaudio"):
            # ComfyUI 0.33 imports torchaudio at start-up; this stand-in is import-only, tests only.
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(STUBS), env.get("PYTHONPATH")]))
        cmd = [self.python, "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(self.port),
               "--base-directory", str(self.base_dir), "--disable-auto-launch",
               "--database-url", "sqlite:///:memory:", *self.extra_args]
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, cwd=self.comfy_path, env=env, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ComfyUI exited with code {self.proc.returncode} during start-up:\n"
                                   + self.log_tail())
            try:
                self.get("/system_stats")
                return self
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"ComfyUI did not answer within {timeout:.0f} s:\n" + self.log_tail())

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def get(self, path: str):
        with urllib.request.urlopen(self.url + path, timeout=60) as resp:
            return json.loads(resp.read())

    def post(self, path: str, body: dict):
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                payload = resp.read()
                return resp.status, (json.loads(payload) if payload.strip() else {})
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"{}")

    def rss(self) -> int:
        """Resident memory of the server process in bytes (psutil)."""
        import psutil

        return psutil.Process(self.proc.pid).memory_info().rss

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=20)
        if getattr(self, "_log", None):
            self._log.close()
        if self._own_base:
            shutil.rmtree(self.base_dir, ignore_errors=True)


def _has_module(python: str, name: str) -> bool:
    """Whether ``python`` imports the real ``name`` (probed in a clean child: this process may
    already have the test stand-in on sys.path)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    probe = subprocess.run([python, "-c", f"import importlib.util,sys; sys.exit(importlib.util.find_spec('{name}') is None)"],
                           capture_output=True, env=env, cwd=tempfile.gettempdir())
    return probe.returncode == 0
