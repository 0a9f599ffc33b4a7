"""The Pager API on whatever backend device 0 has (the host backend in CI)."""

from __future__ import annotations

import array
from collections.abc import Callable

import pytest

import gpu_pager
from gpu_pager import Policy, State

MIB = 1 << 20


def pattern(n: int, seed: int) -> bytes:
    """n bytes that differ at every offset and between seeds."""
    return bytes((i * 131 + seed * 7 + (i >> 8)) & 0xFF for i in range(n))


def test_for_device_is_one_pager_per_device(pager: gpu_pager.Pager) -> None:
    again = gpu_pager.Pager.for_device(0)
    assert again == pager and hash(again) == hash(pager)
    assert pager.device == 0
    assert pager.backend in ("cuda", "host")
    if pager.backend == "host":
        assert pager.host_fallback  # says why there is no GPU
    else:
        assert pager.host_fallback is None
    assert "Pager(device=0" in repr(pager)


def test_multi_stage_wake_up(pager: gpu_pager.Pager, new_tag: Callable[[], str]) -> None:
    weights, kv = new_tag(), new_tag()
    w_info = pager.region(weights, "preserve", 8 * MIB)
    kv_info = pager.region(kv, Policy.DISCARD, 16 * MIB)
    assert w_info.policy == Policy.PRESERVE and kv_info.policy == Policy.DISCARD
    assert w_info.state == State.RESIDENT and w_info.size == 8 * MIB

    a = pager.alloc(weights, 3 * MIB)
    b = pager.alloc(weights, 4096)
    k = pager.alloc(kv, MIB)
    data_a, data_b = pattern(3 * MIB, 1), pattern(4096, 2)
    pager.write(a, 0, data_a)
    pager.write(b, 0, bytearray(data_b))
    pager.write(k, 0, memoryview(pattern(MIB, 3)))
    addr_a, addr_b = pager.ptr(a), pager.ptr(b)
    assert addr_a >= w_info.base and addr_b >= addr_a + 3 * MIB

    report = pager.release([kv, weights])
    assert report.op == "release"
    assert [r.tag for r in report.regions] == sorted([kv, weights])
    assert report.bytes == 24 * MIB
    assert report.copied == report.region(weights).copied > 0  # type: ignore[union-attr]
    assert report.region(kv).copied == 0  # type: ignore[union-attr]
    assert report.seconds >= report.sync_seconds >= 0
    assert pager.info(weights).state == State.RELEASED

    # The trainer runs; pager access to released memory is an error, not a fault.
    with pytest.raises(gpu_pager.NotResidentError) as e:
        pager.write(a, 0, b"\0" * 16)
    assert e.value.tag == weights
    with pytest.raises(gpu_pager.NotResidentError):
        pager.read(b, 0, 16)
    with pytest.raises(gpu_pager.NotResidentError):
        pager.ptr(a)

    # Stage 1: weights, contents bit-exact at the same addresses; update them in place.
    r1 = pager.resume(weights)
    assert r1.op == "resume" and r1.bytes == 8 * MIB and r1.copied > 0
    assert pager.read(a, 0, 3 * MIB) == data_a
    assert pager.read(b, 0, 4096) == data_b
    assert pager.ptr(a) == addr_a and pager.ptr(b) == addr_b
    pager.write(b, 100, b"updated")
    assert pager.info(kv).state == State.RELEASED  # the KV cache still sleeps
    with pytest.raises(gpu_pager.NotResidentError):
        pager.read(k, 0, 1)

    # Stage 2: the KV cache.
    r2 = pager.resume([kv])
    assert r2.bytes == 16 * MIB and r2.copied == 0
    assert pager.read(b, 100, 7) == b"updated"
    pager.write(k, 0, b"kv")
    assert pager.read(k, 0, 2) == b"kv"

    # Idempotent: resuming again does nothing and says so.
    again = pager.resume((weights, kv))
    assert [r.outcome for r in again.regions] == ["already_done", "already_done"]
    assert again.bytes == 0

    # A second cycle copies only what changed (at most the hash chunk written).
    r3 = pager.release(weights)
    assert r3.region(weights).copied <= 8 * MIB  # type: ignore[union-attr]
    pager.resume(weights)
    assert pager.read(a, 0, 3 * MIB) == data_a


