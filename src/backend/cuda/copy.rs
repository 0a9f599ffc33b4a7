//! The copy pump's primitives on CUDA: one unit of a host↔device copy by the copy engine
//! (`cuMemcpyHtoDAsync` / `cuMemcpyDtoHAsync`) or by the copy kernel (`gp_copy`, which
//! loads or stores the pinned host memory through its device address), on the backend's
//! stream for that mover and direction or on a caller's stream, with a fence after it.

use cudarc::driver::{CudaStream, sys};

use super::launch::Kernel;
use super::{CudaBackend, check, driver_err};
use crate::backend::{
    BackendError, BackendResult, Direction, Fence, Mover, RawCopy, RawStream, check_copy,
};
use crate::kernels::{self, abi};

impl CudaBackend {
    /// Enqueues the copy kernel over `bytes` bytes from `src` to `dst` on `stream`, without
    /// waiting. Either address may be device memory of this context or pinned host memory's
    /// device address ([`crate::backend::HostBuffer::device_ptr`]); any alignment and size.
    /// Overlapping or wrapping ranges are [`BackendError::Invalid`] and nothing is enqueued.
    /// Only enqueues work, so it may be captured into a CUDA graph (load the kernels first
    /// with [`CudaBackend::preload_kernels`]).
    ///
    /// # Safety
    /// Both ranges must be mapped (device memory of this context, or live pinned host
    /// memory) when the work runs, and nothing else may write them (or, `dst`, access it)
    /// concurrently.
    pub unsafe fn copy_kernel_on(
        &self,
        stream: &CudaStream,
        dst: u64,
        src: u64,
        bytes: usize,
    ) -> BackendResult<()> {
        self.check_stream("copy", stream)?;
        check_ranges("copy", dst, src, bytes)?;
        if bytes == 0 {
            return Ok(());
        }
        let _scope = self.dev.scope()?;
        // SAFETY: forwarded from the caller; the stream is a live stream of this context.
        unsafe { self.launch_copy(stream.cu_stream(), dst, src, bytes) }
    }

    /// Launches `gp_copy` on a raw stream. The caller holds a [`super::CtxScope`] and checked
    /// the ranges.
    ///
    /// # Safety
    /// As [`CudaBackend::copy_kernel_on`], and `stream` is a live stream of this context.
    pub(super) unsafe fn launch_copy(
        &self,
        stream: sys::CUstream,
        dst: u64,
        src: u64,
        bytes: usize,
    ) -> BackendResult<()> {
        let params = abi::GpCopyParams {
            dst,
            src,
            bytes: bytes as u64,
        };
        let geometry = kernels::copy_geometry(dst, src, bytes as u64, self.sms);
        // SAFETY: `gp_copy` takes one `GpCopyParams` by value, which `params` is; the caller
        // guarantees both ranges are mapped and the stream live.
        unsafe { self.launch(Kernel::Copy, geometry, &params, stream) }
    }

    /// The backend's own stream for `mover` and `direction`.
    fn copy_stream(&self, mover: Mover, direction: Direction) -> &CudaStream {
        match (mover, direction) {
            (Mover::CopyEngine, Direction::ToDevice) => &self.h2d,
            (Mover::CopyEngine, Direction::ToHost) => &self.d2h,
            (Mover::CopyKernel, Direction::ToDevice) => &self.h2d_kernel,
            (Mover::CopyKernel, Direction::ToHost) => &self.d2h_kernel,
        }
    }

