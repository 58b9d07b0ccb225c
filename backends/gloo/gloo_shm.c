/* SPDX-License-Identifier: MIT */
/*
 * gloo_shm.c: the shared-memory transport of the gloo process group (see gloo_shm.h).
 *
 * The segment: a header (the barrier's generation and arrival count, the closed mark), every
 * rank's process id and send address, then `size` slots of `slot` bytes and one result area
 * of `slot` bytes.
 * Rank 0 creates it under a unique name, the others open it, and rank 0 unlinks the name once
 * every rank has mapped it, so nothing is left in /dev/shm whatever happens later.
 *
 * Every collective runs in chunks that fit the slots. A chunk is: each rank copies its part into
 * its own slot; a barrier; each rank reads what it needs (and, for reductions, reduces its share
 * of the chunk in rank order); a barrier before the slots are written again. All-reduce adds a
 * third step: the shares are reduced into the result area, a barrier, then every rank copies the
 * whole chunk out.
 *
 * With cross-memory attach (decided at creation: every rank could read a word of each peer's
 * memory with process_vm_readv and, unless FSDP_GLOO_CMA=1 asks for it, found that reading a
 * peer costs it less than the slots would; see "Whether reading in place pays" below),
 * all-gather and reduce-scatter skip the slots: each rank
 * publishes its send buffer's address, and after a barrier every rank has the kernel copy what
 * it needs from its peers' buffers (an all-gather's blocks straight into recv; a reduce-scatter's
 * segments a block at a time into its own slot, reduced with its own part in rank order); a
 * second barrier keeps the send buffers until every rank has read them.
 *
 * Whether reading in place pays. Through the slots, a block of an all-gather costs its owner
 * one local copy into its slot (and one into its own recv) and every other rank one copy out;
 * in place, the owner copies into its own recv and every other rank has the kernel read it.
 * At two ranks the slots cost three copies a block and reading in place one copy and one read,
 * so the read pays while it costs less than two copies; at more ranks the bar falls towards
 * one. The kernel's price varies by machine: it pins every page it reads, and on a virtual
 * machine that walks the guest's page tables, a read of 4 MiB measured 4.5 times a local copy
 * (docs/design.md). So, unless FSDP_GLOO_CMA is 0 or 1, each rank prices it at creation, in
 * processor time: a read of 4 MiB of its next peer's memory against a local copy of 4 MiB, the
 * best of three after a warm-up, and votes for reading in place only when the read costs less
 * than one and a half copies (the bar for two ranks, less what a reduce-scatter's cache-hot
 * reduction gains). The choice changes no bits: the same values are reduced in the same order.
 *
 * The barrier is a generation count in shared memory: the last rank to arrive resets the count,
 * advances the generation and wakes the others with a futex (not private: the waiters are other
 * processes). A waiter spins briefly, then sleeps on the futex in slices of at most 50 ms, and
 * between slices checks the group's closed mark, its peers' processes (kill(pid, 0)) and the
 * collective's deadline.
 */
#define _GNU_SOURCE

#include <errno.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include <fsdp/errno.h>

#include "backends/gloo/gloo_shm.h"
#include "core/copy.h"
#include "core/reduce.h"
#include "core/timeutil.h"

#define SHM_MAGIC 0x46534d32u /* "FSM2" */
/* Bytes of a peer's segment a reduce-scatter reads at a time with cross-memory attach: small
 * enough that the copies stay in this core's cache until they are reduced. */
#define CMA_BLOCK ((size_t)256 << 10)
/* The block a rank reads from its next peer and copies locally to price cross-memory attach,
 * and how many times (the first of each warms the pages and is not counted). */
#define CAL_BYTES ((size_t)4 << 20)
#define CAL_REPS 4
#define SPIN_ITERS 4000
#define SLICE_NS 50000000LL /* longest futex sleep between liveness checks */

struct shm_hdr {
    uint32_t magic, size;
    uint64_t slot;
    _Alignas(64) _Atomic uint32_t gen;
    _Alignas(64) _Atomic uint32_t count;
    _Alignas(64) _Atomic uint32_t closed; /* 1 + the rank that closed the group; 0 while open */
};

