"""Runs test code in a fresh interpreter: for what reads the environment once per process
(the host backend's capacity, the drop-in switch, vLLM's plugins)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap


def run_python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    """Runs ``code`` (dedented) with ``python -c`` in this environment plus ``env``; returns
    the finished process with its output as text."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=120,
    )
