/* nn.h — the fused neural-network ops of the models, as sharded ops with
 * their VJPs on the tape: RMSNorm, RoPE, attention, embedding lookup,
 * cross-entropy, SwiGLU and the token mean of the loss.
 *
 * Each op states which shardings its local kernel needs, reshards its
 * operands to them (collectives tagged ctx->layer/op; implicit in auto mode
 * where the operand came in another sharding), runs the blas_kernels kernel
 * on the local shards with whatever cross-device sums the math needs, and
 * records a VJP whose cotangents carry partial axes where the math leaves
 * them partial.  Arrays without data (dry run) skip the kernels but move and
 * count the same bytes. */
#ifndef MESH_NN_H
#define MESH_NN_H

#include "blas_kernels/bk_rope.h"
#include "mesh/tape.h"

/* Records a memory-bound op's cost for the step-time model (models/core/timemodel.c): no matrix-unit
 * FLOPs, `elements` (local) read and written in HBM, timed at the profile's HBM bandwidth.  The
 * ops of this file and the models' layout ops (MLA's splits, concatenations, head broadcasts)
 * call it forward and in their VJPs; matmuls and attention record their own FLOPs. */
void mesh_nn_cost_memory(mesh_tape *t, double elements, const char *tag);
/* The same in a VJP, tagged as the entry's forward op with "/bwd" (its layer named). */
void mesh_nn_cost_memory_bwd(mesh_tape *t, const mesh_entry *e, double elements);

/* y = x * rsqrt(mean(x^2, last dim) + eps) * scale.  The last dim may be
 * sharded (the sum of squares is then all-reduced over its axes). */
sim_status mesh_nn_rmsnorm(mesh_tape *t, mesh_var *x, mesh_var *scale, double eps, const char *name, mesh_var **y);

/* Rotary embedding of x (B, T, H, D) at positions (B, T) int32; D is
 * gathered if sharded, positions follow x's (B, T) sharding. */
sim_status mesh_nn_rope(mesh_tape *t, mesh_var *x, const mesh_array *positions, const bk_rope_params *p,
                        const char *name, mesh_var **y);

/* Causal GQA attention: q (B, T, Hq, D), k (B, S, Hkv, D), v (B, S, Hkv, Dv),
 * mask k_pos <= q_pos.  q keeps its (B, T, H) sharding; k and v are brought
 * to q's batch and head sharding with the sequence gathered (context
 * parallelism: K/V all-gathered over the axes that shard T).  Kv heads must
 * be divisible by the number of head shards (else a clear error). */
sim_status mesh_nn_attention(mesh_tape *t, mesh_var *q, mesh_var *k, mesh_var *v, const mesh_array *q_pos, double scale,
                             const char *name, mesh_var **out);
/* The same with MaxText's kernel choice and attn_logits_soft_cap: dot = the dot-product path (the
 * whole score matrix, its probabilities (B, Hq, T, S) kept for the backward; in explicit mode first
 * JAX's rule for MaxText's qk_product einsum, which refuses a sharded sequence), else flash (blocked,
 * the logsumexp kept).  Same placements and traffic.  soft_cap > 0 (flash only; the model refuses
 * it with dot): scores -> cap tanh(score / cap).  window > 0: MaxText's local_sliding mask, key
 * positions > query position - window too; under context parallelism the keys arrive gathered
 * with their positions, so the window holds across shards (and load-balanced orders) as is. */
/* MaxText's splash-attention blocks (sa_block_*, each clipped to the sequence as MaxText does) and
 * its backward kernels (sa_use_fused_bwd_kernel): the step-time model costs the blocks the TPU
 * kernel visits.  NULL, or a flash kernel that is not splash: the causal half is costed. */
typedef struct {
    int64_t q, kv, q_dkv, kv_dkv, q_dq, kv_dq;
    bool fused_bwd;
} mesh_nn_splash;
sim_status mesh_nn_attention_kernel(mesh_tape *t, mesh_var *q, mesh_var *k, mesh_var *v, const mesh_array *q_pos,
                                    double scale, double soft_cap, int64_t window, bool dot,
                                    const mesh_nn_splash *splash, const char *name, mesh_var **out);

/* The same with attention sinks (MaxText attention_sink): sinks (Hq) one learned logit per query
 * head in every row's softmax (bk_attention.h), brought to the query heads' sharding; its gradient
 * is reduced over the axes of the batch and the sequence.  NULL sinks: mesh_nn_attention_kernel. */
