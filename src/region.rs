//! One tagged region: a virtual address range reserved once, the physical memory mapped into
//! it while resident, its sub-allocator, and its pinned host backup.
//!
//! Three kinds share one mechanism, a table of mappings by offset ([`Mapped`]):
//! - a **fixed** region maps its whole range, in chunks, while resident;
//! - an **elastic** region maps chunks only where asked ([`crate::Pager::back`], a paged KV
//!   cache) and maps nothing on resume;
//! - a **growing** region reserves a large range and maps exactly the
//!   memory under its live buffers: an allocation maps its buffer (one piece per chunk size),
//!   a free unmaps it, a release backs up and unmaps what is mapped, and a resume maps and
//!   restores exactly that again, at the same addresses.
//!
//! The region performs the steps of a move; [`crate::Pager`] orders them across the regions
//! of one call so that each call is all or nothing.

use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use std::collections::BTreeMap;

use crate::backend::{
    Backend, BackendError, BackendResult, DeferredErrors, DeviceRange, Fence, Reservation,
};
use crate::backup::{Backup, Media, Saved};
use crate::error::{Error, Result};
use crate::map_ahead;
use crate::mapped::{Mapped, pieces};
use crate::pump::{Pump, Sink};
use crate::ranges::{RangeSet, bridge};
use crate::report::{RegionReport, Report};
use crate::suballoc::{AllocError, SubAllocator};

mod backups;
mod early;
mod types;

pub(crate) use early::{EarlyUnmap, Unmapped};

pub use types::{Medium, Policy, RegionInfo, RegionKind, RegionOptions, RegionStats, State};

pub(crate) struct Region {
    /// Unique among the pager's regions, never reused (see [`RegionInfo::id`]).
    pub id: u64,
    pub tag: String,
    pub policy: Policy,
    /// Backup medium (Preserve regions).
    pub medium: Medium,
    /// The pager's media context, lent whole (the file medium's I/O).
    media: Arc<Media>,
    pub chunk_bytes: usize,
    pub kind: RegionKind,
    /// Pin each buffer's backup when it is allocated (growing `Preserve` with `prepin`).
    prepin: bool,
    /// Releases that changed this region (a KV cache invalidates its block ids on a change).
    releases: u64,
    /// Owned by one owner ([`crate::Pager::region_exclusive`], a KV cache), which removes
    /// it; a plain [`crate::Pager::remove`] is refused.
    exclusive: bool,
    /// What is mapped. Each mapping holds the reservation, so the range is freed only after
    /// the last one is unmapped.
    mapped: Mapped,
    reservation: Arc<dyn Reservation>,
    /// Pinned host copies by region offset, kept across cycles once allocated: one at 0
    /// for a fixed region, one per buffer for a growing one.
    backups: BTreeMap<usize, Backup>,
    /// Bytes of live buffers marked overwritten by the next update (region offsets): a
    /// release does not save them. Cleared where a buffer is freed.
    marks: RangeSet,
    state: State,
    /// The last release dropped the contents (`ReleaseOptions::drop`): the next resume
    /// zero-fills what it maps (or poisons it, see `PagerConfig::poison_discards`).
    zero_on_resume: bool,
    /// After `resume_on`: the restore copies still in flight on the caller's stream.
    pending: Option<std::sync::Arc<dyn Fence>>,
    alloc: SubAllocator,
    /// A growing region's buffers' lengths as asked for, by offset (the allocator holds
    /// them rounded up to the granularity): a buffer has one length wherever it is found.
    lens: BTreeMap<usize, usize>,
    leases: usize,
    last_release: Option<RegionReport>,
    last_resume: Option<RegionReport>,
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
            .field("kind", &self.kind)
            .finish_non_exhaustive()
    }
}

impl Drop for Region {
    /// A restore enqueued by `resume_on` may still be copying from the backup into the
    /// mappings: wait for it before the fields (mappings, then the backups) are freed.
    fn drop(&mut self) {
        if let Err(e) = self.settle() {
            self.errors
                .record(format!("dropping region `{}`: {e}", self.tag));
        }
    }
}

/// How a region is created.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Shape {
    /// Reserved bytes (a multiple of the granularity).
    pub size: usize,
    /// Chunk size (fixed, elastic) or largest piece (growing).
    pub chunk_bytes: usize,
}

