/* test_bk_rope.c — RoPE (MaxText default layout and YaRN) against the _ref twin, known values
 * from reference/maxtext-facts.md §4.7 and §4.1, the relative-position property, and the
 * backward (inverse rotation) against finite differences, and the process-wide table cache (one
 * table per distinct params and positions, shared by concurrent callers, same bits as a table made
 * per token), and Llama 3.1's scaled interleaved RoPE against MaxText's own numbers. */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "blas_kernels/bk_check.h"
#include "blas_kernels/bk_rope.h"

/* Both twins form angles in double; the fast one rotates in float with float cos/sin: a few
 * ulps per element, so 1e-6 norm-wise relative. */
#define REF_RTOL 1e-6
/* RoPE is linear in x: central differences are exact up to float rounding of the output
 * (~6e-8 * sqrt(n) / eps): 1e-4 is tight yet far above the noise. */
#define FD_EPS 1e-2
#define FD_RTOL 1e-4

static bk_rope_params variant(int v, int dim)
{
    if (v >= 5) { // Llama 3.1 (theta 500000 as its model files set), with and without its scaling
        bk_rope_params q = bk_rope_params_llama31(dim);
        q.max_timescale = 500000.0;
        q.use_scale = v == 5;
        return q;
    }
    bk_rope_params p = v == 0 ? bk_rope_params_default(dim) : bk_rope_params_yarn(dim);
    if (v == 2) p.interleave = 0;
    if (v == 3) p.attention_scaling = 1, p.truncate = 0;
    if (v == 4) p.min_timescale = 2.0, p.max_timescale = 500000.0, p.linear_scaling_factor = 8.0;
    return p;
}
#define NVARIANTS 7

static void test_rope_vs_ref(void **state)
{
    (void)state;
    bk_rng r = {41};
    const int cfg[][4] = {{1, 1, 8, 0}, {5, 3, 64, 4}, {17, 4, 128, 0}, {5, 2, 2, 1}, {6, 1, 64, 512}};
    for (int v = 0; v < NVARIANTS; v++)
        for (size_t c = 0; c < sizeof cfg / sizeof cfg[0]; c++) {
            int N = cfg[c][0], H = cfg[c][1], d = cfg[c][2], pad = cfg[c][3];
            bk_rope_params p = variant(v, d);
            int is = d + pad, os = d + (pad ? 1 : 0); // strided rows, different in and out strides
            size_t ni = (size_t)N * H * is, no = (size_t)N * H * os;
            float *x = malloc(ni * 4), *y = malloc(no * 4), *yr = malloc(no * 4);
            float *dx = malloc(ni * 4), *dxr = malloc(ni * 4), *dy = malloc(no * 4);
            int32_t *pos = malloc(N * sizeof *pos);
            for (int n = 0; n < N; n++) pos[n] = bk_rng_int(&r, 200000); // any order, large values
            pos[0] = 0;
            bk_rng_fill(&r, x, ni, -1, 1);
            bk_rng_fill(&r, dy, no, -1, 1);
            memset(y, 0, no * 4), memset(yr, 0, no * 4);
            bk_rope_fwd(y, x, pos, N, H, is, os, &p);
            bk_rope_fwd_ref(yr, x, pos, N, H, is, os, &p);
            double e = bk_rel_err(y, yr, no);
            if (e > REF_RTOL) print_error("variant %d N=%d H=%d d=%d: fwd rel err %g\n", v, N, H, d, e);
            assert_true(e <= REF_RTOL);
            for (size_t i = 0; i < ni; i++) dx[i] = dxr[i] = 0.0f;
            bk_rope_bwd(dx, dy, pos, N, H, is, os, &p);
            bk_rope_bwd_ref(dxr, dy, pos, N, H, is, os, &p);
            assert_true(bk_rel_err(dx, dxr, ni) <= REF_RTOL);
            /* padding columns of the input layout receive no gradient */
            for (int row = 0; row < N * H; row++)
                for (int j = d; j < is; j++) assert_true(dx[(size_t)row * is + j] == 0.0f);
            free(x), free(y), free(yr), free(dx), free(dxr), free(dy), free(pos);
        }
}