struct fsdp_gloo_shm {
    int rank, size;
    size_t slot;  /* bytes per slot */
    size_t bytes; /* of the mapping */
    struct shm_hdr *h;
    int32_t *pid;   /* [size] */
    uint64_t *addr; /* [size]: each rank's send buffer of the collective in progress (CMA) */
    char *slots;    /* size * slot */
    char *result;   /* slot */
    int cma;        /* peers' send buffers are read in place (process_vm_readv) */
    uint64_t probe; /* what a peer's probe reads from this rank's memory */
    /* Processor time this rank took to read CAL_BYTES from its next peer in place and to copy
     * them locally, best of CAL_REPS - 1 (ns); 0 when not measured. */
    int64_t cal_read_ns, cal_copy_ns;
};

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

/* Reads bytes from address `from` of process pid into dst (process_vm_readv, in as many calls
 * as the kernel needs). Returns 0, or -1 with errno. */
static int cma_read(pid_t pid, void *dst, uint64_t from, size_t bytes) {
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
        if (cma_read(pid, buf, from, CAL_BYTES) != 0) return -1;
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

static void unmap(fsdp_gloo_shm_t *s) {
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

int fsdp__gloo_shm_create(fsdp_store_t *store, int rank, int size, fsdp_gloo_shm_t **out,
                          char *msg, size_t cap) {
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
            unmap(s);
            return store_fail(store, rc, msg, cap);
        }
    } else {
        size_t len = 0;
        if ((rc = fsdp_store_get(store, "shm.name", name, sizeof name - 1, &len)) < 0) {
            unmap(s);
            return store_fail(store, rc, msg, cap);
        }
        name[len < sizeof name - 1 ? len : sizeof name - 1] = 0;
        ok = name[0] && map_segment(s, name, 0, why, sizeof why) == 0;
        if (!name[0]) snprintf(why, sizeof why, "rank 0 could not create the segment");
    }
    /* 3. Every rank says whether it mapped it; rank 0 then unlinks the name. */
    if ((rc = put_mine(store, "shm.ok", rank, ok ? "1" : "0")) < 0) {
        if (rank == 0 && ok) shm_unlink(name);
        unmap(s);
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
        unmap(s);
        return store_fail(store, rc, msg, cap);
    }
    if (!all) {
        snprintf(msg, cap, "%s", why);
        unmap(s);
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
    if (can && mode < 0 && (cal = malloc(2 * CAL_BYTES)) != NULL)
        memset(cal, 0x5a, 2 * CAL_BYTES);
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
              cma_read((pid_t)s->pid[q], &got, where, sizeof got) == 0 && got == word;
        if (q == next) next_cal = block;
    }
    if (rc == FSDP_OK && can && mode < 0) {
        /* A rank that could not allocate its block, or whose peer could not, keeps the slots. */
        can = cal && next_cal &&
              cma_price((pid_t)s->pid[next], next_cal, cal, &s->cal_read_ns, &s->cal_copy_ns) ==
                  0 &&
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
        unmap(s);
        return store_fail(store, rc, msg, cap);
    }
    const char *how = every ? "peers' buffers read in place" : "through the slots";
    if (mode == 0)
        snprintf(msg, cap, "%s (FSDP_GLOO_CMA=0)", how);
    else if (s->cal_read_ns > 0)
        snprintf(msg, cap,
                 "%s (this rank read 4 MiB of rank %d in %.2f ms of processor time, copied "
                 "4 MiB in %.2f ms)",
                 how, next, (double)s->cal_read_ns / 1e6, (double)s->cal_copy_ns / 1e6);
    else
        snprintf(msg, cap, "%s", how);
    s->cma = every;
    *out = s;
    return FSDP_OK;
}

/* ---- the barrier --------------------------------------------------------------------------- */

static void futex_wait(_Atomic uint32_t *addr, uint32_t val, int64_t ns) {
    struct timespec ts = {.tv_sec = (time_t)(ns / 1000000000), .tv_nsec = (long)(ns % 1000000000)};
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAIT, val, &ts, NULL, 0);
}

static void futex_wake_all(_Atomic uint32_t *addr) {
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAKE, 0x7fffffff, NULL, NULL, 0);
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* Whether process p has ended: gone, or a zombie its parent has not reaped yet. */
static int gone(pid_t p) {
    if (kill(p, 0) != 0) return errno == ESRCH;
    char path[64], buf[256];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)p);
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    const char *paren = strrchr(buf, ')'); /* the state follows the command name */
    return paren && paren[1] == ' ' && (paren[2] == 'Z' || paren[2] == 'X');
}

