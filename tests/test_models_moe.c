/* test_models_moe.c — the MoE router (models/blocks/moe.h) against float64 references
 * computed here from MaxText 0.2.5's definitions (layers/moe.py), on one
 * device and on a 2x2 mesh that shards the tokens:
 *   - no score function (routed_score_func=""): the top-k of the raw logits
 *     (plus bias), weights = logits x routed_scaling_factor (pre-bias logits
 *     for DeepSeek-V3 names, biased ones otherwise), no renormalisation;
 *   - group-limited routing (n_routing_groups, topk_routing_group): groups
 *     ranked by the sum of their two best biased scores, the other groups'
 *     experts masked before the top-k;
 *   - the load-balance loss: density divided by num_experts_per_tok, the
 *     softmax of the pre-bias scores, and its gradient;
 *   - random routing: draws equal on every mesh, weights the biased scores;
 *   - loss-free balancing: the expert counts summed over the token axes, and
 *     bias += rate * sign(mean - count);
 *   - a bad group configuration is an input error naming the keys. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "models/blocks/moe.h"
#include "mesh/nn.h"
#include "tests/helpers.h"

enum { B = 4, S = 4, E = 8, K = 2, N = B * S };

typedef struct {
    mesh_shape mesh;
    const char *tok_spec; /* sharding of the (B, S, E) scores */
    model_moe_route_cfg rc;
    bool with_bias, lb;
    double lb_weight;
    float scores[N * E], bias[E];
    /* results, gathered */
    float weights[N * K], dscores[N * E], lb_loss, counts[4][E];
    int32_t idx[N * K];
} router_job;

/* Every exit goes through `out`, so a failing step (an expected refusal included) frees the tape and
 * the arrays it made (the arrays start zeroed: freeing one never made is a no-op). */
static sim_status router_device(sim_device *dev, void *arg)
{
    router_job *j = arg;
    mesh_ctx ctx = {
        .dev = dev, .mesh = &j->mesh, .mode = MESH_MODE_AUTO, .drop_size_one = true, .layer = "router_test"};
    mesh_tape *t = mesh_tape_new(&ctx, true);
    mesh_spec tok, rep, rep3;
    mesh_array sa = {0}, ba = {0}, sink = {0};
    sim_status st = mesh_spec_parse(j->tok_spec, &j->mesh, &tok);
    if (st) goto out;
    mesh_spec_init(&rep, 1);
    mesh_spec_init(&rep3, 3);
    int64_t ss[3] = {B, S, E}, bs[1] = {E};
    if ((st = mesh_array_new(dev, &j->mesh, "scores", 3, ss, &tok, SIM_F32, SIM_MEM_ACTIVATIONS, &sa))) goto out;
    if ((st = mesh_array_new(dev, &j->mesh, "bias", 1, bs, &rep, SIM_F32, SIM_MEM_PARAMS, &ba))) goto out;
    if ((st = mesh_array_new(dev, &j->mesh, "dscores", 3, ss, &rep3, SIM_F32, SIM_MEM_GRADS, &sink))) goto out;
    mesh_array_load_global(dev, &j->mesh, &sa, j->scores);
    mesh_array_load_global(dev, &j->mesh, &ba, j->bias);
    mesh_var *s = mesh_tape_param(t, &sa, &sink), *b = j->with_bias ? mesh_tape_input(t, &ba, false) : NULL;
    mesh_var *w, *ix, *loss = NULL;
    if ((st = model_moe_route(t, s, b, &j->rc, "routing", &w, &ix))) goto out;
    if ((st = mesh_array_store_global(dev, &j->mesh, &w->val, j->weights))) goto out;
    if ((st = mesh_array_store_global(dev, &j->mesh, &ix->val, j->idx))) goto out;
    if ((st = model_moe_expert_counts(t, ix, E, "counts", j->counts[sim_device_id(dev)]))) goto out;
    if (j->lb) {
        /* the sparse path of a DeepSeek-V3 name: probabilities from the pre-bias scores */
        if ((st = model_moe_lb_loss(t, s, NULL, ix, j->lb_weight, "lb", &loss))) goto out;
        if (sim_device_id(dev) == 0) j->lb_loss = ((float *)loss->val.data)[0];
        if ((st = mesh_tape_backward(t, loss))) goto out;
        st = mesh_array_store_global(dev, &j->mesh, &sink, j->dscores);
    }
out:
    mesh_tape_free(t);
    mesh_array_free(dev, &sa);
    mesh_array_free(dev, &ba);
    mesh_array_free(dev, &sink);
    return st;
}

/* 1 device, or data=2 x fsdp=2 with the batch on both (P(('data','fsdp'), None, None)) or batch and
 * sequence apart (P('data', 'fsdp', None)). */
