/* bk_math.h — exp for the elementwise kernels, written so that loops over it
 * vectorise (no libm call, no branch): Cody-Waite reduction x = n ln2 + r,
 * |r| <= ln2/2, a degree-6 minimax polynomial for e^r (Cephes' expf
 * coefficients, max error about 1 ulp over the float range), and 2^n built in
 * the exponent bits.  Below -87.3 (where e^x leaves the normal floats) the
 * result is exactly 0, as libm's underflow gives (so exp(-inf) = 0); above
 * 88.7 it saturates at ~3.3e38 (callers here only pass x <= 0). */
#ifndef BK_MATH_H
#define BK_MATH_H

#include <stdint.h>
#include <string.h>

static inline float bk_expf(float x_in)
{
    float x = x_in < -87.3f ? -87.3f : x_in > 88.7f ? 88.7f : x_in;
    /* n = round(x / ln2) by the 1.5 * 2^23 trick (round to nearest, vectorises) */
    float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    float e = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return x_in < -87.3f ? 0.0f : e * scale;
}

/* 1 / (1 + e^-x) without overflow, branch-free. */
static inline float bk_sigmoidf(float x)
{
    float e = bk_expf(x < 0.0f ? x : -x); /* e^-|x| <= 1 */
    float inv = 1.0f / (1.0f + e);
    return x >= 0.0f ? inv : e * inv;
}

#endif
