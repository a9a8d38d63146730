/* bk_rope.c — RoPE forward/backward. Angles pos * freq are formed in double and their sin/cos
 * computed once per token (shared by all heads); the rotation itself is a fused float loop.
 * (MaxText forms angles in float32; double is closer to the exact value, the difference is
 * ~1e-4 rad at pos 4096 and far below bf16 resolution.) */
#include "blas_kernels/bk_rope.h"

#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "blas_kernels/bk.h"
#include "blas_kernels/bk_parallel.h"

bk_rope_params bk_rope_params_default(int dim)
{
    bk_rope_params p;
    memset(&p, 0, sizeof p);
    p.kind = BK_ROPE_DEFAULT;
    p.dim = dim;
    p.min_timescale = 1.0;
    p.max_timescale = 10000.0;
    p.linear_scaling_factor = 1.0;
    p.factor = 1.0;
    return p;
}

bk_rope_params bk_rope_params_yarn(int dim)
{
    bk_rope_params p = bk_rope_params_default(dim);
    p.kind = BK_ROPE_YARN;
    p.factor = 40.0;
    p.original_max_position_embeddings = 4096;
    p.beta_fast = 32.0;
    p.beta_slow = 1.0;
    p.interleave = 1;
    p.truncate = 1;
    p.attention_scaling = 0;
    return p;
}

bk_rope_params bk_rope_params_llama31(int dim)
{
    bk_rope_params p = bk_rope_params_default(dim);
    p.kind = BK_ROPE_LLAMA31;
    p.use_scale = 1;
    return p;
}

/* Llama 3.1's fixed scaling constants (embeddings.LLaMARotaryEmbedding._apply_scaling_factor,
 * after Meta's reference model.py apply_scaling): not configurable in MaxText. */
#define LLAMA31_SCALE_FACTOR 8.0
#define LLAMA31_LOW_FREQ_FACTOR 1.0
#define LLAMA31_HIGH_FREQ_FACTOR 4.0
#define LLAMA31_OLD_CONTEXT_LEN 8192.0

/* Llama 3.1's scaled frequency of an unscaled one. */
static double llama31_scale(double freq)
{
    double low_wavelen = LLAMA31_OLD_CONTEXT_LEN / LLAMA31_LOW_FREQ_FACTOR;
    double high_wavelen = LLAMA31_OLD_CONTEXT_LEN / LLAMA31_HIGH_FREQ_FACTOR;
    double wavelen = 2.0 * M_PI / freq;
    if (wavelen < high_wavelen) return freq;
    if (wavelen > low_wavelen) return freq / LLAMA31_SCALE_FACTOR;
    double smooth = (LLAMA31_OLD_CONTEXT_LEN / wavelen - LLAMA31_LOW_FREQ_FACTOR) /
                    (LLAMA31_HIGH_FREQ_FACTOR - LLAMA31_LOW_FREQ_FACTOR);
    return (1.0 - smooth) * freq / LLAMA31_SCALE_FACTOR + smooth * freq;
}

/* Where input and output pair i sit: interleaved (2i, 2i+1) or halves (i, i + dim/2). */
static int in_interleaved(const bk_rope_params *p)
{
    return (p->kind == BK_ROPE_YARN && p->interleave) || p->kind == BK_ROPE_LLAMA31;
}
static int out_interleaved(const bk_rope_params *p) { return p->kind == BK_ROPE_LLAMA31; }

