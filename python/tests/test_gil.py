"""Long calls release the GIL: other Python threads run while a release copies."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable

import pytest

import gpu_pager

MIB = 1 << 20

# A release must take this long for a thread's progress in its middle to tell anything.
LONG_ENOUGH_S = 0.02


def _release_watched(pager: gpu_pager.Pager, tag: str) -> tuple[float, float, list[float]]:
    """Releases ``tag`` while another thread counts: (start, end, the counter's times)."""
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
        pager.release(tag)  # pins, hashes and copies with the GIL released
        t1 = time.perf_counter()
    finally:
        stop.set()
        counter.join()
        sys.setswitchinterval(old)
    return t0, t1, samples


def test_release_lets_python_threads_run(pager: gpu_pager.Pager, new_tag: Callable[[], str]) -> None:
    # The host backend's 32 MiB release is long enough; a GPU moves 32 MiB in about a
    # millisecond, so the size grows until the release lasts.
    for size in (32 * MIB, 256 * MIB, 1024 * MIB):
        tag = new_tag()
        pager.region(tag, "preserve", size)
        buf = pager.alloc(tag, size)
        pager.write(buf, size - 4, b"\x5a" * 4)
        t0, t1, samples = _release_watched(pager, tag)
        if t1 - t0 >= LONG_ENOUGH_S:
            break
        pager.resume(tag)
        pager.free(buf)
        pager.remove(tag)
    else:
        pytest.skip(f"a release of {size // MIB} MiB took only {(t1 - t0) * 1e3:.1f} ms: too short to tell")
    # With the GIL held for the whole call, the counter could not run in its middle.
    middle = [s for s in samples if t0 + 0.25 * (t1 - t0) < s < t0 + 0.75 * (t1 - t0)]
    assert middle, f"no Python ran during a {(t1 - t0) * 1e3:.0f} ms release of {size // MIB} MiB"
    pager.resume(tag)
    assert pager.read(buf, size - 4, 4) == b"\x5a" * 4
