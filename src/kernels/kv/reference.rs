//! Plain-Rust reference implementations of the KV kernels: `write`, `copy_blocks`,
//! `gather`, `swap_out` and `swap_in`.
//!
//! The CUDA kernels in `kernels/kv.cu` are tested against these (fresh random data, outputs
//! poisoned first, every shape compared byte for byte), and the host backend runs them on
//! its own memory. They are written for clarity, not speed. Each has a `check_*` twin that
//! validates a call from buffer lengths alone: what every backend runs before it launches.
//!
//! # Conventions
//!
//! * The cache is any [`CacheBytes`] (a byte slice, or a region's raw memory) laid out by
//!   [`KvLayout`] (block-major: block `b` occupies `[b·bytes_per_block,
//!   (b+1)·bytes_per_block)`). Its capacity is the number of **whole** blocks in it
//!   ([`blocks_in`]); trailing bytes past the last whole block are never read or written. A
//!   block id (or the block of a slot) at or past the capacity is an error.
//! * The kernels are pure data movement, so they are dtype-agnostic: a head vector is a row
//!   of [`KvLayout::row_bytes`] bytes moved as bytes. Only where the CUDA kernels need element
//!   alignment (the token stride of `write`) does the dtype size matter.
//! * Token-major buffers (`keys`, `values`, the output of `gather`) hold one token as
//!   `[kv_heads, head_dim]` dense rows.
//! * Caller buffers (keys, values, outputs, the host buffer) may be **longer** than needed:
//!   only the needed prefix is read or written, the rest is left untouched.
//! * Every function validates all of its inputs before it moves a byte: on error it returns
//!   a [`KvError`] and nothing was written. Indices past their limit (layer, slot, block id,
//!   token count, a buffer too short) are [`KvError::OutOfRange`] — for a short buffer, the
//!   index is the last byte the operation would touch and the limit the buffer's length.
//!   Arguments unusable for another reason (a token stride too small or misaligned,
//!   conflicting `copy_blocks` pairs, a repeated `swap_in` block) are
//!   [`KvError::InvalidArgument`] with the reason.

use std::collections::HashSet;

use super::{Kv, KvError, KvLayout};

pub(super) fn invalid(reason: impl Into<String>) -> KvError {
    KvError::InvalidArgument {
        reason: reason.into(),
    }
}

/// `u64 → usize`; only fails on targets with a `usize` narrower than the value.
fn to_usize(x: u64, what: &str) -> Result<usize, KvError> {
    usize::try_from(x).map_err(|_| invalid(format!("{what} ({x}) does not fit in usize")))
}

/// Errors unless the `what` buffer's `len` bytes hold `needed` bytes.
fn need(what: &'static str, needed: u64, len: usize) -> Result<(), KvError> {
    if needed > len as u64 {
        return Err(KvError::BufferTooSmall {
            what,
            needed,
            len: len as u64,
        });
    }
    Ok(())
}

fn check_block(what: &'static str, block: u32, capacity: u32) -> Result<(), KvError> {
    if block >= capacity {
        return Err(KvError::OutOfRange {
            what,
            index: u64::from(block),
            limit: u64::from(capacity),
        });
    }
    Ok(())
}

/// Whole blocks of `layout` in a cache of `cache_bytes` bytes: the capacity the functions of
/// this module check block ids and slots against (capped at `u32::MAX`).
pub fn blocks_in(layout: &KvLayout, cache_bytes: usize) -> u32 {
    layout.max_blocks(cache_bytes as u64)
}

/// Bytes of one token of all heads, `kv_heads × row_bytes`: the minimum token stride of
/// [`write()`] and the token stride of the output of [`gather`].
pub fn token_bytes(layout: &KvLayout) -> u64 {
    layout.token_bytes()
}

