/* SPDX-License-Identifier: MIT */
/*
 * t_train_metrics.c: fsdp-train's metrics writer (tools/train_metrics.c) on its own.
 *   - a value that is not finite (NaN, an infinity) is written as null, so every line stays
 *     JSON that any reader parses, and a finite one keeps its 17 digits;
 *   - every record starts with its type and a wall-clock time in seconds since the epoch;
 *   - the config record holds the version, world, backend and every flag of train_opts_json;
 *   - a write that fails is kept and reported by train_metrics_close (fsdp-train exits 1), and
 *     nothing is written after it.
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "tap.h"
#include "tools/train.h"

/* The file's text (static buffer). */
static const char *slurp(FILE *f) {
    static char buf[1 << 15];
    rewind(f);
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    buf[n] = '\0';
    return buf;
}

int main(void) {
    tap_plan_lazy();
    train_opts_t o;
    char *argv[] = {"fsdp-train", "--steps", "7", "--metrics", "m.jsonl", NULL};
    tap_is_int(train_parse_flags(5, argv, &o), 0, "flags parse");
    job_t j = {.o = &o, .world = 3, .metrics = tmpfile()};
    j.cfg.n_layer = 2;
    if (!j.metrics) tap_bail("tmpfile: %s", strerror(errno));

    json_t *rec = train_metrics_record("train");
    json_object_set_new(rec, "loss", train_json_num(NAN));
    json_object_set_new(rec, "grad_norm", train_json_num(INFINITY));
    json_object_set_new(rec, "lr", train_json_num(-INFINITY));
    json_object_set_new(rec, "step_s", train_json_num(0.1));
    train_metrics_emit(&j, rec);
    const char *text = slurp(j.metrics);
    json_error_t e;
    json_t *back = json_loads(text, 0, &e);
    tap_ok(back != NULL, "the record is valid JSON (%s)", back ? "parsed" : e.text);
    tap_ok(json_is_null(json_object_get(back, "loss")), "a NaN loss is null");
    tap_ok(json_is_null(json_object_get(back, "grad_norm")), "an infinite norm is null");
    tap_ok(json_is_null(json_object_get(back, "lr")), "so is -inf");
    tap_ok(json_real_value(json_object_get(back, "step_s")) == 0.1, "0.1 comes back exactly");
    tap_ok(strncmp(text, "{\"type\":\"train\",\"time\":", 23) == 0,
           "the record starts with its type and time: %.40s", text);
    double t = json_number_value(json_object_get(back, "time"));
    tap_ok(fabs(t - (double)time(NULL)) < 60, "time is the wall clock in seconds (%.3f)", t);
    json_decref(back);

    /* The config record. */
    rewind(j.metrics);
    if (ftruncate(fileno(j.metrics), 0) != 0) tap_bail("ftruncate");
    train_metrics_config(&j, "gloo");
    back = json_loads(slurp(j.metrics), 0, &e);
    tap_ok(back && !strcmp(json_string_value(json_object_get(back, "type")), "config"),
           "the config record parses");
    tap_is_str(json_string_value(json_object_get(back, "version")), fsdp_version_string(),
               "with the version");
    tap_ok(json_integer_value(json_object_get(back, "world")) == 3, "the world");
    tap_is_str(json_string_value(json_object_get(back, "backend")), "gloo", "the backend");
    json_t *flags = json_object_get(back, "flags");
    tap_ok(json_integer_value(json_object_get(flags, "steps")) == 7, "the flags as given");
    tap_is_str(json_string_value(json_object_get(flags, "metrics")), "m.jsonl", "paths too");
    tap_ok(json_integer_value(json_object_get(flags, "batch-size")) == 16, "defaults included");
    tap_ok(json_is_null(json_object_get(flags, "init")), "unset paths are null");
    tap_ok(json_integer_value(json_object_get(json_object_get(back, "model"), "n_layer")) == 2,
           "and the model as resolved");
    json_decref(back);
    tap_is_int(train_metrics_close(&j), 0, "closing a file written in full returns 0");

    /* A write that fails: a stream open for reading only. */
    j.metrics = fopen("/dev/null", "r");
    if (!j.metrics) tap_bail("fopen /dev/null");
    train_metrics_emit(&j, train_metrics_record("val"));
    tap_ok(j.metrics_errno != 0, "a failed write is kept (%s)", strerror(j.metrics_errno));
    int first = j.metrics_errno;
    train_metrics_emit(&j, train_metrics_record("val"));
    tap_is_int(j.metrics_errno, first, "the first failure stays the one reported");
    tap_is_int(train_metrics_close(&j), -1, "and train_metrics_close reports it");
    return tap_done();
}
