//! Device memory taken the way another program takes it (a stand-in for a trainer's
//! tensors), to put the pager under memory pressure in tests, benchmarks and the stress
//! harness.

use std::ffi::c_int;
use std::sync::Arc;

use cudarc::driver::{DriverError, result, sys};
use gpu_pager::backend::{
    Backend, BackendError, BackendKind, BackendResult, DeferredErrors, Mapping,
};

/// Memory held by someone other than the pager, from [`Hog::take`]; given back on drop.
#[derive(Debug)]
pub struct Hog {
    len: usize,
    memory: Memory,
}

#[derive(Debug)]
enum Memory {
    /// On the host backend (and for zero bytes): chunks mapped in a reservation of their
    /// own (each mapping holds it), which the backend counts against its capacity like any
    /// other mapping. Held, never read.
    Mapped { _mappings: Vec<Box<dyn Mapping>> },
    /// On CUDA: a plain `cuMemAlloc` allocation in the device's primary context (the
    /// pager's context), as a trainer's caching allocator makes.
    Cuda(DeviceAlloc),
}

impl Hog {
    /// Takes `bytes` of `backend`'s device memory (on the host backend, rounded up to its
    /// granularity). Fails with [`BackendError::OutOfMemory`] when that much is not free.
    pub fn take(backend: &dyn Backend, bytes: usize) -> BackendResult<Hog> {
        let info = backend.info();
        if bytes == 0 {
            let memory = Memory::Mapped {
                _mappings: Vec::new(),
            };
            return Ok(Hog { len: 0, memory });
        }
        if let (BackendKind::Cuda, Some(ordinal)) = (info.kind, info.ordinal) {
            let errors = backend.deferred_errors().clone();
            let memory = Memory::Cuda(DeviceAlloc::new(ordinal, bytes, errors)?);
            return Ok(Hog { len: bytes, memory });
        }
        let len = bytes.next_multiple_of(info.granularity);
        let reservation = backend.reserve(len)?;
        // SAFETY: the span is the whole fresh reservation, unmapped.
        let mappings = unsafe { backend.map(&reservation, 0, &[len]) }?;
        let memory = Memory::Mapped {
            _mappings: mappings,
        };
        Ok(Hog { len, memory })
    }

    /// Bytes held.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Device address of the held memory, to write it as a trainer would; `None` on the
    /// host backend, where the hog stands for capacity only and is never touched.
    pub fn ptr(&self) -> Option<u64> {
        match &self.memory {
            Memory::Cuda(a) => Some(a.ptr),
            Memory::Mapped { .. } => None,
        }
    }
}

/// A `cuMemAlloc` allocation; freed on drop, failures recorded in the backend's
/// [`DeferredErrors`] as the backend's own handles do.
#[derive(Debug)]
struct DeviceAlloc {
    ptr: sys::CUdeviceptr,
    device: sys::CUdevice,
    ctx: sys::CUcontext,
    errors: Arc<DeferredErrors>,
}

// SAFETY: the allocation and the retained primary context are usable from any thread; every
// use makes the context current on the using thread first.
unsafe impl Send for DeviceAlloc {}
// SAFETY: as above; `&DeviceAlloc` hands out only the address.
unsafe impl Sync for DeviceAlloc {}

impl DeviceAlloc {
    fn new(ordinal: usize, bytes: usize, errors: Arc<DeferredErrors>) -> BackendResult<Self> {
        let failed = |op: &'static str| {
            move |e: DriverError| match e.0 {
                sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => {
                    BackendError::OutOfMemory { requested: bytes }
                }
                _ => BackendError::Driver {
                    op,
                    message: e.to_string(),
                },
            }
        };
        let ordinal = c_int::try_from(ordinal).map_err(|_| BackendError::Invalid {
            op: "hog",
            reason: format!("device {ordinal} is out of range"),
        })?;
        let device = result::device::get(ordinal).map_err(failed("cuDeviceGet"))?;
        // SAFETY: `device` is a valid device; the retain is released once, on drop or below.
        let ctx = unsafe { result::primary_ctx::retain(device) }
            .map_err(failed("cuDevicePrimaryCtxRetain"))?;
        // SAFETY: a plain allocation in the current context, owned by the returned value.
        match in_context(ctx, || unsafe { result::malloc_sync(bytes) }) {
            Ok(ptr) => Ok(DeviceAlloc {
                ptr,
                device,
                ctx,
                errors,
            }),
            Err(e) => {
                // SAFETY: releases the retain taken above, once.
                if let Err(r) = unsafe { result::primary_ctx::release(device) } {
                    errors.record(format!("releasing a failed memory hog's context: {r}"));
                }
                Err(failed("cuMemAlloc")(e))
            }
        }
    }
}

impl Drop for DeviceAlloc {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from cuMemAlloc in this context and is freed only here.
        if let Err(e) = in_context(self.ctx, || unsafe { result::free_sync(self.ptr) }) {
            self.errors
                .record(format!("freeing a memory hog (cuMemFree): {e}"));
        }
        // SAFETY: releases the retain `new` took, once.
        if let Err(e) = unsafe { result::primary_ctx::release(self.device) } {
            self.errors
                .record(format!("releasing a memory hog's context: {e}"));
        }
    }
}

/// Runs `f` with `ctx` current, then gives the thread its context back.
fn in_context<T>(
    ctx: sys::CUcontext,
    f: impl FnOnce() -> Result<T, DriverError>,
) -> Result<T, DriverError> {
    let previous = result::ctx::get_current()?.unwrap_or(std::ptr::null_mut());
    // SAFETY: `ctx` is a retained primary context, live for the call.
    unsafe { result::ctx::set_current(ctx) }?;
    let out = f();
    // SAFETY: `previous` was current on this thread just before (or NULL, which unbinds).
    let back = unsafe { result::ctx::set_current(previous) };
    out.and_then(|v| back.map(|()| v))
}
