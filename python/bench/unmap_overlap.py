"""Does freeing one region's device memory overlap the copies of another, or does the driver
run it behind them? The question behind a release that unmaps its discarded tags (the KV
cache) while its preserved tags (the weights) are still copying to the host.

Bare driver calls through ctypes, no gpu_pager: ``--weights-gib`` of weights in ``--tensors``
allocations (each its own ``cuMemCreate``, mapped into one reservation) are copied to pinned
host memory with ``cuMemcpyDtoHAsync`` on one stream, and ``--kv-gib`` of KV cache in 2 GiB
handles is unmapped and released (``cuMemUnmap`` + ``cuMemRelease``):

- ``serial``: the copies, wait, then the KV's unmap, then the weights' unmap (a release today);
- ``overlap``: the copies enqueued, the KV's unmap at once on the same thread, then the wait;
- ``overlap_thread``: the KV's unmap on a second thread while this one enqueues and waits.

Prints each mode's median over ``--rounds`` and the parts of ``serial`` (copy alone, each
unmap alone). Then the same call by call: how long the KV cache's unmap takes while the
copies run and when the copies end (``beside``), and the weights unmapped ``--groups`` at a
time, each group as soon as its copies are done, while the later groups copy (``pipelined``:
what a release does). Then the other question of a release's unmap: the weights' handles unmapped one
``cuMemUnmap`` each, or one ``cuMemUnmap`` over the whole span (the driver takes a range that
covers several mappings laid back to back), each followed by the handles' ``cuMemRelease``
(timed apart), and the handles released as soon as they are mapped (the driver frees the
memory at the unmap then; the release's time moves to the map), with the free device memory
checked after the unmap. The unmap's time varies about two-fold from one process to the
next; two guesses are timed: the weights mapped right after 32 GiB were freed (the driver
still scrubbing them) against 0.5 s after, and, for each NUMA node of the host, the
one-call unmap with this process's threads on that node's cores. On the GPU machine, from
the repository root::

    bash .gpu/on-device py python/bench/unmap_overlap.py --weights-gib 16 --kv-gib 16 --rounds 4
"""

from __future__ import annotations

import argparse
import ctypes
import os
import random
import statistics
import threading
import time
from typing import Any

GIB = 1 << 30
MIB = 1 << 20
GRANULE = 2 * MIB


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class _AllocProp(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", _Location),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", _AllocFlags),
    ]


class _AccessDesc(ctypes.Structure):
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


# (base, total bytes, [(address, bytes, handle)]): one reservation and its mappings.
Mapped = tuple[int, int, list[tuple[int, int, int]]]


