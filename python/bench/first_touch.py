"""How fast this host backs fresh anonymous memory, with no CUDA involved: maps ``--gib``
GiB, asks for transparent huge pages (``MADV_HUGEPAGE``, as gpu_pager's pinned backups do),
touches it on ``--threads`` threads (a write per huge page, each thread over its share),
unmaps, and does it again ``--rounds`` times. On a machine whose memory was never used since boot
(a fresh virtual machine whose guest memory the hypervisor hands out on first use) the first
round is slower than the later ones, which reuse memory freed by the round before.

    python first_touch.py --gib 16 --rounds 3

Also prints ``MemFree`` and, where the kernel has it, ``Unaccepted`` memory (memory of a
confidential VM not yet accepted from the hypervisor) from /proc/meminfo, and how much the
kernel's counters of direct compaction and huge-page faults rose in each round (a round
slowed by compaction shows ``compact_stall``).
Linux only. Where huge pages are refused (``thp_fault_fallback`` rises), a write per 2 MiB
backs only one small page of each, and the figure means little.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import threading
import time

GIB = 1 << 30
HUGE = 2 << 20
# linux/mman.h (x86-64 and arm64)
PROT_READ, PROT_WRITE = 1, 2
MAP_PRIVATE, MAP_ANONYMOUS = 0x02, 0x20
MADV_HUGEPAGE = 14


def meminfo() -> str:
    """MemFree and Unaccepted from /proc/meminfo, in GiB."""
    out = []
    with open("/proc/meminfo") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("MemFree", "Unaccepted"):
                out.append(f"{key} {int(rest.split()[0]) / (1 << 20):.1f} GiB")
    return ", ".join(out)


def vmstat() -> dict[str, int]:
    """The kernel's counters of direct compaction and huge-page faults."""
    keys = ("compact_stall", "thp_fault_alloc", "thp_fault_fallback")
    out = {}
    with open("/proc/vmstat") as f:
        for line in f:
            key, _, value = line.partition(" ")
            if key in keys:
                out[key] = int(value)
    return out


def touch_round(nbytes: int, threads: int) -> float:
    """Seconds to back ``nbytes`` of fresh anonymous memory with huge pages on ``threads``
    threads (ctypes calls release the GIL), then unmap it."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                          ctypes.c_long]
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    addr = libc.mmap(None, nbytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "mmap failed")
    try:
        libc.madvise(addr, nbytes, MADV_HUGEPAGE)
        share = nbytes // threads // HUGE * HUGE
        def populate(k: int) -> None:
            # One write per huge page backs the whole page (as gpu_pager's touch does);
            # ctypes.memset releases the GIL, so the threads fault in parallel.
            start = k * share
            end = nbytes if k == threads - 1 else start + share
            for at in range(start, end, HUGE):
                ctypes.memset(addr + at, 1, 1)

        t = time.perf_counter()
        workers = [threading.Thread(target=populate, args=(k,)) for k in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        seconds = time.perf_counter() - t
        return seconds
    finally:
        libc.munmap(addr, nbytes)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                    help="touching threads (default: one per CPU)")
    args = ap.parse_args()
    nbytes = int(args.gib * GIB) // HUGE * HUGE
    print(f"first_touch: before: {meminfo()}", flush=True)
    for r in range(args.rounds):
        before = vmstat()
        s = touch_round(nbytes, args.threads)
        counters = ", ".join(f"{k} +{v - before.get(k, 0)}" for k, v in vmstat().items())
        print(f"first_touch: round {r + 1}: {nbytes / GIB:.1f} GiB backed in {s * 1e3:.0f} ms "
              f"({nbytes / GIB / s:.1f} GiB/s) on {args.threads} threads; {counters}; {meminfo()}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
