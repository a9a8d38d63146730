/* pipeline_run.h — the pipelined decoder stack (pipeline_run.c): the decoder
 * layers run as MaxText's layers/pipeline.py runs them, on the pipeline config
 * and schedule of pipeline.h.  Above model.h (it runs a family's layer
 * function on a device's model state), which only needs the config. */
#ifndef MODELS_PIPELINE_RUN_H
#define MODELS_PIPELINE_RUN_H

#include <stdint.h>

#include "models/core/model.h"

/* x (B, T, E) -> y (B, T, E): flat layer first_layer + (r*S + s)*L + l of fn
 * run by stage s in repeat r. */
sim_status model_pipeline_run(model_dev *md, mesh_tape *t, const model_batch *b, mesh_var *x, model_layer_fn fn,
                              int64_t first_layer, mesh_var **y);

#endif
