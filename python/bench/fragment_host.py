"""Fragments the host's physical memory and holds it so, for measuring how pinning behaves
on a machine that has run for a while (page cache, a trainer's host buffers): most free
memory then comes in pieces smaller than a 2 MiB huge page.

It backs nearly all available memory with 4 KiB pages (``MADV_NOHUGEPAGE``, then
``MADV_POPULATE_WRITE``) in parallel child processes, then gives back all but one page of
every 64 KiB (``MADV_DONTNEED``). What stays held is about 1/16 of that memory, spread over
all of it, so that few 2 MiB blocks of physical memory are wholly free; a transparent huge
page then needs compaction first. Prints the free blocks by order (``/proc/buddyinfo``)
before and after, then holds the memory until it is killed (SIGTERM or SIGINT)::

    python fragment_host.py --leave-gib 8 &    # prints "fragment_host: holding ..." when ready
    ...                                        # measure
    kill %1

Linux only (``MADV_POPULATE_WRITE`` needs 5.14; older kernels get a write per page).
"""

from __future__ import annotations

import argparse
import mmap
import os
import signal
import subprocess
import sys
import time

GIB = 1 << 30
PAGE = mmap.PAGESIZE
MADV_POPULATE_WRITE = 23  # linux/mman.h; not exported by Python's mmap module
KEEP_EVERY = 64 << 10  # one page held per 64 KiB


def available() -> int:
    """``MemAvailable`` from /proc/meminfo, in bytes."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise SystemExit("fragment_host: no MemAvailable in /proc/meminfo")


def free_blocks() -> str:
    """Free memory by block size over all zones: total GiB in blocks of 2 MiB or more, and
    in smaller blocks."""
    big = small = 0
    with open("/proc/buddyinfo") as f:
        for line in f:
            counts = [int(x) for x in line.split()[4:]]
            for order, n in enumerate(counts):
                b = n * PAGE << order
                if (PAGE << order) >= 2 << 20:
                    big += b
                else:
                    small += b
    return f"free in blocks of >= 2 MiB: {big / GIB:.1f} GiB, in smaller blocks: {small / GIB:.1f} GiB"


def child(nbytes: int) -> None:
    """Backs ``nbytes`` with small pages, gives back all but one page per 64 KiB, holds."""
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_NOHUGEPAGE)
    try:
        m.madvise(MADV_POPULATE_WRITE)
    except OSError:
        for at in range(0, nbytes, PAGE):
            m[at] = 1
    for at in range(0, nbytes - KEEP_EVERY + 1, KEEP_EVERY):
        m.madvise(mmap.MADV_DONTNEED, at + PAGE, KEEP_EVERY - PAGE)
    print("held", flush=True)
    signal.sigwait({signal.SIGTERM, signal.SIGINT})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--leave-gib", type=float, default=8,
                    help="available memory left untouched while the rest is backed (default 8)")
    ap.add_argument("--procs", type=int, default=os.cpu_count() or 1,
                    help="child processes that back the memory in parallel")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
        child(args.child)
        return 0
    span = available() - int(args.leave_gib * GIB)
    if span < KEEP_EVERY * args.procs:
        raise SystemExit(f"fragment_host: only {available() / GIB:.1f} GiB available; nothing to fragment")
    print(f"fragment_host: before: {free_blocks()}", flush=True)
    per = span // args.procs // KEEP_EVERY * KEEP_EVERY
    t = time.perf_counter()
    kids = [subprocess.Popen([sys.executable, __file__, "--child", str(per)], stdout=subprocess.PIPE, text=True)
            for _ in range(args.procs)]

    def stop(*_: object) -> None:
        for k in kids:
            k.terminate()
        for k in kids:
            k.wait()
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    for k in kids:
        assert k.stdout is not None
        if k.stdout.readline().strip() != "held":
            print("fragment_host: a child failed", file=sys.stderr, flush=True)
            stop()
    held = per // KEEP_EVERY * PAGE * args.procs
    print(f"fragment_host: holding {held / GIB:.1f} GiB spread over {per * args.procs / GIB:.1f} GiB "
          f"({time.perf_counter() - t:.1f} s); after: {free_blocks()}", flush=True)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    sys.exit(main())
