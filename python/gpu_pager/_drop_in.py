"""Switching an engine to gpu_pager's drop-ins without editing it.

With ``GPU_PAGER_DROP_IN=torch_memory_saver`` (a comma-separated list of the names in
``NAMES``, or ``all``) in the environment, ``import torch_memory_saver`` and
its submodules resolve to ``gpu_pager.compat.torch_memory_saver`` in every Python process
of that environment, child processes included. The wheel installs ``gpu_pager_drop_in.pth``,
which Python runs at start-up: with the variable set it imports this module and calls
:func:`_startup`; without it, it reads the variable and imports nothing (the line runs in
every Python process of the environment).

Names are matched in any case. A name that is no drop-in stops every Python process of the
environment at start (one line on stderr, exit status 2): the variable exists only to switch
a drop-in on, and a typo must not leave an engine on its own allocator unnoticed. Anything
else that goes wrong in the switch (a broken install, an exception of any kind,
``SystemExit`` included) leaves the program running without the drop-ins and costs at most
one line on stderr; it runs once per process even where the ``.pth`` file is seen twice (a
venv's ``lib64`` symlink). ``0``, ``off``, ``false``, ``no`` and ``none`` (any case) switch
it off, as an empty value does.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from types import ModuleType
from typing import Sequence

ENV = "GPU_PAGER_DROP_IN"
"""The environment variable that names the drop-ins to switch on."""

ALIASES = {
    "torch_memory_saver": "gpu_pager.compat.torch_memory_saver",
}
"""Module name → the gpu_pager module that stands in for it, by drop-in name."""

NAMES = (*ALIASES, "vllm")
"""Every drop-in the variable can name: the aliased modules, and ``vllm`` (switched on by
the ``vllm.general_plugins`` entry point that vLLM loads, ``gpu_pager.compat.vllm``)."""


OFF = ("", "0", "off", "false", "no", "none")
"""Values of the variable that switch every drop-in off (compared stripped, in lower case;
``gpu_pager_drop_in.pth`` checks the same ones before importing anything)."""


def _short(text: str, most: int) -> str:
    """``text``, cut to ``most`` characters with ``...`` where it is longer (values from the
    environment are echoed in messages, and may be long)."""
    return text if len(text) <= most else text[: most - 3] + "..."


def _named(asked: str) -> set[str]:
    """The names in a value of ``$GPU_PAGER_DROP_IN`` (comma-separated, blanks ignored, any
    case; none for a value in :data:`OFF`)."""
    if asked.strip().lower() in OFF:
        return set()
    return {n.strip().lower() for n in asked.split(",") if n.strip()}


def wanted(name: str) -> bool:
    """Whether ``$GPU_PAGER_DROP_IN`` names drop-in ``name`` (or ``all``)."""
    chosen = _named(os.environ.get(ENV, ""))
    return name in chosen or "all" in chosen


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports of ``name`` and ``name.*`` get gpu_pager's module ``target`` (and its
    submodules), the very module objects, so both names share one state."""

    def __init__(self, name: str, target: str) -> None:
        self.name = name
        self.target = target

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        """The spec of ``fullname`` as gpu_pager's module: its file as ``origin``, and
        ``None`` for a submodule that does not exist (as for any missing module)."""
        if fullname != self.name and not fullname.startswith(self.name + "."):
            return None
        real = importlib.util.find_spec(self.target + fullname[len(self.name) :])
        if real is None:
            return None
        spec = importlib.machinery.ModuleSpec(
            fullname,
            self,
            origin=real.origin,
            is_package=real.submodule_search_locations is not None,
        )
        if real.submodule_search_locations is not None:
            spec.submodule_search_locations = list(real.submodule_search_locations)
        spec.has_location = real.has_location
        return spec

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(self.target + spec.name[len(self.name) :])

    def exec_module(self, module: ModuleType) -> None:
        """Nothing: the module ran when gpu_pager imported it."""


def install(names: str | None = None) -> list[str]:
    """Puts the drop-ins ``names`` (default: ``$GPU_PAGER_DROP_IN``) in front of every other
    importer; returns the module names now resolved to gpu_pager. Unknown names raise
    ``ValueError`` naming the known ones."""
    asked = os.environ.get(ENV, "") if names is None else names
    chosen = _named(asked)
    if "all" in chosen:
        chosen = set(NAMES)
    unknown = chosen - set(NAMES)
    if unknown:
        names_shown = ", ".join(_short(n, 40) for n in sorted(unknown)[:5])
        more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
        raise ValueError(
            f"{ENV}={_short(asked, 80)!r}: unknown drop-in {names_shown}{more}; known: "
            f"{', '.join(sorted(NAMES))} (or all)"
        )
    done = []
    for name in sorted(chosen & set(ALIASES)):
        if any(isinstance(f, _Alias) and f.name == name for f in sys.meta_path):
            continue
        sys.meta_path.insert(0, _Alias(name, ALIASES[name]))
        done.append(name)
    return done


def vllm_plugins_problem() -> str | None:
    """Why vLLM would not load gpu_pager's entry point, or ``None``: vLLM loads only the
    plugins that ``VLLM_PLUGINS`` names (comma-separated, as vLLM splits it) when it is
    set."""
    allowed = os.environ.get("VLLM_PLUGINS")
    if allowed is None or "gpu_pager" in allowed.split(","):
        return None
    return (
        f"{ENV} names vllm, but VLLM_PLUGINS={_short(allowed, 80)!r} does not name gpu_pager, "
        "so vLLM "
        "keeps its own allocator: add gpu_pager to VLLM_PLUGINS"
    )


_started = False


def _startup() -> None:
    """What the ``.pth`` file runs, once per process: :func:`install` when the variable is
    set. A name that is no drop-in stops the process at start with one line on stderr and
    exit status 2: the variable exists only to switch a drop-in on, so a typo must not run
    the engine on its own allocator unnoticed. A ``VLLM_PLUGINS`` that keeps vLLM from
    switching is reported in one line and the process runs on (an exception in a ``.pth``
    line would print a traceback, or stop the interpreter with a fatal error)."""
    global _started
    if _started or not _named(os.environ.get(ENV, "")):
        return
    _started = True
    try:
        install()
    except ValueError as e:
        sys.stderr.write(f"gpu_pager: {e}; fix the name or unset {ENV}\n")
        sys.stderr.flush()
        os._exit(2)
    problem = vllm_plugins_problem() if wanted("vllm") else None
    if problem:
        print(f"gpu_pager: {problem}", file=sys.stderr)
