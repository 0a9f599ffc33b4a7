//! The pager: regions by tag, release and resume of tag sets, buffers, leases and stats.
//!
//! Where each kind of call lives (the public ones are `Pager` methods; the work behind a
//! move is in free functions that this file calls by path):
//!
//! | calls | file |
//! |---|---|
//! | `new`, `with_config`, `release`, `resume`, `resume_on`, `lease`, `info`, `stats`, `back`/`trim` of elastic regions | this file |
//! | `for_device`, `configure` (one pager per device and process) | `registry.rs` |
//! | the settings table (`PagerConfig`, `SETTINGS`) | `pager/settings.rs` |
//! | tuning, release and resume options | `pager/config.rs` |
//! | `region`, `region_with`, `region_exclusive`, `remove` | `pager/create.rs` |
//! | `alloc`, `free`, `read`, `write`, `fill`, `hash`, `buffer_at`, `buffer_containing` | `pager/buffers.rs` |
//! | a move's steps: `moves::release`, `moves::resume` | `pager/moves.rs` |
//! | `add_companion`, `remove_companion`; `companions::run` | `pager/companions.rs` |
//! | `audit`; `audit::warn_if_resident` after a release | `pager/audit.rs` |
//! | `read_backup`, `backup_ptr` | `pager/backup_read.rs` |
//! | `set_overwritten`, `mark_overwritten`, `overwritten` | `pager/overwritten.rs` |

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};

use crate::backend::{Backend, BackendKind, RawStream};
use crate::backup::Media;
use crate::backup::file::BackupFiles;
use crate::error::{Error, Result, nearest_tag};
use crate::pump::{self, CopyRoute, PumpConfig};
use crate::region::{
    Medium, Policy, Region, RegionInfo, RegionKind, RegionOptions, RegionStats, Shape, State,
};
use crate::report::Report;

mod audit;
mod backup_read;
mod buffers;
mod companions;
mod config;
mod create;
mod moves;
mod overwritten;
mod settings;

use config::round_chunk;

pub use audit::{Audit, AuditRegion, RESIDENT_EVENT, RESIDENT_WARNING_BYTES};
pub use buffers::Buffer;
use buffers::stale;
pub use companions::{Companion, CompanionError};
pub use config::{
    DEFAULT_ALIGN, DEFAULT_CHUNK_BYTES, HOST_BUDGET_ENV, MAX_TAG_BYTES, POISON,
    POISON_DISCARDS_ENV, PREPIN_ENV, RECLAIM_SCRUBBED_ENV, ReleaseOptions, ResumeOptions, Tuning,
};
pub use settings::{PagerConfig, SETTINGS, Setting, SettingKind, SettingType, SettingValue};

/// Statistics of the whole pager.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stats {
    /// One entry per region, in tag order.
    pub regions: Vec<RegionStats>,
    /// Failures that no call could return (a driver or OS call from a `Drop`, a cleanup
    /// call on an error path), not yet taken with [`Pager::take_deferred_errors`], oldest
    /// first; at most [`crate::backend::DEFERRED_ERRORS_KEPT`] (the newest). Shared by
    /// every pager on the same backend. Each was also logged through the `log` crate.
    pub deferred_errors: Vec<String>,
    /// Such failures recorded since the backend was created, taken or not.
    pub deferred_errors_total: u64,
}

impl Stats {
    /// Physical bytes mapped over all regions.
    pub fn resident_bytes(&self) -> usize {
        self.regions.iter().map(|r| r.resident_bytes).sum()
    }
    /// Reserved-but-unmapped bytes over all regions.
    pub fn released_bytes(&self) -> usize {
        self.regions.iter().map(|r| r.released_bytes).sum()
    }
    /// Pinned host backup bytes over all regions.
    pub fn backup_bytes(&self) -> usize {
        self.regions.iter().map(|r| r.backup_bytes).sum()
    }
    /// The entry for `tag`.
    pub fn region(&self, tag: &str) -> Option<&RegionStats> {
        self.regions.iter().find(|r| r.info.tag == tag)
    }
}

