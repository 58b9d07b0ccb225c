/* SPDX-License-Identifier: MIT */
/*
 * data.c: token datasets (llm.c token files, byte-level text) and the batch loader.
 *
 * Invariants:
 * - A dataset is immutable once opened. Its tokens are [first, first + count) of one open file,
 *   which every view of it shares through a reference count; the file is closed with the last.
 *   Immutability is what lets every rank thread share one dataset without locks, and the reason
 *   a dataset has no error buffer: its calls take the caller's context for their message.
 * - Nothing in a file is trusted: it must be a regular file (fsdp__open_regular, so a FIFO given
 *   as --data is refused rather than waited on), the header is checked against the file's size
 *   before any token is read, sizes are compared without overflow, and every read goes through
 *   pread(), so a file that shrinks later gives FSDP_EBACKEND rather than SIGBUS.
 * - A loader is stateless apart from its position: batch i is a pure function of (dataset, B, T,
 *   rank, W, shuffle, seed, i). The shuffled order is a keyed Feistel permutation of each
 *   epoch's batch positions (Philox as its round function, cycle-walking to the epoch length),
 *   so no permutation table is stored and any position can be resumed in O(1).
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <pthread.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fsdp/data.h>
#include <fsdp/tensor.h>

#include "internal.h"

/* Where the corpus is installed (set by Makefile.am, where $(pkgdatadir) is known with its final
 * prefix). No build path is compiled in: a program run from a build tree finds that tree's copy
 * from its own location (find_tree_corpus), so the library is the same bytes whichever
 * directory it was built in. */
#ifndef FSDP_DATA_PKGDATADIR
#define FSDP_DATA_PKGDATADIR "/nonexistent"
#endif

typedef struct data_file {
    _Atomic int refs;
    int fd;
    fsdp_data_format_t format; /* TOKENS or TEXT */
    uint64_t base;             /* byte offset of token 0: the header's size, or 0 */
    unsigned width;            /* bytes per token: 2 (uint16) or 1 (a byte) */
    uint64_t ntok;             /* tokens in the file */
    char path[];
} data_file_t;

struct fsdp_dataset {
    data_file_t *file; /* one reference */
    uint64_t first;    /* the dataset's token 0 is the file's token `first` */
    uint64_t count;    /* tokens, > 0 */
    uint32_t max_token;
};

struct fsdp_loader {
    fsdp_ctx_t *ctx;    /* borrowed, may be NULL */
    fsdp_dataset_t *ds; /* the loader's own reference to the dataset */
    fsdp_loader_options_t opts;
    int64_t rows;      /* B / W */
    size_t ntok;       /* tokens of one rank's inputs: rows * T */
    uint64_t bt;       /* tokens a global batch advances by: B * T */
    uint64_t nbatches; /* batches per epoch */
    uint64_t pos;      /* index of the next global batch */
    int half_bits;     /* width of each half of the Feistel network's domain */
    int64_t *buf;      /* (ntok + 1) tokens: a rank's inputs plus the last target */
    int32_t *buf32;    /* (ntok + 1) tokens narrowed for i32 tensors */
    char err[FSDP_ERR_LEN];
};

/* ---- errors -----------------------------------------------------------------------------------
 */

/* A loader's error: its own text and its context's. */
static int loader_err(fsdp_loader_t *l, int rc, const char *fmt, ...) FSDP_PRINTF(3, 4);
static int loader_err(fsdp_loader_t *l, int rc, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fsdp__verr(l->err, rc, fmt, ap);
    va_end(ap);
    if (l->ctx) fsdp__ctx_err(l->ctx, rc, "%s", l->err);
    return rc;
}

/* XSI strerror_r into buf (thread-safe, unlike strerror). */
static const char *errtext(int e, char *buf, size_t cap) {
    if (strerror_r(e, buf, cap) != 0) snprintf(buf, cap, "errno %d", e);
    return buf;
}

/* ---- files ------------------------------------------------------------------------------------
 */

