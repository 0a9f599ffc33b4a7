"""One SGLang release's own memory-saver path driving the torch_memory_saver drop-in on the
GPU: its ``torch_memory_saver_adapter.py`` (the calls SGLang makes) and its scheduler's
``release_memory_occupation``/``resume_memory_occupation`` taken from its source (the order
SGLang pauses and resumes in: ``kv_cache`` then a flush, the model's buffers stashed,
``weights``, ``cuda_graph``; resume ``cuda_graph``, ``weights`` and the buffers, then
``kv_cache``); a small model stands in for the engine. Prints one JSON line per check.

    python sglang_checks.py RELEASE_DIR MODE

MODE: ``preload`` (the scheduler runs in a child started inside
``configure_subprocess()``, as SGLang's engine starts it) or ``torch`` (the pluggable
allocator, ``hook_mode = "torch"``).

Checks: ``release-all`` (everything paused and resumed: memory freed, weights and buffers
bit-exact, the graph captured under the memory saver replays as before), ``staged`` (verl's
order: resume ``weights``, update them, then ``kv_cache`` and ``cuda_graph``), ``oom`` (a
resume with the device full raises ``gpu_pager.OutOfMemoryError``, loses nothing, and a
retry succeeds; torch_memory_saver exits the process there).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from functools import partial
from types import SimpleNamespace
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import release as rel  # noqa: E402

MIB = 1 << 20
SCHEDULER_METHODS = ("release_memory_occupation", "resume_memory_occupation")
STATE_FUNCTIONS = ("_export_static_state", "_import_static_state")


def main() -> None:
    release, mode = sys.argv[1], sys.argv[2]
    # As a user switches SGLang: the variable (for the children, whose start-up reads it)
    # and, since this process started without it, the switch itself.
    os.environ["GPU_PAGER_DROP_IN"] = "torch_memory_saver"
    from gpu_pager import _drop_in

    _drop_in.install()
    if mode == "preload" and "--child" not in sys.argv:
        # SGLang's engine starts its scheduler processes inside configure_subprocess().
        rel.import_root(release, "sglang")
        from sglang.srt.utils.torch_memory_saver_adapter import TorchMemorySaverAdapter  # type: ignore[import-not-found]  # the release's

        adapter = TorchMemorySaverAdapter.create(enable=True)
        with adapter.configure_subprocess():
            done = subprocess.run([sys.executable, *sys.argv, "--child"])
        raise SystemExit(done.returncode)
    child(release, mode)


def child(release_dir: str, mode: str) -> None:
    name = os.path.basename(os.path.normpath(release_dir))
    import torch
    import torch.distributed as dist

    rel.import_root(release_dir, "sglang")
    if mode == "torch":
        import torch_memory_saver

        torch_memory_saver.torch_memory_saver.hook_mode = "torch"
    from sglang.srt import constants as c  # type: ignore[attr-defined]  # the release's, over the shim's package
    from sglang.srt.utils.torch_memory_saver_adapter import TorchMemorySaverAdapter

    adapter = TorchMemorySaverAdapter.create(enable=True)
    if not type(adapter).__name__.endswith("Real") or not adapter.enabled:
        raise SystemExit(f"{name}: the memory saver is not enabled ({type(adapter).__name__})")
    import torch_memory_saver

    if not torch_memory_saver.__name__.startswith("gpu_pager") and "gpu_pager" not in (
        getattr(torch_memory_saver, "__file__", "") or ""
    ):
        raise SystemExit(f"{name}: torch_memory_saver is not gpu_pager's drop-in")

    store = tempfile.mktemp(prefix="sglang-checks-")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    nn = torch.nn
    hidden = 2048

    class Model(nn.Module):  # type: ignore[name-defined,misc]  # torch is Any here
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(
                nn.Linear(hidden, hidden, bias=False, dtype=torch.bfloat16) for _ in range(32)
            )
            self.register_buffer("scale", torch.rand(hidden, dtype=torch.bfloat16))

        def forward(self, x: Any) -> Any:
            for layer in self.layers:
                x = torch.tanh(layer(x))
            return x * self.scale

    torch.manual_seed(0)
    with adapter.region(c.GPU_MEMORY_TYPE_WEIGHTS, enable_cpu_backup=True):
        model = Model().cuda()
    with adapter.region(c.GPU_MEMORY_TYPE_KV_CACHE):
        kv = torch.randn(256 * MIB, dtype=torch.bfloat16, device="cuda")
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kv_bytes = kv.numel() * kv.element_size()
    x = torch.randn(8, hidden, dtype=torch.bfloat16, device="cuda")
    graph = torch.cuda.CUDAGraph()
    backup = {"enable_cpu_backup": True} if rel.version_numbers(release_dir) >= (0, 5, 23) else {}
    graph_ctx = partial(adapter.cuda_graph, tag=c.GPU_MEMORY_TYPE_CUDA_GRAPH, **backup)
    stream = torch.cuda.Stream()
    with torch.no_grad():
        model(x)
        torch.cuda.synchronize()
        with graph_ctx(cuda_graph=graph, pool=torch.cuda.graph_pool_handle(), stream=stream):
            out = model(x)
    graph.replay()
    torch.cuda.synchronize()
    reference = out.clone()

    namespace: dict[str, Any] = {
        "torch": torch,
        "logger": None,
        "GPU_MEMORY_ALL_TYPES": c.GPU_MEMORY_ALL_TYPES,
        "GPU_MEMORY_TYPE_KV_CACHE": c.GPU_MEMORY_TYPE_KV_CACHE,
        "GPU_MEMORY_TYPE_WEIGHTS": c.GPU_MEMORY_TYPE_WEIGHTS,
        "GPU_MEMORY_TYPE_CUDA_GRAPH": c.GPU_MEMORY_TYPE_CUDA_GRAPH,
        "ReleaseMemoryOccupationReqOutput": SimpleNamespace,
        "ResumeMemoryOccupationReqOutput": SimpleNamespace,
        "DisaggregationMode": SimpleNamespace(DECODE="decode", PREFILL="prefill", NULL="null"),
    }
    source = os.path.join(release_dir, "sources", "scheduler.py")
    rel.build_functions(rel.functions(source, STATE_FUNCTIONS), namespace)
    ReleaseScheduler = rel.build_class(
        "ReleaseScheduler", rel.methods(source, SCHEDULER_METHODS), namespace
    )

    class Scheduler(ReleaseScheduler):  # type: ignore[misc,valid-type]
        """The release's release/resume methods on the engine's stand-in state."""

        def __init__(self) -> None:
            self.offload_tags: set[str] = set()
            self.memory_saver_adapter = adapter
            self.tp_worker = SimpleNamespace(model_runner=SimpleNamespace(model=model))
            self.tp_cpu_group = dist.group.WORLD
            self.scheduler = SimpleNamespace(_engine_paused=False, disaggregation_mode="null")
            self.flushed = 0

        def is_fully_idle(self, **_: Any) -> bool:
            return True

        def flush_cache(self) -> None:
            self.flushed += 1

        def _assert_weight_cache_inactive(self, _: str) -> None:
            pass

    scheduler = Scheduler()
    expect = {k: p.detach().cpu() for k, p in model.named_parameters()}
    expect_buffers = {k: b.cpu() for k, b in model.named_buffers()}

    def free() -> int:
        torch.cuda.synchronize()
        return int(torch.cuda.mem_get_info()[0])

    def same(what: str) -> None:
        for k, p in model.named_parameters():
            if not torch.equal(p.detach().cpu(), expect[k]):
                raise AssertionError(f"{what}: parameter {k} differs")
        for k, b in model.named_buffers():
            if not torch.equal(b.cpu(), expect_buffers[k]):
                raise AssertionError(f"{what}: buffer {k} differs")

    def replays(what: str) -> None:
        graph.replay()
        torch.cuda.synchronize()
        if not torch.equal(out, reference):
            raise AssertionError(f"{what}: the graph's replay differs")

    def release(tags: list[str] | None) -> None:
        scheduler.release_memory_occupation(SimpleNamespace(tags=tags))

    def resume(tags: list[str] | None) -> None:
        scheduler.resume_memory_occupation(SimpleNamespace(tags=tags))

    def release_all() -> str:
        before = free()
        t = time.perf_counter()
        release(None)
        pause_s = time.perf_counter() - t
        got = free() - before
        if got < 0.9 * (weight_bytes + kv_bytes):
            raise AssertionError(f"freed {got / MIB:.0f} MiB of {(weight_bytes + kv_bytes) / MIB:.0f}")
        t = time.perf_counter()
        resume(None)
        resume_s = time.perf_counter() - t
        same("after resume")
        replays("after resume")
        return f"freed {got / MIB:.0f} MiB; pause {pause_s * 1e3:.0f} ms, resume {resume_s * 1e3:.0f} ms"

    def staged() -> str:
        release(None)
        asleep = free()
        resume([c.GPU_MEMORY_TYPE_WEIGHTS])
        same("after resume(weights)")
        if asleep - free() >= weight_bytes + kv_bytes // 2:
            raise AssertionError("resume(weights) mapped the KV cache too")
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(-1)
        resume([c.GPU_MEMORY_TYPE_KV_CACHE, c.GPU_MEMORY_TYPE_CUDA_GRAPH])
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(-1)
        same("after the update and resume(kv_cache, cuda_graph)")
        replays("after the staged resume")
        return "weights, the update, then kv_cache and cuda_graph"

    def oom() -> str:
        import gpu_pager

        release(None)
        filler = torch.empty(max(free() - 64 * MIB, 0), dtype=torch.uint8, device="cuda")
        try:
            resume(None)
        except gpu_pager.OutOfMemoryError as e:
            raised = type(e)
        else:
            raise AssertionError("resume with the device full raised nothing")
        del filler
        torch.cuda.empty_cache()
        # SGLang forgot the tags before its first resume call failed; a retry names them again.
        scheduler.offload_tags.update(c.GPU_MEMORY_ALL_TYPES)
        resume(None)
        same("after the retry")
        replays("after the retry")
        return f"{raised.__module__}.{raised.__name__}, then the retry resumed all"

    checks: list[tuple[str, Callable[[], str]]] = [
        ("release-all", release_all),
        ("staged", staged),
        ("oom", oom),
    ]
    rel.run_checks(name, mode, checks)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
