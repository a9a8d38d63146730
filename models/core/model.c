/* model.c — model definition from the config, per-device parameters and
 * batches, and the logical-name helpers the forward pass uses. */
#include "models/core/model.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "blas_kernels/bk_parallel.h"
#include "config/release.h"
#include "mesh/ad.h"
#include "mesh/nn.h"
#include "mesh/reshard.h"
#include "models/core/init.h"
#include "models/core/timemodel.h"
#include "sim/devlocal.h"

/* ------------------------------------------------------------ definition */

sim_status model_cfg_i64(const cfg_config *cfg, const char *key, int64_t *out)
{
    long long x;
    SIM_TRY(cfg_get_int(cfg, key, &x));
    *out = x;
    return SIM_OK;
}

sim_status model_cfg_bool(const cfg_config *cfg, const char *key, bool *out)
{
    int x;
    SIM_TRY(cfg_get_bool(cfg, key, &x));
    *out = x != 0;
    return SIM_OK;
}

int model_depth_words(const model_family *f, int64_t first, int64_t rest, char (*words)[MODEL_WORD_MAX], int cap)
{
    if (f->depth_words) return f->depth_words(first, rest, words, cap);
    if (cap < 1) return 0;
    snprintf(words[0], MODEL_WORD_MAX, "base_num_decoder_layers=%lld", (long long)(first + rest));
    return 1;
}

sim_status model_cfg_unsupported(const cfg_config *cfg, const char *key, const char *why)
{
    const cfg_entry *en = cfg_find(cfg, key);
    return sim_err(SIM_ERR_INPUT, "%s=%s (%s): %s", key, en && en->value.text ? en->value.text : "?",
                   en ? en->where : "", why);
}

/* The keys gpt-oss's model files set and shardsim simulates with decoder_block=gpt_oss only.  MaxText
 * reads attention_sink in every Attention and mlp_bias in every RoutedMoE (and clips DeepSeek V4's
 * activations by mlp_activations_limit), none of which the other simulated blocks run: refused
 * there, naming the key. */
static sim_status gptoss_keys_elsewhere(const cfg_config *cfg, const char *block)
{
    if (!strcmp(block, "gpt_oss")) return SIM_OK;
    static const char *const bools[3] = {"attention_bias", "attention_sink", "mlp_bias"};
    char why[256];
    for (int i = 0; i < 3; i++) {
        bool on;
        SIM_TRY(model_cfg_bool(cfg, bools[i], &on));
        snprintf(why, sizeof why, "%s is simulated with decoder_block=gpt_oss only, not with %s; use %s=false",
                 bools[i], block, bools[i]);
        if (on) return model_cfg_unsupported(cfg, bools[i], why);
    }
    int64_t cycle;
    SIM_TRY(model_cfg_i64(cfg, "inhomogeneous_layer_cycle_interval", &cycle));
    snprintf(why, sizeof why,
             "a scanned block of several layers is simulated with decoder_block=gpt_oss only, not with %s; use "
             "inhomogeneous_layer_cycle_interval=1",
             block);
    if (cycle != 1) return model_cfg_unsupported(cfg, "inhomogeneous_layer_cycle_interval", why);
    double lim;
    SIM_TRY(cfg_get_double(cfg, "mlp_activations_limit", &lim));
    snprintf(why, sizeof why,
             "the clipped activations are simulated with decoder_block=gpt_oss only, not with %s; use "
             "mlp_activations_limit=-1",
             block);
    if (lim > 0) return model_cfg_unsupported(cfg, "mlp_activations_limit", why);
    const char **acts;
    int n;
    SIM_TRY(cfg_get_str_list(cfg, "mlp_activations", &acts, &n));
    /* keys.yml lets [silu, linear], [gelu, linear] and [sigmoid, linear] through; the dense MLP runs
     * the first two (model_mlp), the third is gpt_oss's alone */
    bool clamped = n == 2 && !strcmp(acts[0], "sigmoid") && !strcmp(acts[1], "linear");
    free(acts);
    snprintf(why, sizeof why,
             "mlp_activations=[sigmoid, linear] is gpt_oss's clamped GLU, simulated with decoder_block=gpt_oss only; "
             "%s runs SwiGLU or GeGLU: use mlp_activations=[silu, linear]",
             block);
    if (clamped) return model_cfg_unsupported(cfg, "mlp_activations", why);
    return SIM_OK;
}

static sim_status positive(const char *key, int64_t v)
{
    if (v < 1) return sim_err(SIM_ERR_INPUT, "%s=%lld: must be at least 1", key, (long long)v);
    return SIM_OK;
}

/* MaxText 0.2.5's kernel choice (AttentionOp.apply_attention, training): dot_product, or autoselected
 * when the sequence is shorter than 128 tokens or the hardware is a CPU, takes the dot-product path
 * (the whole score matrix); flash and the remaining autoselected cases take the flash kernel, which
 * the simulator's blocked online-softmax kernel stands for.  MaxText runs flash on TPU (splash) and
 * GPU (Pallas Triton); on CPU its flash path is the GPU kernel and fails, so it is refused here. */
static sim_status attention_kernel(const cfg_config *cfg, model_dims *d)
{
    static const char *const hw[] = {"tpu", "gpu", "gpu_multiprocess", "cpu"};
    static const char *const kernels[] = {"autoselected", "dot_product", "flash"};
    int h, k;
    SIM_TRY(cfg_get_enum(cfg, "hardware", hw, 4, &h));
    const char *a;
    SIM_TRY(cfg_get_str(cfg, "attention", &a));
    k = -1;
    for (int i = 0; a && i < 3; i++)
        if (!strcmp(a, kernels[i])) k = i;
    if (k < 0)
        return sim_err(SIM_ERR_INPUT,
                       "attention='%s': the simulator models MaxText's autoselected, dot_product and flash "
                       "kernels only (cudnn_flash_te, paged, vllm_rpa ... are GPU/inference kernels); use "
                       "attention=autoselected, dot_product or flash",
                       a ? a : "");
    if (k == 2 && h == 3)
        return sim_err(SIM_ERR_INPUT,
                       "attention=flash with hardware=cpu: MaxText 0.2.5 has no flash kernel for CPU (its non-TPU "
                       "flash path is the GPU Pallas Triton kernel, which does not run there); use "
                       "attention=dot_product (or autoselected) on hardware=cpu, or hardware=tpu for flash");
    d->attn_dot = k == 1 || (k == 0 && (d->seq < 128 || h == 3));
    /* flash on TPU is the splash kernel (attention_op.py tpu_flash_attention): its blocks and backward
     * kernels set what the step-time model costs (tokamax's splash has the fused backward only) */
    memset(&d->splash, 0, sizeof d->splash);
    if (!d->attn_dot && h == 0) {
        static const char *const keys[] = {"sa_block_q",      "sa_block_kv",   "sa_block_q_dkv",
                                           "sa_block_kv_dkv", "sa_block_q_dq", "sa_block_kv_dq"};
        int64_t *dst[] = {&d->splash.q,      &d->splash.kv,   &d->splash.q_dkv,
                          &d->splash.kv_dkv, &d->splash.q_dq, &d->splash.kv_dq};
        for (int i = 0; i < 6; i++) {
            SIM_TRY(model_cfg_i64(cfg, keys[i], dst[i]));
            if (*dst[i] <= 0)
                return sim_err(SIM_ERR_INPUT,
                               "%s=%lld: expected a block size > 0; set a positive size (MaxText's default is 512)",
                               keys[i], (long long)*dst[i]);
        }
        bool fused, tokamax;
        SIM_TRY(model_cfg_bool(cfg, "sa_use_fused_bwd_kernel", &fused));
        SIM_TRY(model_cfg_bool(cfg, "use_tokamax_splash", &tokamax));
        d->splash.fused_bwd = fused || tokamax;
    }
    return SIM_OK;
}

/* gradient_accumulation_steps and shard_optimizer_over_data, with the
 * combinations MaxText's config validation (configs/types.py) refuses. */
static sim_status zero1_and_ga_from_config(const cfg_config *cfg, model_def *m)
{
    model_dims *d = &m->d;
    SIM_TRY(model_cfg_i64(cfg, "gradient_accumulation_steps", &d->ga));
    if (d->ga < 1)
        return sim_err(SIM_ERR_INPUT,
                       "gradient_accumulation_steps=%lld: it must be a positive number of microbatches per step "
                       "(1 = no accumulation)",
                       (long long)d->ga);
    /* A dry run simulates the first two microbatches of its one step and accounts the others as
     * repeats of the second (models/core/train.c), but the step-time model still times every one in
     * turn (its clocks are doubles: the same bits as a full run take the same additions) and
     * collectives.csv lists every call, so the count stays bounded. */
    if (d->dry_run && d->ga > MODEL_DRY_RUN_MAX_GA)
        return sim_err(SIM_ERR_INPUT,
                       "gradient_accumulation_steps=%lld with dry_run=true: a dry run is limited to %d microbatches "
                       "(its step-time estimate and collectives.csv go through each one); the traffic grows "
                       "linearly with the count and the peak memory is that of 2 microbatches, so dry-run %d or "
                       "fewer and scale",
                       (long long)d->ga, MODEL_DRY_RUN_MAX_GA, MODEL_DRY_RUN_MAX_GA);
    SIM_TRY(model_cfg_bool(cfg, "shard_optimizer_over_data", &d->zero1));
    if (!d->zero1) return SIM_OK;
    int f = mesh_shape_axis_index(&m->mesh, "fsdp"), ft = mesh_shape_axis_index(&m->mesh, "fsdp_transpose");
    int fsdp = (f >= 0 ? m->mesh.sizes[f] : 1) * (ft >= 0 ? m->mesh.sizes[ft] : 1);
    /* 0.2.5's types.py refuses it (the gradients sharded P('fsdp') are added to moments sharded
     * P(('data','fsdp')): a type error in explicit mode); 0.2.0's accepts it (maxtext_release) */
    const char *refuser = cfg_release_refusal(m->release, "zero1_with_fsdp");
    if (fsdp > 1 && refuser)
        return sim_err(SIM_ERR_INPUT,
                       "shard_optimizer_over_data=true (ZeRO-1) cannot be combined with FSDP: the fsdp and "
                       "fsdp_transpose mesh axes have a combined size of %d (MaxText %s refuses this too: %s). Set "
                       "ici_fsdp_parallelism and ici_fsdp_transpose_parallelism (and their dcn_ counterparts) to 1, "
                       "or set shard_optimizer_over_data=false",
                       fsdp, cfg_release_maxtext(m->release), refuser);
    SIM_TRY(model_opt_zero1_check(cfg)); /* MaxText's validate_optimizer_sharding_over_data */
    return SIM_OK;
}

