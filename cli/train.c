/* train.c — `shardsim train` and `shardsim dump`.
 *
 * train: load the config, define the model on its mesh, print the config
 * box, train (one line per step), then the traffic table (op x mesh axes x
 * phase) and the memory table (per device x category), and with output_dir
 * the artifacts: run.json, metrics.json, collectives.csv, traffic.csv,
 * trace.json and the MaxText sharding dump.  dump: the sharding dump alone,
 * from a dry forward pass (shapes only). */
#include "blas_kernels/bk_coretype.h"
#include "cli/cli.h"
#include "cli/artifacts.h"
#include "cli/common.h"
#include "cli/hostmem.h"
#include "cli/report.h"
#include "cli/report_html.h"
#include "config/release.h"
#include "sim/trace.h"
#include "sim/xrank.h"

#include <errno.h>
#include <jansson.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "models/core/checks.h"
#include "models/core/checkpoint.h"
#include "models/core/timemodel.h"
#include "models/core/train.h"

typedef struct {
    cfg_config *cfg;
    model_def *def;
} cli_model;

static void model_close(cli_model *cm)
{
    if (cm->def) {
        model_def_free(cm->def);
        free(cm->def);
    }
    cfg_free(cm->cfg);
    memset(cm, 0, sizeof *cm);
}

static sim_status model_open(int argc, char **argv, const char *const *extra, int n_extra, cli_model *cm)
{
    memset(cm, 0, sizeof *cm);
    const char *words[300];
    int n = 0;
    for (int i = 0; i < argc && n < 280; i++) words[n++] = argv[i];
    for (int i = 0; i < n_extra; i++) words[n++] = extra[i];
    SIM_TRY(cli_configs_check());
    SIM_TRY(cfg_load_argv(cli_base_config(), n, words, &cm->cfg));
    cm->def = calloc(1, sizeof *cm->def);
    sim_status st = model_def_from_config(cm->cfg, cm->def);
    if (!st && (st = cli_rank_placement(cm->cfg, &cm->def->mesh))) model_def_free(cm->def);
    if (st) {
        model_def_free(cm->def); /* what it built before failing (the rules) */
        free(cm->def);
        cm->def = NULL;
    }
    return st;
}

static const char *cfg_str(const cfg_config *c, const char *key)
{
    const char *s = NULL;
    if (cfg_get_str(c, key, &s) != SIM_OK || !s) return "";
    return s;
}

/* trace.json of a dry run with a hardware profile: the modelled timeline, written whole or not at all */
typedef struct {
    const cfg_hw *hw;
    const model_tm_result *tm;
} modelled_trace;

static sim_status write_modelled_trace(FILE *f, void *arg)
{
    const modelled_trace *mt = arg;
    return model_tm_write_trace(f, mt->hw, mt->tm);
}

/* ------------------------------------------------------------ dump entries */

/* Entries of the parameters as MaxText lists them: a pipelined one gives one entry per layer of a
 * stage (MaxText's layout), scan_layers=false one per layer (defs keeps those tensors' paths alive). */
static int dump_params(const model_def *def, cli_dump_param *p, char (*paths)[MODEL_PATH_MAX + 32],
                       model_param_def *defs)
{
    int np = 0;
    for (int i = 0; i < def->nparams; i++) {
        int64_t per = model_param_pipelined(def, i) ? def->d.pipe.layers_per_stage : 0;
        for (int64_t l = 0; l < per; l++) {
            cli_dump_param *q = &p[np];
            memset(q, 0, sizeof *q);
            if (model_pipe_dump_layout(def, i, l, paths[np], sizeof paths[np], &q->rank, q->shape, q->logical,
                                       &q->spec) != SIM_OK)
                continue;
            /* ZeRO-1: MaxText's add_data_to_sharding on this [(R,) S, ...] tensor (the repeat dim when R allows) */
            q->has_opt_spec = def->d.zero1;
            q->no_opt = def->defs[i].state_var;
            q->opt = def->opt;
            q->branch = def->opt_param[i].branch;
            if (def->d.zero1) model_zero1_spec(&def->mesh, q->rank, q->shape, &q->spec, &q->opt_spec);
            for (int d = 0; d < q->rank; d++)
                if (q->logical[d]) q->logical[d] = cfg_release_logical_name(def->release, q->logical[d]);
            q->path = paths[np++];
        }
        if (per) continue;
        for (int k = 0; k < model_param_def_tensors(&def->defs[i]); k++, np++) {
            memset(&p[np], 0, sizeof p[np]);
            mesh_spec spec;
            model_param_def_tensor(&def->defs[i], &def->unpruned[i], k, &defs[np], &spec);
            p[np].path = defs[np].path;
            p[np].rank = defs[np].rank;
            for (int d = 0; d < p[np].rank; d++) {
                p[np].shape[d] = defs[np].shape[d];
                /* the names of the release followed (its logical_names: 0.2.0's Linen 'embed' for 0.2.5's
                 * 'embed_attn' ...), as its get_shaped_inputs annotates them */
                p[np].logical[d] = defs[np].logical[d] ? cfg_release_logical_name(def->release, defs[np].logical[d])
                                                       : NULL;
            }
            p[np].spec = spec;
            p[np].no_opt = def->defs[i].state_var;
            p[np].opt = def->opt; /* the train state's optimizer part is its row's tree */
            p[np].branch = def->opt_param[i].branch;
            /* ZeRO-1: the Adam moments in the data-sharded layout, the parameters as get_shaped_inputs gives them
             * (ZeRO-1 is refused with scan_layers=false: one tensor per parameter then) */
            p[np].has_opt_spec = def->d.zero1;
            p[np].opt_spec = def->opt_unpruned[i];
        }
    }
    return np;
}

