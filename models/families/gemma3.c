/* gemma3.c — the Gemma 3 decoder (MaxText 0.2.5's gemma3 decoder_block: models/gemma3.py
 * Gemma3DecoderLayer, scanned as Gemma3ScannableBlock by layers/nnx_decoders.py) on the tape.
 *
 * MaxText's choices, settled at the source:
 *   - the layers come in blocks of six (GEMMA3_ATTENTION_PATTERN: five LOCAL_SLIDING, then one
 *     GLOBAL).  _init_scanned_gemma3 scans num_decoder_layers // 6 blocks (parameters
 *     decoder.layers.layers_<j>.*, j = 0..5, stacked along the scanned "layers" dim) and builds
 *     layers_remainder, one unscanned block of num_decoder_layers % 6 layers
 *     (decoder.layers_remainder.layers_<j>.*, no stacked dim), whose layer j is again
 *     get_attention_type(j): the remainder layers are all local.  The remat unit is the block
 *     (the scan's body, and the remainder's own jax.checkpoint with the same policy);
 *   - a layer: x -> pre_self_attention_norm -> Attention -> post_self_attention_norm (with
 *     use_post_attn_norm) -> + x -> pre_ffw_norm -> MlpBlock -> post_ffw_norm (with
 *     use_post_ffw_norm) -> + residual -> Dropout(broadcast_dims=(-2,)); the residual stream is
 *     constrained (maybe_shard_with_logical, both shard modes) to (activation_batch,
 *     activation_norm_length, activation_embed) after the input, the pre-attention norm, the
 *     attention, the MLP and the output, and the block constrains its input the same way;
 *   - Attention with use_qk_norm=True (query_norm and key_norm, RMSNorms over head_dim, before
 *     RoPE), query_pre_attn_scalar = get_query_pre_attn_scalar(config): head_dim**-0.5 for
 *     gemma3-4b and gemma3-12b, (base_emb_dim // base_num_query_heads)**-0.5 for gemma3-27b, a
 *     ValueError for any other model_name (refused here naming model_name); that scalar is not 1,
 *     so init_query_w folds no 1/sqrt(head_dim) into the query init.  attn_logits_soft_cap as the
 *     config sets it (the gemma3 files set none);
 *   - the local layers' window is sliding_window_size (AttentionOp's mask); their RoPE's max
 *     timescale is local_rope_max_timescale when > 0 and their linear scaling factor 1
 *     (init_rotary_embedding: "In gemma3, linear scaling factor does not apply to local sliding
 *     layers"); the global layer's is rope_max_timescale with rope_linear_scaling_factor;
 *   - MlpBlock with config.mlp_activations (the files: [gelu, linear], jax.nn.gelu's tanh form),
 *     intermediate_sharding (activation_batch, activation_length, activation_mlp);
 *   - around the layers, the generic Decoder (models/blocks/decoder.c): MaxText 0.2.5's decoder
 *     multiplies the embedding by nothing (no sqrt(emb_dim) scale: nnx_decoders.py _apply_embedding
 *     only casts it to dtype), and the logits go through attend_on_embedding (the files set
 *     logits_via_embedding), whose hard-coded bfloat16 cast of the table model_logits follows;
 *     final_logits_soft_cap as the config sets it (the gemma3 files set none). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mesh/ad.h"
#include "mesh/nn.h"
#include "models/blocks/attention.h"
#include "models/blocks/decoder.h"
#include "models/blocks/dense_layer.h"
#include "models/blocks/mlp.h"
#include "models/core/model.h"

enum { G3_PATTERN = 6 }; /* len(GEMMA3_ATTENTION_PATTERN) */

/* The family's own dims (model_dims.family_dims). */
typedef struct {
    int64_t blocks;        /* scanned blocks: num_decoder_layers // 6 */
    int64_t remainder;     /* layers of layers_remainder: num_decoder_layers % 6 */
    double query_scale;    /* get_query_pre_attn_scalar */
    int64_t window;        /* sliding_window_size of the local layers */
    double local_rope_max; /* the local layers' RoPE max timescale */
    bool post_attn_norm, post_ffw_norm;
} g3_dims;

