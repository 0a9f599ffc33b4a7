/*
 * abi.h — the parameter blocks shared by the CUDA kernels (kernels/<family>.cu) and Rust.
 *
 * Plain C, <stdint.h> only. build.rs runs bindgen on this file into `$OUT_DIR/abi.rs`
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

#include <stdint.h>

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

#endif /* GP_ABI_H */
