/* plan.c — `shardsim plan` for three models, run as a user runs it (the program as a child
 * process): the time to the full ranking, the candidates it considered and dry-ran, and
 * candidates per second, against the targets (llama2-7b on v5p-8 under 5 s; deepseek3-671b on
 * v5p-256 under 60 s with at least 500 candidates considered).  Benchmark, not a test: prints
 * the table and exits 0 unless a run fails to start. */
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

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

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
    return 0;
}
