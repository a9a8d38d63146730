/* ctx.h — what every sharded op needs to know about where it runs: the
 * device, the mesh, the shard mode, how size-1 axes compare, and the layer
 * path used in collective tags and error messages.  One per device thread. */
#ifndef MESH_CTX_H
#define MESH_CTX_H

#include <stdbool.h>

#include "mesh/mesh_shape.h"
#include "sim/machine.h"

typedef enum {
    MESH_MODE_AUTO = 0, /* constraints reshard; disagreements resolved by the cheapest reshard (implicit) */
    MESH_MODE_EXPLICIT  /* JAX sharding-in-types: constraints assert, only reshard changes a sharding */
} mesh_mode;

struct mesh_tape;          /* the autodiff tape; NULL when not recording */
struct mesh_reshard_cache; /* resharded operand copies to reuse (mesh/reshard.h) */
struct cfg_release;        /* the MaxText release followed (config/release.h) */
struct mesh_replay;        /* a remat layer's forward values (mesh/replay.h) */

typedef struct {
    sim_device *dev;                   /* this device */
    const mesh_shape *mesh;            /* the mesh (axis order = sim axis order) */
    mesh_mode mode;                    /* shard_mode */
    const struct cfg_release *release; /* maxtext_release: the explicit-mode errors raised and the release
                                   named in them; NULL = the default release's */
    bool drop_size_one;                /* remove_size_one_mesh_axis_from_type: compare specs without size-1 axes */
    const char *layer;                 /* current layer path ("decoder/layers/self_attention"), for tags and errors */
    struct mesh_tape *tape;            /* where ops record themselves for backward, or NULL */
    struct mesh_reshard_cache *cache;  /* operand reshards already made and still valid, or NULL */
    bool dead_outputs;                 /* what the ops make now is read by nothing, forward or backward (a
                                   rematerialised layer's tail: XLA removes it from the recomputation),
                                   so a reshard gives the target layout without moving or counting data */
    const sim_dtype *operand_gather;   /* non-NULL: a computed operand resharded for an op is counted (held and
                                   moved) in this dtype (a compiler's cast moved before the gather) */
    bool single_use;                   /* a weight gathered for the op running serves it alone (set by the autodiff
                                   layer: mesh_tape_single_use), so the compiler may window the product */
    bool embed_all_to_all;             /* mesh_nn_embed all-gathers the token ids and all-to-alls the looked-up rows
                                   where the table's embed dim is split by axes that split the tokens' batch
                                   (XLA:TPU) instead of gathering the table (XLA:CPU) */
    bool psum_grads;                   /* the gradients accumulated now are a shard_map's sums over its replicated
                                   inputs' groups (sim_meta.psum) */
    struct mesh_replay *replay;        /* non-NULL while a remat layer runs: its forward keeps the heavy kernels'
                                   outputs there, its recomputation takes them instead of running the kernels */
    double product_flops;              /* the FLOPs on this device of the last einsum (mesh_einsum): the weight
                                   gradient one product made is reduced right after it (sim_meta.product_flops) */
    uint64_t product_other_bytes;      /* for that reduction: the bytes of an operand the compiler gathers inside
                                   the product (sim_meta.product_other_bytes), 0: none */
    bool regather;                     /* the op running is a backward product whose weight the compiler gathers
                                   again instead of reusing the recomputation's gather (mesh_entry.regather) */
    const sim_dtype *out_counted;      /* non-NULL: an einsum's output is counted (held) in this dtype, where the
                                   modelled compiler writes the product narrower than it computes it */
} mesh_ctx;

#endif
