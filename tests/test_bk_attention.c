/* test_bk_attention.c — blocked causal attention against the naive _ref twin, finite
 * differences, permuted / chunked positions, tiles not dividing T, fully masked rows, the sliding
 * window, attention sinks. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "blas_kernels/bk_attention.h"
#include "blas_kernels/bk_check.h"
#include "blas_kernels/bk_parallel.h"

/* Fast vs _ref: scores and P V products in float (sgemm) over <= 300 keys, softmax statistics
 * partly in double; observed <= 1.9e-7 (fwd) and <= 3.3e-7 (bwd) norm-wise, so 2e-6 and 3e-6
 * leave ~10x margin while any masking, GQA or tiling error gives >= 1e-2. */
#define FWD_RTOL 2e-6
#define BWD_RTOL 3e-6
/* FD on the _ref forward: eps 1e-2 on O(1) inputs, smooth softmax: truncation O(eps^2) and float
 * output rounding (~6e-8 sqrt(n) / eps) are both ~1e-5; observed <= 4e-5, bound 3e-4. */
#define FD_EPS 1e-2
#define FD_RTOL 3e-4

typedef struct {
    bk_attn_dims d;
    float *q, *k, *v, *out, *lse;
    int32_t *qp, *kp;
    size_t nq, nk, nv, no, nl;
} prob_t;

static prob_t prob_new(bk_rng *r, bk_attn_dims d)
{
    prob_t p;
    memset(&p, 0, sizeof p);
    p.d = d;
    p.nq = (size_t)d.B * d.Tq * d.Hq * d.Dqk;
    p.nk = (size_t)d.B * d.Tk * d.Hkv * d.Dqk;
    p.nv = (size_t)d.B * d.Tk * d.Hkv * d.Dv;
    p.no = (size_t)d.B * d.Tq * d.Hq * d.Dv;
    p.nl = (size_t)d.B * d.Hq * d.Tq;
    p.q = malloc((p.nq + 1) * 4), p.k = malloc((p.nk + 1) * 4), p.v = malloc((p.nv + 1) * 4);
    p.out = malloc((p.no + 1) * 4), p.lse = malloc((p.nl + 1) * 4);
    p.qp = malloc(((size_t)d.B * d.Tq + 1) * 4), p.kp = malloc(((size_t)d.B * d.Tk + 1) * 4);
    bk_rng_fill(r, p.q, p.nq, -1, 1);
    bk_rng_fill(r, p.k, p.nk, -1, 1);
    bk_rng_fill(r, p.v, p.nv, -1, 1);
    /* default positions: the queries are the last Tq of the Tk keys (a trailing chunk) */
    for (int b = 0; b < d.B; b++) {
        for (int j = 0; j < d.Tk; j++) p.kp[b * d.Tk + j] = j;
        for (int i = 0; i < d.Tq; i++) p.qp[b * d.Tq + i] = d.Tk - d.Tq + i;
    }
    return p;
}

static void prob_free(prob_t *p)
{
    free(p->q), free(p->k), free(p->v), free(p->out), free(p->lse), free(p->qp), free(p->kp);
}

static float *zeros(size_t n) { return calloc(n + 1, sizeof(float)); }

/* fast vs ref, fwd and bwd (with and without dlse), on problem p */
static void check_vs_ref(prob_t *p, bk_rng *r, const char *what)
{
    const bk_attn_dims *d = &p->d;
    float *out_r = zeros(p->no), *lse_r = zeros(p->nl), *dout = zeros(p->no), *dlse = zeros(p->nl);
    bk_rng_fill(r, dout, p->no, -1, 1);
    bk_rng_fill(r, dlse, p->nl, -1, 1);
    bk_attention_fwd(p->out, p->lse, p->q, p->k, p->v, p->qp, p->kp, d);
    bk_attention_fwd_ref(out_r, lse_r, p->q, p->k, p->v, p->qp, p->kp, d);
    double eo = bk_rel_err(p->out, out_r, p->no);
    double el = 0.0;
    for (size_t i = 0; i < p->nl; i++) {
        if (isinf(lse_r[i])) {
            assert_true(isinf(p->lse[i]) && p->lse[i] < 0);
            continue;
        }
        el = fmax(el, fabs((double)p->lse[i] - lse_r[i]) / (1.0 + fabs(lse_r[i])));
    }
    for (int pass = 0; pass < 2; pass++) {
        const float *gl = pass ? dlse : NULL;
        float *dq = zeros(p->nq), *dk = zeros(p->nk), *dv = zeros(p->nv);
        float *dqr = zeros(p->nq), *dkr = zeros(p->nk), *dvr = zeros(p->nv);
        bk_attention_bwd(dq, dk, dv, dout, gl, p->out, p->lse, p->q, p->k, p->v, p->qp, p->kp, d);
        bk_attention_bwd_ref(dqr, dkr, dvr, dout, gl, out_r, lse_r, p->q, p->k, p->v, p->qp, p->kp, d);
        double eq = bk_rel_err(dq, dqr, p->nq), ek = bk_rel_err(dk, dkr, p->nk), ev = bk_rel_err(dv, dvr, p->nv);
        if (eo > FWD_RTOL || el > FWD_RTOL || eq > BWD_RTOL || ek > BWD_RTOL || ev > BWD_RTOL)
            print_error("%s B=%d Tq=%d Tk=%d Hq=%d Hkv=%d Dqk=%d Dv=%d bq=%d bk=%d dlse=%d: out %.2e "
                        "lse %.2e dq %.2e dk %.2e dv %.2e\n",
                        what, d->B, d->Tq, d->Tk, d->Hq, d->Hkv, d->Dqk, d->Dv, d->block_q, d->block_k, pass, eo, el,
                        eq, ek, ev);
        assert_true(eo <= FWD_RTOL && el <= FWD_RTOL);
        assert_true(eq <= BWD_RTOL && ek <= BWD_RTOL && ev <= BWD_RTOL);
        for (size_t i = 0; i < p->nq; i++) assert_false(isnan(dq[i]));
        free(dq), free(dk), free(dv), free(dqr), free(dkr), free(dvr);
    }
    for (size_t i = 0; i < p->no; i++) assert_false(isnan(p->out[i]));
    free(out_r), free(lse_r), free(dout), free(dlse);
}

