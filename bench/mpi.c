/* mpi.c — one 8-device simulation run in one process and spread over R = 1, 2, 4 MPI ranks
 * (`mpirun -np R shardsim train`, sim/xrank.h) on this machine: the fastest step after the first,
 * the largest resident memory of one process (a rank), the CPU time of the whole job, and the bytes
 * the ranks sent each other per step; the printed losses must equal the one-process run's (exit 1).
 *
 * Then the largest configuration that runs with R ranks but not with one: each process gets the
 * host memory the one-process run of that model needs (SHARDSIM_HOST_MEMORY_BYTES: every rank a
 * host of that size, as on R machines), and the decoder layers grow.  A rank's need is what
 * shardsim's host-memory check computes before a real run (its share of the devices' dry-run
 * peaks, the arenas' reuse cache, host buffers), read from the check's refusal at 4 and 8 layers
 * (it is linear in the layers, the fit then stepped to the edge of the check's own figures); the
 * R = 4 model is run for real (one step: the check lets it through) to show its RSS per rank
 * against the budget, where the same model in one process is refused.
 *
 * Model: bench/step.c's (llama2-7b with emb 512, 8 heads of 64, mlp 1536, 4 layers, vocab 4096,
 * 256 tokens) over fsdp=4 tensor=2, a global batch of 8 sequences.  Each run is a child process;
 * its memory is the child's ru_maxrss (the largest of it and the processes it waited for: the
 * ranks).  One run each on a shared machine: compare rows of one table only.  Skipped, with a
 * message, without MPI or mpirun. */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "blas_kernels/bk_coretype.h"
#include "sim/xrank.h"

#define MPI_ENV                                                                                                        \
    "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1 "                   \
    "OMPI_MCA_btl_vader_single_copy_mechanism=none OMPI_MCA_hwloc_base_binding_policy=none "

static const char ARGS[] = "model_name=llama2-7b override_model_config=true base_emb_dim=512 base_num_query_heads=8 "
                           "base_num_kv_heads=8 head_dim=64 base_mlp_dim=1536 base_num_decoder_layers=4 "
                           "vocab_size=4096 max_target_length=256 per_device_batch_size=1 ici_fsdp_parallelism=4 "
                           "ici_tensor_parallelism=2";

typedef struct {
    int rc;
    double wall, cpu, step, mb;
    double loss[16];
    int nloss;
    unsigned long long xbytes; /* per step, as the MPI section prints it */
} result;

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* Runs cmd (stdout into path) in a child shell; reads its step lines and MPI section back. */
static result run(const char *cmd, const char *path)
{
    result r;
    memset(&r, 0, sizeof r);
    fflush(stdout);
    double t0 = now();
    pid_t pid = fork();
    if (pid == 0) {
        if (!freopen(path, "w", stdout) || !freopen("/dev/null", "w", stderr)) _exit(127);
        execl("/bin/sh", "sh", "-c", cmd, (char *)NULL);
        _exit(127);
    }
    int status = 0;
    struct rusage ru;
    if (pid < 0 || wait4(pid, &status, 0, &ru) < 0) {
        perror("mpi: fork/wait");
        exit(1);
    }
    r.wall = now() - t0;
    r.cpu = (double)ru.ru_utime.tv_sec + 1e-6 * (double)ru.ru_utime.tv_usec + (double)ru.ru_stime.tv_sec +
            1e-6 * (double)ru.ru_stime.tv_usec;
    r.mb = (double)ru.ru_maxrss * 1024.0 / 1e6;
    r.rc = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    FILE *f = fopen(path, "r");
    char line[1024];
    bool steps = false;
    while (f && fgets(line, sizeof line, f)) {
        int s;
        double loss, gn, rn, lr, t;
        if (strstr(line, "tokens/s")) {
            steps = true;
            continue;
        }
        if (steps && sscanf(line, " %d %lf %lf %lf %lf %lf", &s, &loss, &gn, &rn, &lr, &t) == 6) {
            if (r.nloss < 16) r.loss[r.nloss++] = loss;
            if (s > 0 && (r.step == 0 || t < r.step)) r.step = t;
        } else {
            steps = false;
        }
        unsigned long long b;
        if (sscanf(line, " %llu bytes (", &b) == 1 && strstr(line, "in each of")) r.xbytes = b;
    }
    if (f) fclose(f);
    return r;
}

