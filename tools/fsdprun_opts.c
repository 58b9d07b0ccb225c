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
#include <unistd.h>

#include "core/build_info.h"
#include "tools/fsdprun.h"

static const char usage_text[] =
    "NAME\n"
    "    fsdprun - start the ranks of a libfsdp job on this node\n"
    "\n"
    "SYNOPSIS\n"
    "    fsdprun -n N [--nnodes M --node-rank K] [--store URL | --master-addr HOST\n"
    "            [--master-port P] | --rdzv-endpoint HOST:P] [--backend NAME]\n"
    "            [--timeout S] [--grace S] [--no-prefix] [--share-network] [--]\n"
    "            PROGRAM [ARGS...]\n"
    "\n"
    "DESCRIPTION\n"
    "    Starts N copies of PROGRAM, the local ranks of a job of N*M ranks spread over M nodes,\n"
    "    waits for them, and exits with a status that says whether all of them succeeded.\n"
    "    On a multi-node job, run one fsdprun per node with the same -n, --nnodes and\n"
    "    --master-addr (or --store) and that node's --node-rank; as with torchrun, nothing else\n"
    "    is needed: the fsdprun of node 0 serves the rendezvous store at the master address.\n"
    "\n"
    "OPTIONS\n"
    "    -n N, --nproc N, --nproc-per-node N\n"
    "                         ranks to start on this node (required, at least 1)\n"
    "    --nnodes M           nodes in the job (default 1)\n"
    "    --node-rank K        index of this node, 0 <= K < M (default 0)\n"
    "    --master-addr HOST   where the rendezvous store is served: the fsdprun of node 0\n"
    "                         serves a TCP store on HOST (an address of node 0 that every node\n"
    "                         reaches; it listens on that address only) and every rank gets\n"
    "                         FSDP_STORE=tcp://HOST:P. Required when M > 1 without --store.\n"
    "    --master-port P      the TCP store's port (default 29500; 0 picks a free one, on a\n"
    "                         single node only)\n"
    "    --rdzv-endpoint HOST:P  the same as --master-addr HOST --master-port P\n"
    "    --store URL          a store every rank opens instead: file:///dir,\n"
    "                         redis://[:password@]host:port[/db][?prefix=P] or tcp://host:port\n"
    "                         (served by someone else). Without --store and --master-addr: a\n"
    "                         new temporary directory under $TMPDIR (or /tmp), removed when\n"
    "                         fsdprun exits (single node only).\n"
    "    --backend NAME       process-group backend the ranks use: gloo (the default), nccl,\n"
    "                         or sim (for ranks that are not libfsdp processes)\n"
    "    --force              start more ranks than the limit: the online CPUs, at least 8\n"
    "    --timeout S          stop the ranks if the job is still running after S seconds\n"
    "    --grace S            seconds between SIGTERM and SIGKILL when stopping ranks\n"
    "                         (default 5)\n"
    "    --no-prefix          let the ranks write to fsdprun's stdout and stderr directly\n"
    "    --share-network      run the ranks in the host's network. Without it, the ranks of\n"
    "                         a one-node job with a file store run in a network namespace of\n"
    "                         their own (only a loopback), so that no other user of the host\n"
    "                         can connect to their Gloo listeners; a warning says when the\n"
    "                         kernel refuses one\n"
    "    -h, --help           print this text and exit\n"
    "    --version            print the version and exit\n"
    "    Options end at the first argument that is not one (or at --); everything after\n"
    "    belongs to PROGRAM. Long options also take the form --name=value, and '_' may\n"
    "    stand for '-' in their names (--nproc_per_node), as torchrun allows.\n"
    "\n"
    "ENVIRONMENT OF EACH RANK\n"
    "    RANK=K*N+i  WORLD_SIZE=N*M  LOCAL_RANK=i  LOCAL_WORLD_SIZE=N  NODE_RANK=K  NNODES=M\n"
    "    FSDP_STORE=URL  FSDP_BACKEND=NAME, for i = 0..N-1; fsdp_launch_env_read() reads them.\n"
    "    With the TCP store, also MASTER_ADDR=HOST and MASTER_PORT=P.\n"
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
    "    still running after the grace period. Once all are gone it prints a summary: the\n"
    "    first rank to fail, its status or signal and the last line it printed, and the ranks\n"
    "    that failed after it. SIGINT, SIGTERM and SIGHUP sent to fsdprun are\n"
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
    "    fsdprun -n 8 --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 ./train   (on 10.0.0.1)\n"
    "    fsdprun -n 8 --nnodes 2 --node-rank 1 --master-addr 10.0.0.1 ./train   (on the other)\n"
    "    fsdprun -n 8 --nnodes 2 --node-rank 0 --store redis://10.0.0.1:6379 ./train\n";

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

/* A port: 0..65535. */
static int parse_port(const char *opt, const char *v, int *out) {
    long x = 0;
    const char *p = v;
    for (; *p >= '0' && *p <= '9' && x <= 65535; p++)
        x = x * 10 + (*p - '0');
    if (p == v || *p || x > 65535) {
        usage_error("%s wants a port number in 0..65535, not '%s'", opt, v);
        return -1;
    }
    *out = (int)x;
    return 0;
}

static int set_host(const char *opt, const char *v, size_t n, options_t *o) {
    if (n == 0 || n >= sizeof o->master_addr || memchr(v, '/', n) || memchr(v, '@', n)) {
        usage_error("%s wants a host name or address, not '%.*s'", opt, (int)n, v);
        return -1;
    }
    memcpy(o->master_addr, v, n);
    o->master_addr[n] = 0;
    return 0;
}

