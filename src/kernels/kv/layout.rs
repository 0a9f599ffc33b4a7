//! Byte layout of the `kv_cache` region: see [`KvLayout`].

use super::KvError;

/// Element type of the cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KvDtype {
    /// bfloat16, 2 bytes.
    Bf16,
    /// IEEE half, 2 bytes.
    F16,
    /// IEEE single, 4 bytes.
    F32,
}

impl KvDtype {
    /// Bytes per element.
    pub const fn size(self) -> u64 {
        match self {
            KvDtype::Bf16 | KvDtype::F16 => 2,
            KvDtype::F32 => 4,
        }
    }
}

/// Order of the dimensions inside one page (one layer's K or V of one block).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KvOrder {
    /// `[block_size, kv_heads, head_dim]`: tokens outer (the vLLM / FlashAttention default).
    Nhd,
    /// `[kv_heads, block_size, head_dim]`: heads outer (FlashInfer's HND).
    Hnd,
}

/// Keys or values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kv {
    /// Keys.
    K,
    /// Values.
    V,
}

/// Element strides of one layer's K (or V) cache seen as `[block, token, head, dim]`.
/// Multiply by [`KvDtype::size`] for byte strides; the dim stride is always 1.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KvStrides {
    /// Elements between block `b` and block `b + 1` (the whole block: all layers, K and V).
    pub block: u64,
    /// Elements between token `t` and `t + 1` within a block.
    pub token: u64,
    /// Elements between head `h` and `h + 1`.
    pub head: u64,
}

/// Shape, dtype and order of the paged KV cache, and the byte layout of the region.
///
/// # The layout: block-major
///
/// The whole KV cache of every layer lives in one region (one virtual range) of
/// `blocks × bytes_per_block` bytes. It is **block-major**: block `b` occupies bytes
/// `[b·bytes_per_block, (b+1)·bytes_per_block)`, and inside it, for each layer `l` in order, the
/// K page of layer `l` then its V page. A page holds `block_size × kv_heads × head_dim` elements
/// in the chosen [`KvOrder`]: NHD `[block_size, kv_heads, head_dim]` or HND
/// `[kv_heads, block_size, head_dim]`.
///
/// ```text
/// block 0: [L0.K][L0.V][L1.K][L1.V] ... [Ln.K][Ln.V]
/// block 1: [L0.K][L0.V][L1.K][L1.V] ... [Ln.K][Ln.V]
/// ...
/// ```
///
/// Seen from one layer, its K cache is a strided 4-D tensor `[blocks, block_size, kv_heads,
/// head_dim]` (NHD; HND swaps the middle two) with base [`KvLayout::k_base`] and element strides
/// [`KvLayout::strides`]: the block stride is the whole block (all layers, K and V), the inner
/// strides are dense. FlashInfer and FlashAttention paged kernels take per-layer base pointers
/// with an explicit block (page) stride, so they read this layout directly; so do the crate's own
/// kernels. vLLM's cross-layer ("layers contiguous per block") layout is the same idea.
///
/// Why not layer-major `[layer][K|V][blocks][...]` (what vLLM allocates per layer by default)?
/// There every layer's tensor is dense (block stride = one page), which any kernel accepts, but
/// the blocks `0..n` of all layers are `2·layers` separate ranges spread across the whole
/// region: backing "the low blocks" needs physical chunks in every layer's slice, and trimming
/// one block id frees memory in `2·layers` places. Block-major makes blocks `0..n` one
/// contiguous prefix `[0, n·bytes_per_block)`, so elastic backing maps a compact low range of
/// block ids as few physical chunks, and a chunk-aligned range of block ids with no live block
/// can be unmapped as one piece (kvcached likewise keeps all layers in one range). The price is
/// that a kernel demanding a *dense* per-layer tensor (block stride = page size) cannot read it
/// without a copy; kernels taking strides (all the ones we target) are fine. The layout also does
/// not depend on the number of blocks, so the region can grow or be trimmed without moving any
/// layer's base.
///
/// Every row (`head_dim` elements) is a multiple of 2 bytes because every [`KvDtype`] is at
/// least 2 bytes wide; rows are 16-byte aligned when `head_dim × dtype.size()` is a multiple of
/// 16 (kernels fall back to narrower accesses otherwise).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KvLayout {
    layers: u32,
    kv_heads: u32,
    head_dim: u32,
    block_size: u32,
    dtype: KvDtype,
    order: KvOrder,
    page_elems: u64,
    block_elems: u64,
}

