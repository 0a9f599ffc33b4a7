//! Block allocator of the paged KV cache: see [`BlockPool`].

use std::collections::HashMap;
use std::ops::Range;

use super::{BlockId, KvError, KvLayout, SeqId};

/// Where a token of a sequence is to be written, from [`BlockPool::write_slot`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriteTarget {
    /// The block that holds the token now (exclusively owned by the sequence).
    pub block: BlockId,
    /// The token's slot, `block.index × block_size + token % block_size` (vLLM's slot mapping).
    pub slot: u64,
    /// When the block was shared, the sequence now has a fresh block and the caller must copy
    /// the contents of this (still live) source block into [`block`](Self::block) before
    /// writing — all layers, K and V (the `copy_blocks` kernel).
    pub needs_copy_from: Option<BlockId>,
}

/// Counters of a [`BlockPool`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolStats {
    /// Blocks in the pool.
    pub capacity: u32,
    /// Blocks with a reference count of at least one.
    pub live: u32,
    /// Free blocks.
    pub free: u32,
    /// Blocks referenced more than once (shared by forks or retained).
    pub shared: u32,
    /// The highest live block index, if any: blocks above it hold nothing.
    pub highest_live: Option<u32>,
    /// Live sequences.
    pub sequences: usize,
}

/// Hierarchical bitset: `levels[0]` has one bit per element, `levels[k+1]` one bit per word
/// of `levels[k]` (set when that word is non-zero). The last level is a single word.
#[derive(Debug, Clone)]
struct BitTree {
    levels: Vec<Vec<u64>>,
}

impl BitTree {
    fn new(len: u32) -> Self {
        let mut levels = Vec::new();
        let mut n = (len as usize).max(1);
        loop {
            let words = n.div_ceil(64);
            levels.push(vec![0u64; words]);
            if words == 1 {
                break;
            }
            n = words;
        }
        Self { levels }
    }

    fn set(&mut self, i: u32) {
        let mut i = i as usize;
        for level in &mut self.levels {
            let w = &mut level[i / 64];
            let was_zero = *w == 0;
            *w |= 1 << (i % 64);
            if !was_zero {
                return;
            }
            i /= 64;
        }
    }

    fn clear(&mut self, i: u32) {
        let mut i = i as usize;
        for level in &mut self.levels {
            let w = &mut level[i / 64];
            *w &= !(1 << (i % 64));
            if *w != 0 {
                return;
            }
            i /= 64;
        }
    }

    fn get(&self, i: u32) -> bool {
        let i = i as usize;
        self.levels[0][i / 64] & (1 << (i % 64)) != 0
    }

    fn first(&self) -> Option<u32> {
        let mut idx = 0usize;
        for level in self.levels.iter().rev() {
            let w = level[idx];
            if w == 0 {
                return None;
            }
            idx = idx * 64 + w.trailing_zeros() as usize;
        }
        u32::try_from(idx).ok()
    }

    fn last(&self) -> Option<u32> {
        let mut idx = 0usize;
        for level in self.levels.iter().rev() {
            let w = level[idx];
            if w == 0 {
                return None;
            }
            idx = idx * 64 + 63 - w.leading_zeros() as usize;
        }
        u32::try_from(idx).ok()
    }

    /// Whether any bit in `range` is set (leaf scan, `O(len / 64)`).
    fn any_in(&self, range: Range<u32>) -> bool {
        let (mut i, end) = (range.start as usize, range.end as usize);
        let leaves = &self.levels[0];
        while i < end {
            let word = leaves[i / 64] >> (i % 64);
            let span = (64 - i % 64).min(end - i);
            let mask = if span == 64 {
                u64::MAX
            } else {
                (1u64 << span) - 1
            };
            if word & mask != 0 {
                return true;
            }
            i += span;
        }
        false
    }
}

#[derive(Debug, Clone)]
struct Seq {
    blocks: Vec<BlockId>,
    tokens: u64,
}

