/* SPDX-License-Identifier: MIT */
/*
 * store_redis.c: the Redis store, for ranks that are processes on any hosts that reach one Redis
 * server. Built on hiredis; without it fsdp_store_create_redis() still exists and returns
 * FSDP_ENOTSUP, so the exported symbols do not depend on configure.
 *
 * Commands: SET for set, GET for get (polled, 1 ms doubling to 50 ms, until the handle's timeout),
 * INCRBY for add (atomic on the server; the value is decimal text, as in the other stores),
 * EXISTS for check. Keys are "<prefix>/<key>", or the bare key without a prefix. A URL's password
 * and database (fsdp_store_open_url) become AUTH and SELECT on every new connection; a refusal
 * is not retried. The password is never written into a message: the server's own replies pass
 * through scrub() first, and "where" is host:port only.
 *
 * Invariants:
 * - The shared data holds one connection, guarded by `mu`: only one command is on the wire at a
 *   time. The mutex is never held while sleeping between polls, so a rank waiting for a key does
 *   not keep the rank that will set it off the connection.
 * - The connection is made by the first command, not by the constructor, and again after a
 *   failure. Refused connections are retried until the operation's deadline, so ranks may start
 *   before the server. Every connect attempt and every command has a socket timeout no longer
 *   than the time left, so nothing blocks past the handle's timeout (a connect attempt is also
 *   capped at 1 s, which bounds how long other threads wait for the mutex).
 * - A command that failed on the wire is not resent: INCRBY may have been applied. The
 *   connection is dropped and the error returned.
 * - hiredis writes with write(2), which raises SIGPIPE on a connection the server closed. Each
 *   command runs with SIGPIPE blocked in the calling thread, and a SIGPIPE it raised is discarded,
 *   so a dead server is an error code and not the death of the process.
 */
#include <config.h>

#include <errno.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>
#include <time.h>

#include "core/timeutil.h"
#include "store/store_impl.h"

#if FSDP_HAVE_HIREDIS

#include <hiredis/hiredis.h>

#define HOST_CAP 256
#define PREFIX_CAP 256
/* Longest single connect attempt, in ms. */
#define CONNECT_SLICE_MS 1000

typedef struct redis_store {
    pthread_mutex_t mu; /* guards refs and c */
    int refs;
    redisContext *c; /* NULL until connected and after a failure */
    int port;
    char host[HOST_CAP];
    char prefix[PREFIX_CAP];
    char where[HOST_CAP + 16]; /* "host:port", for messages */
    char user[256];            /* AUTH user, "" for the password alone */
    char password[256];        /* AUTH password, "" for no AUTH; never in a message */
    int db;                    /* SELECT db when > 0 */
} redis_store_t;

/* Blocks SIGPIPE in this thread; pipe_restore() discards one that arrived meanwhile. */
typedef struct pipe_guard {
    sigset_t old;
    int was_pending;
} pipe_guard_t;

static void pipe_block(pipe_guard_t *g) {
    sigset_t set, pending;
    sigemptyset(&set);
    sigaddset(&set, SIGPIPE);
    sigemptyset(&pending);
    sigpending(&pending);
    g->was_pending = sigismember(&pending, SIGPIPE) == 1;
    pthread_sigmask(SIG_BLOCK, &set, &g->old);
}

static void pipe_restore(pipe_guard_t *g) {
    sigset_t set, pending;
    sigemptyset(&set);
    sigaddset(&set, SIGPIPE);
    sigemptyset(&pending);
    sigpending(&pending);
    if (!g->was_pending && sigismember(&pending, SIGPIPE) == 1) {
        struct timespec zero = {0, 0};
        sigtimedwait(&set, NULL, &zero);
    }
    pthread_sigmask(SIG_SETMASK, &g->old, NULL);
}

static struct timeval tv_of_ms(int64_t ms) {
    if (ms < 1) ms = 1;
    struct timeval tv = {(time_t)(ms / 1000), (suseconds_t)(ms % 1000) * 1000};
    return tv;
}

