"""The exception tree: one class per error code, each with .tag, .code and the message."""

from __future__ import annotations

import pytest

import gpu_pager
from fresh import run_python

MIB = 1 << 20


def test_every_code_has_its_class() -> None:
    codes = gpu_pager.error_codes()
    assert len(codes) == len({n for n, _ in codes}) >= 16
    for number, name in codes:
        cls = getattr(gpu_pager, f"{name}Error")
        assert f"{name}Error" in gpu_pager.__all__
        assert issubclass(cls, gpu_pager.PagerError) and cls is not gpu_pager.PagerError
        assert cls.code == number
        assert cls.__module__ == "gpu_pager" and cls.__doc__
    names = {name for _, name in codes}
    assert {"NotResident", "UnknownTag", "Busy", "OutOfMemory", "Panic"} <= names
    classes = {
        n
        for n in dir(gpu_pager)
        if n.endswith("Error") and isinstance(getattr(gpu_pager, n), type)
    }
    assert classes == {f"{n}Error" for n in names} | {"PagerError"}


def test_base_class() -> None:
    assert issubclass(gpu_pager.PagerError, Exception)
    assert gpu_pager.PagerError.__doc__
    # Device memory running out is a MemoryError too; nothing else is.
    assert issubclass(gpu_pager.OutOfMemoryError, MemoryError)
    assert not issubclass(gpu_pager.BusyError, MemoryError)
    made = gpu_pager.NotResidentError("by hand")
    assert made.code == gpu_pager.NotResidentError.code and made.tag is None and made.tags == []


def test_fields(pager: gpu_pager.Pager, tag: str) -> None:
    pager.region(tag, "preserve", 2 * MIB)
    buf = pager.alloc(tag, 64)
    pager.release(tag)
    with pytest.raises(gpu_pager.PagerError) as e:
        pager.write(buf, 0, b"x")
    err = e.value
    assert type(err) is gpu_pager.NotResidentError
    assert err.tag == tag and err.code == gpu_pager.NotResidentError.code
    assert f"`{tag}`" in str(err) and "resume" in str(err)
    assert err.args == (str(err),)


def test_unknown_tag_suggests_the_nearest(pager: gpu_pager.Pager, tag: str) -> None:
    pager.region(tag, "discard", 2 * MIB)
    with pytest.raises(gpu_pager.UnknownTagError) as e:
        pager.resume(tag + "x")
    assert e.value.tag == tag + "x"
    assert f"did you mean `{tag}`" in str(e.value)


def test_out_of_memory_loses_nothing(pager: gpu_pager.Pager) -> None:
    if pager.backend != "host":
        pytest.skip("GPU_PAGER_HOST_CAPACITY sets only the host backend's capacity")
    done = run_python(
        """
        import gpu_pager
        MIB = 1 << 20
        p = gpu_pager.Pager.for_device(0)
        assert p.backend == "host"
        p.region("weights", "preserve", 32 * MIB)
        w = p.alloc("weights", 4096)
        p.write(w, 0, b"w" * 4096)
        p.release("weights")
        p.region("trainer", "discard", 48 * MIB)  # the trainer takes the memory
        try:
            p.resume("weights")
        except gpu_pager.OutOfMemoryError as e:
            assert isinstance(e, MemoryError)
            assert e.tag == "weights" and e.code == gpu_pager.OutOfMemoryError.code
            assert "resume" in str(e) and "nothing was lost" in str(e), str(e)
        else:
            raise SystemExit("resume did not run out of memory")
        try:
            p.region("more", "discard", 32 * MIB)
        except MemoryError as e:  # region creation, caught as the builtin
            assert type(e) is gpu_pager.OutOfMemoryError and e.tag == "more"
        else:
            raise SystemExit("region creation did not run out of memory")
        p.release("trainer")
        p.resume("weights")
        assert p.read(w, 0, 4096) == b"w" * 4096
        print("ok")
        """,
        GPU_PAGER_HOST_CAPACITY="64M",
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_bad_capacity_is_refused_naming_the_variable(pager: gpu_pager.Pager) -> None:
    if pager.backend != "host":
        pytest.skip("GPU_PAGER_HOST_CAPACITY matters only without a GPU")
    done = run_python(
        """
        import gpu_pager
        try:
            gpu_pager.Pager.for_device(0)
        except gpu_pager.InvalidArgumentError as e:
            print("refused:", e)
        """,
        GPU_PAGER_HOST_CAPACITY="lots",
    )
    assert done.returncode == 0, done.stderr
    assert "refused:" in done.stdout and "GPU_PAGER_HOST_CAPACITY" in done.stdout
    assert "unset it" in done.stdout


def test_the_package_raises_c_failures_as_the_pager_does() -> None:
    """One construction for every exception: the C ABI's codes, the package's own checks."""
    err = gpu_pager._native._error(gpu_pager.BusyError.code, "held", ["weights"])
    assert type(err) is gpu_pager.BusyError
    assert (err.code, err.tag, err.tags, str(err)) == (gpu_pager.BusyError.code, "weights", ["weights"], "held")
    unknown = gpu_pager._native._error(12345, "what")
    assert type(unknown) is gpu_pager.InvalidArgumentError and unknown.tag is None
