/*
 * fsdprun.c: starts the local ranks of a libfsdp job, torchrun-style.
 *
 * Process model: fsdprun forks N children, each in its own process group (so a signal reaches
 * everything a rank started, and a terminal's Ctrl-C reaches fsdprun alone, which forwards it
 * once). Each child gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, NODE_RANK, NNODES,
 * FSDP_STORE and FSDP_BACKEND, and execs the program. An exec failure travels back over a
 * close-on-exec pipe, so "no such program" is reported as such rather than as exit status 127.
 *
 * Output: every child's stdout and stderr are pipes that one poll loop reads. Bytes are kept per
 * stream until a newline (or EOF, or 64 KiB without one), and each complete line is written with
 * its "[rank R] " prefix before anything else is written, so lines of different ranks never mix.
 *
 * Failure policy: the first rank that exits non-zero or by a signal is reported; the others get
 * SIGTERM, and SIGKILL if they are still there a grace period later. SIGINT, SIGTERM and SIGHUP
 * sent to fsdprun are forwarded the same way; a second one kills at once. Every child is reaped
 * before fsdprun exits, and the temporary store directory it made is removed.
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
#include <math.h>
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
#ifdef __linux__
#include <sys/prctl.h>
#endif

#include <fsdp/launch.h>

extern char **environ;

#define EXIT_USAGE 2     /* bad usage, or the job could not be started */
#define EXIT_TIMEOUT 124 /* --timeout expired, as timeout(1) */
#define MAX_LINE 65536   /* a longer line without a newline is split */
#define DRAIN_S 2.0      /* how long to keep reading after the last rank was reaped */

static const char usage_text[] =
    "NAME\n"
    "    fsdprun - start the ranks of a libfsdp job on this node\n"
    "\n"
    "SYNOPSIS\n"
    "    fsdprun -n N [--nnodes M --node-rank K] [--store URL] [--backend NAME]\n"
    "            [--timeout S] [--grace S] [--no-prefix] [--] PROGRAM [ARGS...]\n"
    "\n"
    "DESCRIPTION\n"
    "    Starts N copies of PROGRAM, the local ranks of a job of N*M ranks spread over M nodes,\n"
    "    waits for them, and exits with a status that says whether all of them succeeded.\n"
    "    On a multi-node job, run one fsdprun per node with the same -n, --nnodes and --store and\n"
    "    that node's --node-rank.\n"
    "\n"
    "OPTIONS\n"
    "    -n N, --nproc N      ranks to start on this node (required, at least 1)\n"
    "    --nnodes M           nodes in the job (default 1)\n"
    "    --node-rank K        index of this node, 0 <= K < M (default 0)\n"
    "    --store URL          rendezvous store every rank opens: file:///dir or\n"
    "                         redis://host:port/prefix. Default: a new temporary directory\n"
    "                         under $TMPDIR (or /tmp), removed when fsdprun exits. Required\n"
    "                         when M > 1, and it must be reachable from every node.\n"
    "    --backend NAME       process-group backend the ranks use (default gloo)\n"
    "    --timeout S          stop the ranks if the job is still running after S seconds\n"
    "    --grace S            seconds between SIGTERM and SIGKILL when stopping ranks\n"
    "                         (default 5)\n"
    "    --no-prefix          let the ranks write to fsdprun's stdout and stderr directly\n"
    "    -h, --help           print this text and exit\n"
    "    --version            print the version and exit\n"
    "    Options end at the first argument that is not one (or at --); everything after\n"
    "    belongs to PROGRAM. Long options also take the form --name=value.\n"
    "\n"
    "ENVIRONMENT OF EACH RANK\n"
    "    RANK=K*N+i  WORLD_SIZE=N*M  LOCAL_RANK=i  LOCAL_WORLD_SIZE=N  NODE_RANK=K  NNODES=M\n"
    "    FSDP_STORE=URL  FSDP_BACKEND=NAME, for i = 0..N-1; fsdp_launch_env_read() reads them.\n"
    "    Everything else is inherited. Standard input is inherited too, unless it is a\n"
    "    terminal: then the ranks read /dev/null, since they run in their own process groups.\n"
    "\n"
    "OUTPUT\n"
    "    Every line a rank writes to stdout or stderr goes to fsdprun's stdout or stderr with\n"
    "    \"[rank R] \" in front, R being the global rank. Lines are written whole: output of\n"
    "    different ranks never mixes within a line. A last line without a newline gets one;\n"
    "    a line longer than 64 KiB is split.\n"
    "\n"
    "FAILURES AND SIGNALS\n"
    "    When a rank exits with a non-zero status or is killed by a signal, fsdprun names the\n"
    "    first such rank, sends SIGTERM to the process groups of the others and SIGKILL to those\n"
    "    still running after the grace period. SIGINT, SIGTERM and SIGHUP sent to fsdprun are\n"
    "    forwarded to every rank in the same way; a second one sends SIGKILL at once.\n"
    "\n"
    "EXIT STATUS\n"
    "    0        every rank exited with status 0\n"
    "    1        the first rank that failed exited with a non-zero status\n"
    "    128+S    the first rank that failed was killed by signal S, or fsdprun got signal S\n"
    "    124      --timeout expired\n"
    "    2        bad usage, or the job could not be started (e.g. PROGRAM cannot be run)\n"
    "\n"
    "EXAMPLES\n"
    "    fsdprun -n 4 ./train --steps 100\n"
    "    fsdprun -n 8 --nnodes 2 --node-rank 0 --store redis://10.0.0.1:6379/job7 ./train\n";

