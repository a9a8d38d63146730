/* block_ref.c — test support: float64 references of the dense blocks (see block_ref.h). */
#include "tests/block_ref.h"

#include <math.h>
#include <stdlib.h>

#include "sim/status.h"

void ref_rmsnorm(int64_t N, int64_t E, const double *x, const float *g, double eps, double *y)
{
    for (int64_t n = 0; n < N; n++) {
        double ms = 0;
        for (int64_t e = 0; e < E; e++) ms += x[n * E + e] * x[n * E + e];
        double inv = 1 / sqrt(ms / (double)E + eps);
        for (int64_t e = 0; e < E; e++) y[n * E + e] = x[n * E + e] * inv * (g ? g[e] : 1.0);
    }
}

/* Token x (E) through kernel w (E, nh, D) at heads [h0, h0 + n) -> p (n, D). */
static void project(const ref_attention *a, const double *x, const float *w, int64_t nh, int64_t h0, int64_t n,
                    double *p)
{
    for (int64_t h = 0; h < n; h++)
        for (int64_t d = 0; d < a->D; d++) {
            double s = 0;
            for (int64_t e = 0; e < a->E; e++) s += x[e] * w[(e * nh + h0 + h) * a->D + d];
            p[h * a->D + d] = s;
        }
}

/* The optional norm, then the RoPE at position pos, on each of n heads of D. */
static void norm_rope(const ref_attention *a, double *v, int64_t n, const float *g, int64_t pos)
{
    int64_t D = a->D, half = D / 2;
    if (g) ref_rmsnorm(n, D, v, g, a->eps, v);
    for (int64_t h = 0; h < n; h++) {
        double *x = v + h * D;
        for (int64_t i = 0; i < half; i++) {
            double ts = a->min_ts * pow(a->max_ts / a->min_ts, 2.0 * (double)i / (double)D);
            double ang = (double)pos / ts, re = x[i], im = x[i + half];
            x[i] = re * cos(ang) - im * sin(ang);
            x[i + half] = re * sin(ang) + im * cos(ang);
        }
    }
}

void ref_attention_fwd(const ref_attention *a, int64_t B, int64_t T, const double *x, double *y)
{
    int64_t E = a->E, H = a->H, K = a->K, D = a->D, N = B * T;
    double *q = calloc((size_t)(N * H * D), sizeof *q), *k = calloc((size_t)(N * K * D), sizeof *k);
    double *v = calloc((size_t)(N * K * D), sizeof *v), *o = calloc((size_t)(H * D), sizeof *o);
    double *p = calloc((size_t)T, sizeof *p);
    SIM_ASSERT(q && k && v && o && p);
    for (int64_t n = 0; n < N; n++) {
        const double *xn = x + n * E;
        if (a->wqkv) {
            project(a, xn, a->wqkv, H + 2 * K, 0, H, q + n * H * D);
            project(a, xn, a->wqkv, H + 2 * K, H, K, k + n * K * D);
            project(a, xn, a->wqkv, H + 2 * K, H + K, K, v + n * K * D);
        } else {
            project(a, xn, a->wq, H, 0, H, q + n * H * D);
            project(a, xn, a->wk, K, 0, K, k + n * K * D);
            project(a, xn, a->wv, K, 0, K, v + n * K * D);
        }
        norm_rope(a, q + n * H * D, H, a->qn, n % T);
        norm_rope(a, k + n * K * D, K, a->kn, n % T);
    }
    for (int64_t b = 0; b < B; b++)
        for (int64_t t = 0; t < T; t++) {
            for (int64_t h = 0; h < H; h++) {
                int64_t kv = h / (H / K);
                const double *qq = q + ((b * T + t) * H + h) * D;
                double mx = -INFINITY, z = 0;
                for (int64_t s = 0; s <= t; s++) {
                    const double *kk = k + ((b * T + s) * K + kv) * D;
                    double dot = 0;
                    for (int64_t d = 0; d < D; d++) dot += qq[d] * kk[d];
                    p[s] = a->scale * dot;
                    mx = fmax(mx, p[s]);
                }
                for (int64_t s = 0; s <= t; s++) z += (p[s] = exp(p[s] - mx));
                for (int64_t d = 0; d < D; d++) {
                    double acc = 0;
                    for (int64_t s = 0; s <= t; s++) acc += p[s] / z * v[((b * T + s) * K + kv) * D + d];
                    o[h * D + d] = acc;
                }
            }
            for (int64_t e = 0; e < E; e++) {
                double s = 0;
                for (int64_t hd = 0; hd < H * D; hd++) s += o[hd] * a->wo[hd * E + e];
                y[(b * T + t) * E + e] = s;
            }
        }
    free(q);
    free(k);
    free(v);
    free(o);
    free(p);
}

void ref_mlp_fwd(const ref_mlp *m, int64_t N, const double *x, double *y)
{
    int64_t E = m->E, F = m->F;
    double *h = malloc((size_t)F * sizeof *h);
    SIM_ASSERT(h);
    for (int64_t n = 0; n < N; n++) {
        const double *xn = x + n * E;
        for (int64_t f = 0; f < F; f++) {
            double g = 0, u = 0;
            for (int64_t e = 0; e < E; e++) {
                g += xn[e] * (m->wi ? m->wi[(e * 2 + 0) * F + f] : m->wi0[e * F + f]);
                u += xn[e] * (m->wi ? m->wi[(e * 2 + 1) * F + f] : m->wi1[e * F + f]);
            }
            h[f] = g / (1 + exp(-g)) * u;
        }
        for (int64_t e = 0; e < E; e++) {
            double s = 0;
            for (int64_t f = 0; f < F; f++) s += h[f] * m->wo[f * E + e];
            y[n * E + e] = s;
        }
    }
    free(h);
}

double ref_dot(int64_t n, const float *c, const double *y)
{
    double s = 0;
    for (int64_t i = 0; i < n; i++) s += (double)c[i] * y[i];
    return s;
}

double *ref_widen(int64_t n, const float *x)
{
    double *d = malloc((size_t)n * sizeof *d);
    SIM_ASSERT(d);
    for (int64_t i = 0; i < n; i++) d[i] = x[i];
    return d;
}

void ref_compare(int64_t n, const float *a, const double *b, double *worst, double *big)
{
    *worst = *big = 0;
    for (int64_t i = 0; i < n; i++) {
        *worst = fmax(*worst, fabs(a[i] - b[i]));
        *big = fmax(*big, fabs(b[i]));
    }
}
