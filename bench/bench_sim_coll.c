/* SPDX-License-Identifier: MIT */
/*
 * bench_sim_coll.c: bandwidth of the sim backend's all-gather, reduce-scatter and all-reduce.
 *
 * For every message size from 1 KiB to 256 MiB (doubling) and world sizes 2 and 4, the ranks
 * run one collective kind back to back and the mean time per call (max over ranks) is turned
 * into algorithm and bus bandwidth with the nccl-tests formulas. Beside each row stand two
 * floors measured in this process, on one thread, while no rank thread exists:
 *
 *   memcpy floor  one memcpy of the bytes one rank copies from its peers in an all-gather;
 *   summing floor one plain loop summing the N ranks' whole inputs of the collective in rank
 *                 order; a rank of an ideal N-way split does 1/N of that work.
 *
 * The targets (message >= 16 MiB, world size 2): all-gather bus bandwidth >= 0.8x the memcpy
 * floor; reduce-scatter and all-reduce time <= 1.25x the summing floor divided by N.
 *
 * Every collective's result is checked (after one untimed call, and again after the timed
 * loop, which starts from poisoned receive buffers), so a broken collective cannot report a
 * good number. Run with --help for the options.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <sys/resource.h>

#include <fsdp/context.h>
#include <fsdp/dtype.h>
#include <fsdp/errno.h>
#include <fsdp/mem.h>
#include <fsdp/pg.h>
#include <fsdp/sim.h>

#include "bench_util.h"
#include "coll_util.h"

#define KIB ((size_t)1024)
#define MIB (KIB * KIB)
#define MIN_BYTES KIB
#define MAX_BYTES_FULL (256 * MIB)
#define MAX_BYTES_QUICK (16 * MIB)
#define TARGET_MIN_BYTES (16 * MIB) /* the targets apply from this size on... */
#define TARGET_WORLD 2              /* ...at this world size */
#define AG_TARGET 0.80              /* busbw / memcpy bandwidth, at least */
#define RED_TARGET 1.25             /* time / (summing floor / N), at most */
#define MAX_WORLD 64
#define GB 1e9 /* nccl-tests' GB/s are 10^9 bytes per second */

/* ---------------------------------------------------------------------------------------- */
/* What is measured */

typedef enum variant {
    V_AG_IN = 0, /* all_gather, send == recv + rank * count (what FSDP issues) */
    V_AG_OUT,    /* all_gather, separate send buffer */
    V_RS,        /* reduce_scatter, out of place */
    V_AR,        /* all_reduce, out of place */
    V_COUNT
} variant_t;

static const char *const variant_title[V_COUNT] = {
    "all_gather, in place (send = recv + rank * count, as FSDP issues it)",
    "all_gather, out of place",
    "reduce_scatter, out of place, f32 sum",
    "all_reduce, out of place, f32 sum",
};

static int is_gather(variant_t v) {
    return v == V_AG_IN || v == V_AG_OUT;
}

/* ---------------------------------------------------------------------------------------- */
/* Helpers */

/* CPU seconds used by the whole process so far, and its page faults. */
static void process_usage(double *cpu_s, long *faults) {
    struct rusage u;
    getrusage(RUSAGE_SELF, &u);
    *cpu_s = (double)u.ru_utime.tv_sec + (double)u.ru_utime.tv_usec * 1e-6 +
             (double)u.ru_stime.tv_sec + (double)u.ru_stime.tv_usec * 1e-6;
    *faults = u.ru_minflt + u.ru_majflt;
}

static const char *human(size_t bytes, char *buf, size_t cap) {
    if (bytes >= MIB && bytes % MIB == 0)
        snprintf(buf, cap, "%zu MiB", bytes / MIB);
    else if (bytes >= KIB && bytes % KIB == 0)
        snprintf(buf, cap, "%zu KiB", bytes / KIB);
    else
        snprintf(buf, cap, "%zu B", bytes);
    return buf;
}

