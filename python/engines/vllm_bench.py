"""The vLLM drop-in against one vLLM release's own allocator (its ``cumem.py`` and
``cumem_allocator.abi3.so``), called as that release's worker and default backend call it,
in one process per release and allocator; the link's speed measured in the same process.
Prints one JSON line.

    python vllm_bench.py RELEASE_DIR stock|gpu_pager [--weights-gib 16] [--tensors 300]
                         [--kv-gib 16] [--cycles 2]
    python vllm_bench.py --all ENGINES_DIR [same options]   every vLLM release there, each
                         allocator in a process of its own, then a table (JSON rows in
                         $OUT/engines-bench.jsonl where OUT is set)

Rows: the first level-1 sleep (host backups made), then per cycle, with every weight changed
before it: level-1 sleep, wake-up of everything; a selective wake (weights, then the KV
cache); a level-2 sleep and its wake; the KV cache's discard and wake-up. Medians over the
cycles after the first.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import release as rel  # noqa: E402

GIB = 1 << 30


def timed(torch: Any, call: Any) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    call()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def link(torch: Any, nbytes: int = 2 * GIB) -> tuple[float, float]:
    """Bytes per second device to host and host to device, pinned, best of three."""
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    d2h = min(timed(torch, lambda: host.copy_(dev, non_blocking=True)) for _ in range(3))
    h2d = min(timed(torch, lambda: dev.copy_(host, non_blocking=True)) for _ in range(3))
    return nbytes / d2h, nbytes / h2d


ROWS = (
    ("first_sleep_s", "first sleep"),
    ("sleep_s", "sleep"),
    ("wake_s", "wake"),
    ("wake_weights_s", "wake weights"),
    ("wake_kv_s", "then KV"),
    ("sleep_level2_s", "level-2 sleep"),
    ("wake_level2_s", "its wake"),
    ("kv_discard_s", "KV discard"),
    ("kv_wake_s", "KV wake"),
)


def every(engines: str, options: list[str]) -> None:
    """Runs each vLLM release of ``engines`` with each allocator; prints the table."""
    import subprocess

    results = []
    for d in sorted(os.listdir(engines), key=lambda d: rel.version_numbers(os.path.join(engines, d)) if d.startswith("vllm-") else ()):
        if not d.startswith("vllm-"):
            continue
        for impl in ("stock", "gpu_pager"):
            print(f"vllm_bench: {d} {impl} ...", file=sys.stderr, flush=True)
            done = subprocess.run([sys.executable, __file__, os.path.join(engines, d), impl, *options],
                                  capture_output=True, text=True, timeout=300)
            lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
            if done.returncode != 0 or not lines:
                sys.stderr.write(done.stderr[-3000:])
                results.append({"release": d, "impl": impl, "error": done.stderr.strip().splitlines()[-1:]})
                continue
            results.append(json.loads(lines[-1]))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "engines-bench.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in results)
    ok = [r for r in results if "error" not in r]
    if ok:
        r0 = ok[0]
        print(f"{r0['device']}; {r0['weights_bytes'] / GIB:.1f} GiB of weights in {r0['tensors']} tensors, "
              f"changed every cycle; KV {r0['kv_bytes'] / GIB:.0f} GiB; ms (median of the cycles)")
    print("| release | allocator | link D2H/H2D GB/s | " + " | ".join(n for _, n in ROWS) + " | sleep / link | wake / link |")
    print("|---|---|---|" + "---|" * (len(ROWS) + 2))
    for r in results:
        if "error" in r:
            print(f"| {r['release']} | {r['impl']} | error: {r['error']} |")
            continue
        cells = [f"{r[k] * 1e3:.1f}" if k in r else "-" for k, _ in ROWS]
        print(f"| {r['release']} | {r['impl']} | {r['link_d2h_gbs']:.1f}/{r['link_h2d_gbs']:.1f} | "
              + " | ".join(cells) + f" | {r['sleep_x_link']:.2f} | {r['wake_x_link']:.2f} |")
    if any("error" in r for r in results):
        raise SystemExit(1)


def main() -> None:
    if sys.argv[1:2] == ["--all"]:
        every(sys.argv[2], sys.argv[3:])
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("release")
    ap.add_argument("impl", choices=("stock", "gpu_pager"))
    ap.add_argument("--weights-gib", type=float, default=16)
    ap.add_argument("--tensors", type=int, default=300)
    ap.add_argument("--kv-gib", type=float, default=16)
    ap.add_argument("--cycles", type=int, default=2)
    args = ap.parse_args()
    if args.impl == "stock":
        os.environ.pop("GPU_PAGER_DROP_IN", None)
    else:
        os.environ["GPU_PAGER_DROP_IN"] = "vllm"
    import torch

    torch.zeros(1, device="cuda")
    rel.import_root(args.release, "vllm")
    from vllm.device_allocator import get_mem_allocator_instance
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    a = get_mem_allocator_instance()
    assert type(a).__module__.startswith("gpu_pager") == (args.impl == "gpu_pager"), type(a)
    v = rel.version_numbers(args.release)
    d2h, h2d = link(torch)

    each = int(args.weights_gib * GIB) // args.tensors // 2
    with a.use_memory_pool(tag="weights"):
        weights = [torch.randn(each, dtype=torch.bfloat16, device="cuda") for _ in range(args.tensors)]
    with a.use_memory_pool(tag="kv_cache"):
        kv = torch.empty(int(args.kv_gib * GIB), dtype=torch.uint8, device="cuda")
    nbytes = sum(w.numel() * 2 for w in weights)

    # As the release's worker and default backend call the allocator.
    if v >= (0, 34):
        level1 = lambda: a.sleep(("weights", "runtime", "cudagraph"), ())  # noqa: E731
        level2 = lambda: a.sleep(("weights", "runtime", "cudagraph"), {w.untyped_storage().data_ptr() for w in weights})  # noqa: E731
    elif v >= (0, 33):
        level1 = lambda: a.sleep(offload_tags=("weights", "runtime", "cudagraph"))  # noqa: E731
        level2 = lambda: a.sleep(offload_tags=("runtime", "cudagraph"))  # noqa: E731
    else:
        level1 = lambda: a.sleep(offload_tags=("weights",))  # noqa: E731
        level2 = lambda: a.sleep(offload_tags=())  # noqa: E731

    def change() -> None:
        with torch.no_grad():
            for w in weights:
                w.add_(1)

    rows: dict[str, list[float]] = {k: [] for k in (
        "sleep", "wake", "wake_weights", "wake_kv", "sleep_level2", "wake_level2", "kv_discard", "kv_wake")}
    change()
    first_sleep = timed(torch, level1)
    first_wake = timed(torch, lambda: a.wake_up(None))
    for _ in range(args.cycles):
        change()
        rows["sleep"].append(timed(torch, level1))
        rows["wake"].append(timed(torch, lambda: a.wake_up(None)))
        change()
        level1()
        rows["wake_weights"].append(timed(torch, lambda: a.wake_up(["weights"])))
        rows["wake_kv"].append(timed(torch, lambda: a.wake_up(["kv_cache"])))
        rows["sleep_level2"].append(timed(torch, level2))
        rows["wake_level2"].append(timed(torch, lambda: a.wake_up(None)))
        if hasattr(a, "discard"):
            rows["kv_discard"].append(timed(torch, lambda: a.discard(("kv_cache",))))
            rows["kv_wake"].append(timed(torch, lambda: a.wake_up(["kv_cache"])))
    out = {
        "release": os.path.basename(os.path.normpath(args.release)),
        "impl": args.impl,
        "device": torch.cuda.get_device_name(),
        "weights_bytes": nbytes,
        "tensors": args.tensors,
        "kv_bytes": kv.numel(),
        "link_d2h_gbs": d2h / 1e9,
        "link_h2d_gbs": h2d / 1e9,
        "first_sleep_s": first_sleep,
        "first_wake_s": first_wake,
        **{f"{k}_s": statistics.median(x) for k, x in rows.items() if x},
    }
    out["sleep_x_link"] = out["sleep_s"] / (nbytes / d2h)
    out["wake_x_link"] = out["wake_s"] / (nbytes / h2d)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
