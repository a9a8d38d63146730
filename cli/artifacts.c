/* artifacts.c — the files of output_dir=DIR (see artifacts.h).
 *
 * JSON is built as a libjansson tree and dumped by jansson with the layout
 * of Python's json.dumps(obj, indent=2) (one item per line, ": " after a
 * key, "[]"/"{}" for empty containers, non-ASCII as \uXXXX, no final
 * newline), so the MaxText sharding dump comes out byte for byte as
 * sharding_dump.py writes it.
 * Files are written to DIR/.NAME.tmp.<pid>.<n> and renamed into place. */
#include "blas_kernels/bk_coretype.h"
#include "cli/artifacts.h"

#include <errno.h>
#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "sim/textout.h"
#include "sim/trace.h"

/* ======================================================================== */
/* files                                                                    */
/* ======================================================================== */

sim_status cli_artifacts_mkdir(const char *dir)
{
    char path[PATH_MAX];
    if (!dir || !*dir) return sim_err(SIM_ERR_IO, "output directory is empty; set output_dir=DIR");
    if (strlen(dir) >= sizeof path) return sim_err(SIM_ERR_IO, "output directory '%s' is too long", dir);
    snprintf(path, sizeof path, "%s", dir);
    /* Create each prefix ending at a '/', then the whole path. */
    for (char *p = path + 1;; p++) {
        if (*p != '/' && *p != '\0') continue;
        char saved = *p;
        *p = '\0';
        if (mkdir(path, 0777) != 0 && errno != EEXIST) {
            int e = errno;
            return sim_err(SIM_ERR_IO, "cannot create directory '%s' (for '%s'): %s", path, dir, strerror(e));
        }
        *p = saved;
        if (!saved) break;
    }
    struct stat st;
    if (stat(dir, &st) != 0 || !S_ISDIR(st.st_mode))
        return sim_err(SIM_ERR_IO, "'%s' exists and is not a directory; choose another output_dir", dir);
    return SIM_OK;
}

static atomic_uint tmp_counter;

sim_status cli_artifact_write(const char *dir, const char *name, cli_write_fn fn, void *arg)
{
    char final[PATH_MAX], tmp[PATH_MAX];
    int nf = snprintf(final, sizeof final, "%s/%s", dir, name);
    int nt =
        snprintf(tmp, sizeof tmp, "%s/.%s.tmp.%ld.%u", dir, name, (long)getpid(), atomic_fetch_add(&tmp_counter, 1u));
    if (nf < 0 || nt < 0 || (size_t)nf >= sizeof final || (size_t)nt >= sizeof tmp)
        return sim_err(SIM_ERR_IO, "path '%s/%s' is too long", dir, name);
    SIM_TRY(cli_artifacts_mkdir(dir));
    FILE *f = fopen(tmp, "w");
    if (!f) {
        int e = errno;
        return sim_err(SIM_ERR_IO, "cannot write '%s': %s", final, strerror(e));
    }
    sim_status st = fn(f, arg);
    int werr = ferror(f);
    int e = errno;
    if (fclose(f) != 0 && !werr) {
        werr = 1;
        e = errno;
    }
    if (st == SIM_OK && werr) st = sim_err(SIM_ERR_IO, "writing '%s' failed: %s", final, strerror(e));
    else if (st != SIM_OK) sim_err_append(" (writing '%s')", final); /* the writer does not know the path */
    if (st == SIM_OK && rename(tmp, final) != 0) {
        e = errno;
        st = sim_err(SIM_ERR_IO, "cannot rename '%s' to '%s': %s", tmp, final, strerror(e));
    }
    if (st != SIM_OK) {
        unlink(tmp);
        sim_err_trace(__FILE__, __LINE__);
    }
    return st;
}

/* ======================================================================== */
/* CSV                                                                      */
/* ======================================================================== */

static void csv_field(FILE *f, const char *s)
{
    if (!strpbrk(s, ",\"\n\r")) {
        fputs(s, f);
        return;
    }
    fputc('"', f);
    for (; *s; s++) {
        if (*s == '"') fputc('"', f);
        fputc(*s, f);
    }
    fputc('"', f);
}

/* ======================================================================== */
/* collectives.csv and traffic.csv                                          */
/* ======================================================================== */

typedef struct {
    const cli_records *recs;
    cli_step_range steps;
    int n_devices; /* devices written (whole devices, from device 0) */
} csv_args;

/* csv_field on a textout */
static void csv_field_out(sim_textout *o, const char *s)
{
    if (!strpbrk(s, ",\"\n\r")) {
        sim_textout_str(o, s);
        return;
    }
    sim_textout_char(o, '"');
    for (; *s; s++) {
        if (*s == '"') sim_textout_char(o, '"');
        sim_textout_char(o, *s);
    }
    sim_textout_char(o, '"');
}

/* One line per record, formatted by hand (sim/textout.h): a 256-device run writes
 * hundreds of thousands of lines on one thread at the end. */