/* Gemma3DecoderLayer.activation_axis_names (train mode) */
static const char *const A[3] = {"activation_batch", "activation_norm_length", "activation_embed"};
/* its MlpBlock intermediate_sharding */
static const char *const MLP_MID[3] = {"activation_batch", "activation_length", "activation_mlp"};

/* One sublayer's parameters (model_param_index; -1 where absent). */
typedef struct {
    int q, k, v, o, qn, kn, pre_attn, post_attn, pre_ffw, post_ffw, wi0, wi1, wo;
} g3_ix;

static int ix_of(const model_def *m, bool rem, int j, const char *what)
{
    char path[160];
    snprintf(path, sizeof path, "decoder.%s.layers_%d.%s", rem ? "layers_remainder" : "layers", j, what);
    return model_param_index(m, path);
}

static g3_ix g3_indices(const model_def *m, bool rem, int j)
{
    g3_ix x = {
        .q = ix_of(m, rem, j, "self_attention.query.kernel"),
        .k = ix_of(m, rem, j, "self_attention.key.kernel"),
        .v = ix_of(m, rem, j, "self_attention.value.kernel"),
        .o = ix_of(m, rem, j, "self_attention.out.kernel"),
        .qn = ix_of(m, rem, j, "self_attention.query_norm.scale"),
        .kn = ix_of(m, rem, j, "self_attention.key_norm.scale"),
        .pre_attn = ix_of(m, rem, j, "pre_self_attention_norm.scale"),
        .post_attn = ix_of(m, rem, j, "post_self_attention_norm.scale"),
        .pre_ffw = ix_of(m, rem, j, "pre_ffw_norm.scale"),
        .post_ffw = ix_of(m, rem, j, "post_ffw_norm.scale"),
        .wi0 = ix_of(m, rem, j, "mlp.wi_0.kernel"),
        .wi1 = ix_of(m, rem, j, "mlp.wi_1.kernel"),
        .wo = ix_of(m, rem, j, "mlp.wo.kernel"),
    };
    return x;
}

/* get_attention_type(j): layer 5 of a block is global, the others local sliding. */
static bool g3_is_global(int j) { return j % G3_PATTERN == G3_PATTERN - 1; }

/* The rotary embedding of sublayer j (Attention.init_rotary_embedding). */
static bk_rope_params g3_rope(const model_dims *d, const g3_dims *g, bool global)
{
    bk_rope_params rp = bk_rope_params_default((int)d->head_dim);
    rp.min_timescale = d->rope_min;
    rp.max_timescale = d->rope_theta;
    rp.linear_scaling_factor = d->rope_linear;
    if (!global) {
        if (g->local_rope_max > 0) rp.max_timescale = g->local_rope_max;
        rp.linear_scaling_factor = 1.0;
    }
    return rp;
}

static sim_status shard(model_dev *md, mesh_tape *t, mesh_var *x, const char *what, mesh_var **y)
{
    char name[64];
    snprintf(name, sizeof name, "gemma3/%s", what);
    return model_shard_as(md, t, x, name, 3, A, y);
}

/* One Gemma3DecoderLayer: sublayer j of n in the block (remainder or scanned), stack index s.  Only the
 * block's last layer makes the remat unit's output, which nothing reads when remat recomputes it. */
