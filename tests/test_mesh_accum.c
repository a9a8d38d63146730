/* test_mesh_accum.c — mesh_einsum_into: an einsum whose product is added into an existing array
 * (a cotangent sum) by sgemm with beta = 1, on 2 devices (mesh axis 'x'), against mesh_einsum and
 * a separate add (what mesh_tape_accumulate does):
 *   - fused where the placement's output spec equals acc's: a batch-sharded product, and a product
 *     partial over 'x' (contraction dim sharded on both sides) into a partial acc;
 *   - each fused and each separate result within the float32 summation bound of the double sum
 *     c + sum_k a_k b_k: |computed - exact| <= gamma_(K+1) (|c| + sum_k |a_k b_k|),
 *     gamma_n = n u / (1 - n u), u = 2^-24, whatever the order sgemm adds in (the K = 1100 terms
 *     span several of sgemm's K blocks, so the old value joins early in one and last in the other);
 *   - the same collective records and the same arena figures (peak, allocations, live) as the
 *     separate path: the product is counted as a ghost while it would have lived;
 *   - falls back, acc untouched and the product as mesh_einsum's, where acc's spec differs (not
 *     partial where the product is) or the kernel would write through a scratch layout. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>

#include "blas_kernels/bk_einsum.h"
#include "mesh/ops.h"
#include "mesh/tape.h"
#include "sim/arena.h"
#include "tests/helpers.h"

enum { B = 2, T = 3, K = 1100, D = 5, NDEV = 2, NCASE = 4 };

typedef struct {
    const char *sub, *spec_a, *spec_b, *spec_acc;
    int64_t sa[3], sb[3], sacc[3];
    int ra, rb, racc;
    bool fuse; /* expected */
} acase;

static const acase CASES[NCASE] = {
    /* batch sharded, weight replicated: the product comes out P('x') as acc */
    {"btk,kd->btd",
     "P('x', None, None)",
     "P(None, None)",
     "P('x', None, None)",
     {B, T, K},
     {K, D},
     {B, T, D},
     3,
     2,
     3,
     true},
    /* contraction sharded on both sides: the product is partial over 'x', as acc */
    {"btk,kd->btd",
     "P(None, None, 'x')",
     "P('x', None)",
     "P(None, None, None, unreduced={'x'})",
     {B, T, K},
     {K, D},
     {B, T, D},
     3,
     2,
     3,
     true},
    /* the same product into a reduced acc: specs differ (the add would need the all-reduce first) */
    {"btk,kd->btd",
     "P(None, None, 'x')",
     "P('x', None)",
     "P(None, None, None)",
     {B, T, K},
     {K, D},
     {B, T, D},
     3,
     2,
     3,
     false},
    /* specs equal (replicated) but the output's rows (t outermost, b innermost) are not one view */
    {"btk,kd->tdb",
     "P(None, None, None)",
     "P(None, None)",
     "P(None, None, None)",
     {B, T, K},
     {K, D},
     {T, D, B},
     3,
     2,
     3,
     false},
};

typedef struct {
    mesh_shape mesh;
    /* per device and case, written by the device thread */
    bool fused[NDEV][NCASE];
    double worst[NDEV][NCASE][2]; /* |computed - exact| / bound: fused path, separate path */
    int acc_kept[NDEV][NCASE];    /* fallback: acc bits unchanged and the product as mesh_einsum's */
    size_t nrec[NDEV][NCASE][2];
    uint64_t sent[NDEV][NCASE][2];
    sim_arena_stats mem[NDEV][NCASE][2];
} job;

static float val(uint64_t i, uint64_t salt) /* deterministic values in [-1, 1) */
{
    uint64_t h = (i + 1) * 0x9e3779b97f4a7c15ull ^ salt * 0xbf58476d1ce4e5b9ull;
    h ^= h >> 31;
    return (float)((double)(h >> 40) / (double)(1ull << 23) - 1.0);
}

static sim_status make(sim_device *d, const mesh_shape *m, const char *name, const char *spec, int rank,
                       const int64_t *shape, uint64_t salt, mesh_array *out)
{
    mesh_spec s;
    SIM_TRY(mesh_spec_parse(spec, m, &s));
    SIM_TRY(mesh_array_new(d, m, name, rank, shape, &s, SIM_F32, SIM_MEM_ACTIVATIONS, out));
    float *p = out->data;
    for (size_t i = 0; i < out->nlocal; i++) p[i] = val(i, salt + 31u * (uint64_t)sim_device_id(d));
    return SIM_OK;
}

/* Worst |got - exact| / bound over the local product of a fused-eligible case (the local product
 * is a_local x b_local: no operand moves in the first two cases), c = acc's old local values. */
static double worst_ratio(const mesh_array *a, const mesh_array *b, const float *c, const float *got)
{
    const double u = ldexp(1.0, -24);
    int64_t kl = a->local[2], n = kl + 1;
    double gamma = (double)n * u / (1.0 - (double)n * u), worst = 0.0;
    const float *pa = a->data, *pb = b->data;
    for (int64_t r = 0; r < a->local[0] * a->local[1]; r++)
        for (int64_t j = 0; j < D; j++) {
            double exact = c[r * D + j], mag = fabs(c[r * D + j]);
            for (int64_t k = 0; k < kl; k++) {
                double p = (double)pa[r * kl + k] * pb[k * D + j];
                exact += p;
                mag += fabs(p);
            }
            double ratio = fabs(got[r * D + j] - exact) / (gamma * mag);
            if (ratio > worst) worst = ratio;
        }
    return worst;
}

