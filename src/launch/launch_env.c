/* SPDX-License-Identifier: MIT */
/*
 * launch_env.c: reads the environment a launcher gives each process (fsdp/launch.h).
 *
 * Pure: every variable is read through the caller's getter, nothing is written anywhere but
 * the caller's record and message buffer, and the record is written only on success. Each check
 * that fails names the variables involved and their values, since the person reading the message
 * is looking at a job script, not at this code.
 */
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <fsdp/launch.h>

#include "internal.h"

typedef struct reader {
    fsdp_launch_getenv_fn get;
    void *arg;
    char err[FSDP_ERR_LEN];
} reader_t;

/* Values are quoted in messages up to this many characters. */
#define SHOWN "%.100s"

static int fail(reader_t *r, const char *fmt, ...) FSDP_PRINTF(2, 3);

static int fail(reader_t *r, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(r->err, sizeof r->err, fmt, ap);
    va_end(ap);
    return FSDP_EINVAL;
}

/* The value of `name`, or NULL when it is unset or empty. */
static const char *lookup(reader_t *r, const char *name) {
    const char *v = r->get(name, r->arg);
    return v && *v ? v : NULL;
}

static int all_digits(const char *s) {
    if (!*s) return 0;
    for (; *s; s++)
        if (*s < '0' || *s > '9') return 0;
    return 1;
}

/* Parses the value v of variable `name` as a non-negative decimal int. */
static int parse_num(reader_t *r, const char *name, const char *v, int *out) {
    if (v[0] == '-' && all_digits(v + 1)) return fail(r, "%s=" SHOWN " is negative", name, v);
    if (!all_digits(v)) return fail(r, "%s='" SHOWN "' is not a number", name, v);
    long long x = 0;
    for (const char *p = v; *p; p++) {
        x = x * 10 + (*p - '0');
        if (x > INT_MAX) return fail(r, "%s=" SHOWN " is too large", name, v);
    }
    *out = (int)x;
    return 0;
}

/* Reads the optional number `name`: *set says whether it was there. */
static int read_num(reader_t *r, const char *name, int *out, int *set) {
    const char *v = lookup(r, name);
    *set = v != NULL;
    return v ? parse_num(r, name, v, out) : 0;
}

/* Reads two variables that must be set together: *set is 1 when both are, 0 when neither. */
static int read_pair(reader_t *r, const char *a_name, int *a, const char *b_name, int *b,
                     int *set) {
    const char *av = lookup(r, a_name), *bv = lookup(r, b_name);
    *set = 0;
    if (!av && !bv) return 0;
    if (!bv) return fail(r, "%s is set (" SHOWN ") but %s is not", a_name, av, b_name);
    if (!av) return fail(r, "%s is set (" SHOWN ") but %s is not", b_name, bv, a_name);
    int rc = parse_num(r, a_name, av, a);
    if (rc == 0) rc = parse_num(r, b_name, bv, b);
    *set = rc == 0;
    return rc;
}

static int check_size(reader_t *r, const char *name, int v) {
    return v >= 1 ? 0 : fail(r, "%s=%d must be at least 1", name, v);
}

static int check_below(reader_t *r, const char *a_name, int a, const char *b_name, int b) {
    return a < b ? 0 : fail(r, "%s=%d is not less than %s=%d", a_name, a, b_name, b);
}

/* A rank/size pair that must be there: checks both and that rank < size. */
static int read_global(reader_t *r, const char *rank_name, const char *size_name,
                       fsdp_launch_env_t *e) {
    int set = 0;
    int rc = read_pair(r, rank_name, &e->rank, size_name, &e->world_size, &set);
    if (rc == 0) rc = check_size(r, size_name, e->world_size);
    if (rc == 0) rc = check_below(r, rank_name, e->rank, size_name, e->world_size);
    return rc;
}

/* The optional local pair; without it the job is taken to run on one node. */
static int read_local(reader_t *r, const char *rank_name, const char *size_name,
                      const char *world_name, fsdp_launch_env_t *e) {
    int set = 0;
    int rc = read_pair(r, rank_name, &e->local_rank, size_name, &e->local_world_size, &set);
    if (rc < 0) return rc;
    if (!set) {
        e->local_rank = e->rank;
        e->local_world_size = e->world_size;
        return 0;
    }
    rc = check_size(r, size_name, e->local_world_size);
    if (rc == 0) rc = check_below(r, rank_name, e->local_rank, size_name, e->local_world_size);
    if (rc == 0 && e->local_world_size > e->world_size)
        rc = fail(r, "%s=%d is larger than %s=%d", size_name, e->local_world_size, world_name,
                  e->world_size);
    return rc;
}

