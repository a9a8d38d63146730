/* bk_topk.c — top-k by insertion into a sorted list of the k best so far (MoE routing has
 * k <= 8 of E <= 256 experts, so this beats sorting); large k sorts an index array. */
#include "blas_kernels/bk_topk.h"

#include <math.h>

#include "blas_kernels/bk.h"

/* does (a, ia) rank before (b, ib)? larger value first, NaN largest, then lower index */
static inline int ranks_before(float a, int ia, float b, int ib)
{
    int na = isnan(a), nb = isnan(b);
    if (na != nb) return na;
    if (!na && a != b) return a > b;
    return ia < ib;
}

/* qsort has no context argument: the row being sorted, per thread (devices are threads) */
static _Thread_local const float *sort_row;
static int cmp_idx(const void *pa, const void *pb)
{
    int a = *(const int32_t *)pa, b = *(const int32_t *)pb;
    if (a == b) return 0;
    return ranks_before(sort_row[a], a, sort_row[b], b) ? -1 : 1;
}

void bk_topk_fwd(float *vals, int32_t *idx, const float *x, int N, int E, int k)
{
    BK_ASSERTF(N >= 0 && E > 0 && k > 0 && k <= E, "N=%d E=%d k=%d (need 0 < k <= E)", N, E, k);
    int32_t *perm = k > 32 ? bk_xmalloc((size_t)E * sizeof *perm) : NULL;
    for (int n = 0; n < N; n++) {
        const float *r = x + (size_t)n * E;
        float *bv = vals + (size_t)n * k;
        int32_t *bi = idx + (size_t)n * k;
        if (perm) {
            for (int j = 0; j < E; j++) perm[j] = j;
            sort_row = r;
            qsort(perm, (size_t)E, sizeof *perm, cmp_idx);
            for (int s = 0; s < k; s++) bi[s] = perm[s], bv[s] = r[perm[s]];
            continue;
        }
        int cnt = 0;
        for (int j = 0; j < E; j++) {
            float v = r[j];
            if (cnt == k && !ranks_before(v, j, bv[k - 1], bi[k - 1])) continue;
            int p = cnt < k ? cnt : k - 1; // slot freed at the end (or dropped last)
            /* j is larger than every stored index, so equal values stay ahead of it */
            while (p > 0 && ranks_before(v, j, bv[p - 1], bi[p - 1])) {
                bv[p] = bv[p - 1], bi[p] = bi[p - 1];
                p--;
            }
            bv[p] = v, bi[p] = j;
            if (cnt < k) cnt++;
        }
    }
    free(perm);
}

void bk_topk_bwd(float *dx, const float *dvals, const int32_t *idx, int N, int E, int k)
{
    BK_ASSERTF(N >= 0 && E > 0 && k > 0 && k <= E, "N=%d E=%d k=%d", N, E, k);
    for (int n = 0; n < N; n++)
        for (int s = 0; s < k; s++) {
            int32_t j = idx[(size_t)n * k + s];
            BK_ASSERTF(j >= 0 && j < E, "idx[%d, %d]=%d outside [0, %d)", n, s, (int)j, E);
            dx[(size_t)n * E + j] += dvals[(size_t)n * k + s];
        }
}

/* selection: slot s takes the best not-yet-taken element, scanning every index */
void bk_topk_fwd_ref(float *vals, int32_t *idx, const float *x, int N, int E, int k)
{
    BK_ASSERT(k > 0 && k <= E);
    char *taken = bk_xmalloc((size_t)E);
    for (int n = 0; n < N; n++) {
        const float *r = x + (size_t)n * E;
        for (int j = 0; j < E; j++) taken[j] = 0;
        for (int s = 0; s < k; s++) {
            int best = -1;
            for (int j = 0; j < E; j++)
                if (!taken[j] && (best < 0 || ranks_before(r[j], j, r[best], best))) best = j;
            taken[best] = 1;
            idx[(size_t)n * k + s] = best;
            vals[(size_t)n * k + s] = r[best];
        }
    }
    free(taken);
}