/// The cache memory the references move bytes in and out of: a byte slice (a host mirror in
/// tests), or, on the host backend, the region itself, where only the blocks a call touches
/// need to be mapped (so no reference to unmapped memory is ever formed). Offsets and
/// lengths are in range: the functions of this module check before they call.
pub trait CacheBytes {
    /// Length in bytes.
    fn len(&self) -> usize;
    /// Whether the cache has no bytes.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Copies `dst.len()` bytes at `off` into `dst`.
    fn read(&self, off: usize, dst: &mut [u8]);
    /// Copies `src` to `off`.
    fn write(&mut self, off: usize, src: &[u8]);
    /// Copies `len` bytes from offset `src` to offset `dst` (the ranges may overlap).
    fn copy_within(&mut self, src: usize, dst: usize, len: usize);
}

impl CacheBytes for [u8] {
    fn len(&self) -> usize {
        <[u8]>::len(self)
    }
    fn read(&self, off: usize, dst: &mut [u8]) {
        dst.copy_from_slice(&self[off..off + dst.len()]);
    }
    fn write(&mut self, off: usize, src: &[u8]) {
        self[off..off + src.len()].copy_from_slice(src);
    }
    fn copy_within(&mut self, src: usize, dst: usize, len: usize) {
        <[u8]>::copy_within(self, src..src + len, dst);
    }
}

impl CacheBytes for Vec<u8> {
    fn len(&self) -> usize {
        self.as_slice().len()
    }
    fn read(&self, off: usize, dst: &mut [u8]) {
        self.as_slice().read(off, dst)
    }
    fn write(&mut self, off: usize, src: &[u8]) {
        CacheBytes::write(self.as_mut_slice(), off, src)
    }
    fn copy_within(&mut self, src: usize, dst: usize, len: usize) {
        CacheBytes::copy_within(self.as_mut_slice(), src, dst, len)
    }
}

/// Reference of the KV write kernel (vLLM's `reshape_and_cache_flash` role).
///
/// For each token `t < tokens`, the keys and values of all heads, `[kv_heads, head_dim]`
/// dense rows starting at byte `t × token_stride_bytes` of `keys` / `values`, go to layer
/// `layer`'s K and V cache at slot `slot_mapping[t]`: block `slot / block_size`, token
/// `slot % block_size` of that block. A negative slot is padding: that token is skipped.
///
/// Validated first (nothing is written on error):
/// * `layer < layers` ([`KvError::OutOfRange`]);
/// * `token_stride_bytes ≥ kv_heads × row_bytes` and a multiple of the dtype size (the CUDA
///   kernel reads whole, aligned elements) ([`KvError::InvalidArgument`]);
/// * `slot_mapping` has at least `tokens` entries (only the first `tokens` are read);
/// * `keys` and `values` hold `(tokens − 1) × token_stride_bytes + kv_heads × row_bytes`
///   bytes (nothing when `tokens` is 0);
/// * every non-negative slot is below `capacity × block_size`, where capacity is
///   [`blocks_in`]`(layout, cache.len())`.
///
/// Two tokens mapped to the same slot: the later one wins here; the CUDA kernel writes them
/// in parallel, so callers must not rely on either (engines never map two tokens to one slot).
#[allow(clippy::too_many_arguments)]
pub fn write(
    cache: &mut (impl CacheBytes + ?Sized),
    layout: &KvLayout,
    layer: u32,
    keys: &[u8],
    values: &[u8],
    tokens: usize,
    token_stride_bytes: usize,
    slot_mapping: &[i64],
) -> Result<(), KvError> {
    check_write(
        layout,
        cache.len(),
        layer,
        keys.len(),
        values.len(),
        tokens,
        token_stride_bytes,
        slot_mapping,
    )?;
    let row = to_usize(layout.row_bytes(), "row bytes")?;
    let stride = token_stride_bytes as u64;
    for (t, &slot) in slot_mapping[..tokens].iter().enumerate() {
        if slot < 0 {
            continue;
        }
        let src = t as u64 * stride;
        for h in 0..layout.kv_heads() {
            let from = src + u64::from(h) * layout.row_bytes();
            let from = from as usize;
            let k = layout.slot_offset(layer, Kv::K, slot as u64, h)?;
            cache.write(k as usize, &keys[from..from + row]);
            let v = layout.slot_offset(layer, Kv::V, slot as u64, h)?;
            cache.write(v as usize, &values[from..from + row]);
        }
    }
    Ok(())
}

