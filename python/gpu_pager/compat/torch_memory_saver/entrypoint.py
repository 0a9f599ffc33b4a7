"""``TorchMemorySaver``, torch_memory_saver 0.0.10's public object, on gpu_pager (see the
package docs). The per-thread region config lives in gpu-pager's core, which both hook modes
route allocations through; this module keeps torch's pools, as torch_memory_saver does."""

from __future__ import annotations

import atexit
import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from gpu_pager import _native
from gpu_pager import _pools
from gpu_pager.compat.torch_memory_saver.binary_wrapper import BinaryWrapper
from gpu_pager.compat.torch_memory_saver.hooks.mode_preload import (
    is_preloaded,
    preload_library_path,
)
from gpu_pager.compat.torch_memory_saver.utils import is_xpu

__all__ = ["TorchMemorySaver"]

logger = logging.getLogger(__name__)

_TAG_DEFAULT = "default"
if TYPE_CHECKING:
    from typing import Literal

    _CpuBackupBackend = Literal["mmap", "pinned"]
    _HookMode = Literal["preload", "torch"]


def _torch() -> Any:
    """torch, checked against gpu_pager.torch's floor."""
    return _pools.load_torch()


class TorchMemorySaver:
    """Pausable GPU memory by tag: ``region()`` marks allocations, ``pause()`` gives their
    memory back (keeping their addresses), ``resume()`` brings it back."""

    def __init__(self) -> None:
        self._impl_ctor_kwargs: dict[str, Any] = {}
        self._impl: _TorchMemorySaverImpl | None = None

    @contextmanager
    def region(
        self,
        tag: str = _TAG_DEFAULT,
        enable_cpu_backup: bool = False,
        enable_disk_backup: bool = False,
        cpu_backup_backend: _CpuBackupBackend | None = None,
    ) -> Iterator[None]:
        """Tensors allocated inside are pausable under ``tag``. With ``enable_cpu_backup``
        their contents survive a pause in host memory: ``cpu_backup_backend`` "pinned"
        (default; pinned memory kept across cycles) or "mmap" (given back after each
        resume). With ``enable_disk_backup`` they survive in a file of the disk backup
        directory (``set_disk_backup_dir``, ``TMS_DISK_BACKUP_DIR``, else ``/tmp``).
        Without either, their contents are undefined after a resume."""
        self._validate_cpu_backup_backend(enable_cpu_backup, cpu_backup_backend)
        if enable_cpu_backup and enable_disk_backup:
            raise ValueError(
                "enable_cpu_backup and enable_disk_backup are mutually exclusive; choose one"
            )
        impl = self._ensure_initialized()
        with impl.region(
            tag=tag,
            enable_cpu_backup=enable_cpu_backup,
            enable_disk_backup=enable_disk_backup,
            cpu_backup_backend=cpu_backup_backend,
        ):
            yield

    @contextmanager
    def cuda_graph(
        self,
        cuda_graph: Any,
        pool: Any = None,
        stream: Any = None,
        capture_error_mode: str = "global",
        tag: str = _TAG_DEFAULT,
        enable_cpu_backup: bool = False,
        cpu_backup_backend: _CpuBackupBackend | None = None,
    ) -> Iterator[None]:
        """``torch.cuda.graph(cuda_graph, ...)`` whose memory is pausable under ``tag``, in
        both hook modes."""
        self._validate_cpu_backup_backend(enable_cpu_backup, cpu_backup_backend)
        impl = self._ensure_initialized()
        with impl.cuda_graph(
            cuda_graph=cuda_graph,
            pool=pool,
            stream=stream,
            capture_error_mode=capture_error_mode,
            tag=tag,
            enable_cpu_backup=enable_cpu_backup,
            cpu_backup_backend=cpu_backup_backend,
        ):
            yield

    @contextmanager
    def disable(self) -> Iterator[None]:
        """Inside a region (or whole-process mode), allocations are ordinary torch memory:
        not pausable, and given back to the device by ``torch.cuda.empty_cache()`` once
        freed (the block's private pool is retired at its end)."""
        impl = self._ensure_initialized()
        with impl.disable():
            yield

    def pause(self, tag: str | None = None) -> None:
        """Pauses ``tag`` (``None``: every tag) on every device: waits for the device's
        work, backs up what has a backup, gives the memory back. Idempotent."""
        self._ensure_initialized().pause(tag)

    def resume(self, tag: str | None = None) -> None:
        """Resumes ``tag`` (``None``: every tag) at the same addresses, contents restored
        where backed up. Idempotent. Raises ``gpu_pager.OutOfMemoryError`` (a
        ``RuntimeError``) when the device has not enough free memory yet: nothing is lost,
        the tag stays paused, and a later resume succeeds."""
        self._ensure_initialized().resume(tag)

    @property
    def enabled(self) -> bool:
        """Always ``True`` (for compatibility)."""
        return True

    @property
    def hook_mode(self) -> _HookMode:
        """``"preload"`` (the default; needs ``configure_subprocess()``) or ``"torch"``."""
        if self._impl is not None:
            return self._impl.hook_mode
        mode: _HookMode = self._impl_ctor_kwargs.get("hook_mode", "preload")
        return mode

    @hook_mode.setter
    def hook_mode(self, hook_mode: _HookMode) -> None:
        if hook_mode not in ("preload", "torch"):
            raise ValueError(f"hook_mode must be 'preload' or 'torch', not {hook_mode!r}")
        if self._impl is not None:
            if hook_mode == self._impl.hook_mode:
                return
            raise RuntimeError(
                "torch_memory_saver is initialised already; set hook_mode before its first use"
            )
        self._impl_ctor_kwargs["hook_mode"] = hook_mode

    @property
    def memory_margin_bytes(self) -> int:
        """Set only: allocations that would leave less than this many bytes of the device
        free fail instead (out of memory)."""
        raise NotImplementedError("Only setter is supported")

    @memory_margin_bytes.setter
    def memory_margin_bytes(self, value: int) -> None:
        impl = self._ensure_initialized()
        impl._binary_wrapper.cdll.set_memory_margin_bytes(int(value))

    @property
    def retain_cpu_backup(self) -> bool:
        """Whether resumes keep the CPU backups (their contents and addresses) instead of
        giving them back; initially ``TMS_RETAIN_CPU_BACKUP``."""
        self._ensure_initialized()
        return _native._tms_retain()

    @retain_cpu_backup.setter
    def retain_cpu_backup(self, value: bool) -> None:
        self._ensure_initialized()
        _native._tms_set_retain(bool(value))

    def get_cpu_backup(self, x: Any, zero_copy: bool = False) -> Any:
        """A CPU tensor with ``x``'s bytes from its CPU backup while its tag is paused (or
        resumed with the backup retained), else ``None``. ``zero_copy=True`` returns a view
        of the backup itself, valid until the tag's next pause or non-retaining resume."""
        return self._ensure_initialized().get_cpu_backup(x, zero_copy=zero_copy)

    def set_disk_backup_dir(self, path: str) -> None:
        """The directory of disk backups (created if missing; on a real disk, not tmpfs)."""
        self._ensure_initialized()
        os.makedirs(path, exist_ok=True)
        _native._tms_set_disk_dir(path)

    def _validate_cpu_backup_backend(
        self, enable_cpu_backup: bool, cpu_backup_backend: _CpuBackupBackend | None
    ) -> None:
        if cpu_backup_backend is None:
            return
        if not enable_cpu_backup:
            raise ValueError("cpu_backup_backend requires enable_cpu_backup=True")
        if is_xpu():
            raise ValueError("cpu_backup_backend is not supported on XPU; host shadows use malloc")
        if cpu_backup_backend not in ("pinned", "mmap"):
            raise ValueError(
                f"cpu_backup_backend must be 'pinned' or 'mmap', not {cpu_backup_backend!r}"
            )
        if cpu_backup_backend == "mmap" and _torch().version.hip:
            raise ValueError("cpu_backup_backend='mmap' is not supported on ROCm")

    def _ensure_initialized(self) -> _TorchMemorySaverImpl:
        if self._impl is None:
            self._impl = _TorchMemorySaverImpl(**self._impl_ctor_kwargs)
        return self._impl