static sim_status g3_layer(model_dev *md, mesh_tape *t, const model_batch *b, bool rem, int j, int n, int s, int unit,
                           mesh_var *x, mesh_var **y)
{
    const model_def *m = md->def;
    const model_dims *d = &m->d;
    const g3_dims *g = d->family_dims;
    g3_ix ix = g3_indices(m, rem, j);
    const bool global = g3_is_global(j);
    char layer[64], attn_layer[96], mlp_layer[96];
    const char *saved_layer = md->ctx.layer;
    snprintf(layer, sizeof layer, "decoder/%s_%d/layers_%d", rem ? "layers_remainder" : "layers", unit, j);
    snprintf(attn_layer, sizeof attn_layer, "%s/self_attention", layer);
    snprintf(mlp_layer, sizeof mlp_layer, "%s/mlp", layer);
    md->ctx.layer = layer;

    sim_status st;
    mesh_var *in, *lnx, *a, *h, *hs, *mlp;
    SIM_TRY_GOTO(shard(md, t, x, "inputs", &in), st, fail);
    SIM_TRY_GOTO(
        mesh_nn_rmsnorm(t, in, model_param_leaf(md, t, ix.pre_attn, s), d->eps, "pre_self_attention_norm", &lnx), st,
        fail);
    SIM_TRY_GOTO(shard(md, t, lnx, "lnx", &lnx), st, fail);
    md->ctx.layer = attn_layer;
    model_attention_block ab = {.query = ix.q,
                                .key = ix.k,
                                .value = ix.v,
                                .qkv = -1,
                                .out = ix.o,
                                .query_norm = ix.qn,
                                .key_norm = ix.kn,
                                .norm_eps = d->eps,
                                .layer = s,
                                .rope = g3_rope(d, g, global),
                                .scale = g->query_scale,
                                .soft_cap = d->attn_soft_cap,
                                .sliding_window = global ? 0 : g->window,
                                .out_names = A};
    SIM_TRY_GOTO(model_attention(md, t, b, &ab, lnx, &a), st, fail);
    md->ctx.layer = layer;
    if (ix.post_attn >= 0)
        SIM_TRY_GOTO(
            mesh_nn_rmsnorm(t, a, model_param_leaf(md, t, ix.post_attn, s), d->eps, "post_self_attention_norm", &a), st,
            fail);
    SIM_TRY_GOTO(shard(md, t, a, "attention_lnx", &a), st, fail);
    SIM_TRY_GOTO(mesh_ad_add(t, a, in, "residual_attention", &h), st, fail);
    SIM_TRY_GOTO(mesh_nn_rmsnorm(t, h, model_param_leaf(md, t, ix.pre_ffw, s), d->eps, "pre_ffw_norm", &hs), st, fail);
    md->ctx.layer = mlp_layer;
    const bool last = j == n - 1;
    model_mlp_block mb = {.wi_0 = ix.wi0,
                          .wi_1 = ix.wi1,
                          .wi = -1,
                          .wo = ix.wo,
                          .layer = s,
                          .intermediate = MLP_MID,
                          .out = A,
                          .output_live = !last};
    SIM_TRY_GOTO(model_mlp(md, t, &mb, hs, &mlp), st, fail);
    md->ctx.layer = layer;
    /* the block's tail: nothing reads it when remat recomputes the block (model_mlp) */
    md->ctx.dead_outputs = md->recomputing && last;
    if (ix.post_ffw >= 0)
        SIM_TRY_GOTO(mesh_nn_rmsnorm(t, mlp, model_param_leaf(md, t, ix.post_ffw, s), d->eps, "post_ffw_norm", &mlp),
                     st, fail);
    SIM_TRY_GOTO(shard(md, t, mlp, "mlp_lnx", &mlp), st, fail);
    SIM_TRY_GOTO(mesh_ad_add(t, mlp, h, "residual_mlp", &h), st, fail);
    SIM_TRY_GOTO(model_dropout(md, t, h, layer, &h), st, fail);
    SIM_TRY_GOTO(shard(md, t, h, "y", y), st, fail);
fail: /* the context as the caller left it, on every path */
    md->ctx.dead_outputs = false;
    md->ctx.layer = saved_layer;
    return st;
}

/* One remat unit: scanned block u (u < blocks) of six layers, or the remainder block
 * (Gemma3ScannableBlock.__call__: the input constrained, then each layer in turn). */
