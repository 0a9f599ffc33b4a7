"""Type stubs of gpu_pager._native, the extension module (re-exported by ``gpu_pager``)."""

import os
from collections.abc import Callable, Iterable
from typing import Any, ClassVar, Literal, final

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
    "CompanionError",
    "PanicError",
    "error_codes",
    "_torch_hook_state",
    "_error",
    "_use_tag",
    "_keep_forever",
    "_tms_set_tag",
    "_tms_tag",
    "_tms_pause",
    "_tms_resume",
    "_tms_set_disk_dir",
    "_tms_set_retain",
    "_tms_retain",
    "_tms_set_margin",
    "_tms_backup_view",
    "configure",
    "settings",
    "Config",
    "Audit",
    "AuditRegion",
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
    "POISON",
    "__version__",
]

_Tags = str | Iterable[str]
_PolicyName = Literal["preserve", "discard", "discard_zeroed"]
"""A policy by name, where a ``Policy`` is taken."""
_MediumName = Literal["pinned", "host", "file"]
"""A backup medium: pinned host memory kept across cycles, host memory given back after each
resume, or a file in the backup directory."""
_KindName = Literal["fixed", "growing"]
"""A region kind: all its bytes mapped while resident, or memory mapped only under its
buffers."""

_RouteName = Literal["engine", "kernel", "fastest"]
"""Who copies contents: the copy engine (leaves the SMs to the application), the copy
kernel, or whichever the first 64 MiB of a copy shows faster."""

DEFAULT_ALIGN: int
"""Default buffer alignment in bytes (256, what CUDA's own allocators guarantee)."""

POISON: int
"""The 32-bit pattern of poisoned discards (``0x7FFF7FFF``): a NaN read as bf16, fp16 or fp32."""

__version__: str

def error_codes() -> list[tuple[int, str]]:
    """Every error code as ``(number, name)``; the class of ``name`` is ``<name>Error``."""

# <settings:configure>
def configure(
    device: int = 0,
    *,
    chunk_bytes: int | None = None,
    skip_unchanged: bool | None = None,
    verify_restore: bool | None = None,
    save_route: _RouteName | None = None,
    restore_route: _RouteName | None = None,
    poison_discards: bool | None = None,
    resident_warning_bytes: int | None = None,
    host_budget_bytes: int | None = None,
    prepin: bool | None = None,
) -> None:
    """Chooses the settings of device ``device``'s pager (default 0) before its first use
    (before ``Pager.for_device`` or anything else opens it), one keyword per setting; a
    setting left out, or ``None``, keeps its default. A byte count is an int, a switch a
    bool, a route ``"engine"``, ``"kernel"`` or ``"fastest"``; anything else is
    ``TypeError`` or ``ValueError``, an unknown keyword ``TypeError`` naming the
    settings. Until the pager exists a later call replaces the settings; afterwards the
    same settings are accepted and others are ``InvalidArgumentError``, changing nothing.
    The settings: ``chunk_bytes`` (bytes, default ``536870912``): Physical chunk size in
    bytes (default 512 MiB), rounded up to the device's granularity and to a power of two
    (0 is refused). Mapping costs per chunk; a region's last chunk wastes at most one
    chunk's rounding. A region's own chunk size overrides it. ``skip_unchanged`` (switch,
    default ``True``): A release copies only the parts of a preserve region that changed
    since its last backup or restore (default on). ``verify_restore`` (switch, default
    ``False``): After each restore, compare the device contents with the backup's hashes;
    a mismatch fails the resume as corrupted (default off: one hash pass per resume).
    ``save_route`` (route, default ``'engine'``): Who copies contents to the backup on
    release: `engine` (the default: it leaves the SMs to the application), `kernel` or
    `fastest`. ``restore_route`` (route, default ``'fastest'``): Who restores contents on
    resume: `engine`, `kernel` or `fastest` (the default: right after a trainer's free
    the copy kernel can outrun the copy engine). ``poison_discards`` (switch, default
    ``False``): Memory that comes back without its contents (a discard region, a tag
    dropped at its release) is filled with the poison pattern on resume, a NaN read as
    bf16, fp16 or fp32, so that reading it before writing it shows at once (default off;
    the environment variable `GPU_PAGER_POISON_DISCARDS=1` turns it on too).
    ``resident_warning_bytes`` (bytes, default ``4294967296``): A release that moved
    something logs one warning when this process holds more than this many bytes of
    device memory outside every region after it (the device's whole use outside the
    regions where NVML does not report this process); the audit shows all of it (default
    4 GiB; the largest value: never). ``host_budget_bytes`` (bytes, default
    ``18446744073709551615``): The most host memory that the backups in pinned or host
    memory, the KV caches' swap space and the file backups' staging buffers of every gpu-
    pager process of this user on the node may hold together (a ledger in `/dev/shm`; a
    killed process's share comes back). A release whose new backups would pass it fails
    before anything moves, as out of memory naming the budget and each process's share,
    as does swap space over it (default: no budget; the environment variable
    `GPU_PAGER_HOST_BUDGET`, e.g. `64G`, sets it for the process's pagers). ``prepin``
    (switch, default ``False``): Every preserve region with a pinned backup is created
    with `prepin` on: its backup is pinned as the region is created (fixed) or as each
    buffer is allocated (growing), so that its first release pins nothing and copies at
    the link. Off (the default), the first release pins while it copies, bound by how
    fast the host pins. The host memory is taken for every such region, also one whose
    contents a release usually drops (the vLLM drop-in's `kv_cache`): it suits processes
    whose preserve regions are all saved, as a trainer's under the torch_memory_saver
    drop-in (the environment variable `GPU_PAGER_PREPIN=1` turns it on, for engines that
    cannot pass the option)."""
