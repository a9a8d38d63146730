/* bk_activation.c — SiLU / SwiGLU / GeGLU, and the bfloat16 round trip.
 * silu'(x) = s + x s (1 - s) with s = sigmoid(x);
 * gelu'(x) = c + x * 0.5 (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2), t = tanh(...), c = 0.5 (1 + t). */
#include "blas_kernels/bk_activation.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "blas_kernels/bk.h"
#include "blas_kernels/bk_math.h"
#include "blas_kernels/bk_parallel.h"

enum { GRAIN = 1 << 14 }; /* elements per parallel chunk */

/* 1/(1+e^-x) that never overflows and vectorises (bk_math.h). */
static inline float sigmoidf_stable(float x) { return bk_sigmoidf(x); }

static inline double sigmoid_d(double x)
{
    if (x >= 0.0) return 1.0 / (1.0 + exp(-x));
    double e = exp(x);
    return e / (1.0 + e);
}

/* Operands of one elementwise call, shared by its parallel chunks. */
typedef struct {
    float *o0, *o1;
    const float *i0, *i1, *i2;
} ew_args;

/* Pointers are copied into restrict locals so the loops vectorise. */
BK_CLONES static void silu_fwd_chunk(int64_t lo, int64_t hi, void *arg)
{
    const ew_args *a = arg;
    float *restrict out = a->o0;
    const float *restrict in = a->i0;
    for (int64_t i = lo; i < hi; i++) out[i] = in[i] * sigmoidf_stable(in[i]);
}

BK_CLONES static void silu_bwd_chunk(int64_t lo, int64_t hi, void *arg)
{
    const ew_args *a = arg;
    float *restrict din = a->o0;
    const float *restrict dout = a->i0, *restrict in = a->i1;
    for (int64_t i = lo; i < hi; i++) {
        float x = in[i], s = sigmoidf_stable(x);
        din[i] += dout[i] * (s + x * s * (1.0f - s));
    }
}

BK_CLONES static void swiglu_fwd_chunk(int64_t lo, int64_t hi, void *arg)
{
    const ew_args *a = arg;
    float *restrict out = a->o0;
    const float *restrict gate = a->i0, *restrict up = a->i1;
    for (int64_t i = lo; i < hi; i++) out[i] = gate[i] * sigmoidf_stable(gate[i]) * up[i];
}

BK_CLONES static void swiglu_bwd_chunk(int64_t lo, int64_t hi, void *arg)
{
    const ew_args *a = arg;
    float *restrict dgate = a->o0, *restrict dup = a->o1;
    const float *restrict dout = a->i0, *restrict gate = a->i1, *restrict up = a->i2;
    for (int64_t i = lo; i < hi; i++) {
        float g = gate[i], s = sigmoidf_stable(g), d = dout[i];
        dgate[i] += d * up[i] * (s + g * s * (1.0f - s));
        dup[i] += d * g * s;
    }
}

BK_CLONES static void swiglu_bwd_into_chunk(int64_t lo, int64_t hi, void *arg)
{
    const ew_args *a = arg;
    float *restrict dgate = a->o0, *restrict dup = a->o1;
    const float *restrict dout = a->i0, *restrict gate = a->i1, *restrict up = a->i2;
    for (int64_t i = lo; i < hi; i++) {
        float g = gate[i], s = sigmoidf_stable(g), d = dout[i];
        dgate[i] = d * up[i] * (s + g * s * (1.0f - s));
        dup[i] = d * g * s;
    }
}

/* jax.nn.gelu(approximate=True): x * 0.5 * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x**3))) */
static const float GELU_K = 0.7978845608028654f; /* sqrt(2/pi) */
static const float GELU_C = 0.044715f;

BK_CLONES static void geglu_fwd_chunk(int64_t lo, int64_t hi, void *arg)
{
    const ew_args *a = arg;
    float *restrict out = a->o0;
    const float *restrict gate = a->i0, *restrict up = a->i1;
    for (int64_t i = lo; i < hi; i++) {
        float x = gate[i], cdf = 0.5f * (1.0f + tanhf(GELU_K * (x + GELU_C * (x * x * x))));
        out[i] = x * cdf * up[i];
    }
}

BK_CLONES static void geglu_bwd_into_chunk(int64_t lo, int64_t hi, void *arg)
{
    const ew_args *a = arg;
    float *restrict dgate = a->o0, *restrict dup = a->o1;
    const float *restrict dout = a->i0, *restrict gate = a->i1, *restrict up = a->i2;
    for (int64_t i = lo; i < hi; i++) {
        float x = gate[i], th = tanhf(GELU_K * (x + GELU_C * (x * x * x))), cdf = 0.5f * (1.0f + th), d = dout[i];
        float dgelu = cdf + x * 0.5f * (1.0f - th * th) * GELU_K * (1.0f + 3.0f * GELU_C * x * x);
        dgate[i] = d * up[i] * dgelu;
        dup[i] = d * x * cdf;
    }
}

void bk_geglu_fwd(float *out, const float *gate, const float *up, size_t n)
{
    BK_ASSERT(n == 0 || (out && gate && up));
    ew_args a = {out, NULL, gate, up, NULL};
    bk_parallel_for((int64_t)n, GRAIN, geglu_fwd_chunk, &a);
}

void bk_geglu_bwd_into(float *dgate, float *dup, const float *dout, const float *gate, const float *up, size_t n)
{
    BK_ASSERT(n == 0 || (dgate && dup && dout && gate && up));
    ew_args a = {dgate, dup, dout, gate, up};
    bk_parallel_for((int64_t)n, GRAIN, geglu_bwd_into_chunk, &a);
}

