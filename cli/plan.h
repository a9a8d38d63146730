/* plan.h — `shardsim plan`: which configuration to run a model with on a topology.
 *
 * Enumerates candidate configurations (configs/plan.yml: rule sets x meshes x shard_mode x
 * shard_optimizer_over_data, then remat_policy x gradient_accumulation_steps x pipeline
 * microbatches), refuses those the config loader refuses (the reason is train's message), prunes
 * those whose parameters, gradients and optimizer state alone exceed the device's HBM, dry-runs
 * the rest within a budget (each dry run in a child process, a few layers of each kind, the
 * figures extrapolated to the model's layer count; the top candidates in full) and ranks the
 * ones that fit by the hardware profile's modelled step time. */
#ifndef CLI_PLAN_H
#define CLI_PLAN_H

#include <stdint.h>
#include <stdio.h>

/* The ways `parts` ordered factors (each >= 1) multiply to n with at most max_split of them > 1:
 * the meshes plan enumerates over `parts` axes of a slice of n devices. */
int64_t cli_plan_count_meshes(int n, int parts, int max_split);

/* shardsim plan [file.yml ...] [key=value ...] [--explain K] */
int cli_plan(int argc, char **argv, FILE *out, FILE *err);

#endif
