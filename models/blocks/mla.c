/* mla.c — multi-head latent attention (MaxText layers/attention_mla.py), see mla.h.
 *
 * q = x wq (or wq_b(q_norm(x wq_a))) split into q_nope and q_pe; kv_a = x wkv_a split into the
 * latent (kv_norm, then wkv_b -> k_nope, value) and ONE rope key head shared by all heads; YaRN
 * (or the default rotary embedding) rotates q_pe and the key head; query = [q_nope, rope(q_pe)],
 * key = [k_nope, rope(k_rope) broadcast]; softmax scale qk_head_dim^-0.5 times the YaRN mscale
 * factor.  Every constraint carries MaxText's logical names and dump names
 * (reference/maxtext-facts.md §4.7, §5.4). */
#include "models/blocks/mla.h"

#include <stdio.h>
#include <string.h>

#include "blas_kernels/bk_rope.h"
#include "config/release.h"
#include "mesh/ad.h"
#include "mesh/nn.h"
#include "mesh/ops.h"

static const char *const A[3] = {"activation_batch", "activation_norm_length", "activation_embed"};
static const char *const MLA_IN[3] = {"activation_batch_attn", "activation_length", "activation_embed"};
static const char *const KV4[4] = {"activation_kv_batch", "activation_length", "activation_kv_heads",
                                   "activation_kv_head_dim"};
static const char *const Q_LORA[3] = {"activation_kv_batch", "activation_length", "q_lora_up_proj"};
static const char *const KV_LORA[3] = {"activation_kv_batch", "activation_length", "kv_lora_up_proj"};
static const char *const MLA_OUT[4] = {"activation_batch_attn", "activation_length", "activation_heads",
                                       "activation_kv"};

model_mla_params model_mla_params_at(const model_def *m, const char *prefix)
{
    model_mla_params p;
    p.query = model_param_at(m, prefix, "self_attention.query.kernel");
    p.wq_a = model_param_at(m, prefix, "self_attention.wq_a.kernel");
    p.q_norm = model_param_at(m, prefix, "self_attention.q_norm.scale");
    p.wq_b = model_param_at(m, prefix, "self_attention.wq_b.kernel");
    p.wkv_a = model_param_at(m, prefix, "self_attention.wkv_a.kernel");
    p.kv_norm = model_param_at(m, prefix, "self_attention.kv_norm.scale");
    p.wkv_b = model_param_at(m, prefix, "self_attention.wkv_b.kernel");
    p.out = model_param_at(m, prefix, "self_attention.out.kernel");
    return p;
}

/* ------------------------------------------------------------ activations for the dump */

/* MaxText's attention kernel logs its operands in (batch, heads, sequence,
 * dim) layout without logical names: the query keeps its sequence sharding,
 * keys and values arrive with the sequence gathered (what mesh_nn_attention
 * does).  The kernel's block-mask arrays (attention_op/arr) are TPU kernel
 * details with no counterpart here and are not logged. */
static void log_attention_op(const model_dev *md, const mesh_var *q, const mesh_var *k, const mesh_var *v)
{
    const mesh_var *xs[3] = {q, k, v};
    static const char *const names[3] = {"attention_op/query", "attention_op/key", "attention_op/value"};
    for (int i = 0; i < 3; i++) {
        const mesh_array *a = &xs[i]->val;
        mesh_array bhsd = *a; /* shape only: (B, T, H, D) -> (B, H, T, D) */
        bhsd.shape[1] = a->shape[2];
        bhsd.shape[2] = a->shape[1];
        mesh_spec s;
        mesh_spec_init(&s, 4);
        int from[3] = {0, 2, 1}; /* batch, heads, then the sequence (the query's only) */
        for (int dd = 0; dd < (i == 0 ? 3 : 2); dd++) {
            s.n_axes[dd] = q->val.spec.n_axes[from[dd]];
            memcpy(s.axes[dd], q->val.spec.axes[from[dd]], sizeof s.axes[dd]);
        }
        model_note_activation(md, names[i], &bhsd, 4, NULL, &s);
    }
}

