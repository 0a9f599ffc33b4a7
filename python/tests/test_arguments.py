"""The Python binding's arguments and errors at their edges."""

from __future__ import annotations

import pytest

import gpu_pager

from fresh import run_python

MIB = 1 << 20


def test_a_removed_region_s_buffer_is_stale(pager: gpu_pager.Pager, tag: str) -> None:
    """Item 16: the buffer went with its region; nothing tells the caller to create it."""
    pager.region(tag, "preserve", 2 * MIB)
    buf = pager.alloc(tag, 4096)
    pager.remove(tag)
    with pytest.raises(gpu_pager.StaleBufferError):
        pager.write(buf, 0, b"x")
    with pytest.raises(gpu_pager.StaleBufferError):
        pager.free(buf)


def test_for_device_takes_an_int_at_least_zero() -> None:
    """Item 19: True is no device 1, and -1 is a ValueError that says what is accepted."""
    with pytest.raises(TypeError, match="device must be an int"):
        gpu_pager.Pager.for_device(True)
    with pytest.raises(ValueError, match="device must be between 0 and"):
        gpu_pager.Pager.for_device(-1)
    assert gpu_pager.Pager.for_device().device == 0


@pytest.mark.parametrize("huge", [1 << 64, 1 << 128, 1 << 300, -(1 << 200)])
def test_every_size_past_the_machine_is_the_same_error(
    pager: gpu_pager.Pager, tag: str, huge: int
) -> None:
    """Item 19: 2^64 and 2^128 gave different errors."""
    pager.region(tag, "preserve", 2 * MIB)
    with pytest.raises(ValueError, match="nbytes must be between 0 and"):
        pager.alloc(tag, huge)


def test_a_tag_with_a_nul_is_refused(pager: gpu_pager.Pager) -> None:
    """Item 19: C can never name such a region, so no binding makes one."""
    with pytest.raises(gpu_pager.InvalidArgumentError, match="NUL"):
        pager.region("a\0b", "preserve", 2 * MIB)
    assert "a\0b" not in pager.tags()


def test_an_alignment_above_the_granularity_is_refused(pager: gpu_pager.Pager, tag: str) -> None:
    """Item 19: a region's base is only granularity-aligned, so 2^40 cannot be honoured."""
    pager.region(tag, "preserve", 4 * MIB)
    with pytest.raises(gpu_pager.InvalidArgumentError, match="granularity"):
        pager.alloc(tag, 64, align=1 << 40)
    buf = pager.alloc(tag, 64, align=2 * MIB)
    assert pager.ptr(buf) % (2 * MIB) == 0


def test_zero_byte_copies_agree_with_c(pager: gpu_pager.Pager, tag: str) -> None:
    """Item 19: zero bytes copy nothing in every binding, after the same checks."""
    pager.region(tag, "preserve", 2 * MIB)
    buf = pager.alloc(tag, 64)
    pager.write(buf, 0, b"")
    assert pager.read(buf, 64, 0) == b""
    with pytest.raises(gpu_pager.OutOfRangeError):
        pager.write(buf, 65, b"")
    pager.release(tag)
    with pytest.raises(gpu_pager.NotResidentError):
        pager.write(buf, 0, b"")
    pager.resume(tag)


def test_log_records_and_deferred_errors_reach_python() -> None:
    """gpu-pager's log records go to ``logging`` (logger ``gpu_pager``) after the call that
    made them; failures no call could return are in ``Stats`` and can be taken."""
    done = run_python(
        """
        import logging
        records = []
        class Keep(logging.Handler):
            def emit(self, record):
                records.append((record.name, record.levelno, record.getMessage()))
        logging.getLogger("gpu_pager").addHandler(Keep())
        logging.getLogger("gpu_pager").setLevel(logging.INFO)
        import gpu_pager
        pager = gpu_pager.Pager.for_device(0)
        pager.tags()
        stats = pager.stats()
        assert stats.deferred_errors == [] and stats.deferred_errors_total >= 0
        assert pager.take_deferred_errors() == []
        if pager.backend == "host":
            assert any(
                n == "gpu_pager" and lvl == logging.WARNING and "host backend" in m
                for n, lvl, m in records
            ), records
        print("ok")
        """,
        GPU_PAGER_HOST_CAPACITY="64M",
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr
