//! The backup of a `Preserve` region: pinned host memory (kept across cycles, or given back
//! after each resume) or a file ([`file`](mod@file)), chosen per region ([`Medium`]).
//!
//! Pinning is slow (a large fraction of a second per GiB), so the buffer is allocated once —
//! at the first release that has something to save, or when the region is created with
//! `prepin` — and reused by every later cycle; freeing it is an explicit choice
//! ([`crate::Pager::free_backup`]). A growing region pins the missing backups of all its
//! buffers in one batch ([`crate::backend::Backend::alloc_pinned_many`], or on its first
//! release [`crate::backend::Backend::alloc_pinned_many_from_device`], filled as they are
//! pinned) and hands each its buffer ([`Backup::adopt`], then [`Backup::seed_from_device`]
//! for a filled one).
//!
//! A backup holds some byte ranges of the device range it covers — the live buffers' bytes
//! that were not marked overwritten ([`crate::Pager::set_overwritten`]) at the last save —
//! and keeps track of exactly which: a resume restores those ranges and nothing else.
//!
//! The backup also remembers one hash per hash chunk of the device contents it saved (the
//! `chunk_hash` kernel, which reads at the device's memory bandwidth). A release hashes the
//! device contents and copies only the chunks whose hash changed, so releasing weights that
//! were not updated since the last backup or restore costs a hash instead of a copy. A chunk
//! counts as unchanged only when the backup also held every byte now wanted of it: bytes
//! that were marked at the last save left holes, which the hash cannot vouch for. The hash
//! is a 64-bit non-cryptographic hash: an accidental collision (a changed chunk with an
//! unchanged hash) has probability about 2^-64 per chunk, and is not guarded against
//! adversaries.

use std::ops::Range;
use std::time::{Duration, Instant};

use crate::backend::{Backend, BackendError, BackendResult, DeviceRange, HostBuffer, one_each};
use crate::kernels;
use crate::pump::{Pump, Sink};

pub(crate) mod file;
pub(crate) mod ledger;
mod medium;
mod memory;
mod named;

pub(crate) use ledger::Share;
pub(crate) use medium::Media;
pub use medium::Medium;
use medium::Store;
use memory::MemoryStore;

/// A backup's store in pinned host memory, pinned in a batch with others ([`pin_many`],
/// [`pin_many_from_device`]) for [`Backup::adopt`]: the batching of the pinned-memory media
/// ([`Medium::is_pinned_memory`]), with each store's share of the node's host budget.
#[derive(Debug)]
pub(crate) struct PinnedBackup(MemoryStore);

/// One pinned store per size of `sizes`, in one batch ([`Backend::alloc_pinned_many`]),
/// within the node's host budget; all or nothing.
pub(crate) fn pin_many(
    backend: &dyn Backend,
    media: &Media,
    sizes: &[usize],
) -> BackendResult<Vec<PinnedBackup>> {
    let share = media.reserve(sizes.iter().sum())?;
    let bufs = backend
        .alloc_pinned_many(sizes)
        .and_then(|b| one_each("alloc_pinned_many", b, sizes.len()))?;
    Ok(with_shares(bufs, sizes, share))
}

/// One pinned store per range of `ranges`, filled with the range's device bytes as the
/// batch pins ([`Backend::alloc_pinned_many_from_device`]), within the node's host budget;
/// all or nothing.
///
/// # Safety
/// As [`Backend::alloc_pinned_many_from_device`].
pub(crate) unsafe fn pin_many_from_device(
    backend: &dyn Backend,
    media: &Media,
    ranges: &[DeviceRange],
) -> BackendResult<Vec<PinnedBackup>> {
    let sizes: Vec<usize> = ranges.iter().map(|r| r.bytes).collect();
    let share = media.reserve(sizes.iter().sum())?;
    // SAFETY: the caller's contract.
    let bufs = unsafe { backend.alloc_pinned_many_from_device(ranges) }
        .and_then(|b| one_each("alloc_pinned_many_from_device", b, ranges.len()))?;
    Ok(with_shares(bufs, &sizes, share))
}

