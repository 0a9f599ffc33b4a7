/* On a driver older than the floor (the stand-in driver, CUDA 11.8): the first call on
 * device 0 fails with GPU_PAGER_ERROR_BACKEND, and the message names both versions. */
#include <stdio.h>
#include <string.h>
#include "gpu_pager.h"

int main(void) {
    gpu_pager_code rc =
        gpu_pager_region(0, "weights", GPU_PAGER_PRESERVE, GPU_PAGER_FIXED, 1 << 20, false, NULL);
    const char *msg = gpu_pager_last_error();
    printf("%u %s\n", (unsigned)rc, msg ? msg : "(none)");
    if (rc != GPU_PAGER_ERROR_BACKEND || msg == NULL || strstr(msg, "CUDA 11.8") == NULL ||
        strstr(msg, "CUDA 12.0 or newer") == NULL)
        return 1;
    printf("ok\n");
    return 0;
}
