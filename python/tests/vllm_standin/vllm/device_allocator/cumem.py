"""Stand-in for ``vllm.device_allocator.cumem``: an allocator that only says it is vLLM's."""


class CuMemAllocator:
    instance: "CuMemAllocator | None" = None

    @staticmethod
    def get_instance() -> "CuMemAllocator":
        if CuMemAllocator.instance is None:
            CuMemAllocator.instance = CuMemAllocator()
        return CuMemAllocator.instance
