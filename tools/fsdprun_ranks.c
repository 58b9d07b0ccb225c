/* SPDX-License-Identifier: MIT */
/*
 * fsdprun_ranks.c: the ranks as processes: their environment, starting them, signalling them,
 * reaping them, and the failure policy.
 *
 * Each rank runs in its own process group (so a signal reaches everything it started) with
 * RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, NODE_RANK, NNODES, FSDP_STORE and
 * FSDP_BACKEND set and every other variable inherited. An exec failure travels back over a
 * close-on-exec pipe, so "no such program" is reported as such rather than as exit status 127.
 * The first rank that exits non-zero or by a signal is reported and the others are stopped;
 * failures after fsdprun began stopping the job are its own doing and are not reported.
 *
 * Invariant: a rank is live from a successful fork until waitpid has returned it, and
 * job->nlive counts the live ranks.
 */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#ifdef __linux__
#include <sys/prctl.h>
#endif

#include <fsdp/launch.h>

#include "tools/fsdprun.h"

extern char **environ;

/* Sends sig to the process group of every live rank (its own group, so helpers it started get
 * it too); falls back to the rank itself should the group not exist. */
void signal_ranks(job_t *job, int sig) {
    for (int i = 0; i < job->opt.nproc; i++) {
        rank_t *r = &job->ranks[i];
        if (!r->live) continue;
        if (kill(-r->pid, sig) < 0) kill(r->pid, sig);
        r->signalled = 1;
    }
}

/* Starts stopping the job: sig to every live rank, SIGKILL after the grace period. */
void stop_ranks(job_t *job, int sig) {
    job->stopping = 1;
    signal_ranks(job, sig);
    if (job->kill_at == 0) job->kill_at = now_s() + job->opt.grace_s;
}

