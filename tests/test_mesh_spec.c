/* test_mesh_spec.c — mesh from flags (fill rules, dcn x ici, errors), device
 * coordinates, PartitionSpec text and JSON forms, shard geometry. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "config/config.h"
#include "config/json.h"
#include "mesh/mesh_shape.h"
#include "mesh/spec.h"
#include "tests/helpers.h"

/* configs_dir NULL: configs/ with its key contract (configs/keys.yml). */
static sim_status mesh_from_overrides_in(const char *configs_dir, int n, const char *const *ovr, mesh_shape *m)
{
    cfg_args a = {NULL, configs_dir, NULL, 0, ovr, n};
    cfg_config *cfg = NULL;
    sim_status st = cfg_load(&a, &cfg);
    if (st != SIM_OK) fail_msg("config: %s", sim_errmsg());
    st = mesh_shape_from_config(cfg, m);
    cfg_free(cfg);
    return st;
}

static sim_status mesh_from_overrides(int n, const char *const *ovr, mesh_shape *m)
{
    return mesh_from_overrides_in(NULL, n, ovr, m);
}

static int size_of(const mesh_shape *m, const char *axis)
{
    int a = mesh_shape_axis_index(m, axis);
    assert_true(a >= 0);
    return m->sizes[a];
}

/* ---- mesh --------------------------------------------------------------- */

static void test_mesh_from_config(void **state)
{
    (void)state;
    mesh_shape m;
    /* default: ici_fsdp=-1 and no device count -> 1 device */
    assert_int_equal(mesh_from_overrides(0, NULL, &m), SIM_OK);
    assert_int_equal(m.n_axes, 12);
    assert_int_equal(m.num_devices, 1);
    const char *o1[] = {"num_devices=8"};
    assert_int_equal(mesh_from_overrides(1, o1, &m), SIM_OK);
    assert_int_equal(size_of(&m, "fsdp"), 8);
    assert_int_equal(m.num_devices, 8);
    assert_int_equal(size_of(&m, "data"), 1); /* dcn_data=-1 fills num_slices=1 */
    const char *o2[] = {"num_devices=8", "ici_tensor_parallelism=2"};
    assert_int_equal(mesh_from_overrides(2, o2, &m), SIM_OK);
    assert_int_equal(size_of(&m, "fsdp"), 4);
    assert_int_equal(size_of(&m, "tensor"), 2);
    /* no device count: the product of the flags, a -1 counting 1 */
    const char *o3[] = {"ici_expert_parallelism=2", "ici_tensor_parallelism=3"};
    assert_int_equal(mesh_from_overrides(2, o3, &m), SIM_OK);
    assert_int_equal(m.num_devices, 6);
    assert_int_equal(size_of(&m, "fsdp"), 1);
    /* the stage axis reads ici_pipeline_parallelism (the key contract refuses
     * it until pipeline parallelism is simulated, so load without keys.yml:
     * tests/ has none) */
    const char *o4[] = {"ici_pipeline_parallelism=2", "num_devices=4"};
    assert_int_equal(mesh_from_overrides_in("tests", 2, o4, &m), SIM_OK);
    assert_int_equal(size_of(&m, "stage"), 2);
    assert_int_equal(size_of(&m, "fsdp"), 2);
    /* custom mesh axes */
    const char *o5[] = {"custom_mesh_and_rule=ep-as-cp", "num_devices=8", "ici_expert_parallelism=2"};
    assert_int_equal(mesh_from_overrides(3, o5, &m), SIM_OK);
    char buf[256];
    assert_string_equal(mesh_shape_format(&m, buf, sizeof buf), "data=1 stage=1 fsdp=4 expert=2");
}

