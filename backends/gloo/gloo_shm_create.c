/* SPDX-License-Identifier: MIT */
/*
 * gloo_shm_create.c: how a group of the shared-memory transport (gloo_shm.h) is made: the
 * segment, and whether the group reads its peers' buffers in place (gloo_shm.c runs the
 * collectives).
 *
 * The segment: a header (the barrier's generation and arrival count, the closed mark), every
 * rank's process id and send address, then `size` slots of `slot` bytes and one result area
 * of `slot` bytes.
 * Rank 0 creates it under a unique name, the others open it, and rank 0 unlinks the name once
 * every rank has mapped it, so nothing is left in /dev/shm whatever happens later.
 *
 * Cross-memory attach is decided by all ranks together, each first reading a word of every
 * peer's memory with process_vm_readv. Whether reading in place pays. Through the slots, a block of
 * an all-gather costs its owner one local copy into its slot (and one into its own recv) and every
 * other rank one copy out; in place, the owner copies into its own recv and every other rank has
 * the kernel read it. At two ranks the slots cost three copies a block and reading in place one
 * copy and one read, so the read pays while it costs less than two copies; at more ranks the bar
 * falls towards one. The kernel's price varies by machine: it pins every page it reads, and on a
 * virtual machine that walks the guest's page tables, a read of 4 MiB measured 4.5 times a local
 * copy (docs/design.md). So, unless FSDP_GLOO_CMA is 0 or 1, each rank prices it at creation, in
 * processor time: a read of 4 MiB of its next peer's memory against a local copy of 4 MiB, the
 * best of three after a warm-up, and votes for reading in place only when the read costs less
 * than one and a half copies (the bar for two ranks, less what a reduce-scatter's cache-hot
 * reduction gains). The choice changes no bits: the same values are reduced in the same order.
 */
#define _GNU_SOURCE

#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include <fsdp/errno.h>

#include "backends/gloo/gloo_shm_impl.h"
#include "core/copy.h"
#include "core/cpus.h"
#include "core/timeutil.h"

#define SHM_MAGIC 0x46534d32u /* "FSM2" */
/* The block a rank reads from its next peer and copies locally to price cross-memory attach,
 * and how many times (the first of each warms the pages and is not counted). */
#define CAL_BYTES ((size_t)4 << 20)
#define CAL_REPS 4

static size_t align_up(size_t v, size_t a) {
    return (v + a - 1) / a * a;
}

static size_t pid_offset(void) {
    return align_up(sizeof(struct shm_hdr), 64);
}

static size_t addr_offset(int size) {
    return align_up(pid_offset() + (size_t)size * sizeof(int32_t), 64);
}

static size_t slots_offset(int size) {
    return align_up(addr_offset(size) + (size_t)size * sizeof(uint64_t), 4096);
}

/* Bytes per slot: 32 MiB shared out, between 256 KiB and 4 MiB a rank. */
static size_t slot_bytes(int size) {
    size_t s = ((size_t)32 << 20) / (size_t)size;
    if (s > ((size_t)4 << 20)) s = (size_t)4 << 20;
    if (s < ((size_t)256 << 10)) s = (size_t)256 << 10;
    return s / 4096 * 4096;
}

/* ---- creation ------------------------------------------------------------------------------ */

/* What two ranks must share to share memory and see each other's processes. */
static void host_id(char *buf, size_t cap) {
    char boot[64] = "", ipc[64] = "", pidns[64] = "";
    FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
    if (f) {
        if (!fgets(boot, sizeof boot, f)) boot[0] = 0;
        fclose(f);
        boot[strcspn(boot, "\n")] = 0;
    }
    ssize_t n = readlink("/proc/self/ns/ipc", ipc, sizeof ipc - 1);
    ipc[n > 0 ? n : 0] = 0;
    n = readlink("/proc/self/ns/pid", pidns, sizeof pidns - 1);
    pidns[n > 0 ? n : 0] = 0;
    if (!boot[0] || !ipc[0] || !pidns[0])
        snprintf(buf, cap, "unknown.%d", (int)getpid()); /* never equal to another process's */
    else
        snprintf(buf, cap, "%s %s %s", boot, ipc, pidns);
}

