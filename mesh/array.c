/* array.c — allocation, host import/export and block copies of distributed arrays. */
#include "mesh/array.h"

#include <stdio.h>
#include <string.h>

#include "blas_kernels/bk_parallel.h"
#include "sim/arena.h"

sim_status mesh_shape_to_sim(const mesh_shape *m, sim_mesh_desc *out)
{
    const char *names[MESH_MAX_AXES];
    for (int i = 0; i < m->n_axes; i++) names[i] = m->names[i];
    SIM_TRY(sim_mesh_desc_make(m->n_axes, names, m->sizes, out));
    for (int i = 0; i < m->n_axes; i++) out->dcn[i] = m->dcn[i]; /* which devices share a slice */
    return SIM_OK;
}

sim_status mesh_spec_fit_rank(const mesh_spec *s, int rank, const char *name, mesh_spec *out)
{
    if (s->rank > rank)
        return sim_err(SIM_ERR_INPUT, "'%s' has %d dims but its PartitionSpec has %d entries; give at most one per dim",
                       name, rank, s->rank);
    *out = *s;
    for (int d = s->rank; d < rank; d++) out->n_axes[d] = 0;
    out->rank = rank;
    return SIM_OK;
}

/* counted: the dtype the arena counts it in, -1 as the device counts cat (sim_device_counted_dtype),
 * -2 the same but only charged (mesh_array_borrow: no storage). */
static sim_status array_new(sim_device *d, const mesh_shape *m, const char *name, int rank, const int64_t *shape,
                            const mesh_spec *spec, sim_dtype dt, int counted, sim_mem_cat cat, bool zero,
                            mesh_array *out)
{
    bool charge = counted == -2;
    if (charge) counted = -1;
    memset(out, 0, sizeof *out);
    if (rank < 0 || rank > MESH_SPEC_MAX_RANK)
        return sim_err(SIM_ERR_INPUT, "array '%s': rank %d is outside 0..%d", name, rank, MESH_SPEC_MAX_RANK);
    mesh_spec fit;
    SIM_TRY(mesh_spec_fit_rank(spec, rank, name, &fit));
    spec = &fit;
    SIM_TRY(mesh_spec_check(spec, m));
    SIM_TRY(mesh_spec_check_shape(spec, m, rank, shape, name));
    sim_str_put(out->name, sizeof out->name, 0, name, SIZE_MAX);
    out->rank = rank;
    if (rank) memcpy(out->shape, shape, (size_t)rank * sizeof *shape); /* a scalar may come with shape == NULL */
    out->spec = *spec;
    out->dtype = dt;
    out->counted = counted >= 0 ? (sim_dtype)counted : sim_device_counted_dtype(d, dt, cat);
    out->counted_fixed = counted >= 0;
    out->cat = cat;
    mesh_spec_local_shape(spec, m, shape, out->local);
    out->nlocal = 1;
    for (int i = 0; i < rank; i++) out->nlocal *= (size_t)out->local[i];
    static _Thread_local uint64_t next_uid; /* arrays are made on their device's thread */
    out->uid = ++next_uid;
    size_t counted_bytes = out->nlocal * sim_dtype_size(out->counted);
    sim_status st = charge ? sim_arena_charge(sim_device_arena(d), counted_bytes, cat, name)
                           : sim_arena_alloc_counted(sim_device_arena(d), out->nlocal * sim_dtype_size(dt),
                                                     counted_bytes, cat, name, zero, &out->data);
    /* a failed allocation (a simulated OOM) holds nothing: freeing it later
     * must not release bytes that were never accounted (dry runs have no
     * pointer to tell) */
    if (st != SIM_OK) out->nlocal = 0;
    return st;
}

sim_status mesh_array_new(sim_device *d, const mesh_shape *m, const char *name, int rank, const int64_t *shape,
                          const mesh_spec *spec, sim_dtype dt, sim_mem_cat cat, mesh_array *out)
{
    return array_new(d, m, name, rank, shape, spec, dt, -1, cat, true, out);
}

sim_status mesh_array_new_as(sim_device *d, const mesh_shape *m, const char *name, int rank, const int64_t *shape,
                             const mesh_spec *spec, sim_dtype dt, sim_dtype counted, sim_mem_cat cat, bool zero,
                             mesh_array *out)
{
    return array_new(d, m, name, rank, shape, spec, dt, (int)counted, cat, zero, out);
}

