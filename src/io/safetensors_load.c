/* SPDX-License-Identifier: MIT */
/*
 * safetensors_load.c: loading a file's tensors into named lists and modules.
 *
 * A load matches names first, checks every match (shape, dtype, NULL tensors), and writes only
 * when nothing is wrong, so a refused load leaves the destination untouched. Matching goes
 * through an optional map from file names to destination names (the Hugging Face GPT-2 layout
 * uses one), over a sorted index, so a file of n tensors loads in O(n log n) comparisons.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "io/io_impl.h"

/* ---- a growing string for reports ---------------------------------------------------------- */


/* ---- helpers ------------------------------------------------------------------------------- */

bool fsdp__st_same_view(const fsdp_tensor_t *a, const fsdp_tensor_t *b) {
    if (!a || !b) return false;
    if (a == b) return true;
    int nd = fsdp_tensor_ndim(a);
    return fsdp_tensor_same_storage(a, b) &&
           fsdp_tensor_storage_offset(a) == fsdp_tensor_storage_offset(b) &&
           nd == fsdp_tensor_ndim(b) &&
           memcmp(fsdp_tensor_shape(a), fsdp_tensor_shape(b), sizeof(int64_t) * (size_t)nd) == 0 &&
           memcmp(fsdp_tensor_strides(a), fsdp_tensor_strides(b), sizeof(int64_t) * (size_t)nd) ==
               0;
}

/* Whether dst has e's shape, or its transpose when transpose. */
static bool shape_fits(const fsdp_tensor_t *dst, const struct fsdp__st_entry *e, bool transpose) {
    int nd = fsdp_tensor_ndim(dst);
    const int64_t *s = fsdp_tensor_shape(dst);
    if (nd != e->ndim) return false;
    if (transpose) return nd == 2 && s[0] == e->shape[1] && s[1] == e->shape[0];
    for (int d = 0; d < nd; d++)
        if (s[d] != e->shape[d]) return false;
    return true;
}

static const char *shape_str(const int64_t *shape, int nd, char *buf, size_t cap) {
    size_t o = (size_t)snprintf(buf, cap, "[");
    for (int d = 0; d < nd && o < cap; d++)
        o += (size_t)snprintf(buf + o, cap - o, "%s%lld", d ? ", " : "", (long long)shape[d]);
    if (o < cap) snprintf(buf + o, cap - o, "]");
    return buf;
}

/* Sorting file entries by their mapped names; qsort has no argument, so each item carries its
 * name. */
struct mapped {
    const char *name; /* destination name (NULL: skipped) */
    size_t j;         /* file entry */
};

static int cmp_mapped(const void *a, const void *b) {
    const struct mapped *x = a, *y = b;
    int c = strcmp(x->name, y->name);
    if (c) return c;
    return x->j < y->j ? -1 : x->j > y->j;
}

