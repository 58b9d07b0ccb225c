/* SPDX-License-Identifier: MIT */
/*
 * fsdprun.c: starts the local ranks of a libfsdp job, torchrun-style.
 *
 * This file holds main, the poll loop, fsdprun's own signal handling and the temporary store
 * directory; the command line is in fsdprun_opts.c, the ranks' processes in fsdprun_ranks.c and
 * the prefixing of their output in fsdprun_output.c (what they share: fsdprun.h).
 *
 * Process model: fsdprun forks N children, each in its own process group (so a signal reaches
 * everything a rank started, and a terminal's Ctrl-C reaches fsdprun alone, which forwards it
 * once). Each child gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, NODE_RANK, NNODES,
 * FSDP_STORE and FSDP_BACKEND (and MASTER_ADDR, MASTER_PORT with the TCP store), and execs the
 * program.
 *
 * The store: --store as given; else, with --master-addr, --master-port or --rdzv-endpoint (and
 * always on several nodes), the TCP store at the master address, which node 0's fsdprun serves
 * from a thread of its own (src/store/store_tcp_server.c, compiled in) until every rank is
 * reaped; else a temporary file-store directory that fsdprun makes and removes. An exec failure
 * travels back over a close-on-exec pipe, so "no such program" is reported as such rather than as
 * exit status 127. Before the store server starts and the first fork, fsdprun moves into a
 * network namespace of the job's own when the job allows one (fsdprun_netns.c), so that other
 * users of the host cannot reach the ranks.
 *
 * Output: every child's stdout and stderr are pipes that one poll loop reads. Bytes are kept per
 * stream until a newline (or EOF, or 64 KiB without one), and each complete line is written with
 * its "[rank R] " prefix before anything else is written, so lines of different ranks never mix.
 *
 * Failure policy: the first rank that exits non-zero or by a signal is reported; the others get
 * SIGTERM, and SIGKILL if they are still there a grace period later. SIGINT, SIGTERM and SIGHUP
 * sent to fsdprun are forwarded to every rank, and fsdprun waits for them with no deadline, so
 * that they can finish their step and save (fsdp-train does, collectively); a second one kills
 * at once. Every child is reaped before fsdprun exits, and the temporary store directory it made
 * is removed. The ranks get fsdprun's own command line (up to the program) in $FSDPRUN_COMMAND,
 * quoted for a shell, so that a rank can print the command that resumes the job.
 *
 * The invariant of the loop: a rank is "live" until waitpid has returned it; a stream is open
 * until EOF (or the drain deadline after the last rank was reaped, when something the rank left
 * behind still holds the pipe).
 */
/* realpath() is an XSI function. */
#define _XOPEN_SOURCE 700

#include <config.h>

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "store/store_tcp_proto.h"
#include "tools/fsdprun.h"

#define EXIT_USAGE 2     /* bad usage, or the job could not be started */
#define EXIT_TIMEOUT 124 /* --timeout expired, as timeout(1) */

/* ------------------------------------------------------------------------------------------ */
/* Signals: the handler only writes the signal number into a pipe that the poll loop watches. */

static int sig_wfd = -1;
static volatile sig_atomic_t stop_pending;
static const int handled[] = {SIGCHLD, SIGINT, SIGTERM, SIGHUP};
#define NHANDLED (sizeof handled / sizeof handled[0])
static int installed[NHANDLED]; /* which got our handler (others keep their disposition) */
static int pipe_was_ignored;

static void on_signal(int sig) {
    int saved = errno;
    unsigned char c = (unsigned char)sig;
    if (sig != SIGCHLD) stop_pending = 1;
    if (write(sig_wfd, &c, 1) < 0) {
        /* The pipe is full: the loop will reap and see stop_pending anyway. */
    }
    errno = saved;
}

