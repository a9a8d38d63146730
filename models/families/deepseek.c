/* deepseek.c — the DeepSeek decoder (MaxText decoder_block: deepseek) on the tape.
 *
 * Parameters (reference/maxtext-facts.md §5.4-5.7): the first
 * first_num_dense_layers layers are stacked under params.decoder.dense_layers,
 * the rest under params.decoder.moe_layers (scan dim 1, logical 'dense_layers'
 * / 'moe_layers'); each has MLA self-attention (plain `query` when
 * q_lora_rank = 0, else wq_a / q_norm / wq_b; wkv_a, kv_norm, wkv_b, out) and
 * either a SwiGLU `mlp` or the DeepSeekMoeBlock_0 (MoeBlock_0: gate, wi_0,
 * wi_1, wo; shared_experts: an MLP of width shared_experts x moe_mlp_dim).
 *
 * Layer (facts §5.6), every constraint with MaxText's logical names and dump
 * names:  h = x + MLA(norm1(x));  out = h + (MLP or routed MoE + shared)(norm2(h)).
 * MLA (§4.7, §5.4): q = x wq (or wq_b(q_norm(x wq_a))) split into q_nope and
 * q_pe; kv_a = x wkv_a split into the latent (kv_norm, then wkv_b -> k_nope,
 * value) and ONE rope key head shared by all heads; YaRN rotates q_pe and the
 * key head; query = [q_nope, rope(q_pe)], key = [k_nope, rope(k_rope)
 * broadcast]; softmax scale qk_head_dim^-0.5 times the YaRN mscale factor.
 * MoE (§6): gate logits -> sigmoid/softmax/no scores -> top-k (bias for
 * selection only on DeepSeek-V3, optionally group-limited) -> the expert
 * region of models/blocks/moe.h (sparse ragged all-to-all path, or with
 * sparse_matmul=false the dense path, dropping past capacity_factor > 0);
 * the load-balance loss of every MoE layer (weight / number of MoE layers)
 * is added to the loss.  The DeepSeek-V3 gate bias is MaxText 0.2.5's
 * MoEBiasVar: not trained; with routed_bias_update_rate each layer's expert
 * counts feed bias_update after the step.
 * use_ring_of_experts gathers the tokens and router
 * logits over the expert axes before the top-k and reduce-scatters the
 * region's output instead (model_moe_ring_gather, MaxText's roe_ag_and_route).
 * mtp_num_layers adds MaxText's MultiTokenPredictionBlock after the decoder
 * (mtp_loss): its parameters live under params.mtp_block, its transformer
 * layer is the decoder's last layer type, unscanned, and its loss (and its
 * MoE load-balance loss) join the training loss.
 *
 * With remat (every remat_policy but none) each layer is one tape entry (output and, for MoE
 * layers with a load-balance loss, that loss): backward runs the layer again
 * on a recording tape, so only the layer inputs live between the passes, plus the tensors the
 * policy saves (MaxText's checkpoint_name tags: MLA's, the MLPs', and inside the routed experts
 * the grouped matmul's products, which model_moe_experts keeps in its own buffers).
 *
 * The layout ops MLA and MTP need (split and concatenation of the last dim, the shared rope key
 * broadcast to every head, the token roll and masked sum) are mesh/ad.h's. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config/release.h"
#include "mesh/ad.h"
#include "models/blocks/mla.h"
#include "models/blocks/mlp.h"
#include "models/blocks/moe.h"
#include "mesh/nn.h"
#include "mesh/ops.h"
#include "mesh/reshard.h"
#include "models/families/batchsplit.h"
#include "models/families/deepseek_dims.h"
#include "models/core/init.h"
#include "models/core/model.h"
#include "models/core/pipeline_run.h"

/* ------------------------------------------------------------ logical names */

static const char *const A[3] = {"activation_batch", "activation_norm_length", "activation_embed"};
static const char *const MLP_WI[3] = {"activation_batch", "activation_norm_length", "activation_mlp"};
static const char *const EMB_OUT[3] = {"activation_embed_and_logits_batch", "activation_length", "activation_embed"};
static const char *const FINAL[3] = {"activation_batch", "activation_length", "activation_embed"};
static const char *const LOSS[2] = {"activation_embed_and_logits_batch", "activation_length"};
static const char *const LOGITS[3] = {"activation_embed_and_logits_batch", "activation_length", "activation_vocab"};

enum { MTP_MAX = 2 }; /* parameters per MTP layer: 20 at most, MODEL_MAX_PARAMS bounds the total */

/* ------------------------------------------------------------ config */

static sim_status unsupported(const cfg_config *cfg, const char *key, const char *why)
{
    return model_cfg_unsupported(cfg, key, why);
}

