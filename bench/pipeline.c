/* pipeline.c — pipeline-parallelism benchmark, in one run:
 *
 *   1. The seed-002 configurations (MaxText's explicit-sharding change to the
 *      pipeline module) for full-size llama2-7b on 4 devices, as dry runs
 *      (shapes, traffic and memory only), in auto and explicit mode:
 *        FSDP+PP   stage=2 fsdp=2, num_pipeline_microbatches=8, pipeline_fsdp_ag_once
 *        ZeRO-1+PP the same with data=2 and shard_optimizer_over_data
 *      per_device_batch_size=12 and max_target_length=2048 (MaxText's base
 *      defaults of that time).  Per configuration: the peak memory per device
 *      by category, and the bytes each device sends per step by collective and
 *      mesh axes.  A configuration shardsim refuses prints its message.
 *   2. A real small Llama (4 layers, emb 256, 8 x 128 tokens): the pipelined step time (stage=2, M=4) over the
 *      unpipelined one on the same 2 devices (data=2) and over 1 device.
 *
 * Benchmark, not a test: it prints the tables and ratios and exits 0 unless
 * a supported run fails. */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "models/train.h"

enum { MAX_ROWS = 64 };

typedef struct {
    sim_op op;
    char axes[64];
    double bytes;
} traffic_row;

typedef struct {
    bool refused;
    char why[512];
    size_t peak, at_peak[SIM_NMEM]; /* the device with the highest peak */
    double step_s;
    int nrows;
    traffic_row rows[MAX_ROWS];
} run_result;

static void add_traffic(run_result *r, sim_op op, const char *axes, double bytes)
{
    for (int i = 0; i < r->nrows; i++)
        if (r->rows[i].op == op && !strcmp(r->rows[i].axes, axes)) {
            r->rows[i].bytes += bytes;
            return;
        }
    if (r->nrows == MAX_ROWS) return;
    traffic_row *t = &r->rows[r->nrows++];
    t->op = op;
    snprintf(t->axes, sizeof t->axes, "%s", axes);
    t->bytes = bytes;
}

static run_result run(const char *const *words, int nwords, int steps)
{
    run_result res;
    memset(&res, 0, sizeof res);
    mesh_cfg *cfg;
    if (mesh_cfg_load_argv("configs/base.yml", nwords, words, &cfg)) {
        fprintf(stderr, "bench/pipeline: config: %s\n", sim_errmsg());
        exit(1);
    }
    model_def *def = calloc(1, sizeof *def);
    if (model_def_from_config(cfg, def)) { /* a refusal is a result */
        res.refused = true;
        snprintf(res.why, sizeof res.why, "%s", sim_errmsg());
        free(def);
        mesh_cfg_free(cfg);
        return res;
    }
    model_data data;
    model_train_job job;
    memset(&job, 0, sizeof job);
    sim_machine *m;
    if (model_data_from_config(cfg, &data) || model_optim_from_config(cfg, &job.opt) ||
        model_machine_new(def, 0, false, &m)) {
        fprintf(stderr, "bench/pipeline: setup: %s\n", sim_errmsg());
        exit(1);
    }
    job.def = def;
    job.data = &data;
    job.steps = steps;
    job.stats = calloc((size_t)steps, sizeof *job.stats);
    if (model_train(&job, m) != SIM_OK) {
        fprintf(stderr, "bench/pipeline: train: %s\n", sim_errmsg());
        exit(1);
    }
    res.step_s = job.stats[0].time_s;
    for (int s = 1; s < steps; s++)
        if (s == 1 || job.stats[s].time_s < res.step_s) res.step_s = job.stats[s].time_s;
    int nd = sim_machine_num_devices(m);
    const sim_mesh_desc *md = sim_machine_mesh(m);
    for (int d = 0; d < nd; d++) {
        sim_device *dev = sim_machine_device(m, d);
        sim_arena_stats as;
        sim_arena_get_stats(sim_device_arena(dev), &as);
        if (as.peak > res.peak) {
            res.peak = as.peak;
            memcpy(res.at_peak, as.at_peak_by, sizeof res.at_peak);
        }
        size_t n;
        const sim_record *r = sim_device_records(dev, &n);
        for (size_t i = 0; i < n; i++) {
            if (r[i].step != steps - 1) continue;
            char ax[64];
            sim_axes_label(md, r[i].axes, ax, sizeof ax);
            add_traffic(&res, r[i].op, ax, (double)r[i].bytes_sent / nd);
        }
    }
    free(job.stats);
    sim_machine_free(m);
    model_data_close(&data);
    model_def_free(def);
    free(def);
    mesh_cfg_free(cfg);
    return res;
}

static const char *gib(double b, char *buf, size_t cap)
{
    snprintf(buf, cap, "%.2f", b / (1024.0 * 1024.0 * 1024.0));
    return buf;
}