static void test_attention_vs_ref(void **state)
{
    (void)state;
    bk_rng r = {51};
    /* B, Tq, Tk, Hq, Hkv, Dqk, Dv, block_q, block_k */
    const int cfg[][9] = {
        {1, 1, 1, 1, 1, 8, 8, 0, 0},          // T = 1
        {2, 5, 5, 2, 1, 16, 16, 2, 3},        // GQA 2, tiles 2 x 3 not dividing 5
        {1, 17, 17, 4, 2, 12, 8, 4, 5},       // Dv != Dqk
        {2, 17, 17, 4, 4, 8, 8, 16, 16},      // MHA, tile 16 < T = 17
        {1, 17, 17, 4, 1, 8, 4, 3, 7},        // GQA 4
        {1, 5, 13, 2, 2, 8, 8, 2, 4},         // Tq < Tk: a trailing query chunk
        {1, 17, 17, 3, 3, 24, 16, 0, 0},      // MLA-like 3:2 dims, default tiles > T
        {1, 300, 300, 2, 1, 32, 16, 64, 128}, // several tiles, skipped upper-triangle tiles
        /* diagonal tiles taller than the 64-row blocks they run in, each over the keys it sees */
        {2, 260, 260, 2, 2, 16, 16, 0, 0},    // default 128 x 128 tiles: 64 + 64 rows, a ragged last tile
        {1, 150, 150, 2, 1, 16, 8, 100, 128}, // 64 + 36 rows
        {1, 130, 130, 2, 1, 8, 8, 128, 32},   // key tiles no row of a block sees: skipped
    };
    for (size_t c = 0; c < sizeof cfg / sizeof cfg[0]; c++) {
        const int *x = cfg[c];
        bk_attn_dims d = {x[0], x[1], x[2], x[3], x[4], x[5], x[6], 0.0f, x[7], x[8], 0.0f, 0, NULL, NULL};
        d.scale = (float)(1.0 / sqrt((double)d.Dqk)) * (c % 2 ? 3.0f : 1.0f); // peaky and flat softmaxes
        prob_t p = prob_new(&r, d);
        check_vs_ref(&p, &r, "contiguous");
        prob_free(&p);
    }
}

/* ---- finite differences ---- */

typedef struct {
    prob_t *p;
    float *wo, *wl, *o, *l; // loss = sum(wo * out) + sum(wl * lse over visible rows)
} fd_ctx;

static double fd_loss(void *c_)
{
    fd_ctx *c = c_;
    bk_attention_fwd_ref(c->o, c->l, c->p->q, c->p->k, c->p->v, c->p->qp, c->p->kp, &c->p->d);
    double s = bk_dot_d(c->wo, c->o, c->p->no);
    for (size_t i = 0; i < c->p->nl; i++)
        if (!isinf(c->l[i])) s += (double)c->wl[i] * c->l[i];
    return s;
}

static void fd_check(float soft_cap, float scale)
{
    bk_rng r = {52};
    bk_attn_dims d = {2, 5, 7, 4, 2, 6, 4, scale, 2, 3, soft_cap, 0, NULL, NULL};
    prob_t p = prob_new(&r, d);
    /* batch 1 gets shuffled key positions and one query that sees nothing (position -1) */
    const int32_t kp1[7] = {6, 0, 3, 5, 1, 2, 4}, qp1[5] = {2, -1, 6, 4, 3};
    memcpy(p.kp + 7, kp1, sizeof kp1), memcpy(p.qp + 5, qp1, sizeof qp1);
    float *wo = zeros(p.no), *wl = zeros(p.nl), *o = zeros(p.no), *l = zeros(p.nl);
    bk_rng_fill(&r, wo, p.no, -1, 1);
    bk_rng_fill(&r, wl, p.nl, -1, 1);
    float *dq = zeros(p.nq), *dk = zeros(p.nk), *dv = zeros(p.nv);
    bk_attention_fwd(p.out, p.lse, p.q, p.k, p.v, p.qp, p.kp, &d);
    bk_attention_bwd(dq, dk, dv, wo, wl, p.out, p.lse, p.q, p.k, p.v, p.qp, p.kp, &d);
    fd_ctx c = {&p, wo, wl, o, l};
    double *g = malloc((p.nq + p.nk + p.nv) * sizeof *g);
    bk_fd_grad(fd_loss, &c, p.q, p.nq, FD_EPS, g);
    double eq = bk_rel_err_fd(dq, g, p.nq);
    bk_fd_grad(fd_loss, &c, p.k, p.nk, FD_EPS, g);
    double ek = bk_rel_err_fd(dk, g, p.nk);
    bk_fd_grad(fd_loss, &c, p.v, p.nv, FD_EPS, g);
    double ev = bk_rel_err_fd(dv, g, p.nv);
    print_message("attention fd rel err (soft cap %g): dq %.2e dk %.2e dv %.2e\n", soft_cap, eq, ek, ev);
    assert_true(eq <= FD_RTOL && ek <= FD_RTOL && ev <= FD_RTOL);
    free(wo), free(wl), free(o), free(l), free(dq), free(dk), free(dv), free(g);
    prob_free(&p);
}

static void test_attention_fd(void **state)
{
    (void)state;
    fd_check(0.0f, 0.5f);
}

/* attn_logits_soft_cap: scores s -> cap tanh(s / cap).  Scaled scores of size ~3 under a cap of
 * 1.5 put most of them on the curved part of tanh.  The fast kernel matches the double twin
 * (which differentiates through the cap with sech^2 instead of 1 - tanh^2), the backward matches
 * finite differences of the twin, and the cap changes the result (it is not a no-op). */
