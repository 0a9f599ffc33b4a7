//! Pinning many buffers in one batch ([`CudaBackend::pin_many`]): one mapping, one touch on
//! every core, one registration per buffer (see the parent module's "Batches").

use std::ops::Range;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::{
    AnonMemory, CudaPinned, HUGE_PAGE_BYTES, PinOptions, PinTimings, on_threads, touch_timed,
};
use crate::backend::cuda::CudaBackend;
use crate::backend::{BackendError, BackendResult};

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

impl CudaBackend {
    /// Pins one buffer per entry of `sizes` (each at least one byte), reading as zeros, in
    /// one batch: one mapping of their sizes each rounded up to [`HUGE_PAGE_BYTES`], touched
    /// once as [`CudaBackend::pin`] touches (`opts`' `touch_threads`, `populate` and
    /// `huge_pages`), then each buffer's slice registered with its own `cuMemHostRegister`
    /// (`piece_bytes` is ignored): one after another on this thread, or with
    /// `parallel_register` on as many threads as touched (each thread registers whole
    /// buffers, disjoint ranges; the default is serial, for the benchmark to compare), and
    /// its device address taken from that registration. Each buffer may be dropped on its
    /// own, in any order (see the module documentation). No sizes: no buffers.
    ///
    /// Every buffer carries the whole batch's [`PinTimings`] (the same on each, not to be
    /// added up over them): the batch's `map`, `touch` and `touch_threads`, `register` for
    /// all its registrations and device-address lookups, `pieces` its registrations (one
    /// per buffer).
    ///
    /// All or nothing: on error every registration made is undone and the memory unmapped.
    /// Errors: [`BackendError::Invalid`] for a size of 0; [`BackendError::Os`] when the
    /// memory cannot be mapped; [`BackendError::Driver`] when the driver refuses to register
    /// a slice.
    pub fn pin_many(&self, sizes: &[usize], opts: &PinOptions) -> BackendResult<Vec<CudaPinned>> {
        let (slices, total) = slices(sizes)?;
        if slices.is_empty() {
            return Ok(Vec::new());
        }
        let t = Instant::now();
        let mut mem = AnonMemory::map(total, opts.huge_pages, self.dev.errors.clone())?;
        let map = t.elapsed();
        let (touched, threads) = touch_timed(&mut mem, opts);
        let t = Instant::now();
        // Nothing registered yet. On any error below, dropping `out` unregisters what was
        // registered, and the last buffer to drop unmaps the memory.
        let mut out: Vec<CudaPinned> = sizes
            .iter()
            .zip(mem.split(&slices)?)
            .map(|(&len, mem)| CudaPinned {
                regs: Vec::with_capacity(1),
                device_ptr: 0,
                len,
                timings: PinTimings::default(),
                mem,
                dev: self.dev.clone(),
            })
            .collect();
        if opts.parallel_register && out.len() > 1 {
            register_each_parallel(&mut out, threads)?;
        } else {
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
        let timings = PinTimings {
            map,
            touch: touched,
            register: t.elapsed(),
            wait: Duration::ZERO,
            touch_threads: threads,
            pieces: out.len(),
        };
        for p in &mut out {
            p.timings = timings;
        }
        Ok(out)
    }
}

impl CudaPinned {
    /// Registers the buffer's whole slice, one registration.
    fn register_whole(&mut self) -> BackendResult<()> {
        let whole = 0..self.mem.len;
        self.register_serial(std::slice::from_ref(&whole))
    }
}

/// Registers each of `bufs` whole on up to `threads` threads (this one included). A buffer
/// that was registered keeps its registration for its `Drop`, also when another failed; a
/// failure returns after the others finished (no new buffer starts once one failed).
fn register_each_parallel(bufs: &mut [CudaPinned], threads: usize) -> BackendResult<()> {
    let failed: Mutex<Option<BackendError>> = Mutex::new(None);
    let first = || failed.lock().unwrap_or_else(|p| p.into_inner());
    on_threads(
        threads.min(bufs.len()),
        bufs.iter_mut().collect(),
        |p: &mut CudaPinned| {
            if first().is_some() {
                return;
            }
            if let Err(e) = p.register_whole() {
                first().get_or_insert(e);
            }
        },
    );
    if let Some(e) = failed.into_inner().unwrap_or_else(|p| p.into_inner()) {
        return Err(e);
    }
    // A helper thread that panicked left its buffers unregistered (`on_threads`).
    if bufs.iter().any(|p| p.regs.is_empty()) {
        return Err(BackendError::Invalid {
            op: "alloc_pinned_many",
            reason: "a registering thread stopped before it registered its buffers".to_owned(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::super::touch;
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
            let mem = AnonMemory::map(total, true, errors.clone()).expect("mmap");
            assert!(
                matches!(mem.split(&bad), Err(BackendError::Invalid { .. })),
                "{bad:?}"
            );
        }

        let mut mem = AnonMemory::map(total, true, errors.clone()).expect("mmap");
        touch(mem.as_mut_slice(), 2, true);
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
