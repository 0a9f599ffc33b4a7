"""torch_memory_saver's test helpers (``torch_memory_saver.testing_utils``)."""

from __future__ import annotations

from typing import Any

from gpu_pager.compat.torch_memory_saver.utils import is_xpu

__all__ = ["is_xpu", "get_device", "empty_cache", "get_and_print_gpu_memory"]


def _torch() -> Any:
    import torch

    return torch


def get_device() -> str:
    """The device string tests allocate on: ``"cuda"``."""
    return "cuda"


def empty_cache() -> None:
    """``torch.cuda.empty_cache()``."""
    _torch().cuda.empty_cache()


def get_and_print_gpu_memory(message: str, gpu_id: int = 0) -> int:
    """The device memory in use on ``gpu_id`` (every process's, as the driver counts it),
    printed with ``message``."""
    used = int(_torch().cuda.device_memory_used(gpu_id))
    print(f"GPU {gpu_id} memory: {used / 1024**3:.2f} GB ({message})")
    return used