static void test_attention_soft_cap(void **state)
{
    (void)state;
    bk_rng r = {57};
    const int cfg[][9] = {
        {2, 5, 5, 2, 1, 16, 16, 2, 3},
        {1, 17, 17, 4, 2, 12, 8, 4, 5},
        {1, 5, 13, 2, 2, 8, 8, 2, 4},
    };
    for (size_t c = 0; c < sizeof cfg / sizeof cfg[0]; c++) {
        const int *x = cfg[c];
        bk_attn_dims d = {x[0], x[1], x[2], x[3], x[4], x[5], x[6], 3.0f / sqrtf((float)x[5]),
                          x[7], x[8], 1.5f, 0,    NULL, NULL};
        prob_t p = prob_new(&r, d);
        check_vs_ref(&p, &r, "soft cap");
        float *o0 = zeros(p.no), *l0 = zeros(p.nl);
        bk_attn_dims u = d;
        u.soft_cap = 0.0f;
        bk_attention_fwd(o0, l0, p.q, p.k, p.v, p.qp, p.kp, &u);
        bk_attention_fwd(p.out, p.lse, p.q, p.k, p.v, p.qp, p.kp, &d);
        assert_true(bk_rel_err(p.out, o0, p.no) > 1e-2);
        /* every visible capped score is below the cap, so lse <= cap + log(#visible keys) */
        for (int h = 0; h < d.Hq; h++)
            for (int i = 0; i < d.Tq; i++) {
                int vis = d.Tk - d.Tq + i + 1;
                assert_true(p.lse[h * d.Tq + i] <= 1.5f + logf((float)vis) + 1e-5f);
            }
        free(o0), free(l0);
        prob_free(&p);
    }
    fd_check(1.5f, 3.0f);
}

/* ---- positions: permuted order and chunks ---- */

/* A sequence of T tokens in natural order vs the same tokens stored in permuted order (as
 * load-balanced context parallelism stores them) with their true positions: the outputs and
 * gradients must be the same rows, permuted. */
static void test_attention_permuted(void **state)
{
    (void)state;
    bk_rng r = {53};
    bk_attn_dims d = {1, 16, 16, 4, 2, 8, 6, 0.4f, 3, 5, 0.0f, 0, NULL, NULL};
    prob_t a = prob_new(&r, d), b = prob_new(&r, d);
    /* MaxText load-balanced order for 4 chunks of 4 over 2 shards: chunks 0,3 | 1,2 */
    int perm[16];
    const int chunks[4] = {0, 3, 1, 2};
    for (int c = 0; c < 4; c++)
        for (int t = 0; t < 4; t++) perm[c * 4 + t] = chunks[c] * 4 + t;
    size_t rq = (size_t)d.Hq * d.Dqk, rk = (size_t)d.Hkv * d.Dqk, rv = (size_t)d.Hkv * d.Dv;
    for (int i = 0; i < 16; i++) { // row i of b is token perm[i] of a
        memcpy(b.q + i * rq, a.q + perm[i] * rq, rq * 4);
        memcpy(b.k + i * rk, a.k + perm[i] * rk, rk * 4);
        memcpy(b.v + i * rv, a.v + perm[i] * rv, rv * 4);
        b.qp[i] = b.kp[i] = perm[i];
    }
    float *doa = zeros(a.no), *dob = zeros(a.no);
    size_t ro = (size_t)d.Hq * d.Dv;
    bk_rng_fill(&r, doa, a.no, -1, 1);
    for (int i = 0; i < 16; i++) memcpy(dob + i * ro, doa + perm[i] * ro, ro * 4);
    float *dqa = zeros(a.nq), *dka = zeros(a.nk), *dva = zeros(a.nv);
    float *dqb = zeros(a.nq), *dkb = zeros(a.nk), *dvb = zeros(a.nv);
    bk_attention_fwd(a.out, a.lse, a.q, a.k, a.v, a.qp, a.kp, &d);
    bk_attention_fwd(b.out, b.lse, b.q, b.k, b.v, b.qp, b.kp, &d);
    bk_attention_bwd(dqa, dka, dva, doa, NULL, a.out, a.lse, a.q, a.k, a.v, a.qp, a.kp, &d);
    bk_attention_bwd(dqb, dkb, dvb, dob, NULL, b.out, b.lse, b.q, b.k, b.v, b.qp, b.kp, &d);
    /* un-permute b into natural order and compare (different tile grouping -> float rounding) */
    float *t = zeros(a.no > a.nq ? a.no : a.nq);
    for (int i = 0; i < 16; i++) memcpy(t + perm[i] * ro, b.out + i * ro, ro * 4);
    assert_true(bk_rel_err(t, a.out, a.no) <= FWD_RTOL);
    for (int i = 0; i < 16; i++) memcpy(t + perm[i] * rq, dqb + i * rq, rq * 4);
    assert_true(bk_rel_err(t, dqa, a.nq) <= BWD_RTOL);
    for (int i = 0; i < 16; i++) memcpy(t + perm[i] * rk, dkb + i * rk, rk * 4);
    assert_true(bk_rel_err(t, dka, a.nk) <= BWD_RTOL);
    for (int i = 0; i < 16; i++) memcpy(t + perm[i] * rv, dvb + i * rv, rv * 4);
    assert_true(bk_rel_err(t, dva, a.nv) <= BWD_RTOL);
    for (int h = 0; h < d.Hq; h++)
        for (int i = 0; i < 16; i++) assert_true(fabsf(b.lse[h * 16 + i] - a.lse[h * 16 + perm[i]]) <= 1e-5f);
    /* and the permuted problem also matches the reference directly */
    check_vs_ref(&b, &r, "permuted");
    free(doa), free(dob), free(dqa), free(dka), free(dva), free(dqb), free(dkb), free(dvb), free(t);
    prob_free(&a), prob_free(&b);
}

