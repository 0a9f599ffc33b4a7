// copy.cu — gp_copy: copy bytes between device memory and pinned host memory (zero-copy:
// the kernel loads or stores the host side directly over the link), or within the device.
//
// The copy pump (gpu_pager::pump) runs it next to the copy engine: right after a trainer
// frees a large allocation the copy engine runs at half the link for about a second, while
// an SM-driven copy over the same link does not slow down (BENCHMARKS.md, "H200,
// 2026-12-02, later run").
//
// Any addresses and byte count. The access width W is the largest power of two up to 16
// that divides (dst - src) mod 16: co-aligned ranges (the pager's backups and regions are
// page-aligned, and every copy keeps the same offset on both sides) move in 16-byte words,
// others in narrower ones. The bytes before dst reaches a multiple of W (the head) and the
// (bytes - head) % W bytes after the last whole word (the tail) are copied one by one by the
// grid's first threads; fewer than 16 each.
//
// The body is cut into tiles of blockDim.x * GP_COPY_UNROLL words. A block takes tiles
// grid-stride; each thread loads GP_COPY_UNROLL words of its tile (consecutive threads,
// consecutive words: every load instruction of a warp reads 32 consecutive words) before it
// stores any, so that every thread keeps that many independent loads in flight: reading
// host memory costs about a microsecond per access, and the link is reached only with many
// loads outstanding. gpu_pager::kernels::copy_geometry sizes the grid from the SM count.
// The ranges must not overlap (the launcher checks).

#include "abi.h"

// Words each thread loads before it stores (mirrored by gpu_pager::kernels::copy_geometry).
#define GP_COPY_UNROLL 4

template <int W>
struct GpWord;
template <>
struct GpWord<16> {
    typedef uint4 T;
};
template <>
struct GpWord<8> {
    typedef uint2 T;
};
template <>
struct GpWord<4> {
    typedef uint32_t T;
};
template <>
struct GpWord<2> {
    typedef uint16_t T;
};
template <>
struct GpWord<1> {
    typedef uint8_t T;
};

// The copy in W-byte words; requires (p.dst - p.src) % W == 0.
template <int W>
static __device__ __forceinline__ void gp_copy_words(const GpCopyParams& p) {
    typedef typename GpWord<W>::T T;
    const uint64_t tid = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const uint64_t misaligned = p.dst & (uint64_t)(W - 1);
    const uint64_t to_aligned = misaligned != 0 ? (uint64_t)W - misaligned : 0;
    const uint64_t head = to_aligned < p.bytes ? to_aligned : p.bytes;
    const uint64_t words = (p.bytes - head) / W;
    const uint64_t body_end = head + words * W;
    const unsigned char* const s8 = (const unsigned char*)p.src;
    unsigned char* const d8 = (unsigned char*)p.dst;

    // Head and tail: fewer than W bytes each, one byte per thread.
    if (tid < head) {
        d8[tid] = s8[tid];
    }
    if (tid < p.bytes - body_end) {
        d8[body_end + tid] = s8[body_end + tid];
    }

    // Body: dst + head is W-aligned, and so is src + head (same residue mod W). Plain loads
    // (no __restrict__, which would make them ld.global.nc): the KV swap kernel reached the
    // link reading pinned host memory with plain loads.
    const T* const s = (const T*)(s8 + head);
    T* const d = (T*)(d8 + head);
    const uint64_t tile = (uint64_t)blockDim.x * GP_COPY_UNROLL;
    const uint64_t step = (uint64_t)gridDim.x * tile;
    // `w` is this thread's first word in the tile; its others follow blockDim.x apart.
    for (uint64_t w = (uint64_t)blockIdx.x * tile + threadIdx.x; w < words; w += step) {
        if (w + (uint64_t)(GP_COPY_UNROLL - 1) * blockDim.x < words) {
            T x[GP_COPY_UNROLL];
#pragma unroll
            for (int u = 0; u < GP_COPY_UNROLL; ++u) {
                x[u] = s[w + (uint64_t)u * blockDim.x];
            }
#pragma unroll
            for (int u = 0; u < GP_COPY_UNROLL; ++u) {
                d[w + (uint64_t)u * blockDim.x] = x[u];
            }
        } else {
            // The last, partial tile.
            for (uint64_t i = w; i < words; i += blockDim.x) {
                d[i] = s[i];
            }
        }
    }
}

extern "C" __global__ void gp_copy(GpCopyParams p) {
    // The same choice as gpu_pager::kernels::copy_width; uniform over the launch.
    const uint64_t residue = (p.dst - p.src) & 15u;
    if (residue == 0) {
        gp_copy_words<16>(p);
    } else if ((residue & 7u) == 0) {
        gp_copy_words<8>(p);
    } else if ((residue & 3u) == 0) {
        gp_copy_words<4>(p);
    } else if ((residue & 1u) == 0) {
        gp_copy_words<2>(p);
    } else {
        gp_copy_words<1>(p);
    }
}
