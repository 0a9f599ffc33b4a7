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

import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from gpu_pager import _native
from gpu_pager._audit import DiscardedAllocation, OutsideSegment, TorchAudit, audit
from gpu_pager._native import Buffer, Lease, Pager, Policy, RegionInfo, Report
from gpu_pager._pools import (
    FREE_SYMBOL,
    MALLOC_SYMBOL,
    TORCH_FLOOR,
    USE_TAG_SYMBOL,
    allocator,
    check_torch_version,
    current_tag,
    empty_cache,
    graph_pool,
    last_error,
    library_path,
    pool,
    trim,
    use_tag,
)
from gpu_pager._pools import _tags
from gpu_pager._pools import device_index as _index
from gpu_pager._pools import ensure_region as _ensure_region
from gpu_pager._pools import expandable_segments_off as _expandable_segments_off
from gpu_pager._pools import give_back as _give_back
from gpu_pager._pools import load_torch as _torch
from gpu_pager._pools import pools as _pools
from gpu_pager._pools import tagged as _tagged

if TYPE_CHECKING:
    from gpu_pager._native import _PolicyName

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
