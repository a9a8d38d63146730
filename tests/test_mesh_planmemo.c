/* test_mesh_planmemo.c — the per-thread memo of resharding-plan bytes answers
 * what mesh_plan_make answers: the same bytes, the same "no plan", on first
 * sight and on every repeat, and nothing from another mesh. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mesh/planmemo.h"

static mesh_shape make_mesh(int n, const char *const *names, const int *sizes)
{
    mesh_shape m;
    assert_int_equal(mesh_shape_init(&m, n, names, sizes), SIM_OK);
    return m;
}

static uint64_t rng(uint64_t *s) /* xorshift64* */
{
    *s ^= *s >> 12;
    *s ^= *s << 25;
    *s ^= *s >> 27;
    return *s * 2685821657736338717ull;
}

/* Each mesh axis lands on a random dim (or none, or the partial set), in random order. */
static mesh_spec random_spec(const mesh_shape *m, int rank, uint64_t *s)
{
    mesh_spec sp;
    memset(&sp, 0, sizeof sp);
    sp.rank = rank;
    for (int a = 0; a < m->n_axes; a++) {
        int where = (int)(rng(s) % (uint64_t)(rank + 2)); /* rank: replicated, rank + 1: partial */
        if (where < rank) sp.axes[where][sp.n_axes[where]++] = (int8_t)a;
        else if (where == rank + 1 && rng(s) % 3 == 0) sp.partial |= 1u << a;
    }
    return sp;
}

typedef struct {
    int n_same, n_none; /* cases with bytes, cases without a plan */
} tally;

static void compare(const mesh_shape *m, int rank, const int64_t *shape, const mesh_spec *from, const mesh_spec *to,
                    tally *t)
{
    mesh_plan *direct = malloc(sizeof *direct), *scratch = malloc(sizeof *scratch);
    bool want_ok = mesh_spec_equal(from, to) ||
                   mesh_plan_make(m, "x", rank, shape, SIM_F32, from, to, direct) == SIM_OK;
    uint64_t want = mesh_spec_equal(from, to) ? 0 : want_ok ? direct->total_bytes : 0;
    sim_err_clear();
    for (int rep = 0; rep < 2; rep++) { /* the first call fills the slot, the second reads it */
        uint64_t got = 12345;
        bool ok = mesh_plan_bytes_memo(m, scratch, "x", rank, shape, from, to, &got);
        sim_err_clear();
        assert_int_equal(ok, want_ok);
        if (ok) assert_int_equal(got, want);
    }
    if (want_ok) t->n_same++;
    else t->n_none++;
    free(direct);
    free(scratch);
}

static void test_memo_equals_planner(void **state)
{
    (void)state;
    const char *names[] = {"data", "fsdp", "tensor", "expert"};
    int sizes_a[] = {2, 4, 2, 1}, sizes_b[] = {4, 2, 1, 2}; /* same names, another mesh */
    mesh_shape ma = make_mesh(4, names, sizes_a), mb = make_mesh(4, names, sizes_b);
    const int64_t shapes[][3] = {{16, 32, 8}, {8, 64, 4}, {3, 16, 8} /* 3 divides by nothing: some specs have no plan */};
    uint64_t s = 0x9e3779b97f4a7c15ull;
    tally t = {0, 0};
    for (int i = 0; i < 3000; i++) {
        /* few distinct cases, asked many times, alternating meshes: hits, misses and evictions */
        uint64_t pick = rng(&s) % 40, cs = pick * 7919 + 1;
        const int64_t *shape = shapes[pick % 3];
        int rank = 2 + (int)(pick % 2);
        const mesh_shape *m = (rng(&s) & 1) ? &ma : &mb;
        mesh_spec from = random_spec(m, rank, &cs), to = random_spec(m, rank, &cs);
        to.partial &= from.partial; /* a plan can reduce partial sums, not make them */
        compare(m, rank, shape, &from, &to, &t);
    }
    assert_true(t.n_same > 100); /* both kinds were exercised */
    assert_true(t.n_none > 100);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_memo_equals_planner),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
