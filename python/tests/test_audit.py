"""The residency audit: ``Pager.audit()`` adds up to the regions and the device, and
``gpu_pager.torch.audit()`` names torch's segments outside every tag."""

from __future__ import annotations

import os
import textwrap
from collections.abc import Callable

import gpu_pager
from fresh import run_python

HERE = os.path.dirname(os.path.abspath(__file__))


def test_the_audit_adds_up_to_the_regions(
    pager: gpu_pager.Pager, new_tag: Callable[[], str]
) -> None:
    kept, gone = new_tag(), new_tag()
    pager.region(kept, "preserve", 4 << 20)
    pager.region(gone, "discard", 8 << 20)
    pager.release(gone)
    a = pager.audit()
    assert a.mapped_bytes == pager.stats().resident_bytes
    assert a.device_used_bytes == a.device_total_bytes - a.device_free_bytes
    assert a.outside_bytes == max(0, a.device_used_bytes - a.mapped_bytes)
    if pager.backend == "host":
        # The host backend's device is this process's alone, as NVML would report it.
        assert a.processes == [(os.getpid(), a.device_used_bytes)]
        assert (a.this_process_bytes, a.other_processes_bytes) == (a.device_used_bytes, 0)
    elif a.processes is not None:
        # NVML (on the GPU) lists this process with at least its regions' memory.
        assert a.this_process_bytes is None or a.this_process_bytes >= a.mapped_bytes
    entries = {r.tag: r for r in a.regions}
    assert entries[kept].state == gpu_pager.State.RESIDENT
    assert entries[kept].mapped_bytes == entries[kept].reserved_bytes == 4 << 20
    assert entries[gone].state == gpu_pager.State.RELEASED
    assert (entries[gone].mapped_bytes, entries[gone].reserved_bytes) == (0, 8 << 20)
    assert entries[gone].policy == gpu_pager.Policy.DISCARD and entries[gone].kind == "fixed"
    table = str(a)
    assert kept in table and gone in table and "outside every region" in table, table
    pager.remove(gone)
    pager.remove(kept)


