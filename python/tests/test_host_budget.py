"""One host-memory budget for the backups of every gpu-pager process on the node
(``host_budget_bytes``, ``GPU_PAGER_HOST_BUDGET``), on the host backend with real processes:
a release whose backup would pass it fails before anything moves, naming the budget and
who holds what, and a killed process's share comes back."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

MIB = 1 << 20

HOLDER = """
    import sys, gpu_pager
    p = gpu_pager.Pager.for_device(0)
    p.region("w", "preserve", 64 << 20)
    b = p.alloc("w", 64 << 20)
    p.write(b, 0, bytes([1]) * (64 << 20))
    p.release("w")                      # pins a 64 MiB backup: this process's share
    print("held", flush=True)
    sys.stdin.read()                    # until killed
"""

ASKER = """
    import gpu_pager
    p = gpu_pager.Pager.for_device(0)
    assert p.config.host_budget_bytes == 96 << 20, p.config
    p.region("w", "preserve", 64 << 20)
    b = p.alloc("w", 4096)
    p.write(b, 0, bytes([7]) * 4096)
    try:
        p.release("w")
    except gpu_pager.OutOfMemoryError as e:
        print("refused:", e)
    audit = p.audit()
    assert audit.host_budget is not None
    budget, shares = audit.host_budget
    print("audit:", budget, shares, "host budget for backups" in str(audit))
    # Nothing moved: the region is resident with its contents.
    assert p.info("w").state == gpu_pager.State.RESIDENT
    assert p.read(b, 0, 4096) == bytes([7]) * 4096
    input()                             # the holder is killed meanwhile
    p.release("w")
    p.resume("w")
    assert p.read(b, 0, 4096) == bytes([7]) * 4096
    print("released after the holder died")
"""


def _env(ledger: Path) -> dict[str, str]:
    return {
        **os.environ,
        "GPU_PAGER_LEDGER_DIR": str(ledger),
        "GPU_PAGER_HOST_BUDGET": "96M",
        "GPU_PAGER_HOST_CAPACITY": "1G",
    }


def test_the_budget_holds_across_processes_and_a_killed_one_gives_its_share_back(tmp_path: Path) -> None:
    env = _env(tmp_path / "ledger")
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(HOLDER)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    asker = None
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "held", holder.stderr.read() if holder.stderr else ""
        asker = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(ASKER)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        )
        assert asker.stdout is not None and asker.stdin is not None
        refused = asker.stdout.readline()
        assert refused.startswith("refused:"), refused + (asker.stderr.read() if asker.stderr else "")
        assert "host-memory budget" in refused and "(96.0 MiB)" in refused, refused
        assert f"pid {holder.pid}: 64.0 MiB" in refused, refused
        assert "GPU_PAGER_HOST_BUDGET" in refused, refused
        audit = asker.stdout.readline().split()
        assert audit[0] == "audit:" and audit[1] == str(96 * MIB) and audit[-1] == "True", audit
        assert f"[({holder.pid}, {64 * MIB})," in " ".join(audit), audit
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(timeout=30)
        out, err = asker.communicate("\n", timeout=60)
        assert asker.returncode == 0, err
        assert out.strip() == "released after the holder died", out + err
    finally:
        for proc in (holder, asker):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