static int enabled(void) {
    const char *v = getenv("FSDP_GLOO_SHM");
    return !(v && strcmp(v, "0") == 0);
}

/* FSDP_GLOO_CMA: 0 never reads peers in place, 1 does whenever the kernel allows it, unset (or
 * anything else) does when it measures cheaper than the slots. Returns 0, 1 or -1 (measure). */
static int cma_mode(void) {
    const char *v = getenv("FSDP_GLOO_CMA");
    if (v && strcmp(v, "0") == 0) return 0;
    if (v && strcmp(v, "1") == 0) return 1;
    return -1;
}

/*
 * How long a barrier's waiter spins before it sleeps on the futex. Spinning wins a wake-up's
 * latency when the peers it waits for run on other cores. When the group's ranks outnumber the
 * CPUs this process may run on, the peer it waits for may need this very core, and the spin
 * only delays it: four ranks on two cores spent 9% of their processor time in the spin, and
 * their steps were 2 to 3 ms (6 to 8%) shorter without it (docs/design.md). FSDP_GLOO_SPIN, a
 * count of iterations from 0 to 1000000, forces the choice; anything else is ignored.
 */
static int spin_iters(int size, int *cpus_out) {
    const int cpus = fsdp__cpu_count();
    *cpus_out = cpus;
    const char *v = getenv("FSDP_GLOO_SPIN");
    if (v && *v) {
        char *end;
        long n = strtol(v, &end, 10);
        if (*end == 0 && n >= 0 && n <= 1000000) return (int)n;
    }
    return size <= cpus ? FSDP__GLOO_SHM_SPIN : 0;
}

int fsdp__gloo_shm_cma_read(pid_t pid, void *dst, uint64_t from, size_t bytes) {
    size_t done = 0;
    while (done < bytes) {
        struct iovec local = {(char *)dst + done, bytes - done};
        struct iovec remote = {(void *)(uintptr_t)(from + done), bytes - done};
        ssize_t n = process_vm_readv(pid, &local, 1, &remote, 1, 0);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) {
            if (n == 0) errno = EFAULT;
            return -1;
        }
        done += (size_t)n;
    }
    return 0;
}

/* Prices cross-memory attach on this machine: the processor time (this thread's, so that being
 * descheduled does not count) to read CAL_BYTES at `from` in process pid, and to copy CAL_BYTES
 * locally with the copy the slots use; the best of CAL_REPS - 1 rounds after one that warms
 * the pages. buf holds 2 CAL_BYTES. Returns 0, or -1 when a read fails. */
static int cma_price(pid_t pid, uint64_t from, char *buf, int64_t *read_ns, int64_t *copy_ns) {
    *read_ns = *copy_ns = INT64_MAX;
    for (int rep = 0; rep < CAL_REPS; rep++) {
        int64_t t0 = fsdp__thread_cpu_ns();
        if (fsdp__gloo_shm_cma_read(pid, buf, from, CAL_BYTES) != 0) return -1;
        int64_t t1 = fsdp__thread_cpu_ns();
        fsdp__copy_large(buf, buf + CAL_BYTES, CAL_BYTES);
        int64_t t2 = fsdp__thread_cpu_ns();
        if (rep == 0) continue;
        if (t1 - t0 < *read_ns) *read_ns = t1 - t0;
        if (t2 - t1 < *copy_ns) *copy_ns = t2 - t1;
    }
    return 0;
}

/* Whether reading peers in place pays, from one rank's prices (see the file's comment). */
static int cma_pays(int64_t read_ns, int64_t copy_ns) {
    return 2 * read_ns < 3 * copy_ns;
}

static int store_fail(fsdp_store_t *store, int rc, char *msg, size_t cap) {
    snprintf(msg, cap, "store: %s", fsdp_store_last_error(store));
    return rc;
}

