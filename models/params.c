/* params.c — per-layer views of stacked parameters. */
#include "models/params.h"

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
