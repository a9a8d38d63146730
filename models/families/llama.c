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
#include "config/release.h"
#include "mesh/ad.h"
#include "mesh/nn.h"
#include "mesh/ops.h"
#include "models/core/model.h"

/* Logical names of the residual stream (layer "A" of facts §5.2) and friends. */
static const char *const A[3] = {"activation_batch", "activation_norm_length", "activation_embed"};
static const char *const ATTN_IN[3] = {"activation_batch_attn", "activation_input_length_attn", "activation_embed_attn"};
static const char *const KV4[4] = {"activation_kv_batch", "activation_length_attn", "activation_kv_heads",
                                   "activation_kv_head_dim"};
static const char *const ATTN_OUT[4] = {"activation_batch_attn", "activation_length_attn", "activation_heads",
                                        "activation_kv"};
static const char *const MLP_MID[3] = {"activation_batch", "activation_length", "activation_mlp"};
/* fused_mlp: the activations must not shard the num_activations dim */
static const char *const MLP_FUSED[4] = {"activation_batch", "activation_length", NULL, "activation_mlp"};
static const char *const EMB_OUT[3] = {"activation_embed_and_logits_batch", "activation_length", "activation_embed"};
static const char *const FINAL[3] = {"activation_batch", "activation_length", "activation_embed"};

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
static mesh_var *param(model_dev *md, mesh_tape *t, int i, int l)
{
    model_param *p = &md->p[i];
    bool grad = mesh_tape_recording(t) && p->g;
    return mesh_tape_param(t, &p->w[l], grad ? &p->g[l] : NULL);
}


/* fused_qkv (Attention.qkv_projection): one product with the [embed, heads + 2 kv_heads, kv]
 * kernel (no out_sharding), tagged qkv_proj, then a shard_map whose in_specs are the query's
 * logical sharding splits each device's block of heads into its query, key and value heads
 * (local counts in the global ratio).  So with k shards on the heads dim, query head t*H/k + i
 * comes from fused head t*(H+2K)/k + i: the split depends on the mesh, as in MaxText.  Auto mode
 * reshards to the in_specs; explicit mode requires the product to have them already (JAX's
 * shard_map raises otherwise). */