static sim_status write_collectives(FILE *f, void *arg)
{
    const csv_args *a = arg;
    const cli_records *r = a->recs;
    char ax[256];
    sim_textout *o = malloc(sizeof *o);
    if (!o) return sim_err(SIM_ERR_OOM, "collectives.csv: out of host memory");
    sim_textout_init(o, f);
    sim_textout_str(o, "device,step,phase,tag,op,mesh_axes,group_size,dtype,elements,bytes_sent,bytes_recv,kind,"
                       "bytes_sent_dcn\n");
    for (int d = 0; d < a->n_devices; d++) {
        sim_axes last = {-1, {0}}; /* the axes text of the previous record, kept */
        sim_walk w;
        cli_records_walk(r, d, &w);
        for (const sim_record *x; (x = sim_walk_next_record(&w));) {
            if (x->step < a->steps.first || x->step > a->steps.last) continue;
            sim_textout_i64(o, d);
            sim_textout_char(o, ',');
            sim_textout_i64(o, x->step);
            sim_textout_char(o, ',');
            sim_textout_str(o, sim_phase_name(x->phase));
            sim_textout_char(o, ',');
            csv_field_out(o, x->tag[0] ? x->tag : "-");
            sim_textout_char(o, ',');
            sim_textout_str(o, sim_op_name(x->op));
            sim_textout_char(o, ',');
            if (last.n != x->axes.n || memcmp(last.axis, x->axes.axis, (size_t)x->axes.n * sizeof *x->axes.axis)) {
                cli_axes_text(&r->mesh, x->axes, ax, sizeof ax);
                last = x->axes;
            }
            csv_field_out(o, ax);
            sim_textout_char(o, ',');
            sim_textout_i64(o, x->group_size);
            sim_textout_char(o, ',');
            sim_textout_str(o, sim_dtype_name(x->dtype));
            sim_textout_char(o, ',');
            sim_textout_u64(o, x->elements);
            sim_textout_char(o, ',');
            sim_textout_u64(o, x->bytes_sent);
            sim_textout_char(o, ',');
            sim_textout_u64(o, x->bytes_recv);
            sim_textout_str(o, x->implicit ? ",implicit," : ",explicit,");
            sim_textout_u64(o, x->bytes_sent_dcn);
            sim_textout_char(o, '\n');
        }
    }
    sim_textout_flush(o);
    free(o);
    return SIM_OK;
}

int cli_collectives_csv_devices(const cli_records *recs, cli_step_range steps, size_t max_rows)
{
    if (!max_rows) return recs->n_devices;
    size_t rows = 0;
    int n = 0;
    for (int d = 0; d < recs->n_devices; d++) {
        sim_walk w;
        cli_records_walk(recs, d, &w);
        for (const sim_record *x; (x = sim_walk_next_record(&w));) rows += x->step >= steps.first && x->step <= steps.last;
        if (d > 0 && rows > max_rows) break;
        n++;
    }
    return n;
}

sim_status cli_write_collectives_csv(const char *dir, const cli_records *recs, cli_step_range steps, size_t max_rows)
{
    csv_args a = {recs, steps, cli_collectives_csv_devices(recs, steps, max_rows)};
    return cli_artifact_write(dir, "collectives.csv", write_collectives, &a);
}

static void traffic_csv_row(FILE *f, const char *op, const char *axes, const char *phase, const cli_traffic_row *r,
                            int nd)
{
    csv_field(f, op);
    fputc(',', f);
    csv_field(f, axes);
    fputc(',', f);
    csv_field(f, phase);
    fprintf(f, ",%llu,%.6g,%.17g,%llu,%llu,%.6f,%.17g\n", (unsigned long long)r->calls,
            nd ? (double)r->calls / nd : 0.0, r->bytes_mean, (unsigned long long)r->bytes_max,
            (unsigned long long)r->bytes, r->share, nd ? (double)r->bytes_dcn / nd : 0.0);
}

static sim_status write_traffic(FILE *f, void *arg)
{
    const cli_traffic *t = arg;
    char ax[256];
    fputs("op,mesh_axes,phase,calls,calls_per_device,bytes_per_device_mean,bytes_per_device_max,bytes_total,share,"
          "bytes_per_device_dcn_mean\n",
          f);
    for (int i = 0; i < t->n_rows; i++) {
        const cli_traffic_row *r = &t->rows[i];
        traffic_csv_row(f, sim_op_name(r->op), cli_axes_text(&t->mesh, r->axes, ax, sizeof ax),
                        sim_phase_name(r->phase), r, t->n_devices);
    }
    return SIM_OK; /* no total row: a sum over the rows is one line of any tool */
}

sim_status cli_write_traffic_csv(const char *dir, const cli_traffic *t)
{
    return cli_artifact_write(dir, "traffic.csv", write_traffic, (void *)t);
}

/* ======================================================================== */
/* metrics.json                                                             */
/* ======================================================================== */

typedef struct {
    const cli_step_metrics *steps;
    int n_steps;
    const sim_arena_stats *stats;
    int n_devices;
} metrics_args;

/* Memory per device as metrics.json and parity.json show it: the peaks, the capacities and each
 * category's bytes at the peak, one array entry per device. */
static void memory_json(cfg_jw *w, const sim_arena_stats *stats, int n_devices)
{
    cfg_jw_obj(w);
    cfg_jw_key(w, "per_device_peak_bytes");
    cfg_jw_arr(w);
    for (int d = 0; d < n_devices; d++) cfg_jw_u64(w, stats[d].peak);
    cfg_jw_end(w);
    cfg_jw_key(w, "capacity_bytes");
    cfg_jw_arr(w);
    for (int d = 0; d < n_devices; d++) cfg_jw_u64(w, stats[d].capacity);
    cfg_jw_end(w);
    cfg_jw_key(w, "by_category");
    cfg_jw_obj(w);
    for (int c = 0; c < SIM_NMEM; c++) {
        cfg_jw_key(w, sim_mem_cat_name((sim_mem_cat)c));
        cfg_jw_arr(w);
        for (int d = 0; d < n_devices; d++) cfg_jw_u64(w, stats[d].at_peak_by[c]);
        cfg_jw_end(w);
    }
    cfg_jw_end(w);
    cfg_jw_end(w);
}