static int64_t ms_left(int64_t deadline_ns) {
    int64_t ns = deadline_ns - fsdp__now_ns();
    return ns <= 0 ? 0 : (ns + 999999) / 1000000;
}

/* Replaces every occurrence of the password in a server's message by "***". */
static void scrub(const redis_store_t *r, const char *msg, char *out, size_t cap) {
    size_t pl = strlen(r->password), o = 0;
    while (*msg && o + 1 < cap) {
        if (pl && strncmp(msg, r->password, pl) == 0) {
            o += (size_t)snprintf(out + o, cap - o, "***");
            if (o >= cap) o = cap - 1;
            msg += pl;
        } else {
            out[o++] = *msg++;
        }
    }
    out[o] = 0;
}

/* Sends AUTH and SELECT on a new connection; 0, or -1 with why set (the server refused). */
static int hello_locked(redis_store_t *r, redisContext *c, char *why, size_t cap) {
    for (int step = 0; step < 2; step++) {
        char dbs[16];
        const char *argv[3];
        size_t argvlen[3];
        int argc = 0;
        if (step == 0 && r->password[0]) {
            argv[argc++] = "AUTH";
            if (r->user[0]) argv[argc++] = r->user;
            argv[argc++] = r->password;
        } else if (step == 1 && r->db > 0) {
            snprintf(dbs, sizeof dbs, "%d", r->db);
            argv[argc++] = "SELECT";
            argv[argc++] = dbs;
        } else {
            continue;
        }
        for (int i = 0; i < argc; i++)
            argvlen[i] = strlen(argv[i]);
        redisReply *rep = redisCommandArgv(c, argc, argv, argvlen);
        char said[256];
        if (!rep) {
            scrub(r, c->errstr[0] ? c->errstr : "connection lost", said, sizeof said);
            snprintf(why, cap, "%s: %s", step ? "SELECT" : "AUTH", said);
            return -1;
        }
        int ok = rep->type == REDIS_REPLY_STATUS;
        if (!ok) {
            scrub(r, rep->type == REDIS_REPLY_ERROR ? rep->str : "an unexpected reply", said,
                  sizeof said);
            if (step == 0)
                snprintf(why, cap, "the server refused AUTH%s%s: %s", r->user[0] ? " as user " : "",
                         r->user, said);
            else
                snprintf(why, cap, "the server refused SELECT %d: %s", r->db, said);
        }
        freeReplyObject(rep);
        if (!ok) return -1;
    }
    return 0;
}

/* Makes the connection; the caller holds r->mu. On failure `why` says what went wrong; -1 when
 * retrying cannot help (the server refused AUTH or SELECT). */
static int connect_locked(redis_store_t *r, int64_t deadline_ns, char *why, size_t cap) {
    int64_t ms = ms_left(deadline_ns);
    if (ms > CONNECT_SLICE_MS) ms = CONNECT_SLICE_MS;
    redisContext *c = redisConnectWithTimeout(r->host, r->port, tv_of_ms(ms));
    if (!c) {
        snprintf(why, cap, "out of memory");
        return 0;
    }
    if (c->err) {
        snprintf(why, cap, "%s", c->errstr);
        redisFree(c);
        return 0;
    }
    if (r->password[0] || r->db > 0) {
        redisSetTimeout(c, tv_of_ms(ms_left(deadline_ns)));
        pipe_guard_t g;
        pipe_block(&g);
        int rc = hello_locked(r, c, why, cap);
        pipe_restore(&g);
        if (rc < 0) {
            redisFree(c);
            return -1;
        }
    }
    r->c = c;
    return 0;
}

/*
 * Runs one command, connecting first if needed (refused connections are retried until the
 * deadline). On FSDP_OK *reply is the server's reply (possibly an error reply), for the caller
 * to free.
 */
