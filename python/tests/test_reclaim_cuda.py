"""The scrubbed-page reclaimer's edges on a GPU: a process that exits while the reclaimer's
schedule runs (its helper thread may be inside a driver call) exits cleanly. Needs a CUDA
GPU (skipped otherwise, with the reason)."""

from __future__ import annotations

import os
import sys

import pytest

from typing import Any

torch: Any = pytest.importorskip("torch", reason="torch is not installed (it tells whether there is a GPU)")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False)", allow_module_level=True)

sys.path.insert(0, os.path.dirname(__file__))
from fresh import run_python  # noqa: E402

RELEASE_THEN_EXIT = """
    import time, gpu_pager
    p = gpu_pager.Pager.for_device(0)
    p.region("kv", "discard", 8 << 30)
    p.release(["kv"]); p.resume(["kv"]); p.release(["kv"])
    time.sleep(AFTER)
    print("released")
"""


@pytest.mark.parametrize("after_ms", [0, 5, 20, 40, 80])
def test_a_process_exiting_inside_the_reclaimer_s_schedule_exits_cleanly(after_ms: int) -> None:
    """8 GiB released (over the reclaimer's threshold), then exit at points of its schedule
    (25 ms, 50 ms, 100 ms, ... after the free): status 0, no hang, nothing on stderr."""
    code = RELEASE_THEN_EXIT.replace("AFTER", str(after_ms / 1000))
    for _ in range(2):
        done = run_python(code, GPU_PAGER_RECLAIM_SCRUBBED="1")
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == "released", done.stdout
        assert "error" not in done.stderr.lower(), done.stderr
