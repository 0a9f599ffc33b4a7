"""A drop-in for vLLM's ``CuMemAllocator`` (``vllm/device_allocator/cumem.py``) on
gpu_pager::

    from gpu_pager.compat.vllm import CuMemAllocator

    allocator = CuMemAllocator.get_instance()
    with allocator.use_memory_pool(tag="weights"):
        model = load_model()
    with allocator.use_memory_pool(tag="kv_cache"):
        kv = allocate_kv_cache()
    allocator.sleep(offload_tags=("weights",))  # level 1
    allocator.wake_up(tags=["weights"])  # update the weights, then
    allocator.wake_up(tags=["kv_cache"])

A tag's policy is fixed when its region is created: ``policies[tag]`` (default
``Policy.PRESERVE`` for ``"weights"``, ``Policy.DISCARD`` for every other tag). ``sleep``
backs up exactly the ``PRESERVE`` regions; naming a ``DISCARD`` region in
``offload_tags`` is a ``ValueError`` (create it as ``PRESERVE``), and a ``PRESERVE``
region left out of ``offload_tags`` is backed up anyway (its contents are then defined
where vLLM promises nothing). Sleeping or waking twice does nothing; a wake-up that runs
out of memory raises ``gpu_pager.OutOfMemoryError`` and leaves every tag asleep with its
backup.

Region sizes: regions grow with torch's segments; ``region_bytes[tag]`` set before the
first ``use_memory_pool(tag)`` makes a fixed region of that size instead.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from gpu_pager import Policy

__all__ = ["CuMemAllocator"]


class CuMemAllocator:
    """vLLM's ``CuMemAllocator`` on gpu_pager (see the module docs). One per process:
    ``CuMemAllocator.get_instance()``."""

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
        self.policies: dict[str, Policy] = {"weights": Policy.PRESERVE}
        """The policy of each tag's region, read when the region is created."""
        self.region_bytes: dict[str, int] = {}
        """Sizes of fixed regions not yet created, by tag (default: growing regions)."""
        self.current_tag: str = CuMemAllocator.default_tag
        self._tags: list[str] = []
        self._device: int | None = None

    def _policy(self, tag: str) -> Policy:
        return self.policies.get(tag, Policy.DISCARD)

    @contextmanager
    def use_memory_pool(self, tag: str | None = None) -> Iterator[None]:
        """Tensors allocated inside come from region ``tag`` (default ``"default"``)."""
        import torch

        import gpu_pager.torch as gpt

        tag = CuMemAllocator.default_tag if tag is None else tag
        device = int(torch.cuda.current_device())
        if self._device is None:
            self._device = device
        previous, self.current_tag = self.current_tag, tag
        try:
            with gpt.region(tag, self._policy(tag), bytes=self.region_bytes.get(tag)):
                if tag not in self._tags:
                    self._tags.append(tag)
                yield
        finally:
            self.current_tag = previous

    def _pager(self) -> Any:
        import gpu_pager.torch as gpt

        return gpt.pager(self._device)

    def sleep(self, offload_tags: tuple[str, ...] | str | None = None) -> None:
        """Releases every tag's region; those in ``offload_tags`` (default ``("default",)``)
        keep their contents (they must be ``PRESERVE`` regions)."""
        if offload_tags is None:
            offload_tags = (CuMemAllocator.default_tag,)
        elif isinstance(offload_tags, str):
            offload_tags = (offload_tags,)
        for tag in offload_tags:
            if tag in self._tags and self._policy(tag) != Policy.PRESERVE:
                raise ValueError(
                    f"tag {tag!r} is a {self._policy(tag).value} region, so sleep cannot "
                    f"offload it; set policies[{tag!r}] = Policy.PRESERVE before creating it"
                )
        if self._tags:
            import gpu_pager.torch as gpt

            gpt.release(self._tags, self._device)
        gc.collect()

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Resumes ``tags`` (default: all). All or nothing."""
        names = list(self._tags) if tags is None else [t for t in tags if t in self._tags]
        if names:
            import gpu_pager.torch as gpt

            gpt.resume(names, self._device)

    def get_current_usage(self) -> int:
        """Bytes of the segments torch holds in this allocator's regions, asleep or not (as
        vLLM counts them)."""
        if not self._tags:
            return 0
        stats = self._pager().stats()
        return sum(r.allocated_bytes for r in stats.regions if r.tag in self._tags)
