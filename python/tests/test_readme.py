"""README.md's Python examples run as written (like its Rust examples, which are doctests).
A block whose first line is ``# needs: torch and a CUDA GPU`` runs only where torch sees
a GPU, and is skipped elsewhere with that reason."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

README = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")
NEEDS_CUDA = "# needs: torch and a CUDA GPU"


def _blocks() -> list[str]:
    with open(README, encoding="utf-8") as f:
        text = f.read()
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def test_readme_has_python_examples() -> None:
    blocks = _blocks()
    assert blocks, "README.md has no Python example"
    assert any(b.startswith(NEEDS_CUDA) for b in blocks), "no torch example"
    assert any(not b.startswith(NEEDS_CUDA) for b in blocks), "no example that runs anywhere"


@pytest.mark.parametrize("index", range(len(_blocks())))
def test_readme_python_example_runs(index: int) -> None:
    code = _blocks()[index]
    if code.startswith(NEEDS_CUDA) and not _cuda():
        pytest.skip("README example needs torch and a CUDA GPU")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
