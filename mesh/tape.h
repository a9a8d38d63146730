/* tape.h — reverse-mode autodiff over sharded ops, one tape per device.
 *
 * Every value is a global tensor (a mesh_array); every op recorded here is a
 * global function, and its VJP is computed with sharded ops as well.  A
 * cotangent is a global tensor too: it may carry partial axes (the true
 * cotangent is the sum over them), which is how backward defers reductions:
 * the contribution of a batch-sharded matmul to a weight gradient is partial
 * over the batch axes and is only summed (all-reduce, or reduce-scatter onto
 * an FSDP-sharded weight) when it reaches the parameter.
 *
 * Accumulating into a value's gradient reshards the contribution to the
 * value's own spec, keeping the partial axes the value does not shard (a
 * gradient carries its value's sharding).  Leaves that stand for parameters
 * have a sink (the parameter's gradient array); at the end of a backward pass
 * each leaf's gradient is reduced to the sink's spec and added to it, in the
 * order the leaves were made (the same on every device).
 *
 * Backward always resolves shardings as auto mode does: like JAX's
 * transposes, it is generated, not written, so it never raises
 * explicit-mode errors. */
#ifndef MESH_TAPE_H
#define MESH_TAPE_H

#include <stdbool.h>

#include "mesh/array.h"
#include "mesh/ctx.h"
#include "sim/collectives.h"

enum { MESH_ENTRY_MAX_IN = 8, MESH_ENTRY_MAX_SAVED = 8 };

typedef struct mesh_tape mesh_tape;

typedef struct mesh_var {
    mesh_array val;  /* the value */
    mesh_array grad; /* accumulated cotangent (valid when has_grad) */
    bool has_grad;
    bool needs_grad;  /* a gradient is wanted: a leaf that wants one depends on it */
    bool owned;       /* val belongs to the tape (freed with it) */
    mesh_array *sink; /* parameter leaves: where the reduced gradient is added */
    int id;
} mesh_var;

struct mesh_entry;
typedef sim_status (*mesh_vjp_fn)(mesh_tape *t, struct mesh_entry *e);

typedef struct mesh_entry {
    mesh_vjp_fn vjp;
    char tag[SIM_TAG_MAX]; /* layer/op, for the backward collectives */
    int nin, nout;
    mesh_var *in[MESH_ENTRY_MAX_IN];
    mesh_var *out[2];
    mesh_array saved[MESH_ENTRY_MAX_SAVED]; /* extra arrays the VJP needs: saved[0..nsaved) */
    bool saved_owned[MESH_ENTRY_MAX_SAVED]; /* freed with the entry when set */
    int nsaved;
    char sub[64];  /* einsum subscripts and other text */
    double f[5];   /* scalars (eps, scale, ...) */
    int64_t i[4];  /* integers */
    void *payload; /* op-specific (freed with free_payload) */
    void (*free_payload)(void *);
    bool regather; /* its VJP gathers a weight operand again rather than reading the copy the recorded op
                      gathered (mesh_tape_mark_regather) */
} mesh_entry;

mesh_tape *mesh_tape_new(mesh_ctx *ctx, bool recording);
/* Frees every owned value, gradient and saved array. */
void mesh_tape_free(mesh_tape *t);
mesh_ctx *mesh_tape_ctx(mesh_tape *t);
/* "<ctx->layer>/<name>" into buf: the tag of an op's collectives. */
const char *mesh_tape_tag(mesh_tape *t, const char *name, char *buf, size_t cap);
/* Operand reshards made on this tape, reused until the tape is freed. */
struct mesh_reshard_cache *mesh_tape_cache(mesh_tape *t);
bool mesh_tape_recording(const mesh_tape *t);
/* Whether an operand a weight is gathered into now serves one product only: t records nothing (a
 * remat layer's forward, recomputed for its backward) or its backward pass runs (the forward's
 * gathers, kept for the backward, are in the cache). */
bool mesh_tape_single_use(const mesh_tape *t);
/* Marks every entry recorded on t so far: in the backward pass their VJPs gather a weight operand
 * again instead of reading the gather the recorded op made (mesh_ctx.regather).  XLA:TPU's
 * collective CSE merges two gathers of one weight only when their uses lie close together in the
 * loop body; a model marks the products its layer's long tail separates from their VJPs. */
void mesh_tape_mark_regather(mesh_tape *t);

/* A value owned by someone else (a layer input, a batch): not freed by the tape. */
mesh_var *mesh_tape_input(mesh_tape *t, const mesh_array *val, bool needs_grad);
/* A parameter: its gradient is reduced into `sink` (spec of the parameter). */
mesh_var *mesh_tape_param(mesh_tape *t, const mesh_array *val, mesh_array *sink);
/* A fresh value the caller fills (val zeroed; owned by the tape). */
mesh_var *mesh_tape_var(mesh_tape *t);
/* Hands the value of v to the caller (the tape forgets it). */
mesh_array mesh_tape_take(mesh_tape *t, mesh_var *v);

/* Records an op (no-op when not recording or when no input needs a
 * gradient).  Outputs get needs_grad from the inputs.  Returns the entry to
 * fill (payload, saved arrays...) or NULL when nothing was recorded. */
mesh_entry *mesh_tape_record(mesh_tape *t, mesh_vjp_fn vjp, const char *tag, int nin, mesh_var *const *in, int nout,
                             mesh_var *const *out);

/* Keeps `a` for the VJP (owned: the entry frees it). */
void mesh_entry_save(mesh_entry *e, const mesh_array *a, bool owned);

/* Adds a cotangent contribution to v (consumes g: it is freed or moved). */
sim_status mesh_tape_accumulate(mesh_tape *t, mesh_var *v, mesh_array *g, const char *tag);

/* v's cotangent sum, when a contribution may be added straight into it (mesh_einsum_into): v
 * wants a gradient, already has one and is not a parameter (those are reduced one by one);
 * else NULL. */
mesh_array *mesh_tape_grad_sum(mesh_var *v);
/* The rest of mesh_tape_accumulate for a contribution already added into v's cotangent sum, of
 * that sum's spec: the arena accounting of the contribution (ghost, consumed) as it would be. */
void mesh_tape_accumulated(mesh_tape *t, mesh_var *v, mesh_array *ghost);

/* Backward from a scalar loss (cotangent 1) or from an output cotangent
 * (consumed), then flushes leaf gradients into their sinks. */
sim_status mesh_tape_backward(mesh_tape *t, mesh_var *loss);
sim_status mesh_tape_backward_from(mesh_tape *t, mesh_var *out, mesh_array *cot);

/* Local helpers for VJPs: a fresh array like `like` (same shape and spec, or
 * the given spec), zeroed, in the temporaries category. */
sim_status mesh_tape_zeros(mesh_tape *t, const char *name, int rank, const int64_t *shape, const mesh_spec *spec,
                           sim_mem_cat cat, mesh_array *out);
/* y += x elementwise on the local shards (same spec). */
void mesh_local_add(mesh_array *y, const mesh_array *x);

#endif
