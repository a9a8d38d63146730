/* planmemo.h — the bytes of a resharding plan, remembered per thread.  The
 * einsum placement search prices every candidate placement by the plans it
 * needs (mesh_plan_make) and finds the same few hundred (shape, from, to)
 * triples on every layer, pass and device: a 256-device dry run of a deep
 * model makes millions of plans to read their total_bytes.  The memo keeps
 * the figure (or that no plan exists) by mesh, shape and both specs. */
#ifndef MESH_PLANMEMO_H
#define MESH_PLANMEMO_H

#include <stdbool.h>
#include <stdint.h>

#include "mesh/reshard.h"

/* total_bytes of mesh_plan_make(m, name, rank, shape, SIM_F32, from, to) in *bytes, or 0 when
 * from equals to; false when no plan exists (no error is left set: the caller moves on to the
 * next candidate).  `scratch` holds the plan when one is made. */
bool mesh_plan_bytes_memo(const mesh_shape *m, mesh_plan *scratch, const char *name, int rank, const int64_t *shape,
                          const mesh_spec *from, const mesh_spec *to, uint64_t *bytes);

#endif
