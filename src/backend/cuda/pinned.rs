//! Pinned host memory by registration: anonymous memory, first touched on every core, then
//! page-locked with `cuMemHostRegister`.
//!
//! `cuMemHostAlloc` faults, zeroes and locks its pages on one thread inside the driver, which
//! puts seconds on the first release of a large region without `prepin`. Registering memory
//! the process has already touched is the cheaper half, and touching parallelises. So
//! [`CudaBackend::pin`]:
//!
//! 1. maps anonymous private memory (`mmap`), aligned to [`HUGE_PAGE_BYTES`], and asks for
//!    transparent huge pages (`madvise(MADV_HUGEPAGE)`; refused or not, it goes on) and for
//!    the mapping to stay out of forked children (`MADV_DONTFORK`: a child of a process with
//!    pinned pages would otherwise get copies of all of them at fork);
//! 2. first-touches it with a write per page (faster than `MADV_POPULATE_WRITE`) on up to
//!    `available_parallelism` threads, at least [`MIN_TOUCH_BYTES_PER_THREAD`] each, so that
//!    a small buffer is touched on the calling thread without spawning;
//! 3. registers it with `CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP`, one
//!    registration (pieces cost a fixed price each that only a pipeline hides, below);
//! 4. takes the device address kernels use (zero-copy) from `cuMemHostGetDevicePointer`.
//!
//! The contents are initialised: anonymous memory reads as zeros from the moment it is
//! mapped (the kernel zero-fills every page it backs it with), and the touch backs every page.
//!
//! Dropping a [`CudaPinned`] unregisters each registration, then unmaps the memory; failures
//! go to the backend's [`DeferredErrors`].
//!
//! **Batches** ([`CudaBackend::pin_many`], [`CudaBackend::pin_many_from_device`]: a growing
//! region's backups) share one mapping, touched once, with one registration per buffer;
//! see `batch.rs`.
//!
//! **Pieces.** The driver does not document a copy whose host range spans two registrations
//! as valid, so [`CudaBackend::pin`] registers one piece. [`CudaBackend::pin_from_device`]
//! (a region's first backup) registers in pieces so that touching, registering and copying
//! overlap; such a buffer reports its piece size in [`HostBuffer::piece_bytes`], and the
//! copy pump (`src/pump.rs`) cuts every later copy at those ends.

use std::ffi::c_void;
use std::fmt;
use std::num::NonZeroUsize;
use std::ops::Range;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use cudarc::driver::sys;

use super::{CudaBackend, Dev, check, driver_err};
use crate::backend::host::page_size;
use crate::backend::{BackendError, BackendResult, DeferredErrors, HostBuffer};

mod batch;

/// The size of a transparent huge page on x86-64 (and of the pages an arm64 kernel with
/// 4 KiB base pages uses): the alignment of the memory [`CudaBackend::pin`] maps, and the
/// unit touching threads and registration pieces are cut in.
pub const HUGE_PAGE_BYTES: usize = 2 << 20;

/// The fewest bytes one touching thread is given: a buffer of less than twice this is
/// touched on the calling thread. Spawning a thread costs tens of µs, touching 8 MiB about a
/// millisecond, so a helper pays for itself many times.
pub const MIN_TOUCH_BYTES_PER_THREAD: usize = 8 << 20;

/// Piece size of the pager's first backups ([`crate::backend::Backend::alloc_pinned_from_device`]
/// through [`CudaBackend::pin_from_device`]): 2 GiB. Every piece's registration pays a fixed
/// cost that the overlap does not hide, so pieces are large; the first piece's touch and the
/// last piece's copy, which nothing overlaps, stay short next to a whole weights backup.
pub const FIRST_BACKUP_PIECE_BYTES: usize = 2 << 30;

/// Anonymous private memory from `mmap`, `len` bytes at `ptr` (aligned as asked) inside a
/// mapping of `mapped` bytes at `raw`; unmapped on drop. Or a slice of such memory
/// ([`AnonMemory::split`]): `len` bytes at `ptr` inside the memory `of`, which is unmapped
/// when its last slice drops; a slice dropped before then gives its pages back.
struct AnonMemory {
    raw: NonNull<u8>,
    mapped: usize,
    ptr: NonNull<u8>,
    len: usize,
    errors: Arc<DeferredErrors>,
    /// For a slice: the memory it is part of. `None`: this value owns the mapping.
    of: Option<Arc<AnonMemory>>,
    /// For a slice: give its pages back when it drops (cleared by an owner that could not
    /// unregister them).
    discard_on_drop: bool,
}

// SAFETY: the bytes `ptr .. ptr + len` are this value's alone (the slices of one mapping are
// disjoint, and memory that was split is only reachable through `&` in the slices' `Arc`);
// the mapping is unmapped once, by the value that owns it; `&AnonMemory` hands out nothing
// mutable.
unsafe impl Send for AnonMemory {}
// SAFETY: as above.
unsafe impl Sync for AnonMemory {}

