/* ad.h — the generic sharded ops of mesh/ops.h on the autodiff tape:
 * einsum, residual add, the two constraint primitives, and the layout ops on the last dims
 * (split, concatenation, head broadcast: MLA's) and along the sequence (roll, masked sum:
 * multi-token prediction).  Their VJPs are
 * sharded ops themselves (resolved as auto mode): for c = einsum(a, b),
 * da = einsum(dc, b) and db = einsum(a, dc) with the subscripts rearranged;
 * for constraints and reshards the VJP is the identity on the global tensor
 * (the cotangent is resharded back to the input's sharding). */
#ifndef MESH_AD_H
#define MESH_AD_H

#include "mesh/tape.h"

/* Two-operand einsum with explicit output ("bte,ehd->bthd"); out_sharding as
 * JAX's (NULL: none). */
sim_status mesh_ad_einsum(mesh_tape *t, const char *sub, mesh_var *a, mesh_var *b, const mesh_spec *out_sharding,
                          const char *name, mesh_var **out);
/* a + b (same shape). */
sim_status mesh_ad_add(mesh_tape *t, mesh_var *a, mesh_var *b, const char *name, mesh_var **out);
/* MaxText's maybe_shard_with_logical: reshard in explicit mode, constraint in auto. */
sim_status mesh_ad_shard_as(mesh_tape *t, mesh_var *x, const mesh_spec *spec, const char *name, mesh_var **out);
/* Raw with_sharding_constraint: an assert in explicit mode, a reshard in auto. */
sim_status mesh_ad_constraint(mesh_tape *t, mesh_var *x, const mesh_spec *spec, const char *name, mesh_var **out);

/* An identity on x (its value, not a copy) that counts, without changing a value, the collectives
 * XLA's partitioner runs where a sharding propagated from a consumer splits x's last dim over the
 * axes of along's one dim while the simulation keeps it whole: an all-gather of x now (gather), and in
 * the backward a reduce-scatter of x's cotangent onto that split (a slice, nothing counted, where
 * the cotangent is not partial over those axes) and, with regather, a second all-gather of x for a
 * product's weight gradient that reads it.  Size-1 axes and axes x already uses are left out; with
 * none left (or a last dim they do not divide) *out = x and nothing is counted.  The arrays moved
 * are transient temporaries; name is the collectives' op name. */
sim_status mesh_ad_counted_split_last(mesh_tape *t, mesh_var *x, const mesh_spec *along, bool gather, bool regather,
                                      const char *name, mesh_var **out);

/* Einsum VJP contributions added into an existing cotangent by sgemm (mesh_einsum_into) so far, on
 * every device of every run of the process; and the switch (on by default) that allows it, for
 * tests comparing with the separate add.  Set the switch only while no machine runs. */
long long mesh_ad_fused_count(void);
void mesh_ad_set_fuse(bool on);

/* Layout ops.  Each materialises its output (XLA:TPU does: the slices change the tiling) and
 * charges the copy to the step-time model as layout work; their VJPs copy the cotangents back. */
/* y1 = x[..., :d1], y2 = x[..., d1:], the last dim whole (expand: y2 gets a size-1 dim before its last). */
sim_status mesh_ad_split_last(mesh_tape *t, mesh_var *x, int64_t d1, bool expand, const char *name, mesh_var **y1,
                              mesh_var **y2);
/* y = [a, b] along the last dim; b follows a's sharding, the last dim whole. */
sim_status mesh_ad_concat_last(mesh_tape *t, mesh_var *a, mesh_var *b, const char *name, mesh_var **y);
/* y (B, T, H, R) = x (B, T, 1, R) repeated over H heads, made directly in `spec` (its heads dim may
 * be sharded: each device writes its heads only); the VJP sums over the heads (partial over the
 * axes that split them). */
sim_status mesh_ad_broadcast_heads(mesh_tape *t, mesh_var *x, int64_t H, const mesh_spec *spec, const char *name,
                                   mesh_var **y);
/* MaxText's roll_and_mask applied k times to token ids (B, T): shifted left by k along the
 * sequence, 0 in the last k positions; no gradient.  The sequence must be whole on every device
 * (the caller refuses a sharded one: a context-parallel shift is a ppermute).  The result is a tape
 * value, freed with the tape. */
sim_status mesh_ad_roll_tokens(mesh_tape *t, const mesh_array *src, int64_t k, const char *name,
                               const mesh_array **out);
/* scale * sum of x (B, T) over the positions t < T - k (MaxText's xent times the rolled target
 * mask, summed), a replicated scalar. */
sim_status mesh_ad_masked_sum(mesh_tape *t, mesh_var *x, int64_t k, double scale, const char *name, mesh_var **out);

#endif
