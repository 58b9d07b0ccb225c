/* SPDX-License-Identifier: MIT */
/*
 * ops_attention.h: scaled dot-product attention over the heads of a packed projection as one
 * differentiable operation, on devices with a fused kernel (device_impl.h, `attention`). The nn
 * layer's GPT attention calls it where fsdp__attention_packed_ok says it may, and composes the
 * same attention from views and fsdp_attention where not; both give the same values, bit for
 * bit where the mask removes nothing from the products (cpu_attention.c says where not).
 */
#ifndef FSDP_OPS_ATTENTION_H
#define FSDP_OPS_ATTENTION_H

#include <stdbool.h>
#include <stdint.h>

#include <fsdp/tensor.h>

/*
 * Whether fsdp__attention_packed takes these arguments: qkv a contiguous f32 (B, T, 3 d) tensor
 * with B, T and d non-zero and `heads` dividing d, on a device with the fused kernel; mask NULL
 * or a contiguous f32 (T, T) tensor on the same device that needs no gradient; and the
 * environment does not set FSDP_FUSED_ATTENTION=0 (which keeps the composed path, for
 * comparisons).
 */
bool fsdp__attention_packed_ok(const fsdp_tensor_t *qkv, int64_t heads, const fsdp_tensor_t *mask);

/*
 * out (B, T, d) = the heads merged of softmax((scale q) k^T + mask) v for every sequence and
 * head, q, k and v being the (T, d / heads) slices of qkv at columns h hd, d + h hd and
 * 2 d + h hd. Differentiable in qkv; saves qkv and the (B, heads, T, T) attention weights.
 * Arguments as fsdp__attention_packed_ok accepts them (FSDP_EINVAL otherwise, saying which).
 */
int fsdp__attention_packed(fsdp_tensor_t *qkv, int64_t heads, double scale, fsdp_tensor_t *mask,
                           fsdp_tensor_t **out);

#endif
