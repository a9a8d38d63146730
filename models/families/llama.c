/* llama.c — the Llama2 decoder (MaxText's llama2 decoder_block) on the tape.
 *
 * Every activation is constrained where MaxText constrains it, with the same
 * logical names (reference/maxtext-facts.md §5.1-5.3, 5.5, 5.8); in explicit
 * mode the projections get MaxText's out_shardings.  With remat (every
 * remat_policy but none) each decoder layer is one tape entry: forward runs the layer on a scratch
 * tape that records nothing and keeps only the output; the entry's VJP runs
 * the layer again on a recording tape (its FSDP all-gathers included) and
 * back-propagates through it, so only layer inputs (and the tensors the
 * policy saves, tagged where MaxText calls checkpoint_name) stay alive
 * between the passes, as on real hardware. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "blas_kernels/bk_rope.h"
#include "mesh/ad.h"
#include "mesh/nn.h"
#include "mesh/ops.h"
#include "models/blocks/attention.h"
#include "models/blocks/decoder.h"
#include "models/blocks/mlp.h"
#include "models/core/model.h"

/* Logical names of the residual stream (layer "A" of facts §5.2) and friends. */
static const char *const A[3] = {"activation_batch", "activation_norm_length", "activation_embed"};
static const char *const MLP_MID[3] = {"activation_batch", "activation_length", "activation_mlp"};

typedef struct {
    int q, k, v, qkv, o, ln1, ln2, wi0, wi1, wi, wo, embed, norm, logits;
} llama_ix;

