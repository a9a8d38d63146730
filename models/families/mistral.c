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
 * Around the layers, the Decoder is the generic one (models/blocks/decoder.c). */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "blas_kernels/bk_rope.h"
#include "mesh/ad.h"
#include "mesh/nn.h"
#include "models/blocks/attention.h"
#include "models/blocks/decoder.h"
#include "models/blocks/mlp.h"
#include "models/core/model.h"

/* MistralDecoderLayer.activation_axis_names and mlp_activation_axis_names */
static const char *const A[3] = {"activation_batch", "activation_norm_length", "activation_embed"};
static const char *const MLP_MID[3] = {"activation_batch", "activation_norm_length", "activation_mlp"};

typedef struct {
    int q, k, v, qkv, o, ln1, ln2, wi0, wi1, wi, wo, embed, norm, logits;
} mistral_ix;

static mistral_ix indices(const model_def *m)
{
    mistral_ix x;
    x.q = model_param_index(m, "self_attention.query.kernel");
    x.k = model_param_index(m, "self_attention.key.kernel");
    x.v = model_param_index(m, "self_attention.value.kernel");
    x.qkv = model_param_index(m, "self_attention.qkv_proj.kernel");
    x.o = model_param_index(m, "self_attention.out.kernel");
    x.ln1 = model_param_index(m, "pre_self_attention_layer_norm.scale");
    x.ln2 = model_param_index(m, "post_self_attention_layer_norm.scale");
    x.wi0 = model_param_index(m, "mlp.wi_0.kernel");
    x.wi1 = model_param_index(m, "mlp.wi_1.kernel");
    x.wi = model_param_index(m, "mlp.wi.kernel");
    x.wo = model_param_index(m, "mlp.wo.kernel");
    x.embed = model_param_index(m, "token_embedder.embedding");
    x.norm = model_param_index(m, "decoder_norm.scale");
    x.logits = model_param_index(m, "logits_dense.kernel");
    return x;
}

/* One MistralDecoderLayer. */
static sim_status mistral_layer(model_dev *md, mesh_tape *t, const model_batch *b, int l, mesh_var *x, mesh_var **y)
{
    const model_def *m = md->def;
    const model_dims *d = &m->d;
    mistral_ix ix = indices(m);
    char layer[64], attn_layer[96], mlp_layer[96];
    const char *saved_layer = md->ctx.layer;
    snprintf(layer, sizeof layer, "decoder/layers_%d", l);
    snprintf(attn_layer, sizeof attn_layer, "%s/self_attention", layer);
    snprintf(mlp_layer, sizeof mlp_layer, "%s/mlp", layer);
    md->ctx.layer = layer;

    mesh_var *h, *lnx, *a;
    SIM_TRY(model_shard_as(md, t, x, "mistral/inputs", 3, A, &h));
    SIM_TRY(mesh_nn_rmsnorm(t, h, model_param_leaf(md, t, ix.ln1, l), d->eps, "pre_self_attention_layer_norm", &lnx));
    SIM_TRY(model_shard_as(md, t, lnx, "mistral/lnx", 3, A, &lnx));

    md->ctx.layer = attn_layer;
    bk_rope_params rp = bk_rope_params_default((int)d->head_dim);
    rp.min_timescale = d->rope_min;
    rp.max_timescale = d->rope_theta;
    rp.linear_scaling_factor = d->rope_linear;
    model_attention_block ab = {.query = ix.q,
                                .key = ix.k,
                                .value = ix.v,
                                .qkv = d->fused_qkv ? ix.qkv : -1,
                                .out = ix.o,
                                .query_norm = -1,
                                .key_norm = -1,
                                .layer = l,
                                .rope = rp,
                                .scale = 1.0,
                                .soft_cap = 0,
                                .sliding_window = 0,
                                .out_names = A};
    SIM_TRY(model_attention(md, t, b, &ab, lnx, &a));
    md->ctx.layer = layer;
    SIM_TRY(model_shard_as(md, t, a, "mistral/attention_lnx", 3, A, &a));
    SIM_TRY(mesh_ad_add(t, h, a, "residual_attention", &h)); /* intermediate_inputs */
    mesh_var *hs, *mlp;
    SIM_TRY(mesh_nn_rmsnorm(t, h, model_param_leaf(md, t, ix.ln2, l), d->eps, "post_self_attention_layer_norm", &hs));
    SIM_TRY(model_shard_as(md, t, hs, "mistral/hidden_states", 3, A, &hs));

    md->ctx.layer = mlp_layer;
    model_mlp_block mb = {.wi_0 = ix.wi0,
                          .wi_1 = ix.wi1,
                          .wi = d->fused_mlp ? ix.wi : -1,
                          .wo = ix.wo,
                          .layer = l,
                          .intermediate = MLP_MID,
                          .out = A};
    SIM_TRY(model_mlp(md, t, &mb, hs, &mlp));
    md->ctx.layer = layer;
    /* the layer's tail: nothing reads it when remat recomputes the layer (model_mlp) */
    md->ctx.dead_outputs = md->recomputing;
    sim_status st = model_shard_as(md, t, mlp, "mistral/mlp_lnx", 3, A, &mlp);
    if (st == SIM_OK) st = mesh_ad_add(t, h, mlp, "residual_mlp", &h);
    if (st == SIM_OK) st = model_dropout(md, t, h, layer, &h);
    if (st == SIM_OK) st = model_shard_as(md, t, h, "mistral/layer_output", 3, A, y);
    md->ctx.dead_outputs = false;
    md->ctx.layer = saved_layer;
    return st;
}

