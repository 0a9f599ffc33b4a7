// fill.cu — gp_fill: fill a device range with a repeated 32-bit pattern.
//
// Byte j of [dst, dst + bytes) becomes byte (j % 4) of `pattern` (little-endian), for any
// alignment of dst and any byte count. The range splits into
//   head: the bytes before the first GP_FILL_BODY_ALIGN (512-byte) boundary, written one by
//         one by different threads;
//   body: whole 16-byte vectors from that boundary on, written with uint4 stores in a
//         grid-stride loop, with the pattern rotated so that the byte-position rule above
//         still holds;
//   tail: the bytes after the last whole vector (at most 15), written one by one.
// The body starts at a 512-byte boundary, not merely a 16-byte one: on an H200 (4224
// blocks of 256), 8 GiB at dst + 3 filled at 2.8 TB/s with a 16-byte-aligned body (warps'
// 512-byte spans straddling 32-byte sectors), 3.9 TB/s 32-byte-aligned, 4.35 TB/s
// 512-byte-aligned, the same as an aligned dst. Indices are 64-bit: ranges of tens of GiB are fine. Launch with any 1-D grid
// (gpu_pager::kernels::fill_geometry picks one).

#include "abi.h"

// Alignment of the vector body (a power of two, at least 16). Mirrored by
// gpu_pager::kernels::fill_geometry.
#define GP_FILL_BODY_ALIGN 512u

// Byte j (counted from dst) of the filled range.
static __device__ __forceinline__ unsigned char gp_fill_byte(uint32_t pattern, uint64_t j) {
    return (unsigned char)(pattern >> (8u * (uint32_t)(j & 3u)));
}

extern "C" __global__ void gp_fill(GpFillParams p) {
    const uint64_t tid = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
    unsigned char* const bytes = (unsigned char*)p.dst;

    // Head: bytes up to the first body boundary (or the whole range if it is shorter).
    const uint64_t to_boundary = (GP_FILL_BODY_ALIGN - (p.dst & (GP_FILL_BODY_ALIGN - 1u))) &
                                 (GP_FILL_BODY_ALIGN - 1u);
    const uint64_t head = to_boundary < p.bytes ? to_boundary : p.bytes;
    const uint64_t vectors = (p.bytes - head) / 16u;
    const uint64_t body_end = head + vectors * 16u;

    for (uint64_t j = tid; j < head; j += stride) {
        bytes[j] = gp_fill_byte(p.pattern, j);
    }

    // Body: vector k covers bytes head + 16k .. head + 16k + 15. Its byte b must be pattern
    // byte (head + b) % 4, i.e. the pattern rotated right by 8 * (head % 4) bits.
    const uint32_t rotated = __funnelshift_r(p.pattern, p.pattern, 8u * (uint32_t)(head & 3u));
    const uint4 v = make_uint4(rotated, rotated, rotated, rotated);
    uint4* const body = (uint4*)(bytes + head);
    for (uint64_t k = tid; k < vectors; k += stride) {
        body[k] = v;
    }

    // Tail: the bytes after the last whole vector.
    for (uint64_t j = body_end + tid; j < p.bytes; j += stride) {
        bytes[j] = gp_fill_byte(p.pattern, j);
    }
}