/* ---------------------------------------------------------------------------------------- */
/* Floors: one thread, no rank thread running */

typedef void (*kernel_fn)(void *arg);

/*
 * Mean seconds per call of fn(arg): one warm-up call, then a calibration that grows the number
 * of calls until they take a tenth of target_s, then about target_s worth of calls. The calls
 * go through a volatile pointer so that the compiler cannot merge the repetitions.
 */
static double time_kernel(kernel_fn fn, void *arg, double target_s) {
    kernel_fn volatile call = fn;
    call(arg);
    long reps = 1;
    double t;
    for (;;) {
        double t0 = bench_now_s();
        for (long i = 0; i < reps; i++)
            call(arg);
        t = bench_now_s() - t0;
        if (t >= target_s / 10 || reps >= (1L << 26)) break;
        reps *= 4;
    }
    double per = t / (double)reps;
    long n = (long)(target_s / (per > 0 ? per : 1e-9));
    if (n < 2) n = 2;
    if (n > (1L << 28)) n = 1L << 28;
    double t0 = bench_now_s();
    for (long i = 0; i < n; i++)
        call(arg);
    return (bench_now_s() - t0) / (double)n;
}

typedef struct copy_arg {
    void *dst;
    const void *src;
    size_t bytes;
} copy_arg_t;

static void copy_kernel(void *arg) {
    copy_arg_t *a = arg;
    memcpy(a->dst, a->src, a->bytes);
}

/* Bandwidth in bytes per second of one thread's memcpy of `bytes`; < 0 when out of memory. */
static double memcpy_floor(size_t bytes, double target_s) {
    copy_arg_t a = {bench_coll_alloc(bytes), bench_coll_alloc(bytes), bytes};
    double bw = -1;
    if (a.dst && a.src) {
        bench_coll_fill((float *)a.src, 0, 0, bytes / sizeof(float));
        bw = (double)bytes / time_kernel(copy_kernel, &a, target_s);
    }
    free(a.dst);
    free((void *)a.src);
    return bw;
}

typedef struct sum_arg {
    float *out;
    const float *ins[MAX_WORLD];
    int nin;
    size_t n;
} sum_arg_t;

/*
 * out[i] = ((in0[i] + in1[i]) + in2[i]) + ..., a plain f32 loop in rank order. It walks the
 * arrays in blocks of 4 KiB so that the partial sums stay in L1 between the passes over the
 * inputs: every input is read once and the output written once, as in one fused loop.
 */
static void sum_kernel(void *arg) {
    enum { BLOCK = 1024 };
    sum_arg_t *a = arg;
    for (size_t off = 0; off < a->n; off += BLOCK) {
        size_t m = a->n - off < BLOCK ? a->n - off : BLOCK;
        float *o = a->out + off;
        const float *x = a->ins[0] + off;
        const float *y = a->nin > 1 ? a->ins[1] + off : x;
        if (a->nin > 1)
            for (size_t i = 0; i < m; i++)
                o[i] = x[i] + y[i];
        else
            for (size_t i = 0; i < m; i++)
                o[i] = x[i];
        for (int k = 2; k < a->nin; k++) {
            const float *z = a->ins[k] + off;
            for (size_t i = 0; i < m; i++)
                o[i] += z[i];
        }
    }
}

/*
 * Seconds one thread takes to sum nin inputs of `bytes` each into one output of `bytes`;
 * < 0 when out of memory, or when the sum came out wrong.
 */
