"""The torch_memory_saver drop-in without a GPU: the preload library's exports and the one
core it shares with the package, the switch that makes ``import torch_memory_saver``
resolve here, argument checks, and backup media through ``Pager`` on the host backend."""

from __future__ import annotations

import ctypes
import os
import subprocess
from pathlib import Path
from typing import Literal

import pytest

import gpu_pager
from gpu_pager.compat.torch_memory_saver import TorchMemorySaver, configure_subprocess
from gpu_pager.compat.torch_memory_saver.hooks.mode_preload import preload_library_path
from fresh import run_python

MIB = 1 << 20

TMS_SYMBOLS = [
    "cudaMalloc",
    "cudaFree",
    "tms_pause",
    "tms_resume",
    "tms_set_current_tag",
    "tms_get_current_tag",
    "tms_set_interesting_region",
    "tms_get_interesting_region",
    "tms_set_enable_cpu_backup",
    "tms_get_enable_cpu_backup",
    "tms_set_cpu_backup_backend",
    "tms_get_cpu_backup_backend",
    "tms_set_enable_disk_backup",
    "tms_get_enable_disk_backup",
    "tms_set_disk_backup_dir",
    "tms_set_retain_cpu_backup",
    "tms_get_retain_cpu_backup",
    "tms_get_cpu_backup_pointer",
    "set_memory_margin_bytes",
]


def test_the_preload_library_exports_torch_memory_saver_s_entry_points() -> None:
    path = preload_library_path()
    assert Path(path).parent == Path(gpu_pager._native.__file__ or "").parent
    lib = ctypes.CDLL(path)
    for name in TMS_SYMBOLS:
        assert hasattr(lib, name), name


