/* SPDX-License-Identifier: MIT */
/*
 * t_plugin.c: the CUDA plugin as a user program sees it. This program links libfsdp.so only
 * (not the convenience libraries), so every CUDA or NCCL call goes through the plugin that
 * libfsdp opens with dlopen (src/launch/plugin.c).
 *
 * - A sim run and CPU work do not map the CUDA libraries; the resident size is printed.
 * - FSDP_PLUGIN_DIR naming a directory without the plugin gives FSDP_ENOTSUP naming the path
 *   and dlerror()'s text, for a device and for an NCCL group, and loads nothing.
 * - Eight threads reaching CUDA at once (sim ranks are threads) all get today's "no CUDA device
 *   is visible" error through the plugin (CUDA_VISIBLE_DEVICES is emptied, so this holds on a
 *   GPU machine too), and the CUDA libraries are then mapped.
 * - Without CUDA in the build: today's "not built into this libfsdp" message.
 */
#include <config.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <fsdp.h>

#include "tap.h"

#define THREADS 8
#ifdef FSDP_HAVE_NCCL
#define FSDP_HAVE_NCCL_INT 1
#else
#define FSDP_HAVE_NCCL_INT 0
#endif

/* 1 when /proc/self/maps has a mapping whose path contains `name`, 0 if not, -1 unreadable. */
static int mapped(const char *name) {
    FILE *f = fopen("/proc/self/maps", "r");
    if (!f) return -1;
    char line[4096];
    int found = 0;
    while (!found && fgets(line, sizeof line, f)) found = strstr(line, name) != NULL;
    fclose(f);
    return found;
}

/* A field of /proc/self/status in KiB (VmRSS, VmHWM); -1 when absent. */
static long status_kib(const char *field) {
    FILE *f = fopen("/proc/self/status", "r");
    if (!f) return -1;
    char line[256];
    long v = -1;
    size_t n = strlen(field);
    while (fgets(line, sizeof line, f))
        if (strncmp(line, field, n) == 0 && line[n] == ':') v = strtol(line + n + 1, NULL, 10);
    fclose(f);
    return v;
}

static int any_cuda_lib_mapped(void) {
    static const char *const libs[] = {"libcudart", "libcublas", "libcublasLt", "libnccl",
                                       "libfsdp-cuda"};
    for (size_t i = 0; i < sizeof libs / sizeof libs[0]; i++)
        if (mapped(libs[i]) != 0) return 1;
    return 0;
}

/* One step of work on 2 sim ranks: an all_reduce of a gradient-like vector, then an update. */
static int rank_step(fsdp_ctx_t *ctx, void *arg) {
    (void)arg;
    fsdp_pg_t *pg = fsdp_ctx_pg(ctx);
    float g[64], w[64];
    for (int i = 0; i < 64; i++) {
        g[i] = (float)(fsdp_pg_rank(pg) + 1) * (float)i;
        w[i] = 1.0f;
    }
    int rc = fsdp_pg_all_reduce(pg, g, g, 64, FSDP_DTYPE_F32, FSDP_REDOP_AVG, NULL);
    if (rc < 0) return rc;
    for (int i = 0; i < 64; i++) w[i] -= 0.5f * g[i];
    return w[2] == 1.0f - 0.5f * 3.0f ? FSDP_OK : FSDP_EINTERNAL;
}

#ifdef FSDP_HAVE_CUDA
struct racer {
    pthread_t t;
    int rc;
    char msg[1024];
};

static void *race(void *arg) {
    struct racer *r = arg;
    fsdp_ctx_t *ctx = NULL;
    r->rc = fsdp_ctx_create(NULL, &ctx);
    if (r->rc < 0) {
        snprintf(r->msg, sizeof r->msg, "fsdp_ctx_create failed");
        return NULL;
    }
    fsdp_device_t *dev = NULL;
    r->rc = fsdp_device_create(ctx, FSDP_DEVICE_CUDA, NULL, &dev);
    snprintf(r->msg, sizeof r->msg, "%s", fsdp_ctx_last_error(ctx));
    fsdp_device_destroy(dev);
    fsdp_ctx_destroy(ctx);
    return NULL;
}
#endif

