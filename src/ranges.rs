//! Sets of byte ranges: the bytes a region has marked overwritten, and the helpers that turn
//! them into the spans a release saves.

use std::ops::Range;

/// A set of byte offsets kept as disjoint, non-adjacent ranges (rangemap's, which panics on
/// an empty range: every method here takes one as the empty set).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct RangeSet(rangemap::RangeSet<usize>);

impl RangeSet {
    /// Bytes in the set.
    pub fn bytes(&self) -> usize {
        self.0.iter().map(Range::len).sum()
    }

    /// Adds `range`, merging with touching spans.
    pub fn insert(&mut self, range: Range<usize>) {
        if !range.is_empty() {
            self.0.insert(range);
        }
    }

    /// Takes `range` out of the set.
    pub fn remove(&mut self, range: Range<usize>) {
        if !range.is_empty() {
            self.0.remove(range);
        }
    }

    /// The parts of the set inside `range`, in order.
    pub fn within(&self, range: &Range<usize>) -> Vec<Range<usize>> {
        if range.is_empty() {
            return Vec::new();
        }
        self.0
            .overlapping(range)
            .map(|s| s.start.max(range.start)..s.end.min(range.end))
            .collect()
    }

    /// The parts of `range` outside the set, in order.
    pub fn gaps(&self, range: &Range<usize>) -> Vec<Range<usize>> {
        if range.is_empty() {
            return Vec::new();
        }
        self.0.gaps(range).collect()
    }
}

/// Joins sorted, disjoint `spans` whose gap is smaller than `gap` bytes: one copy over a
/// small gap costs less than a second copy call.
pub(crate) fn bridge(spans: Vec<Range<usize>>, gap: usize) -> Vec<Range<usize>> {
    let mut out: Vec<Range<usize>> = Vec::with_capacity(spans.len());
    for s in spans {
        if s.is_empty() {
            continue;
        }
        match out.last_mut() {
            Some(last) if s.start.saturating_sub(last.end) < gap.max(1) => {
                last.end = last.end.max(s.end);
            }
            _ => out.push(s),
        }
    }
    out
}

/// Whether sorted, disjoint `set` covers every byte of `range` (true for an empty range).
pub(crate) fn covers(set: &[Range<usize>], range: &Range<usize>) -> bool {
    if range.is_empty() {
        return true;
    }
    // The last span starting at or before `range.start` must reach `range.end`.
    let i = set.partition_point(|s| s.start <= range.start);
    i > 0 && set[i - 1].end >= range.end
}

/// The parts of sorted, disjoint `set` inside `range`, in order.
pub(crate) fn clip(set: &[Range<usize>], range: &Range<usize>) -> Vec<Range<usize>> {
    let first = set.partition_point(|s| s.end <= range.start);
    set[first..]
        .iter()
        .take_while(|s| s.start < range.end)
        .map(|s| s.start.max(range.start)..s.end.min(range.end))
        .filter(|s| !s.is_empty())
        .collect()
}

#[cfg(test)]
#[allow(clippy::single_range_in_vec_init)] // one-span sets are the point of some cases
mod tests {
    use super::*;

    fn set(spans: &[Range<usize>]) -> RangeSet {
        let mut s = RangeSet::default();
        for r in spans {
            s.insert(r.clone());
        }
        s
    }

    fn all(s: &RangeSet) -> Vec<Range<usize>> {
        s.within(&(0..usize::MAX))
    }

    #[test]
    fn insert_merges_touching_and_overlapping() {
        let mut s = set(&[10..20, 30..40]);
        assert_eq!(s.bytes(), 20);
        s.insert(20..25);
        assert_eq!(all(&s), vec![10..25, 30..40]);
        s.insert(5..35);
        assert_eq!(all(&s), vec![5..40]);
        s.insert(50..50);
        assert_eq!(all(&s), vec![5..40]);
        s.insert(12..13);
        assert_eq!(all(&s), vec![5..40]);
        assert_eq!(s.bytes(), 35);
        s.insert(0..100);
        assert_eq!((all(&s), s.bytes()), (vec![0..100], 100));
    }

    #[test]
    fn remove_splits_and_trims() {
        let mut s = set(&[0..100]);
        s.remove(10..20);
        assert_eq!(all(&s), vec![0..10, 20..100]);
        s.remove(5..25);
        assert_eq!(all(&s), vec![0..5, 25..100]);
        s.remove(90..200);
        assert_eq!(all(&s), vec![0..5, 25..90]);
        s.remove(0..5);
        assert_eq!((all(&s), s.bytes()), (vec![25..90], 65));
        s.remove(0..1000);
        assert_eq!((all(&s), s.bytes()), (vec![], 0));
    }

    #[test]
    fn within_and_gaps_clip_to_the_range() {
        let s = set(&[10..20, 30..40]);
        assert_eq!(s.within(&(15..35)), vec![15..20, 30..35]);
        assert_eq!(s.within(&(20..30)), Vec::<Range<usize>>::new());
        assert_eq!(s.gaps(&(0..50)), vec![0..10, 20..30, 40..50]);
        assert_eq!(s.gaps(&(12..18)), Vec::<Range<usize>>::new());
        assert_eq!(s.gaps(&(18..32)), vec![20..30]);
        // Empty ranges are empty sets (rangemap would panic on them).
        assert_eq!(s.within(&(15..15)), Vec::<Range<usize>>::new());
        assert_eq!(s.gaps(&(25..25)), Vec::<Range<usize>>::new());
        let mut t = s.clone();
        t.remove(15..15);
        assert_eq!(t, s);
    }

    #[test]
    fn bridge_joins_small_gaps_only() {
        assert_eq!(
            bridge(vec![0..10, 15..20, 40..50], 5),
            vec![0..10, 15..20, 40..50]
        );
        assert_eq!(bridge(vec![0..10, 14..20, 40..50], 5), vec![0..20, 40..50]);
        assert_eq!(bridge(vec![0..10, 10..20], 0), vec![0..20]);
        assert_eq!(bridge(vec![0..10, 11..20], 0), vec![0..10, 11..20]);
        assert_eq!(bridge(vec![3..3, 5..6], 100), vec![5..6]);
    }

    #[test]
    fn covers_and_clip_on_sorted_slices() {
        let v = vec![0..10, 20..30];
        assert!(covers(&v, &(2..10)) && covers(&v, &(20..30)) && covers(&v, &(5..5)));
        assert!(!covers(&v, &(5..21)) && !covers(&v, &(10..11)) && !covers(&v, &(25..31)));
        assert_eq!(clip(&v, &(5..25)), vec![5..10, 20..25]);
        assert_eq!(clip(&v, &(10..20)), Vec::<Range<usize>>::new());
        assert_eq!(clip(&v, &(0..100)), v);
    }
}
