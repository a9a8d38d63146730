/* init.h — mesh-independent parameter initialisation.
 *
 * The value of element i (global row-major index) of a tensor is a pure
 * function of (seed, tensor name, i): a counter-based generator, so each
 * device computes only its own shard and every mesh builds the same global
 * tensor.  Layer l of a scanned parameter P is the tensor named "P/layer_l"
 * (model_init_layer_name), so a layer's values depend neither on the mesh nor
 * on how the layers are stored.
 *
 * Generator: key = splitmix64(splitmix64(seed + golden) ^ fnv1a64(name));
 * word n of a tensor = splitmix64 output n of a stream started at key
 * (mix(key + n * 0x9E3779B97F4A7C15)).  Element i owns words
 * 64*i+1 .. 64*i+64 and draws from them in order, so its value never depends
 * on its neighbours.  A standard normal is Doornik's ZIGNOR ziggurat (128
 * strips; one word per draw 98.8% of the time: strip from the low 7 bits, a
 * uniform in (-1, 1) from the top 53; wedge and tail draws take more words).
 * NORMAL multiplies it by `scale`.  TRUNC_NORMAL (MaxText's variance_scaling
 * 'truncated_normal') re-draws until |z| <= 2 and multiplies by
 * scale / 0.87962566103423978, the standard deviation of N(0,1) cut at +-2,
 * so the result has standard deviation exactly `scale` and lies in
 * [-2.2737 scale, 2.2737 scale] — what jax.nn.initializers.variance_scaling
 * does with stddev = sqrt(variance).  `scale` is the target standard
 * deviation for NORMAL and TRUNC_NORMAL, ignored for ONES and ZEROS. */
#ifndef MODELS_INIT_H
#define MODELS_INIT_H

#include <stdint.h>

#include "models/core/params.h"

/* Standard deviation of N(0, 1) truncated to [-2, 2] (jax's constant). */
#define MODEL_TRUNC_NORMAL_STD 0.87962566103423978
/* Words of the stream each element owns. */
#define MODEL_INIT_WORDS 64

/* "P/layer_l" for layer l of a scanned parameter, P for an unscanned one (layer < 0). */
const char *model_init_layer_name(const char *path, int layer, char *buf, size_t cap);

/* The 64-bit key of a tensor (seed and name mixed). */
uint64_t model_init_key(uint64_t seed, const char *name);

/* Host side: fills out[0..n) with global elements first .. first+n-1 of tensor `name`. */
void model_init_range(float *out, int64_t first, int64_t n, const char *name, model_init_kind kind, double scale,
                      uint64_t seed);
/* Host side: the whole global tensor of n elements (row-major). */
void model_init_global(float *out, int64_t n, const char *name, model_init_kind kind, double scale, uint64_t seed);

/* Fills this device's shard of `a` (float32) from the global indices of its
 * elements.  Partial axes: devices off coordinate 0 on them hold zeros.  In
 * dry run nothing is written. */
sim_status model_init_fill(sim_device *d, const mesh_shape *m, mesh_array *a, const char *name, model_init_kind kind,
                           double scale, uint64_t seed);

/* Fills w[l] of every parameter from its def (init kind, scale), layer l of a
 * scanned parameter under model_init_layer_name(path, l). */
sim_status model_params_init(sim_device *d, const mesh_shape *m, model_param *params, int n, uint64_t seed);

/* Fills this device's shard of `a`, an array of p's STACKED global shape
 * (any spec, no partial axes), with the values model_params_init gives the
 * per-layer arrays (ZeRO-1's stored parameters: made in place, as MaxText's
 * sharded init makes them, with no communication). */
sim_status model_init_fill_stacked(sim_device *d, const mesh_shape *m, const model_param *p, mesh_array *a,
                                   uint64_t seed);

#endif
