/* data.h — mesh-independent training batches.
 *
 * The global batch of step s is a pure function of (config, seed, s): every
 * mesh trains on the same tokens.  model_batch_global fills host arrays with
 * the whole global batch; devices then take their shards of it.
 *
 *   dataset_type=synthetic (default): row r of step s is T+1 tokens of the
 *     sequence x[t+1] = (a * x[t] + c) mod Vs, started at a random token
 *     x[0] = h mod Vs, h = mix(mix(mix(seed + G) + s*G) + (r+1)*G) with mix
 *     the splitmix64 finaliser and G its increment.  Vs = min(vocab_size, 256)
 *     keeps the pattern small enough that a 2-layer model learns the whole
 *     next-token map in a few steps whatever the vocabulary (a permutation of
 *     V=32000 tokens would need far more tokens than 20 steps show it); a is
 *     the first integer >= 5 coprime with Vs (so the map is a permutation:
 *     no short cycles) and c = 3 % Vs.
 *   dataset_type=text dataset_path=FILE: byte tokens (vocab 256; vocab_size
 *     must be >= 256).  Row r of step s (B rows) is the T+1 bytes at offset
 *     ((s*B + r) * T) mod (file_size - T - 1); the file needs >= T+2 bytes.
 *
 * Inputs are the first T tokens of a row, targets the last T, positions
 * 0..T-1.  Context parallelism reorders each row into MaxText's
 * load-balanced chunk order (model_reorder_load_balanced). */
#ifndef MODELS_DATA_H
#define MODELS_DATA_H

#include <stdint.h>

#include "config/config.h"
#include "sim/status.h"

typedef enum { MODEL_DATA_SYNTHETIC = 0, MODEL_DATA_TEXT } model_data_type;

enum { MODEL_DATA_PATH_MAX = 4096, MODEL_SYNTHETIC_VOCAB_MAX = 256 };

typedef struct {
    model_data_type type;
    int64_t vocab;                  /* vocab_size */
    int64_t seq;                    /* T = max_target_length */
    uint64_t seed;                  /* data_shuffle_seed */
    char path[MODEL_DATA_PATH_MAX]; /* dataset_path (text) */
    int fd;                         /* open file (text), else -1 */
    int64_t file_size;              /* bytes of the file (text) */
    int64_t syn_vocab;              /* Vs: tokens the synthetic pattern uses */
    int64_t syn_a, syn_c;           /* synthetic x[t+1] = (a x[t] + c) mod Vs */
} model_data;

/* Opens a stream from explicit settings (path is used for text only). */
sim_status model_data_open(model_data *d, model_data_type type, int64_t vocab, int64_t seq, uint64_t seed,
                           const char *path);
/* Reads dataset_type, dataset_path, vocab_size, max_target_length, data_shuffle_seed. */
sim_status model_data_from_config(const cfg_config *cfg, model_data *d);
void model_data_close(model_data *d);

/* The global batch of step `step`, `rows` rows of T tokens each, row-major
 * (rows, T): inputs, targets, positions (any may be NULL). */
sim_status model_batch_global(const model_data *d, int64_t step, int64_t rows, int32_t *inputs, int32_t *targets,
                              int32_t *positions);

/* MaxText's batch sizes (types.py calculate_global_batch_sizes) for one
 * microbatch: rows_trained = int(num_devices * pdbs); rows_loaded = that for
 * pdbs >= 1, num_devices for pdbs < 1 (loaded as if pdbs = 1, then only the
 * first rows_trained rows are used).  Error when rows_trained < 1. */
sim_status model_batch_rows(int num_devices, double per_device_batch_size, int64_t *rows_loaded, int64_t *rows_trained);

/* Context-parallel load balancing of every row of rows (B, T): the sequence
 * is cut into 2*cp chunks and rearranged so that the contiguous shard d of
 * cp holds chunks d and 2cp-1-d: order c0, c(2cp-1), c1, c(2cp-2), ...
 * (MaxText reorder_causal_load_balanced).  T must divide by 2*cp.  Apply it
 * to inputs, targets and positions alike. */
sim_status model_reorder_load_balanced(int32_t *rows, int64_t B, int64_t T, int cp);
/* The inverse (MaxText to_contiguous=True). */
sim_status model_reorder_load_balanced_inverse(int32_t *rows, int64_t B, int64_t T, int cp);

#endif
