//! One KV kernel call described on device addresses: what a backend launches
//! ([`crate::backend::KvKernels::kv`]). [`crate::kv::KvCache`] builds these after checking
//! block ids against its pool; they can also be built by hand for engine-owned tensors.

use super::reference::{self, invalid};
use super::{Kv, KvError, KvLayout};

/// Where a paged KV cache lives: its layout, the device address of block 0 (the region
/// base) and how many blocks follow it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheView {
    /// The layout.
    pub layout: KvLayout,
    /// Device address of block 0.
    pub base: u64,
    /// Blocks in the cache.
    pub blocks: u32,
}

impl CacheView {
    /// Bytes of the whole cache (`blocks × bytes_per_block`).
    pub fn bytes(&self) -> u64 {
        // Saturates instead of wrapping; `KvOp::check` rejects a cache this large.
        self.layout
            .bytes_per_block()
            .saturating_mul(u64::from(self.blocks))
    }
}

/// A range of device memory (or of pinned host memory the device can address).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceSpan {
    /// First address.
    pub addr: u64,
    /// Length in bytes.
    pub len: usize,
}

impl DeviceSpan {
    fn end(&self) -> u64 {
        self.addr.saturating_add(self.len as u64)
    }
}

/// One KV kernel call. Index lists (slots, block tables, block ids) are host slices: the
/// backend checks them and copies them to the device itself.
///
/// The semantics of each variant are those of the function of the same name in
/// [`reference`](mod@reference), with the cache at [`CacheView::base`] and the buffers
/// at the given spans.
#[derive(Debug, Clone, Copy)]
pub enum KvOp<'a> {
    /// [`reference::write()`]: `tokens` tokens of keys and values (token-major, a token every
    /// `token_stride_bytes`) into `layer`'s K and V pages at `slot_mapping` (slot < 0:
    /// padding).
    Write {
        /// The cache.
        cache: CacheView,
        /// Layer written.
        layer: u32,
        /// The keys.
        keys: DeviceSpan,
        /// The values.
        values: DeviceSpan,
        /// Tokens to write.
        tokens: usize,
        /// Bytes between tokens of `keys` and `values`.
        token_stride_bytes: usize,
        /// One slot per token.
        slot_mapping: &'a [i64],
    },
    /// [`reference::gather`]: `tokens` tokens of `layer`'s K or V, read through
    /// `block_table`, into `out` as `[tokens, kv_heads, head_dim]`.
    Gather {
        /// The cache.
        cache: CacheView,
        /// Layer read.
        layer: u32,
        /// Keys or values.
        kv: Kv,
        /// Block ids in token order.
        block_table: &'a [u32],
        /// Tokens to gather.
        tokens: usize,
        /// The output.
        out: DeviceSpan,
    },
    /// [`reference::copy_blocks`]: whole blocks, `(src, dst)` pairs, in one launch.
    CopyBlocks {
        /// The cache.
        cache: CacheView,
        /// `(source, destination)` block ids.
        pairs: &'a [(u32, u32)],
    },
    /// [`reference::swap_out`]: `blocks` into `host`, packed in list order.
    SwapOut {
        /// The cache.
        cache: CacheView,
        /// Blocks to copy out.
        blocks: &'a [u32],
        /// Pinned host memory (its device-visible address).
        host: DeviceSpan,
    },
    /// [`reference::swap_in`]: `host`, packed in list order, into `blocks`.
    SwapIn {
        /// The cache.
        cache: CacheView,
        /// Blocks to overwrite.
        blocks: &'a [u32],
        /// Pinned host memory (its device-visible address).
        host: DeviceSpan,
    },
}

