/* deepseek_dims.h — DeepSeek's own dims (MaxText decoder_block: deepseek), read from the config by
 * deepseek.c and kept in model_dims.family_dims: the MLA attention's, the MoE's, and the layer
 * layout (dense layers first, multi-token prediction, the batch-split schedule); the MLA and MoE
 * dims are the blocks' types (models/blocks/mla.h, moe.h).  Only the
 * DeepSeek family's files (deepseek.c, batchsplit.c) read them. */
#ifndef MODELS_DEEPSEEK_DIMS_H
#define MODELS_DEEPSEEK_DIMS_H

#include <stdbool.h>
#include <stdint.h>

#include "models/blocks/mla.h"
#include "models/blocks/moe.h"
#include "models/core/model.h"

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
