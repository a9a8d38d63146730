/* parity.c — `shardsim parity`: one model, one data stream, several
 * configurations (mesh, rules, shard mode, ...).  Each configuration trains
 * the same steps; the losses of every step and every parameter gradient of
 * every step are compared with the first configuration's.  The table of
 * losses, the largest relative differences, and the verdict are printed; the
 * exit code is 1 when any difference exceeds parity_rtol, naming the first
 * step and the first parameter whose gradient diverged.
 *
 * When a configuration changes the device count and does not set
 * per_device_batch_size itself, that value is scaled so the global batch
 * stays the reference's (otherwise the runs would not see the same tokens).
 *
 * Each configuration runs under its own hbm_limit_gb.  One that runs out of
 * simulated memory is reported as it happens and the others still run; the
 * table compares those that finished, and the exit code is 1 (0 needs every
 * configuration to run and agree).  When the reference itself does not fit
 * nothing can be compared: parity stops there (exit 1).  A configuration
 * whose run would not fit in host memory (cli/hostmem.h, with the gradient
 * copies parity keeps) stops parity before it runs (exit 2).
 *
 * Across releases (a configuration names maxtext_release): a configuration that the release it
 * follows refuses (its config: a key it lacks, a types.py check) or fails to trace (an explicit-mode
 * error of that MaxText and JAX) is reported with its message and the others still run, so the
 * table shows where an upgrade breaks a configuration, with both answers; the reference is the
 * first configuration that runs, and the exit code is 1.  Progress: a line as
 * each configuration starts and one as it ends, flushed at once; on a
 * terminal a step bar on stderr. */
#include "cli/cli.h"
#include "cli/artifacts.h"
#include "cli/common.h"
#include "cli/hostmem.h"
#include "cli/report.h"
#include "cli/report_html.h"

#include <jansson.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "config/release.h"
#include "models/core/checks.h"
#include "models/core/timemodel.h"
#include "models/core/train.h"
#include "sim/xrank.h"

enum { MAX_CONFIGS = 32, MAX_WORDS = 64 };

typedef struct {
    char label[320];
    char text[1024];        /* the overrides as given */
    char *words[MAX_WORDS]; /* split */
    int n;
} parity_cfg;

static void split_configs(const char *spec, parity_cfg *c, int *n)
{
    *n = 0;
    const char *p = spec;
    while (*p && *n < MAX_CONFIGS) {
        const char *semi = strchr(p, ';');
        size_t len = semi ? (size_t)(semi - p) : strlen(p);
        parity_cfg *pc = &c[(*n)++];
        memset(pc, 0, sizeof *pc);
        snprintf(pc->text, sizeof pc->text, "%.*s", (int)len, p);
        char *save = NULL;
        char buf[1024];
        snprintf(buf, sizeof buf, "%s", pc->text);
        for (char *w = strtok_r(buf, " \t", &save); w && pc->n < MAX_WORDS; w = strtok_r(NULL, " \t", &save))
            pc->words[pc->n++] = strdup(w);
        snprintf(pc->label, sizeof pc->label, "%.300s", pc->n ? pc->text : "(base)");
        p = semi ? semi + 1 : p + len;
    }
}

static sim_status load_def(int argc, char **argv, const parity_cfg *pc, const char *extra, cfg_config **cfg,
                           model_def **def)
{
    const char *w[400];
    int n = 0;
    for (int i = 0; i < argc; i++) w[n++] = argv[i];
    for (int i = 0; i < pc->n; i++) w[n++] = pc->words[i];
    if (extra) w[n++] = extra;
    *def = NULL;
    SIM_TRY(cli_configs_check());
    SIM_TRY(cfg_load_argv(cli_base_config(), n, w, cfg));
    /* on a refusal *cfg stays for the caller (it reports and frees it); the model does not */
    sim_status st;
    bool defined = false;
    double tolerance;
    *def = calloc(1, sizeof **def);
    SIM_ASSERT(*def);
    SIM_TRY_GOTO(model_def_from_config(*cfg, *def), st, fail);
    defined = true;
    SIM_TRY_GOTO(cfg_get_double(*cfg, "sharding_tolerance", &tolerance), st, fail);
    SIM_TRY_GOTO(model_check_sharding_tolerance(*def, tolerance), st, fail);
    SIM_TRY_GOTO(cli_rank_placement(*cfg, &(*def)->mesh), st, fail);
fail:
    if (st) {
        if (defined) model_def_free(*def);
        free(*def);
        *def = NULL;
    }
    return st;
}

