//! Paged KV cache, host-side groundwork: the byte layout of the `kv_cache` region
//! ([`KvLayout`]) and the block allocator with reference counts, fork, copy-on-write and
//! per-sequence block tables ([`BlockPool`]).
//!
//! Nothing here touches a device. The layout says where every `(layer, K/V, block, token,
//! head)` vector lives inside the one `kv_cache` region; the pool says which blocks are live,
//! which copies the caller must perform before writing, and which ranges of block ids hold
//! no live block (so elastic backing can unmap them).
//!
//! ```
//! use gpu_pager::kv::{BlockPool, Kv, KvDtype, KvLayout, KvOrder};
//!
//! # fn main() -> Result<(), gpu_pager::kv::KvError> {
//! let layout = KvLayout::new(2, 4, 64, 16, KvDtype::Bf16, KvOrder::Nhd)?;
//! let mut pool = BlockPool::for_layout(&layout, 1 << 20)?;
//! let seq = pool.create_seq();
//! pool.append_tokens(seq, 20)?;                 // two blocks
//! let child = pool.fork(seq)?;                  // shares both blocks
//! let target = pool.write_slot(child, 19)?;     // copy-on-write of the second block
//! assert!(target.needs_copy_from.is_some());
//! let _offset = layout.slot_offset(1, Kv::V, target.slot, 3)?;
//! pool.free_seq(seq)?;
//! pool.free_seq(child)?;
//! assert_eq!(pool.live_blocks(), 0);
//! # Ok(()) }
//! ```

mod block_pool;
mod cache;
mod layout;
mod op;
pub mod reference;

pub use block_pool::{BlockId, BlockPool, PoolStats, SeqId, WriteTarget};
pub use cache::{DEFAULT_KV_CHUNK_BYTES, KvCache, KvCacheConfig, KvStats, SwapSpace};
pub use layout::{Kv, KvDtype, KvLayout, KvOrder, KvStrides};
pub use op::{CacheView, DeviceSpan, KvOp};

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
    /// [`BlockPool::invalidate_all`] (a release of `kv_cache`).
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
         sequences, or grow the kv_cache region"
    )]
    KvExhausted {
        /// Blocks requested.
        requested: u32,
        /// Blocks free at the time.
        free: u32,
    },

    /// The sequence id is unknown (never created, already freed, or dropped by
    /// [`BlockPool::invalidate_all`]).
    #[error(
        "sequence {seq} is unknown (freed, or dropped when kv_cache was released); create a new one"
    )]
    UnknownSeq {
        /// The sequence id given.
        seq: SeqId,
    },
}
