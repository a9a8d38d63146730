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
#define BK_ASSERT(cond)                                                                  \
  do {                                                                                   \
    if (!(cond)) {                                                                       \
      fprintf(stderr, "%s:%d: BK_ASSERT failed: %s\n", __FILE__, __LINE__, #cond);       \
      abort();                                                                           \
    }                                                                                    \
  } while (0)

/* Same, with a printf-style explanation carrying the bad values. */
#define BK_ASSERTF(cond, ...)                                                            \
  do {                                                                                   \
    if (!(cond)) {                                                                       \
      fprintf(stderr, "%s:%d: BK_ASSERT failed: %s: ", __FILE__, __LINE__, #cond);      \
      fprintf(stderr, __VA_ARGS__);                                                      \
      fputc('\n', stderr);                                                               \
      abort();                                                                           \
    }                                                                                    \
  } while (0)

/* malloc that never returns NULL (kernel scratch is small: O(block^2) or O(row)). */
static inline void *bk_xmalloc(size_t bytes) {
  void *p = malloc(bytes ? bytes : 1);
  BK_ASSERTF(p != NULL, "out of memory allocating %zu bytes of kernel scratch", bytes);
  return p;
}

#endif /* BK_H */
