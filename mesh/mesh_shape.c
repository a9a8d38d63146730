/* mesh_shape.c — mesh from flags (MaxText create_device_mesh and
 * fill_unspecified_mesh_axes), coordinates and device ids. */
#include "mesh/mesh_shape.h"

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config/release.h"

const char *mesh_shape_flag_stem(const char *axis)
{
    /* MaxText names the stage axis' flags after pipelining. */
    return strcmp(axis, "stage") == 0 ? "pipeline" : axis;
}

/* "ici_fsdp_parallelism=4 x ici_tensor_parallelism=2" for the flags != 1
 * (and != -1: the filler is named separately). */
static void describe_level(char *buf, size_t cap, int n, const int *vals, const char *const *flags,
                           const char *const *names)
{
    size_t k = 0;
    buf[0] = '\0';
    for (int i = 0; i < n && k < cap; i++) {
        if (vals[i] == 1 || vals[i] == -1) continue;
        k += (size_t)snprintf(buf + k, cap - k, "%s%s=%d", k ? " x " : "", flags ? flags[i] : names[i], vals[i]);
    }
    if (!buf[0]) snprintf(buf, cap, "all 1");
}

/* MaxText fill_unspecified_mesh_axes for one level; target <= 0: unknown
 * (a -1 counts as 1 and the product becomes the target).  target_what names
 * the target with its numbers ("the 8 devices per slice (num_devices=8,
 * num_slices=1)"); fix_hint says what else the user may change. */
static sim_status fill_level(int n, int *vals, long long *target, const char *level, const char *const *flags,
                             const char *const *names, const char *target_what, const char *fix_hint)
{
    int minus = -1;
    long long prod = 1;
    for (int i = 0; i < n; i++) {
        const char *flag = flags ? flags[i] : names[i];
        if (vals[i] == -1) {
            if (minus >= 0)
                return sim_err(SIM_ERR_INPUT,
                               "%s parallelism: %s=-1 and %s=-1: at most one %s flag may be -1 "
                               "(it takes the devices left over); set one of them to a number",
                               level, flags ? flags[minus] : names[minus], flag, level);
            minus = i;
        } else if (vals[i] < 1) {
            return sim_err(SIM_ERR_INPUT, "%s=%d: a parallelism must be a positive number or -1", flag, vals[i]);
        } else {
            prod *= vals[i];
            if (prod > (1LL << 30))
                return sim_err(SIM_ERR_INPUT, "%s parallelism: product of the flags is too large", level);
        }
    }
    char desc[1024];
    if (*target <= 0) {
        if (minus >= 0) vals[minus] = 1;
        *target = prod;
        return SIM_OK;
    }
    if (minus >= 0) {
        if (*target % prod != 0) {
            describe_level(desc, sizeof desc, n, vals, flags, names);
            return sim_err(SIM_ERR_INPUT,
                           "%s parallelism: the product %lld of the other %s flags (%s) does not "
                           "divide %s, so %s=-1 cannot fill the rest; change the flags or %s",
                           level, prod, level, desc, target_what, flags ? flags[minus] : names[minus], fix_hint);
        }
        vals[minus] = (int)(*target / prod);
        return SIM_OK;
    }
    if (prod != *target) {
        describe_level(desc, sizeof desc, n, vals, flags, names);
        return sim_err(SIM_ERR_INPUT,
                       "%s parallelism: the product of the %s flags is %lld (%s), which does not "
                       "match %s; make them agree (change the flags or %s), or set one %s flag "
                       "to -1 to fill the rest",
                       level, level, prod, desc, target_what, fix_hint, level);
    }
    return SIM_OK;
}