static void test_rope_known_values(void **state)
{
    (void)state;
    /* default, d = 4: timescales 1 and 10000^(1/2) = 100; pos 1: angles 1 and 0.01 */
    bk_rope_params p = bk_rope_params_default(4);
    float x[4] = {1, 2, 3, 4}, y[4];
    int32_t pos = 1;
    bk_rope_fwd(y, x, &pos, 1, 1, 4, 4, &p);
    double e[4] = {1 * cos(1.0) - 3 * sin(1.0), 2 * cos(0.01) - 4 * sin(0.01), 3 * cos(1.0) + 1 * sin(1.0),
                   4 * cos(0.01) + 2 * sin(0.01)};
    for (int i = 0; i < 4; i++) assert_true(fabs(y[i] - e[i]) < 1e-6);

    /* YaRN with DeepSeek-V3 settings (d = 64, theta 1e4, orig 4096, factor 40, beta 32/1):
   * correction range low = floor(10.47) = 10, high = ceil(22.5) = 23 */
    bk_rope_params q = bk_rope_params_yarn(64);
    double f[32];
    bk_rope_freqs(f, &q);
    for (int i = 0; i < 32; i++) {
        double base = pow(10000.0, -2.0 * i / 64);
        double ramp = i <= 10 ? 0.0 : (i >= 23 ? 1.0 : (i - 10) / 13.0);
        double want = base * (1 - ramp) + base / 40 * ramp;
        assert_true(fabs(f[i] - want) <= 1e-12 * base);
    }
    assert_true(f[0] == 1.0 && fabs(f[31] - pow(10000.0, -62.0 / 64) / 40) < 1e-15);

    /* interleaved input pairs, concatenated output: x = (re0, im0, re1, im1) at pos 0 -> (re0, re1,
   * im0, im1), with attention scaling 0.1 ln 40 + 1 */
    bk_rope_params s = bk_rope_params_yarn(4);
    s.attention_scaling = 1;
    float xi[4] = {1, 2, 3, 4}, yi[4];
    int32_t p0 = 0;
    bk_rope_fwd(yi, xi, &p0, 1, 1, 4, 4, &s);
    double m = 0.1 * log(40.0) + 1;
    assert_true(fabs(yi[0] - 1 * m) < 1e-6 && fabs(yi[1] - 3 * m) < 1e-6);
    assert_true(fabs(yi[2] - 2 * m) < 1e-6 && fabs(yi[3] - 4 * m) < 1e-6);

    /* MLA softmax scale from the facts: deepseek3 192^-0.5 * 1.3688879^2 = 0.135233;
   * deepseek2-16b mscale 0.707 gives the factor 1.5896; no adjustment when max <= orig */
    assert_true(fabs(bk_mla_softmax_scale(192, 163840, 4096, 40, 1.0) - 0.135233) < 1e-6);
    assert_true(fabs(bk_mla_softmax_scale(192, 163840, 4096, 40, 0.707) * sqrt(192.0) - 1.5896) < 1e-4);
    assert_true(bk_mla_softmax_scale(192, 4096, 4096, 40, 1.0) == 1.0 / sqrt(192.0));
    assert_true(fabs(bk_yarn_mscale(40, 1.0) - 1.3688879) < 1e-7 && bk_yarn_mscale(1.0, 1.0) == 1.0);
}

/* Llama 3.1 (embeddings.LLaMARotaryEmbedding), d = 8, theta 500000.  By hand: unscaled timescales
 * 500000^(j/4) = 1, 26.5915, 707.107, 18803.0; wavelengths 2 pi ts = 6.28, 167.1 (< 2048: kept),
 * 4442.9 (between 2048 and 8192: s = (8192/4442.9 - 1)/3 = 0.281277, freq x ((1 - s)/8 + s) =
 * x 0.371117, ts 1905.32) and 118143 (> 8192: freq / 8, ts 150424).  The rotations are MaxText
 * 0.2.5's own output (LLaMARotaryEmbedding in float32 on CPU, jax 0.12.0.1) for integer-valued inputs
 * x[n][h][k] = (16 n + 8 h + k) % 7 - 3 (2 heads) at positions 0, 1, 5, 1000, 8191: pairs
 * (x[2j], x[2j+1]) in and out. */
