/* model.h — a model as MaxText defines it, on a mesh: its dimensions read
 * from the config, its parameters (MaxText paths, stacked shapes, logical
 * axes, specs resolved with the config's rules), and each device's share of
 * them.  The forward pass (llama.c) is written against global shapes and
 * logical names; this module turns names into specs and keeps the list of
 * activations it constrained for the input_shardings.json dump. */
#ifndef MODELS_MODEL_H
#define MODELS_MODEL_H

#include <stdbool.h>
#include <pthread.h>

#include "config/config.h"
#include "mesh/nn.h"
#include "mesh/replay.h"
#include "mesh/ctx.h"
#include "mesh/rules.h"
#include "mesh/tape.h"
#include "models/core/optimizer.h"
#include "models/core/params.h"
#include "models/core/pipeline.h"
#include "models/core/timemodel.h"

/* gemma3 defines the most parameters: 13 in each of 6 scanned and up to 5 remainder layers */
enum { MODEL_MAX_PARAMS = 192, MODEL_MAX_ACTS = 96 };
/* Microbatches a dry run accounts at most (gradient_accumulation_steps with dry_run=true): it
 * simulates two, but its step-time estimate and collectives.csv go through every one.  And the most tokens one step may hold (rows x microbatches x
 * sequence: the step's host token arrays; 2^40 x 12 bytes is beyond any host). */
#define MODEL_DRY_RUN_MAX_GA 1024
#define MODEL_MAX_STEP_TOKENS (1LL << 40)

/* The tensors MaxText's layer code tags with checkpoint_name (the names remat policies save). */
typedef enum {
    MODEL_CKPT_QUERY_PROJ = 0,
    MODEL_CKPT_KEY_PROJ,
    MODEL_CKPT_VALUE_PROJ,
    MODEL_CKPT_KV_PROJ,
    MODEL_CKPT_QKV_PROJ,
    MODEL_CKPT_OUT_PROJ,
    MODEL_CKPT_MLPWI,
    MODEL_CKPT_MLPWI_0,
    MODEL_CKPT_MLPWI_1,
    MODEL_CKPT_MLPWO,
    MODEL_CKPT_CONTEXT,
    MODEL_CKPT_ATTENTION_OUT,
    MODEL_CKPT_QUERY_WA_PROJ,
    MODEL_CKPT_KV_WA_PROJ,
    MODEL_CKPT_MLA_Q,
    MODEL_CKPT_MLA_KV,
    MODEL_CKPT_DECODER_LAYER_INPUT,
    MODEL_CKPT_MOE_MLPWI_0,
    MODEL_CKPT_MOE_MLPWI_1,
    MODEL_CKPT_MOE_MLPWO,
    MODEL_CKPT_MOE_X_SORTED,
    MODEL_CKPT_MOE_ROUTING_MAPS,
    MODEL_CKPT_INDEXER_CUTOFF,
    MODEL_CKPT_ENGRAM,
    MODEL_CKPT_N
} model_ckpt_name;

/* What a remat policy does with a tagged tensor. */
typedef enum { MODEL_CKPT_REMAT = 0, MODEL_CKPT_DEVICE, MODEL_CKPT_OFFLOAD } model_ckpt_action;

/* MaxText's name of a tag ("query_proj"). */
const char *model_ckpt_name_str(model_ckpt_name n);

/* remat_recompute (shardsim's own key): a rematerialised layer's recomputation in the backward
 * pass runs its ops (allocations, collectives, records, costs) as ever; its kernels' values come
 * from the forward pass kept in host memory (never), are computed again (always), or the first
 * where the host can hold them (auto).  Losses, gradients and every figure are the same bits. */
typedef enum { MODEL_RECOMPUTE_AUTO = 0, MODEL_RECOMPUTE_ALWAYS, MODEL_RECOMPUTE_NEVER } model_remat_recompute;

/* A model family: one row per MaxText decoder_block (model_family below; the rows are in
 * models/families/families.c). */
struct model_family;
enum { MODEL_WORD_MAX = 64 }; /* a "key=value" config word a family writes (model_family.depth_words) */

