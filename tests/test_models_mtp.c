/* test_models_mtp.c — DeepSeek-V3's multi-token prediction (mtp_num_layers,
 * mtp_loss_scaling_factor; MaxText layers/multi_token_prediction.py) on a
 * small deepseek3-tiny variant:
 *   - parameters: MaxText's names under params.mtp_block.mtp_layer_<k> with
 *     their logical axes, the transformer layer unscanned;
 *   - the loss composition by hand: with every MTP final norm's scale set to
 *     0 the MTP logits are 0, so each counted position's cross-entropy is
 *     ln(vocab) exactly and the loss must be the main loss (the same
 *     parameters without MTP) + mtp_loss_scaling_factor x ln(vocab), for 1 and
 *     2 MTP layers (the pooled average over layers and positions);
 *   - the reported MTP part of the loss (learning/mtp_loss): loss minus it
 *     is the loss without MTP;
 *   - the MTP parameters' gradients against central finite differences;
 *   - parity over 5 training steps (loss and every gradient, rtol 1e-4) with
 *     the 1-device run on fsdp=4 expert=2, in auto and explicit mode, and with
 *     2 MTP layers in auto mode;
 *   - refusals naming the key: llama2, pipeline, gradient accumulation,
 *     mtp_reuse_input_embedding, the MTP gate bias update
 *     (routed_bias_update_rate), a sharded sequence (context parallelism). */
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

#include "models/core/train.h"
#include "tests/helpers.h"
#include "tests/model_run.h"

/* tests/data/tiny-deepseek.yml (1 dense + 2 MoE layers, 8 experts top-2, MLA with q_lora, sigmoid
 * routing with the bias: DeepSeek-V3 routing) with the MoE parity knobs of tests/data/moe-training.yml */
static const char *const TINY[] = {TINY_DEEPSEEK_YML, MOE_TRAINING_YML};
enum { NTINY = sizeof TINY / sizeof TINY[0], ROWS = 8, SEQ = 16, VOCAB = 64, EMB = 32, STEPS = 5 };

static model_def *load(const char *const *extra, int n_extra, int devices, cfg_config **cfg_out)
{
    return model_run_load(TINY, NTINY, ROWS, extra, n_extra, devices, 0, cfg_out);
}

static int param_ix(const model_def *def, const char *path)
{
    for (int i = 0; i < def->nparams; i++)
        if (!strcmp(def->defs[i].path, path)) return i;
    return -1;
}

/* ------------------------------------------------------------ parameters */

static void test_parameters(void **state)
{
    (void)state;
    const char *extra[] = {"mtp_num_layers=2"};
    model_def *def = load(extra, 1, 1, NULL);
    model_def *plain = load(NULL, 0, 1, NULL);
    static const struct {
        const char *path;
        int rank;
        int64_t shape[3];
        const char *logical[3];
    } want[] = {
        {"params.mtp_block.mtp_layer_1.mtp_1_embedding_norm.scale", 1, {EMB}, {"norm"}},
        {"params.mtp_block.mtp_layer_1.mtp_1_hidden_state_norm.scale", 1, {EMB}, {"norm"}},
        {"params.mtp_block.mtp_layer_1.mtp_1_projection.kernel", 2, {2 * EMB, EMB}, {"embed", NULL}},
        {"params.mtp_block.mtp_layer_1.mtp_1_final_norm.scale", 1, {EMB}, {"norm"}},
        {"params.mtp_block.mtp_layer_2.mtp_2_projection.kernel", 2, {2 * EMB, EMB}, {"embed", NULL}},
        /* the transformer layer: the decoder's MoE layer without the stack dim */
        {"params.mtp_block.mtp_layer_1.mtp_1_transformer_layer.self_attention.wq_a.kernel",
         2,
         {EMB, 16},
         {"embed_attn", "q_lora_up_proj"}},
        {"params.mtp_block.mtp_layer_2.mtp_2_transformer_layer.DeepSeekMoeBlock_0.MoeBlock_0.wi_0",
         3,
         {8, EMB, 16},
         {"exp", "embed_moe", "mlp_moe"}},
        {"params.mtp_block.mtp_layer_2.mtp_2_transformer_layer.post_self_attention_layer_norm.scale",
         1,
         {EMB},
         {"norm"}},
        /* DeepSeek-V3's gate bias: a MoEBiasVar of (experts,) with (None,), as MaxText's dump shows */
        {"params.mtp_block.mtp_layer_1.mtp_1_transformer_layer.DeepSeekMoeBlock_0.MoeBlock_0.gate.bias",
         1,
         {8},
         {NULL}},
    };
    for (size_t w = 0; w < sizeof want / sizeof want[0]; w++) {
        int i = param_ix(def, want[w].path);
        if (i < 0) fail_msg("no parameter %s", want[w].path);
        const model_param_def *d = &def->defs[i];
        assert_int_equal(d->rank, want[w].rank);
        assert_int_equal(d->scan_dim, -1);
        for (int k = 0; k < d->rank; k++) {
            assert_int_equal(d->shape[k], want[w].shape[k]);
            if (want[w].logical[k]) assert_string_equal(d->logical[k], want[w].logical[k]);
            else assert_null(d->logical[k]);
        }
    }
    /* every decoder MoE-layer parameter has its MTP twin in each layer; nothing else is added */
    int moe = 0;
    for (int i = 0; i < plain->nparams; i++) {
        const char *p = plain->defs[i].path;
        if (strncmp(p, "params.decoder.moe_layers.", 26)) continue;
        moe++;
        for (int k = 1; k <= 2; k++) {
            char twin[256];
            snprintf(twin, sizeof twin, "params.mtp_block.mtp_layer_%d.mtp_%d_transformer_layer.%s", k, k, p + 26);
            int j = param_ix(def, twin);
            if (j < 0) fail_msg("no MTP twin %s", twin);
            assert_int_equal(def->defs[j].rank, plain->defs[i].rank - 1);
        }
    }
    assert_int_equal(def->nparams, plain->nparams + 2 * (moe + 4));
    model_run_unload(def);
    model_run_unload(plain);
}