# </settings:configure>

def settings() -> list[tuple[str, Literal["bytes", "switch", "route"], int | bool | str, str]]:
    """Every setting ``configure`` takes, in order: ``(name, kind, default, doc)``."""

def _torch_hook_state(device: int) -> tuple[str | None, str | None]:
    """``(tag, last_error)``: the calling thread's tag for torch segments on ``device``
    and the message of its last failed C call (used by ``gpu_pager.torch``)."""

def _use_tag(device: int, tag: str | None) -> None:
    """Sets (``None``: clears) the calling thread's tag for torch segments on ``device``;
    the region must exist (``UnknownTagError``). ``gpu_pager.torch.use_tag`` calls it."""

def _keep_forever(obj: object) -> None:
    """Takes a reference to ``obj`` that is never given back (torch pools and allocators
    that must outlive interpreter shutdown)."""

# The torch_memory_saver drop-in's model (the drop-in wing), for
# gpu_pager.compat.torch_memory_saver; not an API of its own.

def _tms_set_tag(tag: str) -> None:
    """Sets the calling thread's drop-in tag (at most 224 bytes: ``InvalidArgumentError``)."""

def _tms_tag() -> str:
    """The calling thread's drop-in tag (initially ``"default"``)."""

def _tms_pause(tag: str | None = None) -> None:
    """Pauses the drop-in's regions of ``tag`` (``None`` or empty: all) on every device."""

def _tms_resume(tag: str | None = None) -> None:
    """Resumes the drop-in's regions of ``tag`` (``None`` or empty: all) on every device."""

def _tms_set_disk_dir(path: str | os.PathLike[str]) -> None:
    """The directory of the drop-in's disk backups (created if missing)."""

def _tms_set_retain(on: bool) -> None:
    """Whether the drop-in's resumes keep the CPU backups."""

def _tms_retain() -> bool:
    """Whether the drop-in's resumes keep the CPU backups."""

def _tms_set_margin(bytes: int) -> None:
    """Routed allocations that would leave fewer than ``bytes`` free fail instead."""

