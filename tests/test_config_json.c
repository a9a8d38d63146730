/* test_config_json.c — config/json.h: JSON read into a plain tree.
 *   - every kind parses to its value: null, booleans, integers (exact, with their text), other
 *     numbers (double, %.17g text), strings with escapes and \u sequences (UTF-8 out), arrays and
 *     objects in file order;
 *   - mesh_json_get finds a member by key (NULL for a missing key or a non-object);
 *   - equality is semantic: numbers by value (1 == 1.0), objects in any key order, arrays in order;
 *   - bad input is refused with the input's name and line:column (trailing garbage, a duplicate
 *     key, an unterminated string, a missing file as an I/O error). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "config/json.h"
#include "tests/helpers.h"

static mesh_json *parse(const char *text)
{
    mesh_json *j = NULL;
    if (mesh_json_parse(text, strlen(text), "t.json", &j) != SIM_OK) fail_msg("%s", sim_errmsg());
    return j;
}

static void test_kinds(void **state)
{
    (void)state;
    mesh_json *j =
        parse("{\"n\": null, \"t\": true, \"f\": false, \"i\": -42, \"big\": 9007199254740993,"
              " \"x\": 0.5, \"e\": 1e3, \"s\": \"a\\\"b\\\\c\\n\\u00e9\", \"a\": [1, [2, 3], {}], \"o\": {\"k\": 7}}");
    assert_int_equal(j->kind, MESH_JSON_OBJECT);
    assert_int_equal(j->n, 10);
    static const char *const keys[] = {"n", "t", "f", "i", "big", "x", "e", "s", "a", "o"};
    for (int k = 0; k < 10; k++) assert_string_equal(j->keys[k], keys[k]); /* file order */
    assert_int_equal(mesh_json_get(j, "n")->kind, MESH_JSON_NULL);
    assert_int_equal(mesh_json_get(j, "t")->boolean, 1);
    assert_int_equal(mesh_json_get(j, "f")->boolean, 0);
    const mesh_json *i = mesh_json_get(j, "i");
    assert_true(i->is_integer && i->integer == -42 && i->number == -42.0);
    assert_string_equal(i->str, "-42");
    const mesh_json *big = mesh_json_get(j, "big"); /* 2^53 + 1: exact as an integer, not as a double */
    assert_true(big->is_integer);
    assert_true(big->integer == 9007199254740993LL);
    assert_string_equal(big->str, "9007199254740993");
    const mesh_json *x = mesh_json_get(j, "x"), *e = mesh_json_get(j, "e");
    assert_false(x->is_integer);
    assert_true(x->number == 0.5);
    assert_false(e->is_integer);
    assert_true(e->number == 1000.0);
    assert_string_equal(mesh_json_get(j, "s")->str, "a\"b\\c\n\xc3\xa9"); /* é in UTF-8 */
    const mesh_json *a = mesh_json_get(j, "a");
    assert_int_equal(a->kind, MESH_JSON_ARRAY);
    assert_int_equal(a->n, 3);
    assert_int_equal(a->items[1].n, 2);
    assert_int_equal(a->items[1].items[1].integer, 3);
    assert_int_equal(a->items[2].kind, MESH_JSON_OBJECT);
    assert_int_equal(a->items[2].n, 0);
    assert_int_equal(mesh_json_get(mesh_json_get(j, "o"), "k")->integer, 7);
    assert_null(mesh_json_get(j, "missing"));
    assert_null(mesh_json_get(a, "k")); /* not an object */
    assert_string_equal(mesh_json_kind_name(MESH_JSON_ARRAY), "array");
    mesh_json_free(j);
}

static void test_equal(void **state)
{
    (void)state;
    mesh_json *a = parse("{\"x\": 1, \"y\": [1, 2, {\"z\": null}]}");
    mesh_json *b = parse("{\"y\": [1.0, 2, {\"z\": null}], \"x\": 1.0}");
    mesh_json *c = parse("{\"y\": [2, 1, {\"z\": null}], \"x\": 1}");
    mesh_json *d = parse("{\"x\": 1, \"y\": [1, 2, {\"z\": false}]}");
    mesh_json *e = parse("{\"x\": 1, \"y\": [1, 2, {\"z\": null}], \"w\": 0}");
    assert_true(mesh_json_equal(a, b));
    assert_true(mesh_json_equal(b, a));
    assert_false(mesh_json_equal(a, c)); /* array order matters */
    assert_false(mesh_json_equal(a, d)); /* null is not false */
    assert_false(mesh_json_equal(a, e)); /* an extra key */
    assert_false(mesh_json_equal(e, a));
    mesh_json_free(a);
    mesh_json_free(b);
    mesh_json_free(c);
    mesh_json_free(d);
    mesh_json_free(e);
}

static void expect_refused(const char *text, const char *needle)
{
    mesh_json *j = NULL;
    sim_status st = mesh_json_parse(text, strlen(text), "bad.json", &j);
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
    mesh_json *j = NULL;
    assert_int_equal(mesh_json_read_file("/nonexistent/x.json", &j), SIM_ERR_IO);
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
    mesh_json *j = helper_read_json(NULL, path);
    mesh_json *k = parse(text);
    assert_true(mesh_json_equal(j, k));
    mesh_json_free(j);
    mesh_json_free(k);
    unlink(path);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_kinds),
        cmocka_unit_test(test_equal),
        cmocka_unit_test(test_refusals),
        cmocka_unit_test(test_read_file),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
