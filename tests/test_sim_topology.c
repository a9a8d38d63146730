/* test_sim_topology.c — sim/topology.h: the host's cores and thread pinning.
 *   - the core count is at least 1 and at most the processors the OS has online;
 *   - OpenBLAS threads per device are max(1, cores / devices), for every device count up to
 *     twice the cores (and a non-positive count gets all the cores);
 *   - a pinned thread runs on the processors of one core only, index and index + cores pin to the
 *     same core (index % cores), and two different cores give disjoint sets; where the OS refuses
 *     binding (some containers), the refusal is a status with a message, as the machine expects. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <pthread.h>
#include <sched.h>
#include <string.h>
#include <unistd.h>

#include "sim/topology.h"

static void test_cores(void **state)
{
    (void)state;
    int c = sim_topology_cores();
    long online = sysconf(_SC_NPROCESSORS_ONLN);
    assert_true(c >= 1);
    if (online > 0) assert_true(c <= online);
    assert_int_equal(sim_topology_cores(), c); /* loaded once: the same answer */
}

static void test_topology(void **state)
{
    (void)state;
    int cores = sim_topology_cores();
    assert_true(cores >= 1);
    assert_int_equal(sim_topology_blas_threads(1), cores);
    assert_int_equal(sim_topology_blas_threads(cores * 4), 1);
    assert_int_equal(sim_topology_blas_threads(64), cores / 64 > 1 ? cores / 64 : 1);
}

static void test_blas_threads(void **state)
{
    (void)state;
    int c = sim_topology_cores();
    for (int d = 1; d <= 2 * c + 2; d++) {
        int want = c / d < 1 ? 1 : c / d;
        assert_int_equal(sim_topology_blas_threads(d), want);
    }
    assert_int_equal(sim_topology_blas_threads(0), c);
    assert_int_equal(sim_topology_blas_threads(-4), c);
}

typedef struct {
    int index;
    sim_status st;
    cpu_set_t set;
} pin_job;

static void *pin_thread(void *arg)
{
    pin_job *j = arg;
    j->st = sim_topology_pin_self(j->index);
    CPU_ZERO(&j->set);
    if (j->st == SIM_OK) pthread_getaffinity_np(pthread_self(), sizeof j->set, &j->set);
    else if (!*sim_errmsg()) j->st = SIM_ERR_INTERNAL + 100; /* a refusal must say why */
    return NULL;
}

static pin_job pin(int index)
{
    pin_job j;
    memset(&j, 0, sizeof j);
    j.index = index;
    pthread_t t;
    assert_int_equal(pthread_create(&t, NULL, pin_thread, &j), 0);
    assert_int_equal(pthread_join(t, NULL), 0);
    return j;
}

static void test_pin(void **state)
{
    (void)state;
    int c = sim_topology_cores();
    pin_job a = pin(0);
    if (a.st != SIM_OK) {
        assert_int_equal(a.st, SIM_ERR_INTERNAL); /* refused, with a message */
        print_message("binding refused here; the refusal is a status with a message\n");
        return;
    }
    long online = sysconf(_SC_NPROCESSORS_ONLN);
    assert_true(CPU_COUNT(&a.set) >= 1 && CPU_COUNT(&a.set) <= online);
    pin_job again = pin(c); /* c % c = core 0 */
    assert_int_equal(again.st, SIM_OK);
    assert_true(CPU_EQUAL(&a.set, &again.set));
    if (c > 1) {
        pin_job b = pin(1);
        assert_int_equal(b.st, SIM_OK);
        cpu_set_t both;
        CPU_AND(&both, &a.set, &b.set);
        assert_int_equal(CPU_COUNT(&both), 0);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_cores),
        cmocka_unit_test(test_topology),
        cmocka_unit_test(test_blas_threads),
        cmocka_unit_test(test_pin),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
