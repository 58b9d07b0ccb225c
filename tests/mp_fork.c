/* SPDX-License-Identifier: MIT */
/*
 * mp_fork.c: rank processes (see mp_fork.h).
 */
#define _GNU_SOURCE /* mkdtemp, nftw */
#include "mp_fork.h"

#include <errno.h>
#include <ftw.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "core/sanitizer.h"
#include "tap.h"

/* What mp_shared_alloc() puts before the caller's bytes: the mapping's length. */
typedef struct mp_head {
    size_t bytes;
    _Alignas(max_align_t) unsigned char data[];
} mp_head_t;

void *mp_shared_alloc(size_t bytes) {
    size_t total = sizeof(mp_head_t) + bytes;
    mp_head_t *h = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (h == MAP_FAILED) tap_bail("mmap of %zu shared bytes: %s", total, strerror(errno));
    h->bytes = total; /* an anonymous mapping starts zeroed */
    return h->data;
}

void mp_shared_free(void *p) {
    if (!p) return;
    mp_head_t *h = (mp_head_t *)((unsigned char *)p - offsetof(mp_head_t, data));
    munmap(h, h->bytes);
}

void mp_mutex_init(pthread_mutex_t *mu) {
    pthread_mutexattr_t a;
    if (pthread_mutexattr_init(&a) != 0 ||
        pthread_mutexattr_setpshared(&a, PTHREAD_PROCESS_SHARED) != 0 ||
        pthread_mutex_init(mu, &a) != 0)
        tap_bail("cannot make a process-shared mutex");
    pthread_mutexattr_destroy(&a);
}

/* A rank's context (rank of n, seed); err names the failure. */
static int rank_ctx(int rank, int n, uint64_t seed, fsdp_ctx_t **ctx, char *err, size_t cap) {
    fsdp_ctx_options_t co;
    fsdp_ctx_options_init(&co);
    co.rank = rank;
    co.world_size = n;
    co.seed = seed;
    *ctx = NULL;
    int rc = fsdp_ctx_create(&co, ctx);
    if (rc < 0) snprintf(err, cap, "fsdp_ctx_create: %s", fsdp_err_name(rc));
    return rc;
}

int mp_gloo_rank(int rank, int n, uint64_t seed, fsdp_store_t *store, fsdp_ctx_t **ctx,
                 fsdp_pg_t **pg, char *err, size_t cap) {
    *pg = NULL;
    int rc = rank_ctx(rank, n, seed, ctx, err, cap);
    if (rc < 0) return rc;
    fsdp_gloo_options_t go;
    fsdp_gloo_options_init(&go);
    go.timeout_ms = MP_CONNECT_MS;
    rc = fsdp_pg_create_gloo(*ctx, store, &go, pg);
    if (rc < 0)
        snprintf(err, cap, "fsdp_pg_create_gloo: %s: %s", fsdp_err_name(rc),
                 fsdp_ctx_last_error(*ctx));
    return rc;
}

int mp_nccl_rank(int rank, int n, uint64_t seed, fsdp_store_t *store, fsdp_ctx_t **ctx,
                 fsdp_device_t **dev, char *err, size_t cap) {
    *dev = NULL;
    int rc = rank_ctx(rank, n, seed, ctx, err, cap);
    if (rc < 0) return rc;
    fsdp_nccl_options_t no;
    fsdp_nccl_options_init(&no);
    no.device = rank;
    no.timeout_ms = 2 * MP_CONNECT_MS;
    fsdp_pg_t *pg = NULL;
    const char *what = "fsdp_pg_create_nccl";
    rc = fsdp_pg_create_nccl(*ctx, store, &no, &pg);
    if (rc == 0) {
        fsdp_device_options_t d;
        fsdp_device_options_init(&d);
        d.ordinal = rank;
        what = "fsdp_device_create(cuda)";
        rc = fsdp_device_create(*ctx, FSDP_DEVICE_CUDA, &d, dev);
    }
    if (rc == 0) {
        what = "fsdp_ctx_set_device";
        rc = fsdp_ctx_set_device(*ctx, *dev);
    }
    if (rc < 0)
        snprintf(err, cap, "%s: %s: %s", what, fsdp_err_name(rc), fsdp_ctx_last_error(*ctx));
    return rc;
}