/// The checks of [`write()`] on buffer lengths instead of buffers: what every backend's
/// launcher runs before it moves a byte.
#[allow(clippy::too_many_arguments)]
pub fn check_write(
    layout: &KvLayout,
    cache_len: usize,
    layer: u32,
    keys_len: usize,
    values_len: usize,
    tokens: usize,
    token_stride_bytes: usize,
    slot_mapping: &[i64],
) -> Result<(), KvError> {
    layout.base(layer, Kv::K)?;
    let token_bytes = token_bytes(layout);
    let stride = token_stride_bytes as u64;
    if stride < token_bytes {
        return Err(invalid(format!(
            "write: token_stride_bytes {stride} is smaller than one token of all heads \
             ({} heads × {} bytes = {token_bytes} bytes); pass the byte stride between tokens \
             of the keys / values tensors",
            layout.kv_heads(),
            layout.row_bytes()
        )));
    }
    let elem = layout.dtype().size();
    if !stride.is_multiple_of(elem) {
        return Err(invalid(format!(
            "write: token_stride_bytes {stride} is not a multiple of the element size \
             ({elem} bytes); pass a stride in whole elements"
        )));
    }
    if slot_mapping.len() < tokens {
        return Err(KvError::OutOfRange {
            what: "token of slot_mapping",
            index: tokens as u64 - 1,
            limit: slot_mapping.len() as u64,
        });
    }
    let slots = &slot_mapping[..tokens];
    if tokens > 0 {
        let needed = (tokens as u64 - 1)
            .saturating_mul(stride)
            .saturating_add(token_bytes);
        need("keys", needed, keys_len)?;
        need("values", needed, values_len)?;
    }
    let capacity = blocks_in(layout, cache_len);
    let limit = u64::from(capacity) * u64::from(layout.block_size());
    for &slot in slots {
        if slot >= 0 && slot as u64 >= limit {
            return Err(KvError::OutOfRange {
                what: "slot",
                index: slot as u64,
                limit,
            });
        }
    }
    Ok(())
}

/// Reference of the copy-blocks kernel (copy-on-write): for each `(src, dst)` pair, block
/// `src` — all layers, K and V, `bytes_per_block` bytes — is copied over block `dst`.
///
/// # The ordering rule
///
/// The CUDA kernel copies all pairs in one launch, in parallel, so the result must not depend
/// on the order of the pairs. It does not when **no block is written twice and no written
/// block is read**: the destinations are pairwise distinct and none of them is the source of
/// any pair (including its own: `src == dst` is rejected too). Sources may repeat (one block
/// copied to several forks). Lists breaking the rule are rejected with
/// [`KvError::InvalidArgument`]; split them into several calls (a copy chain `a → b`, `b → c`
/// becomes `b → c` then `a → b`).
///
/// Validated first (nothing is written on error): every id below the capacity
/// [`blocks_in`]`(layout, cache.len())` ([`KvError::OutOfRange`]), then the rule above.
pub fn copy_blocks(
    cache: &mut (impl CacheBytes + ?Sized),
    layout: &KvLayout,
    pairs: &[(u32, u32)],
) -> Result<(), KvError> {
    check_copy_blocks(layout, cache.len(), pairs)?;
    let bpb = to_usize(layout.bytes_per_block(), "bytes per block")?;
    for &(src, dst) in pairs {
        cache.copy_within(src as usize * bpb, dst as usize * bpb, bpb);
    }
    Ok(())
}

