"""PyTorch integration: tensors allocated inside ``region(tag)`` live in the pager's region
``tag``, at addresses that survive release and resume (so CUDA graphs that captured them
stay valid).

::

    import torch
    import gpu_pager.torch as gpt

    with gpt.region("weights", "preserve", bytes=8 << 30):
        model = load_model()  # parameters come from region "weights"
    with gpt.region("kv_cache", "discard", bytes=32 << 30):
        kv = torch.empty(...)

    gpt.release(["kv_cache", "weights"])  # the trainer runs
    gpt.resume("weights")  # weights back bit-exact, same addresses
    gpt.resume("kv_cache")

How: torch's ``CUDAPluggableAllocator`` is pointed at two C functions that the extension
module ``gpu_pager._native`` exports (``gpu_pager_torch_malloc``/``gpu_pager_torch_free``),
inside one ``torch.cuda.MemPool`` per (tag, device), kept for the whole process. torch's
caching allocator still caches and splits blocks in the segments it gets from us. Segment
frees come from torch at its own pace (``del pool`` or ``empty_cache`` after a pool is
dropped), not when tensors die.

torch is imported on first use, so that this module imports without it. Without ``bytes``
the region grows with torch's segments (multiples of 2 MiB): memory is mapped under live
segments only; with ``bytes`` it is a fixed region that must hold every segment.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from gpu_pager import _native
from gpu_pager._native import Pager, Policy, RegionInfo, Report

__all__ = [
    "MALLOC_SYMBOL",
    "FREE_SYMBOL",
    "USE_TAG_SYMBOL",
    "library_path",
    "use_tag",
    "current_tag",
    "last_error",
    "allocator",
    "pool",
    "pager",
    "region",
    "release",
    "resume",
]

MALLOC_SYMBOL = "gpu_pager_torch_malloc"
"""The alloc function torch's pluggable allocator calls: ``void* (size_t, int, cudaStream_t)``."""
FREE_SYMBOL = "gpu_pager_torch_free"
"""The free function: ``void (void*, size_t, int, cudaStream_t)``."""
USE_TAG_SYMBOL = "gpu_pager_use_tag"
"""Sets the calling thread's tag for new segments: ``int (int device, const char* tag)``."""

_lock = threading.Lock()
_allocator: Any = None
# One pool per (tag, device), never dropped: a pool bound to one device silently bypasses
# the allocator on another, and dropping a pool frees segments a CUDA graph may still use.
_pools: dict[tuple[str, int], Any] = {}
_lib: ctypes.CDLL | None = None


def _torch() -> Any:
    import torch

    return torch


def library_path() -> str:
    """The path of the shared object that exports the allocator functions: the extension
    module itself, so that torch and Python share one pager per device."""
    path = _native.__file__
    assert path is not None
    return path


def _c() -> ctypes.CDLL:
    global _lib
    with _lock:
        if _lib is None:
            lib = ctypes.CDLL(library_path())
            lib.gpu_pager_use_tag.argtypes = [ctypes.c_int, ctypes.c_char_p]
            lib.gpu_pager_use_tag.restype = ctypes.c_int
            _lib = lib
        return _lib


def use_tag(device: int, tag: str | None) -> None:
    """Sets (``None``: clears) the region that new torch segments on ``device`` come from,
    for the calling thread. ``region()`` does this for you."""
    code = _c().gpu_pager_use_tag(device, None if tag is None else tag.encode())
    if code != 0:
        names = dict(_native.error_codes())
        cls = getattr(_native, f"{names.get(code, 'InvalidArgument')}Error")
        raise cls(last_error() or f"gpu_pager_use_tag failed with code {code}")


def current_tag(device: int) -> str | None:
    """The calling thread's tag for new segments on ``device``, or ``None``."""
    return _native._torch_hook_state(device)[0]


def last_error() -> str | None:
    """Why the calling thread's last failed allocation (or free) failed, if one did. torch
    raises a bare ``torch.OutOfMemoryError`` when ours returns nothing; this says why."""
    return _native._torch_hook_state(0)[1]


