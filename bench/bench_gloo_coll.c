/* SPDX-License-Identifier: MIT */
/*
 * bench_gloo_coll.c: bus bandwidth of the gloo backend's all-gather, reduce-scatter and
 * all-reduce over TCP loopback, against the raw throughput of one loopback TCP stream.
 *
 * The ranks are threads of this process (each with its own context and Gloo world group over a
 * clone of one in-memory store), so every byte goes through Gloo's tcp transport and the
 * kernel's loopback device, as between processes on one host. With --procs they are processes
 * instead: the program forks one per rank, and they meet through a file store in a new
 * directory from mkdtemp (removed at the end); the rows live in a shared anonymous mapping, so
 * the parent prints what the ranks measured. For every message size (1 MiB to
 * 64 MiB by default, doubling) and world sizes 2 and 4, the ranks run one collective back to
 * back; the mean time per call (max over ranks) becomes algorithm and bus bandwidth with the
 * nccl-tests formulas.
 *
 * Beside each row stands the floor: the throughput of one plain TCP connection over 127.0.0.1
 * between two threads of this process, streaming the bytes one rank sends in that collective
 * (busbw's numerator: (N-1)/N of the message for all-gather and reduce-scatter, 2(N-1)/N for
 * all-reduce), measured before the ranks start. ratio = busbw / that throughput: 1 would mean
 * the collective drives every rank's link as fast as one bare stream goes.
 *
 * Every result is checked (after one untimed call, and again after the timed loop, which starts
 * from poisoned receive buffers). Run with --help for the options.
 */
#define _POSIX_C_SOURCE 200809L
/* MAP_ANONYMOUS is not in POSIX 2008; glibc shows it with _DEFAULT_SOURCE. */
#define _DEFAULT_SOURCE

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <dirent.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>

#include <fsdp/context.h>
#include <fsdp/dtype.h>
#include <fsdp/errno.h>
#include <fsdp/gloo.h>
#include <fsdp/pg.h>
#include <fsdp/store.h>

#include "bench_util.h"
#include "coll_util.h"

#define KIB ((size_t)1024)
#define MIB (KIB * KIB)
#define MAX_WORLD 16
#define MAX_SIZES 32
#define GB 1e9

typedef enum variant { V_AG = 0, V_RS, V_AR, V_COUNT } variant_t;

static const char *const variant_title[V_COUNT] = {
    "all_gather, in place (send = recv + rank * count, as FSDP issues it), f32",
    "reduce_scatter, out of place, f32 sum",
    "all_reduce, out of place, f32 sum",
};
static const fsdp_coll_kind_t variant_kind[V_COUNT] = {
    FSDP_COLL_ALL_GATHER, FSDP_COLL_REDUCE_SCATTER, FSDP_COLL_ALL_REDUCE};

/* ---------------------------------------------------------------------------------------- */
/* The floor: one loopback TCP stream */

typedef struct stream {
    int fd;
    const char *buf;
    size_t bytes;
    long reps;
    int err;
} stream_t;

static void *sender_main(void *arg) {
    stream_t *s = arg;
    for (long i = 0; i < s->reps && !s->err; i++) {
        size_t off = 0;
        while (off < s->bytes) {
            ssize_t w = write(s->fd, s->buf + off, s->bytes - off);
            if (w < 0 && errno == EINTR) continue;
            if (w <= 0) {
                s->err = errno ? errno : EIO;
                break;
            }
            off += (size_t)w;
        }
    }
    return NULL;
}

/* Seconds to receive reps messages of `bytes` from a sender thread; < 0 on failure. */
static double stream_round(int tx, int rx, const char *src, char *dst, size_t bytes, long reps) {
    stream_t s = {tx, src, bytes, reps, 0};
    pthread_t t;
    double t0 = bench_now_s();
    if (pthread_create(&t, NULL, sender_main, &s) != 0) return -1;
    int err = 0;
    for (long i = 0; i < reps && !err; i++) {
        size_t off = 0;
        while (off < bytes) {
            ssize_t r = read(rx, dst + off, bytes - off);
            if (r < 0 && errno == EINTR) continue;
            if (r <= 0) {
                err = 1;
                break;
            }
            off += (size_t)r;
        }
    }
    double dt = bench_now_s() - t0;
    pthread_join(t, NULL);
    return err || s.err ? -1 : dt;
}

