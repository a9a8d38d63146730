/* test_sim_fiber.c — devices as fibers on a few worker threads (sim/fiber.h):
 * the same results as a thread per device whatever the worker count, each
 * device keeps its own thread-local slots and error message across swaps,
 * failures (a device's error, a deadlock, the watchdog) end a fiber run as
 * they end a threaded one, and a helper whose worker is busy does not hold
 * up the exchange it was asked to help.  Sanitizer builds run threads only: there the
 * fiber cases check that the machine fell back (sim_machine_threads). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "sim/collectives.h"
#include "sim/devlocal.h"
#include "sim/fiber.h"

static sim_machine *machine_2d(int a, int b, int workers, double timeout_s)
{
    const char *names[] = {"x", "y"};
    int sizes[] = {a, b};
    sim_mesh_desc md;
    assert_int_equal(sim_mesh_desc_make(2, names, sizes, &md), SIM_OK);
    sim_machine_opts o = {0};
    o.quiet = true;
    o.workers = workers;
    o.collective_timeout_s = timeout_s;
    sim_machine *m = NULL;
    assert_int_equal(sim_machine_new(&md, &o, &m), SIM_OK);
    return m;
}

/* The OS threads a run of n devices on `workers` should use. */
static int threads_expected(int n, int workers) { return sim_fibers_available() && workers < n ? workers : n; }

/* ------------------------------------------------------- same results */

enum { N16 = 16, OUT = 64 };

typedef struct {
    float out[N16][OUT];
} coll_case;

/* A chain of collectives over both axes with integer-valued data: each result feeds the next,
 * so a device that read a peer's buffer too early or too late changes every later value. */
static sim_status chain_device(sim_device *d, void *arg)
{
    coll_case *cc = arg;
    int id = sim_device_id(d);
    float x[4], g[16], r[4], a[16], b[16], p[4];
    for (int i = 0; i < 4; i++) x[i] = (float)(id * 4 + i);
    for (int it = 0; it < 8; it++) {
        SIM_TRY(sim_all_gather(d, x, g, 4, SIM_F32, sim_axes_1(0), sim_meta_tag("ag")));      /* 4 x 4 */
        SIM_TRY(sim_reduce_scatter(d, g, r, 16, SIM_F32, sim_axes_1(1), sim_meta_tag("rs"))); /* 16 / 4 */
        SIM_TRY(sim_all_reduce(d, r, r, 4, SIM_F32, sim_axes_2(0, 1), sim_meta_tag("ar")));
        for (int i = 0; i < 4; i++) r[i] = (float)((int64_t)r[i] % 1009 + id);
        SIM_TRY(sim_all_gather(d, r, a, 4, SIM_F32, sim_axes_1(1), sim_meta_tag("ag2")));
        SIM_TRY(sim_all_to_all(d, a, b, 16, SIM_F32, sim_axes_1(0), sim_meta_tag("a2a")));
        int perm[4] = {1, 2, 3, 0};
        SIM_TRY(sim_ppermute(d, b, p, 4, perm, SIM_F32, sim_axes_1(1), sim_meta_tag("pp")));
        for (int i = 0; i < 4; i++) x[i] = (float)((int64_t)(p[i] + b[4 + i] + b[12 + i]) % 997);
        memcpy(&cc->out[id][it * 8], x, sizeof x);
        memcpy(&cc->out[id][it * 8 + 4], r, sizeof r);
    }
    return SIM_OK;
}

