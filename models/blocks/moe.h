/* moe.h — the routed mixture-of-experts ops of DeepSeek (MaxText layers/moe.py,
 * reference/maxtext-facts.md §6) on the autodiff tape:
 *
 *   scores    router scores: sigmoid or softmax of the gate logits;
 *   route     top-k of (scores + bias) with ties to the lowest expert index
 *             (optionally within the best groups, or random draws), the
 *             weights (pre-bias scores for DeepSeek-V3, else the biased
 *             values), renormalised for sigmoid, times routed_scaling_factor;
 *   lb_loss   the sequence-wise load-balance loss;
 *   counts    the expert counts and bias update of loss-free balancing;
 *   experts   the expert computation as one manual region with its own VJP,
 *             in MaxText's two forms:
 *     sparse (dropless, default): each device sorts its tokens' assignments by
 *       expert, exchanges them with a ragged all-to-all over the expert-parallel
 *       axes, runs one grouped matmul per local expert (SwiGLU), reduce-scatters
 *       the hidden-sharded product over the tensor axes, sends the rows back
 *       with the reverse ragged all-to-all and sums them with the routing
 *       weights;
 *     dense (sparse_matmul=false, capacity_factor > 0): every sequence gives each expert
 *       int(max(ceil(S k / E) cf, cf)) slots, filled in token order then top-k
 *       order; assignments past capacity are dropped; fixed-size buffers go
 *       through an all-to-all over the expert axes.
 *
 * Routing never depends on the mesh: the top-k runs on whole score rows.
 * Arrays without data (dry run) skip the math; the sparse exchange then
 * assumes every expert gets an equal share of the assignments (the real
 * counts are data), while the dense path's sizes are exact.  Every buffer of
 * the sparse region is accounted at MaxText's static size (the dropless worst
 * case), so the memory figures of a dry run equal those of a real run. */
#ifndef MODELS_MOE_H
#define MODELS_MOE_H

#include <stdbool.h>

#include "config/config.h"
#include "mesh/tape.h"
#include "models/core/model.h"

/* routed_score_func: "" (the raw gate logits), "sigmoid", "softmax". */
typedef enum { MODEL_MOE_SCORE_NONE = 0, MODEL_MOE_SCORE_SIGMOID, MODEL_MOE_SCORE_SOFTMAX } model_moe_score;

/* scores (B, S, E) = sigmoid(logits) or softmax(logits) over E. */
sim_status model_moe_scores(mesh_tape *t, mesh_var *logits, bool sigmoid, const char *name, mesh_var **scores);

typedef struct {
    int k;                  /* num_experts_per_tok */
    bool sigmoid;           /* routed_score_func sigmoid: weights divided by their sum (+1e-20) */
    double scaling;         /* routed_scaling_factor */
    bool bias_selects_only; /* DeepSeek-V3 routing: bias only ranks, weights are the pre-bias scores */
    int groups;             /* n_routing_groups: > 0 limits the top-k to the best topk_groups groups; 0 = off */
    int topk_groups;        /* topk_routing_group */
    bool random;            /* use_random_routing: k experts drawn uniformly per token, weights = biased scores */
    uint64_t random_key;    /* its draws: a function of (key, global token index, slot) only */
    bool no_eps;            /* renormalise without moe.py's 1e-20 (deepseek_batchsplit.py's routing) */
    bool softmax_topk;      /* the other blocks' weights (moe.py get_topk, not DeepSeek): softmax over the k
                             * selected values in float32, no routed_scaling_factor (Mixtral) */
    bool norm_topk;         /* norm_topk_prob with softmax_topk: the k weights divided by their sum */
} model_moe_route_cfg;

/* One token's routing, the only router (model_moe_route and the batch-split schedule): s (E) its
 * scores, bias (E) or NULL, token its global index (random draws); sel (E) scratch; idx (k) the
 * experts and w (k) the weights as model_moe_route describes them. */
void model_moe_route_token(const float *s, const float *bias, int64_t E, const model_moe_route_cfg *c, uint64_t token,
                           float *sel, int32_t *idx, float *w);

/* Top-k routing of scores (B, S, E) with an optional bias (E) (NULL: none):
 * weights (B, S, k) on the tape and indices (B, S, k) int32 (a tape value
 * without gradient).  Both take the scores' (B, S) sharding.  With groups,
 * the experts outside the topk_groups groups of best top-2 sum (of the biased
 * scores) are masked first (DeepSeek-V3, moe.py expert_group_mask).  Random
 * routing returns the biased scores at the drawn experts, neither
 * renormalised nor scaled (moe.py get_topk returns before
 * deepseek_scale_weights). */
sim_status model_moe_route(mesh_tape *t, mesh_var *scores, mesh_var *bias, const model_moe_route_cfg *c,
                           const char *name, mesh_var **weights, mesh_var **indices);

