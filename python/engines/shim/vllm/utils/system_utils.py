"""``vllm.utils.system_utils.find_loaded_library``: the path of a shared library this process
has loaded (its name ``lib_name.so...``), from ``/proc/self/maps``."""

from __future__ import annotations


def find_loaded_library(lib_name: str) -> str | None:
    with open("/proc/self/maps") as f:
        for line in f:
            start = line.find("/")
            if start == -1:
                continue
            path = line[start:].strip()
            if path.rsplit("/", 1)[-1].startswith((f"{lib_name}.", f"{lib_name}-")):
                return path
    return None
