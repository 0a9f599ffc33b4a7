//! The CUDA backend: driver-API virtual memory management (VMM) on one GPU.
//!
//! Address ranges, physical chunks and mappings are RAII handles built directly on
//! `cudarc::driver::sys` (cudarc's safe layer has no VMM): a reservation frees its range on
//! drop, a chunk releases its physical memory on drop, and a mapping owns its chunk and holds
//! its reservation, so dropping it unmaps first, then releases, and the range is freed after
//! its last mapping. Every handle holds the context, which therefore outlives all memory it
//! created.
//!
//! The context, streams and module loading use cudarc's safe layer; every kernel launch
//! goes through `launch.rs` (the embedded modules and the one `cuLaunchKernel`). The
//! backend keeps five non-blocking streams: the copy engine's host→device and device→host
//! copies, the copy kernel's host→device and device→host copies (so that both movers of
//! the copy pump, in both directions, run side by side: see the copy pump (`src/pump.rs`)), and the other
//! kernels (fill, chunk hash, KV).
//!
//! **The caller's context is left alone.** Every entry point, and every `Drop` that calls
//! the driver, makes the context current for its duration only and then gives the calling
//! thread back the context it had (another device's, a non-primary one, or none): a
//! `CtxScope`, PyTorch's `CUDAGuard` pattern. cudarc's `bind_to_thread` would leave ours
//! current; its objects that bind in their own `Drop` (streams, modules, the context) are
//! dropped inside a scope too.
//!
//! Errors from `Drop` cannot be returned: they are recorded in the backend's
//! [`DeferredErrors`] (logged through `log`, kept for [`crate::Pager::take_deferred_errors`]),
//! never printed and never a panic. So are the errors cudarc defers from its own `Drop` impls
//! to its next `bind_to_thread`: each scope drains them first, so that they do not fail an
//! unrelated call.

use std::fmt;
use std::mem::ManuallyDrop;
#[cfg(feature = "testing")]
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaContext, CudaStream, DriverError, sys};

use super::reclaim::{Reclaimer, Schedule};
use super::{
    Backend, BackendError, BackendKind, BackendResult, DeferredErrors, DeviceInfo, DeviceProcess,
    DeviceRange, Fence, HostBuffer, KvKernels, Mapping, MemInfo, Mover, RawCopy, RawStream,
    Reservation, check_map,
};
use crate::kernels::{self, abi};

mod context;
mod copy;
mod handles;
mod kv;
mod launch;
mod nvml;
mod pinned;
use context::{CtxScope, Dev, InScope};
use handles::{CudaChunk, CudaFence, CudaMapping, CudaReservation};
pub use kv::RowsKernel;
use launch::Kernel;
pub use pinned::FIRST_BACKUP_PIECE_BYTES;
pub use pinned::{CudaPinned, HUGE_PAGE_BYTES, MIN_TOUCH_BYTES_PER_THREAD};

/// Formats a driver error as `"<error name>: <error string>"`.
fn describe(e: DriverError) -> String {
    let name = e
        .error_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|_| format!("CUresult {}", e.0 as u32));
    let text = e
        .error_string()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|_| "(no description)".to_owned());
    format!("{name}: {text}")
}

/// A [`BackendError::Driver`] for the failed call `op`.
fn driver_err(op: &'static str, e: DriverError) -> BackendError {
    BackendError::Driver {
        op,
        message: describe(e),
    }
}

/// Turns a raw `CUresult` into a `Result`.
fn check(r: sys::CUresult) -> Result<(), DriverError> {
    r.result()
}

/// Allocation properties of pinned device memory on `device`, as the backend creates its
/// chunks with.
fn device_alloc_prop(device: sys::CUdevice) -> sys::CUmemAllocationProp {
    sys::CUmemAllocationProp {
        type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes: sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE,
        location: sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: device,
        },
        win32HandleMetaData: std::ptr::null_mut(),
        allocFlags: sys::CUmemAllocationProp_st__bindgen_ty_1 {
            compressionType: 0,
            gpuDirectRDMACapable: 0,
            usage: 0,
            reserved: [0; 4],
        },
    }
}

/// The PCI bus id of `device` (`"0000:3b:00.0"`), `None` if the driver does not say.
fn pci_bus_id(device: sys::CUdevice) -> Option<String> {
    let mut buf = [0 as std::ffi::c_char; 32];
    // SAFETY: `buf` is writable for its length, which is passed; the driver writes a
    // NUL-terminated string of at most that many bytes.
    check(unsafe { sys::cuDeviceGetPCIBusId(buf.as_mut_ptr(), buf.len() as i32, device) }).ok()?;
    // SAFETY: NUL-terminated within `buf` (the driver's contract, and `buf` was zeroed).
    let id = unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) };
    id.to_str().ok().map(str::to_owned)
}

