/* test_mesh_reshard.c — the resharding planner on 1-D to 3-D meshes.
 *
 * Hand-derived cases pin the step kinds and byte counts of each transition
 * in DESIGN.md's table.  A random sweep then reshards arrays between random
 * specs (partial axes, multi-axis tuples in either order, moves between dims)
 * with exact integer-valued data and checks: the values survive, the spec is
 * the target, the bytes the simulator counted equal the plan's, and the plan
 * never costs more than the naive route (all-reduce, gather all, slice). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mesh/reshard.h"
#include "tests/helpers.h"

/* ------------------------------------------------------------ hand-derived plans */

typedef struct {
    const char *from, *to;
    int nsteps;
    mesh_step_kind kinds[4];
    uint64_t bytes;
} hand_case;

static void check_hand(const mesh_shape *m, int rank, const int64_t *shape, const hand_case *hc)
{
    mesh_spec f = helper_spec(m, hc->from), t = helper_spec(m, hc->to);
    mesh_plan p;
    if (mesh_plan_make(m, "x", rank, shape, SIM_F32, &f, &t, &p) != SIM_OK) fail_msg("%s", sim_errmsg());
    if (p.n != hc->nsteps || p.total_bytes != hc->bytes) {
        mesh_plan_print(&p, m, stderr);
        fail_msg("%s -> %s: %d steps / %llu bytes, expected %d / %llu", hc->from, hc->to, p.n,
                 (unsigned long long)p.total_bytes, hc->nsteps, (unsigned long long)hc->bytes);
    }
    for (int i = 0; i < p.n; i++) assert_int_equal(p.step[i].kind, hc->kinds[i]);
    assert_true(mesh_spec_equal(&p.step[p.n ? p.n - 1 : 0].after, &t) || p.n == 0);
}