static void test_fibers_match_threads(void **state)
{
    (void)state;
    coll_case *want = calloc(1, sizeof *want), *got = calloc(1, sizeof *got);
    assert_non_null(want);
    assert_non_null(got);
    sim_machine *m = machine_2d(4, 4, N16, 0); /* a thread per device */
    assert_int_equal(sim_machine_run(m, chain_device, want), SIM_OK);
    assert_int_equal(sim_machine_threads(m), N16);
    sim_machine_free(m);
    /* first iteration by hand: the all-reduce over all 16 devices of the reduce-scatter of the
     * gathers is the sum over every device of its x (id*4 + i) sliced by y: element i of
     * device (x, y) sums rows 4y+i... of the gathered (4 x 4) block, each of which is summed
     * over the 4 devices of the y group; checked through a float64 reference below */
    double ref[4] = {0};
    for (int dev = 0; dev < N16; dev++) {
        /* device dev's gather over x (devices dev%4 + 4*xr, xr = 0..3) is 16 values; the
         * reduce-scatter over y (devices 4*(dev/4) + yr) sums them and keeps block y = dev%4 */
        int y = dev % 4;
        for (int i = 0; i < 4; i++) {
            double s = 0;
            int e = y * 4 + i; /* element of the 16-long gathered buffer */
            for (int yr = 0; yr < 4; yr++) {
                int peer = 4 * (dev / 4) + yr;    /* a member of dev's y group */
                int src = peer % 4 + 4 * (e / 4); /* gather block e/4 comes from x rank e/4 */
                s += src * 4 + e % 4;
            }
            ref[i] += s; /* all-reduce over every device */
        }
    }
    for (int dev = 0; dev < N16; dev++)
        for (int i = 0; i < 4; i++) assert_true(want->out[dev][4 + i] == (float)((int64_t)ref[i] % 1009 + dev));
    int workers[] = {1, 2, 3, 5};
    for (size_t w = 0; w < sizeof workers / sizeof workers[0]; w++) {
        memset(got, 0, sizeof *got);
        m = machine_2d(4, 4, workers[w], 0);
        assert_int_equal(sim_machine_run(m, chain_device, got), SIM_OK);
        assert_int_equal(sim_machine_threads(m), threads_expected(N16, workers[w]));
        sim_machine_free(m);
        assert_memory_equal(got, want, sizeof *want);
    }
    free(want);
    free(got);
}

/* --------------------------------------------------- per-device state */

static _Thread_local void *slot;
static void *slot_get(void) { return slot; }
static void slot_set(void *p) { slot = p; }

typedef struct {
    int mine[N16];
    int wrong_slot[N16], wrong_msg[N16], fresh[N16];
} local_case;

/* Each device puts its own pointer in the slot and its own error message, then waits at
 * collectives many times: with one worker every wait swaps to another device on the thread. */
static sim_status local_device(sim_device *d, void *arg)
{
    local_case *lc = arg;
    int id = sim_device_id(d);
    lc->fresh[id] = slot == NULL && sim_errmsg()[0] == '\0';
    slot = &lc->mine[id];
    char want[64];
    snprintf(want, sizeof want, "device %d's own message", id);
    sim_err(SIM_ERR_CHECK, "%s", want);
    float x = 1, y;
    for (int it = 0; it < 20; it++) {
        if (it % 2) SIM_TRY(sim_device_barrier(d));
        else SIM_TRY(sim_all_reduce(d, &x, &y, 1, SIM_F32, sim_axes_1(it % 4 ? 0 : 1), sim_meta_tag("ar")));
        lc->wrong_slot[id] += slot != &lc->mine[id];
        lc->wrong_msg[id] += strcmp(sim_errmsg(), want) != 0;
    }
    return SIM_OK;
}

static void test_device_locals_survive_swaps(void **state)
{
    (void)state;
    sim_device_local_register(slot_get, slot_set);
    sim_device_local_register(slot_get, slot_set); /* twice: one slot */
    for (int workers = 1; workers <= 2; workers++) {
        local_case *lc = calloc(1, sizeof *lc);
        assert_non_null(lc);
        sim_machine *m = machine_2d(4, 4, workers, 0);
        assert_int_equal(sim_machine_run(m, local_device, lc), SIM_OK);
        assert_int_equal(sim_machine_threads(m), threads_expected(N16, workers));
        for (int id = 0; id < N16; id++) {
            assert_true(lc->fresh[id]);
            assert_int_equal(lc->wrong_slot[id], 0);
            assert_int_equal(lc->wrong_msg[id], 0);
        }
        sim_machine_free(m);
        free(lc);
    }
}

/* ----------------------------------------------------------- failures */

typedef struct {
    int mode;
} fail_case;

static sim_status fail_device(sim_device *d, void *arg)
{
    const fail_case *fc = arg;
    int id = sim_device_id(d);
    float x = 1, y[16];
    switch (fc->mode) {
    case 0: /* device 5 fails after two collectives: every other device stops */
        for (int it = 0; it < 50; it++) {
            if (id == 5 && it == 2) return sim_err(SIM_ERR_CHECK, "device 5 found a problem");
            SIM_TRY(sim_all_reduce(d, &x, y, 1, SIM_F32, sim_axes_2(0, 1), sim_meta_tag("ar")));
        }
        return SIM_OK;
    case 1: /* device 3 leaves early: its peers can never complete */
        if (id == 3) return SIM_OK;
        return sim_all_gather(d, &x, y, 1, SIM_F32, sim_axes_1(1), sim_meta_tag("left/ag"));
    case 2: /* device 2 is busy elsewhere (on its worker's thread) far longer than the watchdog allows */
        if (id == 2) {
            usleep(600 * 1000);
            return SIM_OK;
        }
        return sim_all_gather(d, &x, y, 1, SIM_F32, sim_axes_1(1), sim_meta_tag("stuck/ag"));
    }
    return SIM_OK;
}