static void test_rope_llama31(void **state)
{
    (void)state;
    bk_rope_params p = bk_rope_params_llama31(8);
    p.max_timescale = 500000.0;
    double f[4];
    bk_rope_freqs(f, &p);
    /* the hand values in double (MaxText's float32 ones: 1, 26.5914803, 1905.32068, 150424.125) */
    const double ts[4] = {1.0, 26.591479484724942, 1905.3202144188376, 150424.12372345573};
    for (int j = 0; j < 4; j++) {
        if (fabs(1.0 / f[j] - ts[j]) > 1e-12 * ts[j])
            print_error("pair %d: timescale %.17g, want %.17g\n", j, 1.0 / f[j], ts[j]);
        assert_true(fabs(1.0 / f[j] - ts[j]) <= 1e-12 * ts[j]);
    }
    /* the blend by hand, in double */
    double w = 2.0 * M_PI * pow(500000.0, 0.5), s = (8192.0 / w - 1.0) / 3.0;
    assert_true(fabs(f[2] - pow(500000.0, -0.5) * ((1.0 - s) / 8.0 + s)) < 1e-15);
    assert_true(fabs(f[3] - pow(500000.0, -0.75) / 8.0) < 1e-18);

    enum { N = 5, H = 2, D = 8 };
    const int32_t pos[N] = {0, 1, 5, 1000, 8191};
    float x[N * H * D], y[N * H * D], yr[N * H * D];
    for (int i = 0; i < N * H * D; i++) x[i] = (float)(i % 7 - 3);
    static const float scaled[N * H * D] = {-3,
                                            -2,
                                            -1,
                                            0,
                                            1,
                                            2,
                                            3,
                                            -3,
                                            -2,
                                            -1,
                                            0,
                                            1,
                                            2,
                                            3,
                                            -3,
                                            -2,
                                            -0.540302277f,
                                            -0.841470957f,
                                            0.924098611f,
                                            2.03618312f,
                                            3.00157404f,
                                            -2.99842501f,
                                            -1.99999332f,
                                            -1.00001335f,
                                            -0.841470957f,
                                            0.540302277f,
                                            1.8857944f,
                                            3.07307339f,
                                            -2.99894977f,
                                            -2.00157428f,
                                            -1.0f,
                                            -6.64786967e-06f,
                                            2.20151091f,
                                            -0.391599894f,
                                            3.50789547f,
                                            -2.38635063f,
                                            -1.99736881f,
                                            -1.00524497f,
                                            -3.32393465e-05f,
                                            1.0f,
                                            3.44409728f,
                                            -1.06686199f,
                                            -2.57327485f,
                                            -2.52552128f,
                                            -0.999996543f,
                                            -0.00262422697f,
                                            0.999933541f,
                                            2.00003314f,
                                            4.16777611f,
                                            0.793501616f,
                                            -2.08429003f,
                                            -0.809774995f,
                                            -0.501079738f,
                                            0.865401089f,
                                            1.9800123f,
                                            3.01322937f,
                                            -0.033378005f,
                                            -3.60539675f,
                                            -0.995670974f,
                                            0.0929479748f,
                                            -0.136758387f,
                                            2.23188186f,
                                            3.0198772f,
                                            -2.97999024f,
                                            0.529774189f,
                                            2.17240405f,
                                            -0.154306799f,
                                            0.988022983f,
                                            1.94390535f,
                                            -3.03664827f,
                                            -2.88670182f,
                                            -2.16031313f,
                                            0.646390498f,
                                            0.763006806f,
                                            0.679409385f,
                                            2.13035274f,
                                            -3.9524188f,
                                            -1.54220259f,
                                            -1.94260979f,
                                            -1.10736942f};
    static const float unscaled[N * H * D] = {// rope_use_scale=false: the last two pairs differ
                                              -3,
                                              -2,
                                              -1,
                                              0,
                                              1,
                                              2,
                                              3,
                                              -3,
                                              -2,
                                              -1,
                                              0,
                                              1,
                                              2,
                                              3,
                                              -3,
                                              -2,
                                              -0.540302277f,
                                              -0.841470957f,
                                              0.924098611f,
                                              2.03618312f,
                                              3.00423956f,
                                              -2.99575424f,
                                              -1.99994683f,
                                              -1.00010633f,
                                              -0.841470957f,
                                              0.540302277f,
                                              1.8857944f,
                                              3.07307339f,
                                              -2.99716854f,
                                              -2.00424051f,
                                              -1.0f,
                                              -5.31829573e-05f,
                                              2.20151091f,
                                              -0.391599894f,
                                              3.50789547f,
                                              -2.38635063f,
                                              -1.99287903f,
                                              -1.014117f,
                                              -0.000265914772f,
                                              0.99999994f,
                                              3.44409728f,
                                              -1.06686199f,
                                              -2.57327485f,
                                              -2.52552128f,
                                              -0.999975026f,
                                              -0.00707100797f,
                                              0.999468088f,
                                              2.00026584f,
                                              4.16777611f,
                                              0.793501616f,
                                              -2.08429003f,
                                              -0.809774995f,
                                              -0.987765908f,
                                              0.155943841f,
                                              1.83769858f,
                                              3.10207415f,
                                              -0.033378005f,
                                              -3.60539675f,
                                              -0.995670974f,
                                              0.0929479748f,
                                              -1.81958795f,
                                              1.29965353f,
                                              3.15523195f,
                                              -2.83628464f,
                                              0.529774189f,
                                              2.17240405f,
                                              -0.154306799f,
                                              0.988022983f,
                                              3.60555124f,
                                              0.000884652138f,
                                              -1.87587571f,
                                              -3.0791378f,
                                              0.646390498f,
                                              0.763006806f,
                                              0.679409385f,
                                              2.13035274f,
                                              -0.831029534f,
                                              -4.1604557f,
                                              -1.39124179f,
                                              -1.75055599f};
    for (int use = 1; use >= 0; use--) {
        p.use_scale = use;
        const float *want = use ? scaled : unscaled;
        bk_rope_fwd(y, x, pos, N, H, D, D, &p);
        bk_rope_fwd_ref(yr, x, pos, N, H, D, D, &p);
        /* MaxText forms the angles pos / timescale in float32: at pos 8191 its angle differs from the
     * exact one by up to ~5e-4 rad times |x| <= 3 */
        for (int i = 0; i < N * H * D; i++) {
            double tol = pos[i / (H * D)] == 8191 ? 2e-3 : 2e-5;
            if (fabs(y[i] - want[i]) > tol || fabs(yr[i] - want[i]) > tol)
                print_error("use_scale=%d element %d: %.9g (ref %.9g), MaxText %.9g\n", use, i, y[i], yr[i], want[i]);
            assert_true(fabs(y[i] - want[i]) <= tol && fabs(yr[i] - want[i]) <= tol);
        }
    }
}