/// Queries the allocation granularity of pinned device memory on `device`.
fn query_granularity(
    device: sys::CUdevice,
    option: sys::CUmemAllocationGranularity_flags,
) -> Result<usize, DriverError> {
    let prop = device_alloc_prop(device);
    let mut granularity = 0usize;
    // SAFETY: both pointers are valid for the duration of the call; `prop` is fully
    // initialised.
    check(unsafe { sys::cuMemGetAllocationGranularity(&mut granularity, &prop, option) })?;
    Ok(granularity)
}

/// [`kernels::check_chunk_hash_args`] as a backend error (the host backend checks the same).
fn check_chunk_hash_args(src: u64, bytes: usize, chunk_bytes: usize) -> BackendResult<()> {
    kernels::check_chunk_hash_args(src, bytes, chunk_bytes).map_err(|reason| {
        BackendError::Invalid {
            op: "chunk_hash",
            reason,
        }
    })
}

/// Device memory from `cuMemAlloc` for the per-chunk hashes of [`Backend::chunk_hash`] and
/// the index lists of [`KvKernels::kv`].
struct DeviceScratch {
    ptr: sys::CUdeviceptr,
    bytes: usize,
    dev: Arc<Dev>,
}

impl Drop for DeviceScratch {
    fn drop(&mut self) {
        let scope = self.dev.scope_in_drop("scratch memory");
        // SAFETY: `ptr` came from cuMemAlloc and is freed exactly once, here; every use was
        // followed by a stream synchronisation before the lock guarding it was released.
        if let Err(e) = check(unsafe { sys::cuMemFree_v2(self.ptr) }) {
            self.dev.record(
                "cuMemFree",
                format_args!("{} bytes of scratch memory", self.bytes),
                e,
            );
        }
        drop(scope);
    }
}

/// The scratch memory of [`Backend::chunk_hash`]: device memory the kernels accumulate the
/// hashes in, and pinned host memory they are copied to.
#[derive(Default)]
struct HashScratch {
    dev: Option<DeviceScratch>,
    host: Option<CudaPinned>,
}

/// The CUDA backend on one device.
///
/// Thread-safe. Every entry point makes the context current for the call and gives the
/// calling thread its own context back on return (a context scope), so callers on threads bound
/// to another device (or to none) stay where they were. Failures in `Drop` (of the
/// backend's handles, or deferred by cudarc) are kept in [`Backend::deferred_errors`].
pub struct CudaBackend {
    dev: Arc<Dev>,
    device: sys::CUdevice,
    /// The copy engine's host→device stream.
    h2d: InScope<Arc<CudaStream>>,
    /// The copy engine's device→host stream.
    d2h: InScope<Arc<CudaStream>>,
    /// The copy kernel's host→device stream.
    h2d_kernel: InScope<Arc<CudaStream>>,
    /// The copy kernel's device→host stream.
    d2h_kernel: InScope<Arc<CudaStream>>,
    kernel_stream: InScope<Arc<CudaStream>>,
    info: DeviceInfo,
    /// The device's PCI bus id (`cuDeviceGetPCIBusId`), by which NVML finds it.
    pci_bus_id: Option<String>,
    /// Streaming multiprocessors, for the copy kernel's grid.
    sms: u32,
    loaded: InScope<launch::Loaded>,
    hash_scratch: Mutex<HashScratch>,
    /// Device copies of the index lists of [`KvKernels::kv`] calls.
    kv_scratch: Mutex<Option<DeviceScratch>>,
    /// Piece size of first backups ([`Backend::alloc_pinned_from_device`]), which tests
    /// shrink; [`FIRST_BACKUP_PIECE_BYTES`] in library builds.
    #[cfg(feature = "testing")]
    first_backup_piece: AtomicUsize,
}

impl fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaBackend")
            .field("ordinal", &self.dev.ctx.ordinal())
            .field("info", &self.info)
            .finish_non_exhaustive()
    }
}