/* Sets key "<what>/<rank>" to val. */
static int put_mine(fsdp_store_t *store, const char *what, int rank, const char *val) {
    char key[64];
    snprintf(key, sizeof key, "%s/%d", what, rank);
    return fsdp_store_set(store, key, val, strlen(val));
}

/* Reads key "<what>/<q>" into buf (NUL-terminated). */
static int get_theirs(fsdp_store_t *store, const char *what, int q, char *buf, size_t cap) {
    char key[64];
    size_t len = 0;
    snprintf(key, sizeof key, "%s/%d", what, q);
    int rc = fsdp_store_get(store, key, buf, cap - 1, &len);
    if (rc < 0) return rc;
    buf[len < cap - 1 ? len : cap - 1] = 0;
    return FSDP_OK;
}

void fsdp__gloo_shm_unmap(fsdp_gloo_shm_t *s) {
    if (s->h) munmap(s->h, s->bytes);
    free(s);
}

/* Maps (rank 0: creates) the segment `name`; msg says why not. */
static int map_segment(fsdp_gloo_shm_t *s, const char *name, int create, char *msg, size_t cap) {
    int fd = create ? shm_open(name, O_RDWR | O_CREAT | O_EXCL, 0600) : shm_open(name, O_RDWR, 0);
    if (fd < 0) {
        snprintf(msg, cap, "shm_open(%s): %s", name, strerror(errno));
        return -1;
    }
    int err = 0;
    /* posix_fallocate, not ftruncate alone: a /dev/shm too small for the segment must fail
     * here, not raise SIGBUS at the first copy into a page it cannot back. */
    if (create && (err = posix_fallocate(fd, 0, (off_t)s->bytes)) != 0) {
        snprintf(msg, cap, "reserving %zu bytes of shared memory: %s", s->bytes, strerror(err));
        close(fd);
        shm_unlink(name);
        return -1;
    }
    struct stat st;
    if (!create && (fstat(fd, &st) != 0 || (size_t)st.st_size < s->bytes)) {
        snprintf(msg, cap, "segment %s is smaller than %zu bytes", name, s->bytes);
        close(fd);
        return -1;
    }
    void *p = mmap(NULL, s->bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) {
        snprintf(msg, cap, "mmap of %zu bytes: %s", s->bytes, strerror(errno));
        if (create) shm_unlink(name);
        return -1;
    }
    s->h = p;
    s->pid = (int32_t *)((char *)p + pid_offset());
    s->addr = (uint64_t *)(void *)((char *)p + addr_offset(s->size));
    s->slots = (char *)p + slots_offset(s->size);
    s->result = s->slots + (size_t)s->size * s->slot;
    if (create) {
        s->h->magic = SHM_MAGIC;
        s->h->size = (uint32_t)s->size;
        s->h->slot = s->slot;
        atomic_init(&s->h->gen, 0);
        atomic_init(&s->h->count, 0);
        atomic_init(&s->h->closed, 0);
    } else if (s->h->magic != SHM_MAGIC || s->h->size != (uint32_t)s->size ||
               s->h->slot != s->slot) {
        snprintf(msg, cap, "segment %s does not describe this group", name);
        return -1;
    }
    s->pid[s->rank] = (int32_t)getpid();
    return 0;
}