static void test_mesh_errors(void **state)
{
    (void)state;
    mesh_shape m;
    const char *o1[] = {"ici_fsdp_parallelism=-1", "ici_tensor_parallelism=-1", "num_devices=8"};
    assert_int_equal(mesh_from_overrides(3, o1, &m), SIM_ERR_INPUT);
    assert_contains(sim_errmsg(), "ici_fsdp_parallelism=-1");
    assert_contains(sim_errmsg(), "ici_tensor_parallelism=-1");
    assert_contains(sim_errmsg(), "at most one");
    const char *o2[] = {"ici_fsdp_parallelism=4", "ici_tensor_parallelism=3", "num_devices=8"};
    assert_int_equal(mesh_from_overrides(3, o2, &m), SIM_ERR_INPUT);
    assert_contains(sim_errmsg(), "12");
    assert_contains(sim_errmsg(), "8");
    assert_contains(sim_errmsg(), "ici_fsdp_parallelism=4 x ici_tensor_parallelism=3");
    const char *o3[] = {"ici_tensor_parallelism=3", "num_devices=8"};
    assert_int_equal(mesh_from_overrides(2, o3, &m), SIM_ERR_INPUT);
    assert_contains(sim_errmsg(), "does not divide");
    assert_contains(sim_errmsg(), "ici_fsdp_parallelism=-1");
    const char *o4[] = {"dcn_fsdp_parallelism=2", "num_devices=8"};
    assert_int_equal(mesh_from_overrides(2, o4, &m), SIM_ERR_INPUT);
    assert_contains(sim_errmsg(), "dcn_fsdp_parallelism=2");
    assert_contains(sim_errmsg(), "num_slices");
    const char *o5[] = {"ici_fsdp_parallelism=0"};
    assert_int_equal(mesh_from_overrides(1, o5, &m), SIM_ERR_INPUT);
    assert_contains(sim_errmsg(), "ici_fsdp_parallelism=0");
    const char *o6[] = {"num_devices=6", "num_slices=4"};
    assert_int_equal(mesh_from_overrides(2, o6, &m), SIM_ERR_INPUT);
    assert_contains(sim_errmsg(), "num_slices=4");
    /* the legacy rules need the legacy flags (present in our base) */
    const char *o7[] = {"custom_mesh_and_rule=legacy", "num_devices=4", "ici_sequence_parallelism=2"};
    assert_int_equal(mesh_from_overrides(3, o7, &m), SIM_OK);
    assert_int_equal(m.n_axes, 13);
    assert_int_equal(size_of(&m, "sequence"), 2);
}

/* Every dcn_*_parallelism key of the base config: 2 with one slice is refused
 * with MaxText's "only one slice" (whether or not its axis is in mesh_axes:
 * dcn_sequence_parallelism is a legacy key outside the default mesh); with
 * two slices it is accepted.  dcn_diloco_parallelism is outside MaxText's
 * product, and its axis is in the mesh, so the slice count is what refuses it. */
static void test_mesh_dcn_needs_slices(void **state)
{
    (void)state;
    cfg_args a = {NULL, NULL, NULL, 0, NULL, 0};
    cfg_config *cfg = NULL;
    if (cfg_load(&a, &cfg) != SIM_OK) fail_msg("config: %s", sim_errmsg());
    int checked = 0;
    for (int i = 0; i < cfg->n; i++) {
        const char *key = cfg->entries[i].key;
        size_t n = strlen(key);
        if (strncmp(key, "dcn_", 4) != 0 || n < 12 || strcmp(key + n - 12, "_parallelism") != 0) continue;
        char one[128], zero[128];
        snprintf(one, sizeof one, "%s=2", key);
        snprintf(zero, sizeof zero, "%s=0", key);
        mesh_shape m;
        const char *o1[] = {one};
        assert_int_equal(mesh_from_overrides(1, o1, &m), SIM_ERR_INPUT);
        assert_contains(sim_errmsg(), one);
        if (strcmp(key, "dcn_diloco_parallelism") == 0) assert_contains(sim_errmsg(), "num_slices=1");
        else assert_contains(sim_errmsg(), "only one slice available");
        const char *o0[] = {zero};
        assert_int_equal(mesh_from_overrides(1, o0, &m), SIM_ERR_INPUT);
        assert_contains(sim_errmsg(), zero);
        /* two slices: the key's axis takes them (dcn_data_parallelism=-1 fills 1) */
        const char *o2[] = {one, "num_slices=2", "num_devices=2"};
        if (mesh_from_overrides(3, o2, &m) != SIM_OK) fail_msg("%s with 2 slices: %s", key, sim_errmsg());
        assert_int_equal(m.num_slices, 2);
        checked++;
    }
    cfg_free(cfg);
    assert_true(checked >= 14); /* MaxText's 12 in its product, diloco, shardsim's tensor_transpose */
}

