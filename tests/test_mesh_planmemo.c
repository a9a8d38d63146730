/* test_mesh_planmemo.c — the per-thread memo of resharding-plan bytes answers
 * what mesh_plan_make answers: the same bytes, the same "no plan", on first
 * sight and on every repeat, and nothing from another mesh.  The shared memo
 * of decisions returns what was put under a key, from any thread, and the
 * einsum placements it remembers equal the ones searched afresh. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <pthread.h>

#include "mesh/ops.h"
#include "mesh/planmemo.h"
#include "sim/collectives.h"
#include "tests/helpers.h"

static uint64_t rng(uint64_t *s) /* xorshift64* */
{
    *s ^= *s >> 12;
    *s ^= *s << 25;
    *s ^= *s >> 27;
    return *s * 2685821657736338717ull;
}

/* Each mesh axis lands on a random dim (or none, or the partial set), in random order. */
static mesh_spec random_spec(const mesh_shape *m, int rank, uint64_t *s)
{
    mesh_spec sp;
    memset(&sp, 0, sizeof sp);
    sp.rank = rank;
    for (int a = 0; a < m->n_axes; a++) {
        int where = (int)(rng(s) % (uint64_t)(rank + 2)); /* rank: replicated, rank + 1: partial */
        if (where < rank) sp.axes[where][sp.n_axes[where]++] = (int8_t)a;
        else if (where == rank + 1 && rng(s) % 3 == 0) sp.partial |= 1u << a;
    }
    return sp;
}

typedef struct {
    int n_same, n_none; /* cases with bytes, cases without a plan */
} tally;

static void compare(const mesh_shape *m, int rank, const int64_t *shape, const mesh_spec *from, const mesh_spec *to,
                    tally *t)
{
    mesh_plan *direct = malloc(sizeof *direct), *scratch = malloc(sizeof *scratch);
    bool want_ok =
        mesh_spec_equal(from, to) || mesh_plan_make(m, "x", rank, shape, SIM_F32, from, to, direct) == SIM_OK;
    uint64_t want = mesh_spec_equal(from, to) ? 0 : want_ok ? direct->total_bytes : 0;
    sim_err_clear();
    for (int rep = 0; rep < 2; rep++) { /* the first call fills the slot, the second reads it */
        uint64_t got = 12345;
        bool ok = mesh_plan_bytes_memo(m, scratch, "x", rank, shape, from, to, &got);
        sim_err_clear();
        assert_int_equal(ok, want_ok);
        if (ok) assert_int_equal(got, want);
    }
    if (want_ok) t->n_same++;
    else t->n_none++;
    free(direct);
    free(scratch);
}

static void test_memo_equals_planner(void **state)
{
    (void)state;
    const char *names[] = {"data", "fsdp", "tensor", "expert"};
    int sizes_a[] = {2, 4, 2, 1}, sizes_b[] = {4, 2, 1, 2}; /* same names, another mesh */
    mesh_shape ma = helper_mesh(4, names, sizes_a), mb = helper_mesh(4, names, sizes_b);
    const int64_t shapes[][3] = {
        {16, 32, 8}, {8, 64, 4}, {3, 16, 8} /* 3 divides by nothing: some specs have no plan */};
    uint64_t s = 0x9e3779b97f4a7c15ull;
    tally t = {0, 0};
    for (int i = 0; i < 3000; i++) {
        /* few distinct cases, asked many times, alternating meshes: hits, misses and evictions */
        uint64_t pick = rng(&s) % 40, cs = pick * 7919 + 1;
        const int64_t *shape = shapes[pick % 3];
        int rank = 2 + (int)(pick % 2);
        const mesh_shape *m = (rng(&s) & 1) ? &ma : &mb;
        mesh_spec from = random_spec(m, rank, &cs), to = random_spec(m, rank, &cs);
        to.partial &= from.partial; /* a plan can reduce partial sums, not make them */
        compare(m, rank, shape, &from, &to, &t);
    }
    assert_true(t.n_same > 100); /* both kinds were exercised */
    assert_true(t.n_none > 100);
}

/* ------------------------------------------------------------ the shared memo */

enum { SM_THREADS = 4, SM_KEYS = 600 };

/* key i: a few hundred bytes (as a placement key), the value a function of i */
static int sm_key(int i, unsigned char *k)
{
    int n = 40 + (i * 37) % 300;
    for (int j = 0; j < n; j++) k[j] = (unsigned char)((i * 131 + j * 7) ^ (j >> 3));
    memcpy(k, &i, sizeof i); /* distinct keys */
    return n;
}

static uint64_t sm_val(int i) { return (uint64_t)i * 0x9e3779b97f4a7c15ull + 17; }

typedef struct {
    int id;
    int wrong, found;
} sm_arg;

