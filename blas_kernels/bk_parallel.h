/* bk_parallel.h — a small pool of worker threads for the kernels that are
 * not sgemm (elementwise ops, attention tiles, optimizer updates), so a
 * device that owns several cores uses them outside OpenBLAS too.
 *
 * Work is cut into chunks of a fixed `grain` that does not depend on the
 * thread count: each chunk computes the same thing whichever thread runs it,
 * so results are bitwise identical for any number of threads.  Waiting
 * blocks on condition variables (no spinning).  With 1 thread (the default,
 * and whenever a caller finds the pool busy) chunks run inline in order. */
#ifndef BK_PARALLEL_H
#define BK_PARALLEL_H

#include <stddef.h>
#include <stdint.h>

/* Threads to use, the caller included (1 = inline).  Call from one thread
 * while no kernel runs (e.g. when a simulated machine is made).  The
 * environment variable SHARDSIM_KERNEL_THREADS, when set, overrides n. */
void bk_parallel_set_threads(int n);
int bk_parallel_threads(void);

/* fn(lo, hi, arg) for consecutive chunks [lo, hi) of [0, n), each at most
 * `grain` long; returns when all are done. */
typedef void (*bk_range_fn)(int64_t lo, int64_t hi, void *arg);
void bk_parallel_for(int64_t n, int64_t grain, bk_range_fn fn, void *arg);

/* memset(p, 0, bytes) in chunks on the pool (inline below two chunks): zeroing a big cotangent or
 * gradient buffer, and taking its first-touch page faults, on all the device's cores. */
void bk_parallel_zero(void *p, size_t bytes);
/* memcpy(dst, src, bytes) the same way (the buffers must not overlap). */
void bk_parallel_copy(void *dst, const void *src, size_t bytes);

#endif
