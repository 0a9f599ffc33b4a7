"""torch_memory_saver's helper module (``torch_memory_saver.utils``), for code and tests that
import from it."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

logger = logging.getLogger(__name__)


_xpu: bool | None = None


def is_xpu() -> bool:
    """Whether torch runs on Intel XPU (gpu_pager supports CUDA only)."""
    global _xpu
    if _xpu is None:
        try:
            import torch
        except ImportError:
            return False
        _xpu = hasattr(torch, "xpu") and bool(torch.xpu.is_available())
    return _xpu


def get_binary_path_from_package(stem: str) -> Path:
    """The shared library that plays torch_memory_saver's binary ``stem``: gpu-pager's
    preload library for the preload hook, the extension module for the torch hook."""
    if "preload" in stem:
        from gpu_pager.compat.torch_memory_saver.hooks.mode_preload import preload_library_path

        return Path(preload_library_path())
    from gpu_pager import _native

    return Path(_native.__file__ or "")


@contextmanager
def change_env(key: str, value: str) -> Iterator[None]:
    """Sets environment variable ``key`` to ``value`` inside; restores it (or its absence)."""
    old = os.environ.get(key)
    os.environ[key] = value
    logger.debug("change_env set %s=%s", key, value)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = old
        logger.debug("change_env restored %s=%s", key, old)
