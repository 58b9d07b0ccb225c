/* SPDX-License-Identifier: MIT */
/*
 * gemm_clock.c: a preloaded library that clocks a process's single-precision matrix products.
 *
 *   GEMM_CLOCK_DIR=DIR LD_PRELOAD=bench/.libs/libgemmclock.so PROGRAM ...
 *
 * It stands in front of the BLAS's cblas_sgemm (libfsdp's CPU device) and sgemm_ (the Fortran
 * entry PyTorch's CPU matrix products call), forwards every call to the next library that
 * defines the symbol, and adds the call's wall time (CLOCK_MONOTONIC), its 2 m n k FLOPs and
 * one call to a small record in DIR/gemm.PID. The record is a shared mapping of that file,
 * updated after every call, so a process that leaves without running destructors (Python's
 * multiprocessing children end with os._exit) still leaves its totals behind. A call made from
 * inside another clocked call (a BLAS whose cblas_ entry calls its Fortran one) is not counted
 * twice. Without GEMM_CLOCK_DIR the library forwards and counts nothing.
 *
 * overhead_sweep.sh --gemm reads the records: the products of one step are the difference
 * between two runs that differ only in their number of steps, which leaves out the start-up and
 * the first steps' page faults.
 *
 * The record is three lines of text rewritten in place: "calls N", "seconds S", "gflop F".
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <link.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#define RECORD_BYTES 128

typedef void cblas_sgemm_fn(int order, int ta, int tb, int m, int n, int k, float alpha,
                            const float *a, int lda, const float *b, int ldb, float beta, float *c,
                            int ldc);
typedef void sgemm_fn(const char *ta, const char *tb, const int *m, const int *n, const int *k,
                      const float *alpha, const float *a, const int *lda, const float *b,
                      const int *ldb, const float *beta, float *c, const int *ldc);

/* The entries this library exports in front of the BLAS's (the enums of cblas.h pass as int). */
void cblas_sgemm(int order, int ta, int tb, int m, int n, int k, float alpha, const float *a,
                 int lda, const float *b, int ldb, float beta, float *c, int ldc);
void sgemm_(const char *ta, const char *tb, const int *m, const int *n, const int *k,
            const float *alpha, const float *a, const int *lda, const float *b, const int *ldb,
            const float *beta, float *c, const int *ldc);

static pthread_once_t once = PTHREAD_ONCE_INIT;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static cblas_sgemm_fn *next_cblas;
static sgemm_fn *next_fortran;
static char *record;  /* the shared mapping of DIR/gemm.PID, or NULL */
static pid_t record_pid; /* the process `record` and the totals belong to (0: none yet) */
static unsigned long long calls;
static double seconds, gflop;
static __thread int depth;

/* What find_next looks for and what it found. */
struct search {
    const char *name;
    void *self; /* this library's own definition, skipped */
    void *found;
};

static int search_object(struct dl_phdr_info *info, size_t size, void *arg) {
    (void)size;
    struct search *s = arg;
    if (s->found || !info->dlpi_name || !*info->dlpi_name) return 0;
    void *h = dlopen(info->dlpi_name, RTLD_LAZY | RTLD_NOLOAD);
    if (!h) return 0;
    void *f = dlsym(h, s->name);
    if (f && f != s->self) s->found = f;
    dlclose(h);
    return s->found != NULL;
}

/* The next definition of `name` after this library's. RTLD_NEXT only sees the global scope; a
 * BLAS that a dlopen'ed library brought in privately (PyTorch's libtorch_cpu, loaded by Python)
 * is found by asking every loaded object in turn. */
static void *find_next(const char *name, void *self) {
    void *f = dlsym(RTLD_NEXT, name);
    if (f) return f;
    struct search s = {name, self, NULL};
    dl_iterate_phdr(search_object, &s);
    return s.found;
}

static void setup(void) {
    next_cblas = (cblas_sgemm_fn *)find_next("cblas_sgemm", (void *)cblas_sgemm);
    next_fortran = (sgemm_fn *)find_next("sgemm_", (void *)sgemm_);
}

/* Opens this process's record, DIR/gemm.PID, with its totals at zero. A child forked after the
 * parent's first product opens its own (record_pid tells), so neither adds to the other's. */
static void open_record(void) {
    if (record) munmap(record, RECORD_BYTES);
    record = NULL;
    calls = 0;
    seconds = gflop = 0;
    record_pid = getpid();
    const char *dir = getenv("GEMM_CLOCK_DIR");
    if (!dir || !*dir) return;
    char path[4096];
    if (snprintf(path, sizeof path, "%s/gemm.%ld", dir, (long)record_pid) >= (int)sizeof path)
        return;
    int fd = open(path, O_RDWR | O_CREAT | O_TRUNC, 0644);
    if (fd < 0) return;
    if (ftruncate(fd, RECORD_BYTES) == 0) {
        void *p = mmap(NULL, RECORD_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (p != MAP_FAILED) record = p;
    }
    close(fd);
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* Adds one product to the totals and rewrites the record (spaces pad it to its full size). */
static void count(double t, long long m, long long n, long long k) {
    pthread_mutex_lock(&lock);
    if (record_pid != getpid()) open_record();
    if (!record) {
        pthread_mutex_unlock(&lock);
        return;
    }
    calls++;
    seconds += t;
    gflop += 2e-9 * (double)m * (double)n * (double)k;
    char line[RECORD_BYTES];
    int len = snprintf(line, sizeof line, "calls %llu\nseconds %.9f\ngflop %.6f\n", calls,
                       seconds, gflop);
    if (len > 0 && len < RECORD_BYTES) {
        memset(line + len, ' ', RECORD_BYTES - (size_t)len);
        line[RECORD_BYTES - 1] = '\n';
        memcpy(record, line, RECORD_BYTES);
    }
    pthread_mutex_unlock(&lock);
}

/* Before a product: finds the next definitions once, stops if `next` (the one about to be called)
 * is missing (the program linked against a BLAS, so the preload is broken: better than returning
 * a product that was never computed), and returns the start time of an outermost call. */
static double enter(void *const *next, const char *name) {
    pthread_once(&once, setup);
    if (!*next) {
        fprintf(stderr, "gemm_clock: no %s after this library\n", name);
        abort();
    }
    return depth++ == 0 ? now() : 0;
}

/* After a product: counts an outermost call. */
static void leave(double t0, long long m, long long n, long long k) {
    if (--depth == 0) count(now() - t0, m, n, k);
}

void cblas_sgemm(int order, int ta, int tb, int m, int n, int k, float alpha, const float *a,
                 int lda, const float *b, int ldb, float beta, float *c, int ldc) {
    double t0 = enter((void *const *)&next_cblas, "cblas_sgemm");
    next_cblas(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    leave(t0, m, n, k);
}

void sgemm_(const char *ta, const char *tb, const int *m, const int *n, const int *k,
            const float *alpha, const float *a, const int *lda, const float *b, const int *ldb,
            const float *beta, float *c, const int *ldc) {
    double t0 = enter((void *const *)&next_fortran, "sgemm_");
    next_fortran(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    leave(t0, *m, *n, *k);
}