impl Region {
    /// Reserves the range and maps it, or, elastic or growing, maps nothing (the region
    /// starts resident either way).
    pub fn create(
        backend: &dyn Backend,
        id: u64,
        tag: &str,
        shape: Shape,
        policy: Policy,
        options: RegionOptions,
        media: &Arc<Media>,
    ) -> Result<Region> {
        if options.kind == RegionKind::Elastic && policy == Policy::Preserve {
            return Err(Error::InvalidArgument {
                tag: Some(tag.to_owned()),
                reason: "a preserve region cannot be elastic (resuming an elastic region maps \
                         nothing, so there is nowhere to restore to); make it discard or \
                         discard-zeroed, or fixed or growing"
                    .to_owned(),
            });
        }
        let reservation = backend
            .reserve(shape.size)
            .map_err(|e| Error::backend(tag, "reserving the address range", e))?;
        let mut region = Region {
            id,
            tag: tag.to_owned(),
            policy,
            medium: options.medium,
            media: media.clone(),
            chunk_bytes: shape.chunk_bytes,
            kind: options.kind,
            prepin: options.prepin
                && options.kind == RegionKind::Growing
                && policy == Policy::Preserve,
            releases: 0,
            exclusive: false,
            mapped: Mapped::default(),
            reservation,
            backups: BTreeMap::new(),
            marks: RangeSet::default(),
            state: State::Released,
            zero_on_resume: false,
            pending: None,
            alloc: SubAllocator::new(shape.size),
            lens: BTreeMap::new(),
            leases: 0,
            last_release: None,
            last_resume: None,
            errors: backend.deferred_errors().clone(),
        };
        if !region.on_demand() {
            region.map_all(backend, "region creation")?;
            if policy == Policy::DiscardZeroed {
                region.zero(backend)?;
            }
        }
        region.state = State::Resident;
        if options.prepin && policy == Policy::Preserve && !region.growing() {
            region.pin(backend, 0, shape.size)?;
        }
        Ok(region)
    }

    pub fn base(&self) -> u64 {
        self.reservation.base()
    }

    /// Memory is mapped exactly under live buffers.
    pub fn growing(&self) -> bool {
        self.kind == RegionKind::Growing
    }