static void rank_exited(job_t *job, int i, int status) {
    rank_t *r = &job->ranks[i];
    r->live = 0;
    r->status = status;
    job->nlive--;
    if (job->nlive == 0) job->drain_until = now_s() + DRAIN_S;
    int failed = !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    /* Once fsdprun is stopping the job, further failures are its own doing. */
    if (!failed || job->first_fail >= 0 || job->stopping) return;
    job->first_fail = i;
    job->first_status = status;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    job->first_fail_ms = (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
    if (WIFEXITED(status)) {
        say("fsdprun: rank %d exited with status %d", r->rank, WEXITSTATUS(status));
    } else {
        int sig = WTERMSIG(status);
        const char *name = signal_name(sig);
        if (name)
            say("fsdprun: rank %d was killed by signal %d (%s)", r->rank, sig, name);
        else
            say("fsdprun: rank %d was killed by signal %d", r->rank, sig);
    }
    if (job->nlive > 0) stop_ranks(job, SIGTERM);
}

/* "status 3" or "signal 9 (SIGKILL)" for a wait status. */
static void describe_status(int status, char *buf, size_t cap) {
    if (WIFEXITED(status)) {
        snprintf(buf, cap, "status %d", WEXITSTATUS(status));
    } else {
        const char *name = signal_name(WTERMSIG(status));
        if (name)
            snprintf(buf, cap, "signal %d (%s)", WTERMSIG(status), name);
        else
            snprintf(buf, cap, "signal %d", WTERMSIG(status));
    }
}

void report_failure(const job_t *job) {
    if (job->first_fail < 0) return;
    const rank_t *f = &job->ranks[job->first_fail];
    char cause[64], others[512] = "";
    describe_status(job->first_status, cause, sizeof cause);
    size_t at = 0;
    int nothers = 0;
    for (int i = 0; i < job->opt.nproc; i++) {
        const rank_t *r = &job->ranks[i];
        if (i == job->first_fail || r->pid == 0 ||
            (WIFEXITED(r->status) && WEXITSTATUS(r->status) == 0))
            continue;
        char st[64];
        describe_status(r->status, st, sizeof st);
        int w = snprintf(others + at, sizeof others - at, "%s%d (%s%s)", nothers ? ", " : "",
                         r->rank, st, r->signalled ? ", stopped by fsdprun" : "");
        if (w < 0 || (size_t)w >= sizeof others - at) break;
        at += (size_t)w;
        nothers++;
    }
    char here[48] = "";
    if (job->opt.nnodes > 1) snprintf(here, sizeof here, " on node %d", job->opt.node_rank);
    say("fsdprun: summary: rank %d failed first%s (%s); its last line: %s%s%s; %s%s%s%s", f->rank,
        here, cause, f->last[0] ? "'" : "", f->last[0] ? f->last : "none", f->last[0] ? "'" : "",
        nothers ? "then, as a consequence, ranks " : "no other rank failed", others,
        job->first_in_job[0] ? "; before it, " : "", job->first_in_job);
}

void reap(job_t *job) {
    for (int i = 0; i < job->opt.nproc; i++) {
        rank_t *r = &job->ranks[i];
        if (!r->live) continue;
        int status = 0;
        pid_t p = waitpid(r->pid, &status, WNOHANG);
        if (p == r->pid)
            rank_exited(job, i, status);
        else if (p < 0 && errno == ECHILD)
            rank_exited(job, i, 0); /* cannot happen */
    }
}

void got_signal(job_t *job, int sig) {
    if (!job->stop_signal) {
        /* Forwarded with no SIGKILL deadline: the ranks finish their step together and save
         * (fsdp-train), which may take longer than the grace period; a second signal kills. */
        job->stop_signal = sig;
        if (job->nlive > 0)
            say("fsdprun: got %s; forwarding it to the ranks and waiting for them (a second "
                "signal kills them)",
                signal_name(sig));
        job->stopping = 1;
        signal_ranks(job, sig);
    } else {
        if (job->nlive > 0) say("fsdprun: got %s again; killing the ranks", signal_name(sig));
        signal_ranks(job, SIGKILL);
    }
}

/* The environment of one rank: ours without the launch variables, plus them. */
static const char *const launch_vars[] = {
    "RANK",   "WORLD_SIZE", "LOCAL_RANK",   "LOCAL_WORLD_SIZE", "NODE_RANK",
    "NNODES", "FSDP_STORE", "FSDP_BACKEND", "MASTER_ADDR",      "MASTER_PORT"};
#define NLAUNCH (sizeof launch_vars / sizeof launch_vars[0])
/* The variables a job sets: MASTER_ADDR and MASTER_PORT (the last two) with the TCP store
 * only; otherwise the ranks inherit whatever fsdprun had. */
#define NSET(job) ((job)->tcp ? NLAUNCH : NLAUNCH - 2)

typedef struct rank_env {
    char **envp;        /* NULL-terminated */
    char *own[NLAUNCH]; /* the strings we allocated */
} rank_env_t;

static void rank_env_free(rank_env_t *e) {
    for (size_t k = 0; k < NLAUNCH; k++)
        free(e->own[k]);
    free(e->envp);
    memset(e, 0, sizeof *e);
}

static int is_launch_var(const char *entry, size_t nset) {
    for (size_t k = 0; k < nset; k++) {
        size_t n = strlen(launch_vars[k]);
        if (strncmp(entry, launch_vars[k], n) == 0 && entry[n] == '=') return 1;
    }
    return 0;
}

static int rank_env_build(const job_t *job, int local, rank_env_t *e) {
    const options_t *o = &job->opt;
    memset(e, 0, sizeof *e);
    size_t n = 0;
    for (char **p = environ; *p; p++)
        n++;
    e->envp = calloc(n + NLAUNCH + 1, sizeof *e->envp);
    if (!e->envp) return -1;
    size_t m = 0, nset = NSET(job);
    for (char **p = environ; *p; p++)
        if (!is_launch_var(*p, nset)) e->envp[m++] = *p;
    const char *vals[NLAUNCH];
    char num[7][16];
    snprintf(num[0], sizeof num[0], "%d", o->node_rank * o->nproc + local);
    snprintf(num[1], sizeof num[1], "%d", o->nproc * o->nnodes);
    snprintf(num[2], sizeof num[2], "%d", local);
    snprintf(num[3], sizeof num[3], "%d", o->nproc);
    snprintf(num[4], sizeof num[4], "%d", o->node_rank);
    snprintf(num[5], sizeof num[5], "%d", o->nnodes);
    for (int k = 0; k < 6; k++)
        vals[k] = num[k];
    vals[6] = o->store ? o->store : job->store_url;
    vals[7] = o->backend;
    snprintf(num[6], sizeof num[6], "%d", o->master_port);
    vals[8] = o->master_addr;
    vals[9] = num[6];
    for (size_t k = 0; k < nset; k++) {
        size_t len = strlen(launch_vars[k]) + 1 + strlen(vals[k]) + 1;
        e->own[k] = malloc(len);
        if (!e->own[k]) {
            rank_env_free(e);
            return -1;
        }
        snprintf(e->own[k], len, "%s=%s", launch_vars[k], vals[k]);
        e->envp[m++] = e->own[k];
    }
    e->envp[m] = NULL;
    return 0;
}

static const char *envp_get(const char *name, void *arg) {
    size_t n = strlen(name);
    for (char **p = arg; *p; p++)
        if (strncmp(*p, name, n) == 0 && (*p)[n] == '=') return *p + n + 1;
    return NULL;
}

/* The child, between fork and exec: only async-signal-safe calls. Never returns. */
static void child_exec(const job_t *job, int out_w, int err_w, int exec_w, char **envp,
                       pid_t parent, const sigset_t *mask) {
#ifdef __linux__
    /* Die with fsdprun even if it is killed with SIGKILL. */
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(127);
#else
    (void)parent;
#endif
    setpgid(0, 0);
    restore_signals();
    sigprocmask(SIG_SETMASK, mask, NULL);
    if (job->devnull >= 0 && dup2(job->devnull, 0) < 0) goto fail;
    if (out_w >= 0 && dup2(out_w, 1) < 0) goto fail;
    if (err_w >= 0 && dup2(err_w, 2) < 0) goto fail;
    environ = envp;
    execvp(job->opt.argv[0], job->opt.argv);
fail:;
    int e = errno;
    ssize_t w = write(exec_w, &e, sizeof e);
    (void)w;
    _exit(127);
}

/* Starts local rank i. Returns 0, or -1 after reporting why it could not. */
int start_rank(job_t *job, int i) {
    rank_t *r = &job->ranks[i];
    int out[2] = {-1, -1}, err[2] = {-1, -1}, ex[2] = {-1, -1};
    rank_env_t env = {0};
    int rc = -1;
    if (job->opt.prefix && (cloexec_pipe(out) < 0 || cloexec_pipe(err) < 0)) {
        say("fsdprun: cannot create the output pipes of rank %d: %s", r->rank, strerror(errno));
        goto out;
    }
    if (cloexec_pipe(ex) < 0) {
        say("fsdprun: cannot create a pipe for rank %d: %s", r->rank, strerror(errno));
        goto out;
    }
    if (rank_env_build(job, i, &env) < 0) {
        say("fsdprun: out of memory");
        goto out;
    }
    sigset_t all, old;
    sigfillset(&all);
    sigprocmask(SIG_BLOCK, &all, &old);
    pid_t parent = getpid();
    pid_t pid = fork();
    if (pid == 0) child_exec(job, out[1], err[1], ex[1], env.envp, parent, &old);
    int fork_errno = errno;
    if (pid > 0) {
        r->pid = pid;
        r->live = 1;
        job->nlive++;
        setpgid(pid, pid); /* also here, so no signal can go to a group not yet made */
    }
    sigprocmask(SIG_SETMASK, &old, NULL);
    if (pid < 0) {
        say("fsdprun: cannot start rank %d: %s", r->rank, strerror(fork_errno));
        goto out;
    }
    close_fd(&out[1]);
    close_fd(&err[1]);
    close_fd(&ex[1]);
    /* EOF: exec succeeded (the pipe was close-on-exec). An int: the exec's errno. */
    int child_errno = 0;
    size_t got = 0;
    while (got < sizeof child_errno) {
        ssize_t n = read(ex[0], (char *)&child_errno + got, sizeof child_errno - got);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) break;
        got += (size_t)n;
    }
    if (got == sizeof child_errno) {
        say("fsdprun: cannot run '%s': %s", job->opt.argv[0], strerror(child_errno));
        int status;
        while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
        }
        r->live = 0;
        job->nlive--;
        goto out;
    }
    if (job->opt.prefix) {
        r->out.fd = out[0];
        r->err.fd = err[0];
        out[0] = err[0] = -1;
        job->nopen += 2;
    }
    rc = 0;
out:
    close_fd(&out[0]);
    close_fd(&out[1]);
    close_fd(&err[0]);
    close_fd(&err[1]);
    close_fd(&ex[0]);
    close_fd(&ex[1]);
    rank_env_free(&env);
    return rc;
}

/* Checks every rank's environment with the library's own parser, so fsdprun and
 * fsdp_launch_env_read can never disagree (and an over-long --store is refused up front). */
int check_envs(job_t *job) {
    for (int i = 0; i < job->opt.nproc; i++) {
        rank_env_t env;
        if (rank_env_build(job, i, &env) < 0) {
            say("fsdprun: out of memory");
            return -1;
        }
        fsdp_launch_env_t e;
        char msg[512];
        int rc = fsdp_launch_env_parse(envp_get, env.envp, &e, msg, sizeof msg);
        rank_env_free(&env);
        if (rc < 0) {
            usage_error("the ranks' environment would be refused: %s", msg);
            return -1;
        }
        if (e.rank != job->ranks[i].rank || e.local_rank != i) {
            say("fsdprun: internal error: rank %d parses as rank %d", job->ranks[i].rank, e.rank);
            return -1;
        }
    }
    return 0;
}
