//! A region's backups: pinning them (ahead with `prepin`, or at the release that needs
//! them), a first backup pinned and filled from the device in one pass, and giving host
//! backups back. The save and the restore themselves are [`Region::save`] and
//! [`Region::map_and_restore`]; the buffers are [`crate::backup`]'s.

use super::*;

impl Region {
    /// Pins the backup at region offset `start` for `len` bytes (creates its file, for
    /// [`Medium::File`]) unless it has one. Returns the time it took.
    pub(super) fn pin(
        &mut self,
        backend: &dyn Backend,
        start: usize,
        len: usize,
    ) -> Result<Duration> {
        let what = match self.medium.uses_files() {
            true => "creating the backup file",
            false => "pinning the host backup",
        };
        self.backups
            .entry(start)
            .or_default()
            .ensure(self.medium, backend, &self.media, len)
            .map_err(|e| Error::backend(&self.tag, what, e))
    }

    /// Pins the backups now, for a creation that asks again for this region with `prepin`:
    /// a fixed `Preserve` region's one backup, or (growing) each live buffer's, and every
    /// later buffer's when it is allocated. Nothing for other policies or `Medium::Host`.
    pub fn prepin_now(&mut self, backend: &dyn Backend) -> Result<()> {
        if self.policy != Policy::Preserve || !self.medium.can_prepin() {
            return Ok(());
        }
        if self.growing() {
            self.prepin = true;
            self.ensure_backup(backend, 0)?;
        } else {
            self.pin(backend, 0, self.size())?;
        }
        Ok(())
    }

    /// Gives back the host memory of a [`Medium::Host`] region's backups (after a resume
    /// restored them). Returns the bytes given back.
    pub fn give_back_host_backups(&mut self) -> usize {
        if !self.medium.gives_back_after_resume() {
            return 0;
        }
        let bytes = self.backup_bytes();
        self.backups.clear();
        bytes
    }

    /// The host address of the backup's copy of region bytes `range`, when a backup in host
    /// memory validly holds all of them.
    pub fn backup_host_ptr(&self, range: Range<usize>) -> Option<u64> {
        backup_at(&self.backups, range.start)
            .and_then(|(start, b)| b.host_ptr(range.start - start..range.end - start))
    }

    /// The backups that a release with copy gap `gap` needs and that are not pinned, as
    /// (region offset, bytes of the device range they cover): see `save_plan`; a buffer
    /// marked whole needs none. Drops the backups of buffers freed or reallocated at another
    /// size first (keeping those of live buffers, pinned at their size or not yet pinned).
    fn missing_backups(&mut self, gap: usize) -> Vec<(usize, usize)> {
        let plan = self.save_plan(gap);
        self.backups.retain(|start, b| {
            plan.iter()
                .any(|(s, len, _)| s == start && (b.bytes() == 0 || b.bytes() >= *len))
        });
        plan.into_iter()
            .filter(|(start, _, want)| {
                !want.is_empty() && !self.backups.get(start).is_some_and(Backup::is_pinned)
            })
            .map(|(start, len, _)| (start, len))
            .collect()
    }

    /// Allocates the pinned backups that a release with copy gap `gap` needs and that are
    /// missing: one of the region's size for a fixed region with something to save; one per
    /// live buffer with something to save for a growing one (a buffer marked whole needs
    /// none), all pinned in one batch ([`Backend::alloc_pinned_many`]; all or nothing: on
    /// failure none of them is pinned). Drops the backups of freed buffers. Returns the
    /// time the pinning took.
    pub fn ensure_backup(&mut self, backend: &dyn Backend, gap: usize) -> Result<Duration> {
        let missing = self.missing_backups(gap);
        if !self.medium.is_pinned_memory() {
            // One by one; on failure the ones just made are deleted again.
            let t = Instant::now();
            for (k, &(start, len)) in missing.iter().enumerate() {
                if let Err(e) = self.pin(backend, start, len) {
                    for &(s, _) in &missing[..k] {
                        self.backups.remove(&s);
                    }
                    return Err(e);
                }
            }
            return Ok(t.elapsed());
        }
        match missing[..] {
            [] => Ok(Duration::ZERO),
            [(start, len)] if !self.growing() => self.pin(backend, start, len),
            _ => {
                let t = Instant::now();
                let sizes: Vec<usize> = missing.iter().map(|&(_, len)| len).collect();
                let pinned = crate::backup::pin_many(backend, &self.media, &sizes)
                    .map_err(|e| Error::backend(&self.tag, "pinning the host backups", e))?;
                let pinning = t.elapsed();
                for (&(start, _), p) in missing.iter().zip(pinned) {
                    self.backups.entry(start).or_default().adopt(p);
                }
                Ok(pinning)
            }
        }
    }