static void dump_activations(const model_def *def, const char *dtype, cli_dump_activation *a, int *na)
{
    *na = def->nacts;
    for (int i = 0; i < def->nacts; i++) {
        const model_act *act = &def->acts[i];
        memset(&a[i], 0, sizeof a[i]);
        a[i].name = act->name;
        a[i].dtype = act->float32 ? "float32" : dtype; /* the config's activation dtype, as MaxText logs it */
        a[i].rank = act->rank;
        a[i].logical_known = act->logical_known;
        for (int d = 0; d < act->rank; d++) {
            a[i].shape[d] = act->shape[d];
            a[i].logical[d] = act->logical[d][0] ? act->logical[d] : NULL;
        }
        a[i].spec = act->spec;
    }
}

/* MaxText's three files (named_shardings.json, logical_shardings.json,
 * input_shardings.json), and shardings.json holding all three. */
static sim_status write_dump(const char *dir, const cfg_config *cfg, const model_def *def)
{
    int cap = 0;
    for (int i = 0; i < def->nparams; i++)
        cap += model_param_def_tensors(&def->defs[i]) +
               (model_param_pipelined(def, i) ? (int)def->d.pipe.layers_per_stage : 0);
    cli_dump_param *p = calloc((size_t)cap + 1, sizeof *p);
    char(*paths)[MODEL_PATH_MAX + 32] = calloc((size_t)cap + 1, sizeof *paths);
    model_param_def *defs = calloc((size_t)cap + 1, sizeof *defs);
    cli_dump_activation a[MODEL_MAX_ACTS];
    int na;
    const char *dtype = cfg_str(cfg, "dtype");
    if (!p || !paths || !defs) {
        free(p);
        free(paths);
        free(defs);
        return sim_err(SIM_ERR_INTERNAL, "dump: out of host memory");
    }
    dump_activations(def, *dtype ? dtype : "float32", a, &na);
    int np = dump_params(def, p, paths, defs);
    sim_status st = cli_write_shardings_json(dir, &def->mesh, p, np, CLI_DUMP_TRAIN_STATE, a, na);
    if (!st) st = cli_write_sharding_dump(dir, &def->mesh, p, np, CLI_DUMP_TRAIN_STATE, a, na);
    free(p);
    free(paths);
    free(defs);
    return st;
}

/* ------------------------------------------------------------ train */

typedef struct {
    FILE *out;
    const model_def *def;
    cli_step_metrics *metrics;
    FILE *metrics_file; /* metrics_file=...: one JSON line per step, or NULL */
    const char *run_name;
} step_printer;

/* "step 3: backward 12/32" on a terminal while a step runs (remat layers). */
static void print_layer(void *arg, int64_t step, int layer, bool backward)
{
    step_printer *sp = arg;
    int L = (int)sp->def->d.layers, done = backward ? L + (L - layer) : layer + 1;
    char label[96];
    snprintf(label, sizeof label, "step %lld: %s %d/%d", (long long)step, backward ? "backward" : "forward",
             backward ? L - layer : layer + 1, L);
    cli_progress(stderr, (double)done / (2.0 * L), label);
}

static void print_step(const model_step_stats *s, void *arg)
{
    step_printer *sp = arg;
    cli_progress_done(stderr);
    cli_step_metrics *m = &sp->metrics[s->step];
    m->step = (int)s->step;
    m->loss = s->loss;
    m->mtp_loss = s->mtp_loss;
    m->has_mtp = model_mtp_layers(sp->def) > 0;
    m->grad_norm = s->grad_norm;
    m->raw_grad_norm = s->raw_grad_norm;
    m->lr = s->lr;
    m->time_s = s->time_s;
    m->tokens_per_s = s->time_s > 0 ? (double)(sp->def->d.batch * sp->def->d.ga * sp->def->d.seq) / s->time_s : 0;
    m->peak_bytes = s->peak_bytes;
    m->dry = sp->def->d.dry_run;
    cli_report_step_line(sp->out, m);
    fflush(sp->out);
    if (sp->metrics_file) {
        /* MaxText's metrics_file line: its scalar names, step as a float, run_name.  learning/grad_norm is
         * the norm after clipping, learning/raw_grad_norm before (trainers/pre_train/train.py train_step) */
        cfg_jw w;
        cfg_jw_init(&w);
        cfg_jw_obj(&w);
        static const char *const keys[] = {"learning/loss",          "learning/grad_norm",
                                           "learning/raw_grad_norm", "learning/current_learning_rate",
                                           "perf/step_time_seconds", "perf/per_device_tokens_per_sec"};
        const double vals[] = {m->loss, m->grad_norm, m->raw_grad_norm,
                               m->lr,   m->time_s,    m->tokens_per_s / sp->def->mesh.num_devices};
        for (int k = 0; k < 6; k++) {
            cfg_jw_key(&w, keys[k]);
            cfg_jw_num(&w, vals[k], k < 4 ? 9 : 6);
        }
        cfg_jw_key(&w, "step"); /* a float, as MaxText writes it */
        cfg_jw_double(&w, (double)m->step);
        cfg_jw_key(&w, "run_name");
        cfg_jw_str(&w, sp->run_name);
        if (m->has_mtp) {
            cfg_jw_key(&w, "learning/mtp_loss");
            cfg_jw_num(&w, m->mtp_loss, 9);
        }
        cfg_jw_end(&w);
        cfg_jw_write(&w, sp->metrics_file, CFG_JW_LINE, 9);
        fputc('\n', sp->metrics_file);
        fflush(sp->metrics_file);
    }
}