int fsdp__gloo_shm_create(fsdp_store_t *store, int rank, int size, fsdp_gloo_shm_t **out, char *msg,
                          size_t cap) {
    char mine[200], theirs[200], name[96];
    int rc;
    *out = NULL;
    msg[0] = 0;
    if (size < 2) {
        snprintf(msg, cap, "one rank");
        return FSDP_OK;
    }
    /* 1. Every rank asks for it and sees the same host. */
    if (enabled())
        host_id(mine, sizeof mine);
    else
        snprintf(mine, sizeof mine, "off");
    if ((rc = put_mine(store, "shm.host", rank, mine)) < 0) return store_fail(store, rc, msg, cap);
    int same = strcmp(mine, "off") != 0;
    for (int q = 0; q < size; q++) {
        if ((rc = get_theirs(store, "shm.host", q, theirs, sizeof theirs)) < 0)
            return store_fail(store, rc, msg, cap);
        if (strcmp(theirs, mine) != 0 && same) {
            same = 0;
            snprintf(msg, cap, "rank %d is on another host or namespace, or asked for TCP", q);
        }
    }
    if (!same) {
        if (!msg[0]) snprintf(msg, cap, "FSDP_GLOO_SHM=0");
        return FSDP_OK;
    }
    /* 2. Rank 0 creates the segment and names it; the others map it. */
    fsdp_gloo_shm_t *s = calloc(1, sizeof *s);
    if (!s) {
        snprintf(msg, cap, "out of memory");
        return FSDP_ENOMEM;
    }
    s->rank = rank;
    s->size = size;
    s->slot = slot_bytes(size);
    s->bytes = slots_offset(size) + ((size_t)size + 1) * s->slot;
    char why[160] = "";
    int ok;
    if (rank == 0) {
        static _Atomic unsigned serial;
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        snprintf(name, sizeof name, "/fsdp-gloo.%d.%u.%ld", (int)getpid(),
                 atomic_fetch_add(&serial, 1), (long)ts.tv_nsec);
        ok = map_segment(s, name, 1, why, sizeof why) == 0;
        rc = fsdp_store_set(store, "shm.name", ok ? name : "", ok ? strlen(name) : 0);
        if (rc < 0) {
            if (ok) shm_unlink(name);
            fsdp__gloo_shm_unmap(s);
            return store_fail(store, rc, msg, cap);
        }
    } else {
        size_t len = 0;
        if ((rc = fsdp_store_get(store, "shm.name", name, sizeof name - 1, &len)) < 0) {
            fsdp__gloo_shm_unmap(s);
            return store_fail(store, rc, msg, cap);
        }
        name[len < sizeof name - 1 ? len : sizeof name - 1] = 0;
        ok = name[0] && map_segment(s, name, 0, why, sizeof why) == 0;
        if (!name[0]) snprintf(why, sizeof why, "rank 0 could not create the segment");
    }
    /* 3. Every rank says whether it mapped it; rank 0 then unlinks the name. */
    if ((rc = put_mine(store, "shm.ok", rank, ok ? "1" : "0")) < 0) {
        if (rank == 0 && ok) shm_unlink(name);
        fsdp__gloo_shm_unmap(s);
        return store_fail(store, rc, msg, cap);
    }
    int all = ok;
    for (int q = 0; q < size && rc == FSDP_OK; q++) {
        rc = get_theirs(store, "shm.ok", q, theirs, sizeof theirs);
        if (rc == FSDP_OK && strcmp(theirs, "1") != 0 && all) {
            all = 0;
            if (!why[0]) snprintf(why, sizeof why, "rank %d could not map the segment", q);
        }
    }
    if (rank == 0 && name[0] && ok) shm_unlink(name);
    if (rc < 0) {
        fsdp__gloo_shm_unmap(s);
        return store_fail(store, rc, msg, cap);
    }
    if (!all) {
        snprintf(msg, cap, "%s", why);
        fsdp__gloo_shm_unmap(s);
        return FSDP_OK;
    }
    /* 4. Cross-memory attach: every rank publishes where a random word of its own lies, and a
     * block to price the reads by; reads each peer's word with process_vm_readv; unless
     * FSDP_GLOO_CMA says otherwise, prices reading its next peer's block against a local copy;
     * and says whether every read gave the word and the price was right. The group reads peers'
     * buffers in place only when every rank said so (the kernel, a seccomp filter, the prices
     * or FSDP_GLOO_CMA=0 may forbid it). A rank keeps its block until every rank has spoken. */
    char val[96];
    const int mode = cma_mode();
    int can = mode != 0;
    char *cal = NULL;
    if (can && mode < 0 && (cal = malloc(2 * CAL_BYTES)) != NULL) memset(cal, 0x5a, 2 * CAL_BYTES);
    if (can) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        s->probe = ((uint64_t)getpid() << 32) ^ (uint64_t)ts.tv_nsec ^ 0x9e3779b97f4a7c15ull;
        snprintf(val, sizeof val, "%llx %llx %llx", (unsigned long long)(uintptr_t)&s->probe,
                 (unsigned long long)s->probe,
                 (unsigned long long)(uintptr_t)(cal ? cal + CAL_BYTES : NULL));
    } else {
        snprintf(val, sizeof val, "off");
    }
    rc = put_mine(store, "shm.probe", rank, val);
    const int next = (rank + 1) % size;
    unsigned long long next_cal = 0;
    for (int q = 0; q < size && rc == FSDP_OK && can; q++) {
        unsigned long long where = 0, word = 0, block = 0, got = 0;
        if (q == rank || (rc = get_theirs(store, "shm.probe", q, theirs, sizeof theirs)) < 0)
            continue;
        can = sscanf(theirs, "%llx %llx %llx", &where, &word, &block) == 3 &&
              fsdp__gloo_shm_cma_read((pid_t)s->pid[q], &got, where, sizeof got) == 0 &&
              got == word;
        if (q == next) next_cal = block;
    }
    if (rc == FSDP_OK && can && mode < 0) {
        /* A rank that could not allocate its block, or whose peer could not, keeps the slots. */
        can =
            cal && next_cal &&
            cma_price((pid_t)s->pid[next], next_cal, cal, &s->cal_read_ns, &s->cal_copy_ns) == 0 &&
            cma_pays(s->cal_read_ns, s->cal_copy_ns);
    }
    if (rc == FSDP_OK) rc = put_mine(store, "shm.cma", rank, can ? "1" : "0");
    int every = can;
    for (int q = 0; q < size && rc == FSDP_OK; q++) {
        rc = get_theirs(store, "shm.cma", q, theirs, sizeof theirs);
        if (rc == FSDP_OK && strcmp(theirs, "1") != 0) every = 0;
    }
    free(cal);
    if (rc < 0) {
        fsdp__gloo_shm_unmap(s);
        return store_fail(store, rc, msg, cap);
    }
    int cpus;
    s->spin = spin_iters(size, &cpus);
    char waits[96];
    snprintf(waits, sizeof waits, "; %d ranks on %d CPUs: a barrier's waiters %s", size, cpus,
             s->spin ? "spin, then sleep" : "sleep at once");
    const char *how = every ? "peers' buffers read in place" : "through the slots";
    if (mode == 0)
        snprintf(msg, cap, "%s (FSDP_GLOO_CMA=0)%s", how, waits);
    else if (s->cal_read_ns > 0)
        snprintf(msg, cap,
                 "%s (this rank read 4 MiB of rank %d in %.2f ms of processor time, copied "
                 "4 MiB in %.2f ms)%s",
                 how, next, (double)s->cal_read_ns / 1e6, (double)s->cal_copy_ns / 1e6, waits);
    else
        snprintf(msg, cap, "%s%s", how, waits);
    s->cma = every;
    *out = s;
    return FSDP_OK;
}

int fsdp__gloo_shm_cma(const fsdp_gloo_shm_t *s) {
    return s && s->cma;
}

int fsdp__gloo_shm_spin(const fsdp_gloo_shm_t *s) {
    return s ? s->spin : -1;
}

int fsdp__gloo_shm_cma_price(const fsdp_gloo_shm_t *s, int64_t *read_ns, int64_t *copy_ns) {
    *read_ns = s ? s->cal_read_ns : 0;
    *copy_ns = s ? s->cal_copy_ns : 0;
    return s && s->cal_read_ns > 0 ? cma_pays(s->cal_read_ns, s->cal_copy_ns) : -1;
}
