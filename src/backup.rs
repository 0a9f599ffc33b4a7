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

use crate::backend::{Backend, BackendError, HostBuffer};
use crate::kernels;
use crate::pump::{Pinned, PinnedMut, Pump, Sink};

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

/// A pinned host copy of a region's leading bytes.
#[derive(Debug, Default)]
pub(crate) struct Backup {
    buf: Option<Box<dyn HostBuffer>>,
    /// Leading bytes of the region the backup holds: what a resume restores.
    held: usize,
    /// Hashes of those bytes, one per hash chunk (None: unknown, the next save copies all).
    hashes: Option<Vec<u64>>,
    /// What the backup will hold once the copies of the last save have finished
    /// ([`Backup::commit`]).
    staged: Option<Staged>,
}

/// The state a save leaves once its copies have finished.
#[derive(Debug)]
struct Staged {
    held: usize,
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
        self.staged = None;
        Ok(t.elapsed())
    }

    /// The hash-chunk size for `len` bytes: `chunk`, or larger when `len` would need more
    /// hashes than one kernel launch computes.
    pub fn hash_chunk(len: usize, chunk: usize) -> usize {
        chunk.max(len.div_ceil(kernels::MAX_HASH_CHUNKS).next_multiple_of(16))
    }

    /// Starts copying device `base .. base + len` into the backup through `pump`. With
    /// `skip_unchanged`, hashes the device range first and copies only the hash chunks whose
    /// hash differs from the backup's. The backup must have been ensured. From here on the
    /// backup holds nothing until [`Backup::commit`], which the caller calls once the pump's
    /// scope has succeeded; after a failure it stays so (a copy may have overwritten part
    /// of it), and the next save copies everything again.
    ///
    /// # Safety
    /// `base .. base + len` must be mapped device memory of `backend`, not written, until
    /// the pump's scope returns; `pump` runs on `backend`.
    pub unsafe fn save<'h>(
        &'h mut self,
        backend: &dyn Backend,
        base: u64,
        len: usize,
        skip_unchanged: bool,
        hash_chunk: usize,
        pump: &mut Pump<'_, 'h>,
    ) -> Result<Saved, BackendError> {
        let Backup {
            buf,
            held,
            hashes,
            staged,
        } = self;
        let mut out = Saved::default();
        let old = hashes.take().filter(|_| skip_unchanged);
        *held = 0;
        *staged = None;
        if len == 0 {
            *staged = Some(Staged {
                held: 0,
                hashes: None,
            });
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
        let runs: Vec<Range<usize>> = changed_runs(kernels::chunk_count(len, chunk), changed)
            .into_iter()
            .map(|run| run.start * chunk..(run.end * chunk).min(len))
            .collect();
        let buf = buf.as_mut().ok_or_else(|| BackendError::Invalid {
            op: "save",
            reason: "internal: no backup buffer".to_owned(),
        })?;
        // SAFETY: the caller's contract covers the device ranges (inside `base .. base +
        // len`); the host side is the backup, borrowed by the pump for its scope.
        out.copied = unsafe { copy_out(PinnedMut::new(buf.as_mut()), base, &runs, pump) }?;
        *staged = Some(Staged {
            held: len,
            hashes: new,
        });
        Ok(out)
    }

    /// Makes the last save's contents the backup's, once its copies have finished.
    pub fn commit(&mut self) {
        if let Some(s) = self.staged.take() {
            self.held = s.held;
            self.hashes = s.hashes;
        }
    }

    /// Sends the backup's bytes `ranges` (offsets from the backup's start, each clipped to
    /// [`Backup::held`]) to device `base + offset` through `sink`. Returns the bytes sent.
    ///
    /// # Safety
    /// As [`Sink::push_to_device`] for each device range `base + range`; for a stream sink, the
    /// backup is not saved into or freed before the stream has run the copies (release and
    /// `free_backup` synchronize first).
    pub unsafe fn restore<'h>(
        &'h self,
        base: u64,
        ranges: &[Range<usize>],
        sink: &mut Sink<'_, '_, 'h>,
    ) -> Result<usize, BackendError> {
        let held = self.held;
        let mut sent = 0;
        for range in ranges {
            let range = range.start.min(held)..range.end.min(held);
            if range.is_empty() {
                continue;
            }
            let buf = self.buf.as_ref().ok_or_else(|| BackendError::Invalid {
                op: "restore",
                reason: "internal: saved contents without a backup".to_owned(),
            })?;
            let src = Pinned::new(buf.as_ref())
                .get(range.clone())
                .ok_or_else(|| BackendError::Invalid {
                    op: "restore",
                    reason: format!(
                        "internal: backup bytes {range:?} outside its {} bytes",
                        buf.len()
                    ),
                })?;
            // SAFETY: as this function's contract.
            unsafe { sink.push_to_device(src, base + range.start as u64) }?;
            sent += range.len();
        }
        Ok(sent)
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

/// Pushes the copies of device `base + r` into `dst[r]` for each of `ranges` (sorted,
/// disjoint, inside `dst`) into `pump`. Returns the bytes pushed.
///
/// # Safety
/// Each device range `base + r` is mapped memory of the pump's backend, not written until
/// the pump's scope returns.
unsafe fn copy_out<'h>(
    dst: PinnedMut<'h>,
    base: u64,
    ranges: &[Range<usize>],
    pump: &mut Pump<'_, 'h>,
) -> Result<usize, BackendError> {
    let bad = |r: &Range<usize>| BackendError::Invalid {
        op: "save",
        reason: format!("internal: backup ranges out of order or outside the backup at {r:?}"),
    };
    let (mut rest, mut at, mut copied) = (dst, 0usize, 0usize);
    for r in ranges {
        let skip = r.start.checked_sub(at).ok_or_else(|| bad(r))?;
        let (_, tail) = rest.split_at(skip).ok_or_else(|| bad(r))?;
        let (part, tail) = tail.split_at(r.len()).ok_or_else(|| bad(r))?;
        // SAFETY: the caller's contract covers the device range; `part` is the backup's
        // bytes `r`, borrowed by the pump.
        unsafe { pump.push_to_host(base + r.start as u64, part) }?;
        (rest, at) = (tail, r.end);
        copied += r.len();
    }
    Ok(copied)
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