    /// Memory is mapped on demand, not all at once (elastic and growing regions).
    pub fn on_demand(&self) -> bool {
        self.kind != RegionKind::Fixed
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
            medium: self.medium,
            state: self.state,
            kind: self.kind,
            id: self.id,
            releases: self.releases,
        }
    }

    pub fn stats(&self) -> RegionStats {
        let resident = self.mapped_bytes();
        let wanted = if self.growing() {
            self.extents().iter().map(|e| e.len()).sum()
        } else {
            self.size()
        };
        RegionStats {
            info: self.info(),
            resident_bytes: resident,
            released_bytes: wanted - resident.min(wanted),
            allocated_bytes: self.alloc.allocated_bytes(),
            buffers: self.alloc.count(),
            backup_bytes: self.backup_bytes(),
            held_bytes: self.backups.values().map(Backup::held_bytes).sum(),
            marked_bytes: self.marks.bytes(),
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
    fn map_error(&self, backend: &dyn Backend, e: BackendError, during: &'static str) -> Error {
        map_error(&self.tag, backend, e, during)
    }

    /// Bytes mapped now.
    pub fn mapped_bytes(&self) -> usize {
        self.mapped.bytes()
    }

    /// The bytes the chunks sharing a byte with `range` cover (`range` inside the region).
    fn chunk_span(&self, range: &Range<usize>) -> Range<usize> {
        if range.is_empty() {
            return range.start..range.start;
        }
        let c = self.chunk_bytes;
        range.start / c * c..range.end.div_ceil(c).saturating_mul(c).min(self.size())
    }

    /// Errors with `InvalidArgument` for a reversed range (`start > end`) and with
    /// `OutOfRange` unless `range` lies inside the region.
    pub fn check_range(&self, range: &Range<usize>) -> Result<()> {
        if range.start > range.end {
            return Err(Error::reversed_range(&self.tag, range));
        }
        if range.end > self.size() {
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

    /// Whether every byte of `range` (inside the region) is mapped.
    pub fn is_backed(&self, range: &Range<usize>) -> bool {
        self.mapped.covers(range)
    }

    /// The byte range a growing region maps for a live allocation: the allocation itself
    /// (its offset and length are multiples of the granularity).
    fn extent(offset: usize, len: usize) -> Range<usize> {
        offset..offset + len
    }

    /// A growing region's live allocations, as the ranges mapped under them.
    fn extents(&self) -> Vec<Range<usize>> {
        self.alloc
            .live()
            .map(|a| Self::extent(a.offset, a.len))
            .collect()
    }

    /// What a resident region has mapped, at most: the whole range (fixed), the buffers'
    /// extents (growing), or nothing it maps by itself (elastic: `back` decides).
    fn wanted(&self) -> Vec<Range<usize>> {
        if self.growing() {
            self.extents()
        } else if self.on_demand() {
            Vec::new()
        } else {
            std::iter::once(0..self.size()).collect()
        }
    }

    /// Maps what the region wants and lacks (all of it while released; see `wanted`).
    pub fn map_all(&mut self, backend: &dyn Backend, during: &'static str) -> Result<Duration> {
        let t = Instant::now();
        let wanted = self.wanted();
        self.map_ranges(backend, &wanted, during)?;
        Ok(t.elapsed())
    }

    /// Maps the unmapped parts of `ranges`, in pieces cut at the chunk size, one backend
    /// call per gap (a whole released region is one gap: one access change over the whole
    /// range, the cheapest pattern). All or nothing: on failure what this call mapped is
    /// unmapped again. Returns the gaps newly mapped. `during` names the step for an
    /// out-of-memory error.
    fn map_ranges(
        &mut self,
        backend: &dyn Backend,
        ranges: &[Range<usize>],
        during: &'static str,
    ) -> Result<Vec<Range<usize>>> {
        let gaps: Vec<Range<usize>> = ranges.iter().flat_map(|r| self.mapped.gaps(r)).collect();
        for (k, gap) in gaps.iter().enumerate() {
            let sizes = pieces(gap, self.chunk_bytes);
            // SAFETY: the gap lies inside this region's reservation (from `wanted`, `back`
            // or an allocation, all inside it) and is unmapped (a gap of `mapped`, which
            // records every mapping of the region).
            match unsafe { backend.map(&self.reservation, gap.start, &sizes) } {
                Ok(maps) => self.mapped.insert(gap.start, maps),
                Err(e) => {
                    // Undo the gaps mapped before this one, then report (free memory is
                    // measured after the undo).
                    for done in &gaps[..k] {
                        self.mapped.remove_within(done);
                    }
                    return Err(self.map_error(backend, e, during));
                }
            }
        }
        Ok(gaps)
    }

    /// Maps the unmapped chunks sharing a byte with `range` (inside the region) and, for
    /// `DiscardZeroed`, zero-fills them. All or nothing. Returns the bytes newly mapped.
    pub fn back(&mut self, backend: &dyn Backend, range: &Range<usize>) -> Result<usize> {
        if self.growing() {
            return Err(Error::InvalidArgument {
                tag: Some(self.tag.clone()),
                reason: "a growing region maps memory under its buffers by itself; allocate \
                         buffers instead of backing ranges"
                    .to_owned(),
            });
        }
        let span = self.chunk_span(range);
        let gaps = self.map_ranges(backend, &[span], "back")?;
        self.zero_new(backend, &gaps)?;
        Ok(gaps.iter().map(Range::len).sum())
    }

    /// Zero-fills newly mapped `gaps` of a `DiscardZeroed` region; on failure unmaps them
    /// again (after waiting for the device).
    fn zero_new(&mut self, backend: &dyn Backend, gaps: &[Range<usize>]) -> Result<()> {
        if self.policy != Policy::DiscardZeroed {
            return Ok(());
        }
        let zeroed = gaps
            .iter()
            .try_for_each(|gap| self.zero_range(backend, gap.clone()));
        if let Err(e) = zeroed {
            // A fill may still be queued on the device: wait before unmapping.
            if let Err(sync) = backend.synchronize() {
                self.errors.record(format!(
                    "synchronize after a failed zero-fill of `{}` (the zero-fill's own error \
                     was returned): {sync}",
                    self.tag
                ));
            }
            for gap in gaps {
                self.mapped.remove_within(gap);
            }
            return Err(e);
        }
        Ok(())
    }

    /// Unmaps every mapping that shares no byte with any of `keep`. Returns the bytes given
    /// back. The caller has synchronized the device. A growing region keeps exactly its
    /// buffers mapped, so there is nothing to trim (0).
    pub fn trim(&mut self, keep: &[Range<usize>]) -> usize {
        if self.growing() {
            return 0;
        }
        self.mapped.remove_where(|m| {
            !keep
                .iter()
                .any(|k| k.start < m.end && m.start < k.end && k.start < k.end)
        })
    }

    /// Zero-fills `range` (mapped, inside the region).
    pub fn zero_range(&self, backend: &dyn Backend, range: Range<usize>) -> Result<()> {
        self.fill_range(backend, range, 0)
    }

    /// Fills a mapped range (region offsets) with the 32-bit `pattern` repeated.
    fn fill_range(&self, backend: &dyn Backend, range: Range<usize>, pattern: u32) -> Result<()> {
        // SAFETY: the caller passes a mapped range of this region.
        unsafe { backend.fill(self.base() + range.start as u64, range.len(), pattern) }
            .map_err(|e| Error::backend(&self.tag, "filling", e))
    }

    /// A growing region's new buffer `offset .. offset + len` (granularity-aligned): maps it
    /// while resident (zero-filled for `DiscardZeroed`) and pins its backup with `prepin`.
    /// All or nothing: on failure nothing stays mapped or pinned for it, and the caller
    /// frees the allocation.
    pub fn map_buffer(&mut self, backend: &dyn Backend, offset: usize, len: usize) -> Result<()> {
        let extent = Self::extent(offset, len);
        if !self.is_resident() {
            return Ok(());
        }
        let gaps = self.map_ranges(backend, std::slice::from_ref(&extent), "alloc")?;
        self.zero_new(backend, &gaps)?;
        if self.prepin
            && let Err(e) = self.pin(backend, offset, len)
        {
            self.backups.remove(&offset);
            self.mapped.remove_within(&extent);
            return Err(e);
        }
        Ok(())
    }

    /// A growing region's buffer `offset .. offset + len` was freed: unmaps it and drops
    /// its backup. Waits for the device first, so that no queued work still uses it.
    pub fn unmap_buffer(&mut self, backend: &dyn Backend, offset: usize, len: usize) -> Result<()> {
        let extent = Self::extent(offset, len);
        if self.mapped.any_within(&extent) {
            backend
                .synchronize()
                .map_err(|e| Error::backend(&self.tag, "waiting for device work", e))?;
            self.mapped.remove_within(&extent);
        }
        self.backups.remove(&offset);
        Ok(())
    }

    /// Copies region bytes `range` from the backup that validly holds all of them into
    /// `out`; returns whether one did (an unreadable file backup is an error).
    pub fn read_backup(
        &self,
        range: Range<usize>,
        out: &mut [u8],
    ) -> Result<bool, crate::backend::BackendError> {
        match backup_at(&self.backups, range.start) {
            Some((start, b)) => b.read(range.start - start..range.end - start, out),
            None => Ok(false),
        }
    }

    /// Forgets everything kept for the buffer at `offset .. offset + len` (its allocation)
    /// once it is freed: its marks (a new buffer there starts unmarked).
    fn forget_buffer(&mut self, offset: usize, len: usize) {
        self.marks.remove(offset..offset + len);
        self.lens.remove(&offset);
    }

    /// A new buffer of `bytes` with identity `id`: sub-allocates `want` bytes (`bytes`, or
    /// rounded up to the granularity in a growing region) aligned to `align` and, in a
    /// growing region, maps them. Returns its offset. All or nothing.
    pub fn add_buffer(
        &mut self,
        backend: &dyn Backend,
        bytes: usize,
        want: usize,
        align: usize,
        id: u64,
    ) -> Result<usize> {
        let a = self.alloc.alloc(want, align, id).map_err(|e| match e {
            AllocError::Invalid(reason) if bytes == 0 => Error::InvalidSize {
                tag: self.tag.clone(),
                reason,
            },
            AllocError::Invalid(reason) => Error::InvalidArgument {
                tag: Some(self.tag.clone()),
                reason,
            },
            AllocError::Full { free } => Error::RegionFull {
                tag: self.tag.clone(),
                requested: bytes,
                align,
                free,
            },
            AllocError::Stale => Error::Internal {
                tag: Some(self.tag.clone()),
                reason: "the allocator answered a fresh allocation as stale".to_owned(),
            },
        })?;
        if self.growing() {
            if let Err(e) = self.map_buffer(backend, a.offset, a.len) {
                let _ = self.alloc.free(a.offset, id);
                return Err(e);
            }
            self.lens.insert(a.offset, bytes);
        }
        Ok(a.offset)
    }

    /// Frees the buffer at `offset` with identity `id`: in a growing region, after the
    /// device's work on it, unmaps its memory first. `StaleBuffer` unless it is live.
    pub fn remove_buffer(&mut self, backend: &dyn Backend, offset: usize, id: u64) -> Result<()> {
        let tag = self.tag.clone();
        let stale = || Error::StaleBuffer { tag, id, offset };
        let len = match self.alloc.get(offset) {
            Some(a) if a.id == id => a.len,
            _ => return Err(stale()),
        };
        if self.growing() {
            self.settle()?;
            self.unmap_buffer(backend, offset, len)?;
        }
        self.alloc.free(offset, id).map_err(|_| stale())?;
        self.forget_buffer(offset, len);
        Ok(())
    }

    /// Whether the buffer at `offset` with identity `id` is live.
    pub fn is_live(&self, offset: usize, id: u64) -> bool {
        self.alloc.is_live(offset, id)
    }

    /// The allocated extent of the live buffer at `offset` with identity `id` (a growing
    /// region's buffers are rounded up to the granularity), if it is live.
    pub fn extent_of(&self, offset: usize, id: u64) -> Option<usize> {
        self.alloc.get(offset).filter(|a| a.id == id).map(|a| a.len)
    }

    /// The live buffer containing region offset `at`: its offset, identity and length as
    /// asked for (`None` in free space or in a buffer's padding).
    pub fn buffer_at(&self, at: usize) -> Option<(usize, u64, usize)> {
        let a = self.alloc.live_containing(at)?;
        let len = self.lens.get(&a.offset).copied().unwrap_or(a.len);
        (at - a.offset < len).then_some((a.offset, a.id, len))
    }

    /// Whether it is owned by one owner, which removes it (see the field).
    pub fn exclusive(&self) -> bool {
        self.exclusive
    }

    /// Makes the region owned by one owner, or not.
    pub fn set_exclusive(&mut self, on: bool) {
        self.exclusive = on;
    }

    /// Live leases.
    pub fn leases(&self) -> usize {
        self.leases
    }

    /// Takes a lease (the region stays resident until it is given back).
    pub fn lease(&mut self) {
        self.leases += 1;
    }

    /// Gives a lease back.
    pub fn unlease(&mut self) {
        self.leases = self.leases.saturating_sub(1);
    }

    /// Releases that changed the region so far.
    pub fn releases(&self) -> u64 {
        self.releases
    }

    /// Whether the last release dropped the contents (the next resume fills what it maps).
    pub fn zero_on_resume(&self) -> bool {
        self.zero_on_resume
    }

    /// Maps the region and sends the restore of its backups to `sink`, overlapping the two:
    /// the ranges to map (the whole region, or the buffers of a growing one, cut at the
    /// chunk size; of a resident region, only what is unmapped of them: what a failed
    /// release had unmapped already) are mapped run by run, a run being ranges that lie
    /// back to back (a growing region's buffers usually do), in groups of doubling size
    /// ([`map_ahead::plan`]: one backend call and one access change per group, not per
    /// buffer), and each group's copies are pushed as soon as it is mapped. With `overlap`
    /// the groups are mapped ahead on a helper thread while this thread keeps the sink's
    /// movers fed ([`map_ahead::map_in_order`]). Every piece keeps its own physical handle,
    /// so that freeing one buffer later unmaps only its own. Without `overlap`, or with
    /// nothing to restore in the run (marked overwritten at the release), the run is
    /// mapped whole, then copied. The region stays borrowed by the sink until the copies
    /// have finished (a pump's scope waits for them; a stream sink's caller keeps a fence).
    /// On failure what this call handed to the sink stays mapped: the caller unmaps it once
    /// the copies are over (after the pump's scope returns, or a synchronize). Returns (time
    /// this thread spent mapping or waiting for mappings, bytes sent).
    ///
    /// Why runs: a map call made while copies run costs many times what it costs on an idle
    /// device, so a growing region of hundreds of buffers mapped one call per buffer makes
    /// the resume wait for its mapping.
    pub fn map_and_restore<'s, 'e, 'h>(
        &'h mut self,
        backend: &dyn Backend,
        sink: &mut Sink<'s, 'e, 'h>,
        overlap: bool,
    ) -> Result<(Duration, usize)> {
        // All of it for a released region; what a failed release had unmapped already for
        // a resident one.
        let wanted: Vec<Range<usize>> = self
            .wanted()
            .iter()
            .flat_map(|r| self.mapped.gaps(r))
            .collect();
        let base = self.base();
        // The backups are lent to the sink for `'h`; the mappings stay ours to extend.
        let Region {
            mapped,
            backups,
            reservation,
            chunk_bytes,
            tag,
            ..
        } = self;
        let backups: &'h BTreeMap<usize, Backup> = backups;
        let tag: &str = tag;
        let groups = map_ahead::plan(&wanted, *chunk_bytes, overlap, |r| {
            restores_into(backups, r)
        });
        let ahead = overlap && groups.iter().any(|g| g.restores);
        let mut copied = 0;
        // The sink's lifetimes are named: closures over elided ones are generic in them,
        // which compilers before 1.94 cannot prove outlive the backups' borrow.
        let restore =
            |sink: &mut Sink<'s, 'e, 'h>, g: &map_ahead::Group, maps: BackendResult<_>| {
                let maps = maps.map_err(|e| map_error(tag, backend, e, "resume"))?;
                mapped.insert(g.offset, maps);
                if !g.restores {
                    return Ok(());
                }
                let span = g.span();
                // One restore per range of the run that the group covers: the whole group for
                // a fixed region (the pump cuts it into whole units), a buffer or part of one
                // for a growing region (one backup holds it).
                for r in &wanted[g.run.clone()] {
                    let part = r.start.max(span.start)..r.end.min(span.end);
                    if part.is_empty() {
                        continue;
                    }
                    // SAFETY: the part was just mapped, and the caller unmaps nothing before the
                    // copies are over (see above); release synchronizes before it writes the
                    // backup again, and the backups are borrowed for `'h`.
                    copied += unsafe { restore_range(backups, backend, base, tag, part, sink) }?;
                }
                Ok(())
            };
        let feed = |sink: &mut Sink<'s, 'e, 'h>| {
            sink.poll()
                .map_err(|e| Error::backend(tag, "restoring contents from the backup", e))
        };
        // SAFETY: the groups lie inside this region's reservation (they cover the wanted
        // ranges, which lie inside the region), and are unmapped (gaps of `mapped`, which
        // records every mapping of the region; nothing else maps into its reservation).
        let map_time = unsafe {
            map_ahead::map_in_order(backend, reservation, &groups, ahead, sink, feed, restore)
        }?;
        Ok((map_time, copied))
    }

    /// Checks the restored contents against the backups' hashes (`verify_restore`).
    pub fn verify(&self, backend: &dyn Backend, hash_chunk: usize) -> Result<()> {
        for (&start, backup) in &self.backups {
            // SAFETY: called after the restore finished, with the region mapped; a backup's
            // held bytes lie inside the mapping they were saved from.
            let bad = unsafe { backup.verify(backend, self.base() + start as u64, hash_chunk) }
                .map_err(|e| Error::backend(&self.tag, "verifying restored contents", e))?;
            if let Some(offset) = bad {
                return Err(Error::Corrupted {
                    tag: self.tag.clone(),
                    offset: start + offset,
                });
            }
        }
        Ok(())
    }

    /// Unmaps and releases everything mapped, through `backend` (the region's). Returns
    /// (bytes, time). The caller has synchronized the device, so a pending restore is over.
    pub fn unmap_all(&mut self, backend: &dyn Backend) -> (usize, Duration) {
        self.pending = None;
        let t = Instant::now();
        let bytes = self.mapped.bytes();
        let mut maps = self.mapped.take_all();
        // SAFETY: the region's mappings are its backend's; the caller synchronized the
        // device, and nothing uses the memory any more (a release checked the leases; an
        // undone resume never handed the memory out).
        unsafe { backend.unmap_runs(&mut maps) };
        drop(maps);
        (bytes, t.elapsed())
    }

    /// Zero-fills everything mapped (the whole region right after `map_all`), one fill per
    /// contiguous run.
    pub fn zero(&self, backend: &dyn Backend) -> Result<Duration> {
        self.fill(backend, 0)
    }

    /// Fills everything mapped with the 32-bit `pattern` repeated, one fill per contiguous
    /// run.
    pub fn fill(&self, backend: &dyn Backend, pattern: u32) -> Result<Duration> {
        let t = Instant::now();
        for run in self.mapped.runs() {
            self.fill_range(backend, run, pattern)?;
        }
        Ok(t.elapsed())
    }

    /// Pinned backup bytes held.
    fn backup_bytes(&self) -> usize {
        self.backups.values().map(Backup::bytes).sum()
    }

    /// What a release saves, per backup: (the backup's region offset, the extent of the
    /// device range it covers, the byte ranges to save from that offset). A fixed region
    /// has one backup over the whole region, a growing one one per live buffer. The bytes
    /// to save are the live buffers' bytes less the marked ones; a gap of fewer than `gap`
    /// bytes between two such spans (marked bytes, or free space between buffers) is saved
    /// too, as one copy costs less than two.
    fn save_plan(&self, gap: usize) -> Vec<(usize, usize, Vec<Range<usize>>)> {
        if self.growing() {
            self.extents()
                .into_iter()
                .map(|e| {
                    let want = self.marks.gaps(&e);
                    let local = want.into_iter().map(|r| r.start - e.start..r.end - e.start);
                    (e.start, e.len(), bridge(local.collect(), gap))
                })
                .collect()
        } else {
            let want = self
                .alloc
                .live()
                .flat_map(|a| self.marks.gaps(&(a.offset..a.offset + a.len)))
                .collect();
            vec![(0, self.size(), bridge(want, gap))]
        }
    }

    /// Marks (`on`) or unmarks region bytes `range` as overwritten by the next update.
    pub fn set_marks(&mut self, range: Range<usize>, on: bool) {
        if on {
            self.marks.insert(range);
        } else {
            self.marks.remove(range);
        }
    }

    /// The marked parts of region bytes `range`.
    pub fn marks_within(&self, range: &Range<usize>) -> Vec<Range<usize>> {
        self.marks.within(range)
    }

    /// Whether any byte of `range` is marked overwritten. A backup over such bytes is not
    /// filled in one pass at the first release (that copies the whole extent): marked bytes
    /// are never copied out, so it is pinned, then saved through the pump.
    fn has_marks_within(&self, range: &Range<usize>) -> bool {
        !self.marks.within(range).is_empty()
    }

    /// Frees the pinned backups. Refused while released (they hold the contents).
    pub fn free_backup(&mut self) -> Result<usize> {
        if !self.is_resident() && self.backups.values().any(Backup::holds_any) {
            return Err(Error::BackupInUse {
                tag: self.tag.clone(),
            });
        }
        let freed = self.backup_bytes();
        self.backups.clear();
        Ok(freed)
    }

    /// Pushes the copies of the live, unmarked contents of a resident Preserve region into
    /// its backups (see `save_plan`; `ensure_backup` with the same `gap` must have pinned
    /// them) into `pump`, only the changed hash chunks when `skip_unchanged`. Each backup
    /// validly holds exactly what this save wanted of it once the caller calls
    /// [`Region::commit_saves`] after the pump's scope succeeded. Does not change state.
    ///
    /// With `early`, also returns an [`EarlyUnmap`] of the region's mappings: each backup
    /// that saves its whole device range (a growing region's unmarked buffer, a fixed
    /// region with no marks and no free space) has its range queued to be unmapped once its
    /// copies are done, and a step of it runs after each backup's pushes; the caller steps
    /// it on while it waits for the pump ([`Pump::drain`]). It comes back on failure too:
    /// what it unmapped is mapped and restored again by [`Region::commit_saves_within`] and
    /// [`Region::map_and_restore`].
    pub fn save<'h>(
        &'h mut self,
        backend: &dyn Backend,
        skip_unchanged: bool,
        hash_chunk: usize,
        gap: usize,
        early: bool,
        pump: &mut Pump<'_, 'h>,
    ) -> (Result<Saved>, Option<EarlyUnmap<'h>>) {
        let base = self.base();
        let mut plan: BTreeMap<usize, (usize, Vec<Range<usize>>)> = self
            .save_plan(gap)
            .into_iter()
            .map(|(start, len, want)| (start, (len, want)))
            .collect();
        if let Some((start, _)) = plan
            .iter()
            .find(|(start, (_, want))| !want.is_empty() && !self.backups.contains_key(start))
        {
            let e = Error::backend(
                &self.tag,
                "copying contents to the host backup",
                BackendError::Internal {
                    op: "save",
                    reason: format!("no backup pinned at offset {start}"),
                },
            );
            return (Err(e), None);
        }
        let Region {
            backups,
            tag,
            mapped,
            ..
        } = self;
        let mut unmap = early.then(|| EarlyUnmap::new(mapped));
        let mut out = Saved::default();
        // Every backup at once (each lent to the pump for `'h`): those the plan does not
        // name (freed buffers) are left alone.
        for (&start, backup) in backups.iter_mut() {
            let Some((len, want)) = plan.remove(&start) else {
                continue;
            };
            // SAFETY: the region is resident, so the backup's device range (the whole fixed
            // region, or a live buffer of a growing one) is mapped, and the pager holds its
            // lock after a synchronize until the pump's scope has returned, so nothing
            // writes it meanwhile (engine kernels launched later are the caller's contract,
            // as for any raw pointer) and only `unmap` unmaps it, once the pump has done
            // these pushes; the pump runs on `backend`.
            let saved = unsafe {
                backup.save(
                    backend,
                    base + start as u64,
                    len,
                    &want,
                    skip_unchanged,
                    hash_chunk,
                    pump,
                )
            }
            .map_err(|e| Error::backend(tag, "copying contents to the host backup", e));
            let saved = match saved {
                Ok(saved) => saved,
                Err(e) => return (Err(e), unmap),
            };
            out.copied += saved.copied;
            out.hash += saved.hash;
            if let Some(u) = &mut unmap {
                if want.len() == 1 && want[0] == (0..len) {
                    u.after(start..start + len, pump.pushes());
                }
                u.step(pump.pushes_done());
            }
        }
        (Ok(out), unmap)
    }

    /// The whole region's memory to unmap at once while a release copies other regions'
    /// (a region whose contents the release drops or never keeps).
    pub fn early_unmap_all(&mut self) -> EarlyUnmap<'_> {
        let all = 0..self.size();
        let mut unmap = EarlyUnmap::new(&mut self.mapped);
        unmap.after(all, 0);
        unmap
    }

    /// Commits the last save of each backup that starts at one of `extents` (their copies
    /// finished although the release failed later), so that they restore what was saved.
    pub fn commit_saves_within(&mut self, extents: &[Range<usize>]) {
        for e in extents {
            if let Some(b) = self.backups.get_mut(&e.start) {
                b.commit();
            }
        }
    }

    /// Makes the contents of the last save the backups', once its copies have finished.
    pub fn commit_saves(&mut self) {
        for backup in self.backups.values_mut() {
            backup.commit();
        }
    }

    /// Marks the region released after its memory was unmapped (a `Preserve` region's
    /// backups hold its contents) and counts the release.
    pub fn set_released(&mut self) {
        self.state = State::Released;
        self.releases += 1;
    }

    /// Forgets what the backups hold (a release dropped the contents for this cycle): the
    /// resume restores nothing and zero-fills what it maps, a `Discard` region excepted,
    /// whose memory comes back uninitialised as always. Host memory backups are given back.
    pub fn drop_contents(&mut self) {
        for b in self.backups.values_mut() {
            b.forget();
        }
        self.give_back_host_backups();
        self.zero_on_resume = self.policy != Policy::Discard;
    }

    /// Marks the region resident after its memory was mapped and its contents restored
    /// (or, with `pending`, enqueued behind that fence).
    pub fn set_resident(&mut self, pending: Option<std::sync::Arc<dyn Fence>>) {
        self.zero_on_resume = false;
        self.state = State::Resident;
        self.pending = pending;
    }

    /// Waits for a restore enqueued by `resume_on` to finish, so that pager-mediated access
    /// (on other streams, or the host) sees the restored contents.
    pub fn wait_pending(&self) -> Result<()> {
        if let Some(f) = &self.pending {
            f.wait().map_err(|e| {
                Error::backend(&self.tag, "waiting for a restore on the caller's stream", e)
            })?;
        }
        Ok(())
    }

    /// Waits for a restore enqueued by `resume_on` to finish and forgets its fence.
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

