/* SPDX-License-Identifier: MIT */
/*
 * fs_util.h: file-system helpers of the tests that plant files (t_store_file, t_store_trust,
 * t_io_trust): paths inside a test's directory, removing that tree without following links,
 * and the guard
 * around a call that a regression could make block.
 *
 * The guard: SIGALRM every `seconds` seconds, without SA_RESTART, interrupts a blocked system
 * call (opening a FIFO), so the call returns an error and the checks after it fail instead of
 * the suite hanging; a call that keeps retrying is stopped at the third signal with a Bail out!.
 */
#ifndef FSDP_TEST_FS_UTIL_H
#define FSDP_TEST_FS_UTIL_H

#include <dirent.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <unistd.h>

#include "tap.h"

/* "dir/name" in one of four rotating static buffers, so that a call can take a few at once.
 * dir may be an earlier result (it is joined in a local buffer first, so no overlap). */
static inline const char *fsu_join(const char *dir, const char *name) {
    static char buf[4][1024];
    static int k;
    char tmp[sizeof buf[0]];
    snprintf(tmp, sizeof tmp, "%s/%s", dir, name);
    char *p = buf[k++ % 4];
    memcpy(p, tmp, sizeof tmp);
    return p;
}

/* rm -r of path, never following a link. */
static inline void fsu_remove_tree(const char *path) {
    struct stat st;
    if (lstat(path, &st) != 0) return;
    if (S_ISDIR(st.st_mode)) {
        DIR *d = opendir(path);
        struct dirent *e;
        while (d && (e = readdir(d))) {
            if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
            char sub[2048];
            int n = snprintf(sub, sizeof sub, "%s/%s", path, e->d_name);
            if (n > 0 && (size_t)n < sizeof sub) fsu_remove_tree(sub);
        }
        if (d) closedir(d);
        rmdir(path);
    } else {
        unlink(path);
    }
}

static volatile sig_atomic_t fsu_guard_fired;

static inline void fsu_on_guard(int sig) {
    (void)sig;
    if (++fsu_guard_fired >= 3) {
        static const char msg[] = "Bail out! a call stayed blocked through three guard signals\n";
        if (write(1, msg, sizeof msg - 1) < 0) _exit(2);
        _exit(1);
    }
}

static inline void fsu_guard_install(void) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = fsu_on_guard;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGALRM, &sa, NULL);
}

static inline void fsu_guard_start(int seconds) {
    fsu_guard_fired = 0;
    struct itimerval it = {{seconds, 0}, {seconds, 0}};
    setitimer(ITIMER_REAL, &it, NULL);
}

static inline void fsu_guard_stop(void) {
    struct itimerval it = {{0, 0}, {0, 0}};
    setitimer(ITIMER_REAL, &it, NULL);
    if (fsu_guard_fired) tap_diag("the call blocked until the guard interrupted it");
}

#endif /* FSDP_TEST_FS_UTIL_H */
