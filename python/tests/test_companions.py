"""Companions from Python: callables that move with a tag, undone with the move when one
raises."""

from __future__ import annotations

from collections.abc import Callable

import pytest

import gpu_pager


def test_companions_move_with_their_tag_and_a_failure_undoes_the_move(
    pager: gpu_pager.Pager, new_tag: Callable[[], str]
) -> None:
    tag = new_tag()
    pager.region(tag, "preserve", 1 << 20)
    buf = pager.alloc(tag, 4096)
    pager.write(buf, 0, bytes([3]) * 4096)
    log: list[tuple[str, str, str]] = []
    refuse = {"release": False, "resume": False}

    def recorder(name: str) -> tuple[Callable[[str], None], Callable[[str], None]]:
        def before(t: str) -> None:
            if refuse["release"] and name == "transport":
                raise ConnectionError("peer gone")
            log.append((name, "release", t))

        def after(t: str) -> None:
            if refuse["resume"] and name == "transport":
                raise ConnectionError("peer still gone")
            log.append((name, "resume", t))

        return before, after

    transport = pager.add_companion(tag, "transport", *recorder("transport"))
    own = pager.add_companion(tag, "own", *recorder("own"))
    pager.release(tag)
    assert log == [("own", "release", tag), ("transport", "release", tag)]
    log.clear()
    pager.resume(tag)
    assert log == [("transport", "resume", tag), ("own", "resume", tag)]
    log.clear()

    # A failing release: "own" ran first and is undone; the region stays resident.
    refuse["release"] = True
    with pytest.raises(gpu_pager.CompanionError, match="ConnectionError: peer gone") as e:
        pager.release(tag)
    assert e.value.tag == tag and "`transport`" in str(e.value)
    assert log == [("own", "release", tag), ("own", "resume", tag)]
    assert pager.info(tag).state == gpu_pager.State.RESIDENT
    refuse["release"] = False
    log.clear()

    # A failing resume: the region stays released with its backup; "own" never ran.
    pager.release(tag)
    log.clear()
    refuse["resume"] = True
    with pytest.raises(gpu_pager.CompanionError, match="during the resume"):
        pager.resume(tag)
    assert log == []
    assert pager.info(tag).state == gpu_pager.State.RELEASED
    refuse["resume"] = False
    pager.resume(tag)
    assert pager.read(buf, 0, 4096) == bytes([3]) * 4096

    for cid in (transport, own):
        pager.remove_companion(cid)
    with pytest.raises(gpu_pager.InvalidArgumentError, match="not registered"):
        pager.remove_companion(own)
    log.clear()
    pager.release(tag)
    pager.resume(tag)
    assert log == []


def test_a_companion_keeps_a_python_buffer_only_while_its_tag_is_resident(
    pager: gpu_pager.Pager, new_tag: Callable[[], str]
) -> None:
    """The second user: memory outside the pager (here a bytearray standing in for another
    allocator's buffer) dropped at each release and restored at each resume."""
    tag = new_tag()
    pager.region(tag, "discard", 1 << 20)
    state: dict[str, bytearray | bytes | None] = {"live": bytearray(range(256)) * 16}

    def drop(_: str) -> None:
        live = state.pop("live")
        assert isinstance(live, bytearray)
        state["kept"] = bytes(live)

    def restore(_: str) -> None:
        kept = state.pop("kept")
        assert isinstance(kept, bytes)
        state["live"] = bytearray(kept)

    cid = pager.add_companion(tag, "side buffer", drop, restore)
    for _ in range(2):
        pager.release(tag)
        assert "live" not in state
        pager.resume(tag)
        assert state["live"] == bytearray(range(256)) * 16
    pager.remove_companion(cid)


def test_companion_arguments_are_checked(pager: gpu_pager.Pager) -> None:
    with pytest.raises(TypeError, match="before_release must be callable"):
        pager.add_companion("t", "n", 3)  # type: ignore[arg-type]
    with pytest.raises(gpu_pager.InvalidArgumentError):
        pager.add_companion("", "n")
