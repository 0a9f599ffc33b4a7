//! The pinned host backup of a `Preserve` region, kept across cycles.
//!
//! Pinning is slow (about 0.44 s per GiB on the H200 host), so the buffer is allocated once —
//! at the first release, or when the region is created with `prepin` — and reused by every
//! later cycle; freeing it is an explicit choice ([`crate::Pager::free_backup`]).
//!
//! The backup also remembers one hash per hash chunk of what it holds (the `chunk_hash`
//! kernel, a few milliseconds for 16 GiB on the H200). A release hashes the device contents
//! and copies only the chunks whose hash changed, so releasing weights that were not
//! updated since the last backup or restore costs a hash instead of a copy. The hash is a
//! 64-bit non-cryptographic hash: an accidental collision (a changed chunk with an unchanged
//! hash) has probability about 2^-64 per chunk, and is not guarded against adversaries.

use std::ops::Range;
use std::time::{Duration, Instant};

use crate::backend::{Backend, BackendError, HostBuffer, RawStream};
use crate::kernels;

/// Default hash-chunk size: 32 MiB. Small enough that a partial weight update copies little,
/// large enough that each copy runs at link speed.
pub const DEFAULT_HASH_CHUNK_BYTES: usize = 32 << 20;

/// What a save did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Saved {
    /// Bytes actually copied (changed chunks only).
    pub copied: usize,
    /// Time hashing the device contents.
    pub hash: Duration,
    /// Time copying.
    pub copy: Duration,
}

/// A pinned host copy of a region's leading bytes.
#[derive(Debug, Default)]
pub(crate) struct Backup {
    buf: Option<Box<dyn HostBuffer>>,
    /// Leading bytes of the region the backup holds: what a resume restores.
    held: usize,
    /// Hashes of those bytes, one per hash chunk (None: unknown, the next save copies all).
    hashes: Option<Vec<u64>>,
}

impl Backup {
    /// Leading bytes of the region the backup holds.
    pub fn held(&self) -> usize {
        self.held
    }

    /// Bytes of pinned memory held.
    pub fn bytes(&self) -> usize {
        self.buf.as_ref().map_or(0, |b| b.len())
    }

    /// Pins `size` bytes if nothing is pinned yet. Returns the time it took.
    pub fn ensure(&mut self, backend: &dyn Backend, size: usize) -> Result<Duration, BackendError> {
        if self.buf.is_some() {
            return Ok(Duration::ZERO);
        }
        let t = Instant::now();
        self.buf = Some(backend.alloc_pinned(size)?);
        self.held = 0;
        self.hashes = None;
        Ok(t.elapsed())
    }

    /// The hash-chunk size for `len` bytes: `chunk`, or larger when `len` would need more
    /// hashes than one kernel launch computes.
    pub fn hash_chunk(len: usize, chunk: usize) -> usize {
        chunk.max(len.div_ceil(kernels::MAX_HASH_CHUNKS).next_multiple_of(16))
    }

    /// Copies device `base .. base + len` into the backup. With `skip_unchanged`, hashes the
    /// device range first and copies only the hash chunks whose hash differs from the
    /// backup's. The backup must have been ensured. On error the backup holds nothing (a
    /// copy may have overwritten part of it), so the next save copies everything again.
    ///
    /// # Safety
    /// `base .. base + len` must be mapped device memory of `backend`, not written while this
    /// runs.
    pub unsafe fn save(
        &mut self,
        backend: &dyn Backend,
        base: u64,
        len: usize,
        skip_unchanged: bool,
        hash_chunk: usize,
    ) -> Result<Saved, BackendError> {
        let mut out = Saved::default();
        let old = self.hashes.take().filter(|_| skip_unchanged);
        self.held = 0;
        if len == 0 {
            return Ok(out);
        }
        let chunk = Self::hash_chunk(len, hash_chunk);
        let t = Instant::now();
        let new = if skip_unchanged {
            // SAFETY: the caller guarantees the range is mapped.
            Some(unsafe { backend.chunk_hash(base, len, chunk) }?)
        } else {
            None
        };
        out.hash = t.elapsed();

        let changed = |k: usize| match (&old, &new) {
            (Some(o), Some(n)) => o.get(k) != n.get(k),
            _ => true,
        };
        let runs = changed_runs(kernels::chunk_count(len, chunk), changed);
        let buf = self.buf.as_mut().ok_or_else(|| BackendError::Invalid {
            op: "save",
            reason: "internal: no backup buffer".to_owned(),
        })?;
        let t = Instant::now();
        let host = buf.as_mut_slice();
        let mut enqueue = || -> Result<(), BackendError> {
            for run in &runs {
                let bytes = run.start * chunk..(run.end * chunk).min(len);
                out.copied += bytes.len();
                // SAFETY: the device range is mapped (the caller's contract); the host slice
                // is the backup, which nothing else touches until wait_copies returns below.
                unsafe {
                    backend.copy_to_host_async(&mut host[bytes.clone()], base + bytes.start as u64)
                }?;
            }
            Ok(())
        };
        let enqueued = enqueue();
        // Wait even after a failed enqueue: earlier copies may still be writing the backup.
        let waited = backend.wait_copies();
        enqueued.and(waited)?;
        out.copy = t.elapsed();
        self.hashes = new;
        self.held = len;
        Ok(out)
    }

