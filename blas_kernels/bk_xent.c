/* bk_xent.c — cross-entropy with z-loss; the full kernel is the vocab-sharded composition run
 * with one shard, so the two can never drift apart. */
#include "blas_kernels/bk_xent.h"

#include <math.h>

#include "blas_kernels/bk.h"
#include "blas_kernels/bk_math.h"
#include "blas_kernels/bk_parallel.h"

/* Rows are independent: the row loops run in chunks of XENT_GRAIN rows on the kernel pool, each
 * row computed as on one thread.  The exponentials are bk_expf (vectorised, about 1 ulp; libm's
 * expf was a call per logit), and a row's sum of them runs in XENT_LANES double lanes, each
 * summing every XENT_LANES-th term in order, then the lanes in order: the same bits from every
 * clone and thread count. */
enum { XENT_GRAIN = 16, XENT_LANES = 16 };

typedef struct {
    float *out, *dlogits;
    const float *logits, *m, *dloss, *lse;
    const int32_t *targets;
    int V_local, v_lo;
    float z_loss;
    int set; /* backward: write dlogits instead of adding to it */
} xent_job;

BK_CLONES static void row_max_chunk(int64_t lo, int64_t hi, void *arg)
{
    const xent_job *J = arg;
    for (int64_t n = lo; n < hi; n++) {
        const int V = J->V_local, body = V - V % XENT_LANES;
        const float *x = J->logits + (size_t)n * V;
        float lane[XENT_LANES]; // a max is exact: lanes give the value a single pass gives
        for (int l = 0; l < XENT_LANES; l++) lane[l] = -INFINITY;
        for (int j = 0; j < body; j += XENT_LANES)
            for (int l = 0; l < XENT_LANES; l++) lane[l] = x[j + l] > lane[l] ? x[j + l] : lane[l];
        for (int j = body; j < V; j++) lane[j - body] = x[j] > lane[j - body] ? x[j] : lane[j - body];
        float mx = -INFINITY; // an empty shard contributes -inf to the max all-reduce
        for (int l = 0; l < XENT_LANES; l++) mx = lane[l] > mx ? lane[l] : mx;
        J->out[n] = mx;
    }
}

void bk_xent_row_max(float *m, const float *logits, int N, int V_local)
{
    BK_ASSERTF(N >= 0 && V_local >= 0, "N=%d V_local=%d", N, V_local);
    xent_job J = {m, NULL, logits, NULL, NULL, NULL, NULL, V_local, 0, 0.0f, 0};
    bk_parallel_for(N, XENT_GRAIN, row_max_chunk, &J);
}

BK_CLONES static void row_sumexp_chunk(int64_t lo, int64_t hi, void *arg)
{
    const xent_job *J = arg;
    const int V = J->V_local, body = V - V % XENT_LANES;
    for (int64_t n = lo; n < hi; n++) {
        const float *x = J->logits + (size_t)n * V;
        const float mn = J->m[n];
        BK_ASSERTF(isfinite(mn) || V == 0, "row %lld: max %g is not finite", (long long)n, (double)mn);
        double lane[XENT_LANES] = {0};
        for (int j = 0; j < body; j += XENT_LANES)
            for (int l = 0; l < XENT_LANES; l++) lane[l] += (double)bk_expf(x[j + l] - mn);
        for (int j = body; j < V; j++) lane[j - body] += (double)bk_expf(x[j] - mn);
        double acc = 0.0;
        for (int l = 0; l < XENT_LANES; l++) acc += lane[l];
        J->out[n] = (float)acc;
    }
}

void bk_xent_row_sumexp(float *s, const float *logits, const float *m, int N, int V_local)
{
    BK_ASSERTF(N >= 0 && V_local >= 0, "N=%d V_local=%d", N, V_local);
    xent_job J = {s, NULL, logits, m, NULL, NULL, NULL, V_local, 0, 0.0f, 0};
    bk_parallel_for(N, XENT_GRAIN, row_sumexp_chunk, &J);
}

void bk_xent_pick_target(float *t, const float *logits, const int32_t *targets, int N, int V_local, int v_lo)
{
    BK_ASSERTF(N >= 0 && V_local >= 0, "N=%d V_local=%d", N, V_local);
    for (int n = 0; n < N; n++) {
        long long j = (long long)targets[n] - v_lo;
        t[n] = (j >= 0 && j < V_local) ? logits[(size_t)n * V_local + j] : 0.0f;
    }
}

void bk_xent_combine(float *loss, float *lse, const float *m, const float *s, const float *t, int N, float z_loss)
{
    for (int n = 0; n < N; n++) {
        BK_ASSERTF(s[n] > 0.0f, "row %d: sum of exp %g must be positive", n, (double)s[n]);
        double l = (double)m[n] + log((double)s[n]);
        lse[n] = (float)l;
        loss[n] = (float)(l - t[n] + (double)z_loss * l * l);
    }
}