/// Fixed-capacity pool of KV blocks with reference counts, sequences, fork and copy-on-write.
///
/// The block-level calls ([`allocate`](Self::allocate), [`retain`](Self::retain),
/// [`free`](Self::free)) and the sequence calls share the same reference counts: a sequence
/// holds one reference to each block in its table, so free only what you allocated or retained.
///
/// # Complexity
///
/// Free blocks are kept in a hierarchical bitset (a 64-ary tree of `u64` words, one bit
/// per block at the leaves; an inner bit is set when its child word is non-zero), and live blocks
/// in a second one. Allocation takes the **lowest** free id by descending the tree with
/// trailing-zero counts; freeing sets one leaf bit and at most one bit per level above it. Both
/// are `O(log₆₄ capacity)` word operations: 3 levels up to 262,144 blocks, 4 up to 16.7 M,
/// 6 for `u32::MAX` — constant in practice, and no per-block `Arc`, lock or heap node.
/// [`BlockPool::highest_live_block`] is the same descent on the live tree.
///
/// | operation | cost |
/// |---|---|
/// | [`allocate`](BlockPool::allocate), [`free`](BlockPool::free), [`retain`](BlockPool::retain) | `O(log₆₄ n)` |
/// | [`append_tokens`](BlockPool::append_tokens) | `O(new blocks · log₆₄ n)` amortised |
/// | [`write_slot`](BlockPool::write_slot) | `O(1)`, `O(log₆₄ n)` when it copies |
/// | [`fork`](BlockPool::fork), [`free_seq`](BlockPool::free_seq) | `O(blocks of the sequence)` |
/// | [`highest_live_block`](BlockPool::highest_live_block), [`live_blocks`](BlockPool::live_blocks) | `O(log₆₄ n)`, `O(1)` |
/// | [`empty_ranges`](BlockPool::empty_ranges) | `O(n / 64)` |
/// | [`invalidate_all`](BlockPool::invalidate_all) | `O(n)` (once per release of `kv_cache`) |
///
/// # Generations
///
/// Every block has a generation, bumped each time the block is allocated and by
/// [`BlockPool::invalidate_all`]. A [`BlockId`] carries the generation it was handed out with;
/// an id whose generation is not the block's current one is [`KvError::Stale`], and a current
/// id of a free block is [`KvError::DoubleFree`]. Old ids are therefore never silently reused.
/// (Generations are `u32` and wrap; a stale id is mistaken for a live one only if it is kept
/// across exactly 2³² re-allocations of its block.)
#[derive(Debug, Clone)]
pub struct BlockPool {
    block_size: u32,
    refcount: Vec<u32>,
    generation: Vec<u32>,
    free_set: BitTree,
    live_set: BitTree,
    live: u32,
    shared: u32,
    seqs: HashMap<SeqId, Seq>,
    next_seq: u64,
}

impl BlockPool {
    /// A pool of `capacity` blocks of `block_size` tokens, all free.
    /// [`KvError::InvalidLayout`] when either is 0.
    pub fn new(capacity: u32, block_size: u32) -> Result<Self, KvError> {
        if capacity == 0 || block_size == 0 {
            return Err(KvError::InvalidLayout {
                reason: format!(
                    "a block pool needs capacity ≥ 1 and block_size ≥ 1 (got {capacity}, {block_size})"
                ),
            });
        }
        let mut free_set = BitTree::new(capacity);
        for i in 0..capacity {
            free_set.set(i);
        }
        Ok(Self {
            block_size,
            refcount: vec![0; capacity as usize],
            generation: vec![0; capacity as usize],
            free_set,
            live_set: BitTree::new(capacity),
            live: 0,
            shared: 0,
            seqs: HashMap::new(),
            next_seq: 0,
        })
    }

    /// A pool of as many blocks of `layout` as fit in `region_bytes`.
    pub fn for_layout(layout: &KvLayout, region_bytes: u64) -> Result<Self, KvError> {
        Self::new(layout.max_blocks(region_bytes), layout.block_size())
    }

