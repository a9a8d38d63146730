/* bk_softcap.c — scaled tanh soft cap, forward and backward (see the header). */
#include "blas_kernels/bk_softcap.h"

#include <math.h>

void bk_softcap_fwd(float *out, const float *in, size_t n, float a, float cap)
{
    if (cap > 0.0f) {
        const float k = a / cap;
        for (size_t i = 0; i < n; i++) out[i] = cap * tanhf(k * in[i]);
    } else {
        for (size_t i = 0; i < n; i++) out[i] = a * in[i];
    }
}

void bk_softcap_bwd(float *din, const float *dout, const float *out, size_t n, float a, float cap)
{
    if (cap > 0.0f) {
        const float inv = 1.0f / cap;
        for (size_t i = 0; i < n; i++) {
            const float t = out[i] * inv; // tanh(a x / cap), recovered from the output
            din[i] += dout[i] * a * (1.0f - t * t);
        }
    } else {
        for (size_t i = 0; i < n; i++) din[i] += a * dout[i];
    }
}

void bk_softcap_fwd_ref(float *out, const float *in, size_t n, float a, float cap)
{
    for (size_t i = 0; i < n; i++) {
        double x = (double)a * in[i];
        out[i] = (float)(cap > 0.0f ? cap * tanh(x / cap) : x);
    }
}

void bk_softcap_bwd_ref(float *din, const float *dout, const float *in, size_t n, float a, float cap)
{
    for (size_t i = 0; i < n; i++) {
        double g = a;
        if (cap > 0.0f) {
            double c = cosh((double)a * in[i] / cap);
            g = a / (c * c); // d/dx cap tanh(a x / cap) = a sech^2(a x / cap)
        }
        din[i] += (float)(dout[i] * g);
    }
}