static void check_params(const bk_rope_params *p)
{
    BK_ASSERT(p != NULL);
    BK_ASSERTF(p->dim > 0 && p->dim % 2 == 0, "rope dim=%d must be even and positive", p->dim);
    BK_ASSERTF(p->max_timescale > 0.0, "max_timescale=%g", p->max_timescale);
    if (p->kind == BK_ROPE_DEFAULT || p->kind == BK_ROPE_LLAMA31) {
        BK_ASSERTF(p->min_timescale > 0.0, "min_timescale=%g", p->min_timescale);
        BK_ASSERTF(p->linear_scaling_factor > 0.0, "linear_scaling_factor=%g", p->linear_scaling_factor);
    } else {
        BK_ASSERTF(p->kind == BK_ROPE_YARN, "rope kind %d", (int)p->kind);
        BK_ASSERTF(p->factor > 0.0 && p->original_max_position_embeddings > 0 && p->beta_fast > 0.0 &&
                       p->beta_slow > 0.0,
                   "yarn factor=%g original_max_position_embeddings=%d beta_fast=%g beta_slow=%g", p->factor,
                   p->original_max_position_embeddings, p->beta_fast, p->beta_slow);
    }
}

/* YaRN correction dim: the pair index whose wavelength makes num_rot turns over orig_max. */
static double yarn_correction_dim(double num_rot, int d, double theta, int orig_max)
{
    return d * log(orig_max / (num_rot * 2.0 * M_PI)) / (2.0 * log(theta));
}

void bk_rope_freqs(double *freq, const bk_rope_params *p)
{
    check_params(p);
    int d = p->dim, half = d / 2;
    if (p->kind == BK_ROPE_DEFAULT) {
        for (int i = 0; i < half; i++) {
            double ts = p->min_timescale * pow(p->max_timescale / p->min_timescale, 2.0 * i / d);
            freq[i] = 1.0 / (ts * p->linear_scaling_factor);
        }
        return;
    }
    if (p->kind == BK_ROPE_LLAMA31) {
        for (int i = 0; i < half; i++) {
            double f = 1.0 / (p->min_timescale * pow(p->max_timescale / p->min_timescale, 2.0 * i / d));
            freq[i] = p->use_scale ? llama31_scale(f) : f;
        }
        return;
    }
    double low = yarn_correction_dim(p->beta_fast, d, p->max_timescale, p->original_max_position_embeddings);
    double high = yarn_correction_dim(p->beta_slow, d, p->max_timescale, p->original_max_position_embeddings);
    if (p->truncate) low = floor(low), high = ceil(high);
    low = fmax(low, 0.0);
    high = fmin(high, (double)(d - 1));
    if (low == high) high += 0.001; // as MaxText: avoid a zero-width ramp
    for (int i = 0; i < half; i++) {
        double base = 1.0 / pow(p->max_timescale, 2.0 * i / d);
        double ramp = fmin(fmax((i - low) / (high - low), 0.0), 1.0);
        double smooth = 1.0 - ramp;
        freq[i] = base / p->factor * (1.0 - smooth) + base * smooth;
    }
}

double bk_yarn_mscale(double factor, double mscale) { return factor <= 1.0 ? 1.0 : 0.1 * mscale * log(factor) + 1.0; }

double bk_mla_softmax_scale(int qk_head_dim, long max_position_embeddings, long original_max_position_embeddings,
                            double rope_factor, double mscale)
{
    BK_ASSERTF(qk_head_dim > 0, "qk_head_dim=%d", qk_head_dim);
    double s = 1.0 / sqrt((double)qk_head_dim);
    if (max_position_embeddings > original_max_position_embeddings) {
        double m = 0.1 * mscale * log(rope_factor) + 1.0; // no factor<=1 guard, as MaxText
        s *= m * m;
    }
    return s;
}

static double output_scale(const bk_rope_params *p)
{
    if (p->kind == BK_ROPE_YARN && p->attention_scaling && p->factor > 1.0) return 0.1 * log(p->factor) + 1.0;
    return 1.0;
}

static void check_args(const void *out, const void *in, const int32_t *pos, int N, int H, int in_stride, int out_stride,
                       const bk_rope_params *p)
{
    check_params(p);
    BK_ASSERTF(N >= 0 && H > 0, "N=%d H=%d", N, H);
    BK_ASSERTF(in_stride >= p->dim && out_stride >= p->dim, "strides in=%d out=%d must be >= rope dim %d", in_stride,
               out_stride, p->dim);
    BK_ASSERT(N == 0 || (out && in && pos));
}