/* Why a barrier cannot complete, or FSDP_OK: the group closed, a peer's process gone. */
static int broken(fsdp_gloo_shm_t *s, int *peer, char *msg, size_t cap) {
    /* An ended process first: a rank that saw it end closes the group too, and the process is
     * the cause to name. */
    for (int q = 0; q < s->size; q++) {
        if (q == s->rank || s->pid[q] <= 0) continue;
        if (s->pid[q] != (int32_t)getpid() && gone((pid_t)s->pid[q])) {
            *peer = q;
            snprintf(msg, cap, "rank %d's process (pid %d) has exited", q, (int)s->pid[q]);
            return FSDP_EREMOTE;
        }
    }
    uint32_t c = atomic_load_explicit(&s->h->closed, memory_order_acquire);
    if (c) {
        *peer = (int)c - 1;
        snprintf(msg, cap, "rank %d closed the group's shared memory", (int)c - 1);
        return FSDP_EREMOTE;
    }
    return FSDP_OK;
}

static int barrier(fsdp_gloo_shm_t *s, int64_t deadline, int64_t timeout_ms, int *peer,
                   char *msg, size_t cap) {
    struct shm_hdr *h = s->h;
    const uint32_t g = atomic_load_explicit(&h->gen, memory_order_acquire);
    if (atomic_fetch_add_explicit(&h->count, 1, memory_order_acq_rel) == (uint32_t)s->size - 1) {
        atomic_store_explicit(&h->count, 0, memory_order_relaxed);
        atomic_fetch_add_explicit(&h->gen, 1, memory_order_release);
        futex_wake_all(&h->gen);
        return FSDP_OK;
    }
    for (int i = 0; i < SPIN_ITERS; i++) {
        if (atomic_load_explicit(&h->gen, memory_order_acquire) != g) return FSDP_OK;
        cpu_relax();
    }
    for (;;) {
        if (atomic_load_explicit(&h->gen, memory_order_acquire) != g) return FSDP_OK;
        int rc = broken(s, peer, msg, cap);
        /* A peer may complete the barrier, then close the group or exit at once: its mark comes
         * after the generation it advanced, so look again before blaming it. */
        if (rc < 0) return atomic_load_explicit(&h->gen, memory_order_acquire) != g ? FSDP_OK : rc;
        int64_t left = deadline - fsdp__now_ns();
        if (left <= 0) {
            snprintf(msg, cap, "timed out after %lld ms waiting for the other ranks at a barrier "
                               "of the shared-memory transport",
                     (long long)timeout_ms);
            return FSDP_ETIMEDOUT;
        }
        futex_wait(&h->gen, g, left < SLICE_NS ? left : SLICE_NS);
    }
}

/* ---- collectives --------------------------------------------------------------------------- */

typedef struct run {
    fsdp_gloo_shm_t *s;
    int64_t deadline, timeout_ms;
    int *peer;
    char *msg;
    size_t cap;
} run_t;

#define SYNC(r)                                                                                    \
    do {                                                                                           \
        int src_ = barrier((r)->s, (r)->deadline, (r)->timeout_ms, (r)->peer, (r)->msg,            \
                           (r)->cap);                                                              \
        if (src_ < 0) return src_;                                                                 \
    } while (0)

static char *slot_of(fsdp_gloo_shm_t *s, int q) {
    return s->slots + (size_t)q * s->slot;
}

/* One input pointer per rank for a reduction: on the stack up to MAX_INS ranks. */
enum { MAX_INS = 64 };
struct ins {
    const void *small[MAX_INS];
    const void **p;
};

static int ins_init(run_t *r, struct ins *in) {
    const size_t n = (size_t)r->s->size;
    in->p = n <= MAX_INS ? in->small : malloc(n * sizeof *in->p);
    if (in->p) return FSDP_OK;
    snprintf(r->msg, r->cap, "out of memory");
    return FSDP_ENOMEM;
}

static void ins_fini(struct ins *in) {
    if (in->p != in->small) free(in->p);
}

