"""The KV cache alone, paused and resumed through torch: gpu_pager's torch_memory_saver
compat, torch_memory_saver 0.0.10 itself (a benchmark peer, never a dependency: bring its
wheel), and the bare driver calls in torch_memory_saver's pattern (``bare``: per tensor
``cuMemCreate`` + ``cuMemMap`` + ``cuMemSetAccess`` on resume, ``cuMemUnmap`` +
``cuMemRelease`` on pause, through ctypes), as the floor both libraries stand on.

A single pause or resume of 64 GiB spreads 15–50 ms from one cycle to the next, and the
machine drifts over minutes; so each implementation runs in its own process for a few
cycles, and the processes alternate over several rounds (the order rotating each round),
so that every implementation sees the same stretch of the machine's time.

    python kv_cycles.py                              # 3 rounds of 10 cycles each
    python kv_cycles.py --rounds 5 --cycles 8 --json out.json
    python kv_cycles.py --impl bare --cycles 5       # one process, one implementation
    python kv_cycles.py --impls gpu_pager,gpu_pager_no_reclaim,torch_memory_saver,bare
                                  # gpu_pager_no_reclaim: GPU_PAGER_RECLAIM_SCRUBBED=0

Each cycle: 0.5 s idle, pause, 0.5 s idle, resume (as ``side_by_side.py``'s KV rows), and
every cycle counts, the first of each process included. The cache is 32 tensors of
``--kv-gib``/32 each (default 64 GiB), allocated once per process; the two libraries' tensors
are written once before the first cycle, the bare calls' memory is never written.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from side_by_side import exit_child

GIB = 1 << 30
IMPLS = ("gpu_pager", "gpu_pager_no_reclaim", "torch_memory_saver", "bare")
DEFAULT_IMPLS = ("gpu_pager", "torch_memory_saver", "bare")

TENSORS = 32


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _AllocProp(ctypes.Structure):
    """``CUmemAllocationProp``: pinned device memory on one device, no export handle."""
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int),
                ("location", _Location), ("win32HandleMetaData", ctypes.c_void_p),
                ("allocFlags", _AllocFlags)]


class _AccessDesc(ctypes.Structure):
    """``CUmemAccessDesc``."""
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


class Bare:
    """32 equal tensors' worth of device memory held as torch_memory_saver holds it: a
    reserved range and one physical handle per tensor, each mapped and enabled on its own."""

    _PINNED, _DEVICE, _READWRITE = 1, 1, 3

    def __init__(self, device: int, size: int) -> None:
        self.cu = ctypes.CDLL("libcuda.so.1")
        self.prop = _AllocProp(type=self._PINNED, location=_Location(self._DEVICE, device))
        self.access = _AccessDesc(location=_Location(self._DEVICE, device), flags=self._READWRITE)
        gran = ctypes.c_size_t()
        self._check("cuMemGetAllocationGranularity",
                    self.cu.cuMemGetAllocationGranularity(ctypes.byref(gran), ctypes.byref(self.prop), 0))
        self.size = -(-size // gran.value) * gran.value
        self.ptrs: list[int] = []
        for _ in range(TENSORS):
            ptr = ctypes.c_uint64()
            self._check("cuMemAddressReserve", self.cu.cuMemAddressReserve(
                ctypes.byref(ptr), ctypes.c_size_t(self.size), ctypes.c_size_t(0),
                ctypes.c_uint64(0), ctypes.c_ulonglong(0)))
            self.ptrs.append(ptr.value)
        self.handles: list[int] = []
        self.resume()

    @staticmethod
    def _check(what: str, rc: int) -> None:
        if rc != 0:
            raise RuntimeError(f"{what} failed: CUresult {rc}")

    def resume(self) -> None:
        """Per tensor: create a handle, map it, enable access (torch_memory_saver's resume)."""
        for ptr in self.ptrs:
            h = ctypes.c_uint64()
            self._check("cuMemCreate", self.cu.cuMemCreate(
                ctypes.byref(h), ctypes.c_size_t(self.size), ctypes.byref(self.prop), ctypes.c_ulonglong(0)))
            self._check("cuMemMap", self.cu.cuMemMap(
                ctypes.c_uint64(ptr), ctypes.c_size_t(self.size), ctypes.c_size_t(0), h, ctypes.c_ulonglong(0)))
            self._check("cuMemSetAccess", self.cu.cuMemSetAccess(
                ctypes.c_uint64(ptr), ctypes.c_size_t(self.size), ctypes.byref(self.access), ctypes.c_size_t(1)))
            self.handles.append(h.value)

    def pause(self) -> None:
        """Per tensor: unmap, release the handle (torch_memory_saver's pause)."""
        self._check("cuCtxSynchronize", self.cu.cuCtxSynchronize())
        for ptr, h in zip(self.ptrs, self.handles):
            self._check("cuMemUnmap", self.cu.cuMemUnmap(ctypes.c_uint64(ptr), ctypes.c_size_t(self.size)))
            self._check("cuMemRelease", self.cu.cuMemRelease(ctypes.c_uint64(h)))
        self.handles = []


def run_one(impl: str, kv_bytes: int, cycles: int) -> dict[str, Any]:
    """``cycles`` KV pause/resume cycles of ``impl`` in this process: seconds per step."""
    import torch

    torch.cuda.init()
    torch.empty(1, device="cuda")  # the primary context, current on this thread
    size = kv_bytes // TENSORS
    pause: Callable[[], object]
    resume: Callable[[], object]
    if impl == "bare":
        bare = Bare(torch.cuda.current_device(), size)
        pause, resume = bare.pause, bare.resume
    else:
        if impl.startswith("gpu_pager"):
            from gpu_pager.compat.torch_memory_saver import torch_memory_saver as tms
        else:
            from torch_memory_saver import torch_memory_saver as tms  # type: ignore[no-redef]
        tms.hook_mode = "torch"  # no LD_PRELOAD needed; the same allocator path for both
        with tms.region("kv_cache"):
            kv = [torch.empty(size, dtype=torch.uint8, device="cuda") for _ in range(TENSORS)]
        for t in kv:
            t.fill_(1)
        pause, resume = (lambda: tms.pause("kv_cache")), (lambda: tms.resume("kv_cache"))

    def timed(f: Callable[[], Any]) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        f()
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    out: dict[str, list[float]] = {"pause": [], "resume": []}
    for _ in range(cycles):
        time.sleep(0.5)
        out["pause"].append(timed(pause))
        time.sleep(0.5)
        out["resume"].append(timed(resume))
    _log(f"{impl}: {cycles} cycles, pause median {statistics.median(out['pause']) * 1e3:.1f} ms, "
         f"resume median {statistics.median(out['resume']) * 1e3:.1f} ms")
    return {"impl": impl, "kv_bytes": kv_bytes, **out}


def _quartiles(xs: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return q[0], q[1], q[2]


def table(samples: dict[str, dict[str, list[float]]], rounds: int, cycles: int, kv_bytes: int) -> str:
    """Markdown: per implementation and step, the median, quartiles and range over every
    cycle of every round, the median of each round's median, and the median against the
    bare calls'."""
    lines = [
        f"{kv_bytes / GIB:.0f} GiB of KV cache as {TENSORS} tensors; {rounds} rounds of {cycles} cycles "
        "per implementation, processes alternated.",
        "",
        "| step | implementation | median ms | quartiles ms | min–max ms | per-round medians ms | median / bare |",
        "|---|---|---|---|---|---|---|",
    ]
    for step in ("pause", "resume"):
        bare = samples.get("bare", {}).get(step)
        bare_med = statistics.median(bare) if bare else None
        for impl in IMPLS:
            rs = samples.get(impl, {}).get(step)
            if not rs:
                continue
            q1, med, q3 = _quartiles(rs)
            per_round = [statistics.median(rs[i:i + cycles]) * 1e3 for i in range(0, len(rs), cycles)]
            ratio = f"{med / bare_med:.2f}" if bare_med else "—"
            lines.append(
                f"| {step} | {impl} | {med * 1e3:.1f} | {q1 * 1e3:.1f}–{q3 * 1e3:.1f} | "
                f"{min(rs) * 1e3:.1f}–{max(rs) * 1e3:.1f} | {', '.join(f'{m:.1f}' for m in per_round)} | {ratio} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--impl", choices=IMPLS, help="one process of one implementation")
    ap.add_argument("--impls", default=",".join(DEFAULT_IMPLS),
                    help=f"which to alternate (comma-separated, of {', '.join(IMPLS)})")
    ap.add_argument("--kv-gib", type=float, default=64)
    ap.add_argument("--cycles", type=int, default=10, help="pause/resume cycles per process")
    ap.add_argument("--rounds", type=int, default=3, help="processes per implementation, alternated")
    ap.add_argument("--json", help="write the samples here")
    args = ap.parse_args()
    kv_bytes = int(args.kv_gib * GIB)
    if args.cycles < 1 or args.rounds < 1:
        ap.error("--cycles and --rounds must be at least 1")
    if args.impl:
        exit_child(run_one(args.impl, kv_bytes, args.cycles), args.json)
    impls = [i for i in args.impls.split(",") if i]
    unknown = [i for i in impls if i not in IMPLS]
    if unknown or not impls:
        ap.error(f"--impls takes some of {', '.join(IMPLS)}; got {args.impls!r}")
    samples: dict[str, dict[str, list[float]]] = {}
    for r in range(args.rounds):
        order = impls[r % len(impls):] + impls[:r % len(impls)]
        for impl in order:
            out = f"/tmp/kv_cycles_{impl}.json"
            _log(f"round {r + 1} of {args.rounds}: {impl}")
            cmd = [sys.executable, os.path.abspath(__file__), "--impl", impl, "--json", out,
                   "--kv-gib", str(args.kv_gib), "--cycles", str(args.cycles)]
            env = dict(os.environ)
            if impl == "gpu_pager_no_reclaim":  # the next allocation collects the scrubbed pages
                env["GPU_PAGER_RECLAIM_SCRUBBED"] = "0"
            done = subprocess.run(cmd, env=env)
            if done.returncode != 0:
                _log(f"{impl} failed with exit code {done.returncode}")
                return 1
            with open(out) as f:
                got = json.load(f)
            for step in ("pause", "resume"):
                samples.setdefault(impl, {}).setdefault(step, []).extend(got[step])
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rounds": args.rounds, "cycles": args.cycles, "kv_bytes": kv_bytes,
                       "samples": samples}, f)
    print(table(samples, args.rounds, args.cycles, kv_bytes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
