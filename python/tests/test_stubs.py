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
    """The stubs are usable: the package's Python code, these tests, the benchmarks and the
    engine releases' checks (both run only on a GPU machine) type-check."""
    pytest.importorskip("mypy", reason="mypy is not installed")
    env = dict(os.environ)
    env.setdefault("MYPY_CACHE_DIR", os.path.join(tempfile.gettempdir(), "gpu_pager-mypy-cache"))
    root = os.path.dirname(CONFIG)
    # Two runs: the tests' stand-in vLLM and the engine checks' shim are both a package
    # named vllm.
    for paths in (["gpu_pager", "tests", "bench"], ["engines"]):
        done = subprocess.run(
            [sys.executable, "-m", "mypy", "--config-file", CONFIG, *paths],
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


# The stubs' settings blocks are generated from the settings table (gpu_pager.settings()):
# a new setting is a row of the table; GPU_PAGER_FIX_STUBS=1 rewrites the blocks.
SOURCE_STUBS = os.path.join(os.path.dirname(CONFIG), "gpu_pager", "_native.pyi")
_TYPES = {"bytes": "int", "switch": "bool", "route": "_RouteName"}


def _docstring(text: str, indent: str) -> list[str]:
    """``text`` as a stub docstring at ``indent``, wrapped at 92 columns."""
    import textwrap

    body = textwrap.fill(" ".join(text.split()), 92 - len(indent) - 3).splitlines()
    lines = [f'{indent}"""{body[0]}'] + [indent + line for line in body[1:]]
    lines[-1] += '"""'
    return lines


def _settings_blocks() -> dict[str, list[str]]:
    rows = gpu_pager.settings()
    shown = {True: "True", False: "False"}
    listed = " ".join(
        f"``{name}`` ({kind}, default ``{shown.get(default, repr(default)) if isinstance(default, bool) else repr(default)}``): {doc}"
        for name, kind, default, doc in rows
    )
    configure = (
        ["def configure(", "    device: int = 0,", "    *,"]
        + [f"    {name}: {_TYPES[kind]} | None = None," for name, kind, _, _ in rows]
        + [") -> None:"]
        + _docstring(f"{inspect.getdoc(gpu_pager.configure)} The settings: {listed}", "    ")
    )
    config = ["class Config:"] + _docstring(inspect.getdoc(gpu_pager.Config) or "", "    ")
    for name, kind, _, doc in rows:
        config += ["", "    @property", f"    def {name}(self) -> {_TYPES[kind]}:"] + _docstring(doc, "        ")
    return {"configure": configure, "Config": config}


def test_the_stubs_settings_blocks_are_the_settings_table() -> None:
    with open(SOURCE_STUBS, encoding="utf-8") as f:
        text = f.read()
    lines = text.splitlines()
    stale = []
    for name, want in _settings_blocks().items():
        begin, end = f"# <settings:{name}>", f"# </settings:{name}>"
        a, b = lines.index(begin), lines.index(end)
        if lines[a + 1 : b] != want:
            stale.append(name)
            lines[a + 1 : b] = want
    if stale and os.environ.get("GPU_PAGER_FIX_STUBS") == "1":
        with open(SOURCE_STUBS, "w", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")
        return
    assert not stale, f"{stale} differ from the settings table: run with GPU_PAGER_FIX_STUBS=1"