void model_add_param(model_def *m, const char *path, int rank, const int64_t *shape, const char *const *logical,
                     int scan_dim, model_init_kind init, double scale)
{
    SIM_ASSERT(m->nparams < MODEL_MAX_PARAMS);
    model_param_def *d = &m->defs[m->nparams++];
    memset(d, 0, sizeof *d);
    snprintf(d->path, sizeof d->path, "%s", path);
    d->rank = rank;
    for (int i = 0; i < rank; i++) {
        d->shape[i] = shape[i];
        d->logical[i] = logical[i];
    }
    d->scan_dim = scan_dim;
    d->init = init;
    d->scale = scale;
}

/* MaxText's get_individual_scales: global_parameter_scale = 2^k multiplies heads and MLP widths by
 * 2^(k/3 + (k%3 > 0)), the embedding by 2^(k/3 + (k%3 > 1)) and the layers by 2^(k/3). */
static sim_status parameter_scale(const cfg_config *cfg, model_dims *d)
{
    long long s;
    SIM_TRY(cfg_get_int(cfg, "global_parameter_scale", &s));
    if (s < 1 || (s & (s - 1)))
        return sim_err(SIM_ERR_INPUT,
                       "global_parameter_scale=%lld: must be a power of two (1, 2, 4, ...); for finer control set "
                       "base_emb_dim, base_num_query_heads, base_num_kv_heads, base_mlp_dim and "
                       "base_num_decoder_layers directly",
                       s);
    int k = 0;
    while ((1LL << k) < s) k++;
    int base = k / 3, rem = k % 3;
    int head = base + (rem > 0), emb = base + (rem > 1);
    if (k > 30) return sim_err(SIM_ERR_INPUT, "global_parameter_scale=%lld is too large", s);
    d->q_heads <<= head;
    d->kv_heads <<= head;
    d->mlp <<= head;
    d->emb <<= emb;
    d->layers <<= base;
    d->param_scale_mlp = 1LL << head;
    return SIM_OK;
}

/* ------------------------------------------------------------ remat policies */

static const char *const CKPT_NAMES[MODEL_CKPT_N] = {
    "query_proj",
    "key_proj",
    "value_proj",
    "kv_proj",
    "qkv_proj",
    "out_proj",
    "mlpwi",
    "mlpwi_0",
    "mlpwi_1",
    "mlpwo",
    "context",
    "attention_out",
    "query_wa_proj",
    "kv_wa_proj",
    "mla_q",
    "mla_kv",
    "decoder_layer_input",
    "moe_mlpwi_0",
    "moe_mlpwi_1",
    "moe_mlpwo",
    "moe_x_sorted",
    "moe_routing_maps",
    "indexer_cutoff_threshold",
    "engram",
};

const char *model_ckpt_name_str(model_ckpt_name n) { return n >= 0 && n < MODEL_CKPT_N ? CKPT_NAMES[n] : "?"; }

/* MaxText's policies (layers/nnx_decoders.py get_remat_policy and minimal_policy): the names each
 * saves on the device (save_only_these_names) or offloads to host (save_and_offload_only_these_
 * names).  "quantization" (the *_with_quantization variants) tags nothing without quantization. */
#define B(n) (1u << MODEL_CKPT_##n)
#define QKV (B(QUERY_PROJ) | B(VALUE_PROJ) | B(KEY_PROJ) | B(KV_PROJ) | B(QKV_PROJ))
#define MINIMAL (QKV | B(OUT_PROJ) | B(MLPWI_0) | B(MLPWI_1) | B(MLPWI) | B(MLPWO))
static const struct {
    const char *name;
    uint32_t device, offload;
} POLICIES[] = {
    {"full", 0, 0},
    {"minimal", MINIMAL, 0},
    {"minimal_with_quantization", MINIMAL, 0},
    {"minimal_with_context", MINIMAL | B(CONTEXT), 0},
    {"minimal_flash", MINIMAL | B(CONTEXT), 0},
    {"minimal_with_context_and_quantization", MINIMAL | B(CONTEXT), 0},
    {"save_dot_with_context_except_mlp", QKV | B(CONTEXT) | B(OUT_PROJ), 0},
    {"save_dot_except_mlpwi", QKV | B(OUT_PROJ) | B(MLPWO), 0},
    {"save_dot_except_mlp", QKV | B(OUT_PROJ), 0},
    {"save_qkv_proj", QKV, 0},
    {"qkv_proj_offloaded", 0, B(QUERY_PROJ) | B(VALUE_PROJ) | B(KEY_PROJ) | B(KV_PROJ)},
    {"minimal_offloaded", 0, MINIMAL},
    {"save_out_proj", B(OUT_PROJ), 0},
};
#undef QKV
#undef MINIMAL
#undef B

/* The dtypes bytes are counted in (numerics stay float32).  MaxText 0.2.5:
 * parameters are created in weight_dtype and DenseGeneral casts each kernel
 * to `dtype` right before its dot (layers/linears.py); where that cast lands
 * is the compiler's: XLA:CPU gathers and reduces weight_dtype (its compiled
 * step with dtype=bfloat16 on fsdp=4 gathers f32 at convert_element_type and
 * all-reduces the f32 gradients), XLA:TPU casts first and moves `dtype` -- the
 * hardware profile's rule (model_hw_wire_dtypes; weight_dtype without one);
 * activations and their collectives are in `dtype`; optax's Adam moments take
 * the parameters' dtype (mu_dtype "" = weight_dtype). */
static sim_status counted_dtypes_from_config(const cfg_config *cfg, model_dims *d)
{
    static const char *const names[] = {"float32", "bfloat16"};
    static const sim_dtype dts[] = {SIM_F32, SIM_BF16};
    const char *keys[2] = {"dtype", "weight_dtype"};
    sim_dtype *out[2] = {&d->act_dtype, &d->weight_dtype};
    for (int k = 0; k < 2; k++) {
        int ix;
        SIM_TRY(cfg_get_enum(cfg, keys[k], names, 2, &ix));
        *out[k] = dts[ix];
    }
    /* where the compiler of the selected hardware profile moves MaxText's cast (configs/hardware/) */
    SIM_TRY(model_hw_wire_dtypes(cfg, d->act_dtype, d->weight_dtype, &d->gather_dtype, &d->reduce_dtype, d->wire_rule,
                                 sizeof d->wire_rule));
    SIM_TRY(model_hw_xla_rules(cfg, d->act_dtype, d->weight_dtype, &d->xla));
    SIM_TRY(model_cfg_bool(cfg, "logits_dot_in_fp32", &d->logits_dot_fp32));
    SIM_TRY(model_cfg_bool(cfg, "cast_logits_to_fp32", &d->logits_cast_fp32));
    return SIM_OK;
}

static sim_status remat_policy_from_config(const cfg_config *cfg, model_dims *d)
{
    const char *p;
    SIM_TRY(cfg_get_str(cfg, "remat_policy", &p));
    /* the YAML reader takes "none" for a null: read the text as written */
    const cfg_entry *en = cfg_find(cfg, "remat_policy");
    if (!p && en && en->value.kind == CFG_SCALAR && en->value.text) p = en->value.text;
    if (!p) return sim_err(SIM_ERR_INPUT, "remat_policy is empty: use full, none or one of MaxText's policies");
    snprintf(d->remat_policy, sizeof d->remat_policy, "%s", p);
    memset(d->ckpt, 0, sizeof d->ckpt);
    /* remat_policy=none rematerialises the decoder layers as full does unless MaxText calls them
     * without a checkpoint (config/release.h cfg_release_remat_none_keeps: only unscanned layers in
     * 0.2.5; the pipeline's stage layers are wrapped like the scanned stack) */
    bool none_keeps;
    SIM_TRY(cfg_release_remat_none_keeps(cfg, &none_keeps));
    d->remat_full = strcmp(p, "none") != 0 || !none_keeps;
    if (d->remat_full && !strcmp(p, "none")) p = "full";
    static const char *const modes[] = {"auto", "always", "never"};
    int rc;
    SIM_TRY(cfg_get_enum(cfg, "remat_recompute", modes, 3, &rc));
    d->remat_recompute = (model_remat_recompute)rc;
    d->remat_replay = d->remat_full && d->remat_recompute != MODEL_RECOMPUTE_ALWAYS;
    if (!d->remat_full) return SIM_OK;
    if (!strcmp(p, "custom")) {
        /* the per-tensor keys (base.yml: remat | device | offload) */
        static const char *const acts[] = {"remat", "device", "offload"};
        for (int n = 0; n < MODEL_CKPT_N; n++) {
            int a;
            SIM_TRY(cfg_get_enum(cfg, CKPT_NAMES[n], acts, 3, &a));
            d->ckpt[n] = (uint8_t)a;
        }
        if (d->ckpt[MODEL_CKPT_DECODER_LAYER_INPUT] == MODEL_CKPT_OFFLOAD)
            return sim_err(SIM_ERR_INPUT,
                           "decoder_layer_input=offload (remat_policy=custom): offloading the decoder layers' inputs "
                           "to host is not simulated; keep it 'device' (every layer input stays on the device, as "
                           "with the other policies)");
        return SIM_OK;
    }
    for (size_t i = 0; i < sizeof POLICIES / sizeof POLICIES[0]; i++)
        if (!strcmp(p, POLICIES[i].name)) {
            for (int n = 0; n < MODEL_CKPT_N; n++)
                d->ckpt[n] = POLICIES[i].device >> n & 1    ? MODEL_CKPT_DEVICE
                             : POLICIES[i].offload >> n & 1 ? MODEL_CKPT_OFFLOAD
                                                            : MODEL_CKPT_REMAT;
            return SIM_OK;
        }
    char list[1024];
    size_t o = 0;
    for (size_t i = 0; i < sizeof POLICIES / sizeof POLICIES[0]; i++)
        o += (size_t)snprintf(list + o, sizeof list - o, "%s, ", POLICIES[i].name);
    return sim_err(SIM_ERR_INPUT,
                   "remat_policy='%s': MaxText's policies are %scustom (with the per-tensor keys) and none", p, list);
}