    /// A resident `Preserve` region's first backups, pinned and filled in one pass when a
    /// release with copy gap `gap` has something to save and they are not pinned yet, so
    /// that the save that follows (with `skip_unchanged`, the same `hash_chunk`) copies
    /// nothing: a fixed region's one backup ([`Backup::ensure_from_device`]: the whole region
    /// copied while it pins, then hashed); a growing region's missing backups, one per live
    /// buffer with something to save, in one batch
    /// ([`Backend::alloc_pinned_many_from_device`]: each buffer's whole extent copied while
    /// the batch pins; then each backup seeded with [`Backup::seed_from_device`]; all or
    /// nothing: on failure none of them is pinned, but when hashing fails, after which the
    /// backups stay pinned holding nothing). Backups already pinned are left to
    /// [`Region::ensure_backup`] and the save. Returns the time pinning and copying took,
    /// the time hashing took, and the bytes copied.
    pub fn first_backup_from_device(
        &mut self,
        backend: &dyn Backend,
        gap: usize,
        hash_chunk: usize,
    ) -> Result<(Duration, Duration, usize)> {
        let none = (Duration::ZERO, Duration::ZERO, 0);
        if self.policy != Policy::Preserve || !self.is_resident() || !self.medium.is_pinned_memory()
        {
            return Ok(none);
        }
        if self.growing() {
            return self.first_backups_of_buffers(backend, gap, hash_chunk);
        }
        let Some((start, len, want)) = self.save_plan(gap).into_iter().next() else {
            return Ok(none);
        };
        if want.is_empty()
            || self.backups.get(&start).is_some_and(|b| b.bytes() > 0)
            || self.has_marks_within(&(start..start + len))
        {
            return Ok(none);
        }
        let base = self.base() + start as u64;
        let backup = self.backups.entry(start).or_default();
        // SAFETY: the region is fixed and resident, so `base .. base + len` (the whole
        // region) is mapped; the pager holds its lock after a synchronize until the release
        // returns, so nothing unmaps or writes it meanwhile (engine kernels launched later
        // are the caller's contract, as for any raw pointer).
        let (pin, hash) =
            unsafe { backup.ensure_from_device(backend, &self.media, base, len, hash_chunk) }
                .map_err(|e| Error::backend(&self.tag, "pinning the host backup", e))?;
        Ok((pin, hash, len))
    }

    /// [`Region::first_backup_from_device`] for a growing region: its missing backups in one
    /// batch, filled as they are pinned, then seeded.
    fn first_backups_of_buffers(
        &mut self,
        backend: &dyn Backend,
        gap: usize,
        hash_chunk: usize,
    ) -> Result<(Duration, Duration, usize)> {
        let missing: Vec<(usize, usize)> = self
            .missing_backups(gap)
            .into_iter()
            .filter(|&(start, len)| !self.has_marks_within(&(start..start + len)))
            .collect();
        if missing.is_empty() {
            return Ok((Duration::ZERO, Duration::ZERO, 0));
        }
        let base = self.base();
        let ranges: Vec<DeviceRange> = missing
            .iter()
            .map(|&(start, len)| DeviceRange {
                src: base + start as u64,
                bytes: len,
            })
            .collect();
        let pinning = |e| Error::backend(&self.tag, "pinning the host backups", e);
        let t = Instant::now();
        // SAFETY: the region is resident, so each live buffer's extent (`missing` names live
        // buffers only) is mapped; the pager holds its lock after a synchronize until the
        // release returns, so nothing unmaps or writes them meanwhile (engine kernels
        // launched later are the caller's contract, as for any raw pointer).
        let pinned = unsafe { crate::backup::pin_many_from_device(backend, &self.media, &ranges) }
            .map_err(pinning)?;
        let pin = t.elapsed();
        // Every buffer is adopted before any is hashed: a failed hash leaves them all pinned.
        for (&(start, _), p) in missing.iter().zip(pinned) {
            self.backups.entry(start).or_default().adopt(p);
        }
        let (mut hash, mut copied) = (Duration::ZERO, 0);
        for (&(start, _), r) in missing.iter().zip(&ranges) {
            let backup = self.backups.entry(start).or_default();
            // SAFETY: as above; the buffer was just filled with a copy of `r`, unchanged since.
            hash += unsafe { backup.seed_from_device(backend, r.src, r.bytes, hash_chunk) }
                .map_err(|e| Error::backend(&self.tag, "hashing the host backups", e))?;
            copied += r.bytes;
        }
        Ok((pin, hash, copied))
    }
}
