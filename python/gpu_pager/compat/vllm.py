"""A drop-in for vLLM's sleep-mode allocator (``vllm/device_allocator/``: the
``MemAllocator`` protocol, ``CuMemAllocator`` and the sleep-mode backends) on gpu_pager, for
the vLLM releases RL frameworks run: 0.24 (verl), 0.29 (OpenRLHF), 0.31 (TRL), 0.33 and 0.34.
Each release speaks its own sleep protocol (:mod:`gpu_pager.compat._vllm_releases`); the
drop-in answers each in that release's semantics and refuses a vLLM it does not know::

    from gpu_pager.compat.vllm import get_mem_allocator_instance

    allocator = get_mem_allocator_instance()
    with allocator.use_memory_pool(tag="weights"):
        model = load_model()
    with allocator.use_memory_pool(tag="kv_cache"):
        kv = allocate_kv_cache()
    with allocator.cudagraph_pool() as pool:  # graphs' memory sleeps too
        with torch.cuda.graph(graph, pool=pool):
            ...
    allocator.sleep(offload_tags=("weights",))  # level 1; level 2: offload_tags=()
    allocator.wake_up(tags=["weights"])
    update_weights(model)
    allocator.wake_up(tags=["kv_cache"])

To switch vLLM without editing it, install the wheel and set
``GPU_PAGER_DROP_IN=vllm`` (or ``all``): vLLM loads the ``vllm.general_plugins`` entry point
``gpu_pager`` (:func:`register`) in every process, which then puts this allocator behind
vLLM's ``get_mem_allocator_instance()`` (where ``VLLM_PLUGINS`` limits the plugins vLLM
loads, it must name ``gpu_pager``; every process says so on stderr otherwise). With that
switch, vLLM's own default backend drives this allocator; where the release has sleep-mode
backends (0.29 and later), the entry point also registers the ``gpu_pager`` backend
(``--sleep-mode-backend gpu_pager``), which needs the same switch, since the model's memory
must come from this allocator.

vLLM's semantics, kept: which tags keep their contents is chosen at each ``sleep`` (the
tags in ``offload_tags``, default ``("default",)``, and the ``KEPT_TAGS``; every other tag
is discarded and comes back zeroed); on vLLM 0.34, ``sleep(offload_tags, discardable)``
also leaves out of the backup the tensors at the ``discardable`` addresses (the parameters
the weight update rewrites: they come back undefined), and keeps every other byte of the
weights (preserved parameters, a drafter, buffers), block by block where vLLM copies whole
allocations; ``discard(tags)`` drops tags without a backup; a selective wake-up wakes the
named tags and, from vLLM 0.33 on, every tag that is not in ``DEFERRABLE_TAGS`` (``default``,
block tables, scratch, the graph pool); ``sleep`` and ``wake_up`` are idempotent; tags
already asleep keep how they went to sleep; waking or discarding a tag that has no
allocations moves nothing (a KV-only worker, or a wake-up before any weights exist); where
vLLM has tag hooks (``register_tag_hooks``, for a KV connector's transport registrations),
a tag's before-unmap hooks run before its memory is unmapped and its after-map hooks after
its memory is mapped back, as the pager's companions of the tag (``Pager.add_companion``).
vLLM 0.34's extensible KV cache lives outside the allocator (vLLM releases and recommits it
itself) and keeps working beside the drop-in.
Backups stay in pinned host memory across cycles, so a sleep of unchanged weights copies
nothing; with ``VLLM_SLEEP_MODE_RELEASE_HOST_MEMORY=1`` each wake-up gives that memory back
instead (:func:`release_host_memory`). Differences, on the safe side: a wake-up that runs
out of memory raises ``gpu_pager.OutOfMemoryError`` (a ``RuntimeError``, as vLLM's CUDA
errors are, and a ``MemoryError``), restores nothing and loses nothing, and a retry
succeeds; a second ``wake_up`` of an awake tag does nothing (vLLM 0.24 maps it again); a
hook that raises undoes the sleep or wake-up it ran in (the hooks that ran
are undone, every tag stays as it was) and surfaces as ``gpu_pager.CompanionError`` (a
``RuntimeError``) naming the hook's exception, where vLLM leaves the tag half moved; a
tag's after-map hooks run when the tag is mapped back, not again at wake-ups that find it
mapped already (vLLM reruns them, being idempotent, to retry a failed one: here a failed
one leaves its tag asleep, and the next wake-up retries it); an allocation under a
sleeping tag fails (``torch.OutOfMemoryError``, the
reason in ``gpu_pager.torch.last_error()``) instead of handing out memory that is not
mapped.
"""

