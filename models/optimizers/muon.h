/* muon.h — MaxText's opt_type=muon: optax.contrib.muon with the parameter
 * classification of MaxText's muon_utils, run on sharded weights.
 *
 * Classification (muon_utils.transform_logic; the rules are data in
 * configs/muon.yml): norm scales, embeddings, the output head and biases go
 * to AdamW; routed experts (-2), (-1); the router (0), (-1) (AdamW with
 * muon_include_routers=false); attention query/key/value/wq_b/wkv_b (0),
 * (-2, -1) and out (0, -2), (-1); anything else (MLPs, shared experts, MLA
 * wq_a/wkv_a) (0), (-1).  Every other dim (the stacked-layer dim, the expert
 * dim) is a batch dim.
 *
 * Update of a Muon leaf (optax scale_by_muon, scale_by_shape,
 * add_decayed_weights, scale_by_learning_rate), t = s + 1:
 *   mu <- (1 - beta) g + beta mu
 *   X  =  beta (mu / (1 - beta^(t+1))) + (1 - beta) (g / (1 - beta^t))   (nesterov)
 *   per matrix of the batch (rows = the smaller of the reduction and output
 *   groups, as optax transposes when R > O):
 *   X <- X / (||X||_F + adam_eps); 5 times: A = X X^T, B = b A + c A A, X <- a X + B X
 *   with (a, b, c) = (3.4445, -4.7750, 2.0315)
 *   u = scale X + muon_weight_decay W,  W <- W - lr(s) u
 *   scale = sqrt(max(1, O / R)), or muon_consistent_rms * sqrt(max(R, O)).
 * AdamW leaves get optax.adamw(nesterov=True) with adam_b1/b2/eps/eps_root and
 * adam_weight_decay (no mask), on the same schedule.
 *
 * The Newton–Schulz iteration runs as mesh ops (einsum, elementwise, sums) in
 * auto placement on the whole stacked leaf, so its collectives are those a
 * partitioner inserts for the weight's sharding: none when only batch dims
 * are sharded, an all-reduce of the Gram matrix per step when the long
 * (contracted) dim is sharded, all-gathers when the short dim is. */
#ifndef MODELS_MUON_H
#define MODELS_MUON_H

#include <stdbool.h>

#include "config/config.h"
#include "mesh/ctx.h"
#include "models/core/params.h"
#include "models/optimizers/optim.h" /* the table: its row and opt_type numbers */

enum { MODEL_MUON_NS_STEPS = 5 };

/* MaxText's classification rules, read from <configs>/muon.yml (see that file). */
enum { MODEL_MUON_LIST_MAX = 16, MODEL_MUON_NAME_MAX = 32 };
typedef enum {
    MODEL_MUON_ADAMW_CONTAINS = 0,
    MODEL_MUON_ADAMW_EQUALS,
    MODEL_MUON_ADAMW_SUFFIXES,
    MODEL_MUON_ADAMW_SUFFIX_EXCEPT,
    MODEL_MUON_MOE_BLOCKS,
    MODEL_MUON_SHARED_EXPERTS,
    MODEL_MUON_EXPERT_WEIGHTS,
    MODEL_MUON_ROUTERS,
    MODEL_MUON_GROUPED,
    MODEL_MUON_ATTN_BLOCKS,
    MODEL_MUON_ATTN_QKV,
    MODEL_MUON_ATTN_OUT,
    MODEL_MUON_ATTN_OUT_BLOCKS,
    MODEL_MUON_NLISTS
} model_muon_list;
typedef enum {
    MODEL_MUON_DIMS_EXPERT = 0,
    MODEL_MUON_DIMS_ROUTER,
    MODEL_MUON_DIMS_GROUPED,
    MODEL_MUON_DIMS_QKV,
    MODEL_MUON_DIMS_OUT,
    MODEL_MUON_DIMS_STANDARD,
    MODEL_MUON_NDIMS
} model_muon_rule_dims;
typedef struct {
    int n[MODEL_MUON_NLISTS]; /* names per list */
    char name[MODEL_MUON_NLISTS][MODEL_MUON_LIST_MAX][MODEL_MUON_NAME_MAX];
    int n_red[MODEL_MUON_NDIMS], n_out[MODEL_MUON_NDIMS];   /* dimension numbers per class */
    int red[MODEL_MUON_NDIMS][4], out[MODEL_MUON_NDIMS][4]; /* as written (negative from the end) */
} model_muon_rules;

