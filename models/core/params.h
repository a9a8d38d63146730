/* params.h — model parameters as MaxText names and shapes them, and how a
 * device stores them.
 *
 * A parameter is described globally (model_param_def): its dotted MaxText
 * path ("params.decoder.layers.mlp.wi_0.kernel"), its global shape as MaxText
 * stores it — scanned layers stacked at dim `scan_dim` (1 in MaxText) — its
 * logical axis names, and its init.  Each device stores a scanned parameter
 * layer-major: one mesh_array per layer, whose global shape is the stacked
 * shape without the scan dim and whose spec is the stacked spec without the
 * scan dim (the scan dim maps to 'stage' or [] and is never split outside
 * pipelining).  Checkpoints and dumps show the stacked form. */
#ifndef MODELS_PARAMS_H
#define MODELS_PARAMS_H

#include "mesh/array.h"

enum { MODEL_PATH_MAX = 128, MODEL_MAX_LAYERS = 1024, MODEL_OPT_SLOTS_MAX = 4 };

typedef enum {
    MODEL_INIT_NORMAL = 0,   /* normal(0, scale^2) */
    MODEL_INIT_TRUNC_NORMAL, /* normal(0, scale^2) truncated to [-2, 2] standard deviations */
    MODEL_INIT_ONES,         /* norm scales */
    MODEL_INIT_ZEROS
} model_init_kind;

typedef struct {
    char path[MODEL_PATH_MAX];               /* dotted MaxText path */
    int rank;                                /* dims of the stacked global shape */
    int64_t shape[MESH_SPEC_MAX_RANK];       /* stacked global shape */
    const char *logical[MESH_SPEC_MAX_RANK]; /* logical axis name per dim (NULL = None) */
    int scan_dim;                            /* dim holding the layers, or -1 */
    model_init_kind init;
    double scale;   /* standard deviation for normal inits */
    bool state_var; /* a non-trainable variable (MaxText's MoEBiasVar gate
                                                    bias, an nnx.Variable, not an nnx.Param): no
                                                    gradient, no optimizer state; its layers are
                                                    stacked first whatever param_scan_axis says */
    bool unscanned; /* scan_layers=false: MaxText names layer l of the
                                                    stack S "S_l" and stores it unstacked (dumps,
                                                    checkpoints); storage here is the same */
} model_param_def;

typedef struct {
    model_param_def def;
    mesh_spec spec;          /* resolved spec of the stacked tensor (size-1 axes dropped) */
    mesh_spec spec_unpruned; /* with size-1 axes, for named_shardings.json */
    int n_layers;            /* shape[scan_dim], or 1 */
    int64_t stage_span;      /* pipeline: layers per stage per repeat (the scan dim's 'stage' blocks repeat
                              * every span*stages layers); 0: one contiguous block per stage */
    mesh_array *w;           /* [n_layers] values, layer-major (SIM_MEM_PARAMS) */
    mesh_array *g;           /* [n_layers] gradients (SIM_MEM_GRADS), or NULL */
    /* the optimizer's state as named slots (models/core/optimizer.h: the row names them, as optax's
     * state does: AdamW "mu", "nu"; a Muon leaf "mu"): slot[k] is [n_layers] (SIM_MEM_OPTIMIZER) for
     * k < n_slots, else NULL */
    int n_slots;
    const char *slot_name[MODEL_OPT_SLOTS_MAX];
    mesh_array *slot[MODEL_OPT_SLOTS_MAX];
} model_param;

/* The per-layer global shape/spec: the stacked ones without the scan dim. */
void model_param_layer_shape(const model_param *p, int *rank, int64_t *shape);
void model_param_layer_spec(const model_param *p, mesh_spec *spec);

/* The tensors MaxText has for a parameter: 1 when stacked (or not a layer weight), its layer
 * count when unscanned. */
int model_param_def_tensors(const model_param_def *d);
/* Tensor k of that list: the definition itself, or layer k as MaxText names and shapes it
 * unscanned ("params.decoder.layers.mlp.wo.kernel" -> "params.decoder.layers_3.mlp.wo.kernel",
 * the scan dim dropped from shape, logical names and `spec`; spec may be NULL). */
void model_param_def_tensor(const model_param_def *d, const mesh_spec *spec, int k, model_param_def *out,
                            mesh_spec *out_spec);
/* The same for a device's parameter: a view whose arrays are layer k's (not owned). */
void model_param_tensor_view(const model_param *p, int k, model_param *view);

/* The spec of the stacked tensor whose per-layer slices have spec `layer`:
 * an unsplit dim inserted at the scan dim (the layers of a device's
 * per-layer arrays side by side); p->spec's dims when there is no scan dim.
 * A pipelined parameter (stage_span > 0) keeps its 'stage' split on the scan
 * dim, and its stacked layers are in stage-major order (model_param_stack_layer),
 * so each stage's layers are one contiguous block. */
void model_param_stacked_spec(const model_param *p, const mesh_spec *layer, mesh_spec *out);
/* A stacked array (global shape p->def.shape, model_param_stacked_spec of the
 * layers' spec, category `cat`) holding a copy of the per-layer arrays. */
sim_status model_param_stack(sim_device *d, const mesh_shape *m, const model_param *p, const mesh_array *layers,
                             const char *name, sim_mem_cat cat, mesh_array *out);
/* Copies the layers of such a stacked array back into the per-layer arrays
 * (a pipelined parameter: only the layers device d's stage holds). */
void model_param_unstack(sim_device *d, const mesh_shape *m, const model_param *p, const mesh_array *stacked,
                         mesh_array *layers);
/* The layer at position q of the stacked scan dim: q itself, or for a
 * pipelined parameter (S stages, L = stage_span layers per stage and repeat,
 * R repeats) the stage-major order q = (s*R + r)*L + j of the flat layer
 * (r*S + s)*L + j.  MaxText stacks the same layers [R, S, ...] per layer of a
 * stage; the stage-major order puts each stage's block (and, inside it, each
 * repeat's) contiguous, so 'stage' (and ZeRO-1's 'data' on MaxText's repeat
 * dim) are plain block splits of this dim. */
int64_t model_param_stack_layer(const mesh_shape *m, const model_param *p, int64_t q);
/* Whether device `device` holds layer l of p (always, unless pipelined). */
bool model_param_holds_layer(const mesh_shape *m, const model_param *p, int device, int64_t l);

/* ZeRO-1's optimizer-state spec of a stacked parameter (MaxText's
 * sharding.add_data_to_sharding), from its spec WITH size-1 axes (and giving
 * it with them, for the dumps): unchanged when 'data' is absent from the mesh
 * or already used; otherwise 'data' is prepended to the first dim whose
 * per-shard size is divisible by the data size and whose axes do not include
 * 'tensor' of size > 1 (MaxText 0.2.5 applies the rule to its NNX state's
 * specs, from which size-1 axes are removed), or nothing changes when no dim
 * qualifies. */
void model_zero1_spec(const mesh_shape *m, int rank, const int64_t *shape, const mesh_spec *unpruned, mesh_spec *out);

#endif