static int install_handlers(void) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigfillset(&sa.sa_mask);
    for (size_t i = 0; i < NHANDLED; i++) {
        struct sigaction old;
        if (sigaction(handled[i], NULL, &old) < 0) return -1;
        /* An ignored SIGINT or SIGHUP (a background job, nohup) stays ignored, for the ranks
         * too, as a shell would do. */
        if ((handled[i] == SIGINT || handled[i] == SIGHUP) && old.sa_handler == SIG_IGN) continue;
        sa.sa_flags = handled[i] == SIGCHLD ? SA_NOCLDSTOP : 0;
        if (sigaction(handled[i], &sa, NULL) < 0) return -1;
        installed[i] = 1;
    }
    struct sigaction ign, old;
    memset(&ign, 0, sizeof ign);
    ign.sa_handler = SIG_IGN;
    sigemptyset(&ign.sa_mask);
    if (sigaction(SIGPIPE, &ign, &old) < 0) return -1;
    pipe_was_ignored = old.sa_handler == SIG_IGN;
    return 0;
}

/* Between fork and exec: sigaction only, which is async-signal-safe. */
void restore_signals(void) {
    struct sigaction dfl;
    memset(&dfl, 0, sizeof dfl);
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);
    for (size_t k = 0; k < NHANDLED; k++)
        if (installed[k]) sigaction(handled[k], &dfl, NULL);
    if (!pipe_was_ignored) sigaction(SIGPIPE, &dfl, NULL);
}

const char *signal_name(int sig) {
    switch (sig) {
    case SIGHUP:
        return "SIGHUP";
    case SIGINT:
        return "SIGINT";
    case SIGQUIT:
        return "SIGQUIT";
    case SIGILL:
        return "SIGILL";
    case SIGTRAP:
        return "SIGTRAP";
    case SIGABRT:
        return "SIGABRT";
    case SIGBUS:
        return "SIGBUS";
    case SIGFPE:
        return "SIGFPE";
    case SIGKILL:
        return "SIGKILL";
    case SIGUSR1:
        return "SIGUSR1";
    case SIGSEGV:
        return "SIGSEGV";
    case SIGUSR2:
        return "SIGUSR2";
    case SIGPIPE:
        return "SIGPIPE";
    case SIGALRM:
        return "SIGALRM";
    case SIGTERM:
        return "SIGTERM";
    case SIGXCPU:
        return "SIGXCPU";
    case SIGXFSZ:
        return "SIGXFSZ";
    case SIGSYS:
        return "SIGSYS";
    default:
        return NULL;
    }
}

/* ------------------------------------------------------------------------------------------ */
/* Small helpers. */

double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

void say(const char *fmt, ...) {
    char buf[1024];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(buf, sizeof buf - 1, fmt, ap);
    va_end(ap);
    if (n < 0) return;
    if ((size_t)n > sizeof buf - 2) n = (int)sizeof buf - 2;
    buf[n++] = '\n';
    /* One write per message, so it stays whole among the ranks' lines. */
    const char *p = buf;
    while (n > 0) {
        ssize_t w = write(2, p, (size_t)n);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return;
        p += w;
        n -= (int)w;
    }
}

void usage_error(const char *fmt, ...) {
    char buf[768];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    say("fsdprun: %s", buf);
    say("Try 'fsdprun --help' for more information.");
}

static int set_cloexec(int fd) {
    int fl = fcntl(fd, F_GETFD);
    return fl < 0 ? -1 : fcntl(fd, F_SETFD, fl | FD_CLOEXEC);
}

/* pipe() with both ends close-on-exec: a child must not hold another rank's pipe, or that
 * rank's EOF would never come. */
int cloexec_pipe(int fds[2]) {
    if (pipe(fds) < 0) return -1;
    if (set_cloexec(fds[0]) < 0 || set_cloexec(fds[1]) < 0) {
        close(fds[0]);
        close(fds[1]);
        return -1;
    }
    return 0;
}

void close_fd(int *fd) {
    if (*fd >= 0) close(*fd);
    *fd = -1;
}

/* ------------------------------------------------------------------------------------------ */
/* The temporary store directory. */

