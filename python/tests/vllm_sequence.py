"""vLLM's sleep sequence on a real transformers model (``engine.Engine``: a Llama with random
weights, its static KV cache, a decode step captured in a CUDA graph), in a process of its
own, through an allocator with vLLM's protocol. Prints one JSON line per step and exits 0
when every check holds.

    python vllm_sequence.py [SIZE] [--impl vllm|tms]

``vllm`` (the test): gpu_pager's vLLM drop-in, with vLLM's tags (``weights``, ``kv_cache``,
``runtime`` for block tables, the graph pool through ``use_cudagraph_pool()``) and the
sequences: level 1 (weights offloaded), level 2 (nothing kept; the weights come back zeroed
and are reloaded, the model's buffers restored as vLLM's worker does), ``discard(["kv_cache"])``,
and a wake-up out of memory that raises a ``RuntimeError`` and then succeeds. Each ends with
logits equal to the run that never slept. ``tms`` (a benchmark peer, torch_memory_saver
itself in torch hook mode): the level-1 timings only, its graph outside its regions (it
cannot capture into them in that mode).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402

torch.use_deterministic_algorithms(True, warn_only=True)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine import Engine, Placement, trainer_pass  # noqa: E402

GIB = 1 << 30


def say(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def free() -> int:
    torch.cuda.synchronize()
    return int(torch.cuda.mem_get_info()[0])


def timed(f: Callable[[], object]) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    f()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def check(cond: bool, what: str) -> None:
    if not cond:
        say(failed=what)
        raise SystemExit(1)


def same(engine: Engine, want: tuple[torch.Tensor, torch.Tensor]) -> bool:
    got = engine.step()
    return all(torch.equal(g, w) for g, w in zip(got, want))


def run_vllm(size: str) -> None:
    import gpu_pager
    import gpu_pager.torch as gpt
    from gpu_pager.compat.vllm import get_mem_allocator_instance

    alloc = get_mem_allocator_instance()

    def graph(cg: Any) -> AbstractContextManager[Any]:
        @contextmanager
        def capture() -> Iterator[None]:
            with alloc.use_cudagraph_pool() as pool:
                with torch.cuda.graph(cg, pool=pool):
                    yield

        return capture()

    engine = Engine(
        size,
        Placement(
            weights=lambda: alloc.use_memory_pool("weights"),
            kv=lambda: alloc.use_memory_pool("kv_cache"),
            graph=graph,
        ),
    )
    with alloc.use_memory_pool("runtime"):  # block tables: a tag that is never deferred
        blocks = torch.arange(1 << 20, dtype=torch.int32, device="cuda")
    pager = gpt.pager()

    def state(tag: str) -> Any:
        return pager.info(tag).state

    for name, t in engine.tensors().items():
        where = gpt.locate(t)
        check(where is not None and where[0] == ("kv_cache" if name.startswith("kv") else "weights"), name)
    graph_at = gpt.locate(engine.logits)
    check(graph_at is not None and graph_at[0] == "cuda_graph", "the graph's memory in its pool")
    want = engine.step()
    addresses = engine.addresses()
    new_weights = engine.snapshot_parameters()
    buffers = {n: b.detach().cpu().clone() for n, b in engine.model.named_buffers()}
    weights = engine.weight_bytes()
    say(step="built", weights_gib=weights / GIB, usage_gib=alloc.get_current_usage() / GIB)

    # Level 1: the weights offloaded, everything else discarded.
    before = free()
    t_sleep = timed(lambda: alloc.sleep(offload_tags=("weights",)))
    rose = free() - before
    check(rose >= weights, f"level 1: free memory rose by {rose}, weights {weights}")
    trainer_pass()
    t_wake_w = timed(lambda: alloc.wake_up(tags=["weights"]))
    check(state("kv_cache") == gpu_pager.State.RELEASED, "kv_cache deferred")
    check(all(state(t) == gpu_pager.State.RESIDENT for t in ("weights", "runtime", "cuda_graph")),
          "a selective wake-up wakes every tag that is not deferrable")
    check(all(torch.equal(p.detach().cpu(), v) for p, v in zip(engine.parameters(), new_weights)),
          "level 1: weights bit-exact after the wake-up")
    check(torch.equal(blocks, torch.arange(1 << 20, dtype=torch.int32, device="cuda")),
          "level 1: runtime state kept")
    blocks.fill_(1)  # touching a non-deferrable tag after a weights-only wake: no fault
    torch.cuda.synchronize()
    engine.update(new_weights)
    t_wake_kv = timed(lambda: alloc.wake_up(tags=["kv_cache"]))
    check(same(engine, want) and engine.addresses() == addresses, "level 1: logits equal")
    say(step="level 1", sleep_s=t_sleep, freed_gib=rose / GIB, wake_weights_s=t_wake_w, wake_kv_s=t_wake_kv)

    # Level 2: nothing kept; weights reloaded, buffers restored (vLLM's worker does both).
    alloc.sleep(offload_tags=())
    trainer_pass()
    alloc.wake_up(tags=["weights"])
    check(float(engine.parameters()[0].detach().abs().sum()) == 0.0, "level 2: weights come back zeroed")
    check(int(blocks.sum()) == blocks.numel(), "level 2: runtime state kept")
    with torch.no_grad():
        for n, b in engine.model.named_buffers():
            b.copy_(buffers[n])
    engine.update(new_weights)
    alloc.wake_up(tags=["kv_cache"])
    check(same(engine, want), "level 2: logits equal")
    say(step="level 2", ok=True)

    # The KV cache alone (vLLM's release_kv_cache_memory), then back.
    alloc.discard(["kv_cache"])
    check(state("kv_cache") == gpu_pager.State.RELEASED and state("weights") == gpu_pager.State.RESIDENT, "discard")
    alloc.wake_up(tags=["kv_cache"])
    check(same(engine, want), "discard: logits equal")
    say(step="discard kv_cache", ok=True)

    # A wake-up while the trainer still holds the memory: a RuntimeError, nothing lost.
    alloc.sleep(offload_tags=("weights",))
    hog = torch.empty(free() - GIB, dtype=torch.uint8, device="cuda")
    try:
        alloc.wake_up(tags=["weights"])
        check(False, "a wake-up without memory raised nothing")
    except RuntimeError as e:
        check(isinstance(e, gpu_pager.OutOfMemoryError), f"raised {type(e)}")
        say(step="out of memory", raised=type(e).__name__, message=str(e)[:160])
    check(state("weights") == gpu_pager.State.RELEASED, "out of memory: still asleep")
    del hog
    torch.cuda.empty_cache()
    alloc.wake_up(tags=["weights"])
    check(all(torch.equal(p.detach().cpu(), v) for p, v in zip(engine.parameters(), new_weights)),
          "after the retry: weights bit-exact")
    alloc.wake_up()
    check(same(engine, want), "after the retry: logits equal")
    say(step="retry", ok=True)


def run_tms(size: str) -> None:
    from torch_memory_saver import torch_memory_saver as tms

    tms.hook_mode = "torch"
    engine = Engine(
        size,
        Placement(
            weights=lambda: tms.region("weights", enable_cpu_backup=True),
            kv=lambda: tms.region("kv_cache"),
        ),
    )
    want = engine.step()
    new_weights = engine.snapshot_parameters()
    before = free()
    t_sleep = timed(lambda: (tms.pause("kv_cache"), tms.pause("weights")))
    rose = free() - before
    trainer_pass()
    t_wake_w = timed(lambda: tms.resume("weights"))
    engine.update(new_weights)
    t_wake_kv = timed(lambda: tms.resume("kv_cache"))
    check(same(engine, want), "torch_memory_saver: logits equal")
    say(step="level 1", impl="torch_memory_saver", sleep_s=t_sleep, freed_gib=rose / GIB,
        wake_weights_s=t_wake_w, wake_kv_s=t_wake_kv)


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--impl")]
    impl = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--impl=")), "vllm")
    (run_vllm if impl == "vllm" else run_tms)(args[0] if args else "large")
    print("done", flush=True)