/* MaxText's output layout: base_output_directory/run_name (run_name empty:
 * <model_name>_<YYYY-MM-DD-HH-MM>, as MaxText names it), checkpoints in
 * .../checkpoints when enable_checkpointing=true.  output_dir (shardsim's key)
 * wins when set; a checkpoint_dir given with enable_checkpointing=false is a
 * contradiction, not a silent choice. */
static sim_status resolve_outputs(const cfg_config *cfg, char *outdir, size_t cap_out, char *ckdir, size_t cap_ck,
                                  char *run_name, size_t cap_run)
{
    const char *base = cfg_str(cfg, "base_output_directory"), *run = cfg_str(cfg, "run_name");
    const char *out = cfg_str(cfg, "output_dir"), *ck = cfg_str(cfg, "checkpoint_dir");
    int enable;
    SIM_TRY(cfg_get_bool(cfg, "enable_checkpointing", &enable));
    if (strstr(base, "://"))
        return sim_err(SIM_ERR_INPUT,
                       "base_output_directory=%s: shardsim writes local files only; give a local directory", base);
    if (*run) {
        snprintf(run_name, cap_run, "%s", run);
    } else {
        time_t t = time(NULL);
        struct tm tm;
        char ts[32] = "";
        if (gmtime_r(&t, &tm)) strftime(ts, sizeof ts, "%Y-%m-%d-%H-%M", &tm);
        snprintf(run_name, cap_run, "%s_%s", cfg_str(cfg, "model_name"), ts);
    }
    if (*out) snprintf(outdir, cap_out, "%s", out);
    else if (*base) snprintf(outdir, cap_out, "%s/%s", base, run_name);
    else outdir[0] = '\0';
    if (*ck && !enable)
        return sim_err(SIM_ERR_INPUT,
                       "checkpoint_dir=%s with enable_checkpointing=false: drop checkpoint_dir, or set "
                       "enable_checkpointing=true",
                       ck);
    if (*ck) snprintf(ckdir, cap_ck, "%s", ck);
    else if (*base && enable) snprintf(ckdir, cap_ck, "%s/%s/checkpoints", base, run_name);
    else ckdir[0] = '\0';
    return SIM_OK;
}

/* Where the run starts, as MaxText's load_state_if_possible decides: the
 * latest checkpoint of this run's checkpoint_dir first (a run in progress
 * resumes; load_parameters_path and load_full_state_path are then not
 * read), else load_full_state_path (parameters, optimizer state, step), else
 * load_parameters_path (parameters only, step 0).  A checkpoint saved after
 * step n resumes at step n + 1 (MaxText's start_step = the optimizer count).  A dry run computes no
 * values: it starts at step 0 and only checks the file it is given. */
typedef struct {
    char path[4096];
    bool full;
    long long start;
} resume_plan;

static sim_status resolve_resume(const cfg_config *cfg, const char *ckdir, bool dry, long long steps, FILE *out,
                                 resume_plan *r)
{
    const char *lp = cfg_str(cfg, "load_parameters_path"), *lfs = cfg_str(cfg, "load_full_state_path");
    memset(r, 0, sizeof *r);
    if (*ckdir && !dry) {
        int stale = 0;
        long long latest;
        SIM_TRY(model_checkpoint_latest(ckdir, r->path, sizeof r->path, &latest, &stale));
        if (stale)
            fprintf(out,
                    "checkpoint_dir %s holds %d temporary file%s of a save that did not finish: never loaded, "
                    "removed by the next save\n",
                    ckdir, stale, stale > 1 ? "s" : "");
        if (latest >= 0) {
            r->full = true;
            r->start = latest + 1;
            fprintf(out, "resuming from this run's checkpoint %s (saved after step %lld)%s%s%s\n", r->path, latest,
                    *lp || *lfs ? "; as MaxText does, " : "",
                    *lp    ? "load_parameters_path"
                    : *lfs ? "load_full_state_path"
                           : "",
                    *lp || *lfs ? " is not read while checkpoint_dir holds a checkpoint" : "");
        }
    }
    if (!r->full && *lfs) {
        snprintf(r->path, sizeof r->path, "%s", lfs);
        long long held;
        sim_status st = model_checkpoint_step(lfs, &held);
        if (st) {
            sim_err_append(" (load_full_state_path=%s)", lfs);
            return st;
        }
        r->full = true;
        r->start = dry ? 0 : held + 1;
        if (!dry) fprintf(out, "resuming from load_full_state_path=%s (saved after step %lld)\n", lfs, held);
    } else if (!r->full && *lp) {
        snprintf(r->path, sizeof r->path, "%s", lp);
    }
    if (r->full && r->start >= steps)
        return sim_err(SIM_ERR_INPUT,
                       "checkpoint %s was saved after step %lld (%lld steps done) and steps=%lld: "
                       "nothing is left to train; set steps above %lld to continue, or %s",
                       r->path, r->start - 1, r->start, steps, r->start,
                       *lfs && strcmp(r->path, lfs) == 0 ? "drop load_full_state_path"
                                                         : "set enable_checkpointing=false or another checkpoint_dir "
                                                           "(or run_name) to start over");
    return SIM_OK;
}