static bk_rope_params rope_params(const model_dims *d, const model_mla_dims *mla)
{
    int dim = (int)mla->qk_rope;
    bk_rope_params p = mla->yarn ? bk_rope_params_yarn(dim) : bk_rope_params_default(dim);
    p.max_timescale = d->rope_theta;
    if (!mla->yarn) {
        p.min_timescale = d->rope_min;
        p.linear_scaling_factor = d->rope_linear;
        return p;
    }
    p.factor = mla->rope_factor;
    p.original_max_position_embeddings = (int)mla->orig_max_pos;
    p.beta_fast = mla->beta_fast;
    p.beta_slow = mla->beta_slow;
    p.interleave = mla->rope_interleave;
    p.truncate = mla->rope_truncate;
    p.attention_scaling = mla->rope_attn_scaling;
    return p;
}

/* MaxText 0.2.5 builds MLA's q_norm and kv_norm without the shard mode, so in explicit mode their
 * scale (logical 'norm': tensor) is not resharded to the activation's last dim before RMSNorm's
 * einsum('...k,k->...k'), which jnp.einsum hands to dot_general as (scale, y), k a batch dim: a
 * sharded scale against an unsharded activation dim is refused.  The other norms align the scale. */
static sim_status unaligned_norm_check(model_dev *md, const mesh_var *x, const mesh_var *scale, const char *name)
{
    if (md->ctx.mode != MESH_MODE_EXPLICIT) return SIM_OK;
    const char *where = cfg_release_error(md->ctx.release, "mla_norm_scale", "layers/normalizations.py:__call__");
    if (!where) return SIM_OK; /* the release followed traces it (maxtext_release) */
    char sub[32];
    snprintf(sub, sizeof sub, "%.*sk,k->%.*sk", x->val.rank - 1, "abcdefgh", x->val.rank - 1, "abcdefgh");
    return mesh_einsum_check(&md->ctx, sub, &x->val, &scale->val, name, where,
                             "MaxText's MLA norms ignore shard_mode: use tensor=1 (and tensor_sequence=1) with MLA in "
                             "explicit mode, or shard_mode=auto");
}

/* MaxText 0.2.5's YaRN rotary embedding in explicit mode: the complex frequencies looked up by
 * position come out sharded (activation_batch, activation_length, q_heads) over (B, T, rope/2); a
 * new head axis makes them (B, T, 1, rope/2), then broadcast_to the rotated input's (B, T, H, rope/2)
 * with out_sharding (activation_batch, activation_length, None, None): the q_heads axes (tensor,
 * tensor_sequence) on the frequency dim cannot be dropped by a broadcast, and JAX refuses it; so it
 * does when the two batch shardings differ (a dense layer before a pipeline, below). */
static sim_status yarn_check(model_dev *md, const mesh_var *x)
{
    if (md->ctx.mode != MESH_MODE_EXPLICIT) return SIM_OK;
    const char *where = cfg_release_error(md->ctx.release, "yarn_freqs_broadcast", "layers/embeddings.py:__call__");
    if (!where) return SIM_OK;
    static const char *const fnames[4] = {"activation_batch", "activation_length", NULL, "q_heads"};
    static const char *const onames[4] = {"activation_batch", "activation_length", NULL, NULL};
    const mesh_array *a = &x->val;
    int64_t half = a->shape[3] / 2;
    int64_t in_shape[4] = {a->shape[0], a->shape[1], 1, half},
            out_shape[4] = {a->shape[0], a->shape[1], a->shape[2], half};
    mesh_spec fs, os;
    /* freqs_sharding is built when the module is, under the config's rules; the rotated sharding when
     * it runs: in a dense layer before a pipeline that is under logical_axis_rules_pp_act_as_dp, whose
     * activation_batch adds 'stage' (then the batch dim differs too) */
    mesh_resolved fr;
    SIM_TRY(mesh_rules_resolve(&md->def->rules, &md->def->mesh, "rope/freqs", 4, fnames, &fr));
    fs = fr.spec;
    SIM_TRY(model_logical_spec(md->def, "rope/rotated", 4, onames, &os));
    bool batch_differs = fs.n_axes[0] != os.n_axes[0] || memcmp(fs.axes[0], os.axes[0], (size_t)fs.n_axes[0]) != 0;
    return mesh_broadcast_to_check(
        &md->ctx, "complex64", 4, in_shape, &fs, out_shape, &os, "query_rope", where,
        batch_differs ? "MaxText's YaRN frequencies keep the config rules' batch sharding in the dense "
                        "layers before a pipeline (which run with 'stage' added to activation_batch): "
                        "run pipelines in shard_mode=auto"
                      : "MaxText's YaRN frequencies keep the q_heads sharding: use tensor=1 and "
                        "tensor_sequence=1 with rope_type=yarn in explicit mode, rope_type=default, or "
                        "shard_mode=auto");
}

