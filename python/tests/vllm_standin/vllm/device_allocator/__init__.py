"""Stand-in for ``vllm.device_allocator``: the tags a wake-up may defer and the function
that names the process's sleep-mode allocator."""

DEFERRABLE_TAGS: tuple[str, ...] = ("weights", "kv_cache")


def get_mem_allocator_instance() -> object:
    from vllm.device_allocator.cumem import CuMemAllocator

    return CuMemAllocator.get_instance()
