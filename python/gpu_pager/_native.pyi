"""Type stubs of gpu_pager._native, the extension module (re-exported by ``gpu_pager``)."""

import os
from collections.abc import Iterable
from typing import Any, ClassVar, final

from typing_extensions import Buffer as _BytesLike, Self

__all__ = [
    "PagerError",
    "NotResidentError",
    "NotBackedError",
    "UnknownTagError",
    "BusyError",
    "OutOfMemoryError",
    "InvalidSizeError",
    "OutOfRangeError",
    "StaleBufferError",
    "RegionFullError",
    "TagConflictError",
    "CorruptedError",
    "BackupInUseError",
    "InvalidArgumentError",
    "KvError",
    "BackendError",
    "InternalError",
    "PanicError",
    "error_codes",
    "_torch_hook_state",
    "_error",
    "Pager",
    "Lease",
    "Policy",
    "State",
    "RegionInfo",
    "Buffer",
    "Steps",
    "RegionReport",
    "Report",
    "RegionStats",
    "Stats",
    "DEFAULT_ALIGN",
    "__version__",
]

_Tags = str | Iterable[str]

DEFAULT_ALIGN: int
"""Default buffer alignment in bytes (256, what CUDA's own allocators guarantee)."""

__version__: str

def error_codes() -> list[tuple[int, str]]:
    """Every error code as ``(number, name)``; the class of ``name`` is ``<name>Error``."""

def _torch_hook_state(device: int) -> tuple[str | None, str | None]:
    """``(tag, last_error)``: the calling thread's tag for torch segments on ``device``
    and the message of its last failed C call (used by ``gpu_pager.torch``)."""

@final
class Policy:
    """What happens to a region's contents across a release."""

    PRESERVE: ClassVar[Policy]
    """Copied to pinned host memory on release, restored bit-exact on resume (weights)."""
    DISCARD: ClassVar[Policy]
    """Dropped on release; the memory comes back with undefined contents (KV cache)."""
    DISCARD_ZEROED: ClassVar[Policy]
    """Dropped on release; the memory comes back zero-filled."""
    @property
    def value(self) -> str:
        """``"preserve"``, ``"discard"`` or ``"discard_zeroed"``."""
    def __int__(self) -> int: ...
    def __eq__(self, other: object, /) -> bool: ...
    def __hash__(self) -> int: ...

@final
class State:
    """Whether a region's physical memory is mapped."""

    RESIDENT: ClassVar[State]
    RELEASED: ClassVar[State]
    @property
    def value(self) -> str:
        """``"resident"`` or ``"released"``."""
    def __int__(self) -> int: ...
    def __eq__(self, other: object, /) -> bool: ...
    def __hash__(self) -> int: ...

@final
class RegionInfo:
    """A region's description, as it was when the call returned."""

    @property
    def tag(self) -> str: ...
    @property
    def base(self) -> int:
        """First device address; never changes while the region exists."""
    @property
    def size(self) -> int:
        """Reserved bytes (rounded up to the granularity)."""
    @property
    def chunk_bytes(self) -> int: ...
    @property
    def policy(self) -> Policy: ...
    @property
    def medium(self) -> str:
        """Where a ``PRESERVE`` region's contents go while released: ``"pinned"``, ``"host"``
        or ``"file"``."""
    @property
    def state(self) -> State: ...
    @property
    def kind(self) -> str:
        """How its memory is mapped: ``"fixed"``, ``"growing"`` or ``"elastic"``."""
    @property
    def id(self) -> int: ...
    @property
    def releases(self) -> int:
        """Releases that changed the region so far."""

