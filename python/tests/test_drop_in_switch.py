"""The start-up switch (``GPU_PAGER_DROP_IN`` and the wheel's ``.pth`` file) never clutters
a program and stops it only for a name that is no drop-in: whatever else goes wrong in it,
the program runs and exits as it would, with at most one line on stderr; names match in any
case; off values switch it off; it runs once per process; and ``torch_memory_saver`` found
through it looks like a module with files."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fresh import run_python

PROGRAM = "print('ran')"


def _site_packages_with_the_pth() -> Path:
    """The site-packages directory holding ``gpu_pager_drop_in.pth``."""
    for entry in map(Path, sys.path):
        if (entry / "gpu_pager_drop_in.pth").is_file():
            return entry
    pytest.skip("gpu_pager_drop_in.pth is not installed in this environment")


def _check_unstopped(done: subprocess.CompletedProcess[str]) -> None:
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ran", done.stdout + done.stderr
    assert len(done.stderr.splitlines()) <= 1, done.stderr


@pytest.mark.parametrize(
    "raised",
    [
        "SystemExit(3)",
        "KeyboardInterrupt()",
        "ImportError('a broken install')",
        "BaseException('a pyo3 panic is a BaseException')",
    ],
)
@pytest.mark.parametrize("where", ["package", "switch"])
def test_no_exception_in_the_switch_stops_a_program(
    tmp_path: Path, raised: str, where: str
) -> None:
    """A stand-in ``gpu_pager`` ahead of the real one on the path raises at import (a broken
    install) or in ``_startup`` (a bug, an interrupt, an exit): the program still runs."""
    package = tmp_path / "gpu_pager"
    package.mkdir()
    if where == "package":
        (package / "__init__.py").write_text(f"raise {raised}\n")
    else:
        (package / "__init__.py").write_text("")
        (package / "_drop_in.py").write_text(f"def _startup():\n    raise {raised}\n")
    done = run_python(
        PROGRAM,
        GPU_PAGER_DROP_IN="torch_memory_saver",
        PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
    )
    _check_unstopped(done)
    assert "gpu_pager" in done.stderr, "one line says the switch is off"


@pytest.mark.parametrize("value", ["0", "off", "OFF", "false", "no", "None", " "])
def test_off_values_switch_it_off(value: str) -> None:
    code = """
        import sys
        print(sorted(m for m in sys.modules if m.startswith("gpu_pager")))
    """
    done = run_python(code, GPU_PAGER_DROP_IN=value)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", f"{value!r}: {done.stdout}"
    assert done.stderr == ""
    from gpu_pager import _drop_in

    assert not _drop_in._named(value)


def test_the_pth_seen_twice_runs_the_switch_once(tmp_path: Path) -> None:
    """A venv's ``lib64 -> lib`` symlink puts site-packages on the path twice: the switch's
    warning about a bad value still prints once."""
    site_packages = _site_packages_with_the_pth()
    twin = tmp_path / "lib64-site-packages"
    twin.symlink_to(site_packages, target_is_directory=True)
    code = f"""
        import site
        site.addsitedir({str(site_packages)!r})
        site.addsitedir({str(twin)!r})
        print('ran')
    """
    done = subprocess.run(
        [sys.executable, "-S", "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env={**os.environ, "GPU_PAGER_DROP_IN": "vllm", "VLLM_PLUGINS": "other"},
        timeout=120,
    )
    _check_unstopped(done)
    assert done.stderr.count("gpu_pager:") == 1, done.stderr


@pytest.mark.parametrize("value", ["VLLM", "Torch_Memory_Saver", " vllm , TORCH_MEMORY_SAVER ", "ALL"])
def test_names_match_in_any_case(value: str) -> None:
    code = """
        import sys
        from gpu_pager import _drop_in
        print(_drop_in.wanted("vllm") or _drop_in.wanted("torch_memory_saver"))
    """
    done = run_python(code, GPU_PAGER_DROP_IN=value)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True", done.stdout + done.stderr
    assert done.stderr == ""


@pytest.mark.parametrize("value", ["vlm", "vllm,nope", "torch_memory_saverr"])
def test_an_unknown_name_stops_the_process_at_start(value: str) -> None:
    """A typo in the variable must not run the engine on its own allocator unnoticed
    (review item 13): one line naming the known drop-ins, exit status 2, nothing run."""
    done = run_python(PROGRAM, GPU_PAGER_DROP_IN=value)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout == ""
    assert len(done.stderr.splitlines()) == 1, done.stderr
    assert "unknown drop-in" in done.stderr and "known: torch_memory_saver, vllm" in done.stderr


def test_a_long_value_is_not_echoed_whole() -> None:
    """A 100 kB value costs one short line on stderr, not the value twice."""
    done = run_python(PROGRAM, GPU_PAGER_DROP_IN="x" * 100_000, VLLM_PLUGINS="y" * 100_000)
    assert done.returncode == 2
    assert "unknown drop-in" in done.stderr
    assert len(done.stderr) < 1000, len(done.stderr)


def test_find_spec_sees_torch_memory_saver_s_files() -> None:
    code = """
        import importlib.util
        spec = importlib.util.find_spec("torch_memory_saver")
        print(spec.origin)
        print(spec.submodule_search_locations is not None)
        print(importlib.util.find_spec("torch_memory_saver.nope"))
        print(importlib.util.find_spec("torch_memory_saver.entrypoint").origin)
    """
    done = run_python(code, GPU_PAGER_DROP_IN="torch_memory_saver")
    assert done.returncode == 0, done.stderr
    origin, package, missing, sub = done.stdout.split("\n")[:4]
    assert origin.endswith(os.path.join("torch_memory_saver", "__init__.py")), origin
    assert Path(origin).is_file()
    assert package == "True"
    assert missing == "None", "a missing submodule is None, not an exception"
    assert sub.endswith(os.path.join("torch_memory_saver", "entrypoint.py")), sub
