/* test_sim_status.c — sim/status.h: the one status enum and the thread's error message.
 *   - sim_err keeps the formatted message and returns the status it was given; sim_err_append
 *     adds context; sim_err_clear empties both message and trail;
 *   - SIM_TRY passes a failure up unchanged and records each file:line it travelled through (the
 *     trail SHARDSIM_DEBUG prints), in call order, and a success passes through without a trace;
 *   - the message is per thread: another thread's sim_err leaves this thread's alone;
 *   - save / restore / init of the state the fiber scheduler swaps between devices;
 *   - exit codes: 0 for SIM_OK, 2 for bad input and I/O (what a user fixes), 1 for the rest;
 *     every status has its own name. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sim/status.h"
#include "tests/helpers.h"

static void test_message_and_append(void **state)
{
    (void)state;
    sim_err_clear();
    assert_string_equal(sim_errmsg(), "");
    assert_int_equal(sim_err(SIM_ERR_INPUT, "steps=%d: expected a count >= %d", -3, 1), SIM_ERR_INPUT);
    assert_string_equal(sim_errmsg(), "steps=-3: expected a count >= 1");
    sim_err_append(" (%s)", "set steps=1 or more");
    assert_string_equal(sim_errmsg(), "steps=-3: expected a count >= 1 (set steps=1 or more)");
    /* a new error replaces the old message */
    assert_int_equal(sim_err(SIM_ERR_IO, "cannot read %s", "x.yml"), SIM_ERR_IO);
    assert_string_equal(sim_errmsg(), "cannot read x.yml");
    sim_err_clear();
    assert_string_equal(sim_errmsg(), "");
    assert_string_equal(sim_err_trail(), "");
}

/* A long message is cut at the buffer, not overrun; appending to a full buffer changes nothing. */
static void test_long_message(void **state)
{
    (void)state;
    char big[6000];
    memset(big, 'k', sizeof big - 1);
    big[sizeof big - 1] = '\0';
    sim_err(SIM_ERR_INPUT, "%s", big);
    size_t n = strlen(sim_errmsg());
    assert_true(n > 1000 && n < sizeof big - 1);
    sim_err_append("tail");
    assert_int_equal(strlen(sim_errmsg()), n);
    sim_err_clear();
}

static int inner_line, outer_line;

static sim_status inner(int fail)
{
    if (fail) return sim_err(SIM_ERR_SHARDING, "inner failed");
    return SIM_OK;
}

static sim_status middle(int fail)
{
    inner_line = __LINE__ + 1;
    SIM_TRY(inner(fail));
    return SIM_OK;
}

static sim_status outer(int fail)
{
    outer_line = __LINE__ + 1;
    SIM_TRY(middle(fail));
    return SIM_OK;
}

static void test_try_trail(void **state)
{
    (void)state;
    sim_err_clear();
    assert_int_equal(outer(0), SIM_OK);
    assert_string_equal(sim_err_trail(), "");
    assert_int_equal(outer(1), SIM_ERR_SHARDING);
    assert_string_equal(sim_errmsg(), "inner failed");
    char want[256];
    snprintf(want, sizeof want, "  at %s:%d\n  at %s:%d", __FILE__, inner_line, __FILE__, outer_line);
    assert_string_equal(sim_err_trail(), want);
    /* a new error starts a new trail */
    sim_err(SIM_ERR_CHECK, "again");
    assert_string_equal(sim_err_trail(), "");
    sim_err_clear();
}

static void *other_thread(void *arg)
{
    (void)arg;
    sim_err(SIM_ERR_OOM, "device 3 is out of memory");
    return strcmp(sim_errmsg(), "device 3 is out of memory") == 0 ? arg : NULL;
}

static void test_per_thread(void **state)
{
    (void)state;
    sim_err(SIM_ERR_INPUT, "main thread's message");
    pthread_t t;
    int token = 1;
    void *ret = NULL;
    assert_int_equal(pthread_create(&t, NULL, other_thread, &token), 0);
    assert_int_equal(pthread_join(t, &ret), 0);
    assert_ptr_equal(ret, &token);
    assert_string_equal(sim_errmsg(), "main thread's message");
    sim_err_clear();
}

static void test_save_restore(void **state)
{
    (void)state;
    char *a = malloc(SIM_ERR_STATE_BYTES), *b = malloc(SIM_ERR_STATE_BYTES);
    sim_err(SIM_ERR_CHECK, "device A");
    sim_err_trace("a.c", 7);
    sim_err_state_save(a);
    sim_err_state_init(b);
    sim_err_state_restore(b);
    assert_string_equal(sim_errmsg(), "");
    assert_string_equal(sim_err_trail(), "");
    sim_err(SIM_ERR_CHECK, "device B");
    sim_err_state_save(b);
    sim_err_state_restore(a);
    assert_string_equal(sim_errmsg(), "device A");
    assert_string_equal(sim_err_trail(), "  at a.c:7");
    sim_err_state_restore(b);
    assert_string_equal(sim_errmsg(), "device B");
    assert_string_equal(sim_err_trail(), "");
    free(a);
    free(b);
    sim_err_clear();
}

static void test_exit_codes_and_names(void **state)
{
    (void)state;
    static const struct {
        sim_status st;
        int code;
    } want[] = {{SIM_OK, 0},           {SIM_ERR_INPUT, 2},    {SIM_ERR_IO, 2},       {SIM_ERR_OOM, 1},
                {SIM_ERR_MISMATCH, 1}, {SIM_ERR_DEADLOCK, 1}, {SIM_ERR_SHARDING, 1}, {SIM_ERR_CHECK, 1},
                {SIM_ERR_ABORTED, 1},  {SIM_ERR_INTERNAL, 1}};
    enum { N = sizeof want / sizeof want[0] };
    for (int i = 0; i < N; i++) {
        assert_int_equal(sim_status_exit_code(want[i].st), want[i].code);
        const char *name = sim_status_name(want[i].st);
        assert_true(strlen(name) > 0 && strcmp(name, "unknown status") != 0);
        for (int j = 0; j < i; j++) assert_string_not_equal(name, sim_status_name(want[j].st));
    }
    assert_string_equal(sim_status_name(SIM_OK), "ok");
    assert_string_equal(sim_status_name((sim_status)99), "unknown status");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_message_and_append), cmocka_unit_test(test_long_message),
        cmocka_unit_test(test_try_trail),          cmocka_unit_test(test_per_thread),
        cmocka_unit_test(test_save_restore),       cmocka_unit_test(test_exit_codes_and_names),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
