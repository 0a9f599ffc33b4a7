"""The pool machinery of ``gpu_pager.torch`` and of the drop-ins (package-private): torch
loaded and checked, the pluggable allocator, one ``torch.cuda.MemPool`` per (tag, device),
their retirement and trimming (see ``gpu_pager.torch``'s module docs), the pools of CUDA
graphs, and the contexts that route this thread's torch segments to a tag. One lock guards
the pools' tables. ``gpu_pager.torch`` re-exports the public functions; the drop-ins call
the rest here instead of reaching into ``gpu_pager.torch``."""

from __future__ import annotations

import atexit
import dataclasses
import os
import re
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from gpu_pager import _native
from gpu_pager._native import Pager, Policy, RegionInfo

if TYPE_CHECKING:
    from gpu_pager._native import _MediumName, _PolicyName


def _tags(tags: str | Iterable[str]) -> list[str]:
    return [tags] if isinstance(tags, str) else list(tags)


MALLOC_SYMBOL = "gpu_pager_torch_malloc"
"""The alloc function torch's pluggable allocator calls: ``void* (size_t, int, cudaStream_t)``."""
FREE_SYMBOL = "gpu_pager_torch_free"
"""The free function: ``void (void*, size_t, int, cudaStream_t)``."""
USE_TAG_SYMBOL = "gpu_pager_use_tag"
"""Sets the calling thread's tag for new segments: ``int (int device, const char* tag)``."""


lock = threading.Lock()
_allocator: Any = None
# One pool per (tag, device) (a pool bound to one device silently bypasses the allocator on
# another), until it is retired (see the module docs).
pools: dict[tuple[str, int], Any] = {}


@dataclasses.dataclass
class _Retired:
    """A pool that was retired, while segments may remain in it. torch aborts when a pool
    object is destroyed in some states (while any thread allocates to a pool, or after its
    use count was given back), so no pool object is ever destroyed: each is kept to the end
    of the process (keep_forever) and only its memory goes back."""

    key: Any
    index: int
    pool: Any
    # Its unused bytes after the last give-back (what torch could not free then: a context
    # or a graph still held the pool); a give-back is due again only when this grows.
    unused: int = 0
    # The free room of its segments that tensors still hold part of, after the last
    # give-back: mapped, and never used again, since nothing allocates to a retired pool.
    stranded: int = 0


retired: list[_Retired] = []
# Keys of pools that CUDA graphs were captured into: never retired by trim.
graph_keys: set[Any] = set()


TORCH_FLOOR = (2, 8)
"""The oldest torch (major, minor) this module and the drop-ins run on: 2.8 is the first with
``torch._C._cuda_beginAllocateCurrentThreadToPool``, which routes one thread's allocations to
a tag's pool. SGLang, vLLM and verl pin 2.8 or newer; tested on 2.11."""

_torch_checked = False


def check_torch_version(version: str) -> None:
    """Raises ``ImportError`` unless ``version`` (a ``torch.__version__`` such as
    ``"2.9.1+cu128"``) is ``TORCH_FLOOR`` or newer."""
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None or (int(found[1]), int(found[2])) < TORCH_FLOOR:
        floor = ".".join(map(str, TORCH_FLOOR))
        raise ImportError(
            f"gpu_pager.torch needs torch {floor} or newer, and this process has torch "
            f"{version}: upgrade torch (pip install 'torch>={floor}')"
        )


def load_torch() -> Any:
    """torch, imported on first use and checked against ``TORCH_FLOOR`` once."""
    global _torch_checked
    try:
        import torch
    except ModuleNotFoundError as e:
        if e.name != "torch":
            raise
        floor = ".".join(map(str, TORCH_FLOOR))
        raise ModuleNotFoundError(
            f"gpu_pager.torch (and the drop-ins) need torch {floor} or newer, and this Python "
            f"has no torch: install it (pip install 'torch>={floor}'), or use the pager without "
            "torch: gpu_pager.Pager.for_device(0) with its region, alloc, release and resume",
            name="torch",
        ) from None
    if not _torch_checked:
        check_torch_version(str(torch.__version__))
        _torch_checked = True
    return torch


def keep_forever(obj: Any) -> None:
    """Takes a reference that is never given back, so that ``obj`` outlives interpreter
    shutdown. torch's ``MemPool`` keeps a raw pointer to its allocator, and destroying a
    pool frees its cached segments through that allocator: if the allocator (or a pool)
    were collected at exit in the wrong order, torch would abort with "Trying to free a
    pointer not allocated here". Kept alive, neither is destroyed; the process's exit
    returns the memory."""
    _native._keep_forever(obj)


def library_path() -> str:
    """The path of the shared object that exports the allocator functions: the extension
    module itself, so that torch and Python share one pager per device."""
    path = _native.__file__
    assert path is not None
    return path


def use_tag(device: int, tag: str | None) -> None:
    """Sets (``None``: clears) the region that new torch segments on ``device`` come from,
    for the calling thread. The region must exist (``UnknownTagError``). ``use()`` does
    this for you."""
    _native._use_tag(device, tag)


