/* SPDX-License-Identifier: MIT */
/*
 * fsdp/store.h: a small key-value store for rendezvous.
 *
 * Ranks exchange what they need to connect (NCCL unique ids, Gloo addresses, counters) through a
 * store. A store handle has its own key prefix and last-error text; handles made with
 * fsdp_store_clone() share the data of the handle they came from. The in-memory store serves
 * ranks that are threads of one process; the file store serves processes that share a directory
 * (one host, or many over NFS); the Redis store serves processes anywhere that reach one Redis
 * server; the TCP store serves processes anywhere that reach one fsdp_store_server (fsdprun's
 * node 0, or rank 0 of fsdp_init_from_env). Every call on one handle must come from one thread at a
 * time; different handles on the same data may be used concurrently.
 *
 * The constructors have no store yet to hold error text: they take the calling rank's context
 * and leave the reason there (fsdp_ctx_last_error). ctx may be NULL (a program that has no
 * context yet); the reason is then logged at error level (see FSDP_LOG). The context only
 * receives the message: the store does not keep it.
 */
#ifndef FSDP_STORE_H
#define FSDP_STORE_H

#include <stddef.h>
#include <stdint.h>

#include <fsdp/context.h>
#include <fsdp/export.h>

FSDP_BEGIN_DECLS

typedef struct fsdp_store fsdp_store_t;

/* Default timeout of get and wait, in milliseconds. */
#define FSDP_STORE_DEFAULT_TIMEOUT_MS 30000

/* Creates an empty in-memory store. The caller owns *out. ctx (may be NULL) receives the error
 * message. */
FSDP_EXTERN int fsdp_store_create_memory(fsdp_ctx_t *ctx, fsdp_store_t **out);

/*
 * Opens the file store in directory `dir`, creating it and its missing parents (mkdir -p). Every
 * handle, in any process or on any host, opened on the same directory sees the same data. Each
 * key is one file whose name encodes the key ('/' and other bytes are %-escaped, so keys never
 * make subdirectories). set replaces a value atomically (a temporary file renamed into place), so
 * readers never see part of one; set and add lock the key (flock on a per-key lock file), so add
 * is atomic across processes; get and wait poll the directory (1 ms doubling to 50 ms) until the
 * handle's timeout. Files are created readable by their owner only: every rank must run as the
 * same user. Nothing is removed from the directory; use a fresh directory per job.
 *
 * The directory must be private, since whoever can write to it can steer the ranks: directories
 * the store creates are 0700 whatever the umask, and dir itself must not be a symbolic link,
 * must be owned by the effective user and writable by no one else, and its parent must not be
 * writable by group or others unless it is sticky (like /tmp). Key files are never read or
 * written through a link; a key or lock file that is a link or not a regular file is refused
 * (FSDP_EINVAL from the operation, naming the file).
 *
 * Blocks only for the directory checks. The caller owns *out (NULL on failure). Errors, with
 * their message on ctx (may be NULL): FSDP_EINVAL for a NULL or empty dir, or a directory that
 * fails the checks above (the message names the path, its owner uid and mode, and what is
 * wrong); FSDP_EBACKEND when the directory cannot be created or written (the message names the
 * path and the system's reason). Thread-safe.
 */
FSDP_EXTERN int fsdp_store_create_file(fsdp_ctx_t *ctx, const char *dir, fsdp_store_t **out);

/*
 * Opens the Redis store on the server at host:port. Keys are stored as "<prefix>/<key>", or bare
 * when prefix is NULL or empty, so jobs sharing a server use different prefixes. set is SET, add
 * is INCRBY (atomic on the server), check is EXISTS; get and wait poll GET (1 ms doubling to
 * 50 ms) until the handle's timeout.
 *
 * Does not connect: the first operation does, retrying a refused connection until the handle's
 * timeout so ranks may start before the server; an unreachable server gives FSDP_ETIMEDOUT naming
 * host:port. No operation blocks much longer than the handle's timeout. Handles on the same data
 * share one connection, used under a lock. A command that failed on the wire is not resent (add
 * may have counted); the error is FSDP_EBACKEND and the next operation reconnects. SIGPIPE from a
 * closed connection is blocked and discarded in the calling thread.
 *
 * The caller owns *out (NULL on failure). Errors, with their message on ctx (may be NULL):
 * FSDP_EINVAL for a NULL or empty host, a port outside 1..65535 or a host or prefix of 256 bytes
 * or more; FSDP_ENOTSUP when libfsdp was built without hiredis. Thread-safe.
 */
