"""torch_memory_saver's view of its C library (``_impl._binary_wrapper.cdll``): here
gpu-pager's preload library, whose ``tms_*`` entry points forward to gpu-pager's core. Names
it does not export (``cudaHostGetFlags``, ...) come from the CUDA runtime the process has
loaded, as they would through torch_memory_saver's library, which links that runtime."""

from __future__ import annotations

import ctypes
from typing import Any


def _cuda_runtime() -> ctypes.CDLL | None:
    """The CUDA runtime already loaded in the process (torch's), else one by its soname."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                if "libcudart.so" in path:
                    return ctypes.CDLL(path)
    except OSError:
        pass
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


class _Library:
    """A ``ctypes.CDLL`` that falls back to the CUDA runtime for names it lacks."""

    def __init__(self, path: str) -> None:
        self._lib = ctypes.CDLL(path)
        self._runtime: ctypes.CDLL | None = None
        self._path = path

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            fn = getattr(self._lib, name)
        except AttributeError:
            if self._runtime is None:
                self._runtime = _cuda_runtime()
            if self._runtime is None:
                raise AttributeError(f"{name}: not in {self._path}, and no CUDA runtime") from None
            fn = getattr(self._runtime, name)
        # Cached, so that argtypes and restype set on it stay.
        setattr(self, name, fn)
        return fn


class BinaryWrapper:
    """The C library and torch_memory_saver's per-thread config setter."""

    def __init__(self, path_binary: str) -> None:
        self.cdll: Any = _Library(path_binary)
        _setup_function_signatures(self.cdll)

    def set_config(
        self,
        *,
        tag: str,
        interesting_region: bool,
        enable_cpu_backup: bool,
        cpu_backup_backend: str | None = None,
        enable_disk_backup: bool = False,
    ) -> None:
        """Sets this thread's config (what its allocations are routed to)."""
        self.cdll.tms_set_current_tag(tag.encode("utf-8"))
        self.cdll.tms_set_interesting_region(interesting_region)
        self.cdll.tms_set_enable_cpu_backup(enable_cpu_backup)
        if cpu_backup_backend is not None:
            self.cdll.tms_set_cpu_backup_backend(cpu_backup_backend.encode("utf-8"))
        self.cdll.tms_set_enable_disk_backup(enable_disk_backup)


def _setup_function_signatures(cdll: Any) -> None:
    c = ctypes
    for name, args, res in [
        ("tms_set_current_tag", [c.c_char_p], None),
        ("tms_get_current_tag", [], c.c_char_p),
        ("tms_set_interesting_region", [c.c_bool], None),
        ("tms_get_interesting_region", [], c.c_bool),
        ("tms_set_enable_cpu_backup", [c.c_bool], None),
        ("tms_get_enable_cpu_backup", [], c.c_bool),
        ("tms_set_cpu_backup_backend", [c.c_char_p], None),
        ("tms_get_cpu_backup_backend", [], c.c_char_p),
        ("tms_set_enable_disk_backup", [c.c_bool], None),
        ("tms_get_enable_disk_backup", [], c.c_bool),
        ("tms_set_disk_backup_dir", [c.c_char_p], None),
        ("tms_pause", [c.c_char_p], c.c_int),
        ("tms_resume", [c.c_char_p], c.c_int),
        ("set_memory_margin_bytes", [c.c_uint64], None),
        ("tms_set_retain_cpu_backup", [c.c_bool], None),
        ("tms_get_retain_cpu_backup", [], c.c_bool),
        ("tms_get_cpu_backup_pointer", [c.POINTER(c.c_uint8), c.c_uint64], c.POINTER(c.c_uint8)),
    ]:
        fn = getattr(cdll, name)
        fn.argtypes = args
        fn.restype = res
