"""SGLang's own ``Engine`` (``enable_memory_saver=True``, CUDA graphs on, its scheduler in its
own process) through the seed's multi-stage wake-up, stock (torch_memory_saver 0.0.10) or
through the drop-in (``GPU_PAGER_DROP_IN=torch_memory_saver``: nothing else differs; with
``E2E_HOOK_MODE=torch`` every process sets torch_memory_saver's ``hook_mode = "torch"`` at
start, as a framework that chooses that mode does). Run by ``e2e.py``; prints one JSON row per
check and call.

    python e2e_sglang.py MODEL_DIR

Cycles, each ending with the reference batch's greedy tokens compared token for token:
  - ``seed``: ``release_memory_occupation()``, ``resume_memory_occupation(["weights"])``,
    ``update_weights_from_tensor`` (the checkpoint's weights: an RL step's update with the same
    values), ``resume_memory_occupation(["kv_cache", "cuda_graph"])`` (verl's order);
  - ``skipped stage`` (last): a release, then the KV cache and graphs resumed but not the
    weights, then a generation: what the engine does with weights that are not there.
"""

from __future__ import annotations

import glob
import importlib
import os
import sys
import threading
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import e2e_rows as rows  # noqa: E402
from e2e_rows import BATCH, TOKENS, call, emit  # noqa: E402



def main() -> None:
    model = sys.argv[1]
    switch = os.environ.get("GPU_PAGER_DROP_IN", "")
    sgl: Any = importlib.import_module("sglang")
    tms: Any = importlib.import_module("torch_memory_saver")
    emit(check="version", kind="info",
         detail=f"SGLang {sgl.__version__}, torch_memory_saver from {tms.__name__} "
         f"({getattr(tms, '__file__', '')}), hook mode {os.environ.get('E2E_HOOK_MODE', 'preload')}")
    emit(check="drop-in", ok=("gpu_pager" in (getattr(tms, "__file__", "") or "")) == bool(switch),
         detail=getattr(tms, "__file__", ""))

    t = time.perf_counter()
    engine = sgl.Engine(
        model_path=model, enable_memory_saver=True, skip_tokenizer_init=True,
        attention_backend="triton", sampling_backend="pytorch", grammar_backend="none",
        mem_fraction_static=0.5, random_seed=0, cuda_graph_max_bs=16, max_running_requests=16,
        context_length=1024, log_level="error",
    )
    emit(check="start", kind="info", detail=f"Engine up in {time.perf_counter() - t:.1f} s")

    ids = rows.prompts()
    params = {"temperature": 0.0, "max_new_tokens": TOKENS, "ignore_eos": True}

    def generate() -> list[list[int]]:
        return [list(o["output_ids"]) for o in engine.generate(input_ids=ids, sampling_params=params)]

    reference = generate()
    emit(check="reference", tokens=reference, detail=f"{BATCH} x {TOKENS} greedy tokens")

    import torch

    load_file: Any = importlib.import_module("safetensors.torch").load_file
    weights: list[tuple[str, torch.Tensor]] = []
    for shard in sorted(glob.glob(os.path.join(model, "*.safetensors"))):
        weights += list(load_file(shard, device="cuda").items())
    nbytes = sum(t.numel() * t.element_size() for _, t in weights)
    emit(check="weights-bytes", kind="info", bytes=nbytes, detail=f"{len(weights)} tensors")

    def same(cycle: str) -> None:
        rows.same(cycle, generate(), reference)

    for cycle in ("seed", "seed again"):
        prefix = "" if cycle == "seed" else "again: "
        call(f"{prefix}release all", lambda: engine.release_memory_occupation(), sleep=True)
        call(f"{prefix}wake weights", lambda: engine.resume_memory_occupation(["weights"]))
        call(f"{prefix}update_weights_from_tensor", lambda: engine.update_weights_from_tensor(weights))
        call(f"{prefix}wake kv_cache+cuda_graph", lambda: engine.resume_memory_occupation(["kv_cache", "cuda_graph"]))
        same(cycle)

    # The skipped stage, last: the engine may not survive it.
    del weights
    torch.cuda.empty_cache()
    engine.release_memory_occupation()
    engine.resume_memory_occupation(["kv_cache", "cuda_graph"])
    emit(check="skipped stage: started", kind="info", detail="weights released, KV cache and graphs resumed")
    outcome: dict[str, Any] = {}

    def attempt() -> None:
        try:
            outcome["tokens"] = generate()
        except BaseException as e:  # noqa: BLE001 - what the engine raises is the finding
            outcome["error"] = f"{type(e).__module__}.{type(e).__name__}: {str(e)[:300]}"

    worker = threading.Thread(target=attempt, daemon=True)
    worker.start()
    worker.join(30)
    if "error" in outcome:
        detail = f"raised {outcome['error']}"
    elif "tokens" in outcome:
        detail = "generated tokens from weights that are not there: " + (
            "the reference's" if outcome["tokens"] == reference else "not the reference's")
    else:
        detail = "no answer in 30 s"
    emit(check="skipped stage", kind="finding", ok=True, detail=detail)
    os._exit(0)  # the engine may be wedged; its processes go with this one's group


if __name__ == "__main__":
    main()