/* Load-balance loss as MaxText 0.2.5 computes it (moe.py load_balance_loss):
 * probs = softmax(scores + bias) over E (bias NULL: of the scores alone, the
 * sparse path's pre-bias scores), density = per-sequence count of assignments
 * to each expert / (S k) (0.2.5 divides by num_experts_per_tok; e591f30c did
 * not), and loss = mean_{B,E}(density * mean_S probs) * E^2 * weight, over
 * the whole batch (a replicated scalar). */
sim_status model_moe_lb_loss(mesh_tape *t, mesh_var *scores, mesh_var *bias, mesh_var *indices, double weight,
                             const char *name, mesh_var **loss);

/* Loss-free balancing's statistic (moe.py calculate_expert_counts): how many
 * of the batch's assignments in indices (B, S, k) went to each of E experts,
 * summed over the token axes (an all-reduce of E int32-sized counts, as
 * MaxText's psum over the batch axes); out (E) on every device (untouched in
 * a dry run). */
sim_status model_moe_expert_counts(mesh_tape *t, mesh_var *indices, int64_t E, const char *name, float *out);

/* The bias update of one layer (moe.py load_balance_updates_from_counts),
 * in float32 as MaxText: bias[e] += rate * sign(sum(counts) / E - counts[e]). */
void model_moe_bias_update(float *bias, const float *counts, int64_t E, double rate);

/* One megablox grouped-matmul call's tile (MaxText's wi_tile_* / wo_tile_* triples, in the
 * kernel's (tm, tk, tn) order): every grid step computes a whole tm x tk x tn block. */
typedef struct {
    int64_t m, k, n;
} model_moe_tile;
enum { MODEL_MOE_WI = 0, MODEL_MOE_WO = 1, MODEL_MOE_FWD = 0, MODEL_MOE_DLHS = 1, MODEL_MOE_DRHS = 2 };

typedef struct {
    sim_axes ep;                    /* expert-parallel axes: they shard the experts dim of the weights, in order */
    bool ring;                      /* use_ring_of_experts: x, weights and indices come gathered over ep
                             * (model_moe_ring_gather); each device runs its own experts on every
                             * row and the output is reduce-scattered over ep onto `out` */
    bool output_dead;               /* ring, remat's recomputation in backward: nothing reads the output's
                             * value (only its cotangent flows), so XLA drops the reduce-scatter;
                             * the output is zeros in `out`'s sharding and nothing moves */
    sim_axes h;                     /* axes sharding the expert hidden dim (tensor parallelism inside the MoE) */
    int64_t capacity;               /* dense path: slots per expert per sequence (model_moe_capacity); 0: sparse */
    mesh_spec out;                  /* spec of the output (B, S, M) (MaxText's out_specs) */
    unsigned keep;                  /* remat: MODEL_MOE_KEEP_* residuals the policy saves (MaxText's moe.py tags) */
    struct model_moe_saved **saved; /* remat: where they wait between the passes (NULL: nothing kept) */
    model_moe_tile gmm[2][3];       /* sparse path: the megablox gmm tiles [wi, wo][fwd, dlhs, drhs], for the
                              * step-time model's cost of the padded tiles; all zero: exact FLOPs */
    mesh_var *b0, *b1, *bo;         /* mlp_bias: wi_0's and wi_1's (experts, hidden) and wo's (experts, embed)
                                       biases (moe.py wi_0_bias, wi_1_bias, wo_bias); NULL: none */
    bool clamped;                   /* gpt_oss: the clamped GLU (bk_clamped_glu_fwd) instead of SwiGLU */
    float alpha, limit;             /* its constants (1.702, mlp_activations_limit) */
} model_moe_cfg;

/* The region's residuals a remat policy saves, by MaxText's checkpoint_name
 * tags in moe.py: the grouped matmul's wi_0 and wi_1 products (mlpwi_0 /
 * moe_mlpwi_0, moe_mlpwi_1; the dense path also tags wi_1 mlpwi_1), its wo
 * product before the return (mlpwo / moe_mlpwo), the expert-sorted input rows
 * (moe_x_sorted) and the routing maps (moe_routing_maps: the sort's row of
 * each assignment).  In remat's first pass (a tape that records nothing) the
 * region leaves the kept buffers in *saved, accounted as activations; when the
 * layer is recomputed for its backward (a recording tape) the region releases
 * them before it allocates its own again: the saved tensors stand for their
 * recomputed twins, so at no time are both on the device.  Numerics are those
 * of full remat (the recomputation gives the same bits). */
enum {
    MODEL_MOE_KEEP_WI0 = 1u << 0,
    MODEL_MOE_KEEP_WI1 = 1u << 1,
    MODEL_MOE_KEEP_WO = 1u << 2,
    MODEL_MOE_KEEP_X = 1u << 3,
    MODEL_MOE_KEEP_MAPS = 1u << 4,
};
typedef struct model_moe_saved model_moe_saved;
void model_moe_saved_free(void *saved);