static int make_store_dir(job_t *job) {
    const char *tmp = getenv("TMPDIR");
    if (!tmp || !*tmp) tmp = "/tmp";
    char templ[PATH_MAX];
    if (snprintf(templ, sizeof templ, "%s/fsdprun.XXXXXX", tmp) >= (int)sizeof templ) {
        say("fsdprun: TMPDIR is too long");
        return -1;
    }
    if (!mkdtemp(templ)) {
        say("fsdprun: cannot create a store directory under '%s': %s", tmp, strerror(errno));
        return -1;
    }
    /* realpath makes a relative TMPDIR absolute, as a file:// URL needs. */
    job->store_dir = realpath(templ, NULL);
    if (!job->store_dir) {
        say("fsdprun: cannot resolve '%s': %s", templ, strerror(errno));
        rmdir(templ);
        return -1;
    }
    snprintf(job->store_url, sizeof job->store_url, "file://%s", job->store_dir);
    return 0;
}

/* Removes name (relative to dirfd) and, if it is a directory, everything in it, without
 * following symbolic links. */
static int remove_tree(int dirfd, const char *name, int depth) {
    if (unlinkat(dirfd, name, 0) == 0 || errno == ENOENT) return 0;
    if ((errno != EISDIR && errno != EPERM) || depth > 64) return -1;
    int fd = openat(dirfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) return -1;
    DIR *d = fdopendir(fd);
    if (!d) {
        close(fd);
        return -1;
    }
    int rc = 0;
    struct dirent *de;
    while ((de = readdir(d)) != NULL) {
        if (strcmp(de->d_name, ".") == 0 || strcmp(de->d_name, "..") == 0) continue;
        if (remove_tree(fd, de->d_name, depth + 1) < 0) rc = -1;
    }
    closedir(d);
    if (unlinkat(dirfd, name, AT_REMOVEDIR) < 0 && errno != ENOENT) rc = -1;
    return rc;
}

/* ------------------------------------------------------------------------------------------ */
/* The TCP store: served here on node 0, reached at the master address by every rank. */

#define DEFAULT_MASTER_PORT 29500 /* torchrun's */

static int setup_tcp_store(job_t *job) {
    options_t *o = &job->opt;
    char why[512];
    if (fsdp__tcp_key_from_env(&job->tcp_key, why, sizeof why) < 0) {
        say("fsdprun: %s", why);
        return -1;
    }
    if (!o->master_addr[0]) snprintf(o->master_addr, sizeof o->master_addr, "127.0.0.1");
    if (o->master_port < 0) o->master_port = DEFAULT_MASTER_PORT;
    if (o->node_rank == 0) {
        /* Only on the master address; with FSDP_STORE_KEY_FILE, only to clients that prove
         * they hold the key. */
        char err[512];
        int rc = fsdp__tcp_server_start(o->master_addr, o->master_port, &job->tcp_key, &job->server,
                                        err, sizeof err);
        if (rc < 0) {
            say("fsdprun: cannot serve the rendezvous store: %s", err);
            return -1;
        }
        o->master_port = fsdp__tcp_server_port(job->server);
    }
    const char *host = o->master_addr;
    snprintf(job->store_url, sizeof job->store_url,
             strchr(host, ':') ? "tcp://[%s]:%d" : "tcp://%s:%d", host, o->master_port);
    job->tcp = 1;
    return 0;
}

/* ------------------------------------------------------------------------------------------ */
/* The loop. */

static int poll_timeout_ms(const job_t *job) {
    double t = now_s(), until = -1;
    if (job->kill_at > 0 && job->nlive > 0) until = job->kill_at;
    if (job->deadline > 0 && !job->stopping && (until < 0 || job->deadline < until))
        until = job->deadline;
    if (job->nlive == 0 && (until < 0 || job->drain_until < until)) until = job->drain_until;
    if (until < 0) return -1;
    double ms = (until - t) * 1000.0;
    if (ms < 0) return 0;
    return ms > 1e6 ? 1000000 : (int)ms + 1;
}