/* A query chunk (rows 6..10 of 17) attending the full key set equals those rows of the full
 * attention: nothing assumes Tq == Tk or that queries start at position 0. */
static void test_attention_chunk(void **state)
{
    (void)state;
    bk_rng r = {54};
    bk_attn_dims full = {1, 17, 17, 2, 1, 8, 8, 0.35f, 4, 4, 0.0f, 0, NULL, NULL};
    prob_t f = prob_new(&r, full);
    bk_attention_fwd(f.out, f.lse, f.q, f.k, f.v, f.qp, f.kp, &full);
    bk_attn_dims cd = full;
    cd.Tq = 5;
    prob_t c = prob_new(&r, cd);
    size_t rq = (size_t)full.Hq * full.Dqk, ro = (size_t)full.Hq * full.Dv;
    memcpy(c.q, f.q + 6 * rq, 5 * rq * 4);
    memcpy(c.k, f.k, c.nk * 4), memcpy(c.v, f.v, c.nv * 4);
    for (int i = 0; i < 5; i++) c.qp[i] = 6 + i;
    bk_attention_fwd(c.out, c.lse, c.q, c.k, c.v, c.qp, c.kp, &cd);
    assert_true(bk_rel_err(c.out, f.out + 6 * ro, 5 * ro) <= FWD_RTOL);
    for (int h = 0; h < 2; h++)
        for (int i = 0; i < 5; i++) assert_true(fabsf(c.lse[h * 5 + i] - f.lse[h * 17 + 6 + i]) <= 1e-5f);
    check_vs_ref(&c, &r, "chunk");
    prob_free(&f), prob_free(&c);
}

static void test_attention_fully_masked(void **state)
{
    (void)state;
    bk_rng r = {55};
    bk_attn_dims d = {2, 6, 5, 2, 1, 4, 3, 0.5f, 2, 2, 0.0f, 0, NULL, NULL};
    prob_t p = prob_new(&r, d);
    /* keys at positions 10..14; queries 8, 12, 9, 14, 3, 11: rows 0, 2, 4 see nothing */
    const int32_t qp[6] = {8, 12, 9, 14, 3, 11};
    for (int b = 0; b < 2; b++) {
        for (int j = 0; j < 5; j++) p.kp[b * 5 + j] = 10 + j;
        memcpy(p.qp + b * 6, qp, sizeof qp);
    }
    check_vs_ref(&p, &r, "masked");
    float *dout = zeros(p.no), *dq = zeros(p.nq), *dk = zeros(p.nk), *dv = zeros(p.nv);
    bk_rng_fill(&r, dout, p.no, -1, 1);
    bk_attention_fwd(p.out, p.lse, p.q, p.k, p.v, p.qp, p.kp, &d);
    bk_attention_bwd(dq, dk, dv, dout, NULL, p.out, p.lse, p.q, p.k, p.v, p.qp, p.kp, &d);
    for (int b = 0; b < 2; b++)
        for (int i = 0; i < 6; i++) {
            int masked = qp[i] < 10;
            for (int h = 0; h < d.Hq; h++) {
                float l = p.lse[(b * d.Hq + h) * 6 + i];
                assert_true(masked ? (isinf(l) && l < 0) : isfinite(l));
                for (int c = 0; c < d.Dv; c++) {
                    float o = p.out[((b * 6 + i) * d.Hq + h) * d.Dv + c];
                    assert_true(masked ? o == 0.0f : isfinite(o));
                }
                for (int c = 0; c < d.Dqk; c++) {
                    float g = dq[((b * 6 + i) * d.Hq + h) * d.Dqk + c];
                    assert_true(masked ? g == 0.0f : isfinite(g));
                }
            }
        }
    /* no key at all (Tk = 0): every row is fully masked */
    bk_attn_dims e = d;
    e.Tk = 0;
    bk_attention_fwd(p.out, p.lse, p.q, p.k, p.v, p.qp, p.kp, &e);
    for (size_t i = 0; i < (size_t)e.B * e.Tq * e.Hq * e.Dv; i++) assert_true(p.out[i] == 0.0f);
    free(dout), free(dq), free(dk), free(dv);
    prob_free(&p);
}

/* Tile sizes change only rounding, never the result beyond float noise. */
static void test_attention_tile_invariance(void **state)
{
    (void)state;
    bk_rng r = {56};
    bk_attn_dims d = {1, 33, 33, 2, 2, 8, 8, 0.35f, 1, 1, 0.0f, 0, NULL, NULL};
    prob_t p = prob_new(&r, d);
    float *o1 = zeros(p.no), *l1 = zeros(p.nl);
    bk_attention_fwd(o1, l1, p.q, p.k, p.v, p.qp, p.kp, &d);
    const int tiles[][2] = {{33, 33}, {7, 5}, {64, 2}, {2, 64}};
    for (int t = 0; t < 4; t++) {
        d.block_q = tiles[t][0], d.block_k = tiles[t][1];
        bk_attention_fwd(p.out, p.lse, p.q, p.k, p.v, p.qp, p.kp, &d);
        assert_true(bk_rel_err(p.out, o1, p.no) <= FWD_RTOL);
        assert_true(bk_rel_err(p.lse, l1, p.nl) <= FWD_RTOL);
    }
    free(o1), free(l1);
    prob_free(&p);
}

/* Dot-product attention (the score matrix materialised) against the same _ref twin, GQA, Dv != Dqk,
 * a trailing chunk and permuted positions; its probabilities sum to 1 over the visible keys and are
 * 0 on masked ones. Same tolerances as the blocked kernel (the same float products, one tile). */
/* The dot-product kernel's backward from its probabilities against the reference's, for the
 * cotangent dout of the output (out_r, lse_r: the reference's forward). */
