/* pipeline.c — pipeline-parallelism benchmark, in one run:
 *
 *   1. The seed-002 configurations (MaxText's explicit-sharding change to the
 *      pipeline module) for full-size llama2-7b on 4 devices, as dry runs
 *      (shapes, traffic and memory only), in auto and explicit mode (explicit
 *      is refused as MaxText 0.2.5 refuses it: the positions gather's
 *      ShardingTypeError; the row prints the message):
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

#include "bench/lib/bench_run.h"
#include "models/core/train.h"

/* The rows: bench_run's result; a refusal prints its message. */
typedef bench_result run_result;

static run_result run(const char *const *words, int nwords, int steps)
{
    run_result res;
    bench_run("bench/pipeline", words, nwords, steps, &res);
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
           "per_device_batch_size=12, max_target_length=2048, dry run (MaxText's default dtypes: bfloat16 activations, "
           "float32 weights)\n");
    printf("MaxText on v5p-8 (seed 002, bf16 activations): FSDP+PP auto 48219 MB explicit 50913 MB; "
           "ZeRO-1+PP auto 48315 MB explicit 47997 MB\n\n");
    printf("%-10s %-9s | %8s %8s %8s %8s %8s %8s %8s | %-15s %-14s %12s\n", "config", "mode", "params", "grads",
           "optim", "acts", "temps", "comm", "peak", "collective", "axes", "GiB/dev/step");
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
                           gib((double)r.at_peak[SIM_MEM_PARAMS], b[0], 32),
                           gib((double)r.at_peak[SIM_MEM_GRADS], b[1], 32),
                           gib((double)r.at_peak[SIM_MEM_OPTIMIZER], b[2], 32),
                           gib((double)r.at_peak[SIM_MEM_ACTIVATIONS], b[3], 32),
                           gib((double)r.at_peak[SIM_MEM_TEMP], b[4], 32),
                           gib((double)r.at_peak[SIM_MEM_COMM], b[5], 32), gib((double)r.peak, b[6], 32));
                else printf("%-10s %-9s | %8s %8s %8s %8s %8s %8s %8s | ", "", "", "", "", "", "", "", "", "");
                if (r.nrows)
                    printf("%-15s %-14s %12s\n", sim_op_name(r.rows[i].op), r.rows[i].axes,
                           gib(r.rows[i].bytes, b[7], 32));
                else printf("\n");
            }
            fflush(stdout);
        }
    printf("(memory in GiB per device, each category as held when the device peaked)\n\n");
}

static void step_ratio(void)
{
    static const char *const model[] = {"model_name=llama2-7b",
                                        "override_model_config=true",
                                        "base_num_decoder_layers=4",
                                        "base_emb_dim=256",
                                        "base_num_query_heads=4",
                                        "base_num_kv_heads=4",
                                        "head_dim=64",
                                        "base_mlp_dim=768",
                                        "vocab_size=1024",
                                        "max_target_length=128",
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
