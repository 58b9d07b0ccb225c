/*
 * optim_impl.h: gradient-norm helpers shared by fsdp_clip_grad_norm (plain parameters) and FSDP's
 * clip over shards, so that both compute the same local quantities the same way.
 */
#ifndef FSDP_OPTIM_IMPL_H
#define FSDP_OPTIM_IMPL_H

#include <fsdp/tensor.h>

/* The local part of a p-norm of g: sum of |g_i|^p for finite p, max |g_i| for p = +inf (0 for
 * an empty tensor), computed on g's device in g's compute dtype. */
int fsdp__grad_norm_part(fsdp_tensor_t *g, double p, double *out);

/* Combines parts: the norm from an accumulated sum (finite p) or max (inf). */
double fsdp__grad_norm_finish(double acc, double p);

/* The clip coefficient PyTorch uses: max_norm / (total + 1e-6), clamped to at most 1. */
double fsdp__clip_coef(double max_norm, double total);

/* g *= coef in place. */
int fsdp__grad_scale(fsdp_tensor_t *g, double coef);

#endif /* FSDP_OPTIM_IMPL_H */
