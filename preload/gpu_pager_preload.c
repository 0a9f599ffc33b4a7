/*
 * libgpu_pager_preload.so: the preload library of gpu-pager's torch_memory_saver drop-in.
 *
 * Loaded with LD_PRELOAD (torch_memory_saver.configure_subprocess() sets it up for child
 * processes), it puts its own cudaMalloc and cudaFree in front of the CUDA runtime's:
 * - cudaMalloc on a thread inside a torch_memory_saver region (or in every thread, with
 *   TMS_INIT_ENABLE=1) allocates in gpu-pager; everything else goes to the runtime;
 * - cudaFree of a gpu-pager allocation frees it there; everything else goes to the runtime;
 * - torch_memory_saver's C entry points (tms_pause, tms_resume, tms_set_current_tag, ...)
 *   exist in the process, as examples written for torch_memory_saver look them up.
 *
 * It holds no logic of its own: every call goes to the C ABI of gpu-pager's core
 * (gpu_pager_tms_*), in the Python extension beside this file (or the library named by
 * GPU_PAGER_CORE), loaded on first use. It does not link the CUDA runtime or Python, so
 * it loads into any child process; where the core cannot be loaded (a process that is not
 * Python), cudaMalloc and cudaFree go to the runtime unchanged.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <libgen.h>
#include <link.h>
#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Only for the types of the core's functions, found with dlsym below: this library links
 * nothing of the core, and the compiler checks every call against the C ABI. */
#include "gpu_pager_tms.h"

#define EXPORT __attribute__((visibility("default")))

typedef int cuda_error;
/* cudaErrorMemoryAllocation, what cudaMalloc returns when it cannot allocate. */
#define CUDA_ERROR_MEMORY_ALLOCATION 2
/* cudaErrorInitializationError: no CUDA runtime in the process to pass a call to. */
#define CUDA_ERROR_INITIALIZATION 3

/* The CUDA runtime's own functions, found behind this library: looked up again on each
 * call until all three are there (the runtime may be loaded after the first call, e.g. a
 * cudaFree(NULL) before libcudart), then kept. Each pointer is written and read atomically;
 * `runtime_found` is set last. */
static struct {
    cuda_error (*malloc)(void **, size_t);
    cuda_error (*free)(void *);
    cuda_error (*get_device)(int *);
} runtime;
static bool runtime_found;

/* The core's C ABI (gpu_pager_tms_*); all NULL when the core could not be loaded. */
#define CORE_FN(name) __typeof__(name) *
static struct {
    CORE_FN(gpu_pager_tms_cuda_malloc) cuda_malloc;
    CORE_FN(gpu_pager_tms_cuda_free) cuda_free;
    CORE_FN(gpu_pager_tms_set_enabled) set_enabled;
    CORE_FN(gpu_pager_tms_enabled) enabled;
    CORE_FN(gpu_pager_tms_set_tag) set_tag;
    CORE_FN(gpu_pager_tms_tag) tag;
    CORE_FN(gpu_pager_tms_set_cpu_backup) set_cpu_backup;
    CORE_FN(gpu_pager_tms_cpu_backup) cpu_backup;
    CORE_FN(gpu_pager_tms_set_cpu_backend) set_cpu_backend;
    CORE_FN(gpu_pager_tms_cpu_backend) cpu_backend;
    CORE_FN(gpu_pager_tms_set_disk_backup) set_disk_backup;
    CORE_FN(gpu_pager_tms_disk_backup) disk_backup;
    CORE_FN(gpu_pager_tms_set_disk_dir) set_disk_dir;
    CORE_FN(gpu_pager_tms_set_margin) set_margin;
    CORE_FN(gpu_pager_tms_set_retain) set_retain;
    CORE_FN(gpu_pager_tms_retain) retain;
    CORE_FN(gpu_pager_tms_pause) pause;
    CORE_FN(gpu_pager_tms_resume) resume;
    CORE_FN(gpu_pager_tms_backup_pointer) backup_pointer;
    CORE_FN(gpu_pager_last_error) last_error;
} core;
#undef CORE_FN
static pthread_once_t core_once = PTHREAD_ONCE_INIT;

/* Finds the loaded CUDA runtime for find_runtime: the first object named libcudart.so*. */
static int find_cudart(struct dl_phdr_info *info, size_t size, void *out) {
    (void)size;
    const char *name = info->dlpi_name;
    if (name != NULL && strstr(name, "libcudart.so") != NULL) {
        *(const char **)out = name;
        return 1;
    }
    return 0;
}

/* Looks the runtime's three functions up: behind this library, else (a runtime loaded
 * without RTLD_GLOBAL, as a dependency of a library opened locally) in the copy already in
 * the process, by its path. Stores them only when all three are found. */