/* ------------------------------------------------------------ the loss by hand */

static void test_loss_composition(void **state)
{
    (void)state;
    model_run_batch b;
    model_run_batch_make(&b, ROWS, SEQ, VOCAB);
    const double f = 0.3;
    /* no load-balance loss: with MTP its mean runs over one more MoE layer */
    const char *plain_x[] = {"load_balance_loss_weight=0"};
    model_def *plain = load(plain_x, 1, 1, NULL);
    for (int K = 1; K <= 2; K++) {
        char k_arg[32];
        snprintf(k_arg, sizeof k_arg, "mtp_num_layers=%d", K);
        const char *extra[] = {"load_balance_loss_weight=0", k_arg, "mtp_loss_scaling_factor=0.3"};
        model_def *def = load(extra, 3, 1, NULL);
        model_grads params;
        double with_init = model_run_loss_grads(def, b.in, b.tg, b.pos, NULL, &params, NULL);
        for (int k = 1; k <= K; k++) {
            char p[128];
            snprintf(p, sizeof p, "params.mtp_block.mtp_layer_%d.mtp_%d_final_norm.scale", k, k);
            int i = param_ix(def, p);
            assert_true(i >= 0);
            memset(params.g[i], 0, (size_t)params.layer_elems[i] * sizeof(float));
        }
        double with_mtp = model_run_loss_grads(def, b.in, b.tg, b.pos, &params, NULL, NULL);
        /* the main model's parameters come first, in the same order */
        model_grads main_params = params;
        main_params.n = plain->nparams;
        for (int i = 0; i < plain->nparams; i++) assert_string_equal(plain->defs[i].path, def->defs[i].path);
        double main_loss = model_run_loss_grads(plain, b.in, b.tg, b.pos, &main_params, NULL, NULL);
        double want = main_loss + f * log((double)VOCAB);
        printf("  %d MTP layer(s), final norms zeroed: loss %.7f = main %.7f + %.1f x ln(%d) (%.7f); with the "
               "initial norms %.7f\n",
               K, with_mtp, main_loss, f, VOCAB, want, with_init);
        assert_true(fabs(with_mtp - want) < 2e-6 * want);
        /* with trained-from-init norms the MTP head predicts something: a different, finite loss */
        assert_true(isfinite(with_init) && fabs(with_init - want) > 1e-4);
        model_grads_free(&params);
        model_run_unload(def);
    }
    model_run_unload(plain);
}

/* The training loop reports the MTP part of the loss (MaxText's learning/mtp_loss): the step-0
 * loss minus it is the loss of the same model without MTP. */
