/* SPDX-License-Identifier: MIT */
/*
 * init_env.c: fsdp_init_from_env, a rank made from its launch environment (fsdp/launch.h).
 *
 * It sits in the launch layer, above the process groups and their backends, because it ties
 * them together: the launch environment (launch_env.c), a store (src/store) and the world group
 * of the backend that FSDP_BACKEND names, chosen from the table of backends below: adding a
 * backend adds an entry here and touches no lower layer.
 *
 * The store, in order of precedence: FSDP_STORE (any store URL); else MASTER_ADDR and
 * MASTER_PORT, as PyTorch's env:// (rank 0 serves the TCP store on MASTER_ADDR:MASTER_PORT in a
 * thread of its own, owned by its context, and every rank connects to it); else, for a world of
 * one, an in-memory store. URLs reach messages only through fsdp__store_url_redact.
 */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <fsdp/gloo.h>
#include <fsdp/launch.h>
#include <fsdp/nccl.h>
#include <fsdp/pg.h>
#include <fsdp/store.h>

#include "internal.h"
#include "store/store_impl.h"
#include "store/store_url.h"

static const fsdp__abi_struct_t init_options_abi =
    FSDP__ABI_STRUCT(fsdp_init_options_t, "fsdp_init_options_init", timeout_ms);

void(fsdp_init_options_init)(fsdp_init_options_t *o, size_t size) {
    fsdp_init_options_t d;
    memset(&d, 0, sizeof d);
    d.log_level = -1;
    fsdp__abi_init(o, size, &d, &init_options_abi);
}

/* Logs the message on ctx (NULL: stderr), copies it to msg, and returns rc. */
static int init_fail(fsdp_ctx_t *ctx, char *msg, size_t cap, int rc, const char *fmt, ...)
    FSDP_PRINTF(5, 6);
static int init_fail(fsdp_ctx_t *ctx, char *msg, size_t cap, int rc, const char *fmt, ...) {
    char buf[FSDP_ERR_LEN];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    /* Once: to the caller who asked for the text, else to the log. */
    if (msg && cap)
        snprintf(msg, cap, "%s", buf);
    else
        fsdp_log(ctx, FSDP_LOG_ERROR, "%s", buf);
    return rc;
}

/* $FSDP_TIMEOUT_MS as a positive number of milliseconds; 0 when unset; -1 when malformed. */
static int64_t env_timeout(void) {
    const char *v = getenv("FSDP_TIMEOUT_MS");
    if (!v || !*v) return 0;
    char *end = NULL;
    errno = 0;
    long long t = strtoll(v, &end, 10);
    if (errno || *end || t <= 0) return -1;
    return (int64_t)t;
}

/* Makes the world group of a backend over the store. */
typedef int (*world_fn)(fsdp_ctx_t *ctx, fsdp_store_t *store, int64_t timeout_ms, fsdp_pg_t **pg);

static int world_gloo(fsdp_ctx_t *ctx, fsdp_store_t *store, int64_t timeout_ms, fsdp_pg_t **pg) {
    fsdp_gloo_options_t go;
    fsdp_gloo_options_init(&go);
    go.timeout_ms = timeout_ms;
    return fsdp_pg_create_gloo(ctx, store, &go, pg);
}

static int world_nccl(fsdp_ctx_t *ctx, fsdp_store_t *store, int64_t timeout_ms, fsdp_pg_t **pg) {
    /* The device comes from LOCAL_RANK, which the launchers set (fsdp/nccl.h). */
    fsdp_nccl_options_t no;
    fsdp_nccl_options_init(&no);
    no.timeout_ms = timeout_ms;
    return fsdp_pg_create_nccl(ctx, store, &no, pg);
}

/* The backends of FSDP_BACKEND. `refusal` explains a name that is known but cannot make a world
 * group of processes; `label` prefixes the failure of one that can. */
static const struct {
    const char *name;
    world_fn create;
    const char *label;
    const char *refusal;
} backends[] = {
    {"gloo", world_gloo, "", NULL},
    {"nccl", world_nccl, "FSDP_BACKEND=nccl: ", NULL},
    {"sim", NULL, NULL,
     "the sim backend runs ranks as threads of one process (fsdp_sim_run); processes use gloo"},
};

