"""One vLLM release's own sleep code driving an allocator on the GPU: the release's
``vllm/device_allocator/`` (allocator protocol, ``CuMemAllocator``, backends), its plugin
loader, and its worker's ``sleep``/``wake_up``/``discard`` methods taken from its
``gpu_worker.py``; a small model stands in for the engine. Prints one JSON line per check.

    python vllm_checks.py RELEASE_DIR SWITCH

SWITCH: ``drop-in`` (``GPU_PAGER_DROP_IN=vllm``: vLLM's own backend, or its worker on 0.24,
drives gpu_pager's allocator), ``backend`` (the same and ``--sleep-mode-backend gpu_pager``,
from 0.29 on), or ``stock`` (the release's own allocator: shows that the checks read the
release as it is).

Checks: ``level1`` (sleep(1), wake: weights, buffers, block tables bit-exact, a graph replays
as before, the memory freed), ``selective`` (wake weights, update them, wake the KV cache, in
the release's semantics), ``level2`` (sleep(2): what the release keeps is kept, the rest is
reloaded), ``discard`` (the KV cache freed without a backup, then woken), ``oom`` (a wake-up
with the device full raises the release's exception type, loses nothing, and a retry
succeeds), ``extensible-kv`` (0.34: the KV cache outside the allocator, released and
recommitted by vLLM beside it).
"""

from __future__ import annotations

import fnmatch
import logging
import os
import sys
import time
from types import SimpleNamespace
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import release as rel  # noqa: E402

MIB = 1 << 20
WORKER_METHODS = (
    "sleep",
    "wake_up",
    "discard",
    "sleep_mode_backend",
    "_get_sleep_mode_backend",
    "_get_sleep_parameters",
    "_discardable_parameters",
    "_save_sleep_parameters",
    "_restore_sleep_parameters",
)


def main() -> None:
    release, switch = sys.argv[1], sys.argv[2]
    name = os.path.basename(os.path.normpath(release))
    v = rel.version_numbers(release)
    if switch == "stock":
        os.environ.pop("GPU_PAGER_DROP_IN", None)
    else:
        os.environ["GPU_PAGER_DROP_IN"] = "vllm"
    logging.basicConfig(level=logging.WARNING)

    import torch

    torch.cuda.init()
    torch.zeros(1, device="cuda")  # loads libcudart, which vLLM's cuda_wrapper looks up
    rel.import_root(release, "vllm")
    # The worker module binds this at import, before vLLM loads its plugins.
    from vllm.device_allocator import get_mem_allocator_instance
    from vllm.platforms import current_platform
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    allocator = get_mem_allocator_instance()
    ours = type(allocator).__module__.startswith("gpu_pager")
    if ours != (switch != "stock"):
        raise SystemExit(f"{name} {switch}: the allocator is {type(allocator).__module__}")

    namespace: dict[str, Any] = {
        "torch": torch,
        "nn": torch.nn,
        "time": time,
        "logger": logging.getLogger("vllm.worker"),
        "format_gib": lambda b: f"{b / (1 << 30):.2f}",
        "fnmatch_filter": lambda names, pattern: fnmatch.filter(list(names), pattern),
        "current_platform": current_platform,
        "get_mem_allocator_instance": get_mem_allocator_instance,
        "has_kv_transfer_group": lambda: False,
        "get_kv_transfer_group": None,
        "suspend_device_comms": lambda: None,
        "resume_device_comms": lambda: None,
    }
    sources = rel.methods(os.path.join(release, "sources", "gpu_worker.py"), WORKER_METHODS)
    ReleaseWorker = rel.build_class("ReleaseWorker", sources, namespace)
    preserve = ["keep.*", "draft.*"] if v >= (0, 33) else ["keep.*"]
    backend = "gpu_pager" if switch == "backend" else "cumem"
    engine = Engine(torch, allocator, v)

    class Worker(ReleaseWorker):  # type: ignore[misc,valid-type]
        """The release's worker methods on the engine's stand-in state."""

        def __init__(self) -> None:
            model_config = SimpleNamespace(
                sleep_mode_backend=backend,
                enable_nccl_comm_suspend=False,
                sleep_preserve_parameter_names=preserve,
            )
            self.model_config = model_config
            self.vllm_config = SimpleNamespace(model_config=model_config)
            self.model_runner = SimpleNamespace(
                model=engine.model, post_kv_cache_wake_up=lambda: None
            )
            if engine.extensible is not None:
                self.model_runner.extensible_kv_cache = engine.extensible
            self._sleep_saved_buffers: dict[str, Any] = {}
            self._sleep_saved_draft_buffers: dict[str, Any] = {}
            self._sleep_saved_parameters: dict[str, Any] = {}
            self._sleep_mode_backend = None

        def get_draft_model(self) -> Any:
            return engine.draft

        def synchronize_device(self) -> None:
            torch.cuda.synchronize()

    worker = Worker()
    checks: list[tuple[str, Callable[[], str]]] = [
        ("level1", lambda: engine.level1(worker)),
        ("selective", lambda: engine.selective(worker)),
        ("level2", lambda: engine.level2(worker)),
    ]
    if v >= (0, 29):
        checks.append(("discard", lambda: engine.discard(worker, allocator)))
    if switch != "stock":
        checks.append(("oom", lambda: engine.oom(worker)))
    if engine.extensible is not None:
        checks.append(("extensible-kv", lambda: engine.extensible_kv(worker)))
    rel.run_checks(name, switch, checks)