static int run_loop(job_t *job, int sig_rfd) {
    int n = job->opt.nproc;
    struct pollfd *pfds = calloc((size_t)(1 + 2 * n), sizeof *pfds);
    stream_t **which = calloc((size_t)(1 + 2 * n), sizeof *which);
    rank_t **owner = calloc((size_t)(1 + 2 * n), sizeof *owner);
    if (!pfds || !which || !owner) {
        say("fsdprun: out of memory; killing the ranks");
        signal_ranks(job, SIGKILL);
        for (int i = 0; i < n; i++)
            if (job->ranks[i].live) {
                while (waitpid(job->ranks[i].pid, NULL, 0) < 0 && errno == EINTR) {
                }
                job->ranks[i].live = 0;
            }
        free(pfds);
        free(which);
        free(owner);
        return -1;
    }
    while (job->nlive > 0 || job->nopen > 0) {
        int np = 0;
        pfds[np++] = (struct pollfd){.fd = sig_rfd, .events = POLLIN};
        for (int i = 0; i < n; i++) {
            stream_t *ss[2] = {&job->ranks[i].out, &job->ranks[i].err};
            for (int k = 0; k < 2; k++)
                if (ss[k]->fd >= 0) {
                    which[np] = ss[k];
                    owner[np] = &job->ranks[i];
                    pfds[np++] = (struct pollfd){.fd = ss[k]->fd, .events = POLLIN};
                }
        }
        int rc = poll(pfds, (nfds_t)np, poll_timeout_ms(job));
        if (rc < 0 && errno != EINTR) {
            say("fsdprun: poll: %s", strerror(errno));
            sleep(1); /* should not happen; do not spin */
        }
        if (rc > 0 && (pfds[0].revents & POLLIN)) {
            unsigned char sigs[64];
            ssize_t got = read(sig_rfd, sigs, sizeof sigs);
            for (ssize_t k = 0; k < got; k++)
                if (sigs[k] != SIGCHLD) got_signal(job, sigs[k]);
        }
        reap(job);
        for (int k = 1; rc > 0 && k < np; k++)
            if (pfds[k].revents & (POLLIN | POLLHUP | POLLERR))
                read_stream(job, owner[k], which[k]);
        double t = now_s();
        if (job->kill_at > 0 && t >= job->kill_at) {
            job->kill_at = 0;
            if (job->nlive > 0) {
                say("fsdprun: %d rank%s still running %g s after SIGTERM; sending SIGKILL",
                    job->nlive, job->nlive == 1 ? "" : "s", job->opt.grace_s);
                signal_ranks(job, SIGKILL);
            }
        }
        if (job->deadline > 0 && t >= job->deadline && !job->stopping) {
            job->timed_out = 1;
            say("fsdprun: time limit of %g s reached; stopping the ranks", job->opt.timeout_s);
            stop_ranks(job, SIGTERM);
        }
        if (job->nlive == 0 && job->nopen > 0 && t >= job->drain_until) {
            /* The ranks are gone but something they started still holds a pipe. */
            for (int i = 0; i < n; i++) {
                close_stream(job, &job->ranks[i], &job->ranks[i].out);
                close_stream(job, &job->ranks[i], &job->ranks[i].err);
            }
        }
    }
    free(pfds);
    free(which);
    free(owner);
    return 0;
}

static int exit_status(const job_t *job) {
    if (job->launch_failed) return EXIT_USAGE;
    if (job->first_fail >= 0) {
        int st = job->first_status;
        return WIFSIGNALED(st) ? 128 + WTERMSIG(st) : 1;
    }
    if (job->stop_signal) return 128 + job->stop_signal;
    if (job->timed_out) return EXIT_TIMEOUT;
    return 0;
}

/* $FSDPRUN_COMMAND: fsdprun's argv up to the program, each word quoted for a POSIX shell. */
static void export_command(int argc, char **argv, char **prog) {
    size_t cap = 64;
    for (int i = 0; i < argc && argv + i != prog; i++)
        cap += 4 * strlen(argv[i]) + 3;
    char *buf = malloc(cap), *p = buf;
    if (!buf) return;
    for (int i = 0; i < argc && argv + i != prog; i++) {
        const char *a = argv[i];
        int plain = *a != '\0' && strspn(a, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                                            "0123456789_-+./:=,@%") == strlen(a);
        if (p != buf) *p++ = ' ';
        if (plain) {
            p += sprintf(p, "%s", a);
            continue;
        }
        *p++ = '\'';
        for (; *a; a++)
            p += *a == '\'' ? sprintf(p, "'\\''") : sprintf(p, "%c", *a);
        *p++ = '\'';
    }
    *p = '\0';
    setenv("FSDPRUN_COMMAND", buf, 1);
    free(buf);
}

