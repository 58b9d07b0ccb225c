/* SPDX-License-Identifier: MIT */
/*
 * t_launch_env.c: the launch-environment parser (fsdp/launch.h), fed from tables.
 *
 * Each case is an environment (NAME=VALUE strings) and either the record it must give, written
 * as one line so a failure shows every field, or the pieces its error message must contain.
 * Error messages must name the variable and show its value, so the needles say both.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <fsdp.h>

#include "tap.h"

#define MAXVARS 16

/* The getter: looks NAME up in a NULL-terminated array of "NAME=VALUE". */
static const char *table_get(const char *name, void *arg) {
    const char *const *env = arg;
    size_t n = strlen(name);
    for (; *env; env++)
        if (strncmp(*env, name, n) == 0 && (*env)[n] == '=') return *env + n + 1;
    return NULL;
}

static void describe(const fsdp_launch_env_t *e, char *buf, size_t cap) {
    snprintf(buf, cap, "rank %d/%d local %d/%d node %d/%d %s store='%s' backend=%s", e->rank,
             e->world_size, e->local_rank, e->local_world_size, e->node_rank, e->nnodes, e->source,
             e->store_url, e->backend);
}

typedef struct ok_case {
    const char *name;
    const char *env[MAXVARS];
    const char *want; /* describe() of the expected record */
} ok_case_t;