    /// Enqueues `copy` (checked, non-empty) with `mover` on `stream`. The caller holds a
    /// [`super::CtxScope`].
    ///
    /// # Safety
    /// [`crate::backend::Backend::copy_unit`]'s contract, until `stream` has run the copy;
    /// `stream` is a live stream of this context.
    unsafe fn enqueue_copy(
        &self,
        copy: &RawCopy,
        mover: Mover,
        stream: sys::CUstream,
    ) -> BackendResult<()> {
        let bytes = copy.bytes;
        match (mover, copy.direction) {
            (Mover::CopyEngine, Direction::ToDevice) => {
                let src = copy.host as *const std::ffi::c_void;
                // SAFETY: the caller guarantees the device range is mapped and the pinned
                // host range live and unwritten until the stream has run the copy.
                check(unsafe { sys::cuMemcpyHtoDAsync_v2(copy.device, src, bytes, stream) })
                    .map_err(|e| driver_err("cuMemcpyHtoDAsync", e))
            }
            (Mover::CopyEngine, Direction::ToHost) => {
                let dst = copy.host as *mut std::ffi::c_void;
                // SAFETY: as above, the host range untouched by anyone else meanwhile.
                check(unsafe { sys::cuMemcpyDtoHAsync_v2(dst, copy.device, bytes, stream) })
                    .map_err(|e| driver_err("cuMemcpyDtoHAsync", e))
            }
            (Mover::CopyKernel, Direction::ToDevice) => {
                // SAFETY: as above; `host_device` is the host range's device address.
                unsafe { self.launch_copy(stream, copy.device, copy.host_device, bytes) }
            }
            (Mover::CopyKernel, Direction::ToHost) => {
                // SAFETY: as above.
                unsafe { self.launch_copy(stream, copy.host_device, copy.device, bytes) }
            }
        }
    }

    /// [`crate::backend::Backend::copy_unit`]: the copy on the backend's stream for `mover`
    /// and the copy's direction, and a fence recorded after it.
    ///
    /// # Safety
    /// As `copy_unit`.
    pub(super) unsafe fn copy_unit_impl(
        &self,
        copy: &RawCopy,
        mover: Mover,
    ) -> BackendResult<Box<dyn Fence>> {
        let nonempty = check_copy("copy_unit", copy)?;
        let _scope = self.dev.scope()?;
        // The event first: once the copy is enqueued, nothing may fail without waiting for it.
        let fence = self.new_fence()?;
        if !nonempty {
            // An unrecorded event has passed.
            return Ok(Box::new(fence));
        }
        let stream = self.copy_stream(mover, copy.direction);
        // SAFETY: forwarded from the caller; the stream is the backend's own, live.
        unsafe { self.enqueue_copy(copy, mover, stream.cu_stream()) }?;
        // SAFETY: the event and the stream are live objects of this context.
        let recorded = check(unsafe { sys::cuEventRecord(fence.event, stream.cu_stream()) });
        if let Err(e) = recorded {
            // The copy is in flight without a fence: wait for it here, so that nothing of a
            // failed call outlives it (the caller's host memory may go right after).
            if let Err(sync) = stream.synchronize() {
                self.dev.errors.record(format!(
                    "waiting for a copy whose fence could not be recorded (cuEventRecord's \
                     error was returned): cuStreamSynchronize failed: {}",
                    super::describe(sync)
                ));
            }
            return Err(driver_err("cuEventRecord", e));
        }
        Ok(Box::new(fence))
    }

    /// [`crate::backend::Backend::copy_on`]: the copy on the caller's stream.
    ///
    /// # Safety
    /// As `copy_on`.
    pub(super) unsafe fn copy_on_impl(
        &self,
        copy: &RawCopy,
        mover: Mover,
        stream: RawStream,
    ) -> BackendResult<()> {
        if !check_copy("copy_on", copy)? {
            return Ok(());
        }
        let _scope = self.dev.scope()?;
        // SAFETY: forwarded from the caller, who guarantees the stream is a live stream of
        // this context.
        unsafe { self.enqueue_copy(copy, mover, stream.0 as sys::CUstream) }
    }
}

/// Rejects a kernel copy whose ranges wrap the address space or overlap.
fn check_ranges(op: &'static str, dst: u64, src: u64, bytes: usize) -> BackendResult<()> {
    let n = bytes as u64;
    if dst.checked_add(n).is_none() || src.checked_add(n).is_none() {
        return Err(BackendError::Invalid {
            op,
            reason: format!("{bytes} bytes from {src:#x} to {dst:#x} wrap the address space"),
        });
    }
    if n > 0 && dst < src + n && src < dst + n {
        return Err(BackendError::Invalid {
            op,
            reason: format!("{bytes} bytes from {src:#x} to {dst:#x}: the ranges overlap"),
        });
    }
    Ok(())
}
