/* SPDX-License-Identifier: MIT */
/*
 * plugin.c: finds, opens and checks the CUDA plugin (libfsdp-cuda.so, see
 * backends/plugin_abi.h).
 *
 * Where it looks: $FSDP_PLUGIN_DIR alone when it is set and not empty; else beside libfsdp
 * itself when libfsdp was loaded from a libtool build tree (a directory named .libs, where the
 * freshly built plugin lies too), or else in the directory named after the package beside it
 * (<dir of libfsdp.so>/libfsdp/, where a default install puts the plugin: an install that was
 * moved elsewhere, or the GPU bundle of tools/gpu-bundle.sh, still finds its own plugin); then
 * the install directory compiled in (FSDP_PLUGIN_LIBDIR, $(pkglibdir)). A program that has the
 * plugin's table linked in (fsdp__cuda_plugin, a weak reference) uses it and opens nothing.
 *
 * Invariants: `loaded` goes from NULL to a checked table once and never back (the plugin is
 * never closed: devices and groups point into it); loads are serialized by load_mu, so sim ranks
 * that reach CUDA together open it once; a failed load leaves nothing behind and is tried again
 * by the next caller (FSDP_PLUGIN_DIR may have been fixed meanwhile).
 */
#define _GNU_SOURCE /* dladdr */
#include <config.h>

#include <dlfcn.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "device/device_impl.h"
#include "launch/plugin.h"
#include "pg/pg_impl.h"

/* Defined only when the plugin's code is linked in statically (see Makefile.am). */
extern const struct fsdp_plugin fsdp__cuda_plugin __attribute__((weak, visibility("hidden")));

static pthread_mutex_t load_mu = PTHREAD_MUTEX_INITIALIZER;
static _Atomic(const struct fsdp_plugin *) loaded;

/* The core's internal functions the plugin calls (struct fsdp_plugin_core). */
static const struct fsdp_plugin_core core_table = {
    .abi = FSDP_PLUGIN_ABI,
    .size = sizeof(struct fsdp_plugin_core),
    .ctx_err = fsdp__ctx_err,
    .ctx_attach = fsdp__ctx_attach,
    .gemm_check = fsdp__gemm_check,
    .pg_init = fsdp__pg_init,
    .pg_fini = fsdp__pg_fini,
    .pg_err = fsdp__pg_err,
    .work_complete = fsdp__work_complete,
    .coll_describe = fsdp__coll_describe,
    .shared_acquire = fsdp__ctx_shared_acquire,
    .shared_release = fsdp__ctx_shared_release,
};

const struct fsdp_plugin *fsdp__plugin_loaded(void) {
    return atomic_load_explicit(&loaded, memory_order_acquire);
}

/* Appends "; " (when not first) and a formatted piece to the message of paths tried. */
static void tried_add(char *buf, size_t cap, const char *fmt, const char *a, const char *b) {
    size_t n = strlen(buf);
    if (n + 3 >= cap) return;
    if (n > 0) {
        memcpy(buf + n, "; ", 3);
        n += 2;
    }
    snprintf(buf + n, cap - n, fmt, a, b);
}

/* Checks a plugin's table against this libfsdp; on a mismatch *why says how they differ. */
static int check_table(const struct fsdp_plugin *p, char *why, size_t cap) {
    if (!p) {
        snprintf(why, cap, "it refused this libfsdp's core table (ABI %d)", FSDP_PLUGIN_ABI);
        return -1;
    }
    if (p->abi != FSDP_PLUGIN_ABI || p->size < sizeof *p || !p->version ||
        strcmp(p->version, PACKAGE_VERSION) != 0) {
        snprintf(why, cap,
                 "it is a plugin of libfsdp %s (plugin ABI %u), but this libfsdp is %s "
                 "(plugin ABI %d); install the plugin built with this libfsdp",
                 p->version ? p->version : "(unknown)", (unsigned)p->abi, PACKAGE_VERSION,
                 FSDP_PLUGIN_ABI);
        return -1;
    }
    return 0;
}

/* Tries dir/libfsdp-cuda.so: on success *out is its checked table; on failure the reason is
 * appended to `tried`. */
