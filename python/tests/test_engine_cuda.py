"""A real torch model through the multi-stage wake-up: a transformers Llama with random
weights (0.3 GB and 3.4 GB), its static KV cache in its own tag and a decode step captured
in a CUDA graph, through gpu_pager.torch and through both compat modules. Needs torch,
transformers and a CUDA GPU (skipped otherwise, with the reason)."""

from __future__ import annotations


import os
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import pytest

import gpu_pager

torch: Any = pytest.importorskip("torch", reason="torch is not installed")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False)", allow_module_level=True)
pytest.importorskip("transformers", reason="transformers is not installed")

import gpu_pager.torch as gpt  # noqa: E402
from torch_tags import new_tag, tag  # noqa: E402, F401  (fixtures)
from gpu_pager.compat.torch_memory_saver import TorchMemorySaver  # noqa: E402
from gpu_pager.compat.vllm import CuMemAllocator  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from engine import Engine, Placement, gpt_placement, trainer_pass  # noqa: E402

MIB = 1 << 20
CYCLES = 3


def free_bytes() -> int:
    torch.cuda.synchronize()
    return int(torch.cuda.mem_get_info()[0])


def assert_rose_by(before: int, released: int) -> None:
    """Free device memory rose by what was released (within 64 MiB of driver noise)."""
    rise = free_bytes() - before
    assert abs(rise - released) <= 64 * MIB, f"free memory rose by {rise}, released {released}"


@pytest.fixture
def tags(new_tag: Callable[[], str]) -> dict[str, str]:
    """Fresh tags for the engine's three kinds of memory. Regions of earlier tests stay
    (torch never frees their segments), so each test uses new ones."""
    return {"weights": new_tag(), "kv": new_tag(), "graph": new_tag()}


def _check_cycle(engine: Engine, want: Any, addresses: dict[str, int]) -> None:
    got = engine.step()
    assert engine.addresses() == addresses, "a tensor moved"
    for g, w in zip(got, want):
        assert torch.equal(g, w), "logits differ from the run before the release"


def _cycles(
    engine: Engine,
    release_all: Callable[[], int],
    resume_weights: Callable[[], object],
    resume_rest: Callable[[], None],
) -> None:
    """The seed's multi-stage wake-up, CYCLES times: release everything (free memory rises
    by what was released), the trainer allocates most of the GPU and frees it, resume the
    weights, update them in place, resume the KV cache and the graph; then the logits are
    bit-exact, no tensor moved and the graph replays."""
    want = engine.step()
    addresses = engine.addresses()
    new_weights = engine.snapshot_parameters()
    for _ in range(CYCLES):
        before = free_bytes()
        released = release_all()
        assert released > engine.weight_bytes()
        assert_rose_by(before, released)
        trainer_pass()
        resume_weights()
        engine.update(new_weights)
        resume_rest()
        _check_cycle(engine, want, addresses)


@pytest.mark.parametrize("size", ["small", "large"])
def test_llama_multi_stage_wake_up(size: str, tags: dict[str, str]) -> None:
    w, kv, g = tags["weights"], tags["kv"], tags["graph"]
    engine = Engine(size, gpt_placement(tags))
    for name, t in engine.tensors().items():
        where = gpt.locate(t)
        want = w if name.startswith(("param", "buffer")) else kv
        assert where is not None and where[0] == want, name
    assert gpt.locate(engine.logits) is not None and gpt.locate(engine.logits)[0] == g  # type: ignore[index]
    assert gpt.locate(engine.token) is None  # ordinary torch memory

    def release_all() -> int:
        return gpt.release([kv, w, g]).bytes

    def resume_weights() -> None:
        gpt.resume(w)

    def resume_rest() -> None:
        gpt.resume([kv, g])

    _cycles(engine, release_all, resume_weights, resume_rest)


def test_update_aware_wake_up_keeps_the_buffers(tags: dict[str, str]) -> None:
    """Every parameter marked overwritten: the release copies (almost) nothing, the resume
    restores nothing, the update writes the parameters, and the rotary buffers, which are
    not parameters, come back bit-exact: the logits match."""
    w, kv, g = tags["weights"], tags["kv"], tags["graph"]
    engine = Engine(
        "small",
        gpt_placement(tags),
    )
    marked = gpt.mark_parameters(engine.model)
    assert marked == engine.weight_bytes()
    want = engine.step()
    addresses = engine.addresses()
    new = engine.snapshot_parameters()
    inv_freq = engine.model.model.rotary_emb.inv_freq.detach().cpu()
    for _ in range(CYCLES):
        report = gpt.release([kv, w, g])
        copied = report.region(w).copied  # type: ignore[union-attr]
        # What is copied: the buffers, and the free space inside torch's segments (torch's
        # free blocks are not marked: gpu_pager cannot see them).
        assert copied < engine.weight_bytes() // 4, f"{copied} bytes copied, all marked"
        trainer_pass()
        gpt.resume(w)
        assert torch.equal(gpt.read(engine.model.model.rotary_emb.inv_freq), inv_freq)
        engine.update(new)
        gpt.resume([kv, g])
        _check_cycle(engine, want, addresses)
    gpt.mark_parameters(engine.model, on=False)
    report = gpt.release(w)
    assert report.region(w).copied >= engine.weight_bytes()  # type: ignore[union-attr]
    gpt.resume(w)
    _check_cycle(engine, want, addresses)


