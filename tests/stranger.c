/* SPDX-License-Identifier: MIT */
/*
 * stranger.c: another user of the host who races a job's listeners (issue 26, item 1), for
 * t_fsdprun_netns.sh.
 *
 *   tests/stranger SECONDS READY_FILE STOP_FILE
 *
 * Started as root, it first becomes nobody (uid and gid 65534), so that it is another user of
 * the host. It notes the TCP sockets listening on 127.0.0.1 when it starts, then for SECONDS
 * seconds, or until STOP_FILE exists, reads /proc/net/tcp every millisecond and connects to
 * every new listener, keeping each connection open, as a process that wants to break the job's
 * rendezvous would. It creates READY_FILE once it watches, and at the end prints "connected N" (the
 * new listeners it reached) and exits 0; exit status 2 on bad arguments, 1 when it cannot watch at
 * all.
 */
#define _GNU_SOURCE

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define MAX_SEEN 4096

static unsigned long seen[MAX_SEEN]; /* inodes of listeners noted or connected to */
static int nseen;

static int was_seen(unsigned long ino) {
    for (int i = 0; i < nseen; i++)
        if (seen[i] == ino) return 1;
    return 0;
}

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Reads /proc/net/tcp; for each loopback listener not seen yet, notes it and (connect) connects
 * to it. Returns the number of new connections, or -1 when the file cannot be read. */
static int scan(int connect_new, int *fds, int *nfds, int maxfds) {
    FILE *f = fopen("/proc/net/tcp", "re");
    if (!f) return -1;
    char line[512];
    int made = 0;
    if (!fgets(line, sizeof line, f)) { /* the header */
        fclose(f);
        return 0;
    }
    while (fgets(line, sizeof line, f)) {
        unsigned addr, port, st;
        unsigned long ino = 0;
        /* sl local rem st tx:rx tr:when retrnsmt uid timeout inode */
        if (sscanf(line, " %*d: %8X:%4X %*8X:%*4X %2X %*8X:%*8X %*2X:%*8X %*8X %*u %*d %lu", &addr,
                   &port, &st, &ino) != 4)
            continue;
        if (st != 0x0A || addr != htonl(INADDR_LOOPBACK) || was_seen(ino) || nseen == MAX_SEEN)
            continue;
        seen[nseen++] = ino;
        if (!connect_new || *nfds == maxfds) continue;
        int s = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (s < 0) continue;
        struct sockaddr_in sa;
        memset(&sa, 0, sizeof sa);
        sa.sin_family = AF_INET;
        sa.sin_port = htons((unsigned short)port);
        sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        if (connect(s, (struct sockaddr *)&sa, sizeof sa) == 0) {
            fds[(*nfds)++] = s;
            made++;
        } else {
            close(s);
        }
    }
    fclose(f);
    return made;
}

int main(int argc, char **argv) {
    if (argc != 4 || atof(argv[1]) <= 0) {
        fprintf(stderr, "usage: stranger SECONDS READY_FILE STOP_FILE\n");
        return 2;
    }
    double seconds = atof(argv[1]);
    if (geteuid() == 0 && (setgroups(0, NULL) < 0 || setgid(65534) < 0 || setuid(65534) < 0)) {
        fprintf(stderr, "stranger: cannot become nobody: %s\n", strerror(errno));
        return 1;
    }
    static int fds[1024];
    int nfds = 0, connected = 0;
    if (scan(0, fds, &nfds, 1024) < 0) {
        fprintf(stderr, "stranger: cannot read /proc/net/tcp: %s\n", strerror(errno));
        return 1;
    }
    int rf = open(argv[2], O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (rf >= 0) close(rf);
    double end = now() + seconds;
    while (now() < end && access(argv[3], F_OK) != 0) {
        int m = scan(1, fds, &nfds, 1024);
        if (m > 0) connected += m;
        usleep(1000);
    }
    printf("connected %d\n", connected);
    for (int i = 0; i < nfds; i++)
        close(fds[i]);
    return 0;
}
