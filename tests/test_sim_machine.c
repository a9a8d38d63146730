/* test_sim_machine.c — devices, ids and coordinates, arenas (accounting,
 * peak, OOM message, dry run), waiting that blocks instead of spinning,
 * the full barrier, records across runs, and a failure that leaves other groups alone (the host
 * topology is test_sim_topology's, the Chrome trace test_sim_trace's). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "sim/collectives.h"
#include "tests/helpers.h"

static sim_machine *machine(int n, const char *const *names, const int *sizes, sim_machine_opts o)
{
    return helper_sim_machine_opts(n, names, sizes, o);
}

/* ------------------------------------------------------------ mesh and ids */

static void test_mesh_ids_and_errors(void **state)
{
    (void)state;
    const char *names[] = {"data", "fsdp", "tensor"};
    int sizes[] = {2, 3, 4};
    sim_mesh_desc md;
    assert_int_equal(sim_mesh_desc_make(3, names, sizes, &md), SIM_OK);
    assert_int_equal(sim_mesh_num_devices(&md), 24);
    /* row-major, first axis most significant: id = (d*3 + f)*4 + t */
    for (int d = 0; d < 2; d++)
        for (int f = 0; f < 3; f++)
            for (int t = 0; t < 4; t++) {
                int c[3], want = (d * 3 + f) * 4 + t;
                int in[3] = {d, f, t};
                assert_int_equal(sim_mesh_device_id(&md, in), want);
                sim_mesh_coords(&md, want, c);
                assert_int_equal(c[0], d);
                assert_int_equal(c[1], f);
                assert_int_equal(c[2], t);
            }
    char buf[64];
    assert_string_equal(sim_mesh_coord_label(&md, 23, buf, sizeof buf), "(data=1, fsdp=2, tensor=3)");
    assert_int_equal(sim_mesh_group_size(&md, sim_axes_2(0, 2)), 8);

    int bad[] = {2, 0, 4};
    assert_int_equal(sim_mesh_desc_make(3, names, bad, &md), SIM_ERR_INPUT);
    assert_non_null(strstr(sim_errmsg(), "'fsdp' has size 0"));
    const char *dup[] = {"data", "data"};
    assert_int_equal(sim_mesh_desc_make(2, dup, sizes, &md), SIM_ERR_INPUT);
    assert_non_null(strstr(sim_errmsg(), "twice"));
    int big[] = {16, 16, 4};
    assert_int_equal(sim_mesh_desc_make(3, names, big, &md), SIM_ERR_INPUT);
    assert_non_null(strstr(sim_errmsg(), "512"));
    /* 512 devices is allowed */
    int ok512[] = {8, 8, 8};
    assert_int_equal(sim_mesh_desc_make(3, names, ok512, &md), SIM_OK);
}

typedef struct {
    int id[512];
    int coord0[512];
    int rank[512];
    int member[512];
} id_case;

static sim_status id_device(sim_device *d, void *arg)
{
    id_case *ic = arg;
    int id = sim_device_id(d);
    ic->id[id] = id;
    ic->coord0[id] = sim_device_coord(d, 0);
    ic->rank[id] = sim_device_group_rank(d, sim_axes_2(1, 0));
    ic->member[id] = sim_device_group_member(d, sim_axes_2(1, 0), 0);
    return sim_device_barrier(d);
}

static void test_run_512_devices(void **state)
{
    (void)state;
    const char *names[] = {"x", "y"};
    int sizes[] = {32, 16};
    sim_machine *m = machine(2, names, sizes, (sim_machine_opts){0});
    id_case *ic = calloc(1, sizeof *ic);
    assert_int_equal(sim_machine_run(m, id_device, ic), SIM_OK);
    for (int i = 0; i < 512; i++) {
        assert_int_equal(ic->id[i], i);
        assert_int_equal(ic->coord0[i], i / 16);
        /* axes (y, x): rank = y*32 + x; member 0 of every group is device 0 */
        assert_int_equal(ic->rank[i], (i % 16) * 32 + i / 16);
        assert_int_equal(ic->member[i], 0);
    }
    free(ic);
    sim_machine_free(m);
}

/* ------------------------------------------------------------ arenas */

