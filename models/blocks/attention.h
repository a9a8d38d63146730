/* attention.h — MaxText's Attention (layers/attentions.py) with global causal MHA/GQA on the tape:
 * the self-attention block the dense families build on, as llama.cpp's build_attn.
 *
 *   q, k, v = x . query, x . key, x . value   (or one fused_qkv product split per shard)
 *   q, k    = query_norm(q), key_norm(k)      (use_qk_norm: RMSNorm over head_dim, before RoPE)
 *   q, k    = rope(q), rope(k)
 *   o       = attention(q * query_pre_attn_scalar, k, v) . out
 *
 * with Attention's own logical names (input, query/key/value, out axis names of train mode), its
 * checkpoint tags (query_proj, key_proj, value_proj or qkv_proj, attention_out, out_proj) and its
 * out_shardings in explicit mode.  What differs between decoder layers is a field: the query/key
 * norms, the RoPE, the score scale, the soft cap.  Weights are read by parameter index through
 * model_param_leaf when their product runs. */
#ifndef MODELS_BLOCKS_ATTENTION_H
#define MODELS_BLOCKS_ATTENTION_H

#include "blas_kernels/bk_rope.h"
#include "models/core/model.h"

typedef struct {
    int query, key, value;        /* (embed, heads | kv_heads, head_dim) kernels; -1 with qkv */
    int qkv;                      /* fused_qkv: the (embed, heads + 2 kv_heads, head_dim) kernel, else -1 */
    int out;                      /* (heads, head_dim, embed) */
    int query_norm, key_norm;     /* use_qk_norm: the (head_dim) RMSNorm scales, else -1 */
    double norm_eps;              /* their epsilon (normalization_layer_epsilon) */
    int layer;                    /* index into the parameters' stacks */
    bk_rope_params rope;          /* the rotary embedding of query and key */
    double scale;                 /* query_pre_attn_scalar (1: MaxText folds 1/sqrt(head_dim) into the
                                        query init instead) */
    double soft_cap;              /* attn_logits_soft_cap as the layer passes it (0: none) */
    int64_t sliding_window;       /* attention_type=local_sliding as the layer passes it: sliding_window_size
                                     (AttentionOp's mask, attention_op.py); 0: global causal */
    const char *const *out_names; /* 3 logical names of out's out_sharding (the layer's out_sharding) */
    const struct model_attention_extra *extra; /* biases and sinks (NULL: none) */
} model_attention_block;

/* Attention's optional parameters (gpt_oss): the projections' biases (use_bias_in_projections, from
 * attention_bias: DenseGeneral's bias added to query, key, value and out) and the sinks
 * (attention_sink: one softmax logit per query head, attention_op.py).  -1: none. */
typedef struct model_attention_extra {
    int query_bias, key_bias, value_bias, out_bias;
    int sinks;
} model_attention_extra;

/* x (B, T, E) -> y (B, T, E), the causal self-attention of the batch's positions. */
sim_status model_attention(model_dev *md, mesh_tape *t, const model_batch *b, const model_attention_block *a,
                           mesh_var *x, mesh_var **y);

/* For a decoder block whose layer builds its Attention without attention_type (MaxText 0.2.5's
 * llama2, mistral, mixtral, qwen3: Attention's default AttentionType.GLOBAL, which
 * attention_op.py's _resolve_attention_type keeps whatever the config says): attention_type other
 * than global is refused, naming the block and the layer file, since MaxText would run global
 * attention there and apply no window. */
sim_status model_attention_global_only(const cfg_config *cfg, const char *block, const char *layer);

#endif
