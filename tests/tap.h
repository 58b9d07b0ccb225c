/* SPDX-License-Identifier: MIT */
/*
 * tap.h: a header-only TAP producer for libfsdp's tests.
 *
 * A test program calls tap_plan(n) (or tap_plan_lazy() and tap_done() prints the plan at the
 * end), then checks. Typed checks print both values on failure, so a failing log says what was
 * expected and what came. tap_done() returns the exit status: 0 when every test passed and the
 * count matched the plan. Checks are thread-safe, so rank threads of a sim run may report; the
 * output of one check is one write.
 */
#ifndef FSDP_TAP_H
#define FSDP_TAP_H

#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* One state per test program, shared by every file that includes this header (helper files such
 * as gradcheck.c report too): a weak definition in each object, merged by the linker. */
struct tap_state_s {
    pthread_mutex_t mu;
    int planned; /* -1 when lazy */
    int run;
    int failed;
};
__attribute__((weak)) struct tap_state_s tap_state = {PTHREAD_MUTEX_INITIALIZER, -1, 0, 0};

static inline void tap_plan(int n) {
    tap_state.planned = n;
    printf("1..%d\n", n);
    fflush(stdout);
}

/* The plan is printed by tap_done(), after the last test. */
static inline void tap_plan_lazy(void) { tap_state.planned = -1; }

static inline void tap_vdiag(const char *fmt, va_list ap) {
    char buf[2048];
    vsnprintf(buf, sizeof buf, fmt, ap);
    /* Every line of the message becomes a TAP comment. */
    char out[4096];
    size_t o = 0;
    const char *p = buf;
    while (*p && o + 4 < sizeof out) {
        out[o++] = '#';
        out[o++] = ' ';
        while (*p && *p != '\n' && o + 2 < sizeof out) out[o++] = *p++;
        out[o++] = '\n';
        if (*p == '\n') p++;
    }
    out[o] = 0;
    fputs(out, stdout);
}

static inline void tap_diag(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    pthread_mutex_lock(&tap_state.mu);
    tap_vdiag(fmt, ap);
    fflush(stdout);
    pthread_mutex_unlock(&tap_state.mu);
    va_end(ap);
}

/* Reports one test; `detail` (may be NULL) is printed as a comment when it failed. */
static inline int tap_report(int pass, const char *detail, const char *fmt, va_list ap) {
    char name[1024];
    vsnprintf(name, sizeof name, fmt, ap);
    pthread_mutex_lock(&tap_state.mu);
    int n = ++tap_state.run;
    if (!pass) tap_state.failed++;
    printf("%s %d - %s\n", pass ? "ok" : "not ok", n, name);
    if (!pass && detail) {
        char d[2048];
        snprintf(d, sizeof d, "%s", detail);
        const char *p = d;
        while (*p) {
            const char *e = strchr(p, '\n');
            int len = e ? (int)(e - p) : (int)strlen(p);
            printf("#   %.*s\n", len, p);
            p += len + (e ? 1 : 0);
        }
    }
    fflush(stdout);
    pthread_mutex_unlock(&tap_state.mu);
    return pass;
}

static inline int tap_ok(int pass, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int r = tap_report(pass, NULL, fmt, ap);
    va_end(ap);
    return r;
}

/* tap_ok with a detail (may be NULL) printed as a comment when it failed. */
static inline int tap_ok_why(int pass, const char *detail, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int r = tap_report(pass, detail, fmt, ap);
    va_end(ap);
    return r;
}

static inline int tap_is_int(int64_t got, int64_t want, const char *fmt, ...) {
    char d[256];
    snprintf(d, sizeof d, "got:  %" PRId64 "\nwant: %" PRId64, got, want);
    va_list ap;
    va_start(ap, fmt);
    int r = tap_report(got == want, d, fmt, ap);
    va_end(ap);
    return r;
}

static inline int tap_is_uint(uint64_t got, uint64_t want, const char *fmt, ...) {
    char d[256];
    snprintf(d, sizeof d, "got:  %" PRIu64 " (0x%" PRIx64 ")\nwant: %" PRIu64 " (0x%" PRIx64 ")",
             got, got, want, want);
    va_list ap;
    va_start(ap, fmt);
    int r = tap_report(got == want, d, fmt, ap);
    va_end(ap);
    return r;
}