/* $MASTER_ADDR and $MASTER_PORT: 1 when both are set (port checked), 0 when neither is, or a
 * negative code with the message written (a half-set pair, a bad port). */
static int env_master(fsdp_ctx_t *ctx, int rank, char *msg, size_t cap, const char **addr,
                      int *port) {
    const char *a = getenv("MASTER_ADDR"), *p = getenv("MASTER_PORT");
    if (a && !*a) a = NULL;
    if (p && !*p) p = NULL;
    if (!a && !p) return 0;
    if (!a || !p)
        return init_fail(ctx, msg, cap, FSDP_EINVAL,
                         "fsdp_init_from_env: rank %d: %s is set but %s is not; set both (the "
                         "address and port where rank 0 serves the store) or neither",
                         rank, a ? "MASTER_ADDR" : "MASTER_PORT",
                         a ? "MASTER_PORT" : "MASTER_ADDR");
    char *end = NULL;
    errno = 0;
    long v = strtol(p, &end, 10);
    if (errno || *end || v < 1 || v > 65535 || !(*p >= '0' && *p <= '9'))
        return init_fail(ctx, msg, cap, FSDP_EINVAL,
                         "fsdp_init_from_env: rank %d: MASTER_PORT='%.32s' is not a port in "
                         "1..65535",
                         rank, p);
    *addr = a;
    *port = (int)v;
    return 1;
}

