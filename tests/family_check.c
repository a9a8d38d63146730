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

/* `shardsim train` with base, the case's words and `more`; fails the test unless it exits 0. */
static void train(const char *const *base, int nbase, const char *const *words, int nwords, const char *const *more,
                  int nmore)
{
    const char *argv[MAX_ARGS];
    int argc = 0;
    if (nbase + nwords + nmore + 1 > MAX_ARGS) fail_msg("family_check: %d words, at most %d", nbase + nwords + nmore, MAX_ARGS - 1);
    for (int i = 0; i < nbase; i++) argv[argc++] = base[i];
    for (int i = 0; i < nwords; i++) argv[argc++] = words[i];
    for (int i = 0; i < nmore; i++) argv[argc++] = more[i];
    argv[argc++] = "hardware=cpu";
    cli_capture r = cli_capture_run(cli_train, argc, argv);
    if (r.rc) fail_msg("shardsim train exit %d: %s", r.rc, r.err);
    cli_capture_free(&r);
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
        const cfg_json *ov = cfg_json_get(peer, "overrides");
        assert_non_null(ov);
        for (int i = 0; i < nbase + nw; i++) {
            const char *w = i < nbase ? base[i] : lc->words[i - nbase];
            bool found = false;
            for (int j = 0; j < ov->n && !found; j++) found = !strcmp(ov->items[j].str, w);
            if (!found) fail_msg("%s: MaxText's run did not get %s", lc->name, w);
        }
        const cfg_json *ml = cfg_json_get(peer, "losses");
        assert_non_null(ml);
        assert_int_equal(ml->n, 2);
        /* the parameters: shardsim's after one step from its init (gen.sh), then both runs from them */
        char *dir = helper_tmpdir(tag);
        char ck[128], load[256], out[128], metrics[160], p0[160];
        snprintf(ck, sizeof ck, "checkpoint_dir=%s/ck", dir);
        snprintf(p0, sizeof p0, "%s/ck/step_0.safetensors", dir);
        snprintf(load, sizeof load, "load_parameters_path=%s", p0);
        snprintf(out, sizeof out, "output_dir=%s/out", dir);
        const char *make[] = {"steps=1", "learning_rate=1e-2", "enable_checkpointing=true", ck};
        train(base, nbase, lc->words, nw, make, 4);
        const char *run[] = {"steps=2", "learning_rate=1e-3", load, out};
        train(base, nbase, lc->words, nw, run, 4);
        snprintf(metrics, sizeof metrics, "%s/out/metrics.json", dir);
        cfg_json *ours = helper_read_json(NULL, metrics);
        const cfg_json *st = cfg_json_get(ours, "steps");
        assert_non_null(st);
        assert_int_equal(st->n, 2);
        for (int s = 0; s < 2; s++) {
            double m = cfg_json_get(&ml->items[s], "loss")->number, o = cfg_json_get(&st->items[s], "loss")->number;
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
        cfg_json_free(ours);
        cfg_json_free(peer);
        helper_rm_rf(dir);
        free(dir);
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
