"""The vLLM drop-in against one vLLM release's own allocator (its ``cumem.py`` and
``cumem_allocator.abi3.so``), called as that release's worker and default backend call it,
in one process per release and allocator; the link's speed measured in the same process.
Prints one JSON line.

    python vllm_bench.py RELEASE_DIR stock|gpu_pager [--weights-gib 16] [--tensors 300]
                         [--kv-gib 16] [--cycles 2] [--idle 0.5]
    python vllm_bench.py --all ENGINES_DIR [--only vllm-0.34.0] [--skip-fp8] [same options]
                         every vLLM release there (or those named), each allocator in a
                         process of its own, then the tables (JSON rows in
                         $OUT/engines-bench.jsonl where OUT is set)
    ... --fp8            the fp8 rows instead of the others

Rows: the first level-1 sleep (host backups made), then per cycle, with every weight changed
before it: level-1 sleep, wake-up of everything; a selective wake (weights, then the KV
cache); a level-2 sleep and its wake; the KV cache's discard and wake-up. Medians over the
cycles after the first; on 0.34, with its own allocator, its extensible KV cache's
release and zeroed recommit too (where the KV cache lives on its defaults). Each wake
comes ``--idle`` seconds after its sleep, where an RL loop has its trainer's step: right
after a release of 32 GiB, the driver is still scrubbing the freed memory, and the next
allocations wait for it (about 30 ms of a back-to-back wake).
The fp8 rows (``--fp8``, back to back): bf16 weights quantized to fp8 inside the weights
pool and the bf16 freed, then level-1 sleeps and wakes of what is left.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
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


def _child(release: str, impl: str, options: list[str]) -> dict[str, Any]:
    """One release and allocator in a process of its own; its JSON line, or its error."""
    import subprocess

    name = os.path.basename(release)
    print(f"vllm_bench: {name} {impl} {' '.join(options)} ...", file=sys.stderr, flush=True)
    done = subprocess.run([sys.executable, __file__, release, impl, *options],
                          capture_output=True, text=True, timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        sys.stderr.write(done.stderr[-3000:])
        return {"release": name, "impl": impl, "error": done.stderr.strip().splitlines()[-1:]}
    return dict(json.loads(lines[-1]))


def _table(results: list[dict[str, Any]], rows: tuple[tuple[str, str], ...], ratios: tuple[str, str]) -> None:
    print("| release | allocator | link D2H/H2D GB/s | " + " | ".join(n for _, n in rows)
          + " | sleep / link | wake / link |")
    print("|---|---|---|" + "---|" * (len(rows) + 2))
    for r in results:
        if "error" in r:
            print(f"| {r['release']} | {r['impl']} | error: {r['error']} |")
            continue
        cells = [f"{r[k] * 1e3:.1f}" if k in r else "-" for k, _ in rows]
        print(f"| {r['release']} | {r['impl']} | {r['link_d2h_gbs']:.1f}/{r['link_h2d_gbs']:.1f} | "
              + " | ".join(cells) + f" | {r[ratios[0]]:.2f} | {r[ratios[1]]:.2f} |")


def every(engines: str, options: list[str]) -> None:
    """Runs each vLLM release of ``engines`` (or those named by ``--only NAME``, repeatable)
    with each allocator, the main rows and then the fp8 rows (``--skip-fp8``: not those);
    prints the tables and, for the drop-in, where its sleep's time goes."""
    only = [options[i + 1] for i, o in enumerate(options) if o == "--only"]
    skip_fp8 = "--skip-fp8" in options
    rest = [o for i, o in enumerate(options)
            if o not in ("--only", "--skip-fp8") and (i == 0 or options[i - 1] != "--only")]
    releases = sorted((d for d in os.listdir(engines) if d.startswith("vllm-") and (not only or d in only)),
                      key=lambda d: rel.version_numbers(os.path.join(engines, d)))
    results = [_child(os.path.join(engines, d), impl, rest) for d in releases for impl in ("stock", "gpu_pager")]
    fp8 = [] if skip_fp8 else [_child(os.path.join(engines, d), impl, [*rest, "--fp8"])
                               for d in releases for impl in ("stock", "gpu_pager")]
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "engines-bench.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in results + fp8)
    ok = [r for r in results if "error" not in r]
    if ok:
        r0 = ok[0]
        print(f"{r0['device']}; {r0['weights_bytes'] / GIB:.1f} GiB of weights in {r0['tensors']} tensors, "
              f"changed every cycle; KV {r0['kv_bytes'] / GIB:.0f} GiB; ms (median of the cycles)")
    _table(results, ROWS, ("sleep_x_link", "wake_x_link"))
    for r in ok:
        if "ext_kv_release_s" in r:
            ours = next((o for o in ok if o["release"] == r["release"] and o["impl"] == "gpu_pager"), {})
            print(f"{r['release']} extensible KV cache (vLLM's own, {r['kv_bytes'] / GIB:.0f} GiB): "
                  f"release_physical {r['ext_kv_release_s'] * 1e3:.1f} ms, recommit zeroed "
                  f"{r['ext_kv_recommit_s'] * 1e3:.1f} ms; the drop-in's KV discard "
                  f"{ours.get('kv_discard_s', float('nan')) * 1e3:.1f} ms, KV wake zeroed "
                  f"{ours.get('kv_wake_s', float('nan')) * 1e3:.1f} ms")
    for r in ok:
        for name in ("sleep", "wake", "wake_weights", "level2", "discard"):
            if f"{name}_parts_s" in r:
                parts = ", ".join(f"{k} {x * 1e3:.1f}" for k, x in r[f"{name}_parts_s"].items())
                print(f"{r['release']} drop-in {name}, ms: {parts}")
    if fp8:
        print("\nfp8 online quantization: bf16 built in the weights pool, quantized, the bf16 freed")
        _table(fp8, (("fp8_sleep_s", "sleep"), ("fp8_wake_s", "wake")), ("fp8_sleep_x_link", "fp8_wake_x_link"))
        for r in fp8:
            if "error" not in r:
                print(f"{r['release']} {r['impl']}: live {r['fp8_live_bytes'] / GIB:.2f} GiB, "
                      f"device holds {r['fp8_held_bytes'] / GIB:.2f} GiB after the context")
    if any("error" in r for r in results + fp8):
        raise SystemExit(1)