def allocator() -> Any:
    """The process's ``torch.cuda.memory.CUDAPluggableAllocator`` over gpu_pager."""
    global _allocator
    torch = _torch()
    with _lock:
        if _allocator is None:
            _allocator = torch.cuda.memory.CUDAPluggableAllocator(
                library_path(), MALLOC_SYMBOL, FREE_SYMBOL
            )
        return _allocator


def _index(device: Any) -> int:
    torch = _torch()
    if device is None:
        return int(torch.cuda.current_device())
    if isinstance(device, int):
        return device
    index = torch.device(device).index
    return int(torch.cuda.current_device()) if index is None else int(index)


def pool(tag: str, device: Any = None) -> Any:
    """The ``torch.cuda.MemPool`` of ``tag`` on ``device`` (default: the current one),
    created on first use and kept for the whole process. Its ``.id`` can be passed as
    ``pool=`` to ``torch.cuda.graph``."""
    torch = _torch()
    index = _index(device)
    alloc = allocator()
    with _lock:
        p = _pools.get((tag, index))
        if p is None:
            with torch.cuda.device(index):  # a pool belongs to the device current at creation
                p = torch.cuda.MemPool(allocator=alloc.allocator())
            _pools[(tag, index)] = p
        return p


def pager(device: Any = None) -> Pager:
    """The pager of ``device`` (default: torch's current device)."""
    return Pager.for_device(_index(device))


def _ensure_region(
    p: Pager, tag: str, policy: Policy | str, bytes: int | None, prepin: bool
) -> RegionInfo:
    """Creates region ``tag``, or returns it if it exists with ``policy``: without ``bytes``
    an existing region is taken at its size, so that ``region(tag)`` can be entered again."""
    if bytes is None and tag in p.tags():
        info = p.info(tag)
        bytes = 0 if info.growing else info.size
    return p.region(tag, policy, bytes, prepin)


@contextmanager
def _expandable_segments_off() -> Iterator[None]:
    # A MemPool with a pluggable allocator does not work with expandable segments
    # (pytorch#147851); vLLM turns them off for the pool's context, and so do we.
    torch = _torch()
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    on = "expandable_segments:True" in conf
    if on:
        torch.cuda.memory._set_allocator_settings("expandable_segments:False")
    try:
        yield
    finally:
        if on:
            torch.cuda.memory._set_allocator_settings("expandable_segments:True")


@contextmanager
def region(
    tag: str,
    policy: Policy | str = "preserve",
    bytes: int | None = None,
    device: Any = None,
    prepin: bool = False,
) -> Iterator[RegionInfo]:
    """Tensors allocated by this thread inside the block on ``device`` (default: the current
    one) come from region ``tag``, created with ``policy`` and ``bytes`` if it does not
    exist. Nests: the previous tag is restored on exit. Yields the region's description.
    A segment that does not fit raises ``torch.OutOfMemoryError`` with our reason added as
    a note (and in ``last_error()``)."""
    torch = _torch()
    index = _index(device)
    info = _ensure_region(Pager.for_device(index), tag, policy, bytes, prepin)
    previous = current_tag(index)
    with _expandable_segments_off(), torch.cuda.use_mem_pool(pool(tag, index), device=index):
        use_tag(index, tag)
        try:
            yield info
        except torch.OutOfMemoryError as e:
            why = last_error()
            if why and hasattr(e, "add_note"):
                e.add_note(f"gpu_pager: {why}")
            raise
        finally:
            use_tag(index, previous)


def _tags(tags: str | Iterable[str]) -> list[str]:
    return [tags] if isinstance(tags, str) else list(tags)


def release(tags: str | Iterable[str], device: Any = None) -> Report:
    """Waits for torch's work on ``device`` and releases ``tags`` (see ``Pager.release``).
    Tensors in them keep their addresses; touching them before ``resume`` faults."""
    torch = _torch()
    index = _index(device)
    torch.cuda.synchronize(index)
    return Pager.for_device(index).release(_tags(tags))


def resume(tags: str | Iterable[str], device: Any = None) -> Report:
    """Resumes ``tags`` (see ``Pager.resume``); the contents of ``preserve`` regions are back
    when it returns."""
    return Pager.for_device(_index(device)).resume(_tags(tags))