from __future__ import annotations

import dataclasses
import gc
import importlib
import logging
import os
import threading
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Literal, NamedTuple

# The pool machinery the drop-in shares with gpu_pager.torch (it imports no torch).
from gpu_pager import _pools

__all__ = [
    "AllocationData",
    "DEFERRABLE_TAGS",
    "GRAPH_TAG",
    "GRAPH_TAGS",
    "KEPT_TAGS",
    "CuMemAllocator",
    "RELEASE_HOST_MEMORY_ENV",
    "get_mem_allocator_instance",
    "register",
    "release_host_memory",
]

logger = logging.getLogger(__name__)

DEFERRABLE_TAGS: tuple[str, ...] = ("weights", "kv_cache")
"""The tags a selective wake-up may leave asleep; any wake-up restores every other tag."""

GRAPH_TAG = "cuda_graph"
"""The tag of the memory of CUDA graphs captured in ``use_cudagraph_pool()``."""

GRAPH_TAGS: tuple[str, ...] = (GRAPH_TAG, "cudagraph")
"""The tags of graph memory: ours, and vLLM's own (``use_memory_pool("cudagraph")``, where
vLLM main captures its graphs). Their pools keep their free blocks (a replay may read state
kept there); every ``sleep`` keeps their contents."""

KEPT_TAGS: tuple[str, ...] = ("runtime", *GRAPH_TAGS)
"""The tags every ``sleep`` keeps, whatever ``offload_tags`` says: vLLM's runtime state
(block tables, request state), which survives both sleep levels, and the graphs' pools,
where kernels may keep state that they set at capture and read at every replay."""


RELEASE_HOST_MEMORY_ENV = "VLLM_SLEEP_MODE_RELEASE_HOST_MEMORY"
"""vLLM's switch to give the host memory of the backups back after each wake-up."""


def release_host_memory() -> bool:
    """Whether ``VLLM_SLEEP_MODE_RELEASE_HOST_MEMORY`` is on (``1``, ``true``, ``yes``).
    Read when a tag is first used: its backups then go to host memory that each wake-up
    gives back to the system (pinned again at the next sleep) instead of pinned memory
    kept across cycles, for hosts whose engines take turns on one GPU."""
    return os.environ.get(RELEASE_HOST_MEMORY_ENV, "").strip().lower() in ("1", "true", "yes")


@dataclasses.dataclass
class AllocationData:
    """One allocation (a torch segment) of a tag, as vLLM's allocator describes its own:
    ``handle`` is ``(device, bytes, address, 0)`` (gpu_pager keeps no driver handle per
    allocation)."""

    handle: tuple[int, int, int, int]
    tag: str
    cpu_backup_tensor: Any = None
    is_asleep: bool = False


class _TagHooks(NamedTuple):
    before_unmap: Callable[..., None]
    after_map: Callable[..., None]


_COMPANION = "vLLM tag hooks"
"""The name of the pager companion that runs a tag's vLLM hooks (in ``CompanionError``)."""


# Where vLLM keeps its sleep-mode allocator, newest layout first: vLLM's main branch moved
# ``vllm.device_allocator`` under ``vllm.backends.platform`` (shims stay at the old path for a
# while); releases have only the old path. The drop-in looks in both.
_VLLM_PACKAGES: tuple[str, ...] = (
    "vllm.backends.platform.device_allocator",
    "vllm.device_allocator",
)


def _vllm_modules(name: str = "") -> Iterator[Any]:
    """The modules ``<package><name>`` of the running vLLM, newest first, for each package
    of ``_VLLM_PACKAGES`` that it has (none without vLLM), imported as they are reached."""
    for package in _VLLM_PACKAGES:
        try:
            yield importlib.import_module(package + name)
        except ImportError:
            continue


def _vllm_module(name: str = "") -> Any:
    """The first of :func:`_vllm_modules`, or ``None``."""
    return next(_vllm_modules(name), None)


_FOUND: list[Any] = []
"""What :func:`_found` read, once read."""