typedef struct {
    char model_name[64];
    const struct model_family *family; /* decoder_block's row of the family table */
    void *family_dims;                 /* the family's own dims (its file's struct, allocated by its define hook;
                                 NULL for a family without any); model_def_free frees it */
    int64_t vocab, emb, q_heads, kv_heads, head_dim, mlp, layers;
    double eps, z_loss, rope_theta, rope_min, rope_linear;
    bool rope_llama31;          /* Llama 3.1's RoPE: model_name llama3.1* or rope_type llama3.1 (attentions.py) */
    bool rope_use_scale;        /* rope_use_scale: its frequency scaling (with rope_llama31 only) */
    bool remat_full;            /* each decoder layer is rematerialised (every remat_policy but none) */
    char remat_policy[48];      /* remat_policy as given */
    model_remat_recompute remat_recompute; /* remat_recompute: how the backward gets a layer's forward values */
    bool remat_replay;          /* this run's recomputations take the forward's values from host memory
                                   (mesh/replay.h) instead of computing them: remat_full and remat_recompute
                                   is not always (the host-memory check may turn it off, cli/hostmem.c) */
    uint8_t ckpt[MODEL_CKPT_N]; /* model_ckpt_action per tag: what the policy saves, offloads or recomputes */
    mesh_mode mode;             /* shard_mode */
    bool drop_size_one;         /* remove_size_one_mesh_axis_from_type */
    bool dry_run;
    /* counted dtypes (the simulator computes in float32; bytes follow MaxText's dtypes) */
    sim_dtype act_dtype;    /* dtype: activations, saved residuals, gathered weights, every collective */
    sim_dtype weight_dtype; /* weight_dtype: parameters, gradients, optimizer state */
    sim_dtype gather_dtype; /* a parameter's all-gathered copy and its bytes on the wire: the hardware
                                 profile's compiler rule (weight_dtype without a profile: XLA:CPU) */
    sim_dtype reduce_dtype; /* a parameter gradient's reductions, by the same rule */
    char wire_rule[192];    /* which rule set the two (model_hw_wire_dtypes): run.json, the config box */
    cfg_xla_rules xla;      /* the profile's compiler transformations (model_hw_xla_rules; all off without
                                 a profile): hoisted weight copies, accumulation buffers, Newton-Schulz
                                 gathers, windowed einsums, psum reduce-scatters */
    bool logits_dot_fp32;   /* logits_dot_in_fp32: the logits product (kernel gather included) in float32 */
    bool logits_cast_fp32;  /* cast_logits_to_fp32: logits cast to float32 before the loss */
    int64_t batch;          /* global rows of one forward pass (one microbatch; the step with ga = 1) */
    int64_t rows_loaded;    /* rows loaded per microbatch (>= batch; fractional per_device_batch_size) */
    int64_t ga;             /* gradient_accumulation_steps: microbatches per step (rows per step = ga x batch) */
    bool zero1;             /* shard_optimizer_over_data (ZeRO-1; see core/optimizer.h) */
    int64_t seq;            /* max_target_length */
    uint64_t seed;          /* init_weights_seed */
    int cp_axis;            /* mesh axis of context_sharding, -1 when absent */
    int cp;                 /* its size */
    bool cp_load_balance;   /* context_parallel_load_balance */
    bool attn_dot;          /* attention kernel: dot-product (score matrix materialised), else flash (blocked) */
    mesh_nn_splash splash;  /* flash on TPU: the splash kernel's blocks (sa_block_*), for the step-time model */
    bool scan_layers;       /* scan_layers: the layers run as one jax.lax.scan in MaxText (carry type checked) */
    model_pipe pipe;        /* pipeline parallelism (pipeline.h); pipe.on when the stage axis has size > 1 */
    /* output head and attention numerics (MaxText keys of the same names) */
    bool tied_logits;      /* logits_via_embedding: logits = y . embedding^T, no logits_dense */
    bool normalize_tied;   /* normalize_embedding_logits: tied logits / sqrt(emb) */
    double final_soft_cap; /* final_logits_soft_cap (0 = off; MaxText applies it to tied logits only) */
    double attn_soft_cap;  /* attn_logits_soft_cap (0 = off) */
    bool qk_norm_key;      /* use_qk_norm: Llama's query init loses its 1/sqrt(head_dim) (see model.c) */
    double dropout;        /* dropout_rate when enable_dropout (0 = off) */
    bool fused_mlp;        /* fused_mlp: one wi kernel (embed, num_activations, mlp) (Llama) */
    bool mlp_gelu;         /* mlp_activations [gelu, linear] (GeGLU, jax.nn.gelu's tanh form), else [silu, linear] */
    bool fused_qkv;        /* fused_qkv: one qkv_proj kernel (embed, heads + 2 kv_heads, kv) split per shard (Llama) */
    int64_t
        param_scale_mlp; /* global_parameter_scale's factor on MLP widths (DeepSeek scales base_moe_mlp_dim by it) */
    bool loss_assert;    /* loss_constraint=assert: the loss constraint as before MaxText PR #4208 */
} model_dims;