static int try_dir(const char *dir, char *tried, size_t cap, const struct fsdp_plugin **out) {
    char path[4096];
    int n = snprintf(path, sizeof path, "%s/%s", dir, FSDP_PLUGIN_FILE);
    if (n < 0 || (size_t)n >= sizeof path) {
        tried_add(tried, cap, "%s/%s: path too long", dir, FSDP_PLUGIN_FILE);
        return -1;
    }
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        const char *e = dlerror();
        tried_add(tried, cap, "dlopen(%s): %s", path, e ? e : "unknown error");
        return -1;
    }
    fsdp_plugin_entry_fn entry;
    void *sym = dlsym(h, FSDP_PLUGIN_ENTRY);
    if (!sym) {
        const char *e = dlerror();
        tried_add(tried, cap, "%s: not a libfsdp plugin of this version (%s)", path,
                  e ? e : FSDP_PLUGIN_ENTRY " not found");
        dlclose(h);
        return -1;
    }
    /* POSIX's way from an object pointer to a function pointer. */
    memcpy(&entry, &sym, sizeof entry);
    char why[512];
    const struct fsdp_plugin *p = entry(&core_table);
    if (check_table(p, why, sizeof why) < 0) {
        tried_add(tried, cap, "%s: %s", path, why);
        dlclose(h);
        return -1;
    }
    *out = p;
    return 0;
}

/* The directory libfsdp was loaded from, made absolute (it may have been loaded through a
 * relative LD_LIBRARY_PATH entry, and the cwd may change); *libtool is set when that directory
 * is a libtool build tree's .libs. */
static int libfsdp_dir(char *buf, size_t cap, bool *libtool) {
    Dl_info info;
    if (!dladdr((void *)&core_table, &info) || !info.dli_fname) return -1;
    const char *slash = strrchr(info.dli_fname, '/');
    if (!slash) return -1;
    size_t len = (size_t)(slash - info.dli_fname);
    if (len >= cap) return -1;
    *libtool = len >= 5 && memcmp(slash - 5, ".libs", 5) == 0 && (len == 5 || slash[-6] == '/');
    memcpy(buf, info.dli_fname, len);
    buf[len] = '\0';
    char *abs = realpath(len ? buf : "/", NULL);
    if (!abs) return -1;
    size_t alen = strlen(abs);
    if (alen >= cap) {
        free(abs);
        return -1;
    }
    memcpy(buf, abs, alen + 1);
    free(abs);
    return 0;
}

static int load_locked(char *tried, size_t cap, const struct fsdp_plugin **out) {
    if (&fsdp__cuda_plugin != NULL) {
        char why[512];
        if (check_table(&fsdp__cuda_plugin, why, sizeof why) < 0) {
            tried_add(tried, cap, "%s: %s", "the plugin linked into this program", why);
            return -1;
        }
        *out = &fsdp__cuda_plugin;
        return 0;
    }
    const char *env = getenv(FSDP_PLUGIN_DIR_ENV);
    if (env && *env) return try_dir(env, tried, cap, out);
    char dir[4096];
    bool libtool = false;
    if (libfsdp_dir(dir, sizeof dir, &libtool) == 0) {
        /* A build tree's .libs holds the plugin itself; an install keeps it one level down. */
        size_t n = strlen(dir);
        bool fits = libtool || n + sizeof "/" PACKAGE <= sizeof dir;
        if (fits && !libtool) memcpy(dir + n, "/" PACKAGE, sizeof "/" PACKAGE);
        if (fits && strcmp(dir, FSDP_PLUGIN_LIBDIR) != 0 && try_dir(dir, tried, cap, out) == 0)
            return 0;
    }
    return try_dir(FSDP_PLUGIN_LIBDIR, tried, cap, out);
}

int fsdp__plugin_get(fsdp_ctx_t *ctx, const char *who, const struct fsdp_plugin **out) {
    const struct fsdp_plugin *p = fsdp__plugin_loaded();
    if (p) {
        *out = p;
        return FSDP_OK;
    }
    char tried[1536] = "";
    pthread_mutex_lock(&load_mu);
    p = atomic_load_explicit(&loaded, memory_order_acquire);
    int rc = p ? 0 : load_locked(tried, sizeof tried, &p);
    if (rc == 0) atomic_store_explicit(&loaded, p, memory_order_release);
    pthread_mutex_unlock(&load_mu);
    if (rc < 0) {
        *out = NULL;
        return fsdp__ctx_err(ctx, FSDP_ENOTSUP,
                             "%s: the CUDA plugin %s could not be loaded (%s); set %s to the "
                             "directory that holds it",
                             who, FSDP_PLUGIN_FILE, tried, FSDP_PLUGIN_DIR_ENV);
    }
    fsdp_log(ctx, FSDP_LOG_DEBUG, "%s: CUDA plugin of libfsdp %s loaded", who, p->version);
    *out = p;
    return FSDP_OK;
}
