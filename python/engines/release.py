"""One engine release, as the checks run it: its own files (from scripts/engines-extract)
over the stand-ins of ``shim/`` in one import root, and the methods of its worker or
scheduler taken from its source by name, so that the release's own code makes the calls."""

from __future__ import annotations

import ast
import json
import os
import shutil
import sys
import tempfile
import textwrap
import time
import traceback
from collections.abc import Callable
from typing import Any

SHIM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "shim")


def version(release: str) -> str:
    """The release's version (its ``VERSION`` file)."""
    with open(os.path.join(release, "VERSION")) as f:
        return f.read().strip()


def version_numbers(release: str) -> tuple[int, ...]:
    """The release's version as numbers, for comparisons (``(0, 34, 0)``)."""
    return tuple(int(x) for x in version(release).split("."))


def import_root(release: str, engine: str) -> str:
    """A temporary directory holding the stand-in package ``engine`` with the release's own
    files over it; put first on ``sys.path``."""
    root = tempfile.mkdtemp(prefix=f"{engine}-{version(release)}-")
    shutil.copytree(os.path.join(SHIM, engine), os.path.join(root, engine))
    shutil.copytree(os.path.join(release, engine), os.path.join(root, engine), dirs_exist_ok=True)
    shutil.copy(os.path.join(release, "VERSION"), root)
    sys.path.insert(0, root)
    return root


def _function_source(src: str, node: ast.FunctionDef) -> str:
    lines = src.splitlines()
    first = min([d.lineno for d in node.decorator_list] + [node.lineno])
    assert node.end_lineno is not None
    return textwrap.dedent("\n".join(lines[first - 1 : node.end_lineno]))


def methods(source: str, names: tuple[str, ...]) -> dict[str, str]:
    """The source of each method among ``names`` that a class of file ``source`` defines
    (decorators included), by name."""
    with open(source) as f:
        src = f.read()
    found: dict[str, str] = {}
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.ClassDef):
            for fn in node.body:
                if isinstance(fn, ast.FunctionDef) and fn.name in names and fn.name not in found:
                    found[fn.name] = _function_source(src, fn)
    return found


def functions(source: str, names: tuple[str, ...]) -> dict[str, str]:
    """The source of each module-level function among ``names`` in file ``source``."""
    with open(source) as f:
        src = f.read()
    return {
        n.name: _function_source(src, n)
        for n in ast.parse(src).body
        if isinstance(n, ast.FunctionDef) and n.name in names
    }


def build_class(name: str, sources: dict[str, str], namespace: dict[str, Any]) -> type:
    """A class ``name`` whose methods are ``sources`` (the release's code), run with
    ``namespace`` as their module globals."""
    body = "\n".join(textwrap.indent(s, "    ") for s in sources.values()) or "    pass"
    code = f"from __future__ import annotations\n\nclass {name}:\n{body}\n"
    exec(compile(code, f"<release {name}>", "exec"), namespace)
    built: type = namespace[name]
    return built


def build_functions(sources: dict[str, str], namespace: dict[str, Any]) -> None:
    """Defines ``sources`` (the release's module-level functions) in ``namespace``."""
    code = "from __future__ import annotations\n\n" + "\n\n".join(sources.values())
    exec(compile(code, "<release functions>", "exec"), namespace)


def run_checks(release: str, switch: str, checks: list[tuple[str, Callable[[], str]]]) -> None:
    """Runs each check in turn and prints its JSON row (a failed check is a row with its
    exception, not the end of the run; its traceback goes to stderr)."""
    for check, run in checks:
        t = time.perf_counter()
        try:
            detail, ok = run(), True
        except Exception as e:  # noqa: BLE001
            detail, ok = f"{type(e).__name__}: {e}", False
            traceback.print_exc()
        row = {"release": release, "switch": switch, "check": check, "ok": ok, "detail": detail,
               "seconds": round(time.perf_counter() - t, 3)}
        print(json.dumps(row), flush=True)