/* param_scan_axis: MaxText's scan stacks every layer weight along this axis (the definitions
 * above write the layers at dim 1, MaxText's default).  Only where the layers sit in the stacked
 * shape (dumps, checkpoints) changes; each device stores a weight layer by layer either way. */
static sim_status scan_axis_from_config(const cfg_config *cfg, model_def *m)
{
    long long a;
    SIM_TRY(cfg_get_int(cfg, "param_scan_axis", &a));
    for (int i = 0; i < m->nparams; i++) {
        model_param_def *d = &m->defs[i];
        if (d->scan_dim < 0 || d->scan_dim == a || d->state_var) continue; /* MoEBiasVar: layers first always */
        if (a < 0 || a >= d->rank)
            return sim_err(SIM_ERR_INPUT,
                           "param_scan_axis=%lld: %s has %d dims per layer, so the stacked layer dim can go at 0..%d; "
                           "use param_scan_axis=0 or 1 (MaxText's default)",
                           a, d->path, d->rank - 1, d->rank - 1);
        int64_t n = d->shape[d->scan_dim];
        const char *name = d->logical[d->scan_dim];
        int s = d->scan_dim;
        while (s < a) d->shape[s] = d->shape[s + 1], d->logical[s] = d->logical[s + 1], s++;
        while (s > a) d->shape[s] = d->shape[s - 1], d->logical[s] = d->logical[s - 1], s--;
        d->shape[a] = n;
        d->logical[a] = name;
        d->scan_dim = (int)a;
    }
    return SIM_OK;
}

/* What MaxText's config does when it pipelines (types.py): 'stage' moves before 'data' in the
 * mesh axes, and the embedding/logits batch rule becomes [stage, data, fsdp, fsdp_transpose, expert]. */
static void pipeline_mesh_and_rules(model_def *m)
{
    mesh_shape *ms = &m->mesh;
    int st = mesh_shape_axis_index(ms, "stage"), da = mesh_shape_axis_index(ms, "data");
    if (st < 0 || ms->sizes[st] <= 1) return;
    if (da >= 0 && st > da) {
        char name[MESH_AXIS_NAME_MAX];
        memcpy(name, ms->names[st], sizeof name);
        memcpy(ms->names[st], ms->names[da], sizeof name);
        memcpy(ms->names[da], name, sizeof name);
        int t = ms->sizes[st];
        ms->sizes[st] = ms->sizes[da];
        ms->sizes[da] = t;
        t = ms->dcn[st];
        ms->dcn[st] = ms->dcn[da];
        ms->dcn[da] = t;
        t = ms->ici[st];
        ms->ici[st] = ms->ici[da];
        ms->ici[da] = t;
    }
    int r = mesh_rules_find(&m->rules, "activation_embed_and_logits_batch");
    if (r >= 0) {
        static const char *const axes[] = {"stage", "data", "fsdp", "fsdp_transpose", "expert"};
        mesh_rule *ru = &m->rules.rules[r];
        for (int a = 0; a < ru->n_axes; a++) free(ru->axes[a]);
        free(ru->axes);
        ru->n_axes = 5;
        ru->axes = calloc(5, sizeof *ru->axes);
        SIM_ASSERT(ru->axes);
        for (int a = 0; a < 5; a++) ru->axes[a] = strdup(axes[a]);
    }
}

/* Pipeline keys (pipeline.c) and the combinations not implemented with a pipeline yet. */
static sim_status pipeline_setup(model_def *m, const cfg_config *cfg)
{
    model_dims *d = &m->d;
    /* a family may run some layers before the pipeline (DeepSeek: its dense layers) */
    const model_family *fam = d->family;
    int64_t before = fam->layers_before_pipeline ? fam->layers_before_pipeline(m) : 0;
    int64_t stack = d->layers - before;
    SIM_TRY(model_pipe_from_config(cfg, &m->mesh, stack, d->batch, &d->pipe));
    if (!d->pipe.on) return SIM_OK;
    if (fam->pipeline_check) SIM_TRY(fam->pipeline_check(m, cfg));
    if (before > 0) { /* logical_axis_rules_pp_act_as_dp */
        mesh_rules_init(&m->rules_pp_dp);
        for (int r = 0; r < m->rules.n; r++) {
            const mesh_rule *ru = &m->rules.rules[r];
            const char *axes[MESH_MAX_AXES + 1];
            int n = 0;
            for (int a = 0; a < ru->n_axes && n < MESH_MAX_AXES; a++) {
                if (!strcmp(ru->axes[a], "stage")) continue;
                if (!strcmp(ru->axes[a], "data")) axes[n++] = "stage";
                axes[n++] = ru->axes[a];
            }
            mesh_rules_add(&m->rules_pp_dp, ru->name, n, axes);
        }
    }
    if (d->cp > 1)
        return sim_err(SIM_ERR_INPUT,
                       "context parallelism (%d devices on '%s') with pipeline parallelism is not implemented yet; "
                       "set the context axis to 1 or ici_pipeline_parallelism=1",
                       d->cp, m->mesh.names[d->cp_axis]);
    /* the microbatch must split over the axes that shard activation_batch inside a stage */
    static const char *const shift_names[4] = {"activation_stage", "activation_batch", "activation_length",
                                               "activation_embed"};
    mesh_spec ss;
    SIM_TRY(model_logical_spec(m, "pipeline/shift", 4, shift_names, &ss));
    int64_t shp[4] = {d->pipe.stages, d->pipe.micro_rows, d->seq, d->emb};
    if (mesh_spec_check_shape(&ss, &m->mesh, 4, shp, "pipeline shift buffer") != SIM_OK) {
        char why[512];
        snprintf(why, sizeof why, "%s", sim_errmsg());
        return sim_err(SIM_ERR_INPUT,
                       "num_pipeline_microbatches=%lld leaves %lld rows per microbatch (%lld rows per step), which "
                       "the pipeline buffers cannot shard: %s; use fewer microbatches or a larger "
                       "per_device_batch_size",
                       (long long)d->pipe.microbatches, (long long)d->pipe.micro_rows, (long long)d->batch, why);
    }
    /* inside the pipeline every collective must stay within a stage: only the
     * stage buffers, the layer stack and the embedding/logits batch may use 'stage' */
    static const char *const may_use_stage[] = {"activation_stage", "layers", "activation_embed_and_logits_batch",
                                                "activation_embed_and_logits_batch_sequence"};
    for (int r = 0; r < m->rules.n; r++) {
        const mesh_rule *ru = &m->rules.rules[r];
        bool allowed = false;
        for (int k = 0; k < 4; k++) allowed |= !strcmp(ru->name, may_use_stage[k]);
        for (int a = 0; a < ru->n_axes && !allowed; a++)
            if (!strcmp(ru->axes[a], "stage"))
                return sim_err(
                    SIM_ERR_INPUT,
                    "logical_axis_rules: the rule for '%s'%s%s maps to 'stage', which the pipeline owns "
                    "(ici_pipeline_parallelism=%lld); only activation_stage, layers and the embedding/logits "
                    "batch may use it — drop 'stage' from that rule",
                    ru->name, ru->where && *ru->where ? " at " : "", ru->where ? ru->where : "",
                    (long long)d->pipe.stages);
    }
    return SIM_OK;
}