def _level1(a: Any, v: tuple[int, ...]) -> Any:
    """The release's level-1 sleep as its worker and default backend call the allocator."""
    if v >= (0, 34):
        return lambda: a.sleep(("weights", "runtime", "cudagraph"), ())
    if v >= (0, 33):
        return lambda: a.sleep(offload_tags=("weights", "runtime", "cudagraph"))
    return lambda: a.sleep(offload_tags=("weights",))


def fp8_run(torch: Any, a: Any, args: Any, v: tuple[int, ...], d2h: float, h2d: float) -> dict[str, Any]:
    """fp8 online quantization as vLLM does it: bf16 weights built inside
    ``use_memory_pool("weights")``, quantized to fp8 and the bf16 tensors freed inside the
    context; then level-1 sleeps and wakes with the fp8 bytes changed before each. The link
    is measured for the live (fp8) bytes; the fp8 bytes are checked bit-exact after every wake."""
    per = int(args.weights_gib * GIB) // args.tensors // 2
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # what the link's measure left in torch's cache
    free0 = torch.cuda.mem_get_info()[0]
    with a.use_memory_pool(tag="weights"):
        bf16 = [torch.randn(per, dtype=torch.bfloat16, device="cuda") for _ in range(args.tensors)]
        fp8 = [w.to(torch.float8_e4m3fn) for w in bf16]
        del bf16
    torch.cuda.synchronize()
    held = free0 - torch.cuda.mem_get_info()[0]
    live = sum(w.nbytes for w in fp8)
    level1 = _level1(a, v)
    sleeps: list[float] = []
    wakes: list[float] = []
    for cycle in range(args.cycles + 1):
        for w in fp8:
            w.view(torch.uint8).add_(1)
        expect = [w.view(torch.uint8).sum(dtype=torch.int64).item() for w in fp8]
        expect_first = fp8[0].view(torch.uint8).cpu()
        s = timed(torch, level1)
        w_ = timed(torch, lambda: a.wake_up(None))
        got = [w.view(torch.uint8).sum(dtype=torch.int64).item() for w in fp8]
        if got != expect or not torch.equal(fp8[0].view(torch.uint8).cpu(), expect_first):
            raise SystemExit(f"fp8 weights changed by the sleep of cycle {cycle}")
        if cycle:
            sleeps.append(s)
            wakes.append(w_)
    out = {
        "release": os.path.basename(os.path.normpath(args.release)),
        "impl": args.impl,
        "device": torch.cuda.get_device_name(),
        "fp8_live_bytes": live,
        "fp8_held_bytes": held,
        "link_d2h_gbs": d2h / 1e9,
        "link_h2d_gbs": h2d / 1e9,
        "fp8_sleep_s": statistics.median(sleeps),
        "fp8_wake_s": statistics.median(wakes),
    }
    out["fp8_sleep_x_link"] = out["fp8_sleep_s"] / (live / d2h)
    out["fp8_wake_x_link"] = out["fp8_wake_s"] / (live / h2d)
    return out


