"""vLLM's sleep-mode backend on gpu_pager's allocator, ``gpu_pager.compat.vllm.GpuPagerBackend``
(imported by vLLM's backend registry when ``--sleep-mode-backend gpu_pager`` is chosen; it
needs vLLM)."""

from __future__ import annotations

from typing import Any

from gpu_pager.compat.vllm import _vllm_module, get_mem_allocator_instance

# Found where vLLM keeps it (see ``_VLLM_PACKAGES``); only the registry imports this module,
# so the registry's module has it.
SleepModeBackend: Any = _vllm_module(".sleep_mode_backend").SleepModeBackend


class GpuPagerBackend(SleepModeBackend):  # type: ignore[misc,unused-ignore]
    """The ``gpu_pager`` sleep-mode backend: vLLM's sleep levels on gpu_pager's allocator
    (level 1 keeps the weights, level 2 only the allocator's ``KEPT_TAGS``)."""

    def suspend(self, level: int = 1) -> None:
        """vLLM's sleep: level 1 keeps the weights (``offload_tags=("weights",)``), level 2
        keeps nothing but the allocator's ``KEPT_TAGS``."""
        self._state = "SUSPENDED"
        get_mem_allocator_instance().sleep(offload_tags=("weights",) if level == 1 else ())

    def resume(self, tags: list[str] | None = None) -> None:
        """vLLM's wake-up of ``tags`` (default: all; see ``CuMemAllocator.wake_up``)."""
        self._state = "RESUMING"
        get_mem_allocator_instance().wake_up(tags)
        self._state = "RUNNING"

    def discard(self, tags: tuple[str, ...]) -> None:
        """Drops ``tags`` without a backup (vLLM's ``release_kv_cache_memory``)."""
        get_mem_allocator_instance().discard(tags)
        self._state = "SUSPENDED"

    @classmethod
    def preserves_communicators(cls) -> bool:
        """True: only memory moves; NCCL communicators stay as they are."""
        return True
