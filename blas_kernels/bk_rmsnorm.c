/* bk_rmsnorm.c — RMSNorm forward/backward.
 * Backward: with g = dout * scale and r = rstd, dx = r * g - x * r^3 * mean(g * x);
 * dscale_c = sum_n dout[n,c] * x[n,c] * r[n]. */
#include "blas_kernels/bk_rmsnorm.h"

#include <math.h>

#include "blas_kernels/bk.h"

void bk_rmsnorm_fwd(float *out, float *rstd, const float *x, const float *scale, int N, int C, float eps)
{
    BK_ASSERTF(N >= 0 && C > 0, "N=%d C=%d", N, C);
    BK_ASSERT(out && rstd && x && scale);
    for (int n = 0; n < N; n++) {
        const float *xr = x + (size_t)n * C;
        float *yr = out + (size_t)n * C;
        double ss = 0.0;
        for (int c = 0; c < C; c++) ss += (double)xr[c] * xr[c];
        float r = (float)(1.0 / sqrt(ss / C + (double)eps));
        rstd[n] = r;
        for (int c = 0; c < C; c++) yr[c] = xr[c] * r * scale[c];
    }
}

void bk_rmsnorm_bwd(float *dx, float *dscale, const float *dout, const float *x, const float *rstd, const float *scale,
                    int N, int C)
{
    BK_ASSERTF(N >= 0 && C > 0, "N=%d C=%d", N, C);
    BK_ASSERT(dx && dscale && dout && x && rstd && scale);
    double *ds = bk_xmalloc((size_t)C * sizeof *ds); // column sums in double: N may be large
    for (int c = 0; c < C; c++) ds[c] = 0.0;
    for (int n = 0; n < N; n++) {
        const float *xr = x + (size_t)n * C, *gr = dout + (size_t)n * C;
        float *dxr = dx + (size_t)n * C;
        double r = rstd[n], dot = 0.0;
        for (int c = 0; c < C; c++) {
            dot += (double)gr[c] * scale[c] * xr[c];
            ds[c] += (double)gr[c] * xr[c] * r;
        }
        float a = (float)r, b = (float)(r * r * r * dot / C);
        for (int c = 0; c < C; c++) dxr[c] += a * gr[c] * scale[c] - b * xr[c];
    }
    for (int c = 0; c < C; c++) dscale[c] += (float)ds[c];
    free(ds);
}

void bk_rmsnorm_fwd_ref(float *out, float *rstd, const float *x, const float *scale, int N, int C, float eps)
{
    for (int n = 0; n < N; n++) {
        double ss = 0.0;
        for (int c = 0; c < C; c++) ss += (double)x[n * C + c] * x[n * C + c];
        double r = 1.0 / sqrt(ss / C + eps);
        rstd[n] = (float)r;
        for (int c = 0; c < C; c++) out[n * C + c] = (float)(x[n * C + c] * r * scale[c]);
    }
}

void bk_rmsnorm_bwd_ref(float *dx, float *dscale, const float *dout, const float *x, const float *rstd,
                        const float *scale, int N, int C)
{
    for (int c = 0; c < C; c++) {
        double s = 0.0;
        for (int n = 0; n < N; n++) s += (double)dout[n * C + c] * x[n * C + c] * rstd[n];
        dscale[c] += (float)s;
    }
    for (int n = 0; n < N; n++) {
        double r = rstd[n], dot = 0.0;
        for (int c = 0; c < C; c++) dot += (double)dout[n * C + c] * scale[c] * x[n * C + c];
        for (int c = 0; c < C; c++)
            dx[n * C + c] += (float)(r * dout[n * C + c] * scale[c] - r * r * r * dot / C * x[n * C + c]);
    }
}