static void config_box(FILE *out, const cli_model *cm, long long steps)
{
    const model_def *def = cm->def;
    const model_dims *d = &def->d;
    char mesh[256], dims[256], batch[128], params[64], st[32];
    cli_mesh_summary(&def->mesh, mesh, sizeof mesh);
    snprintf(dims, sizeof dims, "emb %lld, heads %lld (kv %lld) x %lld, mlp %lld, layers %lld, vocab %lld",
             (long long)d->emb, (long long)d->q_heads, (long long)d->kv_heads, (long long)d->head_dim,
             (long long)d->mlp, (long long)d->layers, (long long)d->vocab);
    if (d->ga > 1)
        snprintf(batch, sizeof batch, "%lld rows x %lld tokens: %lld microbatches of %lld rows (%lld loaded)",
                 (long long)(d->batch * d->ga), (long long)d->seq, (long long)d->ga, (long long)d->batch,
                 (long long)d->rows_loaded);
    else
        snprintf(batch, sizeof batch, "%lld rows x %lld tokens (%lld loaded)", (long long)d->batch, (long long)d->seq,
                 (long long)d->rows_loaded);
    double nparam = (double)model_param_bytes(def) / 4.0; /* model_param_bytes counts float32 */
    snprintf(params, sizeof params, "%.2f M (%.1f MiB %s)", nparam / 1e6,
             nparam * (double)sim_dtype_size(d->weight_dtype) / 1048576.0, sim_dtype_name(d->weight_dtype));
    snprintf(st, sizeof st, "%lld", steps);
    const char *custom = cfg_str(cm->cfg, "custom_mesh_and_rule");
    char dtypes[128];
    snprintf(dtypes, sizeof dtypes, "activations %s, weights %s (bytes; math in float32)", sim_dtype_name(d->act_dtype),
             sim_dtype_name(d->weight_dtype));
    char xla[512];
    model_xla_rules_text(&d->xla, xla, sizeof xla);
    cli_kv rows[] = {
        {"model", d->model_name},
        {"decoder", d->family->name},
        {"mesh", mesh},
        {"shard_mode", d->mode == MESH_MODE_EXPLICIT ? "explicit" : "auto"},
        {"rules", *custom ? custom : "base"},
        {"dims", dims},
        {"parameters", params},
        {"batch", batch},
        {"steps", st},
        {"remat_policy", d->remat_policy},
        {"dtypes", dtypes},
        {"weight collectives", d->wire_rule},
        {"compiler rules", xla},
        {"optimizer state", d->zero1 ? "ZeRO-1: sharded over data (shard_optimizer_over_data)" : "as the parameters"},
        {"dataset", cfg_str(cm->cfg, "dataset_type")},
        {"dry_run", d->dry_run ? "true (shapes, shardings, traffic and memory only)" : "false"},
        {"blas kernels", bk_coretype_current()->summary},
    };
    cli_report_config_box(out, "shardsim train", rows, (int)(sizeof rows / sizeof rows[0]));
}

/* Under mpirun every rank decides where to start from the files it sees; ranks that saw different
 * checkpoints would train different steps, so the decisions must agree (each rank reads and writes
 * its own devices' slices of the one file: checkpoint_dir must be on a file system they share). */
static sim_status resume_agrees(const resume_plan *r, const char *ckdir)
{
    int R = sim_xrank_size();
    if (R < 2) return SIM_OK;
    typedef struct {
        long long start;
        int full;
        char path[4096];
    } seen;
    seen mine, *all = calloc((size_t)R, sizeof *all);
    SIM_ASSERT(all);
    memset(&mine, 0, sizeof mine);
    mine.start = r->start;
    mine.full = r->full;
    snprintf(mine.path, sizeof mine.path, "%s", r->path);
    sim_status st = sim_xrank_allgather(&mine, sizeof mine, all);
    for (int i = 1; i < R && st == SIM_OK; i++)
        if (all[i].start != all[0].start || all[i].full != all[0].full || strcmp(all[i].path, all[0].path))
            st = sim_err(SIM_ERR_INPUT,
                         "MPI rank %d would start from %s (step %lld) but rank 0 from %s (step %lld): "
                         "every rank must see the same checkpoints; put checkpoint_dir%s%s on a file system all ranks "
                         "share",
                         i, all[i].path[0] ? all[i].path : "scratch", all[i].start,
                         all[0].path[0] ? all[0].path : "scratch", all[0].start, *ckdir ? "=" : "", ckdir);
    free(all);
    return st;
}

