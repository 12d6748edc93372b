"""Run a Triton kernel check on the CPU: Triton's interpreter (TRITON_INTERPRET=1) in a child process, since the
variable must be set before Triton is imported and this process may have imported it already."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None or importlib.util.find_spec("numpy") is None,
                                  reason="Triton (and numpy for its interpreter) not installed")


def run_interpreted(code: str) -> None:
    """Run ``code`` (which must print OK at its end) under the interpreter; fail with its output otherwise."""
    body = "import os\nos.environ['TRITON_INTERPRET'] = '1'\n" + textwrap.dedent(code)
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", body], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]
