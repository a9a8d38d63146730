/* params.c — per-layer views of stacked parameters. */
#include "models/core/params.h"

#include <stdio.h>
#include <stdbool.h>
#include <string.h>

#include "mesh/mesh_shape.h"
#include "sim/machine.h"

void model_param_layer_shape(const model_param *p, int *rank, int64_t *shape)
{
    int r = 0;
    for (int d = 0; d < p->def.rank; d++)
        if (d != p->def.scan_dim) shape[r++] = p->def.shape[d];
    *rank = r;
}

void model_param_layer_spec(const model_param *p, mesh_spec *spec)
{
    mesh_spec_init(spec, 0);
    int r = 0;
    for (int d = 0; d < p->spec.rank; d++) {
        if (d == p->def.scan_dim) continue;
        spec->n_axes[r] = p->spec.n_axes[d];
        memcpy(spec->axes[r], p->spec.axes[d], sizeof spec->axes[r]);
        r++;
    }
    spec->rank = r;
    spec->partial = p->spec.partial;
}

int model_param_def_tensors(const model_param_def *d)
{
    return d->unscanned && d->scan_dim >= 0 ? (int)d->shape[d->scan_dim] : 1;
}

/* "<prefix>.S.<rest>" -> "<prefix>.S_k.<rest>", S the stack's logical name (= its path component). */
static void layer_path(const model_param_def *d, int k, char *buf, size_t cap)
{
    const char *stack = d->logical[d->scan_dim];
    char key[64];
    snprintf(key, sizeof key, ".%s.", stack ? stack : "layers");
    const char *at = strstr(d->path, key);
    char tmp[2 * MODEL_PATH_MAX];
    if (!at) snprintf(tmp, sizeof tmp, "%s_%d", d->path, k);
    else
        snprintf(tmp, sizeof tmp, "%.*s.%s_%d.%s", (int)(at - d->path), d->path, stack ? stack : "layers", k,
                 at + strlen(key));
    size_t n = strlen(tmp);
    if (n >= cap) n = cap - 1;
    memcpy(buf, tmp, n);
    buf[n] = 0;
}

void model_param_def_tensor(const model_param_def *d, const mesh_spec *spec, int k, model_param_def *out,
                            mesh_spec *out_spec)
{
    *out = *d;
    if (spec && out_spec) *out_spec = *spec;
    if (model_param_def_tensors(d) == 1) return;
    layer_path(d, k, out->path, sizeof out->path);
    int r = 0;
    for (int i = 0; i < d->rank; i++) {
        if (i == d->scan_dim) continue;
        out->shape[r] = d->shape[i];
        out->logical[r] = d->logical[i];
        if (spec && out_spec) {
            out_spec->n_axes[r] = spec->n_axes[i];
            memcpy(out_spec->axes[r], spec->axes[i], sizeof out_spec->axes[r]);
        }
        r++;
    }
    out->rank = r;
    out->scan_dim = -1;
    out->unscanned = false;
    if (spec && out_spec) out_spec->rank = r;
}

void model_param_tensor_view(const model_param *p, int k, model_param *view)
{
    *view = *p;
    if (model_param_def_tensors(&p->def) == 1) return;
    model_param_def_tensor(&p->def, &p->spec, k, &view->def, &view->spec);
    mesh_spec un;
    model_param_def tmp;
    model_param_def_tensor(&p->def, &p->spec_unpruned, k, &tmp, &un);
    view->spec_unpruned = un;
    view->n_layers = 1;
    view->w = p->w ? &p->w[k] : NULL;
    view->g = p->g ? &p->g[k] : NULL;
    for (int j = 0; j < MODEL_OPT_SLOTS_MAX; j++) view->slot[j] = p->slot[j] ? &p->slot[j][k] : NULL;
}

void model_zero1_spec(const mesh_shape *m, int rank, const int64_t *shape, const mesh_spec *unpruned, mesh_spec *out)
{
    *out = *unpruned;
    int data = mesh_shape_axis_index(m, "data"), tensor = mesh_shape_axis_index(m, "tensor");
    if (data < 0 || (mesh_spec_dim_axes(unpruned) & (1u << data))) return;
    for (int d = 0; d < rank; d++) {
        int64_t shard = shape[d];
        bool has_tensor = false;
        for (int i = 0; i < unpruned->n_axes[d]; i++) {
            shard /= m->sizes[unpruned->axes[d][i]];
            /* MaxText 0.2.5's NNX state carries specs without size-1 axes: a 'tensor' of size 1 is not there */
            has_tensor |= unpruned->axes[d][i] == tensor && m->sizes[tensor] > 1;
        }
        if (has_tensor || shard % m->sizes[data]) continue;
        /* ('data', *old): data becomes the most significant part of the block index */
        memmove(&out->axes[d][1], &out->axes[d][0], (size_t)out->n_axes[d] * sizeof out->axes[d][0]);
        out->axes[d][0] = (int8_t)data;
        out->n_axes[d]++;
        return;
    }
}

