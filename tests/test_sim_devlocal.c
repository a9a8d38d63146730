/* test_sim_devlocal.c — sim/devlocal.h: the registry of device-local thread-locals.
 *   - save reads every registered slot of the calling thread, in registration order;
 *   - restore writes them back (a fiber's swap: the values it saved, not the thread's since);
 *   - registering the same accessors again adds no slot.
 * The fibers' use of it (slots kept across swaps, NULL on a fresh device) is test_sim_fiber's. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "sim/devlocal.h"

static _Thread_local void *tl_a, *tl_b;
static void *get_a(void) { return tl_a; }
static void set_a(void *p) { tl_a = p; }
static void *get_b(void) { return tl_b; }
static void set_b(void *p) { tl_b = p; }

static void test_save_and_restore(void **state)
{
    (void)state;
    sim_device_local_register(get_a, set_a);
    sim_device_local_register(get_b, set_b);
    sim_device_local_register(get_a, set_a); /* again: no third slot */
    int x, y, z;
    tl_a = &x;
    tl_b = &y;
    void *slots[SIM_DEVICE_LOCALS_MAX] = {0};
    void *const sentinel = &z;
    for (int i = 0; i < SIM_DEVICE_LOCALS_MAX; i++) slots[i] = sentinel;
    sim_device_locals_save(slots);
    assert_ptr_equal(slots[0], &x);
    assert_ptr_equal(slots[1], &y);
    assert_ptr_equal(slots[2], sentinel); /* only two slots were registered */
    /* another device runs on the thread: its values, then ours back */
    tl_a = &z;
    tl_b = NULL;
    sim_device_locals_restore(slots);
    assert_ptr_equal(tl_a, &x);
    assert_ptr_equal(tl_b, &y);
    void *fresh[SIM_DEVICE_LOCALS_MAX] = {0};
    sim_device_locals_restore(fresh); /* a fresh device: every slot NULL */
    assert_null(tl_a);
    assert_null(tl_b);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_save_and_restore),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
