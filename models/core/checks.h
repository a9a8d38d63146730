/* checks.h — MaxText's sharding checks on a model definition:
 * sharding_tolerance (maxtext.utils.sharding.assert_params_sufficiently_sharded, run when a
 * training state is set up) and debug_sharding's printout of every parameter's and activation's
 * sharding (print_shardings_params and maybe_shard_with_name's log lines). */
#ifndef MODELS_CHECKS_H
#define MODELS_CHECKS_H

#include <stdio.h>

#include "models/core/model.h"

/* The share MaxText compares with sharding_tolerance: elements of the parameters that are not
 * sharded on every non-trivial mesh axis of {fsdp, fsdp_transpose, sequence, context,
 * context_usp_ulysses, context_autoregressive, tensor, tensor_sequence, stage, expert}, divided by
 * the parameters' total BYTES (MaxText counts the numerator in elements and the denominator with
 * calculate_bytes_from_pytree; with float32 weights the share is a quarter of the element share).
 * Returns -1 when no such axis has more than one device (MaxText skips the check). */
double model_unsharded_share(const model_def *m);

/* SIM_ERR_CHECK (exit 1) with MaxText's message (the share, the tolerance and the five largest
 * offending parameters) when model_unsharded_share > tolerance; skipped under pipeline
 * parallelism, as MaxText. */
sim_status model_check_sharding_tolerance(const model_def *m, double tolerance);

/* debug_sharding: the non-trivial mesh axes ("fsdp: 4"), every parameter (path, shape, physical
 * spec without size-1 axes) and every activation the forward pass constrained (logical and
 * physical lines), in MaxText's wording.  dtype labels the activations. */
void model_print_shardings(const model_def *m, const char *dtype, FILE *f);

#endif
