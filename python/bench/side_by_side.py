"""Side by side, one GPU, one run: the same torch workload written against
torch_memory_saver's API, through ``gpu_pager.compat.torch_memory_saver`` and through
torch_memory_saver 0.0.10 itself (a benchmark peer only, never a dependency: bring its wheel).

Workload (DESIGN.md): 16 GiB of weights in ~300 tensors with CPU backup, 64 GiB of KV
cache without. Every figure is next to the pinned host<->device link measured in the same
process, and every cycle is checked (the weights' checksums after each resume).

    python side_by_side.py                 # both, one after the other; prints a Markdown table
    python side_by_side.py --impl gpu_pager --json out.json   # one implementation

Sizes scale down with ``--weights-gib``/``--kv-gib``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any, NoReturn

GIB = 1 << 30
MIB = 1 << 20


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def weight_sizes(total: int, n: int) -> list[int]:
    """~n tensor sizes summing to about ``total``, shaped like a transformer's: a few large
    (embeddings), many medium (projections), some tiny (norms)."""
    import random

    rng = random.Random(7)
    big = [total // 16, total // 16]
    rest = total - sum(big)
    tiny = [rng.randrange(8, 64) * 1024 for _ in range(n // 4)]
    k = n - len(big) - len(tiny)
    medium = rest - sum(tiny)
    weights = [rng.uniform(0.5, 1.5) for _ in range(k)]
    scale = medium / sum(weights)
    mids = [max(MIB, int(w * scale) // 256 * 256) for w in weights]
    return big + mids + tiny


def thp_state() -> str:
    """Transparent huge pages: the system's settings and this process's huge anonymous
    memory (the pinned backups are anonymous memory registered with CUDA)."""
    parts = []
    for name in ("enabled", "defrag"):
        try:
            with open(f"/sys/kernel/mm/transparent_hugepage/{name}") as f:
                parts.append(f"{name} {f.read().strip()}")
        except OSError:
            parts.append(f"{name} unknown")
    try:
        with open("/proc/self/smaps_rollup") as f:
            huge = [line.split()[1] for line in f if line.startswith("AnonHugePages:")]
        parts.append(f"AnonHugePages {int(huge[0]) / (1 << 20):.2f} GiB" if huge else "AnonHugePages unknown")
    except OSError:
        parts.append("AnonHugePages unknown")
    return ", ".join(parts)


VMSTAT_KEYS = ("compact_stall", "compact_fail", "compact_success", "thp_fault_alloc",
                "thp_fault_fallback")


def vmstat() -> dict[str, int]:
    """The kernel's counters of direct compaction and huge-page faults (``/proc/vmstat``)."""
    out = {}
    try:
        with open("/proc/vmstat") as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key in VMSTAT_KEYS:
                    out[key] = int(value)
    except OSError:
        pass
    return out


def vmstat_since(before: dict[str, int]) -> str:
    """How much each counter of :func:`vmstat` rose since ``before``."""
    now = vmstat()
    return ", ".join(f"{k} +{now[k] - before[k]}" for k in VMSTAT_KEYS if k in now and k in before) or "unknown"


def link(torch: Any) -> tuple[float, float]:
    """Pinned host->device and device->host bytes/s: one 4 GiB copy each way, best of 3."""
    n = 4 * GIB
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    out = []
    for direction in ("h2d", "d2h"):
        best = float("inf")
        for _ in range(3):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            if direction == "h2d":
                dev.copy_(host, non_blocking=True)
            else:
                host.copy_(dev, non_blocking=True)
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
        out.append(n / best)
    del host, dev
    torch.cuda.empty_cache()
    return out[0], out[1]


