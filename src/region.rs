//! One tagged region: a virtual address range reserved once, the physical chunks mapped into
//! it while resident, its sub-allocator, and its pinned host backup.
//!
//! The region performs the steps of a move; [`crate::Pager`] orders them across the regions
//! of one call so that each call is all or nothing.

use std::time::{Duration, Instant};

use crate::backend::{Backend, BackendError, Fence, Mapping, RawStream, Reservation};
use crate::backup::{Backup, Saved};
use crate::error::{Error, Result};
use crate::report::{RegionReport, Report};
use crate::suballoc::SubAllocator;

/// What happens to a region's contents across a release.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Policy {
    /// Copied to pinned host memory on release and restored bit-exact on resume (weights).
    Preserve,
    /// Dropped on release; the memory comes back uninitialised (KV cache).
    Discard,
    /// Dropped on release; the memory comes back zero-filled.
    DiscardZeroed,
}

/// Whether a region's physical memory is mapped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum State {
    /// Mapped: device addresses are backed by memory.
    Resident,
    /// Unmapped: the addresses stay reserved but nothing backs them.
    Released,
}

/// Options fixed when a region is created.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RegionOptions {
    /// Allocate the pinned host backup now (Preserve only), so the first release pays no
    /// pinning on its critical path.
    pub prepin: bool,
}

/// A public description of a region.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegionInfo {
    /// The tag.
    pub tag: String,
    /// First device address; never changes while the region exists.
    pub base: u64,
    /// Reserved bytes (the requested size rounded up to the granularity).
    pub size: usize,
    /// Physical chunk size (the last chunk may be smaller).
    pub chunk_bytes: usize,
    /// Contents policy.
    pub policy: Policy,
    /// Current state.
    pub state: State,
}

/// Per-region statistics.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegionStats {
    /// The region.
    pub info: RegionInfo,
    /// Physical bytes mapped now.
    pub resident_bytes: usize,
    /// Reserved bytes with nothing mapped (the whole region while released).
    pub released_bytes: usize,
    /// Bytes in live buffers.
    pub allocated_bytes: usize,
    /// Live buffers.
    pub buffers: usize,
    /// Pinned host backup held, in bytes.
    pub backup_bytes: usize,
    /// Live leases.
    pub leases: usize,
    /// The last release that changed this region.
    pub last_release: Option<RegionReport>,
    /// The last resume that changed this region.
    pub last_resume: Option<RegionReport>,
}

pub(crate) struct Region {
    pub tag: String,
    pub policy: Policy,
    pub chunk_bytes: usize,
    // Field order is drop order: mappings are unmapped and released before the reservation
    // frees the address range.
    mappings: Vec<Box<dyn Mapping>>,
    reservation: Box<dyn Reservation>,
    /// Pinned host copy; kept across cycles once allocated.
    backup: Backup,
    pub state: State,
    /// After `resume_on`: the restore copies still in flight on the caller's stream.
    pending: Option<std::sync::Arc<dyn Fence>>,
    pub alloc: SubAllocator,
    pub leases: usize,
    pub last_release: Option<RegionReport>,
    pub last_resume: Option<RegionReport>,
}

impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Region")
            .field("tag", &self.tag)
            .field("policy", &self.policy)
            .field("state", &self.state)
            .field("base", &format_args!("{:#x}", self.base()))
            .field("size", &self.size())
            .finish_non_exhaustive()
    }
}

impl Drop for Region {
    /// A restore enqueued by `resume_on` may still be copying from the backup into the
    /// mappings: wait for it before the fields (mappings, then the backup) are freed.
    fn drop(&mut self) {
        if let Err(e) = self.settle() {
            eprintln!("gpu-pager: dropping `{}`: {e}", self.tag);
        }
    }
}

/// Splits `size` into chunks of `chunk` bytes, the last one shorter.
pub(crate) fn chunk_sizes(size: usize, chunk: usize) -> Vec<usize> {
    let mut out = vec![chunk; size / chunk];
    if size % chunk != 0 {
        out.push(size % chunk);
    }
    out
}

impl Region {
    /// Reserves the range and maps it (the region starts resident).
    pub fn create(
        backend: &dyn Backend,
        tag: &str,
        size: usize,
        chunk_bytes: usize,
        policy: Policy,
        options: RegionOptions,
    ) -> Result<Region> {
        let reservation = backend
            .reserve(size)
            .map_err(|e| Error::backend(tag, "reserving the address range", e))?;
        let mut region = Region {
            tag: tag.to_owned(),
            policy,
            chunk_bytes,
            mappings: Vec::new(),
            reservation,
            backup: Backup::default(),
            state: State::Released,
            pending: None,
            alloc: SubAllocator::new(size),
            leases: 0,
            last_release: None,
            last_resume: None,
        };
        region.map_all(backend)?;
        if policy == Policy::DiscardZeroed {
            region.zero(backend)?;
        }
        region.state = State::Resident;
        if options.prepin && policy == Policy::Preserve {
            region.ensure_backup(backend)?;
        }
        Ok(region)
    }

