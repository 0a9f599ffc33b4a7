"""The cost of poisoned discards: the resume of a discarded KV cache with
``poison_discards`` on fills it with the NaN pattern on the device. Reports the fill's
speed against the device's write bandwidth measured in the same run (torch's ``fill_`` of
an equal buffer), and the resume with and without the option.

    python poison.py              # 16 GiB of KV cache, 5 cycles
    python poison.py --gib 4 --cycles 3
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import gpu_pager

GIB = 1 << 30


def write_bandwidth(nbytes: int) -> float:
    """Bytes per second of torch's ``fill_`` over ``nbytes`` (best of 5)."""
    buf = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    best = float("inf")
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        buf.fill_(0x7F)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    del buf
    torch.cuda.empty_cache()
    return nbytes / best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=16.0, help="KV cache size (GiB)")
    ap.add_argument("--cycles", type=int, default=5)
    args = ap.parse_args()
    nbytes = int(args.gib * GIB)
    gpu_pager.configure(0, poison_discards=True)
    pager = gpu_pager.Pager.for_device(0)
    bandwidth = write_bandwidth(nbytes)
    print(f"{torch.cuda.get_device_name()}: device write bandwidth {bandwidth / 1e9:.0f} GB/s "
          f"(torch fill_ of {args.gib:g} GiB)")
    pager.region("kv", "discard", nbytes, kind="fixed")
    fills, resumes = [], []
    for _ in range(args.cycles):
        pager.release("kv")
        t = time.perf_counter()
        report = pager.resume("kv")
        resumes.append(time.perf_counter() - t)
        region = report.region("kv")
        assert region is not None
        fills.append(region.steps.fill)
    fill = statistics.median(fills)
    print(f"poison fill of {args.gib:g} GiB: median {fill * 1e3:.1f} ms "
          f"({nbytes / fill / 1e9:.0f} GB/s, {nbytes / fill / bandwidth:.2f} x the write "
          f"bandwidth); resume median {statistics.median(resumes) * 1e3:.1f} ms "
          f"(min {min(resumes) * 1e3:.1f})")


if __name__ == "__main__":
    main()
