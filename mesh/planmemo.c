/* planmemo.c — see planmemo.h.  A direct-mapped table of 64 slots per thread
 * (device threads make their own plans: no locks); a slot holds a packed key
 * (rank, shape, each spec's dims, axes and partial axes: the inputs the plan's
 * bytes depend on) and the figure.  A different mesh empties the table. */
#include "mesh/planmemo.h"

#include <string.h>


enum { PM_SLOTS = 64, PM_KEY = 104 }; /* a key that does not fit (a rank-8 shape on many axes) is not kept */

typedef struct {
    unsigned long gen;    /* valid while equal to pm_gen */
    uint64_t hash;
    int key_len;
    bool ok;              /* a plan exists */
    uint64_t bytes;
    unsigned char key[PM_KEY];
} pm_slot;

static _Thread_local unsigned long pm_gen;
static _Thread_local mesh_shape pm_mesh;
static _Thread_local bool pm_used;
static _Thread_local pm_slot pm_slots[PM_SLOTS];

/* Bytes the packed key of (rank, from, to) needs. */
static int key_need(int rank, const mesh_spec *from, const mesh_spec *to)
{
    int n = 1 + 8 * rank;
    const mesh_spec *s[2] = {from, to};
    for (int k = 0; k < 2; k++) {
        n += 1 + 4;
        for (int d = 0; d < s[k]->rank; d++) {
            if (s[k]->n_axes[d] > MESH_MAX_AXES) return PM_KEY + 1; /* not a valid spec: no memo */
            n += 1 + (s[k]->n_axes[d] > 0 ? s[k]->n_axes[d] : 0);
        }
    }
    return n;
}

static bool make(const mesh_shape *m, mesh_plan *scratch, const char *name, int rank, const int64_t *shape,
                 const mesh_spec *from, const mesh_spec *to, uint64_t *bytes)
{
    if (mesh_plan_make(m, name, rank, shape, SIM_F32, from, to, scratch) != SIM_OK) return false;
    *bytes = scratch->total_bytes;
    return true;
}

static int pack_spec(unsigned char *k, int n, const mesh_spec *s)
{
    k[n++] = (unsigned char)s->rank;
    for (int d = 0; d < s->rank; d++) {
        int na = s->n_axes[d] > 0 ? s->n_axes[d] : 0;
        k[n++] = (unsigned char)na;
        for (int i = 0; i < na; i++) k[n++] = (unsigned char)s->axes[d][i];
    }
    memcpy(k + n, &s->partial, 4);
    return n + 4;
}

bool mesh_plan_bytes_memo(const mesh_shape *m, mesh_plan *scratch, const char *name, int rank, const int64_t *shape,
                          const mesh_spec *from, const mesh_spec *to, uint64_t *bytes)
{
    if (mesh_spec_equal(from, to)) {
        *bytes = 0;
        return true;
    }
    if (rank < 0 || rank > MESH_SPEC_MAX_RANK || from->rank < 0 || from->rank > MESH_SPEC_MAX_RANK || to->rank < 0 ||
        to->rank > MESH_SPEC_MAX_RANK || key_need(rank, from, to) > PM_KEY)
        return make(m, scratch, name, rank, shape, from, to, bytes); /* its own error, as before */
    if (!pm_used || memcmp(&pm_mesh, m, sizeof *m)) {
        pm_gen++; /* empties every slot without touching them */
        pm_mesh = *m;
        pm_used = true;
    }
    unsigned char key[PM_KEY];
    int n = 0;
    key[n++] = (unsigned char)rank;
    memcpy(key + n, shape, (size_t)rank * sizeof *shape);
    n += rank * (int)sizeof *shape;
    n = pack_spec(key, n, from);
    n = pack_spec(key, n, to);
    uint64_t h = 0xcbf29ce484222325ull; /* FNV-1a 64 */
    for (int i = 0; i < n; i++) h = (h ^ key[i]) * 0x100000001b3ull;
    pm_slot *s = &pm_slots[h % PM_SLOTS];
    if (s->gen == pm_gen && s->hash == h && s->key_len == n && !memcmp(s->key, key, (size_t)n)) {
        *bytes = s->bytes;
        return s->ok;
    }
    bool ok = make(m, scratch, name, rank, shape, from, to, bytes); /* a failure leaves its error, as before */
    s->gen = pm_gen;
    s->hash = h;
    s->key_len = n;
    memcpy(s->key, key, (size_t)n);
    s->ok = ok;
    s->bytes = ok ? *bytes : 0;
    return ok;
}
