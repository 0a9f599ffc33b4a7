//! The paged KV cache below the backends: its pure descriptions and its kernels' launch
//! parameters.
//!
//! - [`KvLayout`] (and [`Kv`], [`KvDtype`], [`KvOrder`], [`KvStrides`]): the byte layout of
//!   the cache region;
//! - [`KvOp`] on a [`CacheView`] and [`DeviceSpan`]s: one checked kernel call, what a
//!   backend's [`KvKernels`](crate::backend::KvKernels) launch;
//! - [`reference`](mod@reference): the plain-Rust reference of each kernel (the host backend runs them);
//! - [`KvError`] and the ids it names ([`BlockId`], [`SeqId`]);
//! - launch parameters and geometry of `kernels/kv.cu` (below).
//!
//! Users reach the descriptions through [`crate::kv`], which re-exports them next to the
//! cache ([`crate::kv::KvCache`]) and the block allocator ([`crate::kv::BlockPool`]).
//!
//! # Launch parameters and geometry
//!
//! Everything here is pure host code: it turns a [`KvLayout`] and device addresses into the
//! parameter structs of `kernels/abi.h` and picks grids. The launchers validate the calls
//! first ([`KvOp::check`]); these builders are also public for enqueue-only
//! launches (`CudaBackend::kv_rows_on` / `kv_move_on`), so they refuse what the kernels
//! cannot do on their own (no access width dividing every address and stride, counts over
//! 32 bits, a token over 2^31 bytes), whoever calls them.

mod error;
mod layout;
mod op;
pub mod reference;

pub use error::{BlockId, KvError, SeqId};
pub use layout::{Kv, KvDtype, KvLayout, KvOrder, KvStrides};
pub use op::{CacheView, DeviceSpan, KvOp};

use super::abi::{GpKvMoveParams, GpKvRowsParams};
use super::{BLOCK_THREADS, LaunchGeometry};

/// Entry point of the write kernel (module [`super::KernelModule::Kv`]).
pub const WRITE: &str = "gp_kv_write";
/// Entry point of the gather kernel.
pub const GATHER: &str = "gp_kv_gather";
/// Entry point of the block-move kernel (copy_blocks, swap_out, swap_in).
pub const MOVE_BLOCKS: &str = "gp_kv_move_blocks";

/// Vectors each thread of the move kernel loads before storing (`GP_MOVE_UNROLL`).
const MOVE_UNROLL: u64 = 4;
/// Most CTAs of a row kernel (they loop over the remaining tokens).
const ROWS_MAX_BLOCKS: u64 = 1 << 20;
/// Most CTAs per block in the move kernel's x dimension.
const MOVE_MAX_X: u64 = 1 << 16;
/// `gridDim.y` limit.
const MAX_GRID_Y: u64 = 65_535;

/// The widest access (16, 8, 4 or 2 bytes) that divides every value, or `None` when even 2
/// does not (an odd address or stride).
pub fn vec_bytes(values: &[u64]) -> Option<u32> {
    let all = values.iter().fold(0u64, |acc, &v| acc | v);
    [16u32, 8, 4, 2]
        .into_iter()
        .find(|&w| all % u64::from(w) == 0)
}

/// Geometry of [`WRITE`] / [`GATHER`]: `tx` threads per token (a power of two from 32 to
/// [`BLOCK_THREADS`], enough for one token's vectors when it has few), `ty = 256 / tx`
/// tokens per CTA, one CTA per `ty` tokens up to 2^20 CTAs.
pub fn rows_geometry(tokens: u64, vecs_per_token: u64) -> LaunchGeometry {
    let tx = vecs_per_token
        .next_power_of_two()
        .clamp(32, u64::from(BLOCK_THREADS)) as u32;
    let ty = BLOCK_THREADS / tx;
    let blocks = tokens.div_ceil(u64::from(ty)).clamp(1, ROWS_MAX_BLOCKS) as u32;
    LaunchGeometry {
        grid: (blocks, 1, 1),
        block: (tx, ty, 1),
    }
}

/// Geometry of [`MOVE_BLOCKS`]: `grid.y` one per listed block (up to 65535; the kernel
/// strides over the rest), `grid.x` enough CTAs of 256 threads for one block's vectors at
/// four per thread.
pub fn move_geometry(count: u64, block_bytes: u64, vec_bytes: u32) -> LaunchGeometry {
    let vecs = block_bytes / u64::from(vec_bytes);
    let x = vecs
        .div_ceil(u64::from(BLOCK_THREADS) * MOVE_UNROLL)
        .clamp(1, MOVE_MAX_X) as u32;
    let y = count.clamp(1, MAX_GRID_Y) as u32;
    LaunchGeometry {
        grid: (x, y, 1),
        block: (BLOCK_THREADS, 1, 1),
    }
}

