//! The errors of the KV layer ([`KvError`]) and the ids they name ([`BlockId`], [`SeqId`]).

use std::fmt;

/// A block handed out by a [`BlockPool`](crate::kv::BlockPool): its index in the region and the generation it was
/// allocated in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockId {
    /// Block index: the block lives at `index × bytes_per_block` in the region.
    pub index: u32,
    /// Generation the id was handed out with.
    pub generation: u32,
}

impl fmt::Display for BlockId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{}@gen{}", self.index, self.generation)
    }
}

/// A sequence (one request's KV history) in a [`BlockPool`](crate::kv::BlockPool). Ids are never reused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqId(pub u64);

impl fmt::Display for SeqId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "seq{}", self.0)
    }
}

/// Errors of the KV layer. Every message says what to do about it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KvError {
    /// The layout (or pool) parameters are unusable.
    #[error("invalid KV layout: {reason}; fix the KvLayout / BlockPool parameters")]
    InvalidLayout {
        /// What is wrong.
        reason: String,
    },

    /// Arguments of a KV operation that cannot be acted on (a token stride too small or
    /// misaligned, conflicting copy pairs, a block listed twice, ...).
    #[error("invalid arguments: {reason}; fix the call")]
    InvalidArgument {
        /// What is wrong.
        reason: String,
    },

    /// An index (layer, head, token, slot, ...) is past its limit.
    #[error("{what} {index} is out of range (limit {limit}); pass an index below the limit")]
    OutOfRange {
        /// Which index.
        what: &'static str,
        /// The index given.
        index: u64,
        /// The exclusive limit.
        limit: u64,
    },

    /// A buffer is shorter than the call needs.
    #[error(
        "the {what} buffer holds {len} bytes but the call needs {needed}; pass a buffer of at \
         least {needed} bytes, or fewer tokens or blocks"
    )]
    BufferTooSmall {
        /// Which buffer: `"keys"`, `"values"`, `"output"`, `"host"`.
        what: &'static str,
        /// Bytes the call reads or writes in it.
        needed: u64,
        /// Bytes it has.
        len: u64,
    },

    /// The block is already free (its id is current, its reference count is zero).
    #[error(
        "block {id} is already free (double free); free each allocation or retain exactly once"
    )]
    DoubleFree {
        /// The block.
        id: BlockId,
    },

    /// The id names no block of this pool.
    #[error(
        "block {id} is not a block of this pool (capacity {capacity}); use ids this pool handed out"
    )]
    ForeignOrOutOfRange {
        /// The id given.
        id: BlockId,
        /// Blocks in the pool.
        capacity: u32,
    },

    /// The id was handed out before the block was re-allocated or before
    /// [`BlockPool::invalidate_all`](crate::kv::BlockPool::invalidate_all) (a release of `kv_cache`).
    #[error(
        "block {id} is stale (the block is now at generation {generation}); its contents are gone — \
         drop the old id and allocate again (re-prefill the sequence)"
    )]
    Stale {
        /// The id given.
        id: BlockId,
        /// The block's current generation.
        generation: u32,
    },

    /// Not enough free blocks.
    #[error(
        "KV cache exhausted: {requested} block(s) requested but only {free} free; free or preempt \
         sequences, or give the cache more blocks"
    )]
    KvExhausted {
        /// Blocks requested.
        requested: u32,
        /// Blocks free at the time.
        free: u32,
    },

    /// The sequence id is unknown (never created, already freed, or dropped by
    /// [`BlockPool::invalidate_all`](crate::kv::BlockPool::invalidate_all)).
    #[error(
        "sequence {seq} is unknown (freed, or dropped when the cache's region was released); create \
         a new one"
    )]
    UnknownSeq {
        /// The sequence id given.
        seq: SeqId,
    },
}
