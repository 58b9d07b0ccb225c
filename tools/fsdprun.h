/* SPDX-License-Identifier: MIT */
/*
 * fsdprun.h: what the files of fsdprun share: the job, its ranks and their output streams.
 *
 * fsdprun.c holds main, the poll loop, fsdprun's own signal handling and the store (a temporary
 * directory, or the TCP store that node 0 serves with src/store/store_tcp_server.c);
 * fsdprun_opts.c the command line; fsdprun_ranks.c starting, signalling and reaping the ranks;
 * fsdprun_output.c the prefixed copying of the ranks' output; fsdprun_record.c the failure
 * records that nodes leave for each other in the store. fsdprun is a program of its own
 * (it compiles src/launch/launch_env.c and the TCP store's server in and links no libfsdp), so the
 * functions shared here keep short names. Everything runs on the one thread of the poll loop,
 * except what fsdprun_ranks.c runs in a child between fork and exec (async-signal-safe calls only).
 */
#ifndef FSDP_TOOLS_FSDPRUN_H
#define FSDP_TOOLS_FSDPRUN_H

#include <limits.h>
#include <signal.h>
#include <stddef.h>
#include <sys/types.h>

#include "store/store_tcp_proto.h"

#define MAX_LINE 65536 /* a longer line without a newline is split */
#define DRAIN_S 2.0    /* how long to keep reading after the last rank was reaped */
#define RECORD_CAP 512 /* bytes of a failure record (fsdprun_record.c) */

typedef struct options {
    int nproc;             /* -n, 0 until given */
    int nnodes;            /* --nnodes */
    int node_rank;         /* --node-rank */
    const char *store;     /* --store, NULL for a temporary file store or the TCP store */
    char master_addr[256]; /* --master-addr or --rdzv-endpoint's host, "" when not given */
    int master_port;       /* --master-port or --rdzv-endpoint's port, -1 when not given */
    const char *backend;
    double timeout_s; /* 0: none */
    double grace_s;
    int prefix;  /* 0 with --no-prefix */
    int isolate_network; /* 0 with --share-network (fsdprun_netns.c) */
    int force;           /* --force: -n above the limit of CPUs */
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
    char last[160];  /* the last non-empty line it printed (cut), "" while none */
    int status;      /* its wait status once reaped */
    int signalled;   /* fsdprun signalled it (stopping the job) before it exited */
} rank_t;

typedef struct job {
    options_t opt;
    rank_t *ranks;
    int nlive;
    int nopen;       /* open streams */
    char *store_dir; /* the temporary store directory we own, or NULL */
    char store_url[PATH_MAX + 16];
    struct fsdp__tcp_server *server; /* the TCP store this launcher serves (node 0), or NULL */
    int tcp;                         /* the ranks meet at the TCP store: MASTER_* are set too */
    fsdp__tcp_key_t tcp_key;         /* FSDP_STORE_KEY_FILE's key for it; len 0: none */
    int devnull;                     /* stdin of the ranks when ours is a terminal, else -1 */
    int first_fail;                  /* index of the first failed rank, or -1 */
    int first_status;                /* its wait status */
    long long first_fail_ms;         /* when it was reaped (ms since the epoch), for records */
    char first_in_job[RECORD_CAP];   /* an earlier failure another node recorded, or "" */
    int stop_signal;                 /* the first INT/TERM/HUP fsdprun received, or 0 */
    int stopping;                    /* SIGTERM (or a forwarded signal) went out */
    int timed_out;
    int launch_failed;  /* a rank could not be started */
    double kill_at;     /* when to send SIGKILL (monotonic s), 0: not scheduled */
    double deadline;    /* --timeout, 0: none */
    double drain_until; /* after the last rank was reaped, 0: not yet */
    int out_dead[3];    /* writes to fd 1 or 2 failed for good: drop further output */
    char *scratch;      /* assembled output of one write */
    size_t scratch_cap;
} job_t;

/* fsdprun_netns.c: the ranks' own network namespace. */

/* 1 when the ranks of this job can run in a network of their own (one node, a store on the
 * file system, no --share-network), else 0. */
int fsdprun_netns_wanted(const options_t *o);
/* Moves fsdprun into a new network namespace with its loopback up, for the ranks it starts
 * from now on. 0 on success; -1 when fsdprun stays in the host's network (why says so); -2
 * when it is left in a namespace without a working loopback (why says so; the job cannot run). */
int fsdprun_netns_enter(char *why, size_t cap);

/* fsdprun_ranks.c: after every rank was reaped, when one failed: one line naming the first to
 * fail, its cause and the last line it printed, and the ranks stopped as a consequence. */
void report_failure(const job_t *job);

/* fsdprun_record.c, for jobs on several nodes with a TCP or file store: leaves this node's first
 * failure in the store as "fsdprun/failed/<node>" (nothing when no rank failed here). */
void record_failure(const job_t *job);
/* When a rank failed here, prints the other nodes' records ("fsdprun: node N reports: ..."),
 * waiting a few seconds for them, and keeps in job->first_in_job the one that happened before
 * this node's failure, if any; returns how many it printed. */
int print_records(job_t *job);

/* fsdprun.c: small helpers. */

/* Monotonic time in seconds. */
double now_s(void);
/* Writes one line to stderr with a single write, so it stays whole among the ranks' lines. */
void say(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* say() with "fsdprun: " in front, then the hint to try --help. */
void usage_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* pipe() with both ends close-on-exec. */
int cloexec_pipe(int fds[2]);
/* Closes *fd when open and sets it to -1. */
void close_fd(int *fd);
/* "SIGTERM" for SIGTERM, and so on; NULL for a signal without a name here. */
const char *signal_name(int sig);
/* In a child between fork and exec: gives back the dispositions fsdprun found for the signals
 * it handles. Async-signal-safe. */
void restore_signals(void);

/* fsdprun_opts.c: returns 0 to run, 1 when --help/--version was served, -1 on a usage error
 * (reported). */
int parse_options(int argc, char **argv, options_t *o);

/* fsdprun_ranks.c */

/* Starts local rank i. Returns 0, or -1 after reporting why it could not. */
int start_rank(job_t *job, int i);
/* Checks every rank's environment with the library's parser; -1 after reporting a refusal. */
int check_envs(job_t *job);
/* Sends sig to the process group of every live rank. */
void signal_ranks(job_t *job, int sig);
/* Starts stopping the job: sig to every live rank, SIGKILL after the grace period. */
void stop_ranks(job_t *job, int sig);
/* Reaps every rank that has exited (without blocking) and applies the failure policy. */
void reap(job_t *job);
/* A SIGINT, SIGTERM or SIGHUP that fsdprun received: forwarded, or SIGKILL the second time. */
void got_signal(job_t *job, int sig);

/* fsdprun_output.c */

/* Reads what is there (one read) from a readable stream of rank r and writes its complete
 * lines; closes the stream at EOF. */
void read_stream(job_t *job, rank_t *r, stream_t *s);
/* Writes what is left of the stream as a last line and closes it (nothing when closed). */
void close_stream(job_t *job, rank_t *r, stream_t *s);

#endif /* FSDP_TOOLS_FSDPRUN_H */