/// The pager's error for a failed map of region `tag`.
fn map_error(tag: &str, backend: &dyn Backend, e: BackendError, during: &'static str) -> Error {
    match e {
        BackendError::OutOfMemory { requested } => Error::OutOfMemory {
            tag: tag.to_owned(),
            during,
            requested,
            free: backend.mem_info().map_or(0, |m| m.free),
        },
        e => Error::backend(tag, "mapping physical memory", e),
    }
}

/// Sends the restore of region bytes `range` from the backup that holds them (of
/// `backups`, by region offset; bytes it does not hold are left as they are) to `sink`.
/// Returns the bytes sent.
///
/// # Safety
/// `base + range` is mapped memory of the region at `base`, as [`Backup::restore`] needs.
unsafe fn restore_range<'h>(
    backups: &'h BTreeMap<usize, Backup>,
    backend: &dyn Backend,
    base: u64,
    tag: &str,
    range: Range<usize>,
    sink: &mut Sink<'_, '_, 'h>,
) -> Result<usize> {
    let Some((start, backup)) = backup_at(backups, range.start) else {
        return Ok(0);
    };
    let local = range.start - start..range.end - start;
    // SAFETY: as this function's contract.
    unsafe { backup.restore(backend, base + start as u64, &[local], sink) }
        .map_err(|e| Error::backend(tag, "restoring contents from the backup", e))
}

/// The backup (of `backups`, by region offset) whose device range holds region byte `at`,
/// and its offset.
fn backup_at(backups: &BTreeMap<usize, Backup>, at: usize) -> Option<(usize, &Backup)> {
    backups
        .range(..=at)
        .next_back()
        .filter(|(start, b)| at < *start + b.extent())
        .map(|(&start, b)| (start, b))
}

/// Whether a backup validly holds any byte of region range `range` (a resume restores
/// something there).
fn restores_into(backups: &BTreeMap<usize, Backup>, range: &Range<usize>) -> bool {
    backup_at(backups, range.start).is_some_and(|(start, b)| {
        b.holds_within(&(range.start - start..range.end.saturating_sub(start)))
    })
}

/// Records the per-region entries of a report on the regions (for stats).
pub(crate) fn remember(report: &Report, region: &mut Region) {
    if let Some(r) = report.region(&region.tag)
        && r.outcome == crate::report::Outcome::Done
    {
        match report.op {
            crate::report::Move::Release => region.last_release = Some(r.clone()),
            crate::report::Move::Resume => region.last_resume = Some(r.clone()),
        }
    }
}