static void file_release(data_file_t *f) {
    if (!f || atomic_fetch_sub(&f->refs, 1) != 1) return;
    if (f->fd >= 0) close(f->fd);
    free(f);
}

/* Reads exactly n bytes at offset off. Returns 0, an errno value, or -1 when the file ended
 * first. */
static int pread_full(int fd, void *dst, size_t n, uint64_t off) {
    unsigned char *p = dst;
    while (n) {
        if (off > (uint64_t)INT64_MAX) return EOVERFLOW;
        ssize_t got = pread(fd, p, n, (off_t)off);
        if (got < 0) {
            if (errno == EINTR) continue;
            return errno;
        }
        if (got == 0) return -1;
        p += got;
        n -= (size_t)got;
        off += (uint64_t)got;
    }
    return 0;
}

/* Writes why a read of `n` bytes at `off` failed into msg (FSDP_ERR_LEN bytes). */
static int read_failed(char *msg, const data_file_t *f, int e, size_t n, uint64_t off) {
    char why[128];
    if (e < 0)
        snprintf(why, sizeof why, "the file ended early (was it truncated after it was opened?)");
    else
        errtext(e, why, sizeof why);
    return fsdp__err(msg, FSDP_EBACKEND, "%s: reading %zu bytes at offset %" PRIu64 ": %s", f->path,
                     n, off, why);
}