/// One line for the pager, then one per region:
///
/// ```text
/// 2 regions: 1.00 GiB resident, 4.00 GiB released, 1.00 GiB backup
///   kv_cache     Discard          released        0 B mapped of 4.00 GiB, 0 buffers, 0 leases
///   weights      Preserve         resident   1.00 GiB mapped of 1.00 GiB, 291 buffers, 0 leases, backup 1.00 GiB
/// ```
impl std::fmt::Display for Stats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        use crate::report::bytes_h;
        write!(
            f,
            "{} region{}: {} resident, {} released, {} backup",
            self.regions.len(),
            if self.regions.len() == 1 { "" } else { "s" },
            bytes_h(self.resident_bytes()),
            bytes_h(self.released_bytes()),
            bytes_h(self.backup_bytes())
        )?;
        for r in &self.regions {
            let kind = match r.info.kind {
                RegionKind::Fixed => format!("{:?}", r.info.policy),
                k => format!("{k} {:?}", r.info.policy),
            };
            let state = match r.info.state {
                State::Resident => "resident",
                State::Released => "released",
            };
            write!(
                f,
                "\n  {:<12} {kind:<16} {state:<8} {:>10} mapped of {}, {} buffers, {} leases",
                r.info.tag,
                bytes_h(r.resident_bytes),
                bytes_h(r.info.size),
                r.buffers,
                r.leases
            )?;
            if r.backup_bytes > 0 {
                write!(f, ", backup {}", bytes_h(r.backup_bytes))?;
            }
        }
        Ok(())
    }
}

type Slot = Arc<Mutex<Region>>;

/// Owns tagged regions of device memory at stable addresses and moves them out of and back
/// into physical memory. `Send + Sync`: moves of different tags may run concurrently from
/// different threads; moves of one tag are serialised.
///
/// Raw device pointers obtained from [`Pager::ptr`] stay valid addresses forever but are
/// only backed by memory while the region is resident: dereferencing one after a release
/// (in a kernel, a copy, a graph replay) is the caller's responsibility. Use a [`Lease`] to
/// keep tags resident while such pointers are in use.
pub struct Pager {
    backend: Arc<dyn Backend>,
    config: PagerConfig,
    /// The backup directory and staging buffer of file backups.
    media: Arc<Media>,
    /// The process that made the pager: every call in another one (a fork) fails.
    pid: u32,
    regions: RwLock<BTreeMap<String, Slot>>,
    /// The same regions by base address, for [`Pager::buffer_at`]. Changed only while
    /// `regions` is write-locked (lock order: `regions`, then `by_base`, then a region).
    by_base: RwLock<BTreeMap<u64, Slot>>,
    /// The copies in flight on this device's link, per direction, over every call's pump
    /// (a fastest restore stays off the copy kernel while a release copies out).
    traffic: pump::Traffic,
    /// Work registered to move with tags ([`Pager::add_companion`]), in registration order.
    companions: RwLock<Vec<Arc<companions::Entry>>>,
}

impl std::fmt::Debug for Pager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pager")
            .field("backend", &self.backend.info().name)
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

/// A new identity for a region or a buffer, unique in the process: a [`Buffer`] of one pager
/// is never live in another (it is a [`Error::StaleBuffer`] there), even when two pagers
/// (one per device) hand out buffers at the same offsets.
fn next_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// Locks a mutex, recovering from poisoning: region state is updated only after each
/// fallible step succeeds, so a panic elsewhere cannot leave it half-changed.
fn lock(slot: &Slot) -> MutexGuard<'_, Region> {
    slot.lock().unwrap_or_else(|p| p.into_inner())
}

/// The tags of `map`, for [`unknown_tag`] once the map's lock is given back.
fn known_tags(map: &BTreeMap<String, Slot>) -> Vec<String> {
    map.keys().cloned().collect()
}

/// [`Error::UnknownTag`] for `tag`, suggesting the nearest of `known` (no suggestion for a
/// tag longer than any tag can be). Called without the region map's lock.
fn unknown_tag(known: &[String], tag: &str) -> Error {
    let nearest = if tag.len() > MAX_TAG_BYTES {
        None
    } else {
        nearest_tag(tag, known.iter().map(String::as_str))
    };
    Error::UnknownTag {
        tag: tag.to_owned(),
        nearest,
    }
}

/// A tag is a name of 1 to [`MAX_TAG_BYTES`] bytes without NUL bytes (C cannot name one).
fn check_tag(tag: &str) -> Result<()> {
    if tag.is_empty() || tag.len() > MAX_TAG_BYTES || tag.contains('\0') {
        let shown: String = tag.chars().take(64).collect();
        return Err(Error::InvalidArgument {
            tag: Some(shown),
            reason: format!(
                "a tag must be a name of 1 to {MAX_TAG_BYTES} bytes without NUL bytes (C \
                 cannot name one), not one of {} bytes",
                tag.len()
            ),
        });
    }
    Ok(())
}

