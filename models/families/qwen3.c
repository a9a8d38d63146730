/* qwen3.c — the dense Qwen3 decoder (MaxText 0.2.5's qwen3 decoder_block: models/qwen3.py
 * Qwen3DecoderLayer over AttentionWithNorm) on the tape.
 *
 * A layer is Llama's shape with MaxText's Qwen3 choices, settled at the source:
 *   - attention is layers/attentions.py's Attention with use_qk_norm=config.use_qk_norm (true in
 *     every qwen3 model file): query_norm and key_norm are RMSNorms over head_dim (kernel_axes
 *     ("norm",), epsilon normalization_layer_epsilon, with a scale), applied to the projections
 *     before RoPE; their scales are per layer, scanned like every layer parameter
 *     (decoder.layers.self_attention.{query,key}_norm.scale, (head_dim, layers), ("norm", "layers"));
 *   - query_pre_attn_scalar = head_dim**-0.5 multiplies the query after RoPE, so init_query_w keeps
 *     the plain fan-in init (no 1/sqrt(head_dim) folded in, whatever use_qk_norm says);
 *   - the layer passes neither attn_logits_soft_cap nor a sliding window to its Attention;
 *     the rotary embedding is config.rope_type's (default here) with rope_max_timescale;
 *   - the MLP is MlpBlock with intermediate_sharding (activation_batch, activation_norm_length,
 *     activation_mlp) and out_sharding the residual's names;
 *   - AttentionWithNorm constrains the residual stream, and passes out_shardings, in explicit mode
 *     only: in auto mode its _maybe_shard_with_logical is the identity and the shardings are None
 *     (layer_shard says how auto mode places the residual; the dump logs it in explicit mode only);
 *   - no dropout on the layer's output (only MlpBlock's intermediate dropout);
 *   - checkpoint names: Attention's and MlpBlock's (decoder_layer_input is kept by every policy).
 * The layer is the dense one Llama's is (models/blocks/dense_layer.c) with these choices; around
 * the layers, the Decoder is the generic one (embedding, final norm, logits tied or not as
 * logits_via_embedding says): models/blocks/decoder.c. */
#include <math.h>

#include "models/blocks/dense_layer.h"
#include "models/core/model.h"

/* Qwen3DecoderLayer's MlpBlock intermediate_sharding (activation_norm_length, unlike Llama's) */
static const char *const MLP_MID[3] = {"activation_batch", "activation_norm_length", "activation_mlp"};

/* One Qwen3DecoderLayer (apply_attention_with_norm, then the MLP), as model_remat_layer wants it:
 * query/key norms when defined, the query scaled by head_dim^-0.5 after RoPE, no soft cap, the
 * residual constrained in explicit mode only, no dropout on the output. */
static sim_status qwen3_layer(model_dev *md, mesh_tape *t, const model_batch *b, int l, mesh_var *x, mesh_var **y,
                              mesh_var **aux)
{
    const model_dims *d = &md->def->d;
    model_dense_layer c = {.prefix = "qwen3",
                           .residual_explicit_only = true,
                           .rope = model_dense_rope(d),
                           .scale = 1.0 / sqrt((double)d->head_dim),
                           .soft_cap = 0,
                           .mlp_mid = MLP_MID,
                           .output_dropout = false};
    return model_dense_layer_run(md, t, b, &c, l, x, y, aux);
}

/* What MaxText's qwen3 layer would read and shardsim does not simulate is refused, naming the key. */
static sim_status qwen3_define(model_def *m, const cfg_config *cfg)
{
    const model_dims *d = &m->d;
    model_dense_refusals r = {.block = "qwen3", .layer = "models/qwen3.py Qwen3DecoderLayer", .no_mrope = true};
    SIM_TRY(model_dense_refuse(cfg, d, &r));
    bool qk_norm;
    /* use_qk_norm=false is MaxText's qwen3 layer without the norms (the query init stays unscaled) */
    SIM_TRY(model_cfg_bool(cfg, "use_qk_norm", &qk_norm));
    model_dense_define(m, 1.0, qk_norm); /* init_query_w: query_pre_attn_scalar != 1, no depth scaling */
    return SIM_OK;
}

static sim_status qwen3_loss(model_dev *md, mesh_tape *t, const model_batch *b, mesh_var **loss)
{
    return model_dense_loss(md, t, b, qwen3_layer, loss);
}

/* MaxText's decoder_block qwen3 (the dense Qwen3 model files): every layer alike, scanned and
 * pipelined alike, nothing updated outside the optimizer. */
const model_family model_family_qwen3 = {
    .name = "qwen3",
    .define = qwen3_define,
    .setup = model_dense_setup,
    .loss = qwen3_loss,
};
