"""The project's own scripts, as a new user meets them."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("command", ["demo", "bench", "side-by-side", "engines", "engine-e2e", "pytest"])
def test_gpu_check_without_the_packed_tree_fails_and_says_what_to_run(tmp_path: Path, command: str) -> None:
    """Without .gpu/ (scripts/gpu-pack's output) every check exits non-zero naming gpu-pack,
    instead of printing "No such file or directory" and exiting 0."""
    shutil.copytree(ROOT / "scripts", tmp_path / "scripts")
    done = subprocess.run(
        ["bash", "scripts/gpu-check", command], cwd=tmp_path, capture_output=True, text=True,
        timeout=60, env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out")},
    )
    assert done.returncode != 0, done.stdout + done.stderr
    assert "run scripts/gpu-pack first" in done.stderr