static int rm_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw) {
    (void)sb, (void)flag, (void)ftw;
    return remove(path);
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Reaps the rank processes still running (pid[r] > 0) without blocking; clears the pids of
 * those that ended. Returns how many are left, or -1 when waitpid() failed. */
static int reap(int n, pid_t *pid, int *rc) {
    int left = 0;
    for (int r = 0; r < n; r++) {
        if (pid[r] <= 0) continue;
        int ws = 0;
        pid_t p = waitpid(pid[r], &ws, WNOHANG);
        if (p == 0 || (p < 0 && errno == EINTR)) {
            left++;
            continue;
        }
        if (p < 0) {
            tap_diag("waitpid of rank %d: %s", r, strerror(errno));
            return -1;
        }
        pid[r] = 0;
        if (WIFEXITED(ws) && WEXITSTATUS(ws) == 0) continue;
        tap_diag("rank %d process ended abnormally (%s %d)", r,
                 WIFSIGNALED(ws) ? "signal" : "exit status",
                 WIFSIGNALED(ws) ? WTERMSIG(ws) : WEXITSTATUS(ws));
        if (*rc == FSDP_OK) *rc = FSDP_EREMOTE;
    }
    return left;
}

/* ThreadSanitizer slows the rank processes several times over (and make check runs tests in
 * parallel on a small machine), so the deadlines, which only catch hangs, stretch with it. */
#if FSDP_UNDER_TSAN
#define MP_DEADLINE_SCALE 5
#elif FSDP_UNDER_ASAN
#define MP_DEADLINE_SCALE 2
#else
#define MP_DEADLINE_SCALE 1
#endif

int mp_fork_ranks(int n, mp_rank_fn fn, void *arg, int deadline_s, int *status) {
    if (n < 1 || n > MP_MAX_RANKS) tap_bail("mp_fork_ranks: %d ranks", n);
    deadline_s *= MP_DEADLINE_SCALE;
    int *st = mp_shared_alloc(MP_MAX_RANKS * sizeof *st);
    for (int r = 0; r < n; r++)
        st[r] = FSDP_EINTERNAL; /* until the rank says otherwise */
    const char *tmp = getenv("TMPDIR");
    char dir[512];
    snprintf(dir, sizeof dir, "%s/fsdp-gloo-XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (!mkdtemp(dir)) tap_bail("mkdtemp(%s): %s", dir, strerror(errno));
    /* What stdio holds now would be written again by every child. */
    fflush(stdout);
    fflush(stderr);
    pid_t pid[MP_MAX_RANKS] = {0};
    for (int r = 0; r < n; r++) {
        pid[r] = fork();
        if (pid[r] < 0) tap_bail("fork: %s", strerror(errno));
        if (pid[r] == 0) {
            st[r] = fn(r, n, dir, arg);
            fflush(stdout);
            fflush(stderr);
            _exit(0);
        }
    }
    int rc = FSDP_OK, left;
    const double deadline = now_s() + deadline_s;
    int killed = 0;
    while ((left = reap(n, pid, &rc)) > 0) {
        if (!killed && now_s() > deadline) {
            tap_diag("the rank processes passed %d s: killing the %d left", deadline_s, left);
            for (int r = 0; r < n; r++)
                if (pid[r] > 0) kill(pid[r], SIGKILL);
            killed = 1;
        }
        struct timespec ts = {0, 5 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    if (left < 0 && rc == FSDP_OK) rc = FSDP_EINTERNAL;
    if (killed) rc = FSDP_ETIMEDOUT;
    for (int r = 0; r < n; r++) {
        if (status) status[r] = st[r];
        if (st[r] < 0 && rc == FSDP_OK) rc = st[r];
    }
    mp_shared_free(st);
    nftw(dir, rm_entry, 8, FTW_DEPTH | FTW_PHYS);
    return rc;
}