def run_one(impl: str, weights_bytes: int, kv_bytes: int, n_tensors: int, repeats: int,
            kv_repeats: int) -> dict[str, Any]:
    import torch

    if impl == "gpu_pager":
        from gpu_pager.compat.torch_memory_saver import torch_memory_saver as tms
    else:
        from torch_memory_saver import torch_memory_saver as tms  # type: ignore[no-redef]
    tms.hook_mode = "torch"  # no LD_PRELOAD needed; the same allocator path for both
    h2d, d2h = link(torch)
    _log(f"{impl}: link h2d {h2d / 1e9:.1f} GB/s, d2h {d2h / 1e9:.1f} GB/s")
    # Host threads for pinning: the CPUs this thread may run on (torch's OpenMP may bind
    # the main thread), against the machine's.
    _log(f"{impl}: {len(os.sched_getaffinity(0))} of {os.cpu_count()} CPUs allowed to this "
         f"thread, torch intra-op threads {torch.get_num_threads()}")

    sizes = weight_sizes(weights_bytes, n_tensors)
    t = time.perf_counter()
    with tms.region("weights", enable_cpu_backup=True):
        weights = [torch.empty(s, dtype=torch.uint8, device="cuda") for s in sizes]
    with tms.region("kv_cache"):
        kv = [torch.empty(kv_bytes // 32, dtype=torch.uint8, device="cuda") for _ in range(32)]
    for w in weights:
        w.random_(0, 256)
    torch.cuda.synchronize()
    _log(f"{impl}: {len(weights)} weight tensors ({sum(sizes) / GIB:.2f} GiB), "
         f"{len(kv)} KV tensors ({kv_bytes / GIB:.0f} GiB) in {time.perf_counter() - t:.1f} s")
    if impl != "gpu_pager":
        tms.retain_cpu_backup = True  # keep the pinned backup: its fast configuration
    wbytes = sum(sizes)

    def checksum() -> list[int]:
        return [int(w[:: max(1, w.numel() // 4096)].to(torch.int64).sum()) for w in weights]

    def timed(f: Callable[[], Any]) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        report = f()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        if report is not None:  # gpu_pager's pause and resume say where the time went
            _log(f"{impl}: {seconds * 1e3:.1f} ms; {report}")
        return seconds

    def change() -> None:
        for w in weights:
            w.add_(1)

    want = checksum()
    rows: dict[str, list[float]] = {}

    def add(name: str, seconds: float) -> None:
        rows.setdefault(name, []).append(seconds)

    def check(stage: str) -> None:
        got = checksum()
        if got != want:
            raise SystemExit(f"{impl}: weights differ after {stage}")

    counters = vmstat()
    add("first pause of the weights (backup pinned then)", timed(lambda: tms.pause("weights")))
    _log(f"{impl}: after the first pause, transparent huge pages: {thp_state()}; "
         f"the kernel's counters during it: {vmstat_since(counters)}")
    time.sleep(1)
    add("resume weights, 1 s after", timed(lambda: tms.resume("weights")))
    check("the first cycle")
    for r in range(repeats):
        change()
        want = checksum()
        add("pause weights, contents changed", timed(lambda: tms.pause("weights")))
        time.sleep(1)
        add("resume weights, 1 s after", timed(lambda: tms.resume("weights")))
        check("a resume")
        add("pause weights, unchanged since the last backup", timed(lambda: tms.pause("weights")))
        # The trainer: most of the free memory allocated, written, freed; resume at once.
        free = torch.cuda.mem_get_info()[0]
        trainer = torch.empty(free - 2 * GIB, dtype=torch.uint8, device="cuda")
        trainer.fill_(1)
        torch.cuda.synchronize()
        del trainer
        torch.cuda.empty_cache()
        add("resume weights right after a trainer's allocate/write/free", timed(lambda: tms.resume("weights")))
        check("a resume after the trainer")
        add("pause KV cache", timed(lambda: tms.pause("kv_cache")))
        time.sleep(0.5)
        add("resume KV cache", timed(lambda: tms.resume("kv_cache")))
        _log(f"{impl}: cycle {r + 1}/{repeats} done")
    # The KV cache alone, cycled often enough that the medians mean something: single
    # samples of a 64 GiB unmap or map spread 20–60 ms from one run to the next.
    for _ in range(kv_repeats):
        time.sleep(0.5)
        add("pause KV cache, cycles 0.5 s apart", timed(lambda: tms.pause("kv_cache")))
        time.sleep(0.5)
        add("resume KV cache 0.5 s after its pause", timed(lambda: tms.resume("kv_cache")))
    _log(f"{impl}: {kv_repeats} KV cycles done")
    return {
        "impl": impl,
        "h2d": h2d,
        "d2h": d2h,
        "weights_bytes": wbytes,
        "kv_bytes": kv_bytes,
        "tensors": len(weights),
        "rows": rows,
    }


def table(results: list[dict[str, Any]]) -> str:
    a, b = results
    names = list(a["rows"])
    lines = [
        f"Link in these runs: host→device {a['h2d'] / 1e9:.1f} / {b['h2d'] / 1e9:.1f} GB/s, "
        f"device→host {a['d2h'] / 1e9:.1f} / {b['d2h'] / 1e9:.1f} GB/s ({a['impl']} / {b['impl']}); "
        f"{a['weights_bytes'] / GIB:.2f} GiB of weights in {a['tensors']} tensors, "
        f"{a['kv_bytes'] / GIB:.0f} GiB of KV cache.",
        "",
        f"| operation | {a['impl']} ms (median, min–max) | ratio to the link | {b['impl']} ms | ratio to the link | {a['impl']} / {b['impl']} |",
        "|---|---|---|---|---|---|",
    ]
    for name in names:
        cells = []
        meds = []
        for r in (a, b):
            xs = r["rows"].get(name, [])
            if not xs:
                cells += ["—", "—"]
                meds.append(float("nan"))
                continue
            med = statistics.median(xs) * 1e3
            meds.append(med)
            lim = None
            if "weights" in name:
                bw = r["d2h"] if "pause" in name else r["h2d"]
                lim = r["weights_bytes"] / bw * 1e3
            span = f"{med:.1f} ({min(xs) * 1e3:.1f}–{max(xs) * 1e3:.1f})" if len(xs) > 1 else f"{med:.1f}"
            cells += [span, f"{med / lim:.3f}" if lim else "—"]
        lines.append(f"| {name} | {' | '.join(cells)} | {meds[0] / meds[1]:.2f} |")
    return "\n".join(lines)


def exit_child(result: dict[str, Any], path: str | None) -> NoReturn:
    """Ends a child process of one implementation: writes ``result`` to ``path`` (as JSON,
    when given) and exits with status 0 at once. Interpreter teardown is skipped on purpose:
    torch_memory_saver's exit handlers exit with status 1 (after printing "only support
    interesting region"), and the figures are written by then."""
    if path:
        with open(path, "w") as f:
            json.dump(result, f)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def warm_host(nbytes: int) -> None:
    """Writes ``nbytes`` of fresh anonymous memory (huge pages asked for, as the pinned
    backups do), then gives it back: the host's memory is then backed and free for the
    children's backups."""
    import ctypes
    import mmap

    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        m.madvise(mmap.MADV_HUGEPAGE)
    base = ctypes.addressof(ctypes.c_char.from_buffer(m))
    step = 1 << 30
    for off in range(0, nbytes, step):
        ctypes.memset(base + off, 1, min(step, nbytes - off))
    m.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--impl", choices=["gpu_pager", "torch_memory_saver"])
    ap.add_argument("--json")
    ap.add_argument("--weights-gib", type=float, default=16)
    ap.add_argument("--kv-gib", type=float, default=None,
                    help="KV cache (default 64 GiB, less where it and the weights would not "
                         "leave 6 GiB of the device free: an 80 GB card takes 56)")
    ap.add_argument("--tensors", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--kv-repeats", type=int, default=10,
                    help="extra pause/resume cycles of the KV cache alone")
    args = ap.parse_args()
    if args.kv_gib is None:
        # The card's size from nvidia-smi: a CUDA context here would take memory from the
        # children for the whole run.
        query = ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits", "-i", "0"]
        total_gib = float(subprocess.run(query, capture_output=True, text=True, check=True).stdout) / 1024
        args.kv_gib = float(max(8, min(64, int(total_gib - args.weights_gib - 6) // 8 * 8)))
    wb, kb = int(args.weights_gib * GIB), int(args.kv_gib * GIB)
    if args.impl:
        exit_child(run_one(args.impl, wb, kb, args.tensors, args.repeats, args.kv_repeats), args.json)
    # The first child would otherwise pay a fresh machine's first touch of host memory.
    warm_host(int(wb * 1.1))
    results = []
    for impl in ("gpu_pager", "torch_memory_saver"):
        out = f"/tmp/side_by_side_{impl}.json"
        cmd = [sys.executable, os.path.abspath(__file__), "--impl", impl, "--json", out,
               "--weights-gib", str(args.weights_gib), "--kv-gib", str(args.kv_gib),
               "--tensors", str(args.tensors), "--repeats", str(args.repeats),
               "--kv-repeats", str(args.kv_repeats)]
        done = subprocess.run(cmd)
        if done.returncode != 0:
            _log(f"{impl} failed with exit code {done.returncode}")
            return 1
        with open(out) as f:
            results.append(json.load(f))
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
