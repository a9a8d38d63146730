/* pipeline.h — pipeline parallelism as MaxText's layers/pipeline.py runs it
 * (reference/maxtext-facts.md §7, maxtext-facts-2.md §C).
 *
 * The config is derived as MaxText derives it (stages S over the `stage`
 * axis, layers per stage L, repeats R, microbatches M, forwarding delay d);
 * the decoder layers' weights are stacked [R, S, L, ...] (flat layer index
 * (r*S + s)*L + l) and each device holds only its stage's layers.  The
 * schedule is one loop of M*R + d*(S-1) iterations in a manual region over
 * `stage` (shard_map): each device runs its stage's layers on its slot of the
 * `shift` buffer, and the `shift`, `state_io` and `circ_storage` buffers move
 * with real ppermutes with MaxText's pairs.  Backward walks the iterations in
 * reverse (ppermute's transpose is the inverse permutation), recomputing each
 * layer from its saved input (MaxText's iteration remat saves
 * iteration_input and decoder_layer_input). */
#ifndef MODELS_PIPELINE_H
#define MODELS_PIPELINE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "config/config.h"
#include "mesh/mesh_shape.h"
#include "sim/status.h"

typedef struct {
    bool on;                  /* S > 1: the decoder layers run as a pipeline */
    int stage_axis;           /* mesh axis index of `stage`, -1 when absent */
    int64_t stages;           /* S = ici x dcn pipeline parallelism */
    int64_t layers_per_stage; /* L = num_layers_per_pipeline_stage */
    int64_t repeats;          /* R = num_pipeline_repeats (derived when -1) */
    int64_t microbatches;     /* M = num_pipeline_microbatches (derived when -1) */
    int64_t layers;           /* pipeline_parallel_layers (derived when -1) = S * R * L */
    int64_t delay;            /* d: 2 with pipeline_delay_activation_forwarding, else 1 */
    int64_t micro_rows;       /* rows of one microbatch (batch / M) */
    bool ag_once;             /* pipeline_fsdp_ag_once */
    bool ag_per_repeat;       /* pipeline_fsdp_ag_per_repeat */
    bool circ_storage;        /* R > 1 and M > S * d: the circ_storage buffer is used */
} model_pipe;

/* Derives and checks the pipeline keys.  decoder_layers: the pipelined
 * stack's size; batch: rows trained per step.  Every violated rule is an
 * input error naming the keys, their values and a valid choice; pipeline
 * features not implemented yet are refused the same way. */
sim_status model_pipe_from_config(const cfg_config *cfg, const mesh_shape *mesh, int64_t decoder_layers, int64_t batch,
                                  model_pipe *out);

/* Iterations of one pipeline call: M*R + d*(S-1). */
int64_t model_pipe_iterations(const model_pipe *p);
/* Stage s at iteration i: microbatches processed k = max(i - d*s, 0), its
 * microbatch k % M and repeat k / M (not clamped: >= R in cool-down). */
void model_pipe_ids(const model_pipe *p, int64_t i, int64_t s, int64_t *micro, int64_t *repeat);
/* Whether stage s computes a bubble (warm-up or cool-down) at iteration i. */
bool model_pipe_is_bubble(const model_pipe *p, int64_t i, int64_t s);
/* Stage holding flat layer l: (l / L) % S. */
int64_t model_pipe_layer_stage(const model_pipe *p, int64_t l);
/* ppermutes of [mb, seq, emb] slots per iteration per direction (2, or 3 with circ_storage). */
int model_pipe_ppermutes_per_iteration(const model_pipe *p);
/* MaxText's bubble fraction d*(S-1) / (M*R + d*(S-1)). */
double model_pipe_bubble_fraction(const model_pipe *p);
/* One line: "pipeline: S=2 R=1 M=4 d=1 iterations=5 bubble=0.200 (...)". */
void model_pipe_describe(const model_pipe *p, char *buf, size_t cap);

#endif