static sim_status g3_block(model_dev *md, mesh_tape *t, const model_batch *b, int u, mesh_var *x, mesh_var **y,
                           mesh_var **aux)
{
    const g3_dims *g = md->def->d.family_dims;
    *aux = NULL;
    const bool rem = u >= g->blocks;
    const int n = rem ? (int)g->remainder : G3_PATTERN, s = rem ? 0 : u;
    mesh_var *h;
    SIM_TRY(shard(md, t, x, "block_inputs", &h));
    for (int j = 0; j < n; j++) SIM_TRY(g3_layer(md, t, b, rem, j, n, s, u, h, &h));
    *y = h;
    return SIM_OK;
}

/* ------------------------------------------------------------ definition */

static void define_layer(model_def *m, const g3_dims *g, bool rem, int j)
{
    const model_dims *d = &m->d;
    int64_t E = d->emb, H = d->q_heads, K = d->kv_heads, D = d->head_dim, F = d->mlp, L = g->blocks;
    double fe = 1.0 / sqrt((double)E);
    char prefix[96];
    snprintf(prefix, sizeof prefix, "params.decoder.%s.layers_%d.", rem ? "layers_remainder" : "layers", j);
    /* a scanned parameter has the stacked dim after its first ("layers", scan dim 1); a remainder one
     * has none */
#define G3_PARAM(path, rank, shape, logical, init, scale)                                                              \
    do {                                                                                                               \
        const int64_t *sh_ = (shape);                                                                                  \
        const char *const *lg_ = (logical);                                                                            \
        int64_t s2[5];                                                                                                 \
        const char *l2[5];                                                                                             \
        int r2 = 0;                                                                                                    \
        for (int i_ = 0; i_ < (rank); i_++) {                                                                          \
            s2[r2] = sh_[i_], l2[r2++] = lg_[i_];                                                                      \
            if (i_ == 0 && !rem) s2[r2] = L, l2[r2++] = "layers";                                                      \
        }                                                                                                              \
        char p_[192];                                                                                                  \
        snprintf(p_, sizeof p_, "%s%s", prefix, path);                                                                 \
        model_add_param(m, p_, r2, s2, l2, rem ? -1 : 1, init, scale);                                                 \
    } while (0)
    G3_PARAM("pre_self_attention_norm.scale", 1, ((int64_t[]){E}), ((const char *[]){"norm"}), MODEL_INIT_ONES, 0);
    /* init_query_w: query_pre_attn_scalar != 1, so no 1/sqrt(head_dim) in the query init */
    G3_PARAM("self_attention.query.kernel", 3, ((int64_t[]){E, H, D}),
             ((const char *[]){"embed_attn", "q_heads", "kv"}), MODEL_INIT_NORMAL, fe);
    G3_PARAM("self_attention.key.kernel", 3, ((int64_t[]){E, K, D}),
             ((const char *[]){"embed_attn", "kv_heads", "kv_head_dim"}), MODEL_INIT_NORMAL, fe);
    G3_PARAM("self_attention.value.kernel", 3, ((int64_t[]){E, K, D}),
             ((const char *[]){"embed_attn", "kv_heads", "kv_head_dim"}), MODEL_INIT_NORMAL, fe);
    G3_PARAM("self_attention.query_norm.scale", 1, ((int64_t[]){D}), ((const char *[]){"norm"}), MODEL_INIT_ONES, 0);
    G3_PARAM("self_attention.key_norm.scale", 1, ((int64_t[]){D}), ((const char *[]){"norm"}), MODEL_INIT_ONES, 0);
    G3_PARAM("self_attention.out.kernel", 3, ((int64_t[]){H, D, E}), ((const char *[]){"heads", "kv", "embed_attn"}),
             MODEL_INIT_NORMAL, 1.0 / sqrt((double)(H * D)));
    if (g->post_attn_norm)
        G3_PARAM("post_self_attention_norm.scale", 1, ((int64_t[]){E}), ((const char *[]){"norm"}), MODEL_INIT_ONES, 0);
    G3_PARAM("pre_ffw_norm.scale", 1, ((int64_t[]){E}), ((const char *[]){"norm"}), MODEL_INIT_ONES, 0);
    G3_PARAM("mlp.wi_0.kernel", 2, ((int64_t[]){E, F}), ((const char *[]){"embed", "mlp"}), MODEL_INIT_TRUNC_NORMAL,
             fe);
    G3_PARAM("mlp.wi_1.kernel", 2, ((int64_t[]){E, F}), ((const char *[]){"embed", "mlp"}), MODEL_INIT_TRUNC_NORMAL,
             fe);
    G3_PARAM("mlp.wo.kernel", 2, ((int64_t[]){F, E}), ((const char *[]){"mlp", "embed"}), MODEL_INIT_TRUNC_NORMAL,
             1.0 / sqrt((double)F));
    if (g->post_ffw_norm)
        G3_PARAM("post_ffw_norm.scale", 1, ((int64_t[]){E}), ((const char *[]){"norm"}), MODEL_INIT_ONES, 0);
#undef G3_PARAM
}

