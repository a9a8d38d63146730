/* bench_host.c — the machine a benchmark ran on (see bench_host.h). */
#include "bench/lib/bench_host.h"

#include "blas_kernels/bk_coretype.h"

void bench_host_print(FILE *out)
{
    char cpu[512];
    fprintf(out, "OpenBLAS kernels: %s\n", bk_coretype_current()->summary);
    fprintf(out, "CPU: %s\n", bk_cpu_describe(cpu, sizeof cpu));
}