/// Each buffer with its part of `share`.
fn with_shares(
    bufs: Vec<Box<dyn HostBuffer>>,
    sizes: &[usize],
    mut share: Share,
) -> Vec<PinnedBackup> {
    bufs.into_iter()
        .zip(sizes)
        .map(|(buf, &len)| PinnedBackup(MemoryStore(buf, share.split(len))))
        .collect()
}

/// Default hash-chunk size: 32 MiB. Small enough that a partial weight update copies little,
/// large enough that each copy runs at link speed.
pub const DEFAULT_HASH_CHUNK_BYTES: usize = 32 << 20;

/// What a save did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Saved {
    /// Bytes copied (changed chunks only), once the pump has finished.
    pub copied: usize,
    /// Time hashing the device contents.
    pub hash: Duration,
}

/// The hashes of the device contents at the last save, one per hash chunk of `chunk` bytes
/// (`None`: not hashed, because the save held none of the chunk's bytes).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Hashes {
    chunk: usize,
    of: Vec<Option<u64>>,
}

/// A pinned host copy of some byte ranges of a region (its live buffers' unmarked bytes).
#[derive(Debug, Default)]
pub(crate) struct Backup {
    buf: Option<Box<dyn Store>>,
    /// The byte ranges (from the backup's start; sorted, disjoint) that hold the device
    /// contents as of the last save: exactly what a resume restores. Everything else in
    /// the buffer is stale or never written and must never reach the device.
    valid: Vec<Range<usize>>,
    /// Bytes of the device range the last save covered (the hash-chunk grid's extent).
    len: usize,
    /// Hashes of the device contents at the last save (None: unknown, the next save copies
    /// everything it saves). A chunk's hash stands for the backup's bytes of that chunk only
    /// where `valid` covers them.
    hashes: Option<Hashes>,
    /// What the backup will hold once the copies of the last save have finished
    /// ([`Backup::commit`]).
    staged: Option<Staged>,
}

/// The state a save leaves once its copies have finished.
#[derive(Debug)]
struct Staged {
    valid: Vec<Range<usize>>,
    hashes: Option<Hashes>,
}

impl Backup {
    /// Bytes the backup validly holds: what a resume restores.
    pub fn held_bytes(&self) -> usize {
        self.valid.iter().map(Range::len).sum()
    }

    /// Whether the backup holds anything a resume would restore.
    pub fn holds_any(&self) -> bool {
        !self.valid.is_empty()
    }

    /// Whether the backup validly holds any byte of `range` (from the backup's start).
    pub fn holds_within(&self, range: &Range<usize>) -> bool {
        !crate::ranges::clip(&self.valid, range).is_empty()
    }

    /// Bytes of the device range the last save covered (0 before the first save).
    pub fn extent(&self) -> usize {
        self.len
    }

    /// Copies the backup's bytes `range` (from its start) into `out` (of `range.len()`
    /// bytes) when the backup validly holds every one of them; returns whether it did. A
    /// file that cannot be read is an error, not "no copy".
    pub fn read(&self, range: Range<usize>, out: &mut [u8]) -> Result<bool, BackendError> {
        if !crate::ranges::covers(&self.valid, &range) || out.len() != range.len() {
            return Ok(false);
        }
        match &self.buf {
            Some(store) if range.end <= store.len() => store.read(range, out).map(|()| true),
            _ => Ok(false),
        }
    }

    /// The host address of the backup's bytes `range` (from its start) when they are in
    /// host memory and the backup validly holds every one of them.
    pub fn host_ptr(&self, range: Range<usize>) -> Option<u64> {
        if !crate::ranges::covers(&self.valid, &range) {
            return None;
        }
        let host = self.buf.as_ref()?.host()?;
        (range.end <= host.len()).then(|| host.as_ptr() as u64 + range.start as u64)
    }

    /// Forgets what the backup holds (its memory or file stays): a resume restores nothing,
    /// and the next save copies everything it saves.
    pub fn forget(&mut self) {
        (self.valid, self.hashes, self.staged) = (Vec::new(), None, None);
    }

    /// Bytes the backup holds room for (host memory, or the file's size).
    pub fn bytes(&self) -> usize {
        self.buf.as_ref().map_or(0, |s| s.len())
    }

