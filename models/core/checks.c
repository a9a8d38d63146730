/* checks.c — sharding_tolerance and debug_sharding (see checks.h).  Facts from MaxText 0.2.5:
 * maxtext/utils/sharding.py (_get_nontrival_mesh_axes, _analyze_sharding,
 * _raise_if_unsharded_exceeds_tolerance, maybe_shard_with_name) and
 * maxtext/utils/maxtext_utils.py (print_shardings_params). */
#include "models/core/checks.h"

#include <stdlib.h>
#include <string.h>

static const char *const TARGET_AXES[] = {
    "fsdp",   "fsdp_transpose",  "sequence", "context", "context_usp_ulysses", "context_autoregressive",
    "tensor", "tensor_sequence", "stage",    "expert"};
enum { NTARGET = sizeof TARGET_AXES / sizeof TARGET_AXES[0] };

/* Bitmask of the mesh axes the check looks at (present with more than one device). */
static uint32_t target_mask(const mesh_shape *mesh)
{
    uint32_t t = 0;
    for (int i = 0; i < NTARGET; i++) {
        int a = mesh_shape_axis_index(mesh, TARGET_AXES[i]);
        if (a >= 0 && mesh->sizes[a] > 1) t |= 1u << a;
    }
    return t;
}

static int64_t elems(const model_param_def *d)
{
    int64_t n = 1;
    for (int i = 0; i < d->rank; i++) n *= d->shape[i];
    return n;
}

double model_unsharded_share(const model_def *m)
{
    uint32_t t = target_mask(&m->mesh);
    if (!t) return -1;
    double unsharded = 0, bytes = 0;
    for (int i = 0; i < m->nparams; i++) {
        bytes += 4.0 * (double)elems(&m->defs[i]); /* weight_dtype float32 */
        if ((mesh_spec_dim_axes(&m->unpruned[i]) & t) != t) unsharded += (double)elems(&m->defs[i]);
    }
    return unsharded / bytes;
}

/* Python's repr of a list of axis names, e.g. ['fsdp', 'tensor']. */
static int axes_list(const mesh_shape *mesh, uint32_t mask, char *buf, int cap)
{
    int o = snprintf(buf, (size_t)cap, "[");
    bool first = true;
    /* MaxText sorts the names */
    for (int pass = 0; pass < 1; pass++) {
        const char *names[MESH_MAX_AXES];
        int n = 0;
        for (int a = 0; a < mesh->n_axes; a++)
            if (mask >> a & 1) names[n++] = mesh->names[a];
        for (int i = 1; i < n; i++)
            for (int j = i; j > 0 && strcmp(names[j - 1], names[j]) > 0; j--) {
                const char *x = names[j];
                names[j] = names[j - 1];
                names[j - 1] = x;
            }
        for (int i = 0; i < n && o < cap; i++) {
            o += snprintf(buf + o, (size_t)(cap - o), "%s'%s'", first ? "" : ", ", names[i]);
            first = false;
        }
    }
    if (o < cap) o += snprintf(buf + o, (size_t)(cap - o), "]");
    return o;
}

/* Python's repr of a tuple of spec entries: ('fsdp', None, ('data', 'tensor')). */
static void spec_tuple(const mesh_spec *s, const mesh_shape *mesh, char *buf, int cap)
{
    int o = snprintf(buf, (size_t)cap, "(");
    for (int d = 0; d < s->rank && o < cap; d++) {
        if (d) o += snprintf(buf + o, (size_t)(cap - o), ", ");
        if (s->n_axes[d] == 0) o += snprintf(buf + o, (size_t)(cap - o), "None");
        else if (s->n_axes[d] == 1) o += snprintf(buf + o, (size_t)(cap - o), "'%s'", mesh->names[s->axes[d][0]]);
        else {
            o += snprintf(buf + o, (size_t)(cap - o), "(");
            for (int k = 0; k < s->n_axes[d] && o < cap; k++)
                o += snprintf(buf + o, (size_t)(cap - o), "%s'%s'", k ? ", " : "", mesh->names[s->axes[d][k]]);
            if (o < cap) o += snprintf(buf + o, (size_t)(cap - o), ")");
        }
    }
    if (o < cap) o += snprintf(buf + o, (size_t)(cap - o), s->rank == 1 ? ",)" : ")");
}

static void shape_text(const char *dtype, int rank, const int64_t *shape, char *buf, int cap)
{
    int o = snprintf(buf, (size_t)cap, "%s[", dtype);
    for (int d = 0; d < rank && o < cap; d++)
        o += snprintf(buf + o, (size_t)(cap - o), "%s%lld", d ? "," : "", (long long)shape[d]);
    if (o < cap) snprintf(buf + o, (size_t)(cap - o), "]");
}