/* Forward and backward share the cos/sin table and the pair addressing:
 * input pair i sits at (a_i, b_i) = (2i, 2i+1) if interleaved, else (i, i+half);
 * output pair i at (i, i+half), or at (2i, 2i+1) for LLAMA31.  The table has one row (cos[half], sin[half], times
 * the output scale) per position: a call's tokens usually repeat a few positions (a batch of
 * rows at 0..T-1), so the rows are made once per distinct position in [pos_lo, pos_hi]
 * instead of once per token; when the positions spread wider than there are tokens, each token
 * makes its own row.  A row holds the same values either way. */
typedef struct {
    float *out;
    const float *in;
    const int32_t *pos;
    int H, in_stride, out_stride, backward;
    const bk_rope_params *p;
    const double *freq;
    float *table; /* (pos_hi - pos_lo + 1, dim) rows, or NULL: per token */
    int64_t pos_lo;
} rope_job;

/* One table row: cos and sin of pos * freq[i], times the output scale. */
static void rope_row(float *cs, int32_t pos, const double *freq, int half, float scale)
{
    for (int i = 0; i < half; i++) {
        double ang = (double)pos * freq[i];
        cs[i] = (float)(cos(ang) * scale);
        cs[half + i] = (float)(sin(ang) * scale);
    }
}

static void rope_table_rows(int64_t lo, int64_t hi, void *arg)
{
    const rope_job *J = arg;
    int half = J->p->dim / 2;
    float scale = (float)output_scale(J->p);
    for (int64_t r = lo; r < hi; r++)
        rope_row(J->table + r * J->p->dim, (int32_t)(J->pos_lo + r), J->freq, half, scale);
}

/* y = rotate(x) for one row of the non-interleaved layout (y and x do not overlap). */
static inline void rot_fwd(float *restrict y, const float *restrict x, const float *restrict c, const float *restrict s,
                           int half)
{
    for (int i = 0; i < half; i++) {
        float x1 = x[i], x2 = x[i + half];
        y[i] = x1 * c[i] - x2 * s[i];
        y[i + half] = x2 * c[i] + x1 * s[i];
    }
}

static inline void rot_bwd(float *restrict dx, const float *restrict g, const float *restrict c,
                           const float *restrict s, int half)
{
    for (int i = 0; i < half; i++) {
        float g1 = g[i], g2 = g[i + half];
        dx[i] += g1 * c[i] + g2 * s[i];
        dx[i + half] += g2 * c[i] - g1 * s[i];
    }
}

BK_CLONES static void rope_tokens(int64_t n_lo, int64_t n_hi, void *arg)
{
    const rope_job *J = arg;
    const bk_rope_params *p = J->p;
    int half = p->dim / 2, H = J->H;
    int il = in_interleaved(p), ol = out_interleaved(p);
    float *own = J->table ? NULL : bk_xmalloc((size_t)2 * half * sizeof *own); // this token's row
    float *tmp = bk_xmalloc((size_t)p->dim * sizeof *tmp);                     // an in-place input row
    float scale = (float)output_scale(p);
    for (int64_t n = n_lo; n < n_hi; n++) {
        const float *cs = own;
        if (J->table) cs = J->table + (J->pos[n] - J->pos_lo) * p->dim;
        else rope_row(own, J->pos[n], J->freq, half, scale);
        const float *c = cs, *s = cs + half;
        for (int h = 0; h < H; h++) {
            size_t row = (size_t)n * H + h;
            if (!J->backward) {
                const float *x = J->in + row * J->in_stride;
                float *y = J->out + row * J->out_stride;
                if ((const float *)y == x) {
                    memcpy(tmp, x, (size_t)p->dim * sizeof *tmp);
                    x = tmp;
                }
                if (!il) {
                    rot_fwd(y, x, c, s, half);
                    continue;
                }
                int o1 = ol ? 2 : 1, o2 = ol ? 1 : half; // output pair i at (o1*i, o1*i + o2)
                for (int i = 0; i < half; i++) {
                    float x1 = x[2 * i], x2 = x[2 * i + 1];
                    y[o1 * i] = x1 * c[i] - x2 * s[i];
                    y[o1 * i + o2] = x2 * c[i] + x1 * s[i];
                }
            } else { // here `out` is din (input layout), `in` is dout (output layout)
                const float *g = J->in + row * J->out_stride;
                float *dx = J->out + row * J->in_stride;
                if (!il) {
                    rot_bwd(dx, g, c, s, half);
                    continue;
                }
                int o1 = ol ? 2 : 1, o2 = ol ? 1 : half;
                for (int i = 0; i < half; i++) {
                    float g1 = g[o1 * i], g2 = g[o1 * i + o2];
                    dx[2 * i] += g1 * c[i] + g2 * s[i];
                    dx[2 * i + 1] += g2 * c[i] - g1 * s[i];
                }
            }
        }
    }
    free(own), free(tmp);
}

