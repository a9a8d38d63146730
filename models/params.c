/* params.c — per-layer views of stacked parameters. */
#include "models/params.h"

#include <stdio.h>
#include <string.h>

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
    if (!at)
        snprintf(tmp, sizeof tmp, "%s_%d", d->path, k);
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
    view->m = p->m ? &p->m[k] : NULL;
    view->v = p->v ? &p->v[k] : NULL;
}
