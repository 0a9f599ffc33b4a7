//! First-fit sub-allocator of offsets inside one region, with coalescing on free.
//!
//! Pure bookkeeping: it never touches memory, so buffers can be allocated and freed whether
//! the region is resident or released. Each allocation gets a unique id so that a second
//! free of the same buffer, or a free of a buffer from another region, is detected.

use std::collections::BTreeMap;

/// Why an allocation or free was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum AllocError {
    /// Zero bytes, or an alignment that is not a power of two.
    Invalid(String),
    /// No free range fits.
    Full { free: usize },
    /// No live allocation has this offset and id.
    Stale,
}

/// One live allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Allocation {
    pub offset: usize,
    pub len: usize,
    pub id: u64,
}

/// Offsets `[0, size)` handed out in aligned pieces.
#[derive(Debug, Clone)]
pub(crate) struct SubAllocator {
    size: usize,
    /// Free ranges, coalesced.
    free: rangemap::RangeSet<usize>,
    /// Live allocations by start offset: (len, id).
    live: BTreeMap<usize, (usize, u64)>,
    free_bytes: usize,
}

impl SubAllocator {
    /// An allocator over `size` bytes, all free.
    pub fn new(size: usize) -> Self {
        let mut free = rangemap::RangeSet::new();
        if size > 0 {
            free.insert(0..size);
        }
        SubAllocator {
            size,
            free,
            live: BTreeMap::new(),
            free_bytes: size,
        }
    }

    /// Allocates `len` bytes at an offset that is a multiple of `align` (a power of two),
    /// taking the lowest offset that fits.
    pub fn alloc(&mut self, len: usize, align: usize, id: u64) -> Result<Allocation, AllocError> {
        if len == 0 {
            return Err(AllocError::Invalid("zero-byte buffer".to_owned()));
        }
        if !align.is_power_of_two() {
            return Err(AllocError::Invalid(format!(
                "alignment {align} is not a power of two"
            )));
        }
        let found = self.free.iter().find_map(|r| {
            let aligned = r.start.checked_next_multiple_of(align)?;
            let end = aligned.checked_add(len)?;
            (end <= r.end).then_some(aligned)
        });
        let Some(aligned) = found else {
            return Err(AllocError::Full {
                free: self.free_bytes,
            });
        };
        self.free.remove(aligned..aligned + len);
        self.live.insert(aligned, (len, id));
        self.free_bytes -= len;
        Ok(Allocation {
            offset: aligned,
            len,
            id,
        })
    }

    /// Frees the allocation at `offset` if its id is `id`.
    pub fn free(&mut self, offset: usize, id: u64) -> Result<Allocation, AllocError> {
        match self.live.get(&offset) {
            Some(&(len, live_id)) if live_id == id => {
                self.live.remove(&offset);
                self.free.insert(offset..offset + len);
                self.free_bytes += len;
                Ok(Allocation { offset, len, id })
            }
            _ => Err(AllocError::Stale),
        }
    }

    /// Whether an allocation with this offset and id is live.
    pub fn is_live(&self, offset: usize, id: u64) -> bool {
        self.live
            .get(&offset)
            .is_some_and(|&(_, live_id)| live_id == id)
    }

    /// The live allocation whose bytes include `offset`, if any (O(log n)).
    pub fn live_containing(&self, offset: usize) -> Option<Allocation> {
        let (&start, &(len, id)) = self.live.range(..=offset).next_back()?;
        (offset < start + len).then_some(Allocation {
            offset: start,
            len,
            id,
        })
    }

    /// Bytes in live allocations.
    pub fn allocated_bytes(&self) -> usize {
        self.size - self.free_bytes
    }

    /// Bytes not allocated (maybe fragmented).
    #[cfg(test)]
    pub fn free_bytes(&self) -> usize {
        self.free_bytes
    }

    /// Number of live allocations.
    pub fn count(&self) -> usize {
        self.live.len()
    }

    /// The live allocation at `offset`, if any.
    pub fn get(&self, offset: usize) -> Option<Allocation> {
        self.live
            .get(&offset)
            .map(|&(len, id)| Allocation { offset, len, id })
    }