def test_discard_zeroed_comes_back_zero(pager: gpu_pager.Pager, tag: str) -> None:
    pager.region(tag, "discard_zeroed", 2 * MIB)
    buf = pager.alloc(tag, 4096)
    pager.write(buf, 0, b"\xff" * 4096)
    pager.release(tag)
    pager.resume(tag)
    assert pager.read(buf, 0, 4096) == bytes(4096)


def test_write_and_read_ranges(pager: gpu_pager.Pager, tag: str) -> None:
    pager.region(tag, "preserve", 2 * MIB)
    buf = pager.alloc(tag, 1000)
    assert buf.tag == tag and buf.nbytes == len(buf) == 1000 and buf.offset % 256 == 0
    assert "Buffer(" in repr(buf)
    pager.write(buf, 10, array.array("B", [1, 2, 3]))
    assert pager.read(buf, 10, 3) == b"\x01\x02\x03"
    assert pager.read(buf, 0, 0) == b""
    with pytest.raises(gpu_pager.OutOfRangeError):
        pager.write(buf, 999, b"ab")
    with pytest.raises(gpu_pager.OutOfRangeError):
        pager.read(buf, 0, 1001)
    with pytest.raises(gpu_pager.OutOfRangeError):
        pager.read(buf, 2**62, 2**62)


def test_alloc_free_and_alignment(pager: gpu_pager.Pager, tag: str) -> None:
    pager.region(tag, "discard", 2 * MIB)
    a = pager.alloc(tag, 100, align=4096)
    b = pager.alloc(tag, 100, align=4096)
    assert a.offset % 4096 == 0 and b.offset % 4096 == 0 and a != b
    assert len({a, b}) == 2
    pager.free(a)
    with pytest.raises(gpu_pager.StaleBufferError) as e:
        pager.free(a)
    assert e.value.tag == tag
    with pytest.raises(gpu_pager.StaleBufferError):
        pager.write(a, 0, b"x")
    with pytest.raises(gpu_pager.RegionFullError):
        pager.alloc(tag, 4 * MIB)
    pager.free(b)


def test_region_again_and_conflict(pager: gpu_pager.Pager, tag: str) -> None:
    first = pager.region(tag, "preserve", 2 * MIB)
    again = pager.region(tag, Policy.PRESERVE, 2 * MIB)
    assert again.base == first.base and again.id == first.id
    with pytest.raises(gpu_pager.TagConflictError) as e:
        pager.region(tag, "discard", 2 * MIB)
    assert e.value.tag == tag and "policy" in str(e.value)
    assert tag in pager.tags()
    pager.remove(tag)
    assert tag not in pager.tags()
    with pytest.raises(gpu_pager.UnknownTagError):
        pager.info(tag)


def test_prepin(pager: gpu_pager.Pager, tag: str, new_tag: Callable[[], str]) -> None:
    pager.region(tag, "preserve", 2 * MIB, prepin=True)
    assert pager.region_stats(tag).backup_bytes == 2 * MIB
    with pytest.raises(gpu_pager.InvalidArgumentError):
        pager.region(new_tag(), "discard", 2 * MIB, prepin=True)


def test_a_region_s_kind_is_named_not_implied_by_a_size(pager: gpu_pager.Pager, tag: str) -> None:
    # Without bytes a region grows with its buffers; with bytes it is fixed; kind= says so
    # explicitly, and a fixed region of 0 bytes is refused with the growing kind named.
    assert pager.region(tag, "preserve").kind == "growing"
    assert pager.region(tag + "_fixed", "discard", 2 * MIB).kind == "fixed"
    assert pager.region(tag + "_g", "discard", 64 * MIB, kind="growing").kind == "growing"
    with pytest.raises(gpu_pager.InvalidSizeError, match="growing"):
        pager.region(tag + "_zero", "discard", 0)
    with pytest.raises(ValueError, match="fixed"):
        pager.region(tag + "_bad", "discard", 2 * MIB, kind="elastic")  # type: ignore[arg-type]


