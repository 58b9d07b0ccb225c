/*
 * internal.h: what the layers of libfsdp share and users do not see.
 *
 * The context is defined here so that the core can reach a rank's accounting, logging and
 * groups without indirection; nothing outside src/, sim/ and backends/ includes this file.
 */
#ifndef FSDP_INTERNAL_H
#define FSDP_INTERNAL_H

#include <pthread.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include <fsdp.h>

/* Length of every last-error buffer, including the terminating NUL. Messages that list names
 * (the frozen-parameter check lists every FQN of a unit) need room: 512 cut them short. */
#define FSDP_ERR_LEN 2048

/* rc = call; if it failed, jump to label. The label is named at every call site on purpose. */
#define FSDP_TRY(rc, label, call)                                                              \
    do {                                                                                       \
        (rc) = (call);                                                                         \
        if ((rc) < 0) goto label;                                                              \
    } while (0)

#define FSDP_MIN(a, b) ((a) < (b) ? (a) : (b))
#define FSDP_MAX(a, b) ((a) > (b) ? (a) : (b))

struct fsdp_ctx {
    int rank;
    int world_size;
    fsdp_rng_t rng;
    _Atomic int log_level;       /* fsdp_log_level_t */
    pthread_mutex_t log_mu;      /* guards sink, sink_user, nwarn and last_warn */
    fsdp_log_sink_fn sink;
    void *sink_user;
    uint64_t nwarn;              /* warnings logged, whatever the level (fsdp_ctx_warnings) */
    char last_warn[1024];
    /* Memory accounting; atomics because a rank's comm thread allocates too. */
    _Atomic size_t mem_current[FSDP_MEM_NCAT];
    _Atomic size_t mem_peak[FSDP_MEM_NCAT];
    _Atomic size_t mem_total;
    _Atomic size_t mem_total_peak;
    _Atomic size_t mem_allocs;
    /* Borrowed world group and store (set by whoever created the rank: the sim runner). */
    fsdp_pg_t *pg;
    fsdp_store_t *store;
    /* A store the context owns (fsdp_init_from_env), freed after its groups. */
    fsdp_store_t *store_owned;
    void (*store_destroy)(fsdp_store_t *store);
    /* Every live process group of this rank, so that destroy can reclaim forgotten ones. */
    pthread_mutex_t groups_mu;
    fsdp_pg_t *groups;
    /* The Gloo backend's worker for this rank, shared by the rank's Gloo groups: created with
     * the first and freed with the last (backends/gloo/gloo_pg.c); guarded by groups_mu. */
    struct fsdp__gloo_rank *gloo;
    /* Layers above the core hang their per-rank state here; the core frees each through the
     * destructor stored beside it, so it never calls upward by name. */
    struct fsdp_device *dev;         /* default device (borrowed unless == dev_owned) */
    struct fsdp_device *dev_owned;   /* the CPU device created on first use */
    void (*dev_destroy)(struct fsdp_device *dev);
    struct fsdp_tape *tape;          /* autograd tape of this rank */
    void (*tape_destroy)(struct fsdp_tape *tape);
    struct fsdp__rank *fsdp;         /* FSDP units of this rank (src/fsdp) */
    void (*fsdp_destroy)(struct fsdp__rank *state);
    char err[FSDP_ERR_LEN];
};

/* Formats into an error buffer of FSDP_ERR_LEN bytes and returns rc, so a failing path can be
 * `return fsdp__err(buf, FSDP_EINVAL, "...")`. */
int fsdp__verr(char *buf, int rc, const char *fmt, va_list ap);
int fsdp__err(char *buf, int rc, const char *fmt, ...) FSDP_PRINTF(3, 4);

/* Same, on a context's last error (ctx may be NULL: the message is only logged). */
int fsdp__ctx_err(fsdp_ctx_t *ctx, int rc, const char *fmt, ...) FSDP_PRINTF(3, 4);

/* A growable string for messages that list names. fsdp__sb_add appends (printf-style); after an
 * allocation failure it stops appending and sets oom. Zero-initialize; fsdp__sb_free releases. */
typedef struct fsdp__sbuf {
    char *s;
    size_t n, cap;
    bool oom;
} fsdp__sbuf_t;
void fsdp__sb_add(fsdp__sbuf_t *b, const char *fmt, ...) FSDP_PRINTF(2, 3);
/* The text so far ("" when empty or after an allocation failure). */
const char *fsdp__sb_str(const fsdp__sbuf_t *b);
void fsdp__sb_free(fsdp__sbuf_t *b);

/* Converts n elements of es bytes between little-endian (the file formats') and host order, in
 * place: a no-op on little-endian hosts, a byte reversal per element otherwise. */
void fsdp__swap_le(void *buf, size_t n, size_t es);

/* Attaches the borrowed world group and store of a rank (sim runner, init-from-env). */
void fsdp__ctx_attach(fsdp_ctx_t *ctx, fsdp_pg_t *pg, fsdp_store_t *store);

/* Registration of process groups on their context (pg.c calls these). */
void fsdp__ctx_add_group(fsdp_ctx_t *ctx, fsdp_pg_t *pg);
void fsdp__ctx_remove_group(fsdp_ctx_t *ctx, fsdp_pg_t *pg);

/* Destroys every group still registered on ctx (waiting for their outstanding works). With a
 * non-NULL `why`, each one other than the world group is reported as a warning. */
void fsdp__ctx_destroy_groups(fsdp_ctx_t *ctx, const char *why);

#endif /* FSDP_INTERNAL_H */