/* MaxText 0.2.5's default rotary embedding (RotaryEmbedding.apply_rotary) multiplies the input
 * (B, T, H, D) by sin/cos built from the positions (B, T, 1, D): they carry the positions' sharding
 * (the input data's, input_data_sharding_logical_axes: batch, and the length on
 * activation_norm_length's axes).  In explicit mode JAX's
 * broadcasting rule then puts an axis on two dims when the heads are sharded by an axis that also
 * shards the positions' length (tensor_sequence): refused. */
static sim_status rope_mul_check(model_dev *md, const mesh_var *x, const mesh_array *positions)
{
    if (md->ctx.mode != MESH_MODE_EXPLICIT) return SIM_OK;
    const char *where = cfg_release_error(md->ctx.release, "rope_positions_mul", "layers/embeddings.py:apply_rotary");
    if (!where) return SIM_OK;
    const mesh_array *a = &x->val;
    int64_t shape[4] = {a->shape[0], a->shape[1], 1, a->shape[3]};
    /* the positions as MaxText's input pipeline shards them (input_data_sharding_logical_axes) */
    static const char *const pnames[4] = {"activation_embed_and_logits_batch", "activation_norm_length", NULL, NULL};
    mesh_spec ps;
    SIM_TRY(model_logical_spec(md->def, "inputs/positions", 4, pnames, &ps));
    mesh_array sv = mesh_array_view(positions, 4, shape, &ps);
    sv.dtype = SIM_F32; /* sin/cos of the positions, in the input's dtype */
    snprintf(sv.name, sizeof sv.name, "sin");
    return mesh_mul_check(&md->ctx, a, &sv, "query_rope", where,
                          "MaxText's rotary embedding keeps the positions' sequence sharding: use "
                          "tensor_sequence=1 with MLA in explicit mode, or shard_mode=auto");
}

/* The low-rank product y = norm(x w) that MLA's q_norm / kv_norm return, as XLA:TPU partitions it in
 * auto mode (hardware profile key low_rank_norm_sharding: configs/hardware/v5p.yml has the compile's
 * evidence).  Nothing constrains wq_a's or wkv_a's output (layers/linears.py drops out_sharding in
 * auto mode) and the norm's scale is split over `tensor` (logical 'norm'), so the sharding
 * propagation splits the product's last dim the same way, and the next product (wq_b, wkv_b), which
 * contracts that dim, gathers it: once where it runs (used: it is not a product the remat policy
 * saved), once more in the backward for its weight gradient where the compiler does not merge the
 * two (weight_gather_cse: near; a rematerialised layer's), and its cotangent is reduce-scattered.
 * shardsim keeps the product whole (the values, the norm's sums and every other collective as they
 * were) and counts those three. */
static sim_status norm_split(model_dev *md, mesh_tape *t, mesh_var *y, const mesh_var *scale, bool used,
                             const char *name, mesh_var **out)
{
    *out = y;
    /* the configured mode: a recomputation runs in the backward, which resolves shardings as auto mode does */
    if (md->def->d.mode != MESH_MODE_AUTO || !md->def->d.xla.norm_splits_product) return SIM_OK;
    return mesh_ad_counted_split_last(t, y, &scale->val.spec, used, md->recomputing && md->def->d.xla.regather_far,
                                      name, out);
}

/* The query from its last product: split, RoPE on the rope part, concatenated (attention_mla.py). */
static sim_status query_tail(model_dev *md, mesh_tape *t, const model_batch *b, const model_mla_dims *mla, mesh_var *q,
                             mesh_var **query)
{
    mesh_var *q_nope, *q_pe;
    SIM_TRY(mesh_ad_split_last(t, q, mla->qk_nope, false, "query_split", &q_nope, &q_pe));
    SIM_TRY(model_shard_as(md, t, q_nope, "attention_mla/q_nope", 4, KV4, &q_nope));
    SIM_TRY(model_shard_as(md, t, q_pe, "attention_mla/q_pe", 4, KV4, &q_pe));
    bk_rope_params rp = rope_params(&md->def->d, mla);
    if (mla->yarn) SIM_TRY(yarn_check(md, q_pe));
    else SIM_TRY(rope_mul_check(md, q_pe, &b->positions));
    SIM_TRY(mesh_nn_rope(t, q_pe, &b->positions, &rp, "query_rope", &q_pe));
    SIM_TRY(mesh_ad_concat_last(t, q_nope, q_pe, "query_concat", query));
    return model_shard_as(md, t, *query, "attention_mla/query", 4, KV4, query);
}