static void test_mesh_dcn_and_coords(void **state)
{
    (void)state;
    mesh_shape m;
    /* 2 slices of 4: data takes the slices (dcn_data=-1), fsdp the slice */
    const char *o1[] = {"num_devices=8", "num_slices=2"};
    assert_int_equal(mesh_from_overrides(2, o1, &m), SIM_OK);
    int d = mesh_shape_axis_index(&m, "data"), f = mesh_shape_axis_index(&m, "fsdp");
    assert_int_equal(m.dcn[d], 2);
    assert_int_equal(m.ici[d], 1);
    assert_int_equal(m.sizes[f], 4);
    assert_int_equal(m.num_slices, 2);
    for (int dev = 0; dev < 8; dev++) assert_int_equal(mesh_shape_slice(&m, dev), dev / 4);
    /* one axis split across both levels: fsdp = dcn 2 x ici 4, dcn outermost */
    const char *o2[] = {"num_devices=8", "num_slices=2", "dcn_data_parallelism=1", "dcn_fsdp_parallelism=2"};
    assert_int_equal(mesh_from_overrides(4, o2, &m), SIM_OK);
    f = mesh_shape_axis_index(&m, "fsdp");
    assert_int_equal(m.sizes[f], 8);
    assert_int_equal(m.dcn[f], 2);
    assert_int_equal(m.ici[f], 4);
    for (int dev = 0; dev < 8; dev++) assert_int_equal(mesh_shape_slice(&m, dev), dev / 4);

    /* row-major ids, first axis most significant */
    const char *names[] = {"a", "b", "c"};
    int sizes[] = {2, 3, 4};
    assert_int_equal(mesh_shape_init(&m, 3, names, sizes), SIM_OK);
    assert_int_equal(m.num_devices, 24);
    int c[3];
    mesh_shape_coords(&m, 17, c); /* 17 = 1*12 + 1*4 + 1 */
    assert_int_equal(c[0], 1);
    assert_int_equal(c[1], 1);
    assert_int_equal(c[2], 1);
    for (int dev = 0; dev < 24; dev++) {
        mesh_shape_coords(&m, dev, c);
        assert_int_equal(mesh_shape_device(&m, c), dev);
        assert_int_equal(c[0] * 12 + c[1] * 4 + c[2], dev);
    }
    assert_int_equal(mesh_shape_axis_index(&m, "b"), 1);
    assert_int_equal(mesh_shape_axis_index(&m, "z"), -1);
    assert_string_equal(mesh_shape_flag_stem("stage"), "pipeline");
}

/* ---- spec text ---------------------------------------------------------- */

static mesh_shape test_mesh(void)
{
    const char *names[] = {"data", "fsdp", "tensor", "expert"};
    int sizes[] = {2, 4, 1, 2};
    mesh_shape m;
    assert_int_equal(mesh_shape_init(&m, 4, names, sizes), SIM_OK);
    return m;
}

static void roundtrip(const mesh_shape *m, const char *in, const char *canonical)
{
    mesh_spec s;
    if (mesh_spec_parse(in, m, &s) != SIM_OK) fail_msg("parse %s: %s", in, sim_errmsg());
    char buf[256];
    int n = mesh_spec_format(&s, m, buf, sizeof buf);
    assert_int_equal(n, (int)strlen(buf));
    if (strcmp(buf, canonical) != 0) fail_msg("%s printed as %s, expected %s", in, buf, canonical);
    mesh_spec t;
    assert_int_equal(mesh_spec_parse(buf, m, &t), SIM_OK);
    assert_true(mesh_spec_equal(&s, &t));
}