sim_status model_check_sharding_tolerance(const model_def *m, double tolerance)
{
    int stage = mesh_shape_axis_index(&m->mesh, "stage");
    if (stage >= 0 && m->mesh.sizes[stage] > 1) return SIM_OK; /* MaxText: not with pipeline parallelism */
    double share = model_unsharded_share(m);
    if (share < 0 || share <= tolerance) return SIM_OK;
    uint32_t t = target_mask(&m->mesh);
    int order[MODEL_MAX_PARAMS], n = 0;
    for (int i = 0; i < m->nparams; i++)
        if ((mesh_spec_dim_axes(&m->unpruned[i]) & t) != t) order[n++] = i;
    for (int i = 1; i < n; i++) /* largest first (stable) */
        for (int j = i; j > 0 && elems(&m->defs[order[j]]) > elems(&m->defs[order[j - 1]]); j--) {
            int x = order[j];
            order[j] = order[j - 1];
            order[j - 1] = x;
        }
    size_t cap = 8192, o = 0;
    char *msg = malloc(cap);
    SIM_ASSERT(msg);
    o += (size_t)snprintf(msg + o, cap - o,
                          "Unsharded parameter percentage (%.2f%%)exceeds tolerance (%.2f%%).\n"
                          "The following large tensors are replicated (unsharded) but could be sharded on at least one "
                          "of the available axes:",
                          100 * share, 100 * tolerance);
    char avail[256];
    axes_list(&m->mesh, t, avail, sizeof avail);
    for (int k = 0; k < n && k < 5 && o < cap; k++) {
        int i = order[k];
        char shape[128], spec[256], miss[256];
        shape_text("float32", m->defs[i].rank, m->defs[i].shape, shape, sizeof shape);
        spec_tuple(&m->unpruned[i], &m->mesh, spec, sizeof spec);
        axes_list(&m->mesh, t & ~mesh_spec_dim_axes(&m->unpruned[i]), miss, sizeof miss);
        o += (size_t)snprintf(msg + o, cap - o,
                              "\n - Name: %s(Size: %lld, Shape: %s, Spec: P%s)  is unsharded on axis: %s "
                              "could be sharded on: %s",
                              m->defs[i].path, (long long)elems(&m->defs[i]), shape, spec, miss, avail);
    }
    char axes[256] = "";
    size_t ao = 0;
    for (int a = 0; a < m->mesh.n_axes && ao < sizeof axes; a++)
        if (t >> a & 1)
            ao += (size_t)snprintf(axes + ao, sizeof axes - ao, "%s%s=%d", ao ? " " : "", m->mesh.names[a],
                                   m->mesh.sizes[a]);
    if (o < cap)
        snprintf(msg + o, cap - o,
                 "\n(sharding_tolerance=%g on the mesh axes %s, MaxText's check of the state's parameters: raise "
                 "sharding_tolerance, or shard these parameters on the listed axes with the mesh or the "
                 "logical_axis_rules)",
                 tolerance, axes);
    sim_status st = sim_err(SIM_ERR_CHECK, "%s", msg);
    free(msg);
    return st;
}

void model_print_shardings(const model_def *m, const char *dtype, FILE *f)
{
    for (int a = 0; a < m->mesh.n_axes; a++)
        if (m->mesh.sizes[a] > 1) fprintf(f, "%s: %d\n", m->mesh.names[a], m->mesh.sizes[a]);
    char shape[160], spec[320];
    for (int i = 0; i < m->nparams; i++)
        for (int k = 0; k < model_param_def_tensors(&m->defs[i]); k++) { /* scan_layers=false: per layer */
            model_param_def d;
            mesh_spec ps;
            model_param_def_tensor(&m->defs[i], &m->spec[i], k, &d, &ps);
            char path[MODEL_PATH_MAX];
            snprintf(path, sizeof path, "%s", d.path);
            for (char *c = path; *c; c++)
                if (*c == '.') *c = '/';
            shape_text("float32", d.rank, d.shape, shape, sizeof shape);
            spec_tuple(&ps, &m->mesh, spec, sizeof spec);
            fprintf(f, " %s\n    Shape:     %s\n    Physical:  %s\n", path, shape, spec);
        }
    fprintf(f, "\n");
    for (int i = 0; i < m->nacts; i++) {
        const model_act *act = &m->acts[i];
        shape_text(dtype, act->rank, act->shape, shape, sizeof shape);
        char logical[400];
        if (!act->logical_known) snprintf(logical, sizeof logical, "Unknown");
        else {
            int o = snprintf(logical, sizeof logical, "(");
            for (int d = 0; d < act->rank && o < (int)sizeof logical; d++) {
                if (act->logical[d][0])
                    o += snprintf(logical + o, sizeof logical - (size_t)o, "%s'%s'", d ? ", " : "", act->logical[d]);
                else o += snprintf(logical + o, sizeof logical - (size_t)o, "%sNone", d ? ", " : "");
            }
            if (o < (int)sizeof logical) snprintf(logical + o, sizeof logical - (size_t)o, act->rank == 1 ? ",)" : ")");
        }
        spec_tuple(&act->spec, &m->mesh, spec, sizeof spec);
        /* maybe_shard_with_name formats the type as {:.<60}: padded with dots to 60 columns */
        char padded[200];
        int len = snprintf(padded, sizeof padded, "%s", shape);
        while (len < 60) padded[len++] = '.';
        padded[len] = 0;
        fprintf(f, "%s Logical: %s %s.\n", act->name, padded, logical);
        fprintf(f, "%s Physical: %s %s.\n", act->name, padded, spec);
    }
}
