/* test_models_deepseek.c — DeepSeek (MLA + MoE) end to end on small shapes:
 *   - the whole-model gradient against central finite differences of the
 *     loss on one device: MLA with dense layers, and a model with a MoE layer
 *     and the load-balance loss (elements whose perturbation changes the
 *     routing — the finite difference then disagrees with itself at h/2 — are
 *     skipped and counted);
 *   - parity over 5 training steps (loss and every parameter gradient of
 *     every step, rtol 1e-4: |loss - ref| <= 1e-4 |ref| and per parameter
 *     ||g - g_ref|| <= 1e-4 ||g_ref||) of a small deepseek3-tiny variant with
 *     the 1-device run, on the meshes of its tests (data, FSDP, tensor, expert and their mixes) in auto and explicit mode,
 *     for the sparse (ragged all-to-all) and the dense capacity MoE paths
 *     (capacity large enough to drop nothing); ep-as-cp against
 *     fsdp=2 context=2 under the base rules and shard-exp-on-fsdp against the
 *     base rules on fsdp=4 expert=2 (MaxText's checks for those rule sets);
 *     the other custom rule sets against the 1-device run; a fractional
 *     per_device_batch_size (0.5 on 8 devices) against 4 rows on 1 device;
 *   - the MoE region alone against a host reference with routing computed
 *     independently from the global scores, and its ragged all-to-all bytes
 *     equal to the routed rows that cross devices x the row bytes;
 *   - dry run: the dense path's traffic equals a real run's byte for byte,
 *     the sparse path's everywhere but the ragged exchanges, and peak memory
 *     is the same;
 *   - full-size deepseek3-test and deepseek3-671b train one dry step;
 *   - experts that do not divide over the expert axis are refused with a
 *     message naming the key and the fix. */
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
#include "models/core/train.h"
#include "tests/helpers.h"
#include "tests/model_run.h"

/* A deepseek3-tiny variant: 1 dense + 2 MoE layers, 8 experts top-2,
 * MLA with q_lora, sigmoid routing with bias (DeepSeek-V3 routing). */
/* tests/data/tiny-deepseek.yml (1 dense + 2 MoE layers, 8 experts top-2, MLA with q_lora, sigmoid
 * routing with the bias: DeepSeek-V3 routing) with the MoE parity knobs of tests/data/moe-training.yml */
static const char *const TINY[] = {TINY_DEEPSEEK_YML, MOE_TRAINING_YML};
enum { NTINY = sizeof TINY / sizeof TINY[0], ROWS = 8, SEQ = 16, VOCAB = 64, STEPS = 5 };

/* capacity ceil(16*2/8) * 4 = 16 = the sequence: the dense path drops nothing (sparse_matmul=false
 * capacity_factor=4: with sparse_matmul=true MaxText ignores capacity_factor) */
static const char *const DENSE_PATH = "tests/data/moe_dense_path.yml";

static model_def *load(const char *const *extra, int n_extra, int devices, cfg_config **cfg_out)
{
    return model_run_load(TINY, NTINY, ROWS, extra, n_extra, devices, 0, cfg_out);
}

/* ------------------------------------------------------------ gradient check */

