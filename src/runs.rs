//! Merging indices into runs of consecutive values, for the places that act on contiguous
//! spans (hash chunks to copy, chunks to map, blocks to back).

use std::ops::Range;

/// The runs of consecutive values among `indices`, which must come in non-decreasing order
/// (repeats are allowed and merged): `[1, 2, 2, 3, 5, 8, 9]` gives `[1..4, 5..6, 8..10]`.
pub(crate) fn runs<T>(indices: impl IntoIterator<Item = T>) -> Vec<Range<T>>
where
    T: Copy + PartialEq + std::ops::Add<Output = T> + From<u8>,
{
    let one = T::from(1);
    let mut out: Vec<Range<T>> = Vec::new();
    for i in indices {
        match out.last_mut() {
            Some(r) if r.end == i || r.end == i + one => r.end = i + one,
            _ => out.push(i..i + one),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::runs;

    #[test]
    fn merges_neighbours_and_repeats() {
        assert_eq!(runs([1usize, 2, 2, 3, 5, 8, 9]), vec![1..4, 5..6, 8..10]);
        assert_eq!(runs([7u32]), vec![7..8]);
        assert!(runs(Vec::<u32>::new()).is_empty());
    }
}