/* Reads <configs_dir>/muon.yml; errors name the file, the key and the fix. */
sim_status model_muon_rules_load(const char *configs_dir, model_muon_rules *out);

typedef struct {
    double beta;            /* muon_beta */
    double weight_decay;    /* muon_weight_decay (decoupled, times lr) */
    bool consistent_rms_on; /* muon_consistent_rms is a number (not None) */
    double consistent_rms;  /* its value */
    bool include_routers;   /* muon_include_routers */
    model_muon_rules rules; /* configs/muon.yml */
    bool ns_gather_bf16;    /* Newton-Schulz operands gathered in bfloat16 (cfg_xla_rules) */
    bool ns_gather_once;    /* one gather of X serves X X^T and B X (cfg_xla_rules) */
    bool stacked;           /* muon_update_buffers: stacked (cfg_xla_rules.muon_stacked) */
} model_muon_cfg;

/* Reads the muon_* keys and the rules, and refuses what MaxText does not
 * support with Muon (pipeline parallelism, ZeRO-1, muon_type=maxtext_muon,
 * muon_use_all_to_all). */
sim_status model_muon_from_config(const cfg_config *cfg, model_muon_cfg *out);

/* The Muon settings opt_type=muon's row read into an optimizer config (model_optim_cfg.priv). */
const model_muon_cfg *model_muon_cfg_of(const model_optim_cfg *o);

/* How one parameter is optimized. */
typedef struct {
    bool muon;                   /* false: the AdamW fallback */
    int n_red, n_out;            /* reduction and output dims */
    int red[MESH_SPEC_MAX_RANK]; /* dims of the stacked shape (non-negative) */
    int out[MESH_SPEC_MAX_RANK];
} model_muon_dims;

/* Classifies a parameter by its dotted path and stacked rank (muon.yml). */
void model_muon_classify(const model_muon_cfg *c, const model_param_def *def, model_muon_dims *out);

/* The classification the row keeps for a parameter of a model defined with opt_type=muon
 * (model_def.opt_param[i]). */
const model_muon_dims *model_muon_dims_of(const model_opt_param *p);

/* The update's scale for a leaf of stacked shape `shape` (float32, as optax). */
float model_muon_scale(const model_muon_cfg *c, const model_param_def *def, const model_muon_dims *dims);

/* The orthogonalization of §A.3 on one stacked leaf `x` (global shape = the
 * stacked shape, any spec), in place: normalisation and the Newton–Schulz
 * steps as mesh ops in auto placement (ctx's mode is ignored), collectives
 * tagged "optimizer/<path>/ns".  x keeps its spec.  gather: the dtype
 * operands are gathered in (NULL: as computed, float32); once: within a step
 * one gather of an operand serves every product that reads it (a compiler's
 * CSE: X for X X^T and for B X), else each product gathers its own.
 * hold_products: each step's product B X stays counted (float32, X's shard)
 * until the orthogonalization returns, as XLA:TPU holds them for the update
 * (muon_update_buffers: stacked); counted only. */
sim_status model_muon_orthogonalize(const mesh_ctx *ctx, const model_muon_dims *dims, double eps, const char *path,
                                    const sim_dtype *gather, bool once, bool hold_products, mesh_array *x);

/* One optimizer update of every parameter of this device (opt_type=muon):
 * Muon leaves as above (the NS collectives in phase optimizer), AdamW leaves
 * elementwise; dims[i] = parameter i's classification.  s = updates already applied; grad_norm = the global norm
 * (clipping as for AdamW).  Slot 0 ("mu") holds Muon's momentum or Adam's mu, slot 1 ("nu") Adam's nu
 * (a Muon leaf has none).  Gradients are read, not changed. */
sim_status model_muon_update(mesh_ctx *ctx, const model_optim_cfg *o, const model_muon_dims *dims, model_param *params,
                             int n, long long s, double grad_norm);

#endif
