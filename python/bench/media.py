"""Pause and resume of weights through each backup medium, gpu_pager's torch_memory_saver
drop-in against torch_memory_saver 0.0.10 itself with the same option, in one run, with
the limits measured in the same run:

- ``pinned`` (``enable_cpu_backup=True``) and ``mmap`` (``cpu_backup_backend="mmap"``):
  against the pinned host↔device link (the best of three 4 GiB copies each way);
- ``disk`` (``enable_disk_backup=True``): against the disk's sequential write (with
  ``fdatasync``) and read (after dropping the file from the page cache) of a file as large
  as the weights, in the backup directory.

Each (implementation, medium) runs in its own process, in torch hook mode for both (no
``LD_PRELOAD``). Weights: ``--gib`` GiB in 1 GiB tensors, rewritten before each pause
(contents changed: nothing to skip), checked bit-exact after each resume by a checksum.
Run on the GPU machine with torch_memory_saver importable (``scripts/gpu-check media``)::

    python3 python/bench/media.py --gib 16 --cycles 2 --dir /var/tmp/gpu-pager-media
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

from side_by_side import warm_host

GIB = 1 << 30


def rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def child(impl: str, medium: str, gib: int, cycles: int, directory: str) -> None:
    import torch

    if impl == "gpu_pager":
        from gpu_pager.compat.torch_memory_saver import torch_memory_saver as saver
    else:
        from torch_memory_saver import torch_memory_saver as saver  # type: ignore[no-redef]
    saver.hook_mode = "torch"
    kwargs: dict[str, Any] = {"tag": "weights"}
    if medium == "disk":
        saver.set_disk_backup_dir(directory)
        kwargs["enable_disk_backup"] = True
    else:
        kwargs.update(enable_cpu_backup=True, cpu_backup_backend=medium)
    with saver.region(**kwargs):
        weights = [torch.empty(GIB, dtype=torch.uint8, device="cuda") for _ in range(gib)]
    for cycle in range(cycles):
        for i, w in enumerate(weights):
            w.view(torch.int64).random_(0, 1 << 62)
            if i == 0:
                w[:8] = cycle
        torch.cuda.synchronize()
        sums = [int(w.view(torch.int64).sum()) for w in weights]
        before = rss()
        t = time.perf_counter()
        saver.pause("weights")
        pause = time.perf_counter() - t
        paused = rss()
        time.sleep(1)
        t = time.perf_counter()
        saver.resume("weights")
        torch.cuda.synchronize()
        resume = time.perf_counter() - t
        resumed = rss()
        ok = [int(w.view(torch.int64).sum()) for w in weights] == sums
        print(
            json.dumps(
                {
                    "impl": impl,
                    "medium": medium,
                    "cycle": cycle,
                    "pause_s": pause,
                    "resume_s": resume,
                    "rss_pause_gib": (paused - before) / GIB,
                    "rss_resume_gib": (resumed - paused) / GIB,
                    "bit_exact": ok,
                }
            ),
            flush=True,
        )


def link(gib: int = 4) -> dict[str, float]:
    import torch

    n = gib * GIB
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    out = {}
    for name, dst, src in (("h2d", dev, host), ("d2h", host, dev)):
        best = 0.0
        for _ in range(3):
            torch.cuda.synchronize()
            t = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            best = max(best, n / (time.perf_counter() - t))
        out[name] = best
    return out


def disk(directory: str, gib: int) -> dict[str, float]:
    """Sequential write (fdatasync at the end) and cold read of a ``gib`` GiB file."""
    path = os.path.join(directory, f"disk-probe-{os.getpid()}")
    chunk = os.urandom(64 << 20)
    n = gib * GIB // len(chunk)
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
    t = time.perf_counter()
    for _ in range(n):
        os.write(fd, chunk)
    os.fdatasync(fd)
    write = n * len(chunk) / (time.perf_counter() - t)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    fd = os.open(path, os.O_RDONLY)
    t = time.perf_counter()
    while os.read(fd, 64 << 20):
        pass
    read = n * len(chunk) / (time.perf_counter() - t)
    os.close(fd)
    os.remove(path)
    return {"write": write, "read": read}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--gib", type=int, default=16, help="weights, in 1 GiB tensors")
    p.add_argument("--cycles", type=int, default=2)
    p.add_argument("--dir", default="/var/tmp/gpu-pager-media", help="disk backup directory")
    p.add_argument("--media", default="pinned,mmap,disk")
    p.add_argument("--impls", default="gpu_pager,torch_memory_saver")
    p.add_argument("--child", nargs=2, metavar=("IMPL", "MEDIUM"), help=argparse.SUPPRESS)
    a = p.parse_args()
    os.makedirs(a.dir, exist_ok=True)
    if a.child:
        child(a.child[0], a.child[1], a.gib, a.cycles, a.dir)
        return

    def measure(what: str) -> dict[str, float]:
        code = f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); import media, json; "
        code += f"print(json.dumps(media.{what}))"
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"measuring {what} failed:\n{done.stderr}")
        result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
        return result

    # The first child would otherwise pay a fresh machine's first touch of host memory.
    warm_host(int(a.gib * GIB * 1.1))
    limits = {"link": measure("link()"), "disk": measure(f"disk({a.dir!r}, {a.gib})")}
    print(f"limits: {json.dumps(limits)}", flush=True)
    rows = []
    for medium in a.media.split(","):
        for impl in a.impls.split(","):
            print(f"== {impl} / {medium}", flush=True)
            done = subprocess.run(
                [sys.executable, __file__, "--child", impl, medium, "--gib", str(a.gib),
                 "--cycles", str(a.cycles), "--dir", a.dir],
                capture_output=True,
                text=True,
            )
            lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
            if not lines:
                print(f"   failed (exit {done.returncode}):\n{done.stderr[-3000:]}", flush=True)
                continue
            if done.returncode != 0:
                # torch_memory_saver's hooks exit with status 1 at interpreter exit in torch
                # mode ("only support interesting region"), after the measured cycles.
                print(f"   (exit {done.returncode} after its cycles: {done.stderr.strip()[-200:]})")
            for ln in lines:
                r = json.loads(ln)
                rows.append(r)
                print(f"   {json.dumps(r)}", flush=True)
    limits_end = {"link": measure("link()")}
    print(f"limits at the end: {json.dumps(limits_end)}", flush=True)
    nbytes = a.gib * GIB
    link_h2d = max(limits["link"]["h2d"], limits_end["link"]["h2d"])
    link_d2h = max(limits["link"]["d2h"], limits_end["link"]["d2h"])
    print()
    print(f"| medium | implementation | pause s (× limit) | resume s (× limit) | RSS after pause / after resume GiB | bit-exact |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        if r["medium"] == "disk":
            lp, lr = nbytes / limits["disk"]["write"], nbytes / limits["disk"]["read"]
        else:
            lp, lr = nbytes / link_d2h, nbytes / link_h2d
        print(
            f"| {r['medium']} | {r['impl']} (cycle {r['cycle']}) | {r['pause_s']:.3f} ({r['pause_s'] / lp:.2f}×) "
            f"| {r['resume_s']:.3f} ({r['resume_s'] / lr:.2f}×) | {r['rss_pause_gib']:+.1f} / "
            f"{r['rss_resume_gib']:+.1f} | {r['bit_exact']} |"
        )
    print(
        f"\nlimits: link h2d {link_h2d / 1e9:.1f} GB/s, d2h {link_d2h / 1e9:.1f} GB/s (best of start and end); "
        f"disk write {limits['disk']['write'] / 1e9:.2f} GB/s, read {limits['disk']['read'] / 1e9:.2f} GB/s"
    )


if __name__ == "__main__":
    main()