/* ---- the process-wide table cache ----
 * Every simulated device rotates the same positions with the same parameters (a batch shard
 * holds rows at 0..T-1), so a table made once serves them all: 64 devices made 64 copies of
 * each table per layer and pass before.  A table is a pure function of (params, position), so a
 * cached row holds the bits a fresh one would.  Entries are read-only once published and live
 * until bk_rope_cache_clear (or exit).  The lock guards only the list: a table is computed
 * outside it (on the kernel pool, which may run other work meanwhile), and a device that lost
 * the race to publish frees its own copy and takes the published one.  No lock is held across
 * anything that can block or switch fibers, and nothing is per thread, so devices running as
 * threads or as fibers on worker threads share the cache alike. */
typedef struct rope_table {
    struct rope_table *next;
    bk_rope_params p;
    int64_t lo, hi; /* positions of the first and last row */
    float *rows;    /* (hi - lo + 1, dim) */
} rope_table;

enum { ROPE_CACHE_MAX_BYTES = 64 << 20 }; /* past this, tables are made per call as before */

static struct {
    pthread_mutex_t mu;
    rope_table *head;
    size_t bytes;
    int tables;
    int exit_hook;
} C = {PTHREAD_MUTEX_INITIALIZER, NULL, 0, 0, 0};

static int same_params(const bk_rope_params *a, const bk_rope_params *b)
{
    return a->kind == b->kind && a->dim == b->dim && a->min_timescale == b->min_timescale &&
           a->max_timescale == b->max_timescale && a->linear_scaling_factor == b->linear_scaling_factor &&
           a->factor == b->factor && a->original_max_position_embeddings == b->original_max_position_embeddings &&
           a->beta_fast == b->beta_fast && a->beta_slow == b->beta_slow && a->interleave == b->interleave &&
           a->truncate == b->truncate && a->attention_scaling == b->attention_scaling && a->use_scale == b->use_scale;
}

/* The cached rows for positions [lo, hi] (row of position lo first), or NULL.  Caller holds C.mu. */
static const float *cache_find(const bk_rope_params *p, int64_t lo, int64_t hi)
{
    for (const rope_table *t = C.head; t; t = t->next)
        if (t->lo <= lo && hi <= t->hi && same_params(&t->p, p)) return t->rows + (lo - t->lo) * p->dim;
    return NULL;
}

void bk_rope_cache_clear(void)
{
    pthread_mutex_lock(&C.mu);
    rope_table *t = C.head;
    C.head = NULL;
    C.bytes = 0;
    C.tables = 0;
    pthread_mutex_unlock(&C.mu);
    while (t) {
        rope_table *next = t->next;
        free(t->rows);
        free(t);
        t = next;
    }
}

int bk_rope_cache_tables(void)
{
    pthread_mutex_lock(&C.mu);
    int n = C.tables;
    pthread_mutex_unlock(&C.mu);
    return n;
}

