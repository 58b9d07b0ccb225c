/* SPDX-License-Identifier: MIT */
/*
 * consumer.c: a program built against the installed libfsdp through pkg-config by
 * "make installcheck" (and so by "make distcheck"): the headers, the library and fsdp.pc work
 * outside the build tree.
 */
#define _POSIX_C_SOURCE 200809L /* setenv */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <fsdp.h>

static int rank_main(fsdp_ctx_t *ctx, void *arg) {
    (void)arg;
    fsdp_pg_t *pg = fsdp_ctx_pg(ctx);
    float x = (float)(fsdp_pg_rank(pg) + 1), sum = 0;
    int rc = fsdp_pg_all_reduce(pg, &x, &sum, 1, FSDP_DTYPE_F32, FSDP_REDOP_SUM, NULL);
    return rc == FSDP_OK && sum == 6.0f ? FSDP_OK : FSDP_EINTERNAL;
}

/* A one-rank Gloo world, when the library has the backend: the installed library finds libgloo
 * and the C++ runtime. */
static int gloo_alone(void) {
    if (!fsdp_gloo_available()) {
        printf("installed libfsdp: built without Gloo\n");
        return FSDP_OK;
    }
    fsdp_ctx_t *ctx = NULL;
    fsdp_store_t *store = NULL;
    fsdp_pg_t *pg = NULL;
    float x = 2.0f, y = 0.0f;
    int rc = fsdp_ctx_create(NULL, &ctx);
    if (rc == FSDP_OK) rc = fsdp_store_create_memory(NULL, &store);
    if (rc == FSDP_OK) rc = fsdp_pg_create_gloo(ctx, store, NULL, &pg);
    if (rc == FSDP_OK) rc = fsdp_pg_all_reduce(pg, &x, &y, 1, FSDP_DTYPE_F32, FSDP_REDOP_SUM, NULL);
    if (rc == FSDP_OK && y != 2.0f) rc = FSDP_EINTERNAL;
    printf("installed libfsdp: gloo all_reduce over 1 rank: %s\n", fsdp_err_name(rc));
    fsdp_pg_destroy(pg);
    fsdp_ctx_destroy(ctx);
    fsdp_store_destroy(store);
    return rc;
}

/* The parts that need jansson (the safetensors reader) and hiredis (the Redis store), so that
 * the static link pulls them in: a missing file and a port nothing listens on are clean
 * errors (or FSDP_ENOTSUP in a build without hiredis). */
static int json_and_redis(void) {
    fsdp_safetensors_t *st = NULL;
    int rs = fsdp_safetensors_open(NULL, "/nonexistent/consumer.safetensors", &st);
    fsdp_store_t *store = NULL;
    int rr = fsdp_store_create_redis(NULL, "127.0.0.1", 1, NULL, &store);
    if (rr == FSDP_OK) { /* it connects on first use */
        fsdp_store_set_timeout(store, 300);
        rr = fsdp_store_set(store, "consumer", "1", 1);
    }
    printf("installed libfsdp: safetensors of a missing file: %s; Redis on port 1: %s\n",
           fsdp_err_name(rs), fsdp_err_name(rr));
    fsdp_safetensors_close(st);
    fsdp_store_destroy(store);
    return rs < 0 && rr < 0 ? FSDP_OK : FSDP_EINTERNAL;
}

/* The CUDA device through the installed plugin (libfsdp-cuda.so in $(pkglibdir)), with no GPU
 * visible: a CUDA build must find and load the plugin, whose own error then says that no device
 * is visible; a build without CUDA says the device is not built in. */
static int cuda_plugin(void) {
    setenv("CUDA_VISIBLE_DEVICES", "", 1);
    fsdp_ctx_t *ctx = NULL;
    fsdp_device_t *dev = NULL;
    int rc = fsdp_ctx_create(NULL, &ctx);
    if (rc != FSDP_OK) return rc;
    rc = fsdp_device_create(ctx, FSDP_DEVICE_CUDA, NULL, &dev);
    const char *msg = fsdp_ctx_last_error(ctx);
    int ok = rc == FSDP_ENOTSUP && (strstr(msg, "no CUDA device is visible") ||
                                    strstr(msg, "not built into this libfsdp"));
    printf("installed libfsdp: CUDA device with no GPU visible: %s: %s\n", fsdp_err_name(rc), msg);
    fsdp_device_destroy(dev);
    fsdp_ctx_destroy(ctx);
    return ok ? FSDP_OK : FSDP_EINTERNAL;
}

int main(void) {
    if (strcmp(fsdp_version_string(), FSDP_VERSION_STRING) != 0) {
        fprintf(stderr, "header version %s, library %s\n", FSDP_VERSION_STRING,
                fsdp_version_string());
        return 1;
    }
    fsdp_sim_options_t opts;
    fsdp_sim_options_init(&opts);
    opts.world_size = 3;
    int rc = fsdp_sim_run(&opts, rank_main, NULL, NULL);
    printf("installed libfsdp %s: sim all_reduce over 3 ranks: %s\n", fsdp_version_string(),
           fsdp_err_name(rc));
    if (rc != FSDP_OK) return 1;
    if (gloo_alone() != FSDP_OK) return 1;
    if (json_and_redis() != FSDP_OK) return 1;
    /* Linked statically (make installcheck's second build), the program cannot use the CUDA
     * plugin, which links libfsdp.so: a second copy of the library would serve it. */
    if (getenv("CONSUMER_STATIC")) {
        printf("installed libfsdp, linked statically: the CUDA plugin is not tried\n");
        return 0;
    }
    return cuda_plugin() == FSDP_OK ? 0 : 1;
}
