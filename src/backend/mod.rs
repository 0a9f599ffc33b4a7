//! The few primitives the pager needs from a device, and two implementations.
//!
//! [`cuda::CudaBackend`] drives CUDA virtual memory management (VMM) through the driver API;
//! [`host::HostBackend`] provides the same primitives on host memory (memfd + mmap) so that
//! every pager path, out-of-memory included, runs without a GPU. (The workspace's
//! `gpu-pager-testkit` crate wraps either and injects failures, to test the pager's error
//! paths.)
//!
//! The handles are RAII: a [`Mapping`] unmaps and then releases its physical memory when
//! dropped; a [`Reservation`] frees its address range when dropped. A mapping holds the
//! reservation it lies in (an `Arc`), so the range is freed only after the last mapping
//! inside it is unmapped, whatever order the owners drop them in.
//!
//! A failure inside a `Drop` (an unmap, a release, a free, an event destroy) cannot be
//! returned: the handle records it in its backend's [`DeferredErrors`], which logs it
//! through the [`log`] crate and keeps it for [`crate::Pager::stats`] and
//! [`crate::Pager::take_deferred_errors`]. Nothing in the library prints.
//!
//! Device addresses are plain `u64` values. Functions that dereference them are `unsafe`:
//! the caller promises the range lies inside mapped memory of this backend.

pub mod cuda;
pub mod host;
pub(crate) mod reclaim;

use std::collections::VecDeque;
use std::fmt;
use std::ops::Range;
use std::sync::{Arc, Mutex};

use crate::kernels::kv::{KvError, KvOp};

/// Which implementation a backend is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BackendKind {
    /// CUDA driver VMM on a GPU.
    Cuda,
    /// Host memory standing in for a GPU (memfd + mmap).
    Host,
}

impl fmt::Display for BackendKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            BackendKind::Cuda => "cuda",
            BackendKind::Host => "host",
        })
    }
}

/// What a backend says about its device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Implementation.
    pub kind: BackendKind,
    /// Human-readable device name (e.g. "NVIDIA H200", "host memory").
    pub name: String,
    /// Physical allocation granularity in bytes (queried, never assumed). Chunk sizes and
    /// mapping offsets are multiples of it.
    pub granularity: usize,
    /// Total device memory in bytes (for the host backend: its capacity limit).
    pub total_bytes: usize,
    /// Compute capability (major, minor) on CUDA, `None` on the host backend.
    pub compute_capability: Option<(i32, i32)>,
    /// The CUDA device number, `None` on the host backend.
    pub ordinal: Option<usize>,
}

/// One process using the device and its device memory, as the driver's management library
/// (NVML) reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceProcess {
    /// Its process id, in NVML's PID namespace (the host's, inside a container that does not
    /// share it).
    pub pid: u32,
    /// Device memory it holds, its CUDA context included; `None` where NVML does not say.
    pub bytes: Option<usize>,
}

/// Free and total device memory, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemInfo {
    /// Bytes a new allocation could still get.
    pub free: usize,
    /// Bytes the device has in all.
    pub total: usize,
}

/// Processes' shares of the host budget as `pid 123: 4.00 GiB, pid 456: 0.50 GiB`.
pub(crate) fn shown_shares(shares: &[(u32, usize)]) -> String {
    let parts: Vec<String> = shares
        .iter()
        .map(|&(p, b)| format!("pid {p}: {}", crate::names::size(b)))
        .collect();
    parts.join(", ")
}

/// A failure inside a backend. The pager turns these into [`crate::Error`] values that
/// name the region.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// The device could not provide `requested` bytes of physical memory.
    #[error("out of device memory: {requested} bytes requested")]
    OutOfMemory {
        /// Bytes asked for in the failing call.
        requested: usize,
    },
    /// Host memory could not be allocated (a backup, a staging or swap buffer).
    #[error(
        "out of host memory: {requested} bytes could not be allocated; free host memory, or \
         back the region up to a file (the file backup medium)"
    )]
    HostOutOfMemory {
        /// Bytes asked for.
        requested: usize,
    },
    /// A backup would take this node's gpu-pager processes past their host-memory budget
    /// ([`crate::PagerConfig::host_budget_bytes`]); nothing was pinned.
    #[error(
        "the host-memory budget of this node's gpu-pager processes ({}) would be passed: \
         {} more asked for, shares now {}; raise host_budget_bytes (GPU_PAGER_HOST_BUDGET), \
         release fewer regions with backups at once{}",
        crate::names::size(*budget), crate::names::size(*requested),
        shown_shares(shares),
        if *staging {
            " (a file backup takes host memory only for this staging buffer, once per pager)"
        } else {
            ", or back this region up to a file (the file backup medium)"
        }
    )]
    HostBudget {
        /// The budget, in bytes.
        budget: usize,
        /// What the backup asked for.
        requested: usize,
        /// Each live process's share, largest first: (pid, bytes).
        shares: Vec<(u32, usize)>,
        /// Whether it was a file backup's staging buffer (backing up to a file is no way
        /// out then).
        staging: bool,
    },
    /// A driver call failed.
    #[error("{op} failed: {message}")]
    Driver {
        /// The driver call, e.g. `cuMemMap`.
        op: &'static str,
        /// The driver's error name and text.
        message: String,
    },
    /// An operating-system call failed (host backend).
    #[error("{op} failed: {error}")]
    Os {
        /// The system call, e.g. `mmap`.
        op: &'static str,
        /// The OS error (part of the message; not a `source()`, so that error-chain printers
        /// show it once).
        error: std::io::Error,
    },
    /// A file operation of a file backup ([`crate::Medium::File`]) failed: a full disk, a
    /// directory that is not writable, too many open files, a backup that cannot be read
    /// back. The message says whether anything was lost and what to do.
    #[error("{op} `{path}` failed: {error}; {}", file_advice(*.lost, error))]
    File {
        /// What was being done, e.g. `writing a backup file in`.
        op: &'static str,
        /// The directory of the backup file (which has no name of its own).
        path: String,
        /// The OS error (part of the message, not a `source()`).
        error: std::io::Error,
        /// Whether the backup's contents are gone (a read failed): a retry fails the same
        /// way. Otherwise the move did not happen and nothing was lost.
        lost: bool,
    },
    /// Arguments the backend cannot act on (misaligned, zero-sized, ...).
    #[error("invalid argument to {op}: {reason}")]
    Invalid {
        /// The operation.
        op: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// An invariant of the backend itself failed: a bug, not the caller's input.
    #[error("{op}: {reason}")]
    Internal {
        /// The operation.
        op: &'static str,
        /// Which invariant failed.
        reason: String,
    },
    /// No usable device (no driver, no GPU).
    #[error("no usable device: {0}")]
    Unavailable(String),
    /// The NVIDIA driver is older than [`DRIVER_FLOOR`]: a GPU is there, but gpu-pager's
    /// kernels and driver calls need a newer driver.
    #[error(
        "the NVIDIA driver on this machine supports CUDA {} (cuDriverGetVersion: {found}); \
         gpu-pager needs a driver for CUDA {} or newer (r525.60.13 or newer; CUDA 13 drivers \
         included): update the NVIDIA driver",
        cuda_version(*.found),
        cuda_version(DRIVER_FLOOR)
    )]
    UnsupportedDriver {
        /// The driver's CUDA version as `cuDriverGetVersion` gives it (`1000 * major + 10 *
        /// minor`, e.g. 11080 for 11.8).
        found: i32,
    },
    /// A fault injected through a test hook.
    #[error("injected fault in {op}")]
    Injected {
        /// The operation that was made to fail.
        op: &'static str,
    },
}