/* Rows for positions [lo, hi]: the cached ones, or made now and published; *own is set when the
 * caller got a private copy (cache full) that it must free. */
static const float *table_for(rope_job *J, int64_t lo, int64_t hi, float **own)
{
    const bk_rope_params *p = J->p;
    *own = NULL;
    pthread_mutex_lock(&C.mu);
    const float *hit = cache_find(p, lo, hi);
    pthread_mutex_unlock(&C.mu);
    if (hit) return hit;
    size_t bytes = (size_t)(hi - lo + 1) * p->dim * sizeof(float);
    float *rows = bk_xmalloc(bytes);
    J->table = rows;
    J->pos_lo = lo;
    bk_parallel_for(hi - lo + 1, 64, rope_table_rows, J);
    rope_table *t = NULL;
    pthread_mutex_lock(&C.mu);
    hit = cache_find(p, lo, hi); /* another device may have published it meanwhile */
    if (!hit && C.bytes + bytes <= ROPE_CACHE_MAX_BYTES) {
        t = malloc(sizeof *t);
        if (t) {
            *t = (rope_table){C.head, *p, lo, hi, rows};
            C.head = t;
            C.bytes += bytes;
            C.tables++;
            if (!C.exit_hook) C.exit_hook = atexit(bk_rope_cache_clear) == 0;
        }
    }
    pthread_mutex_unlock(&C.mu);
    if (t) return rows;
    if (hit) {
        free(rows);
        return hit;
    }
    *own = rows;
    return rows;
}

static void rope_apply(float *out, const float *in, const int32_t *pos, int N, int H, int in_stride, int out_stride,
                       const bk_rope_params *p, int backward)
{
    check_args(out, in, pos, N, H, in_stride, out_stride, p);
    double *freq = bk_xmalloc((size_t)(p->dim / 2) * sizeof *freq);
    bk_rope_freqs(freq, p);
    rope_job J = {out, in, pos, H, in_stride, out_stride, backward, p, freq, NULL, 0};
    float *own = NULL;
    if (N > 0) {
        int64_t lo = pos[0], hi = pos[0];
        for (int n = 1; n < N; n++) {
            lo = pos[n] < lo ? pos[n] : lo;
            hi = pos[n] > hi ? pos[n] : hi;
        }
        if (hi - lo + 1 <= N) {                             // fewer distinct positions than tokens: a row per position
            J.table = (float *)table_for(&J, lo, hi, &own); /* read-only from here on */
            J.pos_lo = lo;
        }
    }
    bk_parallel_for(N, 256, rope_tokens, &J); /* tokens are independent */
    free(own);
    free(freq);
}

void bk_rope_fwd(float *out, const float *in, const int32_t *positions, int N, int H, int in_stride, int out_stride,
                 const bk_rope_params *p)
{
    BK_ASSERTF(out != in || in_stride == out_stride, "in-place rope needs equal strides (%d, %d)", in_stride,
               out_stride);
    rope_apply(out, in, positions, N, H, in_stride, out_stride, p, 0);
}

void bk_rope_bwd(float *din, const float *dout, const int32_t *positions, int N, int H, int in_stride, int out_stride,
                 const bk_rope_params *p)
{
    BK_ASSERT(din != dout || N == 0); // accumulation cannot run in place
    rope_apply(din, dout, positions, N, H, in_stride, out_stride, p, 1);
}

/* ---- reference: per element, frequencies re-derived from the formulas as written ---- */

