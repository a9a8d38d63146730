/* model_run.h — test support: one training run of a model from config words
 * (config, model definition, data, optimizer, job, simulated machine), as the
 * model tests open, train and close it.  Failures end the test (cmocka). */
#ifndef TESTS_MODEL_RUN_H
#define TESTS_MODEL_RUN_H

#include <stdbool.h>
#include <stdint.h>

#include "models/core/train.h"

typedef struct {
    cfg_config *cfg;
    model_def *def;
    model_data data;
    model_train_job job;
    sim_machine *m;
} model_run;

/* Starts a run on a loaded config and model (the run owns both from here):
 * data, optimizer, a job of `steps` steps and its machine. */
void model_run_start(model_run *r, cfg_config *cfg, model_def *def, long long steps);
/* Loads configs/base.yml with the words base[0..nbase), per_device_batch_size
 * = rows / devices, steps=steps (when steps > 0) and extra[0..n_extra), and
 * defines the model; fails the test if either is refused or the mesh has not
 * `devices` devices.  The config goes to *cfg_out (the caller frees it), or is
 * freed when cfg_out is NULL.  model_run_unload frees the model. */
model_def *model_run_load(const char *const *base, int nbase, int rows, const char *const *extra, int n_extra,
                          int devices, long long steps, cfg_config **cfg_out);
void model_run_unload(model_def *def);
/* model_run_load with the config kept, then model_run_start. */
void model_run_open(model_run *r, const char *const *base, int nbase, int rows, const char *const *extra, int n_extra,
                    int devices, long long steps);
/* Trains every step on a machine that records spans (the run's own machine replaced) and returns
 * the Chrome trace (sim/trace.h) as text, to free. */
char *model_run_train_traced(model_run *r);
/* Trains every step; with grads, keeps each step's gradients in job.step_grads. */
void model_run_train(model_run *r, bool grads);
void model_run_close(model_run *r);

/* Requires the same collective records on devices 0..devices-1 of a and b (count, and per record
 * op, phase, tag, axes, dtype, elements, bytes sent and received, implicit) and the same arena
 * figures (peak, live, allocations, and per category peak and share at the peak).  With
 * MODEL_RUN_DATA_ROUTED, a ragged all-to-all's bytes (which follow the routing, i.e. the data)
 * are not compared. */
enum { MODEL_RUN_DATA_ROUTED = 1 };
void model_run_expect_same_records(const char *what, const model_run *a, const model_run *b, int devices,
                                   unsigned flags);

/* Requires parity over the first `steps` steps (both runs trained with
 * gradients): each loss and every gradient within rtol 1e-4 of ref's; a
 * parameter without gradients (a non-trained variable) must have none in
 * both.  Prints the worst gradient difference. */
void model_run_compare(const char *what, const model_run *a, const model_run *ref, int steps);
/* Requires a refusal: the config words base[0..nbase), per_device_batch_size
 * = rows / devices, steps=1 and extra[0..n) fail with SIM_ERR_INPUT, either
 * when the model is defined or (a layout refusal) at the first step, with a
 * message naming both `key` and `also`. */
void model_run_expect_refused(const char *const *base, int nbase, int rows, const char *const *extra, int n,
                              int devices, const char *key, const char *also);
/* Elements of parameter i one device holds under `spec` (NULL: the parameter's own), derived from its
 * global shape and the sizes of the mesh axes the spec splits it by (not from any device's arrays). */
uint64_t model_run_shard_elems(const model_def *def, int i, const mesh_spec *spec);
/* A fixed token pattern for gradient checks: rows x seq ids below vocab, the
 * targets the same pattern one position on, positions 0..seq-1. */
void model_run_pattern(int rows, int seq, int vocab, int32_t *in, int32_t *tg, int32_t *pos);
/* The fixed token pattern of model_run_pattern as one batch of rows x seq tokens (at most
 * MODEL_RUN_BATCH_MAX), for gradient checks. */
enum { MODEL_RUN_BATCH_MAX = 8 * 64 };
typedef struct {
    int32_t in[MODEL_RUN_BATCH_MAX], tg[MODEL_RUN_BATCH_MAX], pos[MODEL_RUN_BATCH_MAX];
} model_run_batch;
void model_run_batch_make(model_run_batch *b, int rows, int seq, int vocab);
/* One loss-and-gradient evaluation of def on a fresh machine (parameters from
 * pin when given; pout and g as model_loss_and_grads_from fills them). */
double model_run_loss_grads(const model_def *def, const int32_t *in, const int32_t *tg, const int32_t *pos,
                            const model_grads *pin, model_grads *pout, model_grads *g);

#endif