static void gradient_check(const char *const *extra, int n_extra, int *checked_out, int *skipped_out)
{
    model_def *def = load(extra, n_extra, 1, NULL);
    model_run_batch b;
    model_run_batch_make(&b, ROWS, SEQ, VOCAB);
    model_grads params, grads;
    double loss = model_run_loss_grads(def, b.in, b.tg, b.pos, NULL, &params, &grads);
    assert_true(loss > 3.0 && loss < 5.5); /* about ln(64) = 4.16 at init */
    int checked = 0, skipped = 0;
    for (int i = 0; i < def->nparams; i++) {
        int64_t n = params.layer_elems[i] * params.n_layers[i];
        for (int pick = 0; pick < 3; pick++) {
            int64_t best = 0;
            for (int64_t j = 1; j < n; j++)
                if (fabsf(grads.g[i][j]) > fabsf(grads.g[i][best])) best = j;
            float g = grads.g[i][best];
            if (fabsf(g) < 1e-4f) break;
            float saved = params.g[i][best];
            double fd[2];
            for (int hi = 0; hi < 2; hi++) {
                double h = hi ? 5e-3 : 1e-2;
                params.g[i][best] = saved + (float)h;
                double lp = model_run_loss_grads(def, b.in, b.tg, b.pos, &params, NULL, NULL);
                params.g[i][best] = saved - (float)h;
                double lm = model_run_loss_grads(def, b.in, b.tg, b.pos, &params, NULL, NULL);
                fd[hi] = (lp - lm) / (2 * h);
            }
            params.g[i][best] = saved;
            grads.g[i][best] = 0; /* next pick */
            /* a routing decision flipped inside [-h, h]: the loss is not smooth there */
            if (fabs(fd[0] - fd[1]) > 0.02 * fabs(fd[1]) + 2e-5) {
                /* only what feeds the router can flip it: never the experts, the shared
                 * experts or the output head */
                const char *p = def->defs[i].path;
                if (strstr(p, "MoeBlock_0.w") || strstr(p, "shared_experts") || strstr(p, "logits_dense") ||
                    strstr(p, "decoder_norm"))
                    fail_msg("%s element %lld: the loss is not smooth (%.6g at h, %.6g at h/2) downstream of the "
                             "routing",
                             p, (long long)best, fd[0], fd[1]);
                skipped++;
                continue;
            }
            if (fabs(fd[1] - g) > 0.02 * fabs(g) + 2e-5)
                fail_msg("%s element %lld: backward %.6g, finite differences %.6g", def->defs[i].path, (long long)best,
                         g, fd[1]);
            checked++;
        }
    }
    model_grads_free(&params);
    model_grads_free(&grads);
    *checked_out = checked;
    *skipped_out = skipped;
    model_run_unload(def);
}

static void test_gradient_mla_dense(void **state)
{
    (void)state;
    const char *extra[] = {"base_num_decoder_layers=2", "first_num_dense_layers=2"};
    int checked, skipped;
    gradient_check(extra, 2, &checked, &skipped);
    printf("  MLA + dense layers: %d elements checked\n", checked);
    assert_int_equal(skipped, 0); /* no routing: the loss is smooth */
    assert_true(checked >= 2 * 20);
}

static void test_gradient_moe(void **state)
{
    (void)state;
    const char *sparse[] = {"base_num_decoder_layers=2", "first_num_dense_layers=1"};
    const char *dense[] = {"base_num_decoder_layers=2", "first_num_dense_layers=1", DENSE_PATH,
                           "routed_score_func=softmax", "routed_bias=false"};
    int checked, skipped;
    gradient_check(sparse, 2, &checked, &skipped);
    printf("  MLA + MoE (sparse, sigmoid, bias): %d elements checked, %d skipped (routing flipped)\n", checked,
           skipped);
    assert_true(checked >= 50);
    gradient_check(dense, 5, &checked, &skipped);
    printf("  MLA + MoE (dense capacity, softmax): %d elements checked, %d skipped (routing flipped)\n", checked,
           skipped);
    assert_true(checked >= 50);
}

/* ------------------------------------------------------------ parity over 5 steps */

/* Trains STEPS steps of TINY + extra on `devices` devices (with every step's gradients when grads). */
static void train_run_opt(model_run *r, const char *const *extra, int n_extra, int devices, bool grads)
{
    model_run_open(r, TINY, NTINY, ROWS, extra, n_extra, devices, STEPS);
    model_run_train(r, grads);
}

static void train_run(model_run *r, const char *const *extra, int n_extra, int devices)
{
    train_run_opt(r, extra, n_extra, devices, true);
}

/* A configuration MaxText 0.2.5 cannot trace in explicit mode: training stops with a sharding
 * error naming `err` (MaxText's failing op), before any step. */