/* One activation the forward pass constrained (for input_shardings.json). */
typedef struct {
    char name[96]; /* "llama2/inputs" */
    int rank;
    int64_t shape[MESH_SPEC_MAX_RANK];
    char logical[MESH_SPEC_MAX_RANK][48];
    bool logical_known; /* false: MaxText logs "Unknown" (e.g. MoE kernels inside shard_map) */
    bool float32;       /* logged as float32 whatever dtype says (MaxText casts logits to float32) */
    mesh_spec spec;
} model_act;

typedef struct {
    model_dims d;
    const struct cfg_release *release; /* maxtext_release (config/release.h), never NULL once defined */
    mesh_shape mesh;
    mesh_rules rules;
    int nparams;
    model_param_def defs[MODEL_MAX_PARAMS];
    mesh_spec spec[MODEL_MAX_PARAMS];            /* stacked spec, size-1 axes dropped */
    mesh_spec unpruned[MODEL_MAX_PARAMS];        /* with size-1 axes (named_shardings.json) */
    const model_optimizer *opt;                  /* opt_type's row of the optimizer table */
    model_opt_param opt_param[MODEL_MAX_PARAMS]; /* how it treats each parameter (its slots, decay, class) */
    /* the optimizer state's stacked spec (ZeRO-1 adds 'data', model_zero1_spec; else = spec/unpruned) */
    mesh_spec opt_spec[MODEL_MAX_PARAMS];
    mesh_spec opt_unpruned[MODEL_MAX_PARAMS];
    /* activations seen by the forward pass, first time each, in trace order */
    pthread_mutex_t act_lock;
    int nacts;
    model_act acts[MODEL_MAX_ACTS];
    /* pipeline: the rules under which layers before the pipeline run (MaxText's
     * logical_axis_rules_pp_act_as_dp: 'stage' removed from every rule and put before
     * 'data' wherever 'data' appears); n == 0 when unused */
    mesh_rules rules_pp_dp;
    /* pipeline: device 0's wall time in its stage's layers (forward and backward), all and in bubbles */
    uint64_t pipe_layer_ns, pipe_bubble_ns;
} model_def;

/* Config getters into the model's field types (errors as cfg_get_*). */
sim_status model_cfg_i64(const cfg_config *cfg, const char *key, int64_t *out);
sim_status model_cfg_bool(const cfg_config *cfg, const char *key, bool *out);
/* A refusal naming the key, its value and where it was set, then why (SIM_ERR_INPUT). */
sim_status model_cfg_unsupported(const cfg_config *cfg, const char *key, const char *why);

/* Reads the dims, builds the mesh and the rules and defines the parameters.  On an error nothing
 * is left allocated (model_def_free on the refused def is allowed and not needed). */
sim_status model_def_from_config(const cfg_config *cfg, model_def *out);
void model_def_free(model_def *m);
/* Spec of a tensor with these logical dim names (NULL = None). */
sim_status model_logical_spec(const model_def *m, const char *tensor, int rank, const char *const *names,
                              mesh_spec *out);
/* Index of a parameter by its dotted path suffix ("self_attention.query.kernel"), or -1. */
int model_param_index(const model_def *m, const char *suffix);
/* The parameter whose path is prefix "." suffix, or -1. */
int model_param_at(const model_def *m, const char *prefix, const char *suffix);
/* Bytes of all parameters (global). */
uint64_t model_param_bytes(const model_def *m);
/* Bytes the optimizer step reads and writes in HBM on a device, from the sizes of the device's shards
 * of the parameters, gradients and optimizer state (weight_dtype each; ZeRO-1: the optimizer layout,
 * opt_spec, where the update runs): the update's elementwise passes as opt_type's row counts them
 * (model_opt_update_traffic: AdamW 2 P + G + 2 O), and the norms MaxText's train_step computes every
 * step for its metrics (P + 2 G).  Independent of what the arena holds when it peaks: a rule that
 * moves the peak's composition (muon_update_buffers, saved_product_gradient_copies) does not move it.
 * The step-time model's optimizer term (model_tm_estimate's optimizer_bytes). */