typedef struct options {
    int nproc;         /* -n, 0 until given */
    int nnodes;        /* --nnodes */
    int node_rank;     /* --node-rank */
    const char *store; /* --store, NULL for a temporary file store */
    const char *backend;
    double timeout_s; /* 0: none */
    double grace_s;
    int prefix;  /* 0 with --no-prefix */
    char **argv; /* the program and its arguments */
} options_t;

typedef struct stream {
    int fd;     /* read end of the pipe; -1 once closed */
    int out_fd; /* where its lines go: 1 or 2 */
    char *buf;  /* the pending partial line */
    size_t len, cap;
} stream_t;

typedef struct rank {
    int rank;  /* global rank */
    pid_t pid; /* 0 until started */
    int live;  /* started and not reaped */
    stream_t out, err;
    char prefix[32];
    size_t prefix_len;
} rank_t;

typedef struct job {
    options_t opt;
    rank_t *ranks;
    int nlive;
    int nopen;       /* open streams */
    char *store_dir; /* the temporary store directory we own, or NULL */
    char store_url[PATH_MAX + 16];
    int devnull;      /* stdin of the ranks when ours is a terminal, else -1 */
    int first_fail;   /* index of the first failed rank, or -1 */
    int first_status; /* its wait status */
    int stop_signal;  /* the first INT/TERM/HUP fsdprun received, or 0 */
    int stopping;     /* SIGTERM (or a forwarded signal) went out */
    int timed_out;
    int launch_failed;  /* a rank could not be started */
    double kill_at;     /* when to send SIGKILL (monotonic s), 0: not scheduled */
    double deadline;    /* --timeout, 0: none */
    double drain_until; /* after the last rank was reaped, 0: not yet */
    int out_dead[3];    /* writes to fd 1 or 2 failed for good: drop further output */
    char *scratch;      /* assembled output of one write */
    size_t scratch_cap;
} job_t;

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

