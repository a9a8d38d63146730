/* family_check.c — the decoder-family tests' shared checks (see family_check.h). */
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

#include "cli/cli.h"
#include "config/json.h"
#include "tests/cli_capture.h"
#include "tests/dump_compare.h"
#include "tests/family_check.h"
#include "tests/helpers.h"
#include "tests/model_run.h"

enum { MAX_ARGS = 64 };

/* `shardsim train` with words and `more`, on hardware=cpu; fails the test unless it exits 0. */
static void train(const char *const *words, int nwords, const char *const *more, int nmore)
{
    const char *argv[MAX_ARGS];
    int argc = 0;
    if (nwords + nmore + 1 > MAX_ARGS) fail_msg("family_check: %d words, at most %d", nwords + nmore, MAX_ARGS - 1);
    for (int i = 0; i < nwords; i++) argv[argc++] = words[i];
    for (int i = 0; i < nmore; i++) argv[argc++] = more[i];
    argv[argc++] = "hardware=cpu";
    cli_capture r = cli_capture_run(cli_train, argc, argv);
    if (r.rc) fail_msg("shardsim train exit %d: %s", r.rc, r.err);
    cli_capture_free(&r);
}

void family_two_step_losses(const char *tag, const char *const *words, int nwords, double loss[2])
{
    /* the parameters: shardsim's after one step from its init (gen.sh), then both runs from them */
    char *dir = helper_tmpdir(tag);
    char ck[128], load[256], out[128], metrics[160], p0[160];
    snprintf(ck, sizeof ck, "checkpoint_dir=%s/ck", dir);
    snprintf(p0, sizeof p0, "%s/ck/step_0.safetensors", dir);
    snprintf(load, sizeof load, "load_parameters_path=%s", p0);
    snprintf(out, sizeof out, "output_dir=%s/out", dir);
    const char *make[] = {"steps=1", "learning_rate=1e-2", "enable_checkpointing=true", ck};
    train(words, nwords, make, 4);
    const char *run[] = {"steps=2", "learning_rate=1e-3", load, out};
    train(words, nwords, run, 4);
    snprintf(metrics, sizeof metrics, "%s/out/metrics.json", dir);
    cfg_json *ours = helper_read_json(NULL, metrics);
    const cfg_json *st = cfg_json_get(ours, "steps");
    assert_non_null(st);
    assert_int_equal(st->n, 2);
    for (int s = 0; s < 2; s++) loss[s] = cfg_json_get(&st->items[s], "loss")->number;
    cfg_json_free(ours);
    helper_rm_rf(dir);
    free(dir);
}

void family_check_overrides(const cfg_json *peer, const char *name, const char *const *words, int nwords)
{
    const cfg_json *ov = cfg_json_get(peer, "overrides");
    assert_non_null(ov);
    for (int i = 0; i < nwords; i++) {
        bool found = false;
        for (int j = 0; j < ov->n && !found; j++) found = !strcmp(ov->items[j].str, words[i]);
        if (!found) fail_msg("%s: MaxText's run did not get %s", name, words[i]);
    }
}

void family_check_losses(const char *tag, const char *const *base, int nbase, const family_loss_case *cases,
                         int ncases)
{
    for (int c = 0; c < ncases; c++) {
        const family_loss_case *lc = &cases[c];
        int nw = 0;
        while (nw < 6 && lc->words[nw]) nw++;
        char path[1200];
        snprintf(path, sizeof path, "%s/maxtext-0.2.5/losses/%s.json", helper_reference_dir(), lc->name);
        cfg_json *peer = helper_read_json(NULL, path);
        /* the measurement is of this configuration: every word given here was given to MaxText */
        const char *words[MAX_ARGS];
        if (nbase + nw > MAX_ARGS) fail_msg("family_check: %d words, at most %d", nbase + nw, MAX_ARGS);
        for (int i = 0; i < nbase + nw; i++) words[i] = i < nbase ? base[i] : lc->words[i - nbase];
        family_check_overrides(peer, lc->name, words, nbase + nw);
        const cfg_json *ml = cfg_json_get(peer, "losses");
        assert_non_null(ml);
        assert_int_equal(ml->n, 2);
        double ours[2];
        family_two_step_losses(tag, words, nbase + nw, ours);
        for (int s = 0; s < 2; s++) {
            double m = cfg_json_get(&ml->items[s], "loss")->number, o = ours[s];
            double rel = fabs(o - m) / fabs(m);
            printf("  %-36s step %d  shardsim %.9f  MaxText 0.2.5 %.9f  rel %.2e\n", lc->name, s, o, m, rel);
            if (rel > lc->rtol)
                fail_msg("%s step %d: shardsim %.9f, MaxText %.9f (rel %.2e > %.0e)", lc->name, s, o, m, rel, lc->rtol);
            if (s == 0 && lc->at_least > 0 && rel <= lc->at_least)
                fail_msg("%s: the known difference (%s) is gone (rel %.2e): make this case exact", lc->name,
                         lc->known ? lc->known : "?", rel);
        }
        /* after one step the loss moved by far more than the tolerance: the step itself is compared */
        double m0 = cfg_json_get(&ml->items[0], "loss")->number, m1 = cfg_json_get(&ml->items[1], "loss")->number;
        assert_true(fabs(m1 - m0) / fabs(m0) > 100 * lc->rtol || lc->at_least > 0);
        cfg_json_free(peer);
    }
}