def _tms_backup_view(ptr: int, nbytes: int) -> memoryview | None:
    """A writable view of the CPU backup of the ``nbytes`` device bytes at ``ptr`` while
    their tag is paused (or resumed with the backup retained), else ``None``."""

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
    def value(self) -> _PolicyName:
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
    def value(self) -> Literal["resident", "released"]:
        """``"resident"`` or ``"released"``."""
    def __int__(self) -> int: ...
    def __eq__(self, other: object, /) -> bool: ...
    def __hash__(self) -> int: ...

@final
# <settings:Config>
class Config:
    """A pager's settings (``Pager.config``; chosen with ``gpu_pager.configure`` before the
    device's first use), sizes as the pager rounded them: one attribute per setting
    (``gpu_pager.settings()`` lists them with their docs)."""

    @property
    def chunk_bytes(self) -> int:
        """Physical chunk size in bytes (default 512 MiB), rounded up to the device's
        granularity and to a power of two (0 is refused). Mapping costs per chunk; a
        region's last chunk wastes at most one chunk's rounding. A region's own chunk
        size overrides it."""

    @property
    def skip_unchanged(self) -> bool:
        """A release copies only the parts of a preserve region that changed since its last
        backup or restore (default on)."""

    @property
    def verify_restore(self) -> bool:
        """After each restore, compare the device contents with the backup's hashes; a
        mismatch fails the resume as corrupted (default off: one hash pass per resume)."""

    @property
    def save_route(self) -> _RouteName:
        """Who copies contents to the backup on release: `engine` (the default: it leaves
        the SMs to the application), `kernel` or `fastest`."""

    @property
    def restore_route(self) -> _RouteName:
        """Who restores contents on resume: `engine`, `kernel` or `fastest` (the default:
        right after a trainer's free the copy kernel can outrun the copy engine)."""

    @property
    def poison_discards(self) -> bool:
        """Memory that comes back without its contents (a discard region, a tag dropped at
        its release) is filled with the poison pattern on resume, a NaN read as bf16,
        fp16 or fp32, so that reading it before writing it shows at once (default off;
        the environment variable `GPU_PAGER_POISON_DISCARDS=1` turns it on too)."""

    @property
    def resident_warning_bytes(self) -> int:
        """A release that moved something logs one warning when this process holds more than
        this many bytes of device memory outside every region after it (the device's
        whole use outside the regions where NVML does not report this process); the audit
        shows all of it (default 4 GiB; the largest value: never)."""

    @property
    def host_budget_bytes(self) -> int:
        """The most host memory that the backups in pinned or host memory, the KV caches'
        swap space and the file backups' staging buffers of every gpu-pager process of
        this user on the node may hold together (a ledger in `/dev/shm`; a killed
        process's share comes back). A release whose new backups would pass it fails
        before anything moves, as out of memory naming the budget and each process's
        share, as does swap space over it (default: no budget; the environment variable
        `GPU_PAGER_HOST_BUDGET`, e.g. `64G`, sets it for the process's pagers)."""

    @property
    def prepin(self) -> bool:
        """Every preserve region with a pinned backup is created with `prepin` on: its
        backup is pinned as the region is created (fixed) or as each buffer is allocated
        (growing), so that its first release pins nothing and copies at the link. Off
        (the default), the first release pins while it copies, bound by how fast the host
        pins. The host memory is taken for every such region, also one whose contents a
        release usually drops (the vLLM drop-in's `kv_cache`): it suits processes whose
        preserve regions are all saved, as a trainer's under the torch_memory_saver drop-
        in (the environment variable `GPU_PAGER_PREPIN=1` turns it on, for engines that
        cannot pass the option)."""
# </settings:Config>

