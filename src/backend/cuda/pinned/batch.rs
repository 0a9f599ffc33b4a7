//! Pinning many buffers in one batch ([`CudaBackend::pin_many`], behind
//! [`crate::backend::Backend::alloc_pinned_many`]: a growing region's first release pins the
//! backups of all its buffers at once): one mapping, each buffer's slice rounded up to
//! [`HUGE_PAGE_BYTES`], touched once on every core, then one registration per buffer (so
//! that no copy spans two). The buffers share the mapping: dropping one unregisters its
//! slice and gives its pages back with `madvise(MADV_DONTNEED)` (unmapping a sub-range would
//! leave a hole a later `mmap` could take, under the final `munmap`); the last one to drop
//! unmaps the whole range. [`CudaBackend::pin_many_from_device`] lays the batch out the same
//! way and fills it from the device in the pipeline of [`CudaBackend::pin_from_device`],
//! over parts of whole buffers.

use std::ops::Range;

use super::{
    AnonMemory, CudaPinned, HUGE_PAGE_BYTES, cores, pipeline, pipeline_touch_threads,
    register_and_copy, touch, touch_each, touch_threads,
};
use crate::backend::cuda::CudaBackend;
use crate::backend::{BackendError, BackendResult, DeviceRange};

/// Where each buffer of a batch of `sizes` lies in the batch's mapping: back to back, each
/// its size rounded up to [`HUGE_PAGE_BYTES`] (so that freeing one never splits a huge page
/// of another). Returns the slices and their total.
///
/// Errors ([`BackendError::Invalid`]): a size of 0, or a total that overflows `usize`.
pub(super) fn slices(sizes: &[usize]) -> BackendResult<(Vec<Range<usize>>, usize)> {
    let invalid = |reason: String| BackendError::Invalid {
        op: "alloc_pinned_many",
        reason,
    };
    let mut out = Vec::with_capacity(sizes.len());
    let mut total = 0usize;
    for (k, &n) in sizes.iter().enumerate() {
        if n == 0 {
            return Err(invalid(format!("0 bytes requested for buffer {k}")));
        }
        let end = n
            .checked_next_multiple_of(HUGE_PAGE_BYTES)
            .and_then(|span| total.checked_add(span))
            .ok_or_else(|| invalid(format!("{sizes:?} bytes of pinned memory overflow")))?;
        out.push(total..end);
        total = end;
    }
    Ok((out, total))
}

/// Consecutive buffers of a batch (lying at `slices`) grouped into the parts of
/// [`CudaBackend::pin_many_from_device`]'s pipeline: as many buffers as fit in `piece` bytes
/// (rounded up to [`HUGE_PAGE_BYTES`]) each, but at least one (a buffer larger than that is a
/// part of its own). Returns ranges of buffer indices, in order and back to back; one part
/// when `piece` is 0; none for no buffers.
pub(super) fn groups(slices: &[Range<usize>], piece: usize) -> Vec<Range<usize>> {
    let piece = piece.checked_next_multiple_of(HUGE_PAGE_BYTES).unwrap_or(0);
    let mut out = Vec::new();
    let (mut start, mut bytes) = (0, 0usize);
    for (k, s) in slices.iter().enumerate() {
        if k > start && piece > 0 && bytes.saturating_add(s.len()) > piece {
            out.push(start..k);
            (start, bytes) = (k, 0);
        }
        bytes = bytes.saturating_add(s.len());
    }
    if start < slices.len() {
        out.push(start..slices.len());
    }
    out
}

/// One part of [`CudaBackend::pin_many_from_device`]'s pipeline: its buffers, each as its
/// index in the batch and its slice of the mapping.
type Part<'a> = Vec<(usize, &'a mut [u8])>;

impl CudaBackend {
    /// The buffers of a batch over `mem`, one per entry of `sizes` lying at `slices`, nothing
    /// registered yet. Dropping them before they are registered gives the memory back.
    fn unregistered(
        &self,
        sizes: &[usize],
        mem: AnonMemory,
        slices: &[Range<usize>],
    ) -> BackendResult<Vec<CudaPinned>> {
        Ok(sizes
            .iter()
            .zip(mem.split(slices)?)
            .map(|(&len, mem)| CudaPinned {
                regs: Vec::with_capacity(1),
                device_ptr: 0,
                len,
                mem,
                dev: self.dev.clone(),
            })
            .collect())
    }

