/* bk.h — common definitions of the blas_kernels layer.
 *
 * blas_kernels is the bottom layer: local math on plain row-major float32 buffers, forward and
 * backward, each fast kernel with a naive `_ref` twin (plain loops, double accumulation) for tests.
 * It knows nothing else in the project. Kernels return void: a broken contract (bad dims, a NULL
 * buffer, an index out of range) is a programming error caught by the always-on BK_ASSERT.
 */
#ifndef BK_H
#define BK_H

#include <stdio.h>
#include <stdlib.h>

/* Always on (not tied to NDEBUG): prints the condition and file:line, then aborts. */
#define BK_ASSERT(cond)                                                                                                \
    do {                                                                                                               \
        if (!(cond)) {                                                                                                 \
            fprintf(stderr, "%s:%d: BK_ASSERT failed: %s\n", __FILE__, __LINE__, #cond);                               \
            abort();                                                                                                   \
        }                                                                                                              \
    } while (0)

/* Same, with a printf-style explanation carrying the bad values. */
#define BK_ASSERTF(cond, ...)                                                                                          \
    do {                                                                                                               \
        if (!(cond)) {                                                                                                 \
            fprintf(stderr, "%s:%d: BK_ASSERT failed: %s: ", __FILE__, __LINE__, #cond);                               \
            fprintf(stderr, __VA_ARGS__);                                                                              \
            fputc('\n', stderr);                                                                                       \
            abort();                                                                                                   \
        }                                                                                                              \
    } while (0)

/* BK_CLONES before a hot elementwise function compiles it three times, for AVX-512, AVX2 and the
 * baseline x86-64, and lets the loader pick the widest the CPU has (GCC's target_clones): the
 * build stays portable and this machine's wide vectors are used.  Every clone runs the same float
 * operations in the same order (no reassociation, and -std=c11 keeps a*b+c as two roundings, never
 * a fused FMA), so the results are the same bits whichever clone runs.  Reductions stay in scalar
 * order or in explicit lanes written out in the source.  BK_NO_CLONES keeps only the baseline. */
/* ThreadSanitizer crashes in the loader's ifunc resolvers, which run before its runtime is up:
 * its builds keep the baseline only. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && !defined(BK_NO_CLONES) &&                       \
    !defined(__SANITIZE_THREAD__)
#define BK_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define BK_CLONES
#endif

/* malloc that never returns NULL (kernel scratch is small: O(block^2) or O(row)). */
static inline void *bk_xmalloc(size_t bytes)
{
    void *p = malloc(bytes ? bytes : 1);
    BK_ASSERTF(p != NULL, "out of memory allocating %zu bytes of kernel scratch", bytes);
    return p;
}

#endif /* BK_H */
