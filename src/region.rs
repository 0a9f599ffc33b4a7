//! One tagged region: a virtual address range reserved once, the physical chunks mapped into
//! it while resident, its sub-allocator, and its pinned host backup.
//!
//! The region performs the steps of a move; [`crate::Pager`] orders them across the regions
//! of one call so that each call is all or nothing.

use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::backend::{
    Backend, BackendError, DeferredErrors, Fence, Mapping, RawStream, Reservation,
};
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

/// Describes a region's policy and size for error messages ([`Error::TagConflict`]).
pub(crate) fn describe(policy: Policy, bytes: usize, elastic: bool) -> String {
    let elastic = if elastic { "elastic " } else { "" };
    format!("{elastic}{policy:?} with {bytes} bytes")
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
    /// Map physical chunks only where asked ([`crate::Pager::back`]) and give them back
    /// with [`crate::Pager::trim`], instead of mapping the whole region while resident (a
    /// paged KV cache). The region is created, and resumed, with nothing mapped. Only for
    /// [`Policy::Discard`] and [`Policy::DiscardZeroed`].
    pub elastic: bool,
    /// Physical chunk size for this region instead of [`crate::PagerConfig::chunk_bytes`],
    /// rounded the same way (up to the granularity and to a power of two). Elastic regions
    /// map and unmap whole chunks, so smaller chunks follow their use more closely.
    pub chunk_bytes: Option<usize>,
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
    /// Whether chunks are mapped only where backed ([`RegionOptions::elastic`]).
    pub elastic: bool,
    /// Identity of the region: unique among the regions a pager ever created, so a region
    /// removed and created again under the same tag has a new id.
    pub id: u64,
    /// Releases that changed the region so far (see [`crate::Pager::releases`]).
    pub releases: u64,
}

/// Per-region statistics.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegionStats {
    /// The region.
    pub info: RegionInfo,
    /// Physical bytes mapped now (for an elastic region: its backed chunks).
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
    /// Unique among the pager's regions, never reused (see [`RegionInfo::id`]).
    pub id: u64,
    pub tag: String,
    pub policy: Policy,
    pub chunk_bytes: usize,
    /// Chunks are mapped on demand (`back`/`trim`), not all at once.
    pub elastic: bool,
    /// Releases that changed this region (a KV cache invalidates its block ids on a change).
    pub releases: u64,
    /// Entry `i` is chunk `i` (see `chunk_range`), `None` unmapped. Each mapping holds the
    /// reservation, so the range is freed only after the last one is unmapped.
    mappings: Vec<Option<Box<dyn Mapping>>>,
    reservation: Arc<dyn Reservation>,
    /// Pinned host copy; kept across cycles once allocated.
    backup: Backup,
    pub state: State,
    /// After `resume_on`: the restore copies still in flight on the caller's stream.
    pending: Option<std::sync::Arc<dyn Fence>>,
    pub alloc: SubAllocator,
    pub leases: usize,
    pub last_release: Option<RegionReport>,
    pub last_resume: Option<RegionReport>,
    /// The backend's sink, for failures that cannot be returned (in `Drop`, in cleanup).
    errors: Arc<DeferredErrors>,
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
            self.errors
                .record(format!("dropping region `{}`: {e}", self.tag));
        }
    }
}

/// Splits `size` into chunks of `chunk` bytes, the last one shorter: how a region of
/// `size` bytes is mapped (benchmarks use it to time the same pattern with bare VMM calls).
pub fn chunk_sizes(size: usize, chunk: usize) -> Vec<usize> {
    let mut out = vec![chunk; size / chunk];
    if size % chunk != 0 {
        out.push(size % chunk);
    }
    out
}

impl Region {
    /// Reserves the range and maps it, or, elastic, maps nothing (the region starts
    /// resident either way).
    pub fn create(
        backend: &dyn Backend,
        id: u64,
        tag: &str,
        size: usize,
        chunk_bytes: usize,
        policy: Policy,
        options: RegionOptions,
    ) -> Result<Region> {
        if options.elastic && policy == Policy::Preserve {
            return Err(Error::InvalidArgument {
                tag: tag.to_owned(),
                reason: "a Preserve region cannot be elastic (its backup covers the whole \
                         region); use Policy::Discard or Policy::DiscardZeroed, or elastic: false"
                    .to_owned(),
            });
        }
        let reservation = backend
            .reserve(size)
            .map_err(|e| Error::backend(tag, "reserving the address range", e))?;
        let chunks = size.div_ceil(chunk_bytes);
        let mut region = Region {
            id,
            tag: tag.to_owned(),
            policy,
            chunk_bytes,
            elastic: options.elastic,
            releases: 0,
            mappings: std::iter::repeat_with(|| None).take(chunks).collect(),
            reservation,
            backup: Backup::default(),
            state: State::Released,
            pending: None,
            alloc: SubAllocator::new(size),
            leases: 0,
            last_release: None,
            last_resume: None,
            errors: backend.deferred_errors().clone(),
        };
        if !region.elastic {
            region.map_all(backend)?;
            if policy == Policy::DiscardZeroed {
                region.zero(backend)?;
            }
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
            elastic: self.elastic,
            id: self.id,
            releases: self.releases,
        }
    }

