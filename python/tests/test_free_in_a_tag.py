"""Memory freed inside a tag goes back to the device, and ``disable()`` never aborts, on the
host backend with a stand-in for torch's pools (``torch_standin``: torch's use counts and
its aborts, gpu_pager's real allocator hooks). The same cases run with torch on the GPU in
``test_torch_cuda.py`` and vLLM's own suite."""

from __future__ import annotations

import json
import os
import textwrap

from fresh import run_python

HERE = os.path.dirname(os.path.abspath(__file__))
MIB = 1 << 20

PRELUDE = """
    import json, sys
    import torch_standin
    torch = torch_standin.install()
    import gpu_pager
    import gpu_pager.torch as gpt
    MIB = 1 << 20
    pager = gpu_pager.Pager.for_device(0)

    def held(tag):
        return pager.region_stats(tag).allocated_bytes

    def backed_up(tag):
        # Releases and resumes tag; returns the bytes its backup held meanwhile.
        gpt.release(tag)
        backup = pager.region_stats(tag).backup_bytes
        gpt.resume(tag)
        return backup
"""


def run(code: str) -> dict[str, object]:
    """Runs ``PRELUDE + code`` in a fresh interpreter; returns the JSON it prints last."""
    source = textwrap.dedent(PRELUDE) + textwrap.dedent(code)
    done = run_python(source, PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_a_model_quantized_inside_a_tag_holds_only_its_live_bytes() -> None:
    """The fp8 online-quantization path: bf16 weights built inside ``use``, fp8 ones made
    from them, the bf16 ones freed. After the block the region holds the fp8 bytes, and a
    release backs up only those."""
    out = run("""
        with gpt.use("weights"):
            bf16 = [torch.empty(8 * MIB) for _ in range(4)]
            fp8 = [torch.empty(4 * MIB) for _ in range(4)]
            inside = held("weights")
            del bf16
        after = held("weights")
        backup = backed_up("weights")
        print(json.dumps(dict(inside=inside, after=after, backup=backup,
                              aborts=torch_standin.ABORTS)))
    """)
    assert out == dict(inside=48 * MIB, after=16 * MIB, backup=16 * MIB, aborts=[])


def test_a_tensor_freed_between_entries_goes_back_at_the_next_entry() -> None:
    """vLLM's re-entered tag: X dies after the second entry; the third entry gives its
    memory back, and Y (in the same pool as X) stays, counted and backed up."""
    out = run("""
        with gpt.use("t"):
            xs = [torch.empty(64 * MIB)]
        with gpt.use("t"):
            y = torch.empty(64 * MIB)
        before = held("t")
        xs.clear()
        with gpt.use("t"):
            pass
        after = held("t")
        backup = backed_up("t")
        print(json.dumps(dict(before=before, after=after, backup=backup,
                              aborts=torch_standin.ABORTS)))
    """)
    assert out == dict(before=128 * MIB, after=64 * MIB, backup=64 * MIB, aborts=[])


def test_the_vllm_drop_in_counts_and_releases_only_live_segments() -> None:
    """Through ``gpu_pager.compat.vllm``: ``pointer_to_data`` (what vLLM's tests sum) counts
    Y alone after X died, including Y's retired pool, and a sleep/wake keeps that."""
    out = run("""
        from gpu_pager.compat import vllm
        a = vllm.get_mem_allocator_instance()
        def mapped():
            return sum(d.handle[1] for d in a.pointer_to_data.values() if not d.is_asleep)
        with a.use_memory_pool("t"):
            xs = [torch.empty(64 * MIB)]
        with a.use_memory_pool("t"):
            y = torch.empty(64 * MIB)
        xs.clear()
        with a.use_memory_pool("t"):
            pass
        first = mapped()
        a.sleep(offload_tags="t")
        asleep = mapped()
        a.wake_up()
        print(json.dumps(dict(first=first, asleep=asleep, woken=mapped(),
                              region=held("t"), aborts=torch_standin.ABORTS)))
    """)
    assert out == dict(first=64 * MIB, asleep=0, woken=64 * MIB, region=64 * MIB, aborts=[])


def test_graph_pools_keep_their_free_segments() -> None:
    """A pool that graphs are captured into keeps what was freed in it (a replay may read
    state there), in gpu_pager.torch and in the vLLM drop-in's graph tags."""
    out = run("""
        from gpu_pager.compat import vllm
        gpt.graph_pool("g")
        with gpt.use("g"):
            t = torch.empty(8 * MIB)
            del t
        ours = held("g")
        a = vllm.get_mem_allocator_instance()
        with a.use_memory_pool("cudagraph"):
            t = torch.empty(8 * MIB)
            del t
        print(json.dumps(dict(ours=ours, vllms=held("cudagraph"),
                              kept="cudagraph" in vllm.KEPT_TAGS, aborts=torch_standin.ABORTS)))
    """)
    assert out == dict(ours=8 * MIB, vllms=8 * MIB, kept=True, aborts=[])


def test_disable_never_aborts_even_when_the_tag_s_pool_is_retired_inside() -> None:
    """``disable()`` inside ``use``, nested, and with the tag's pool retired inside the block
    (the tag entered again there): torch's use counts never go wrong (each would abort the
    process), and what the block allocated is ordinary memory."""
    out = run("""
        with gpt.use("w"):
            with gpt.disable():
                plain = torch.empty(4 * MIB)
                with gpt.disable():
                    pass
            t = torch.empty(8 * MIB)
            del t  # an unused segment: the next entry retires the pool
            with gpt.disable():
                with gpt.use("w"):
                    kept = torch.empty(2 * MIB)
            after = torch.empty(2 * MIB)
        print(json.dumps(dict(plain=plain.data_ptr(), region=held("w"),
                              aborts=torch_standin.ABORTS)))
    """)
    assert out == dict(plain=0, region=4 * MIB, aborts=[])


def test_the_torch_memory_saver_drop_in_s_disable_in_torch_mode_never_aborts() -> None:
    """torch_memory_saver's documented ``disable()`` inside ``region()`` in torch hook mode
    (the real torch_memory_saver 0.0.10 aborts there on torch 2.11): no abort, and memory
    freed inside regions goes back at their exit and at a pause."""
    out = run("""
        from gpu_pager.compat.torch_memory_saver import torch_memory_saver as tms
        tms.hook_mode = "torch"
        with tms.region(tag="w", enable_cpu_backup=True):
            with tms.disable():
                plain = torch.empty(4 * MIB)
                with tms.disable():  # nested: ordinary already, not an error
                    inner = torch.empty(4 * MIB)
            w = torch.empty(8 * MIB)
            gone = torch.empty(8 * MIB)
            del gone
        after_region = held("w")
        with tms.region(tag="w", enable_cpu_backup=True):
            late = torch.empty(8 * MIB)
        del late
        tms.pause("w")
        backup = pager.region_stats("w").backup_bytes
        tms.resume("w")
        print(json.dumps(dict(after_region=after_region, backup=backup,
                              aborts=torch_standin.ABORTS)))
    """)
    assert out == dict(after_region=8 * MIB, backup=8 * MIB, aborts=[])


def test_use_entered_during_a_graph_capture_does_not_synchronize() -> None:
    """A capture forbids synchronizing: ``use`` entered while the stream captures (a graph
    captured into a tag) leaves trimming for later instead of failing the capture; the
    next entry outside the capture gives the freed memory back."""
    out = run("""
        with gpt.use("cap"):
            xs = [torch.empty(64 * MIB)]
        with gpt.use("cap"):
            y = torch.empty(64 * MIB)
        xs.clear()
        torch_standin.CAPTURING[0] = True
        with gpt.use("cap"):
            during = held("cap")
        torch_standin.CAPTURING[0] = False
        with gpt.use("cap"):
            pass
        print(json.dumps(dict(during=during, after=held("cap"))))
    """)
    assert out == dict(during=128 * MIB, after=64 * MIB)


def test_a_tag_that_keeps_a_tensor_each_step_does_not_grow_step_after_step() -> None:
    """Each step inside ``use`` keeps one 4 MiB tensor (a block of a shared 20 MiB segment,
    beside a 4 MiB scratch tensor freed in the same step) and frees a 64 MiB one (a whole
    segment left unused, which ``use`` gives back). Retiring the pool each time would strand
    the shared segments' free room, a segment more per step; the tag's excess over its
    live bytes must stop growing instead."""
    out = run("""
        kept, excess = [], []
        for step in range(40):
            with gpt.use("steps"):
                scratch = torch.empty(4 * MIB, shared=True)
                kept.append(torch.empty(4 * MIB, shared=True))
                big = torch.empty(64 * MIB)
                del scratch, big
            excess.append(pager.region_stats("steps").resident_bytes - 4 * MIB * len(kept))
        print(json.dumps(dict(excess=excess, aborts=torch_standin.ABORTS)))
    """)
    excess = out["excess"]
    assert isinstance(excess, list)
    assert out["aborts"] == []
    assert excess[-1] <= excess[19] + 20 * MIB, excess
    assert max(excess) <= 200 * MIB, excess