/* get_query_pre_attn_scalar (models/gemma3.py): by model_name. */
static sim_status query_pre_attn_scalar(const model_def *m, const cfg_config *cfg, double *out)
{
    const model_dims *d = &m->d;
    if (!strcmp(d->model_name, "gemma3-4b") || !strcmp(d->model_name, "gemma3-12b")) {
        *out = 1.0 / sqrt((double)d->head_dim);
        return SIM_OK;
    }
    if (!strcmp(d->model_name, "gemma3-27b")) {
        int64_t e, h;
        SIM_TRY(model_cfg_i64(cfg, "base_emb_dim", &e));
        SIM_TRY(model_cfg_i64(cfg, "base_num_query_heads", &h));
        if (h < 1 || e / h < 1)
            return model_cfg_unsupported(cfg, "base_num_query_heads",
                                         "gemma3-27b's query scale is (base_emb_dim // base_num_query_heads)**-0.5, "
                                         "which needs base_emb_dim >= base_num_query_heads >= 1");
        *out = 1.0 / sqrt((double)(e / h));
        return SIM_OK;
    }
    return model_cfg_unsupported(
        cfg, "model_name",
        "MaxText 0.2.5's gemma3 layer takes its query scale from the model name "
        "(models/gemma3.py get_query_pre_attn_scalar: gemma3-4b, gemma3-12b or gemma3-27b) and "
        "raises \"Unsupported model name\" for any other; use one of the three (with "
        "override_model_config=true to change its sizes)");
}