static void test_fiber_failures(void **state)
{
    (void)state;
    for (int workers = 1; workers <= 2; workers++) {
        fail_case fc = {0};
        sim_machine *m = machine_2d(2, 4, workers, 0);
        assert_int_equal(sim_machine_run(m, fail_device, &fc), SIM_ERR_CHECK);
        assert_string_equal(sim_errmsg(), "device 5 found a problem");
        /* the machine runs again after a failure */
        fc.mode = 1;
        assert_int_equal(sim_machine_run(m, fail_device, &fc), SIM_ERR_DEADLOCK);
        assert_non_null(strstr(sim_errmsg(), "collective deadlock"));
        assert_non_null(strstr(sim_errmsg(), "left/ag"));
        assert_non_null(strstr(sim_errmsg(), "device 3 (finished)"));
        assert_int_equal(sim_machine_threads(m), threads_expected(8, workers));
        sim_machine_free(m);
    }
    /* the watchdog: device 2 holds worker 0 (2 % 2) for 0.6 s; its group's members on worker 1
     * (devices 1 and 3) time out after 0.2 s and name it */
    fail_case fc = {2};
    sim_machine *m = machine_2d(1, 4, 2, 0.2);
    assert_int_equal(sim_machine_run(m, fail_device, &fc), SIM_ERR_DEADLOCK);
    assert_non_null(strstr(sim_errmsg(), "collective watchdog"));
    assert_non_null(strstr(sim_errmsg(), "stuck/ag"));
    assert_non_null(strstr(sim_errmsg(), "device 2 (elsewhere)"));
    sim_machine_free(m);
}

/* ------------------------------------------------------- late helper */

enum { BIG = 1 << 17 }; /* floats per device: a 2-member all-gather above the split threshold */

typedef struct {
    float *send[4], *recv[4];
    int order;      /* next position in the order devices 0 and 3 finish */
    int done_at[4]; /* the position each finished at */
    int wrong[4];
} helper_case;

/* Mesh x=2, y=2, two workers: devices 0 and 2 on worker 0, 1 and 3 on worker 1.  Device 1
 * parks in its all-gather with device 0 and device 3 then holds worker 1 for 0.5 s; device 0
 * arrives last, after 50 ms, and asks device 1 to help move the data.  Device 0 must not wait
 * for that help: it moves everything itself and goes on while worker 1 is still busy. */
static sim_status helper_device(sim_device *d, void *arg)
{
    helper_case *hc = arg;
    int id = sim_device_id(d);
    if (id == 0) usleep(50 * 1000);
    if (id == 3) usleep(500 * 1000);
    for (int i = 0; i < BIG; i++) hc->send[id][i] = (float)(id * BIG + i);
    SIM_TRY(sim_all_gather(d, hc->send[id], hc->recv[id], BIG, SIM_F32, sim_axes_1(1), sim_meta_tag("big")));
    if (id == 0 || id == 3) hc->done_at[id] = __atomic_fetch_add(&hc->order, 1, __ATOMIC_SEQ_CST);
    int first = id - id % 2; /* the group over y: devices first and first + 1 */
    for (int r = 0; r < 2; r++)
        for (int i = 0; i < BIG; i++) hc->wrong[id] += hc->recv[id][r * BIG + i] != (float)((first + r) * BIG + i);
    return SIM_OK;
}

static void test_late_helper_does_not_hold_the_exchange(void **state)
{
    (void)state;
    helper_case hc;
    memset(&hc, 0, sizeof hc);
    for (int i = 0; i < 4; i++) {
        hc.send[i] = malloc(BIG * sizeof(float));
        hc.recv[i] = malloc(2 * BIG * sizeof(float));
        assert_non_null(hc.send[i]);
        assert_non_null(hc.recv[i]);
    }
    sim_machine *m = machine_2d(2, 2, 2, 0);
    assert_int_equal(sim_machine_run(m, helper_device, &hc), SIM_OK);
    for (int i = 0; i < 4; i++) assert_int_equal(hc.wrong[i], 0);
    if (sim_machine_threads(m) == 2) assert_true(hc.done_at[0] < hc.done_at[3]);
    sim_machine_free(m);
    for (int i = 0; i < 4; i++) {
        free(hc.send[i]);
        free(hc.recv[i]);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fibers_match_threads),
        cmocka_unit_test(test_device_locals_survive_swaps),
        cmocka_unit_test(test_fiber_failures),
        cmocka_unit_test(test_late_helper_does_not_hold_the_exchange),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
