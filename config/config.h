/* config.h — MaxText-style configuration: YAML files plus key=value overrides.
 *
 * A config is an ordered map key -> value.  A value is a scalar (kept as the
 * text written, parsed as null/bool/int/float/string on demand), a list, or a
 * map; lists nest (logical_axis_rules is a list of [name, axes] pairs).
 * cfg_load applies MaxText's merge rules (pyconfig.py / types.py):
 *
 *   1. base file (default configs/base.yml), after its `base_config:` chain
 *      (parent first; a child may add keys).  The keys of this merged base are
 *      the KNOWN keys: nothing is compiled in.
 *   2. the model file <configs>/models/<model_name>.yml (model_name as set by
 *      the base, the extra files or the command line; "default" = no file).
 *   3. extra YAML files, in order, then key=value overrides, in order.  A key
 *      that the model file sets and a user layer (3) sets to a different value
 *      is an error unless override_model_config=true (MaxText's rule).  A
 *      MaxText config file among the files (named base.yml, or with a
 *      base_config key) is MaxText's argv[1] instead: it applies below the
 *      model file (which overrides it without conflict), its rules merge as
 *      base rules, and its directory is searched first for models/ and
 *      custom_mesh_and_rule/.
 *   logical_axis_rules are not replaced but MERGED by logical name at each of
 *   2 and 3: every earlier rule whose name the new list mentions is dropped and
 *   the new rules are appended (override_logical_axis_rules=true in that layer
 *   replaces the list instead).
 *   4. custom_mesh_and_rule=NAME: <configs>/custom_mesh_and_rule/NAME.yml
 *      REPLACES mesh_axes, logical_axis_rules and data_sharding (whichever it
 *      has); its other keys must be known but are not applied.  context_sharding
 *      is then re-inferred as the first axis of the `activation_length` rule
 *      that is `context` or `expert` (when there is one and no user layer set
 *      context_sharding).
 *
 * Keys in model, custom, extra files and overrides must be known; an unknown
 * key is an error naming the key, its source and the closest known key.  A
 * value must have the type of the base value (int where the base has an int,
 * a list where it has a list, ...; a string or null base accepts any scalar).
 * Every entry records where its value came from ("file:line",
 * "command line", ...).
 *
 * The key contract: when the configs directory holds keys.yml (configs/keys.yml
 * lists every key of MaxText's base.yml and of shardsim, one line each), the
 * known keys are its keys (a key of the base file without a line there is an
 * error), keys the base file lacks take the keys.yml default, values are typed
 * by its `type`, and after merging every key whose value differs from its
 * default is checked against its class: refused (or a value outside
 * `simulated`, or outside MaxText's `choices`) is an error naming the key, the
 * feature and the fix; inert keys are marked for run.json.  Then MaxText's
 * combination checks (types.py) that concern simulated features, and
 * compile_topology=NAME (<configs>/topologies.yml) sets num_devices,
 * num_slices and dry_run. */
#ifndef CONFIG_CONFIG_H
#define CONFIG_CONFIG_H

#include "config/value.h"
#include "sim/status.h"

/* A key's class in configs/keys.yml. */
typedef enum {
    CFG_KEY_UNCLASSIFIED = 0, /* no keys.yml for this config */
    CFG_KEY_HONOURED,         /* read by the simulator with MaxText's meaning */
    CFG_KEY_INERT,            /* cannot change losses, shardings, memory or traffic */
    CFG_KEY_REFUSED           /* a feature not simulated: only the default is accepted */
} cfg_key_class;

typedef struct {
    char *key;
    cfg_value value;
    char *where;           /* source of the current value: "configs/base.yml:27",
                     "command line", "inferred from custom_mesh_and_rule=..." */
    int from_model;        /* 1 when the model file set this key */
    int from_user;         /* 1 when an extra file or the command line set this key */
    cfg_key_class cls;     /* from keys.yml (UNCLASSIFIED without one) */
    const char *why;       /* keys.yml's one-line reason, or NULL */
    const cfg_value *spec; /* the key's keys.yml line (a map), or NULL */
    int changed;           /* 1 when the value differs from the default */
} cfg_entry;