@final
class AuditRegion:
    """One region in an ``Audit``."""

    @property
    def tag(self) -> str:
        """The tag."""
    @property
    def state(self) -> State:
        """Resident or released."""
    @property
    def policy(self) -> Policy:
        """Its policy."""
    @property
    def kind(self) -> Literal["fixed", "growing", "elastic"]:
        """How its memory is mapped."""
    @property
    def reserved_bytes(self) -> int:
        """Reserved address range, bytes."""
    @property
    def mapped_bytes(self) -> int:
        """Physical bytes mapped now."""
    @property
    def allocated_bytes(self) -> int:
        """Bytes in live buffers."""
    @property
    def backup_bytes(self) -> int:
        """Backup held, bytes."""

@final
class Audit:
    """Where a device's memory is, as ``Pager.audit()`` saw it; ``str()`` is a table."""

    @property
    def device_total_bytes(self) -> int:
        """The device's memory in all, bytes."""
    @property
    def device_free_bytes(self) -> int:
        """What the driver says is free, bytes."""
    @property
    def device_used_bytes(self) -> int:
        """Device memory in use (every holder, other processes included), bytes."""
    @property
    def mapped_bytes(self) -> int:
        """Physical bytes mapped under the pager's regions."""
    @property
    def outside_bytes(self) -> int:
        """Device memory in use outside every region, bytes."""
    @property
    def processes(self) -> list[tuple[int, int | None]] | None:
        """The processes using the device as ``(pid, bytes)``, this one included, as NVML
        reports them; ``None`` where NVML is not there."""
    @property
    def host_budget(self) -> tuple[int, list[tuple[int, int]]] | None:
        """The node's host budget for backups (``host_budget_bytes``) and each live gpu-pager
        process's share of it as ``(pid, bytes)``, largest first, this one included; ``None``
        without a budget."""
    @property
    def this_process_bytes(self) -> int | None:
        """Device memory this process holds (``None``: NVML does not report it)."""
    @property
    def other_processes_bytes(self) -> int | None:
        """Device memory the other processes on the device hold (``None``: no NVML)."""
    @property
    def regions(self) -> list[AuditRegion]:
        """Every region, in tag order."""

@final
class RegionInfo:
    """A region's description, as it was when the call returned."""

    @property
    def tag(self) -> str:
        """The tag."""
    @property
    def base(self) -> int:
        """First device address; never changes while the region exists."""
    @property
    def size(self) -> int:
        """Reserved bytes (rounded up to the granularity)."""
    @property
    def chunk_bytes(self) -> int:
        """Physical chunk size in bytes (the last chunk may be smaller)."""
    @property
    def policy(self) -> Policy:
        """Contents policy."""
    @property
    def medium(self) -> _MediumName:
        """Where a ``PRESERVE`` region's contents go while released: ``"pinned"``, ``"host"``
        or ``"file"``."""
    @property
    def state(self) -> State:
        """State when the call returned."""
    @property
    def kind(self) -> Literal["fixed", "growing", "elastic"]:
        """How its memory is mapped: ``"fixed"``, ``"growing"`` or ``"elastic"``."""
    @property
    def id(self) -> int:
        """Identity: unique among the regions and buffers of the process."""
    @property
    def releases(self) -> int:
        """Releases that changed the region so far."""

@final
class Buffer:
    """A buffer inside a region: a handle (tag, offset, length), not a pointer."""

    @property
    def tag(self) -> str:
        """The region's tag."""
    @property
    def offset(self) -> int:
        """Offset in bytes from the region's base address."""
    @property
    def nbytes(self) -> int:
        """Length in bytes."""
    @property
    def device(self) -> int:
        """The device of the pager that allocated it."""
    def __len__(self) -> int: ...
    def __eq__(self, other: object, /) -> bool: ...
    def __hash__(self) -> int: ...

