/* decoder.c — MaxText's Decoder around a family's layer (see decoder.h). */
#include "models/blocks/decoder.h"

#include <stdio.h>
#include <string.h>

#include "config/release.h"
#include "mesh/ad.h"
#include "mesh/nn.h"
#include "mesh/ops.h"
#include "models/core/pipeline_run.h"

static const char *const EMB_OUT[3] = {"activation_embed_and_logits_batch", "activation_length", "activation_embed"};
static const char *const FINAL[3] = {"activation_batch", "activation_length", "activation_embed"};

sim_status model_decoder_loss(model_dev *md, mesh_tape *t, const model_batch *b, const model_decoder_block *dec,
                              mesh_var **loss)
{
    const model_def *m = md->def;
    md->ctx.layer = "decoder";
    mesh_var *x, *logits, *tok_loss, *table = model_param_leaf(md, t, dec->embed, 0);
    SIM_TRY(mesh_nn_embed(t, table, &b->tokens, "token_embedder", &x));
    if (md->ctx.mode == MESH_MODE_EXPLICIT) /* Embed's out_sharding */
        SIM_TRY(model_shard_as(md, t, x, "embed/out", 3, EMB_OUT, &x));
    SIM_TRY(model_dropout(md, t, x, "decoder/embedding", &x)); /* no dropout with a pipeline (refused) */
    if (m->d.pipe.on) /* the stack runs as MaxText's pipeline (pipeline_run.c) */
        SIM_TRY(model_pipeline_run(md, t, b, x, dec->layer, 0, &x));
    mesh_var *lb_sum = NULL; /* the layers' load-balance losses (MoE layers), summed */
    const int64_t units = dec->units > 0 ? dec->units : m->d.layers;
    for (int l = 0; l < units && !m->d.pipe.on; l++) {
        mesh_var *in = x, *aux = NULL;
        if (m->d.remat_full) {
            char tag[64];
            snprintf(tag, sizeof tag, "decoder/layers_%d/remat", l);
            SIM_TRY(model_remat_layer(md, t, b, l, x, dec->layer, tag, &x, &aux));
        } else {
            SIM_TRY(dec->layer(md, t, b, l, x, &x, &aux));
        }
        if (aux) {
            md->ctx.layer = "loss";
            if (lb_sum) SIM_TRY(mesh_ad_add(t, lb_sum, aux, "moe_lb_loss", &lb_sum));
            else lb_sum = aux;
        }
        /* MaxText scans the layers (scan_layers): the carry's type may not change across a layer */
        if (l == 0 && m->d.scan_layers && (dec->units <= 0 || dec->scanned_units > 0))
            SIM_TRY(mesh_scan_carry_check(&md->ctx, &in->val, &x->val, "layers",
                                          cfg_release_error(md->ctx.release, "decoder_scan_carry",
                                                            "layers/nnx_decoders.py:_apply_layers_sequentially")));
    }
    md->ctx.layer = "decoder";
    SIM_TRY(mesh_nn_rmsnorm(t, x, model_param_leaf(md, t, dec->norm, 0), m->d.eps, "decoder_norm", &x));
    if (md->ctx.mode == MESH_MODE_EXPLICIT) SIM_TRY(model_shard_as(md, t, x, "decoder/norm_out", 3, FINAL, &x));
    SIM_TRY(model_dropout(md, t, x, "decoder/output_head", &x));
    SIM_TRY(model_logits(md, t, x, table, dec->logits >= 0 ? model_param_leaf(md, t, dec->logits, 0) : NULL, &logits));
    /* train.py loss_fn: max_utils.cross_entropy_with_logits(logits, jax.nn.one_hot(targets)) multiplies
     * the one-hot targets (the targets' sharding, vocab unsharded) by the log-softmax (the logits'
     * sharding): in explicit mode JAX's broadcasting rule must accept the pair */
    const char *xent_site = cfg_release_error(md->ctx.release, "cross_entropy_targets_mul",
                                              "utils/max_utils.py:_cross_entropy_with_logits_fwd");
    if (md->ctx.mode == MESH_MODE_EXPLICIT && xent_site) {
        /* the targets as MaxText shards its input data (input_data_sharding_logical_axes' default) */
        static const char *const IN_DATA[2] = {"activation_embed_and_logits_batch", "activation_norm_length"};
        mesh_array oh = b->targets;
        mesh_spec ts;
        SIM_TRY(model_logical_spec(m, "targets", 2, IN_DATA, &ts));
        oh.rank = 3;
        oh.shape[2] = logits->val.shape[2];
        mesh_spec_init(&oh.spec, 3);
        for (int dd = 0; dd < 2; dd++) {
            oh.spec.n_axes[dd] = ts.n_axes[dd];
            memcpy(oh.spec.axes[dd], ts.axes[dd], sizeof oh.spec.axes[dd]);
        }
        oh.dtype = SIM_F32;
        SIM_TRY(mesh_mul_check(&md->ctx, &oh, &logits->val, "cross_entropy", xent_site,
                               "shard the targets' length and the logits' vocab dim on different mesh axes (the "
                               "rules of activation_length and activation_vocab), or run in shard_mode=auto"));
    }
    SIM_TRY(mesh_nn_xent(t, logits, &b->targets, m->d.z_loss, "cross_entropy", &tok_loss));
    /* MaxText 0.2.5 reshards the per-token loss (loss_constraint=assert: the assert of before PR #4208) */
    SIM_TRY(model_loss_constraint(md, t, tok_loss, true, &tok_loss));
    md->ctx.layer = "loss";
    SIM_TRY(mesh_nn_mean(t, tok_loss, "mean", loss));
    /* train.py loss_fn: the load-balance loss the MoE layers sowed (moe_lb_loss) joins the loss */
    if (lb_sum) SIM_TRY(mesh_ad_add(t, *loss, lb_sum, "plus_moe_lb_loss", loss));
    return SIM_OK;
}
