/* SPDX-License-Identifier: MIT */
/*
 * train_stop.c: fsdp-train's interruption, its timeouts and what a run's checkpoints carry from
 * one run to the next.
 *
 * Interruption. The first SIGINT or SIGTERM only sets a flag. At the end of every step the
 * ranks all-reduce the step time with MAX, and the same all-reduce carries the flag (the largest
 * signal number any rank got), so every rank learns after the same step that the run stops,
 * without a collective of its own: then the ranks save a checkpoint together (when there is a
 * checkpoint directory), rank 0 prints the command that resumes the run, and the process exits
 * with 128 + the signal. A signal after the last step is agreed on by one more all-reduce, so
 * that every rank skips the collective sample and export alike. A second signal exits at once.
 * Under fsdprun, the launcher forwards its first SIGINT or SIGTERM to every rank and waits.
 *
 * Timeouts. The first rendezvous, the build, loading, saving and the end keep the long timeout
 * ($FSDP_TIMEOUT_MS, else the library's default of 300 s); the steps run under --timeout (60 s by
 * default), so a stalled peer is noticed within a minute.
 *
 * The start of a run. Rank 0 resolves --resume (latest: the newest complete checkpoint), checks
 * the flags against the checkpoint's record (train_ckpt.c) and picks the run id (a resumed run
 * keeps its checkpoint's); a world of processes gets rank 0's decision by one broadcast, so
 * every rank starts from the same checkpoint or stops with the same status.
 */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "tools/train.h"

/* The first SIGINT or SIGTERM only sets g_signal; the ranks agree on it at the end of every step
 * (the step time's all-reduce carries it, so it costs no collective of its own), stop together,
 * save and exit with 128 + the signal. A second one exits at once. */
/* The ranks are threads (sim) that read it while the handler writes it: an atomic, lock-free
 * so that the handler may use it (volatile sig_atomic_t orders nothing between threads). */
#if ATOMIC_INT_LOCK_FREE != 2
#error "fsdp-train's signal flag needs a lock-free atomic int"
#endif
static atomic_int g_signal;

int train_pending_signal(void) {
    return atomic_load(&g_signal);
}

/* Whether SIGINT or SIGTERM is pending for the process beside the one being handled: sent
 * together, or while the process was stopped, the two may be taken by two threads, and the
 * thread of the second may run its handler only after the ranks have begun to save. */
static bool other_pending(void) {
    sigset_t p;
    return sigpending(&p) == 0 && (sigismember(&p, SIGINT) == 1 || sigismember(&p, SIGTERM) == 1);
}

static void on_signal(int sig) {
    int saved = errno, none = 0;
    if (other_pending() || !atomic_compare_exchange_strong(&g_signal, &none, sig)) {
        static const char msg[] = "\n" TRAIN_PROG ": a second signal: exiting at once\n";
        ssize_t w = write(STDERR_FILENO, msg, sizeof msg - 1);
        (void)w;
        _exit(128 + sig);
    }
    errno = saved;
}

/* Installs on_signal for SIGINT and SIGTERM; an ignored SIGINT (a background job) stays so. */
void train_install_signals(void) {
    static const int sigs[] = {SIGINT, SIGTERM};
    for (size_t i = 0; i < sizeof sigs / sizeof sigs[0]; i++) {
        struct sigaction sa, old;
        memset(&sa, 0, sizeof sa);
        sa.sa_handler = on_signal;
        sa.sa_flags = SA_RESTART;
        sigemptyset(&sa.sa_mask);
        if (sigaction(sigs[i], NULL, &old) == 0 && old.sa_handler == SIG_IGN) continue;
        sigaction(sigs[i], &sa, NULL);
    }
}

static const char *sig_name(int sig) {
    return sig == SIGINT ? "SIGINT" : sig == SIGTERM ? "SIGTERM" : "a signal";
}

/* Appends arg to buf (cap bytes, at len) quoted for a POSIX shell where it needs it. */
static size_t put_arg(char *buf, size_t cap, size_t len, const char *arg) {
    bool plain = *arg != '\0';
    for (const char *p = arg; *p && plain; p++)
        plain = strchr("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-+./:=,@%",
                       *p) != NULL;
    if (len && len < cap) buf[len++] = ' ';
    if (plain) return len + (size_t)snprintf(buf + len, len < cap ? cap - len : 0, "%s", arg);
    if (len < cap) buf[len++] = '\'';
    for (const char *p = arg; *p; p++)
        len += (size_t)snprintf(buf + len, len < cap ? cap - len : 0, "%s",
                                *p == '\'' ? "'\\''" : (char[]){*p, 0});
    if (len < cap) buf[len++] = '\'';
    if (len < cap) buf[len] = '\0';
    return len;
}

/* The command that resumes this run: fsdprun's own command line when it launched us
 * ($FSDPRUN_COMMAND, quoted by fsdprun), then ours without --resume, then --resume latest
 * (and --checkpoint-dir when it was only implied by --save-every). */
