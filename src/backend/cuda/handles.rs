//! The driver handles a CUDA backend hands out: reserved address ranges, physical chunks,
//! mappings and fences, each released by its `Drop`.

use super::*;

/// A reserved virtual address range (`cuMemAddressReserve`); dropping it frees the range.
pub(super) struct CudaReservation {
    pub(super) base: sys::CUdeviceptr,
    pub(super) len: usize,
    pub(super) dev: Arc<Dev>,
}

impl fmt::Debug for CudaReservation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaReservation")
            .field("base", &format_args!("{:#x}", self.base))
            .field("len", &self.len)
            .finish()
    }
}

impl Reservation for CudaReservation {
    fn base(&self) -> u64 {
        self.base
    }

    fn len(&self) -> usize {
        self.len
    }
}

impl Drop for CudaReservation {
    fn drop(&mut self) {
        let scope = self.dev.scope_in_drop("an address reservation");
        // SAFETY: the range came from cuMemAddressReserve with exactly this base and size and
        // is freed once, here; every mapping inside it holds this reservation, so all of
        // them have been unmapped.
        if let Err(e) = check(unsafe { sys::cuMemAddressFree(self.base, self.len) }) {
            self.dev.record(
                "cuMemAddressFree",
                format_args!("{} bytes at {:#x}", self.len, self.base),
                e,
            );
        }
        drop(scope);
    }
}

/// Physical device memory from `cuMemCreate`; dropping it releases the handle (the memory
/// returns to the device once it is also unmapped).
pub(super) struct CudaChunk {
    pub(super) handle: sys::CUmemGenericAllocationHandle,
    pub(super) len: usize,
    pub(super) dev: Arc<Dev>,
}

impl fmt::Debug for CudaChunk {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaChunk")
            .field("handle", &format_args!("{:#x}", self.handle))
            .field("len", &self.len)
            .finish()
    }
}

impl Drop for CudaChunk {
    fn drop(&mut self) {
        let scope = self.dev.scope_in_drop("a physical chunk");
        // SAFETY: the handle came from cuMemCreate and is released once, here.
        match check(unsafe { sys::cuMemRelease(self.handle) }) {
            Ok(()) => self.dev.freed(self.len),
            Err(e) => self
                .dev
                .record("cuMemRelease", format_args!("a {}-byte chunk", self.len), e),
        }
        drop(scope);
    }
}

/// A [`CudaChunk`] mapped at a fixed address inside a reservation it holds. Dropping it
/// unmaps the range, then releases the chunk and its hold on the reservation (the range is
/// freed with the last hold).
pub(super) struct CudaMapping {
    pub(super) ptr: sys::CUdeviceptr,
    pub(super) len: usize,
    /// Unmapped already by [`crate::backend::Backend::unmap_runs`], with its neighbours.
    pub(super) unmapped: bool,
    // Both dropped after `Drop::drop` has unmapped the range.
    pub(super) chunk: CudaChunk,
    pub(super) _reservation: Arc<dyn Reservation>,
}

impl fmt::Debug for CudaMapping {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaMapping")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .field("chunk", &self.chunk)
            .finish()
    }
}

impl Mapping for CudaMapping {
    fn ptr(&self) -> u64 {
        self.ptr
    }

    fn len(&self) -> usize {
        self.len
    }

    fn unmapped(&mut self) {
        self.unmapped = true;
    }
}

impl Drop for CudaMapping {
    fn drop(&mut self) {
        if self.unmapped {
            return; // the chunk, dropped next, releases the memory
        }
        let dev = &self.chunk.dev;
        let scope = dev.scope_in_drop("a mapping");
        // SAFETY: exactly this range was mapped by cuMemMap and is unmapped once, here. The
        // owner synchronised the device before dropping, so no work still touches it.
        if let Err(e) = check(unsafe { sys::cuMemUnmap(self.ptr, self.len) }) {
            dev.record(
                "cuMemUnmap",
                format_args!("{} bytes at {:#x}", self.len, self.ptr),
                e,
            );
        }
        drop(scope);
    }
}

/// A CUDA event recorded on a caller's stream ([`Backend::fence`]); destroyed on drop.
#[derive(Debug)]
pub(super) struct CudaFence {
    pub(super) event: sys::CUevent,
    pub(super) dev: Arc<Dev>,
}

// SAFETY: a CUevent handle may be used from any thread while its context is current (every
// use enters a context scope first).
unsafe impl Send for CudaFence {}
// SAFETY: as above; cuEventSynchronize may be called concurrently.
unsafe impl Sync for CudaFence {}

impl Fence for CudaFence {
    fn wait(&self) -> BackendResult<()> {
        let _scope = self.dev.scope()?;
        // SAFETY: the event is live until drop.
        check(unsafe { sys::cuEventSynchronize(self.event) })
            .map_err(|e| driver_err("cuEventSynchronize", e))
    }

    fn is_done(&self) -> BackendResult<bool> {
        let _scope = self.dev.scope()?;
        // SAFETY: the event is live until drop.
        match unsafe { sys::cuEventQuery(self.event) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            e => Err(driver_err("cuEventQuery", DriverError(e))),
        }
    }
}

impl Drop for CudaFence {
    fn drop(&mut self) {
        let scope = self.dev.scope_in_drop("a fence");
        // SAFETY: the event was created by `fence` and is destroyed only here.
        if let Err(e) = check(unsafe { sys::cuEventDestroy_v2(self.event) }) {
            self.dev
                .record("cuEventDestroy", format_args!("a fence's event"), e);
        }
        drop(scope);
    }
}
