/* gpt_oss.c — the gpt-oss decoder (MaxText 0.2.5's gpt_oss decoder_block: models/gpt_oss.py
 * GptOssDecoderLayer, scanned as GptOssScannableBlock) on the tape.
 *
 * Settled at the source:
 *   - the scanned block holds inhomogeneous_layer_cycle_interval (2 in both model files) layers,
 *     layers_0 and layers_1, so every parameter is stacked over num_decoder_layers / 2 under
 *     decoder/layers/layers_<c>/...; layer l of the model is layers_<l % 2> at stack index l / 2;
 *   - the attention pattern (GPT_OSS_ATTENTION_PATTERN): layer_id % 2 == 0 local_sliding with
 *     sliding_window_size, else global;
 *   - GptOssAttention is MaxText's Attention with use_bias_in_projections = attention_bias (query,
 *     key, value and out biases), the sinks of attention_sink (one logit per query head, logical
 *     (None,)), query_pre_attn_scalar = head_dim**-0.5 after RoPE (so the query init keeps the plain
 *     fan-in scale), no query/key norm, the RoPE of rope_type (yarn in both model files:
 *     YarnRotaryEmbedding with rope_factor, original_max_position_embeddings, beta_fast/slow,
 *     rope_interleave, rope_truncate, rope_attention_scaling);
 *   - GptOssMlp is moe.py's RoutedMoE(num_experts, num_experts_per_tok, intermediate_dim = mlp_dim,
 *     gate kernel ("embed", None)) with the gate bias of routed_bias, the experts' biases of mlp_bias
 *     (wi_0_bias, wi_1_bias, wo_bias) and apply_ffn_activation's gpt_oss branch: min(w0, limit),
 *     clip(w1, -limit, limit), w0 sigmoid(1.702 w0) (w1 + 1), limit = mlp_activations_limit;
 *     routing as get_topk outside DeepSeek (softmax over the k selected logits, norm_topk_prob);
 *   - the residual stream constrained to (activation_batch, activation_norm_length,
 *     activation_embed) by nn.with_logical_constraint in both shard modes; dropout on the layer's
 *     output; the load-balance loss sown as moe_lb_loss.
 * Around the layers, the Decoder is the generic one (models/blocks/decoder.c). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "blas_kernels/bk_rope.h"
#include "mesh/ad.h"
#include "mesh/nn.h"
#include "models/blocks/attention.h"
#include "models/blocks/decoder.h"
#include "models/blocks/dense_layer.h"
#include "models/blocks/moe.h"
#include "models/core/model.h"

static const char *const A[3] = {"activation_batch", "activation_norm_length", "activation_embed"};

enum { CYCLE = 2 }; /* GPT_OSS_ATTENTION_PATTERN's length, the model files' inhomogeneous_layer_cycle_interval */

/* What the family keeps in model_dims.family_dims. */
typedef struct {
    model_moe_dims moe;
    bk_rope_params rope;
    float limit;
    int64_t window;
    bool attention_bias, sinks, mlp_bias;
} gptoss_dims;

static const gptoss_dims *gdims(const model_def *m) { return m->d.family_dims; }

typedef struct {
    int q, k, v, o, qb, kb, vb, ob, sinks, ln1, ln2, gate, gate_bias, wi0, wi1, wo, wi0b, wi1b, wob;
} gptoss_cycle_ix;

static int pidx(const model_def *m, int c, const char *leaf)
{
    char path[160];
    snprintf(path, sizeof path, "layers.layers_%d.%s", c, leaf);
    return model_param_index(m, path);
}