typedef struct {
    int n;                          /* number of entries (= number of known keys) */
    cfg_entry *entries;             /* in the base config's order */
    char *base_file;                /* the base file as given */
    char *configs_dir;              /* where models/ and custom_mesh_and_rule/ are looked up */
    char *model_file;               /* the model file applied, NULL for model_name=default */
    char *custom_file;              /* the custom_mesh_and_rule file applied, or NULL */
    char *keys_file;                /* the keys.yml applied, or NULL */
    const cfg_value *registry;      /* keys.yml's `keys` map, parsed once per process
                                       (entries' spec/why point into it), or NULL */
    int *index, index_cap, index_n; /* hash index of the entries (position + 1) */
    struct cfg_hw_cache *hw;        /* the hardware profile the config selects, read once (hardware.h) */
    /* Strings that values point to (file names); owned by the config. */
    int n_strings, cap_strings;
    char **strings;
} cfg_config;

typedef struct {
    const char *base_file;    /* NULL: "configs/base.yml" */
    const char *configs_dir;  /* NULL: the base file's directory */
    const char *const *files; /* extra YAML files, applied in order */
    int n_files;
    const char *const *overrides; /* "key=value" strings, applied in order */
    int n_overrides;
} cfg_args;

/* Loads and merges a config as described above.  *out is heap-allocated; free
 * it with cfg_free.  Override values: text starting with '[' or '{' is a
 * YAML flow list/map (`logical_axis_rules=[['norm','fsdp']]`); text in single
 * or double quotes is a string; anything else is a plain scalar taken verbatim
 * (`dataset_path=/a b:c#d` is that string). */
sim_status cfg_load(const cfg_args *args, cfg_config **out);
/* Command-line convenience: arguments ending in .yml/.yaml are extra files,
 * arguments with '=' are overrides, anything else is an error naming it. */
sim_status cfg_load_argv(const char *base_file, int argc, const char *const *argv, cfg_config **out);
/* Loads one YAML file on its own (no merging, no key checks): for tools and
 * tests that compare raw files. */
sim_status cfg_load_file(const char *path, cfg_config **out);
void cfg_free(cfg_config *cfg);

/* ---- lookup ---------------------------------------------------------------- */
const cfg_entry *cfg_find(const cfg_config *cfg, const char *key);
/* The entry, or SIM_ERR_INPUT naming the key and the closest known key. */
sim_status cfg_entry_get(const cfg_config *cfg, const char *key, const cfg_entry **out);
/* The known key closest to `key` by edit distance (NULL for an empty config). */
const char *cfg_closest_key(const cfg_config *cfg, const char *key);

/* ---- the key contract (keys.c) ------------------------------------------------
 * configs/keys.yml, parsed once per process and path (configs point into it), classes and types
 * every entry; after merging, a changed key is checked against its class, `simulated` and `choices`. */
/* "honoured", "inert", "refused" or "unclassified". */
const char *cfg_key_class_name(cfg_key_class c);

/* A field of the key's keys.yml line ("type", "default", "simulated", ...), or
 * NULL when the line has no such field or the config has no keys.yml. */
const cfg_value *cfg_entry_field(const cfg_entry *e, const char *field);

/* ---- typed getters: SIM_ERR_INPUT naming key, value, source and the expected
 * type when the key is missing or its value does not parse. ------------------ */
sim_status cfg_get_int(const cfg_config *cfg, const char *key, long long *out);
sim_status cfg_get_double(const cfg_config *cfg, const char *key, double *out);
sim_status cfg_get_bool(const cfg_config *cfg, const char *key, int *out);
/* Scalar text; *out = NULL when the value is null/None. */
sim_status cfg_get_str(const cfg_config *cfg, const char *key, const char **out);
/* Index of the value in allowed[0..n_allowed) (exact match); error lists them. */
sim_status cfg_get_enum(const cfg_config *cfg, const char *key, const char *const *allowed, int n_allowed, int *out);
/* A list of scalars: *n items, (*items)[i] points into the config (do not free
 * the strings; free(*items) only).  null gives 0 items. */
sim_status cfg_get_str_list(const cfg_config *cfg, const char *key, const char ***items, int *n);

#endif