sim_status mesh_nn_attention_sinks(mesh_tape *t, mesh_var *q, mesh_var *k, mesh_var *v, mesh_var *sinks,
                                   const mesh_array *q_pos, double scale, double soft_cap, int64_t window, bool dot,
                                   const mesh_nn_splash *splash, const char *name, mesh_var **out);

/* y = x + bias broadcast over x's leading dims (bias's shape is x's trailing dims): a projection's
 * use_bias (MaxText DenseGeneral).  A partial x is reduced first; y keeps x's sharding, the bias is
 * brought to it, and its gradient sums the leading dims (partial over their axes). */
sim_status mesh_nn_bias_add(mesh_tape *t, mesh_var *x, mesh_var *bias, const char *name, mesh_var **out);

/* out (B, T, E) = table[tokens]: table (V, E) may be sharded on V (the
 * lookup is then partial over those axes) and E; axes that also shard the
 * tokens are gathered out of the table first, or, with ctx.embed_all_to_all
 * and E split by the trailing axes of the tokens' batch (then every axis of
 * their length), the token ids are gathered and the rows all-to-all'd (or
 * all-gathered and sliced where the length is split; the same bits; see
 * nn.c). */
sim_status mesh_nn_embed(mesh_tape *t, mesh_var *table, const mesh_array *tokens, const char *name, mesh_var **out);

/* Per-token loss (B, T) = logsumexp - logit[target] + z * logsumexp^2 for
 * logits (B, T, V), V possibly sharded (no full-vocab gather). */
sim_status mesh_nn_xent(mesh_tape *t, mesh_var *logits, const mesh_array *targets, double z_loss, const char *name,
                        mesh_var **loss);

/* out = silu(gate) * up (same sharding; up follows gate). */
sim_status mesh_nn_swiglu(mesh_tape *t, mesh_var *gate, mesh_var *up, const char *name, mesh_var **out);
/* out = gelu(gate) * up, jax.nn.gelu's tanh approximation (mlp_activations [gelu, linear]); as swiglu. */
sim_status mesh_nn_geglu(mesh_tape *t, mesh_var *gate, mesh_var *up, const char *name, mesh_var **out);

/* y = x rounded to bfloat16 and read back as float32 (jnp.asarray(x, jnp.bfloat16) where a float32
 * product reads it); its VJP rounds the cotangent the same way, as the transposed convert does.  Same
 * sharding as x; no bytes move. */
sim_status mesh_nn_round_bf16(mesh_tape *t, mesh_var *x, const char *name, mesh_var **out);

/* y = cap tanh(a x / cap), or a x when cap = 0 (final_logits_soft_cap, normalize_embedding_logits);
 * same sharding as x (partial axes summed first). */
sim_status mesh_nn_softcap(mesh_tape *t, mesh_var *x, double a, double cap, const char *name, mesh_var **out);

/* x with a dim of size 2 at `dim` -> its two slices x[..., 0, ...] and x[..., 1, ...] (the dim is
 * gathered if sharded; the slices keep x's other shardings): fused_mlp's wi output. */
sim_status mesh_nn_unstack2(mesh_tape *t, mesh_var *x, int dim, const char *name, mesh_var **y0, mesh_var **y1);

/* x split along `dim` into n parts inside each shard, as a shard_map body splits its local block
 * (fused_qkv's split_qkv): with k shards on that dim, part j takes sizes[j]/k consecutive
 * entries of every local block, so globally part j is the concatenation over shards of their
 * j-th pieces.  Each part keeps x's spec (partial axes summed first); sizes[j] must divide by k
 * and add up to the dim.  n is 1 or 2 (a tape entry's outputs): split three ways in two steps. */
sim_status mesh_nn_split_local(mesh_tape *t, mesh_var *x, int dim, int n, const int64_t *sizes, const char *name,
                               mesh_var **ys);

/* Dropout (flax semantics) with a mesh-independent mask: one draw per global index of x without
 * dim `bcast` (bk_dropout.h), from `key`; rate 0 returns x itself.  Same sharding as x. */
sim_status mesh_nn_dropout(mesh_tape *t, mesh_var *x, double rate, uint64_t key, int bcast, const char *name,
                           mesh_var **out);

/* Scalar mean over every element of x (all axes reduced; result replicated). */
sim_status mesh_nn_mean(mesh_tape *t, mesh_var *x, const char *name, mesh_var **out);

/* Brings an array to `spec` as a new array (a copy, never touching src);
 * *owned tells whether the caller must free it. */
sim_status mesh_nn_operand(mesh_tape *t, const mesh_array *src, const mesh_spec *spec, const char *tag, mesh_array *out,
                           bool *owned);

#endif
