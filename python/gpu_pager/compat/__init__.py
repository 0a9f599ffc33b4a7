"""Drop-in replacements for the memory layers engines already call:
``gpu_pager.compat.torch_memory_saver`` (SGLang) and ``gpu_pager.compat.vllm`` (vLLM's
``CuMemAllocator``). Both need torch with CUDA at run time and import without it."""
