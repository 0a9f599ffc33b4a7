// kv.cu — the paged KV cache kernels (see abi.h for the exact contracts; the Rust
// references are gpu_pager::kv::reference::{write, gather, copy_blocks, swap_out, swap_in}).
//
//   gp_kv_write        new keys/values, token-major, into the cache through an int64 slot
//                      mapping (slot < 0: padding, skipped) — vLLM's reshape_and_cache role.
//   gp_kv_gather       one sequence's tokens, through its block table, out of the cache into
//                      a token-major buffer.
//   gp_kv_move_blocks  whole blocks by index lists: copy-on-write copies inside the cache,
//                      and swaps between the cache and pinned host memory (zero-copy: the
//                      kernel loads or stores host memory directly over the link, one launch
//                      for any number of blocks).
//
// The kernels only move bytes. Every access is vec_bytes wide (16, 8, 4 or 2): the host
// launcher picks the widest width that divides every address, stride and row length, so
// rows of odd head_dim (e.g. 5 bf16 = 10 bytes) still move correctly, with 2-byte accesses.
// The width is uniform per launch, so the switch below costs one branch.
//
// Row kernels: blockDim (tx, ty); threadIdx.y picks one of ty tokens of the CTA, and the tx
// threads of that token walk its kv_heads × row_bytes / vec_bytes vectors. Consecutive
// threads touch consecutive vectors of a row (coalesced on both sides: the token-major side
// is dense, and rows in the cache are whole head_dim runs). Both planes (K and V) are
// loaded before either is stored, so each thread has two loads in flight.
//
// Move kernel: blockIdx.y strides over the blocks of the list, blockIdx.x and threadIdx.x
// over the vectors of one block, four independent loads in flight per thread before the
// stores (latency hiding matters most for the zero-copy swaps, ~1 µs per host access).

#include "abi.h"

template <int V>
struct GpVec;
template <>
struct GpVec<16> {
    typedef uint4 T;
};
template <>
struct GpVec<8> {
    typedef uint2 T;
};
template <>
struct GpVec<4> {
    typedef uint32_t T;
};
template <>
struct GpVec<2> {
    typedef uint16_t T;
};

template <int V>
static __device__ __forceinline__ typename GpVec<V>::T gp_load(uint64_t addr) {
    return *(const typename GpVec<V>::T*)addr;
}

template <int V>
static __device__ __forceinline__ void gp_store(uint64_t addr, typename GpVec<V>::T x) {
    *(typename GpVec<V>::T*)addr = x;
}

// WRITE: io -> cache through the slot mapping; otherwise (gather): cache -> io through the
// block table.
template <int V, bool WRITE>
static __device__ __forceinline__ void gp_kv_rows(const GpKvRowsParams& p) {
    const uint32_t vecs_per_row = p.row_bytes / V;
    const uint32_t vecs = p.kv_heads * vecs_per_row;  // < 2^31, checked by the launcher
    const uint64_t token_step = (uint64_t)gridDim.x * blockDim.y;
    for (uint64_t t = (uint64_t)blockIdx.x * blockDim.y + threadIdx.y; t < p.tokens;
         t += token_step) {
        uint64_t block, tok;
        if (WRITE) {
            const int64_t slot = ((const int64_t*)p.index)[t];
            if (slot < 0) {
                continue;  // padding
            }
            block = (uint64_t)slot / p.block_size;
            tok = (uint64_t)slot % p.block_size;
        } else {
            block = ((const uint32_t*)p.index)[t / p.block_size];
            tok = t % p.block_size;
        }
        const uint64_t cache_row0 = block * p.block_stride + tok * p.page_token_stride;
        const uint64_t io_row0 = t * p.io_token_stride;
        for (uint32_t i = threadIdx.x; i < vecs; i += blockDim.x) {
            const uint32_t h = i / vecs_per_row;
            const uint32_t v = i - h * vecs_per_row;
            const uint64_t c = cache_row0 + h * p.page_head_stride + (uint64_t)v * V;
            // io rows are dense: head h, vector v of a token is vector i of that token.
            const uint64_t o = io_row0 + (uint64_t)i * V;
            const uint64_t src0 = WRITE ? p.io[0] + o : p.cache[0] + c;
            const uint64_t dst0 = WRITE ? p.cache[0] + c : p.io[0] + o;
            const typename GpVec<V>::T a = gp_load<V>(src0);
            if (p.planes == 2) {
                const uint64_t src1 = WRITE ? p.io[1] + o : p.cache[1] + c;
                const uint64_t dst1 = WRITE ? p.cache[1] + c : p.io[1] + o;
                const typename GpVec<V>::T b = gp_load<V>(src1);
                gp_store<V>(dst0, a);
                gp_store<V>(dst1, b);
            } else {
                gp_store<V>(dst0, a);
            }
        }
    }
}

extern "C" __global__ void gp_kv_write(GpKvRowsParams p) {
    switch (p.vec_bytes) {
        case 16: gp_kv_rows<16, true>(p); break;
        case 8: gp_kv_rows<8, true>(p); break;
        case 4: gp_kv_rows<4, true>(p); break;
        default: gp_kv_rows<2, true>(p); break;
    }
}

extern "C" __global__ void gp_kv_gather(GpKvRowsParams p) {
    switch (p.vec_bytes) {
        case 16: gp_kv_rows<16, false>(p); break;
        case 8: gp_kv_rows<8, false>(p); break;
        case 4: gp_kv_rows<4, false>(p); break;
        default: gp_kv_rows<2, false>(p); break;
    }
}

// Vectors each thread loads before it stores (mirrored by gpu_pager::kernels::kv).
#define GP_MOVE_UNROLL 4

template <int V>
static __device__ __forceinline__ void gp_kv_move(const GpKvMoveParams& p) {
    typedef typename GpVec<V>::T T;
    const uint64_t vecs = p.block_bytes / V;
    const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
    const uint64_t first = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
    for (uint64_t i = blockIdx.y; i < p.count; i += gridDim.y) {
        const uint64_t s = p.src_ids ? ((const uint32_t*)p.src_ids)[i] : i;
        const uint64_t d = p.dst_ids ? ((const uint32_t*)p.dst_ids)[i] : i;
        const T* const src = (const T*)(p.src + s * p.block_bytes);
        T* const dst = (T*)(p.dst + d * p.block_bytes);
        uint64_t k = first;
        for (; k + (GP_MOVE_UNROLL - 1) * stride < vecs; k += GP_MOVE_UNROLL * stride) {
            T x[GP_MOVE_UNROLL];
#pragma unroll
            for (int u = 0; u < GP_MOVE_UNROLL; ++u) {
                x[u] = src[k + u * stride];
            }
#pragma unroll
            for (int u = 0; u < GP_MOVE_UNROLL; ++u) {
                dst[k + u * stride] = x[u];
            }
        }
        for (; k < vecs; k += stride) {
            dst[k] = src[k];
        }
    }
}

extern "C" __global__ void gp_kv_move_blocks(GpKvMoveParams p) {
    switch (p.vec_bytes) {
        case 16: gp_kv_move<16>(p); break;
        case 8: gp_kv_move<8>(p); break;
        case 4: gp_kv_move<4>(p); break;
        default: gp_kv_move<2>(p); break;
    }
}
