//! Backups in pinned host memory ([`super::Medium::Pinned`] and [`super::Medium::Host`]):
//! saves and restores are copies over the link through the pager's pump, which overlaps
//! them with each other and with the release's other work.

use std::ops::Range;

use super::Store;
use super::ledger::Share;
use crate::backend::{Backend, BackendError, BackendResult, HostBuffer};
use crate::pump::{Pinned, PinnedMut, Pump, Sink};

/// One backup's pinned host buffer, and its share of the node's host budget.
#[derive(Debug)]
pub(super) struct MemoryStore(
    pub(super) Box<dyn HostBuffer>,
    // Held for its drop, which gives the bytes back to the budget.
    #[allow(dead_code)] pub(super) Share,
);

impl Store for MemoryStore {
    fn len(&self) -> usize {
        self.0.len()
    }

    fn host(&self) -> Option<&[u8]> {
        Some(self.0.as_slice())
    }

    fn read(&self, range: Range<usize>, out: &mut [u8]) -> BackendResult<()> {
        let src = self
            .0
            .as_slice()
            .get(range.clone())
            .ok_or_else(|| outside("read", &range, self.len()))?;
        out.copy_from_slice(src);
        Ok(())
    }

    unsafe fn save<'h>(
        &'h mut self,
        _backend: &dyn Backend,
        base: u64,
        runs: &[Range<usize>],
        pump: &mut Pump<'_, 'h>,
    ) -> BackendResult<usize> {
        let bad = |r: &Range<usize>| BackendError::Internal {
            op: "save",
            reason: format!("backup ranges out of order or outside the backup at {r:?}"),
        };
        let (mut rest, mut at, mut copied) = (PinnedMut::new(self.0.as_mut()), 0usize, 0usize);
        for r in runs {
            let skip = r.start.checked_sub(at).ok_or_else(|| bad(r))?;
            let (_, tail) = rest.split_at(skip).ok_or_else(|| bad(r))?;
            let (part, tail) = tail.split_at(r.len()).ok_or_else(|| bad(r))?;
            // SAFETY: the caller's contract covers the device range; `part` is the backup's
            // bytes `r`, borrowed by the pump for its scope.
            unsafe { pump.push_to_host(base + r.start as u64, part) }?;
            (rest, at) = (tail, r.end);
            copied += r.len();
        }
        Ok(copied)
    }

    unsafe fn restore<'h>(
        &'h self,
        _backend: &dyn Backend,
        base: u64,
        spans: &[Range<usize>],
        sink: &mut Sink<'_, '_, 'h>,
    ) -> BackendResult<usize> {
        let mut sent = 0;
        for span in spans {
            let src = Pinned::new(self.0.as_ref())
                .get(span.clone())
                .ok_or_else(|| outside("restore", span, self.len()))?;
            // SAFETY: the caller's contract, for each device range `base + span`.
            unsafe { sink.push_to_device(src, base + span.start as u64) }?;
            sent += span.len();
        }
        Ok(sent)
    }
}

fn outside(op: &'static str, range: &Range<usize>, len: usize) -> BackendError {
    BackendError::Internal {
        op,
        reason: format!("backup bytes {range:?} outside its {len} bytes"),
    }
}
