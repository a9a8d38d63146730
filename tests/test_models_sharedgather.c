/* test_models_sharedgather.c — the shared all-gather (sim_all_gather_dim_shared,
 * used by stage() for every einsum / elementwise / reshape operand and by
 * mesh_nn_operand, for weights and activations alike) moves data
 * differently and nothing else: a small model trained with it and with the
 * plain gather (every member copying the whole array:
 * sim_machine_set_shared_gathers off) gives the same bits (every step's loss,
 * gradient norm and gradients), the same collective records and the same
 * arena figures on every device (live, peak, per category, at the peak,
 * allocations).  Meshes: Llama on fsdp=8, fsdp=4 x tensor=2, fsdp=8 x
 * tensor=8 (64 devices) and fsdp=2 x context=2 x tensor=2 (the K/V gather
 * over context); a DeepSeek (MLA + MoE) on fsdp=2 x expert=2.  The shared run
 * really shared (its machine made buffers, the plain one none), activations
 * too where the run gathers any (more buffers than weight gathers), no
 * buffer outlives a step, and it runs with sim_machine_set_shared_guard: a
 * kernel or VJP writing into a shared operand would fault.  A third run
 * sharing weights alone (sim_machine_set_shared_activations off) is equal
 * too, and makes fewer buffers where the mesh gathers activations. */
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
#include "sim/collectives.h"

/* tests/data/llama2-7b-narrow.yml over 32 tokens */
static const char *const SMALL[] = {LLAMA2_NARROW_YML, "max_target_length=32"};
/* tests/data/tiny-deepseek.yml with 1 dense + 1 MoE layer of 4 experts (top-2, MLA with q_lora) */
static const char *const TINY_DS[] = {TINY_DEEPSEEK_YML, "base_num_decoder_layers=2", "num_experts=4",
                                      "learning_rate=3e-3", "load_balance_loss_weight=0.01"};
enum { NSMALL = sizeof SMALL / sizeof SMALL[0], NTINY_DS = sizeof TINY_DS / sizeof TINY_DS[0] };
enum { ROWS = 8, STEPS = 2, MAXDEV = 64 };

typedef struct {
    double loss[STEPS], gnorm[STEPS];
    sim_arena_stats arena[MAXDEV];
    size_t nrec[MAXDEV];
    sim_record *rec[MAXDEV];
    uint64_t made, live;
    int ndev;
} outcome;

/* Trains; leaves the run open (its step gradients are compared) for the caller to close. */
typedef enum { PLAIN, WEIGHTS, ALL } sharing;

static void train(model_run *r, const char *const *base, int nbase, const char *const *mesh, int n, int ndev,
                  sharing how, outcome *o)
{
    model_run_open(r, base, nbase, ROWS, mesh, n, ndev, STEPS);
    sim_machine_set_shared_gathers(r->m, how != PLAIN);
    sim_machine_set_shared_activations(r->m, how == ALL);
    sim_machine_set_shared_guard(r->m, how != PLAIN);
    model_run_train(r, true);
    for (int s = 0; s < STEPS; s++) o->loss[s] = r->job.stats[s].loss, o->gnorm[s] = r->job.stats[s].raw_grad_norm;
    o->ndev = ndev;
    for (int id = 0; id < ndev; id++) {
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
            if (memcmp(ga->g[i], gb->g[i], bytes))
                fail_msg("%s: step %d, gradient of parameter %d differs", what, s, i);
            compared++;
        }
    }
    assert_true(compared > 0);
    assert_int_equal(a->ndev, b->ndev);
    for (int id = 0; id < a->ndev; id++) {
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
    for (int id = 0; id < o->ndev; id++) free(o->rec[id]);
}

/* acts: the mesh gathers activations (or gradients) into read-only operands, and sharing them
 * must make more buffers than sharing weights alone */
static void shared_equals_plain(const char *what, const char *const *base, int nbase, const char *const *mesh, int n,
                                int ndev, bool acts)
{
    model_run rs, rw, rp;
    outcome s, w, p;
    train(&rs, base, nbase, mesh, n, ndev, ALL, &s);
    train(&rw, base, nbase, mesh, n, ndev, WEIGHTS, &w);
    train(&rp, base, nbase, mesh, n, ndev, PLAIN, &p);
    compare(what, &rs, &s, &rp, &p);
    compare(what, &rw, &w, &rp, &p);
    /* the shared run made buffers (at least one weight gather per layer per step) and freed them
     * all by the end of each step; the plain run made none */
    assert_true(w.made >= (uint64_t)STEPS * 2);
    assert_int_equal(s.live, 0);
    assert_int_equal(w.live, 0);
    assert_int_equal(p.made, 0);
    if (acts && s.made <= w.made)
        fail_msg("%s: %llu shared buffers with activations shared, %llu with weights alone", what,
                 (unsigned long long)s.made, (unsigned long long)w.made);
    if (!acts) assert_int_equal(s.made, w.made);
    /* and the run trained */
    assert_true(s.loss[STEPS - 1] < s.loss[0]);
    model_run_close(&rs);
    model_run_close(&rw);
    model_run_close(&rp);
    free_outcome(&s);
    free_outcome(&w);
    free_outcome(&p);
}

static void test_fsdp8(void **state)
{
    (void)state;
    const char *mesh[] = {"ici_fsdp_parallelism=8"};
    shared_equals_plain("fsdp=8", SMALL, NSMALL, mesh, 1, 8, false);
}

static void test_fsdp4_tensor2(void **state)
{
    (void)state;
    const char *mesh[] = {"ici_fsdp_parallelism=4", "ici_tensor_parallelism=2"};
    shared_equals_plain("fsdp=4 tensor=2", SMALL, NSMALL, mesh, 2, 8, true);
}

static void test_fsdp8_tensor8(void **state)
{
    (void)state;
    /* 8 heads of 8: the heads divide over tensor=8 */
    const char *mesh[] = {"ici_fsdp_parallelism=8", "ici_tensor_parallelism=8", "base_num_query_heads=8",
                          "base_num_kv_heads=8", "head_dim=8"};
    shared_equals_plain("fsdp=8 tensor=8", SMALL, NSMALL, mesh, 5, 64, true);
}

static void test_context(void **state)
{
    (void)state;
    const char *mesh[] = {"ici_fsdp_parallelism=2", "ici_context_parallelism=2", "ici_tensor_parallelism=2"};
    shared_equals_plain("fsdp=2 context=2 tensor=2", SMALL, NSMALL, mesh, 3, 8, true);
}

static void test_deepseek_moe(void **state)
{
    (void)state;
    const char *mesh[] = {"ici_fsdp_parallelism=2", "ici_expert_parallelism=2"};
    shared_equals_plain("deepseek fsdp=2 expert=2", TINY_DS, NTINY_DS, mesh, 2, 4, false);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fsdp8),   cmocka_unit_test(test_fsdp4_tensor2), cmocka_unit_test(test_fsdp8_tensor8),
        cmocka_unit_test(test_context), cmocka_unit_test(test_deepseek_moe),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