sim_status mesh_shape_build(mesh_shape *m, int n_axes, const char *const *names, const int *ici, const int *dcn,
                            int num_devices, int num_slices, const char *const *ici_flags, const char *const *dcn_flags)
{
    memset(m, 0, sizeof *m);
    if (n_axes < 1 || n_axes > MESH_MAX_AXES)
        return sim_err(SIM_ERR_INPUT, "mesh_axes has %d axes; shardsim supports 1 to %d", n_axes, MESH_MAX_AXES);
    for (int i = 0; i < n_axes; i++) {
        if (strlen(names[i]) == 0 || strlen(names[i]) >= MESH_AXIS_NAME_MAX)
            return sim_err(SIM_ERR_INPUT, "mesh axis name '%s' must have 1 to %d characters", names[i],
                           MESH_AXIS_NAME_MAX - 1);
        for (int j = 0; j < i; j++)
            if (strcmp(names[i], names[j]) == 0) return sim_err(SIM_ERR_INPUT, "mesh_axes lists '%s' twice", names[i]);
        snprintf(m->names[i], MESH_AXIS_NAME_MAX, "%s", names[i]);
        m->ici[i] = ici[i];
        m->dcn[i] = dcn ? dcn[i] : 1;
    }
    m->n_axes = n_axes;
    long long slices = num_slices > 0 ? num_slices : 1;
    char what[160];
    snprintf(what, sizeof what, "num_slices=%lld", slices);
    SIM_TRY(fill_level(n_axes, m->dcn, &slices, "dcn", dcn_flags, names, what, "num_slices"));
    long long per_slice = 0;
    if (num_devices > 0) {
        if (num_devices % slices != 0)
            return sim_err(SIM_ERR_INPUT,
                           "num_devices=%d is not a multiple of num_slices=%lld; every slice "
                           "holds the same number of devices",
                           num_devices, slices);
        per_slice = num_devices / slices;
    }
    snprintf(what, sizeof what, "the %lld devices per slice (num_devices=%d, num_slices=%lld)", per_slice, num_devices,
             slices);
    SIM_TRY(fill_level(n_axes, m->ici, &per_slice, "ici", ici_flags, names, what, "num_devices"));
    m->num_slices = (int)slices;
    m->num_devices = (int)(per_slice * slices);
    for (int i = 0; i < n_axes; i++) m->sizes[i] = m->dcn[i] * m->ici[i];
    return SIM_OK;
}

sim_status mesh_shape_init(mesh_shape *m, int n_axes, const char *const *names, const int *sizes)
{
    return mesh_shape_build(m, n_axes, names, sizes, NULL, 0, 1, NULL, NULL);
}

static sim_status flag_value(const cfg_config *cfg, const char *level, const char *axis, const char *mesh_where,
                             char *flag, size_t cap, int *out)
{
    snprintf(flag, cap, "%s_%s_parallelism", level, mesh_shape_flag_stem(axis));
    if (!cfg_find(cfg, flag))
        return sim_err(SIM_ERR_INPUT,
                       "mesh axis '%s' (mesh_axes, %s) has no %s flag: the base config %s does not "
                       "define it; add `%s: 1` to the base config or drop the axis",
                       axis, mesh_where, flag, cfg->base_file, flag);
    long long v;
    SIM_TRY(cfg_get_int(cfg, flag, &v));
    if (v < -1 || v == 0 || v > (1 << 24)) {
        const cfg_entry *e = cfg_find(cfg, flag);
        return sim_err(SIM_ERR_INPUT, "%s=%lld (%s): a parallelism must be a positive number or -1", flag, v, e->where);
    }
    *out = (int)v;
    return SIM_OK;
}

/* The dcn_* keys MaxText multiplies to decide whether DCN parallelism was
 * requested: MaxText 0.2.5 src/maxtext/configs/types.py,
 * MaxTextConfig.set_derived_and_validate_values (`dcn_product = ...; if
 * abs(dcn_product) > 1 and not num_slices > 1: raise ValueError("DCN
 * parallelism requested but only one slice available.")`; the same list in
 * pyconfig_deprecated.py validate_multiple_slices).  It checks the keys, not
 * mesh_axes, so a legacy key outside the mesh (dcn_sequence_parallelism) or
 * an axis a custom mesh leaves out is refused too.  dcn_diloco_parallelism is
 * not in MaxText's product; dcn_tensor_transpose_parallelism is shardsim's
 * legacy key (MaxText removed tensor_transpose) and is held to the same rule. */
static const char *const DCN_SLICE_KEYS[] = {"dcn_data_parallelism",
                                             "dcn_pipeline_parallelism",
                                             "dcn_fsdp_parallelism",
                                             "dcn_fsdp_transpose_parallelism",
                                             "dcn_sequence_parallelism",
                                             "dcn_context_parallelism",
                                             "dcn_context_usp_ulysses_parallelism",
                                             "dcn_tensor_parallelism",
                                             "dcn_tensor_sequence_parallelism",
                                             "dcn_expert_parallelism",
                                             "dcn_context_autoregressive_parallelism",
                                             "dcn_autoregressive_parallelism",
                                             "dcn_tensor_transpose_parallelism"};