    /// Blocks in the pool.
    pub fn capacity(&self) -> u32 {
        self.refcount.len() as u32
    }

    /// Tokens per block.
    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    /// Free blocks.
    pub fn free_blocks(&self) -> u32 {
        self.capacity() - self.live
    }

    /// Blocks with a reference count of at least one.
    pub fn live_blocks(&self) -> u32 {
        self.live
    }

    /// The highest live block index, if any block is live. Backing for blocks above it can be
    /// trimmed.
    pub fn highest_live_block(&self) -> Option<u32> {
        self.live_set.last()
    }

    /// Ranges `[k·blocks_per_chunk, (k+1)·blocks_per_chunk)` (the last one clipped to the
    /// capacity) holding no live block, adjacent ones merged, in increasing order: what
    /// elastic backing may unmap when one physical chunk holds `blocks_per_chunk` blocks.
    /// [`KvError::InvalidLayout`] when `blocks_per_chunk` is 0.
    pub fn empty_ranges(&self, blocks_per_chunk: u32) -> Result<Vec<Range<u32>>, KvError> {
        if blocks_per_chunk == 0 {
            return Err(KvError::InvalidLayout {
                reason: "blocks_per_chunk is 0; it must be at least 1".into(),
            });
        }
        let cap = self.capacity();
        let mut out: Vec<Range<u32>> = Vec::new();
        let mut start = 0u32;
        while start < cap {
            let end = start.saturating_add(blocks_per_chunk).min(cap);
            if !self.live_set.any_in(start..end) {
                match out.last_mut() {
                    Some(last) if last.end == start => last.end = end,
                    _ => out.push(start..end),
                }
            }
            start = end;
        }
        Ok(out)
    }

    /// Runs of consecutive live block indices, in increasing order (the complement of
    /// [`BlockPool::empty_ranges`]`(1)`): what elastic backing must keep mapped.
    pub fn live_runs(&self) -> Vec<Range<u32>> {
        let (Some(first), Some(last)) = (self.live_set.first(), self.highest_live_block()) else {
            return Vec::new();
        };
        crate::runs::runs((first..=last).filter(|&i| self.live_set.get(i)))
    }

    /// The current id of block `index` if it is live (`None` when free or out of range).
    /// For checking raw indices, such as the blocks of a slot mapping.
    pub fn live_id(&self, index: u32) -> Option<BlockId> {
        let i = index as usize;
        (self.refcount.get(i).copied().unwrap_or(0) > 0).then(|| BlockId {
            index,
            generation: self.generation[i],
        })
    }

    /// Counters for reporting and trimming.
    pub fn stats(&self) -> PoolStats {
        PoolStats {
            capacity: self.capacity(),
            live: self.live,
            free: self.free_blocks(),
            shared: self.shared,
            highest_live: self.highest_live_block(),
            sequences: self.seqs.len(),
        }
    }

    /// Checks that `id` is current and live; returns its index.
    fn check(&self, id: BlockId) -> Result<usize, KvError> {
        let i = id.index as usize;
        let Some(&generation) = self.generation.get(i) else {
            return Err(KvError::ForeignOrOutOfRange {
                id,
                capacity: self.capacity(),
            });
        };
        if generation != id.generation {
            return Err(KvError::Stale { id, generation });
        }
        if self.refcount[i] == 0 {
            return Err(KvError::DoubleFree { id });
        }
        Ok(i)
    }

    /// Reference count of a live block (0 is never returned: a free block's id is an error).
    pub fn refcount(&self, id: BlockId) -> Result<u32, KvError> {
        self.check(id).map(|i| self.refcount[i])
    }

    /// Whether `id` is a current id of a live block.
    pub fn is_live(&self, id: BlockId) -> bool {
        self.check(id).is_ok()
    }