static void test_spec_text(void **state)
{
    (void)state;
    mesh_shape m = test_mesh();
    roundtrip(&m, "P()", "P()");
    roundtrip(&m, "P(None,)", "P(None,)");
    roundtrip(&m, "P('fsdp',)", "P('fsdp',)");
    roundtrip(&m, "P('fsdp', None, None)", "P('fsdp', None, None)");
    roundtrip(&m, "P(('data','fsdp'),None)", "P(('data', 'fsdp'), None)");
    roundtrip(&m, "P(None, 'tensor')", "P(None, 'tensor')");
    roundtrip(&m, "  PartitionSpec ( \"expert\" , ( 'fsdp', ) , ( ) , [\"data\", 'tensor'] ) ",
              "P('expert', 'fsdp', None, ('data', 'tensor'))");
    roundtrip(&m, "P(('fsdp', 'expert'), None, None, None)", "P(('fsdp', 'expert'), None, None, None)");
    roundtrip(&m, "P('fsdp', None, partial=('data',))", "P('fsdp', None, unreduced={'data'})");
    roundtrip(&m, "P('fsdp', unreduced={'expert', 'data'})", "P('fsdp', unreduced={'data', 'expert'})");
    roundtrip(&m, "P(unreduced={'data'})", "P(unreduced={'data'})");
    roundtrip(&m, "P(partial='data')", "P(unreduced={'data'})");

    mesh_spec s;
    assert_int_equal(mesh_spec_parse("P(('data','fsdp'), 'expert')", &m, &s), SIM_OK);
    assert_int_equal(s.rank, 2);
    assert_int_equal(s.n_axes[0], 2);
    assert_int_equal(s.axes[0][0], 0);
    assert_int_equal(s.axes[0][1], 1);
    assert_int_equal(s.axes[1][0], 3);
    assert_int_equal(mesh_spec_axis_dim(&s, 3), 1);
    assert_int_equal(mesh_spec_axis_dim(&s, 2), -1);
    assert_int_equal(mesh_spec_dim_axes(&s), 0xBu);
}

static void parse_fails(const mesh_shape *m, const char *text, const char *n1, const char *n2)
{
    mesh_spec s;
    if (mesh_spec_parse(text, m, &s) != SIM_ERR_INPUT) fail_msg("%s parsed", text);
    assert_contains(sim_errmsg(), text);
    assert_contains(sim_errmsg(), n1);
    if (n2) assert_contains(sim_errmsg(), n2);
}

static void test_spec_parse_errors(void **state)
{
    (void)state;
    mesh_shape m = test_mesh();
    parse_fails(&m, "P('fsdpp', None)", "'fsdpp' is not a mesh axis", "data, fsdp, tensor, expert");
    parse_fails(&m, "P('fsdp', Nne)", "position 11", "'Nne'");
    parse_fails(&m, "P('fsdp', 'fsdp')", "'fsdp' twice", NULL);
    parse_fails(&m, "P(('data', 'fsdp'), None, partial=('fsdp',))", "partial", "'fsdp'");
    parse_fails(&m, "P('fsdp", "unterminated", NULL);
    parse_fails(&m, "Q('fsdp')", "P( or PartitionSpec(", NULL);
    parse_fails(&m, "P('fsdp' None)", "',' or ')'", NULL);
    parse_fails(&m, "P(partial=('data',), 'fsdp')", "dims come before", NULL);
    parse_fails(&m, "P(None, None, None, None, None, None, None, None, None)", "more than 8", NULL);
    parse_fails(&m, "P('fsdp') x", "end of the text", NULL);
}