/* Round to nearest, ties to even, on the upper 16 bits (XLA's float32 -> bfloat16 convert; NaNs stay
 * NaN, quietened). */
void bk_round_bf16(float *out, const float *x, size_t n)
{
    BK_ASSERT(n == 0 || (out && x));
    for (size_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, &x[i], sizeof u);
        if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu)) u |= 0x00400000u; /* NaN */
        else u += 0x7fffu + ((u >> 16) & 1u);
        u &= 0xffff0000u;
        memcpy(&out[i], &u, sizeof u);
    }
}

void bk_silu_fwd(float *out, const float *in, size_t n)
{
    BK_ASSERT(n == 0 || (out && in));
    ew_args a = {out, NULL, in, NULL, NULL};
    bk_parallel_for((int64_t)n, GRAIN, silu_fwd_chunk, &a);
}

void bk_silu_bwd(float *din, const float *dout, const float *in, size_t n)
{
    BK_ASSERT(n == 0 || (din && dout && in));
    ew_args a = {din, NULL, dout, in, NULL};
    bk_parallel_for((int64_t)n, GRAIN, silu_bwd_chunk, &a);
}

void bk_swiglu_fwd(float *out, const float *gate, const float *up, size_t n)
{
    BK_ASSERT(n == 0 || (out && gate && up));
    ew_args a = {out, NULL, gate, up, NULL};
    bk_parallel_for((int64_t)n, GRAIN, swiglu_fwd_chunk, &a);
}

void bk_swiglu_bwd(float *dgate, float *dup, const float *dout, const float *gate, const float *up, size_t n)
{
    BK_ASSERT(n == 0 || (dgate && dup && dout && gate && up));
    ew_args a = {dgate, dup, dout, gate, up};
    bk_parallel_for((int64_t)n, GRAIN, swiglu_bwd_chunk, &a);
}

void bk_swiglu_bwd_into(float *dgate, float *dup, const float *dout, const float *gate, const float *up, size_t n)
{
    BK_ASSERT(n == 0 || (dgate && dup && dout && gate && up));
    ew_args a = {dgate, dup, dout, gate, up};
    bk_parallel_for((int64_t)n, GRAIN, swiglu_bwd_into_chunk, &a);
}

void bk_clamped_glu_fwd(float *out, const float *gate, const float *up, size_t n, float alpha, float limit)
{
    BK_ASSERT(n == 0 || (out && gate && up));
    for (size_t i = 0; i < n; i++) {
        const float g = gate[i] < limit ? gate[i] : limit;
        const float u = up[i] < -limit ? -limit : (up[i] > limit ? limit : up[i]);
        const float s = 1.0f / (1.0f + expf(-alpha * g));
        out[i] = g * s * (u + 1.0f);
    }
}

void bk_clamped_glu_bwd(float *dgate, float *dup, const float *dout, const float *gate, const float *up, size_t n,
                        float alpha, float limit)
{
    BK_ASSERT(n == 0 || (dgate && dup && dout && gate && up));
    for (size_t i = 0; i < n; i++) {
        const float g = gate[i] < limit ? gate[i] : limit;
        const float u = up[i] < -limit ? -limit : (up[i] > limit ? limit : up[i]);
        const float s = 1.0f / (1.0f + expf(-alpha * g));
        if (gate[i] < limit) dgate[i] += dout[i] * (u + 1.0f) * (s + g * alpha * s * (1.0f - s));
        if (up[i] > -limit && up[i] < limit) dup[i] += dout[i] * g * s;
    }
}

void bk_silu_fwd_ref(float *out, const float *in, size_t n)
{
    for (size_t i = 0; i < n; i++) out[i] = (float)(in[i] * sigmoid_d(in[i]));
}

void bk_silu_bwd_ref(float *din, const float *dout, const float *in, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        double x = in[i], s = sigmoid_d(x);
        din[i] += (float)(dout[i] * (s + x * s * (1.0 - s)));
    }
}

void bk_swiglu_fwd_ref(float *out, const float *gate, const float *up, size_t n)
{
    for (size_t i = 0; i < n; i++) out[i] = (float)(gate[i] * sigmoid_d(gate[i]) * up[i]);
}

void bk_swiglu_bwd_ref(float *dgate, float *dup, const float *dout, const float *gate, const float *up, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        double g = gate[i], s = sigmoid_d(g);
        dgate[i] += (float)(dout[i] * up[i] * (s + g * s * (1.0 - s)));
        dup[i] += (float)(dout[i] * g * s);
    }
}

static double gelu_cdf_d(double x) { return 0.5 * (1.0 + tanh(0.7978845608028654 * (x + 0.044715 * x * x * x))); }

void bk_geglu_fwd_ref(float *out, const float *gate, const float *up, size_t n)
{
    for (size_t i = 0; i < n; i++) out[i] = (float)(gate[i] * gelu_cdf_d(gate[i]) * up[i]);
}

void bk_geglu_bwd_ref(float *dgate, float *dup, const float *dout, const float *gate, const float *up, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        double x = gate[i], th = tanh(0.7978845608028654 * (x + 0.044715 * x * x * x));
        double dg = 0.5 * (1.0 + th) + x * 0.5 * (1.0 - th * th) * 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * x * x);
        dgate[i] = (float)(dout[i] * up[i] * dg);
        dup[i] = (float)(dout[i] * x * 0.5 * (1.0 + th));
    }
}
