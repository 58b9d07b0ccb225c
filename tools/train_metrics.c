/* SPDX-License-Identifier: MIT */
/*
 * train_metrics.c: fsdp-train's --metrics file, one JSON object a line, written through jansson.
 *
 * The first record is {"type":"config"}: the version and build, the world, the backend and
 * device, the model as resolved, and every flag's value (train_opts_json). Then one
 * {"type":"train"} record a step and one {"type":"val"} a validation. Every record has "time",
 * the wall clock in seconds since the epoch; durations are in seconds and memory in bytes
 * throughout. A value that is not finite (a diverged loss, an overflowed gradient norm) is
 * written as null, so that every line stays valid JSON. Only rank 0 writes. A write that fails
 * (a full disk, /dev/full) is remembered; train_metrics_close reports it and fsdp-train exits 1.
 */
#include <errno.h>
#include <math.h>
#include <string.h>
#include <time.h>

#include "tools/train.h"

json_t *train_json_num(double v) {
    return isfinite(v) ? json_real(v) : json_null();
}

json_t *train_metrics_record(const char *type) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    json_t *rec = json_object();
    if (!rec) return NULL;
    json_object_set_new(rec, "type", json_string(type));
    json_object_set_new(rec, "time", json_real((double)ts.tv_sec + (double)ts.tv_nsec * 1e-9));
    return rec;
}

void train_metrics_emit(job_t *j, json_t *rec) {
    /* No file, or one that failed already: the first failure is the one reported. */
    if (!j->metrics || j->metrics_errno) {
        json_decref(rec);
        return;
    }
    errno = 0;
    if (!rec || json_dumpf(rec, j->metrics, JSON_COMPACT) != 0 || fputc('\n', j->metrics) == EOF ||
        fflush(j->metrics) != 0)
        j->metrics_errno = errno ? errno : EIO;
    json_decref(rec);
}

void train_metrics_config(job_t *j, const char *backend) {
    const train_opts_t *o = j->o;
    json_t *rec = train_metrics_record("config");
    json_t *model = json_object(), *flags = train_opts_json(o);
    if (!rec || !model || !flags) {
        json_decref(rec);
        json_decref(model);
        json_decref(flags);
        if (j->metrics && !j->metrics_errno) j->metrics_errno = ENOMEM;
        return;
    }
    json_object_set_new(rec, "version", json_string(fsdp_version_string()));
    json_object_set_new(rec, "build", json_string(fsdp_build_info()));
    json_object_set_new(rec, "world", json_integer(j->world));
    json_object_set_new(rec, "backend", json_string(backend));
    json_object_set_new(rec, "device",
                        json_string(o->device == TRAIN_DEVICE_CUDA ? "cuda" : "cpu"));
    json_object_set_new(model, "n_layer", json_integer(j->cfg.n_layer));
    json_object_set_new(model, "n_head", json_integer(j->cfg.n_head));
    json_object_set_new(model, "n_embd", json_integer(j->cfg.d_model));
    json_object_set_new(model, "block_size", json_integer(j->cfg.max_seq));
    json_object_set_new(model, "vocab_size", json_integer(j->cfg.vocab));
    json_object_set_new(model, "dropout", train_json_num(j->cfg.dropout));
    json_object_set_new(rec, "model", model);
    json_object_set_new(rec, "tokens_per_step",
                        json_integer(o->batch_size * o->seq_len * o->grad_accum));
    json_object_set_new(rec, "flags", flags);
    train_metrics_emit(j, rec);
}

int train_metrics_close(job_t *j) {
    if (!j->metrics) return 0;
    int err = j->metrics_errno;
    errno = 0;
    if (fclose(j->metrics) != 0 && !err) err = errno ? errno : EIO;
    j->metrics = NULL;
    if (!err) return 0;
    fprintf(stderr, TRAIN_PROG ": --metrics: writing %s failed: %s\n", j->o->metrics,
            strerror(err));
    return -1;
}
