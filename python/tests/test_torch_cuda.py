"""torch on gpu_pager: needs torch and a CUDA GPU (skipped otherwise). Written for the GPU
machine (torch 2.11, CUDA 13); see python-research notes for the torch facts relied on."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest

import gpu_pager

torch: Any = pytest.importorskip("torch", reason="torch is not installed")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False)", allow_module_level=True)

import gpu_pager.torch as gpt  # noqa: E402
from torch_tags import new_tag, tag  # noqa: E402, F401  (fixtures)
from gpu_pager.compat.torch_memory_saver import TorchMemorySaver  # noqa: E402
from gpu_pager.compat.vllm import CuMemAllocator  # noqa: E402
from fresh import run_python  # noqa: E402

MIB = 1 << 20


def test_tensors_live_in_the_region_and_survive_a_cycle(new_tag: Callable[[], str]) -> None:
    weights, kv = new_tag(), new_tag()
    with gpt.region(weights, "preserve", bytes=64 * MIB) as info:
        w = torch.arange(4 << 20, dtype=torch.float32, device="cuda")  # 16 MiB
    with gpt.region(kv, "discard", bytes=64 * MIB):
        k = torch.ones(1 << 20, dtype=torch.float32, device="cuda")
    assert info.base <= w.data_ptr() < info.base + info.size
    expect = w.clone().cpu()
    addr = w.data_ptr()
    graph = torch.cuda.CUDAGraph()
    out = torch.empty_like(w)
    with torch.cuda.graph(graph):
        out.copy_(w * 2)

    report = gpt.release([weights, kv])
    assert report.bytes == 128 * MIB
    gpt.resume(weights)
    assert w.data_ptr() == addr
    assert torch.equal(w.cpu(), expect)
    graph.replay()  # the captured address is valid again
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), expect * 2)
    gpt.resume(kv)
    k.fill_(3)
    assert float(k.sum()) == 3 * (1 << 20)


def test_region_full_is_torch_oom_with_our_reason(tag: str) -> None:
    with pytest.raises(torch.OutOfMemoryError) as e:
        with gpt.region(tag, "discard", bytes=4 * MIB):
            torch.empty(64 * MIB, dtype=torch.uint8, device="cuda")
    assert "no free range" in (gpt.last_error() or "")
    if hasattr(e.value, "__notes__"):
        assert any("gpu_pager" in n for n in e.value.__notes__)


def test_outside_a_region_tensors_are_ordinary(pager: gpu_pager.Pager) -> None:
    before = pager.stats().resident_bytes
    x = torch.ones(1 << 20, device="cuda")
    assert pager.stats().resident_bytes == before
    del x


def test_torch_memory_saver_compat(new_tag: Callable[[], str]) -> None:
    tms = TorchMemorySaver()
    tms.hook_mode = "torch"
    w_tag, kv_tag = new_tag(), new_tag()
    with tms.region(w_tag, enable_cpu_backup=True):
        w = torch.full((1 << 20,), 7.0, device="cuda")
    with tms.region(kv_tag):
        k = torch.zeros(1 << 20, device="cuda")
    pager = gpt.pager()
    tms.pause(kv_tag)
    tms.pause(w_tag)
    assert pager.region_stats(w_tag).held_bytes >= 4 * MIB
    tms.pause(w_tag)  # idempotent (torch_memory_saver exits here)
    tms.pause("no such tag")  # nothing to do
    tms.resume(w_tag)
    assert float(w.sum()) == 7.0 * (1 << 20)
    tms.resume()
    k.fill_(1)
    assert float(k.sum()) == 1 << 20


def test_disable_gives_its_memory_back_at_empty_cache(tag: str) -> None:
    """Memory allocated and freed inside ``disable()`` is torch's ordinary memory: free
    device memory comes back at ``torch.cuda.empty_cache()``, for a tensor that outlived
    the block too once it died."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.mem_get_info()[0]
    with gpt.use(tag):
        with gpt.disable():
            scratch = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
            kept = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
            assert gpt.locate(scratch) is None
            assert before - torch.cuda.mem_get_info()[0] >= 3 << 30
            del scratch
        again = torch.empty(1 << 20, device="cuda")
    assert gpt.locate(again) is not None, "the tag's pool again after the block"
    torch.cuda.empty_cache()
    assert before - torch.cuda.mem_get_info()[0] < (1 << 30) + 64 * MIB, "scratch given back"
    del kept
    torch.cuda.empty_cache()
    assert before - torch.cuda.mem_get_info()[0] < 64 * MIB, "the survivor given back too"


