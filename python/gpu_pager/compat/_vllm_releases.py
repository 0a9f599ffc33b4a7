"""The vLLM releases the vLLM drop-in knows, and how each one's sleep protocol looks.

vLLM changed its sleep protocol several times; a drop-in that answers one release's calls
with another's semantics drops weights without a word (a ``suspend(set())`` read as a sleep
level). So the drop-in reads the running vLLM's version and the signatures that its calls
depend on, and refuses a vLLM that is not one of these, naming the ones it knows.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
from typing import Any

__all__ = ["Protocol", "PROTOCOLS", "NEWEST", "SUPPORTED", "Found", "detect"]


@dataclasses.dataclass(frozen=True)
class Protocol:
    """One sleep protocol of vLLM's, as its worker and backends call the allocator."""

    releases: str
    """The releases that speak it, as users name them (``"0.29, 0.31"``)."""
    minors: tuple[int, ...]
    """The ``0.<minor>`` versions that speak it (every patch release of each)."""
    suspend: str | None
    """What ``SleepModeBackend.suspend`` takes: ``"level"`` (an int, 1 or 2),
    ``"discardable"`` (the storage addresses that the weight update rewrites), or ``None``
    where the release has no backends (the worker calls the allocator)."""
    sleep_discardable: bool
    """Whether ``MemAllocator.sleep`` takes ``discardable`` after ``offload_tags``."""
    deferrable: bool
    """Whether a selective wake-up wakes every tag but the ``DEFERRABLE_TAGS`` too (else it
    wakes the named tags only)."""
    discard: bool
    """Whether the allocator protocol has ``discard(tags)``."""


PROTOCOLS: tuple[Protocol, ...] = (
    Protocol("0.24", (24,), None, False, False, False),
    Protocol("0.29, 0.31", (29, 31), "level", False, False, True),
    Protocol("0.33", (33,), "level", False, True, True),
    Protocol("0.34", (34,), "discardable", True, True, True),
)
"""Every protocol the drop-in speaks; each was driven by its releases' own sleep code on a
GPU (``scripts/gpu-check engines``)."""

NEWEST = PROTOCOLS[-1]
"""The protocol of a vLLM whose version cannot be read (a source tree, a stand-in)."""

SUPPORTED = ", ".join(f"0.{m}" for p in PROTOCOLS for m in p.minors)
"""The releases the drop-in supports, for messages."""


@dataclasses.dataclass(frozen=True)
class Found:
    """What :func:`detect` read from the running vLLM."""

    version: str | None
    protocol: Protocol | None
    """The release's protocol, or ``None`` when the drop-in does not know it."""
    problem: str | None
    """Why the protocol is not known (``None`` when it is)."""


def _version(vllm: Any) -> str | None:
    version = getattr(vllm, "__version__", None)
    if isinstance(version, str):
        return version
    try:
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as dist_version

        return dist_version("vllm")
    except (PackageNotFoundError, ValueError):
        return None


def _params(function: Any) -> list[str] | None:
    """The parameter names of ``function`` after ``self``, or ``None`` without one."""
    if function is None:
        return None
    try:
        names = list(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return None
    return names[1:] if names[:1] == ["self"] else names


def _import(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _minor(version: str) -> int | None:
    m = re.match(r"0\.(\d+)(?:\.|$|[a-z+])", version)
    return int(m.group(1)) if m else None


def detect(package: str = "vllm.device_allocator") -> Found:
    """Reads the running vLLM's version and sleep protocol (``package``: where its
    allocator package is). A version the drop-in does not know, or a release whose
    signatures are not those of its protocol, is a :class:`Found` with ``problem`` set."""
    vllm = _import("vllm")
    version = None if vllm is None else _version(vllm)
    allocators = _import(package)
    if allocators is None:
        return Found(version, None, f"this vLLM has no {package}")
    minor = None if version is None else _minor(version)
    expected = next((p for p in PROTOCOLS if minor in p.minors), None)
    if expected is None:
        return Found(
            version,
            None,
            f"gpu_pager's vLLM drop-in knows the sleep protocols of vLLM {SUPPORTED}, "
            f"not vLLM {version or '(version unknown)'}'s",
        )
    seen: dict[str, bool | str | None] = {
        "MemAllocator.sleep takes discardable": "discardable"
        in (_params(getattr(getattr(allocators, "MemAllocator", None), "sleep", None)) or ()),
        "DEFERRABLE_TAGS exists": hasattr(allocators, "DEFERRABLE_TAGS"),
    }
    want: dict[str, bool | str | None] = {
        "MemAllocator.sleep takes discardable": expected.sleep_discardable,
        "DEFERRABLE_TAGS exists": expected.deferrable,
    }
    backends = _import(package + ".sleep_mode_backend")
    suspend = _params(getattr(getattr(backends, "SleepModeBackend", None), "suspend", None))
    seen["SleepModeBackend.suspend takes"] = suspend[0] if suspend else None
    want["SleepModeBackend.suspend takes"] = expected.suspend
    wrong = [f"{k}: {seen[k]} (vLLM {expected.releases}: {want[k]})" for k in want if seen[k] != want[k]]
    if wrong:
        return Found(
            version,
            None,
            f"vLLM {version} does not speak the sleep protocol of vLLM {expected.releases} "
            f"that gpu_pager's drop-in knows ({'; '.join(wrong)})",
        )
    return Found(version, expected, None)