impl KvOp<'_> {
    /// The kernel's name, for errors and reports (`"write"`, `"gather"`, ...).
    pub fn name(&self) -> &'static str {
        match self {
            KvOp::Write { .. } => "write",
            KvOp::Gather { .. } => "gather",
            KvOp::CopyBlocks { .. } => "copy_blocks",
            KvOp::SwapOut { .. } => "swap_out",
            KvOp::SwapIn { .. } => "swap_in",
        }
    }

    /// The cache the call works on.
    pub fn cache(&self) -> &CacheView {
        match self {
            KvOp::Write { cache, .. }
            | KvOp::Gather { cache, .. }
            | KvOp::CopyBlocks { cache, .. }
            | KvOp::SwapOut { cache, .. }
            | KvOp::SwapIn { cache, .. } => cache,
        }
    }

    /// Bytes the call moves (each byte counted once: read from one place, written to
    /// another). Bandwidth figures divide this by the time.
    pub fn bytes_moved(&self) -> u64 {
        let l = &self.cache().layout;
        let token = l.token_bytes();
        match *self {
            KvOp::Write {
                tokens,
                slot_mapping,
                ..
            } => {
                2 * token
                    * slot_mapping[..tokens.min(slot_mapping.len())]
                        .iter()
                        .filter(|&&s| s >= 0)
                        .count() as u64
            }
            KvOp::Gather { tokens, .. } => token * tokens as u64,
            KvOp::CopyBlocks { pairs, .. } => l.bytes_per_block() * pairs.len() as u64,
            KvOp::SwapOut { blocks, .. } | KvOp::SwapIn { blocks, .. } => {
                l.bytes_per_block() * blocks.len() as u64
            }
        }
    }

    /// Checks the whole call before anything is launched: every check of the reference
    /// function (ids and slots below the capacity, lengths consistent, lists well formed),
    /// the cache range not wrapping, and no caller buffer overlapping the cache.
    pub fn check(&self) -> Result<(), KvError> {
        let cache = self.cache_span()?;
        let (buffers, count) = self.buffers();
        // What the kernels need on every backend (so host tests fail where a GPU would):
        // 2-byte alignment (the narrowest access) and counts that fit 32 bits.
        for (what, s) in std::iter::once(("cache", cache)).chain(buffers.iter().copied()) {
            if s.addr % 2 != 0 {
                return Err(invalid(format!(
                    "{}: the {what} address {:#x} is odd; the kernels need 2-byte alignment",
                    self.name(),
                    s.addr
                )));
            }
        }
        if u32::try_from(count).is_err() {
            return Err(invalid(format!(
                "{}: {count} tokens or blocks in one call; at most {} — split the call",
                self.name(),
                u32::MAX
            )));
        }
        self.check_reference(cache.len)?;
        for (what, s) in buffers {
            if s.len > 0 && s.addr < cache.end() && cache.addr < s.end() {
                return Err(invalid(format!(
                    "{}: the {what} buffer {:#x}..{:#x} overlaps the cache {:#x}..{:#x}; \
                     pass a buffer outside the KV cache",
                    self.name(),
                    s.addr,
                    s.end(),
                    cache.addr,
                    cache.end()
                )));
            }
        }
        Ok(())
    }

    /// The cache's span, after checking that its size fits `usize`, that one token of all
    /// heads fits the kernels' 31-bit index and that the range does not wrap.
    fn cache_span(&self) -> Result<DeviceSpan, KvError> {
        let c = self.cache();
        let bytes = c.layout.total_bytes(c.blocks)?;
        let len = usize::try_from(bytes)
            .map_err(|_| invalid(format!("a cache of {bytes} bytes does not fit usize")))?;
        if c.layout.token_bytes() >= 1 << 31 {
            return Err(invalid(format!(
                "{}: one token of all heads is {} bytes; the kernels index it with 31 bits",
                self.name(),
                c.layout.token_bytes()
            )));
        }
        if c.base.checked_add(c.bytes()).is_none() {
            return Err(invalid(format!(
                "the cache at {:#x} with {} bytes wraps the address space",
                c.base,
                c.bytes()
            )));
        }
        Ok(DeviceSpan { addr: c.base, len })
    }

    /// The caller's buffers by name, and how many tokens or blocks the call moves.
    fn buffers(&self) -> (Vec<(&'static str, DeviceSpan)>, usize) {
        match *self {
            KvOp::Write {
                keys,
                values,
                tokens,
                ..
            } => (vec![("keys", keys), ("values", values)], tokens),
            KvOp::Gather { out, tokens, .. } => (vec![("output", out)], tokens),
            KvOp::CopyBlocks { pairs, .. } => (vec![], pairs.len()),
            KvOp::SwapOut { host, blocks, .. } | KvOp::SwapIn { host, blocks, .. } => {
                (vec![("host", host)], blocks.len())
            }
        }
    }

    /// The reference function's own checks, against a cache of `cache_len` bytes.
    fn check_reference(&self, cache_len: usize) -> Result<(), KvError> {
        let layout = &self.cache().layout;
        match *self {
            KvOp::Write {
                layer,
                keys,
                values,
                tokens,
                token_stride_bytes,
                slot_mapping,
                ..
            } => reference::check_write(
                layout,
                cache_len,
                layer,
                keys.len,
                values.len,
                tokens,
                token_stride_bytes,
                slot_mapping,
            ),
            KvOp::Gather {
                layer,
                kv,
                block_table,
                tokens,
                out,
                ..
            } => {
                reference::check_gather(layout, cache_len, layer, kv, block_table, tokens, out.len)
            }
            KvOp::CopyBlocks { pairs, .. } => {
                reference::check_copy_blocks(layout, cache_len, pairs)
            }
            KvOp::SwapOut { blocks, host, .. } => {
                reference::check_swap_out(layout, cache_len, blocks, host.len).map(drop)
            }
            KvOp::SwapIn { blocks, host, .. } => {
                reference::check_swap_in(layout, cache_len, blocks, host.len).map(drop)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::kv::{KvDtype, KvOrder};

    fn view() -> CacheView {
        CacheView {
            layout: KvLayout::new(2, 2, 8, 4, KvDtype::F16, KvOrder::Nhd).unwrap(),
            base: 0x10_0000,
            blocks: 8,
        }
    }

    #[test]
    fn checks_reach_the_reference_and_overlaps() {
        let cache = view();
        let bpb = cache.layout.bytes_per_block() as usize;
        let host = DeviceSpan {
            addr: 0x90_0000,
            len: 2 * bpb,
        };
        let ok = KvOp::SwapOut {
            cache,
            blocks: &[1, 7],
            host,
        };
        ok.check().unwrap();
        assert_eq!(ok.bytes_moved(), 2 * bpb as u64);
        let e = KvOp::SwapOut {
            cache,
            blocks: &[1, 8],
            host,
        }
        .check()
        .unwrap_err();
        assert!(matches!(e, KvError::OutOfRange { index: 8, .. }), "{e}");
        let inside = DeviceSpan {
            addr: cache.base + 16,
            len: 2 * bpb,
        };
        let e = KvOp::SwapIn {
            cache,
            blocks: &[0, 1],
            host: inside,
        }
        .check()
        .unwrap_err();
        assert!(e.to_string().contains("overlaps the cache"), "{e}");
        let e = KvOp::SwapIn {
            cache,
            blocks: &[1, 1],
            host,
        }
        .check()
        .unwrap_err();
        assert!(matches!(e, KvError::InvalidArgument { .. }), "{e}");
        let w = KvOp::Write {
            cache,
            layer: 1,
            keys: host,
            values: host,
            tokens: 3,
            token_stride_bytes: 32,
            slot_mapping: &[0, -1, 31, 99],
        };
        w.check().unwrap();
        assert_eq!(w.bytes_moved(), 2 * 2 * 32);
        assert_eq!(w.name(), "write");
    }
}
