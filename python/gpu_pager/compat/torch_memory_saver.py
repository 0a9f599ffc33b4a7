"""A drop-in for torch_memory_saver 0.0.10 (``from torch_memory_saver import
torch_memory_saver``) on gpu_pager, for SGLang and the RL frameworks that drive it::

    from gpu_pager.compat.torch_memory_saver import torch_memory_saver

    with torch_memory_saver.region("weights", enable_cpu_backup=True):
        model = load_model()
    with torch_memory_saver.region("kv_cache"):
        kv = allocate_kv_cache()
    torch_memory_saver.pause("kv_cache")
    torch_memory_saver.pause("weights")
    torch_memory_saver.resume("weights")
    torch_memory_saver.resume("kv_cache")

Differences, all on the safe side:

- Everything goes through torch's pluggable allocator (``hook_mode`` "preload" and
  "torch" behave the same; ``configure_subprocess`` does nothing, no ``LD_PRELOAD``).
- Pausing or resuming twice does nothing (torch_memory_saver exits the process).
- ``pause`` and ``resume`` return gpu_pager's ``Report`` (bytes copied, time per step)
  instead of ``None``.
- Running out of memory on resume raises ``gpu_pager.OutOfMemoryError`` and loses nothing:
  the tags stay paused with their backups, and a later ``resume`` succeeds
  (torch_memory_saver exits the process).
- A tag used with and without CPU backup gets two regions (``tag`` and ``tag.preserve`` or
  ``tag.discard``).
- ``enable_cpu_backup=True`` is ``Policy.PRESERVE`` (the pinned backup is kept between
  cycles, as with ``retain_cpu_backup``), otherwise ``Policy.DISCARD`` (contents
  undefined after resume).
- ``cuda_graph`` works in both hook modes: the graph's memory comes from the tag's pool
  (a ``pool`` handle passed in is not used: graphs captured in one tag share the tag's
  pool, which is what a shared handle asks for).
- ``get_cpu_backup`` always returns a copy (``zero_copy`` is not honoured: a view of the
  backup could change under the caller at the next pause).
- Disk backup and ``memory_margin_bytes`` are not supported (``NotImplementedError``).

Region sizes: regions grow with torch's segments, memory mapped under live segments only.
``region_bytes[tag]`` (or ``GPU_PAGER_REGION_BYTES``, e.g. ``"8G"``, for every tag) set
before the first ``region(tag)`` makes a fixed region of that size instead.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import gpu_pager
from gpu_pager import Policy

__all__ = ["TorchMemorySaver", "torch_memory_saver", "configure_subprocess"]

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def _parse_bytes(text: str) -> int:
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = t[-1] if t and t[-1] in "KMGT" else ""
    return int(t[: len(t) - len(unit)]) * _UNITS[unit]


@contextmanager
def configure_subprocess() -> Iterator[None]:
    """Nothing to configure: gpu_pager needs no ``LD_PRELOAD``."""
    yield


class TorchMemorySaver:
    """torch_memory_saver's ``TorchMemorySaver`` on gpu_pager (see the module docs)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # (tag, cpu backup) -> region tag
        self._regions: dict[tuple[str, bool], str] = {}
        self._local = threading.local()
        self._hook_mode = "preload"
        self.region_bytes: dict[str, int] = {}
        """Sizes of fixed regions not yet created, by tag (default: growing regions)."""
        env = os.environ.get("GPU_PAGER_REGION_BYTES")
        self._default_bytes = _parse_bytes(env) if env else None
        self.retain_cpu_backup = True
        """Accepted for compatibility: gpu_pager keeps a region's pinned backup anyway."""

    @property
    def enabled(self) -> bool:
        """Always ``True`` (for compatibility)."""
        return True

    @property
    def hook_mode(self) -> str:
        """``"preload"`` or ``"torch"``; both use torch's pluggable allocator here."""
        return self._hook_mode

    @hook_mode.setter
    def hook_mode(self, mode: str) -> None:
        if mode not in ("preload", "torch"):
            raise ValueError(f"hook_mode must be 'preload' or 'torch', not {mode!r}")
        self._hook_mode = mode

    @property
    def memory_margin_bytes(self) -> int:
        """Not supported: gpu_pager does not refuse allocations for a margin."""
        raise NotImplementedError("Only setter is supported")

    @memory_margin_bytes.setter
    def memory_margin_bytes(self, value: int) -> None:
        raise NotImplementedError("gpu_pager does not keep a memory margin")

    def _region_tag(self, tag: str, backup: bool) -> tuple[str, Policy]:
        """The region that holds ``tag`` with or without CPU backup, and its policy."""
        policy = Policy.PRESERVE if backup else Policy.DISCARD
        with self._lock:
            name = self._regions.get((tag, backup))
            if name is None:
                other = self._regions.get((tag, not backup))
                name = tag if other is None else f"{tag}.{'preserve' if backup else 'discard'}"
                self._regions[(tag, backup)] = name
            return name, policy

    def _names(self, tag: str | None) -> list[str]:
        with self._lock:
            return sorted(n for (t, _), n in self._regions.items() if tag is None or t == tag)

    @contextmanager
    def region(
        self,
        tag: str = "default",
        enable_cpu_backup: bool = False,
        enable_disk_backup: bool = False,
        cpu_backup_backend: str | None = None,
    ) -> Iterator[None]:
        """Tensors allocated inside come from region ``tag`` (pausable)."""
        if enable_disk_backup:
            raise NotImplementedError("gpu_pager has no disk backup; use enable_cpu_backup")
        if cpu_backup_backend is not None and not enable_cpu_backup:
            raise ValueError("cpu_backup_backend needs enable_cpu_backup=True")
        if cpu_backup_backend not in (None, "pinned", "mmap"):
            raise ValueError(f"cpu_backup_backend must be 'pinned' or 'mmap', not {cpu_backup_backend!r}")
        import gpu_pager.torch as gpt

        name, policy = self._region_tag(tag, enable_cpu_backup)
        size = self.region_bytes.get(tag, self._default_bytes)
        depth = getattr(self._local, "depth", 0)
        self._local.depth = depth + 1
        try:
            with gpt.region(name, policy, bytes=size):
                yield
        finally:
            self._local.depth = depth

    @contextmanager
    def cuda_graph(
        self,
        cuda_graph: Any = None,
        pool: Any = None,
        stream: Any = None,
        capture_error_mode: str = "global",
        tag: str = "default",
        enable_cpu_backup: bool = False,
        cpu_backup_backend: str | None = None,
    ) -> Iterator[None]:
        """``torch.cuda.graph`` whose captured allocations come from region ``tag``, so that
        they can be paused (``pool`` is not used: see the module docs). Without a graph,
        the same as ``region``."""
        if cuda_graph is None:
            with self.region(tag, enable_cpu_backup, cpu_backup_backend=cpu_backup_backend):
                yield
            return
        import gpu_pager.torch as gpt

        name, policy = self._region_tag(tag, enable_cpu_backup)
        with gpt.graph(
            cuda_graph, name, policy, stream=stream, capture_error_mode=capture_error_mode
        ):
            yield

    @contextmanager
    def disable(self) -> Iterator[None]:
        """Allocations inside are ordinary torch memory (not pausable)."""
        if getattr(self._local, "depth", 0) == 0:
            raise AssertionError("disable() must be used inside region()")
        import gpu_pager.torch as gpt

        with gpt.disable():
            yield

    def pause(self, tag: str | None = None) -> gpu_pager.Report | None:
        """Releases region ``tag`` (``None``: every region); idempotent. Returns gpu_pager's
        ``Report`` of the release (what it copied and how long each step took), or ``None``
        when no region has that tag (torch_memory_saver returns ``None`` always)."""
        names = self._names(tag)
        if not names:
            return None
        import gpu_pager.torch as gpt

        return gpt.release(names)

    def resume(self, tag: str | None = None) -> gpu_pager.Report | None:
        """Resumes region ``tag`` (``None``: every region); idempotent. Raises
        ``gpu_pager.OutOfMemoryError`` (nothing lost) if the memory is not free yet. Returns
        the ``Report`` of the resume, or ``None`` as ``pause`` does."""
        names = self._names(tag)
        if not names:
            return None
        import gpu_pager.torch as gpt

        return gpt.resume(names)

    def get_cpu_backup(self, x: Any, zero_copy: bool = False) -> Any:
        """A CPU tensor with ``x``'s contents from its region's pinned backup while the
        region is paused, else ``None`` (as torch_memory_saver). Always a copy: with
        ``zero_copy=True`` torch_memory_saver hands out a view of its backup, which the
        next pause may overwrite under the caller; gpu_pager does not."""
        import gpu_pager.torch as gpt

        return gpt.read_backup(x)

    def set_disk_backup_dir(self, path: str) -> None:
        """Not supported: gpu_pager has no disk backup."""
        raise NotImplementedError("gpu_pager has no disk backup")

    def stats(self) -> gpu_pager.Stats:
        """gpu_pager's statistics of the current device's pager."""
        import gpu_pager.torch as gpt

        return gpt.pager().stats()


torch_memory_saver = TorchMemorySaver()
"""The process's instance, as ``torch_memory_saver.torch_memory_saver``."""