static const char *signal_name(int sig) {
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

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void say(const char *fmt, ...) {
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

static void usage_error(const char *fmt, ...) {
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
static int cloexec_pipe(int fds[2]) {
    if (pipe(fds) < 0) return -1;
    if (set_cloexec(fds[0]) < 0 || set_cloexec(fds[1]) < 0) {
        close(fds[0]);
        close(fds[1]);
        return -1;
    }
    return 0;
}

static void close_fd(int *fd) {
    if (*fd >= 0) close(*fd);
    *fd = -1;
}

/* ------------------------------------------------------------------------------------------ */
/* Options. */

static int parse_count(const char *opt, const char *v, int min, int *out) {
    long x = 0;
    const char *p = v;
    for (; *p >= '0' && *p <= '9' && x <= 1000000; p++)
        x = x * 10 + (*p - '0');
    if (p == v || *p || x < min || x > 1000000) {
        usage_error("%s wants a whole number of at least %d, not '%s'", opt, min, v);
        return -1;
    }
    *out = (int)x;
    return 0;
}

static int parse_seconds(const char *opt, const char *v, int allow_zero, double *out) {
    char *end = NULL;
    errno = 0;
    double x = strtod(v, &end);
    if (!*v || *end || errno || !isfinite(x) || x < 0 || (x == 0 && !allow_zero) || x > 1e7) {
        usage_error("%s wants a number of seconds%s, not '%s'", opt,
                    allow_zero ? "" : " greater than 0", v);
        return -1;
    }
    *out = x;
    return 0;
}

/* Returns 0 to run, 1 when --help/--version was served, -1 on a usage error. */
static int parse_options(int argc, char **argv, options_t *o) {
    memset(o, 0, sizeof *o);
    o->nnodes = 1;
    o->backend = "gloo";
    o->grace_s = 5;
    o->prefix = 1;
    int i = 1;
    for (; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--") == 0) {
            i++;
            break;
        }
        if (a[0] != '-' || a[1] == 0) break; /* the program */
        if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) {
            fputs(usage_text, stdout);
            fflush(stdout);
            return 1;
        }
        if (strcmp(a, "--version") == 0) {
            printf("fsdprun (%s) %s\n", PACKAGE_NAME, PACKAGE_VERSION);
            fflush(stdout);
            return 1;
        }
        if (strcmp(a, "--no-prefix") == 0) {
            o->prefix = 0;
            continue;
        }
        /* Options with a value: -nN, -n N, --name=V, --name V. */
        const char *name = a, *val = NULL;
        char namebuf[64];
        if (a[1] != '-') {
            if (a[1] != 'n') {
                usage_error("unknown option '%s'", a);
                return -1;
            }
            name = "-n";
            if (a[2]) val = a + 2;
        } else {
            const char *eq = strchr(a, '=');
            if (eq) {
                snprintf(namebuf, sizeof namebuf, "%.*s", (int)(eq - a), a);
                name = namebuf;
                val = eq + 1;
            }
        }
        static const char *const valued[] = {"-n",      "--nproc",   "--nnodes",  "--node-rank",
                                             "--store", "--backend", "--timeout", "--grace"};
        int known = 0;
        for (size_t k = 0; k < sizeof valued / sizeof valued[0]; k++)
            if (strcmp(name, valued[k]) == 0) known = 1;
        if (!known) {
            usage_error("unknown option '%s'", a);
            return -1;
        }
        if (!val) {
            if (i + 1 >= argc) {
                usage_error("%s needs a value", name);
                return -1;
            }
            val = argv[++i];
        }
        int rc = 0;
        if (strcmp(name, "-n") == 0 || strcmp(name, "--nproc") == 0)
            rc = parse_count(name, val, 1, &o->nproc);
        else if (strcmp(name, "--nnodes") == 0)
            rc = parse_count(name, val, 1, &o->nnodes);
        else if (strcmp(name, "--node-rank") == 0)
            rc = parse_count(name, val, 0, &o->node_rank);
        else if (strcmp(name, "--store") == 0)
            o->store = val;
        else if (strcmp(name, "--backend") == 0)
            o->backend = val;
        else if (strcmp(name, "--timeout") == 0)
            rc = parse_seconds(name, val, 0, &o->timeout_s);
        else
            rc = parse_seconds(name, val, 1, &o->grace_s);
        if (rc < 0) return -1;
    }
    if (o->nproc == 0) {
        usage_error("missing -n N, the number of ranks to start on this node");
        return -1;
    }
    if (o->node_rank >= o->nnodes) {
        usage_error("--node-rank %d is not less than --nnodes %d", o->node_rank, o->nnodes);
        return -1;
    }
    if ((long long)o->nproc * o->nnodes > INT_MAX) {
        usage_error("-n %d times --nnodes %d is too many ranks", o->nproc, o->nnodes);
        return -1;
    }
    if (o->nnodes > 1 && !o->store) {
        usage_error("--nnodes %d needs --store URL, a store that every node can reach "
                    "(redis://host:port/prefix, or file:///dir on a file system all nodes "
                    "share): a temporary store on this node would split the job",
                    o->nnodes);
        return -1;
    }
    if (o->store) {
        const char *sep = strstr(o->store, "://");
        if (!sep || sep == o->store) {
            usage_error("--store wants a URL such as file:///shared/dir or "
                        "redis://host:6379/prefix, not '%s'",
                        o->store);
            return -1;
        }
    }
    if (!o->backend[0]) {
        usage_error("--backend wants a name, such as gloo or nccl");
        return -1;
    }
    if (i >= argc) {
        usage_error("no program to run");
        return -1;
    }
    o->argv = argv + i;
    return 0;
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
/* Output. */

static int write_all(job_t *job, int fd, const char *p, size_t n) {
    if (job->out_dead[fd]) return 0;
    while (n > 0) {
        ssize_t w = write(fd, p, n);
        if (w < 0 && errno == EINTR) continue;
        if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            /* Someone made our output non-blocking: wait until it drains. */
            struct pollfd pf = {.fd = fd, .events = POLLOUT};
            poll(&pf, 1, 100);
            continue;
        }
        if (w <= 0) {
            /* EPIPE and friends: the reader is gone. Keep draining the ranks regardless. */
            job->out_dead[fd] = 1;
            return -1;
        }
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

static int reserve(char **buf, size_t *cap, size_t need) {
    if (need <= *cap) return 0;
    size_t c = *cap ? *cap : 4096;
    while (c < need)
        c *= 2;
    char *p = realloc(*buf, c);
    if (!p) return -1;
    *buf = p;
    *cap = c;
    return 0;
}

/* Writes the complete lines of s->buf[0, upto) with prefixes, and keeps the rest. With
 * `all`, the remainder is written too, as a line of its own. */
static void flush_lines(job_t *job, rank_t *r, stream_t *s, int all) {
    size_t upto = 0;
    for (size_t i = s->len; i > 0; i--)
        if (s->buf[i - 1] == '\n') {
            upto = i;
            break;
        }
    if (all || s->len - upto >= MAX_LINE) upto = s->len;
    if (upto == 0) return;
    size_t lines = 0;
    for (size_t i = 0; i < upto; i++)
        lines += s->buf[i] == '\n';
    size_t need = upto + (lines + 1) * (r->prefix_len + 1);
    if (reserve(&job->scratch, &job->scratch_cap, need) < 0) {
        /* No memory for prefixes: pass the bytes through rather than lose them. */
        write_all(job, s->out_fd, s->buf, upto);
    } else {
        char *o = job->scratch;
        size_t at = 0;
        while (at < upto) {
            const char *nl = memchr(s->buf + at, '\n', upto - at);
            size_t end = nl ? (size_t)(nl - s->buf) : upto;
            memcpy(o, r->prefix, r->prefix_len);
            o += r->prefix_len;
            memcpy(o, s->buf + at, end - at);
            o += end - at;
            *o++ = '\n';
            at = end + 1;
        }
        write_all(job, s->out_fd, job->scratch, (size_t)(o - job->scratch));
    }
    memmove(s->buf, s->buf + upto, s->len - upto);
    s->len -= upto;
}

static void close_stream(job_t *job, rank_t *r, stream_t *s) {
    if (s->fd < 0) return;
    flush_lines(job, r, s, 1);
    close_fd(&s->fd);
    job->nopen--;
}

/* Reads what is there (one read) from a readable stream. */
static void read_stream(job_t *job, rank_t *r, stream_t *s) {
    if (reserve(&s->buf, &s->cap, s->len + 65536) < 0) {
        flush_lines(job, r, s, 1); /* make room the hard way */
        if (reserve(&s->buf, &s->cap, s->len + 65536) < 0) return;
    }
    ssize_t n = read(s->fd, s->buf + s->len, 65536);
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) return;
    if (n <= 0) {
        close_stream(job, r, s);
        return;
    }
    s->len += (size_t)n;
    flush_lines(job, r, s, 0);
}

/* ------------------------------------------------------------------------------------------ */
/* Children. */

/* Sends sig to the process group of every live rank (its own group, so helpers it started get
 * it too); falls back to the rank itself should the group not exist. */
static void signal_ranks(job_t *job, int sig) {
    for (int i = 0; i < job->opt.nproc; i++) {
        rank_t *r = &job->ranks[i];
        if (!r->live) continue;
        if (kill(-r->pid, sig) < 0) kill(r->pid, sig);
    }
}

/* Starts stopping the job: sig to every live rank, SIGKILL after the grace period. */
static void stop_ranks(job_t *job, int sig) {
    job->stopping = 1;
    signal_ranks(job, sig);
    if (job->kill_at == 0) job->kill_at = now_s() + job->opt.grace_s;
}

static void rank_exited(job_t *job, int i, int status) {
    rank_t *r = &job->ranks[i];
    r->live = 0;
    job->nlive--;
    if (job->nlive == 0) job->drain_until = now_s() + DRAIN_S;
    int failed = !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    /* Once fsdprun is stopping the job, further failures are its own doing. */
    if (!failed || job->first_fail >= 0 || job->stopping) return;
    job->first_fail = i;
    job->first_status = status;
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

static void reap(job_t *job) {
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

static void got_signal(job_t *job, int sig) {
    if (!job->stop_signal) {
        job->stop_signal = sig;
        if (job->nlive > 0) say("fsdprun: got %s; forwarding it to the ranks", signal_name(sig));
        stop_ranks(job, sig);
    } else {
        if (job->nlive > 0) say("fsdprun: got %s again; killing the ranks", signal_name(sig));
        signal_ranks(job, SIGKILL);
    }
}

/* The environment of one rank: ours without the launch variables, plus them. */
static const char *const launch_vars[] = {
    "RANK",      "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
    "NODE_RANK", "NNODES",     "FSDP_STORE", "FSDP_BACKEND"};
#define NLAUNCH (sizeof launch_vars / sizeof launch_vars[0])

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

static int is_launch_var(const char *entry) {
    for (size_t k = 0; k < NLAUNCH; k++) {
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
    size_t m = 0;
    for (char **p = environ; *p; p++)
        if (!is_launch_var(*p)) e->envp[m++] = *p;
    const char *vals[NLAUNCH];
    char num[6][16];
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
    for (size_t k = 0; k < NLAUNCH; k++) {
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
    struct sigaction dfl;
    memset(&dfl, 0, sizeof dfl);
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);
    for (size_t k = 0; k < NHANDLED; k++)
        if (installed[k]) sigaction(handled[k], &dfl, NULL);
    if (!pipe_was_ignored) sigaction(SIGPIPE, &dfl, NULL);
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
static int start_rank(job_t *job, int i) {
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
static int check_envs(job_t *job) {
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
    if (!job.opt.store && make_store_dir(&job) < 0) goto out;
    if (check_envs(&job) < 0) goto out;
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
    status = exit_status(&job);

out:
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
