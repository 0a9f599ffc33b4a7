//! The paged KV cache on a pager region: see [`KvCache`].

use std::ops::Range;
use std::sync::{Arc, Mutex, MutexGuard};

use super::{
    BlockId, BlockPool, CacheView, DeviceSpan, Kv, KvError, KvLayout, KvOp, PoolStats, SeqId,
};
use crate::backend::HostBuffer;
use crate::error::{Error, Result};
use crate::{Buffer, Lease, Pager, Policy, RegionKind, RegionOptions};

/// Default physical chunk size of a KV cache region: 64 MiB. Elastic backing maps and trims
/// whole chunks, so smaller chunks follow the live blocks more closely, and larger ones map
/// faster (mapping costs per handle).
pub const DEFAULT_KV_CHUNK_BYTES: usize = 64 << 20;

/// Settings of a [`KvCache`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvCacheConfig {
    /// Physical chunk size of the region (rounded up to the granularity and a power of two by
    /// the pager). Default [`DEFAULT_KV_CHUNK_BYTES`].
    pub chunk_bytes: usize,
}

impl Default for KvCacheConfig {
    fn default() -> Self {
        Self {
            chunk_bytes: DEFAULT_KV_CHUNK_BYTES,
        }
    }
}

/// Memory and block counters of a [`KvCache`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvStats {
    /// Bytes of address space reserved for the cache (all blocks, rounded to the
    /// granularity).
    pub reserved_bytes: usize,
    /// Bytes of physical memory mapped now (whole chunks around the live blocks).
    pub mapped_bytes: usize,
    /// Bytes the live blocks occupy.
    pub live_bytes: u64,
    /// The block pool's counters.
    pub pool: PoolStats,
}

struct State {
    pool: BlockPool,
    /// The region's release count when the pool was last valid.
    releases_seen: u64,
}

/// A paged KV cache in one elastic `Discard` region of a [`Pager`]: a [`BlockPool`] over the
/// blocks of a [`KvLayout`], physical memory mapped only under live blocks, and the KV
/// kernels with every id checked on the host before a launch.
///
/// * **Stable addresses.** The region's base, and so every layer's K and V base
///   ([`KvCache::k_ptr`], [`KvCache::v_ptr`]), never changes; attention kernels and CUDA
///   graphs may record them.
/// * **Elastic backing.** Allocating blocks ([`KvCache::append_tokens`], copy-on-write in
///   [`KvCache::prepare_write`]) maps the chunks under them first; [`KvCache::trim`] unmaps
///   every chunk without a live block and gives the memory back to the device. Live blocks
///   are always backed. Allocation prefers low ids, so the mapped part stays compact.
/// * **Release.** Releasing the region (`pager.release(&[tag])`, with other tags or alone)
///   drops all contents. Every block id and sequence handed out before becomes stale: the
///   next call notices the release and answers [`KvError::Stale`] / [`KvError::UnknownSeq`]
///   (as [`Error::Kv`]), never reuses an old id silently. `pager.resume(&[tag])` maps
///   nothing: blocks are backed again as they are allocated.
/// * **Checked kernels.** [`write`](KvCache::write), [`gather`](KvCache::gather),
///   [`copy_blocks`](KvCache::copy_blocks), [`swap_out`](KvCache::swap_out) and
///   [`swap_in`](KvCache::swap_in) check ids, slots and lengths against the pool and the
///   layout, hold a lease on every region they touch while they run, and wait for the
///   kernel. A released region is [`Error::NotResident`], never a fault.
///
/// All methods take `&self`; one mutex serialises them.
pub struct KvCache {
    pager: Arc<Pager>,
    tag: String,
    layout: KvLayout,
    blocks: u32,
    base: u64,
    chunk_bytes: usize,
    /// The region's identity ([`crate::RegionInfo::id`]): a region removed and created again
    /// under the tag is not this cache's.
    region_id: u64,
    state: Mutex<State>,
}

impl std::fmt::Debug for KvCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvCache")
            .field("tag", &self.tag)
            .field("layout", &self.layout)
            .field("blocks", &self.blocks)
            .field("base", &format_args!("{:#x}", self.base))
            .finish_non_exhaustive()
    }
}

