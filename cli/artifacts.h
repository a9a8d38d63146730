/* artifacts.h — the files a run leaves in output_dir=DIR:
 *
 *   collectives.csv   one row per collective call per device
 *   traffic.csv       the op x axes x phase pivot
 *   metrics.json      per-step loss, grad norms (clipped, raw), lr, time; memory per device by category
 *   run.json          resolved config (value and source of every key), mesh, rules, version, time
 *   trace.json        Chrome trace of the devices' spans
 *   named_shardings.json, logical_shardings.json, input_shardings.json
 *                     the sharding dump in MaxText's format (sharding_dump.py):
 *                     json.dumps(indent=2) layout, byte for byte
 *   parity.json       `shardsim parity`: losses per config and step, verdict
 *
 * Every file is written to a hidden temporary name in DIR and renamed into
 * place once complete, so a failure never leaves a half-written file.
 * Errors are SIM_ERR_IO naming the path and the system's reason. */
#ifndef CLI_ARTIFACTS_H
#define CLI_ARTIFACTS_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <time.h>

#include "cli/report.h"
#include "config/config.h"
#include "mesh/mesh_shape.h"
#include "mesh/rules.h"
#include "mesh/spec.h"
#include "models/core/optimizer.h"
#include "sim/trace.h"

/* Version string written to run.json when the caller gives none. */
#define CLI_SHARDSIM_VERSION "shardsim 0.1.0"

/* ---- files ------------------------------------------------------------------ */

/* Creates dir and its missing parents (mkdir -p). */
sim_status cli_artifacts_mkdir(const char *dir);
/* Writes dir/name through fn(f, arg): a temporary file renamed to the final
 * name when fn returns SIM_OK and every write succeeded; removed otherwise. */
typedef sim_status (*cli_write_fn)(FILE *f, void *arg);
sim_status cli_artifact_write(const char *dir, const char *name, cli_write_fn fn, void *arg);

/* ---- run artifacts ------------------------------------------------------------- */

/* collectives.csv: device,step,phase,tag,op,mesh_axes,group_size,dtype,elements,
 * bytes_sent,bytes_recv,kind,bytes_sent_dcn (the part of bytes_sent to other slices) — records in `steps`, device by device, in call
 * order; with max_rows > 0 only whole devices from device 0 while their rows
 * fit in max_rows (device 0 always: collectives_csv_max_rows). */
sim_status cli_write_collectives_csv(const char *dir, const cli_records *recs, cli_step_range steps, size_t max_rows);
/* How many devices (from device 0) collectives.csv holds under max_rows (0: all). */
int cli_collectives_csv_devices(const cli_records *recs, cli_step_range steps, size_t max_rows);
/* traffic.csv: op,mesh_axes,phase,calls,calls_per_device,bytes_per_device_mean,
 * bytes_per_device_max,bytes_total,share,bytes_per_device_dcn_mean (the part of the mean
 * sent to other slices) — the rows of t in its order (no total row). */
sim_status cli_write_traffic_csv(const char *dir, const cli_traffic *t);
/* metrics.json:
 *   {"steps": [{"step", "loss", "grad_norm", "raw_grad_norm", "lr", "time_s", "tokens_per_s", "peak_bytes"}...],
 *    "memory": {"per_device_peak_bytes": [...],
 *               "by_category": {"params": [per device], "grads": ..., "optimizer": ...,
 *                               "activations": ..., "temporaries": ..., "comm": ...}}}
 * by_category is each device's breakdown at its peak; a non-finite or dry-run
 * loss/grad norm is null, and so is a dry run's tokens_per_s.  grad_norm is the global norm of the
 * gradients applied, after clipping; raw_grad_norm before it (MaxText's learning/grad_norm and
 * learning/raw_grad_norm).  stats may be NULL (n_devices 0): memory is empty. */
sim_status cli_write_metrics_json(const char *dir, const cli_step_metrics *steps, int n_steps,
                                  const sim_arena_stats *stats, int n_devices);