impl CudaBackend {
    /// Opens device `ordinal`: retains its primary context, creates the streams and
    /// queries the device.
    ///
    /// Returns [`BackendError::Unavailable`] (never panics) when the driver library is not
    /// installed, when `cuInit` fails, when there is no such device or when the device does
    /// not support virtual memory management, and [`BackendError::UnsupportedDriver`] when
    /// the driver is older than [`super::DRIVER_FLOOR`].
    pub fn new(ordinal: usize) -> BackendResult<Self> {
        // SAFETY: only tries to open the driver library; no driver call is made.
        if !unsafe { sys::is_culib_present() } {
            return Err(BackendError::Unavailable(
                "the CUDA driver library (libcuda.so) is not installed (gpu-pager needs an \
                 NVIDIA driver for CUDA 12.0 or newer)"
                    .to_owned(),
            ));
        }
        // Before cuInit (which it does not need), so that a driver below the floor gets the
        // error that says so, not whatever a newer call would do on it.
        let mut version = 0;
        // SAFETY: one valid out-pointer; cuDriverGetVersion exists in every driver.
        check(unsafe { sys::cuDriverGetVersion(&mut version) }).map_err(|e| {
            if e.0 == sys::CUresult::CUDA_ERROR_STUB_LIBRARY {
                // A toolkit's link stub on the loader path (build containers, CPU-only CI):
                // there is no driver, as when the library is missing.
                BackendError::Unavailable(
                    "the CUDA driver library (libcuda.so) found is a CUDA toolkit's link stub, \
                     not an NVIDIA driver (take the stubs folder off LD_LIBRARY_PATH where a \
                     GPU should be used)"
                        .to_owned(),
                )
            } else {
                driver_err("cuDriverGetVersion", e)
            }
        })?;
        super::check_driver_version(version)?;
        cudarc::driver::result::init()
            .map_err(|e| BackendError::Unavailable(format!("cuInit failed: {}", describe(e))))?;
        let count = cudarc::driver::result::device::get_count().map_err(|e| {
            BackendError::Unavailable(format!("cuDeviceGetCount failed: {}", describe(e)))
        })?;
        let count = usize::try_from(count).unwrap_or(0);
        if ordinal >= count {
            return Err(BackendError::Unavailable(format!(
                "CUDA device {ordinal} requested, but {count} device(s) are visible"
            )));
        }
        let errors = Arc::new(DeferredErrors::new());
        // cudarc's `CudaContext::new` makes the context current and leaves it so: give the
        // caller's back on every way out of here (declared first, so dropped last).
        let restore = CtxScope::save(&errors)?;
        let ctx = CudaContext::new(ordinal).map_err(|e| {
            BackendError::Unavailable(format!(
                "cannot open a context on CUDA device {ordinal}: {}",
                describe(e)
            ))
        })?;
        let dev = Arc::new(Dev {
            ctx: ManuallyDrop::new(ctx),
            errors: errors.clone(),
            // Off until a pager sets it (`Tuning::reclaim_scrubbed`): a backend used alone
            // makes no calls of its own.
            reclaim: Reclaimer::new(Schedule::DEFAULT, false),
        });
        let ctx = &dev.ctx;
        let device = ctx.cu_device();
        let vmm = ctx
            .attribute(
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
            )
            .map_err(|e| driver_err("cuDeviceGetAttribute", e))?;
        if vmm == 0 {
            return Err(BackendError::Unavailable(format!(
                "CUDA device {ordinal} does not support virtual memory management"
            )));
        }
        let granularity = query_granularity(
            device,
            sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
        )
        .map_err(|e| driver_err("cuMemGetAllocationGranularity", e))?;
        if granularity == 0 {
            return Err(BackendError::Unavailable(format!(
                "CUDA device {ordinal} reports an allocation granularity of 0"
            )));
        }
        let name = ctx.name().map_err(|e| driver_err("cuDeviceGetName", e))?;
        let total_bytes = ctx
            .total_mem()
            .map_err(|e| driver_err("cuDeviceTotalMem", e))?;
        let compute_capability = ctx
            .compute_capability()
            .map_err(|e| driver_err("cuDeviceGetAttribute", e))?;
        let sms = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| driver_err("cuDeviceGetAttribute", e))?;
        let pci_bus_id = pci_bus_id(device);
        if pci_bus_id.is_some() {
            nvml::load_in_background();
        }
        let new_stream = || {
            ctx.new_stream()
                .map(|s| InScope::new(s, &dev))
                .map_err(|e| driver_err("cuStreamCreate", e))
        };
        let h2d = new_stream()?;
        let d2h = new_stream()?;
        let h2d_kernel = new_stream()?;
        let d2h_kernel = new_stream()?;
        let kernel_stream = new_stream()?;
        let backend = Self {
            device,
            h2d,
            d2h,
            h2d_kernel,
            d2h_kernel,
            kernel_stream,
            sms: u32::try_from(sms).unwrap_or(1).max(1),
            pci_bus_id,
            info: DeviceInfo {
                kind: BackendKind::Cuda,
                name,
                granularity,
                total_bytes,
                compute_capability: Some(compute_capability),
                ordinal: Some(ordinal),
            },
            loaded: InScope::new(launch::Loaded::default(), &dev),
            hash_scratch: Mutex::new(HashScratch::default()),
            kv_scratch: Mutex::new(None),
            #[cfg(feature = "testing")]
            first_backup_piece: AtomicUsize::new(FIRST_BACKUP_PIECE_BYTES),
            dev: dev.clone(),
        };
        // Every kernel module loaded now, once per device: a first wake-up or release then
        // spends nothing on loading (tens of milliseconds), and a GPU the kernels were not
        // built for fails here, with its name, rather than at the first release.
        backend.preload_kernels().map_err(|e| {
            BackendError::Unavailable(format!(
                "gpu-pager's kernels cannot be loaded on CUDA device {ordinal} ({}, compute \
                 capability {}.{}); they are built for compute capability 8.0 and newer: {e}",
                backend.info.name, compute_capability.0, compute_capability.1
            ))
        })?;
        drop(restore);
        Ok(backend)
    }

    /// The CUDA context (the device's primary context). Code that uses it through cudarc
    /// directly gets cudarc's behaviour: its calls make the context current and leave it so.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.dev.ctx
    }

    /// The stream [`Backend::fill`] and [`Backend::chunk_hash`] launch their kernels on.
    pub fn kernel_stream(&self) -> &Arc<CudaStream> {
        &self.kernel_stream
    }

    /// The device's streaming multiprocessors.
    pub fn sm_count(&self) -> u32 {
        self.sms
    }

    /// Fails unless `stream` belongs to this backend's context.
    fn check_stream(&self, op: &'static str, stream: &CudaStream) -> BackendResult<()> {
        if **stream.context() == **self.dev.ctx {
            Ok(())
        } else {
            Err(BackendError::Invalid {
                op,
                reason: "the stream belongs to another CUDA context".to_owned(),
            })
        }
    }

    /// Enqueues a fill of `bytes` at `dst` with the 32-bit `pattern` (see [`Backend::fill`])
    /// on `stream`, without waiting. Only enqueues work, so it may be captured into a CUDA
    /// graph (load the kernels first with [`CudaBackend::preload_kernels`]).
    ///
    /// # Safety
    /// `dst .. dst + bytes` must be mapped device memory of this context when the work runs,
    /// and nothing else may access it concurrently.
    pub unsafe fn fill_on(
        &self,
        stream: &CudaStream,
        dst: u64,
        bytes: usize,
        pattern: u32,
    ) -> BackendResult<()> {
        self.check_stream("fill", stream)?;
        if bytes == 0 {
            return Ok(());
        }
        let _scope = self.dev.scope()?;
        let params = abi::GpFillParams {
            dst,
            bytes: bytes as u64,
            pattern,
            _pad: 0,
        };
        let geometry = kernels::fill_geometry(dst, bytes as u64);
        // SAFETY: `gp_fill` takes one `GpFillParams`, which `params` is; the caller
        // guarantees the range it writes is mapped device memory; the stream is this
        // context's (checked above).
        unsafe { self.launch(Kernel::Fill, geometry, &params, stream.cu_stream()) }?;
        Ok(())
    }

    /// Enqueues the hashes of `bytes` at `src` in chunks of `chunk_bytes` (see
    /// [`Backend::chunk_hash`]) on `stream`, without waiting: `cuMemsetD8Async` zeroes the
    /// `chunk_count` u64 values at `out`, then the partial and the finalize kernels run.
    /// Only enqueues work, so it may be captured into a CUDA graph (load the kernels first
    /// with [`CudaBackend::preload_kernels`]).
    ///
    /// The arguments must pass [`kernels::check_chunk_hash_args`] (`src` 16-byte aligned,
    /// `bytes` > 0, `chunk_bytes` a non-zero multiple of 16, at most
    /// [`kernels::MAX_HASH_CHUNKS`] chunks) and `out` must be 8-byte aligned; otherwise
    /// [`BackendError::Invalid`] returns and nothing is enqueued.
    ///
    /// # Safety
    /// `src .. src + bytes` and `out .. out + 8 * chunk_count` must be mapped device memory
    /// of this context when the work runs; `out` must not overlap the source, and nothing
    /// else may write either range concurrently.
    pub unsafe fn chunk_hash_on(
        &self,
        stream: &CudaStream,
        src: u64,
        bytes: usize,
        chunk_bytes: usize,
        out: u64,
    ) -> BackendResult<()> {
        self.check_stream("chunk_hash", stream)?;
        check_chunk_hash_args(src, bytes, chunk_bytes)?;
        if !out.is_multiple_of(8) {
            return Err(BackendError::Invalid {
                op: "chunk_hash",
                reason: format!("output address {out:#x} is not 8-byte aligned"),
            });
        }
        let chunks = kernels::chunk_count(bytes, chunk_bytes);
        let geometry =
            kernels::chunk_hash_geometry(bytes as u64, chunk_bytes as u64, self.sm_count())
                .map_err(|reason| BackendError::Invalid {
                    op: "chunk_hash",
                    reason,
                })?;
        let _scope = self.dev.scope()?;
        let params = abi::GpChunkHashParams {
            src,
            bytes: bytes as u64,
            chunk_bytes: chunk_bytes as u64,
            out,
        };
        // Loaded before anything is enqueued, so that a failure leaves nothing in flight.
        self.function(Kernel::ChunkHashPartial)?;
        self.function(Kernel::ChunkHashFinalize)?;
        // SAFETY: the caller guarantees `out .. out + 8 * chunks` is mapped device memory;
        // the stream is a live stream of this context.
        check(unsafe { sys::cuMemsetD8Async(out, 0, chunks * 8, stream.cu_stream()) })
            .map_err(|e| driver_err("cuMemsetD8Async", e))?;
        let raw = stream.cu_stream();
        // SAFETY: `gp_chunk_hash_partial` takes one `GpChunkHashParams`, which `params` is;
        // the caller guarantees that the ranges it reads and writes are mapped device memory.
        unsafe { self.launch(Kernel::ChunkHashPartial, geometry, &params, raw) }?;
        let finalize = kernels::chunk_hash_finalize_geometry(chunks);
        // SAFETY: as for the partial kernel; it only touches `out .. out + 8 * chunks`.
        unsafe { self.launch(Kernel::ChunkHashFinalize, finalize, &params, raw) }?;
        Ok(())
    }

    /// Returns pinned host scratch memory of at least `bytes` in `slot`, growing it when
    /// needed. The caller holds the lock on `slot` while it uses the memory.
    fn host_scratch<'s>(
        &self,
        slot: &'s mut Option<CudaPinned>,
        bytes: usize,
    ) -> BackendResult<&'s CudaPinned> {
        if slot.as_ref().is_none_or(|s| s.len() < bytes) {
            // The smaller buffer's last use was synchronised.
            *slot = None;
            *slot = Some(self.pin(bytes.next_power_of_two().max(4096))?);
        }
        slot.as_ref().ok_or_else(|| BackendError::Internal {
            op: "chunk_hash",
            reason: "no host scratch".to_owned(),
        })
    }

    /// Returns the address of scratch device memory of at least `bytes` in `slot`, growing
    /// it when needed. The caller holds the lock on `slot` while it uses the memory.
    fn scratch(&self, slot: &mut Option<DeviceScratch>, bytes: usize) -> BackendResult<u64> {
        if let Some(s) = slot.as_ref().filter(|s| s.bytes >= bytes) {
            return Ok(s.ptr);
        }
        // Free the smaller buffer first (its last use was synchronised).
        *slot = None;
        let size = bytes.next_power_of_two().max(4096);
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: `ptr` is a valid out-pointer; the context is bound.
        match check(unsafe { sys::cuMemAlloc_v2(&mut ptr, size) }) {
            Ok(()) => {}
            Err(DriverError(sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY)) => {
                return Err(BackendError::OutOfMemory { requested: size });
            }
            Err(e) => return Err(driver_err("cuMemAlloc", e)),
        }
        *slot = Some(DeviceScratch {
            ptr,
            bytes: size,
            dev: self.dev.clone(),
        });
        Ok(ptr)
    }
}

