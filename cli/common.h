/* common.h — helpers shared by the shardsim commands: finding configs/,
 * splitting command-line words into command keys, YAML files and config
 * overrides, and parsing small lists. */
#ifndef CLI_COMMON_H
#define CLI_COMMON_H

#include <stdint.h>
#include <stdio.h>

#include "config/config.h"
#include "mesh/mesh_shape.h"
#include "mesh/spec.h"
#include "sim/status.h"

/* The configs/ folder: $SHARDSIM_CONFIGS, else beside the executable's
 * build/ folder, else ./configs. */
const char *cli_configs_dir(void);
/* SIM_OK when cli_configs_dir() holds base.yml; else an error saying where
 * it looked and how to point shardsim at its data (SHARDSIM_CONFIGS). */
sim_status cli_configs_check(void);
/* "configs/base.yml" under cli_configs_dir(). */
const char *cli_base_config(void);

/* Words split by kind.  `own` lists the keys the command itself takes. */
typedef struct {
    int n_own;
    const char *own_key[32];
    const char *own_val[32];
    int n_cfg; /* words for the config loader: *.yml files and other key=value */
    const char *cfg[256];
} cli_args;

sim_status cli_split_args(int argc, char **argv, const char *const *own, int n_own, cli_args *out);
/* Value of one of the command's own keys, or NULL. */
const char *cli_arg(const cli_args *a, const char *key);

/* "8,16" -> {8, 16}; errors name `what`. */
sim_status cli_parse_shape(const char *text, const char *what, int *rank, int64_t *shape);
/* "data=2,fsdp=2" -> a single-slice mesh. */
sim_status cli_parse_mesh(const char *text, mesh_shape *m);

/* rank_placement (sim/xrank.h): read from cfg, set for the machines to come, its axes checked
 * against mesh's; an error names the key. */
sim_status cli_rank_placement(const cfg_config *cfg, const mesh_shape *mesh);

/* Prints "shardsim: <message>" and returns the exit code for st.  Under mpirun it prints nothing:
 * it tells the other ranks (sim_xrank_post_failure) and keeps the message for cli_end_job. */
int cli_fail(FILE *err, sim_status st);
/* The end of the process, after the command returned rc: under mpirun every rank agrees on the
 * job's exit code and rank 0 prints the failure that started it, once (sim_xrank_conclude); then
 * MPI_Finalize.  Returns the exit code. */
int cli_end_job(int rc, FILE *err);

#endif