/* With one slice every key of DCN_SLICE_KEYS must be 1 or -1 (|product| <= 1,
 * MaxText's test, is the same as every |value| <= 1 once 0 is refused). */
static sim_status check_dcn_keys(const cfg_config *cfg, long long num_slices)
{
    for (size_t i = 0; i < sizeof DCN_SLICE_KEYS / sizeof DCN_SLICE_KEYS[0]; i++) {
        const char *key = DCN_SLICE_KEYS[i];
        const cfg_entry *e = cfg_find(cfg, key);
        if (!e) continue; /* a base config without the legacy key */
        long long v;
        SIM_TRY(cfg_get_int(cfg, key, &v));
        /* stricter than MaxText for a key outside the mesh (it lets 0 through
         * there): a parallelism of 0 or below -1 is a typo wherever it is */
        if (v == 0 || v < -1)
            return sim_err(SIM_ERR_INPUT,
                           "%s=%lld (%s): a parallelism must be a positive number or -1; set it to "
                           "1 (or to the slices along that axis)",
                           key, v, e->where);
        if (v > 1 && num_slices <= 1)
            return sim_err(SIM_ERR_INPUT,
                           "%s=%lld (%s): DCN parallelism requested but only one slice available "
                           "(num_slices=%lld; MaxText 0.2.5 raises this in configs/types.py): a "
                           "dcn_* parallelism must be 1 (or -1) with one slice; set %s=1, or set "
                           "num_slices (compile_topology_num_slices) to the number of slices",
                           key, v, e->where, num_slices, key);
    }
    return SIM_OK;
}

/* An ici parallelism flag of an axis the release followed does not have (maxtext_release's
 * absent_axes: 0.2.5 has no 'tensor_transpose' or 'sequence') is refused, naming the release, unless
 * the config's own mesh_axes has the axis (custom_mesh_and_rule=legacy): MaxText would not know it.
 * (The dcn flags keep the slice rule above: with slices to spare they are accepted, unused.) */
static sim_status check_absent_axes(const cfg_config *cfg, const char *const *axes, int n)
{
    if (!cfg_find(cfg, "maxtext_release")) return SIM_OK;
    const cfg_release *r;
    SIM_TRY(cfg_release_of(cfg, &r));
    static const char pre[] = "ici_", suf[] = "_parallelism";
    const size_t lp = sizeof pre - 1, sl = sizeof suf - 1;
    for (int i = 0; i < cfg->n; i++) {
        const char *key = cfg->entries[i].key;
        size_t kl = strlen(key);
        if (strncmp(key, pre, lp) || kl <= lp + sl || strcmp(key + kl - sl, suf)) continue;
        char axis[64];
        snprintf(axis, sizeof axis, "%.*s", (int)(kl - lp - sl), key + lp);
        const char *fix = cfg_release_absent_axis(r, axis);
        if (!fix) continue;
        bool in_mesh = false;
        for (int a = 0; a < n; a++) in_mesh |= !strcmp(axes[a], axis);
        long long v;
        if (in_mesh || cfg_get_int(cfg, key, &v) != SIM_OK || v == 1) {
            sim_err_clear();
            continue;
        }
        return sim_err(SIM_ERR_INPUT, "%s=%lld (%s): MaxText %s has no '%s' mesh axis (maxtext_release=%s); %s", key, v,
                       cfg->entries[i].where, cfg_release_maxtext(r), axis, cfg_release_maxtext(r), fix);
    }
    return SIM_OK;
}

