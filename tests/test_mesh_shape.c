/* test_mesh_shape.c — mesh/mesh_shape.h: the device mesh.
 *   - ids are row-major over the coordinates, first axis most significant: for every device of a
 *     2 x 3 x 2 mesh, coords -> id -> coords round-trips and the id is c0*6 + c1*2 + c2;
 *   - a -1 parallelism fills the rest of its level (ici from the devices per slice, dcn from
 *     num_slices); an axis size is dcn x ici with the slice part outermost, so a device's slice is
 *     the mixed radix of its coordinates' slice parts (c / ici);
 *   - refusals name the flag and what is expected: sizes that do not multiply to the devices, two
 *     -1 in one level, a 0, a repeated axis name;
 *   - from a config: ici_fsdp_parallelism=-1 fills 8 devices beside tensor=2; 'stage' reads the
 *     pipeline flags (mesh_shape_flag_stem);
 *   - format, axis lookup and equality. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <string.h>

#include "config/config.h"
#include "mesh/mesh_shape.h"
#include "tests/helpers.h"

static void test_ids_and_coords(void **state)
{
    (void)state;
    static const char *const names[] = {"a", "b", "c"};
    static const int sizes[] = {2, 3, 2};
    mesh_shape m = helper_mesh(3, names, sizes);
    assert_int_equal(m.num_devices, 12);
    assert_int_equal(m.num_slices, 1);
    for (int d = 0; d < 12; d++) {
        int c[3];
        mesh_shape_coords(&m, d, c);
        assert_int_equal(c[0] * 6 + c[1] * 2 + c[2], d);
        assert_true(c[0] < 2 && c[1] < 3 && c[2] < 2);
        assert_int_equal(mesh_shape_device(&m, c), d);
        assert_int_equal(mesh_shape_slice(&m, d), 0);
    }
    assert_int_equal(mesh_shape_axis_index(&m, "b"), 1);
    assert_int_equal(mesh_shape_axis_index(&m, "nope"), -1);
    char buf[64];
    assert_string_equal(mesh_shape_format(&m, buf, sizeof buf), "a=2 b=3 c=2");
    mesh_shape same = helper_mesh(3, names, sizes);
    assert_true(mesh_shape_equal(&m, &same));
    static const int other[] = {2, 2, 3};
    mesh_shape diff = helper_mesh(3, names, other);
    assert_false(mesh_shape_equal(&m, &diff));
}

static void test_fill_and_slices(void **state)
{
    (void)state;
    static const char *const names[] = {"data", "fsdp"};
    /* 2 slices of 4 devices: dcn data=-1 (fills 2), ici fsdp=-1 (fills 4 beside data's 1) */
    int ici[] = {1, -1}, dcn[] = {-1, 1};
    mesh_shape m;
    assert_int_equal(mesh_shape_build(&m, 2, names, ici, dcn, 8, 2, NULL, NULL), SIM_OK);
    assert_int_equal(m.dcn[0], 2);
    assert_int_equal(m.ici[1], 4);
    assert_int_equal(m.sizes[0], 2);
    assert_int_equal(m.sizes[1], 4);
    assert_int_equal(m.num_slices, 2);
    for (int d = 0; d < 8; d++) {
        int c[2];
        mesh_shape_coords(&m, d, c);
        assert_int_equal(mesh_shape_slice(&m, d), c[0] / m.ici[0]); /* data's slice part */
    }
    /* ici data=2 inside each of 2 slices on dcn data: data = 4, slice = c_data / 2 */
    int ici2[] = {2, 2}, dcn2[] = {2, 1};
    assert_int_equal(mesh_shape_build(&m, 2, names, ici2, dcn2, 8, 2, NULL, NULL), SIM_OK);
    assert_int_equal(m.sizes[0], 4);
    for (int d = 0; d < 8; d++) {
        int c[2];
        mesh_shape_coords(&m, d, c);
        assert_int_equal(mesh_shape_slice(&m, d), c[0] / 2);
    }
}

static void expect_refused(int n, const char *const *names, const int *ici, int devices, const char *needle)
{
    static const char *const flags[] = {"ici_a_parallelism", "ici_b_parallelism", "ici_c_parallelism"};
    mesh_shape m;
    sim_status st = mesh_shape_build(&m, n, names, ici, NULL, devices, 1, flags, NULL);
    if (st != SIM_ERR_INPUT) fail_msg("accepted (status %d), expected a refusal naming '%s'", (int)st, needle);
    assert_contains(sim_errmsg(), needle);
    sim_err_clear();
}

static void test_refusals(void **state)
{
    (void)state;
    static const char *const names[] = {"a", "b"};
    static const char *const twice[] = {"a", "a"};
    int bad_product[] = {2, 3}, two_fill[] = {-1, -1}, zero[] = {0, 2}, ok[] = {2, 2};
    expect_refused(2, names, bad_product, 8, "ici_");
    expect_refused(2, names, two_fill, 8, "-1");
    expect_refused(2, names, zero, 0, "ici_a_parallelism");
    expect_refused(2, twice, ok, 4, "mesh_axes lists 'a' twice");
}

static void test_from_config(void **state)
{
    (void)state;
    const char *words[] = {"num_devices=8", "ici_tensor_parallelism=2", "ici_pipeline_parallelism=2"};
    cfg_config *cfg = NULL;
    if (cfg_load_argv("configs/base.yml", 3, words, &cfg) != SIM_OK) fail_msg("%s", sim_errmsg());
    mesh_shape m;
    if (mesh_shape_from_config(cfg, &m) != SIM_OK) fail_msg("%s", sim_errmsg());
    assert_int_equal(m.num_devices, 8);
    assert_int_equal(m.sizes[mesh_shape_axis_index(&m, "tensor")], 2);
    assert_int_equal(m.sizes[mesh_shape_axis_index(&m, "stage")], 2); /* ici_pipeline_parallelism */
    assert_int_equal(m.sizes[mesh_shape_axis_index(&m, "fsdp")], 2);  /* -1: 8 / (2 x 2) */
    int product = 1;
    for (int a = 0; a < m.n_axes; a++) product *= m.sizes[a];
    assert_int_equal(product, 8);
    assert_string_equal(mesh_shape_flag_stem("stage"), "pipeline");
    assert_string_equal(mesh_shape_flag_stem("fsdp"), "fsdp");
    cfg_free(cfg);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_ids_and_coords),
        cmocka_unit_test(test_fill_and_slices),
        cmocka_unit_test(test_refusals),
        cmocka_unit_test(test_from_config),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
