/* test_models_sharedgather.c — the shared all-gather of parameters
 * (sim_all_gather_dim_shared, used by stage() and mesh_nn_operand) moves
 * data differently and nothing else: a small Llama trained on fsdp=8 and on
 * fsdp=4 x tensor=2 with it and with the plain gather (every member copying
 * the whole weight: sim_machine_set_shared_gathers off) gives the same bits
 * (every step's loss, gradient norm and gradients), the same collective
 * records and the same arena figures on every device (live, peak, per
 * category, at the peak, allocations); the shared run really shared (its
 * machine made buffers, the plain one none) and no buffer outlives a step. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model_run.h"
#include "sim/collectives.h"

static const char *const SMALL[] = {
    "model_name=llama2-7b", "override_model_config=true", "base_emb_dim=64",  "base_num_query_heads=4",
    "base_num_kv_heads=4",  "head_dim=16",                "base_mlp_dim=192", "base_num_decoder_layers=2",
    "vocab_size=256",       "max_target_length=32",       "learning_rate=3e-3",
};
enum { NSMALL = sizeof SMALL / sizeof SMALL[0], ROWS = 8, STEPS = 2, MAXDEV = 8 };

typedef struct {
    double loss[STEPS], gnorm[STEPS];
    sim_arena_stats arena[MAXDEV];
    size_t nrec[MAXDEV];
    sim_record *rec[MAXDEV];
    uint64_t made, live;
} outcome;

/* Trains; leaves the run open (its step gradients are compared) for the caller to close. */
static void train(model_run *r, const char *const *mesh, int n, bool shared, outcome *o)
{
    model_run_open(r, SMALL, NSMALL, ROWS, mesh, n, MAXDEV, STEPS);
    sim_machine_set_shared_gathers(r->m, shared);
    model_run_train(r, true);
    for (int s = 0; s < STEPS; s++) o->loss[s] = r->job.stats[s].loss, o->gnorm[s] = r->job.stats[s].grad_norm;
    for (int id = 0; id < MAXDEV; id++) {
        sim_device *d = sim_machine_device(r->m, id);
        sim_arena_get_stats(sim_device_arena(d), &o->arena[id]);
        const sim_record *rec = sim_device_records(d, &o->nrec[id]);
        o->rec[id] = malloc(o->nrec[id] * sizeof *rec + 1);
        memcpy(o->rec[id], rec, o->nrec[id] * sizeof *rec);
    }
    sim_machine_shared_stats(r->m, &o->made, &o->live);
}

static void compare(const char *what, model_run *ra, const outcome *a, model_run *rb, const outcome *b)
{
    for (int s = 0; s < STEPS; s++)
        if (memcmp(&a->loss[s], &b->loss[s], sizeof(double)) || memcmp(&a->gnorm[s], &b->gnorm[s], sizeof(double)))
            fail_msg("%s: step %d loss %.17g vs %.17g, grad norm %.17g vs %.17g", what, s, a->loss[s], b->loss[s],
                     a->gnorm[s], b->gnorm[s]);
    int compared = 0;
    for (int s = 0; s < STEPS; s++) {
        const model_grads *ga = &ra->job.step_grads[s], *gb = &rb->job.step_grads[s];
        assert_int_equal(ga->n, gb->n);
        for (int i = 0; i < ga->n; i++) {
            assert_true(!ga->g[i] == !gb->g[i]);
            if (!ga->g[i]) continue;
            size_t bytes = (size_t)(ga->layer_elems[i] * ga->n_layers[i]) * sizeof(float);
            if (memcmp(ga->g[i], gb->g[i], bytes)) fail_msg("%s: step %d, gradient of parameter %d differs", what, s, i);
            compared++;
        }
    }
    assert_true(compared > 0);
    for (int id = 0; id < MAXDEV; id++) {
        const sim_arena_stats *x = &a->arena[id], *y = &b->arena[id];
        assert_int_equal(x->live, y->live);
        assert_int_equal(x->peak, y->peak);
        assert_int_equal(x->n_allocs, y->n_allocs);
        for (int c = 0; c < SIM_NMEM; c++) {
            assert_int_equal(x->live_by[c], y->live_by[c]);
            assert_int_equal(x->peak_by[c], y->peak_by[c]);
            assert_int_equal(x->at_peak_by[c], y->at_peak_by[c]);
        }
        assert_int_equal(a->nrec[id], b->nrec[id]);
        for (size_t i = 0; i < a->nrec[id]; i++) {
            const sim_record *p = &a->rec[id][i], *q = &b->rec[id][i];
            assert_int_equal(p->op, q->op);
            assert_int_equal(p->group_size, q->group_size);
            assert_int_equal(p->dtype, q->dtype);
            assert_int_equal(p->elements, q->elements);
            assert_int_equal(p->bytes_sent, q->bytes_sent);
            assert_int_equal(p->bytes_recv, q->bytes_recv);
            assert_int_equal(p->weight, q->weight);
            assert_int_equal(p->implicit, q->implicit);
            assert_string_equal(p->tag, q->tag);
        }
    }
}

static void free_outcome(outcome *o)
{
    for (int id = 0; id < MAXDEV; id++) free(o->rec[id]);
}

static void shared_equals_plain(const char *what, const char *const *mesh, int n)
{
    model_run rs, rp;
    outcome s, p;
    train(&rs, mesh, n, true, &s);
    train(&rp, mesh, n, false, &p);
    compare(what, &rs, &s, &rp, &p);
    /* the shared run made buffers (at least one weight gather per layer per step) and freed them
     * all by the end of each step; the plain run made none */
    assert_true(s.made >= (uint64_t)STEPS * 2);
    assert_int_equal(s.live, 0);
    assert_int_equal(p.made, 0);
    /* and the run trained */
    assert_true(s.loss[STEPS - 1] < s.loss[0]);
    model_run_close(&rs);
    model_run_close(&rp);
    free_outcome(&s);
    free_outcome(&p);
}

static void test_fsdp8(void **state)
{
    (void)state;
    const char *mesh[] = {"ici_fsdp_parallelism=8"};
    shared_equals_plain("fsdp=8", mesh, 1);
}

static void test_fsdp4_tensor2(void **state)
{
    (void)state;
    const char *mesh[] = {"ici_fsdp_parallelism=4", "ici_tensor_parallelism=2"};
    shared_equals_plain("fsdp=4 tensor=2", mesh, 2);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fsdp8),
        cmocka_unit_test(test_fsdp4_tensor2),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