static sim_status mistral_layer_fn(model_dev *md, mesh_tape *t, const model_batch *b, int l, mesh_var *x, mesh_var **y,
                                   mesh_var **aux)
{
    *aux = NULL;
    return mistral_layer(md, t, b, l, x, y);
}

/* ------------------------------------------------------------ definition */

#define LAYER_PARAM(path, rank, shape, logical, init, scale)                                                           \
    model_add_param(m, "params.decoder.layers." path, rank, shape, logical, 1, init, scale)

static void define_params(model_def *m)
{
    const model_dims *d = &m->d;
    int64_t V = d->vocab, E = d->emb, H = d->q_heads, K = d->kv_heads, D = d->head_dim, F = d->mlp, L = d->layers;
    double fe = 1.0 / sqrt((double)E);
    /* Attention.init_query_w: 1/sqrt(head_dim) in the query init unless the config's use_qk_norm
     * is set (the layer passes no use_qk_norm, so no norm runs either way) */
    double qs = d->qk_norm_key ? 1.0 : 1.0 / sqrt((double)D);
    model_add_param(m, "params.token_embedder.embedding", 2, (int64_t[]){V, E},
                    (const char *[]){"vocab", "embed_vocab"}, -1, MODEL_INIT_NORMAL, fe);
    LAYER_PARAM("pre_self_attention_layer_norm.scale", 2, ((int64_t[]){E, L}), ((const char *[]){"norm", "layers"}),
                MODEL_INIT_ONES, 0);
    if (d->fused_qkv)
        LAYER_PARAM("self_attention.qkv_proj.kernel", 4, ((int64_t[]){E, L, H + 2 * K, D}),
                    ((const char *[]){"embed_attn", "layers", "heads", "kv"}), MODEL_INIT_NORMAL, fe);
    else {
        LAYER_PARAM("self_attention.query.kernel", 4, ((int64_t[]){E, L, H, D}),
                    ((const char *[]){"embed_attn", "layers", "q_heads", "kv"}), MODEL_INIT_NORMAL, fe * qs);
        LAYER_PARAM("self_attention.key.kernel", 4, ((int64_t[]){E, L, K, D}),
                    ((const char *[]){"embed_attn", "layers", "kv_heads", "kv_head_dim"}), MODEL_INIT_NORMAL, fe);
        LAYER_PARAM("self_attention.value.kernel", 4, ((int64_t[]){E, L, K, D}),
                    ((const char *[]){"embed_attn", "layers", "kv_heads", "kv_head_dim"}), MODEL_INIT_NORMAL, fe);
    }
    LAYER_PARAM("self_attention.out.kernel", 4, ((int64_t[]){H, L, D, E}),
                ((const char *[]){"heads", "layers", "kv", "embed_attn"}), MODEL_INIT_NORMAL,
                1.0 / sqrt((double)(H * D)));
    LAYER_PARAM("post_self_attention_layer_norm.scale", 2, ((int64_t[]){E, L}), ((const char *[]){"norm", "layers"}),
                MODEL_INIT_ONES, 0);
    if (d->fused_mlp)
        LAYER_PARAM("mlp.wi.kernel", 4, ((int64_t[]){E, L, 2, F}),
                    ((const char *[]){"embed", "layers", "num_activations", "mlp"}), MODEL_INIT_TRUNC_NORMAL, fe);
    else {
        LAYER_PARAM("mlp.wi_0.kernel", 3, ((int64_t[]){E, L, F}), ((const char *[]){"embed", "layers", "mlp"}),
                    MODEL_INIT_TRUNC_NORMAL, fe);
        LAYER_PARAM("mlp.wi_1.kernel", 3, ((int64_t[]){E, L, F}), ((const char *[]){"embed", "layers", "mlp"}),
                    MODEL_INIT_TRUNC_NORMAL, fe);
    }
    LAYER_PARAM("mlp.wo.kernel", 3, ((int64_t[]){F, L, E}), ((const char *[]){"mlp", "layers", "embed"}),
                MODEL_INIT_TRUNC_NORMAL, 1.0 / sqrt((double)F));
    model_add_param(m, "params.decoder.decoder_norm.scale", 1, (int64_t[]){E}, (const char *[]){"norm"}, -1,
                    MODEL_INIT_ONES, 0);
    if (!d->tied_logits)
        model_add_param(m, "params.decoder.logits_dense.kernel", 2, (int64_t[]){E, V},
                        (const char *[]){"embed_vocab", "vocab"}, -1, MODEL_INIT_TRUNC_NORMAL, fe);
}