/// Errors unless `n` fits the kernels' 32-bit count fields.
fn count32(what: &str, n: usize) -> Result<u32, String> {
    u32::try_from(n).map_err(|_| {
        format!(
            "{n} {what} in one call; at most {} — split the call",
            u32::MAX
        )
    })
}

/// The token-major side of a row kernel: where token 0 of each plane starts, and the byte
/// stride between tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenMajor {
    /// Token 0 of plane 0 (keys, or the gather output).
    pub first: u64,
    /// Token 0 of plane 1 (values), when there are two planes.
    pub second: Option<u64>,
    /// Bytes between consecutive tokens.
    pub token_stride: u64,
}

/// Parameters of [`WRITE`] (`index` = device address of `tokens` int64 slots; planes K and
/// V of `layer`, from `io.first` = keys and `io.second` = values) or of [`GATHER`] (`index`
/// = device address of the uint32 block table; `kv` picks the plane, `io.first` is the
/// output). `cache` is the region base (block 0). Errors name what no access width fits.
pub fn rows_params(
    layout: &KvLayout,
    cache: u64,
    planes: &[Kv],
    layer: u32,
    io: TokenMajor,
    index: u64,
    tokens: usize,
) -> Result<GpKvRowsParams, String> {
    let page = |kv: Kv| -> Result<u64, String> {
        layout
            .base(layer, kv)
            .map(|b| cache + b)
            .map_err(|e| e.to_string())
    };
    let (cache0, cache1, planes_n) = match planes {
        [a] => (page(*a)?, 0, 1),
        [a, b] if a != b => (page(*a)?, page(*b)?, 2),
        [_, _] => return Err("the same plane twice; the two planes must be K and V".to_owned()),
        _ => {
            return Err(format!(
                "{} planes; a row kernel moves 1 or 2",
                planes.len()
            ));
        }
    };
    let io1 = if planes_n == 2 {
        io.second
            .ok_or_else(|| "two planes but one token-major buffer".to_owned())?
    } else {
        0
    };
    let size = layout.dtype().size();
    let s = layout.strides();
    let row = layout.row_bytes();
    let params = GpKvRowsParams {
        cache: [cache0, cache1],
        io: [io.first, io1],
        index,
        block_stride: layout.bytes_per_block(),
        io_token_stride: io.token_stride,
        page_token_stride: s.token * size,
        page_head_stride: s.head * size,
        tokens: count32("tokens", tokens)?,
        kv_heads: layout.kv_heads(),
        row_bytes: u32::try_from(row).map_err(|_| format!("a {row}-byte head row is too long"))?,
        block_size: layout.block_size(),
        planes: planes_n,
        vec_bytes: 0,
    };
    if u64::from(params.kv_heads) * row >= 1 << 31 {
        return Err(format!(
            "one token of all heads is {} bytes; the kernels index it with 31 bits",
            u64::from(params.kv_heads) * row
        ));
    }
    let mut align = vec![
        params.cache[0],
        params.io[0],
        params.io_token_stride,
        params.page_token_stride,
        params.page_head_stride,
        params.block_stride,
        row,
    ];
    if planes_n == 2 {
        align.extend([params.cache[1], params.io[1]]);
    }
    let vec = vec_bytes(&align).ok_or_else(|| {
        format!(
            "an address or stride is odd (cache {cache:#x}, buffers {:#x} / {:#x}, token stride {}); \
             the kernels need 2-byte alignment at least",
            params.io[0], params.io[1], params.io_token_stride
        )
    })?;
    Ok(GpKvRowsParams {
        vec_bytes: vec,
        ..params
    })
}