def test_lease_is_a_context_manager(pager: gpu_pager.Pager, tag: str) -> None:
    pager.region(tag, "discard", 2 * MIB)
    with pager.lease(tag) as lease:
        assert lease.active and lease.tags == [tag]
        assert pager.region_stats(tag).leases == 1
        with pytest.raises(gpu_pager.BusyError) as e:
            pager.release([tag])
        assert e.value.tag == tag and "lease" in str(e.value)
        with pytest.raises(gpu_pager.BusyError):
            pager.remove(tag)
    assert not lease.active and "active=False" in repr(lease)
    lease.close()  # twice is harmless
    pager.release(tag)
    with pytest.raises(gpu_pager.NotResidentError):
        pager.lease([tag])
    report, lease2 = pager.resume_and_lease(tag)
    assert report.bytes == 2 * MIB and lease2.active
    with pytest.raises(gpu_pager.BusyError):
        pager.release(tag)
    lease2.close()
    pager.release(tag)


def test_lease_released_when_collected(pager: gpu_pager.Pager, tag: str) -> None:
    pager.region(tag, "discard", 2 * MIB)
    pager.lease(tag)  # dropped at once
    pager.release(tag)


def test_resume_on_stream_arguments(pager: gpu_pager.Pager, tag: str) -> None:
    class FakeStream:
        cuda_stream = 0  # the legacy default stream, as torch.cuda.Stream exposes it

    pager.region(tag, "preserve", 2 * MIB)
    buf = pager.alloc(tag, 64)
    pager.write(buf, 0, b"s" * 64)
    for stream in (0, FakeStream()):
        pager.release(tag)
        report = pager.resume_on(tag, stream)
        assert report.op == "resume"
        if pager.backend == "cuda":
            continue  # the copy may still run on the stream
        assert pager.read(buf, 0, 64) == b"s" * 64
    with pytest.raises(TypeError):
        pager.resume_on(tag, "stream")
    with pytest.raises(TypeError):
        pager.resume_on(tag, object())
    with pytest.raises(ValueError):
        pager.resume_on(tag, -1)


def test_reports_and_stats(pager: gpu_pager.Pager, new_tag: Callable[[], str]) -> None:
    w, kv = new_tag(), new_tag()
    pager.region(w, "preserve", 4 * MIB)
    pager.region(kv, "discard", 2 * MIB)
    buf = pager.alloc(w, 4096)
    pager.write(buf, 0, b"x" * 4096)
    report = pager.release([w, kv])
    entry = report.region(w)
    assert entry is not None and report.region("nope") is None
    assert entry.outcome == "done" and entry.bytes == 4 * MIB and entry.copied > 0
    assert entry.seconds == pytest.approx(entry.steps.total)
    steps = entry.steps
    assert min(steps.pin, steps.copy, steps.map, steps.unmap, steps.fill, steps.hash) >= 0
    assert "Steps(" in repr(steps) and "RegionReport(" in repr(entry)
    assert f'"{w}"' in repr(report) and "release" in str(report)

    stats = pager.stats()
    mine = [r for r in stats.regions if r.tag in (w, kv)]
    assert [r.tag for r in mine] == sorted([w, kv])
    ws = stats.region(w)
    assert ws is not None and stats.region("nope") is None
    assert ws.info.state == State.RELEASED and ws.info.policy == Policy.PRESERVE
    assert ws.released_bytes == 4 * MIB and ws.resident_bytes == 0
    assert ws.backup_bytes == 4 * MIB and ws.buffers == 1 and ws.allocated_bytes >= 4096
    assert ws.leases == 0 and ws.last_resume is None
    assert ws.last_release is not None and ws.last_release.copied == entry.copied
    assert stats.released_bytes >= 6 * MIB and stats.backup_bytes >= 4 * MIB
    assert "RegionStats(" in repr(ws) and "Stats(" in repr(stats)
    assert w in str(stats) and "released" in str(stats)
    info = pager.info(w)
    assert info.releases == 1 and info.kind == "fixed" and "RegionInfo(" in repr(info)
    pager.resume([w, kv])
    assert pager.region_stats(w).last_resume is not None


