//! The backend primitives on host memory, so every pager path runs without a GPU.
//!
//! A reservation is an anonymous `PROT_NONE` mapping: touching an unmapped part faults, just
//! as a GPU kernel touching an unmapped VMM range does, instead of reading stale data. A
//! physical chunk is a memfd of the chunk's size, mapped `MAP_FIXED | MAP_SHARED` over its
//! slice of the reservation (the descriptor is closed once mapped); dropping it puts the
//! `PROT_NONE` placeholder back, so the memory really goes back to the system. A capacity
//! limit stands in for the device's memory size, so out-of-memory paths run in CI.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::ptr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use super::{
    Backend, BackendError, BackendKind, BackendResult, DeferredErrors, DeviceInfo, DeviceProcess,
    DeviceRange, Direction, HostBuffer, KvKernels, Mapping, MemInfo, Mover, RawCopy, Reservation,
    check_copy, check_map, kv_invalid,
};
use crate::kernels::kv::{KvOp, reference as kv_reference};
use crate::kernels::{self, reference};

/// Settings of a [`HostBackend`].
#[derive(Debug, Clone, Copy)]
pub struct HostConfig {
    /// Bytes of "device memory" the backend hands out before it reports out-of-memory.
    /// This is real host memory once touched, and a `Preserve` region's pinned backup takes
    /// as much again, so keep it within what the machine holds.
    pub capacity: usize,
    /// Allocation granularity in bytes (a multiple of the OS page size).
    pub granularity: usize,
}

/// Environment variable that sets the host backend's capacity for [`HostConfig::from_env`]
/// (and so for [`super::auto`]): bytes, or a number with a `K`, `M`, `G` or `T` suffix
/// (binary units), e.g. `GPU_PAGER_HOST_CAPACITY=8G`.
pub const CAPACITY_ENV: &str = "GPU_PAGER_HOST_CAPACITY";

/// The largest default capacity: 32 GiB.
pub const MAX_DEFAULT_CAPACITY: usize = 32 << 30;

impl Default for HostConfig {
    /// Half of this machine's physical memory, at most [`MAX_DEFAULT_CAPACITY`] (half,
    /// because a `Preserve` region's backup doubles what its contents take), with a 2 MiB
    /// granularity like the GPU's. On a 24 GiB machine that is 12 GiB.
    fn default() -> Self {
        let granularity = 2 << 20;
        let half = physical_memory() / 2;
        HostConfig {
            capacity: (half.min(MAX_DEFAULT_CAPACITY) / granularity * granularity).max(granularity),
            granularity,
        }
    }
}

impl HostConfig {
    /// [`HostConfig::default`], with the capacity taken from [`CAPACITY_ENV`] when it is
    /// set. A value that does not parse is an error that says how to write it.
    pub fn from_env() -> BackendResult<HostConfig> {
        let mut config = HostConfig::default();
        if let Ok(v) = std::env::var(CAPACITY_ENV) {
            config.capacity = capacity_from(&v, config.granularity, physical_memory())?;
        }
        Ok(config)
    }
}

/// The capacity that `GPU_PAGER_HOST_CAPACITY=asked` sets, in whole chunks of
/// `granularity`: an error for what is no byte count, less than one chunk (every region
/// would fail), or more than the machine's `physical` memory.
fn capacity_from(asked: &str, granularity: usize, physical: usize) -> BackendResult<usize> {
    let invalid = |reason: String| BackendError::Invalid {
        op: "the setting GPU_PAGER_HOST_CAPACITY",
        reason,
    };
    let shown: String = asked.chars().take(64).collect();
    let capacity = parse_bytes(asked).ok_or_else(|| {
        invalid(format!(
            "{CAPACITY_ENV}={shown:?} is not a byte count; write e.g. 8G, 512M or 1073741824"
        ))
    })?;
    if capacity < granularity {
        return Err(invalid(format!(
            "{CAPACITY_ENV}={shown} is less than one chunk of {} MiB, so no region would fit; \
             ask for at least {}M",
            granularity >> 20,
            granularity >> 20
        )));
    }
    check_capacity(&shown, capacity, physical)?;
    Ok(capacity / granularity * granularity)
}

