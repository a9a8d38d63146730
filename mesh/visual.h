/* visual.h — a picture of how an array of any rank is laid out over the
 * devices, like jax.debug.visualize_array_sharding: one cell per block, each
 * naming the devices that hold it (a range "0-3" where they are consecutive).
 * Partial axes are noted under the grid. */
#ifndef MESH_VISUAL_H
#define MESH_VISUAL_H

#include <stdio.h>

#include "mesh/spec.h"

/* Writes the grid, to scale, over the array's two dims (rank >= 3: its sharded
 * dims), or with more than two sharded dims the list of blocks. */
void mesh_visualize(FILE *f, const mesh_shape *m, const mesh_spec *s, int rank, const int64_t *shape);

#endif