/* <rope(q, a), rope(k, b)> depends only on a - b (the reason RoPE exists), for every variant:
 * both q and k go through the same (possibly un-interleaving) map. */
static void test_rope_relative(void **state)
{
    (void)state;
    bk_rng r = {42};
    for (int v = 0; v < NVARIANTS; v++) {
        int d = 64;
        bk_rope_params p = variant(v, d);
        float q[64], k[64], rq[64], rk[64];
        bk_rng_fill(&r, q, d, -1, 1);
        bk_rng_fill(&r, k, d, -1, 1);
        double ref = 0.0;
        for (int shift = 0; shift < 4; shift++) {
            int32_t a = 7 + 1000 * shift, b = 3 + 1000 * shift; // distance 4 throughout
            bk_rope_fwd(rq, q, &a, 1, 1, d, d, &p);
            bk_rope_fwd(rk, k, &b, 1, 1, d, d, &p);
            double dot = bk_dot_d(rq, rk, d);
            if (shift == 0) ref = dot;
            /* angles up to ~3000 rad: float cos/sin of them differ from exact by ~1e-7 relative */
            assert_true(fabs(dot - ref) < 1e-4);
        }
    }
}

typedef struct {
    float *x, *y, *wy;
    const int32_t *pos;
    int N, H, d;
    bk_rope_params p;
} ctx_t;

static double loss(void *q)
{
    ctx_t *c = q;
    bk_rope_fwd_ref(c->y, c->x, c->pos, c->N, c->H, c->d, c->d, &c->p);
    return bk_dot_d(c->wy, c->y, (size_t)c->N * c->H * c->d);
}

static void test_rope_bwd(void **state)
{
    (void)state;
    bk_rng r = {43};
    int N = 5, H = 3, d = 16;
    size_t n = (size_t)N * H * d;
    float x[5 * 3 * 16], y[5 * 3 * 16], dy[5 * 3 * 16], dx[5 * 3 * 16], back[5 * 3 * 16];
    double g[5 * 3 * 16];
    int32_t pos[5] = {4, 0, 17, 3, 9}; // non-contiguous, unordered
    for (int v = 0; v < NVARIANTS; v++) {
        bk_rope_params p = variant(v, d);
        bk_rng_fill(&r, x, n, -1, 1);
        bk_rng_fill(&r, dy, n, -1, 1);
        memset(dx, 0, sizeof dx);
        bk_rope_bwd(dx, dy, pos, N, H, d, d, &p);
        ctx_t c = {x, y, dy, pos, N, H, d, p};
        bk_fd_grad(loss, &c, x, n, FD_EPS, g);
        double e = bk_rel_err_fd(dx, g, n);
        if (e > FD_RTOL) print_error("variant %d: fd rel err %g\n", v, e);
        assert_true(e <= FD_RTOL);
        /* bwd is the inverse rotation: bwd(fwd(x)) = s^2 x (s = attention scaling, 1 if off) */
        bk_rope_fwd(y, x, pos, N, H, d, d, &p);
        memset(back, 0, sizeof back);
        bk_rope_bwd(back, y, pos, N, H, d, d, &p);
        double s = v == 3 ? 0.1 * log(40.0) + 1 : 1.0;
        for (size_t i = 0; i < n; i++) back[i] = (float)(back[i] / (s * s));
        assert_true(bk_rel_err(back, x, n) <= 1e-6);
        /* in place equals out of place */
        memcpy(back, x, sizeof back);
        bk_rope_fwd(back, back, pos, N, H, d, d, &p);
        assert_true(memcmp(back, y, sizeof back) == 0);
    }
}