/* Bytes per second of one TCP connection over 127.0.0.1 streaming messages of `bytes`; < 0 when
 * a socket call failed. */
static double tcp_floor(size_t bytes, double target_s) {
    int ls = -1, tx = -1, rx = -1;
    double bw = -1;
    char *src = bench_coll_alloc(bytes), *dst = bench_coll_alloc(bytes);
    struct sockaddr_in a;
    socklen_t alen = sizeof a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (!src || !dst) goto out;
    bench_coll_fill((float *)(void *)src, 0, 0, bytes / sizeof(float));
    ls = socket(AF_INET, SOCK_STREAM, 0);
    if (ls < 0 || bind(ls, (struct sockaddr *)&a, sizeof a) < 0 || listen(ls, 1) < 0 ||
        getsockname(ls, (struct sockaddr *)&a, &alen) < 0)
        goto out;
    tx = socket(AF_INET, SOCK_STREAM, 0);
    if (tx < 0 || connect(tx, (struct sockaddr *)&a, sizeof a) < 0) goto out;
    rx = accept(ls, NULL, NULL);
    if (rx < 0) goto out;
    int one = 1;
    setsockopt(tx, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    /* Warm-up and calibration, then about target_s of messages. */
    long reps = 1;
    double t;
    for (;;) {
        t = stream_round(tx, rx, src, dst, bytes, reps);
        if (t < 0) goto out;
        if (t >= target_s / 10 || reps >= (1L << 20)) break;
        reps *= 4;
    }
    long n = (long)(target_s / (t / (double)reps));
    if (n < 2) n = 2;
    t = stream_round(tx, rx, src, dst, bytes, n);
    if (t > 0 && memcmp(src, dst, bytes) == 0) bw = (double)bytes * (double)n / t;
out:
    if (ls >= 0) close(ls);
    if (tx >= 0) close(tx);
    if (rx >= 0) close(rx);
    free(src);
    free(dst);
    return bw;
}

/* ---------------------------------------------------------------------------------------- */
/* The ranks */

typedef struct row {
    variant_t v;
    size_t bytes; /* requested message size */
    size_t count, size;
    double tcp_bw; /* floor, bytes/s */
    double time_s; /* mean per call, slowest rank (rank 0 writes) */
    double cpu_s;  /* CPU time per call of every rank and its threads together (rank 0 writes) */
    long iters;    /* rank 0 writes */
    long bad;      /* wrong elements, all ranks (under the world's lock) */
    char err[300]; /* first failure */
} row_t;

/* Shared by the ranks: threads, or processes (then in a MAP_SHARED mapping, the mutex
 * process-shared). */
typedef struct world {
    int n;
    int procs; /* ranks are processes (each measures its own CPU time) */
    double target_s;
    int nrows;
    row_t rows[V_COUNT * MAX_SIZES];
    pthread_mutex_t mu;
} world_t;

typedef struct rank_arg {
    world_t *w;
    int rank;
    fsdp_store_t *store;
    pthread_t thread;
} rank_arg_t;

static int call(fsdp_pg_t *pg, variant_t v, const float *send, float *recv, size_t count) {
    switch (v) {
    case V_AG:
        return fsdp_pg_all_gather(pg, send, recv, count, FSDP_DTYPE_F32, NULL);
    case V_RS:
        return fsdp_pg_reduce_scatter(pg, send, recv, count, FSDP_DTYPE_F32, FSDP_REDOP_SUM, NULL);
    default:
        return fsdp_pg_all_reduce(pg, send, recv, count, FSDP_DTYPE_F32, FSDP_REDOP_SUM, NULL);
    }
}

static float expected(variant_t v, int r, int n, size_t count, size_t k) {
    return v == V_AG   ? bench_coll_value((int)(k / count), k % count)
           : v == V_RS ? bench_coll_value_sum(n, (size_t)r * count + k)
                       : bench_coll_value_sum(n, k);
}

/* Checks the ends of every chunk and 4096 positions spread over recv. */
static long verify(variant_t v, const float *recv, size_t elems, int r, int n, size_t count) {
    long bad = 0;
    size_t chunk = v == V_AG ? count : elems;
    for (size_t s = 0; s < elems; s += chunk)
        bad += (recv[s] != expected(v, r, n, count, s)) +
               (recv[s + chunk - 1] != expected(v, r, n, count, s + chunk - 1));
    for (size_t j = 0; j < 4096; j++) {
        size_t k = (j * 2654435761u) % elems;
        bad += recv[k] != expected(v, r, n, count, k);
    }
    return bad;
}

static void poison(variant_t v, float *recv, size_t elems, int r, size_t count) {
    if (v == V_AG) {
        memset(recv, 0xff, (size_t)r * count * sizeof(float));
        memset(recv + (size_t)(r + 1) * count, 0xff,
               (elems - (size_t)(r + 1) * count) * sizeof(float));
    } else {
        memset(recv, 0xff, elems * sizeof(float));
    }
}

static double cpu_now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Runs iters calls after a barrier; *t gets the slowest rank's time and *cpu the CPU time the
 * calls took: summed over the processes when the ranks are processes, else the one process's
 * (every rank thread and Gloo's threads), the largest reading of the ranks. */
static int timed(fsdp_pg_t *pg, const world_t *w, variant_t v, const float *send, float *recv,
                 size_t count, long iters, double *t, double *cpu) {
    int rc = fsdp_pg_barrier(pg, NULL);
    double t0 = bench_now_s(), c0 = cpu_now_s();
    for (long i = 0; i < iters && rc == FSDP_OK; i++)
        rc = call(pg, v, send, recv, count);
    *t = bench_now_s() - t0;
    *cpu = cpu_now_s() - c0;
    if (rc == FSDP_OK) rc = fsdp_pg_all_reduce(pg, t, t, 1, FSDP_DTYPE_F64, FSDP_REDOP_MAX, NULL);
    if (rc == FSDP_OK)
        rc = fsdp_pg_all_reduce(pg, cpu, cpu, 1, FSDP_DTYPE_F64,
                                w->procs ? FSDP_REDOP_SUM : FSDP_REDOP_MAX, NULL);
    return rc;
}

static int run_row(fsdp_pg_t *pg, world_t *w, row_t *row, int r) {
    const int n = w->n;
    const size_t c = row->count;
    size_t send_elems = row->v == V_RS ? c * (size_t)n : c;
    size_t recv_elems = row->v == V_AG ? c * (size_t)n : c;
    float *recv = bench_coll_alloc(recv_elems * sizeof(float));
    float *send_mem = row->v == V_AG ? NULL : bench_coll_alloc(send_elems * sizeof(float));
    float *send = row->v == V_AG ? recv + (size_t)r * c : send_mem;
    double t = 0, cpu = 0;
    long iters = 1, bad = 0;
    int rc = FSDP_ENOMEM;
    if (!recv || (row->v != V_AG && !send_mem)) goto out;
    bench_coll_fill(send, r, 0, send_elems);
    poison(row->v, recv, recv_elems, r, c);
    rc = call(pg, row->v, send, recv, c);
    if (rc != FSDP_OK) goto out;
    poison(row->v, recv, recv_elems, r, c);
    rc = call(pg, row->v, send, recv, c);
    if (rc != FSDP_OK) goto out;
    bad += verify(row->v, recv, recv_elems, r, n, c);
    for (;;) {
        rc = timed(pg, w, row->v, send, recv, c, iters, &t, &cpu);
        if (rc != FSDP_OK) goto out;
        if (t >= w->target_s / 10 || iters >= (1L << 20)) break;
        iters *= 4;
    }
    iters = (long)(w->target_s / (t / (double)iters));
    if (iters < 3) iters = 3;
    poison(row->v, recv, recv_elems, r, c);
    rc = timed(pg, w, row->v, send, recv, c, iters, &t, &cpu);
    if (rc != FSDP_OK) goto out;
    bad += verify(row->v, recv, recv_elems, r, n, c);
    if (r == 0) {
        row->time_s = t / (double)iters;
        row->cpu_s = cpu / (double)iters;
        row->iters = iters;
    }
out:
    pthread_mutex_lock(&w->mu);
    row->bad += bad;
    if (rc != FSDP_OK && !row->err[0])
        snprintf(row->err, sizeof row->err, "rank %d: %s: %s", r, fsdp_err_name(rc),
                 fsdp_pg_last_error(pg));
    pthread_mutex_unlock(&w->mu);
    free(recv);
    free(send_mem);
    return rc;
}

static void *rank_main(void *p) {
    rank_arg_t *a = p;
    world_t *w = a->w;
    fsdp_ctx_t *ctx = NULL;
    fsdp_pg_t *pg = NULL;
    fsdp_ctx_options_t co;
    fsdp_ctx_options_init(&co);
    co.rank = a->rank;
    co.world_size = w->n;
    int rc = fsdp_ctx_create(&co, &ctx);
    if (rc == FSDP_OK) {
        fsdp_gloo_options_t o;
        fsdp_gloo_options_init(&o);
        o.timeout_ms = 120000;
        rc = fsdp_pg_create_gloo(ctx, a->store, &o, &pg);
        if (rc != FSDP_OK)
            fprintf(stderr, "bench_gloo_coll: rank %d: %s\n", a->rank, fsdp_ctx_last_error(ctx));
    }
    for (int i = 0; i < w->nrows && rc == FSDP_OK; i++)
        rc = run_row(pg, w, &w->rows[i], a->rank);
    fsdp_ctx_destroy(ctx);
    return NULL;
}

/* ---------------------------------------------------------------------------------------- */
/* Driver */

typedef struct options {
    int quick, world, op;
    int procs; /* ranks as processes (fork) instead of threads */
    size_t min_bytes, max_bytes;
} options_t;

static void usage(FILE *f) {
    fprintf(f,
            "usage: bench_gloo_coll [--procs] [--quick] [--world N] [--op OP] [--min-bytes B] "
            "[--max-bytes B] [--help]\n"
            "\n"
            "Bus bandwidth of the gloo backend's collectives (f32) over TCP loopback, ranks as\n"
            "threads (or processes), beside the throughput of one bare loopback TCP stream.\n"
            "\n"
            "  --procs        ranks are processes forked by this one, meeting through a file\n"
            "                 store in a new directory under $TMPDIR (default /tmp)\n"
            "  --quick        sizes 1M and 4M, short measurements (a few seconds)\n"
            "  --world N      only world size N (2..%d; default: 2 and 4)\n"
            "  --op OP        only all_gather, reduce_scatter or all_reduce\n"
            "  --min-bytes B  smallest message (nccl-tests' size), with an optional K, M or G\n"
            "                 suffix (powers of 1024); default 1M; sizes double\n"
            "  --max-bytes B  largest message; default 64M\n"
            "  --help         this text\n",
            MAX_WORLD);
}

static int parse_bytes(const char *s, size_t *out) {
    char *end;
    unsigned long long v = strtoull(s, &end, 10);
    unsigned long long mul = 1;
    if (end == s) return -1;
    if (*end == 'K' || *end == 'k') mul = 1ull << 10;
    if (*end == 'M' || *end == 'm') mul = 1ull << 20;
    if (*end == 'G' || *end == 'g') mul = 1ull << 30;
    if (mul != 1) end++;
    if (*end || v == 0 || v > SIZE_MAX / mul) return -1;
    *out = (size_t)(v * mul);
    return 0;
}

static const char *opt_value(int argc, char **argv, int *i, const char *name) {
    size_t len = strlen(name);
    if (strncmp(argv[*i], name, len) != 0) return NULL;
    if (argv[*i][len] == '=') return argv[*i] + len + 1;
    if (argv[*i][len] == 0 && *i + 1 < argc) return argv[++*i];
    return NULL;
}

static int parse_args(int argc, char **argv, options_t *o) {
    memset(o, 0, sizeof *o);
    o->op = -1;
    o->min_bytes = MIB;
    o->max_bytes = 64 * MIB;
    for (int i = 1; i < argc; i++) {
        const char *v;
        if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
            usage(stdout);
            exit(0);
        } else if (strcmp(argv[i], "--procs") == 0) {
            o->procs = 1;
        } else if (strcmp(argv[i], "--quick") == 0) {
            o->quick = 1;
            o->max_bytes = 4 * MIB;
        } else if ((v = opt_value(argc, argv, &i, "--world"))) {
            char *end;
            long n = strtol(v, &end, 10);
            if (*end || n < 2 || n > MAX_WORLD) {
                fprintf(stderr, "bench_gloo_coll: --world wants 2..%d, got '%s'\n", MAX_WORLD, v);
                return -1;
            }
            o->world = (int)n;
        } else if ((v = opt_value(argc, argv, &i, "--op"))) {
            o->op = strcmp(v, "all_gather") == 0       ? V_AG
                    : strcmp(v, "reduce_scatter") == 0 ? V_RS
                    : strcmp(v, "all_reduce") == 0     ? V_AR
                                                       : -2;
            if (o->op == -2) {
                fprintf(stderr, "bench_gloo_coll: unknown --op '%s'\n", v);
                return -1;
            }
        } else if ((v = opt_value(argc, argv, &i, "--max-bytes"))) {
            if (parse_bytes(v, &o->max_bytes) < 0) {
                fprintf(stderr, "bench_gloo_coll: bad --max-bytes '%s'\n", v);
                return -1;
            }
        } else if ((v = opt_value(argc, argv, &i, "--min-bytes"))) {
            if (parse_bytes(v, &o->min_bytes) < 0) {
                fprintf(stderr, "bench_gloo_coll: bad --min-bytes '%s'\n", v);
                return -1;
            }
        } else {
            fprintf(stderr, "bench_gloo_coll: unknown or incomplete option '%s'\n", argv[i]);
            usage(stderr);
            return -1;
        }
    }
    if (o->min_bytes > o->max_bytes) {
        fprintf(stderr, "bench_gloo_coll: --min-bytes is larger than --max-bytes\n");
        return -1;
    }
    return 0;
}

/* Removes the file store's directory and the files in it (it has no subdirectories). */
static void remove_store_dir(const char *dir) {
    DIR *d = opendir(dir);
    if (d) {
        struct dirent *e;
        char path[4096];
        while ((e = readdir(d)))
            if (strcmp(e->d_name, ".") != 0 && strcmp(e->d_name, "..") != 0) {
                int k = snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
                if (k > 0 && (size_t)k < sizeof path) unlink(path);
            }
        closedir(d);
    }
    rmdir(dir);
}

/* Runs the ranks as threads over clones of one in-memory store. Returns 0 or 1. */
static int run_threads(world_t *w) {
    int n = w->n, failed = 0, started = 0;
    fsdp_store_t *store = NULL;
    rank_arg_t ranks[MAX_WORLD];
    memset(ranks, 0, sizeof ranks);
    if (fsdp_store_create_memory(NULL, &store) != FSDP_OK) return 1;
    for (int r = 0; r < n && !failed; r++) {
        ranks[r].w = w;
        ranks[r].rank = r;
        failed = fsdp_store_clone(store, NULL, &ranks[r].store) != FSDP_OK;
    }
    for (; started < n && !failed; started++)
        failed = pthread_create(&ranks[started].thread, NULL, rank_main, &ranks[started]) != 0;
    for (int r = 0; r < started; r++)
        pthread_join(ranks[r].thread, NULL);
    for (int r = 0; r < n; r++)
        fsdp_store_destroy(ranks[r].store);
    fsdp_store_destroy(store);
    return failed;
}

/* Runs the ranks as processes, forked from this one, over a file store in a new directory.
 * Returns 0, or 1 when one could not start or did not exit with status 0. */
static int run_procs(world_t *w) {
    const char *tmp = getenv("TMPDIR");
    char dbuf[4096];
    snprintf(dbuf, sizeof dbuf, "%s/bench_gloo_coll.XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (!mkdtemp(dbuf)) {
        fprintf(stderr, "bench_gloo_coll: mkdtemp(%s): %s\n", dbuf, strerror(errno));
        return 1;
    }
    pid_t pids[MAX_WORLD];
    int n = w->n, failed = 0, started = 0;
    fflush(stdout);
    fflush(stderr);
    for (; started < n; started++) {
        pid_t pid = fork();
        if (pid < 0) {
            fprintf(stderr, "bench_gloo_coll: fork: %s\n", strerror(errno));
            failed = 1;
            break;
        }
        if (pid == 0) {
            rank_arg_t a = {.w = w, .rank = started};
            /* Without a context the library logs why on stderr. */
            if (fsdp_store_create_file(NULL, dbuf, &a.store) != FSDP_OK) {
                fprintf(stderr, "bench_gloo_coll: rank %d: cannot open the file store in %s\n",
                        started, dbuf);
                _exit(1);
            }
            rank_main(&a);
            fsdp_store_destroy(a.store);
            _exit(0);
        }
        pids[started] = pid;
    }
    if (failed) /* the ranks that started wait for the others until their timeout */
        for (int r = 0; r < started; r++)
            kill(pids[r], SIGTERM);
    for (int r = 0; r < started; r++) {
        int st = 0;
        while (waitpid(pids[r], &st, 0) < 0 && errno == EINTR) {
        }
        if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
            if (!failed)
                fprintf(stderr, "bench_gloo_coll: rank %d %s %d\n", r,
                        WIFSIGNALED(st) ? "was killed by signal" : "exited with status",
                        WIFSIGNALED(st) ? WTERMSIG(st) : WEXITSTATUS(st));
            failed = 1;
        }
    }
    remove_store_dir(dbuf);
    return failed;
}