static sim_status read_dims(const cfg_config *cfg, const model_dims *d, ds_dims *ds)
{
    SIM_TRY(model_cfg_i64(cfg, "first_num_dense_layers", &ds->dense_layers));
    SIM_TRY(model_moe_dims_read(cfg, d, false, &ds->moe));
    SIM_TRY(model_cfg_i64(cfg, "q_lora_rank", &ds->mla.q_lora));
    SIM_TRY(model_cfg_i64(cfg, "kv_lora_rank", &ds->mla.kv_lora));
    SIM_TRY(model_cfg_i64(cfg, "qk_nope_head_dim", &ds->mla.qk_nope));
    SIM_TRY(model_cfg_i64(cfg, "qk_rope_head_dim", &ds->mla.qk_rope));
    SIM_TRY(model_cfg_i64(cfg, "v_head_dim", &ds->mla.v_head));
    static const char *const rope_types[] = {"default", "yarn"};
    int rt;
    SIM_TRY(cfg_get_enum(cfg, "rope_type", rope_types, 2, &rt));
    if (d->rope_llama31) /* by its name, MaxText would rotate MLA's rope dims with Llama 3.1's RoPE */
        return sim_err(SIM_ERR_INPUT,
                       "model_name=%s with decoder_block=deepseek: MaxText applies Llama 3.1's RoPE "
                       "(LLaMARotaryEmbedding) to every llama3.1* model name, which shardsim simulates with "
                       "decoder_block=llama2 only; use another model_name",
                       d->model_name);
    ds->mla.yarn = rt == 1;
    SIM_TRY(cfg_get_double(cfg, "rope_factor", &ds->mla.rope_factor));
    SIM_TRY(cfg_get_double(cfg, "beta_fast", &ds->mla.beta_fast));
    SIM_TRY(cfg_get_double(cfg, "beta_slow", &ds->mla.beta_slow));
    SIM_TRY(cfg_get_double(cfg, "mscale", &ds->mla.mscale));
    SIM_TRY(model_cfg_i64(cfg, "max_position_embeddings", &ds->mla.max_pos));
    SIM_TRY(model_cfg_i64(cfg, "original_max_position_embeddings", &ds->mla.orig_max_pos));
    SIM_TRY(model_cfg_bool(cfg, "rope_interleave", &ds->mla.rope_interleave));
    SIM_TRY(model_cfg_bool(cfg, "rope_truncate", &ds->mla.rope_truncate));
    SIM_TRY(model_cfg_bool(cfg, "rope_attention_scaling", &ds->mla.rope_attn_scaling));

    /* what this simulator does not model yet: refuse rather than run something else */
    static const char *const att[] = {"global", "mla"};
    int at;
    SIM_TRY(cfg_get_enum(cfg, "attention_type", att, 2, &at));
    if (at != 1)
        return unsupported(cfg, "attention_type",
                           "decoder_block=deepseek uses multi-head latent attention; set attention_type=mla");
    const char **acts;
    int nacts;
    SIM_TRY(cfg_get_str_list(cfg, "mlp_activations", &acts, &nacts));
    bool swiglu = nacts == 2 && !strcmp(acts[0], "silu") && !strcmp(acts[1], "linear");
    free(acts);
    if (!swiglu) return sim_err(SIM_ERR_INPUT, "mlp_activations: only [\"silu\", \"linear\"] (SwiGLU) is simulated");
    if (d->fused_qkv) /* attention_mla.py: assert not config.fused_qkv */
        return sim_err(SIM_ERR_INPUT,
                       "fused_qkv=true with decoder_block=deepseek: MaxText 0.2.5 asserts \"Fused QKV is "
                       "not supported for MLA\" (multi-head latent attention has no q/k/v kernels to "
                       "fuse); set fused_qkv=false");
    if (d->fused_mlp)
        return unsupported(cfg, "fused_mlp",
                           "the fused wi kernel is simulated for decoder_block=llama2 only; use "
                           "fused_mlp=false with DeepSeek");
    bool b;
    /* group-limited routing: moe.py reads the groups in deepseek_routing only (DeepSeek-V3 names) */
    long long groups, keep;
    SIM_TRY(cfg_get_int(cfg, "n_routing_groups", &groups));
    SIM_TRY(model_cfg_bool(cfg, "use_batch_split_schedule", &ds->batch_split));
    SIM_TRY(cfg_get_int(cfg, "topk_routing_group", &keep));
    if (groups != -1 && ds->moe.bias_selects_only && d->layers > ds->dense_layers) {
        int64_t per = groups > 0 ? ds->moe.experts / groups : 0;
        if (groups < 1 || groups > 256 || ds->moe.experts % groups || per < 2)
            return sim_err(SIM_ERR_INPUT,
                           "n_routing_groups=%lld with num_experts=%lld: the groups must split the experts evenly "
                           "into groups of at least 2 (MaxText reshapes the scores to (groups, experts/groups) and "
                           "sums each group's top 2; at most 256 groups here); use a divisor of num_experts up to "
                           "num_experts/2, or -1 (off)",
                           groups, (long long)ds->moe.experts);
        if (keep < 1 || keep > groups || keep * per < ds->moe.top_k)
            return sim_err(SIM_ERR_INPUT,
                           "topk_routing_group=%lld with n_routing_groups=%lld (%lld experts each) and "
                           "num_experts_per_tok=%lld: the kept groups must number 1..n_routing_groups and hold at "
                           "least num_experts_per_tok experts (MaxText's top-k over the group scores needs k >= 1, "
                           "and fewer experts would route tokens to masked ones); choose topk_routing_group >= %lld",
                           keep, groups, (long long)per, (long long)ds->moe.top_k,
                           (long long)((ds->moe.top_k + per - 1) / per));
        ds->moe.routing_groups = (int)groups;
        ds->moe.topk_groups = (int)keep;
    }
    /* loss-free balancing (moe.py should_update_load_balance: routed_bias and a rate > 0) */
    SIM_TRY(cfg_get_double(cfg, "routed_bias_update_rate", &ds->moe.bias_update_rate));
    if (ds->moe.bias_update_rate > 0 && ds->moe.routed_bias && !ds->moe.bias_selects_only)
        return unsupported(cfg, "routed_bias_update_rate",
                           "MaxText 0.2.5 adds the (layers, experts) update to a gate bias it stores as an nnx.Param "
                           "(experts, layers) for this model_name, which fails unless the two sizes agree; the "
                           "update is simulated for the MoEBiasVar bias of deepseek3*, deepseek4* and kimi-k2* "
                           "names; use one of those or 0");

    /* multi-token prediction (layers/multi_token_prediction.py) */
    SIM_TRY(model_cfg_i64(cfg, "mtp_num_layers", &ds->mtp_layers));
    SIM_TRY(cfg_get_double(cfg, "mtp_loss_scaling_factor", &ds->mtp_scale));
    if (ds->mtp_layers < 0 || ds->mtp_layers > MTP_MAX)
        return sim_err(SIM_ERR_INPUT,
                       "mtp_num_layers=%lld: shardsim simulates 0 to %d multi-token prediction layers "
                       "(DeepSeek-V3 uses 1)",
                       (long long)ds->mtp_layers, MTP_MAX);
    if (ds->mtp_layers > 0) {
        SIM_TRY(model_cfg_bool(cfg, "mtp_reuse_input_embedding", &b));
        if (b)
            return unsupported(cfg, "mtp_reuse_input_embedding",
                               "shifting the main decoder's token embeddings into the MTP layers is not simulated; "
                               "use mtp_reuse_input_embedding=false (each MTP layer looks its tokens up, same values)");
        int64_t pp[2];
        SIM_TRY(model_cfg_i64(cfg, "ici_pipeline_parallelism", &pp[0]));
        SIM_TRY(model_cfg_i64(cfg, "dcn_pipeline_parallelism", &pp[1]));
        if (pp[0] > 1 || pp[1] > 1)
            return unsupported(cfg, "mtp_num_layers",
                               "multi-token prediction with pipeline parallelism is not "
                               "simulated; use ici/dcn_pipeline_parallelism=1 or mtp_num_layers=0");
        if (d->ga > 1)
            return unsupported(cfg, "mtp_num_layers",
                               "multi-token prediction with gradient_accumulation_steps > 1 (MaxText then weights the "
                               "MTP loss by each microbatch's token count) is not simulated; use "
                               "gradient_accumulation_steps=1 or mtp_num_layers=0");
        if (ds->moe.bias_update_rate > 0 && ds->moe.routed_bias)
            return unsupported(cfg, "routed_bias_update_rate",
                               "loss-free balancing with multi-token prediction (MaxText also moves the MTP "
                               "layers' gate bias, from their own expert counts) is not simulated; use "
                               "routed_bias_update_rate=0 or mtp_num_layers=0");
    }

    /* remat policies: the routed experts keep MaxText's moe.py tags of the grouped matmul (mlpwi_0,
     * moe_mlpwi_0/1, mlpwo, moe_mlpwo: model_moe_cfg.keep); the sorted inputs and the routing maps
     * (custom-only keys) and the batch-split schedule (its own MoE region) do not keep theirs */
    static const model_ckpt_name moe_tags[] = {
        MODEL_CKPT_MLPWI,     MODEL_CKPT_MLPWI_0,      MODEL_CKPT_MLPWI_1,
        MODEL_CKPT_MLPWO,     MODEL_CKPT_MOE_MLPWI_0,  MODEL_CKPT_MOE_MLPWI_1,
        MODEL_CKPT_MOE_MLPWO, MODEL_CKPT_MOE_X_SORTED, MODEL_CKPT_MOE_ROUTING_MAPS};
    for (size_t i = 0; i < sizeof moe_tags / sizeof moe_tags[0] && d->layers > ds->dense_layers; i++) {
        model_ckpt_name n = moe_tags[i];
        if (d->ckpt[n] == MODEL_CKPT_REMAT) continue;
        if (n == MODEL_CKPT_MOE_X_SORTED || n == MODEL_CKPT_MOE_ROUTING_MAPS)
            return sim_err(SIM_ERR_INPUT,
                           "%s=%s (remat_policy=custom): saving the routed experts' %s across remat is not "
                           "simulated; keep %s=remat (the other MoE tags, moe_mlpwi_0/moe_mlpwi_1/moe_mlpwo, are)",
                           model_ckpt_name_str(n), d->ckpt[n] == MODEL_CKPT_DEVICE ? "device" : "offload",
                           n == MODEL_CKPT_MOE_X_SORTED ? "expert-sorted inputs" : "routing maps",
                           model_ckpt_name_str(n));
        if (ds->batch_split)
            return sim_err(SIM_ERR_INPUT,
                           "remat_policy=%s keeps '%s' with use_batch_split_schedule=true: the batch-split MoE "
                           "layers (deepseek_batchsplit.py) are not simulated with saved MLP/MoE tensors; use "
                           "full, none, save_qkv_proj, save_out_proj, save_dot_except_mlp, "
                           "save_dot_with_context_except_mlp, qkv_proj_offloaded, or custom without the MLP/MoE tags",
                           d->remat_policy, model_ckpt_name_str(n));
    }

    /* sizes */
    if (ds->dense_layers < 0 || ds->dense_layers > d->layers)
        return sim_err(SIM_ERR_INPUT, "first_num_dense_layers=%lld must be between 0 and base_num_decoder_layers=%lld",
                       (long long)ds->dense_layers, (long long)d->layers);
    static const char *const pk[] = {"kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"};
    int64_t pv[] = {ds->mla.kv_lora, ds->mla.qk_nope, ds->mla.qk_rope, ds->mla.v_head};
    for (int i = 0; i < 4; i++)
        if (pv[i] < 1) return sim_err(SIM_ERR_INPUT, "%s=%lld: must be at least 1", pk[i], (long long)pv[i]);
    if (ds->mla.q_lora < 0)
        return sim_err(SIM_ERR_INPUT, "q_lora_rank=%lld: use 0 (plain query projection) or a rank",
                       (long long)ds->mla.q_lora);
    if (ds->mla.qk_rope % 2)
        return sim_err(SIM_ERR_INPUT, "qk_rope_head_dim=%lld: RoPE needs an even dim", (long long)ds->mla.qk_rope);
    if (d->layers > ds->dense_layers) {
        if (ds->moe.experts < 1 || ds->moe.top_k < 1 || ds->moe.top_k > ds->moe.experts || ds->moe.top_k > 64)
            return sim_err(
                SIM_ERR_INPUT,
                "num_experts_per_tok=%lld with num_experts=%lld: a MoE layer routes each token to 1..min(64, "
                "num_experts) experts",
                (long long)ds->moe.top_k, (long long)ds->moe.experts);
        if (ds->moe.moe_mlp < 1)
            return sim_err(SIM_ERR_INPUT, "base_moe_mlp_dim=%lld: the MoE layers need the routed experts' width",
                           (long long)ds->moe.moe_mlp);
        if (ds->moe.shared_experts < 0)
            return sim_err(SIM_ERR_INPUT, "shared_experts=%lld: must be 0 or more", (long long)ds->moe.shared_experts);
    }
    return SIM_OK;
}