def _found() -> Any:
    """What :func:`gpu_pager.compat._vllm_releases.detect` reads from the running vLLM (in
    the first of ``_VLLM_PACKAGES`` that it has), once per process."""
    if not _FOUND:
        from gpu_pager.compat import _vllm_releases

        allocators = _vllm_module()
        package = _VLLM_PACKAGES[-1] if allocators is None else allocators.__name__
        _FOUND.append(_vllm_releases.detect(package))
    return _FOUND[0]


def _protocol() -> Any:
    """The running vLLM's sleep protocol; the newest without a vLLM whose release is
    known (a stand-in, or this module used on its own)."""
    from gpu_pager.compat import _vllm_releases

    return _found().protocol or _vllm_releases.NEWEST


def _vllm_tag_hooks() -> _TagHooks | None:
    """vLLM's tag hooks where the running vLLM has them (``register_tag_hooks``: state that
    must live exactly as long as a tag's mapping, such as a KV connector's transport
    registration of the KV cache), else ``None``."""
    allocators = _vllm_module()
    before = getattr(allocators, "run_before_unmap_hooks", None)
    after = getattr(allocators, "run_after_map_hooks", None)
    if before is None or after is None:
        return None
    return _TagHooks(before, after)


def _gpt() -> Any:
    import gpu_pager.torch as gpt

    return gpt