static void *sm_thread(void *arg)
{
    sm_arg *a = arg;
    unsigned char k[400];
    for (int r = 0; r < 3; r++)
        for (int i = 0; i < SM_KEYS; i++) {
            int key = (i * 7 + a->id * 131) % SM_KEYS; /* threads put the same keys in other orders */
            int n = sm_key(key, k);
            uint64_t v = 0;
            if (mesh_memo_get(k, n, &v, sizeof v)) {
                a->found++;
                a->wrong += v != sm_val(key);
            } else {
                v = sm_val(key);
                mesh_memo_put(k, n, &v, sizeof v);
            }
        }
    return NULL;
}

static void test_shared_memo(void **state)
{
    (void)state;
    pthread_t th[SM_THREADS];
    sm_arg args[SM_THREADS];
    for (int t = 0; t < SM_THREADS; t++) {
        args[t] = (sm_arg){t, 0, 0};
        assert_int_equal(pthread_create(&th[t], NULL, sm_thread, &args[t]), 0);
    }
    int found = 0;
    for (int t = 0; t < SM_THREADS; t++) {
        pthread_join(th[t], NULL);
        assert_int_equal(args[t].wrong, 0);
        found += args[t].found;
    }
    /* every key was put at least once, in the first round of some thread: later rounds find it */
    assert_true(found >= 2 * SM_THREADS * SM_KEYS);
    unsigned char k[400];
    for (int i = 0; i < SM_KEYS; i++) {
        int n = sm_key(i, k);
        uint64_t v = 0;
        assert_true(mesh_memo_get(k, n, &v, sizeof v));
        assert_int_equal(v, sm_val(i));
        k[n - 1] ^= 0x55; /* one byte off: not the same key */
        assert_false(mesh_memo_get(k, n, &v, sizeof v));
        assert_false(mesh_memo_get(k, n - 1, &v, sizeof v));
    }
    /* off: nothing found, nothing kept */
    mesh_memo_set_enabled(false);
    int n = sm_key(3, k);
    uint64_t v = 0;
    assert_false(mesh_memo_get(k, n, &v, sizeof v));
    mesh_memo_set_enabled(true);
    assert_true(mesh_memo_get(k, n, &v, sizeof v));
}

static void test_mesh_ids(void **state)
{
    (void)state;
    const char *names[] = {"data", "fsdp"};
    int s1[] = {2, 4}, s2[] = {4, 2};
    mesh_shape a = helper_mesh(2, names, s1), b = helper_mesh(2, names, s2);
    mesh_shape *a2 = malloc(sizeof *a2);
    *a2 = a; /* the same mesh elsewhere */
    int ia = mesh_memo_mesh_id(&a), ib = mesh_memo_mesh_id(&b);
    assert_true(ia >= 0 && ib >= 0);
    assert_int_not_equal(ia, ib);
    assert_int_equal(mesh_memo_mesh_id(a2), ia);
    assert_int_equal(mesh_memo_mesh_id(&b), ib);
    a2->sizes[0] = 4; /* changed in place: another mesh now (a pointer is no identity) */
    a2->sizes[1] = 2;
    assert_int_not_equal(mesh_memo_mesh_id(a2), ia);
    free(a2);
}

/* ------------------------------------------------------------ remembered einsum placements */

enum { EP_DEV = 8, EP_OPS = 40, EP_POOL = EP_OPS + 4 };

typedef struct {
    const mesh_shape *m;
    mesh_mode mode;
    mesh_einsum_info info[EP_DEV][EP_OPS];
    uint64_t sent[EP_DEV][EP_OPS]; /* bytes sent by the device after each op */
} ep_run;

/* A random spec of `rank` dims: each mesh axis on a random dim or none (the same on every
 * device: the generator is seeded alike). */
static void ep_spec(const mesh_shape *m, int rank, uint64_t *s, mesh_spec *out)
{
    mesh_spec_init(out, rank);
    for (int a = 0; a < m->n_axes; a++) {
        int where = (int)(rng(s) % (uint64_t)(rank + 1));
        if (where < rank) out->axes[where][out->n_axes[where]++] = (int8_t)a;
    }
}

/* A sequence of einsums on one reshard cache, operands drawn from a pool that grows with the
 * outputs: later ops find copies made by earlier ones (free in the search). */