/// What to do about a failed file operation of a file backup, by its cause.
fn file_advice(lost: bool, error: &std::io::Error) -> &'static str {
    if lost {
        return "the backup's contents are lost (the file was damaged, truncated or its disk \
                failed) and a retry fails the same way: remove the region and load its \
                contents again";
    }
    match error.raw_os_error() {
        Some(libc::ENOSPC | libc::EDQUOT | libc::EFBIG) => {
            "the move did not happen and nothing was lost — free disk space, or set another \
             backup directory (set_backup_dir)"
        }
        Some(libc::EMFILE | libc::ENFILE) => {
            "the move did not happen and nothing was lost — the process has too many open \
             files: raise its limit (ulimit -n) or close files"
        }
        Some(libc::ENOENT | libc::ENOTDIR | libc::EACCES | libc::EPERM | libc::EROFS) => {
            "the move did not happen and nothing was lost — the backup directory cannot hold \
             files (missing, not a directory, read-only or not writable by this user): set a \
             writable directory on a real disk (set_backup_dir or GPU_PAGER_BACKUP_DIR)"
        }
        _ => {
            "the move did not happen and nothing was lost — check the backup directory's \
             disk, or set another backup directory (set_backup_dir)"
        }
    }
}

/// Result type of backend calls.
pub type BackendResult<T> = Result<T, BackendError>;

/// The oldest driver gpu-pager runs on, as `cuDriverGetVersion` counts: CUDA 12.0 (driver
/// r525.60.13). The kernels are CUDA 12 images, which load on every CUDA 12 and 13 driver,
/// and the driver calls are CUDA 12.0's API.
pub const DRIVER_FLOOR: i32 = 12000;

/// `12000` as `"12.0"`, `11080` as `"11.8"`.
fn cuda_version(v: i32) -> String {
    format!("{}.{}", v / 1000, (v % 1000) / 10)
}

/// Checks a driver version (as `cuDriverGetVersion` gives it) against [`DRIVER_FLOOR`].
pub fn check_driver_version(found: i32) -> BackendResult<()> {
    if found < DRIVER_FLOOR {
        return Err(BackendError::UnsupportedDriver { found });
    }
    Ok(())
}

/// How many unread messages a [`DeferredErrors`] keeps; older ones are dropped (and still
/// counted in [`DeferredErrors::total`]).
pub const DEFERRED_ERRORS_KEPT: usize = 64;

/// Failures that no call could return, kept as values (cudarc's `record_err` / `check_err`
/// pattern): a driver or OS call made from a `Drop` (unmapping, releasing, freeing,
/// destroying an event, giving the caller's CUDA context back), a cleanup call on an error
/// path whose first error was returned instead, and errors cudarc deferred from its own
/// `Drop` impls.
///
/// Each backend owns one ([`Backend::deferred_errors`]) and every handle it hands out holds
/// it (an `Arc`), so a handle dropped after its backend still has somewhere to report.
/// [`DeferredErrors::record`] logs the message through the [`log`] crate (level `error`,
/// target `gpu_pager`) and keeps it until [`DeferredErrors::take`]; nothing is printed.
#[derive(Debug, Default)]
pub struct DeferredErrors {
    state: Mutex<DeferredState>,
}

#[derive(Debug, Default)]
struct DeferredState {
    total: u64,
    unread: VecDeque<String>,
}

impl DeferredErrors {
    /// An empty sink.
    pub fn new() -> Self {
        Self::default()
    }

    fn state(&self) -> std::sync::MutexGuard<'_, DeferredState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Logs `message` and keeps it (the newest [`DEFERRED_ERRORS_KEPT`] are kept).
    pub fn record(&self, message: impl Into<String>) {
        let message = message.into();
        log::error!(target: "gpu_pager", "{message}");
        let mut s = self.state();
        s.total += 1;
        if s.unread.len() == DEFERRED_ERRORS_KEPT {
            s.unread.pop_front();
        }
        s.unread.push_back(message);
    }

    /// The kept messages, oldest first, without removing them.
    pub fn unread(&self) -> Vec<String> {
        self.state().unread.iter().cloned().collect()
    }

    /// Removes and returns the kept messages, oldest first.
    pub fn take(&self) -> Vec<String> {
        self.state().unread.drain(..).collect()
    }

    /// Failures recorded since the sink was created, taken or not.
    pub fn total(&self) -> u64 {
        self.state().total
    }
}

