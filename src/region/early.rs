//! A release's unmapping of what it has saved while the rest still copies.

use std::collections::VecDeque;
use std::ops::Range;
use std::time::{Duration, Instant};

use crate::mapped::Mapped;

/// Unmaps a region's extents (region offsets) while a release's pump still copies: each
/// extent once the pump has finished every push made before it was queued
/// ([`crate::pump::Pump::pushes_done`]), one mapping per [`EarlyUnmap::step`], so that the
/// thread feeding the pump is never away from it for long.
///
/// Why: freeing device memory costs the driver about a millisecond per 2 GiB, and it runs
/// beside copies of other memory: a release that unmaps only after its last copy adds all
/// of it to the copy's time.
pub(crate) struct EarlyUnmap<'a> {
    mapped: &'a mut Mapped,
    /// (extent, the pushes that must be done first), in push order.
    pending: VecDeque<(Range<usize>, u64)>,
    /// Extents taken from `pending`, in order: all unmapped but the last, which may be in
    /// part.
    unmapped: Vec<Range<usize>>,
    bytes: usize,
    time: Duration,
}

/// What an [`EarlyUnmap`] did: the extents it unmapped (the last may be in part), the
/// bytes, the time.
#[derive(Debug, Default, Clone)]
pub(crate) struct Unmapped {
    pub extents: Vec<Range<usize>>,
    pub bytes: usize,
    pub time: Duration,
}

impl<'a> EarlyUnmap<'a> {
    pub fn new(mapped: &'a mut Mapped) -> Self {
        EarlyUnmap {
            mapped,
            pending: VecDeque::new(),
            unmapped: Vec::new(),
            bytes: 0,
            time: Duration::ZERO,
        }
    }

    /// Queues `extent` to be unmapped once the pump's first `after` pushes are done.
    pub fn after(&mut self, extent: Range<usize>, after: u64) {
        self.pending.push_back((extent, after));
    }

    /// Unmaps one mapping of the first queued extent if `done` pushes are done. Returns
    /// whether it unmapped anything.
    ///
    /// The caller knows that nothing on the device uses the extent once its pushes are done
    /// (a release synchronized first and holds the region locked).
    pub fn step(&mut self, done: u64) -> bool {
        loop {
            if let Some(extent) = self.unmapped.last() {
                let t = Instant::now();
                let freed = self.mapped.remove_first_within(extent);
                self.time += t.elapsed();
                if freed > 0 {
                    self.bytes += freed;
                    return true;
                }
            }
            match self.pending.front() {
                Some((_, after)) if *after <= done => {}
                _ => return false,
            }
            if let Some((extent, _)) = self.pending.pop_front() {
                self.unmapped.push(extent);
            }
        }
    }

    /// What it did; extents still queued stay mapped.
    pub fn finish(self) -> Unmapped {
        Unmapped {
            extents: self.unmapped,
            bytes: self.bytes,
            time: self.time,
        }
    }
}