    /// Whether the backup has its memory or file.
    pub fn is_pinned(&self) -> bool {
        self.buf.is_some()
    }

    /// Makes the backup's store of `size` bytes for `medium` (pinned on `backend`, or in
    /// `media`'s files) if it has none yet. Returns the time it took.
    pub fn ensure(
        &mut self,
        medium: Medium,
        backend: &dyn Backend,
        media: &Media,
        size: usize,
    ) -> Result<Duration, BackendError> {
        if self.buf.is_some() {
            return Ok(Duration::ZERO);
        }
        let t = Instant::now();
        self.buf = Some(medium.store(backend, media, size)?);
        self.forget();
        Ok(t.elapsed())
    }

    /// Takes `pinned` (pinned elsewhere, in a batch with other backups: [`pin_many`],
    /// [`pin_many_from_device`]) as the backup's store, in place of any it had; the backup
    /// then holds nothing.
    pub fn adopt(&mut self, pinned: PinnedBackup) {
        self.buf = Some(Box::new(pinned.0));
        self.forget();
    }

    /// Pins `size` bytes filled with device `base .. base + size` in one step
    /// ([`Backend::alloc_pinned_from_device`]) if nothing is pinned yet, and seeds the backup
    /// as a save of all of them with hashes would: it validly holds `0..size`, with the hash
    /// of every hash chunk (`hash_chunk`, on the grid of [`Backup::save`] for a device range
    /// of `size` bytes). A save with `skip_unchanged` that follows before the device changes
    /// then copies nothing, and holds what it wants from then on (bytes it does not want,
    /// such as marked ones, drop out). Returns the time pinning and copying took, and the
    /// time hashing took (both zero when something was pinned already). On a hash failure
    /// the buffer is kept but holds nothing (the next save copies everything).
    ///
    /// # Safety
    /// `base .. base + size` must be mapped device memory of `backend`, not written until
    /// the call returns.
    pub unsafe fn ensure_from_device(
        &mut self,
        backend: &dyn Backend,
        media: &Media,
        base: u64,
        size: usize,
        hash_chunk: usize,
    ) -> Result<(Duration, Duration), BackendError> {
        if self.buf.is_some() {
            return Ok((Duration::ZERO, Duration::ZERO));
        }
        let t = Instant::now();
        let share = media.reserve(size)?;
        // SAFETY: the caller's contract.
        let buf = unsafe { backend.alloc_pinned_from_device(size, base) }?;
        let pinned = t.elapsed();
        self.adopt(PinnedBackup(MemoryStore(buf, share)));
        // SAFETY: the caller's contract; the buffer holds a copy of the range, unchanged
        // since.
        let hashed = unsafe { self.seed_from_device(backend, base, size, hash_chunk) }?;
        Ok((pinned, hashed))
    }

    /// Seeds a backup whose buffer (just adopted, e.g. from a batch pinned and filled at
    /// once: [`Backend::alloc_pinned_many_from_device`]) holds a copy of the `size` device
    /// bytes at `base`, as a save of all of them with hashes would
    /// ([`Backup::ensure_from_device`]): it
    /// validly holds `0..size`, with the hash of every hash chunk (`hash_chunk`, on the grid
    /// of [`Backup::save`] for a device range of `size` bytes), so that a save with
    /// `skip_unchanged` before the device changes copies nothing. Returns the time hashing
    /// took. On a hash failure (or a buffer shorter than `size`: `Invalid`) it holds
    /// nothing (the next save copies everything).
    ///
    /// # Safety
    /// `base .. base + size` must be mapped device memory of `backend`, unchanged since it
    /// was copied into the buffer, and not written until the call returns.
    pub unsafe fn seed_from_device(
        &mut self,
        backend: &dyn Backend,
        base: u64,
        size: usize,
        hash_chunk: usize,
    ) -> Result<Duration, BackendError> {
        self.forget();
        self.len = size;
        if self.bytes() < size {
            return Err(BackendError::Internal {
                op: "seed_from_device",
                reason: format!("a backup of {} bytes for {size} device bytes", self.bytes()),
            });
        }
        let t = Instant::now();
        let chunk = Self::hash_chunk(size, hash_chunk);
        let all = 0..kernels::chunk_count(size, chunk);
        // SAFETY: the caller's contract; the device is unchanged since the copy.
        let hashes = unsafe { hash_chunks(backend, base, size, chunk, all) }?;
        self.valid = std::iter::once(0..size).collect();
        self.hashes = Some(hashes);
        Ok(t.elapsed())
    }