impl CudaBackend {
    /// Test fixture: sets the piece size of later first backups
    /// ([`Backend::alloc_pinned_from_device`], default [`FIRST_BACKUP_PIECE_BYTES`]), and the
    /// part size of later batches of them ([`Backend::alloc_pinned_many_from_device`]), so
    /// that a small buffer has many pieces.
    #[cfg(feature = "testing")]
    pub fn set_first_backup_piece_bytes(&self, bytes: usize) {
        self.first_backup_piece.store(bytes, Ordering::Relaxed);
    }

    /// Test fixture: how many times the helper thread has collected the driver's scrubbed
    /// pages ([`Backend::set_reclaim_scrubbed`]).
    #[cfg(feature = "testing")]
    pub fn scrub_collections(&self) -> u64 {
        self.dev.reclaim.runs()
    }

    /// The piece size of first backups.
    fn first_backup_piece(&self) -> usize {
        #[cfg(feature = "testing")]
        return self.first_backup_piece.load(Ordering::Relaxed);
        #[cfg(not(feature = "testing"))]
        FIRST_BACKUP_PIECE_BYTES
    }

    /// A fresh event (timing disabled) as an unrecorded fence, which has passed until it is
    /// recorded. The caller holds a [`CtxScope`].
    fn new_fence(&self) -> BackendResult<CudaFence> {
        let mut event: sys::CUevent = std::ptr::null_mut();
        let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
        // SAFETY: `event` is a valid out-pointer.
        check(unsafe { sys::cuEventCreate(&mut event, flags) })
            .map_err(|e| driver_err("cuEventCreate", e))?;
        Ok(CudaFence {
            event,
            dev: self.dev.clone(),
        })
    }
}

