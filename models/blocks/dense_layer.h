/* dense_layer.h — the pre-norm decoder layer that Llama (MaxText's LlamaDecoderLayer,
 * models/llama2.py), Mistral, Qwen3 (Qwen3DecoderLayer over AttentionWithNorm, models/qwen3.py)
 * and, with the routed experts as their feed-forward half, Mixtral (MixtralDecoderLayer) and Qwen3
 * MoE (Qwen3MoeDecoderLayer) share:
 *
 *   h = x + attention(rmsnorm(x))         (pre_self_attention_layer_norm, self_attention)
 *   y = h + ffn(rmsnorm(h))               (post_self_attention_layer_norm, mlp or the MoE block)
 *
 * with the residual stream constrained to (activation_batch, activation_norm_length,
 * activation_embed) under the family's names ("llama2/inputs", ...).  What differs between the two
 * is a field of model_dense_layer: the query/key norms, the RoPE, the score scale, the soft cap,
 * the MLP's intermediate names, whether the residual constraints are logged in auto mode and
 * whether dropout runs on the layer's output.  The parameters (model_dense_define) are the same
 * MaxText paths, with the query/key norm scales when the family has them. */
#ifndef MODELS_BLOCKS_DENSE_LAYER_H
#define MODELS_BLOCKS_DENSE_LAYER_H

#include "blas_kernels/bk_rope.h"
#include "models/core/model.h"

/* The layer's parameters (model_param_index; -1 where the model has none). */
typedef struct {
    int q, k, v, qkv, o, qn, kn, ln1, ln2, wi0, wi1, wi, wo, embed, norm, logits;
} model_dense_ix;

/* The feed-forward half of a layer other than the dense MlpBlock (the routed MoE: model_moe_ffn in
 * models/blocks/moe.h): hs (B, T, E), the post-attention norm's output (hidden_states), -> *y
 * (B, T, E) with layer l of the parameters, under the scope name `scope`
 * ("decoder/layers_<l>/<ffn_scope>"); *aux its second output (a load-balance loss term) or NULL.
 * arg is the family's model_dense_layer.ffn_arg. */
typedef sim_status (*model_dense_ffn_fn)(model_dev *md, mesh_tape *t, const void *arg, int l, mesh_var *hs,
                                         const char *scope, mesh_var **y, mesh_var **aux);

/* A family's choices for its layer. */
typedef struct {
    const char *prefix;          /* the constraints' names: "<prefix>/inputs", "<prefix>/lnx", ... */
    bool residual_explicit_only; /* AttentionWithNorm: the residual constraints apply (and are logged)
                                        in explicit mode only; auto mode places the residual with the same
                                        names, unlogged */
    bk_rope_params rope;         /* the rotary embedding */
    double scale;                /* query_pre_attn_scalar (1: folded into the query init) */
    double soft_cap;             /* attn_logits_soft_cap as the layer passes it (0: none) */
    const char *const *mlp_mid;  /* 3 logical names of the MLP's intermediate_sharding */
    bool output_dropout;         /* dropout on the layer's output (Llama's layer, not Qwen3's) */
    model_dense_ffn_fn ffn;      /* the feed-forward half; NULL: the dense MlpBlock (mlp.wi_0, wi_1 or wi, wo) */
    const void *ffn_arg;         /* ffn's argument */
    const char *ffn_scope;       /* the feed-forward half's scope name under the layer; NULL: "mlp" */
    bool ffn_output_first;       /* the residual sum as mlp_lnx + intermediate_inputs (MixtralDecoderLayer's
                                    operand order); else intermediate_inputs + mlp_lnx */
} model_dense_layer;

/* The layer's parameters; query_norm/key_norm run before RoPE when their scales are defined. */
model_dense_ix model_dense_indices(const model_def *m);
/* MaxText's Attention RoPE for these dims: default (rope_min_timescale, rope_max_timescale,
 * rope_linear_scaling_factor) or Llama 3.1's (LLaMARotaryEmbedding, which reads no linear factor). */
bk_rope_params model_dense_rope(const model_dims *d);

/* Layer l: x (B, T, E) -> y (B, T, E); *aux the feed-forward half's second output (NULL for the
 * dense MlpBlock), as model_layer_fn returns it. */
sim_status model_dense_layer_run(model_dev *md, mesh_tape *t, const model_batch *b, const model_dense_layer *c, int l,
                                 mesh_var *x, mesh_var **y, mesh_var **aux);

/* Defines the model's parameters in MaxText's order: the embedding, the scanned layer stack (the
 * query kernel's init scaled by query_init_scale on top of 1/sqrt(embed); the query/key norm scales
 * with qk_norm) and the head. */
void model_dense_define(model_def *m, double query_init_scale, bool qk_norm);
/* The two ends model_dense_define is made of, for a layer with another MLP (mixtral, qwen3_moe): the
 * embedding, the attention half (pre-norm, query/key/value or qkv_proj, the query/key norms with qk_norm,
 * out, the post-attention norm), and the head (decoder_norm, logits_dense unless tied). */
void model_dense_define_attention(model_def *m, double query_init_scale, bool qk_norm);
void model_dense_define_head(model_def *m);

/* What a family of the dense layer does not simulate, refused naming the key: a global-only
 * Attention (model_attention_global_only), rope_type other than default (or Llama 3.1's RoPE),
 * mtp_num_layers != 0, and as the family says attn_logits_soft_cap != 0, use_mrope and fused_mlp. */
typedef struct {
    const char *block;     /* decoder_block, as the messages name it */
    const char *layer;     /* MaxText's layer, "models/mistral.py MistralDecoderLayer" */
    bool no_soft_cap;      /* the layer passes no attn_logits_soft_cap (MaxText's models/<block>.py) */
    bool no_mrope;         /* Qwen3's multimodal RoPE (use_mrope) is not simulated */
    bool experts;          /* the feed-forward half is routed experts: nothing to fuse (fused_mlp) */
} model_dense_refusals;
sim_status model_dense_refuse(const cfg_config *cfg, const model_dims *d, const model_dense_refusals *r);

/* The setup hook of a dense family: MaxText runs the batch-split schedule for DeepSeek only, so
 * use_batch_split_schedule=true is refused naming the key. */
sim_status model_dense_setup(model_def *m, const cfg_config *cfg);

/* The loss of a model of these layers (a family's loss hook, through the generic Decoder). */
sim_status model_dense_loss(model_dev *md, mesh_tape *t, const model_batch *b, model_layer_fn layer, mesh_var **loss);

#endif