    /// Live allocations in offset order.
    pub fn live(&self) -> impl Iterator<Item = Allocation> + '_ {
        self.live
            .iter()
            .map(|(&offset, &(len, id))| Allocation { offset, len, id })
    }

    /// Checks the internal invariants (tests only).
    #[cfg(test)]
    pub fn check(&self) {
        let mut pieces: Vec<(usize, usize, bool)> = self
            .free
            .iter()
            .map(|r| (r.start, r.len(), true))
            .chain(self.live.iter().map(|(&s, &(l, _))| (s, l, false)))
            .collect();
        pieces.sort();
        let mut at = 0;
        let mut prev_free = false;
        for (s, l, is_free) in pieces {
            assert!(s >= at, "overlap at {s}");
            assert!(l > 0);
            if is_free {
                assert!(!(prev_free && s == at), "adjacent free ranges at {s}");
            }
            prev_free = is_free;
            at = s + l;
        }
        assert!(at <= self.size);
        let free: usize = self.free.iter().map(|r| r.len()).sum();
        assert_eq!(free, self.free_bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn first_fit_alignment_and_coalescing() {
        let mut a = SubAllocator::new(4096);
        let x = a.alloc(100, 256, 1).unwrap();
        let y = a.alloc(100, 256, 2).unwrap();
        assert_eq!((x.offset, y.offset), (0, 256));
        a.free(0, 1).unwrap();
        assert_eq!(a.free(0, 1), Err(AllocError::Stale));
        assert_eq!(a.free(256, 99), Err(AllocError::Stale));
        let z = a.alloc(64, 64, 3).unwrap();
        assert_eq!(z.offset, 0);
        a.free(256, 2).unwrap();
        a.free(0, 3).unwrap();
        a.check();
        assert_eq!(a.free_bytes(), 4096);
        assert_eq!(a.alloc(4096, 1, 4).unwrap().offset, 0);
        assert!(matches!(
            a.alloc(1, 1, 5),
            Err(AllocError::Full { free: 0 })
        ));
        assert!(matches!(a.alloc(0, 1, 5), Err(AllocError::Invalid(_))));
        assert!(matches!(a.alloc(1, 3, 5), Err(AllocError::Invalid(_))));
    }

    #[test]
    fn live_containing_finds_the_buffer_around_an_offset() {
        let mut a = SubAllocator::new(4096);
        assert_eq!(a.live_containing(0), None);
        let x = a.alloc(100, 256, 1).unwrap();
        let y = a.alloc(100, 256, 2).unwrap();
        assert_eq!(a.live_containing(0), Some(x));
        assert_eq!(a.live_containing(99), Some(x));
        assert_eq!(a.live_containing(100), None); // the gap before y
        assert_eq!(a.live_containing(256), Some(y));
        assert_eq!(a.live_containing(355), Some(y));
        assert_eq!(a.live_containing(356), None);
        a.free(0, 1).unwrap();
        assert_eq!(a.live_containing(0), None);
    }

    #[derive(Debug, Clone)]
    enum Op {
        Alloc(usize, u32),
        Free(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (1usize..3000, 0u32..10).prop_map(|(l, a)| Op::Alloc(l, a)),
            any::<usize>().prop_map(Op::Free),
        ]
    }

    proptest! {
        /// Random alloc/free against a model: allocations never overlap, stay in bounds and
        /// aligned, every freed byte comes back, and a full free restores one free range.
        #[test]
        fn matches_model(ops in proptest::collection::vec(op(), 1..200)) {
            let size = 64 * 1024;
            let mut a = SubAllocator::new(size);
            let mut model: Vec<Allocation> = Vec::new();
            let mut id = 0;
            for op in ops {
                match op {
                    Op::Alloc(len, align_log) => {
                        id += 1;
                        let align = 1usize << align_log;
                        match a.alloc(len, align, id) {
                            Ok(al) => {
                                prop_assert_eq!(al.offset % align, 0);
                                prop_assert!(al.offset + len <= size);
                                for m in &model {
                                    prop_assert!(al.offset + len <= m.offset || m.offset + m.len <= al.offset);
                                }
                                model.push(al);
                            }
                            Err(AllocError::Full { free }) => {
                                let used: usize = model.iter().map(|m| m.len).sum();
                                prop_assert_eq!(free, size - used);
                            }
                            Err(e) => prop_assert!(false, "unexpected {:?}", e),
                        }
                    }
                    Op::Free(pick) => {
                        if model.is_empty() { continue; }
                        let m = model.swap_remove(pick % model.len());
                        prop_assert_eq!(a.free(m.offset, m.id), Ok(m));
                        prop_assert_eq!(a.free(m.offset, m.id), Err(AllocError::Stale));
                    }
                }
                a.check();
                prop_assert_eq!(a.count(), model.len());
                let mut live: Vec<_> = a.live().collect();
                let mut want = model.clone();
                live.sort_by_key(|m| m.offset);
                want.sort_by_key(|m| m.offset);
                prop_assert_eq!(live, want);
            }
            for m in model.drain(..) {
                a.free(m.offset, m.id).unwrap();
            }
            prop_assert_eq!(a.free_bytes(), size);
            prop_assert_eq!(a.alloc(size, 1, 0).map(|x| x.offset), Ok(0));
        }
    }
}