impl Backend for CudaBackend {
    fn info(&self) -> &DeviceInfo {
        &self.info
    }

    fn deferred_errors(&self) -> &Arc<DeferredErrors> {
        &self.dev.errors
    }

    fn mem_info(&self) -> BackendResult<MemInfo> {
        let _scope = self.dev.scope()?;
        let (free, total) =
            cudarc::driver::result::mem_get_info().map_err(|e| driver_err("cuMemGetInfo", e))?;
        Ok(MemInfo { free, total })
    }

    fn processes(&self) -> Option<Vec<DeviceProcess>> {
        nvml::processes(self.pci_bus_id.as_deref()?)
    }

    fn set_reclaim_scrubbed(&self, on: bool) {
        self.dev.reclaim.set_enabled(on);
    }

    fn reserve(&self, bytes: usize) -> BackendResult<Arc<dyn Reservation>> {
        let g = self.info.granularity;
        if bytes == 0 || !bytes.is_multiple_of(g) {
            return Err(BackendError::Invalid {
                op: "reserve",
                reason: format!("{bytes} bytes is not a non-zero multiple of the granularity {g}"),
            });
        }
        let _scope = self.dev.scope()?;
        let mut base: sys::CUdeviceptr = 0;
        // SAFETY: `base` is a valid out-pointer; alignment 0 and address hint 0 let the
        // driver choose (aligned to the granularity).
        check(unsafe { sys::cuMemAddressReserve(&mut base, bytes, 0, 0, 0) })
            .map_err(|e| driver_err("cuMemAddressReserve", e))?;
        Ok(Arc::new(CudaReservation {
            base,
            len: bytes,
            dev: self.dev.clone(),
        }))
    }

