"""The type stubs match the module (mypy's stubtest), and every public name has a
docstring at run time."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import tempfile

import pytest

import gpu_pager
import gpu_pager._native as native


CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pyproject.toml")
# The preload library is a shared object in the package that is no Python module.
ALLOWLIST = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stubtest_allowlist.txt")


def test_stubtest() -> None:
    pytest.importorskip("mypy.stubtest", reason="mypy is not installed")
    env = dict(os.environ)
    env.setdefault("MYPY_CACHE_DIR", os.path.join(tempfile.gettempdir(), "gpu_pager-mypy-cache"))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy.stubtest",
            "gpu_pager",
            "--mypy-config-file",
            CONFIG,
            "--allowlist",
            ALLOWLIST,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_mypy_strict_on_the_package_and_tests() -> None:
    """The stubs are usable: the package's Python code, these tests and the benchmarks (run
    only on a GPU machine) type-check."""
    pytest.importorskip("mypy", reason="mypy is not installed")
    env = dict(os.environ)
    env.setdefault("MYPY_CACHE_DIR", os.path.join(tempfile.gettempdir(), "gpu_pager-mypy-cache"))
    root = os.path.dirname(CONFIG)
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", CONFIG, "gpu_pager", "tests", "bench"],
        capture_output=True,
        text=True,
        env=env,
        cwd=root,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_public_item_of_the_stubs_has_a_docstring() -> None:
    """What an editor shows comes from the stubs: every public class, function, method and
    property there says what it is."""
    import ast

    stubs = os.path.join(os.path.dirname(native.__file__), "_native.pyi")
    with open(stubs, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    missing = [
        f"{node.name} (line {node.lineno})"
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.ClassDef))
        and not node.name.startswith("_")
        and ast.get_docstring(node) is None
    ]
    assert not missing, missing


def test_every_public_name_has_a_docstring() -> None:
    for name in gpu_pager.__all__:
        if name.startswith("__"):
            continue
        obj = getattr(gpu_pager, name)
        if isinstance(obj, int):
            continue
        assert inspect.getdoc(obj), name
        if isinstance(obj, type) and obj.__module__ == "gpu_pager" and obj in vars(native).values():
            for attr, member in vars(obj).items():
                if attr.startswith("_"):
                    continue
                if callable(member) or inspect.isdatadescriptor(member):
                    assert inspect.getdoc(member), f"{name}.{attr}"
