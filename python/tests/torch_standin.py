"""A stand-in for the part of torch's caching allocator that gpu_pager's pools rely on, for
host tests without torch or a GPU: ``MemPool`` with torch's use counts (a pool is freed at
``empty_cache`` only once its use count is 0, and a count that goes below 0 or a pool
revived at 0 is torch's internal-assert abort), one thread's allocations routed to a pool,
whole segments cached and reused, and the pluggable allocator calling gpu_pager's real C
hooks on the host backend.

``install()`` puts it in ``sys.modules["torch"]``; ``empty(nbytes)`` allocates a "tensor";
``ABORTS`` lists what torch would have aborted on."""

from __future__ import annotations

import ctypes
import itertools
import sys
import threading
import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

SEGMENT = 2 << 20
ABORTS: list[str] = []
_ids = itertools.count(1)
_pools: dict[tuple[int, int], "_Pool"] = {}
_routes = threading.local()
_routed = [0]  # allocations routed to a pool, on every thread


class _Segment:
    def __init__(self, address: int, size: int) -> None:
        self.address, self.size, self.active = address, size, False
        # A shared segment (``empty(..., shared=True)``): the sizes of its live blocks, and
        # whether each is live; ``active`` then says whether any is.
        self.blocks: list[list[Any]] | None = None

    def free_room(self) -> int:
        return self.size - sum(int(size) for size, live in self.blocks or [] if live)


class _Pool:
    def __init__(self, allocator: Any) -> None:
        self.use_count = 1
        self.allocator = allocator
        self.segments: list[_Segment] = []

    def release_unused(self) -> None:
        for seg in [s for s in self.segments if not s.active]:
            if self.allocator is not None:
                self.allocator.free(seg.address, seg.size, 0, None)
            self.segments.remove(seg)


class Tensor:
    """Holds one whole segment, or one block of a shared one; its memory returns to the
    pool's cache when it dies."""

    def __init__(self, seg: _Segment, block: list[Any] | None = None) -> None:
        self._seg, self._block = seg, block

    def data_ptr(self) -> int:
        return self._seg.address

    def __del__(self) -> None:
        if self._block is None:
            self._seg.active = False
            return
        self._block[1] = False
        self._seg.active = any(live for _, live in self._seg.blocks or [])


def _stack() -> list[tuple[int, int]]:
    stack: list[tuple[int, int]] = _routes.__dict__.setdefault("stack", [])
    return stack


SHARED_SEGMENT = 20 << 20
"""torch's segment for allocations of 1 to 10 MiB, which share it (``empty(shared=True)``)."""


def _shared(pool: _Pool, nbytes: int) -> Tensor:
    """A block of ``nbytes`` in a shared segment of ``pool`` with room for it, or a new one:
    torch splits such segments, and a segment with one live block is not free."""
    seg = next((s for s in pool.segments if s.blocks is not None and s.free_room() >= nbytes), None)
    if seg is None:
        address = pool.allocator.malloc(SHARED_SEGMENT, 0, None)
        if not address:
            raise OutOfMemoryError(f"no memory for {SHARED_SEGMENT} bytes")
        seg = _Segment(address, SHARED_SEGMENT)
        seg.blocks = []
        pool.segments.append(seg)
    block: list[Any] = [nbytes, True]
    seg.blocks = [b for b in seg.blocks or [] if b[1]] + [block]
    seg.active = True
    return Tensor(seg, block)


def empty(nbytes: int, shared: bool = False) -> Tensor:
    """A tensor of ``nbytes`` in the pool this thread's allocations go to (a cached unused
    segment of the size if there is one), or outside every pool. ``shared``: a block of a
    20 MiB segment that other blocks share (torch's way for 1 to 10 MiB), inside a pool."""
    size = -(-nbytes // SEGMENT) * SEGMENT
    stack = _stack()
    if shared and stack:
        return _shared(_pools[stack[-1]], nbytes)
    if not stack:
        seg = _Segment(0, size)
        seg.active = True
        return Tensor(seg)
    pool = _pools[stack[-1]]
    for seg in pool.segments:
        if not seg.active and seg.size == size:
            seg.active = True
            return Tensor(seg)
    address = pool.allocator.malloc(size, 0, None) if pool.allocator is not None else next(_ids) << 32
    if not address:
        raise OutOfMemoryError(f"no memory for {size} bytes")
    seg = _Segment(address, size)
    seg.active = True
    pool.segments.append(seg)
    return Tensor(seg)


class OutOfMemoryError(RuntimeError):
    pass


class _Pluggable:
    def __init__(self, path: str, malloc: str, free: str) -> None:
        lib = ctypes.CDLL(path)
        self.malloc = getattr(lib, malloc)
        self.malloc.restype = ctypes.c_void_p
        self.malloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        self.free = getattr(lib, free)
        self.free.restype = None
        self.free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]

    def allocator(self) -> "_Pluggable":
        return self


