/* seeds.c — the sizing of shardsim against the measurements published with
 * the seeds (MaxText on TPU v5p-8; /work/shared/reference/seed-measurements.md,
 * restated in the table below): for each measured row shardsim can express,
 * a dry run on compile_topology=v5p-8 (4 devices, the v5p hardware profile),
 * the predicted peak memory per device and step time beside the measured
 * ones and their ratio.
 *
 *   seed 000  deepseek3-test, per_device_batch_size=1, FSDP4 / FSDP2+TP2 /
 *             FSDP2+TPT2 (the tensor_transpose axis), auto and explicit
 *   seed 002  llama2-7b, stage=2 fsdp=2, num_pipeline_microbatches=8,
 *             pipeline_fsdp_ag_once, and the same with data=2 +
 *             shard_optimizer_over_data (ZeRO-1), auto and explicit
 *
 * Each row runs under the MaxText release that ran it where 0.2.5 differs:
 * the explicit rows and the tensor_transpose rows under maxtext_release=0.2.0
 * (MaxText 0.2.0 on JAX 0.8.1, the first PyPI release with both seeds'
 * changes; 0.2.5 refuses the explicit pipelines at their positions gather,
 * the explicit FSDP2+TP2 at MLA's q_norm, and has no tensor_transpose axis).
 * The auto rows keep the default release (0.2.5): MaxText traces them alike.
 * 0.2.0 itself fails two explicit rows (as 0.2.1 does, both on JAX 0.8.1):
 * seed 000's FSDP2+TPT2 at the optimizer update's add (the sparse MoE's
 * kernel gradients carry its shard_map in_specs) and seed 002's ZeRO-1+PP at
 * jax.jit's check of the ZeRO-1 state; the seeds measured them on their pull
 * requests' commits, which no release holds, so those rows print the refusal.
 *
 * Keys the seed command lines leave out take MaxText's defaults of the time
 * (per_device_batch_size 12, max_target_length 2048, dtype bfloat16,
 * weight_dtype float32, remat_policy full).  The v5p profile also sets the
 * dtype of weight gathers and gradient reductions: bfloat16, as XLA:TPU
 * compiles MaxText's step (configs/hardware/v5p.yml).  Measured "MB" are read as MiB,
 * the profiler's unit (the PRs do not say).  Targets: memory within 10%,
 * step time within 25%, except seed 000's FSDP2+TPT2 auto row, whose
 * measurement comes from a partitioner choice shardsim does not make, and
 * seed 002's memory, which neither MaxText 0.2.5's own compiled step (auto
 * rows) nor 0.2.0's (the explicit row) reproduces (the rows carry the reason).
 * Benchmark, not a test: prints the table and exits 0 unless a run fails. */
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "models/core/timemodel.h"
#include "models/core/train.h"

typedef struct {
    const char *seed, *config, *mode;
    const char *words[12];
    double mem_mb, step_ms; /* measured on v5p-8 */
    const char *exempt;     /* why the targets do not apply, or NULL */
    const char *mem_exempt; /* why the memory target alone does not apply, or NULL */
} row;

#define DS "model_name=deepseek3-test", "per_device_batch_size=1"
#define LL                                                                                                             \
    "model_name=llama2-7b", "ici_pipeline_parallelism=2", "num_pipeline_microbatches=8", "pipeline_fsdp_ag_once=true"
#define Z1 "ici_data_parallelism=2", "shard_optimizer_over_data=true"
#define TPT "maxtext_release=0.2.0", "ici_tensor_transpose_parallelism=2"
#define OLD "maxtext_release=0.2.0" /* the seeds' release, where 0.2.5 refuses the row */

/* Seed 002's memory: the same MaxText 0.2.5 step compiled by XLA:CPU (peers/maxtext/hlo_bytes.sh with
 * num_devices=4 and the row's keys, dtype=bfloat16) and ahead of time for v5p-8 by XLA:TPU (MaxText's
 * train_compile with compile_topology=v5p-8, libtpu 0.0.50.1 from PyPI, the version jax 0.12.0.1 pins):
 * memory_analysis() arguments + outputs - aliases + temporaries, and the buffer assignments (hand figures
 * in MiB per device: the stage's 16 layers are 3238133760 parameters, 12353 MiB in float32, 6176 in
 * bfloat16; 129 iterations x 3 x 2048 x 4096 bfloat16 = 6192 MiB). */
