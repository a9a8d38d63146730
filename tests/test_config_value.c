/* test_config_value.c — config values (config/value.c): a scalar's type read from its text as
 * YAML 1.1 does (plus MaxText's None), typed reads, equality by value, flow text and JSON. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config/config.h"
#include "config/json.h"
#include "tests/config_fixture.h"

static const cfg_value *val(const cfg_config *cfg, const char *key)
{
    const cfg_entry *e = cfg_find(cfg, key);
    if (!e) fail_msg("key %s missing", key);
    return &e->value;
}

static cfg_config *load_ok(const char *base, const char *dir, int n, const char *const *ovr)
{
    (void)dir;
    return cfgt_load_ok(base, n, ovr);
}

static cfg_value scalar(const char *text)
{
    cfg_value v = {CFG_SCALAR, (char *)text, 0, 0, NULL, NULL, "t", 1};
    return v;
}

static void test_scalar_types(void **state)
{
    (void)state;
    struct {
        const char *text;
        int quoted;
        cfg_type t;
    } cases[] = {
        {"10_000", 0, CFG_INT},  {"-1", 0, CFG_INT},       {"0x10", 0, CFG_INT},   {"1.e-05", 0, CFG_FLOAT},
        {"3.e-5", 0, CFG_FLOAT}, {"12.0", 0, CFG_FLOAT},   {"1e-6", 0, CFG_FLOAT}, {".inf", 0, CFG_FLOAT},
        {"None", 0, CFG_NULL},   {"none", 1, CFG_NULL},    {"null", 0, CFG_NULL},  {"", 0, CFG_NULL},
        {"", 1, CFG_STRING},     {"True", 0, CFG_BOOL},    {"off", 0, CFG_BOOL},   {"1", 1, CFG_STRING},
        {"fsdp", 0, CFG_STRING}, {"1.2.3", 0, CFG_STRING}, {"_1", 0, CFG_STRING},  {"inf", 0, CFG_STRING},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        cfg_value v = {CFG_SCALAR, (char *)cases[i].text, cases[i].quoted, 0, NULL, NULL, "t", 1};
        if (cfg_scalar_type(&v) != cases[i].t)
            fail_msg("'%s' (quoted %d): type %d, expected %d", cases[i].text, cases[i].quoted, cfg_scalar_type(&v),
                     cases[i].t);
    }
}

/* Typed reads: an integral real reads as an integer, a fraction does not; equality by value. */
static void test_typed_reads(void **state)
{
    (void)state;
    long long i;
    double d;
    int b;
    cfg_value v = scalar("3.0");
    assert_int_equal(cfg_value_int(&v, "x", &i), SIM_OK);
    assert_int_equal(i, 3);
    v = scalar("3.5");
    assert_int_equal(cfg_value_int(&v, "key 'x'", &i), SIM_ERR_INPUT);
    assert_contains(sim_errmsg(), "t:1: key 'x' = 3.5 is a number, expected an integer");
    v = scalar("0x1F");
    assert_int_equal(cfg_value_double(&v, "x", &d), SIM_OK);
    assert_true(d == 31.0);
    v = scalar("Yes");
    assert_int_equal(cfg_value_bool(&v, "x", &b), SIM_OK);
    assert_int_equal(b, 1);
    v = scalar("1");
    assert_int_equal(cfg_value_bool(&v, "x", &b), SIM_ERR_INPUT);
    cfg_value a = scalar("10_000"), c = scalar("10000.0"), e = scalar("1e4"), f = scalar("10001");
    assert_true(cfg_value_equal(&a, &c));
    assert_true(cfg_value_equal(&a, &e));
    assert_false(cfg_value_equal(&a, &f));
    cfg_value t1 = scalar("on"), t2 = scalar("TRUE"), s1 = scalar("on");
    assert_true(cfg_value_equal(&t1, &t2));
    s1.quoted = 1; /* 'on' in quotes is the string, not a boolean */
    assert_false(cfg_value_equal(&t1, &s1));
    cfg_value l1[2] = {scalar("1"), scalar("x")}, l2[2] = {scalar("1.0"), scalar("x")};
    cfg_value la = {CFG_LIST, NULL, 0, 2, l1, NULL, "t", 1}, lb = {CFG_LIST, NULL, 0, 2, l2, NULL, "t", 1};
    assert_true(cfg_value_equal(&la, &lb));
    l2[1] = scalar("y");
    assert_false(cfg_value_equal(&la, &lb));
}

/* A value as typed JSON through the one writer, read back by the JSON reader. */
static void test_value_json(void **state)
{
    (void)state;
    cfg_value items[5] = {scalar("null"), scalar("off"), scalar("-12"), scalar("2.5e-3"), scalar("a\"b")};
    char *keys[5] = {"n", "b", "i", "f", "s"};
    cfg_value map = {CFG_MAP, NULL, 0, 5, items, keys, "t", 1};
    cfg_jw w;
    cfg_jw_init(&w);
    cfg_value_json(&w, &map);
    char *text = cfg_jw_dumps(&w, CFG_JW_LINE, 17);
    cfg_json *j;
    assert_int_equal(cfg_json_parse(text, strlen(text), "t", &j), SIM_OK);
    assert_int_equal(cfg_json_get(j, "n")->kind, CFG_JSON_NULL);
    assert_int_equal(cfg_json_get(j, "b")->kind, CFG_JSON_BOOL);
    assert_int_equal(cfg_json_get(j, "b")->boolean, 0);
    assert_true(cfg_json_get(j, "i")->is_integer && cfg_json_get(j, "i")->integer == -12);
    assert_true(cfg_json_get(j, "f")->number == 2.5e-3);
    assert_string_equal(cfg_json_get(j, "s")->str, "a\"b");
    cfg_json_free(j);
    free(text);
}

static void test_value_text(void **state)
{
    (void)state;
    const char *o[] = {"logical_axis_rules=[['norm', fsdp], [x, []]]", "override_logical_axis_rules=true"};
    cfg_config *cfg = load_ok(NULL, NULL, 2, o);
    char *t = cfg_value_to_text(val(cfg, "logical_axis_rules"), 0);
    assert_string_equal(t, "[['norm', fsdp], [x, []]]");
    free(t);
    t = cfg_value_to_text(val(cfg, "logical_axis_rules"), 1);
    assert_string_equal(t, "[[\"norm\", \"fsdp\"], [\"x\", []]]");
    free(t);
    /* jansson, the one JSON writer, writes an exponent without '+' or leading zeros */
    t = cfg_value_to_text(val(cfg, "normalization_layer_epsilon"), 1);
    assert_string_equal(t, "1e-5");
    free(t);
    t = cfg_value_to_text(val(cfg, "checkpoint_period"), 1);
    assert_string_equal(t, "10000");
    free(t);
    t = cfg_value_to_text(val(cfg, "per_device_batch_size"), 1);
    assert_string_equal(t, "12.0");
    free(t);
    cfg_free(cfg);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_scalar_types),
        cmocka_unit_test(test_typed_reads),
        cmocka_unit_test(test_value_text),
        cmocka_unit_test(test_value_json),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
