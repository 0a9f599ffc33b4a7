//! The pager: regions by tag, release and resume of tag sets, buffers, leases and stats.

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};

use crate::backend::{Backend, BackendKind, RawStream};
use crate::backup::file::{BackupFiles, FileIo};
use crate::error::{Error, Result, nearest_tag};
use crate::pump::{self, CopyRoute, PumpConfig};
use crate::region::{
    Medium, Policy, Region, RegionInfo, RegionKind, RegionOptions, RegionStats, Shape, State,
};
use crate::report::Report;
use crate::suballoc::AllocError;

mod backup_read;
mod companions;
mod config;
mod moves;
mod overwritten;

use config::round_chunk;

pub use companions::{Companion, CompanionError};
pub use config::{
    DEFAULT_ALIGN, DEFAULT_CHUNK_BYTES, MAX_TAG_BYTES, PagerConfig, ReleaseOptions, ResumeOptions,
    Tuning,
};

/// A buffer sub-allocated inside a region: a handle (tag, offset, length), not a pointer.
/// Get its device address with [`Pager::ptr`] while the region is resident.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Buffer {
    tag: Arc<str>,
    id: u64,
    offset: usize,
    len: usize,
}

impl Buffer {
    /// The region's tag.
    pub fn tag(&self) -> &str {
        &self.tag
    }
    /// Offset from the region's base address.
    pub fn offset(&self) -> usize {
        self.offset
    }
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether the buffer is empty (never: zero-byte buffers are refused).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

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
    files: Arc<FileIo>,
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
    companions: RwLock<Vec<companions::Entry>>,
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

/// An elastic or growing region may reserve up to this many times the device's memory.
pub(crate) const MAX_RESERVE_FACTOR: usize = 4;

/// Describes a region for error messages.
fn describe(policy: Policy, medium: Medium, bytes: usize, kind: RegionKind) -> String {
    let backup = if policy == Policy::Preserve {
        format!(" with a {medium} backup")
    } else {
        String::new()
    };
    let article = match kind {
        RegionKind::Elastic => "an",
        RegionKind::Fixed | RegionKind::Growing => "a",
    };
    let size = match kind {
        RegionKind::Growing => format!("reserving {bytes} bytes"),
        RegionKind::Fixed | RegionKind::Elastic => format!("of {bytes} bytes"),
    };
    format!("{article} {kind} {policy:?} region{backup} {size}")
}

/// What a region creation asks for, compared with an existing region of the tag.
struct Wanted {
    policy: Policy,
    size: usize,
    kind: RegionKind,
    medium: Medium,
    prepin: bool,
    exclusive: bool,
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

/// The options a region of `policy` can take: a backup medium and `prepin` are for
/// `Preserve` regions, and `prepin` pins what a host-medium backup gives back.
fn check_options(tag: &str, policy: Policy, options: &RegionOptions) -> Result<()> {
    let refuse = |reason: String| Err(Error::invalid(Some(tag), reason));
    if options.medium != Medium::Pinned && policy != Policy::Preserve {
        return refuse(format!(
            "a backup medium ({}) is for preserve regions, and a {policy:?} region keeps no \
             contents; leave the medium at its default",
            options.medium
        ));
    }
    if options.prepin && options.medium == Medium::Host {
        return refuse(
            "prepin pins the backup now, but a host-medium backup is given back after every \
             resume and pinned again at the release; use prepin with the pinned medium, or \
             leave it off"
                .to_owned(),
        );
    }
    if options.prepin && policy != Policy::Preserve {
        return refuse(format!(
            "prepin pins a host backup, and a {policy:?} region has none (its contents are \
             dropped on release); use prepin only with the preserve policy"
        ));
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
        Pager {
            files: Arc::new(FileIo::new(config.tuning.file_chunk_bytes)),
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
        self.files
            .set_dir(dir, files)
            .map_err(|e| Error::InvalidArgument {
                tag: None,
                reason: format!("the backup directory {} cannot be used: {e}", dir.display()),
            })
    }

    /// The directory new [`Medium::File`] backups go to, if one is set.
    pub fn backup_dir(&self) -> Option<std::path::PathBuf> {
        self.files.dir()
    }

    /// How new [`Medium::File`] backups are named in their directory.
    pub fn backup_files(&self) -> BackupFiles {
        self.files.files()
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

    /// Creates a fixed region of `bytes` (rounded up to the granularity), resident, at a
    /// device address that stays the same until the pager is dropped or the region removed.
    /// Asking again for an existing tag with the same kind, size and policy returns the
    /// existing region.
    ///
    /// A **growing** region ([`RegionOptions::GROWING`] with [`Pager::region_with`]) is for
    /// engines that do not know their sizes before loading (allocations through PyTorch): it
    /// reserves address space (`bytes`, or four times the device's memory for 0) and maps
    /// physical memory only under live buffers. Each [`Pager::alloc`] maps its buffer
    /// (rounded up to the granularity, in pieces of at most the chunk size; all or nothing,
    /// `OutOfMemory` maps nothing), each [`Pager::free`] unmaps it after waiting for the
    /// device, a release backs up (`Preserve`) and unmaps exactly the buffers, and a resume
    /// maps and restores exactly them at the same addresses. Any policy may grow.
    pub fn region(&self, tag: &str, bytes: usize, policy: Policy) -> Result<RegionInfo> {
        self.region_with(tag, bytes, policy, RegionOptions::default())
    }

    /// [`Pager::region`] with options: its [`RegionKind`] (fixed, growing, elastic),
    /// `prepin`, a per-region `chunk_bytes`, the backup's medium. An elastic region is
    /// created with nothing mapped; see [`Pager::back`]. Asking again for an existing tag
    /// also needs the same kind and medium (`prepin` then pins an unpinned backup).
    pub fn region_with(
        &self,
        tag: &str,
        bytes: usize,
        policy: Policy,
        options: RegionOptions,
    ) -> Result<RegionInfo> {
        self.create_region(tag, bytes, policy, options, false)
    }

    /// [`Pager::region_with`] that refuses an existing tag (`InvalidArgument`) instead of
    /// returning it: for owners that must be the only user of their region (a
    /// [`crate::kv::KvCache`]).
    pub fn region_exclusive(
        &self,
        tag: &str,
        bytes: usize,
        policy: Policy,
        options: RegionOptions,
    ) -> Result<RegionInfo> {
        self.create_region(tag, bytes, policy, options, true)
    }

    fn create_region(
        &self,
        tag: &str,
        bytes: usize,
        policy: Policy,
        options: RegionOptions,
        exclusive: bool,
    ) -> Result<RegionInfo> {
        self.check_process()?;
        check_tag(tag)?;
        let size = self.region_size(tag, bytes, options.kind)?;
        check_options(tag, policy, &options)?;
        let want = Wanted {
            policy,
            size,
            kind: options.kind,
            medium: options.medium,
            prepin: options.prepin,
            exclusive,
        };
        // An existing region is answered without building anything.
        let existing = {
            let map = self.regions.read().unwrap_or_else(|p| p.into_inner());
            map.get(tag).cloned()
        };
        if let Some(slot) = existing {
            return self.existing(tag, &slot, &want);
        }
        let mut region = self.build_region(tag, size, policy, options)?;
        region.exclusive = exclusive;
        self.publish(tag, region, &want)
    }

    /// The reserved size of a new region of `kind` asked for with `bytes`: rounded up to the
    /// granularity; a fixed region must fit in the device, the others reserve at most
    /// [`MAX_RESERVE_FACTOR`] times it (a growing region of 0 bytes reserves that much:
    /// address space is cheap).
    fn region_size(&self, tag: &str, bytes: usize, kind: RegionKind) -> Result<usize> {
        let info = self.backend.info();
        let g = info.granularity;
        let reserve = info.total_bytes.saturating_mul(MAX_RESERVE_FACTOR);
        let bytes = if kind == RegionKind::Growing && bytes == 0 {
            reserve / g * g
        } else {
            bytes
        };
        let (limit, why, hint) = match kind {
            RegionKind::Fixed => (
                info.total_bytes,
                "a fixed region is mapped whole while resident and must fit in",
                ", or create it growing to map only under its buffers, or elastic to map only \
                 what is backed",
            ),
            RegionKind::Elastic | RegionKind::Growing => (
                reserve,
                "an elastic or growing region reserves at most 4 times",
                "",
            ),
        };
        bytes
            .checked_next_multiple_of(g)
            .filter(|&s| s > 0 && s <= limit)
            .ok_or_else(|| Error::InvalidSize {
                tag: tag.to_owned(),
                reason: format!(
                    "{bytes} bytes: a region needs 1 to {limit} bytes ({why} the device's {} \
                     bytes, {}); ask for fewer bytes{hint}",
                    info.total_bytes, info.name,
                ),
            })
    }

    /// Builds region `tag` (without the map's lock: mapping and pinning take time). A
    /// Discard region that is mapped whole (fixed) or buffer by buffer (growing: a torch KV
    /// cache's segments) has nothing to copy while it maps, so it gets the fewest handles;
    /// everything else maps and copies (or backs) chunk by chunk.
    fn build_region(
        &self,
        tag: &str,
        size: usize,
        policy: Policy,
        options: RegionOptions,
    ) -> Result<Region> {
        let default_chunk = if policy != Policy::Preserve && options.kind != RegionKind::Elastic {
            self.config.tuning.discard_chunk_bytes
        } else {
            self.config.chunk_bytes
        };
        let g = self.backend.info().granularity.max(1);
        let chunk_bytes = options
            .chunk_bytes
            .map_or(default_chunk, |c| round_chunk(c, g))
            .min(size);
        let shape = Shape { size, chunk_bytes };
        let backend = self.backend.as_ref();
        Region::create(backend, next_id(), tag, shape, policy, options, &self.files)
    }

    /// Publishes a built region under a short write lock, unless another thread made the
    /// tag meanwhile (then that one answers, as [`Pager::existing`] does).
    fn publish(&self, tag: &str, region: Region, want: &Wanted) -> Result<RegionInfo> {
        let info = region.info();
        let mut map = self.regions.write().unwrap_or_else(|p| p.into_inner());
        if let Some(slot) = map.get(tag).cloned() {
            drop(map);
            drop(region);
            return self.existing(tag, &slot, want);
        }
        let slot = Arc::new(Mutex::new(region));
        map.insert(tag.to_owned(), slot.clone());
        self.by_base
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .insert(info.base, slot);
        Ok(info)
    }

    /// The answer to a creation of `tag` that exists as `slot`: its description when it
    /// is what `want` asks for (pinning its backup now if `want.prepin` and it is not
    /// pinned yet), else `TagConflict` naming what differs (`InvalidArgument` for an owner
    /// that needs a region of its own).
    fn existing(&self, tag: &str, slot: &Slot, want: &Wanted) -> Result<RegionInfo> {
        let mut r = lock(slot);
        if want.exclusive {
            return Err(Error::InvalidArgument {
                tag: Some(tag.to_owned()),
                reason: "the region exists already, and this owner needs a region of its \
                         own (one KvCache per region); use another tag or remove it first"
                    .to_owned(),
            });
        }
        let growing = want.kind == RegionKind::Growing;
        if r.policy == want.policy
            && r.kind == want.kind
            && (growing || r.size() == want.size)
            && r.medium == want.medium
        {
            if want.prepin && want.policy == Policy::Preserve {
                r.prepin_now(self.backend.as_ref())?;
            }
            return Ok(r.info());
        }
        let differs: Vec<&str> = [
            (r.policy != want.policy, "policy"),
            (r.kind != want.kind, "kind (fixed, elastic or growing)"),
            (
                !growing && r.kind != RegionKind::Growing && r.size() != want.size,
                "size",
            ),
            (r.medium != want.medium, "backup medium"),
        ]
        .into_iter()
        .filter_map(|(d, what)| d.then_some(what))
        .collect();
        Err(Error::TagConflict {
            tag: tag.to_owned(),
            existing: describe(r.policy, r.medium, r.size(), r.kind),
            requested: describe(want.policy, want.medium, want.size, want.kind),
            differs: differs.join(" and "),
        })
    }

    /// Removes a region: unmaps it, frees its backup and its address range. Refused while
    /// leased. Buffers of the region become stale.
    pub fn remove(&self, tag: &str) -> Result<()> {
        self.remove_impl(tag, None).map(|_| ())
    }

    /// Removes region `tag` only if it is still the region with identity `id` (its owner
    /// dropping it); returns whether it was removed.
    pub(crate) fn remove_if_id(&self, tag: &str, id: u64) -> Result<bool> {
        self.remove_impl(tag, Some(id))
    }

    fn remove_impl(&self, tag: &str, id: Option<u64>) -> Result<bool> {
        let slot = self.slot(tag)?;
        if !Self::removable(tag, &mut lock(&slot), id)? {
            return Ok(false);
        }
        // Work on the device may still use the region: wait for it holding no lock, so that
        // calls on other tags go on meanwhile.
        self.backend
            .synchronize()
            .map_err(|e| Error::backend(tag, "waiting for device work", e))?;
        // Unlink under a short write lock, checking again: the tag may name another region
        // by now, or the region may have been leased meanwhile.
        let removed = {
            let mut map = self.regions.write().unwrap_or_else(|p| p.into_inner());
            if !map.get(tag).is_some_and(|s| Arc::ptr_eq(s, &slot)) {
                return Ok(false);
            }
            let base = {
                let mut r = lock(&slot);
                if !Self::removable(tag, &mut r, id)? {
                    return Ok(false);
                }
                r.base()
            };
            self.by_base
                .write()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&base);
            map.remove(tag)
        };
        // The region is unmapped and freed when its last handle goes, outside every lock.
        drop(removed);
        drop(slot);
        Ok(true)
    }

    /// Whether region `r` (of `tag`) may be removed by this call: `Ok(false)` when it is no
    /// longer the region with identity `id`; `Busy` while leased; `InvalidArgument` for a
    /// region that belongs to an owner (unless the owner removes it).
    fn removable(tag: &str, r: &mut Region, id: Option<u64>) -> Result<bool> {
        if id.is_some_and(|id| id != r.id) {
            return Ok(false);
        }
        if id.is_some() {
            // Its owner is going away: whatever happens below, a plain `remove` may take
            // the region from now on (it is nobody's any more).
            r.exclusive = false;
        }
        if id.is_none() && r.exclusive {
            return Err(Error::InvalidArgument {
                tag: Some(tag.to_owned()),
                reason: "the region belongs to its owner (a KvCache) and is removed when that \
                         owner is dropped; drop the KvCache instead of removing its region"
                    .to_owned(),
            });
        }
        if r.leases > 0 {
            return Err(Error::Busy {
                tag: tag.to_owned(),
                leases: r.leases,
            });
        }
        Ok(true)
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
        Ok(lock(&self.slot(tag)?).info())
    }

    /// Allocates a buffer of `bytes` in region `tag`, aligned to [`DEFAULT_ALIGN`].
    pub fn alloc(&self, tag: &str, bytes: usize) -> Result<Buffer> {
        self.alloc_aligned(tag, bytes, DEFAULT_ALIGN)
    }

    /// Allocates a buffer of `bytes` in region `tag` at an offset that is a multiple of
    /// `align` (a power of two, at most the granularity: `InvalidArgument` otherwise, as a
    /// region's base is aligned to no more). Works whether the region is resident or released.
    pub fn alloc_aligned(&self, tag: &str, bytes: usize, align: usize) -> Result<Buffer> {
        let slot = self.slot(tag)?;
        let mut r = lock(&slot);
        let id = next_id();
        // A growing region maps each buffer by itself, so buffers own whole granules.
        let g = self.backend.info().granularity;
        // A region's base is aligned to the granularity and no more, so an offset cannot
        // give an address a larger alignment.
        if align > g {
            return Err(Error::InvalidArgument {
                tag: Some(tag.to_owned()),
                reason: format!(
                    "an alignment of {align} bytes is above the device's granularity ({g} \
                     bytes), the most a region's addresses are aligned to; ask for at most {g}"
                ),
            });
        }
        let (want, align) = if r.growing() && bytes > 0 {
            let Some(rounded) = bytes.checked_next_multiple_of(g) else {
                return Err(Error::InvalidSize {
                    tag: tag.to_owned(),
                    reason: format!("{bytes} bytes cannot be rounded to the {g}-byte granularity"),
                });
            };
            (rounded, align.max(g))
        } else {
            (bytes, align)
        };
        match r.alloc.alloc(want, align, id) {
            Ok(a) => {
                if r.growing() {
                    if let Err(e) = r.map_buffer(self.backend.as_ref(), a.offset, a.len) {
                        let _ = r.alloc.free(a.offset, id);
                        return Err(e);
                    }
                    r.lens.insert(a.offset, bytes);
                }
                Ok(Buffer {
                    tag: Arc::from(tag),
                    id,
                    offset: a.offset,
                    len: bytes,
                })
            }
            Err(AllocError::Invalid(reason)) => Err(if bytes == 0 {
                Error::InvalidSize {
                    tag: tag.to_owned(),
                    reason,
                }
            } else {
                Error::InvalidArgument {
                    tag: Some(tag.to_owned()),
                    reason,
                }
            }),
            Err(AllocError::Full { free }) => Err(Error::RegionFull {
                tag: tag.to_owned(),
                requested: bytes,
                align,
                free,
            }),
            Err(AllocError::Stale) => Err(Error::Internal {
                tag: Some(tag.to_owned()),
                reason: "the allocator answered a fresh allocation as stale".to_owned(),
            }),
        }
    }

    /// The live buffer that starts exactly at device address `ptr`, in any region, resident
    /// or released; `None` when no live buffer starts there (an address inside a buffer, a
    /// freed buffer, memory of another pager). For callers that only keep the pointer, such
    /// as PyTorch's allocator hooks (`free(ptr, ..)`). O(log regions + log buffers).
    pub fn buffer_at(&self, ptr: u64) -> Option<Buffer> {
        self.buffer_containing(ptr)
            .filter(|(_, offset)| *offset == 0)
            .map(|(buf, _)| buf)
    }

    /// The live buffer whose bytes include device address `ptr`, and `ptr`'s offset in it
    /// (what [`Pager::write`] and [`Pager::read`] take). Same cost as [`Pager::buffer_at`].
    pub fn buffer_containing(&self, ptr: u64) -> Option<(Buffer, usize)> {
        if !self.in_own_process() {
            return None;
        }
        let slot = {
            let by_base = self.by_base.read().unwrap_or_else(|p| p.into_inner());
            by_base.range(..=ptr).next_back()?.1.clone()
        };
        let r = lock(&slot);
        let offset = usize::try_from(ptr - r.base()).ok()?;
        if offset >= r.size() {
            return None;
        }
        let a = r.alloc.live_containing(offset)?;
        // A growing region rounds its buffers up to the granularity: the rest is padding.
        let len = r.lens.get(&a.offset).copied().unwrap_or(a.len);
        if offset - a.offset >= len {
            return None;
        }
        Some((
            Buffer {
                tag: Arc::from(r.tag.as_str()),
                id: a.id,
                offset: a.offset,
                len,
            },
            offset - a.offset,
        ))
    }

    /// Frees a buffer. A second free of the same buffer returns `StaleBuffer`.
    ///
    /// In a growing region the free gives the buffer's memory back to the device at once:
    /// it waits for all outstanding device work (as a release does), then unmaps the buffer.
    pub fn free(&self, buf: &Buffer) -> Result<()> {
        let slot = self.slot_of(buf)?;
        let mut r = lock(&slot);
        if !r.alloc.is_live(buf.offset, buf.id) {
            return Err(stale(buf));
        }
        let len = r.alloc.get(buf.offset).map_or(0, |a| a.len);
        if r.growing() {
            r.settle()?;
            r.unmap_buffer(self.backend.as_ref(), buf.offset, len)?;
        }
        r.alloc.free(buf.offset, buf.id).map_err(|_| stale(buf))?;
        r.forget_buffer(buf.offset, len);
        Ok(())
    }

    /// Runs `f` on the locked region of `buf` after checking that the buffer is live, that
    /// `offset + len` fits in it, that the region is resident and, elastic, that the range
    /// is backed. `f` gets the device address of `buf + offset`; a zero `len` runs nothing.
    fn with_resident<T: Default>(
        &self,
        buf: &Buffer,
        offset: usize,
        len: usize,
        op: &'static str,
        f: impl FnOnce(&Region, u64) -> Result<T>,
    ) -> Result<T> {
        let slot = self.slot_of(buf)?;
        let mut r = lock(&slot);
        let range = buffer_range(&r, buf, offset, len)?;
        r.require_resident(op)?;
        if r.on_demand() && !r.is_backed(&range) {
            return Err(Error::NotBacked {
                tag: buf.tag.to_string(),
                offset: range.start,
                len,
            });
        }
        r.settle()?;
        if len == 0 {
            return Ok(T::default());
        }
        f(&r, r.base() + range.start as u64)
    }

    /// The device address of a buffer. `NotResident` while its region is released;
    /// `NotBacked` when the region is elastic and the buffer not wholly backed. The address
    /// is stable across cycles, but see the type's docs on using it.
    pub fn ptr(&self, buf: &Buffer) -> Result<u64> {
        self.with_resident(buf, 0, buf.len, "a pointer lookup", |_, addr| Ok(addr))
    }

    /// The device address of a live buffer, resident or released (unlike [`Pager::ptr`],
    /// which needs the memory mapped): where it is and will be. `StaleBuffer` for a buffer
    /// freed, or of a region removed (even if a region of the same tag was made again: its
    /// addresses belong to that one).
    pub fn address(&self, buf: &Buffer) -> Result<u64> {
        let slot = self.slot_of(buf)?;
        let r = lock(&slot);
        if !r.alloc.is_live(buf.offset, buf.id) {
            return Err(stale(buf));
        }
        Ok(r.base() + buf.offset as u64)
    }

    /// Copies `data` from the host into `buf` at `offset` and waits for it.
    /// Zero bytes copy nothing, after the same checks.
    pub fn write(&self, buf: &Buffer, offset: usize, data: &[u8]) -> Result<()> {
        self.with_resident(buf, offset, data.len(), "a write", |r, addr| {
            // SAFETY: the range is inside a live buffer of a resident region (checked), and
            // the region's lock is held, so it is mapped for the whole copy.
            unsafe { self.backend.copy_to_device(addr, data) }
                .map_err(|e| Error::backend(&r.tag, "copying host data to the device", e))
        })
    }

    /// Copies `out.len()` bytes of `buf` at `offset` to the host and waits for it.
    /// Zero bytes copy nothing, after the same checks.
    pub fn read(&self, buf: &Buffer, offset: usize, out: &mut [u8]) -> Result<()> {
        self.with_resident(buf, offset, out.len(), "a read", |r, addr| {
            // SAFETY: as in `write`: mapped, live, locked.
            unsafe { self.backend.copy_to_host(out, addr) }
                .map_err(|e| Error::backend(&r.tag, "copying device data to the host", e))
        })
    }

    /// Fills the whole buffer with the 32-bit `pattern` (0 zeroes) with the `fill` kernel.
    pub fn fill(&self, buf: &Buffer, pattern: u32) -> Result<()> {
        self.with_resident(buf, 0, buf.len, "the fill kernel", |r, addr| {
            // SAFETY: as in `write`: mapped, live, locked.
            unsafe { self.backend.fill(addr, buf.len, pattern) }
                .map_err(|e| Error::backend(&r.tag, "the fill kernel", e))
        })
    }

    /// Hashes the buffer in chunks of `chunk_bytes` (a multiple of 16) with the `chunk_hash`
    /// kernel; see [`crate::kernels::reference::chunk_hash`] for the function.
    pub fn hash(&self, buf: &Buffer, chunk_bytes: usize) -> Result<Vec<u64>> {
        // The kernel's argument rules, checked here so that a bad chunk size is the caller's
        // InvalidArgument, not a backend failure. Regions and buffers are 256-aligned.
        crate::kernels::check_chunk_hash_args(0, buf.len, chunk_bytes).map_err(|reason| {
            Error::InvalidArgument {
                tag: Some(buf.tag().to_owned()),
                reason,
            }
        })?;
        self.with_resident(buf, 0, buf.len, "the chunk_hash kernel", |r, addr| {
            // SAFETY: as in `write`: mapped, live, locked.
            unsafe { self.backend.chunk_hash(addr, buf.len, chunk_bytes) }
                .map_err(|e| Error::backend(&r.tag, "the chunk_hash kernel", e))
        })
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
            g.leases += 1;
        }
        drop(guards);
        Ok(Lease { slots })
    }

    /// Gives the physical memory of `tags` back to the device. Waits for all outstanding
    /// device work first; copies `Preserve` regions to their pinned backups (only the parts
    /// that changed, with `skip_unchanged`); then unmaps. Regions already released are
    /// reported as such. All or nothing: if any region is leased, or a copy fails, nothing
    /// is released.
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
        self.release_locked(tags, &mut regions, options)
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
        self.resume_locked(tags, &mut regions, None, options)
    }