/* out (B, S, M) = sum_j weights[.., j] * FFN_{indices[.., j]}(x) with
 * FFN_e(x) = (silu(x w0[e]) * (x w1[e])) wo[e]; x (B, S, M), w0/w1 (E, M, H),
 * wo (E, H, M).  The tokens keep x's (B, S) sharding; the weights are brought
 * to (ep, None, h) / (ep, h, None) (the FSDP all-gather).  Gradients reach x,
 * weights, w0, w1 and wo; the weight gradients are partial over the
 * token-sharding axes that are not expert axes.  Errors name the dims and
 * the fix when the experts or the hidden dim do not divide. */
sim_status model_moe_experts(mesh_tape *t, mesh_var *x, mesh_var *weights, mesh_var *indices, mesh_var *w0,
                             mesh_var *w1, mesh_var *wo, const model_moe_cfg *c, const char *name, mesh_var **out);

/* Ring of experts (MaxText's use_ring_of_experts, moe.py roe_ag_and_route):
 * out (B, S, W) = x all-gathered over the expert-parallel axes ep on the
 * batch dim (tiled, group rank order), as jax.lax.all_gather(tiled=True)
 * inside MaxText's shard_map; its VJP reduce-scatters the cotangent back
 * (the all-gather's transpose).  x's batch dim must end with the ep axes, in
 * order, and no other dim may use them (then the gather is exactly the
 * resharding that drops them); otherwise an error names
 * use_ring_of_experts and the layout. */
sim_status model_moe_ring_gather(mesh_tape *t, mesh_var *x, sim_axes ep, const char *name, mesh_var **out);

/* MaxText's ring also all-gathers the biased router logits next to the
 * pre-bias ones (DeepSeek-V3 routing ranks experts by scores + bias): this
 * computes scores + bias (E) on the local rows and all-gathers them over ep,
 * a real collective with its bytes counted.  The gathered values are not kept:
 * model_moe_route adds the same bias to the gathered scores, which gives the
 * same floats.  Nothing is recorded on the tape (the selection has no
 * gradient, so MaxText's backward has no reduce-scatter for it either). */
sim_status model_moe_ring_gather_biased(mesh_tape *t, mesh_var *scores, mesh_var *bias, sim_axes ep, const char *name);

/* The dense path's per-sequence capacity for S tokens, k of E experts. */
int64_t model_moe_capacity(int64_t S, int k, int64_t E, double capacity_factor);

/* The one expert permutation (moe.py's permute: a stable sort of the assignments by expert), as a
 * counting sort: assignment a goes to bucket key[a] in [0, nb), or nowhere when key[a] < 0;
 * cnt[0..nb) gets each bucket's count, row[a] the assignment's row in bucket order with ties in
 * assignment order (-1: nowhere).  Returns the rows placed.  The sparse path sorts by (owner rank,
 * local expert), the batch-split schedule by local expert. */
int64_t model_moe_permute(const int32_t *key, int64_t n, int64_t nb, int64_t *cnt, int32_t *row);

/* The routed and shared experts (moe.py), as the config sets them. */
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
    bool softmax_topk;          /* the family's: moe.py get_topk's weights outside DeepSeek (model_moe_route_cfg) */
    bool norm_topk;             /* norm_topk_prob (read with softmax_topk only: DeepSeek's routing ignores it) */
} model_moe_dims;

/* Reads the MoE keys moe.py's RoutedMoE reads (widths, routing, load balance, the sparse or dense
 * path, ring of experts, the gmm tiles) into o, refusing what is not simulated with the key named;
 * o->moe_mlp is base_moe_mlp_dim (a family whose layer passes another width sets it after).
 * softmax_topk is the caller's: it says which get_topk branch the decoder block takes. */
sim_status model_moe_dims_read(const cfg_config *cfg, const model_dims *d, bool softmax_topk, model_moe_dims *o);

/* The checks of a fully MoE layer outside DeepSeek (mixtral, qwen3_moe) once its dims are read:
 * top-k within 1..min(64, experts), and with remat_policy=custom the expert-sorted inputs and
 * routing maps kept as remat (saving them is not simulated). */
sim_status model_moe_check_routed(const model_dims *d, const model_moe_dims *mo);

/* The setup hook's checks of such a family: MaxText runs the batch-split schedule for DeepSeek
 * only, and collecting the load-balance loss from pipeline iterations is not simulated. */
sim_status model_moe_check_setup(const model_def *m, const cfg_config *cfg, const model_moe_dims *mo);
/* The same as a family row's setup hook, for a family that keeps its model_moe_dims in
 * model_dims.family_dims (mixtral, qwen3_moe). */
