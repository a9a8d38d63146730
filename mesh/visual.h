/* visual.h — a picture of how a 1-D or 2-D array is laid out over the
 * devices, like jax.debug.visualize_array_sharding: one cell per block, each
 * naming the devices that hold it (a range "0-3" where they are consecutive).
 * Partial axes are noted under the grid. */
#ifndef MESH_VISUAL_H
#define MESH_VISUAL_H

#include <stdio.h>

#include "mesh/spec.h"

/* Writes the grid; arrays of rank 0 or > 2 get a one-line summary instead. */
void mesh_visualize(FILE *f, const mesh_shape *m, const mesh_spec *s, int rank, const int64_t *shape);

#endif
