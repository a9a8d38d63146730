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

void ref_project(int64_t E, const double *x, const float *w, int64_t nh, int64_t h0, int64_t n, int64_t D, double *p)
{
    for (int64_t h = 0; h < n; h++)
        for (int64_t d = 0; d < D; d++) {
            double s = 0;
            for (int64_t e = 0; e < E; e++) s += x[e] * w[(e * nh + h0 + h) * D + d];
            p[h * D + d] = s;
        }
}

void ref_out_proj(int64_t N, int64_t HD, int64_t E, const double *o, const float *wo, double *y)
{
    for (int64_t n = 0; n < N; n++)
        for (int64_t e = 0; e < E; e++) {
            double s = 0;
            for (int64_t hd = 0; hd < HD; hd++) s += o[n * HD + hd] * wo[hd * E + e];
            y[n * E + e] = s;
        }
}

void ref_rope(double *v, int64_t n, int64_t D, int64_t pos, double min_ts, double max_ts)
{
    int64_t half = D / 2;
    for (int64_t h = 0; h < n; h++) {
        double *x = v + h * D;
        for (int64_t i = 0; i < half; i++) {
            double ts = min_ts * pow(max_ts / min_ts, 2.0 * (double)i / (double)D);
            double ang = (double)pos / ts, re = x[i], im = x[i + half];
            x[i] = re * cos(ang) - im * sin(ang);
            x[i + half] = re * sin(ang) + im * cos(ang);
        }
    }
}

void ref_causal_attention(int64_t B, int64_t T, int64_t H, int64_t K, int64_t Dqk, int64_t Dv, const double *q,
                          const double *k, const double *v, double scale, double *o)
{
    double *p = calloc((size_t)T, sizeof *p);
    SIM_ASSERT(p);
    for (int64_t b = 0; b < B; b++)
        for (int64_t t = 0; t < T; t++)
            for (int64_t h = 0; h < H; h++) {
                int64_t kv = h / (H / K);
                const double *qq = q + ((b * T + t) * H + h) * Dqk;
                double mx = -INFINITY, z = 0;
                for (int64_t s = 0; s <= t; s++) {
                    const double *kk = k + ((b * T + s) * K + kv) * Dqk;
                    double dot = 0;
                    for (int64_t d = 0; d < Dqk; d++) dot += qq[d] * kk[d];
                    p[s] = scale * dot;
                    mx = fmax(mx, p[s]);
                }
                for (int64_t s = 0; s <= t; s++) z += (p[s] = exp(p[s] - mx));
                for (int64_t d = 0; d < Dv; d++) {
                    double acc = 0;
                    for (int64_t s = 0; s <= t; s++) acc += p[s] / z * v[((b * T + s) * K + kv) * Dv + d];
                    o[((b * T + t) * H + h) * Dv + d] = acc;
                }
            }
    free(p);
}

void ref_attention_fwd(const ref_attention *a, int64_t B, int64_t T, const double *x, double *y)
{
    int64_t E = a->E, H = a->H, K = a->K, D = a->D, N = B * T;
    double *q = calloc((size_t)(N * H * D), sizeof *q), *k = calloc((size_t)(N * K * D), sizeof *k);
    double *v = calloc((size_t)(N * K * D), sizeof *v), *o = calloc((size_t)(N * H * D), sizeof *o);
    SIM_ASSERT(q && k && v && o);
    for (int64_t n = 0; n < N; n++) {
        const double *xn = x + n * E;
        double *qn = q + n * H * D, *kn = k + n * K * D;
        if (a->wqkv) {
            ref_project(E, xn, a->wqkv, H + 2 * K, 0, H, D, qn);
            ref_project(E, xn, a->wqkv, H + 2 * K, H, K, D, kn);
            ref_project(E, xn, a->wqkv, H + 2 * K, H + K, K, D, v + n * K * D);
        } else {
            ref_project(E, xn, a->wq, H, 0, H, D, qn);
            ref_project(E, xn, a->wk, K, 0, K, D, kn);
            ref_project(E, xn, a->wv, K, 0, K, D, v + n * K * D);
        }
        if (a->qn) ref_rmsnorm(H, D, qn, a->qn, a->eps, qn);
        if (a->kn) ref_rmsnorm(K, D, kn, a->kn, a->eps, kn);
        ref_rope(qn, H, D, n % T, a->min_ts, a->max_ts);
        ref_rope(kn, K, D, n % T, a->min_ts, a->max_ts);
    }
    ref_causal_attention(B, T, H, K, D, D, q, k, v, a->scale, o);
    ref_out_proj(N, H * D, E, o, a->wo, y);
    free(q);
    free(k);
    free(v);
    free(o);
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
            h[f] =
                (m->gelu ? g * 0.5 * (1 + tanh(sqrt(2 / M_PI) * (g + 0.044715 * g * g * g))) : g / (1 + exp(-g))) * u;
        }
        for (int64_t e = 0; e < E; e++) {
            double s = 0;
            for (int64_t f = 0; f < F; f++) s += h[f] * m->wo[f * E + e];
            y[n * E + e] = s;
        }
    }
    free(h);
}

void ref_dense_layer_fwd(const ref_dense_layer *L, int64_t B, int64_t T, const double *x, double *y)
{
    int64_t n = B * T * L->a.E;
    double *t = malloc((size_t)n * sizeof *t), *u = malloc((size_t)n * sizeof *u);
    SIM_ASSERT(t && u);
    ref_rmsnorm(B * T, L->a.E, x, L->ln1, L->eps, t);
    ref_attention_fwd(&L->a, B, T, t, u);
    for (int64_t i = 0; i < n; i++) u[i] += x[i]; /* h */
    ref_rmsnorm(B * T, L->a.E, u, L->ln2, L->eps, t);
    ref_mlp_fwd(&L->m, B * T, t, y);
    for (int64_t i = 0; i < n; i++) y[i] += u[i];
    free(t);
    free(u);
}