sim_status model_moe_setup(model_def *m, const cfg_config *cfg);

/* The routed experts' parameters of a fully MoE layer outside DeepSeek (mixtral, qwen3_moe), stacked
 * over the scanned layers under params.decoder.layers.<scope>: RoutedMoE's gate kernel ('embed',
 * None), its bias where routed_bias is set, and wi_0, wi_1, wo (width mo->moe_mlp), with moe.py's
 * logical names (embed_moe on the expert dim under shard_exp_on_fsdp). */
void model_moe_define_routed_params(model_def *m, const char *scope, const model_moe_dims *mo);
/* The same stacked over `stack` layers, with moe.py's expert biases when mlp_bias (wi_0_bias,
 * wi_1_bias: ('exp', 'layers', 'activation_mlp'), wo_bias: ('exp', 'layers', 'activation_embed'),
 * zeros as default_bias_init). */
void model_moe_define_routed_params_stack(model_def *m, const char *scope, const model_moe_dims *mo, int64_t stack,
                                          bool mlp_bias);

/* Expert-parallel and expert-hidden axes of the expert region: the mesh axes of the weights'
 * ('exp', None, 'mlp_no_fsdp') names without fsdp. */
sim_status model_moe_axes(const model_def *m, sim_axes *ep, sim_axes *h);

/* Once the mesh is known: the experts split evenly over the expert-parallel axes, and MaxText's
 * config check of random routing with an expert-parallel rank of 1. */
sim_status model_moe_check_mesh(const model_def *m, const cfg_config *cfg, const model_moe_dims *mo);

/* One layer's routed experts as moe.py's RoutedMoE runs them. */
typedef struct {
    const model_moe_dims *dims;
    int gate, gate_bias;    /* the gate kernel (embed, experts) and its bias (-1: none) */
    int wi0, wi1, wo;       /* the expert kernels (experts, embed, hidden) / (experts, hidden, embed) */
    const char *const *out; /* 3 logical names of the output (the layer's out_sharding: the region's out_specs) */
    int64_t lb_layers;      /* the layers whose load-balance losses MaxText averages (MTP's included) */
    const struct model_moe_gptoss *gptoss; /* gpt_oss's additions (NULL: none) */
} model_moe_layer;

/* gpt_oss's RoutedMoE (models/gpt_oss.py GptOssMlp): the experts' biases (mlp_bias; -1: none), the
 * clamped GLU, and the parameters' stack index (its scanned block stacks every other layer). */
typedef struct model_moe_gptoss {
    int wi0_bias, wi1_bias, wo_bias;
    float limit; /* mlp_activations_limit */
    int stack;   /* the layer's index in its parameters' stacks */
} model_moe_gptoss;

/* The routed experts of a fully MoE layer outside DeepSeek, as model_moe_define_routed_params defined
 * them under params.decoder.layers.<scope>, with the output named `out` and the load-balance losses
 * averaged over the model's layers. */
model_moe_layer model_moe_layer_at(const model_def *m, const char *scope, const model_moe_dims *dims,
                                   const char *const *out);

/* x (B, S, M) -> y (B, S, M): the gate logits (moe/inputs, moe/gate_logits constraints), the
 * scores, the top-k, the expert counts of loss-free balancing, the load-balance loss *lb (NULL
 * when load_balance_loss_weight is 0, else the layer's share of the weight), then the expert
 * region (model_moe_experts: sparse or dense path, ring, remat's kept products), under the scope
 * name `scope` (e.g. decoder/layers_0/MoeBlock_0) and layer l of the parameters. */
sim_status model_moe_routed(model_dev *md, mesh_tape *t, const model_moe_layer *ml, int l, mesh_var *x,
                            const char *scope, mesh_var **y, mesh_var **lb);

/* model_moe_routed as the dense layer's feed-forward half (model_dense_ffn_fn in
 * models/blocks/dense_layer.h): arg is the layer's model_moe_layer, *aux its load-balance loss. */
sim_status model_moe_ffn(model_dev *md, mesh_tape *t, const void *arg, int l, mesh_var *hs, const char *scope,
                         mesh_var **y, mesh_var **aux);

/* The shared experts of a DeepSeek MoE layer (moe.py RoutedAndSharedMoE.shared_experts, an
 * MlpBlock of width shared_experts x moe_mlp_dim): SwiGLU with MaxText's checkpoint tags (mlpwi_0,
 * mlpwi_1, mlpwo), x (B, T, E) -> y (B, T, E) with layer l of the parameters wi0, wi1, wo. The
 * DeepSeek layer and the batch-split schedule both run it beside the routed experts. */
sim_status model_moe_shared_experts(model_dev *md, mesh_tape *t, int wi0, int wi1, int wo, int l, mesh_var *x,
                                    mesh_var **y);

#endif