sim_status mesh_array_new_raw(sim_device *d, const mesh_shape *m, const char *name, int rank, const int64_t *shape,
                              const mesh_spec *spec, sim_dtype dt, sim_mem_cat cat, mesh_array *out)
{
    return array_new(d, m, name, rank, shape, spec, dt, -1, cat, false, out);
}

sim_status mesh_array_new_ghost(sim_device *d, const mesh_shape *m, const char *name, int rank, const int64_t *shape,
                                const mesh_spec *spec, sim_dtype dt, sim_mem_cat cat, mesh_array *out)
{
    sim_status st = array_new(d, m, name, rank, shape, spec, dt, -2, cat, false, out);
    if (st == SIM_OK) out->hold = MESH_HOLD_GHOST;
    return st;
}

sim_status mesh_array_clone(sim_device *d, const mesh_shape *m, const mesh_array *src, const char *name,
                            sim_mem_cat cat, mesh_array *out)
{
    SIM_TRY(mesh_array_new_raw(d, m, name, src->rank, src->shape, &src->spec, src->dtype, cat, out));
    /* on the kernel pool: a clone is often a big cotangent (the residual adds' backward) */
    if (out->data && src->data) bk_parallel_copy(out->data, src->data, src->nlocal * sim_dtype_size(src->dtype));
    if (src->counted_fixed) mesh_array_recount(d, out, src->counted);
    return SIM_OK;
}

sim_status mesh_array_borrow(sim_device *d, const mesh_shape *m, const mesh_array *src, const char *name,
                             sim_mem_cat cat, mesh_array *out)
{
    /* the header mesh_array_new_raw would make (checks, counted dtype, uid), charged instead of allocated */
    sim_status st = array_new(d, m, name, src->rank, src->shape, &src->spec, src->dtype, -2, cat, false, out);
    if (st != SIM_OK) return st;
    out->data = src->data;
    out->hold = MESH_HOLD_BORROWED;
    if (src->counted_fixed) mesh_array_recount(d, out, src->counted);
    return SIM_OK;
}

void mesh_array_free(sim_device *d, mesh_array *a)
{
    sim_arena *arena = sim_device_arena(d);
    size_t counted = a->nlocal * sim_dtype_size(a->counted);
    if (a->hold != MESH_HOLD_OWN) { /* counted only; a shared buffer's last reference frees it */
        if (a->data || a->hold == MESH_HOLD_GHOST || sim_device_dry(d)) sim_arena_discharge(arena, counted, a->cat);
        if (a->hold == MESH_HOLD_SHARED) sim_shared_release(d, a->data);
    } else if (a->data || sim_device_dry(d)) {
        sim_arena_release_counted(arena, a->data, a->nlocal * sim_dtype_size(a->dtype), counted, a->cat);
    }
    a->data = NULL;
    a->nlocal = 0;
    a->hold = MESH_HOLD_OWN;
}

void mesh_array_recount(sim_device *d, mesh_array *a, sim_dtype dt)
{
    if (a->data || a->hold == MESH_HOLD_GHOST || sim_device_dry(d))
        sim_arena_recount(sim_device_arena(d), a->nlocal * sim_dtype_size(a->counted), a->nlocal * sim_dtype_size(dt),
                          a->cat);
    a->counted = dt;
    a->counted_fixed = true;
}

/* SIM_F32 (the zero value) in the options means no cast: the dtype as counted. */
static sim_dtype narrower(sim_dtype cast, sim_dtype counted)
{
    return cast != SIM_F32 && sim_dtype_size(cast) < sim_dtype_size(counted) ? cast : counted;
}

sim_dtype mesh_array_gather_dtype(const sim_device *d, const mesh_array *w)
{
    if (w->counted_fixed || w->dtype != SIM_F32) return w->counted;
    return narrower(sim_machine_options(sim_device_machine((sim_device *)d))->counted_gather, w->counted);
}

sim_dtype mesh_array_reduce_dtype(const sim_device *d, sim_dtype counted)
{
    return narrower(sim_machine_options(sim_device_machine((sim_device *)d))->counted_grad_reduce, counted);
}

sim_meta mesh_array_meta(const mesh_array *a, sim_meta meta)
{
    bool state = a->cat == SIM_MEM_PARAMS || a->cat == SIM_MEM_GRADS || a->cat == SIM_MEM_OPTIMIZER;
    return (a->counted_fixed || state) && !meta.counted_set ? sim_meta_counted(meta, a->counted) : meta;
}