static void check_dot_bwd(const prob_t *p, const bk_attn_dims *d, const float *dout, const float *probs,
                          const float *out_r, const float *lse_r)
{
    float *dq = zeros(p->nq), *dk = zeros(p->nk), *dv = zeros(p->nv);
    float *dq_r = zeros(p->nq), *dk_r = zeros(p->nk), *dv_r = zeros(p->nv);
    bk_attention_dot_bwd(dq, dk, dv, dout, probs, p->q, p->k, p->v, d);
    bk_attention_bwd_ref(dq_r, dk_r, dv_r, dout, NULL, out_r, lse_r, p->q, p->k, p->v, p->qp, p->kp, d);
    assert_true(bk_rel_err(dq, dq_r, p->nq) < BWD_RTOL);
    assert_true(bk_rel_err(dk, dk_r, p->nk) < BWD_RTOL);
    assert_true(bk_rel_err(dv, dv_r, p->nv) < BWD_RTOL);
    free(dq), free(dk), free(dv), free(dq_r), free(dk_r), free(dv_r);
}

static void test_attention_dot_vs_ref(void **state)
{
    (void)state;
    bk_rng r = {77};
    bk_attn_dims dims[3] = {
        {.B = 2, .Tq = 37, .Tk = 37, .Hq = 4, .Hkv = 2, .Dqk = 16, .Dv = 8, .scale = 0.25f},
        {.B = 1, .Tq = 9, .Tk = 40, .Hq = 3, .Hkv = 3, .Dqk = 8, .Dv = 8, .scale = 1.0f},
        {.B = 3, .Tq = 16, .Tk = 16, .Hq = 2, .Hkv = 1, .Dqk = 4, .Dv = 6, .scale = 0.5f},
    };
    for (int c = 0; c < 3; c++) {
        prob_t p = prob_new(&r, dims[c]);
        const bk_attn_dims *d = &p.d;
        if (c == 2) /* permuted positions (load-balanced context parallelism) */
            for (int b = 0; b < d->B; b++)
                for (int i = 0; i < d->Tq; i++) p.qp[b * d->Tq + i] = p.kp[b * d->Tk + i] = (i * 5) % d->Tq;
        size_t np = (size_t)d->B * d->Hq * d->Tq * d->Tk;
        float *probs = zeros(np), *out_r = zeros(p.no), *lse_r = zeros(p.nl), *dout = zeros(p.no);
        bk_rng_fill(&r, dout, p.no, -1, 1);
        bk_attention_dot_fwd(p.out, probs, p.q, p.k, p.v, p.qp, p.kp, d);
        bk_attention_fwd_ref(out_r, lse_r, p.q, p.k, p.v, p.qp, p.kp, d);
        assert_true(bk_rel_err(p.out, out_r, p.no) < FWD_RTOL);
        for (int b = 0; b < d->B; b++)
            for (int h = 0; h < d->Hq; h++)
                for (int i = 0; i < d->Tq; i++) {
                    const float *pr = probs + (((size_t)b * d->Hq + h) * d->Tq + i) * d->Tk;
                    double sum = 0.0;
                    for (int j = 0; j < d->Tk; j++) {
                        if (p.kp[b * d->Tk + j] > p.qp[b * d->Tq + i]) assert_true(pr[j] == 0.0f);
                        sum += pr[j];
                    }
                    assert_true(fabs(sum - 1.0) < 1e-5);
                }
        check_dot_bwd(&p, d, dout, probs, out_r, lse_r);
        free(probs), free(out_r), free(lse_r), free(dout);
        prob_free(&p);
    }
}

/* ---- sliding window (MaxText attention_type=local_sliding) ---- */

/* The window as MaxText's attention_op.py generate_attention_mask builds it: key col visible to
 * query row iff col > row - W and col <= row.  Checked against the double twin on tiles that are
 * skipped whole (keys all older than the window), cut by the window's old edge, or cut by both
 * edges; on a trailing query chunk and on load-balanced permuted positions; with and without the
 * soft cap.  Then hand facts the twin does not supply: W = 1 leaves each query its own key only
 * (out = its value row, lse = its own score), W >= T is plain causal attention, and the
 * dot-product kernel's probabilities are 0 outside the window and sum to 1 over min(row + 1, W)
 * keys. */
