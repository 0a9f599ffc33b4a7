/* The preload library (libgpu_pager_preload.so) on the host backend, loaded the way torch
 * loads the CUDA runtime (a library opened locally), with a stand-in runtime:
 * - a runtime loaded after the first cudaFree is still found (review item 10);
 * - a forked child's cudaFree and tms_pause return instead of hanging on a lock a parent
 *   thread held at the fork (review item 4), 20 times while a parent thread allocates,
 *   frees, pauses and resumes.
 * argv[1]: the preload library; argv[2]: the stand-in runtime (named libcudart.so.12). The
 * core comes from GPU_PAGER_CORE. Prints "ok" at the end. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#define CHECK(cond)                                                              \
    do {                                                                         \
        if (!(cond)) {                                                           \
            fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
            exit(1);                                                             \
        }                                                                        \
    } while (0)

typedef int (*malloc_fn)(void **, size_t);
typedef int (*free_fn)(void *);
typedef void (*set_region_fn)(bool);
typedef void (*set_tag_fn)(const char *);
typedef int (*move_fn)(const char *);

static malloc_fn cuda_malloc;
static free_fn cuda_free;
static set_region_fn set_region;
static set_tag_fn set_tag;
static move_fn pause_tag, resume_tag;
static atomic_bool stop;

static void *sym(void *lib, const char *name) {
    void *p = dlsym(lib, name);
    if (p == NULL) {
        fprintf(stderr, "missing %s: %s\n", name, dlerror());
        exit(1);
    }
    return p;
}

/* A parent thread inside the drop-in all the time: allocations, frees, pauses, resumes. */
static void *busy(void *arg) {
    (void)arg;
    set_region(true);
    set_tag("busy");
    while (!atomic_load(&stop)) {
        void *p = NULL;
        CHECK(cuda_malloc(&p, 4096) == 0);
        CHECK(cuda_free(p) == 0);
        CHECK(pause_tag("busy") == 0);
        CHECK(resume_tag("busy") == 0);
    }
    return NULL;
}

int main(int argc, char **argv) {
    CHECK(argc == 3);
    void *pre = dlopen(argv[1], RTLD_NOW | RTLD_GLOBAL);
    CHECK(pre != NULL);
    cuda_malloc = (malloc_fn)sym(pre, "cudaMalloc");
    cuda_free = (free_fn)sym(pre, "cudaFree");
    set_region = (set_region_fn)sym(pre, "tms_set_interesting_region");
    set_tag = (set_tag_fn)sym(pre, "tms_set_current_tag");
    pause_tag = (move_fn)sym(pre, "tms_pause");
    resume_tag = (move_fn)sym(pre, "tms_resume");

    /* Item 10: no runtime yet, then one loaded late. */
    CHECK(cuda_free(NULL) == 3);
    void *rt = dlopen(argv[2], RTLD_NOW | RTLD_LOCAL);
    CHECK(rt != NULL);
    int *frees = (int *)sym(rt, "fake_frees");
    void *p = NULL;
    CHECK(cuda_malloc(&p, 4096) == 0 && p != NULL);
    CHECK(cuda_free(p) == 0 && *frees == 1);

    /* Item 4: a routed allocation, a busy parent thread, forked children. */
    set_region(true);
    set_tag("fork");
    void *routed = NULL;
    CHECK(cuda_malloc(&routed, 1 << 20) == 0 && routed != NULL);
    set_region(false);
    pthread_t thread;
    CHECK(pthread_create(&thread, NULL, busy, NULL) == 0);
    for (int i = 0; i < 20; i++) {
        pid_t pid = fork();
        CHECK(pid >= 0);
        if (pid == 0) {
            alarm(10); /* a hang ends the child with SIGALRM */
            cuda_free(routed);
            _exit(pause_tag("fork") != 0 ? 0 : 2);
        }
        int status = 0;
        CHECK(waitpid(pid, &status, 0) == pid);
        if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
            fprintf(stderr, "child %d: %s %d\n", i, WIFSIGNALED(status) ? "signal" : "exit",
                    WIFSIGNALED(status) ? WTERMSIG(status) : WEXITSTATUS(status));
            exit(1);
        }
    }
    atomic_store(&stop, true);
    CHECK(pthread_join(thread, NULL) == 0);
    CHECK(cuda_free(routed) == 0 && *frees == 1);
    puts("ok");
    return 0;
}