static void test_hand_derived_plans(void **state)
{
    (void)state;
    /* 1-D mesh x=4, float32 (8, 16): local block of P('x', None) is 2*16*4 = 128 B */
    const char *n1[] = {"x"};
    int s1[] = {4};
    mesh_shape m1 = helper_mesh(1, n1, s1);
    int64_t sh[] = {8, 16};
    const hand_case c1[] = {
        {"P('x', None)", "P(None, None)", 1, {MESH_STEP_ALL_GATHER}, 3 * 128},    /* (k-1)*s */
        {"P('x', None)", "P(None, 'x')", 1, {MESH_STEP_ALL_TO_ALL}, 3 * 128 / 4}, /* (k-1)*n/k */
        {"P(None, None)", "P(None, 'x')", 1, {MESH_STEP_SLICE}, 0},
        {"P(None, None, unreduced={'x'})", "P('x', None)", 1, {MESH_STEP_REDUCE_SCATTER}, 3 * 512 / 4},
        {"P(None, None, unreduced={'x'})", "P(None, None)", 1, {MESH_STEP_ALL_REDUCE}, 2 * 3 * 512 / 4},
        {"P(None, None)", "P(None, None, unreduced={'x'})", 1, {MESH_STEP_MAKE_PARTIAL}, 0},
        {"P('x', None)", "P('x', None)", 0, {0}, 0},
    };
    for (size_t i = 0; i < sizeof c1 / sizeof c1[0]; i++) check_hand(&m1, 2, sh, &c1[i]);

    /* 2-D mesh a=2, b=2 */
    const char *n2[] = {"a", "b"};
    int s2[] = {2, 2};
    mesh_shape m2 = helper_mesh(2, n2, s2);
    const hand_case c2[] = {
        /* the tuple moves as one all-to-all over the 4-device group: 3/4 * 128 B */
        {"P(('a', 'b'), None)", "P(None, ('a', 'b'))", 1, {MESH_STEP_ALL_TO_ALL}, 96},
        /* order change on one dim: one ppermute; device (a, b) holds block 2a+b and needs block 2b+a,
         * so (0,1) and (1,0) swap their 128 B blocks and (0,0), (1,1) keep theirs */
        {"P(('a', 'b'), None)", "P(('b', 'a'), None)", 1, {MESH_STEP_PERMUTE}, 128},
        /* swap: local (4, 8) = 128 B; gather a on dim 0: 1*128 B -> local (8, 8) = 256 B;
         * move b dim1 -> dim0: 1/2 * 256 B; slice a on dim 1: free */
        {"P('a', 'b')", "P('b', 'a')", 3, {MESH_STEP_ALL_GATHER, MESH_STEP_ALL_TO_ALL, MESH_STEP_SLICE}, 128 + 128},
        /* partial a to dim 0 while b slices dim 1 first: slice (free), then RS over a of 8*8*4 B */
        {"P(None, None, unreduced={'a'})", "P('a', 'b')", 2, {MESH_STEP_SLICE, MESH_STEP_REDUCE_SCATTER}, 256 / 2},
        /* two partial axes, one replicated target: one all-reduce over (a, b): 2*3/4*512 */
        {"P(None, None, unreduced={'a', 'b'})", "P(None, None)", 1, {MESH_STEP_ALL_REDUCE}, 768},
    };
    for (size_t i = 0; i < sizeof c2 / sizeof c2[0]; i++) check_hand(&m2, 2, sh, &c2[i]);
    {
        mesh_spec f = helper_spec(&m2, "P(('a', 'b'), None)"), t = helper_spec(&m2, "P(('b', 'a'), None)");
        mesh_plan p;
        assert_int_equal(mesh_plan_make(&m2, "x", 2, sh, SIM_F32, &f, &t, &p), SIM_OK);
        const uint64_t per_device[4] = {0, 128, 128, 0}; /* devices 1 = (0,1) and 2 = (1,0) swap */
        for (int d = 0; d < 4; d++) assert_int_equal(mesh_plan_device_bytes(&p, &m2, d), per_device[d]);
    }
    {
        /* a cycle of three axes: device (a,b,c) holds block 4a+2b+c and needs 4c+2a+b; equal only
         * where 2a+b = 3c, i.e. (0,0,0) and (1,1,1): six of the eight devices send their 64 B block */
        const char *n3c[] = {"a", "b", "c"};
        int s3c[] = {2, 2, 2};
        mesh_shape m3c = helper_mesh(3, n3c, s3c);
        mesh_spec f = helper_spec(&m3c, "P(('a', 'b', 'c'), None)"), t = helper_spec(&m3c, "P(('c', 'a', 'b'), None)");
        mesh_plan p;
        assert_int_equal(mesh_plan_make(&m3c, "x", 2, sh, SIM_F32, &f, &t, &p), SIM_OK);
        assert_int_equal(p.n, 1);
        assert_int_equal(p.step[0].kind, MESH_STEP_PERMUTE);
        int senders = 0;
        for (int d = 0; d < 8; d++) {
            uint64_t b = mesh_plan_device_bytes(&p, &m3c, d);
            assert_true(b == 0 || b == 64);
            senders += b == 64;
        }
        assert_int_equal(senders, 6);
        assert_int_equal(mesh_plan_device_bytes(&p, &m3c, 0), 0);
        assert_int_equal(mesh_plan_device_bytes(&p, &m3c, 7), 0);
    }

    /* the example: data=2 fsdp=2 tensor=2, (8, 16) from P(('data','fsdp'), None) to P(None, 'tensor'):
     * slice tensor on dim 1 (local 2x8), then one all-gather over (data, fsdp): 3 * 2*8*4 = 192 B */
    const char *n3[] = {"data", "fsdp", "tensor"};
    int s3[] = {2, 2, 2};
    mesh_shape m3 = helper_mesh(3, n3, s3);
    hand_case c3 = {"P(('data','fsdp'),None)", "P(None,'tensor')", 2, {MESH_STEP_SLICE, MESH_STEP_ALL_GATHER}, 192};
    check_hand(&m3, 2, sh, &c3);

    /* errors name the tensor, dim and axes */
    mesh_spec f = helper_spec(&m1, "P(None, None)"), t = helper_spec(&m1, "P(None, 'x')");
    int64_t bad[] = {8, 6};
    mesh_plan p;
    assert_int_equal(mesh_plan_make(&m1, "decoder/wq", 2, bad, SIM_F32, &f, &t, &p), SIM_ERR_INPUT);
    assert_non_null(strstr(sim_errmsg(), "decoder/wq"));
}

typedef struct {
    const mesh_shape *m;
    int rank;
    int64_t shape[3];
    mesh_spec from, to;
    mesh_plan plan;
    float *global; /* the true values */
    float *out;    /* written back after the reshard */
    uint64_t sent[64];
} sweep;

