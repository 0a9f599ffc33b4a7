"""The C entry points torch's pluggable allocator calls, exported by the extension module,
driven here through ctypes on the host backend (no torch needed)."""

from __future__ import annotations

import ctypes
import subprocess
import sys
import textwrap

import pytest

import gpu_pager
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
    for name in (gpt.MALLOC_SYMBOL, gpt.FREE_SYMBOL, gpt.USE_TAG_SYMBOL):
        assert ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
    assert gpt.library_path() == gpu_pager._native.__file__


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
        _, _, segments, segment_bytes = gpu_pager._native._torch_hook_state(0)
        assert segments >= 2 and segment_bytes >= 6 * MIB
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
        assert "not a gpu_pager segment" in (gpt.last_error() or "")
    finally:
        gpt.use_tag(0, None)
    assert gpt.current_tag(0) is None
    assert not lib.gpu_pager_torch_malloc(2 * MIB, 0, None)
    assert "no tag is set" in (gpt.last_error() or "")


def test_use_tag_is_per_thread(tag: str) -> None:
    import threading

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
    first = gpt._ensure_region(pager, tag, "preserve", 4 * MIB, False)
    again = gpt._ensure_region(pager, tag, "preserve", None, False)
    assert again.id == first.id
    with pytest.raises(gpu_pager.TagConflictError):
        gpt._ensure_region(pager, tag, "discard", None, False)


def test_use_tag_refuses_a_negative_device() -> None:
    with pytest.raises(gpu_pager.InvalidArgumentError):
        gpt.use_tag(-1, "x")


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