    /// Allocates the lowest free block with a reference count of one.
    /// [`KvError::KvExhausted`] when none is free.
    pub fn allocate(&mut self) -> Result<BlockId, KvError> {
        let Some(index) = self.free_set.first() else {
            return Err(KvError::KvExhausted {
                requested: 1,
                free: 0,
            });
        };
        let i = index as usize;
        self.free_set.clear(index);
        self.live_set.set(index);
        self.generation[i] = self.generation[i].wrapping_add(1);
        self.refcount[i] = 1;
        self.live += 1;
        Ok(BlockId {
            index,
            generation: self.generation[i],
        })
    }

    /// Allocates `n` blocks (the lowest free ones, in increasing order), all or nothing.
    pub fn allocate_n(&mut self, n: u32) -> Result<Vec<BlockId>, KvError> {
        if n > self.free_blocks() {
            return Err(KvError::KvExhausted {
                requested: n,
                free: self.free_blocks(),
            });
        }
        let mut out = Vec::with_capacity(n as usize);
        for _ in 0..n {
            out.push(self.allocate()?);
        }
        Ok(out)
    }

    /// Adds a reference to a live block.
    pub fn retain(&mut self, id: BlockId) -> Result<(), KvError> {
        let i = self.check(id)?;
        let Some(rc) = self.refcount[i].checked_add(1) else {
            return Err(KvError::OutOfRange {
                what: "reference count",
                index: u64::from(u32::MAX) + 1,
                limit: u64::from(u32::MAX),
            });
        };
        if rc == 2 {
            self.shared += 1;
        }
        self.refcount[i] = rc;
        Ok(())
    }

    /// Drops one reference; returns whether the block became free.
    pub fn free(&mut self, id: BlockId) -> Result<bool, KvError> {
        let i = self.check(id)?;
        Ok(self.decref(i))
    }

    /// Decrements a checked, live block.
    fn decref(&mut self, i: usize) -> bool {
        self.refcount[i] -= 1;
        match self.refcount[i] {
            0 => {
                self.live -= 1;
                self.live_set.clear(i as u32);
                self.free_set.set(i as u32);
                true
            }
            1 => {
                self.shared -= 1;
                false
            }
            _ => false,
        }
    }

    /// Every block id handed out before becomes stale, every block free, and every sequence
    /// unknown. Call it after `kv_cache` is released: its contents are gone.
    pub fn invalidate_all(&mut self) {
        for g in &mut self.generation {
            *g = g.wrapping_add(1);
        }
        let cap = self.capacity();
        for i in 0..cap {
            self.refcount[i as usize] = 0;
            self.free_set.set(i);
            self.live_set.clear(i);
        }
        self.live = 0;
        self.shared = 0;
        self.seqs.clear();
    }

    /// A new, empty sequence.
    pub fn create_seq(&mut self) -> SeqId {
        let id = SeqId(self.next_seq);
        self.next_seq += 1;
        self.seqs.insert(
            id,
            Seq {
                blocks: Vec::new(),
                tokens: 0,
            },
        );
        id
    }

    fn seq(&self, seq: SeqId) -> Result<&Seq, KvError> {
        self.seqs.get(&seq).ok_or(KvError::UnknownSeq { seq })
    }

    /// The sequence's block table, in token order.
    pub fn block_table(&self, seq: SeqId) -> Result<&[BlockId], KvError> {
        self.seq(seq).map(|s| s.blocks.as_slice())
    }

    /// Tokens in the sequence.
    pub fn seq_tokens(&self, seq: SeqId) -> Result<u64, KvError> {
        self.seq(seq).map(|s| s.tokens)
    }