fn invalid(reason: impl Into<String>) -> KvError {
    KvError::InvalidLayout {
        reason: reason.into(),
    }
}

impl KvLayout {
    /// Validates and builds a layout. Errors ([`KvError::InvalidLayout`]) on a zero dimension
    /// or when a block's size overflows (it must fit in `i64` bytes, what kernels index with).
    pub fn new(
        layers: u32,
        kv_heads: u32,
        head_dim: u32,
        block_size: u32,
        dtype: KvDtype,
        order: KvOrder,
    ) -> Result<Self, KvError> {
        for (name, v) in [
            ("layers", layers),
            ("kv_heads", kv_heads),
            ("head_dim", head_dim),
            ("block_size", block_size),
        ] {
            if v == 0 {
                return Err(invalid(format!("{name} is 0; it must be at least 1")));
            }
        }
        let overflow = || {
            invalid(format!(
                "one block ({layers} layers × 2 × {block_size} tokens × {kv_heads} heads × \
                 {head_dim} dims × {} bytes) overflows i64 bytes; use smaller dimensions",
                dtype.size()
            ))
        };
        let page_elems = u64::from(block_size)
            .checked_mul(u64::from(kv_heads))
            .and_then(|x| x.checked_mul(u64::from(head_dim)))
            .ok_or_else(overflow)?;
        let block_elems = page_elems
            .checked_mul(2 * u64::from(layers))
            .ok_or_else(overflow)?;
        let block_bytes = block_elems.checked_mul(dtype.size()).ok_or_else(overflow)?;
        if block_bytes > i64::MAX as u64 {
            return Err(overflow());
        }
        Ok(Self {
            layers,
            kv_heads,
            head_dim,
            block_size,
            dtype,
            order,
            page_elems,
            block_elems,
        })
    }

    /// Number of layers.
    pub fn layers(&self) -> u32 {
        self.layers
    }
    /// KV heads per layer.
    pub fn kv_heads(&self) -> u32 {
        self.kv_heads
    }
    /// Elements per head vector.
    pub fn head_dim(&self) -> u32 {
        self.head_dim
    }
    /// Tokens per block.
    pub fn block_size(&self) -> u32 {
        self.block_size
    }
    /// Element type.
    pub fn dtype(&self) -> KvDtype {
        self.dtype
    }
    /// Order inside a page.
    pub fn order(&self) -> KvOrder {
        self.order
    }

    /// Bytes of one head vector (`head_dim × dtype.size()`).
    pub fn row_bytes(&self) -> u64 {
        u64::from(self.head_dim) * self.dtype.size()
    }

    /// Bytes of one token of all heads (`kv_heads × row_bytes`): the token stride of a dense
    /// `[tokens, kv_heads, head_dim]` buffer.
    pub fn token_bytes(&self) -> u64 {
        // ≤ page_bytes, which fits in i64.
        u64::from(self.kv_heads) * self.row_bytes()
    }

    /// Bytes of one page: one layer's K (or V) of one block.
    pub fn page_bytes(&self) -> u64 {
        self.page_elems * self.dtype.size()
    }

    /// Bytes of one block: all layers, K and V.
    pub fn bytes_per_block(&self) -> u64 {
        self.block_elems * self.dtype.size()
    }

    /// Bytes of a cache of `blocks` blocks; [`KvError::InvalidLayout`] if it overflows `u64`.
    pub fn total_bytes(&self, blocks: u32) -> Result<u64, KvError> {
        self.bytes_per_block()
            .checked_mul(u64::from(blocks))
            .ok_or_else(|| invalid(format!("{blocks} blocks overflow u64 bytes; use fewer")))
    }

    /// Whole blocks that fit in `region_bytes`, capped at `u32::MAX`.
    pub fn max_blocks(&self, region_bytes: u64) -> u32 {
        u32::try_from(region_bytes / self.bytes_per_block()).unwrap_or(u32::MAX)
    }