static void train_expect_error(const char *const *extra, int n_extra, int devices, const char *err, const char *what)
{
    model_run r;
    model_run_open(&r, TINY, NTINY, ROWS, extra, n_extra, devices, 1);
    sim_status st = model_train(&r.job, r.m);
    if (st != SIM_ERR_SHARDING || !strstr(sim_errmsg(), err))
        fail_msg("%s: expected a sharding error naming '%s', got status %d: %s", what, err, (int)st,
                 st ? sim_errmsg() : "(trained)");
    model_run_close(&r);
}

static double worst_loss, worst_grad;
static char worst_where[256];
static double worst_step[STEPS];

/* Losses and every gradient of every step of a against b. */
static void compare_runs(const char *what, const model_run *a, const model_run *b)
{
    for (int s = 0; s < STEPS; s++) {
        double l = a->job.stats[s].loss, lr = b->job.stats[s].loss, dl = fabs(l - lr) / fabs(lr);
        if (dl > worst_loss) worst_loss = dl;
        if (dl > 1e-4) fail_msg("%s step %d: loss %.7f vs %.7f", what, s, l, lr);
        for (int i = 0; i < a->def->nparams; i++) {
            const model_grads *g = &a->job.step_grads[s], *gr = &b->job.step_grads[s];
            double e = model_rel_norm_diff(g->g[i], gr->g[i], g->layer_elems[i] * g->n_layers[i]);
            if (e > worst_step[s]) worst_step[s] = e;
            if (e > worst_grad) {
                worst_grad = e;
                snprintf(worst_where, sizeof worst_where, "%s step %d %s", what, s, a->def->defs[i].path);
            }
            if (e > 1e-4) fail_msg("%s step %d: gradient of %s differs by %.3g", what, s, a->def->defs[i].path, e);
        }
    }
}

typedef struct {
    const char *label;
    const char *flags[5];
    int devices;
    bool explicit_too;
    const char *explicit_err; /* MaxText 0.2.5 cannot trace it in explicit mode: its failing op */
} mesh_case;

/* MaxText 0.2.5's explicit-mode failures (tests/data/maxtext-0.2.5/verdicts): dot-product attention
 * (T = 16 < 128) with the sequence sharded; MLA's q_norm (q_lora_rank > 0) with tensor > 1.  Their
 * parity is checked in auto mode. */
#define QK_ERR "MaxText 0.2.5 fails here too: layers/attention_op.py:qk_product"
#define TENSOR_ERR "MaxText 0.2.5 fails here too: layers/normalizations.py:__call__"

static const mesh_case MESHES[] = {
    {"fsdp=8", {"ici_fsdp_parallelism=8"}, 8, true, NULL},
    {"fsdp=4 expert=2", {"ici_fsdp_parallelism=4", "ici_expert_parallelism=2"}, 8, true, NULL},
    {"fsdp=2 expert=4", {"ici_fsdp_parallelism=2", "ici_expert_parallelism=4"}, 8, true, NULL},
    {"data=2 fsdp=2 expert=2",
     {"ici_data_parallelism=2", "ici_fsdp_parallelism=2", "ici_expert_parallelism=2"},
     8,
     true,
     NULL},
    {"fsdp=2 tensor=2 expert=2",
     {"ici_fsdp_parallelism=2", "ici_tensor_parallelism=2", "ici_expert_parallelism=2"},
     8,
     true,
     TENSOR_ERR},
    {"fsdp=2 context=2 expert=2",
     {"ici_fsdp_parallelism=2", "ici_context_parallelism=2", "ici_expert_parallelism=2"},
     8,
     true,
     QK_ERR},
    /* the other custom rule sets, against the 1-device run */
    {"cp-as-ep fsdp=2 context=2 expert=2",
     {"custom_mesh_and_rule=cp-as-ep", "ici_fsdp_parallelism=2", "ici_context_parallelism=2",
      "ici_expert_parallelism=2"},
     8,
     false,
     NULL},
    {"ep-as-dp fsdp=4 expert=2",
     {"custom_mesh_and_rule=ep-as-dp", "ici_fsdp_parallelism=4", "ici_expert_parallelism=2"},
     8,
     false,
     NULL},
    {"pure-fsdp fsdp=8", {"custom_mesh_and_rule=pure-fsdp", "ici_fsdp_parallelism=8"}, 8, false, NULL},
    {"pipeline-large-moe fsdp=2 tensor=2 expert=2",
     {"custom_mesh_and_rule=pipeline-large-moe", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2",
      "ici_expert_parallelism=2"},
     8,
     false,
     NULL},
};
enum { NMESH = sizeof MESHES / sizeof MESHES[0] };