impl AnonMemory {
    /// Maps `bytes` (> 0) rounded up to the page size, or, from one huge page up, to
    /// [`HUGE_PAGE_BYTES`] and aligned to it (mapping one huge page more and using the
    /// aligned part), with transparent huge pages asked for.
    fn map(bytes: usize, errors: Arc<DeferredErrors>) -> BackendResult<AnonMemory> {
        let page = page_size();
        let huge = bytes >= HUGE_PAGE_BYTES;
        let align = if huge {
            HUGE_PAGE_BYTES.max(page)
        } else {
            page
        };
        let too_large = || BackendError::Invalid {
            op: "alloc_pinned",
            reason: format!("{bytes} bytes of pinned memory cannot be mapped"),
        };
        let len = bytes
            .checked_next_multiple_of(align)
            .ok_or_else(too_large)?;
        let mapped = len.checked_add(align - page).ok_or_else(too_large)?;
        // SAFETY: a new private anonymous mapping at an address the kernel picks; nothing
        // else is affected.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                mapped,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(BackendError::Os {
                op: "mmap",
                error: std::io::Error::last_os_error(),
            });
        }
        let raw = NonNull::new(p.cast::<u8>()).ok_or_else(|| BackendError::Os {
            op: "mmap",
            error: std::io::Error::other("returned a null pointer"),
        })?;
        let skip = (p as usize).next_multiple_of(align) - p as usize;
        // `skip < align` and `mapped = len + align - page`, with `p` page-aligned: the
        // aligned `len` bytes lie inside the mapping.
        let ptr = NonNull::new(raw.as_ptr().wrapping_add(skip)).unwrap_or(raw);
        let mem = AnonMemory {
            raw,
            mapped,
            ptr,
            len,
            errors,
            of: None,
            discard_on_drop: false,
        };
        if huge {
            mem.advise(libc::MADV_HUGEPAGE);
        }
        mem.advise(libc::MADV_DONTFORK);
        Ok(mem)
    }

    /// `madvise(advice)` over the usable bytes; a refusal changes nothing that matters.
    fn advise(&self, advice: libc::c_int) {
        // SAFETY: the range is inside this live mapping; advice only changes how the kernel
        // backs it, never its contents (HUGEPAGE, DONTFORK).
        let _ = unsafe { libc::madvise(self.ptr.as_ptr().cast(), self.len, advice) };
    }

    /// Cuts the usable bytes into `slices` (offsets into them, in order and disjoint), each
    /// an [`AnonMemory`] of its own that gives its pages back when dropped while others live;
    /// the last slice to drop unmaps the memory. `Invalid` (the memory unmapped) when the
    /// slices are out of order, overlap or reach past the usable bytes.
    fn split(self, slices: &[Range<usize>]) -> BackendResult<Vec<AnonMemory>> {
        let mut end = 0;
        for r in slices {
            if r.start < end || r.start > r.end || r.end > self.len {
                return Err(BackendError::Invalid {
                    op: "alloc_pinned_many",
                    reason: format!("slice {r:?} of {} bytes, after {end}", self.len),
                });
            }
            end = r.end;
        }
        let whole = Arc::new(self);
        Ok(slices
            .iter()
            .map(|r| AnonMemory {
                raw: whole.raw,
                mapped: whole.mapped,
                // Inside the usable bytes (checked above).
                ptr: NonNull::new(whole.ptr.as_ptr().wrapping_add(r.start)).unwrap_or(whole.ptr),
                len: r.len(),
                errors: whole.errors.clone(),
                of: Some(whole.clone()),
                discard_on_drop: true,
            })
            .collect())
    }

    /// Gives the physical pages of usable bytes `range` back (`madvise(MADV_DONTNEED)`):
    /// they read as zeros from then on, backed again when next touched. The range stays
    /// mapped (no hole for a later `mmap`).
    ///
    /// # Safety
    /// Nobody uses bytes `range` (no reference, no registration, no copy in flight).
    unsafe fn discard(&self, range: Range<usize>) -> std::io::Result<()> {
        if range.is_empty() {
            return Ok(());
        }
        if range.end > self.len {
            return Err(std::io::Error::other(format!(
                "{range:?} lies outside the {} usable bytes",
                self.len
            )));
        }
        let at = self.ptr.as_ptr().wrapping_add(range.start);
        // SAFETY: `at .. at + range.len()` lies inside this live mapping (checked above) and
        // is used by nobody (the caller's contract), so dropping its contents harms no one.
        let rc = unsafe { libc::madvise(at.cast(), range.len(), libc::MADV_DONTNEED) };
        if rc != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }

    /// The usable bytes.
    fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: `ptr .. ptr + len` lies inside the live private anonymous mapping, which
        // reads as zeros until written (initialised) and is reachable only through `self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AnonMemory {
    fn drop(&mut self) {
        if let Some(whole) = &self.of {
            // A slice: the memory it is part of is unmapped when its last slice drops (after
            // this). Until then, give this slice's pages back.
            if self.discard_on_drop && Arc::strong_count(whole) > 1 {
                // SAFETY: the slice's bytes are used by nobody: no reference into them
                // outlives `self`, and its owner unregistered them and waited for every
                // copy using them (or cleared `discard_on_drop`).
                if let Err(e) = unsafe { self.discard(0..self.len) } {
                    self.errors.record(format!(
                        "madvise(MADV_DONTNEED) of {} bytes of pinned host memory failed (they \
                         stay until the rest of their batch is dropped): {e}",
                        self.len
                    ));
                }
            }
            return;
        }
        // SAFETY: exactly this mapping was created by `map`, is unmapped once, here, and no
        // slice of it outlives `self` (the slices of a split hold it).
        if unsafe { libc::munmap(self.raw.as_ptr().cast(), self.mapped) } != 0 {
            let e = std::io::Error::last_os_error();
            self.errors.record(format!(
                "munmap of {} bytes of pinned host memory failed: {e}",
                self.mapped
            ));
        }
    }
}

