/* step.c — training step time of the issue-4 benchmark model, as ratios from
 * one run (the peak is the all-core sgemm of the OpenBLAS kernels that run,
 * measured in this run; the header names the kernels):
 *   1 device, default remat: model FLOPs / (step time x peak)     target >= 0.80
 *     (the recomputation takes the forward's values: remat_recompute=auto; a row with
 *     remat_recompute=always computes them again, its executed FLOPs include them)
 *   1 device, remat_policy=none scan_layers=false: model FLOPs / (step time x peak) target >= 0.85
 *     (the step without recomputation: over scanned layers MaxText's none is full remat,
 *     jax.checkpoint(policy=None); its unscanned loop calls the layers without a checkpoint)
 *   8 devices: step time / the 1-device step time                 target <= 1.05
 *     for fsdp=8, fsdp=4 tensor=2 and data=2 fsdp=2 tensor=2
 *   64 devices (fsdp=8 tensor=8, the same global batch of 8 sequences):
 *     step time / the 1-device step time                          target <= 1.15
 *
 * Model: llama2-7b with emb 512, 8 heads of 64, mlp 1536, 4 layers, vocab
 * 4096, 256 tokens, a global batch of 8 sequences.  Model FLOPs count the
 * matmuls (6 x matmul parameters x tokens, forward and backward) and causal
 * attention (2 B T^2 H D forward, x3 with backward), not the remat
 * recompute, as MaxText's MFU does.  With remat_recompute=always the
 * layers' forward runs twice, so the table also gives the executed FLOPs
 * (recompute included) over the peak, and a 1-device row with
 * remat_policy=none over unscanned layers (nothing recomputed).  Each configuration trains a few steps; the fastest
 * step after the first is reported, with the process's CPU time (user +
 * sys) per step over the steps after the first and its ratio to the 1-device run's, the voluntary context switches per step
 * and the OS threads the devices ran on, and the load average at the start: on a
 * shared machine the wall-clock ratios are only as good as the load lets
 * them be, and CPU time / step time shows how many cores the run got.
 *
 *   build/bench/step [STEPS [MAX_DEVICES]]   (4 steps; every row, or those of at most MAX_DEVICES) */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

#include "bench/lib/bench_host.h"
#include "blas_kernels/bk_roofline.h"
#include "models/core/train.h"

static const char *const MODEL[] = {
    "model_name=llama2-7b",   "override_model_config=true", "base_emb_dim=512",
    "base_num_query_heads=8", "base_num_kv_heads=8",        "head_dim=64",
    "base_mlp_dim=1536",      "base_num_decoder_layers=4",  "vocab_size=4096",
    "max_target_length=256",
};
enum { NMODEL = sizeof MODEL / sizeof MODEL[0], ROWS = 8 };

typedef struct {
    const char *label;
    const char *flags[4];
    int devices;
} config;

static double cpu_seconds(void)
{
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return (double)ru.ru_utime.tv_sec + 1e-6 * (double)ru.ru_utime.tv_usec + (double)ru.ru_stime.tv_sec +
           1e-6 * (double)ru.ru_stime.tv_usec;
}

/* Voluntary context switches of the process (every thread's): a device thread that sleeps at a
 * collective makes one; devices running as fibers on a worker per core make few. */
static double voluntary_switches(void)
{
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return (double)ru.ru_nvcsw;
}

/* The process's CPU time and voluntary switches after each step (device 0 reports a step when it
 * has finished it; the others finish theirs within the same collectives). */
typedef struct {
    double *cpu, *switches;
    int steps;
} step_marks;

static void mark_step(const model_step_stats *s, void *arg)
{
    step_marks *k = arg;
    if (s->step < 0 || s->step >= k->steps) return;
    k->cpu[s->step] = cpu_seconds();
    k->switches[s->step] = voluntary_switches();
}