static void test_arena_accounting(void **state)
{
    (void)state;
    sim_arena *a = sim_arena_new("device 5 (data=1, fsdp=1)", 1000, false);
    void *p1, *p2, *p3;
    assert_int_equal(sim_arena_alloc(a, 400, SIM_MEM_PARAMS, "w", false, &p1), SIM_OK);
    assert_int_equal(sim_arena_alloc(a, 300, SIM_MEM_ACTIVATIONS, "act", true, &p2), SIM_OK);
    assert_true(((uintptr_t)p1 % 64) == 0 && ((uintptr_t)p2 % 64) == 0);
    for (int i = 0; i < 300; i++) assert_int_equal(((unsigned char *)p2)[i], 0);
    memset(p1, 7, 400);
    sim_arena_stats st;
    sim_arena_get_stats(a, &st);
    assert_int_equal(st.live, 700);
    assert_int_equal(st.peak, 700);
    assert_int_equal(st.live_by[SIM_MEM_PARAMS], 400);
    sim_arena_release(a, p2, 300, SIM_MEM_ACTIVATIONS);
    assert_int_equal(sim_arena_alloc(a, 200, SIM_MEM_COMM, "buf", false, &p3), SIM_OK);
    sim_arena_get_stats(a, &st);
    assert_int_equal(st.live, 600);
    assert_int_equal(st.peak, 700);
    assert_int_equal(st.at_peak_by[SIM_MEM_ACTIVATIONS], 300);
    assert_int_equal(st.at_peak_by[SIM_MEM_COMM], 0);
    assert_int_equal(st.peak_by[SIM_MEM_COMM], 200);
    /* 600 live + 401 > 1000: OOM naming device, tensor, request and breakdown */
    void *p4 = (void *)1;
    assert_int_equal(sim_arena_alloc(a, 401, SIM_MEM_GRADS, "decoder/mlp/wi grad", false, &p4), SIM_ERR_OOM);
    assert_null(p4);
    const char *msg = sim_errmsg();
    assert_non_null(strstr(msg, "device 5 (data=1, fsdp=1)"));
    assert_non_null(strstr(msg, "decoder/mlp/wi grad"));
    assert_non_null(strstr(msg, "401 B"));
    assert_non_null(strstr(msg, "params 400 B"));
    assert_non_null(strstr(msg, "comm 200 B"));
    /* exactly up to capacity is fine */
    assert_int_equal(sim_arena_alloc(a, 400, SIM_MEM_GRADS, "g", false, &p4), SIM_OK);
    sim_arena_release(a, p4, 400, SIM_MEM_GRADS);
    sim_arena_reset_peak(a);
    sim_arena_get_stats(a, &st);
    assert_int_equal(st.peak, 600);
    /* blocks still live are freed with the arena (ASan checks this) */
    sim_arena_free_all(a);

    /* dry run: same accounting, no memory */
    sim_arena *dry = sim_arena_new("dry", 0, true);
    void *q;
    assert_int_equal(sim_arena_alloc(dry, (size_t)1 << 40, SIM_MEM_PARAMS, "huge", false, &q), SIM_OK);
    assert_null(q);
    sim_arena_get_stats(dry, &st);
    assert_int_equal(st.live, (size_t)1 << 40);
    sim_arena_release(dry, NULL, (size_t)1 << 40, SIM_MEM_PARAMS);
    sim_arena_get_stats(dry, &st);
    assert_int_equal(st.live, 0);
    assert_int_equal(st.peak, (size_t)1 << 40);
    sim_arena_free_all(dry);
}

/* Released large blocks are reused by a request of the same size (no fresh
 * pages); the accounting does not see the cache, and zeroed requests are
 * zeroed even when the block is reused. */
