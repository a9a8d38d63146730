/* ops.h — sharded ops on distributed arrays, with their sharding rules in both shard modes.
 *
 * Every op takes global-shape operands, computes on the local shards and returns a new array in
 * this device's arena (named "<layer>/<name>"; category out_cat or the first operand's).  Output
 * arrays must not alias inputs.  The rules follow JAX's sharding in types
 * (reference/jax-sharding-facts.md §1, Summary A):
 *   explicit  the JAX rule decides the output spec or fails with JAX's wording (SIM_ERR_SHARDING;
 *             the message also names the op, the layer, the operands with their P(...) specs and
 *             the fix).  Collectives the rule implies (the all-gather of a contraction sharded on
 *             one side, the all-reduce of a sharded reduced dim, the one out_sharding asks for)
 *             are recorded as explicit.
 *   auto      never fails on sharding: among candidate placements of the operands (each operand's
 *             own sharding, the other's, out_sharding's, replicated — per dim) the op takes the
 *             one whose reshards cost the fewest bytes (mesh_plan_make) and records those
 *             collectives as implicit.  Partial ("unreduced") values flow through linear ops.
 * All collectives are tagged "<layer>/<name>".  In explicit mode, with ctx->drop_size_one, specs
 * are compared with their size-1 axes removed (MaxText's remove_size_one_mesh_axis_from_type).
 * An op never fails after it has started a collective (every rule check comes first).  Operands
 * are resharded as copies in the temporaries category; with ctx->cache such a copy is made once
 * per (array, spec, target) and borrowed afterwards (mesh/reshard.h). */
#ifndef MESH_OPS_H
#define MESH_OPS_H

#include <stddef.h>

#include "mesh/array.h"
#include "mesh/ctx.h"
#include "mesh/reshard.h"

/* ---- einsum ---------------------------------------------------------------- */

/* What mesh_einsum ran, for writing its VJP. */
typedef struct {
    char subscripts[64]; /* the local product (indices found in one operand only were summed first) */
    mesh_spec a_spec;    /* lhs spec when the local product ran */
    mesh_spec b_spec;    /* rhs spec when the local product ran */
    mesh_spec local_out; /* output spec of the local product: partial over shared contraction axes */
    mesh_spec out_spec;  /* the output's final spec (after the collective out_sharding asks for) */
    uint64_t bytes_in;   /* bytes sent per device to reshard the operands */
    uint64_t bytes_out;  /* bytes sent per device to bring the product to out_sharding */
} mesh_einsum_info;

/* out = einsum(subscripts, a, b) (float32; see bk_einsum.h for the subscripts).
 * Explicit (JAX dot_general rule): partial operands are refused; without out_sharding the batch
 * dims of a and b must be sharded identically, a contraction dim may be sharded on one side only
 * (that operand is all-gathered along it), the output is batch ++ lhs free ++ rhs free (an axis
 * used twice is an error); with out_sharding the product runs locally and the output is all-reduced,
 * reduce-scattered or left partial as out_sharding says (unreduced axes must equal the axes of
 * identically sharded contraction dims).
 * Auto: cheapest operand placement; a contraction dim both operands shard identically gives a
 * partial output, kept partial unless out_sharding says otherwise; partial operands are linear
 * (the output is partial over their axes; never both operands over the same axis).
 * out_sharding may be NULL; info may be NULL. */
sim_status mesh_einsum(mesh_ctx *ctx, const char *subscripts, const mesh_array *a, const mesh_array *b,
                       const mesh_spec *out_sharding, const char *name, sim_mem_cat out_cat, mesh_array *out,
                       mesh_einsum_info *info);

/* mesh_einsum (no out_sharding) whose product is to be added to acc, an array of the output's shape
 * (a cotangent contribution): where the placement chosen as ever gives acc's spec, dims and partial
 * axes, and the local product writes its output in place (bk_einsum_out_direct), the product is
 * added into acc by sgemm itself (beta = 1) and *fused is true; *out is then a ghost
 * (mesh_array_new_ghost): counted in the arena as the product would be, no storage, released with
 * mesh_array_free.  Otherwise exactly mesh_einsum, *fused false, acc untouched.  The
 * collectives and the arena's figures are the same either way; acc's bits differ from a separate
 * add by rounding (the old value joins the sum at sgemm's first K block instead of after the last). */
sim_status mesh_einsum_into(mesh_ctx *ctx, const char *subscripts, const mesh_array *a, const mesh_array *b,
                            mesh_array *acc, const char *name, sim_mem_cat out_cat, mesh_array *out, bool *fused);

/* ---- elementwise ------------------------------------------------------------- */

/* out = a + b, a - b, a * b (float32).  Equal ranks (or one scalar); size-1 dims broadcast.
 * Spec per dim (JAX broadcasting rule): equal -> kept; None on a size-1 dim ignored; None vs A -> A
 * (the replicated operand is sliced locally, no bytes); A vs B -> error in explicit; an axis on two
 * dims -> error in explicit.  Partial: add/sub need equal partial sets in explicit (the output
 * keeps them); mul refuses partial operands in explicit; auto keeps partials (add/sub: union,
 * mul: linear in each operand, never both over one axis). */
sim_status mesh_add(mesh_ctx *ctx, const mesh_array *a, const mesh_array *b, const char *name, mesh_array *out);
sim_status mesh_sub(mesh_ctx *ctx, const mesh_array *a, const mesh_array *b, const char *name, mesh_array *out);
sim_status mesh_mul(mesh_ctx *ctx, const mesh_array *a, const mesh_array *b, const char *name, mesh_array *out);

