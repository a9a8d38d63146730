/* bk_softmax.c — row softmax forward/backward (in-place forward allowed: out == in). */
#include "blas_kernels/bk_softmax.h"

#include <math.h>

#include "blas_kernels/bk.h"

void bk_softmax_fwd(float *out, const float *in, int N, int V)
{
    BK_ASSERTF(N >= 0 && V > 0, "N=%d V=%d", N, V);
    BK_ASSERT(out && in);
    for (int n = 0; n < N; n++) {
        const float *x = in + (size_t)n * V;
        float *y = out + (size_t)n * V;
        float m = x[0];
        for (int j = 1; j < V; j++) m = x[j] > m ? x[j] : m;
        double s = 0.0;
        for (int j = 0; j < V; j++) {
            y[j] = expf(x[j] - m);
            s += y[j];
        }
        float inv = (float)(1.0 / s);
        for (int j = 0; j < V; j++) y[j] *= inv;
    }
}

void bk_softmax_bwd(float *din, const float *dout, const float *out, int N, int V)
{
    BK_ASSERTF(N >= 0 && V > 0, "N=%d V=%d", N, V);
    BK_ASSERT(din && dout && out);
    for (int n = 0; n < N; n++) {
        const float *g = dout + (size_t)n * V, *y = out + (size_t)n * V;
        float *dx = din + (size_t)n * V;
        double dot = 0.0;
        for (int j = 0; j < V; j++) dot += (double)g[j] * y[j];
        float d = (float)dot;
        for (int j = 0; j < V; j++) dx[j] += y[j] * (g[j] - d);
    }
}

void bk_softmax_fwd_ref(float *out, const float *in, int N, int V)
{
    for (int n = 0; n < N; n++) {
        double m = in[n * V];
        for (int j = 1; j < V; j++) m = fmax(m, in[n * V + j]);
        double s = 0.0;
        for (int j = 0; j < V; j++) s += exp(in[n * V + j] - m);
        for (int j = 0; j < V; j++) out[n * V + j] = (float)(exp(in[n * V + j] - m) / s);
    }
}

void bk_softmax_bwd_ref(float *din, const float *dout, const float *out, int N, int V)
{
    for (int n = 0; n < N; n++) {
        double dot = 0.0;
        for (int j = 0; j < V; j++) dot += (double)dout[n * V + j] * out[n * V + j];
        for (int j = 0; j < V; j++) din[n * V + j] += (float)(out[n * V + j] * (dout[n * V + j] - dot));
    }
}
