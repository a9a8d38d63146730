/* xla.c — shardsim's sizing against XLA:TPU's own compile of MaxText 0.2.5's
 * train step: for every configuration of the project's ground truth
 * (tests/data/xla/tpu.json, or the files given as arguments), a dry run of
 * the same MaxText keys on the same topology, and per configuration the peak
 * per device (shardsim, XLA's memory_analysis(), ratio), shardsim's
 * composition of it, and the bytes each device sends per collective kind
 * with their ratios.  Targets (xla_truth.h): peak within 3%, every kind with
 * at least 1% of the bytes within 5%.  Where an XLA choice depends on a flag
 * or threshold shardsim cannot see, shardsim follows XLA's default (the
 * docs/xla-fidelity.md).
 * Benchmark, not a test: prints the table, exits 0 unless a run fails
 * (tests/test_xla_truth.c asserts the targets). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "bench/lib/xla_truth.h"

static const char *const SHORT[XT_NKINDS] = {"AG", "RS", "AR", "A2A", "CP", "RA2A"};

static void gib(double b, char *buf, size_t cap) { snprintf(buf, cap, "%.2f", b / 1073741824.0); }

static int run_file(const char *path, int *n_ok, int *n_all)
{
    xt_set set;
    char err[512];
    if (!xt_load(path, &set, err, sizeof err)) {
        fprintf(stderr, "bench/xla: %s\n", err);
        return 1;
    }
    printf("%s (XLA:TPU compiles by %s)\n", path, set.versions);
    printf("%-36s %8s %8s %6s  %-46s  %s\n", "configuration", "ss GiB", "XLA GiB", "ratio",
           "shardsim at peak: params/grads/opt/wcopy/act/tmp", "bytes per kind, GiB: shardsim/XLA (ratio)");
    for (int i = 0; i < set.n; i++) {
        const xt_config *c = &set.c[i];
        if (!c->compiled) {
            printf("%-36s not compiled by XLA: %.120s\n", c->name, c->error);
            continue;
        }
        xt_result r;
        xt_compare(c, &r);
        if (r.refused) {
            printf("%-36s refused by shardsim: %.120s\n", c->name, r.why);
            continue;
        }
        (*n_all)++;
        *n_ok += r.all_ok;
        char a[16], b[16];
        gib(r.peak, a, sizeof a);
        gib(c->peak, b, sizeof b);
        char comp[96];
        snprintf(comp, sizeof comp, "%.1f/%.1f/%.1f/%.1f/%.1f/%.1f", r.at_peak[SIM_MEM_PARAMS] / 1073741824.0,
                 r.at_peak[SIM_MEM_GRADS] / 1073741824.0, r.at_peak[SIM_MEM_OPTIMIZER] / 1073741824.0,
                 r.at_peak[SIM_MEM_WCOPY] / 1073741824.0, r.at_peak[SIM_MEM_ACTIVATIONS] / 1073741824.0,
                 r.at_peak[SIM_MEM_TEMP] / 1073741824.0);
        printf("%-36s %8s %8s %6.3f%s %-46s ", c->name, a, b, r.peak_ratio, r.peak_ok ? " " : "*", comp);
        for (int k = 0; k < XT_NKINDS; k++) {
            if (!r.kind_checked[k] && !(c->kind_bytes[k] > 0 && xt_share(c, k) >= 0.001)) continue;
            printf(" %s %.2f/%.2f", SHORT[k], r.kind_bytes[k] / 1073741824.0, c->kind_bytes[k] / 1073741824.0);
            if (r.kind_checked[k]) printf(" (%.3f%s)", r.kind_ratio[k], r.kind_ok[k] ? "" : "*");
        }
        putchar('\n');
        if (!r.all_ok && c->miss[0]) printf("%-36s   known miss: %s\n", "", c->miss);
    }
    xt_free(&set);
    return 0;
}

int main(int argc, char **argv)
{
    int ok = 0, all = 0, rc = 0;
    if (argc < 2) rc = run_file("tests/data/xla/tpu.json", &ok, &all);
    for (int i = 1; i < argc && !rc; i++) rc = run_file(argv[i], &ok, &all);
    printf("\n%d of %d configurations within the targets (peak +-%.0f%%, every kind with >= %.0f%% of the bytes "
           "+-%.0f%%; * marks a miss; AG all-gather, RS reduce-scatter, AR all-reduce, A2A all-to-all, CP "
           "collective-permute, RA2A ragged all-to-all, not compared: routing-dependent)\n",
           ok, all, XT_PEAK_TOL * 100, XT_KIND_MIN_SHARE * 100, XT_KIND_TOL * 100);
    return rc;
}