def current_tag(device: int) -> str | None:
    """The calling thread's tag for new segments on ``device``, or ``None``."""
    return _native._torch_hook_state(device)[0]


def last_error() -> str | None:
    """Why the calling thread's last failed C call (a torch allocation or free included)
    failed, if one did. torch raises a bare ``torch.OutOfMemoryError`` when our allocation
    returns nothing; this says why."""
    return _native._torch_hook_state(0)[1]


def allocator() -> Any:
    """The process's ``torch.cuda.memory.CUDAPluggableAllocator`` over gpu_pager."""
    global _allocator
    torch = load_torch()
    with lock:
        if _allocator is None:
            _allocator = torch.cuda.memory.CUDAPluggableAllocator(
                library_path(), MALLOC_SYMBOL, FREE_SYMBOL
            )
            keep_forever(_allocator)
        return _allocator


def device_index(device: Any) -> int:
    torch = load_torch()
    if device is None:
        return int(torch.cuda.current_device())
    if isinstance(device, int):
        return device
    index = torch.device(device).index
    return int(torch.cuda.current_device()) if index is None else int(index)


def pool(tag: str, device: Any = None) -> Any:
    """The ``torch.cuda.MemPool`` of ``tag`` on ``device`` (default: the current one),
    created on first use and kept for the whole process. Its ``.id`` is what ``graph``
    captures into."""
    torch = load_torch()
    index = device_index(device)
    alloc = allocator()
    with lock:
        p = pools.get((tag, index))
        if p is None:
            with torch.cuda.device(index):  # a pool belongs to the device current at creation
                p = torch.cuda.MemPool(allocator=alloc.allocator())
            keep_forever(p)
            pools[(tag, index)] = p
        return p


def segments(pool: Any) -> list[tuple[int, int]]:
    """Each segment of ``pool``: its bytes, and the bytes of its blocks that a tensor (or a
    pending free) still holds."""
    return [
        (
            int(seg.get("total_size", 0)),
            sum(
                int(b.get("size", 0))
                for b in seg.get("blocks", [])
                if b.get("state", "active_allocated") != "inactive"
            ),
        )
        for seg in pool.snapshot(include_traces=False)
    ]


def _unused_bytes(pool: Any) -> int:
    """Bytes of the segments of ``pool`` with nothing allocated in them (torch frees those
    of a retired pool at ``empty_cache``)."""
    return sum(size for size, used in segments(pool) if not used)


def _unused_and_stranded(pool: Any) -> tuple[int, int]:
    """The unused bytes of ``pool`` (``_unused_bytes``) and the free room of its segments
    that tensors hold part of: what retiring the pool would strand."""
    found = segments(pool)
    return (
        sum(size for size, used in found if not used),
        sum(size - used for size, used in found if used),
    )


def retire(p: Any, key: Any, index: int) -> None:
    """Retires pool ``p`` (of ``key``, on device ``index``, already taken out of its pools,
    so that the key's next allocations start a new pool): gives back the reference the pool
    object holds on torch's pool, so that torch frees its unused segments at
    ``empty_cache`` once no thread allocates to it (a CUDA graph captured into it keeps it
    until the graph is reset). The object itself is kept to the end of the process."""
    torch = load_torch()
    keep_forever(p)
    torch._C._cuda_releasePool(index, p.id)
    retired.append(_Retired(key, index, p))


def give_back(index: int) -> None:
    """Waits for the device's work, then lets torch free the unused segments of retired
    pools (and its own cache, as ``torch.cuda.empty_cache()`` does); forgets the retired
    pools that have no segment left, and notes what the others still hold unused."""
    torch = load_torch()
    torch.cuda.synchronize(index)
    torch.cuda.empty_cache()
    with lock:
        retired[:] = [r for r in retired if r.pool.snapshot(include_traces=False)]
        for r in retired:
            r.unused, r.stranded = _unused_and_stranded(r.pool)


def _capturing() -> bool:
    """Whether this thread's current stream is capturing a CUDA graph."""
    return bool(load_torch().cuda.is_current_stream_capturing())


def trim_pools(pools: dict[Any, Any], keys: Iterable[Any], index: int) -> int:
    """Retires each pool ``pools[key]`` of ``keys`` on device ``index`` that holds a segment
    with nothing allocated in it, except the pools of CUDA graphs, and lets torch free what
    retired pools no longer use. A retired pool's partly used segments keep their free
    room mapped until their tensors die, so a pool is retired only when it frees more than
    that room and the room its key's earlier retired pools still strand: a tag that keeps
    a tensor at each step and frees another maps a bounded excess, not a segment more per
    step. Returns the bytes given back (none while the stream captures a CUDA graph:
    nothing is trimmed then). ``trim`` calls this with this module's pools, the drop-ins
    (``gpu_pager.compat.pools``) with their own."""
    if _capturing():
        # Retiring and giving back synchronize the device, which a capture forbids; the
        # next call outside the capture trims.
        return 0
    found = 0
    with lock:
        for key in [k for k in keys if k in pools and k not in graph_keys]:
            unused, stranded = _unused_and_stranded(pools[key])
            earlier = sum(r.stranded for r in retired if r.key == key and r.index == index)
            if unused > stranded + earlier:
                found += unused
                retire(pools.pop(key), key, index)
        # Tensors died in a retired pool since the last give-back.
        grown = any(r.index == index and _unused_bytes(r.pool) > r.unused for r in retired)
    if found or grown:
        give_back(index)
    return found


