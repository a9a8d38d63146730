/* models.h — model files (<configs>/models/NAME.yml, MaxText's own) and their decoder blocks.
 *
 * The loader (config.h) applies the model file that model_name selects, refuses a model whose
 * decoder block is not simulated (keys.yml's decoder_block `simulated`) by that block, with
 * decoder_blocks.yml's description, and refuses a user layer that changes a model's key without
 * override_model_config=true (MaxText's rule).  `shardsim models` lists the files by block. */
#ifndef CONFIG_MODELS_H
#define CONFIG_MODELS_H

#include "config/config.h"

/* A model name is a file <configs>/models/<model_name>.yml (MaxText's own files); its
 * decoder_block says which layer MaxText builds.  keys.yml's decoder_block `simulated` lists the
 * blocks shardsim runs: a model file (or any layer) naming another block MaxText has is refused
 * by its block before its keys are checked, with <configs>/decoder_blocks.yml's description. */
typedef struct {
    char *name;  /* the model name: the file name without .yml */
    char *file;  /* <configs>/models/<name>.yml */
    char *block; /* its decoder_block (keys.yml's default when the file sets none) */
} cfg_model_file;

/* Every model file of the config's configs directory, sorted by name. */
sim_status cfg_model_files(const cfg_config *cfg, cfg_model_file **out, int *n);
void cfg_model_files_free(cfg_model_file *m, int n);
/* 1 when keys.yml lists the block as simulated (or the config has no keys.yml). */
int cfg_block_simulated(const cfg_config *cfg, const char *block);
/* "models/mixtral.py MixtralDecoderLayer: <what it computes>" from decoder_blocks.yml, malloc'd,
 * or NULL when the file or the block's line is missing. */
char *cfg_block_about(const cfg_config *cfg, const char *block);

#endif