    /// The hash-chunk size for `len` bytes: `chunk`, or larger when `len` would need more
    /// hashes than one kernel launch computes.
    pub fn hash_chunk(len: usize, chunk: usize) -> usize {
        chunk.max(len.div_ceil(kernels::MAX_HASH_CHUNKS).next_multiple_of(16))
    }

    /// Starts saving the device bytes `want` (offsets from `base`; sorted, disjoint, inside
    /// `0..len`) into the backup through `pump`. Once the caller has seen the pump's scope
    /// succeed and called [`Backup::commit`], the backup validly holds exactly `want`: bytes
    /// it held before outside `want` are forgotten (never restored again). Until then, and
    /// for good after a failure (a copy may have overwritten part of it), it holds nothing,
    /// so the next save copies everything again. `len` is the extent of the device range,
    /// which fixes the hash-chunk grid (keep it the same across saves of one backup).
    ///
    /// With `skip_unchanged`, hashes the hash chunks that share a byte with `want` (and
    /// only those: a save of nothing hashes nothing) and skips a chunk's part of `want` when
    /// both hold: the chunk's hash equals the one stored at the last save, and the last save
    /// held every byte of that part. A chunk that held marked (unsaved) bytes at the last
    /// save has holes in the backup, so those bytes are copied now, whatever the hash says.
    /// The backup must have been ensured when `want` is not empty.
    ///
    /// # Safety
    /// `base .. base + len` must be mapped device memory of `backend`, not written, until
    /// the pump's scope returns; `pump` runs on `backend`.
    // The device range, what to save of it, how to hash it, and the pump: a struct for them
    // would only rename the arguments.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn save<'h>(
        &'h mut self,
        backend: &dyn Backend,
        base: u64,
        len: usize,
        want: &[Range<usize>],
        skip_unchanged: bool,
        hash_chunk: usize,
        pump: &mut Pump<'_, 'h>,
    ) -> Result<Saved, BackendError> {
        let Backup {
            buf,
            valid,
            len: extent,
            hashes,
            staged,
        } = self;
        let mut out = Saved::default();
        let chunk = Self::hash_chunk(len, hash_chunk);
        let old = hashes.take().filter(|h| skip_unchanged && h.chunk == chunk);
        let old_valid = std::mem::take(valid);
        *extent = len;
        *staged = None;
        let want: Vec<Range<usize>> = crate::ranges::clip(want, &(0..len));
        if want.is_empty() {
            *staged = Some(Staged {
                valid: Vec::new(),
                hashes: None,
            });
            return Ok(out);
        }
        // Each wanted byte's hash chunk, and its parts of `want`.
        let parts = by_chunk(&want, chunk);
        let t = Instant::now();
        let new = if skip_unchanged {
            // SAFETY: the caller guarantees the range is mapped.
            Some(unsafe { hash_chunks(backend, base, len, chunk, parts.iter().map(|(k, _)| *k)) }?)
        } else {
            None
        };
        out.hash = t.elapsed();

        let unchanged = |k: usize, part: &Range<usize>| match (&old, &new) {
            (Some(o), Some(n)) => {
                let (was, now) = (o.of.get(k).copied().flatten(), n.of[k]);
                was.is_some() && was == now && crate::ranges::covers(&old_valid, part)
            }
            _ => false,
        };
        let changed = parts.iter().filter(|(k, part)| !unchanged(*k, part));
        let runs = crate::ranges::bridge(changed.map(|(_, part)| part.clone()).collect(), 0);
        let store = buf.as_mut().ok_or_else(|| BackendError::Internal {
            op: "save",
            reason: "no backup buffer".to_owned(),
        })?;
        if store.len() < len {
            return Err(BackendError::Internal {
                op: "save",
                reason: format!("a backup of {} bytes for {len} device bytes", store.len()),
            });
        }
        // SAFETY: the caller's contract covers the device ranges (inside `base .. base +
        // len`); the store is the backup's, borrowed by the pump for its scope.
        out.copied = unsafe { store.save(backend, base, &runs, pump) }?;
        *staged = Some(Staged {
            valid: want,
            hashes: new,
        });
        Ok(out)
    }

    /// Makes the last save's contents the backup's, once its copies have finished.
    pub fn commit(&mut self) {
        if let Some(s) = self.staged.take() {
            self.valid = s.valid;
            self.hashes = s.hashes;
        }
    }

    /// Sends the bytes of `ranges` (offsets from the backup's start) that the backup validly
    /// holds to device `base + ` their offsets through `sink`, one push per held span. Bytes
    /// it does not hold are left as they are. Returns the bytes sent.
    ///
    /// # Safety
    /// As [`Sink::push_to_device`] for each device range `base + range`; for a stream sink, the
    /// backup is not saved into or freed before the stream has run the copies (release and
    /// `free_backup` synchronize first).
    pub unsafe fn restore<'h>(
        &'h self,
        backend: &dyn Backend,
        base: u64,
        ranges: &[Range<usize>],
        sink: &mut Sink<'_, '_, 'h>,
    ) -> Result<usize, BackendError> {
        let mut sent = 0;
        let store = match &self.buf {
            Some(s) => s,
            None if self.valid.is_empty() => return Ok(0),
            None => {
                return Err(BackendError::Internal {
                    op: "restore",
                    reason: "saved contents without a backup".to_owned(),
                });
            }
        };
        for range in ranges {
            let spans = crate::ranges::clip(&self.valid, range);
            // SAFETY: as this function's contract; the spans lie inside `range`.
            sent += unsafe { store.restore(backend, base, &spans, sink) }?;
        }
        Ok(sent)
    }

    /// Checks the restored device contents against the backup, over exactly the bytes it
    /// validly holds. Returns the offset (from the backup's start) of the first span that
    /// differs, if any. Whole hash chunks with a stored hash are checked by hashing the
    /// device only (a few ms for 16 GiB); parts of chunks (next to marked bytes) and saves
    /// made without hashes are hashed on the host as well, and their first unaligned bytes
    /// (the kernel reads from 16-byte boundaries) are read back and compared.
    ///
    /// # Safety
    /// The held ranges must be mapped device memory of `backend` with the restore finished.
    pub unsafe fn verify(
        &self,
        backend: &dyn Backend,
        base: u64,
        hash_chunk: usize,
    ) -> Result<Option<usize>, BackendError> {
        if self.valid.is_empty() {
            return Ok(None);
        }
        let Some(store) = &self.buf else {
            return Ok(None);
        };
        let chunk = Self::hash_chunk(self.len, hash_chunk);
        let stored = self.hashes.as_ref().filter(|h| h.chunk == chunk);
        let mut whole = Vec::new();
        for (k, part) in by_chunk(&self.valid, chunk) {
            let full = part.start == k * chunk && part.end == ((k + 1) * chunk).min(self.len);
            match stored.and_then(|h| h.of.get(k).copied().flatten()) {
                Some(h) if full => whole.push((k, h)),
                // SAFETY: `part` is held, so mapped and restored (the caller's contract).
                _ => match unsafe { verify_part(backend, base, store.as_ref(), &part) }? {
                    true => {}
                    false => return Ok(Some(part.start)),
                },
            }
        }
        for run in crate::runs::runs(whole.iter().map(|(k, _)| *k)) {
            let bytes = run.start * chunk..(run.end * chunk).min(self.len);
            // SAFETY: these chunks are held whole, so mapped and restored.
            let got = unsafe { backend.chunk_hash(base + bytes.start as u64, bytes.len(), chunk) }?;
            let want = whole.iter().filter(|(k, _)| run.contains(k));
            for ((k, want), got) in want.zip(got) {
                if *want != got {
                    return Ok(Some(k * chunk));
                }
            }
        }
        Ok(None)
    }
}