    unsafe fn map(
        &self,
        reservation: &Arc<dyn Reservation>,
        offset: usize,
        chunk_sizes: &[usize],
    ) -> BackendResult<Vec<Box<dyn Mapping>>> {
        let (at, total) = check_map(
            reservation.as_ref(),
            offset,
            chunk_sizes,
            self.info.granularity,
        )?;
        let _scope = self.dev.scope()?;
        let oom_or = |op: &'static str, e: DriverError| match e.0 {
            sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => {
                BackendError::OutOfMemory { requested: total }
            }
            _ => driver_err(op, e),
        };
        let prop = device_alloc_prop(self.device);
        // On any early return below, `mappings` drops: every mapping made so far is unmapped
        // and its chunk released, which makes the call all-or-nothing.
        let mut mappings: Vec<CudaMapping> = Vec::with_capacity(chunk_sizes.len());
        let mut ptr = at;
        for &size in chunk_sizes {
            let mut handle: sys::CUmemGenericAllocationHandle = 0;
            // SAFETY: `handle` is a valid out-pointer and `prop` fully initialised.
            check(unsafe { sys::cuMemCreate(&mut handle, size, &prop, 0) })
                .map_err(|e| oom_or("cuMemCreate", e))?;
            let chunk = CudaChunk {
                handle,
                len: size,
                dev: self.dev.clone(),
            };
            // SAFETY: `ptr .. ptr + size` lies inside `reservation` (checked), which is this
            // backend's and unmapped there (the caller's contract); `size` is the whole chunk,
            // so offset 0 is in range.
            check(unsafe { sys::cuMemMap(ptr, size, 0, chunk.handle, 0) })
                .map_err(|e| oom_or("cuMemMap", e))?;
            mappings.push(CudaMapping {
                ptr,
                len: size,
                unmapped: false,
                chunk,
                _reservation: reservation.clone(),
            });
            ptr += size as u64;
        }
        let access = sys::CUmemAccessDesc {
            location: sys::CUmemLocation {
                type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                id: self.device,
            },
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        // One call over the whole span: far cheaper than one per chunk.
        // SAFETY: `at .. at + total` is fully mapped by the loop above; `access` is one valid
        // descriptor.
        check(unsafe { sys::cuMemSetAccess(at, total, &access, 1) })
            .map_err(|e| oom_or("cuMemSetAccess", e))?;
        Ok(mappings
            .into_iter()
            .map(|m| Box::new(m) as Box<dyn Mapping>)
            .collect())
    }

