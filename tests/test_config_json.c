/* test_config_json.c — config/json.h: JSON read into a plain tree, and written by the one writer.
 *   - every kind parses to its value: null, booleans, integers (exact, with their text), other
 *     numbers (double, %.17g text), strings with escapes and \u sequences (UTF-8 out), arrays and
 *     objects in file order;
 *   - cfg_json_get finds a member by key (NULL for a missing key or a non-object);
 *   - equality is semantic: numbers by value (1 == 1.0), objects in any key order, arrays in order;
 *   - bad input is refused with the input's name and line:column (trailing garbage, a duplicate
 *     key, an unterminated string, a missing file as an I/O error);
 *   - the writer (cfg_jw): escapes done by jansson (quote, backslash, control characters,
 *     non-ASCII as \uXXXX in the indented layout), bytes that are not UTF-8 kept readable,
 *     numbers as %.<digits>g writes them, Python's indent=2 layout; texts written out by hand. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "config/json.h"
#include "tests/helpers.h"

static cfg_json *parse(const char *text)
{
    cfg_json *j = NULL;
    if (cfg_json_parse(text, strlen(text), "t.json", &j) != SIM_OK) fail_msg("%s", sim_errmsg());
    return j;
}

static void test_kinds(void **state)
{
    (void)state;
    cfg_json *j =
        parse("{\"n\": null, \"t\": true, \"f\": false, \"i\": -42, \"big\": 9007199254740993,"
              " \"x\": 0.5, \"e\": 1e3, \"s\": \"a\\\"b\\\\c\\n\\u00e9\", \"a\": [1, [2, 3], {}], \"o\": {\"k\": 7}}");
    assert_int_equal(j->kind, CFG_JSON_OBJECT);
    assert_int_equal(j->n, 10);
    static const char *const keys[] = {"n", "t", "f", "i", "big", "x", "e", "s", "a", "o"};
    for (int k = 0; k < 10; k++) assert_string_equal(j->keys[k], keys[k]); /* file order */
    assert_int_equal(cfg_json_get(j, "n")->kind, CFG_JSON_NULL);
    assert_int_equal(cfg_json_get(j, "t")->boolean, 1);
    assert_int_equal(cfg_json_get(j, "f")->boolean, 0);
    const cfg_json *i = cfg_json_get(j, "i");
    assert_true(i->is_integer && i->integer == -42 && i->number == -42.0);
    assert_string_equal(i->str, "-42");
    const cfg_json *big = cfg_json_get(j, "big"); /* 2^53 + 1: exact as an integer, not as a double */
    assert_true(big->is_integer);
    assert_true(big->integer == 9007199254740993LL);
    assert_string_equal(big->str, "9007199254740993");
    const cfg_json *x = cfg_json_get(j, "x"), *e = cfg_json_get(j, "e");
    assert_false(x->is_integer);
    assert_true(x->number == 0.5);
    assert_false(e->is_integer);
    assert_true(e->number == 1000.0);
    assert_string_equal(cfg_json_get(j, "s")->str, "a\"b\\c\n\xc3\xa9"); /* é in UTF-8 */
    const cfg_json *a = cfg_json_get(j, "a");
    assert_int_equal(a->kind, CFG_JSON_ARRAY);
    assert_int_equal(a->n, 3);
    assert_int_equal(a->items[1].n, 2);
    assert_int_equal(a->items[1].items[1].integer, 3);
    assert_int_equal(a->items[2].kind, CFG_JSON_OBJECT);
    assert_int_equal(a->items[2].n, 0);
    assert_int_equal(cfg_json_get(cfg_json_get(j, "o"), "k")->integer, 7);
    assert_null(cfg_json_get(j, "missing"));
    assert_null(cfg_json_get(a, "k")); /* not an object */
    assert_string_equal(cfg_json_kind_name(CFG_JSON_ARRAY), "array");
    cfg_json_free(j);
}

static void test_equal(void **state)
{
    (void)state;
    cfg_json *a = parse("{\"x\": 1, \"y\": [1, 2, {\"z\": null}]}");
    cfg_json *b = parse("{\"y\": [1.0, 2, {\"z\": null}], \"x\": 1.0}");
    cfg_json *c = parse("{\"y\": [2, 1, {\"z\": null}], \"x\": 1}");
    cfg_json *d = parse("{\"x\": 1, \"y\": [1, 2, {\"z\": false}]}");
    cfg_json *e = parse("{\"x\": 1, \"y\": [1, 2, {\"z\": null}], \"w\": 0}");
    assert_true(cfg_json_equal(a, b));
    assert_true(cfg_json_equal(b, a));
    assert_false(cfg_json_equal(a, c)); /* array order matters */
    assert_false(cfg_json_equal(a, d)); /* null is not false */
    assert_false(cfg_json_equal(a, e)); /* an extra key */
    assert_false(cfg_json_equal(e, a));
    cfg_json_free(a);
    cfg_json_free(b);
    cfg_json_free(c);
    cfg_json_free(d);
    cfg_json_free(e);
}

