"""The C entry points torch's pluggable allocator calls, exported by the extension module,
driven here through ctypes on the host backend (no torch needed)."""

from __future__ import annotations

import ctypes
import subprocess
import sys
import textwrap

import pytest

import gpu_pager
import gpu_pager._pools
import gpu_pager.torch as gpt

MIB = 1 << 20


@pytest.fixture(scope="module")
def lib() -> ctypes.CDLL:
    lib = ctypes.CDLL(gpt.library_path())
    lib.gpu_pager_torch_malloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    lib.gpu_pager_torch_malloc.restype = ctypes.c_void_p
    lib.gpu_pager_torch_free.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_void_p,
    ]
    lib.gpu_pager_torch_free.restype = None
    return lib


def test_symbols_are_exported(lib: ctypes.CDLL) -> None:
    # The torch hooks and the whole C ABI (include/gpu_pager.h) come from the extension
    # module itself: one copy of the library in the process.
    for name in (
        gpt.MALLOC_SYMBOL,
        gpt.FREE_SYMBOL,
        gpt.USE_TAG_SYMBOL,
        "gpu_pager_release",
        "gpu_pager_resume",
        "gpu_pager_last_error",
    ):
        assert ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
    assert gpt.library_path() == gpu_pager._native.__file__


def test_c_calls_see_the_python_pager(lib: ctypes.CDLL, pager: gpu_pager.Pager, tag: str) -> None:
    # A region made from Python is released through the C entry point of the same module.
    pager.region(tag, "discard", 4 * MIB)
    lib.gpu_pager_release.argtypes = [
        ctypes.c_int,
        ctypes.POINTER(ctypes.c_char_p),
        ctypes.c_size_t,
        ctypes.c_void_p,
    ]
    lib.gpu_pager_release.restype = ctypes.c_int
    tags = (ctypes.c_char_p * 1)(tag.encode())
    assert lib.gpu_pager_release(0, tags, 1, None) == 0
    assert pager.info(tag).state == gpu_pager.State.RELEASED


def test_malloc_and_free_in_the_tagged_region(
    lib: ctypes.CDLL, pager: gpu_pager.Pager, tag: str
) -> None:
    info = pager.region(tag, "preserve", 8 * MIB)
    assert gpt.current_tag(0) is None
    gpt.use_tag(0, tag)
    try:
        assert gpt.current_tag(0) == tag
        a = lib.gpu_pager_torch_malloc(2 * MIB, 0, None)
        b = lib.gpu_pager_torch_malloc(4 * MIB, 0, None)
        assert a and b and a != b
        for p in (a, b):
            assert info.base <= p < info.base + info.size and p % (2 * MIB) == 0
        assert pager.region_stats(tag).allocated_bytes == 6 * MIB
        assert pager.region_stats(tag).buffers == 2
        found = pager.buffer_containing(b + 1234)
        assert found is not None and found[1] == 1234 and found[0].nbytes == 4 * MIB
        # The region is full: NULL (torch raises OutOfMemoryError), and the reason is kept.
        assert not lib.gpu_pager_torch_malloc(4 * MIB, 0, None)
        assert "no free range" in (gpt.last_error() or "")
        # Free works while the region is released too.
        pager.release(tag)
        lib.gpu_pager_torch_free(a, 2 * MIB, 0, None)
        pager.resume(tag)
        lib.gpu_pager_torch_free(b, 4 * MIB, 0, None)
        assert pager.region_stats(tag).allocated_bytes == 0
        lib.gpu_pager_torch_free(b, 4 * MIB, 0, None)  # unknown now: ignored, reported
        assert "freed already" in (gpt.last_error() or "")
        assert pager.buffer_containing(b) is None
    finally:
        gpt.use_tag(0, None)
    assert gpt.current_tag(0) is None
    assert not lib.gpu_pager_torch_malloc(2 * MIB, 0, None)
    assert "no current tag" in (gpt.last_error() or "")


def test_use_tag_is_per_thread(pager: gpu_pager.Pager, tag: str) -> None:
    import threading

    pager.region(tag, "discard", 2 * MIB)
    seen: list[str | None] = []
    gpt.use_tag(0, tag)
    try:
        t = threading.Thread(target=lambda: seen.append(gpt.current_tag(0)))
        t.start()
        t.join()
    finally:
        gpt.use_tag(0, None)
    assert seen == [None]


def test_region_entered_again_without_bytes(pager: gpu_pager.Pager, tag: str) -> None:
    first = gpu_pager._pools.ensure_region(pager, tag, "preserve", 4 * MIB, False)
    again = gpu_pager._pools.ensure_region(pager, tag, "preserve", None, False)
    assert again.id == first.id
    with pytest.raises(gpu_pager.TagConflictError):
        gpu_pager._pools.ensure_region(pager, tag, "discard", None, False)


def test_region_entered_again_keeps_its_medium(pager: gpu_pager.Pager, tag: str) -> None:
    """A tag created with host-memory backups (vLLM's release-host-memory switch) is taken
    as it is when entered again, not refused for asking pinned ones."""
    first = pager.region(tag, "preserve", medium="host")
    again = gpu_pager._pools.ensure_region(pager, tag, "preserve", None, False)
    assert (again.id, again.medium) == (first.id, "host")


def test_use_tag_refuses_a_negative_device_and_an_unknown_tag() -> None:
    with pytest.raises(gpu_pager.InvalidArgumentError):
        gpt.use_tag(-1, "x")
    with pytest.raises(gpu_pager.UnknownTagError):
        gpt.use_tag(0, "no-such-region")


def test_modules_import_without_torch() -> None:
    code = textwrap.dedent(
        """
        import sys
        sys.modules["torch"] = None  # `import torch` raises ImportError
        import gpu_pager.torch
        import gpu_pager.compat.torch_memory_saver as tms
        import gpu_pager.compat.vllm as vllm
        assert tms.torch_memory_saver.enabled
        assert vllm.CuMemAllocator.get_instance() is vllm.CuMemAllocator.get_instance()
        assert vllm.CuMemAllocator.get_instance().get_current_usage() == 0
        with tms.configure_subprocess():
            pass
        print("ok")
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_c_code_in_a_python_process_shares_the_package_s_pager(lib: ctypes.CDLL) -> None:
    """The documented way for C code in a Python process: the extension module's own C ABI
    (``library_path()``); what it makes is the package's, one pager per device."""
    lib.gpu_pager_region.argtypes = [
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_uint32,
        ctypes.c_uint32,
        ctypes.c_size_t,
        ctypes.c_bool,
        ctypes.c_void_p,
    ]
    lib.gpu_pager_region.restype = ctypes.c_int
    assert lib.gpu_pager_region(0, b"made-in-c", 1, 0, 4 * MIB, False, None) == 0
    pager = gpu_pager.Pager.for_device(0)
    assert "made-in-c" in pager.tags()
    assert pager.info("made-in-c").policy == gpu_pager.Policy.DISCARD
    pager.remove("made-in-c")