static void resume_command(const job_t *j, char *buf, size_t cap) {
    const char *launcher = getenv("FSDPRUN_COMMAND");
    size_t len = 0;
    buf[0] = '\0';
    if (launcher && *launcher) len = (size_t)snprintf(buf, cap, "%s", launcher);
    bool dir_given = false;
    for (int i = 0; i < j->argc && len < cap; i++) {
        const char *a = j->argv[i];
        if (i > 0 && strcmp(a, "--resume") == 0) {
            i++; /* and its value */
            continue;
        }
        if (i > 0 && strncmp(a, "--resume=", 9) == 0) continue;
        if (strcmp(a, "--checkpoint-dir") == 0 || strncmp(a, "--checkpoint-dir=", 17) == 0)
            dir_given = true;
        len = put_arg(buf, cap, len, a);
    }
    if (!dir_given && len < cap) {
        len = put_arg(buf, cap, len, "--checkpoint-dir");
        len = put_arg(buf, cap, len, j->o->checkpoint_dir);
    }
    if (len < cap) len = put_arg(buf, cap, len, "--resume");
    if (len < cap) put_arg(buf, cap, len, "latest");
    buf[cap - 1] = '\0'; /* a command longer than the buffer is cut, never unterminated */
}

/* The collectives' timeout on every group of rank k. */
void train_set_timeouts(rank_t *k, int64_t ms) {
    fsdp_pg_t *groups[3] = {k->pg, k->shard_pg, k->rep_pg};
    for (int i = 0; i < 3; i++)
        if (groups[i]) fsdp_pg_set_timeout(groups[i], ms);
}

/* The all-reduce that makes every rank see the same stop request (the largest signal number
 * any rank got, 0 for none). */
int train_agree_stop(rank_t *k, int *stop) {
    double mine = (double)atomic_load(&g_signal), all = 0;
    int rc = fsdp_pg_all_reduce(k->pg, &mine, &all, 1, FSDP_DTYPE_F64, FSDP_REDOP_MAX, NULL);
    if (rc < 0) return train_fail(k, "agreeing on a stop", rc);
    *stop = (int)all;
    return 0;
}

/* Saves the checkpoint of `step` (collective). 0 when saved; 1 when it failed and the run goes on
 * (--on-save-error continue); < 0 when it failed and the run stops. Either way a failed save
 * leaves the previous checkpoints as they were. */
int train_save_checkpoint(rank_t *k, int64_t step) {
    const train_opts_t *o = k->j->o;
    char err[1024] = "";
    if (k->r == 0) train_ckpt_cleanup(o->checkpoint_dir);
    train_ckpt_extra_t ex = {.position = fsdp_loader_get_position(k->train_ld),
                             .scaler = k->scaler,
                             .skipped = k->skipped,
                             .run_id = k->j->run_id,
                             .flags = k->j->flags};
    /* rank 0 writes the index while the others wait: the setup's longer timeout */
    train_set_timeouts(k, k->j->setup_timeout_ms);
    int rc =
        train_ckpt_save(k->ctx, k->root, k->opt, o->checkpoint_dir, step, &ex, err, sizeof err);
    train_set_timeouts(k, k->j->train_timeout_ms);
    if (rc == 0) {
        if (k->r == 0) train_ckpt_prune(o->checkpoint_dir, o->keep_last, step);
        if (!o->quiet && !k->j->tty)
            train_say(k, "step %lld: saved %s/step-%lld\n", (long long)step, o->checkpoint_dir,
                      (long long)step);
        return 0;
    }
    if (rc != FSDP_EREMOTE) {
        if (k->j->tty && k->r == 0) putchar('\n'), fflush(stdout);
        fprintf(stderr, "%s: rank %d: %s\n", TRAIN_PROG, k->r, err);
    }
    if (o->save_error_continue) {
        if (k->r == 0)
            fprintf(stderr,
                    "%s: the checkpoint of step %lld was not saved; training goes on "
                    "(--on-save-error continue), the earlier checkpoints are as they were\n",
                    TRAIN_PROG, (long long)step);
        return 1;
    }
    if (k->r == 0)
        fprintf(stderr,
                "%s: stopping at step %lld: the checkpoint was not saved (--on-save-error stop); "
                "the earlier checkpoints are as they were\n",
                TRAIN_PROG, (long long)step);
    return rc;
}

/* The first signal's end of the run, after the ranks agreed on it: a checkpoint of `step` when
 * there is a checkpoint directory, then (rank 0) the resume command. */