FSDP_EXTERN int fsdp_store_create_redis(fsdp_ctx_t *ctx, const char *host, int port,
                                        const char *prefix, fsdp_store_t **out);

/*
 * Opens the TCP store served by a fsdp_store_server (below) at host:port: no Redis and no shared
 * file system, just one process that every rank can reach, like PyTorch's TCPStore. Keys are
 * "<prefix>/<key>", or bare when prefix is NULL or empty. set, add and check are one request
 * each (add is atomic on the server); get and wait poll (1 ms doubling to 50 ms) until the
 * handle's timeout. Values are at most 64 MiB (FSDP_EINVAL beyond), and the server holds at
 * most 1 GiB of keys and values (FSDP_ENOMEM beyond).
 *
 * Does not connect: the first operation does, retrying a refused connection until the handle's
 * timeout so ranks may start before the server; an unreachable server gives FSDP_ETIMEDOUT
 * naming host:port, and a port where something else listens gives FSDP_ETIMEDOUT saying so. No
 * operation blocks much longer than the handle's timeout. Handles on the same data share one
 * connection, used under a lock. A request that failed on the wire is not resent (add may have
 * counted); the error is FSDP_EBACKEND and the next operation reconnects. A closed connection
 * never raises SIGPIPE.
 *
 * The job's key: when FSDP_STORE_KEY_FILE names a file (16 to 1024 bytes, a regular file of the
 * user's that nobody else may read), the handle proves it holds that key to the server and
 * checks that the server holds it too, and refuses a server that does not ask for it; a server
 * started with the same variable serves only such clients. Without it the store has no
 * authentication: whoever reaches the port can read and steer the rendezvous, so serve it on an
 * address only the job's hosts reach. A server and a handle that disagree about the key fail
 * the operation with FSDP_EINVAL at once, saying which side lacks what. The caller owns *out
 * (NULL on failure). Errors, with their message on ctx (may be NULL): FSDP_EINVAL for a NULL or
 * empty host, a port outside 1..65535, a host or prefix of 256 bytes or more, or a key file that
 * is refused (the message names it and the fault); FSDP_EBACKEND when it cannot be read.
 * Thread-safe.
 */
FSDP_EXTERN int fsdp_store_create_tcp(fsdp_ctx_t *ctx, const char *host, int port,
                                      const char *prefix, fsdp_store_t **out);

/* A server of the TCP store, running in a thread of the calling process. */
typedef struct fsdp_store_server fsdp_store_server_t;

/*
 * Starts a TCP store server listening on host:port: host NULL or "" listens on every interface,
 * port 0 picks a free port (fsdp_store_server_port tells which). It serves any number of
 * clients from one thread of its own, with non-blocking sockets: a client that stalls, sends a
 * malformed request (answered, then disconnected) or dies mid-request (its partial request is
 * dropped) never holds up the others, and what a client can make it allocate is bounded by what
 * it sent (see docs/design.md, "The TCP store"). The data lives in memory until the server
 * stops. The thread blocks every signal. With FSDP_STORE_KEY_FILE set it serves only clients
 * that prove they hold that key (see fsdp_store_create_tcp) and closes the others' connections
 * before reading a request. The caller owns *out, freed by fsdp_store_server_stop.
 * Errors, with their message on ctx (may be NULL): FSDP_EINVAL for a port outside 0..65535, a
 * host that does not resolve or a refused key file; FSDP_EBACKEND when the address cannot be
 * bound (in use, not an address of this host), naming host:port and the reason. Thread-safe.
 */
FSDP_EXTERN int fsdp_store_server_start(fsdp_ctx_t *ctx, const char *host, int port,
                                        fsdp_store_server_t **out);

