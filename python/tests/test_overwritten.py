"""Update-aware release: bytes marked "overwritten by the next update" are neither saved
nor restored; their neighbours come back bit-exact (the host backend in CI)."""

from __future__ import annotations

import pytest

import gpu_pager

MIB = 1 << 20


def pattern(n: int, seed: int) -> bytes:
    """n bytes that differ at every offset and between seeds."""
    return bytes((i * 131 + seed * 7 + (i >> 8)) & 0xFF for i in range(n))


def test_marked_buffers_are_skipped_and_neighbours_bit_exact(
    pager: gpu_pager.Pager, tag: str
) -> None:
    # Pinned ahead: a first release without a backup copies the whole region while it pins
    # (first_save_overlap); this test counts what a save of marked buffers copies.
    pager.region(tag, "preserve", 8 * MIB, prepin=True)
    bufs = [pager.alloc(tag, MIB) for _ in range(3)]
    for i, b in enumerate(bufs):
        pager.write(b, 0, pattern(MIB, i))
    addrs = [pager.ptr(b) for b in bufs]

    # The middle buffer whole, and one "tensor" inside the last one.
    pager.set_overwritten(bufs[1])
    pager.set_overwritten(bufs[2], offset=4096, length=8192)
    assert pager.overwritten(bufs[1]) == [(0, MIB)]
    assert pager.overwritten(bufs[2]) == [(4096, 4096 + 8192)]
    assert pager.overwritten(bufs[0]) == []
    assert pager.region_stats(tag).marked_bytes == MIB + 8192

    report = pager.release(tag)
    # The 1 MiB marked buffer is skipped; the small mark lies in a gap under 1 MiB, which is
    # copied along.
    assert report.copied == 2 * MIB
    assert pager.region_stats(tag).held_bytes == 2 * MIB
    assert pager.resume(tag).copied == 2 * MIB

    assert [pager.ptr(b) for b in bufs] == addrs
    assert pager.read(bufs[0], 0, MIB) == pattern(MIB, 0)
    got = pager.read(bufs[2], 0, MIB)
    want = pattern(MIB, 2)
    assert got[:4096] == want[:4096] and got[4096 + 8192 :] == want[4096 + 8192 :]
    # The update writes the marked buffer: it is mapped and writable.
    pager.write(bufs[1], 0, pattern(MIB, 9))
    assert pager.read(bufs[1], 0, MIB) == pattern(MIB, 9)

    # Unmarked, the next cycle saves and restores it bit-exact.
    pager.set_overwritten(bufs[1], on=False)
    pager.set_overwritten(bufs[2], False, 4096, 8192)
    assert pager.overwritten(bufs[1]) == [] and pager.overwritten(bufs[2]) == []
    pager.release(tag)
    pager.resume(tag)
    assert pager.read(bufs[1], 0, MIB) == pattern(MIB, 9)
    assert pager.read(bufs[0], 0, MIB) == pattern(MIB, 0)


def test_all_marked_release_copies_nothing(pager: gpu_pager.Pager, tag: str) -> None:
    pager.region(tag, "preserve", 4 * MIB)
    bufs = [pager.alloc(tag, MIB) for _ in range(2)]
    for b in bufs:
        pager.write(b, 0, pattern(MIB, 1))
        pager.set_overwritten(b)
    report = pager.release(tag)
    assert report.copied == 0
    assert pager.region_stats(tag).backup_bytes == 0  # nothing to save, nothing pinned
    assert pager.resume(tag).copied == 0
    for b in bufs:
        pager.write(b, 0, pattern(MIB, 5))
        assert pager.read(b, 0, MIB) == pattern(MIB, 5)


def test_a_freed_buffers_marks_go(pager: gpu_pager.Pager, tag: str) -> None:
    pager.region(tag, "preserve", 4 * MIB)
    a = pager.alloc(tag, MIB)
    pager.set_overwritten(a)
    pager.free(a)
    assert pager.region_stats(tag).marked_bytes == 0
    with pytest.raises(gpu_pager.StaleBufferError):
        pager.set_overwritten(a)
    again = pager.alloc(tag, MIB)
    assert again.offset == a.offset and pager.overwritten(again) == []


def test_bad_marks_are_typed_errors(pager: gpu_pager.Pager, tag: str) -> None:
    pager.region(tag, "preserve", 4 * MIB)
    b = pager.alloc(tag, 1000)
    with pytest.raises(gpu_pager.OutOfRangeError, match=tag):
        pager.set_overwritten(b, offset=900, length=200)
    with pytest.raises(gpu_pager.OutOfRangeError):
        pager.set_overwritten(b, offset=1001)
    with pytest.raises(ValueError):
        pager.set_overwritten(b, offset=-1)
    with pytest.raises(TypeError):
        pager.set_overwritten(b, offset=True)
    pager.set_overwritten(b, offset=1000)  # an empty range marks nothing
    assert pager.overwritten(b) == []
