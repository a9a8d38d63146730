/* bk_gemm.c — sgemm wrappers (row-major), strided batched and grouped products.
 * Leading dimensions are checked here so a wrong one fails with the numbers instead of
 * OpenBLAS's terse xerbla message. */
#include "blas_kernels/bk_gemm.h"

#include <cblas.h>

#include "blas_kernels/bk.h"

static void check_dims(int trans_a, int trans_b, int M, int N, int K, const float *A, int lda,
                       const float *B, int ldb, const float *C, int ldc) {
  BK_ASSERTF(M >= 0 && N >= 0 && K >= 0, "M=%d N=%d K=%d", M, N, K);
  int a_cols = trans_a ? M : K, b_cols = trans_b ? K : N;
  BK_ASSERTF(lda >= (a_cols > 1 ? a_cols : 1), "lda=%d < %d columns of A", lda, a_cols);
  BK_ASSERTF(ldb >= (b_cols > 1 ? b_cols : 1), "ldb=%d < %d columns of B", ldb, b_cols);
  BK_ASSERTF(ldc >= (N > 1 ? N : 1), "ldc=%d < N=%d", ldc, N);
  BK_ASSERT(M == 0 || N == 0 || C != NULL);
  BK_ASSERT(M == 0 || N == 0 || K == 0 || (A != NULL && B != NULL));
}