void mesh_copy_block(void *dst, const void *src, int rank, const int64_t *in, const int64_t *out, const int64_t *start,
                     size_t es)
{
    if (rank == 0) {
        memcpy(dst, src, es);
        return;
    }
    /* innermost dim contiguous; walk the others with an index vector */
    int64_t idx[MESH_SPEC_MAX_RANK] = {0};
    int64_t in_stride[MESH_SPEC_MAX_RANK];
    in_stride[rank - 1] = 1;
    for (int i = rank - 2; i >= 0; i--) in_stride[i] = in_stride[i + 1] * in[i + 1];
    int64_t rows = 1;
    for (int i = 0; i < rank - 1; i++) rows *= out[i];
    size_t row_bytes = (size_t)out[rank - 1] * es;
    char *o = dst;
    if (row_bytes == 0) return;
    for (int64_t r = 0; r < rows; r++) {
        int64_t off = start[rank - 1];
        for (int i = 0; i < rank - 1; i++) off += (start[i] + idx[i]) * in_stride[i];
        memcpy(o, (const char *)src + (size_t)off * es, row_bytes);
        o += row_bytes;
        for (int i = rank - 2; i >= 0; i--) {
            if (++idx[i] < out[i]) break;
            idx[i] = 0;
        }
    }
}

/* Coordinates of device on all axes; true when its coordinate is 0 on every axis in mask. */
static bool zero_on(const mesh_shape *m, int device, uint32_t mask)
{
    int c[MESH_MAX_AXES];
    mesh_shape_coords(m, device, c);
    for (int a = 0; a < m->n_axes; a++)
        if ((mask & (1u << a)) && c[a] != 0) return false;
    return true;
}

void mesh_array_load_global(sim_device *d, const mesh_shape *m, mesh_array *a, const void *global)
{
    mesh_array_owned(a);
    if (!a->data) return;
    size_t es = sim_dtype_size(a->dtype);
    int dev = sim_device_id(d);
    if (a->spec.partial && !zero_on(m, dev, a->spec.partial)) {
        memset(a->data, 0, a->nlocal * es);
        return;
    }
    mesh_dim_shard sh[MESH_SPEC_MAX_RANK];
    mesh_spec_shard(&a->spec, m, a->shape, dev, sh);
    int64_t start[MESH_SPEC_MAX_RANK];
    for (int i = 0; i < a->rank; i++) start[i] = sh[i].offset;
    mesh_copy_block(a->data, global, a->rank, a->shape, a->local, start, es);
}

sim_status mesh_array_store_global(sim_device *d, const mesh_shape *m, const mesh_array *a, void *global)
{
    return mesh_array_store_global_except(d, m, a, global, 0);
}

sim_status mesh_array_store_global_except(sim_device *d, const mesh_shape *m, const mesh_array *a, void *global,
                                          uint32_t held_apart)
{
    if (a->spec.partial)
        return sim_err(SIM_ERR_INTERNAL, "array '%s' still holds partial sums; reshard it before storing", a->name);
    if (!a->data) return SIM_OK;
    int dev = sim_device_id(d);
    uint32_t unused = ((1u << m->n_axes) - 1) & ~mesh_spec_dim_axes(&a->spec) & ~held_apart;
    if (!zero_on(m, dev, unused)) return SIM_OK;
    size_t es = sim_dtype_size(a->dtype);
    mesh_dim_shard sh[MESH_SPEC_MAX_RANK];
    mesh_spec_shard(&a->spec, m, a->shape, dev, sh);
    /* scatter rows of the shard into the global buffer */
    int rank = a->rank;
    if (rank == 0) {
        memcpy(global, a->data, es);
        return SIM_OK;
    }
    int64_t idx[MESH_SPEC_MAX_RANK] = {0}, stride[MESH_SPEC_MAX_RANK];
    stride[rank - 1] = 1;
    for (int i = rank - 2; i >= 0; i--) stride[i] = stride[i + 1] * a->shape[i + 1];
    int64_t rows = 1;
    for (int i = 0; i < rank - 1; i++) rows *= a->local[i];
    size_t row_bytes = (size_t)a->local[rank - 1] * es;
    const char *src = a->data;
    for (int64_t r = 0; r < rows && row_bytes; r++) {
        int64_t off = sh[rank - 1].offset;
        for (int i = 0; i < rank - 1; i++) off += (sh[i].offset + idx[i]) * stride[i];
        memcpy((char *)global + (size_t)off * es, src, row_bytes);
        src += row_bytes;
        for (int i = rank - 2; i >= 0; i--) {
            if (++idx[i] < a->local[i]) break;
            idx[i] = 0;
        }
    }
    return SIM_OK;
}