/* The bench model without its layer count: base_num_decoder_layers is appended. */
static void args_with_layers(int layers, char *buf, size_t cap)
{
    char *a = strdup(ARGS), *at = strstr(a, "base_num_decoder_layers=4 ");
    if (at)
        memmove(at, at + strlen("base_num_decoder_layers=4 "), strlen(at + strlen("base_num_decoder_layers=4 ")) + 1);
    snprintf(buf, cap, "%s base_num_decoder_layers=%d", a, layers);
    free(a);
}

/* "34.51 GiB" / "14.3 MiB" -> bytes (0 when it is neither). */
static double parse_bytes(const char *s)
{
    double v;
    char unit[8];
    if (sscanf(s, "%lf %7s", &v, unit) != 2) return 0;
    if (!strncmp(unit, "GiB", 3)) return v * (double)(1ull << 30);
    if (!strncmp(unit, "MiB", 3)) return v * (double)(1ull << 20);
    return 0;
}

/* The host memory a rank of R (R = 0: one process) needs for `layers`, as the host-memory check
 * says when it refuses (budget 1 byte); 0 when it did not refuse. */
static double need(const char *prog, int R, int layers, const char *budget)
{
    char args[1024], cmd[4096], line[4096];
    args_with_layers(layers, args, sizeof args);
    if (R == 0)
        snprintf(cmd, sizeof cmd, "SHARDSIM_HOST_MEMORY_BYTES=%s %s train %s steps=1 2>&1 >/dev/null", budget, prog,
                 args);
    else
        snprintf(cmd, sizeof cmd,
                 MPI_ENV "SHARDSIM_HOST_MEMORY_BYTES=%s mpirun -q -np %d %s train %s steps=1 2>&1 >/dev/null", budget,
                 R, prog, args);
    FILE *p = popen(cmd, "r");
    double b = 0;
    while (p && fgets(line, sizeof line, p)) {
        const char *at = strstr(line, "this run needs about ");
        if (at) b = parse_bytes(at + strlen("this run needs about "));
    }
    if (p) pclose(p);
    return b;
}

/* The largest configuration that runs with R ranks but not with one (see the header). */
static int largest(const char *prog, const char *path)
{
    double n4 = need(prog, 0, 4, "1");
    if (n4 <= 0) {
        printf("largest: the host-memory check gave no figure (no /proc/meminfo?): skipped\n");
        return 1;
    }
    unsigned long long budget = (unsigned long long)n4 + (1ull << 20);
    char bs[32];
    snprintf(bs, sizeof bs, "%llu", budget);
    printf("\nthe largest model that runs with R ranks but not with one: each process may take %.1f MB (what the "
           "one-process run of the %d-layer model needs; SHARDSIM_HOST_MEMORY_BYTES=%s), the decoder layers grow\n\n",
           (double)budget / 1e6, 4, bs);
    printf("%-14s %8s %18s %24s\n", "run", "layers", "need/rank (MB)", "need at layers+1 (MB)");
    const int Rs[] = {0, 2, 4};
    int best[3] = {0, 0, 0}, bad = 0;
    double per_rank[3] = {0, 0, 0};
    for (int i = 0; i < 3; i++) {
        double a = need(prog, Rs[i], 4, "1"), b = need(prog, Rs[i], 8, "1");
        if (a <= 0 || b <= a) {
            printf("%-14s the check's figures did not grow with the layers (%.0f, %.0f): FAILED\n", "", a, b);
            bad++;
            continue;
        }
        double slope = (b - a) / 4.0;
        int L = 4 + (int)(((double)budget - a) / slope);
        /* the fit is to the check's rounded figures: step to the edge its figures draw */
        while (L > 1 && need(prog, Rs[i], L, "1") > (double)budget) L--;
        while (need(prog, Rs[i], L + 1, "1") <= (double)budget) L++;
        best[i] = L;
        per_rank[i] = need(prog, Rs[i], L, "1");
        char label[32];
        snprintf(label, sizeof label, Rs[i] ? "mpirun -np %d" : "one process", Rs[i]);
        printf("%-14s %8d %18.1f %24.1f\n", label, L, per_rank[i] / 1e6, need(prog, Rs[i], L + 1, "1") / 1e6);
        fflush(stdout);
    }
    if (bad) return bad;
    /* the R = 4 model for real: it runs in the budget; in one process it is refused */
    char args[1024], cmd[4096];
    args_with_layers(best[2], args, sizeof args);
    double one = need(prog, 0, best[2], "1");
    snprintf(cmd, sizeof cmd, MPI_ENV "SHARDSIM_HOST_MEMORY_BYTES=%s mpirun -np 4 %s train %s steps=1", bs, prog, args);
    result r = run(cmd, path);
    printf("\n%d layers under mpirun -np 4, one step: %s in %.1f s, largest rank RSS %.1f MB against the %.1f MB "
           "budget (the check's need per rank %.1f MB; a rank's RSS also holds the program, its libraries and MPI's "
           "buffers); in one process it needs %.1f MB: %s\n",
           best[2], r.rc ? "FAILED" : "ran", r.wall, r.mb, (double)budget / 1e6, per_rank[2] / 1e6, one / 1e6,
           one > (double)budget ? "refused" : "NOT REFUSED");
    return r.rc != 0 || one <= (double)budget;
}