static void test_attention_window(void **state)
{
    (void)state;
    bk_rng r = {91};
    /* B, Tq, Tk, Hq, Hkv, Dqk, Dv, block_q, block_k, window, cap x10 */
    const int cfg[][11] = {
        {2, 5, 5, 2, 1, 16, 16, 2, 3, 2, 0},    // window across 2 x 3 tiles
        {1, 40, 40, 4, 2, 8, 8, 8, 8, 11, 0},   // whole tiles skipped, both edges cut
        {1, 40, 40, 2, 2, 8, 6, 0, 0, 7, 0},    // default tiles (one tile)
        {1, 9, 40, 3, 3, 8, 8, 4, 5, 6, 0},     // a trailing query chunk
        {2, 33, 33, 4, 1, 12, 8, 16, 4, 5, 15}, // soft cap
        {1, 70, 70, 2, 1, 8, 8, 64, 64, 3, 0},  // the partly visible tile's 64-row sub-blocks
    };
    for (size_t c = 0; c < sizeof cfg / sizeof cfg[0]; c++) {
        const int *x = cfg[c];
        bk_attn_dims d = {
            x[0], x[1], x[2], x[3], x[4], x[5], x[6], 1.0f / sqrtf((float)x[5]), x[7], x[8], (float)x[10] / 10.0f,
            x[9], NULL, NULL};
        prob_t p = prob_new(&r, d);
        check_vs_ref(&p, &r, "window");
        prob_free(&p);
    }
    /* load-balanced positions: 4 chunks of 4 stored as 0,3 | 1,2 */
    {
        bk_attn_dims d = {1, 16, 16, 4, 2, 8, 6, 0.4f, 3, 5, 0.0f, 6, NULL, NULL};
        prob_t p = prob_new(&r, d);
        const int chunks[4] = {0, 3, 1, 2};
        for (int ch = 0; ch < 4; ch++)
            for (int t = 0; t < 4; t++) p.qp[ch * 4 + t] = p.kp[ch * 4 + t] = chunks[ch] * 4 + t;
        check_vs_ref(&p, &r, "window permuted");
        prob_free(&p);
    }
    /* W = 1: each query sees only its own key */
    {
        bk_attn_dims d = {2, 19, 19, 4, 2, 8, 8, 0.5f, 4, 4, 0.0f, 1, NULL, NULL};
        prob_t p = prob_new(&r, d);
        bk_attention_fwd(p.out, p.lse, p.q, p.k, p.v, p.qp, p.kp, &d);
        for (int b = 0; b < d.B; b++)
            for (int i = 0; i < d.Tq; i++)
                for (int h = 0; h < d.Hq; h++) {
                    const int g = h / (d.Hq / d.Hkv);
                    const float *o = p.out + (((size_t)b * d.Tq + i) * d.Hq + h) * d.Dv;
                    const float *vv = p.v + (((size_t)b * d.Tk + i) * d.Hkv + g) * d.Dv;
                    const float *qq = p.q + (((size_t)b * d.Tq + i) * d.Hq + h) * d.Dqk;
                    const float *kk = p.k + (((size_t)b * d.Tk + i) * d.Hkv + g) * d.Dqk;
                    for (int cc = 0; cc < d.Dv; cc++) assert_true(fabsf(o[cc] - vv[cc]) <= 1e-6f);
                    double s = 0;
                    for (int cc = 0; cc < d.Dqk; cc++) s += (double)qq[cc] * kk[cc];
                    assert_true(fabs(p.lse[((size_t)b * d.Hq + h) * d.Tq + i] - 0.5 * s) <= 1e-5);
                }
        prob_free(&p);
    }
    /* W >= T: the causal result, bit for bit (nothing is masked beyond causality) */
    {
        bk_attn_dims d = {1, 23, 23, 2, 1, 8, 8, 0.35f, 8, 8, 0.0f, 23, NULL, NULL};
        prob_t p = prob_new(&r, d);
        float *o0 = zeros(p.no), *l0 = zeros(p.nl);
        bk_attn_dims u = d;
        u.window = 0;
        bk_attention_fwd(o0, l0, p.q, p.k, p.v, p.qp, p.kp, &u);
        bk_attention_fwd(p.out, p.lse, p.q, p.k, p.v, p.qp, p.kp, &d);
        assert_memory_equal(o0, p.out, p.no * sizeof(float));
        d.window = 22; /* one key fewer for the last query: a different result */
        bk_attention_fwd(p.out, p.lse, p.q, p.k, p.v, p.qp, p.kp, &d);
        assert_true(bk_rel_err(p.out, o0, p.no) > 1e-6);
        free(o0), free(l0);
        prob_free(&p);
    }
    /* dot-product kernel: probabilities inside the window only, against the twin */
    {
        bk_attn_dims d = {.B = 2, .Tq = 21, .Tk = 21, .Hq = 4, .Hkv = 2, .Dqk = 8, .Dv = 8, .scale = 0.5f, .window = 4};
        prob_t p = prob_new(&r, d);
        size_t np = (size_t)d.B * d.Hq * d.Tq * d.Tk;
        float *probs = zeros(np), *out_r = zeros(p.no), *lse_r = zeros(p.nl), *dout = zeros(p.no);
        bk_rng_fill(&r, dout, p.no, -1, 1);
        bk_attention_dot_fwd(p.out, probs, p.q, p.k, p.v, p.qp, p.kp, &d);
        bk_attention_fwd_ref(out_r, lse_r, p.q, p.k, p.v, p.qp, p.kp, &d);
        assert_true(bk_rel_err(p.out, out_r, p.no) < FWD_RTOL);
        for (int b = 0; b < d.B; b++)
            for (int h = 0; h < d.Hq; h++)
                for (int i = 0; i < d.Tq; i++) {
                    const float *pr = probs + (((size_t)b * d.Hq + h) * d.Tq + i) * d.Tk;
                    double sum = 0.0;
                    int nz = 0;
                    for (int j = 0; j < d.Tk; j++) {
                        if (j > i || j <= i - d.window) assert_true(pr[j] == 0.0f);
                        nz += pr[j] != 0.0f;
                        sum += pr[j];
                    }
                    assert_int_equal(nz, i + 1 < d.window ? i + 1 : d.window);
                    assert_true(fabs(sum - 1.0) < 1e-5);
                }
        check_dot_bwd(&p, &d, dout, probs, out_r, lse_r);
        free(probs), free(out_r), free(lse_r), free(dout);
        prob_free(&p);
    }
}

/* The blocked kernels run (batch row, kv head) pairs on the kernel pool: with GQA (two query heads
 * per kv head, which sum into the same dk and dv) and 2 or 3 threads, every output has the bits of
 * one thread. */