/* Measures the floors, runs the world, prints its tables. Returns 0 or 1 (a failure). */
static int run_world(const options_t *o, int n) {
    /* Shared, so that rank processes write their results where this process reads them. */
    world_t *w = mmap(NULL, sizeof *w, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (w == MAP_FAILED) return 1;
    memset(w, 0, sizeof *w);
    w->n = n;
    w->procs = o->procs;
    w->target_s = o->quick ? 0.05 : 0.3;
    pthread_mutexattr_t ma;
    pthread_mutexattr_init(&ma);
    if (o->procs) pthread_mutexattr_setpshared(&ma, PTHREAD_PROCESS_SHARED);
    pthread_mutex_init(&w->mu, &ma);
    pthread_mutexattr_destroy(&ma);
    for (int v = 0; v < V_COUNT; v++) {
        if (o->op >= 0 && o->op != v) continue;
        for (size_t b = o->min_bytes; b <= o->max_bytes && w->nrows < V_COUNT * MAX_SIZES;
             b *= (o->quick ? 4 : 2)) {
            row_t *row = &w->rows[w->nrows];
            row->v = (variant_t)v;
            row->bytes = b;
            row->count = bench_coll_count(variant_kind[row->v], b, n);
            if (row->count == 0) continue;
            row->size = bench_coll_msg_bytes(variant_kind[row->v], row->count, n);
            /* The bytes one rank sends per call, streamed alone, before any rank runs. */
            size_t per_rank =
                (size_t)((double)row->size * bench_coll_bus_factor(variant_kind[row->v], n));
            row->tcp_bw = tcp_floor(per_rank, o->quick ? 0.05 : 0.2);
            w->nrows++;
        }
    }
    int failed = o->procs ? run_procs(w) : run_threads(w);
    int last_v = -1;
    for (int i = 0; i < w->nrows; i++) {
        row_t *row = &w->rows[i];
        if ((int)row->v != last_v) {
            last_v = (int)row->v;
            printf("\n## %s, world size %d (%s)\n", variant_title[row->v], n,
                   o->procs ? "processes" : "threads");
            printf("%12s %10s %6s %10s %10s %10s %9s %6s %10s %6s\n", "size", "count", "iters",
                   "time_us", "algbw_GB/s", "busbw_GB/s", "tcp_GB/s", "ratio", "cpu_us", "cores");
        }
        if (row->err[0] || row->bad || row->time_s <= 0) {
            fprintf(stderr, "bench_gloo_coll: %s, world %d, %zu bytes: %s%s%ld wrong elements\n",
                    fsdp_coll_name(variant_kind[row->v]), n, row->size, row->err,
                    row->err[0] ? "; " : "", row->bad);
            failed = 1;
            continue;
        }
        double algbw = (double)row->size / row->time_s / GB;
        double busbw = algbw * bench_coll_bus_factor(variant_kind[row->v], n);
        printf("%12zu %10zu %6ld %10.1f %10.2f %10.2f %9.2f %6.2f %10.1f %6.2f\n", row->size,
               row->count, row->iters, row->time_s * 1e6, algbw, busbw, row->tcp_bw / GB,
               row->tcp_bw > 0 ? busbw * GB / row->tcp_bw : 0.0, row->cpu_s * 1e6,
               row->cpu_s / row->time_s);
    }
    fflush(stdout);
    pthread_mutex_destroy(&w->mu);
    munmap(w, sizeof *w);
    return failed;
}

int main(int argc, char **argv) {
    options_t o;
    if (parse_args(argc, argv, &o) < 0) return 2;
    if (!fsdp_gloo_available()) {
        fprintf(stderr, "bench_gloo_coll: this libfsdp was built without Gloo\n");
        return 1;
    }
    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    double load = -1;
    FILE *lf = fopen("/proc/loadavg", "r");
    if (lf) {
        if (fscanf(lf, "%lf", &load) != 1) load = -1;
        fclose(lf);
    }
    printf("# bench_gloo_coll: gloo backend over TCP loopback, ranks as %s\n",
           o.procs ? "processes (forked; file store)" : "threads of one process");
    printf("# machine: %ld online CPU(s); load average (1 min) at start: %.2f\n", ncpu, load);
    printf("# time_us: mean per call, slowest rank; size: nccl-tests' message bytes; algbw = "
           "size / time;\n"
           "# busbw = algbw * (N-1)/N (all_gather, reduce_scatter), * 2(N-1)/N (all_reduce); "
           "GB = 10^9 bytes\n"
           "# tcp_GB/s: one loopback TCP stream between two threads, messages of the bytes one "
           "rank sends per call\n"
           "# (size * busbw/algbw), measured before the ranks start; ratio = busbw / tcp_GB/s\n"
           "# cpu_us: CPU time per call of all ranks and their threads together (user and\n"
           "# system); cores = cpu_us / time_us, the cores a call keeps busy on average\n");
    int worlds[2] = {2, 4}, nworlds = 2, failed = 0;
    if (o.world) {
        worlds[0] = o.world;
        nworlds = 1;
    }
    double t0 = bench_now_s();
    for (int i = 0; i < nworlds; i++)
        failed |= run_world(&o, worlds[i]);
    printf("\n# total %.1f s\n", bench_now_s() - t0);
    return failed;
}