static sim_status write_metrics(FILE *f, void *arg)
{
    const metrics_args *a = arg;
    cfg_jw w;
    cfg_jw_init(&w);
    cfg_jw_obj(&w);
    cfg_jw_key(&w, "steps");
    cfg_jw_arr(&w);
    for (int i = 0; i < a->n_steps; i++) {
        const cli_step_metrics *s = &a->steps[i];
        cfg_jw_obj(&w);
        cfg_jw_key(&w, "step");
        cfg_jw_int(&w, s->step);
        cfg_jw_key(&w, "loss");
        if (s->dry) cfg_jw_null(&w);
        else cfg_jw_double(&w, s->loss);
        if (s->has_mtp) { /* the multi-token prediction part of loss (MaxText's learning/mtp_loss) */
            cfg_jw_key(&w, "mtp_loss");
            if (s->dry) cfg_jw_null(&w);
            else cfg_jw_double(&w, s->mtp_loss);
        }
        cfg_jw_key(&w, "grad_norm"); /* after clipping, raw_grad_norm before: MaxText's learning/ names */
        if (s->dry) cfg_jw_null(&w);
        else cfg_jw_double(&w, s->grad_norm);
        cfg_jw_key(&w, "raw_grad_norm");
        if (s->dry) cfg_jw_null(&w);
        else cfg_jw_double(&w, s->raw_grad_norm);
        cfg_jw_key(&w, "lr");
        cfg_jw_double(&w, s->lr);
        cfg_jw_key(&w, "time_s");
        cfg_jw_double(&w, s->time_s);
        cfg_jw_key(&w, "tokens_per_s");
        if (s->dry) cfg_jw_null(&w); /* a dry run computes nothing */
        else cfg_jw_double(&w, s->tokens_per_s);
        cfg_jw_key(&w, "peak_bytes");
        cfg_jw_u64(&w, s->peak_bytes);
        cfg_jw_end(&w);
    }
    cfg_jw_end(&w);
    cfg_jw_key(&w, "memory");
    memory_json(&w, a->stats, a->n_devices);
    cfg_jw_end(&w);
    cfg_jw_write(&w, f, CFG_JW_INDENT2, 17);
    fputc('\n', f);
    return SIM_OK;
}

sim_status cli_write_metrics_json(const char *dir, const cli_step_metrics *steps, int n_steps,
                                  const sim_arena_stats *stats, int n_devices)
{
    metrics_args a = {steps, n_steps, stats, stats ? n_devices : 0};
    return cli_artifact_write(dir, "metrics.json", write_metrics, &a);
}

/* ======================================================================== */
/* run.json                                                                 */
/* ======================================================================== */

/* One config entry as run.json shows it: key: {value, source[, why]}. */
static void entry_json(cfg_jw *w, const cfg_entry *e, bool why)
{
    cfg_jw_key(w, e->key);
    cfg_jw_obj(w);
    cfg_jw_key(w, "value");
    cfg_value_json(w, &e->value);
    cfg_jw_key(w, "source");
    cfg_jw_str(w, e->where ? e->where : "");
    if (why) {
        cfg_jw_key(w, "why");
        cfg_jw_str(w, e->why ? e->why : "");
    }
    cfg_jw_end(w);
}

static sim_status write_run(FILE *f, void *arg)
{
    const cli_run_info *in = arg;
    cfg_jw w;
    cfg_jw_init(&w);
    cfg_jw_obj(&w);
    cfg_jw_key(&w, "shardsim_version");
    cfg_jw_str(&w, in->version ? in->version : CLI_SHARDSIM_VERSION);
    time_t t = in->time ? in->time : time(NULL);
    struct tm tm;
    char ts[64] = "";
    if (gmtime_r(&t, &tm)) strftime(ts, sizeof ts, "%Y-%m-%dT%H:%M:%SZ", &tm);
    cfg_jw_key(&w, "time");
    cfg_jw_str(&w, ts);
    cfg_jw_key(&w, "command");
    cfg_jw_str(&w, in->command);
    cfg_jw_key(&w, "argv");
    cfg_jw_arr(&w);
    for (int i = 0; i < in->argc; i++) cfg_jw_str(&w, in->argv[i]);
    cfg_jw_end(&w);
    { /* the OpenBLAS kernels that ran: results are bitwise reproducible per machine and kernel */
        const bk_coretype_info *k = bk_coretype_current();
        cfg_jw_key(&w, "blas_kernels");
        cfg_jw_obj(&w);
        cfg_jw_key(&w, "core");
        cfg_jw_str(&w, k->core);
        cfg_jw_key(&w, "openblas_detected");
        cfg_jw_str(&w, k->detected);
        cfg_jw_key(&w, "failed_check");
        cfg_jw_str(&w, k->failed);
        cfg_jw_key(&w, "checked");
        cfg_jw_bool(&w, k->checked);
        cfg_jw_key(&w, "summary");
        cfg_jw_str(&w, k->summary);
        cfg_jw_end(&w);
    }
    if (in->mesh) {
        const mesh_shape *m = in->mesh;
        cfg_jw_key(&w, "mesh");
        cfg_jw_obj(&w);
        cfg_jw_key(&w, "axis_names");
        cfg_jw_arr(&w);
        for (int a = 0; a < m->n_axes; a++) cfg_jw_str(&w, m->names[a]);
        cfg_jw_end(&w);
        const char *what[3] = {"shape", "ici", "dcn"};
        const int *vals[3] = {m->sizes, m->ici, m->dcn};
        for (int k = 0; k < 3; k++) {
            cfg_jw_key(&w, what[k]);
            cfg_jw_obj(&w);
            for (int a = 0; a < m->n_axes; a++) {
                cfg_jw_key(&w, m->names[a]);
                cfg_jw_int(&w, vals[k][a]);
            }
            cfg_jw_end(&w);
        }
        cfg_jw_key(&w, "num_devices");
        cfg_jw_int(&w, m->num_devices);
        cfg_jw_key(&w, "num_slices");
        cfg_jw_int(&w, m->num_slices);
        cfg_jw_end(&w);
    }
    if (in->rules) {
        cfg_jw_key(&w, "logical_axis_rules");
        cfg_jw_arr(&w);
        for (int i = 0; i < in->rules->n; i++) {
            const mesh_rule *r = &in->rules->rules[i];
            cfg_jw_arr(&w);
            cfg_jw_str(&w, r->name);
            cfg_jw_arr(&w);
            for (int j = 0; j < r->n_axes; j++) cfg_jw_str(&w, r->axes[j]);
            cfg_jw_end(&w);
            cfg_jw_end(&w);
        }
        cfg_jw_end(&w);
    }
    if (in->cfg && in->cfg->keys_file) {
        /* the key contract: inert keys that were set (accepted, no effect on
         * the simulation), with the reason */
        cfg_jw_key(&w, "inert_keys_set");
        cfg_jw_obj(&w);
        for (int i = 0; i < in->cfg->n; i++) {
            const cfg_entry *e = &in->cfg->entries[i];
            if (e->cls != CFG_KEY_INERT || !e->changed) continue;
            entry_json(&w, e, true);
        }
        cfg_jw_end(&w);
    }
    if (in->wire_gather) { /* the hardware profile's compiler rule (model_hw_wire_dtypes) */
        cfg_jw_key(&w, "weight_collective_dtypes");
        cfg_jw_obj(&w);
        cfg_jw_key(&w, "weight_gather");
        cfg_jw_str(&w, in->wire_gather);
        cfg_jw_key(&w, "gradient_reduction");
        cfg_jw_str(&w, in->wire_reduce ? in->wire_reduce : "");
        cfg_jw_key(&w, "rule");
        cfg_jw_str(&w, in->wire_rule ? in->wire_rule : "");
        cfg_jw_end(&w);
    }
    if (in->compiler_rules) { /* model_xla_rules_text: docs/xla-fidelity.md */
        cfg_jw_key(&w, "compiler_rules");
        cfg_jw_str(&w, in->compiler_rules);
    }
    if (in->step_time_model) {
        cfg_jw_key(&w, "step_time_model");
        cfg_jw_tree(&w, json_incref(in->step_time_model));
    }
    if (in->cfg) {
        cfg_jw_key(&w, "config");
        cfg_jw_obj(&w);
        for (int i = 0; i < in->cfg->n; i++) {
            const cfg_entry *e = &in->cfg->entries[i];
            entry_json(&w, e, false);
        }
        cfg_jw_end(&w);
    }
    cfg_jw_end(&w);
    cfg_jw_write(&w, f, CFG_JW_INDENT2, 17);
    fputc('\n', f);
    return SIM_OK;
}