@final
class Buffer:
    """A buffer inside a region: a handle (tag, offset, length), not a pointer."""

    @property
    def tag(self) -> str: ...
    @property
    def offset(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def device(self) -> int: ...
    def __len__(self) -> int: ...
    def __eq__(self, other: object, /) -> bool: ...
    def __hash__(self) -> int: ...

@final
class Steps:
    """Seconds spent in each step of one region's move."""

    @property
    def pin(self) -> float: ...
    @property
    def copy(self) -> float: ...
    @property
    def map(self) -> float: ...
    @property
    def unmap(self) -> float: ...
    @property
    def fill(self) -> float: ...
    @property
    def hash(self) -> float: ...
    @property
    def total(self) -> float: ...

@final
class RegionReport:
    """One region's part of a ``Report``."""

    @property
    def tag(self) -> str: ...
    @property
    def outcome(self) -> str:
        """``"done"`` or ``"already_done"``."""
    @property
    def bytes(self) -> int: ...
    @property
    def copied(self) -> int: ...
    @property
    def steps(self) -> Steps: ...
    @property
    def seconds(self) -> float: ...

@final
class Report:
    """What one ``release`` or ``resume`` call did."""

    @property
    def op(self) -> str:
        """``"release"`` or ``"resume"``."""
    @property
    def regions(self) -> list[RegionReport]: ...
    @property
    def bytes(self) -> int: ...
    @property
    def copied(self) -> int: ...
    @property
    def seconds(self) -> float: ...
    @property
    def sync_seconds(self) -> float: ...
    def region(self, tag: str) -> RegionReport | None: ...

@final
class RegionStats:
    """Statistics of one region."""

    @property
    def info(self) -> RegionInfo: ...
    @property
    def tag(self) -> str: ...
    @property
    def resident_bytes(self) -> int: ...
    @property
    def released_bytes(self) -> int: ...
    @property
    def allocated_bytes(self) -> int: ...
    @property
    def buffers(self) -> int: ...
    @property
    def backup_bytes(self) -> int: ...
    @property
    def held_bytes(self) -> int: ...
    @property
    def marked_bytes(self) -> int: ...
    @property
    def leases(self) -> int: ...
    @property
    def last_release(self) -> RegionReport | None: ...
    @property
    def last_resume(self) -> RegionReport | None: ...

@final
class Stats:
    """Statistics of the whole pager."""

    @property
    def regions(self) -> list[RegionStats]: ...
    @property
    def resident_bytes(self) -> int: ...
    @property
    def released_bytes(self) -> int: ...
    @property
    def backup_bytes(self) -> int: ...
    @property
    def deferred_errors(self) -> list[str]:
        """Failures no call could return, not yet taken; each also logged (``"gpu_pager"``)."""
    @property
    def deferred_errors_total(self) -> int: ...
    def region(self, tag: str) -> RegionStats | None: ...

@final
class Lease:
    """Keeps tags resident while open; a context manager."""

    @property
    def tags(self) -> list[str]: ...
    @property
    def active(self) -> bool: ...
    def close(self) -> None:
        """Ends the lease; closing twice is harmless."""
    def __enter__(self) -> Self: ...
    def __exit__(self, *_exc: object) -> bool: ...

@final
class Pager:
    """The process's pager for one device; get it with ``Pager.for_device(device)``."""

    @staticmethod
    def for_device(device: int = 0) -> Pager:
        """The pager of CUDA device ``device``, created on first use."""
    @property
    def device(self) -> int: ...
    @property
    def backend(self) -> str:
        """``"cuda"`` or ``"host"``."""
    @property
    def host_fallback(self) -> str | None:
        """Why the pager runs on host memory, or ``None`` on a GPU."""
    def region(
        self,
        tag: str,
        policy: Policy | str,
        bytes: int | None = None,
        prepin: bool = False,
        medium: str = "pinned",
        kind: str | None = None,
    ) -> RegionInfo:
        """Creates region ``tag`` (or returns the same existing one): ``kind`` ``"fixed"``
        (the default with ``bytes``) or ``"growing"`` (the default without)."""
    def set_backup_dir(self, path: str | os.PathLike[str]) -> None:
        """Where new ``"file"`` backups go (created if missing, checked by a write)."""
    @property
    def backup_dir(self) -> str | None:
        """The directory of new ``"file"`` backups, or ``None``."""
    def remove(self, tag: str) -> None: ...
    def tags(self) -> list[str]: ...
    def info(self, tag: str) -> RegionInfo: ...
    def alloc(self, tag: str, nbytes: int, align: int | None = None) -> Buffer: ...
    def free(self, buf: Buffer) -> None: ...
    def ptr(self, buf: Buffer) -> int: ...
    def buffer_containing(self, ptr: int) -> tuple[Buffer, int] | None: ...
    def write(self, buf: Buffer, offset: int, data: _BytesLike) -> None: ...
    def read(self, buf: Buffer, offset: int, n: int) -> bytes: ...
    def set_overwritten(
        self,
        buf: Buffer,
        on: bool = True,
        offset: int | None = None,
        length: int | None = None,
    ) -> None:
        """Marks (or unmarks) bytes of ``buf`` as overwritten by the next update: releases
        neither save nor restore them."""
    def overwritten(self, buf: Buffer) -> list[tuple[int, int]]:
        """The ``(start, end)`` byte ranges of ``buf`` marked overwritten."""
    def read_backup(self, buf: Buffer, offset: int, n: int) -> bytes:
        """``n`` bytes of a released buffer from its pinned host backup."""
    def release(self, tags: _Tags, drop: _Tags | None = None) -> Report: ...
    def resume(self, tags: _Tags, keep_host_backups: bool = False) -> Report: ...
    def resume_on(self, tags: _Tags, stream: int | Any) -> Report:
        """``resume`` with the copies enqueued on ``stream`` (int or ``.cuda_stream``)."""
    def resume_and_lease(self, tags: _Tags) -> tuple[Report, Lease]: ...
    def lease(self, tags: _Tags) -> Lease: ...
    def stats(self) -> Stats: ...
    def region_stats(self, tag: str) -> RegionStats: ...
    def take_deferred_errors(self) -> list[str]:
        """Takes the failures no call could return (``Stats.deferred_errors``)."""
    def __eq__(self, other: object, /) -> bool: ...
    def __hash__(self) -> int: ...

def _error(code: int, message: str, tags: list[str] = ...) -> PagerError: ...

class PagerError(RuntimeError):
    """Base class of every error gpu_pager raises; ``.tag``, ``.tags``, ``.code``, message."""

    code: int
    tag: str | None
    tags: list[str]

class NotResidentError(PagerError): ...
class NotBackedError(PagerError): ...
class UnknownTagError(PagerError): ...
class BusyError(PagerError): ...
class OutOfMemoryError(PagerError, MemoryError): ...
class InvalidSizeError(PagerError): ...
class OutOfRangeError(PagerError): ...
class StaleBufferError(PagerError): ...
class RegionFullError(PagerError): ...
class TagConflictError(PagerError): ...
class CorruptedError(PagerError): ...
class BackupInUseError(PagerError): ...
class InvalidArgumentError(PagerError): ...
class KvError(PagerError): ...
class BackendError(PagerError): ...
class InternalError(PagerError): ...
class PanicError(PagerError): ...