def test_vllm_compat_sleep_and_wake(new_tag: Callable[[], str]) -> None:
    """vLLM's allocator: the offloaded tag comes back bit-exact, the discarded one zeroed;
    a selective wake-up leaves only deferrable tags asleep."""
    alloc = CuMemAllocator()
    w_tag, other = new_tag(), new_tag()
    with alloc.use_memory_pool(tag=w_tag):
        w = torch.full((1 << 20,), 5.0, device="cuda")
    with alloc.use_memory_pool(tag=other):
        k = torch.full((1 << 20,), 3.0, device="cuda")
    assert alloc.get_current_usage() >= 8 * MIB
    alloc.sleep(offload_tags=(w_tag,))
    alloc.sleep(offload_tags=(w_tag,))  # idempotent
    alloc.wake_up(tags=[w_tag])  # `other` is not deferrable: it wakes too
    assert float(w.sum()) == 5.0 * (1 << 20)
    assert float(k.abs().sum()) == 0.0, "discarded: zeroed"
    alloc.discard(other)
    alloc.wake_up()
    k.fill_(2)
    assert float(k.sum()) == 2 * (1 << 20)


def test_vllm_release_host_memory_gives_the_backup_back(
    new_tag: Callable[[], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``VLLM_SLEEP_MODE_RELEASE_HOST_MEMORY=1`` an offloaded tag's backup is host
    memory that the wake-up gives back; without it the backup stays pinned for the next
    sleep. The contents come back bit-exact either way."""
    p = gpt.pager()
    for value, kept in (("1", False), ("0", True)):
        monkeypatch.setenv("VLLM_SLEEP_MODE_RELEASE_HOST_MEMORY", value)
        alloc = CuMemAllocator()
        t = new_tag()
        with alloc.use_memory_pool(tag=t):
            w = torch.full((16 * MIB,), 7, dtype=torch.uint8, device="cuda")
        assert p.info(t).medium == ("pinned" if kept else "host")
        alloc.sleep(offload_tags=(t,))
        assert p.region_stats(t).backup_bytes >= w.nbytes
        alloc.wake_up()
        assert int((w == 7).sum()) == w.numel()
        backup = p.region_stats(t).backup_bytes
        assert backup >= w.nbytes if kept else backup == 0, (value, backup)


def test_vllm_pointer_to_data_follows_the_mappings(new_tag: Callable[[], str]) -> None:
    """``pointer_to_data`` as vLLM's own tests read it: one record per segment with its tag
    and size, mapped bytes (the records not asleep) following discard, sleep and wake."""
    alloc = CuMemAllocator()
    w, kv = new_tag(), new_tag()
    with alloc.use_memory_pool(tag=w):
        a = torch.ones(16 * MIB, dtype=torch.uint8, device="cuda")
    with alloc.use_memory_pool(tag=kv):
        b = torch.ones(32 * MIB, dtype=torch.uint8, device="cuda")

    def mapped() -> int:
        return sum(d.handle[1] for d in alloc.pointer_to_data.values() if not d.is_asleep)

    records = alloc.pointer_to_data
    assert {d.tag for d in records.values()} == {w, kv}
    assert {a.data_ptr(), b.data_ptr()} <= set(records)
    assert mapped() == a.nbytes + b.nbytes == alloc.get_current_usage()
    alloc.discard(kv)
    assert mapped() == a.nbytes
    alloc.sleep(offload_tags=(w,))
    assert mapped() == 0
    alloc.wake_up()
    assert mapped() == a.nbytes + b.nbytes
    assert int(a.sum()) == a.numel()


def test_vllm_sleep_mode_backend_cycle() -> None:
    """The ``gpu_pager`` sleep-mode backend as vLLM 0.34's worker drives it (through vLLM's
    registry: the stand-in package): a level-1 ``suspend(set())`` keeps the weights (an
    earlier backend read the set as level 2 and dropped them), a weights-only wake, then
    the KV cache; ``discard`` (``release_kv_cache_memory``) drops the KV cache alone."""
    code = """
        import torch
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        from vllm.device_allocator.sleep_mode_backend import SleepModeBackendFactory
        from gpu_pager.compat.vllm import get_mem_allocator_instance
        import gpu_pager.torch as gpt
        a = get_mem_allocator_instance()
        with a.use_memory_pool(tag="weights"):
            w = torch.full((1 << 20,), 5.0, device="cuda")
        with a.use_memory_pool(tag="kv_cache"):
            kv = torch.full((1 << 20,), 3.0, device="cuda")
        b = SleepModeBackendFactory.get_backend_class("gpu_pager")()
        b.suspend(set())
        assert b.state() == "SUSPENDED"
        b.resume(["weights"])
        assert float(w.sum()) == 5.0 * (1 << 20)
        assert gpt.pager().info("kv_cache").state.value == "released"
        b.resume(["kv_cache"])
        assert b.state() == "RUNNING" and float(kv.abs().sum()) == 0.0
        kv.fill_(2)
        b.discard(("kv_cache",))
        assert gpt.pager().info("kv_cache").state.value == "released"
        assert gpt.pager().info("weights").state.value == "resident"
        b.resume(None)
        assert float(w.sum()) == 5.0 * (1 << 20) and float(kv.abs().sum()) == 0.0
        print("ok")
    """
    done = run_vllm_standin(code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def run_vllm_standin(code: str) -> Any:
    """``run_python`` with the vLLM stand-in (0.34's protocol) importable and the vLLM
    drop-in switched on."""
    standin = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_standin")
    return run_python(
        code,
        PYTHONPATH=standin + os.pathsep + os.environ.get("PYTHONPATH", ""),
        GPU_PAGER_DROP_IN="vllm",
    )


def test_vllm_0_34_discardable_leaves_out_only_the_rewritten_tensors() -> None:
    """vLLM 0.34's level 2: ``sleep(offload_tags, discardable)`` as its default backend
    calls it (positionally; an earlier allocator raised ``TypeError``), with the storages
    that the weight update rewrites. Every other tensor of the weights (a preserved
    parameter, a drafter's, a buffer), also one that shares a torch segment with a
    discardable one, comes back bit-exact (an earlier backend dropped them all); the memory
    is freed; and the next level-1 sleep backs everything up again."""
    code = """
        import torch
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        from vllm.device_allocator import get_mem_allocator_instance
        a = get_mem_allocator_instance()
        with a.use_memory_pool(tag="weights"):
            # 1 MiB tensors: torch puts several in one 20 MiB segment.
            rewritten = [torch.full((1 << 18,), float(i), device="cuda") for i in range(6)]
            kept = [torch.full((1 << 18,), 100.0 + i, device="cuda") for i in range(6)]
            big = torch.full((64 << 18,), 7.0, device="cuda")
        keep = [t.clone().cpu() for t in kept]
        torch.cuda.synchronize()
        free = torch.cuda.mem_get_info()[0]
        a.sleep(("weights", "runtime", "cudagraph"), {t.untyped_storage().data_ptr() for t in rewritten})
        assert torch.cuda.mem_get_info()[0] - free >= 70 << 20, "the weights were not freed"
        a.wake_up(None)
        for t, k in zip(kept, keep):
            assert torch.equal(t.cpu(), k), "a tensor outside discardable was not kept"
        assert float(big.min()) == 7.0 and float(big.max()) == 7.0
        for t in rewritten:
            t.fill_(-1.0)  # the weight update
        a.sleep(("weights", "runtime", "cudagraph"), set())
        a.wake_up(["weights"])
        assert all(float(t.min()) == -1.0 and float(t.max()) == -1.0 for t in rewritten)
        print("ok")
    """
    done = run_vllm_standin(code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_resume_on_a_torch_stream(tag: str) -> None:
    # A 4 MiB tensor comes from a 20 MiB segment (torch rounds 1–10 MiB requests up).
    with gpt.region(tag, "preserve", bytes=64 * MIB):
        x = torch.full((1 << 20,), 9.0, device="cuda")
    gpt.release(tag)
    stream = torch.cuda.Stream()
    gpt.pager().resume_on(tag, stream)
    with torch.cuda.stream(stream):
        total = x.sum()
    stream.synchronize()
    assert float(total) == 9.0 * (1 << 20)


def test_use_grows_and_gives_memory_back(pager: gpu_pager.Pager, tag: str) -> None:
    with gpt.use(tag) as info:  # no bytes: a growing region
        x = torch.empty(64 * MIB, dtype=torch.uint8, device="cuda")
    assert info.kind == "growing"
    assert pager.region_stats(tag).resident_bytes >= 64 * MIB
    assert gpt.locate(x) == (tag, x.data_ptr() - info.base)
    before = torch.cuda.mem_get_info()[0]
    del x
    torch.cuda.empty_cache()  # torch keeps a live pool's segments
    assert pager.region_stats(tag).resident_bytes >= 64 * MIB
    gpt.empty_cache(tag)  # drops the pool: torch frees the segment, the region unmaps it
    assert pager.region_stats(tag).resident_bytes == 0
    assert pager.region_stats(tag).buffers == 0
    assert torch.cuda.mem_get_info()[0] - before >= 64 * MIB
    with gpt.use(tag):  # a new pool
        y = torch.empty(4 * MIB, dtype=torch.uint8, device="cuda")
    assert gpt.locate(y) is not None


def test_disable_allocates_outside(tag: str) -> None:
    with gpt.use(tag):
        inside = torch.empty(1 << 20, device="cuda")
        with gpt.disable():
            outside = torch.empty(1 << 20, device="cuda")
        again = torch.empty(1 << 20, device="cuda")
    assert gpt.locate(inside) is not None and gpt.locate(again) is not None
    assert gpt.locate(outside) is None
    assert gpt.current_tag(torch.cuda.current_device()) is None


def test_graph_memory_lives_in_its_tag(new_tag: Callable[[], str]) -> None:
    weights, graph_tag = new_tag(), new_tag()
    with gpt.use(weights):
        w = torch.randn(1 << 20, device="cuda")
    static_in = torch.randn(1 << 20, device="cuda")
    g = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        (static_in * w).sum()  # warm-up
    torch.cuda.current_stream().wait_stream(side)
    with gpt.graph(g, graph_tag):
        out = (static_in * w + 1).sum()
    where = gpt.locate(out)
    assert where is not None and where[0] == graph_tag
    g.replay()
    want = out.clone()
    gpt.release([weights, graph_tag])
    gpt.resume([weights, graph_tag])
    g.replay()
    assert torch.equal(out, want)


def test_pager_mediated_tensor_access(tag: str) -> None:
    with gpt.use(tag):
        x = torch.zeros(1 << 20, device="cuda")
    gpt.write(x, torch.full((1 << 20,), 3.0))
    assert float(gpt.read(x).sum()) == 3.0 * (1 << 20)
    gpt.release(tag)
    with pytest.raises(gpu_pager.NotResidentError) as e:
        gpt.write(x, torch.ones(1 << 20))
    assert e.value.tag == tag
    with pytest.raises(gpu_pager.NotResidentError):
        gpt.read(x)
    gpt.resume(tag)
    assert float(gpt.read(x).sum()) == 3.0 * (1 << 20)
    with pytest.raises(ValueError):
        gpt.read(torch.zeros(4, device="cuda"))


def test_interpreter_exit_is_clean() -> None:
    """Pools, segments and a released region at exit: no abort (torch once aborted with
    "Trying to free a pointer not allocated here" when the allocator died first)."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(
        """
        import torch, gpu_pager.torch as gpt
        with gpt.use("a"):
            x = torch.ones(8 << 20, device="cuda")
        with gpt.use("b", "discard"):
            y = torch.ones(8 << 20, device="cuda")
        del y
        gpt.release("b")
        print("ok")
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
    assert "Trying to free" not in done.stderr


def test_get_cpu_backup_while_paused(new_tag: Callable[[], str]) -> None:
    tms = TorchMemorySaver()
    tms.hook_mode = "torch"
    w = new_tag()
    with tms.region(w, enable_cpu_backup=True):
        x = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
    assert tms.get_cpu_backup(x) is None  # resident: no backup to read
    tms.pause(w)
    got = tms.get_cpu_backup(x)
    assert got is not None and got.device.type == "cpu" and got.dtype == x.dtype
    assert torch.equal(got, torch.arange(1 << 20, dtype=torch.float32))
    tms.resume(w)
    assert tms.get_cpu_backup(x) is None


def test_marked_tensors_are_not_restored(tag: str) -> None:
    with gpt.use(tag):
        param = torch.full((4 << 20,), 1.0, device="cuda")  # 16 MiB
        buffer = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
    assert gpt.mark_overwritten(param) == 16 * MIB
    found = gpt.pager().buffer_containing(buffer.data_ptr())
    assert found is not None
    report = gpt.release(tag)
    # The buffer's segment is saved; of the parameter's, at most what shares a 1 MiB gap.
    assert report.region(tag).copied <= found[0].nbytes + MIB  # type: ignore[union-attr]
    assert gpt.read_backup(param) is None  # not in the backup
    assert torch.equal(gpt.read_backup(buffer), torch.arange(1 << 20, dtype=torch.float32))
    gpt.resume(tag)
    assert torch.equal(gpt.read(buffer), torch.arange(1 << 20, dtype=torch.float32))
    param.fill_(2.0)  # the update
    assert float(param.sum()) == 2.0 * (4 << 20)


def test_empty_cache_with_live_tensors_keeps_them(tag: str) -> None:
    """``empty_cache(tag)`` while tensors live in the tag: they stay, intact; their memory
    goes back once they die, at the next ``torch.cuda.empty_cache()``."""
    with gpt.use(tag):
        x = torch.full((4 * MIB,), 7, dtype=torch.uint8, device="cuda")
    gpt.empty_cache(tag)
    assert int(x.sum()) == 7 * 4 * MIB
    assert gpt.pager().region_stats(tag).buffers == 1
    del x
    torch.cuda.empty_cache()
    assert gpt.pager().region_stats(tag).buffers == 0


def test_a_quantized_model_holds_only_its_fp8_bytes(pager: gpu_pager.Pager, tag: str) -> None:
    """The fp8 online-quantization path: a bf16 model built inside ``use``, quantized, the
    bf16 tensors freed. After the block the region maps the fp8 bytes only (and the device
    has the rest back); a release copies only those, and they come back bit-exact."""
    torch.cuda.synchronize()
    free_before = torch.cuda.mem_get_info()[0]
    with gpt.use(tag):
        bf16 = [torch.empty(64 * MIB, dtype=torch.bfloat16, device="cuda").normal_() for _ in range(4)]
        fp8 = [w.to(torch.float8_e4m3fn) for w in bf16]
        del bf16
    live = sum(w.nbytes for w in fp8)
    assert pager.region_stats(tag).resident_bytes == live
    assert free_before - torch.cuda.mem_get_info()[0] < live + 64 * MIB
    expect = [w.view(torch.uint8).cpu() for w in fp8]
    report = gpt.release(tag)
    assert report.bytes == live
    gpt.resume(tag)
    for w, e in zip(fp8, expect):
        assert torch.equal(w.view(torch.uint8).cpu(), e)


def test_freeing_inside_nested_tags_and_disable_never_aborts() -> None:
    """Memory freed inside a tag nested in another goes back at the inner block's exit;
    ``disable()`` inside both drop-ins' regions in torch hook mode, nested, and with the
    tag's pool retired inside the block: no abort (each case runs in its own process)."""
    done = run_python("""
        import torch
        import gpu_pager.torch as gpt
        from gpu_pager.compat.torch_memory_saver import torch_memory_saver as tms
        MIB = 1 << 20
        with gpt.use("outer-a"):
            a = torch.empty(8 * MIB, dtype=torch.uint8, device="cuda")
            with gpt.use("inner-b"):
                # Over 10 MiB: torch gives each its own segment of its size.
                b = torch.empty(16 * MIB, dtype=torch.uint8, device="cuda")
                gone = torch.empty(32 * MIB, dtype=torch.uint8, device="cuda")
                del gone
            held = gpt.pager().region_stats("inner-b").resident_bytes
            assert held == 16 * MIB, held
            with gpt.disable():
                plain = torch.empty(8 * MIB, dtype=torch.uint8, device="cuda")
                with gpt.disable():
                    pass
                with gpt.use("outer-a"):
                    c = torch.empty(2 * MIB, dtype=torch.uint8, device="cuda")
        assert gpt.locate(plain) is None and gpt.locate(c) is not None
        tms.hook_mode = "torch"
        with tms.region(tag="w", enable_cpu_backup=True):
            with tms.disable():
                x = torch.empty(8 * MIB, dtype=torch.uint8, device="cuda")
                with tms.disable():
                    y = torch.empty(8 * MIB, dtype=torch.uint8, device="cuda")
            w = torch.ones(8 * MIB, dtype=torch.uint8, device="cuda")
        del x, y
        torch.cuda.empty_cache()
        tms.pause("w")
        tms.resume("w")
        assert int(w.sum()) == 8 * MIB
        print("done")
    """)
    assert done.returncode == 0 and done.stdout.strip().endswith("done"), done.stderr[-3000:]


def test_parameters_are_written_through_the_pager(tag: str) -> None:
    with gpt.use(tag):
        lin = torch.nn.Linear(64, 64, device="cuda")
    gpt.write(lin.weight, torch.ones(64, 64))  # a leaf that requires grad
    assert float(gpt.read(lin.weight).sum()) == 64 * 64


def test_partly_used_segments_do_not_make_a_tag_grow_step_after_step(
    pager: gpu_pager.Pager, tag: str
) -> None:
    """Each step inside ``use`` keeps one 4 MiB tensor (torch splits a 20 MiB segment for
    it and for a 4 MiB tensor freed in the same step) and frees a 64 MiB one (a whole
    segment with nothing left in it, which ``use`` gives back at its exit). Retiring the
    pool every time strands the split segments' free room, a segment more per step: the
    tag's excess over its live bytes must stop growing instead."""
    kept, excess = [], []
    for _ in range(40):
        with gpt.use(tag):
            scratch = torch.empty(4 * MIB, dtype=torch.uint8, device="cuda")
            kept.append(torch.empty(4 * MIB, dtype=torch.uint8, device="cuda"))
            big = torch.empty(64 * MIB, dtype=torch.uint8, device="cuda")
            del scratch, big
        excess.append(pager.region_stats(tag).resident_bytes - sum(t.nbytes for t in kept))
    assert excess[-1] <= excess[19] + 20 * MIB, [e // MIB for e in excess]
    assert max(excess) <= 200 * MIB, [e // MIB for e in excess]


def test_use_entered_during_a_real_capture_leaves_the_capture_valid(
    new_tag: Callable[[], str],
) -> None:
    """A tag with a whole free segment (which ``use`` gives back outside a capture) entered
    while torch captures a CUDA graph: the capture must not be broken by a synchronization,
    the graph replays, and the next entry outside the capture gives the segment back."""
    tag, graph_tag = new_tag(), new_tag()
    pager = gpt.pager()
    with gpt.use(tag):
        kept = torch.ones(1 << 20, device="cuda")
    with gpt.use(tag):
        big = torch.empty(64 * MIB, dtype=torch.uint8, device="cuda")
    del big
    before = pager.region_stats(tag).resident_bytes
    graph = torch.cuda.CUDAGraph()
    with gpt.graph(graph, graph_tag):
        with gpt.use(tag):
            pass
        out = kept * 2
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, kept * 2)
    with gpt.use(tag):
        pass
    assert pager.region_stats(tag).resident_bytes <= before - 64 * MIB