/* Keys and values from the normalised latent: wkv_b's product split into the no-rope key and the value,
 * one rope key head broadcast to every head (attention_mla.py). */
static sim_status key_value(model_dev *md, mesh_tape *t, const model_batch *b, const model_mla_dims *mla,
                            const model_mla_params *p, int l, mesh_var *kv_latent, mesh_var *k_rope, mesh_var **key,
                            mesh_var **value)
{
    mesh_var *kv, *k_nope, *key_rope;
    bk_rope_params rp = rope_params(&md->def->d, mla);
    SIM_TRY(model_dense(md, t, "btk,khd->bthd", kv_latent, model_param_leaf(md, t, p->wkv_b, l), "wkv_b", 4, KV4, &kv));
    SIM_TRY(mesh_ad_split_last(t, kv, mla->qk_nope, false, "kv_split_heads", &k_nope, value));
    SIM_TRY(model_shard_as(md, t, k_nope, "attention_mla/key_nope", 4, KV4, &k_nope));
    SIM_TRY(mesh_nn_rope(t, k_rope, &b->positions, &rp, "key_rope", &k_rope));
    mesh_spec kv4;
    SIM_TRY(model_logical_spec(md->def, "attention_mla/key_rope", 4, KV4, &kv4));
    SIM_TRY(mesh_ad_broadcast_heads(t, k_rope, md->def->d.q_heads, &kv4, "key_rope_broadcast", &key_rope));
    SIM_TRY(model_shard_as(md, t, key_rope, "attention_mla/key_rope", 4, KV4, &key_rope));
    SIM_TRY(mesh_ad_concat_last(t, k_nope, key_rope, "key_concat", key));
    SIM_TRY(model_shard_as(md, t, *key, "attention_mla/key", 4, KV4, key));
    return model_shard_as(md, t, *value, "attention_mla/value", 4, KV4, value);
}

