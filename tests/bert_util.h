/* SPDX-License-Identifier: MIT */
/*
 * bert_util.h: what the BERT tests share (t_bert.c: the model against PyTorch; t_bert_props.c:
 * configuration, dropout, initialisation, the model without a pooler). G is tests/golden/bert.bin
 * (tests/golden/gen_bert.py: Hugging Face's BertForMaskedLM in plain torch), CTX the context every
 * tensor is made on; both are set by bert_util_open and freed by bert_util_close. Tensors
 * returned are new references.
 */
#ifndef FSDP_TEST_BERT_UTIL_H
#define FSDP_TEST_BERT_UTIL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <fsdp/autograd.h>
#include <fsdp/bert.h>
#include <fsdp/context.h>
#include <fsdp/errno.h>
#include <fsdp/nn.h>
#include <fsdp/rng.h>
#include <fsdp/tensor.h>

#include "golden.h"

#ifndef GOLDEN_DIR
#define GOLDEN_DIR "tests/golden"
#endif

/* The spec's fp32 tolerance. */
#define RTOL 1.3e-6
#define ATOL 1e-5

extern golden_t *G;
extern fsdp_ctx_t *CTX;

/* Loads G and creates CTX: 0, or GOLDEN_ENOENT / another negative code with msg saying why. */
int bert_util_open(char *msg, size_t len);
void bert_util_close(void);

/* The record "bert/<key>" (NULL when absent), and it as a tensor on CTX. */
const golden_rec_t *rec(const char *key);
fsdp_tensor_t *gtensor(const char *key);
/* The golden model's configuration (with the pooler). */
void golden_config(fsdp_bert_config_t *c);
/* The golden state dict ("bert/init/<key>" records in file order) as an owned list. */
int golden_state_dict(fsdp_named_list_t *sd);
/* The model of cfg on CTX with PyTorch's weights (strict load unless !strict). */
int build_loaded(const fsdp_bert_config_t *cfg, bool strict, fsdp_module_t **m);
/* A host copy of t's elements as floats (NULL on failure); *n receives the count. */
float *host_f32(const fsdp_tensor_t *t, size_t *n);
/* Whether elements [from, to) of a and b, or all of them, are bitwise equal (f32). */
bool same_range(const fsdp_tensor_t *a, const fsdp_tensor_t *b, size_t from, size_t to);
bool same_all(const fsdp_tensor_t *a, const fsdp_tensor_t *b);
/* The golden input_ids with element (b, s) set to v; the golden mask converted to dt. */
fsdp_tensor_t *ids_with(int64_t b, int64_t s, int64_t v);
fsdp_tensor_t *mask_as(fsdp_dtype_t dt);

/* The golden inputs. */
typedef struct inputs {
    fsdp_tensor_t *ids, *types, *mask, *labels, *gpooled;
} inputs_t;
int inputs_load(inputs_t *in);
void inputs_free(inputs_t *in);

#ifdef FSDP_TAP_H
/* These print through tap.h, whose counters are per translation unit: they are compiled into
 * each test program's own. */

/* The error of a failed call as a TAP comment. */
static inline void diag_err(int rc) {
    tap_diag("%s: %s", fsdp_strerror(rc), fsdp_ctx_last_error(CTX));
}

/* Logits of m (NULL on failure, with a diagnostic). */
static inline fsdp_tensor_t *logits_of(fsdp_module_t *m, fsdp_tensor_t *ids, fsdp_tensor_t *mask,
                                       fsdp_tensor_t *types, fsdp_tensor_t **pooled) {
    fsdp_tensor_t *lg = NULL;
    int rc = fsdp_bert_forward(m, ids, mask, types, &lg, pooled);
    if (rc < 0) diag_err(rc);
    return lg;
}

/* A check that rc is FSDP_EINVAL with no output and a message naming needle. */
static inline void expect_einval(int rc, fsdp_tensor_t *out, const char *needle, const char *what) {
    const char *msg = fsdp_ctx_last_error(CTX);
    tap_ok_why(rc == FSDP_EINVAL && !out && strstr(msg, needle), msg,
               "%s: FSDP_EINVAL naming %s, no output", what, needle);
}
#endif

#endif /* FSDP_TEST_BERT_UTIL_H */