static const ok_case_t ok_cases[] = {
    {"empty environment: rank 0 of 1",
     {NULL},
     "rank 0/1 local 0/1 node -1/-1 none store='' backend=gloo"},
    {"fsdprun: every variable",
     {"RANK=5", "WORLD_SIZE=8", "LOCAL_RANK=1", "LOCAL_WORLD_SIZE=4", "NODE_RANK=1", "NNODES=2",
      "FSDP_STORE=file:///tmp/fsdprun.abc", "FSDP_BACKEND=nccl", NULL},
     "rank 5/8 local 1/4 node 1/2 fsdprun store='file:///tmp/fsdprun.abc' backend=nccl"},
    {"torchrun: GROUP_RANK and GROUP_WORLD_SIZE give the node",
     {"RANK=3", "WORLD_SIZE=4", "LOCAL_RANK=1", "LOCAL_WORLD_SIZE=2", "GROUP_RANK=1",
      "GROUP_WORLD_SIZE=2", "TORCHELASTIC_RUN_ID=x", NULL},
     "rank 3/4 local 1/2 node 1/2 torchrun store='' backend=gloo"},
    {"RANK and WORLD_SIZE alone: one node, local = global",
     {"RANK=2", "WORLD_SIZE=3", NULL},
     "rank 2/3 local 2/3 node -1/-1 torchrun store='' backend=gloo"},
    {"NODE_RANK without NNODES: fsdprun naming, count unknown",
     {"RANK=0", "WORLD_SIZE=2", "NODE_RANK=0", NULL},
     "rank 0/2 local 0/2 node 0/-1 torchrun store='' backend=gloo"},
    {"zeros are numbers",
     {"RANK=0", "WORLD_SIZE=1", "LOCAL_RANK=00", "LOCAL_WORLD_SIZE=1", NULL},
     "rank 0/1 local 0/1 node -1/-1 torchrun store='' backend=gloo"},
    {"empty values count as unset",
     {"RANK=", "WORLD_SIZE=", "SLURM_PROCID=", "FSDP_BACKEND=", "FSDP_STORE=", NULL},
     "rank 0/1 local 0/1 node -1/-1 none store='' backend=gloo"},
    {"slurm: SLURM_TASKS_PER_NODE=4,3 on node 1",
     {"SLURM_PROCID=5", "SLURM_NTASKS=7", "SLURM_LOCALID=1", "SLURM_NODEID=1", "SLURM_NNODES=2",
      "SLURM_TASKS_PER_NODE=4,3", NULL},
     "rank 5/7 local 1/3 node 1/2 slurm store='' backend=gloo"},
    {"slurm: 4(x2),3 on node 0",
     {"SLURM_PROCID=1", "SLURM_NTASKS=11", "SLURM_LOCALID=1", "SLURM_NODEID=0", "SLURM_NNODES=3",
      "SLURM_TASKS_PER_NODE=4(x2),3", NULL},
     "rank 1/11 local 1/4 node 0/3 slurm store='' backend=gloo"},
    {"slurm: 4(x2),3 on node 1",
     {"SLURM_PROCID=7", "SLURM_NTASKS=11", "SLURM_LOCALID=3", "SLURM_NODEID=1", "SLURM_NNODES=3",
      "SLURM_TASKS_PER_NODE=4(x2),3", NULL},
     "rank 7/11 local 3/4 node 1/3 slurm store='' backend=gloo"},
    {"slurm: 4(x2),3 on node 2",
     {"SLURM_PROCID=10", "SLURM_NTASKS=11", "SLURM_LOCALID=2", "SLURM_NODEID=2", "SLURM_NNODES=3",
      "SLURM_TASKS_PER_NODE=4(x2),3", "FSDP_STORE=redis://h:6379/j", NULL},
     "rank 10/11 local 2/3 node 2/3 slurm store='redis://h:6379/j' backend=gloo"},
    {"slurm: 1,2(x2),5 on node 3",
     {"SLURM_PROCID=9", "SLURM_NTASKS=10", "SLURM_LOCALID=4", "SLURM_NODEID=3",
      "SLURM_TASKS_PER_NODE=1,2(x2),5", NULL},
     "rank 9/10 local 4/5 node 3/-1 slurm store='' backend=gloo"},
    {"slurm: a uniform 2(x3) needs no SLURM_NODEID",
     {"SLURM_PROCID=3", "SLURM_NTASKS=6", "SLURM_LOCALID=1", "SLURM_TASKS_PER_NODE=2(x3)", NULL},
     "rank 3/6 local 1/2 node -1/-1 slurm store='' backend=gloo"},
    {"slurm: 2,2,2 is uniform too",
     {"SLURM_PROCID=3", "SLURM_NTASKS=6", "SLURM_LOCALID=1", "SLURM_TASKS_PER_NODE=2,2,2", NULL},
     "rank 3/6 local 1/2 node -1/-1 slurm store='' backend=gloo"},
    {"slurm: SLURM_NTASKS_PER_NODE when SLURM_TASKS_PER_NODE is unset",
     {"SLURM_PROCID=6", "SLURM_NTASKS=8", "SLURM_LOCALID=2", "SLURM_NTASKS_PER_NODE=4",
      "SLURM_NODEID=1", "SLURM_NNODES=2", NULL},
     "rank 6/8 local 2/4 node 1/2 slurm store='' backend=gloo"},
    {"slurm: SLURM_TASKS_PER_NODE wins over SLURM_NTASKS_PER_NODE",
     {"SLURM_PROCID=4", "SLURM_NTASKS=5", "SLURM_LOCALID=0", "SLURM_NTASKS_PER_NODE=4",
      "SLURM_TASKS_PER_NODE=4,1", "SLURM_NODEID=1", NULL},
     "rank 4/5 local 0/1 node 1/-1 slurm store='' backend=gloo"},
    {"slurm: SLURM_NTASKS_PER_NODE above SLURM_NTASKS is capped",
     {"SLURM_PROCID=1", "SLURM_NTASKS=2", "SLURM_LOCALID=1", "SLURM_NTASKS_PER_NODE=8", NULL},
     "rank 1/2 local 1/2 node -1/-1 slurm store='' backend=gloo"},
    {"slurm: one node and no per-node count: local = global",
     {"SLURM_PROCID=2", "SLURM_NTASKS=3", "SLURM_LOCALID=2", "SLURM_NNODES=1", NULL},
     "rank 2/3 local 2/3 node -1/1 slurm store='' backend=gloo"},
    {"slurm: SLURM_NTASKS without SLURM_PROCID (an salloc shell) is no launch",
     {"SLURM_NTASKS=4", "SLURM_NNODES=2", "SLURM_TASKS_PER_NODE=2(x2)", NULL},
     "rank 0/1 local 0/1 node -1/-1 none store='' backend=gloo"},
    {"openmpi: all four, node unknown despite OMPI_COMM_WORLD_NODE_RANK",
     {"OMPI_COMM_WORLD_RANK=3", "OMPI_COMM_WORLD_SIZE=4", "OMPI_COMM_WORLD_LOCAL_RANK=1",
      "OMPI_COMM_WORLD_LOCAL_SIZE=2", "OMPI_COMM_WORLD_NODE_RANK=1", NULL},
     "rank 3/4 local 1/2 node -1/-1 openmpi store='' backend=gloo"},
    {"openmpi: without the local pair, one node",
     {"OMPI_COMM_WORLD_RANK=1", "OMPI_COMM_WORLD_SIZE=2", "FSDP_BACKEND=sim", NULL},
     "rank 1/2 local 1/2 node -1/-1 openmpi store='' backend=sim"},
    {"precedence: fsdprun/torchrun over Slurm and Open MPI",
     {"OMPI_COMM_WORLD_RANK=3", "OMPI_COMM_WORLD_SIZE=4", "SLURM_PROCID=2", "SLURM_NTASKS=3",
      "SLURM_LOCALID=2", "SLURM_NNODES=1", "RANK=1", "WORLD_SIZE=2", NULL},
     "rank 1/2 local 1/2 node -1/-1 torchrun store='' backend=gloo"},
    {"precedence: Slurm over Open MPI",
     {"OMPI_COMM_WORLD_RANK=3", "OMPI_COMM_WORLD_SIZE=4", "SLURM_PROCID=2", "SLURM_NTASKS=3",
      "SLURM_LOCALID=2", "SLURM_NNODES=1", NULL},
     "rank 2/3 local 2/3 node -1/1 slurm store='' backend=gloo"},
    {"precedence: a bad variable of a lower source is not read",
     {"RANK=0", "WORLD_SIZE=1", "SLURM_PROCID=x", "OMPI_COMM_WORLD_RANK=-3", NULL},
     "rank 0/1 local 0/1 node -1/-1 torchrun store='' backend=gloo"},
    {"largest int",
     {"RANK=2147483646", "WORLD_SIZE=2147483647", NULL},
     "rank 2147483646/2147483647 local 2147483646/2147483647 node -1/-1 torchrun store='' "
     "backend=gloo"},
};