/* trace_steps=...: the steps trace.json keeps, as given and as parsed. */
typedef struct {
    const sim_trace_range *ranges;
    int n;
    const char *text;
} trace_steps;

/* The files of output_dir=DIR after a run: run.json, metrics.json, the CSVs, trace.json (the
 * modelled timeline when the time model kept one), the sharding dump and report.html. */
static sim_status write_artifacts(const cli_model *cm, int argc, char **argv, const char *outdir,
                                  const cli_step_metrics *metrics, int n_steps, sim_machine *m, const cli_records *recs,
                                  const cli_traffic *traffic, const sim_arena_stats *mem, const cfg_hw *hw,
                                  const model_tm_result *tm, struct json_t *tm_json, const trace_steps *ts, FILE *out)
{
    const model_def *def = cm->def;
    int nd = sim_machine_num_devices(m);
    char xla[512];
    cli_run_info info = {"train",
                         argc,
                         (const char *const *)argv,
                         cm->cfg,
                         &def->mesh,
                         &def->rules,
                         NULL,
                         0,
                         tm_json,
                         sim_dtype_name(def->d.gather_dtype),
                         sim_dtype_name(def->d.reduce_dtype),
                         def->d.wire_rule,
                         model_xla_rules_text(&def->d.xla, xla, sizeof xla)};
    SIM_TRY(cli_write_run_json(outdir, &info));
    SIM_TRY(cli_write_metrics_json(outdir, metrics, n_steps, mem, nd));
    long long max_rows = 0, max_events = 0;
    SIM_TRY(cfg_get_int(cm->cfg, "collectives_csv_max_rows", &max_rows));
    SIM_TRY(cfg_get_int(cm->cfg, "trace_max_events", &max_events));
    SIM_TRY(cli_write_collectives_csv(outdir, recs, cli_steps_all(), (size_t)max_rows));
    SIM_TRY(cli_write_traffic_csv(outdir, traffic));
    if (tm->spans) { /* a dry run with a profile: trace.json in modelled time */
        modelled_trace mt = {hw, tm};
        SIM_TRY(cli_artifact_write(outdir, "trace.json", write_modelled_trace, &mt));
    } else {
        SIM_TRY(cli_write_trace_json(outdir, m, (size_t)max_events));
        uint64_t left_steps = sim_trace_steps_skipped(m);
        if (left_steps) {
            char kept[512];
            fprintf(out,
                    "\ntrace.json: steps %s of %d (trace_steps=%s); left out %llu step%s and their %llu "
                    "spans (trace_steps=all keeps every step)\n",
                    cli_trace_steps_text(ts->ranges, ts->n, kept, sizeof kept), n_steps, ts->text,
                    (unsigned long long)left_steps, left_steps > 1 ? "s" : "",
                    (unsigned long long)sim_trace_spans_skipped(m));
        }
    }
    int csv_dev = cli_collectives_csv_devices(recs, cli_steps_all(), (size_t)max_rows);
    size_t trace_dev = tm->spans ? (size_t)nd : sim_trace_devices_within(m, (size_t)max_events);
    if (tm->spans)
        fprintf(out, "\ntrace.json: the modelled timeline of device %d (the slowest) on %s\n", tm->device, hw->name);
    if (csv_dev < nd || (int)trace_dev < nd)
        fprintf(out,
                "\nlimited artifacts: collectives.csv holds devices 0-%d and trace.json devices 0-%zu of "
                "%d (collectives_csv_max_rows=%lld, trace_max_events=%lld; 0 = no limit)\n",
                csv_dev - 1, trace_dev - 1, nd, max_rows, max_events);
    SIM_TRY(write_dump(outdir, cm->cfg, def));
    SIM_TRY(cli_write_report_html(outdir));
    fprintf(out, "\nartifacts written to %s (open report.html in a browser)\n", outdir);
    return SIM_OK;
}