class CuMemAllocator:
    """vLLM's ``CuMemAllocator`` on gpu_pager (see the module docs). One per process:
    ``CuMemAllocator.get_instance()``. Each tag is a growing ``PRESERVE`` region of the
    device's pager; whether its contents survive is chosen at each ``sleep``. Safe to call
    from several threads: sleeps, wake-ups and discards run one at a time."""

    instance: CuMemAllocator | None = None
    default_tag: str = "default"
    _instance_lock = threading.Lock()

    @staticmethod
    def get_instance() -> CuMemAllocator:
        """The process's allocator, created on first use."""
        with CuMemAllocator._instance_lock:
            if CuMemAllocator.instance is None:
                CuMemAllocator.instance = CuMemAllocator()
            return CuMemAllocator.instance

    def __init__(self) -> None:
        self.current_tag: str = CuMemAllocator.default_tag
        self.allocator_and_pools: dict[str, list[tuple[Any, Any]]] = {}
        """Each tag's torch pools and allocator, as vLLM (0.33 and later) keeps them: a
        list of ``(pool, allocator)`` per tag (``release_pools``)."""
        self._tags: list[str] = []
        self._device: int | None = None
        # Tags asleep, and whether their contents were kept (offloaded) when they fell asleep.
        self._kept: dict[str, bool] = {}
        # The byte ranges of discardable tensors left out of the last sleep's backup, as
        # (buffer, offset, length), unmarked once their tag is awake again.
        self._unsaved: list[tuple[Any, int, int]] = []
        # RL frameworks call the allocator from their own threads: one move at a time, so
        # that the books above follow the pager's state.
        self._lock = threading.RLock()

    def _ensure(self, tag: str) -> Any:
        """Makes tag ``tag``'s region and pool if they are new; returns the pool."""
        gpt = _gpt()
        with self._lock:
            if self._device is None:
                import torch

                self._device = int(torch.cuda.current_device())
            if tag in self._kept:
                raise RuntimeError(
                    f"tag {tag!r} is asleep: wake it up (wake_up([{tag!r}])) before allocating in it"
                )
            medium: Literal["host", "pinned"] = "host" if release_host_memory() else "pinned"
            _pools.ensure_region(gpt.pager(self._device), tag, "preserve", None, False, medium)
            self._add_tag(tag)
            pool = gpt.graph_pool(tag, self._device) if tag in GRAPH_TAGS else gpt.pool(tag, self._device)
            pools = self.allocator_and_pools.setdefault(tag, [])
            if all(p is not pool for p, _ in pools):
                pools.append((pool, gpt.allocator()))
            return pool

    @contextmanager
    def use_memory_pool(self, tag: str | None = None) -> Iterator[None]:
        """Tensors allocated inside come from tag ``tag``'s region (default ``"default"``).
        Memory freed inside the tag goes back to the device at the context's entry and exit
        (segments with nothing allocated in them), as in vLLM: the model built in bf16,
        quantized and the bf16 tensors freed holds only its live bytes after the context.
        The graph tags (``GRAPH_TAGS``) keep theirs."""
        tag = CuMemAllocator.default_tag if tag is None else tag
        self._ensure(tag)
        previous, self.current_tag = self.current_tag, tag
        try:
            with _gpt().use(tag, "preserve", device=self._device):
                yield
        finally:
            self.current_tag = previous

    @contextmanager
    def reuse_memory_pool(self, tag: str) -> Iterator[None]:
        """Enters the existing pool of ``tag`` again (``ValueError`` when there is none)."""
        if tag not in self._tags:
            raise ValueError(f"Memory pool for tag {tag!r} does not exist.")
        with self.use_memory_pool(tag):
            yield

    @contextmanager
    def use_cudagraph_pool(self) -> Iterator[tuple[int, int]]:
        """Yields the pool to capture CUDA graphs into (``torch.cuda.graph(g, pool=...)``):
        the graphs' memory lives in tag ``GRAPH_TAG``, which sleeps with the rest (its
        contents kept: ``KEPT_TAGS``) and wakes with any wake-up, at the same addresses, so
        the graphs replay without a capture."""
        with self._graph_pool(GRAPH_TAG) as pool:
            yield pool

    @contextmanager
    def cudagraph_pool(self) -> Iterator[tuple[int, int]]:
        """vLLM's own name (0.33 and later) for the graph pool, in vLLM's tag
        ``cudagraph``: as :meth:`use_cudagraph_pool`."""
        with self._graph_pool("cudagraph") as pool:
            yield pool

    @contextmanager
    def _graph_pool(self, tag: str) -> Iterator[tuple[int, int]]:
        pool = self._ensure(tag)
        assert self._device is not None  # set by _ensure
        # The capture itself routes the graph's allocations to the pool; this thread's
        # tag says which region they land in.
        with _pools.tagged(self._device, tag):
            yield pool.id

    def _pager(self) -> Any:
        return _gpt().pager(self._device)

    def _add_tag(self, tag: str) -> None:
        """Takes ``tag`` on (once): where the running vLLM has tag hooks, they become a
        companion of its region, run by every release and resume of the tag, whoever calls
        them. Where it has none (every release up to 0.34), the region gets no companion: a
        companion is Python, so the pager would wait mid-release for the GIL, which the
        garbage collection that a sleep runs beside the release holds to its end."""
        if tag in self._tags:
            return
        if _vllm_tag_hooks() is not None:
            self._pager().add_companion(tag, _COMPANION, self._before_unmap, self._after_map)
        self._tags.append(tag)

    def _before_unmap(self, tag: str) -> None:
        """vLLM's before-unmap hooks of ``tag``, still mapped (also when a failed wake-up
        unmaps it again), where vLLM has hooks."""
        hooks = _vllm_tag_hooks()
        if hooks is not None:
            hooks.before_unmap(self._mapped_only(tag), [tag])

    def _after_map(self, tag: str) -> None:
        """vLLM's after-map hooks of ``tag``, just mapped (also when a failed sleep maps it
        back), where vLLM has hooks: no other tag's hooks run again."""
        hooks = _vllm_tag_hooks()
        if hooks is not None:
            hooks.after_map(self._mapped_only(tag))

    def _mapped_only(self, tag: str) -> list[AllocationData]:
        """Records that say ``tag`` alone is mapped: what a companion call hands vLLM's
        hooks, whatever the allocator's own state says mid-move."""
        device = self._device or 0
        return [AllocationData((device, 0, 0, 0), t, is_asleep=t != tag) for t in self._tags]

    def sleep(
        self,
        offload_tags: tuple[str, ...] | str | None = None,
        discardable: Collection[int] = (),
    ) -> None:
        """Gives every tag's memory back: the tags in ``offload_tags`` (default
        ``("default",)``) and the ``KEPT_TAGS`` keep their contents, the others are
        discarded (zeroed when they wake). ``discardable`` (vLLM 0.34): the storage
        addresses of tensors the caller rewrites after the wake-up; those tensors of the
        ``weights`` tag are left out of the backup (undefined after the wake-up), every
        other byte of the tag is kept. Tags already asleep keep how they went to sleep.
        Idempotent."""
        with self._lock:
            self._sleep(offload_tags, discardable)

    def _sleep(self, offload_tags: tuple[str, ...] | str | None, discardable: Collection[int]) -> None:
        if offload_tags is None:
            offload_tags = (CuMemAllocator.default_tag,)
        elif isinstance(offload_tags, str):
            offload_tags = (offload_tags,)
        offload_tags = (*offload_tags, *KEPT_TAGS)
        awake = [t for t in self._tags if t not in self._kept]
        changed = [t for t in self._tags if t in self._kept and self._kept[t] != (t in offload_tags)]
        if changed:
            logger.warning(
                "gpu_pager vLLM allocator: sleep cannot change how %s went to sleep; kept it",
                changed,
            )
        if awake:
            drop = [t for t in awake if t not in offload_tags]
            kept_weights = "weights" in awake and "weights" not in drop
            unsaved = self._leave_out(discardable) if kept_weights else []
            try:
                # vLLM collects garbage after the unmap so that its empty_cache gives back
                # what dead tensors held outside the tags; a collection takes tens of
                # milliseconds in an engine's process, so it runs while the pager copies.
                self._unmap(awake, drop=drop, meanwhile=gc.collect)
            except BaseException:
                self._save_again(unsaved)
                raise
            self._unsaved += unsaved
            import torch

            torch.cuda.empty_cache()

    def _leave_out(self, discardable: Collection[int]) -> list[tuple[Any, int, int]]:
        """Marks the live blocks of tag ``weights`` that start at a ``discardable`` address
        as overwritten by the next update (``Pager.set_overwritten``): a release neither
        saves nor restores them. Returns the marked ranges."""
        if not discardable or self._device is None:
            return []
        wanted = {int(a) for a in discardable}
        p = self._pager()
        marked: list[tuple[Any, int, int]] = []
        try:
            for pool in _pools.tag_pools(("weights", self._device)):
                for seg in pool.snapshot(include_traces=False):
                    for block in seg["blocks"]:
                        address = int(block["address"])
                        if block["state"] == "inactive" or address not in wanted:
                            continue
                        found = p.buffer_containing(address)
                        if found is None:
                            continue
                        buf, offset = found
                        p.set_overwritten(buf, True, offset, int(block["size"]))
                        marked.append((buf, offset, int(block["size"])))
        except BaseException:
            self._save_again(marked)
            raise
        return marked

    def _save_again(self, marked: list[tuple[Any, int, int]]) -> None:
        """Clears the marks of :meth:`_leave_out` (buffers freed since are skipped)."""
        import gpu_pager

        p = self._pager()
        for buf, offset, n in marked:
            try:
                p.set_overwritten(buf, False, offset, n)
            except gpu_pager.PagerError:
                pass

    def discard(self, tags: Sequence[str] | str) -> None:
        """Gives the memory of ``tags`` back without keeping their contents (they come back
        zeroed when they wake), after the device's work. Tags already asleep are left as
        they are, and tags without allocations are ignored, as in vLLM."""
        names = (tags,) if isinstance(tags, str) else tuple(tags)
        with self._lock:
            awake = [t for t in self._tags if t in names and t not in self._kept]
            if awake:
                self._unmap(awake, drop=awake)

    def _unmap(self, tags: list[str], drop: list[str], meanwhile: Callable[[], object] | None = None) -> None:
        """Releases ``tags`` (those in ``drop`` without a backup), running ``meanwhile``
        alongside; the pager runs their vLLM hooks (the companions) and undoes them if the
        release fails."""
        _gpt().release(tags, self._device, drop=drop, meanwhile=meanwhile)
        for t in tags:
            self._kept[t] = t not in drop

    @property
    def pointer_to_data(self) -> dict[int, AllocationData]:
        """The allocations by address, as vLLM's allocator keeps them: one per segment torch
        holds in this allocator's tags, asleep or not. A snapshot (changing it changes
        nothing)."""
        if self._device is None:
            return {}
        out: dict[int, AllocationData] = {}
        for tag in self._tags:
            for pool in _pools.tag_pools((tag, self._device)):
                for seg in pool.snapshot(include_traces=False):
                    address, size = int(seg["address"]), int(seg["total_size"])
                    out[address] = AllocationData(
                        (self._device, size, address, 0), tag, is_asleep=tag in self._kept
                    )
        return out

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Maps the memory of ``tags`` back at the same addresses, with the contents of
        those that kept them (default: every tag); from vLLM 0.33 on, a selective wake-up
        also wakes every tag that is not in ``DEFERRABLE_TAGS``. All or nothing: out of
        memory raises ``gpu_pager.OutOfMemoryError`` (a ``RuntimeError``) and every tag
        stays asleep with its backup. Tags without allocations are ignored, as in vLLM. Idempotent."""
        with self._lock:
            asleep = [t for t in self._tags if t in self._kept]
            deferrable = DEFERRABLE_TAGS if _protocol().deferrable else asleep
            want = [t for t in asleep if tags is None or t in tags or t not in deferrable]
            if want:
                _gpt().resume(want, self._device)
                for t in want:
                    del self._kept[t]
                if "weights" in want:
                    unsaved, self._unsaved = self._unsaved, []
                    self._save_again(unsaved)

    def get_current_usage(self) -> int:
        """Bytes of the segments torch holds in this allocator's tags, asleep or not (as
        vLLM counts them)."""
        if not self._tags:
            return 0
        stats = self._pager().stats()
        return int(sum(r.allocated_bytes for r in stats.regions if r.tag in self._tags))

    def release_pools(self) -> None:
        """Drops this allocator's references to its pools (vLLM calls it before exit).
        gpu_pager keeps torch's allocator and pools alive to the end of the process, so
        their destruction can never call into a freed allocator (vLLM's "pure virtual
        method called" at exit). Safe to call more than once."""
        self.allocator_and_pools.clear()

    def close(self) -> None:
        """``release_pools()``."""
        self.release_pools()


def get_mem_allocator_instance() -> CuMemAllocator:
    """The process's sleep-mode allocator (vLLM's ``get_mem_allocator_instance``)."""
    return CuMemAllocator.get_instance()


def __getattr__(name: str) -> Any:
    # vLLM's backend registry imports the class by name when a backend is selected.
    if name == "GpuPagerBackend":
        from gpu_pager.compat._vllm_backend import GpuPagerBackend

        return GpuPagerBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def is_vllm_s_allocator() -> bool:
    """Whether vLLM's ``get_mem_allocator_instance()`` gives this allocator (the switch
    ``GPU_PAGER_DROP_IN=vllm`` took effect)."""
    return any(
        getattr(cumem, "CuMemAllocator", None) is CuMemAllocator for cumem in _vllm_modules(".cumem")
    )


def register() -> None:
    """vLLM's ``vllm.general_plugins`` entry point, run in every vLLM process. Registers the
    ``gpu_pager`` sleep-mode backend where vLLM has the registry; with ``GPU_PAGER_DROP_IN``
    naming ``vllm`` (or ``all``) it also puts this allocator behind vLLM's
    ``get_mem_allocator_instance()`` and ``cumem.CuMemAllocator`` (under
    ``vllm.device_allocator``, and ``vllm.backends.platform.device_allocator`` where a
    development branch of vLLM kept them), so that vLLM's default path uses it, also where
    a module bound ``get_mem_allocator_instance`` before this ran (vLLM's function looks the
    class up when called). A vLLM whose release or sleep protocol the drop-in does not know
    is refused (``RuntimeError`` naming the supported releases) and keeps its own
    allocator."""
    backends = _vllm_module(".sleep_mode_backend")
    if backends is not None:
        try:
            backends.SleepModeBackendFactory.register_backend(
                "gpu_pager", "gpu_pager.compat.vllm", "GpuPagerBackend"
            )
        except ValueError:
            pass  # registered already (a second call in this process)
    from gpu_pager._drop_in import wanted

    if not wanted("vllm"):
        return
    packages = list(_vllm_modules())
    if not packages:
        raise RuntimeError(
            "GPU_PAGER_DROP_IN asks for vLLM's allocator, but this vLLM has neither "
            f"{' nor '.join(_VLLM_PACKAGES)}: upgrade gpu_pager or unset GPU_PAGER_DROP_IN"
        )
    found = _found()
    if found.protocol is None:
        raise RuntimeError(
            f"GPU_PAGER_DROP_IN asks for vLLM's allocator, but {found.problem}: use one of "
            "those releases, or unset GPU_PAGER_DROP_IN to keep vLLM's own allocator"
        )
    for allocators in packages:
        setattr(allocators, "get_mem_allocator_instance", get_mem_allocator_instance)
    for cumem in _vllm_modules(".cumem"):
        setattr(cumem, "CuMemAllocator", CuMemAllocator)
    logger.info(
        "gpu_pager: vLLM %s's sleep-mode allocator is gpu_pager's (%s)",
        found.version,
        os.environ.get("GPU_PAGER_DROP_IN"),
    )
