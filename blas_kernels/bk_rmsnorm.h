/* bk_rmsnorm.h — RMSNorm over the last dim (MaxText/T5 style, no bias, no mean subtraction):
 * y = x * rstd * scale, rstd = 1 / sqrt(mean(x^2) + eps), mean and rstd computed in double.
 * Forward saves rstd per row for the backward.
 */
#ifndef BK_RMSNORM_H
#define BK_RMSNORM_H

void bk_rmsnorm_fwd(float *out,         // (N, C)
                    float *rstd,        // (N) saved for bwd
                    const float *x,     // (N, C)
                    const float *scale, // (C)
                    int N, int C, float eps);
/* dx += d/dx, dscale += d/dscale (dscale summed over rows in double, then added). */
void bk_rmsnorm_bwd(float *dx,          // (N, C)
                    float *dscale,      // (C)
                    const float *dout,  // (N, C)
                    const float *x,     // (N, C)
                    const float *rstd,  // (N)
                    const float *scale, // (C)
                    int N, int C);
void bk_rmsnorm_fwd_ref(float *out, float *rstd, const float *x, const float *scale, int N, int C, float eps);
void bk_rmsnorm_bwd_ref(float *dx, float *dscale, const float *dout, const float *x, const float *rstd,
                        const float *scale, int N, int C);

#endif /* BK_RMSNORM_H */
