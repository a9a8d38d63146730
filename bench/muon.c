/* muon.c — what the shard-exp-on-fsdp rule set buys Muon, in bytes.
 *
 * deepseek2-16b at full size, dry run (shapes, shardings and counted
 * collectives; no math), one training step of per_device_batch_size=1 on 8
 * devices, for every combination of
 *   mesh       FSDP=8, FSDP=4 EP=2
 *   rules      MaxText's base rules, custom_mesh_and_rule=shard-exp-on-fsdp
 *   optimizer  AdamW, Muon (optax_muon, as MaxText builds it)
 * Per row: the bytes each device sends in phase optimizer (Muon: the
 * Newton-Schulz collectives of every leaf; both: the gradient-norm
 * all-reduce), of which for the routed expert weights, the bytes of the whole
 * step, the optimizer's share of them, and the peak memory per device.
 * Seed 001's claim: under the base rules fsdp shards a matrix dim of every
 * routed expert, so Muon all-reduces their Gram matrices five times a step;
 * shard-exp-on-fsdp puts fsdp on the expert dim, and the experts'
 * Newton-Schulz needs no collective at all.
 *
 * Benchmark, not a test: it prints the table and exits 0 unless a run fails. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "models/core/train.h"

typedef struct {
    const char *label;
    const char *flags[3];
} bench_case;

static const bench_case MESHES[] = {
    {"FSDP=8", {"ici_fsdp_parallelism=8"}},
    {"FSDP=4 EP=2", {"ici_fsdp_parallelism=4", "ici_expert_parallelism=2"}},
};
static const bench_case RULES[] = {
    {"base", {NULL}},
    {"shard-exp-on-fsdp", {"custom_mesh_and_rule=shard-exp-on-fsdp"}},
};
static const bench_case OPTS[] = {
    {"AdamW", {"opt_type=adamw"}},
    {"Muon", {"opt_type=muon"}},
};

typedef struct {
    double opt, opt_experts, total; /* bytes sent per device in the step (mean over devices) */
    double peak;                    /* highest arena peak over devices */
} result;

static void fail(const char *what)
{
    fprintf(stderr, "bench/muon: %s: %s\n", what, sim_errmsg());
    exit(1);
}

static result run(const char *const *words, int nwords)
{
    result res = {0};
    cfg_config *cfg;
    model_def *def = calloc(1, sizeof *def);
    model_data data;
    model_train_job job;
    memset(&job, 0, sizeof job);
    sim_machine *m;
    if (cfg_load_argv("configs/base.yml", nwords, words, &cfg)) fail("config");
    if (model_def_from_config(cfg, def)) fail("model");
    if (model_data_from_config(cfg, &data) || model_optim_from_config(cfg, &job.opt)) fail("data/optimizer");
    if (model_machine_new(def, 0, false, &m)) fail("machine");
    job.def = def;
    job.data = &data;
    job.steps = 1;
    job.stats = calloc(1, sizeof *job.stats);
    if (model_train(&job, m) != SIM_OK) fail("train");
    int nd = sim_machine_num_devices(m);
    for (int d = 0; d < nd; d++) {
        sim_device *dev = sim_machine_device(m, d);
        sim_arena_stats as;
        sim_arena_get_stats(sim_device_arena(dev), &as);
        if ((double)as.peak > res.peak) res.peak = (double)as.peak;
        size_t n;
        const sim_record *r = sim_device_records(dev, &n);
        for (size_t i = 0; i < n; i++) {
            double b = (double)r[i].bytes_sent / nd;
            res.total += b;
            if (r[i].phase != SIM_PHASE_OPTIMIZER) continue;
            res.opt += b;
            if (strstr(r[i].tag, "MoeBlock_0.wi_") || strstr(r[i].tag, "MoeBlock_0.wo/")) res.opt_experts += b;
        }
    }
    free(job.stats);
    sim_machine_free(m);
    model_data_close(&data);
    model_def_free(def);
    free(def);
    cfg_free(cfg);
    return res;
}

static const char *gib(double b, char *buf, size_t cap)
{
    snprintf(buf, cap, "%.2f", b / (1024.0 * 1024.0 * 1024.0));
    return buf;
}

int main(void)
{
    printf("bench/muon: deepseek2-16b, full size, dry run, 1 step, per_device_batch_size=1 "
           "(max_target_length from the model), 8 devices\n");
    printf("bytes are sent per device per step (mean over devices); GiB = 2^30 bytes\n\n");
    printf("%-12s %-18s %-6s %14s %14s %14s %8s %12s\n", "mesh", "rules", "opt", "optimizer GiB", "of it experts",
           "step GiB", "opt %", "peak GiB");
    printf("--------------------------------------------------------------------------------------------------------"
           "-\n");
    result res[2][2][2];
    for (int mi = 0; mi < 2; mi++)
        for (int ri = 0; ri < 2; ri++)
            for (int oi = 0; oi < 2; oi++) {
                const char *w[12];
                int n = 0;
                w[n++] = "model_name=deepseek2-16b";
                w[n++] = "dry_run=true";
                w[n++] = "per_device_batch_size=1";
                w[n++] = "steps=1";
                for (int k = 0; k < 3 && MESHES[mi].flags[k]; k++) w[n++] = MESHES[mi].flags[k];
                for (int k = 0; k < 3 && RULES[ri].flags[k]; k++) w[n++] = RULES[ri].flags[k];
                w[n++] = OPTS[oi].flags[0];
                result r = run(w, n);
                res[mi][ri][oi] = r;
                char a[32], b[32], c[32], d[32];
                printf("%-12s %-18s %-6s %14s %14s %14s %7.1f%% %12s\n", MESHES[mi].label, RULES[ri].label,
                       OPTS[oi].label, gib(r.opt, a, sizeof a), gib(r.opt_experts, b, sizeof b),
                       gib(r.total, c, sizeof c), r.total > 0 ? 100.0 * r.opt / r.total : 0.0,
                       gib(r.peak, d, sizeof d));
                fflush(stdout);
            }
    printf("\nMuon step bytes, shard-exp-on-fsdp / base rules:");
    for (int mi = 0; mi < 2; mi++) printf("  %s %.3f", MESHES[mi].label, res[mi][1][1].total / res[mi][0][1].total);
    printf("\nMuon step bytes / AdamW step bytes (same mesh and rules):");
    for (int mi = 0; mi < 2; mi++)
        for (int ri = 0; ri < 2; ri++)
            printf("  %s %s %.2f", MESHES[mi].label, RULES[ri].label, res[mi][ri][1].total / res[mi][ri][0].total);
    printf("\n");
    return 0;
}