static void test_spec_json(void **state)
{
    (void)state;
    mesh_shape m = test_mesh();
    mesh_spec s;
    assert_int_equal(mesh_spec_parse("P('fsdp', None, ('data', 'expert'))", &m, &s), SIM_OK);
    char buf[256];
    mesh_spec_format_json(&s, &m, buf, sizeof buf);
    assert_string_equal(buf, "[\"fsdp\", null, [\"data\", \"expert\"]]");
    cfg_json *j;
    assert_int_equal(cfg_json_parse(buf, strlen(buf), "test", &j), SIM_OK);
    mesh_spec t;
    assert_int_equal(mesh_spec_from_json(j, &m, "test", &t), SIM_OK);
    assert_true(mesh_spec_equal(&s, &t));
    cfg_json_free(j);
    /* rank 0, a one-axis list, an unknown axis */
    mesh_spec_init(&s, 0);
    mesh_spec_format_json(&s, &m, buf, sizeof buf);
    assert_string_equal(buf, "[]");
    const char *txt = "[[\"fsdp\"], []]";
    assert_int_equal(cfg_json_parse(txt, strlen(txt), "t", &j), SIM_OK);
    assert_int_equal(mesh_spec_from_json(j, &m, "t", &t), SIM_OK);
    mesh_spec_format(&t, &m, buf, sizeof buf);
    assert_string_equal(buf, "P('fsdp', None)");
    cfg_json_free(j);
    txt = "[\"stage\"]";
    assert_int_equal(cfg_json_parse(txt, strlen(txt), "t", &j), SIM_OK);
    assert_int_equal(mesh_spec_from_json(j, &m, "t", &t), SIM_ERR_INPUT);
    assert_contains(sim_errmsg(), "'stage' is not a mesh axis");
    cfg_json_free(j);
    /* JSON reader: escapes, numbers, errors with line numbers */
    txt = "{\"a\\u00e9\\n\": [1, -2.5e3, true, false, null], \"b\": {}}";
    assert_int_equal(cfg_json_parse(txt, strlen(txt), "t", &j), SIM_OK);
    assert_string_equal(j->keys[0], "a\xc3\xa9\n");
    const cfg_json *arr = cfg_json_get(j, "a\xc3\xa9\n");
    assert_int_equal(arr->n, 5);
    assert_true(arr->items[1].number == -2500.0);
    assert_int_equal(arr->items[2].boolean, 1);
    assert_int_equal(arr->items[4].kind, CFG_JSON_NULL);
    assert_int_equal(cfg_json_get(j, "b")->kind, CFG_JSON_OBJECT);
    cfg_json_free(j);
    txt = "{\n\"a\": [1, 2,]\n}";
    assert_int_equal(cfg_json_parse(txt, strlen(txt), "bad.json", &j), SIM_ERR_INPUT);
    assert_contains(sim_errmsg(), "bad.json:2:");
    /* duplicate keys are refused (a header must not say two things about one name) */
    txt = "{\"a\": 1, \"a\": 2}";
    assert_int_equal(cfg_json_parse(txt, strlen(txt), "dup.json", &j), SIM_ERR_INPUT);
    assert_contains(sim_errmsg(), "dup.json:");
    assert_contains(sim_errmsg(), "duplicate");
    /* integers keep their exact value beyond 2^53 */
    txt = "[9007199254740993, 1.5]";
    assert_int_equal(cfg_json_parse(txt, strlen(txt), "t", &j), SIM_OK);
    assert_true(j->items[0].is_integer);
    assert_true(j->items[0].integer == 9007199254740993LL);
    assert_false(j->items[1].is_integer);
    cfg_json_free(j);
}

/* ---- geometry ----------------------------------------------------------- */

