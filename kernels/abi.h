/*
 * abi.h — the parameter blocks shared by the CUDA kernels (kernels/<family>.cu) and Rust.
 *
 * Plain C, <stdint.h> only (under NVRTC, which has no C library headers, the same
 * fixed-width types are declared here as every CUDA target defines them). build.rs runs bindgen on this file into `$OUT_DIR/abi.rs`
 * (re-exported as `gpu_pager::kernels::abi`), so every struct here has one layout on both
 * sides: fixed-width fields, naturally aligned, explicit padding, no pointers (device
 * addresses travel as uint64_t). Each kernel takes one of these structs by value as its only
 * parameter.
 *
 * Changing a struct here changes the kernels and the Rust launchers together; both are
 * rebuilt from this file.
 */
#ifndef GP_ABI_H
#define GP_ABI_H

#ifdef __CUDACC_RTC__
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef unsigned long long uint64_t;
typedef long long int64_t;
#else
#include <stdint.h>
#endif

/*
 * gp_fill: fill [dst, dst + bytes) with a repeated 32-bit pattern.
 * Byte j of the range becomes byte (j % 4) of `pattern` in little-endian order, whatever
 * the alignment of dst; pattern 0 zeroes the range.
 */
typedef struct GpFillParams {
    uint64_t dst;     /* device address of the first byte; any alignment */
    uint64_t bytes;   /* number of bytes to write; 0 is a no-op */
    uint32_t pattern; /* the 32-bit pattern, applied little-endian from dst */
    uint32_t _pad;    /* explicit padding to 24 bytes; set to 0 */
} GpFillParams;

/*
 * gp_chunk_hash_partial / gp_chunk_hash_finalize: one 64-bit hash per chunk of
 * [src, src + bytes).
 *
 * The hash (the Rust reference, gpu_pager::kernels::reference::chunk_hash, matches it bit
 * for bit; all arithmetic wraps modulo 2^64):
 *
 *   fmix64(k): k ^= k >> 33; k *= 0xff51afd7ed558ccd;
 *              k ^= k >> 33; k *= 0xc4ceb9fe1a85ec53;
 *              k ^= k >> 33; return k;
 *
 *   The range is cut into chunks of chunk_bytes bytes; the last one may be shorter.
 *   For chunk c of length len, read its bytes as little-endian u64 words w_0 .. w_{n-1},
 *   n = ceil(len / 8), the last word zero-padded, and compute
 *
 *     sum    = sum over i of fmix64(w_i ^ (i * GP_HASH_K1))   (i: word index in the chunk)
 *     hash_c = fmix64(sum ^ (len * GP_HASH_K2))
 *
 *   The sum is order-independent, so any number of threads may each add their words'
 *   terms (partial kernel, atomicAdd into out[c]) before the finalize kernel mixes in the
 *   length. The length term makes chunks that differ only by trailing zero bytes differ.
 *
 * Launcher preconditions (checked on the host, not in the kernels): src 16-byte aligned,
 * chunk_bytes a non-zero multiple of 16, bytes > 0, at most 65535 chunks, out zeroed
 * before the partial kernel.
 */
#define GP_HASH_K1 0x9E3779B97F4A7C15ULL
#define GP_HASH_K2 0xC2B2AE3D27D4EB4FULL

typedef struct GpChunkHashParams {
    uint64_t src;         /* device address of the first byte; 16-byte aligned */
    uint64_t bytes;       /* total bytes to hash; > 0 */
    uint64_t chunk_bytes; /* bytes per chunk (the last may be shorter); multiple of 16 */
    uint64_t out;         /* device address of ceil(bytes / chunk_bytes) uint64_t hashes */
} GpChunkHashParams;

/*
 * Paged KV cache kernels (kernels/kv.cu). They move bytes: the element type only decides
 * the row length (head_dim × element size). Every address, stride and length in a launch
 * is a multiple of vec_bytes (16, 8, 4 or 2), the width of every load and store; the Rust
 * launchers pick the widest width that divides all of them (gpu_pager::kernels::kv).
 */