/// The checks of [`copy_blocks`] on the cache length instead of the cache.
pub fn check_copy_blocks(
    layout: &KvLayout,
    cache_len: usize,
    pairs: &[(u32, u32)],
) -> Result<(), KvError> {
    let capacity = blocks_in(layout, cache_len);
    for &(src, dst) in pairs {
        check_block("source block", src, capacity)?;
        check_block("destination block", dst, capacity)?;
    }
    let sources: HashSet<u32> = pairs.iter().map(|&(src, _)| src).collect();
    let mut dests = HashSet::with_capacity(pairs.len());
    for (i, &(src, dst)) in pairs.iter().enumerate() {
        if sources.contains(&dst) {
            return Err(invalid(format!(
                "copy_blocks: pair {i} ({src} → {dst}) writes block {dst}, which is also a \
                 source; a written block must not be read in the same call (the kernel copies \
                 all pairs in parallel): split the list into calls"
            )));
        }
        if !dests.insert(dst) {
            return Err(invalid(format!(
                "copy_blocks: pair {i} ({src} → {dst}) writes block {dst}, which an earlier pair \
                 writes too; give each destination once"
            )));
        }
    }
    Ok(())
}

/// Reference of the gather kernel: the first `tokens` tokens of one sequence, read through its
/// `block_table` (block ids in token order; token `i` lives in block `block_table[i /
/// block_size]` at token `i % block_size`), from layer `layer`'s K or V cache into `out` as a
/// contiguous `[tokens, kv_heads, head_dim]` buffer (`tokens × kv_heads × row_bytes` bytes).
///
/// Validated first (nothing is written on error), all [`KvError::OutOfRange`]: `layer <
/// layers`; `tokens ≤ block_table.len() × block_size`; each of the first
/// `⌈tokens / block_size⌉` table entries (the ones read; entries past them are ignored, so a
/// padded table is fine) below the capacity [`blocks_in`]`(layout, cache.len())`; `out` long
/// enough.
pub fn gather(
    cache: &(impl CacheBytes + ?Sized),
    layout: &KvLayout,
    layer: u32,
    kv: Kv,
    block_table: &[u32],
    tokens: usize,
    out: &mut [u8],
) -> Result<(), KvError> {
    check_gather(
        layout,
        cache.len(),
        layer,
        kv,
        block_table,
        tokens,
        out.len(),
    )?;
    let bs = u64::from(layout.block_size());
    let token_bytes = token_bytes(layout);
    let row = to_usize(layout.row_bytes(), "row bytes")?;
    for i in 0..tokens as u64 {
        let block = block_table[(i / bs) as usize];
        let token = (i % bs) as u32;
        for h in 0..layout.kv_heads() {
            let src = layout.offset(layer, kv, block, token, h)?;
            let dst = (i * token_bytes + u64::from(h) * layout.row_bytes()) as usize;
            cache.read(src as usize, &mut out[dst..dst + row]);
        }
    }
    Ok(())
}

/// The checks of [`gather`] on buffer lengths instead of buffers.
pub fn check_gather(
    layout: &KvLayout,
    cache_len: usize,
    layer: u32,
    kv: Kv,
    block_table: &[u32],
    tokens: usize,
    out_len: usize,
) -> Result<(), KvError> {
    layout.base(layer, kv)?;
    let bs = u64::from(layout.block_size());
    let used = (tokens as u64).div_ceil(bs);
    if used > block_table.len() as u64 {
        return Err(KvError::OutOfRange {
            what: "token of the block table",
            index: tokens as u64 - 1,
            limit: (block_table.len() as u64).saturating_mul(bs),
        });
    }
    let capacity = blocks_in(layout, cache_len);
    for &b in &block_table[..used as usize] {
        check_block("block of the block table", b, capacity)?;
    }
    need(
        "output",
        (tokens as u64).saturating_mul(token_bytes(layout)),
        out_len,
    )?;
    Ok(())
}

