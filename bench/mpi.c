/* mpi.c — one 8-device simulation run in one process and spread over R = 1, 2, 4 MPI ranks
 * (`mpirun -np R shardsim train`, sim/xrank.h) on this machine: the fastest step after the first,
 * the largest resident memory of one process (a rank), the CPU time of the whole job, and the bytes
 * the ranks sent each other per step; the printed losses must equal the one-process run's (exit 1).
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

#define MPI_ENV                                                                                          \
    "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1 "    \
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
        printf("mpi: skipped: %s\n", sim_xrank_built() ? "mpirun is not installed (openmpi-bin)"
                                                       : "this build has no MPI (SHARDSIM_MPI=0)");
        return 0;
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
        if (nps[i] == 0)
            snprintf(cmd, sizeof cmd, "%s train %s steps=%d", prog, ARGS, steps);
        else
            snprintf(cmd, sizeof cmd, MPI_ENV "mpirun -np %d %s train %s steps=%d", nps[i], prog, ARGS, steps);
        result r = run(cmd, path);
        if (i == 0) base = r;
        bool same = r.rc == 0 && r.nloss == base.nloss && !memcmp(r.loss, base.loss, sizeof r.loss);
        bad += !same;
        char label[32];
        snprintf(label, sizeof label, nps[i] ? "mpirun -np %d" : "one process", nps[i]);
        printf("%-14s %9.3f %9.2f %9.2f %12.2f %9.1f %16llu  %s\n", label, r.step, base.step > 0 ? r.step / base.step : 0,
               r.wall, r.cpu, r.mb, r.xbytes, r.rc ? "FAILED" : same ? "equal" : "DIFFER");
        fflush(stdout);
    }
    unlink(path);
    return bad ? 1 : 0;
}
