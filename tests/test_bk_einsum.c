/* test_bk_einsum.c — bk_einsum against bk_einsum_ref on the einsums of a transformer (projections,
 * attention scores and values, MoE), transposed layouts that need copies, odd sizes, size-1 and
 * size-0 dims, summed-away indices, accumulation (beta = 1) and the parser's error messages.
 * Integer-valued data keeps every sum exact, so results must match bit for bit. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "blas_kernels/bk_check.h"
#include "blas_kernels/bk_einsum.h"

typedef struct {
    const char *sub;
    int ra, rb;
    int64_t sa[6], sb[6];
} ein_case;

static int64_t numel(const int64_t *s, int r)
{
    int64_t n = 1;
    for (int i = 0; i < r; i++) n *= s[i];
    return n;
}

static void fill_int(bk_rng *r, float *x, int64_t n)
{
    for (int64_t i = 0; i < n; i++) x[i] = (float)(bk_rng_int(r, 7) - 3);
}

static void check_case(const ein_case *c, bk_rng *r)
{
    bk_einsum_dims d;
    char err[256];
    if (bk_einsum_parse(c->sub, c->ra, c->sa, c->rb, c->sb, &d, err, sizeof err) != 0) fail_msg("%s", err);
    int64_t na = numel(c->sa, c->ra), nb = numel(c->sb, c->rb), no = numel(d.out_shape, d.ro);
    float *a = malloc((size_t)(na ? na : 1) * sizeof *a), *b = malloc((size_t)(nb ? nb : 1) * sizeof *b);
    float *o = malloc((size_t)(no ? no : 1) * sizeof *o), *oref = malloc((size_t)(no ? no : 1) * sizeof *o);
    fill_int(r, a, na);
    fill_int(r, b, nb);
    /* beta = 0 must ignore the output's contents */
    for (int64_t i = 0; i < no; i++) o[i] = NAN, oref[i] = NAN;
    bk_einsum(c->sub, o, a, c->ra, c->sa, b, c->rb, c->sb, 0.0f);
    bk_einsum_ref(c->sub, oref, a, c->ra, c->sa, b, c->rb, c->sb, 0.0f);
    for (int64_t i = 0; i < no; i++)
        if (o[i] != oref[i])
            fail_msg("%s beta=0: element %lld is %g, expected %g", c->sub, (long long)i, o[i], oref[i]);
    /* beta = 1 accumulates (gradients), on integer data again */
    fill_int(r, o, no);
    memcpy(oref, o, (size_t)no * sizeof *o);
    bk_einsum(c->sub, o, a, c->ra, c->sa, b, c->rb, c->sb, 1.0f);
    bk_einsum_ref(c->sub, oref, a, c->ra, c->sa, b, c->rb, c->sb, 1.0f);
    for (int64_t i = 0; i < no; i++)
        if (o[i] != oref[i])
            fail_msg("%s beta=1: element %lld is %g, expected %g", c->sub, (long long)i, o[i], oref[i]);
    /* real-valued data with a general beta: float rounding only */
    bk_rng_fill(r, a, (size_t)na, -1, 1);
    bk_rng_fill(r, b, (size_t)nb, -1, 1);
    bk_rng_fill(r, o, (size_t)no, -1, 1);
    memcpy(oref, o, (size_t)no * sizeof *o);
    bk_einsum(c->sub, o, a, c->ra, c->sa, b, c->rb, c->sb, 0.5f);
    bk_einsum_ref(c->sub, oref, a, c->ra, c->sa, b, c->rb, c->sb, 0.5f);
    if (no) {
        double e = bk_rel_err(o, oref, (size_t)no);
        if (e > 1e-5) fail_msg("%s beta=0.5: relative error %g", c->sub, e);
    }
    free(a), free(b), free(o), free(oref);
}