/* What MaxText's gemma3 layer would read and shardsim does not simulate is refused, naming the key. */
static sim_status gemma3_define(model_def *m, const cfg_config *cfg)
{
    const model_dims *d = &m->d;
    g3_dims *g = calloc(1, sizeof *g);
    if (!g) return sim_err(SIM_ERR_OOM, "gemma3: out of host memory");
    m->d.family_dims = g; /* model_def_free frees it */
    SIM_TRY(query_pre_attn_scalar(m, cfg, &g->query_scale));
    const char *at, *rt;
    SIM_TRY(cfg_get_str(cfg, "attention_type", &at));
    if (at && strcmp(at, "global") && strcmp(at, "local_sliding"))
        return model_cfg_unsupported(cfg, "attention_type",
                                     "the gemma3 layers take their attention type from GEMMA3_ATTENTION_PATTERN (five "
                                     "local_sliding, one global); use attention_type=global");
    SIM_TRY(cfg_get_str(cfg, "rope_type", &rt));
    if ((rt && strcmp(rt, "default")) || d->rope_llama31)
        return model_cfg_unsupported(cfg, "rope_type",
                                     "decoder_block=gemma3 is simulated with the default RoPE (rope_max_timescale, "
                                     "local_rope_max_timescale for the local layers); use rope_type=default");
    SIM_TRY(model_cfg_i64(cfg, "sliding_window_size", &g->window));
    if (g->window <= 0)
        return model_cfg_unsupported(cfg, "sliding_window_size",
                                     "the gemma3 local layers need a window (AttentionOp raises without one); set "
                                     "sliding_window_size > 0 (the gemma3 files set 1024)");
    int64_t lr;
    SIM_TRY(model_cfg_i64(cfg, "local_rope_max_timescale", &lr));
    g->local_rope_max = (double)lr;
    SIM_TRY(model_cfg_bool(cfg, "use_post_attn_norm", &g->post_attn_norm));
    SIM_TRY(model_cfg_bool(cfg, "use_post_ffw_norm", &g->post_ffw_norm));
    bool scan;
    SIM_TRY(model_cfg_bool(cfg, "scan_layers", &scan));
    if (!scan)
        return model_cfg_unsupported(cfg, "scan_layers",
                                     "decoder_block=gemma3 is simulated scanned (blocks of six layers and "
                                     "layers_remainder, nnx_decoders.py _init_scanned_gemma3); use scan_layers=true");
    if (d->fused_qkv)
        return model_cfg_unsupported(
            cfg, "fused_qkv",
            "decoder_block=gemma3 is simulated with separate query, key and value kernels; use "
            "fused_qkv=false");
    if (d->fused_mlp)
        return model_cfg_unsupported(cfg, "fused_mlp",
                                     "decoder_block=gemma3 is simulated with separate wi_0 and wi_1 kernels; use "
                                     "fused_mlp=false");
    int64_t mtp;
    SIM_TRY(model_cfg_i64(cfg, "mtp_num_layers", &mtp));
    if (mtp != 0)
        return model_cfg_unsupported(
            cfg, "mtp_num_layers",
            "multi-token prediction runs with decoder_block=deepseek only; use mtp_num_layers=0");
    g->blocks = d->layers / G3_PATTERN;
    g->remainder = d->layers % G3_PATTERN;

    int64_t V = d->vocab, E = d->emb;
    model_add_param(m, "params.token_embedder.embedding", 2, (int64_t[]){V, E},
                    (const char *[]){"vocab", "embed_vocab"}, -1, MODEL_INIT_NORMAL, 1.0 / sqrt((double)E));
    for (int j = 0; g->blocks > 0 && j < G3_PATTERN; j++) define_layer(m, g, false, j);
    for (int j = 0; j < g->remainder; j++) define_layer(m, g, true, j);
    model_dense_define_head(m);
    return SIM_OK;
}

static sim_status gemma3_pipeline_check(model_def *m, const cfg_config *cfg)
{
    (void)m;
    return model_cfg_unsupported(cfg, "ici_pipeline_parallelism",
                                 "the gemma3 block's pipelined stack (blocks of six layers) is not simulated; use "
                                 "ici_pipeline_parallelism=1 and dcn_pipeline_parallelism=1");
}

static sim_status gemma3_loss(model_dev *md, mesh_tape *t, const model_batch *b, mesh_var **loss)
{
    const model_def *m = md->def;
    const g3_dims *g = m->d.family_dims;
    model_decoder_block dec = {.layer = g3_block,
                               .embed = model_param_index(m, "token_embedder.embedding"),
                               .norm = model_param_index(m, "decoder_norm.scale"),
                               .logits = model_param_index(m, "logits_dense.kernel"),
                               .units = (int)(g->blocks + (g->remainder > 0)),
                               .scanned_units = (int)g->blocks};
    return model_decoder_loss(md, t, b, &dec, loss);
}

/* MaxText's decoder_block gemma3 (gemma3-4b, -12b, -27b): blocks of six layers as remat units, no
 * pipeline, nothing updated outside the optimizer; `shardsim plan` shortens it with the default
 * base_num_decoder_layers word (the blocks and the remainder follow from it). */
const model_family model_family_gemma3 = {
    .name = "gemma3",
    .define = gemma3_define,
    .setup = model_dense_setup, /* use_batch_split_schedule refused */
    .loss = gemma3_loss,
    .pipeline_check = gemma3_pipeline_check,
};