static double sum_floor(int nin, size_t bytes, double target_s) {
    sum_arg_t a;
    memset(&a, 0, sizeof a);
    a.nin = nin;
    a.n = bytes / sizeof(float);
    a.out = bench_coll_alloc(bytes);
    int ok = a.out != NULL;
    for (int k = 0; k < nin; k++) {
        float *p = bench_coll_alloc(bytes);
        if (p)
            bench_coll_fill(p, k, 0, a.n);
        else
            ok = 0;
        a.ins[k] = p;
    }
    double t = -1;
    if (ok) {
        t = time_kernel(sum_kernel, &a, target_s);
        if (a.out[0] != bench_coll_value_sum(nin, 0) ||
            a.out[a.n - 1] != bench_coll_value_sum(nin, a.n - 1))
            t = -1;
    }
    free(a.out);
    for (int k = 0; k < nin; k++)
        free((void *)a.ins[k]);
    return t;
}

/* ---------------------------------------------------------------------------------------- */
/* The collectives, run by every rank */

typedef struct rank_result {
    long bad;         /* mismatching elements among those checked */
    size_t bad_index; /* first one, in recv */
    float got, want;  /* its values */
    char msg[256];    /* failure of a call */
} rank_result_t;

typedef struct job {
    variant_t v;
    size_t count;
    double target_s;
    double time_s; /* written by rank 0: mean seconds per call, max over ranks */
    long iters;    /* written by rank 0 */
    double cpus;   /* written by rank 0: process CPU seconds / wall seconds over its timed loop */
    long faults;   /* written by rank 0: page faults of the process during its timed loop */
    rank_result_t res[MAX_WORLD];
} job_t;

typedef struct bufs {
    float *send, *recv;         /* as passed to the collective */
    float *send_mem, *recv_mem; /* what was allocated (send_mem is NULL in place) */
    size_t send_elems, recv_elems;
} bufs_t;

static void poison(const job_t *job, const bufs_t *b, int r);

static int alloc_bufs(fsdp_ctx_t *ctx, const job_t *job, int r, int n, bufs_t *b) {
    size_t c = job->count;
    memset(b, 0, sizeof *b);
    switch (job->v) {
    case V_AG_IN:
    case V_AG_OUT:
        b->send_elems = c;
        b->recv_elems = c * (size_t)n;
        break;
    case V_RS:
        b->send_elems = c * (size_t)n;
        b->recv_elems = c;
        break;
    default:
        b->send_elems = c;
        b->recv_elems = c;
        break;
    }
    int rc =
        fsdp_mem_alloc(ctx, FSDP_MEM_COMM, b->recv_elems * sizeof(float), (void **)&b->recv_mem);
    if (rc == FSDP_OK && job->v != V_AG_IN)
        rc = fsdp_mem_alloc(ctx, FSDP_MEM_COMM, b->send_elems * sizeof(float),
                            (void **)&b->send_mem);
    if (rc != FSDP_OK) return rc;
    b->recv = b->recv_mem;
    b->send = job->v == V_AG_IN ? b->recv_mem + (size_t)r * c : b->send_mem;
    /* First touch of every page, by the rank that owns the buffer. */
    bench_coll_fill(b->send, r, 0, b->send_elems);
    poison(job, b, r);
    return FSDP_OK;
}

/* Fills what the collective writes with NaNs (all bits set), keeping the in-place send. */
static void poison(const job_t *job, const bufs_t *b, int r) {
    if (job->v == V_AG_IN) {
        memset(b->recv, 0xff, (size_t)r * job->count * sizeof(float));
        memset(b->recv + (size_t)(r + 1) * job->count, 0xff,
               (b->recv_elems - (size_t)(r + 1) * job->count) * sizeof(float));
    } else {
        memset(b->recv, 0xff, b->recv_elems * sizeof(float));
    }
}

static float expected(const job_t *job, int r, int n, size_t k) {
    switch (job->v) {
    case V_AG_IN:
    case V_AG_OUT:
        return bench_coll_value((int)(k / job->count), k % job->count);
    case V_RS:
        return bench_coll_value_sum(n, (size_t)r * job->count + k);
    default:
        return bench_coll_value_sum(n, k);
    }
}

static void check_at(const job_t *job, const bufs_t *b, int r, int n, size_t k,
                     rank_result_t *res) {
    float want = expected(job, r, n, k);
    if (b->recv[k] == want) return;
    if (res->bad++ == 0) {
        res->bad_index = k;
        res->got = b->recv[k];
        res->want = want;
    }
}