    pub fn base(&self) -> u64 {
        self.reservation.base()
    }

    pub fn size(&self) -> usize {
        self.reservation.len()
    }

    pub fn info(&self) -> RegionInfo {
        RegionInfo {
            tag: self.tag.clone(),
            base: self.base(),
            size: self.size(),
            chunk_bytes: self.chunk_bytes,
            policy: self.policy,
            state: self.state,
        }
    }

    pub fn stats(&self) -> RegionStats {
        let resident: usize = self.mappings.iter().map(|m| m.len()).sum();
        RegionStats {
            info: self.info(),
            resident_bytes: resident,
            released_bytes: self.size() - resident,
            allocated_bytes: self.alloc.allocated_bytes(),
            buffers: self.alloc.count(),
            backup_bytes: self.backup.bytes(),
            leases: self.leases,
            last_release: self.last_release.clone(),
            last_resume: self.last_resume.clone(),
        }
    }

    pub fn is_resident(&self) -> bool {
        self.state == State::Resident
    }

    /// Errors with `NotResident` unless resident.
    pub fn require_resident(&self, op: &'static str) -> Result<()> {
        if self.is_resident() {
            Ok(())
        } else {
            Err(Error::NotResident {
                tag: self.tag.clone(),
                op,
            })
        }
    }

    /// The pager's error for a failed map of this region.
    fn map_error(&self, backend: &dyn Backend, e: BackendError) -> Error {
        match e {
            BackendError::OutOfMemory { requested } => Error::OutOfMemory {
                tag: self.tag.clone(),
                requested,
                free: backend.mem_info().map_or(0, |m| m.free),
            },
            e => Error::backend(&self.tag, "mapping physical memory", e),
        }
    }

    /// Maps every chunk with one backend call (one access change over the whole range, the
    /// cheapest pattern). On failure nothing stays mapped. Returns the time it took.
    pub fn map_all(&mut self, backend: &dyn Backend) -> Result<Duration> {
        debug_assert!(self.mappings.is_empty());
        let t = Instant::now();
        let sizes = chunk_sizes(self.size(), self.chunk_bytes);
        // SAFETY: the span is exactly this region's reservation, which nothing maps now
        // (mappings is empty while released).
        let mapped = unsafe { backend.map(self.base(), &sizes) };
        self.mappings = mapped.map_err(|e| self.map_error(backend, e))?;
        Ok(t.elapsed())
    }

    /// Maps the region and enqueues the restore of its backup, overlapping the two: chunks
    /// are mapped in groups of doubling size (1, 2, 4, … chunks, one backend call each), and
    /// each group's copy is enqueued before the next group is mapped. Without `overlap`, one
    /// group: map everything, then copy. Copies go on `stream`
    /// or the backend's own copy stream; the caller waits for them. On failure the caller
    /// must synchronize before unmapping (copies may be in flight). Returns (time spent
    /// mapping, bytes enqueued).
    pub fn map_and_restore(
        &mut self,
        backend: &dyn Backend,
        stream: Option<RawStream>,
        overlap: bool,
    ) -> Result<(Duration, usize)> {
        debug_assert!(self.mappings.is_empty());
        let sizes = chunk_sizes(self.size(), self.chunk_bytes);
        let first_group = if overlap { 1 } else { sizes.len() };
        let (mut first, mut group, mut offset) = (0, first_group, 0usize);
        let (mut map_time, mut copied) = (Duration::ZERO, 0);
        while first < sizes.len() {
            let last = (first + group).min(sizes.len());
            let bytes: usize = sizes[first..last].iter().sum();
            let t = Instant::now();
            // SAFETY: the span lies inside this region's reservation, past everything mapped
            // so far, so it is unmapped.
            let mapped = unsafe { backend.map(self.base() + offset as u64, &sizes[first..last]) };
            map_time += t.elapsed();
            self.mappings
                .extend(mapped.map_err(|e| self.map_error(backend, e))?);
            // SAFETY: the span was just mapped and stays mapped until the copies finish (the
            // caller waits, or synchronizes before unmapping on failure); release
            // synchronizes before it writes the backup again.
            copied += unsafe {
                self.backup
                    .restore_async(backend, self.base(), offset..offset + bytes, stream)
            }
            .map_err(|e| Error::backend(&self.tag, "restoring contents from the backup", e))?;
            offset += bytes;
            first = last;
            group *= 2;
        }
        Ok((map_time, copied))
    }