def test_skipped_stage_is_an_error_not_a_fault(tags: dict[str, str]) -> None:
    w, kv, g = tags["weights"], tags["kv"], tags["graph"]
    engine = Engine(
        "small",
        gpt_placement(tags),
    )
    want = engine.step()
    addresses = engine.addresses()
    new = engine.snapshot_parameters()
    gpt.release([kv, w, g])
    gpt.resume([kv, g])  # the weights' resume is skipped (verl PR 2365's path)
    param = engine.parameters()[0]
    with pytest.raises(gpu_pager.NotResidentError) as e:
        gpt.write(param, new[0].cuda())  # the update, through the pager
    assert e.value.tag == w
    with pytest.raises(gpu_pager.NotResidentError):
        gpt.read(engine.model.model.rotary_emb.inv_freq)
    with pytest.raises(gpu_pager.NotResidentError):
        gpt.lease(w)
    # Nothing was lost: resume and go on.
    gpt.resume(w)
    for p, v in zip(engine.parameters(), new):
        gpt.write(p, v)
    assert torch.equal(gpt.read(param), new[0])
    with gpt.lease([w, kv, g]):  # kernels run while the tags are leased
        with pytest.raises(gpu_pager.BusyError):
            gpt.release(w)
        _check_cycle(engine, want, addresses)


