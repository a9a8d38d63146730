/* test_bk_roofline.c — blas_kernels/bk_roofline.h: the measured sgemm roof.
 *   - the core count is the OS's online processors (at least 1);
 *   - a measurement is a positive rate that cannot beat the time it took: a product of 2 M N K
 *     flops measured over at least min_seconds and three runs took at least as long as three
 *     products at the measured rate, checked as wall time >= 3 x 2 M N K / rate;
 *   - OpenBLAS's thread count is put back after measuring (the benchmarks measure between runs
 *     that set their own). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <cblas.h>
#include <time.h>
#include <unistd.h>

#include "blas_kernels/bk_roofline.h"

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void test_cores(void **state)
{
    (void)state;
    long online = sysconf(_SC_NPROCESSORS_ONLN);
    assert_int_equal(bk_num_cores(), online > 0 ? online : 1);
}

static void test_gflops_bounded_by_its_time(void **state)
{
    (void)state;
    enum { M = 64, N = 96, K = 128 };
    int before = openblas_get_num_threads();
    double t0 = now_s();
    double g = bk_sgemm_gflops(1, M, N, K, 0.01);
    double took = now_s() - t0;
    assert_true(g > 0);
    /* at least 3 timed products (plus a warm-up), each 2 M N K flops at g GFLOP/s at best */
    double floor_s = 3.0 * 2.0 * M * N * K / (g * 1e9);
    assert_true(took >= floor_s);
    assert_true(took >= 0.01);
    assert_int_equal(openblas_get_num_threads(), before);
}

static void test_threads_restored(void **state)
{
    (void)state;
    int before = openblas_get_num_threads();
    openblas_set_num_threads(1);
    double g = bk_sgemm_gflops(0, 32, 32, 32, 0.001); /* all cores while measuring */
    assert_true(g > 0);
    assert_int_equal(openblas_get_num_threads(), 1);
    openblas_set_num_threads(before);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_cores),
        cmocka_unit_test(test_gflops_bounded_by_its_time),
        cmocka_unit_test(test_threads_restored),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
