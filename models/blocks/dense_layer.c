/* dense_layer.c — the pre-norm decoder layer of Llama, Mistral, Qwen3, and with the routed experts
 * as its feed-forward half Mixtral and Qwen3 MoE, on the tape (see dense_layer.h).
 *
 * Every activation is constrained where MaxText constrains it, with the same logical names
 * (reference/maxtext-facts.md §5.1-5.3, 5.5, 5.8); in explicit mode the projections get MaxText's
 * out_shardings.  With remat (every remat_policy but none) the layer is one tape entry
 * (model_remat_layer): only its input and the tensors the policy saves stay alive between the
 * passes, as on real hardware. */
#include "models/blocks/dense_layer.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "mesh/ad.h"
#include "mesh/nn.h"
#include "models/blocks/attention.h"
#include "models/blocks/decoder.h"
#include "models/blocks/mlp.h"

/* The residual stream's logical names (layer "A" of facts §5.2; AttentionWithNorm.activation_axis_names). */
static const char *const A[3] = {"activation_batch", "activation_norm_length", "activation_embed"};

model_dense_ix model_dense_indices(const model_def *m)
{
    model_dense_ix x;
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

bk_rope_params model_dense_rope(const model_dims *d)
{
    bk_rope_params rp =
        d->rope_llama31 ? bk_rope_params_llama31((int)d->head_dim) : bk_rope_params_default((int)d->head_dim);
    rp.min_timescale = d->rope_min;
    rp.max_timescale = d->rope_theta;
    if (d->rope_llama31) rp.use_scale = d->rope_use_scale;
    else rp.linear_scaling_factor = d->rope_linear; /* LLaMARotaryEmbedding does not read it */
    return rp;
}

/* A constraint of the residual stream, "<prefix>/<what>".  With residual_explicit_only (Qwen3's
 * AttentionWithNorm._maybe_shard_with_logical) MaxText constrains in explicit mode only; in auto
 * mode XLA's sharding propagation still gives the unconstrained residual the sharding of its
 * constrained neighbours (MaxText's compiled step for a small qwen3 on fsdp=4 tensor=2 sends the
 * bytes of a Llama of the same shape, whose layer constrains it: peers/maxtext/hlo_bytes.sh,
 * 163.458 and 163.482 MiB; tests/data/maxtext-0.2.5/hlo_bytes).  shardsim's auto placement is
 * local, so the residual is placed as propagation leaves it: the same names, unlogged. */
static sim_status residual(model_dev *md, mesh_tape *t, const model_dense_layer *c, mesh_var *x, const char *what,
                           mesh_var **y)
{
    char name[96];
    snprintf(name, sizeof name, "%s/%s", c->prefix, what);
    if (!c->residual_explicit_only || md->ctx.mode == MESH_MODE_EXPLICIT)
        return model_shard_as(md, t, x, name, 3, A, y);
    mesh_spec s;
    SIM_TRY(model_logical_spec(md->def, name, 3, A, &s));
    return mesh_ad_shard_as(t, x, &s, name, y);
}

/* The dense MlpBlock as the layer's feed-forward half (facts §5.5). */
static sim_status dense_mlp(model_dev *md, mesh_tape *t, const model_dense_layer *c, const model_dense_ix *ix, int l,
                            mesh_var *hs, mesh_var **y)
{
    model_mlp_block mb = {.wi_0 = ix->wi0,
                          .wi_1 = ix->wi1,
                          .wi = md->def->d.fused_mlp ? ix->wi : -1,
                          .wo = ix->wo,
                          .layer = l,
                          .intermediate = c->mlp_mid,
                          .out = A};
    return model_mlp(md, t, &mb, hs, y);
}

/* One layer: facts §5.2 (layer), §5.3 (attention), §5.5 (MLP). */
sim_status model_dense_layer_run(model_dev *md, mesh_tape *t, const model_batch *b, const model_dense_layer *c, int l,
                                 mesh_var *x, mesh_var **y, mesh_var **aux)
{
    const model_def *m = md->def;
    const model_dims *d = &m->d;
    model_dense_ix ix = model_dense_indices(m);
    char layer[64], attn_layer[96], ffn_layer[96];
    const char *saved_layer = md->ctx.layer;
    snprintf(layer, sizeof layer, "decoder/layers_%d", l);
    snprintf(attn_layer, sizeof attn_layer, "%s/self_attention", layer);
    snprintf(ffn_layer, sizeof ffn_layer, "%s/%s", layer, c->ffn_scope ? c->ffn_scope : "mlp");
    md->ctx.layer = layer;
    *aux = NULL;

    sim_status st;
    mesh_var *h, *lnx, *a, *hs, *mlp;
    SIM_TRY_GOTO(residual(md, t, c, x, "inputs", &h), st, fail);
    SIM_TRY_GOTO(
        mesh_nn_rmsnorm(t, h, model_param_leaf(md, t, ix.ln1, l), d->eps, "pre_self_attention_layer_norm", &lnx), st,
        fail);
    SIM_TRY_GOTO(residual(md, t, c, lnx, "lnx", &lnx), st, fail);

    md->ctx.layer = attn_layer;
    model_attention_block ab = {.query = ix.q,
                                .key = ix.k,
                                .value = ix.v,
                                .qkv = d->fused_qkv ? ix.qkv : -1,
                                .out = ix.o,
                                .query_norm = ix.qn,
                                .key_norm = ix.kn,
                                .norm_eps = d->eps,
                                .layer = l,
                                .rope = c->rope,
                                .scale = c->scale,
                                .soft_cap = c->soft_cap,
                                .out_names = A};
    SIM_TRY_GOTO(model_attention(md, t, b, &ab, lnx, &a), st, fail);
    md->ctx.layer = layer;
    SIM_TRY_GOTO(residual(md, t, c, a, "attention_lnx", &a), st, fail);
    SIM_TRY_GOTO(mesh_ad_add(t, h, a, "residual_attention", &h), st, fail); /* intermediate_inputs */
    SIM_TRY_GOTO(
        mesh_nn_rmsnorm(t, h, model_param_leaf(md, t, ix.ln2, l), d->eps, "post_self_attention_layer_norm", &hs), st,
        fail);
    SIM_TRY_GOTO(residual(md, t, c, hs, "hidden_states", &hs), st, fail);
    md->ctx.layer = ffn_layer;
    if (c->ffn) SIM_TRY_GOTO(c->ffn(md, t, c->ffn_arg, l, hs, ffn_layer, &mlp, aux), st, fail);
    else SIM_TRY_GOTO(dense_mlp(md, t, c, &ix, l, hs, &mlp), st, fail);
    md->ctx.layer = layer;
    /* the layer's tail: nothing reads it when remat recomputes the layer (model_mlp, model_moe_routed) */
    md->ctx.dead_outputs = md->recomputing;
    SIM_TRY_GOTO(residual(md, t, c, mlp, "mlp_lnx", &mlp), st, fail);
    if (c->ffn_output_first) SIM_TRY_GOTO(mesh_ad_add(t, mlp, h, "residual_mlp", &h), st, fail);
    else SIM_TRY_GOTO(mesh_ad_add(t, h, mlp, "residual_mlp", &h), st, fail);
    if (c->output_dropout) SIM_TRY_GOTO(model_dropout(md, t, h, layer, &h), st, fail);
    SIM_TRY_GOTO(residual(md, t, c, h, "layer_output", y), st, fail);
fail: /* the context as the caller left it, on every path */
    md->ctx.dead_outputs = false;
    md->ctx.layer = saved_layer;
    return st;
}

#define LAYER_PARAM(path, rank, shape, logical, init, scale)                                                           \
    model_add_param(m, "params.decoder.layers." path, rank, shape, logical, 1, init, scale)

void model_dense_define_attention(model_def *m, double query_init_scale, bool qk_norm)
{
    const model_dims *d = &m->d;
    int64_t V = d->vocab, E = d->emb, H = d->q_heads, K = d->kv_heads, D = d->head_dim, L = d->layers;
    double fe = 1.0 / sqrt((double)E);
    model_add_param(m, "params.token_embedder.embedding", 2, (int64_t[]){V, E},
                    (const char *[]){"vocab", "embed_vocab"}, -1, MODEL_INIT_NORMAL, fe);
    LAYER_PARAM("pre_self_attention_layer_norm.scale", 2, ((int64_t[]){E, L}), ((const char *[]){"norm", "layers"}),
                MODEL_INIT_ONES, 0);
    if (d->fused_qkv) /* Attention.init_qkv_w: the plain kernel_init, no depth scaling of the query part */
        LAYER_PARAM("self_attention.qkv_proj.kernel", 4, ((int64_t[]){E, L, H + 2 * K, D}),
                    ((const char *[]){"embed_attn", "layers", "heads", "kv"}), MODEL_INIT_NORMAL, fe);
    else {
        LAYER_PARAM("self_attention.query.kernel", 4, ((int64_t[]){E, L, H, D}),
                    ((const char *[]){"embed_attn", "layers", "q_heads", "kv"}), MODEL_INIT_NORMAL,
                    fe * query_init_scale);
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
}

void model_dense_define_head(model_def *m)
{
    const model_dims *d = &m->d;
    model_add_param(m, "params.decoder.decoder_norm.scale", 1, (int64_t[]){d->emb}, (const char *[]){"norm"}, -1,
                    MODEL_INIT_ONES, 0);
    if (!d->tied_logits)
        model_add_param(m, "params.decoder.logits_dense.kernel", 2, (int64_t[]){d->emb, d->vocab},
                        (const char *[]){"embed_vocab", "vocab"}, -1, MODEL_INIT_TRUNC_NORMAL,
                        1.0 / sqrt((double)d->emb));
}

void model_dense_define(model_def *m, double query_init_scale, bool qk_norm)
{
    const model_dims *d = &m->d;
    int64_t E = d->emb, F = d->mlp, L = d->layers;
    double fe = 1.0 / sqrt((double)E);
    model_dense_define_attention(m, query_init_scale, qk_norm);
    if (d->fused_mlp) /* MlpBlock with fused_mlp: one kernel for both activations */
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
    model_dense_define_head(m);
}

sim_status model_dense_refuse(const cfg_config *cfg, const model_dims *d, const model_dense_refusals *r)
{
    char why[320];
    SIM_TRY(model_attention_global_only(cfg, r->block, r->layer));
    const char *rt;
    SIM_TRY(cfg_get_str(cfg, "rope_type", &rt));
    if ((rt && strcmp(rt, "default")) || d->rope_llama31) {
        snprintf(why, sizeof why,
                 "decoder_block=%s is simulated with the default RoPE (rope_max_timescale); use rope_type=default",
                 r->block);
        return model_cfg_unsupported(cfg, "rope_type", why);
    }
    if (r->no_soft_cap && d->attn_soft_cap != 0) {
        snprintf(why, sizeof why,
                 "MaxText 0.2.5's %s layer (models/%s.py) does not pass attn_logits_soft_cap to its Attention, so no "
                 "cap applies; use attn_logits_soft_cap=0 (decoder_block=llama2 passes it)",
                 r->block, r->block);
        return model_cfg_unsupported(cfg, "attn_logits_soft_cap", why);
    }
    if (r->no_mrope) {
        bool mrope;
        SIM_TRY(model_cfg_bool(cfg, "use_mrope", &mrope));
        if (mrope)
            return model_cfg_unsupported(cfg, "use_mrope",
                                         "Qwen3's multimodal RoPE (mrope_section) is not simulated; use use_mrope=false");
    }
    int64_t mtp;
    SIM_TRY(model_cfg_i64(cfg, "mtp_num_layers", &mtp));
    if (mtp != 0)
        return model_cfg_unsupported(
            cfg, "mtp_num_layers",
            "multi-token prediction runs with decoder_block=deepseek only; use mtp_num_layers=0");
    if (r->experts && d->fused_mlp) {
        snprintf(why, sizeof why,
                 "the %s layer has no dense MLP to fuse (its experts keep wi_0 and wi_1); use fused_mlp=false",
                 r->block);
        return model_cfg_unsupported(cfg, "fused_mlp", why);
    }
    return SIM_OK;
}

sim_status model_dense_setup(model_def *m, const cfg_config *cfg)
{
    (void)m;
    bool on;
    SIM_TRY(model_cfg_bool(cfg, "use_batch_split_schedule", &on));
    if (on)
        return model_cfg_unsupported(cfg, "use_batch_split_schedule",
                                     "MaxText runs the batch-split schedule for decoder_block=deepseek only; drop it");
    return SIM_OK;
}

sim_status model_dense_loss(model_dev *md, mesh_tape *t, const model_batch *b, model_layer_fn layer, mesh_var **loss)
{
    model_dense_ix ix = model_dense_indices(md->def);
    model_decoder_block dec = {.layer = layer, .embed = ix.embed, .norm = ix.norm, .logits = ix.logits};
    return model_decoder_loss(md, t, b, &dec, loss);
}