void bk_gemm(int trans_a, int trans_b, int M, int N, int K, float alpha, const float *A, int lda,
             const float *B, int ldb, float beta, float *C, int ldc) {
  check_dims(trans_a, trans_b, M, N, K, A, lda, B, ldb, C, ldc);
  if (M == 0 || N == 0) return;
  if (K == 0) {  // sgemm handles it, but some builds read A/B anyway; be explicit
    for (int i = 0; i < M; i++)
      for (int j = 0; j < N; j++) C[(size_t)i * ldc + j] = beta == 0.0f ? 0.0f : beta * C[(size_t)i * ldc + j];
    return;
  }
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
              trans_b ? CblasTrans : CblasNoTrans, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

void bk_gemm_ref(int trans_a, int trans_b, int M, int N, int K, float alpha, const float *A,
                 int lda, const float *B, int ldb, float beta, float *C, int ldc) {
  check_dims(trans_a, trans_b, M, N, K, A, lda, B, ldb, C, ldc);
  for (int i = 0; i < M; i++) {
    for (int j = 0; j < N; j++) {
      double acc = 0.0;
      for (int p = 0; p < K; p++) {
        double a = trans_a ? A[(size_t)p * lda + i] : A[(size_t)i * lda + p];
        double b = trans_b ? B[(size_t)j * ldb + p] : B[(size_t)p * ldb + j];
        acc += a * b;
      }
      float *c = &C[(size_t)i * ldc + j];
      *c = (float)(alpha * acc + (beta == 0.0f ? 0.0 : (double)beta * *c));
    }
  }
}

void bk_gemm_strided_batched(int trans_a, int trans_b, int M, int N, int K, float alpha,
                             const float *A, int lda, long long stride_a, const float *B, int ldb,
                             long long stride_b, float beta, float *C, int ldc,
                             long long stride_c, int batch) {
  BK_ASSERTF(batch >= 0, "batch=%d", batch);
  BK_ASSERTF(stride_c != 0 || batch <= 1, "stride_c=0 with batch=%d would race on C", batch);
  for (int i = 0; i < batch; i++)
    bk_gemm(trans_a, trans_b, M, N, K, alpha, A + i * stride_a, lda, B + i * stride_b, ldb,
            beta, C + i * stride_c, ldc);
}

void bk_gemm_strided_batched_ref(int trans_a, int trans_b, int M, int N, int K, float alpha,
                                 const float *A, int lda, long long stride_a, const float *B,
                                 int ldb, long long stride_b, float beta, float *C, int ldc,
                                 long long stride_c, int batch) {
  for (int i = 0; i < batch; i++)
    bk_gemm_ref(trans_a, trans_b, M, N, K, alpha, A + i * stride_a, lda, B + i * stride_b, ldb,
                beta, C + i * stride_c, ldc);
}

/* ---- grouped (MoE) ---- */

static void check_groups(const int32_t *group_sizes, int G, int M) {
  BK_ASSERT(G >= 0 && (G == 0 || group_sizes != NULL));
  long long total = 0;
  for (int g = 0; g < G; g++) {
    BK_ASSERTF(group_sizes[g] >= 0, "group_sizes[%d]=%d", g, (int)group_sizes[g]);
    total += group_sizes[g];
  }
  BK_ASSERTF(total == M, "group sizes sum to %lld, expected M=%d", total, M);
}

void bk_grouped_gemm_fwd(float *out, const float *x, const float *w, const int32_t *group_sizes,
                         int G, int M, int K, int N) {
  check_groups(group_sizes, G, M);
  long long row = 0;
  for (int g = 0; g < G; g++) {
    int m = group_sizes[g];
    if (m > 0)
      bk_gemm(0, 0, m, N, K, 1.0f, x + row * K, K, w + (long long)g * K * N, N, 0.0f,
              out + row * N, N);
    row += m;
  }
}

void bk_grouped_gemm_bwd(float *dx, float *dw, const float *dout, const float *x, const float *w,
                         const int32_t *group_sizes, int G, int M, int K, int N) {
  check_groups(group_sizes, G, M);
  long long row = 0;
  for (int g = 0; g < G; g++) {
    int m = group_sizes[g];
    if (m > 0) {
      if (dx)  // dx_g (m, K) += dout_g (m, N) w_g^T
        bk_gemm(0, 1, m, K, N, 1.0f, dout + row * N, N, w + (long long)g * K * N, N, 1.0f,
                dx + row * K, K);
      if (dw)  // dw_g (K, N) += x_g^T (K, m) dout_g (m, N)
        bk_gemm(1, 0, K, N, m, 1.0f, x + row * K, K, dout + row * N, N, 1.0f,
                dw + (long long)g * K * N, N);
    }
    row += m;
  }
}

void bk_grouped_gemm_fwd_ref(float *out, const float *x, const float *w,
                             const int32_t *group_sizes, int G, int M, int K, int N) {
  check_groups(group_sizes, G, M);
  long long row = 0;
  for (int g = 0; g < G; g++) {
    for (int i = 0; i < group_sizes[g]; i++, row++)
      for (int j = 0; j < N; j++) {
        double acc = 0.0;
        for (int p = 0; p < K; p++)
          acc += (double)x[row * K + p] * w[((long long)g * K + p) * N + j];
        out[row * N + j] = (float)acc;
      }
  }
}

void bk_grouped_gemm_bwd_ref(float *dx, float *dw, const float *dout, const float *x,
                             const float *w, const int32_t *group_sizes, int G, int M, int K,
                             int N) {
  check_groups(group_sizes, G, M);
  long long row0 = 0;
  for (int g = 0; g < G; g++) {
    int m = group_sizes[g];
    const float *wg = w + (long long)g * K * N;
    if (dx)
      for (int i = 0; i < m; i++)
        for (int p = 0; p < K; p++) {
          double acc = 0.0;
          for (int j = 0; j < N; j++) acc += (double)dout[(row0 + i) * N + j] * wg[(long long)p * N + j];
          dx[(row0 + i) * K + p] += (float)acc;
        }
    if (dw)
      for (int p = 0; p < K; p++)
        for (int j = 0; j < N; j++) {
          double acc = 0.0;
          for (int i = 0; i < m; i++) acc += (double)x[(row0 + i) * K + p] * dout[(row0 + i) * N + j];
          dw[((long long)g * K + p) * N + j] += (float)acc;
        }
    row0 += m;
  }
}