static int partial_rank(sim_device *d, const mesh_shape *m, uint32_t mask, int *k)
{
    int r = 0;
    *k = 1;
    for (int a = 0; a < m->n_axes; a++)
        if (mask & (1u << a)) {
            r = r * m->sizes[a] + sim_device_coord(d, a);
            *k *= m->sizes[a];
        }
    return r;
}

static sim_status sweep_device(sim_device *d, void *arg)
{
    sweep *sw = arg;
    mesh_array a;
    SIM_TRY(mesh_array_new(d, sw->m, "t", sw->rank, sw->shape, &sw->from, SIM_F32, SIM_MEM_ACTIVATIONS, &a));
    mesh_array_load_global(d, sw->m, &a, sw->global);
    /* partial: rank r > 0 holds r everywhere, rank 0 holds value - sum of the others */
    int k, r = partial_rank(d, sw->m, sw->from.partial, &k);
    float *x = a.data;
    for (size_t i = 0; i < a.nlocal; i++) x[i] = r ? (float)r : x[i] - (float)(k * (k - 1) / 2);
    sim_device_clear_records(d);
    SIM_TRY(mesh_plan_run(d, sw->m, &sw->plan, &a, sim_meta_implicit("test/reshard")));
    if (!mesh_spec_equal(&a.spec, &sw->to)) return sim_err(SIM_ERR_CHECK, "spec after the plan is not the target");
    size_t nr;
    const sim_record *rec = sim_device_records(d, &nr);
    for (size_t i = 0; i < nr; i++) sw->sent[sim_device_id(d)] += rec[i].bytes_sent;
    /* partial targets: reduce to replicated before comparing values */
    if (a.spec.partial) {
        mesh_spec full = a.spec;
        full.partial = 0;
        SIM_TRY(mesh_reshard(d, sw->m, &a, &full, sim_meta_implicit("test/check")));
    }
    SIM_TRY(mesh_array_store_global(d, sw->m, &a, sw->out));
    mesh_array_free(d, &a);
    sim_arena_stats st;
    sim_arena_get_stats(sim_device_arena(d), &st);
    return st.live == 0 ? SIM_OK : sim_err(SIM_ERR_CHECK, "arena not empty after the reshard");
}

static void test_random_reshards(void **state)
{
    (void)state;
    static const char *names[] = {"a", "b", "c"};
    static const int sizes[][3] = {{4, 0, 0}, {3, 0, 0}, {2, 3, 0}, {2, 2, 2}, {2, 3, 2}};
    static const int naxes[] = {1, 1, 2, 3, 3};
    uint64_t rng = 12345;
    int runs = 0, moved = 0;
    int kinds_seen[MESH_STEP_KINDS] = {0};
    for (int mi = 0; mi < 5; mi++) {
        mesh_shape m = helper_mesh(naxes[mi], names, sizes[mi]);
        sim_machine *mach = helper_machine(&m, false);
        for (int it = 0; it < 120; it++) {
            sweep *sw = calloc(1, sizeof *sw);
            sw->m = &m;
            sw->rank = 2 + (int)(helper_rng_next(&rng) % 2);
            for (int i = 0; i < sw->rank; i++) sw->shape[i] = i == 1 ? 48 : 24;
            sw->from = helper_random_spec(&m, sw->rank, &rng, true);
            sw->to = helper_random_spec(&m, sw->rank, &rng, true);
            int64_t n = 1;
            for (int i = 0; i < sw->rank; i++) n *= sw->shape[i];
            sw->global = malloc((size_t)n * sizeof(float));
            sw->out = calloc((size_t)n, sizeof(float));
            for (int64_t i = 0; i < n; i++) sw->global[i] = (float)(helper_rng_next(&rng) % 1000);
            if (mesh_plan_make(&m, "t", sw->rank, sw->shape, SIM_F32, &sw->from, &sw->to, &sw->plan) != SIM_OK)
                fail_msg("plan: %s", sim_errmsg());
            if (sim_machine_run(mach, sweep_device, sw) != SIM_OK) fail_msg("run: %s", sim_errmsg());
            for (int64_t i = 0; i < n; i++)
                if (sw->out[i] != sw->global[i]) {
                    char f[128], t[128];
                    mesh_spec_format(&sw->from, &m, f, sizeof f);
                    mesh_spec_format(&sw->to, &m, t, sizeof t);
                    mesh_plan_print(&sw->plan, &m, stderr);
                    fail_msg("%s -> %s: element %lld is %g, expected %g", f, t, (long long)i, sw->out[i],
                             sw->global[i]);
                }
            /* the simulator's counts equal the plan's, on every device */
            for (int dv = 0; dv < m.num_devices; dv++) {
                uint64_t want = mesh_plan_device_bytes(&sw->plan, &m, dv);
                assert_true(want <= sw->plan.total_bytes);
                bool has_ar = false;
                for (int s = 0; s < sw->plan.n; s++) has_ar |= sw->plan.step[s].kind == MESH_STEP_ALL_REDUCE;
                if (!has_ar) assert_int_equal(sw->sent[dv], want);
            }
            /* never worse than the naive route: all-reduce the partials, gather everything */
            int64_t nloc = 1;
            int64_t local[3];
            mesh_spec_local_shape(&sw->from, &m, sw->shape, local);
            for (int i = 0; i < sw->rank; i++) nloc *= local[i];
            int kp = 1;
            for (int a = 0; a < m.n_axes; a++)
                if (sw->from.partial & (1u << a)) kp *= m.sizes[a];
            uint64_t naive = (uint64_t)(2 * (kp - 1) * nloc * 4 / kp) + (uint64_t)(n - nloc) * 4;
            assert_true(sw->plan.total_bytes <= naive);
            for (int s = 0; s < sw->plan.n; s++) kinds_seen[sw->plan.step[s].kind] = 1;
            moved += sw->plan.n > 0;
            runs++;
            free(sw->global);
            free(sw->out);
            free(sw);
        }
        sim_machine_free(mach);
    }
    assert_int_equal(runs, 600);
    assert_true(moved > 500);
    for (int k = 0; k < MESH_STEP_KINDS; k++) assert_true(kinds_seen[k]); /* every step kind was exercised */
}