/* A nonlinear elementwise function over a local buffer: out[i] = f(in[i]) for i < n, `arg` its
 * parameters.  Must allow out == in. */
typedef void (*mesh_map_fn)(float *out, const float *in, size_t n, void *arg);

/* out = fn(a), same spec.  A partial input: explicit -> error; auto -> all-reduced first (implicit). */
sim_status mesh_map(mesh_ctx *ctx, const mesh_array *a, mesh_map_fn fn, void *arg, const char *name, mesh_array *out);

/* ---- reductions, layout ---------------------------------------------------- */

/* Sums over dims[0..ndims) (float32), dropping them.  A reduced dim sharded over axes is all-reduced
 * over them (explicit: as JAX inserts it; auto: implicit), unless out_sharding keeps those axes
 * unreduced; partial inputs stay partial.  out_sharding (rank - ndims entries) may be NULL. */
sim_status mesh_reduce_sum(mesh_ctx *ctx, const mesh_array *a, int ndims, const int *dims,
                           const mesh_spec *out_sharding, const char *name, mesh_array *out);

/* out dim i = a dim perm[i]; the spec entries move with their dims; no communication. */
sim_status mesh_transpose(mesh_ctx *ctx, const mesh_array *a, const int *perm, const char *name, mesh_array *out);

/* Row-major reshape to `shape`.  Output spec (JAX rule): out_sharding if given; singleton dims
 * added/removed keep the others' specs; one dim split into adjacent dims hands its axes out major
 * first; adjacent dims merged concatenate their axes (a sharded dim after an unsharded one is an
 * error); anything else is an error in explicit mode.  Auto keeps what stays contiguous and
 * replicates the rest.  Data moves only when the spec needs it (counted). */
sim_status mesh_reshape(mesh_ctx *ctx, const mesh_array *a, int rank, const int64_t *shape,
                        const mesh_spec *out_sharding, const char *name, mesh_array *out);

/* ---- changing and asserting shardings (in place) ----------------------------- */

/* jax.sharding.reshard: a to `spec` (missing trailing entries are None), both modes; its
 * collectives are explicit (asked for by model code). */
sim_status mesh_reshard_op(mesh_ctx *ctx, mesh_array *a, const mesh_spec *spec, const char *name);
/* jax.lax.with_sharding_constraint: explicit -> an assert (SIM_ERR_SHARDING with JAX's
 * AssertionError text naming both specs), no data moves; auto -> reshard, implicit collectives. */
sim_status mesh_with_sharding_constraint(mesh_ctx *ctx, mesh_array *a, const mesh_spec *spec, const char *name);
/* MaxText's maybe_shard_with_logical: explicit -> reshard (explicit collectives); auto ->
 * constraint (implicit collectives). */
sim_status mesh_shard_as(mesh_ctx *ctx, mesh_array *a, const mesh_spec *spec, const char *name);

/* ---- text ---------------------------------------------------------------------- */

/* JAX's short type text: "f32[8@x,4]", "f32[8@(x,y),4]{U:z}", "f32[]".  Returns the length needed. */
int mesh_type_format(const mesh_shape *m, sim_dtype dt, int rank, const int64_t *shape, const mesh_spec *s, char *buf,
                     int cap);

/* ---- explicit-mode checks on types only (nothing computed or moved; SIM_OK in auto mode) ------ */

/* A data-less copy of x's header with another shape and spec: the type an op of MaxText's layer
 * code would see (e.g. the query reshaped to (b, t, kv_heads, groups, d)). */
mesh_array mesh_array_view(const mesh_array *x, int rank, const int64_t *shape, const mesh_spec *spec);
/* JAX's dot_general rule for jnp.einsum(subscripts, a, b) on the types of a and b: as jnp.einsum,
 * dot_general gets (a, b) when batch ++ a's free ++ b's free is the output order, else (b, a).  `where` names MaxText's op ("file:function") in the error,
 * `fix` (NULL = the rule's generic advice) says what the user can change. */
sim_status mesh_einsum_check(mesh_ctx *ctx, const char *subscripts, const mesh_array *a, const mesh_array *b,
                             const char *name, const char *where, const char *fix);
/* jax.lax.scan's rule: the carry's output type must equal its input type (TypeError in JAX). */
sim_status mesh_scan_carry_check(mesh_ctx *ctx, const mesh_array *in, const mesh_array *out, const char *name,
                                 const char *where);

/* jnp.broadcast_to(x, out_shape, out_sharding=out_spec) on a type (same rank): a dim that is not
 * broadcast must already carry the requested sharding (ValueError in JAX).  dtype_label is the
 * dtype as JAX prints it ("complex64"). */
sim_status mesh_broadcast_to_check(mesh_ctx *ctx, const char *dtype_label, int rank, const int64_t *in_shape,
                                   const mesh_spec *in_spec, const int64_t *out_shape, const mesh_spec *out_spec,
                                   const char *name, const char *where, const char *fix);

/* JAX's broadcasting rule of an elementwise mul on the types of a and b (equal ranks). */
sim_status mesh_mul_check(mesh_ctx *ctx, const mesh_array *a, const mesh_array *b, const char *name, const char *where,
                          const char *fix);

#endif