/// A reserved virtual address range, shared (`Arc`) by its owner and by every [`Mapping`]
/// inside it. Dropping the last reference frees the range, so no mapping outlives it.
pub trait Reservation: Send + Sync + fmt::Debug {
    /// First address of the range.
    fn base(&self) -> u64;
    /// Length of the range in bytes.
    fn len(&self) -> usize;
    /// Whether the range is empty (never true for a live reservation).
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Physical memory mapped at a fixed address with read/write access. Dropping it unmaps the
/// range (leaving the address reserved) and then releases the physical memory.
pub trait Mapping: Send + Sync + fmt::Debug {
    /// Address the memory is mapped at.
    fn ptr(&self) -> u64;
    /// Length in bytes.
    fn len(&self) -> usize;
    /// Its range has been unmapped already, with its neighbours', by its backend's
    /// [`Backend::unmap_runs`]: dropping it then only releases the memory. A wrapper around
    /// another backend's mapping passes this on.
    fn unmapped(&mut self);
    /// Whether the mapping is empty (never true for a live mapping).
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Page-locked ("pinned") host memory that the device can copy to and from at full link
/// speed. Allocated once per region and kept across cycles (pinning is slow).
pub trait HostBuffer: Send + Sync + fmt::Debug {
    /// The bytes.
    fn as_slice(&self) -> &[u8];
    /// The bytes, mutable.
    fn as_mut_slice(&mut self) -> &mut [u8];
    /// Length in bytes.
    fn len(&self) -> usize {
        self.as_slice().len()
    }
    /// Whether the buffer is empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The address kernels (the copy kernel, the KV swaps) use to read and write the buffer
    /// in place (zero-copy). The CUDA backend maps its pinned memory into the device's
    /// address space and returns the driver's device pointer for it; with unified addressing
    /// (every 64-bit CUDA platform) that is the host address, which is the default here.
    fn device_ptr(&self) -> u64 {
        self.as_slice().as_ptr() as u64
    }
    /// The buffer is registered with the driver in pieces of this many bytes from its start
    /// (the last one shorter); 0 (the default): as one. A copy between the device and the
    /// buffer must stay inside one piece (the driver does not document a copy across two
    /// registrations as valid): the copy pump (`src/pump.rs`) cuts its copies at these boundaries.
    /// Multi-piece buffers come from [`Backend::alloc_pinned_from_device`].
    fn piece_bytes(&self) -> usize {
        0
    }
}

/// A CUDA stream (`CUstream`) of the caller's, as an integer so that it is `Send`. The
/// backend enqueues work on it without taking ownership. `RawStream(0)` is the legacy
/// default stream. The host backend runs everything synchronously and ignores it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RawStream(pub usize);

/// A point in a stream's work, recorded by [`Backend::fence`] (or after one copy by
/// [`Backend::copy_unit`]).
pub trait Fence: Send + Sync + fmt::Debug {
    /// Blocks until the stream's work before the fence has finished.
    fn wait(&self) -> BackendResult<()>;

    /// Whether the stream's work before the fence has finished, without blocking
    /// (`cuEventQuery`). An error (a failed copy, a broken context) is returned as such.
    fn is_done(&self) -> BackendResult<bool>;
}

/// Who moves the bytes of a copy between host and device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Mover {
    /// The GPU's copy engine (DMA): `cuMemcpyHtoDAsync` / `cuMemcpyDtoHAsync` from or to the
    /// pinned host memory.
    CopyEngine,
    /// The copy kernel (`gp_copy`, [`crate::kernels::COPY`]) on the SMs, loading or storing
    /// the pinned host memory directly (zero-copy, through [`HostBuffer::device_ptr`]).
    CopyKernel,
}

impl Mover {
    /// Both movers, in index order.
    pub const ALL: [Mover; 2] = [Mover::CopyEngine, Mover::CopyKernel];

    /// 0 for the copy engine, 1 for the copy kernel.
    pub fn index(self) -> usize {
        self as usize
    }
}

impl fmt::Display for Mover {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Mover::CopyEngine => "copy engine",
            Mover::CopyKernel => "copy kernel",
        })
    }
}

/// Which way a copy goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Direction {
    /// Host to device (a restore).
    ToDevice,
    /// Device to host (a backup).
    ToHost,
}

/// A device range to copy into a fresh pinned buffer
/// ([`Backend::alloc_pinned_many_from_device`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceRange {
    /// Device address of the first byte.
    pub src: u64,
    /// Bytes (at least one).
    pub bytes: usize,
}

/// One contiguous copy between pinned host memory and device memory, as raw addresses
/// (what [`Backend::copy_unit`] and [`Backend::copy_on`] move; the copy pump cuts
/// borrowed host memory into these).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RawCopy {
    /// Which way the bytes go.
    pub direction: Direction,
    /// Host address of the first host byte: what the copy engine is given.
    pub host: u64,
    /// Device address of the same host byte ([`HostBuffer::device_ptr`] plus the offset):
    /// what the copy kernel loads or stores.
    pub host_device: u64,
    /// Device address of the first device byte.
    pub device: u64,
    /// Bytes to copy.
    pub bytes: usize,
}

/// `bufs` when a batch call returned one buffer per request (`want` of them); else
/// [`BackendError::Invalid`] naming `op`, a backend that broke the batch contract.
pub(crate) fn one_each(
    op: &'static str,
    bufs: Vec<Box<dyn HostBuffer>>,
    want: usize,
) -> BackendResult<Vec<Box<dyn HostBuffer>>> {
    if bufs.len() == want {
        return Ok(bufs);
    }
    let reason = format!("{} buffers for {want} requests", bufs.len());
    Err(BackendError::Invalid { op, reason })
}

/// The primitives the pager needs. Implementations are thread-safe; the pager serialises
/// moves of one region itself.
///
/// Every method is required (none has a default), so that a wrapper that forwards to an
/// inner backend cannot leave out a method added later without the compiler saying so; the
/// helpers [`pin_each`], [`pin_then_copy`] and [`pin_many_then_copy`] are what a backend
/// without a faster way answers.
pub trait Backend: Send + Sync + fmt::Debug {
    /// Describes the device.
    fn info(&self) -> &DeviceInfo;

    /// Where this backend's handles record the failures their `Drop` cannot return. A
    /// wrapper returns the wrapped backend's (its handles are the wrapped backend's).
    fn deferred_errors(&self) -> &Arc<DeferredErrors>;

    /// Free and total device memory now.
    fn mem_info(&self) -> BackendResult<MemInfo>;

    /// The processes using the device now, with their device memory, where the backend can
    /// see them (NVML on a GPU); `None` where it cannot.
    fn processes(&self) -> Option<Vec<DeviceProcess>>;

    /// Whether a release of device memory makes the backend collect the driver's scrubbed
    /// pages ahead, on a helper thread, so that the next allocation does not pay for them
    /// (off until turned on; a pager sets it from [`crate::Tuning::reclaim_scrubbed`], on by
    /// default): the driver zeroes freed memory and hands it back to its allocator only
    /// at an allocation, which then waits for that bookkeeping (about 20 ms per 64 GiB on
    /// an H100). A backend without a scrubber ignores it.
    fn set_reclaim_scrubbed(&self, on: bool);