/* ------------------------------------------------------------ read-only copies */

/* A kernel's operand (ops.c stage, nn.c operand): a view of the array that borrows its shard
 * (mesh_array_borrow) resharded with mesh_reshard_shared, then on to a second random spec.  The
 * source must come out untouched whatever the plan does first (in place: a copy is made), a plan
 * that is one all-gather must leave the copy in the group's shared buffer, a shared copy resharded
 * again must get a shard of its own before any step in place, and the values must survive. */
typedef struct {
    const mesh_shape *m;
    int rank;
    int64_t shape[3];
    mesh_spec from, to, to2;
    float *global, *out;
    int shared[64];           /* the first reshard left a shared copy */
    int borrowed_inplace[64]; /* its plan started in place (all-reduce, make-partial) */
    int shared_inplace[64];   /* the second plan started in place on a shared copy */
} ro_case;

static bool starts_in_place(const mesh_shape *m, int rank, const int64_t *shape, const mesh_spec *f, const mesh_spec *t)
{
    mesh_plan p;
    SIM_ASSERT(mesh_plan_make(m, "t", rank, shape, SIM_F32, f, t, &p) == SIM_OK);
    return p.n > 0 && (p.step[0].kind == MESH_STEP_ALL_REDUCE || p.step[0].kind == MESH_STEP_MAKE_PARTIAL);
}

