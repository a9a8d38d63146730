/* llama.c — the Llama2 decoder (MaxText's llama2 decoder_block: models/llama2.py
 * LlamaDecoderLayer) on the tape: the dense pre-norm layer (models/blocks/dense_layer.c) with
 * Llama's choices, under the generic Decoder (models/blocks/decoder.c). */
#include <math.h>
#include <string.h>

#include "models/blocks/attention.h"
#include "models/blocks/dense_layer.h"
#include "models/core/model.h"

/* LlamaDecoderLayer's MlpBlock intermediate names (activation_length, unlike Qwen3's) */
static const char *const MLP_MID[3] = {"activation_batch", "activation_length", "activation_mlp"};

/* One decoder layer, as model_remat_layer wants it (Llama layers have no second output): no
 * query/key norm (the llama2 layer does not pass use_qk_norm), MaxText folds 1/sqrt(head_dim) into
 * the query init so the score scale is 1, every residual constraint logged, dropout on the output. */
static sim_status llama_layer(model_dev *md, mesh_tape *t, const model_batch *b, int l, mesh_var *x, mesh_var **y,
                              mesh_var **aux)
{
    const model_dims *d = &md->def->d;
    model_dense_layer c = {.prefix = "llama2",
                           .residual_explicit_only = false,
                           .rope = model_dense_rope(d),
                           .scale = 1.0,
                           .soft_cap = d->attn_soft_cap,
                           .mlp_mid = MLP_MID,
                           .output_dropout = true};
    return model_dense_layer_run(md, t, b, &c, l, x, y, aux);
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
    /* MaxText's Attention.init_query_w drops the depth scaling whenever the config's use_qk_norm is
     * set, although the llama2 decoder never passes use_qk_norm to its Attention (no query/key norm
     * runs): the only effect of the key on Llama is an unscaled query init. */
    model_dense_define(m, d->qk_norm_key ? 1.0 : 1.0 / sqrt((double)d->head_dim), false);
    return SIM_OK;
}

/* ------------------------------------------------------------ the whole model */

static sim_status llama_loss(model_dev *md, mesh_tape *t, const model_batch *b, mesh_var **loss)
{
    return model_dense_loss(md, t, b, llama_layer, loss);
}

/* MaxText's decoder_block llama2 (Llama 2, 3, 3.1, 3.3 model files): every layer scanned and
 * pipelined alike, nothing updated outside the optimizer. */
const model_family model_family_llama2 = {
    .name = "llama2",
    .define = llama_define,
    .setup = model_dense_setup,
    .loss = llama_loss,
};
