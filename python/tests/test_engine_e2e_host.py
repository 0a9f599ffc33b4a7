"""python/engines/e2e.py's verdicts across runs, on the host (the runs themselves need the
engines and a GPU): the drop-in passes only with stock's tokens, at least stock's freed memory,
at most stock's time per sleep and wake-up, and its weights' wake within 1.10x the link."""

from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType
from typing import Any

GIB = 1 << 30
HERE = os.path.dirname(os.path.abspath(__file__))


def e2e() -> ModuleType:
    path = os.path.join(HERE, "..", "engines", "e2e.py")
    spec = importlib.util.spec_from_file_location("engines_e2e", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["engines_e2e"] = module
    spec.loader.exec_module(module)
    return module


def run(tokens: Any, sleep_s: float, freed: int, wake_s: float) -> list[dict[str, Any]]:
    return [
        {"check": "weights-bytes", "kind": "info", "bytes": 4 * GIB, "ok": True},
        {"check": "reference", "tokens": tokens, "ok": True},
        {"check": "sleep(1)", "kind": "call", "seconds": sleep_s, "freed": freed, "ok": True},
        {"check": "wake weights", "kind": "call", "seconds": wake_s, "ok": True},
        {"check": "rl: reload_weights", "kind": "call", "seconds": 9.0, "ok": True},
    ]


def verdicts(ours: list[dict[str, Any]]) -> dict[str, bool]:
    stock = run([[1, 2]], 0.40, 30 * GIB, 0.20)
    rows = e2e().compare("vllm-0.24.0", {"stock": stock, "drop-in": ours}, {"h2d": 4 * GIB / 0.16})
    return {r["check"]: r["ok"] for r in rows}


def test_a_drop_in_as_good_as_stock_passes_every_check() -> None:
    got = verdicts(run([[1, 2]], 0.30, 30 * GIB, 0.17))
    assert got == {
        "tokens = stock's": True,
        "sleep(1): freed >= stock": True,
        "sleep(1): time <= stock": True,
        "wake weights: time <= stock": True,
        "wake weights <= 1.10x link": True,
    }


def test_other_tokens_less_memory_slower_calls_and_a_slow_link_fail() -> None:
    got = verdicts(run([[1, 3]], 0.50, 20 * GIB, 0.21))
    assert not got["tokens = stock's"]
    assert not got["sleep(1): freed >= stock"]
    assert not got["sleep(1): time <= stock"]
    assert not got["wake weights: time <= stock"]
    assert not got["wake weights <= 1.10x link"]  # 0.21 s for a 0.16 s link: 1.31x


def test_a_dead_engine_names_its_cuda_error() -> None:
    err = "INFO ...\nRuntimeError: CUDA error: an illegal memory access was encountered\nKilled\n"
    assert "illegal memory access" in e2e().cause(err)
