/* plan.c — `shardsim plan` for three models, run as a user runs it (the program as a child
 * process): the time to the full ranking, the candidates it considered and dry-ran, and
 * candidates per second, against the targets (llama2-7b on v5p-8 under 5 s; deepseek3-671b on
 * v5p-256 under 60 s with at least 500 candidates considered).  Then the check against seed 000
 * (/work/shared/reference/seed-measurements.md: deepseek3-test on v5p-8, MaxText's auto mode,
 * measured 2014 ms FSDP2+TP2 < 2238 ms FSDP4 < 10743 ms FSDP2+TPT2): plan with each of the three
 * meshes fixed (remat full, auto, no accumulation: the seed's command lines) and the order of the
 * three modelled step times against the measured order.  (The seed's explicit rows cannot be
 * compared: MaxText 0.2.5 refuses explicit TP2 and TPT2, and so does plan.)  Benchmark, not a test:
 * prints the tables and exits 0 unless a run fails to start. */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct {
    const char *name, *args;
    double target_s;
} row;

static const row ROWS[] = {
    {"llama2-7b v5p-8",
     "model_name=llama2-7b compile_topology=v5p-8 compile_topology_num_slices=1 per_device_batch_size=1", 5},
    {"deepseek2-16b v5p-16",
     "model_name=deepseek2-16b compile_topology=v5p-16 compile_topology_num_slices=1 "
     "per_device_batch_size=1",
     60},
    {"deepseek3-671b v5p-256",
     "model_name=deepseek3-671b compile_topology=v5p-256 compile_topology_num_slices=1 "
     "per_device_batch_size=1",
     60},
};

/* A child's whole output (NULL when it cannot start); *rc its status. */
static char *run_capture(const char *cmd, int *rc)
{
    FILE *p = popen(cmd, "r");
    if (!p) return NULL;
    size_t cap = 1 << 20, n = 0, k;
    char *out = malloc(cap);
    if (!out) {
        pclose(p);
        return NULL;
    }
    while ((k = fread(out + n, 1, cap - 1 - n, p)) > 0) n += k;
    out[n] = '\0';
    *rc = pclose(p);
    return out;
}

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* Seed 000's auto rows: the mesh words and the measured step time (ms). */
typedef struct {
    const char *name, *words;
    double measured_ms;
} seed_row;

static const seed_row SEED000[] = {
    {"FSDP2+TP2", "ici_fsdp_parallelism=2 ici_tensor_parallelism=2", 2014},
    {"FSDP4", "ici_fsdp_parallelism=4", 2238},
    {"FSDP2+TPT2", "custom_mesh_and_rule=legacy ici_fsdp_parallelism=2 ici_tensor_transpose_parallelism=2", 10743},
};

/* The number before `label` in text, or -1. */
static long long number_before(const char *text, const char *label)
{
    const char *p = strstr(text, label);
    if (!p) return -1;
    while (p > text && p[-1] == ' ') p--;
    const char *q = p;
    while (q > text && q[-1] >= '0' && q[-1] <= '9') q--;
    return q < p ? atoll(q) : -1;
}

int main(int argc, char **argv)
{
    const char *prog = argc > 1 ? argv[1] : "build/shardsim";
    printf("%-24s %10s %12s %10s %12s %8s %7s\n", "plan", "time (s)", "considered", "dry-run", "cand/s", "target",
           "ratio");
    for (size_t i = 0; i < sizeof ROWS / sizeof ROWS[0]; i++) {
        char cmd[1024];
        snprintf(cmd, sizeof cmd, "%s plan %s 2>/dev/null", prog, ROWS[i].args);
        double t0 = now();
        FILE *p = popen(cmd, "r");
        if (!p) {
            fprintf(stderr, "bench/plan: cannot run %s\n", cmd);
            return 1;
        }
        size_t cap = 1 << 20, n = 0;
        char *out = malloc(cap);
        if (!out) return 1;
        size_t k;
        while ((k = fread(out + n, 1, cap - 1 - n, p)) > 0) n += k;
        out[n] = '\0';
        int rc = pclose(p);
        double dt = now() - t0;
        long long considered = number_before(out, "candidates considered");
        long long ran = number_before(out, "dry-run:");
        printf("%-24s %10.1f %12lld %10lld %12.0f %7.0fs %7.2f%s\n", ROWS[i].name, dt, considered, ran,
               considered > 0 ? (double)considered / dt : 0, ROWS[i].target_s, dt / ROWS[i].target_s,
               rc == -1 ? "  (did not run)" : "");
        free(out);
    }
    printf("time: wall seconds to the full ranking (the program, as a child); considered: every candidate "
           "enumerated; dry-run: those simulated (sampled layers or in full); ratio: time / target\n");

    /* seed 000: the plan's order of the three meshes against the measured order */
    enum { NSEED = sizeof SEED000 / sizeof SEED000[0] };
    double ms[NSEED];
    printf("\nseed 000 (deepseek3-test, v5p-8, auto): plan with the mesh fixed\n%-12s %14s %14s\n", "mesh",
           "modelled (ms)", "measured (ms)");
    for (int i = 0; i < NSEED; i++) {
        char cmd[1024];
        snprintf(cmd, sizeof cmd,
                 "%s plan model_name=deepseek3-test compile_topology=v5p-8 compile_topology_num_slices=1 "
                 "per_device_batch_size=1 remat_policy=full shard_mode=auto gradient_accumulation_steps=1 %s "
                 "2>/dev/null",
                 prog, SEED000[i].words);
        int rc = 0;
        char *out = run_capture(cmd, &rc);
        if (!out) {
            fprintf(stderr, "bench/plan: cannot run %s\n", cmd);
            return 1;
        }
        const char *top = strstr(out, "  #1 ");
        ms[i] = top ? atof(top + 5) : -1;
        printf("%-12s %14.1f %14.0f%s\n", SEED000[i].name, ms[i], SEED000[i].measured_ms,
               top ? "" : "  (no ranked candidate)");
        free(out);
    }
    bool same = true;
    for (int i = 0; i < NSEED; i++)
        for (int j = 0; j < NSEED; j++)
            if (ms[i] < 0 || ((ms[i] < ms[j]) != (SEED000[i].measured_ms < SEED000[j].measured_ms))) same = false;
    printf("order of the modelled step times against the measured order: %s\n", same ? "same" : "DIFFERENT");
    return 0;
}
