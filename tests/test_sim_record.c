/* test_sim_record.c — sim/record.h: the collective ops' names, as the traffic tables, the traces
 * and run.json print them (the strings XLA's HLO uses for the same collectives), one per op. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "sim/record.h"

static void test_op_names(void **state)
{
    (void)state;
    assert_int_equal(SIM_NOP, 6);
    assert_string_equal(sim_op_name(SIM_OP_ALL_GATHER), "all-gather");
    assert_string_equal(sim_op_name(SIM_OP_REDUCE_SCATTER), "reduce-scatter");
    assert_string_equal(sim_op_name(SIM_OP_ALL_REDUCE), "all-reduce");
    assert_string_equal(sim_op_name(SIM_OP_ALL_TO_ALL), "all-to-all");
    assert_string_equal(sim_op_name(SIM_OP_PPERMUTE), "ppermute");
    assert_string_equal(sim_op_name(SIM_OP_RAGGED_ALL_TO_ALL), "ragged-all-to-all");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_op_names),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