/* Reduces n elements of every rank's input in rank order (in->p[q]) into the nout outputs. */
static int reduce_ins(run_t *r, const fsdp_gloo_op_t *op, const struct ins *in, size_t n,
                      void *const *outs, int nout) {
    int size = r->s->size;
    int rc = fsdp__reduce(outs, nout, in->p, size, n, op->dtype, op->op, size, op->prescale);
    if (rc < 0) snprintf(r->msg, r->cap, "out of memory reducing");
    return rc;
}

/* Reduces element range [e, e + n) of chunk `base` (an element offset into each slot) over
 * every slot, in rank order, into the nout outputs; the rank's own input is `own` (its send
 * buffer, which it did not copy into its slot). */
static int reduce_slots(run_t *r, const fsdp_gloo_op_t *op, size_t es, size_t base, size_t n,
                        const void *own, void *const *outs, int nout) {
    fsdp_gloo_shm_t *s = r->s;
    struct ins in;
    int rc = ins_init(r, &in);
    if (rc < 0) return rc;
    for (int q = 0; q < s->size; q++)
        in.p[q] = q == s->rank ? own : slot_of(s, q) + base * es;
    rc = reduce_ins(r, op, &in, n, outs, nout);
    ins_fini(&in);
    return rc;
}

/* A failed read of peer q's memory: the peer's end names it, anything else is the kernel's. */
static int cma_fail(run_t *r, int q, const char *what) {
    int e = errno;
    int rc = broken(r->s, r->peer, r->msg, r->cap);
    if (rc < 0) return rc;
    *r->peer = q;
    snprintf(r->msg, r->cap, "%s: reading rank %d's buffer (process_vm_readv): %s", what, q,
             strerror(e));
    return e == ESRCH ? FSDP_EREMOTE : FSDP_EBACKEND;
}

/* With cross-memory attach: each rank publishes its send buffer; after a barrier every rank
 * reads each peer's block straight into recv (one copy, by the kernel, instead of one into the
 * slot and one out of it), and a second barrier keeps the send buffers until all have read. */
static int all_gather_cma(run_t *r, const fsdp_gloo_op_t *op, size_t es) {
    fsdp_gloo_shm_t *s = r->s;
    const size_t bytes = op->count * es;
    char *recv = op->recv;
    s->addr[s->rank] = (uint64_t)(uintptr_t)op->send;
    SYNC(r);
    for (int q = 0; q < s->size; q++) {
        char *dst = recv + (size_t)q * bytes;
        if (q == s->rank)
            fsdp__copy_large(dst, op->send, bytes);
        else if (cma_read((pid_t)s->pid[q], dst, s->addr[q], bytes) != 0)
            return cma_fail(r, q, "all_gather");
    }
    SYNC(r);
    return FSDP_OK;
}

static int all_gather(run_t *r, const fsdp_gloo_op_t *op, size_t es) {
    fsdp_gloo_shm_t *s = r->s;
    const size_t bytes = op->count * es;
    const char *send = op->send;
    char *recv = op->recv;
    if (s->cma) return all_gather_cma(r, op, es);
    for (size_t off = 0; off < bytes; off += s->slot) {
        const size_t len = bytes - off < s->slot ? bytes - off : s->slot;
        /* This rank's block goes into its slot and, unless in place, its recv in one pass. */
        char *own = recv + (size_t)s->rank * bytes + off;
        if (own != send + off)
            fsdp__copy_large2(slot_of(s, s->rank), own, send + off, len);
        else
            fsdp__copy_large(slot_of(s, s->rank), send + off, len);
        SYNC(r);
        for (int q = 0; q < s->size; q++)
            if (q != s->rank)
                fsdp__copy_large(recv + (size_t)q * bytes + off, slot_of(s, q), len);
        SYNC(r);
    }
    return FSDP_OK;
}

static int broadcast(run_t *r, const fsdp_gloo_op_t *op, size_t es) {
    fsdp_gloo_shm_t *s = r->s;
    const size_t bytes = op->count * es;
    for (size_t off = 0; off < bytes; off += s->slot) {
        const size_t len = bytes - off < s->slot ? bytes - off : s->slot;
        if (s->rank == op->root)
            fsdp__copy_large(slot_of(s, op->root), (const char *)op->send + off, len);
        SYNC(r);
        if (s->rank != op->root || op->send != op->recv)
            fsdp__copy_large((char *)op->recv + off, slot_of(s, op->root), len);
        SYNC(r);
    }
    return FSDP_OK;
}

