"""README.md's and docs/PYTHON.md's Python examples run as written (like the Rust examples of
README.md and docs/GUIDE.md, which are doctests). A block whose first line is
``# needs: torch and a CUDA GPU`` runs only where torch sees a GPU, and is skipped elsewhere
with that reason."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
README = os.path.join(ROOT, "README.md")
PYTHON_DOC = os.path.join(ROOT, "docs", "PYTHON.md")
NEEDS_CUDA = "# needs: torch and a CUDA GPU"


def _blocks(path: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def test_the_docs_have_python_examples() -> None:
    assert _blocks(README), "README.md has no Python example"
    blocks = _blocks(README) + _blocks(PYTHON_DOC)
    assert any(b.startswith(NEEDS_CUDA) for b in blocks), "no torch example"
    assert any(not b.startswith(NEEDS_CUDA) for b in blocks), "no example that runs anywhere"


EXAMPLES = [(os.path.basename(p), i) for p in (README, PYTHON_DOC) for i in range(len(_blocks(p)))]


@pytest.mark.parametrize("doc,index", EXAMPLES)
def test_python_example_runs(doc: str, index: int) -> None:
    code = _blocks(README if doc == "README.md" else PYTHON_DOC)[index]
    if code.startswith(NEEDS_CUDA) and not _cuda():
        pytest.skip(f"{doc} example needs torch and a CUDA GPU")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr


BENCHMARKS = os.path.join(ROOT, "BENCHMARKS.md")


def _rows(text: str) -> list[list[str]]:
    """Every table row of a markdown text, as its cells."""
    return [
        [c.strip() for c in line.strip().strip("|").split("|")]
        for line in text.splitlines()
        if line.startswith("|") and not line.startswith("|---")
    ]


def _section(text: str, heading: str) -> str:
    start = text.index(heading)
    end = text.find("\n#", start + len(heading))
    return text[start : end if end >= 0 else len(text)]


def test_the_readme_speed_table_is_the_benchmarks_figures() -> None:
    """Each row of the README's speed table carries the figures BENCHMARKS.md has for it:
    the weights rows from the side-by-side table (its "× link" columns), the KV rows from
    the KV table (median / bare, gpu-pager's default and torch_memory_saver)."""
    with open(README, encoding="utf-8") as f:
        readme = f.read()
    with open(BENCHMARKS, encoding="utf-8") as f:
        bench = f.read()
    speed = _rows(_section(readme, "## Speed"))[1:]
    side = {r[0]: (r[2], r[4]) for r in _rows(_section(bench, "### Weights and KV cache through"))}
    kv = {(r[0], r[1]): r[-1] for r in _rows(_section(bench, "### 64 GiB of KV cache"))}
    assert len(speed) >= 6, speed
    for op, _, ours, peer in speed:
        if op in side:
            want = side[op]
        else:
            step = op.split()[0]
            want = (kv[(step, "gpu-pager, scrubbed pages collected (the default)")], kv[(step, "torch_memory_saver")])
        assert (ours, peer) == (f"{want[0]} ×", f"{want[1]} ×"), op