class MemPool:
    def __init__(self, allocator: Any = None) -> None:
        self.id = (0, next(_ids))
        _pools[self.id] = _Pool(allocator)

    def snapshot(self, include_traces: bool = True) -> list[dict[str, Any]]:
        pool = _pools.get(self.id)
        if pool is None:
            return []
        def blocks(s: _Segment) -> list[dict[str, Any]]:
            if s.blocks is None:
                return [{"size": s.size, "state": "active_allocated" if s.active else "inactive"}]
            live = [{"size": size, "state": "active_allocated"} for size, on in s.blocks if on]
            return live + [{"size": s.free_room(), "state": "inactive"}] * (s.free_room() > 0)

        return [{"address": s.address, "total_size": s.size, "blocks": blocks(s)} for s in pool.segments]

    def __del__(self) -> None:
        if _routed[0] or self.id not in _pools:
            ABORTS.append(f"MemPool {self.id} destroyed while allocations are routed, or after torch freed it")
            return
        _release_pool(0, self.id)


def _release_pool(device: int, pool_id: tuple[int, int]) -> None:
    pool = _pools.get(pool_id)
    if pool is None or pool.use_count <= 0:
        ABORTS.append(f"releasePool of {pool_id}: use_count below 0")
        return
    pool.use_count -= 1


def _begin(device: int, pool_id: tuple[int, int]) -> None:
    pool = _pools.get(pool_id)
    if pool is None or pool.use_count <= 0:
        ABORTS.append(f"routing to {pool_id}, a pool torch let go")
        return
    pool.use_count += 1
    _routed[0] += 1
    _stack().append(pool_id)


def _end(device: int, pool_id: tuple[int, int]) -> None:
    stack = _stack()
    if pool_id not in stack:
        raise RuntimeError("endAllocatePool: not currently recording to mempool_id")
    if pool_id in stack:
        _routed[0] -= 1
        stack.reverse()
        stack.remove(pool_id)
        stack.reverse()


def empty_cache() -> None:
    for pool_id, pool in list(_pools.items()):
        if pool.use_count == 0:
            pool.release_unused()
            if not pool.segments:
                del _pools[pool_id]


@contextmanager
def use_mem_pool(pool: MemPool, device: Any = None) -> Iterator[None]:
    _begin(0, pool.id)
    try:
        yield
    finally:
        _end(0, pool.id)
        _release_pool(0, pool.id)


@contextmanager
def _device(index: int) -> Iterator[None]:
    yield


CAPTURING = [False]
"""Whether the stand-in's current stream is capturing a CUDA graph (tests set it)."""


def _synchronize(device: Any = None) -> None:
    if CAPTURING[0]:
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")


def install() -> types.ModuleType:
    """Puts the stand-in in ``sys.modules["torch"]``."""
    torch = types.ModuleType("torch")
    torch.__version__ = "2.11.0"  # type: ignore[attr-defined]
    torch.OutOfMemoryError = OutOfMemoryError  # type: ignore[attr-defined]
    torch.empty = empty  # type: ignore[attr-defined]
    torch.Tensor = Tensor  # type: ignore[attr-defined]
    torch._C = types.SimpleNamespace(  # type: ignore[attr-defined]
        _cuda_releasePool=_release_pool,
        _cuda_beginAllocateCurrentThreadToPool=_begin,
        _cuda_endAllocateToPool=_end,
    )
    memory = types.SimpleNamespace(
        CUDAPluggableAllocator=_Pluggable,
        MemPool=MemPool,
        use_mem_pool=use_mem_pool,
        empty_cache=empty_cache,
        _set_allocator_settings=lambda s: None,
    )
    torch.cuda = types.SimpleNamespace(  # type: ignore[attr-defined]
        memory=memory,
        MemPool=MemPool,
        use_mem_pool=use_mem_pool,
        empty_cache=empty_cache,
        synchronize=_synchronize,
        is_current_stream_capturing=lambda: CAPTURING[0],
        current_device=lambda: 0,
        device=_device,
    )
    sys.modules["torch"] = torch
    return torch