typedef struct err_case {
    const char *name;
    const char *env[MAXVARS];
    const char *needles[3]; /* each must occur in the message */
} err_case_t;

static const err_case_t err_cases[] = {
    /* fsdprun / torchrun */
    {"RANK not a number", {"RANK=abc", "WORLD_SIZE=2", NULL}, {"RANK='abc'", "not a number"}},
    {"RANK with a sign", {"RANK=+1", "WORLD_SIZE=2", NULL}, {"RANK='+1'", "not a number"}},
    {"RANK with a space", {"RANK= 1", "WORLD_SIZE=2", NULL}, {"RANK=' 1'", "not a number"}},
    {"RANK in hex", {"RANK=0x1", "WORLD_SIZE=2", NULL}, {"RANK='0x1'"}},
    {"WORLD_SIZE with a decimal point",
     {"RANK=0", "WORLD_SIZE=2.0", NULL},
     {"WORLD_SIZE='2.0'", "not a number"}},
    {"RANK negative", {"RANK=-1", "WORLD_SIZE=2", NULL}, {"RANK=-1", "negative"}},
    {"WORLD_SIZE negative", {"RANK=1", "WORLD_SIZE=-2", NULL}, {"WORLD_SIZE=-2", "negative"}},
    {"RANK too large",
     {"RANK=99999999999", "WORLD_SIZE=2", NULL},
     {"RANK=99999999999", "too large"}},
    {"WORLD_SIZE 0", {"RANK=0", "WORLD_SIZE=0", NULL}, {"WORLD_SIZE=0", "at least 1"}},
    {"RANK = WORLD_SIZE",
     {"RANK=2", "WORLD_SIZE=2", NULL},
     {"RANK=2 is not less than WORLD_SIZE=2"}},
    {"RANK without WORLD_SIZE", {"RANK=0", NULL}, {"RANK is set (0)", "WORLD_SIZE is not"}},
    {"WORLD_SIZE without RANK", {"WORLD_SIZE=4", NULL}, {"WORLD_SIZE is set (4)", "RANK is not"}},
    {"half-set RANK pair is reported even when Slurm is complete",
     {"WORLD_SIZE=4", "SLURM_PROCID=0", "SLURM_NTASKS=1", "SLURM_LOCALID=0", "SLURM_NNODES=1",
      NULL},
     {"WORLD_SIZE is set (4)", "RANK is not"}},
    {"LOCAL_RANK without LOCAL_WORLD_SIZE",
     {"RANK=0", "WORLD_SIZE=2", "LOCAL_RANK=0", NULL},
     {"LOCAL_RANK is set (0)", "LOCAL_WORLD_SIZE is not"}},
    {"LOCAL_WORLD_SIZE without LOCAL_RANK",
     {"RANK=0", "WORLD_SIZE=2", "LOCAL_WORLD_SIZE=2", NULL},
     {"LOCAL_WORLD_SIZE is set (2)", "LOCAL_RANK is not"}},
    {"LOCAL_RANK = LOCAL_WORLD_SIZE",
     {"RANK=0", "WORLD_SIZE=4", "LOCAL_RANK=2", "LOCAL_WORLD_SIZE=2", NULL},
     {"LOCAL_RANK=2 is not less than LOCAL_WORLD_SIZE=2"}},
    {"LOCAL_RANK not a number",
     {"RANK=0", "WORLD_SIZE=4", "LOCAL_RANK=one", "LOCAL_WORLD_SIZE=2", NULL},
     {"LOCAL_RANK='one'", "not a number"}},
    {"LOCAL_WORLD_SIZE 0",
     {"RANK=0", "WORLD_SIZE=4", "LOCAL_RANK=0", "LOCAL_WORLD_SIZE=0", NULL},
     {"LOCAL_WORLD_SIZE=0", "at least 1"}},
    {"LOCAL_WORLD_SIZE > WORLD_SIZE",
     {"RANK=0", "WORLD_SIZE=4", "LOCAL_RANK=0", "LOCAL_WORLD_SIZE=8", NULL},
     {"LOCAL_WORLD_SIZE=8 is larger than WORLD_SIZE=4"}},
    {"NODE_RANK = NNODES",
     {"RANK=0", "WORLD_SIZE=4", "NODE_RANK=2", "NNODES=2", NULL},
     {"NODE_RANK=2 is not less than NNODES=2"}},
    {"NNODES 0",
     {"RANK=0", "WORLD_SIZE=4", "NODE_RANK=0", "NNODES=0", NULL},
     {"NNODES=0", "at least 1"}},
    {"NODE_RANK negative",
     {"RANK=0", "WORLD_SIZE=4", "NODE_RANK=-1", "NNODES=2", NULL},
     {"NODE_RANK=-1", "negative"}},
    {"GROUP_RANK not a number",
     {"RANK=0", "WORLD_SIZE=4", "GROUP_RANK=x", NULL},
     {"GROUP_RANK='x'", "not a number"}},
    {"GROUP_RANK = GROUP_WORLD_SIZE",
     {"RANK=0", "WORLD_SIZE=4", "GROUP_RANK=1", "GROUP_WORLD_SIZE=1", NULL},
     {"GROUP_RANK=1 is not less than GROUP_WORLD_SIZE=1"}},
    /* Slurm */
    {"SLURM_PROCID without SLURM_NTASKS",
     {"SLURM_PROCID=0", "SLURM_LOCALID=0", NULL},
     {"SLURM_PROCID is set (0)", "SLURM_NTASKS is not"}},
    {"SLURM_PROCID = SLURM_NTASKS",
     {"SLURM_PROCID=4", "SLURM_NTASKS=4", "SLURM_LOCALID=0", "SLURM_NNODES=1", NULL},
     {"SLURM_PROCID=4 is not less than SLURM_NTASKS=4"}},
    {"SLURM_PROCID not a number",
     {"SLURM_PROCID=first", "SLURM_NTASKS=4", NULL},
     {"SLURM_PROCID='first'", "not a number"}},
    {"SLURM_NTASKS negative",
     {"SLURM_PROCID=0", "SLURM_NTASKS=-4", NULL},
     {"SLURM_NTASKS=-4", "negative"}},
    {"no SLURM_LOCALID",
     {"SLURM_PROCID=1", "SLURM_NTASKS=4", "SLURM_NNODES=1", NULL},
     {"SLURM_LOCALID is not", "SLURM_PROCID is set (1)"}},
    {"SLURM_LOCALID not a number",
     {"SLURM_PROCID=1", "SLURM_NTASKS=4", "SLURM_LOCALID=1a", "SLURM_NNODES=1", NULL},
     {"SLURM_LOCALID='1a'", "not a number"}},
    {"SLURM_NODEID = SLURM_NNODES",
     {"SLURM_PROCID=1", "SLURM_NTASKS=4", "SLURM_LOCALID=1", "SLURM_NODEID=2", "SLURM_NNODES=2",
      "SLURM_TASKS_PER_NODE=2(x2)", NULL},
     {"SLURM_NODEID=2 is not less than SLURM_NNODES=2"}},
    {"SLURM_NODEID past the SLURM_TASKS_PER_NODE list",
     {"SLURM_PROCID=1", "SLURM_NTASKS=11", "SLURM_LOCALID=1", "SLURM_NODEID=3",
      "SLURM_TASKS_PER_NODE=4(x2),3", NULL},
     {"SLURM_NODEID=3", "3 nodes", "SLURM_TASKS_PER_NODE='4(x2),3'"}},
    {"non-uniform SLURM_TASKS_PER_NODE without SLURM_NODEID",
     {"SLURM_PROCID=1", "SLURM_NTASKS=11", "SLURM_LOCALID=1", "SLURM_TASKS_PER_NODE=4(x2),3", NULL},
     {"SLURM_TASKS_PER_NODE='4(x2),3'", "SLURM_NODEID is not set"}},
    {"SLURM_LOCALID past this node's count",
     {"SLURM_PROCID=10", "SLURM_NTASKS=11", "SLURM_LOCALID=3", "SLURM_NODEID=2",
      "SLURM_TASKS_PER_NODE=4(x2),3", NULL},
     {"SLURM_LOCALID=3 is not less than 3", "SLURM_TASKS_PER_NODE='4(x2),3'"}},
    {"SLURM_LOCALID past SLURM_NTASKS_PER_NODE",
     {"SLURM_PROCID=3", "SLURM_NTASKS=8", "SLURM_LOCALID=3", "SLURM_NTASKS_PER_NODE=2", NULL},
     {"SLURM_LOCALID=3", "SLURM_NTASKS_PER_NODE=2"}},
    {"SLURM_NTASKS_PER_NODE 0",
     {"SLURM_PROCID=0", "SLURM_NTASKS=8", "SLURM_LOCALID=0", "SLURM_NTASKS_PER_NODE=0", NULL},
     {"SLURM_NTASKS_PER_NODE=0", "at least 1"}},
    {"SLURM_NTASKS_PER_NODE not a number",
     {"SLURM_PROCID=0", "SLURM_NTASKS=8", "SLURM_LOCALID=0", "SLURM_NTASKS_PER_NODE=4(x2)", NULL},
     {"SLURM_NTASKS_PER_NODE='4(x2)'", "not a number"}},
    {"SLURM_TASKS_PER_NODE sums past SLURM_NTASKS on this node",
     {"SLURM_PROCID=0", "SLURM_NTASKS=4", "SLURM_LOCALID=0", "SLURM_NODEID=0",
      "SLURM_TASKS_PER_NODE=5", NULL},
     {"SLURM_TASKS_PER_NODE='5'", "more than SLURM_NTASKS=4"}},
    {"no per-node count on several nodes",
     {"SLURM_PROCID=0", "SLURM_NTASKS=8", "SLURM_LOCALID=0", "SLURM_NNODES=2", NULL},
     {"SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE", "SLURM_NNODES=2 is not 1"}},
    {"no per-node count, node count unknown",
     {"SLURM_PROCID=0", "SLURM_NTASKS=8", "SLURM_LOCALID=0", NULL},
     {"SLURM_TASKS_PER_NODE", "SLURM_NNODES is unset"}},
    /* Open MPI */
    {"OMPI_COMM_WORLD_RANK without its size",
     {"OMPI_COMM_WORLD_RANK=0", NULL},
     {"OMPI_COMM_WORLD_RANK is set (0)", "OMPI_COMM_WORLD_SIZE is not"}},
    {"OMPI_COMM_WORLD_SIZE without its rank",
     {"OMPI_COMM_WORLD_SIZE=3", NULL},
     {"OMPI_COMM_WORLD_SIZE is set (3)", "OMPI_COMM_WORLD_RANK is not"}},
    {"OMPI_COMM_WORLD_RANK = size",
     {"OMPI_COMM_WORLD_RANK=3", "OMPI_COMM_WORLD_SIZE=3", NULL},
     {"OMPI_COMM_WORLD_RANK=3 is not less than OMPI_COMM_WORLD_SIZE=3"}},
    {"OMPI local rank = local size",
     {"OMPI_COMM_WORLD_RANK=1", "OMPI_COMM_WORLD_SIZE=4", "OMPI_COMM_WORLD_LOCAL_RANK=2",
      "OMPI_COMM_WORLD_LOCAL_SIZE=2", NULL},
     {"OMPI_COMM_WORLD_LOCAL_RANK=2 is not less than OMPI_COMM_WORLD_LOCAL_SIZE=2"}},
    {"OMPI local rank without local size",
     {"OMPI_COMM_WORLD_RANK=1", "OMPI_COMM_WORLD_SIZE=4", "OMPI_COMM_WORLD_LOCAL_RANK=1", NULL},
     {"OMPI_COMM_WORLD_LOCAL_RANK is set (1)", "OMPI_COMM_WORLD_LOCAL_SIZE is not"}},
    {"OMPI size not a number",
     {"OMPI_COMM_WORLD_RANK=0", "OMPI_COMM_WORLD_SIZE=four", NULL},
     {"OMPI_COMM_WORLD_SIZE='four'", "not a number"}},
};