/* What run.json records. */
typedef struct {
    const char *command; /* "train", "parity", "dump" (may be NULL) */
    int argc;            /* the command's words (may be 0) */
    const char *const *argv;
    const cfg_config *cfg;          /* resolved config (may be NULL) */
    const mesh_shape *mesh;         /* the mesh (may be NULL) */
    const mesh_rules *rules;        /* logical axis rules in effect (may be NULL) */
    const char *version;            /* NULL: CLI_SHARDSIM_VERSION */
    time_t time;                    /* 0: now */
    struct json_t *step_time_model; /* the step-time model's estimate as a JSON object (run.json's
                                    "step_time_model", model_tm_json), or NULL */
    const char *wire_gather;        /* dtype names of weight gathers and gradient reductions and the rule that set
                                    them (run.json's "weight_collective_dtypes"), or NULL */
    const char *wire_reduce, *wire_rule;
    const char *compiler_rules; /* the hardware profile's program transformations in force, one line
                                    (run.json's "compiler_rules", model_xla_rules_text), or NULL */
} cli_run_info;

/* run.json:
 *   {"shardsim_version": "...", "time": "2025-01-31T12:00:00Z", "command": "train", "argv": [...],
 *    "mesh": {"axis_names": [...], "shape": {axis: size}, "num_devices": N, "num_slices": S},
 *    "logical_axis_rules": [["name", ["axis", ...]], ...],
 *    "weight_collective_dtypes": {"weight_gather": "bfloat16", "gradient_reduction": "bfloat16", "rule": "..."},
 *    "compiler_rules": "hoisted weight copies, windowed einsums over >= 8 devices, ...",
 *    "config": {"key": {"value": <JSON value>, "source": "configs/base.yml:27"}, ...}} */
sim_status cli_write_run_json(const char *dir, const cli_run_info *info);
/* trace.json (sim_trace_write_chrome): whole devices from device 0 while
 * their events fit in max_events (0: every device; trace_max_events). */
sim_status cli_write_trace_json(const char *dir, sim_machine *m, size_t max_events);
/* Most items of trace_steps (each a step or a range). */
enum { CLI_TRACE_STEPS_MAX = 64 };
/* trace_steps (a comma-separated list of first, last, all, none, N, A-B) as ranges of steps
 * of a run that trains steps first..last into r[0..*n), at most cap of them; a bad item, a
 * step outside the run or more than cap items is SIM_ERR_INPUT naming the key. */
sim_status cli_trace_steps_parse(const char *text, int64_t first, int64_t last, sim_trace_range *r, int cap, int *n);
/* "0, 19" or "0-3, 19" ("none" for no step).  Returns buf. */
const char *cli_trace_steps_text(const sim_trace_range *r, int n, char *buf, size_t cap);

/* ---- sharding dump (MaxText format) ---------------------------------------------- */

/* A train-state leaf (parameter, optimizer state, step). */
typedef struct {
    const char *path; /* JAX keystr when it starts with '.' (".params/['params']/['decoder']/..."),
                           else a parameter path, '.' or '/' separated, with or without the
                           leading "params" ("params.decoder.layers.mlp.wi_0.kernel") */
    int rank;
    int64_t shape[MESH_SPEC_MAX_RANK];       /* global shape (scanned layers stacked) */
    const char *logical[MESH_SPEC_MAX_RANK]; /* logical axis names, NULL = None */
    mesh_spec spec;                          /* resolved, size-1 axes KEPT (mesh_resolved.unpruned) */
    bool has_opt_spec;                       /* Adam moments sharded differently (ZeRO-1) */
    mesh_spec opt_spec;                      /* their spec when has_opt_spec */
    const model_optimizer *opt;              /* the optimizer whose state the train-state dump lists (the
                                                   first entry's counts; NULL: adamw's) */
    int branch;                              /* its part holding this leaf (model_opt_param.branch: Muon
                                                   1, its AdamW fallback -1), 0 when unpartitioned */
    bool no_opt;                             /* a non-trainable variable (MaxText's MoEBiasVar):
                                                   listed with the parameters, no optimizer state */
} cli_dump_param;