static void test_arena_reuses_large_blocks(void **state)
{
    (void)state;
    sim_arena *a = sim_arena_new("device 0", 0, false);
    size_t big = (size_t)32 << 20, mid = (size_t)2 << 20;
    void *p, *q, *r;
    assert_int_equal(sim_arena_alloc(a, big, SIM_MEM_TEMP, "big", false, &p),
                     SIM_OK); /* peak 32 MiB: cache cap 4 MiB */
    sim_arena_release(a, p, big, SIM_MEM_TEMP);
    assert_int_equal(sim_arena_alloc(a, mid, SIM_MEM_ACTIVATIONS, "x", false, &q), SIM_OK);
    memset(q, 0x5a, mid);
    sim_arena_release(a, q, mid, SIM_MEM_ACTIVATIONS);
    sim_arena_stats st;
    sim_arena_get_stats(a, &st);
    assert_int_equal(st.live, 0);
    assert_int_equal(sim_arena_alloc(a, mid, SIM_MEM_GRADS, "y", true, &r), SIM_OK);
    assert_ptr_equal(r, q); /* the same block came back */
    for (size_t i = 0; i < mid; i += 4093) assert_int_equal(((unsigned char *)r)[i], 0);
    sim_arena_get_stats(a, &st);
    assert_int_equal(st.live, mid);
    assert_int_equal(st.live_by[SIM_MEM_GRADS], mid);
    sim_arena_release(a, r, mid, SIM_MEM_GRADS);
    sim_arena_free_all(a); /* frees the cached block too (ASan checks) */
}

static sim_status oom_device(sim_device *d, void *arg)
{
    (void)arg;
    void *p;
    size_t want = sim_device_id(d) == 2 ? 2048 : 512;
    SIM_TRY(sim_arena_alloc(sim_device_arena(d), want, SIM_MEM_ACTIVATIONS, "big activation", false, &p));
    float x = 1, y;
    return sim_all_reduce(d, &x, &y, 1, SIM_F32, sim_axes_1(0), sim_meta_tag("after"));
}

static void test_oom_stops_machine(void **state)
{
    (void)state;
    const char *names[] = {"fsdp"};
    int sizes[] = {4};
    sim_machine_opts o = {0};
    o.capacity_bytes = 1024;
    sim_machine *m = machine(1, names, sizes, o);
    assert_int_equal(sim_machine_run(m, oom_device, NULL), SIM_ERR_OOM);
    assert_non_null(strstr(sim_errmsg(), "device 2 (fsdp=2)"));
    assert_non_null(strstr(sim_errmsg(), "big activation"));
    sim_machine_free(m);
}

/* ------------------------------------------------------------ blocking waits */