sim_status cli_write_run_json(const char *dir, const cli_run_info *info)
{
    return cli_artifact_write(dir, "run.json", write_run, (void *)info);
}

typedef struct {
    sim_machine *m;
    size_t max_events;
} trace_args;

static sim_status write_trace(FILE *f, void *arg)
{
    const trace_args *a = arg;
    return sim_trace_write_chrome(a->m, f, a->max_events);
}

sim_status cli_write_trace_json(const char *dir, sim_machine *m, size_t max_events)
{
    trace_args a = {m, max_events};
    return cli_artifact_write(dir, "trace.json", write_trace, &a);
}

/* A step number of trace_steps: digits only, within the run's steps. */
static sim_status trace_step_number(const char *text, const char *tok, size_t len, int64_t first, int64_t last,
                                    int64_t *out)
{
    int64_t v = 0;
    bool ok = len > 0 && len <= 18;
    for (size_t i = 0; ok && i < len; i++) {
        ok = tok[i] >= '0' && tok[i] <= '9';
        v = v * 10 + (tok[i] - '0');
    }
    if (!ok)
        return sim_err(SIM_ERR_INPUT,
                       "trace_steps=%s: '%.*s' is not a step: expected a comma-separated list of first, "
                       "last, all, none, a step number N or a range A-B, e.g. trace_steps=first,last or "
                       "trace_steps=0,5-7,last",
                       text, (int)len, tok);
    if (v < first || v > last)
        return sim_err(SIM_ERR_INPUT,
                       "trace_steps=%s: step %lld is not a step of this run, which trains steps "
                       "%lld-%lld; name steps in that range (or first, last)",
                       text, (long long)v, (long long)first, (long long)last);
    *out = v;
    return SIM_OK;
}

sim_status cli_trace_steps_parse(const char *text, int64_t first, int64_t last, sim_trace_range *r, int cap, int *n)
{
    *n = 0;
    const char *p = text;
    while (true) {
        while (*p == ' ') p++;
        const char *tok = p;
        size_t len = strcspn(p, ",");
        const char *next = p + len;
        while (len && tok[len - 1] == ' ') len--;
        if (!len)
            return sim_err(SIM_ERR_INPUT,
                           "trace_steps=%s: an empty item; expected a comma-separated list of first, "
                           "last, all, none, a step number N or a range A-B (trace_steps=first,last "
                           "is the default)",
                           text);
        if (*n == cap)
            return sim_err(SIM_ERR_INPUT,
                           "trace_steps=%s: more than %d items; join neighbouring steps into ranges "
                           "A-B",
                           text, cap);
        sim_trace_range *x = &r[*n];
        const char *dash = memchr(tok, '-', len);
        if (len == 5 && !strncmp(tok, "first", 5)) {
            x->first = x->last = first;
        } else if (len == 4 && !strncmp(tok, "last", 4)) {
            x->first = x->last = last;
        } else if (len == 3 && !strncmp(tok, "all", 3)) {
            x->first = first;
            x->last = last;
        } else if (len == 4 && !strncmp(tok, "none", 4)) {
            x->first = 1; /* an empty range: no step */
            x->last = 0;
        } else if (dash) {
            SIM_TRY(trace_step_number(text, tok, (size_t)(dash - tok), first, last, &x->first));
            SIM_TRY(trace_step_number(text, dash + 1, len - (size_t)(dash - tok) - 1, first, last, &x->last));
            if (x->first > x->last)
                return sim_err(SIM_ERR_INPUT,
                               "trace_steps=%s: the range %lld-%lld is empty; write it from the "
                               "lower step to the higher (%lld-%lld)",
                               text, (long long)x->first, (long long)x->last, (long long)x->last, (long long)x->first);
        } else {
            SIM_TRY(trace_step_number(text, tok, len, first, last, &x->first));
            x->last = x->first;
        }
        (*n)++;
        if (!*next) break;
        p = next + 1;
    }
    return SIM_OK;
}