def test_torch_s_segments_outside_every_tag_are_named() -> None:
    code = textwrap.dedent(
        """
        import torch_standin
        torch = torch_standin.install()
        import gpu_pager, gpu_pager.torch as gpt
        pager = gpu_pager.Pager.for_device(0)
        inside = pager.region("audited", "preserve", 2 << 20).base
        kv = pager.region("audited-kv", "discard", 4 << 20).base
        meta = dict(filename="/srv/engine/block_table.py", line=7, name="__init__")
        frame = dict(filename="/srv/engine/deepseek.py", line=42, name="make_buffer")
        torch.cuda.memory_snapshot = lambda: [
            dict(device=0, address=inside, total_size=2 << 20, segment_pool_id=(1, 2),
                 blocks=[dict(state="active_allocated", frames=[])]),
            dict(device=0, address=0x7000_0000_0000, total_size=6 << 20,
                 segment_pool_id=(0, 0),
                 blocks=[dict(state="active_allocated",
                              frames=[dict(filename="/lib/torch/nn.py", line=1, name="x"),
                                      dict(filename="memory_snapshot.cpp", line=0,
                                           name="gather_with_cpp"),
                                      frame])]),
            dict(device=0, address=0x7100_0000_0000, total_size=3 << 20,
                 segment_pool_id=(0, 0), blocks=[]),
            dict(device=0, address=kv, total_size=4 << 20, segment_pool_id=(3, 4),
                 blocks=[dict(state="active_allocated", size=1 << 20, frames=[meta]),
                         dict(state="inactive", size=3 << 20, frames=[])]),
        ]
        a = gpt.audit()
        print([(s.bytes >> 20, s.site) for s in a.outside_tags])
        print(a.torch_outside_bytes >> 20)
        print([(d.tag, d.bytes >> 20, d.site) for d in a.discarded])
        text = str(a)
        assert "deepseek.py:42 in make_buffer" in text and "site unknown" in text, text
        assert "live allocations in discard tags" in text, text
        print("ok")
        """
    )
    done = run_python(code, PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "[(6, '/srv/engine/deepseek.py:42 in make_buffer'), (3, None)]", lines
    assert lines[1] == "9", lines
    assert lines[2] == "[('audited-kv', 1, '/srv/engine/block_table.py:7 in __init__')]", lines
    assert lines[-1] == "ok", lines


WARNED = """
    import logging
    import torch_standin
    torch = torch_standin.install()
    import gpu_pager, gpu_pager.torch as gpt
    seen = []
    class Keep(logging.Handler):
        def emit(self, record):
            if "still in use" in record.getMessage():
                seen.append(record.getMessage())
    logging.getLogger("gpu_pager").addHandler(Keep())
    # Above a CUDA context's memory (on a GPU it lies outside every region), below the test's.
    gpu_pager.configure(0, resident_warning_bytes=2 << 30)
    pager = gpu_pager.Pager.for_device(0)
    print(pager.config.resident_warning_bytes)
    pager.region("kept", "preserve", 4 << 20)
    pager.region("gone", "discard", 4 << 20)
    frame = dict(filename="/srv/engine/deepseek.py", line=42, name="make_buffer")
    torch.cuda.memory_snapshot = lambda: [
        dict(device=0, address=0x7000_0000_0000, total_size=6 << 20, segment_pool_id=(0, 0),
             blocks=[dict(state="active_allocated", frames=[frame])]),
    ]
    # `kept` stays resident on purpose and nothing lies outside the regions: quiet.
    pager.release("gone")
    print(len(seen))
    # The core's warning, as a release with an allocator's memory outside the regions logs
    # it: its data in the record's fields.
    text = ('gpu-pager: device 0: after releasing ["gone"], 0.01 GiB of this process\\'s '
            'device memory is still in use outside every region (more than 2.00 GiB)')
    fields = dict(event="resident_after_release", device="0", outside_bytes=str(6 << 20))
    logging.getLogger("gpu_pager").warning(text, extra=dict(gpu_pager=fields))
    # The same words without the data are someone else's: left as they are.
    logging.getLogger("gpu_pager").warning("copied: " + text)
    for message in seen:
        print(message)
"""


def test_the_release_warning_names_torch_s_holders_and_resident_regions_stay_quiet() -> None:
    done = run_python(
        textwrap.dedent(WARNED),
        PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[:2] == [str(2 << 30), "0"], lines
    warning = lines[2]
    assert warning.startswith("gpu-pager: device 0: after releasing"), warning
    assert "torch holds 0.01 GiB of it outside every tag" in warning, warning
    assert "the largest: 0.01 GiB at /srv/engine/deepseek.py:42 in make_buffer" in warning, warning
    assert lines[3].startswith("copied: ") and "torch holds" not in lines[3], lines


MEANWHILE = """
    import threading
    import torch_standin
    torch_standin.install()
    import gpu_pager, gpu_pager.torch as gpt
    p = gpu_pager.Pager.for_device(0)
    p.region("mw", "preserve", 4 << 20)
    ran = []
    work = lambda: ran.append(threading.current_thread() is not threading.main_thread())
    print(gpt.release("mw", meanwhile=work).region("mw").outcome, ran)
    try:
        gpt.release("no-such-tag", meanwhile=work)
    except gpu_pager.UnknownTagError:
        print("refused", ran)
"""


def test_release_runs_meanwhile_on_a_helper_thread_and_waits_for_it() -> None:
    """``gpu_pager.torch.release(meanwhile=...)`` (the vLLM drop-in's garbage collection
    during the copies): the work runs once, off the calling thread, and is done when the
    call returns, also when the release fails."""
    done = run_python(
        textwrap.dedent(MEANWHILE),
        PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["done [True]", "refused [True, True]"], done.stdout