static sim_status sleepy_device(sim_device *d, void *arg)
{
    (void)arg;
    if (sim_device_id(d) == 0) {
        struct timespec ts = {0, 400 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    float x = 1, y = 0;
    SIM_TRY(sim_all_reduce(d, &x, &y, 1, SIM_F32, sim_axes_2(0, 1), sim_meta_tag("wake")));
    return y == 64.0f ? SIM_OK : sim_err(SIM_ERR_CHECK, "sum %g", y);
}

static double cpu_seconds(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* 63 devices wait 0.4 s for device 0, as 64 threads and as fibers on 2 workers (sim/fiber.c, where the
 * build has them: the worker without a runnable device must sleep); spinning would burn ~2 cores * 0.4 s */
static void test_waiting_blocks(void **state)
{
    (void)state;
    const char *names[] = {"data", "fsdp"};
    int sizes[] = {8, 8};
    const int workers[] = {64, 2};
    for (int i = 0; i < 2; i++) {
        sim_machine *m = machine(2, names, sizes, (sim_machine_opts){.workers = workers[i]});
        double c0 = cpu_seconds();
        uint64_t t0 = sim_now_ns();
        assert_int_equal(sim_machine_run(m, sleepy_device, NULL), SIM_OK);
        double wall = (double)(sim_now_ns() - t0) / 1e9, cpu = cpu_seconds() - c0;
        assert_true(wall >= 0.4);
        if (cpu > 0.15)
            fail_msg("64 waiting devices on %d OS threads used %.3f s of CPU in %.3f s: waiting must block",
                     sim_machine_threads(m), cpu, wall);
        sim_machine_free(m);
    }
}

/* Records and arenas survive from one run to the next. */
static sim_status two_runs_device(sim_device *d, void *arg)
{
    (void)arg;
    float x = 1, y;
    sim_device_set_step(d, sim_device_step(d) + 1);
    return sim_all_reduce(d, &x, &y, 1, SIM_F32, sim_axes_1(0), sim_meta_tag("step"));
}

static void test_records_across_runs(void **state)
{
    (void)state;
    const char *names[] = {"data"};
    int sizes[] = {3};
    sim_machine *m = machine(1, names, sizes, (sim_machine_opts){0});
    assert_int_equal(sim_machine_run(m, two_runs_device, NULL), SIM_OK);
    assert_int_equal(sim_machine_run(m, two_runs_device, NULL), SIM_OK);
    size_t nr;
    const sim_record *r = sim_device_records(sim_machine_device(m, 2), &nr);
    assert_int_equal(nr, 2);
    assert_int_equal(r[0].step, 1);
    assert_int_equal(r[1].step, 2);
    sim_op_totals t = sim_device_op_totals(sim_machine_device(m, 2), SIM_OP_ALL_REDUCE);
    assert_int_equal(t.calls, 2);
    /* n=1 over k=3: rank r owns [r*n/k, (r+1)*n/k), so rank 2 owns the element and
     * sends n+(k-2)*1 = 2 elements per call, ranks 0 and 1 send n = 1; together
     * 4 = 2(k-1)n elements, the all-reduce formula. */
    assert_int_equal(t.bytes_sent, 2 * 2 * 4);
    assert_int_equal(sim_device_op_totals(sim_machine_device(m, 0), SIM_OP_ALL_REDUCE).bytes_sent, 2 * 1 * 4);
    assert_int_equal(sim_device_op_totals(sim_machine_device(m, 1), SIM_OP_ALL_REDUCE).bytes_sent, 2 * 1 * 4);
    sim_machine_free(m);
}

/* A device of one group fails right after its collective while the other
 * group is still inside its own: the other group's members must not leave
 * the collective (and free their buffers) while a peer still reads them.
 * Under `make asan` / `make tsan` a violation is a reported error; here the
 * devices that finish must hold correct data. */
typedef struct {
    int ok[4];
    int wrong[4];
} race_case;

static sim_status race_device(sim_device *d, void *arg)
{
    race_case *rc = arg;
    size_t n = 1 << 16;
    float *send = malloc(n * sizeof *send), *recv = malloc(2 * n * sizeof *recv);
    for (size_t i = 0; i < n; i++) send[i] = (float)(sim_device_id(d) + 1);
    sim_status st = sim_all_gather(d, send, recv, n, SIM_F32, sim_axes_1(0), sim_meta_tag("race"));
    for (size_t i = 0; i < n; i++) send[i] = -1.0f; /* what a reused buffer would hold */
    int id = sim_device_id(d);
    if (st == SIM_OK) {
        rc->ok[id] = 1;
        for (int q = 0; q < 2; q++) {
            float want = (float)(sim_device_group_member(d, sim_axes_1(0), q) + 1);
            for (size_t i = 0; i < n; i += 97) rc->wrong[id] += recv[(size_t)q * n + i] != want;
        }
    }
    free(send);
    free(recv);
    if (st == SIM_OK && sim_device_coord(d, 1) == 0) return sim_err(SIM_ERR_SHARDING, "fails after its collective");
    return st;
}

static void test_failure_does_not_cut_other_groups_short(void **state)
{
    (void)state;
    const char *names[] = {"x", "y"};
    int sizes[] = {2, 2};
    sim_machine *m = machine(2, names, sizes, (sim_machine_opts){0});
    for (int it = 0; it < 50; it++) {
        race_case rc;
        memset(&rc, 0, sizeof rc);
        assert_int_equal(sim_machine_run(m, race_device, &rc), SIM_ERR_SHARDING);
        for (int id = 0; id < 4; id++) assert_int_equal(rc.wrong[id], 0);
        /* the failing group finished its collective before failing */
        assert_true(rc.ok[0] && rc.ok[2]);
    }
    sim_machine_free(m);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_mesh_ids_and_errors),
        cmocka_unit_test(test_run_512_devices),
        cmocka_unit_test(test_arena_accounting),
        cmocka_unit_test(test_oom_stops_machine),
        cmocka_unit_test(test_arena_reuses_large_blocks),
        cmocka_unit_test(test_waiting_blocks),
        cmocka_unit_test(test_records_across_runs),
        cmocka_unit_test(test_failure_does_not_cut_other_groups_short),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