static sim_status run_router(router_job *j, int layout)
{
    const char *names[] = {"data", "fsdp"};
    int one[] = {1, 1}, two[] = {2, 2};
    SIM_ASSERT(mesh_shape_init(&j->mesh, 2, names, layout ? two : one) == SIM_OK);
    j->tok_spec = layout == 2 ? "P('data', 'fsdp', None)"
                  : layout    ? "P(('data', 'fsdp'), None, None)"
                              : "P(None, None, None)";
    sim_machine *m = helper_machine(&j->mesh, false);
    sim_status st = sim_machine_run(m, router_device, j);
    sim_machine_free(m);
    return st;
}

/* distinct raw logits (positive and negative) and a bias that reorders some experts */
static void fill_inputs(router_job *j)
{
    for (int i = 0; i < N * E; i++) j->scores[i] = helper_det_val((uint32_t)i, 2.0f) + 0.0001f * (float)(i % E);
    for (int e = 0; e < E; e++) j->bias[e] = (e % 3 == 0) ? 0.8f : (e % 3 == 1 ? -0.5f : 0.0f);
}

/* float64 reference: indices of the k largest of v (ties to the lowest index). */
static void ref_topk(const double *v, int n, int k, int *out)
{
    bool used[64] = {false};
    for (int j = 0; j < k; j++) {
        int best = -1;
        for (int e = 0; e < n; e++)
            if (!used[e] && (best < 0 || v[e] > v[best])) best = e;
        used[best] = true;
        out[j] = best;
    }
}

static void test_no_score_function(void **state)
{
    (void)state;
    static router_job j;
    for (int ds3 = 0; ds3 < 2; ds3++)
        for (int layout = 0; layout < 3; layout++) {
            memset(&j, 0, sizeof j);
            fill_inputs(&j);
            j.with_bias = true;
            /* routed_score_func="": the scores ARE the gate logits; no sigmoid renormalisation */
            j.rc = (model_moe_route_cfg){.k = K, .sigmoid = false, .scaling = 2.5, .bias_selects_only = ds3};
            if (run_router(&j, layout) != SIM_OK) fail_msg("router: %s", sim_errmsg());
            double maxerr = 0;
            for (int n = 0; n < N; n++) {
                double g[E];
                for (int e = 0; e < E; e++) g[e] = (double)j.scores[n * E + e] + j.bias[e];
                int sel[K];
                ref_topk(g, E, K, sel);
                for (int k = 0; k < K; k++) {
                    assert_int_equal(j.idx[n * K + k], sel[k]);
                    /* DeepSeek-V3: the pre-bias logit; other names: the biased one; times the scaling */
                    double want = (ds3 ? (double)j.scores[n * E + sel[k]] : g[sel[k]]) * 2.5;
                    double err = fabs(want - j.weights[n * K + k]);
                    if (err > maxerr) maxerr = err;
                }
            }
            assert_true(maxerr < 1e-6);
        }
    /* the bias changed some choices: the test would pass without it otherwise */
    int moved = 0;
    for (int n = 0; n < N; n++) {
        double r[E];
        for (int e = 0; e < E; e++) r[e] = j.scores[n * E + e];
        int sel[K];
        ref_topk(r, E, K, sel);
        moved += sel[0] != j.idx[n * K] || sel[1] != j.idx[n * K + 1];
    }
    printf("  raw-logit routing: %d of %d tokens routed differently because of the bias\n", moved, N);
    assert_true(moved > 0);
}

static void test_group_limited(void **state)
{
    (void)state;
    static router_job j;
    enum { G = 4, KEEP = 2, PER = E / G };
    int differs = 0;
    for (int layout = 0; layout < 3; layout++) {
        memset(&j, 0, sizeof j);
        fill_inputs(&j);
        for (int i = 0; i < N * E; i++) j.scores[i] = 1.0f / (1.0f + expf(-j.scores[i])); /* sigmoid scores */
        j.with_bias = true;
        j.rc = (model_moe_route_cfg){
            .k = K, .sigmoid = true, .scaling = 2.5, .bias_selects_only = true, .groups = G, .topk_groups = KEEP};
        if (run_router(&j, layout) != SIM_OK) fail_msg("router: %s", sim_errmsg());
        double maxerr = 0;
        for (int n = 0; n < N; n++) {
            double g[E], gs[G];
            for (int e = 0; e < E; e++) g[e] = (double)j.scores[n * E + e] + j.bias[e];
            for (int q = 0; q < G; q++) { /* sum of the two best of each group (PER = 2: both) */
                int t2[2];
                ref_topk(g + q * PER, PER, 2, t2);
                gs[q] = g[q * PER + t2[0]] + g[q * PER + t2[1]];
            }
            int kept[KEEP];
            ref_topk(gs, G, KEEP, kept);
            double masked[E];
            for (int e = 0; e < E; e++) masked[e] = -INFINITY;
            for (int q = 0; q < KEEP; q++)
                for (int e = 0; e < PER; e++) masked[kept[q] * PER + e] = g[kept[q] * PER + e];
            int sel[K], plain[K];
            ref_topk(masked, E, K, sel);
            ref_topk(g, E, K, plain);
            differs += sel[0] != plain[0] || sel[1] != plain[1];
            double sum = 1e-20;
            for (int k = 0; k < K; k++) sum += j.scores[n * E + sel[k]];
            for (int k = 0; k < K; k++) {
                assert_int_equal(j.idx[n * K + k], sel[k]);
                double err = fabs(j.scores[n * E + sel[k]] / sum * 2.5 - j.weights[n * K + k]);
                if (err > maxerr) maxerr = err;
            }
        }
        assert_true(maxerr < 1e-6);
    }
    printf("  group-limited routing: %d of %d token routings differ from the plain top-k (x3 layouts)\n", differs / 3,
           N);
    assert_true(differs > 0);
}