/// Refuses a capacity above the machine's memory: the host backend's "device" memory is host
/// memory, and a process that counts on more than there is gets killed instead of an error.
fn check_capacity(asked: &str, capacity: usize, physical: usize) -> BackendResult<()> {
    if capacity > physical {
        return Err(BackendError::Invalid {
            op: "the setting GPU_PAGER_HOST_CAPACITY",
            reason: format!(
                "{CAPACITY_ENV}={asked} is more than this machine's {physical} bytes of memory (the \
                 host backend's device memory is host memory, and a Preserve region's backup \
                 takes as much again); ask for at most half of it"
            ),
        });
    }
    Ok(())
}

/// Parses `"1073741824"`, `"512M"`, `"1.5G"`, `"1T"` (binary units; a trailing `B` or `iB`
/// is accepted). `None` for anything else, zero included.
fn parse_bytes(s: &str) -> Option<usize> {
    crate::names::parse_bytes(s).filter(|&b| b > 0 && b < usize::MAX)
}

/// Physical memory of this machine in bytes (32 GiB if the system does not say).
fn physical_memory() -> usize {
    // SAFETY: sysconf has no memory-safety preconditions.
    let pages = unsafe { libc::sysconf(libc::_SC_PHYS_PAGES) };
    usize::try_from(pages)
        .ok()
        .and_then(|p| p.checked_mul(page_size()))
        .filter(|&b| b > 0)
        .unwrap_or(MAX_DEFAULT_CAPACITY)
}

/// `bytes` (non-zero) zeroed bytes, or `None` when the allocator cannot provide them (a
/// failure `vec![0; n]` would turn into an abort).
pub(crate) fn zeroed(bytes: usize) -> Option<Vec<u8>> {
    let layout = std::alloc::Layout::array::<u8>(bytes)
        .ok()
        .filter(|l| l.size() > 0)?;
    // SAFETY: the layout has a non-zero size (checked).
    let p = unsafe { std::alloc::alloc_zeroed(layout) };
    if p.is_null() {
        return None;
    }
    // SAFETY: `p` comes from the global allocator with this layout (capacity and length
    // `bytes`, alignment 1) and its bytes are initialised (zeroed).
    Some(unsafe { Vec::from_raw_parts(p, bytes, bytes) })
}

/// Host-memory implementation of [`Backend`].
#[derive(Debug)]
pub struct HostBackend {
    info: DeviceInfo,
    used: Arc<AtomicUsize>,
    errors: Arc<DeferredErrors>,
}

impl HostBackend {
    /// A backend with the given capacity and granularity. The granularity is rounded up to
    /// the OS page size.
    pub fn new(config: HostConfig) -> Self {
        let page = page_size();
        let granularity = config.granularity.max(page).div_ceil(page) * page;
        HostBackend {
            info: DeviceInfo {
                kind: BackendKind::Host,
                name: "host memory (no GPU)".to_owned(),
                granularity,
                total_bytes: config.capacity,
                compute_capability: None,
                ordinal: None,
            },
            used: Arc::new(AtomicUsize::new(0)),
            errors: Arc::new(DeferredErrors::new()),
        }
    }

    /// Bytes of capacity in use (mapped chunks).
    pub fn used_bytes(&self) -> usize {
        self.used.load(Ordering::SeqCst)
    }
}

pub(crate) fn page_size() -> usize {
    // SAFETY: sysconf has no memory-safety preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(p).unwrap_or(4096).max(4096)
}

fn charge(used: &AtomicUsize, capacity: usize, bytes: usize) -> BackendResult<()> {
    used.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |u| {
        u.checked_add(bytes).filter(|&n| n <= capacity)
    })
    .map(|_| ())
    .map_err(|_| BackendError::OutOfMemory { requested: bytes })
}

fn os_error(op: &'static str) -> BackendError {
    BackendError::Os {
        op,
        error: std::io::Error::last_os_error(),
    }
}