static int command(redis_store_t *r, int argc, const char **argv, const size_t *argvlen,
                   int64_t deadline_ns, int64_t timeout_ms, const char *op, const char *key,
                   redisReply **reply, char *err) {
    char why[768] = "";
    int64_t nap = 0;
    for (;;) {
        pthread_mutex_lock(&r->mu);
        if (!r->c && connect_locked(r, deadline_ns, why, sizeof why) < 0) {
            pthread_mutex_unlock(&r->mu);
            return fsdp__err(err, FSDP_EBACKEND, "redis store %s: %s '%s': %s", r->where, op, key,
                             why);
        }
        if (r->c) {
            redisSetTimeout(r->c, tv_of_ms(ms_left(deadline_ns)));
            pipe_guard_t g;
            pipe_block(&g);
            *reply = redisCommandArgv(r->c, argc, argv, argvlen);
            pipe_restore(&g);
            if (*reply) {
                pthread_mutex_unlock(&r->mu);
                return FSDP_OK;
            }
            snprintf(why, sizeof why, "%s", r->c->errstr[0] ? r->c->errstr : "connection lost");
            redisFree(r->c);
            r->c = NULL;
            pthread_mutex_unlock(&r->mu);
            int late = fsdp__now_ns() >= deadline_ns;
            return fsdp__err(err, late ? FSDP_ETIMEDOUT : FSDP_EBACKEND,
                             "redis store %s: %s '%s': %s%s", r->where, op, key, why,
                             late ? " (the handle's timeout ran out)" : "");
        }
        pthread_mutex_unlock(&r->mu);
        if (fsdp__now_ns() >= deadline_ns)
            return fsdp__err(err, FSDP_ETIMEDOUT,
                             "redis store %s: %s '%s': cannot connect to Redis at %s within %lld "
                             "ms: %s",
                             r->where, op, key, r->where, (long long)timeout_ms, why);
        nap = fsdp__store_backoff_ms(nap);
        int64_t ms = ms_left(deadline_ns);
        fsdp__sleep_ms(nap < ms ? nap : ms);
    }
}

/* The Redis key of a store key (prefix/key). */
static int redis_key(const redis_store_t *r, const char *key, char *buf, size_t cap, char *err) {
    int n =
        r->prefix[0] ? snprintf(buf, cap, "%s/%s", r->prefix, key) : snprintf(buf, cap, "%s", key);
    if (n < 0 || (size_t)n >= cap)
        return fsdp__err(err, FSDP_EINVAL, "redis store %s: key '%.64s...' is too long", r->where,
                         key);
    return FSDP_OK;
}

#define RKEY_CAP (PREFIX_CAP + 1 + 512)

/* Turns an unexpected reply into an error. */
static int bad_reply(const redis_store_t *r, const redisReply *rep, const char *op, const char *key,
                     char *err) {
    if (rep->type == REDIS_REPLY_ERROR)
        return fsdp__err(err, FSDP_EBACKEND, "redis store %s: %s '%s': the server said: %s",
                         r->where, op, key, rep->str);
    return fsdp__err(err, FSDP_EBACKEND, "redis store %s: %s '%s': unexpected reply type %d",
                     r->where, op, key, rep->type);
}

static int redis_set(void *data, const char *key, const void *value, size_t len, int64_t timeout_ms,
                     char *err) {
    redis_store_t *r = data;
    char rkey[RKEY_CAP];
    int rc = redis_key(r, key, rkey, sizeof rkey, err);
    if (rc < 0) return rc;
    const char *argv[3] = {"SET", rkey, len ? (const char *)value : ""};
    size_t argvlen[3] = {3, strlen(rkey), len};
    redisReply *rep;
    rc = command(r, 3, argv, argvlen, fsdp__store_deadline_ns(timeout_ms), timeout_ms, "set", key,
                 &rep, err);
    if (rc < 0) return rc;
    if (rep->type != REDIS_REPLY_STATUS) rc = bad_reply(r, rep, "set", key, err);
    freeReplyObject(rep);
    return rc;
}