    /// Checks the restored contents against the backup's hashes (`verify_restore`).
    pub fn verify(&self, backend: &dyn Backend, hash_chunk: usize) -> Result<()> {
        // SAFETY: called after the restore finished, with the region mapped.
        let bad = unsafe { self.backup.verify(backend, self.base(), hash_chunk) }
            .map_err(|e| Error::backend(&self.tag, "verifying restored contents", e))?;
        match bad {
            None => Ok(()),
            Some(chunk) => Err(Error::Corrupted {
                tag: self.tag.clone(),
                offset: chunk * Backup::hash_chunk(self.backup.held(), hash_chunk),
            }),
        }
    }

    /// Unmaps and releases every chunk. Returns (bytes, time). The caller has synchronized
    /// the device, so a pending restore is over.
    pub fn unmap_all(&mut self) -> (usize, Duration) {
        self.pending = None;
        let t = Instant::now();
        let bytes = self.mappings.iter().map(|m| m.len()).sum();
        self.mappings.clear();
        (bytes, t.elapsed())
    }

    /// Zero-fills the whole region (must be mapped).
    pub fn zero(&self, backend: &dyn Backend) -> Result<Duration> {
        let t = Instant::now();
        // SAFETY: the whole reservation is mapped (called right after map_all).
        unsafe { backend.fill(self.base(), self.size(), 0) }
            .map_err(|e| Error::backend(&self.tag, "zero-filling", e))?;
        Ok(t.elapsed())
    }

    /// Allocates the pinned backup if there is none. Returns the time it took.
    pub fn ensure_backup(&mut self, backend: &dyn Backend) -> Result<Duration> {
        let size = self.size();
        self.backup
            .ensure(backend, size)
            .map_err(|e| Error::backend(&self.tag, "pinning the host backup", e))
    }

    /// Frees the pinned backup. Refused while released (it holds the contents).
    pub fn free_backup(&mut self) -> Result<usize> {
        if !self.is_resident() && self.backup.held() > 0 {
            return Err(Error::BackupInUse {
                tag: self.tag.clone(),
            });
        }
        Ok(self.backup.free())
    }

    /// Copies the live prefix of a resident Preserve region into the backup (which must
    /// exist), only the changed hash chunks when `skip_unchanged`. Does not change state.
    pub fn save(
        &mut self,
        backend: &dyn Backend,
        skip_unchanged: bool,
        hash_chunk: usize,
    ) -> Result<Saved> {
        let n = self.alloc.high_water();
        // SAFETY: the region is resident, so `base..base+n` (n <= size) is mapped, and the
        // pager holds its lock after a synchronize, so nothing writes it meanwhile (engine
        // kernels launched later are the caller's contract, as for any raw pointer).
        unsafe {
            self.backup
                .save(backend, self.base(), n, skip_unchanged, hash_chunk)
        }
        .map_err(|e| Error::backend(&self.tag, "copying contents to the host backup", e))
    }

    /// Marks the region released after its chunks were unmapped (a `Preserve` region's
    /// backup holds its contents, see [`Backup::held`]).
    pub fn set_released(&mut self) {
        self.state = State::Released;
    }

    /// Marks the region resident after its chunks were mapped and its contents restored
    /// (or, with `pending`, enqueued behind that fence).
    pub fn set_resident(&mut self, pending: Option<std::sync::Arc<dyn Fence>>) {
        self.state = State::Resident;
        self.pending = pending;
    }

    /// Waits for a restore enqueued by `resume_on` to finish, so that pager-mediated access
    /// (on other streams, or the host) sees the restored contents.
    pub fn settle(&mut self) -> Result<()> {
        if let Some(f) = &self.pending {
            f.wait().map_err(|e| {
                Error::backend(&self.tag, "waiting for a restore on the caller's stream", e)
            })?;
            self.pending = None;
        }
        Ok(())
    }
}

/// Records the per-region entries of a report on the regions (for stats).
pub(crate) fn remember(report: &Report, region: &mut Region) {
    if let Some(r) = report.region(&region.tag) {
        if r.outcome == crate::report::Outcome::Done {
            match report.op {
                crate::report::Move::Release => region.last_release = Some(r.clone()),
                crate::report::Move::Resume => region.last_resume = Some(r.clone()),
            }
        }
    }
}