/* Checks every element of small results; of large ones, the ends of every chunk and 4096
 * positions spread over the buffer. */
static void verify(const job_t *job, const bufs_t *b, int r, int n, rank_result_t *res) {
    size_t total = b->recv_elems;
    if (total <= 65536) {
        for (size_t k = 0; k < total; k++)
            check_at(job, b, r, n, k, res);
        return;
    }
    size_t chunk = is_gather(job->v) ? job->count : total;
    for (size_t s = 0; s < total; s += chunk) {
        check_at(job, b, r, n, s, res);
        check_at(job, b, r, n, s + chunk - 1, res);
    }
    for (size_t j = 0; j < 4096; j++)
        check_at(job, b, r, n, (j * 2654435761u) % total, res);
}

static int call(fsdp_pg_t *pg, const job_t *job, const bufs_t *b) {
    switch (job->v) {
    case V_AG_IN:
    case V_AG_OUT:
        return fsdp_pg_all_gather(pg, b->send, b->recv, job->count, FSDP_DTYPE_F32, NULL);
    case V_RS:
        return fsdp_pg_reduce_scatter(pg, b->send, b->recv, job->count, FSDP_DTYPE_F32,
                                      FSDP_REDOP_SUM, NULL);
    default:
        return fsdp_pg_all_reduce(pg, b->send, b->recv, job->count, FSDP_DTYPE_F32, FSDP_REDOP_SUM,
                                  NULL);
    }
}

/* Runs `iters` calls after a barrier; *max_s receives the slowest rank's elapsed time. With
 * usage != NULL, also measures what the whole process used during this rank's loop. */
static int timed_loop(fsdp_pg_t *pg, const job_t *job, const bufs_t *b, long iters, double *max_s,
                      job_t *usage) {
    double cpu0 = 0, cpu1 = 0;
    long faults0 = 0, faults1 = 0;
    int rc = fsdp_pg_barrier(pg, NULL);
    if (usage) process_usage(&cpu0, &faults0);
    double t0 = bench_now_s();
    for (long i = 0; i < iters && rc == FSDP_OK; i++)
        rc = call(pg, job, b);
    double t = bench_now_s() - t0;
    if (usage) {
        process_usage(&cpu1, &faults1);
        usage->cpus = t > 0 ? (cpu1 - cpu0) / t : 0;
        usage->faults = faults1 - faults0;
    }
    if (rc == FSDP_OK) rc = fsdp_pg_all_reduce(pg, &t, &t, 1, FSDP_DTYPE_F64, FSDP_REDOP_MAX, NULL);
    *max_s = t;
    return rc;
}

static int rank_main(fsdp_ctx_t *ctx, void *arg) {
    job_t *job = arg;
    fsdp_pg_t *pg = fsdp_ctx_pg(ctx);
    int r = fsdp_pg_rank(pg), n = fsdp_pg_size(pg);
    rank_result_t *res = &job->res[r];
    bufs_t b;
    double t = 0;
    long iters = 1;
    int rc = alloc_bufs(ctx, job, r, n, &b);
    if (rc != FSDP_OK) {
        snprintf(res->msg, sizeof res->msg, "allocation: %s", fsdp_ctx_last_error(ctx));
        goto out;
    }
    /* Warm-up, then one checked call from poisoned buffers. */
    rc = call(pg, job, &b);
    if (rc == FSDP_OK) {
        poison(job, &b, r);
        rc = call(pg, job, &b);
    }
    if (rc != FSDP_OK) goto fail;
    verify(job, &b, r, n, res);
    /* Calibration. Every rank takes the same decisions: they depend on the max over ranks. */
    for (;;) {
        rc = timed_loop(pg, job, &b, iters, &t, NULL);
        if (rc != FSDP_OK) goto fail;
        if (t >= job->target_s / 10 || iters >= (1L << 24)) break;
        iters *= 4;
    }
    double per = t / (double)iters;
    iters = (long)(job->target_s / (per > 0 ? per : 1e-9));
    if (iters < 3) iters = 3;
    /* The measurement, from poisoned buffers, checked afterwards. */
    poison(job, &b, r);
    rc = timed_loop(pg, job, &b, iters, &t, r == 0 ? job : NULL);
    if (rc != FSDP_OK) goto fail;
    verify(job, &b, r, n, res);
    if (r == 0) {
        job->time_s = t / (double)iters;
        job->iters = iters;
    }
    goto out;
fail:
    snprintf(res->msg, sizeof res->msg, "%s: %s", fsdp_err_name(rc),
             fsdp_pg_last_error(pg)[0] ? fsdp_pg_last_error(pg) : fsdp_strerror(rc));
out:
    fsdp_mem_free(ctx, b.recv_mem);
    fsdp_mem_free(ctx, b.send_mem);
    return rc;
}