/* Optional node index and count; each may be missing (-1). */
static int read_node(reader_t *r, const char *rank_name, const char *count_name,
                     fsdp_launch_env_t *e) {
    int set = 0, rc;
    e->node_rank = e->nnodes = -1;
    rc = read_num(r, count_name, &e->nnodes, &set);
    if (rc < 0) return rc;
    if (set) {
        rc = check_size(r, count_name, e->nnodes);
        if (rc < 0) return rc;
    }
    rc = read_num(r, rank_name, &e->node_rank, &set);
    if (rc < 0) return rc;
    if (set && e->nnodes > 0) rc = check_below(r, rank_name, e->node_rank, count_name, e->nnodes);
    return rc;
}

/* fsdprun and torchrun. */
static int read_torchrun(reader_t *r, fsdp_launch_env_t *e) {
    int rc = read_global(r, "RANK", "WORLD_SIZE", e);
    if (rc == 0) rc = read_local(r, "LOCAL_RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE", e);
    if (rc < 0) return rc;
    if (lookup(r, "NODE_RANK") || lookup(r, "NNODES")) {
        rc = read_node(r, "NODE_RANK", "NNODES", e);
        snprintf(e->source, sizeof e->source, "%s", lookup(r, "NNODES") ? "fsdprun" : "torchrun");
    } else {
        rc = read_node(r, "GROUP_RANK", "GROUP_WORLD_SIZE", e);
        snprintf(e->source, sizeof e->source, "torchrun");
    }
    return rc;
}

/*
 * The task count of node `node` in a SLURM_TASKS_PER_NODE value v: comma-separated entries
 * COUNT or COUNT(xREPEAT), each covering REPEAT consecutive nodes. With node < 0 (SLURM_NODEID
 * unset) the answer exists only when every node runs the same count.
 */
static int slurm_tasks_on_node(reader_t *r, const char *v, int node, int *count) {
    const char *name = "SLURM_TASKS_PER_NODE";
    const char *p = v;
    long long nodes = 0;
    int first = -1, uniform = 1, found = -1;
    for (;;) {
        long long c = 0, reps = 1;
        if (*p < '0' || *p > '9') goto malformed;
        for (; *p >= '0' && *p <= '9'; p++) {
            c = c * 10 + (*p - '0');
            if (c > INT_MAX) goto malformed;
        }
        if (*p == '(') {
            if (p[1] != 'x' || p[2] < '0' || p[2] > '9') goto malformed;
            p += 2;
            reps = 0;
            for (; *p >= '0' && *p <= '9'; p++) {
                reps = reps * 10 + (*p - '0');
                if (reps > INT_MAX) goto malformed;
            }
            if (*p != ')') goto malformed;
            p++;
        }
        if (c < 1 || reps < 1) goto malformed;
        if (node >= nodes && node < nodes + reps) found = (int)c;
        nodes += reps;
        if (nodes > INT_MAX) goto malformed;
        if (first < 0)
            first = (int)c;
        else if (c != first)
            uniform = 0;
        if (*p == 0) break;
        if (*p != ',') goto malformed;
        p++;
    }
    if (node >= 0) {
        if (found < 0)
            return fail(r, "SLURM_NODEID=%d is not less than the %lld nodes of %s='" SHOWN "'",
                        node, nodes, name, v);
        *count = found;
    } else {
        if (!uniform)
            return fail(r, "%s='" SHOWN "' differs between nodes, and SLURM_NODEID is not set",
                        name, v);
        *count = first;
    }
    return 0;
malformed:
    return fail(r,
                "%s='" SHOWN "' is malformed at character %d (want COUNT or COUNT(xREPEAT), "
                "separated by commas, every count at least 1)",
                name, v, (int)(p - v) + 1);
}