/* ------------------------------------------------------------ parameters */

/* A parameter whose scan dim is its dim 1 when that dim is a layer stack (dense_layers, moe_layers). */
static void add(model_def *m, const char *path, int rank, const int64_t *shape, const char *const *logical,
                model_init_kind init, double scale)
{
    int scan =
        rank > 1 && logical[1] && (!strcmp(logical[1], "dense_layers") || !strcmp(logical[1], "moe_layers")) ? 1 : -1;
    model_add_param(m, path, rank, shape, logical, scan, init, scale);
}

static double fan_in(int64_t n) { return 1.0 / sqrt((double)n); }

/* A parameter of a layer: shape and logical names with the stack dim at 1; an unscanned layer
 * (the MTP transformer layer) drops it. */
static void add_layer(model_def *m, bool unscanned, const char *path, int rank, const int64_t *shape,
                      const char *const *logical, model_init_kind init, double scale)
{
    if (!unscanned) {
        add(m, path, rank, shape, logical, init, scale);
        return;
    }
    int64_t sh[MESH_SPEC_MAX_RANK];
    const char *lg[MESH_SPEC_MAX_RANK];
    for (int i = 0, j = 0; i < rank; i++)
        if (i != 1) {
            sh[j] = shape[i];
            lg[j++] = logical[i];
        }
    add(m, path, rank - 1, sh, lg, init, scale);
}

/* One stack of layers ("dense_layers" or "moe_layers", n of them) under params.decoder, or
 * (prefix given) one unscanned layer under `prefix` (MaxText's MTP transformer layer). */
