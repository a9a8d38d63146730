/* bk_gemm.h — matrix products on row-major float32 through OpenBLAS sgemm.
 *
 * bk_gemm is sgemm with row-major semantics; the strided batched form loops sgemm over a batch
 * with element strides; the grouped form (MoE) multiplies consecutive row groups of one input by
 * their own matrix of a weight stack (G, K, N), group g owning group_sizes[g] rows.
 * Each has a `_ref` twin (naive loops, double accumulation) used by tests.
 */
#ifndef BK_GEMM_H
#define BK_GEMM_H

#include <stdint.h>

/* C = alpha * op(A) * op(B) + beta * C, row-major; op(X) = X or X^T when trans_x != 0.
 * op(A) is (M, K), op(B) is (K, N), C is (M, N); lda/ldb/ldc are row strides in elements of the
 * matrices as stored (A is stored (M, K) or, transposed, (K, M)). beta == 0 ignores C's contents. */
void bk_gemm(int trans_a, int trans_b, int M, int N, int K, float alpha, const float *A,
             int lda,                        // (M, K) or (K, M) if trans_a
             const float *B, int ldb,        // (K, N) or (N, K) if trans_b
             float beta, float *C, int ldc); // (M, N)
void bk_gemm_ref(int trans_a, int trans_b, int M, int N, int K, float alpha, const float *A, int lda, const float *B,
                 int ldb, float beta, float *C, int ldc);

/* For i in [0, batch): C_i = alpha * op(A_i) op(B_i) + beta * C_i with X_i = X + i * stride_x
 * (a stride of 0 broadcasts one matrix to every batch entry). */
void bk_gemm_strided_batched(int trans_a, int trans_b, int M, int N, int K, float alpha, const float *A, int lda,
                             long long stride_a,                                // (batch, M, K)
                             const float *B, int ldb, long long stride_b,       // (batch, K, N)
                             float beta, float *C, int ldc, long long stride_c, // (batch, M, N)
                             int batch);
void bk_gemm_strided_batched_ref(int trans_a, int trans_b, int M, int N, int K, float alpha, const float *A, int lda,
                                 long long stride_a, const float *B, int ldb, long long stride_b, float beta, float *C,
                                 int ldc, long long stride_c, int batch);

/* Grouped product (MoE experts): rows [r_g, r_g + group_sizes[g]) of x, r_g = sum of earlier
 * sizes, are multiplied by w[g]; sum of group_sizes must equal M (empty groups allowed).
 * fwd overwrites out; bwd accumulates dx += dout_g w_g^T and dw[g] += x_g^T dout_g
 * (dx or dw may be NULL to skip it). */
void bk_grouped_gemm_fwd(float *out,                 // (M, N)
                         const float *x,             // (M, K)
                         const float *w,             // (G, K, N)
                         const int32_t *group_sizes, // (G)
                         int G, int M, int K, int N);
void bk_grouped_gemm_bwd(float *dx,         // (M, K) or NULL
                         float *dw,         // (G, K, N) or NULL
                         const float *dout, // (M, N)
                         const float *x,    // (M, K)
                         const float *w,    // (G, K, N)
                         const int32_t *group_sizes, int G, int M, int K, int N);
void bk_grouped_gemm_fwd_ref(float *out, const float *x, const float *w, const int32_t *group_sizes, int G, int M,
                             int K, int N);
void bk_grouped_gemm_bwd_ref(float *dx, float *dw, const float *dout, const float *x, const float *w,
                             const int32_t *group_sizes, int G, int M, int K, int N);

#endif /* BK_GEMM_H */