impl Pager {
    /// A pager over `backend` with default settings.
    pub fn new(backend: Arc<dyn Backend>) -> Self {
        Self::with_config(backend, PagerConfig::default())
    }

    /// A pager over `backend` with the given settings.
    pub fn with_config(backend: Arc<dyn Backend>, config: PagerConfig) -> Self {
        let config = config.effective(backend.info().granularity);
        backend.set_reclaim_scrubbed(config.tuning.reclaim_scrubbed);
        Pager {
            media: Arc::new(Media::new(
                config.tuning.file_chunk_bytes,
                config.host_budget_bytes,
            )),
            backend,
            config,
            pid: std::process::id(),
            regions: RwLock::new(BTreeMap::new()),
            by_base: RwLock::new(BTreeMap::new()),
            traffic: pump::Traffic::default(),
            companions: RwLock::new(Vec::new()),
        }
    }

    /// The pump settings of a copy on `route`.
    fn pump_config(&self, route: CopyRoute) -> PumpConfig {
        PumpConfig {
            route,
            unit_bytes: self.config.tuning.copy_unit_bytes,
            depth: self.config.tuning.copy_depth,
        }
    }

    /// Makes `dir` (created if missing) the directory where new [`Medium::File`] backups
    /// go, after checking that a file can be written there; they have no name there
    /// ([`BackupFiles::Unnamed`]). Backups made before stay where they are. A new pager
    /// takes the directory from the environment variable `GPU_PAGER_BACKUP_DIR`, if set.
    /// Put it on a real disk: on tmpfs the "disk" is the host memory a file backup is meant
    /// to spare.
    pub fn set_backup_dir(&self, dir: impl AsRef<std::path::Path>) -> Result<()> {
        self.set_backup_files(dir, BackupFiles::Unnamed)
    }

    /// [`Pager::set_backup_dir`], with new backups named as `files` says
    /// ([`BackupFiles::Named`]: one visible file per backup, as torch_memory_saver lays
    /// them out).
    pub fn set_backup_files(
        &self,
        dir: impl AsRef<std::path::Path>,
        files: BackupFiles,
    ) -> Result<()> {
        let dir = dir.as_ref();
        self.media
            .files
            .set_dir(dir, files)
            .map_err(|e| Error::InvalidArgument {
                tag: None,
                reason: format!("the backup directory {} cannot be used: {e}", dir.display()),
            })
    }

    /// `bytes` of host memory counted against the node's host budget while the share
    /// lives (for pinned memory the pager hands out beside the backups).
    pub(crate) fn reserve_host(
        &self,
        bytes: usize,
    ) -> crate::backend::BackendResult<crate::backup::Share> {
        self.media.reserve(bytes)
    }

    /// The directory new [`Medium::File`] backups go to, if one is set.
    pub fn backup_dir(&self) -> Option<std::path::PathBuf> {
        self.media.files.dir()
    }

    /// How new [`Medium::File`] backups are named in their directory.
    pub fn backup_files(&self) -> BackupFiles {
        self.media.files.files()
    }