/* Malformed SLURM_TASKS_PER_NODE values: each must be refused, naming the variable and value. */
static const char *const bad_tpn[] = {
    "4(x2",
    "4(2)",
    "4,,3",
    ",4",
    "4,",
    "4(x0)",
    "0",
    "4x2",
    "4(x2)3",
    "a",
    "4(x)",
    "(x2)",
    "4 ",
    "4(x2),",
    "4(x-1)",
    "-4",
    "99999999999",
    "4(x99999999999)",
    "4(x2147483647),1",
};

static void run_ok_cases(void) {
    for (size_t i = 0; i < sizeof ok_cases / sizeof ok_cases[0]; i++) {
        const ok_case_t *c = &ok_cases[i];
        fsdp_launch_env_t e;
        char msg[512] = "untouched", got[1024];
        int rc = fsdp_launch_env_parse(table_get, (void *)c->env, &e, msg, sizeof msg);
        if (rc == 0)
            describe(&e, got, sizeof got);
        else
            snprintf(got, sizeof got, "%s: %s", fsdp_err_name(rc), msg);
        tap_is_str(got, c->want, "%s", c->name);
        if (rc == 0 && msg[0]) tap_diag("success left a message: %s", msg);
    }
}

static void run_err_cases(void) {
    for (size_t i = 0; i < sizeof err_cases / sizeof err_cases[0]; i++) {
        const err_case_t *c = &err_cases[i];
        fsdp_launch_env_t e;
        memset(&e, 0x5a, sizeof e);
        char msg[512] = "";
        int rc = fsdp_launch_env_parse(table_get, (void *)c->env, &e, msg, sizeof msg);
        int untouched = 1;
        for (size_t b = 0; b < sizeof e; b++)
            if (((unsigned char *)&e)[b] != 0x5a) untouched = 0;
        tap_ok(rc == FSDP_EINVAL && untouched, "%s: FSDP_EINVAL, record untouched (rc %d)", c->name,
               rc);
        for (int k = 0; k < 3 && c->needles[k]; k++)
            tap_has_str(msg, c->needles[k], "%s: message has \"%s\"", c->name, c->needles[k]);
    }
}