double model_opt_step_bytes(const model_def *m);

/* One device's share of the model. */
typedef struct {
    const model_def *def;
    mesh_ctx ctx;
    model_param p[MODEL_MAX_PARAMS];
    /* the saved tensors of the remat layer running (NULL outside remat or with nothing to save) */
    struct model_remat_store *remat;
    /* a remat layer running again in backward: values only its backward reads matter (XLA drops
     * the rest of the recomputation, e.g. the ring of experts' final reduce-scatter) */
    bool recomputing;
    /* bytes charged this pass by model_saved_product (cfg_xla_rules.saved_grad_copies), released with the
     * pass's backward */
    size_t saved_copy_bytes;
    /* the last forward pass's multi-token prediction loss (mtp_num_layers > 0; part of the loss) */
    double mtp_loss;
    /* ZeRO-1 in training (d.zero1, a 'data' axis > 1, an optimizer with state): the
     * stored state of each parameter as ONE stacked array in the optimizer
     * layout (opt_spec): z[i].w the parameters, z[i].slot[] the optimizer state, z[i].g
     * the step's reduce-scattered gradient (scan_dim -1, n_layers 1).  p[i].w
     * is then the all-gathered working copy the forward pass reads, p[i].g
     * the gradient sinks, and p[i] holds no slots. */
    bool zero1;
    bool zero1_released; /* p[i].w and p[i].g are released between a step's backward and the next gather */
    model_param z[MODEL_MAX_PARAMS];
    /* optional: told after each remat layer's forward and backward (progress display) */
    void (*on_layer)(void *arg, int layer, bool backward);
    void *on_layer_arg;
    /* batch-split schedule: the running layer's gathered weights, standing in for the stored
     * parameters (NULL: the parameter itself) */
    mesh_var *wover[MODEL_MAX_PARAMS];
    struct batchsplit_prefetch *bs_prefetch; /* batch split: the next layer's weights, gathered ahead */
    /* routed_bias_update_rate (model_bias_active): the global expert counts of each MoE layer in this
     * forward pass [moe layers x experts] (a remat recompute writes the same values), and their sum
     * over the step's microbatches, from which the step's bias update is taken */
    float *bias_counts, *bias_counts_step;
    size_t n_bias_counts; /* their length (model_family.step_counts; 0: none) */
} model_dev;

/* Allocates (and initialises, unless load happens later) this device's
 * parameters; with_grads/with_opt add gradient and Adam buffers. */
sim_status model_dev_init(model_dev *md, const model_def *def, sim_device *dev, bool with_grads, bool with_opt);
void model_dev_free(model_dev *md);
/* Zeroes every gradient buffer. */
void model_dev_zero_grads(model_dev *md);
/* Parameter i's layer l as a tape leaf, its gradient sunk into p[i].g[l] when recording; a weight a
 * schedule gathered for the running layer (md->wover[i]) stands in for it. */
mesh_var *model_param_leaf(model_dev *md, mesh_tape *t, int i, int l);

/* One step's batch on one device: int32 (B, T) arrays sharded like the
 * model's inputs (batch and sequence axes from the rules). */
typedef struct {
    mesh_array tokens, targets, positions;
} model_batch;

/* Loads this device's shards of the global host arrays (rows_loaded x seq;
 * only the first `batch` rows are trained on). */
sim_status model_batch_load(model_dev *md, const int32_t *inputs, const int32_t *targets, const int32_t *positions,
                            model_batch *b);
void model_batch_free(model_dev *md, model_batch *b);

/* One decoder layer: x -> y, and optionally a second output (DeepSeek's
 * load-balance loss term; NULL when the layer has none). */
typedef sim_status (*model_layer_fn)(model_dev *md, mesh_tape *t, const model_batch *b, int layer, mesh_var *x,
                                     mesh_var **y, mesh_var **aux);