static llama_ix indices(const model_def *m)
{
    llama_ix x;
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

/* A parameter of layer l as a tape leaf (its gradient sinks into p->g[l] when recording). */
static mesh_var *param(model_dev *md, mesh_tape *t, int i, int l) { return model_param_leaf(md, t, i, l); }

/* The RoPE of MaxText's Attention for this model: default, or Llama 3.1's (LLaMARotaryEmbedding). */
static bk_rope_params rope_params(const model_dims *d)
{
    bk_rope_params rp =
        d->rope_llama31 ? bk_rope_params_llama31((int)d->head_dim) : bk_rope_params_default((int)d->head_dim);
    rp.min_timescale = d->rope_min;
    rp.max_timescale = d->rope_theta;
    if (d->rope_llama31) rp.use_scale = d->rope_use_scale;
    else rp.linear_scaling_factor = d->rope_linear; /* LLaMARotaryEmbedding does not read it */
    return rp;
}

/* One decoder layer: facts §5.2 (layer), §5.3 (attention), §5.5 (MLP). */
static sim_status llama_layer(model_dev *md, mesh_tape *t, const model_batch *b, int l, mesh_var *x, mesh_var **y)
{
    const model_def *m = md->def;
    const model_dims *d = &m->d;
    llama_ix ix = indices(m);
    char layer[64], attn_layer[96], mlp_layer[96];
    const char *saved_layer = md->ctx.layer;
    snprintf(layer, sizeof layer, "decoder/layers_%d", l);
    snprintf(attn_layer, sizeof attn_layer, "%s/self_attention", layer);
    snprintf(mlp_layer, sizeof mlp_layer, "%s/mlp", layer);
    md->ctx.layer = layer;

    mesh_var *h, *lnx, *a;
    SIM_TRY(model_shard_as(md, t, x, "llama2/inputs", 3, A, &h));
    SIM_TRY(mesh_nn_rmsnorm(t, h, param(md, t, ix.ln1, l), d->eps, "pre_self_attention_layer_norm", &lnx));
    SIM_TRY(model_shard_as(md, t, lnx, "llama2/lnx", 3, A, &lnx));

    /* attention: no query/key norm (the llama2 layer does not pass use_qk_norm), and MaxText folds
     * 1/sqrt(head_dim) into the query init, so the score scale is 1 */
    md->ctx.layer = attn_layer;
    model_attention_block ab = {.query = ix.q,
                                .key = ix.k,
                                .value = ix.v,
                                .qkv = d->fused_qkv ? ix.qkv : -1,
                                .out = ix.o,
                                .query_norm = -1,
                                .key_norm = -1,
                                .layer = l,
                                .rope = rope_params(d),
                                .scale = 1.0,
                                .soft_cap = d->attn_soft_cap,
                                .out_names = A};
    SIM_TRY(model_attention(md, t, b, &ab, lnx, &a));
    md->ctx.layer = layer;
    SIM_TRY(model_shard_as(md, t, a, "llama2/attention_lnx", 3, A, &a));
    SIM_TRY(mesh_ad_add(t, h, a, "residual_attention", &h));

    /* MLP */
    mesh_var *ln2, *mlp;
    SIM_TRY(mesh_nn_rmsnorm(t, h, param(md, t, ix.ln2, l), d->eps, "post_self_attention_layer_norm", &ln2));
    SIM_TRY(model_shard_as(md, t, ln2, "llama2/hidden_states", 3, A, &ln2));
    md->ctx.layer = mlp_layer;
    model_mlp_block mb = {.wi_0 = ix.wi0,
                          .wi_1 = ix.wi1,
                          .wi = d->fused_mlp ? ix.wi : -1,
                          .wo = ix.wo,
                          .layer = l,
                          .intermediate = MLP_MID,
                          .out = A};
    SIM_TRY(model_mlp(md, t, &mb, ln2, &mlp));
    md->ctx.layer = layer;
    /* the layer's tail: nothing reads it when remat recomputes the layer (model_mlp) */
    md->ctx.dead_outputs = md->recomputing;
    sim_status st = model_shard_as(md, t, mlp, "llama2/mlp_lnx", 3, A, &mlp);
    if (st == SIM_OK) st = mesh_ad_add(t, h, mlp, "residual_mlp", &h);
    if (st == SIM_OK) st = model_dropout(md, t, h, layer, &h);
    if (st == SIM_OK) st = model_shard_as(md, t, h, "llama2/layer_output", 3, A, y);
    md->ctx.dead_outputs = false;
    md->ctx.layer = saved_layer;
    return st;
}

/* The layer as model_remat_layer wants it (Llama layers have no second output). */
static sim_status llama_layer_fn(model_dev *md, mesh_tape *t, const model_batch *b, int l, mesh_var *x, mesh_var **y,
                                 mesh_var **aux)
{
    *aux = NULL;
    return llama_layer(md, t, b, l, x, y);
}

/* ------------------------------------------------------------ definition */

static void define_params(model_def *m)
{
    const model_dims *d = &m->d;
    int64_t V = d->vocab, E = d->emb, H = d->q_heads, K = d->kv_heads, D = d->head_dim, F = d->mlp, L = d->layers;
    double fe = 1.0 / sqrt((double)E);
    /* MaxText's Attention.init_query_w drops the depth scaling whenever the config's use_qk_norm is
     * set, although the llama2 decoder never passes use_qk_norm to its Attention (no query/key norm
     * runs): the only effect of the key on Llama is an unscaled query init. */
    double qs = d->qk_norm_key ? 1.0 : 1.0 / sqrt((double)D);
    model_add_param(m, "params.token_embedder.embedding", 2, (int64_t[]){V, E},
                    (const char *[]){"vocab", "embed_vocab"}, -1, MODEL_INIT_NORMAL, fe);
    model_add_param(m, "params.decoder.layers.pre_self_attention_layer_norm.scale", 2, (int64_t[]){E, L},
                    (const char *[]){"norm", "layers"}, 1, MODEL_INIT_ONES, 0);
    if (d->fused_qkv) /* Attention.init_qkv_w: the plain kernel_init, no depth scaling of the query part */
        model_add_param(m, "params.decoder.layers.self_attention.qkv_proj.kernel", 4, (int64_t[]){E, L, H + 2 * K, D},
                        (const char *[]){"embed_attn", "layers", "heads", "kv"}, 1, MODEL_INIT_NORMAL, fe);
    else {
        /* MaxText divides the query init by sqrt(head_dim) instead of scaling the scores */
        model_add_param(m, "params.decoder.layers.self_attention.query.kernel", 4, (int64_t[]){E, L, H, D},
                        (const char *[]){"embed_attn", "layers", "q_heads", "kv"}, 1, MODEL_INIT_NORMAL, fe * qs);
        model_add_param(m, "params.decoder.layers.self_attention.key.kernel", 4, (int64_t[]){E, L, K, D},
                        (const char *[]){"embed_attn", "layers", "kv_heads", "kv_head_dim"}, 1, MODEL_INIT_NORMAL, fe);
        model_add_param(m, "params.decoder.layers.self_attention.value.kernel", 4, (int64_t[]){E, L, K, D},
                        (const char *[]){"embed_attn", "layers", "kv_heads", "kv_head_dim"}, 1, MODEL_INIT_NORMAL, fe);
    }
    model_add_param(m, "params.decoder.layers.self_attention.out.kernel", 4, (int64_t[]){H, L, D, E},
                    (const char *[]){"heads", "layers", "kv", "embed_attn"}, 1, MODEL_INIT_NORMAL,
                    1.0 / sqrt((double)(H * D)));
    model_add_param(m, "params.decoder.layers.post_self_attention_layer_norm.scale", 2, (int64_t[]){E, L},
                    (const char *[]){"norm", "layers"}, 1, MODEL_INIT_ONES, 0);
    if (d->fused_mlp) /* MlpBlock with fused_mlp: one kernel for both activations */
        model_add_param(m, "params.decoder.layers.mlp.wi.kernel", 4, (int64_t[]){E, L, 2, F},
                        (const char *[]){"embed", "layers", "num_activations", "mlp"}, 1, MODEL_INIT_TRUNC_NORMAL, fe);
    else {
        model_add_param(m, "params.decoder.layers.mlp.wi_0.kernel", 3, (int64_t[]){E, L, F},
                        (const char *[]){"embed", "layers", "mlp"}, 1, MODEL_INIT_TRUNC_NORMAL, fe);
        model_add_param(m, "params.decoder.layers.mlp.wi_1.kernel", 3, (int64_t[]){E, L, F},
                        (const char *[]){"embed", "layers", "mlp"}, 1, MODEL_INIT_TRUNC_NORMAL, fe);
    }
    model_add_param(m, "params.decoder.layers.mlp.wo.kernel", 3, (int64_t[]){F, L, E},
                    (const char *[]){"mlp", "layers", "embed"}, 1, MODEL_INIT_TRUNC_NORMAL, 1.0 / sqrt((double)F));
    model_add_param(m, "params.decoder.decoder_norm.scale", 1, (int64_t[]){E}, (const char *[]){"norm"}, -1,
                    MODEL_INIT_ONES, 0);
    if (!d->tied_logits)
        model_add_param(m, "params.decoder.logits_dense.kernel", 2, (int64_t[]){E, V},
                        (const char *[]){"embed_vocab", "vocab"}, -1, MODEL_INIT_TRUNC_NORMAL, fe);
}

/* MaxText's llama2 decoder would honour these; the simulated one has global attention and default
 * (or Llama 3.1's) RoPE only, so other values are refused. */
static sim_status llama_define(model_def *m, const cfg_config *cfg)
{
    const model_dims *d = &m->d;
    const char *rt;
    SIM_TRY(model_attention_global_only(cfg, "llama2", "models/llama2.py LlamaDecoderLayer"));
    SIM_TRY(cfg_get_str(cfg, "rope_type", &rt));
    if (rt && strcmp(rt, "default") && !d->rope_llama31)
        return sim_err(SIM_ERR_INPUT,
                       "rope_type=%s with decoder_block=llama2 is not simulated; use rope_type=default or "
                       "rope_type=llama3.1",
                       rt);
    int64_t mtp;
    SIM_TRY(model_cfg_i64(cfg, "mtp_num_layers", &mtp));
    if (mtp != 0)
        return sim_err(SIM_ERR_INPUT,
                       "mtp_num_layers=%lld with decoder_block=llama2 is not simulated (multi-token "
                       "prediction runs with decoder_block=deepseek); use mtp_num_layers=0",
                       (long long)mtp);
    define_params(m);
    return SIM_OK;
}

/* Once the specs are known: MaxText runs the batch-split schedule for DeepSeek only. */
static sim_status llama_setup(model_def *m, const cfg_config *cfg)
{
    bool on;
    SIM_TRY(model_cfg_bool(cfg, "use_batch_split_schedule", &on));
    if (on)
        return sim_err(SIM_ERR_INPUT, "decoder_block with use_batch_split_schedule=true: MaxText runs the batch-split "
                                      "schedule for decoder_block=deepseek only; drop use_batch_split_schedule or use "
                                      "a DeepSeek model");
    return SIM_OK;
}

/* ------------------------------------------------------------ the whole model */

static sim_status llama_loss(model_dev *md, mesh_tape *t, const model_batch *b, mesh_var **loss)
{
    llama_ix ix = indices(md->def);
    model_decoder_block dec = {.layer = llama_layer_fn, .embed = ix.embed, .norm = ix.norm, .logits = ix.logits};
    return model_decoder_loss(md, t, b, &dec, loss);
}

/* MaxText's decoder_block llama2 (Llama 2, 3, 3.1, 3.3 model files): every layer scanned and
 * pipelined alike, nothing updated outside the optimizer. */
const model_family model_family_llama2 = {
    .name = "llama2",
    .define = llama_define,
    .setup = llama_setup,
    .loss = llama_loss,
};