static void run_bad_tpn(void) {
    for (size_t i = 0; i < sizeof bad_tpn / sizeof bad_tpn[0]; i++) {
        char var[128];
        snprintf(var, sizeof var, "SLURM_TASKS_PER_NODE=%s", bad_tpn[i]);
        const char *env[] = {
            "SLURM_PROCID=0", "SLURM_NTASKS=4", "SLURM_LOCALID=0", "SLURM_NODEID=0", var, NULL};
        fsdp_launch_env_t e;
        char msg[512] = "", want[128];
        int rc = fsdp_launch_env_parse(table_get, (void *)env, &e, msg, sizeof msg);
        snprintf(want, sizeof want, "SLURM_TASKS_PER_NODE='%s' is malformed", bad_tpn[i]);
        tap_ok(rc == FSDP_EINVAL && strstr(msg, want) != NULL,
               "SLURM_TASKS_PER_NODE='%s' is refused as malformed", bad_tpn[i]);
        if (rc != FSDP_EINVAL || !strstr(msg, want)) tap_diag("rc %d, message: %s", rc, msg);
    }
}

static void test_strings(void) {
    static char long_store[600], exact_store[512 + 16], long_backend[64];
    snprintf(long_store, sizeof long_store, "FSDP_STORE=file:///");
    memset(long_store + strlen(long_store), 'd', 520);
    /* 511 characters is the most that fits in store_url[512]. */
    snprintf(exact_store, sizeof exact_store, "FSDP_STORE=");
    memset(exact_store + 11, 's', 511);
    snprintf(long_backend, sizeof long_backend, "FSDP_BACKEND=%s",
             "a-backend-name-of-thirty-two-chars");
    fsdp_launch_env_t e;
    char msg[512];

    const char *env1[] = {long_store, NULL};
    int rc = fsdp_launch_env_parse(table_get, (void *)env1, &e, msg, sizeof msg);
    tap_is_int(rc, FSDP_EINVAL, "a 528-character FSDP_STORE does not fit");
    tap_has_str(msg, "FSDP_STORE is 528 characters long", "the message names FSDP_STORE");
    tap_ok(!strstr(msg, "file:///"), "but not its text, which may hold a password (issue 26): %s",
           msg);
    tap_has_str(msg, "at most 511", "the message gives the limit");

    const char *env2[] = {exact_store, NULL};
    rc = fsdp_launch_env_parse(table_get, (void *)env2, &e, msg, sizeof msg);
    tap_ok(rc == 0 && strlen(e.store_url) == 511, "a 511-character FSDP_STORE fits (rc %d)", rc);

    const char *env3[] = {long_backend, NULL};
    rc = fsdp_launch_env_parse(table_get, (void *)env3, &e, msg, sizeof msg);
    tap_is_int(rc, FSDP_EINVAL, "a 34-character FSDP_BACKEND does not fit (32 bytes with the NUL)");
    tap_has_str(msg, "FSDP_BACKEND='a-backend-name-of-thirty-two-chars' is 34",
                "the message names FSDP_BACKEND and its value");
}