/* ---------------------------------------------------------------------------------------- */
/* Driver */

typedef struct options {
    int quick;
    int world; /* 0: 2 and 4 */
    int op;    /* -1: all; else FSDP_COLL_ALL_GATHER, _REDUCE_SCATTER or _ALL_REDUCE */
    size_t min_bytes, max_bytes;
} options_t;

typedef struct tally {
    int pass, miss;
} tally_t;

static void usage(FILE *f) {
    fprintf(
        f,
        "usage: bench_sim_coll [--quick] [--world N] [--op OP] [--min-bytes B] [--max-bytes B]\n"
        "                      [--help]\n"
        "\n"
        "Bus bandwidth of the sim backend's collectives (f32) for messages of 1 KiB and up,\n"
        "doubling, beside a one-thread memcpy floor and a one-thread summing floor.\n"
        "\n"
        "  --quick        messages up to 16 MiB and shorter measurements (well under 30 s)\n"
        "  --world N      only world size N (2..%d; default: 2 and 4)\n"
        "  --op OP        only all_gather, reduce_scatter or all_reduce\n"
        "  --max-bytes B  largest message (nccl-tests' size), a number with an optional K, M\n"
        "                 or G suffix (powers of 1024); default 256M, 16M with --quick\n"
        "  --min-bytes B  smallest message, the same way (default 1K); sizes double from it\n"
        "  --help         this text\n",
        MAX_WORLD);
}

static int parse_bytes(const char *s, size_t *out) {
    char *end;
    unsigned long long v = strtoull(s, &end, 10);
    if (end == s) return -1;
    unsigned long long mul = 1;
    if (*end == 'K' || *end == 'k')
        mul = 1ull << 10;
    else if (*end == 'M' || *end == 'm')
        mul = 1ull << 20;
    else if (*end == 'G' || *end == 'g')
        mul = 1ull << 30;
    if (mul != 1) end++;
    if (*end == 'i' && mul != 1) end++;
    if (*end == 'B') end++;
    if (*end || v == 0 || v > SIZE_MAX / mul) return -1;
    *out = (size_t)(v * mul);
    return 0;
}

