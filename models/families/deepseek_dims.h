/* deepseek_dims.h — DeepSeek's own dims (MaxText decoder_block: deepseek), read from the config by
 * deepseek.c and kept in model_dims.family_dims: the MLA attention's, the MoE's, and the layer
 * layout (dense layers first, multi-token prediction, the batch-split schedule); the MLA dims
 * are the block's type (models/blocks/mla.h).  Only the
 * DeepSeek family's files (deepseek.c, batchsplit.c) read them. */
#ifndef MODELS_DEEPSEEK_DIMS_H
#define MODELS_DEEPSEEK_DIMS_H

#include <stdbool.h>
#include <stdint.h>

#include "models/blocks/mla.h"
#include "models/core/model.h"

/* The routed and shared experts (moe.py). */
typedef struct {
    int64_t moe_mlp;        /* base_moe_mlp_dim: hidden width of one routed expert */
    int64_t experts, top_k; /* num_experts, num_experts_per_tok */
    int64_t shared_experts; /* shared_experts (shared MLP width = shared_experts x moe_mlp) */
    double routed_scale;    /* routed_scaling_factor */
    int routed_score;       /* routed_score_func: model_moe_score (none, sigmoid, softmax) */
    bool routed_sigmoid;    /* routed_score_func sigmoid: the top-k weights are renormalised */
    bool routed_bias;       /* gate bias */
    bool
        bias_selects_only; /* model_name deepseek3.. or deepseek4..: the bias picks experts, pre-bias scores weigh them */
    int routing_groups;    /* n_routing_groups with DeepSeek-V3 routing (0: off, and for other model names) */
    int topk_groups;       /* topk_routing_group: groups kept per token */
    bool random_routing;   /* use_random_routing */
    double bias_update_rate;    /* routed_bias_update_rate: loss-free balancing of the MoEBiasVar gate bias */
    double lb_weight;           /* load_balance_loss_weight */
    double capacity_factor;     /* > 0: dense capacity path; else the sparse dropless path */
    bool shard_exp_on_fsdp;     /* shard_exp_on_fsdp: MoE kernel logical axes with embed_moe on the expert dim */
    bool ring_of_experts;       /* use_ring_of_experts on the sparse path: tokens all-gathered over the expert axes */
    int64_t gmm_tiles[2][3][3]; /* sparse path with megablox (not tokamax): the wi_/wo_tile_{fwd,dlhs,drhs}_
                                 * {batch_seq,embed_dim,mlp_dim} triples for the step-time model; 0: untiled */
} model_moe_dims;

typedef struct {
    int64_t dense_layers; /* first_num_dense_layers (the rest are MoE layers) */
    model_mla_dims mla;
    model_moe_dims moe;
    int64_t mtp_layers;   /* mtp_num_layers: DeepSeek-V3's multi-token prediction depth (0: none) */
    double mtp_scale;     /* mtp_loss_scaling_factor */
    bool batch_split;     /* use_batch_split_schedule: the MoE layers run batchsplit.c's schedule */
    int64_t split_factor; /* batch_split_factor (2 when batch_split) */
} ds_dims;

/* The DeepSeek dims of a model whose family is DeepSeek's. */
static inline ds_dims *deepseek_dims(const model_def *m) { return m->d.family_dims; }

#endif