    /// Reserves `bytes` (a multiple of the granularity) of virtual address space, mapped to
    /// nothing. Accessing it faults until something is mapped.
    fn reserve(&self, bytes: usize) -> BackendResult<Arc<dyn Reservation>>;

    /// Creates one physical chunk per entry of `chunk_sizes` (each a multiple of the
    /// granularity), maps them back to back starting `offset` bytes into `reservation`, and
    /// enables read/write access over the whole span. Each mapping holds `reservation`, so the
    /// range stays reserved until the last of them is dropped. All or nothing: on failure
    /// everything created in this call is unmapped and released before the error returns.
    ///
    /// Checked ([`BackendError::Invalid`], nothing mapped): `chunk_sizes` non-empty, every
    /// size and `offset` a multiple of the granularity, and the span inside the reservation.
    ///
    /// # Safety
    /// What the backend cannot check stays the caller's: `reservation` must come from this
    /// backend's [`Backend::reserve`] (a `dyn Reservation` does not say whose it is, and the
    /// host backend maps with `MAP_FIXED`, which would replace whatever another owner has at
    /// those addresses), and no part of the span may be mapped already (the backend does not
    /// track which parts of a reservation are mapped; on the host a second mapping silently
    /// replaces the first, whose drop would later unmap the second under its owner).
    unsafe fn map(
        &self,
        reservation: &Arc<dyn Reservation>,
        offset: usize,
        chunk_sizes: &[usize],
    ) -> BackendResult<Vec<Box<dyn Mapping>>>;

    /// Unmaps `maps` (in address order) one run of mappings laid back to back at a time,
    /// where the backend can: one driver call per run instead of one per mapping, which a
    /// release of hundreds of buffers pays for each. Each mapping so unmapped is told
    /// ([`Mapping::unmapped`]); dropping it then releases its memory. A run the backend
    /// cannot unmap whole is left as it was, and each of its mappings unmaps itself when
    /// dropped, as always; so nothing fails here, and a backend without a faster way does
    /// nothing.
    ///
    /// # Safety
    /// Every mapping is this backend's (from its [`Backend::map`], or a wrapper's around
    /// those), and nothing on the device uses their ranges any more (the caller waited).
    unsafe fn unmap_runs(&self, maps: &mut [Box<dyn Mapping>]);

    /// Waits until every operation queued on the device (by anyone in this process) has
    /// finished. Release calls this before it unmaps anything.
    fn synchronize(&self) -> BackendResult<()>;

    /// Allocates `bytes` of pinned host memory, reading as zeros. On CUDA: anonymous memory
    /// touched on every core, then registered (see [`cuda::CudaBackend::pin`]).
    fn alloc_pinned(&self, bytes: usize) -> BackendResult<Box<dyn HostBuffer>>;

    /// Allocates one pinned buffer per entry of `sizes` (each as [`Backend::alloc_pinned`]
    /// would: reading as zeros, at least one byte), in one batch where the backend can do
    /// better than one call each: a growing region's first release pins the backups of all
    /// its buffers with one call. The buffers are independent: each may be dropped on its
    /// own, in any order. All or nothing: on error nothing allocated by this call stays
    /// allocated. No sizes: no buffers.
    ///
    /// [`pin_each`] calls [`Backend::alloc_pinned`] once per size; the CUDA backend pins
    /// the batch at once ([`cuda::CudaBackend::pin_many`]).
    fn alloc_pinned_many(&self, sizes: &[usize]) -> BackendResult<Vec<Box<dyn HostBuffer>>>;

    /// Copies `src` (any host memory) to device address `dst` with the copy engine and waits
    /// for the copy to finish.
    ///
    /// # Safety
    /// `dst .. dst + src.len()` must be mapped device memory of this backend that no other
    /// thread writes concurrently.
    unsafe fn copy_to_device(&self, dst: u64, src: &[u8]) -> BackendResult<()>;

    /// Copies device address `src` into `dst` (any host memory) with the copy engine and
    /// waits for the copy to finish.
    ///
    /// # Safety
    /// `src .. src + dst.len()` must be mapped device memory of this backend.
    unsafe fn copy_to_host(&self, dst: &mut [u8], src: u64) -> BackendResult<()>;

    /// Allocates `bytes` of pinned host memory as [`Backend::alloc_pinned`] does, filled with
    /// a copy of device memory at `src`: a region's first backup in one step.
    /// [`pin_then_copy`] pins, then copies; the CUDA backend overlaps the two
    /// ([`cuda::CudaBackend::pin_from_device`], registering in pieces: see
    /// [`HostBuffer::piece_bytes`]). Nothing is left allocated on error.
    ///
    /// # Safety
    /// `src .. src + bytes` must be mapped device memory of this backend, not written until
    /// the call returns.
    unsafe fn alloc_pinned_from_device(
        &self,
        bytes: usize,
        src: u64,
    ) -> BackendResult<Box<dyn HostBuffer>>;

    /// Allocates one pinned buffer per entry of `ranges` (of its `bytes`, as
    /// [`Backend::alloc_pinned_many`] does: independent buffers, each droppable on its own),
    /// each filled with a copy of its device range: the missing backups of a growing region's
    /// buffers in one step. [`pin_many_then_copy`] pins the batch, then copies each buffer; the CUDA
    /// backend overlaps the two ([`cuda::CudaBackend::pin_many_from_device`]). All or
    /// nothing: on error nothing allocated by this call stays allocated. No ranges: no
    /// buffers.
    ///
    /// # Safety
    /// Every `src .. src + bytes` of `ranges` must be mapped device memory of this backend,
    /// not written until the call returns.
    unsafe fn alloc_pinned_many_from_device(
        &self,
        ranges: &[DeviceRange],
    ) -> BackendResult<Vec<Box<dyn HostBuffer>>>;

    /// Enqueues `copy` with `mover` on the backend's own stream for that mover and the copy's
    /// direction (four streams: copy engine and copy kernel, each way, so that copies of
    /// either direction and by either mover run side by side), records a fence right after
    /// it, and returns the fence without waiting. A failed call leaves nothing of itself in
    /// flight. The host backend copies at once and returns a passed fence.
    ///
    /// Use the copy pump (`src/pump.rs`), which keeps the host memory borrowed until the copy has
    /// finished; this is its primitive.
    ///
    /// # Safety
    /// Until the fence has passed: `copy.device .. + copy.bytes` is mapped device memory of
    /// this backend that nothing else accesses; `copy.host .. + copy.bytes` is live pinned
    /// memory from this backend's [`Backend::alloc_pinned`] with `copy.host_device` its
    /// device address, not written by anyone (and, for [`Direction::ToHost`], not read
    /// either); the two ranges do not overlap.
    unsafe fn copy_unit(&self, copy: &RawCopy, mover: Mover) -> BackendResult<Box<dyn Fence>>;

