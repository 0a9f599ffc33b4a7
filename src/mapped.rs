//! The physical mappings of one region, by offset: which byte ranges are backed by memory.
//!
//! A mapping may be of any size (a multiple of the granularity): a fixed region maps chunks
//! of its chunk size, a growing region maps one piece per buffer (split at the chunk size),
//! so that an allocation costs one `cuMemCreate` + `cuMemMap` like a bare VMM allocation.
//! Mappings never overlap.

use std::collections::BTreeMap;
use std::ops::Range;

use crate::backend::Mapping;

/// Mappings keyed by their offset from the region's base.
#[derive(Debug, Default)]
pub(crate) struct Mapped {
    spans: BTreeMap<usize, Box<dyn Mapping>>,
    bytes: usize,
}

impl Mapped {
    /// Bytes mapped.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Records mappings laid back to back from `offset` (as [`crate::backend::Backend::map`]
    /// returns them).
    pub fn insert(&mut self, offset: usize, maps: Vec<Box<dyn Mapping>>) {
        let mut at = offset;
        for m in maps {
            let len = m.len();
            self.bytes += len;
            let old = self.spans.insert(at, m);
            debug_assert!(old.is_none(), "two mappings at offset {at}");
            at += len;
        }
    }

    /// The mapping containing byte `at`, as its range.
    fn containing(&self, at: usize) -> Option<Range<usize>> {
        let (&start, m) = self.spans.range(..=at).next_back()?;
        (at < start + m.len()).then(|| start..start + m.len())
    }

    /// Whether every byte of `range` is mapped (true for an empty range).
    pub fn covers(&self, range: &Range<usize>) -> bool {
        let mut at = range.start;
        while at < range.end {
            match self.containing(at) {
                Some(r) => at = r.end,
                None => return false,
            }
        }
        true
    }

    /// Whether some mapping starts inside `range`.
    pub fn any_within(&self, range: &Range<usize>) -> bool {
        self.spans.range(range.clone()).next().is_some()
    }

    /// The unmapped parts of `range`, in order.
    pub fn gaps(&self, range: &Range<usize>) -> Vec<Range<usize>> {
        let mut out = Vec::new();
        let mut at = range.start;
        if let Some(r) = self.containing(at) {
            at = r.end;
        }
        for (&start, m) in self.spans.range(at..range.end) {
            if start > at {
                out.push(at..start);
            }
            at = at.max(start + m.len());
        }
        if at < range.end {
            out.push(at..range.end);
        }
        out
    }

    /// The maximal contiguous mapped ranges, in order.
    pub fn runs(&self) -> Vec<Range<usize>> {
        let mut out: Vec<Range<usize>> = Vec::new();
        for (&start, m) in &self.spans {
            match out.last_mut() {
                Some(last) if last.end == start => last.end = start + m.len(),
                _ => out.push(start..start + m.len()),
            }
        }
        out
    }

    /// Unmaps (drops) every mapping for which `drop_it(range)` holds. Returns the bytes
    /// given back. The caller knows nothing on the device uses them.
    pub fn remove_where(&mut self, mut drop_it: impl FnMut(&Range<usize>) -> bool) -> usize {
        let doomed: Vec<usize> = self
            .spans
            .iter()
            .filter(|&(&start, m)| drop_it(&(start..start + m.len())))
            .map(|(&start, _)| start)
            .collect();
        let mut freed = 0;
        for start in doomed {
            if let Some(m) = self.spans.remove(&start) {
                freed += m.len();
            }
        }
        self.bytes -= freed;
        freed
    }

    /// Unmaps every mapping lying inside `range`. Returns the bytes given back.
    pub fn remove_within(&mut self, range: &Range<usize>) -> usize {
        self.remove_where(|r| r.start >= range.start && r.end <= range.end)
    }