int train_stop_run(rank_t *k, int64_t step, int sig) {
    const train_opts_t *o = k->j->o;
    int rc = 0;
    /* every rank records it (sim ranks write the same value) for the exit status */
    __atomic_store_n(&k->j->stop_signal, sig, __ATOMIC_RELAXED);
    if (k->r == 0) {
        if (k->j->tty) putchar('\n'); /* the progress line may be mid-line */
        fflush(stdout);
    }
    if (o->checkpoint_dir) {
        rc = train_save_checkpoint(k, step);
        if (rc != 0) return rc < 0 ? rc : FSDP_EINVAL;
    }
    if (k->r != 0) return 0;
    if (!o->checkpoint_dir) {
        fprintf(stderr,
                "%s: stopped by %s after step %lld of %lld; nothing saved (no --checkpoint-dir "
                "or --save-every)\n",
                TRAIN_PROG, sig_name(sig), (long long)step, (long long)o->steps);
        return 0;
    }
    char cmd[8192];
    resume_command(k->j, cmd, sizeof cmd);
    fprintf(stderr, "%s: stopped by %s after step %lld of %lld; saved %s/step-%lld\n", TRAIN_PROG,
            sig_name(sig), (long long)step, (long long)o->steps, o->checkpoint_dir,
            (long long)step);
    fprintf(stderr, "%s: resume with: %s\n", TRAIN_PROG, cmd);
    return 0;
}

/* $FSDP_TIMEOUT_MS when it is a positive number, else 0. */
static int64_t env_timeout_ms(void) {
    const char *v = getenv("FSDP_TIMEOUT_MS");
    char *end = NULL;
    long long t = v && *v ? strtoll(v, &end, 10) : 0;
    return v && *v && !*end && t > 0 ? (int64_t)t : 0;
}

/* The timeouts (docs/fsdp-train.1, "--timeout"): setup, loading, saves and the end keep
 * $FSDP_TIMEOUT_MS or the library's default (or --timeout when that is longer); the steps use
 * --timeout, else $FSDP_TIMEOUT_MS, else TRAIN_TIMEOUT_DEFAULT_S. */
void train_timeouts(job_t *j) {
    int64_t env = env_timeout_ms(), given = (int64_t)(j->o->timeout_s * 1000.0);
    j->setup_timeout_ms = env ? env : FSDP_PG_DEFAULT_TIMEOUT_MS;
    if (given > j->setup_timeout_ms) j->setup_timeout_ms = given;
    j->train_timeout_ms = given ? given : env ? env : (int64_t)(TRAIN_TIMEOUT_DEFAULT_S * 1000.0);
}

/* A new run's id: 16 hex digits from the kernel's random source (or the clock and pid). */
static void new_run_id(char *buf, size_t cap) {
    uint64_t x = 0;
    int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    if (fd < 0 || read(fd, &x, sizeof x) != (ssize_t)sizeof x) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        x = ((uint64_t)ts.tv_sec * 1000000007u) ^ (uint64_t)ts.tv_nsec ^ ((uint64_t)getpid() << 40);
    }
    if (fd >= 0) close(fd);
    snprintf(buf, cap, "%016llx", (unsigned long long)x);
}

/* What every rank must start from alike: rank 0 decides, the others receive it. */
typedef struct start_rec {
    int32_t status; /* 0, or the exit status (2) after rank 0 said why */
    char resume[4096];
    char run_id[40];
} start_rec_t;

/* --resume resolved (latest, the flags' check) and the run id; rank 0 of a process-per-rank
 * world decides and broadcasts. Returns 0 or an exit status. */
static int start_record(job_t *j, fsdp_ctx_t *ctx, start_rec_t *sr) {
    const train_opts_t *o = j->o;
    memset(sr, 0, sizeof *sr);
    if (!ctx || fsdp_ctx_rank(ctx) == 0) {
        char rid[64] = "";
        if (o->resume)
            sr->status =
                train_ckpt_resolve(o, true, sr->resume, sizeof sr->resume, rid, sizeof rid);
        /* a resumed run keeps its checkpoint's id: all its checkpoints belong to one run */
        if (rid[0] && strlen(rid) < sizeof sr->run_id)
            snprintf(sr->run_id, sizeof sr->run_id, "%s", rid);
        else
            new_run_id(sr->run_id, sizeof sr->run_id);
    }
    if (ctx) {
        start_rec_t got;
        int rc = fsdp_pg_broadcast(fsdp_ctx_pg(ctx), sr, &got, sizeof *sr, FSDP_DTYPE_U8, 0, NULL);
        if (rc < 0) {
            fprintf(stderr, "%s: sharing the start of the run: %s\n", TRAIN_PROG,
                    fsdp_ctx_last_error(ctx));
            return 2;
        }
        *sr = got;
        sr->resume[sizeof sr->resume - 1] = sr->run_id[sizeof sr->run_id - 1] = '\0';
    }
    return sr->status;
}

int train_start(job_t *j, fsdp_ctx_t *ctx) {
    start_rec_t *sr = malloc(sizeof *sr);
    if (!sr) {
        fprintf(stderr, "%s: out of memory\n", TRAIN_PROG);
        return 2;
    }
    int status = start_record(j, ctx, sr);
    if (status == 0 && j->o->resume && !(j->resume_path = strdup(sr->resume))) {
        fprintf(stderr, "%s: out of memory\n", TRAIN_PROG);
        status = 2;
    }
    snprintf(j->run_id, sizeof j->run_id, "%s", sr->run_id);
    free(sr);
    return status;
}