int family_check_dump(const char *what, const char *model, const char *mesh, int nargs, const char *const *args)
{
    char gdir[1200];
    snprintf(gdir, sizeof gdir, "%s/maxtext-0.2.5/goldens/%s/cpu-8/%s", helper_reference_dir(), model, mesh);
    return dump_compare_025(what, gdir, nargs, args);
}

void family_check_parity(const char *const *tiny, int ntiny, int rows, int steps, const family_mesh *meshes,
                         int nmeshes)
{
    model_run ref;
    model_run_open(&ref, tiny, ntiny, rows, NULL, 0, 1, steps);
    model_run_train(&ref, true);
    for (int i = 0; i < nmeshes; i++) {
        int n = 0;
        char what[200] = "";
        size_t o = 0;
        while (n < 5 && meshes[i].words[n])
            o += (size_t)snprintf(what + o, sizeof what - o, "%s ", meshes[i].words[n++]);
        model_run r;
        model_run_open(&r, tiny, ntiny, rows, meshes[i].words, n, meshes[i].devices, steps);
        model_run_train(&r, true);
        model_run_compare(what, &r, &ref, steps);
        model_run_close(&r);
    }
    model_run_close(&ref);
}

void family_check_refusals(const char *const *tiny, int ntiny, const family_refusal *cases, int ncases)
{
    for (int i = 0; i < ncases; i++) {
        const char *argv[MAX_ARGS];
        int argc = 0;
        if (ntiny + 4 > MAX_ARGS) fail_msg("family_check: %d words, at most %d", ntiny, MAX_ARGS - 4);
        for (int k = 0; k < ntiny; k++) argv[argc++] = tiny[k];
        argv[argc++] = "steps=1";
        argv[argc++] = "per_device_batch_size=8";
        argv[argc++] = cases[i].word;
        if (cases[i].word2) argv[argc++] = cases[i].word2;
        cli_capture r = cli_capture_run(cli_train, argc, argv);
        if (r.rc != 2 || !strstr(r.err, cases[i].key) || !strstr(r.err, cases[i].also))
            fail_msg("%s: exit %d, expected 2 naming %s and '%s': %s", cases[i].word, r.rc, cases[i].key, cases[i].also,
                     r.err);
        cli_capture_free(&r);
    }
}

/* The refusals of model_dense_refuse and model_dense_setup every family of the dense layer makes. */
static const family_refusal DENSE_REFUSALS[] = {
    {"attention_type=mla", "attention_type", "global", NULL},
    {"attention_type=local_sliding", "sliding_window_size", "must be an integer > 0", NULL},
    {"attention_type=local_sliding", "attention_type", "never applies sliding_window_size", "sliding_window_size=8"},
    {"rope_type=yarn", "rope_type", "default", NULL},
    {"mtp_num_layers=1", "mtp_num_layers", "deepseek", NULL},
    {"use_batch_split_schedule=true", "use_batch_split_schedule", "deepseek", NULL},
};

void family_check_dense_refusals(const char *const *tiny, int ntiny, const family_refusal *own, int nown)
{
    family_check_refusals(tiny, ntiny, DENSE_REFUSALS, (int)(sizeof DENSE_REFUSALS / sizeof DENSE_REFUSALS[0]));
    family_check_refusals(tiny, ntiny, own, nown);
}

enum { MESHES_MAX = 32 };