static sim_status fused_qkv(model_dev *md, mesh_tape *t, mesh_var *xq, mesh_var *w, mesh_var **q, mesh_var **k,
                            mesh_var **v)
{
    const model_dims *d = &md->def->d;
    mesh_var *qkv, *parts[2];
    SIM_TRY(mesh_ad_einsum(t, "bte,ehd->bthd", xq, w, NULL, "qkv_proj", &qkv));
    SIM_TRY(model_checkpoint_name(md, qkv, MODEL_CKPT_QKV_PROJ));
    mesh_spec in;
    SIM_TRY(model_logical_spec(md->def, "attention/split_qkv", 4, KV4, &in));
    if (md->ctx.mode == MESH_MODE_EXPLICIT && !mesh_spec_equal(&qkv->val.spec, &in)) {
        char want[256], have[256];
        mesh_spec_format(&in, md->ctx.mesh, want, sizeof want);
        mesh_spec_format(&qkv->val.spec, md->ctx.mesh, have, sizeof have);
        return sim_err(SIM_ERR_INPUT,
                       "fused_qkv=true with shard_mode=explicit: the qkv_proj product has sharding %s but split_qkv's "
                       "shard_map wants in_specs %s (the query's logical axes), and JAX raises \"in_specs passed to "
                       "shard_map ... does not match the specs of the input\" as MaxText 0.2.5 runs it; use "
                       "shard_mode=auto, fused_qkv=false, or a mesh where the two agree",
                       have, want);
    }
    if (md->ctx.mode != MESH_MODE_EXPLICIT) SIM_TRY(mesh_ad_shard_as(t, qkv, &in, "attention/split_qkv", &qkv));
    SIM_TRY(mesh_nn_split_local(t, qkv, 2, 2, (int64_t[]){d->q_heads, 2 * d->kv_heads}, "split_qkv", parts));
    *q = parts[0];
    SIM_TRY(mesh_nn_split_local(t, parts[1], 2, 2, (int64_t[]){d->kv_heads, d->kv_heads}, "split_qkv", parts));
    *k = parts[0];
    *v = parts[1];
    return SIM_OK;
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

    /* attention */
    md->ctx.layer = attn_layer;
    mesh_var *xq, *q, *k, *v, *o;
    SIM_TRY(model_shard_as(md, t, lnx, "attention/inputs_q", 3, ATTN_IN, &xq));
    /* a policy that saves the three projections (minimal, save_dot_*) replaces their recomputation and
     * RoPE with the saved copies: read by nothing, left out as XLA leaves them out (model_recomputed_dead) */
    md->ctx.dead_outputs = model_recomputed_dead(md, MODEL_CKPT_QUERY_PROJ) &&
                           model_recomputed_dead(md, MODEL_CKPT_KEY_PROJ) &&
                           model_recomputed_dead(md, MODEL_CKPT_VALUE_PROJ);
    if (d->fused_qkv)
        SIM_TRY(fused_qkv(md, t, xq, param(md, t, ix.qkv, l), &q, &k, &v));
    else {
        SIM_TRY(model_dense(md, t, "bte,ehd->bthd", xq, param(md, t, ix.q, l), "query", 4, KV4, &q));
        SIM_TRY(model_dense(md, t, "bte,ehd->bthd", xq, param(md, t, ix.k, l), "key", 4, KV4, &k));
        SIM_TRY(model_dense(md, t, "bte,ehd->bthd", xq, param(md, t, ix.v, l), "value", 4, KV4, &v));
    }
    bk_rope_params rp = d->rope_llama31 ? bk_rope_params_llama31((int)d->head_dim) : bk_rope_params_default((int)d->head_dim);
    rp.min_timescale = d->rope_min;
    rp.max_timescale = d->rope_theta;
    if (d->rope_llama31) rp.use_scale = d->rope_use_scale;
    else rp.linear_scaling_factor = d->rope_linear; /* LLaMARotaryEmbedding does not read it */
    SIM_TRY(mesh_nn_rope(t, q, &b->positions, &rp, "query_rope", &q));
    SIM_TRY(mesh_nn_rope(t, k, &b->positions, &rp, "key_rope", &k));
    SIM_TRY(model_shard_as(md, t, q, "attention/query", 4, KV4, &q));
    SIM_TRY(model_shard_as(md, t, k, "attention/key", 4, KV4, &k));
    SIM_TRY(model_shard_as(md, t, v, "attention/value", 4, KV4, &v));
    md->ctx.dead_outputs = false;
    /* the tensors remat policies save (MaxText's checkpoint_name tags, attentions.py) */
    SIM_TRY(model_checkpoint_name(md, q, MODEL_CKPT_QUERY_PROJ));
    SIM_TRY(model_checkpoint_name(md, k, MODEL_CKPT_KEY_PROJ));
    SIM_TRY(model_checkpoint_name(md, v, MODEL_CKPT_VALUE_PROJ));
    /* MaxText folds 1/sqrt(head_dim) into the query init: the score scale is 1 */
    SIM_TRY(mesh_nn_attention_kernel(t, q, k, v, &b->positions, 1.0, d->attn_soft_cap, d->attn_dot, &d->splash, "attention_op",
                                      &o));
    SIM_TRY(model_checkpoint_name(md, o, MODEL_CKPT_ATTENTION_OUT));
    SIM_TRY(model_shard_as(md, t, o, "attention/out", 4, ATTN_OUT, &o));
    SIM_TRY(model_dense_saved(md, t, MODEL_CKPT_OUT_PROJ, "bthd,hde->bte", o, param(md, t, ix.o, l), "out", 3, A, &a));
    md->ctx.layer = layer;
    SIM_TRY(model_shard_as(md, t, a, "llama2/attention_lnx", 3, A, &a));
    SIM_TRY(mesh_ad_add(t, h, a, "residual_attention", &h));

    /* MLP */
    mesh_var *ln2, *g, *u, *act, *mlp;
    SIM_TRY(mesh_nn_rmsnorm(t, h, param(md, t, ix.ln2, l), d->eps, "post_self_attention_layer_norm", &ln2));
    SIM_TRY(model_shard_as(md, t, ln2, "llama2/hidden_states", 3, A, &ln2));
    md->ctx.layer = mlp_layer;
    if (d->fused_mlp) { /* linears.MlpBlock, fused: one product, then x[:, :, 0] and x[:, :, 1] */
        mesh_var *wi;
        SIM_TRY(model_dense(md, t, "bte,eaf->btaf", ln2, param(md, t, ix.wi, l), "wi", 4, MLP_FUSED, &wi));
        SIM_TRY(model_shard_as(md, t, wi, "linears/fused_x", 4, MLP_FUSED, &wi));
        SIM_TRY(model_checkpoint_name(md, wi, MODEL_CKPT_MLPWI));
        SIM_TRY(mesh_nn_unstack2(t, wi, 2, "wi_split", &g, &u));
    } else {
        SIM_TRY(model_dense_saved(md, t, MODEL_CKPT_MLPWI_0, "bte,ef->btf", ln2, param(md, t, ix.wi0, l), "wi_0", 3,
                            MLP_MID, &g));
        SIM_TRY(model_dense_saved(md, t, MODEL_CKPT_MLPWI_1, "bte,ef->btf", ln2, param(md, t, ix.wi1, l), "wi_1", 3,
                            MLP_MID, &u));
    }
    SIM_TRY(mesh_nn_swiglu(t, g, u, "swiglu", &act));
    SIM_TRY(model_dropout(md, t, act, mlp_layer, &act)); /* MlpBlock's intermediate dropout */
    SIM_TRY(model_shard_as(md, t, act, "linears/x", 3, MLP_MID, &act));
    /* from here on the layer makes its output, which nothing reads when remat recomputes the layer for
     * its backward: XLA drops these ops from the recomputation (mesh_ctx.dead_outputs), wo's product
     * included, so wo is gathered in the backward for the input gradient alone (and a policy that saves
     * wo's output replaces the product with the saved copy: dead either way) */
    md->ctx.dead_outputs = md->recomputing;
    sim_status st = model_dense(md, t, "btf,fe->bte", act, param(md, t, ix.wo, l), "wo", 3, A, &mlp);
    md->ctx.dead_outputs = false;
    if (st == SIM_OK) st = model_checkpoint_name(md, mlp, MODEL_CKPT_MLPWO);
    if (st != SIM_OK) return st;
    md->ctx.layer = layer;
    md->ctx.dead_outputs = md->recomputing;
    st = model_shard_as(md, t, mlp, "llama2/mlp_lnx", 3, A, &mlp);
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
    model_add_param(m, "params.token_embedder.embedding", 2, (int64_t[]){V, E}, (const char *[]){"vocab", "embed_vocab"},
                    -1, MODEL_INIT_NORMAL, fe);
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
                    (const char *[]){"heads", "layers", "kv", "embed_attn"}, 1, MODEL_INIT_NORMAL, 1.0 / sqrt((double)(H * D)));
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
    model_add_param(m, "params.decoder.layers.mlp.wo.kernel", 3, (int64_t[]){F, L, E}, (const char *[]){"mlp", "layers", "embed"},
                    1, MODEL_INIT_TRUNC_NORMAL, 1.0 / sqrt((double)F));
    model_add_param(m, "params.decoder.decoder_norm.scale", 1, (int64_t[]){E}, (const char *[]){"norm"}, -1, MODEL_INIT_ONES, 0);
    if (!d->tied_logits)
        model_add_param(m, "params.decoder.logits_dense.kernel", 2, (int64_t[]){E, V}, (const char *[]){"embed_vocab", "vocab"},
                        -1, MODEL_INIT_TRUNC_NORMAL, fe);
}

