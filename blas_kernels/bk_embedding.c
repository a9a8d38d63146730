/* bk_embedding.c — gather / scatter-add of table rows. */
#include "blas_kernels/bk_embedding.h"

#include <string.h>

#include "blas_kernels/bk.h"
#include "blas_kernels/bk_parallel.h"

static void check(int N, int C, int V_local)
{
    BK_ASSERTF(N >= 0 && C > 0 && V_local >= 0, "N=%d C=%d V_local=%d", N, C, V_local);
}

/* Both directions run on the kernel pool.  The lookup's tokens are independent.  The scatter-add
 * is cut by destination table rows, not by tokens: each chunk owns rows [r0, r1) and walks every
 * token in order, so a row receives its tokens' rows in token order whatever the thread count. */
enum { EMB_GRAIN = 1 << 16 }; /* floats per chunk */

typedef struct {
    float *out;
    const float *in;
    const int32_t *ids;
    int N, C, v_lo, V_local, zero;
} emb_job;

static int64_t grain_rows(int C) { return (EMB_GRAIN + C - 1) / C; }

static void fwd_tokens(int64_t lo, int64_t hi, void *arg)
{
    const emb_job *J = arg;
    const int C = J->C;
    for (int64_t n = lo; n < hi; n++) {
        long long r = (long long)J->ids[n] - J->v_lo;
        float *o = J->out + (size_t)n * C;
        if (r >= 0 && r < J->V_local) memcpy(o, J->in + (size_t)r * C, (size_t)C * sizeof *o);
        else memset(o, 0, (size_t)C * sizeof *o);
    }
}

static void bwd_rows(int64_t r0, int64_t r1, void *arg)
{
    const emb_job *J = arg;
    const int C = J->C;
    if (J->zero) memset(J->out + (size_t)r0 * C, 0, (size_t)(r1 - r0) * C * sizeof(float));
    for (int n = 0; n < J->N; n++) { // token order: repeated ids always sum in the same order
        long long r = (long long)J->ids[n] - J->v_lo;
        if (r < r0 || r >= r1) continue;
        float *d = J->out + (size_t)r * C;
        const float *g = J->in + (size_t)n * C;
        for (int c = 0; c < C; c++) d[c] += g[c];
    }
}

void bk_embedding_fwd(float *out, const int32_t *ids, const float *table, int N, int C, int v_lo, int V_local)
{
    check(N, C, V_local);
    emb_job J = {out, table, ids, N, C, v_lo, V_local, 0};
    bk_parallel_for(N, grain_rows(C), fwd_tokens, &J);
}

static void embedding_bwd(float *dtable, const float *dout, const int32_t *ids, int N, int C, int v_lo, int V_local,
                          int zero)
{
    check(N, C, V_local);
    emb_job J = {dtable, dout, ids, N, C, v_lo, V_local, zero};
    bk_parallel_for(V_local, grain_rows(C), bwd_rows, &J);
}

void bk_embedding_bwd(float *dtable, const float *dout, const int32_t *ids, int N, int C, int v_lo, int V_local)
{
    embedding_bwd(dtable, dout, ids, N, C, v_lo, V_local, 0);
}

void bk_embedding_bwd_zero(float *dtable, const float *dout, const int32_t *ids, int N, int C, int v_lo, int V_local)
{
    embedding_bwd(dtable, dout, ids, N, C, v_lo, V_local, 1);
}

void bk_embedding_fwd_ref(float *out, const int32_t *ids, const float *table, int N, int C, int v_lo, int V_local)
{
    for (int n = 0; n < N; n++)
        for (int c = 0; c < C; c++) {
            int in_range = ids[n] >= v_lo && ids[n] < v_lo + V_local;
            out[(size_t)n * C + c] = in_range ? table[(size_t)(ids[n] - v_lo) * C + c] : 0.0f;
        }
}

/* per table row, the sum over every token with that id, in double */
void bk_embedding_bwd_ref(float *dtable, const float *dout, const int32_t *ids, int N, int C, int v_lo, int V_local)
{
    for (int r = 0; r < V_local; r++)
        for (int c = 0; c < C; c++) {
            double s = 0.0;
            for (int n = 0; n < N; n++)
                if (ids[n] == v_lo + r) s += dout[(size_t)n * C + c];
            dtable[(size_t)r * C + c] += (float)s;
        }
}
