/* batchsplit.h — MaxText's DeepSeek batch-split schedule (use_batch_split_schedule;
 * models/deepseek_batchsplit.py, reference/maxtext-facts-2.md §B) for the MoE layers:
 * each device splits its rows into two interleaved microbatches; per layer the
 * layer's weights are all-gathered over fsdp (counted in `dtype`, as MaxText casts
 * them before the gather), attention and then the MoE run microbatch by
 * microbatch (trace spans and collective tags carry mb0 / mb1), tokens are
 * dispatched by an all-gather over `expert` and combined by a reduce-scatter,
 * and the weight gradients are reduce-scattered over fsdp, summed over `expert`
 * for the non-routed weights, then over `data` in a separate step.  Routing is
 * the schedule's own: sigmoid scores, group-limited (top-2 per group), weights
 * normalised without an epsilon, applied to the expert's intermediate. */
#ifndef MODELS_BATCHSPLIT_H
#define MODELS_BATCHSPLIT_H

#include "models/core/model.h"
#include "models/families/deepseek_dims.h"

/* Reads batch_split_factor, the routing groups and dtype, and refuses what the
 * schedule does not run as MaxText runs it (errors name the key and the fix).
 * Called once the parameters are defined; a no-op with the schedule off. */
sim_status batchsplit_setup(model_def *m, const mesh_cfg *cfg);

/* One MoE layer (global index gl) under the schedule, rematerialised as a whole
 * in backward (weights gathered again, as MaxText's backward does).  As in
 * MaxText the weights are gathered one layer ahead: the forward of layer l
 * gathers layer l+1's (the first layer gathers its own), the backward of layer l
 * gathers layer l-1's, so two layers' gathered weights are alive at the peak. */
sim_status batchsplit_layer(model_dev *md, mesh_tape *t, const model_batch *b, int gl, mesh_var *x, mesh_var **y,
                            mesh_var **aux);

/* Releases the weights a device gathered ahead and has not used (model_dev_free calls it). */
void batchsplit_dev_free(model_dev *md);

#endif