/* Remat (every remat_policy but none): runs fn on a scratch tape that keeps
 * only the outputs and the tensors the policy saves (model_checkpoint_name),
 * and records one entry whose VJP runs fn again on a recording tape (its
 * all-gathers included) and back-propagates through it.  `tag` names the
 * entry (e.g. "decoder/layers_3/remat"). */
/* Remat's values (mesh/replay.h) around a layer run on md's context: begin makes the store the
 * forward fills when d.remat_replay and a backward pass follows (else NULL, nothing kept); use
 * hands it (or NULL: compute again) to the recomputation; end detaches either. */
mesh_replay *model_replay_begin(model_dev *md, bool backward_follows);
void model_replay_use(model_dev *md, mesh_replay *r);
void model_replay_end(model_dev *md);

sim_status model_remat_layer(model_dev *md, mesh_tape *t, const model_batch *b, int layer, mesh_var *x,
                             model_layer_fn fn, const char *tag, mesh_var **y, mesh_var **aux);

/* Whether parameter i is part of the pipelined layer stack (stage-held). */
bool model_param_pipelined(const model_def *m, int i);
/* Layer l of each stage of a pipelined parameter as MaxText's sharding dump
 * shows it: path decoder.pipeline_module.layers[.layers_<l> when L > 1].<rest>,
 * shape [(R,) S, per-layer dims] (R only when circular), logical names
 * (circular_repeats,) layers, ..., spec with 'stage' on the S dim (size-1 axes kept). */
sim_status model_pipe_dump_layout(const model_def *m, int i, int64_t l, char *path, size_t cap, int *rank,
                                  int64_t *shape, const char **logical, mesh_spec *spec);
/* ZeRO-1's optimizer-state spec (size-1 axes kept) of pipelined parameter i
 * in the stacked layout (stage-major, model_param_stack_layer): MaxText's
 * add_data_to_sharding applied to the [(R,) S, ...] tensors it stacks, so
 * 'data' lands on the repeat dim when R divides by it (here: after 'stage'
 * on the scan dim) or else on the first eligible per-layer dim. */
sim_status model_pipe_zero1_spec(const model_def *m, int i, mesh_spec *out);
/* Runs fn (a layer before the pipeline) under rules_pp_dp on this thread. */
sim_status model_layer_pp_as_dp(model_dev *md, mesh_tape *t, const model_batch *b, int layer, mesh_var *x,
                                model_layer_fn fn, mesh_var **y, mesh_var **aux);
/* The rules logical names resolve with on this device thread (NULL: the model's). */
void model_set_thread_rules(const mesh_rules *r);
/* Whether device `device` holds layer l of scanned parameters (always true
 * without a pipeline; with one, only its stage's layers). */
bool model_holds_layer(const model_def *m, int device, int64_t l);
/* Stores layer l of parameter p (weights or grads) into a global buffer
 * from whichever device holds it. */
sim_status model_store_layer(model_dev *md, const model_param *p, const mesh_array *a, int64_t l, void *global);
/* The output head after the final norm: logits_dense, or with logits_via_embedding the
 * transposed embedding table (normalised and soft-capped as MaxText does).  `embed` is the
 * embedding table's tape leaf, `dense_w` logits_dense's (NULL when tied). */
sim_status model_logits(model_dev *md, mesh_tape *t, mesh_var *y, mesh_var *embed, mesh_var *dense_w,
                        mesh_var **logits);

/* MaxText's checkpoint_name(x, name), called where MaxText's layer code calls it.  Inside a
 * remat layer's forward, a tensor the policy saves on the device stays alive (in the device's
 * arena, as activations) until that layer's backward, where it stands in for its recomputed twin;
 * an offloaded one is copied to host memory (outside the device arena: offloaded bytes do not
 * count toward device memory) and brought back when the backward recomputes the layer.  Outside
 * remat (remat_policy=none, a forward-only pass) it does nothing.  The recomputation runs every op
 * of the layer (values are identical) except the products whose saved outputs replace them and
 * the layer's tail (model_recomputed_dead, mesh_ctx.dead_outputs): those are left out, as XLA
 * leaves them out, so neither their FLOPs nor their weight gathers count twice. */
