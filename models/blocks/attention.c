/* attention.c — MaxText's global MHA/GQA Attention on the tape (see attention.h). */
#include "models/blocks/attention.h"

#include "mesh/ad.h"
#include "mesh/nn.h"
#include "mesh/ops.h"

#include <stdio.h>
#include <string.h>

/* Attention's axis names in train mode (attentions.py: input_axis_names, query/key/value_axis_names,
 * out_axis_names; reference/maxtext-facts.md §5.3) */
static const char *const ATTN_IN[3] = {"activation_batch_attn", "activation_input_length_attn",
                                       "activation_embed_attn"};
static const char *const KV4[4] = {"activation_kv_batch", "activation_length_attn", "activation_kv_heads",
                                   "activation_kv_head_dim"};
static const char *const ATTN_OUT[4] = {"activation_batch_attn", "activation_length_attn", "activation_heads",
                                        "activation_kv"};

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

sim_status model_attention(model_dev *md, mesh_tape *t, const model_batch *b, const model_attention_block *a,
                           mesh_var *x, mesh_var **y)
{
    const model_dims *d = &md->def->d;
    const int l = a->layer;
    const bool qk_norm = a->query_norm >= 0;
    mesh_var *xq, *q, *k, *v, *o;
    SIM_TRY(model_shard_as(md, t, x, "attention/inputs_q", 3, ATTN_IN, &xq));
    /* a policy that saves the three projections (minimal, save_dot_*) replaces their recomputation and
     * RoPE with the saved copies: read by nothing, left out as XLA leaves them out (model_recomputed_dead).
     * With query/key norms the projections still feed the norms' backward, so they run. */
    const model_attention_extra *ex = a->extra;
    md->ctx.dead_outputs = !qk_norm && !ex && model_recomputed_dead(md, MODEL_CKPT_QUERY_PROJ) &&
                           model_recomputed_dead(md, MODEL_CKPT_KEY_PROJ) &&
                           model_recomputed_dead(md, MODEL_CKPT_VALUE_PROJ);
    if (a->qkv >= 0) SIM_TRY(fused_qkv(md, t, xq, model_param_leaf(md, t, a->qkv, l), &q, &k, &v));
    else {
        SIM_TRY(model_dense(md, t, "bte,ehd->bthd", xq, model_param_leaf(md, t, a->query, l), "query", 4, KV4, &q));
        SIM_TRY(model_dense(md, t, "bte,ehd->bthd", xq, model_param_leaf(md, t, a->key, l), "key", 4, KV4, &k));
        SIM_TRY(model_dense(md, t, "bte,ehd->bthd", xq, model_param_leaf(md, t, a->value, l), "value", 4, KV4, &v));
    }
    if (ex && ex->query_bias >= 0) { /* DenseGeneral(use_bias): the bias after the product */
        SIM_TRY(mesh_nn_bias_add(t, q, model_param_leaf(md, t, ex->query_bias, l), "query_bias", &q));
        SIM_TRY(mesh_nn_bias_add(t, k, model_param_leaf(md, t, ex->key_bias, l), "key_bias", &k));
        SIM_TRY(mesh_nn_bias_add(t, v, model_param_leaf(md, t, ex->value_bias, l), "value_bias", &v));
    }
    if (qk_norm) { /* Attention.__call__: query_norm and key_norm (RMSNorm over head_dim) before RoPE */
        SIM_TRY(mesh_nn_rmsnorm(t, q, model_param_leaf(md, t, a->query_norm, l), a->norm_eps, "query_norm", &q));
        SIM_TRY(mesh_nn_rmsnorm(t, k, model_param_leaf(md, t, a->key_norm, l), a->norm_eps, "key_norm", &k));
    }
    SIM_TRY(mesh_nn_rope(t, q, &b->positions, &a->rope, "query_rope", &q));
    SIM_TRY(mesh_nn_rope(t, k, &b->positions, &a->rope, "key_rope", &k));
    SIM_TRY(model_shard_as(md, t, q, "attention/query", 4, KV4, &q));
    SIM_TRY(model_shard_as(md, t, k, "attention/key", 4, KV4, &k));
    SIM_TRY(model_shard_as(md, t, v, "attention/value", 4, KV4, &v));
    md->ctx.dead_outputs = false;
    /* the products whose (reshaped, roped) outputs a policy saves for the backward */
    if (a->qkv >= 0) SIM_TRY(model_saved_product(md, MODEL_CKPT_QKV_PROJ, &md->p[a->qkv].w[l]));
    else {
        SIM_TRY(model_saved_product(md, MODEL_CKPT_QUERY_PROJ, &md->p[a->query].w[l]));
        SIM_TRY(model_saved_product(md, MODEL_CKPT_KEY_PROJ, &md->p[a->key].w[l]));
        SIM_TRY(model_saved_product(md, MODEL_CKPT_VALUE_PROJ, &md->p[a->value].w[l]));
    }
    /* the tensors remat policies save (MaxText's checkpoint_name tags, attentions.py) */
    SIM_TRY(model_checkpoint_name(md, q, MODEL_CKPT_QUERY_PROJ));
    SIM_TRY(model_checkpoint_name(md, k, MODEL_CKPT_KEY_PROJ));
    SIM_TRY(model_checkpoint_name(md, v, MODEL_CKPT_VALUE_PROJ));
    /* query_pre_attn_scalar multiplies the query after RoPE; the kernel applies it to the scores,
     * the same product (AttentionOp adds no scale of its own) */
    mesh_var *sinks = ex && ex->sinks >= 0 ? model_param_leaf(md, t, ex->sinks, l) : NULL;
    SIM_TRY(mesh_nn_attention_sinks(t, q, k, v, sinks, &b->positions, a->scale, a->soft_cap, a->sliding_window,
                                    d->attn_dot, &d->splash, "attention_op", &o));
    SIM_TRY(model_checkpoint_name(md, o, MODEL_CKPT_ATTENTION_OUT));
    SIM_TRY(model_shard_as(md, t, o, "attention/out", 4, ATTN_OUT, &o));
    SIM_TRY(model_dense_saved(md, t, MODEL_CKPT_OUT_PROJ, "bthd,hde->bte", o, model_param_leaf(md, t, a->out, l),
                              "out", 3, a->out_names, y));
    if (ex && ex->out_bias >= 0)
        SIM_TRY(mesh_nn_bias_add(t, *y, model_param_leaf(md, t, ex->out_bias, l), "out_bias", y));
    return SIM_OK;
}

sim_status model_attention_global_only(const cfg_config *cfg, const char *block, const char *layer)
{
    const char *at;
    SIM_TRY(cfg_get_str(cfg, "attention_type", &at));
    if (!at || !strcmp(at, "global")) return SIM_OK;
    char why[512];
    if (!strcmp(at, "local_sliding"))
        snprintf(why, sizeof why,
                 "MaxText 0.2.5's %s layer (%s) builds its Attention without attention_type, so AttentionOp runs "
                 "global causal attention and never applies sliding_window_size; shardsim would simulate the same "
                 "global attention. Use attention_type=global (the sliding window is applied by the layers that pass "
                 "it: gemma2, gemma3, gpt_oss, olmo3)",
                 block, layer);
    else
        snprintf(why, sizeof why,
                 "decoder_block=%s is simulated with global attention (%s); use attention_type=global (mla needs "
                 "decoder_block=deepseek)",
                 block, layer);
    return model_cfg_unsupported(cfg, "attention_type", why);
}
