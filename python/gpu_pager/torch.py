"""PyTorch integration: tensors allocated inside ``use(tag)`` live in the pager's region
``tag``, at addresses that survive release and resume (so CUDA graphs that captured them
stay valid).

::

    import torch
    import gpu_pager.torch as pager

    with pager.use("weights"):  # a growing PRESERVE region
        model = load_model()  # parameters and buffers come from region "weights"
    with pager.use("kv_cache", "discard"):
        kv = torch.empty(...)
    graph = torch.cuda.CUDAGraph()
    with pager.graph(graph, "cuda_graph"):  # the graph's own memory in a tag too
        out = model(static_input)

    pager.release(["kv_cache", "weights", "cuda_graph"])  # the trainer runs
    pager.resume("weights")  # weights back bit-exact, same addresses
    update_weights(model)
    pager.resume(["kv_cache", "cuda_graph"])
    graph.replay()

How: torch's ``CUDAPluggableAllocator`` is pointed at two C functions that the extension
module ``gpu_pager._native`` exports (``gpu_pager_torch_malloc``/``gpu_pager_torch_free``;
the whole C ABI lives in that module, so torch, Python and C share one pager per device),
inside one ``torch.cuda.MemPool`` per (tag, device). torch's caching allocator still caches
and splits blocks in the segments it gets from us, and never frees a segment of a pool that
is in use, not even at ``torch.cuda.empty_cache()``. So memory freed inside a tag goes back
this way: when a tag's pool holds a segment with nothing allocated in it, at the entry and
exit of ``use(tag)`` and before ``release``, the pool is retired (torch may then free its
unused segments, and frees the others as their tensors die, at any ``empty_cache``) and the
tag's next allocations start a new pool. The model built in bf16 inside ``use("weights")``,
quantized and its bf16 tensors freed, then holds only its live bytes, and a release copies
only those. Pools that CUDA graphs were captured into (``graph``) are the exception: their
free blocks may hold state a replay reads, so they are kept. ``empty_cache(tag)`` retires a
tag's pool whatever it holds.

Without ``bytes`` a region grows with torch's segments (multiples of 2 MiB): memory is
mapped under live segments only, and freed segments give their memory back at once. With
``bytes`` it is a fixed region that must hold every segment.

**Raw access to a released tag.** torch kernels use raw device addresses; the pager
cannot intercept them. A kernel (or a graph replay) that touches a tensor of a released
tag reads or writes unmapped memory: CUDA reports ``an illegal memory access`` and the
CUDA context is unusable afterwards, exactly as with torch_memory_saver or vLLM's sleep
mode. gpu_pager's protections are the pager-mediated paths: ``read``/``write`` (and
``Pager.read``/``Pager.write``) raise ``NotResidentError``, and ``lease(tags)`` keeps
tags resident while kernels that use them may run (a release then raises ``BusyError``).

**Registrations of the memory.** A resume maps new physical memory at the same addresses:
whatever registered the old pages with a NIC or a library (an RDMA memory region, NCCL's
registration of buffers in captured graphs, a KV connector's transport) goes stale.
Re-register after the resume (vLLM's tag hooks do so through the vLLM drop-in); with NCCL
under captured graphs, set ``NCCL_GRAPH_REGISTER=0``.

**Never remove a region torch still has segments in** (``Pager.remove``): torch indexes
its blocks by address, and a removed region's addresses can be handed to a new region.
Let the tensors die and call ``empty_cache(tag)`` first (``stats`` then shows no buffers).

torch is imported on first use, so that this module imports without it. It must be torch
2.8 or newer (``TORCH_FLOOR``); the first call that needs torch raises ``ImportError`` on an
older one.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from gpu_pager import _native
from gpu_pager._native import Audit, Buffer, Lease, Pager, Policy, RegionInfo, Report

if TYPE_CHECKING:
    from gpu_pager._native import _MediumName, _PolicyName

__all__ = [
    "TORCH_FLOOR",
    "check_torch_version",
    "MALLOC_SYMBOL",
    "FREE_SYMBOL",
    "USE_TAG_SYMBOL",
    "library_path",
    "use_tag",
    "current_tag",
    "last_error",
    "allocator",
    "pool",
    "empty_cache",
    "graph_pool",
    "trim",
    "pager",
    "use",
    "region",
    "disable",
    "graph",
    "release",
    "resume",
    "lease",
    "locate",
    "read",
    "write",
    "mark_overwritten",
    "mark_parameters",
    "read_backup",
    "audit",
    "TorchAudit",
    "OutsideSegment",
    "DiscardedAllocation",
]

MALLOC_SYMBOL = "gpu_pager_torch_malloc"
"""The alloc function torch's pluggable allocator calls: ``void* (size_t, int, cudaStream_t)``."""
FREE_SYMBOL = "gpu_pager_torch_free"
"""The free function: ``void (void*, size_t, int, cudaStream_t)``."""
USE_TAG_SYMBOL = "gpu_pager_use_tag"
"""Sets the calling thread's tag for new segments: ``int (int device, const char* tag)``."""

