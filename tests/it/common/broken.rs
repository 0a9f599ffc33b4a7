//! A host backend that breaks the pager's contract on purpose, to show that checks notice.

use gpu_pager::backend::host::HostBackend;
use gpu_pager::backend::{
    Backend, BackendResult, Direction, Fence, HostBuffer, KvKernels, Mapping, Mover, RawCopy,
    RawStream, Reservation,
};
use gpu_pager_testkit::Hog;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flaw {
    /// Every restore copy (each unit of a pumped restore) lands with one byte flipped.
    FlipRestores,
    /// Every 5th map also takes memory that is never given back.
    LeakOnMap,
    /// Every 3rd KV write lands with one byte of its first written row flipped.
    FlipKvWrites,
}

#[derive(Debug)]
pub struct Broken {
    inner: HostBackend,
    flaw: Flaw,
    /// The flaw acts only while this is set (it is, from the start).
    pub active: AtomicBool,
    maps: AtomicU64,
    kv_writes: AtomicU64,
}

impl Broken {
    /// `inner` with `flaw`, active.
    pub fn new(inner: HostBackend, flaw: Flaw) -> Self {
        Broken {
            inner,
            flaw,
            active: AtomicBool::new(true),
            maps: AtomicU64::new(0),
            kv_writes: AtomicU64::new(0),
        }
    }

    fn has(&self, flaw: Flaw) -> bool {
        self.flaw == flaw && self.active.load(Ordering::SeqCst)
    }

    /// With [`Flaw::FlipRestores`], flips the middle byte of a restore just copied.
    ///
    /// # Safety
    /// `copy` was just copied: its device range is mapped memory of the inner backend.
    unsafe fn flip(&self, copy: &RawCopy) -> BackendResult<()> {
        if !self.has(Flaw::FlipRestores) || copy.direction != Direction::ToDevice || copy.bytes == 0
        {
            return Ok(());
        }
        let at = copy.device + copy.bytes as u64 / 2;
        let mut b = [0u8; 1];
        // SAFETY: `at` lies inside the device range the caller guarantees mapped.
        unsafe { self.inner.copy_to_host(&mut b, at) }?;
        b[0] ^= 0x10;
        // SAFETY: as above.
        unsafe { self.inner.copy_to_device(at, &b) }
    }
}

impl Backend for Broken {
    gpu_pager::forward_backend!(inner:
        info, deferred_errors, mem_info, processes, set_reclaim_scrubbed, reserve, unmap_runs,
        synchronize,
        alloc_pinned, alloc_pinned_many, alloc_pinned_many_from_device, copy_to_device,
        copy_to_host, fence, fill, chunk_hash);
    unsafe fn alloc_pinned_from_device(
        &self,
        bytes: usize,
        src: u64,
    ) -> BackendResult<Box<dyn HostBuffer>> {
        // SAFETY: the caller's contract, passed on; through this wrapper's own copies.
        unsafe { gpu_pager::backend::pin_then_copy(self, bytes, src) }
    }
    unsafe fn map(
        &self,
        reservation: &Arc<dyn Reservation>,
        offset: usize,
        sizes: &[usize],
    ) -> BackendResult<Vec<Box<dyn Mapping>>> {
        if self.has(Flaw::LeakOnMap)
            && self.maps.fetch_add(1, Ordering::SeqCst) % 5 == 4
            && let Ok(h) = Hog::take(&self.inner, self.inner.info().granularity)
        {
            std::mem::forget(h);
        }
        // SAFETY: forwarded from the caller.
        unsafe { self.inner.map(reservation, offset, sizes) }
    }
    unsafe fn copy_unit(&self, copy: &RawCopy, mover: Mover) -> BackendResult<Box<dyn Fence>> {
        // SAFETY: forwarded from the caller (the host backend copies at once).
        let fence = unsafe { self.inner.copy_unit(copy, mover) }?;
        // SAFETY: as above.
        unsafe { self.flip(copy) }?;
        Ok(fence)
    }
    unsafe fn copy_on(&self, copy: &RawCopy, mover: Mover, stream: RawStream) -> BackendResult<()> {
        // SAFETY: forwarded from the caller (the host backend copies at once).
        unsafe { self.inner.copy_on(copy, mover, stream) }?;
        // SAFETY: as above.
        unsafe { self.flip(copy) }
    }
    fn kv_kernels(&self) -> &dyn KvKernels {
        self
    }
}

/// The KV kernels are the host backend's, with [`Flaw::FlipKvWrites`] applied after them.
impl KvKernels for Broken {
    unsafe fn kv_on(
        &self,
        op: &gpu_pager::kv::KvOp<'_>,
        _stream: RawStream,
        _index: u64,
    ) -> BackendResult<()> {
        // SAFETY: forwarded from the caller (the host backend runs it synchronously).
        unsafe { self.kv(op) }
    }
    unsafe fn kv(&self, op: &gpu_pager::kv::KvOp<'_>) -> BackendResult<()> {
        // SAFETY: forwarded from the caller.
        unsafe { self.inner.kv_kernels().kv(op) }?;
        if let gpu_pager::kv::KvOp::Write {
            cache,
            layer,
            tokens,
            slot_mapping,
            ..
        } = *op
        {
            let first = slot_mapping[..tokens].iter().find(|&&s| s >= 0);
            if let Some(&slot) = first.filter(|_| {
                self.has(Flaw::FlipKvWrites)
                    && self.kv_writes.fetch_add(1, Ordering::SeqCst) % 3 == 2
            }) {
                let off = cache
                    .layout
                    .slot_offset(layer, gpu_pager::kv::Kv::K, slot as u64, 0)
                    .expect("a checked slot");
                let at = cache.base + off;
                let mut b = [0u8; 1];
                // SAFETY: the row was just written, so it is mapped memory of the cache.
                unsafe { self.inner.copy_to_host(&mut b, at) }?;
                b[0] ^= 0x10;
                // SAFETY: as above.
                unsafe { self.inner.copy_to_device(at, &b) }?;
            }
        }
        Ok(())
    }
}
