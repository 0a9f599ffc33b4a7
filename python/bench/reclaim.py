"""The scrubbed-page reclaimer on a GPU (``GPU_PAGER_RECLAIM_SCRUBBED``), three questions:

``first``: what the first allocation after a large release pays, with the reclaimer on, off,
and off with one ``cuMemGetInfo`` call in its place (does a query collect the scrubbed pages
without holding any memory?). One process per variant, ``--rounds`` releases each.

``exit``: processes that exit within the reclaimer's schedule, right after a release of
``--gib`` (after 0, 5, 20, 40 and 80 ms): each must exit with status 0 in time.

``fill``: a trainer that fills the device with 2 MiB ``cuMemAlloc`` calls right after a
release, to what ``cuMemGetInfo`` said was free less ``--slack-mib``, while the reclaimer
runs (``--variant off``: without it, the control); it must never see an out-of-memory
error (``--rounds`` times).

    python reclaim.py first|exit|fill [--gib 32] [--rounds 5] [--slack-mib 64]
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

GIB = 1 << 30
MIB = 1 << 20


def _cuda() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def _current_context(cuda: ctypes.CDLL) -> None:
    """Makes device 0's primary context (the pager's) current on this thread."""
    assert cuda.cuInit(0) == 0
    ctx = ctypes.c_void_p()
    assert cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0
    assert cuda.cuCtxSetCurrent(ctx) == 0


def _free(cuda: ctypes.CDLL) -> int:
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    assert cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)) == 0
    return free.value


def _released(gib: float, tag: str = "kv") -> object:
    """A fixed discard region of ``gib`` GiB, made resident, written, then released."""
    import gpu_pager

    p = gpu_pager.Pager.for_device(0)
    p.region(tag, "discard", int(gib * GIB))
    p.release([tag])
    p.resume([tag])
    p.release([tag])
    return p


def first(args: argparse.Namespace) -> None:
    """One variant (``--variant``) in this process: the first allocation's time after each
    release, through the pager's own next map (a resume of a small region)."""
    os.environ["GPU_PAGER_RECLAIM_SCRUBBED"] = "0" if args.variant != "on" else "1"
    import gpu_pager

    cuda = _cuda()
    p = gpu_pager.Pager.for_device(0)
    p.region("kv", "discard", int(args.gib * GIB))
    p.region("probe", "discard", 2 * MIB)
    p.release(["probe"])
    _current_context(cuda)
    ms = []
    for _ in range(args.rounds):
        p.release(["kv"])
        time.sleep(0.3)
        if args.variant == "query":
            _free(cuda)
            time.sleep(0.05)
        t = time.perf_counter()
        p.resume(["probe"])
        ms.append((time.perf_counter() - t) * 1e3)
        p.release(["probe"])
        p.resume(["kv"])
    print(json.dumps({"variant": args.variant, "first_map_ms": ms, "median_ms": statistics.median(ms)}))


def exit_early(args: argparse.Namespace) -> None:
    code = (
        "import sys, time, gpu_pager\n"
        "p = gpu_pager.Pager.for_device(0)\n"
        f"p.region('kv', 'discard', {int(args.gib * GIB)})\n"
        "p.release(['kv']); p.resume(['kv']); p.release(['kv'])\n"
        "time.sleep(float(sys.argv[1]))\n"
    )
    failures = 0
    for delay in (0.0, 0.005, 0.02, 0.04, 0.08) * args.rounds:
        t = time.perf_counter()
        rc: int | str
        try:
            done = subprocess.run([sys.executable, "-c", code, str(delay)], capture_output=True, text=True, timeout=60)
            rc, err = done.returncode, done.stderr.strip()[-300:]
        except subprocess.TimeoutExpired:
            rc, err = "hung", ""
        took = time.perf_counter() - t
        ok = rc == 0
        failures += not ok
        print(f"exit after {delay * 1e3:.0f} ms: status {rc}, {took:.2f} s{'' if ok else ' ' + err}", flush=True)
    print(json.dumps({"check": "exit", "failures": failures}))
    if failures:
        raise SystemExit(1)


def fill(args: argparse.Namespace) -> None:
    os.environ["GPU_PAGER_RECLAIM_SCRUBBED"] = "0" if args.variant == "off" else "1"
    cuda = _cuda()
    p = _released(args.gib)
    _current_context(cuda)
    ooms = 0
    for r in range(args.rounds):
        p.resume(["kv"])  # type: ignore[attr-defined]
        p.release(["kv"])  # type: ignore[attr-defined]
        want = (_free(cuda) - args.slack_mib * MIB) // (2 * MIB)
        held = []
        ptr = ctypes.c_uint64()
        err = 0
        for _ in range(want):
            err = cuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(2 * MIB))
            if err:
                break
            held.append(ptr.value)
        if err:
            ooms += 1
        print(f"round {r}: {len(held)} of {want} chunks, error {err}", flush=True)
        for h in held:
            cuda.cuMemFree_v2(ctypes.c_uint64(h))
    print(json.dumps({"check": "fill", "reclaimer": args.variant != "off", "ooms": ooms}))
    if ooms:
        raise SystemExit(1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("first", "exit", "fill"))
    ap.add_argument("--gib", type=float, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--slack-mib", type=int, default=64)
    ap.add_argument("--variant", choices=("on", "off", "query"))
    args = ap.parse_args()
    if args.what == "first" and args.variant is None:
        for v in ("off", "query", "on", "off", "query", "on"):
            done = subprocess.run([sys.executable, __file__, "first", "--variant", v, "--gib", str(args.gib),
                                   "--rounds", str(args.rounds)], capture_output=True, text=True, timeout=300)
            print(done.stdout.strip() or done.stderr[-2000:], flush=True)
        return
    {"first": first, "exit": exit_early, "fill": fill}[args.what](args)


if __name__ == "__main__":
    main()
