/* test_sim_arena.c — counted-only arena entries (sim_arena_charge, _discharge,
 * _back): a charge moves every figure exactly as an allocation of the same
 * counted bytes does (checked against a second arena that allocates), fails
 * the same simulated OOM naming the tensor, and holds no storage; a backed
 * charge is a real block the ordinary release frees. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <string.h>

#include "sim/arena.h"

enum { KIB = 1024 };

static void same_stats(const sim_arena *a, const sim_arena *b)
{
    sim_arena_stats x, y;
    sim_arena_get_stats(a, &x);
    sim_arena_get_stats(b, &y);
    assert_memory_equal(&x, &y, sizeof x);
}

static void test_charge_counts_as_alloc(void **state)
{
    (void)state;
    for (int dry = 0; dry < 2; dry++) {
        sim_arena *charged = sim_arena_new("charged", 0, dry), *alloced = sim_arena_new("alloced", 0, dry);
        void *w = NULL, *w2 = NULL, *t = NULL, *g = NULL;
        /* a parameter, then a gathered copy counted in bfloat16 (half its float32 storage) */
        assert_int_equal(sim_arena_alloc(charged, 8 * KIB, SIM_MEM_PARAMS, "w", false, &w), SIM_OK);
        assert_int_equal(sim_arena_alloc(alloced, 8 * KIB, SIM_MEM_PARAMS, "w", false, &w2), SIM_OK);
        assert_int_equal(sim_arena_charge(charged, 16 * KIB, SIM_MEM_TEMP, "w/gathered"), SIM_OK);
        assert_int_equal(sim_arena_alloc_counted(alloced, 32 * KIB, 16 * KIB, SIM_MEM_TEMP, "w/gathered", false, &g),
                         SIM_OK);
        same_stats(charged, alloced);
        sim_arena_stats st;
        sim_arena_get_stats(charged, &st);
        assert_int_equal(st.live, 24 * KIB);
        assert_int_equal(st.live_by[SIM_MEM_TEMP], 16 * KIB);
        assert_int_equal(st.n_allocs, 2);
        /* a charge given storage later (a copy for a step in place): no figure moves */
        assert_int_equal(sim_arena_back(charged, 32 * KIB, SIM_MEM_TEMP, "w/gathered", &t), SIM_OK);
        assert_true(dry ? t == NULL : t != NULL);
        if (t) memset(t, 1, 32 * KIB); /* its storage is real (ASan checks the size) */
        same_stats(charged, alloced);
        /* gone the ordinary way: the peak stays, live drops */
        sim_arena_release_counted(charged, t, 32 * KIB, 16 * KIB, SIM_MEM_TEMP);
        sim_arena_release_counted(alloced, g, 32 * KIB, 16 * KIB, SIM_MEM_TEMP);
        same_stats(charged, alloced);
        /* a charge undone by a discharge */
        assert_int_equal(sim_arena_charge(charged, 4 * KIB, SIM_MEM_ACTIVATIONS, "x"), SIM_OK);
        assert_int_equal(sim_arena_alloc(alloced, 4 * KIB, SIM_MEM_ACTIVATIONS, "x", false, &g), SIM_OK);
        sim_arena_discharge(charged, 4 * KIB, SIM_MEM_ACTIVATIONS);
        sim_arena_release(alloced, g, 4 * KIB, SIM_MEM_ACTIVATIONS);
        same_stats(charged, alloced);
        sim_arena_get_stats(charged, &st);
        assert_int_equal(st.live, 8 * KIB);
        assert_int_equal(st.peak, 24 * KIB);
        assert_int_equal(st.peak_by[SIM_MEM_ACTIVATIONS], 4 * KIB);
        sim_arena_release(charged, w, 8 * KIB, SIM_MEM_PARAMS);
        sim_arena_release(alloced, w2, 8 * KIB, SIM_MEM_PARAMS);
        sim_arena_free_all(charged);
        sim_arena_free_all(alloced);
    }
}

static void test_charge_oom(void **state)
{
    (void)state;
    sim_arena *a = sim_arena_new("device 5", 10 * KIB, false);
    assert_int_equal(sim_arena_charge(a, 6 * KIB, SIM_MEM_TEMP, "layers/mlp/wi"), SIM_OK);
    assert_int_equal(sim_arena_charge(a, 6 * KIB, SIM_MEM_TEMP, "layers/mlp/wo"), SIM_ERR_OOM);
    assert_non_null(strstr(sim_errmsg(), "device 5"));
    assert_non_null(strstr(sim_errmsg(), "layers/mlp/wo"));
    sim_arena_stats st;
    sim_arena_get_stats(a, &st);
    assert_int_equal(st.live, 6 * KIB); /* the refused charge counted nothing */
    assert_int_equal(st.n_allocs, 1);
    sim_arena_discharge(a, 6 * KIB, SIM_MEM_TEMP);
    sim_arena_get_stats(a, &st);
    assert_int_equal(st.live, 0);
    sim_arena_free_all(a);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_charge_counts_as_alloc),
        cmocka_unit_test(test_charge_oom),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