static uint32_t le32(const unsigned char *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* The header fields are int32; llm.c writes them little-endian. */
static int64_t le32_signed(const unsigned char *p) {
    uint32_t u = le32(p);
    return u >= 0x80000000u ? (int64_t)u - 4294967296LL : (int64_t)u;
}

/*
 * Reads the file's tokens [first, first + n) (file token indices) in chunks. Each token goes to
 * out (when not NULL) and into the running maximum *max (when not NULL). On failure returns
 * FSDP_EBACKEND with the reason in msg.
 */
static int read_tokens(const data_file_t *f, uint64_t first, size_t n, int64_t *out, uint32_t *max,
                       char *msg) {
    unsigned char chunk[16384];
    size_t per = sizeof chunk / f->width;
    uint32_t m = max ? *max : 0;
    while (n) {
        size_t k = n < per ? n : per;
        size_t bytes = k * f->width;
        uint64_t off = f->base + first * f->width;
        int e = pread_full(f->fd, chunk, bytes, off);
        if (e) return read_failed(msg, f, e, bytes, off);
        for (size_t i = 0; i < k; i++) {
            uint32_t t = f->width == 2 ? (uint32_t)chunk[2 * i] | (uint32_t)chunk[2 * i + 1] << 8
                                       : (uint32_t)chunk[i];
            if (out) out[i] = (int64_t)t;
            if (t > m) m = t;
        }
        if (out) out += k;
        first += k;
        n -= k;
    }
    if (max) *max = m;
    return FSDP_OK;
}

/* Checks an llm.c header against a file of `size` bytes and sets f's layout. */
static int check_header(fsdp_ctx_t *ctx, data_file_t *f, uint64_t size) {
    const uint64_t hb = FSDP_DATA_HEADER_BYTES;
    if (size == 0)
        return fsdp__ctx_err_or_log(
            ctx, FSDP_EINVAL,
            "fsdp_dataset_open: %s: the file is empty; an llm.c token file starts "
            "with a header of %d int32 (%" PRIu64 " bytes)",
            f->path, FSDP_DATA_HEADER_INTS, hb);
    if (size < hb)
        return fsdp__ctx_err_or_log(ctx, FSDP_EINVAL,
                                    "fsdp_dataset_open: %s: truncated header: the file has %" PRIu64
                                    " bytes, the llm.c header alone has %" PRIu64,
                                    f->path, size, hb);
    unsigned char h[12];
    int e = pread_full(f->fd, h, sizeof h, 0);
    if (e) {
        char msg[FSDP_ERR_LEN];
        read_failed(msg, f, e, sizeof h, 0);
        return fsdp__ctx_err_or_log(ctx, FSDP_EBACKEND, "fsdp_dataset_open: %s", msg);
    }
    int64_t magic = le32_signed(h), version = le32_signed(h + 4), count = le32_signed(h + 8);
    if (magic != FSDP_DATA_MAGIC)
        return fsdp__ctx_err_or_log(ctx, FSDP_EINVAL,
                                    "fsdp_dataset_open: %s: header[0] (magic) is %" PRId64
                                    ", expected %d: not an llm.c token file",
                                    f->path, magic, FSDP_DATA_MAGIC);
    if (version != FSDP_DATA_VERSION)
        return fsdp__ctx_err_or_log(ctx, FSDP_EINVAL,
                                    "fsdp_dataset_open: %s: header[1] (version) is %" PRId64
                                    ", only version %d (uint16 tokens) is supported",
                                    f->path, version, FSDP_DATA_VERSION);
    if (count <= 0)
        return fsdp__ctx_err_or_log(ctx, FSDP_EINVAL,
                                    "fsdp_dataset_open: %s: header[2] (token count) is %" PRId64
                                    "; it must be positive",
                                    f->path, count);
    uint64_t have = size - hb, need = (uint64_t)count * 2;
    if (have < need)
        return fsdp__ctx_err_or_log(ctx, FSDP_EINVAL,
                                    "fsdp_dataset_open: %s: header[2] (token count) is %" PRId64
                                    " (%" PRIu64 " bytes of uint16) but only %" PRIu64
                                    " bytes follow the header: the file is truncated",
                                    f->path, count, need, have);
    if (have > need)
        return fsdp__ctx_err_or_log(ctx, FSDP_EINVAL,
                                    "fsdp_dataset_open: %s: header[2] (token count) is %" PRId64
                                    " (%" PRIu64 " bytes of uint16) but %" PRIu64
                                    " bytes follow the header: %" PRIu64 " bytes too many",
                                    f->path, count, need, have, have - need);
    f->format = FSDP_DATA_TOKENS;
    f->base = hb;
    f->width = 2;
    f->ntok = (uint64_t)count;
    return FSDP_OK;
}

static int ends_with(const char *s, const char *suffix) {
    size_t n = strlen(s), k = strlen(suffix);
    return n >= k && strcmp(s + n - k, suffix) == 0;
}

/* ---- datasets ---------------------------------------------------------------------------------
 */

/* A new dataset over f's tokens [first, first + count), taking a reference on f and reading the
 * range once for its largest token. */
static int dataset_new(fsdp_ctx_t *ctx, data_file_t *f, uint64_t first, uint64_t count,
                       const char *fn, fsdp_dataset_t **out) {
    fsdp_dataset_t *ds = calloc(1, sizeof *ds);
    if (!ds) return fsdp__ctx_err_or_log(ctx, FSDP_ENOMEM, "%s: out of memory", fn);
    uint32_t max = 0;
    /* Whole chunks at a time, so a size_t narrower than 64 bits still reads everything. */
    for (uint64_t done = 0; done < count;) {
        uint64_t k = count - done > ((uint64_t)1 << 30) ? (uint64_t)1 << 30 : count - done;
        char msg[FSDP_ERR_LEN];
        int rc = read_tokens(f, first + done, (size_t)k, NULL, &max, msg);
        if (rc < 0) {
            free(ds);
            return fsdp__ctx_err_or_log(ctx, rc, "%s: %s", fn, msg);
        }
        done += k;
    }
    atomic_fetch_add(&f->refs, 1);
    ds->file = f;
    ds->first = first;
    ds->count = count;
    ds->max_token = max;
    *out = ds;
    return FSDP_OK;
}

int fsdp_dataset_open(fsdp_ctx_t *ctx, const char *path, fsdp_data_format_t format,
                      fsdp_dataset_t **out) {
    static const char fn[] = "fsdp_dataset_open";
    data_file_t *f = NULL;
    int rc;
    char why[128];
    if (out) *out = NULL;
    if (!out) return fsdp__ctx_err_or_log(ctx, FSDP_EINVAL, "%s: out is NULL", fn);
    if (!path || !*path)
        return fsdp__ctx_err_or_log(ctx, FSDP_EINVAL, "%s: the path is NULL or empty", fn);
    if ((unsigned)format > FSDP_DATA_TEXT)
        return fsdp__ctx_err_or_log(ctx, FSDP_EINVAL, "%s: %s: unknown format %d", fn, path,
                                    (int)format);
    size_t plen = strlen(path);
    f = calloc(1, sizeof *f + plen + 1);
    if (!f) return fsdp__ctx_err_or_log(ctx, FSDP_ENOMEM, "%s: %s: out of memory", fn, path);
    memcpy(f->path, path, plen + 1);
    atomic_init(&f->refs, 1);
    /* a FIFO given as --data must not hang the open (fsdp__open_regular) */
    struct stat st;
    f->fd = fsdp__open_regular(AT_FDCWD, path, O_RDONLY, 0, &st, why, sizeof why);
    if (f->fd < 0) {
        rc = fsdp__ctx_err_or_log(ctx, f->fd, "%s: %s: %s", fn, path, why);
        f->fd = -1;
        goto out;
    }
    uint64_t size = st.st_size > 0 ? (uint64_t)st.st_size : 0;
    if (format == FSDP_DATA_AUTO) {
        unsigned char m[4];
        format = FSDP_DATA_TEXT;
        if (ends_with(path, ".bin"))
            format = FSDP_DATA_TOKENS;
        else if (size >= 4 && pread_full(f->fd, m, 4, 0) == 0 && le32(m) == FSDP_DATA_MAGIC)
            format = FSDP_DATA_TOKENS;
    }
    if (format == FSDP_DATA_TOKENS) {
        rc = check_header(ctx, f, size);
        if (rc < 0) goto out;
    } else {
        if (size == 0) {
            rc = fsdp__ctx_err_or_log(ctx, FSDP_EINVAL,
                                      "%s: %s: the file is empty: a text dataset needs at "
                                      "least one byte",
                                      fn, path);
            goto out;
        }
        f->format = FSDP_DATA_TEXT;
        f->base = 0;
        f->width = 1;
        f->ntok = size;
    }
    rc = dataset_new(ctx, f, 0, f->ntok, fn, out);
out:
    file_release(f); /* the dataset holds its own reference */
    return rc;
}

int fsdp_dataset_view(fsdp_ctx_t *ctx, const fsdp_dataset_t *ds, uint64_t first, uint64_t count,
                      fsdp_dataset_t **out) {
    static const char fn[] = "fsdp_dataset_view";
    if (out) *out = NULL;
    if (!ds || !out) return fsdp__ctx_err_or_log(ctx, FSDP_EINVAL, "%s: ds or out is NULL", fn);
    if (count == 0 || first > ds->count || count > ds->count - first)
        return fsdp__ctx_err_or_log(ctx, FSDP_EINVAL,
                                    "%s: %s: tokens [%" PRIu64 ", %" PRIu64 " + %" PRIu64
                                    ") are not a non-empty range of the dataset's %" PRIu64,
                                    fn, ds->file->path, first, first, count, ds->count);
    return dataset_new(ctx, ds->file, ds->first + first, count, fn, out);
}

int fsdp_dataset_split(fsdp_ctx_t *ctx, const fsdp_dataset_t *ds, double val_fraction,
                       fsdp_dataset_t **train, fsdp_dataset_t **val) {
    static const char fn[] = "fsdp_dataset_split";
    if (train) *train = NULL;
    if (val) *val = NULL;
    if (!ds || !train || !val)
        return fsdp__ctx_err_or_log(ctx, FSDP_EINVAL, "%s: ds, train or val is NULL", fn);
    if (!(val_fraction > 0.0 && val_fraction < 1.0))
        return fsdp__ctx_err_or_log(ctx, FSDP_EINVAL, "%s: %s: val_fraction %g is not in (0, 1)",
                                    fn, ds->file->path, val_fraction);
    uint64_t n = ds->count;
    double v = floor((double)n * val_fraction);
    uint64_t nval = v >= (double)n ? n : (uint64_t)v;
    if (nval == 0 || nval >= n)
        return fsdp__ctx_err_or_log(ctx, FSDP_EINVAL,
                                    "%s: %s: a validation fraction of %g of %" PRIu64
                                    " tokens leaves one part empty",
                                    fn, ds->file->path, val_fraction, n);
    int rc = fsdp_dataset_view(ctx, ds, 0, n - nval, train);
    if (rc < 0) return rc;
    rc = fsdp_dataset_view(ctx, ds, n - nval, nval, val);
    if (rc < 0) {
        fsdp_dataset_destroy(*train);
        *train = NULL;
    }
    return rc;
}

void fsdp_dataset_destroy(fsdp_dataset_t *ds) {
    if (!ds) return;
    file_release(ds->file);
    free(ds);
}

uint64_t fsdp_dataset_num_tokens(const fsdp_dataset_t *ds) {
    return ds ? ds->count : 0;
}

fsdp_data_format_t fsdp_dataset_format(const fsdp_dataset_t *ds) {
    return ds ? ds->file->format : FSDP_DATA_AUTO;
}

const char *fsdp_dataset_path(const fsdp_dataset_t *ds) {
    return ds ? ds->file->path : "";
}

uint32_t fsdp_dataset_max_token(const fsdp_dataset_t *ds) {
    return ds ? ds->max_token : 0;
}

int fsdp_dataset_read(fsdp_ctx_t *ctx, const fsdp_dataset_t *ds, uint64_t first, size_t n,
                      int64_t *out) {
    static const char fn[] = "fsdp_dataset_read";
    if (!ds || (!out && n))
        return fsdp__ctx_err_or_log(ctx, FSDP_EINVAL, "%s: ds or out is NULL", fn);
    if (first > ds->count || n > ds->count - first)
        return fsdp__ctx_err_or_log(ctx, FSDP_EINVAL,
                                    "%s: %s: tokens [%" PRIu64 ", %" PRIu64
                                    " + %zu) are outside the "
                                    "dataset's %" PRIu64,
                                    fn, ds->file->path, first, first, n, ds->count);
    char msg[FSDP_ERR_LEN];
    int rc = read_tokens(ds->file, ds->first + first, n, out, NULL, msg);
    if (rc < 0) return fsdp__ctx_err_or_log(ctx, rc, "%s: %s", fn, msg);
    return FSDP_OK;
}

/* The build tree's corpus, when the running program lies in one: the program's directory or one
 * of the three above it (libtool puts the real binaries in .libs/, tests and tools one level
 * down) holding config.status, which marks the top of a configured build tree, and
 * data/corpus.txt, which make puts there (a copy in a tree built outside the sources). */
static char tree_corpus[4096];
static pthread_once_t tree_once = PTHREAD_ONCE_INIT;

static void find_tree_corpus(void) {
    char dir[sizeof tree_corpus - 32];
    ssize_t n = readlink("/proc/self/exe", dir, sizeof dir - 1);
    if (n <= 0) return;
    dir[n] = 0;
    for (int up = 0; up < 4; up++) {
        char *slash = strrchr(dir, '/');
        if (!slash || slash == dir) return;
        *slash = 0;
        char marker[sizeof dir + 32];
        snprintf(marker, sizeof marker, "%s/config.status", dir);
        if (access(marker, F_OK) != 0) continue;
        snprintf(tree_corpus, sizeof tree_corpus, "%s/data/corpus.txt", dir);
        if (access(tree_corpus, R_OK) != 0) tree_corpus[0] = 0;
        return;
    }
}

const char *fsdp_data_default_corpus(void) {
    static const char installed[] = FSDP_DATA_PKGDATADIR "/corpus.txt";
    if (access(installed, R_OK) == 0) return installed;
    pthread_once(&tree_once, find_tree_corpus);
    return tree_corpus[0] ? tree_corpus : NULL;
}

/* ---- loaders ----------------------------------------------------------------------------------
 */

static const fsdp__abi_struct_t loader_options_abi =
    FSDP__ABI_STRUCT(fsdp_loader_options_t, "fsdp_loader_options_init", seed);

void(fsdp_loader_options_init)(fsdp_loader_options_t *opts, size_t size) {
    fsdp_loader_options_t d;
    memset(&d, 0, sizeof d);
    d.batch_size = 8;
    d.seq_len = 64;
    d.rank = 0;
    d.world_size = 1;
    d.shuffle = false;
    d.seed = 0;
    fsdp__abi_init(opts, size, &d, &loader_options_abi);
}

int fsdp_loader_create(fsdp_ctx_t *ctx, const fsdp_dataset_t *ds, const fsdp_loader_options_t *opts,
                       fsdp_loader_t **out) {
    static const char fn[] = "fsdp_loader_create";
    if (out) *out = NULL;
    if (!ds || !opts || !out)
        return fsdp__ctx_err_or_log(ctx, FSDP_EINVAL, "%s: ds, opts or out is NULL", fn);
    int rc = fsdp__abi_check(ctx, fn, "opts", opts, &loader_options_abi);
    if (rc < 0) return rc;
    const char *path = ds->file->path;
    int64_t b = opts->batch_size, t = opts->seq_len;
    int w = opts->world_size, r = opts->rank;
    if (b <= 0 || t <= 0)
        return fsdp__ctx_err_or_log(ctx, FSDP_EINVAL,
                                    "%s: %s: batch_size (%" PRId64 ") and seq_len (%" PRId64
                                    ") must be positive",
                                    fn, path, b, t);
    if (w < 1 || r < 0 || r >= w)
        return fsdp__ctx_err_or_log(ctx, FSDP_EINVAL,
                                    "%s: %s: rank %d is not in a world of size %d", fn, path, r, w);
    if (b % w != 0)
        return fsdp__ctx_err_or_log(
            ctx, FSDP_EINVAL,
            "%s: %s: batch_size %" PRId64 " is not divisible by world_size %d: each "
            "rank reads batch_size / world_size rows of every batch, so batch_size "
            "must be a multiple of %d",
            fn, path, b, w, w);
    uint64_t n = ds->count;
    /* B*T + 1 <= N, tested without forming B*T. */
    if (n < 2 || (uint64_t)b > (n - 1) / (uint64_t)t)
        return fsdp__ctx_err_or_log(
            ctx, FSDP_EINVAL,
            "%s: %s: the dataset has %" PRIu64 " tokens, fewer than one batch of "
            "batch_size %" PRId64 " x seq_len %" PRId64 " needs (plus one target)",
            fn, path, n, b, t);
    if ((uint64_t)(b / w) * (uint64_t)t >= SIZE_MAX / sizeof(int64_t))
        return fsdp__ctx_err_or_log(ctx, FSDP_EINVAL,
                                    "%s: %s: a rank's batch of %" PRId64 " x %" PRId64
                                    " tokens does not fit in memory",
                                    fn, path, b / w, t);
    fsdp_loader_t *l = calloc(1, sizeof *l);
    if (!l) return fsdp__ctx_err_or_log(ctx, FSDP_ENOMEM, "%s: out of memory", fn);
    l->ctx = ctx;
    fsdp_loader_options_init(&l->opts);
    fsdp__abi_copy_in(&l->opts, opts, &loader_options_abi);
    l->rows = b / w;
    l->ntok = (size_t)(l->rows * t); /* <= N, so it fits */
    l->bt = (uint64_t)b * (uint64_t)t;
    l->nbatches = (n - 1) / l->bt;
    int k = 0;
    while (k < 64 && ((uint64_t)1 << k) < l->nbatches)
        k++;
    if (k < 2) k = 2;
    l->half_bits = (k + 1) / 2;
    l->buf = malloc((l->ntok + 1) * sizeof *l->buf);
    l->buf32 = malloc((l->ntok + 1) * sizeof *l->buf32);
    l->ds = calloc(1, sizeof *l->ds);
    if (!l->buf || !l->buf32 || !l->ds) {
        size_t ntok = l->ntok;
        free(l->buf);
        free(l->buf32);
        free(l->ds);
        free(l);
        return fsdp__ctx_err_or_log(ctx, FSDP_ENOMEM, "%s: out of memory for %zu tokens", fn, ntok);
    }
    *l->ds = *ds;
    atomic_fetch_add(&ds->file->refs, 1);
    *out = l;
    return FSDP_OK;
}

void fsdp_loader_destroy(fsdp_loader_t *l) {
    if (!l) return;
    fsdp_dataset_destroy(l->ds);
    free(l->buf);
    free(l->buf32);
    free(l);
}

const fsdp_loader_options_t *fsdp_loader_options(const fsdp_loader_t *l) {
    return l ? &l->opts : NULL;
}

int64_t fsdp_loader_rows(const fsdp_loader_t *l) {
    return l ? l->rows : 0;
}

uint64_t fsdp_loader_num_batches(const fsdp_loader_t *l) {
    return l ? l->nbatches : 0;
}

uint64_t fsdp_loader_get_position(const fsdp_loader_t *l) {
    return l ? l->pos : 0;
}

int fsdp_loader_set_position(fsdp_loader_t *l, uint64_t position) {
    if (!l)
        return fsdp__ctx_err_or_log(NULL, FSDP_EINVAL,
                                    "fsdp_loader_set_position: the loader is NULL");
    l->pos = position;
    return FSDP_OK;
}

const char *fsdp_loader_last_error(const fsdp_loader_t *l) {
    return l ? l->err : "";
}

/* A four-round Feistel network on [0, 2^(2h)), keyed by (seed, epoch), with Philox as the round
 * function: a bijection whatever the round function, and pseudo-random with a good one. */
static uint64_t feistel(const fsdp_loader_t *l, uint64_t epoch, uint64_t x) {
    const int h = l->half_bits; /* 1..32 */
    const uint64_t mask = ((uint64_t)1 << h) - 1;
    const uint32_t key[2] = {(uint32_t)l->opts.seed, (uint32_t)(l->opts.seed >> 32)};
    uint64_t left = x >> h, right = x & mask;
    for (uint32_t round = 0; round < 4; round++) {
        const uint32_t ctr[4] = {(uint32_t)right, round, (uint32_t)epoch, (uint32_t)(epoch >> 32)};
        uint32_t o[4];
        fsdp_philox4x32_10(ctr, key, o);
        uint64_t next = left ^ (((uint64_t)o[1] << 32 | o[0]) & mask);
        left = right;
        right = next;
    }
    return left << h | right;
}

/* Which batch position of its epoch global batch `index` reads. */
static uint64_t batch_slot(const fsdp_loader_t *l, uint64_t index) {
    uint64_t epoch = index / l->nbatches, p = index % l->nbatches;
    if (!l->opts.shuffle || l->nbatches == 1) return p;
    /* Cycle-walking: apply the permutation of [0, 2^(2h)) until the value lands in
     * [0, nbatches). This restricts it to a permutation of [0, nbatches); since
     * 2^(2h) < 4 * nbatches, it takes fewer than four steps on average. */
    p = feistel(l, epoch, p);
    while (p >= l->nbatches) p = feistel(l, epoch, p);
    return p;
}

int fsdp_loader_batch(fsdp_loader_t *l, uint64_t index, int64_t *inputs, int64_t *targets) {
    if (!l) return fsdp__ctx_err_or_log(NULL, FSDP_EINVAL, "fsdp_loader_batch: the loader is NULL");
    l->err[0] = 0;
    uint64_t start = batch_slot(l, index) * l->bt +
                     (uint64_t)l->opts.rank * (uint64_t)l->rows * (uint64_t)l->opts.seq_len;
    char msg[FSDP_ERR_LEN];
    int rc = read_tokens(l->ds->file, l->ds->first + start, l->ntok + 1, l->buf, NULL, msg);
    if (rc < 0) return loader_err(l, rc, "fsdp_loader_batch: batch %" PRIu64 ": %s", index, msg);
    if (inputs) memcpy(inputs, l->buf, l->ntok * sizeof *inputs);
    if (targets) memcpy(targets, l->buf + 1, l->ntok * sizeof *targets);
    return FSDP_OK;
}

int fsdp_loader_next(fsdp_loader_t *l, int64_t *inputs, int64_t *targets) {
    if (!l) return fsdp__ctx_err_or_log(NULL, FSDP_EINVAL, "fsdp_loader_next: the loader is NULL");
    int rc = fsdp_loader_batch(l, l->pos, inputs, targets);
    if (rc == FSDP_OK) l->pos++;
    return rc;
}

/* Checks that t is an (rows, T) i32 or i64 tensor. */
static int check_tensor(fsdp_loader_t *l, const fsdp_tensor_t *t, const char *what) {
    fsdp_dtype_t dt = fsdp_tensor_dtype(t);
    if (fsdp_tensor_ndim(t) != 2 || fsdp_tensor_size(t, 0) != l->rows ||
        fsdp_tensor_size(t, 1) != l->opts.seq_len ||
        (dt != FSDP_DTYPE_I64 && dt != FSDP_DTYPE_I32)) {
        char desc[256];
        fsdp_tensor_describe(t, desc, sizeof desc);
        return loader_err(l, FSDP_EINVAL,
                          "fsdp_loader_next_tensors: %s is %s; expected (%" PRId64 ", %" PRId64
                          ") of i64 or i32",
                          what, desc, l->rows, l->opts.seq_len);
    }
    return FSDP_OK;
}

/* Copies n tokens from src into t, narrowing for an i32 tensor. */
static int fill_tensor(fsdp_loader_t *l, fsdp_tensor_t *t, const int64_t *src, const char *what) {
    int rc;
    if (fsdp_tensor_dtype(t) == FSDP_DTYPE_I64) {
        rc = fsdp_tensor_copy_from_host(t, src, l->ntok * sizeof *src);
    } else {
        for (size_t i = 0; i < l->ntok; i++)
            l->buf32[i] = (int32_t)src[i]; /* tokens < 2^16 */
        rc = fsdp_tensor_copy_from_host(t, l->buf32, l->ntok * sizeof *l->buf32);
    }
    if (rc < 0)
        return loader_err(l, rc, "fsdp_loader_next_tensors: copying into %s: %s", what,
                          fsdp_ctx_last_error(fsdp_tensor_ctx(t)));
    return FSDP_OK;
}

int fsdp_loader_next_tensors(fsdp_loader_t *l, fsdp_tensor_t *inputs, fsdp_tensor_t *targets) {
    if (!l)
        return fsdp__ctx_err_or_log(NULL, FSDP_EINVAL,
                                    "fsdp_loader_next_tensors: the loader is NULL");
    l->err[0] = 0;
    int rc;
    if (inputs && (rc = check_tensor(l, inputs, "inputs")) < 0) return rc;
    if (targets && (rc = check_tensor(l, targets, "targets")) < 0) return rc;
    rc = fsdp_loader_batch(l, l->pos, NULL, NULL); /* fills l->buf */
    if (rc < 0) return rc;
    if (inputs && (rc = fill_tensor(l, inputs, l->buf, "inputs")) < 0) return rc;
    if (targets && (rc = fill_tensor(l, targets, l->buf + 1, "targets")) < 0) return rc;
    l->pos++;
    return FSDP_OK;
}