sim_status mesh_shape_from_config(const cfg_config *cfg, mesh_shape *m)
{
    const char **axes = NULL;
    int n = 0;
    SIM_TRY(cfg_get_str_list(cfg, "mesh_axes", &axes, &n));
    const cfg_entry *me = cfg_find(cfg, "mesh_axes");
    sim_status st;
    int ici[MESH_MAX_AXES], dcn[MESH_MAX_AXES];
    char ici_names[MESH_MAX_AXES][96], dcn_names[MESH_MAX_AXES][96];
    const char *ici_flags[MESH_MAX_AXES], *dcn_flags[MESH_MAX_AXES];
    long long num_devices = -1, num_slices = 1;
    if (n < 1 || n > MESH_MAX_AXES)
        SIM_TRY_GOTO(
            sim_err(SIM_ERR_INPUT, "mesh_axes (%s) has %d axes; shardsim supports 1 to %d", me->where, n, MESH_MAX_AXES),
            st, fail);
    for (int i = 0; i < n; i++) {
        SIM_TRY_GOTO(flag_value(cfg, "ici", axes[i], me->where, ici_names[i], sizeof ici_names[i], &ici[i]), st, fail);
        SIM_TRY_GOTO(flag_value(cfg, "dcn", axes[i], me->where, dcn_names[i], sizeof dcn_names[i], &dcn[i]), st, fail);
        ici_flags[i] = ici_names[i];
        dcn_flags[i] = dcn_names[i];
    }
    if (cfg_find(cfg, "num_slices")) {
        SIM_TRY_GOTO(cfg_get_int(cfg, "num_slices", &num_slices), st, fail);
        /* MaxText: -1 = detect; off TPU that is one slice. */
        if (num_slices == -1) num_slices = 1;
        if (num_slices < 1 || num_slices > (1 << 20))
            SIM_TRY_GOTO(sim_err(SIM_ERR_INPUT, "num_slices=%lld (%s): expected a positive number or -1", num_slices,
                                 cfg_find(cfg, "num_slices")->where),
                         st, fail);
    }
    SIM_TRY_GOTO(check_dcn_keys(cfg, num_slices), st, fail);
    SIM_TRY_GOTO(check_absent_axes(cfg, axes, n), st, fail);
    if (cfg_find(cfg, "num_devices")) {
        SIM_TRY_GOTO(cfg_get_int(cfg, "num_devices", &num_devices), st, fail);
        if (num_devices == 0 || num_devices < -1 || num_devices > (1 << 24))
            SIM_TRY_GOTO(sim_err(SIM_ERR_INPUT,
                                 "num_devices=%lld (%s): expected a positive device count, or -1 for the "
                                 "product of the ici/dcn flags",
                                 num_devices, cfg_find(cfg, "num_devices")->where),
                         st, fail);
    }
    SIM_TRY_GOTO(mesh_shape_build(m, n, axes, ici, dcn, (int)num_devices, (int)num_slices, ici_flags, dcn_flags), st,
                 fail);
fail:
    free(axes);
    return st;
}

int mesh_shape_axis_index(const mesh_shape *m, const char *name)
{
    for (int i = 0; i < m->n_axes; i++)
        if (strcmp(m->names[i], name) == 0) return i;
    return -1;
}

void mesh_shape_coords(const mesh_shape *m, int device, int *coords)
{
    SIM_ASSERT(device >= 0 && device < m->num_devices);
    for (int i = m->n_axes - 1; i >= 0; i--) {
        coords[i] = device % m->sizes[i];
        device /= m->sizes[i];
    }
}

int mesh_shape_device(const mesh_shape *m, const int *coords)
{
    int id = 0;
    for (int i = 0; i < m->n_axes; i++) {
        SIM_ASSERT(coords[i] >= 0 && coords[i] < m->sizes[i]);
        id = id * m->sizes[i] + coords[i];
    }
    return id;
}

int mesh_shape_slice(const mesh_shape *m, int device)
{
    int coords[MESH_MAX_AXES];
    mesh_shape_coords(m, device, coords);
    int s = 0;
    for (int i = 0; i < m->n_axes; i++) s = s * m->dcn[i] + coords[i] / m->ici[i];
    return s;
}

const char *mesh_shape_format(const mesh_shape *m, char *buf, int cap)
{
    int k = 0;
    buf[0] = '\0';
    for (int i = 0; i < m->n_axes && k < cap; i++)
        k += snprintf(buf + k, (size_t)(cap - k), "%s%s=%d", i ? " " : "", m->names[i], m->sizes[i]);
    return buf;
}

int mesh_shape_equal(const mesh_shape *a, const mesh_shape *b)
{
    if (a->n_axes != b->n_axes) return 0;
    for (int i = 0; i < a->n_axes; i++)
        if (strcmp(a->names[i], b->names[i]) != 0 || a->sizes[i] != b->sizes[i] || a->dcn[i] != b->dcn[i] ||
            a->ici[i] != b->ici[i])
            return 0;
    return 1;
}
