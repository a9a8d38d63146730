/* test_mesh_array.c — mesh/array.h: the distributed array, on a 2 x 3 mesh (x, y) with integer
 * data whose value is its global index, so every shard's contents are known exactly:
 *   - each device's shard of P('x', 'y'), P(None, 'y'), P(('x', 'y'), None) and a replicated
 *     array holds exactly the global elements its block covers (offsets from the block rule:
 *     block b of k along a dim of size n starts at b n / k), and storing the shards back gives
 *     the global array;
 *   - a partial array loads the value on the devices at coordinate 0 of its partial axes and 0
 *     elsewhere (the sum over them is the global), and storing it is refused;
 *   - a dim that does not divide over its axes is refused naming the array; a spec longer than
 *     the array is refused, a shorter one is padded with None;
 *   - the arena counts nlocal x the dtype's size in the array's category, and gives it back on free;
 *     a clone is a copy; a dry-run machine's arrays have no data but the same local shapes;
 *   - mesh_copy_block copies the selected block of a row-major array. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <string.h>

#include "mesh/array.h"
#include "tests/helpers.h"

enum { NX = 2, NY = 3, R = 4, C = 6, NDEV = NX * NY };

typedef struct {
    mesh_shape mesh;
    bool dry;
    float global[R * C];
    float back[3][R * C]; /* stored back, per spec */
    int bad[NDEV];        /* per device: elements not where the block rule puts them */
    int partial_bad[NDEV];
    sim_status partial_store[NDEV], indivisible[NDEV], too_long[NDEV];
    char indivisible_msg[256];
    int64_t padded_local[NDEV][2];
    size_t bytes_diff[NDEV], after_free[NDEV];
    int clone_bad[NDEV];
    bool dry_ok[NDEV];
} job;

static const char *const SPECS[3] = {"P('x', 'y')", "P(None, 'y')", "P(None, None)"};

static sim_status array_device(sim_device *dev, void *arg)
{
    job *j = arg;
    const mesh_shape *m = &j->mesh;
    int id = sim_device_id(dev), co[2];
    mesh_shape_coords(m, id, co);
    int64_t shape[2] = {R, C};
    sim_arena_stats s0, s1;
    for (int k = 0; k < 3; k++) {
        mesh_spec s;
        SIM_TRY(mesh_spec_parse(SPECS[k], m, &s));
        sim_arena_get_stats(sim_device_arena(dev), &s0);
        mesh_array a;
        SIM_TRY(mesh_array_new(dev, m, "a", 2, shape, &s, SIM_F32, SIM_MEM_ACTIVATIONS, &a));
        sim_arena_get_stats(sim_device_arena(dev), &s1);
        if (k == 0)
            j->bytes_diff[id] = s1.live_by[SIM_MEM_ACTIVATIONS] - s0.live_by[SIM_MEM_ACTIVATIONS] - a.nlocal * 4;
        if (j->dry) {
            j->dry_ok[id] = a.data == NULL && a.local[0] * a.local[1] == (int64_t)a.nlocal;
            mesh_array_free(dev, &a);
            return SIM_OK;
        }
        mesh_array_load_global(dev, m, &a, j->global);
        /* the block rule, by hand: rows split by the row axes' mixed-radix coordinate, columns likewise */
        int64_t r0 = 0, c0 = 0, nr = R, nc = C;
        if (k == 0) r0 = co[0] * (R / NX), nr = R / NX, c0 = co[1] * (C / NY), nc = C / NY;
        if (k == 1) c0 = co[1] * (C / NY), nc = C / NY;
        if (a.local[0] != nr || a.local[1] != nc) j->bad[id]++;
        const float *v = a.data;
        for (int64_t r = 0; r < nr; r++)
            for (int64_t c = 0; c < nc; c++)
                if (v[r * nc + c] != j->global[(r0 + r) * C + c0 + c]) j->bad[id]++;
        SIM_TRY(mesh_array_store_global(dev, m, &a, j->back[k]));
        mesh_array_free(dev, &a);
        if (k == 0) {
            sim_arena_get_stats(sim_device_arena(dev), &s1);
            j->after_free[id] = s1.live_by[SIM_MEM_ACTIVATIONS] - s0.live_by[SIM_MEM_ACTIVATIONS];
        }
    }
    /* P(('x', 'y'), None): 12 rows over x and y (6 ways, x most significant): the (x, y) block is
     * rows 2 (x NY + y) .. +2 */
    {
        int64_t tall[2] = {12, 2};
        mesh_spec s;
        SIM_TRY(mesh_spec_parse("P(('x', 'y'), None)", m, &s));
        mesh_array a;
        SIM_TRY(mesh_array_new(dev, m, "tall", 2, tall, &s, SIM_F32, SIM_MEM_TEMP, &a));
        float g[24];
        for (int i = 0; i < 24; i++) g[i] = (float)i;
        mesh_array_load_global(dev, m, &a, g);
        int64_t b = co[0] * NY + co[1];
        const float *v = a.data;
        if (a.local[0] != 2) j->bad[id]++;
        for (int i = 0; i < 4; i++)
            if (v[i] != g[b * 4 + i]) j->bad[id]++;
        mesh_array c;
        SIM_TRY(mesh_array_clone(dev, m, &a, "copy", SIM_MEM_TEMP, &c));
        if (c.data == a.data || memcmp(c.data, a.data, a.nlocal * 4) || c.nlocal != a.nlocal) j->clone_bad[id]++;
        mesh_array_free(dev, &c);
        mesh_array_free(dev, &a);
    }
    /* partial over y */
    {
        mesh_spec s;
        SIM_TRY(mesh_spec_parse("P('x', None)", m, &s));
        s.partial = 1u << 1;
        mesh_array a;
        SIM_TRY(mesh_array_new(dev, m, "p", 2, shape, &s, SIM_F32, SIM_MEM_TEMP, &a));
        mesh_array_load_global(dev, m, &a, j->global);
        const float *v = a.data;
        for (size_t i = 0; i < a.nlocal; i++) {
            float want = co[1] == 0 ? j->global[(co[0] * (R / NX)) * C + (int64_t)i] : 0.0f;
            if (v[i] != want) j->partial_bad[id]++;
        }
        float sink[R * C];
        j->partial_store[id] = mesh_array_store_global(dev, m, &a, sink);
        mesh_array_free(dev, &a);
    }
    /* refusals and padding */
    {
        mesh_spec s;
        SIM_TRY(mesh_spec_parse("P('y', None)", m, &s)); /* 4 rows over 3 */
        mesh_array a;
        j->indivisible[id] = mesh_array_new(dev, m, "odd_rows", 2, shape, &s, SIM_F32, SIM_MEM_TEMP, &a);
        if (id == 0) snprintf(j->indivisible_msg, sizeof j->indivisible_msg, "%s", sim_errmsg());
        SIM_TRY(mesh_spec_parse("P(None, None, 'x')", m, &s));
        j->too_long[id] = mesh_array_new(dev, m, "short", 2, shape, &s, SIM_F32, SIM_MEM_TEMP, &a);
        SIM_TRY(mesh_spec_parse("P('x')", m, &s));
        SIM_TRY(mesh_array_new(dev, m, "padded", 2, shape, &s, SIM_F32, SIM_MEM_TEMP, &a));
        j->padded_local[id][0] = a.local[0];
        j->padded_local[id][1] = a.local[1];
        mesh_array_free(dev, &a);
        sim_err_clear();
    }
    return SIM_OK;
}

