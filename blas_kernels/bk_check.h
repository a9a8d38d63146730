/* bk_check.h — header-only helpers for checking kernels: a deterministic RNG, error norms and a
 * central finite-difference gradient. Used by the bk tests (and usable by higher layers' tests);
 * nothing here is linked into the library.
 * The RNG is splitmix64: explicit state passed by pointer, identical streams on every machine.
 */
#ifndef BK_CHECK_H
#define BK_CHECK_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>

typedef struct {
    uint64_t s; // splitmix64 state; any seed is fine
} bk_rng;

static inline uint64_t bk_rng_u64(bk_rng *r)
{
    uint64_t z = (r->s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* uniform in [0, 1) with 53 random bits */
static inline double bk_rng_unit(bk_rng *r) { return (double)(bk_rng_u64(r) >> 11) * 0x1.0p-53; }

static inline float bk_rng_uniform(bk_rng *r, float lo, float hi) { return (float)(lo + (hi - lo) * bk_rng_unit(r)); }

/* uniform integer in [0, n) (n > 0; the modulo bias is irrelevant for tests) */
static inline int bk_rng_int(bk_rng *r, int n) { return (int)(bk_rng_u64(r) % (uint64_t)n); }

static inline void bk_rng_fill(bk_rng *r, float *x, size_t n, float lo, float hi)
{
    for (size_t i = 0; i < n; i++) x[i] = bk_rng_uniform(r, lo, hi);
}

/* ||a - b||_2 / ||b||_2 in double (||b|| floored at 1e-30 so an all-zero b compares absolutely). */
static inline double bk_rel_err(const float *a, const float *b, size_t n)
{
    double num = 0.0, den = 0.0;
    for (size_t i = 0; i < n; i++) {
        double d = (double)a[i] - b[i];
        num += d * d;
        den += (double)b[i] * b[i];
    }
    return sqrt(num) / fmax(sqrt(den), 1e-30);
}

/* same, analytic float gradient a against a double reference b */
static inline double bk_rel_err_fd(const float *a, const double *b, size_t n)
{
    double num = 0.0, den = 0.0;
    for (size_t i = 0; i < n; i++) {
        double d = (double)a[i] - b[i];
        num += d * d;
        den += b[i] * b[i];
    }
    return sqrt(num) / fmax(sqrt(den), 1e-30);
}

static inline double bk_max_abs_diff(const float *a, const float *b, size_t n)
{
    double m = 0.0;
    for (size_t i = 0; i < n; i++) m = fmax(m, fabs((double)a[i] - b[i]));
    return m;
}

/* sum_i w[i] * y[i] in double: the scalar loss whose gradient w.r.t. y is w */
static inline double bk_dot_d(const float *w, const float *y, size_t n)
{
    double s = 0.0;
    for (size_t i = 0; i < n; i++) s += (double)w[i] * y[i];
    return s;
}

/* Central finite differences of loss(ctx) w.r.t. the n floats of param, into grad (double).
 * The step actually taken is measured after rounding to float ((float)(x+eps) - x, exact in
 * double), so float rounding of the perturbed input does not bias the quotient. */
static inline void bk_fd_grad(double (*loss)(void *ctx), void *ctx, float *param, size_t n, double eps, double *grad)
{
    for (size_t i = 0; i < n; i++) {
        float x0 = param[i];
        float xp = (float)(x0 + eps), xm = (float)(x0 - eps);
        param[i] = xp;
        double lp = loss(ctx);
        param[i] = xm;
        double lm = loss(ctx);
        param[i] = x0;
        grad[i] = (lp - lm) / ((double)xp - (double)xm);
    }
}

#endif /* BK_CHECK_H */