/* --rdzv-endpoint HOST:PORT, or [V6ADDR]:PORT. */
static int parse_endpoint(const char *opt, const char *v, options_t *o) {
    const char *colon = strrchr(v, ':');
    if (v[0] == '[') {
        const char *close = strchr(v, ']');
        if (!close || close[1] != ':') colon = NULL;
        if (colon && set_host(opt, v + 1, (size_t)(close - v - 1), o) < 0) return -1;
    } else if (colon && memchr(v, ':', (size_t)(colon - v))) {
        colon = NULL; /* an IPv6 address needs its brackets */
    } else if (colon && set_host(opt, v, (size_t)(colon - v), o) < 0) {
        return -1;
    }
    if (!colon) {
        usage_error("%s wants HOST:PORT (or [IPV6]:PORT), not '%s'", opt, v);
        return -1;
    }
    return parse_port(opt, colon + 1, &o->master_port);
}

/* Returns 0 to run, 1 when --help/--version was served, -1 on a usage error. */
int parse_options(int argc, char **argv, options_t *o) {
    memset(o, 0, sizeof *o);
    o->nnodes = 1;
    o->backend = "gloo";
    o->grace_s = 5;
    o->prefix = 1;
    o->isolate_network = 1;
    o->master_port = -1;
    int given_addr = 0, given_port = 0, given_endpoint = 0;
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
        if (strcmp(a, "--share-network") == 0) {
            o->isolate_network = 0;
            continue;
        }
        if (strcmp(a, "--force") == 0) {
            o->force = 1;
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
            /* torchrun spells its options with '-' or '_': --nproc_per_node is --nproc-per-node */
            const char *eq = strchr(a, '=');
            size_t len = eq ? (size_t)(eq - a) : strlen(a);
            snprintf(namebuf, sizeof namebuf, "%.*s", (int)len, a);
            for (char *c = namebuf + 2; *c; c++)
                if (*c == '_') *c = '-';
            name = namebuf;
            if (eq) val = eq + 1;
        }
        static const char *const valued[] = {
            "-n",          "--nproc",       "--nproc-per-node", "--nnodes",
            "--node-rank", "--store",       "--backend",        "--timeout",
            "--grace",     "--master-addr", "--master-port",    "--rdzv-endpoint"};
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
        if (strcmp(name, "-n") == 0 || strcmp(name, "--nproc") == 0 ||
            strcmp(name, "--nproc-per-node") == 0)
            rc = parse_count(name, val, 1, &o->nproc);
        else if (strcmp(name, "--nnodes") == 0)
            rc = parse_count(name, val, 1, &o->nnodes);
        else if (strcmp(name, "--node-rank") == 0)
            rc = parse_count(name, val, 0, &o->node_rank);
        else if (strcmp(name, "--store") == 0)
            o->store = val;
        else if (strcmp(name, "--master-addr") == 0)
            rc = set_host(name, val, strlen(val), o), given_addr = 1;
        else if (strcmp(name, "--master-port") == 0)
            rc = parse_port(name, val, &o->master_port), given_port = 1;
        else if (strcmp(name, "--rdzv-endpoint") == 0)
            rc = parse_endpoint(name, val, o), given_endpoint = 1;
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
    if (given_endpoint && (given_addr || given_port)) {
        usage_error("--rdzv-endpoint is --master-addr and --master-port in one: give one or "
                    "the other");
        return -1;
    }
    if (o->store && (given_addr || given_port || given_endpoint)) {
        usage_error("--store names the store itself; --master-addr, --master-port and "
                    "--rdzv-endpoint say where fsdprun serves one: give one or the other");
        return -1;
    }
    if (o->nnodes > 1 && !o->store && !o->master_addr[0]) {
        usage_error("--nnodes %d needs --master-addr HOST (node 0's address, where its fsdprun "
                    "serves the store; or --rdzv-endpoint HOST:PORT) or --store URL, a store "
                    "that every node can reach: a temporary store on this node would split the "
                    "job",
                    o->nnodes);
        return -1;
    }
    if (o->nnodes > 1 && o->master_port == 0) {
        usage_error("--master-port 0 (a free port) works on a single node only: the other "
                    "nodes could not know it");
        return -1;
    }
    if (o->store) {
        const char *sep = strstr(o->store, "://");
        if (!sep || sep == o->store) {
            /* Not echoed: a malformed URL may still hold a password. */
            usage_error("--store wants a URL such as file:///shared/dir, "
                        "redis://host:6379 or tcp://host:port");
            return -1;
        }
    }
    if (strcmp(o->backend, "gloo") != 0 && strcmp(o->backend, "nccl") != 0 &&
        strcmp(o->backend, "sim") != 0) {
        usage_error("--backend '%s' is not a backend: gloo, nccl or sim", o->backend);
        return -1;
    }
    /* A typo such as -n 100000 must not fork until the machine gives out. */
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    int limit = cpus > 8 ? (cpus > INT_MAX ? INT_MAX : (int)cpus) : 8;
    if (o->nproc > limit && !o->force) {
        usage_error("-n %d is more ranks than this node's %ld CPUs (the limit is %d); give "
                    "--force to start them anyway",
                    o->nproc, cpus, limit);
        return -1;
    }
    if (i >= argc) {
        usage_error("no program to run");
        return -1;
    }
    o->argv = argv + i;
    return 0;
}