    /// Enqueues the copy of backup bytes `range` (clipped to [`Backup::held`]) to
    /// device `base + range.start`, on `stream` or the backend's own copy stream. Returns the
    /// bytes enqueued.
    ///
    /// # Safety
    /// `base + range` must be mapped device memory of `backend` until the copy finishes, and
    /// the backup must not be saved into or freed before then (release synchronizes first).
    pub unsafe fn restore_async(
        &self,
        backend: &dyn Backend,
        base: u64,
        range: Range<usize>,
        stream: Option<RawStream>,
    ) -> Result<usize, BackendError> {
        let held = self.held;
        let range = range.start.min(held)..range.end.min(held);
        if range.is_empty() {
            return Ok(0);
        }
        let buf = self.buf.as_ref().ok_or_else(|| BackendError::Invalid {
            op: "restore",
            reason: "internal: saved contents without a backup".to_owned(),
        })?;
        // SAFETY: the caller guarantees the device range stays mapped and the backup
        // untouched until the copy finishes.
        unsafe {
            backend.copy_to_device_async(
                base + range.start as u64,
                &buf.as_slice()[range.clone()],
                stream,
            )
        }?;
        Ok(range.len())
    }

    /// Checks restored device contents `base .. base + held()` against the backup's hashes.
    /// Returns the index of the first hash chunk that differs, if any. Without stored
    /// hashes (saves made with `skip_unchanged` off) it hashes the backup on the host.
    ///
    /// # Safety
    /// The range must be mapped device memory of `backend` with the restore finished.
    pub unsafe fn verify(
        &self,
        backend: &dyn Backend,
        base: u64,
        hash_chunk: usize,
    ) -> Result<Option<usize>, BackendError> {
        let held = self.held;
        if held == 0 {
            return Ok(None);
        }
        let chunk = Self::hash_chunk(held, hash_chunk);
        let want = match (&self.hashes, &self.buf) {
            (Some(h), _) => h.clone(),
            (_, Some(b)) => kernels::reference::chunk_hash(&b.as_slice()[..held], chunk),
            (_, None) => return Ok(None),
        };
        // SAFETY: the caller guarantees the range is mapped and restored.
        let got = unsafe { backend.chunk_hash(base, held, chunk) }?;
        Ok(got.iter().zip(&want).position(|(a, b)| a != b))
    }
}

/// Maximal runs of consecutive indices in `0..n` for which `changed` holds.
fn changed_runs(n: usize, changed: impl Fn(usize) -> bool) -> Vec<Range<usize>> {
    crate::runs::runs((0..n).filter(|&k| changed(k)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_merge_neighbours() {
        let set = [1, 2, 3, 5, 8, 9];
        assert_eq!(
            changed_runs(10, |k| set.contains(&k)),
            vec![1..4, 5..6, 8..10]
        );
        assert_eq!(changed_runs(3, |_| true), vec![0..3]);
        assert!(changed_runs(3, |_| false).is_empty());
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