static gptoss_cycle_ix cycle_indices(const model_def *m, int c)
{
    gptoss_cycle_ix x;
    x.q = pidx(m, c, "GptOssAttention.query.kernel");
    x.k = pidx(m, c, "GptOssAttention.key.kernel");
    x.v = pidx(m, c, "GptOssAttention.value.kernel");
    x.o = pidx(m, c, "GptOssAttention.out.kernel");
    x.qb = pidx(m, c, "GptOssAttention.query.bias");
    x.kb = pidx(m, c, "GptOssAttention.key.bias");
    x.vb = pidx(m, c, "GptOssAttention.value.bias");
    x.ob = pidx(m, c, "GptOssAttention.out.bias");
    x.sinks = pidx(m, c, "GptOssAttention.sinks");
    x.ln1 = pidx(m, c, "pre_self_attention_layer_norm.scale");
    x.ln2 = pidx(m, c, "post_self_attention_layer_norm.scale");
    x.gate = pidx(m, c, "GptOssMlp.gate.kernel");
    x.gate_bias = pidx(m, c, "GptOssMlp.gate.bias");
    x.wi0 = pidx(m, c, "GptOssMlp.wi_0");
    x.wi1 = pidx(m, c, "GptOssMlp.wi_1");
    x.wo = pidx(m, c, "GptOssMlp.wo");
    x.wi0b = pidx(m, c, "GptOssMlp.wi_0_bias");
    x.wi1b = pidx(m, c, "GptOssMlp.wi_1_bias");
    x.wob = pidx(m, c, "GptOssMlp.wo_bias");
    return x;
}

/* One GptOssDecoderLayer (layer l of the model); *lb its load-balance loss (NULL without one). */
static sim_status gptoss_layer(model_dev *md, mesh_tape *t, const model_batch *b, int l, mesh_var *x, mesh_var **y,
                               mesh_var **lb)
{
    const model_def *m = md->def;
    const model_dims *d = &m->d;
    const gptoss_dims *g = gdims(m);
    const int c = l % CYCLE, s = l / CYCLE;
    gptoss_cycle_ix ix = cycle_indices(m, c);
    char layer[64], attn_layer[96], moe_layer[96];
    const char *saved_layer = md->ctx.layer;
    snprintf(layer, sizeof layer, "decoder/layers_%d", l);
    snprintf(attn_layer, sizeof attn_layer, "%s/GptOssAttention", layer);
    snprintf(moe_layer, sizeof moe_layer, "%s/GptOssMlp", layer);
    md->ctx.layer = layer;
    *lb = NULL;

    mesh_var *h, *lnx, *a;
    SIM_TRY(model_shard_as(md, t, x, "gpt_oss/inputs", 3, A, &h));
    SIM_TRY(mesh_nn_rmsnorm(t, h, model_param_leaf(md, t, ix.ln1, s), d->eps, "pre_self_attention_layer_norm", &lnx));
    SIM_TRY(model_shard_as(md, t, lnx, "gpt_oss/lnx", 3, A, &lnx));

    md->ctx.layer = attn_layer;
    model_attention_extra ex = {.query_bias = g->attention_bias ? ix.qb : -1,
                                .key_bias = g->attention_bias ? ix.kb : -1,
                                .value_bias = g->attention_bias ? ix.vb : -1,
                                .out_bias = g->attention_bias ? ix.ob : -1,
                                .sinks = g->sinks ? ix.sinks : -1};
    model_attention_block ab = {.query = ix.q,
                                .key = ix.k,
                                .value = ix.v,
                                .qkv = -1,
                                .out = ix.o,
                                .query_norm = -1,
                                .key_norm = -1,
                                .layer = s,
                                .rope = g->rope,
                                .scale = 1.0 / sqrt((double)d->head_dim),
                                .soft_cap = 0,
                                /* GPT_OSS_ATTENTION_PATTERN: local_sliding, then global */
                                .sliding_window = c == 0 ? g->window : 0,
                                .out_names = A,
                                .extra = &ex};
    SIM_TRY(model_attention(md, t, b, &ab, lnx, &a));
    md->ctx.layer = layer;
    SIM_TRY(model_shard_as(md, t, a, "gpt_oss/attention_lnx", 3, A, &a));
    SIM_TRY(mesh_ad_add(t, h, a, "residual_attention", &h)); /* intermediate_inputs */
    mesh_var *hs, *moe;
    SIM_TRY(mesh_nn_rmsnorm(t, h, model_param_leaf(md, t, ix.ln2, s), d->eps, "post_self_attention_layer_norm", &hs));
    SIM_TRY(model_shard_as(md, t, hs, "gpt_oss/hidden_states", 3, A, &hs));

    model_moe_gptoss go = {.wi0_bias = g->mlp_bias ? ix.wi0b : -1,
                           .wi1_bias = g->mlp_bias ? ix.wi1b : -1,
                           .wo_bias = g->mlp_bias ? ix.wob : -1,
                           .limit = g->limit,
                           .stack = s};
    model_moe_layer ml = {.dims = &g->moe,
                          .gate = ix.gate,
                          .gate_bias = ix.gate_bias,
                          .wi0 = ix.wi0,
                          .wi1 = ix.wi1,
                          .wo = ix.wo,
                          .out = A,
                          .lb_layers = d->layers,
                          .gptoss = &go};
    SIM_TRY(model_moe_routed(md, t, &ml, l, hs, moe_layer, &moe, lb));
    md->ctx.layer = layer;
    /* the layer's tail: nothing reads it when remat recomputes the layer */
    md->ctx.dead_outputs = md->recomputing;
    sim_status st = model_shard_as(md, t, moe, "gpt_oss/mlp_lnx", 3, A, &moe);
    if (st == SIM_OK) st = mesh_ad_add(t, moe, h, "residual_mlp", &h);
    if (st == SIM_OK) st = model_dropout(md, t, h, layer, &h);
    if (st == SIM_OK) st = model_shard_as(md, t, h, "gpt_oss/layer_output", 3, A, y);
    md->ctx.dead_outputs = false;
    md->ctx.layer = saved_layer;
    return st;
}