static void seed002_table(void)
{
    static const struct {
        const char *label;
        const char *flags[4];
    } C[] = {
        {"FSDP+PP", {"ici_fsdp_parallelism=-1"}},
        {"ZeRO-1+PP", {"ici_fsdp_parallelism=-1", "ici_data_parallelism=2", "shard_optimizer_over_data=true"}},
    };
    printf("llama2-7b, 4 devices, stage=2, num_pipeline_microbatches=8, pipeline_fsdp_ag_once=true, "
           "per_device_batch_size=12, max_target_length=2048, dry run (MaxText's default dtypes: bfloat16 activations, float32 weights)\n");
    printf("MaxText on v5p-8 (seed 002, bf16 activations): FSDP+PP auto 48219 MB explicit 50913 MB; "
           "ZeRO-1+PP auto 48315 MB explicit 47997 MB\n\n");
    printf("%-10s %-9s | %8s %8s %8s %8s %8s %8s %8s | %-15s %-14s %12s\n", "config", "mode", "params", "grads", "optim",
           "acts", "temps", "comm", "peak", "collective", "axes", "GiB/dev/step");
    for (int i = 0; i < 150; i++) putchar('-');
    putchar('\n');
    for (size_t c = 0; c < sizeof C / sizeof C[0]; c++)
        for (int mode = 0; mode < 2; mode++) {
            const char *w[16];
            int n = 0;
            w[n++] = "model_name=llama2-7b";
            w[n++] = "dry_run=true";
            w[n++] = "steps=1";
            w[n++] = "num_devices=4";
            w[n++] = "ici_pipeline_parallelism=2";
            w[n++] = "num_pipeline_microbatches=8";
            w[n++] = "pipeline_fsdp_ag_once=true";
            w[n++] = mode ? "shard_mode=explicit" : "shard_mode=auto";
            for (int f = 0; f < 4 && C[c].flags[f]; f++) w[n++] = C[c].flags[f];
            run_result r = run(w, n, 1);
            if (r.refused) {
                printf("%-10s %-9s | refused: %s\n", C[c].label, mode ? "explicit" : "auto", r.why);
                continue;
            }
            char b[8][32];
            for (int i = 0; i < r.nrows || i == 0; i++) {
                if (i == 0)
                    printf("%-10s %-9s | %8s %8s %8s %8s %8s %8s %8s | ", C[c].label, mode ? "explicit" : "auto",
                           gib((double)r.at_peak[SIM_MEM_PARAMS], b[0], 32), gib((double)r.at_peak[SIM_MEM_GRADS], b[1], 32),
                           gib((double)r.at_peak[SIM_MEM_OPTIMIZER], b[2], 32),
                           gib((double)r.at_peak[SIM_MEM_ACTIVATIONS], b[3], 32),
                           gib((double)r.at_peak[SIM_MEM_TEMP], b[4], 32), gib((double)r.at_peak[SIM_MEM_COMM], b[5], 32),
                           gib((double)r.peak, b[6], 32));
                else
                    printf("%-10s %-9s | %8s %8s %8s %8s %8s %8s %8s | ", "", "", "", "", "", "", "", "", "");
                if (r.nrows)
                    printf("%-15s %-14s %12s\n", sim_op_name(r.rows[i].op), r.rows[i].axes,
                           gib(r.rows[i].bytes, b[7], 32));
                else
                    printf("\n");
            }
            fflush(stdout);
        }
    printf("(memory in GiB per device, each category as held when the device peaked)\n\n");
}

static void step_ratio(void)
{
    static const char *const model[] = {"model_name=llama2-7b", "override_model_config=true", "base_num_decoder_layers=4",
                                        "base_emb_dim=256", "base_num_query_heads=4", "base_num_kv_heads=4",
                                        "head_dim=64", "base_mlp_dim=768", "vocab_size=1024", "max_target_length=128",
                                        "steps=3"};
    enum { NM = sizeof model / sizeof model[0] };
    const char *w[NM + 4];
    for (int i = 0; i < NM; i++) w[i] = model[i];
    w[NM] = "per_device_batch_size=8";
    run_result one = run(w, NM + 1, 3);
    w[NM] = "per_device_batch_size=4";
    w[NM + 1] = "ici_data_parallelism=2";
    run_result dp = run(w, NM + 2, 3);
    w[NM + 1] = "ici_pipeline_parallelism=2";
    w[NM + 2] = "num_pipeline_microbatches=4";
    run_result pp = run(w, NM + 3, 3);
    printf("small Llama (4 layers, emb 256, 8 x 128 tokens per step), fastest of steps 2-3\n");
    printf("%-34s %10s\n", "mesh", "step (s)");
    printf("%-34s %10.3f\n", "1 device", one.step_s);
    printf("%-34s %10.3f\n", "data=2", dp.step_s);
    printf("%-34s %10.3f\n", "stage=2 M=4 (R=2, 9 iterations)", pp.step_s);
    printf("ratio pipelined / unpipelined on 2 devices: %.3f; pipelined / 1 device: %.3f\n", pp.step_s / dp.step_s,
           pp.step_s / one.step_s);
}

int main(int argc, char **argv)
{
    bool table = true, ratio = true;
    if (argc > 1 && !strcmp(argv[1], "table")) ratio = false;
    if (argc > 1 && !strcmp(argv[1], "ratio")) table = false;
    if (table) seed002_table();
    if (ratio) step_ratio();
    return 0;
}