/* Takes the value of option `name` from "--name=value" or "--name value". */
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
    int have_max = 0;
    for (int i = 1; i < argc; i++) {
        const char *v;
        if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
            usage(stdout);
            exit(0);
        } else if (strcmp(argv[i], "--quick") == 0) {
            o->quick = 1;
        } else if ((v = opt_value(argc, argv, &i, "--world"))) {
            char *end;
            long w = strtol(v, &end, 10);
            if (*end || w < 2 || w > MAX_WORLD) {
                fprintf(stderr, "bench_sim_coll: --world wants 2..%d, got '%s'\n", MAX_WORLD, v);
                return -1;
            }
            o->world = (int)w;
        } else if ((v = opt_value(argc, argv, &i, "--op"))) {
            if (strcmp(v, "all_gather") == 0)
                o->op = FSDP_COLL_ALL_GATHER;
            else if (strcmp(v, "reduce_scatter") == 0)
                o->op = FSDP_COLL_REDUCE_SCATTER;
            else if (strcmp(v, "all_reduce") == 0)
                o->op = FSDP_COLL_ALL_REDUCE;
            else {
                fprintf(stderr,
                        "bench_sim_coll: --op wants all_gather, reduce_scatter or all_reduce, "
                        "got '%s'\n",
                        v);
                return -1;
            }
        } else if ((v = opt_value(argc, argv, &i, "--max-bytes"))) {
            if (parse_bytes(v, &o->max_bytes) < 0 || o->max_bytes < MIN_BYTES) {
                fprintf(stderr, "bench_sim_coll: --max-bytes wants a size >= 1K, got '%s'\n", v);
                return -1;
            }
            have_max = 1;
        } else if ((v = opt_value(argc, argv, &i, "--min-bytes"))) {
            if (parse_bytes(v, &o->min_bytes) < 0 || o->min_bytes < MIN_BYTES) {
                fprintf(stderr, "bench_sim_coll: --min-bytes wants a size >= 1K, got '%s'\n", v);
                return -1;
            }
        } else {
            fprintf(stderr, "bench_sim_coll: unknown or incomplete option '%s'\n", argv[i]);
            usage(stderr);
            return -1;
        }
    }
    if (!have_max) o->max_bytes = o->quick ? MAX_BYTES_QUICK : MAX_BYTES_FULL;
    if (!o->min_bytes) o->min_bytes = MIN_BYTES;
    if (o->min_bytes > o->max_bytes) {
        fprintf(stderr, "bench_sim_coll: --min-bytes is larger than --max-bytes\n");
        return -1;
    }
    return 0;
}

static fsdp_coll_kind_t variant_kind(variant_t v) {
    return is_gather(v) ? FSDP_COLL_ALL_GATHER
           : v == V_RS  ? FSDP_COLL_REDUCE_SCATTER
                        : FSDP_COLL_ALL_REDUCE;
}

static void print_table_header(variant_t v, int n) {
    printf("\n## %s, world size %d\n", variant_title[v], n);
    if (is_gather(v)) {
        printf("# floor memcpy_GB/s: one thread memcpy of (N-1)/N * size bytes, what one rank "
               "copies from its peers\n");
        printf("# ratio = busbw / memcpy_GB/s; target >= %.2f for size >= %zu MiB at world size "
               "%d\n",
               AG_TARGET, TARGET_MIN_BYTES / MIB, TARGET_WORLD);
        if (v == V_AG_OUT)
            printf("# out of place: each rank also copies its own chunk (size/N bytes) into recv; "
                   "busbw does not count that copy\n");
        printf("%12s %10s %7s %11s %10s %10s %11s %6s %6s %5s %6s\n", "size", "count", "iters",
               "time_us", "algbw_GB/s", "busbw_GB/s", "memcpy_GB/s", "ratio", "target", "cpus",
               "faults");
    } else {
        if (v == V_RS)
            printf("# floor sum_us: one thread sums all N ranks' send buffers, N inputs of size "
                   "bytes each, into one output of size bytes\n");
        else
            printf("# floor sum_us: one thread sums all N ranks' send buffers, N inputs of size "
                   "bytes each, into one output of size bytes\n"
                   "# (the collective also writes every slice to all N recv buffers: N times the "
                   "floor's output bytes)\n");
        printf("# ratio = time_us / (sum_us / N); target <= %.2f for size >= %zu MiB at world "
               "size %d\n",
               RED_TARGET, TARGET_MIN_BYTES / MIB, TARGET_WORLD);
        printf("%12s %10s %7s %11s %10s %10s %11s %11s %6s %6s %5s %6s\n", "size", "count", "iters",
               "time_us", "algbw_GB/s", "busbw_GB/s", "sum_us", "sum/N_us", "ratio", "target",
               "cpus", "faults");
    }
}

