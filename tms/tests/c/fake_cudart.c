/* A stand-in CUDA runtime for the preload library's tests: cudaMalloc hands out addresses
 * from a static arena, cudaFree counts what it was given. Built as libcudart.so.12 so the
 * preload library finds it by name. */
#include <stddef.h>
#include <stdint.h>

static unsigned char arena[1 << 16];
static size_t used;
int fake_frees;

int cudaMalloc(void **ptr, size_t size) {
    if (size > sizeof arena - used) {
        return 2;
    }
    *ptr = arena + used;
    used += (size + 255) / 256 * 256;
    return 0;
}

int cudaFree(void *ptr) {
    (void)ptr;
    fake_frees++;
    return 0;
}

int cudaGetDevice(int *device) {
    *device = 0;
    return 0;
}