@final
class Steps:
    """Seconds spent in each step of one region's move."""

    @property
    def pin(self) -> float:
        """Allocating the pinned host backup (first release only, unless prepinned)."""
    @property
    def copy(self) -> float:
        """Copying contents (device to host on release, host to device on resume)."""
    @property
    def map(self) -> float:
        """Creating and mapping physical memory and enabling access (for a resume that restores
        contents, which maps ahead on a helper thread: the time it waited for its mappings)."""
    @property
    def unmap(self) -> float:
        """Unmapping and releasing physical memory."""
    @property
    def fill(self) -> float:
        """Filling: zeros, or the poison of poisoned discards."""
    @property
    def hash(self) -> float:
        """Hashing contents."""
    @property
    def total(self) -> float:
        """Sum of the steps, in seconds."""

@final
class RegionReport:
    """One region's part of a ``Report``."""

    @property
    def tag(self) -> str:
        """The region."""
    @property
    def outcome(self) -> Literal["done", "already_done"]:
        """``"done"`` or ``"already_done"``."""
    @property
    def bytes(self) -> int:
        """Physical bytes mapped (resume) or unmapped (release)."""
    @property
    def copied(self) -> int:
        """Bytes copied between device and host."""
    @property
    def steps(self) -> Steps:
        """Seconds per step."""
    @property
    def seconds(self) -> float:
        """Seconds of all steps together."""

@final
class Report:
    """What one ``release`` or ``resume`` call did."""

    @property
    def op(self) -> Literal["release", "resume"]:
        """``"release"`` or ``"resume"``."""
    @property
    def regions(self) -> list[RegionReport]:
        """One entry per region named in the call, in tag order."""
    @property
    def bytes(self) -> int:
        """Physical bytes moved in or out of the device's memory map."""
    @property
    def copied(self) -> int:
        """Bytes copied between device and host."""
    @property
    def seconds(self) -> float:
        """Wall time of the whole call, in seconds."""
    @property
    def sync_seconds(self) -> float:
        """Seconds spent waiting for outstanding device work (release only)."""
    def region(self, tag: str) -> RegionReport | None:
        """The entry for ``tag``, or ``None`` if the call did not name it."""

@final
class RegionStats:
    """Statistics of one region."""

    @property
    def info(self) -> RegionInfo:
        """The region's description."""
    @property
    def tag(self) -> str:
        """The region's tag (``info.tag``)."""
    @property
    def resident_bytes(self) -> int:
        """Physical bytes mapped now (for an elastic region: its backed chunks)."""
    @property
    def released_bytes(self) -> int:
        """Reserved bytes with nothing mapped (the whole region while released)."""
    @property
    def allocated_bytes(self) -> int:
        """Bytes in live buffers."""
    @property
    def buffers(self) -> int:
        """Live buffers."""
    @property
    def backup_bytes(self) -> int:
        """Backup held, in bytes: host memory, or the backup file's size (``info.medium`` says
        which)."""
    @property
    def held_bytes(self) -> int:
        """Bytes the backup validly holds: while released, what a resume restores."""
    @property
    def marked_bytes(self) -> int:
        """Bytes of live buffers marked overwritten by the next update (see
        ``Pager.set_overwritten``), which a release does not save."""
    @property
    def leases(self) -> int:
        """Live leases."""
    @property
    def last_release(self) -> RegionReport | None:
        """The last release that changed this region, if any."""
    @property
    def last_resume(self) -> RegionReport | None:
        """The last resume that changed this region, if any."""

@final
class Stats:
    """Statistics of the whole pager."""

    @property
    def regions(self) -> list[RegionStats]:
        """One entry per region, in tag order."""
    @property
    def resident_bytes(self) -> int:
        """Physical bytes mapped over all regions."""
    @property
    def released_bytes(self) -> int:
        """Reserved-but-unmapped bytes over all regions."""
    @property
    def backup_bytes(self) -> int:
        """Backup bytes held over all regions (host memory and files)."""
    @property
    def deferred_errors(self) -> list[str]:
        """Failures no call could return, not yet taken; each also logged (``"gpu_pager"``)."""
    @property
    def deferred_errors_total(self) -> int:
        """Such failures since the pager was made, taken or not."""
    def region(self, tag: str) -> RegionStats | None:
        """The entry for ``tag``, or ``None`` if there is no such region."""

