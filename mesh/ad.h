/* ad.h — the generic sharded ops of mesh/ops.h on the autodiff tape:
 * einsum, residual add, and the two constraint primitives.  Their VJPs are
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

/* Einsum VJP contributions added into an existing cotangent by sgemm (mesh_einsum_into) so far, on
 * every device of every run of the process; and the switch (on by default) that allows it, for
 * tests comparing with the separate add.  Set the switch only while no machine runs. */
long long mesh_ad_fused_count(void);
void mesh_ad_set_fuse(bool on);

#endif