    /// Unmaps the first mapping lying inside `range`. Returns its bytes (0: none left).
    pub fn remove_first_within(&mut self, range: &Range<usize>) -> usize {
        let first = self
            .spans
            .range(range.clone())
            .find(|&(&start, m)| start + m.len() <= range.end)
            .map(|(&start, _)| start);
        let freed = first
            .and_then(|start| self.spans.remove(&start))
            .map_or(0, |m| m.len());
        self.bytes -= freed;
        freed
    }

    /// Takes every mapping out, in address order, for the caller to unmap (dropping them
    /// does, one by one; [`crate::backend::Backend::unmap_runs`] first, a run at a time).
    pub fn take_all(&mut self) -> Vec<Box<dyn Mapping>> {
        self.bytes = 0;
        std::mem::take(&mut self.spans).into_values().collect()
    }
}

/// Splits `range` into pieces of at most `piece` bytes, cut at multiples of `piece` from
/// offset 0 (so the pieces of a chunk-grid region are its chunks).
pub(crate) fn pieces(range: &Range<usize>, piece: usize) -> Vec<usize> {
    let mut out = Vec::new();
    let mut at = range.start;
    while at < range.end {
        let next = ((at / piece) + 1).saturating_mul(piece).min(range.end);
        out.push(next - at);
        at = next;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Fake(usize);
    impl Mapping for Fake {
        fn ptr(&self) -> u64 {
            0
        }
        fn len(&self) -> usize {
            self.0
        }
        fn unmapped(&mut self) {}
    }

    fn maps(sizes: &[usize]) -> Vec<Box<dyn Mapping>> {
        sizes
            .iter()
            .map(|&s| Box::new(Fake(s)) as Box<dyn Mapping>)
            .collect()
    }

    #[test]
    fn coverage_gaps_runs_and_removal() {
        let mut m = Mapped::default();
        m.insert(10, maps(&[5, 5])); // 10..20
        m.insert(30, maps(&[10])); // 30..40
        assert_eq!(m.bytes(), 20);
        assert!(m.covers(&(10..20)) && m.covers(&(12..18)) && m.covers(&(5..5)));
        assert!(!m.covers(&(10..21)) && !m.covers(&(0..1)) && !m.covers(&(19..31)));
        assert_eq!(m.gaps(&(0..50)), vec![0..10, 20..30, 40..50]);
        assert_eq!(m.gaps(&(12..35)), vec![20..30]);
        assert!(m.gaps(&(30..40)).is_empty());
        assert_eq!(m.runs(), vec![10..20, 30..40]);
        assert_eq!(m.remove_within(&(10..16)), 5);
        assert_eq!(m.runs(), vec![15..20, 30..40]);
        assert_eq!(m.remove_where(|r| r.start >= 30), 10);
        let rest = m.take_all();
        assert_eq!(rest.iter().map(|r| r.len()).collect::<Vec<_>>(), vec![5]);
        assert_eq!(m.bytes(), 0);
    }

    #[test]
    fn removing_the_first_mapping_within_a_range_goes_one_at_a_time() {
        let mut m = Mapped::default();
        m.insert(0, maps(&[4, 4, 4])); // 0..12
        assert_eq!(
            m.remove_first_within(&(2..12)),
            4,
            "4..8: 0..4 starts before the range"
        );
        assert_eq!(
            m.remove_first_within(&(2..10)),
            0,
            "8..12 ends after the range"
        );
        assert_eq!(m.remove_first_within(&(0..12)), 4);
        assert_eq!(m.remove_first_within(&(0..12)), 4);
        assert_eq!(m.remove_first_within(&(0..12)), 0);
        assert_eq!(m.bytes(), 0);
    }

    #[test]
    fn pieces_cut_at_the_grid() {
        assert_eq!(pieces(&(0..10), 4), vec![4, 4, 2]);
        assert_eq!(pieces(&(6..10), 4), vec![2, 2]);
        assert_eq!(pieces(&(8..8), 4), Vec::<usize>::new());
        assert_eq!(pieces(&(0..3), 8), vec![3]);
    }
}