static int redis_get(void *data, const char *key, void *buf, size_t cap, size_t *len,
                     int64_t timeout_ms, char *err) {
    redis_store_t *r = data;
    char rkey[RKEY_CAP];
    int rc = redis_key(r, key, rkey, sizeof rkey, err);
    if (rc < 0) return rc;
    const char *argv[2] = {"GET", rkey};
    size_t argvlen[2] = {3, strlen(rkey)};
    int64_t deadline = fsdp__store_deadline_ns(timeout_ms), nap = 0;
    for (;;) {
        redisReply *rep;
        rc = command(r, 2, argv, argvlen, deadline, timeout_ms, "get", key, &rep, err);
        if (rc < 0) return rc;
        if (rep->type == REDIS_REPLY_STRING) {
            *len = rep->len;
            if (buf && cap) memcpy(buf, rep->str, rep->len < cap ? rep->len : cap);
            freeReplyObject(rep);
            return FSDP_OK;
        }
        if (rep->type != REDIS_REPLY_NIL) {
            rc = bad_reply(r, rep, "get", key, err);
            freeReplyObject(rep);
            return rc;
        }
        freeReplyObject(rep);
        if (fsdp__now_ns() >= deadline)
            return fsdp__err(err, FSDP_ETIMEDOUT,
                             "redis store %s: key '%s' did not appear within %lld ms", r->where,
                             key, (long long)timeout_ms);
        nap = fsdp__store_backoff_ms(nap);
        int64_t ms = ms_left(deadline);
        fsdp__sleep_ms(nap < ms ? nap : ms);
    }
}

static int redis_add(void *data, const char *key, int64_t delta, int64_t *result,
                     int64_t timeout_ms, char *err) {
    redis_store_t *r = data;
    char rkey[RKEY_CAP], num[32];
    int rc = redis_key(r, key, rkey, sizeof rkey, err);
    if (rc < 0) return rc;
    int n = snprintf(num, sizeof num, "%" PRId64, delta);
    const char *argv[3] = {"INCRBY", rkey, num};
    size_t argvlen[3] = {6, strlen(rkey), (size_t)n};
    redisReply *rep;
    rc = command(r, 3, argv, argvlen, fsdp__store_deadline_ns(timeout_ms), timeout_ms, "add", key,
                 &rep, err);
    if (rc < 0) return rc;
    if (rep->type == REDIS_REPLY_INTEGER) {
        *result = (int64_t)rep->integer;
    } else if (rep->type == REDIS_REPLY_ERROR &&
               (strstr(rep->str, "not an integer") || strstr(rep->str, "overflow"))) {
        rc = fsdp__err(err, FSDP_EINVAL,
                       "redis store %s: add on '%s', whose value is not a counter (%s)", r->where,
                       key, rep->str);
    } else {
        rc = bad_reply(r, rep, "add", key, err);
    }
    freeReplyObject(rep);
    return rc;
}

static int redis_check(void *data, const char *key, int *found, int64_t timeout_ms, char *err) {
    redis_store_t *r = data;
    char rkey[RKEY_CAP];
    int rc = redis_key(r, key, rkey, sizeof rkey, err);
    if (rc < 0) return rc;
    const char *argv[2] = {"EXISTS", rkey};
    size_t argvlen[2] = {6, strlen(rkey)};
    redisReply *rep;
    rc = command(r, 2, argv, argvlen, fsdp__store_deadline_ns(timeout_ms), timeout_ms, "check", key,
                 &rep, err);
    if (rc < 0) return rc;
    if (rep->type == REDIS_REPLY_INTEGER)
        *found = rep->integer > 0;
    else
        rc = bad_reply(r, rep, "check", key, err);
    freeReplyObject(rep);
    return rc;
}

static void redis_retain(void *data) {
    redis_store_t *r = data;
    pthread_mutex_lock(&r->mu);
    r->refs++;
    pthread_mutex_unlock(&r->mu);
}

static void redis_release(void *data) {
    redis_store_t *r = data;
    pthread_mutex_lock(&r->mu);
    int last = --r->refs == 0;
    pthread_mutex_unlock(&r->mu);
    if (!last) return;
    if (r->c) redisFree(r->c);
    pthread_mutex_destroy(&r->mu);
    memset(r->password, 0, sizeof r->password);
    free(r);
}

static const struct fsdp_store_ops redis_ops = {
    .name = "redis",
    .set = redis_set,
    .get = redis_get,
    .add = redis_add,
    .check = redis_check,
    .retain = redis_retain,
    .release = redis_release,
};

