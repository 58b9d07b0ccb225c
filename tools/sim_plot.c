/* SPDX-License-Identifier: MIT */
/*
 * sim_plot.c: fsdp-sim --plot: scaling curves and a memory breakdown, drawn by gnuplot.
 *
 * One SVG of two panels: model TFLOPS per GPU against the number of GPUs (a log2 axis), one
 * curve per sharding strategy; and the simulated rank's peak memory by category, one stacked
 * bar per configuration, beside the GPU's capacity. The data and the script go to gnuplot on its
 * standard input (inline data blocks), so nothing is left behind but the picture. Strategy names
 * and categories are the library's own strings, which hold no quote.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include "tools/sim.h"

static double gib(size_t b) {
    return (double)b / 1073741824.0;
}

int sim_plot(const char *path, const char *title, const sim_config_t *cfgs, const sim_result_t *res,
             int n) {
    size_t len = strlen(path);
    if (len < 5 || strcmp(path + len - 4, ".svg") != 0) {
        fprintf(stderr, "fsdp-sim: --plot %s: the picture's name must end in .svg\n", path);
        return -1;
    }
    if (strchr(path, '\'') || strchr(path, '\n')) {
        fprintf(stderr, "fsdp-sim: --plot %s: the name may not hold a quote or a newline\n", path);
        return -1;
    }
    FILE *gp = popen("gnuplot", "w");
    if (!gp) {
        fprintf(stderr, "fsdp-sim: --plot: cannot run gnuplot (Debian: apt-get install "
                        "gnuplot-nox)\n");
        return -1;
    }
    /* The strategies, in the order they first appear. */
    fsdp_sharding_strategy_t strat[8];
    int ns = 0;
    for (int i = 0; i < n; i++) {
        int j = 0;
        while (j < ns && strat[j] != cfgs[i].strategy)
            j++;
        if (j == ns && ns < 8) strat[ns++] = cfgs[i].strategy;
    }
    for (int j = 0; j < ns; j++) {
        fprintf(gp, "$s%d << EOD\n", j);
        for (int i = 0; i < n; i++)
            if (cfgs[i].strategy == strat[j]) fprintf(gp, "%d %.6g\n", cfgs[i].gpus, res[i].tflops);
        fprintf(gp, "EOD\n");
    }
    static const fsdp_mem_cat_t cats[] = {FSDP_MEM_PARAMS,      FSDP_MEM_GRADS, FSDP_MEM_OPTIM,
                                          FSDP_MEM_ACTIVATIONS, FSDP_MEM_COMM,  FSDP_MEM_OTHER};
    const int ncat = (int)(sizeof cats / sizeof cats[0]);
    fprintf(gp, "$mem << EOD\nconfig");
    for (int k = 0; k < ncat; k++)
        fprintf(gp, " %s", fsdp_mem_cat_name(cats[k]));
    fprintf(gp, "\n");
    for (int i = 0; i < n; i++) {
        fprintf(gp, "\"%d %s\"", cfgs[i].gpus, fsdp_sharding_strategy_name(cfgs[i].strategy));
        for (int k = 0; k < ncat; k++)
            fprintf(gp, " %.6g", gib(res[i].mem.peak[cats[k]]));
        fprintf(gp, "\n");
    }
    fprintf(gp, "EOD\n");
    fprintf(gp,
            "set terminal svg size 1100,460 dynamic enhanced font 'sans,11'\n"
            "set output '%s'\n"
            "set multiplot layout 1,2 title '%s' noenhanced\n"
            "set title 'model TFLOPS per GPU'\nset xlabel 'GPUs'\nset ylabel 'TFLOPS'\n"
            "set logscale x 2\nset grid\nset key bottom left noenhanced\nset yrange [0:*]\n",
            path, title);
    fprintf(gp, "plot ");
    for (int j = 0; j < ns; j++)
        fprintf(gp, "%s$s%d using 1:2 with linespoints lw 2 title '%s'", j ? ", " : "", j,
                fsdp_sharding_strategy_name(strat[j]));
    fprintf(gp, "\n");
    fprintf(gp,
            "unset logscale x\nset title 'peak memory of the simulated rank (GiB, by category)'\n"
            "set xlabel ''\nset ylabel 'GiB'\nset style data histograms\n"
            "set style histogram rowstacked\nset style fill solid 0.8 border -1\n"
            "set boxwidth 0.7\nset key top right autotitle columnheader noenhanced\n"
            "set xtics rotate by -30 noenhanced\nset arrow 1 from graph 0, first %.6g to graph 1, "
            "first %.6g nohead dt 2 lw 2\nset label 1 'GPU memory' at graph 0.02, first %.6g "
            "offset 0,0.6\n",
            gib(res[0].mem_capacity), gib(res[0].mem_capacity), gib(res[0].mem_capacity));
    fprintf(gp, "plot for [k=2:%d] $mem using k:xtic(1)\nunset multiplot\n", ncat + 1);
    int st = pclose(gp);
    if (st != 0) {
        fprintf(stderr,
                "fsdp-sim: --plot %s: gnuplot failed (status %d; Debian: apt-get install "
                "gnuplot-nox)\n",
                path, WIFEXITED(st) ? WEXITSTATUS(st) : st);
        return -1;
    }
    return 0;
}