static void define_layers(model_def *m, const char *prefix, const char *stack, int64_t n, bool moe)
{
    const model_dims *d = &m->d;
    const ds_dims *ds = deepseek_dims(m);
    int64_t E = d->emb, H = d->q_heads, Dqk = ds->mla.qk_nope + ds->mla.qk_rope;
    char p[MODEL_PATH_MAX];
    const bool un = prefix != NULL;
    if (un) stack = "layers"; /* a placeholder name for the stack dim add_layer drops */
#define PATH(fmt)                                                                                                      \
    (un ? snprintf(p, sizeof p, "%s." fmt, prefix) : snprintf(p, sizeof p, "params.decoder.%s." fmt, stack), p)
#define add(m, ...) add_layer(m, un, __VA_ARGS__)
    add(m, PATH("pre_self_attention_layer_norm.scale"), 2, (int64_t[]){E, n}, (const char *[]){"norm", stack},
        MODEL_INIT_ONES, 0);
    if (ds->mla.q_lora == 0) {
        add(m, PATH("self_attention.query.kernel"), 4, (int64_t[]){E, n, H, Dqk},
            (const char *[]){"embed_attn", stack, "q_heads", "kv"}, MODEL_INIT_NORMAL, fan_in(E));
    } else {
        add(m, PATH("self_attention.wq_a.kernel"), 3, (int64_t[]){E, n, ds->mla.q_lora},
            (const char *[]){"embed_attn", stack, "q_lora_up_proj"}, MODEL_INIT_NORMAL, fan_in(E));
        add(m, PATH("self_attention.q_norm.scale"), 2, (int64_t[]){ds->mla.q_lora, n}, (const char *[]){"norm", stack},
            MODEL_INIT_ONES, 0);
        add(m, PATH("self_attention.wq_b.kernel"), 4, (int64_t[]){ds->mla.q_lora, n, H, Dqk},
            (const char *[]){"q_lora", stack, "q_heads", "kv"}, MODEL_INIT_NORMAL, fan_in(ds->mla.q_lora));
    }
    add(m, PATH("self_attention.wkv_a.kernel"), 3, (int64_t[]){E, n, ds->mla.kv_lora + ds->mla.qk_rope},
        (const char *[]){"embed_attn", stack, "kv_lora_up_proj"}, MODEL_INIT_NORMAL, fan_in(E));
    add(m, PATH("self_attention.kv_norm.scale"), 2, (int64_t[]){ds->mla.kv_lora, n}, (const char *[]){"norm", stack},
        MODEL_INIT_ONES, 0);
    add(m, PATH("self_attention.wkv_b.kernel"), 4, (int64_t[]){ds->mla.kv_lora, n, H, ds->mla.qk_nope + ds->mla.v_head},
        (const char *[]){"kv_lora", stack, "kv_heads", "kv_head_dim"}, MODEL_INIT_NORMAL, fan_in(ds->mla.kv_lora));
    add(m, PATH("self_attention.out.kernel"), 4, (int64_t[]){H, n, ds->mla.v_head, E},
        (const char *[]){"heads", stack, "kv", "embed_attn"}, MODEL_INIT_NORMAL, fan_in(H * ds->mla.v_head));
    add(m, PATH("post_self_attention_layer_norm.scale"), 2, (int64_t[]){E, n}, (const char *[]){"norm", stack},
        MODEL_INIT_ONES, 0);
    if (!moe) {
        int64_t F = d->mlp;
        add(m, PATH("mlp.wi_0.kernel"), 3, (int64_t[]){E, n, F}, (const char *[]){"embed", stack, "mlp"},
            MODEL_INIT_TRUNC_NORMAL, fan_in(E));
        add(m, PATH("mlp.wi_1.kernel"), 3, (int64_t[]){E, n, F}, (const char *[]){"embed", stack, "mlp"},
            MODEL_INIT_TRUNC_NORMAL, fan_in(E));
        add(m, PATH("mlp.wo.kernel"), 3, (int64_t[]){F, n, E}, (const char *[]){"mlp", stack, "embed"},
            MODEL_INIT_TRUNC_NORMAL, fan_in(F));
        return;
    }
    int64_t X = ds->moe.experts, Hm = ds->moe.moe_mlp, Fs = ds->moe.shared_experts * ds->moe.moe_mlp;
    add(m, PATH("DeepSeekMoeBlock_0.MoeBlock_0.gate.kernel"), 3, (int64_t[]){E, n, X},
        (const char *[]){"embed_router", stack, NULL}, MODEL_INIT_TRUNC_NORMAL, fan_in(E));
    /* the DeepSeek-V3 bias's storage is the release's (maxtext_release's variables.gate_bias): 0.2.5's
     * MoEBiasVar, or 0.2.0's nnx.Param (its layers/moe.py GateLogit.__init__: trained like the kernels
     * and stacked like them, with optimizer state; its train_step writes the update into the parameters) */
    bool bias_var = !strcmp(cfg_release_variable(m->release, "gate_bias", "moe_bias_var"), "moe_bias_var");
    if (ds->moe.routed_bias && ds->moe.bias_selects_only && bias_var) {
        /* MaxText 0.2.5's GateLogit keeps the DeepSeek-V3 bias as a MoEBiasVar: not trained (no gradient,
         * no optimizer state; routed_bias_update_rate changes it), its layers stacked first */
        if (un) /* one layer (MTP): a plain [experts] vector */
            add_layer(m, false, PATH("DeepSeekMoeBlock_0.MoeBlock_0.gate.bias"), 1, (int64_t[]){X},
                      (const char *[]){NULL}, MODEL_INIT_ZEROS, 0);
        else {
            add(m, PATH("DeepSeekMoeBlock_0.MoeBlock_0.gate.bias"), 2, (int64_t[]){n, X}, (const char *[]){stack, NULL},
                MODEL_INIT_ZEROS, 0);
            m->defs[m->nparams - 1].scan_dim = 0;
        }
        m->defs[m->nparams - 1].state_var = true;
    } else if (ds->moe.routed_bias) { /* other model names (and 0.2.0): an nnx.Param, stacked like the kernels */
        add(m, PATH("DeepSeekMoeBlock_0.MoeBlock_0.gate.bias"), 2, (int64_t[]){X, n}, (const char *[]){NULL, stack},
            MODEL_INIT_ZEROS, 0);
    }
    /* shard_exp_on_fsdp: MaxText names the expert dim embed_moe and leaves the embedding dim unnamed */
    const char *const *wi = ds->moe.shard_exp_on_fsdp ? (const char *[]){"embed_moe", stack, NULL, "mlp_moe"}
                            : ds->batch_split         ? (const char *[]){"expert_only", stack, "embed_moe", NULL}
                                                      : (const char *[]){"exp", stack, "embed_moe", "mlp_moe"};
    const char *const *wo = ds->moe.shard_exp_on_fsdp ? (const char *[]){"embed_moe", stack, "mlp_moe", NULL}
                            : ds->batch_split         ? (const char *[]){"expert_only", stack, NULL, "embed_moe"}
                                                      : (const char *[]){"exp", stack, "mlp_moe", "embed_moe"};
    /* (with batch split, moe.py's get_batchsplit_init_kernel_axes; shard_exp_on_fsdp takes precedence there too) */
    add(m, PATH("DeepSeekMoeBlock_0.MoeBlock_0.wi_0"), 4, (int64_t[]){X, n, E, Hm}, wi, MODEL_INIT_TRUNC_NORMAL,
        fan_in(E));
    add(m, PATH("DeepSeekMoeBlock_0.MoeBlock_0.wi_1"), 4, (int64_t[]){X, n, E, Hm}, wi, MODEL_INIT_TRUNC_NORMAL,
        fan_in(E));
    add(m, PATH("DeepSeekMoeBlock_0.MoeBlock_0.wo"), 4, (int64_t[]){X, n, Hm, E}, wo, MODEL_INIT_TRUNC_NORMAL,
        fan_in(Hm));
    if (Fs > 0) {
        add(m, PATH("DeepSeekMoeBlock_0.shared_experts.wi_0.kernel"), 3, (int64_t[]){E, n, Fs},
            (const char *[]){"embed", stack, "mlp"}, MODEL_INIT_TRUNC_NORMAL, fan_in(E));
        add(m, PATH("DeepSeekMoeBlock_0.shared_experts.wi_1.kernel"), 3, (int64_t[]){E, n, Fs},
            (const char *[]){"embed", stack, "mlp"}, MODEL_INIT_TRUNC_NORMAL, fan_in(E));
        add(m, PATH("DeepSeekMoeBlock_0.shared_experts.wo.kernel"), 3, (int64_t[]){Fs, n, E},
            (const char *[]){"mlp", stack, "embed"}, MODEL_INIT_TRUNC_NORMAL, fan_in(Fs));
    }
#undef add
#undef PATH
}

static void define_stack(model_def *m, const char *stack, int64_t n, bool moe)
{
    define_layers(m, NULL, stack, n, moe);
}

/* MaxText's MultiTokenPredictionBlock: mtp_block.mtp_layer_<k> holds mtp_<k>_embedding_norm,
 * mtp_<k>_hidden_state_norm, mtp_<k>_projection (2 emb -> emb, ('embed', None)), the transformer
 * layer (the decoder's last layer type, unscanned) and mtp_<k>_final_norm. */
static void define_mtp(model_def *m)
{
    const model_dims *d = &m->d;
    const ds_dims *ds = deepseek_dims(m);
    int64_t E = d->emb;
    for (int k = 1; k <= ds->mtp_layers; k++) {
        char p[MODEL_PATH_MAX], tl[MODEL_PATH_MAX];
        snprintf(p, sizeof p, "params.mtp_block.mtp_layer_%d.mtp_%d_embedding_norm.scale", k, k);
        add(m, p, 1, (int64_t[]){E}, (const char *[]){"norm"}, MODEL_INIT_ONES, 0);
        snprintf(p, sizeof p, "params.mtp_block.mtp_layer_%d.mtp_%d_hidden_state_norm.scale", k, k);
        add(m, p, 1, (int64_t[]){E}, (const char *[]){"norm"}, MODEL_INIT_ONES, 0);
        snprintf(p, sizeof p, "params.mtp_block.mtp_layer_%d.mtp_%d_projection.kernel", k, k);
        add(m, p, 2, (int64_t[]){2 * E, E}, (const char *[]){"embed", NULL}, MODEL_INIT_TRUNC_NORMAL, fan_in(2 * E));
        snprintf(tl, sizeof tl, "params.mtp_block.mtp_layer_%d.mtp_%d_transformer_layer", k, k);
        define_layers(m, tl, NULL, 1, d->layers > ds->dense_layers);
        snprintf(p, sizeof p, "params.mtp_block.mtp_layer_%d.mtp_%d_final_norm.scale", k, k);
        add(m, p, 1, (int64_t[]){E}, (const char *[]){"norm"}, MODEL_INIT_ONES, 0);
    }
}

