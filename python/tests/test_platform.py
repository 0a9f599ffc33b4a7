"""Where the package runs: the NVIDIA driver floor and the torch floor, each refused below
with an error that names what was found and what is needed; and the build's CUDA pins."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

import gpu_pager.torch as gpt
from fresh import run_python

ROOT = Path(__file__).resolve().parents[2]


def _stub_driver(folder: Path) -> Path:
    """Builds the stand-in driver (tests/driver_stub/libcuda.c) as ``folder/libcuda.so``."""
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        pytest.fail(f"the C compiler `{cc}` is needed to build the stand-in driver (set CC)")
    subprocess.run(
        [cc, "-shared", "-fPIC", "-o", str(folder / "libcuda.so"), str(ROOT / "tests/driver_stub/libcuda.c")],
        check=True,
    )
    return folder


def test_a_driver_below_the_floor_is_a_backend_error(tmp_path: Path) -> None:
    done = run_python(
        """
        import gpu_pager
        try:
            gpu_pager.Pager.for_device(0)
        except gpu_pager.BackendError as e:
            print("refused:", e)
        """,
        LD_LIBRARY_PATH=str(_stub_driver(tmp_path)),
        GPU_PAGER_STUB_DRIVER_VERSION="11080",
    )
    assert done.returncode == 0, done.stderr
    assert "refused:" in done.stdout, done.stdout
    for part in ("CUDA 11.8", "CUDA 12.0 or newer", "update the NVIDIA driver"):
        assert part in done.stdout, done.stdout


def test_a_driver_at_the_floor_passes_the_check(tmp_path: Path) -> None:
    """The stand-in has no device: past the check, device 0 runs on the host backend."""
    done = run_python(
        """
        import gpu_pager
        print(gpu_pager.Pager.for_device(0).backend)
        """,
        LD_LIBRARY_PATH=str(_stub_driver(tmp_path)),
        GPU_PAGER_STUB_DRIVER_VERSION="12000",
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "host", done.stdout


@pytest.mark.parametrize("version", ["2.8.0", "2.9.1+cu128", "2.11.0+cu130", "3.0.0a0"])
def test_supported_torch_versions(version: str) -> None:
    gpt.check_torch_version(version)


@pytest.mark.parametrize("version", ["2.7.1+cu126", "2.5.0", "1.13.1", "unknown"])
def test_older_torch_is_refused_naming_both_versions(version: str) -> None:
    with pytest.raises(ImportError, match=rf"needs torch 2\.8 or newer, and this process has torch {re.escape(version)}"):
        gpt.check_torch_version(version)


def test_the_torch_layer_refuses_an_old_torch_at_first_use(tmp_path: Path) -> None:
    """A stand-in ``torch`` package of version 2.7.1 on ``PYTHONPATH``: the first call that
    needs torch raises ``ImportError`` (the module itself imports without torch)."""
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text('__version__ = "2.7.1+cu126"\n')
    done = run_python(
        """
        import gpu_pager.torch as gpt
        try:
            gpt.allocator()
        except ImportError as e:
            print("refused:", e)
        """,
        PYTHONPATH=str(tmp_path),
    )
    assert done.returncode == 0, done.stderr
    assert "refused: gpu_pager.torch needs torch 2.8 or newer" in done.stdout, done.stdout


def test_without_torch_use_says_what_it_needs_and_how_to_go_without(tmp_path: Path) -> None:
    """No torch at all (a ``torch`` that cannot be imported): ``use()`` raises
    ``ModuleNotFoundError`` naming the torch it needs and the pager that works without it,
    not a bare "No module named 'torch'" (review item 17)."""
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'torch'\", name='torch')\n")
    done = run_python(
        """
        import gpu_pager.torch as gpt
        try:
            with gpt.use("weights"):
                pass
        except ModuleNotFoundError as e:
            print("refused:", e)
        """,
        PYTHONPATH=str(tmp_path),
    )
    assert done.returncode == 0, done.stderr
    assert "refused: gpu_pager.torch (and the drop-ins) need torch 2.8 or newer" in done.stdout, done.stdout
    assert "gpu_pager.Pager.for_device(0)" in done.stdout


def test_the_build_requirements_pin_the_toolchains_cuda() -> None:
    """pip install ./python and scripts/toolchain build with the same CUDA 12 compilers."""
    pyproject = tomllib.loads((ROOT / "python/pyproject.toml").read_text())
    requires = set(pyproject["build-system"]["requires"])
    toolchain = (ROOT / "scripts/toolchain").read_text()
    pinned = set(re.findall(r'"((?:nvidia-cuda-nvrtc-cu12|nvidia-nvfatbin-cu12|libclang)==[^"]+)"', toolchain))
    assert len(pinned) == 3, pinned
    assert pinned <= requires, (pinned, requires)