static void find_runtime(void) {
    if (__atomic_load_n(&runtime_found, __ATOMIC_ACQUIRE)) {
        return;
    }
    __typeof__(runtime) found;
    void *h = RTLD_NEXT;
    for (int attempt = 0; attempt < 2; attempt++) {
        if (attempt == 1) {
            const char *path = NULL;
            dl_iterate_phdr(find_cudart, &path);
            h = path != NULL ? dlopen(path, RTLD_NOW | RTLD_NOLOAD) : NULL;
            if (h == NULL) {
                return;
            }
        }
        *(void **)(&found.malloc) = dlsym(h, "cudaMalloc");
        *(void **)(&found.free) = dlsym(h, "cudaFree");
        *(void **)(&found.get_device) = dlsym(h, "cudaGetDevice");
        if (attempt == 1) {
            dlclose(h); /* RTLD_NOLOAD took a reference; the runtime stays loaded */
        }
        if (found.malloc != NULL && found.free != NULL && found.get_device != NULL) {
            __atomic_store_n(&runtime.malloc, found.malloc, __ATOMIC_RELAXED);
            __atomic_store_n(&runtime.free, found.free, __ATOMIC_RELAXED);
            __atomic_store_n(&runtime.get_device, found.get_device, __ATOMIC_RELAXED);
            __atomic_store_n(&runtime_found, true, __ATOMIC_RELEASE);
            return;
        }
    }
}

/* One of the runtime's functions as last stored (NULL: not found yet). */
#define RUNTIME(fn) __atomic_load_n(&runtime.fn, __ATOMIC_ACQUIRE)

/* Whether the user asked for every allocation to be routed (then a missing core is worth a
 * word on stderr; otherwise a process that never routes stays quiet). */
static bool routing_wanted(void) {
    const char *v = getenv("TMS_INIT_ENABLE");
    return v != NULL && (strcmp(v, "1") == 0 || strcmp(v, "true") == 0 || strcmp(v, "TRUE") == 0 ||
                         strcmp(v, "yes") == 0 || strcmp(v, "YES") == 0);
}

static void load_core(void) {
    char path[4096];
    const char *env = getenv("GPU_PAGER_CORE");
    if (env != NULL && env[0] != '\0') {
        snprintf(path, sizeof path, "%s", env);
    } else {
        /* The extension module beside this library: gpu_pager/_native.abi3.so. */
        Dl_info self;
        if (dladdr((void *)load_core, &self) == 0 || self.dli_fname == NULL) {
            return;
        }
        char dir[4096];
        snprintf(dir, sizeof dir, "%s", self.dli_fname);
        snprintf(path, sizeof path, "%s/_native.abi3.so", dirname(dir));
    }
    /* The same path Python imports: the process then holds one copy of the core. */
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (h == NULL) {
        if (routing_wanted()) {
            fprintf(stderr,
                    "gpu-pager preload: cannot load the core (%s): %s; cudaMalloc and cudaFree "
                    "go to the CUDA runtime unchanged (set GPU_PAGER_CORE to the gpu_pager "
                    "extension's path)\n",
                    path, dlerror());
        }
        return;
    }
#define BIND(field, name)                                 \
    do {                                                  \
        *(void **)(&core.field) = dlsym(h, name);         \
        if (core.field == NULL) {                         \
            goto missing;                                 \
        }                                                 \
    } while (0)
    BIND(cuda_malloc, "gpu_pager_tms_cuda_malloc");
    BIND(cuda_free, "gpu_pager_tms_cuda_free");
    BIND(set_enabled, "gpu_pager_tms_set_enabled");
    BIND(enabled, "gpu_pager_tms_enabled");
    BIND(set_tag, "gpu_pager_tms_set_tag");
    BIND(tag, "gpu_pager_tms_tag");
    BIND(set_cpu_backup, "gpu_pager_tms_set_cpu_backup");
    BIND(cpu_backup, "gpu_pager_tms_cpu_backup");
    BIND(set_cpu_backend, "gpu_pager_tms_set_cpu_backend");
    BIND(cpu_backend, "gpu_pager_tms_cpu_backend");
    BIND(set_disk_backup, "gpu_pager_tms_set_disk_backup");
    BIND(disk_backup, "gpu_pager_tms_disk_backup");
    BIND(set_disk_dir, "gpu_pager_tms_set_disk_dir");
    BIND(set_margin, "gpu_pager_tms_set_margin");
    BIND(set_retain, "gpu_pager_tms_set_retain");
    BIND(retain, "gpu_pager_tms_retain");
    BIND(pause, "gpu_pager_tms_pause");
    BIND(resume, "gpu_pager_tms_resume");
    BIND(backup_pointer, "gpu_pager_tms_backup_pointer");
    BIND(last_error, "gpu_pager_last_error");
#undef BIND
    return;
missing:
    fprintf(stderr, "gpu-pager preload: %s lacks the gpu_pager_tms_* functions (%s)\n", path,
            dlerror());
    memset(&core, 0, sizeof core);
}

