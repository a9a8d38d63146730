/* bk_gemm.c — sgemm wrappers (row-major), strided batched and grouped products.
 * Leading dimensions are checked here so a wrong one fails with the numbers instead of
 * OpenBLAS's terse xerbla message.
 *
 * Threads: a large product is cut into blocks of its larger output dim and the blocks run on the
 * kernel pool (bk_parallel), each one single-threaded sgemm; OpenBLAS's own threads stay at 1
 * while a machine runs (sim_machine_new).  One pool for every kernel: OpenBLAS's workers spin in
 * sched_yield for a while after each call, and on a device with two cores that spinning took a
 * sixth of a step's CPU and slowed the pool's elementwise kernels beside it.
 * Each block packs the whole of the other operand again, so a product big enough to keep every
 * thread busy for a while gets one block per pool thread (a 4-block split of the benchmark
 * model's products packed 637 M floats per step, one block per thread 489 M); a smaller one gets
 * two blocks per thread, so a thread that wakes late does not leave the other waiting.
 * Each output element is one dot product over the whole K in sgemm's order whichever block
 * holds it (OpenBLAS blocks K by K alone), so results are the same bits as one unsplit sgemm for
 * any block count, hence any thread count (tests/test_bk_gemm checks 2 to 4 threads).
 * No wrapper here zeroes an output: the memset a profile shows under sgemm_nn/tn/nt is OpenBLAS's
 * own beta pass (sgemm_beta_<core>), which with beta = 0 clears C before its kernel accumulates
 * C += alpha A B; cblas offers no way around it.  Most of its time is the page faults of a freshly
 * mapped output buffer, which the kernel would take instead if the memset went (2026-11, 64
 * devices: memset 2.2-2.5% of the samples, its own clear_page faults on top). */
#include "blas_kernels/bk_gemm.h"

#include <cblas.h>

#include "blas_kernels/bk.h"
#include "blas_kernels/bk_parallel.h"

/* A product is split when it has at least GEMM_SPLIT_MNK multiply-adds (below that the pool's
 * wake-up costs more than the second core gains) and its larger output dim holds two blocks;
 * from GEMM_ONE_BLOCK_MNK (about a millisecond of one core) each thread gets one block. */
enum { GEMM_ALIGN = 64, GEMM_SPLIT_MNK = 1 << 22, GEMM_ONE_BLOCK_MNK = 1 << 26 };

typedef struct {
    int trans_a, trans_b, M, N, K;
    float alpha, beta;
    const float *A, *B;
    int lda, ldb, ldc;
    float *C;
    int split_rows; // blocks of rows of C (else of columns)
    int64_t block;  // rows or columns per block
} gemm_job;

static void sgemm(int trans_a, int trans_b, int M, int N, int K, float alpha, const float *A, int lda, const float *B,
                  int ldb, float beta, float *C, int ldc)
{
    cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans, M, N, K, alpha,
                A, lda, B, ldb, beta, C, ldc);
}

static void gemm_blocks(int64_t lo, int64_t hi, void *arg)
{
    const gemm_job *j = arg;
    for (int64_t b = lo; b < hi; b++) {
        int64_t r0 = b * j->block, dim = j->split_rows ? j->M : j->N;
        int n = (int)(r0 + j->block < dim ? j->block : dim - r0);
        if (n <= 0) continue;
        if (j->split_rows) // rows r0.. of op(A) and C
            sgemm(j->trans_a, j->trans_b, n, j->N, j->K, j->alpha, j->trans_a ? j->A + r0 : j->A + r0 * j->lda, j->lda,
                  j->B, j->ldb, j->beta, j->C + r0 * j->ldc, j->ldc);
        else // columns r0.. of op(B) and C
            sgemm(j->trans_a, j->trans_b, j->M, n, j->K, j->alpha, j->A, j->lda,
                  j->trans_b ? j->B + r0 * j->ldb : j->B + r0, j->ldb, j->beta, j->C + r0, j->ldc);
    }
}

static void check_dims(int trans_a, int trans_b, int M, int N, int K, const float *A, int lda, const float *B, int ldb,
                       const float *C, int ldc)
{
    BK_ASSERTF(M >= 0 && N >= 0 && K >= 0, "M=%d N=%d K=%d", M, N, K);
    int a_cols = trans_a ? M : K, b_cols = trans_b ? K : N;
    BK_ASSERTF(lda >= (a_cols > 1 ? a_cols : 1), "lda=%d < %d columns of A", lda, a_cols);
    BK_ASSERTF(ldb >= (b_cols > 1 ? b_cols : 1), "ldb=%d < %d columns of B", ldb, b_cols);
    BK_ASSERTF(ldc >= (N > 1 ? N : 1), "ldc=%d < N=%d", ldc, N);
    BK_ASSERT(M == 0 || N == 0 || C != NULL);
    BK_ASSERT(M == 0 || N == 0 || K == 0 || (A != NULL && B != NULL));
}