/// The checks of [`swap_out`] (and the range checks of [`swap_in`]) on buffer lengths;
/// returns `bytes_per_block` as `usize`.
pub fn check_swap_out(
    layout: &KvLayout,
    cache_len: usize,
    blocks: &[u32],
    host_len: usize,
) -> Result<usize, KvError> {
    let capacity = blocks_in(layout, cache_len);
    for &b in blocks {
        check_block("block", b, capacity)?;
    }
    need(
        "host",
        (blocks.len() as u64).saturating_mul(layout.bytes_per_block()),
        host_len,
    )?;
    to_usize(layout.bytes_per_block(), "bytes per block")
}

/// Reference of the swap-out kernel: block `blocks[i]` (all layers, K and V) is copied to
/// bytes `[i·bytes_per_block, (i+1)·bytes_per_block)` of `host` — the blocks packed back to
/// back, in list order.
///
/// Validated first (nothing is written on error), [`KvError::OutOfRange`]: every id below
/// the capacity [`blocks_in`]`(layout, cache.len())`; `host` at least
/// `blocks.len() × bytes_per_block` bytes. A block may be listed more than once.
pub fn swap_out(
    cache: &(impl CacheBytes + ?Sized),
    layout: &KvLayout,
    blocks: &[u32],
    host: &mut [u8],
) -> Result<(), KvError> {
    let bpb = check_swap_out(layout, cache.len(), blocks, host.len())?;
    for (i, &b) in blocks.iter().enumerate() {
        cache.read(b as usize * bpb, &mut host[i * bpb..(i + 1) * bpb]);
    }
    Ok(())
}

/// Reference of the swap-in kernel, the inverse of [`swap_out`]: bytes
/// `[i·bytes_per_block, (i+1)·bytes_per_block)` of `host` are copied to block `blocks[i]`.
///
/// Validated first (nothing is written on error): every id below the capacity
/// [`blocks_in`]`(layout, cache.len())` and `host` at least `blocks.len() × bytes_per_block`
/// bytes ([`KvError::OutOfRange`]); no block listed twice — the kernel writes all blocks in
/// parallel, so a repeat would make the result depend on scheduling
/// ([`KvError::InvalidArgument`]).
pub fn swap_in(
    cache: &mut (impl CacheBytes + ?Sized),
    layout: &KvLayout,
    blocks: &[u32],
    host: &[u8],
) -> Result<(), KvError> {
    let bpb = check_swap_in(layout, cache.len(), blocks, host.len())?;
    for (i, &b) in blocks.iter().enumerate() {
        cache.write(b as usize * bpb, &host[i * bpb..(i + 1) * bpb]);
    }
    Ok(())
}