int main(void) {
    tap_plan(12);
    /* No GPU for this program, even on a GPU machine: the runtime then reports none. */
    setenv("CUDA_VISIBLE_DEVICES", "", 1);

    fsdp_sim_options_t so;
    fsdp_sim_options_init(&so);
    so.world_size = 2;
    tap_is_int(fsdp_sim_run(&so, rank_step, NULL, NULL), FSDP_OK, "a 2-rank sim step runs");
    tap_is_int(any_cuda_lib_mapped(), 0, "after the sim step no CUDA library is mapped");
    long rss = status_kib("VmRSS"), hwm = status_kib("VmHWM");
    tap_diag("after the sim step: VmRSS %ld KiB, VmHWM %ld KiB", rss, hwm);

    fsdp_ctx_t *ctx = NULL;
    if (fsdp_ctx_create(NULL, &ctx) < 0) tap_bail("fsdp_ctx_create failed");
    fsdp_device_t *dev = NULL;

#ifdef FSDP_HAVE_CUDA
    /* A directory without the plugin. */
    char empty[192];
    tap_tmppath(empty, sizeof empty, "t_plugin_XXXXXX");
    if (!mkdtemp(empty)) tap_bail("mkdtemp failed");
    const char *saved = getenv("FSDP_PLUGIN_DIR");
    char *saved_copy = saved ? strdup(saved) : NULL;
    setenv("FSDP_PLUGIN_DIR", empty, 1);
    int rc = fsdp_device_create(ctx, FSDP_DEVICE_CUDA, NULL, &dev);
    const char *msg = fsdp_ctx_last_error(ctx);
    tap_ok(rc == FSDP_ENOTSUP && dev == NULL, "missing plugin: fsdp_device_create gives "
           "FSDP_ENOTSUP (got %s) and no device", fsdp_err_name(rc));
    char path[512];
    snprintf(path, sizeof path, "%s/libfsdp-cuda.so", empty);
    tap_ok(strstr(msg, path) && strstr(msg, "cannot open shared object file") &&
               strstr(msg, "FSDP_PLUGIN_DIR"),
           "the message names the path and dlerror's text: %s", msg);
    fsdp_store_t *store = NULL;
    fsdp_pg_t *pg = NULL;
    if (fsdp_store_create_memory(NULL, &store) < 0) tap_bail("fsdp_store_create_memory failed");
    rc = fsdp_pg_create_nccl(ctx, store, NULL, &pg);
    msg = fsdp_ctx_last_error(ctx);
    tap_ok(rc == FSDP_ENOTSUP && pg == NULL && strstr(msg, "fsdp_pg_create_nccl") &&
               strstr(msg, path),
           "missing plugin: fsdp_pg_create_nccl gives FSDP_ENOTSUP (got %s): %s",
           fsdp_err_name(rc), msg);
    tap_is_int(any_cuda_lib_mapped(), 0, "a failed load leaves no CUDA library mapped");
    tap_ok(fsdp_nccl_device(NULL) == -1 && fsdp_nccl_available() == FSDP_HAVE_NCCL_INT &&
               any_cuda_lib_mapped() == 0,
           "fsdp_nccl_device(NULL) is -1 and fsdp_nccl_available() %d: neither loads anything",
           FSDP_HAVE_NCCL_INT);
    rmdir(empty);

    /* The plugin where libfsdp finds it by itself (beside it in the build tree, or installed). */
    unsetenv("FSDP_PLUGIN_DIR");
    struct racer r[THREADS];
    memset(r, 0, sizeof r);
    for (int i = 0; i < THREADS; i++)
        if (pthread_create(&r[i].t, NULL, race, &r[i]) != 0) tap_bail("pthread_create failed");
    int all = 1;
    for (int i = 0; i < THREADS; i++) {
        pthread_join(r[i].t, NULL);
        if (r[i].rc != FSDP_ENOTSUP || !strstr(r[i].msg, "no CUDA device is visible")) {
            all = 0;
            tap_diag("thread %d: %s: %s", i, fsdp_err_name(r[i].rc), r[i].msg);
        }
    }
    tap_ok(all, "%d threads loading the plugin at once all get FSDP_ENOTSUP \"no CUDA device is "
           "visible\" (%s)", THREADS, r[0].msg);
    tap_ok(mapped("libfsdp-cuda") == 1 && mapped("libcublas") == 1,
           "the plugin and cuBLAS are now mapped");
    long rss2 = status_kib("VmRSS");
    tap_diag("with the plugin loaded: VmRSS %ld KiB (%ld KiB more than after the sim step)", rss2,
             rss2 - rss);
    rc = fsdp_pg_create_nccl(ctx, store, NULL, &pg);
    msg = fsdp_ctx_last_error(ctx);
#ifdef FSDP_HAVE_NCCL
    tap_ok(rc == FSDP_ENOTSUP && pg == NULL && strstr(msg, "no CUDA device is visible"),
           "fsdp_pg_create_nccl through the plugin: %s: %s", fsdp_err_name(rc), msg);
#else
    tap_ok(rc == FSDP_ENOTSUP && pg == NULL, "fsdp_pg_create_nccl without NCCL: %s", msg);
#endif
    tap_is_int(fsdp_nccl_device(pg), -1, "fsdp_nccl_device of no group, plugin loaded");
    tap_ok(rss2 > rss, "loading the plugin costs resident memory (%ld KiB before, %ld after)", rss,
           rss2);
    if (saved_copy) setenv("FSDP_PLUGIN_DIR", saved_copy, 1);
    free(saved_copy);
    fsdp_store_destroy(store);
#else
    int rc = fsdp_device_create(ctx, FSDP_DEVICE_CUDA, NULL, &dev);
    tap_ok(rc == FSDP_ENOTSUP && dev == NULL &&
               strstr(fsdp_ctx_last_error(ctx), "not built into this libfsdp"),
           "without CUDA: %s", fsdp_ctx_last_error(ctx));
    tap_skip(9, "libfsdp was built without CUDA: there is no plugin");
#endif
    fsdp_ctx_destroy(ctx);
    return tap_done();
}
