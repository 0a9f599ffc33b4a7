"""fp8 online quantization through the vLLM drop-in: a bf16 model is built inside
``use_memory_pool("weights")``, quantized to fp8, and its bf16 tensors freed, as RL rollouts
with fp8 weights do. Reports what the device holds after the context, and what a
``sleep(offload_tags=("weights",))`` and the ``wake_up`` that follows move and take,
against the link's speed for the live bytes measured in the same run (a pinned copy of the
same size), and checks the fp8 bytes come back bit-exact.

    python fp8.py                       # 8 GiB of bf16 in 64 tensors, 3 cycles
    python fp8.py --gib 2 --tensors 16 --cycles 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from gpu_pager.compat import vllm

GIB = 1 << 30


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=8.0, help="bf16 model size (GiB)")
    ap.add_argument("--tensors", type=int, default=64)
    ap.add_argument("--cycles", type=int, default=3)
    args = ap.parse_args()
    per = int(args.gib * GIB) // args.tensors // 2  # bf16 elements per tensor

    torch.cuda.synchronize()
    free0 = torch.cuda.mem_get_info()[0]
    a = vllm.get_mem_allocator_instance()
    with a.use_memory_pool("weights"):
        bf16 = [torch.empty(per, dtype=torch.bfloat16, device="cuda").normal_() for _ in range(args.tensors)]
        fp8 = [w.to(torch.float8_e4m3fn) for w in bf16]
        built = sum(w.nbytes for w in bf16)
        del bf16
    torch.cuda.synchronize()
    live = sum(w.nbytes for w in fp8)
    mapped = sum(d.handle[1] for d in a.pointer_to_data.values() if not d.is_asleep)
    held = free0 - torch.cuda.mem_get_info()[0]
    print(f"bf16 built {built / GIB:.2f} GiB, fp8 live {live / GIB:.2f} GiB")
    print(f"after the context: allocator maps {mapped / GIB:.2f} GiB, the device holds "
          f"{held / GIB:.2f} GiB more than before ({held / live:.3f}x the live bytes)")

    pinned = torch.empty(live, dtype=torch.uint8, pin_memory=True)
    src = torch.empty(live, dtype=torch.uint8, device="cuda")
    link = []
    for _ in range(3):
        torch.cuda.synchronize()
        t = time.perf_counter()
        pinned.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        link.append(live / (time.perf_counter() - t))
    del src, pinned
    torch.cuda.empty_cache()
    gbps = max(link) / 1e9
    floor_ms = live / max(link) * 1e3
    print(f"link (device to pinned host, same bytes): {gbps:.1f} GB/s, {floor_ms:.1f} ms for the live bytes")

    expect = [w.view(torch.uint8).cpu() for w in fp8]
    sleeps, wakes = [], []
    for c in range(args.cycles):
        for w in fp8:  # new weights each cycle, so each sleep copies
            w.view(torch.uint8).add_(1)
        expect = [e.add_(1) for e in expect]
        torch.cuda.synchronize()
        t = time.perf_counter()
        a.sleep(offload_tags=("weights",))
        sleeps.append((time.perf_counter() - t) * 1e3)
        t = time.perf_counter()
        a.wake_up()
        torch.cuda.synchronize()
        wakes.append((time.perf_counter() - t) * 1e3)
        ok = all(torch.equal(w.view(torch.uint8).cpu(), e) for w, e in zip(fp8, expect))
        print(f"cycle {c}: sleep {sleeps[-1]:.1f} ms, wake {wakes[-1]:.1f} ms, bit-exact {ok}")
        assert ok
    s, w = statistics.median(sleeps), statistics.median(wakes)
    print(f"median sleep {s:.1f} ms ({floor_ms / s:.2f} of the link for the live bytes), "
          f"median wake {w:.1f} ms ({floor_ms / w:.2f} of the link)")


if __name__ == "__main__":
    main()