#define PP_FSDP_MEM                                                                                                    \
    "MaxText 0.2.5's own step does not reach the measured figure either: compiled ahead of time for v5p-8 by "         \
    "XLA:TPU (libtpu 0.0.50.1, train_compile compile_topology=v5p-8) its memory_analysis() is 54753 MiB per "          \
    "device (shardsim 1.10 of it), by XLA:CPU 69344 MiB. XLA:TPU converts each fsdp shard of the stage's "             \
    "layers to bfloat16 before the all-gather (6176 MiB held instead of 12353; shardsim does the same under the "      \
    "v5p profile, configs/hardware/v5p.yml weight_gather_dtype), and keeps, as shardsim does, the float32 "            \
    "gradient accumulators in the gathered shape (12353 MiB) and the 129 saved bfloat16 iteration inputs "             \
    "(6192 MiB) with 20029 MiB of parameters and Adam state; the MaxText of the PR's time does not reach it "          \
    "either: MaxText 0.1.0 with JAX 0.8.0 and libtpu 0.0.24 (the version JAX 0.8.0 pins) compiles it to 55804 "        \
    "MiB, MaxText 0.2.0 to 55708 MiB"
#define PP_Z1_MEM                                                                                                      \
    "MaxText 0.2.5's own step needs far more than the measured figure: XLA:TPU's ahead-of-time compile for "           \
    "v5p-8 reports 74359 MiB per device (shardsim 0.90 of it), XLA:CPU 75447 MiB (shardsim 0.89), keeping the "        \
    "float32 working parameters and Adam state (26706 MiB), the float32 gradient accumulators in the stage's "         \
    "whole shape (12353 MiB) and the saved inputs (6192 MiB); the PR's run must have used other settings or "          \
    "another MaxText/JAX (it ran JAX 0.8.0); MaxText 0.1.0 on JAX 0.8.0 / libtpu 0.0.24 has no "                       \
    "shard_optimizer_over_data key (without it: 74529 MiB) and 0.2.0's train_compile cannot build its "                \
    "parameter shardings, so the figure came from a run no published MaxText compiles to"

/* Seed 002's explicit FSDP+PP under MaxText 0.2.0 (JAX 0.8.1), compiled ahead of time for v5p-8 by XLA:TPU
 * (0.2.0's train_compile, libtpu 0.0.30, the version jax 0.8.1 pins; with the TPU's default attention the
 * compile fails: 0.2.0's tpu_flash_attention is not in a shard_map under explicit mode, "Mosaic kernels
 * cannot be automatically partitioned", so attention=dot_product) and by XLA:CPU (peers/maxtext/
 * hlo_bytes.py with 0.2.0's venv, num_devices=4, dtype=bfloat16). */
#define PP_FSDP_EXPL_MEM                                                                                               \
    "MaxText 0.2.0's own explicit step does not reach the measured figure either: XLA:TPU's ahead-of-time "            \
    "compile for v5p-8 (libtpu 0.0.30, attention=dot_product: the default flash kernel does not compile in explicit "  \
    "mode) reports 57494 MiB per device, 1.13x the measured 50913 (shardsim 1.21x XLA's). Its explicit shardings "     \
    "leave the logits cotangent split over stage and fsdp on the batch and the final norm's output over fsdp, so "     \
    "the logits kernel's gradient gathers the whole cotangent over the 4 devices, as shardsim does: XLA:TPU in "       \
    "bfloat16 (all-gather bf16[48,2048,32000], 6000 MiB), XLA:CPU and shardsim in float32 (12000 MiB; XLA:CPU "        \
    "81826 MiB against 73629 for the auto step)"

static const row ROWS[] = {
    {"000", "FSDP4", "auto", {DS}, 68748, 2238, NULL, NULL},
    {"000", "FSDP4", "explicit", {DS, "shard_mode=explicit", OLD}, 68961, 2284, NULL, NULL},
    {"000", "FSDP2+TP2", "auto", {DS, "ici_tensor_parallelism=2"}, 69448, 2014, NULL, NULL},
    {"000",
     "FSDP2+TP2",
     "explicit",
     {DS, "ici_tensor_parallelism=2", "shard_mode=explicit", OLD},
     69617,
     2378,
     NULL,
     NULL},
    {"000",
     "FSDP2+TPT2",
     "auto",
     {DS, TPT},
     93836,
     10743,
     "the PR's 'tensor-transpose pathology' of auto mode (its explicit mode removed it: -26% memory, -75% step): "
     "XLA's partitioner resharded differently; shardsim's auto mode reshards at MaxText's constraints by its cheapest "
     "plan, "
     "so it predicts near the explicit figures",
     NULL},
    {"000", "FSDP2+TPT2", "explicit", {DS, TPT, "shard_mode=explicit"}, 69373, 2714, NULL, NULL},
    {"002", "FSDP+PP", "auto", {LL}, 48219, 4567, NULL, PP_FSDP_MEM},
    /* the explicit rows: under 0.2.0 on JAX 0.8.1 (0.2.5 refuses every explicit pipeline) */
    {"002", "FSDP+PP", "explicit", {LL, "shard_mode=explicit", OLD}, 50913, 6822, NULL, PP_FSDP_EXPL_MEM},
    {"002", "ZeRO-1+PP", "auto", {LL, Z1}, 48315, 4636, NULL, PP_Z1_MEM},
    {"002", "ZeRO-1+PP", "explicit", {LL, Z1, "shard_mode=explicit", OLD}, 47997, 5272, NULL, NULL},
};
enum { NROWS = sizeof ROWS / sizeof ROWS[0] };