impl KvCache {
    /// Creates region `tag` for `blocks` blocks of `layout` (elastic, `Discard`, nothing
    /// mapped yet) and an empty pool over it. The tag must be new: the cache is the only
    /// owner of its region (`InvalidArgument` otherwise), and dropping the cache removes it. Manage the region's backing through
    /// the cache only: a direct `pager.trim` or `pager.back` on it breaks the rule that live
    /// blocks are backed.
    pub fn new(
        pager: Arc<Pager>,
        tag: &str,
        layout: KvLayout,
        blocks: u32,
        config: KvCacheConfig,
    ) -> Result<Self> {
        let kv_err = |error| Error::Kv {
            tag: Some(tag.to_owned()),
            error,
        };
        let pool = BlockPool::new(blocks, layout.block_size()).map_err(kv_err)?;
        let bytes = layout.total_bytes(blocks).map_err(kv_err)?;
        let bytes = usize::try_from(bytes).map_err(|_| Error::InvalidSize {
            tag: tag.to_owned(),
            reason: format!("{bytes} bytes of KV cache do not fit usize"),
        })?;
        let info = pager.region_exclusive(
            tag,
            bytes,
            Policy::Discard,
            RegionOptions {
                kind: RegionKind::Elastic,
                chunk_bytes: Some(config.chunk_bytes),
                ..Default::default()
            },
        )?;
        Ok(Self {
            tag: tag.to_owned(),
            layout,
            blocks,
            base: info.base,
            chunk_bytes: info.chunk_bytes,
            region_id: info.id,
            pager,
            state: Mutex::new(State {
                pool,
                releases_seen: info.releases,
            }),
        })
    }

    /// The region's tag.
    pub fn tag(&self) -> &str {
        &self.tag
    }

    /// The layout.
    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    /// Blocks in the cache.
    pub fn blocks(&self) -> u32 {
        self.blocks
    }

    /// The physical chunk size: the unit of mapping and trimming.
    pub fn chunk_bytes(&self) -> usize {
        self.chunk_bytes
    }

    /// Where the cache lives, for building [`KvOp`]s by hand.
    pub fn view(&self) -> CacheView {
        CacheView {
            layout: self.layout,
            base: self.base,
            blocks: self.blocks,
        }
    }

    /// Device address of block 0 of `layer`'s K cache; with [`KvLayout::strides`] it
    /// describes the layer's K tensor to an attention kernel. Stable for the cache's life,
    /// backed only under live blocks while the region is resident.
    pub fn k_ptr(&self, layer: u32) -> Result<u64> {
        self.ptr(layer, Kv::K)
    }

    /// Device address of block 0 of `layer`'s V cache (see [`KvCache::k_ptr`]).
    pub fn v_ptr(&self, layer: u32) -> Result<u64> {
        self.ptr(layer, Kv::V)
    }

    fn ptr(&self, layer: u32, kv: Kv) -> Result<u64> {
        Ok(self.base + self.layout.base(layer, kv).map_err(|e| self.kv_err(e))?)
    }

    fn kv_err(&self, error: KvError) -> Error {
        Error::Kv {
            tag: Some(self.tag.clone()),
            error,
        }
    }