/// The machine's parallelism: the threads a touch may use.
fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, NonZeroUsize::get)
}

/// Threads to touch `len` bytes with: at most `threads`, at most one per
/// [`MIN_TOUCH_BYTES_PER_THREAD`], at least one.
fn touch_threads(len: usize, threads: usize) -> usize {
    threads.min(len / MIN_TOUCH_BYTES_PER_THREAD).max(1)
}

/// `0 .. len` cut into consecutive ranges of `piece` bytes (rounded up to
/// [`HUGE_PAGE_BYTES`]), the last one shorter; one range when `piece` is 0 or covers `len`.
fn pieces(len: usize, piece: usize) -> Vec<Range<usize>> {
    let piece = piece.checked_next_multiple_of(HUGE_PAGE_BYTES).unwrap_or(0);
    if piece == 0 || piece >= len {
        return std::iter::once(0..len).collect();
    }
    (0..len)
        .step_by(piece)
        .map(|s| s..s.saturating_add(piece).min(len))
        .collect()
}

/// Backs every page of `part` (page-aligned) with memory: a write of 0 (what the page reads
/// as already) at each page.
fn touch_part(part: &mut [u8], page: usize) {
    for i in (0..part.len()).step_by(page) {
        part[i] = 0;
    }
}

/// Runs `work` on the calling thread and on up to `threads - 1` scoped helper threads, all
/// taking their items from one queue until it is empty. A helper that cannot be spawned
/// leaves its share to the others; a helper that panics is joined and ignored (its items
/// then count as not done: the callers' `work` records what it finished as it goes).
fn on_threads<T: Send>(threads: usize, items: Vec<T>, work: impl Fn(T) + Sync) {
    let queue = Mutex::new(items);
    let next = || queue.lock().unwrap_or_else(|p| p.into_inner()).pop();
    let drain = || {
        while let Some(item) = next() {
            work(item);
        }
    };
    std::thread::scope(|s| {
        let drain = &drain;
        let helpers: Vec<_> = (1..threads)
            .filter_map(|_| {
                std::thread::Builder::new()
                    .name("gpu-pager-pin".to_owned())
                    .spawn_scoped(s, drain)
                    .ok()
            })
            .collect();
        drain();
        for h in helpers {
            let _ = h.join();
        }
    });
}

/// First-touches `mem` (page-aligned) on `threads` threads (1: the calling thread alone),
/// in parts of whole huge pages so that no huge page is faulted by two threads, four parts
/// per thread so that a slow thread holds the others up less.
fn touch(mem: &mut [u8], threads: usize) {
    touch_each(vec![mem], threads);
}

/// [`touch`] for several ranges (each page-aligned; the slices of one batch) at once: their
/// parts, cut from each range's start, share one set of threads.
fn touch_each(mems: Vec<&mut [u8]>, threads: usize) {
    let page = page_size();
    let total: usize = mems.iter().map(|m| m.len()).sum();
    if threads <= 1 || total <= HUGE_PAGE_BYTES {
        for m in mems {
            touch_part(m, page);
        }
        return;
    }
    let part = total
        .div_ceil(threads * 4)
        .next_multiple_of(HUGE_PAGE_BYTES);
    let parts: Vec<&mut [u8]> = mems.into_iter().flat_map(|m| m.chunks_mut(part)).collect();
    // A touch cannot panic (its indices stay inside its part); were a helper to, its pages
    // would be backed by the registration instead: slower, never wrong.
    on_threads(threads, parts, |p| touch_part(p, page));
}