static sim_status def_from_config(const cfg_config *cfg, model_def *m)
{
    memset(m, 0, sizeof *m);
    pthread_mutex_init(&m->act_lock, NULL);
    model_dims *d = &m->d;
    const char *s;
    SIM_TRY(cfg_get_str(cfg, "model_name", &s));
    snprintf(d->model_name, sizeof d->model_name, "%s", s ? s : "default");
    const char *blocks[8];
    SIM_ASSERT(model_n_families <= 8);
    for (int i = 0; i < model_n_families; i++) blocks[i] = model_families[i]->name;
    int blk;
    SIM_TRY(cfg_get_enum(cfg, "decoder_block", blocks, model_n_families, &blk));
    d->family = model_families[blk];
    SIM_TRY(model_cfg_i64(cfg, "vocab_size", &d->vocab));
    SIM_TRY(model_cfg_i64(cfg, "base_emb_dim", &d->emb));
    SIM_TRY(model_cfg_i64(cfg, "base_num_query_heads", &d->q_heads));
    SIM_TRY(model_cfg_i64(cfg, "base_num_kv_heads", &d->kv_heads));
    SIM_TRY(model_cfg_i64(cfg, "head_dim", &d->head_dim));
    SIM_TRY(model_cfg_i64(cfg, "base_mlp_dim", &d->mlp));
    SIM_TRY(model_cfg_i64(cfg, "base_num_decoder_layers", &d->layers));
    SIM_TRY(model_cfg_i64(cfg, "max_target_length", &d->seq));
    SIM_TRY(parameter_scale(cfg, d));
    static const char *const pk[] = {"vocab_size", "base_emb_dim", "base_num_query_heads",    "base_num_kv_heads",
                                     "head_dim",   "base_mlp_dim", "base_num_decoder_layers", "max_target_length"};
    int64_t pv[] = {d->vocab, d->emb, d->q_heads, d->kv_heads, d->head_dim, d->mlp, d->layers, d->seq};
    for (int i = 0; i < 8; i++) SIM_TRY(positive(pk[i], pv[i]));
    if (d->q_heads % d->kv_heads)
        return sim_err(SIM_ERR_INPUT, "base_num_query_heads=%lld is not a multiple of base_num_kv_heads=%lld",
                       (long long)d->q_heads, (long long)d->kv_heads);
    if (d->head_dim % 2)
        return sim_err(SIM_ERR_INPUT, "head_dim=%lld: RoPE needs an even head_dim", (long long)d->head_dim);
    SIM_TRY(cfg_get_double(cfg, "normalization_layer_epsilon", &d->eps));
    SIM_TRY(cfg_get_double(cfg, "z_loss_multiplier", &d->z_loss));
    SIM_TRY(cfg_get_double(cfg, "rope_max_timescale", &d->rope_theta));
    SIM_TRY(cfg_get_double(cfg, "rope_min_timescale", &d->rope_min));
    SIM_TRY(cfg_get_double(cfg, "rope_linear_scaling_factor", &d->rope_linear));
    if (!(d->rope_linear > 0))
        return sim_err(SIM_ERR_INPUT, "rope_linear_scaling_factor=%g: must be positive (1 = no scaling)",
                       d->rope_linear);
    /* MaxText's Attention.init_rotary_embedding (attentions.py) picks LLaMARotaryEmbedding by the
     * model's name before it reads rope_type: every llama3.1* name (llama3.1-8b, -70b, -405b and
     * their -Instruct names) and rope_type=llama3.1 rotate with Llama 3.1's scaled RoPE. */
    const char *rope_type;
    SIM_TRY(cfg_get_str(cfg, "rope_type", &rope_type));
    d->rope_llama31 = !strncmp(d->model_name, "llama3.1", 8) || (rope_type && !strncmp(rope_type, "llama3.1", 8));
    SIM_TRY(model_cfg_bool(cfg, "rope_use_scale", &d->rope_use_scale));
    SIM_TRY(model_cfg_bool(cfg, "logits_via_embedding", &d->tied_logits));
    SIM_TRY(model_cfg_bool(cfg, "normalize_embedding_logits", &d->normalize_tied));
    SIM_TRY(cfg_get_double(cfg, "final_logits_soft_cap", &d->final_soft_cap));
    SIM_TRY(cfg_get_double(cfg, "attn_logits_soft_cap", &d->attn_soft_cap));
    if (d->final_soft_cap < 0 || d->attn_soft_cap < 0)
        return sim_err(
            SIM_ERR_INPUT,
            "final_logits_soft_cap=%g, attn_logits_soft_cap=%g: a soft cap is a positive bound, or 0 for none",
            d->final_soft_cap, d->attn_soft_cap);
    SIM_TRY(model_cfg_bool(cfg, "use_qk_norm", &d->qk_norm_key));
    SIM_TRY(model_cfg_bool(cfg, "fused_mlp", &d->fused_mlp));
    { /* MlpBlock's activations (keys.yml simulates [silu, linear] and [gelu, linear]) */
        const char **acts;
        int nacts;
        SIM_TRY(cfg_get_str_list(cfg, "mlp_activations", &acts, &nacts));
        d->mlp_gelu = nacts == 2 && !strcmp(acts[0], "gelu");
        free(acts);
    }
    SIM_TRY(model_cfg_bool(cfg, "fused_qkv", &d->fused_qkv));
    bool dropout_on;
    SIM_TRY(model_cfg_bool(cfg, "enable_dropout", &dropout_on));
    SIM_TRY(cfg_get_double(cfg, "dropout_rate", &d->dropout));
    if (!(d->dropout >= 0 && d->dropout <= 1))
        return sim_err(SIM_ERR_INPUT, "dropout_rate=%g: a probability between 0 and 1", d->dropout);
    if (!dropout_on) d->dropout = 0; /* MaxText trains with deterministic = not enable_dropout */
    SIM_TRY(remat_policy_from_config(cfg, d));
    SIM_TRY(attention_kernel(cfg, d));
    if (d->attn_soft_cap > 0 && d->attn_dot)
        return sim_err(SIM_ERR_INPUT,
                       "attn_logits_soft_cap=%g with the dot-product attention kernel is not simulated "
                       "(attention=%s selects it here); use attention=flash",
                       d->attn_soft_cap, "dot_product or autoselected");
    static const char *const modes[] = {"auto", "explicit"};
    int md;
    SIM_TRY(cfg_get_enum(cfg, "shard_mode", modes, 2, &md));
    d->mode = md ? MESH_MODE_EXPLICIT : MESH_MODE_AUTO;
    d->drop_size_one = true;
    if (cfg_find(cfg, "remove_size_one_mesh_axis_from_type"))
        SIM_TRY(model_cfg_bool(cfg, "remove_size_one_mesh_axis_from_type", &d->drop_size_one));
    SIM_TRY(model_cfg_bool(cfg, "dry_run", &d->dry_run));
    /* a dry run computes nothing, so keeps nothing for the recomputation (the host-memory check's dry
     * step of a real run keeps remat_replay, and counts the bytes the run would keep) */
    if (d->dry_run) d->remat_replay = false;
    static const char *const loss_modes[] = {"reshard", "assert"};
    int lm;
    SIM_TRY(cfg_get_enum(cfg, "loss_constraint", loss_modes, 2, &lm));
    d->loss_assert = lm == 1;
    SIM_TRY(counted_dtypes_from_config(cfg, d));
    SIM_TRY(model_cfg_bool(cfg, "scan_layers", &d->scan_layers));

    SIM_TRY(model_cfg_bool(cfg, "context_parallel_load_balance", &d->cp_load_balance));
    long long seed;
    SIM_TRY(cfg_get_int(cfg, "init_weights_seed", &seed));
    d->seed = (uint64_t)seed;

    SIM_TRY(cfg_release_of(cfg, &m->release));
    SIM_TRY(mesh_shape_from_config(cfg, &m->mesh));
    { /* the slice's physical shape, for the windowed-einsum model's link count (cfg_xla_rules.torus) */
        cfg_hw hw;
        bool found;
        int per_slice = m->mesh.num_devices / (m->mesh.num_slices > 0 ? m->mesh.num_slices : 1);
        SIM_TRY(cfg_hw_from_config(cfg, per_slice, &hw, &found));
        m->d.xla.torus_n = found ? hw.xla.torus_n : 0;
        for (int i = 0; i < m->d.xla.torus_n; i++) m->d.xla.torus[i] = hw.xla.torus[i];
    }
    SIM_TRY(zero1_and_ga_from_config(cfg, m));
    SIM_TRY(mesh_rules_from_config(cfg, &m->rules));
    pipeline_mesh_and_rules(m);
    double pdbs;
    SIM_TRY(cfg_get_double(cfg, "per_device_batch_size", &pdbs));
    d->batch = (int64_t)((double)m->mesh.num_devices * pdbs + 1e-9);
    if (pdbs <= 0 || d->batch < 1)
        return sim_err(SIM_ERR_INPUT,
                       "per_device_batch_size=%g on %d devices trains %lld rows per step; it needs at least one row "
                       "(per_device_batch_size >= %g)",
                       pdbs, m->mesh.num_devices, (long long)d->batch, 1.0 / m->mesh.num_devices);
    d->rows_loaded = pdbs < 1 ? m->mesh.num_devices : d->batch;
    /* the step's token arrays (rows x microbatches x sequence) are host arrays indexed in 64 bits */
    int64_t step_rows, step_tokens;
    if (__builtin_mul_overflow(d->rows_loaded, d->ga, &step_rows) ||
        __builtin_mul_overflow(step_rows, d->seq, &step_tokens) || step_tokens > MODEL_MAX_STEP_TOKENS)
        return sim_err(SIM_ERR_INPUT,
                       "gradient_accumulation_steps=%lld x %lld rows x max_target_length=%lld: a step of more "
                       "than %lld tokens; lower gradient_accumulation_steps or per_device_batch_size",
                       (long long)d->ga, (long long)d->rows_loaded, (long long)d->seq,
                       (long long)MODEL_MAX_STEP_TOKENS);
    const char *cs;
    SIM_TRY(cfg_get_str(cfg, "context_sharding", &cs));
    d->cp_axis = cs ? mesh_shape_axis_index(&m->mesh, cs) : -1;
    d->cp = d->cp_axis >= 0 ? m->mesh.sizes[d->cp_axis] : 1;
    if (d->cp > 1 && d->cp_load_balance && d->seq % (2 * d->cp))
        return sim_err(SIM_ERR_INPUT,
                       "max_target_length=%lld must be divisible by 2 x the context-parallel size %d for "
                       "load-balanced context parallelism (or set context_parallel_load_balance=false)",
                       (long long)d->seq, d->cp);

    SIM_TRY(gptoss_keys_elsewhere(cfg, d->family->name));
    SIM_TRY(d->family->define(m, cfg));
    SIM_TRY(pipeline_setup(m, cfg));
    SIM_TRY(scan_axis_from_config(cfg, m));
    bool scan;
    SIM_TRY(model_cfg_bool(cfg, "scan_layers", &scan));
    for (int i = 0; i < m->nparams && !scan; i++) m->defs[i].unscanned = m->defs[i].scan_dim >= 0;
    bool moved = false;
    for (int i = 0; i < m->nparams; i++)
        moved |= m->defs[i].scan_dim >= 0 && m->defs[i].scan_dim != 1 && !m->defs[i].state_var;
    if (d->zero1 && (!scan || moved))
        return sim_err(SIM_ERR_INPUT,
                       "shard_optimizer_over_data=true with %s: ZeRO-1 is simulated for MaxText's default layer "
                       "layout only; drop one of the two",
                       !scan ? "scan_layers=false" : "param_scan_axis other than 1");
    if (m->d.pipe.on) { /* combinations of the pipeline not simulated yet */
        bool unscanned = false, moved_axis = false;
        for (int i = 0; i < m->nparams; i++) {
            unscanned |= m->defs[i].unscanned;
            moved_axis |= m->defs[i].scan_dim >= 0 && m->defs[i].scan_dim != 1 && !m->defs[i].state_var;
        }
        const char *what = d->dropout > 0 ? "enable_dropout with dropout_rate > 0"
                           : d->fused_mlp ? "fused_mlp=true"
                           : unscanned    ? "scan_layers=false"
                           : moved_axis   ? "param_scan_axis other than 1"
                                          : NULL;
        if (!what && d->family->pipeline_unsimulated) what = d->family->pipeline_unsimulated(m);
        if (!what && strcmp(d->remat_policy, "full") && strcmp(d->remat_policy, "none")) what = "this remat_policy";
        if (what)
            return sim_err(SIM_ERR_INPUT,
                           "%s with pipeline parallelism (ici/dcn_pipeline_parallelism > 1) is not simulated yet; "
                           "drop one of the two (remat_policy: full or none with a pipeline)",
                           what);
    }
    for (int i = 0; i < m->nparams; i++) {
        mesh_resolved res;
        const model_param_def *pd = &m->defs[i];
        SIM_TRY(mesh_rules_resolve(&m->rules, &m->mesh, pd->path, pd->rank, pd->logical, &res));
        m->spec[i] = res.spec;
        m->unpruned[i] = res.unpruned;
        if (d->pipe.on && model_param_pipelined(m, i)) { /* MaxText's stage vmap puts the layer stack on 'stage' */
            int ax = d->pipe.stage_axis;
            SIM_TRY(mesh_spec_set_dim(&m->spec[i], &m->mesh, pd->scan_dim, 1, &ax));
            SIM_TRY(mesh_spec_set_dim(&m->unpruned[i], &m->mesh, pd->scan_dim, 1, &ax));
        }
        SIM_TRY(mesh_spec_check_shape(&m->spec[i], &m->mesh, pd->rank, pd->shape, pd->path));
        m->opt_spec[i] = m->spec[i];
        m->opt_unpruned[i] = m->unpruned[i];
        if (d->zero1 && !pd->state_var) { /* a state variable has no optimizer state to shard */
            if (d->pipe.on && model_param_pipelined(m, i)) SIM_TRY(model_pipe_zero1_spec(m, i, &m->opt_unpruned[i]));
            else model_zero1_spec(&m->mesh, pd->rank, pd->shape, &m->unpruned[i], &m->opt_unpruned[i]);
            m->opt_spec[i] = m->opt_unpruned[i];
            mesh_spec_drop_size_one(&m->opt_spec[i], &m->mesh);
        }
    }
    if (d->family->setup) SIM_TRY(d->family->setup(m, cfg)); /* after the specs: it may check them */
    /* the optimizer's treatment of each parameter, once (its slots; Muon: configs/muon.yml) */
    SIM_TRY(model_opt_define(cfg, m->defs, m->nparams, &m->opt, m->opt_param));
    return SIM_OK;
}