int cli_train(int argc, char **argv, FILE *out, FILE *err)
{
    cli_model cm;
    /* With no arguments at all: the built-in small model (MaxText's defaults
     * in base.yml are a 1 B-parameter model that needs ~29 GiB). */
    char small[4096 + 16];
    char *small_argv[1] = {small};
    if (argc == 0) {
        snprintf(small, sizeof small, "%s/small.yml", cli_configs_dir());
        fprintf(out,
                "no arguments: training the built-in small Llama (%s); give keys or YAML files to choose "
                "another (shardsim help train)\n\n",
                small);
        argc = 1;
        argv = small_argv;
    }
    /* what the run holds, released at the one label below on every path */
    model_data data;
    memset(&data, 0, sizeof data);
    data.fd = -1;
    model_train_job job;
    memset(&job, 0, sizeof job);
    sim_machine *m = NULL;
    cli_step_metrics *metrics = NULL;
    step_printer sp = {out, NULL, NULL, NULL, NULL};
    bool made_outdir = false;
    const char *outdir = "";
    cli_traffic traffic;
    memset(&traffic, 0, sizeof traffic);
    sim_arena_stats *mem = NULL;
    model_tm_result tm;
    memset(&tm, 0, sizeof tm);
    struct json_t *tm_json = NULL;
    int rc = 0;
    sim_status st;
    SIM_TRY_GOTO(model_open(argc, argv, NULL, 0, &cm), st, fail);
    const model_def *def = cm.def;
    long long steps, ckpt_period;
    double hbm;
    SIM_TRY_GOTO(cfg_get_int(cm.cfg, "steps", &steps), st, fail);
    SIM_TRY_GOTO(cfg_get_double(cm.cfg, "hbm_limit_gb", &hbm), st, fail);
    SIM_TRY_GOTO(cfg_get_int(cm.cfg, "checkpoint_period", &ckpt_period), st, fail);
    int on_start = 1, on_completion = 1;
    SIM_TRY_GOTO(cfg_get_bool(cm.cfg, "save_checkpoint_on_start", &on_start), st, fail);
    SIM_TRY_GOTO(cfg_get_bool(cm.cfg, "save_checkpoint_on_completion", &on_completion), st, fail);
    if (steps < 1) SIM_TRY_GOTO(sim_err(SIM_ERR_INPUT, "steps=%lld: train at least one step", steps), st, fail);
    SIM_TRY_GOTO(model_optim_from_config(cm.cfg, &job.opt), st, fail);
    SIM_TRY_GOTO(model_data_from_config(cm.cfg, &data), st, fail);
    double tolerance;
    int debug_sharding = 0;
    SIM_TRY_GOTO(cfg_get_double(cm.cfg, "sharding_tolerance", &tolerance), st, fail);
    SIM_TRY_GOTO(model_check_sharding_tolerance(def, tolerance), st,
                 fail); /* MaxText checks when it sets up the state */
    SIM_TRY_GOTO(cfg_get_bool(cm.cfg, "debug_sharding", &debug_sharding), st, fail);
    const char *load = cfg_str(cm.cfg, "load_parameters_path");
    if (*load && access(load, R_OK) != 0)
        SIM_TRY_GOTO(sim_err(SIM_ERR_INPUT,
                             "load_parameters_path=%s: cannot read it (%s); give a checkpoint written "
                             "by checkpoint_dir=..., e.g. DIR/step_0.safetensors",
                             load, strerror(errno)),
                     st, fail);
    char outbuf[4096], ckbuf[4096], run_name[1024];
    SIM_TRY_GOTO(resolve_outputs(cm.cfg, outbuf, sizeof outbuf, ckbuf, sizeof ckbuf, run_name, sizeof run_name), st,
                 fail);
    resume_plan resume;
    memset(&resume, 0, sizeof resume);
    /* the pipeline refuses checkpoint_dir itself (models/core/pipeline.c); the directory MaxText derives
     * from base_output_directory with enable_checkpointing (its default) is the same feature */
    if (*ckbuf && def->d.pipe.on)
        SIM_TRY_GOTO(sim_err(SIM_ERR_INPUT,
                             "enable_checkpointing=true with base_output_directory and pipeline "
                             "parallelism (stages=%lld): checkpoints of stage-held layers are not implemented yet; set "
                             "enable_checkpointing=false or ici_pipeline_parallelism=1",
                             (long long)def->d.pipe.stages),
                     st, fail);
    SIM_TRY_GOTO(resolve_resume(cm.cfg, ckbuf, def->d.dry_run, steps, out, &resume), st, fail);
    SIM_TRY_GOTO(resume_agrees(&resume, ckbuf), st, fail);
    /* trace_steps names steps of this run: checked before anything is written */
    sim_trace_range tsteps[CLI_TRACE_STEPS_MAX];
    int ntsteps = 0;
    const char *tsteps_text = cfg_str(cm.cfg, "trace_steps");
    SIM_TRY_GOTO(cli_trace_steps_parse(tsteps_text, def->d.dry_run ? 0 : resume.start, def->d.dry_run ? 0 : steps - 1,
                                       tsteps, CLI_TRACE_STEPS_MAX, &ntsteps),
                 st, fail);
    outdir = outbuf;
    const char *metrics_path = cfg_str(cm.cfg, "metrics_file");
    /* under mpirun rank 0 writes every file; the others gather their records to it (sim/xrank.h) */
    bool want_trace = *outdir != '\0';
    if (sim_xrank_rank() > 0) outdir = metrics_path = "";
    if (*metrics_path && def->d.dry_run)
        SIM_TRY_GOTO(sim_err(SIM_ERR_INPUT,
                             "metrics_file=%s: a dry run (dry_run=true or compile_topology) computes no "
                             "losses to write; drop metrics_file or run for real",
                             metrics_path),
                     st, fail);
    /* made now so a bad path fails before training; removed again if the run fails before writing into it */
    made_outdir = *outdir && access(outdir, F_OK) != 0;
    if (*outdir) SIM_TRY_GOTO(cli_artifacts_mkdir(outdir), st, fail);
    if (*ckbuf) SIM_TRY_GOTO(cli_artifacts_mkdir(ckbuf), st, fail);
    /* the hardware profile (hardware_profile or compile_topology's family): the step-time
     * estimate, and the HBM capacity when hbm_limit_gb is left at its default */
    cfg_hw hw;
    model_tm_eff eff;
    bool have_hw = false;
    int per_slice = def->mesh.num_devices / (def->mesh.num_slices > 0 ? def->mesh.num_slices : 1);
    SIM_TRY_GOTO(cfg_hw_from_config(cm.cfg, per_slice, &hw, &have_hw), st, fail);
    if (have_hw) SIM_TRY_GOTO(model_tm_eff_load(cli_configs_dir(), &eff), st, fail);
    const cfg_entry *hbm_e = cfg_find(cm.cfg, "hbm_limit_gb");
    if (have_hw && hbm == 0 && hbm_e && !hbm_e->from_user) hbm = hw.hbm_bytes / 1e9;
    if (def->d.dry_run) steps = 1;                     /* one step: per-step traffic and memory */
    if (def->d.dry_run) sim_host_malloc_many_arenas(); /* this process makes dry runs only */
    config_box(out, &cm, steps);
    if (!def->d.dry_run) {
        model_train_job probe = {0};
        probe.data = &data;
        SIM_TRY_GOTO(model_optim_from_config(cm.cfg, &probe.opt), st, fail);
        SIM_TRY_GOTO(cli_host_memory_fits(cm.def, &probe, hbm, *ckbuf || *resume.path, 0, err), st, fail);
    }
    if (sim_xrank_size() > def->mesh.num_devices && !def->d.dry_run)
        SIM_TRY_GOTO(sim_err(SIM_ERR_INPUT,
                             "%d MPI ranks for a mesh of %d devices: every rank needs a device; launch "
                             "at most %d ranks (mpirun -np %d)",
                             sim_xrank_size(), def->mesh.num_devices, def->mesh.num_devices, def->mesh.num_devices),
                     st, fail);
    SIM_TRY_GOTO(model_machine_new(def, hbm, want_trace, &m), st, fail);
    double watchdog_s = 0;
    SIM_TRY_GOTO(cfg_get_double(cm.cfg, "collective_timeout_s", &watchdog_s), st, fail);
    sim_machine_set_collective_timeout(m, watchdog_s);
    sim_machine_set_record_costs(m, have_hw);
    if (want_trace) { /* devices that cannot fit in trace.json keep no spans (a 256-device dry run: ~250 MB);
                       * on every rank under mpirun: each keeps its devices' spans for rank 0 */
        long long trace_events = 0;
        SIM_TRY_GOTO(cfg_get_int(cm.cfg, "trace_max_events", &trace_events), st, fail);
        sim_trace_set_limit(m, (size_t)trace_events);
        SIM_TRY_GOTO(sim_trace_set_steps(m, tsteps, ntsteps, tsteps_text), st, fail);
    }
    metrics = calloc((size_t)steps, sizeof *metrics);
    if (!metrics)
        SIM_TRY_GOTO(sim_err(SIM_ERR_INPUT,
                             "steps=%lld: the per-step records (%zu bytes a step) do not fit in host "
                             "memory; train fewer steps",
                             steps, sizeof *metrics + sizeof(model_step_stats)),
                     st, fail);
    sp = (step_printer){out, def, metrics, NULL, run_name};
    if (*metrics_path && !(sp.metrics_file = fopen(metrics_path, "w")))
        SIM_TRY_GOTO(sim_err(SIM_ERR_IO, "metrics_file=%s: cannot write it: %s", metrics_path, strerror(errno)), st,
                     fail);
    job.def = def;
    job.data = &data;
    job.steps = steps;
    job.checkpoint_dir = ckbuf;
    job.checkpoint_period = ckpt_period;
    job.load_path = resume.path;
    job.load_full_state = resume.full;
    job.start_step = resume.start;
    job.skip_save_on_start = !on_start;
    job.skip_save_on_completion = !on_completion;
    job.on_step = print_step;
    job.on_layer = print_layer;
    job.cb_arg = &sp;
    job.stats = calloc((size_t)steps, sizeof *job.stats);
    if (def->d.pipe.on) {
        char line[512];
        model_pipe_describe(&def->d.pipe, line, sizeof line);
        fprintf(out, "\n%s\n", line);
    }
    fprintf(out, "\n");
    cli_report_step_header(out);
    if (!job.stats)
        SIM_TRY_GOTO(sim_err(SIM_ERR_INPUT,
                             "steps=%lld: the per-step records do not fit in host memory; train "
                             "fewer steps",
                             steps),
                     st, fail);
    SIM_TRY_GOTO(model_train(&job, m), st, fail);
    if (def->d.pipe.on) {
        const model_pipe *pp = &def->d.pipe;
        fprintf(out,
                "\npipeline bubbles: %lld of %lld iterations per stage (%.1f%% of stage compute, bubbles computed "
                "and discarded)",
                (long long)(pp->delay * (pp->stages - 1)), (long long)model_pipe_iterations(pp),
                100.0 * model_pipe_bubble_fraction(pp));
        if (!def->d.dry_run && def->pipe_layer_ns)
            fprintf(out, "; measured on device 0: %.1f%% of its layer time",
                    100.0 * (double)def->pipe_bubble_ns / (double)def->pipe_layer_ns);
        fprintf(out, "\n");
    }
    cli_records recs;
    cli_records_from_machine(m, &recs);
    SIM_TRY_GOTO(cli_traffic_build(&recs, cli_steps_all(), &traffic), st, fail);
    int nd = sim_machine_num_devices(m);
    mem = calloc((size_t)nd, sizeof *mem);
    SIM_ASSERT(mem);
    cli_memory_collect(m, mem);
    if (debug_sharding) { /* the activations are known once a forward pass has run */
        const char *dt = cfg_str(cm.cfg, "dtype");
        fprintf(out, "\ndebug_sharding:\n");
        model_print_shardings(def, *dt ? dt : "float32", out);
    }
    long long ran = steps - resume.start;
    fprintf(out, "\ntraffic over %lld step%s:\n", ran, ran > 1 ? "s" : "");
    cli_report_traffic(out, &traffic);
    fprintf(out, "\nmemory at peak:\n");
    cli_report_memory(out, mem, nd);
    cli_report_xrank(out, m);
    /* the step-time model, on the last step (every step moves the same bytes) */
    if (have_hw) {
        double opt_bytes = model_opt_step_bytes(def);
        double bubble = def->d.pipe.on ? model_pipe_bubble_fraction(&def->d.pipe) : 0.0;
        const char *dt = cfg_str(cm.cfg, "dtype");
        sim_status est =
            model_tm_estimate(&hw, &eff, dt, m, (int)steps - 1, bubble, opt_bytes, def->d.dry_run && *outdir, &tm);
        const char *note = NULL;
        model_hw_peak(&hw, dt, &note);
        if (!est) {
            fprintf(out, "\n");
            model_tm_print(out, &hw, sim_machine_mesh(m), &tm);
            if (note) fprintf(out, "  note: dtype=%s: %s\n", dt, note);
            cfg_jw tw;
            cfg_jw_init(&tw);
            model_tm_json(&tw, &hw, sim_machine_mesh(m), &tm);
            tm_json = cfg_jw_take(&tw);
        } else { /* a figure the profile does not publish: say so, the run itself succeeded */
            fprintf(out, "\nstep time not estimated: %s\n", sim_errmsg());
            sim_err_clear();
        }
    }
    trace_steps ts = {tsteps, ntsteps, tsteps_text};
    if (*outdir)
        SIM_TRY_GOTO(write_artifacts(&cm, argc, argv, outdir, metrics + resume.start, (int)(steps - resume.start), m,
                                     &recs, &traffic, mem, have_hw ? &hw : NULL, &tm, tm_json, &ts, out),
                     st, fail);
fail:
    if (st != SIM_OK) rc = cli_fail(err, st);
    if (rc && made_outdir) rmdir(outdir); /* only succeeds while it is still empty */
    free(tm.spans);
    json_decref(tm_json);
    cli_traffic_free(&traffic);
    free(mem);
    if (sp.metrics_file) fclose(sp.metrics_file);
    free(job.stats);
    free(metrics);
    sim_machine_free(m);
    model_data_close(&data);
    model_close(&cm);
    return rc;
}

