/* test_models_determinism.c — a training run is a function of its config: the same config trained
 * twice gives the same bits (every step's loss and gradient norm, every final parameter), on one
 * device with the kernel pool at 2 threads and at 1 thread (the kernels cut their work in chunks
 * that do not depend on the thread count), and on 8 devices (fsdp=4 x tensor=2, where device
 * threads share the pool and run kernels inline when they find it busy). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/helpers.h"
#include "tests/model_run.h"

/* llama2-7b at width 64, 2 layers, 64 tokens (tests/data/llama2-7b-narrow.yml) */
static const char *const SMALL[] = {LLAMA2_NARROW_YML};
enum { NSMALL = sizeof SMALL / sizeof SMALL[0], ROWS = 8, STEPS = 3 };

typedef struct {
    double loss[STEPS], gnorm[STEPS];
    model_grads params;
} outcome;

static void train(const char *const *extra, int n, int devices, const char *threads, outcome *o)
{
    if (threads) setenv("SHARDSIM_KERNEL_THREADS", threads, 1);
    else unsetenv("SHARDSIM_KERNEL_THREADS");
    model_run r;
    model_run_open(&r, SMALL, NSMALL, ROWS, extra, n, devices, STEPS);
    memset(&o->params, 0, sizeof o->params);
    r.job.final_params = &o->params;
    model_run_train(&r, false);
    for (int s = 0; s < STEPS; s++) o->loss[s] = r.job.stats[s].loss, o->gnorm[s] = r.job.stats[s].raw_grad_norm;
    model_run_close(&r);
    unsetenv("SHARDSIM_KERNEL_THREADS");
}

static void expect_same_bits(const char *what, const outcome *a, const outcome *b)
{
    for (int s = 0; s < STEPS; s++)
        if (memcmp(&a->loss[s], &b->loss[s], sizeof(double)) || memcmp(&a->gnorm[s], &b->gnorm[s], sizeof(double)))
            fail_msg("%s: step %d loss %.17g vs %.17g, grad norm %.17g vs %.17g", what, s, a->loss[s], b->loss[s],
                     a->gnorm[s], b->gnorm[s]);
    assert_int_equal(a->params.n, b->params.n);
    int compared = 0;
    for (int i = 0; i < a->params.n; i++) {
        if (!a->params.g[i]) continue;
        size_t bytes = (size_t)(a->params.layer_elems[i] * a->params.n_layers[i]) * sizeof(float);
        if (memcmp(a->params.g[i], b->params.g[i], bytes)) fail_msg("%s: parameter %d differs", what, i);
        compared++;
    }
    assert_true(compared > 0);
}

static void test_one_device_twice_and_thread_counts(void **state)
{
    (void)state;
    const char *one[] = {"ici_fsdp_parallelism=1"};
    outcome a, b, c;
    train(one, 1, 1, "2", &a);
    train(one, 1, 1, "2", &b);
    train(one, 1, 1, "1", &c);
    expect_same_bits("1 device, run twice", &a, &b);
    expect_same_bits("1 device, 2 kernel threads vs 1", &a, &c);
    /* and the run trained: the loss moved */
    assert_true(a.loss[STEPS - 1] < a.loss[0]);
    model_grads_free(&a.params), model_grads_free(&b.params), model_grads_free(&c.params);
}

static void test_eight_devices_twice(void **state)
{
    (void)state;
    const char *mesh[] = {"ici_fsdp_parallelism=4", "ici_tensor_parallelism=2", "remat_policy=none",
                          "scan_layers=false"};
    outcome a, b;
    train(mesh, 4, 8, NULL, &a);
    train(mesh, 4, 8, NULL, &b);
    expect_same_bits("fsdp=4 tensor=2, run twice", &a, &b);
    model_grads_free(&a.params), model_grads_free(&b.params);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_one_device_twice_and_thread_counts),
        cmocka_unit_test(test_eight_devices_twice),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