static void test_einsum_vs_ref(void **state)
{
    (void)state;
    bk_rng r = {42};
    const ein_case cases[] = {
        {"btd,dh->bth", 3, 2, {2, 5, 7}, {7, 3}},              // projection, no copy
        {"bth,hd->btd", 3, 2, {3, 4, 9}, {9, 5}},              // output projection
        {"bsnh,btnh->bnst", 4, 4, {2, 5, 3, 4}, {2, 6, 3, 4}}, // attention scores, strided batch
        {"bnst,btnh->bsnh", 4, 4, {2, 3, 5, 6}, {2, 6, 3, 4}}, // attention values
        {"ij,jk->ik", 2, 2, {17, 33}, {33, 9}},                // odd sizes
        {"ji,jk->ik", 2, 2, {13, 7}, {13, 5}},                 // a stored transposed
        {"ij,kj->ik", 2, 2, {7, 13}, {5, 13}},                 // b stored transposed
        {"ij,jk->ki", 2, 2, {7, 6}, {6, 5}},                   // output transposed
        {"ijb,jkb->bik", 3, 3, {4, 5, 3}, {5, 6, 3}},          // batch innermost: copies
        {"i,j->ij", 1, 1, {7}, {5}},                           // outer product, no contraction
        {"i,i->", 1, 1, {11}, {11}},                           // dot product, scalar output
        {"bij,bj->bi", 3, 2, {3, 4, 5}, {3, 5}},               // batched matvec
        {"ijk,jkl->il", 3, 3, {3, 4, 5}, {4, 5, 6}},           // two contraction letters
        {"ikj,jkl->li", 3, 3, {3, 5, 4}, {4, 5, 6}},           // contraction letters out of order
        {"abc,cd->abd", 3, 2, {1, 5, 1}, {1, 4}},              // size-1 dims
        {"ij,kl->il", 2, 2, {3, 4}, {5, 6}},                   // j and k summed away
        {"bsec,ecd->bsed", 4, 3, {2, 3, 4, 5}, {4, 5, 6}},     // MoE: expert as batch
        {"bsd,bsd->bs", 3, 3, {2, 7, 9}, {2, 7, 9}},           // row-wise dot products
        {"ij,jk->ik", 2, 2, {0, 3}, {3, 4}},                   // empty output
        {"ij,jk->ik", 2, 2, {3, 0}, {0, 4}},                   // empty contraction: beta * out
        {" b t d , d h -> b t h ", 3, 2, {2, 3, 4}, {4, 5}},   // spaces are ignored
        {"btd,bth->dh", 3, 3, {2, 5, 7}, {2, 5, 3}},           // weight gradient
        {"bth,dh->btd", 3, 2, {2, 5, 3}, {7, 3}},              // input gradient
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) check_case(&cases[i], &r);
}

static void test_einsum_roles(void **state)
{
    (void)state;
    bk_einsum_dims d;
    char err[256];
    int64_t sa[] = {2, 5, 3, 4}, sb[] = {2, 6, 3, 4};
    assert_int_equal(bk_einsum_parse("bsnh,btnh->bnst", 4, sa, 4, sb, &d, err, sizeof err), 0);
    assert_int_equal(d.role['b' - 'a'], BK_EIN_BATCH);
    assert_int_equal(d.role['n' - 'a'], BK_EIN_BATCH);
    assert_int_equal(d.role['s' - 'a'], BK_EIN_LHS_FREE);
    assert_int_equal(d.role['t' - 'a'], BK_EIN_RHS_FREE);
    assert_int_equal(d.role['h' - 'a'], BK_EIN_CONTRACT);
    assert_int_equal(d.role['z' - 'a'], BK_EIN_UNUSED);
    assert_int_equal(d.ro, 4);
    int64_t want[] = {2, 3, 5, 6};
    for (int i = 0; i < 4; i++) assert_int_equal(d.out_shape[i], want[i]);
}

/* The layouts model code uses run straight on the buffers; a batch letter innermost forces copies. */
static void test_einsum_no_copy(void **state)
{
    (void)state;
    int64_t x[] = {2, 5, 7}, w[] = {7, 3}, q[] = {2, 5, 3, 4}, k[] = {2, 6, 3, 4}, p[] = {2, 3, 5, 6};
    int64_t h[] = {2, 5, 3}, wo[] = {3, 7}, m1[] = {13, 7}, m2[] = {13, 5}, ib[] = {4, 5, 3}, jb[] = {5, 6, 3};
    assert_int_equal(bk_einsum_copied("btd,dh->bth", 3, x, 2, w), 0);
    assert_int_equal(bk_einsum_copied("bth,hd->btd", 3, h, 2, wo), 0);
    assert_int_equal(bk_einsum_copied("bsnh,btnh->bnst", 4, q, 4, k), 0);
    assert_int_equal(bk_einsum_copied("bnst,btnh->bsnh", 4, p, 4, k), 0);
    assert_int_equal(bk_einsum_copied("ji,jk->ik", 2, m1, 2, m2), 0); /* transposed a: sgemm trans flag */
    assert_int_equal(bk_einsum_copied("btd,bth->dh", 3, x, 3, h), 0); /* weight gradient */
    assert_int_equal(bk_einsum_copied("bth,dh->btd", 3, h, 2, w), 0); /* input gradient */
    assert_true(bk_einsum_copied("ijb,jkb->bik", 3, ib, 3, jb) > 0);
    /* the output written in place (beta = 1 then accumulates inside sgemm): every layout above,
   * including the one whose inputs are copied; an output whose row letters are not nested (t
   * outermost, b innermost, d between) goes through a scratch result */
    assert_true(bk_einsum_out_direct("btd,dh->bth", 3, x, 2, w));
    assert_true(bk_einsum_out_direct("bth,dh->btd", 3, h, 2, w));
    assert_true(bk_einsum_out_direct("bnst,btnh->bsnh", 4, p, 4, k));
    assert_true(bk_einsum_out_direct("ijb,jkb->bik", 3, ib, 3, jb));
    assert_true(bk_einsum_out_direct("ij,jk->ki", 2, (int64_t[]){7, 6}, 2, (int64_t[]){6, 5})); /* C^T = B^T A^T */
    assert_false(bk_einsum_out_direct("bth,hd->tdb", 3, h, 2, wo));
    assert_true(bk_einsum_copied("bth,hd->tdb", 3, h, 2, wo) > 0);
}