/* The one unwind of def_from_config: whatever step refuses the config, the rules built before it
 * (the only heap memory a model_def owns) are freed and zeroed, so a refused config leaves nothing
 * allocated whether or not the caller then calls model_def_free. */
sim_status model_def_from_config(const cfg_config *cfg, model_def *m)
{
    sim_status st = def_from_config(cfg, m);
    if (st != SIM_OK) {
        free(m->d.family_dims);
        m->d.family_dims = NULL;
        mesh_rules_free(&m->rules);
        mesh_rules_free(&m->rules_pp_dp);
    }
    return st;
}

void model_def_free(model_def *m)
{
    free(m->d.family_dims);
    m->d.family_dims = NULL;
    mesh_rules_free(&m->rules);
    mesh_rules_free(&m->rules_pp_dp);
    pthread_mutex_destroy(&m->act_lock);
}

/* A layer running before the pipeline resolves its names under rules_pp_dp (per device thread;
 * per device when a thread runs several devices as fibers: sim_device_local_register). */
static _Thread_local const mesh_rules *thread_rules;

static void *thread_rules_get(void) { return (void *)thread_rules; }
static void thread_rules_set(void *r) { thread_rules = r; }
static void thread_rules_register(void) { sim_device_local_register(thread_rules_get, thread_rules_set); }

void model_set_thread_rules(const mesh_rules *r)
{
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, thread_rules_register); /* before the first device sets it */
    thread_rules = r;
}

sim_status model_logical_spec(const model_def *m, const char *tensor, int rank, const char *const *names,
                              mesh_spec *out)
{
    mesh_resolved res;
    SIM_TRY(mesh_rules_resolve(thread_rules ? thread_rules : &m->rules, &m->mesh, tensor, rank, names, &res));
    *out = res.spec;
    return SIM_OK;
}

int model_param_at(const model_def *m, const char *prefix, const char *suffix)
{
    /* path == prefix "." suffix, compared in place (this runs for every layer of every device) */
    size_t lp = strlen(prefix);
    for (int i = 0; i < m->nparams; i++) {
        const char *path = m->defs[i].path;
        if (!strncmp(path, prefix, lp) && path[lp] == '.' && !strcmp(path + lp + 1, suffix)) return i;
    }
    return -1;
}

mesh_var *model_param_leaf(model_dev *md, mesh_tape *t, int i, int l)
{
    if (md->wover[i]) return md->wover[i];
    model_param *p = &md->p[i];
    bool grad = mesh_tape_recording(t) && p->g;
    return mesh_tape_param(t, &p->w[l], grad ? &p->g[l] : NULL);
}

int model_param_index(const model_def *m, const char *suffix)
{
    size_t ls = strlen(suffix);
    for (int i = 0; i < m->nparams; i++) {
        size_t lp = strlen(m->defs[i].path);
        if (lp >= ls && !strcmp(m->defs[i].path + lp - ls, suffix)) return i;
    }
    return -1;
}

double model_opt_step_bytes(const model_def *m)
{
    /* ZeRO-1 as model_dev_init decides it: the stored state is in the optimizer layout wherever a 'data'
     * axis of more than one device shards it (the SGD row, without state, refuses ZeRO-1) */
    int data = mesh_shape_axis_index(&m->mesh, "data");
    bool zero1 = m->d.zero1 && data >= 0 && m->mesh.sizes[data] > 1;
    double wsize = (double)sim_dtype_size(m->d.weight_dtype), update = 0, params = 0, grads = 0;
    for (int i = 0; i < m->nparams; i++) {
        const model_param_def *d = &m->defs[i];
        int64_t local[MESH_SPEC_MAX_RANK];
        mesh_spec_local_shape(zero1 ? &m->opt_spec[i] : &m->spec[i], &m->mesh, d->shape, local);
        double shard = wsize;
        for (int k = 0; k < d->rank; k++) shard *= (double)local[k];
        update += shard * model_opt_update_traffic(m->opt, &m->opt_param[i], d->state_var);
        /* the norms (trainers/pre_train/train.py train_step: learning/raw_grad_norm and grad_norm read
         * the raw and the clipped gradients, learning/param_norm the new parameters, each an
         * l2norm_pytree of the trained state) */
        if (d->state_var) continue;
        params += shard;
        grads += shard;
    }
    return update + params + 2.0 * grads;
}

uint64_t model_param_bytes(const model_def *m)
{
    uint64_t n = 0;
    for (int i = 0; i < m->nparams; i++) {
        uint64_t e = 4;
        for (int d = 0; d < m->defs[i].rank; d++) e *= (uint64_t)m->defs[i].shape[d];
        n += e;
    }
    return n;
}

/* ------------------------------------------------------------ per device */

/* ZeRO-1's stored state of parameter i: one stacked array each for the
 * parameters (initialised in place) and the two moments, in the optimizer
 * layout; the gradient there is made each step (train.c). */
static sim_status zero1_state_new(model_dev *md, int i)
{
    const model_def *def = md->def;
    model_param *z = &md->z[i];
    z->def = def->defs[i];
    z->def.scan_dim = -1; /* one stacked tensor: the optimizer is elementwise */
    z->spec = def->opt_spec[i];
    z->spec_unpruned = def->opt_unpruned[i];
    z->n_layers = 1;
    /* the parameters, then the optimizer's slots (named for the arena's listing as before: "(adam)") */
    const model_opt_param *op = &def->opt_param[i];
    z->n_slots = op->n_slots;
    for (int k = 0; k < op->n_slots; k++) z->slot_name[k] = def->opt->slot[k];
    mesh_array **bufs[1 + MODEL_OPT_SLOTS_MAX] = {&z->w};
    for (int k = 0; k < op->n_slots; k++) bufs[1 + k] = &z->slot[k];
    for (int b = 0; b < 1 + op->n_slots; b++) {
        sim_mem_cat cat = b ? SIM_MEM_OPTIMIZER : SIM_MEM_PARAMS;
        char name[MESH_NAME_MAX];
        snprintf(name, sizeof name, "%s%s", z->def.path, b ? " (adam)" : " (zero1)");
        *bufs[b] = calloc(1, sizeof(mesh_array));
        SIM_TRY(
            mesh_array_new(md->ctx.dev, &def->mesh, name, z->def.rank, z->def.shape, &z->spec, SIM_F32, cat, *bufs[b]));
    }
    model_param p = md->p[i]; /* the per-layer init names */
    return model_init_fill_stacked(md->ctx.dev, &def->mesh, &p, z->w, def->d.seed);
}