/// Page-locked host memory: anonymous memory registered with the driver in one or more
/// pieces ([`CudaBackend::pin`]). Dropping it unregisters every piece, then unmaps it.
pub struct CudaPinned {
    /// Registered ranges, as offsets from `mem.ptr`, unregistered in `Drop::drop`.
    regs: Vec<Range<usize>>,
    /// What kernels use for `mem.ptr` (`cuMemHostGetDevicePointer`).
    device_ptr: u64,
    /// Bytes asked for (the mapping may be longer).
    len: usize,
    /// Dropped after `Drop::drop` has unregistered it.
    mem: AnonMemory,
    dev: Arc<Dev>,
}

// SAFETY: the buffer exclusively owns its memory, which any thread may use or free (the
// driver calls in `Drop` enter the context first); shared references only read it.
unsafe impl Send for CudaPinned {}
// SAFETY: see `Send`; `&CudaPinned` hands out only `&[u8]`.
unsafe impl Sync for CudaPinned {}

impl fmt::Debug for CudaPinned {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaPinned")
            .field("ptr", &self.mem.ptr)
            .field("len", &self.len)
            .field("device_ptr", &format_args!("{:#x}", self.device_ptr))
            .field("registrations", &self.regs.len())
            .finish()
    }
}

impl CudaPinned {
    /// The registered ranges, as byte offsets into the buffer, in order and back to back
    /// (the last may extend past [`HostBuffer::len`] to the end of the mapping). A copy's host
    /// range must lie inside one of them.
    pub fn registrations(&self) -> &[Range<usize>] {
        &self.regs
    }

    /// Registers the buffer's whole mapping, one registration.
    fn register_whole(&mut self) -> BackendResult<()> {
        let _scope = self.dev.scope()?;
        let whole = 0..self.mem.len;
        register(self.mem.ptr.as_ptr() as usize, whole.len())?;
        self.regs.push(whole);
        Ok(())
    }

    /// The device address of the memory, checked to be one contiguous range over all
    /// registrations (with unified addressing it is the host address itself).
    fn lookup_device_ptr(&self) -> BackendResult<u64> {
        let _scope = self.dev.scope()?;
        let base = self.mem.ptr.as_ptr() as usize;
        let mut first = 0u64;
        for (k, r) in self.regs.iter().enumerate() {
            let mut d: sys::CUdeviceptr = 0;
            // SAFETY: `d` is a valid out-pointer; `base + r.start` starts a registration
            // made by this buffer.
            check(unsafe {
                sys::cuMemHostGetDevicePointer_v2(&mut d, (base + r.start) as *mut c_void, 0)
            })
            .map_err(|e| driver_err("cuMemHostGetDevicePointer", e))?;
            if k == 0 {
                first = d;
            } else if d != first + r.start as u64 {
                return Err(BackendError::Invalid {
                    op: "alloc_pinned",
                    reason: format!(
                        "the device addresses of the registrations are not contiguous (piece \
                         {k} at {d:#x}, expected {:#x}); register in one piece",
                        first + r.start as u64
                    ),
                });
            }
        }
        Ok(first)
    }
}

/// `cuMemHostRegister` of `len` bytes at `addr`, portable to every context and mapped for
/// the device. The caller holds a context scope.
fn register(addr: usize, len: usize) -> BackendResult<()> {
    let flags = sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP;
    // SAFETY: `addr .. addr + len` lies inside a live anonymous mapping owned by the
    // `CudaPinned` being built, and overlaps none of its other registrations.
    check(unsafe { sys::cuMemHostRegister_v2(addr as *mut c_void, len, flags) })
        .map_err(|e| driver_err("cuMemHostRegister", e))
}

