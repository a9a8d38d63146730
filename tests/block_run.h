/* block_run.h — test support: one block of a model (attention, MLP, the dense layer, MLA) run alone
 * on every device of the model's mesh, as a family's layer runs it: the model's parameters on each
 * device (model_dev_init), a batch of positions 0..T-1, a given input x (B, T, E) in the residual
 * stream's sharding, and the block's VJP seeded with a given cotangent c.  The global output, the
 * input's gradient and the values and gradients of the parameters a test names come back on the
 * host, for a reference the test computes itself.  Failures end the test (cmocka). */
#ifndef TESTS_BLOCK_RUN_H
#define TESTS_BLOCK_RUN_H

#include "models/core/model.h"

enum { BLOCK_RUN_MAX_PARAMS = 16 };

/* The block: x -> *y on md's tape (arg: the test's block struct). */
typedef sim_status (*block_run_fn)(model_dev *md, mesh_tape *t, const model_batch *b, mesh_var *x, mesh_var **y,
                                   const void *arg);

typedef struct {
    const model_def *def; /* B = def->d.batch rows of T = def->d.seq tokens, width E = def->d.emb */
    block_run_fn fn;
    const void *arg;
    int layer;   /* the layer whose parameters are reported */
    int nparams; /* parameter indices reported (model_param_index) */
    int params[BLOCK_RUN_MAX_PARAMS];
    /* filled by block_run_check while it runs (and freed by it) */
    float *y;                         /* (B, T, E) */
    float *dx;                        /* d sum(c * y) / dx, (B, T, E) */
    float *w[BLOCK_RUN_MAX_PARAMS];   /* layer `layer` of each reported parameter, global */
    float *dw[BLOCK_RUN_MAX_PARAMS];  /* its gradient */
    int64_t wn[BLOCK_RUN_MAX_PARAMS]; /* its element count */
} block_run;

/* The test's reference of the block: x (B T, E) -> y (B T, E) in float64, reading the weights from
 * r->w[] (in the order of r->params; the central differences perturb them in place). */
typedef void (*block_run_ref)(const block_run *r, const void *arg, const double *x, double *y);

/* Runs the block on a fixed input x and cotangent c and requires its output within rtol (relative
 * to the largest value, which must not be zero) of the reference's, and the input's and every
 * reported parameter's gradient within gtol (relative to the largest difference) of central
 * differences of sum(c * reference(x)) at a spread of elements; then frees what the run made. */
void block_run_check(block_run *r, block_run_ref ref, const void *arg, double rtol, double gtol);

#endif