static sim_status gptoss_layer_fn(model_dev *md, mesh_tape *t, const model_batch *b, int l, mesh_var *x, mesh_var **y,
                                  mesh_var **aux)
{
    return gptoss_layer(md, t, b, l, x, y, aux);
}

/* ------------------------------------------------------------ definition */

/* MaxText's parameters: the embedding, the scanned block's layers_0 and layers_1 (each stacked over
 * num_decoder_layers / 2), the head. */
static void define_params(model_def *m)
{
    const model_dims *d = &m->d;
    const gptoss_dims *g = gdims(m);
    int64_t V = d->vocab, E = d->emb, H = d->q_heads, K = d->kv_heads, D = d->head_dim, L = d->layers / CYCLE;
    double fe = 1.0 / sqrt((double)E);
    model_add_param(m, "params.token_embedder.embedding", 2, (int64_t[]){V, E},
                    (const char *[]){"vocab", "embed_vocab"}, -1, MODEL_INIT_NORMAL, fe);
    char path[192], scope[64];
#define P(leaf, rank, shape, logical, init, scale)                                                                     \
    do {                                                                                                               \
        snprintf(path, sizeof path, "params.decoder.layers.layers_%d.%s", c, leaf);                                    \
        model_add_param(m, path, rank, shape, logical, 1, init, scale);                                                \
    } while (0)
    for (int c = 0; c < CYCLE; c++) {
        P("pre_self_attention_layer_norm.scale", 2, ((int64_t[]){E, L}), ((const char *[]){"norm", "layers"}),
          MODEL_INIT_ONES, 0);
        /* init_query_w: query_pre_attn_scalar != 1, so no depth scaling */
        P("GptOssAttention.query.kernel", 4, ((int64_t[]){E, L, H, D}),
          ((const char *[]){"embed_attn", "layers", "q_heads", "kv"}), MODEL_INIT_NORMAL, fe);
        P("GptOssAttention.key.kernel", 4, ((int64_t[]){E, L, K, D}),
          ((const char *[]){"embed_attn", "layers", "kv_heads", "kv_head_dim"}), MODEL_INIT_NORMAL, fe);
        P("GptOssAttention.value.kernel", 4, ((int64_t[]){E, L, K, D}),
          ((const char *[]){"embed_attn", "layers", "kv_heads", "kv_head_dim"}), MODEL_INIT_NORMAL, fe);
        P("GptOssAttention.out.kernel", 4, ((int64_t[]){H, L, D, E}),
          ((const char *[]){"heads", "layers", "kv", "embed_attn"}), MODEL_INIT_NORMAL, 1.0 / sqrt((double)(H * D)));
        if (g->attention_bias) { /* DenseGeneral's bias: the kernel's output axes (default_bias_init: zeros) */
            P("GptOssAttention.query.bias", 3, ((int64_t[]){H, L, D}), ((const char *[]){"q_heads", "layers", "kv"}),
              MODEL_INIT_ZEROS, 0);
            P("GptOssAttention.key.bias", 3, ((int64_t[]){K, L, D}),
              ((const char *[]){"kv_heads", "layers", "kv_head_dim"}), MODEL_INIT_ZEROS, 0);
            P("GptOssAttention.value.bias", 3, ((int64_t[]){K, L, D}),
              ((const char *[]){"kv_heads", "layers", "kv_head_dim"}), MODEL_INIT_ZEROS, 0);
            P("GptOssAttention.out.bias", 2, ((int64_t[]){E, L}), ((const char *[]){"embed_attn", "layers"}),
              MODEL_INIT_ZEROS, 0);
        }
        if (g->sinks) /* Attention.sinks: default_bias_init, out_sharding (None,) */
            P("GptOssAttention.sinks", 2, ((int64_t[]){H, L}), ((const char *[]){NULL, "layers"}), MODEL_INIT_ZEROS, 0);
        P("post_self_attention_layer_norm.scale", 2, ((int64_t[]){E, L}), ((const char *[]){"norm", "layers"}),
          MODEL_INIT_ONES, 0);
        snprintf(scope, sizeof scope, "layers_%d.GptOssMlp", c);
        model_moe_define_routed_params_stack(m, scope, &g->moe, L, g->mlp_bias);
    }
#undef P
    model_dense_define_head(m);
}

