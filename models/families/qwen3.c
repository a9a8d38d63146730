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
 * Around the layers, the Decoder is the generic one (embedding, final norm, logits tied or not as
 * logits_via_embedding says): models/blocks/decoder.c. */
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

/* AttentionWithNorm.activation_axis_names and mlp_activation_axis_names */
static const char *const A[3] = {"activation_batch", "activation_norm_length", "activation_embed"};
static const char *const MLP_MID[3] = {"activation_batch", "activation_norm_length", "activation_mlp"};

typedef struct {
    int q, k, v, qkv, o, qn, kn, ln1, ln2, wi0, wi1, wi, wo, embed, norm, logits;
} qwen3_ix;

static qwen3_ix indices(const model_def *m)
{
    qwen3_ix x;
    x.q = model_param_index(m, "self_attention.query.kernel");
    x.k = model_param_index(m, "self_attention.key.kernel");
    x.v = model_param_index(m, "self_attention.value.kernel");
    x.qkv = model_param_index(m, "self_attention.qkv_proj.kernel");
    x.o = model_param_index(m, "self_attention.out.kernel");
    x.qn = model_param_index(m, "self_attention.query_norm.scale");
    x.kn = model_param_index(m, "self_attention.key_norm.scale");
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

/* AttentionWithNorm's _maybe_shard_with_logical: MaxText constrains the residual stream in explicit
 * mode only (in auto mode the method is the identity, and its dump logs nothing).  In auto mode
 * XLA's sharding propagation still gives the unconstrained residual the sharding of its
 * constrained neighbours (Attention's inputs, the next layer's): MaxText's compiled step for a
 * small qwen3 on fsdp=4 tensor=2 sends the bytes of a Llama of the same shape, whose layer
 * constrains it (peers/maxtext/hlo_bytes.sh: 163.458 and 163.482 MiB; tests/data/maxtext-0.2.5/hlo_bytes).  shardsim's auto placement is
 * local, so the residual is placed here as propagation leaves it: the same names, unlogged. */
static sim_status layer_shard(model_dev *md, mesh_tape *t, mesh_var *x, const char *name, mesh_var **y)
{
    if (md->ctx.mode == MESH_MODE_EXPLICIT) return model_shard_as(md, t, x, name, 3, A, y);
    mesh_spec s;
    SIM_TRY(model_logical_spec(md->def, name, 3, A, &s));
    return mesh_ad_shard_as(t, x, &s, name, y);
}

/* One Qwen3DecoderLayer (apply_attention_with_norm, then the MLP). */
static sim_status qwen3_layer(model_dev *md, mesh_tape *t, const model_batch *b, int l, mesh_var *x, mesh_var **y)
{
    const model_def *m = md->def;
    const model_dims *d = &m->d;
    qwen3_ix ix = indices(m);
    char layer[64], attn_layer[96], mlp_layer[96];
    const char *saved_layer = md->ctx.layer;
    snprintf(layer, sizeof layer, "decoder/layers_%d", l);
    snprintf(attn_layer, sizeof attn_layer, "%s/self_attention", layer);
    snprintf(mlp_layer, sizeof mlp_layer, "%s/mlp", layer);
    md->ctx.layer = layer;

    mesh_var *h, *lnx, *a;
    SIM_TRY(layer_shard(md, t, x, "qwen3/inputs", &h));
    SIM_TRY(mesh_nn_rmsnorm(t, h, model_param_leaf(md, t, ix.ln1, l), d->eps, "pre_self_attention_layer_norm", &lnx));
    SIM_TRY(layer_shard(md, t, lnx, "qwen3/lnx", &lnx));

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
                                .query_norm = ix.qn,
                                .key_norm = ix.kn,
                                .norm_eps = d->eps,
                                .layer = l,
                                .rope = rp,
                                .scale = 1.0 / sqrt((double)d->head_dim),
                                .soft_cap = 0,
                                .out_names = A};
    SIM_TRY(model_attention(md, t, b, &ab, lnx, &a));
    md->ctx.layer = layer;
    SIM_TRY(layer_shard(md, t, a, "qwen3/attention_lnx", &a));
    SIM_TRY(mesh_ad_add(t, h, a, "residual_attention", &h)); /* intermediate_inputs */
    mesh_var *hs, *mlp;
    SIM_TRY(mesh_nn_rmsnorm(t, h, model_param_leaf(md, t, ix.ln2, l), d->eps, "post_self_attention_layer_norm", &hs));
    SIM_TRY(layer_shard(md, t, hs, "qwen3/hidden_states", &hs));

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
    sim_status st = layer_shard(md, t, mlp, "qwen3/mlp_lnx", &mlp);
    if (st == SIM_OK) st = mesh_ad_add(t, h, mlp, "residual_mlp", &h);
    if (st == SIM_OK) st = layer_shard(md, t, h, "qwen3/layer_output", y);
    md->ctx.dead_outputs = false;
    md->ctx.layer = saved_layer;
    return st;
}

static sim_status qwen3_layer_fn(model_dev *md, mesh_tape *t, const model_batch *b, int l, mesh_var *x, mesh_var **y,
                                 mesh_var **aux)
{
    *aux = NULL;
    return qwen3_layer(md, t, b, l, x, y);
}

/* ------------------------------------------------------------ definition */