sim_status model_checkpoint_name(model_dev *md, mesh_var *x, model_ckpt_name name);
/* A product whose output gets checkpoint `name`, made by fn(md, t, ...) through model_dense_saved: when
 * remat recomputes the layer and the policy saved that output, nothing reads the recomputed product
 * (the saved copy replaces it), and XLA leaves it out of the recomputation; the product then runs
 * with mesh_ctx.dead_outputs (no gathers counted, no cost), its VJP unchanged. */
bool model_recomputed_dead(const model_dev *md, model_ckpt_name name);
/* A layer product whose output gets checkpoint `name`, with weight w (the device's shard of one layer's
 * slice): in a remat layer's first pass whose policy saves that output on the device for the backward, a
 * compiler with cfg_xla_rules.saved_grad_copies holds that many weight_dtype copies of w until the pass's
 * backward ends (configs/hardware/v5p.yml: saved_product_gradient_copies; SIM_MEM_GRADS, counted only).
 * Called by model_dense_saved and by the blocks whose saved tensor is a product's reshaped output
 * (attention's query/key/value, MLA's, the experts'); not for a product whose output no backward reads
 * (the MLP's wo: XLA keeps no such residual). */
sim_status model_saved_product(model_dev *md, model_ckpt_name name, const mesh_array *w);
/* Releases what model_saved_product charged (after a pass's backward). */
void model_saved_products_release(model_dev *md);
/* A layer's product with its MaxText out_sharding (explicit mode; model_out_sharding of `name`):
 * mesh_ad_einsum(sub, x, w).  model_dense_saved: the same, then checkpoint `name` on its output, the
 * product left out of a recomputation whose policy saved that output (model_recomputed_dead). */
sim_status model_dense(model_dev *md, mesh_tape *t, const char *sub, mesh_var *x, mesh_var *w, const char *name,
                       int rank, const char *const *out_names, mesh_var **y);
sim_status model_dense_saved(model_dev *md, mesh_tape *t, model_ckpt_name name, const char *sub, mesh_var *x,
                             mesh_var *w, const char *op, int rank, const char *const *out_names, mesh_var **y);
/* A region that keeps its own residuals (the routed experts, model_moe_cfg.saved): under a remat
 * layer whose policy saves something, the slot where its first pass leaves them and its
 * recomputation finds them again (called in the same order in both passes); blob_free releases
 * what is left when the layer goes.  NULL outside remat or when the policy saves nothing. */
void **model_checkpoint_region(model_dev *md, void (*blob_free)(void *));

/* MaxText's Dropout(rate=dropout_rate, broadcast_dims=(-2,)) at one site (`site` names it, e.g.
 * "decoder/layers_3/mlp"): the mask depends on (init_weights_seed, the step, the site) and the
 * global (batch, feature) index only, so every mesh, and a remat recomputation, drops the same
 * elements.  Returns x itself when dropout is off. */
sim_status model_dropout(model_dev *md, mesh_tape *t, mesh_var *x, const char *site, mesh_var **y);

/* The scalar loss of the batch on the tape (forward pass): the family's loss hook. */
sim_status model_loss(model_dev *md, mesh_tape *t, const model_batch *b, mesh_var **loss);

/* A model family (MaxText's decoder_block): everything the rest of the program asks of a decoder,
 * as hooks of one row.  Core reaches the families only through these rows (model_families,
 * defined in models/families/families.c); a family's file is the only place that knows its own
 * dims (m->d.family_dims).  A NULL hook means "nothing to do" or the default it names. */
