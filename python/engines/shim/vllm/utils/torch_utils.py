"""``vllm.utils.torch_utils.PIN_MEMORY``: pinned host memory is available on CUDA hosts."""

PIN_MEMORY = True
