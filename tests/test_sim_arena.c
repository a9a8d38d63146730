/* test_sim_arena.c — counted-only arena entries (sim_arena_charge, _discharge,
 * _back): a charge moves every figure exactly as an allocation of the same
 * counted bytes does (checked against a second arena that allocates), fails
 * the same simulated OOM naming the tensor, and holds no storage; a backed
 * charge is a real block the ordinary release frees.  A host block swapped
 * into a live block (sim_arena_swap) becomes its storage, contents and all,
 * with no figure moved, and is released, or reused, as the arena's own. */
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

static void test_swap_host_block(void **state)
{
    (void)state;
    enum { N = 300 * KIB };
    /* 3 KiB: freed when released; 2 MiB: kept in the cache (>= 16 KiB): both storage paths */
    for (size_t bytes = 3 * KIB; bytes <= (size_t)(2u << 20); bytes += (2u << 20) - 3 * KIB) {
        sim_arena *a = sim_arena_new("swap", 0, false);
        void *big = NULL, *p = NULL;
        /* a large peak, so that a released block of `bytes` may be kept in the cache */
        assert_int_equal(sim_arena_alloc(a, 64u << 20, SIM_MEM_PARAMS, "w", false, &big), SIM_OK);
        assert_int_equal(sim_arena_alloc_counted(a, bytes, bytes / 2, SIM_MEM_ACTIVATIONS, "y", true, &p), SIM_OK);
        sim_arena_stats before, after;
        sim_arena_get_stats(a, &before);
        unsigned char *h = sim_arena_block_new(bytes);
        assert_non_null(h);
        for (size_t i = 0; i < bytes; i++) h[i] = (unsigned char)(i * 7 + 1);
        void *q = p;
        sim_arena_swap(a, &q, h, bytes);
        assert_ptr_equal(q, h);
        sim_arena_get_stats(a, &after);
        assert_memory_equal(&before, &after, sizeof before);
        for (size_t i = 0; i < bytes; i++) assert_int_equal(((unsigned char *)q)[i], (unsigned char)(i * 7 + 1));
        /* the host block is the arena's now: released as y, the live figures drop by y's count */
        sim_arena_release_counted(a, q, bytes, bytes / 2, SIM_MEM_ACTIVATIONS);
        sim_arena_get_stats(a, &after);
        assert_int_equal(after.live, 64u << 20);
        /* the arena can still hand out and take back a block of the same size */
        assert_int_equal(sim_arena_alloc(a, bytes, SIM_MEM_TEMP, "t", false, &p), SIM_OK);
        memset(p, 3, bytes);
        sim_arena_release(a, p, bytes, SIM_MEM_TEMP);
        sim_arena_release(a, big, 64u << 20, SIM_MEM_PARAMS);
        sim_arena_get_stats(a, &after);
        assert_int_equal(after.live, 0);
        sim_arena_block_free(sim_arena_block_new(N)); /* a host block never swapped goes back as it came */
        sim_arena_block_free(NULL);
        sim_arena_free_all(a);
    }
}

/* A released block of 16 KiB or more comes back to the next request of exactly its size (its
 * storage is reused: the same pointer), never to one of another size; many sizes at once keep
 * their own blocks (the cache's buckets); blocks under 16 KiB are not kept. */
static void test_cache_reuses_same_size(void **state)
{
    (void)state;
    sim_arena *a = sim_arena_new("cache", 0, false);
    void *big = NULL; /* a peak whose eighth (the cache's bound) holds every block below: ~12 MiB */
    assert_int_equal(sim_arena_alloc(a, 128u << 20, SIM_MEM_PARAMS, "w", false, &big), SIM_OK);
    enum { NS = 40 };
    void *p[NS], *q[NS];
    for (int i = 0; i < NS; i++) /* 16 KiB .. ~600 KiB, sizes that share buckets too */
        assert_int_equal(sim_arena_alloc(a, (size_t)(16 + 15 * i) * KIB + 64 * (i % 3), SIM_MEM_TEMP, "t", false, &p[i]),
                         SIM_OK);
    for (int i = 0; i < NS; i++) sim_arena_release(a, p[i], (size_t)(16 + 15 * i) * KIB + 64 * (i % 3), SIM_MEM_TEMP);
    for (int i = NS - 1; i >= 0; i--) {
        assert_int_equal(sim_arena_alloc(a, (size_t)(16 + 15 * i) * KIB + 64 * (i % 3), SIM_MEM_TEMP, "t", false, &q[i]),
                         SIM_OK);
        assert_ptr_equal(q[i], p[i]);
    }
    for (int i = 0; i < NS; i++) sim_arena_release(a, q[i], (size_t)(16 + 15 * i) * KIB + 64 * (i % 3), SIM_MEM_TEMP);
    /* a size no released block has: a new block (every cached one is still there to be found) */
    void *r = NULL;
    assert_int_equal(sim_arena_alloc(a, 17 * KIB, SIM_MEM_TEMP, "r", false, &r), SIM_OK);
    for (int i = 0; i < NS; i++) assert_ptr_not_equal(r, p[i]);
    sim_arena_release(a, r, 17 * KIB, SIM_MEM_TEMP);
    for (int i = 0; i < NS; i++) {
        assert_int_equal(sim_arena_alloc(a, (size_t)(16 + 15 * i) * KIB + 64 * (i % 3), SIM_MEM_TEMP, "t", false, &q[i]),
                         SIM_OK);
        assert_ptr_equal(q[i], p[i]);
    }
    for (int i = 0; i < NS; i++) sim_arena_release(a, q[i], (size_t)(16 + 15 * i) * KIB + 64 * (i % 3), SIM_MEM_TEMP);
    sim_arena_release(a, big, 128u << 20, SIM_MEM_PARAMS);
    sim_arena_free_all(a);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_charge_counts_as_alloc),
        cmocka_unit_test(test_charge_oom),
        cmocka_unit_test(test_swap_host_block),
        cmocka_unit_test(test_cache_reuses_same_size),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