/*
 * gp_kv_write / gp_kv_gather: move head rows between the paged cache and token-major
 * buffers ([tokens, kv_heads, row_bytes] dense rows, io_token_stride bytes between
 * tokens).
 *
 * For token t and plane p (0 = K, 1 = V; planes is 1 or 2):
 *   gp_kv_write:  slot = ((const int64_t*)index)[t]; slot < 0 is padding (skipped);
 *                 block = slot / block_size, tok = slot % block_size;
 *                 io[p] row (t, h) -> cache[p] row (block, tok, h).
 *   gp_kv_gather: block = ((const uint32_t*)index)[t / block_size], tok = t % block_size;
 *                 cache[p] row (block, tok, h) -> io[p] row (t, h).
 * Cache row (block, tok, h) starts at
 *   cache[p] + block * block_stride + tok * page_token_stride + h * page_head_stride.
 * Launch: blockDim (tx, ty), tx threads per token, ty tokens per CTA, any grid.x.
 */
typedef struct GpKvRowsParams {
    uint64_t cache[2];          /* row (0, 0, 0) of plane 0 and 1 (the layer's K, V page of block 0) */
    uint64_t io[2];             /* token 0 of the token-major buffer of plane 0 and 1 */
    uint64_t index;             /* write: tokens int64 slots; gather: ceil(tokens/block_size) uint32 blocks */
    uint64_t block_stride;      /* bytes between blocks */
    uint64_t io_token_stride;   /* bytes between tokens of io */
    uint64_t page_token_stride; /* bytes between tokens inside a page */
    uint64_t page_head_stride;  /* bytes between heads inside a page */
    uint32_t tokens;            /* tokens to move */
    uint32_t kv_heads;          /* heads per token */
    uint32_t row_bytes;         /* bytes of one head row; multiple of vec_bytes */
    uint32_t block_size;        /* tokens per block */
    uint32_t planes;            /* 1 (io[1], cache[1] unused) or 2 */
    uint32_t vec_bytes;         /* 16, 8, 4 or 2 */
} GpKvRowsParams;

/*
 * gp_kv_move_blocks: for i < count, copy block_bytes bytes from
 *   src + (src_ids ? src_ids[i] : i) * block_bytes   to   dst + (dst_ids ? dst_ids[i] : i) * block_bytes.
 * copy_blocks (src = dst = the cache, both id lists), swap_out (dst = pinned host memory,
 * identity), swap_in (src = pinned host memory, identity). No destination may be written
 * twice or read by another pair (checked by the launchers).
 * Launch: grid (x: CTAs per block, y: any; pairs are strided by gridDim.y), blockDim.x
 * threads.
 */
typedef struct GpKvMoveParams {
    uint64_t src;         /* base of the source blocks */
    uint64_t dst;         /* base of the destination blocks */
    uint64_t src_ids;     /* device address of count uint32 source block indices, or 0 for i */
    uint64_t dst_ids;     /* device address of count uint32 destination indices, or 0 for i */
    uint64_t block_bytes; /* bytes per block; multiple of vec_bytes */
    uint32_t count;       /* blocks to move */
    uint32_t vec_bytes;   /* 16, 8, 4 or 2 */
} GpKvMoveParams;

/*
 * gp_copy: copy [src, src + bytes) to [dst, dst + bytes) (kernels/copy.cu). Either side may
 * be device memory or pinned host memory reached zero-copy through its device address; the
 * ranges must not overlap. Any addresses and byte count: the access width W is the largest
 * power of two up to 16 that divides (dst - src) mod 16 (16 when they are co-aligned), the
 * bytes before dst reaches a multiple of W and the last (bytes - head) % W bytes are copied
 * one by one, everything between in W-byte words. The Rust reference is
 * gpu_pager::kernels::reference::copy; gpu_pager::kernels::copy_geometry sizes the grid.
 * Launch: any 1-D grid of 1-D blocks, at least 16 threads in all (the head and tail bytes go
 * to the first threads).
 */
typedef struct GpCopyParams {
    uint64_t dst;   /* address of the first byte written */
    uint64_t src;   /* address of the first byte read */
    uint64_t bytes; /* bytes to copy; 0 is a no-op */
} GpCopyParams;

#endif /* GP_ABI_H */