/* Runs one row; returns 0, or -1 after printing why the run failed. */
static int run_row(const options_t *o, variant_t v, int n, size_t bytes, tally_t *tally) {
    double target_s = o->quick ? 0.02 : 0.15;
    double floor_s = o->quick ? 0.01 : 0.05;
    size_t count = bench_coll_count(variant_kind(v), bytes, n);
    if (count == 0) return 0;
    size_t size = bench_coll_msg_bytes(variant_kind(v), count, n);
    int targeted = n == TARGET_WORLD && size >= TARGET_MIN_BYTES;

    /* The floor first, while no rank thread exists. */
    double copy_bw = 0, sum_s = 0;
    if (is_gather(v)) {
        copy_bw = memcpy_floor((size_t)(n - 1) * count * sizeof(float), floor_s);
        if (copy_bw < 0) {
            fprintf(stderr, "bench_sim_coll: out of memory for the memcpy floor\n");
            return -1;
        }
    } else {
        sum_s = sum_floor(n, size, floor_s);
        if (sum_s < 0) {
            fprintf(stderr, "bench_sim_coll: summing floor of %zu bytes x %d failed (memory)\n",
                    size, n);
            return -1;
        }
    }

    job_t *job = calloc(1, sizeof *job);
    if (!job) {
        fprintf(stderr, "bench_sim_coll: out of memory\n");
        return -1;
    }
    job->v = v;
    job->count = count;
    job->target_s = target_s;
    fsdp_sim_options_t so;
    fsdp_sim_options_init(&so);
    so.world_size = n;
    int status[MAX_WORLD];
    int rc = fsdp_sim_run(&so, rank_main, job, status);
    char hb[32];
    int failed = 0;
    for (int r = 0; r < n; r++) {
        const rank_result_t *res = &job->res[r];
        if (status[r] != FSDP_OK || res->msg[0]) {
            fprintf(stderr, "bench_sim_coll: %s, world %d, %s: rank %d failed: %s\n",
                    fsdp_coll_name(variant_kind(v)), n, human(size, hb, sizeof hb), r,
                    res->msg[0] ? res->msg : fsdp_strerror(status[r]));
            failed = 1;
        }
        if (res->bad) {
            fprintf(stderr,
                    "bench_sim_coll: %s, world %d, %s: rank %d: %ld wrong element(s) in recv, "
                    "first at index %zu: got %g, want %g\n",
                    fsdp_coll_name(variant_kind(v)), n, human(size, hb, sizeof hb), r, res->bad,
                    res->bad_index, (double)res->got, (double)res->want);
            failed = 1;
        }
    }
    if (rc != FSDP_OK && !failed) {
        fprintf(stderr, "bench_sim_coll: the sim run failed: %s\n", fsdp_strerror(rc));
        failed = 1;
    }
    double t = job->time_s, cpus = job->cpus;
    long iters = job->iters, faults = job->faults;
    free(job);
    if (failed) return -1;

    double algbw = (double)size / t / GB;
    double busbw = algbw * bench_coll_bus_factor(variant_kind(v), n);
    const char *verdict = "";
    if (is_gather(v)) {
        double ratio = busbw * GB / copy_bw;
        if (targeted) verdict = ratio >= AG_TARGET ? "PASS" : "MISS";
        printf("%12zu %10zu %7ld %11.1f %10.2f %10.2f %11.2f %6.2f %6s %5.2f %6ld\n", size, count,
               iters, t * 1e6, algbw, busbw, copy_bw / GB, ratio, verdict, cpus, faults);
    } else {
        double ratio = t / (sum_s / n);
        if (targeted) verdict = ratio <= RED_TARGET ? "PASS" : "MISS";
        printf("%12zu %10zu %7ld %11.1f %10.2f %10.2f %11.1f %11.1f %6.2f %6s %5.2f %6ld\n", size,
               count, iters, t * 1e6, algbw, busbw, sum_s * 1e6, sum_s / n * 1e6, ratio, verdict,
               cpus, faults);
    }
    fflush(stdout);
    if (targeted) {
        if (verdict[0] == 'P')
            tally[v].pass++;
        else
            tally[v].miss++;
    }
    return 0;
}