typedef struct model_family {
    const char *name; /* decoder_block, as MaxText names it */
    /* Reads the family's keys (its dims into a family_dims it allocates), refuses what it does not
     * simulate (SIM_ERR_INPUT naming the key and the fix) and defines the parameters (model_add_param). */
    sim_status (*define)(model_def *m, const cfg_config *cfg);
    /* After the parameters' specs are resolved: checks that need them (NULL: none). */
    sim_status (*setup)(model_def *m, const cfg_config *cfg);
    /* The forward pass: token embedding, the decoder layers (each through model_remat_layer,
     * model_pipeline_run), the output head and the loss. */
    sim_status (*loss)(model_dev *md, mesh_tape *t, const model_batch *b, mesh_var **loss);
    /* Pipeline parallelism: layers that run before the pipelined stack (NULL: none; they run under
     * rules_pp_dp); refusals once the pipeline is on (NULL: none); whether scanned parameter i is
     * part of the pipelined stack (NULL: every scanned parameter); a combination the pipeline does
     * not simulate yet, as "key=value" text, or NULL (NULL hook: none). */
    int64_t (*layers_before_pipeline)(const model_def *m);
    sim_status (*pipeline_check)(model_def *m, const cfg_config *cfg);
    bool (*param_pipelined)(const model_def *m, const model_param_def *pd);
    const char *(*pipeline_unsimulated)(const model_def *m);
    /* State the step updates outside the optimizer (DeepSeek's gate bias): how many host floats of
     * per-step statistics a training device keeps (model_dev.bias_counts; NULL or 0: none), and the
     * update after the optimizer (NULL: none). */
    size_t (*step_counts)(const model_def *m);
    void (*after_step)(model_dev *md);
    /* Multi-token prediction layers (NULL: 0): the loss then carries model_dev.mtp_loss. */
    int64_t (*mtp_layers)(const model_def *m);
    /* Releases what the family keeps per device (NULL: nothing); model_dev_free calls it. */
    void (*dev_free)(model_dev *md);
    /* The logical names parameter i's gradient carries where the release followed gives it others
     * than the parameter's (a shard_map returning a kernel's gradient with its in_specs:
     * maxtext_release's grad_logical_names), into names[0..cap); returns how many, 0 for the
     * parameter's own (NULL hook: always its own). */
    int (*grad_names)(const model_def *m, int i, const char **names, int cap);
    /* The config words (with override_model_config=true) that shorten the model to `first` layers
     * before the scanned stack (layers_before_pipeline) and `rest` in it, for `shardsim plan`'s
     * sampled dry runs: written into words[0..cap), returning how many (NULL hook: the one word
     * base_num_decoder_layers=<first + rest>; model_depth_words). */
    int (*depth_words)(int64_t first, int64_t rest, char (*words)[MODEL_WORD_MAX], int cap);
} model_family;

/* The words of family f's depth_words hook, or its default. */
int model_depth_words(const model_family *f, int64_t first, int64_t rest, char (*words)[MODEL_WORD_MAX], int cap);

/* The family table, one row per simulated decoder_block (models/families/families.c). */
extern const model_family *const model_families[];
extern const int model_n_families;
/* Multi-token prediction layers of the model (0 for a family without them). */
int64_t model_mtp_layers(const model_def *m);
/* Adds a parameter definition (MaxText path, global shape, logical names, scan dim or -1, init). */
void model_add_param(model_def *m, const char *path, int rank, const int64_t *shape, const char *const *logical,
                     int scan_dim, model_init_kind init, double scale);

/* The constraint MaxText's loss_fn puts on the per-token loss (B, T), by loss_constraint:
 * reshard (MaxText 0.2.5, after PR #4208: maybe_shard_with_logical, size-1 axes dropped, a reshard in
 * explicit mode) or assert (before it: flax's with_logical_constraint, size-1 axes kept, an assert
 * in explicit mode).  Auto mode reshards either way.  note: log it for input_shardings.json. */
sim_status model_loss_constraint(model_dev *md, mesh_tape *t, mesh_var *x, bool note, mesh_var **out);

/* Logs an activation for input_shardings.json once per (name, shape), as
 * MaxText keys its entries by "name: dtype[shape]"; names == NULL logs its
 * logical axes as unknown.  Only device 0 logs (the others return at once). */
void model_note_activation(const model_dev *md, const char *name, const mesh_array *a, int rank,
                           const char *const *names, const mesh_spec *spec);
/* shard_as / constraint by logical names, recording the activation for the dump. */
/* Marks the logged activation `name` as float32 in the dump (device 0; no-op elsewhere). */
void model_note_activation_f32(const model_dev *md, const char *name);
sim_status model_shard_as(model_dev *md, mesh_tape *t, mesh_var *x, const char *dump_name, int rank,
                          const char *const *names, mesh_var **out);
sim_status model_constraint(model_dev *md, mesh_tape *t, mesh_var *x, const char *dump_name, int rank,
                            const char *const *names, mesh_var **out);
/* An explicit-mode out_sharding by logical names (NULL in auto mode, as MaxText). */
sim_status model_out_sharding(model_dev *md, const char *tensor, int rank, const char *const *names, mesh_spec *spec,
                              const mesh_spec **out);

#endif
