/* SPDX-License-Identifier: MIT */
/*
 * t_cuda_probe.c: the CUDA build runs a kernel and gets the values the CPU computes.
 * Skips where libfsdp was built without CUDA or no device is visible.
 */
#include <config.h>

#include <stdlib.h>

#include "tap.h"

#ifdef FSDP_HAVE_CUDA
#include "backends/cuda/cuda_probe.h"
#endif

int main(void) {
#ifndef FSDP_HAVE_CUDA
    return tap_skip_all("libfsdp was configured without CUDA");
#else
    char why[256] = "";
    int ndev = fsdp__cuda_device_count(why, sizeof why);
    if (ndev <= 0) return tap_skip_all("no CUDA device");
    tap_plan_lazy();
    tap_diag("%d CUDA device(s)", ndev);
    size_t n = (size_t)1 << 20;
    float *out = malloc(n * sizeof *out);
    for (int dev = 0; dev < ndev; dev++) {
        int rc = fsdp__cuda_fill_iota(dev, out, n, 0.5f, why, sizeof why);
        if (!tap_is_int(rc, 0, "device %d: fill kernel runs (%s)", dev, why)) continue;
        size_t bad = 0;
        for (size_t i = 0; i < n; i++)
            if (out[i] != 0.5f + (float)i) bad++;
        tap_is_size(bad, 0, "device %d: %zu values equal the CPU's value + index", dev, n);
    }
    free(out);
    return tap_done();
#endif
}