/// The pipeline of [`CudaBackend::pin_from_device`] and [`CudaBackend::pin_many_from_device`]
/// over `parts` (in order): a scoped helper thread runs `touch` on the parts in order and
/// sends each touched part to this thread, which runs `step` on it (registering it and
/// enqueueing its copies) while the helper touches the next. Stops at the first error of
/// `step` (or a part that does not come, should the helper panic); the helper finishes its
/// current part and is joined before this returns. Where no helper can be spawned, this
/// thread touches everything first. Returns the first error and the parts handed to `step`
/// (which the caller keeps, and with them their borrows, until their copies are done).
fn pipeline<P: Send>(
    parts: Vec<P>,
    touch: impl Fn(&mut P) + Sync,
    mut step: impl FnMut(&mut P) -> BackendResult<()>,
) -> (BackendResult<()>, Vec<P>) {
    let count = parts.len();
    let (tx, rx) = std::sync::mpsc::channel::<P>();
    // The helper's work, taken once: by the helper, or by this thread if none spawns.
    let job = Mutex::new(Some((parts, tx)));
    let toucher = || {
        let taken = job.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some((parts, tx)) = taken {
            for mut part in parts {
                touch(&mut part);
                if tx.send(part).is_err() {
                    break; // the receiver stopped taking parts: an error
                }
            }
        }
    };
    let out = std::thread::scope(|s| {
        let helper = std::thread::Builder::new()
            .name("gpu-pager-pin".to_owned())
            .spawn_scoped(s, toucher);
        if helper.is_err() {
            // No helper: touch every part here first (no overlap, still correct).
            toucher();
        }
        let mut held: Vec<P> = Vec::with_capacity(count);
        let mut outcome = Ok(());
        for _ in 0..count {
            let Ok(mut part) = rx.recv() else {
                outcome = Err(BackendError::Internal {
                    op: "pin_from_device",
                    reason: "the touching thread stopped early".to_owned(),
                });
                break;
            };
            let stepped = step(&mut part);
            held.push(part);
            if let Err(e) = stepped {
                outcome = Err(e);
                break;
            }
        }
        // Dropping the receiver stops the helper after its current part (on error).
        drop(rx);
        if let Ok(h) = helper {
            // A helper that panicked touched less: the `recv` above reported it.
            let _ = h.join();
        }
        (outcome, held)
    });
    drop(job);
    out
}

/// The helper threads that touch one part of a pipeline: all cores but one (the calling
/// thread registers meanwhile), at least one.
fn pipeline_touch_threads() -> usize {
    cores().saturating_sub(1).max(1)
}

/// The pipeline's touch of one piece of [`CudaBackend::pin_from_device`]: on
/// `touch_threads(len, helpers)` threads.
fn touch_piece(helpers: usize) -> impl Fn(&mut (Range<usize>, &mut [u8])) + Sync {
    move |(_, part)| touch(part, touch_threads(part.len(), helpers))
}

/// Registers `part` (piece `r` of a buffer of `bytes` usable bytes), notes it in `regs` (to be
/// unregistered on drop), and enqueues the copy of its usable bytes from device
/// `src + r.start` on `stream`; nothing is enqueued when the registration fails. The caller
/// holds a context scope.
///
/// # Safety
/// `part` is piece `r` of a live mapping that the caller borrows exclusively until `stream`
/// has run the copy, registered nowhere else; `src + r.start ..` for the usable bytes is
/// mapped device memory of the context, not written until then; `stream` is a live stream
/// of the context.
unsafe fn register_and_copy(
    part: &mut [u8],
    r: &Range<usize>,
    bytes: usize,
    src: u64,
    stream: sys::CUstream,
    regs: &mut Vec<Range<usize>>,
) -> BackendResult<()> {
    register(part.as_mut_ptr() as usize, part.len())?;
    regs.push(r.clone());
    let n = r.end.min(bytes).saturating_sub(r.start).min(part.len());
    if n == 0 {
        return Ok(());
    }
    // SAFETY: the destination is the first `n` bytes of `part`, just registered; the source
    // is mapped and unwritten, and `part` stays borrowed until the stream has run the copy
    // (the caller's contract).
    check(unsafe {
        sys::cuMemcpyDtoHAsync_v2(part.as_mut_ptr().cast(), src + r.start as u64, n, stream)
    })
    .map_err(|e| driver_err("cuMemcpyDtoHAsync", e))
}

impl HostBuffer for CudaPinned {
    fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr .. ptr + len` lies inside the live mapping owned by `self`; it is
        // initialised (anonymous memory reads as zeros until written); no `&mut` exists
        // while `&self` is borrowed.
        unsafe { std::slice::from_raw_parts(self.mem.ptr.as_ptr(), self.len) }
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`; `&mut self` makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.mem.ptr.as_ptr(), self.len) }
    }

    fn len(&self) -> usize {
        self.len
    }

    fn device_ptr(&self) -> u64 {
        self.device_ptr
    }

    fn piece_bytes(&self) -> usize {
        match self.regs.as_slice() {
            [first, _, ..] => first.len(),
            _ => 0,
        }
    }
}

impl Drop for CudaPinned {
    fn drop(&mut self) {
        let scope = self.dev.scope_in_drop("pinned host memory");
        let base = self.mem.ptr.as_ptr() as usize;
        for r in self.regs.drain(..) {
            let at = (base + r.start) as *mut c_void;
            // SAFETY: `at` starts a registration this buffer made and nothing else
            // unregisters; no slice of the buffer outlives `self`, and the owner waited for
            // every copy using it.
            let unregistered = check(unsafe { sys::cuMemHostUnregister(at) });
            if let Err(e) = unregistered {
                // Still registered, maybe: the pages stay until the whole mapping goes.
                self.mem.discard_on_drop = false;
                self.dev.record(
                    "cuMemHostUnregister",
                    format_args!("{} bytes of pinned host memory", r.len()),
                    e,
                );
            }
        }
        drop(scope);
        // `mem` is unmapped when the fields drop, after this (a slice of a batch: its pages
        // given back, the mapping unmapped with the last slice).
    }
}