static void run(job *j)
{
    static const char *const names[] = {"x", "y"};
    static const int sizes[] = {NX, NY};
    j->mesh = helper_mesh(2, names, sizes);
    for (int i = 0; i < R * C; i++) j->global[i] = (float)i;
    sim_machine *m = helper_machine(&j->mesh, j->dry);
    sim_status st = sim_machine_run(m, array_device, j);
    sim_machine_free(m);
    if (st != SIM_OK) fail_msg("run: %s", sim_errmsg());
}

static void test_shards(void **state)
{
    (void)state;
    static job j;
    memset(&j, 0, sizeof j);
    run(&j);
    for (int d = 0; d < NDEV; d++) {
        assert_int_equal(j.bad[d], 0);
        assert_int_equal(j.clone_bad[d], 0);
        assert_int_equal(j.partial_bad[d], 0);
        assert_int_equal(j.bytes_diff[d], 0);
        assert_int_equal(j.after_free[d], 0);
        assert_true(j.partial_store[d] != SIM_OK);
        assert_int_equal(j.indivisible[d], SIM_ERR_INPUT);
        assert_int_equal(j.too_long[d], SIM_ERR_INPUT);
        assert_int_equal(j.padded_local[d][0], R / NX);
        assert_int_equal(j.padded_local[d][1], C);
    }
    for (int k = 0; k < 3; k++) assert_memory_equal(j.back[k], j.global, sizeof j.global);
    assert_contains(j.indivisible_msg, "odd_rows");
}

static void test_dry(void **state)
{
    (void)state;
    static job j;
    memset(&j, 0, sizeof j);
    j.dry = true;
    run(&j);
    for (int d = 0; d < NDEV; d++) {
        assert_true(j.dry_ok[d]);
        assert_int_equal(j.bytes_diff[d], 0);
    }
}

static void test_copy_block(void **state)
{
    (void)state;
    float src[3 * 4 * 5], dst[2 * 2 * 3];
    for (int i = 0; i < 60; i++) src[i] = (float)i;
    int64_t in[3] = {3, 4, 5}, out[3] = {2, 2, 3}, start[3] = {1, 2, 1};
    mesh_copy_block(dst, src, 3, in, out, start, sizeof(float));
    int k = 0;
    for (int a = 0; a < 2; a++)
        for (int b = 0; b < 2; b++)
            for (int c = 0; c < 3; c++) assert_true(dst[k++] == (float)((1 + a) * 20 + (2 + b) * 5 + (1 + c)));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_shards),
        cmocka_unit_test(test_dry),
        cmocka_unit_test(test_copy_block),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