def test_raw_kernel_on_a_released_tag_faults() -> None:
    """Documented, not prevented: a raw kernel on a released tag's tensor touches unmapped
    memory and CUDA reports it (in a subprocess: the context is unusable afterwards)."""
    code = textwrap.dedent(
        """
        import torch, gpu_pager.torch as gpt
        with gpt.use("raw", "discard"):
            x = torch.ones(1 << 20, device="cuda")
        gpt.release("raw")
        try:
            x.add_(1)
            torch.cuda.synchronize()
            print("no fault")
        except Exception as e:
            print("fault:", e)
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    out = done.stdout + done.stderr
    assert "fault:" in out and "illegal" in out.lower(), out


def test_torch_memory_saver_compat_scenario(tags: dict[str, str]) -> None:
    """The same scenario written against torch_memory_saver's API."""
    tms = TorchMemorySaver()
    tms.hook_mode = "torch"
    w, kv, g = tags["weights"], tags["kv"], tags["graph"]
    engine = Engine(
        "small",
        Placement(
            weights=lambda: tms.region(w, enable_cpu_backup=True),
            kv=lambda: tms.region(kv),
            graph=lambda cg: tms.cuda_graph(cg, tag=g),
        ),
    )

    def release_all() -> int:
        p = gpt.pager()
        before = p.stats().resident_bytes
        tms.pause(kv)
        tms.pause(w)
        tms.pause(g)
        tms.pause(w)  # twice: nothing (torch_memory_saver exits here)
        return before - p.stats().resident_bytes

    def resume_rest() -> None:
        tms.resume(kv)
        tms.resume(g)
        tms.resume(g)  # twice: nothing

    _cycles(engine, release_all, lambda: tms.resume(w), resume_rest)


def test_vllm_compat_scenario(tags: dict[str, str]) -> None:
    """The same scenario written against vLLM's CuMemAllocator (level-1 sleep: the weights
    are offloaded, the KV cache discarded; vLLM keeps its graphs' memory)."""
    alloc = CuMemAllocator()
    w, kv = tags["weights"], tags["kv"]

    def pool(tag: str) -> AbstractContextManager[Any]:
        return alloc.use_memory_pool(tag=tag)

    engine = Engine(
        "small",
        Placement(weights=lambda: pool(w), kv=lambda: pool(kv), graph=lambda cg: torch.cuda.graph(cg)),
    )
    assert alloc.get_current_usage() >= engine.weight_bytes()

    def release_all() -> int:
        p = gpt.pager()
        before = p.stats().resident_bytes
        alloc.sleep(offload_tags=(w,))
        alloc.sleep(offload_tags=(w,))  # twice: nothing
        return before - p.stats().resident_bytes

    _cycles(
        engine,
        release_all,
        lambda: alloc.wake_up(tags=[w]),
        lambda: alloc.wake_up(tags=[kv]),
    )


def test_two_processes_share_the_gpu() -> None:
    """Two engines in two processes on one GPU, each with its own pager, cycling at the
    same time: neither disturbs the other."""
    script = os.path.join(os.path.dirname(__file__), "engine.py")
    env = dict(os.environ, GPU_PAGER_TRAINER_FRACTION="0.2")
    procs = [
        subprocess.Popen(
            [sys.executable, script, "small", "5"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out
        assert out.count("logits bit-exact True, addresses unchanged True") == 5, out


def test_torchrun_one_rank_per_gpu() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs for one rank per GPU; this machine has {torch.cuda.device_count()}")
    script = os.path.join(os.path.dirname(__file__), "engine.py")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={torch.cuda.device_count()}",
            script,
            "small",
            "3",
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_vllm_sleep_sequence_on_a_real_model() -> None:
    """vLLM's sleep sequence through the drop-in, in a process of its own (vLLM's fixed tag
    names): level 1, level 2, discard of the KV cache, and an out-of-memory wake-up that
    raises a RuntimeError and then succeeds; each ends with logits equal to the run that
    never slept (``vllm_sequence.py`` checks and says which step failed)."""
    script = os.path.join(os.path.dirname(__file__), "vllm_sequence.py")
    done = subprocess.run(
        [sys.executable, script, "large"], capture_output=True, text=True, timeout=600
    )
    out = done.stdout + done.stderr[-3000:]
    assert done.returncode == 0, out
    for step in ("level 1", "level 2", "discard kv_cache", "out of memory", "retry"):
        assert f'"step": "{step}"' in done.stdout, out


POISONED = """
import os, sys
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
import torch
torch.use_deterministic_algorithms(True, warn_only=True)
sys.path.insert(0, {tests!r})
import gpu_pager
import gpu_pager.torch as gpt
from engine import Engine, gpt_placement

tags = dict(weights="w", kv="kv", graph="g")
engine = Engine("small", gpt_placement(tags))
print("poison", gpt.pager().config.poison_discards)
want = engine.step()
gpt.release(["kv", "w", "g"])
gpt.resume("w")
gpt.resume(["kv", "g"])
got = engine.step()  # the normal sequence: the cache reset and refilled before it is read
print("same", all(torch.equal(a, b) for a, b in zip(got, want)))
gpt.release("kv")
gpt.resume("kv")
engine.graph.replay()  # a decode that reads the discarded cache before anything writes it
torch.cuda.synchronize()
print("nan", bool(torch.isnan(engine.logits).any()))
"""


@pytest.mark.parametrize("poison", [True, False])
def test_poisoned_discards_turn_a_stale_kv_read_into_nan_logits(poison: bool) -> None:
    """With ``GPU_PAGER_POISON_DISCARDS=1`` a decode step that reads the KV cache after a
    wake-up, before a prefill wrote it, gives NaN logits; the normal sequence gives the same
    logits as before the cycle, with the option on or off."""
    env = {**os.environ, "GPU_PAGER_POISON_DISCARDS": "1" if poison else ""}
    code = POISONED.format(tests=os.path.dirname(__file__))
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.split()
    assert lines[:4] == ["poison", str(poison), "same", "True"], done.stdout
    if poison:
        assert lines[4:] == ["nan", "True"], done.stdout


AUDITED = """
import logging, sys
import torch
sys.path.insert(0, {tests!r})
import gpu_pager.torch as gpt
from engine import Engine, gpt_placement

seen = []
class Keep(logging.Handler):
    def emit(self, record):
        seen.append(record.getMessage())
logging.getLogger("gpu_pager").addHandler(Keep())
torch.cuda.memory._record_memory_history(max_entries=100000)
def forgotten_buffer():
    return torch.empty(5 << 30, dtype=torch.uint8, device="cuda")
tags = dict(weights="w", kv="kv", graph="g")
engine = Engine("small", gpt_placement(tags))
want = engine.step()
leftover = forgotten_buffer()
gpt.release(["kv", "w", "g"])
a = gpt.audit()
big = a.outside_tags[0]
print(big.bytes >= 5 << 30, "forgotten_buffer" in (big.site or ""))
warned = [m for m in seen if "still in use" in m]
print(len(warned), "forgotten_buffer" in warned[0] if warned else None)
mapped = {{r.tag: r.mapped_bytes for r in a.pager.regions}}
print(a.pager.outside_bytes >= 5 << 30, [mapped[t] for t in ("w", "kv", "g")])
gpt.resume(["w", "kv", "g"])
print(all(torch.equal(x, y) for x, y in zip(engine.step(), want)))
print(a)
print(*warned)
print("processes", a.pager.processes, a.pager.this_process_bytes)
"""


def test_the_audit_names_a_buffer_outside_every_tag() -> None:
    """A transformers model in three tags and a 5 GiB buffer allocated outside every tag
    (the SGLang case): after the release, ``gpu_pager.torch.audit()`` shows the buffer with
    its size and allocation site and the tags with nothing mapped, the release logs one
    warning naming the buffer's site, and the engine's logits after the resume are the
    same as before."""
    code = AUDITED.format(tests=os.path.dirname(__file__))
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[:4] == ["True True", "1 True", "True [0, 0, 0]", "True"], done.stdout