static sim_status deepseek_define(model_def *m, const cfg_config *cfg)
{
    const model_dims *d = &m->d;
    ds_dims *ds = calloc(1, sizeof *ds);
    SIM_ASSERT(ds);
    m->d.family_dims = ds; /* model_def_free (or the refused definition) frees it */
    SIM_TRY(read_dims(cfg, d, ds));
    int64_t V = d->vocab, E = d->emb, nd = ds->dense_layers, nm = d->layers - ds->dense_layers;
    add(m, "params.token_embedder.embedding", 2, (int64_t[]){V, E}, (const char *[]){"vocab", "embed_vocab"},
        MODEL_INIT_NORMAL, fan_in(E));
    if (nd > 0) define_stack(m, "dense_layers", nd, false);
    if (nm > 0) define_stack(m, "moe_layers", nm, true);
    add(m, "params.decoder.decoder_norm.scale", 1, (int64_t[]){E}, (const char *[]){"norm"}, MODEL_INIT_ONES, 0);
    if (!d->tied_logits)
        add(m, "params.decoder.logits_dense.kernel", 2, (int64_t[]){E, V}, (const char *[]){"embed_vocab", "vocab"},
            MODEL_INIT_TRUNC_NORMAL, fan_in(E));
    define_mtp(m);
    if (nm > 0) SIM_TRY(model_moe_check_mesh(m, cfg, &ds->moe));
    return SIM_OK;
}

/* ------------------------------------------------------------ parameter lookup */

typedef struct {
    int ln1, ln2;                       /* norms */
    model_mla_params mla;               /* attention */
    int wi0, wi1, wo;                   /* dense MLP or shared experts */
    int gate, gate_bias, ew0, ew1, ewo; /* routed experts */
} ds_stack;

/* The parameters of the layers under `s` (params.decoder.<stack> or an MTP transformer layer). */
static ds_stack stack_ix_at(const model_def *m, const char *s, bool moe)
{
    ds_stack x;
    x.ln1 = model_param_at(m, s, "pre_self_attention_layer_norm.scale");
    x.ln2 = model_param_at(m, s, "post_self_attention_layer_norm.scale");
    x.mla = model_mla_params_at(m, s);
    x.wi0 = model_param_at(m, s, moe ? "DeepSeekMoeBlock_0.shared_experts.wi_0.kernel" : "mlp.wi_0.kernel");
    x.wi1 = model_param_at(m, s, moe ? "DeepSeekMoeBlock_0.shared_experts.wi_1.kernel" : "mlp.wi_1.kernel");
    x.wo = model_param_at(m, s, moe ? "DeepSeekMoeBlock_0.shared_experts.wo.kernel" : "mlp.wo.kernel");
    x.gate = model_param_at(m, s, "DeepSeekMoeBlock_0.MoeBlock_0.gate.kernel");
    x.gate_bias = model_param_at(m, s, "DeepSeekMoeBlock_0.MoeBlock_0.gate.bias");
    x.ew0 = model_param_at(m, s, "DeepSeekMoeBlock_0.MoeBlock_0.wi_0");
    x.ew1 = model_param_at(m, s, "DeepSeekMoeBlock_0.MoeBlock_0.wi_1");
    x.ewo = model_param_at(m, s, "DeepSeekMoeBlock_0.MoeBlock_0.wo");
    return x;
}

static ds_stack stack_ix(const model_def *m, bool moe)
{
    return stack_ix_at(m, moe ? "params.decoder.moe_layers" : "params.decoder.dense_layers", moe);
}

static int global_ix(const model_def *m, const char *path)
{
    for (int i = 0; i < m->nparams; i++)
        if (!strcmp(m->defs[i].path, path)) return i;
    return -1;
}

/* A parameter of layer l as a tape leaf (its gradient sinks into p->g[l] when recording). */
static mesh_var *param(model_dev *md, mesh_tape *t, int i, int l) { return model_param_leaf(md, t, i, l); }

/* SwiGLU MLP (facts §5.5): dense layers and the shared experts, MaxText's MlpBlock with the
 * DeepSeek layer's intermediate_sharding (activation_norm_length) and out_sharding. */
static sim_status mlp(model_dev *md, mesh_tape *t, int wi0, int wi1, int wo, int l, mesh_var *x, mesh_var **y)
{
    model_mlp_block b = {.wi_0 = wi0, .wi_1 = wi1, .wi = -1, .wo = wo, .layer = l, .intermediate = MLP_WI, .out = A};
    return model_mlp(md, t, &b, x, y);
}

/* Routed experts plus shared experts (facts §5.6-5.7, §6): (B, T, E) -> (B, T, E),
 * and the layer's load-balance loss when load_balance_loss_weight > 0. */
static sim_status moe(model_dev *md, mesh_tape *t, const ds_stack *s, int l, mesh_var *x, const char *block,
                      mesh_var **y, mesh_var **lb)
{
    const model_def *m = md->def;
    const ds_dims *ds = deepseek_dims(m);
    char routed[192], shared[192];
    snprintf(routed, sizeof routed, "%s/MoeBlock_0", block);
    snprintf(shared, sizeof shared, "%s/shared_experts", block);
    /* MaxText: the mean over every MoE layer's loss, the MTP layers' included */
    model_moe_layer ml = {.dims = &ds->moe,
                          .gate = s->gate,
                          .gate_bias = s->gate_bias,
                          .wi0 = s->ew0,
                          .wi1 = s->ew1,
                          .wo = s->ewo,
                          .out = A,
                          .lb_layers = m->d.layers - ds->dense_layers + ds->mtp_layers};
    mesh_var *out;
    SIM_TRY(model_moe_routed(md, t, &ml, l, x, routed, &out, lb));
    if (s->wi0 >= 0) {
        md->ctx.layer = shared;
        mesh_var *sh;
        SIM_TRY(model_moe_shared_experts(md, t, s->wi0, s->wi1, s->wo, l, x, &sh));
        SIM_TRY(mesh_ad_add(t, out, sh, "routed_plus_shared", &out));
    }
    *y = out;
    return SIM_OK;
}

/* One decoder layer (facts §5.6) with the parameters s (index l of their stack), named `layer`. */
static sim_status ds_layer_at(model_dev *md, mesh_tape *t, const model_batch *b, const ds_stack *sp, int l, bool is_moe,
                              const char *layer, mesh_var *x, mesh_var **y, mesh_var **lb)
{
    const model_def *m = md->def;
    const model_dims *d = &m->d;
    const ds_stack s = *sp;
    char attn[160], ffn[160];
    const char *saved = md->ctx.layer;
    snprintf(attn, sizeof attn, "%s/self_attention", layer);
    snprintf(ffn, sizeof ffn, "%s/%s", layer, is_moe ? "DeepSeekMoeBlock_0" : "mlp");
    md->ctx.layer = layer;
    *lb = NULL;
    mesh_var *h, *lnx, *a, *hs, *f;
    SIM_TRY(model_shard_as(md, t, x, "deepseek/inputs", 3, A, &h));
    SIM_TRY(mesh_nn_rmsnorm(t, h, param(md, t, s.ln1, l), d->eps, "pre_self_attention_layer_norm", &lnx));
    SIM_TRY(model_shard_as(md, t, lnx, "deepseek/pre_attention_norm", 3, A, &lnx));
    md->ctx.layer = attn;
    SIM_TRY(model_mla(md, t, b, &deepseek_dims(m)->mla, &s.mla, l, lnx, &a));
    md->ctx.layer = layer;
    SIM_TRY(model_shard_as(md, t, a, "deepseek/attention_result", 3, A, &a));
    SIM_TRY(mesh_ad_add(t, h, a, "residual_attention", &h));
    SIM_TRY(mesh_nn_rmsnorm(t, h, param(md, t, s.ln2, l), d->eps, "post_self_attention_layer_norm", &hs));
    SIM_TRY(model_shard_as(md, t, hs, "deepseek/post_attention_norm", 3, A, &hs));
    if (is_moe) {
        SIM_TRY(moe(md, t, &s, l, hs, ffn, &f, lb));
    } else {
        md->ctx.layer = ffn;
        SIM_TRY(mlp(md, t, s.wi0, s.wi1, s.wo, l, hs, &f));
    }
    md->ctx.layer = layer;
    /* the layer's output, when remat recomputes the layer for its backward: nothing reads it (XLA drops
     * these ops from the recomputation; mesh_ctx.dead_outputs) */
    md->ctx.dead_outputs = md->recomputing;
    sim_status st = model_shard_as(md, t, f, is_moe ? "deepseek/mlp_lnx" : "deepseek/mlp", 3, A, &f);
    if (st == SIM_OK) st = mesh_ad_add(t, f, h, "residual_mlp", &h);
    if (st == SIM_OK) st = model_dropout(md, t, h, layer, &h); /* dropout_op */
    if (st == SIM_OK) st = model_shard_as(md, t, h, "deepseek/x", 3, A, y);
    md->ctx.dead_outputs = false;
    md->ctx.layer = saved;
    return st;
}

