/* mla.h — DeepSeek's multi-head latent attention as a block (MaxText layers/attention_mla.py):
 * x (B, T, E) -> (B, T, E) through a low-rank query (or a plain one), a compressed key-value
 * latent, one rotary key head shared by every head, and the attention kernel.  A family keeps the
 * dims in its own and names the block's parameters (model_mla_params_at); the DeepSeek layer and
 * the batch-split schedule both run it. */
#ifndef MODELS_BLOCKS_MLA_H
#define MODELS_BLOCKS_MLA_H

#include <stdbool.h>
#include <stdint.h>

#include "models/core/model.h"

/* Multi-head latent attention (attention_mla.py) and its YaRN RoPE. */
typedef struct {
    int64_t q_lora, kv_lora;                          /* q_lora_rank (0: plain query projection), kv_lora_rank */
    int64_t qk_nope, qk_rope, v_head;                 /* MLA head dims */
    double rope_factor, beta_fast, beta_slow, mscale; /* YaRN */
    int64_t max_pos, orig_max_pos;                    /* max_position_embeddings, original_max_position_embeddings */
    bool yarn, rope_interleave, rope_truncate, rope_attn_scaling;
} model_mla_dims;

/* The block's parameters: indices into model_def (-1 when absent: query without q_lora_rank,
 * wq_a / q_norm / wq_b with it). */
typedef struct {
    int query, wq_a, q_norm, wq_b, wkv_a, kv_norm, wkv_b, out;
} model_mla_params;

/* The parameters under `prefix` (a layer stack, "params.decoder.moe_layers", or an MTP layer):
 * prefix.self_attention.{query,wq_a,...}. */
model_mla_params model_mla_params_at(const model_def *m, const char *prefix);

/* MLA on x (B, T, E) -> y (B, T, E) with layer l of the parameters p; b's positions drive the
 * rotary embedding.  In explicit mode refuses what MaxText 0.2.5 refuses (its q_norm / kv_norm,
 * YaRN frequencies and rotary positions keep shardings JAX cannot reconcile), with JAX's words. */
sim_status model_mla(model_dev *md, mesh_tape *t, const model_batch *b, const model_mla_dims *mla,
                     const model_mla_params *p, int l, mesh_var *x, mesh_var **y);

#endif