void family_check_dense_parity(const char *const *tiny, int ntiny, int rows, int steps, const char *second,
                               const family_mesh *own, int nown)
{
    const family_mesh common[] = {
        {2, {"ici_data_parallelism=2"}},
        {4, {"ici_fsdp_parallelism=4"}},
        {2, {"ici_tensor_parallelism=2"}},
        {2, {"ici_context_parallelism=2"}},
        {4, {"ici_fsdp_parallelism=4", "shard_mode=explicit"}},
        {4, {"ici_data_parallelism=2", second, "shard_mode=explicit"}},
        /* a sharded sequence in explicit mode needs the flash kernel (MaxText's dot-product path refuses it) */
        {4,
         {"ici_fsdp_parallelism=2", "ici_context_parallelism=2", "shard_mode=explicit", "attention=flash",
          "hardware=tpu"}},
        {4, {"ici_fsdp_parallelism=2", second, "remat_policy=minimal", "shard_mode=explicit"}},
    };
    enum { NCOMMON = sizeof common / sizeof common[0] };
    family_mesh all[MESHES_MAX];
    if (NCOMMON + nown > MESHES_MAX) fail_msg("family_check: %d meshes, at most %d", NCOMMON + nown, MESHES_MAX);
    memcpy(all, common, sizeof common);
    memcpy(all + NCOMMON, own, (size_t)nown * sizeof *own);
    family_check_parity(tiny, ntiny, rows, steps, all, NCOMMON + nown);
}

void family_check_moe_parity(const char *const *tiny, int ntiny, int rows, int steps, const char *norm_word)
{
    const family_mesh moe[] = {
        {2, {"ici_expert_parallelism=2"}},
        {4, {"ici_fsdp_parallelism=2", "ici_expert_parallelism=2"}},
        {4, {"ici_expert_parallelism=2", "ici_tensor_parallelism=2", "sparse_matmul=false"}},
        {8, {"ici_data_parallelism=2", "ici_fsdp_parallelism=2", "ici_expert_parallelism=2", norm_word}},
    };
    family_check_dense_parity(tiny, ntiny, rows, steps, "ici_expert_parallelism=2", moe,
                              (int)(sizeof moe / sizeof moe[0]));
}

void family_check_routed_params(const model_def *def, const char *scope, int64_t emb, int64_t layers,
                                int64_t experts, int64_t width)
{
    char path[160];
    snprintf(path, sizeof path, "%s.gate.bias", scope);
    assert_int_equal(model_param_index(def, path), -1); /* routed_bias=false */
    assert_int_equal(model_param_index(def, "mlp.wi_0.kernel"), -1);
    assert_int_equal(model_param_index(def, "shared_experts"), -1);
    snprintf(path, sizeof path, "params.decoder.layers.%s.gate.kernel", scope);
    int g = model_param_index(def, path);
    snprintf(path, sizeof path, "params.decoder.layers.%s.wi_0", scope);
    int w0 = model_param_index(def, path);
    snprintf(path, sizeof path, "params.decoder.layers.%s.wo", scope);
    int wo = model_param_index(def, path);
    assert_true(g >= 0 && w0 >= 0 && wo >= 0);
    /* GateLogit with the layer's kernel_axes ("embed", None), stacked (embed, layers, experts) */
    assert_int_equal(def->defs[g].shape[0], emb);
    assert_int_equal(def->defs[g].shape[1], layers);
    assert_int_equal(def->defs[g].shape[2], experts);
    assert_string_equal(def->defs[g].logical[0], "embed");
    assert_null(def->defs[g].logical[2]);
    /* the experts (experts, layers, embed, width) / (experts, layers, width, embed) */
    assert_int_equal(def->defs[w0].shape[0], experts);
    assert_int_equal(def->defs[w0].shape[3], width);
    assert_int_equal(def->defs[wo].shape[2], width);
    assert_string_equal(def->defs[w0].logical[0], "exp");
    assert_string_equal(def->defs[wo].logical[2], "mlp_moe");
}

void family_check_moe_dumps(const char *small, const char *large)
{
    char m[96], what[160];
    snprintf(m, sizeof m, "model_name=%s", small);
    const char *a[] = {m, "num_devices=8", "ici_fsdp_parallelism=4", "ici_expert_parallelism=2"};
    snprintf(what, sizeof what, "%s fsdp=4 expert=2", small);
    assert_true(family_check_dump(what, small, "ici_fsdp_parallelism=4_ici_expert_parallelism=2", 4, a) >= 3 * 12);
    snprintf(m, sizeof m, "model_name=%s", large);
    const char *b[] = {m, "num_devices=8", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2",
                       "ici_expert_parallelism=2", "sparse_matmul=false"};
    snprintf(what, sizeof what, "%s fsdp=2 tensor=2 expert=2 dense", large);
    assert_true(family_check_dump(what, large,
                                  "ici_fsdp_parallelism=2_ici_tensor_parallelism=2_ici_expert_parallelism=2_"
                                  "sparse_matmul=false",
                                  6, b) >= 3 * 12);
}
