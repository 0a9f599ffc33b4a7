"""What ``e2e_vllm.py`` and ``e2e_sglang.py`` share: the rows they print for ``e2e.py``, the
device's used memory, a timed call and the token comparison."""

from __future__ import annotations

import importlib
import json
import random
import time
from typing import Any, Callable

BATCH = 8
PROMPT = 48
TOKENS = 48
"""The reference batch: 8 prompts of 48 random token ids, 48 greedy tokens each."""


def prompts() -> list[list[int]]:
    """The reference batch's token ids (the same in every run)."""
    rng = random.Random(0)
    return [[rng.randrange(3, 32000) for _ in range(PROMPT)] for _ in range(BATCH)]


def emit(**row: Any) -> None:
    """One JSON row on stdout (``ok`` defaults to true)."""
    row.setdefault("ok", True)
    print(json.dumps(row), flush=True)


def used_bytes() -> int:
    """Device 0's used memory as NVML reports it (every process's)."""
    pynvml: Any = importlib.import_module("pynvml")
    pynvml.nvmlInit()
    try:
        return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).used)
    finally:
        pynvml.nvmlShutdown()


def call(name: str, fn: Callable[[], Any], sleep: bool = False) -> None:
    """Times ``fn()`` and emits a ``call`` row; with ``sleep``, the memory it freed too."""
    before = used_bytes() if sleep else 0
    t = time.perf_counter()
    fn()
    seconds = time.perf_counter() - t
    row: dict[str, Any] = {"check": name, "kind": "call", "seconds": seconds}
    if sleep:
        row["freed"] = before - used_bytes()
    emit(detail=f"{seconds * 1e3:.1f} ms", **row)


def same(cycle: str, got: list[list[int]], reference: list[list[int]]) -> None:
    """Emits whether ``got`` is ``reference``, token for token."""
    diff = sum(a != b for ra, rb in zip(got, reference) for a, b in zip(ra, rb))
    emit(check=f"{cycle}: tokens", ok=got == reference,
         detail="identical" if got == reference else f"{diff} of {BATCH * TOKENS} tokens differ")