_lock = threading.Lock()
_allocator: Any = None
# One pool per (tag, device) (a pool bound to one device silently bypasses the allocator on
# another), until it is retired (see the module docs).
_pools: dict[tuple[str, int], Any] = {}


@dataclasses.dataclass
class _Retired:
    """A pool that was retired, while segments may remain in it. torch aborts when a pool
    object is destroyed in some states (while any thread allocates to a pool, or after its
    use count was given back), so no pool object is ever destroyed: each is kept to the end
    of the process (_keep_forever) and only its memory goes back."""

    key: Any
    index: int
    pool: Any
    # Its unused bytes after the last give-back (what torch could not free then: a context
    # or a graph still held the pool); a give-back is due again only when this grows.
    unused: int = 0
    # The free room of its segments that tensors still hold part of, after the last
    # give-back: mapped, and never used again, since nothing allocates to a retired pool.
    stranded: int = 0


_old: list[_Retired] = []
# Keys of pools that CUDA graphs were captured into: never retired by trim.
_graphs: set[Any] = set()


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


def _torch() -> Any:
    """torch, imported on first use and checked against ``TORCH_FLOOR`` once."""
    global _torch_checked
    import torch

    if not _torch_checked:
        check_torch_version(str(torch.__version__))
        _torch_checked = True
    return torch