static void test_load_balance_loss(void **state)
{
    (void)state;
    static router_job j;
    const double w = 0.3;
    float first = 0;
    for (int layout = 0; layout < 3; layout++) {
        memset(&j, 0, sizeof j);
        fill_inputs(&j);
        for (int i = 0; i < N * E; i++) j.scores[i] = 1.0f / (1.0f + expf(-j.scores[i]));
        j.with_bias = true;
        j.lb = true;
        j.lb_weight = w;
        j.rc = (model_moe_route_cfg){.k = K, .sigmoid = true, .scaling = 1.0, .bias_selects_only = true};
        if (run_router(&j, layout) != SIM_OK) fail_msg("router: %s", sim_errmsg());
        /* float64: density = count / (S k), probs = softmax(pre-bias scores), loss = mean(density * mean_S probs) E^2 w */
        double p[N][E], cnt[B][E] = {{0}}, pm[B][E] = {{0}};
        for (int n = 0; n < N; n++) {
            double mx = -INFINITY, sum = 0;
            for (int e = 0; e < E; e++) mx = fmax(mx, j.scores[n * E + e]);
            for (int e = 0; e < E; e++) sum += exp(j.scores[n * E + e] - mx);
            for (int e = 0; e < E; e++) p[n][e] = exp(j.scores[n * E + e] - mx) / sum;
            double g[E];
            for (int e = 0; e < E; e++) g[e] = (double)j.scores[n * E + e] + j.bias[e];
            int sel[K];
            ref_topk(g, E, K, sel);
            for (int k = 0; k < K; k++) cnt[n / S][sel[k]] += 1;
            for (int e = 0; e < E; e++) pm[n / S][e] += p[n][e] / S;
        }
        double loss = 0;
        for (int b = 0; b < B; b++)
            for (int e = 0; e < E; e++) loss += cnt[b][e] / (S * K) * pm[b][e];
        loss = loss / (B * E) * E * E * w;
        printf("  load-balance loss (layout %d): %.9f, float64 reference %.9f\n", layout, j.lb_loss, loss);
        assert_true(fabs(j.lb_loss - loss) <= 1e-6 * fabs(loss));
        /* e591f30c's loss (no division by k) would be K times larger: the check above tells them apart */
        if (layout == 0) first = j.lb_loss;
        assert_true(fabs(j.lb_loss - first) <= 1e-6 * fabs(first));
        /* gradient: dL/dp[n][e] = w E / (B S^2 k) cnt[b][e], through each token's softmax */
        double maxerr = 0, maxg = 0;
        for (int n = 0; n < N; n++) {
            double dp[E], dot = 0;
            for (int e = 0; e < E; e++) {
                dp[e] = w * E / ((double)B * S * S * K) * cnt[n / S][e];
                dot += dp[e] * p[n][e];
            }
            for (int e = 0; e < E; e++) {
                double want = p[n][e] * (dp[e] - dot);
                maxerr = fmax(maxerr, fabs(want - j.dscores[n * E + e]));
                maxg = fmax(maxg, fabs(want));
            }
        }
        assert_true(maxg > 0);
        assert_true(maxerr <= 1e-6 * maxg);
    }
}

