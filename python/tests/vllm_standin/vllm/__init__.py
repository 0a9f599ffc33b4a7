"""A stand-in for the vllm package in gpu_pager's tests: just the module paths and names
that gpu_pager's vLLM drop-in reaches (vLLM itself does not install offline on the GPU
machine, nor without CUDA here). Not vLLM's code."""

__version__ = "0.34.0"
"""The release whose sleep protocol the stand-in speaks (tests rewrite it to try others)."""
