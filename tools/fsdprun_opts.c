/* SPDX-License-Identifier: MIT */
/*
 * fsdprun_opts.c: fsdprun's command line and its --help text.
 *
 * Options end at the first argument that is not one (or at --); what follows is the program
 * and its arguments, which are never looked at. Every value is checked here, whole (no
 * trailing junk) and against its range, so that a usage error is one line on stderr and exit
 * status 2 before anything starts. What needs the job to exist (the ranks' environment as the
 * library would parse it) is checked later, by check_envs.
 */
#include <config.h>

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/build_info.h"
#include "tools/fsdprun.h"

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
    "    forwarded to every rank, and fsdprun waits for them with no deadline (fsdp-train\n"
    "    finishes its step and saves); a second one sends SIGKILL at once.\n"
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
int parse_options(int argc, char **argv, options_t *o) {
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
            printf("fsdprun (%s) %s\n%s\n", PACKAGE_NAME, PACKAGE_VERSION, FSDP_BUILD_INFO);
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