const char *cli_trace_steps_text(const sim_trace_range *r, int n, char *buf, size_t cap)
{
    size_t k = 0;
    buf[0] = '\0';
    for (int i = 0; i < n && k < cap; i++) {
        if (r[i].first > r[i].last) continue; /* none */
        const char *sep = k ? ", " : "";
        if (r[i].first == r[i].last) k += (size_t)snprintf(buf + k, cap - k, "%s%lld", sep, (long long)r[i].first);
        else k += (size_t)snprintf(buf + k, cap - k, "%s%lld-%lld", sep, (long long)r[i].first, (long long)r[i].last);
    }
    if (!k) snprintf(buf, cap, "none");
    return buf;
}

/* ======================================================================== */
/* sharding dump                                                            */
/* ======================================================================== */

/* snprintf-style appender: *n counts what is needed, buf holds what fits. */
static void put_text(char *buf, size_t cap, size_t *n, const char *s, size_t len)
{
    for (size_t i = 0; i < len; i++, (*n)++)
        if (*n + 1 < cap) buf[*n] = s[i];
    if (cap) buf[*n + 1 < cap ? *n : cap - 1] = '\0';
}

int cli_dump_keystr(const char *path, char *buf, size_t cap)
{
    if (path[0] == '.') return snprintf(buf, cap, "%s", path);
    size_t n = 0;
    if (cap) buf[0] = '\0';
    const char *prefix = ".params/['params']";
    put_text(buf, cap, &n, prefix, strlen(prefix));
    const char *s = path;
    /* the leading "params" names the collection, which the prefix already says */
    if (!strncmp(s, "params", 6) && (s[6] == '.' || s[6] == '/' || s[6] == '\0')) s += 6;
    while (*s) {
        while (*s == '.' || *s == '/') s++;
        if (!*s) break;
        size_t len = strcspn(s, "./");
        put_text(buf, cap, &n, "/['", 3);
        put_text(buf, cap, &n, s, len);
        put_text(buf, cap, &n, "']", 2);
        s += len;
    }
    return (int)n;
}

enum { KEY_CAP = 1024 };

/* One leaf of the dump as written: key, entry (NULL for a scalar count/step). */
typedef struct {
    char key[KEY_CAP];
    const cli_dump_param *p; /* NULL: rank-0 leaf (.step, .count) */
    int opt;                 /* an Adam moment: uses opt_spec when given */
    int64_t len;             /* p == NULL: 0 for a scalar, else a replicated vector of len (ns_coeffs) */
} leaf;

/* Sort key of a parameter: its path components joined by '\x01', which sorts
 * below every printable byte, so strcmp orders component by component as
 * JAX flattens a dict (keys sorted). */
typedef struct {
    char sort[KEY_CAP];
    char rel[KEY_CAP]; /* keystr after ".params/['params']" */
    int index;
} param_key;

static int param_key_cmp(const void *a, const void *b)
{
    const param_key *x = a, *y = b;
    int c = strcmp(x->sort, y->sort);
    return c ? c : x->index - y->index;
}

static sim_status param_rel(const cli_dump_param *p, param_key *k)
{
    char key[KEY_CAP];
    if (cli_dump_keystr(p->path, key, sizeof key) >= (int)sizeof key)
        return sim_err(SIM_ERR_INPUT, "sharding dump: parameter path '%.200s...' is too long", p->path);
    const char *prefix = ".params/['params']";
    if (strncmp(key, prefix, strlen(prefix)))
        return sim_err(SIM_ERR_INPUT,
                       "sharding dump: '%s' is not a parameter; the train-state dump takes parameter paths "
                       "(\"params.decoder...\" or \".params/['params']/...\")",
                       p->path);
    snprintf(k->rel, sizeof k->rel, "%s", key + strlen(prefix));
    /* "/['a']/['b']" -> "a\x01b" */
    size_t n = 0;
    for (const char *s = k->rel; *s && n + 1 < sizeof k->sort;) {
        if (!strncmp(s, "/['", 3)) {
            if (n) k->sort[n++] = '\x01';
            s += 3;
        } else if (!strncmp(s, "']", 2)) {
            s += 2;
        } else {
            k->sort[n++] = *s++;
        }
    }
    k->sort[n] = '\0';
    return SIM_OK;
}

/* The optimizer row's leaves into the dump's list (model_opt_tree.leaf). */
typedef struct {
    leaf *l;
    int *k;
    int cap;
    const param_key *pk; /* the parameters in JAX order: index into the entries */
    const cli_dump_param *p;
} opt_leaves;

static sim_status opt_leaf(void *arg, const char *key, int param, int64_t len)
{
    opt_leaves *o = arg;
    if (*o->k >= o->cap)
        return sim_err(SIM_ERR_INTERNAL, "sharding dump: the optimizer lists more than %d leaves", o->cap);
    leaf *x = &o->l[(*o->k)++];
    snprintf(x->key, KEY_CAP, "%s", key);
    x->p = param >= 0 ? &o->p[o->pk[param].index] : NULL;
    x->opt = param >= 0;
    x->len = param >= 0 ? 0 : len;
    return SIM_OK;
}