static sim_status one_case(sim_device *d, job *j, int ci)
{
    const acase *c = &CASES[ci];
    int id = sim_device_id(d);
    mesh_ctx ctx = {.dev = d, .mesh = &j->mesh, .mode = MESH_MODE_AUTO, .drop_size_one = true, .layer = "layer"};
    mesh_array a, b, acc, acc2, out, out2;
    SIM_TRY(make(d, &j->mesh, "a", c->spec_a, c->ra, c->sa, 1, &a));
    SIM_TRY(make(d, &j->mesh, "b", c->spec_b, c->rb, c->sb, 2, &b));
    SIM_TRY(make(d, &j->mesh, "acc", c->spec_acc, c->racc, c->sacc, 3, &acc));
    SIM_TRY(make(d, &j->mesh, "acc", c->spec_acc, c->racc, c->sacc, 3, &acc2));
    float old[B * T * D];
    memcpy(old, acc.data, acc.nlocal * sizeof(float));
    sim_arena *ar = sim_device_arena(d);
    size_t n;

    /* the separate path: the product apart, then the add where the specs allow it */
    sim_arena_reset_peak(ar);
    sim_device_clear_records(d);
    SIM_TRY(mesh_einsum(&ctx, c->sub, &a, &b, NULL, "e", SIM_MEM_TEMP, &out2, NULL));
    bool same = mesh_spec_equal(&out2.spec, &acc2.spec);
    if (same) mesh_local_add(&acc2, &out2);
    const sim_record *rec = sim_device_records(d, &n);
    j->nrec[id][ci][1] = n;
    for (size_t i = 0; i < n; i++) j->sent[id][ci][1] += rec[i].bytes_sent;
    float prod[B * T * D];
    size_t nprod = out2.nlocal;
    memcpy(prod, out2.data, nprod * sizeof(float));
    mesh_array_free(d, &out2);
    sim_arena_get_stats(ar, &j->mem[id][ci][1]);

    /* the fused path */
    sim_arena_reset_peak(ar);
    sim_device_clear_records(d);
    bool fused;
    SIM_TRY(mesh_einsum_into(&ctx, c->sub, &a, &b, &acc, "e", SIM_MEM_TEMP, &out, &fused));
    j->fused[id][ci] = fused;
    rec = sim_device_records(d, &n);
    j->nrec[id][ci][0] = n;
    for (size_t i = 0; i < n; i++) j->sent[id][ci][0] += rec[i].bytes_sent;
    if (fused) {
        mesh_array_free(d, &out);
        sim_arena_get_stats(ar, &j->mem[id][ci][0]);
        j->worst[id][ci][0] = worst_ratio(&a, &b, old, acc.data);
        j->worst[id][ci][1] = worst_ratio(&a, &b, old, acc2.data);
    } else {
        j->acc_kept[id][ci] = !memcmp(acc.data, old, acc.nlocal * sizeof(float)) && out.nlocal == nprod &&
                              !memcmp(out.data, prod, nprod * sizeof(float));
        mesh_array_free(d, &out);
        sim_arena_get_stats(ar, &j->mem[id][ci][0]);
    }
    mesh_array_free(d, &a);
    mesh_array_free(d, &b);
    mesh_array_free(d, &acc);
    mesh_array_free(d, &acc2);
    return SIM_OK;
}

static sim_status run_device(sim_device *d, void *arg)
{
    for (int ci = 0; ci < NCASE; ci++) SIM_TRY(one_case(d, arg, ci));
    return SIM_OK;
}

static void test_einsum_into(void **state)
{
    (void)state;
    static job j;
    memset(&j, 0, sizeof j);
    const char *names[] = {"x"};
    int two[] = {NDEV};
    assert_int_equal(mesh_shape_init(&j.mesh, 1, names, two), SIM_OK);
    sim_machine *m = helper_machine(&j.mesh, false);
    sim_status st = sim_machine_run(m, run_device, &j);
    sim_machine_free(m);
    if (st) fail_msg("run failed: %s", sim_errmsg());
    for (int id = 0; id < NDEV; id++)
        for (int ci = 0; ci < NCASE; ci++) {
            const acase *c = &CASES[ci];
            if (j.fused[id][ci] != c->fuse)
                fail_msg("case %d (%s into %s), device %d: fused %d, expected %d", ci, c->sub, c->spec_acc, id,
                         j.fused[id][ci], c->fuse);
            if (c->fuse)
                for (int p = 0; p < 2; p++)
                    if (!(j.worst[id][ci][p] <= 1.0))
                        fail_msg("case %d device %d %s path: error %.3g x the summation bound", ci, id,
                                 p ? "separate" : "fused", j.worst[id][ci][p]);
            if (!c->fuse && !j.acc_kept[id][ci])
                fail_msg("case %d device %d: a fallback changed acc or made another product", ci, id);
            assert_int_equal(j.nrec[id][ci][0], j.nrec[id][ci][1]);
            assert_int_equal(j.sent[id][ci][0], j.sent[id][ci][1]);
            const sim_arena_stats *f = &j.mem[id][ci][0], *s = &j.mem[id][ci][1];
            assert_int_equal(f->peak, s->peak);
            assert_int_equal(f->live, s->live);
            for (int k = 0; k < SIM_NMEM; k++) assert_int_equal(f->peak_by[k], s->peak_by[k]);
        }
    for (int ci = 0; ci < 2; ci++) /* an old value dropped or added twice would be ~|c|: tens of bounds */
        printf("  case %d: worst error %.3g (fused), %.3g (separate) of the bound\n", ci, j.worst[0][ci][0],
               j.worst[0][ci][1]);
    /* the partial case moved nothing, the batch-sharded one nothing either: no collective at all */
    assert_int_equal(j.nrec[0][0][0] + j.nrec[0][1][0], 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_einsum_into),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