/* One decoder layer (global index gl). */
static sim_status ds_layer(model_dev *md, mesh_tape *t, const model_batch *b, int gl, mesh_var *x, mesh_var **y,
                           mesh_var **lb)
{
    const ds_dims *ds = deepseek_dims(md->def);
    bool is_moe = gl >= ds->dense_layers;
    int l = is_moe ? gl - (int)ds->dense_layers : gl;
    ds_stack s = stack_ix(md->def, is_moe);
    char layer[64];
    snprintf(layer, sizeof layer, "decoder/%s_%d", is_moe ? "moe_layers" : "dense_layers", l);
    return ds_layer_at(md, t, b, &s, l, is_moe, layer, x, y, lb);
}

/* A dense layer before the pipeline: MaxText runs it under logical_axis_rules_pp_act_as_dp. */
static sim_status ds_dense_pp_fn(model_dev *md, mesh_tape *t, const model_batch *b, int gl, mesh_var *x, mesh_var **y,
                                 mesh_var **lb)
{
    return model_layer_pp_as_dp(md, t, b, gl, x, ds_layer, y, lb);
}

/* ------------------------------------------------------------ multi-token prediction */

/* MaxText's roll_and_mask on token ids (mesh_ad_roll_tokens), refused over a sharded sequence. */
static sim_status roll_tokens(model_dev *md, mesh_tape *t, const mesh_array *src, int64_t k, const char *name,
                              const mesh_array **out)
{
    if (src->spec.n_axes[1]) {
        char sp[160];
        mesh_spec_format(&src->spec, md->ctx.mesh, sp, sizeof sp);
        return sim_err(SIM_ERR_INPUT,
                       "mtp_num_layers=%lld with the input tokens sharded %s: shifting the tokens across a sharded "
                       "sequence (MaxText's context-parallel ppermute) is not simulated; use meshes and rules that "
                       "keep the sequence whole (no context parallelism) with multi-token prediction",
                       (long long)deepseek_dims(md->def)->mtp_layers, sp);
    }
    return mesh_ad_roll_tokens(t, src, k, name, out);
}

/* maybe_shard_with_logical without debug_sharding: MaxText does not log these in its dump. */
static sim_status shard_unlogged(model_dev *md, mesh_tape *t, mesh_var *x, const char *name, int rank,
                                 const char *const *names, mesh_var **out)
{
    mesh_spec s;
    SIM_TRY(model_logical_spec(md->def, name, rank, names, &s));
    return mesh_ad_shard_as(t, x, &s, name, out);
}

/* params.mtp_block.mtp_layer_<k>.mtp_<k>_<what> as a tape leaf. */
static mesh_var *mtp_param(model_dev *md, mesh_tape *t, int k, const char *what)
{
    char name[MODEL_PATH_MAX];
    snprintf(name, sizeof name, "params.mtp_block.mtp_layer_%d.mtp_%d_%s", k, k, what);
    int ix = global_ix(md->def, name);
    SIM_ASSERT(ix >= 0);
    return param(md, t, ix, 0);
}

/* MaxText's MultiTokenPredictionBlock (layers/multi_token_prediction.py) on the main decoder's
 * last hidden state h (B, T, E), before decoder_norm.  For k = 1..K:
 *   e_k = embed(tokens shifted by k);  h_k = layer_k(W_k [norm(e_k) ; norm(h_{k-1})]);
 *   xent_k = cross-entropy of logits(final_norm_k(h_k)) on the targets shifted by k (no z-loss),
 *   counted where t < T - k.
 * loss = scale * sum_k sum xent_k / (sum_k B (T - k) + 1e-8), MaxText's calculate_mtp_loss; the
 * MTP layers' load-balance losses join the decoder's (lb). */
static sim_status mtp_loss(model_dev *md, mesh_tape *t, const model_batch *b, mesh_var *h, mesh_var *table,
                           mesh_var *logits_w, mesh_var **loss, mesh_var **lb)
{
    const model_def *m = md->def;
    const model_dims *d = &m->d;
    const ds_dims *ds = deepseek_dims(m);
    const int K = (int)ds->mtp_layers;
    const bool moe_layer = d->layers > ds->dense_layers;
    double weights = 0;
    for (int k = 1; k <= K; k++) weights += (double)b->tokens.shape[0] * (double)(b->tokens.shape[1] - k);
    const double scale = ds->mtp_scale / (weights + 1e-8);
    *loss = NULL;
    *lb = NULL;
    const mesh_array *tokens = &b->tokens, *targets = &b->targets;
    for (int k = 1; k <= K; k++) {
        char block[64], layer[128], name[MODEL_PATH_MAX];
        snprintf(block, sizeof block, "mtp_block/mtp_layer_%d", k);
        md->ctx.layer = block;
        SIM_TRY(roll_tokens(md, t, tokens, 1, "mtp/rolled_input_ids", &tokens));
        SIM_TRY(roll_tokens(md, t, targets, 1, "mtp/rolled_target_ids", &targets));
        /* the decoder's _apply_embedding on the shifted tokens */
        mesh_var *e, *en, *hn, *cat, *proj, *y, *ylb, *logits, *xent, *lk;
        SIM_TRY(mesh_nn_embed(t, table, tokens, "token_embedder", &e));
        if (md->ctx.mode == MESH_MODE_EXPLICIT) {
            mesh_spec es;
            SIM_TRY(model_logical_spec(m, "embed/out", 3, EMB_OUT, &es));
            SIM_TRY(mesh_ad_shard_as(t, e, &es, "embed/out", &e));
        }
        SIM_TRY(model_dropout(md, t, e, block, &e));
        SIM_TRY(shard_unlogged(md, t, e, "multi_token_prediction/target_token_embedding", 3, FINAL, &e));
#define MTP_PARAM(what) mtp_param(md, t, k, what)
        SIM_TRY(mesh_nn_rmsnorm(t, e, MTP_PARAM("embedding_norm.scale"), d->eps, "embedding_norm", &en));
        SIM_TRY(mesh_nn_rmsnorm(t, h, MTP_PARAM("hidden_state_norm.scale"), d->eps, "hidden_state_norm", &hn));
        if (md->ctx.mode == MESH_MODE_EXPLICIT) /* the embedding norm takes the hidden norm's sharding */
            SIM_TRY(mesh_ad_shard_as(t, en, &hn->val.spec, "multi_token_prediction/embedding_norm", &en));
        SIM_TRY(mesh_ad_concat_last(t, en, hn, "concatenate", &cat));
        SIM_TRY(mesh_ad_einsum(t, "btf,fe->bte", cat, MTP_PARAM("projection.kernel"), NULL, "projection", &proj));
        /* the transformer layer: the decoder's last layer type, unscanned, without remat */
        snprintf(name, sizeof name, "params.mtp_block.mtp_layer_%d.mtp_%d_transformer_layer", k, k);
        ds_stack st = stack_ix_at(m, name, moe_layer);
        snprintf(layer, sizeof layer, "%s/mtp_%d_transformer_layer", block, k);
        SIM_TRY(ds_layer_at(md, t, b, &st, 0, moe_layer, layer, proj, &y, &ylb));
        md->ctx.layer = block;
        if (ylb) {
            if (*lb) SIM_TRY(mesh_ad_add(t, *lb, ylb, "moe_lb_loss", lb));
            else *lb = ylb;
        }
        h = y;
        /* the dedicated final norm, then the shared output head without decoder_norm */
        SIM_TRY(mesh_nn_rmsnorm(t, y, MTP_PARAM("final_norm.scale"), d->eps, "final_norm", &y));
#undef MTP_PARAM
        SIM_TRY(shard_unlogged(md, t, y, "multi_token_prediction/normed_mtp_hidden_state", 3, FINAL, &y));
        SIM_TRY(model_dropout(md, t, y, "mtp/output_head", &y));
        SIM_TRY(model_logits(md, t, y, table, logits_w, &logits));
        SIM_TRY(model_shard_as(md, t, logits, "multi_token_prediction/mtp_logits", 3, LOGITS, &logits));
        model_note_activation_f32(md, "multi_token_prediction/mtp_logits"); /* cast_logits_to_fp32 */
        SIM_TRY(mesh_nn_xent(t, logits, targets, 0.0, "cross_entropy", &xent));
        SIM_TRY(model_shard_as(md, t, xent, "multi_token_prediction/mtp_xent", 2, LOSS, &xent));
        model_note_activation_f32(md, "multi_token_prediction/mtp_xent");
        SIM_TRY(mesh_ad_masked_sum(t, xent, k, scale, "mtp_loss", &lk));
        if (*loss) SIM_TRY(mesh_ad_add(t, *loss, lk, "mtp_loss_sum", loss));
        else *loss = lk;
    }
    return SIM_OK;
}