int fsdp_store_create_redis(fsdp_ctx_t *ctx, const char *host, int port, const char *prefix,
                            fsdp_store_t **out) {
    return fsdp__store_create_redis_auth(ctx, host, port, prefix, NULL, out);
}

int fsdp__store_create_redis_auth(fsdp_ctx_t *ctx, const char *host, int port, const char *prefix,
                                  const fsdp__redis_auth_t *auth, fsdp_store_t **out) {
    if (!out) return fsdp__ctx_err_or_log(ctx, FSDP_EINVAL, "fsdp_store_create_redis: out is NULL");
    *out = NULL;
    if (!host || !*host)
        return fsdp__ctx_err_or_log(ctx, FSDP_EINVAL, "fsdp_store_create_redis: host is %s",
                                    host ? "empty" : "NULL");
    if (strlen(host) >= HOST_CAP)
        return fsdp__ctx_err_or_log(ctx, FSDP_EINVAL,
                                    "fsdp_store_create_redis: host '%.64s...' is longer than %d "
                                    "bytes",
                                    host, HOST_CAP - 1);
    if (port < 1 || port > 65535)
        return fsdp__ctx_err_or_log(ctx, FSDP_EINVAL,
                                    "fsdp_store_create_redis(%s): port %d is outside 1..65535",
                                    host, port);
    if (prefix && strlen(prefix) >= PREFIX_CAP)
        return fsdp__ctx_err_or_log(ctx, FSDP_EINVAL,
                                    "fsdp_store_create_redis(%s:%d): prefix '%.64s...' is longer "
                                    "than %d bytes",
                                    host, port, prefix, PREFIX_CAP - 1);
    if (auth && (strlen(auth->user) >= 256 || strlen(auth->password) >= 256))
        return fsdp__ctx_err_or_log(ctx, FSDP_EINVAL,
                                    "fsdp_store_create_redis(%s:%d): the user name or password is "
                                    "longer than 255 bytes",
                                    host, port);
    redis_store_t *r = calloc(1, sizeof *r);
    if (!r) return fsdp__ctx_err_or_log(ctx, FSDP_ENOMEM, "fsdp_store_create_redis: out of memory");
    snprintf(r->host, sizeof r->host, "%s", host);
    snprintf(r->prefix, sizeof r->prefix, "%s", prefix ? prefix : "");
    r->port = port;
    if (auth) {
        snprintf(r->user, sizeof r->user, "%s", auth->user);
        snprintf(r->password, sizeof r->password, "%s", auth->password);
        r->db = auth->db;
    }
    /* An IPv6 address is written [addr]:port, as in URLs. */
    snprintf(r->where, sizeof r->where, strchr(host, ':') ? "[%s]:%d" : "%s:%d", host, port);
    pthread_mutex_init(&r->mu, NULL);
    r->refs = 1;
    int rc = fsdp__store_wrap(&redis_ops, r, out);
    if (rc < 0) return fsdp__ctx_err_or_log(ctx, rc, "fsdp_store_create_redis: out of memory");
    return FSDP_OK;
}

#else /* !FSDP_HAVE_HIREDIS */

int fsdp_store_create_redis(fsdp_ctx_t *ctx, const char *host, int port, const char *prefix,
                            fsdp_store_t **out) {
    return fsdp__store_create_redis_auth(ctx, host, port, prefix, NULL, out);
}

int fsdp__store_create_redis_auth(fsdp_ctx_t *ctx, const char *host, int port, const char *prefix,
                                  const fsdp__redis_auth_t *auth, fsdp_store_t **out) {
    (void)prefix;
    (void)auth;
    if (out) *out = NULL;
    return fsdp__ctx_err_or_log(ctx, FSDP_ENOTSUP,
                                "fsdp_store_create_redis(%s:%d): libfsdp was built without "
                                "hiredis (install libhiredis-dev and configure --with-hiredis)",
                                host ? host : "(null)", port);
}

#endif /* FSDP_HAVE_HIREDIS */