sim_status model_dev_init(model_dev *md, const model_def *def, sim_device *dev, bool with_grads, bool with_opt)
{
    memset(md, 0, sizeof *md);
    md->def = def;
    md->ctx.dev = dev;
    md->ctx.mesh = &def->mesh;
    md->ctx.mode = def->d.mode;
    md->ctx.release = def->release;
    md->ctx.drop_size_one = def->d.drop_size_one;
    md->ctx.embed_all_to_all = def->d.xla.embed_all_to_all;
    md->ctx.layer = "";
    int data = mesh_shape_axis_index(&def->mesh, "data");
    md->zero1 = with_opt && with_grads && def->d.zero1 && data >= 0 && def->mesh.sizes[data] > 1;
    for (int i = 0; i < def->nparams; i++) {
        model_param *p = &md->p[i];
        p->def = def->defs[i];
        p->spec = def->spec[i];
        p->spec_unpruned = def->unpruned[i];
        p->n_layers = p->def.scan_dim >= 0 ? (int)p->def.shape[p->def.scan_dim] : 1;
        int rank;
        int64_t shape[MESH_SPEC_MAX_RANK];
        mesh_spec ls;
        model_param_layer_shape(p, &rank, shape);
        model_param_layer_spec(p, &ls);
        /* the optimizer's slots as its row names them (ZeRO-1 keeps them elsewhere: zero1_state_new); a state
         * variable (MoEBiasVar) has neither gradient nor optimizer state */
        bool sv = p->def.state_var;
        int ns = with_opt && !md->zero1 ? def->opt_param[i].n_slots : 0;
        p->n_slots = ns;
        for (int k = 0; k < ns; k++) p->slot_name[k] = def->opt->slot[k];
        mesh_array **bufs[2 + MODEL_OPT_SLOTS_MAX] = {&p->w, with_grads && !sv ? &p->g : NULL};
        for (int k = 0; k < ns; k++) bufs[2 + k] = &p->slot[k];
        bool stacked = model_param_pipelined(def, i);
        if (stacked) p->stage_span = def->d.pipe.layers_per_stage;
        for (int b = 0; b < 2 + ns; b++) {
            sim_mem_cat cat = b == 0 ? SIM_MEM_PARAMS : b == 1 ? SIM_MEM_GRADS : SIM_MEM_OPTIMIZER;
            if (!bufs[b]) continue;
            /* ZeRO-1 without accumulation: the gradient sinks keep the sum over 'data'
             * pending, so one reduce-scatter brings it to the optimizer layout */
            mesh_spec bs = ls;
            if (b == 1 && md->zero1 && def->d.ga == 1 && !(mesh_spec_dim_axes(&ls) & (1u << data)))
                bs.partial |= 1u << data;
            *bufs[b] = calloc((size_t)p->n_layers, sizeof(mesh_array));
            for (int l = 0; l < p->n_layers; l++) {
                char name[MESH_NAME_MAX];
                sim_str_put(name, sizeof name, sim_str_put(name, sizeof name, 0, p->def.path, SIZE_MAX),
                            b == 1   ? " (grad)"
                            : b >= 2 ? " (adam)"
                                     : "",
                            SIZE_MAX);
                mesh_array *a = &(*bufs[b])[l];
                if (stacked && !model_holds_layer(def, sim_device_id(dev), l)) {
                    /* another stage's layer: described, never stored here (no data, no bytes) */
                    memset(a, 0, sizeof *a);
                    sim_str_put(a->name, sizeof a->name, 0, name, SIZE_MAX);
                    a->rank = rank;
                    memcpy(a->shape, shape, sizeof(int64_t) * (size_t)rank);
                    a->spec = bs;
                    a->dtype = a->counted = SIM_F32;
                    a->cat = cat;
                    continue;
                }
                /* ZeRO-1 with accumulation: MaxText casts the parameters to dtype before the
                 * all-gather and the accumulation loop, so the working copy, the per-microbatch
                 * gradients and their accumulator are in dtype (facts-2 §D) */
                if (md->zero1 && def->d.ga > 1 && b <= 1)
                    SIM_TRY(mesh_array_new_as(dev, &def->mesh, name, rank, shape, &bs, SIM_F32, def->d.act_dtype, cat,
                                              true, a));
                else SIM_TRY(mesh_array_new(dev, &def->mesh, name, rank, shape, &bs, SIM_F32, cat, a));
            }
        }
        if (md->zero1 && !sv) SIM_TRY(zero1_state_new(md, i));
    }
    SIM_TRY(model_params_init(dev, &def->mesh, md->p, def->nparams, def->d.seed));
    size_t n = with_grads && def->d.family->step_counts ? def->d.family->step_counts(def) : 0;
    if (n) { /* the family's per-step host statistics (DeepSeek: E expert counts per MoE layer) */
        md->n_bias_counts = n;
        md->bias_counts = calloc(n, sizeof(float));
        md->bias_counts_step = calloc(n, sizeof(float));
        SIM_ASSERT(md->bias_counts && md->bias_counts_step);
    }
    /* ZeRO-1 keeps a state variable where it is: its stored state is the parameter itself (a view) */
    for (int i = 0; i < def->nparams && md->zero1; i++)
        if (md->p[i].def.state_var) md->z[i] = md->p[i];
    return SIM_OK;
}

bool model_param_pipelined(const model_def *m, int i)
{
    if (!m->d.pipe.on || m->defs[i].scan_dim < 0) return false;
    return !m->d.family->param_pipelined || m->d.family->param_pipelined(m, &m->defs[i]);
}

sim_status model_layer_pp_as_dp(model_dev *md, mesh_tape *t, const model_batch *b, int layer, mesh_var *x,
                                model_layer_fn fn, mesh_var **y, mesh_var **aux)
{
    const mesh_rules *saved = thread_rules;
    model_set_thread_rules(md->def->rules_pp_dp.n ? &md->def->rules_pp_dp : NULL);
    sim_status st = fn(md, t, b, layer, x, y, aux);
    model_set_thread_rules(saved);
    return st;
}

bool model_holds_layer(const model_def *m, int device, int64_t l)
{
    const model_pipe *pp = &m->d.pipe;
    if (!pp->on) return true;
    int c[MESH_MAX_AXES];
    mesh_shape_coords(&m->mesh, device, c);
    return model_pipe_layer_stage(pp, l) == c[pp->stage_axis];
}

sim_status model_store_layer(model_dev *md, const model_param *p, const mesh_array *a, int64_t l, void *global)
{
    const model_def *m = md->def;
    if (!m->d.pipe.on || p->def.scan_dim < 0 ||
        (m->d.family->param_pipelined && !m->d.family->param_pipelined(m, &p->def)))
        return mesh_array_store_global(md->ctx.dev, &m->mesh, a, global);
    if (!model_holds_layer(m, sim_device_id(md->ctx.dev), l)) return SIM_OK;
    return mesh_array_store_global_except(md->ctx.dev, &m->mesh, a, global, 1u << m->d.pipe.stage_axis);
}

void model_dev_free(model_dev *md)
{
    if (md->def->d.family->dev_free) md->def->d.family->dev_free(md);
    free(md->bias_counts);
    free(md->bias_counts_step);
    md->bias_counts = md->bias_counts_step = NULL;
    for (int i = 0; i < md->def->nparams; i++)
        for (int z = 0; z < 2; z++) {
            model_param *p = z ? &md->z[i] : &md->p[i];
            if (z && md->p[i].def.state_var) continue; /* a view of p[i] */
            mesh_array *bufs[2 + MODEL_OPT_SLOTS_MAX] = {p->w, p->g};
            for (int k = 0; k < MODEL_OPT_SLOTS_MAX; k++) bufs[2 + k] = p->slot[k];
            for (int b = 0; b < 2 + MODEL_OPT_SLOTS_MAX; b++) {
                if (!bufs[b]) continue;
                if (!z && b < 2 && md->zero1_released) { /* their shards are already released */
                    free(bufs[b]);
                    continue;
                }
                for (int l = 0; l < p->n_layers; l++) mesh_array_free(md->ctx.dev, &bufs[b][l]);
                free(bufs[b]);
            }
            p->w = p->g = NULL;
            for (int k = 0; k < MODEL_OPT_SLOTS_MAX; k++) p->slot[k] = NULL;
        }
}

void model_dev_zero_grads(model_dev *md)
{
    for (int i = 0; i < md->def->nparams; i++) {
        model_param *p = &md->p[i];
        if (!p->g) continue;
        for (int l = 0; l < p->n_layers; l++)
            bk_parallel_zero(p->g[l].data, p->g[l].nlocal * sizeof(float)); /* on the kernel pool */
    }
}

/* ------------------------------------------------------------ batches */

static const char *const INPUT_NAMES[2] = {"activation_embed_and_logits_batch", "activation_length"};

sim_status model_batch_load(model_dev *md, const int32_t *inputs, const int32_t *targets, const int32_t *positions,
                            model_batch *b)
{
    const model_def *m = md->def;
    mesh_spec s;
    SIM_TRY(model_logical_spec(m, "inputs", 2, INPUT_NAMES, &s));
    int64_t shape[2] = {m->d.batch, m->d.seq};
    const int32_t *src[3] = {inputs, targets, positions};
    mesh_array *dst[3] = {&b->tokens, &b->targets, &b->positions};
    static const char *const names[3] = {"inputs", "targets", "positions"};
    for (int i = 0; i < 3; i++) {
        SIM_TRY(mesh_array_new(md->ctx.dev, &m->mesh, names[i], 2, shape, &s, SIM_I32, SIM_MEM_ACTIVATIONS, dst[i]));
        if (src[i]) mesh_array_load_global(md->ctx.dev, &m->mesh, dst[i], src[i]);
    }
    return SIM_OK;
}

void model_batch_free(model_dev *md, model_batch *b)
{
    mesh_array_free(md->ctx.dev, &b->tokens);
    mesh_array_free(md->ctx.dev, &b->targets);
    mesh_array_free(md->ctx.dev, &b->positions);
}

/* ------------------------------------------------------------ forward */

sim_status model_loss(model_dev *md, mesh_tape *t, const model_batch *b, mesh_var **loss)
{
    return md->def->d.family->loss(md, t, b, loss);
}

int64_t model_mtp_layers(const model_def *m)
{
    return m->d.family && m->d.family->mtp_layers ? m->d.family->mtp_layers(m) : 0;
}