/* ------------------------------------------------------------ the whole model */

static sim_status deepseek_loss(model_dev *md, mesh_tape *t, const model_batch *b, mesh_var **loss)
{
    const model_def *m = md->def;
    int embed = global_ix(m, "params.token_embedder.embedding"),
        norm = global_ix(m, "params.decoder.decoder_norm.scale"),
        logits_ix = global_ix(m, "params.decoder.logits_dense.kernel");
    md->ctx.layer = "decoder";
    mesh_var *x, *logits, *tok_loss, *lb_sum = NULL, *table = param(md, t, embed, 0);
    SIM_TRY(mesh_nn_embed(t, table, &b->tokens, "token_embedder", &x));
    if (md->ctx.mode == MESH_MODE_EXPLICIT) { /* Embed's out_sharding */
        mesh_spec es;
        SIM_TRY(model_logical_spec(m, "embed/out", 3, EMB_OUT, &es));
        SIM_TRY(mesh_ad_shard_as(t, x, &es, "embed/out", &x));
    }
    SIM_TRY(model_dropout(md, t, x, "decoder/embedding", &x)); /* no dropout with a pipeline (refused) */
    /* with a pipeline: the dense layers run first with 'stage' acting as data, the MoE layers as the pipeline */
    const bool pp = m->d.pipe.on;
    const int n_before = pp ? (int)deepseek_dims(m)->dense_layers : m->d.layers;
    /* two stacks (the dense layers, the MoE layers), each bounded in a dry run (model_layers_bounded) */
    const int n_dense = (int)deepseek_dims(m)->dense_layers < n_before ? (int)deepseek_dims(m)->dense_layers : n_before;
    mesh_tape_mark mark;
    for (int l = 0; l < n_before; l++) {
        /* the batch-split MoE layers are simulated in full: their schedule is not one layer after another
         * alike (a bounded run of them differs from the full one) */
        const bool whole = l >= n_dense && deepseek_dims(m)->batch_split;
        const int first = whole ? l : l < n_dense ? 0 : n_dense, end = whole ? l : l < n_dense ? n_dense : n_before;
        model_layer_repeat_begin(md, t, first, end, l, &mark);
        mesh_var *lb, *in = x;
        if (pp && m->d.remat_full) {
            char tag[64];
            snprintf(tag, sizeof tag, "decoder/dense_layers_%d/remat", l);
            SIM_TRY(model_remat_layer(md, t, b, l, x, ds_dense_pp_fn, tag, &x, &lb));
        } else if (pp) {
            SIM_TRY(ds_dense_pp_fn(md, t, b, l, x, &x, &lb));
        } else if (deepseek_dims(m)->batch_split && l >= (int)deepseek_dims(m)->dense_layers) {
            /* the MoE layers' own schedule (batchsplit.c); like MaxText's custom VJP it recomputes the
             * layer in backward whatever remat_policy says */
            char tag[64];
            snprintf(tag, sizeof tag, "decoder/moe_layers_%d/remat", l - (int)deepseek_dims(m)->dense_layers);
            SIM_TRY(model_remat_layer(md, t, b, l, x, batchsplit_layer, tag, &x, &lb));
        } else if (m->d.remat_full) {
            char tag[64];
            bool is_moe = l >= (int)deepseek_dims(md->def)->dense_layers;
            snprintf(tag, sizeof tag, "decoder/%s_%d/remat", is_moe ? "moe_layers" : "dense_layers",
                     is_moe ? l - (int)deepseek_dims(md->def)->dense_layers : l);
            SIM_TRY(model_remat_layer(md, t, b, l, x, ds_layer, tag, &x, &lb));
        } else {
            SIM_TRY(ds_layer(md, t, b, l, x, &x, &lb));
        }
        /* MaxText scans each stack of layers (scan_layers): the carry's type may not change across a
         * layer (tensor_sequence shards the output's length; measured with 0.2.0, whose first error
         * this is, rows D11 and D12 of tests/data/maxtext-0.2.0/verdicts) */
        if (l == 0 && m->d.scan_layers && !pp)
            SIM_TRY(mesh_scan_carry_check(&md->ctx, &in->val, &x->val, "dense_layers",
                                          cfg_release_error(md->ctx.release, "decoder_scan_carry",
                                                            "layers/nnx_decoders.py:_apply_layers_sequentially")));
        if (lb) {
            md->ctx.layer = "loss";
            if (lb_sum) SIM_TRY(mesh_ad_add(t, lb_sum, lb, "moe_lb_loss", &lb_sum));
            else lb_sum = lb;
        }
        SIM_TRY(model_layer_repeat_end(md, t, first, end, &l, &mark));
    }
    if (pp) SIM_TRY(model_pipeline_run(md, t, b, x, ds_layer, deepseek_dims(m)->dense_layers, &x));
    mesh_var *hidden = x; /* the last layer's output, before decoder_norm: MTP's first input */
    md->ctx.layer = "decoder";
    SIM_TRY(mesh_nn_rmsnorm(t, x, param(md, t, norm, 0), m->d.eps, "decoder_norm", &x));
    if (md->ctx.mode == MESH_MODE_EXPLICIT) {
        mesh_spec fs;
        SIM_TRY(model_logical_spec(m, "decoder/norm_out", 3, FINAL, &fs));
        SIM_TRY(mesh_ad_shard_as(t, x, &fs, "decoder/norm_out", &x));
    }
    SIM_TRY(model_dropout(md, t, x, "decoder/output_head", &x));
    SIM_TRY(model_logits(md, t, x, table, logits_ix >= 0 ? param(md, t, logits_ix, 0) : NULL, &logits));
    SIM_TRY(mesh_nn_xent(t, logits, &b->targets, m->d.z_loss, "cross_entropy", &tok_loss));
    /* MaxText 0.2.5 reshards the per-token loss; loss_constraint=assert gives the raw constraint it used before PR #4208 */
    SIM_TRY(model_loss_constraint(md, t, tok_loss, false, &tok_loss));
    md->ctx.layer = "loss";
    SIM_TRY(mesh_nn_mean(t, tok_loss, "mean", loss));
    if (deepseek_dims(m)->mtp_layers > 0) { /* train.py: the MTP loss joins the loss before the load-balance loss */
        mesh_var *mtp, *mtp_lb;
        SIM_TRY(mtp_loss(md, t, b, hidden, table, logits_ix >= 0 ? param(md, t, logits_ix, 0) : NULL, &mtp, &mtp_lb));
        if (mtp->val.data) md->mtp_loss = ((const float *)mtp->val.data)[0]; /* learning/mtp_loss */
        md->ctx.layer = "loss";
        SIM_TRY(mesh_ad_add(t, *loss, mtp, "plus_mtp_loss", loss));
        if (mtp_lb) {
            if (lb_sum) SIM_TRY(mesh_ad_add(t, lb_sum, mtp_lb, "moe_lb_loss", &lb_sum));
            else lb_sum = mtp_lb;
        }
    }
    if (lb_sum) SIM_TRY(mesh_ad_add(t, *loss, lb_sum, "plus_moe_lb_loss", loss));
    return SIM_OK;
}

