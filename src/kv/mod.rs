//! Paged KV cache: the byte layout of the `kv_cache` region ([`KvLayout`]), the block
//! allocator with reference counts, fork, copy-on-write and per-sequence block tables
//! ([`BlockPool`]), one checked kernel call ([`KvOp`]), and the cache itself on an elastic
//! pager region ([`KvCache`]): physical memory only under live blocks, the kernels of
//! `kernels/kv.cu` behind host-side checks, and every id stale after a release.
//!
//! ```
//! use std::sync::Arc;
//! use gpu_pager::backend::host::{HostBackend, HostConfig};
//! use gpu_pager::kv::{Kv, KvCache, KvCacheConfig, KvDtype, KvError, KvLayout, KvOrder};
//! use gpu_pager::{Error, Pager, Policy};
//!
//! # fn main() -> Result<(), Error> {
//! // On a GPU use `gpu_pager::registry::open_backend(0)?.0`; the host backend runs anywhere.
//! let pager = Arc::new(Pager::new(Arc::new(HostBackend::new(HostConfig::default()))));
//! let layout = KvLayout::new(2, 4, 64, 16, KvDtype::Bf16, KvOrder::Nhd)
//!     .map_err(|error| Error::Kv { tag: Some("kv_cache".into()), error })?;
//! let kv = KvCache::new(pager.clone(), "kv_cache", layout, 1024, KvCacheConfig::default())?;
//! assert_eq!(kv.stats()?.mapped_bytes, 0);          // nothing backed yet
//!
//! // Keys and values of 20 tokens, [tokens, kv_heads, head_dim], in a pager buffer.
//! let token = 4 * 64 * 2;
//! pager.region("io", 1 << 20, Policy::Discard)?;
//! let (keys, values, out) = (pager.alloc("io", 20 * token)?, pager.alloc("io", 20 * token)?,
//!                            pager.alloc("io", 20 * token)?);
//! pager.write(&keys, 0, &vec![7u8; 20 * token])?;
//! pager.write(&values, 0, &vec![9u8; 20 * token])?;
//!
//! let seq = kv.create_seq()?;
//! kv.append_tokens(seq, 20)?;                       // two blocks, their chunk mapped
//! let slots = kv.prepare_write(seq, 0..20)?;
//! kv.write(1, &keys, &values, 20, token, &slots)?;  // layer 1
//! let child = kv.fork(seq)?;                        // shares both blocks
//! assert_eq!(kv.gather(1, Kv::V, child, &out)?, 20);
//! let mut back = vec![0u8; 20 * token];
//! pager.read(&out, 0, &mut back)?;
//! assert!(back.iter().all(|&b| b == 9));
//!
//! pager.release(&["kv_cache"])?;                    // contents gone ...
//! pager.resume(&["kv_cache"])?;
//! assert!(matches!(kv.gather(1, Kv::V, child, &out),   // ... and so are the ids
//!                  Err(Error::Kv { error: KvError::UnknownSeq { .. }, .. })));
//! # Ok(()) }
//! ```
//!
//! The pool alone, without memory:
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

pub use block_pool::{BlockPool, PoolStats, WriteTarget};
pub use cache::{DEFAULT_KV_CHUNK_BYTES, KvCache, KvCacheConfig, KvStats, SwapSpace};
// The pure descriptions (layout, ops, errors, ids, the Rust references) live below the
// backends, in `crate::kernels::kv`, so that the backends do not depend on this module;
// they are re-exported here, where users look for them.
pub use crate::kernels::kv::reference;
pub use crate::kernels::kv::{
    BlockId, CacheView, DeviceSpan, Kv, KvDtype, KvError, KvLayout, KvOp, KvOrder, KvStrides, SeqId,
};
