/*
 * A stand-in for the NVIDIA driver library, for the tests of the driver floor: built as
 * libcuda.so into a temporary folder that LD_LIBRARY_PATH puts first, it answers
 * cuDriverGetVersion with $GPU_PAGER_STUB_DRIVER_VERSION (e.g. 11080 for CUDA 11.8; "stub":
 * CUDA_ERROR_STUB_LIBRARY, as a CUDA toolkit's link stub answers) and has no device. Nothing else of the driver is here: a library that called further would fail
 * to find the symbol, which the tests would see.
 */
#include <stdlib.h>
#include <string.h>

#define CUDA_SUCCESS 0
#define CUDA_ERROR_INVALID_VALUE 1
#define CUDA_ERROR_STUB_LIBRARY 34
#define CUDA_ERROR_NO_DEVICE 100

int cuDriverGetVersion(int *version) {
    const char *v = getenv("GPU_PAGER_STUB_DRIVER_VERSION");
    if (version == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    if (v != NULL && strcmp(v, "stub") == 0)
        return CUDA_ERROR_STUB_LIBRARY;
    *version = v ? atoi(v) : 0;
    return CUDA_SUCCESS;
}

int cuInit(unsigned int flags) {
    (void)flags;
    return CUDA_ERROR_NO_DEVICE;
}

int cuGetErrorName(int error, const char **name) {
    *name = error == CUDA_ERROR_NO_DEVICE ? "CUDA_ERROR_NO_DEVICE" : "CUDA_ERROR_UNKNOWN";
    return CUDA_SUCCESS;
}

int cuGetErrorString(int error, const char **text) {
    *text = error == CUDA_ERROR_NO_DEVICE ? "no CUDA-capable device is detected" : "unknown error";
    return CUDA_SUCCESS;
}