@final
class Lease:
    """Keeps tags resident while open; a context manager."""

    @property
    def tags(self) -> list[str]:
        """The leased tags, as given."""
    @property
    def active(self) -> bool:
        """Whether the lease is still held."""
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
    def device(self) -> int:
        """The device ordinal."""
    @property
    def config(self) -> Config:
        """The pager's settings (``configure`` chooses them before the first use)."""
    @property
    def backend(self) -> Literal["cuda", "host"]:
        """``"cuda"`` or ``"host"``."""
    @property
    def host_fallback(self) -> str | None:
        """Why the pager runs on host memory, or ``None`` on a GPU."""
    def region(
        self,
        tag: str,
        policy: Policy | _PolicyName,
        bytes: int | None = None,
        prepin: bool = False,
        medium: _MediumName = "pinned",
        kind: _KindName | None = None,
    ) -> RegionInfo:
        """Creates region ``tag`` (or returns the same existing one): ``kind`` ``"fixed"``
        (the default with ``bytes``) or ``"growing"`` (the default without)."""
    def set_backup_dir(self, path: str | os.PathLike[str]) -> None:
        """Where new ``"file"`` backups go (created if missing, checked by a write)."""
    @property
    def backup_dir(self) -> str | None:
        """The directory of new ``"file"`` backups, or ``None``."""
    def add_companion(
        self,
        tag: str,
        name: str,
        before_release: Callable[[str], object] | None = None,
        after_resume: Callable[[str], object] | None = None,
    ) -> int:
        """Registers work that moves with region ``tag``: ``before_release(tag)`` before its
        memory is unmapped, ``after_resume(tag)`` after it is mapped and restored. An exception
        undoes the move and raises ``CompanionError``. Returns the id ``remove_companion``
        takes."""
    def remove_companion(self, id: int) -> None:
        """Unregisters companion ``id``; it is not called again once this returns."""
    def remove(self, tag: str) -> None:
        """Removes region ``tag``: unmaps it, frees its backup and its address range; its buffers
        become stale. Refused (``BusyError``) while it is leased."""
    def tags(self) -> list[str]:
        """The tags of all regions, in order."""
    def info(self, tag: str) -> RegionInfo:
        """The description of region ``tag``."""
    def alloc(self, tag: str, nbytes: int, align: int | None = None) -> Buffer:
        """Allocates a buffer of ``nbytes`` in region ``tag``, aligned to ``align`` bytes (a power
        of two; default 256). Works whether the region is resident or released."""
    def free(self, buf: Buffer) -> None:
        """Frees a buffer. Freeing it twice is ``StaleBufferError``."""
    def ptr(self, buf: Buffer) -> int:
        """The buffer's device address (an int). The address never changes, but it is backed by
        memory only while the region is resident: ``NotResidentError`` otherwise."""
    def buffer_containing(self, ptr: int) -> tuple[Buffer, int] | None:
        """The live buffer whose bytes include device address ``ptr`` (an int, e.g. a torch tensor's
        ``data_ptr()``) and ``ptr``'s offset in it, as ``(buffer, offset)``; ``None`` when no
        live buffer of this pager holds that address. Works while the region is released too."""
    def write(self, buf: Buffer, offset: int, data: _BytesLike) -> None:
        """Copies ``data`` (bytes-like) into the buffer at ``offset``, through the pager: a released
        region is ``NotResidentError``, never a fault."""
    def read(self, buf: Buffer, offset: int, n: int) -> bytes:
        """Reads ``n`` bytes of the buffer from ``offset``, through the pager (a released region is
        ``NotResidentError``)."""
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
    def release(self, tags: _Tags, drop: _Tags | None = None) -> Report:
        """Gives the physical memory of ``tags`` (a str or a sequence of str) back to the device:
        waits for outstanding device work, copies ``PRESERVE`` regions to their backups,
        unmapping each buffer as soon as its own copies are done. All or nothing for what it
        saves (``BusyError`` if one is leased; after a failed copy every region is resident
        again, its saved contents restored; a region whose contents it does not keep, a
        ``DISCARD`` region or one dropped, comes back as its resume would bring it).
        Regions already released are reported as such. ``drop`` (tags among ``tags``) drops
        those regions' contents for this cycle instead of backing them up: they come back
        zeroed at the next resume (a ``DISCARD`` region: undefined)."""
    def resume(self, tags: _Tags, keep_host_backups: bool = False) -> Report:
        """Maps physical memory back under ``tags`` at the same addresses and restores ``PRESERVE``
        contents bit-exact. All or nothing: on ``OutOfMemoryError`` every region stays released
        with its backup, and a later resume succeeds. ``"host"`` backups give their memory back
        after the restore unless ``keep_host_backups``."""
    def resume_on(self, tags: _Tags, stream: int | Any) -> Report:
        """``resume`` with the copies enqueued on ``stream`` (int or ``.cuda_stream``)."""
    def resume_and_lease(self, tags: _Tags) -> tuple[Report, Lease]:
        """``resume`` and ``lease`` in one step, so that no other thread can release the tags in
        between. Returns ``(report, lease)``."""
    def lease(self, tags: _Tags) -> Lease:
        """Keeps ``tags`` resident until the lease is closed: releasing one of them is ``BusyError``
        meanwhile. ``NotResidentError`` if one is released now. Use it as a context manager
        (``with pager.lease("weights"): ...``) or call ``close()``."""
    def audit(self) -> Audit:
        """Where the device's memory is now: each region's bytes and state, the device's use,
        and what lies outside every region."""
    def stats(self) -> Stats:
        """Statistics of every region."""
    def region_stats(self, tag: str) -> RegionStats:
        """Statistics of region ``tag``."""
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