    /// Enqueues `copy` with `mover` (a copy-engine call, or a launch of the copy kernel) on
    /// the caller's `stream` and returns without waiting and without a fence. The host
    /// backend copies at once.
    ///
    /// # Safety
    /// As [`Backend::copy_unit`], until the stream has run the copy; `stream` is a live
    /// stream of this backend's context.
    unsafe fn copy_on(&self, copy: &RawCopy, mover: Mover, stream: RawStream) -> BackendResult<()>;

    /// Records a fence on the caller's `stream` after the work enqueued on it so far (a CUDA
    /// event). The host backend's fences are already passed.
    fn fence(&self, stream: RawStream) -> BackendResult<Box<dyn Fence>>;

    /// Fills `bytes` at `dst` with the 32-bit `pattern` repeated (byte `j` of the range is
    /// byte `j % 4` of `pattern` in little-endian order; pattern 0 zeroes). Waits for it.
    ///
    /// # Safety
    /// `dst .. dst + bytes` must be mapped device memory of this backend.
    unsafe fn fill(&self, dst: u64, bytes: usize, pattern: u32) -> BackendResult<()>;

    /// Hashes `bytes` at `src` in chunks of `chunk_bytes` (the last chunk may be shorter) with
    /// [`crate::kernels::reference::chunk_hash`]'s function and returns one hash per chunk.
    /// `src` must be 16-byte aligned, `bytes` non-zero, `chunk_bytes` a non-zero multiple of
    /// 16, and the range at most [`crate::kernels::MAX_HASH_CHUNKS`] chunks; otherwise
    /// [`BackendError::Invalid`].
    ///
    /// # Safety
    /// `src .. src + bytes` must be mapped device memory of this backend.
    unsafe fn chunk_hash(
        &self,
        src: u64,
        bytes: usize,
        chunk_bytes: usize,
    ) -> BackendResult<Vec<u64>>;

    /// The backend's paged-KV-cache kernels. A wrapper that leaves them alone returns the
    /// wrapped backend's; one that changes them implements [`KvKernels`] and returns itself.
    fn kv_kernels(&self) -> &dyn KvKernels;
}

/// Implements the named [`Backend`] methods of a wrapper by calling the same method of its
/// field `inner` (itself a [`Backend`]), inside `impl Backend for Wrapper { ... }` beside
/// the methods the wrapper changes:
///
/// ```ignore
/// impl Backend for Wrapper {
///     gpu_pager::forward_backend!(inner: info, deferred_errors, mem_info, synchronize);
///     fn reserve(&self, bytes: usize) -> BackendResult<Arc<dyn Reservation>> { ... }
///     // ...
/// }
/// ```
///
/// Every method of the trait is required, so a method neither written nor named here is a
/// compile error, never a silent default. An unsafe method forwarded keeps its contract:
/// the wrapper's caller upholds it for the inner backend. `kv_kernels` forwards to the
/// inner backend's kernels.
#[macro_export]
macro_rules! forward_backend {
    ($inner:ident: $($method:ident),+ $(,)?) => {
        $( $crate::forward_backend!(@one $inner $method); )+
    };
    (@one $i:ident info) => {
        fn info(&self) -> &$crate::backend::DeviceInfo {
            self.$i.info()
        }
    };
    (@one $i:ident deferred_errors) => {
        fn deferred_errors(&self) -> &::std::sync::Arc<$crate::backend::DeferredErrors> {
            self.$i.deferred_errors()
        }
    };
    (@one $i:ident mem_info) => {
        fn mem_info(&self) -> $crate::backend::BackendResult<$crate::backend::MemInfo> {
            self.$i.mem_info()
        }
    };
    (@one $i:ident processes) => {
        fn processes(&self) -> ::std::option::Option<::std::vec::Vec<$crate::backend::DeviceProcess>> {
            self.$i.processes()
        }
    };
    (@one $i:ident set_reclaim_scrubbed) => {
        fn set_reclaim_scrubbed(&self, on: bool) {
            self.$i.set_reclaim_scrubbed(on)
        }
    };
    (@one $i:ident reserve) => {
        fn reserve(
            &self,
            bytes: usize,
        ) -> $crate::backend::BackendResult<::std::sync::Arc<dyn $crate::backend::Reservation>> {
            self.$i.reserve(bytes)
        }
    };
    (@one $i:ident map) => {
        unsafe fn map(
            &self,
            reservation: &::std::sync::Arc<dyn $crate::backend::Reservation>,
            offset: usize,
            chunk_sizes: &[usize],
        ) -> $crate::backend::BackendResult<::std::vec::Vec<::std::boxed::Box<dyn $crate::backend::Mapping>>> {
            // SAFETY: the caller upholds `map`'s contract, the inner backend's.
            unsafe { self.$i.map(reservation, offset, chunk_sizes) }
        }
    };
    (@one $i:ident unmap_runs) => {
        unsafe fn unmap_runs(&self, maps: &mut [::std::boxed::Box<dyn $crate::backend::Mapping>]) {
            // SAFETY: the caller upholds `unmap_runs`'s contract, the inner backend's.
            unsafe { self.$i.unmap_runs(maps) }
        }
    };
    (@one $i:ident synchronize) => {
        fn synchronize(&self) -> $crate::backend::BackendResult<()> {
            self.$i.synchronize()
        }
    };
    (@one $i:ident alloc_pinned) => {
        fn alloc_pinned(
            &self,
            bytes: usize,
        ) -> $crate::backend::BackendResult<::std::boxed::Box<dyn $crate::backend::HostBuffer>> {
            self.$i.alloc_pinned(bytes)
        }
    };
    (@one $i:ident alloc_pinned_many) => {
        fn alloc_pinned_many(
            &self,
            sizes: &[usize],
        ) -> $crate::backend::BackendResult<::std::vec::Vec<::std::boxed::Box<dyn $crate::backend::HostBuffer>>> {
            self.$i.alloc_pinned_many(sizes)
        }
    };
    (@one $i:ident copy_to_device) => {
        unsafe fn copy_to_device(&self, dst: u64, src: &[u8]) -> $crate::backend::BackendResult<()> {
            // SAFETY: the caller upholds `copy_to_device`'s contract, the inner backend's.
            unsafe { self.$i.copy_to_device(dst, src) }
        }
    };
    (@one $i:ident copy_to_host) => {
        unsafe fn copy_to_host(&self, dst: &mut [u8], src: u64) -> $crate::backend::BackendResult<()> {
            // SAFETY: the caller upholds `copy_to_host`'s contract, the inner backend's.
            unsafe { self.$i.copy_to_host(dst, src) }
        }
    };
    (@one $i:ident alloc_pinned_from_device) => {
        unsafe fn alloc_pinned_from_device(
            &self,
            bytes: usize,
            src: u64,
        ) -> $crate::backend::BackendResult<::std::boxed::Box<dyn $crate::backend::HostBuffer>> {
            // SAFETY: the caller upholds the contract, the inner backend's.
            unsafe { self.$i.alloc_pinned_from_device(bytes, src) }
        }
    };
    (@one $i:ident alloc_pinned_many_from_device) => {
        unsafe fn alloc_pinned_many_from_device(
            &self,
            ranges: &[$crate::backend::DeviceRange],
        ) -> $crate::backend::BackendResult<::std::vec::Vec<::std::boxed::Box<dyn $crate::backend::HostBuffer>>> {
            // SAFETY: the caller upholds the contract, the inner backend's.
            unsafe { self.$i.alloc_pinned_many_from_device(ranges) }
        }
    };
    (@one $i:ident copy_unit) => {
        unsafe fn copy_unit(
            &self,
            copy: &$crate::backend::RawCopy,
            mover: $crate::backend::Mover,
        ) -> $crate::backend::BackendResult<::std::boxed::Box<dyn $crate::backend::Fence>> {
            // SAFETY: the caller upholds `copy_unit`'s contract, the inner backend's.
            unsafe { self.$i.copy_unit(copy, mover) }
        }
    };
    (@one $i:ident copy_on) => {
        unsafe fn copy_on(
            &self,
            copy: &$crate::backend::RawCopy,
            mover: $crate::backend::Mover,
            stream: $crate::backend::RawStream,
        ) -> $crate::backend::BackendResult<()> {
            // SAFETY: the caller upholds `copy_on`'s contract, the inner backend's.
            unsafe { self.$i.copy_on(copy, mover, stream) }
        }
    };
    (@one $i:ident fence) => {
        fn fence(
            &self,
            stream: $crate::backend::RawStream,
        ) -> $crate::backend::BackendResult<::std::boxed::Box<dyn $crate::backend::Fence>> {
            self.$i.fence(stream)
        }
    };
    (@one $i:ident fill) => {
        unsafe fn fill(&self, dst: u64, bytes: usize, pattern: u32) -> $crate::backend::BackendResult<()> {
            // SAFETY: the caller upholds `fill`'s contract, the inner backend's.
            unsafe { self.$i.fill(dst, bytes, pattern) }
        }
    };
    (@one $i:ident chunk_hash) => {
        unsafe fn chunk_hash(
            &self,
            src: u64,
            bytes: usize,
            chunk_bytes: usize,
        ) -> $crate::backend::BackendResult<::std::vec::Vec<u64>> {
            // SAFETY: the caller upholds `chunk_hash`'s contract, the inner backend's.
            unsafe { self.$i.chunk_hash(src, bytes, chunk_bytes) }
        }
    };
    (@one $i:ident kv_kernels) => {
        fn kv_kernels(&self) -> &dyn $crate::backend::KvKernels {
            self.$i.kv_kernels()
        }
    };
}