/// The hashes of device `base .. base + len` on the grid of `chunk` bytes, for the chunks
/// `chunks` (ascending indices; each hashed once, consecutive ones in one launch) and `None`
/// for the others: what [`Backup::save`] stores and compares.
///
/// # Safety
/// The named chunks of `base .. base + len` are mapped device memory of `backend`.
unsafe fn hash_chunks(
    backend: &dyn Backend,
    base: u64,
    len: usize,
    chunk: usize,
    chunks: impl Iterator<Item = usize>,
) -> Result<Hashes, BackendError> {
    let mut of = vec![None; kernels::chunk_count(len, chunk)];
    for run in crate::runs::runs(chunks) {
        let bytes = run.start * chunk..(run.end * chunk).min(len);
        // SAFETY: the caller guarantees the range is mapped.
        let h = unsafe { backend.chunk_hash(base + bytes.start as u64, bytes.len(), chunk) }?;
        for (k, h) in run.zip(h) {
            if let Some(slot) = of.get_mut(k) {
                *slot = Some(h);
            }
        }
    }
    Ok(Hashes { chunk, of })
}

/// Whether device `base + part` equals the backup's bytes `part`: the part from its first
/// 16-byte boundary by one device hash against the host reference, the bytes before it read
/// back. A file backup's part is read from the file (that part only).
///
/// # Safety
/// `base + part` must be mapped device memory of `backend`.
unsafe fn verify_part(
    backend: &dyn Backend,
    base: u64,
    store: &dyn Store,
    part: &Range<usize>,
) -> Result<bool, BackendError> {
    let read;
    let host: &[u8] = match store.host().and_then(|h| h.get(part.clone())) {
        Some(bytes) => bytes,
        None => {
            let mut bytes = vec![0u8; part.len()];
            store.read(part.clone(), &mut bytes)?;
            read = bytes;
            &read
        }
    };
    let aligned = ((base + part.start as u64).next_multiple_of(16) - base) as usize;
    let head = 0..aligned.min(part.end) - part.start;
    if !head.is_empty() {
        let mut got = vec![0u8; head.len()];
        // SAFETY: inside `part`, mapped (the caller's contract).
        unsafe { backend.copy_to_host(&mut got, base + part.start as u64) }?;
        if got != host[head.clone()] {
            return Ok(false);
        }
    }
    if head.end < host.len() {
        let rest = head.end..host.len();
        let chunk = rest.len().next_multiple_of(16);
        let at = base + (part.start + rest.start) as u64;
        // SAFETY: inside `part`, mapped, and 16-byte aligned.
        let got = unsafe { backend.chunk_hash(at, rest.len(), chunk) }?;
        let want = kernels::reference::chunk_hash(&host[rest], chunk);
        return Ok(got == want);
    }
    Ok(true)
}