static void test_buffers(void) {
    const char *bad[] = {"RANK=7", "WORLD_SIZE=2", NULL};
    fsdp_launch_env_t e;
    tap_is_int(fsdp_launch_env_parse(table_get, (void *)bad, &e, NULL, 0), FSDP_EINVAL,
               "msg may be NULL");
    char small[8];
    memset(small, 'z', sizeof small);
    fsdp_launch_env_parse(table_get, (void *)bad, &e, small, sizeof small);
    tap_is_str(small, "RANK=7 ", "a short msg buffer gets a cut, terminated message");
    char one = 'z';
    fsdp_launch_env_parse(table_get, (void *)bad, &e, &one, 1);
    tap_is_int(one, 0, "a one-byte buffer gets just the terminator");
    char msg[64] = "stale";
    const char *good[] = {NULL};
    fsdp_launch_env_parse(table_get, (void *)good, &e, msg, sizeof msg);
    tap_is_str(msg, "", "success clears the message");
    tap_is_int(fsdp_launch_env_parse(NULL, NULL, &e, msg, sizeof msg), FSDP_EINVAL,
               "a NULL getter is refused");
    tap_has_str(msg, "get is NULL", "and named");
    tap_is_int(fsdp_launch_env_parse(table_get, (void *)good, NULL, msg, sizeof msg), FSDP_EINVAL,
               "a NULL record is refused");
    tap_has_str(msg, "out is NULL", "and named");
}

