"""The drop-ins' torch helpers: their own pools trimmed, kept for graphs, retired or dropped,
and a tag's pools listed, on the pool machinery of ``gpu_pager.torch`` (which retires pools
instead of destroying them: see its module docs). Not part of ``gpu_pager.torch``'s API."""

from __future__ import annotations

import atexit
from collections.abc import Iterable
from typing import Any

import gpu_pager.torch as gpt

__all__ = ["trim_pools", "keep_for_graphs", "tag_pools", "retire_pool", "drop_pool_when_unused"]


def trim_pools(pools: dict[Any, Any], keys: Iterable[Any], index: int) -> int:
    """Retires each pool ``pools[key]`` of ``keys`` (a drop-in's own pools) on device
    ``index`` that holds a segment with nothing allocated in it, except pools of CUDA
    graphs, and lets torch free what retired pools no longer use. Returns the bytes of the
    unused segments found."""
    return gpt._trim_pools(pools, keys, index)


def keep_for_graphs(key: Any) -> None:
    """Marks the pool of ``key`` (a drop-in's key) as one that CUDA graphs are captured
    into: ``trim_pools`` never retires it, since its free blocks may hold state a replay
    reads."""
    gpt._keep_for_graphs(key)


def tag_pools(key: Any) -> list[Any]:
    """The pools of ``key`` (``(tag, device)`` of ``gpu_pager.torch``) that may hold
    segments: its current pool, if any, and the retired ones."""
    with gpt._lock:
        current = [gpt._pools[key]] if key in gpt._pools else []
        return current + [r.pool for r in gpt._old if r.key == key]


def retire_pool(pool: Any, device: Any = None) -> None:
    """Retires ``pool`` (a pool of torch's own allocator that a torch_memory_saver
    ``disable()`` block allocated in): what it holds unused goes back to the device now,
    and the rest as its tensors die, at a later ``torch.cuda.empty_cache()``. The pool
    object is kept to the end of the process (destroying one aborts torch in some
    states)."""
    index = gpt._index(device)
    with gpt._lock:
        gpt._retire(pool, None, index)
    gpt._give_back(index)


# Pools of torch's own allocator that the torch_memory_saver drop-in's ``disable()`` blocks
# ended with in preload mode, while tensors still lived in them: destroyed once empty.
_unused_later: list[Any] = []


def drop_pool_when_unused(pool: Any) -> None:
    """Destroys ``pool`` (a pool of torch's own allocator that a torch_memory_saver
    ``disable()`` block allocated in, where no allocations are routed to pools: preload
    mode) once no tensor lives in it: at once when none does, else at a later call of
    this. Destroying it empties that pool's cache alone, where ``retire_pool`` empties
    torch's whole cache (whose segments the preload library may have routed into regions,
    to be paused and resumed). torch aborts when a pool is destroyed while tensors live in
    it: such pools are kept past exit."""
    torch = gpt._torch()
    with gpt._lock:
        if not _unused_later:
            atexit.register(_keep_unused_later)
        _unused_later.append(pool)
    torch.cuda.synchronize()
    with gpt._lock:
        done = [p for p in _unused_later if not any(used for _, used in gpt._segments(p))]
        _unused_later[:] = [p for p in _unused_later if p not in done]
    del done


def _keep_unused_later() -> None:
    for p in list(_unused_later):
        gpt._keep_forever(p)