    pub fn stats(&self) -> RegionStats {
        let resident = self.mapped_bytes();
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

    /// Bytes mapped now.
    pub fn mapped_bytes(&self) -> usize {
        self.mappings.iter().flatten().map(|m| m.len()).sum()
    }

    /// The byte range chunk `i` covers.
    fn chunk_range(&self, i: usize) -> Range<usize> {
        i * self.chunk_bytes..((i + 1) * self.chunk_bytes).min(self.size())
    }

    /// The chunks that share a byte with `range` (which lies inside the region).
    fn chunks_touching(&self, range: &Range<usize>) -> Range<usize> {
        if range.is_empty() {
            return 0..0;
        }
        range.start / self.chunk_bytes..range.end.div_ceil(self.chunk_bytes)
    }

    /// Errors with `OutOfRange` unless `range` lies inside the region (`start <= end`).
    pub fn check_range(&self, range: &Range<usize>) -> Result<()> {
        if range.start > range.end || range.end > self.size() {
            return Err(Error::OutOfRange {
                tag: self.tag.clone(),
                what: "region",
                offset: range.start,
                len: range.end.saturating_sub(range.start),
                size: self.size(),
            });
        }
        Ok(())
    }

    /// Whether every chunk sharing a byte with `range` (inside the region) is mapped.
    pub fn is_backed(&self, range: &Range<usize>) -> bool {
        self.mappings[self.chunks_touching(range)]
            .iter()
            .all(Option::is_some)
    }

    /// Maps every unmapped chunk (all of them while released). See `map_chunks`.
    pub fn map_all(&mut self, backend: &dyn Backend) -> Result<Duration> {
        let t = Instant::now();
        self.map_chunks(backend, 0..self.mappings.len())?;
        Ok(t.elapsed())
    }

    /// The contiguous runs of chunks among `chunks` that are mapped (`mapped`) or not.
    fn runs(&self, chunks: Range<usize>, mapped: bool) -> Vec<Range<usize>> {
        crate::runs::runs(chunks.filter(|&i| self.mappings[i].is_some() == mapped))
    }

    /// The byte range a non-empty run of chunks covers.
    fn bytes_of(&self, run: &Range<usize>) -> Range<usize> {
        self.chunk_range(run.start).start..self.chunk_range(run.end - 1).end
    }

    /// Maps the unmapped chunks among `chunks`, one backend call per contiguous run (a whole
    /// released region is one run: one access change over the whole range, the cheapest
    /// pattern). All or nothing: on failure what this call mapped is unmapped again.
    /// Returns the runs of chunks newly mapped.
    pub fn map_chunks(
        &mut self,
        backend: &dyn Backend,
        chunks: Range<usize>,
    ) -> Result<Vec<Range<usize>>> {
        let runs = self.runs(chunks, false);
        for (k, run) in runs.iter().enumerate() {
            let sizes: Vec<usize> = run.clone().map(|i| self.chunk_range(i).len()).collect();
            let offset = self.bytes_of(run).start;
            // SAFETY: the reservation is `backend`'s (the region's backend, which reserved
            // it); the run's chunks are unmapped (their entries are `None`, and every mapping
            // in the region has an entry).
            match unsafe { backend.map(&self.reservation, offset, &sizes) } {
                Ok(mapped) => {
                    for (slot, m) in self.mappings[run.clone()].iter_mut().zip(mapped) {
                        *slot = Some(m);
                    }
                }
                Err(e) => {
                    // Undo the runs mapped before this one, then report (free memory is
                    // measured after the undo).
                    for done in &runs[..k] {
                        self.unmap_chunks(done.clone());
                    }
                    return Err(self.map_error(backend, e));
                }
            }
        }
        Ok(runs)
    }

    /// Maps the unmapped chunks sharing a byte with `range` (inside the region) and, for
    /// `DiscardZeroed`, zero-fills them. All or nothing. Returns the bytes newly mapped.
    pub fn back(&mut self, backend: &dyn Backend, range: &Range<usize>) -> Result<usize> {
        let runs = self.map_chunks(backend, self.chunks_touching(range))?;
        if self.policy == Policy::DiscardZeroed {
            let zeroed = runs
                .iter()
                .try_for_each(|run| self.zero_range(backend, self.bytes_of(run)));
            if let Err(e) = zeroed {
                // A fill may still be queued on the device: wait before unmapping.
                if let Err(sync) = backend.synchronize() {
                    self.errors.record(format!(
                        "synchronize after a failed back of `{}` (the back's own error was \
                         returned): {sync}",
                        self.tag
                    ));
                }
                for run in &runs {
                    self.unmap_chunks(run.clone());
                }
                return Err(e);
            }
        }
        Ok(runs.iter().map(|run| self.bytes_of(run).len()).sum())
    }

    /// Unmaps the chunks `chunks` (those mapped). Returns the bytes given back. The caller
    /// has synchronized the device or knows nothing uses them.
    pub fn unmap_chunks(&mut self, chunks: Range<usize>) -> usize {
        self.mappings[chunks]
            .iter_mut()
            .filter_map(Option::take)
            .map(|m| m.len())
            .sum()
    }

    /// Unmaps every mapped chunk that shares no byte with any of `keep`. Returns the bytes
    /// given back. The caller has synchronized the device.
    pub fn trim(&mut self, keep: &[Range<usize>]) -> usize {
        // One pass over the keep ranges and one over the chunks: O(ranges + chunks).
        let mut kept = vec![false; self.mappings.len()];
        for k in keep {
            let k = k.start.min(self.size())..k.end.min(self.size());
            for i in self.chunks_touching(&k) {
                kept[i] = true;
            }
        }
        let mut bytes = 0;
        for (i, kept) in kept.into_iter().enumerate() {
            if !kept {
                bytes += self.unmap_chunks(i..i + 1);
            }
        }
        bytes
    }

    /// Zero-fills `range` (mapped, inside the region).
    pub fn zero_range(&self, backend: &dyn Backend, range: Range<usize>) -> Result<()> {
        // SAFETY: the caller passes a mapped range of this region.
        unsafe { backend.fill(self.base() + range.start as u64, range.len(), 0) }
            .map_err(|e| Error::backend(&self.tag, "zero-filling", e))
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
        debug_assert!(self.mappings.iter().all(Option::is_none));
        let sizes = chunk_sizes(self.size(), self.chunk_bytes);
        let first_group = if overlap { 1 } else { sizes.len() };
        let (mut first, mut group, mut offset) = (0, first_group, 0usize);
        let (mut map_time, mut copied) = (Duration::ZERO, 0);
        while first < sizes.len() {
            let last = (first + group).min(sizes.len());
            let bytes: usize = sizes[first..last].iter().sum();
            let t = Instant::now();
            // SAFETY: the reservation is `backend`'s; the span lies past everything mapped so
            // far (the region was wholly unmapped), so it is unmapped.
            let mapped = unsafe { backend.map(&self.reservation, offset, &sizes[first..last]) };
            map_time += t.elapsed();
            let mapped = mapped.map_err(|e| self.map_error(backend, e))?;
            for (slot, m) in self.mappings[first..last].iter_mut().zip(mapped) {
                *slot = Some(m);
            }
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

    /// Unmaps and releases every mapped chunk. Returns (bytes, time). The caller has
    /// synchronized the device, so a pending restore is over.
    pub fn unmap_all(&mut self) -> (usize, Duration) {
        self.pending = None;
        let t = Instant::now();
        let bytes = self.unmap_chunks(0..self.mappings.len());
        (bytes, t.elapsed())
    }

    /// Zero-fills every mapped chunk (the whole region right after `map_all`), one fill per
    /// contiguous run.
    pub fn zero(&self, backend: &dyn Backend) -> Result<Duration> {
        let t = Instant::now();
        for run in self.runs(0..self.mappings.len(), true) {
            self.zero_range(backend, self.bytes_of(&run))?;
        }
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
    /// backup holds its contents, see [`Backup::held`]) and counts the release.
    pub fn set_released(&mut self) {
        self.state = State::Released;
        self.releases += 1;
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
