"""The "preload" hook mode: gpu-pager's preload library (``libgpu_pager_preload.so``, in the
package beside the extension module) in ``LD_PRELOAD`` puts its ``cudaMalloc`` and
``cudaFree`` in front of the CUDA runtime's, so that allocations from any library of the
process (torch's allocator, NCCL, cuBLAS workspaces) can be routed to gpu_pager."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from gpu_pager.compat.torch_memory_saver.utils import change_env

PRELOAD_LIBRARY = "libgpu_pager_preload.so"
"""The preload library's file name."""


def preload_library_path() -> str:
    """The path of gpu-pager's preload library. Raises ``FileNotFoundError`` with the fix
    when this installation lacks it (the wheel ships it; a source tree gets it from
    ``cargo build -p gpu-pager-python``)."""
    from gpu_pager import _native

    here = os.path.dirname(os.path.abspath(_native.__file__ or ""))
    path = os.path.join(here, PRELOAD_LIBRARY)
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"gpu_pager's preload library is missing ({path}); reinstall the gpu_pager wheel, "
            "which ships it, or use torch_memory_saver.hook_mode = 'torch'"
        )
    return path


def is_preloaded() -> bool:
    """Whether this process runs with gpu-pager's preload library in ``LD_PRELOAD``."""
    entries = os.environ.get("LD_PRELOAD", "").replace(" ", ":").split(":")
    return any(os.path.basename(p) == PRELOAD_LIBRARY for p in entries if p)


@contextmanager
def configure_subprocess() -> Iterator[None]:
    """Inside, ``LD_PRELOAD`` names gpu-pager's preload library (in front of what it had),
    so that child processes started meanwhile can use ``hook_mode="preload"``."""
    path = preload_library_path()
    current = os.environ.get("LD_PRELOAD", "")
    with change_env("LD_PRELOAD", f"{path}:{current}" if current else path):
        yield