typedef struct {
    bool refused;
    char why[1024];
    double peak_mib, step_ms, mfu, compute_ms, exposed_ms, optimizer_ms, bubble_ms;
} result;

static result run(const row *r)
{
    result res;
    memset(&res, 0, sizeof res);
    const char *w[24];
    int n = 0;
    for (int i = 0; i < 12 && r->words[i]; i++) w[n++] = r->words[i];
    w[n++] = "compile_topology=v5p-8";
    w[n++] = "compile_topology_num_slices=1";
    w[n++] = "dtype=bfloat16";
    w[n++] = "steps=1";
    cfg_config *cfg;
    model_def *def = calloc(1, sizeof *def);
    if (cfg_load_argv("configs/base.yml", n, w, &cfg) || model_def_from_config(cfg, def)) {
        res.refused = true; /* a refusal is a result */
        snprintf(res.why, sizeof res.why, "%s", sim_errmsg());
        sim_err_clear();
        free(def);
        return res;
    }
    cfg_hw hw;
    model_tm_eff eff;
    bool have = false;
    model_data data;
    model_train_job job;
    memset(&job, 0, sizeof job);
    sim_machine *m;
    if (cfg_hw_from_config(cfg, def->mesh.num_devices, &hw, &have) || !have || model_tm_eff_load("configs", &eff) ||
        model_data_from_config(cfg, &data) || model_optim_from_config(cfg, &job.opt) ||
        model_machine_new(def, 0, false, &m)) {
        fprintf(stderr, "bench/seeds: setup: %s\n", have ? sim_errmsg() : "no hardware profile");
        exit(1);
    }
    job.def = def;
    job.data = &data;
    job.steps = 1;
    job.stats = calloc(1, sizeof *job.stats);
    if (model_train(&job, m) != SIM_OK) { /* the release's own errors (the explicit-mode verdicts) */
        res.refused = true;
        snprintf(res.why, sizeof res.why, "%s", sim_errmsg());
        sim_err_clear();
    }
    for (int d = 0; !res.refused && d < sim_machine_num_devices(m); d++) {
        sim_arena_stats as;
        sim_arena_get_stats(sim_device_arena(sim_machine_device(m, d)), &as);
        if ((double)as.peak / 1048576.0 > res.peak_mib) res.peak_mib = (double)as.peak / 1048576.0;
    }
    const cfg_entry *dt = cfg_find(cfg, "dtype");
    double bubble = def->d.pipe.on ? model_pipe_bubble_fraction(&def->d.pipe) : 0.0;
    model_tm_result tm;
    memset(&tm, 0, sizeof tm);
    if (!res.refused && model_tm_estimate(&hw, &eff, dt ? dt->value.text : "bfloat16", m, 0, bubble,
                                          model_opt_step_bytes(def), false, &tm)) {
        fprintf(stderr, "bench/seeds: model: %s\n", sim_errmsg());
        exit(1);
    }
    res.step_ms = tm.step_s * 1e3;
    res.mfu = tm.mfu;
    res.compute_ms = tm.compute_s * 1e3;
    res.exposed_ms = tm.exposed_s * 1e3;
    res.optimizer_ms = tm.optimizer_s * 1e3;
    res.bubble_ms = tm.bubble_s * 1e3;
    free(job.stats);
    sim_machine_free(m);
    model_data_close(&data);
    model_def_free(def);
    free(def);
    cfg_free(cfg);
    return res;
}

/* "explicit 0.2.0": the mode, and the release when the row names one */
static const char *mode_label(const row *r)
{
    static char buf[32];
    snprintf(buf, sizeof buf, "%s", r->mode);
    for (int i = 0; i < 12 && r->words[i]; i++)
        if (!strncmp(r->words[i], "maxtext_release=", 16))
            snprintf(buf, sizeof buf, "%s %s", r->mode, r->words[i] + 16);
    return buf;
}