static void expect_refused(const char *text, const char *needle)
{
    cfg_json *j = NULL;
    sim_status st = cfg_json_parse(text, strlen(text), "bad.json", &j);
    if (st == SIM_OK) fail_msg("accepted: %s", text);
    assert_int_equal(st, SIM_ERR_INPUT);
    assert_null(j);
    assert_contains(sim_errmsg(), "bad.json:");
    assert_contains(sim_errmsg(), needle);
    sim_err_clear();
}

static void test_refusals(void **state)
{
    (void)state;
    expect_refused("{\"a\": 1} x", "invalid JSON");
    expect_refused("{\"a\": 1, \"a\": 2}", "invalid JSON");
    expect_refused("[\"open", "invalid JSON");
    expect_refused("{\n\"a\": tru}", "bad.json:2:");
    cfg_json *j = NULL;
    assert_int_equal(cfg_json_read_file("/nonexistent/x.json", &j), SIM_ERR_IO);
    assert_contains(sim_errmsg(), "/nonexistent/x.json");
    sim_err_clear();
}

static void test_read_file(void **state)
{
    (void)state;
    char path[] = "/tmp/shardsim_json_XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    close(fd);
    const char *text = "[1, \"two\", {\"three\": 3}]\n";
    helper_write_file(path, text, strlen(text));
    cfg_json *j = helper_read_json(NULL, path);
    cfg_json *k = parse(text);
    assert_true(cfg_json_equal(j, k));
    cfg_json_free(j);
    cfg_json_free(k);
    unlink(path);
}

static void test_write_layouts(void **state)
{
    (void)state;
    cfg_jw w;
    cfg_jw_init(&w);
    cfg_jw_obj(&w);
    cfg_jw_key(&w, "s");
    cfg_jw_str(&w, "q\"b\\c\n\x01\xc3\xa9");
    cfg_jw_key(&w, "l");
    cfg_jw_arr(&w);
    cfg_jw_int(&w, -4);
    cfg_jw_u64(&w, 18446744073709551ULL);
    cfg_jw_double(&w, 0.5);
    cfg_jw_double(&w, 2.0);
    cfg_jw_double(&w, NAN);
    cfg_jw_null(&w);
    cfg_jw_bool(&w, 0);
    cfg_jw_end(&w);
    cfg_jw_key(&w, "e");
    cfg_jw_obj(&w);
    cfg_jw_end(&w);
    cfg_jw_end(&w);
    char *indented = cfg_jw_dumps(&w, CFG_JW_INDENT2, 17);
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
    cfg_jw_init(&w);
    cfg_jw_arr(&w);
    cfg_jw_str(&w, "\xc3\xa9");
    cfg_jw_str(&w, "a\xff"
                   "b");
    cfg_jw_str(&w, NULL);
    cfg_jw_end(&w);
    char *line = cfg_jw_dumps(&w, CFG_JW_LINE, 17);
    assert_string_equal(line, "[\"\xc3\xa9\", \"a?b\", null]");
    free(line);
}

/* cfg_jw_num: the number %.<digits>g writes, typed as JSON reads that text. */
static void test_write_numbers(void **state)
{
    (void)state;
    cfg_jw w;
    cfg_jw_init(&w);
    cfg_jw_arr(&w);
    cfg_jw_num(&w, 12.0, 6);      /* "12": an integer */
    cfg_jw_num(&w, 0.1234567, 6); /* "0.123457" */
    cfg_jw_num(&w, 1234567.0, 6); /* "1.23457e+06": a real of that value */
    cfg_jw_num(&w, 1.0 / 3.0, 9); /* "0.333333333" */
    cfg_jw_num(&w, INFINITY, 6);  /* not finite: null */
    cfg_jw_end(&w);
    char *t = cfg_jw_dumps(&w, CFG_JW_LINE, 9);
    assert_string_equal(t, "[12, 0.123457, 1234570.0, 0.333333333, null]");
    free(t);
    /* a tree taken from one writer goes into another */
    cfg_jw inner;
    cfg_jw_init(&inner);
    cfg_jw_obj(&inner);
    cfg_jw_key(&inner, "k");
    cfg_jw_int(&inner, 1);
    cfg_jw_end(&inner);
    cfg_jw_init(&w);
    cfg_jw_obj(&w);
    cfg_jw_key(&w, "inner");
    cfg_jw_tree(&w, cfg_jw_take(&inner));
    cfg_jw_end(&w);
    t = cfg_jw_dumps(&w, CFG_JW_LINE, 17);
    assert_string_equal(t, "{\"inner\": {\"k\": 1}}");
    free(t);
    /* an unfinished document is discarded whole */
    cfg_jw_init(&w);
    cfg_jw_obj(&w);
    cfg_jw_key(&w, "x");
    cfg_jw_arr(&w);
    cfg_jw_discard(&w);
    assert_null(w.root);
    assert_int_equal(w.depth, 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_kinds),     cmocka_unit_test(test_equal),         cmocka_unit_test(test_refusals),
        cmocka_unit_test(test_read_file), cmocka_unit_test(test_write_layouts), cmocka_unit_test(test_write_numbers),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