    fn check_layer(&self, layer: u32) -> Result<(), KvError> {
        if layer >= self.layers {
            return Err(KvError::OutOfRange {
                what: "layer",
                index: u64::from(layer),
                limit: u64::from(self.layers),
            });
        }
        Ok(())
    }

    /// Byte offset, from the region base, of block 0 of `layer`'s K or V cache.
    pub fn base(&self, layer: u32, kv: Kv) -> Result<u64, KvError> {
        self.check_layer(layer)?;
        let k = u64::from(layer) * 2 * self.page_bytes();
        Ok(match kv {
            Kv::K => k,
            Kv::V => k + self.page_bytes(),
        })
    }

    /// Byte offset of block 0 of `layer`'s K cache.
    pub fn k_base(&self, layer: u32) -> Result<u64, KvError> {
        self.base(layer, Kv::K)
    }

    /// Byte offset of block 0 of `layer`'s V cache.
    pub fn v_base(&self, layer: u32) -> Result<u64, KvError> {
        self.base(layer, Kv::V)
    }

    /// Element strides of every layer's K and V cache as `[block, token, head, dim]`
    /// (the same for all layers and for K and V).
    pub fn strides(&self) -> KvStrides {
        let hd = u64::from(self.head_dim);
        let (token, head) = match self.order {
            KvOrder::Nhd => (u64::from(self.kv_heads) * hd, hd),
            KvOrder::Hnd => (hd, u64::from(self.block_size) * hd),
        };
        KvStrides {
            block: self.block_elems,
            token,
            head,
        }
    }

    /// Byte offset of the head vector `(layer, kv, block, token, head)`; errors on an index
    /// past its limit or on `u64` overflow (a huge block index).
    pub fn offset(
        &self,
        layer: u32,
        kv: Kv,
        block: u32,
        token: u32,
        head: u32,
    ) -> Result<u64, KvError> {
        let base = self.base(layer, kv)?;
        if token >= self.block_size {
            return Err(KvError::OutOfRange {
                what: "token in block",
                index: u64::from(token),
                limit: u64::from(self.block_size),
            });
        }
        if head >= self.kv_heads {
            return Err(KvError::OutOfRange {
                what: "kv head",
                index: u64::from(head),
                limit: u64::from(self.kv_heads),
            });
        }
        let s = self.strides();
        let inner = u64::from(token) * s.token + u64::from(head) * s.head;
        self.bytes_per_block()
            .checked_mul(u64::from(block))
            .and_then(|b| b.checked_add(base + inner * self.dtype.size()))
            .ok_or_else(|| invalid(format!("block {block} overflows u64 byte offsets")))
    }