#define LAYER_PARAM(path, rank, shape, logical, init, scale)                                                           \
    model_add_param(m, "params.decoder.layers." path, rank, shape, logical, 1, init, scale)

static void define_params(model_def *m, bool qk_norm)
{
    const model_dims *d = &m->d;
    int64_t V = d->vocab, E = d->emb, H = d->q_heads, K = d->kv_heads, D = d->head_dim, F = d->mlp, L = d->layers;
    double fe = 1.0 / sqrt((double)E);
    model_add_param(m, "params.token_embedder.embedding", 2, (int64_t[]){V, E},
                    (const char *[]){"vocab", "embed_vocab"}, -1, MODEL_INIT_NORMAL, fe);
    LAYER_PARAM("pre_self_attention_layer_norm.scale", 2, ((int64_t[]){E, L}), ((const char *[]){"norm", "layers"}),
                MODEL_INIT_ONES, 0);
    if (d->fused_qkv)
        LAYER_PARAM("self_attention.qkv_proj.kernel", 4, ((int64_t[]){E, L, H + 2 * K, D}),
                    ((const char *[]){"embed_attn", "layers", "heads", "kv"}), MODEL_INIT_NORMAL, fe);
    else {
        /* init_query_w: query_pre_attn_scalar != 1, so no depth scaling of the query init */
        LAYER_PARAM("self_attention.query.kernel", 4, ((int64_t[]){E, L, H, D}),
                    ((const char *[]){"embed_attn", "layers", "q_heads", "kv"}), MODEL_INIT_NORMAL, fe);
        LAYER_PARAM("self_attention.key.kernel", 4, ((int64_t[]){E, L, K, D}),
                    ((const char *[]){"embed_attn", "layers", "kv_heads", "kv_head_dim"}), MODEL_INIT_NORMAL, fe);
        LAYER_PARAM("self_attention.value.kernel", 4, ((int64_t[]){E, L, K, D}),
                    ((const char *[]){"embed_attn", "layers", "kv_heads", "kv_head_dim"}), MODEL_INIT_NORMAL, fe);
    }
    if (qk_norm) {
        LAYER_PARAM("self_attention.query_norm.scale", 2, ((int64_t[]){D, L}), ((const char *[]){"norm", "layers"}),
                    MODEL_INIT_ONES, 0);
        LAYER_PARAM("self_attention.key_norm.scale", 2, ((int64_t[]){D, L}), ((const char *[]){"norm", "layers"}),
                    MODEL_INIT_ONES, 0);
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

/* What MaxText's qwen3 layer would read and shardsim does not simulate is refused, naming the key. */
static sim_status qwen3_define(model_def *m, const cfg_config *cfg)
{
    const model_dims *d = &m->d;
    const char *rt;
    SIM_TRY(model_attention_global_only(cfg, "qwen3", "models/qwen3.py Qwen3DecoderLayer"));
    SIM_TRY(cfg_get_str(cfg, "rope_type", &rt));
    if ((rt && strcmp(rt, "default")) || d->rope_llama31)
        return model_cfg_unsupported(cfg, "rope_type",
                                     "decoder_block=qwen3 is simulated with the default RoPE (rope_max_timescale); use "
                                     "rope_type=default");
    bool mrope, qk_norm;
    SIM_TRY(model_cfg_bool(cfg, "use_mrope", &mrope));
    if (mrope)
        return model_cfg_unsupported(cfg, "use_mrope",
                                     "Qwen3's multimodal RoPE (mrope_section) is not simulated; use use_mrope=false");
    int64_t mtp;
    SIM_TRY(model_cfg_i64(cfg, "mtp_num_layers", &mtp));
    if (mtp != 0)
        return model_cfg_unsupported(
            cfg, "mtp_num_layers",
            "multi-token prediction runs with decoder_block=deepseek only; use mtp_num_layers=0");
    /* use_qk_norm=false is MaxText's qwen3 layer without the norms (the query init stays unscaled) */
    SIM_TRY(model_cfg_bool(cfg, "use_qk_norm", &qk_norm));
    define_params(m, qk_norm);
    return SIM_OK;
}

static sim_status qwen3_setup(model_def *m, const cfg_config *cfg)
{
    (void)m;
    bool on;
    SIM_TRY(model_cfg_bool(cfg, "use_batch_split_schedule", &on));
    if (on)
        return model_cfg_unsupported(cfg, "use_batch_split_schedule",
                                     "MaxText runs the batch-split schedule for decoder_block=deepseek only; drop it");
    return SIM_OK;
}

static sim_status qwen3_loss(model_dev *md, mesh_tape *t, const model_batch *b, mesh_var **loss)
{
    qwen3_ix ix = indices(md->def);
    model_decoder_block dec = {.layer = qwen3_layer_fn, .embed = ix.embed, .norm = ix.norm, .logits = ix.logits};
    return model_decoder_loss(md, t, b, &dec, loss);
}

/* MaxText's decoder_block qwen3 (the dense Qwen3 model files): every layer alike, scanned and
 * pipelined alike, nothing updated outside the optimizer. */
const model_family model_family_qwen3 = {
    .name = "qwen3",
    .define = qwen3_define,
    .setup = qwen3_setup,
    .loss = qwen3_loss,
};