/* What MaxText's mistral layer would read and shardsim does not simulate, or what the layer does
 * not read although the config sets it, is refused naming the key. */
static sim_status mistral_define(model_def *m, const cfg_config *cfg)
{
    const model_dims *d = &m->d;
    SIM_TRY(model_attention_global_only(cfg, "mistral", "models/mistral.py MistralDecoderLayer"));
    const char *rt;
    SIM_TRY(cfg_get_str(cfg, "rope_type", &rt));
    if ((rt && strcmp(rt, "default")) || d->rope_llama31)
        return model_cfg_unsupported(cfg, "rope_type",
                                     "decoder_block=mistral is simulated with the default RoPE (rope_max_timescale); "
                                     "use rope_type=default");
    if (d->attn_soft_cap != 0)
        return model_cfg_unsupported(cfg, "attn_logits_soft_cap",
                                     "MaxText 0.2.5's mistral layer (models/mistral.py) does not pass "
                                     "attn_logits_soft_cap to its Attention, so no cap applies; use "
                                     "attn_logits_soft_cap=0 (decoder_block=llama2 passes it)");
    int64_t mtp;
    SIM_TRY(model_cfg_i64(cfg, "mtp_num_layers", &mtp));
    if (mtp != 0)
        return model_cfg_unsupported(
            cfg, "mtp_num_layers",
            "multi-token prediction runs with decoder_block=deepseek only; use mtp_num_layers=0");
    define_params(m);
    return SIM_OK;
}

static sim_status mistral_setup(model_def *m, const cfg_config *cfg)
{
    (void)m;
    bool on;
    SIM_TRY(model_cfg_bool(cfg, "use_batch_split_schedule", &on));
    if (on)
        return model_cfg_unsupported(cfg, "use_batch_split_schedule",
                                     "MaxText runs the batch-split schedule for decoder_block=deepseek only; drop it");
    return SIM_OK;
}

static sim_status mistral_loss(model_dev *md, mesh_tape *t, const model_batch *b, mesh_var **loss)
{
    mistral_ix ix = indices(md->def);
    model_decoder_block dec = {.layer = mistral_layer_fn, .embed = ix.embed, .norm = ix.norm, .logits = ix.logits};
    return model_decoder_loss(md, t, b, &dec, loss);
}

/* MaxText's decoder_block mistral (mistral-7b): every layer alike, scanned and pipelined alike,
 * nothing updated outside the optimizer. */
const model_family model_family_mistral = {
    .name = "mistral",
    .define = mistral_define,
    .setup = mistral_setup,
    .loss = mistral_loss,
};