int main(int argc, char **argv)
{
    int steps = argc > 1 ? atoi(argv[1]) : 4;
    if (steps < 2) steps = 2;
    char prog[1024];
    ssize_t n = readlink("/proc/self/exe", prog, sizeof prog - 1);
    if (n <= 0) return 1;
    prog[n] = '\0';
    for (int up = 0; up < 2; up++) *strrchr(prog, '/') = '\0'; /* <build>/bench/mpi -> <build> */
    strcat(prog, "/shardsim");
    if (!sim_xrank_built() || system("command -v mpirun > /dev/null 2>&1") != 0) {
        printf("mpi: skipped: %s\n",
               sim_xrank_built() ? "mpirun is not installed (openmpi-bin)" : "this build has no MPI (SHARDSIM_MPI=0)");
        return 0;
    }
    char path0[64];
    snprintf(path0, sizeof path0, "/tmp/shardsim-bench-mpi.%d.txt", (int)getpid());
    if (argc > 2 && !strcmp(argv[2], "largest")) { /* `mpi STEPS largest`: the second table alone */
        int bad = largest(prog, path0);
        unlink(path0);
        return bad ? 1 : 0;
    }
    printf("OpenBLAS kernels: %s\n", bk_coretype_current()->summary);
    double load[3] = {0, 0, 0};
    if (getloadavg(load, 3) == 3) printf("load average at the start: %.2f %.2f %.2f\n", load[0], load[1], load[2]);
    printf("8 devices (fsdp=4 tensor=2), %d steps; step: the fastest after the first; RSS: the largest process\n\n",
           steps);
    printf("%-14s %9s %9s %9s %12s %9s %16s  %s\n", "run", "step (s)", "/1-proc", "wall (s)", "cpu (s)", "RSS (MB)",
           "MPI bytes/step", "losses");
    char path[64], cmd[2048];
    snprintf(path, sizeof path, "/tmp/shardsim-bench-mpi.%d.txt", (int)getpid());
    const int nps[] = {0, 1, 2, 4};
    result base;
    memset(&base, 0, sizeof base);
    int bad = 0;
    for (int i = 0; i < 4; i++) {
        if (nps[i] == 0) snprintf(cmd, sizeof cmd, "%s train %s steps=%d", prog, ARGS, steps);
        else snprintf(cmd, sizeof cmd, MPI_ENV "mpirun -np %d %s train %s steps=%d", nps[i], prog, ARGS, steps);
        result r = run(cmd, path);
        if (i == 0) base = r;
        bool same = r.rc == 0 && r.nloss == base.nloss && !memcmp(r.loss, base.loss, sizeof r.loss);
        bad += !same;
        char label[32];
        snprintf(label, sizeof label, nps[i] ? "mpirun -np %d" : "one process", nps[i]);
        printf("%-14s %9.3f %9.2f %9.2f %12.2f %9.1f %16llu  %s\n", label, r.step,
               base.step > 0 ? r.step / base.step : 0, r.wall, r.cpu, r.mb, r.xbytes,
               r.rc   ? "FAILED"
               : same ? "equal"
                      : "DIFFER");
        fflush(stdout);
    }
    unlink(path);
    bad += largest(prog, path);
    return bad ? 1 : 0;
}