static double ref_freq(const bk_rope_params *p, int i)
{
    int d = p->dim;
    if (p->kind == BK_ROPE_DEFAULT) {
        double fraction = 2.0 * i / d;
        double timescale = p->min_timescale * pow(p->max_timescale / p->min_timescale, fraction);
        return 1.0 / (timescale * p->linear_scaling_factor);
    }
    if (p->kind == BK_ROPE_LLAMA31) { // written as MaxText's _apply_scaling_factor reads
        double fraction = 2.0 * i / d;
        double freq = 1.0 / (p->min_timescale * pow(p->max_timescale / p->min_timescale, fraction));
        if (!p->use_scale) return freq;
        double wavelen = 2.0 * acos(-1.0) / freq;
        if (wavelen < 8192.0 / 4.0) return freq;
        if (wavelen > 8192.0 / 1.0) return freq / 8.0;
        double smooth = (8192.0 / wavelen - 1.0) / (4.0 - 1.0);
        return (1.0 - smooth) * freq / 8.0 + smooth * freq;
    }
    double two_pi = 2.0 * acos(-1.0), orig = p->original_max_position_embeddings;
    double low = d * log(orig / (p->beta_fast * two_pi)) / (2.0 * log(p->max_timescale));
    double high = d * log(orig / (p->beta_slow * two_pi)) / (2.0 * log(p->max_timescale));
    if (p->truncate) {
        low = floor(low);
        high = ceil(high);
    }
    if (low < 0) low = 0;
    if (high > d - 1) high = d - 1;
    if (low == high) high += 0.001;
    double lin = (i - low) / (high - low);
    double ramp = lin < 0 ? 0 : (lin > 1 ? 1 : lin);
    double base = exp(-(2.0 * i / d) * log(p->max_timescale));
    return base * (1.0 - ramp) + base / p->factor * ramp;
}

void bk_rope_fwd_ref(float *out, const float *in, const int32_t *positions, int N, int H, int in_stride, int out_stride,
                     const bk_rope_params *p)
{
    check_args(out, in, positions, N, H, in_stride, out_stride, p);
    BK_ASSERT(out != in);
    int half = p->dim / 2, il = in_interleaved(p), ol = out_interleaved(p);
    double sc = (p->kind == BK_ROPE_YARN && p->attention_scaling && p->factor > 1) ? 0.1 * log(p->factor) + 1 : 1;
    for (int n = 0; n < N; n++)
        for (int h = 0; h < H; h++)
            for (int i = 0; i < half; i++) {
                const float *x = in + ((size_t)n * H + h) * in_stride;
                float *y = out + ((size_t)n * H + h) * out_stride;
                double re = il ? x[2 * i] : x[i], im = il ? x[2 * i + 1] : x[i + half];
                double a = positions[n] * ref_freq(p, i);
                /* (re + i im) * e^{i a} */
                y[ol ? 2 * i : i] = (float)(sc * (re * cos(a) - im * sin(a)));
                y[ol ? 2 * i + 1 : i + half] = (float)(sc * (re * sin(a) + im * cos(a)));
            }
}

void bk_rope_bwd_ref(float *din, const float *dout, const int32_t *positions, int N, int H, int in_stride,
                     int out_stride, const bk_rope_params *p)
{
    check_args(din, dout, positions, N, H, in_stride, out_stride, p);
    int half = p->dim / 2, il = in_interleaved(p), ol = out_interleaved(p);
    double sc = (p->kind == BK_ROPE_YARN && p->attention_scaling && p->factor > 1) ? 0.1 * log(p->factor) + 1 : 1;
    for (int n = 0; n < N; n++)
        for (int h = 0; h < H; h++)
            for (int i = 0; i < half; i++) {
                const float *g = dout + ((size_t)n * H + h) * out_stride;
                float *dx = din + ((size_t)n * H + h) * in_stride;
                double a = positions[n] * ref_freq(p, i);
                double g_re = g[ol ? 2 * i : i], g_im = g[ol ? 2 * i + 1 : i + half];
                /* (g_re + i g_im) * e^{-i a} */
                double dre = sc * (g_re * cos(a) + g_im * sin(a));
                double dim_ = sc * (g_im * cos(a) - g_re * sin(a));
                dx[il ? 2 * i : i] += (float)dre;
                dx[il ? 2 * i + 1 : i + half] += (float)dim_;
            }
}