/* The leaves in file order. */
static sim_status dump_leaves(const cli_dump_param *p, int n, cli_dump_mode mode, leaf **out, int *n_out)
{
    int cap = mode == CLI_DUMP_TRAIN_STATE ? (1 + MODEL_OPT_SLOTS_MAX) * n + 8 : n;
    leaf *l = calloc((size_t)cap + 1, sizeof *l);
    SIM_ASSERT(l);
    int k = 0;
    if (mode == CLI_DUMP_AS_GIVEN) {
        for (int i = 0; i < n; i++) {
            if (cli_dump_keystr(p[i].path, l[k].key, KEY_CAP) >= KEY_CAP) {
                free(l);
                return sim_err(SIM_ERR_INPUT, "sharding dump: path '%.200s...' is too long", p[i].path);
            }
            l[k++].p = &p[i];
        }
    } else {
        param_key *pk = calloc((size_t)n + 1, sizeof *pk);
        SIM_ASSERT(pk);
        for (int i = 0; i < n; i++) {
            sim_status st = param_rel(&p[i], &pk[i]);
            if (st != SIM_OK) {
                free(pk);
                free(l);
                return st;
            }
            pk[i].index = i;
        }
        qsort(pk, (size_t)n, sizeof *pk, param_key_cmp);
        snprintf(l[k++].key, KEY_CAP, ".step");
        for (int i = 0; i < n; i++) {
            snprintf(l[k].key, KEY_CAP, ".params/['params']%.900s", pk[i].rel);
            l[k++].p = &p[pk[i].index];
        }
        /* the optimizer's state: its row lists the leaves (models/optimizers/optim.h) */
        const char **rel = calloc((size_t)n + 1, sizeof *rel);
        bool *stateless = calloc((size_t)n + 1, sizeof *stateless);
        int *branch = calloc((size_t)n + 1, sizeof *branch);
        SIM_ASSERT(rel && stateless && branch);
        for (int i = 0; i < n; i++) {
            rel[i] = pk[i].rel;
            stateless[i] = p[pk[i].index].no_opt;
            branch[i] = p[pk[i].index].branch;
        }
        opt_leaves ol = {l, &k, cap, pk, p};
        const model_opt_tree t = {n, rel, stateless, branch, opt_leaf, &ol};
        sim_status st = model_opt_tree_write(n > 0 ? p[0].opt : NULL, &t);
        free(rel);
        free(stateless);
        free(branch);
        free(pk);
        if (st != SIM_OK) {
            free(l);
            return st;
        }
    }
    *out = l;
    *n_out = k;
    return SIM_OK;
}

static void jw_shape(cfg_jw *w, int rank, const int64_t *shape)
{
    cfg_jw_arr(w);
    for (int d = 0; d < rank; d++) cfg_jw_int(w, (long long)shape[d]);
    cfg_jw_end(w);
}

static sim_status check_param(const leaf *l, const mesh_shape *m)
{
    const cli_dump_param *p = l->p;
    const mesh_spec *s = l->opt && p->has_opt_spec ? &p->opt_spec : &p->spec;
    if (p->rank < 0 || p->rank > MESH_SPEC_MAX_RANK)
        return sim_err(SIM_ERR_INPUT, "sharding dump: '%s' has rank %d (at most %d)", l->key, p->rank,
                       MESH_SPEC_MAX_RANK);
    if (m && s->rank != p->rank)
        return sim_err(SIM_ERR_INPUT, "sharding dump: '%s' has rank %d but its spec has %d dims", l->key, p->rank,
                       s->rank);
    if (m) {
        sim_status st = mesh_spec_check(s, m);
        if (st != SIM_OK) {
            sim_err_append(" (sharding dump entry '%s')", l->key);
            return st;
        }
    }
    return SIM_OK;
}

static void jw_mesh(cfg_jw *w, const mesh_shape *m)
{
    cfg_jw_key(w, "mesh");
    cfg_jw_obj(w);
    cfg_jw_key(w, "axis_names");
    cfg_jw_arr(w);
    for (int a = 0; a < m->n_axes; a++) cfg_jw_str(w, m->names[a]);
    cfg_jw_end(w);
    cfg_jw_key(w, "shape");
    cfg_jw_obj(w);
    for (int a = 0; a < m->n_axes; a++) {
        cfg_jw_key(w, m->names[a]);
        cfg_jw_int(w, m->sizes[a]);
    }
    cfg_jw_end(w);
    cfg_jw_end(w);
}

/* named (m != NULL) or logical (m == NULL) shardings. */
static sim_status dump_state(cfg_jw *w, const mesh_shape *m, const cli_dump_param *p, int n, cli_dump_mode mode)
{
    leaf *l = NULL;
    int nl = 0;
    SIM_TRY(dump_leaves(p, n, mode, &l, &nl));
    for (int i = 0; i < nl; i++) {
        if (!l[i].p) continue;
        sim_status st = check_param(&l[i], m);
        if (st != SIM_OK) {
            free(l);
            return st;
        }
    }
    cfg_jw_obj(w);
    for (int i = 0; i < nl; i++) {
        const cli_dump_param *q = l[i].p;
        int rank = q ? q->rank : 0;
        cfg_jw_key(w, l[i].key);
        cfg_jw_obj(w);
        if (m) jw_mesh(w, m);
        cfg_jw_key(w, "partition_spec");
        cfg_jw_arr(w);
        if (m && q) {
            const mesh_spec *s = l[i].opt && q->has_opt_spec ? &q->opt_spec : &q->spec;
            for (int d = 0; d < rank; d++) {
                if (s->n_axes[d] == 0) {
                    cfg_jw_null(w);
                } else if (s->n_axes[d] == 1) {
                    cfg_jw_str(w, m->names[s->axes[d][0]]);
                } else {
                    cfg_jw_arr(w);
                    for (int j = 0; j < s->n_axes[d]; j++) cfg_jw_str(w, m->names[s->axes[d][j]]);
                    cfg_jw_end(w);
                }
            }
        } else if (q) {
            for (int d = 0; d < rank; d++) cfg_jw_str(w, q->logical[d]);
        }
        cfg_jw_end(w);
        cfg_jw_key(w, "shape");
        if (!q && l[i].len) {
            jw_shape(w, 1, &l[i].len);
        } else {
            jw_shape(w, rank, q ? q->shape : NULL);
        }
        cfg_jw_end(w);
    }
    cfg_jw_end(w);
    free(l);
    return SIM_OK;
}

/* One dump document to f (Python's json.dumps(indent=2) layout). */
static sim_status dump_to_file(FILE *f, cfg_jw *w, sim_status st)
{
    if (st == SIM_OK) cfg_jw_write(w, f, CFG_JW_INDENT2, 17);
    else cfg_jw_discard(w);
    return st;
}

sim_status cli_dump_named(FILE *f, const mesh_shape *m, const cli_dump_param *p, int n, cli_dump_mode mode)
{
    SIM_ASSERT(m);
    cfg_jw w;
    cfg_jw_init(&w);
    return dump_to_file(f, &w, dump_state(&w, m, p, n, mode));
}