static void test_attention_threads_same_bits(void **state)
{
    (void)state;
    bk_rng r = {57};
    bk_attn_dims d = {3, 150, 150, 4, 2, 16, 8, 0.25f, 64, 32, 0.0f, 0, NULL, NULL};
    prob_t p = prob_new(&r, d);
    float *dout = zeros(p.no);
    bk_rng_fill(&r, dout, p.no, -1, 1);
    float *o[3], *l[3], *dq[3], *dk[3], *dv[3];
    for (int t = 0; t < 3; t++) {
        bk_parallel_set_threads(t + 1);
        o[t] = zeros(p.no), l[t] = zeros(p.nl), dq[t] = zeros(p.nq), dk[t] = zeros(p.nk), dv[t] = zeros(p.nv);
        bk_attention_fwd(o[t], l[t], p.q, p.k, p.v, p.qp, p.kp, &d);
        bk_attention_bwd(dq[t], dk[t], dv[t], dout, NULL, o[t], l[t], p.q, p.k, p.v, p.qp, p.kp, &d);
    }
    bk_parallel_set_threads(1);
    for (int t = 1; t < 3; t++) {
        assert_memory_equal(o[t], o[0], p.no * sizeof(float));
        assert_memory_equal(l[t], l[0], p.nl * sizeof(float));
        assert_memory_equal(dq[t], dq[0], p.nq * sizeof(float));
        assert_memory_equal(dk[t], dk[0], p.nk * sizeof(float));
        assert_memory_equal(dv[t], dv[0], p.nv * sizeof(float));
    }
    for (int t = 0; t < 3; t++) free(o[t]), free(l[t]), free(dq[t]), free(dk[t]), free(dv[t]);
    free(dout);
    prob_free(&p);
}

/* ---- attention sinks (MaxText attention_sink) ---- */

/* Loss of the _ref forward for finite differences over the sinks. */
static double fd_sink_loss(void *c_)
{
    fd_ctx *c = c_;
    return fd_loss(c);
}

/* Sinks as attention_op.py compute_local_attention adds them: one logit per query head
 * concatenated to every score row, in the max and the sum, its column dropped before P V.  The
 * blocked and dot-product kernels match the double twin (out, lse, dq, dk, dv and the sinks'
 * gradient) with and without the window, the soft cap and dlse, on contiguous and permuted
 * positions; the twin's sink gradient matches finite differences of its forward; and hand facts
 * the twin does not supply: a query that sees one key gets out = v e^s / (e^s + e^sink), a sink of
 * -inf is no sink, and a query that sees nothing gets out = 0 and lse = its sink. */
