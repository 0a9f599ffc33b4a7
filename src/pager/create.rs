//! Region creation and removal: the checks of a new region's options, its size, and the
//! publication of a new region or the return of an existing one of the same tag.

use super::*;

/// An elastic or growing region may reserve up to this many times the device's memory.
const MAX_RESERVE_FACTOR: usize = 4;

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

/// The options a region of `policy` can take: a backup medium and `prepin` are for
/// `Preserve` regions, and `prepin` pins what a host-medium backup gives back.
fn check_options(tag: &str, policy: Policy, options: &RegionOptions) -> Result<()> {
    let refuse = |reason: String| Err(Error::invalid(Some(tag), reason));
    if options.medium != Medium::default() && policy != Policy::Preserve {
        return refuse(format!(
            "a backup medium ({}) is for preserve regions, and a {policy:?} region keeps no \
             contents; leave the medium at its default",
            options.medium
        ));
    }
    if options.prepin && !options.medium.can_prepin() {
        let why = match options.medium {
            Medium::File => "a file backup keeps its bytes on disk and has no host memory to pin",
            _ => {
                "a host-medium backup is given back after every resume and pinned again at the \
                  release"
            }
        };
        return refuse(format!(
            "prepin pins the backup's host memory now, but {why}; use prepin with the pinned \
             medium, or leave it off"
        ));
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
        // The setting turns the option on where a region can take it.
        let prepin = options.prepin
            || (self.config.prepin && policy == Policy::Preserve && options.medium.can_prepin());
        let options = RegionOptions { prepin, ..options };
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
        region.set_exclusive(exclusive);
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
        // Fix-its name only what every binding can do: the growing kind, not the elastic one
        // (Rust's alone).
        let (limit, why, hint) = match kind {
            RegionKind::Fixed => (
                info.total_bytes,
                "a fixed region is mapped whole while resident and must fit in",
                ", or create it growing to map only under its buffers",
            ),
            RegionKind::Elastic | RegionKind::Growing => (
                reserve,
                "a growing or elastic region reserves at most 4 times",
                "",
            ),
        };
        let fix = if bytes == 0 {
            "give it a size of at least 1 byte"
        } else {
            "ask for fewer bytes"
        };
        bytes
            .checked_next_multiple_of(g)
            .filter(|&s| s > 0 && s <= limit)
            .ok_or_else(|| Error::InvalidSize {
                tag: tag.to_owned(),
                reason: format!(
                    "{}: a region needs 1 byte to {} ({why} the device's {}, {}); {fix}{hint}",
                    sized(bytes),
                    sized(limit),
                    sized(info.total_bytes),
                    info.name,
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
        Region::create(backend, next_id(), tag, shape, policy, options, &self.media)
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
            r.set_exclusive(false);
        }
        if id.is_none() && r.exclusive() {
            return Err(Error::InvalidArgument {
                tag: Some(tag.to_owned()),
                reason: "the region belongs to its owner (a KvCache) and is removed when that \
                         owner is dropped; drop the KvCache instead of removing its region"
                    .to_owned(),
            });
        }
        if r.leases() > 0 {
            return Err(Error::Busy {
                tag: tag.to_owned(),
                leases: r.leases(),
            });
        }
        Ok(true)
    }
}

/// `bytes` as users read a size: the count, and in GiB or MiB beside it.
fn sized(bytes: usize) -> String {
    if bytes >= 1 << 20 {
        format!("{bytes} bytes ({})", crate::names::size(bytes))
    } else {
        format!("{bytes} bytes")
    }
}
