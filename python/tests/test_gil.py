"""Long calls release the GIL: other Python threads run while a release copies."""

from __future__ import annotations

import sys
import threading
import time

import pytest

import gpu_pager

MIB = 1 << 20


def test_release_lets_python_threads_run(pager: gpu_pager.Pager, tag: str) -> None:
    size = 32 * MIB
    pager.region(tag, "preserve", size)
    buf = pager.alloc(tag, size)
    pager.write(buf, 0, b"\x5a" * size)

    samples: list[float] = []
    stop = threading.Event()

    def count() -> None:
        while not stop.is_set():
            samples.append(time.perf_counter())

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)
    counter = threading.Thread(target=count)
    counter.start()
    try:
        time.sleep(0.01)
        t0 = time.perf_counter()
        pager.release(tag)  # pins, hashes and copies 32 MiB with the GIL released
        t1 = time.perf_counter()
    finally:
        stop.set()
        counter.join()
        sys.setswitchinterval(old)
    if t1 - t0 < 0.02:
        pytest.skip(f"the release took only {(t1 - t0) * 1e3:.1f} ms: too short to tell")
    # With the GIL held for the whole call, the counter could not run in its middle.
    middle = [s for s in samples if t0 + 0.25 * (t1 - t0) < s < t0 + 0.75 * (t1 - t0)]
    assert middle, f"no Python ran during a {(t1 - t0) * 1e3:.0f} ms release"
    pager.resume(tag)
    assert pager.read(buf, size - 4, 4) == b"\x5a" * 4