/// The paged-KV-cache kernels of a backend, reached through [`Backend::kv_kernels`].
///
/// They are custom operations on top of the primitives of [`Backend`], kept out of it (as
/// mistral.rs keeps paged attention a custom op outside candle's `BackendStorage`), so that
/// a wrapper forwards only what it wraps: a fault-injecting wrapper of memory primitives
/// forwards `kv_kernels` whole, and a wrapper of the KV kernels implements this trait alone.
pub trait KvKernels: Send + Sync {
    /// Runs one paged-KV-cache kernel ([`KvOp`]) and waits for it. The call is checked first
    /// ([`KvOp::check`]: ids and slots in range, lengths consistent, no buffer overlapping the
    /// cache); a failed check is [`BackendError::Invalid`] and nothing runs.
    ///
    /// # Safety
    /// Every block of the cache the call touches, and every buffer span of `op`, must be
    /// mapped memory of this backend (pinned host memory from [`Backend::alloc_pinned`] for
    /// the swaps) that nothing else accesses until the call returns.
    unsafe fn kv(&self, op: &KvOp<'_>) -> BackendResult<()>;

    /// Enqueues one paged-KV-cache kernel on the caller's `stream` and returns without
    /// waiting (no host synchronisation; nothing is allocated or copied). The op is checked
    /// as by [`KvKernels::kv`], from its host index lists; the kernel reads the same lists
    /// from device memory at `index`, laid out as: a write's `tokens` int64 slots; a
    /// gather's `⌈tokens / block_size⌉` uint32 block ids; copy_blocks' uint32 sources then
    /// destinations; a swap's uint32 block ids. The host backend runs the op synchronously
    /// from the host lists and ignores `stream` and `index`.
    ///
    /// # Safety
    /// As [`KvKernels::kv`], but until the kernel has run on `stream` (not until the call
    /// returns); `stream` is a live stream of this backend's context; `index` holds exactly
    /// the checked lists when the kernel runs.
    unsafe fn kv_on(&self, op: &KvOp<'_>, stream: RawStream, index: u64) -> BackendResult<()>;
}

/// Checks what [`Backend::copy_unit`] and [`Backend::copy_on`] can check themselves: a
/// non-empty copy whose ranges do not wrap the address space and do not overlap.
/// `Ok(false)`: nothing to copy.
pub(crate) fn check_copy(op: &'static str, copy: &RawCopy) -> BackendResult<bool> {
    if copy.bytes == 0 {
        return Ok(false);
    }
    let bytes = copy.bytes as u64;
    let ends = [copy.host, copy.host_device, copy.device].map(|a| a.checked_add(bytes));
    if ends.iter().any(Option::is_none) {
        return Err(BackendError::Invalid {
            op,
            reason: format!("a copy of {bytes} bytes wraps the address space ({copy:?})"),
        });
    }
    let overlaps = |a: u64, b: u64| a < b + bytes && b < a + bytes;
    if overlaps(copy.host, copy.device) || overlaps(copy.host_device, copy.device) {
        return Err(BackendError::Invalid {
            op,
            reason: format!("the host and device ranges of a copy overlap ({copy:?})"),
        });
    }
    Ok(true)
}

/// Checks the arguments of [`Backend::map`] against granularity `g` and returns the span's
/// first address and length.
pub(crate) fn check_map(
    reservation: &dyn Reservation,
    offset: usize,
    chunk_sizes: &[usize],
    g: usize,
) -> BackendResult<(u64, usize)> {
    let invalid = |reason: String| BackendError::Invalid { op: "map", reason };
    if chunk_sizes.is_empty() {
        return Err(invalid("no chunk sizes given".to_owned()));
    }
    if !offset.is_multiple_of(g) {
        return Err(invalid(format!(
            "offset {offset} is not a multiple of the granularity {g}"
        )));
    }
    let mut total = 0usize;
    for &size in chunk_sizes {
        if size == 0 || size % g != 0 {
            return Err(invalid(format!(
                "chunk size {size} is not a non-zero multiple of the granularity {g}"
            )));
        }
        total = total
            .checked_add(size)
            .ok_or_else(|| invalid("chunk sizes overflow usize".to_owned()))?;
    }
    if offset
        .checked_add(total)
        .is_none_or(|end| end > reservation.len())
    {
        return Err(invalid(format!(
            "{total} bytes at offset {offset} exceed the {}-byte reservation",
            reservation.len()
        )));
    }
    Ok((reservation.base() + offset as u64, total))
}

/// The backend's error for a KV call that fails its checks.
pub(crate) fn kv_invalid(op: &KvOp<'_>, e: KvError) -> BackendError {
    BackendError::Invalid {
        op: op.name(),
        reason: e.to_string(),
    }
}

/// The backend of device `ordinal`, by the one host-fallback rule of the crate (the
/// registry's pagers, the tools and the benches all use it): the CUDA backend when the
/// driver and the device are there; without a usable GPU, device 0 runs on the host backend
/// (capacity from [`host::CAPACITY_ENV`], else half the machine's memory, at most 32 GiB)
/// and the second value says why. Errors: a CUDA failure other than the absence of a
/// device, a device other than 0 without a GPU ([`BackendError::Unavailable`]), a malformed
/// [`host::CAPACITY_ENV`] ([`BackendError::Invalid`]).
pub fn auto(ordinal: usize) -> BackendResult<(Arc<dyn Backend>, Option<String>)> {
    let why = match cuda::CudaBackend::new(ordinal) {
        Ok(b) => return Ok((Arc::new(b), None)),
        Err(BackendError::Unavailable(why)) => why,
        Err(e) => return Err(e),
    };
    if ordinal != 0 {
        return Err(BackendError::Unavailable(format!(
            "device {ordinal}: {why}; without a GPU only device 0 exists (on the host \
             backend), so use device 0 or run on a machine with {} GPUs",
            ordinal + 1
        )));
    }
    let config = host::HostConfig::from_env()?;
    Ok((Arc::new(host::HostBackend::new(config)), Some(why)))
}

/// [`Backend::unmap_runs`] given the backend's unmap of one address range: `unmap(start,
/// len)` once per run of `maps` (in address order) laid back to back, a run of one mapping
/// included; each mapping of a run it unmapped (`true`) is told so.
pub fn unmap_by_runs(maps: &mut [Box<dyn Mapping>], mut unmap: impl FnMut(u64, usize) -> bool) {
    for run in contiguous_runs(maps) {
        let Some(run) = maps.get_mut(run) else {
            continue;
        };
        let (Some(first), Some(last)) = (run.first(), run.last()) else {
            continue;
        };
        let (start, end) = (first.ptr(), last.ptr() + last.len() as u64);
        if unmap(start, (end - start) as usize) {
            for m in run.iter_mut() {
                m.unmapped();
            }
        }
    }
}

/// The runs of `maps` (in address order) laid back to back, as index ranges into `maps`.
fn contiguous_runs(maps: &[Box<dyn Mapping>]) -> Vec<Range<usize>> {
    let mut runs: Vec<Range<usize>> = Vec::new();
    // Where the run so far ends, as an address.
    let mut end = None;
    for (k, m) in maps.iter().enumerate() {
        match runs.last_mut() {
            Some(r) if end == Some(m.ptr()) => r.end = k + 1,
            _ => runs.push(k..k + 1),
        }
        end = Some(m.ptr() + m.len() as u64);
    }
    runs
}

/// [`Backend::alloc_pinned_many`] by one [`Backend::alloc_pinned`] per size, for a backend
/// that cannot pin a batch faster.
pub fn pin_each(b: &dyn Backend, sizes: &[usize]) -> BackendResult<Vec<Box<dyn HostBuffer>>> {
    // Collecting into a `Result` stops at the first error and drops what it collected.
    sizes.iter().map(|&n| b.alloc_pinned(n)).collect()
}

/// [`Backend::alloc_pinned_from_device`] by pinning, then copying, for a backend that cannot
/// overlap the two.
///
/// # Safety
/// As [`Backend::alloc_pinned_from_device`].
pub unsafe fn pin_then_copy(
    b: &dyn Backend,
    bytes: usize,
    src: u64,
) -> BackendResult<Box<dyn HostBuffer>> {
    let mut buf = b.alloc_pinned(bytes)?;
    // SAFETY: `src .. src + bytes` is mapped device memory of this backend (the caller's
    // contract) and the buffer holds `bytes` bytes.
    unsafe { b.copy_to_host(buf.as_mut_slice(), src) }?;
    Ok(buf)
}

/// [`Backend::alloc_pinned_many_from_device`] by pinning the batch, then copying each
/// buffer, for a backend that cannot overlap the two.
///
/// # Safety
/// As [`Backend::alloc_pinned_many_from_device`].
pub unsafe fn pin_many_then_copy(
    b: &dyn Backend,
    ranges: &[DeviceRange],
) -> BackendResult<Vec<Box<dyn HostBuffer>>> {
    let sizes: Vec<usize> = ranges.iter().map(|r| r.bytes).collect();
    let bufs = b.alloc_pinned_many(&sizes)?;
    let mut bufs = one_each("alloc_pinned_many", bufs, ranges.len())?;
    // On error, dropping `bufs` frees every buffer.
    for (buf, r) in bufs.iter_mut().zip(ranges) {
        // SAFETY: `r.src .. r.src + r.bytes` is mapped device memory of this backend (the
        // caller's contract) and the buffer holds `r.bytes` bytes.
        unsafe { b.copy_to_host(buf.as_mut_slice(), r.src) }?;
    }
    Ok(bufs)
}

#[cfg(test)]
mod tests {
    use super::host::{HostBackend, HostConfig};
    use super::*;

    #[test]
    fn the_driver_floor_is_cuda_12_0() {
        for ok in [12000, 12020, 12090, 13000, 13020] {
            assert!(check_driver_version(ok).is_ok(), "{ok}");
        }
        for old in [0, 10020, 11080, 11090] {
            let err = check_driver_version(old).unwrap_err();
            assert!(matches!(err, BackendError::UnsupportedDriver { found } if found == old));
        }
        let msg = check_driver_version(11040).unwrap_err().to_string();
        assert!(
            msg.contains("supports CUDA 11.4 (cuDriverGetVersion: 11040)"),
            "{msg}"
        );
        assert!(
            msg.contains("CUDA 12.0 or newer (r525.60.13 or newer"),
            "{msg}"
        );
    }

    #[test]
    fn deferred_errors_keep_the_newest_and_count_all() {
        let sink = DeferredErrors::new();
        assert_eq!((sink.total(), sink.take()), (0, Vec::<String>::new()));
        for i in 0..DEFERRED_ERRORS_KEPT + 3 {
            sink.record(format!("failure {i}"));
        }
        assert_eq!(sink.total(), DEFERRED_ERRORS_KEPT as u64 + 3);
        let unread = sink.unread();
        assert_eq!(unread.len(), DEFERRED_ERRORS_KEPT);
        assert_eq!(unread[0], "failure 3");
        assert_eq!(sink.take(), unread);
        assert!(sink.take().is_empty());
        assert_eq!(sink.total(), DEFERRED_ERRORS_KEPT as u64 + 3);
    }

    #[test]
    fn map_checks_the_span_against_the_reservation() {
        let g = 64 << 10;
        let b = HostBackend::new(HostConfig {
            capacity: 16 * g,
            granularity: g,
        });
        let r = b.reserve(4 * g).expect("reserve");
        for (offset, sizes) in [
            (0, &[][..]),
            (0, &[0][..]),
            (0, &[g + 1][..]),
            (1, &[g][..]),
            (4 * g, &[g][..]),
            (0, &[5 * g][..]),
            (3 * g, &[g, g][..]),
            (0, &[usize::MAX - g + 1, g][..]),
        ] {
            // SAFETY: every call is rejected before anything is mapped (asserted).
            let got = unsafe { b.map(&r, offset, sizes) };
            assert!(
                matches!(got, Err(BackendError::Invalid { op: "map", .. })),
                "{offset} {sizes:?}"
            );
        }
        assert_eq!(b.used_bytes(), 0);
        // SAFETY: the last granule of the fresh reservation, mapped once.
        let m = unsafe { b.map(&r, 3 * g, &[g]) }.expect("map the last granule");
        assert_eq!(m[0].ptr(), r.base() + 3 * g as u64);
        // The mapping holds the reservation: dropping the owner's handle first is fine.
        drop(r);
        // SAFETY: the mapping is live and writable.
        unsafe { b.copy_to_device(m[0].ptr(), &[1, 2, 3]) }.expect("write");
        drop(m);
        assert_eq!(b.used_bytes(), 0);
    }

    /// A mapping at an address, recording whether it was told it is unmapped.
    #[derive(Debug)]
    struct At(u64, usize, Arc<std::sync::atomic::AtomicBool>);
    impl Mapping for At {
        fn ptr(&self) -> u64 {
            self.0
        }
        fn len(&self) -> usize {
            self.1
        }
        fn unmapped(&mut self) {
            self.2.store(true, std::sync::atomic::Ordering::SeqCst);
        }
    }

    #[test]
    fn runs_are_unmapped_whole_and_only_what_was_unmapped_is_told() {
        // 0..10 and 10..30 back to back, a gap, 40..45, a gap, 50..60 and 60..61.
        let spans = [(0, 10), (10, 20), (40, 5), (50, 10), (60, 1)];
        let told: Vec<Arc<std::sync::atomic::AtomicBool>> =
            spans.iter().map(|_| Arc::default()).collect();
        let mut maps: Vec<Box<dyn Mapping>> = spans
            .iter()
            .zip(&told)
            .map(|(&(at, len), t)| Box::new(At(at, len, t.clone())) as Box<dyn Mapping>)
            .collect();
        let mut calls = Vec::new();
        // The backend fails to unmap the run at 40.
        unmap_by_runs(&mut maps, |start, len| {
            calls.push((start, len));
            start != 40
        });
        assert_eq!(calls, vec![(0, 30), (40, 5), (50, 11)]);
        let told: Vec<bool> = told
            .iter()
            .map(|t| t.load(std::sync::atomic::Ordering::SeqCst))
            .collect();
        assert_eq!(told, vec![true, true, false, true, true]);
        unmap_by_runs(&mut [], |_, _| panic!("no run in no mappings"));
    }

    #[test]
    fn the_host_backend_unmaps_a_run_at_once_and_its_drops_only_release() {
        let b = HostBackend::new(HostConfig::default());
        let chunk = b.info().granularity;
        let r = b.reserve(8 * chunk).expect("reserve");
        // SAFETY: the reservation is this backend's and nothing is mapped in it.
        let mut maps = unsafe { b.map(&r, 0, &[chunk, 2 * chunk, chunk]) }.expect("map");
        // SAFETY: as above, at 6 chunks: a second run.
        maps.extend(unsafe { b.map(&r, 6 * chunk, &[chunk]) }.expect("map"));
        assert_eq!(b.used_bytes(), 5 * chunk);
        // SAFETY: the mappings are this backend's; nothing uses them.
        unsafe { b.unmap_runs(&mut maps) };
        // Unmapped, not yet released: the memory is given back when they drop.
        assert_eq!(b.used_bytes(), 5 * chunk);
        drop(maps);
        assert_eq!(b.used_bytes(), 0);
        // The range is reserved again: it maps anew.
        // SAFETY: nothing is mapped in the reservation any more.
        let again = unsafe { b.map(&r, 0, &[4 * chunk]) }.expect("map again");
        // SAFETY: mapped just now, unused.
        unsafe { b.copy_to_device(again[0].ptr(), &[7]) }.expect("write");
    }
}