static void test_random_routing(void **state)
{
    (void)state;
    static router_job j, ref;
    for (int layout = 0; layout < 3; layout++) {
        router_job *r = layout ? &j : &ref;
        memset(r, 0, sizeof *r);
        fill_inputs(r);
        r->with_bias = true;
        r->rc = (model_moe_route_cfg){
            .k = K, .sigmoid = true, .scaling = 2.5, .bias_selects_only = true, .random = true, .random_key = 0x1234};
        if (run_router(r, layout) != SIM_OK) fail_msg("router: %s", sim_errmsg());
        if (!layout) continue;
        assert_memory_equal(j.idx, ref.idx, sizeof j.idx); /* the same draws on every mesh */
        assert_memory_equal(j.weights, ref.weights, sizeof j.weights);
    }
    int seen[E] = {0}, topk_same = 0;
    for (int n = 0; n < N; n++)
        for (int k = 0; k < K; k++) {
            int e = ref.idx[n * K + k];
            assert_true(e >= 0 && e < E);
            seen[e]++;
            /* the biased score, neither renormalised nor scaled */
            assert_true(ref.weights[n * K + k] == ref.scores[n * E + e] + ref.bias[e]);
        }
    for (int n = 0; n < N; n++) {
        double g[E];
        for (int e = 0; e < E; e++) g[e] = (double)ref.scores[n * E + e] + ref.bias[e];
        int sel[K];
        ref_topk(g, E, K, sel);
        topk_same += sel[0] == ref.idx[n * K] && sel[1] == ref.idx[n * K + 1];
    }
    int distinct = 0;
    for (int e = 0; e < E; e++) distinct += seen[e] > 0;
    printf("  random routing: %d of %d experts drawn, %d of %d tokens as the top-k would route them\n", distinct, E,
           topk_same, N);
    assert_true(distinct >= E - 2);
    assert_true(topk_same < N / 2);
}

static void test_counts_and_bias_update(void **state)
{
    (void)state;
    static router_job j;
    for (int layout = 0; layout < 3; layout++) {
        memset(&j, 0, sizeof j);
        fill_inputs(&j);
        j.with_bias = true;
        j.rc = (model_moe_route_cfg){.k = K, .sigmoid = true, .scaling = 1.0, .bias_selects_only = true};
        if (run_router(&j, layout) != SIM_OK) fail_msg("router: %s", sim_errmsg());
        double want[E] = {0};
        for (int n = 0; n < N * K; n++) want[j.idx[n]] += 1;
        for (int d = 0; d < (layout ? 4 : 1); d++)
            for (int e = 0; e < E; e++) assert_true(j.counts[d][e] == want[e]); /* every device, the whole batch */
    }
    /* mean load 4: below -> +rate, above -> -rate, equal -> unchanged */
    float bias[E] = {0.5f, 0.5f, 0.5f, 0.5f, 0, 0, 0, 0}, counts[E] = {0, 4, 8, 3, 5, 4, 6, 2};
    model_moe_bias_update(bias, counts, E, 0.25);
    const float want[E] = {0.75f, 0.5f, 0.25f, 0.75f, -0.25f, 0.0f, -0.25f, 0.25f};
    for (int e = 0; e < E; e++) assert_true(bias[e] == want[e]);
}

static void test_bad_groups(void **state)
{
    (void)state;
    static router_job j;
    memset(&j, 0, sizeof j);
    fill_inputs(&j);
    j.rc = (model_moe_route_cfg){
        .k = K, .sigmoid = true, .scaling = 1.0, .bias_selects_only = true, .groups = 3, .topk_groups = 1};
    assert_int_equal(run_router(&j, 0), SIM_ERR_INPUT);
    assert_non_null(strstr(sim_errmsg(), "n_routing_groups=3"));
}

/* The one expert permutation: a stable counting sort, checked against rows worked out by hand
 * (bucket starts 0, 2, 3 from the counts 2, 1, 2; ties keep assignment order; -1 goes nowhere). */
static void test_permute(void **state)
{
    (void)state;
    const int32_t key[6] = {2, 0, -1, 2, 1, 0};
    int64_t cnt[3] = {7, 7, 7}; /* overwritten, not added to */
    int32_t row[6];
    assert_int_equal(model_moe_permute(key, 6, 3, cnt, row), 5);
    const int64_t want_cnt[3] = {2, 1, 2};
    const int32_t want_row[6] = {3, 0, -1, 4, 2, 1};
    for (int b = 0; b < 3; b++) assert_int_equal(cnt[b], want_cnt[b]);
    for (int a = 0; a < 6; a++) assert_int_equal(row[a], want_row[a]);
    /* nothing placed: every count zero, every row -1 */
    const int32_t none[2] = {-1, -1};
    assert_int_equal(model_moe_permute(none, 2, 3, cnt, row), 0);
    for (int b = 0; b < 3; b++) assert_int_equal(cnt[b], 0);
    assert_int_equal(row[0], -1);
    assert_int_equal(row[1], -1);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_no_score_function),
        cmocka_unit_test(test_group_limited),
        cmocka_unit_test(test_load_balance_loss),
        cmocka_unit_test(test_random_routing),
        cmocka_unit_test(test_counts_and_bias_update),
        cmocka_unit_test(test_bad_groups),
        cmocka_unit_test(test_permute),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