/* ------------------------------------------------------------ dump */

typedef struct {
    const model_def *def;
} dump_job;

static sim_status dump_device(sim_device *dev, void *arg)
{
    dump_job *job = arg;
    model_dev md;
    SIM_TRY(model_dev_init(&md, job->def, dev, false, false));
    model_batch b;
    sim_status st = model_batch_load(&md, NULL, NULL, NULL, &b);
    mesh_tape *t = mesh_tape_new(&md.ctx, false);
    mesh_var *loss;
    if (st == SIM_OK) st = model_loss(&md, t, &b, &loss);
    mesh_tape_free(t);
    if (b.tokens.rank) model_batch_free(&md, &b);
    model_dev_free(&md);
    return st;
}

int cli_dump(int argc, char **argv, FILE *out, FILE *err)
{
    const char *extra[] = {"dry_run=true"};
    cli_model cm;
    sim_status st = model_open(argc, argv, extra, 1, &cm);
    const char *outdir = st ? "" : cfg_str(cm.cfg, "output_dir");
    if (!st && !*outdir) st = sim_err(SIM_ERR_INPUT, "dump needs output_dir=DIR to write the sharding files into");
    sim_machine *m = NULL;
    if (!st) st = model_machine_new(cm.def, 0, false, &m);
    dump_job job = {cm.def};
    if (!st) st = sim_machine_run(m, dump_device, &job);
    if (!st) st = write_dump(outdir, cm.cfg, cm.def);
    int rc = 0;
    if (st) rc = cli_fail(err, st);
    else
        fprintf(out,
                "wrote named_shardings.json, logical_shardings.json, input_shardings.json and shardings.json (%d "
                "parameters, %d activations) to %s\n",
                cm.def->nparams, cm.def->nacts, outdir);
    sim_machine_free(m);
    model_close(&cm);
    return rc;
}