def test_policy_and_state_enums() -> None:
    assert Policy.PRESERVE.value == "preserve" and str(Policy.DISCARD) == "discard"
    assert Policy.DISCARD_ZEROED.value == "discard_zeroed"
    assert State.RESIDENT.value == "resident" and str(State.RELEASED) == "released"
    assert Policy.PRESERVE != Policy.DISCARD
    assert len({Policy.PRESERVE, Policy.PRESERVE, Policy.DISCARD}) == 2


def test_bad_python_types(pager: gpu_pager.Pager, tag: str) -> None:
    pager.region(tag, "preserve", 2 * MIB)
    buf = pager.alloc(tag, 64)
    with pytest.raises(ValueError, match="unknown policy"):
        pager.region(tag, "keep", 2 * MIB)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        pager.region(tag, 1, 2 * MIB)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        pager.region(tag, "preserve", 2.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        pager.region(tag, "preserve", True)
    with pytest.raises(ValueError):
        pager.region(tag, "preserve", -1)
    with pytest.raises(TypeError):
        pager.region(1, "preserve", 2 * MIB)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        pager.alloc(tag, "64")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        pager.alloc(tag, -64)
    with pytest.raises(TypeError):
        pager.write(buf, 0, "text")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        pager.write(buf, 0, 5)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        pager.write(b"not a buffer", 0, b"x")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        pager.read(buf, -1, 1)
    with pytest.raises(TypeError):
        pager.release(5)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        pager.release(b"weights")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        pager.release([tag, 5])  # type: ignore[list-item]
    with pytest.raises(TypeError):
        gpu_pager.Pager()
    with pytest.raises(ValueError):
        gpu_pager.Pager.for_device(-1)


def test_pager_errors_for_bad_values(pager: gpu_pager.Pager, tag: str) -> None:
    # No bytes is a growing region; a size past the device is InvalidSize.
    assert pager.region(tag + "_grows", "preserve").kind == "growing"
    with pytest.raises(gpu_pager.InvalidSizeError):
        pager.region(tag + "_huge", "preserve", 1 << 60)
    pager.region(tag, "preserve", 2 * MIB)
    with pytest.raises(gpu_pager.InvalidSizeError):
        pager.alloc(tag, 0)
    with pytest.raises(gpu_pager.PagerError):
        pager.alloc(tag, 64, align=3)
    with pytest.raises(gpu_pager.UnknownTagError):
        pager.release([tag, "no-such-tag"])
    assert pager.info(tag).state == State.RESIDENT  # all or nothing


def test_other_device_without_gpu(pager: gpu_pager.Pager) -> None:
    if pager.backend == "cuda":
        pytest.skip("there is a GPU: device 1 may exist")
    with pytest.raises(gpu_pager.BackendError) as e:
        gpu_pager.Pager.for_device(1)
    assert e.value.code == gpu_pager.BackendError.code


def test_read_backup_while_released(pager: gpu_pager.Pager, tag: str) -> None:
    pager.region(tag, "preserve", 4 << 20)
    buf = pager.alloc(tag, 1 << 20)
    data = bytes(range(256)) * 4096
    pager.write(buf, 0, data)
    with pytest.raises(gpu_pager.InvalidArgumentError):
        pager.read_backup(buf, 0, 16)  # resident: read the device
    pager.set_overwritten(buf, True, 512 << 10)  # the second half
    pager.release(tag)
    assert pager.read_backup(buf, 100, 1000) == data[100:1100]
    with pytest.raises(gpu_pager.InvalidArgumentError) as e:
        pager.read_backup(buf, 512 << 10, 16)  # marked at the release
    assert e.value.tag == tag
    with pytest.raises(gpu_pager.OutOfRangeError):
        pager.read_backup(buf, (1 << 20) - 8, 16)
    pager.resume(tag)
    assert pager.read(buf, 0, 1000) == data[:1000]
