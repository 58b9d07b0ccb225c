/* SPDX-License-Identifier: MIT */
/*
 * internal.h: what the layers of libfsdp share and users do not see.
 *
 * The context is defined here so that the core can reach a rank's accounting and logging
 * without indirection; nothing outside src/, sim/ and backends/ includes this file. It is the
 * core's header: it includes the core's public headers only, and the context knows the layers
 * above it only as opaque pointers with the destructors they registered (docs/design.md,
 * "Layers").
 */
#ifndef FSDP_INTERNAL_H
#define FSDP_INTERNAL_H

#include <pthread.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include <fsdp/context.h>
#include <fsdp/dtype.h>
#include <fsdp/errno.h>
#include <fsdp/export.h>
#include <fsdp/log.h>
#include <fsdp/mem.h>
#include <fsdp/redop.h>
#include <fsdp/rng.h>
#include <fsdp/version.h>

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

/* An object that a rank's context destroys when the rank forgets it: a process group registers
 * one (embedded in it) when created and unregisters it when destroyed. */
struct fsdp__ctx_child {
    struct fsdp__ctx_child *next;
    void *obj;                   /* the object, compared with the world group (ctx->pg) */
    const char *what;            /* "process group", for the warning */
    const char *name;            /* the object's name, for the warning */
    void (*destroy)(void *obj);  /* unregisters the child itself */
};

/* Per-rank state that several objects of a layer above the core share (the Gloo worker of a
 * rank's Gloo groups, the NCCL groups' ordering state), found by a key of that layer. */
struct fsdp__ctx_shared {
    struct fsdp__ctx_shared *next;
    const void *key;
    void *obj;
    int refs;
};

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
    /* Every live child of this rank (its process groups), so that destroy can reclaim forgotten
     * ones, and the shared per-rank states; both guarded by children_mu. */
    pthread_mutex_t children_mu;
    struct fsdp__ctx_child *children;
    struct fsdp__ctx_shared *shared;
    /* The memory category that new tensors are counted in: activations, or gradients while the
     * rank runs backward (set by the autograd engine, read by the tensor layer). */
    _Atomic int tensor_mem_cat; /* fsdp_mem_category_t */
    /* Layers above the core hang their per-rank state here; the core frees each through the
     * destructor stored beside it, so it never calls upward by name. */
    struct fsdp_device *dev;         /* default device (borrowed unless == dev_owned) */
    struct fsdp_device *dev_owned;   /* the CPU device created on first use */
    void (*dev_destroy)(struct fsdp_device *dev);
    struct fsdp_tape *tape;          /* autograd tape of this rank */
    void (*tape_destroy)(struct fsdp_tape *tape);
    struct fsdp__rank *fsdp;         /* FSDP units of this rank (src/fsdp) */
    void (*fsdp_destroy)(struct fsdp__rank *state);
    /* Trace recording (src/core/trace.c): the lane of a recorder this rank records into, NULL
     * while tracing is off (the one pointer every recording point tests, see core/trace.h), and
     * the lock that fsdp_trace_start/stop and every recording hold, so that a lane is never
     * used after its rank stopped (the rank's communication thread records too). */
    struct fsdp__trace_lane *_Atomic trace;
    pthread_mutex_t trace_mu;
    /* The trace's clock for this rank: NULL for CLOCK_MONOTONIC, or a simulator's (its rank's
     * simulated time in ns, fsdp__ctx_set_trace_clock). Set while the rank records nothing. */
    int64_t (*trace_clock)(void *arg);
    void *trace_clock_arg;
    char err[FSDP_ERR_LEN];
};

/* Formats into an error buffer of FSDP_ERR_LEN bytes and returns rc, so a failing path can be
 * `return fsdp__err(buf, FSDP_EINVAL, "...")`. */
int fsdp__verr(char *buf, int rc, const char *fmt, va_list ap);
int fsdp__err(char *buf, int rc, const char *fmt, ...) FSDP_PRINTF(3, 4);

