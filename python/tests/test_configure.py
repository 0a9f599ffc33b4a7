"""``gpu_pager.configure``: a device's settings, chosen before its pager exists."""

from __future__ import annotations

import pytest

import gpu_pager
from fresh import run_python


def test_settings_apply_to_the_pager_created_after_them() -> None:
    # A fresh interpreter: in this one, other tests have opened device 0's pager already.
    done = run_python(
        """
        import gpu_pager
        gpu_pager.configure(0)  # a later call replaces an earlier one
        gpu_pager.configure(0, chunk_bytes=3 << 20, skip_unchanged=False,
                            verify_restore=True, save_route="fastest", restore_route="engine")
        c = gpu_pager.Pager.for_device(0).config
        assert (c.chunk_bytes, c.skip_unchanged, c.verify_restore) == (4 << 20, False, True), c
        assert (c.save_route, c.restore_route) == ("fastest", "engine"), c
        # The same settings again are accepted, others refused and nothing changes.
        gpu_pager.configure(0, chunk_bytes=3 << 20, skip_unchanged=False,
                            verify_restore=True, save_route="fastest", restore_route="engine")
        try:
            gpu_pager.configure(0, verify_restore=False)
        except gpu_pager.InvalidArgumentError as e:
            assert "before its first use" in str(e), e
        else:
            raise AssertionError("other settings accepted after the first use")
        assert gpu_pager.Pager.for_device(0).config.verify_restore
        print(repr(c))
        """
    )
    assert done.returncode == 0, done.stderr
    assert "Config(chunk_bytes=4194304, skip_unchanged=False" in done.stdout


def test_an_open_pager_keeps_its_settings(pager: gpu_pager.Pager) -> None:
    c = pager.config
    same = dict(
        chunk_bytes=c.chunk_bytes,
        skip_unchanged=c.skip_unchanged,
        verify_restore=c.verify_restore,
        save_route=c.save_route,
        restore_route=c.restore_route,
    )
    gpu_pager.configure(pager.device, **same)  # type: ignore[arg-type]
    with pytest.raises(gpu_pager.InvalidArgumentError, match="before its first use"):
        gpu_pager.configure(pager.device, verify_restore=not c.verify_restore)
    assert pager.config.verify_restore == c.verify_restore


def test_bad_settings_are_python_errors() -> None:
    with pytest.raises(ValueError, match='unknown restore_route "sideways"'):
        gpu_pager.configure(0, restore_route="sideways")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="chunk_bytes must be an int"):
        gpu_pager.configure(0, chunk_bytes=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="chunk_bytes must be between"):
        gpu_pager.configure(0, chunk_bytes=-1)
    with pytest.raises(TypeError):
        gpu_pager.configure(0, 1 << 20)  # type: ignore[call-arg]


def test_poisoned_discards_read_back_as_nan() -> None:
    done = run_python(
        """
        import array, struct, gpu_pager
        gpu_pager.configure(0, poison_discards=True)
        p = gpu_pager.Pager.for_device(0)
        assert p.config.poison_discards
        p.region("kv", "discard", 1 << 20)
        b = p.alloc("kv", 4096)
        p.write(b, 0, bytes([1]) * 4096)
        p.release("kv")
        p.resume("kv")
        got = p.read(b, 0, 4096)
        assert got == struct.pack("<I", gpu_pager.POISON) * 1024, got[:8]
        floats = array.array("f", got)
        assert all(f != f for f in floats), "fp32 NaN"
        print("poisoned")
        """
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "poisoned"


def test_the_environment_turns_poison_on() -> None:
    done = run_python(
        "import gpu_pager; print(gpu_pager.Pager.for_device(0).config.poison_discards)",
        GPU_PAGER_POISON_DISCARDS="1",
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True"


def test_the_environment_turns_prepin_on() -> None:
    """``GPU_PAGER_PREPIN=1``: engines that cannot pass ``prepin`` (a drop-in's regions)
    get every pinned backup pinned ahead."""
    done = run_python(
        "import gpu_pager; print(gpu_pager.Pager.for_device(0).config.prepin)",
        GPU_PAGER_PREPIN="1",
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True"


@pytest.mark.parametrize(
    ("name", "value", "forms"),
    [
        ("GPU_PAGER_HOST_BUDGET", "lots", "a byte count"),
        ("GPU_PAGER_RECLAIM_SCRUBBED", "maybe", "a switch"),
        ("GPU_PAGER_POISON_DISCARDS", "sure", "a switch"),
        ("GPU_PAGER_PREPIN", "2", "a switch"),
    ],
)
def test_an_environment_value_that_does_not_parse_is_an_error_naming_it(name: str, value: str, forms: str) -> None:
    """One rule for every variable (review item 14): a value that does not parse fails the
    pager's creation with ``InvalidArgument`` naming the variable, the value and the forms it
    takes (it was a warning, or silently ignored, depending on the variable)."""
    code = """
    import gpu_pager
    try:
        gpu_pager.Pager.for_device(0)
    except gpu_pager.InvalidArgumentError as e:
        print("refused:", e)
    """
    done = run_python(code, **{name: value})
    assert done.returncode == 0, done.stderr
    assert "refused: " in done.stdout, done.stdout
    assert f"{name}={value!r}".replace("'", '"') in done.stdout, done.stdout
    assert forms in done.stdout and "fix or unset it" in done.stdout, done.stdout