/// Maps `len` bytes at `addr` as an inaccessible placeholder (`addr == 0`: anywhere).
fn map_placeholder(addr: u64, len: usize) -> BackendResult<u64> {
    let fixed = if addr == 0 { 0 } else { libc::MAP_FIXED };
    // SAFETY: an anonymous PROT_NONE mapping; with MAP_FIXED, `addr..addr+len` lies inside a
    // reservation this backend owns (the caller's contract), so nothing else is replaced.
    let p = unsafe {
        libc::mmap(
            addr as *mut libc::c_void,
            len,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | fixed,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(os_error("mmap(PROT_NONE)"));
    }
    Ok(p as u64)
}

#[derive(Debug)]
struct HostReservation {
    base: u64,
    len: usize,
    errors: Arc<DeferredErrors>,
}

impl Reservation for HostReservation {
    fn base(&self) -> u64 {
        self.base
    }
    fn len(&self) -> usize {
        self.len
    }
}

impl Drop for HostReservation {
    fn drop(&mut self) {
        // SAFETY: the range was mapped by `reserve` and is owned by this reservation alone;
        // every mapping inside it holds the reservation, so all of them are gone.
        if unsafe { libc::munmap(self.base as *mut libc::c_void, self.len) } != 0 {
            let e = std::io::Error::last_os_error();
            self.errors.record(format!(
                "munmap of a {}-byte reservation at {:#x} failed: {e}",
                self.len, self.base
            ));
        }
    }
}

/// A memfd mapped over part of a reservation it holds, so the placeholder it puts back on
/// drop always lands inside the still-reserved range.
#[derive(Debug)]
struct HostMapping {
    ptr: u64,
    len: usize,
    /// Unmapped already by [`Backend::unmap_runs`], with its neighbours.
    unmapped: bool,
    used: Arc<AtomicUsize>,
    errors: Arc<DeferredErrors>,
    _reservation: Arc<dyn Reservation>,
}

impl Mapping for HostMapping {
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

impl Drop for HostMapping {
    fn drop(&mut self) {
        // Unmap (put the placeholder back so the address stays reserved): the mapping was
        // the memfd's last reference, so its memory goes back to the system.
        // (Unmapped already by `unmap_runs`, with its neighbours: only the count is left.)
        if !self.unmapped
            && let Err(e) = map_placeholder(self.ptr, self.len)
        {
            self.errors.record(format!(
                "unmapping a {}-byte host chunk at {:#x} failed: {e}",
                self.len, self.ptr
            ));
        }
        self.used.fetch_sub(self.len, Ordering::SeqCst);
    }
}

impl HostBackend {
    /// Maps one memfd chunk of `len` bytes at `at`.
    ///
    /// # Safety
    /// `at .. at + len` lies inside `reservation`, one of this backend's, and is unmapped.
    unsafe fn map_one(
        &self,
        reservation: &Arc<dyn Reservation>,
        at: u64,
        len: usize,
    ) -> BackendResult<HostMapping> {
        charge(&self.used, self.info.total_bytes, len)?;
        let uncharge = |e| {
            self.used.fetch_sub(len, Ordering::SeqCst);
            e
        };
        // SAFETY: memfd_create with a NUL-terminated name has no memory-safety preconditions.
        let fd = unsafe { libc::memfd_create(c"gpu-pager-chunk".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(uncharge(os_error("memfd_create")));
        }
        // SAFETY: `fd` is a fresh descriptor that nothing else owns.
        let memfd = unsafe { OwnedFd::from_raw_fd(fd) };
        let size = libc::off_t::try_from(len).map_err(|_| BackendError::Invalid {
            op: "map",
            reason: format!("{len} bytes exceed off_t"),
        });
        let size = size.map_err(uncharge)?;
        // SAFETY: ftruncate on a descriptor we own.
        if unsafe { libc::ftruncate(memfd.as_raw_fd(), size) } != 0 {
            return Err(uncharge(os_error("ftruncate")));
        }
        // SAFETY: `at..at+len` lies inside a reservation of this backend and is unmapped
        // (`map_one`'s contract), so MAP_FIXED replaces only our own placeholder.
        let p = unsafe {
            libc::mmap(
                at as *mut libc::c_void,
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_FIXED,
                memfd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(uncharge(os_error("mmap(memfd)")));
        }
        // The mapping holds the memory: the descriptor closes here, so that a region of many
        // chunks needs no descriptor per chunk.
        drop(memfd);
        Ok(HostMapping {
            ptr: at,
            len,
            unmapped: false,
            used: self.used.clone(),
            errors: self.errors.clone(),
            _reservation: reservation.clone(),
        })
    }
}

/// Host copies are synchronous, so every fence has passed.
#[derive(Debug)]
struct Passed;

impl super::Fence for Passed {
    fn wait(&self) -> BackendResult<()> {
        Ok(())
    }
    fn is_done(&self) -> BackendResult<bool> {
        Ok(true)
    }
}

/// Runs `copy` at once: with the copy engine from the host address, with the copy kernel
/// from the device address of the host bytes (the same address here), the kernel's
/// reference ([`reference::copy`]) either way.
///
/// # Safety
/// As [`Backend::copy_unit`]: both ranges are live memory of this backend that nothing else
/// accesses during the call, and they do not overlap.
unsafe fn host_copy(op: &'static str, copy: &RawCopy, mover: Mover) -> BackendResult<()> {
    if !check_copy(op, copy)? {
        return Ok(());
    }
    let host = match mover {
        Mover::CopyEngine => copy.host,
        Mover::CopyKernel => copy.host_device,
    };
    let (dst, src) = match copy.direction {
        Direction::ToDevice => (copy.device, host),
        Direction::ToHost => (host, copy.device),
    };
    // SAFETY: the caller guarantees `src .. src + bytes` is live memory nobody writes.
    let src = unsafe { std::slice::from_raw_parts(src as *const u8, copy.bytes) };
    // SAFETY: the caller guarantees `dst .. dst + bytes` is live memory nobody else accesses,
    // disjoint from `src` (checked above).
    let dst = unsafe { std::slice::from_raw_parts_mut(dst as *mut u8, copy.bytes) };
    reference::copy(dst, src);
    Ok(())
}

#[derive(Debug)]
struct HostVec(Vec<u8>);

impl HostBuffer for HostVec {
    fn as_slice(&self) -> &[u8] {
        &self.0
    }
    fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.0
    }
}

impl Backend for HostBackend {
    fn info(&self) -> &DeviceInfo {
        &self.info
    }

    fn deferred_errors(&self) -> &Arc<DeferredErrors> {
        &self.errors
    }

    fn mem_info(&self) -> BackendResult<MemInfo> {
        let total = self.info.total_bytes;
        Ok(MemInfo {
            free: total.saturating_sub(self.used_bytes()),
            total,
        })
    }

    /// This process alone, holding every byte in use: the host backend's device is its own.
    fn processes(&self) -> Option<Vec<DeviceProcess>> {
        Some(vec![DeviceProcess {
            pid: std::process::id(),
            bytes: Some(self.used_bytes()),
        }])
    }

    /// Nothing to collect: host memory has no scrubber.
    fn set_reclaim_scrubbed(&self, _on: bool) {}

    fn alloc_pinned_many(&self, sizes: &[usize]) -> BackendResult<Vec<Box<dyn HostBuffer>>> {
        super::pin_each(self, sizes)
    }

    unsafe fn alloc_pinned_from_device(
        &self,
        bytes: usize,
        src: u64,
    ) -> BackendResult<Box<dyn HostBuffer>> {
        // SAFETY: the caller's contract, passed on.
        unsafe { super::pin_then_copy(self, bytes, src) }
    }

    unsafe fn alloc_pinned_many_from_device(
        &self,
        ranges: &[DeviceRange],
    ) -> BackendResult<Vec<Box<dyn HostBuffer>>> {
        // SAFETY: the caller's contract, passed on.
        unsafe { super::pin_many_then_copy(self, ranges) }
    }

    fn reserve(&self, bytes: usize) -> BackendResult<Arc<dyn Reservation>> {
        if bytes == 0 || !bytes.is_multiple_of(self.info.granularity) {
            return Err(BackendError::Invalid {
                op: "reserve",
                reason: format!(
                    "{bytes} bytes is not a non-zero multiple of the granularity {}",
                    self.info.granularity
                ),
            });
        }
        // Over-reserve by one granule, then trim head and tail so the base is aligned to the
        // granularity, as CUDA's reservations are.
        let g = self.info.granularity;
        let raw = map_placeholder(0, bytes + g)?;
        let base = raw.next_multiple_of(g as u64);
        let head = (base - raw) as usize;
        let tail = g - head;
        for (addr, len) in [(raw, head), (base + bytes as u64, tail)] {
            // SAFETY: both pieces lie inside the mapping made just above and outside the
            // returned range, so nothing else refers to them.
            if len > 0 && unsafe { libc::munmap(addr as *mut libc::c_void, len) } != 0 {
                return Err(os_error("munmap"));
            }
        }
        Ok(Arc::new(HostReservation {
            base,
            len: bytes,
            errors: self.errors.clone(),
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
        let mut out: Vec<Box<dyn Mapping>> = Vec::with_capacity(chunk_sizes.len());
        let mut next = at;
        for &len in chunk_sizes {
            // SAFETY: the span lies inside `reservation` (checked), which is this backend's
            // and unmapped there (the caller's contract).
            match unsafe { self.map_one(reservation, next, len) } {
                Ok(m) => out.push(Box::new(m)),
                // Dropping `out` unmaps and releases what this call mapped.
                Err(BackendError::OutOfMemory { .. }) => {
                    return Err(BackendError::OutOfMemory { requested: total });
                }
                Err(e) => return Err(e),
            }
            next += len as u64;
        }
        Ok(out)
    }

    /// One placeholder mapping over each run, as the CUDA backend's one `cuMemUnmap` per
    /// run, so that the host tests walk the same path.
    unsafe fn unmap_runs(&self, maps: &mut [Box<dyn Mapping>]) {
        // The range is covered exactly by mappings of this backend (the caller's
        // contract), so the placeholder replaces nothing else.
        crate::backend::unmap_by_runs(maps, |start, len| map_placeholder(start, len).is_ok());
    }

    fn synchronize(&self) -> BackendResult<()> {
        Ok(())
    }

    fn alloc_pinned(&self, bytes: usize) -> BackendResult<Box<dyn HostBuffer>> {
        if bytes == 0 {
            return Err(BackendError::Invalid {
                op: "alloc_pinned",
                reason: "zero bytes".to_owned(),
            });
        }
        let v = zeroed(bytes).ok_or(BackendError::HostOutOfMemory { requested: bytes })?;
        Ok(Box::new(HostVec(v)))
    }

    unsafe fn copy_to_device(&self, dst: u64, src: &[u8]) -> BackendResult<()> {
        // SAFETY: the caller guarantees `dst..dst+len` is mapped memory of this backend with no
        // concurrent writer; `src` is a valid slice that cannot overlap it (it is pageable
        // host memory outside any reservation).
        unsafe { ptr::copy_nonoverlapping(src.as_ptr(), dst as *mut u8, src.len()) };
        Ok(())
    }

    unsafe fn copy_to_host(&self, dst: &mut [u8], src: u64) -> BackendResult<()> {
        // SAFETY: the caller guarantees `src..src+len` is mapped memory of this backend.
        unsafe { ptr::copy_nonoverlapping(src as *const u8, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    unsafe fn copy_unit(
        &self,
        copy: &RawCopy,
        mover: Mover,
    ) -> BackendResult<Box<dyn super::Fence>> {
        // SAFETY: the caller's contract (copy_unit's) covers the call, which finishes here.
        unsafe { host_copy("copy_unit", copy, mover) }?;
        Ok(Box::new(Passed))
    }

    unsafe fn copy_on(
        &self,
        copy: &RawCopy,
        mover: Mover,
        _stream: super::RawStream,
    ) -> BackendResult<()> {
        // SAFETY: as in copy_unit; host copies are synchronous.
        unsafe { host_copy("copy_on", copy, mover) }
    }

    fn fence(&self, _stream: super::RawStream) -> BackendResult<Box<dyn super::Fence>> {
        Ok(Box::new(Passed))
    }

    unsafe fn fill(&self, dst: u64, bytes: usize, pattern: u32) -> BackendResult<()> {
        // SAFETY: the caller guarantees `dst..dst+bytes` is mapped memory of this backend.
        let buf = unsafe { std::slice::from_raw_parts_mut(dst as *mut u8, bytes) };
        reference::fill(buf, pattern);
        Ok(())
    }

    unsafe fn chunk_hash(
        &self,
        src: u64,
        bytes: usize,
        chunk_bytes: usize,
    ) -> BackendResult<Vec<u64>> {
        kernels::check_chunk_hash_args(src, bytes, chunk_bytes).map_err(|reason| {
            BackendError::Invalid {
                op: "chunk_hash",
                reason,
            }
        })?;
        // SAFETY: the caller guarantees `src..src+bytes` is mapped memory of this backend.
        let data = unsafe { std::slice::from_raw_parts(src as *const u8, bytes) };
        Ok(reference::chunk_hash(data, chunk_bytes))
    }

    fn kv_kernels(&self) -> &dyn KvKernels {
        self
    }
}

impl KvKernels for HostBackend {
    /// Runs the op synchronously from its host lists, as [`KvKernels::kv`] does.
    unsafe fn kv_on(
        &self,
        op: &KvOp<'_>,
        _stream: super::RawStream,
        _index: u64,
    ) -> BackendResult<()> {
        // SAFETY: `kv_on`'s contract includes `kv`'s.
        unsafe { self.kv(op) }
    }

    /// Runs the Rust reference of the kernel ([`crate::kernels::kv::reference`]) on the memory itself.
    unsafe fn kv(&self, op: &KvOp<'_>) -> BackendResult<()> {
        op.check().map_err(|e| kv_invalid(op, e))?;
        let c = *op.cache();
        // SAFETY: the caller guarantees that the blocks the call touches are mapped and
        // untouched by others; the reference reads and writes only those (the checks above
        // keep every offset below `c.bytes()`, which fits usize), and `check` rejected
        // buffers overlapping the cache, so no slice made below aliases it.
        let cache = &mut unsafe { RawCache::new(c.base, c.bytes() as usize) };
        let l = &c.layout;
        // Every `span` / `span_mut` below relies on the caller's guarantee that the op's
        // spans are mapped memory of this backend that nothing else touches during the call;
        // only the written spans are made mutable, and they overlap neither the cache nor
        // each other (an op has at most one written span).
        let result = match *op {
            KvOp::Write {
                layer,
                keys,
                values,
                tokens,
                token_stride_bytes,
                slot_mapping,
                ..
            } => {
                // SAFETY: `keys` is a mapped span of the caller's, read only (see above).
                let keys = unsafe { span(keys.addr, keys.len) };
                // SAFETY: `values` likewise.
                let values = unsafe { span(values.addr, values.len) };
                kv_reference::write(
                    cache,
                    l,
                    layer,
                    keys,
                    values,
                    tokens,
                    token_stride_bytes,
                    slot_mapping,
                )
            }
            KvOp::Gather {
                layer,
                kv,
                block_table,
                tokens,
                out,
                ..
            } => {
                // SAFETY: `out` is the op's one written span, overlapping nothing (see above).
                let out = unsafe { span_mut(out.addr, out.len) };
                kv_reference::gather(cache, l, layer, kv, block_table, tokens, out)
            }
            KvOp::CopyBlocks { pairs, .. } => kv_reference::copy_blocks(cache, l, pairs),
            KvOp::SwapOut { blocks, host, .. } => {
                // SAFETY: `host` is the op's one written span, overlapping nothing (see above).
                let host = unsafe { span_mut(host.addr, host.len) };
                kv_reference::swap_out(cache, l, blocks, host)
            }
            KvOp::SwapIn { blocks, host, .. } => {
                // SAFETY: `host` is a mapped span of the caller's, read only (see above).
                let host = unsafe { span(host.addr, host.len) };
                kv_reference::swap_in(cache, l, blocks, host)
            }
        };
        result.map_err(|e| kv_invalid(op, e))
    }
}

/// The cache as raw memory for the references: every access forms a slice over exactly the
/// bytes it moves, so blocks that are not mapped (an elastic region's unbacked chunks) are
/// never referenced.
struct RawCache {
    base: u64,
    len: usize,
}

impl RawCache {
    /// # Safety
    /// Every range of `base..base + len` the references access through it must be mapped,
    /// writable memory that nothing else accesses while it lives.
    unsafe fn new(base: u64, len: usize) -> Self {
        RawCache { base, len }
    }

    fn at(&self, off: usize) -> *mut u8 {
        (self.base as usize + off) as *mut u8
    }
}

impl kv_reference::CacheBytes for RawCache {
    fn len(&self) -> usize {
        self.len
    }
    fn read(&self, off: usize, dst: &mut [u8]) {
        debug_assert!(off + dst.len() <= self.len);
        // SAFETY: `new`'s contract: the accessed range is mapped; `dst` is a distinct slice
        // (buffers never overlap the cache).
        unsafe { ptr::copy_nonoverlapping(self.at(off), dst.as_mut_ptr(), dst.len()) };
    }
    fn write(&mut self, off: usize, src: &[u8]) {
        debug_assert!(off + src.len() <= self.len);
        // SAFETY: as in `read`.
        unsafe { ptr::copy_nonoverlapping(src.as_ptr(), self.at(off), src.len()) };
    }
    fn copy_within(&mut self, src: usize, dst: usize, len: usize) {
        debug_assert!(src.max(dst) + len <= self.len);
        // SAFETY: as in `read`; `ptr::copy` allows overlapping ranges.
        unsafe { ptr::copy(self.at(src), self.at(dst), len) };
    }
}

/// `len` bytes at `addr` as a slice (empty when `len` is 0, whatever `addr` is).
///
/// # Safety
/// `addr..addr+len` must be readable memory that nothing writes while the slice lives.
unsafe fn span<'a>(addr: u64, len: usize) -> &'a [u8] {
    if len == 0 {
        return &[];
    }
    // SAFETY: the caller's contract; `len > 0`, so `addr` is a real address.
    unsafe { std::slice::from_raw_parts(addr as *const u8, len) }
}

/// `len` bytes at `addr` as a mutable slice (empty when `len` is 0).
///
/// # Safety
/// `addr..addr+len` must be writable memory that nothing else accesses while the slice
/// lives.
unsafe fn span_mut<'a>(addr: u64, len: usize) -> &'a mut [u8] {
    if len == 0 {
        return &mut [];
    }
    // SAFETY: the caller's contract; `len > 0`, so `addr` is a real address.
    unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, len) }
}

#[cfg(test)]
mod capacity_tests {
    use super::*;

    #[test]
    fn a_capacity_above_the_machine_s_memory_is_refused() {
        assert!(check_capacity("8G", 8 << 30, 16 << 30).is_ok());
        let e = check_capacity("1T", 1 << 40, 16 << 30)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("GPU_PAGER_HOST_CAPACITY=1T") && e.contains("at most half"),
            "{e}"
        );
    }

    #[test]
    fn a_capacity_below_one_chunk_or_not_a_count_is_refused_in_words() {
        let g = 2 << 20;
        assert_eq!(capacity_from("8G", g, 16 << 30).unwrap(), 8 << 30);
        assert_eq!(
            capacity_from("5M", g, 16 << 30).unwrap(),
            4 << 20,
            "whole chunks"
        );
        for (asked, words) in [
            ("1", "less than one chunk of 2 MiB"),
            ("1M", "ask for at least 2M"),
            ("lots", "is not a byte count"),
        ] {
            let e = capacity_from(asked, g, 16 << 30).unwrap_err().to_string();
            assert!(e.contains(words), "{asked}: {e}");
            assert!(
                e.starts_with("invalid argument to the setting GPU_PAGER_HOST_CAPACITY: "),
                "{e}"
            );
        }
        let long = "9".repeat(100_000) + "x";
        let e = capacity_from(&long, g, 16 << 30).unwrap_err().to_string();
        assert!(
            e.len() < 300,
            "a long value is not echoed whole: {} bytes",
            e.len()
        );
    }

    #[test]
    fn zeroed_memory_is_an_option_not_an_abort() {
        assert_eq!(zeroed(3), Some(vec![0, 0, 0]));
        assert_eq!(zeroed(0), None);
        assert_eq!(zeroed(usize::MAX / 2), None);
    }

    #[test]
    fn byte_counts_parse() {
        assert_eq!(parse_bytes("1073741824"), Some(1 << 30));
        assert_eq!(parse_bytes("8G"), Some(8 << 30));
        assert_eq!(parse_bytes("512m"), Some(512 << 20));
        assert_eq!(parse_bytes("64KiB"), Some(64 << 10));
        assert_eq!(parse_bytes(" 2 GB "), Some(2 << 30));
        assert_eq!(parse_bytes("1T"), Some(1 << 40));
        assert_eq!(parse_bytes(" 256 MiB "), Some(256 << 20));
        assert_eq!(parse_bytes("1KB"), Some(1024));
        assert_eq!(parse_bytes("1.5G"), Some(3 << 29));
        for bad in [
            "",
            "G",
            "0",
            "-1G",
            "lots",
            "12 apples",
            "99999999999999999999T",
        ] {
            assert_eq!(parse_bytes(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn the_default_fits_the_machine() {
        let c = HostConfig::default();
        assert!(c.capacity <= MAX_DEFAULT_CAPACITY);
        assert!(c.capacity <= physical_memory() / 2 || c.capacity == c.granularity);
        assert_eq!(c.capacity % c.granularity, 0);
    }
}