void model_param_stacked_spec(const model_param *p, const mesh_spec *layer, mesh_spec *out)
{
    int sd = p->def.scan_dim;
    if (sd < 0) {
        *out = *layer;
        return;
    }
    mesh_spec_init(out, layer->rank + 1);
    for (int d = 0, r = 0; d < out->rank; d++) {
        if (d == sd) continue;
        out->n_axes[d] = layer->n_axes[r];
        memcpy(out->axes[d], layer->axes[r], sizeof out->axes[d]);
        r++;
    }
    if (p->stage_span > 0 && sd < p->spec.rank) { /* pipelined: each stage stores its own block */
        out->n_axes[sd] = p->spec.n_axes[sd];
        memcpy(out->axes[sd], p->spec.axes[sd], sizeof out->axes[sd]);
    }
    out->partial = layer->partial;
}

/* Stages of a pipelined parameter (the product of its scan dim's axes), 1 otherwise. */
static int64_t stack_stages(const mesh_shape *m, const model_param *p)
{
    int sd = p->def.scan_dim;
    if (p->stage_span <= 0 || sd < 0 || sd >= p->spec.rank) return 1;
    int64_t s = 1;
    for (int i = 0; i < p->spec.n_axes[sd]; i++) s *= m->sizes[p->spec.axes[sd][i]];
    return s;
}

int64_t model_param_stack_layer(const mesh_shape *m, const model_param *p, int64_t q)
{
    int64_t S = stack_stages(m, p);
    if (S == 1) return q;
    int64_t L = p->stage_span, RL = p->n_layers / S;
    int64_t s = q / RL, r = (q % RL) / L, j = q % L;
    return (r * S + s) * L + j;
}

bool model_param_holds_layer(const mesh_shape *m, const model_param *p, int device, int64_t l)
{
    int64_t S = stack_stages(m, p);
    if (S == 1) return true;
    int c[MESH_MAX_AXES];
    mesh_shape_coords(m, device, c);
    int sd = p->def.scan_dim;
    int64_t block = 0;
    for (int i = 0; i < p->spec.n_axes[sd]; i++) {
        int ax = p->spec.axes[sd][i];
        block = block * m->sizes[ax] + c[ax];
    }
    return (l / p->stage_span) % S == block;
}

/* Local geometry of a stacked array over per-layer shards: stacked[o][l][i]
 * is element o * inner + i of layer l's shard (o < outer, i < inner). */
static void stack_geometry(const model_param *p, const mesh_array *layer0, int64_t *outer, int64_t *inner)
{
    int sd = p->def.scan_dim < 0 ? 0 : p->def.scan_dim;
    *outer = 1;
    *inner = 1;
    for (int d = 0; d < layer0->rank; d++) *(d < sd ? outer : inner) *= layer0->local[d];
}

/* layers[l] for the n layers held (in increasing order: a pipelined stage's
 * local block in stage-major order, model_param_stack_layer) */
static void stack_copy(float *stacked, float *const *layers, int L, int64_t outer, int64_t inner, bool to_stacked)
{
    for (int64_t o = 0; o < outer; o++)
        for (int l = 0; l < L; l++) {
            float *s = stacked + (o * L + l) * inner, *x = layers[l] + o * inner;
            memcpy(to_stacked ? s : x, to_stacked ? x : s, (size_t)inner * sizeof(float));
        }
}

sim_status model_param_stack(sim_device *d, const mesh_shape *m, const model_param *p, const mesh_array *layers,
                             const char *name, sim_mem_cat cat, mesh_array *out)
{
    mesh_spec s;
    model_param_stacked_spec(p, &layers[0].spec, &s);
    if (layers[0].counted_fixed) /* the layers' dtype where it was fixed (ZeRO-1 with accumulation) */
        SIM_TRY(
            mesh_array_new_as(d, m, name, p->def.rank, p->def.shape, &s, SIM_F32, layers[0].counted, cat, false, out));
    else SIM_TRY(mesh_array_new_raw(d, m, name, p->def.rank, p->def.shape, &s, SIM_F32, cat, out));
    if (!out->data) return SIM_OK; /* dry run */
    float *src[MODEL_MAX_LAYERS];
    int n = 0, first = -1;
    for (int l = 0; l < p->n_layers; l++)
        if (model_param_holds_layer(m, p, sim_device_id(d), l)) {
            if (first < 0) first = l;
            src[n++] = layers[l].data;
        }
    if (!n) return SIM_OK;
    int64_t outer, inner;
    stack_geometry(p, &layers[first], &outer, &inner);
    stack_copy(out->data, src, n, outer, inner, true);
    return SIM_OK;
}

void model_param_unstack(sim_device *d, const mesh_shape *m, const model_param *p, const mesh_array *stacked,
                         mesh_array *layers)
{
    if (!stacked->data) return;
    float *dst[MODEL_MAX_LAYERS];
    int n = 0, first = -1;
    for (int l = 0; l < p->n_layers; l++)
        if (model_param_holds_layer(m, p, sim_device_id(d), l)) {
            if (first < 0) first = l;
            dst[n++] = layers[l].data;
        }
    if (!n) return;
    int64_t outer, inner;
    stack_geometry(p, &layers[first], &outer, &inner);
    stack_copy(stacked->data, dst, n, outer, inner, false);
}