static sim_status ro_device(sim_device *d, void *arg)
{
    ro_case *rc = arg;
    int id = sim_device_id(d);
    mesh_array a, b;
    SIM_TRY(mesh_array_new(d, rc->m, "t", rc->rank, rc->shape, &rc->from, SIM_F32, SIM_MEM_PARAMS, &a));
    mesh_array_load_global(d, rc->m, &a, rc->global);
    int k, r = partial_rank(d, rc->m, rc->from.partial, &k);
    float *x = a.data;
    for (size_t i = 0; i < a.nlocal; i++) x[i] = r ? (float)r : x[i] - (float)(k * (k - 1) / 2);
    float *before = malloc(a.nlocal * sizeof(float) + 1);
    memcpy(before, a.data, a.nlocal * sizeof(float));
    rc->borrowed_inplace[id] = starts_in_place(rc->m, rc->rank, rc->shape, &rc->from, &rc->to);
    SIM_TRY(mesh_array_borrow(d, rc->m, &a, "t/copy", SIM_MEM_TEMP, &b));
    SIM_TRY(mesh_reshard_shared(d, rc->m, &b, &rc->to, sim_meta_weight("test/ro")));
    sim_status st = SIM_OK;
    if (memcmp(before, a.data, a.nlocal * sizeof(float))) st = sim_err(SIM_ERR_CHECK, "the source changed");
    if (b.hold == MESH_HOLD_BORROWED) st = sim_err(SIM_ERR_CHECK, "a borrowed view outlived its reshard");
    if (b.data == a.data && a.nlocal) st = sim_err(SIM_ERR_CHECK, "the copy is the source's shard");
    rc->shared[id] = b.hold == MESH_HOLD_SHARED;
    rc->shared_inplace[id] =
        b.hold == MESH_HOLD_SHARED && starts_in_place(rc->m, rc->rank, rc->shape, &b.spec, &rc->to2);
    SIM_TRY(mesh_reshard(d, rc->m, &b, &rc->to2, sim_meta_tag("test/ro2")));
    if (b.spec.partial) {
        mesh_spec full = b.spec;
        full.partial = 0;
        SIM_TRY(mesh_reshard(d, rc->m, &b, &full, sim_meta_tag("test/check")));
    }
    SIM_TRY(mesh_array_store_global(d, rc->m, &b, rc->out));
    mesh_array_free(d, &b);
    mesh_array_free(d, &a);
    free(before);
    sim_arena_stats as;
    sim_arena_get_stats(sim_device_arena(d), &as);
    if (as.live) st = sim_err(SIM_ERR_CHECK, "arena not empty after the copies");
    return st;
}

static void test_read_only_copies(void **state)
{
    (void)state;
    static const char *names[] = {"a", "b", "c"};
    static const int sizes[][3] = {{4, 0, 0}, {2, 3, 0}, {2, 2, 2}};
    static const int naxes[] = {1, 2, 3};
    uint64_t rng = 777;
    int shared = 0, borrowed_inplace = 0, shared_inplace = 0;
    for (int mi = 0; mi < 3; mi++) {
        mesh_shape m = helper_mesh(naxes[mi], names, sizes[mi]);
        sim_machine *mach = helper_machine(&m, false);
        for (int it = 0; it < 60; it++) {
            ro_case *rc = calloc(1, sizeof *rc);
            rc->m = &m;
            rc->rank = 2;
            rc->shape[0] = 24, rc->shape[1] = 48;
            rc->from = helper_random_spec(&m, rc->rank, &rng, true);
            /* every third target replicated-or-gathered: the FSDP case (one all-gather) comes up often */
            rc->to = it % 3 ? helper_random_spec(&m, rc->rank, &rng, false) : rc->from;
            if (it % 3 == 0) {
                rc->to.partial = 0;
                for (int dd = 0; dd < rc->rank; dd++) rc->to.n_axes[dd] = 0;
            }
            rc->to2 = helper_random_spec(&m, rc->rank, &rng, true);
            int64_t n = rc->shape[0] * rc->shape[1];
            rc->global = malloc((size_t)n * sizeof(float));
            rc->out = calloc((size_t)n, sizeof(float));
            for (int64_t i = 0; i < n; i++) rc->global[i] = (float)(helper_rng_next(&rng) % 1000);
            if (sim_machine_run(mach, ro_device, rc) != SIM_OK) fail_msg("run: %s", sim_errmsg());
            for (int64_t i = 0; i < n; i++)
                if (rc->out[i] != rc->global[i])
                    fail_msg("element %lld is %g, expected %g", (long long)i, rc->out[i], rc->global[i]);
            shared += rc->shared[0];
            borrowed_inplace += rc->borrowed_inplace[0];
            shared_inplace += rc->shared_inplace[0];
            free(rc->global);
            free(rc->out);
            free(rc);
        }
        uint64_t made, live;
        sim_machine_shared_stats(mach, &made, &live);
        assert_int_equal(live, 0); /* every shared copy was given back */
        sim_machine_free(mach);
    }
    /* each path was exercised */
    assert_true(shared > 5);
    assert_true(borrowed_inplace > 5);
    assert_true(shared_inplace > 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_hand_derived_plans),
        cmocka_unit_test(test_random_reshards),
        cmocka_unit_test(test_read_only_copies),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