static void parity_path(bool dense)
{
    const char *path = dense ? DENSE_PATH : "capacity_factor=-1";
    model_run ref;
    train_run(&ref, &path, 1, 1);
    /* the loss moves: parity over steps that compare nothing would be empty */
    assert_true(fabs(ref.job.stats[STEPS - 1].loss - ref.job.stats[0].loss) > 0.05);
    for (int mi = 0; mi < NMESH; mi++)
        for (int mode = 0; mode < (MESHES[mi].explicit_too ? 2 : 1); mode++) {
            const char *extra[8];
            int n = 0;
            extra[n++] = path;
            for (int f = 0; f < 5 && MESHES[mi].flags[f]; f++) extra[n++] = MESHES[mi].flags[f];
            extra[n++] = mode ? "shard_mode=explicit" : "shard_mode=auto";
            char what[160];
            snprintf(what, sizeof what, "%s %s %s", dense ? "dense" : "sparse", MESHES[mi].label, extra[n - 1]);
            if (mode && MESHES[mi].explicit_err) {
                train_expect_error(extra, n, MESHES[mi].devices, MESHES[mi].explicit_err, what);
                continue;
            }
            model_run r;
            train_run(&r, extra, n, MESHES[mi].devices);
            compare_runs(what, &r, &ref);
            model_run_close(&r);
        }
    /* fractional per_device_batch_size (facts §9.2): 8 rows loaded, the first 4 trained on,
     * against 4 rows on 1 device */
    model_run ref4;
    const char *r4[] = {path, "per_device_batch_size=4"};
    train_run(&ref4, r4, 2, 1);
    static const char *const frac[2][5] = {
        {"per_device_batch_size=0.5", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2", "ici_expert_parallelism=2"},
        {"per_device_batch_size=0.5", "custom_mesh_and_rule=pipeline-large-moe", "ici_fsdp_parallelism=2",
         "ici_context_parallelism=2", "ici_expert_parallelism=2"}};
    for (int fi = 0; fi < 2; fi++)
        for (int mode = 0; mode < 2; mode++) {
            const char *extra[8];
            int n = 0;
            extra[n++] = path;
            for (int f = 0; f < 5 && frac[fi][f]; f++) extra[n++] = frac[fi][f];
            extra[n++] = mode ? "shard_mode=explicit" : "shard_mode=auto";
            char what[200];
            snprintf(what, sizeof what, "%s fractional batch %s %s", dense ? "dense" : "sparse", frac[fi][1],
                     extra[n - 1]);
            if (mode) { /* tensor=2 (q_norm) and context=2 (dot-product attention): MaxText fails */
                train_expect_error(extra, n, 8, fi == 0 ? TENSOR_ERR : QK_ERR, what);
                continue;
            }
            model_run r;
            train_run(&r, extra, n, 8);
            compare_runs(what, &r, &ref4);
            model_run_close(&r);
        }
    model_run_close(&ref4);
    /* MaxText's checks of two rule sets against the base rules */
    for (int mode = 0; mode < 2; mode++) {
        const char *md = mode ? "shard_mode=explicit" : "shard_mode=auto";
        const char *base_cp[] = {path, "ici_fsdp_parallelism=2", "ici_context_parallelism=2", md};
        const char *ep_cp[] = {path, "custom_mesh_and_rule=ep-as-cp", "ici_fsdp_parallelism=2",
                               "ici_expert_parallelism=2", md};
        model_run a, b;
        char what[160];
        snprintf(what, sizeof what, "%s ep-as-cp fsdp=2 expert=2 vs base fsdp=2 context=2 %s",
                 dense ? "dense" : "sparse", md);
        if (mode) { /* both shard the sequence: dot-product attention fails in MaxText */
            train_expect_error(base_cp, 4, 4, QK_ERR, what);
            train_expect_error(ep_cp, 5, 4, QK_ERR, what);
        } else {
            train_run(&a, base_cp, 4, 4);
            train_run(&b, ep_cp, 5, 4);
            compare_runs(what, &b, &a);
            compare_runs(what, &b, &ref);
            model_run_close(&a);
            model_run_close(&b);
        }
        const char *base_ep[] = {path, "ici_fsdp_parallelism=4", "ici_expert_parallelism=2", md};
        const char *sef[] = {path, "custom_mesh_and_rule=shard-exp-on-fsdp", "ici_fsdp_parallelism=4",
                             "ici_expert_parallelism=2", md};
        train_run(&a, base_ep, 4, 8);
        train_run(&b, sef, 5, 8);
        snprintf(what, sizeof what, "%s shard-exp-on-fsdp vs base fsdp=4 expert=2 %s", dense ? "dense" : "sparse", md);
        compare_runs(what, &b, &a);
        model_run_close(&a);
        model_run_close(&b);
    }
    model_run_close(&ref);
}

static void test_parity_sparse(void **state)
{
    (void)state;
    worst_loss = worst_grad = 0;
    memset(worst_step, 0, sizeof worst_step);
    parity_path(false);
    printf("  sparse path: largest relative difference over all meshes and steps: loss %.2e, gradient %.2e (%s)\n",
           worst_loss, worst_grad, worst_where);
    for (int s = 0; s < STEPS; s++) printf("    step %d: gradient %.2e\n", s, worst_step[s]);
}

static void test_parity_dense(void **state)
{
    (void)state;
    worst_loss = worst_grad = 0;
    memset(worst_step, 0, sizeof worst_step);
    parity_path(true);
    printf("  dense path: largest relative difference over all meshes and steps: loss %.2e, gradient %.2e (%s)\n",
           worst_loss, worst_grad, worst_where);
}

/* ------------------------------------------------------------ the MoE region alone */

enum { RB = 8, RS = 4, RM = 8, RH = 4, RE = 8, RK = 2 };

typedef struct {
    mesh_shape mesh;
    int ep_axis;                /* mesh axis of 'expert' */
    float x[RB * RS * RM];      /* global inputs */
    float scores[RB * RS * RE]; /* global router scores (distinct per token) */
    float w0[RE * RM * RH], w1[RE * RM * RH], wo[RE * RH * RM];
    float out[RB * RS * RM]; /* device result, gathered */
    int64_t dispatch_sent[8], return_sent[8], dispatch_bwd_sent[8], return_bwd_sent[8];
} region_job;

static sim_status region_device(sim_device *dev, void *arg)
{
    region_job *j = arg;
    mesh_ctx ctx = {.dev = dev, .mesh = &j->mesh, .mode = MESH_MODE_AUTO, .drop_size_one = true, .layer = "moe_test"};
    mesh_tape *t = mesh_tape_new(&ctx, true);
    mesh_spec tok, rep;
    SIM_TRY(mesh_spec_parse("P(('fsdp', 'expert'), None, None)", &j->mesh, &tok));
    mesh_spec_init(&rep, 3);
    int64_t xs[3] = {RB, RS, RM}, ss[3] = {RB, RS, RE}, w0s[3] = {RE, RM, RH}, wos[3] = {RE, RH, RM};
    mesh_array xa, sa, w0a, w1a, woa;
    SIM_TRY(mesh_array_new(dev, &j->mesh, "x", 3, xs, &tok, SIM_F32, SIM_MEM_ACTIVATIONS, &xa));
    SIM_TRY(mesh_array_new(dev, &j->mesh, "scores", 3, ss, &tok, SIM_F32, SIM_MEM_ACTIVATIONS, &sa));
    SIM_TRY(mesh_array_new(dev, &j->mesh, "w0", 3, w0s, &rep, SIM_F32, SIM_MEM_PARAMS, &w0a));
    SIM_TRY(mesh_array_new(dev, &j->mesh, "w1", 3, w0s, &rep, SIM_F32, SIM_MEM_PARAMS, &w1a));
    SIM_TRY(mesh_array_new(dev, &j->mesh, "wo", 3, wos, &rep, SIM_F32, SIM_MEM_PARAMS, &woa));
    mesh_array_load_global(dev, &j->mesh, &xa, j->x);
    mesh_array_load_global(dev, &j->mesh, &sa, j->scores);
    mesh_array_load_global(dev, &j->mesh, &w0a, j->w0);
    mesh_array_load_global(dev, &j->mesh, &w1a, j->w1);
    mesh_array_load_global(dev, &j->mesh, &woa, j->wo);
    mesh_var *x = mesh_tape_input(t, &xa, true), *s = mesh_tape_input(t, &sa, true),
             *w0 = mesh_tape_input(t, &w0a, true), *w1 = mesh_tape_input(t, &w1a, true),
             *wo = mesh_tape_input(t, &woa, true), *weights, *indices, *out, *loss;
    model_moe_route_cfg rc = {.k = RK, .sigmoid = true, .scaling = 2.5, .bias_selects_only = true};
    SIM_TRY(model_moe_route(t, s, NULL, &rc, "routing", &weights, &indices));
    model_moe_cfg mc;
    memset(&mc, 0, sizeof mc);
    mc.ep = sim_axes_1(j->ep_axis);
    mc.out = tok;
    SIM_TRY(model_moe_experts(t, x, weights, indices, w0, w1, wo, &mc, "moe", &out));
    SIM_TRY(mesh_array_store_global(dev, &j->mesh, &out->val, j->out));
    SIM_TRY(mesh_nn_mean(t, out, "mean", &loss));
    sim_device_set_phase(dev, SIM_PHASE_BACKWARD);
    SIM_TRY(mesh_tape_backward(t, loss));
    size_t n;
    const sim_record *r = sim_device_records(dev, &n);
    int id = sim_device_id(dev);
    for (size_t i = 0; i < n; i++) {
        if (r[i].op != SIM_OP_RAGGED_ALL_TO_ALL) continue;
        int64_t *slot = strstr(r[i].tag, "dispatch_bwd") ? j->dispatch_bwd_sent
                        : strstr(r[i].tag, "return_bwd") ? j->return_bwd_sent
                        : strstr(r[i].tag, "dispatch")   ? j->dispatch_sent
                                                         : j->return_sent;
        slot[id] += (int64_t)r[i].bytes_sent;
    }
    mesh_tape_free(t);
    mesh_array *all[5] = {&xa, &sa, &w0a, &w1a, &woa};
    for (int i = 0; i < 5; i++) mesh_array_free(dev, all[i]);
    return SIM_OK;
}

static void test_region_routing_and_bytes(void **state)
{
    (void)state;
    static region_job j;
    memset(&j, 0, sizeof j);
    const char *names[] = {"fsdp", "expert"};
    int sizes[] = {2, 4};
    assert_int_equal(mesh_shape_init(&j.mesh, 2, names, sizes), SIM_OK);
    j.ep_axis = 1;
    for (int i = 0; i < RB * RS * RM; i++) j.x[i] = helper_det_val((uint32_t)i, 1.0f);
    for (int i = 0; i < RE * RM * RH; i++) {
        j.w0[i] = helper_det_val((uint32_t)i + 1000, 0.5f);
        j.w1[i] = helper_det_val((uint32_t)i + 2000, 0.5f);
        j.wo[i] = helper_det_val((uint32_t)i + 3000, 0.5f);
    }
    /* scores: a random permutation of 8 well-separated levels per token */
    for (int t = 0; t < RB * RS; t++)
        for (int e = 0; e < RE; e++) j.scores[t * RE + e] = 0.05f + 0.1f * (float)((e * 5 + t * 3 + (t / 3)) % RE);
    sim_machine *m = helper_machine(&j.mesh, false);
    if (sim_machine_run(m, region_device, &j) != SIM_OK) fail_msg("region: %s", sim_errmsg());
    sim_machine_free(m);
    /* independent routing: top-2 of each token's scores, weights renormalised x 2.5 */
    int64_t cross[8] = {0}, into[8] = {0};
    double maxerr = 0;
    for (int t = 0; t < RB * RS; t++) {
        const float *s = j.scores + t * RE;
        int e1 = 0, e2 = -1;
        for (int e = 1; e < RE; e++)
            if (s[e] > s[e1]) e1 = e;
        for (int e = 0; e < RE; e++)
            if (e != e1 && (e2 < 0 || s[e] > s[e2])) e2 = e;
        int sel[2] = {e1, e2};
        double wsum = s[e1] + s[e2], ref[RM] = {0};
        int dev = t / RS, dev_ep = dev % 4; /* rows (fsdp, expert): one row of RS tokens per device */
        for (int jj = 0; jj < 2; jj++) {
            int e = sel[jj], owner = e / 2; /* 2 experts per expert rank */
            if (owner != dev_ep) {
                cross[dev]++;
                into[(dev / 4) * 4 + owner]++;
            }
            double w = s[e] / wsum * 2.5, h[RH];
            for (int c = 0; c < RH; c++) {
                double a = 0, b = 0;
                for (int r = 0; r < RM; r++) {
                    a += (double)j.x[t * RM + r] * j.w0[(e * RM + r) * RH + c];
                    b += (double)j.x[t * RM + r] * j.w1[(e * RM + r) * RH + c];
                }
                h[c] = a / (1 + exp(-a)) * b;
            }
            for (int r = 0; r < RM; r++) {
                double y = 0;
                for (int c = 0; c < RH; c++) y += h[c] * j.wo[(e * RH + c) * RM + r];
                ref[r] += w * y;
            }
        }
        for (int r = 0; r < RM; r++) {
            double err = fabs(ref[r] - j.out[t * RM + r]);
            if (err > maxerr) maxerr = err;
        }
    }
    printf("  MoE region vs host reference: max abs error %.2e\n", maxerr);
    assert_true(maxerr < 1e-5);
    int64_t row = RM * 4, total = 0;
    for (int d = 0; d < 8; d++) {
        /* forward: my rows leave once; the rows I served go back; backward mirrors it */
        assert_int_equal(j.dispatch_sent[d], cross[d] * row);
        assert_int_equal(j.return_sent[d], into[d] * row);
        assert_int_equal(j.return_bwd_sent[d], cross[d] * row);
        assert_int_equal(j.dispatch_bwd_sent[d], into[d] * row);
        total += cross[d];
    }
    printf("  ragged all-to-all: %lld routed rows crossed devices, bytes equal rows x %lld B on every device\n",
           (long long)total, (long long)row);
    assert_true(total > 0);
}

/* ------------------------------------------------------------ dry run */

static void dry_vs_real(bool dense)
{
    const char *base[] = {dense ? DENSE_PATH : "capacity_factor=-1",
                          "ici_fsdp_parallelism=2",
                          "ici_tensor_parallelism=2",
                          "ici_expert_parallelism=2",
                          "steps=1",
                          "dry_run=false"};
    model_run a, b;
    train_run_opt(&a, base, 6, 8, false);
    base[5] = "dry_run=true";
    train_run_opt(&b, base, 6, 8, false);
    /* the sparse path's ragged exchanges follow the routing, which is data: a dry run has none */
    model_run_expect_same_records(dense ? "dense" : "sparse", &a, &b, 8, dense ? 0 : MODEL_RUN_DATA_ROUTED);
    model_run_close(&a);
    model_run_close(&b);
}

static void test_dry_run(void **state)
{
    (void)state;
    dry_vs_real(true);
    dry_vs_real(false);
}

/* Full-size models size on a laptop: one dry step of deepseek3-test (61 layers) and
 * deepseek3-671b on 8 devices, shapes and traffic only. */
static void test_full_size_dry_runs(void **state)
{
    (void)state;
    static const char *const models[2] = {"model_name=deepseek3-test", "model_name=deepseek3-671b"};
    for (int i = 0; i < 2; i++) {
        const char *argv[] = {models[i], "ici_fsdp_parallelism=4",  "ici_expert_parallelism=2", "dry_run=true",
                              "steps=1", "per_device_batch_size=1", "max_target_length=512"};
        cfg_config *cfg;
        assert_int_equal(cfg_load_argv("configs/base.yml", 7, argv, &cfg), SIM_OK);
        model_def *def = calloc(1, sizeof *def);
        if (model_def_from_config(cfg, def) != SIM_OK) fail_msg("%s: %s", models[i], sim_errmsg());
        model_data data;
        model_train_job job;
        memset(&job, 0, sizeof job);
        if (model_data_from_config(cfg, &data) || model_optim_from_config(cfg, &job.opt)) fail_msg("%s", sim_errmsg());
        sim_machine *m;
        assert_int_equal(model_machine_new(def, 0, false, &m), SIM_OK);
        job.def = def;
        job.data = &data;
        job.steps = 1;
        job.stats = calloc(1, sizeof *job.stats);
        if (model_train(&job, m) != SIM_OK) fail_msg("%s: %s", models[i], sim_errmsg());
        /* every device holds at least its eighth of the parameters, gradients and both Adam moments */
        double state_bytes = 4.0 * (double)model_param_bytes(def) / 8;
        printf("  %s dry run on 8 devices: peak %.1f GiB per device (parameters %.2f B)\n", models[i] + 11,
               (double)job.stats[0].peak_bytes / (1 << 30), (double)model_param_bytes(def) / 4e9);
        assert_true((double)job.stats[0].peak_bytes > state_bytes);
        free(job.stats);
        sim_machine_free(m);
        model_data_close(&data);
        model_run_unload(def);
        cfg_free(cfg);
    }
}

/* ------------------------------------------------------------ errors */

static void test_experts_refused(void **state)
{
    (void)state;
    const char *argv[NTINY + 4];
    int argc = 0;
    for (int i = 0; i < NTINY; i++) argv[argc++] = TINY[i];
    argv[argc++] = "num_experts=6";
    argv[argc++] = "ici_expert_parallelism=4";
    argv[argc++] = "ici_fsdp_parallelism=2";
    argv[argc++] = "per_device_batch_size=1";
    cfg_config *cfg;
    assert_int_equal(cfg_load_argv("configs/base.yml", argc, argv, &cfg), SIM_OK);
    model_def *def = calloc(1, sizeof *def);
    assert_int_equal(model_def_from_config(cfg, def), SIM_ERR_INPUT);
    assert_non_null(strstr(sim_errmsg(), "num_experts=6"));
    assert_non_null(strstr(sim_errmsg(), "expert=4"));
    assert_non_null(strstr(sim_errmsg(), "ici_expert_parallelism"));
    cfg_free(cfg);
    model_def_free(def);
    free(def);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_gradient_mla_dense),
        cmocka_unit_test(test_gradient_moe),
        cmocka_unit_test(test_region_routing_and_bytes),
        cmocka_unit_test(test_parity_sparse),
        cmocka_unit_test(test_parity_dense),
        cmocka_unit_test(test_dry_run),
        cmocka_unit_test(test_full_size_dry_runs),
        cmocka_unit_test(test_experts_refused),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