    /// The backend.
    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }

    /// Whether the pager runs on a GPU or on host memory.
    pub fn backend_kind(&self) -> BackendKind {
        self.backend.info().kind
    }

    /// The effective settings (sizes rounded as [`Pager::with_config`] rounds them).
    pub fn config(&self) -> PagerConfig {
        self.config
    }

    /// Fails in a forked child of the process that made the pager, before any lock is taken
    /// (a lock a parent thread held at the fork is never released in the child).
    fn check_process(&self) -> Result<()> {
        let here = std::process::id();
        if here == self.pid {
            return Ok(());
        }
        Err(Error::InvalidArgument {
            tag: None,
            reason: format!(
                "this pager was made in process {} and this process ({here}) is a fork of it: \
                 device memory and its bookkeeping cannot be shared across a fork (CUDA forbids \
                 it too); make the pager in this process (start it with spawn rather than \
                 fork), or fork before the first pager call",
                self.pid
            ),
        })
    }

    /// Whether this is the process that made the pager (see `check_process`).
    fn in_own_process(&self) -> bool {
        std::process::id() == self.pid
    }

    fn slot(&self, tag: &str) -> Result<Slot> {
        self.check_process()?;
        self.not_held(tag)?;
        let known = {
            let map = self.regions.read().unwrap_or_else(|p| p.into_inner());
            match map.get(tag) {
                Some(slot) => return Ok(slot.clone()),
                None => known_tags(&map),
            }
        };
        Err(unknown_tag(&known, tag))
    }

    /// The slot of `buf`'s region; a region removed since is `StaleBuffer` (the buffer went
    /// with it), not an unknown tag.
    fn slot_of(&self, buf: &Buffer) -> Result<Slot> {
        self.slot(&buf.tag).map_err(|e| match e {
            Error::UnknownTag { .. } => stale(buf),
            e => e,
        })
    }

    /// The slots for `tags`, deduplicated, in tag order (the lock order).
    fn slots(&self, tags: &[&str]) -> Result<Vec<Slot>> {
        let mut sorted: Vec<&str> = tags.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        sorted.into_iter().map(|t| self.slot(t)).collect()
    }

    /// Tags of all regions, in order.
    pub fn tags(&self) -> Vec<String> {
        if !self.in_own_process() {
            return Vec::new();
        }
        let map = self.regions.read().unwrap_or_else(|p| p.into_inner());
        map.keys().cloned().collect()
    }

    /// A region's description. Its `base` is valid to record (e.g. in a CUDA graph) at any
    /// time; it is backed by memory only while the region is resident.
    pub fn info(&self, tag: &str) -> Result<RegionInfo> {
        self.on_region(tag, || self.slot(tag), |a| Ok(a.region().info()))
    }

    /// Keeps `tags` resident until the lease drops: releasing any of them fails with
    /// `Busy` meanwhile. Fails with `NotResident` if one is released now. A lease does not
    /// keep an elastic region's chunks backed: [`Pager::trim`] still unmaps unused ones.
    pub fn lease(&self, tags: &[&str]) -> Result<Lease> {
        let slots = self.slots(tags)?;
        let mut guards: Vec<_> = slots.iter().map(lock).collect();
        for g in &guards {
            g.require_resident("a lease")?;
        }
        for g in &mut guards {
            g.settle()?;
        }
        for g in &mut guards {
            g.lease();
        }
        drop(guards);
        Ok(Lease { slots })
    }

    /// Gives the physical memory of `tags` back to the device. Waits for all outstanding
    /// device work first; copies `Preserve` regions to their pinned backups (only the parts
    /// that changed, with `skip_unchanged`), unmapping each buffer once its own copies are
    /// done and the regions it does not save at once, while the rest copies (unless a tag
    /// has companions, which run between the copies and the unmap). Regions already
    /// released are reported as such. All or nothing: if any region is leased, or a copy
    /// fails, nothing is released (what was unmapped is mapped and restored again; a region
    /// whose contents were being dropped comes back as its resume would bring it). Only if
    /// mapping back fails too (the device is lost) is that region left released and the
    /// failure recorded ([`Pager::take_deferred_errors`]): its resume restores the buffers
    /// the release had unmapped, and the others come back without contents.
    pub fn release(&self, tags: &[&str]) -> Result<Report> {
        self.release_with(tags, &ReleaseOptions::default())
    }

    /// [`Pager::release`] that drops the contents of the regions named in
    /// [`ReleaseOptions::drop`] for this cycle instead of backing them up: they are unmapped
    /// without a copy, and the resume after maps them back **zeroed** (a `Discard` region:
    /// uninitialised, as always). Their backups (if any) hold nothing from then on, so the
    /// resume restores nothing; the release after that backs up as usual. A dropped tag must
    /// be one of `tags` (`InvalidArgument` otherwise, nothing released). All or nothing, as
    /// every release. vLLM chooses this way at each sleep which tags keep their contents.
    pub fn release_with(&self, tags: &[&str], options: &ReleaseOptions) -> Result<Report> {
        if let Some(d) = options.drop.iter().find(|d| !tags.contains(&d.as_str())) {
            return Err(Error::InvalidArgument {
                tag: Some(d.clone()),
                reason: "a tag to drop must also be one of the tags released; add it to the \
                         tags, or leave it out of the drop list"
                    .to_owned(),
            });
        }
        let slots = self.slots(tags)?;
        let mut regions: Vec<_> = slots.iter().map(lock).collect();
        let report = moves::release(self, tags, &mut regions, options)?;
        drop(regions);
        if report
            .regions
            .iter()
            .any(|r| r.outcome == crate::report::Outcome::Done)
        {
            audit::warn_if_resident(self, tags);
        }
        Ok(report)
    }

    /// Maps physical memory back under `tags` at the same addresses and restores
    /// `Preserve` contents, overlapping the copies with the mapping. Returns when the
    /// contents are in place. All or nothing: if any region cannot be mapped (e.g.
    /// `OutOfMemory` because a trainer still holds the memory) or restored, every region
    /// mapped by this call is unmapped again, stays released with its backup intact, and
    /// the error returns; a later resume succeeds.
    pub fn resume(&self, tags: &[&str]) -> Result<Report> {
        self.resume_with(tags, ResumeOptions::default())
    }

    /// [`Pager::resume`] with options: whether [`Medium::Host`] backups keep their host
    /// memory after the restore ([`ResumeOptions::keep_host_backups`]).
    pub fn resume_with(&self, tags: &[&str], options: ResumeOptions) -> Result<Report> {
        let slots = self.slots(tags)?;
        let mut regions: Vec<_> = slots.iter().map(lock).collect();
        moves::resume(self, tags, &mut regions, None, options)
    }

    /// [`Pager::resume`] and [`Pager::lease`] in one step: no other thread can release the
    /// tags in between.
    pub fn resume_and_lease(&self, tags: &[&str]) -> Result<(Report, Lease)> {
        let slots = self.slots(tags)?;
        let mut regions: Vec<_> = slots.iter().map(lock).collect();
        let report = moves::resume(self, tags, &mut regions, None, ResumeOptions::default())?;
        // Still under the regions' locks: no release can come in between.
        for r in &mut regions {
            r.lease();
        }
        drop(regions);
        Ok((report, Lease { slots }))
    }

    /// Like [`Pager::resume`], but enqueues the restore copies on the caller's CUDA
    /// `stream` and returns once the mapping is done, so that the engine's next kernels on
    /// that stream run after the restore without a host-side wait. Contents are in place
    /// when the stream reaches that point; pager reads and writes of the region from the
    /// host before then are the caller's to order (synchronize the stream first).
    /// `verify_restore` is not applied. On the host backend copies are synchronous.
    pub fn resume_on(&self, tags: &[&str], stream: RawStream) -> Result<Report> {
        let slots = self.slots(tags)?;
        let mut regions: Vec<_> = slots.iter().map(lock).collect();
        moves::resume(
            self,
            tags,
            &mut regions,
            Some(stream),
            ResumeOptions::default(),
        )
    }

    /// Maps physical memory under the chunks of the elastic region `tag` that share a byte
    /// with `range` (offsets from the region's base) and are not mapped yet. Returns the
    /// bytes newly mapped (whole chunks; 0 for an empty range or a non-elastic region, which
    /// is mapped whole while resident). `DiscardZeroed` regions get the new chunks
    /// zero-filled; `Discard` leaves them uninitialised. All or nothing: on failure (e.g.
    /// [`Error::OutOfMemory`]) nothing stays newly mapped, and a later call may succeed.
    /// Needs the region resident ([`Error::NotResident`]) and `range` inside it
    /// ([`Error::OutOfRange`]).
    pub fn back(&self, tag: &str, range: Range<usize>) -> Result<usize> {
        let slot = self.slot(tag)?;
        let mut r = lock(&slot);
        r.require_resident("back")?;
        r.check_range(&range)?;
        if range.is_empty() {
            return Ok(0);
        }
        r.back(self.backend.as_ref(), &range)
    }

    /// Gives back to the device every mapped chunk of the elastic region `tag` that shares
    /// no byte with any of the `keep` ranges (offsets from the region's base; ranges past
    /// the end or empty keep nothing). Waits for all outstanding device work first, since
    /// kernels may still use the memory. Returns the bytes unmapped; 0 for a released
    /// region (it has nothing mapped). Contents of the unmapped chunks are lost.
    ///
    /// Leases do not block a trim: a lease keeps a region resident, not its unused chunks
    /// backed. Pager access to a trimmed range fails with [`Error::NotBacked`]; raw pointers
    /// into it fault, as into a released region. Refused with [`Error::InvalidArgument`]
    /// for a region that is not elastic.
    pub fn trim(&self, tag: &str, keep: &[Range<usize>]) -> Result<usize> {
        let slot = self.slot(tag)?;
        let mut r = lock(&slot);
        if !r.on_demand() {
            return Err(Error::InvalidArgument {
                tag: Some(tag.to_owned()),
                reason: "only elastic regions can be trimmed; create the region elastic, or \
                         release it instead"
                    .to_owned(),
            });
        }
        if !r.is_resident() {
            return Ok(0);
        }
        self.backend
            .synchronize()
            .map_err(|e| Error::backend(tag, "waiting for device work", e))?;
        Ok(r.trim(keep))
    }

    /// Whether `range` (offsets from the region's base) of region `tag` is backed by
    /// physical memory: the region is resident and every chunk sharing a byte with the range
    /// is mapped. An empty range is backed when the region is resident. A non-elastic
    /// region is backed exactly while resident. [`Error::OutOfRange`] unless the range lies
    /// inside the region.
    pub fn is_backed(&self, tag: &str, range: Range<usize>) -> Result<bool> {
        let slot = self.slot(tag)?;
        let r = lock(&slot);
        r.check_range(&range)?;
        Ok(r.is_resident() && r.is_backed(&range))
    }

    /// How many releases have changed region `tag` since it was created (0 at creation,
    /// one more for each release that unmapped it; releases of an already released region do
    /// not count). A KV cache compares it with the value it saw to know that its blocks'
    /// contents are gone.
    pub fn releases(&self, tag: &str) -> Result<u64> {
        Ok(lock(&self.slot(tag)?).releases())
    }

    /// Frees a region's pinned backup (the next release pins again). Refused while the
    /// region is released with its contents in the backup.
    pub fn free_backup(&self, tag: &str) -> Result<usize> {
        let slot = self.slot(tag)?;
        let mut r = lock(&slot);
        // An asynchronous restore (`resume_on`) may still read the backup.
        self.backend
            .synchronize()
            .map_err(|e| Error::backend(tag, "waiting for device work", e))?;
        r.free_backup()
    }

    /// A region's identity and release count (what a KV cache re-validates on every call),
    /// without building a whole `RegionInfo`.
    pub(crate) fn identity(&self, tag: &str) -> Result<(u64, u64)> {
        let slot = self.slot(tag)?;
        let r = lock(&slot);
        Ok((r.id, r.releases()))
    }

    /// Statistics of one region.
    pub fn region_stats(&self, tag: &str) -> Result<RegionStats> {
        self.on_region(tag, || self.slot(tag), |a| Ok(a.region().stats()))
    }

    /// Statistics of every region.
    pub fn stats(&self) -> Stats {
        let errors = self.backend.deferred_errors();
        if !self.in_own_process() {
            return Stats {
                regions: Vec::new(),
                deferred_errors: Vec::new(),
                deferred_errors_total: 0,
            };
        }
        let map = self.regions.read().unwrap_or_else(|p| p.into_inner());
        Stats {
            regions: map
                .iter()
                .map(|(tag, s)| {
                    self.with_held(|r| r.tag == *tag, Region::stats)
                        .unwrap_or_else(|| lock(s).stats())
                })
                .collect(),
            deferred_errors: errors.unread(),
            deferred_errors_total: errors.total(),
        }
    }

    /// Removes and returns the failures that no call could return, oldest first (see
    /// [`Stats::deferred_errors`]): a failed unmap, release or free when a region, a mapping
    /// or a pinned buffer was dropped; a failed device synchronisation while undoing a
    /// failed resume or back; a `KvCache` that could not remove its region when dropped;
    /// errors cudarc deferred from its own `Drop` impls. Each was logged through the `log`
    /// crate when it happened.
    ///
    /// The next pager call does **not** return them (unlike cudarc, whose next
    /// `bind_to_thread` does): the failure belongs to an object already gone, not to that
    /// call, which may come from another thread, concern another tag and succeed in full;
    /// failing it would report an all-or-nothing move as failed although it happened, and
    /// invite a retry that moves again. A failure that leaves the device unusable (a
    /// sticky CUDA error) fails the next driver call by itself. Poll this (or
    /// [`Pager::stats`]) to notice leaks; the backend's sink is shared by every pager on it,
    /// so one drain takes them all.
    pub fn take_deferred_errors(&self) -> Vec<String> {
        if !self.in_own_process() {
            return Vec::new();
        }
        self.backend.deferred_errors().take()
    }
}

/// Keeps tags resident while alive; see [`Pager::lease`].
#[derive(Debug)]
pub struct Lease {
    slots: Vec<Slot>,
}

impl Lease {
    /// The leased tags.
    pub fn tags(&self) -> Vec<String> {
        self.slots.iter().map(|s| lock(s).tag.clone()).collect()
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        for s in &self.slots {
            let mut r = lock(s);
            r.unlease();
        }
    }
}
