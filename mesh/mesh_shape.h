/* mesh_shape.h — the device mesh: named axes, their sizes, device <-> coordinates.
 *
 * Built from MaxText flags (mesh_axes order; ici_<axis>_parallelism and
 * dcn_<axis>_parallelism, the 'stage' axis using *_pipeline_parallelism; at
 * most one -1 per level fills the remainder; num_slices; num_devices).  Axis
 * size = dcn x ici with the dcn (slice) factor outermost: coordinate c on an
 * axis is slice part c / ici and in-slice part c % ici.  Device id = row-major
 * index of the coordinates, first axis most significant (JAX/MaxText order). */
#ifndef MESH_MESH_SHAPE_H
#define MESH_MESH_SHAPE_H

#include "config/config.h"
#include "sim/status.h"

enum {
    MESH_MAX_AXES = 16,     /* axes of one mesh (MaxText uses 12; legacy 13) */
    MESH_AXIS_NAME_MAX = 48 /* bytes of an axis name, with the NUL */
};

typedef struct {
    int n_axes;                                    /* number of mesh axes */
    char names[MESH_MAX_AXES][MESH_AXIS_NAME_MAX]; /* axis names, in mesh_axes order */
    int sizes[MESH_MAX_AXES];                      /* devices along each axis (dcn * ici) */
    int dcn[MESH_MAX_AXES];                        /* slice factor of each axis (outer part) */
    int ici[MESH_MAX_AXES];                        /* in-slice factor of each axis (inner part) */
    int num_devices;                               /* product of sizes */
    int num_slices;                                /* product of dcn */
} mesh_shape;

/* Builds from explicit per-axis ici/dcn lists (entries may be -1: fills the
 * remainder, at most one per level).  num_devices <= 0 means "the product of
 * the given sizes" (a -1 then counts as 1); num_slices <= 0 means 1.
 * ici_flags/dcn_flags name the flags in error messages (may be NULL). */
sim_status mesh_shape_build(mesh_shape *m, int n_axes, const char *const *names, const int *ici, const int *dcn,
                            int num_devices, int num_slices, const char *const *ici_flags,
                            const char *const *dcn_flags);
/* Single-slice mesh with the given sizes (for tests and tools). */
sim_status mesh_shape_init(mesh_shape *m, int n_axes, const char *const *names, const int *sizes);
/* Reads mesh_axes, ici_*, dcn_*, num_slices and num_devices from a config.
 * num_devices = -1 in the config means the product of the flags (-1 flags
 * count as 1 then). */
sim_status mesh_shape_from_config(const cfg_config *cfg, mesh_shape *m);

/* Index of the axis named `name`, or -1. */
int mesh_shape_axis_index(const mesh_shape *m, const char *name);
/* coords[n_axes] of device id (row-major, first axis most significant). */
void mesh_shape_coords(const mesh_shape *m, int device, int *coords);
/* Device id of coords[n_axes]. */
int mesh_shape_device(const mesh_shape *m, const int *coords);
/* Slice index of a device (mixed radix of the dcn parts of its coordinates). */
int mesh_shape_slice(const mesh_shape *m, int device);
/* "data=1 fsdp=4 expert=2" into buf; returns buf. */
const char *mesh_shape_format(const mesh_shape *m, char *buf, int cap);
/* The flag stem of an axis: "pipeline" for "stage", else the name itself. */
const char *mesh_shape_flag_stem(const char *axis);
int mesh_shape_equal(const mesh_shape *a, const mesh_shape *b);

#endif