typedef struct {
    int c, nc;
    long long steps;
} parity_progress;

static void parity_step(const model_step_stats *ss, void *arg)
{
    const parity_progress *pp = arg;
    char label[64];
    snprintf(label, sizeof label, "configuration %d/%d: step %lld/%lld", pp->c + 1, pp->nc, (long long)ss->step + 1,
             pp->steps);
    cli_progress(stderr, (double)(ss->step + 1) / (double)pp->steps, label);
}

/* The maxtext_release a configuration names (its own words, then the common arguments), or NULL. */
static const char *release_of(const parity_cfg *pc, int argc, char **argv)
{
    for (int i = pc->n - 1; i >= 0; i--)
        if (!strncmp(pc->words[i], "maxtext_release=", 16)) return pc->words[i] + 16;
    for (int i = argc - 1; i >= 0; i--)
        if (!strncmp(argv[i], "maxtext_release=", 16)) return argv[i] + 16;
    return NULL;
}

static bool sets_pdbs(const parity_cfg *pc)
{
    for (int i = 0; i < pc->n; i++)
        if (!strncmp(pc->words[i], "per_device_batch_size=", 22)) return true;
    return false;
}

int cli_cmd_parity(int argc, char **argv, FILE *out, FILE *err)
{
    static const char *const own[] = {"configs"};
    cli_args a;
    sim_status st = cli_split_args(argc, argv, own, 1, &a);
    if (st) return cli_fail(err, st);
    const char *spec = cli_arg(&a, "configs");
    if (!spec || !*spec) {
        sim_err(SIM_ERR_INPUT, "parity needs configs=\"<overrides>;<overrides>;...\", e.g.\n"
                               "  shardsim parity configs=\"ici_fsdp_parallelism=1;ici_fsdp_parallelism=8\"");
        return cli_fail(err, SIM_ERR_INPUT);
    }
    parity_cfg *cfgs = calloc(MAX_CONFIGS, sizeof *cfgs);
    int nc;
    split_configs(spec, cfgs, &nc);
    int rc = 0;
    double **losses = calloc((size_t)nc, sizeof *losses);
    cli_parity_config *pcs = calloc((size_t)nc, sizeof *pcs);
    model_grads *ref = NULL;
    long long steps = 0;
    double rtol = 1e-4, worst_grad = 0;
    int64_t ref_batch = 0;
    int diverge_step = -1;
    char diverge_param[MODEL_PATH_MAX] = "", diverge_cfg[320] = "", outdir[1024] = "";
    bool *oom = calloc((size_t)nc, sizeof *oom);
    int n_oom = 0;
    /* across releases: each configuration's failure under its release (NULL: it ran) */
    bool cross = false;
    for (int c = 0; c < nc; c++) cross |= release_of(&cfgs[c], a.n_cfg, (char **)a.cfg) != NULL;
    char **failed = calloc((size_t)nc, sizeof *failed);
    int n_failed = 0, ref_c = -1;
    bool header = false; /* the first line, printed once (a failing first configuration is no reference) */
    /* what each configuration costs, for parity.json and the report: its mesh, memory per device,
     * the traffic of its last step and, with a hardware profile, the modelled time of that step */
    char(*meshes)[256] = calloc((size_t)nc, sizeof *meshes);
    sim_arena_stats **mems = calloc((size_t)nc, sizeof *mems);
    cli_traffic *traffic = calloc((size_t)nc, sizeof *traffic);
    json_t **tm_json = calloc((size_t)nc, sizeof *tm_json);
    int *ndev = calloc((size_t)nc, sizeof *ndev);
    for (int c = 0; c < nc && st == SIM_OK; c++) {
        cfg_config *cfg = NULL;
        model_def *def = NULL;
        char pdbs[64];
        st = load_def(a.n_cfg, (char **)a.cfg, &cfgs[c], NULL, &cfg, &def);
        if (st == SIM_ERR_INPUT && cross) {
            /* refused by its release's config: reported, the others still run */
            const char *rel = release_of(&cfgs[c], a.n_cfg, (char **)a.cfg);
            failed[c] = strdup(sim_errmsg());
            snprintf(cfgs[c].label, sizeof cfgs[c].label, "refused by MaxText %s",
                     rel ? rel : cfg_release_maxtext(NULL));
            fprintf(out, "[%d/%d] %-32s <- %s\n      %s\n", c + 1, nc, cfgs[c].label,
                    cfgs[c].n ? cfgs[c].text : "(no overrides)", failed[c]);
            fflush(out);
            n_failed++;
            oom[c] = true; /* not in the table */
            n_oom++;
            sim_err_clear();
            st = SIM_OK;
            cfg_free(cfg);
            continue;
        }
        if (st == SIM_OK && ref_c >= 0 && def->d.batch * def->d.ga != ref_batch && !sets_pdbs(&cfgs[c])) {
            snprintf(pdbs, sizeof pdbs, "per_device_batch_size=%.17g",
                     (double)ref_batch / (double)(def->mesh.num_devices * def->d.ga));
            model_def_free(def);
            free(def);
            cfg_free(cfg);
            st = load_def(a.n_cfg, (char **)a.cfg, &cfgs[c], pdbs, &cfg, &def);
        }
        model_data data;
        memset(&data, 0, sizeof data);
        data.fd = -1;
        model_train_job job;
        memset(&job, 0, sizeof job);
        if (st == SIM_OK && ref_c < 0) {
            ref_batch = def->d.batch * def->d.ga; /* rows per step, over all microbatches */
            st = cfg_get_int(cfg, "steps", &steps);
            if (!st) st = cfg_get_double(cfg, "parity_rtol", &rtol);
            const char *od = NULL;
            if (!st) st = cfg_get_str(cfg, "output_dir", &od);
            if (od && sim_xrank_rank() == 0) snprintf(outdir, sizeof outdir, "%s", od); /* rank 0 writes */
            if (!st && !header)
                fprintf(out, "parity: %d configurations, %lld steps, rtol %g on the loss and every gradient\n\n", nc,
                        steps, rtol);
            header = true;
        }
        if (st == SIM_OK && def->d.batch * def->d.ga != ref_batch)
            st = sim_err(SIM_ERR_INPUT,
                         "configuration '%s' trains %lld rows per step, the reference %lld; set "
                         "per_device_batch_size so that the global batches agree",
                         cfgs[c].label, (long long)(def->d.batch * def->d.ga), (long long)ref_batch);
        if (st == SIM_OK && def->d.dry_run) st = sim_err(SIM_ERR_INPUT, "parity needs real numbers: drop dry_run=true");
        if (st == SIM_OK) st = model_optim_from_config(cfg, &job.opt);
        if (st == SIM_OK) st = model_data_from_config(cfg, &data);
        sim_machine *m = NULL;
        double hbm = 0;
        if (st == SIM_OK) st = cfg_get_double(cfg, "hbm_limit_gb", &hbm);
        if (st == SIM_OK) st = model_machine_new(def, hbm, false, &m);
        cfg_hw hw;
        model_tm_eff eff;
        bool have_hw = false;
        if (st == SIM_OK) {
            int per_slice = def->mesh.num_devices / (def->mesh.num_slices > 0 ? def->mesh.num_slices : 1);
            st = cfg_hw_from_config(cfg, per_slice, &hw, &have_hw);
            if (st == SIM_OK && have_hw) st = model_tm_eff_load(cli_configs_dir(), &eff);
            if (st == SIM_OK) sim_machine_set_record_costs(m, have_hw);
        }
        if (st == SIM_OK) {
            /* label: the mesh and the mode, which is what tells the runs apart */
            char mesh[256];
            cli_mesh_summary(&def->mesh, mesh, sizeof mesh);
            char *paren = strstr(mesh, " (");
            if (paren) *paren = '\0';
            const char *rules = NULL;
            if (cfg_get_str(cfg, "custom_mesh_and_rule", &rules) != SIM_OK) rules = NULL;
            char extra[80] = "";
            if (def->d.ga > 1) snprintf(extra, sizeof extra, " G=%lld", (long long)def->d.ga);
            if (def->d.zero1) snprintf(extra + strlen(extra), sizeof extra - strlen(extra), " ZeRO-1");
            if (cross) /* the release tells the runs apart too */
                snprintf(extra + strlen(extra), sizeof extra - strlen(extra), " MaxText %s",
                         cfg_release_maxtext(def->release));
            snprintf(cfgs[c].label, sizeof cfgs[c].label, "%s%s%s%s %s", mesh, rules && *rules ? " " : "",
                     rules && *rules ? rules : "", extra, def->d.mode == MESH_MODE_EXPLICIT ? "explicit" : "auto");
            fprintf(out, "[%d/%d] %-32s <- %s\n", c + 1, nc, cfgs[c].label,
                    cfgs[c].n ? cfgs[c].text : "(no overrides)");
            fflush(out);
            parity_progress pp = {c, nc, steps};
            job.def = def;
            job.data = &data;
            job.steps = steps;
            job.stats = calloc((size_t)steps, sizeof *job.stats);
            job.step_grads = calloc((size_t)steps, sizeof *job.step_grads);
            job.on_step = parity_step;
            job.cb_arg = &pp;
            uint64_t t0 = sim_now_ns();
            /* host memory: the run, plus every step's gradients kept here (the reference's too) */
            uint64_t kept = (uint64_t)steps * (uint64_t)model_param_bytes(def) * (ref_c >= 0 ? 2u : 1u);
            st = cli_host_memory_fits(def, &job, hbm, false, kept, err);
            if (st == SIM_ERR_INPUT) sim_err_append(" (parity configuration '%s')", cfgs[c].label);
            if (st == SIM_OK) st = model_train(&job, m);
            cli_progress_done(stderr);
            losses[c] = calloc((size_t)steps, sizeof **losses);
            for (long long s = 0; s < steps; s++) losses[c][s] = job.stats[s].loss;
            if (st == SIM_OK)
                fprintf(out, "      %lld step%s in %.1f s, last loss %.7f\n", steps, steps > 1 ? "s" : "",
                        (double)(sim_now_ns() - t0) / 1e9, losses[c][steps - 1]);
            if (st == SIM_ERR_SHARDING && cross) {
                /* this release's MaxText (and JAX) fails to trace it: reported, the others still run */
                failed[c] = strdup(sim_errmsg());
                fprintf(out, "      fails under maxtext_release=%s: %s\n", cfg_release_maxtext(def->release),
                        failed[c]);
                n_failed++;
                oom[c] = true; /* not in the table */
                n_oom++;
                sim_err_clear();
                st = SIM_OK;
            } else if (st == SIM_ERR_OOM && sim_xrank_size() > 1) {
                /* under mpirun the ranks that did not run out are waiting on the one that did: the job ends */
            } else if (st == SIM_ERR_OOM) {
                /* reported as such; the other configurations still run (not the reference's absence) */
                fprintf(out, "      out of simulated memory (hbm_limit_gb=%g): %s\n", hbm, sim_errmsg());
                oom[c] = true;
                n_oom++;
                if (ref_c < 0)
                    sim_err(SIM_ERR_OOM,
                            "the reference configuration '%s' does not fit in hbm_limit_gb=%g: nothing to "
                            "compare with; raise hbm_limit_gb (0 = unlimited) or shard it further",
                            cfgs[c].label, hbm);
                else st = SIM_OK;
            }
            fflush(out);
            if (st == SIM_OK && !oom[c] && *outdir) {
                cli_mesh_summary(&def->mesh, meshes[c], sizeof meshes[c]);
                ndev[c] = sim_machine_num_devices(m);
                mems[c] = calloc((size_t)ndev[c], sizeof **mems);
                if (mems[c]) cli_memory_collect(m, mems[c]);
                cli_records recs;
                cli_records_from_machine(m, &recs);
                st = cli_traffic_build(&recs, cli_steps((int)steps - 1, (int)steps - 1), &traffic[c]);
                if (st == SIM_OK && have_hw) {
                    double opt_bytes = model_opt_step_bytes(def);
                    double bubble = def->d.pipe.on ? model_pipe_bubble_fraction(&def->d.pipe) : 0.0;
                    const char *dt = NULL;
                    if (cfg_get_str(cfg, "dtype", &dt) != SIM_OK || !dt) dt = "";
                    model_tm_result tm;
                    memset(&tm, 0, sizeof tm);
                    if (model_tm_estimate(&hw, &eff, dt, m, (int)steps - 1, bubble, opt_bytes, false, &tm) == SIM_OK) {
                        cfg_jw tw;
                        cfg_jw_init(&tw);
                        model_tm_json(&tw, &hw, sim_machine_mesh(m), &tm);
                        tm_json[c] = cfg_jw_take(&tw);
                    } else { /* a figure the profile does not publish: no estimate, the parity check stands */
                        sim_err_clear();
                    }
                    free(tm.spans);
                }
            }
            if (st == SIM_OK && oom[c]) {
                /* no gradients to compare */
            } else if (st == SIM_OK && ref_c < 0) {
                ref = job.step_grads;
                job.step_grads = NULL;
                ref_c = c;
            } else if (st == SIM_OK) {
                for (long long s = 0; s < steps; s++)
                    for (int i = 0; i < def->nparams; i++) {
                        double e = model_rel_norm_diff(job.step_grads[s].g[i], ref[s].g[i],
                                                       ref[s].layer_elems[i] * ref[s].n_layers[i]);
                        if (e > worst_grad) worst_grad = e;
                        if (e > rtol && (diverge_step < 0 || s < diverge_step)) {
                            diverge_step = (int)s;
                            snprintf(diverge_param, sizeof diverge_param, "%s", def->defs[i].path);
                            snprintf(diverge_cfg, sizeof diverge_cfg, "%s", cfgs[c].label);
                        }
                    }
            }
            if (job.step_grads)
                for (long long s = 0; s < steps; s++) model_grads_free(&job.step_grads[s]);
            free(job.step_grads);
            free(job.stats);
        }
        if (!oom[c]) { /* the table holds the configurations that ran */
            int k = c - n_oom;
            pcs[k].label = cfgs[c].label;
            pcs[k].overrides = cfgs[c].text;
            pcs[k].losses = losses[c];
            pcs[k].mesh = meshes[c][0] ? meshes[c] : NULL;
            pcs[k].n_devices = mems[c] ? ndev[c] : 0;
            pcs[k].mem = mems[c];
            pcs[k].traffic = traffic[c].rows || traffic[c].n_devices ? &traffic[c] : NULL;
            pcs[k].step_time_model = tm_json[c];
        }
        sim_machine_free(m);
        model_data_close(&data);
        if (def) {
            model_def_free(def);
            free(def);
        }
        cfg_free(cfg);
    }
    if (st) {
        rc = cli_fail(err, st);
    } else {
        cli_parity p = {nc - n_oom,
                        pcs,
                        (int)steps,
                        0,
                        rtol,
                        diverge_step,
                        diverge_step >= 0 ? diverge_param : NULL,
                        diverge_step >= 0 ? diverge_cfg : NULL};
        fprintf(out, "\n");
        cli_report_parity(out, &p);
        fprintf(out, "largest relative gradient difference (norm per parameter, any step): %.3g\n", worst_grad);
        bool fail = cli_parity_first_failure(&p) >= 0 || diverge_step >= 0;
        if (diverge_step >= 0)
            fprintf(out, "first diverging gradient: step %d, %s, in configuration '%s'\n", diverge_step, diverge_param,
                    diverge_cfg);
        if (n_oom > n_failed) {
            fprintf(out, "INCOMPLETE: %d configuration%s ran out of simulated memory, not compared:", n_oom - n_failed,
                    n_oom - n_failed > 1 ? "s" : "");
            for (int c = 0; c < nc; c++)
                if (oom[c] && !failed[c]) fprintf(out, " '%s'", cfgs[c].label);
            fprintf(out, " (raise hbm_limit_gb, 0 = unlimited, or shard them further)\n");
            fail = true;
        }
        if (cross) {
            /* each configuration under its release: where one traces and another fails, both answers */
            if (n_failed)
                fprintf(out, "NOT COMPARED: %d configuration%s fail%s under the release %s follow%s:\n", n_failed,
                        n_failed > 1 ? "s" : "", n_failed > 1 ? "" : "s", n_failed > 1 ? "they" : "it",
                        n_failed > 1 ? "" : "s");
            fprintf(out, "across releases:\n");
            for (int c = 0; c < nc; c++) {
                const char *rel = release_of(&cfgs[c], a.n_cfg, (char **)a.cfg);
                fprintf(out, "  [%d] maxtext_release=%s: ", c + 1, rel ? rel : cfg_release_maxtext(NULL));
                if (!failed[c]) {
                    fprintf(out, "%s\n", oom[c] ? "out of simulated memory" : "traces and trains");
                    continue;
                }
                const char *nl = strchr(failed[c], '\n');
                fprintf(out, "fails: %.*s\n", nl ? (int)(nl - failed[c]) : (int)strlen(failed[c]), failed[c]);
                const char *mt = strstr(failed[c], "fails here too: ");
                if (mt) {
                    mt += strlen("fails here too: ");
                    const char *e = strchr(mt, '\n');
                    fprintf(out, "      at MaxText's %.*s\n", e ? (int)(e - mt) : (int)strlen(mt), mt);
                }
            }
            if (n_failed) fail = true;
        }
        if (*outdir) {
            st = cli_write_parity_json(outdir, &p);
            if (!st) st = cli_write_report_html(outdir);
            if (st) rc = cli_fail(err, st);
        }
        if (!rc) rc = fail ? 1 : 0;
    }
    if (ref) {
        for (long long s = 0; s < steps; s++) model_grads_free(&ref[s]);
        free(ref);
    }
    for (int c = 0; c < nc; c++) {
        free(mems[c]);
        cli_traffic_free(&traffic[c]);
        json_decref(tm_json[c]);
    }
    free(meshes);
    free(mems);
    free(traffic);
    free(tm_json);
    free(ndev);
    for (int c = 0; c < nc; c++) {
        free(losses[c]);
        for (int i = 0; i < cfgs[c].n; i++) free(cfgs[c].words[i]);
    }
    free(losses);
    for (int c = 0; c < nc; c++) free(failed[c]);
    free(failed);
    free(oom);
    free(pcs);
    free(cfgs);
    return rc;
}