    /// Locks the state, re-validated against the region: if it was released since the pool
    /// was last valid, every id and sequence is invalidated first; if it is not this cache's
    /// region any more (removed, maybe created again), the call fails.
    fn state(&self) -> Result<MutexGuard<'_, State>> {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let (id, releases) = self.pager.identity(&self.tag)?;
        if id != self.region_id {
            return Err(Error::InvalidArgument {
                tag: Some(self.tag.clone()),
                reason: "the region this KvCache was created on was removed (the tag now names \
                         another region); create a new KvCache"
                    .to_owned(),
            });
        }
        if releases != st.releases_seen {
            st.pool.invalidate_all();
            st.releases_seen = releases;
        }
        Ok(st)
    }

    /// The start of every call that touches memory: a lease on the cache's region and on
    /// the regions of `buffers` (so no release can slip in while the call runs; a
    /// concurrent release fails with `Busy`), then the state, validated after the lease.
    /// `NotResident` (naming `op`) while the region is released.
    fn begin(
        &self,
        op: &'static str,
        buffers: &[&Buffer],
    ) -> Result<(Lease, MutexGuard<'_, State>)> {
        let mut tags: Vec<&str> = vec![&self.tag];
        tags.extend(buffers.iter().map(|b| b.tag()));
        let lease = self.pager.lease(&tags).map_err(|e| match e {
            Error::NotResident { tag, .. } => Error::NotResident { tag, op },
            e => e,
        })?;
        let st = self.state()?;
        Ok((lease, st))
    }

    /// Byte range of the region holding blocks `blocks`.
    fn byte_range(&self, blocks: Range<u32>) -> Range<usize> {
        let bpb = self.layout.bytes_per_block() as usize;
        blocks.start as usize * bpb..blocks.end as usize * bpb
    }

    /// Maps the chunks under `ids` (grouped into runs of consecutive indices).
    fn back(&self, ids: &[BlockId]) -> Result<()> {
        let mut idx: Vec<u32> = ids.iter().map(|b| b.index).collect();
        idx.sort_unstable();
        for r in crate::runs::runs(idx) {
            self.pager.back(&self.tag, self.byte_range(r))?;
        }
        Ok(())
    }

    /// A new, empty sequence. `NotResident` while the region is released.
    pub fn create_seq(&self) -> Result<SeqId> {
        let (_lease, mut st) = self.begin("a KV cache allocation", &[])?;
        Ok(st.pool.create_seq())
    }

    /// Grows `seq` by `n` tokens, allocating the blocks it needs (lowest ids first) and
    /// mapping the chunks under them. All or nothing: on [`KvError::KvExhausted`] or when
    /// the device has no memory for the chunks ([`Error::OutOfMemory`]) nothing changed.
    /// Returns the new blocks.
    pub fn append_tokens(&self, seq: SeqId, n: u64) -> Result<Vec<BlockId>> {
        let (_lease, mut st) = self.begin("a KV cache allocation", &[])?;
        let before = st.pool.seq_tokens(seq).map_err(|e| self.kv_err(e))?;
        let new = st.pool.append_tokens(seq, n).map_err(|e| self.kv_err(e))?;
        if let Err(e) = self.back(&new) {
            // Undo the allocation; the chunks `back` mapped stay until the next trim.
            st.pool.truncate(seq, before).map_err(|e| self.kv_err(e))?;
            return Err(e);
        }
        Ok(new)
    }

    /// Shrinks `seq` to `tokens` tokens (e.g. rejected speculative tokens); returns the
    /// blocks that became free.
    pub fn truncate(&self, seq: SeqId, tokens: u64) -> Result<Vec<BlockId>> {
        let mut st = self.state()?;
        st.pool.truncate(seq, tokens).map_err(|e| self.kv_err(e))
    }

    /// A new sequence sharing all of `seq`'s blocks (copy-on-write on the next write to a
    /// shared block through [`KvCache::prepare_write`]).
    pub fn fork(&self, seq: SeqId) -> Result<SeqId> {
        let mut st = self.state()?;
        st.pool.fork(seq).map_err(|e| self.kv_err(e))
    }

    /// Drops `seq`; returns the blocks that became free (their chunks stay mapped until
    /// [`KvCache::trim`]).
    pub fn free_seq(&self, seq: SeqId) -> Result<Vec<BlockId>> {
        let mut st = self.state()?;
        st.pool.free_seq(seq).map_err(|e| self.kv_err(e))
    }

    /// `seq`'s block table (current ids, in token order) and its length in tokens.
    pub fn block_table(&self, seq: SeqId) -> Result<(Vec<BlockId>, u64)> {
        let st = self.state()?;
        let table = st
            .pool
            .block_table(seq)
            .map_err(|e| self.kv_err(e))?
            .to_vec();
        let tokens = st.pool.seq_tokens(seq).map_err(|e| self.kv_err(e))?;
        Ok((table, tokens))
    }

    /// The slot mapping for writing tokens `tokens` of `seq` (each below its length):
    /// shared blocks among them are first replaced by private copies (copy-on-write: new
    /// blocks are mapped, then one `copy_blocks` launch copies all of them). Pass the result
    /// to [`KvCache::write`]. On an error no block changed hands.
    ///
    /// Slots are raw indices without a generation: they stay valid until the sequence's
    /// blocks change (a free, a truncate, a release). If another thread may release the
    /// cache meanwhile, hold `pager.lease(&[tag])` from here until the writes are done (a
    /// release then fails with `Busy`); otherwise a release, followed by another sequence
    /// allocating the same blocks, would send these slots into that sequence's blocks.
    pub fn prepare_write(&self, seq: SeqId, tokens: Range<u64>) -> Result<Vec<i64>> {
        let (_lease, mut st) = self.begin("a KV cache allocation", &[])?;
        let len = st.pool.seq_tokens(seq).map_err(|e| self.kv_err(e))?;
        if tokens.start > tokens.end {
            // A reversed range: its start is what is out of range (at most its end).
            return Err(self.kv_err(KvError::OutOfRange {
                what: "start of the token range to write (after its end)",
                index: tokens.start,
                limit: tokens.end + 1,
            }));
        }
        if tokens.end > len {
            return Err(self.kv_err(KvError::OutOfRange {
                what: "end of the token range to write",
                index: tokens.end,
                limit: len + 1,
            }));
        }
        let bs = u64::from(self.layout.block_size());
        let table = st.pool.block_table(seq).map_err(|e| self.kv_err(e))?;
        let first = (tokens.start / bs) as usize;
        let last = (tokens.end.div_ceil(bs) as usize).min(table.len());
        let shared = table[first.min(last)..last]
            .iter()
            .any(|&b| st.pool.refcount(b).is_ok_and(|rc| rc > 1));
        // Without shared blocks `write_slot` changes nothing; with them, work on a copy so
        // that a failure (exhaustion, no memory for the copies) leaves the pool as it was.
        let mut copy = shared.then(|| st.pool.clone());
        let pool = copy.as_mut().unwrap_or(&mut st.pool);
        let mut slots = Vec::with_capacity(tokens.end.saturating_sub(tokens.start) as usize);
        let mut copies = Vec::new();
        for t in tokens {
            let target = pool.write_slot(seq, t).map_err(|e| self.kv_err(e))?;
            if let Some(src) = target.needs_copy_from {
                copies.push((src, target.block));
            }
            let slot = i64::try_from(target.slot).map_err(|_| {
                self.kv_err(KvError::OutOfRange {
                    what: "slot",
                    index: target.slot,
                    limit: i64::MAX as u64,
                })
            })?;
            slots.push(slot);
        }
        if !copies.is_empty() {
            let fresh: Vec<BlockId> = copies.iter().map(|c| c.1).collect();
            self.back(&fresh)?;
            let pairs: Vec<(u32, u32)> = copies.iter().map(|(s, d)| (s.index, d.index)).collect();
            self.run(&KvOp::CopyBlocks {
                cache: self.view(),
                pairs: &pairs,
            })?;
        }
        if let Some(pool) = copy {
            st.pool = pool;
        }
        Ok(slots)
    }

    /// Writes `tokens` tokens of keys and values (`[tokens, kv_heads, head_dim]`, a token
    /// every `token_stride_bytes`, from pager buffers) into `layer` at `slot_mapping`
    /// (slot < 0: padding, skipped). Every non-negative slot must lie in a live block that
    /// no other sequence shares (take the slots from [`KvCache::prepare_write`], which copies
    /// shared blocks first; a slot mapping is only valid until the pool changes). Two tokens
    /// mapped to one slot leave that slot undefined (the kernel writes in parallel).
    pub fn write(
        &self,
        layer: u32,
        keys: &Buffer,
        values: &Buffer,
        tokens: usize,
        token_stride_bytes: usize,
        slot_mapping: &[i64],
    ) -> Result<()> {
        // SAFETY: no raw spans: the keys and values are the leased pager buffers.
        unsafe {
            self.write_impl(
                &[keys, values],
                None,
                layer,
                tokens,
                token_stride_bytes,
                slot_mapping,
                None,
            )
        }
    }

    /// [`KvCache::write`] from raw device memory (an engine's tensors). Like every call
    /// here it runs on the backend's own stream and waits for the kernel; it is not ordered
    /// after the engine's streams.
    ///
    /// # Safety
    /// `keys` and `values` must be device memory of the pager's device, valid until the call
    /// returns, and every kernel that writes them must have finished (synchronise the
    /// producing stream first); nothing may write them during the call.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn write_raw(
        &self,
        layer: u32,
        keys: DeviceSpan,
        values: DeviceSpan,
        tokens: usize,
        token_stride_bytes: usize,
        slot_mapping: &[i64],
    ) -> Result<()> {
        // SAFETY: forwarded from the caller.
        unsafe {
            self.write_impl(
                &[],
                Some((keys, values)),
                layer,
                tokens,
                token_stride_bytes,
                slot_mapping,
                None,
            )
        }
    }

    /// [`KvCache::write_raw`] enqueued on the engine's `stream`: the slots are checked on
    /// the host as always, then the kernel is launched on `stream` reading the slot mapping
    /// from device memory at `slot_mapping_dev`, and the call returns without waiting (no
    /// host synchronisation, nothing allocated or copied). A release or trim waits for all
    /// device work before it unmaps, so the kernel never runs on unmapped memory.
    ///
    /// # Safety
    /// `stream` is a live CUDA stream of the pager's context (any value on the host
    /// backend, which runs the write synchronously); `slot_mapping_dev` holds exactly the
    /// first `tokens` values of `slot_mapping` (8-byte aligned) when the kernel runs; `keys`
    /// and `values` are valid and written by nothing else when it runs (producers ordered
    /// before it on `stream`); and the blocks the slots name stay this sequence's until
    /// then (free or reuse them only in work ordered after it).
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn write_on(
        &self,
        stream: crate::backend::RawStream,
        layer: u32,
        keys: DeviceSpan,
        values: DeviceSpan,
        tokens: usize,
        token_stride_bytes: usize,
        slot_mapping: &[i64],
        slot_mapping_dev: u64,
    ) -> Result<()> {
        // SAFETY: forwarded from the caller.
        unsafe {
            self.write_impl(
                &[],
                Some((keys, values)),
                layer,
                tokens,
                token_stride_bytes,
                slot_mapping,
                Some((stream, slot_mapping_dev)),
            )
        }
    }

    /// The three writes: lease the cache (and `buffers`' regions), check the slots against
    /// the pool, then run the write synchronously, or enqueue it on `on` = (stream, device
    /// slot mapping). The keys and values are `spans`, or else `buffers[0]` and `[1]`.
    ///
    /// # Safety
    /// Raw `spans` and `on` carry the contracts of [`KvCache::write_raw`] and
    /// [`KvCache::write_on`]; with neither there is nothing to uphold.
    #[allow(clippy::too_many_arguments)]
    unsafe fn write_impl(
        &self,
        buffers: &[&Buffer],
        spans: Option<(DeviceSpan, DeviceSpan)>,
        layer: u32,
        tokens: usize,
        token_stride_bytes: usize,
        slot_mapping: &[i64],
        on: Option<(crate::backend::RawStream, u64)>,
    ) -> Result<()> {
        let (_lease, st) = self.begin("the KV write kernel", buffers)?;
        self.check_slots(&st.pool, &slot_mapping[..tokens.min(slot_mapping.len())])?;
        let (keys, values) = match spans {
            Some(s) => s,
            None => {
                let s = self.spans(buffers)?;
                (s[0], s[1])
            }
        };
        let op = KvOp::Write {
            cache: self.view(),
            layer,
            keys,
            values,
            tokens,
            token_stride_bytes,
            slot_mapping,
        };
        op.check().map_err(|e| self.kv_err(e))?;
        // The lease keeps this region and the buffers' regions resident until this
        // returns (and a release afterwards waits for an enqueued kernel before unmapping);
        // pager buffers are live and backed (`ptr` checked them); the slots' blocks are live
        // (checked after the lease) and so backed; `check` rejected buffers overlapping the
        // cache; raw spans, the stream and the device slot mapping are the caller's contract.
        let backend = self.pager.backend();
        let r = match on {
            // SAFETY: as just said.
            None => unsafe { backend.kv_kernels().kv(&op) },
            // SAFETY: as just said.
            Some((stream, index)) => unsafe { backend.kv_kernels().kv_on(&op, stream, index) },
        };
        r.map_err(|e| Error::backend(&self.tag, "a KV kernel", e))
    }

    /// Copies `seq`'s tokens of `layer`'s K or V into `out` as a contiguous
    /// `[tokens, kv_heads, head_dim]` buffer; returns the token count.
    pub fn gather(&self, layer: u32, kv: Kv, seq: SeqId, out: &Buffer) -> Result<u64> {
        let (_lease, st) = self.begin("the KV gather kernel", &[out])?;
        let table = st.pool.block_table(seq).map_err(|e| self.kv_err(e))?;
        let tokens = st.pool.seq_tokens(seq).map_err(|e| self.kv_err(e))?;
        let ids = self.check_ids(&st.pool, table)?;
        let tokens_usize = usize::try_from(tokens).map_err(|_| {
            self.kv_err(KvError::InvalidArgument {
                reason: format!("{tokens} tokens do not fit usize"),
            })
        })?;
        let out = self.spans(&[out])?[0];
        self.run(&KvOp::Gather {
            cache: self.view(),
            layer,
            kv,
            block_table: &ids,
            tokens: tokens_usize,
            out,
        })?;
        Ok(tokens)
    }

    /// Copies whole blocks (all layers, K and V), `(src, dst)` pairs, in one launch. Both
    /// ids of every pair must be live; see [`super::reference::copy_blocks`] for the rule on
    /// overlapping pairs.
    pub fn copy_blocks(&self, pairs: &[(BlockId, BlockId)]) -> Result<()> {
        let (_lease, st) = self.begin("the KV copy_blocks kernel", &[])?;
        let flat: Vec<BlockId> = pairs.iter().flat_map(|&(s, d)| [s, d]).collect();
        let idx = self.check_ids(&st.pool, &flat)?;
        let pairs: Vec<(u32, u32)> = idx.chunks_exact(2).map(|p| (p[0], p[1])).collect();
        self.run(&KvOp::CopyBlocks {
            cache: self.view(),
            pairs: &pairs,
        })
    }

    /// Pinned host memory for swapping up to `blocks` blocks out, from the pager's backend
    /// (so the device can address it), counted against the node's host budget
    /// ([`crate::PagerConfig::host_budget_bytes`]) while it lives: over it, out of memory
    /// naming the budget and who holds what.
    pub fn alloc_host(&self, blocks: u32) -> Result<SwapSpace> {
        let bytes = usize::try_from(self.layout.bytes_per_block())
            .ok()
            .and_then(|b| b.checked_mul(blocks as usize))
            .ok_or_else(|| Error::InvalidSize {
                tag: self.tag.clone(),
                reason: format!("{blocks} blocks of swap space overflow usize bytes"),
            })?;
        let pinning = |e| Error::backend(&self.tag, "pinning host memory for swapping", e);
        let share = self.pager.reserve_host(bytes.max(1)).map_err(pinning)?;
        let buf = self
            .pager
            .backend()
            .alloc_pinned(bytes.max(1))
            .map_err(pinning)?;
        Ok(SwapSpace {
            buf,
            blocks,
            _share: share,
        })
    }

    /// Copies `blocks` (live) to `host`, packed in list order, in one zero-copy launch
    /// (preemption, offload).
    pub fn swap_out(&self, blocks: &[BlockId], host: &mut SwapSpace) -> Result<()> {
        let (_lease, st) = self.begin("the KV swap_out kernel", &[])?;
        let idx = self.check_ids(&st.pool, blocks)?;
        self.run(&KvOp::SwapOut {
            cache: self.view(),
            blocks: &idx,
            host: host.span(),
        })
    }

    /// Copies `host` (packed in list order, as [`KvCache::swap_out`] left it) into `blocks`
    /// (live, each listed once) in one zero-copy launch.
    pub fn swap_in(&self, blocks: &[BlockId], host: &SwapSpace) -> Result<()> {
        let (_lease, st) = self.begin("the KV swap_in kernel", &[])?;
        let idx = self.check_ids(&st.pool, blocks)?;
        self.run(&KvOp::SwapIn {
            cache: self.view(),
            blocks: &idx,
            host: host.span(),
        })
    }

    /// Unmaps every chunk with no live block and gives its memory back to the device;
    /// returns the bytes unmapped. Waits for the device first.
    pub fn trim(&self) -> Result<usize> {
        let st = self.state()?;
        let keep: Vec<Range<usize>> = st
            .pool
            .live_runs()
            .into_iter()
            .map(|r| self.byte_range(r))
            .collect();
        self.pager.trim(&self.tag, &keep)
    }

    /// Mapped vs reserved bytes and the pool's counters.
    pub fn stats(&self) -> Result<KvStats> {
        let st = self.state()?;
        let pool = st.pool.stats();
        let region = self.pager.region_stats(&self.tag)?;
        Ok(KvStats {
            reserved_bytes: region.info.size,
            mapped_bytes: region.resident_bytes,
            live_bytes: u64::from(pool.live) * self.layout.bytes_per_block(),
            pool,
        })
    }

    /// Runs `f` on the pool (read-only), e.g. to inspect refcounts.
    pub fn with_pool<T>(&self, f: impl FnOnce(&BlockPool) -> T) -> Result<T> {
        let st = self.state()?;
        Ok(f(&st.pool))
    }

    /// Each id current and live; returns the indices.
    fn check_ids(&self, pool: &BlockPool, ids: &[BlockId]) -> Result<Vec<u32>> {
        ids.iter()
            .map(|&id| pool.refcount(id).map(|_| id.index))
            .collect::<std::result::Result<_, _>>()
            .map_err(|e| self.kv_err(e))
    }

    /// Every non-negative slot in a live block.
    fn check_slots(&self, pool: &BlockPool, slots: &[i64]) -> Result<()> {
        let bs = u64::from(self.layout.block_size());
        for (t, &slot) in slots.iter().enumerate() {
            if slot < 0 {
                continue;
            }
            let block = slot as u64 / bs;
            let live = u32::try_from(block).ok().and_then(|b| pool.live_id(b));
            let Some(id) = live else {
                return Err(self.kv_err(KvError::InvalidArgument {
                    reason: format!(
                        "slot {slot} of token {t} lies in block {block}, which is not allocated \
                         (freed, or the cache was released since the slots were made); write \
                         only to slots of live blocks (from prepare_write)"
                    ),
                }));
            };
            if pool.refcount(id).is_ok_and(|rc| rc > 1) {
                return Err(self.kv_err(KvError::InvalidArgument {
                    reason: format!(
                        "slot {slot} of token {t} lies in block {block}, which sequences share; \
                         take the slots from prepare_write, which copies shared blocks first"
                    ),
                }));
            }
        }
        Ok(())
    }

    /// The device spans of live buffers (their regions leased by the caller).
    fn spans(&self, buffers: &[&Buffer]) -> Result<Vec<DeviceSpan>> {
        buffers
            .iter()
            .map(|b| {
                Ok(DeviceSpan {
                    addr: self.pager.ptr(b)?,
                    len: b.len(),
                })
            })
            .collect()
    }

    /// Checks `op` and runs it on the backend. The caller holds a lease from
    /// [`KvCache::begin`] and checked every block id the op names against the pool.
    fn run(&self, op: &KvOp<'_>) -> Result<()> {
        op.check().map_err(|e| self.kv_err(e))?;
        // SAFETY: the caller's lease keeps this region and the buffers' regions resident
        // until the call returns; the buffers are live and backed (`ptr` checked both);
        // every cache block the op touches was checked live after the lease was taken, and
        // live blocks are always backed; `check` rejected buffers overlapping the cache; a
        // swap's host memory is a `SwapSpace` pinned by this pager's backend.
        unsafe { self.pager.backend().kv_kernels().kv(op) }
            .map_err(|e| Error::backend(&self.tag, "a KV kernel", e))
    }
}

