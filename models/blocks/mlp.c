/* mlp.c — MaxText's SwiGLU MlpBlock on the tape (see mlp.h). */
#include "models/blocks/mlp.h"

#include "mesh/ad.h"
#include "mesh/nn.h"

/* MlpBlock.intermediate_logical (train mode): the constraint before wo */
static const char *const MLP_X[3] = {"activation_batch", "activation_length", "activation_mlp"};

sim_status model_mlp(model_dev *md, mesh_tape *t, const model_mlp_block *b, mesh_var *x, mesh_var **y)
{
    const int l = b->layer;
    mesh_var *g, *u, *act;
    if (b->wi >= 0) {
        /* fused_mlp: one product, then x[:, :, 0] and x[:, :, 1]; the constraint keeps the
         * num_activations dim unsharded (intermediate_logical with None inserted before its last) */
        const char *const fused[4] = {b->intermediate[0], b->intermediate[1], NULL, b->intermediate[2]};
        const char *const fused_x[4] = {MLP_X[0], MLP_X[1], NULL, MLP_X[2]};
        mesh_var *wi;
        SIM_TRY(model_dense(md, t, "bte,eaf->btaf", x, model_param_leaf(md, t, b->wi, l), "wi", 4, fused, &wi));
        SIM_TRY(model_shard_as(md, t, wi, "linears/fused_x", 4, fused_x, &wi));
        SIM_TRY(model_saved_product(md, MODEL_CKPT_MLPWI, &md->p[b->wi].w[l]));
        SIM_TRY(model_checkpoint_name(md, wi, MODEL_CKPT_MLPWI));
        SIM_TRY(mesh_nn_unstack2(t, wi, 2, "wi_split", &g, &u));
    } else {
        SIM_TRY(model_dense_saved(md, t, MODEL_CKPT_MLPWI_0, "bte,ef->btf", x, model_param_leaf(md, t, b->wi_0, l),
                                  "wi_0", 3, b->intermediate, &g));
        SIM_TRY(model_dense_saved(md, t, MODEL_CKPT_MLPWI_1, "bte,ef->btf", x, model_param_leaf(md, t, b->wi_1, l),
                                  "wi_1", 3, b->intermediate, &u));
    }
    /* _convert_to_activation_function(mlp_activations[0]) times the linear one */
    if (md->def->d.mlp_gelu) SIM_TRY(mesh_nn_geglu(t, g, u, "geglu", &act));
    else SIM_TRY(mesh_nn_swiglu(t, g, u, "swiglu", &act));
    SIM_TRY(model_dropout(md, t, act, md->ctx.layer, &act)); /* MlpBlock's intermediate dropout */
    SIM_TRY(model_shard_as(md, t, act, "linears/x", 3, MLP_X, &act));
    /* from here on the layer makes its output, which nothing reads when remat recomputes the layer for
     * its backward: XLA drops these ops from the recomputation (mesh_ctx.dead_outputs), wo's product
     * included, so wo is gathered in the backward for the input gradient alone (and a policy that saves
     * wo's output replaces the product with the saved copy: dead either way) */
    md->ctx.dead_outputs = md->recomputing && !b->output_live;
    sim_status st = model_dense(md, t, "btf,fe->bte", act, model_param_leaf(md, t, b->wo, l), "wo", 3, b->out, y);
    md->ctx.dead_outputs = false;
    SIM_TRY(st);
    return model_checkpoint_name(md, *y, MODEL_CKPT_MLPWO);
}
