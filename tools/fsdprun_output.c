/* SPDX-License-Identifier: MIT */
/*
 * fsdprun_output.c: copying the ranks' output to fsdprun's own, a prefix on every line.
 *
 * Bytes are kept per stream until a newline (or EOF, or MAX_LINE bytes without one), and each
 * complete line is written with its "[rank R] " prefix in one write of all the complete lines
 * of one read, so lines of different ranks never mix. Output that cannot be written (the
 * reader of fsdprun's stdout went away) is dropped from then on, but the ranks' pipes are
 * still drained so that no rank blocks on a full pipe.
 */
#include <errno.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tools/fsdprun.h"

static int write_all(job_t *job, int fd, const char *p, size_t n) {
    if (job->out_dead[fd]) return 0;
    while (n > 0) {
        ssize_t w = write(fd, p, n);
        if (w < 0 && errno == EINTR) continue;
        if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            /* Someone made our output non-blocking: wait until it drains. */
            struct pollfd pf = {.fd = fd, .events = POLLOUT};
            poll(&pf, 1, 100);
            continue;
        }
        if (w <= 0) {
            /* EPIPE and friends: the reader is gone. Keep draining the ranks regardless. */
            job->out_dead[fd] = 1;
            return -1;
        }
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

static int reserve(char **buf, size_t *cap, size_t need) {
    if (need <= *cap) return 0;
    size_t c = *cap ? *cap : 4096;
    while (c < need)
        c *= 2;
    char *p = realloc(*buf, c);
    if (!p) return -1;
    *buf = p;
    *cap = c;
    return 0;
}

/* Keeps line (len bytes, no newline) as r's last line when it has more than blanks, cut to fit
 * and with control characters shown as '?', for the failure summary. */
static void note_last(rank_t *r, const char *line, size_t len) {
    size_t k = 0;
    while (k < len && (line[k] == ' ' || line[k] == '\t' || line[k] == '\r'))
        k++;
    if (k == len) return;
    size_t n = len < sizeof r->last - 1 ? len : sizeof r->last - 1;
    for (size_t i = 0; i < n; i++)
        r->last[i] = (unsigned char)line[i] < 0x20 ? '?' : line[i];
    r->last[n] = 0;
}

/* Writes the complete lines of s->buf[0, upto) with prefixes, and keeps the rest. With
 * `all`, the remainder is written too, as a line of its own. */
static void flush_lines(job_t *job, rank_t *r, stream_t *s, int all) {
    size_t upto = 0;
    for (size_t i = s->len; i > 0; i--)
        if (s->buf[i - 1] == '\n') {
            upto = i;
            break;
        }
    if (all || s->len - upto >= MAX_LINE) upto = s->len;
    if (upto == 0) return;
    size_t lines = 0;
    for (size_t i = 0; i < upto; i++)
        lines += s->buf[i] == '\n';
    size_t need = upto + (lines + 1) * (r->prefix_len + 1);
    if (reserve(&job->scratch, &job->scratch_cap, need) < 0) {
        /* No memory for prefixes: pass the bytes through rather than lose them. */
        write_all(job, s->out_fd, s->buf, upto);
    } else {
        char *o = job->scratch;
        size_t at = 0;
        while (at < upto) {
            const char *nl = memchr(s->buf + at, '\n', upto - at);
            size_t end = nl ? (size_t)(nl - s->buf) : upto;
            note_last(r, s->buf + at, end - at);
            memcpy(o, r->prefix, r->prefix_len);
            o += r->prefix_len;
            memcpy(o, s->buf + at, end - at);
            o += end - at;
            *o++ = '\n';
            at = end + 1;
        }
        write_all(job, s->out_fd, job->scratch, (size_t)(o - job->scratch));
    }
    memmove(s->buf, s->buf + upto, s->len - upto);
    s->len -= upto;
}

void close_stream(job_t *job, rank_t *r, stream_t *s) {
    if (s->fd < 0) return;
    flush_lines(job, r, s, 1);
    close_fd(&s->fd);
    job->nopen--;
}

/* Reads what is there (one read) from a readable stream. */
void read_stream(job_t *job, rank_t *r, stream_t *s) {
    if (reserve(&s->buf, &s->cap, s->len + 65536) < 0) {
        flush_lines(job, r, s, 1); /* make room the hard way */
        if (reserve(&s->buf, &s->cap, s->len + 65536) < 0) return;
    }
    ssize_t n = read(s->fd, s->buf + s->len, 65536);
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) return;
    if (n <= 0) {
        close_stream(job, r, s);
        return;
    }
    s->len += (size_t)n;
    flush_lines(job, r, s, 0);
}
