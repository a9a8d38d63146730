/* vjp_check.h — test support: an op on the autodiff tape checked against finite differences of
 * its own forward.  The op runs on a mesh with its inputs in the given shardings; the cotangent
 * of its output is a fixed pseudo-random array c, so each input's gradient is that of the scalar
 * f = sum(c * op(inputs)).  Central differences of f are taken on one device (the op's forward
 * alone, no tape) in double, over a spread of elements of every float input.  Failures end the
 * test (cmocka). */
#ifndef TESTS_VJP_CHECK_H
#define TESTS_VJP_CHECK_H

#include <stdbool.h>

#include "mesh/tape.h"

enum { VJP_MAX_IN = 5 };

/* Builds the op's output from its inputs (in the order of the case). */
typedef sim_status (*vjp_op)(mesh_tape *t, mesh_var *const *in, const void *arg, mesh_var **out);

typedef struct {
    const char *what;
    int nin;
    int rank[VJP_MAX_IN];
    int64_t shape[VJP_MAX_IN][4];
    const char *spec[VJP_MAX_IN];  /* PartitionSpec text on the mesh (NULL: replicated) */
    bool integer[VJP_MAX_IN];      /* an int32 input (token ids, targets, positions): no gradient */
    int32_t int_bound[VJP_MAX_IN]; /* integer inputs take values in [0, bound) */
    int out_rank;                  /* the output's global shape, as the op must make it */
    int64_t out_shape[4];
    float scale; /* float inputs take values in [-scale, scale] (0: 1) */
    vjp_op op;
    const void *arg;
} vjp_case;

/* Every float input's gradient on mesh m within tol (relative to the largest finite difference
 * of that input) of the finite differences; returns the worst relative difference. */
double vjp_check(const vjp_case *c, const mesh_shape *m, double tol);

#endif