static void test_reported(void **state)
{
    (void)state;
    const char *with[] = {"load_balance_loss_weight=0", "mtp_num_layers=1", "mtp_loss_scaling_factor=0.3"};
    const char *without[] = {"load_balance_loss_weight=0"};
    model_run a, b;
    model_run_open(&a, TINY, NTINY, ROWS, with, 3, 1, 1);
    model_run_train(&a, false);
    model_run_open(&b, TINY, NTINY, ROWS, without, 1, 1, 1);
    model_run_train(&b, false);
    double l = a.job.stats[0].loss, m = a.job.stats[0].mtp_loss, main_loss = b.job.stats[0].loss;
    printf("  step 0: loss %.7f, of which MTP %.7f; without MTP %.7f\n", l, m, main_loss);
    assert_true(fabs((l - m) - main_loss) < 2e-6 * main_loss);
    assert_true(m > 0 && m / 0.3 < 2 * log((double)VOCAB)); /* a cross-entropy near ln(vocab) at init */
    assert_true(b.job.stats[0].mtp_loss == 0);
    model_run_close(&a);
    model_run_close(&b);
}

/* ------------------------------------------------------------ gradients */

/* Central finite differences of the loss against the backward pass for the largest gradient
 * element of each named parameter; returns how many were skipped (routing flipped in [-h, h]). */
static int check_gradients(const char *const *extra, int n_extra, const char *const *names, int nnames)
{
    model_run_batch b;
    model_run_batch_make(&b, ROWS, SEQ, VOCAB);
    model_def *def = load(extra, n_extra, 1, NULL);
    model_grads params, grads;
    model_run_loss_grads(def, b.in, b.tg, b.pos, NULL, &params, &grads);
    int checked = 0, skipped = 0;
    for (int n = 0; n < nnames; n++) {
        int i = param_ix(def, names[n]);
        if (i < 0) fail_msg("no parameter %s", names[n]);
        int64_t cnt = params.layer_elems[i] * params.n_layers[i], best = 0;
        for (int64_t j = 1; j < cnt; j++)
            if (fabsf(grads.g[i][j]) > fabsf(grads.g[i][best])) best = j;
        float g = grads.g[i][best], saved = params.g[i][best];
        assert_true(fabsf(g) > 1e-5f); /* the MTP loss reaches the parameter */
        double fds[2];
        for (int hi = 0; hi < 2; hi++) {
            const double h = hi ? 5e-3 : 1e-2;
            params.g[i][best] = saved + (float)h;
            double lp = model_run_loss_grads(def, b.in, b.tg, b.pos, &params, NULL, NULL);
            params.g[i][best] = saved - (float)h;
            double lm = model_run_loss_grads(def, b.in, b.tg, b.pos, &params, NULL, NULL);
            params.g[i][best] = saved;
            fds[hi] = (lp - lm) / (2 * h);
        }
        double fd = fds[1];
        /* a routing decision flipped inside [-h, h]: the loss is not smooth there; only what feeds a
         * router can flip one (never the final norm or the shared experts) */
        if (fabs(fds[0] - fds[1]) > 0.02 * fabs(fds[1]) + 2e-5) {
            if (strstr(names[n], "final_norm") || strstr(names[n], "shared_experts"))
                fail_msg("%s: the loss is not smooth (%.6g at h, %.6g at h/2) downstream of the routing", names[n],
                         fds[0], fds[1]);
            skipped++;
            continue;
        }
        if (fabs(fd - g) > 0.02 * fabs(g) + 2e-5)
            fail_msg("%s element %lld: backward %.6g, finite differences %.6g", names[n], (long long)best, g, fd);
        checked++;
    }
    printf("  %d MTP-path gradients match central finite differences within 2%% (%d skipped: routing flips)\n", checked,
           skipped);
    model_grads_free(&params);
    model_grads_free(&grads);
    model_run_unload(def);
    return skipped;
}