def test_a_process_that_is_not_python_runs_under_the_preload_library() -> None:
    done = subprocess.run(
        ["sh", "-c", "echo ran"],
        capture_output=True,
        text=True,
        env={**os.environ, "LD_PRELOAD": preload_library_path(), "TMS_INIT_ENABLE": "1"},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ran"


def test_preloaded_entry_points_reach_the_package_s_own_core() -> None:
    """In a child started inside configure_subprocess(), the process-wide ``tms_*`` symbols
    (``ctypes.CDLL(None)``, as torch_memory_saver's examples look them up) and the package
    share one core: a tag set through one is seen through the other."""
    code = """
        import ctypes
        from gpu_pager import _native
        api = ctypes.CDLL(None)
        api.tms_set_current_tag.argtypes = [ctypes.c_char_p]
        api.tms_get_current_tag.restype = ctypes.c_char_p
        api.tms_set_current_tag(b"one-core")
        assert api.tms_get_current_tag() == b"one-core"
        assert _native._tms_tag() == "one-core"
        assert api.tms_pause(None) == 0 and api.tms_resume(None) == 0
        print("ok")
    """
    with configure_subprocess():
        assert preload_library_path() in os.environ["LD_PRELOAD"]
        done = run_python(code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
    assert preload_library_path() not in os.environ.get("LD_PRELOAD", "")


def test_the_switch_resolves_torch_memory_saver_to_gpu_pager() -> None:
    """A process whose code never names gpu_pager gets the drop-in from the environment."""
    code = """
        import torch_memory_saver
        from torch_memory_saver import torch_memory_saver as saver
        from torch_memory_saver.entrypoint import TorchMemorySaver
        from torch_memory_saver.utils import change_env
        import torch_memory_saver.testing_utils
        assert isinstance(saver, TorchMemorySaver)
        print(type(saver).__module__)
    """
    done = run_python(code, GPU_PAGER_DROP_IN="torch_memory_saver")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "gpu_pager.compat.torch_memory_saver.entrypoint"
    off = run_python("import torch_memory_saver", GPU_PAGER_DROP_IN="")
    assert off.returncode != 0 or "gpu_pager" not in off.stdout


def test_without_the_switch_the_start_up_imports_nothing_of_gpu_pager() -> None:
    """The wheel's ``.pth`` runs in every Python process of the environment: without
    ``GPU_PAGER_DROP_IN`` it must not load the package or its extension module (with the
    import machinery the switch needs, tens of milliseconds at every interpreter start)."""
    code = """
        import sys
        print(sorted(m for m in sys.modules if m.startswith("gpu_pager")))
    """
    off = run_python(code, GPU_PAGER_DROP_IN="")
    assert off.returncode == 0, off.stderr
    assert off.stdout.strip() == "[]"
    on = run_python(code, GPU_PAGER_DROP_IN="torch_memory_saver")
    assert "gpu_pager._drop_in" in on.stdout, on.stdout + on.stderr


def test_a_bad_switch_value_names_the_known_ones() -> None:
    done = run_python("print('started')", GPU_PAGER_DROP_IN="torch_memory_saverr")
    assert done.returncode == 2 and "started" not in done.stdout
    assert "unknown drop-in" in done.stderr and "torch_memory_saver" in done.stderr
    from gpu_pager import _drop_in

    with pytest.raises(ValueError, match="known: torch_memory_saver"):
        _drop_in.install("nope")


def test_region_arguments_are_checked_before_anything_happens() -> None:
    tms = TorchMemorySaver()
    with pytest.raises(ValueError, match="requires enable_cpu_backup"):
        with tms.region(enable_cpu_backup=False, cpu_backup_backend="mmap"):
            pass
    with pytest.raises(ValueError, match="'pinned' or 'mmap'"):
        with tms.region(enable_cpu_backup=True, cpu_backup_backend="disk"):  # type: ignore[arg-type]
            pass
    with pytest.raises(ValueError, match="mutually exclusive"):
        with tms.region(enable_cpu_backup=True, enable_disk_backup=True):
            pass
    with pytest.raises(ValueError, match="hook_mode"):
        tms.hook_mode = "ld_preload"  # type: ignore[assignment]


def test_preload_mode_without_the_preload_library_says_how_to_get_it() -> None:
    if "libgpu_pager_preload.so" in os.environ.get("LD_PRELOAD", ""):
        pytest.skip("this process runs with the preload library")
    tms = TorchMemorySaver()
    with pytest.raises(RuntimeError, match="configure_subprocess"):
        tms._ensure_initialized()


def _unnamed_files_in(directory: Path) -> int:
    """Files this process holds open in ``directory`` that have no name there."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.endswith(" (deleted)") and os.path.dirname(target) == str(directory):
            count += 1
    return count


def test_backup_media_through_the_pager(pager: gpu_pager.Pager, tmp_path: Path) -> None:
    pager.set_backup_dir(str(tmp_path))
    assert pager.backup_dir == str(tmp_path)
    media: list[Literal["pinned", "host", "file"]] = ["pinned", "host", "file"]
    for medium in media:
        tag = f"media-{medium}"
        info = pager.region(tag, "preserve", 8 * MIB, medium=medium)
        assert info.medium == medium
        b = pager.alloc(tag, 4096)
        pager.write(b, 0, bytes([3]) * 4096)
        pager.release(tag)
        if medium == "file":
            # The backup is a file without a name in the directory (nothing to leak).
            assert not list(tmp_path.iterdir())
            assert _unnamed_files_in(tmp_path) == 1
        pager.resume(tag, keep_host_backups=False)
        assert pager.read(b, 0, 4096) == bytes([3]) * 4096
        held = pager.region_stats(tag).backup_bytes
        assert (held == 0) == (medium == "host"), medium
        pager.remove(tag)
    assert not list(tmp_path.iterdir())
    with pytest.raises(ValueError, match="unknown backup medium"):
        pager.region("media-bad", "preserve", 8 * MIB, medium="disk")  # type: ignore[arg-type]
    with pytest.raises(gpu_pager.InvalidArgumentError, match="preserve regions"):
        pager.region("media-kv", "discard", 8 * MIB, medium="host")
    with pytest.raises(gpu_pager.InvalidArgumentError):
        pager.set_backup_dir("/proc/gpu-pager-nowhere")


def test_pager_errors_are_runtime_errors() -> None:
    assert issubclass(gpu_pager.PagerError, RuntimeError)
    assert issubclass(gpu_pager.OutOfMemoryError, RuntimeError)
    assert issubclass(gpu_pager.OutOfMemoryError, MemoryError)


def test_a_failed_core_call_raises_gpu_pager_s_exception() -> None:
    """What the drop-in's calls into the core raise: the code's class, a RuntimeError (what
    callers of torch and vLLM catch), with the core's message; nothing changes."""
    from gpu_pager import _native

    before = _native._tms_tag()
    with pytest.raises(gpu_pager.InvalidArgumentError, match="at most 224 bytes") as e:
        _native._tms_set_tag("t" * 300)
    assert isinstance(e.value, RuntimeError)
    assert _native._tms_tag() == before
    with pytest.raises(gpu_pager.InvalidArgumentError, match="directory is empty"):
        _native._tms_set_disk_dir("")
    assert _native._tms_backup_view(0x1000, 16) is None


def test_a_missing_preload_library_names_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    from gpu_pager.compat.torch_memory_saver.hooks import mode_preload

    monkeypatch.setattr(mode_preload, "PRELOAD_LIBRARY", "libgpu_pager_preload_gone.so")
    with pytest.raises(FileNotFoundError, match="hook_mode = 'torch'"):
        mode_preload.preload_library_path()
    with pytest.raises(FileNotFoundError, match="reinstall"):
        with configure_subprocess():
            pass
