/* mixtral.c — the Mixtral decoder (MaxText 0.2.5's mixtral decoder_block: models/mixtral.py
 * MixtralDecoderLayer) on the tape.
 *
 * The layer is Mistral's with the MLP replaced by moe.py's RoutedMoE (MoeBlock_0), settled at the
 * source:
 *   - attention as Mistral's: Attention built without attention_type, sliding_window_size or
 *     attn_logits_soft_cap (global, no window, no cap: those keys are refused), no query/key norm,
 *     1/sqrt(head_dim) folded into the query init;
 *   - RoutedMoE(num_experts, num_experts_per_tok, intermediate_dim=config.mlp_dim (not
 *     moe_mlp_dim), kernel_axes=("embed", None) for the gate): gate logits (routed_score_func, ""
 *     by default: the raw logits), top-k with ties to the lowest expert, then get_topk's branch for
 *     decoder blocks other than DeepSeek: a float32 softmax over the k selected logits (no
 *     routed_scaling_factor), divided by their sum with norm_topk_prob; no shared experts.  The
 *     experts run on the sparse path (ragged all-to-all over the expert axes, dropless) or the
 *     dense path (sparse_matmul=false), models/blocks/moe.c, the one MoE block DeepSeek also runs;
 *   - the load-balance loss (load_balance_loss_weight > 0) is sown per layer as moe_lb_loss and
 *     averaged over the layers into the loss;
 *   - _maybe_shard_with_logical on the residual after the input, the pre-attention norm, the
 *     attention, the post-attention norm, the MoE and the output (both shard modes), and Dropout on
 *     the layer output;
 *   - checkpoint names: decoder_layer_input, Attention's, and moe.py's inside the experts.
 * Around the layers, the Decoder is the generic one (models/blocks/decoder.c), which adds the
 * layers' load-balance losses. */
#include <math.h>
#include <stdlib.h>

#include "models/blocks/dense_layer.h"
#include "models/blocks/moe.h"
#include "models/core/model.h"

/* MixtralDecoderLayer.activation_axis_names: the MoE's out_sharding */
static const char *const A[3] = {"activation_batch", "activation_norm_length", "activation_embed"};

/* The MoE dims, kept in model_dims.family_dims. */
static const model_moe_dims *mixtral_dims(const model_def *m) { return m->d.family_dims; }

/* One MixtralDecoderLayer: the dense layer (models/blocks/dense_layer.c) with Mistral's attention
 * (no query/key norm, 1/sqrt(head_dim) folded into the query init, no cap, the default RoPE), every
 * residual constraint logged, RoutedMoE as MoeBlock_0 in place of the MLP (layer_output =
 * mlp_lnx + intermediate_inputs, in that order) and dropout on the output; *aux its load-balance
 * loss (NULL without one). */
static sim_status mixtral_layer(model_dev *md, mesh_tape *t, const model_batch *b, int l, mesh_var *x, mesh_var **y,
                                mesh_var **aux)
{
    const model_def *m = md->def;
    model_moe_layer ml = model_moe_layer_at(m, "MoeBlock_0", mixtral_dims(m), A);
    model_dense_layer c = {.prefix = "mixtral",
                           .residual_explicit_only = false,
                           .rope = model_dense_rope(&m->d),
                           .scale = 1.0,
                           .soft_cap = 0,
                           .output_dropout = true,
                           .ffn = model_moe_ffn,
                           .ffn_arg = &ml,
                           .ffn_scope = "MoeBlock_0",
                           .ffn_output_first = true};
    return model_dense_layer_run(md, t, b, &c, l, x, y, aux);
}

/* ------------------------------------------------------------ definition */

static void define_params(model_def *m)
{
    const model_dims *d = &m->d;
    double qs = d->qk_norm_key ? 1.0 : 1.0 / sqrt((double)d->head_dim); /* Attention.init_query_w, as Mistral's */
    model_dense_define_attention(m, qs, false);
    model_moe_define_routed_params(m, "MoeBlock_0", mixtral_dims(m));
    model_dense_define_head(m);
}

/* What MaxText's mixtral layer would read and shardsim does not simulate, or what the layer does
 * not read although the config sets it, is refused naming the key. */
static sim_status mixtral_define(model_def *m, const cfg_config *cfg)
{
    const model_dims *d = &m->d;
    model_moe_dims *mo = calloc(1, sizeof *mo);
    SIM_ASSERT(mo);
    m->d.family_dims = mo; /* model_def_free (or the refused definition) frees it */
    model_dense_refusals r = {
        .block = "mixtral", .layer = "models/mixtral.py MixtralDecoderLayer", .no_soft_cap = true, .experts = true};
    SIM_TRY(model_dense_refuse(cfg, d, &r));
    /* get_topk's branch outside DeepSeek: softmax over the k selected logits, norm_topk_prob honoured */
    SIM_TRY(model_moe_dims_read(cfg, d, true, mo));
    mo->moe_mlp = d->mlp; /* RoutedMoE(intermediate_dim=config.mlp_dim) */
    SIM_TRY(model_moe_check_routed(d, mo));
    define_params(m);
    return model_moe_check_mesh(m, cfg, mo);
}

static sim_status mixtral_loss(model_dev *md, mesh_tape *t, const model_batch *b, mesh_var **loss)
{
    return model_dense_loss(md, t, b, mixtral_layer, loss);
}

/* MaxText's decoder_block mixtral (mixtral-8x7b, mixtral-8x22b): every layer alike, scanned and
 * pipelined alike, nothing updated outside the optimizer (loss-free balancing is DeepSeek's). */
const model_family model_family_mixtral = {
    .name = "mixtral",
    .define = mixtral_define,
    .setup = model_moe_setup,
    .loss = mixtral_loss,
};