def trim(tags: str | Iterable[str] | None = None, device: Any = None) -> int:
    """Gives the device memory of segments with nothing allocated in them back from the
    pools of ``tags`` (default: every tag) on ``device``: what tensors freed inside the
    tags held. ``use`` and ``release`` do this by themselves; graph pools keep theirs.
    Returns the bytes given back."""
    index = device_index(device)
    wanted = None if tags is None else set(_tags(tags))
    keys = [k for k in list(pools) if k[1] == index and (wanted is None or k[0] in wanted)]
    return trim_pools(pools, keys, index)


def graph_pool(tag: str, device: Any = None) -> Any:
    """``pool(tag, device)``, marked as a pool CUDA graphs are captured into: ``trim``
    leaves it alone, since its free blocks may hold state that a replay reads."""
    p = pool(tag, device)
    keep_for_graphs((tag, device_index(device)))
    return p


def keep_for_graphs(key: Any) -> None:
    """Marks the pool of ``key`` (in this module's pools or a drop-in's) as one that CUDA
    graphs are captured into: ``trim_pools`` never retires it."""
    with lock:
        graph_keys.add(key)


def empty_cache(tags: str | Iterable[str] | None = None, device: Any = None) -> None:
    """Gives the torch segments of ``tags`` (default: every tag) on ``device`` back: retires
    the tags' pools, graph pools included (a new one starts at the next ``use``), and
    empties torch's cache. Unused segments go back now; those of tensors still alive, when
    they die and a later ``empty_cache`` (or ``use``, or ``release``) runs. A CUDA graph
    captured into a tag keeps the pool's memory while the graph lives."""
    index = device_index(device)
    wanted = None if tags is None else set(_tags(tags))
    with lock:
        for key in [k for k in pools if k[1] == index and (wanted is None or k[0] in wanted)]:
            graph_keys.discard(key)
            retire(pools.pop(key), key, index)
    give_back(index)


def ensure_region(
    p: Pager,
    tag: str,
    policy: Policy | _PolicyName,
    bytes: int | None,
    prepin: bool,
    medium: _MediumName = "pinned",
) -> RegionInfo:
    """Creates region ``tag`` (backed up in ``medium``), or returns it if it exists with
    ``policy``: without ``bytes`` an existing region is taken at its size and medium, so
    that ``use(tag)`` can be entered again."""
    if bytes is None and tag in p.tags():
        info = p.info(tag)
        medium = info.medium
        if info.kind != "growing":
            bytes = info.size
    return p.region(tag, policy, bytes, prepin, medium)


@contextmanager
def expandable_segments_off() -> Iterator[None]:
    # A MemPool with a pluggable allocator does not work with expandable segments
    # (pytorch#147851); vLLM turns them off for the pool's context, and so do we.
    torch = load_torch()
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
def tagged(index: int, tag: str) -> Iterator[None]:
    """This thread's torch segments on device ``index`` come from ``tag`` inside; a torch
    out-of-memory error gets our reason as a note."""
    torch = load_torch()
    previous = current_tag(index)
    use_tag(index, tag)
    try:
        yield
    except torch.OutOfMemoryError as e:
        why = last_error()
        if why and hasattr(e, "add_note"):
            e.add_note(f"gpu_pager: {why}")
        raise
    finally:
        use_tag(index, previous)


def tag_pools(key: Any) -> list[Any]:
    """The pools of ``key`` (``(tag, device)``) that may hold segments: its current pool, if
    any, and the retired ones."""
    with lock:
        current = [pools[key]] if key in pools else []
        return current + [r.pool for r in retired if r.key == key]


def retire_pool(pool: Any, device: Any = None) -> None:
    """Retires ``pool`` (a pool of torch's own allocator that a torch_memory_saver
    ``disable()`` block allocated in): what it holds unused goes back to the device now,
    and the rest as its tensors die, at a later ``torch.cuda.empty_cache()``. The pool
    object is kept to the end of the process (destroying one aborts torch in some
    states)."""
    index = device_index(device)
    with lock:
        retire(pool, None, index)
    give_back(index)


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
    torch = load_torch()
    with lock:
        if not _unused_later:
            atexit.register(_keep_unused_later)
        _unused_later.append(pool)
    torch.cuda.synchronize()
    with lock:
        done = [p for p in _unused_later if not any(used for _, used in segments(p))]
        _unused_later[:] = [p for p in _unused_later if p not in done]
    del done


def _keep_unused_later() -> None:
    for p in list(_unused_later):
        keep_forever(p)