int main(int argc, char **argv) {
    options_t o;
    if (parse_args(argc, argv, &o) < 0) return 2;
    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    double load = -1;
    FILE *lf = fopen("/proc/loadavg", "r");
    if (lf) {
        if (fscanf(lf, "%lf", &load) != 1) load = -1;
        fclose(lf);
    }
    int worlds[2] = {2, 4}, nworlds = 2;
    if (o.world) {
        worlds[0] = o.world;
        nworlds = 1;
    }
    char lo[32], hi[32];
    printf("# bench_sim_coll: sim backend collectives, f32, sizes %s..%s%s\n",
           human(o.min_bytes, lo, sizeof lo), human(o.max_bytes, hi, sizeof hi),
           o.quick ? " (--quick)" : "");
    printf("# machine: %ld online CPU(s); each rank is a thread with a communication thread of "
           "its own\n",
           ncpu);
    if (load >= 0)
        printf("# load average (1 min) at start: %.2f%s\n", load,
               load > 0.5 ? " -- other processes are using the CPUs; expect noisy numbers" : "");
    printf("# note: on a 2-core machine world size 4 oversubscribes the cores (4 ranks copying "
           "on 2 cores)%s\n",
           ncpu >= 0 && ncpu < 4 ? "; that is the case here" : "");
    printf("# time_us: mean time per collective after warm-up, the slowest rank's; size: "
           "nccl-tests' message bytes\n");
    printf("# (all_gather: N * count * 4, reduce_scatter: N * count * 4, all_reduce: count * 4); "
           "algbw = size / time;\n");
    printf("# busbw = algbw * (N-1)/N (all_gather, reduce_scatter), algbw * 2(N-1)/N "
           "(all_reduce); GB = 10^9 bytes\n");
    printf("# floors are measured on one thread of this process, same sizes, while no rank "
           "runs; every result is checked\n");
    printf("# cpus: CPU seconds of the whole process per wall second during rank 0's timed loop "
           "(at most min(N, CPUs));\n"
           "#   far below that for large sizes means the ranks waited for a CPU (other busy "
           "processes distort the numbers)\n"
           "# faults: page faults of the process during that loop (buffers are touched before "
           "timing, so 0 is expected)\n");

    tally_t tally[V_COUNT];
    memset(tally, 0, sizeof tally);
    double t0 = bench_now_s();
    for (int v = 0; v < V_COUNT; v++) {
        if (o.op >= 0 && (int)variant_kind((variant_t)v) != o.op) continue;
        for (int w = 0; w < nworlds; w++) {
            print_table_header((variant_t)v, worlds[w]);
            for (size_t bytes = o.min_bytes; bytes <= o.max_bytes; bytes *= 2)
                if (run_row(&o, (variant_t)v, worlds[w], bytes, tally) < 0) return 1;
        }
    }
    printf("\n# targets (size >= %zu MiB, world size %d):", TARGET_MIN_BYTES / MIB, TARGET_WORLD);
    int any = 0;
    for (int v = 0; v < V_COUNT; v++) {
        if (tally[v].pass + tally[v].miss == 0) continue;
        static const char *const shortname[V_COUNT] = {
            "all_gather in place", "all_gather out of place", "reduce_scatter", "all_reduce"};
        printf("%s %s %d PASS %d MISS", any ? ";" : "", shortname[v], tally[v].pass, tally[v].miss);
        any = 1;
    }
    printf("%s\n# total %.1f s\n", any ? "" : " no row in range", bench_now_s() - t0);
    return 0;
}