/* MaxText's llama2 decoder would honour these; the simulated one has global attention and default
 * (or Llama 3.1's) RoPE only, so other values are refused. */
static sim_status llama_define(model_def *m, const mesh_cfg *cfg)
{
    const model_dims *d = &m->d;
    const char *at, *rt;
    SIM_TRY(mesh_cfg_get_str(cfg, "attention_type", &at));
    SIM_TRY(mesh_cfg_get_str(cfg, "rope_type", &rt));
    if (at && strcmp(at, "global"))
        return sim_err(SIM_ERR_INPUT, "attention_type=%s with decoder_block=llama2 is not simulated; use attention_type=global "
                                      "(mla needs decoder_block=deepseek)", at);
    if (rt && strcmp(rt, "default") && !d->rope_llama31)
        return sim_err(SIM_ERR_INPUT,
                       "rope_type=%s with decoder_block=llama2 is not simulated; use rope_type=default or "
                       "rope_type=llama3.1", rt);
    int64_t mtp;
    SIM_TRY(model_cfg_i64(cfg, "mtp_num_layers", &mtp));
    if (mtp != 0)
        return sim_err(SIM_ERR_INPUT, "mtp_num_layers=%lld with decoder_block=llama2 is not simulated (multi-token "
                                      "prediction runs with decoder_block=deepseek); use mtp_num_layers=0",
                       (long long)mtp);
    define_params(m);
    return SIM_OK;
}