static const char *verdict(double ratio, double tol, const char *exempt)
{
    if (exempt) return "exempt";
    return fabs(ratio - 1.0) <= tol ? "ok" : "MISS";
}

int main(void)
{
    model_tm_eff eff;
    if (model_tm_eff_load("configs", &eff)) {
        fprintf(stderr, "bench/seeds: %s\n", sim_errmsg());
        return 1;
    }
    printf("seeds on v5p-8 (4 devices): predicted (dry run, v5p profile) vs measured (MaxText PRs)\n");
    printf("model constants (configs/timemodel.yml): mxu %.2f, hbm %.2f, layout ops %.2f, ici %.2f, dcn %.2f, "
           "hop latency %.1f us, weight collectives %s\n\n",
           eff.mxu, eff.hbm, eff.layout, eff.ici, eff.dcn, eff.hop_latency_s * 1e6,
           eff.overlap_weights ? "overlapped with compute" : "serialised with compute");
    printf("%-4s %-11s %-14s | %9s %9s %6s %-6s | %8s %8s %6s %-6s | %5s %8s %8s %8s %8s\n", "seed", "config", "mode",
           "mem MiB", "measured", "ratio", "", "step ms", "measured", "ratio", "", "MFU", "compute", "exposed", "optim",
           "bubbles");
    for (int i = 0; i < 156; i++) putchar('-');
    putchar('\n');
    int miss = 0;
    for (int i = 0; i < NROWS; i++) {
        const row *r = &ROWS[i];
        result x = run(r);
        if (x.refused) {
            printf("%-4s %-11s %-14s | refused: %s\n", r->seed, r->config, mode_label(r), x.why);
            continue;
        }
        double rm = x.peak_mib / r->mem_mb, rs = x.step_ms / r->step_ms;
        const char *vm = verdict(rm, 0.10, r->exempt ? r->exempt : r->mem_exempt), *vs = verdict(rs, 0.25, r->exempt);
        miss += !strcmp(vm, "MISS") + !strcmp(vs, "MISS");
        printf("%-4s %-11s %-14s | %9.0f %9.0f %6.3f %-6s | %8.0f %8.0f %6.3f %-6s | %4.1f%% %8.0f %8.0f %8.0f %8.0f\n",
               r->seed, r->config, mode_label(r), x.peak_mib, r->mem_mb, rm, vm, x.step_ms, r->step_ms, rs, vs,
               100.0 * x.mfu, x.compute_ms, x.exposed_ms, x.optimizer_ms, x.bubble_ms);
        fflush(stdout);
    }
    printf("\ntargets: memory within 10%%, step time within 25%%; %d miss%s\n", miss, miss == 1 ? "" : "es");
    for (int i = 0; i < NROWS; i++)
        if (ROWS[i].exempt)
            printf("exempt: seed %s %s %s: %s\n", ROWS[i].seed, ROWS[i].config, ROWS[i].mode, ROWS[i].exempt);
    for (int i = 0; i < NROWS; i++)
        if (ROWS[i].mem_exempt)
            printf("exempt (memory): seed %s %s %s: %s\n", ROWS[i].seed, ROWS[i].config, ROWS[i].mode,
                   ROWS[i].mem_exempt);
    printf("seed 000's step is the experts' megablox tiles (64 rows per expert in 512-row tiles, k = n = 512 in "
           "1024-wide blocks: 32x the useful FLOPs) and the FSDP gathers of all 256 experts, serialised "
           "(configs/timemodel.yml overlap_weight_collectives; the XLA:TPU HLO has no asynchronous collective "
           "either); `shardsim train` prints both breakdowns. The third term is MLA's layout ops (the splits of q "
           "and kv, the concatenations, the rope key broadcast over 128 heads), timed at layout_op_efficiency: "
           "XLA:TPU's own cost model (estimated_cycles in the seed's after_codegen HLO, at 1.75 GHz) puts the "
           "step's fusions, copies and slices at 912 ms (dot fusions 190, memory-bound ops 722, of which the "
           "layer bodies' layout ops ~500 ms at 556 GB/s); with the Pallas kernels (splash attention, megablox "
           "gmm: no estimate from XLA; shardsim's 812 ms) and the collectives (shardsim's 484 ms + ~80 the model "
           "does not move) that is ~2290 ms against the measured 2238 (docs/explanations/step-time.md, seed notes)\n");
    return 0;
}