void bk_gemm(int trans_a, int trans_b, int M, int N, int K, float alpha, const float *A, int lda, const float *B,
             int ldb, float beta, float *C, int ldc)
{
    check_dims(trans_a, trans_b, M, N, K, A, lda, B, ldb, C, ldc);
    if (M == 0 || N == 0) return;
    if (K == 0) { // sgemm handles it, but some builds read A/B anyway; be explicit
        for (int i = 0; i < M; i++)
            for (int j = 0; j < N; j++) C[(size_t)i * ldc + j] = beta == 0.0f ? 0.0f : beta * C[(size_t)i * ldc + j];
        return;
    }
    int dim = M >= N ? M : N, threads = bk_parallel_threads();
    double mnk = (double)M * N * K;
    int64_t chunks = mnk >= GEMM_ONE_BLOCK_MNK ? threads : 2 * (int64_t)threads;
    int64_t block = ((dim + chunks - 1) / chunks + GEMM_ALIGN - 1) / GEMM_ALIGN * GEMM_ALIGN;
    if (threads < 2 || mnk < GEMM_SPLIT_MNK || dim < 2 * block) {
        sgemm(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
        return;
    }
    gemm_job j = {trans_a, trans_b, M, N, K, alpha, beta, A, B, lda, ldb, ldc, C, M >= N, block};
    bk_parallel_for((dim + block - 1) / block, 1, gemm_blocks, &j);
}

void bk_gemm_ref(int trans_a, int trans_b, int M, int N, int K, float alpha, const float *A, int lda, const float *B,
                 int ldb, float beta, float *C, int ldc)
{
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

void bk_gemm_strided_batched(int trans_a, int trans_b, int M, int N, int K, float alpha, const float *A, int lda,
                             long long stride_a, const float *B, int ldb, long long stride_b, float beta, float *C,
                             int ldc, long long stride_c, int batch)
{
    BK_ASSERTF(batch >= 0, "batch=%d", batch);
    BK_ASSERTF(stride_c != 0 || batch <= 1, "stride_c=0 with batch=%d would race on C", batch);
    for (int i = 0; i < batch; i++)
        bk_gemm(trans_a, trans_b, M, N, K, alpha, A + i * stride_a, lda, B + i * stride_b, ldb, beta, C + i * stride_c,
                ldc);
}

void bk_gemm_strided_batched_ref(int trans_a, int trans_b, int M, int N, int K, float alpha, const float *A, int lda,
                                 long long stride_a, const float *B, int ldb, long long stride_b, float beta, float *C,
                                 int ldc, long long stride_c, int batch)
{
    for (int i = 0; i < batch; i++)
        bk_gemm_ref(trans_a, trans_b, M, N, K, alpha, A + i * stride_a, lda, B + i * stride_b, ldb, beta,
                    C + i * stride_c, ldc);
}

/* ---- grouped (MoE) ---- */

static void check_groups(const int32_t *group_sizes, int G, int M)
{
    BK_ASSERT(G >= 0 && (G == 0 || group_sizes != NULL));
    long long total = 0;
    for (int g = 0; g < G; g++) {
        BK_ASSERTF(group_sizes[g] >= 0, "group_sizes[%d]=%d", g, (int)group_sizes[g]);
        total += group_sizes[g];
    }
    BK_ASSERTF(total == M, "group sizes sum to %lld, expected M=%d", total, M);
}

void bk_grouped_gemm_fwd(float *out, const float *x, const float *w, const int32_t *group_sizes, int G, int M, int K,
                         int N)
{
    check_groups(group_sizes, G, M);
    long long row = 0;
    for (int g = 0; g < G; g++) {
        int m = group_sizes[g];
        if (m > 0) bk_gemm(0, 0, m, N, K, 1.0f, x + row * K, K, w + (long long)g * K * N, N, 0.0f, out + row * N, N);
        row += m;
    }
}

void bk_grouped_gemm_bwd(float *dx, float *dw, const float *dout, const float *x, const float *w,
                         const int32_t *group_sizes, int G, int M, int K, int N)
{
    check_groups(group_sizes, G, M);
    long long row = 0;
    for (int g = 0; g < G; g++) {
        int m = group_sizes[g];
        if (m > 0) {
            if (dx) // dx_g (m, K) += dout_g (m, N) w_g^T
                bk_gemm(0, 1, m, K, N, 1.0f, dout + row * N, N, w + (long long)g * K * N, N, 1.0f, dx + row * K, K);
            if (dw) // dw_g (K, N) += x_g^T (K, m) dout_g (m, N)
                bk_gemm(1, 0, K, N, m, 1.0f, x + row * K, K, dout + row * N, N, 1.0f, dw + (long long)g * K * N, N);
        }
        row += m;
    }
}

void bk_grouped_gemm_fwd_ref(float *out, const float *x, const float *w, const int32_t *group_sizes, int G, int M,
                             int K, int N)
{
    check_groups(group_sizes, G, M);
    long long row = 0;
    for (int g = 0; g < G; g++) {
        for (int i = 0; i < group_sizes[g]; i++, row++)
            for (int j = 0; j < N; j++) {
                double acc = 0.0;
                for (int p = 0; p < K; p++) acc += (double)x[row * K + p] * w[((long long)g * K + p) * N + j];
                out[row * N + j] = (float)acc;
            }
    }
}

void bk_grouped_gemm_bwd_ref(float *dx, float *dw, const float *dout, const float *x, const float *w,
                             const int32_t *group_sizes, int G, int M, int K, int N)
{
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
