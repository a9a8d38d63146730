/* mlp.h — MaxText's MlpBlock (layers/linears.py) with SwiGLU activations (mlp_activations
 * [silu, linear]; GeGLU with [gelu, linear], model_dims.mlp_gelu) on the tape: the gated feed-forward block every dense family builds on, as
 * llama.cpp's build_ffn.
 *
 *   gate = x . wi_0, up = x . wi_1        (or one fused_mlp product x . wi, split on its 2-dim)
 *   y    = dropout(silu(gate) * up) . wo
 *
 * with the checkpoint tags MaxText's MlpBlock puts on them (mlpwi_0, mlpwi_1 or mlpwi, mlpwo) and
 * its constraints: the products' out_sharding is the caller's (MaxText's intermediate_sharding and
 * out_sharding arguments, which differ between decoder layers), the activation before wo is
 * constrained to the block's own intermediate names (activation_batch, activation_length,
 * activation_mlp).  The block reads its weights by parameter index through model_param_leaf,
 * each when its product runs (so the batch-split schedule's gathered copies serve it too). */
#ifndef MODELS_BLOCKS_MLP_H
#define MODELS_BLOCKS_MLP_H

#include "models/core/model.h"

typedef struct {
    int wi_0, wi_1;                  /* (embed, mlp) gate and up kernels (model_param_index); -1 with wi */
    int wi;                          /* fused_mlp: the (embed, 2, mlp) kernel, else -1 */
    int wo;                          /* (mlp, embed) */
    int layer;                       /* index into the parameters' stacks */
    const char *const *intermediate; /* 3 logical names of wi's out_sharding (the layer's intermediate_sharding) */
    const char *const *out;          /* 3 logical names of wo's out_sharding (the layer's out_sharding) */
    bool output_live;                /* the output feeds more of the same remat unit (a layer inside gemma3's
                                        block of six), so its recomputation is not dead */
} model_mlp_block;

/* x (B, T, E) -> y (B, T, E).  Dropout runs at site md->ctx.layer (MlpBlock's intermediate
 * dropout).  When remat recomputes the layer for its backward, wo's product (and with it the
 * layer's tail) feeds nothing unless output_live: it runs with mesh_ctx.dead_outputs, as XLA drops it. */
sim_status model_mlp(model_dev *md, mesh_tape *t, const model_mlp_block *b, mesh_var *x, mesh_var **y);

#endif