def _parts(torch: Any) -> dict[str, float]:
    """Wraps the calls the drop-in's sleep and wake are made of so that each one's seconds
    add up in the returned dict (cleared by the caller before the call it looks at): torch
    pool trims, the pager's release and resume and their steps, ``gc.collect`` and
    ``torch.cuda.empty_cache``."""
    import gc

    import gpu_pager.torch as gpt

    parts: dict[str, float] = {}

    def wrap(owner: Any, name: str, key: str) -> None:
        inner = getattr(owner, name)

        def timed_call(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                result = inner(*a, **k)
            finally:
                parts[key] = parts.get(key, 0.0) + time.perf_counter() - t
            if key in ("release", "resume") and result is not None:
                for region in result.regions:
                    steps = region.steps
                    for step in ("pin", "copy", "map", "unmap", "fill", "hash"):
                        parts[f"{key}.{step}"] = parts.get(f"{key}.{step}", 0.0) + getattr(steps, step)
                    own = "map" if key == "resume" else "unmap"
                    parts[f"{key}.{own}[{region.tag}]"] = getattr(steps, own)
                parts[f"{key}.sync"] = parts.get(f"{key}.sync", 0.0) + result.sync_seconds
                parts[f"{key}.pager"] = parts.get(f"{key}.pager", 0.0) + result.seconds
            return result

        setattr(owner, name, timed_call)

    wrap(gpt, "trim", "trim")
    wrap(gpt, "release", "release")
    wrap(gpt, "resume", "resume")
    from gpu_pager.compat import vllm as drop_in

    wrap(drop_in.CuMemAllocator, "_leave_out", "leave_out")
    wrap(drop_in.CuMemAllocator, "_save_again", "save_again")
    wrap(gc, "collect", "gc.collect")
    wrap(torch.cuda, "empty_cache", "empty_cache")
    return parts


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
    ap.add_argument("--fp8", action="store_true", help="the fp8 online-quantization rows instead")
    ap.add_argument("--idle", type=float, default=0.5,
                    help="seconds between each sleep and its wake (a trainer's step in an RL loop; 0: back to back)")
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

    if args.fp8:
        print(json.dumps(fp8_run(torch, a, args, v, d2h, h2d)), flush=True)
        return
    each = int(args.weights_gib * GIB) // args.tensors // 2
    with a.use_memory_pool(tag="weights"):
        weights = [torch.randn(each, dtype=torch.bfloat16, device="cuda") for _ in range(args.tensors)]
    with a.use_memory_pool(tag="kv_cache"):
        kv = torch.empty(int(args.kv_gib * GIB), dtype=torch.uint8, device="cuda")
    nbytes = sum(w.numel() * 2 for w in weights)

    # As the release's worker and default backend call the allocator.
    level1 = _level1(a, v)
    if v >= (0, 34):
        level2 = lambda: a.sleep(("weights", "runtime", "cudagraph"), {w.untyped_storage().data_ptr() for w in weights})  # noqa: E731
    elif v >= (0, 33):
        level2 = lambda: a.sleep(offload_tags=("runtime", "cudagraph"))  # noqa: E731
    else:
        level2 = lambda: a.sleep(offload_tags=())  # noqa: E731

    def change() -> None:
        with torch.no_grad():
            for w in weights:
                w.add_(1)

    rows: dict[str, list[float]] = {k: [] for k in (
        "sleep", "wake", "wake_weights", "wake_kv", "sleep_level2", "wake_level2", "kv_discard", "kv_wake")}
    parts = _parts(torch) if args.impl == "gpu_pager" else None
    breakdown: dict[str, dict[str, float]] = {}

    def observed(name: str, call: Callable[[], Any]) -> float:
        """``timed(call)``, keeping where the drop-in's time went (the last cycle's)."""
        if parts is not None:
            parts.clear()
        seconds = timed(torch, call)
        if parts is not None:
            breakdown[name] = dict(parts)
        return seconds

    def rest() -> None:
        time.sleep(args.idle)

    change()
    first_sleep = timed(torch, level1)
    rest()
    first_wake = timed(torch, lambda: a.wake_up(None))
    for _ in range(args.cycles):
        change()
        rows["sleep"].append(observed("sleep", level1))
        rest()
        rows["wake"].append(observed("wake", lambda: a.wake_up(None)))
        change()
        level1()
        rest()
        rows["wake_weights"].append(observed("wake_weights", lambda: a.wake_up(["weights"])))
        rows["wake_kv"].append(timed(torch, lambda: a.wake_up(["kv_cache"])))
        rows["sleep_level2"].append(observed("level2", level2))
        rest()
        rows["wake_level2"].append(timed(torch, lambda: a.wake_up(None)))
        if hasattr(a, "discard"):
            rows["kv_discard"].append(observed("discard", lambda: a.discard(("kv_cache",))))
            rest()
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
    for name, found in breakdown.items():
        out[f"{name}_parts_s"] = found
    out["sleep_x_link"] = out["sleep_s"] / (nbytes / d2h)
    out["wake_x_link"] = out["wake_s"] / (nbytes / h2d)
    if v >= (0, 34) and args.impl == "stock":
        out.update(extensible_rows(torch, int(args.kv_gib * GIB), args.cycles, rest))
    print(json.dumps(out), flush=True)


def extensible_rows(torch: Any, size: int, cycles: int, rest: Callable[[], None]) -> dict[str, float]:
    """vLLM 0.34's extensible KV cache of ``size`` bytes (its own ``ExtensibleTensor``, outside
    the allocator: where the KV cache lives on 0.34's defaults), as its worker's sleep and
    wake reach it: ``release_physical``, then the recommit that zero-fills; medians. What the
    drop-in's KV discard and zeroed KV wake are measured against."""
    from vllm.utils.extensible_tensor import ExtensibleTensor

    tensor = ExtensibleTensor(size)
    tensor.resize_per_segment_(size, zero_new=True)
    released, recommitted = [], []
    for _ in range(cycles):
        released.append(timed(torch, tensor.release_physical))
        rest()
        recommitted.append(timed(torch, lambda: tensor.resize_per_segment_(size, zero_new=True)))
    tensor.free()
    return {"ext_kv_release_s": statistics.median(released), "ext_kv_recommit_s": statistics.median(recommitted)}


if __name__ == "__main__":
    main()