static double run(const config *c, int steps, double *flops, double *executed, double *cpu_per_step,
                  double *switches_per_step, int *threads)
{
    const char *argv[32];
    int argc = 0;
    for (int i = 0; i < NMODEL; i++) argv[argc++] = MODEL[i];
    for (int i = 0; i < 4 && c->flags[i]; i++) argv[argc++] = c->flags[i];
    char pdbs[64], st[32];
    snprintf(pdbs, sizeof pdbs, "per_device_batch_size=%g", (double)ROWS / c->devices);
    snprintf(st, sizeof st, "steps=%d", steps);
    argv[argc++] = pdbs;
    argv[argc++] = st;
    argv[argc++] = "learning_rate=1e-4";
    cfg_config *cfg;
    model_def def;
    model_data data;
    model_train_job job;
    memset(&job, 0, sizeof job);
    sim_machine *m;
    if (cfg_load_argv("configs/base.yml", argc, argv, &cfg) || model_def_from_config(cfg, &def) ||
        model_data_from_config(cfg, &data) || model_optim_from_config(cfg, &job.opt) ||
        model_machine_new(&def, 0, false, &m)) {
        fprintf(stderr, "bench/step: %s\n", sim_errmsg());
        exit(2);
    }
    const model_dims *d = &def.d;
    double mm = 0; /* matmul parameters: all but the embedding table and the norms */
    for (int i = 0; i < def.nparams; i++) {
        if (strstr(def.defs[i].path, "embedding") || strstr(def.defs[i].path, "scale")) continue;
        double e = 1;
        for (int k = 0; k < def.defs[i].rank; k++) e *= (double)def.defs[i].shape[k];
        mm += e;
    }
    double tokens = (double)d->batch * (double)d->seq;
    double attn = 2.0 * (double)d->batch * (double)d->seq * (double)d->seq * (double)d->q_heads * (double)d->head_dim *
                  (double)d->layers;
    *flops = 6 * mm * tokens + 3 * attn;
    /* remat recomputes each layer's forward: its matmuls (all but the logits) and attention, unless
     * the recomputation takes them from the forward (remat_recompute, d->remat_replay) */
    double layer_mm = mm - (double)d->emb * (double)d->vocab;
    *executed = *flops + (d->remat_full && !d->remat_replay ? 2 * layer_mm * tokens + attn : 0);
    job.def = &def;
    job.data = &data;
    job.steps = steps;
    job.stats = calloc((size_t)steps, sizeof *job.stats);
    /* CPU per step over the steps after the first, as the step time: start-up (the initial
     * parameters, the first step's plans and page faults) would weigh on few-step runs unequally */
    step_marks marks = {calloc((size_t)steps, sizeof(double)), calloc((size_t)steps, sizeof(double)), steps};
    job.on_step = mark_step;
    job.cb_arg = &marks;
    sim_status train_st = model_train(&job, m);
    *cpu_per_step = (marks.cpu[steps - 1] - marks.cpu[0]) / (steps - 1);
    *switches_per_step = (marks.switches[steps - 1] - marks.switches[0]) / (steps - 1);
    free(marks.cpu);
    free(marks.switches);
    *threads = sim_machine_threads(m);
    if (train_st != SIM_OK) {
        fprintf(stderr, "bench/step: %s\n", sim_errmsg());
        exit(1);
    }
    double best = 1e30;
    for (int s = 1; s < steps; s++)
        if (job.stats[s].time_s < best) best = job.stats[s].time_s;
    free(job.stats);
    sim_machine_free(m);
    model_data_close(&data);
    model_def_free(&def);
    cfg_free(cfg);
    return best;
}

int main(int argc, char **argv)
{
    bench_host_print(stdout);
    int steps = argc > 1 ? atoi(argv[1]) : 4;
    if (steps < 2) steps = 2;
    /* a second argument keeps the rows of at most that many devices (1: the single-device rows) */
    int max_devices = argc > 2 ? atoi(argv[2]) : 0;
    int cores = bk_num_cores();
    double peak = bk_sgemm_peak_gflops(cores);
    printf("sgemm peak, %d cores, measured now: %.1f GFLOP/s\n", cores, peak);
    double load[3] = {0, 0, 0};
    if (getloadavg(load, 3) == 3) printf("load average at the start: %.2f %.2f %.2f\n", load[0], load[1], load[2]);
    printf("\n");
    static const config configs[] = {
        {"1 device", {"ici_fsdp_parallelism=1"}, 1},
        {"1 device, recomputed", {"ici_fsdp_parallelism=1", "remat_recompute=always"}, 1},
        {"1 device, none unscanned", {"ici_fsdp_parallelism=1", "remat_policy=none", "scan_layers=false"}, 1},
        {"fsdp=8", {"ici_fsdp_parallelism=8"}, 8},
        {"fsdp=4 tensor=2", {"ici_fsdp_parallelism=4", "ici_tensor_parallelism=2"}, 8},
        {"data=2 fsdp=2 tensor=2", {"ici_data_parallelism=2", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2"}, 8},
        {"fsdp=8 tensor=8", {"ici_fsdp_parallelism=8", "ici_tensor_parallelism=8"}, 64},
    };
    printf("%-26s %10s %12s %12s %14s %12s %12s %10s %10s %8s\n", "mesh", "step (s)", "model GFLOP", "model/peak",
           "executed/peak", "/1-device", "cpu/step (s)", "cpu/1-dev", "vcsw/step", "threads");
    double t1 = 0, c1 = 0;
    for (size_t i = 0; i < sizeof configs / sizeof configs[0]; i++) {
        if (max_devices > 0 && configs[i].devices > max_devices) continue;
        double flops, executed, cpu, cs;
        int threads;
        double t = run(&configs[i], steps, &flops, &executed, &cpu, &cs, &threads);
        if (i == 0) t1 = t, c1 = cpu;
        printf("%-26s %10.3f %12.1f %12.2f %14.2f %12.2f %12.2f %10.2f %10.0f %8d\n", configs[i].label, t, flops / 1e9,
               flops / t / 1e9 / peak, executed / t / 1e9 / peak, t / t1, cpu, cpu / c1, cs, threads);
        fflush(stdout);
    }
    printf("\ntargets: 1 device (remat full, its recomputation taking the forward's values) model/peak >= 0.80;\n"
           "none unscanned (nothing recomputed) model/peak >= 0.85; 8 devices <= 1.05 and 64 devices <= 1.15 x the 1-device step time (the\n"
           "multi-device rows use the default remat_policy=full); 'recomputed': remat_recompute=always, the\n"
           "layers' forward computed twice (executed FLOPs include it)\n"
           "cpu/step: the process's CPU time (user + sys, all threads) per step after the first; cpu/1-dev: its\n"
           "ratio to the 1-device row's (a wall-clock ratio moves with the machine's load, this one much less)\n"
           "vcsw/step: voluntary context switches per step (all threads); threads: the OS threads the devices\n"
           "ran on (one per device, or a worker per core with the devices as fibers when they outnumber the cores)\n");
    return 0;
}
