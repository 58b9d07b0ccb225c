/* SPDX-License-Identifier: MIT */
/*
 * fsdp.h: everything public in libfsdp.
 */
#ifndef FSDP_H
#define FSDP_H

#include <fsdp/export.h>
#include <fsdp/version.h>
#include <fsdp/errno.h>
#include <fsdp/dtype.h>
#include <fsdp/rng.h>
#include <fsdp/log.h>
#include <fsdp/mem.h>
#include <fsdp/redop.h>
#include <fsdp/context.h>
#include <fsdp/trace.h>
#include <fsdp/store.h>
#include <fsdp/pg.h>
#include <fsdp/sim.h>
#include <fsdp/gloo.h>
#include <fsdp/nccl.h>
#include <fsdp/device.h>
#include <fsdp/tensor.h>
#include <fsdp/autograd.h>
#include <fsdp/nn.h>
#include <fsdp/transformer.h>
#include <fsdp/bert.h>
#include <fsdp/optim.h>
#include <fsdp/safetensors.h>
#include <fsdp/checkpoint.h>
#include <fsdp/ddp.h>
#include <fsdp/fsdp.h>
#include <fsdp/policy.h>
#include <fsdp/grad_scaler.h>
#include <fsdp/gpt_recipe.h>
#include <fsdp/launch.h>
#include <fsdp/data.h>
#include <fsdp/bpe.h>
#include <fsdp/cluster.h>
#include <fsdp/vsim.h>

#endif /* FSDP_H */