/* send: size blocks of count elements; block q goes to rank q; recv block q comes from q. */
static int all_to_all(run_t *r, const fsdp_gloo_op_t *op, size_t es) {
    fsdp_gloo_shm_t *s = r->s;
    const size_t n = (size_t)s->size, bytes = op->count * es;
    const size_t part = s->slot / n / es * es; /* bytes of each block per chunk */
    for (size_t off = 0; off < bytes; off += part) {
        const size_t len = bytes - off < part ? bytes - off : part;
        for (size_t q = 0; q < n; q++)
            fsdp__copy_large(slot_of(s, s->rank) + q * part,
                             (const char *)op->send + q * bytes + off, len);
        SYNC(r);
        for (size_t q = 0; q < n; q++)
            fsdp__copy_large((char *)op->recv + q * bytes + off,
                             slot_of(s, (int)q) + (size_t)s->rank * part, len);
        SYNC(r);
    }
    return FSDP_OK;
}

/* With cross-memory attach: each rank publishes its send buffer; every rank reads its own
 * segment of each peer's, a block at a time, into its own slot (which no peer reads in this
 * mode) and reduces it with its own in rank order. The peers copy nothing for it. */
static int reduce_scatter_cma(run_t *r, const fsdp_gloo_op_t *op, size_t es) {
    fsdp_gloo_shm_t *s = r->s;
    const size_t n = (size_t)s->size, me = (size_t)s->rank;
    size_t per = (s->slot / n < CMA_BLOCK ? s->slot / n : CMA_BLOCK) / es;
    if (per == 0) per = 1;
    struct ins in;
    int rc = ins_init(r, &in);
    if (rc < 0) return rc;
    s->addr[me] = (uint64_t)(uintptr_t)op->send;
    rc = barrier(s, r->deadline, r->timeout_ms, r->peer, r->msg, r->cap);
    for (size_t e = 0; e < op->count && rc == FSDP_OK; e += per) {
        const size_t m = op->count - e < per ? op->count - e : per;
        const size_t at = (me * op->count + e) * es; /* this rank's segment, chunk e */
        for (size_t q = 0; q < n && rc == FSDP_OK; q++) {
            char *tmp = slot_of(s, s->rank) + q * per * es;
            in.p[q] = q == me ? (const void *)((const char *)op->send + at) : tmp;
            if (q != me && cma_read((pid_t)s->pid[q], tmp, s->addr[q] + at, m * es) != 0)
                rc = cma_fail(r, (int)q, "reduce_scatter");
        }
        void *outs[1] = {(char *)op->recv + e * es};
        if (rc == FSDP_OK) rc = reduce_ins(r, op, &in, m, outs, 1);
    }
    ins_fini(&in);
    if (rc < 0) return rc;
    SYNC(r);
    return FSDP_OK;
}

/* send: size segments of count elements; rank q's result is segment q reduced over the ranks.
 * A rank copies into its slot only the segments the others reduce, and reads its own from its
 * send buffer: 1/size less copying, the same inputs in the same order. */
static int reduce_scatter(run_t *r, const fsdp_gloo_op_t *op, size_t es) {
    fsdp_gloo_shm_t *s = r->s;
    const size_t n = (size_t)s->size, per = s->slot / n / es; /* elements of a segment a chunk */
    const size_t me = (size_t)s->rank;
    if (s->cma) return reduce_scatter_cma(r, op, es);
    for (size_t e = 0; e < op->count; e += per) {
        const size_t m = op->count - e < per ? op->count - e : per;
        for (size_t q = 0; q < n; q++)
            if (q != me)
                fsdp__copy_large(slot_of(s, s->rank) + q * per * es,
                                 (const char *)op->send + (q * op->count + e) * es, m * es);
        SYNC(r);
        void *outs[1] = {(char *)op->recv + e * es};
        int rc = reduce_slots(r, op, es, me * per, m,
                              (const char *)op->send + (me * op->count + e) * es, outs, 1);
        if (rc < 0) return rc;
        SYNC(r);
    }
    return FSDP_OK;
}