    /// Byte offset of the head vector of `slot = block × block_size + token_in_block`
    /// (vLLM's slot mapping) for `layer`, K or V, and `head`.
    pub fn slot_offset(&self, layer: u32, kv: Kv, slot: u64, head: u32) -> Result<u64, KvError> {
        let bs = u64::from(self.block_size);
        let block = u32::try_from(slot / bs).map_err(|_| KvError::OutOfRange {
            what: "slot",
            index: slot,
            limit: (u64::from(u32::MAX) + 1) * bs,
        })?;
        // slot % bs < block_size, which is a u32.
        let token = (slot % bs) as u32;
        self.offset(layer, kv, block, token, head)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    fn layouts() -> Vec<KvLayout> {
        let mut v = Vec::new();
        for order in [KvOrder::Nhd, KvOrder::Hnd] {
            for dtype in [KvDtype::Bf16, KvDtype::F16, KvDtype::F32] {
                for (layers, heads, dim, bs) in [(1, 1, 1, 1), (2, 3, 5, 4), (3, 2, 8, 3)] {
                    v.push(KvLayout::new(layers, heads, dim, bs, dtype, order).unwrap());
                }
            }
        }
        v
    }

    /// Every (layer, K/V, block, token, head) row occupies its own bytes, the rows tile the
    /// region exactly, and the offsets agree with base + strides.
    #[test]
    fn offsets_never_overlap_and_match_strides() {
        for l in layouts() {
            let blocks = 3u32;
            let total = l.total_bytes(blocks).unwrap();
            let row = l.row_bytes();
            let size = l.dtype().size();
            let s = l.strides();
            let mut seen = HashSet::new();
            for b in 0..blocks {
                for layer in 0..l.layers() {
                    for kv in [Kv::K, Kv::V] {
                        for t in 0..l.block_size() {
                            for h in 0..l.kv_heads() {
                                let off = l.offset(layer, kv, b, t, h).unwrap();
                                assert!(off + row <= total);
                                assert_eq!(off % row, 0, "rows are row-aligned");
                                assert!(seen.insert(off / row), "overlap at {off} in {l:?}");
                                let strided = l.base(layer, kv).unwrap()
                                    + size
                                        * (u64::from(b) * s.block
                                            + u64::from(t) * s.token
                                            + u64::from(h) * s.head);
                                assert_eq!(off, strided);
                                let slot = u64::from(b) * u64::from(l.block_size()) + u64::from(t);
                                assert_eq!(l.slot_offset(layer, kv, slot, h).unwrap(), off);
                            }
                        }
                    }
                }
            }
            assert_eq!(seen.len() as u64 * row, total, "rows tile the region");
        }
    }

    #[test]
    fn block_major_prefix() {
        let l = KvLayout::new(4, 2, 16, 8, KvDtype::Bf16, KvOrder::Hnd).unwrap();
        assert_eq!(l.page_bytes(), 8 * 2 * 16 * 2);
        assert_eq!(l.bytes_per_block(), 4 * 2 * l.page_bytes());
        // every byte of blocks 0..n lies in [0, n * bytes_per_block)
        let last = l.offset(3, Kv::V, 1, 7, 1).unwrap();
        assert_eq!(last + l.row_bytes(), l.total_bytes(2).unwrap());
        assert_eq!(l.v_base(0).unwrap(), l.page_bytes());
        assert_eq!(l.k_base(1).unwrap(), 2 * l.page_bytes());
        assert_eq!(l.max_blocks(l.bytes_per_block() * 5 + 1), 5);
    }

    #[test]
    fn validation() {
        let bad = |r: Result<KvLayout, KvError>| {
            assert!(matches!(r, Err(KvError::InvalidLayout { .. })), "{r:?}")
        };
        bad(KvLayout::new(0, 1, 1, 1, KvDtype::F16, KvOrder::Nhd));
        bad(KvLayout::new(1, 0, 1, 1, KvDtype::F16, KvOrder::Nhd));
        bad(KvLayout::new(1, 1, 0, 1, KvDtype::F16, KvOrder::Nhd));
        bad(KvLayout::new(1, 1, 1, 0, KvDtype::F16, KvOrder::Nhd));
        bad(KvLayout::new(
            u32::MAX,
            u32::MAX,
            u32::MAX,
            2,
            KvDtype::F32,
            KvOrder::Nhd,
        ));
        bad(KvLayout::new(
            u32::MAX,
            u32::MAX,
            4,
            1,
            KvDtype::F32,
            KvOrder::Nhd,
        ));
        let l = KvLayout::new(
            1 << 20,
            1 << 10,
            1 << 10,
            1 << 10,
            KvDtype::F32,
            KvOrder::Nhd,
        );
        let l = l.unwrap();
        bad(l.total_bytes(u32::MAX).map(|_| l));
        assert!(l.offset(0, Kv::K, u32::MAX, 0, 0).is_err());

        let l = KvLayout::new(2, 2, 4, 4, KvDtype::F16, KvOrder::Nhd).unwrap();
        let oor = |r: Result<u64, KvError>| {
            assert!(matches!(r, Err(KvError::OutOfRange { .. })), "{r:?}")
        };
        oor(l.k_base(2));
        oor(l.v_base(7));
        oor(l.offset(0, Kv::K, 0, 4, 0));
        oor(l.offset(0, Kv::K, 0, 0, 2));
        oor(l.slot_offset(0, Kv::V, u64::MAX, 0));
        let e = l.k_base(2).unwrap_err().to_string();
        assert!(e.contains("layer 2") && e.contains("limit 2"), "{e}");
    }
}