/// Splits sorted, disjoint `spans` at the multiples of `chunk`: (hash-chunk index, part), in
/// order.
fn by_chunk(spans: &[Range<usize>], chunk: usize) -> Vec<(usize, Range<usize>)> {
    let mut out = Vec::new();
    for s in spans {
        let mut at = s.start;
        while at < s.end {
            let k = at / chunk;
            let end = ((k + 1) * chunk).min(s.end);
            out.push((k, at..end));
            at = end;
        }
    }
    out
}

#[cfg(test)]
#[allow(clippy::single_range_in_vec_init)] // a list of one span is a valid `want`
mod tests {
    use super::*;
    use crate::backend::host::{HostBackend, HostConfig};
    use crate::backend::{Mapping, Reservation};
    use std::sync::Arc;

    const G: usize = 64 << 10;

    /// A host backend with `len` bytes mapped: (backend, device address, its mappings).
    fn device(len: usize) -> (HostBackend, u64, Vec<Box<dyn Mapping>>) {
        let b = HostBackend::new(HostConfig {
            capacity: len,
            granularity: G,
        });
        let r: Arc<dyn Reservation> = b.reserve(len).unwrap();
        // SAFETY: a fresh reservation of this backend, nothing mapped in it yet.
        let maps = unsafe { b.map(&r, 0, &[len]) }.unwrap();
        (b, r.base(), maps)
    }