/* ------------------------------------------------------------ loss-free balancing */

/* Whether the model updates its MoEBiasVar gate bias after each step (routed_bias_update_rate > 0). */
static bool bias_active(const model_def *m)
{
    const model_dims *d = &m->d;
    const ds_dims *ds = deepseek_dims(m);
    return ds->moe.routed_bias && ds->moe.bias_selects_only && ds->moe.bias_update_rate > 0 &&
           d->layers > ds->dense_layers;
}

/* The loss-free balancing update of the gate bias after a step (MaxText's train_step does it after
 * apply_gradients), from md->bias_counts_step; every device updates its replica alike. */
static void bias_update(model_dev *md)
{
    const model_def *m = md->def;
    if (!md->bias_counts_step) return;
    int i = global_ix(m, "params.decoder.moe_layers.DeepSeekMoeBlock_0.MoeBlock_0.gate.bias");
    SIM_ASSERT(i >= 0);
    model_param *p = &md->p[i];
    for (int l = 0; l < p->n_layers; l++)
        if (p->w[l].data) /* replicated: every device holds the whole [E] of layer l (none in a dry run) */
            model_moe_bias_update(p->w[l].data, md->bias_counts_step + (int64_t)l * deepseek_dims(m)->moe.experts,
                                  deepseek_dims(m)->moe.experts, deepseek_dims(m)->moe.bias_update_rate);
}

/* ------------------------------------------------------------ the family row */

/* The dense layers run before the pipeline; the MoE layers are the pipelined stack. */
static int64_t layers_before_pipeline(const model_def *m) { return deepseek_dims(m)->dense_layers; }

/* MaxText's DeepSeek depth: base_num_decoder_layers in all, the first first_num_dense_layers dense. */
static int depth_words(int64_t first, int64_t rest, char (*words)[MODEL_WORD_MAX], int cap)
{
    if (cap < 2) return 0;
    snprintf(words[0], MODEL_WORD_MAX, "base_num_decoder_layers=%lld", (long long)(first + rest));
    snprintf(words[1], MODEL_WORD_MAX, "first_num_dense_layers=%lld", (long long)first);
    return 2;
}

static bool param_pipelined(const model_def *m, const model_param_def *pd)
{
    return strstr(pd->path, ".moe_layers.") != NULL;
}

static sim_status pipeline_check(model_def *m, const cfg_config *cfg)
{
    const model_dims *d = &m->d;
    const ds_dims *ds = deepseek_dims(m);
    /* MaxText 0.2.5's pipeline splits the stage's variables into parameters, intermediates and a catch-all
     * that may hold only RNG state (layers/pipeline.py, the assert after nnx.split); a MoEBiasVar gate bias
     * lands in the catch-all, so every pipeline of these models stops there.  In explicit mode with YaRN the
     * dense layer before the pipeline fails first (the trace-time error of ds_yarn_check, as in MaxText).
     * 0.2.0 keeps the bias an nnx.Param (layers/moe.py GateLogit), so it has no such stop (maxtext_release) */
    bool yarn_first = d->mode == MESH_MODE_EXPLICIT && ds->mla.yarn &&
                      cfg_release_error(m->release, "yarn_freqs_broadcast", "layers/embeddings.py:__call__");
    if (ds->moe.routed_bias && ds->moe.bias_selects_only && !yarn_first &&
        cfg_release_refusal(m->release, "pipeline_moe_bias_var"))
        return model_cfg_unsupported(cfg, "routed_bias",
                                     "MaxText 0.2.5 stops every pipeline whose MoE layers carry this model's "
                                     "MoEBiasVar gate bias (AssertionError: Non-RngState variable found in "
                                     "layers_mutables catch-all partition, layers/pipeline.py); use routed_bias=false "
                                     "with a pipeline, or ici/dcn_pipeline_parallelism=1");
    if (d->layers - ds->dense_layers < 1)
        return sim_err(SIM_ERR_INPUT,
                       "ici_pipeline_parallelism=%lld with first_num_dense_layers=%lld = base_num_decoder_layers: "
                       "DeepSeek pipelines its MoE layers and there are none; add MoE layers or set "
                       "ici_pipeline_parallelism=1",
                       (long long)d->pipe.stages, (long long)ds->dense_layers);
    if (ds->moe.lb_weight > 0)
        return sim_err(SIM_ERR_INPUT,
                       "load_balance_loss_weight=%g with pipeline parallelism: collecting the MoE load-balance loss "
                       "from the pipeline iterations is not implemented yet; set load_balance_loss_weight=0",
                       ds->moe.lb_weight);
    return SIM_OK;
}

static const char *pipeline_unsimulated(const model_def *m)
{
    return bias_active(m) ? "routed_bias_update_rate > 0" : NULL;
}

/* The gate bias update's statistics: E expert counts per MoE layer (MaxText: int32). */
static size_t step_counts(const model_def *m)
{
    const ds_dims *ds = deepseek_dims(m);
    return bias_active(m) ? (size_t)((m->d.layers - ds->dense_layers) * ds->moe.experts) : 0;
}

static int64_t mtp_layers(const model_def *m) { return deepseek_dims(m)->mtp_layers; }

/* MaxText's decoder_block deepseek (DeepSeek-V2/V3, Kimi-K2 model files). */
/* 0.2.0's sparse MoE returns its expert kernels' gradients from its shard_map with its in_specs
 * (maxtext_release's grad_logical_names); the dense path and a pipeline's MoE keep the kernels' own. */
static int grad_names(const model_def *m, int i, const char **names, int cap)
{
    const ds_dims *ds = deepseek_dims(m);
    if (ds->moe.capacity_factor >= 0 || m->d.pipe.on) return 0;
    int n = cfg_release_grad_names(m->release, m->defs[i].path, names, cap);
    return n == m->defs[i].rank ? n : 0;
}

const model_family model_family_deepseek = {
    .name = "deepseek",
    .define = deepseek_define,
    .setup = batchsplit_setup,
    .loss = deepseek_loss,
    .layers_before_pipeline = layers_before_pipeline,
    .depth_words = depth_words,
    .pipeline_check = pipeline_check,
    .param_pipelined = param_pipelined,
    .pipeline_unsimulated = pipeline_unsimulated,
    .step_counts = step_counts,
    .after_step = bias_update,
    .mtp_layers = mtp_layers,
    .dev_free = batchsplit_dev_free,
    .grad_names = grad_names,
};