sim_status model_mla(model_dev *md, mesh_tape *t, const model_batch *b, const model_mla_dims *mla,
                     const model_mla_params *p, int l, mesh_var *x, mesh_var **y)
{
    const model_dims *d = &md->def->d;
    mesh_var *xq, *xkv, *q, *query, *low, *kv_latent, *k_rope, *value, *key, *o;
    SIM_TRY(model_shard_as(md, t, x, "attention_mla/inputs_q", 3, MLA_IN, &xq));
    SIM_TRY(model_shard_as(md, t, x, "attention_mla/inputs_kv", 3, MLA_IN, &xkv));
    /* Queries.  A policy that saves query_proj (minimal, save_dot_*) replaces the recomputed query with the saved
     * copy: the last product (query or wq_b), its split and RoPE are read by nothing then, and XLA leaves
     * them out of the recomputation (model_recomputed_dead), so the product's weight is gathered in the
     * backward for the input gradient alone.  wq_a and q_norm still run: wq_b's weight gradient reads their
     * output.  (MaxText 0.2.5 deepseek2-16b fsdp=8 remat_policy=minimal on v5p-16, tests/data/xla/tpu.json:
     * its backward has no all-gather of wq's bf16[1,2048,16,192], whose input gradient is a
     * collective-permute ring.) */
    const bool q_dead = model_recomputed_dead(md, MODEL_CKPT_QUERY_PROJ);
    sim_status st;
    if (mla->q_lora == 0) {
        md->ctx.dead_outputs = q_dead;
        st = model_dense(md, t, "bte,ehd->bthd", xq, model_param_leaf(md, t, p->query, l), "query", 4, KV4, &q);
        md->ctx.dead_outputs = false;
        SIM_TRY(st);
    } else {
        mesh_var *lq;
        SIM_TRY(model_dense_saved(md, t, MODEL_CKPT_QUERY_WA_PROJ, "bte,eq->btq", xq,
                                  model_param_leaf(md, t, p->wq_a, l), "wq_a", 3, Q_LORA, &lq));
        mesh_var *qn = model_param_leaf(md, t, p->q_norm, l);
        SIM_TRY(unaligned_norm_check(md, lq, qn, "q_norm"));
        SIM_TRY(mesh_nn_rmsnorm(t, lq, qn, d->eps, "q_norm", &lq));
        SIM_TRY(model_checkpoint_name(md, lq, MODEL_CKPT_MLA_Q));
        SIM_TRY(norm_split(md, t, lq, qn, !q_dead, "q_norm/gathered", &lq));
        md->ctx.dead_outputs = q_dead;
        st = model_dense(md, t, "btq,qhd->bthd", lq, model_param_leaf(md, t, p->wq_b, l), "wq_b", 4, KV4, &q);
        md->ctx.dead_outputs = false;
        SIM_TRY(st);
    }
    md->ctx.dead_outputs = q_dead;
    st = query_tail(md, t, b, mla, q, &query);
    md->ctx.dead_outputs = false;
    SIM_TRY(st);
    /* keys and values from the latent; one rope key head for all heads */
    SIM_TRY(model_dense_saved(md, t, MODEL_CKPT_KV_WA_PROJ, "bte,ek->btk", xkv, model_param_leaf(md, t, p->wkv_a, l),
                              "wkv_a", 3, KV_LORA, &low));
    SIM_TRY(mesh_ad_split_last(t, low, mla->kv_lora, true, "kv_split", &kv_latent, &k_rope));
    mesh_var *kvn = model_param_leaf(md, t, p->kv_norm, l);
    SIM_TRY(unaligned_norm_check(md, kv_latent, kvn, "kv_norm"));
    SIM_TRY(mesh_nn_rmsnorm(t, kv_latent, kvn, d->eps, "kv_norm", &kv_latent));
    SIM_TRY(model_checkpoint_name(md, kv_latent, MODEL_CKPT_MLA_KV));
    const bool kv_dead =
        model_recomputed_dead(md, MODEL_CKPT_KEY_PROJ) && model_recomputed_dead(md, MODEL_CKPT_VALUE_PROJ);
    SIM_TRY(norm_split(md, t, kv_latent, kvn, !kv_dead, "kv_norm/gathered", &kv_latent));
    /* With key_proj and value_proj saved, wkv_b's product, its split and the rope key are read by nothing in
     * the recomputation, as the query above (the same compile has no all-gather of wkv_b's
     * bf16[1,512,16,256] in the backward); wkv_a and kv_norm still run for wkv_b's weight gradient. */
    md->ctx.dead_outputs = kv_dead;
    st = key_value(md, t, b, mla, p, l, kv_latent, k_rope, &key, &value);
    md->ctx.dead_outputs = false;
    SIM_TRY(st);
    /* the products whose outputs (split, roped) a policy saves for the backward */
    SIM_TRY(model_saved_product(md, MODEL_CKPT_QUERY_PROJ, &md->p[mla->q_lora == 0 ? p->query : p->wq_b].w[l]));
    SIM_TRY(model_saved_product(
        md, d->ckpt[MODEL_CKPT_KEY_PROJ] == MODEL_CKPT_DEVICE ? MODEL_CKPT_KEY_PROJ : MODEL_CKPT_VALUE_PROJ,
        &md->p[p->wkv_b].w[l]));
    /* the tensors remat policies save (MaxText's checkpoint_name tags, attention_mla.py) */
    SIM_TRY(model_checkpoint_name(md, query, MODEL_CKPT_QUERY_PROJ));
    SIM_TRY(model_checkpoint_name(md, key, MODEL_CKPT_KEY_PROJ));
    SIM_TRY(model_checkpoint_name(md, value, MODEL_CKPT_VALUE_PROJ));
    double scale = bk_mla_softmax_scale((int)(mla->qk_nope + mla->qk_rope), (long)mla->max_pos, (long)mla->orig_max_pos,
                                        mla->rope_factor, mla->mscale);
    log_attention_op(md, query, key, value);
    SIM_TRY(mesh_nn_attention_kernel(t, query, key, value, &b->positions, scale, d->attn_soft_cap, 0, d->attn_dot,
                                     &d->splash, "attention_op", &o));
    SIM_TRY(model_shard_as(md, t, o, "attention_mla/out", 4, MLA_OUT, &o));
    SIM_TRY(model_checkpoint_name(md, o, MODEL_CKPT_ATTENTION_OUT));
    return model_dense_saved(md, t, MODEL_CKPT_OUT_PROJ, "bthd,hde->bte", o, model_param_leaf(md, t, p->out, l), "out",
                             3, A, y);
}
