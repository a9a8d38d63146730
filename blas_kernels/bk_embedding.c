/* bk_embedding.c — gather / scatter-add of table rows. */
#include "blas_kernels/bk_embedding.h"

#include <string.h>

#include "blas_kernels/bk.h"

static void check(int N, int C, int V_local) {
  BK_ASSERTF(N >= 0 && C > 0 && V_local >= 0, "N=%d C=%d V_local=%d", N, C, V_local);
}

void bk_embedding_fwd(float *out, const int32_t *ids, const float *table, int N, int C, int v_lo,
                      int V_local) {
  check(N, C, V_local);
  for (int n = 0; n < N; n++) {
    long long r = (long long)ids[n] - v_lo;
    float *o = out + (size_t)n * C;
    if (r >= 0 && r < V_local)
      memcpy(o, table + (size_t)r * C, (size_t)C * sizeof *o);
    else
      memset(o, 0, (size_t)C * sizeof *o);
  }
}

void bk_embedding_bwd(float *dtable, const float *dout, const int32_t *ids, int N, int C, int v_lo,
                      int V_local) {
  check(N, C, V_local);
  for (int n = 0; n < N; n++) {  // token order: repeated ids always sum in the same order
    long long r = (long long)ids[n] - v_lo;
    if (r < 0 || r >= V_local) continue;
    float *d = dtable + (size_t)r * C;
    const float *g = dout + (size_t)n * C;
    for (int c = 0; c < C; c++) d[c] += g[c];
  }
}

void bk_embedding_fwd_ref(float *out, const int32_t *ids, const float *table, int N, int C,
                          int v_lo, int V_local) {
  for (int n = 0; n < N; n++)
    for (int c = 0; c < C; c++) {
      int in_range = ids[n] >= v_lo && ids[n] < v_lo + V_local;
      out[(size_t)n * C + c] = in_range ? table[(size_t)(ids[n] - v_lo) * C + c] : 0.0f;
    }
}

/* per table row, the sum over every token with that id, in double */
void bk_embedding_bwd_ref(float *dtable, const float *dout, const int32_t *ids, int N, int C,
                          int v_lo, int V_local) {
  for (int r = 0; r < V_local; r++)
    for (int c = 0; c < C; c++) {
      double s = 0.0;
      for (int n = 0; n < N; n++)
        if (ids[n] == v_lo + r) s += dout[(size_t)n * C + c];
      dtable[(size_t)r * C + c] += (float)s;
    }
}