    /// One `cuMemUnmap` per run (the driver takes a range covering several mappings laid
    /// back to back, as long as it cuts none), under one context scope.
    unsafe fn unmap_runs(&self, maps: &mut [Box<dyn Mapping>]) {
        let Some(_scope) = self.dev.scope_in_drop("mappings") else {
            return; // each mapping unmaps itself when dropped
        };
        crate::backend::unmap_by_runs(maps, |start, len| {
            // SAFETY: `start .. start + len` is covered exactly by mappings of this backend
            // (the caller's contract) laid back to back, so the range cuts no mapping; the
            // caller waited for the device.
            check(unsafe { sys::cuMemUnmap(start, len) }).is_ok()
        });
    }

    fn synchronize(&self) -> BackendResult<()> {
        let _scope = self.dev.scope()?;
        // SAFETY: the context is current on this thread.
        check(unsafe { sys::cuCtxSynchronize() }).map_err(|e| driver_err("cuCtxSynchronize", e))
    }

    fn alloc_pinned(&self, bytes: usize) -> BackendResult<Box<dyn HostBuffer>> {
        Ok(Box::new(self.pin(bytes)?))
    }

    /// One mapping touched once, one registration per buffer ([`CudaBackend::pin_many`]).
    fn alloc_pinned_many(&self, sizes: &[usize]) -> BackendResult<Vec<Box<dyn HostBuffer>>> {
        let pinned = self.pin_many(sizes)?;
        Ok(pinned
            .into_iter()
            .map(|p| Box::new(p) as Box<dyn HostBuffer>)
            .collect())
    }

    unsafe fn copy_to_device(&self, dst: u64, src: &[u8]) -> BackendResult<()> {
        if src.is_empty() {
            return Ok(());
        }
        let _scope = self.dev.scope()?;
        // SAFETY: the caller guarantees `dst .. dst + src.len()` is mapped; `src` outlives the
        // wait below, which ends the copy before this returns.
        check(unsafe {
            sys::cuMemcpyHtoDAsync_v2(dst, src.as_ptr().cast(), src.len(), self.h2d.cu_stream())
        })
        .map_err(|e| driver_err("cuMemcpyHtoDAsync", e))?;
        self.h2d
            .synchronize()
            .map_err(|e| driver_err("cuStreamSynchronize", e))
    }

    unsafe fn copy_to_host(&self, dst: &mut [u8], src: u64) -> BackendResult<()> {
        if dst.is_empty() {
            return Ok(());
        }
        let _scope = self.dev.scope()?;
        // SAFETY: the caller guarantees `src .. src + dst.len()` is mapped; `dst` outlives the
        // wait below, which ends the copy before this returns.
        check(unsafe {
            sys::cuMemcpyDtoHAsync_v2(
                dst.as_mut_ptr().cast(),
                src,
                dst.len(),
                self.d2h.cu_stream(),
            )
        })
        .map_err(|e| driver_err("cuMemcpyDtoHAsync", e))?;
        self.d2h
            .synchronize()
            .map_err(|e| driver_err("cuStreamSynchronize", e))
    }

    unsafe fn alloc_pinned_from_device(
        &self,
        bytes: usize,
        src: u64,
    ) -> BackendResult<Box<dyn HostBuffer>> {
        let piece = self.first_backup_piece();
        // SAFETY: forwarded from the caller (mapped device memory of this context, not
        // written until this returns).
        Ok(Box::new(unsafe {
            self.pin_from_device(bytes, piece, src)
        }?))
    }

