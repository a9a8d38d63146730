/* decoder.h — MaxText's Decoder around a family's layer (layers/nnx_decoders.py): the token
 * embedding, the layer stack (each layer through model_remat_layer, or the whole stack as
 * MaxText's pipeline), the final RMSNorm, the output head and the cross-entropy loss, plus the
 * load-balance losses the layers return as their second output (MoE layers).  A family whose
 * every layer is alike (no MTP, no dense layers before MoE ones) builds its loss hook from this
 * block and its own layer function. */
#ifndef MODELS_BLOCKS_DECODER_H
#define MODELS_BLOCKS_DECODER_H

#include "models/core/model.h"

typedef struct {
    model_layer_fn layer; /* one decoder layer (its aux output: its load-balance loss, or NULL) */
    int embed;            /* token_embedder.embedding (model_param_index) */
    int norm;             /* decoder_norm.scale */
    int logits;           /* logits_dense.kernel, -1 with logits_via_embedding */
    int units;            /* how many times `layer` runs, each one remat unit (layer = 0..units-1): a
                             family that scans blocks of several layers (gemma3) passes its block count;
                             0: one per decoder layer (d.layers) */
    int scanned_units;    /* with units: how many leading units MaxText's scan runs (the others, gemma3's
                             layers_remainder, run unscanned, so no carry check) */
} model_decoder_block;

/* The scalar loss of the batch (the family's loss hook). */
sim_status model_decoder_loss(model_dev *md, mesh_tape *t, const model_batch *b, const model_decoder_block *dec,
                              mesh_var **loss);

#endif
