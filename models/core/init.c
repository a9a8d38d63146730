/* init.c — counter-based parameter init (see init.h for the generator).
 *
 * A shard is filled row by row: the innermost dim of a shard is contiguous
 * in the global tensor too, so each row is one run of global indices handed
 * to model_init_range.  Everything runs in double and is rounded to float
 * once, so a value never depends on which run computed it. */
#include "models/core/init.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#define GOLDEN 0x9E3779B97F4A7C15ull
#define INV_2_53 (1.0 / 9007199254740992.0)

static inline uint64_t mix64(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

uint64_t model_init_key(uint64_t seed, const char *name)
{
    uint64_t h = 0xcbf29ce484222325ull; /* FNV-1a 64 */
    for (const unsigned char *p = (const unsigned char *)name; *p; p++) h = (h ^ *p) * 0x100000001b3ull;
    return mix64(mix64(seed + GOLDEN) ^ h);
}

const char *model_init_layer_name(const char *path, int layer, char *buf, size_t cap)
{
    /* "%s" or "%s/layer_%d" without printf: this names every layer of every parameter on every device */
    size_t n = sim_str_put(buf, cap, 0, path, SIZE_MAX);
    if (layer >= 0) {
        char digits[16];
        int k = (int)sizeof digits - 1;
        digits[k] = '\0';
        unsigned v = (unsigned)layer;
        do digits[--k] = (char)('0' + v % 10);
        while ((v /= 10) && k > 0);
        sim_str_put(buf, cap, sim_str_put(buf, cap, n, "/layer_", 7), digits + k, SIZE_MAX);
    }
    return buf;
}

/* ---------------------------------------------------------------- the words of one element */

/* Element i owns words MODEL_INIT_WORDS*i .. +MODEL_INIT_WORDS-1 of its tensor's stream. */
typedef struct {
    uint64_t key;
    uint64_t next; /* next word number */
    uint64_t end;  /* first word number of the next element */
} elem_stream;

static inline elem_stream elem_open(uint64_t key, uint64_t i)
{
    elem_stream s = {key, i * MODEL_INIT_WORDS, (i + 1) * MODEL_INIT_WORDS};
    return s;
}

/* splitmix64's output number n from state key */
static inline uint64_t elem_word(elem_stream *s) { return mix64(s->key + (++s->next) * GOLDEN); }
static inline int elem_spent(const elem_stream *s) { return s->next >= s->end; }
/* uniform in (0, 1]: never 0, so log() is safe */
static inline double elem_uniform(elem_stream *s) { return (double)(int64_t)((elem_word(s) >> 11) + 1) * INV_2_53; }

/* ---------------------------------------------------------------- ziggurat
 * 128 blocks of equal area under the half normal density (Doornik's ZIGNOR):
 * x[0] = V / f(R) (the base strip with the tail), x[1] = R, x[i+1] from
 * x[i] so that every strip has area V, x[128] = 0; ratio[i] = x[i+1]/x[i] is
 * the part of strip i that lies wholly under the curve. */
#define ZIG_C 128
#define ZIG_R 3.442619855899
#define ZIG_V 9.91256303526217e-3

static double zig_x[ZIG_C + 1], zig_ratio[ZIG_C];
static pthread_once_t zig_once = PTHREAD_ONCE_INIT;

static void zig_init(void)
{
    double f = exp(-0.5 * ZIG_R * ZIG_R);
    zig_x[0] = ZIG_V / f;
    zig_x[1] = ZIG_R;
    zig_x[ZIG_C] = 0.0;
    for (int i = 2; i < ZIG_C; i++) {
        zig_x[i] = sqrt(-2.0 * log(ZIG_V / zig_x[i - 1] + f));
        f = exp(-0.5 * zig_x[i] * zig_x[i]);
    }
    for (int i = 0; i < ZIG_C; i++) zig_ratio[i] = zig_x[i + 1] / zig_x[i];
}

/* The slow paths of a ziggurat draw whose first try (word w) missed its
 * rectangle, and further tries: a standard normal from the element's words
 * (0 if they run out, which needs ~30 consecutive rejections: it does not happen). */
static double zig_normal_slow(elem_stream *s, uint64_t w)
{
    for (;;) {
        unsigned i = (unsigned)(w & (ZIG_C - 1));
        double u = 2.0 * (double)(int64_t)(w >> 11) * INV_2_53 - 1.0;
        if (fabs(u) < zig_ratio[i]) return u * zig_x[i];
        if (i == 0) { /* the tail beyond R (Marsaglia) */
            double x, y;
            do {
                if (elem_spent(s)) return 0.0;
                x = log(elem_uniform(s)) / ZIG_R;
                y = log(elem_uniform(s));
            } while (-2.0 * y < x * x);
            return u < 0 ? x - ZIG_R : ZIG_R - x;
        }
        double x = u * zig_x[i]; /* the wedge: compare with the density */
        double f0 = exp(-0.5 * (zig_x[i] * zig_x[i] - x * x));
        double f1 = exp(-0.5 * (zig_x[i + 1] * zig_x[i + 1] - x * x));
        if (f1 + elem_uniform(s) * (f0 - f1) < 1.0) return x;
        if (elem_spent(s)) return 0.0;
        w = elem_word(s);
    }
}

/* One standard normal: strip from the low 7 bits of a word, a uniform in
 * (-1, 1) from its top 53; inside the strip's rectangle (~98.8%) it is done. */
static inline double zig_normal(elem_stream *s)
{
    uint64_t w = elem_word(s);
    unsigned i = (unsigned)(w & (ZIG_C - 1));
    double u = 2.0 * (double)(int64_t)(w >> 11) * INV_2_53 - 1.0;
    if (fabs(u) < zig_ratio[i]) return u * zig_x[i];
    return zig_normal_slow(s, w);
}

static void fill_normal(float *out, uint64_t key, int64_t first, int64_t n, double scale)
{
    for (int64_t k = 0; k < n; k++) {
        elem_stream s = elem_open(key, (uint64_t)(first + k));
        out[k] = (float)(zig_normal(&s) * scale);
    }
}

static void fill_trunc_normal(float *out, uint64_t key, int64_t first, int64_t n, double scale)
{
    double mult = scale / MODEL_TRUNC_NORMAL_STD;
    for (int64_t k = 0; k < n; k++) {
        elem_stream s = elem_open(key, (uint64_t)(first + k));
        double z;
        do z = zig_normal(&s); /* re-draw until inside [-2, 2] (95.4% of draws are) */
        while (fabs(z) > 2.0);
        out[k] = (float)(z * mult);
    }
}

void model_init_range(float *out, int64_t first, int64_t n, const char *name, model_init_kind kind, double scale,
                      uint64_t seed)
{
    if (n <= 0) return;
    pthread_once(&zig_once, zig_init);
    switch (kind) {
    case MODEL_INIT_ZEROS: memset(out, 0, (size_t)n * sizeof *out); return;
    case MODEL_INIT_ONES:
        for (int64_t i = 0; i < n; i++) out[i] = 1.0f;
        return;
    case MODEL_INIT_NORMAL: fill_normal(out, model_init_key(seed, name), first, n, scale); return;
    case MODEL_INIT_TRUNC_NORMAL: fill_trunc_normal(out, model_init_key(seed, name), first, n, scale); return;
    }
    SIM_ASSERT(!"unknown model_init_kind");
}

void model_init_global(float *out, int64_t n, const char *name, model_init_kind kind, double scale, uint64_t seed)
{
    model_init_range(out, 0, n, name, kind, scale, seed);
}

sim_status model_init_fill(sim_device *d, const mesh_shape *m, mesh_array *a, const char *name, model_init_kind kind,
                           double scale, uint64_t seed)
{
    if (a->dtype != SIM_F32)
        return sim_err(SIM_ERR_INTERNAL, "init of '%s': dtype %s is not supported (float32 only)", name,
                       sim_dtype_name(a->dtype));
    if (!a->data) return SIM_OK; /* dry run */
    float *x = a->data;
    int dev = sim_device_id(d);
    if (a->spec.partial) {
        int c[MESH_MAX_AXES];
        mesh_shape_coords(m, dev, c);
        for (int ax = 0; ax < m->n_axes; ax++)
            if ((a->spec.partial & (1u << ax)) && c[ax] != 0) {
                memset(x, 0, a->nlocal * sizeof *x);
                return SIM_OK;
            }
    }
    int rank = a->rank;
    if (rank == 0) {
        model_init_range(x, 0, 1, name, kind, scale, seed);
        return SIM_OK;
    }
    mesh_dim_shard sh[MESH_SPEC_MAX_RANK];
    mesh_spec_shard(&a->spec, m, a->shape, dev, sh);
    int64_t stride[MESH_SPEC_MAX_RANK], idx[MESH_SPEC_MAX_RANK] = {0};
    stride[rank - 1] = 1;
    for (int i = rank - 2; i >= 0; i--) stride[i] = stride[i + 1] * a->shape[i + 1];
    int64_t rows = 1, row = a->local[rank - 1];
    for (int i = 0; i < rank - 1; i++) rows *= a->local[i];
    if (row == 0) return SIM_OK;
    for (int64_t r = 0; r < rows; r++) {
        int64_t g = sh[rank - 1].offset;
        for (int i = 0; i < rank - 1; i++) g += (sh[i].offset + idx[i]) * stride[i];
        model_init_range(x + r * row, g, row, name, kind, scale, seed);
        for (int i = rank - 2; i >= 0; i--) {
            if (++idx[i] < a->local[i]) break;
            idx[i] = 0;
        }
    }
    return SIM_OK;
}

sim_status model_params_init(sim_device *d, const mesh_shape *m, model_param *params, int n, uint64_t seed)
{
    char name[MODEL_PATH_MAX + 32];
    for (int p = 0; p < n; p++) {
        model_param *pp = &params[p];
        if (!pp->w) return sim_err(SIM_ERR_INTERNAL, "init: parameter '%s' has no storage", pp->def.path);
        for (int l = 0; l < pp->n_layers; l++) {
            model_init_layer_name(pp->def.path, pp->def.scan_dim >= 0 ? l : -1, name, sizeof name);
            SIM_TRY(model_init_fill(d, m, &pp->w[l], name, pp->def.init, pp->def.scale, seed));
        }
    }
    return SIM_OK;
}

sim_status model_init_fill_stacked(sim_device *d, const mesh_shape *m, const model_param *p, mesh_array *a,
                                   uint64_t seed)
{
    const model_param_def *def = &p->def;
    int sd = def->scan_dim, rank = a->rank;
    if (sd < 0 || a->spec.partial) return model_init_fill(d, m, a, def->path, def->init, def->scale, seed);
    if (!a->data) return SIM_OK; /* dry run */
    /* global stride of each stacked dim inside one layer (the scan dim has none) */
    int64_t stride[MESH_SPEC_MAX_RANK], s = 1;
    for (int i = rank - 1; i >= 0; i--) {
        stride[i] = i == sd ? 0 : s;
        if (i != sd) s *= a->shape[i];
    }
    mesh_dim_shard sh[MESH_SPEC_MAX_RANK];
    mesh_spec_shard(&a->spec, m, a->shape, sim_device_id(d), sh);
    int64_t idx[MESH_SPEC_MAX_RANK] = {0}, n = (int64_t)a->nlocal;
    /* a run along the last dim stays in one layer unless the last dim is the scan dim */
    int64_t run = sd == rank - 1 ? 1 : a->local[rank - 1];
    char name[MODEL_PATH_MAX + 32];
    float *x = a->data;
    for (int64_t e = 0; e < n; e += run) {
        int64_t g = 0, layer = 0;
        for (int i = 0; i < rank; i++) {
            int64_t gi = sh[i].offset + idx[i];
            if (i == sd) layer = model_param_stack_layer(m, p, gi); /* stage-major when pipelined */
            else g += gi * stride[i];
        }
        model_init_layer_name(def->path, (int)layer, name, sizeof name);
        model_init_range(x + e, g, run, name, def->init, def->scale, seed);
        /* advance the multi-index by `run` elements */
        for (int i = run == 1 ? rank - 1 : rank - 2; i >= 0; i--) {
            if (++idx[i] < a->local[i]) break;
            idx[i] = 0;
        }
    }
    return SIM_OK;
}
