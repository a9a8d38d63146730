/* bk_roofline.h — measured sgemm throughput of this machine, the compute roof against which
 * benchmarks report achieved/peak ratios (stable on a noisy shared machine).
 * Changes the OpenBLAS thread count while measuring and restores it after: call from the main
 * thread while no other thread runs sgemm.
 */
#ifndef BK_ROOFLINE_H
#define BK_ROOFLINE_H

/* Online cores (sysconf), at least 1. */
int bk_num_cores(void);

/* GFLOP/s (2*M*N*K flops per product) of C = A B (row-major float32) on `threads` OpenBLAS
 * threads (<= 0: all cores): one warm-up, then the best run over at least min_seconds and at
 * least 3 runs. */
double bk_sgemm_gflops(int threads, int M, int N, int K, double min_seconds);

/* Peak: the best of 1024^3 and 2048^3 products, ~1 s. */
double bk_sgemm_peak_gflops(int threads);

#endif /* BK_ROOFLINE_H */
