/* bench_host.h — the header line every benchmark starts with: which machine
 * kind made the figures (the CPU's model and vector features) and which
 * OpenBLAS kernels ran, so figures from different kinds are never compared
 * by mistake. */
#ifndef BENCH_LIB_BENCH_HOST_H
#define BENCH_LIB_BENCH_HOST_H

#include <stdio.h>

/* "OpenBLAS kernels: <bk_coretype summary>" and "CPU: <bk_cpu_describe>", one line each. */
void bench_host_print(FILE *out);

#endif