impl CudaBackend {
    /// Pins `bytes` of host memory (see the module documentation), touched on every core, in
    /// one registration; the contents read as zeros. [`crate::backend::Backend::alloc_pinned`]
    /// is `pin`.
    ///
    /// Errors: [`BackendError::Invalid`] for 0 bytes; [`BackendError::Os`] when the memory
    /// cannot be mapped; [`BackendError::Driver`] when the driver refuses to register it.
    /// Nothing stays mapped or registered after an error.
    pub fn pin(&self, bytes: usize) -> BackendResult<CudaPinned> {
        let mut pinned = self.map_only(bytes)?;
        let threads = touch_threads(pinned.mem.len, cores());
        touch(pinned.mem.as_mut_slice(), threads);
        // On any error below, dropping `pinned` unregisters what was registered and unmaps.
        pinned.register_whole()?;
        pinned.device_ptr = pinned.lookup_device_ptr()?;
        Ok(pinned)
    }

    /// Pins `bytes` as [`CudaBackend::pin`] does and fills them with a copy of device memory
    /// at `src`, as a three-stage pipeline over pieces of `piece_bytes` (rounded up to
    /// [`HUGE_PAGE_BYTES`]; 0: one piece, nothing overlaps; the pager's first backups use
    /// [`FIRST_BACKUP_PIECE_BYTES`]): a scoped helper thread first-touches the pieces in order
    /// (on all cores but one) and hands each finished piece to
    /// this thread through a channel; this thread registers each piece it receives and
    /// enqueues its copy on the backend's device→host stream at once. So piece k+1 is
    /// touched while piece k registers and piece k-1 copies. Every copy stays inside one
    /// registration. Waits for the copies before it returns, also on error; when that wait
    /// fails, the buffer is leaked rather than unmapped under a copy that may still run
    /// (recorded in the backend's [`DeferredErrors`]).
    ///
    /// Errors: as [`CudaBackend::pin`], and [`BackendError::Driver`] when a copy cannot be
    /// enqueued or fails. Nothing stays mapped or registered after an error (but for the
    /// leak above).
    ///
    /// # Safety
    /// `src .. src + bytes` must be mapped device memory of this context, not written until
    /// the call returns.
    pub unsafe fn pin_from_device(
        &self,
        bytes: usize,
        piece_bytes: usize,
        src: u64,
    ) -> BackendResult<CudaPinned> {
        let mut pinned = self.map_only(bytes)?;
        let scope = self.dev.scope()?;
        let pieces = pieces(pinned.mem.len, piece_bytes);
        let stream = self.d2h.cu_stream();
        let CudaPinned { mem, regs, .. } = &mut pinned;
        // Each piece's bytes, borrowed mutably from the mapping: the helper touches a piece,
        // then hands its borrow to this thread, which keeps it until the copies are waited
        // for below (the copy engine writes into it meanwhile).
        let mut parts: Vec<(Range<usize>, &mut [u8])> = Vec::with_capacity(pieces.len());
        let mut rest = mem.as_mut_slice();
        for r in &pieces {
            let (part, tail) = rest.split_at_mut(r.len().min(rest.len()));
            parts.push((r.clone(), part));
            rest = tail;
        }
        let touch = touch_piece(pipeline_touch_threads());
        let (enqueued, held) = pipeline(parts, touch, |(r, part)| {
            // SAFETY: `src .. src + bytes` is mapped and unwritten (the caller's contract);
            // `part` is piece `r` of this buffer, touched, borrowed exclusively by this
            // thread and kept (in `held`) until the copies are waited for below.
            unsafe { register_and_copy(part, r, bytes, src, stream, regs) }
        });
        let synced = self.d2h.synchronize();
        drop(held);
        let bytes = pinned.mem.len;
        let mut pinned = self.after_fill("pin_from_device", bytes, pinned, synced, enqueued)?;
        drop(scope);
        pinned.device_ptr = pinned.lookup_device_ptr()?;
        Ok(pinned)
    }