    /// The batch pinned and filled in one pipeline ([`CudaBackend::pin_many_from_device`]),
    /// in parts of the first backups' piece size ([`FIRST_BACKUP_PIECE_BYTES`]).
    unsafe fn alloc_pinned_many_from_device(
        &self,
        ranges: &[DeviceRange],
    ) -> BackendResult<Vec<Box<dyn HostBuffer>>> {
        let part = self.first_backup_piece();
        // SAFETY: forwarded from the caller (every range mapped device memory of this
        // context, not written until this returns).
        let pinned = unsafe { self.pin_many_from_device(ranges, part) }?;
        Ok(pinned
            .into_iter()
            .map(|p| Box::new(p) as Box<dyn HostBuffer>)
            .collect())
    }

    unsafe fn copy_unit(&self, copy: &RawCopy, mover: Mover) -> BackendResult<Box<dyn Fence>> {
        // SAFETY: forwarded from the caller.
        unsafe { self.copy_unit_impl(copy, mover) }
    }

    unsafe fn copy_on(&self, copy: &RawCopy, mover: Mover, stream: RawStream) -> BackendResult<()> {
        // SAFETY: forwarded from the caller.
        unsafe { self.copy_on_impl(copy, mover, stream) }
    }

    fn fence(&self, stream: RawStream) -> BackendResult<Box<dyn Fence>> {
        let _scope = self.dev.scope()?;
        let fence = self.new_fence()?;
        // SAFETY: the event was just created in this context; the caller guarantees `stream`
        // is a live stream of this context.
        check(unsafe { sys::cuEventRecord(fence.event, stream.0 as sys::CUstream) })
            .map_err(|e| driver_err("cuEventRecord", e))?;
        Ok(Box::new(fence))
    }

    unsafe fn fill(&self, dst: u64, bytes: usize, pattern: u32) -> BackendResult<()> {
        if bytes == 0 {
            return Ok(());
        }
        let _scope = self.dev.scope()?;
        // SAFETY: forwarded from the caller.
        unsafe { self.fill_on(&self.kernel_stream, dst, bytes, pattern) }?;
        self.kernel_stream
            .synchronize()
            .map_err(|e| driver_err("cuStreamSynchronize", e))
    }

    unsafe fn chunk_hash(
        &self,
        src: u64,
        bytes: usize,
        chunk_bytes: usize,
    ) -> BackendResult<Vec<u64>> {
        check_chunk_hash_args(src, bytes, chunk_bytes)?;
        let chunks = kernels::chunk_count(bytes, chunk_bytes);
        let out_bytes = chunks * 8;
        let _scope = self.dev.scope()?;
        // The scratch memory is shared: hold the lock until the results are on the host.
        let mut slot = self
            .hash_scratch
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let out = self.scratch(&mut slot.dev, out_bytes)?;
        let host = self.host_scratch(&mut slot.host, out_bytes)?;
        // Loaded before anything is enqueued: a failure after the kernels were enqueued
        // must first wait for them (they write the scratch).
        self.function(Kernel::Copy)?;
        // SAFETY: the source range is forwarded from the caller; `out` is scratch memory of
        // at least `out_bytes`, used by nobody else while the lock is held.
        let hashed =
            unsafe { self.chunk_hash_on(&self.kernel_stream, src, bytes, chunk_bytes, out) };
        // The results reach the host through the copy kernel (a zero-copy store into pinned
        // memory), not the copy engine: a copy-engine read-back waits behind the backup
        // copies a release has queued, once per buffer of a growing region.
        // SAFETY: `out` holds `out_bytes` of results once the kernels above ran (the copy is
        // ordered after them on the same stream); `host` is this backend's pinned memory of
        // at least `out_bytes`, read below only after the synchronisation; the lock keeps
        // both to this call.
        let copied = hashed.and_then(|()| unsafe {
            self.launch_copy(
                self.kernel_stream.cu_stream(),
                host.device_ptr(),
                out,
                out_bytes,
            )
        });
        // Waited for also on failure: whatever was enqueued writes the scratch, which the
        // next call may free.
        let synced = self
            .kernel_stream
            .synchronize()
            .map_err(|e| driver_err("cuStreamSynchronize", e));
        copied?;
        synced?;
        let results = host
            .as_slice()
            .get(..out_bytes)
            .ok_or_else(|| BackendError::Internal {
                op: "chunk_hash",
                reason: format!("host scratch shorter than {out_bytes} bytes"),
            })?;
        Ok(results
            .chunks_exact(8)
            .map(|c| {
                let mut word = [0u8; 8];
                word.copy_from_slice(c);
                u64::from_ne_bytes(word)
            })
            .collect())
    }

    fn kv_kernels(&self) -> &dyn KvKernels {
        self
    }
}
