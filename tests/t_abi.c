/* SPDX-License-Identifier: MIT */
/*
 * t_abi.c: the ABI policy of the options structs (docs/design.md, "ABI policy").
 *
 * Every public struct with an _init function starts with `size_t size`, which its _init stores
 * (the macro passes sizeof as this program was compiled). Consumers refuse a size of 0 (a struct
 * made by a designated initialiser or memset), one below the first layout and one too large to be
 * any layout, with FSDP_EINVAL naming the function, the struct and its _init; a larger size is
 * FSDP_ENOTSUP unless the bytes past this library's layout are zero. A program built against an
 * older, smaller layout is simulated twice: with the real structs at the size where the first
 * layout ends, and with a toy pair of layouts run through the library's own helpers, where the
 * newer one has a field the older caller lacks.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <fsdp.h>

#include "internal.h"
#include "tap.h"

/* _init stores sizeof: every options struct of the public headers. */
#define CHECK_INIT(T, init)                                                                        \
    do {                                                                                           \
        _Static_assert(offsetof(T, size) == 0, #T " starts with its size");                        \
        T o_;                                                                                      \
        memset(&o_, 0xa5, sizeof o_);                                                              \
        init(&o_);                                                                                 \
        tap_is_size(o_.size, sizeof o_, #init " sets size to sizeof(" #T ")");                     \
    } while (0)

static void every_init(void) {
    CHECK_INIT(fsdp_ctx_options_t, fsdp_ctx_options_init);
    CHECK_INIT(fsdp_trace_options_t, fsdp_trace_options_init);
    CHECK_INIT(fsdp_device_options_t, fsdp_device_options_init);
    CHECK_INIT(fsdp_transformer_config_t, fsdp_transformer_config_init);
    CHECK_INIT(fsdp_gpt_config_t, fsdp_gpt_config_init);
    CHECK_INIT(fsdp_bert_config_t, fsdp_bert_config_init);
    CHECK_INIT(fsdp_sgd_options_t, fsdp_sgd_options_init);
    CHECK_INIT(fsdp_adam_options_t, fsdp_adam_options_init);
    CHECK_INIT(fsdp_adam_options_t, fsdp_adamw_options_init);
    CHECK_INIT(fsdp_adam_options_t, fsdp_gpt_recipe_adamw_options_init);
    CHECK_INIT(fsdp_loader_options_t, fsdp_loader_options_init);
    CHECK_INIT(fsdp_calibrate_options_t, fsdp_calibrate_options_init);
    CHECK_INIT(fsdp_sim_options_t, fsdp_sim_options_init);
    CHECK_INIT(fsdp_gloo_options_t, fsdp_gloo_options_init);
    CHECK_INIT(fsdp_nccl_options_t, fsdp_nccl_options_init);
    CHECK_INIT(fsdp_init_options_t, fsdp_init_options_init);
    CHECK_INIT(fsdp_ddp_options_t, fsdp_ddp_options_init);
    CHECK_INIT(fsdp_mixed_precision_t, fsdp_mixed_precision_init);
    CHECK_INIT(fsdp_options_t, fsdp_options_init);
    CHECK_INIT(fsdp_summon_options_t, fsdp_summon_options_init);
    CHECK_INIT(fsdp_full_state_dict_options_t, fsdp_full_state_dict_options_init);
    CHECK_INIT(fsdp_unit_overrides_t, fsdp_unit_overrides_init);
    CHECK_INIT(fsdp_size_policy_options_t, fsdp_size_policy_options_init);
    CHECK_INIT(fsdp_wrap_plan_options_t, fsdp_wrap_plan_options_init);
    CHECK_INIT(fsdp_grad_scaler_options_t, fsdp_grad_scaler_options_init);

    /* The structs inside others are initialised with them. */
    fsdp_options_t o;
    memset(&o, 0, sizeof o);
    fsdp_options_init(&o);
    tap_is_size(o.mixed_precision.size, sizeof o.mixed_precision,
                "fsdp_options_init initialises the mixed precision inside");
    fsdp_unit_overrides_t ov;
    memset(&ov, 0, sizeof ov);
    fsdp_unit_overrides_init(&ov);
    tap_is_size(ov.mixed_precision.size, sizeof ov.mixed_precision,
                "fsdp_unit_overrides_init initialises the mixed precision inside");
}

/* The last error of ctx holds every one of the NULL-terminated needles. */
static void has_all(fsdp_ctx_t *ctx, const char *what, const char *const *needles) {
    const char *err = fsdp_ctx_last_error(ctx);
    for (const char *const *n = needles; *n; n++)
        tap_has_str(err, *n, "%s: the message names '%s'", what, *n);
}

static void fill_gpt(fsdp_gpt_config_t *c) {
    c->vocab = 11;
    c->max_seq = 8;
    c->n_layer = 1;
    c->n_head = 2;
    c->d_model = 8;
}

static int no_rank(fsdp_ctx_t *ctx, void *arg) {
    (void)ctx, (void)arg;
    return 0;
}

/* Sizes that are no layout: 0, below the first layout, absurd. */
static void refused(fsdp_ctx_t *ctx) {
    fsdp_module_t *m = NULL;

    fsdp_gpt_config_t z = {.vocab = 11, .max_seq = 8, .n_layer = 1, .n_head = 2, .d_model = 8};
    tap_is_int(fsdp_gpt_create(ctx, &z, &m), FSDP_EINVAL,
               "fsdp_gpt_create refuses a config made by a designated initialiser");
    has_all(ctx, "size 0",
            (const char *const[]){"fsdp_gpt_create", "cfg->size is 0", "fsdp_gpt_config_t",
                                  "fsdp_gpt_config_init", NULL});
    tap_ok(m == NULL, "no model was made");

    fsdp_sgd_options_t s;
    memset(&s, 0x5a, sizeof s);
    (fsdp_sgd_options_init)(&s, 12);
    tap_is_size(s.size, 12, "an _init given a size below the first layout stores it");
    tap_is_int(((const unsigned char *)&s)[12], 0x5a, "and writes nothing past it");
    fsdp_optim_t *opt = NULL;
    tap_is_int(fsdp_optim_sgd_create(ctx, &s, &opt), FSDP_EINVAL,
               "fsdp_optim_sgd_create refuses size 12");
    char want[128];
    snprintf(want, sizeof want, "smaller than the %zu bytes of the first fsdp_sgd_options_t layout",
             offsetof(fsdp_sgd_options_t, nesterov) + sizeof s.nesterov);
    has_all(ctx, "size 12",
            (const char *const[]){"fsdp_optim_sgd_create", "opts->size is 12", want,
                                  "fsdp_sgd_options_init", NULL});

    fsdp_grad_scaler_options_t g;
    fsdp_grad_scaler_options_init(&g);
    g.size = (size_t)1 << 40;
    fsdp_grad_scaler_t *gs = NULL;
    tap_is_int(fsdp_grad_scaler_create(ctx, &g, &gs), FSDP_EINVAL,
               "fsdp_grad_scaler_create refuses a size no layout has (an uninitialised struct)");
    has_all(ctx, "absurd size",
            (const char *const[]){"not the size of any fsdp_grad_scaler_options_t",
                                  "fsdp_grad_scaler_options_init", NULL});

    fsdp_device_options_t d;
    memset(&d, 0, sizeof d);
    fsdp_device_t *dev = NULL;
    tap_is_int(fsdp_device_create(ctx, FSDP_DEVICE_CPU, &d, &dev), FSDP_EINVAL,
               "fsdp_device_create refuses a memset struct");
    has_all(ctx, "device", (const char *const[]){"fsdp_device_options_init", NULL});

    fsdp_transformer_config_t t;
    memset(&t, 0, sizeof t);
    tap_is_int(fsdp_transformer_create(ctx, &t, &m), FSDP_EINVAL,
               "fsdp_transformer_create refuses size 0");
    fsdp_bert_config_t b;
    memset(&b, 0, sizeof b);
    tap_is_int(fsdp_bert_config_check(ctx, &b), FSDP_EINVAL,
               "fsdp_bert_config_check refuses size 0");
    has_all(ctx, "bert", (const char *const[]){"fsdp_bert_config_t", NULL});

    /* Consumers without a context (the message is logged). */
    fsdp_ctx_options_t co;
    memset(&co, 0, sizeof co);
    co.world_size = 1;
    fsdp_ctx_t *c2 = NULL;
    tap_is_int(fsdp_ctx_create(&co, &c2), FSDP_EINVAL, "fsdp_ctx_create refuses size 0");
    fsdp_trace_options_t tr;
    memset(&tr, 0, sizeof tr);
    fsdp_trace_t *trace = NULL;
    tap_is_int(fsdp_trace_create(&tr, &trace), FSDP_EINVAL, "fsdp_trace_create refuses size 0");
    fsdp_sim_options_t so;
    memset(&so, 0, sizeof so);
    so.world_size = 1;
    tap_is_int(fsdp_sim_run(&so, no_rank, NULL, NULL), FSDP_EINVAL, "fsdp_sim_run refuses size 0");
    fsdp_init_options_t io;
    memset(&io, 0, sizeof io);
    char msg[512];
    tap_is_int(fsdp_init_from_env(&io, &c2, msg, sizeof msg), FSDP_EINVAL,
               "fsdp_init_from_env refuses size 0");
    tap_has_str(msg, "fsdp_init_options_t", "its message buffer names the struct");
}

/* The mixed precision inside fsdp_options_t is part of its layout. */
static void embedded(fsdp_ctx_t *ctx) {
    fsdp_module_t *m = NULL;
    if (fsdp_linear_create(ctx, 4, 4, true, &m) < 0)
        tap_bail("linear: %s", fsdp_ctx_last_error(ctx));
    fsdp_options_t o;
    fsdp_options_init(&o);
    memset(&o.mixed_precision, 0, sizeof o.mixed_precision);
    o.mixed_precision.enabled = true;
    fsdp_unit_t *u = NULL;
    tap_is_int(fsdp_wrap(m, &o, &u), FSDP_EINVAL,
               "fsdp_wrap refuses a mixed precision that was not initialised");
    has_all(ctx, "embedded",
            (const char *const[]){"fsdp_wrap", "o->mixed_precision.size is 0",
                                  "fsdp_mixed_precision_init", "fsdp_options_init", NULL});
    fsdp_options_t none;
    memset(&none, 0, sizeof none);
    tap_is_int(fsdp_wrap(m, &none, &u), FSDP_EINVAL, "fsdp_wrap refuses options of size 0");
    has_all(ctx, "options",
            (const char *const[]){"o->size is 0", "fsdp_options_t", "fsdp_options_init", NULL});

    /* fsdp_policy_decide learns the size of the caller's overrides from them. */
    fsdp_policy_t *p = NULL;
    if (fsdp_policy_always_create(&p) < 0) tap_bail("policy");
    fsdp_unit_overrides_t ov;
    memset(&ov, 0, sizeof ov);
    tap_is_int(fsdp_policy_decide(p, m, false, 0, &ov), FSDP_EINVAL,
               "fsdp_policy_decide refuses overrides that were not initialised");
    has_all(ctx, "decide",
            (const char *const[]){"ov->size is 0", "fsdp_unit_overrides_init", NULL});
    fsdp_unit_overrides_init(&ov);
    ov.has_strategy = true;
    tap_is_int(fsdp_policy_decide(p, m, false, 0, &ov), 1, "it decides with initialised ones");
    tap_ok(!ov.has_strategy && ov.size == sizeof ov, "and fills them, keeping their size");
    fsdp_policy_release(p);
    fsdp_module_release(m);
}

/* Functions that fill a caller's struct take its size from the macro. */
static void filled(fsdp_ctx_t *ctx) {
    fsdp_sgd_options_t s;
    fsdp_sgd_options_init(&s);
    s.lr = 0.25;
    fsdp_optim_t *opt = NULL;
    if (fsdp_optim_sgd_create(ctx, &s, &opt) < 0) tap_bail("sgd: %s", fsdp_ctx_last_error(ctx));
    fsdp_sgd_options_t got;
    memset(&got, 0xa5, sizeof got);
    tap_is_int(fsdp_optim_get_options(opt, -1, &got), FSDP_OK, "get_options fills a struct");
    tap_ok(got.size == sizeof got && got.kind == FSDP_OPTIM_SGD && got.lr == 0.25,
           "with its size, kind and values");
    struct big_sgd {
        fsdp_sgd_options_t s;
        unsigned char extra[16];
    } big;
    memset(&big, 0xa5, sizeof big);
    tap_is_int((fsdp_optim_get_options)(opt, -1, &big.s, sizeof big), FSDP_OK,
               "a newer caller's larger struct is filled");
    static const unsigned char zeros[16];
    tap_ok(big.s.size == sizeof big && memcmp(big.extra, zeros, sizeof zeros) == 0,
           "its size kept, the bytes this library does not know zeroed");
    tap_is_int((fsdp_optim_get_options)(opt, -1, &got, 8), FSDP_EINVAL,
               "a size below the first layout is refused");
    tap_is_int(fsdp_optim_set_options(opt, -1, &big.s), FSDP_OK,
               "the larger struct with a zero tail is accepted back");
    big.extra[3] = 1;
    tap_is_int(fsdp_optim_set_options(opt, -1, &big.s), FSDP_ENOTSUP,
               "with a byte set past this library's layout it is FSDP_ENOTSUP");
    char want[64];
    snprintf(want, sizeof want, "byte %zu past them", offsetof(struct big_sgd, extra) + 3);
    has_all(ctx, "tail",
            (const char *const[]){"fsdp_optim_set_options", "fsdp_sgd_options_t", want, NULL});
    fsdp_optim_destroy(opt);

    fsdp_options_t root;
    fsdp_options_init(&root);
    fsdp_unit_overrides_t ov;
    fsdp_unit_overrides_init(&ov);
    ov.has_limit_all_gathers = true;
    ov.limit_all_gathers = 5;
    fsdp_options_t out;
    memset(&out, 0xa5, sizeof out);
    tap_is_int(fsdp_unit_overrides_apply(&root, &ov, &out), FSDP_OK, "overrides_apply fills out");
    tap_ok(out.size == sizeof out && out.limit_all_gathers == 5 &&
               out.mixed_precision.size == sizeof out.mixed_precision,
           "with its size, the override and the initialised mixed precision");
    tap_is_int((fsdp_unit_overrides_apply)(&root, &ov, &out, 8), FSDP_EINVAL,
               "an out size below the first layout is refused");
    ov.has_mixed_precision = true;
    ov.mixed_precision.size = 0;
    tap_is_int(fsdp_unit_overrides_apply(&root, &ov, &out), FSDP_EINVAL,
               "a set mixed-precision override must have been initialised");
}

/* A caller built against an older or a newer layout of real structs. */
static void real_layouts(fsdp_ctx_t *ctx) {
    /* Older: the size where the first layout ends (before any trailing padding). */
    union {
        fsdp_ctx_options_t o;
        unsigned char b[sizeof(fsdp_ctx_options_t) + 16];
    } u;
    const size_t v1 = offsetof(fsdp_ctx_options_t, log_level) + sizeof u.o.log_level;
    memset(&u, 0x5a, sizeof u);
    (fsdp_ctx_options_init)(&u.o, v1);
    tap_ok(u.o.size == v1 && u.o.world_size == 1 && u.o.log_level == -1,
           "fsdp_ctx_options_init at the first layout's end (%zu bytes) sets the defaults", v1);
    bool untouched = true;
    for (size_t i = v1; i < sizeof u.b; i++)
        untouched = untouched && u.b[i] == 0x5a;
    tap_ok(untouched, "and writes nothing past the caller's size");
    fsdp_ctx_t *c2 = NULL;
    tap_is_int(fsdp_ctx_create(&u.o, &c2), FSDP_OK, "fsdp_ctx_create takes it");
    fsdp_ctx_destroy(c2);

    fsdp_loader_options_t lo;
    (fsdp_loader_options_init)(&lo, offsetof(fsdp_loader_options_t, seed) + sizeof lo.seed);
    tap_ok(lo.batch_size == 8 && lo.world_size == 1, "so does fsdp_loader_options_init");

    /* Newer: a larger struct whose tail this library does not know. */
    struct {
        fsdp_gpt_config_t c;
        unsigned char extra[16];
    } big;
    memset(&big, 0x5a, sizeof big);
    (fsdp_gpt_config_init)(&big.c, sizeof big);
    static const unsigned char zeros[16];
    tap_ok(big.c.size == sizeof big && memcmp(big.extra, zeros, sizeof zeros) == 0,
           "fsdp_gpt_config_init of a larger struct zeroes the tail it does not know");
    fill_gpt(&big.c);
    fsdp_module_t *m = NULL;
    tap_is_int(fsdp_gpt_create(ctx, &big.c, &m), FSDP_OK,
               "fsdp_gpt_create takes a larger config whose tail is zero");
    const fsdp_gpt_config_t *kept = fsdp_gpt_get_config(m);
    tap_ok(kept && kept->size == sizeof *kept && kept->d_model == 8,
           "the model's copy has this library's size and the caller's values");
    fsdp_module_release(m);
    m = NULL;
    big.extra[5] = 1;
    tap_is_int(fsdp_gpt_create(ctx, &big.c, &m), FSDP_ENOTSUP,
               "and refuses it with FSDP_ENOTSUP when a byte of the tail is set");
    char want[64];
    snprintf(want, sizeof want, "cfg->size is %zu", sizeof big);
    has_all(ctx, "newer",
            (const char *const[]){"fsdp_gpt_create", want, "fsdp_gpt_config_t", NULL});
}

/* A pair of layouts of one struct: the first, and one with a field appended. */
typedef struct toy_v1 {
    size_t size;
    int32_t a;
    double b;
} toy_v1_t;
typedef struct toy_v2 {
    size_t size;
    int32_t a;
    double b;
    int32_t c; /* appended; default 7 */
} toy_v2_t;
static const fsdp__abi_struct_t toy_v1_abi = FSDP__ABI_STRUCT(toy_v1_t, "toy_init", b);
static const fsdp__abi_struct_t toy_v2_abi = FSDP__ABI_STRUCT(toy_v2_t, "toy_init", b);

/* toy_init as the library of each layout has it. */
static void toy_init_v1(void *o, size_t size) {
    toy_v1_t d;
    memset(&d, 0, sizeof d);
    d.a = 1;
    d.b = 2.5;
    fsdp__abi_init(o, size, &d, &toy_v1_abi);
}
static void toy_init_v2(void *o, size_t size) {
    toy_v2_t d;
    memset(&d, 0, sizeof d);
    d.a = 1;
    d.b = 2.5;
    d.c = 7;
    fsdp__abi_init(o, size, &d, &toy_v2_abi);
}

static void toy_layouts(void) {
    char buf[FSDP_ERR_LEN];
    /* An older caller of a newer library. */
    union {
        toy_v1_t v;
        unsigned char b[sizeof(toy_v2_t) + 8];
    } u;
    memset(&u, 0x5a, sizeof u);
    toy_init_v2(&u.v, sizeof u.v);
    tap_ok(u.v.size == sizeof(toy_v1_t) && u.v.a == 1 && u.v.b == 2.5,
           "toy: the newer library initialises an older caller's struct");
    tap_is_int(u.b[sizeof(toy_v1_t)], 0x5a, "toy: and writes nothing past it");
    tap_is_int(fsdp__abi_check_buf(buf, "toy_use", "o", &u.v, &toy_v2_abi), FSDP_OK,
               "toy: the newer library takes the older layout");
    const toy_v2_t *as_new = (const void *)u.b;
    tap_ok(!FSDP__ABI_HAS(toy_v2_t, as_new, c) && FSDP__ABI_HAS(toy_v2_t, as_new, b),
           "toy: FSDP__ABI_HAS says the older layout lacks the appended field");
    toy_v2_t lib;
    toy_init_v2(&lib, sizeof lib);
    u.v.a = 5;
    fsdp__abi_copy_in(&lib, &u.v, &toy_v2_abi);
    tap_ok(lib.a == 5 && lib.b == 2.5 && lib.c == 7 && lib.size == sizeof lib,
           "toy: its copy has the caller's fields and the default of the one it lacks");
    u.v.size = sizeof(toy_v1_t) - 4;
    tap_is_int(fsdp__abi_check_buf(buf, "toy_use", "o", &u.v, &toy_v2_abi), FSDP_EINVAL,
               "toy: a size below the first layout is refused");

    /* A newer caller of an older library. */
    toy_v2_t n;
    memset(&n, 0x5a, sizeof n);
    toy_init_v1(&n, sizeof n);
    tap_ok(n.size == sizeof n && n.a == 1 && n.c == 0,
           "toy: the older library zeroes the field it does not know");
    tap_is_int(fsdp__abi_check_buf(buf, "toy_use", "o", &n, &toy_v1_abi), FSDP_OK,
               "toy: the older library takes the newer layout while the new field is zero");
    n.c = 3;
    tap_is_int(fsdp__abi_check_buf(buf, "toy_use", "o", &n, &toy_v1_abi), FSDP_ENOTSUP,
               "toy: and refuses it once the new field is set");
    char want[64];
    snprintf(want, sizeof want, "byte %zu past them", offsetof(toy_v2_t, c));
    tap_has_str(buf, want, "toy: the message names the first byte set");
}

int main(void) {
    tap_plan_lazy();
    every_init();
    fsdp_ctx_t *ctx = NULL;
    if (fsdp_ctx_create(NULL, &ctx) < 0) tap_bail("context");
    refused(ctx);
    embedded(ctx);
    filled(ctx);
    real_layouts(ctx);
    toy_layouts();
    fsdp_ctx_destroy(ctx);
    return tap_done();
}