/* ------------------------------------------------------------ dropout */

sim_status model_dropout(model_dev *md, mesh_tape *t, mesh_var *x, const char *site, mesh_var **y)
{
    const model_dims *d = &md->def->d;
    if (d->dropout <= 0) {
        *y = x;
        return SIM_OK;
    }
    char name[128];
    snprintf(name, sizeof name, "dropout/%s", site);
    uint64_t step = (uint64_t)sim_device_step(md->ctx.dev);
    uint64_t key = model_init_key(d->seed + step * 0x9E3779B97F4A7C15ull, name);
    return mesh_nn_dropout(t, x, d->dropout, key, x->val.rank - 2, "dropout", y);
}

/* ------------------------------------------------------------ output head */

static const char *const LOGITS3[3] = {"activation_embed_and_logits_batch", "activation_length", "activation_vocab"};

sim_status model_logits(model_dev *md, mesh_tape *t, mesh_var *y, mesh_var *embed, mesh_var *dense_w, mesh_var **logits)
{
    const model_dims *d = &md->def->d;
    mesh_spec os;
    const mesh_spec *out;
    SIM_TRY(model_out_sharding(md, "logits_dense", 3, LOGITS3, &os, &out));
    /* logits_dot_in_fp32: the head's DenseGeneral runs in float32 (layers/nnx_decoders.py): no
     * narrowing cast for a compiler to move before the gather, so the kernel moves in weight_dtype
     * whatever the hardware profile (see mesh/ops.c stage).  attend_on_embedding casts its table to
     * bfloat16 whatever attend_dtype says, so the tied table moves as that cast's output */
    if (d->logits_dot_fp32 && !d->tied_logits) dense_w->val.counted_fixed = true;
    if (!d->tied_logits) { /* MaxText applies final_logits_soft_cap on the tied path only */
        SIM_TRY(mesh_ad_einsum(t, "bte,ev->btv", y, dense_w, out, "logits_dense", logits));
    } else {
        /* attend_on_embedding (layers/embeddings.py): y . table^T with the decoder's out_sharding, in
         * attend_dtype, the table cast to bfloat16 first whatever dtype and weight_dtype say
         * (jnp.asarray(embedding_table, jnp.bfloat16).T): the product reads the rounded table and the
         * table's gradient through it is rounded alike */
        mesh_var *table;
        SIM_TRY(mesh_nn_round_bf16(t, embed, "attend_on_embedding/bf16", &table));
        SIM_TRY(mesh_ad_einsum(t, "bte,ve->btv", y, table, out, "logits_via_embedding", logits));
        double a = d->normalize_tied ? 1.0 / sqrt((double)y->val.shape[2]) : 1.0;
        if (a != 1.0 || d->final_soft_cap > 0)
            SIM_TRY(mesh_nn_softcap(t, *logits, a, d->final_soft_cap, "logits_soft_cap", logits));
    }
    /* float32 logits (a float32 product, or cast_logits_to_fp32 after it) are what the loss keeps;
     * XLA fuses the cast into the product, so no bfloat16 copy is counted beside them */
    if (d->logits_dot_fp32 || d->logits_cast_fp32) mesh_array_recount(md->ctx.dev, &(*logits)->val, SIM_F32);
    return SIM_OK;
}

/* ------------------------------------------------------------ logical helpers */

void model_note_activation(const model_dev *md, const char *name, const mesh_array *a, int rank,
                           const char *const *names, const mesh_spec *spec)
{
    if (sim_device_id(md->ctx.dev) != 0) return;
    model_def *m = (model_def *)md->def; /* the activation log is the one mutable part of a definition */
    pthread_mutex_lock(&m->act_lock);
    bool seen = false;
    for (int i = 0; i < m->nacts && !seen; i++) {
        const model_act *x = &m->acts[i];
        seen =
            !strcmp(x->name, name) && x->rank == rank && !memcmp(x->shape, a->shape, (size_t)rank * sizeof a->shape[0]);
    }
    if (!seen && m->nacts < MODEL_MAX_ACTS) {
        model_act *act = &m->acts[m->nacts++];
        memset(act, 0, sizeof *act);
        snprintf(act->name, sizeof act->name, "%s", name);
        act->rank = rank;
        act->logical_known = names != NULL;
        for (int d = 0; d < rank; d++) {
            act->shape[d] = a->shape[d];
            snprintf(act->logical[d], sizeof act->logical[d], "%s", names && names[d] ? names[d] : "");
        }
        act->spec = *spec;
    }
    pthread_mutex_unlock(&m->act_lock);
}

void model_note_activation_f32(const model_dev *md, const char *name)
{
    if (sim_device_id(md->ctx.dev) != 0) return;
    model_def *m = (model_def *)md->def; /* the activation log is the one mutable part of a definition */
    pthread_mutex_lock(&m->act_lock);
    for (int i = 0; i < m->nacts; i++)
        if (!strcmp(m->acts[i].name, name)) m->acts[i].float32 = true;
    pthread_mutex_unlock(&m->act_lock);
}

sim_status model_shard_as(model_dev *md, mesh_tape *t, mesh_var *x, const char *dump_name, int rank,
                          const char *const *names, mesh_var **out)
{
    mesh_spec s;
    SIM_TRY(model_logical_spec(md->def, dump_name, rank, names, &s));
    model_note_activation(md, dump_name, &x->val, rank, names, &s);
    return mesh_ad_shard_as(t, x, &s, dump_name, out);
}

sim_status model_constraint(model_dev *md, mesh_tape *t, mesh_var *x, const char *dump_name, int rank,
                            const char *const *names, mesh_var **out)
{
    mesh_spec s;
    SIM_TRY(model_logical_spec(md->def, dump_name, rank, names, &s));
    model_note_activation(md, dump_name, &x->val, rank, names, &s);
    return mesh_ad_constraint(t, x, &s, dump_name, out);
}

sim_status model_loss_constraint(model_dev *md, mesh_tape *t, mesh_var *x, bool note, mesh_var **out)
{
    static const char *const names[2] = {"activation_embed_and_logits_batch", "activation_length"};
    const model_def *m = md->def;
    mesh_resolved res;
    SIM_TRY(mesh_rules_resolve(thread_rules ? thread_rules : &m->rules, &m->mesh, "loss/xent", 2, names, &res));
    if (note) model_note_activation(md, "loss/xent", &x->val, 2, names, &res.spec);
    if (md->ctx.mode != MESH_MODE_EXPLICIT) return mesh_ad_constraint(t, x, &res.spec, "loss/xent", out);
    /* before PR #4208 flax resolved the names without dropping size-1 axes, and the raw
     * with_sharding_constraint asserts; MaxText 0.2.5 drops them and reshards */
    if (m->d.loss_assert) return mesh_ad_constraint(t, x, &res.unpruned, "loss/xent", out);
    return mesh_ad_shard_as(t, x, &res.spec, "loss/xent", out);
}

sim_status model_out_sharding(model_dev *md, const char *tensor, int rank, const char *const *names, mesh_spec *spec,
                              const mesh_spec **out)
{
    *out = NULL;
    if (md->ctx.mode != MESH_MODE_EXPLICIT) return SIM_OK;
    SIM_TRY(model_logical_spec(md->def, tensor, rank, names, spec));
    *out = spec;
    return SIM_OK;
}

/* ------------------------------------------------------------ remat */

/* The tensors one remat layer saved in its forward, in the order it saved them. */
typedef struct {
    model_ckpt_name name;
    mesh_array a; /* on the device (arena), or shape/spec only when offloaded */
    float *host;  /* offloaded copy (NULL in a dry run) */
    bool offloaded;
    bool region; /* a region's own residuals (model_checkpoint_region): blob, freed by blob_free */
    void *blob;
    void (*blob_free)(void *);
} remat_saved;

typedef struct model_remat_store {
    remat_saved *v;
    int n, cap;
    int next; /* recompute: the next entry to hand back */
    bool recompute;
} model_remat_store;

static void store_free(sim_device *dev, model_remat_store *s)
{
    if (!s) return;
    for (int i = 0; i < s->n; i++) {
        if (s->v[i].region) {
            if (s->v[i].blob) s->v[i].blob_free(s->v[i].blob);
            continue;
        }
        if (!s->v[i].offloaded) mesh_array_free(dev, &s->v[i].a); /* no-op once handed back (nlocal 0) */
        free(s->v[i].host);
    }
    free(s->v);
    free(s);
}

/* A new zeroed entry at the end of the store (growing it by doubling, from 16). */
static remat_saved *store_push(model_remat_store *s)
{
    if (s->n == s->cap) {
        s->cap = s->cap ? 2 * s->cap : 16;
        s->v = realloc(s->v, (size_t)s->cap * sizeof *s->v);
        SIM_ASSERT(s->v);
    }
    remat_saved *r = &s->v[s->n++];
    memset(r, 0, sizeof *r);
    return r;
}

