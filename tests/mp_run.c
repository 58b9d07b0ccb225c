/*
 * mp_run.c: see mp_run.h.
 */
#define _GNU_SOURCE /* mkdtemp, nftw */
#include "mp_run.h"

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

#include "tap.h"

/* How long a whole run may take before its processes are killed. */
#define MP_DEADLINE_S 240

/* What the parent and the children share: the rank statuses, then the job's bytes. */
typedef struct mp_shared {
    int status[FU_MAXR];
    _Alignas(max_align_t) unsigned char job[];
} mp_shared_t;

static int rm_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw) {
    (void)sb, (void)flag, (void)ftw;
    return remove(path);
}

/* One rank process: context, store, Gloo world group, fn. Never returns. */
static void child(mp_shared_t *sh, int rank, const char *dir, fsdp_sim_fn fn) {
    fu_job_t *j = (fu_job_t *)sh->job;
    fu_res_t *r = &j->r[rank];
    fsdp_ctx_t *ctx = NULL;
    fsdp_store_t *store = NULL;
    fsdp_pg_t *pg = NULL;
    fsdp_ctx_options_t co;
    fsdp_ctx_options_init(&co);
    co.rank = rank;
    co.world_size = j->world;
    co.seed = j->seed;
    int rc = fsdp_ctx_create(&co, &ctx);
    if (rc < 0) {
        fu_ck(r, false, "creating the rank's context", "%s", fsdp_err_name(rc));
        goto done;
    }
    FU_TRY(done, "opening the file store", fsdp_store_create_file(dir, &store));
    fsdp_gloo_options_t go;
    fsdp_gloo_options_init(&go);
    go.timeout_ms = 60000;
    FU_TRY(done, "creating the Gloo world group", fsdp_pg_create_gloo(ctx, store, &go, &pg));
    rc = fn(ctx, j);
done:
    sh->status[rank] = rc < 0 ? rc : 0;
    fsdp_ctx_destroy(ctx); /* destroys pg, the world group */
    fsdp_store_destroy(store);
    fflush(stdout);
    fflush(stderr);
    _exit(0);
}

int mp_run_job(fu_job_t *j, size_t size, fsdp_sim_fn fn) {
    if (!fsdp_gloo_available()) return FSDP_ENOTSUP;
    size_t bytes = sizeof(mp_shared_t) + size;
    mp_shared_t *sh = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (sh == MAP_FAILED) tap_bail("mmap of %zu bytes: %s", bytes, strerror(errno));
    memcpy(sh->job, j, size);
    fu_job_t *sj = (fu_job_t *)sh->job;
    for (int r = 0; r < FU_MAXR; r++) {
        sj->r[r].n = 0;
        sh->status[r] = FSDP_EINTERNAL; /* until the rank says otherwise */
    }
    const char *tmp = getenv("TMPDIR");
    char dir[512];
    snprintf(dir, sizeof dir, "%s/fsdp-gloo-XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (!mkdtemp(dir)) tap_bail("mkdtemp(%s): %s", dir, strerror(errno));
    fflush(stdout);
    fflush(stderr);
    pid_t pid[FU_MAXR] = {0};
    for (int r = 0; r < j->world; r++) {
        pid[r] = fork();
        if (pid[r] < 0) tap_bail("fork: %s", strerror(errno));
        if (pid[r] == 0) child(sh, r, dir, fn);
    }
    int left = j->world, rc = FSDP_OK;
    time_t deadline = time(NULL) + MP_DEADLINE_S;
    bool killed = false;
    while (left > 0) {
        int ws = 0;
        pid_t p = waitpid(-1, &ws, WNOHANG);
        if (p > 0) {
            for (int r = 0; r < j->world; r++)
                if (pid[r] == p) {
                    pid[r] = 0;
                    left--;
                    if (!WIFEXITED(ws) || WEXITSTATUS(ws) != 0) {
                        tap_diag("rank %d process ended abnormally (%s %d)", r,
                                 WIFSIGNALED(ws) ? "signal" : "status",
                                 WIFSIGNALED(ws) ? WTERMSIG(ws) : WEXITSTATUS(ws));
                        rc = FSDP_EREMOTE;
                    }
                }
            continue;
        }
        if (p < 0 && errno != EINTR) break;
        if (!killed && time(NULL) > deadline) {
            tap_diag("the run passed %d s: killing its processes", MP_DEADLINE_S);
            for (int r = 0; r < j->world; r++)
                if (pid[r] > 0) kill(pid[r], SIGKILL);
            killed = true;
            rc = FSDP_ETIMEDOUT;
        }
        struct timespec ts = {0, 5 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    int st[FU_MAXR];
    for (int r = 0; r < FU_MAXR; r++) {
        st[r] = r < j->world ? sh->status[r] : 0;
        if (st[r] < 0 && rc == 0) rc = st[r];
    }
    memcpy(j, sh->job, size);
    munmap(sh, bytes);
    nftw(dir, rm_entry, 8, FTW_DEPTH | FTW_PHYS);
    fu_report_job(j, rc, st);
    return rc;
}