    /// Saves through a pump on the host backend and commits, as a release does.
    ///
    /// # Safety
    /// `base .. base + len` is mapped and not written meanwhile.
    unsafe fn save_with(
        backup: &mut Backup,
        b: &HostBackend,
        base: u64,
        len: usize,
        want: &[Range<usize>],
        skip: bool,
        chunk: usize,
    ) -> Saved {
        let (saved, _) = crate::pump::scope(
            b,
            crate::pump::PumpConfig::default(),
            &crate::pump::Traffic::default(),
            // SAFETY: the caller's contract.
            |p| unsafe { backup.save(b, base, len, want, skip, chunk, p) },
            |e| e,
        )
        .unwrap();
        backup.commit();
        saved
    }

    /// Restores `range` through a pump on the host backend; the bytes sent.
    ///
    /// # Safety
    /// The device range is mapped.
    unsafe fn restore_with(
        backup: &Backup,
        b: &HostBackend,
        base: u64,
        range: Range<usize>,
    ) -> usize {
        crate::pump::scope(
            b,
            crate::pump::PumpConfig::default(),
            &crate::pump::Traffic::default(),
            |p| {
                let mut sink = Sink::Pump(p);
                // SAFETY: the caller's contract.
                unsafe { backup.restore(b, base, &[range], &mut sink) }
            },
            |e| e,
        )
        .unwrap()
        .0
    }

    fn put(b: &HostBackend, at: u64, data: &[u8]) {
        // SAFETY: inside the mapped test range.
        unsafe { b.copy_to_device(at, data) }.unwrap();
    }

    fn get(b: &HostBackend, at: u64, len: usize) -> Vec<u8> {
        let mut out = vec![0; len];
        // SAFETY: inside the mapped test range.
        unsafe { b.copy_to_host(&mut out, at) }.unwrap();
        out
    }

    fn bytes(len: usize, seed: u8) -> Vec<u8> {
        (0..len)
            .map(|i| (i as u8).wrapping_mul(31) ^ seed)
            .collect()
    }

    /// Restores the whole backup over a device poisoned with 0xEE and reads it back.
    fn restored(backup: &Backup, b: &HostBackend, base: u64, len: usize) -> (usize, Vec<u8>) {
        put(b, base, &vec![0xEE; len]);
        // SAFETY: mapped, and the host backend copies synchronously.
        let n = unsafe { restore_with(backup, b, base, 0..len) };
        (n, get(b, base, len))
    }

    fn save_hashed(
        backup: &mut Backup,
        b: &HostBackend,
        base: u64,
        len: usize,
        want: &[Range<usize>],
        chunk: usize,
    ) -> Saved {
        // SAFETY: the test's range is mapped and nothing writes it meanwhile.
        unsafe { save_with(backup, b, base, len, want, true, chunk) }
    }

    #[test]
    fn a_save_holds_exactly_what_it_wanted() {
        let len = 4 * G;
        let (b, base, _maps) = device(len);
        let data = bytes(len, 1);
        put(&b, base, &data);
        let mut backup = Backup::default();
        backup
            .ensure(Medium::Pinned, &b, &Media::new(1 << 20, usize::MAX), len)
            .unwrap();
        let want = vec![100..5000, G..2 * G + 7, 3 * G + 1..len];
        for skip in [false, true] {
            // SAFETY: mapped, not written meanwhile.
            let saved = unsafe { save_with(&mut backup, &b, base, len, &want, skip, 1024) };
            assert_eq!(saved.copied, want.iter().map(Range::len).sum::<usize>());
            assert_eq!(backup.held_bytes(), saved.copied);
            let (n, got) = restored(&backup, &b, base, len);
            assert_eq!(n, saved.copied);
            for (i, (g, d)) in got.iter().zip(&data).enumerate() {
                let held = want.iter().any(|w| w.contains(&i));
                assert_eq!(*g, if held { *d } else { 0xEE }, "byte {i} (held {held})");
            }
            // A partial restore restores the held part of the range only.
            put(&b, base, &vec![0xEE; len]);
            // SAFETY: as above.
            let n = unsafe { restore_with(&backup, &b, base, 4000..G + 10) };
            assert_eq!(n, 1000 + 10);
            put(&b, base, &data);
        }
        // SAFETY: as above. Nothing wanted: nothing hashed, copied or held.
        let saved = unsafe { save_with(&mut backup, &b, base, len, &[], true, 1024) };
        assert_eq!(saved, Saved::default());
        assert!(!backup.holds_any());
        assert_eq!(restored(&backup, &b, base, len), (0, vec![0xEE; len]));
    }

