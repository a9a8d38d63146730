/* qwen3_moe.c — the Qwen3 MoE decoder (MaxText 0.2.5's qwen3_moe decoder_block: models/qwen3.py
 * Qwen3MoeDecoderLayer over AttentionWithNorm) on the tape.
 *
 * The layer is the dense Qwen3's attention half with moe.py's RoutedMoE in place of the MLP,
 * settled at the source:
 *   - AttentionWithNorm as for decoder_block=qwen3 (models/families/qwen3.c): query/key RMSNorms
 *     over head_dim before RoPE (use_qk_norm), query_pre_attn_scalar = head_dim**-0.5 after RoPE (so
 *     the query init keeps the plain fan-in scale), no soft cap, no sliding window, rope_type's
 *     default RoPE; the residual stream constrained (and out_sharding passed) in explicit mode only;
 *   - the MoE is the attribute moe_block: RoutedMoE(num_experts, num_experts_per_tok,
 *     intermediate_dim=config.moe_mlp_dim, kernel_axes=("embed", None) for the gate, kernel_init
 *     nd_dense_init(dense_init_scale, "fan_in", "truncated_normal")); no shared experts
 *     (RoutedMoE, not RoutedAndSharedMoE).  Routing is get_topk's branch outside DeepSeek: the raw
 *     gate logits (routed_score_func ""), top-k with ties to the lowest expert, a float32 softmax
 *     over the k selected logits, divided by their sum with norm_topk_prob (true in every
 *     qwen3_moe model file).  Sparse (ragged all-to-all, dropless) and dense paths:
 *     models/blocks/moe.c, the MoE block Mixtral and DeepSeek also run;
 *   - the load-balance loss (load_balance_loss_weight > 0, e.g. qwen3-235b-a22b's 0.001) is sown as
 *     moe_lb_loss and averaged over the layers into the loss;
 *   - no dropout on the layer output (Qwen3MoeDecoderLayer has no Dropout);
 *   - configs/types.py: for qwen3_moe a fully MoE model whose base_mlp_dim differs from
 *     base_moe_mlp_dim gets mlp_dim = moe_mlp_dim instead of an error (config/validate.c); the
 *     layer reads moe_mlp_dim only.
 * Around the layers, the Decoder is the generic one (models/blocks/decoder.c). */
#include <math.h>
#include <stdlib.h>

#include "models/blocks/dense_layer.h"
#include "models/blocks/moe.h"
#include "models/core/model.h"

/* AttentionWithNorm.activation_axis_names: the MoE's out_sharding */
static const char *const A[3] = {"activation_batch", "activation_norm_length", "activation_embed"};

/* The MoE dims, kept in model_dims.family_dims. */
static const model_moe_dims *qmoe_dims(const model_def *m) { return m->d.family_dims; }

/* One Qwen3MoeDecoderLayer: the dense layer (models/blocks/dense_layer.c) with the dense Qwen3's
 * attention (query/key norms when defined, the query scaled by head_dim^-0.5 after RoPE, no soft
 * cap, the residual constrained in explicit mode only, as qwen3.c says) and RoutedMoE as moe_block
 * in place of the MLP, no dropout on the output; *aux its load-balance loss (NULL without one). */
static sim_status qmoe_layer(model_dev *md, mesh_tape *t, const model_batch *b, int l, mesh_var *x, mesh_var **y,
                             mesh_var **aux)
{
    const model_def *m = md->def;
    model_moe_layer ml = model_moe_layer_at(m, "moe_block", qmoe_dims(m), A);
    model_dense_layer c = {.prefix = "qwen3_moe",
                           .residual_explicit_only = true,
                           .rope = model_dense_rope(&m->d),
                           .scale = 1.0 / sqrt((double)m->d.head_dim),
                           .soft_cap = 0,
                           .output_dropout = false,
                           .ffn = model_moe_ffn,
                           .ffn_arg = &ml,
                           .ffn_scope = "moe_block"};
    return model_dense_layer_run(md, t, b, &c, l, x, y, aux);
}

/* ------------------------------------------------------------ definition */

static void define_params(model_def *m, bool qk_norm)
{
    /* init_query_w: query_pre_attn_scalar != 1, so no depth scaling of the query init */
    model_dense_define_attention(m, 1.0, qk_norm);
    model_moe_define_routed_params(m, "moe_block", qmoe_dims(m));
    model_dense_define_head(m);
}

/* What MaxText's qwen3_moe layer would read and shardsim does not simulate is refused, naming the key. */
static sim_status qmoe_define(model_def *m, const cfg_config *cfg)
{
    const model_dims *d = &m->d;
    model_moe_dims *mo = calloc(1, sizeof *mo);
    SIM_ASSERT(mo);
    m->d.family_dims = mo; /* model_def_free (or the refused definition) frees it */
    model_dense_refusals r = {
        .block = "qwen3_moe", .layer = "models/qwen3.py Qwen3MoeDecoderLayer", .no_mrope = true, .experts = true};
    SIM_TRY(model_dense_refuse(cfg, d, &r));
    /* get_topk's branch outside DeepSeek: softmax over the k selected logits, norm_topk_prob honoured;
     * the experts' width is moe_mlp_dim (RoutedMoE(intermediate_dim=config.moe_mlp_dim)) */
    SIM_TRY(model_moe_dims_read(cfg, d, true, mo));
    m->d.mlp = mo->moe_mlp; /* types.py: mlp_dim = moe_mlp_dim for a fully MoE qwen3_moe */
    SIM_TRY(model_moe_check_routed(d, mo));
    /* use_qk_norm=false is MaxText's layer without the norms (the query init stays unscaled) */
    bool qk_norm;
    SIM_TRY(model_cfg_bool(cfg, "use_qk_norm", &qk_norm));
    define_params(m, qk_norm);
    return model_moe_check_mesh(m, cfg, mo);
}

static sim_status qmoe_loss(model_dev *md, mesh_tape *t, const model_batch *b, mesh_var **loss)
{
    return model_dense_loss(md, t, b, qmoe_layer, loss);
}

/* MaxText's decoder_block qwen3_moe (qwen3-30b-a3b, qwen3-235b-a22b, qwen3-480b-a35b): every layer
 * alike, scanned and pipelined alike, nothing updated outside the optimizer. */
const model_family model_family_qwen3_moe = {
    .name = "qwen3_moe",
    .define = qmoe_define,
    .setup = model_moe_setup,
    .loss = qmoe_loss,
};