static void test_attention_sinks(void **state)
{
    (void)state;
    bk_rng r = {91};
    /* B, Tq, Tk, Hq, Hkv, Dqk, Dv, block_q, block_k, window, cap x10, permuted */
    const int cfg[][12] = {
        {2, 5, 5, 2, 1, 16, 16, 2, 3, 0, 0, 0},        {1, 17, 17, 4, 2, 12, 8, 4, 5, 3, 0, 0},
        {2, 40, 40, 4, 2, 8, 8, 16, 8, 6, 15, 1},      {1, 9, 21, 3, 3, 8, 8, 0, 0, 0, 0, 0},
        {1, 150, 150, 2, 1, 16, 8, 100, 128, 0, 0, 0}, {1, 260, 260, 2, 2, 8, 8, 0, 0, 70, 0, 0},
    };
    for (size_t c = 0; c < sizeof cfg / sizeof cfg[0]; c++) {
        const int *x = cfg[c];
        bk_attn_dims d = {x[0], x[1], x[2], x[3], x[4], x[5], x[6], 0.5f, x[7], x[8], (float)x[10] / 10.0f,
                          x[9], NULL, NULL};
        float *sinks = zeros((size_t)d.Hq), *ds = zeros((size_t)d.Hq), *ds_r = zeros((size_t)d.Hq);
        bk_rng_fill(&r, sinks, (size_t)d.Hq, -1.5, 1.5);
        d.sinks = sinks;
        prob_t p = prob_new(&r, d);
        if (x[11])
            for (int b = 0; b < d.B; b++)
                for (int i = 0; i < d.Tq; i++) p.qp[b * d.Tq + i] = p.kp[b * d.Tk + i] = (i * 7) % d.Tq;
        float *out_r = zeros(p.no), *lse_r = zeros(p.nl), *dout = zeros(p.no), *dlse = zeros(p.nl);
        bk_rng_fill(&r, dout, p.no, -1, 1);
        bk_rng_fill(&r, dlse, p.nl, -1, 1);
        bk_attention_fwd(p.out, p.lse, p.q, p.k, p.v, p.qp, p.kp, &p.d);
        bk_attention_fwd_ref(out_r, lse_r, p.q, p.k, p.v, p.qp, p.kp, &p.d);
        assert_true(bk_rel_err(p.out, out_r, p.no) <= FWD_RTOL);
        assert_true(bk_rel_err(p.lse, lse_r, p.nl) <= FWD_RTOL);
        for (int pass = 0; pass < 2; pass++) {
            const float *gl = pass ? dlse : NULL;
            float *dq = zeros(p.nq), *dk = zeros(p.nk), *dv = zeros(p.nv);
            float *dqr = zeros(p.nq), *dkr = zeros(p.nk), *dvr = zeros(p.nv);
            memset(ds, 0, (size_t)d.Hq * sizeof *ds), memset(ds_r, 0, (size_t)d.Hq * sizeof *ds_r);
            p.d.dsinks = ds;
            bk_attention_bwd(dq, dk, dv, dout, gl, p.out, p.lse, p.q, p.k, p.v, p.qp, p.kp, &p.d);
            p.d.dsinks = ds_r;
            bk_attention_bwd_ref(dqr, dkr, dvr, dout, gl, out_r, lse_r, p.q, p.k, p.v, p.qp, p.kp, &p.d);
            double eq = bk_rel_err(dq, dqr, p.nq), ek = bk_rel_err(dk, dkr, p.nk), ev = bk_rel_err(dv, dvr, p.nv),
                   es = bk_rel_err(ds, ds_r, (size_t)d.Hq);
            if (eq > BWD_RTOL || ek > BWD_RTOL || ev > BWD_RTOL || es > BWD_RTOL)
                print_error("sinks case %zu dlse=%d: dq %.2e dk %.2e dv %.2e dsinks %.2e\n", c, pass, eq, ek, ev, es);
            assert_true(eq <= BWD_RTOL && ek <= BWD_RTOL && ev <= BWD_RTOL && es <= BWD_RTOL);
            for (int h = 0; h < d.Hq; h++) assert_true(ds_r[h] != 0.0f); /* the sinks do get a gradient */
            free(dq), free(dk), free(dv), free(dqr), free(dkr), free(dvr);
        }
        if (d.soft_cap == 0.0f) { /* the dot-product kernel (it has no soft cap) */
            size_t np = (size_t)d.B * d.Hq * d.Tq * d.Tk;
            float *probs = zeros(np), *o2 = zeros(p.no);
            bk_attention_dot_fwd(o2, probs, p.q, p.k, p.v, p.qp, p.kp, &p.d);
            assert_true(bk_rel_err(o2, out_r, p.no) <= FWD_RTOL);
            float *dq = zeros(p.nq), *dk = zeros(p.nk), *dv = zeros(p.nv);
            float *dqr = zeros(p.nq), *dkr = zeros(p.nk), *dvr = zeros(p.nv);
            memset(ds, 0, (size_t)d.Hq * sizeof *ds), memset(ds_r, 0, (size_t)d.Hq * sizeof *ds_r);
            p.d.dsinks = ds;
            bk_attention_dot_bwd(dq, dk, dv, dout, probs, p.q, p.k, p.v, &p.d);
            p.d.dsinks = ds_r;
            bk_attention_bwd_ref(dqr, dkr, dvr, dout, NULL, out_r, lse_r, p.q, p.k, p.v, p.qp, p.kp, &p.d);
            assert_true(bk_rel_err(dq, dqr, p.nq) <= BWD_RTOL && bk_rel_err(dk, dkr, p.nk) <= BWD_RTOL);
            assert_true(bk_rel_err(dv, dvr, p.nv) <= BWD_RTOL);
            /* the sink's probability is 1 - the keys' (float sums): a looser bound */
            assert_true(bk_rel_err(ds, ds_r, (size_t)d.Hq) <= 1e-4);
            free(probs), free(o2), free(dq), free(dk), free(dv), free(dqr), free(dkr), free(dvr);
        }
        free(out_r), free(lse_r), free(dout), free(dlse), free(sinks), free(ds), free(ds_r);
        prob_free(&p);
    }

    /* the twin's sink gradient against finite differences of its forward */
    {
        bk_attn_dims d = {2, 5, 7, 4, 2, 6, 4, 0.5f, 2, 3, 0.0f, 3, NULL, NULL};
        float sinks[4] = {0.3f, -0.7f, 1.1f, 0.0f}, g_sink[4] = {0};
        d.sinks = sinks;
        prob_t p = prob_new(&r, d);
        float *wo = zeros(p.no), *wl = zeros(p.nl), *o = zeros(p.no), *l = zeros(p.nl);
        bk_rng_fill(&r, wo, p.no, -1, 1);
        bk_rng_fill(&r, wl, p.nl, -1, 1);
        float *dq = zeros(p.nq), *dk = zeros(p.nk), *dv = zeros(p.nv);
        bk_attention_fwd_ref(p.out, p.lse, p.q, p.k, p.v, p.qp, p.kp, &p.d);
        p.d.dsinks = g_sink;
        bk_attention_bwd_ref(dq, dk, dv, wo, wl, p.out, p.lse, p.q, p.k, p.v, p.qp, p.kp, &p.d);
        fd_ctx c = {&p, wo, wl, o, l};
        double g[4];
        bk_fd_grad(fd_sink_loss, &c, sinks, 4, FD_EPS, g);
        double es = bk_rel_err_fd(g_sink, g, 4);
        print_message("attention sinks fd rel err %.2e\n", es);
        assert_true(es <= FD_RTOL);
        free(wo), free(wl), free(o), free(l), free(dq), free(dk), free(dv);
        prob_free(&p);
    }

    /* hand facts: one visible key, a sink of -inf, a query that sees nothing */
    {
        const float q[2] = {1.0f, 2.0f}, k[2] = {0.5f, -1.0f}, v[2] = {3.0f, -2.0f};
        const int32_t qp[2] = {0, -1}, kp[1] = {0};
        float sink = 0.25f, out[4], lse[2];
        bk_attn_dims d = {.B = 2, .Tq = 1, .Tk = 1, .Hq = 1, .Hkv = 1, .Dqk = 2, .Dv = 2, .scale = 1.0f};
        d.B = 1, d.sinks = &sink;
        const double s = 1.0 * 0.5 + 2.0 * -1.0, w = exp(s) / (exp(s) + exp(0.25));
        bk_attention_fwd(out, lse, q, k, v, qp, kp, &d);
        assert_true(fabs(out[0] - 3.0 * w) < 1e-6 && fabs(out[1] + 2.0 * w) < 1e-6);
        assert_true(fabs(lse[0] - log(exp(s) + exp(0.25))) < 1e-6);
        sink = -INFINITY; /* no sink: the key's value itself */
        bk_attention_fwd(out, lse, q, k, v, qp, kp, &d);
        assert_true(fabs(out[0] - 3.0) < 1e-6 && fabs(out[1] + 2.0) < 1e-6 && fabs(lse[0] - s) < 1e-6);
        sink = 0.25f; /* the query at position -1 sees no key: out 0, lse the sink */
        bk_attention_fwd(out, lse, q, k, v, qp + 1, kp, &d);
        assert_true(out[0] == 0.0f && out[1] == 0.0f && fabs(lse[0] - 0.25) < 1e-7);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_attention_vs_ref),          cmocka_unit_test(test_attention_fd),
        cmocka_unit_test(test_attention_soft_cap),        cmocka_unit_test(test_attention_permuted),
        cmocka_unit_test(test_attention_chunk),           cmocka_unit_test(test_attention_fully_masked),
        cmocka_unit_test(test_attention_tile_invariance), cmocka_unit_test(test_attention_threads_same_bits),
        cmocka_unit_test(test_attention_dot_vs_ref),      cmocka_unit_test(test_attention_window),
        cmocka_unit_test(test_attention_sinks),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