static inline int tap_is_size(size_t got, size_t want, const char *fmt, ...) {
    char d[256];
    snprintf(d, sizeof d, "got:  %zu\nwant: %zu", got, want);
    va_list ap;
    va_start(ap, fmt);
    int r = tap_report(got == want, d, fmt, ap);
    va_end(ap);
    return r;
}

static inline int tap_is_str(const char *got, const char *want, const char *fmt, ...) {
    int pass = (got && want) ? strcmp(got, want) == 0 : got == want;
    char d[1200];
    snprintf(d, sizeof d, "got:  \"%.500s\"\nwant: \"%.500s\"", got ? got : "(null)",
             want ? want : "(null)");
    va_list ap;
    va_start(ap, fmt);
    int r = tap_report(pass, d, fmt, ap);
    va_end(ap);
    return r;
}

/* Passes when `needle` occurs in `hay`. */
static inline int tap_has_str(const char *hay, const char *needle, const char *fmt, ...) {
    int pass = hay && needle && strstr(hay, needle) != NULL;
    char d[1200];
    snprintf(d, sizeof d, "text:    \"%.700s\"\nmissing: \"%.300s\"", hay ? hay : "(null)",
             needle ? needle : "(null)");
    va_list ap;
    va_start(ap, fmt);
    int r = tap_report(pass, d, fmt, ap);
    va_end(ap);
    return r;
}

/* Passes when |got - want| <= atol + rtol * |want| (both NaN counts as equal). */
static inline int tap_is_near(double got, double want, double rtol, double atol, const char *fmt,
                              ...) {
    int pass = (isnan(got) && isnan(want)) || fabs(got - want) <= atol + rtol * fabs(want) ||
               got == want;
    char d[256];
    snprintf(d, sizeof d, "got:  %.17g\nwant: %.17g (rtol %g, atol %g)", got, want, rtol, atol);
    va_list ap;
    va_start(ap, fmt);
    int r = tap_report(pass, d, fmt, ap);
    va_end(ap);
    return r;
}

/* Compares n bytes; on failure prints the first differing offset and bytes. */
static inline int tap_is_mem(const void *got, const void *want, size_t n, const char *fmt, ...) {
    const unsigned char *g = got, *w = want;
    size_t i = 0;
    while (i < n && g[i] == w[i]) i++;
    char d[256];
    if (i < n)
        snprintf(d, sizeof d, "first difference at byte %zu of %zu: got 0x%02x, want 0x%02x", i, n,
                 g[i], w[i]);
    else
        d[0] = 0;
    va_list ap;
    va_start(ap, fmt);
    int r = tap_report(i == n, d, fmt, ap);
    va_end(ap);
    return r;
}

static inline void tap_skip(int n, const char *why) {
    pthread_mutex_lock(&tap_state.mu);
    for (int i = 0; i < n; i++) printf("ok %d # SKIP %s\n", ++tap_state.run, why);
    fflush(stdout);
    pthread_mutex_unlock(&tap_state.mu);
}

/* Skips the whole program: prints "1..0 # SKIP why" and returns the exit status to use. */
static inline int tap_skip_all(const char *why) {
    printf("1..0 # SKIP %s\n", why);
    fflush(stdout);
    return 0;
}

/* Stops the run: tap-driver reports a Bail out! as an error. */
static inline void tap_bail(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    char buf[512];
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    printf("Bail out! %s\n", buf);
    fflush(stdout);
    exit(1);
}

/* Writes "<dir>/<name>" into buf (cap bytes), dir being $TMPDIR or else /tmp, so that a test's
 * scratch files go where the caller points (a package build keeps them in its build tree).
 * Bails out when the path does not fit rather than cutting it. */
static inline void tap_tmppath(char *buf, size_t cap, const char *name) {
    const char *dir = getenv("TMPDIR");
    if (!dir || !*dir) dir = "/tmp";
    int n = snprintf(buf, cap, "%s/%s", dir, name);
    if (n < 0 || (size_t)n >= cap)
        tap_bail("TMPDIR %s is too long for a scratch path of %zu bytes", dir, cap);
}

/* Prints the lazy plan if any and returns the exit status. */
static inline int tap_done(void) {
    if (tap_state.planned < 0) printf("1..%d\n", tap_state.run);
    else if (tap_state.planned != tap_state.run)
        printf("# planned %d tests but ran %d\n", tap_state.planned, tap_state.run);
    fflush(stdout);
    int bad = tap_state.failed > 0 || (tap_state.planned >= 0 && tap_state.planned != tap_state.run);
    return bad ? 1 : 0;
}

#endif /* FSDP_TAP_H */