static void test_spec_geometry(void **state)
{
    (void)state;
    const char *names[] = {"data", "fsdp", "tensor"};
    int sizes[] = {2, 4, 3};
    mesh_shape m;
    assert_int_equal(mesh_shape_init(&m, 3, names, sizes), SIM_OK);
    mesh_spec s;
    /* dim 0 over (data, fsdp): block = data*4 + fsdp; dim 1 over tensor */
    assert_int_equal(mesh_spec_parse("P(('data', 'fsdp'), 'tensor', None)", &m, &s), SIM_OK);
    int64_t shape[] = {16, 6, 5};
    assert_int_equal(mesh_spec_check_shape(&s, &m, 3, shape, "x"), SIM_OK);
    int64_t local[3];
    mesh_spec_local_shape(&s, &m, shape, local);
    assert_int_equal(local[0], 2);
    assert_int_equal(local[1], 2);
    assert_int_equal(local[2], 5);
    for (int dev = 0; dev < m.num_devices; dev++) {
        int c[3];
        mesh_shape_coords(&m, dev, c);
        mesh_dim_shard sh[3];
        mesh_spec_shard(&s, &m, shape, dev, sh);
        assert_int_equal(sh[0].nshards, 8);
        assert_int_equal(sh[0].block, c[0] * 4 + c[1]);
        assert_int_equal(sh[0].offset, (c[0] * 4 + c[1]) * 2);
        assert_int_equal(sh[1].block, c[2]);
        assert_int_equal(sh[1].offset, c[2] * 2);
        assert_int_equal(sh[2].nshards, 1);
        assert_int_equal(sh[2].offset, 0);
        assert_int_equal(sh[2].local, 5);
    }
    /* order inside a tuple matters: (fsdp, data) makes fsdp the major part */
    assert_int_equal(mesh_spec_parse("P(('fsdp', 'data'))", &m, &s), SIM_OK);
    int64_t shape1[] = {8};
    for (int dev = 0; dev < m.num_devices; dev++) {
        int c[3];
        mesh_shape_coords(&m, dev, c);
        mesh_dim_shard sh[1];
        mesh_spec_shard(&s, &m, shape1, dev, sh);
        assert_int_equal(sh[0].block, c[1] * 2 + c[0]);
        assert_int_equal(sh[0].offset, sh[0].block);
    }
    /* divisibility error names tensor, dim, size, axes and sizes */
    assert_int_equal(mesh_spec_parse("P(None, ('fsdp', 'tensor'))", &m, &s), SIM_OK);
    int64_t bad[] = {4, 20};
    assert_int_equal(mesh_spec_check_shape(&s, &m, 2, bad, "decoder/mlp/wi_0"), SIM_ERR_INPUT);
    assert_contains(sim_errmsg(), "'decoder/mlp/wi_0'");
    assert_contains(sim_errmsg(), "dim 1");
    assert_contains(sim_errmsg(), "size 20");
    assert_contains(sim_errmsg(), "12 shards");
    assert_contains(sim_errmsg(), "fsdp=4 x tensor=3");
    int64_t r3[] = {4, 24, 1};
    assert_int_equal(mesh_spec_check_shape(&s, &m, 3, r3, "t"), SIM_ERR_INPUT);
    assert_contains(sim_errmsg(), "rank 3");

    /* size-1 removal keeps order and clears partial size-1 axes */
    const char *n2[] = {"data", "stage", "fsdp"};
    int s2[] = {1, 1, 4};
    assert_int_equal(mesh_shape_init(&m, 3, n2, s2), SIM_OK);
    assert_int_equal(mesh_spec_parse("P(('data', 'fsdp'), None, unreduced={'stage'})", &m, &s), SIM_OK);
    mesh_spec_drop_size_one(&s, &m);
    char buf[128];
    mesh_spec_format(&s, &m, buf, sizeof buf);
    assert_string_equal(buf, "P('fsdp', None)");

    /* set_dim checks the one-axis-once invariant */
    mesh_spec_init(&s, 2);
    int ax[] = {2};
    assert_int_equal(mesh_spec_set_dim(&s, &m, 0, 1, ax), SIM_OK);
    assert_int_equal(mesh_spec_set_dim(&s, &m, 1, 1, ax), SIM_ERR_INPUT);
    assert_contains(sim_errmsg(), "'fsdp' twice");
    assert_int_equal(s.n_axes[1], 0); /* unchanged on error */
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_mesh_from_config),    cmocka_unit_test(test_mesh_errors),
        cmocka_unit_test(test_mesh_dcn_and_coords), cmocka_unit_test(test_mesh_dcn_needs_slices),
        cmocka_unit_test(test_spec_text),           cmocka_unit_test(test_spec_parse_errors),
        cmocka_unit_test(test_spec_json),           cmocka_unit_test(test_spec_geometry),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