int fsdp_init_from_env(const fsdp_init_options_t *o, fsdp_ctx_t **out, char *msg, size_t msg_cap) {
    if (msg && msg_cap) msg[0] = 0;
    if (!out) return init_fail(NULL, msg, msg_cap, FSDP_EINVAL, "fsdp_init_from_env: out is NULL");
    *out = NULL;
    char why[FSDP_ERR_LEN];
    int rc = fsdp__abi_check_buf(why, "fsdp_init_from_env", "o", o, &init_options_abi);
    if (rc < 0) return init_fail(NULL, msg, msg_cap, rc, "%s", why);
    fsdp_init_options_t def;
    if (!o) {
        fsdp_init_options_init(&def);
        o = &def;
    }
    fsdp_launch_env_t env;
    rc = fsdp_launch_env_read(&env, why, sizeof why);
    if (rc < 0)
        return init_fail(NULL, msg, msg_cap, rc, "fsdp_init_from_env: launch environment: %s", why);
    int64_t timeout = o->timeout_ms;
    if (timeout < 0)
        return init_fail(NULL, msg, msg_cap, FSDP_EINVAL,
                         "fsdp_init_from_env: options.timeout_ms is %lld; it must be >= 0",
                         (long long)timeout);
    if (timeout == 0) timeout = env_timeout();
    if (timeout < 0)
        return init_fail(NULL, msg, msg_cap, FSDP_EINVAL,
                         "fsdp_init_from_env: FSDP_TIMEOUT_MS='%s' is not a positive number of "
                         "milliseconds",
                         getenv("FSDP_TIMEOUT_MS"));
    if (timeout == 0) timeout = FSDP_PG_DEFAULT_TIMEOUT_MS;

    fsdp_ctx_options_t co;
    fsdp_ctx_options_init(&co);
    co.rank = env.rank;
    co.world_size = env.world_size;
    co.seed = o->seed;
    co.log_level = o->log_level;
    fsdp_ctx_t *ctx = NULL;
    if ((rc = fsdp_ctx_create(&co, &ctx)) < 0)
        return init_fail(NULL, msg, msg_cap, rc, "fsdp_init_from_env: rank %d of %d: %s", env.rank,
                         env.world_size, fsdp_strerror(rc));

    /* The store: FSDP_STORE, else MASTER_ADDR/MASTER_PORT, else memory for a world of one. */
    fsdp_store_t *store = NULL;
    const char *maddr = NULL;
    int mport = 0;
    char shown[600]; /* the store's URL as messages show it (no password) */
    fsdp__store_url_redact(env.store_url[0] ? env.store_url : "memory:", shown, sizeof shown);
    if (env.store_url[0]) {
        if ((rc = fsdp_store_open_url(ctx, env.store_url, &store)) < 0) {
            init_fail(ctx, msg, msg_cap, rc, "fsdp_init_from_env: rank %d: FSDP_STORE='%s': %s",
                      env.rank, shown, fsdp_ctx_last_error(ctx));
            goto fail;
        }
    } else if ((rc = env_master(ctx, env.rank, msg, msg_cap, &maddr, &mport)) < 0) {
        goto fail;
    } else if (rc == 1) {
        snprintf(shown, sizeof shown, strchr(maddr, ':') ? "tcp://[%s]:%d" : "tcp://%s:%d", maddr,
                 mport);
        /* Rank 0 listens on MASTER_ADDR itself, not on every interface: the store has no
         * authentication, and the address is the one the other ranks were told to reach. */
        rc = env.rank == 0 ? fsdp__store_tcp_serve(ctx, maddr, maddr, mport, &store)
                           : fsdp_store_create_tcp(ctx, maddr, mport, NULL, &store);
        if (rc < 0) {
            init_fail(ctx, msg, msg_cap, rc,
                      "fsdp_init_from_env: rank %d: %s the TCP store of MASTER_ADDR=%s "
                      "MASTER_PORT=%d: %s",
                      env.rank, env.rank == 0 ? "cannot serve" : "cannot open", maddr, mport,
                      fsdp_ctx_last_error(ctx));
            goto fail;
        }
    } else if (env.world_size == 1) {
        if ((rc = fsdp_store_create_memory(ctx, &store)) < 0) {
            init_fail(ctx, msg, msg_cap, rc, "fsdp_init_from_env: out of memory");
            goto fail;
        }
    } else {
        rc = init_fail(ctx, msg, msg_cap, FSDP_EINVAL,
                       "fsdp_init_from_env: rank %d of %d: neither FSDP_STORE nor MASTER_ADDR and "
                       "MASTER_PORT is set; ranks of several processes meet through a shared "
                       "store (FSDP_STORE=file:///dir, redis://host:port or tcp://host:port; or "
                       "MASTER_ADDR/MASTER_PORT, where rank 0 serves one; fsdprun sets them)",
                       env.rank, env.world_size);
        goto fail;
    }
    if ((rc = fsdp_store_set_timeout(store, timeout)) < 0) {
        init_fail(ctx, msg, msg_cap, rc, "fsdp_init_from_env: store timeout: %s",
                  fsdp_store_last_error(store));
        goto fail;
    }
    ctx->store_owned = store;
    ctx->store_destroy = fsdp_store_destroy;

    /* The world group. */
    fsdp_pg_t *pg = NULL;
    size_t b = 0, nb = sizeof backends / sizeof backends[0];
    while (b < nb && strcmp(env.backend, backends[b].name) != 0)
        b++;
    if (b == nb) {
        rc = init_fail(ctx, msg, msg_cap, FSDP_EINVAL,
                       "fsdp_init_from_env: FSDP_BACKEND='%s' is not a backend this build has "
                       "(gloo%s)",
                       env.backend, fsdp_nccl_available() ? ", nccl" : "");
        goto fail;
    }
    if (!backends[b].create) {
        rc = init_fail(ctx, msg, msg_cap, FSDP_EINVAL, "fsdp_init_from_env: FSDP_BACKEND=%s: %s",
                       backends[b].name, backends[b].refusal);
        goto fail;
    }
    if ((rc = backends[b].create(ctx, store, timeout, &pg)) < 0) {
        init_fail(ctx, msg, msg_cap, rc,
                  "fsdp_init_from_env: rank %d of %d: %sthe %s world group over '%s': %s", env.rank,
                  env.world_size, backends[b].label, backends[b].name, shown,
                  fsdp_ctx_last_error(ctx));
        goto fail;
    }
    if (fsdp_ctx_pg(ctx) != pg) { /* the group attaches itself to a context without one */
        rc = init_fail(ctx, msg, msg_cap, FSDP_EINTERNAL,
                       "fsdp_init_from_env: the world group did not attach to the context");
        goto fail;
    }
    *out = ctx;
    return FSDP_OK;
fail : {
    bool owned = ctx->store_owned == store;
    fsdp_ctx_destroy(ctx); /* its groups, then the store once it owns it */
    if (!owned) fsdp_store_destroy(store);
    return rc;
}
}
