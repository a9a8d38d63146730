/* test_sim_types.c — sim/types.h: the plain sim/ types.
 *   - dtype sizes are the bytes of the C types they stand for (float, int32_t, a bfloat16 is the
 *     top half of a float32, uint8_t) and the names MaxText's configs use;
 *   - phase and memory-category names are distinct and non-empty (the report tables key on them);
 *   - sim_axes_* keep the axes in the order given (a group's rank order);
 *   - sim_str_put appends like snprintf's "%s" / "%.*s": truncated at the capacity and at `max`,
 *     always terminated, a start past the end clamped;
 *   - sim_now_ns never goes back and sees a 2 ms sleep as at least 2 ms. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <string.h>
#include <time.h>

#include "sim/types.h"

static void test_dtypes(void **state)
{
    (void)state;
    assert_int_equal(sim_dtype_size(SIM_F32), sizeof(float));
    assert_int_equal(sim_dtype_size(SIM_I32), sizeof(int32_t));
    assert_int_equal(sim_dtype_size(SIM_BF16), sizeof(float) / 2);
    assert_int_equal(sim_dtype_size(SIM_U8), sizeof(uint8_t));
    assert_string_equal(sim_dtype_name(SIM_F32), "float32");
    assert_string_equal(sim_dtype_name(SIM_I32), "int32");
    assert_string_equal(sim_dtype_name(SIM_BF16), "bfloat16");
    assert_string_equal(sim_dtype_name(SIM_U8), "uint8");
}

static void test_names_distinct(void **state)
{
    (void)state;
    for (int p = 0; p < SIM_NPHASE; p++) {
        assert_true(strlen(sim_phase_name((sim_phase)p)) > 0);
        for (int q = 0; q < p; q++) assert_string_not_equal(sim_phase_name((sim_phase)p), sim_phase_name((sim_phase)q));
    }
    assert_string_equal(sim_phase_name(SIM_PHASE_FORWARD), "forward");
    assert_string_equal(sim_phase_name(SIM_PHASE_BACKWARD), "backward");
    for (int c = 0; c < SIM_NMEM; c++) {
        assert_true(strlen(sim_mem_cat_name((sim_mem_cat)c)) > 0);
        for (int d = 0; d < c; d++)
            assert_string_not_equal(sim_mem_cat_name((sim_mem_cat)c), sim_mem_cat_name((sim_mem_cat)d));
    }
    assert_string_equal(sim_mem_cat_name(SIM_MEM_PARAMS), "params");
}

static void test_axes(void **state)
{
    (void)state;
    sim_axes a = sim_axes_none();
    assert_int_equal(a.n, 0);
    a = sim_axes_1(4);
    assert_int_equal(a.n, 1);
    assert_int_equal(a.axis[0], 4);
    a = sim_axes_2(3, 1);
    assert_int_equal(a.n, 2);
    assert_int_equal(a.axis[0], 3);
    assert_int_equal(a.axis[1], 1);
    a = sim_axes_3(2, 0, 5);
    assert_int_equal(a.n, 3);
    assert_int_equal(a.axis[0], 2);
    assert_int_equal(a.axis[1], 0);
    assert_int_equal(a.axis[2], 5);
}

static void test_str_put(void **state)
{
    (void)state;
    char buf[8];
    size_t at = sim_str_put(buf, sizeof buf, 0, "ab", SIZE_MAX);
    assert_int_equal(at, 2);
    assert_string_equal(buf, "ab");
    at = sim_str_put(buf, sizeof buf, at, "cdefghij", SIZE_MAX); /* truncated at cap - 1 = 7 bytes */
    assert_string_equal(buf, "abcdefg");
    assert_int_equal(at, 7);
    at = sim_str_put(buf, sizeof buf, 1, "xyz", 2); /* at most 2 bytes ("%.2s"), from position 1 */
    assert_string_equal(buf, "axy");
    assert_int_equal(at, 3);
    at = sim_str_put(buf, sizeof buf, 50, "q", SIZE_MAX); /* a start past the end: clamped to cap - 1, no room */
    assert_int_equal(at, 7);
    assert_string_equal(buf, "axy");                            /* nothing written before the end */
    assert_int_equal(sim_str_put(buf, 0, 0, "q", SIZE_MAX), 0); /* no capacity: nothing written */
}

static void test_clock(void **state)
{
    (void)state;
    uint64_t t0 = sim_now_ns();
    struct timespec d = {0, 2000000};
    nanosleep(&d, NULL);
    uint64_t t1 = sim_now_ns();
    assert_true(t1 >= t0 + 2000000);
    for (int i = 0; i < 1000; i++) {
        uint64_t t = sim_now_ns();
        assert_true(t >= t1);
        t1 = t;
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_dtypes),  cmocka_unit_test(test_names_distinct), cmocka_unit_test(test_axes),
        cmocka_unit_test(test_str_put), cmocka_unit_test(test_clock),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
