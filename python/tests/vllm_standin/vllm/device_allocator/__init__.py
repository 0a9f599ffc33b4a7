"""Stand-in for ``vllm.device_allocator``: the tags a wake-up may defer, the function that
names the process's sleep-mode allocator, and the tag hooks (callbacks around the unmapping
and the mapping of a tag's memory, for state that lives as long as the mapping)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Iterable
from typing import Any, Protocol

DEFERRABLE_TAGS: tuple[str, ...] = ("weights", "kv_cache")


@dataclasses.dataclass
class AllocationData:
    handle: tuple[int, int, int, int]
    tag: str
    cpu_backup_tensor: Any = None
    is_asleep: bool = False


class MemAllocator(Protocol):
    def sleep(
        self, offload_tags: "tuple[str, ...] | str | None" = None, discardable: Collection[int] = ()
    ) -> None: ...

    def discard(self, tags: "tuple[str, ...] | str") -> None: ...

    def wake_up(self, tags: "list[str] | None" = None) -> None: ...


_hooks: dict[str, list[tuple[Callable[[], None], Callable[[], None]]]] = {}


def register_tag_hooks(
    tag: str, before_unmap: Callable[[], None], after_map: Callable[[], None]
) -> Callable[[], None]:
    pair = (before_unmap, after_map)
    _hooks.setdefault(tag, []).append(pair)
    return lambda: _hooks[tag].remove(pair)


def run_before_unmap_hooks(
    allocations: Iterable[AllocationData], tags: Collection[str] | None = None
) -> None:
    """Each hooked tag in ``tags`` (all if None) that has memory mapped."""
    mapped = {a.tag for a in allocations if not a.is_asleep}
    for tag in sorted(mapped & _hooks.keys()):
        if tags is None or tag in tags:
            for before, _ in _hooks[tag]:
                before()


def run_after_map_hooks(allocations: Iterable[AllocationData]) -> None:
    """Each hooked tag none of whose memory is asleep."""
    asleep = {a.tag for a in allocations if a.is_asleep}
    for tag in sorted(_hooks.keys() - asleep):
        for _, after in _hooks[tag]:
            after()


def get_mem_allocator_instance() -> object:
    from vllm.device_allocator.cumem import CuMemAllocator

    return CuMemAllocator.get_instance()