/* Slurm's srun. */
static int read_slurm(reader_t *r, fsdp_launch_env_t *e) {
    int rc = read_global(r, "SLURM_PROCID", "SLURM_NTASKS", e);
    if (rc < 0) return rc;
    const char *local = lookup(r, "SLURM_LOCALID");
    if (!local) return fail(r, "SLURM_PROCID is set (%d) but SLURM_LOCALID is not", e->rank);
    rc = parse_num(r, "SLURM_LOCALID", local, &e->local_rank);
    if (rc == 0) rc = read_node(r, "SLURM_NODEID", "SLURM_NNODES", e);
    if (rc < 0) return rc;

    const char *tpn = lookup(r, "SLURM_TASKS_PER_NODE");
    int set = 0;
    char from[160];
    if (tpn) {
        rc = slurm_tasks_on_node(r, tpn, e->node_rank, &e->local_world_size);
        snprintf(from, sizeof from, "SLURM_TASKS_PER_NODE='%.100s'", tpn);
    } else {
        rc = read_num(r, "SLURM_NTASKS_PER_NODE", &e->local_world_size, &set);
        if (rc == 0 && set) rc = check_size(r, "SLURM_NTASKS_PER_NODE", e->local_world_size);
        if (rc < 0) return rc;
        if (set) {
            snprintf(from, sizeof from, "SLURM_NTASKS_PER_NODE=%d", e->local_world_size);
            /* --ntasks-per-node is a maximum: a step with fewer tasks than that on one node
             * still has all of them locally. */
            if (e->local_world_size > e->world_size) e->local_world_size = e->world_size;
        } else if (e->nnodes == 1) {
            e->local_world_size = e->world_size;
            snprintf(from, sizeof from, "SLURM_NTASKS=%d on one node", e->world_size);
        } else {
            char nn[48] = "SLURM_NNODES is unset";
            if (e->nnodes > 0) snprintf(nn, sizeof nn, "SLURM_NNODES=%d is not 1", e->nnodes);
            return fail(r,
                        "SLURM_PROCID is set (%d) but neither SLURM_TASKS_PER_NODE nor "
                        "SLURM_NTASKS_PER_NODE is, and %s: cannot tell how many tasks run on "
                        "this node",
                        e->rank, nn);
        }
    }
    if (rc < 0) return rc;
    if (e->local_rank >= e->local_world_size)
        return fail(r, "SLURM_LOCALID=%d is not less than %d, the tasks on this node by %s",
                    e->local_rank, e->local_world_size, from);
    if (e->local_world_size > e->world_size)
        return fail(r, "%s gives %d tasks on this node, more than SLURM_NTASKS=%d", from,
                    e->local_world_size, e->world_size);
    snprintf(e->source, sizeof e->source, "slurm");
    return 0;
}

/* Open MPI's mpirun. */
static int read_openmpi(reader_t *r, fsdp_launch_env_t *e) {
    int rc = read_global(r, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", e);
    if (rc == 0)
        rc = read_local(r, "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE",
                        "OMPI_COMM_WORLD_SIZE", e);
    e->node_rank = e->nnodes = -1;
    snprintf(e->source, sizeof e->source, "openmpi");
    return rc;
}

static int read_string(reader_t *r, const char *name, const char *dflt, char *dst, size_t cap) {
    const char *v = lookup(r, name);
    if (!v) v = dflt;
    size_t n = strlen(v);
    /* A store URL may hold a password: its length is told, never its text. */
    if (n >= cap && strcmp(name, "FSDP_STORE") == 0)
        return fail(r, "%s is %zu characters long; at most %zu fit", name, n, cap - 1);
    if (n >= cap)
        return fail(r, "%s='%.60s%s' is %zu characters long; at most %zu fit", name, v,
                    n > 60 ? "..." : "", n, cap - 1);
    memcpy(dst, v, n + 1);
    return 0;
}

static int parse(reader_t *r, fsdp_launch_env_t *e) {
    int rc;
    if (lookup(r, "RANK") || lookup(r, "WORLD_SIZE")) rc = read_torchrun(r, e);
    /* Only SLURM_PROCID marks a Slurm task: salloc shells carry SLURM_NTASKS too, and a single
     * process started there is not one of N ranks. */
    else if (lookup(r, "SLURM_PROCID"))
        rc = read_slurm(r, e);
    else if (lookup(r, "OMPI_COMM_WORLD_RANK") || lookup(r, "OMPI_COMM_WORLD_SIZE"))
        rc = read_openmpi(r, e);
    else
        rc = 0; /* the defaults set by the caller: rank 0 of 1, "none" */
    if (rc == 0) rc = read_string(r, "FSDP_STORE", "", e->store_url, sizeof e->store_url);
    if (rc == 0) rc = read_string(r, "FSDP_BACKEND", "gloo", e->backend, sizeof e->backend);
    return rc;
}

int fsdp_launch_env_parse(fsdp_launch_getenv_fn get, void *arg, fsdp_launch_env_t *out, char *msg,
                          size_t msg_cap) {
    reader_t r = {.get = get, .arg = arg, .err = ""};
    int rc;
    if (!get || !out) {
        rc = fail(&r, "fsdp_launch_env_parse: %s is NULL", get ? "out" : "get");
    } else {
        fsdp_launch_env_t e = {.rank = 0,
                               .world_size = 1,
                               .local_rank = 0,
                               .local_world_size = 1,
                               .node_rank = -1,
                               .nnodes = -1,
                               .store_url = "",
                               .backend = "",
                               .source = "none"};
        rc = parse(&r, &e);
        if (rc == 0) *out = e;
    }
    if (msg && msg_cap > 0) snprintf(msg, msg_cap, "%s", rc == 0 ? "" : r.err);
    return rc;
}

static const char *process_getenv(const char *name, void *arg) {
    (void)arg;
    return getenv(name);
}

int fsdp_launch_env_read(fsdp_launch_env_t *out, char *msg, size_t msg_cap) {
    return fsdp_launch_env_parse(process_getenv, NULL, out, msg, msg_cap);
}
