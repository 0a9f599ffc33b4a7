"""gpu_pager: the GPU memory of an LLM rollout engine as tagged regions at stable device
addresses, released between rollouts (so that a trainer can use the GPU) and resumed stage
by stage, without reloading the model or recapturing CUDA graphs.

::

    import gpu_pager

    pager = gpu_pager.Pager.for_device(0)  # CUDA, or host memory without a GPU
    pager.region("weights", "preserve", 256 << 20)  # copied to pinned host memory on release
    pager.region("kv_cache", "discard", 1 << 30)  # dropped on release
    w = pager.alloc("weights", 4096)
    pager.write(w, 0, bytes([7]) * 4096)

    pager.release(["kv_cache", "weights"])  # memory goes back to the device
    pager.resume("weights")  # stage 1: contents back, bit-exact, same addresses
    assert pager.read(w, 0, 4096) == bytes([7]) * 4096
    pager.resume("kv_cache")  # stage 2

Every error is a ``PagerError`` subclass named after its code (``NotResidentError``,
``OutOfMemoryError``, ...) with ``.tag`` (``None`` when no region applies), ``.tags``, ``.code``
and a message saying what to do.
PyTorch integration: ``gpu_pager.torch``; drop-in replacements for torch_memory_saver and
vLLM's CuMemAllocator: ``gpu_pager.compat``.
"""

from gpu_pager._native import (
    DEFAULT_ALIGN,
    POISON,
    Audit,
    AuditRegion,
    Buffer,
    Config,
    Lease,
    Pager,
    PagerError,
    Policy,
    RegionInfo,
    RegionReport,
    RegionStats,
    Report,
    State,
    Stats,
    Steps,
    __version__,
    configure,
    error_codes,
    settings,
    NotResidentError,
    NotBackedError,
    UnknownTagError,
    BusyError,
    OutOfMemoryError,
    InvalidSizeError,
    OutOfRangeError,
    StaleBufferError,
    RegionFullError,
    TagConflictError,
    CorruptedError,
    BackupInUseError,
    InvalidArgumentError,
    KvError,
    BackendError,
    InternalError,
    CompanionError,
    PanicError,
)

__all__ = [
    "DEFAULT_ALIGN",
    "POISON",
    "Audit",
    "AuditRegion",
    "Buffer",
    "Config",
    "Lease",
    "Pager",
    "PagerError",
    "Policy",
    "RegionInfo",
    "RegionReport",
    "RegionStats",
    "Report",
    "State",
    "Stats",
    "Steps",
    "__version__",
    "configure",
    "error_codes",
    "settings",
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
]