class Driver:
    """The few VMM and copy calls this probe makes, on device 0's primary context (torch's)."""

    def __init__(self) -> None:
        self.cu = ctypes.CDLL("libcuda.so.1")
        self.prop = _AllocProp()
        self.prop.type = 1  # CU_MEM_ALLOCATION_TYPE_PINNED
        self.prop.location.type = 1  # CU_MEM_LOCATION_TYPE_DEVICE
        self.access = _AccessDesc()
        self.access.location.type = 1
        self.access.flags = 3  # CU_MEM_ACCESS_FLAGS_PROT_READWRITE

    def check(self, result: int, what: str) -> None:
        if result != 0:
            raise RuntimeError(f"{what} failed: CUresult {result}")

    def map(self, sizes: list[int]) -> Mapped:
        """One reservation with one handle per size mapped back to back, read/write."""
        total = sum(sizes)
        base = ctypes.c_uint64()
        self.check(self.cu.cuMemAddressReserve(ctypes.byref(base), ctypes.c_size_t(total), ctypes.c_size_t(0),
                                               ctypes.c_uint64(0), ctypes.c_ulonglong(0)), "cuMemAddressReserve")
        parts: list[tuple[int, int, int]] = []
        offset = 0
        for size in sizes:
            handle = ctypes.c_ulonglong()
            at = ctypes.c_uint64(base.value + offset)
            self.check(self.cu.cuMemCreate(ctypes.byref(handle), ctypes.c_size_t(size), ctypes.byref(self.prop),
                                           ctypes.c_ulonglong(0)), "cuMemCreate")
            self.check(self.cu.cuMemMap(at, ctypes.c_size_t(size), ctypes.c_size_t(0), handle,
                                        ctypes.c_ulonglong(0)), "cuMemMap")
            self.check(self.cu.cuMemSetAccess(at, ctypes.c_size_t(size), ctypes.byref(self.access),
                                              ctypes.c_size_t(1)), "cuMemSetAccess")
            parts.append((base.value + offset, size, handle.value))
            offset += size
        return base.value, total, parts

    def release_handles(self, mapped: Mapped) -> tuple[Mapped, float]:
        """Releases every handle of ``mapped`` while it stays mapped (the memory is freed
        when it is unmapped): the mapping without handles, and the releases' seconds."""
        base, total, parts = mapped
        t = time.perf_counter()
        for _, _, handle in parts:
            self.check(self.cu.cuMemRelease(ctypes.c_ulonglong(handle)), "cuMemRelease (mapped)")
        return (base, total, [(a, n, 0) for a, n, _ in parts]), time.perf_counter() - t

    def free_bytes(self) -> int:
        """The device's free memory (``cuMemGetInfo``)."""
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        self.check(self.cu.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)), "cuMemGetInfo")
        return free.value

    def current_context(self) -> int:
        """This thread's current context (``cuCtxGetCurrent``)."""
        ctx = ctypes.c_void_p()
        self.check(self.cu.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
        return ctx.value or 0

    def unmap_on_thread(self, mapped: Mapped, context: int) -> None:
        """``unmap`` on another thread, with ``context`` made current there first."""
        self.check(self.cu.cuCtxSetCurrent(ctypes.c_void_p(context)), "cuCtxSetCurrent")
        self.unmap(mapped)

    def unmap(self, mapped: Mapped) -> None:
        """Unmaps and releases every handle, then frees the reservation."""
        base, total, parts = mapped
        for address, size, handle in parts:
            self.check(self.cu.cuMemUnmap(ctypes.c_uint64(address), ctypes.c_size_t(size)), "cuMemUnmap")
            self.check(self.cu.cuMemRelease(ctypes.c_ulonglong(handle)), "cuMemRelease")
        self.check(self.cu.cuMemAddressFree(ctypes.c_uint64(base), ctypes.c_size_t(total)), "cuMemAddressFree")

    def unmap_timed(self, mapped: Mapped, one_call: bool) -> tuple[float, float]:
        """``unmap``, timing the unmapping (one call per handle, or ``one_call`` over the
        span) and the releases apart: (unmap s, release s)."""
        base, total, parts = mapped
        t0 = time.perf_counter()
        if one_call:
            self.check(self.cu.cuMemUnmap(ctypes.c_uint64(base), ctypes.c_size_t(total)), "cuMemUnmap (span)")
        else:
            for address, size, _ in parts:
                self.check(self.cu.cuMemUnmap(ctypes.c_uint64(address), ctypes.c_size_t(size)), "cuMemUnmap")
        t1 = time.perf_counter()
        for _, _, handle in parts:
            if handle:  # 0: released when it was mapped
                self.check(self.cu.cuMemRelease(ctypes.c_ulonglong(handle)), "cuMemRelease")
        t2 = time.perf_counter()
        self.check(self.cu.cuMemAddressFree(ctypes.c_uint64(base), ctypes.c_size_t(total)), "cuMemAddressFree")
        return t1 - t0, t2 - t1

    def copy_to_host(self, mapped: Mapped, host: int, stream: int) -> None:
        """Enqueues one device-to-host copy per handle into ``host``, back to back."""
        offset = 0
        for address, size, _ in mapped[2]:
            self.check(self.cu.cuMemcpyDtoHAsync_v2(ctypes.c_void_p(host + offset), ctypes.c_uint64(address),
                                                    ctypes.c_size_t(size), ctypes.c_void_p(stream)),
                       "cuMemcpyDtoHAsync")
            offset += size


def weight_sizes(total: int, n: int) -> list[int]:
    """``n`` sizes of about ``total / n`` each (±50 %), multiples of the 2 MiB granule."""
    rng = random.Random(7)
    shares = [rng.uniform(0.5, 1.5) for _ in range(n)]
    scale = total / sum(shares)
    return [max(GRANULE, int(s * scale) // GRANULE * GRANULE) for s in shares]


def numa_nodes() -> list[tuple[int, set[int]]]:
    """The host's NUMA nodes that have cores this process may run on: (node, its cores)."""
    root = "/sys/devices/system/node"
    allowed = os.sched_getaffinity(0)
    found = []
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        if not (name.startswith("node") and name[4:].isdigit()):
            continue
        cpus: set[int] = set()
        with open(os.path.join(root, name, "cpulist")) as f:
            for part in f.read().strip().split(","):
                if part:
                    lo, _, hi = part.partition("-")
                    cpus.update(range(int(lo), int(hi or lo) + 1))
        if cpus & allowed:
            found.append((int(name[4:]), cpus & allowed))
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weights-gib", type=float, default=16)
    ap.add_argument("--tensors", type=int, default=300)
    ap.add_argument("--kv-gib", type=int, default=16, help="in 2 GiB handles")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--groups", type=int, default=8, help="the pipelined unmap's groups of weights")
    args = ap.parse_args()
    import torch

    torch.empty(1, device="cuda")  # device 0's primary context, current on this thread
    driver = Driver()
    sizes = weight_sizes(int(args.weights_gib * GIB), args.tensors)
    host: Any = torch.empty(sum(sizes), dtype=torch.uint8, pin_memory=True)
    stream: Any = torch.cuda.Stream()
    rows: dict[str, list[float]] = {k: [] for k in (
        "serial", "overlap", "overlap_thread", "copy alone", "KV unmap alone", "weights unmap alone")}
    for _ in range(args.rounds):
        for mode in ("serial", "overlap", "overlap_thread"):
            weights = driver.map(sizes)
            kv = driver.map([2 * GIB] * (args.kv_gib // 2))
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            if mode == "serial":
                driver.copy_to_host(weights, host.data_ptr(), stream.cuda_stream)
                stream.synchronize()
                t1 = time.perf_counter()
                driver.unmap(kv)
                t2 = time.perf_counter()
                driver.unmap(weights)
                rows["copy alone"].append(t1 - t0)
                rows["KV unmap alone"].append(t2 - t1)
                rows["weights unmap alone"].append(time.perf_counter() - t2)
            elif mode == "overlap":
                driver.copy_to_host(weights, host.data_ptr(), stream.cuda_stream)
                driver.unmap(kv)
                stream.synchronize()
                driver.unmap(weights)
            else:
                helper = threading.Thread(target=driver.unmap_on_thread, args=(kv, driver.current_context()))
                helper.start()
                driver.copy_to_host(weights, host.data_ptr(), stream.cuda_stream)
                stream.synchronize()
                helper.join()
                driver.unmap(weights)
            rows[mode].append(time.perf_counter() - t0)
        # The unmap beside the copies, timed call by call: how long the KV's unmap takes
        # while the copies run (its call returns within its own cost, or only once the
        # copies end), and the weights unmapped a group at a time as each group's copies
        # end (``--groups``), while the later groups' copies run.
        weights = driver.map(sizes)
        kv = driver.map([2 * GIB] * (args.kv_gib // 2))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        driver.copy_to_host(weights, host.data_ptr(), stream.cuda_stream)
        t1 = time.perf_counter()
        driver.unmap(kv)
        t2 = time.perf_counter()
        stream.synchronize()
        t3 = time.perf_counter()
        driver.unmap(weights)
        rows.setdefault("beside: KV unmap call, during the copies", []).append(t2 - t1)
        rows.setdefault("beside: the copies end after", []).append(t3 - t0)
        rows.setdefault("beside: in all", []).append(time.perf_counter() - t0)
        weights = driver.map(sizes)
        torch.cuda.synchronize()
        base, total, parts = weights
        step = -(-len(parts) // args.groups)
        groups = [parts[i:i + step] for i in range(0, len(parts), step)]
        t0 = time.perf_counter()
        events = []
        offset = 0
        for g in groups:
            driver.copy_to_host((0, 0, g), host.data_ptr() + offset, stream.cuda_stream)
            offset += sum(n for _, n, _ in g)
            e = torch.cuda.Event()
            e.record(stream)
            events.append(e)
        waited = unmapping = 0.0
        for g, e in zip(groups, events):
            ta = time.perf_counter()
            e.synchronize()
            tb = time.perf_counter()
            for address, size, handle in g:
                driver.check(driver.cu.cuMemUnmap(ctypes.c_uint64(address), ctypes.c_size_t(size)), "cuMemUnmap")
                driver.check(driver.cu.cuMemRelease(ctypes.c_ulonglong(handle)), "cuMemRelease")
            waited += tb - ta
            unmapping += time.perf_counter() - tb
        last = time.perf_counter() - tb
        driver.check(driver.cu.cuMemAddressFree(ctypes.c_uint64(base), ctypes.c_size_t(total)), "cuMemAddressFree")
        rows.setdefault(f"pipelined in {len(groups)} groups: in all", []).append(time.perf_counter() - t0)
        rows.setdefault(f"pipelined in {len(groups)} groups: unmapping (all groups)", []).append(unmapping)
        rows.setdefault(f"pipelined in {len(groups)} groups: the last group's unmap", []).append(last)
        for one_call in (False, True):
            weights = driver.map(sizes)
            torch.cuda.synchronize()
            unmapped, released = driver.unmap_timed(weights, one_call)
            how = "one call" if one_call else "a call per handle"
            rows.setdefault(f"weights unmap, {how}", []).append(unmapped)
            rows.setdefault(f"weights release after unmap, {how}", []).append(released)
        weights = driver.map(sizes)
        weights, released = driver.release_handles(weights)
        torch.cuda.synchronize()
        before = driver.free_bytes()
        unmapped, _ = driver.unmap_timed(weights, True)
        rows.setdefault("weights released at map: the releases", []).append(released)
        rows.setdefault("weights released at map: unmap, one call", []).append(unmapped)
        freed = driver.free_bytes() - before
        if freed < weights[1]:
            raise SystemExit(f"the unmap of handles released at map freed {freed} of {weights[1]} bytes")
    # Memory mapped while the driver still scrubs 32 GiB just freed, against memory mapped
    # 0.5 s after the free: does where the pages come from change what unmapping them costs?
    for wait in (0.0, 0.5):
        for _ in range(args.rounds):
            driver.unmap(driver.map(sizes + [2 * GIB] * (args.kv_gib // 2)))
            time.sleep(wait)
            weights = driver.map(sizes)
            torch.cuda.synchronize()
            unmapped, released = driver.unmap_timed(weights, True)
            rows.setdefault(f"mapped {wait} s after a free: unmap, one call", []).append(unmapped)
            rows.setdefault(f"mapped {wait} s after a free: release after unmap", []).append(released)
    for node, cpus in numa_nodes():
        os.sched_setaffinity(0, cpus)
        for _ in range(args.rounds):
            weights = driver.map(sizes)
            torch.cuda.synchronize()
            unmapped, released = driver.unmap_timed(weights, True)
            rows.setdefault(f"node {node} ({len(cpus)} cores): unmap, one call", []).append(unmapped)
            rows.setdefault(f"node {node}: release after unmap", []).append(released)
    for name, xs in rows.items():
        print(f"{name}: median {statistics.median(xs) * 1e3:.1f} ms, "
              f"each {[round(x * 1e3, 1) for x in xs]}")


if __name__ == "__main__":
    main()
