"""The core's C surface of this drop-in (``gpu_pager_tms_*`` in the extension module), for
the Python side's own calls: failures become gpu_pager's exceptions, with the core's message
(the preload library's ``tms_*`` functions, meant for C callers, print them instead)."""

from __future__ import annotations

import ctypes
import threading
from typing import Any

from gpu_pager import _native

_lock = threading.Lock()
_lib: Any = None


def lib() -> Any:
    """The extension module as a C library, with the signatures of the calls made here."""
    global _lib
    with _lock:
        if _lib is None:
            c = ctypes
            cdll = ctypes.CDLL(_native.__file__ or "")
            for name, args, res in [
                ("gpu_pager_tms_set_tag", [c.c_char_p], c.c_int),
                ("gpu_pager_tms_tag", [], c.c_char_p),
                ("gpu_pager_tms_pause", [c.c_char_p], c.c_int),
                ("gpu_pager_tms_resume", [c.c_char_p], c.c_int),
                ("gpu_pager_tms_set_disk_dir", [c.c_char_p], c.c_int),
                ("gpu_pager_tms_set_retain", [c.c_bool], None),
                ("gpu_pager_tms_retain", [], c.c_bool),
                ("gpu_pager_tms_set_margin", [c.c_uint64], None),
                ("gpu_pager_tms_backup_pointer", [c.c_uint64, c.c_uint64], c.c_void_p),
            ]:
                fn = getattr(cdll, name)
                fn.argtypes = args
                fn.restype = res
            _lib = cdll
        return _lib


def check(code: int, call: str) -> None:
    """Raises the gpu_pager exception of a failed call's code, with its message."""
    if code == 0:
        return
    names = dict(_native.error_codes())
    cls = getattr(_native, f"{names.get(code, 'InvalidArgument')}Error")
    message = _native._torch_hook_state(0)[1] or f"{call} failed with code {code}"
    raise cls(message)


def tag_arg(tag: str | None) -> bytes | None:
    """A tag for the C calls (``None``: every tag)."""
    return None if tag is None else tag.encode("utf-8")