BK_CLONES static void bwd_local_chunk(int64_t lo, int64_t hi, void *arg)
{
    const xent_job *J = arg;
    const int V_local = J->V_local;
    for (int64_t n = lo; n < hi; n++) {
        const float *x = J->logits + (size_t)n * V_local;
        float *dx = J->dlogits + (size_t)n * V_local;
        const float L = J->lse[n], g = J->dloss[n];
        const float gp = (float)(g * (1.0 + 2.0 * (double)J->z_loss * L)); // d loss / d lse, times dloss
        if (J->set)
            for (int j = 0; j < V_local; j++) dx[j] = gp * bk_expf(x[j] - L);
        else
            for (int j = 0; j < V_local; j++) dx[j] += gp * bk_expf(x[j] - L);
        long long jt = (long long)J->targets[n] - J->v_lo;
        if (jt >= 0 && jt < V_local) dx[jt] -= g;
    }
}

void bk_xent_bwd_local(float *dlogits, const float *dloss, const float *logits, const float *lse,
                       const int32_t *targets, int N, int V_local, int v_lo, float z_loss)
{
    BK_ASSERTF(N >= 0 && V_local >= 0, "N=%d V_local=%d", N, V_local);
    xent_job J = {NULL, dlogits, logits, NULL, dloss, lse, targets, V_local, v_lo, z_loss, 0};
    bk_parallel_for(N, XENT_GRAIN, bwd_local_chunk, &J);
}

void bk_xent_bwd_local_into(float *dlogits, const float *dloss, const float *logits, const float *lse,
                            const int32_t *targets, int N, int V_local, int v_lo, float z_loss)
{
    BK_ASSERTF(N >= 0 && V_local >= 0, "N=%d V_local=%d", N, V_local);
    xent_job J = {NULL, dlogits, logits, NULL, dloss, lse, targets, V_local, v_lo, z_loss, 1};
    bk_parallel_for(N, XENT_GRAIN, bwd_local_chunk, &J);
}

void bk_xent_fwd(float *loss, float *lse, const float *logits, const int32_t *targets, int N, int V, float z_loss)
{
    BK_ASSERTF(N >= 0 && V > 0, "N=%d V=%d", N, V);
    for (int n = 0; n < N; n++)
        BK_ASSERTF(targets[n] >= 0 && targets[n] < V, "targets[%d]=%d outside [0, %d)", n, (int)targets[n], V);
    /* per row through the pieces, with the row's own m/s/t as one-element scratch */
    for (int n = 0; n < N; n++) {
        const float *x = logits + (size_t)n * V;
        float m, s, t;
        bk_xent_row_max(&m, x, 1, V);
        bk_xent_row_sumexp(&s, x, &m, 1, V);
        bk_xent_pick_target(&t, x, targets + n, 1, V, 0);
        bk_xent_combine(loss + n, lse + n, &m, &s, &t, 1, z_loss);
    }
}

void bk_xent_bwd(float *dlogits, const float *dloss, const float *logits, const float *lse, const int32_t *targets,
                 int N, int V, float z_loss)
{
    BK_ASSERTF(N >= 0 && V > 0, "N=%d V=%d", N, V);
    for (int n = 0; n < N; n++)
        BK_ASSERTF(targets[n] >= 0 && targets[n] < V, "targets[%d]=%d outside [0, %d)", n, (int)targets[n], V);
    bk_xent_bwd_local(dlogits, dloss, logits, lse, targets, N, V, 0, z_loss);
}

void bk_xent_fwd_ref(float *loss, float *lse, const float *logits, const int32_t *targets, int N, int V, float z_loss)
{
    for (int n = 0; n < N; n++) {
        double mx = -INFINITY, s = 0.0;
        for (int j = 0; j < V; j++) mx = fmax(mx, logits[(size_t)n * V + j]);
        for (int j = 0; j < V; j++) s += exp(logits[(size_t)n * V + j] - mx);
        double l = mx + log(s);
        lse[n] = (float)l;
        loss[n] = (float)(l - logits[(size_t)n * V + targets[n]] + z_loss * l * l);
    }
}

void bk_xent_bwd_ref(float *dlogits, const float *dloss, const float *logits, const float *lse, const int32_t *targets,
                     int N, int V, float z_loss)
{
    (void)lse; // recomputed in double
    for (int n = 0; n < N; n++) {
        double mx = -INFINITY, s = 0.0;
        for (int j = 0; j < V; j++) mx = fmax(mx, logits[(size_t)n * V + j]);
        for (int j = 0; j < V; j++) s += exp(logits[(size_t)n * V + j] - mx);
        double l = mx + log(s);
        for (int j = 0; j < V; j++) {
            double p = exp(logits[(size_t)n * V + j] - l);
            double g = p * (1.0 + 2.0 * z_loss * l) - (j == targets[n] ? 1.0 : 0.0);
            dlogits[(size_t)n * V + j] += (float)(dloss[n] * g);
        }
    }
}