sim_status cli_dump_logical(FILE *f, const cli_dump_param *p, int n, cli_dump_mode mode)
{
    cfg_jw w;
    cfg_jw_init(&w);
    return dump_to_file(f, &w, dump_state(&w, NULL, p, n, mode));
}

/* "deepseek/inputs: bfloat16[192,2048,2048]" */
static void activation_key(const cli_dump_activation *a, char *buf, size_t cap)
{
    size_t n = (size_t)snprintf(buf, cap, "%s: %s[", a->name, a->dtype);
    for (int d = 0; d < a->rank && n < cap; d++)
        n += (size_t)snprintf(buf + n, cap - n, "%s%lld", d ? "," : "", (long long)a->shape[d]);
    if (n < cap) snprintf(buf + n, cap - n, "]");
}

/* Python repr of a tuple of str/None: ('a', None), ('a',), (). */
static void logical_repr(const cli_dump_activation *a, char *buf, size_t cap)
{
    if (!a->logical_known) {
        snprintf(buf, cap, "Unknown");
        return;
    }
    size_t n = (size_t)snprintf(buf, cap, "(");
    for (int d = 0; d < a->rank && n < cap; d++) {
        if (a->logical[d]) n += (size_t)snprintf(buf + n, cap - n, "%s'%s'", d ? ", " : "", a->logical[d]);
        else n += (size_t)snprintf(buf + n, cap - n, "%sNone", d ? ", " : "");
    }
    if (n < cap) snprintf(buf + n, cap - n, "%s)", a->rank == 1 ? "," : "");
}

static sim_status dump_inputs(cfg_jw *w, const mesh_shape *m, const cli_dump_activation *a, int n)
{
    for (int i = 0; i < n; i++) {
        if (a[i].rank < 0 || a[i].rank > MESH_SPEC_MAX_RANK)
            return sim_err(SIM_ERR_INPUT, "sharding dump: activation '%s' has rank %d (at most %d)", a[i].name,
                           a[i].rank, MESH_SPEC_MAX_RANK);
        sim_status st = mesh_spec_check(&a[i].spec, m);
        if (st != SIM_OK) {
            sim_err_append(" (sharding dump activation '%s')", a[i].name);
            return st;
        }
    }
    char(*keys)[KEY_CAP] = calloc((size_t)n + 1, sizeof *keys);
    SIM_ASSERT(keys);
    cfg_jw_obj(w);
    cfg_jw_key(w, "Activation Sharding Dump");
    cfg_jw_arr(w);
    for (int i = 0; i < n; i++) {
        activation_key(&a[i], keys[i], KEY_CAP);
        int dup = 0;
        for (int j = 0; j < i && !dup; j++) dup = !strcmp(keys[i], keys[j]);
        if (dup) continue;
        char logic[KEY_CAP], spec[KEY_CAP];
        logical_repr(&a[i], logic, sizeof logic);
        mesh_spec_format(&a[i].spec, m, spec, (int)sizeof spec);
        cfg_jw_obj(w);
        cfg_jw_key(w, keys[i]);
        cfg_jw_obj(w);
        cfg_jw_key(w, "logic_axes");
        cfg_jw_str(w, logic);
        cfg_jw_key(w, "PartitionSpec");
        cfg_jw_str(w, spec);
        cfg_jw_end(w);
        cfg_jw_end(w);
    }
    cfg_jw_end(w);
    cfg_jw_end(w);
    free(keys);
    return SIM_OK;
}

sim_status cli_dump_inputs(FILE *f, const mesh_shape *m, const cli_dump_activation *a, int n)
{
    cfg_jw w;
    cfg_jw_init(&w);
    return dump_to_file(f, &w, dump_inputs(&w, m, a, n));
}

typedef struct {
    const mesh_shape *m;
    const cli_dump_param *p;
    int n;
    cli_dump_mode mode;
    const cli_dump_activation *a;
    int na;
} dump_args;

static sim_status write_named(FILE *f, void *arg)
{
    const dump_args *d = arg;
    return cli_dump_named(f, d->m, d->p, d->n, d->mode);
}

static sim_status write_logical(FILE *f, void *arg)
{
    const dump_args *d = arg;
    return cli_dump_logical(f, d->p, d->n, d->mode);
}

static sim_status write_inputs(FILE *f, void *arg)
{
    const dump_args *d = arg;
    return cli_dump_inputs(f, d->m, d->a, d->na);
}

/* shardings.json: the three documents under one object. */
static sim_status write_combined(FILE *f, void *arg)
{
    const dump_args *d = arg;
    cfg_jw w;
    cfg_jw_init(&w);
    cfg_jw_obj(&w);
    cfg_jw_key(&w, "named_shardings");
    sim_status st;
    SIM_TRY_GOTO(dump_state(&w, d->m, d->p, d->n, d->mode), st, fail);
    cfg_jw_key(&w, "logical_shardings");
    SIM_TRY_GOTO(dump_state(&w, NULL, d->p, d->n, d->mode), st, fail);
    cfg_jw_key(&w, "input_shardings");
    SIM_TRY_GOTO(dump_inputs(&w, d->m, d->a, d->na), st, fail);
    cfg_jw_end(&w);
    cfg_jw_write(&w, f, CFG_JW_INDENT2, 17);
    fputc('\n', f);
fail:
    if (st != SIM_OK) cfg_jw_discard(&w);
    return st;
}

sim_status cli_write_shardings_json(const char *dir, const mesh_shape *m, const cli_dump_param *params, int n_params,
                                    cli_dump_mode mode, const cli_dump_activation *acts, int n_act)
{
    dump_args d = {m, params, n_params, mode, acts, n_act};
    return cli_artifact_write(dir, "shardings.json", write_combined, &d);
}

sim_status cli_write_sharding_dump(const char *dir, const mesh_shape *m, const cli_dump_param *params, int n_params,
                                   cli_dump_mode mode, const cli_dump_activation *acts, int n_act)
{
    dump_args d = {m, params, n_params, mode, acts, n_act};
    SIM_TRY(cli_artifact_write(dir, "named_shardings.json", write_named, &d));
    SIM_TRY(cli_artifact_write(dir, "logical_shardings.json", write_logical, &d));
    if (n_act >= 0) SIM_TRY(cli_artifact_write(dir, "input_shardings.json", write_inputs, &d));
    return SIM_OK;
}

