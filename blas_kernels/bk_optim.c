/* bk_optim.c — optimizer kernels (see bk_optim.h).
 *
 * The AdamW pass reads x, g, mu, nu once and writes x, mu, nu once (28 bytes per element),
 * so it is bound by memory bandwidth once it is vectorised: the loop bodies keep every
 * operand in a restrict local and the clipping test out of the loop (two loops), and
 * -fno-math-errno (Makefile) lets sqrtf become one instruction.  The float operations
 * and their order are optax's, unchanged by the vector width. */
#include "blas_kernels/bk_optim.h"

#include <math.h>
#include <stdint.h>

#include "blas_kernels/bk.h"
#include "blas_kernels/bk_parallel.h"

enum { ADAM_GRAIN = 1 << 15 }; /* elements per parallel chunk */

typedef struct {
    float *x, *mu, *nu;
    const float *g;
    const bk_adamw_hp *hp;
    double *partial; /* bk_sumsq: one sum per chunk */
    const float *in; /* bk_sumsq: the input */
} optim_job;

BK_CLONES static void adam_chunk(int64_t lo, int64_t hi, void *arg)
{
    const optim_job *J = arg;
    float *restrict x = J->x, *restrict mu = J->mu, *restrict nu = J->nu;
    const float *restrict g = J->g;
    const bk_adamw_hp h = *J->hp;
    if (h.clip) {
        for (int64_t i = lo; i < hi; i++) {
            float gi = (g[i] / h.gnorm) * h.thr;
            float mi = h.omb1 * gi + h.b1 * mu[i];
            float vi = h.omb2 * (gi * gi) + h.b2 * nu[i];
            mu[i] = mi;
            nu[i] = vi;
            float u = (mi / h.bc1) / (sqrtf(vi / h.bc2 + h.eps_root) + h.eps);
            u = u + h.wd * x[i];
            x[i] = x[i] + h.neg_lr * u;
        }
    } else {
        for (int64_t i = lo; i < hi; i++) {
            float gi = g[i];
            float mi = h.omb1 * gi + h.b1 * mu[i];
            float vi = h.omb2 * (gi * gi) + h.b2 * nu[i];
            mu[i] = mi;
            nu[i] = vi;
            float u = (mi / h.bc1) / (sqrtf(vi / h.bc2 + h.eps_root) + h.eps);
            u = u + h.wd * x[i];
            x[i] = x[i] + h.neg_lr * u;
        }
    }
}

void bk_adamw_update(float *x, float *mu, float *nu, const float *g, size_t n, const bk_adamw_hp *hp)
{
    BK_ASSERT(hp && (n == 0 || (x && mu && nu && g)));
    optim_job J = {x, mu, nu, g, hp, NULL, NULL};
    bk_parallel_for((int64_t)n, ADAM_GRAIN, adam_chunk, &J); /* elementwise: chunks are independent */
}

void bk_adamw_update_ref(float *x, float *mu, float *nu, const float *g, size_t n, const bk_adamw_hp *hp)
{
    for (size_t i = 0; i < n; i++) {
        float gi = hp->clip ? (g[i] / hp->gnorm) * hp->thr : g[i];
        mu[i] = hp->omb1 * gi + hp->b1 * mu[i];
        nu[i] = hp->omb2 * (gi * gi) + hp->b2 * nu[i];
        float u = (mu[i] / hp->bc1) / (sqrtf(nu[i] / hp->bc2 + hp->eps_root) + hp->eps) + hp->wd * x[i];
        x[i] += hp->neg_lr * u;
    }
}

BK_CLONES static void sgd_chunk(int64_t lo, int64_t hi, void *arg)
{
    const optim_job *J = arg;
    float *restrict x = J->x;
    const float *restrict g = J->g;
    const bk_adamw_hp h = *J->hp;
    if (h.clip)
        for (int64_t i = lo; i < hi; i++) x[i] = x[i] + h.neg_lr * ((g[i] / h.gnorm) * h.thr);
    else
        for (int64_t i = lo; i < hi; i++) x[i] = x[i] + h.neg_lr * g[i];
}

void bk_sgd_update(float *x, const float *g, size_t n, const bk_adamw_hp *hp)
{
    BK_ASSERT(hp && (n == 0 || (x && g)));
    optim_job J = {x, NULL, NULL, g, hp, NULL, NULL};
    bk_parallel_for((int64_t)n, ADAM_GRAIN, sgd_chunk, &J);
}

/* Sum of squares of x[a, b): 8 interleaved lanes written out so the loop vectorises without
 * reassociating anything, the lanes added in order, then the last (b - a) % 8 in order. */
BK_CLONES static double lanes_sumsq(const float *restrict x, int64_t a, int64_t b)
{
    double lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = a;
    for (; i + 8 <= b; i += 8)
        for (int k = 0; k < 8; k++) lane[k] += (double)x[i + k] * (double)x[i + k];
    double s = 0.0;
    for (int k = 0; k < 8; k++) s += lane[k];
    for (; i < b; i++) s += (double)x[i] * (double)x[i];
    return s;
}

static void sumsq_chunk(int64_t lo, int64_t hi, void *arg)
{
    const optim_job *J = arg;
    for (int64_t c = lo; c < hi; c++) J->partial[c] = lanes_sumsq(J->in, c * BK_SUMSQ_GRAIN, (c + 1) * BK_SUMSQ_GRAIN);
}

double bk_sumsq(const float *x, size_t n)
{
    BK_ASSERT(n == 0 || x);
    size_t full = n / BK_SUMSQ_GRAIN; /* whole chunks on the pool, the tail here */
    double sum = 0.0;
    if (full > 0) {
        double *partial = bk_xmalloc(full * sizeof *partial);
        optim_job J = {NULL, NULL, NULL, NULL, NULL, partial, x};
        bk_parallel_for((int64_t)full, 1, sumsq_chunk, &J);
        for (size_t c = 0; c < full; c++) sum += partial[c];
        free(partial);
    }
    /* the tail in lanes too: a device's gradient shards at 64 devices are mostly tails, and a
   * plain double loop over them took 0.5% of a step's CPU */
    if (n > full * BK_SUMSQ_GRAIN) sum += lanes_sumsq(x, (int64_t)(full * BK_SUMSQ_GRAIN), (int64_t)n);
    return sum;
}

double bk_sumsq_ref(const float *x, size_t n)
{
    double s = 0.0;
    for (size_t i = 0; i < n; i++) s += (double)x[i] * x[i];
    return s;
}
