"""vLLM's sleep-mode backend on gpu_pager's allocator, ``gpu_pager.compat.vllm.GpuPagerBackend``
(imported by vLLM's backend registry when ``--sleep-mode-backend gpu_pager`` is chosen; it
needs vLLM 0.29 or later, and ``GPU_PAGER_DROP_IN=vllm`` so that the model's memory comes
from gpu_pager's allocator)."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from gpu_pager.compat.vllm import (
    _found,
    _protocol,
    _vllm_module,
    get_mem_allocator_instance,
    is_vllm_s_allocator,
)

# Found where vLLM keeps it (see ``_VLLM_PACKAGES``); only the registry imports this module,
# so the registry's module has it.
SleepModeBackend: Any = _vllm_module(".sleep_mode_backend").SleepModeBackend



class GpuPagerBackend(SleepModeBackend):  # type: ignore[misc,unused-ignore]
    """The ``gpu_pager`` sleep-mode backend: vLLM's sleep on gpu_pager's allocator, in the
    running release's protocol: ``suspend(level)`` up to vLLM 0.33 (level 1 keeps the
    weights, level 2 only the allocator's ``KEPT_TAGS``), ``suspend(discardable)`` on 0.34
    (the weights are kept but for the tensors at the ``discardable`` addresses).

    Created at vLLM's first sleep. Raises ``RuntimeError`` there when the running vLLM is
    not a release the drop-in knows, or when vLLM's allocator is not gpu_pager's (set
    ``GPU_PAGER_DROP_IN=vllm``): the model's memory would then live where this backend
    cannot free it."""

    def __init__(self) -> None:
        found = _found()
        if found.protocol is None:
            raise RuntimeError(f"--sleep-mode-backend gpu_pager: {found.problem}")
        if not is_vllm_s_allocator():
            raise RuntimeError(
                "--sleep-mode-backend gpu_pager needs gpu_pager's allocator behind vLLM's, so "
                "that the model's memory comes from it: set GPU_PAGER_DROP_IN=vllm in the "
                "engine's environment (or choose vLLM's own backend)"
            )
        super().__init__()

    def suspend(self, discardable: Any = (), *, level: int | None = None) -> None:
        """vLLM's sleep, as the running release calls it: ``suspend(level)`` (vLLM 0.29 to
        0.33: 1 or 2, positional or by name) or ``suspend(discardable)`` (vLLM 0.34: a
        collection of storage addresses). An argument of the other protocol's kind is a
        ``TypeError``: it would otherwise sleep at the wrong level."""
        allocator = get_mem_allocator_instance()
        if level is not None:
            discardable = level
        if _protocol().suspend == "discardable":
            if isinstance(discardable, int) or not isinstance(discardable, Collection):
                raise TypeError(
                    "gpu_pager's backend on vLLM 0.34 takes suspend(discardable), a "
                    f"collection of storage addresses, not {discardable!r}"
                )
            self._state = "SUSPENDED"
            allocator.sleep(("weights",), discardable)
            return
        level = 1 if discardable == () else discardable
        if isinstance(level, bool) or level not in (1, 2):
            raise TypeError(
                f"gpu_pager's backend on this vLLM takes suspend(level), 1 or 2, not {level!r}"
            )
        self._state = "SUSPENDED"
        allocator.sleep(("weights",) if level == 1 else ())

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