/* ======================================================================== */
/* parity.json                                                              */
/* ======================================================================== */

/* What one configuration costs: its mesh, memory per device (as metrics.json), the traffic of one
 * step (as traffic.csv, per device) and the step-time model's estimate when a profile was set. */
static void write_parity_costs(cfg_jw *w, const cli_parity_config *pc)
{
    if (pc->mesh) {
        cfg_jw_key(w, "mesh");
        cfg_jw_str(w, pc->mesh);
    }
    if (pc->mem && pc->n_devices > 0) {
        cfg_jw_key(w, "devices");
        cfg_jw_int(w, pc->n_devices);
        cfg_jw_key(w, "memory");
        memory_json(w, pc->mem, pc->n_devices);
    }
    if (pc->traffic) {
        const cli_traffic *t = pc->traffic;
        cfg_jw_key(w, "traffic");
        cfg_jw_obj(w);
        cfg_jw_key(w, "step");
        cfg_jw_int(w, t->steps.first);
        cfg_jw_key(w, "bytes_per_device");
        cfg_jw_double(w, t->total.bytes_mean);
        cfg_jw_key(w, "rows");
        cfg_jw_arr(w);
        for (int i = 0; i < t->n_rows; i++) {
            const cli_traffic_row *r = &t->rows[i];
            char ax[256];
            cfg_jw_obj(w);
            cfg_jw_key(w, "op");
            cfg_jw_str(w, sim_op_name(r->op));
            cfg_jw_key(w, "axes");
            cfg_jw_str(w, cli_axes_text(&t->mesh, r->axes, ax, sizeof ax));
            cfg_jw_key(w, "phase");
            cfg_jw_str(w, sim_phase_name(r->phase));
            cfg_jw_key(w, "calls_per_device");
            cfg_jw_double(w, t->n_devices ? (double)r->calls / t->n_devices : 0);
            cfg_jw_key(w, "bytes_per_device");
            cfg_jw_double(w, r->bytes_mean);
            cfg_jw_end(w);
        }
        cfg_jw_end(w);
        cfg_jw_end(w);
    }
    if (pc->step_time_model) {
        cfg_jw_key(w, "step_time_model");
        cfg_jw_tree(w, json_incref(pc->step_time_model));
    }
}

static sim_status write_parity(FILE *f, void *arg)
{
    const cli_parity *p = arg;
    cfg_jw w;
    cfg_jw_init(&w);
    cfg_jw_obj(&w);
    cfg_jw_key(&w, "rtol");
    cfg_jw_double(&w, p->rtol);
    cfg_jw_key(&w, "reference");
    cfg_jw_str(&w, p->n_configs ? p->configs[0].label : NULL);
    cfg_jw_key(&w, "configs");
    cfg_jw_arr(&w);
    for (int c = 0; c < p->n_configs; c++) {
        cfg_jw_obj(&w);
        cfg_jw_key(&w, "label");
        cfg_jw_str(&w, p->configs[c].label);
        cfg_jw_key(&w, "overrides");
        cfg_jw_str(&w, p->configs[c].overrides ? p->configs[c].overrides : "");
        write_parity_costs(&w, &p->configs[c]);
        cfg_jw_end(&w);
    }
    cfg_jw_end(&w);
    cfg_jw_key(&w, "steps");
    cfg_jw_arr(&w);
    double mx = 0;
    for (int i = 0; i < p->n_steps; i++) {
        int worst;
        double r = cli_parity_step_diff(p, i, &worst);
        if (r > mx) mx = r;
        cfg_jw_obj(&w);
        cfg_jw_key(&w, "step");
        cfg_jw_int(&w, p->first_step + i);
        cfg_jw_key(&w, "losses");
        cfg_jw_arr(&w);
        for (int c = 0; c < p->n_configs; c++) cfg_jw_double(&w, p->configs[c].losses[i]);
        cfg_jw_end(&w);
        cfg_jw_key(&w, "max_rel_diff");
        cfg_jw_double(&w, r);
        cfg_jw_key(&w, "worst_config");
        cfg_jw_str(&w, p->n_configs > 1 && r > 0 ? p->configs[worst].label : NULL);
        cfg_jw_key(&w, "pass");
        cfg_jw_bool(&w, r <= p->rtol);
        cfg_jw_end(&w);
    }
    cfg_jw_end(&w);
    int fail = cli_parity_first_failure(p);
    int failed = fail >= 0 || p->diverge_step >= 0 || p->diverge_param;
    cfg_jw_key(&w, "max_rel_diff");
    cfg_jw_double(&w, mx);
    cfg_jw_key(&w, "pass");
    cfg_jw_bool(&w, !failed);
    cfg_jw_key(&w, "first_diverging_step");
    if (p->diverge_step >= 0) cfg_jw_int(&w, p->diverge_step);
    else if (fail >= 0) cfg_jw_int(&w, p->first_step + fail);
    else cfg_jw_null(&w);
    cfg_jw_key(&w, "first_diverging_config");
    int worst = 0;
    if (fail >= 0) cli_parity_step_diff(p, fail, &worst);
    if (p->diverge_config) cfg_jw_str(&w, p->diverge_config);
    else if (fail >= 0 && worst > 0) cfg_jw_str(&w, p->configs[worst].label);
    else cfg_jw_null(&w);
    cfg_jw_key(&w, "first_diverging_param");
    cfg_jw_str(&w, p->diverge_param);
    cfg_jw_end(&w);
    cfg_jw_write(&w, f, CFG_JW_INDENT2, 17);
    fputc('\n', f);
    return SIM_OK;
}

sim_status cli_write_parity_json(const char *dir, const cli_parity *p)
{
    return cli_artifact_write(dir, "parity.json", write_parity, (void *)p);
}
