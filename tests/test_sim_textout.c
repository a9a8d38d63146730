/* test_sim_textout.c — the hand-written formatting of sim/textout.h prints
 * exactly what printf prints. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sim/textout.h"
#include "sim/trace.h"

/* the text a textout writes, through a memory stream */
typedef struct {
    FILE *f;
    char *buf;
    size_t len;
    sim_textout o;
} capture;

static void cap_open(capture *c)
{
    c->buf = NULL;
    c->len = 0;
    c->f = open_memstream(&c->buf, &c->len);
    assert_non_null(c->f);
    sim_textout_init(&c->o, c->f);
}

static char *cap_close(capture *c)
{
    sim_textout_flush(&c->o);
    fclose(c->f);
    return c->buf;
}

static uint64_t rng(uint64_t *s) /* xorshift64* */
{
    *s ^= *s >> 12;
    *s ^= *s << 25;
    *s ^= *s >> 27;
    return *s * 2685821657736338717ull;
}

static void test_integers_as_printf(void **state)
{
    (void)state;
    uint64_t s = 88172645463325252ull;
    capture *c = malloc(sizeof *c);
    for (int i = 0; i < 20000; i++) {
        uint64_t u = rng(&s) >> (rng(&s) % 64); /* every magnitude */
        int64_t v = (int64_t)rng(&s) >> (rng(&s) % 64);
        if (i == 0) u = 0, v = INT64_MIN;
        if (i == 1) u = UINT64_MAX, v = INT64_MAX;
        cap_open(c);
        sim_textout_u64(&c->o, u);
        sim_textout_char(&c->o, ' ');
        sim_textout_i64(&c->o, v);
        char *got = cap_close(c), want[64];
        snprintf(want, sizeof want, "%llu %lld", (unsigned long long)u, (long long)v);
        assert_string_equal(got, want);
        free(got);
    }
    free(c);
}

/* trace.json prints ts = ns / 1e3 and ts + dur with "%.3f" */
static void test_milli_as_printf(void **state)
{
    (void)state;
    uint64_t s = 2463534242ull;
    capture *c = malloc(sizeof *c);
    for (int i = 0; i < 200000; i++) {
        uint64_t a = rng(&s) >> (16 + rng(&s) % 48), b = rng(&s) >> (16 + rng(&s) % 48); /* < 2^48 */
        if (i == 0) a = 0, b = 999;
        if (i == 1) a = (1ull << 48) - 1, b = (1ull << 48) - 1;
        cap_open(c);
        sim_textout_milli(&c->o, a);
        sim_textout_char(&c->o, ' ');
        sim_textout_milli(&c->o, a + b);
        char *got = cap_close(c), want[96];
        double ts = (double)a / 1e3, dur = (double)b / 1e3;
        snprintf(want, sizeof want, "%.3f %.3f", ts, ts + dur);
        assert_string_equal(got, want);
        free(got);
    }
    free(c);
}

/* a long text crosses the 64 KiB buffer many times, in pieces of every size */
static void test_long_text_in_order(void **state)
{
    (void)state;
    size_t total = 0;
    char *want = malloc(1 << 21);
    capture *c = malloc(sizeof *c);
    cap_open(c);
    char piece[100000];
    for (size_t i = 0; i < sizeof piece; i++) piece[i] = (char)('a' + i % 26);
    uint64_t s = 7;
    while (total < (1 << 21) - sizeof piece) {
        size_t len = (size_t)(rng(&s) % 3 ? rng(&s) % 300 : rng(&s) % sizeof piece);
        sim_textout_mem(&c->o, piece, len);
        memcpy(want + total, piece, len);
        total += len;
    }
    char *got = cap_close(c);
    assert_int_equal(c->len, total);
    assert_memory_equal(got, want, total);
    free(got);
    free(want);
    free(c);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_integers_as_printf),
        cmocka_unit_test(test_milli_as_printf),
        cmocka_unit_test(test_long_text_in_order),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
