"""vLLM's own ``LLM`` (``enable_sleep_mode=True``, torch.compile and CUDA graphs on, its engine
core in its own process) through an RL loop's sleeps and wake-ups, stock or through the drop-in
(``GPU_PAGER_DROP_IN=vllm`` in the environment: nothing else differs). Run by ``e2e.py``; prints
one JSON row per check and call.

    python e2e_vllm.py MODEL_DIR

Cycles, each ending with the reference batch's greedy tokens compared token for token:
  - ``level1``: ``sleep(level=1)``, ``wake_up(["weights"])``, ``wake_up(["kv_cache"])``;
  - ``rl``: ``sleep(level=1)``, ``wake_up(["weights"])``, every weight overwritten through the
    engine (zeroed, then ``reload_weights`` from the checkpoint: the update of an RL step with
    the same weights), ``wake_up(["kv_cache"])``;
  - ``level2``: ``sleep(level=2)``, ``wake_up()``, ``reload_weights``.
Each sleep's freed memory is NVML's used memory before less after (device-wide: the engine
core is another process).
"""

from __future__ import annotations

import importlib
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import e2e_rows as rows  # noqa: E402
from e2e_rows import BATCH, TOKENS, call, emit  # noqa: E402


def zero_weights(worker: Any) -> int:
    """Runs in the worker (``collective_rpc``): every parameter zeroed in place."""
    import torch

    n = 0
    with torch.no_grad():
        for p in worker.model_runner.model.parameters():
            p.zero_()
            n += 1
    torch.cuda.synchronize()
    return n


def weights_bytes(worker: Any) -> int:
    """Runs in the worker: the bytes of the model's parameters."""
    return sum(p.numel() * p.element_size() for p in worker.model_runner.model.parameters())


def main() -> None:
    model = sys.argv[1]
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc(callable)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    vllm: Any = importlib.import_module("vllm")
    inputs: Any = importlib.import_module("vllm.inputs")
    switch = os.environ.get("GPU_PAGER_DROP_IN", "")
    emit(check="version", kind="info", detail=f"vLLM {vllm.__version__}, drop-in={switch or 'off'}")

    t = time.perf_counter()
    llm = vllm.LLM(
        model=model, enable_sleep_mode=True, skip_tokenizer_init=True, dtype="bfloat16",
        gpu_memory_utilization=0.5, max_model_len=1024, max_num_seqs=16, seed=0,
    )
    emit(check="start", kind="info", detail=f"LLM up in {time.perf_counter() - t:.1f} s")
    allocator = llm.collective_rpc(
        lambda w: type(importlib.import_module("vllm.device_allocator").get_mem_allocator_instance()).__module__
    )[0]
    emit(check="allocator", ok=(allocator.startswith("gpu_pager")) == bool(switch), detail=allocator)
    emit(check="weights-bytes", kind="info", bytes=llm.collective_rpc(weights_bytes)[0], detail="")

    prompts = [inputs.TokensPrompt(prompt_token_ids=ids) for ids in rows.prompts()]
    params = vllm.SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True, detokenize=False)

    def generate() -> list[list[int]]:
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]

    reference = generate()
    emit(check="reference", tokens=reference, detail=f"{BATCH} x {TOKENS} greedy tokens")

    def same(cycle: str) -> None:
        rows.same(cycle, generate(), reference)

    call("sleep(1)", lambda: llm.sleep(level=1), sleep=True)
    call("wake weights", lambda: llm.wake_up(["weights"]))
    call("wake kv_cache", lambda: llm.wake_up(["kv_cache"]))
    same("level1")

    call("rl: sleep(1)", lambda: llm.sleep(level=1), sleep=True)
    call("rl: wake weights", lambda: llm.wake_up(["weights"]))
    zeroed = llm.collective_rpc(zero_weights)[0]
    call("rl: reload_weights", lambda: llm.collective_rpc("reload_weights"))
    call("rl: wake kv_cache", lambda: llm.wake_up(["kv_cache"]))
    emit(check="rl: zeroed", kind="info", detail=f"{zeroed} parameters zeroed before the reload")
    same("rl")

    call("sleep(2)", lambda: llm.sleep(level=2), sleep=True)
    call("wake all", lambda: llm.wake_up())
    call("level2: reload_weights", lambda: llm.collective_rpc("reload_weights"))
    same("level2")
    del llm


if __name__ == "__main__":
    main()