# This thread's depth of disable() blocks (a nested one changes nothing).
_disabling = threading.local()


class _Pools(dict):  # type: ignore[type-arg]
    """torch's pools by (tag, cpu backup, disk backup, backend, device), made on first use
    on the current device (a pool belongs to the device current at its creation)."""

    def __init__(self, allocator: Any) -> None:
        super().__init__()
        self._allocator = allocator

    def __missing__(self, key: Any) -> Any:
        pool = _torch().cuda.MemPool(allocator=self._allocator)
        self[key] = pool
        return pool


class _TorchMemorySaverImpl:
    def __init__(self, hook_mode: _HookMode = "preload") -> None:
        if hook_mode not in ("preload", "torch"):
            raise ValueError(f"hook_mode must be 'preload' or 'torch', not {hook_mode!r}")
        if hook_mode == "preload" and not is_preloaded():
            raise RuntimeError(
                "torch_memory_saver's hook_mode='preload' needs gpu-pager's preload library "
                "in LD_PRELOAD, and this process runs without it "
                f"(LD_PRELOAD={os.environ.get('LD_PRELOAD', '')!r}, pid {os.getpid()}); start "
                "the process inside torch_memory_saver.configure_subprocess(), or run it with "
                f"LD_PRELOAD={preload_library_path()}, or set "
                "torch_memory_saver.hook_mode = 'torch' before its first use"
            )
        _sanity_checks()
        self.hook_mode: _HookMode = hook_mode
        self._binary_wrapper = BinaryWrapper(preload_library_path())
        _check_one_core(self._binary_wrapper.cdll)
        allocator = None
        if hook_mode == "torch":
            allocator = _torch().cuda.memory.CUDAPluggableAllocator(
                _pools.library_path(), "gpu_pager_tms_torch_malloc", _pools.FREE_SYMBOL
            )
            # torch keeps a raw pointer to the allocator in its pools: never collect it.
            _pools.keep_forever(allocator)
            allocator = allocator.allocator()
        self._mem_pools: dict[Any, Any] = _Pools(allocator)
        # At exit the pools are left alone (their memory goes with the process): destroying
        # them during interpreter teardown could free through a library already unloading.
        atexit.register(_keep_pools, self._mem_pools)

    @contextmanager
    def region(
        self,
        tag: str,
        enable_cpu_backup: bool,
        enable_disk_backup: bool,
        cpu_backup_backend: _CpuBackupBackend | None,
    ) -> Iterator[None]:
        torch = _torch()
        device = int(torch.cuda.current_device())
        resolved = ""
        if enable_cpu_backup:
            resolved = cpu_backup_backend or self._current_backend()
        key = (tag, enable_cpu_backup, enable_disk_backup, resolved, device)
        if self.hook_mode == "torch":
            self._trim([key], device)
        pool = self._mem_pools[key]
        try:
            with torch.cuda.use_mem_pool(pool):
                with self._with_region_config(
                    tag=tag,
                    enable_cpu_backup=enable_cpu_backup,
                    enable_disk_backup=enable_disk_backup,
                    cpu_backup_backend=cpu_backup_backend,
                ):
                    yield
        finally:
            if self.hook_mode == "torch":
                self._trim([key], device)

    def _trim(self, keys: list[Any], device: int) -> None:
        """Memory freed inside a region goes back to the device (torch mode: the segments
        of the regions' pools with nothing allocated in them; graph pools keep theirs)."""
        _pools.trim_pools(self._mem_pools, keys, device)

    def _current_backend(self) -> str:
        backend: bytes = self._binary_wrapper.cdll.tms_get_cpu_backup_backend()
        return backend.decode("utf-8")

    @contextmanager
    def cuda_graph(
        self,
        cuda_graph: Any,
        pool: Any,
        stream: Any,
        capture_error_mode: str,
        tag: str,
        enable_cpu_backup: bool,
        cpu_backup_backend: _CpuBackupBackend | None,
    ) -> Iterator[None]:
        torch = _torch()
        if self.hook_mode == "torch":
            # The graph's allocations go through the pluggable allocator: the tag's pool.
            device = int(torch.cuda.current_device())
            resolved = (cpu_backup_backend or self._current_backend()) if enable_cpu_backup else ""
            key = (tag, enable_cpu_backup, False, resolved, device)
            _pools.keep_for_graphs(key)
            pool = self._mem_pools[key].id
        with torch.cuda.graph(
            cuda_graph, pool=pool, stream=stream, capture_error_mode=capture_error_mode
        ):
            with self._with_region_config(
                tag=tag,
                enable_cpu_backup=enable_cpu_backup,
                cpu_backup_backend=cpu_backup_backend,
            ):
                yield

    @contextmanager
    def _with_region_config(
        self,
        tag: str,
        enable_cpu_backup: bool,
        cpu_backup_backend: _CpuBackupBackend | None,
        enable_disk_backup: bool = False,
    ) -> Iterator[None]:
        cdll = self._binary_wrapper.cdll
        orig_tag = cdll.tms_get_current_tag().decode("utf-8")
        orig_interesting = bool(cdll.tms_get_interesting_region())
        orig_cpu_backup = bool(cdll.tms_get_enable_cpu_backup())
        orig_backend = self._current_backend()
        orig_disk = bool(cdll.tms_get_enable_disk_backup())
        self._binary_wrapper.set_config(
            tag=tag,
            interesting_region=True,
            enable_cpu_backup=enable_cpu_backup,
            cpu_backup_backend=cpu_backup_backend,
            enable_disk_backup=enable_disk_backup,
        )
        try:
            yield
        finally:
            self._binary_wrapper.set_config(
                tag=orig_tag,
                interesting_region=orig_interesting,
                enable_cpu_backup=orig_cpu_backup,
                cpu_backup_backend=orig_backend,
                enable_disk_backup=orig_disk,
            )

    @contextmanager
    def disable(self) -> Iterator[None]:
        cdll = self._binary_wrapper.cdll
        if getattr(_disabling, "depth", 0):
            # disable() inside disable(): allocations are ordinary already.
            _disabling.depth += 1
            try:
                yield
            finally:
                _disabling.depth -= 1
            return
        if not cdll.tms_get_interesting_region():
            raise RuntimeError(
                "torch_memory_saver.disable() is for code inside region() (or with "
                "TMS_INIT_ENABLE=1); outside, allocations are ordinary already"
            )
        torch = _torch()
        cdll.tms_set_interesting_region(False)
        _disabling.depth = 1
        pool = None
        try:
            # A pool of torch's own allocator for the block, dropped at its end so that what
            # was allocated and freed inside goes back to the device (what torch_memory_saver
            # does too; slime relies on it); kept until they die when tensors outlive it.
            pool = torch.cuda.MemPool()
            with torch.cuda.use_mem_pool(pool):
                yield
        finally:
            if pool is not None:
                if self.hook_mode == "torch":
                    # Regions' pools route allocations meanwhile: destroying a pool now
                    # would abort torch.
                    _pools.retire_pool(pool)
                else:
                    _pools.drop_pool_when_unused(pool)
                pool = None
            _disabling.depth = 0
            cdll.tms_set_interesting_region(True)

    def pause(self, tag: str | None) -> None:
        if self.hook_mode == "torch":
            # What tensors freed inside the tags held is neither copied nor restored.
            device = int(_torch().cuda.current_device())
            keys = [k for k in self._mem_pools if not tag or k[0] == tag]
            self._trim(keys, device)
        _native._tms_pause(tag)

    def resume(self, tag: str | None) -> None:
        _native._tms_resume(tag)

    def get_cpu_backup(self, x: Any, zero_copy: bool = False) -> Any:
        torch = _torch()
        if not x.is_cuda:
            raise ValueError(f"get_cpu_backup takes a CUDA tensor, not one on {x.device}")
        if not x.is_contiguous():
            raise ValueError("get_cpu_backup takes a contiguous tensor; pass its contiguous base")
        nbytes = int(x.nbytes)
        view = _native._tms_backup_view(int(x.data_ptr()), nbytes)
        if view is None:
            return None
        if nbytes == 0:
            return torch.empty(x.shape, dtype=x.dtype)
        out = torch.frombuffer(view, dtype=torch.uint8).view(x.dtype).view(x.shape)
        return out if zero_copy else out.clone()


def _sanity_checks() -> None:
    if "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
        raise RuntimeError(
            "TorchMemorySaver is disabled for the current process because "
            "expandable_segments is not supported yet (torch maps expandable segments "
            "itself, past every allocator hook); unset expandable_segments:True in "
            "PYTORCH_CUDA_ALLOC_CONF"
        )


def _check_one_core(cdll: Any) -> None:
    """The preload library must route to the same core as this Python package: a second
    copy would hold regions that this package's pause never sees."""
    probe = f"gpu-pager-probe-{os.getpid()}"
    previous = cdll.tms_get_current_tag()
    cdll.tms_set_current_tag(probe.encode())
    seen = _native._tms_tag()
    cdll.tms_set_current_tag(previous)
    if seen != probe:
        raise RuntimeError(
            "gpu-pager's preload library runs another copy of gpu-pager than the gpu_pager "
            f"package imported here ({_native.__file__}); set GPU_PAGER_CORE to that path, "
            "or use the preload library of the same installation (configure_subprocess())"
        )


def _keep_pools(pools: dict[Any, Any]) -> None:
    for pool in pools.values():
        _pools.keep_forever(pool)