/// The checks of [`swap_in`] on buffer lengths; returns `bytes_per_block` as `usize`.
pub fn check_swap_in(
    layout: &KvLayout,
    cache_len: usize,
    blocks: &[u32],
    host_len: usize,
) -> Result<usize, KvError> {
    let bpb = check_swap_out(layout, cache_len, blocks, host_len)?;
    let mut seen = HashSet::with_capacity(blocks.len());
    for (i, &b) in blocks.iter().enumerate() {
        if !seen.insert(b) {
            return Err(invalid(format!(
                "swap_in: block {b} is listed twice (again at position {i}); give each \
                 destination block once"
            )));
        }
    }
    Ok(bpb)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::kv::{KvDtype, KvOrder};

    /// 1 layer, 2 heads, head_dim 1, 2 tokens per block, bf16: a row is 2 bytes, a page
    /// 8 bytes, a block 16 bytes ([K page][V page]).
    fn tiny(order: KvOrder) -> KvLayout {
        KvLayout::new(1, 2, 1, 2, KvDtype::Bf16, order).unwrap()
    }

    #[test]
    fn write_hand_computed_offsets() {
        // keys of token 0: heads [1 2] [3 4]; token 1: [5 6] [7 8]; values + 100.
        let keys = [1u8, 2, 3, 4, 5, 6, 7, 8];
        let values: Vec<u8> = keys.iter().map(|k| k + 100).collect();
        for (order, expect_block1) in [
            // NHD page: [tok0 h0][tok0 h1][tok1 h0][tok1 h1]
            (
                KvOrder::Nhd,
                [0, 0, 0, 0, 1, 2, 3, 4, 0, 0, 0, 0, 101, 102, 103, 104],
            ),
            // HND page: [h0 tok0][h0 tok1][h1 tok0][h1 tok1]
            (
                KvOrder::Hnd,
                [0, 0, 1, 2, 0, 0, 3, 4, 0, 0, 101, 102, 0, 0, 103, 104],
            ),
        ] {
            let l = tiny(order);
            let mut cache = vec![0u8; 32];
            // token 0 → slot 3 (block 1, token 1), token 1 is padding.
            write(&mut cache, &l, 0, &keys, &values, 2, 4, &[3, -1]).unwrap();
            assert!(cache[..16].iter().all(|&b| b == 0), "{order:?}");
            assert_eq!(cache[16..], expect_block1, "{order:?}");
        }
    }

    #[test]
    fn write_strided_and_short_buffers() {
        let l = tiny(KvOrder::Nhd);
        let mut cache = vec![0u8; 16];
        // stride 6: token 1 starts at byte 6; the last token needs only 4 bytes.
        let keys = [1u8, 2, 3, 4, 9, 9, 5, 6, 7, 8];
        write(&mut cache, &l, 0, &keys, &keys, 2, 6, &[1, 0]).unwrap();
        assert_eq!(cache[..8], [5, 6, 7, 8, 1, 2, 3, 4]);
        let e = write(&mut cache, &l, 0, &keys[..9], &keys, 2, 6, &[1, 0]).unwrap_err();
        assert_eq!(
            e,
            KvError::BufferTooSmall {
                what: "keys",
                needed: 10,
                len: 9
            }
        );
        // odd stride for a 2-byte dtype
        assert!(matches!(
            write(&mut cache, &l, 0, &keys, &keys, 1, 5, &[0]),
            Err(KvError::InvalidArgument { .. })
        ));
        // no tokens: nothing needed, nothing written
        write(&mut cache, &l, 0, &[], &[], 0, 4, &[]).unwrap();
    }

    #[test]
    fn copy_rule() {
        let l = tiny(KvOrder::Nhd);
        let mut cache: Vec<u8> = (0..64).collect();
        let bad = |r: Result<(), KvError>| {
            assert!(matches!(r, Err(KvError::InvalidArgument { .. })), "{r:?}")
        };
        let orig = cache.clone();
        bad(copy_blocks(&mut cache, &l, &[(0, 0)]));
        bad(copy_blocks(&mut cache, &l, &[(0, 1), (1, 2)]));
        bad(copy_blocks(&mut cache, &l, &[(1, 2), (0, 1)]));
        bad(copy_blocks(&mut cache, &l, &[(0, 1), (2, 1)]));
        assert_eq!(cache, orig);
        // fan-out from one source is fine
        copy_blocks(&mut cache, &l, &[(3, 0), (3, 1)]).unwrap();
        assert_eq!(cache[..16], orig[48..]);
        assert_eq!(cache[16..32], orig[48..]);
        assert_eq!(cache[32..], orig[32..]);
    }

    #[test]
    fn capacity_ignores_trailing_bytes() {
        let l = tiny(KvOrder::Hnd);
        assert_eq!(blocks_in(&l, 47), 2);
        let mut cache = vec![7u8; 47];
        let r = swap_in(&mut cache, &l, &[2], &[0; 16]);
        assert_eq!(
            r,
            Err(KvError::OutOfRange {
                what: "block",
                index: 2,
                limit: 2
            })
        );
        swap_in(&mut cache, &l, &[1], &[0; 16]).unwrap();
        assert!(cache[..16].iter().all(|&b| b == 7));
        assert!(cache[16..32].iter().all(|&b| b == 0));
        assert!(cache[32..].iter().all(|&b| b == 7));
    }
}