int main(int argc, char **argv) {
    job_t job;
    memset(&job, 0, sizeof job);
    job.first_fail = -1;
    job.devnull = -1;
    int sigp[2] = {-1, -1};
    int status = EXIT_USAGE;

    int prc = parse_options(argc, argv, &job.opt);
    if (prc != 0) return prc > 0 ? 0 : EXIT_USAGE;
    int n = job.opt.nproc;
    export_command(argc, argv, job.opt.argv);

    job.ranks = calloc((size_t)n, sizeof *job.ranks);
    if (!job.ranks) {
        say("fsdprun: out of memory");
        return EXIT_USAGE;
    }
    for (int i = 0; i < n; i++) {
        rank_t *r = &job.ranks[i];
        r->rank = job.opt.node_rank * n + i;
        r->out.fd = r->err.fd = -1;
        r->out.out_fd = 1;
        r->err.out_fd = 2;
        r->prefix_len = (size_t)snprintf(r->prefix, sizeof r->prefix, "[rank %d] ", r->rank);
    }
    if (!job.opt.store && (job.opt.master_addr[0] || job.opt.master_port >= 0)) {
        if (setup_tcp_store(&job) < 0) goto out;
    } else if (!job.opt.store && make_store_dir(&job) < 0) {
        goto out;
    }
    if (check_envs(&job) < 0) goto out;
    if (fsdprun_netns_wanted(&job.opt)) {
        char why[256] = "";
        int nrc = fsdprun_netns_enter(why, sizeof why);
        if (nrc == -2) {
            say("fsdprun: %s; the ranks cannot run (try --share-network)", why);
            goto out;
        }
        if (nrc < 0)
            say("fsdprun: warning: the ranks share the host's network, where other users can "
                "connect to their listeners (%s)",
                why);
    }
    if (isatty(0)) {
        job.devnull = open("/dev/null", O_RDONLY | O_CLOEXEC);
        if (job.devnull < 0) {
            say("fsdprun: cannot open /dev/null: %s", strerror(errno));
            goto out;
        }
    }
    if (cloexec_pipe(sigp) < 0 || fcntl(sigp[1], F_SETFL, O_NONBLOCK) < 0 ||
        fcntl(sigp[0], F_SETFL, O_NONBLOCK) < 0) {
        say("fsdprun: cannot create the signal pipe: %s", strerror(errno));
        goto out;
    }
    sig_wfd = sigp[1];
    if (install_handlers() < 0) {
        say("fsdprun: cannot install signal handlers: %s", strerror(errno));
        goto out;
    }

    if (job.opt.timeout_s > 0) job.deadline = now_s() + job.opt.timeout_s;
    for (int i = 0; i < n && !stop_pending; i++) {
        if (start_rank(&job, i) < 0) {
            job.launch_failed = 1;
            stop_ranks(&job, SIGTERM);
            break;
        }
    }
    if (job.nlive == 0) job.drain_until = now_s() + DRAIN_S;
    run_loop(&job, sigp[0]);
    record_failure(&job);
    print_records(&job);
    report_failure(&job);
    status = exit_status(&job);

out:
    fsdp__tcp_server_stop(job.server); /* every rank is reaped: no one here needs it now */
    if (job.store_dir) {
        if (remove_tree(AT_FDCWD, job.store_dir, 0) < 0)
            say("fsdprun: warning: could not remove the store directory '%s': %s", job.store_dir,
                strerror(errno));
        free(job.store_dir);
    }
    for (int i = 0; i < n; i++) {
        free(job.ranks[i].out.buf);
        free(job.ranks[i].err.buf);
    }
    free(job.ranks);
    free(job.scratch);
    close_fd(&job.devnull);
    close_fd(&sigp[0]);
    close_fd(&sigp[1]);
    return status;
}
