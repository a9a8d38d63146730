/* mistral.c — the Mistral decoder (MaxText 0.2.5's mistral decoder_block: models/mistral.py
 * MistralDecoderLayer) on the tape.
 *
 * The layer is Llama's, with MaxText's Mistral choices settled at the source:
 *   - attention is layers/attentions.py's Attention built without attention_type,
 *     sliding_window_size or attn_logits_soft_cap: AttentionType.GLOBAL (attention_op.py's
 *     _resolve_attention_type keeps it whatever the config's attention_type says), no window, no
 *     soft cap.  So attention_type=local_sliding and attn_logits_soft_cap, which MaxText would
 *     not apply here, are refused naming the key;
 *   - no query/key norm; 1/sqrt(head_dim) folded into the query init (Attention.init_query_w), so
 *     the score scale is 1; the rotary embedding is config.rope_type's (default here);
 *   - the MLP is MlpBlock with intermediate_sharding (activation_batch, activation_norm_length,
 *     activation_mlp) (Llama's is activation_length) and out_sharding the residual's names;
 *   - _maybe_shard_with_logical constrains the residual stream after the input, the
 *     pre-attention norm, the attention, the post-attention norm, the MLP and the output (in both
 *     shard modes, as Llama's layer), and Dropout(broadcast_dims=(-2,)) runs on the layer output;
 *   - checkpoint names: decoder_layer_input, Attention's and MlpBlock's.
 * The layer is the dense one Llama's is (models/blocks/dense_layer.c) with these choices; around
 * the layers, the Decoder is the generic one (models/blocks/decoder.c). */
#include <math.h>

#include "models/blocks/dense_layer.h"
#include "models/core/model.h"

/* MistralDecoderLayer.mlp_activation_axis_names (activation_norm_length, unlike Llama's) */
static const char *const MLP_MID[3] = {"activation_batch", "activation_norm_length", "activation_mlp"};

/* One MistralDecoderLayer, as model_remat_layer wants it: no query/key norm, the score scale 1
 * (folded into the query init), no soft cap (mistral_define refuses one), the residual constrained
 * in both shard modes, dropout on the output. */
static sim_status mistral_layer(model_dev *md, mesh_tape *t, const model_batch *b, int l, mesh_var *x, mesh_var **y,
                                mesh_var **aux)
{
    model_dense_layer c = {.prefix = "mistral",
                           .residual_explicit_only = false,
                           .rope = model_dense_rope(&md->def->d),
                           .scale = 1.0,
                           .soft_cap = 0,
                           .mlp_mid = MLP_MID,
                           .output_dropout = true};
    return model_dense_layer_run(md, t, b, &c, l, x, y, aux);
}

/* What MaxText's mistral layer would read and shardsim does not simulate, or what the layer does
 * not read although the config sets it, is refused naming the key. */
static sim_status mistral_define(model_def *m, const cfg_config *cfg)
{
    const model_dims *d = &m->d;
    model_dense_refusals r = {.block = "mistral", .layer = "models/mistral.py MistralDecoderLayer", .no_soft_cap = true};
    SIM_TRY(model_dense_refuse(cfg, d, &r));
    /* Attention.init_query_w: 1/sqrt(head_dim) in the query init unless the config's use_qk_norm
     * is set (the layer passes no use_qk_norm, so no norm runs either way) */
    model_dense_define(m, d->qk_norm_key ? 1.0 : 1.0 / sqrt((double)d->head_dim), false);
    return SIM_OK;
}

static sim_status mistral_loss(model_dev *md, mesh_tape *t, const model_batch *b, mesh_var **loss)
{
    return model_dense_loss(md, t, b, mistral_layer, loss);
}

/* MaxText's decoder_block mistral (mistral-7b): every layer alike, scanned and pipelined alike,
 * nothing updated outside the optimizer. */
const model_family model_family_mistral = {
    .name = "mistral",
    .define = mistral_define,
    .setup = model_dense_setup,
    .loss = mistral_loss,
};
