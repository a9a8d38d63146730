/* test_bk_parallel.c — the kernel worker pool: every index runs exactly
 * once, chunk boundaries do not depend on the thread count (so a chunked
 * sum is bitwise equal for 1 and 2 threads), thousands of back-to-back jobs
 * never mix their functions, and two callers at once both finish.  `make
 * tsan` runs this binary too. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "blas_kernels/bk_parallel.h"

typedef struct {
    int *hits;
    int tag;
} hit_arg;

static void mark(int64_t lo, int64_t hi, void *arg)
{
    hit_arg *h = arg;
    for (int64_t i = lo; i < hi; i++) h->hits[i] += h->tag;
}

static void test_each_index_once(void **state)
{
    (void)state;
    for (int threads = 1; threads <= 4; threads++) {
        bk_parallel_set_threads(threads);
        int64_t sizes[] = {0, 1, 7, 1000, 100003};
        for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++) {
            int64_t n = sizes[s];
            int *hits = calloc((size_t)n + 1, sizeof *hits);
            hit_arg h = {hits, 1};
            bk_parallel_for(n, 97, mark, &h);
            for (int64_t i = 0; i < n; i++) assert_int_equal(hits[i], 1);
            free(hits);
        }
    }
    bk_parallel_set_threads(1);
}

typedef struct {
    const float *x;
    double *partial; /* one per chunk */
    int64_t grain;
} sum_arg;

static void chunk_sum(int64_t lo, int64_t hi, void *arg)
{
    sum_arg *s = arg;
    double acc = 0;
    for (int64_t i = lo; i < hi; i++) acc += s->x[i] * 1.000001;
    s->partial[lo / s->grain] = acc;
}

static double chunked_sum(const float *x, int64_t n, int64_t grain)
{
    int64_t nc = (n + grain - 1) / grain;
    double *p = calloc((size_t)nc, sizeof *p);
    sum_arg a = {x, p, grain};
    bk_parallel_for(n, grain, chunk_sum, &a);
    double t = 0;
    for (int64_t c = 0; c < nc; c++) t += p[c]; /* fixed order */
    free(p);
    return t;
}

static void test_bitwise_independent_of_threads(void **state)
{
    (void)state;
    int64_t n = 1 << 20;
    float *x = malloc((size_t)n * sizeof *x);
    uint64_t r = 1;
    for (int64_t i = 0; i < n; i++) {
        r = r * 6364136223846793005ull + 1442695040888963407ull;
        x[i] = (float)((double)(r >> 11) / 9007199254740992.0 - 0.5);
    }
    bk_parallel_set_threads(1);
    double s1 = chunked_sum(x, n, 4096);
    bk_parallel_set_threads(2);
    double s2 = chunked_sum(x, n, 4096);
    bk_parallel_set_threads(4);
    double s4 = chunked_sum(x, n, 4096);
    assert_memory_equal(&s1, &s2, sizeof s1);
    assert_memory_equal(&s1, &s4, sizeof s1);
    bk_parallel_set_threads(1);
    free(x);
}

static void test_back_to_back_jobs(void **state)
{
    (void)state;
    bk_parallel_set_threads(3);
    int n = 513;
    int *a = calloc((size_t)n, sizeof *a), *b = calloc((size_t)n, sizeof *b);
    for (int it = 0; it < 2000; it++) {
        hit_arg ha = {a, 1}, hb = {b, 2};
        bk_parallel_for(n, 5, mark, it % 2 ? &hb : &ha);
    }
    for (int i = 0; i < n; i++) {
        assert_int_equal(a[i], 1000);
        assert_int_equal(b[i], 2000);
    }
    free(a);
    free(b);
    bk_parallel_set_threads(1);
}

/* bk_parallel_zero clears exactly [p, p + bytes) (and bk_parallel_copy fills it), on several chunks (and an odd tail) with 2
 * threads and inline with 1, and leaves the bytes around it alone. */
static void test_zero_exact_range(void **state)
{
    (void)state;
    const size_t bytes = (3u << 20) + 4100; /* a dozen 256 KiB chunks and a partial one */
    unsigned char *buf = malloc(bytes + 64);
    assert_non_null(buf);
    for (int threads = 1; threads <= 2; threads++) {
        bk_parallel_set_threads(threads);
        memset(buf, 0xA5, bytes + 64);
        bk_parallel_zero(buf + 32, bytes);
        for (size_t i = 0; i < bytes + 64; i++) assert_int_equal(buf[i], i < 32 || i >= bytes + 32 ? 0xA5 : 0);
        bk_parallel_zero(NULL, 10); /* no buffer (a dry run's array): nothing */
    }
    /* bk_parallel_copy: the same range rules, byte for byte */
    unsigned char *src = malloc(bytes);
    assert_non_null(src);
    for (size_t i = 0; i < bytes; i++) src[i] = (unsigned char)(i * 2654435761u >> 13);
    for (int threads = 1; threads <= 2; threads++) {
        bk_parallel_set_threads(threads);
        memset(buf, 0xA5, bytes + 64);
        bk_parallel_copy(buf + 32, src, bytes);
        for (size_t i = 0; i < bytes + 64; i++)
            assert_int_equal(buf[i], i < 32 || i >= bytes + 32 ? 0xA5 : src[i - 32]);
    }
    free(src);
    free(buf);
    bk_parallel_set_threads(1);
}

static void *caller(void *arg)
{
    int *hits = arg;
    for (int it = 0; it < 300; it++) {
        hit_arg h = {hits, 1};
        bk_parallel_for(1000, 10, mark, &h);
    }
    return NULL;
}

static void test_two_callers(void **state)
{
    (void)state;
    bk_parallel_set_threads(2);
    int *h1 = calloc(1000, sizeof *h1), *h2 = calloc(1000, sizeof *h2);
    pthread_t t1, t2;
    pthread_create(&t1, NULL, caller, h1);
    pthread_create(&t2, NULL, caller, h2);
    pthread_join(t1, NULL);
    pthread_join(t2, NULL);
    for (int i = 0; i < 1000; i++) {
        assert_int_equal(h1[i], 300);
        assert_int_equal(h2[i], 300);
    }
    free(h1);
    free(h2);
    bk_parallel_set_threads(1);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_each_index_once),   cmocka_unit_test(test_bitwise_independent_of_threads),
        cmocka_unit_test(test_back_to_back_jobs), cmocka_unit_test(test_two_callers),
        cmocka_unit_test(test_zero_exact_range),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