static long find_mapped(const struct mapped *m, size_t n, const char *name) {
    size_t lo = 0, hi = n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        int c = strcmp(m[mid].name, name);
        if (c == 0) return (long)mid;
        if (c < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    return -1;
}

/* ---- the mapped load ----------------------------------------------------------------------- */

int fsdp__st_load_mapped(fsdp_safetensors_t *st, const fsdp_named_list_t *dst, bool strict,
                         fsdp__st_map_fn map, void *arg, const char *fn) {
    if (!st) return FSDP_EINVAL;
    if (!dst || (dst->n > 0 && (!dst->names || !dst->tensors)))
        return fsdp__st_err(st, FSDP_EINVAL,
                            "%s: the destination list is NULL or has no "
                            "names/tensors",
                            fn);
    int rc = FSDP_OK;
    size_t nf = st->n, nm = 0;
    char **owned = calloc(nf ? nf : 1, sizeof *owned); /* mapped names, when map is set */
    bool *tr = calloc(nf ? nf : 1, sizeof *tr);        /* transpose, per file entry */
    bool *used = calloc(nf ? nf : 1, sizeof *used);    /* per file entry */
    bool *skipped = calloc(nf ? nf : 1, sizeof *skipped);
    struct mapped *idx = calloc(nf ? nf : 1, sizeof *idx);
    long *match = calloc(dst->n ? dst->n : 1, sizeof *match); /* dst entry -> file entry */
    fsdp__sbuf_t missing = {0}, unexpected = {0}, bad = {0};
    size_t nmissing = 0, nunexpected = 0, nbad = 0;
    char a[224], b[224], c[256], d[160];
    if (!owned || !tr || !used || !skipped || !idx || !match) {
        rc = fsdp__st_err(st, FSDP_ENOMEM, "%s: out of memory", fn);
        goto out;
    }
    /* Map the file's names. */
    for (size_t j = 0; j < nf; j++) {
        const char *name = st->e[j].name;
        if (map) {
            /* A map adds at most a short prefix, so this always fits. */
            size_t cap = strlen(name) + 64;
            char *buf = malloc(cap);
            if (!buf) {
                rc = fsdp__st_err(st, FSDP_ENOMEM, "%s: out of memory", fn);
                goto out;
            }
            int r = map(name, arg, buf, cap, &tr[j]);
            if (r != 0) free(buf);
            if (r < 0) {
                rc = fsdp__st_err(st, r, "%s: '%s': tensor '%s': its name cannot be mapped", fn,
                                  st->path, fsdp__st_shown(name, a, sizeof a));
                goto out;
            }
            if (r == 1) {
                skipped[j] = true;
                continue;
            }
            owned[j] = buf;
            name = buf;
        }
        idx[nm].name = name;
        idx[nm].j = j;
        nm++;
    }
    qsort(idx, nm, sizeof *idx, cmp_mapped);
    for (size_t k = 1; k < nm; k++)
        if (strcmp(idx[k - 1].name, idx[k].name) == 0) {
            rc = fsdp__st_err(st, FSDP_EINVAL, "%s: '%s': tensors '%s' and '%s' both load '%s'", fn,
                              st->path, fsdp__st_shown(st->e[idx[k - 1].j].name, a, sizeof a),
                              fsdp__st_shown(st->e[idx[k].j].name, b, sizeof b),
                              fsdp__st_shown(idx[k].name, c, sizeof c));
            goto out;
        }
    /* Match the destination's names and check each match. */
    for (size_t i = 0; i < dst->n; i++) {
        match[i] = -1;
        if (!dst->names[i]) {
            fsdp__sb_add(&bad, "%sdestination entry %zu has a NULL name", nbad++ ? "; " : "", i);
            continue;
        }
        long k = find_mapped(idx, nm, dst->names[i]);
        if (k < 0) continue;
        size_t j = idx[k].j;
        const struct fsdp__st_entry *e = &st->e[j];
        match[i] = (long)j;
        used[j] = true;
        const fsdp_tensor_t *t = dst->tensors[i];
        fsdp__st_shown(dst->names[i], a, sizeof a);
        if (!t)
            fsdp__sb_add(&bad, "%s\"%s\" (the destination tensor is NULL)", nbad++ ? "; " : "", a);
        else if (e->dtype == FSDP_DTYPE_COUNT)
            fsdp__sb_add(&bad, "%s\"%s\" (dtype %s cannot be converted)", nbad++ ? "; " : "", a,
                   e->st_dtype);
        else if (!shape_fits(t, e, tr[j]))
            fsdp__sb_add(&bad, "%s\"%s\" (file %s %s%s, destination %s)", nbad++ ? "; " : "", a,
                   e->st_dtype, shape_str(e->shape, e->ndim, c, sizeof c),
                   tr[j] ? ", stored transposed" : "", fsdp_tensor_describe(t, d, sizeof d));
    }
    /* Missing: unmatched destination names, unless they view the elements of a matched one. */
    for (size_t i = 0; i < dst->n; i++) {
        if (match[i] >= 0 || !dst->names[i]) continue;
        bool alias = false;
        for (size_t k = 0; k < dst->n && !alias; k++)
            alias = match[k] >= 0 && fsdp__st_same_view(dst->tensors[i], dst->tensors[k]);
        if (alias) continue;
        fsdp__sb_add(&missing, "%s\"%s\"", nmissing++ ? ", " : "",
               fsdp__st_shown(dst->names[i], a, sizeof a));
    }
    for (size_t j = 0; j < nf; j++) {
        if (used[j] || skipped[j]) continue;
        fsdp__sb_add(&unexpected, "%s\"%s\"", nunexpected++ ? ", " : "",
               fsdp__st_shown(st->e[j].name, a, sizeof a));
    }
    if (missing.oom || unexpected.oom || bad.oom) {
        rc = fsdp__st_err(st, FSDP_ENOMEM, "%s: out of memory", fn);
        goto out;
    }
    if (nbad || (strict && (nmissing || nunexpected))) {
        rc = fsdp__st_err(st, FSDP_EINVAL,
                          "%s: '%s' (%s; nothing loaded): %zu missing, %zu unexpected, %zu "
                          "mismatched; missing: %s; unexpected: %s; mismatched: %s",
                          fn, st->path, strict ? "strict" : "not strict", nmissing, nunexpected,
                          nbad, nmissing ? fsdp__sb_str(&missing) : "none",
                          nunexpected ? fsdp__sb_str(&unexpected) : "none", nbad ? fsdp__sb_str(&bad) : "none");
        goto out;
    }
    for (size_t i = 0; i < dst->n; i++) {
        if (match[i] < 0) continue;
        FSDP_TRY(rc, out, fsdp__st_read_into(st, &st->e[match[i]], dst->tensors[i], tr[match[i]]));
    }
    if (nmissing || nunexpected)
        fsdp__st_err(st, FSDP_OK,
                     "%s: '%s' loaded (not strict): %zu missing, %zu unexpected; missing: %s; "
                     "unexpected: %s",
                     fn, st->path, nmissing, nunexpected, nmissing ? fsdp__sb_str(&missing) : "none",
                     nunexpected ? fsdp__sb_str(&unexpected) : "none");
    rc = FSDP_OK;
out:
    for (size_t j = 0; owned && j < nf; j++)
        free(owned[j]);
    free(owned);
    free(tr);
    free(used);
    free(skipped);
    free(idx);
    free(match);
    free(missing.s);
    free(unexpected.s);
    free(bad.s);
    return rc;
}

int fsdp_safetensors_load_into(fsdp_safetensors_t *st, const fsdp_named_list_t *dst, bool strict) {
    return fsdp__st_load_mapped(st, dst, strict, NULL, NULL, "fsdp_safetensors_load_into");
}

int fsdp_safetensors_load_module(fsdp_safetensors_t *st, fsdp_module_t *m, bool strict) {
    static const char fn[] = "fsdp_safetensors_load_module";
    if (!st) return FSDP_EINVAL;
    if (!m) return fsdp__st_err(st, FSDP_EINVAL, "%s: the module is NULL", fn);
    fsdp_named_list_t sd;
    int rc = fsdp_module_state_dict(m, &sd);
    if (rc < 0) return fsdp__st_err(st, rc, "%s: %s", fn, fsdp_ctx_last_error(fsdp_module_ctx(m)));
    rc = fsdp__st_load_mapped(st, &sd, strict, NULL, NULL, fn);
    fsdp_named_list_free(&sd);
    return rc;
}

int fsdp_safetensors_load_all(fsdp_safetensors_t *st, fsdp_named_list_t *out) {
    static const char fn[] = "fsdp_safetensors_load_all";
    if (out) memset(out, 0, sizeof *out);
    if (!st) return FSDP_EINVAL;
    if (!out) return fsdp__st_err(st, FSDP_EINVAL, "%s: out is NULL", fn);
    int rc = FSDP_OK;
    size_t n = st->n ? st->n : 1;
    out->owned = true;
    out->names = calloc(n, sizeof *out->names);
    out->tensors = calloc(n, sizeof *out->tensors);
    out->modules = calloc(n, sizeof *out->modules);
    if (!out->names || !out->tensors || !out->modules) {
        rc = fsdp__st_err(st, FSDP_ENOMEM, "%s: out of memory", fn);
        goto fail;
    }
    for (size_t i = 0; i < st->n; i++) {
        fsdp_tensor_t *t = NULL;
        FSDP_TRY(rc, fail, fsdp_safetensors_load_tensor(st, st->e[i].name, &t));
        out->names[i] = strdup(st->e[i].name);
        out->tensors[i] = t;
        out->n = i + 1;
        if (!out->names[i]) {
            rc = fsdp__st_err(st, FSDP_ENOMEM, "%s: out of memory", fn);
            goto fail;
        }
    }
    return FSDP_OK;
fail:
    fsdp_named_list_free(out);
    return rc;
}