/* The port the server listens on (-1 for NULL). */
FSDP_EXTERN int fsdp_store_server_port(const fsdp_store_server_t *server);

/* Stops the server within milliseconds, whatever its clients do: closes every connection (their
 * next operation fails with FSDP_EBACKEND or times out) and frees its data. NULL is accepted. */
FSDP_EXTERN void fsdp_store_server_stop(fsdp_store_server_t *server);

/*
 * Opens the store a URL names:
 *   "file:///abs/path"               fsdp_store_create_file(ctx, "/abs/path")
 *   "redis://[[user]:password@]host[:port][/db][?prefix=P]"
 *                                    the Redis store on host:port (6379), after AUTH (with the
 *                                    user name when there is one) and SELECT db (0 when none),
 *                                    keys under prefix P ("" when none)
 *   "tcp://host:port[?prefix=P]"     fsdp_store_create_tcp(ctx, host, port, P or "")
 *   "memory:"                        fsdp_store_create_memory(ctx) (a new, empty store)
 * Schemes are case-insensitive; the user, password and prefix are percent-decoded; an IPv6 host
 * is written in brackets ("redis://[::1]:6379"). The Redis path is a database number, as in
 * every Redis client (it used to be the key prefix; see NEWS). Anything else
 * (another scheme, a relative path, a host in a file URL, a database that is not a number,
 * another query) is FSDP_EINVAL with a message that quotes the URL, its password replaced by
 * "***", and lists these forms. No message of any store ever shows a password. Otherwise returns
 * what the constructor returns; a Redis server that refuses the password or the database makes
 * the first operation fail with FSDP_EBACKEND quoting the server. Messages go to ctx (may be
 * NULL), as the constructors'. Thread-safe.
 */
FSDP_EXTERN int fsdp_store_open_url(fsdp_ctx_t *ctx, const char *url, fsdp_store_t **out);

/* A new handle on the same data whose keys are prefixed by `prefix` (appended to the prefix of
 * `store`, with a '/' between). The data lives until its last handle is destroyed. */
FSDP_EXTERN int fsdp_store_clone(fsdp_store_t *store, const char *prefix, fsdp_store_t **out);

/* Frees a handle; NULL is accepted. */
FSDP_EXTERN void fsdp_store_destroy(fsdp_store_t *store);

/* Timeout for get and wait on this handle (> 0 ms). */
FSDP_EXTERN int fsdp_store_set_timeout(fsdp_store_t *store, int64_t timeout_ms);

/* Sets key to a copy of the `len` bytes at `value` (len may be 0), waking waiters. */
FSDP_EXTERN int fsdp_store_set(fsdp_store_t *store, const char *key, const void *value, size_t len);

/*
 * Waits until key exists, then copies up to `cap` bytes of its value into buf and sets *len to
 * the value's full length (a larger *len than cap means the copy was cut; FSDP_EINVAL is returned
 * then). FSDP_ETIMEDOUT when the key does not appear within the handle's timeout.
 */
FSDP_EXTERN int fsdp_store_get(fsdp_store_t *store, const char *key, void *buf, size_t cap,
                               size_t *len);

/* Waits until every one of the n keys exists. FSDP_ETIMEDOUT names the first missing key. */
FSDP_EXTERN int fsdp_store_wait(fsdp_store_t *store, const char *const *keys, size_t n);

/* Adds delta to the integer counter at key (created at 0), atomically; *result (may be NULL)
 * receives the new value. A key set by fsdp_store_set() holding something other than a counter
 * gives FSDP_EINVAL. */
FSDP_EXTERN int fsdp_store_add(fsdp_store_t *store, const char *key, int64_t delta,
                               int64_t *result);

/* Sets *found to 1 when key exists, without waiting. */
FSDP_EXTERN int fsdp_store_check(fsdp_store_t *store, const char *key, int *found);

/* Text of the last error on this handle ("" when none). */
FSDP_EXTERN const char *fsdp_store_last_error(const fsdp_store_t *store);

FSDP_END_DECLS

#endif /* FSDP_STORE_H */