/// Parameters of [`MOVE_BLOCKS`]: `count` blocks of `block_bytes` from `src` (indexed by the
/// uint32 list at device address `src_ids`, or by position when 0) to `dst` (likewise).
pub fn move_params(
    src: u64,
    dst: u64,
    src_ids: u64,
    dst_ids: u64,
    block_bytes: u64,
    count: usize,
) -> Result<GpKvMoveParams, String> {
    let vec = vec_bytes(&[src, dst, block_bytes]).ok_or_else(|| {
        format!(
            "source {src:#x}, destination {dst:#x} or block size {block_bytes} is odd; the \
             kernel needs 2-byte alignment at least"
        )
    })?;
    Ok(GpKvMoveParams {
        src,
        dst,
        src_ids,
        dst_ids,
        block_bytes,
        count: count32("blocks", count)?,
        vec_bytes: vec,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn widest_dividing_vector() {
        assert_eq!(vec_bytes(&[0x1000, 160, 320]), Some(16));
        assert_eq!(vec_bytes(&[0x1000, 10]), Some(2));
        assert_eq!(vec_bytes(&[0x1008, 16]), Some(8));
        assert_eq!(vec_bytes(&[0x1004]), Some(4));
        assert_eq!(vec_bytes(&[0x1001, 16]), None);
        assert_eq!(vec_bytes(&[]), Some(16));
    }

    #[test]
    fn rows_geometry_packs_small_tokens() {
        // 8 heads × 128 bf16 = 2 KiB per token = 128 vectors: 128 threads, 2 tokens a CTA.
        let g = rows_geometry(1000, 128);
        assert_eq!(g.block, (128, 2, 1));
        assert_eq!(g.grid, (500, 1, 1));
        // One head of 5 bf16 with 2-byte vectors: 5 vectors, a warp per token, 8 per CTA.
        let g = rows_geometry(17, 5);
        assert_eq!(g.block, (32, 8, 1));
        assert_eq!(g.grid, (3, 1, 1));
        // Big tokens: 256 threads loop over them.
        let g = rows_geometry(3, 4096);
        assert_eq!(g.block, (256, 1, 1));
        assert_eq!(rows_geometry(0, 1).grid, (1, 1, 1));
        assert_eq!(rows_geometry(u64::from(u32::MAX), 1024).grid.0, 1 << 20);
    }

    #[test]
    fn move_geometry_spans_blocks() {
        let g = move_geometry(4096, 16 << 10, 16);
        assert_eq!(g.grid, (1, 4096, 1));
        let g = move_geometry(100_000, 256 << 10, 16);
        assert_eq!(g.grid, (16, 65_535, 1));
        let g = move_geometry(0, 2, 2);
        assert_eq!(g.grid, (1, 1, 1));
    }

    #[test]
    fn rows_params_follow_the_layout() {
        let l = KvLayout::new(3, 4, 80, 16, KvDtype::Bf16, KvOrder::Hnd).unwrap();
        let io = TokenMajor {
            first: 0x10_0000,
            second: Some(0x20_0000),
            token_stride: 4 * 160,
        };
        let p = rows_params(&l, 0x4000_0000, &[Kv::K, Kv::V], 2, io, 0x9000, 7).unwrap();
        assert_eq!(p.cache[0], 0x4000_0000 + l.k_base(2).unwrap());
        assert_eq!(p.cache[1], 0x4000_0000 + l.v_base(2).unwrap());
        assert_eq!(p.page_token_stride, 160);
        assert_eq!(p.page_head_stride, 16 * 160);
        assert_eq!(p.block_stride, l.bytes_per_block());
        assert_eq!(
            (p.tokens, p.planes, p.vec_bytes, p.row_bytes),
            (7, 2, 16, 160)
        );
        // An odd head_dim: 5 bf16 = 10-byte rows, 2-byte vectors.
        let l = KvLayout::new(1, 1, 5, 16, KvDtype::Bf16, KvOrder::Nhd).unwrap();
        let io = TokenMajor {
            first: 0x10_0000,
            second: None,
            token_stride: 10,
        };
        let p = rows_params(&l, 0x4000_0000, &[Kv::V], 0, io, 0x9000, 3).unwrap();
        assert_eq!((p.vec_bytes, p.planes), (2, 1));
        // Errors: an odd buffer, a bad layer, two planes with one buffer.
        let odd = TokenMajor {
            first: 0x10_0001,
            ..io
        };
        assert!(rows_params(&l, 0x4000_0000, &[Kv::K], 0, odd, 0, 1).is_err());
        assert!(rows_params(&l, 0x4000_0000, &[Kv::K], 1, io, 0, 1).is_err());
        assert!(rows_params(&l, 0x4000_0000, &[Kv::K, Kv::V], 0, io, 0, 1).is_err());
        let two = TokenMajor {
            second: Some(0x20_0000),
            ..io
        };
        assert!(rows_params(&l, 0x4000_0000, &[Kv::K, Kv::K], 0, two, 0, 1).is_err());
    }

    #[test]
    fn move_params_pick_widths() {
        let p = move_params(0x1000, 0x2000, 0, 0x30, 16 << 10, 4096).unwrap();
        assert_eq!((p.vec_bytes, p.count), (16, 4096));
        let p = move_params(0x1000, 0x2000, 0, 0, 10, 1).unwrap();
        assert_eq!(p.vec_bytes, 2);
        assert!(move_params(0x1001, 0x2000, 0, 0, 16, 1).is_err());
    }
}