    /// Pins one buffer per entry of `ranges` (of its `bytes`, at least one) in one batch laid
    /// out as [`CudaBackend::pin_many`] lays it out (one mapping, each buffer's slice rounded
    /// up to [`HUGE_PAGE_BYTES`], one registration per buffer, each buffer droppable on its
    /// own), and fills each with a copy of its device range, as a pipeline like
    /// [`CudaBackend::pin_from_device`]'s: the buffers are grouped, in order, into parts of
    /// at most `part_bytes` (0: one part, nothing overlaps; a buffer larger than that is
    /// a part of its own, never split: one registration per buffer, and no copy spans two);
    /// a scoped helper thread first-touches the parts in order (each on all cores but one)
    /// and hands each to this thread, which registers each buffer of it and enqueues its
    /// copy on the backend's device→host stream at once. So part k+1 is touched while part
    /// k registers and part k-1 copies. Waits for the copies before it returns, also on
    /// error; when that wait fails, the whole batch is leaked rather than unmapped under a
    /// copy that may still run (recorded in the backend's
    /// [`crate::backend::DeferredErrors`]). No ranges: no buffers.
    ///
    /// All or nothing: on error every registration made is undone and the memory unmapped
    /// (but for the leak above). Errors: as [`CudaBackend::pin_many`], and
    /// [`BackendError::Driver`] when a copy cannot be enqueued or fails.
    ///
    /// # Safety
    /// Every `src .. src + bytes` of `ranges` must be mapped device memory of this context,
    /// not written until the call returns.
    pub unsafe fn pin_many_from_device(
        &self,
        ranges: &[DeviceRange],
        part_bytes: usize,
    ) -> BackendResult<Vec<CudaPinned>> {
        let sizes: Vec<usize> = ranges.iter().map(|r| r.bytes).collect();
        let (slices, total) = slices(&sizes)?;
        if slices.is_empty() {
            return Ok(Vec::new());
        }
        let mem = AnonMemory::map(total, self.dev.errors.clone())?;
        // Nothing registered yet. On any error below, dropping `out` unregisters what was
        // registered, and the last buffer to drop unmaps the memory.
        let mut out = self.unregistered(&sizes, mem, &slices)?;
        let scope = self.dev.scope()?;
        let groups = groups(&slices, part_bytes);
        let helpers = pipeline_touch_threads();
        let stream = self.d2h.cu_stream();
        // Each buffer's registrations, and its bytes borrowed mutably from its slice: the
        // helper touches a part, then hands its borrows to this thread, which keeps them
        // until the copies are waited for below (the copy engine writes into them meanwhile).
        let (mut regs, bufs): (Vec<&mut Vec<Range<usize>>>, Vec<&mut [u8]>) = out
            .iter_mut()
            .map(|p| (&mut p.regs, p.mem.as_mut_slice()))
            .unzip();
        let mut bufs = bufs.into_iter().enumerate();
        let parts: Vec<Part<'_>> = groups
            .iter()
            .map(|g| bufs.by_ref().take(g.len()).collect())
            .collect();
        let touch = |part: &mut Part<'_>| {
            let bytes = part.iter().map(|(_, b)| b.len()).sum();
            let threads = touch_threads(bytes, helpers);
            touch_each(part.iter_mut().map(|(_, b)| &mut **b).collect(), threads);
        };
        let (enqueued, held) = pipeline(parts, touch, |part| {
            for (k, buf) in part.iter_mut() {
                let (Some(range), Some(regs)) = (ranges.get(*k), regs.get_mut(*k)) else {
                    return Err(BackendError::Internal {
                        op: "pin_many_from_device",
                        reason: format!("no buffer {k}"),
                    });
                };
                let whole = 0..buf.len();
                // SAFETY: `range` is mapped and unwritten (the caller's contract); `buf` is
                // the whole slice of buffer `k`, touched, registered nowhere else, borrowed
                // exclusively by this thread and kept (in `held`) until the copies are
                // waited for below.
                unsafe { register_and_copy(buf, &whole, range.bytes, range.src, stream, regs) }?;
            }
            Ok(())
        });
        let synced = self.d2h.synchronize();
        drop(held);
        let mut out = self.after_fill("pin_many_from_device", total, out, synced, enqueued)?;
        for p in &mut out {
            p.device_ptr = p.lookup_device_ptr()?;
        }
        drop(scope);
        Ok(out)
    }

    /// Pins one buffer per entry of `sizes` (each at least one byte), reading as zeros, in
    /// one batch: one mapping of their sizes each rounded up to [`HUGE_PAGE_BYTES`], touched
    /// once as [`CudaBackend::pin`] touches, then each buffer's slice registered with its
    /// own `cuMemHostRegister`, one after another, and its device address taken from that
    /// registration. Each buffer may be dropped on its own, in any order (see the module
    /// documentation). No sizes: no buffers.
    ///
    /// All or nothing: on error every registration made is undone and the memory unmapped.
    /// Errors: [`BackendError::Invalid`] for a size of 0; [`BackendError::Os`] when the
    /// memory cannot be mapped; [`BackendError::Driver`] when the driver refuses to register
    /// a slice.
    pub fn pin_many(&self, sizes: &[usize]) -> BackendResult<Vec<CudaPinned>> {
        let (slices, total) = slices(sizes)?;
        if slices.is_empty() {
            return Ok(Vec::new());
        }
        let mut mem = AnonMemory::map(total, self.dev.errors.clone())?;
        touch(mem.as_mut_slice(), touch_threads(total, cores()));
        // Nothing registered yet. On any error below, dropping `out` unregisters what was
        // registered, and the last buffer to drop unmaps the memory.
        let mut out = self.unregistered(sizes, mem, &slices)?;
        {
            // One scope for the whole loop: the buffers' own scopes then find the context
            // current.
            let _scope = self.dev.scope()?;
            for p in &mut out {
                p.register_whole()?;
            }
        }
        {
            let _scope = self.dev.scope()?;
            for p in &mut out {
                p.device_ptr = p.lookup_device_ptr()?;
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::backend::DeferredErrors;

    const MIB: usize = 1 << 20;

    #[test]
    fn slices_lie_back_to_back_on_huge_page_boundaries() {
        let (s, total) = slices(&[1, 2 * MIB, 2 * MIB + 1, 55 * MIB + 13]).unwrap();
        assert_eq!(
            s,
            vec![
                0..2 * MIB,
                2 * MIB..4 * MIB,
                4 * MIB..8 * MIB,
                8 * MIB..64 * MIB
            ]
        );
        assert_eq!(total, 64 * MIB);
        assert_eq!(slices(&[]).unwrap(), (vec![], 0));
        assert!(matches!(
            slices(&[5, 0, 7]),
            Err(BackendError::Invalid {
                op: "alloc_pinned_many",
                ..
            })
        ));
        assert!(matches!(
            slices(&[usize::MAX / 2, usize::MAX / 2, 3]),
            Err(BackendError::Invalid { .. })
        ));
        assert!(matches!(
            slices(&[usize::MAX]),
            Err(BackendError::Invalid { .. })
        ));
    }

    #[test]
    fn groups_fill_parts_with_whole_buffers_in_order() {
        let (s, _) = slices(&[1, 4097, 3 * MIB + 5, 2 * MIB, 9 * MIB, 1, 1]).unwrap();
        // Slices of 2, 2, 4, 2, 10, 2, 2 MiB.
        assert_eq!(groups(&s, 0), vec![0..7], "no piece size: one part");
        assert_eq!(groups(&s, usize::MAX), vec![0..7]);
        assert_eq!(
            groups(&s, 6 * MIB),
            vec![0..2, 2..4, 4..5, 5..7],
            "at most 6 MiB a part, but a larger buffer alone"
        );
        // Rounded up to huge pages: 5 MiB parts hold 6 MiB.
        assert_eq!(groups(&s, 5 * MIB), groups(&s, 6 * MIB));
        assert_eq!(
            groups(&s, 1),
            vec![0..1, 1..2, 2..3, 3..4, 4..5, 5..6, 6..7]
        );
        assert_eq!(groups(&s, 16 * MIB), vec![0..4, 4..7]);
        assert!(groups(&[], 6 * MIB).is_empty());
        for piece in [0, 1, 2 * MIB, 4 * MIB, 6 * MIB, 64 * MIB] {
            let g = groups(&s, piece);
            assert_eq!(g.first().map(|r| r.start), Some(0));
            assert_eq!(g.last().map(|r| r.end), Some(s.len()));
            assert!(g.iter().all(|r| !r.is_empty()));
            for w in g.windows(2) {
                assert_eq!(w[0].end, w[1].start, "{piece}");
            }
        }
    }

    /// Several slices of one mapping touched at once on shared threads: every page backed,
    /// contents unchanged.
    #[test]
    fn touch_each_backs_every_page_of_every_slice() {
        let errors = Arc::new(DeferredErrors::new());
        let (s, total) = slices(&[1, 3 * MIB + 5, 2 * MIB, 9 * MIB]).unwrap();
        for threads in [1, 3, 4] {
            let mem = AnonMemory::map(total, errors.clone()).expect("mmap");
            let mut parts = mem.split(&s).expect("split");
            assert!(
                parts
                    .iter()
                    .all(|p| resident(p) < p.len / crate::backend::host::page_size())
            );
            touch_each(
                parts.iter_mut().map(AnonMemory::as_mut_slice).collect(),
                threads,
            );
            for (k, p) in parts.iter_mut().enumerate() {
                let page = crate::backend::host::page_size();
                assert_eq!(resident(p), p.len / page, "slice {k}, {threads} threads");
                assert!(p.as_mut_slice().iter().all(|&b| b == 0));
            }
        }
        assert_eq!(errors.total(), 0);
    }

    /// Resident pages of `mem`'s usable bytes, from `mincore`.
    fn resident(mem: &AnonMemory) -> usize {
        let page = crate::backend::host::page_size();
        let mut vec = vec![0u8; mem.len.div_ceil(page)];
        // SAFETY: `ptr .. ptr + len` is a page-aligned range of the live mapping; `vec` has
        // one byte per page of it.
        let rc = unsafe { libc::mincore(mem.ptr.as_ptr().cast(), mem.len, vec.as_mut_ptr()) };
        assert_eq!(rc, 0, "mincore: {}", std::io::Error::last_os_error());
        vec.iter().filter(|&&v| v & 1 == 1).count()
    }

    /// A batch's memory cut into slices: each the bytes asked for; dropping one gives its
    /// pages back while its bytes stay mapped, its neighbours keep their pages and contents.
    #[test]
    fn a_dropped_slice_returns_its_pages_and_spares_the_others() {
        let errors = Arc::new(DeferredErrors::new());
        let (s, total) = slices(&[3 * MIB, 5 * MIB + 1, 2 * MIB]).unwrap();
        let page = crate::backend::host::page_size();
        for bad in [
            vec![0..MIB, MIB..total + 1],
            vec![0..2 * MIB, MIB..3 * MIB],
            vec![2 * MIB..4 * MIB, 0..2 * MIB],
        ] {
            let mem = AnonMemory::map(total, errors.clone()).expect("mmap");
            assert!(
                matches!(mem.split(&bad), Err(BackendError::Invalid { .. })),
                "{bad:?}"
            );
        }

        let mut mem = AnonMemory::map(total, errors.clone()).expect("mmap");
        touch(mem.as_mut_slice(), 2);
        let base2 = mem.ptr.as_ptr() as usize;
        let mut parts = mem.split(&s).expect("split");
        for (p, r) in parts.iter_mut().zip(&s) {
            assert_eq!(p.ptr.as_ptr() as usize, base2 + r.start);
            assert_eq!(p.len, r.len());
            assert_eq!(resident(p), r.len() / page);
            p.as_mut_slice().fill(0x5A);
        }
        // The middle slice's pages go back when it drops; its bytes stay mapped (checked
        // through the first slice's `of`) and read as zeros.
        let middle = parts.remove(1);
        let (at, len) = (middle.ptr.as_ptr() as usize, middle.len);
        drop(middle);
        let whole = parts[0].of.clone().expect("a slice");
        let mut view = vec![0u8; len.div_ceil(page)];
        // SAFETY: `at .. at + len` lies inside the live mapping `whole`; `view` has one byte
        // per page of it.
        let rc = unsafe { libc::mincore(at as *mut libc::c_void, len, view.as_mut_ptr()) };
        assert_eq!(rc, 0, "still mapped: {}", std::io::Error::last_os_error());
        assert!(view.iter().all(|&v| v & 1 == 0), "pages given back");
        drop(whole);
        for (p, k) in parts.iter_mut().zip([0, 2]) {
            assert_eq!(resident(p), s[k].len() / page, "slice {k}");
            assert!(p.as_mut_slice().iter().all(|&b| b == 0x5A), "slice {k}");
        }
        drop(parts);
        assert_eq!(errors.total(), 0);
    }
}