    /// The end of a pin-and-copy pipeline (`op`: [`CudaBackend::pin_from_device`] or
    /// [`CudaBackend::pin_many_from_device`]) over `buffers` (`bytes` of pinned memory), once
    /// `synced`, the wait for the device→host stream, returned. When that wait failed, a copy
    /// may still be writing them: they are leaked rather than unmapped under the copy engine
    /// (recorded in the backend's [`DeferredErrors`]), and the error returned is the failed
    /// enqueue's if there was one, else the wait's. Otherwise `buffers`, or the enqueue's
    /// error (dropping them then unregisters what was registered and unmaps).
    fn after_fill<T>(
        &self,
        op: &str,
        bytes: usize,
        buffers: T,
        synced: Result<(), cudarc::driver::DriverError>,
        enqueued: BackendResult<()>,
    ) -> BackendResult<T> {
        if let Err(e) = synced {
            let why = super::describe(e);
            self.dev.errors.record(format!(
                "{op}: waiting for the copies failed ({why}); {bytes} bytes of pinned host \
                 memory are leaked"
            ));
            std::mem::forget(buffers);
            // The first failure is the one to report (an enqueue that failed before).
            enqueued?;
            return Err(BackendError::Driver {
                op: "cuStreamSynchronize",
                message: format!("waiting for the copies into fresh pinned memory failed: {why}"),
            });
        }
        enqueued.map(|()| buffers)
    }

