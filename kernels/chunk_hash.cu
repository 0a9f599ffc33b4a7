// chunk_hash.cu — one 64-bit hash per chunk of a device range (see abi.h for the exact
// function; gpu_pager::kernels::reference::chunk_hash is the bit-exact Rust reference).
//
// Two launches:
//   gp_chunk_hash_partial   grid (slices, chunks): blockIdx.y is the chunk, blockIdx.x a
//                           slice of it. Each thread adds fmix64(w_i ^ i*K1) over its words
//                           (uint4 loads = two words, grid-stride over the chunk's vectors,
//                           four loads in flight per thread), the block reduces (warp
//                           shuffles, then shared memory) and adds its sum to out[chunk] with
//                           one 64-bit atomicAdd. out must be zeroed before the launch.
//   gp_chunk_hash_finalize  one thread per chunk: out[c] = fmix64(out[c] ^ len_c*K2).
//
// Preconditions, checked by the host launcher: src 16-byte aligned, chunk_bytes a non-zero
// multiple of 16, bytes > 0, at most 65535 chunks (gridDim.y); blockDim.x of the partial
// kernel a multiple of 32 (the reductions shuffle with a full-warp mask) and at most 1024
// (gpu_pager::kernels::chunk_hash_geometry picks the grid). Only the last chunk can end in
// a partial vector (< 16 bytes); one thread reads it with byte loads.

#include "abi.h"

static __device__ __forceinline__ uint64_t gp_fmix64(uint64_t k) {
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdULL;
    k ^= k >> 33;
    k *= 0xc4ceb9fe1a85ec53ULL;
    k ^= k >> 33;
    return k;
}

// The two words of vector v (words 2v and 2v + 1); ik = 2v * K1 (wrapping).
static __device__ __forceinline__ uint64_t gp_vector_terms(uint4 x, uint64_t ik) {
    const uint64_t w0 = ((uint64_t)x.y << 32) | x.x;
    const uint64_t w1 = ((uint64_t)x.w << 32) | x.z;
    return gp_fmix64(w0 ^ ik) + gp_fmix64(w1 ^ (ik + GP_HASH_K1));
}

// Length of chunk c (the last one may be shorter).
static __device__ __forceinline__ uint64_t gp_chunk_len(const GpChunkHashParams& p, uint64_t c) {
    const uint64_t start = c * p.chunk_bytes;
    const uint64_t left = p.bytes - start;
    return left < p.chunk_bytes ? left : p.chunk_bytes;
}

#define GP_HASH_UNROLL 4

extern "C" __global__ void gp_chunk_hash_partial(GpChunkHashParams p) {
    const uint64_t chunk = blockIdx.y;
    const uint64_t len = gp_chunk_len(p, chunk);
    const unsigned char* const base = (const unsigned char*)p.src + chunk * p.chunk_bytes;
    const uint4* __restrict__ const vec = (const uint4*)base;
    const uint64_t vectors = len / 16u;

    const uint64_t tid = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
    // v * 2 * K1 advances by stride * 2 * K1 per step (wrapping); no multiply in the loop.
    const uint64_t step_k = stride * (2u * GP_HASH_K1);

    uint64_t sum = 0;
    uint64_t v = tid;
    uint64_t ik = tid * (2u * GP_HASH_K1);
    // Four independent 16-byte loads in flight per thread, then the leftovers one by one.
    for (; v + (GP_HASH_UNROLL - 1) * stride < vectors; v += GP_HASH_UNROLL * stride) {
        uint4 x[GP_HASH_UNROLL];
#pragma unroll
        for (int u = 0; u < GP_HASH_UNROLL; ++u) {
            x[u] = __ldcs(vec + v + u * stride);
        }
#pragma unroll
        for (int u = 0; u < GP_HASH_UNROLL; ++u) {
            sum += gp_vector_terms(x[u], ik);
            ik += step_k;
        }
    }
    for (; v < vectors; v += stride) {
        sum += gp_vector_terms(__ldcs(vec + v), ik);
        ik += step_k;
    }

    // The chunk's last len % 16 bytes (only the range's last chunk has any): one thread,
    // byte loads, words zero-padded.
    const uint32_t rem = (uint32_t)(len & 15u);
    if (rem != 0 && tid == 0) {
        const unsigned char* const tail = base + vectors * 16u;
        uint64_t w0 = 0;
        uint64_t w1 = 0;
        for (uint32_t b = 0; b < rem; ++b) {
            const uint64_t byte = tail[b];
            if (b < 8u) {
                w0 |= byte << (8u * b);
            } else {
                w1 |= byte << (8u * (b - 8u));
            }
        }
        const uint64_t i0 = vectors * 2u;
        sum += gp_fmix64(w0 ^ (i0 * GP_HASH_K1));
        if (rem > 8u) {
            sum += gp_fmix64(w1 ^ ((i0 + 1u) * GP_HASH_K1));
        }
    }

    // Block reduction: warps by shuffle, then the warp sums through shared memory.
    const unsigned lane = threadIdx.x & 31u;
    const unsigned warp = threadIdx.x >> 5;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        sum += __shfl_down_sync(0xffffffffu, sum, off);
    }
    __shared__ uint64_t warp_sums[32];
    if (lane == 0) {
        warp_sums[warp] = sum;
    }
    __syncthreads();
    if (warp == 0) {
        const unsigned warps = (blockDim.x + 31u) >> 5;
        sum = lane < warps ? warp_sums[lane] : 0;
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
            sum += __shfl_down_sync(0xffffffffu, sum, off);
        }
        if (lane == 0) {
            atomicAdd((unsigned long long*)p.out + chunk, (unsigned long long)sum);
        }
    }
}

extern "C" __global__ void gp_chunk_hash_finalize(GpChunkHashParams p) {
    const uint64_t c = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const uint64_t chunks = (p.bytes + p.chunk_bytes - 1u) / p.chunk_bytes;
    if (c >= chunks) {
        return;
    }
    uint64_t* const out = (uint64_t*)p.out;
    out[c] = gp_fmix64(out[c] ^ (gp_chunk_len(p, c) * GP_HASH_K2));
}