    /// [`Pager::resume`] and [`Pager::lease`] in one step: no other thread can release the
    /// tags in between.
    pub fn resume_and_lease(&self, tags: &[&str]) -> Result<(Report, Lease)> {
        let slots = self.slots(tags)?;
        let mut regions: Vec<_> = slots.iter().map(lock).collect();
        let report = self.resume_locked(tags, &mut regions, None, ResumeOptions::default())?;
        // Still under the regions' locks: no release can come in between.
        for r in &mut regions {
            r.leases += 1;
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
        self.resume_locked(tags, &mut regions, Some(stream), ResumeOptions::default())
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
        Ok(lock(&self.slot(tag)?).releases)
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
        Ok((r.id, r.releases))
    }

    /// Statistics of one region.
    pub fn region_stats(&self, tag: &str) -> Result<RegionStats> {
        Ok(lock(&self.slot(tag)?).stats())
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
            regions: map.values().map(|s| lock(s).stats()).collect(),
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

/// The region's bytes `offset .. offset + len` of `buf`: [`Error::StaleBuffer`] unless `buf`
/// is live in `r`, [`Error::OutOfRange`] unless the range lies inside it.
fn buffer_range(r: &Region, buf: &Buffer, offset: usize, len: usize) -> Result<Range<usize>> {
    if !r.alloc.is_live(buf.offset, buf.id) {
        return Err(stale(buf));
    }
    if offset.checked_add(len).is_none_or(|end| end > buf.len) {
        return Err(Error::OutOfRange {
            tag: buf.tag.to_string(),
            what: "buffer",
            offset,
            len,
            size: buf.len,
        });
    }
    let start = buf.offset + offset;
    Ok(start..start + len)
}

fn stale(buf: &Buffer) -> Error {
    Error::StaleBuffer {
        tag: buf.tag.to_string(),
        id: buf.id,
        offset: buf.offset,
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
            r.leases = r.leases.saturating_sub(1);
        }
    }
}
