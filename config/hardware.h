/* hardware.h — hardware profiles (<configs>/hardware/NAME.yml): one accelerator's published
 * figures (peak FLOP/s, HBM, links), the slice's torus, and what its compiler does to MaxText's
 * step (the dtypes weight collectives move in, the program transformations: docs/xla-fidelity.md).
 *
 * A config selects a profile with hardware_profile=NAME, else through compile_topology's family
 * (v5p-8 -> v5p).  The profile is read once per config: the first cfg_hw_from_config reads the
 * file and keeps it in the config; the wire dtypes, the compiler rules, Muon's Newton-Schulz
 * gathers and the time model (models/core/timemodel.h, which keeps the computations) reuse it. */
#ifndef CONFIG_HARDWARE_H
#define CONFIG_HARDWARE_H

#include <stdbool.h>
#include <stddef.h>

#include "config/config.h"

/* What the profile's compiler does to MaxText's step beyond the dtypes it moves weights in: each field
 * a key of the profile (configs/hardware/v5p.yml gives each one's evidence; docs/xla-fidelity.md). */
typedef struct {
    bool hoist_casts;           /* hoisted_weight_copies: dtype -- each layer stack's float32 weights cast to
                                 `dtype` once, the device's shard held through the forward and backward loops */
    int ga_grad_copies;         /* accumulation_gradient_copies: gradient sets held beside the gradients while
                                 gradient accumulation runs */
    int saved_grad_copies;      /* saved_product_gradient_copies: weight_dtype copies of a layer weight's device
                                 shard held through the step for each product whose output the remat policy
                                 saves for the backward */
    bool ns_gather_bf16;        /* newton_schulz_gather_dtype: bfloat16 -- float32 Newton-Schulz operands cast
                                 before their gathers (with a one-pass matmul_precision) */
    bool ns_gather_once;        /* newton_schulz_operand_gathers: once -- one gather of X serves X X^T and B X */
    bool muon_stacked;          /* muon_update_buffers: stacked -- every Muon leaf's float32 momentum estimate is
                                 formed (its gradient's last read) before the first Newton-Schulz and held until
                                 the leaf's update, and each step's float32 product B X is held until then too */
    int windowed_min_group;     /* windowed_einsum_min_group: weight products over groups at least this large
                                 run as windowed einsums (0: never) */
    double windowed_ici_bw;     /* windowed_einsum_ici_gbps (bytes/s): the link rate of the compiler's windowed-
                                 einsum cost model; 0: the group size alone decides */
    double windowed_peak;       /* the FLOP/s that model times products at (windowed_einsum_tflops) */
    int torus[3], torus_n;      /* the slice's physical shape, for that model's link count (cfg_hw.torus) */
    int psum_scatter_max_group; /* psum_scatter_max_group: a shard_map's gradient psum and slice become a
                                 reduce-scatter over at most this many devices, else an all-reduce (0: always) */
    bool regather_far;          /* weight_gather_cse: near -- two gathers of one weight merge only when their
                                 products lie close in the layer's dataflow: a rematerialised MoE layer's
                                 products ahead of the routing gather their weight again for the input gradient */
    int lane_scatter_ar_max;    /* gradient_lane_scatter_max_all_reduce: a weight gradient's reduce-scatter along
                                 its last dim leaving at most this many elements per device stays an all-reduce
                                 of the whole gradient (0: never) */
    bool embed_all_to_all;      /* embedding_lookup: all_to_all -- under FSDP the token ids are all-gathered, the
                                 rows looked up on the table's shard and all-to-all'd back (gather_table: the
                                 table is all-gathered and its gradient reduce-scattered) */
    bool norm_splits_product;   /* low_rank_norm_sharding: scale -- in auto mode MLA's q_norm and kv_norm scales,
                                 split over `tensor` on the normalised dim, split the low-rank product they
                                 normalise the same way: it is gathered after the norm for the next product
                                 (again for that product's weight gradient where weight_gather_cse is near)
                                 and its cotangent reduce-scattered (counted only) */
} cfg_xla_rules;

/* One accelerator, per JAX device (a chip's figures divided by devices_per_chip). */
typedef struct {
    char name[32];         /* profile name (file stem): "v5p" */
    bool gpu;              /* kind: gpu (NVLink switch in a node) or tpu (torus links) */
    int devices_per_chip;  /* JAX devices per chip */
    double peak_bf16;      /* FLOP/s, dense bfloat16 */
    double peak_fp8;       /* FLOP/s, dense float8; 0 = not published */
    double peak_f32;       /* FLOP/s, float32; 0 = not published */
    double hbm_bytes;      /* HBM capacity, bytes */
    double hbm_bw;         /* HBM bandwidth, bytes/s */
    double link_bw;        /* TPU: one ICI link, one direction, bytes/s; GPU: NVLink injection per
                                 direction; 0 = not published (collectives cannot be timed) */
    double dcn_bw;         /* DCN per device, bytes/s; 0 = not published */
    int torus[3], torus_n; /* physical shape of the slice (torus_n = 0 when the profile has none) */
    bool gather_in_dtype;  /* weight_gather_dtype: dtype -- the compiler casts a float32 weight's shard to
                                 `dtype` before its all-gather (false: weight_dtype, the stored dtype) */
    bool reduce_in_dtype;  /* gradient_reduction_dtype: dtype -- parameter gradients are reduced in `dtype` */
    cfg_xla_rules xla;     /* the compiler's program transformations (hoisted_weight_copies, ...) */
} cfg_hw;

/* Profile names in <configs>/hardware (sorted, comma separated) into buf. */
const char *cfg_hw_names(const char *configs_dir, char *buf, size_t cap);
/* Loads <configs>/hardware/NAME.yml for a slice of `devices_per_slice` devices (0: unknown);
 * an unknown name is SIM_ERR_INPUT listing the valid ones. */
sim_status cfg_hw_load(const char *configs_dir, const char *name, int devices_per_slice, cfg_hw *out);
/* The profile a config selects: hardware_profile=NAME, else compile_topology's family
 * (v5p-8 -> v5p), from <configs> of the config; *found = false when neither is set.  Read once per
 * config (kept in it); the torus is that of a slice of devices_per_slice devices (0: unknown). */
sim_status cfg_hw_from_config(const cfg_config *cfg, int devices_per_slice, cfg_hw *out, bool *found);
/* A figure of a profile: a number >= 0, or 0 for null or absent (not published); `file` and
 * `key` name it in the error. */
sim_status cfg_hw_figure(const cfg_value *v, const char *file, const char *key, double *out);

#endif
