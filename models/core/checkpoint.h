/* checkpoint.h — safetensors checkpoints of global tensors, written and read
 * shard by shard.
 *
 * File DIR/step_<n>.safetensors (the state after training step n, i.e.
 * after n + 1 updates, as MaxText numbers its checkpoints): 8-byte little-endian header length, a JSON
 * header (padded with spaces to a multiple of 8 bytes, as the safetensors
 * library does), then the raw float32 data, row-major, no gaps, in header
 * order.  Header:
 *   {"__metadata__": {"format": "shardsim", "step": "<n>",
 *                     "checksum.<path>": "fnv1a64:<16 hex digits>", ...},
 *    "<path>": {"dtype": "F32", "shape": [stacked shape], "data_offsets": [b, e]}, ...}
 * Tensors: every parameter under its MaxText path with the STACKED shape
 * (scanned layers at scan_dim), then, when the parameters carry optimizer
 * state, each slot as "opt_state.<slot name>.<path>", same shapes: slot 0 of
 * every parameter that has it, then slot 1, ... (model_param.slot_name, as the
 * optimizer's row names them: AdamW "opt_state.mu." and "opt_state.nu.").
 * The checksums live in __metadata__ (a string map), so readers that ignore
 * metadata still read the file.
 *
 * Saving is SPMD: every device computes the same header; device 0 removes
 * stale DIR/ *.safetensors.tmp files of killed saves and writes the header
 * (placeholder checksums) to DIR/step_<n>.safetensors.tmp; after a barrier
 * each device pwrite()s its shards at their offsets in the stacked layout —
 * only the primary replica of each block (optim.h model_layer_primary), in
 * runs of whole contiguous rows; after a second barrier device 0 reads the
 * data back, writes the real checksums (same header length), fsyncs the
 * file, renames it into place and fsyncs the directory: a save killed at any
 * point leaves either the whole file or none (device 0 also removes the
 * temporary file on any failure it sees).
 * Loading: a .tmp path is refused; every device parses the header and checks
 * it against the model's defs — every name is one of the model's tensors,
 * dtypes and shapes match, offsets lie in the file and the tensors tile the
 * data section exactly (no overlap, no gap, no trailing bytes); device 0
 * verifies every checksum and that the loaded values are finite while the
 * others wait at a barrier; then each device pread()s exactly its own shards
 * — a checkpoint saved under one mesh restores under any other.  Errors name
 * the file and the tensor.  In dry run nothing is read or written. */
#ifndef MODELS_CHECKPOINT_H
#define MODELS_CHECKPOINT_H

#include <stdbool.h>

#include "models/core/params.h"

/* "DIR/step_<n>.safetensors" into buf. */
sim_status model_checkpoint_path(const char *dir, long long step, char *buf, size_t cap);

/* Saves the parameters (and their optimizer slots when they carry any)
 * as DIR/step_<step>.safetensors.  Collective: every device calls it. */
sim_status model_checkpoint_save(sim_device *d, const mesh_shape *m, const char *dir, long long step,
                                 model_param *params, int n);

/* Loads the parameters (load_parameters_path) — and with opt_state, the optimizer
 * slots and *step (load_full_state_path; step may be NULL) — from a file
 * written by model_checkpoint_save under any mesh.  Tensors the file holds
 * under "params." that the model does not have are an error; opt_state
 * tensors are ignored unless asked for. */
sim_status model_checkpoint_load(sim_device *d, const mesh_shape *m, const char *path, model_param *params, int n,
                                 bool opt_state, long long *step);

/* The step a checkpoint was saved after (its header's "step"; a resume
 * trains from the next one); an error when the file is no checkpoint or has
 * no step.  Reads the
 * header only: the data are checked when the file is loaded. */
sim_status model_checkpoint_step(const char *path, long long *step);

/* Resume, as MaxText's checkpoint manager finds a run's latest step: the
 * highest n of the DIR/step_<n>.safetensors files (names exactly so; other
 * files are ignored), into path, with *step = n; *step = -1 when DIR is
 * missing or holds none.  *.safetensors.tmp files of a killed save are
 * never candidates; *stale counts them.  The latest file must carry step n
 * in its header: a renamed or foreign file is an error naming it, not a
 * reason to fall back to an older one. */
sim_status model_checkpoint_latest(const char *dir, char *path, size_t cap, long long *step, int *stale);

#endif