/* fsdp_launch_env_read goes through the real environment. */
static void test_process_env(void) {
    static const char *const vars[] = {"RANK",
                                       "WORLD_SIZE",
                                       "LOCAL_RANK",
                                       "LOCAL_WORLD_SIZE",
                                       "NODE_RANK",
                                       "NNODES",
                                       "GROUP_RANK",
                                       "GROUP_WORLD_SIZE",
                                       "SLURM_PROCID",
                                       "OMPI_COMM_WORLD_RANK",
                                       "OMPI_COMM_WORLD_SIZE",
                                       "FSDP_STORE",
                                       "FSDP_BACKEND"};
    for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++)
        unsetenv(vars[i]);
    setenv("RANK", "3", 1);
    setenv("WORLD_SIZE", "4", 1);
    setenv("LOCAL_RANK", "1", 1);
    setenv("LOCAL_WORLD_SIZE", "2", 1);
    setenv("NODE_RANK", "1", 1);
    setenv("NNODES", "2", 1);
    setenv("FSDP_STORE", "file:///tmp/s", 1);
    fsdp_launch_env_t e;
    char msg[256], got[1024];
    int rc = fsdp_launch_env_read(&e, msg, sizeof msg);
    if (rc == 0)
        describe(&e, got, sizeof got);
    else
        snprintf(got, sizeof got, "%s", msg);
    tap_is_str(got, "rank 3/4 local 1/2 node 1/2 fsdprun store='file:///tmp/s' backend=gloo",
               "fsdp_launch_env_read reads the process environment");
    setenv("RANK", "4", 1);
    rc = fsdp_launch_env_read(&e, msg, sizeof msg);
    tap_is_int(rc, FSDP_EINVAL, "and reports its errors");
    tap_has_str(msg, "RANK=4 is not less than WORLD_SIZE=4", "with the variables named");
}

int main(void) {
    tap_plan_lazy();
    run_ok_cases();
    run_err_cases();
    run_bad_tpn();
    test_strings();
    test_buffers();
    test_process_env();
    return tap_done();
}
