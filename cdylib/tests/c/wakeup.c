/* The multi-stage wake-up through the C ABI, then its error paths. Built and run against
 * libgpu_pager.so by cdylib/tests/c.rs, on the GPU when there is one, else on the host
 * backend (with GPU_PAGER_HOST_CAPACITY set small, so out-of-memory is reachable). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu_pager.h"

#define MIB ((size_t)1 << 20)

static int failures = 0;

/* A call that must succeed. */
#define CHECK(call)                                                                        \
    do {                                                                                   \
        gpu_pager_code c_ = (call);                                                        \
        if (c_ != GPU_PAGER_OK) {                                                          \
            fprintf(stderr, "%s:%d: %s -> %s: %s\n", __FILE__, __LINE__, #call,            \
                    gpu_pager_code_name(c_), gpu_pager_last_error());                      \
            exit(1);                                                                       \
        }                                                                                  \
    } while (0)

/* A call that must fail with `code`, its message containing `needle`. */
#define EXPECT(call, code, needle)                                                         \
    do {                                                                                   \
        gpu_pager_clear_error();                                                           \
        gpu_pager_code c_ = (call);                                                        \
        expect_(c_, (code), (needle), #call, __LINE__);                                    \
    } while (0)

static void expect_(gpu_pager_code got, gpu_pager_code want, const char *needle,
                    const char *what, int line) {
    const char *msg = gpu_pager_last_error();
    if (got != want || gpu_pager_last_error_code() != want || strstr(msg, needle) == NULL) {
        fprintf(stderr, "line %d: %s -> %s (want %s, message with \"%s\"): %s\n", line, what,
                gpu_pager_code_name(got), gpu_pager_code_name(want), needle, msg);
        failures++;
    } else {
        printf("  expected %-16s %s\n", gpu_pager_code_name(got), msg);
    }
}

static void pattern(unsigned char *p, size_t n, unsigned seed) {
    for (size_t i = 0; i < n; i++) p[i] = (unsigned char)(i * 31u + seed);
}

/* A growing Preserve region filled through the PyTorch hook with 300 odd-sized
 * allocations: release gives the mapped memory back (free memory rises by it), resume brings
 * every byte back at the same address; frees give memory back at once. */
static void grow(int dev, int N, size_t max_bytes) {
    static void *ptrs[300];
    static size_t lens[300];
    gpu_pager_device_info info;
    CHECK(gpu_pager_region(dev, "torch_weights", GPU_PAGER_PRESERVE, GPU_PAGER_GROWING, 0, false, NULL));
    CHECK(gpu_pager_use_tag(dev, "torch_weights"));
    CHECK(gpu_pager_device(dev, &info));
    const uint64_t g = info.granularity, free0 = info.free_bytes;
    uint64_t mapped = 0;
    unsigned char *data = malloc(max_bytes + N), *back = malloc(max_bytes + N);
    if (!data || !back) exit(1);
    for (int i = 0; i < N; i++) {
        lens[i] = 1 + ((size_t)i * 7919u * 13u) % max_bytes + (size_t)i;
        ptrs[i] = gpu_pager_torch_malloc(lens[i], dev, NULL);
        if (ptrs[i] == NULL) {
            fprintf(stderr, "torch_malloc %d (%zu bytes): %s\n", i, lens[i], gpu_pager_last_error());
            exit(1);
        }
        mapped += (lens[i] + g - 1) / g * g;
        pattern(data, lens[i], (unsigned)i);
        CHECK(gpu_pager_write(dev, (uint64_t)(uintptr_t)ptrs[i], data, lens[i]));
    }
    CHECK(gpu_pager_device(dev, &info));
    if (free0 - info.free_bytes < mapped) {
        fprintf(stderr, "growing: %llu bytes mapped but free memory fell by %llu\n",
                (unsigned long long)mapped, (unsigned long long)(free0 - info.free_bytes));
        failures++;
    }
    const char *tags[] = {"torch_weights"};
    gpu_pager_report r;
    for (int cycle = 0; cycle < 2; cycle++) {
        uint64_t before;
        CHECK(gpu_pager_device(dev, &info));
        before = info.free_bytes;
        CHECK(gpu_pager_release(dev, tags, 1, &r));
        CHECK(gpu_pager_device(dev, &info));
        if (r.bytes != mapped || info.free_bytes + 64 * MIB < before + mapped) {
            fprintf(stderr, "growing release: %llu of %llu bytes, free rose by %llu\n",
                    (unsigned long long)r.bytes, (unsigned long long)mapped,
                    (unsigned long long)(info.free_bytes - before));
            failures++;
        }
        CHECK(gpu_pager_resume(dev, tags, 1, &r));
        for (int i = 0; i < N; i++) {
            pattern(data, lens[i], (unsigned)i);
            CHECK(gpu_pager_read(dev, (uint64_t)(uintptr_t)ptrs[i], back, lens[i]));
            if (memcmp(data, back, lens[i]) != 0) {
                fprintf(stderr, "growing: allocation %d differs after cycle %d\n", i, cycle);
                failures++;
                break;
            }
        }
    }
    printf("growing region: %d torch allocations, %llu bytes mapped, cycled bit-exact\n", N,
           (unsigned long long)mapped);
    CHECK(gpu_pager_device(dev, &info));
    const uint64_t before = info.free_bytes;
    for (int i = 0; i < N; i++) gpu_pager_torch_free(ptrs[i], lens[i], dev, NULL);
    CHECK(gpu_pager_device(dev, &info));
    if (info.free_bytes + 64 * MIB < before + mapped) {
        fprintf(stderr, "growing: the frees gave back %llu of %llu bytes\n",
                (unsigned long long)(info.free_bytes - before), (unsigned long long)mapped);
        failures++;
    }
    CHECK(gpu_pager_use_tag(dev, NULL));
    CHECK(gpu_pager_remove(dev, "torch_weights"));
    free(data);
    free(back);
}

/* Update-aware release: three 1 MiB buffers, the middle one marked "overwritten by the next
 * update" and a small tensor inside the last one too. A release copies only the unmarked
 * bytes (the small mark lies in a gap shorter than 1 MiB, so it is copied along); after the
 * resume the unmarked neighbours are bit-exact and the marked buffer is writable. Unmarked,
 * the next cycle brings it back bit-exact. */
static void marks(int dev) {
    enum { M = 3 };
    uint64_t b[M];
    const size_t len = 1 * MIB, small_at = 4096, small = 8192;
    const char *tags[] = {"marked"};
    unsigned char *data = malloc(len), *back = malloc(len);
    if (!data || !back) exit(1);
    /* Pinned ahead: a first release without a backup copies the whole region while it pins
     * (first_save_overlap); this counts what a save of marked buffers copies. */
    CHECK(gpu_pager_region(dev, "marked", GPU_PAGER_PRESERVE, GPU_PAGER_FIXED, 8 * MIB, true, NULL));
    for (int i = 0; i < M; i++) {
        CHECK(gpu_pager_alloc(dev, "marked", len, &b[i]));
        pattern(data, len, 40u + (unsigned)i);
        CHECK(gpu_pager_write(dev, b[i], data, len));
    }
    CHECK(gpu_pager_set_overwritten(dev, b[1], len, true));
    CHECK(gpu_pager_set_overwritten(dev, b[2] + small_at, small, true));
    gpu_pager_stats st;
    CHECK(gpu_pager_get_stats(dev, &st));
    if (st.marked_bytes != len + small) {
        fprintf(stderr, "marks: %llu bytes marked, want %zu\n",
                (unsigned long long)st.marked_bytes, len + small);
        failures++;
    }
    EXPECT(gpu_pager_set_overwritten(dev, b[1], 0, true), GPU_PAGER_ERROR_INVALID_SIZE,
           "0 bytes");
    EXPECT(gpu_pager_set_overwritten(dev, b[1] + len - 16, 32, true),
           GPU_PAGER_ERROR_OUT_OF_RANGE, "`marked`");
    EXPECT(gpu_pager_set_overwritten(dev, 16, 32, true), GPU_PAGER_ERROR_INVALID_ARGUMENT,
           "not inside");

    gpu_pager_report r;
    CHECK(gpu_pager_release(dev, tags, 1, &r));
    if (r.copied != 2 * len) {
        fprintf(stderr, "marks: the release copied %llu bytes, want %zu\n",
                (unsigned long long)r.copied, 2 * len);
        failures++;
    }
    CHECK(gpu_pager_resume(dev, tags, 1, &r));
    for (int i = 0; i < M; i += 2) {
        pattern(data, len, 40u + (unsigned)i);
        CHECK(gpu_pager_read(dev, b[i], back, len));
        if (memcmp(data, back, len) != 0) {
            fprintf(stderr, "marks: unmarked neighbour %d differs after the cycle\n", i);
            failures++;
        }
    }
    /* The update writes the marked buffer; it reads back. */
    pattern(data, len, 77);
    CHECK(gpu_pager_write(dev, b[1], data, len));
    CHECK(gpu_pager_read(dev, b[1], back, len));
    if (memcmp(data, back, len) != 0) {
        fprintf(stderr, "marks: the marked buffer is not writable after resume\n");
        failures++;
    }
    /* Unmarked: the next cycle saves it again and restores it bit-exact. */
    CHECK(gpu_pager_set_overwritten(dev, b[1], len, false));
    CHECK(gpu_pager_release(dev, tags, 1, &r));
    CHECK(gpu_pager_resume(dev, tags, 1, &r));
    CHECK(gpu_pager_read(dev, b[1], back, len));
    if (memcmp(data, back, len) != 0) {
        fprintf(stderr, "marks: the unmarked buffer differs after the next cycle\n");
        failures++;
    }
    printf("marks: a marked buffer skipped, its neighbours bit-exact, unmarked bit-exact\n");
    for (int i = 0; i < M; i++) CHECK(gpu_pager_free(dev, b[i]));
    CHECK(gpu_pager_remove(dev, "marked"));
    free(data);
    free(back);
}

/* A companion's state: a buffer of the caller's own (outside the pager) that is freed at each
 * release of its tag and brought back, with its contents, at each resume; and counters. */
typedef struct side {
    unsigned char *live;
    unsigned char kept[4096];
    int releases, resumes, fail_with;
} side;

static int side_release(const char *tag, void *user) {
    side *s = user;
    if (s->fail_with) return s->fail_with;
    if (strcmp(tag, "kv_cache") != 0 || s->live == NULL) return 1;
    memcpy(s->kept, s->live, sizeof s->kept);
    free(s->live);
    s->live = NULL;
    s->releases++;
    return 0;
}

static int side_resume(const char *tag, void *user) {
    side *s = user;
    if (strcmp(tag, "kv_cache") != 0 || s->live != NULL) return 1;
    s->live = malloc(sizeof s->kept);
    if (s->live == NULL) return 2;
    memcpy(s->live, s->kept, sizeof s->kept);
    s->resumes++;
    return 0;
}

/* Companions of kv_cache: one that moves a buffer outside the pager with the tag, and one
 * that fails, which undoes the release (the first companion's release undone too). */
static void companions(int dev) {
    const char *kv[] = {"kv_cache"};
    side own = {0}, bad = {0};
    own.live = malloc(sizeof own.kept);
    if (own.live == NULL) exit(1);
    pattern(own.live, sizeof own.kept, 77);
    uint64_t own_id = 0, bad_id = 0;
    EXPECT(gpu_pager_add_companion(dev, "kv_cache", "own", side_release, side_resume, &own,
                                   NULL),
           GPU_PAGER_ERROR_INVALID_ARGUMENT, "id_out");
    bad.fail_with = 3;
    CHECK(gpu_pager_add_companion(dev, "kv_cache", "transport", side_release, NULL, &bad,
                                  &bad_id));
    CHECK(gpu_pager_add_companion(dev, "kv_cache", "own", side_release, side_resume, &own,
                                  &own_id));
    /* On release the newest companion runs first: "own" gives its buffer up, "transport"
     * fails, and "own" gets its buffer back; nothing moved. */
    EXPECT(gpu_pager_release(dev, kv, 1, NULL), GPU_PAGER_ERROR_COMPANION, "returned 3");
    gpu_pager_stats st;
    CHECK(gpu_pager_get_stats(dev, &st));
    if (st.released_bytes != 0 || own.live == NULL || own.releases != 1 || own.resumes != 1) {
        fprintf(stderr, "a failed companion left the release half done\n");
        failures++;
    }
    CHECK(gpu_pager_remove_companion(dev, bad_id));
    EXPECT(gpu_pager_remove_companion(dev, bad_id), GPU_PAGER_ERROR_INVALID_ARGUMENT,
           "not registered");
    for (int cycle = 0; cycle < 2; cycle++) {
        CHECK(gpu_pager_release(dev, kv, 1, NULL));
        if (own.live != NULL) {
            fprintf(stderr, "the companion's buffer outlived the release\n");
            failures++;
        }
        CHECK(gpu_pager_resume(dev, kv, 1, NULL));
    }
    unsigned char want[sizeof own.kept];
    pattern(want, sizeof want, 77);
    if (own.live == NULL || memcmp(own.live, want, sizeof want) != 0 || own.releases != 3 ||
        own.resumes != 3) {
        fprintf(stderr, "the companion's buffer did not come back (%d releases, %d resumes)\n",
                own.releases, own.resumes);
        failures++;
    }
    CHECK(gpu_pager_remove_companion(dev, own_id));
    free(own.live);

    /* Poisoned discards (configured on): the discarded KV cache comes back as NaN words. */
    uint64_t b = 0;
    uint32_t words[1024];
    CHECK(gpu_pager_alloc(dev, "kv_cache", sizeof words, &b));
    memset(words, 0x11, sizeof words);
    CHECK(gpu_pager_write(dev, b, words, sizeof words));
    CHECK(gpu_pager_release(dev, kv, 1, NULL));
    CHECK(gpu_pager_resume(dev, kv, 1, NULL));
    CHECK(gpu_pager_read(dev, b, words, sizeof words));
    for (size_t i = 0; i < sizeof words / sizeof words[0]; i++) {
        if (words[i] != GPU_PAGER_POISON) {
            fprintf(stderr, "word %zu of the discarded KV cache is %#x, not the poison\n", i,
                    (unsigned)words[i]);
            failures++;
            break;
        }
    }
    CHECK(gpu_pager_free(dev, b));
}

/* Settings before the device's first use: refused when malformed, applied to the pager the
 * first call opens, fixed once it is open. */
static void configure(int dev) {
    EXPECT(gpu_pager_configure(dev, NULL), GPU_PAGER_ERROR_INVALID_ARGUMENT, "config is NULL");
    gpu_pager_config bad = gpu_pager_config_default();
    if (bad.size != sizeof(gpu_pager_config)) {
        fprintf(stderr, "gpu_pager_config_default() does not set size\n");
        failures++;
    }
    bad.restore_route = 7;
    EXPECT(gpu_pager_configure(dev, &bad), GPU_PAGER_ERROR_INVALID_ARGUMENT, "restore_route = 7");
    bad = gpu_pager_config_default();
    *(unsigned char *)&bad.verify_restore = 2; /* a bool byte that is neither 0 nor 1 */
    EXPECT(gpu_pager_configure(dev, &bad), GPU_PAGER_ERROR_INVALID_ARGUMENT,
           "config.verify_restore holds the byte 2");
    bad = gpu_pager_config_default();
    bad.size = 0; /* not initialized from the default */
    EXPECT(gpu_pager_configure(dev, &bad), GPU_PAGER_ERROR_INVALID_ARGUMENT, "config.size = 0");
    gpu_pager_config c = gpu_pager_config_default();
    if (c.chunk_bytes != 512 * MIB || !c.skip_unchanged || c.verify_restore ||
        c.save_route != GPU_PAGER_ROUTE_ENGINE || c.restore_route != GPU_PAGER_ROUTE_FASTEST) {
        fprintf(stderr, "gpu_pager_config_default() is not the documented defaults\n");
        failures++;
    }
    if (c.poison_discards) {
        fprintf(stderr, "poisoned discards are on by default\n");
        failures++;
    }
    c.chunk_bytes = 3 * MIB;
    c.verify_restore = true;
    c.poison_discards = true;
    c.save_route = GPU_PAGER_ROUTE_FASTEST;
    CHECK(gpu_pager_configure(dev, &c));
    /* The same by name (a later call replaces an earlier one); bad text changes nothing. */
    EXPECT(gpu_pager_configure_text(dev, "chunk_bytes=3M, sideways=1"),
           GPU_PAGER_ERROR_INVALID_ARGUMENT, "no setting is named \"sideways\"");
    EXPECT(gpu_pager_configure_text(dev, "verify_restore=maybe"), GPU_PAGER_ERROR_INVALID_ARGUMENT,
           "is not a switch");
    EXPECT(gpu_pager_configure_text(dev, NULL), GPU_PAGER_ERROR_INVALID_ARGUMENT, "settings is NULL");
    CHECK(gpu_pager_configure_text(dev, "chunk_bytes=3M verify_restore=true poison_discards=1 "
                                        "save_route=fastest"));
    gpu_pager_config got = gpu_pager_config_default();
    CHECK(gpu_pager_get_config(dev, &got)); /* opens the pager */
    if (got.chunk_bytes != 4 * MIB || !got.verify_restore || !got.skip_unchanged || !got.poison_discards ||
        got.save_route != GPU_PAGER_ROUTE_FASTEST || got.restore_route != GPU_PAGER_ROUTE_FASTEST) {
        fprintf(stderr, "the pager does not have the configured settings (chunk %llu)\n",
                (unsigned long long)got.chunk_bytes);
        failures++;
    }
    CHECK(gpu_pager_configure(dev, &c)); /* the same settings again */
    c.verify_restore = false;
    EXPECT(gpu_pager_configure(dev, &c), GPU_PAGER_ERROR_INVALID_ARGUMENT, "before its first use");
}

int main(void) {
    const int dev = 0;
    configure(dev);
    gpu_pager_device_info info;
    CHECK(gpu_pager_device(dev, &info));
    int host = info.kind == GPU_PAGER_BACKEND_HOST;
    printf("gpu-pager %s, device 0 on %s, %llu bytes free\n", gpu_pager_version(),
           host ? "the host backend (no GPU)" : "CUDA", (unsigned long long)info.free_bytes);

    /* Regions: weights (Preserve) and kv_cache (Discard). */
    const size_t weights_bytes = 8 * MIB, kv_bytes = 16 * MIB, buf_bytes = 1 * MIB;
    uint64_t weights_base = 0;
    CHECK(gpu_pager_region(dev, "weights", GPU_PAGER_PRESERVE, GPU_PAGER_FIXED, weights_bytes, false,
                           &weights_base));
    CHECK(gpu_pager_region(dev, "kv_cache", GPU_PAGER_DISCARD, GPU_PAGER_FIXED, kv_bytes, false, NULL));

    /* Weights buffers with known bytes. */
    enum { N = 4 };
    uint64_t w[N];
    unsigned char *data = malloc(buf_bytes), *back = malloc(buf_bytes);
    if (!data || !back) return 1;
    for (int i = 0; i < N; i++) {
        CHECK(gpu_pager_alloc(dev, "weights", buf_bytes, &w[i]));
        pattern(data, buf_bytes, (unsigned)i);
        CHECK(gpu_pager_write(dev, w[i], data, buf_bytes));
    }

    /* Sleep: release both. */
    const char *both[] = {"kv_cache", "weights"};
    const char *weights[] = {"weights"}, *kv[] = {"kv_cache"};
    gpu_pager_report rep;
    CHECK(gpu_pager_release(dev, both, 2, &rep));
    printf("release: %llu bytes unmapped, %llu copied, %.2f ms\n",
           (unsigned long long)rep.bytes, (unsigned long long)rep.copied, rep.seconds * 1e3);
    if (rep.bytes != weights_bytes + kv_bytes || rep.regions_done != 2 ||
        rep.copied < N * buf_bytes) {
        fprintf(stderr, "unexpected release report\n");
        failures++;
    }
    /* The audit after the release: nothing mapped under the regions, both listed. */
    gpu_pager_audit_totals at;
    const char *table = gpu_pager_audit(dev, &at);
    if (table == NULL || at.mapped_bytes != 0 || at.regions != 2 ||
        at.device_total_bytes < at.device_free_bytes || strstr(table, "weights") == NULL ||
        strstr(table, "released") == NULL) {
        fprintf(stderr, "unexpected audit (mapped %llu, regions %llu):\n%s\n",
                (unsigned long long)at.mapped_bytes, (unsigned long long)at.regions,
                table ? table : gpu_pager_last_error());
        failures++;
    }
    EXPECT(gpu_pager_write(dev, w[0], data, 16), GPU_PAGER_ERROR_NOT_RESIDENT, "`weights`");
    EXPECT(gpu_pager_read(dev, w[0], back, 16), GPU_PAGER_ERROR_NOT_RESIDENT, "resume `weights` first");

    /* Stage 1: weights back, bit-exact, same addresses; update them in place. */
    CHECK(gpu_pager_resume(dev, weights, 1, &rep));
    printf("resume weights: %llu bytes mapped, %llu copied\n", (unsigned long long)rep.bytes,
           (unsigned long long)rep.copied);
    for (int i = 0; i < N; i++) {
        pattern(data, buf_bytes, (unsigned)i);
        CHECK(gpu_pager_read(dev, w[i], back, buf_bytes));
        if (memcmp(data, back, buf_bytes) != 0) {
            fprintf(stderr, "weights buffer %d differs after resume\n", i);
            failures++;
        }
    }
    if (w[0] != weights_base) {
        fprintf(stderr, "the first buffer moved\n");
        failures++;
    }
    pattern(data, buf_bytes, 200);
    CHECK(gpu_pager_write(dev, w[0], data, buf_bytes));
    CHECK(gpu_pager_read(dev, w[0], back, buf_bytes));
    if (memcmp(data, back, buf_bytes) != 0) {
        fprintf(stderr, "updated weights differ\n");
        failures++;
    }

    /* Stage 2: kv_cache. */
    CHECK(gpu_pager_resume(dev, kv, 1, &rep));
    CHECK(gpu_pager_resume(dev, both, 2, &rep)); /* idempotent */
    if (rep.regions_already != 2) {
        fprintf(stderr, "a second resume changed something\n");
        failures++;
    }
    gpu_pager_stats st;
    CHECK(gpu_pager_get_stats(dev, &st));
    if (st.resident_bytes != weights_bytes + kv_bytes || st.released_bytes != 0 ||
        st.regions != 2 || st.buffers != N) {
        fprintf(stderr, "unexpected stats: resident %llu, regions %llu\n",
                (unsigned long long)st.resident_bytes, (unsigned long long)st.regions);
        failures++;
    }

    companions(dev);

    /* A lease keeps weights resident. */
    uint64_t lease = 0;
    CHECK(gpu_pager_lease(dev, weights, 1, &lease));
    EXPECT(gpu_pager_release(dev, weights, 1, NULL), GPU_PAGER_ERROR_BUSY, "`weights`");
    CHECK(gpu_pager_unlease(lease));
    EXPECT(gpu_pager_unlease(lease), GPU_PAGER_ERROR_INVALID_ARGUMENT, "not live");

    printf("error paths:\n");
    uint64_t p = 0;
    /* Unknown tags. */
    const char *nope[] = {"nope"};
    EXPECT(gpu_pager_alloc(dev, "nope", 64, &p), GPU_PAGER_ERROR_UNKNOWN_TAG, "`nope`");
    EXPECT(gpu_pager_release(dev, nope, 1, NULL), GPU_PAGER_ERROR_UNKNOWN_TAG, "`nope`");
    /* NULL arguments. */
    EXPECT(gpu_pager_alloc(dev, NULL, 64, &p), GPU_PAGER_ERROR_INVALID_ARGUMENT, "NULL");
    EXPECT(gpu_pager_alloc(dev, "weights", 64, NULL), GPU_PAGER_ERROR_INVALID_ARGUMENT,
           "ptr_out");
    EXPECT(gpu_pager_release(dev, NULL, 1, NULL), GPU_PAGER_ERROR_INVALID_ARGUMENT, "NULL");
    const char *with_null[] = {"weights", NULL};
    EXPECT(gpu_pager_release(dev, with_null, 2, NULL), GPU_PAGER_ERROR_INVALID_ARGUMENT,
           "tags[1]");
    EXPECT(gpu_pager_write(dev, w[0], NULL, 16), GPU_PAGER_ERROR_INVALID_ARGUMENT, "src");
    EXPECT(gpu_pager_get_stats(dev, NULL), GPU_PAGER_ERROR_INVALID_ARGUMENT, "NULL");
    EXPECT(gpu_pager_device(dev, NULL), GPU_PAGER_ERROR_INVALID_ARGUMENT, "NULL");
    /* Not UTF-8. */
    EXPECT(gpu_pager_region(dev, "\xff\xfe", GPU_PAGER_DISCARD, GPU_PAGER_FIXED, MIB, false, NULL),
           GPU_PAGER_ERROR_INVALID_ARGUMENT, "UTF-8");
    /* Zero sizes: a fixed region of 0 bytes (the kind that grows is named), a buffer. */
    EXPECT(gpu_pager_region(dev, "zero", GPU_PAGER_DISCARD, GPU_PAGER_FIXED, 0, false, NULL),
           GPU_PAGER_ERROR_INVALID_SIZE, "growing");
    EXPECT(gpu_pager_alloc(dev, "weights", 0, &p), GPU_PAGER_ERROR_INVALID_SIZE, "`weights`");
    /* A copy of 0 bytes copies nothing, but its address is checked as any copy's. */
    EXPECT(gpu_pager_write(dev, 16, NULL, 0), GPU_PAGER_ERROR_INVALID_ARGUMENT, "live buffer");
    /* Bad values. */
    EXPECT(gpu_pager_region(dev, "x", 42, GPU_PAGER_FIXED, MIB, false, NULL), GPU_PAGER_ERROR_INVALID_ARGUMENT,
           "GPU_PAGER_PRESERVE");
    EXPECT(gpu_pager_region(dev, "x", GPU_PAGER_DISCARD, 7, MIB, false, NULL),
           GPU_PAGER_ERROR_INVALID_ARGUMENT, "GPU_PAGER_GROWING");
    EXPECT(gpu_pager_region(dev, "weights", GPU_PAGER_DISCARD, GPU_PAGER_FIXED, weights_bytes, false, NULL),
           GPU_PAGER_ERROR_TAG_CONFLICT, "`weights`");
    EXPECT(gpu_pager_alloc(-1, "weights", 64, &p), GPU_PAGER_ERROR_INVALID_ARGUMENT, "-1");
    EXPECT(gpu_pager_write(dev, w[0] + 16, data, buf_bytes), GPU_PAGER_ERROR_OUT_OF_RANGE,
           "`weights`");
    EXPECT(gpu_pager_free(dev, w[0] + 8), GPU_PAGER_ERROR_INVALID_ARGUMENT, "inside");
    EXPECT(gpu_pager_free(dev, 16), GPU_PAGER_ERROR_INVALID_ARGUMENT, "not inside");
    EXPECT(gpu_pager_alloc(dev, "weights", weights_bytes, &p), GPU_PAGER_ERROR_REGION_FULL,
           "`weights`");
    if (host) {
        EXPECT(gpu_pager_device(1, &info), GPU_PAGER_ERROR_BACKEND, "device 1");
    }

    /* Out of memory: a region larger than the device, then a resume while a "trainer"
     * region holds the memory. Nothing is lost; the resume succeeds once it is gone. */
    CHECK(gpu_pager_device(dev, &info));
    EXPECT(gpu_pager_region(dev, "too_big", GPU_PAGER_DISCARD, GPU_PAGER_FIXED, (size_t)info.total_bytes * 2,
                            false, NULL),
           GPU_PAGER_ERROR_INVALID_SIZE, "`too_big`");
    CHECK(gpu_pager_release(dev, kv, 1, NULL));
    CHECK(gpu_pager_device(dev, &info));
    size_t hog = (size_t)(info.free_bytes - kv_bytes / 2) / info.granularity * info.granularity;
    CHECK(gpu_pager_region(dev, "trainer", GPU_PAGER_DISCARD, GPU_PAGER_FIXED, hog, false, NULL));
    EXPECT(gpu_pager_resume(dev, kv, 1, NULL), GPU_PAGER_ERROR_OUT_OF_MEMORY, "`kv_cache`");
    CHECK(gpu_pager_remove(dev, "trainer"));
    CHECK(gpu_pager_resume(dev, kv, 1, NULL));

    /* The PyTorch hooks: nothing is placed without a tag. */
    EXPECT(gpu_pager_use_tag(dev, "nope"), GPU_PAGER_ERROR_UNKNOWN_TAG, "`nope`");
    gpu_pager_clear_error();
    if (gpu_pager_torch_malloc(4096, dev, NULL) != NULL) {
        fprintf(stderr, "torch_malloc without a tag returned memory\n");
        failures++;
    }
    expect_(gpu_pager_last_error_code(), GPU_PAGER_ERROR_INVALID_ARGUMENT, "gpu_pager_use_tag",
            "gpu_pager_torch_malloc without a tag", __LINE__);
    CHECK(gpu_pager_use_tag(dev, "kv_cache"));
    void *t = gpu_pager_torch_malloc(4096, dev, NULL);
    if (t == NULL) {
        fprintf(stderr, "torch_malloc: %s\n", gpu_pager_last_error());
        return 1;
    }
    pattern(data, 4096, 7);
    CHECK(gpu_pager_write(dev, (uint64_t)(uintptr_t)t, data, 4096));
    CHECK(gpu_pager_read(dev, (uint64_t)(uintptr_t)t, back, 4096));
    if (memcmp(data, back, 4096) != 0) failures++;
    gpu_pager_clear_error();
    if (gpu_pager_torch_malloc(0, dev, NULL) != NULL) failures++;
    expect_(gpu_pager_last_error_code(), GPU_PAGER_ERROR_INVALID_SIZE, "0 bytes",
            "gpu_pager_torch_malloc(0)", __LINE__);
    gpu_pager_clear_error();
    gpu_pager_torch_free(t, 4096, dev, NULL);
    if (gpu_pager_last_error_code() != GPU_PAGER_OK) failures++;
    gpu_pager_torch_free(t, 4096, dev, NULL); /* twice: an error, nothing freed */
    expect_(gpu_pager_last_error_code(), GPU_PAGER_ERROR_INVALID_ARGUMENT, "freed already",
            "a second gpu_pager_torch_free", __LINE__);
    CHECK(gpu_pager_release(dev, kv, 1, NULL));
    gpu_pager_clear_error();
    if (gpu_pager_torch_malloc(4096, dev, NULL) != NULL) failures++;
    expect_(gpu_pager_last_error_code(), GPU_PAGER_ERROR_NOT_RESIDENT, "`kv_cache`",
            "gpu_pager_torch_malloc in a released region", __LINE__);
    CHECK(gpu_pager_use_tag(dev, NULL));
    gpu_pager_clear_error();
    if (gpu_pager_torch_malloc(4096, dev, NULL) != NULL) failures++;
    expect_(gpu_pager_last_error_code(), GPU_PAGER_ERROR_INVALID_ARGUMENT, "no current tag",
            "gpu_pager_torch_malloc after clearing the tag", __LINE__);

    marks(dev);

    /* Growing regions through the PyTorch hook: small on the host backend. */
    grow(dev, host ? 20 : 300, host ? 96 * 1024 : 48 * MIB);

    for (int i = 0; i < N; i++) CHECK(gpu_pager_free(dev, w[i]));
    EXPECT(gpu_pager_free(dev, w[0]), GPU_PAGER_ERROR_INVALID_ARGUMENT, "freed already");
    CHECK(gpu_pager_remove(dev, "weights"));
    CHECK(gpu_pager_remove(dev, "kv_cache"));
    free(data);
    free(back);
    if (failures) {
        fprintf(stderr, "%d check(s) failed\n", failures);
        return 1;
    }
    printf("ok\n");
    return 0;
}