static sim_status ep_device(sim_device *d, void *arg)
{
    ep_run *r = arg;
    int id = sim_device_id(d);
    mesh_ctx ctx = {.dev = d, .mesh = r->m, .mode = r->mode, .drop_size_one = true, .layer = "layer"};
    ctx.cache = mesh_reshard_cache_new(d);
    static const char *const subs[] = {"btd,dh->bth", "btd,hd->bth", "btd,bsd->bts", "bth,btd->hd", "btd,dh->bt"};
    int64_t x_shape[3] = {4, 8, 8}, w_shape[2] = {8, 8};
    mesh_array pool3[EP_POOL], pool2[EP_POOL];
    int n3 = 0, n2 = 0;
    uint64_t s = 0x51ed270b27d4f1a3ull;
    for (int i = 0; i < 2; i++) {
        mesh_spec sp;
        ep_spec(r->m, 3, &s, &sp);
        SIM_TRY(mesh_array_new(d, r->m, "x", 3, x_shape, &sp, SIM_F32, SIM_MEM_ACTIVATIONS, &pool3[n3++]));
        ep_spec(r->m, 2, &s, &sp);
        SIM_TRY(mesh_array_new(d, r->m, "w", 2, w_shape, &sp, SIM_F32, SIM_MEM_PARAMS, &pool2[n2++]));
    }
    sim_device_clear_records(d);
    for (int op = 0; op < EP_OPS; op++) {
        int k = (int)(rng(&s) % 5);
        const char *sub = subs[k];
        const mesh_array *a = &pool3[rng(&s) % (uint64_t)n3];
        const mesh_array *b = k == 2 || k == 3 ? &pool3[rng(&s) % (uint64_t)n3] : &pool2[rng(&s) % (uint64_t)n2];
        int out_rank = k == 3 || k == 4 ? 2 : 3;
        mesh_spec os;
        bool with_out = rng(&s) % 3 == 0;
        if (with_out) ep_spec(r->m, out_rank, &s, &os);
        mesh_array y;
        SIM_TRY(mesh_einsum(&ctx, sub, a, b, with_out ? &os : NULL, "op", SIM_MEM_ACTIVATIONS, &y, &r->info[id][op]));
        size_t nrec;
        const sim_record *rec = sim_device_records(d, &nrec);
        uint64_t sent = 0;
        for (size_t i = 0; i < nrec; i++) sent += rec[i].bytes_sent;
        r->sent[id][op] = sent;
        if (y.rank == 3 && n3 < EP_POOL) pool3[n3++] = y;
        else if (y.rank == 2 && y.shape[0] == 8 && n2 < EP_POOL) pool2[n2++] = y; /* (h, d): a weight's shape */
        else mesh_array_free(d, &y);
    }
    mesh_reshard_cache_free(ctx.cache);
    for (int i = 0; i < n3; i++) mesh_array_free(d, &pool3[i]);
    for (int i = 0; i < n2; i++) mesh_array_free(d, &pool2[i]);
    return SIM_OK;
}

static void ep_pass(const mesh_shape *m, mesh_mode mode, ep_run *r)
{
    sim_machine *mach = helper_machine(m, false);
    memset(r, 0, sizeof *r);
    r->m = m;
    r->mode = mode;
    sim_status st = sim_machine_run(mach, ep_device, r);
    if (st != SIM_OK) fail_msg("%s", sim_errmsg());
    sim_machine_free(mach);
}

static void test_einsum_placement_memo(void **state)
{
    (void)state;
    const char *names[] = {"x", "y", "z"};
    int sizes[] = {2, 2, 2};
    mesh_shape m = helper_mesh(3, names, sizes);
    ep_run *fresh = malloc(sizeof *fresh), *got = malloc(sizeof *got);
    mesh_memo_set_enabled(false);
    ep_pass(&m, MESH_MODE_AUTO, fresh); /* every placement searched */
    mesh_memo_set_enabled(true);
    uint64_t moved = 0;
    for (int pass = 0; pass < 2; pass++) { /* the first fills the memo, the second reads it */
        ep_pass(&m, MESH_MODE_AUTO, got);
        for (int d = 0; d < EP_DEV; d++)
            for (int op = 0; op < EP_OPS; op++) {
                const mesh_einsum_info *x = &fresh->info[d][op], *y = &got->info[d][op];
                assert_string_equal(x->subscripts, y->subscripts);
                assert_true(mesh_spec_equal(&x->a_spec, &y->a_spec));
                assert_true(mesh_spec_equal(&x->b_spec, &y->b_spec));
                assert_true(mesh_spec_equal(&x->local_out, &y->local_out));
                assert_true(mesh_spec_equal(&x->out_spec, &y->out_spec));
                assert_int_equal(x->bytes_in, y->bytes_in);
                assert_int_equal(x->bytes_out, y->bytes_out);
                assert_int_equal(fresh->sent[d][op], got->sent[d][op]);
            }
    }
    for (int d = 0; d < EP_DEV; d++) moved += fresh->sent[d][EP_OPS - 1];
    assert_true(moved > 0); /* the sequence does reshard: the search had choices to make */
    free(fresh);
    free(got);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_memo_equals_planner),
        cmocka_unit_test(test_shared_memo),
        cmocka_unit_test(test_mesh_ids),
        cmocka_unit_test(test_einsum_placement_memo),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
