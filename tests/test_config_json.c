/* test_config_json.c — JSON through jansson (config/json.c).  Reading: values, keys in file
 * order, numbers with their integer value, errors with line and column, duplicate keys refused.
 * Writing (the one writer): escapes done by jansson (quote, backslash, control characters,
 * non-ASCII as \uXXXX in the indented layout), bytes that are not UTF-8 kept readable, numbers
 * as %.<digits>g writes them, Python's indent=2 layout; expected texts written out by hand. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config/json.h"
#include "tests/config_fixture.h"

static void test_read(void **state)
{
    (void)state;
    const char *text = "{\"b\": [1, 2.5, -3e2, null, true], \"a\": {\"s\": \"x\\u00e9\\n\"}, \"big\": 9007199254740993}";
    mesh_json *j;
    assert_int_equal(mesh_json_parse(text, strlen(text), "t.json", &j), SIM_OK);
    assert_int_equal(j->kind, MESH_JSON_OBJECT);
    assert_string_equal(j->keys[0], "b"); /* file order */
    const mesh_json *b = mesh_json_get(j, "b");
    assert_int_equal(b->n, 5);
    assert_true(b->items[0].is_integer && b->items[0].integer == 1);
    assert_false(b->items[1].is_integer);
    assert_true(b->items[1].number == 2.5);
    assert_true(b->items[2].number == -300.0);
    assert_int_equal(b->items[3].kind, MESH_JSON_NULL);
    assert_int_equal(b->items[4].boolean, 1);
    assert_string_equal(mesh_json_get(mesh_json_get(j, "a"), "s")->str, "x\xc3\xa9\n");
    assert_true(mesh_json_get(j, "big")->integer == 9007199254740993LL); /* exact, not via a double */
    mesh_json *k;
    const char *same = "{\"big\": 9007199254740993, \"a\": {\"s\": \"x\\u00e9\\n\"}, \"b\": [1, 2.5, -300, null, true]}";
    assert_int_equal(mesh_json_parse(same, strlen(same), "u.json", &k), SIM_OK);
    assert_true(mesh_json_equal(j, k)); /* keys in any order, numbers by value */
    mesh_json_free(k);
    mesh_json_free(j);
    assert_int_equal(mesh_json_parse("{\"a\": 1,\n \"a\": 2}", 17, "d.json", &j), SIM_ERR_INPUT);
    assert_contains(sim_errmsg(), "d.json:2:");
    assert_int_equal(mesh_json_parse("[1, 2", 5, "e.json", &j), SIM_ERR_INPUT);
    assert_contains(sim_errmsg(), "e.json:1:");
    assert_contains(sim_errmsg(), "invalid JSON");
}

static void test_write_layouts(void **state)
{
    (void)state;
    mesh_jw w;
    mesh_jw_init(&w);
    mesh_jw_obj(&w);
    mesh_jw_key(&w, "s");
    mesh_jw_str(&w, "q\"b\\c\n\x01\xc3\xa9");
    mesh_jw_key(&w, "l");
    mesh_jw_arr(&w);
    mesh_jw_int(&w, -4);
    mesh_jw_u64(&w, 18446744073709551ULL);
    mesh_jw_double(&w, 0.5);
    mesh_jw_double(&w, 2.0);
    mesh_jw_double(&w, NAN);
    mesh_jw_null(&w);
    mesh_jw_bool(&w, 0);
    mesh_jw_end(&w);
    mesh_jw_key(&w, "e");
    mesh_jw_obj(&w);
    mesh_jw_end(&w);
    mesh_jw_end(&w);
    char *indented = mesh_jw_dumps(&w, MESH_JW_INDENT2, 17);
    assert_string_equal(indented, "{\n"
                                  "  \"s\": \"q\\\"b\\\\c\\n\\u0001\\u00E9\",\n" /* jansson: upper-case hex */
                                  "  \"l\": [\n"
                                  "    -4,\n"
                                  "    18446744073709551,\n"
                                  "    0.5,\n"
                                  "    2.0,\n"
                                  "    null,\n"
                                  "    null,\n"
                                  "    false\n"
                                  "  ],\n"
                                  "  \"e\": {}\n"
                                  "}");
    free(indented);
    /* one line, UTF-8 as is; a string with bytes that are not UTF-8 keeps the rest */
    mesh_jw_init(&w);
    mesh_jw_arr(&w);
    mesh_jw_str(&w, "\xc3\xa9");
    mesh_jw_str(&w, "a\xff" "b");
    mesh_jw_str(&w, NULL);
    mesh_jw_end(&w);
    char *line = mesh_jw_dumps(&w, MESH_JW_LINE, 17);
    assert_string_equal(line, "[\"\xc3\xa9\", \"a?b\", null]");
    free(line);
}

/* mesh_jw_num: the number %.<digits>g writes, typed as JSON reads that text. */
static void test_write_numbers(void **state)
{
    (void)state;
    mesh_jw w;
    mesh_jw_init(&w);
    mesh_jw_arr(&w);
    mesh_jw_num(&w, 12.0, 6);           /* "12": an integer */
    mesh_jw_num(&w, 0.1234567, 6);      /* "0.123457" */
    mesh_jw_num(&w, 1234567.0, 6);      /* "1.23457e+06": a real of that value */
    mesh_jw_num(&w, 1.0 / 3.0, 9);      /* "0.333333333" */
    mesh_jw_num(&w, INFINITY, 6);       /* not finite: null */
    mesh_jw_end(&w);
    char *t = mesh_jw_dumps(&w, MESH_JW_LINE, 9);
    assert_string_equal(t, "[12, 0.123457, 1234570.0, 0.333333333, null]");
    free(t);
    /* a tree taken from one writer goes into another */
    mesh_jw inner;
    mesh_jw_init(&inner);
    mesh_jw_obj(&inner);
    mesh_jw_key(&inner, "k");
    mesh_jw_int(&inner, 1);
    mesh_jw_end(&inner);
    mesh_jw_init(&w);
    mesh_jw_obj(&w);
    mesh_jw_key(&w, "inner");
    mesh_jw_tree(&w, mesh_jw_take(&inner));
    mesh_jw_end(&w);
    t = mesh_jw_dumps(&w, MESH_JW_LINE, 17);
    assert_string_equal(t, "{\"inner\": {\"k\": 1}}");
    free(t);
    /* an unfinished document is discarded whole */
    mesh_jw_init(&w);
    mesh_jw_obj(&w);
    mesh_jw_key(&w, "x");
    mesh_jw_arr(&w);
    mesh_jw_discard(&w);
    assert_null(w.root);
    assert_int_equal(w.depth, 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_read),
        cmocka_unit_test(test_write_layouts),
        cmocka_unit_test(test_write_numbers),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