sim_status model_checkpoint_name(model_dev *md, mesh_var *x, model_ckpt_name name)
{
    model_remat_store *s = md->remat;
    model_ckpt_action act = (model_ckpt_action)md->def->d.ckpt[name];
    if (!s || act == MODEL_CKPT_REMAT) return SIM_OK;
    sim_device *dev = md->ctx.dev;
    if (s->recompute) {
        /* the same checkpoints come in the same order as in the forward pass */
        SIM_ASSERT(s->next < s->n && !s->v[s->next].region && s->v[s->next].name == name);
        remat_saved *r = &s->v[s->next++];
        if (r->offloaded) { /* brought back: the recomputed twin stands for it on the device */
            free(r->host);
            r->host = NULL;
        } else if (x->owned) { /* the saved tensor replaces its recomputed twin (same values) */
            mesh_array_free(dev, &x->val);
            x->val = r->a;
            memset(&r->a, 0, sizeof r->a);
        } else {
            mesh_array_free(dev, &r->a);
        }
        return SIM_OK;
    }
    remat_saved *r = store_push(s);
    r->name = name;
    if (act == MODEL_CKPT_OFFLOAD) {
        r->offloaded = true;
        r->a = x->val;
        r->a.data = NULL;
        if (x->val.data) {
            size_t bytes = x->val.nlocal * sim_dtype_size(x->val.dtype);
            r->host = malloc(bytes + 1);
            SIM_ASSERT(r->host);
            memcpy(r->host, x->val.data, bytes);
        }
        return SIM_OK;
    }
    if (x->owned) { /* kept alive past the scratch tape: the store owns it now */
        r->a = x->val;
        x->owned = false;
        return SIM_OK;
    }
    char nm[MESH_NAME_MAX];
    snprintf(nm, sizeof nm, "%s (saved)", CKPT_NAMES[name]);
    /* a full copy (on the kernel pool): no zero-filling when there is data to copy */
    SIM_TRY((x->val.data ? mesh_array_new_raw : mesh_array_new)(
        dev, md->ctx.mesh, nm, x->val.rank, x->val.shape, &x->val.spec, x->val.dtype, SIM_MEM_ACTIVATIONS, &r->a));
    if (x->val.data) bk_parallel_copy(r->a.data, x->val.data, x->val.nlocal * sim_dtype_size(x->val.dtype));
    return SIM_OK;
}

bool model_recomputed_dead(const model_dev *md, model_ckpt_name name)
{
    return md->recomputing && md->remat && md->def->d.ckpt[name] != MODEL_CKPT_REMAT;
}

sim_status model_saved_product(model_dev *md, model_ckpt_name name, const mesh_array *w)
{
    const model_dims *d = &md->def->d;
    if (!md->remat || md->recomputing || d->xla.saved_grad_copies <= 0 || d->ckpt[name] != MODEL_CKPT_DEVICE)
        return SIM_OK;
    size_t bytes = w->nlocal * sim_dtype_size(d->weight_dtype) * (size_t)d->xla.saved_grad_copies;
    if (!bytes) return SIM_OK;
    SIM_TRY(sim_arena_charge(sim_device_arena(md->ctx.dev), bytes, SIM_MEM_GRADS, "saved-product gradient copies"));
    md->saved_copy_bytes += bytes;
    return SIM_OK;
}

void model_saved_products_release(model_dev *md)
{
    if (md->saved_copy_bytes) sim_arena_discharge(sim_device_arena(md->ctx.dev), md->saved_copy_bytes, SIM_MEM_GRADS);
    md->saved_copy_bytes = 0;
}

sim_status model_dense(model_dev *md, mesh_tape *t, const char *sub, mesh_var *x, mesh_var *w, const char *name,
                       int rank, const char *const *out_names, mesh_var **y)
{
    mesh_spec os;
    const mesh_spec *out;
    SIM_TRY(model_out_sharding(md, name, rank, out_names, &os, &out));
    return mesh_ad_einsum(t, sub, x, w, out, name, y);
}

sim_status model_dense_saved(model_dev *md, mesh_tape *t, model_ckpt_name name, const char *sub, mesh_var *x,
                             mesh_var *w, const char *op, int rank, const char *const *out_names, mesh_var **y)
{
    md->ctx.dead_outputs = model_recomputed_dead(md, name);
    sim_status st = model_dense(md, t, sub, x, w, op, rank, out_names, y);
    md->ctx.dead_outputs = false;
    SIM_TRY(st);
    SIM_TRY(model_saved_product(md, name, &w->val));
    return model_checkpoint_name(md, *y, name);
}

void **model_checkpoint_region(model_dev *md, void (*blob_free)(void *))
{
    model_remat_store *s = md->remat;
    if (!s) return NULL;
    if (s->recompute) {
        SIM_ASSERT(s->next < s->n && s->v[s->next].region);
        return &s->v[s->next++].blob;
    }
    remat_saved *r = store_push(s);
    r->region = true;
    r->blob_free = blob_free;
    return &r->blob;
}

typedef struct {
    model_dev *md;
    const model_batch *b;
    int layer;
    model_layer_fn fn;
    model_remat_store *store; /* what the forward saved (NULL: nothing) */
    mesh_replay *replay;      /* the forward's kernel values for the recomputation (NULL: computed again) */
} remat_payload;

static void remat_payload_free(void *p)
{
    remat_payload *rp = p;
    store_free(rp->md->ctx.dev, rp->store);
    mesh_replay_free(rp->replay);
    free(rp);
}

mesh_replay *model_replay_begin(model_dev *md, bool backward_follows)
{
    if (!md->def->d.remat_replay || !backward_follows) return NULL;
    SIM_ASSERT(!md->ctx.replay); /* remat layers do not nest */
    mesh_replay *r = mesh_replay_new(md->ctx.dev);
    mesh_replay_start(r, MESH_REPLAY_SAVE);
    md->ctx.replay = r;
    return r;
}

void model_replay_use(model_dev *md, mesh_replay *r)
{
    SIM_ASSERT(!md->ctx.replay);
    if (r) mesh_replay_start(r, MESH_REPLAY_USE);
    md->ctx.replay = r;
}

void model_replay_end(model_dev *md) { md->ctx.replay = NULL; }

static sim_status remat_vjp(mesh_tape *t, mesh_entry *e)
{
    remat_payload *rp = e->payload;
    mesh_var *x = e->in[0], *y = e->out[0], *aux = e->nout > 1 ? e->out[1] : NULL;
    mesh_tape *inner = mesh_tape_new(mesh_tape_ctx(t), true);
    mesh_var *xin = mesh_tape_input(inner, &x->val, true), *yin, *auxin = NULL;
    if (rp->store) rp->store->recompute = true, rp->store->next = 0;
    rp->md->remat = rp->store;
    rp->md->recomputing = true;
    model_replay_use(rp->md, rp->replay);
    sim_status st = rp->fn(rp->md, inner, rp->b, rp->layer, xin, &yin, &auxin);
    model_replay_end(rp->md);
    mesh_replay_free(rp->replay); /* every value went back into the recomputation */
    rp->replay = NULL;
    rp->md->recomputing = false;
    rp->md->remat = NULL;
    /* the outputs' cotangents move into the recomputed layer; one backward pass covers both */
    if (st == SIM_OK && aux && aux->has_grad && auxin) {
        mesh_array cot = aux->grad;
        aux->has_grad = false;
        st = y->has_grad ? mesh_tape_accumulate(inner, auxin, &cot, e->tag)
                         : mesh_tape_backward_from(inner, auxin, &cot);
    }
    if (st == SIM_OK && y->has_grad) {
        mesh_array cot = y->grad;
        y->has_grad = false;
        st = mesh_tape_backward_from(inner, yin, &cot);
    }
    if (st == SIM_OK && xin->has_grad) {
        mesh_array g = xin->grad;
        xin->has_grad = false;
        st = mesh_tape_accumulate(t, x, &g, e->tag);
    }
    mesh_tape_free(inner);
    if (st == SIM_OK && rp->md->on_layer) rp->md->on_layer(rp->md->on_layer_arg, rp->layer, true);
    return st;
}

bool model_layers_bounded(const model_dev *md, int first, int end) { return md->bound_layers && end - first >= 4; }

void model_layer_repeat_begin(model_dev *md, mesh_tape *t, int first, int end, int l, mesh_tape_mark *mark)
{
    if (model_layers_bounded(md, first, end) && l == first + 1) mesh_tape_repeat_begin(t, mark);
}

sim_status model_layer_repeat_end(model_dev *md, mesh_tape *t, int first, int end, int *l, const mesh_tape_mark *mark)
{
    if (!model_layers_bounded(md, first, end) || *l != first + 1) return SIM_OK;
    *l = end - 2; /* the loop goes on with the last layer */
    return mesh_tape_repeat_end(t, mark, (uint64_t)(end - first - 3));
}

sim_status model_remat_layer(model_dev *md, mesh_tape *t, const model_batch *b, int layer, mesh_var *x,
                             model_layer_fn fn, const char *tag, mesh_var **y, mesh_var **aux)
{
    mesh_tape *scratch = mesh_tape_new(mesh_tape_ctx(t), false);
    mesh_var *xin = mesh_tape_input(scratch, &x->val, false), *yin, *auxin = NULL;
    /* tensors the policy saves are kept only when a backward pass will use them */
    model_remat_store *store = NULL;
    if (mesh_tape_recording(t)) {
        for (int n = 0; n < MODEL_CKPT_N && !store; n++)
            if (md->def->d.ckpt[n] != MODEL_CKPT_REMAT) store = calloc(1, sizeof *store);
    }
    md->remat = store;
    mesh_replay *replay = model_replay_begin(md, mesh_tape_recording(t));
    sim_status st = fn(md, scratch, b, layer, xin, &yin, &auxin);
    model_replay_end(md);
    md->remat = NULL;
    if (aux) *aux = NULL;
    if (st == SIM_OK) {
        *y = mesh_tape_var(t);
        (*y)->val = mesh_tape_take(scratch, yin);
        if (auxin && aux) {
            *aux = mesh_tape_var(t);
            (*aux)->val = mesh_tape_take(scratch, auxin);
        }
    }
    mesh_tape_free(scratch);
    if (st != SIM_OK) store_free(md->ctx.dev, store), mesh_replay_free(replay);
    SIM_TRY(st);
    if (md->on_layer) md->on_layer(md->on_layer_arg, layer, false);
    mesh_var *outs[2] = {*y, aux ? *aux : NULL};
    mesh_entry *e = mesh_tape_record(t, remat_vjp, tag, 1, &x, outs[1] ? 2 : 1, outs);
    if (e) {
        remat_payload *p = malloc(sizeof *p);
        SIM_ASSERT(p);
        p->md = md;
        p->b = b;
        p->layer = layer;
        p->fn = fn;
        p->store = store;
        p->replay = replay;
        e->payload = p;
        e->free_payload = remat_payload_free;
    } else store_free(md->ctx.dev, store), mesh_replay_free(replay);
    return SIM_OK;
}
