"""How fast can host memory be pinned, and which half bounds it: first-touching the pages or
registering them with the driver? The question behind a first release (a trainer's first
pause) that pins its backup while it copies: its pin runs below the link.

Bare driver calls through ctypes, no gpu_pager. Each row maps ``--gib`` of fresh anonymous
memory aligned to 2 MiB with transparent huge pages asked for (as gpu_pager's pinned memory
is), then:

- ``touch``: a write to every page on ``--touch-threads`` threads;
- ``register whole``: one ``cuMemHostRegister`` of the touched memory;
- ``register N threads``: the touched memory registered in ``--piece-mib`` pieces, handed out
  to N threads (is the driver's registration serial across threads?).

Prints each row's median over ``--rounds`` in ms and GB/s. On the GPU machine, from the
repository root::

    bash .gpu/on-device py python/bench/pin_probe.py --gib 8 --rounds 3
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import statistics
import threading
import time
from collections.abc import Callable

GIB = 1 << 30
MIB = 1 << 20
HUGE = 2 * MIB
# CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP, as gpu_pager registers.
FLAGS = 1 | 2


class Host:
    """``n`` bytes of fresh anonymous memory, 2 MiB-aligned, huge pages asked for."""

    def __init__(self, n: int) -> None:
        self.m = mmap.mmap(-1, n + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        raw = ctypes.addressof(ctypes.c_char.from_buffer(self.m))
        self.base = (raw + HUGE - 1) // HUGE * HUGE
        self.n = n
        self.m.madvise(mmap.MADV_HUGEPAGE, self.base - raw, n)

    def close(self) -> None:
        import gc

        gc.collect()  # the from_buffer export above must be gone before close
        self.m.close()


def run_threads(n: int, work: Callable[[int], None]) -> None:
    threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--piece-mib", type=int, default=64)
    ap.add_argument("--touch-threads", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    ap.add_argument("--threads", default="1,2,4,8")
    args = ap.parse_args()
    import torch

    torch.empty(1, device="cuda")  # device 0's primary context, current on this thread
    cu = ctypes.CDLL("libcuda.so.1")
    ctx = ctypes.c_void_p()
    assert cu.cuCtxGetCurrent(ctypes.byref(ctx)) == 0
    n = int(args.gib * GIB) // HUGE * HUGE
    piece = args.piece_mib * MIB

    def check(rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{what} failed: CUresult {rc}")

    def touch(h: Host) -> None:
        per = (n // args.touch_threads + HUGE - 1) // HUGE * HUGE

        def work(i: int) -> None:
            lo = i * per
            if lo < n:
                ctypes.memset(h.base + lo, 1, min(per, n - lo))

        run_threads(args.touch_threads, work)

    def register(h: Host, threads: int) -> list[int]:
        """Registers ``h`` in pieces on ``threads`` threads (0: one registration)."""
        if threads == 0:
            check(cu.cuMemHostRegister_v2(ctypes.c_void_p(h.base), ctypes.c_size_t(n), FLAGS), "register")
            return [h.base]
        starts = list(range(0, n, piece))
        lock = threading.Lock()
        done: list[int] = []

        def work(_: int) -> None:
            check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
            while True:
                with lock:
                    if not starts:
                        return
                    lo = starts.pop(0)
                check(cu.cuMemHostRegister_v2(ctypes.c_void_p(h.base + lo), ctypes.c_size_t(min(piece, n - lo)),
                                              FLAGS), "register")
                with lock:
                    done.append(h.base + lo)

        run_threads(threads, work)
        return done

    rows: dict[str, list[float]] = {}
    modes = [0] + [int(t) for t in args.threads.split(",")]
    for _ in range(args.rounds):
        for threads in modes:
            h = Host(n)
            t0 = time.perf_counter()
            touch(h)
            t1 = time.perf_counter()
            regs = register(h, threads)
            t2 = time.perf_counter()
            rows.setdefault("touch", []).append(t1 - t0)
            name = "register whole" if threads == 0 else f"register {threads} threads"
            rows.setdefault(name, []).append(t2 - t1)
            for r in regs:
                check(cu.cuMemHostUnregister(ctypes.c_void_p(r)), "unregister")
            h.close()
    print(f"{n / GIB:.1f} GiB, pieces of {args.piece_mib} MiB, touch on {args.touch_threads} threads")
    for name, xs in rows.items():
        med = statistics.median(xs)
        print(f"{name}: median {med * 1e3:.1f} ms ({n / med / 1e9:.1f} GB/s), "
              f"each {[round(x * 1e3, 1) for x in xs]}")


if __name__ == "__main__":
    main()
