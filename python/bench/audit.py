"""The cost of the residency audit at DESIGN.md's workload: 16 GiB of weights in 291 tensors
under a ``preserve`` tag and the KV cache under a ``discard`` tag (64 GiB, or what fits
beside the weights), through ``gpu_pager.torch``, plus one buffer outside every tag.
Times ``Pager.audit()`` (the regions and the driver's totals) and
``gpu_pager.torch.audit()`` (that, and torch's segments with their sites), with the tags
resident and released, without and with torch's memory history recorded.

    python audit.py               # 16 GiB of weights, the KV cache sized to the device
    python audit.py --calls 20
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import gpu_pager.torch as gpt
from side_by_side import weight_sizes

GIB = 1 << 30


def median_ms(f: Callable[[], Any], calls: int) -> tuple[float, float]:
    """Median and minimum milliseconds of ``calls`` calls of ``f`` (after one warm-up)."""
    f()
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3, min(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights-gib", type=float, default=16.0)
    ap.add_argument("--tensors", type=int, default=291)
    ap.add_argument("--kv-gib", type=float, default=None,
                    help="KV cache size (default: 64 GiB, or the free memory less the "
                         "weights and 8 GiB)")
    ap.add_argument("--calls", type=int, default=50)
    args = ap.parse_args()
    free = torch.cuda.mem_get_info()[0]
    kv_gib = args.kv_gib or min(64.0, (free / GIB - args.weights_gib - 8) // 1)
    with gpt.use("weights"):
        weights = [torch.empty(s, dtype=torch.uint8, device="cuda")
                   for s in weight_sizes(int(args.weights_gib * GIB), args.tensors)]
    with gpt.use("kv_cache", "discard"):
        kv = [torch.empty(int(kv_gib * GIB) // 32, dtype=torch.uint8, device="cuda")
              for _ in range(32)]
    outside = torch.empty(GIB, dtype=torch.uint8, device="cuda")
    pager = gpt.pager()
    print(f"{torch.cuda.get_device_name()}: {len(weights)} weight tensors "
          f"({args.weights_gib:g} GiB), {len(kv)} KV tensors ({kv_gib:g} GiB), "
          f"{outside.numel() / GIB:g} GiB outside every tag; {len(pager.stats().regions)} "
          f"regions, {len(torch.cuda.memory_snapshot())} torch segments")
    print("| audit | tags | memory history | ms per call (median) | min |")
    print("|---|---|---|---|---|")
    for history in (False, True):
        if history:
            torch.cuda.memory._record_memory_history(max_entries=100000)
        for state in ("resident", "released"):
            if state == "released":
                gpt.release(["weights", "kv_cache"])
            for name, f in (("Pager.audit()", pager.audit), ("gpu_pager.torch.audit()", gpt.audit)):
                if name == "Pager.audit()" and history:
                    continue  # the core's audit does not read torch's history
                med, low = median_ms(f, args.calls)
                print(f"| {name} | {state} | {'on' if history else 'off'} | {med:.2f} | {low:.2f} |")
            if state == "released":
                gpt.resume(["weights", "kv_cache"])
    print(gpt.audit())


if __name__ == "__main__":
    main()
