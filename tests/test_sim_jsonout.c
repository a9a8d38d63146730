/* test_sim_jsonout.c — sim/jsonout.h, the one JSON writer, against jansson 2.14's json_dumps (the
 * writer it replaced, an independent implementation): random documents (nesting, empty
 * containers, every escape, non-ASCII text and code points beyond the BMP, reals of every
 * magnitude, the integers' extremes) written in each layout and precision give the same bytes;
 * escapes and layouts also against hand-written texts; text that is not UTF-8 is written with '?'
 * for its high bytes; arr_lines and the document's tail; a write error is reported. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sim/jsonout.h"

/* A document written to memory. */
typedef struct {
    char *buf;
    size_t n;
    FILE *f;
    sim_json *j;
} doc;

static sim_json *doc_open(doc *d, int layout, bool ascii, int precision)
{
    d->buf = NULL;
    d->f = open_memstream(&d->buf, &d->n);
    assert_non_null(d->f);
    assert_int_equal(sim_json_new(d->f, layout, ascii, precision, &d->j), SIM_OK);
    return d->j;
}

/* The text written (the caller frees it). */
static char *doc_close(doc *d, const char *tail)
{
    assert_int_equal(sim_json_close(d->j, tail, "test"), SIM_OK);
    fclose(d->f);
    return d->buf;
}

static uint64_t rng(uint64_t *s)
{
    *s = *s * 6364136223846793005ull + 1442695040888963407ull;
    return *s >> 33;
}

static const char *const STRINGS[] = {
    "", "plain", "q\"b\\s/", "\b\f\n\r\t", "\x01\x1f end", "caf\xc3\xa9", "\xe2\x82\xac 20",
    "\xf0\x9f\x98\x80 smile", "\x7f del", "decoder/layers_0/self_attention",
};

static double random_real(uint64_t *s)
{
    static const double fixed[] = {0.0, -0.0, 1.0, 0.1, 1e20, 1e-5, 123456789012.0, 2.5e-300, 1.7976931348623157e308,
                                   -3.25, 1e16, 1e17, 0.3333333333333333};
    if (rng(s) % 2) return fixed[rng(s) % (sizeof fixed / sizeof fixed[0])];
    double m = (double)(rng(s) % 2000001) / 1000.0 - 1000.0;
    return m * pow(10.0, (double)((int)(rng(s) % 41) - 20));
}

/* A random value as a jansson tree, written to j in the same call order. */
static json_t *random_value(uint64_t *s, sim_json *j, int depth)
{
    int kind = (int)(rng(s) % (depth < 4 ? 8 : 6));
    switch (kind) {
    case 0: sim_json_null(j); return json_null();
    case 1: {
        bool b = rng(s) % 2;
        sim_json_bool(j, b);
        return json_boolean(b);
    }
    case 2: {
        static const int64_t ints[] = {0, 1, -1, INT64_MAX, INT64_MIN, 1234567890123ll};
        int64_t v = rng(s) % 2 ? ints[rng(s) % 6] : (int64_t)rng(s) - (1ll << 30);
        sim_json_i64(j, v);
        return json_integer((json_int_t)v);
    }
    case 3: {
        double d = random_real(s);
        sim_json_real(j, d);
        return json_real(d);
    }
    case 4:
    case 5: {
        const char *t = STRINGS[rng(s) % (sizeof STRINGS / sizeof STRINGS[0])];
        sim_json_str(j, t);
        return json_string(t);
    }
    case 6: {
        json_t *a = json_array();
        sim_json_arr(j);
        for (int n = (int)(rng(s) % 4); n > 0; n--) json_array_append_new(a, random_value(s, j, depth + 1));
        sim_json_end(j);
        return a;
    }
    default: {
        json_t *o = json_object();
        sim_json_obj(j);
        for (int n = (int)(rng(s) % 4), k = 0; k < n; k++) {
            char key[64];
            snprintf(key, sizeof key, "%s%d", STRINGS[rng(s) % (sizeof STRINGS / sizeof STRINGS[0])], k);
            sim_json_key(j, key);
            json_object_set_new(o, key, random_value(s, j, depth + 1));
        }
        sim_json_end(j);
        return o;
    }
    }
}

static void test_same_bytes_as_jansson(void **state)
{
    (void)state;
    const struct {
        int layout;
        bool ascii;
        size_t flags;
    } layouts[] = {
        {2, true, JSON_INDENT(2) | JSON_ENSURE_ASCII},
        {SIM_JSON_LINE, false, 0},
        {1, false, JSON_INDENT(1)},
        {SIM_JSON_COMPACT, false, JSON_COMPACT},
        {SIM_JSON_COMPACT, true, JSON_COMPACT | JSON_ENSURE_ASCII},
    };
    const int precisions[] = {17, 9, 6, 1};
    uint64_t s = 12345;
    for (int k = 0; k < 400; k++) {
        int li = k % 5, p = precisions[k / 5 % 4];
        doc d;
        json_t *tree = random_value(&s, doc_open(&d, layouts[li].layout, layouts[li].ascii, p), 0);
        char *got = doc_close(&d, NULL);
        char *want = json_dumps(tree, layouts[li].flags | JSON_REAL_PRECISION(p) | JSON_ENCODE_ANY);
        assert_non_null(want);
        assert_string_equal(got, want);
        free(want);
        free(got);
        json_decref(tree);
    }
}