/* An activation as MaxText's debug_sharding logs it. */
typedef struct {
    const char *name;  /* "<module>/<variable>": "llama2/inputs" */
    const char *dtype; /* "bfloat16", "float32", "int32" */
    int rank;
    int64_t shape[MESH_SPEC_MAX_RANK];       /* global shape */
    bool logical_known;                      /* false: logic_axes "Unknown" */
    const char *logical[MESH_SPEC_MAX_RANK]; /* logical names (rank of them), NULL = None */
    mesh_spec spec;                          /* final spec, size-1 axes dropped */
} cli_dump_activation;

typedef enum {
    CLI_DUMP_AS_GIVEN = 0, /* the entries are the leaves, in the given order */
    CLI_DUMP_TRAIN_STATE   /* the entries are the parameters: write MaxText's whole train
                               state — .step, .params/..., then the optimizer's state as
                               optax holds it (the row's tree, models/optimizers/optim.h:
                               adamw .opt_state/[0]/.count, .mu/..., .nu/...,
                               .opt_state/[2]/.count; muon the partition state
                               .opt_state/.inner_states/['adam']/... and ['muon']/...) —
                               in JAX tree order (dict keys sorted) */
} cli_dump_mode;

/* "params.decoder.mlp.wi_0.kernel" -> ".params/['params']/['decoder']/['mlp']/['wi_0']/['kernel']";
 * a path starting with '.' is copied.  Returns the length needed (snprintf style). */
int cli_dump_keystr(const char *path, char *buf, size_t cap);

/* The three files to FILE* (the layout of json.dumps(..., indent=2), no final newline). */
sim_status cli_dump_named(FILE *f, const mesh_shape *m, const cli_dump_param *p, int n, cli_dump_mode mode);
sim_status cli_dump_logical(FILE *f, const cli_dump_param *p, int n, cli_dump_mode mode);
/* Entries with the same "name: dtype[shape]" key after the first are left out
 * (MaxText logs each once). */
sim_status cli_dump_inputs(FILE *f, const mesh_shape *m, const cli_dump_activation *a, int n);
/* shardings.json: {"named_shardings": ..., "logical_shardings": ..., "input_shardings": ...}, the
 * three documents in one. */
sim_status cli_write_shardings_json(const char *dir, const mesh_shape *m, const cli_dump_param *params, int n_params,
                                    cli_dump_mode mode, const cli_dump_activation *acts, int n_act);
/* Writes named_shardings.json, logical_shardings.json and (when n_act >= 0)
 * input_shardings.json into dir. */
sim_status cli_write_sharding_dump(const char *dir, const mesh_shape *m, const cli_dump_param *params, int n_params,
                                   cli_dump_mode mode, const cli_dump_activation *acts, int n_act);

/* ---- parity ----------------------------------------------------------------- */

/* parity.json:
 *   {"rtol": r, "reference": "label0",
 *    "configs": [{"label", "overrides", "mesh", "devices",
 *                 "memory": {"per_device_peak_bytes", "capacity_bytes", "by_category"} (as metrics.json),
 *                 "traffic": {"step", "bytes_per_device",
 *                             "rows": [{"op", "axes", "phase", "calls_per_device", "bytes_per_device"}...]},
 *                 "step_time_model": {...} (run.json's, with a hardware profile)}...],
 *    "steps": [{"step", "losses": [per config], "max_rel_diff", "worst_config", "pass"}...],
 *    "max_rel_diff": x, "pass": bool,
 *    "first_diverging_step": int|null, "first_diverging_config": "label"|null,
 *    "first_diverging_param": "path"|null} */
sim_status cli_write_parity_json(const char *dir, const cli_parity *p);

#endif