/* All-reduce (root < 0) or reduce to root: chunks of a slot; each rank reduces its share of the
 * chunk into the result area, then every rank (or the root) copies the chunk out. A rank's own
 * share is read from its send buffer (it copies only the rest into its slot) and, when the rank
 * keeps the result, written into recv as well as the result area. */
static int reduce_all(run_t *r, const fsdp_gloo_op_t *op, size_t es, int root) {
    fsdp_gloo_shm_t *s = r->s;
    const size_t n = (size_t)s->size, chunk = s->slot / es;
    const bool keep = root < 0 || s->rank == root;
    for (size_t e = 0; e < op->count; e += chunk) {
        const size_t m = op->count - e < chunk ? op->count - e : chunk;
        /* Rank q's share of the m elements: [q m / n, (q + 1) m / n). */
        const size_t lo = (size_t)s->rank * m / n, hi = ((size_t)s->rank + 1) * m / n;
        const char *send = (const char *)op->send + e * es;
        /* A non-root's recv of reduce may be NULL: no pointer is made from it. */
        char *recv = keep ? (char *)op->recv + e * es : NULL;
        fsdp__copy_large(slot_of(s, s->rank), send, lo * es);
        fsdp__copy_large(slot_of(s, s->rank) + hi * es, send + hi * es, (m - hi) * es);
        SYNC(r);
        if (hi > lo) {
            void *outs[2] = {s->result + lo * es, keep ? recv + lo * es : NULL};
            int rc = reduce_slots(r, op, es, lo, hi - lo, send + lo * es, outs, keep ? 2 : 1);
            if (rc < 0) return rc;
        }
        SYNC(r);
        if (keep) {
            fsdp__copy_large(recv, s->result, lo * es);
            fsdp__copy_large(recv + hi * es, s->result + hi * es, (m - hi) * es);
        }
        SYNC(r);
    }
    return FSDP_OK;
}

int fsdp__gloo_shm_cma(const fsdp_gloo_shm_t *s) {
    return s && s->cma;
}

int fsdp__gloo_shm_cma_price(const fsdp_gloo_shm_t *s, int64_t *read_ns, int64_t *copy_ns) {
    *read_ns = s ? s->cal_read_ns : 0;
    *copy_ns = s ? s->cal_copy_ns : 0;
    return s && s->cal_read_ns > 0 ? cma_pays(s->cal_read_ns, s->cal_copy_ns) : -1;
}

int fsdp__gloo_shm_run(fsdp_gloo_shm_t *s, const fsdp_gloo_op_t *op, int *peer, char *msg,
                       size_t cap) {
    run_t r = {s, fsdp__now_ns() + op->timeout_ms * 1000000LL, op->timeout_ms, peer, msg, cap};
    const size_t es = fsdp_dtype_size(op->dtype);
    *peer = -1;
    switch (op->kind) {
    case FSDP_COLL_BARRIER:
        SYNC(&r);
        return FSDP_OK;
    case FSDP_COLL_ALL_GATHER:
        return all_gather(&r, op, es);
    case FSDP_COLL_BROADCAST:
        return broadcast(&r, op, es);
    case FSDP_COLL_ALL_TO_ALL:
        return all_to_all(&r, op, es);
    case FSDP_COLL_REDUCE_SCATTER:
        return reduce_scatter(&r, op, es);
    case FSDP_COLL_ALL_REDUCE:
        return reduce_all(&r, op, es, -1);
    case FSDP_COLL_REDUCE:
        return reduce_all(&r, op, es, op->root);
    default:
        snprintf(msg, cap, "collective kind %d is not supported", (int)op->kind);
        return FSDP_EBACKEND;
    }
}

void fsdp__gloo_shm_close(fsdp_gloo_shm_t *s) {
    uint32_t none = 0;
    if (s) atomic_compare_exchange_strong(&s->h->closed, &none, (uint32_t)s->rank + 1);
}

void fsdp__gloo_shm_destroy(fsdp_gloo_shm_t *s) {
    if (!s) return;
    /* Peers still waiting on this rank (it left a collective early) fail at once; after a
     * clean end nobody waits, and the mark is never read again. */
    fsdp__gloo_shm_close(s);
    futex_wake_all(&s->h->gen);
    unmap(s);
}