static sim_status refuse_if(const cfg_config *cfg, const char *key, bool on, const char *fix)
{
    return on ? model_cfg_unsupported(cfg, key, fix) : SIM_OK;
}

/* What MaxText's gpt_oss layer would read and shardsim does not simulate is refused, naming the key. */
static sim_status gptoss_define(model_def *m, const cfg_config *cfg)
{
    const model_dims *d = &m->d;
    gptoss_dims *g = calloc(1, sizeof *g);
    SIM_ASSERT(g);
    m->d.family_dims = g; /* model_def_free (or the refused definition) frees it */
    /* configs/types.py (MaxTextConfig's checks): explicit sharding only for a list of decoders that
     * has no gpt_oss in 0.2.5 */
    if (d->mode == MESH_MODE_EXPLICIT)
        return model_cfg_unsupported(
            cfg, "shard_mode",
            "MaxText 0.2.5 refuses it at config time (configs/types.py: \"Decoder 'gpt_oss' is "
            "not supported with 'explicit' sharding\"); use shard_mode=auto");
    int64_t cycle, mtp;
    SIM_TRY(model_cfg_i64(cfg, "inhomogeneous_layer_cycle_interval", &cycle));
    SIM_TRY(refuse_if(cfg, "inhomogeneous_layer_cycle_interval", cycle != CYCLE,
                      "gpt_oss's scanned block is GPT_OSS_ATTENTION_PATTERN's two layers (local_sliding, global), as "
                      "both gpt-oss model files set it; use inhomogeneous_layer_cycle_interval=2"));
    if (d->layers % CYCLE)
        return model_cfg_unsupported(cfg, "base_num_decoder_layers",
                                     "gpt_oss scans blocks of two layers (inhomogeneous_layer_cycle_interval=2): use "
                                     "an even base_num_decoder_layers");
    bool b;
    SIM_TRY(model_cfg_bool(cfg, "scan_layers", &b));
    SIM_TRY(refuse_if(cfg, "scan_layers", !b,
                      "gpt_oss is simulated with its scanned block (decoder/layers/layers_0, layers_1); use "
                      "scan_layers=true"));
    int64_t ipp, dpp;
    SIM_TRY(model_cfg_i64(cfg, "ici_pipeline_parallelism", &ipp));
    SIM_TRY(model_cfg_i64(cfg, "dcn_pipeline_parallelism", &dpp));
    SIM_TRY(refuse_if(cfg, ipp > 1 ? "ici_pipeline_parallelism" : "dcn_pipeline_parallelism", ipp > 1 || dpp > 1,
                      "the pipeline over gpt_oss's two-layer scanned block is not simulated; use "
                      "ici_pipeline_parallelism=1 and dcn_pipeline_parallelism=1"));
    SIM_TRY(model_cfg_bool(cfg, "use_qk_norm", &b));
    SIM_TRY(refuse_if(cfg, "use_qk_norm", b,
                      "GptOssAttention has no query/key norm in MaxText 0.2.5's gpt_oss layer; use use_qk_norm=false"));
    SIM_TRY(refuse_if(cfg, "fused_qkv", d->fused_qkv,
                      "gpt_oss's projections carry biases (attention_bias) and are simulated unfused; use "
                      "fused_qkv=false"));
    SIM_TRY(refuse_if(cfg, "fused_mlp", d->fused_mlp,
                      "the gpt_oss layer has no dense MLP to fuse (its experts keep wi_0 and wi_1); use "
                      "fused_mlp=false"));
    SIM_TRY(model_cfg_i64(cfg, "mtp_num_layers", &mtp));
    SIM_TRY(refuse_if(cfg, "mtp_num_layers", mtp != 0,
                      "multi-token prediction runs with decoder_block=deepseek only; use mtp_num_layers=0"));
    SIM_TRY(model_cfg_bool(cfg, "use_mrope", &b));
    SIM_TRY(refuse_if(cfg, "use_mrope", b, "multimodal RoPE is not simulated; use use_mrope=false"));
    /* each layer passes its own attention_type (GPT_OSS_ATTENTION_PATTERN): the config's is not read */
    const char *at;
    SIM_TRY(cfg_get_str(cfg, "attention_type", &at));
    SIM_TRY(refuse_if(cfg, "attention_type", at && strcmp(at, "global"),
                      "gpt_oss's layers take their attention type from GPT_OSS_ATTENTION_PATTERN (layers_0 "
                      "local_sliding with sliding_window_size, layers_1 global), not from the config; use "
                      "attention_type=global"));
    /* the RoPE: rope_type default or yarn (YarnRotaryEmbedding, both model files) */
    const char *rt;
    SIM_TRY(cfg_get_str(cfg, "rope_type", &rt));
    bool yarn = rt && !strncmp(rt, "yarn", 4);
    if ((rt && strcmp(rt, "default") && !yarn) || d->rope_llama31)
        return model_cfg_unsupported(cfg, "rope_type",
                                     "decoder_block=gpt_oss is simulated with rope_type=yarn (its model files) or "
                                     "default");
    if (yarn) {
        bool pairwise;
        SIM_TRY(model_cfg_bool(cfg, "rope_pairwise", &pairwise));
        SIM_TRY(refuse_if(cfg, "rope_pairwise", pairwise,
                          "YaRN's pairwise rotation is not simulated; use rope_pairwise=false"));
        g->rope = bk_rope_params_yarn((int)d->head_dim);
        g->rope.max_timescale = d->rope_theta;
        double f;
        int64_t n;
        SIM_TRY(cfg_get_double(cfg, "rope_factor", &f));
        g->rope.factor = f;
        SIM_TRY(model_cfg_i64(cfg, "original_max_position_embeddings", &n));
        g->rope.original_max_position_embeddings = (int)n;
        SIM_TRY(cfg_get_double(cfg, "beta_fast", &f));
        g->rope.beta_fast = f;
        SIM_TRY(cfg_get_double(cfg, "beta_slow", &f));
        g->rope.beta_slow = f;
        SIM_TRY(model_cfg_bool(cfg, "rope_interleave", &b));
        g->rope.interleave = b;
        SIM_TRY(model_cfg_bool(cfg, "rope_truncate", &b));
        g->rope.truncate = b;
        SIM_TRY(model_cfg_bool(cfg, "rope_attention_scaling", &b));
        g->rope.attention_scaling = b;
    } else {
        g->rope = bk_rope_params_default((int)d->head_dim);
        g->rope.min_timescale = d->rope_min;
        g->rope.max_timescale = d->rope_theta;
        g->rope.linear_scaling_factor = d->rope_linear;
    }
    SIM_TRY(model_cfg_i64(cfg, "sliding_window_size", &g->window));
    if (g->window <= 0)
        return model_cfg_unsupported(cfg, "sliding_window_size",
                                     "gpt_oss's even layers are local_sliding (GPT_OSS_ATTENTION_PATTERN), which "
                                     "MaxText requires a positive window for; set sliding_window_size (128 in the "
                                     "model files)");
    SIM_TRY(model_cfg_bool(cfg, "attention_bias", &g->attention_bias));
    SIM_TRY(model_cfg_bool(cfg, "attention_sink", &g->sinks));
    SIM_TRY(model_cfg_bool(cfg, "mlp_bias", &g->mlp_bias));
    const char **acts;
    int nacts;
    SIM_TRY(cfg_get_str_list(cfg, "mlp_activations", &acts, &nacts));
    bool glu = nacts == 2 && !strcmp(acts[0], "sigmoid") && !strcmp(acts[1], "linear");
    free(acts);
    SIM_TRY(refuse_if(cfg, "mlp_activations", !glu,
                      "gpt_oss's experts run apply_ffn_activation's gpt_oss branch with activation_fn = sigmoid "
                      "(w0 sigmoid(1.702 w0) (w1 + 1)), as both model files set it; use "
                      "mlp_activations=[sigmoid, linear]"));
    double lim;
    SIM_TRY(cfg_get_double(cfg, "mlp_activations_limit", &lim));
    g->limit = (float)lim;
    /* RoutedMoE(intermediate_dim=config.mlp_dim), get_topk's branch outside DeepSeek */
    SIM_TRY(model_moe_dims_read(cfg, d, true, &g->moe));
    g->moe.moe_mlp = d->mlp;
    SIM_TRY(model_moe_check_routed(d, &g->moe));
    SIM_TRY(refuse_if(cfg, "routed_bias_update_rate", g->moe.bias_update_rate > 0,
                      "loss-free balancing runs with decoder_block=deepseek only; use routed_bias_update_rate=0"));
    define_params(m);
    return model_moe_check_mesh(m, cfg, &g->moe);
}

static sim_status gptoss_setup(model_def *m, const cfg_config *cfg)
{
    return model_moe_check_setup(m, cfg, &gdims(m)->moe);
}

static sim_status gptoss_loss(model_dev *md, mesh_tape *t, const model_batch *b, mesh_var **loss)
{
    const model_def *m = md->def;
    model_decoder_block dec = {.layer = gptoss_layer_fn,
                               .embed = model_param_index(m, "token_embedder.embedding"),
                               .norm = model_param_index(m, "decoder_norm.scale"),
                               .logits = model_param_index(m, "logits_dense.kernel")};
    return model_decoder_loss(md, t, b, &dec, loss);
}

/* MaxText's decoder_block gpt_oss (gpt-oss-20b, gpt-oss-120b). */
const model_family model_family_gpt_oss = {
    .name = "gpt_oss",
    .define = gptoss_define,
    .setup = gptoss_setup,
    .loss = gptoss_loss,
};
