/* topology.c — compile_topology=NAME (MaxText's ahead-of-time target): num_devices, num_slices and
 * dry_run from <configs>/topologies.yml and compile_topology_num_slices. */
#include "config/internal.h"

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* compile_topology=NAME (MaxText's ahead-of-time target): the devices and
 * slices of that topology, from <configs>/topologies.yml, and a dry run (there
 * is nothing to train on).  As in MaxText's train_compile, the slice count is
 * compile_topology_num_slices and must be positive. */
/* The devices per slice of topology `name` in topologies.yml's table; an unknown name is an error
 * with the closest known one. */
static sim_status topology_size(const cfg_value *doc, const char *path, const cfg_entry *t, long long *per_slice)
{
    const char *name = t->value.text;
    const cfg_value *table = cfg_map_get(doc, "topologies");
    const cfg_value *dps = cfg_map_get(table, name);
    if (dps) return cfg_value_int(dps, "a topology size", per_slice);
    const char *near = NULL;
    int best = INT_MAX;
    for (int i = 0; table && i < table->n; i++) {
        int d = cfg_edit_distance(name, table->keys[i]);
        if (d < best) best = d, near = table->keys[i];
    }
    return sim_err(SIM_ERR_INPUT, "compile_topology=%s (%s): not a topology in %s%s%s%s; use a MaxText name like v5p-8",
                   name, t->where, path, near ? "; did you mean '" : "", near ? near : "", near ? "'?" : "");
}

/* num_devices and num_slices from the topology (a count the user gave must agree), and dry_run. */
static sim_status set_topology(cfg_config *cfg, const char *name, long long devices, long long slices)
{
    char nd[32], ns[32], where[600];
    snprintf(nd, sizeof nd, "%lld", devices);
    snprintf(ns, sizeof ns, "%lld", slices);
    snprintf(where, sizeof where, "compile_topology=%s x compile_topology_num_slices=%lld", name, slices);
    static const char *const keys[] = {"num_devices", "num_slices"};
    const char *vals[] = {nd, ns};
    for (int k = 0; k < 2; k++) {
        const cfg_entry *e = cfg_find(cfg, keys[k]);
        long long v;
        if (e && e->from_user && cfg_value_int(&e->value, keys[k], &v) == SIM_OK && v != -1 && v != atoll(vals[k]))
            return sim_err(SIM_ERR_INPUT, "%s=%lld (%s) disagrees with %s (%s devices in %s slices); drop %s", keys[k],
                           v, e->where, where, nd, ns, keys[k]);
        sim_err_clear(); /* a non-integer value was not an error here */
        if (e) {
            cfg_set_derived(cfg, keys[k], vals[k], where);
            cfg_find_mut(cfg, keys[k])->value.quoted = 0; /* a number, not a string */
        }
    }
    if (cfg_find(cfg, "dry_run")) {
        cfg_set_derived(cfg, "dry_run", "true", where);
        cfg_find_mut(cfg, "dry_run")->value.quoted = 0;
    }
    return SIM_OK;
}

sim_status cfg_topology_apply(cfg_config *cfg, const char *configs_dir)
{
    const cfg_entry *t = cfg_find(cfg, "compile_topology");
    if (!t || t->value.kind != CFG_SCALAR || cfg_is_null(&t->value) || !*t->value.text) return SIM_OK;
    const char *name = t->value.text;
    long long slices, per_slice = 0;
    SIM_TRY(cfg_get_int(cfg, "compile_topology_num_slices", &slices));
    if (slices < 1)
        return sim_err(SIM_ERR_INPUT,
                       "compile_topology=%s (%s) needs compile_topology_num_slices >= 1 (it is %lld); MaxText's "
                       "train_compile requires it too: add compile_topology_num_slices=1",
                       name, t->where, slices);
    char *path = cfg_join_path(configs_dir, "topologies.yml");
    cfg_value doc = {0};
    sim_status st;
    if (!cfg_file_exists(path))
        SIM_TRY_GOTO(sim_err(SIM_ERR_INPUT, "compile_topology=%s: no topology table %s", name, path), st, fail);
    SIM_TRY_GOTO(cfg_yaml_read(cfg, path, NULL, &doc), st, fail);
    SIM_TRY_GOTO(topology_size(&doc, path, t, &per_slice), st, fail);
    SIM_TRY_GOTO(set_topology(cfg, name, per_slice * slices, slices), st, fail);
fail:
    cfg_value_free(&doc);
    free(path);
    return st;
}