static void test_gradients(void **state)
{
    (void)state;
    /* MoE layers: the MTP layer is a MoE layer */
    const char *moe[] = {"mtp_num_layers=1", "mtp_loss_scaling_factor=0.5"};
    static const char *const moe_names[] = {
        "params.mtp_block.mtp_layer_1.mtp_1_embedding_norm.scale",
        "params.mtp_block.mtp_layer_1.mtp_1_hidden_state_norm.scale",
        "params.mtp_block.mtp_layer_1.mtp_1_projection.kernel",
        "params.mtp_block.mtp_layer_1.mtp_1_final_norm.scale",
        "params.mtp_block.mtp_layer_1.mtp_1_transformer_layer.self_attention.out.kernel",
        "params.mtp_block.mtp_layer_1.mtp_1_transformer_layer.DeepSeekMoeBlock_0.shared_experts.wo.kernel",
        "params.mtp_block.mtp_layer_1.mtp_1_transformer_layer.DeepSeekMoeBlock_0.MoeBlock_0.wo",
    };
    check_gradients(moe, 2, moe_names, 7);
    /* dense layers only: nothing can flip, every check counts */
    const char *dense[] = {"mtp_num_layers=2", "mtp_loss_scaling_factor=0.5", "first_num_dense_layers=3"};
    static const char *const dense_names[] = {
        "params.mtp_block.mtp_layer_1.mtp_1_embedding_norm.scale",
        "params.mtp_block.mtp_layer_1.mtp_1_hidden_state_norm.scale",
        "params.mtp_block.mtp_layer_1.mtp_1_projection.kernel",
        "params.mtp_block.mtp_layer_2.mtp_2_projection.kernel",
        "params.mtp_block.mtp_layer_2.mtp_2_final_norm.scale",
        "params.mtp_block.mtp_layer_1.mtp_1_transformer_layer.mlp.wi_0.kernel",
        "params.token_embedder.embedding",
        "params.decoder.dense_layers.mlp.wo.kernel",
    };
    assert_int_equal(check_gradients(dense, 3, dense_names, 8), 0);
}

/* ------------------------------------------------------------ parity */

/* Loss and every gradient of every step within rtol 1e-4 of the reference. */
static void compare(const char *what, const model_run *a, const model_run *ref)
{
    model_run_compare(what, a, ref, STEPS);
}

static void test_parity(void **state)
{
    (void)state;
    for (int K = 1; K <= 2; K++) {
        char k_arg[32];
        snprintf(k_arg, sizeof k_arg, "mtp_num_layers=%d", K);
        const char *one[] = {k_arg};
        model_run ref;
        model_run_open(&ref, TINY, NTINY, ROWS, one, 1, 1, STEPS);
        model_run_train(&ref, true);
        assert_true(fabs(ref.job.stats[STEPS - 1].loss - ref.job.stats[0].loss) > 0.05);
        for (int mode = 0; mode < (K == 1 ? 2 : 1); mode++) {
            const char *extra[] = {k_arg, "ici_fsdp_parallelism=4", "ici_expert_parallelism=2",
                                   mode ? "shard_mode=explicit" : "shard_mode=auto"};
            model_run r;
            model_run_open(&r, TINY, NTINY, ROWS, extra, 4, 8, STEPS);
            model_run_train(&r, true);
            char what[96];
            snprintf(what, sizeof what, "mtp_num_layers=%d fsdp=4 expert=2 %s", K, extra[3]);
            compare(what, &r, &ref);
            model_run_close(&r);
        }
        model_run_close(&ref);
    }
}

/* ------------------------------------------------------------ refusals */

static void expect_refused(const char *const *extra, int n, int devices, const char *key, const char *also)
{
    model_run_expect_refused(TINY, NTINY, ROWS, extra, n, devices, key, also);
}

static void test_refused(void **state)
{
    (void)state;
    const char *llama[] = {"model_name=default", "decoder_block=llama2", "attention_type=global", "mtp_num_layers=1"};
    expect_refused(llama, 4, 1, "mtp_num_layers=1", "decoder_block=deepseek");
    const char *pp[] = {"mtp_num_layers=1", "ici_pipeline_parallelism=2", "first_num_dense_layers=1"};
    expect_refused(pp, 3, 2, "mtp_num_layers", "pipeline");
    const char *ga[] = {"mtp_num_layers=1", "gradient_accumulation_steps=2"};
    expect_refused(ga, 2, 1, "mtp_num_layers", "gradient_accumulation_steps");
    const char *reuse[] = {"mtp_num_layers=1", "mtp_reuse_input_embedding=true"};
    expect_refused(reuse, 2, 1, "mtp_reuse_input_embedding", "mtp_reuse_input_embedding=false");
    const char *rate[] = {"mtp_num_layers=1", "routed_bias_update_rate=0.001"};
    expect_refused(rate, 2, 1, "routed_bias_update_rate", "multi-token prediction");
    const char *big[] = {"mtp_num_layers=3"};
    expect_refused(big, 1, 1, "mtp_num_layers=3", "0 to 2");
    const char *cp[] = {"mtp_num_layers=1", "ici_context_parallelism=2", "ici_fsdp_parallelism=2"};
    expect_refused(cp, 3, 4, "mtp_num_layers=1", "context parallelism");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_parameters), cmocka_unit_test(test_loss_composition), cmocka_unit_test(test_reported),
        cmocka_unit_test(test_gradients),  cmocka_unit_test(test_parity),           cmocka_unit_test(test_refused),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