class NotResidentError(PagerError):
    """The region is released; the operation needs it resident. Resume it first."""
class NotBackedError(PagerError):
    """A range of an elastic region has no physical memory mapped (never backed, or trimmed)."""
class UnknownTagError(PagerError):
    """No region has this tag (the message suggests the nearest one)."""
class BusyError(PagerError):
    """The region is held resident by leases and cannot be released now."""
class OutOfMemoryError(PagerError, MemoryError):
    """The device has too little free memory for the step (resume, region creation, back). Nothing
    was lost; retry once the memory is free. Also a MemoryError."""
class InvalidSizeError(PagerError):
    """A size was zero, too large, or not acceptable here."""
class OutOfRangeError(PagerError):
    """An access outside a buffer or region."""
class StaleBufferError(PagerError):
    """The buffer is not (or no longer) allocated in its region: freed already, or from another
    pager."""
class RegionFullError(PagerError):
    """The region has no free range large enough for the allocation."""
class TagConflictError(PagerError):
    """The tag exists with another policy, size or option than the one asked for."""
class CorruptedError(PagerError):
    """Restored contents differ from the backup (verify_restore); the region stays released."""
class BackupInUseError(PagerError):
    """The backup holds the region's contents while it is released and cannot be freed."""
class InvalidArgumentError(PagerError):
    """An argument other than a size is not acceptable."""
class KvError(PagerError):
    """A paged-KV-cache call was refused; nothing was changed."""
class BackendError(PagerError):
    """The device driver or the operating system failed."""
class InternalError(PagerError):
    """A bug: an invariant of gpu-pager failed (never the caller's input). Please report it with the
    message."""
class CompanionError(PagerError):
    """A companion of the region (Pager.add_companion) failed while it moved; the release or
    resume was undone and every region is as before the call."""
class PanicError(PagerError):
    """A bug: gpu-pager panicked inside the call and the binding caught it. Please report it with
    the message."""