impl Drop for KvCache {
    /// Removes the cache's region (after waiting for device work), unless it was removed
    /// already. A failure (a lease still held on the tag) is recorded in the backend's
    /// deferred errors ([`Pager::take_deferred_errors`]), never a panic; the region then
    /// stays until `pager.remove`.
    fn drop(&mut self) {
        match self.pager.remove_if_id(&self.tag, self.region_id) {
            Ok(_) | Err(Error::UnknownTag { .. }) => {}
            Err(e) => self
                .pager
                .backend()
                .deferred_errors()
                .record(format!("dropping the KV cache `{}`: {e}", self.tag)),
        }
    }
}

/// Pinned host memory for [`KvCache::swap_out`] and [`KvCache::swap_in`], from
/// [`KvCache::alloc_host`]: blocks packed back to back, in the order of the block list.
#[derive(Debug)]
pub struct SwapSpace {
    buf: Box<dyn HostBuffer>,
    blocks: u32,
    /// This buffer's part of the process's share of the host budget.
    _share: crate::backup::Share,
}

impl SwapSpace {
    /// Blocks it was sized for.
    pub fn blocks(&self) -> u32 {
        self.blocks
    }

    /// The bytes (block `i` of the last swap at `i × bytes_per_block`).
    pub fn as_slice(&self) -> &[u8] {
        self.buf.as_slice()
    }

    /// The bytes, mutable (e.g. to restore saved blocks before a swap-in).
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        self.buf.as_mut_slice()
    }

    fn span(&self) -> DeviceSpan {
        DeviceSpan {
            addr: self.buf.device_ptr(),
            len: self.buf.len(),
        }
    }
}