    /// The case the hash alone gets wrong: a chunk saved with a hole (marked bytes), then
    /// wanted whole while the device still holds exactly what it held (a GPU's physical
    /// memory often comes back with its old contents). Its hash is unchanged, yet the
    /// backup lacks the hole's bytes: they must be copied.
    #[test]
    fn a_chunk_with_a_hole_is_copied_even_when_its_hash_matches() {
        let (len, chunk) = (4 * G, G);
        let (b, base, _maps) = device(len);
        let data = bytes(len, 2);
        put(&b, base, &data);
        let mut backup = Backup::default();
        backup
            .ensure(Medium::Pinned, &b, &Media::new(1 << 20, usize::MAX), len)
            .unwrap();
        let all = vec![0..len];
        let hole = G + 100..G + 300;
        let holed = vec![0..hole.start, hole.end..len];
        let s1 = save_hashed(&mut backup, &b, base, len, &holed, chunk);
        assert_eq!(s1.copied, len - hole.len());
        let s2 = save_hashed(&mut backup, &b, base, len, &all, chunk);
        assert_eq!(
            s2.copied, chunk,
            "the chunk with the hole, whole; the others unchanged"
        );
        assert_eq!(restored(&backup, &b, base, len), (len, data.clone()));
        put(&b, base, &data);
        let s3 = save_hashed(&mut backup, &b, base, len, &all, chunk);
        assert_eq!(s3.copied, 0, "unchanged and held whole: nothing to copy");
        // A chunk not hashed last time (none of it wanted) is copied when wanted again.
        let first_only = vec![0..chunk];
        let s4 = save_hashed(&mut backup, &b, base, len, &first_only, chunk);
        assert_eq!(s4.copied, 0);
        let s5 = save_hashed(&mut backup, &b, base, len, &all, chunk);
        assert_eq!(s5.copied, len - chunk);
        assert_eq!(restored(&backup, &b, base, len), (len, data));
    }

    #[test]
    fn verify_checks_held_bytes_only() {
        let len = 4 * G;
        let (b, base, _maps) = device(len);
        let data = bytes(len, 3);
        put(&b, base, &data);
        for skip in [false, true] {
            let mut backup = Backup::default();
            backup
                .ensure(Medium::Pinned, &b, &Media::new(1 << 20, usize::MAX), len)
                .unwrap();
            let want = vec![3..G + 5, 2 * G..4 * G];
            // SAFETY: mapped, not written meanwhile.
            unsafe { save_with(&mut backup, &b, base, len, &want, skip, 4096) };
            // Bytes not held may hold anything.
            put(&b, base + G as u64 + 5, &vec![0x55; G - 5]);
            // SAFETY: mapped.
            assert_eq!(unsafe { backup.verify(&b, base, 4096) }.unwrap(), None);
            for at in [4usize, 2000, G + 4, 3 * G + 17] {
                put(&b, base + at as u64, &[data[at] ^ 1]);
                // SAFETY: mapped.
                let bad = unsafe { backup.verify(&b, base, 4096) }.unwrap();
                let bad = bad.expect("a flipped held byte is found");
                assert!(bad <= at && at - bad < 4096, "{bad} for {at}");
                put(&b, base + at as u64, &[data[at]]);
            }
            put(&b, base, &data);
        }
    }

    #[test]
    fn hash_chunk_respects_the_launch_limit() {
        assert_eq!(Backup::hash_chunk(1 << 30, 32 << 20), 32 << 20);
        let huge = 1usize << 44;
        let c = Backup::hash_chunk(huge, 32 << 20);
        assert!(huge.div_ceil(c) <= kernels::MAX_HASH_CHUNKS);
        assert_eq!(c % 16, 0);
    }
}
