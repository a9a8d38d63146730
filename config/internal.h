/* internal.h — what the files of config/ share and nothing outside config/ includes.
 *
 * config/ is one layer in several files (value, yaml, lookup, load, keys, axis_rules, models,
 * topology, validate, hardware, json); the helpers they share are declared here (those on text
 * and value trees in value.h, below config.h): YAML files and overrides read into values, the
 * config object's private operations, one user layer of the merge, and each step's entry. */
#ifndef CONFIG_INTERNAL_H
#define CONFIG_INTERNAL_H

#include "config/config.h"

#define CFG_RULES_KEY "logical_axis_rules"
/* The `file` of every value a command-line override made: compared by address. */
extern const char cfg_cli_source[];

/* ---- files and YAML (yaml.c) ---- */
int cfg_file_exists(const char *path);
char *cfg_dir_of(const char *path);
char *cfg_join_path(const char *dir, const char *name);
/* Names of the *.yml files in dir, sorted, for "available: ..." lists. */
char *cfg_list_yml(const char *dir);
int cfg_ends_with(const char *s, const char *suf);
/* <dir>/<sub>/<name>.yml in the first of dirs that has it, or NULL. */
char *cfg_find_named_file(char *const *dirs, int n_dirs, const char *sub, const char *name);
/* Parses YAML from a file (path) or a command-line value (text).  A file must hold a map (an
 * empty file is an empty map); values point into cfg's interned file names. */
sim_status cfg_yaml_read(cfg_config *cfg, const char *path, const char *text, cfg_value *out);
/* Adds one "key=value" override to map (see cfg_load for how values read). */
sim_status cfg_yaml_override(cfg_config *cfg, const char *arg, cfg_value *map);

/* ---- the config object (lookup.c) ---- */
cfg_config *cfg_new(void);
/* Interns a string in the config (values keep `file` pointers into it). */
const char *cfg_intern(cfg_config *cfg, const char *s);
char *cfg_where_of(const cfg_value *v);
/* Moves the items of a MAP value into entries (the MAP is left empty). */
void cfg_take_map(cfg_config *cfg, cfg_value *map);
/* (Re)builds the hash index of the entries (after entries are added). */
void cfg_index(cfg_config *cfg);
cfg_entry *cfg_find_mut(cfg_config *cfg, const char *key);
/* Sets a derived scalar (a string) with a descriptive source. */
void cfg_set_derived(cfg_config *cfg, const char *key, const char *text, const char *where);

/* ---- one layer of the merge (load.c) ---- */
typedef struct {
    cfg_value map;    /* MAP of the layer's keys */
    const char *name; /* "model file x", "file y", "the command line" */
    int config_file;  /* a MaxText config file (base.yml, or a file with base_config):
                             it sits below the model file, as MaxText's argv[1] does */
} cfg_layer;
int cfg_layer_flag(const cfg_layer *l, const char *key);
const cfg_value *cfg_layer_value(const cfg_layer *l, const char *key);
/* Checks a layer's keys (known, typed, well-formed rules) against the base values. */
sim_status cfg_check_layer(const cfg_config *cfg, const cfg_value *base_vals, const cfg_layer *l,
                           int allow_base_config);

/* A load in progress (load.c): what every step of the merge reads and adds to. */
enum { CFG_CHAIN_MAX = 16, CFG_MAX_DIRS = 3 };
typedef struct {
    const cfg_args *args;
    cfg_config *cfg;            /* the config being built */
    char *chain[CFG_CHAIN_MAX]; /* real paths of the base file and its base_config ancestors */
    int n_chain;
    cfg_layer *user; /* extra files in order, then the command line (n_user - 1) */
    int n_user;
    cfg_layer model;      /* the model file (an empty map when none) */
    cfg_value *base_vals; /* the merged base's values, before any layer */
    int n_base;
    char *dirs[CFG_MAX_DIRS]; /* where models/, custom_mesh_and_rule/, ranges.yml are looked up */
    int n_dirs;
} cfg_loader;

/* ---- the key contract (keys.c) ---- */
/* Reads <configs_dir>/keys.yml when it exists: classes every entry, adds the keys the base file
 * lacks with their keys.yml default. */
sim_status cfg_keys_apply(cfg_config *cfg, const char *configs_dir);
/* After merging: marks changed keys, refuses what is not simulated. */
sim_status cfg_keys_check(cfg_config *cfg, const cfg_value *base_vals, int n_base);
sim_status cfg_keys_unknown(const cfg_config *cfg, const char *key, const cfg_value *v, const char *layer);
/* The value must have the type keys.yml gives the key, else the type of the base default. */
sim_status cfg_keys_check_type(const cfg_entry *e, const cfg_value *base, const cfg_value *v);

/* ---- logical_axis_rules, mesh axes, custom_mesh_and_rule (axis_rules.c) ---- */
sim_status cfg_rules_check(const cfg_value *v);
/* MaxText's _merge_logical_axis_rules: drop every rule of acc whose name add mentions, append add. */
void cfg_rules_merge(cfg_value *acc, const cfg_value *add);
sim_status cfg_axes_check(const cfg_value *v, const char *key, int allow_nested);
/* The rules of the base, the MaxText config files, the model file and the user layers, merged
 * as pyconfig.py does, written back into the config. */
void cfg_rules_merge_layers(cfg_loader *ld);
/* custom_mesh_and_rule=NAME, when set. */
sim_status cfg_custom_apply_selected(cfg_loader *ld);
sim_status cfg_check_final(const cfg_config *cfg);
void cfg_data_sharding_normalize(cfg_config *cfg);

/* ---- model files and decoder blocks (models.c) ---- */
/* A layer that sets a decoder_block MaxText has and shardsim does not simulate is refused by
 * it (model_name names the model file that set it, or NULL). */
sim_status cfg_block_refuse(const cfg_config *cfg, const cfg_value *v, const char *model_name);
/* 1 when the block's line of <configs>/decoder_blocks.yml sets `field: true` (a capability MaxText
 * gives some blocks only). */
int cfg_block_flag(const cfg_config *cfg, const char *block, const char *field);
/* Reads the model file the user layers' model_name selects into ld->model and checks it. */
sim_status cfg_models_read(cfg_loader *ld);
/* A key the model file sets and a user layer sets differently needs override_model_config=true. */
sim_status cfg_models_check_overrides(const cfg_loader *ld);

/* ---- hardware profiles (hardware.c) ---- */
void cfg_hw_cache_free(struct cfg_hw_cache *c);

/* ---- compile_topology (topology.c), ranges and combinations (validate.c) ---- */
sim_status cfg_topology_apply(cfg_config *cfg, const char *configs_dir);
sim_status cfg_maxtext_rules(const cfg_config *cfg);
sim_status cfg_combinations_check(cfg_config *cfg, char *const *dirs, int n_dirs);
sim_status cfg_ranges_check(cfg_config *cfg, char *const *dirs, int n_dirs);

#endif
