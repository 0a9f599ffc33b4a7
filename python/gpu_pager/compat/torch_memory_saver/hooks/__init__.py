"""The two hook modes: "preload" (``mode_preload``: gpu-pager's preload library in front of
the CUDA runtime) and "torch" (``mode_torch``: torch's pluggable allocator)."""