/* Once the specs are known: MaxText runs the batch-split schedule for DeepSeek only. */
static sim_status llama_setup(model_def *m, const mesh_cfg *cfg)
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
    const model_def *m = md->def;
    llama_ix ix = indices(m);
    md->ctx.layer = "decoder";
    mesh_var *x, *logits, *tok_loss, *table = param(md, t, ix.embed, 0);
    SIM_TRY(mesh_nn_embed(t, table, &b->tokens, "token_embedder", &x));
    if (md->ctx.mode == MESH_MODE_EXPLICIT) /* Embed's out_sharding */
        SIM_TRY(model_shard_as(md, t, x, "embed/out", 3, EMB_OUT, &x));
    SIM_TRY(model_dropout(md, t, x, "decoder/embedding", &x)); /* no dropout with a pipeline (refused) */
    if (m->d.pipe.on) /* the stack runs as MaxText's pipeline (pipeline.c) */
        SIM_TRY(model_pipeline_run(md, t, b, x, llama_layer_fn, 0, &x));
    for (int l = 0; l < m->d.layers && !m->d.pipe.on; l++) {
        mesh_var *in = x;
        if (m->d.remat_full) {
            char tag[64];
            snprintf(tag, sizeof tag, "decoder/layers_%d/remat", l);
            SIM_TRY(model_remat_layer(md, t, b, l, x, llama_layer_fn, tag, &x, NULL));
        } else
            SIM_TRY(llama_layer(md, t, b, l, x, &x));
        /* MaxText scans the layers (scan_layers): the carry's type may not change across a layer */
        if (l == 0 && m->d.scan_layers)
            SIM_TRY(mesh_scan_carry_check(&md->ctx, &in->val, &x->val, "layers",
                                          mesh_release_error(md->ctx.release, "decoder_scan_carry",
                                                             "layers/nnx_decoders.py:_apply_layers_sequentially")));
    }
    md->ctx.layer = "decoder";
    SIM_TRY(mesh_nn_rmsnorm(t, x, param(md, t, ix.norm, 0), m->d.eps, "decoder_norm", &x));
    if (md->ctx.mode == MESH_MODE_EXPLICIT) SIM_TRY(model_shard_as(md, t, x, "decoder/norm_out", 3, FINAL, &x));
    SIM_TRY(model_dropout(md, t, x, "decoder/output_head", &x));
    SIM_TRY(model_logits(md, t, x, table, ix.logits >= 0 ? param(md, t, ix.logits, 0) : NULL, &logits));
    SIM_TRY(mesh_nn_xent(t, logits, &b->targets, m->d.z_loss, "cross_entropy", &tok_loss));
    /* MaxText 0.2.5 reshards the per-token loss (loss_constraint=assert: the assert of before PR #4208) */
    SIM_TRY(model_loss_constraint(md, t, tok_loss, true, &tok_loss));
    md->ctx.layer = "loss";
    return mesh_nn_mean(t, tok_loss, "mean", loss);
}

/* MaxText's decoder_block llama2 (Llama 2, 3, 3.1, 3.3 model files): every layer scanned and
 * pipelined alike, nothing updated outside the optimizer. */
const model_family model_family_llama2 = {
    .name = "llama2",
    .define = llama_define,
    .setup = llama_setup,
    .loss = llama_loss,
};