class Engine:
    """A model (32 layers, a buffer, a preserved layer ``keep``, from 0.33 a drafter), a KV
    cache, block tables (``runtime``, from 0.33) and a captured decode graph (in the
    allocator's graph pool from 0.33), allocated as the release's worker allocates them."""

    def __init__(self, torch: Any, allocator: Any, v: tuple[int, ...]) -> None:
        self.torch, self.allocator, self.v = torch, allocator, v
        nn = torch.nn
        hidden = 2048

        class Model(nn.Module):  # type: ignore[name-defined,misc]  # torch is Any here
            def __init__(self, layers: int) -> None:
                super().__init__()
                self.layers = nn.ModuleList(
                    nn.Linear(hidden, hidden, bias=False, dtype=torch.bfloat16) for _ in range(layers)
                )
                self.keep = nn.Linear(hidden, hidden, bias=False, dtype=torch.bfloat16)
                self.register_buffer("scale", torch.rand(hidden, dtype=torch.bfloat16))

            def forward(self, x: Any) -> Any:
                for layer in self.layers:
                    x = torch.tanh(layer(x))
                return self.keep(x) * self.scale

        torch.manual_seed(0)
        with allocator.use_memory_pool(tag="weights"):
            self.model = Model(32).cuda()
            self.draft = Model(4).cuda() if v >= (0, 33) else None
        with allocator.use_memory_pool(tag="kv_cache"):
            self.kv = torch.randn(256 * MIB, dtype=torch.bfloat16, device="cuda")
        self.kv_bytes = self.kv.numel() * 2
        self.runtime = None
        if v >= (0, 33):
            with allocator.use_memory_pool(tag="runtime"):
                self.runtime = torch.arange(4 * MIB, dtype=torch.int32, device="cuda")
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.params().values())
        self.x = torch.randn(8, hidden, dtype=torch.bfloat16, device="cuda")
        self.graph = torch.cuda.CUDAGraph()
        with torch.no_grad():
            self.model(self.x)  # warm-up outside the capture
            torch.cuda.synchronize()
            if v >= (0, 33):
                with allocator.cudagraph_pool() as pool, torch.cuda.graph(self.graph, pool=pool):
                    self.out = self.model(self.x)
            else:
                with torch.cuda.graph(self.graph):
                    self.out = self.model(self.x)
        self.graph.replay()
        torch.cuda.synchronize()
        self.reference = self.out.clone()
        self.extensible = None
        if v >= (0, 34):
            from vllm.utils.extensible_tensor import ExtensibleTensor

            self.extensible = ExtensibleKV(torch, ExtensibleTensor(256 * MIB), 256 * MIB)
        self.snapshot()

    def params(self) -> dict[str, Any]:
        named = dict(self.model.named_parameters())
        if self.draft is not None:
            named.update((f"draft.{k}", p) for k, p in self.draft.named_parameters())
        return named

    def snapshot(self) -> None:
        """Host copies of what must come back bit-exact."""
        self.expect = {k: p.detach().cpu() for k, p in self.params().items()}
        self.expect_buffers = {k: b.cpu() for k, b in self.model.named_buffers()}
        self.expect_runtime = None if self.runtime is None else self.runtime.cpu()

    def free(self) -> int:
        self.torch.cuda.synchronize()
        return int(self.torch.cuda.mem_get_info()[0])

    def same(self, what: str, names: Any = None) -> None:
        for k, p in self.params().items():
            if (names is None or any(fnmatch.fnmatch(k, n) for n in names)) and not self.torch.equal(
                p.detach().cpu(), self.expect[k]
            ):
                raise AssertionError(f"{what}: parameter {k} differs")
        for k, b in self.model.named_buffers():
            if not self.torch.equal(b.cpu(), self.expect_buffers[k]):
                raise AssertionError(f"{what}: buffer {k} differs")

    def same_runtime(self, what: str) -> None:
        if self.runtime is not None and not self.torch.equal(self.runtime.cpu(), self.expect_runtime):
            raise AssertionError(f"{what}: the block tables (tag runtime) differ")

    def replays(self, what: str) -> None:
        self.graph.replay()
        self.torch.cuda.synchronize()
        if not self.torch.equal(self.out, self.reference):
            raise AssertionError(f"{what}: the graph's replay differs from before the sleep")

    def freed(self, before: int, want: int, what: str) -> int:
        got = self.free() - before
        if got < 0.9 * want:
            raise AssertionError(f"{what}: freed {got / MIB:.0f} MiB, want >= {want / MIB:.0f}")
        return got

    def level1(self, worker: Any) -> str:
        before = self.free()
        t = time.perf_counter()
        worker.sleep(level=1)
        sleep_s = time.perf_counter() - t
        extra = self.extensible.bytes if self.extensible is not None else 0
        got = self.freed(before, self.weight_bytes + self.kv_bytes + extra, "sleep(1)")
        t = time.perf_counter()
        worker.wake_up(None)
        wake_s = time.perf_counter() - t
        self.same("after wake_up()")
        self.same_runtime("after wake_up()")
        self.replays("after wake_up()")
        return f"freed {got / MIB:.0f} MiB; sleep {sleep_s * 1e3:.0f} ms, wake {wake_s * 1e3:.0f} ms"

    def selective(self, worker: Any) -> str:
        torch = self.torch
        worker.sleep(level=1)
        asleep = self.free()
        worker.wake_up(["weights"])
        self.same("after wake_up(['weights'])")
        if self.v >= (0, 33):
            self.same_runtime("after wake_up(['weights']) (runtime is not deferrable)")
        if asleep - self.free() >= self.weight_bytes + self.kv_bytes // 2:
            raise AssertionError("wake_up(['weights']) mapped the KV cache too")
        with torch.no_grad():  # the weight update, in place
            for p in self.params().values():
                p.mul_(-1)
        self.snapshot()
        worker.wake_up(["kv_cache"])
        self.same("after wake_up(['kv_cache'])")
        self.same_runtime("after wake_up(['kv_cache'])")
        with torch.no_grad():
            for p in self.params().values():
                p.mul_(-1)
        self.snapshot()
        self.replays("after the selective wake-up")
        return "weights woke alone, updated, then the KV cache"

    def level2(self, worker: Any) -> str:
        torch = self.torch
        before = self.free()
        worker.sleep(level=2)
        self.freed(before, self.weight_bytes + self.kv_bytes, "sleep(2)")
        worker.wake_up(None)
        kept = ["keep.*", "draft.*"] if self.v >= (0, 33) else ["keep.*"] if self.v >= (0, 31) else []
        self.same("after sleep(2), the preserved parameters and the buffers", kept or ["-"])
        # The trainer's update reloads the rest (vLLM's reload_weights).
        with torch.no_grad():
            for k, p in self.params().items():
                p.copy_(self.expect[k].to(p.device))
        self.same("after the reload")
        self.replays("after sleep(2) and the reload")
        return f"kept {kept or 'the buffers'}; the rest reloaded"

    def discard(self, worker: Any, allocator: Any) -> str:
        before = self.free()
        if hasattr(worker, "discard"):
            worker.discard(("kv_cache",))
        else:
            allocator.discard(("kv_cache",))
        extra = self.extensible.bytes if self.extensible is not None else 0
        self.freed(before, self.kv_bytes + extra, "discard(kv_cache)")
        worker.wake_up(["kv_cache"])
        if self.extensible is not None:
            self.extensible.check_zero()
        self.same("after discard and wake_up(['kv_cache'])")
        self.replays("after discard")
        return "freed the KV cache, woke it"

    def oom(self, worker: Any) -> str:
        torch = self.torch
        worker.sleep(level=1)
        filler = torch.empty(max(self.free() - 64 * MIB, 0), dtype=torch.uint8, device="cuda")
        try:
            worker.wake_up(None)
        except RuntimeError as e:
            raised = type(e)
        else:
            raise AssertionError("wake_up() with the device full raised nothing")
        del filler
        torch.cuda.empty_cache()
        worker.wake_up(None)
        self.same("after the retry")
        self.replays("after the retry")
        return f"{raised.__module__}.{raised.__name__} (a RuntimeError), then the retry woke all"

    def extensible_kv(self, worker: Any) -> str:
        extensible = self.extensible
        if extensible is None:
            raise AssertionError("the extensible KV cache check runs only on releases that have one (0.34 on)")
        before = self.free()
        worker.sleep(level=1)
        self.freed(before, self.weight_bytes + self.kv_bytes + extensible.bytes, "sleep(1)")
        worker.wake_up(None)
        extensible.check_zero()
        self.same("after wake_up()")
        return "vLLM's extensible KV cache released and recommitted (zeroed) beside the allocator"


class ExtensibleKV:
    """vLLM 0.34's extensible KV cache as the worker reaches it (``release_physical``,
    ``recommit``), on the release's own ``ExtensibleTensor``."""

    def __init__(self, torch: Any, tensor: Any, size: int) -> None:
        self.torch, self.tensor, self.bytes = torch, tensor, size
        tensor.resize_per_segment_(size, zero_new=True)
        tensor.full_view().fill_(7)

    def release_physical(self) -> None:
        self.tensor.release_physical()

    def recommit(self) -> None:
        self.tensor.resize_per_segment_(self.bytes, zero_new=True)

    def check_zero(self) -> None:
        if int(self.tensor.full_view().count_nonzero()) != 0:
            raise AssertionError("the extensible KV cache is not zeroed after its recommit")
        self.tensor.full_view().fill_(7)


if __name__ == "__main__":
    main()