/* The cache: B rows at positions 0..T-1 (what every device of a batch-sharded mesh rotates). */
enum { CB = 4, CT = 32, CH = 2, CD = 16, CN = CB * CT, CTHREADS = 8 };

typedef struct {
    const float *x;
    const int32_t *pos;
    const bk_rope_params *p;
    float y[CN * CH * CD];
} cache_job;

static void *cache_worker(void *arg)
{
    cache_job *j = arg;
    bk_rope_fwd(j->y, j->x, j->pos, CN, CH, CD, CD, j->p);
    return NULL;
}

/* Row n rotated alone: positions {pos, pos + 1000} spread wider than 2 tokens, so the kernel
 * makes that token's cos/sin itself instead of going through a table. */
static void rotate_per_token(float *y, const float *x, int32_t pos, const bk_rope_params *p)
{
    float xin[2 * CH * CD], yout[2 * CH * CD];
    memcpy(xin, x, sizeof(float) * CH * CD);
    memset(xin + CH * CD, 0, sizeof(float) * CH * CD);
    int32_t two[2] = {pos, pos + 1000};
    bk_rope_fwd(yout, xin, two, 2, CH, CD, CD, p);
    memcpy(y, yout, sizeof(float) * CH * CD);
}

static void test_rope_cache(void **state)
{
    (void)state;
    bk_rng r = {47};
    static float x[CN * CH * CD], y[CN * CH * CD], want[CN * CH * CD];
    int32_t pos[CN];
    for (int n = 0; n < CN; n++) pos[n] = n % CT;
    bk_rng_fill(&r, x, CN * CH * CD, -1, 1);
    for (int v = 0; v < NVARIANTS; v++) {
        bk_rope_params p = variant(v, CD);
        for (int n = 0; n < CN; n++) rotate_per_token(want + (size_t)n * CH * CD, x + (size_t)n * CH * CD, pos[n], &p);
        bk_rope_cache_clear();
        assert_int_equal(bk_rope_cache_tables(), 0);
        /* concurrent callers: one table published, every result the per-token bits */
        static cache_job jobs[CTHREADS];
        pthread_t tid[CTHREADS];
        for (int t = 0; t < CTHREADS; t++) {
            jobs[t].x = x, jobs[t].pos = pos, jobs[t].p = &p;
            assert_int_equal(pthread_create(&tid[t], NULL, cache_worker, &jobs[t]), 0);
        }
        for (int t = 0; t < CTHREADS; t++) pthread_join(tid[t], NULL);
        for (int t = 0; t < CTHREADS; t++) assert_memory_equal(jobs[t].y, want, sizeof want);
        assert_int_equal(bk_rope_cache_tables(), 1);
        /* a later call inside the cached range (positions 8..23 of the first rows) reuses it */
        bk_rope_fwd(y, x + 8 * CH * CD, pos + 8, 16, CH, CD, CD, &p);
        assert_memory_equal(y, want + 8 * CH * CD, sizeof(float) * 16 * CH * CD);
        assert_int_equal(bk_rope_cache_tables(), 1);
        /* other parameters get their own table, and the first one still serves its own */
        bk_rope_params q = p;
        q.max_timescale *= 2.0;
        bk_rope_fwd(y, x, pos, CN, CH, CD, CD, &q);
        assert_int_equal(bk_rope_cache_tables(), 2);
        assert_true(memcmp(y, want, sizeof want) != 0);
        bk_rope_fwd(y, x, pos, CN, CH, CD, CD, &p);
        assert_memory_equal(y, want, sizeof want);
    }
    bk_rope_cache_clear();
    assert_int_equal(bk_rope_cache_tables(), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_rope_vs_ref),  cmocka_unit_test(test_rope_known_values),
        cmocka_unit_test(test_rope_llama31), cmocka_unit_test(test_rope_relative),
        cmocka_unit_test(test_rope_bwd),     cmocka_unit_test(test_rope_cache),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
