/* SPDX-License-Identifier: MIT */
/*
 * fsdprun_netns.c: a network of the job's own for the ranks of a one-node job (docs/design.md,
 * "Who can reach a rank").
 *
 * Gloo's TCP transport listens on a fresh loopback port per pair of ranks and takes the first
 * connection that arrives, with nothing to prove who made it: another user of the host who
 * watches /proc/net/tcp can connect first and break every job at start-up. When all ranks run
 * on this node, fsdprun moves itself, before it starts them, into a new network namespace
 * whose only interface is a loopback that it brings up: the ranks inherit it, their
 * listeners are invisible and unreachable from the host's namespace, and the file store and
 * shared memory they also use are untouched. Root unshares the network alone; another user
 * first gets a user namespace that maps only its own uid and gid (so files keep their real
 * owners), which Debian and most distributions allow.
 *
 * fsdprun_netns_wanted says when that is possible without changing the job: one node, and a
 * store the ranks reach through the file system (the temporary one or file://; not a master
 * address), since a Redis or TCP store on the host's network would be out of reach, and a backend
 * other than NCCL. When the kernel refuses, the job runs as before and the reason goes to stderr as
 * one warning line.
 */
#define _GNU_SOURCE

#include <errno.h>
#include <fcntl.h>
#include <net/if.h>
#include <sched.h>
#include <stdio.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include "tools/fsdprun.h"

int fsdprun_netns_wanted(const options_t *o) {
    if (!o->isolate_network || o->nnodes != 1) return 0;
    /* A TCP store at a master address is on the host's network, served from there. */
    if (o->master_addr[0] || o->master_port >= 0) return 0;
    /* NCCL's bootstrap and its network plugins have not been run inside one: left as they are. */
    if (strcmp(o->backend, "nccl") == 0) return 0;
    return !o->store || strncmp(o->store, "file://", 7) == 0;
}

/* Writes s to the /proc file at path; 0 or -1 with errno. */
static int write_proc(const char *path, const char *s) {
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    size_t n = strlen(s);
    ssize_t w = write(fd, s, n);
    int e = errno;
    close(fd);
    if (w == (ssize_t)n) return 0;
    errno = w < 0 ? e : EIO;
    return -1;
}

/* A user namespace mapping only our own ids, and a network namespace inside it. */
static int unshare_as_user(char *why, size_t cap) {
    uid_t uid = geteuid();
    gid_t gid = getegid();
    if (unshare(CLONE_NEWUSER | CLONE_NEWNET) < 0) {
        snprintf(why, cap, "unshare(CLONE_NEWUSER | CLONE_NEWNET): %s", strerror(errno));
        return -1;
    }
    char map[64];
    if (write_proc("/proc/self/setgroups", "deny") < 0 && errno != ENOENT) {
        snprintf(why, cap, "/proc/self/setgroups: %s", strerror(errno));
        return -1;
    }
    snprintf(map, sizeof map, "%lu %lu 1\n", (unsigned long)uid, (unsigned long)uid);
    if (write_proc("/proc/self/uid_map", map) < 0) {
        snprintf(why, cap, "/proc/self/uid_map: %s", strerror(errno));
        return -1;
    }
    snprintf(map, sizeof map, "%lu %lu 1\n", (unsigned long)gid, (unsigned long)gid);
    if (write_proc("/proc/self/gid_map", map) < 0) {
        snprintf(why, cap, "/proc/self/gid_map: %s", strerror(errno));
        return -1;
    }
    return 0;
}

/* Brings the loopback interface of the current network namespace up. */
static int loopback_up(char *why, size_t cap) {
    int s = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (s < 0) {
        snprintf(why, cap, "socket for the loopback interface: %s", strerror(errno));
        return -1;
    }
    struct ifreq ifr;
    memset(&ifr, 0, sizeof ifr);
    snprintf(ifr.ifr_name, sizeof ifr.ifr_name, "lo");
    int rc = ioctl(s, SIOCGIFFLAGS, &ifr);
    if (rc == 0) {
        ifr.ifr_flags |= IFF_UP | IFF_RUNNING;
        rc = ioctl(s, SIOCSIFFLAGS, &ifr);
    }
    if (rc < 0) snprintf(why, cap, "bringing up the loopback interface: %s", strerror(errno));
    close(s);
    return rc;
}

int fsdprun_netns_enter(char *why, size_t cap) {
    int home = open("/proc/self/ns/net", O_RDONLY | O_CLOEXEC);
    int rc = -1;
    if (geteuid() == 0 && unshare(CLONE_NEWNET) == 0)
        rc = 0;
    else if (unshare_as_user(why, cap) == 0)
        rc = 0;
    if (rc == 0 && loopback_up(why, cap) < 0) {
        /* A namespace without a working loopback would break the job: go back home, or fail. */
        rc = home >= 0 && setns(home, CLONE_NEWNET) == 0 ? -1 : -2;
    }
    if (home >= 0) close(home);
    return rc;
}