static bool have_core(void) {
    pthread_once(&core_once, load_core);
    return core.cuda_malloc != NULL;
}

/* A failed core call in a function torch_memory_saver declares void: say why on stderr. */
static void report(const char *what, gpu_pager_code code) {
    if (code != GPU_PAGER_OK) {
        fprintf(stderr, "gpu-pager preload: %s failed: %s\n", what, core.last_error());
    }
}

EXPORT cuda_error cudaMalloc(void **ptr, size_t size) {
    find_runtime();
    if (have_core() && core.enabled()) {
        int device = 0;
        __typeof__(runtime.get_device) get_device = RUNTIME(get_device);
        if (get_device != NULL && get_device(&device) != 0) {
            device = 0;
        }
        bool routed = false;
        gpu_pager_code code = core.cuda_malloc(device, size, ptr, &routed);
        if (code != GPU_PAGER_OK) {
            return CUDA_ERROR_MEMORY_ALLOCATION;
        }
        if (routed) {
            return 0;
        }
    }
    __typeof__(runtime.malloc) next = RUNTIME(malloc);
    return next != NULL ? next(ptr, size) : CUDA_ERROR_INITIALIZATION;
}

EXPORT cuda_error cudaFree(void *ptr) {
    find_runtime();
    /* cudaFree(NULL) initializes the runtime's context: always the runtime's. */
    if (ptr != NULL && have_core()) {
        bool freed = false;
        gpu_pager_code code = core.cuda_free(ptr, &freed);
        if (freed) {
            return code == GPU_PAGER_OK ? 0 : CUDA_ERROR_MEMORY_ALLOCATION;
        }
    }
    __typeof__(runtime.free) next = RUNTIME(free);
    return next != NULL ? next(ptr) : CUDA_ERROR_INITIALIZATION;
}

/* torch_memory_saver's entry points, with its signatures. */

EXPORT void tms_set_interesting_region(bool on) {
    if (have_core()) core.set_enabled(on);
}

EXPORT bool tms_get_interesting_region(void) { return have_core() && core.enabled(); }

EXPORT void tms_set_current_tag(const char *tag) {
    if (have_core()) report("tms_set_current_tag", core.set_tag(tag));
}

EXPORT const char *tms_get_current_tag(void) { return have_core() ? core.tag() : "default"; }

EXPORT void tms_set_enable_cpu_backup(bool on) {
    if (have_core()) core.set_cpu_backup(on);
}

EXPORT bool tms_get_enable_cpu_backup(void) { return have_core() && core.cpu_backup(); }

EXPORT void tms_set_cpu_backup_backend(const char *backend) {
    if (have_core()) report("tms_set_cpu_backup_backend", core.set_cpu_backend(backend));
}

EXPORT const char *tms_get_cpu_backup_backend(void) {
    return have_core() ? core.cpu_backend() : "pinned";
}

EXPORT void tms_set_enable_disk_backup(bool on) {
    if (have_core()) core.set_disk_backup(on);
}

EXPORT bool tms_get_enable_disk_backup(void) { return have_core() && core.disk_backup(); }

EXPORT void tms_set_disk_backup_dir(const char *dir) {
    if (have_core()) report("tms_set_disk_backup_dir", core.set_disk_dir(dir));
}

EXPORT void tms_set_retain_cpu_backup(bool on) {
    if (have_core()) core.set_retain(on);
}

EXPORT bool tms_get_retain_cpu_backup(void) { return have_core() && core.retain(); }

EXPORT void set_memory_margin_bytes(uint64_t bytes) {
    if (have_core()) core.set_margin(bytes);
}

EXPORT int tms_pause(const char *tag) {
    if (!have_core()) return CUDA_ERROR_INITIALIZATION;
    gpu_pager_code code = core.pause(tag);
    report("tms_pause", code);
    return (int)code;
}

EXPORT int tms_resume(const char *tag) {
    if (!have_core()) return CUDA_ERROR_INITIALIZATION;
    gpu_pager_code code = core.resume(tag);
    report("tms_resume", code);
    return (int)code;
}

EXPORT uint8_t *tms_get_cpu_backup_pointer(const uint8_t *gpu_ptr, uint64_t size) {
    return have_core() ? core.backup_pointer((uint64_t)(uintptr_t)gpu_ptr, size) : NULL;
}