/* Same, on a context's last error (ctx may be NULL: the message is only logged, at debug
 * level). */
int fsdp__ctx_err(fsdp_ctx_t *ctx, int rc, const char *fmt, ...) FSDP_PRINTF(3, 4);

/* The error of a call whose only object for the text is the caller's context, which may be
 * NULL (the data and store functions, the safetensors writer): on ctx's last error as
 * fsdp__ctx_err, or without a context logged at error level, so the reason is never lost.
 * Returns rc. */
int fsdp__ctx_err_or_log(fsdp_ctx_t *ctx, int rc, const char *fmt, ...) FSDP_PRINTF(3, 4);

/* Whether the environment variable `name` is set to exactly `value` (core/log.c): the switches
 * that turn a default off ("0") or an option on ("1"). */
bool fsdp__env_is(const char *name, const char *value);

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

/* ---- the size member of options structs (docs/design.md, "ABI policy") ---------------------- */

/*
 * What the library knows of one public options struct: every such struct starts with
 * `size_t size`, the size the caller compiled it with, which its _init function stores. One
 * record per struct, defined beside its _init with FSDP__ABI_STRUCT and declared in the layer's
 * internal header. The first layout is named by its last member, so that a member appended
 * later leaves it as it is.
 */
typedef struct fsdp__abi_struct {
    const char *type; /* "fsdp_ctx_options_t" */
    const char *init; /* how to initialise one: "fsdp_ctx_options_init" */
    size_t v1_size;   /* bytes up to the end of the first published layout's last member */
    size_t size;      /* sizeof in this build of the library */
} fsdp__abi_struct_t;

/* The offset just past member m of struct type T. */
#define FSDP__ABI_END(T, m) (offsetof(T, m) + sizeof(((T *)0)->m))
/* The record of struct type T, initialised by init (a string), whose first layout ended with
 * member v1_last. */