    /// Live sequences, in no particular order.
    pub fn seqs(&self) -> impl Iterator<Item = SeqId> + '_ {
        self.seqs.keys().copied()
    }

    /// Grows the sequence by `n` tokens, allocating the blocks it needs (lowest ids first),
    /// all or nothing: on [`KvError::KvExhausted`] nothing changed. Returns the new blocks.
    pub fn append_tokens(&mut self, seq: SeqId, n: u64) -> Result<Vec<BlockId>, KvError> {
        let s = self.seq(seq)?;
        let bs = u64::from(self.block_size);
        let tokens = s.tokens.checked_add(n).ok_or(KvError::OutOfRange {
            what: "sequence length",
            index: u64::MAX,
            limit: u64::MAX,
        })?;
        let need = tokens.div_ceil(bs) - s.blocks.len() as u64;
        let free = self.free_blocks();
        let need = u32::try_from(need)
            .ok()
            .filter(|&need| need <= free)
            .ok_or(KvError::KvExhausted {
                requested: u32::try_from(need).unwrap_or(u32::MAX),
                free,
            })?;
        let new = self.allocate_n(need)?;
        let s = self.seqs.get_mut(&seq).ok_or(KvError::UnknownSeq { seq })?;
        s.blocks.extend_from_slice(&new);
        s.tokens = tokens;
        Ok(new)
    }

    /// A new sequence sharing all of `seq`'s blocks (each reference count + 1).
    pub fn fork(&mut self, seq: SeqId) -> Result<SeqId, KvError> {
        let s = self.seq(seq)?.clone();
        for &b in &s.blocks {
            self.check(b)?;
        }
        for &b in &s.blocks {
            self.retain(b)?;
        }
        let id = SeqId(self.next_seq);
        self.next_seq += 1;
        self.seqs.insert(id, s);
        Ok(id)
    }

    /// Prepares writing token `token` (0-based, below the sequence length) of `seq`.
    /// If its block is shared, the sequence gets a fresh block (the lowest free one), the old
    /// block loses one reference, and the target reports the copy the caller must do first.
    /// On [`KvError::KvExhausted`] nothing changed.
    pub fn write_slot(&mut self, seq: SeqId, token: u64) -> Result<WriteTarget, KvError> {
        let s = self.seq(seq)?;
        if token >= s.tokens {
            return Err(KvError::OutOfRange {
                what: "token of the sequence",
                index: token,
                limit: s.tokens,
            });
        }
        let bs = u64::from(self.block_size);
        let pos = (token / bs) as usize;
        let old = s.blocks[pos];
        let oi = self.check(old)?;
        let slot_of = |b: BlockId| u64::from(b.index) * bs + token % bs;
        if self.refcount[oi] == 1 {
            return Ok(WriteTarget {
                block: old,
                slot: slot_of(old),
                needs_copy_from: None,
            });
        }
        let new = self.allocate()?;
        self.decref(oi);
        let s = self.seqs.get_mut(&seq).ok_or(KvError::UnknownSeq { seq })?;
        s.blocks[pos] = new;
        Ok(WriteTarget {
            block: new,
            slot: slot_of(new),
            needs_copy_from: Some(old),
        })
    }

    /// Shrinks the sequence to its first `tokens` tokens, dropping one reference to each
    /// block no longer needed; returns the blocks that became free. Undoes an
    /// [`append_tokens`](Self::append_tokens) (or rejected speculative tokens).
    /// [`KvError::OutOfRange`] when `tokens` exceeds the length; validates first, so an error
    /// changes nothing.
    pub fn truncate(&mut self, seq: SeqId, tokens: u64) -> Result<Vec<BlockId>, KvError> {
        let s = self.seq(seq)?;
        if tokens > s.tokens {
            return Err(KvError::OutOfRange {
                what: "sequence length to truncate to",
                index: tokens,
                limit: s.tokens + 1,
            });
        }
        let keep = tokens.div_ceil(u64::from(self.block_size)) as usize;
        for &b in &s.blocks[keep..] {
            self.check(b)?;
        }
        let s = self.seqs.get_mut(&seq).ok_or(KvError::UnknownSeq { seq })?;
        let dropped: Vec<BlockId> = s.blocks.drain(keep..).collect();
        s.tokens = tokens;
        let mut freed = Vec::new();
        for b in dropped {
            if self.decref(b.index as usize) {
                freed.push(b);
            }
        }
        Ok(freed)
    }

    /// Drops the sequence and one reference to each of its blocks; returns the blocks that
    /// became free. Validates every block first, so an error changes nothing.
    pub fn free_seq(&mut self, seq: SeqId) -> Result<Vec<BlockId>, KvError> {
        let s = self.seq(seq)?;
        for &b in &s.blocks {
            self.check(b)?;
        }
        // A block may appear only once per table (tables are built from fresh allocations),
        // so checking each once is enough.
        let s = self.seqs.remove(&seq).ok_or(KvError::UnknownSeq { seq })?;
        let mut freed = Vec::new();
        for b in s.blocks {
            if self.decref(b.index as usize) {
                freed.push(b);
            }
        }
        Ok(freed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bittree_first_last_any() {
        for len in [1u32, 63, 64, 65, 4095, 4096, 4097, 300_000] {
            let mut t = BitTree::new(len);
            assert_eq!(t.first(), None);
            assert_eq!(t.last(), None);
            for i in [len - 1, len / 2, 0] {
                t.set(i);
                assert!(t.get(i));
            }
            assert_eq!(t.first(), Some(0));
            assert_eq!(t.last(), Some(len - 1));
            t.clear(0);
            assert_eq!(t.first(), Some(len / 2).filter(|_| len > 1));
            t.clear(len - 1);
            assert_eq!(t.last(), Some(len / 2).filter(|_| len > 2));
            assert!(!t.any_in(0..len / 2));
            assert_eq!(t.any_in(len / 2..len), len > 2);
        }
    }

    #[test]
    fn lowest_first_and_empty_ranges() {
        let mut p = BlockPool::new(10, 4).unwrap();
        let ids = p.allocate_n(6).unwrap();
        assert_eq!(
            ids.iter().map(|b| b.index).collect::<Vec<_>>(),
            [0, 1, 2, 3, 4, 5]
        );
        p.free(ids[1]).unwrap();
        p.free(ids[4]).unwrap();
        assert_eq!(p.allocate().unwrap().index, 1);
        assert_eq!(p.highest_live_block(), Some(5));
        p.free(ids[5]).unwrap();
        p.free(ids[3]).unwrap();
        assert_eq!(p.highest_live_block(), Some(2));
        assert_eq!(p.empty_ranges(2).unwrap(), vec![4..10]);
        assert_eq!(p.empty_ranges(3).unwrap(), vec![3..10]);
        assert_eq!(p.empty_ranges(100).unwrap(), vec![]);
        let s = p.stats();
        assert_eq!((s.live, s.free, s.shared, s.sequences), (3, 7, 0, 0));
        assert_eq!(p.live_runs(), vec![0..3]);
        assert_eq!(p.live_id(2).map(|b| b.index), Some(2));
        assert_eq!(p.live_id(3), None);
        assert_eq!(p.live_id(99), None);
    }

    #[test]
    fn truncate_undoes_append() {
        let mut p = BlockPool::new(10, 4).unwrap();
        let a = p.create_seq();
        p.append_tokens(a, 5).unwrap();
        let b = p.fork(a).unwrap();
        let new = p.append_tokens(b, 7).unwrap();
        assert_eq!(new.len(), 1);
        assert_eq!(p.truncate(b, 5).unwrap(), new);
        assert_eq!(p.seq_tokens(b).unwrap(), 5);
        // Shared blocks lose a reference but stay live.
        assert_eq!(p.truncate(b, 0).unwrap(), vec![]);
        assert_eq!(p.live_blocks(), 2);
        assert!(p.truncate(b, 1).is_err());
        p.free_seq(a).unwrap();
        assert_eq!(p.live_blocks(), 0);
        let c = p.create_seq();
        p.append_tokens(c, 9).unwrap();
        let second = p.block_table(c).unwrap()[1];
        p.free(second).unwrap();
        assert_eq!(p.live_runs(), vec![0..1, 2..3]);
        assert!(
            p.truncate(c, 0).is_err(),
            "a stale block in the table is refused"
        );
        assert_eq!(p.seq_tokens(c).unwrap(), 9);
    }
}