/* Writes a fixed document in a layout: {"a": [1, {}, []], "s": "x\"\n\u00e9", "r": 0.5}. */
static char *fixed_doc(int layout, bool ascii)
{
    doc d;
    sim_json *j = doc_open(&d, layout, ascii, 17);
    sim_json_obj(j);
    sim_json_key(j, "a");
    sim_json_arr(j);
    sim_json_i64(j, 1);
    sim_json_obj(j);
    sim_json_end(j);
    sim_json_arr(j);
    sim_json_end(j);
    sim_json_end(j);
    sim_json_key(j, "s");
    sim_json_str(j, "x\"\n\xc3\xa9");
    sim_json_key(j, "r");
    sim_json_real(j, 0.5);
    sim_json_end(j);
    return doc_close(&d, "\n");
}

static void test_layouts_by_hand(void **state)
{
    (void)state;
    char *t = fixed_doc(2, true);
    assert_string_equal(t, "{\n  \"a\": [\n    1,\n    {},\n    []\n  ],\n  \"s\": \"x\\\"\\n\\u00E9\",\n  \"r\": 0.5\n}\n");
    free(t);
    t = fixed_doc(SIM_JSON_LINE, false);
    assert_string_equal(t, "{\"a\": [1, {}, []], \"s\": \"x\\\"\\n\xc3\xa9\", \"r\": 0.5}\n");
    free(t);
    t = fixed_doc(SIM_JSON_COMPACT, false);
    assert_string_equal(t, "{\"a\":[1,{},[]],\"s\":\"x\\\"\\n\xc3\xa9\",\"r\":0.5}\n");
    free(t);
}

static void test_numbers_by_hand(void **state)
{
    (void)state;
    const struct {
        double d;
        int p;
        const char *want;
    } cases[] = {{1.0, 17, "1.0"}, {1e20, 17, "1e20"}, {1e-5, 17, "1.0000000000000001e-5"}, {1e-5, 6, "1e-5"},
                 {0.1, 17, "0.10000000000000001"}, {0.1, 9, "0.1"}, {0.1f, 9, "0.100000001"}, {2.5, 1, "2.0"}, {-1e100, 3, "-1e100"}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        doc d;
        sim_json_real(doc_open(&d, SIM_JSON_COMPACT, false, cases[i].p), cases[i].d);
        char *buf = doc_close(&d, NULL);
        assert_string_equal(buf, cases[i].want);
        free(buf);
    }
    /* thousandths: "%.3f" of v / 1000, exact */
    doc d;
    sim_json *j = doc_open(&d, SIM_JSON_COMPACT, false, 17);
    sim_json_arr(j);
    const uint64_t ms[] = {0, 5, 1000, 123456789, UINT64_MAX};
    for (int i = 0; i < 5; i++) sim_json_milli(j, ms[i]);
    sim_json_u64(j, UINT64_MAX);
    sim_json_end(j);
    char *buf = doc_close(&d, NULL);
    assert_string_equal(buf, "[0.000,0.005,1.000,123456.789,18446744073709551.615,18446744073709551615]");
    free(buf);
}

/* arr_lines: each item on its own line, the bracket on the next, also when empty */
static void test_lines_and_invalid_utf8(void **state)
{
    (void)state;
    doc d;
    sim_json *j = doc_open(&d, SIM_JSON_COMPACT, false, 17);
    sim_json_obj(j);
    sim_json_key(j, "e");
    sim_json_arr_lines(j);
    sim_json_obj(j);
    sim_json_key(j, "n");
    sim_json_str(j, "bad \xff\xc3 ok \xc3\xa9");
    sim_json_end(j);
    sim_json_i64(j, 2);
    sim_json_end(j);
    sim_json_key(j, "none");
    sim_json_arr_lines(j);
    sim_json_end(j);
    sim_json_end(j);
    char *buf = doc_close(&d, NULL);
    assert_string_equal(buf, "{\"e\":[\n{\"n\":\"bad ?? ok ??\"},\n2\n],\"none\":[\n]}");
    json_error_t err;
    json_t *back = json_loads(buf, 0, &err);
    assert_non_null(back);
    json_decref(back);
    free(buf);
}

static void test_write_error(void **state)
{
    (void)state;
    FILE *f = fopen("/dev/full", "w");
    if (!f) skip();
    sim_json *j;
    assert_int_equal(sim_json_new(f, 2, true, 17, &j), SIM_OK);
    sim_json_str(j, "x");
    assert_int_equal(sim_json_close(j, "\n", "a test file"), SIM_ERR_IO);
    assert_non_null(strstr(sim_errmsg(), "a test file"));
    fclose(f);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_same_bytes_as_jansson), cmocka_unit_test(test_layouts_by_hand),
        cmocka_unit_test(test_numbers_by_hand),       cmocka_unit_test(test_lines_and_invalid_utf8),
        cmocka_unit_test(test_write_error),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