#define FSDP__ABI_STRUCT(T, init, v1_last)                                                         \
    { #T, init, FSDP__ABI_END(T, v1_last), sizeof(T) }
/* Whether the caller's struct o (of type T, checked by fsdp__abi_check) has member m: a member
 * added after the first layout is read only when this holds, and is its default otherwise. */
#define FSDP__ABI_HAS(T, o, m) ((o)->size >= FSDP__ABI_END(T, m))

/* How far past this library's layout a caller's size may go before it is taken for garbage (a
 * struct that was never initialised) rather than a newer layout. */
#define FSDP__ABI_MAX_GROWTH 4096

/*
 * Checks the size member of the caller's struct o (NULL passes: whether NULL is allowed is the
 * caller's rule). Accepted: a size from the first layout's up to this library's, and a larger one
 * (a caller built against a newer libfsdp) when every byte past this library's layout is zero,
 * i.e. the caller asks for nothing this library lacks. FSDP_EINVAL for a size of 0, one below the
 * first layout or one too large to be any layout (an uninitialised struct); FSDP_ENOTSUP naming
 * the first nonzero byte past this library's layout. The message names fn, arg (the argument as
 * the message shows it: "opts", "o->mixed_precision"), the struct, the sizes and the _init
 * function; it lands on ctx, or is logged at error level when ctx is NULL
 * (fsdp__ctx_err_or_log).
 */
int fsdp__abi_check(fsdp_ctx_t *ctx, const char *fn, const char *arg, const void *o,
                    const fsdp__abi_struct_t *abi);
/* The same with the message in buf (FSDP_ERR_LEN bytes), for callers with their own error text. */
int fsdp__abi_check_buf(char *buf, const char *fn, const char *arg, const void *o,
                        const fsdp__abi_struct_t *abi);
/*
 * The check of a struct embedded by value in another public struct (the mixed precision of
 * fsdp_options_t): its bytes are part of the outer layout, which therefore fixes its size, so
 * the size must be exactly this library's. outer_init names the _init that initialises the outer
 * struct (and with it the embedded one), for the message.
 */
int fsdp__abi_check_embedded(fsdp_ctx_t *ctx, const char *fn, const char *arg, const void *o,
                             const fsdp__abi_struct_t *abi, const char *outer_init);

/*
 * Fills the caller's struct dst of dst_size bytes (the size the caller compiled it with) from
 * src, a struct of this library's layout with its members set: the bytes both layouts have,
 * zeros past this library's layout, and dst->size = dst_size. What every _init function does
 * with its defaults, and every function that fills a caller's struct with its answer. A dst_size
 * below the first layout writes nothing but zeros and the size, where they fit, so that every
 * consumer refuses the struct, and one too large to be a layout writes nothing: FSDP_EINVAL,
 * reported as
 * fsdp__abi_check does (fn names the call, what the size: "size", "sizeof *out"). A NULL dst is
 * FSDP_EINVAL with no message.
 */
int fsdp__abi_fill(fsdp_ctx_t *ctx, const char *fn, const char *what, void *dst, size_t dst_size,
                   const void *src, const fsdp__abi_struct_t *abi);
/* An _init function's body after it set its defaults in d: fsdp__abi_fill into o, errors
 * logged. */
void fsdp__abi_init(void *o, size_t size, const void *d, const fsdp__abi_struct_t *abi);

/*
 * Copies the caller's struct src (checked by fsdp__abi_check) into dst, a struct of this
 * library's layout that its _init filled with the defaults: the bytes src->size covers, up to
 * this library's layout, so a member the caller's layout lacks keeps its default; then
 * dst->size = abi->size. Every copy the library keeps of a caller's struct is made this way,
 * never by assignment, which would read past a smaller layout.
 */
void fsdp__abi_copy_in(void *dst, const void *src, const fsdp__abi_struct_t *abi);

/* ---- files (core/file.c; docs/design.md, "Checkpoints (safetensors)") -------------------- */

/* What a st_mode is, for messages: "a regular file", "a FIFO (named pipe)", "a directory",
 * "a character device", "a block device", "a socket", "a symbolic link". */
const char *fsdp__file_kind(unsigned mode);

/*
 * Opens path (relative to dirfd, or AT_FDCWD) for a regular file: flags are O_RDONLY or O_RDWR,
 * plus O_CREAT (with mode) or O_NOFOLLOW as the caller needs; O_NONBLOCK, O_NOCTTY and
 * O_CLOEXEC are always added, so that opening a FIFO or a device cannot block, and O_NONBLOCK is
 * cleared again once fstat showed a regular file. Every open of a file the library reads goes
 * through here. Returns the descriptor (the caller closes it), with its fstat in *st when st is
 * not NULL; or FSDP_EINVAL when path is not a
 * regular file (a FIFO, a directory, a device, a socket, or a link under O_NOFOLLOW), and
 * FSDP_EBACKEND when it cannot be opened or looked at (errno is the system's reason: ENOENT for
 * a missing file). On failure `why` (cap bytes) says what is wrong, without the path:
 * "is a FIFO (named pipe), not a regular file", "cannot open: No such file or directory".
 */
struct stat;
int fsdp__open_regular(int dirfd, const char *path, int flags, unsigned mode, struct stat *st,
                       char *why, size_t cap);

/* fsyncs the directory that holds path (relative to dirfd, or AT_FDCWD), so that a rename in it
 * is durable: 0, or -1 with errno. File systems that cannot sync a directory (EINVAL) are taken
 * at their word. */
int fsdp__sync_dir_of(int dirfd, const char *path);

/*
 * A file replaced atomically: written under a temporary name beside the destination (rename is
 * atomic only within one directory's file system), then renamed over it, so a reader sees the
 * old file or the new one, whole. Only a regular file is ever replaced: the destination is
 * checked with lstat (a link is not followed) when the write begins and again just before the
 * rename, and a FIFO, device, directory or link there is refused (FSDP_EINVAL), naming it and
 * what it is. Every failure removes the temporary file.
 *
 *   fsdp__replace_t r;
 *   rc = fsdp__replace_begin(&r, AT_FDCWD, path, 0666, true, why, sizeof why);
 *   ... write r.fd; on a write error: fsdp__replace_abort(&r) ...
 *   rc = fsdp__replace_commit(&r, why, sizeof why);
 */
typedef struct fsdp__replace {
    int dirfd;        /* names are relative to it: AT_FDCWD or a directory the caller verified */
    const char *path; /* the destination (borrowed from the caller) */
    char *tmp;        /* "<path>.tmp-<pid>-<hex>", NULL when there is no temporary file */
    int fd;           /* open for writing on tmp; -1 once closed */
    bool sync;        /* fsync the file before the rename and its directory after it */
} fsdp__replace_t;

/* Checks the destination, then creates the temporary file (O_EXCL, O_NOFOLLOW, mode under the
 * umask), open for writing in r->fd. FSDP_OK; or FSDP_EINVAL (the destination is not a regular
 * file), FSDP_EBACKEND or FSDP_ENOMEM with `why` (cap bytes) naming the file. r is safe to
 * abort either way. */
int fsdp__replace_begin(fsdp__replace_t *r, int dirfd, const char *path, unsigned mode, bool sync,
                        char *why, size_t cap);
/* With sync, fsyncs r->fd; closes it (when the caller has not: a caller that wrote through stdio
 * fcloses and sets r->fd = -1 first), checks the destination again, renames, and with sync
 * fsyncs the directory. FSDP_OK, or an error as for begin with `why` naming the file; a failed
 * directory sync is FSDP_EBACKEND although the file is in place (the message says so). The
 * temporary file never survives a failure. */
int fsdp__replace_commit(fsdp__replace_t *r, char *why, size_t cap);
/* Closes and removes the temporary file, if any; keeps errno. */
void fsdp__replace_abort(fsdp__replace_t *r);

/* Converts n elements of es bytes between little-endian (the file formats') and host order, in
 * place: a no-op on little-endian hosts, a byte reversal per element otherwise. */
void fsdp__swap_le(void *buf, size_t n, size_t es);

/* Attaches the borrowed world group and store of a rank (sim runner, init-from-env). */
void fsdp__ctx_attach(fsdp_ctx_t *ctx, fsdp_pg_t *pg, fsdp_store_t *store);
/* Makes fn(arg) the clock of ctx's trace (NULL: CLOCK_MONOTONIC again). For a simulator, whose
 * spans are in simulated time; call it while ctx records no trace. */
void fsdp__ctx_set_trace_clock(fsdp_ctx_t *ctx, int64_t (*fn)(void *arg), void *arg);

/* Registration of children on their context (process groups: pg.c calls these). Removing the
 * world group's child also detaches the world group. */
void fsdp__ctx_add_child(fsdp_ctx_t *ctx, struct fsdp__ctx_child *c);
void fsdp__ctx_remove_child(fsdp_ctx_t *ctx, struct fsdp__ctx_child *c);

/* Destroys every child still registered on ctx (a group waits for its outstanding works). With
 * a non-NULL `why`, each one other than the world group is reported as a warning. */
void fsdp__ctx_destroy_children(fsdp_ctx_t *ctx, const char *why);

/* Takes a reference on the state that `key` names on ctx, making it with create(ctx, arg, &obj)
 * when there is none (create returns 0 or a negative code; it runs under the context's lock and
 * must not call back into these functions). *out is the state. */
int fsdp__ctx_shared_acquire(fsdp_ctx_t *ctx, const void *key,
                             int (*create)(fsdp_ctx_t *ctx, void *arg, void **obj), void *arg,
                             void **out);
/* Drops a reference; the last one forgets the state and returns 1, the caller then frees it
 * (outside the context's lock); 0 otherwise. */
int fsdp__ctx_shared_release(fsdp_ctx_t *ctx, const void *key);

#endif /* FSDP_INTERNAL_H */