def _keep_forever(obj: Any) -> None:
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
    torch = _torch()
    with _lock:
        if _allocator is None:
            _allocator = torch.cuda.memory.CUDAPluggableAllocator(
                library_path(), MALLOC_SYMBOL, FREE_SYMBOL
            )
            _keep_forever(_allocator)
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
    created on first use and kept for the whole process. Its ``.id`` is what ``graph``
    captures into."""
    torch = _torch()
    index = _index(device)
    alloc = allocator()
    with _lock:
        p = _pools.get((tag, index))
        if p is None:
            with torch.cuda.device(index):  # a pool belongs to the device current at creation
                p = torch.cuda.MemPool(allocator=alloc.allocator())
            _keep_forever(p)
            _pools[(tag, index)] = p
        return p


def _segments(pool: Any) -> list[tuple[int, int]]:
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
    return sum(size for size, used in _segments(pool) if not used)


def _unused_and_stranded(pool: Any) -> tuple[int, int]:
    """The unused bytes of ``pool`` (``_unused_bytes``) and the free room of its segments
    that tensors hold part of: what retiring the pool would strand."""
    segments = _segments(pool)
    return (
        sum(size for size, used in segments if not used),
        sum(size - used for size, used in segments if used),
    )


def _retire(p: Any, key: Any, index: int) -> None:
    """Retires pool ``p`` (of ``key``, on device ``index``, already taken out of its pools,
    so that the key's next allocations start a new pool): gives back the reference the pool
    object holds on torch's pool, so that torch frees its unused segments at
    ``empty_cache`` once no thread allocates to it (a CUDA graph captured into it keeps it
    until the graph is reset). The object itself is kept to the end of the process."""
    torch = _torch()
    _keep_forever(p)
    torch._C._cuda_releasePool(index, p.id)
    _old.append(_Retired(key, index, p))


def _give_back(index: int) -> None:
    """Waits for the device's work, then lets torch free the unused segments of retired
    pools (and its own cache, as ``torch.cuda.empty_cache()`` does); forgets the retired
    pools that have no segment left, and notes what the others still hold unused."""
    torch = _torch()
    torch.cuda.synchronize(index)
    torch.cuda.empty_cache()
    with _lock:
        _old[:] = [r for r in _old if r.pool.snapshot(include_traces=False)]
        for r in _old:
            r.unused, r.stranded = _unused_and_stranded(r.pool)


def _capturing() -> bool:
    """Whether this thread's current stream is capturing a CUDA graph."""
    return bool(_torch().cuda.is_current_stream_capturing())


def _trim_pools(pools: dict[Any, Any], keys: Iterable[Any], index: int) -> int:
    """Retires each pool ``pools[key]`` of ``keys`` on device ``index`` that holds a segment
    with nothing allocated in it, except the pools of CUDA graphs, and lets torch free what
    retired pools no longer use. A retired pool's partly used segments keep their free
    room mapped until their tensors die, so a pool is retired only when it frees more than
    that room and the room its key's earlier retired pools still strand: a tag that keeps
    a tensor at each step and frees another maps a bounded excess, not a segment more per
    step. Returns the bytes given back (none while the stream captures a CUDA graph:
    nothing is trimmed then). ``trim`` calls this with this module's pools, the drop-ins
    (``gpu_pager.compat._pools``) with their own."""
    if _capturing():
        # Retiring and giving back synchronize the device, which a capture forbids; the
        # next call outside the capture trims.
        return 0
    found = 0
    with _lock:
        for key in [k for k in keys if k in pools and k not in _graphs]:
            unused, stranded = _unused_and_stranded(pools[key])
            earlier = sum(r.stranded for r in _old if r.key == key and r.index == index)
            if unused > stranded + earlier:
                found += unused
                _retire(pools.pop(key), key, index)
        # Tensors died in a retired pool since the last give-back.
        grown = any(r.index == index and _unused_bytes(r.pool) > r.unused for r in _old)
    if found or grown:
        _give_back(index)
    return found


def trim(tags: str | Iterable[str] | None = None, device: Any = None) -> int:
    """Gives the device memory of segments with nothing allocated in them back from the
    pools of ``tags`` (default: every tag) on ``device``: what tensors freed inside the
    tags held. ``use`` and ``release`` do this by themselves; graph pools keep theirs.
    Returns the bytes given back."""
    index = _index(device)
    wanted = None if tags is None else set(_tags(tags))
    keys = [k for k in list(_pools) if k[1] == index and (wanted is None or k[0] in wanted)]
    return _trim_pools(_pools, keys, index)


def graph_pool(tag: str, device: Any = None) -> Any:
    """``pool(tag, device)``, marked as a pool CUDA graphs are captured into: ``trim``
    leaves it alone, since its free blocks may hold state that a replay reads."""
    p = pool(tag, device)
    _keep_for_graphs((tag, _index(device)))
    return p


def _keep_for_graphs(key: Any) -> None:
    """Marks the pool of ``key`` (in this module's pools or a drop-in's) as one that CUDA
    graphs are captured into: ``_trim_pools`` never retires it."""
    with _lock:
        _graphs.add(key)


def empty_cache(tags: str | Iterable[str] | None = None, device: Any = None) -> None:
    """Gives the torch segments of ``tags`` (default: every tag) on ``device`` back: retires
    the tags' pools, graph pools included (a new one starts at the next ``use``), and
    empties torch's cache. Unused segments go back now; those of tensors still alive, when
    they die and a later ``empty_cache`` (or ``use``, or ``release``) runs. A CUDA graph
    captured into a tag keeps the pool's memory while the graph lives."""
    index = _index(device)
    wanted = None if tags is None else set(_tags(tags))
    with _lock:
        for key in [k for k in _pools if k[1] == index and (wanted is None or k[0] in wanted)]:
            _graphs.discard(key)
            _retire(_pools.pop(key), key, index)
    _give_back(index)


_threads = threading.local()


@contextmanager
def _routing(index: int, pool_id: Any) -> Iterator[None]:
    """Records, for ``disable()``, that this thread's allocations on ``index`` go to
    ``pool_id`` inside."""
    stack: list[tuple[int, Any]] = _threads.__dict__.setdefault("pools", [])
    stack.append((index, pool_id))
    try:
        yield
    finally:
        stack.pop()


def _innermost_pool(index: int) -> Any:
    """The pool this thread's allocations on ``index`` go to now (``use``), or ``None``."""
    stack: list[tuple[int, Any]] = _threads.__dict__.get("pools", [])
    return next((p for i, p in reversed(stack) if i == index), None)


def pager(device: Any = None) -> Pager:
    """The pager of ``device`` (default: torch's current device)."""
    return Pager.for_device(_index(device))


def _ensure_region(
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
def _tagged(index: int, tag: str) -> Iterator[None]:
    """This thread's torch segments on device ``index`` come from ``tag`` inside; a torch
    out-of-memory error gets our reason as a note."""
    torch = _torch()
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


@contextmanager
def use(
    tag: str,
    policy: Policy | _PolicyName = "preserve",
    bytes: int | None = None,
    device: Any = None,
    prepin: bool = False,
) -> Iterator[RegionInfo]:
    """Tensors allocated by this thread inside the block on ``device`` (default: the current
    one) come from region ``tag``, created with ``policy`` (default ``"preserve"``) and
    ``bytes`` (default: growing) if it does not exist; entering an existing tag again
    takes it as it is. Nests: the previous tag is restored on exit. Yields the region's
    description. A segment that does not fit raises ``torch.OutOfMemoryError`` with our
    reason added as a note (and in ``last_error()``)."""
    torch = _torch()
    index = _index(device)
    info = _ensure_region(Pager.for_device(index), tag, policy, bytes, prepin)
    trim(tag, index)
    mem = pool(tag, index)
    try:
        with _expandable_segments_off(), torch.cuda.use_mem_pool(mem, device=index):
            with _tagged(index, tag), _routing(index, mem.id):
                yield info
    finally:
        if not trim(tag, index) and _pools.get((tag, index)) is not mem:
            # The pool was retired while this block allocated to it: torch can free its
            # unused segments only now.
            _give_back(index)


region = use
"""Another name of ``use`` (``region(tag, ...)`` as torch_memory_saver spells it)."""


@contextmanager
def disable(device: Any = None) -> Iterator[None]:
    """Tensors allocated by this thread inside the block on ``device`` are ordinary torch
    memory, outside every region, even inside ``use``: the tag's pool stops receiving this
    thread's allocations for the block, which go to torch's default pool, so that what is
    freed goes back to the device at ``torch.cuda.empty_cache()`` as any tensor's memory
    does; tensors may outlive the block."""
    torch = _torch()
    index = _index(device)
    previous = current_tag(index)
    outer = _innermost_pool(index)
    if outer is not None:
        # Stop routing this thread's allocations to the tag's pool, and take it up again
        # after the block. The reference use_mem_pool took stays held meanwhile: the pool
        # never becomes free to destroy under the block, and routing to it again never
        # revives a pool torch let go (either aborts the process).
        torch._C._cuda_endAllocateToPool(index, outer)
    use_tag(index, None)
    try:
        with _routing(index, None):  # a nested disable() finds no pool to stop routing to
            yield
    finally:
        if outer is not None:
            # Routing again takes a second reference: give one back.
            torch._C._cuda_beginAllocateCurrentThreadToPool(index, outer)
            torch._C._cuda_releasePool(index, outer)
        use_tag(index, previous)


@contextmanager
def graph(
    cuda_graph: Any,
    tag: str = "cuda_graph",
    policy: Policy | _PolicyName = "preserve",
    stream: Any = None,
    capture_error_mode: str = "global",
    device: Any = None,
) -> Iterator[Any]:
    """``torch.cuda.graph(cuda_graph, ...)`` whose memory (the tensors the captured work
    allocates) comes from region ``tag`` (growing, ``policy``), so that it can be released
    with the rest. The default ``"preserve"`` keeps its contents: kernels may keep state in
    the pool that they set at capture and read at every replay (workspace metadata,
    counters); ``"discard"`` saves the copy when the captured work rewrites all it reads.
    Graphs captured in one tag share its pool, as graphs passed one pool handle do. The
    captured addresses stay valid across release and resume: replay after resuming ``tag``
    and every tag the graph reads."""
    torch = _torch()
    index = _index(device)
    _ensure_region(Pager.for_device(index), tag, policy, None, False)
    mem = graph_pool(tag, index)
    with _expandable_segments_off(), _tagged(index, tag):
        with torch.cuda.graph(
            cuda_graph, pool=mem.id, stream=stream, capture_error_mode=capture_error_mode
        ) as g:
            yield g


def _tags(tags: str | Iterable[str]) -> list[str]:
    return [tags] if isinstance(tags, str) else list(tags)


def release(
    tags: str | Iterable[str],
    device: Any = None,
    drop: str | Iterable[str] | None = None,
    *,
    meanwhile: Callable[[], object] | None = None,
) -> Report:
    """Waits for torch's work on ``device`` and releases ``tags`` (see ``Pager.release``);
    those also in ``drop`` lose their contents for this cycle (they come back zeroed).
    Tensors in them keep their addresses; touching them with a kernel before ``resume``
    faults (see the module docs); ``read``/``write`` raise ``NotResidentError``.
    ``meanwhile``: Python work to run on a helper thread while the pager moves the memory,
    which it does without the GIL (a ``gc.collect()`` that need not come first costs no
    time then); the call returns once both are done."""
    torch = _torch()
    index = _index(device)
    trim(tags, index)
    torch.cuda.synchronize(index)
    pager, names = Pager.for_device(index), _tags(tags)
    dropped = None if drop is None else _tags(drop)
    if meanwhile is None:
        return pager.release(names, dropped)
    work = meanwhile
    go = threading.Event()

    def helper_work() -> None:
        # Waits for the signal given just before the pager's call, which lets the GIL go:
        # started at once, the work would hold the GIL that this thread still needs.
        go.wait()
        work()

    helper = threading.Thread(target=helper_work, name="gpu_pager meanwhile", daemon=True)
    helper.start()
    try:
        go.set()
        return pager.release(names, dropped)
    finally:
        helper.join()


def resume(tags: str | Iterable[str], device: Any = None) -> Report:
    """Resumes ``tags`` (see ``Pager.resume``); the contents of ``preserve`` regions are back
    when it returns. Raises ``OutOfMemoryError`` (nothing lost, tags stay released) when
    the device has not enough free memory yet."""
    return Pager.for_device(_index(device)).resume(_tags(tags))


def lease(tags: str | Iterable[str], device: Any = None) -> Lease:
    """Keeps ``tags`` resident while the returned lease is open (a context manager):
    releasing one of them raises ``BusyError`` meanwhile. Raises ``NotResidentError`` if
    one is released now. Hold one around kernels that use the tags' tensors."""
    return Pager.for_device(_index(device)).lease(_tags(tags))


def _find(tensor: Any) -> tuple[Pager, Buffer, int] | None:
    """The pager, buffer and offset in the buffer of ``tensor``'s first byte, or ``None``
    when the tensor is not in a region."""
    if not tensor.is_cuda:
        return None
    p = Pager.for_device(int(tensor.device.index))
    found = p.buffer_containing(int(tensor.data_ptr()))
    return None if found is None else (p, found[0], found[1])


def locate(tensor: Any) -> tuple[str, int] | None:
    """The tag of the region holding ``tensor``'s storage and its offset in the region, or
    ``None`` when the tensor is ordinary torch memory."""
    found = _find(tensor)
    if found is None:
        return None
    _, buf, offset = found
    return buf.tag, buf.offset + offset


def _held(tensor: Any) -> tuple[Pager, Buffer, int]:
    """``_find``, or a ``ValueError`` when the tensor is not in a region."""
    found = _find(tensor)
    if found is None:
        raise ValueError(
            "the tensor is not in a gpu_pager region (allocate it inside gpu_pager.torch.use())"
        )
    return found


def _span(tensor: Any) -> tuple[Pager, Buffer, int, int]:
    """The pager, buffer, offset in the buffer and length of ``tensor``'s bytes (a
    contiguous tensor in a region)."""
    if not tensor.is_contiguous():
        raise ValueError("the tensor is not contiguous; use its contiguous base")
    p, buf, offset = _held(tensor)
    return p, buf, offset, int(tensor.numel()) * int(tensor.element_size())


def write(tensor: Any, value: Any) -> None:
    """Copies ``value`` (a tensor or anything ``Tensor.copy_`` takes) into ``tensor``
    through the pager: the tensor's tag is leased for the copy, so a released tag raises
    ``NotResidentError`` instead of faulting, and no release can start until the copy has
    finished. Returns when the copy is done."""
    torch = _torch()
    p, buf, _ = _held(tensor)
    with p.lease([buf.tag]), torch.no_grad():  # parameters are leaves that require grad
        tensor.copy_(value)
        torch.cuda.current_stream(tensor.device).synchronize()


def read(tensor: Any) -> Any:
    """A CPU copy of ``tensor``, read through the pager (``NotResidentError`` if its tag is
    released)."""
    p, buf, _ = _held(tensor)
    with p.lease([buf.tag]):
        return tensor.detach().to("cpu")


def mark_overwritten(tensors: Any, on: bool = True) -> int:
    """Marks (``on=False``: unmarks) each tensor of ``tensors`` (a tensor or an iterable of
    them) as **overwritten by the next weight update**: a release of its tag neither copies
    it to the backup nor does the resume restore it (release and resume of a fully marked
    tag only unmap and map). After the resume its contents are undefined until the update
    writes it; tensors that are not marked (rotary caches, quantization scales) come back
    bit-exact. Marks stay until cleared; marking a tensor of a ``discard`` tag does nothing.
    Returns the bytes (un)marked. See ``Pager.set_overwritten``."""
    torch = _torch()
    items = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    total = 0
    for t in items:
        p, buf, offset, n = _span(t.detach())
        if n:
            p.set_overwritten(buf, on, offset, n)
        total += n
    return total


def mark_parameters(module: Any, on: bool = True) -> int:
    """``mark_overwritten(module.parameters(), on)``: every parameter of a model whose
    weights the trainer replaces after each resume; its buffers (``named_buffers``) stay
    unmarked and survive bit-exact. Returns the bytes (un)marked."""
    return mark_overwritten(list(module.parameters()), on)


def read_backup(tensor: Any) -> Any | None:
    """A CPU copy of ``tensor`` read from its tag's pinned host backup while the tag is
    released (what the next resume restores), or ``None`` when there is no such copy: the
    tag is resident, keeps no contents (``discard``), or the tensor was marked overwritten
    at the release."""
    torch = _torch()
    p, buf, offset, n = _span(tensor.detach())
    if p.info(buf.tag).state == _native.State.RESIDENT:
        return None
    try:
        raw = p.read_backup(buf, offset, n)
    except _native.InvalidArgumentError:
        return None
    out = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return out.view(tensor.dtype).reshape(tensor.shape)


@dataclasses.dataclass(frozen=True)
class OutsideSegment:
    """A segment torch holds outside every tag: device memory the pager's releases leave
    where it is."""

    address: int
    """Its first device address."""
    bytes: int
    """Its size."""
    pool: tuple[int, int]
    """torch's id of its pool (``(0, 0)``: the default pool)."""
    site: str | None
    """Where its first live block was allocated (``file:line in function``), when torch
    records memory history (``torch.cuda.memory._record_memory_history()``), else ``None``."""


@dataclasses.dataclass(frozen=True)
class DiscardedAllocation:
    """A live tensor allocation inside a ``discard`` tag: its contents are dropped at every
    release. Anything here that is not KV cache (metadata that outlives the step it was made
    for) comes back as garbage, or as NaN with poisoned discards."""

    tag: str
    """The discard tag."""
    bytes: int
    """The block's size."""
    site: str | None
    """Where it was allocated, when torch records memory history, else ``None``."""


@dataclasses.dataclass(frozen=True)
class TorchAudit:
    """Where a device's memory is, in a torch process (``audit()``): the pager's audit
    (each tag, the device's use) and torch's segments outside every tag, largest first.
    ``str()`` is a table."""

    pager: Audit
    """The pager's audit: each region, the device's totals."""
    outside_tags: list[OutsideSegment]
    """torch's segments outside every region, largest first."""
    discarded: list[DiscardedAllocation] = dataclasses.field(default_factory=list)
    """The live allocations inside ``discard`` tags, by tag, largest first: the place to look
    for state that must survive a sleep but was allocated under a discarded tag."""

    @property
    def torch_outside_bytes(self) -> int:
        """Bytes torch holds outside every tag."""
        return sum(s.bytes for s in self.outside_tags)

    @property
    def other_bytes(self) -> int:
        """Device memory in use outside the tags and outside torch: the CUDA context,
        libraries and other allocators of this process, and other processes."""
        return max(0, self.pager.outside_bytes - self.torch_outside_bytes)

    def __str__(self) -> str:
        gib = 1 << 30
        lines = [str(self.pager), f"torch outside every tag: {self.torch_outside_bytes / gib:.2f} GiB "
                 f"in {len(self.outside_tags)} segments"]
        for seg in self.outside_tags[:8]:
            where = seg.site or "site unknown (torch.cuda.memory._record_memory_history())"
            lines.append(f"  {seg.bytes / gib:8.2f} GiB at {seg.address:#x}, pool {seg.pool}: {where}")
        lines.append(f"the rest (CUDA context, other allocators and processes): "
                     f"{self.other_bytes / gib:.2f} GiB")
        mine = self.pager.this_process_bytes
        if mine is not None:
            own_rest = max(0, mine - self.pager.mapped_bytes - self.torch_outside_bytes)
            lines.append(f"  of it in this process (CUDA context, libraries, other "
                         f"allocators): {own_rest / gib:.2f} GiB")
        if self.discarded:
            lines.append(f"live allocations in discard tags (dropped at every release): "
                         f"{len(self.discarded)}")
            for a in self.discarded[:8]:
                lines.append(f"  {a.tag}: {a.bytes} bytes, {a.site or 'site unknown'}")
        return "\n".join(lines)


def _live_blocks(segment: dict[str, Any]) -> list[dict[str, Any]]:
    """The segment's blocks in use."""
    return [b for b in segment.get("blocks", []) if str(b.get("state", "")).startswith("active")]


def _is_caller_frame(filename: str) -> bool:
    """A Python frame of the caller's: a ``.py`` file outside torch, or code without a file
    (``<string>``, ``<stdin>``); not torch's own frames, nor the C++ frames torch records
    with them."""
    if "/torch/" in filename:
        return False
    return filename.endswith(".py") or (filename.startswith("<") and filename.endswith(">"))


def _block_site(block: dict[str, Any]) -> str | None:
    """The block's first allocation frame in the caller's Python code, if torch recorded
    it."""
    for frame in block.get("frames", []) or []:
        filename = str(frame.get("filename", ""))
        if _is_caller_frame(filename):
            return f"{filename}:{frame.get('line')} in {frame.get('name')}"
    return None


def _site(segment: dict[str, Any]) -> str | None:
    """Where the segment's first live block was allocated, if recorded."""
    for block in _live_blocks(segment):
        site = _block_site(block)
        if site is not None:
            return site
    return None


def _scan(index: int, p: Pager) -> tuple[list[OutsideSegment], list[DiscardedAllocation]]:
    """torch's segments on device ``index`` outside every region of ``p`` (largest first),
    and the live allocations inside its ``discard`` regions (by tag, largest first)."""
    torch = _torch()
    spans = [
        (r.info.base, r.info.base + r.info.size, r.info.tag, r.info.policy)
        for r in p.stats().regions
    ]
    outside: list[OutsideSegment] = []
    discarded: list[DiscardedAllocation] = []
    for seg in torch.cuda.memory_snapshot():
        if int(seg.get("device", index)) != index:
            continue
        address, size = int(seg["address"]), int(seg["total_size"])
        region = next((sp for sp in spans if sp[0] <= address < sp[1]), None)
        if region is None:
            pool = seg.get("segment_pool_id", (0, 0))
            outside.append(
                OutsideSegment(address, size, (int(pool[0]), int(pool[1])), _site(seg))
            )
        elif region[3] != Policy.PRESERVE:
            discarded.extend(
                DiscardedAllocation(region[2], int(b.get("size", 0)), _block_site(b))
                for b in _live_blocks(seg)
            )
    outside.sort(key=lambda s: (-s.bytes, s.address))
    discarded.sort(key=lambda a: (a.tag, -a.bytes))
    return outside, discarded


def audit(device: Any = None) -> TorchAudit:
    """Where ``device``'s memory is (default: torch's current device): each tag's mapped,
    reserved and backed-up bytes and state, torch's segments outside every tag (with the
    allocation site when torch records memory history), the rest the driver reports in use,
    and the live allocations inside ``discard`` tags. After a ``release``, what is still on
    the GPU and who holds it; before one, what a discard would lose."""
    index = _index(device)
    p = Pager.for_device(index)
    report = p.audit()
    outside, discarded = _scan(index, p)
    return TorchAudit(report, outside, discarded)


# The ``event`` field of the core's warning of memory still in use after a release.
_RESIDENT_EVENT = "resident_after_release"


class _NameTorchHolders(logging.Filter):
    """Adds torch's largest segments outside every tag, with their allocation sites, to the
    pager's warning that much memory stays in use after a release: the pager sees only the
    bytes outside its regions; in a torch process, torch knows who holds them."""

    def filter(self, record: logging.LogRecord) -> bool:
        fields = getattr(record, "gpu_pager", None)
        if not isinstance(fields, dict) or fields.get("event") != _RESIDENT_EVENT:
            return True
        if _torch_if_imported() is None:
            return True
        index = int(fields["device"])
        try:
            outside, _ = _scan(index, Pager.for_device(index))
        except Exception:  # naming the holders must never turn a warning into an error
            return True
        if outside:
            gib = 1 << 30
            largest = "; ".join(
                f"{s.bytes / gib:.2f} GiB at {s.site or 'an unrecorded site'}"
                for s in outside[:3]
            )
            record.msg = (
                f"{record.getMessage()}. torch holds "
                f"{sum(s.bytes for s in outside) / gib:.2f} GiB of it outside every tag, "
                f"the largest: {largest}"
            )
            record.args = ()
        return True


def _torch_if_imported() -> Any:
    """torch, if this process imported it (a warning never imports it)."""
    return sys.modules.get("torch")


logging.getLogger("gpu_pager").addFilter(_NameTorchHolders())