    /// Maps `bytes` (> 0, else `Invalid`) for [`CudaBackend::pin`]: a buffer with nothing
    /// touched or registered yet.
    fn map_only(&self, bytes: usize) -> BackendResult<CudaPinned> {
        if bytes == 0 {
            return Err(BackendError::Invalid {
                op: "alloc_pinned",
                reason: "0 bytes requested".to_owned(),
            });
        }
        let mem = AnonMemory::map(bytes, self.dev.errors.clone())?;
        Ok(CudaPinned {
            regs: Vec::new(),
            device_ptr: 0,
            len: bytes,
            mem,
            dev: self.dev.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: usize = 1 << 20;

    #[test]
    fn pieces_cover_the_range_back_to_back() {
        let len = 10 * HUGE_PAGE_BYTES + 4096;
        assert_eq!(pieces(len, 0), vec![0..len]);
        assert_eq!(pieces(len, len), vec![0..len]);
        assert_eq!(pieces(len, usize::MAX), vec![0..len]);
        let p = pieces(len, 4 * HUGE_PAGE_BYTES);
        assert_eq!(
            p,
            vec![
                0..4 * HUGE_PAGE_BYTES,
                4 * HUGE_PAGE_BYTES..8 * HUGE_PAGE_BYTES,
                8 * HUGE_PAGE_BYTES..len
            ]
        );
        // Rounded up to huge pages: 3 MiB pieces are 4 MiB.
        let p = pieces(len, 3 * MIB);
        assert!(p.iter().all(|r| r.start % HUGE_PAGE_BYTES == 0));
        assert_eq!(p[0], 0..4 * MIB);
        assert_eq!(p.last().map(|r| r.end), Some(len));
        for w in p.windows(2) {
            assert_eq!(w[0].end, w[1].start);
        }
        // Exact multiples leave no empty tail.
        assert_eq!(pieces(8 * MIB, 2 * MIB).len(), 4);
    }

    #[test]
    fn small_buffers_touch_on_the_calling_thread() {
        assert_eq!(touch_threads(4096, cores()), 1);
        assert_eq!(touch_threads(2 * MIN_TOUCH_BYTES_PER_THREAD - 1, 16), 1);
        assert_eq!(touch_threads(2 * MIN_TOUCH_BYTES_PER_THREAD, 16), 2);
        assert_eq!(touch_threads(55 * MIB, 16), 6);
        assert_eq!(touch_threads(16 << 30, 16), 16);
        assert_eq!(touch_threads(16 << 30, 1), 1);
        assert_eq!(touch_threads(1 << 40, cores()), cores());
    }

    /// Pages of `mem` (page-aligned) that are not resident, from `mincore`.
    fn missing_pages(mem: &mut [u8]) -> usize {
        let page = page_size();
        let mut vec = vec![0u8; mem.len().div_ceil(page)];
        // SAFETY: `mem` is a page-aligned range of a live mapping; `vec` has one byte per
        // page of it.
        let rc = unsafe { libc::mincore(mem.as_mut_ptr().cast(), mem.len(), vec.as_mut_ptr()) };
        assert_eq!(rc, 0, "mincore: {}", std::io::Error::last_os_error());
        vec.iter().filter(|&&v| v & 1 == 0).count()
    }

    #[test]
    fn mapped_memory_is_aligned_zeroed_and_long_enough() {
        let errors = Arc::new(DeferredErrors::new());
        for bytes in [1, 4097, 5 * MIB + 13] {
            let mut m = AnonMemory::map(bytes, errors.clone()).expect("mmap");
            // Huge-page alignment only from one huge page up.
            let align = if bytes >= HUGE_PAGE_BYTES {
                HUGE_PAGE_BYTES
            } else {
                page_size()
            };
            assert_eq!(m.ptr.as_ptr() as usize % align, 0, "{bytes}");
            assert_eq!(m.len % align, 0);
            assert!(m.len >= bytes);
            let start = m.raw.as_ptr() as usize;
            assert!(m.ptr.as_ptr() as usize + m.len <= start + m.mapped);
            let s = m.as_mut_slice();
            assert!(s.iter().all(|&b| b == 0));
            s[s.len() - 1] = 7;
        }
        assert_eq!(errors.total(), 0);
    }

    #[test]
    fn touch_backs_every_page_on_threads_or_not() {
        let errors = Arc::new(DeferredErrors::new());
        for threads in [1, 4, 64] {
            let bytes = 48 * MIB + 4096;
            let mut m = AnonMemory::map(bytes, errors.clone()).expect("mmap");
            assert!(missing_pages(m.as_mut_slice()) > 0);
            touch(m.as_mut_slice(), threads);
            assert_eq!(missing_pages(m.as_mut_slice()), 0, "{threads} threads");
            assert!(
                m.as_mut_slice().iter().all(|&b| b == 0),
                "touching changed the contents"
            );
        }
        assert_eq!(errors.total(), 0);
    }

    /// `mem` cut into `pieces(len, piece)`, as `pin_from_device` cuts it.
    fn parts(mem: &mut AnonMemory, piece: usize) -> Vec<(Range<usize>, &mut [u8])> {
        let ranges = pieces(mem.len, piece);
        let mut rest = mem.as_mut_slice();
        let mut out = Vec::new();
        for r in ranges {
            let (part, tail) = rest.split_at_mut(r.len());
            out.push((r, part));
            rest = tail;
        }
        out
    }

    #[test]
    fn the_pipeline_hands_over_every_piece_touched_in_order_on_the_calling_thread() {
        let errors = Arc::new(DeferredErrors::new());
        let here = std::thread::current().id();
        for (helpers, piece) in [(3, 8 * MIB), (1, 6 * MIB), (2, 0)] {
            let bytes = 48 * MIB + 4096;
            let mut m = AnonMemory::map(bytes, errors.clone()).expect("mmap");
            let len = m.len;
            let want = pieces(len, piece);
            let mut seen = Vec::new();
            let (outcome, held) =
                pipeline(parts(&mut m, piece), touch_piece(helpers), |(r, part)| {
                    let part: &mut [u8] = part;
                    assert_eq!(std::thread::current().id(), here);
                    assert_eq!(part.len(), r.len());
                    assert_eq!(missing_pages(part), 0, "piece {r:?} handed over untouched");
                    part[0] = 1; // this thread may write it: it holds the borrow
                    seen.push(r.clone());
                    Ok(())
                });
            assert!(outcome.is_ok());
            assert_eq!(seen, want, "{helpers} helpers, piece {piece}");
            assert_eq!(held.len(), want.len());
            assert!(held.iter().all(|(_, p)| p[0] == 1));
            drop(held);
            assert_eq!(missing_pages(m.as_mut_slice()), 0);
        }
        assert_eq!(errors.total(), 0);
    }

    #[test]
    fn the_pipeline_stops_at_the_first_failed_step_and_joins_its_helper() {
        let errors = Arc::new(DeferredErrors::new());
        let mut m = AnonMemory::map(40 * MIB, errors.clone()).expect("mmap");
        let mut calls = 0;
        let touch = touch_piece(2);
        let (outcome, held) = pipeline(parts(&mut m, 4 * MIB), touch, |(r, _)| {
            calls += 1;
            if r.start == 8 * MIB {
                Err(BackendError::Injected { op: "register" })
            } else {
                Ok(())
            }
        });
        assert!(matches!(
            outcome,
            Err(BackendError::Injected { op: "register" })
        ));
        assert_eq!(calls, 3, "no step after the failed one");
        assert_eq!(
            held.len(),
            3,
            "the failed piece is held too (it may be registered)"
        );
        drop(held);
        drop(m);
        assert_eq!(errors.total(), 0);
    }

    #[test]
    fn on_threads_does_every_item_once_and_one_thread_is_the_caller() {
        let here = std::thread::current().id();
        let seen = Mutex::new(Vec::new());
        on_threads(1, (0..50).collect(), |i: usize| {
            seen.lock().unwrap().push((i, std::thread::current().id()))
        });
        let seen = seen.into_inner().unwrap();
        assert_eq!(seen.len(), 50);
        assert!(seen.iter().all(|&(_, id)| id == here));

        let seen = Mutex::new(Vec::new());
        on_threads(4, (0..1000).collect(), |i: usize| {
            seen.lock().unwrap().push(i)
        });
        let mut seen = seen.into_inner().unwrap();
        seen.sort_unstable();
        assert_eq!(seen, (0..1000).collect::<Vec<_>>());
    }
}