static void test_einsum_parse_errors(void **state)
{
    (void)state;
    char err[256];
    int64_t s2a[] = {4, 5}, s2b[] = {5, 6}, s2c[] = {4, 6};
    struct {
        const char *sub;
        const int64_t *sb;
        int rb;
        const char *needle;
    } bad[] = {
        {"ij,jk", s2b, 2, "explicit"},
        {"ij,jk->iz", s2b, 2, "output index 'z' appears in neither operand"},
        {"iJ,jk->ik", s2b, 2, "not an index letter"},
        {"i...,jk->ik", s2b, 2, "ellipsis"},
        {"ii,ik->ik", s2b, 2, "index 'i' appears twice in operand 0"},
        {"ij,jk->ii", s2b, 2, "index 'i' appears twice in the output"},
        {"ijk,jk->ik", s2b, 2, "operand 0 has 3 indices 'ijk' but the array has rank 2"},
        {"ij,jk->ik", s2c, 2, "index 'j' has size 5 in operand 0 (dim 1) but 4 in operand 1 (dim 0)"},
        {"ij,jk,kl->il", s2b, 2, "only two operands"},
        {"ij->ij", s2b, 2, "two operands"},
        {"ij,jk->i-k", s2b, 2, "unexpected"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        err[0] = '\0';
        assert_int_equal(bk_einsum_parse(bad[i].sub, 2, s2a, bad[i].rb, bad[i].sb, NULL, err, sizeof err), -1);
        if (!strstr(err, bad[i].needle)) fail_msg("'%s': message \"%s\" lacks \"%s\"", bad[i].sub, err, bad[i].needle);
        assert_non_null(strstr(err, "einsum '"));
    }
}

static void test_permute(void **state)
{
    (void)state;
    int64_t shape[] = {2, 3, 4};
    int perm[] = {2, 0, 1};
    float in[24], out[24];
    int32_t iin[24], iout[24];
    for (int i = 0; i < 24; i++) in[i] = (float)i, iin[i] = i;
    bk_permute(out, in, sizeof(float), 3, shape, perm);
    bk_permute(iout, iin, sizeof(int32_t) * 1, 3, shape, perm);
    /* out (4, 2, 3): out[k][i][j] = in[i][j][k] */
    for (int k = 0; k < 4; k++)
        for (int i = 0; i < 2; i++)
            for (int j = 0; j < 3; j++) {
                assert_true(out[(k * 2 + i) * 3 + j] == in[(i * 3 + j) * 4 + k]);
                assert_int_equal(iout[(k * 2 + i) * 3 + j], iin[(i * 3 + j) * 4 + k]);
            }
    /* 2-byte elements take the generic path */
    uint16_t hin[24], hout[24];
    for (int i = 0; i < 24; i++) hin[i] = (uint16_t)i;
    bk_permute(hout, hin, sizeof(uint16_t), 3, shape, perm);
    for (int k = 0; k < 4; k++)
        for (int i = 0; i < 2; i++)
            for (int j = 0; j < 3; j++) assert_int_equal(hout[(k * 2 + i) * 3 + j], hin[(i * 3 + j) * 4 + k]);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_einsum_vs_ref),  cmocka_unit_test(test_einsum_roles),
        cmocka_unit_test(test_einsum_no_copy), cmocka_unit_test(test_einsum_parse_errors),
        cmocka_unit_test(test_permute),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
